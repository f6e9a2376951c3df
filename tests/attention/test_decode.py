"""Decoding-shaped calls: a few new queries (T = 1, 2, 7) against a longer KV cache.

The parallel schedule splits such a call's single row of key blocks over lanes side by side
(split-KV) and merges them by log-sum-exp; the serial schedule walks the blocks; dense is one tile.
Each is compared with the float64 reference (forward, lse, and the gradients of q, k, v and the
sinks) on a ragged cache length (S not a multiple of the block) with per-example fill levels as a
run-time `masks.causal(offset=...)`, bottom-right causality with a window, sinks, soft cap, GQA, and
an example whose cache is empty (its rows 0, their gradients 0). Which implementation
`implementation=None` picks for a decoding step is read from the programs it compiles, here and
exported for cuda and tpu (last test); tests/flax/test_generate.py decodes with it.
"""

import covering
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from covering import pairwise

import jattn
from jattn import masks
from jattn._chunked import plan as _plan
from jattn.bench import structure

B, K, G, H, S = 3, 2, 3, 8, 300
N = K * G
BLOCK_KV = 32  # 10 key blocks (the last ragged): the split schedule deals them over 10 lanes

IMPLEMENTATIONS = {
  "dense": dict(implementation="dense"),
  "serial": dict(implementation="chunked", schedule="serial", block_kv=BLOCK_KV),
  "split": dict(implementation="chunked", schedule="parallel", block_kv=BLOCK_KV),
  # At most 3 lanes per step: the row is split over 3 lanes, dealt unevenly (static lanes of
  # 4, 4 and 2 blocks; at run time 4 steps, the last partly padding).
  "split_width3": dict(
    implementation="chunked", schedule="parallel", block_kv=BLOCK_KV, step_width=3
  ),
}


def _problem(T, seed=0):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(B, T, N, H)).astype(np.float32)
  k = rng.normal(size=(B, S, K, H)).astype(np.float32)
  v = rng.normal(size=(B, S, K, H)).astype(np.float32)
  do = rng.normal(size=(B, T, N, H)).astype(np.float32)
  return q, k, v, do


def _cases(T):
  """name -> (jattn keyword arguments, the (B, N, T, S) visibility they define)."""
  t = np.arange(T)[:, None]
  s = np.arange(S)[None, :]
  # Per-example fill levels of the cache before this step: the new queries sit at positions
  # fill .. fill + T - 1 and see every key up to their own; example 2's cache holds nothing
  # (fill 0, and no valid key: its length is 0, so its rows are empty).
  fill = np.array([S - T, 117, 0], np.int32)
  valid = np.array([S, 117 + T, 0], np.int32)
  fill_vis = np.zeros((B, N, T, S), bool)
  for b in range(B):
    fill_vis[b] = (s <= t + fill[b]) & (s < valid[b])
  window_vis = ref.visible_mask(B, N, T, S, causal="bottom_right", window=(50, 0))
  return {
    "fill_levels": (
      dict(mask=masks.causal(offset=jnp.asarray(fill)) & masks.lengths(None, jnp.asarray(valid))),
      fill_vis,
    ),
    "lengths_sinks": (
      dict(key_value_seq_lengths=jnp.asarray(valid), sinks=jnp.linspace(-1.0, 1.0, N)),
      ref.visible_mask(B, N, T, S, kv_lengths=valid),
    ),
    "bottom_right_window_softcap": (
      dict(is_causal="bottom_right", local_window_size=(50, 0), logits_soft_cap=2.0),
      window_vis,
    ),
  }


# Every pair of new tokens T, case and implementation together once (the 3-lane grouping only
# at T = 7: it does not depend on T): 13 compiled programs instead of the 30 of the product.
ROWS = pairwise(
  {"T": [1, 2, 7], "case": list(_cases(1)), "impl": list(IMPLEMENTATIONS)},
  allowed=lambda row: row["impl"] != "split_width3" or row["T"] == 7,
)


