"""Sharded inputs under plain `jit`, on 4 host devices in a subprocess.

Explicit-axis mesh (sharding in types): batch-, head- and sequence-sharded calls of every
implementation (the chunked kernels in both schedules, and a decoding step split over lanes)
equal the unsharded call, forward and gradients, and the output keeps the query's sharding.

Auto mesh (the compiler propagates shardings), and plain jit with no mesh set: dense and both
chunked schedules (called plainly, and through `jax.sharding.explicit_axes`), with every kind of
mask input and option: every call equals the unsharded one, forward and gradients; batch- and
head-sharded calls run without any collective; a sequence-sharded GQA query stays sharded: K
and V are each gathered once, the dK/dV partial sums all-reduced, and no query- or output-sized
array moves (read from the compiled program of forward and backward together). Also
implementation=None, a (data, sequence) mesh, `jax.vmap` of a sharded call, and `jax.export`
with `jattn.auto_partitioning(False)`.
"""

import textwrap

import pytest
from _subprocess import run_source

WORKER = textwrap.dedent('''
    import contextlib, functools, os
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=4")
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, jax.numpy as jnp, numpy as np, jattn
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    import reference as ref  # tests/support, on the path (`run_source`)
    from jattn.bench import structure
    B, N, K, H = 4, 8, 4, 8  # GQA: a gathered K or V is not query-sized
    mesh = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Explicit,))
    failures = []

    def reference(fn, *args):
      """The unsharded result, from the kernels as ordinary code (jattn's partitioning rule
      off, so a fault in it cannot agree with itself), checked finite; and the unsharded call
      with the rule on (the plain computation on this multi-device process) equal to it, where
      the rule changes the program at all (it takes the chunked kernels only: a dense program
      is the same text with it on, and would be compared with itself)."""
      with jattn.auto_partitioning(False):
        off = jax.jit(fn).lower(*args)
      want = off.compile()(*args)
      for x in jax.tree.leaves(want):
        assert np.isfinite(np.asarray(x, np.float32)).all(), "non-finite reference"
      on = jax.jit(fn).lower(*args)
      if on.as_text() != off.as_text():
        for a, b in zip(jax.tree.leaves(on.compile()(*args)), jax.tree.leaves(want)):
          np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg="rule on, unsharded")
      return want

    unsharded = {}
    # implementation=None at T = S = 1024 takes the chunked path with its default blocks.
    # Every implementation batch-sharded, causal; dense and the chunked kernels also not causal
    # (None, at 1024, only causal: its dispatch does not read the mask, and the kernels it picks
    # are batch-sharded without a mask above). Head and sequence sharding causal.
    cases = [("batch", P("x"), impl, causal, T)
             for impl, T in (("chunked", 96), ("dense", 96), ("parallel", 96), (None, 1024))
             for causal in (False, True) if causal or impl is not None]
    cases += [(where, spec, impl, True, 96)
              for where, spec in (("heads", P(None, None, "x")), ("sequence", P(None, "x")))
              for impl in ("chunked", "dense", "parallel")
              if not (where == "heads" and impl == "parallel")]
    # A decoding step (T = 1 against S = 96): the parallel schedule splits its one row of key
    # blocks over lanes (split-KV), batch- and head-sharded.
    cases += [(where, spec, "parallel", "bottom_right", 1)
              for where, spec in (("batch", P("x")), ("heads", P(None, None, "x")))]
    # Sequence-sharded with every kind of mask input and option: a full bias and a boolean
    # array (both sliced per query shard), segment ids, a score_mod closing over a traced
    # array, dropout, a mask object.
    cases += [("sequence+", P(None, "x"), impl, "bottom_right", 96)
              for impl in ("chunked", "parallel")]
    for where, spec, impl, causal, T in cases:
          S = 96 if T == 1 else T
          ks = jax.random.split(jax.random.key(0), 3)
          q = jax.random.normal(ks[0], (B, T, N, H))
          k = jax.random.normal(ks[1], (B, S, K, H))
          v = jax.random.normal(ks[2], (B, S, K, H))
          lens = jnp.asarray([S, 3, S // 2, 0], jnp.int32)
          sinks = jnp.linspace(-1.0, 1.0, N)
          kw = dict(implementation=impl, is_causal=causal, key_value_seq_lengths=lens,
                    sinks=sinks)
          if impl in ("chunked", "parallel"):
            # Both schedules of the chunked kernels ("chunked": serial).
            kw.update(implementation="chunked", block_q=32, block_kv=16,
                      schedule="parallel" if impl == "parallel" else "serial")
          extra = dict(w=jnp.linspace(0.5, 1.5, N))
          if where == "sequence+":
            kr = jax.random.split(jax.random.key(2), 3)
            extra.update(bias=jax.random.normal(kr[0], (B, N, T, S)),
                         mask=jax.random.bernoulli(kr[1], 0.8, (B, 1, T, S)),
                         seg=jnp.arange(T)[None].repeat(B, 0) // 40)
            kw.update(dropout_rate=0.2, dropout_rng=jax.random.key(3),
                      local_window_size=(50, None))
          def step(q, k, v, extra):  # forward and gradients in one program: one compile per case
            def loss(q, k, v, w):
              more = {}
              if "bias" in extra:
                more = dict(bias=extra["bias"], mask=extra["mask"],
                            q_segment_ids=extra["seg"], kv_segment_ids=extra["seg"],
                            score_mod=lambda s, b, h, i, j: s + w[h] * 0.01 * (i - j))
              out = jattn.dot_product_attention(q, k, v, **kw, **more)
              return (out ** 2).sum(), out
            return jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, extra["w"])
          # The unsharded result depends on the problem, not on the sharding or the kernel that
          # computes it: computed once, by the first case of the problem (the chunked kernels'
          # serial schedule, listed first, where it runs the problem: its partitioning rule's
          # unsharded run is checked too; dense's program has none).
          key = (causal, T, where == "sequence+")
          if key not in unsharded:
            unsharded[key] = reference(step, q, k, v, extra)
          gwant, want = unsharded[key]
          with jax.set_mesh(mesh):
            put = lambda x: jax.device_put(x, NamedSharding(mesh, spec))
            rep = lambda x: jax.device_put(x, NamedSharding(mesh, P()))
            args = [put(x) for x in (q, k, v)] + [jax.tree.map(rep, extra)]
            compiled = jax.jit(step).lower(*args).compile()
            got, out = compiled(*args)
          name = f"{where} {impl} causal={causal}"
          if where.startswith("sequence"):
            # Each device computes its own query rows: K and V are gathered, the query and
            # output never move.
            moved = structure.query_sized(structure.collectives(compiled.as_text()), B, T, N, H)
            if moved:
              failures.append(f"{name}: query- or output-sized collectives {moved}")
          if out.sharding.spec != spec and tuple(out.sharding.spec) != tuple(spec) + (None,) * (4 - len(spec)):
            failures.append(f"{name}: output sharding {out.sharding.spec}")
          np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5, err_msg=name)
          for a, b in zip(got, gwant):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4, err_msg=name)
    # A whole query against K and V sharded along S (a decoding step against a sharded
    # cache), under the Explicit mesh and an Auto mesh: each device attends to its own keys,
    # and the parts are merged across devices: only (B, T, N, H)-sized partial results and
    # their statistics move (all-reduces), never K or V; the output is replicated, dK and dV
    # stay sharded like K and V. Gradients pass through the merge (the lse's cotangent reaches
    # the kernels).
    T, S = 3, 96
    ks = jax.random.split(jax.random.key(4), 4)
    q = jax.random.normal(ks[0], (B, T, N, H))
    k = jax.random.normal(ks[1], (B, S, K, H))
    v = jax.random.normal(ks[2], (B, S, K, H))
    bias = jax.random.normal(ks[3], (B, N, T, S))
    w = jnp.linspace(0.5, 1.5, N)
    # implementation=None too: at this size it would pick dense, which gathers K and V.
    for sched in ("serial", "parallel", None):
      kw = dict(implementation="chunked", schedule=sched, block_q=16, block_kv=8)
      if sched is None:
        kw = dict(implementation=None)
      kw.update(is_causal="bottom_right", key_value_seq_lengths=jnp.asarray([S, 3, 50, 0]),
                sinks=jnp.linspace(-1.0, 1.0, N), dropout_rate=0.3,
                dropout_rng=jax.random.key(5), return_residual=True,
                score_mod=lambda s, b, h, i, j: s + w[h] * 0.01 * (i - j))
      def step(q, k, v, bias, kw=kw):
        def loss(q, k, v, bias):
          out, lse = jattn.dot_product_attention(q, k, v, bias, **kw)
          return (out ** 2).sum(), (out, lse)
        return jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, bias)
      if sched == "serial":  # one problem: its unsharded result, whichever kernel computes it
        want = reference(step, q, k, v, bias)
      # Under the Explicit mesh, and under an Auto mesh (the chunked kernels' partitioning
      # rule splits the keys where the query rows are whole; None takes chunked here).
      for kv_mesh in (mesh, jax.make_mesh((4,), ("x",), axis_types=(AxisType.Auto,))):
        with jax.set_mesh(kv_mesh):
          put = lambda x, spec: jax.device_put(x, NamedSharding(kv_mesh, spec))
          # The bias sharded along S like the keys (given whole, its gradient, computed per
          # key shard, would be gathered to match it).
          args = (put(q, P()), put(k, P(None, "x")), put(v, P(None, "x")),
                  put(bias, P(None, None, None, "x")))
          compiled = jax.jit(step).lower(*args).compile()
          got = compiled(*args)
        name = f"key/value-sharded {sched} {kv_mesh.axis_types[0]}"
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
          np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4, err_msg=name)
        colls = structure.collectives(compiled.as_text())
        if {c.kind for c in colls} != {"all-reduce"} or max(c.bytes for c in colls) > (
            B * T * N * (H + 1) * 4):
          failures.append(f"{name}: collectives {colls}")
        (_, dk, _, _), (out, _) = got
        if tuple(dk.sharding.spec)[:2] != (None, "x") or any(out.sharding.spec):
          failures.append(f"{name}: shardings dk {dk.sharding.spec}, out {out.sharding.spec}")
    # bfloat16 with the keys split over the devices, under the 16-bit rule of
    # tests/properties/test_precision16.py (error against float64 <= 1.5x that of rounding the
    # exact answer, Frobenius): each device's part stays float32 until the parts are merged
    # (Plan.out_dtype): 1.23x serial, 1.18x parallel, as unsharded (1.32x, 1.18x); each part
    # rounded to bfloat16 before the merge, as until 2026-12-06, it was 1.66x and 1.57x.
    qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
    exact = ref.attention(qb, kb, vb)[0]
    rel = lambda x: ref.rel_error(x, exact)
    rounded = rel(ref.round_to_dtype(exact, jnp.bfloat16))
    for sched in ("serial", "parallel"):
      f = functools.partial(jattn.dot_product_attention, implementation="chunked",
                            schedule=sched, block_q=16, block_kv=8)
      for kv_mesh in (mesh, jax.make_mesh((4,), ("x",), axis_types=(AxisType.Auto,))):
        with jax.set_mesh(kv_mesh):
          put = lambda x, spec: jax.device_put(x, NamedSharding(kv_mesh, spec))
          out = jax.jit(f)(put(qb, P()), put(kb, P(None, "x")), put(vb, P(None, "x")))
        name = f"bfloat16 key/value-sharded {sched} {kv_mesh.axis_types[0]}"
        if out.dtype != jnp.bfloat16 or not rel(out) <= 1.5 * rounded:
          failures.append(f"{name}: {out.dtype}, error {rel(out):.3e} against the rounding's "
                          f"{rounded:.3e} ({rel(out) / rounded:.2f}x)")
    # A (data, sequence) mesh: batch over "d", sequence over "x". The per-shard paths would
    # make XLA gather the batch inside a shard_map manual over "x" only, so Q (along T) is
    # gathered instead; the batch stays sharded throughout.
    m2 = jax.make_mesh((2, 2), ("d", "x"), axis_types=(AxisType.Explicit,) * 2)
    T = 64
    ks = jax.random.split(jax.random.key(6), 3)
    q, k, v = (jax.random.normal(kk, (B, T, n, H)) for kk, n in zip(ks, (N, K, K)))
    f = lambda q, k, v: jattn.dot_product_attention(q, k, v, is_causal=True, block_q=8,
                                                    block_kv=8, implementation="chunked")
    with jax.set_mesh(m2):
      args = [jax.device_put(x, NamedSharding(m2, P("d", "x"))) for x in (q, k, v)]
      compiled = jax.jit(f).lower(*args).compile()
      got = compiled(*args)
    np.testing.assert_allclose(got, jax.jit(f)(q, k, v), rtol=1e-5, atol=1e-5)
    batches = {s[0] for c in structure.collectives(compiled.as_text()) for s in c.shapes}
    if batches != {B // 2} or tuple(got.sharding.spec)[:2] != ("d", "x"):
      failures.append(f"(data, sequence) mesh: batch sizes moved {batches}, output "
                      f"{got.sharding.spec}")
    # Auto axes: shardings are not part of the types; the partitioner propagates them.
    T = 256
    mesh = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Auto,))
    ks = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(ks[0], (B, T, N, H))
    k = jax.random.normal(ks[1], (B, T, K, H))
    v = jax.random.normal(ks[2], (B, T, K, H))
    seq = P(None, "x")
    wheres = (("batch", P("x")), ("heads", P(None, None, "x")), ("sequence", seq))
    def run_auto(name, step, args, want, where, meshed=True):
      """``step`` compiled for ``args`` (under the Auto mesh, or with no mesh set) and run:
      equal to ``want``; batch and head sharding move nothing. Returns (result, collectives)."""
      with jax.set_mesh(mesh) if meshed else contextlib.nullcontext():
        compiled = jax.jit(step).lower(*args).compile()
      got = compiled(*args)
      for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4, err_msg=name)
      colls = structure.collectives(compiled.as_text())
      if where != "sequence" and colls:
        failures.append(f"{name}: collectives {colls}")
      return got, colls
    # (name, options, wheres). The chunked kernels, called plainly, are one operation with a
    # partitioning rule that reads the query's sharding when XLA partitions the program
    # (jattn._parallel.partition); called through jax.sharding.explicit_axes they see it while tracing.
    impls = []
    for sched in ("serial", "parallel"):
      kw = dict(implementation="chunked", schedule=sched, block_q=32, block_kv=32)
      impls += [(sched, kw, wheres), (sched + " explicit_axes", kw, wheres[2:])]
    impls.insert(1, ("dense", dict(implementation="dense"), wheres))
    for impl, kw, cases in impls:
      plain = lambda q, k, v, kw=kw: jattn.dot_product_attention(q, k, v, is_causal=True, **kw)
      f = plain
      if impl.endswith("explicit_axes"):
        f = jax.sharding.explicit_axes(plain, axes="x", in_sharding=(seq, seq, seq))
      # Forward and gradients in one program (one compile per case).
      def loss(q, k, v, f):
        out = f(q, k, v)
        return (out ** 2).sum(), out
      grad = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)
      step = functools.partial(grad, f=f)
      if impl == "serial":  # one problem: its unsharded result, by the first chunked kernel
        want = reference(functools.partial(grad, f=plain), q, k, v)
      for where, spec in cases:
        args = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v)]
        name = f"auto {where} {impl}"
        got, colls = run_auto(name, step, args, want, where)
        if where == "sequence":
          # K and V gathered, once each, whole; the dK/dV partial sums reduced; nothing query-
          # or output-sized moves.
          moved = structure.query_sized(colls, B, T, N, H)
          if moved:
            failures.append(f"{name}: query- or output-sized collectives {moved}")
          gathers = [(c.bytes, c.runs) for c in colls if c.kind == "all-gather"]
          if gathers != [(B * K * T * H * 4, 1)] * 2:
            failures.append(f"{name}: all-gathers {gathers}, want K and V once each")
          if sorted({c.kind for c in colls}) != ["all-gather", "all-reduce"]:
            failures.append(f"{name}: collectives {colls}")
          if tuple(got[1].sharding.spec)[:2] != (None, "x"):
            failures.append(f"{name}: output sharding {got[1].sharding.spec}")
    # The partitioning rule with every kind of mask input and option, under an Auto mesh and
    # under no mesh at all (plain jit on sharded arrays): a full bias (split like the query),
    # lengths, sinks (cut per head), segment ids, a window, dropout (at global indices), a mask
    # function and a score_mod reading (b, h, i, j), a boolean mask array (read whole); T = 200
    # with 32-row blocks pads each device's 50 rows. Equal to the unsharded call, forward and
    # gradients; batch and heads split with no collective; a sequence-sharded query stays
    # sharded (K and V gathered, nothing query- or output-sized moves).
    T = 200
    kr = jax.random.split(jax.random.key(8), 8)
    q = jax.random.normal(kr[0], (B, T, N, H))
    k = jax.random.normal(kr[1], (B, T, K, H))
    v = jax.random.normal(kr[2], (B, T, K, H))
    bias = jax.random.normal(kr[3], (B, N, T, T))
    seg = jnp.cumsum(jax.random.bernoulli(kr[4], 0.05, (B, T)), axis=1)
    variants = {
        "bias, lengths, sinks": dict(is_causal=True, key_value_seq_lengths=jnp.asarray(
            [T, 150, 3, 0]), query_seq_lengths=jnp.asarray([0, 7, T, 120]),
            sinks=jnp.linspace(-1.0, 1.0, N)),
        "segments, window, dropout": dict(q_segment_ids=seg, kv_segment_ids=seg,
                                          local_window_size=(40, 0), dropout_rate=0.3,
                                          dropout_rng=jax.random.key(9)),
        "mask function, score_mod": dict(
            mask=jattn.masks.from_function(lambda b, h, i, j: (j <= i) | ((h + b) % 3 == 0)),
            score_mod=lambda s, b, h, i, j: s + 0.01 * (i - j) * (h + 1) - 0.1 * b),
        "boolean mask": dict(mask=jax.random.bernoulli(kr[5], 0.7, (B, 1, T, T))),
    }
    # One unsharded result per variant (the serial schedule's, its rule's unsharded run checked;
    # the parallel schedule's sharded runs are compared with it). With no mesh set: every
    # variant on the serial schedule, the first on the parallel one (the rule reads no mesh of
    # the context; the kernels' part is the schedule's).
    for vname, vkw in variants.items():
      for sched in ("serial", "parallel"):
        kw = dict(implementation="chunked", schedule=sched, block_q=32, block_kv=32, **vkw)
        with_bias = vname.startswith("bias")
        def loss(q, k, v, bias, kw=kw, with_bias=with_bias):
          out = jattn.dot_product_attention(q, k, v, bias if with_bias else None, **kw)
          return (out ** 2).sum(), out
        step = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)
        if sched == "serial":
          want = reference(step, q, k, v, bias)
        unmeshed = sched == "serial" or vname == next(iter(variants))
        for where, spec in (wheres if sched == "serial" else wheres[2:]):
          for meshed in ((True, False) if where == "sequence" and unmeshed else (True,)):
            name = f"auto {where} {vname} {sched}" + ("" if meshed else " (no mesh set)")
            args = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v)] + [bias]
            got, colls = run_auto(name, step, args, want, where, meshed)
            moved = structure.query_sized(colls, B, T, N, H)
            if moved:
              failures.append(f"{name}: query- or output-sized collectives {moved}")
            pad = lambda p: tuple(p) + (None,) * (4 - len(p))
            if pad(got[1].sharding.spec) != pad(spec):
              failures.append(f"{name}: output sharding {got[1].sharding.spec}")
    # A (2, 2) mesh: examples or heads split over one axis, query rows or keys over the other,
    # with a mask function reading the example and head indices, and sinks; 72 rows (36 per
    # device) in blocks of 16: padded blocks.
    m22 = jax.make_mesh((2, 2), ("a", "b"), axis_types=(AxisType.Auto,) * 2)
    fm = jattn.masks.from_function(lambda b, h, i, j: (j <= i + 3 * b) & ((h < 5) | (j >= i - 8)))
    def loss(q, k, v):
      out = jattn.dot_product_attention(q, k, v, mask=fm, sinks=jnp.linspace(-1.0, 2.0, N),
                                        implementation="chunked", block_q=16, block_kv=16)
      return (out ** 2).sum(), out
    step = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)
    q, k, v = q[:, :72], k[:, :72], v[:, :72]
    want = reference(step, q, k, v)
    for qs, kvs in ((P("a", "b"), P("a", "b")), (P(None, "b", "a"), P(None, "b", "a")),
                    (P("a"), P("a", "b"))):
      args = [jax.device_put(x, NamedSharding(m22, s_)) for x, s_ in ((q, qs), (k, kvs), (v, kvs))]
      got = jax.jit(step)(*args)
      for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4, err_msg=f"(2, 2) mesh {qs} {kvs}")
    # implementation=None at T = S = 1024 (where it takes the chunked kernels here), a (data,
    # sequence) mesh, and jax.vmap of a sharded call (vmap maps the plain computation: XLA
    # partitions it as ordinary code), each equal to the unsharded call.
    T = 1024
    kr = jax.random.split(jax.random.key(10), 3)
    q, k, v = (jax.random.normal(kk, (B, T, n, H)) for kk, n in zip(kr, (N, K, K)))
    plain = lambda q, k, v: jattn.dot_product_attention(q, k, v, is_causal=True)
    want = reference(plain, q, k, v)  # the one unsharded call of the three checks below
    args = [jax.device_put(x, NamedSharding(mesh, seq)) for x in (q, k, v)]
    with jax.set_mesh(mesh):
      compiled = jax.jit(plain).lower(*args).compile()
    got = compiled(*args)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    colls = structure.collectives(compiled.as_text())
    if structure.query_sized(colls, B, T, N, H) or tuple(got.sharding.spec)[:2] != (None, "x"):
      failures.append(f"auto sequence implementation=None: {colls}, {got.sharding.spec}")
    m22 = jax.make_mesh((2, 2), ("d", "x"), axis_types=(AxisType.Auto,) * 2)
    args = [jax.device_put(x, NamedSharding(m22, P("d", "x"))) for x in (q, k, v)]
    compiled = jax.jit(plain).lower(*args).compile()
    got = compiled(*args)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    colls = structure.collectives(compiled.as_text())
    if structure.query_sized(colls, B // 2, T, N, H) or tuple(got.sharding.spec)[:2] != ("d", "x"):
      failures.append(f"auto (data, sequence) mesh: {colls}, {got.sharding.spec}")
    # One example under vmap (two stacked calls of it): vmap maps the call whatever its batch.
    stacked = [jnp.stack([x[:1], -x[:1]]) for x in (q, k, v)]
    args = [jax.device_put(x, NamedSharding(mesh, P(None, None, "x"))) for x in stacked]
    vgrad = jax.vmap(jax.grad(lambda q, k, v: (plain(q, k, v) ** 2).sum(), argnums=(0, 1, 2)))
    for a, b in zip(jax.jit(vgrad)(*args), reference(vgrad, *stacked)):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4, err_msg="vmap")
    # The rule is a Python callback, which jax.export cannot serialize: with
    # jattn.auto_partitioning(False) a partitioned program exports (and runs as traced).
    args = [jax.device_put(x, NamedSharding(mesh, seq)) for x in (q, k, v)]
    with jattn.auto_partitioning(False):
      exported = jax.export.export(jax.jit(plain))(*args)
    np.testing.assert_allclose(exported.call(*args), want, rtol=1e-5, atol=1e-5)
    # implementation=None gives a TPU program splash only where it cannot be partitioned:
    # with 4 devices, not in a plain jit (the inputs may be sharded; XLA cannot partition a
    # Pallas kernel), but inside a shard_map over every mesh axis -- one with check_vma=False:
    # splash's kernels do not type their outputs as device-varying.
    big = (jax.ShapeDtypeStruct((8, 4096, 16, 64), jnp.bfloat16),) * 3
    causal = lambda q, k, v: jattn.dot_product_attention(q, k, v, is_causal=True)
    splash = lambda q, k, v: jattn.dot_product_attention(q, k, v, is_causal=True,
                                                         implementation="splash")
    tpu = lambda fn: jax.export.export(jax.jit(fn), platforms=["tpu"])(*big).mlir_module()
    per_device = lambda fn, check: jax.shard_map(fn, mesh=mesh, in_specs=P("x"),
                                                 out_specs=P("x"), check_vma=check)
    found = {name: tpu(fn).count("tpu_custom_call") for name, fn in (
        ("plain", causal), ("shard_map", per_device(causal, False)),
        ("shard_map check_vma", per_device(causal, True)))}
    if found != {"plain": 0, "shard_map": 1, "shard_map check_vma": 0}:
      failures.append(f"implementation=None's fused kernels: {found}")
    try:
      tpu(per_device(splash, True))
      failures.append("splash in shard_map(check_vma=True) was not refused")
    except NotImplementedError as e:
      if "check_vma" not in str(e):
        failures.append(f"splash's refusal: {e}")
    # Under an Explicit mesh the shardings are known while jattn traces: splash runs split over
    # examples and heads inside a shard_map (each device its own, no communication), asked for
    # by name or by implementation=None; a sequence-sharded call, or heads sharded under a mask
    # that differs between them, is refused naming why (None then takes jattn's kernels).
    emesh = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Explicit,))
    def tpu_explicit(fn, spec, T=256):
      with jax.set_mesh(emesh):
        a = [jax.ShapeDtypeStruct((8, T, n, 64), jnp.bfloat16,
                                  sharding=NamedSharding(emesh, spec)) for n in (16, 4, 4)]
        return jax.export.export(jax.jit(fn), platforms=["tpu"])(*a).mlir_module()
    lens = jnp.full((8,), 250)
    named = lambda q, k, v: jattn.dot_product_attention(
        q, k, v, is_causal=True, key_value_seq_lengths=lens, sinks=jnp.zeros((16,)),
        implementation="splash")
    both = jax.grad(lambda q, k, v: named(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    found = {(name, tuple(spec)): tpu_explicit(fn, spec).count("tpu_custom_call")
             for name, fn in (("forward", named), ("forward+backward", both))
             for spec in (P("x"), P(None, None, "x"))}
    found.update({("None", tuple(spec)): tpu_explicit(causal, spec, T=8192).count(
        "tpu_custom_call") for spec in (P("x"), P(None, "x"))})
    batch, heads, seq = ("x",), (None, None, "x"), (None, "x")
    want = {("forward", batch): 1, ("forward+backward", batch): 4, ("forward", heads): 1,
            ("forward+backward", heads): 4, ("None", batch): 1, ("None", seq): 0}
    if found != want:
      failures.append(f"splash under an Explicit mesh: {found}")
    per_head = lambda q, k, v: jattn.dot_product_attention(
        q, k, v, mask=jattn.masks.from_function(lambda b, h, i, j: (j <= i) | (h == 0)),
        implementation="splash")
    for fn, spec, words in ((named, P(None, "x"), "sequence-sharded"),
                            (per_head, P(None, None, "x"), "differs between heads")):
      try:
        tpu_explicit(fn, spec)
        failures.append(f"splash {spec} was not refused")
      except NotImplementedError as e:
        if words not in str(e):
          failures.append(f"splash {spec} refused with: {e}")
    assert not failures, failures
    print("OK")
''')


