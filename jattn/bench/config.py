"""Sweep configuration: a TOML file -> a list of cases, each naming the implementations to compare.

A config holds run settings and sweep axes at the top level, and optionally ``[[sweep]]`` tables
whose keys override the top level (each sweep is the cartesian product of its axes). Without a
``[[sweep]]`` table the top level is the one sweep. Keys (defaults in brackets):

  name, description                      [file name, ""]
  repeats                                timed calls per implementation and case [5]
  warmup                                 untimed calls before timing [1]
  max_memory_gib                         the memory guard (the CLI's --max-memory wins) [16]
  peak_matmul_size                       n of the n^3 matmul that measures the peak [2048]
  seed                                   input PRNG seed [0]
  baseline                               the implementation ratios are taken against ["jax-nn"]
  implementations                        names from IMPLEMENTATIONS [jattn-dense, jattn-chunked,
                                         jax-nn, flax]
  block_sizes                            [[block_q, block_kv], ...] for jattn-chunked, -serial and
                                         -parallel [[512, 512]]
  passes                                 "forward" / "forward+backward" [both]
  batch, heads, kv_heads, head_dim       B, N, K (default K = N), H [1, 8, = heads, 64]
  T, S                                   query / key lengths; S defaults to S = T [required]
  dtypes                                 "float32", "bfloat16", "float16" [["float32"]]
  masks                                  mask specs (see jattn.bench.masks) [["full"]]
  [[compare]] field, values              print and store time ratios between cases that differ
                                         only in ``field`` (e.g. mask "causal" vs "full")
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import itertools
import os
import tomllib as _toml
from pathlib import Path
from typing import Any

from jattn.bench import flops as _flops
from jattn.bench import masks as _masks

IMPLEMENTATIONS = (
  "jattn-dense",
  "jattn-chunked",
  "jattn-serial",
  "jattn-parallel",
  "jattn-splash",
  "jattn-cudnn",
  "jax-nn",
  "jax-nn-cudnn",
  "flax",
  "torch",
)
# jattn's chunked kernels, one row per block size: the platform's default schedule, or one named.
CHUNKED_IMPLEMENTATIONS = ("jattn-chunked", "jattn-serial", "jattn-parallel")
DTYPES = ("float32", "bfloat16", "float16")
# Implementations whose memory is a dense (B, N, T, S) score matrix: guarded before compiling.
DENSE_IMPLEMENTATIONS = frozenset({"jattn-dense", "jax-nn", "flax", "torch"})

_RUN_KEYS = {
  "name",
  "description",
  "repeats",
  "warmup",
  "max_memory_gib",
  "peak_matmul_size",
  "seed",
  "baseline",
  "compare",
  "sweep",
}
_SWEEP_KEYS = {
  "implementations",
  "block_sizes",
  "passes",
  "batch",
  "heads",
  "kv_heads",
  "head_dim",
  "T",
  "S",
  "dtypes",
  "masks",
  "repeats",
  "warmup",
}


class ConfigError(ValueError):
  """A config file that cannot be read or has a bad value; the message names the key."""


class ConfigTypeError(ConfigError, TypeError):
  """A config value of the wrong TOML type (jattn's error policy: a wrong type is a TypeError;
  still a ConfigError, so the CLI reports it the same way)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Impl:
  """One implementation as compared: a name from IMPLEMENTATIONS, and block sizes if chunked."""

  name: str
  block_q: int | None = None
  block_kv: int | None = None

  @property
  def label(self) -> str:
    if self.block_q is None:
      return self.name
    return f"{self.name}-{self.block_q}x{self.block_kv}"

  @property
  def dense_memory(self) -> bool:
    return self.name in DENSE_IMPLEMENTATIONS


@dataclasses.dataclass(frozen=True, slots=True)
class Case:
  """One problem: query (B, T, N, H), key/value (B, S, K, H) in ``dtype``, under ``mask``."""

  pass_: str
  dtype: str
  mask: _masks.MaskSpec
  B: int
  N: int
  K: int
  H: int
  T: int
  S: int
  impls: tuple[Impl, ...]
  repeats: int
  warmup: int

  @property
  def name(self) -> str:
    return (
      f"{self.pass_} {self.dtype} {self.mask.name} B={self.B} N={self.N} K={self.K} "
      f"H={self.H} T={self.T} S={self.S}"
    )

  @property
  def flops(self) -> float:
    return _flops.attention_flops(self.B, self.N, self.T, self.S, self.H, self.mask, self.pass_)

  @property
  def dense_memory_estimate(self) -> int:
    return _flops.dense_memory_estimate(self.B, self.N, self.T, self.S, self.pass_)

  def fields(self) -> dict[str, Any]:
    """The case's identity as flat JSON fields."""
    return {
      "pass": self.pass_,
      "dtype": self.dtype,
      "mask": self.mask.name,
      "B": self.B,
      "N": self.N,
      "K": self.K,
      "H": self.H,
      "T": self.T,
      "S": self.S,
    }


