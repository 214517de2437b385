"""Estimates of the sharded kernels against XLA's partitioning -> kernels/data/sharded_bench.json.

Issue 56's targets, each on an 8-chip mesh (v5e 2x4 and v5p 2x2x2). A multi-chip program's time is
built as in the distributed notebook: the **compiler estimate** (floored) of one chip's compute, plus
the **communication model** (:mod:`kernels.perf.ici`) of its collectives, which the cost model
charges nothing. The collectives are read from the compiled HLO of the whole sharded program, ours
and XLA's partitioning of the plain-JAX reference alike (:func:`kernels.perf.ici.hlo_collectives`),
and priced the same way, without overlap unless the schedule overlaps them (ring attention).

* ``matmul``: 8192^3 bf16, the contraction split over 8, output replicated.
* ``rms_norm``: [8192, 8192] bf16, the hidden axis split over 4 (``model`` of a (2, 4) mesh).
* ``attention``: causal, 32768 tokens, 8 heads of 128, the sequence split over 8: ring attention
  against the all-gathered baseline, composed from one chip's block estimates.
* ``fft``: ``[64, 65536]`` complex64, the transformed axis split over 8: the pencil decomposition
  (two all-to-alls around the single-chip kernel on full rows) against XLA's partitioned
  ``jnp.fft.fft``. Ours: one chip's program with the all-to-alls taken out, estimated; XLA's: the
  partitioned program itself, compiled in this process with the profiler (the cost model charges its
  collectives nothing, and they are priced from its HLO like ours).
* ``local``: each local split's compiled per-chip kernel against the single-chip kernel at the local
  shape (the same Mosaic kernel, operand shapes and no collective).

Usage: ``python tools/bench_sharded.py [--only matmul|rms_norm|attention|local]`` (the estimates need a
few GB each: run under ``nice``).
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import kernels  # noqa: E402  (first: enables the cost model)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from kernels.attention.api import flash_attention  # noqa: E402
from kernels.base import env as _env  # noqa: E402
from kernels.base.backend import target  # noqa: E402
from kernels.base.hardware import get_chip  # noqa: E402
from kernels.perf import ici, tpu, traffic  # noqa: E402
from tools import results  # noqa: E402

OUT = os.path.join(os.path.dirname(__file__), "..", "kernels", "data", "sharded_bench.json")
TOPOLOGIES = {"v5e": "v5e:2x4", "v5p": "v5p:2x2x2"}
N = 8
BF = jnp.bfloat16


def _sds(*shape, dtype=BF, mesh=None, spec=None):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=None if mesh is None else NamedSharding(mesh, spec))


def _estimate(fn, args, generation, flops=None):
  t0 = time.time()
  est = kernels.estimate_tpu(fn, *args, generation=generation, flops=flops, isolate=True)
  rec = est.record()
  print(f"  {generation}: {rec['us']:9.1f} us ({est.label}) in {time.time() - t0:.0f} s", flush=True)
  return rec


def _comm(fn, args, generation):
  """The collectives of ``fn`` compiled on the mesh, and their communication-model microseconds."""
  c = kernels.compile_for_tpu(fn, *args, generation=generation, profile=False)
  found = ici.hlo_collectives(c.hlo)
  return {"collectives": found, "comm_us": ici.hlo_seconds(c.hlo, generation) * 1e6, "memory": c.memory}


def matmul(table):
  M = K = F = 8192
  for gen, topo in TOPOLOGIES.items():
    key = f"{gen}/matmul"
    if key in table:
      continue
    print(key, flush=True)
    mesh = tpu.tpu_mesh(topo, ("x",), (N,), explicit=True)
    a, b = _sds(M, K, mesh=mesh, spec=P(None, "x")), _sds(K, F, mesh=mesh, spec=P("x", None))
    rec = {"ours": _comm(lambda a, b: kernels.matmul(a, b), (a, b), gen),
           "xla": _comm(lambda a, b: jnp.matmul(a, b, out_sharding=NamedSharding(mesh, P())), (a, b), gen)}
    la, lb = _sds(M, K // N), _sds(K // N, F)
    flops = 2 * M * (K // N) * F
    # one chip's compute: without an epilogue the partial products are bf16, summed by the all-reduce
    rec["ours"]["compute"] = _estimate(lambda a, b: kernels.matmul(a, b), (la, lb), gen, flops)
    rec["xla"]["compute"] = _estimate(lambda a, b: a @ b, (la, lb), gen, flops)
    table[key] = rec
    results.save(table, OUT)


def rms_norm(table):
  rows, hidden, split = 8192, 8192, 4
  for gen, topo in TOPOLOGIES.items():
    key = f"{gen}/rms_norm"
    if key in table:
      continue
    print(key, flush=True)
    mesh = tpu.tpu_mesh(topo, ("data", "model"), (2, split), explicit=True)
    x = _sds(rows, hidden, mesh=mesh, spec=P(None, "model"))
    rec = {"ours": _comm(lambda x: kernels.rms_norm(x), (x,), gen),
           "xla": _comm(lambda x: kernels.rms_norm_reference(x), (x,), gen)}
    local = _sds(rows, hidden // split)

    def moments_then_normalise(x):  # one chip's program of a split hidden axis, the psum left out
      h = x.astype(jnp.float32)
      return (h * jax.lax.rsqrt((h * h).sum(-1, keepdims=True) / hidden + 1e-6)).astype(x.dtype)
    rec["ours"]["compute"] = _estimate(moments_then_normalise, (local,), gen)
    rec["xla"]["compute"] = rec["ours"]["compute"]  # XLA partitions the reference into the same program
    rec["local kernel, whole rows"] = _estimate(lambda x: kernels.rms_norm(x), (local,), gen)
    rec["local bytes"] = 2 * rows * (hidden // split) * 2  # read x, write y
    table[key] = rec
    results.save(table, OUT)


def attention(table):
  S, H, D = 32768, 8, 128
  L = S // N
  for gen, topo in TOPOLOGIES.items():
    key = f"{gen}/attention"
    if key in table and "visiting forward" in table[key]:
      continue
    print(key, flush=True)
    mesh = tpu.tpu_mesh(topo, ("x",), (N,), explicit=True)
    q = _sds(1, S, H, D, mesh=mesh, spec=P(None, "x"))
    rec = {"ours": _comm(lambda q, k, v: kernels.flash_attention(q, k, v, causal=True), (q, q, q), gen)}
    # one chip's blocks (one head, times 8: heads are a parallel grid axis of the kernel)
    q1, kv1, kvh = _sds(1, L, 1, D), _sds(1, L, 1, D), _sds(1, L // 2, 1, D)
    for name, fn, args, pairs in (
        ("diagonal forward", lambda q, k, v: flash_attention(q, k, v, causal=True, return_residuals=True),
         (q1, kv1, kv1), L * L / 2),
        ("visiting forward", lambda q, k, v: flash_attention(q, k, v, return_residuals=True), (q1, kvh, kvh),
         L * L / 2)):
      r = _estimate(fn, args, gen, 4 * pairs * D)
      rec[name] = {k: v * H if k in ("us", "model_us", "floor_us", "hbm_bytes") else v for k, v in r.items()}
      rec[name]["scaled_from_heads"] = 1
    table[key] = rec
    results.save(table, OUT)


def _profiled_partitioned(fn, *args, generation="v5e"):
  """The floored compiler estimate (us) of one chip of a multi-chip program, compiled in this process
  with the profiler (compile_for_tpu compiles multi-chip programs without it), and its HLO."""
  folder = _env.STATIC_PROFILE_DIR
  if folder is None:
    raise SystemExit("the static cost model is off in this process (import kernels before JAX starts)")
  chip = get_chip(generation)
  for path in glob.glob(os.path.join(folder, "*")):
    os.remove(path)
  with target(chip):
    hlo = jax.jit(fn).lower(*args).compile().as_text()
  ops = tpu._read_profile(folder)
  t = traffic.hlo_traffic(hlo, {})
  cycles = sum(c * t.multiplicity.get(n, 1) for n, c in ops.items())
  return {"us": max(cycles / chip.clock_hz, t.hbm_bytes / chip.hbm_bandwidth) * 1e6,
          "model_us": cycles / chip.clock_hz * 1e6, "hbm_bytes": t.hbm_bytes}, hlo


def fft(table):
  rows, n = 64, 65536
  gen = "v5e"
  key = f"{gen}/fft"
  if key in table:
    return
  print(key, flush=True)
  mesh = tpu.tpu_mesh(TOPOLOGIES[gen], ("data", "model"), (2, 4), explicit=True)
  spec = P(None, ("data", "model"))
  x = _sds(rows, n, dtype=jnp.complex64, mesh=mesh, spec=spec)
  # (planes out: libtpu cannot import an exported explicit-mesh program with a complex result)
  planes = lambda y: (jnp.real(y), jnp.imag(y))  # noqa: E731
  rec = {"ours": _comm(lambda x: planes(kernels.fft(x)), (x,), gen)}

  def local(x):  # one chip's program, the all-to-alls taken out (the same bytes in and out)
    v = jnp.stack([jnp.real(x), jnp.imag(x)]).reshape(2, rows // N, n)
    yr, yi = kernels.fft((v[0], v[1]))
    v = jnp.stack([yr, yi]).reshape(2, rows, n // N)
    return v[0], v[1]
  rec["ours"]["compute"] = _estimate(local, (_sds(rows, n // N, dtype=jnp.complex64),), gen)
  auto = tpu.tpu_mesh(TOPOLOGIES[gen], ("data", "model"), (2, 4))
  sh = NamedSharding(auto, spec)
  compute, hlo = _profiled_partitioned(jax.jit(jnp.fft.fft, out_shardings=sh),
                                       jax.ShapeDtypeStruct((rows, n), jnp.complex64, sharding=sh), generation=gen)
  rec["xla"] = {"collectives": ici.hlo_collectives(hlo), "compute": compute}
  print(f"  {gen}: XLA {compute['us']:.1f} us (compiler estimate of the partitioned program)", flush=True)
  table[key] = rec
  results.save(table, OUT)


def _kernel_calls(hlo):
  """Each Mosaic call of a compiled program: its result and operand shapes (the custom call's line)."""
  calls = []
  for line in hlo.splitlines():
    if 'custom_call_target="tpu_custom_call"' in line:
      m = re.search(r"=\s*(.*?)\s+custom-call\(", line)
      calls.append(m.group(1) if m else "")
  return sorted(calls)


def local(table):
  mesh = tpu.tpu_mesh("v5e:2x4", ("data", "model"), (2, 4), explicit=True)
  cases = {
      "rms_norm rows": (lambda x: kernels.rms_norm(x), [((8, 2048, 4096), P("data", "model"))]),
      "matmul rows x features": (lambda a, b: kernels.matmul(a, b),
                                 [((8192, 4096), P("data")), ((4096, 8192), P(None, "model"))]),
      "flash_attention batch x heads": (lambda q, k, v: kernels.flash_attention(q, k, v, causal=True),
                                        [((4, 4096, 32, 128), P("data", None, "model"))] * 3),
      "rope batch x seq": (lambda x: kernels.rope(x), [((4, 8192, 8, 128), P("data", "model"))]),
  }
  for name, (fn, args) in cases.items():
    key = f"v5e/local/{name}"
    if key in table:
      continue
    print(key, flush=True)
    sharded = kernels.compile_for_tpu(fn, *[_sds(*s, mesh=mesh, spec=sp) for s, sp in args], generation="v5e",
                                      profile=False)
    shapes = [tuple(d // (mesh.shape[e] if isinstance(e, str) else 1) for d, e in
                    zip(s, tuple(sp) + (None,) * (len(s) - len(sp)))) for s, sp in args]
    single = kernels.compile_for_tpu(fn, *[_sds(*s) for s in shapes], generation="v5e", profile=False)
    table[key] = {"local shapes": shapes, "collectives": ici.hlo_collectives(sharded.hlo),
                  "same kernel calls": _kernel_calls(sharded.hlo) == _kernel_calls(single.hlo),
                  "kernel calls": _kernel_calls(sharded.hlo)}
    print("  ", table[key]["same kernel calls"], table[key]["collectives"], flush=True)
    results.save(table, OUT)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--only", choices=("matmul", "rms_norm", "attention", "fft", "local"), action="append")
  args = parser.parse_args()
  table = results.load(OUT)
  table["_config"] = {"devices": N, "jax": jax.__version__, "topologies": TOPOLOGIES}
  for name in args.only or ("local", "matmul", "rms_norm", "attention", "fft"):
    globals()[name](table)
  results.save(table, OUT)


if __name__ == "__main__":
  main()
