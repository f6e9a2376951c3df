"""implementation="sparse" under plain `jit` on several devices (XLA's partitioner).

Its loop over the examples, left to the partitioner, needed every example on every device (the
whole batch computed on each, the output replicated). Through the partitioning rule's operation
(`jattn._parallel.partition`, rows and keys kept whole) each device runs its own examples and KV
heads. Here: on 4 host devices in a subprocess, batch- and head-sharded calls equal the
unsharded one (forward, lse and the gradients of q, k, v and the sinks), keep the query's
sharding, and move nothing but the selection's indices (gathered) and at most N numbers added
over the devices (the loss's sums, the sinks' gradient); a sequence-sharded query is gathered
and still equal; forward mode (jvp) equals the unsharded one; inside a `jax.shard_map` over
the examples (its mesh axes checked) it equals too; under an Explicit mesh batch- and
head-sharded calls run per device and equal, sequence-sharded ones are refused by name
(NotImplementedError). And in this process, one device
made to look like four: the operation's plain computation (forward, the backward from the saved
output and lse, and forward mode) equals the kernels as ordinary code.
"""

import subprocess
import sys
import textwrap

import pytest

WORKER = textwrap.dedent('''
    import os, re
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=4")
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, jax.numpy as jnp, numpy as np, jattn
    from jattn import masks as M
    from jax.sharding import NamedSharding, PartitionSpec as P

    B, T, N, K, H, n, block = 4, 64, 8, 4, 8, 3, 8
    rng = np.random.default_rng(0)
    q, do = (jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32) for _ in "qd")
    k, v = (jnp.asarray(rng.standard_normal((B, T, K, H)), jnp.float32) for _ in "kv")
    sinks = jnp.asarray(rng.standard_normal(N), jnp.float32)
    idx = np.full((B, T, K, n), -1, np.int32)
    for b in range(B):
      for t in range(T):
        for h in range(K):
          idx[b, t, h] = np.sort(rng.choice(T // block, n, replace=False))
    idx = jnp.asarray(idx)

    def loss(q, k, v, sinks, idx):
      out, lse = jattn.dot_product_attention(
          q, k, v, mask=M.selected_blocks(idx, block), is_causal=True, sinks=sinks,
          return_residual=True, implementation="sparse")
      return (out * do).sum() + jnp.sin(lse).sum(), (out, lse)

    fn = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)
    with jattn.auto_partitioning(False):
      want = jax.jit(fn)(q, k, v, sinks, idx)
    mesh = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    failures = []
    for where, spec in (("batch", P("x")), ("heads", P(None, None, "x")), ("rows", P(None, "x"))):
      put = lambda x: jax.device_put(x, NamedSharding(mesh, spec))
      args = (put(q), put(k), put(v), sinks, put(idx) if where != "heads" else idx)
      f = jax.jit(fn)
      got = f(*args)
      (_, (out, lse)), grads = got
      try:
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
          np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
        if where != "rows":
          assert out.sharding.spec == spec, out.sharding
          text = f.lower(*args).compile().as_text()
          # Added over devices: the loss's sums and the sinks' gradient (at most N numbers).
          added = re.findall(r"= \\w+\\[([\\d,]*)\\][^ ]* all-reduce(?:-start)?\\(", text)
          assert all(np.prod([int(d) for d in a.split(",") if d]) <= N for a in added), added
          gathered = re.findall(r"= (\\w+)\\[([\\d,]*)\\][^ ]* all-gather(?:-start)?\\(", text)
          assert all(t == "s32" for t, _ in gathered), gathered  # the indices only
        # Forward mode: JAX's tangent of the plain computation, partitioned by XLA.
        tangent = lambda q, k, v: jax.jvp(lambda q: loss(q, k, v, sinks, idx)[0], (q,), (q,))
        with jattn.auto_partitioning(False):
          want_t = jax.jit(tangent)(q, k, v)
        got_t = jax.jit(tangent)(*args[:3])
        np.testing.assert_allclose(np.asarray(got_t), np.asarray(want_t), rtol=1e-5, atol=1e-4)
      except AssertionError as e:
        failures.append(f"{where}: {str(e)[:300]}")
    # Inside the user's shard_map over the examples (its axes checked: a loop's carry varies
    # like the inputs): each device's examples whole, equal, forward and gradients. (Without
    # sinks: replicated parameters get a gradient that varies over the map's axes, which a
    # checked shard_map refuses from a custom rule; check_vma=False takes them.)
    def plain(q, k, v, idx, do):
      out, lse = jattn.dot_product_attention(
          q, k, v, mask=M.selected_blocks(idx, block), is_causal=True, return_residual=True,
          implementation="sparse")
      return (out * do).sum() + jnp.sin(lse).sum()

    g = jax.grad(plain, argnums=(0, 1, 2))
    with jattn.auto_partitioning(False):
      want_g = jax.jit(g)(q, k, v, idx, do)
    part = jax.shard_map(g, mesh=mesh, in_specs=(P("x"),) * 5, out_specs=(P("x"),) * 3)
    try:
      for a, b in zip(jax.jit(part)(q, k, v, idx, do), want_g):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    except Exception as e:
      failures.append(f"shard_map: {type(e).__name__}: {str(e)[:300]}")
    # Sharding in types (an Explicit mesh): batch- or head-sharded, each device's examples and
    # heads inside a shard_map, equal (forward, lse, grads with the sinks'), sharded as the
    # query, nothing but the indices and sinks gathered; sequence-sharded, refused by name.
    explicit = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    for where, spec in (("batch", P("x")), ("heads", P(None, None, "x"))):
      with jax.set_mesh(explicit):
        put = lambda x: jax.device_put(x, NamedSharding(explicit, spec))
        args = (put(q), put(k), put(v), sinks, put(idx) if where == "batch" else idx)
        f = jax.jit(fn)
        try:
          got = f(*args)
          for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
          (_, (out, _)), grads = got
          like = NamedSharding(explicit, spec)
          for x in (out, grads[0]):
            assert x.sharding.is_equivalent_to(like, x.ndim), x.sharding
          text = f.lower(*args).compile().as_text()
          gathered = re.findall(r"= (\\w+)\\[([\\d,]*)\\][^ ]* all-gather(?:-start)?\\(", text)
          assert all(t == "s32" or d == str(N) for t, d in gathered), gathered
        except Exception as e:
          failures.append(f"Explicit mesh, {where}: {type(e).__name__}: {str(e)[:300]}")
    with jax.set_mesh(explicit):
      args = [jax.device_put(x, NamedSharding(explicit, P(None, "x"))) for x in (q, k, v)]
      try:
        jax.jit(fn)(*args, sinks, idx)
        failures.append("Explicit mesh, rows: no error")
      except NotImplementedError as e:
        if "Explicit mesh" not in str(e):
          failures.append(f"Explicit mesh, rows: {e}")
    assert not failures, failures
    print("OK")
''')