@dataclasses.dataclass(frozen=True, slots=True)
class Compare:
  field: str
  values: tuple[Any, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class Config:
  name: str
  description: str
  path: str
  max_memory_gib: float
  peak_matmul_size: int
  seed: int
  baseline: str
  compare: tuple[Compare, ...]
  cases: tuple[Case, ...]
  raw: dict[str, Any]

  @property
  def dtypes(self) -> tuple[str, ...]:
    return tuple(sorted({c.dtype for c in self.cases}))


def configs_dir() -> Path:
  """Where the shipped configs live: ``jattn/bench/configs`` inside the installed package (a wheel
  ships the repository's ``configs/`` there), else the checkout's ``configs/`` beside the
  ``jattn/`` directory (an editable install or a bare checkout)."""
  installed = importlib.resources.files("jattn.bench") / "configs"
  if isinstance(installed, Path) and installed.is_dir():
    return installed
  return Path(__file__).resolve().parent.parent.parent / "configs"


def read_table(path, keys, defaults: dict) -> dict:
  """A subcommand's flat TOML config: ``defaults`` updated by the file, whose keys must be a
  subset of ``keys`` (a ValueError naming the file and the unknown keys otherwise)."""
  import tomllib

  with open(path, "rb") as f:
    cfg = tomllib.load(f)
  unknown = set(cfg) - set(keys)
  if unknown:
    raise ValueError(f"{path}: unknown keys {sorted(unknown)}; expected a subset of {sorted(keys)}")
  return {**defaults, **cfg}


def resolve_path(arg: str | None) -> Path:
  """A config argument -> a file: a path, or a bare name like ``quick`` for the shipped
  configs/quick.toml (see configs_dir)."""
  if arg is None:
    arg = "default"
  path = Path(arg)
  if path.is_file():
    return path
  if path.suffix == "" and path.parent == Path("."):
    candidate = configs_dir() / f"{arg}.toml"
    if candidate.is_file():
      return candidate
    raise ConfigError(f"config {arg!r}: no such file (also looked for {candidate})")
  raise ConfigError(f"config {arg!r}: no such file")


def load(path: str | os.PathLike) -> Config:
  """Read and check a config file; every bad key or value is a ConfigError naming it."""
  path = Path(path)
  try:
    with open(path, "rb") as f:
      raw = _toml.load(f)
  except OSError as e:
    raise ConfigError(f"config {str(path)!r}: cannot read it: {e}") from None
  except _toml.TOMLDecodeError as e:
    raise ConfigError(f"config {str(path)!r}: not valid TOML: {e}") from None
  return parse(raw, name=path.stem, path=str(path))


def parse(raw: dict[str, Any], *, name: str = "config", path: str = "") -> Config:
  """Check a config already read from TOML and expand its sweeps into cases."""
  where = f"config {path or name!r}"
  unknown = set(raw) - _RUN_KEYS - _SWEEP_KEYS
  if unknown:
    raise ConfigError(
      f"{where}: unknown key(s) {sorted(unknown)}; known: {sorted(_RUN_KEYS | _SWEEP_KEYS)}"
    )
  top = {k: v for k, v in raw.items() if k in _SWEEP_KEYS}
  sweeps = raw.get("sweep", [{}])
  if not isinstance(sweeps, list) or not sweeps:
    raise ConfigError(f"{where}: 'sweep' must be a list of tables ([[sweep]]), got {sweeps!r}")
  cases = []
  for i, sweep in enumerate(sweeps):
    if not isinstance(sweep, dict):
      raise ConfigError(f"{where}: sweep {i} must be a table, got {sweep!r}")
    bad = set(sweep) - _SWEEP_KEYS
    if bad:
      raise ConfigError(
        f"{where}: sweep {i}: unknown key(s) {sorted(bad)}; known: {sorted(_SWEEP_KEYS)}"
      )
    cases.extend(_expand({**top, **sweep}, f"{where}, sweep {i}"))
  if not cases:
    raise ConfigError(f"{where}: the sweeps describe no case")
  baseline = raw.get("baseline", "jax-nn")
  if baseline not in IMPLEMENTATIONS:
    raise ConfigError(f"{where}: baseline must be one of {IMPLEMENTATIONS}, got {baseline!r}")
  return Config(
    name=_str(raw.get("name", name), "name", where),
    description=_str(raw.get("description", ""), "description", where),
    path=path,
    max_memory_gib=_positive(raw.get("max_memory_gib", 16.0), "max_memory_gib", where),
    peak_matmul_size=_int(raw.get("peak_matmul_size", 2048), "peak_matmul_size", where, 1),
    seed=_int(raw.get("seed", 0), "seed", where, 0),
    baseline=baseline,
    compare=tuple(_compare(c, where) for c in raw.get("compare", [])),
    cases=tuple(cases),
    raw=raw,
  )


def _expand(s: dict[str, Any], where: str) -> list[Case]:
  if "T" not in s:
    raise ConfigError(f"{where}: 'T' (the list of query lengths) is required")
  impl_names = _list(
    s.get("implementations", ["jattn-dense", "jattn-chunked", "jax-nn", "flax"]),
    "implementations",
    where,
  )
  for n in impl_names:
    if n not in IMPLEMENTATIONS:
      raise ConfigError(f"{where}: implementations: unknown {n!r}; known: {IMPLEMENTATIONS}")
  blocks = _list(s.get("block_sizes", [[512, 512]]), "block_sizes", where)
  for b in blocks:
    if (
      not isinstance(b, list)
      or len(b) != 2
      or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in b)
    ):
      raise ConfigError(
        f"{where}: block_sizes entries must be [block_q, block_kv] of positive ints, got {b!r}"
      )
  impls: list[Impl] = []
  for n in dict.fromkeys(impl_names):
    if n in CHUNKED_IMPLEMENTATIONS:
      impls.extend(Impl(n, bq, bk) for bq, bk in dict.fromkeys(tuple(b) for b in blocks))
    else:
      impls.append(Impl(n))
  passes = _list(s.get("passes", list(_flops.PASSES)), "passes", where)
  for p in passes:
    if p not in _flops.PASSES:
      raise ConfigError(f"{where}: passes: unknown {p!r}; known: {_flops.PASSES}")
  dtypes = _list(s.get("dtypes", ["float32"]), "dtypes", where)
  for d in dtypes:
    if d not in DTYPES:
      raise ConfigError(f"{where}: dtypes: unknown {d!r}; known: {DTYPES}")
  mask_specs = []
  for m in _list(s.get("masks", ["full"]), "masks", where):
    try:
      mask_specs.append(_masks.parse(m))
    except ValueError as e:
      raise ConfigError(f"{where}: masks: {e}") from None
  ints: dict[str, list[int]] = {}
  for key, default in (("batch", [1]), ("heads", [8]), ("head_dim", [64]), ("T", None)):
    ints[key] = [_int(v, key, where, 1) for v in _list(s.get(key, default), key, where)]
  kv_heads = s.get("kv_heads")
  kv_heads_list: list[int] | None = (
    None
    if kv_heads is None
    else [_int(v, "kv_heads", where, 1) for v in _list(kv_heads, "kv_heads", where)]
  )
  s_list = s.get("S")
  s_lengths: list[int] | None = (
    None if s_list is None else [_int(v, "S", where, 1) for v in _list(s_list, "S", where)]
  )
  repeats = _int(s.get("repeats", 5), "repeats", where, 1)
  warmup = _int(s.get("warmup", 1), "warmup", where, 0)

  cases = []
  for pass_, dtype, spec, B, N, H in itertools.product(
    passes, dtypes, mask_specs, ints["batch"], ints["heads"], ints["head_dim"]
  ):
    for K in kv_heads_list or [N]:
      if N % K:
        raise ConfigError(f"{where}: kv_heads={K} does not divide heads={N}")
      for T in ints["T"]:
        for S in s_lengths or [T]:
          cases.append(
            Case(
              pass_=pass_,
              dtype=dtype,
              mask=spec,
              B=B,
              N=N,
              K=K,
              H=H,
              T=T,
              S=S,
              impls=tuple(impls),
              repeats=repeats,
              warmup=warmup,
            )
          )
  return cases


