"""The feature matrix: every implementation x every option (x every mesh and sharding, in
tests/support/_matrix_worker.py), each either equal to the float64 reference or refused with a named
NotImplementedError -- no other exception passes.

Both lists are data: an implementation joins by being in jattn's registry
(`jattn._registry.REGISTRY`; the chunked kernels once per schedule; not those that serve one kind
of call only, `Backend.only`), an option by a row in
OPTIONS. Shapes are small (B=4, T=S=32, N=8, K=4, H=8: every dimension a sharding splits is a
multiple of 4) and the chunked blocks smaller still (8), so every case has several blocks, a
ragged mask and more than one query head per key/value head.

The reference is tests/support/reference.py's float64 autodiff (`attention_vjp`), dropout's
keep-mask tests/support/dropout_reference.py (written from docs/dropout.md). Nothing here calls
jattn's internals except to read its list of implementations.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import dropout_reference
import jax
import jax.numpy as jnp
import numpy as np
import reference as ref
import selections

B, T, S, N, K, H = 4, 32, 32, 8, 4, 8
BLOCKS = dict(block_q=8, block_kv=8)


def implementations() -> dict[str, dict]:
  """name -> dot_product_attention keywords, from jattn's registry of implementations."""
  from jattn import _registry
  from jattn._chunked import plan as _plan

  out = {"None": dict(implementation=None)}
  for name, backend in _registry.REGISTRY.items():
    if backend.only is not None:
      continue  # one kind of call only (the sparse path): its own tests
    if name == "chunked":
      for schedule in _plan.SCHEDULES:
        out[f"chunked-{schedule}"] = dict(implementation="chunked", schedule=schedule, **BLOCKS)
    else:
      out[name] = dict(implementation=name)
  return out


def platform_of(impl: str):
  """The platforms an implementation lowers for (None: every one)."""
  from jattn import _registry

  return None if impl == "None" else _registry.platforms(impl.split("-")[0])


@dataclasses.dataclass(frozen=True)
class Option:
  """One option of the call. ``arrays``: name -> (NumPy array, dimension letters over
  B T S N K, '_' for a dimension of its own); the arrays travel as arguments of the jitted call
  (sharded like the inputs where a letter is sharded). ``call(arrays) -> kwargs`` of
  dot_product_attention (``bias`` among them); ``diff``: the arrays differentiated; ``ref``:
  keywords of reference.attention_vjp (``visible`` from ``mask_kw``, given to
  reference.visible_mask)."""

  call: Callable
  arrays: dict = dataclasses.field(default_factory=dict)
  diff: tuple = ()
  mask_kw: dict = dataclasses.field(default_factory=dict)
  ref: Callable = lambda arrays: {}


def _rng(seed):
  return np.random.default_rng(seed)


def _alibi(s, b, h, qi, ki):
  return s - 0.1 * (h + 1).astype(s.dtype) * jnp.abs(qi - ki).astype(s.dtype)


def _table_mod(table):
  # A relative-position table gathered by (q - k), closed over (a learned parameter).
  return lambda s, b, h, qi, ki: s + table[h, qi - ki + S].astype(s.dtype)


_Q_LEN = np.array([T, 5, 17, 0], np.int32)  # an example with no queries
_KV_LEN = np.array([S, 3, 0, 20], np.int32)  # an example with no keys
_SEG = np.stack([(np.arange(T) >= c).astype(np.int32) for c in (0, 10, 20, 31)])
_MASK = _rng(4).random((B, 1, T, S)) < 0.7
# Positions: per example a left-padded cache (its positions start after pad slots, the pads at
# position 0) or a restart (two packed sequences); the queries are the last T keys' positions.
_KV_POS = np.stack(
  [
    np.concatenate([np.zeros(p), np.arange(S - p)])
    if p >= 0
    else np.concatenate([np.arange(-p), np.arange(S + p)])
    for p in (0, 6, 13, -11)
  ]
).astype(np.int32)
_Q_POS = _KV_POS[:, S - T :]
_POS_VIS = (_KV_POS[:, None, None, :] <= _Q_POS[:, None, :, None]) & (
  _KV_POS[:, None, None, :] >= _Q_POS[:, None, :, None] - 7
)
_RATE = 0.25
# Packed prefix trees (RL rollouts), one per example, in depth-first order: a prompt with a
# response that branches and a second response; a GRPO group; two trees (a forest); a chain.
_PARENTS = np.array([[-1, 0, 1, 0], [-1, 0, 0, 0], [-1, 0, -1, 2], [-1, 0, 1, 2]], np.int32)
_NODES = np.stack(
  [
    np.concatenate([np.repeat(np.arange(4), lens), np.full(T - sum(lens), -1)])
    for lens in ([8, 6, 5, 7], [5, 9, 9, 9], [10, 3, 4, 1], [2, 2, 2, 2])
  ]
).astype(np.int32)


