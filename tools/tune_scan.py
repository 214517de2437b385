"""Tunes kernels.scan's blocks and benchmarks linear_scan against XLA, with the TPU compiler's cost model.

Two jobs, two files in ``kernels/data/``; every number is a **compiler estimate**
(``kernels.estimate_tpu``, libtpu's static cost model), never a measurement, stored with
:meth:`kernels.perf.tpu.Estimate.record`: ``us`` is the floored estimate (the model's time, but
never less than the program's counted HBM bytes at the published bandwidth); the model's
own time (``model_us``) and the floor (``floor_us``) stay beside it and are never ranked on.

* ``tune`` -> ``scan_blocks.json``: on v5e and v6e, at ``[8, 4096, 2048]`` bf16 (``a``
  and ``b`` bf16, one gate per element), every ``seq_chunk`` in {128, 256, 512, 1024} and
  ``width_block`` in {512, 1024, 2048}, forward alone and forward + backward; ranked on
  the sum of the two floored times. Candidates within 1% of the best are ties, and among
  ties the smaller VMEM plan wins. v5p and v4 copy v5e's entry (v4 has no cost model; v5p
  was not swept), and say so.
* ``bench`` -> ``scan_bench.json``: the same shape on v5e and v6e, forward and forward +
  backward: ours (default blocks), ``lax.scan`` (:func:`kernels.scan.linear.linear_scan_reference`,
  the XLA path) and ``lax.associative_scan`` (f32 pairs), and Griffin's Pallas scan
  (``recurrentgemma.jax.scan``) when that package imports.

Each estimate runs in a child process (libtpu's cost model can abort a process); results
are written after each one, so an interrupted run resumes. Run it under the shared lock::

  flock /tmp/tpu-heavy.lock nice -n 10 python tools/tune_scan.py tune
  flock /tmp/tpu-heavy.lock nice -n 10 python tools/tune_scan.py bench
"""
from __future__ import annotations

import argparse
import datetime
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

from kernels.scan import linear as scan  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels", "data")
BLOCKS_OUT = os.path.join(DATA, "scan_blocks.json")
BENCH_OUT = os.path.join(DATA, "scan_bench.json")

SHAPE = (8, 4096, 2048)
GENERATIONS = ("v5e", "v6e")
SEQ_CHUNKS = (128, 256, 512, 1024)
WIDTH_BLOCKS = (512, 1024, 2048)
TIE = 0.01
KERNEL_VERSION = 3  # 1: log-step tile scan over 16-row bf16 tiles, start states saved for the backward; 2: 8-row groups chained (2026-11-25); 3: carry folded into each group's first row (no masks), tiles of 16 vector registers per operand (2026-11-26)


def bytes_moved(cfg) -> int:
  """HBM bytes the program must move (the roofline's numerator): each input read once, each output
  written once. Forward: read a and b, write h. Forward + backward as one program: read a, b and dy,
  write h, da and db. (A two-pass kernel also re-reads a and h in its backward: 8 arrays, not 6.)"""
  n = SHAPE[0] * SHAPE[1] * SHAPE[2] * jnp.dtype(cfg["dtype"]).itemsize
  return (6 if cfg["mode"] == "fwdbwd" else 3) * n


def _associative_scan(a, b):
  """``lax.associative_scan`` over time of the pairs (a, b) in f32, h cast to b's dtype."""
  def combine(x, y):
    return x[0] * y[0], y[0] * x[1] + y[1]
  _, h = lax.associative_scan(combine, (a.astype(jnp.float32), b.astype(jnp.float32)), axis=1)
  return h.astype(b.dtype)


GRIFFIN_SRC = os.environ.get("RECURRENTGEMMA_SRC", "/tmp/rg/src")


def _import_griffin():
  """``recurrentgemma.jax.scan`` from the package's unpacked wheel (with einops's) in GRIFFIN_SRC, not
  installed: its package ``__init__`` imports the whole model (flax), so the two packages are created
  empty and the scan module imported alone, with ``flax.struct.dataclass`` (its Complex type) and
  ``absl.logging`` stood in for by a registered frozen dataclass and Python's logging."""
  import dataclasses  # noqa: PLC0415
  import logging  # noqa: PLC0415
  import types  # noqa: PLC0415
  sys.path.insert(0, GRIFFIN_SRC)
  for name in ("recurrentgemma", "recurrentgemma.jax"):
    mod = types.ModuleType(name)
    mod.__path__ = [os.path.join(GRIFFIN_SRC, *name.split("."))]
    sys.modules.setdefault(name, mod)
  struct = types.ModuleType("flax.struct")
  struct.dataclass = lambda cls: jax.tree_util.register_dataclass(dataclasses.dataclass(frozen=True)(cls))
  absl = types.ModuleType("absl")
  absl.logging = logging
  for name, mod in (("flax", types.ModuleType("flax")), ("flax.struct", struct), ("absl", absl),
                    ("absl.logging", logging)):
    sys.modules.setdefault(name, mod)
  from recurrentgemma import common  # noqa: PLC0415
  from recurrentgemma.jax import scan as rg_scan  # noqa: PLC0415
  return rg_scan, common


