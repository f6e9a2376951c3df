"""Sharded inputs on host CPU devices: each implementation's per-device compiled memory and the
collectives its partitioned program runs, for batch, head and sequence sharding, and for a
decoding step (one query row) against K and V sharded along S ("keys"), under Auto and Explicit
mesh axes.

  jattn-bench sharding [--devices 4] [--T 1024] [--impls dense ring ...] [--json out]
      (--impls takes jax.nn, dense, "chunked serial", "chunked parallel", "chunked
      explicit_axes", ring: quote the names with a space)
  python -m jattn.bench.sharding_bench [...]   # the same

Nothing is timed: host devices share this machine's cores. What is read from each compiled
program is what carries over to a real mesh: the collectives (kind, per-device result shape,
bytes) that the partitioner put in, whether any of them moves a query- or output-sized array
(a sequence-sharded query gathered, or the output reduced: the work is then replicated instead
of split), the output's sharding, and the per-device temp memory.

It runs in a child process on P host devices (see `jattn.bench.host_devices`).
"""

from __future__ import annotations

import argparse

from jattn.bench import host_devices

# "keys": K and V sharded along S, the query whole: a decoding step (one query row) against a
# cache sharded over the sequence.
SHARDINGS = ("batch", "heads", "sequence", "keys")
IMPLS = ("jax.nn", "dense", "chunked serial", "chunked parallel", "chunked explicit_axes", "ring")
PASSES = ("forward", "forward+backward")


def _spec(where):
  """The (query, key/value) PartitionSpecs of a sharding."""
  from jax.sharding import PartitionSpec as P

  if where == "keys":
    return P(), P(None, "x")
  spec = {"batch": P("x"), "heads": P(None, None, "x"), "sequence": P(None, "x")}[where]
  return spec, spec


def _runs(impl, axis_type, where) -> bool:
  """Ring attention shards the sequence; "chunked explicit_axes" (the chunked kernels called
  through `jax.sharding.explicit_axes` with the inputs' shardings) is, under an Auto mesh, the
  alternative to the kernels' partitioning rule for a sequence-sharded query, and the way to the
  split-KV merge for K and V sharded along S (under an Explicit mesh every call already is one)."""
  if impl == "ring":
    return where == "sequence"
  if impl == "chunked explicit_axes":
    return where in ("sequence", "keys") and axis_type == "Auto"
  return True


def _fn(impl, causal, mesh, spec):
  import jax

  import jattn

  kw = dict(is_causal=causal)
  if impl == "jax.nn":
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, **kw)
  if impl == "ring":
    return lambda q, k, v: jattn.ring_attention_sharded(q, k, v, mesh=mesh, seq_axis="x", **kw)
  if impl == "dense":
    kw.update(implementation="dense")
  elif impl == "chunked explicit_axes":
    kw.update(implementation="chunked")
    fn = lambda q, k, v: jattn.dot_product_attention(q, k, v, **kw)
    q_spec, kv_spec = spec
    return jax.sharding.explicit_axes(fn, axes="x", in_sharding=(q_spec, kv_spec, kv_spec))
  else:
    kw.update(implementation="chunked", schedule=impl.split()[1])
  return lambda q, k, v: jattn.dot_product_attention(q, k, v, **kw)


def _pass(fn, pss):
  """The timed program: ``(output, grads)`` (grads None forward) so that the output's sharding
  can be read in both passes."""
  import jax
  import jax.numpy as jnp

  if pss == "forward":
    return lambda q, k, v: (fn(q, k, v), None)

  def loss(q, k, v):
    out = fn(q, k, v)
    return jnp.sum(out**2), out

  grad = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)
  return lambda q, k, v: grad(q, k, v)[::-1]


