"""Tunes kernels.gmm's blocks and benchmarks gmm / tgmm against their peers, with the TPU compiler's cost model.

Every number is a **compiler estimate** (``kernels.estimate_tpu``, libtpu's static cost
model), never a measurement, stored with :meth:`kernels.perf.tpu.Estimate.record`: ``us`` is
the floored estimate (the model's time, never less than the program's counted HBM bytes at
the published bandwidth); ``model_us`` and ``floor_us`` stay beside it.

*How our kernels are estimated.* The cost model reads scalar-prefetched values as 0, so an
estimate of the dynamic kernel (visit tables prefetched) sees every visit at group 0,
tile 0 and no DMA: not trustworthy. Ours are therefore estimated with
:func:`kernels.experts.grouped.gmm_static_groups` / ``tgmm_static_groups``: the same kernel body and
index maps with the case's group sizes as compile-time constants (``method:
"static offsets"``; the tests check in interpret mode that it computes what the dynamic
kernel computes). ``ours_dynamic`` is the dynamic kernel's estimate, kept only to show the
blind spot (``method: "dynamic (prefetched tables read as 0)"``).

*Peers.* ``ragged_dot`` (``jax.lax.ragged_dot``, XLA:TPU's grouped matmul), megablox's
``gmm`` (``jax.experimental.pallas.ops.tpu.megablox``; its group metadata is also
scalar-prefetched, and its grid length computed at run time, which the model cannot see:
it is given metadata computed from the case's sizes at trace time, ``tools/peers.py``,
and its tables still read as 0, so it is charged at least its compulsory bytes) at its
default tiling (128, 128, 128) and at (512, 1024, 1024), and a dense capacity einsum: each
expert multiplies a ``[capacity, k]`` slab, capacity = 1.25 x tokens / E (rounded up to 8),
``einsum("eck,ekn->ecn")`` (the expert matmul of GShard's dense layout; the dispatch and
combine einsums are not included).

*Cases.* ``E8``: 8192 rows (routed tokens), E=8, k=4096, n=14336, group sizes ``balanced``
(1024 each), ``skewed`` ([4096, 2048, 1024, 512, 256, 128, 64, 64]) and ``empty`` (2048 in
every other group, 0 in the rest). ``E64``: 8192 tokens x top-8 = 65536 rows, E=64,
k=2048, n=1408, balanced. Every program is first estimated at full size. Where that needs
more memory than ``--max-rss-gb`` (16 GB by default; the cost model's memory grows with the
number of grid steps and experts), E64 is estimated at 4 and 8 experts with the same 1024
rows each and extrapolated linearly in the experts (``scaled``; the slices under ``slices``,
the E=2 slice as a check that the cost is affine: see ``estimate_experts_slices``), and E8 on
a slice of n (``FALLBACK_N``: 2048 columns forward, 1024 forward + backward; the n tiles are
independent grid steps), with ``us`` scaled by ``n / n_slice`` (``scaled_by``; the slice's
own numbers under ``slice``). Scaling a slice charges the pipeline's fill and drain once
per slice, so it overstates a kernel whose first blocks are large: the full-size estimate
is preferred, and ``full_size_error`` says why a record did not get one. The roofline (``fraction_of_roofline``) is on the
FLOPs actually needed, ``2 * rows * k * n`` (x3 with the backward), and the compulsory
bytes (each operand read once, each result written once).

*In pieces* (``--pieces``; records keyed ``.../pieces``): where libtpu's profiled compile
fails on VMEM for a whole forward + backward (E8 on v5e, even the backward alone), the
program is estimated as the sum of its pieces cut at the Pallas kernels
(:func:`kernels.estimate_tpu_pieces`), each kernel in a child process of its own.

Each estimate runs in a child process (the cost model can abort); results are written after
each one, so an interrupted run resumes. Run under the shared lock::

  flock /tmp/tpu-heavy.lock nice -n 10 python tools/tune_gmm.py tune
  flock /tmp/tpu-heavy.lock nice -n 10 python tools/tune_gmm.py bench
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import peers  # noqa: E402  (tools/peers.py: megablox with its real grid)
import results as result_tables  # noqa: E402  (tools/results.py: the JSON tables)
import kernels  # noqa: E402  (first: enables the cost model before JAX loads libtpu)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kernels.experts import grouped as gm

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels", "data")
BLOCKS_OUT = os.path.join(DATA, "gmm_blocks.json")
BENCH_OUT = os.path.join(DATA, "gmm_bench.json")
GENERATIONS = ("v5e", "v6e")
KERNEL_VERSION = 3  # 2: the whole-tile and sub-tile gates are per-visit tables; 3: one dot site per path (the
# same code as 2 where K fits one block, e.g. the forward at the default tk)

CASES = {
    "E8": dict(rows=8192, k=4096, n=14336, experts=8),
    "E64": dict(rows=65536, k=2048, n=1408, experts=64, experts_slices=(4, 8, 2)),
}
SKEW = [4096, 2048, 1024, 512, 256, 128, 64, 64]
MEGABLOX_TILINGS = {"megablox_default": (128, 128, 128), "megablox_large": (512, 1024, 1024)}
CAPACITY = 1.25


def _c(case) -> dict:
  """A case's sizes: ``case`` is a name in CASES or an already resolved dict (see :func:`_case`)."""
  return CASES[case] if isinstance(case, str) else case


