"""Tuning tables: the chunked kernels' block sizes, schedule and step width, measured on your device.

The built-in defaults are measured on a CPU and reasoned for GPU and TPU. ``jattn-bench tune``
times the candidates for given shapes on the device at hand and writes a JSON table; jattn then
uses it for every call it covers that does not set the option itself::

    with jattn.tuning("h200-bf16.json"):         # or: JATTN_TUNING=h200-bf16.json python ...
      out = jattn.dot_product_attention(q, k, v, is_causal=True)

An entry is keyed by device kind (``jax.devices()[0].device_kind``), dtype, head dimension, mask
kind (``full``, ``causal``, ``window`` or ``masked``: any other mask) and length bucket (the
power of two at or above max(T, S)); it holds ``block_q``, ``block_kv``, ``schedule`` and
``step_width``, and ``implementation``: ``"cudnn"`` or ``"splash"`` where the device's fused
kernel beat jattn's kernels (``implementation=None`` then tries it first on its platform), or
``"chunked"``/``"dense"`` where jattn's kernels beat it (the fused kernel is then not tried;
see `jattn._dispatch.order`). Arguments given to the call always win; a table never changes results,
only how they are computed. A table that cannot be read is an error naming the file; one written by
another jattn version, or for other devices only, is used with a warning naming the file.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import hashlib
import json
import os
import warnings
from typing import Any, NamedTuple

import jax

from jattn import _registry
from jattn._version import __version__

ENV_VAR = "JATTN_TUNING"
FORMAT = "jattn-tuning-1"
_OPTIONS = ("block_q", "block_kv", "schedule", "step_width", "implementation")
# Splash's block sizes are multiples of the TPU's 128 lanes.
SPLASH_LANES = 128
_MASK_KINDS = ("full", "causal", "window", "masked")

_active: contextvars.ContextVar[TuningTable | None] = contextvars.ContextVar(
  "jattn_tuning", default=None
)
_env_cache: dict[tuple[str, float], TuningTable] = {}
# The active table's contents, as part of jax.jit's cache key: a function traced before a
# `tuning` block is traced again inside it (and once per table), so the table applies.
_in_jit_key = jax.make_user_context(None)


def length_bucket(T: int, S: int) -> int:
  """The power of two at or above max(T, S): calls of similar length share an entry."""
  n = max(int(T), int(S), 1)
  return 1 << (n - 1).bit_length()


def mask_kind(causal, window, masked: bool) -> str:
  """How a call masks, as a tuning key: masks change which blocks run, so the best blocks."""
  if masked:
    return "masked"
  if window is not None:
    return "window"
  return "causal" if causal is not None else "full"


@dataclasses.dataclass
class TuningTable:
  """Measured options per (device kind, dtype, head dim, mask kind, length bucket).

  ``entries`` maps a key string ``"device_kind|dtype|H|mask|bucket"`` to a dict of options. Use
  it as a context manager (``with table: ...``) or through `tuning`; ``to_json``/`load` write
  and read it.
  """

  entries: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
  jattn_version: str | None = None
  source: str | None = None  # the file it was read from, for messages
  _token: Any = dataclasses.field(default=None, repr=False, compare=False)
  _key: Any = dataclasses.field(default=None, repr=False, compare=False)

  @staticmethod
  def key(device_kind: str, dtype: str, head_dim: int, kind: str, bucket: int) -> str:
    return f"{device_kind}|{dtype}|{int(head_dim)}|{kind}|{int(bucket)}"

  def add(self, device_kind, dtype, head_dim, kind, bucket, **options) -> None:
    _check_options(options, where="TuningTable.add")
    self.entries[self.key(device_kind, str(dtype), head_dim, kind, bucket)] = dict(options)

  def lookup(self, device_kind, dtype, head_dim, kind, bucket) -> dict[str, Any] | None:
    return self.entries.get(self.key(device_kind, str(dtype), head_dim, kind, bucket))

  def to_json(self) -> str:

    return json.dumps(
      {
        "format": FORMAT,
        "jattn_version": self.jattn_version or __version__,
        "entries": self.entries,
      },
      indent=1,
      sort_keys=True,
    )

  def save(self, path) -> None:
    with open(path, "w") as f:
      f.write(self.to_json() + "\n")

  def __enter__(self):
    self._token = _active.set(self)
    digest = hashlib.sha256(json.dumps(self.entries, sort_keys=True).encode()).hexdigest()
    self._key = _in_jit_key(digest)
    self._key.__enter__()
    return self

  def __exit__(self, *exc):
    self._key.__exit__(*exc)
    _active.reset(self._token)
    return False


def _check_options(options, where):
  for name, value in options.items():
    if name not in _OPTIONS:
      raise ValueError(f"{where}: unknown option {name!r}; known: {_OPTIONS}")
    if name == "schedule":
      if value not in ("serial", "parallel"):
        raise ValueError(f"{where}: schedule must be 'serial' or 'parallel', got {value!r}")
    elif name == "implementation":
      # A fused kernel of the registry measured faster than jattn's kernels, or "chunked" /
      # "dense" measured faster than the fused kernel implementation=None would try first.
      known = _registry.fused() + ("chunked", "dense")
      if value not in known:
        raise ValueError(f"{where}: implementation must be one of {known}, got {value!r}")
    elif value is not None and (
      isinstance(value, bool) or not isinstance(value, int) or value <= 0
    ):
      raise ValueError(f"{where}: {name} must be a positive int or null, got {value!r}")


def load(path) -> TuningTable:
  """Read a table written by `TuningTable.save` (``jattn-bench tune``); errors name the file."""
  path = os.fspath(path)
  try:
    with open(path) as f:
      data = json.load(f)
  except OSError as e:
    raise ValueError(f"jattn tuning table {path!r} cannot be read: {e}") from None
  except json.JSONDecodeError as e:
    raise ValueError(f"jattn tuning table {path!r} is not valid JSON: {e}") from None
  if not isinstance(data, dict) or data.get("format") != FORMAT:
    raise ValueError(
      f"jattn tuning table {path!r}: expected a JSON object with "
      f"\"format\": {FORMAT!r} (written by jattn-bench tune), got "
      f"{type(data).__name__ if not isinstance(data, dict) else data.get('format')!r}"
    )
  entries = data.get("entries")
  if not isinstance(entries, dict):
    raise ValueError(f"jattn tuning table {path!r}: \"entries\" must be an object")
  for key, options in entries.items():
    parts = key.split("|")
    if (
      len(parts) != 5
      or not parts[2].isdigit()
      or not parts[4].isdigit()
      or parts[3] not in _MASK_KINDS
      or not isinstance(options, dict)
    ):
      raise ValueError(
        f"jattn tuning table {path!r}: malformed entry {key!r}: {options!r} "
        f"(keys are 'device_kind|dtype|head_dim|mask_kind|length_bucket')"
      )
    _check_options(options, where=f"jattn tuning table {path!r}, entry {key!r}")

  version = data.get("jattn_version")
  if version != __version__:
    warnings.warn(
      f"jattn tuning table {path!r} was written by jattn {version}, this is "
      f"{__version__}: its choices are used, but may no longer be the best; "
      f"re-run jattn-bench tune",
      stacklevel=2,
    )
  return TuningTable(entries=entries, jattn_version=version, source=path)


@contextlib.contextmanager
def tuning(table_or_path):
  """Use a tuning table (a `TuningTable` or the path of one) for the calls inside the block."""
  table = table_or_path if isinstance(table_or_path, TuningTable) else load(table_or_path)
  with table:
    yield table


def active() -> TuningTable | None:
  """The table in use: the innermost `tuning` block's, else the file named by $JATTN_TUNING
  (read once per file version), else None."""
  table = _active.get()
  if table is not None:
    return table
  path = os.environ.get(ENV_VAR)
  if not path:
    return None
  try:
    stamp = os.path.getmtime(path)
  except OSError as e:
    raise ValueError(f"${ENV_VAR}={path!r}: the tuning table cannot be read: {e}") from None
  if (path, stamp) not in _env_cache:
    _env_cache[(path, stamp)] = load(path)
  return _env_cache[(path, stamp)]


class Tuned(NamedTuple):
  """The options a call runs with: its own, else a tuning table's."""

  block_q: int | None = None
  block_kv: int | None = None
  schedule: str | None = None
  step_width: int | None = None
  # The fused kernel a tuning table found fastest on this device for the call (implementation
  # None only): tried first on its platform.
  implementation: str | None = None
  # (block_q, block_kv) for splash: the caller's, else a tuning table's where they are
  # multiples of 128 (`jattn-bench tune` times splash with those), else splash's default.
  splash_blocks: tuple[int | None, int | None] = (None, None)


