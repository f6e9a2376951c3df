"""jattn's Pallas paged kernels -- TPU (`jattn._paged.pallas_tpu`, Mosaic) and GPU
(`jattn._paged.pallas_gpu`, Triton) -- against the float64 reference.

The kernels run here in Pallas's interpret mode (TPU: `force_tpu_interpret_mode`; GPU:
`jattn._lowering.gpu_interpret_mode`): the very kernel a TPU or GPU gets, its grid walked on the
CPU. Their lowerings (Pallas to Mosaic, Pallas to Triton) are made from this CPU; what
`implementation=None` picks is read from the lowered programs.
"""

from __future__ import annotations

import covering
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from accelerators import abstract_gpu
from covering import pairwise
from jax.experimental.pallas import tpu as pltpu
from paged_reference import check, combined, head_major, normal, options, pool, reference

import jattn
from jattn import _lowering

N, K, H = 4, 2, 16  # the GPU kernel (Triton) takes head sizes that are powers of two >= 16
KERNELS = {"tpu": pltpu.force_tpu_interpret_mode, "gpu": _lowering.gpu_interpret_mode}
LAYOUTS = ["NHD", "HND", "combined"]
# PAGES: the tests' pages hold 16 keys (64 and 256 where longer pages are the point): several
# pages to a step of either kernel, partial last pages, tables of a few pages. The TPU kernel's
# interpret mode compiles in a time that grows with the pages a step reads (a table's width),
# so the sequences span few pages each.


@pytest.fixture(params=sorted(KERNELS))
def kernel(request):
  return request.param


def _pallas(kernel, q, kp, vp, table, lens, layout="NHD", **kw):
  """paged_attention through the Pallas kernel on the NHD pools given, laid out as asked."""
  if layout == "HND":
    kp, vp, ks, vs = head_major(kp, vp, kw.pop("k_scale", None), kw.pop("v_scale", None))
    kw.update({} if ks is None else dict(k_scale=ks, v_scale=vs))
  elif layout == "combined":
    kp, vp = combined(kp, vp), None
  with KERNELS[kernel]():
    return jattn.paged_attention(
      q, kp, vp, table, jnp.asarray(lens), kv_layout=layout, implementation="pallas", **kw
    )


OPTIONS = {
  "window_scale": dict(local_window_size=(6, 0), scale=0.3),
  "softcap_sinks_noncausal": dict(logits_soft_cap=2.0, sinks=True, is_causal=False),
}
# Each kernel in every layout and with each set of options, each set of options in every layout:
# 6 calls for the 12 combinations.
OPTION_ROWS = pairwise({"kernel": sorted(KERNELS), "layout": LAYOUTS, "options": list(OPTIONS)})


@pytest.mark.parametrize("row", OPTION_ROWS, ids=covering.ids(OPTION_ROWS))
def test_options_in_every_layout(row):
  kernel, layout, kw = row["kernel"], row["layout"], OPTIONS[row["options"]]
  B, T, ps = 3, 3, 16  # pages of 16: several to a step of either kernel (PAGES above)
  lens = np.array([30, 6, 19])
  kp, vp, table = pool(40, 16, ps, K, H, H, B, lens)
  q = normal(41, (B, T, N, H))
  kw, ref_kw = options(kw, N)
  out, lse = _pallas(kernel, q, kp, vp, table, lens, layout, return_residual=True, **kw)
  want, want_lse = reference(q, kp, vp, table, lens, **ref_kw)
  check(out, want)
  check(lse, want_lse)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_ragged_prefill_and_decode_with_empty_sequences(kernel, layout):
  # A prefill chunk of 21 rows (two tiles), decode tokens, a sequence with no new rows and one
  # with an empty cache; a value head size of its own; a trailing row of no sequence.
  Hv, ps = 32, 16
  lens = np.array([40, 9, 17, 0, 3])
  counts = np.array([21, 1, 0, 0, 1])
  qs = np.concatenate([[0], np.cumsum(counts)])
  kp, vp, table = pool(42, 24, ps, K, H, Hv, 5, lens)
  q = normal(43, (int(qs[-1]) + 1, N, H))
  out, lse = _pallas(
    kernel,
    q,
    kp,
    vp,
    table,
    lens,
    layout,
    query_start=jnp.asarray(qs),
    local_window_size=(7, 0),
    return_residual=True,
  )
  want, want_lse = reference(q, kp, vp, table, lens, qs, window=(7, 0))
  check(np.asarray(out)[:-1], want[:-1])
  assert (np.asarray(out)[-1] == 0).all()
  finite = np.isfinite(want_lse[:-1])
  check(np.where(finite, lse[:-1], 0), np.where(finite, want_lse[:-1], 0))


