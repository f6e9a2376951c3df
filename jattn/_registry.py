"""The registry of implementations: one table, read by the dispatcher, tuning tables and ring.

Each implementation is one `Backend`: its name, the platforms it lowers for, what it supports
(a function of the bound call returning None or the reason it cannot take it, which becomes the
call's `NotImplementedError`) and how it runs. jattn's own are registered by `jattn._backends`;
adding one is a module with its ``run`` (and ``supports``) and one `register` call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


def _takes_everything(call) -> None:
  return None


@dataclasses.dataclass(frozen=True)
class Backend:
  """One implementation of attention.

  ``run(call) -> (out (B, T, N, Hv) in the query dtype, lse (B, T, N) float32[, max logits])`` for a bound call
  (`jattn._call.Call`), with jattn's semantics (empty rows 0, lse carrying its gradient).
  ``platforms``: the platforms it lowers for (None: every one, as XLA programs do); a sequence of
  names falls through one lowered for another platform than the program's.
  ``supports(call) -> None | str``: None, or what it cannot take and why ("bias: the fused kernel
  has no such input"), checked before ``run`` (``run`` may still raise NotImplementedError for
  what it finds only while tracing).
  ``fused``: a platform's fused kernel: a tuning table may name it, and ``implementation=None``
  tries it first where the table measured it faster.
  ``first(call) -> bool``: ``implementation=None`` tries it first on its platforms where this
  holds (splash on a TPU, cuDNN on a GPU, for the calls they take; ``call.static.split`` says
  whether the program can be partitioned), falling back to jattn's kernels.
  ``traced_cheaply(call) -> bool``: whether trying it costs nothing much while tracing
  (splash evaluates a mask it cannot build lazily into a (T, S) array per head): required before
  ``implementation=None`` puts it first, by a tuning table or by ``first``.
  ``ring``: None where ring attention can run it on each pair of shards, else why not.
  ``traced_mask``: it builds its kernels from the mask while the call is traced, so a NumPy
  boolean mask given for it becomes part of the program (`jattn._call.static_mask`).
  ``only``: None for a general implementation; for one that serves a single kind of call, which
  (the sparse path: calls with a `masks.selected_blocks` selection). It refuses every other call,
  and the feature matrix (every option on every implementation) leaves it to its own tests.
  ``max_logits``: None where ``run`` also returns each row's max logit over its visible keys
  (B, T, N) when the call asks (``return_max_logits``), else why not; the dispatcher refuses
  such a call for it (NotImplementedError), so a sequence or ``None`` falls through.
  """

  name: str
  run: Callable[[Any], tuple]
  platforms: tuple[str, ...] | None = None
  supports: Callable[[Any], str | None] = _takes_everything
  fused: bool = False
  first: Callable[[Any], bool] | None = None
  traced_cheaply: Callable[[Any], bool] = lambda call: True
  ring: str | None = None
  traced_mask: bool = False
  aliases: tuple[str, ...] = ()
  only: str | None = None
  max_logits: str | None = "its kernel does not return its running max"


REGISTRY: dict[str, Backend] = {}
_ALIASES: dict[str, str] = {}


def register(backend: Backend) -> Backend:
  """Add ``backend`` to the table (replacing one of the same name); returns it."""
  if not isinstance(backend, Backend):
    raise TypeError(f"register takes a jattn Backend, got {type(backend).__name__}")
  REGISTRY[backend.name] = backend
  for alias in backend.aliases:
    _ALIASES[alias] = backend.name
  return backend


def unregister(name: str) -> None:
  """Remove the backend ``name`` (and its aliases) from the table."""
  REGISTRY.pop(name, None)
  for alias in [a for a, n in _ALIASES.items() if n == name]:
    del _ALIASES[alias]


def canonical(name: str) -> str:
  """The registered name for ``name`` or one of its aliases ("xla" is "dense")."""
  return _ALIASES.get(name, name)


def names() -> tuple[str, ...]:
  """Every name a call may give, aliases included, in registration order."""
  out = []
  for name, backend in REGISTRY.items():
    out += [name, *backend.aliases]
  return tuple(out)


def get(name: str) -> Backend:
  return REGISTRY[canonical(name)]


def fused() -> tuple[str, ...]:
  """The fused kernels' names, sorted (what a tuning table may name)."""
  return tuple(sorted(n for n, b in REGISTRY.items() if b.fused))


def platforms(name: str) -> tuple[str, ...] | None:
  return get(name).platforms