def _tree_visible():
  """(B, 1, T, S): row i sees key j iff j <= i and j's node is i's or an ancestor of it."""
  vis = np.zeros((B, 1, T, S), bool)
  for b in range(B):
    for i in range(T):
      node = _NODES[b, i]
      path = set()
      while node >= 0:
        path.add(node)
        node = _PARENTS[b, node]
      for j in range(i + 1):
        vis[b, 0, i, j] = _NODES[b, j] in path
  return vis


# Learned sparse attention's choices: per example, row and KV head 3 key blocks of 4 (some slots
# -1, so some rows choose nothing visible under causal).
_SEL = selections.indices(_rng(7), B, T, K, 3, S, 4)

OPTIONS: dict[str, Option] = {
  "plain": Option(call=lambda a: {}),
  "bias": Option(
    call=lambda a: dict(bias=a["bias"]),
    arrays={"bias": (_rng(1).standard_normal((B, N, T, S)), "BNTS")},
    diff=("bias",),
    ref=lambda a: dict(bias=a["bias"]),
  ),
  "bias-broadcast": Option(
    call=lambda a: dict(bias=a["bias"]),
    arrays={"bias": (_rng(2).standard_normal((1, N, 1, S)), "_N_S")},
    diff=("bias",),
    ref=lambda a: dict(bias=a["bias"]),
  ),
  "bias+masks": Option(
    call=lambda a: dict(
      bias=a["bias"],
      is_causal=True,
      key_value_seq_lengths=a["kv_len"],
      q_segment_ids=a["seg"],
      kv_segment_ids=a["seg"],
    ),
    arrays={
      "bias": (_rng(3).standard_normal((B, N, T, S)), "BNTS"),
      "kv_len": (_KV_LEN, "B"),
      "seg": (_SEG, "BT"),
    },
    diff=("bias",),
    mask_kw=dict(causal="top_left", kv_lengths=_KV_LEN, q_seg=_SEG, kv_seg=_SEG),
    ref=lambda a: dict(bias=a["bias"]),
  ),
  "causal": Option(call=lambda a: dict(is_causal=True), mask_kw=dict(causal="top_left")),
  "window": Option(call=lambda a: dict(local_window_size=(5, 2)), mask_kw=dict(window=(5, 2))),
  "causal-window": Option(
    call=lambda a: dict(is_causal=True, local_window_size=(7, 0)),
    mask_kw=dict(causal="top_left", window=(7, 0)),
  ),
  "lengths": Option(
    call=lambda a: dict(query_seq_lengths=a["q_len"], key_value_seq_lengths=a["kv_len"]),
    arrays={"q_len": (_Q_LEN, "B"), "kv_len": (_KV_LEN, "B")},
    mask_kw=dict(q_lengths=_Q_LEN, kv_lengths=_KV_LEN),
  ),
  "segment-ids": Option(
    call=lambda a: dict(q_segment_ids=a["seg"], kv_segment_ids=a["seg"]),
    arrays={"seg": (_SEG, "BT")},
    mask_kw=dict(q_seg=_SEG, kv_seg=_SEG),
  ),
  "mask-array": Option(
    call=lambda a: dict(mask=a["mask"]), arrays={"mask": (_MASK, "B_TS")}, mask_kw=dict(mask=_MASK)
  ),
  "positions": Option(
    call=lambda a: dict(
      is_causal=True, local_window_size=(7, 0), q_positions=a["q_pos"], kv_positions=a["kv_pos"]
    ),
    arrays={"q_pos": (_Q_POS, "BT"), "kv_pos": (_KV_POS, "BS")},
    mask_kw=dict(mask=_POS_VIS),
  ),
  "mask-object": Option(
    call=lambda a: dict(mask=_mask_object()), mask_kw=dict(causal="top_left", window=(5, 5))
  ),
  "selection": Option(
    call=lambda a: dict(mask=_selected(a["sel"]), is_causal=True),
    arrays={"sel": (_SEL, "BTK_")},
    mask_kw=dict(causal="top_left", mask=selections.by_hand(_SEL, 4, N, T, S)),
  ),
  "prefix-tree": Option(
    call=lambda a: dict(mask=_prefix_tree(a["parents"], a["nodes"])),
    arrays={"parents": (_PARENTS, "B_"), "nodes": (_NODES, "BT")},
    mask_kw=dict(mask=_tree_visible()),
  ),
  "soft-cap": Option(call=lambda a: dict(logits_soft_cap=2.0), ref=lambda a: dict(soft_cap=2.0)),
  "sinks": Option(
    call=lambda a: dict(sinks=a["sinks"], is_causal=True),
    arrays={"sinks": (np.linspace(-1.0, 1.0, N), "N")},
    diff=("sinks",),
    mask_kw=dict(causal="top_left"),
    ref=lambda a: dict(sinks=a["sinks"]),
  ),
  "dropout": Option(
    call=lambda a: dict(dropout_rate=_RATE, dropout_rng=jax.random.key(5), is_causal=True),
    mask_kw=dict(causal="top_left"),
    ref=lambda a: dict(
      dropout_rate=_RATE, keep=dropout_reference.keep_mask(jax.random.key(5), _RATE, B, N, T, S)
    ),
  ),
  "score-mod": Option(
    call=lambda a: dict(score_mod=_alibi), ref=lambda a: dict(make_score_mod=lambda args: _alibi)
  ),
  "score-mod-table": Option(
    call=lambda a: dict(score_mod=_table_mod(a["table"]), is_causal=True),
    # Never sharded ("__"): the score_mod indexes it with the user's own gather, which
    # under an Explicit mesh cannot read a sharded operand with replicated indices (that
    # is the user's array and code, as it would be without jattn).
    arrays={"table": (_rng(6).standard_normal((N, T + S)), "__")},
    diff=("table",),
    mask_kw=dict(causal="top_left"),
    ref=lambda a: dict(make_score_mod=lambda args: _table_mod(args[0]), score_args=(a["table"],)),
  ),
}