@pytest.mark.parametrize(
  "dtype, kind, layout",
  [
    (jnp.int8, "token", "NHD"),
    (jnp.int8, "head", "HND"),
    (jnp.int8, "token", "combined"),
    (jnp.float8_e4m3fn, "token", "HND"),
    (jnp.float8_e5m2, "tensor", "NHD"),
  ],
)
def test_quantized_pages(kernel, dtype, kind, layout):
  B, T, ps, P = 2, 2, 16, 12
  lens = np.array([41, 20])
  kp, vp, table = pool(44, P, ps, K, H, H, B, lens, garbage=False)
  top = 127.0 if dtype == jnp.int8 else float(jnp.finfo(dtype).max)
  reduce = {
    "tensor": lambda a: a.max(),
    "head": lambda a: a.max(axis=(0, 1)),
    "token": lambda a: a,
  }[kind]
  ks = reduce(np.abs(np.asarray(kp)).max(-1)) / top
  vs = reduce(np.abs(np.asarray(vp)).max(-1)) / top
  quant = lambda x, s: jnp.asarray(
    np.clip(
      (np.round if dtype == jnp.int8 else np.asarray)(
        np.asarray(x) / np.broadcast_to(s, x.shape[:3])[..., None]
      ),
      -top,
      top,
    )
  ).astype(dtype)
  kq, vq = quant(kp, ks), quant(vp, vs)
  q = normal(45, (B, T, N, H))
  ks, vs = jnp.asarray(ks, jnp.float32), jnp.asarray(vs, jnp.float32)
  out = _pallas(kernel, q, kq, vq, table, lens, layout, k_scale=ks, v_scale=vs, logits_soft_cap=5.0)
  want, _ = reference(
    q,
    kq.astype(jnp.float32),
    vq.astype(jnp.float32),
    table,
    lens,
    ks=np.asarray(ks),
    vs=np.asarray(vs),
    cap=5.0,
  )
  check(out, want)


def test_bfloat16_within_rounding_of_the_exact_answer(kernel):
  # 16-bit pools and queries, float32 statistics: the error against float64 stays within a
  # small factor of rounding the exact answer to bfloat16 (16-bit arithmetic would not). Pages
  # of 64 keys: the TPU kernel reads 4 of them a step (not 14 of 16 keys), and its
  # interpret mode compiles in a time that grows with the pages a step reads.
  B, T, ps = 2, 4, 64
  lens = np.array([200, 77])
  kp, vp, table = pool(46, 8, ps, K, H, H, B, lens, garbage=False)
  q = normal(47, (B, T, N, H))
  q, kp, vp = (x.astype(jnp.bfloat16) for x in (q, kp, vp))
  out = _pallas(kernel, q, kp, vp, table, lens, "HND")
  assert out.dtype == jnp.bfloat16
  want, _ = reference(q, kp, vp, table, lens)
  err = np.abs(np.asarray(out, np.float64) - want).max()
  rounding = np.abs(np.asarray(jnp.asarray(want, jnp.bfloat16), np.float64) - want).max()
  assert err <= 2 * rounding, (err, rounding)


def test_long_pages_and_faulty_metadata(kernel):
  # Pages of 256 keys (one page a grid step); under jit with traced metadata a sequence whose
  # page id is out of the pool comes back NaN, the others exact.
  B, T, ps = 3, 2, 256
  lens = np.array([700, 64, 301])
  kp, vp, table = pool(48, 9, ps, K, H, H, B, lens)
  q = normal(49, (B, T, N, H))
  bad = np.array(table)
  bad[2, 1] = 9  # sequence 2's second page: past the pool
  with KERNELS[kernel]():
    f = jax.jit(
      lambda t: jattn.paged_attention(
        q, kp, vp, t, jnp.asarray(lens), local_window_size=(300, 0), implementation="pallas"
      )
    )
    out = np.asarray(f(jnp.asarray(bad)))
  want, _ = reference(q, kp, vp, table, lens, window=(300, 0))
  assert np.isnan(out[2]).all()
  check(out[:2], want[:2])


TRITON = "__gpu$xla.gpu.triton"


