"""The Mask protocol: the base class every mask kind subclasses (what it evaluates, its block
summary, its checks and the questions kernels and the parallel layer ask of it), `Cut` (a device's
examples and heads, the argument of `Mask.take_part`), the pytree registration the kinds share,
and the combinations `&`, `|` and `~` (which the protocol's operators build, so they live here and
the package stays acyclic)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jattn.masks._grid import BlockGrid, _TableGrid


class Mask:
  """Base class. Subclasses are frozen dataclasses and JAX pytrees (arrays are leaves).

  Subclasses implement:
    evaluate(q_pos, kv_pos, shape): bool array broadcastable to (B, N, len(q_pos), len(kv_pos)),
      where q_pos (tq,) and kv_pos (tk,) are int32 absolute positions (possibly traced) and
      shape = (B, N, T, S) is the full problem.
    block_states(grid, shape): int8 array broadcastable to (B, N, nq, nk); a NumPy array when
      the summary is known at trace time, a jax array otherwise. The grid's ranges and block
      tables (`BlockGrid.q_ranges`, `q_blocks`, ...) are NumPy arrays for a call's own grid,
      and jax arrays when the blocks sit at run-time positions (ring attention, `remap`).
    validate(shape): raise ValueError/TypeError, at trace time, if the mask's arrays do not fit
      the call's (B, N, T, S) (same messages as the keyword arguments); masks without arrays
      fit every call.
  """

  def evaluate(self, q_pos, kv_pos, shape):  # pragma: no cover - abstract
    raise NotImplementedError

  def validate(self, shape) -> None:
    del shape

  def check_known(self, shape) -> None:
    """Checks of values the mask's arrays hold, run before the call is traced (where they are
    still known; inside it they are tracers): ValueError naming the argument. ``shape`` is the
    call's (B, N, T, S). By default none."""
    del shape

  def block_states(self, grid: BlockGrid | _TableGrid, shape):  # pragma: no cover - abstract
    raise NotImplementedError

  # What kernels and the parallel layer ask of a mask. The defaults fit a mask that is a function
  # of positions and heads holding no arrays; kinds that differ override them.

  def conjuncts(self) -> tuple[Mask, ...]:
    """The masks ANDed together to make this one (itself, unless it is an AND)."""
    return (self,)

  def band(self) -> tuple[int | None, int | None] | None:
    """(lo, hi) when this mask is the diagonal band q + lo <= k <= q + hi (None: that side
    open), else None: a kernel with its own causal or window masks takes it as one of those."""
    return None

  def ids(self) -> tuple[str, Any, Any] | None:
    """("lengths", q_lengths, kv_lengths) or ("segments", q_ids, kv_ids) for the masks made of
    per-example arrays (a kernel may take them as ids), else None."""
    return None

  def selection(self) -> tuple[Any, int] | None:
    """(the choices (B|1, T, K, n) sorted along n, block size) for learned sparse attention's
    selection (`selected_blocks`: the sparse path gathers what it names), else None."""
    return None

  def is_position_based(self) -> bool:
    """Whether this mask is a function of (batch, head, position) indices alone -- everything
    but an array laid out over the whole (T, S), which a shard's positions cannot index without
    gathering it."""
    return True

  def can_take_part(self) -> bool:
    """Whether `take_part` knows where each of this mask's arrays keeps its batch and head axes
    (by default: it holds none, so it is the same on every part)."""
    return not jax.tree.leaves(self)

  def take_part(self, cut: Cut) -> Mask:
    """This mask on one device's examples and heads (``cut``), positions unchanged."""
    return self

  def shift_indices(self, batch0, head0) -> Mask:
    """This mask with its local example and head 0 at global ``batch0`` and ``head0``."""
    return self

  def unshifted(self) -> Mask:
    """This mask with any shift of its example and head indices dropped (a single-device call
    whose shift reached it traced, see `jattn._backends.splash`)."""
    return self

  def __and__(self, other: Mask) -> Mask:
    _check_is_mask(other, "&")
    return _And(self, other)

  def __or__(self, other: Mask) -> Mask:
    _check_is_mask(other, "|")
    return _Or(self, other)

  def __invert__(self) -> Mask:
    return _Not(self)

  def __bool__(self):
    raise TypeError(
      f"The truth value of a jattn mask ({type(self).__name__}) is ambiguous: use `m1 & m2` or "
      "`m1 | m2` to combine masks, not `and`/`or`."
    )


def _check_is_mask(other, op):
  if not isinstance(other, Mask):
    raise TypeError(f"mask {op} needs another jattn mask, got {type(other).__name__}")


