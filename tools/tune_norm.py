"""Tunes kernels.norm's rows per block and benchmarks it against XLA, with the TPU compiler's cost model.

Two jobs, two files in ``kernels/data/``; every number is a **compiler estimate**
(``kernels.estimate_tpu``, libtpu's static cost model), never a measurement.

* ``tune`` -> ``norm_blocks.json``: for v5e, v5p and v6e, bf16, a few widths
  (8192 rows), layer and RMS norm, with and without the fused residual: the forward at
  several block sizes (rows x width x 2 bytes from 512 KiB to 4 MiB), alone and as
  ``jax.grad`` runs it (the best sum of the two wins), then the backward pass at several
  sizes (estimated as forward + backward with the best forward). v4 has no cost model:
  its entries are v5p's (the kernel shrinks blocks that do not fit v4's VMEM). ``--jobs``
  estimates run at once. Entries tuned for an older ``KERNEL_VERSION`` are tuned again.
* ``bench`` -> ``norm_bench.json``: 8192 rows, widths 1024, 4096 and 16384, bf16, on
  v5e and v6e: layer and RMS norm, with and without the residual, forward alone (and
  forward plus backward at width 4096), ours (default blocks) against XLA's jnp composition
  (``kernels.norm.*_reference``, which XLA fuses itself; with the residual it is the
  unfused composition ``h = x + r``, norm, autodiff). Also a plain copy of a
  ``[8192, width]`` bf16 array, by XLA (``x * 2``) and by a Pallas copy kernel: the
  cost model's own HBM bandwidth, against which a memory-bound kernel is judged
  (the model's HBM is ~2x faster than the published figure).

Each estimate runs in a child process (libtpu's cost model can abort a process);
results are written after each one, so an interrupted run resumes. Run it under the
shared lock::

  flock /tmp/tpu-heavy.lock python tools/tune_norm.py tune
  flock /tmp/tpu-heavy.lock python tools/tune_norm.py bench
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import importlib
import itertools
import json
import os
import platform
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import results as result_tables  # noqa: E402  (tools/results.py: the JSON tables)
import kernels  # noqa: E402  (first: enables the cost model before JAX loads libtpu)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

nm = importlib.import_module("kernels.norm")
tiling = importlib.import_module("kernels.tiling")

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels", "data")
BLOCKS_OUT = os.path.join(DATA, "norm_blocks.json")
BENCH_OUT = os.path.join(DATA, "norm_bench.json")

ROWS = 8192
TUNE_GENERATIONS = ("v5e", "v5p", "v6e")
TUNE_WIDTHS = (1024, 4096)
BLOCK_BYTES = (512 << 10, 1 << 20, 2 << 20, 4 << 20)
BACKWARD_BLOCK_BYTES = (1 << 20, 2 << 20, 4 << 20)
BENCH_GENERATIONS = ("v5e", "v6e")
# A stored result is recomputed unless it carries its implementation's current version:
# forward + backward programs are version 2 (they return the residual's gradient once; see _program);
# our kernel is version 9 (6: chunked math, split input DMAs, cheaper backward, backward operands pinned to HBM: 2026-11-22;
# streamed column sweeps at widths >= 4096, RMS add-and-norm rows tuned on their own: 2026-11-23);
# 7: the forward saves the row statistics for the streamed backward; 8: the backward forms u once, the
# forward computes in 8-row chunks (2026-11-23); 9: the residual is added in the rows' dtype (2026-11-24);
# 10: the kernels write their row outputs back themselves, several DMAs a block (kernels.pipeline; 2026-11-25);
# 11: that write-back and the two-DMA input reads removed, every block on Pallas's pipeline.
PROGRAM_VERSION = 2
KERNEL_VERSION = 11


def _version(cfg) -> int:
  return KERNEL_VERSION if cfg["impl"] == "ours" else PROGRAM_VERSION if cfg.get("mode") == "fwdbwd" else 1


def _harness(cfg) -> int:
  """Version of the benchmark program itself: forward + backward without the residual is version 2
  (it no longer returns the unused residual input's zero gradient, an [8192, width] broadcast that the
  estimate used to include: ~120 us of 330 at width 4096 on v5e)."""
  return 2 if cfg.get("mode") == "fwdbwd" and not cfg.get("residual") else 1
BENCH_WIDTHS = (1024, 4096, 16384)
BENCH_BACKWARD_WIDTHS = (1024, 4096)  # forward + backward (XLA's program takes minutes to estimate)


def bytes_moved(cfg) -> int:
  """HBM bytes the fused kernels must move (the roofline's numerator), bf16."""
  n = ROWS * cfg["hidden"] * jnp.dtype(cfg["dtype"]).itemsize
  if cfg["impl"].startswith("copy"):
    return 2 * n
  fwd = (4 if cfg["residual"] else 2) * n   # read x (and r), write y (and h)
  bwd = (4 if cfg["residual"] else 3) * n   # read h, dy (and dh), write dx
  return fwd + (bwd if cfg["mode"] == "fwdbwd" else 0)


def _program(cfg):
  """The function and argument shapes ``cfg`` describes."""
  h, dtype = cfg["hidden"], jnp.dtype(cfg["dtype"])
  x = jax.ShapeDtypeStruct((ROWS, h), dtype)
  vec = jax.ShapeDtypeStruct((h,), jnp.float32)
  if cfg["impl"] == "copy_xla":
    return (lambda x: x * 2), (x,)
  if cfg["impl"] == "copy_pallas":
    from jax.experimental import pallas as pl
    rows = cfg.get("rows") or 256

    def copy(x):
      def body(i_ref, o_ref):
        o_ref[...] = i_ref[...]
      spec = pl.BlockSpec((rows, h), lambda i: (i, 0))
      return pl.pallas_call(body, grid=(ROWS // rows,), in_specs=[spec], out_specs=spec,
                            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
    return copy, (x,)
  layer = cfg["kind"] == "layer"
  if cfg["impl"] == "ours":
    blocks = nm.BlockSizes(cfg.get("rows"), cfg.get("backward_rows"))
    if layer:
      norm = lambda x, r, s, b: nm.layer_norm(x, s, b, residual=r, block_sizes=blocks)  # noqa: E731
    else:
      norm = lambda x, r, s, b: nm.rms_norm(x, s, residual=r, block_sizes=blocks)  # noqa: E731
  else:
    if layer:
      norm = lambda x, r, s, b: nm.layer_norm_reference(x, s, b, residual=r)  # noqa: E731
    else:
      norm = lambda x, r, s, b: nm.rms_norm_reference(x, s, residual=r)  # noqa: E731
  residual = cfg["residual"]

  def fwd(x, r, s, b):
    return norm(x, r if residual else None, s, b)

  if cfg["mode"] == "fwd":
    return fwd, (x, x, vec, vec)
  if cfg["mode"] == "fwdgrad":  # the forward as jax.grad runs it: it also saves what the backward needs
    return (lambda x, r, s, b: jax.vjp(fwd, x, r, s, b)[0]), (x, x, vec, vec)

  def fwdbwd(x, r, s, b, dy, dh):
    if not residual:  # (r is unused: its gradient would be a materialised array of zeros)
      out, vjp = jax.vjp(lambda x, s, b: fwd(x, None, s, b), x, s, b)
      return out, vjp(dy)
    out, vjp = jax.vjp(fwd, x, r, s, b)
    grads = vjp((dy, dh))
    # The residual's gradient is x's (d(x + r)/dr = 1), so it is returned once: returning the
    # same array twice makes XLA copy it into a second output buffer (a full extra pass).
    dx, _, ds, db = grads
    return out, (dx, ds, db)
  return fwdbwd, (x, x, vec, vec, x, x)


def estimate(cfg) -> dict:
  fn, args = _program(cfg)
  e = kernels.estimate_tpu(fn, *args, generation=cfg["generation"], flops=0, bytes_accessed=bytes_moved(cfg))
  return {"us": round(e.seconds * 1e6, 3), "fraction_of_roofline": round(e.fraction_of_roofline, 4),
          "valid": e.valid}


def estimate_isolated(cfg) -> dict:
  """:func:`estimate` in a child process."""
  proc = subprocess.run([sys.executable, os.path.abspath(__file__), "one", json.dumps(cfg)], capture_output=True,
                        text=True, timeout=1800)
  lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
  if not lines:
    tail = [ln for ln in proc.stderr.splitlines() if ln.startswith("F") or "Error" in ln]
    return {"error": (tail[-1][:200] if tail else f"exit {proc.returncode}")}
  return json.loads(lines[-1])


def default_rows(cfg) -> dict:
  """The rows per block :func:`kernels.norm.layer_norm` picks by default for ``cfg`` on its generation."""
  tiling.block_table.cache_clear()
  d = nm.default_block_sizes(cfg["generation"], cfg["dtype"], cfg["hidden"], cfg["kind"], cfg["residual"])
  f = nm.fit_block_sizes(d, ROWS, cfg["hidden"], cfg["dtype"], residual=cfg["residual"],
                         params=2 if cfg["kind"] == "layer" else 1, chip=cfg["generation"])
  return {"rows": f.rows, "backward_rows": f.backward_rows}


def _header(description):
  return {"description": description, "generated_by": "tools/tune_norm.py", "kind": "compiler estimate",
          "environment": {"jax": jax.__version__, "python": platform.python_version()}, "rows": ROWS}


def _sweep(configs: list[dict], jobs: int) -> list[dict]:
  """:func:`estimate_isolated` of each configuration, ``jobs`` child processes at a time."""
  with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
    return list(pool.map(estimate_isolated, configs))


def tune(args):
  table = result_tables.load(BLOCKS_OUT) or _header(
      "Default rows per block of kernels.norm (forward 'rows', backward 'backward_rows') per TPU generation and "
      "dtype, for the tuned widths (8192 rows; layer and RMS norm, with and without the fused residual, each); a "
      "call uses the nearest width and scales the rows to keep the block's bytes. Chosen from compiler estimates "
      "(libtpu's static cost model): estimates, not measurements. v4 (no cost model) copies v5p.")
  defaults = table.setdefault("defaults", {})
  for gen in args.generations:
    for hidden, kind, residual in itertools.product(args.widths, args.kinds, (False, True)):
      entries = defaults.setdefault(gen, {}).setdefault("bfloat16", [])
      same = lambda e: (e["hidden"], e.get("kind", "layer"), e.get("residual", True)) == (hidden, kind, residual)  # noqa: E731
      # (Entries tuned for an older kernel version are tuned again.)
      if any(same(e) and e.get("kernel", 0) >= KERNEL_VERSION for e in entries) and not args.force:
        continue
      t0 = time.time()
      base = dict(generation=gen, kind=kind, dtype="bfloat16", hidden=hidden, residual=residual, impl="ours")
      # The forward's rows, alone and as jax.grad runs it (saving the row statistics at widths >= 4096),
      # which the cost model can rank differently; the best sum of the two wins.
      grid = sorted({max(8, b // (hidden * 2)) for b in BLOCK_BYTES})
      saves = nm._streams(hidden, jnp.bfloat16, 128)  # (narrower rows save nothing: the same program twice)
      modes = ("fwd", "fwdgrad") if saves else ("fwd",)
      cfgs = [dict(base, mode=m, rows=r, backward_rows=r) for m in modes for r in grid]
      est = _sweep(cfgs, args.jobs)
      fwd, fwdgrad = dict(zip(grid, est[:len(grid)])), dict(zip(grid, est[-len(grid):]))
      for r in grid:
        print(f"{gen} {kind} H={hidden} residual={residual} forward rows={r}: {fwd[r]}; under grad: {fwdgrad[r]}",
              flush=True)
      # The backward (estimated as forward + backward with the forward), for the forwards in order of
      # fwd + fwdgrad: the best whose forward + backward program compiles. (On v5p, XLA can place so
      # many temporaries of the forward + backward program in VMEM that a forward block which compiles
      # alone no longer fits, e.g. layer add-and-norm at 4096 x 512 rows.)
      ranked = sorted((k for k in grid if "us" in fwd[k] and "us" in fwdgrad[k]),
                      key=lambda k: fwd[k]["us"] + fwdgrad[k]["us"])
      rows_b = sorted({max(8, b // (hidden * 2)) for b in BACKWARD_BLOCK_BYTES})
      for best in ranked:
        bwd_cfgs = [dict(base, mode="fwdbwd", rows=best, backward_rows=r) for r in rows_b]
        bwd = dict(zip(rows_b, _sweep(bwd_cfgs, args.jobs)))
        for r, v in bwd.items():
          print(f"{gen} {kind} H={hidden} residual={residual} forward+backward rows={best}/{r}: {v}", flush=True)
        if any("us" in v for v in bwd.values()):
          break
      best_b = min((r for r in bwd if "us" in bwd[r]), key=lambda r: bwd[r]["us"])
      entries[:] = [e for e in entries if not same(e)] + [{
          "hidden": hidden, "kind": kind, "residual": residual, "rows": best, "backward_rows": best_b,
          "forward": fwd[best], "forward_under_grad": fwdgrad[best], "forward_and_backward": bwd[best_b],
          "forward_sweep": {str(r): v.get("us") for r, v in fwd.items()},
          "forward_under_grad_sweep": {str(r): v.get("us") for r, v in fwdgrad.items()},
          "backward_sweep": {str(r): v.get("us") for r, v in bwd.items()},
          "kernel": KERNEL_VERSION, "tuned": datetime.date.today().isoformat(),
          "wall_seconds": round(time.time() - t0)}]
      entries.sort(key=lambda e: (e["hidden"], e.get("kind", "layer"), e.get("residual", True)))
      if "v5p" in defaults:
        defaults["v4"] = {"bfloat16": [dict(e, source="v5p's choice (libtpu has no cost model for v4)")
                                       for e in defaults["v5p"]["bfloat16"]]}
      result_tables.save(table, BLOCKS_OUT)


def bench(args):
  table = result_tables.load(BENCH_OUT) or _header(
      "kernels.norm against XLA's jnp composition at 8192 rows, bf16: compiler estimates (libtpu's static cost "
      "model), not measurements. 'bytes' is what a fused implementation must move through HBM; "
      "'copy_*' estimate a plain copy of one [8192, width] array, the cost model's own HBM bandwidth.")
  results = table.setdefault("results", {})
  configs = []
  # (Out-of-date results of other widths are recomputed first.)
  stale = sorted({(r["generation"], r["hidden"]) for r in results.values()
                  if r.get("program", 1) < _version(r) or r.get("harness", 1) < _harness(r)})
  for gen, hidden in stale + [(g, h) for g in args.generations for h in args.widths if (g, h) not in stale]:
    for impl in ("copy_xla", "copy_pallas"):
      configs.append(dict(generation=gen, impl=impl, dtype="bfloat16", hidden=hidden))
    for kind in ("layer", "rms"):
      for residual in (False, True):
        for mode in ("fwd", "fwdbwd") if hidden in BENCH_BACKWARD_WIDTHS else ("fwd",):
          for impl in ("ours", "xla"):
            configs.append(dict(generation=gen, kind=kind, dtype="bfloat16", hidden=hidden, residual=residual,
                                mode=mode, impl=impl))
  key = lambda cfg: "/".join(str(cfg.get(k)) for k in ("generation", "impl", "kind", "hidden", "residual", "mode"))  # noqa: E731

  def todo(cfg):
    old = results.get(key(cfg), {})
    current = old.get("program", 1) >= _version(cfg) and old.get("harness", 1) >= _harness(cfg)
    return args.force or "us" not in old or not current

  lock = threading.Lock()

  def run(cfg):
    r = estimate_isolated(cfg)
    r.update(cfg, bytes=bytes_moved(cfg), program=_version(cfg), harness=_harness(cfg))
    if cfg["impl"] == "ours":  # the default rows per block the estimate used (from the table at the time)
      r["blocks"] = default_rows(cfg)
    with lock:  # (written after each estimate, so an interrupted run resumes)
      results[key(cfg)] = r
      print(key(cfg), r.get("us"), r.get("error", ""), flush=True)
      result_tables.save(table, BENCH_OUT)

  with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
    list(pool.map(run, [c for c in configs if todo(c)]))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("job", choices=("tune", "bench", "one"))
  ap.add_argument("config", nargs="?", help="(one) a JSON configuration, used internally")
  ap.add_argument("--generations", nargs="*")
  ap.add_argument("--widths", nargs="*", type=int)
  ap.add_argument("--kinds", nargs="*", default=["layer", "rms"])
  ap.add_argument("--force", action="store_true")
  ap.add_argument("--jobs", type=int, default=2, help="estimates run at once, each in its own process")
  args = ap.parse_args(argv)
  if args.job == "one":
    try:
      print(json.dumps(estimate(json.loads(args.config))))
    except Exception as e:  # noqa: BLE001 - reported to the parent
      print(json.dumps({"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}))
    return
  if args.job == "tune":
    args.generations = args.generations or list(TUNE_GENERATIONS)
    args.widths = args.widths or list(TUNE_WIDTHS)
    tune(args)
  else:
    args.generations = args.generations or list(BENCH_GENERATIONS)
    args.widths = args.widths or list(BENCH_WIDTHS)
    bench(args)


if __name__ == "__main__":
  main()