@pytest.mark.slow
def test_batch_and_head_sharded_calls_run_per_device_and_equal_the_unsharded_call():
  r = subprocess.run([sys.executable, "-c", WORKER], capture_output=True, text=True, timeout=600)
  assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


def test_the_partitioned_operation_unpartitioned_equals_the_kernels(monkeypatch):
  import jax
  import jax.numpy as jnp
  import numpy as np
  from selections import indices

  import jattn
  from jattn import masks as M
  from jattn._parallel import partition as _partition

  B, T, N, K, H, n, block = 2, 40, 4, 2, 8, 3, 4
  rng = np.random.default_rng(1)
  q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
  k, v = (jnp.asarray(rng.standard_normal((B, T, K, H)), jnp.float32) for _ in "kv")
  sinks = jnp.linspace(-1.0, 2.0, N)
  idx = indices(rng, B, T, K, n, T, block)

  def loss(q, k, v, sinks):
    out, lse = jattn.dot_product_attention(
      q,
      k,
      v,
      mask=M.selected_blocks(idx, block),
      is_causal=True,
      key_value_seq_lengths=jnp.array([40, 23]),
      logits_soft_cap=3.0,
      sinks=sinks,
      return_residual=True,
      implementation="sparse",
    )
    weights = jnp.cos(jnp.arange(out.size).reshape(out.shape))
    return (out * weights).sum() + jnp.sin(lse).sum()

  grad = jax.grad(loss, argnums=(0, 1, 2, 3))
  # Forward mode too (the operation alone is a custom VJP, which jvp cannot go through).
  tangents = (jnp.cos(q), jnp.sin(k), v, jnp.ones_like(sinks))
  jvp = lambda *a: jax.jvp(loss, a, tangents)
  with jattn.auto_partitioning(False):
    want = jax.jit(grad)(q, k, v, sinks) + jax.jit(jvp)(q, k, v, sinks)
  calls = []
  applies = _partition.applies
  monkeypatch.setattr(jax, "device_count", lambda: 4)
  monkeypatch.setattr(_partition, "applies", lambda *a: calls.append(1) or applies(*a))
  got = jax.jit(grad)(q, k, v, sinks) + jax.jit(jvp)(q, k, v, sinks)
  assert calls and applies(None, ())  # the operation was used
  for a, b in zip(got, want):
    assert np.isfinite(np.asarray(a)).all()
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