def rotation(outer, inner, turned) -> list[tuple]:
  """A covering design of three factors: rows (inner value, outer value, turned value) in which,
  for every value of ``outer``, every value of ``inner`` and every value of ``turned`` stands
  once or more, ``turned`` shifted by one against ``inner`` from one value of ``outer`` to the
  next (a Latin square's rows). Every pair of values of two factors meets when ``outer`` has at
  least as many values as ``turned``; the rows number len(outer) x max(len(inner),
  len(turned)), and each value of ``inner`` meets each of ``turned`` on about
  len(outer) / len(turned) values of ``outer``: spread evenly, where a greedy design
  (tests/support/covering.py) gives the first value of ``inner`` most of them."""
  assert len(outer) >= len(turned), (outer, turned)
  return [
    (inner[r % len(inner)], o, turned[(r + i) % len(turned)])
    for i, o in enumerate(outer)
    for r in range(max(len(inner), len(turned)))
  ]


# Under meshes (tests/support/_matrix_worker.py): the kind of mesh, and which dimensions are
# sharded.
MESHES = ("auto", "explicit")
LAYOUTS = ("batch", "heads", "sequence")


def sharded_design() -> list[tuple[str, str, str, str]]:
  """(mesh, layout, implementation, option) rows of the matrix under meshes, a covering design
  instead of the product: every option under every mesh and layout (one of jattn's own
  implementations or None takes it; `rotation` turns them so that each takes every option and
  every placement), and each kernel that only refuses on a CPU every option once (the
  placements turned). Splash is not among them: Pallas's interpret mode cannot run a kernel on
  several host devices at once."""
  impls = implementations()
  own = [i for i in impls if platform_of(i) is None]
  refusing = [i for i in impls if platform_of(i) is not None and i != "splash"]
  placements = [(m, lay) for m in MESHES for lay in LAYOUTS]
  rows = [(*p, impl, o) for p, o, impl in rotation(list(OPTIONS), placements, own)]
  for i, impl in enumerate(refusing):
    for o, option in enumerate(OPTIONS):
      rows.append((*placements[(i + o) % len(placements)], impl, option))
  return rows