def _compare(c, where):
  if not isinstance(c, dict) or set(c) != {"field", "values"}:
    raise ConfigError(f"{where}: each [[compare]] needs exactly 'field' and 'values', got {c!r}")
  fields = ("pass", "dtype", "mask", "B", "N", "K", "H", "T", "S", "impl")
  if c["field"] not in fields:
    raise ConfigError(f"{where}: compare field must be one of {fields}, got {c['field']!r}")
  values = _list(c["values"], "compare values", where)
  if len(values) != 2:
    raise ConfigError(f"{where}: compare values must be two values [a, b], got {values!r}")
  if c["field"] == "mask":
    try:
      values = [_masks.parse(v).name for v in values]
    except ValueError as e:
      raise ConfigError(f"{where}: compare: {e}") from None
  return Compare(c["field"], tuple(values))


def _list(v, key, where):
  if not isinstance(v, list):
    raise ConfigTypeError(f"{where}: {key!r} must be a list, got {v!r}")
  if not v:
    raise ConfigError(f"{where}: {key!r} must not be empty")
  return v


def _int(v, key, where, minimum):
  if not isinstance(v, int) or isinstance(v, bool):
    raise ConfigTypeError(f"{where}: {key!r} must be an int >= {minimum}, got {v!r}")
  if v < minimum:
    raise ConfigError(f"{where}: {key!r} must be an int >= {minimum}, got {v!r}")
  return v


def _positive(v, key, where):
  if not isinstance(v, (int, float)) or isinstance(v, bool):
    raise ConfigTypeError(f"{where}: {key!r} must be a positive number, got {v!r}")
  if v <= 0:
    raise ConfigError(f"{where}: {key!r} must be a positive number, got {v!r}")
  return float(v)


def _str(v, key, where):
  if not isinstance(v, str):
    raise ConfigTypeError(f"{where}: {key!r} must be a string, got {v!r}")
  return v
