"""Benchmarks kernels.parallel_scan against XLA with the TPU compiler's cost model.

Every number is a **compiler estimate** (``kernels.estimate_tpu``, libtpu's static cost model),
never a measurement, stored with :meth:`kernels.perf.tpu.Estimate.record`: ``us`` is the floored
estimate (the model's time, never less than the program's counted HBM bytes at the published
bandwidth); the model's own time (``model_us``) and the floor (``floor_us``) stay beside it.
All into ``kernels/data/parallel_scan_bench.json``:

* ``bench``: at ``[1, 4096, 256]`` bf16 with ``n = d_out = 256`` (batch 1: the case segments
  exist for), on v5e and v6e, forward and forward + backward: ours at the default segments,
  ours with one segment (the plain recurrence in VMEM) and ``lax.scan``
  (:func:`kernels.parallel_scan_reference`).
* ``assoc``: the same at ``[1, 512, 256]``, with ``lax.associative_scan`` over the
  (matrix, vector) pairs ``(A, x_t @ B)`` (f32; it materialises ``[seq, n, n]``, and its
  compile at 4096 tokens outgrew this machine's RAM).
* ``segments``: ours, forward, at ``[1, 4096, 256]`` bf16 (``n = 256``) for ``num_segments``
  in 4, 16, 32, 64, 128, 256, on v5e and v6e: checks :func:`default_num_segments`'s rule.
* ``trips``: the same program at 1024 and 4096 tokens (``lax.scan``, and ours with one
  segment): the cost model charges a loop body once, ``Estimate`` multiplies it by the trip
  count; a 4x longer sequence must come out about 4x slower.

Each estimate runs in a child process; results are written after each one, so an interrupted run
resumes. Run it under the shared lock::

  flock /tmp/tpu-heavy.lock nice -n 10 python tools/tune_parallel_scan.py bench
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import results as result_tables  # noqa: E402  (tools/results.py: the JSON tables)
import kernels  # noqa: E402  (first: enables the cost model before JAX loads libtpu)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

from kernels.scan import parallel as ps

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels", "data")
BENCH_OUT = os.path.join(DATA, "parallel_scan_bench.json")
GENERATIONS = ("v5e", "v6e")
WIDTH = 256  # d_in = n = d_out
BENCH_SEQ = 4096
ASSOC_SEQ = 512  # lax.associative_scan materialises [seq, n, n] f32: at 4096 tokens its compile took > 8 GB of host RAM
SWEEP_SEQ = 4096
SWEEP_SEGMENTS = (4, 16, 32, 64, 128, 256)  # (blocks of whole segments: the cost model charges them)
KERNEL_VERSION = 1


def flops_bytes(cfg):
  """The problem's roofline numerators: one pass of FLOPs (x @ B, h @ A, h @ C per token; the backward
  twice that), and each [seq, width] array once (forward: read x, write y; + backward: read dy,
  write dx), bf16."""
  tokens, w = cfg["batch"] * cfg["seq"], cfg.get("width", WIDTH)
  fwd = 2 * tokens * 3 * w * w
  arrays = 4 if cfg["mode"] == "fwdbwd" else 2
  return (3 if cfg["mode"] == "fwdbwd" else 1) * fwd, arrays * tokens * w * 2


def _associative_scan(x, A, B, C, h0):
  """``lax.associative_scan`` over the pairs ``(A, x_t @ B)`` (f32): combine
  ``(M1, v1), (M2, v2) -> (M1 @ M2, v1 @ M2 + v2)``; ``h0`` enters the first pair."""
  u = jnp.matmul(x, B, preferred_element_type=jnp.float32)
  u = u.at[:, 0].add(jnp.matmul(h0, A.astype(jnp.float32)))
  T, n = x.shape[1], A.shape[0]
  M = jnp.broadcast_to(A.astype(jnp.float32), (x.shape[0], T, n, n))

  def combine(a, b):
    return (jnp.matmul(a[0], b[0]), jnp.einsum("...i,...ij->...j", a[1], b[0]) + b[1])
  _, h = lax.associative_scan(combine, (M, u), axis=1)
  return jnp.matmul(h.astype(C.dtype), C, preferred_element_type=jnp.float32).astype(x.dtype)


def _program(cfg):
  dt = jnp.bfloat16
  b, t, width = cfg["batch"], cfg["seq"], cfg.get("width", WIDTH)
  x = jax.ShapeDtypeStruct((b, t, width), dt)
  w = jax.ShapeDtypeStruct((width, width), dt)
  h0 = jax.ShapeDtypeStruct((b, width), jnp.float32)
  if cfg["impl"] == "ours":
    fwd = lambda x, A, B, C, h0: ps.parallel_scan(x, A, B, C, h0=h0, num_segments=cfg.get("segments"))  # noqa: E731
  elif cfg["impl"] == "lax_scan":
    fwd = lambda x, A, B, C, h0: ps.parallel_scan_reference(x, A, B, C, h0=h0)  # noqa: E731
  elif cfg["impl"] == "associative_scan":
    fwd = _associative_scan
  else:
    raise ValueError(cfg["impl"])
  if cfg["mode"] == "fwd":
    return fwd, (x, w, w, w, h0)

  def fwdbwd(x, A, B, C, h0, dy):
    y, vjp = jax.vjp(fwd, x, A, B, C, h0)
    return y, vjp(dy)
  return fwdbwd, (x, w, w, w, h0, x)


def estimate(cfg) -> dict:
  fn, args = _program(cfg)
  flops, nbytes = flops_bytes(cfg)
  e = kernels.estimate_tpu(fn, *args, generation=cfg["generation"], flops=flops, bytes_accessed=nbytes)
  r = e.record()
  r.update(flops=flops, bytes=nbytes, compile_seconds=round(e.compile_seconds, 1))
  # libtpu's profile charges our kernels 0 cycles when a block holds several segments cut into chunks
  # (a 3-d strided block): such an estimate is only its floor, and is marked invalid.
  kernels_charged = {k: v for k, v in e.ops.items() if k.startswith("parallel_scan")}
  r["kernel_cycles"] = kernels_charged
  uncharged = [k for k, v in kernels_charged.items() if v == 0]
  if uncharged:  # no estimate: the time without the kernels is not stored as one
    us = r.pop("us")
    r.pop("fraction_of_roofline", None)
    r.update(valid=False, uncharged_kernels=uncharged,
             error=f"no estimate: libtpu's cost model charged the Pallas kernels 0 cycles ({', '.join(uncharged)}); "
                   f"its time without them ({us} us) is not stored as one")
  if cfg["impl"] == "ours":
    p = ps._validate(*args[:4], None, cfg.get("segments"), True)
    with kernels.base.backend.target(cfg["generation"]):
      plan = ps._plan(p, cfg.get("segments"), True)
    r["plan"] = dict(segments=plan.segments, segment_tokens=plan.s, rows_per_block=plan.lb, chunk=plan.tj)
    r["kernel"] = KERNEL_VERSION
  return r


def _header():
  return {"description": (
      "kernels.scan.parallel (dense LTI state-space scan, d_in = n = d_out = 256, bf16, f32 state) against XLA: "
      "compiler estimates (libtpu's static cost model), not measurements. us is the floored estimate: the "
      "model's time (model_us), never less than the program's counted HBM bytes (hbm_bytes) at the published "
      "bandwidth (floor_us). the roofline is max(flops / peak bf16 MXU, bytes / HBM bandwidth) of the problem "
      "(flops: one pass of x@B, h@A, h@C per token, x3 with the backward; bytes: x and y, + dy and dx); "
      "fraction_of_roofline = roofline / us (uncharged estimates store no us). lax_scan is kernels.parallel_scan_reference (loop bodies "
      "multiplied by the trip count); associative_scan is lax.associative_scan over f32 (A, x_t B) pairs; "
      "'ours' plan is the segmentation the kernel chose."),
      "generated_by": "tools/tune_parallel_scan.py", "kind": "compiler estimate (floored)",
      "environment": {"jax": jax.__version__, "python": platform.python_version()}}


def _run(table, key, cfg, force):
  results = table.setdefault("results", {})
  if key in results and "us" in results[key] and not force:
    return
  r = result_tables.run_child([os.path.abspath(__file__), "one", json.dumps(cfg)])
  r.update(cfg)
  print(key, r.get("us"), r.get("model_us"), r.get("floor_us"), r.get("error", ""), flush=True)
  fresh = result_tables.load(BENCH_OUT) or {}  # (another job may have written since: merge, do not overwrite)
  results.update(fresh.get("results", {}))
  results[key] = r
  result_tables.save(table, BENCH_OUT)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("job", choices=("bench", "assoc", "segments", "trips", "one"))
  ap.add_argument("config", nargs="?", help="(one) a JSON configuration, used internally")
  ap.add_argument("--generations", nargs="*", default=list(GENERATIONS))
  ap.add_argument("--impls", nargs="*", default=["ours", "ours_1", "lax_scan"])
  ap.add_argument("--force", action="store_true")
  args = ap.parse_args(argv)
  if args.job == "one":
    result_tables.print_result(estimate, args.config)
    return
  table = result_tables.load(BENCH_OUT) or {}
  table.update({k: v for k, v in _header().items()})
  for gen in args.generations:
    if args.job == "bench":
      for impl in args.impls:
        for mode in ("fwd", "fwdbwd"):
          cfg = dict(generation=gen, impl="ours" if impl == "ours_1" else impl, mode=mode, batch=1, seq=BENCH_SEQ)
          if impl == "ours_1":
            cfg["segments"] = 1
          _run(table, f"bench/{gen}/{impl}/{mode}", cfg, args.force)
    elif args.job == "assoc":
      for impl in ("ours", "lax_scan", "associative_scan"):
        for mode in ("fwd", "fwdbwd"):
          cfg = dict(generation=gen, impl=impl, mode=mode, batch=1, seq=ASSOC_SEQ)
          _run(table, f"assoc/{gen}/{impl}/{mode}", cfg, args.force)
    elif args.job == "segments":
      for L in SWEEP_SEGMENTS:
        cfg = dict(generation=gen, impl="ours", mode="fwd", batch=1, seq=SWEEP_SEQ, segments=L)
        _run(table, f"segments/{gen}/{L}", cfg, args.force)
    else:
      for impl, extra in (("lax_scan", {}), ("ours", {"segments": 1})):
        for seq in (1024, 4096):
          cfg = dict(generation=gen, impl=impl, mode="fwd", batch=1, seq=seq, **extra)
          _run(table, f"trips/{gen}/{impl}/{seq}", cfg, args.force)


if __name__ == "__main__":
  main()