@pytest.mark.parametrize("row", ROWS, ids=covering.ids(ROWS))
def test_decoding_steps_match_reference(row):
  T, case, impl = row["T"], row["case"], row["impl"]
  q, k, v, do = _problem(T)
  kw, vis = _cases(T)[case]
  ikw = IMPLEMENTATIONS[impl]
  sinks = kw.get("sinks")
  want, want_lse, cache = ref.attention(
    q,
    k,
    v,
    visible=vis,
    soft_cap=kw.get("logits_soft_cap"),
    sinks=None if sinks is None else np.asarray(sinks),
  )
  dq_w, dk_w, dv_w, _, ds_w = ref.grads(cache, do)
  rows = np.isfinite(want_lse)

  def f(q, k, v, sinks):
    extra = dict(kw, sinks=sinks)
    return jattn.dot_product_attention(q, k, v, return_residual=True, **extra, **ikw)

  @jax.jit
  def forward_and_grads(q, k, v, sinks, do):  # one program: one compile per case
    (out, lse), pull = jax.vjp(f, q, k, v, sinks)
    return out, lse, pull((do, jnp.zeros_like(lse)))

  args = (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), sinks, jnp.asarray(do))
  out, lse, (dq, dk, dv, ds) = forward_and_grads(*args)
  msg = f"T={T} {case} {impl}"
  np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5, err_msg=msg)
  np.testing.assert_allclose(
    np.asarray(lse)[rows], want_lse[rows], rtol=2e-5, atol=2e-5, err_msg=msg
  )
  assert np.all(np.asarray(out)[~rows.any(axis=(1, 2))] == 0), msg  # empty cache: 0
  for name, got, w in (("dq", dq, dq_w), ("dk", dk, dk_w), ("dv", dv, dv_w)):
    np.testing.assert_allclose(got, w, rtol=2e-4, atol=2e-5, err_msg=f"{name} {msg}")
  if sinks is not None:
    np.testing.assert_allclose(ds, ds_w, rtol=2e-4, atol=2e-5, err_msg=f"dsinks {msg}")


def test_split_kv_lanes_of_a_decoding_step():
  # One row of 10 key blocks is dealt over min(SPLIT_KV_PARTS, blocks) lanes; a prefill-sized
  # call (T x G rows above DECODE_MAX_ROWS) or one with several query blocks keeps one lane per
  # row.
  cfg = lambda T: jattn._tile.Config(
    B=B, T=T, S=S, K=K, G=G, H=H, scale=1.0, logits_soft_cap=None, dropout_rate=0.0
  )
  plan, _ = _plan.make_plan(cfg(1), None, 1, BLOCK_KV, "parallel")
  ln = _plan.lanes_of(plan.row_lanes)
  assert plan.row_split == 10 and ln.columns.shape == (10, 1)
  assert sorted(ln.columns[:, 0].tolist()) == list(range(10))
  plan, _ = _plan.make_plan(cfg(1), None, 1, BLOCK_KV, "parallel", width=4)
  assert plan.row_split == 4 and _plan.lanes_of(plan.row_lanes).columns.shape == (4, 3)
  plan, _ = _plan.make_plan(cfg(100), None, 100, BLOCK_KV, "parallel")  # 300 rows
  assert plan.row_split == 1 and _plan.lanes_of(plan.row_lanes).columns.shape == (1, 10)
  plan, _ = _plan.make_plan(cfg(8), None, 4, BLOCK_KV, "parallel")  # two query blocks
  assert plan.row_split == 1
  # A run-time map (fill levels given as arrays): each row's blocks dealt in turn, so its
  # steps are ceil(count / lanes) however many blocks it turns out to hold.
  states = jnp.asarray(np.array([[2] * 7 + [0] * 3, [2] * 10, [0] * 10], np.int8))
  ln, steps = _plan.run_time_lanes(states, 4)
  assert int(steps) == 3 and ln.columns.shape == (12, 3)
  np.testing.assert_array_equal(np.asarray(ln.rows)[:, 0], np.repeat([0, 1, 2], 4))
  live = np.asarray(ln.kinds) != 0
  np.testing.assert_array_equal(live.sum(axis=1), [2, 2, 2, 1, 3, 3, 2, 2, 0, 0, 0, 0])
  cols = np.asarray(ln.columns)
  assert sorted(cols[:4][live[:4]].tolist()) == list(range(7))


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_decoding_step_lowered_for_an_accelerator(platform):
  # What a GPU or TPU runs for one decoding step (B = 4, N = 32, K = 8, H = 128, bf16) against
  # a 16384-key cache: implementation=None picks the chunked kernels there (dense would
  # transpose the whole cache each step), their parallel schedule splits the cache over 16 lanes:
  # 64 key blocks of 256 in 4 sequential steps instead of 64; nothing of the cache's size but
  # the cache itself. On this CPU a bfloat16 step stays dense (measured faster here).
  Sc = 16384
  q = jax.ShapeDtypeStruct((4, 1, 32, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((4, Sc, 8, 128), jnp.bfloat16)
  f = lambda q, k, v: jattn.dot_product_attention(q, k, v, is_causal="bottom_right")
  hlo = structure.lowered_for(f, (q, kv, kv), platform)
  st = structure.loop_structure(hlo)
  assert st.steps == Sc // (256 * _plan.SPLIT_KV_PARTS) == 4, st
  assert structure.loop_structure(structure.lowered_for(f, (q, kv, kv))).loops == 0  # CPU: dense
  f32 = (q.update(dtype=jnp.float32),) + (kv.update(dtype=jnp.float32),) * 2
  assert structure.loop_structure(structure.lowered_for(f, f32)).steps == Sc // 256  # CPU: serial