def _selected(indices):
  from jattn import masks

  return masks.selected_blocks(indices, 4)


def _prefix_tree(parents, nodes):
  from jattn import masks

  return masks.prefix_tree(parents, nodes).mask


def _mask_object():
  from jattn import masks

  return masks.causal() & masks.local_window(5)


def inputs(dtype=np.float32):
  """q, k, v and the output cotangent, in ``dtype``."""
  rng = _rng(0)
  shapes = [(B, T, N, H), (B, S, K, H), (B, S, K, H), (B, T, N, H)]
  return tuple(rng.standard_normal(s).astype(dtype) for s in shapes)


def option_arrays(name, dtype=np.float32):
  """The option's arrays, floating ones in ``dtype``."""
  out = {}
  for key, (x, _) in OPTIONS[name].arrays.items():
    x = np.asarray(x)
    out[key] = x.astype(dtype) if np.issubdtype(x.dtype, np.floating) else x
  return out


def reference(name):
  """The float64 (out, grads) of option ``name``: grads a dict of dq, dk, dv and each
  differentiated option array."""
  opt = OPTIONS[name]
  q, k, v, do = inputs(np.float64)
  arrays = option_arrays(name, np.float64)
  vis = ref.visible_mask(B, N, T, S, **opt.mask_kw)
  out, _, g = ref.attention_vjp(q, k, v, do, visible=vis, **opt.ref(arrays))
  grads = dict(dq=g["dq"], dk=g["dk"], dv=g["dv"])
  for d in opt.diff:
    grads[d] = {"bias": g["dbias"], "sinks": g["dsinks"]}.get(d)
    if d == "table":
      grads[d] = g["dargs"][0]
  return out, grads


def loss_and_grads(impl_kw, name):
  """f(q, k, v, do, arrays) -> (out, grads dict): the call and the VJP of sum(out * do)."""
  import jattn

  opt = OPTIONS[name]

  def f(q, k, v, do, arrays):
    def attend(q, k, v, diffs):
      kw = opt.call({**arrays, **diffs})
      return jattn.dot_product_attention(q, k, v, **kw, **impl_kw)

    diffs = {d: arrays[d] for d in opt.diff}
    out, pull = jax.vjp(attend, q, k, v, diffs)
    dq, dk, dv, dd = pull(do)
    return out, dict(dq=dq, dk=dk, dv=dv, **dd)

  return f


def check(name, out, grads, want, tol):
  """Equal to the float64 reference within ``tol`` relative to max(1, max |reference|)."""
  want_out, want_grads = want
  pairs = [("out", out, want_out)] + [(g, grads[g], want_grads[g]) for g in want_grads]
  for what, got, w in pairs:
    got = np.asarray(got, np.float64)
    w = np.asarray(w, np.float64)
    assert got.shape == w.shape, (name, what, got.shape, w.shape)
    assert np.isfinite(got).all(), f"{name}: {what} is not finite"
    err = float(np.abs(got - w).max())
    bound = tol * max(1.0, float(np.abs(w).max()))
    assert err <= bound, f"{name}: {what} differs from the float64 reference by {err:.3e}"