def resolve(fingerprint_, given, implementation, kind, dtype, H, T, S) -> Tuned:
  """The options a call runs with: ``given`` (block_q, block_kv, schedule, step_width), what
  they leave open filled from the active table when the call's ``fingerprint_`` (of that table,
  see `fingerprint`) is not None. Read while the call is traced."""
  table = {} if fingerprint_ is None else options_for(dtype, H, kind, T, S)
  pick = [
    g if g is not None else table.get(n)
    for g, n in zip(given, ("block_q", "block_kv", "schedule", "step_width"))
  ]
  return Tuned(
    block_q=pick[0],
    block_kv=pick[1],
    schedule=pick[2],
    step_width=pick[3],
    implementation=table.get("implementation") if implementation is None else None,
    splash_blocks=(
      splash_block(given[0], table.get("block_q")),
      splash_block(given[1], table.get("block_kv")),
    ),
  )


def fingerprint() -> str | None:
  """The identity of the active table's contents (None without one). A call's static options
  carry it, so that a jitted call is traced again when the table it reads changes (a `tuning`
  block's table is in jit's key anyway; $JATTN_TUNING's is not)."""
  table = active()
  if table is None:
    return None
  return hashlib.sha256(json.dumps(table.entries, sort_keys=True).encode()).hexdigest()


def options_for(dtype, head_dim: int, kind: str, T: int, S: int) -> dict[str, Any]:
  """The active table's options for a call (empty when none applies), for this process's
  device kind. Warns when the table has entries only for other devices."""
  table = active()
  if table is None:
    return {}
  device_kind = jax.devices()[0].device_kind
  found = table.lookup(device_kind, str(dtype), head_dim, kind, length_bucket(T, S))
  if (
    found is None
    and table.entries
    and not any(k.startswith(device_kind + "|") for k in table.entries)
  ):
    warnings.warn(
      f"jattn tuning table {table.source or '(in memory)'!r} has no entry for this "
      f"device ({device_kind!r}): its options are not used",
      stacklevel=3,
    )
  return dict(found or {})


def splash_block(given: int | None, tuned: int | None) -> int | None:
  """The block size splash runs with: the one the call gives, else a tuning table's where it is
  a multiple of 128 (the table's sizes are measured for jattn's kernels, and splash is timed
  with them only then: see `jattn.bench.tune`), else None (splash's default)."""
  if given is not None:
    return given
  return tuned if tuned is not None and tuned % SPLASH_LANES == 0 else None
