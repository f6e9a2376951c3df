"""One page (or block) of keys folded into a tile's running softmax: the arithmetic that the
paged walks share -- the XLA walk (`jattn._paged.walk`) and the Pallas kernels
(`jattn._paged.pallas_tpu`, `jattn._paged.pallas_gpu`) -- so that a rule (which keys a row sees,
where the scale and the soft cap apply, why hidden values are zeroed) is written once.

Positions, not indices: a tile row at position ``pos`` sees key position ``key`` if the key is
cached (``key < kv_len``), the row is real, and causality and the window allow it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jattn import _softmax, _tile, masks


def visible(st, key, pos, real, kv_len, slot=None):
  """Which keys each row sees (broadcasting bool): ``key`` key positions, ``pos`` the rows'
  positions, ``real`` whether a row holds a query, ``kv_len`` the sequence's cached tokens;
  ``slot`` the keys' places in the cache where they differ from their positions (a tree of new
  tokens: their positions are depths, their slots follow each other)."""
  cached = (key if slot is None else slot) < kv_len
  return real & cached & masks.visible_by_position(pos, key, st.causal, st.window)


def scores(st, s, ks, vis):
  """Raw float32 products q . k as logits: the key scale (quantised pages), the logit scale,
  the soft cap, and NEG where the key is hidden (`jattn._softmax`'s stand-in for -inf)."""
  if ks is not None:
    s = s * ks
  s, _ = _tile.scale_cap_bias(st.cfg, s, None)
  return jnp.where(vis, s, jnp.asarray(_softmax.NEG, s.dtype))


def fold_page(st, carry, q, keys, values, ks, vs, vis):
  """A kernel's step: one page's keys (bk, H) and values (bk, Hv) into the running
  (m (R,), l (R,), acc (R, Hv)) of R query rows q (R, H); ``ks``/``vs`` the page's scales
  (None, a scalar or (1, bk)), ``vis`` (R, bk)."""
  m, l, acc = carry
  if ks is not None or st.upcast:
    keys, q = keys.astype(jnp.float32), q.astype(jnp.float32)
  s = jax.lax.dot_general(
    q, keys.astype(q.dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
  )
  m, p, corr, l = _softmax.update(
    m, l, scores(st, s, ks, vis), total=lambda p, axes: p.sum(axis=axes)
  )
  if vs is not None:  # sum_j p_j (s_j v_j) = sum_j (p_j s_j) v_j
    p = p * vs
  if vs is not None or st.upcast:
    values = values.astype(jnp.float32)
  # A hidden key's weight is an exact 0, but 0 * NaN is NaN: garbage past a sequence's end
  # (an unwritten slot, a page of another use) must not leak, so its value is zeroed.
  # (A max over rows, not `any`: Triton's lowering has no boolean reduction.)
  seen = jnp.max(vis.astype(jnp.int32), axis=0) > 0
  values = jnp.where(seen[:, None], values, jnp.zeros((), values.dtype))
  pv = jax.lax.dot_general(
    p.astype(values.dtype), values, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
  )
  return m, l, acc * corr[:, None] + pv
