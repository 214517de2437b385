"""Tunes kernels.matmul's default block sizes with the TPU compiler's cost model.

For each generation the estimator can model (v5e, v5p, v6e), each input dtype and
each problem in PROBLEMS, it estimates the kernel at candidate ``(bm, bk, bn)``
blocks and keeps the fastest; it also estimates XLA's ``a @ b`` for comparison.
Every number is a **compiler estimate** (``kernels.estimate_tpu``), not a
measurement. v4 cannot be estimated (libtpu's cost model does not model it): its
entries are v5p's choices (same 128x128 MXUs, also a megacore), shrunk until they
fit v4's 16 MiB of VMEM.

The search: a few seed blocks, then hill climbing (double or halve one of bm, bk,
bn) from the best until no neighbour is faster. Each estimate runs in a child
process, because libtpu's cost model aborts the process on some programs. Results
go to ``kernels/data/matmul_blocks.json`` after every problem, so an interrupted
run resumes where it stopped (``--force`` re-tunes).

XLA is estimated twice: as compiled by default, and without cross-program prefetch
(XLA copies one entry parameter -- a 32 MiB weight, say -- into VMEM before the
program starts and the cost model does not charge that copy, so its default
estimate of a memory-bound matmul can beat the HBM roofline).

Usage::

  python tools/tune_matmul.py                      # everything missing (~1 h per dtype on 2 cores)
  python tools/tune_matmul.py --generations v5e --dtypes bfloat16 --problems 2048x2048x2048
  # 8192^3: each estimate takes minutes and several GB of RAM, so try a few blocks only
  python tools/tune_matmul.py --generations v5e v6e --dtypes bfloat16 --problems 8192x8192x8192 \
      --candidates 1024,2048,1024 2048,2048,2048 2048,1024,2048
  python tools/tune_matmul.py --xla-only           # refresh XLA's estimates of tuned problems
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import results as result_tables  # noqa: E402  (tools/results.py: the JSON tables)
import kernels  # noqa: E402  (first: enables the cost model before JAX loads libtpu)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

# The module, not the function kernels/__init__.py may export under the same name.
from kernels.gemm import api as mm
from kernels.base.errors import KernelError  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels", "data",
                   "matmul_blocks.json")

DESCRIPTION = (
    "Default (bm, bk, bn) of kernels.matmul per TPU generation and input dtype, for the tuned problems "
    "[M, K] @ [K, N] (defaults[generation][dtype]: a list of {m, k, n, bm, bk, bn, estimate, xla, ...}). "
    "A call takes the shape class of the tuned problem nearest to it in log2 distance over M, K and N, each "
    "dimension capped at kernels.gemm.api.CLASS_CAP (its small dimensions define the class: decode rows, a "
    "narrow output, or large), then fits those blocks to its own dimensions: each block shrinks to the "
    "smallest legal size that keeps the number of blocks along its dimension (K may take up to two more "
    "when that pads less). Chosen by tools/tune_matmul.py from compiler estimates (libtpu's static cost "
    "model via kernels.estimate_tpu): estimates, not measurements.")

# (M, K, N): square sizes, and the skinny shapes of inference (decode: a few rows;
# small-batch prefill; a narrow output projection).
PROBLEMS = {
    "bfloat16": [(1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096),
                 (16, 4096, 4096), (256, 4096, 4096), (4096, 4096, 256)],
    "float32": [(1024, 1024, 1024), (2048, 2048, 2048), (16, 2048, 2048)],
    "int8": [(1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096), (32, 4096, 4096)],
}
GENERATIONS = ("v5e", "v5p", "v6e")
SEEDS = [(512, 1024, 1024), (1024, 1024, 1024), (512, 2048, 512), (1024, 2048, 1024), (256, 512, 512),
         (256, 4096, 512), (16, 4096, 512)]
BM = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
BK = (128, 256, 512, 1024, 2048, 4096)
BN = (128, 256, 512, 1024, 2048, 4096)


def _sds(shape, dtype):
  return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


def _fn(dtype, blocks):
  if jnp.dtype(dtype) == jnp.int8:
    return lambda a, b, sa, sb: mm.quantized_matmul(a, b, sa, sb, out_dtype=jnp.bfloat16, block_sizes=blocks)
  return lambda a, b: mm.matmul(a, b, block_sizes=blocks)


def _args(m, k, n, dtype):
  args = [_sds((m, k), dtype), _sds((k, n), dtype)]
  if jnp.dtype(dtype) == jnp.int8:
    args += [_sds((m,), jnp.float32), _sds((n,), jnp.float32)]
  return args


def program(dtype, m, k, n, blocks=None):
  """(function, argument specs, FLOPs, roofline bytes) of ours at ``blocks``, or of XLA (None):
  the program :func:`estimate` estimates (``tools/refloor.py`` counts its HBM bytes)."""
  out_dtype = jnp.bfloat16 if jnp.dtype(dtype) == jnp.int8 else dtype
  flops, nbytes = kernels.matmul_cost(m, k, n, dtype=dtype, out_dtype=out_dtype)
  if blocks is None:
    if jnp.dtype(dtype) == jnp.int8:
      def fn(a, b, sa, sb):
        acc = jax.lax.dot(a, b, preferred_element_type=jnp.int32)
        return (acc.astype(jnp.float32) * sa[:, None] * sb[None, :]).astype(jnp.bfloat16)
    else:
      def fn(a, b):
        return a @ b
  else:
    fn = _fn(dtype, blocks)
  return fn, _args(m, k, n, dtype), flops, nbytes


def estimate(gen, dtype, m, k, n, blocks=None):
  """Compiler estimate (seconds, fraction of roofline, valid) of ours (``blocks``) or XLA (None)."""
  fn, args, flops, nbytes = program(dtype, m, k, n, blocks)
  e = kernels.estimate_tpu(fn, *args, generation=gen, flops=flops, bytes_accessed=nbytes, dtype=dtype)
  if e.cycles == 0:  # seen for some of XLA's int8 programs: the profile names no op with cycles
    raise KernelError("fn", None, "the cost model reported 0 cycles (no estimate)")
  return e.record()


# XLA:TPU moves one entry parameter into VMEM before the program starts ("cross-program
# prefetch", e.g. the whole weight of a 256x4096x4096 matmul); the cost model does not
# charge that copy, so XLA's estimate can beat the HBM roofline. Kernels that read their
# operands from HBM are also compared with XLA compiled without it.
NO_CROSS_PROGRAM_PREFETCH = "--xla_max_cross_program_prefetches=0"


def estimate_isolated(gen, dtype, m, k, n, blocks=None, libtpu_flags=""):
  """:func:`estimate` in a child process: libtpu's cost model aborts the whole process on some
  programs (e.g. "Unsupported llo instruction"), and one bad candidate must not end the sweep."""
  import subprocess
  b = dataclasses.astuple(blocks) if blocks is not None else (0, 0, 0)
  cmd = [sys.executable, os.path.abspath(__file__), "--one", gen, jnp.dtype(dtype).name,
         *map(str, (m, k, n, *b))]
  env = dict(os.environ)
  if libtpu_flags:  # kernels.base.env keeps these and appends the cost model's flag
    env["LIBTPU_INIT_ARGS"] = (env.get("LIBTPU_INIT_ARGS", "") + " " + libtpu_flags).strip()
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
  lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
  if not lines:
    tail = [ln for ln in proc.stderr.splitlines() if ln.startswith("F") or "Error" in ln]
    raise KernelError("block_sizes", blocks, "the compiler or its cost model crashed: "
                      + (tail[0][:160] if tail else f"exit {proc.returncode}"))
  out = json.loads(lines[-1])
  if "error" in out:
    raise KernelError("block_sizes", blocks, out["error"])
  return out


def _effective(blocks, m, k, n, dtype):
  return mm.fit_block_sizes(mm.BlockSizes(*blocks), m, k, n, dtype)


def tune(gen, dtype, m, k, n, log=print, max_evals=40, candidates=None):
  """Hill-climbs from the seeds (or tries only ``candidates``); returns the best blocks."""
  seen: dict[tuple, dict | None] = {}

  def try_blocks(blocks):
    eff = dataclasses.astuple(_effective(blocks, m, k, n, dtype))
    if eff in seen or len(seen) >= max_evals:
      return seen.get(eff)
    try:
      r = estimate_isolated(gen, dtype, m, k, n, mm.BlockSizes(*eff))
    except KernelError as e:  # does not fit VMEM, breaks the tiling rule, or fails to compile
      log(f"    {eff}: skipped ({str(e).splitlines()[0][:120]})")
      seen[eff] = None
      return None
    seen[eff] = r
    log(f"    {eff}: {r['us']:.1f} us, {100 * r['fraction_of_roofline']:.1f}% of roofline")
    return r

  for s in candidates or SEEDS:
    try_blocks(s)
  while not candidates:
    scored = [(r["us"], b) for b, r in seen.items() if r is not None]
    if not scored:
      raise RuntimeError(f"no candidate compiled for {gen} {dtype} {m}x{k}x{n}")
    best_us, best = min(scored)
    for axis, values in enumerate((BM, BK, BN)):
      i = values.index(best[axis]) if best[axis] in values else None
      for j in ((i - 1, i + 1) if i is not None else ()):
        if 0 <= j < len(values):
          cand = list(best)
          cand[axis] = values[j]
          try_blocks(tuple(cand))
    new_us, _ = min((r["us"], b) for b, r in seen.items() if r is not None)
    if new_us >= best_us or len(seen) >= max_evals:
      break
  best_us, best = min((r["us"], b) for b, r in seen.items() if r is not None)
  return best, seen[best], len([r for r in seen.values() if r is not None])


def _fits(gen, dtype, m, k, n, blocks) -> bool:
  """True if the kernel's own VMEM plan accepts ``blocks`` on ``gen`` (the check it runs before lowering)."""
  from kernels.base.backend import target
  p = mm._Problem(m=m, k=k, n=n, batch=(), a_batch=(), b_batch=(), transpose_a=False, transpose_b=False,
                  dtype=jnp.dtype(dtype), out_dtype=jnp.dtype(jnp.bfloat16), has_bias=False, activation=None,
                  dropout_rate=0.0, precision=None, quantized=jnp.dtype(dtype).itemsize == 1)
  with target(gen):
    try:
      mm._plan(p, mm.BlockSizes(*blocks), save_z=False)
      return True
    except KernelError:
      return False


