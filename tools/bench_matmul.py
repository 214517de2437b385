"""Compiler estimates for the GEMM notebook that are too slow to compute live.

``tools/tune_matmul.py`` stores the tuned blocks and, beside each tuned problem, the
estimates of the kernel and of XLA. The notebook also needs comparisons that are not
part of tuning; this script computes them and writes
``kernels/data/matmul_bench.json``:

* ``jax_pallas``: ``jax.experimental.pallas.ops.tpu.matmul`` (JAX's example kernel)
  at the block shape the JAX Pallas matmul guide uses, ``bm, bk, bn = 512, 1024, 1024``,
  and this kernel at the same blocks, for square bf16 problems;
* ``skinny``: this kernel (default blocks) and XLA's ``a @ b`` with and without
  cross-program prefetch on skinny shapes (``16x8192x8192``, decode-like, and
  ``8192x8192x1024``);
* ``epilogue``: ``matmul(a, b, bias=bias, activation=...)`` against XLA's
  ``gelu(a @ b + bias)`` (f32 sum, cast once), with the exact (erf) gelu and its tanh
  approximation, and the plain matmul of each;
* ``sweep``: the kernel at a grid of ``(bm, bk, bn)`` blocks on one problem (the
  notebook's heatmap);
* ``unaligned``: the shapes users bring (``UNALIGNED``: M, K, N in the thousands and
  none a multiple of 512, vocabulary projections, decode and small-batch rows) on v5e
  and v6e: this kernel at its default blocks (``ours``), at the blocks the previous
  default chose -- the nearest tuned problem's blocks, legalized but not balanced
  (``ours_nearest_tuned``, only where they differ) -- and XLA's ``a @ b`` (for skinny
  M without cross-program prefetch, so that it reads its weight from HBM as the kernel
  does).

Every number is a **compiler estimate** (libtpu's static cost model through
``kernels.estimate_tpu``), never a measurement. Each estimate runs in a child process
(libtpu's cost model aborts the process on some programs, and an 8192^3 estimate takes
several GB that the child returns). Results are saved after every estimate, so an
interrupted run resumes where it stopped (``--force`` recomputes).

Usage::

  flock /tmp/tpu-heavy.lock python tools/bench_matmul.py            # everything missing
  flock /tmp/tpu-heavy.lock python tools/bench_matmul.py --only sweep skinny
  python tools/bench_matmul.py --list                               # what would run
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import results as result_tables  # noqa: E402  (tools/results.py: the JSON tables)
import kernels  # noqa: E402  (first: enables the cost model before JAX loads libtpu)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from kernels.gemm import api as mm

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels", "data",
                   "matmul_bench.json")
GUIDE_BLOCKS = (512, 1024, 1024)  # the JAX Pallas TPU matmul guide's bf16 choice (bm, bk, bn)
NO_CROSS_PROGRAM_PREFETCH = "--xla_max_cross_program_prefetches=0"

# Sweep: bm x bn at a few bk on 2048^3, v5e (each estimate takes seconds there).
SWEEP_PROBLEM = (2048, 2048, 2048)
SWEEP_GENERATION = "v5e"
SWEEP_BM = (128, 256, 512, 1024, 2048)
SWEEP_BN = (128, 256, 512, 1024, 2048)
SWEEP_BK = (512, 1024, 2048)

# Shapes users bring (M, K, N): unaligned square-ish problems, vocabulary projections and
# decode / small-batch rows; "skinny" ones (M <= 256) are also compared with XLA
# without cross-program prefetch.
# (An estimate's wall time grows with the FLOPs: 3000x5000x7000 takes one to two minutes,
# so the vocabulary projection is estimated at 512 rows, not thousands.)
UNALIGNED = ((16, 4096, 50257), (128, 7000, 3000), (1000, 3000, 5000), (7000, 1000, 3000), (256, 5000, 7000),
             (5000, 7000, 1000), (512, 4096, 50257), (3000, 5000, 7000))
UNALIGNED_GENERATIONS = ("v5e", "v6e")


def default_plan(gen, m, k, n, dtype=jnp.bfloat16):
  """The blocks (and operand views) a default ``matmul(a, b)`` call plans on ``gen``."""
  from kernels.base.backend import target
  sd = jax.ShapeDtypeStruct
  p = mm._validate(sd((m, k), dtype), sd((k, n), dtype), transpose_a=False, transpose_b=False, bias=None,
                   activation=None, out_dtype=None, precision=None, dropout_rate=0.0, dropout_key=None)
  q, swap, flip_a, flip_b = mm._stored_views(p)
  with target(gen):
    plan = mm._plan(q, None, save_z=False)
  # in the kernel's problem (C^T = B^T A^T when the output is swapped)
  return {"blocks": mm.BlockSizes(plan.bm, plan.bk, plan.bn), "swap_output": swap, "flip_a": flip_a,
          "flip_b": flip_b}


def previous_default_blocks(gen, m, k, n, dtype=jnp.bfloat16):
  """The blocks the default chose before shape classes and fitting (2026-11-25): the tuned problem
  nearest in uncapped log2 distance, its blocks legalized only."""
  import math
  entries = mm.tiling.block_table("matmul")[gen][jnp.dtype(dtype).name]
  e = min(entries, key=lambda e: sum(abs(math.log2(x / e[d])) for x, d in ((m, "m"), (k, "k"), (n, "n"))))
  return mm.fit_block_sizes(mm.BlockSizes(e["bm"], e["bk"], e["bn"]), m, k, n, dtype, legalize=True, balance=False)


def cases() -> list[dict]:
  """Every estimate the notebook needs, cheapest first (the 8192^3 ones take 3-15 min and ~8 GB each)."""
  out = []

  def add(group, gen, kind, m, k, n, blocks=None, flags=""):
    key = (f"{group}/{gen}/{kind}/{m}x{k}x{n}" + (f"/{'x'.join(map(str, blocks))}" if blocks else "")
           + ("/no_cross_program_prefetch" if flags else ""))
    out.append({"key": key, "group": group, "generation": gen, "kind": kind, "m": m, "k": k, "n": n,
                "blocks": list(blocks) if blocks else None, "libtpu_flags": flags})

  for gen, sizes in (("v5e", (1024, 2048, 4096)), ("v6e", (1024, 2048, 4096)), ("v5p", (1024, 2048, 4096))):
    for s in sizes:
      add("jax_pallas", gen, "jax_pallas", s, s, s, GUIDE_BLOCKS)
      add("jax_pallas", gen, "ours", s, s, s, GUIDE_BLOCKS)
  for gen in ("v5e", "v6e"):
    for (m, k, n) in ((16, 8192, 8192), (8192, 8192, 1024)):
      add("skinny", gen, "ours", m, k, n)
      add("skinny", gen, "xla", m, k, n)
      add("skinny", gen, "xla", m, k, n, flags=NO_CROSS_PROGRAM_PREFETCH)
  for gen in ("v5e", "v6e"):
    for s in (2048, 4096):
      for kind in ("ours", "xla", "ours_bias_gelu", "xla_bias_gelu", "ours_bias_gelu_tanh", "xla_bias_gelu_tanh"):
        add("epilogue", gen, kind, s, s, s)
  for bk in SWEEP_BK:
    for bm in SWEEP_BM:
      for bn in SWEEP_BN:
        add("sweep", SWEEP_GENERATION, "ours", *SWEEP_PROBLEM, (bm, bk, bn))
  for (m, k, n) in UNALIGNED:
    for gen in UNALIGNED_GENERATIONS:
      add("unaligned", gen, "ours", m, k, n)
      # skinny M: XLA would prefetch the weight into VMEM uncharged (see ``skinny``), so
      # only the program that reads it from HBM, as the kernel does, is estimated
      add("unaligned", gen, "xla", m, k, n, flags=NO_CROSS_PROGRAM_PREFETCH if m <= 256 else "")
      old = previous_default_blocks(gen, m, k, n)
      now = default_plan(gen, m, k, n)
      if old != now["blocks"] or now["swap_output"] or now["flip_a"] or now["flip_b"]:
        add("unaligned", gen, "ours_nearest_tuned", m, k, n, dataclasses.astuple(old))
  for gen in ("v5e", "v6e"):
    add("jax_pallas", gen, "jax_pallas", 8192, 8192, 8192, GUIDE_BLOCKS)
    add("jax_pallas", gen, "ours", 8192, 8192, 8192, GUIDE_BLOCKS)
  return out


def _program(kind, gen, m, k, n, blocks):
  """(function, argument specs, blocks used) of one case, all bf16."""
  bf16 = jnp.bfloat16
  a, b, bias = (jax.ShapeDtypeStruct(s, bf16) for s in ((m, k), (k, n), (n,)))
  act = "gelu_tanh" if kind.endswith("gelu_tanh") else "gelu"
  if kind.startswith("ours"):
    if not blocks and kind == "ours":  # the default call itself: its blocks and operand views
      return (lambda a, b: mm.matmul(a, b)), (a, b), default_plan(gen, m, k, n)
    used = mm.fit_block_sizes(mm.BlockSizes(*blocks), m, k, n, bf16) if blocks else \
        mm.fit_block_sizes(mm.default_block_sizes(gen, bf16, m, k, n), m, k, n, bf16, legalize=True)
    if kind == "ours":
      return (lambda a, b: mm.matmul(a, b, block_sizes=used)), (a, b), used
    return (lambda a, b, c: mm.matmul(a, b, bias=c, activation=act, block_sizes=used)), (a, b, bias), used
  if kind == "xla":
    return (lambda a, b: a @ b), (a, b), None
  if kind.startswith("xla_bias_gelu"):  # the same computation as the kernel's: f32 sum, bias and gelu, one cast
    def fn(a, b, c):
      z = jnp.dot(a, b, preferred_element_type=jnp.float32) + c.astype(jnp.float32)
      return jax.nn.gelu(z, approximate=act == "gelu_tanh").astype(bf16)
    return fn, (a, b, bias), None
  if kind == "jax_pallas":
    from jax.experimental.pallas.ops.tpu import matmul as jax_mm
    bm, bk, bn = blocks
    return (lambda a, b: jax_mm.matmul(a, b, block_shape=(bm, bn), block_k=bk)), (a, b), mm.BlockSizes(*blocks)
  raise ValueError(kind)


def estimate_one(case: dict) -> dict:
  """Compiler estimate of one case in this process (the child)."""
  gen, m, k, n = case["generation"], case["m"], case["k"], case["n"]
  fn, args, used = _program(case["kind"], gen, m, k, n, case["blocks"])
  flops, nbytes = kernels.matmul_cost(m, k, n)
  t0 = time.time()
  e = kernels.estimate_tpu(fn, *args, generation=gen, flops=flops, bytes_accessed=nbytes)
  out = {**e.record(), "wall_seconds": round(time.time() - t0, 1)}
  if isinstance(used, dict):  # a default call: it may swap the output and read operands transposed
    out["layout"] = {f: used[f] for f in ("swap_output", "flip_a", "flip_b")}
    used = used["blocks"]
  if used is not None:
    out["blocks_used"] = [used.bm, used.bk, used.bn]
  out["ops"] = e.ops  # cycles per HLO op: how many kernels (fusions) the program has
  return out


def estimate_isolated(case: dict) -> dict:
  env = dict(os.environ)
  if case["libtpu_flags"]:  # kernels.base.env keeps these and appends the cost model's flag
    env["LIBTPU_INIT_ARGS"] = (env.get("LIBTPU_INIT_ARGS", "") + " " + case["libtpu_flags"]).strip()
  proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", json.dumps(case)],
                        capture_output=True, text=True, timeout=3600, env=env)
  lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
  if lines:
    return json.loads(lines[-1])
  tail = [ln for ln in proc.stderr.splitlines() if ln.startswith("F") or "Error" in ln]
  return {"error": "the compiler or its cost model crashed: " + (tail[0][:200] if tail else f"exit {proc.returncode}")}


def nearby_shapes(m, k, n, count=3):
  """Shapes next to (m, k, n) for XLA's program where libtpu's cost model aborts on it: one
  dimension at a time moved to its nearest multiple of 128, the smallest change first."""
  out = []
  for axis, d in enumerate((m, k, n)):
    for moved in {128 * round(d / 128), 128 * -(-d // 128)}:
      if moved != d and moved > 0:
        shape = [m, k, n]
        shape[axis] = moved
        out.append((abs(moved - d) / d, tuple(shape)))
  return [s for _, s in sorted(out)][:count]


def estimate_or_nearby(case: dict) -> dict:
  """:func:`estimate_isolated`; for XLA's program, where the cost model aborts, the nearest shape it
  can estimate (``estimated_as``: compare after scaling by the FLOP ratio, and say so)."""
  r = estimate_isolated(case)
  if "error" not in r or case["kind"] != "xla" or case["group"] != "unaligned":
    return r
  for shape in nearby_shapes(case["m"], case["k"], case["n"]):
    near = estimate_isolated({**case, **dict(zip("mkn", shape))})
    if "error" not in near:
      return {**near, "estimated_as": list(shape),
              "note": f"libtpu's cost model aborted on XLA's program at {case['m']}x{case['k']}x{case['n']} "
                      f"({r['error'][:120]}); estimated at the nearest shape it could: "
                      f"{'x'.join(map(str, shape))}"}
  return r


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", default=OUT)
  ap.add_argument("--only", nargs="*", help="groups to run: jax_pallas skinny epilogue sweep unaligned")
  ap.add_argument("--force", action="store_true", help="recompute cases already stored")
  ap.add_argument("--match", help="only cases whose key matches this regular expression")
  ap.add_argument("--skip-8192", action="store_true", help="leave out the 8192^3 cases (minutes and GBs each)")
  ap.add_argument("--list", action="store_true", help="print the cases that would run and exit")
  ap.add_argument("--max-seconds", type=float, default=None,
                  help="start no new estimate after this many seconds (rerun to resume)")
  ap.add_argument("--one", help="estimate one case given as JSON and print the result (used internally)")
  args = ap.parse_args(argv)
  if args.one:
    try:
      r = estimate_one(json.loads(args.one))
    except Exception as e:  # noqa: BLE001 - reported to the parent as data
      r = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
    print(json.dumps(r), flush=True)
    return

  table = result_tables.load(args.out)
  table.update({
      "description": ("Compiler estimates (libtpu's static cost model via kernels.estimate_tpu) of bf16 matmuls "
                      "for the GEMM notebook: JAX's Pallas matmul at the guide's blocks, skinny shapes against "
                      "XLA with and without cross-program prefetch, the fused bias+gelu epilogue against XLA, "
                      "a block-size sweep, and 'unaligned': the shapes users bring (dimensions that are multiples "
                      "of no block) at the default call (kind ours; blocks_used are of the kernel's problem, "
                      "layout says whether it computes C^T and reads A or B through its transpose), at the "
                      "previous default (ours_nearest_tuned: the nearest tuned problem's blocks, legalized only) "
                      "and XLA; an XLA record with estimated_as was estimated at that nearby shape because the "
                      "cost model aborted at the problem's own. Estimates, not measurements. Computed by "
                      "tools/bench_matmul.py."),
      "generated_by": "tools/bench_matmul.py",
      "environment": {"jax": jax.__version__, "libtpu": importlib.metadata.version("libtpu"),
                      "python": platform.python_version()},
      "sweep": {"generation": SWEEP_GENERATION, "problem": list(SWEEP_PROBLEM), "bm": list(SWEEP_BM),
                "bk": list(SWEEP_BK), "bn": list(SWEEP_BN)},
  })
  results = table.setdefault("results", {})
  import re
  todo = [c for c in cases() if (not args.only or c["group"] in args.only)
          and (not args.match or re.search(args.match, c["key"]))
          and (args.force or c["key"] not in results or "error" in results[c["key"]])
          and not (args.skip_8192 and c["m"] == 8192 and c["k"] == 8192 and c["n"] == 8192)]
  if args.list:
    for c in todo:
      print(c["key"], c["libtpu_flags"])
    return
  if not kernels.estimator_available():
    sys.exit("the TPU compiler's cost model is unavailable (needs jax[tpu]; import kernels before jax)")
  t_all = time.time()
  for i, c in enumerate(todo):
    if args.max_seconds is not None and time.time() - t_all > args.max_seconds:
      print(f"stopping after {time.time() - t_all:.0f} s; {len(todo) - i} cases left (rerun to resume)")
      break
    t0 = time.time()
    r = estimate_or_nearby(c)
    key = c["key"]
    results[key] = {**{f: c[f] for f in ("group", "generation", "kind", "m", "k", "n", "blocks")},
                    "cross_program_prefetch": not c["libtpu_flags"], **r,
                    "label": f"compiler estimate, TPU {c['generation']}",
                    "date": datetime.date.today().isoformat()}
    result_tables.save(table, args.out)
    print(f"[{i + 1}/{len(todo)}] {key}: " + (f"{r['us']:.1f} us" if "us" in r else r["error"])
          + f" ({time.time() - t0:.0f} s)", flush=True)
  print(f"done in {time.time() - t_all:.0f} s")


if __name__ == "__main__":
  main()
