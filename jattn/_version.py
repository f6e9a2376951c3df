"""jattn's version, one home: the package exports it, tuning tables record it."""

__version__ = "0.1.0"