def _derive_v4(table):
  """v4 has no cost model: take v5p's blocks and halve the largest until they fit its 16 MiB of VMEM."""
  v4 = {}
  for dtype, entries in table["defaults"].get("v5p", {}).items():
    if dtype not in mm.MXU_DTYPES["v4"]:
      continue  # Mosaic has no int8/fp8 MXU path on v4
    out = []
    for e in entries:
      b = [e["bm"], e["bk"], e["bn"]]
      while not _fits("v4", dtype, e["m"], e["k"], e["n"], b):
        b[b.index(max(b))] //= 2
      bm, bk, bn = dataclasses.astuple(_effective(b, e["m"], e["k"], e["n"], dtype))
      out.append({"m": e["m"], "k": e["k"], "n": e["n"], "bm": bm, "bk": bk, "bn": bn,
                  "source": "v5p's choice, fitted to v4's 16 MiB VMEM (libtpu has no cost model for v4)"})
    v4[dtype] = out
  table["defaults"]["v4"] = v4


def _xla_fields(gen, dtype, m, k, n, ours):
  """XLA's estimate, as compiled by default and without cross-program prefetch, and our speed ratio to each."""
  out = {}
  for key, flags in (("xla", ""), ("xla_no_cross_program_prefetch", NO_CROSS_PROGRAM_PREFETCH)):
    try:
      out[key] = estimate_isolated(gen, dtype, m, k, n, libtpu_flags=flags)
    except Exception as e:  # noqa: BLE001 - keep the kernel's result even if XLA's estimate fails
      out[key] = {"error": str(e).splitlines()[0][:200]}
    if "us" in out[key]:
      out["speed_vs_" + key] = round(out[key]["us"] / ours["us"], 4)
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--generations", nargs="*", default=list(GENERATIONS))
  ap.add_argument("--dtypes", nargs="*", default=list(PROBLEMS))
  ap.add_argument("--problems", nargs="*", help="MxKxN; default: PROBLEMS for each dtype")
  ap.add_argument("--out", default=OUT)
  ap.add_argument("--force", action="store_true", help="re-tune problems already in the table")
  ap.add_argument("--max-evals", type=int, default=40)
  ap.add_argument("--candidates", nargs="*", help="bm,bk,bn blocks to try instead of hill climbing "
                  "(for large problems, where each estimate takes minutes)")
  ap.add_argument("--xla-only", action="store_true", help="only (re-)estimate XLA for problems in the table")
  ap.add_argument("--one", nargs=8, metavar=("GEN", "DTYPE", "M", "K", "N", "BM", "BK", "BN"),
                  help="estimate one configuration (BM=0: XLA) and print it as JSON (used internally)")
  args = ap.parse_args(argv)
  if args.one:
    gen, dtype, *dims = args.one
    m, k, n, bm, bk, bn = map(int, dims)
    try:
      r = estimate(gen, dtype, m, k, n, mm.BlockSizes(bm, bk, bn) if bm else None)
    except KernelError as e:
      r = {"error": str(e).splitlines()[0][:300]}
    print(json.dumps(r), flush=True)
    return
  if not kernels.estimator_available():
    sys.exit("the TPU compiler's cost model is unavailable (needs jax[tpu]; import kernels before jax)")

  table = result_tables.load(args.out)
  table.update({
      "description": DESCRIPTION,
      "generated_by": "tools/tune_matmul.py",
      "environment": {"jax": jax.__version__, "python": platform.python_version()},
  })
  table.setdefault("defaults", {})
  t_all = time.time()
  for gen in args.generations:
    for dtype in args.dtypes:
      problems = ([tuple(map(int, p.split("x"))) for p in args.problems] if args.problems else PROBLEMS[dtype])
      entries = table["defaults"].setdefault(gen, {}).setdefault(dtype, [])
      for (m, k, n) in problems:
        done = next((e for e in entries if (e["m"], e["k"], e["n"]) == (m, k, n)), None)
        if args.xla_only:
          if done:
            print(f"{gen} {dtype} {m}x{k}x{n}: XLA", flush=True)
            done.update(_xla_fields(gen, dtype, m, k, n, done["estimate"]))
            result_tables.save(table, args.out)
          continue
        if done and not args.force:
          continue
        t0 = time.time()
        print(f"{gen} {dtype} {m}x{k}x{n}", flush=True)
        cands = [tuple(map(int, c.split(","))) for c in args.candidates] if args.candidates else None
        best, r, tried = tune(gen, dtype, m, k, n, log=lambda s: print(s, flush=True), max_evals=args.max_evals,
                              candidates=cands)
        entry = {"m": m, "k": k, "n": n, "bm": best[0], "bk": best[1], "bn": best[2], "estimate": r,
                 "candidates": tried, "tuned": datetime.date.today().isoformat()}
        entry.update(_xla_fields(gen, dtype, m, k, n, r))
        entry["wall_seconds"] = round(time.time() - t0)
        if done:
          entries.remove(done)
        entries.append(entry)
        print(f"  -> {best}: {r['us']:.1f} us; XLA {entry['xla'].get('us', float('nan')):.1f} us, without "
              f"cross-program prefetch {entry['xla_no_cross_program_prefetch'].get('us', float('nan')):.1f} us "
              f"(compiler estimates, TPU {gen}) in {time.time() - t0:.0f} s", flush=True)
        if "v5p" in table["defaults"]:
          _derive_v4(table)
        result_tables.save(table, args.out)
  print(f"done in {time.time() - t_all:.0f} s")


if __name__ == "__main__":
  main()