def child(cfg):
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import AxisType, NamedSharding

  from jattn.bench import structure

  P = cfg["devices"]
  B, T, N, K, H = cfg["batch"], cfg["T"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)
  k, v = (jnp.asarray(rng.standard_normal((B, T, K, H)), jnp.float32) for _ in range(2))
  rows = []
  for axis_type in ("Auto", "Explicit"):
    mesh = jax.make_mesh((P,), ("x",), axis_types=(getattr(AxisType, axis_type),))
    for where in SHARDINGS:
      spec = _spec(where)
      # The query of a "keys" row is one decoding step's: its first row.
      query = q[:, :1] if where == "keys" else q
      args = [
        jax.device_put(x, NamedSharding(mesh, sp))
        for x, sp in zip((query, k, v), (spec[0], spec[1], spec[1]))
      ]
      for impl in cfg["impls"]:
        if not _runs(impl, axis_type, where):
          continue
        for pss in PASSES:
          row = dict(mesh=axis_type, sharding=where, impl=impl, passes=pss)
          fn = jax.jit(_pass(_fn(impl, cfg["causal"], mesh, spec), pss))
          try:
            with jax.set_mesh(mesh):
              compiled = fn.lower(*args).compile()
              out = compiled(*args)
          except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            rows.append(row)
            continue
          hlo = compiled.as_text()
          assert hlo is not None  # the host CPU backend always prints its executables
          colls = structure.collectives(hlo)
          mem = compiled.memory_analysis()
          row.update(
            out_spec=str(tuple(out[0].sharding.spec)),
            temp_mib=(mem.temp_size_in_bytes / 2**20) if mem is not None else None,
            collectives=[
              dict(
                kind=c.kind,
                shapes=[list(s) for s in c.shapes],
                bytes=c.bytes,
                runs=c.runs,
                bytes_per_call=c.bytes_per_call,
              )
              for c in colls
            ],
            # A "keys" row reduces its (B, 1, N, H) partial outputs by design: not asked.
            query_sized=(
              None if where == "keys" else bool(structure.query_sized(colls, B, T, N, H))
            ),
          )
          rows.append(row)
  return rows


def _summary(colls):
  """Per kind: how many run in one call (loop bodies once per step) and the bytes they move."""
  if not colls:
    return "none"
  # kind -> (runs, bytes per call); None once one of them is in a loop of run-time length.
  kinds: dict[str, tuple[int, int] | None] = {}
  for c in colls:
    prev = kinds.get(c["kind"], (0, 0))
    if prev is None or c["runs"] is None:
      kinds[c["kind"]] = None
    else:
      kinds[c["kind"]] = (prev[0] + c["runs"], prev[1] + c["bytes_per_call"])
  return ", ".join(
    f"{k} x{nb[0]} ({nb[1] / 2**20:.2f} MiB)"
    if nb is not None
    else f"{k} (in a loop of run-time length)"
    for k, nb in sorted(kinds.items())
  )


def print_table(rows, cfg):
  print(
    f"{cfg['devices']} host CPU devices; B={cfg['batch']} T=S={cfg['T']} N={cfg['heads']} "
    f"K={cfg['kv_heads']} H={cfg['head_dim']} float32, causal={cfg['causal']}; per device and "
    f"call, from the compiled program (collectives in loops counted once per step)"
  )
  print(
    f"{'mesh':8} {'sharding':9} {'impl':21} {'pass':16} {'out spec':26} {'temp MiB':>8}  "
    f"{'Q/O-sized':9} collectives"
  )
  for r in rows:
    head = f"{r['mesh']:8} {r['sharding']:9} {r['impl']:21} {r['passes']:16}"
    if "error" in r:
      print(f"{head} refused: {r['error']}")
      continue
    temp = "-" if r["temp_mib"] is None else f"{r['temp_mib']:.1f}"
    moved = {None: "-", True: "YES", False: "no"}[r["query_sized"]]
    print(f"{head} {r['out_spec']:26} {temp:>8}  {moved:9} {_summary(r['collectives'])}")


def main(argv=None):
  p = argparse.ArgumentParser(prog="jattn-bench sharding", description=__doc__.split("\n")[0])
  p.add_argument("--devices", type=int, default=4, help="host devices (default 4)")
  p.add_argument("--T", type=int, default=1024, help="sequence length T = S (default 1024)")
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--kv-heads", type=int, default=4)
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--no-causal", action="store_true", help="unmasked instead of causal")
  p.add_argument(
    "--impls",
    nargs="+",
    choices=IMPLS,
    default=list(IMPLS),
    metavar="IMPL",
    help=f"implementations to compile (default: all of {', '.join(IMPLS)})",
  )
  p.add_argument("--json", help="also write the rows to this JSON file")
  p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  a = p.parse_args(argv)
  cfg = dict(
    devices=a.devices,
    T=a.T,
    batch=a.batch,
    heads=a.heads,
    kv_heads=a.kv_heads,
    head_dim=a.head_dim,
    causal=not a.no_causal,
    impls=a.impls,
  )
  for name in ("devices", "T", "batch", "heads", "kv_heads", "head_dim"):
    if cfg[name] < 1:
      p.error(f"--{name.replace('_', '-')} must be >= 1, got {cfg[name]}")
  for name in ("T", "batch", "heads", "kv_heads"):
    if cfg[name] % cfg["devices"]:
      p.error(
        f"--{name.replace('_', '-')}={cfg[name]} must be a multiple of "
        f"--devices={cfg['devices']} (each sharding splits it evenly)"
      )
  return host_devices.main(
    "sharding_bench",
    argv,
    cfg,
    child=child,
    report=lambda rows: print_table(rows, cfg),
    json_path=a.json,
    is_child=a.child,
  )


if __name__ == "__main__":
  raise SystemExit(main())