@dataclasses.dataclass(frozen=True)
class Cut:
  """Examples batch0 .. batch0 + nb - 1 and query heads head0 .. head0 + nh - 1 of a problem of
  B examples and N heads (``batch0`` and ``head0`` may be traced)."""

  batch0: Any
  nb: int
  head0: Any
  nh: int
  B: int
  N: int

  def examples(self, x, axis: int = 0):
    return _cut(x, axis, self.batch0, self.nb, self.B)

  def heads(self, x, axis: int = 1):
    return _cut(x, axis, self.head0, self.nh, self.N)


def _cut(x, axis, start, n, whole):
  if x is None or n == whole or jnp.ndim(x) <= axis or jnp.shape(x)[axis] != whole:
    return x  # absent, not split, or broadcast along this axis
  return jax.lax.dynamic_slice_in_dim(jnp.asarray(x), start, n, axis)


def _register(cls, data_fields=()):
  """Frozen dataclass + pytree: `data_fields` are array leaves, the rest is static structure."""
  meta = [f.name for f in dataclasses.fields(cls) if f.name not in data_fields]
  return jax.tree_util.register_dataclass(cls, data_fields=list(data_fields), meta_fields=meta)


# --------------------------------------------------------------------------------------------
# Combinations.
# --------------------------------------------------------------------------------------------


def _combine(op, a, b):
  """Combine block states; stays NumPy when both sides are static."""
  xp = np if isinstance(a, np.ndarray) and isinstance(b, np.ndarray) else jnp
  if op == "and":
    return xp.minimum(a, b)
  return xp.maximum(a, b)


class _Composite(Mask):
  """A mask made of masks (`&`, `|`, `~`): each question goes to its parts."""

  __slots__ = ()

  def parts(self) -> tuple[Mask, ...]:  # pragma: no cover - abstract
    raise NotImplementedError

  def rebuilt(self, parts) -> Mask:  # pragma: no cover - abstract
    raise NotImplementedError

  def validate(self, shape):
    for m in self.parts():
      m.validate(shape)

  def check_known(self, shape):
    for m in self.parts():
      m.check_known(shape)

  def is_position_based(self):
    return all(m.is_position_based() for m in self.parts())

  def can_take_part(self):
    return all(m.can_take_part() for m in self.parts())

  def take_part(self, cut):
    return self.rebuilt([m.take_part(cut) for m in self.parts()])

  def shift_indices(self, batch0, head0):
    return self.rebuilt([m.shift_indices(batch0, head0) for m in self.parts()])

  def unshifted(self):
    return self.rebuilt([m.unshifted() for m in self.parts()])


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _And(_Composite):
  a: Mask
  b: Mask

  def parts(self):
    return self.a, self.b

  def rebuilt(self, parts):
    return _And(*parts)

  def conjuncts(self):
    return self.a.conjuncts() + self.b.conjuncts()

  def evaluate(self, q_pos, kv_pos, shape):
    return self.a.evaluate(q_pos, kv_pos, shape) & self.b.evaluate(q_pos, kv_pos, shape)

  def block_states(self, grid, shape):
    return _combine("and", self.a.block_states(grid, shape), self.b.block_states(grid, shape))

  def __hash__(self):
    return hash(("and", self.a, self.b))


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _Or(_Composite):
  a: Mask
  b: Mask

  def parts(self):
    return self.a, self.b

  def rebuilt(self, parts):
    return _Or(*parts)

  def evaluate(self, q_pos, kv_pos, shape):
    return self.a.evaluate(q_pos, kv_pos, shape) | self.b.evaluate(q_pos, kv_pos, shape)

  def block_states(self, grid, shape):
    return _combine("or", self.a.block_states(grid, shape), self.b.block_states(grid, shape))

  def __hash__(self):
    return hash(("or", self.a, self.b))


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _Not(_Composite):
  a: Mask

  def parts(self):
    return (self.a,)

  def rebuilt(self, parts):
    return _Not(*parts)

  def evaluate(self, q_pos, kv_pos, shape):
    return ~self.a.evaluate(q_pos, kv_pos, shape)

  def block_states(self, grid, shape):
    st = self.a.block_states(grid, shape)
    return (2 - st).astype(np.int8) if isinstance(st, np.ndarray) else (2 - st).astype(jnp.int8)

  def __hash__(self):
    return hash(("not", self.a))


# Combinations hold masks, which may hold arrays: their children are pytree leaves-or-nodes.
jax.tree_util.register_dataclass(_And, data_fields=["a", "b"], meta_fields=[])
jax.tree_util.register_dataclass(_Or, data_fields=["a", "b"], meta_fields=[])
jax.tree_util.register_dataclass(_Not, data_fields=["a"], meta_fields=[])