def _griffin(a, b):
  """recurrentgemma's Pallas linear scan (its defaults: seq blocks of up to 256, f32 accumulation)."""
  rg_scan, common = _import_griffin()
  h, _ = rg_scan.linear_scan(x=b, a=a, scan_type=common.ScanType.LINEAR_PALLAS)
  return h


def _program(cfg):
  dtype = jnp.dtype(cfg["dtype"])
  x = jax.ShapeDtypeStruct(SHAPE, dtype)
  if cfg["impl"] == "ours":
    blocks = scan.BlockSizes(cfg.get("seq_chunk"), cfg.get("width_block"))
    fwd = lambda a, b: scan.linear_scan(a, b, block_sizes=blocks)  # noqa: E731
  elif cfg["impl"] == "lax_scan":
    fwd = scan.linear_scan_reference
  elif cfg["impl"] == "associative_scan":
    fwd = _associative_scan
  elif cfg["impl"] == "griffin":
    fwd = _griffin
  else:
    raise ValueError(cfg["impl"])
  if cfg["mode"] == "fwd":
    return fwd, (x, x)

  def fwdbwd(a, b, dy):
    h, vjp = jax.vjp(fwd, a, b)
    return h, vjp(dy)
  return fwdbwd, (x, x, x)


def estimate(cfg) -> dict:
  fn, args = _program(cfg)
  e = kernels.estimate_tpu(fn, *args, generation=cfg["generation"], flops=0, bytes_accessed=bytes_moved(cfg))
  r = e.record()
  r.update(bytes=bytes_moved(cfg), compile_seconds=round(e.compile_seconds, 1))
  return r


def estimate_isolated(cfg) -> dict:
  """:func:`estimate` in a child process."""
  return result_tables.run_child([os.path.abspath(__file__), "one", json.dumps(cfg)])


def _header(description):
  return {"description": description, "generated_by": "tools/tune_scan.py", "kind": "compiler estimate (floored)",
          "environment": {"jax": jax.__version__, "python": platform.python_version()}, "shape": list(SHAPE)}


def _vmem(cfg) -> int:
  """The larger VMEM plan of the two kernels (the tie-break)."""
  p = scan._Problem(SHAPE[0], SHAPE[1], SHAPE[2], "full", jnp.dtype(cfg["dtype"]), jnp.dtype(cfg["dtype"]), 1,
                    False, False, False)
  return max(scan._vmem_bytes(cfg["seq_chunk"], cfg["width_block"], p, backward=bw) for bw in (False, True))


def pick(scores: dict[tuple[int, int], float], vmem: dict[tuple[int, int], int]) -> tuple[int, int]:
  """The fastest blocks; within :data:`TIE` of it, the smallest VMEM plan."""
  best = min(scores.values())
  ties = [k for k, us in scores.items() if us <= best * (1 + TIE)]
  return min(ties, key=lambda k: (vmem[k], scores[k]))