@pytest.mark.slow
@pytest.mark.long
def test_sharded_calls_under_explicit_and_auto_meshes():
  r = run_source(WORKER, timeout=900)
  assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]


@pytest.mark.parametrize("schedule", ["serial", "parallel"])
def test_the_partitioned_operation_unpartitioned_equals_the_kernels(monkeypatch, schedule):
  """On a process with several devices every chunked call goes through the partitioning rule's
  operation, and a program that is not partitioned runs its plain computation (forward, and
  the backward from the saved output and lse; forward mode through the plain kernels). Here on
  one device, made to look like several: equal to the kernels as ordinary code, forward, every
  gradient and a tangent, with padded blocks (T = 50 in blocks of 16), sinks, a bias, lengths
  and dropout."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  import jattn
  from jattn._parallel import partition as _partition

  B, T, N, K, H = 2, 50, 4, 2, 8
  ks = jax.random.split(jax.random.key(0), 5)
  q = jax.random.normal(ks[0], (B, T, N, H))
  k, v = (jax.random.normal(kk, (B, T, K, H)) for kk in ks[1:3])
  bias = jax.random.normal(ks[3], (B, N, T, T))
  sinks = jnp.linspace(-1.0, 2.0, N)

  def loss(q, k, v, bias, sinks):
    out = jattn.dot_product_attention(
      q,
      k,
      v,
      bias,
      sinks=sinks,
      is_causal=True,
      key_value_seq_lengths=jnp.array([50, 7]),
      dropout_rate=0.2,
      dropout_rng=jax.random.key(1),
      implementation="chunked",
      schedule=schedule,
      block_q=16,
      block_kv=16,
    )
    return (out * jnp.cos(jnp.arange(out.size).reshape(out.shape))).sum()

  grad = jax.grad(loss, argnums=(0, 1, 2, 3, 4))
  # Forward mode too: a custom VJP here refused it on any process with several devices.
  args = (q, k, v, bias, sinks)
  jvp = lambda *a: jax.jvp(loss, a, tuple(jnp.cos(x) for x in args))
  with jattn.auto_partitioning(False):
    want = jax.jit(grad)(*args) + jax.jit(jvp)(*args)
  calls = []
  applies = _partition.applies
  monkeypatch.setattr(jax, "device_count", lambda: 4)
  monkeypatch.setattr(_partition, "applies", lambda *a: calls.append(1) or applies(*a))
  got = jax.jit(grad)(*args) + jax.jit(jvp)(*args)
  assert calls and applies(None, ())  # the operation was used
  for a, b in zip(got, want):
    assert np.isfinite(np.asarray(a)).all()
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


NO_CONTEXT_WORKER = textwrap.dedent('''
    import os
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=4")
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, jax.numpy as jnp, numpy as np, jattn
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    import reference as ref  # tests/support, on the path (`run_source`)

    B, T, N, K, H = 4, 64, 8, 4, 16
    mesh = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Explicit,))
    ks = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (B, T, n, H)) for key, n in zip(ks, (N, K, K)))

    def reference(causal):
        vis = ref.visible_mask(B, N, T, T, causal="top_left" if causal else None)
        return ref.attention(q, k, v, visible=vis)[0]

    failures = []
    # Every implementation under every sharding; causal or not turned between them (a covering
    # design: each implementation and each sharding both with and without the causal mask).
    for w, (where, spec) in enumerate((("batch", P("x")), ("heads", P(None, None, "x")), ("sequence", P(None, "x")))):
        args = [jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v)]
        for i, impl in enumerate(("dense", "chunked", "parallel", None)):
            kw = dict(implementation="chunked", schedule="parallel") if impl == "parallel" else dict(implementation=impl)
            for causal in ((w + i) % 2 == 1,):
                try:
                    out = jattn.dot_product_attention(*args, is_causal=causal, block_q=16, block_kv=16, **kw)
                    np.testing.assert_allclose(np.asarray(out), reference(causal), atol=2e-5)
                except Exception as e:
                    failures.append(f"{where} {impl} causal={causal}: {type(e).__name__}: {str(e)[:200]}")
    assert not failures, failures
    print("OK")
''')


@pytest.mark.slow
def test_arrays_of_an_explicit_mesh_without_a_context_mesh():
  # jax.nn takes an Explicit mesh's arrays under plain jit, without jax.set_mesh: jattn traces
  # the call under the mesh their types carry (batch-, head- and sequence-sharded, every
  # implementation), against the float64 reference.
  r = run_source(NO_CONTEXT_WORKER, timeout=600)
  assert r.returncode == 0 and "OK" in r.stdout, (r.stdout[-3000:], r.stderr[-3000:])
