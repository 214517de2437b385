"""Tunes kernels.norm's rows per block and benchmarks it against XLA, with the TPU compiler's cost model.

Two jobs, two files in ``kernels/data/``; every number is a **compiler estimate**
(``kernels.estimate_tpu``, libtpu's static cost model), never a measurement, stored with
:meth:`kernels.perf.tpu.Estimate.record`: ``us`` is the floored estimate (the model's time, but
never less than the program's counted HBM bytes at the published bandwidth); the model's
own time (``model_us``) and the floor (``floor_us``) stay beside it and are never ranked on.

* ``tune`` -> ``norm_blocks.json``: for v5e, v5p and v6e, bf16, widths 1024 and 4096
  (8192 rows), layer and RMS norm, with and without the fused residual: the current
  default rows and their neighbours (half and double), for the forward alone and as
  ``jax.grad`` runs it (ranked on the sum of the two), then the backward rows and their
  neighbours (estimated as forward + backward with the chosen forward). Candidates within
  1% of the best floored time are ties, and among ties the current default stays (no churn
  for a gain only the model sees); if it is not among them, the tied candidate whose rows
  are closest to it (log2 distance) wins. v4 has no cost model: its entries are v5p's (the
  kernel shrinks blocks that do not fit v4's VMEM). ``--jobs`` estimates run at once.
  Entries tuned for an older ``KERNEL_VERSION`` are tuned again.
* ``bench`` -> ``norm_bench.json``: 8192 rows, widths 1024, 4096 and 16384, bf16, on
  v5e and v6e: layer and RMS norm, with and without the residual, forward alone (and
  forward plus backward at widths 1024 and 4096), ours (default blocks) against XLA's jnp
  composition (``kernels.norm.*_reference``, which XLA fuses itself; with the residual it
  is the unfused composition ``h = x + r``, norm, autodiff), and, without the residual,
  against ``tokamax.layer_norm`` (the best public normalization for a TPU; it runs its XLA
  implementation there) when tokamax imports. Also a plain copy of a
  ``[8192, width]`` bf16 array, by XLA (``x * 2``) and by a Pallas copy kernel: under the
  floor both sit at the published bandwidth, which checks the floor, not the kernels.

Each estimate runs in a child process (libtpu's cost model can abort a process);
results are written after each one, so an interrupted run resumes. Run it under the
shared lock::

  flock /tmp/tpu-heavy.lock nice -n 10 python tools/tune_norm.py tune
  flock /tmp/tpu-heavy.lock nice -n 10 python tools/tune_norm.py bench
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import fcntl
import itertools
import json
import math
import os
import platform
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import results as result_tables  # noqa: E402  (tools/results.py: the JSON tables)
import kernels  # noqa: E402  (first: enables the cost model before JAX loads libtpu)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from kernels.norm import api as nm
from kernels.base import tiling
from kernels.perf import traffic

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels", "data")
BLOCKS_OUT = os.path.join(DATA, "norm_blocks.json")
BENCH_OUT = os.path.join(DATA, "norm_bench.json")

ROWS = 8192
TUNE_GENERATIONS = ("v5e", "v5p", "v6e")
TUNE_WIDTHS = (1024, 4096)
TIE = 0.01  # candidates within 1% of the best floored time are ties
BENCH_GENERATIONS = ("v5e", "v6e")
# A stored result is recomputed unless it carries its implementation's current version:
# forward + backward programs are version 2 (they return the residual's gradient once; see _program);
# our kernel is version 9 (6: chunked math, split input DMAs, cheaper backward, backward operands pinned to HBM: 2026-11-22;
# streamed column sweeps at widths >= 4096, RMS add-and-norm rows tuned on their own: 2026-11-23);
# 7: the forward saves the row statistics for the streamed backward; 8: the backward forms u once, the
# forward computes in 8-row chunks (2026-11-23); 9: the residual is added in the rows' dtype (2026-11-24);
# 10: the kernels write their row outputs back themselves, several DMAs a block (kernels.pipeline; 2026-11-25);
# 11: that write-back and the two-DMA input reads removed, every block on Pallas's pipeline; every
# estimate stored floored (Estimate.record()).
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


def _tokamax() -> bool:
  """Whether tokamax imports: the best public normalization for a TPU. Its release ships Triton
  and Mosaic GPU kernels only, so on a TPU ``tokamax.layer_norm`` runs its XLA implementation."""
  try:
    import tokamax  # noqa: F401
  except ImportError:
    print("tokamax is not importable: its rows are skipped (pip install tokamax, or PYTHONPATH)")
    return False
  return True


def bytes_moved(cfg) -> int:
  """HBM bytes the program must move (the roofline's numerator), bf16: each input read once, each
  output written once. The forward reads x (and r) and writes y (and h). Forward + backward as one
  program reads x, dy (and r, dh) and writes y, dx (and h): the backward's second read of x (or h),
  which separate passes need, is not compulsory inside one program (XLA can keep it in VMEM)."""
  n = ROWS * cfg["hidden"] * jnp.dtype(cfg["dtype"]).itemsize
  if cfg["impl"].startswith("copy"):
    return 2 * n
  if cfg["mode"] == "fwdbwd":
    return (7 if cfg["residual"] else 4) * n
  return (4 if cfg["residual"] else 2) * n


def _program(cfg):
  """The function and argument shapes ``cfg`` describes."""
  h, dtype = cfg["hidden"], jnp.dtype(cfg["dtype"])
  x = jax.ShapeDtypeStruct((ROWS, h), dtype)
  vec = jax.ShapeDtypeStruct((h,), jnp.float32)
  if cfg["impl"] == "copy_xla":
    return (lambda x: x * 2), (x,)
  if cfg["impl"] == "copy_pallas":
    from jax.experimental import pallas as pl
    rows = cfg.get("rows") or min(256, max(8, (2 << 20) // (h * 2)))  # (blocks of at most 2 MiB: fits v5e at 16384)

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
  elif cfg["impl"] == "tokamax":  # tokamax's layer_norm: on a TPU it has only its XLA implementation
    import tokamax
    norm = lambda x, r, s, b: tokamax.layer_norm(x, s, b if layer else None, subtract_mean=layer,  # noqa: E731
                                                 implementation="xla")
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
  """The floored compiler estimate of ``cfg``'s program, as a stored table keeps it (``Estimate.record()``)."""
  fn, args = _program(cfg)
  e = kernels.estimate_tpu(fn, *args, generation=cfg["generation"], flops=0, bytes_accessed=bytes_moved(cfg))
  return e.record()


# Estimates already made, by program (tune and bench estimate some of the same programs; a run that
# stops and resumes does not repeat them). Only an accelerator: the tables never read it.
CACHE = os.environ.get("TUNE_NORM_CACHE", os.path.join(tempfile.gettempdir(), "tune_norm_estimates.jsonl"))
_cache_lock = threading.Lock()
# Forward + backward programs at widths >= 4096 take several GB each to estimate: one at a time.
_heavy = threading.Semaphore(1)


def _cache_key(cfg) -> str:
  keys = ("generation", "impl", "kind", "dtype", "hidden", "residual", "mode", "rows", "backward_rows")
  return json.dumps({**{k: cfg.get(k) for k in keys}, "version": _version(cfg), "harness": _harness(cfg),
                     "jax": jax.__version__, "counter": traffic.COUNTER_VERSION}, sort_keys=True)


def _cached(key: str) -> dict | None:
  if not os.path.exists(CACHE):
    return None
  with _cache_lock, open(CACHE, encoding="utf-8") as fh:
    found = None
    for line in fh:
      k, _, v = line.rstrip("\n").partition("\t")
      if k == key:
        found = json.loads(v)
    return found


def estimate_isolated(cfg) -> dict:
  """:func:`estimate` in a child process (or the cached result of the same program)."""
  key = _cache_key(cfg)
  hit = _cached(key)
  if hit is not None:
    return hit
  heavy = cfg.get("mode") == "fwdbwd" and cfg["hidden"] >= 4096 or cfg["hidden"] >= 16384
  with _heavy if heavy else contextlib.nullcontext():
    r = result_tables.run_child([os.path.abspath(__file__), "one", json.dumps(cfg)])
  if "us" in r or r.get("error", "").startswith("CompileError"):  # (deterministic results only)
    with _cache_lock, open(CACHE, "a", encoding="utf-8") as fh:
      fh.write(f"{key}\t{json.dumps(r)}\n")
  return r


def default_rows(cfg) -> dict:
  """The rows per block :func:`kernels.norm.api.layer_norm` picks by default for ``cfg`` on its generation."""
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


def pick(estimates: dict[int, float], current: int) -> int:
  """The rows to keep among ``{rows: floored us}``: the fastest, except that candidates within
  :data:`TIE` of it are ties, among which ``current`` stays, or else the one closest to it."""
  best = min(estimates.values())
  ties = [r for r, us in estimates.items() if us <= best * (1 + TIE)]
  if current in ties:
    return current
  return min(ties, key=lambda r: (abs(math.log2(r / current)), estimates[r], r))


def _neighbours(rows: int, cfg: dict, backward: bool) -> list[int]:
  """``rows`` and its half and double, those the kernel would really use (no block of fewer than 8 rows,
  none beyond the array, none that :func:`kernels.norm.api.fit_block_sizes` would shrink to a smaller one)."""
  out = []
  for r in (rows // 2, rows, rows * 2):
    if r < 8 or r > ROWS:
      continue
    b = nm.BlockSizes(ROWS, r) if backward else nm.BlockSizes(r, ROWS)
    f = nm.fit_block_sizes(b, ROWS, cfg["hidden"], cfg["dtype"], residual=cfg["residual"],
                           params=2 if cfg["kind"] == "layer" else 1, chip=cfg["generation"])
    if (f.backward_rows if backward else f.rows) == r:
      out.append(r)
  return out or [rows]


def _us(record: dict) -> float | None:
  """The floored time of a stored estimate, None if it failed or is not valid (faster than the roofline)."""
  return record["us"] if "us" in record and record.get("valid", True) else None


def tune(args):
  table = result_tables.load(BLOCKS_OUT) or _header("")
  table["description"] = (
      "Default rows per block of kernels.norm (forward 'rows', backward 'backward_rows') per TPU generation and "
      "dtype, for the tuned widths (8192 rows; layer and RMS norm, with and without the fused residual, each); a "
      "call uses the nearest width and scales the rows to keep the block's bytes. Chosen from compiler estimates "
      "(libtpu's static cost model; estimates, not measurements): us is the floored compiler estimate, the cost "
      "model's time (model_us) but never less than the program's counted HBM bytes at the published bandwidth "
      "(floor_us). Candidates (the previous rows, half and double) within 1% of the best us are ties, and the "
      "previous rows stay among ties. v4 (no cost model) copies v5p.")
  table["kind"] = "compiler estimate (floored)"
  defaults = table.setdefault("defaults", {})
  for gen in args.generations:
    for hidden, kind, residual in itertools.product(args.widths, args.kinds, (False, True)):
      entries = defaults.setdefault(gen, {}).setdefault("bfloat16", [])
      same = lambda e: (e["hidden"], e.get("kind", "layer"), e.get("residual", True)) == (hidden, kind, residual)  # noqa: E731
      old = next((e for e in entries if same(e)), None)
      # (Entries tuned for an older kernel version are tuned again.)
      if old is not None and old.get("kernel", 0) >= KERNEL_VERSION and not args.force:
        continue
      t0 = time.time()
      base = dict(generation=gen, kind=kind, dtype="bfloat16", hidden=hidden, residual=residual, impl="ours")
      # The current default: the table's present choice (what a call gets today).
      cur = ({"rows": old["rows"], "backward_rows": old["backward_rows"]} if old is not None
             else default_rows(base))
      # The forward's rows, alone and as jax.grad runs it (saving the row statistics at widths >= 4096),
      # which can rank differently; the sum of the two is ranked.
      grid = _neighbours(cur["rows"], base, backward=False)
      saves = nm._streams(hidden, jnp.bfloat16, 128)  # (narrower rows save nothing: the same program twice)
      modes = ("fwd", "fwdgrad") if saves else ("fwd",)
      cfgs = [dict(base, mode=m, rows=r, backward_rows=cur["backward_rows"]) for m in modes for r in grid]
      est = _sweep(cfgs, args.jobs)
      fwd, fwdgrad = dict(zip(grid, est[:len(grid)])), dict(zip(grid, est[-len(grid):]))
      for r in grid:
        print(f"{gen} {kind} H={hidden} residual={residual} forward rows={r}: {fwd[r]}; under grad: {fwdgrad[r]}",
              flush=True)
      score = {r: _us(fwd[r]) + _us(fwdgrad[r]) for r in grid if _us(fwd[r]) and _us(fwdgrad[r])}
      # The backward (estimated as forward + backward with the forward), for the forwards in the order
      # the tie rule prefers them: the first whose forward + backward program compiles. (On v5p, XLA can
      # place so many temporaries of the forward + backward program in VMEM that a forward block which
      # compiles alone no longer fits.)
      order = []
      while len(order) < len(score):
        order.append(pick({r: v for r, v in score.items() if r not in order}, cur["rows"]))
      bwd = {}
      for best in order:
        rows_b = _neighbours(cur["backward_rows"], base, backward=True)
        bwd_cfgs = [dict(base, mode="fwdbwd", rows=best, backward_rows=r) for r in rows_b]
        bwd = dict(zip(rows_b, _sweep(bwd_cfgs, args.jobs)))
        for r, v in bwd.items():
          print(f"{gen} {kind} H={hidden} residual={residual} forward+backward rows={best}/{r}: {v}", flush=True)
        if any(_us(v) for v in bwd.values()):
          break
      else:
        print(f"{gen} {kind} H={hidden} residual={residual}: no candidate compiled; entry left as it was", flush=True)
        continue
      best_b = pick({r: _us(v) for r, v in bwd.items() if _us(v)}, cur["backward_rows"])
      sweep = lambda d: {str(r): {"us": v.get("us"), "model_us": v.get("model_us")} if "us" in v  # noqa: E731
                         else {"error": v.get("error")} for r, v in d.items()}
      entries[:] = [e for e in entries if not same(e)] + [{
          "hidden": hidden, "kind": kind, "residual": residual, "rows": best, "backward_rows": best_b,
          "previous": cur, "forward": fwd[best], "forward_under_grad": fwdgrad[best],
          "forward_and_backward": bwd[best_b], "forward_sweep": sweep(fwd),
          "forward_under_grad_sweep": sweep(fwdgrad), "backward_sweep": sweep(bwd),
          "kernel": KERNEL_VERSION, "tuned": datetime.date.today().isoformat(),
          "wall_seconds": round(time.time() - t0)}]
      entries.sort(key=lambda e: (e["hidden"], e.get("kind", "layer"), e.get("residual", True)))
      if "v5p" in defaults:
        defaults["v4"] = {"bfloat16": [dict(e, source="v5p's choice (libtpu has no cost model for v4)")
                                       for e in defaults["v5p"]["bfloat16"]]}
      result_tables.save(table, BLOCKS_OUT)


def derive(table: dict) -> int:
  """Recomputes every stored record's roofline fields (``bytes``, ``fraction_of_roofline``,
  ``valid``) from its floored time and :func:`bytes_moved`; returns how many records changed."""
  changed = 0

  def fix(r, cfg):
    nonlocal changed
    if "us" not in r:
      return
    b = bytes_moved(cfg)
    frac = round(b / kernels.get_chip(cfg["generation"]).hbm_bandwidth / (r["us"] * 1e-6), 4)
    new = {"fraction_of_roofline": frac, "valid": frac <= 1.0 + 1e-9 and not r.get("unmodeled")}
    if "bytes" in r:
      new["bytes"] = b
    changed += any(r.get(k) != v for k, v in new.items())
    r.update(new)

  for r in table.get("results", {}).values():
    fix(r, r)
  for gen, per_dtype in table.get("defaults", {}).items():
    if gen == "v4":  # (copies of v5p's records)
      continue
    for dtype, entries in per_dtype.items():
      for e in entries:
        for field, mode in (("forward", "fwd"), ("forward_under_grad", "fwdgrad"), ("forward_and_backward", "fwdbwd")):
          if isinstance(e.get(field), dict):
            fix(e[field], {"generation": gen, "impl": "ours", "dtype": dtype, "hidden": e["hidden"],
                           "residual": e.get("residual", True), "mode": mode})
  return changed


def _current(r: dict, cfg: dict) -> bool:
  """Whether a stored result is up to date: floored on today's byte count, and of its implementation's
  current version (an older count is redone by ``tools/refloor.py norm_bench --recount-all``, which keeps
  the model's time)."""
  return ("floor_us" in r and r.get("program", 1) >= _version(cfg) and r.get("harness", 1) >= _harness(cfg)
          and r.get("counter", 1) >= traffic.COUNTER_VERSION)


def bench(args):
  table = result_tables.load(BENCH_OUT) or _header("")
  table["description"] = (
      "kernels.norm.api against XLA's jnp composition at 8192 rows, bf16: compiler estimates (libtpu's static cost "
      "model), not measurements. us is the floored compiler estimate: the cost model's time (model_us), never less "
      "than the program's counted HBM bytes (hbm_bytes) at the published bandwidth (floor_us); fraction_of_roofline "
      "is 'bytes' (what a fused implementation must move through HBM) at the published bandwidth over us. "
      "'copy_*' estimate a plain copy of one [8192, width] array (XLA's x * 2 and a Pallas copy kernel).")
  table["kind"] = "compiler estimate (floored)"
  results = table.setdefault("results", {})
  for r in results.values():  # (blocks of older tables carried the removed output_dmas)
    r.get("blocks", {}).pop("output_dmas", None)
  configs = []
  # (Out-of-date results of other widths are recomputed first.)
  stale = sorted({(r["generation"], r["hidden"]) for r in results.values() if not _current(r, r)})
  for gen, hidden in stale + [(g, h) for g in args.generations for h in args.widths if (g, h) not in stale]:
    for impl in ("copy_xla", "copy_pallas"):
      if args.impls and impl not in args.impls:
        continue
      configs.append(dict(generation=gen, impl=impl, dtype="bfloat16", hidden=hidden))
    for kind in ("layer", "rms"):
      for residual in (False, True):
        for mode in ("fwd", "fwdbwd") if hidden in BENCH_BACKWARD_WIDTHS else ("fwd",):
          for impl in ("ours", "xla", "tokamax"):
            if (args.impls and impl not in args.impls) or (impl == "tokamax" and (residual or not _tokamax())):
              continue  # (tokamax has no fused residual: with one it is XLA's composition)
            configs.append(dict(generation=gen, kind=kind, dtype="bfloat16", hidden=hidden, residual=residual,
                                mode=mode, impl=impl))
  key = lambda cfg: "/".join(str(cfg.get(k)) for k in ("generation", "impl", "kind", "hidden", "residual", "mode"))  # noqa: E731

  def todo(cfg):
    return args.force or not _current(results.get(key(cfg), {}), cfg)

  lock = threading.Lock()

  def run(cfg):
    # Ours runs with the default rows per block (from the table at the time), passed explicitly: the same
    # program, and the same cache entry as tune's estimate of those rows.
    blocks = default_rows(cfg) if cfg["impl"] == "ours" else {}
    r = dict(estimate_isolated(dict(cfg, **blocks)))
    r.update(cfg, bytes=bytes_moved(cfg), program=_version(cfg), harness=_harness(cfg))
    if blocks:
      r["blocks"] = blocks
    with lock, open(os.path.join(tempfile.gettempdir(), "norm_bench.lock"), "a") as fh:  # (written after each estimate, so an interrupted run
      fcntl.flock(fh, fcntl.LOCK_EX)                  # resumes; merged, so two runs can share the table)
      results.update(result_tables.load(BENCH_OUT).get("results", {}))
      results[key(cfg)] = r
      print(key(cfg), r.get("us"), r.get("model_us"), r.get("error", ""), flush=True)
      result_tables.save(table, BENCH_OUT)

  with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
    list(pool.map(run, [c for c in configs if todo(c)]))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("job", choices=("tune", "bench", "one", "derive"))
  ap.add_argument("config", nargs="?", help="(one) a JSON configuration, used internally")
  ap.add_argument("--generations", nargs="*")
  ap.add_argument("--widths", nargs="*", type=int)
  ap.add_argument("--kinds", nargs="*", default=["layer", "rms"])
  ap.add_argument("--impls", nargs="*", help="(bench) only these implementations: ours, xla, tokamax, copy_xla, copy_pallas")
  ap.add_argument("--force", action="store_true")
  ap.add_argument("--tables", nargs="*", help="(derive) these table files (default: both)")
  ap.add_argument("--jobs", type=int, default=2, help="estimates run at once, each in its own process")
  args = ap.parse_args(argv)
  if args.job == "one":
    result_tables.print_result(estimate, args.config)
    return
  if args.job == "derive":  # (after a change to bytes_moved: no estimate runs)
    for path in (args.tables or (BENCH_OUT, BLOCKS_OUT)):
      table = result_tables.load(path)
      print(f"{path}: {derive(table)} records re-derived")
      result_tables.save(table, path)
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