def tune(args):
  table = result_tables.load(BLOCKS_OUT) or _header("")
  table["description"] = (
      "Default blocks of kernels.scan (seq_chunk x width_block) per TPU generation and dtype, at the tuned width "
      "(a call takes the nearest tuned width's entry). Chosen from compiler estimates (libtpu's static cost model; "
      "estimates, not measurements) at [8, 4096, 2048] bf16: us is the floored estimate, the cost model's time "
      "(model_us) but never less than the program's counted HBM bytes at the published bandwidth (floor_us). Ranked "
      "on forward + (forward and backward) us; within 1% of the best, the smaller VMEM plan wins. v5p and v4 copy "
      "v5e (not swept; v4 has no cost model).")
  defaults = table.setdefault("defaults", {})
  for gen in args.generations:
    sweep = {}
    for tc in SEQ_CHUNKS:
      for wb in WIDTH_BLOCKS:
        for mode in ("fwd", "fwdbwd"):
          cfg = dict(generation=gen, impl="ours", dtype="bfloat16", mode=mode, seq_chunk=tc, width_block=wb)
          sweep[(tc, wb, mode)] = r = estimate_isolated(cfg)
          print(gen, tc, wb, mode, r.get("us"), r.get("model_us"), r.get("error", ""), flush=True)
    keys = {(tc, wb) for tc, wb, _ in sweep}
    ok = lambda r: "us" in r and r.get("valid", True)  # noqa: E731
    scores = {k: sweep[k + ("fwd",)]["us"] + sweep[k + ("fwdbwd",)]["us"] for k in keys
              if ok(sweep[k + ("fwd",)]) and ok(sweep[k + ("fwdbwd",)])}
    if not scores:
      print(f"{gen}: no candidate compiled; entry left as it was", flush=True)
      continue
    vmem = {k: _vmem(dict(dtype="bfloat16", seq_chunk=k[0], width_block=k[1])) for k in scores}
    tc, wb = pick(scores, vmem)
    defaults[gen] = {"bfloat16": [{
        "width": SHAPE[2], "seq_chunk": tc, "width_block": wb, "forward": sweep[(tc, wb, "fwd")],
        "forward_and_backward": sweep[(tc, wb, "fwdbwd")],
        "sweep": {f"{k[0]}x{k[1]}/{k[2]}": ({"us": v["us"], "model_us": v["model_us"]} if "us" in v else v)
                  for k, v in sorted(sweep.items())},
        "kernel": KERNEL_VERSION, "tuned": datetime.date.today().isoformat()}]}
    if gen == "v5e":
      for other in ("v5p", "v4"):
        defaults[other] = {"bfloat16": [
            {"width": SHAPE[2], "seq_chunk": tc, "width_block": wb,
             "source": "v5e's choice (not swept; libtpu has no cost model for v4); fit_block_sizes shrinks "
                       "blocks that do not fit the chip's VMEM"}]}
    result_tables.save(table, BLOCKS_OUT)


def bench(args):
  table = result_tables.load(BENCH_OUT) or _header("")
  table["description"] = (
      "kernels.linear_scan against XLA at [8, 4096, 2048] bf16 (a and b bf16, f32 state): compiler estimates "
      "(libtpu's static cost model), not measurements. us is the floored estimate: the model's time (model_us), "
      "never less than the program's counted HBM bytes (hbm_bytes) at the published bandwidth (floor_us); "
      "fraction_of_roofline is 'bytes' (each input read once, each output written once: forward a, b -> h; "
      "forward + backward a, b, dy -> h, da, db) at the published bandwidth over us. lax_scan is "
      "kernels.scan.linear.linear_scan_reference (the model's cycles of the loop body are multiplied by the trip "
      "count); associative_scan is lax.associative_scan of f32 pairs; griffin is recurrentgemma's Pallas scan.")
  results = table.setdefault("results", {})
  for gen in args.generations:
    for impl in args.impls:
      for mode in ("fwd", "fwdbwd"):
        cfg = dict(generation=gen, impl=impl, dtype="bfloat16", mode=mode)
        key = f"{gen}/{impl}/{mode}"
        if key in results and "us" in results[key] and results[key].get("kernel") == KERNEL_VERSION and not args.force:
          continue
        r = estimate_isolated(cfg)
        r.update(cfg)
        if impl == "ours":
          r["kernel"] = KERNEL_VERSION
          with kernels.base.backend.target(gen):
            d = scan.default_block_sizes(gen, jnp.bfloat16, SHAPE[2])
          r["blocks"] = scan.fit_block_sizes(d, SHAPE[1], SHAPE[2], chip=gen).as_dict()
        results[key] = r
        print(key, r.get("us"), r.get("model_us"), r.get("floor_us"), r.get("error", ""), flush=True)
        result_tables.save(table, BENCH_OUT)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("job", choices=("tune", "bench", "one"))
  ap.add_argument("config", nargs="?", help="(one) a JSON configuration, used internally")
  ap.add_argument("--generations", nargs="*", default=list(GENERATIONS))
  ap.add_argument("--impls", nargs="*", default=["ours", "lax_scan", "associative_scan", "griffin"])
  ap.add_argument("--force", action="store_true")
  args = ap.parse_args(argv)
  if args.job == "one":
    result_tables.print_result(estimate, args.config)
    return
  (tune if args.job == "tune" else bench)(args)


if __name__ == "__main__":
  main()