def _case(cfg) -> dict:
  """The sizes of ``cfg``'s program: its case, or with ``experts`` set (an experts slice, see
  :func:`estimate_isolated`) that many experts with the case's rows per expert."""
  c = CASES[cfg["case"]]
  e = cfg.get("experts")
  if not e or e == c["experts"]:
    return c
  assert c["rows"] % c["experts"] == 0
  return dict(c, experts=e, rows=c["rows"] // c["experts"] * e)


def group_sizes(case, groups: str) -> np.ndarray:
  c = _c(case)
  e, m = c["experts"], c["rows"]
  if groups == "balanced":
    return np.full(e, m // e, np.int32)
  if groups == "skewed":
    assert e == len(SKEW) and sum(SKEW) == m
    return np.asarray(SKEW, np.int32)
  if groups == "empty":  # every other group empty, the rest balanced
    return np.asarray([2 * m // e if i % 2 == 0 else 0 for i in range(e)], np.int32)
  raise ValueError(groups)


def flops(case, mode: str, n: int | None = None) -> float:
  c = _c(case)
  f = 2.0 * c["rows"] * c["k"] * (n or c["n"])
  return {"fwd": 1, "bwd": 2, "fwdbwd": 3}[mode] * f


def bytes_needed(case: str, mode: str, n: int | None = None) -> float:
  """Compulsory bf16 bytes. Forward: lhs, rhs read, out written. Forward + backward: lhs, rhs, dout
  read; out, dlhs, drhs written."""
  c = _c(case)
  n = n or c["n"]
  lhs, rhs, out = c["rows"] * c["k"], c["experts"] * c["k"] * n, c["rows"] * n
  if mode == "bwd":  # lhs, rhs, dout read; dlhs, drhs written
    return 2.0 * (2 * (lhs + rhs) + out)
  return 2.0 * ((lhs + rhs + out) if mode == "fwd" else 2 * (lhs + rhs + out))


def capacity(case) -> int:
  c = _c(case)
  return int(math.ceil(CAPACITY * c["rows"] / c["experts"] / 8) * 8)


FALLBACK_N = {"fwd": 2048, "fwdbwd": 1024, "bwd": 1024}  # E8's slice of n when the full program needs too much memory


def _n(cfg) -> int:
  return cfg.get("n") or CASES[cfg["case"]]["n"]


def _program(cfg):
  c = _case(cfg)
  m, k, e = c["rows"], c["k"], c["experts"]
  n = _n(cfg)
  bf16, sds = jnp.bfloat16, jax.ShapeDtypeStruct
  gs = group_sizes(c, cfg["groups"])
  impl = cfg["impl"]
  blocks = tuple(cfg["blocks"]) if cfg.get("blocks") else None
  if cfg.get("kernel") == "tgmm":  # tgmm alone (tuning): lhs [k, rows], rhs [rows, n]
    args = (sds((k, m), bf16), sds((m, n), bf16))
    return (lambda a, b: gm.tgmm_static_groups(a, b, gs, block_sizes=blocks)), args
  lhs, rhs, dout = sds((m, k), bf16), sds((e, k, n), bf16), sds((m, n), bf16)
  gsa = jnp.asarray(gs)
  if impl == "ours":
    fwd = lambda a, b: gm.gmm_static_groups(a, b, gs, block_sizes=blocks)  # noqa: E731
  elif impl == "ours_dynamic":
    fwd = lambda a, b: kernels.gmm(a, b, gsa, block_sizes=blocks)  # noqa: E731
  elif impl == "ragged_dot":
    fwd = lambda a, b: jax.lax.ragged_dot(a, b, gsa)  # noqa: E731
  elif impl in MEGABLOX_TILINGS:
    from jax.experimental.pallas.ops.tpu.megablox import ops as mb  # noqa: PLC0415
    peers.megablox_with_known_groups(gs)  # its real grid (tools/peers.py)
    tiling = tuple(min(t, d) for t, d in zip(MEGABLOX_TILINGS[impl], (m, k, n)))
    fwd = lambda a, b: mb.gmm(a, b, gsa, jnp.bfloat16, tiling)  # noqa: E731
  elif impl == "dense":
    cap = capacity(c)
    lhs, dout = sds((e, cap, k), bf16), sds((e, cap, n), bf16)
    fwd = lambda a, b: jnp.einsum("eck,ekn->ecn", a, b)  # noqa: E731
  else:
    raise ValueError(impl)
  if cfg["mode"] == "fwd":
    return fwd, (lhs, rhs)

  def fwdbwd(a, b, dy):
    out, vjp = jax.vjp(fwd, a, b)
    return out, vjp(dy)

  def bwd(a, b, dy):  # the backward alone: the forward's output is unused, so XLA drops it
    return jax.vjp(fwd, a, b)[1](dy)
  return (bwd if cfg["mode"] == "bwd" else fwdbwd), (lhs, rhs, dout)


PIECES = result_tables.PIECES


def method(impl: str) -> str:
  if impl == "ours":
    return "static offsets (group sizes as compile-time constants; same kernel body)"
  if impl.startswith("megablox"):
    return peers.METHOD
  if impl == "ours_dynamic":
    return "dynamic (prefetched group tables, read as 0 by the cost model: not trustworthy)"
  return "XLA program"


def estimate(cfg) -> dict:
  fn, args = _program(cfg)
  n = _n(cfg)
  c = _case(cfg)
  # In pieces (--pieces): cut at the Pallas kernels, each piece estimated in a child of its own.
  estimator = functools.partial(kernels.estimate_tpu_pieces, isolate=True) if cfg.get("in_pieces") \
      else kernels.estimate_tpu
  e = estimator(fn, *args, generation=cfg["generation"], flops=flops(c, cfg["mode"], n),
                bytes_accessed=bytes_needed(c, cfg["mode"], n))
  r = e.record()
  r.update(compile_seconds=round(e.compile_seconds, 1), n_slice=n)
  return r


MAX_RSS_GB = 16.0  # --max-rss-gb (this machine has 24 GB)
TIMEOUT = None  # --timeout (seconds per estimate; None: no limit)


def run_guarded(cfg) -> dict:
  """The ``one`` job in a child process, stopped if its resident memory passes MAX_RSS_GB (the shared
  machine's limit for one job, ``--max-rss-gb``) or it runs longer than TIMEOUT (``--timeout``)."""
  import subprocess  # noqa: PLC0415
  import time  # noqa: PLC0415
  proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "one", json.dumps(cfg)],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
  peak, t0 = 0.0, time.time()
  while proc.poll() is None:
    peak = max(peak, result_tables.rss_gb(proc.pid))
    if peak > MAX_RSS_GB or (TIMEOUT and time.time() - t0 > TIMEOUT):
      result_tables.kill_tree(proc)
      return {"error": (f"stopped: the estimate passed {MAX_RSS_GB:g} GB of memory" if peak > MAX_RSS_GB
                        else f"stopped: the estimate took longer than {TIMEOUT:g} s"), "peak_rss_gb": round(peak, 1)}
    time.sleep(0.5)
  lines = [ln for ln in proc.stdout.read().splitlines() if ln.startswith("{")]
  r = json.loads(lines[-1]) if lines else {"error": f"exit {proc.returncode}"}
  r["peak_rss_gb"] = round(peak, 1)
  return r


def estimate_experts_slices(cfg) -> dict:
  """The case estimated at fewer experts with the same rows per expert, extrapolated linearly in the
  number of experts (E64: the full program's cost model needs more memory than this machine has).

  Why linear: with balanced groups of ``rows / E`` rows (E64: 1024, a multiple of every ``tm`` used),
  every group is whole m-tiles, so each of our kernels' grid walks per group the same visits (the
  same blocks, the same work) and the visit axis is ``m_tiles + E`` long (the padding visits, one per
  expert, fetch and compute nothing); the grid runs sequentially on the one TensorCore of v5e / v6e.
  So the program at E' experts costs ``a + b * E'`` (``a``: the pipeline's fill and drain), and so do
  the dense einsum (its batch dimension is the experts) and the compulsory bytes. The first two
  slices fix ``a`` and ``b``; the third one (``affine_check``) is compared with the line's prediction,
  a check that the model's cost really is affine in E' (its model time and counted HBM bytes within
  AFFINE_TOLERANCE of the line, else the record is an error, slices kept). ``us`` is then ``max(model_us, floor_us)`` of
  the extrapolated model time and floor."""
  c = CASES[cfg["case"]]
  e_full = c["experts"]
  fit, check = c["experts_slices"][:2], c["experts_slices"][2:]
  parts = {e: run_guarded(dict(cfg, experts=e)) for e in (*fit, *check)}
  return extrapolate_experts(cfg, parts)


AFFINE_TOLERANCE = 0.05  # the largest relative miss of the check slice allowed


def extrapolate_experts(cfg, parts: dict) -> dict:
  """:func:`estimate_experts_slices`'s extrapolation from its slices' records ``{experts: record}``. The
  check slice's model time and counted HBM bytes must lie on the line (within AFFINE_TOLERANCE), else
  the result is an error (the program is not affine in the experts, so the line is not trusted)."""
  c = CASES[cfg["case"]]
  e_full = c["experts"]
  fit, check = c["experts_slices"][:2], c["experts_slices"][2:]
  if not all("us" in parts[e] for e in fit):
    return {"error": "experts slices: " + "; ".join(f"E={e}: {p.get('error', 'ok')}" for e, p in parts.items()),
            "slices": {f"E={e}": p for e, p in parts.items()}}
  (e1, p1), (e2, p2) = [(e, parts[e]) for e in fit]

  def line(key, e):
    return p1[key] + (p2[key] - p1[key]) * (e - e1) / (e2 - e1)
  out = {"scaled": f"linear in the number of experts at {c['rows'] // e_full} rows each, from E={e1} and E={e2}",
         "slices": {f"E={e}": p for e, p in parts.items()}}
  for key in ("model_us", "floor_us", "hbm_bytes"):
    out[key] = round(line(key, e_full), 3)
  out["us"] = max(out["model_us"], out["floor_us"])
  out["floored"] = out["floor_us"] >= out["model_us"]
  out["valid"] = all(parts[e].get("valid", True) for e in fit)
  misses = []
  for e in check:
    if "us" not in parts[e]:
      misses.append(f"E={e} not estimated ({parts[e].get('error')})")
      continue
    for key in ("model_us", "hbm_bytes"):
      got, want = parts[e][key], line(key, e)
      out.setdefault("affine_check", {}).setdefault(f"E={e}", {}).update({key: got, f"predicted_{key}": round(want, 3)})
      if abs(got - want) > AFFINE_TOLERANCE * abs(want):
        misses.append(f"E={e}: {key} {got:g}, the line predicts {want:.6g}")
  if misses:
    pts = ", ".join(f"E={e}: model {p.get('model_us')} us, {p.get('hbm_bytes', 0) / 1e6:.1f} MB"
                    for e, p in sorted(parts.items()))
    return {"error": (f"not estimated: the experts slices are not affine in the number of experts ({'; '.join(misses)}; "
                      f"slices {pts}), so the extrapolation to E={e_full} is not trusted"),
            "slices": out["slices"], "affine_check": out.get("affine_check")}
  n = _n(cfg)
  chip = kernels.get_chip(cfg["generation"])
  rl = kernels.roofline_of(flops(c, cfg["mode"], n), bytes_needed(c, cfg["mode"], n), chip, "bfloat16")
  out["fraction_of_roofline"] = round(rl.seconds / (out["us"] * 1e-6), 4)
  return out


def estimate_isolated(cfg) -> dict:
  """The full-size estimate, else (it needed more memory than MAX_RSS_GB) E64's experts slices or
  E8's slice of n, scaled."""
  c = CASES[cfg["case"]]
  r = run_guarded(cfg)
  if "us" in r or "memory" not in r.get("error", ""):
    return r
  full_size_error = r["error"]
  if c.get("experts_slices") and not cfg.get("experts"):
    r = estimate_experts_slices(cfg)
  else:
    cfg = dict(cfg, n=FALLBACK_N[cfg["mode"]])
    r = run_guarded(cfg)
  r = _scaled_to_n(cfg, r)
  r["full_size_error"] = full_size_error
  return r


def _scaled_to_n(cfg, r) -> dict:
  c = CASES[cfg["case"]]
  n = _n(cfg)
  if "us" in r and n != c["n"]:  # scale the slice to the full n
    s = c["n"] / n
    r = {"slice": r, "scaled_by": s, "us": round(r["us"] * s, 2), "model_us": round(r["model_us"] * s, 2),
         "floor_us": round(r["floor_us"] * s, 2), "fraction_of_roofline": r.get("fraction_of_roofline"),
         "valid": r.get("valid", True), "floored": r.get("floored")}
  return r


def _header(description):
  return {"description": description, "generated_by": "tools/tune_gmm.py", "kind": "compiler estimate (floored)",
          "environment": {"jax": jax.__version__, "python": platform.python_version()}}


# --- tune -------------------------------------------------------------------------------

# Tall m-tiles read each expert's weights once per n-tile for groups of up to tm rows; tk = k (4096)
# keeps a group's weights in VMEM across its tiles, so skewed groups re-read nothing.
GMM_CANDIDATES = [(512, 2048, 2048), (1024, 1024, 2048), (1024, 2048, 2048), (1024, 4096, 2048)]
TGMM_CANDIDATES = [(512, 2048, 2048), (1024, 2048, 2048), (512, 4096, 2048)]


def tune(args):
  table = result_tables.load(BLOCKS_OUT) or _header("")
  table["description"] = (
      "Default blocks (tm, tk, tn) of kernels.gmm's two kernels per TPU generation. Chosen from compiler "
      "estimates (libtpu's static cost model, floored; estimates, not measurements) of the static-offsets kernel "
      "(group sizes as compile-time constants) on the E8 case at full size (8192 rows, E=8, k=4096, n=14336): "
      "gmm ranked on balanced + skewed forward us, tgmm ([k, rows] x [rows, n] -> [E, k, n]) on balanced us. "
      "v5p and v4 copy v5e (not swept; v4 has no cost model); kernels.gmm shrinks blocks that do not fit VMEM.")
  defaults = table.setdefault("defaults", {})
  for gen in args.generations:
    entry = {k: v for k, v in defaults.get(gen, {}).items() if k not in args.kernels}
    for kernel, cands, groups in (("gmm", GMM_CANDIDATES, ("balanced", "skewed")), ("tgmm", TGMM_CANDIDATES,
                                                                                    ("balanced",))):
      if kernel not in args.kernels:
        continue
      sweep = {}
      for blocks in cands:
        for g in groups:
          cfg = dict(generation=gen, impl="ours", case="E8", groups=g, mode="fwd", blocks=list(blocks),
                     kernel=kernel)
          r = run_guarded(cfg)
          sweep[(blocks, g)] = r
          print(gen, kernel, blocks, g, r.get("us"), r.get("model_us"), r.get("error", ""), flush=True)
      scores = {b: sum(sweep[(b, g)]["us"] for g in groups) for b in cands
                if all("us" in sweep[(b, g)] and sweep[(b, g)].get("valid", True) for g in groups)}
      if not scores:
        continue
      best = min(scores, key=scores.get)
      entry[kernel] = {"tm": best[0], "tk": best[1], "tn": best[2],
                       "sweep": {f"{b[0]}x{b[1]}x{b[2]}/{g}": ({"us": v["us"], "model_us": v["model_us"]}
                                                               if "us" in v else v)
                                 for (b, g), v in sorted(sweep.items())},
                       "kernel": KERNEL_VERSION, "tuned": datetime.date.today().isoformat()}
    if entry:
      defaults[gen] = entry
      # v5p (64 MiB of VMEM) and v4 (16 MiB) are not swept and keep their entries: v5e's tall blocks do not
      # compile gmm's forward + backward at the E8 shape there (tests/test_gmm.py compiles it on each chip).
      result_tables.save(table, BLOCKS_OUT)


# --- bench ------------------------------------------------------------------------------

BENCH = [  # (case, groups, impl, mode), the most needed first
    *[("E8", g, "ours", "fwd") for g in ("balanced", "skewed", "empty")],
    ("E8", "balanced", "dense", "fwd"),
    ("E8", "balanced", "megablox_large", "fwd"), ("E8", "balanced", "megablox_default", "fwd"),
    ("E8", "balanced", "ours", "fwdbwd"), ("E8", "balanced", "dense", "fwdbwd"),
    ("E64", "balanced", "ours", "fwd"),
    ("E8", "balanced", "ragged_dot", "fwd"), ("E8", "skewed", "ours", "fwdbwd"),
    ("E64", "balanced", "ours", "fwdbwd"), ("E64", "balanced", "dense", "fwd"),
    ("E64", "balanced", "megablox_large", "fwd"), ("E64", "balanced", "ragged_dot", "fwd"),
    ("E8", "skewed", "megablox_large", "fwd"), ("E8", "skewed", "ragged_dot", "fwd"),
    ("E8", "balanced", "ours_dynamic", "fwd"),
]


def split_fwdbwd(cfg, results) -> dict:
  """Forward + backward as the stored forward record plus the backward alone (the whole
  program's profiled compile can fail on VMEM where each half compiles; a TPU runs the two
  one after the other, so the estimates add up: ``--split-check`` compares with a whole one)."""
  fwd_key = "/".join([cfg["generation"], cfg["case"], cfg["groups"], cfg["impl"], "fwd"])
  fwd = results.get(fwd_key, {})
  if "us" not in fwd:
    return {"error": f"split: no stored forward estimate ({fwd_key})"}
  bwd = estimate_isolated(dict(cfg, mode="bwd"))
  if "us" not in bwd:
    return {"error": f"split: the backward alone: {bwd.get('error')}"}
  out = {key: round(fwd[key] + bwd[key], 3) for key in ("us", "model_us", "floor_us")}  # (slices come scaled)

  def hbm(r):
    return r["hbm_bytes"] if "hbm_bytes" in r else r["slice"]["hbm_bytes"] * r["scaled_by"]
  out["hbm_bytes"] = int(hbm(fwd) + hbm(bwd))
  out["valid"] = bool(fwd.get("valid", True) and bwd.get("valid", True))
  chip = kernels.get_chip(cfg["generation"])
  rl = kernels.roofline_of(flops(cfg["case"], "fwdbwd"), bytes_needed(cfg["case"], "fwdbwd"), chip, "bfloat16")
  out["fraction_of_roofline"] = round(rl.seconds / (out["us"] * 1e-6), 4)
  out["split"] = f"the stored forward ({fwd_key}) plus the backward alone, each estimated on its own"
  out["parts"] = {"fwd": fwd_key, "bwd": bwd}
  return out


def bench(args):
  table = result_tables.load(BENCH_OUT) or _header("")
  table["description"] = __doc__.split("Each estimate runs")[0].strip()
  table["cases"] = {k: dict(v, group_sizes={g: group_sizes(k, g).tolist() for g in ("balanced", "skewed", "empty")
                                            if k == "E8" or g == "balanced"})
                    for k, v in CASES.items()}
  table["capacity_factor"] = CAPACITY
  results = table.setdefault("results", {})
  for case, groups, impl, mode in BENCH:
    for gen in args.generations:
      if (args.impls and impl not in args.impls) or (args.modes and mode not in args.modes):
        continue
      if args.stop_at and time.time() > args.stop_at:
        print("stopping: --stop-at reached", flush=True)
        return
      key = f"{gen}/{case}/{groups}/{impl}/{mode}" + ("/pieces" if args.pieces else "")  # beside the whole record
      if key in results and "us" in results[key] and not (args.force or (args.split_check and args.split_fwdbwd)):
        continue
      cfg = dict(generation=gen, impl=impl, case=case, groups=groups, mode=mode)
      if args.pieces:
        cfg["in_pieces"] = True
      if args.split_fwdbwd and mode == "fwdbwd":
        r = split_fwdbwd(cfg, results)
        whole = results.get(key, {})
        if args.split_check and "us" in whole:  # beside the stored whole estimate, not instead of it
          table.setdefault("split_check", {})[key] = {"whole_us": whole["us"], "split_us": r.get("us"),
                                                      "error": r.get("error")}
          print(key, "whole", whole["us"], "split", r.get("us"), r.get("error", ""), flush=True)
          result_tables.save(table, BENCH_OUT)
          continue
        if "us" not in r and "error" in whole:
          r["whole_error"] = whole["error"]
      else:
        r = estimate_isolated(cfg)
      r = result_tables.physical(r)
      r.update(cfg, method=method(impl) + ("; " + PIECES if args.pieces else ""))
      if impl.startswith("ours"):
        r["kernel"] = KERNEL_VERSION
        c = CASES[case]
        with kernels.base.backend.target(gen):
          plan, _ = gm._plan("gmm", c["rows"], c["k"], c["n"], c["experts"], gm.GmmBlockSizes(), jnp.bfloat16,
                             jnp.bfloat16, jnp.bfloat16, chip=kernels.get_chip(gen))
        r["blocks"] = dict(tm=plan.tm, tk=plan.tk, tn=plan.tn)
      results[key] = r
      print(key, r.get("us"), r.get("model_us"), r.get("fraction_of_roofline"), r.get("error", ""), flush=True)
      result_tables.save(table, BENCH_OUT)


def main(argv=None):
  global MAX_RSS_GB, TIMEOUT
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("job", choices=("tune", "bench", "one"))
  ap.add_argument("config", nargs="?", help="(one) a JSON configuration, used internally")
  ap.add_argument("--generations", nargs="*", default=list(GENERATIONS))
  ap.add_argument("--impls", nargs="*", default=None)
  ap.add_argument("--modes", nargs="*", default=None, help="(bench) fwd and/or fwdbwd")
  ap.add_argument("--kernels", nargs="*", default=["gmm", "tgmm"], help="(tune) which kernels to tune")
  ap.add_argument("--force", action="store_true")
  ap.add_argument("--split-fwdbwd", action="store_true",
                  help="(bench) forward + backward as the stored forward plus the backward alone (split_fwdbwd)")
  ap.add_argument("--split-check", action="store_true",
                  help="(bench, with --split-fwdbwd) store the split beside the whole estimate (split_check)")
  ap.add_argument("--pieces", action="store_true",
                  help="(bench) estimate each program as the sum of its pieces cut at the Pallas kernels "
                       "(kernels.estimate_tpu_pieces; records keyed .../pieces)")
  ap.add_argument("--stop-at", type=float, default=None, help="(bench) start no estimate after this Unix time")
  ap.add_argument("--max-rss-gb", type=float, default=MAX_RSS_GB, help="stop an estimate above this much RAM")
  ap.add_argument("--timeout", type=float, default=None, help="stop an estimate after this many seconds")
  args = ap.parse_args(argv)
  MAX_RSS_GB, TIMEOUT = args.max_rss_gb, args.timeout
  if args.job == "one":
    result_tables.print_result(estimate, args.config)
    return
  (tune if args.job == "tune" else bench)(args)


if __name__ == "__main__":
  main()