def _lowered(f, *args, platform):
  """The program lowered for ``platform``: exported (tpu, cpu), or lowered through jit for
  cuda (jax.export refuses Triton's custom call without being told: README). Triton's lowering
  reads the GPU it compiles for: from a CPU, jax 0.12 wants it named by an abstract device."""
  if platform != "cuda":
    return jax.export.export(jax.jit(f), platforms=[platform])(*args).mlir_module()
  args = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in args]
  with abstract_gpu():
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_the_choice_is_made_where_the_program_is_lowered():
  lens = np.array([30, 6])
  kp, vp, table = pool(50, 16, 8, K, H, H, 2, lens)
  q = jnp.ones((2, 1, N, H))
  args = (q, kp, vp, table, jnp.asarray(lens))
  call = lambda impl: lambda *a: jattn.paged_attention(*a, implementation=impl)
  kernels = lambda impl, platform: {
    name: _lowered(call(impl), *args, platform=platform).count(name)
    for name in ("tpu_custom_call", TRITON)
  }
  # None: the Pallas kernel on a TPU or GPU, the XLA walk elsewhere; "chunked": never a kernel.
  assert kernels(None, "tpu") == {"tpu_custom_call": 1, TRITON: 0}
  assert kernels(None, "cuda") == {"tpu_custom_call": 0, TRITON: 1}
  assert kernels("pallas", "tpu") == {"tpu_custom_call": 1, TRITON: 0}
  assert kernels("pallas", "cuda") == {"tpu_custom_call": 0, TRITON: 1}
  for platform in ("tpu", "cuda", "cpu"):
    assert kernels("chunked", platform) == {"tpu_custom_call": 0, TRITON: 0}
    if platform == "cpu":
      assert kernels(None, platform) == {"tpu_custom_call": 0, TRITON: 0}
  # Exported for cuda, the kernel's custom call must be allowed by name.
  with abstract_gpu():
    exp = jax.export.export(
      jax.jit(call(None)),
      platforms=["cuda"],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)],
    )(*[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in args])
  assert exp.mlir_module().count(TRITON) == 1
  # "pallas" lowered for a CPU outside interpret mode: an error naming the way out.
  with pytest.raises(NotImplementedError, match="implementation='pallas'.*force_tpu_interpret"):
    _lowered(call("pallas"), *args, platform="cpu")
  # A head size Triton cannot take: None keeps the XLA walk on a GPU; "pallas" says why not.
  q6 = jnp.ones((2, 1, N, 8))
  kp6, vp6 = kp[..., :8], vp[..., :8]
  six = (q6, kp6, vp6, table, jnp.asarray(lens))
  assert TRITON not in _lowered(call(None), *six, platform="cuda")
  assert "tpu_custom_call" in _lowered(call(None), *six, platform="tpu")
  with pytest.raises(NotImplementedError, match="H=8: Triton"):
    _lowered(call("pallas"), *six, platform="cuda")
  # A symbolic number of sequences: None keeps the XLA walk; "pallas" says why not.
  b = jax.export.symbolic_shape("b")[0]
  sds = jax.ShapeDtypeStruct
  shapes = (
    sds((b, 1, N, H), jnp.float32),
    kp,
    vp,
    sds((b, table.shape[1]), jnp.int32),
    sds((b,), jnp.int32),
  )
  for platform in ("tpu", "cuda"):
    exp = jax.export.export(jax.jit(call(None)), platforms=[platform])(*shapes)
    assert "custom_call" not in exp.mlir_module().replace(
      "stablehlo.custom_call @shape_assertion", ""
    )
  with pytest.raises(NotImplementedError, match="symbolic number of sequences"):
    _lowered(call("pallas"), *shapes, platform="tpu")


def test_interpret_mode_refuses_what_the_kernel_cannot_take_as_the_device_would():
  """In the GPU kernel's interpret mode a call Triton cannot take (H = 8) runs the XLA walk for
  None and is refused by name for "pallas", as lowered for a GPU (it was a TypeError from
  functools.partial over the reason string; mypy found it)."""
  lens = np.array([5, 9])
  kp, vp, table = pool(51, 8, 4, K, 8, 8, 2, lens)
  q = normal(52, (2, 1, N, 8))
  args = (q, kp, vp, table, jnp.asarray(lens))
  want = jattn.paged_attention(*args, implementation="chunked")
  with _lowering.gpu_interpret_mode():
    np.testing.assert_array_equal(jattn.paged_attention(*args), want)
    with pytest.raises(NotImplementedError, match="pallas.*cuda cannot take H=8: Triton"):
      jattn.paged_attention(*args, implementation="pallas")
