"""Tunes kernels.ssd's chunk and heads per step, and benchmarks ssd against the plain-JAX chunked SSD, with the
TPU compiler's cost model.

Every number is a **compiler estimate** (``kernels.estimate_tpu``, libtpu's static cost model), never a
measurement, stored with :meth:`kernels.perf.tpu.Estimate.record`: ``us`` is the floored estimate (the model's time,
never less than the program's counted HBM bytes at the published bandwidth).

The problem is Mamba-2's: batch 1, ``seq`` 8192, 32 heads x 64 head_dim, state 128, one group, bf16 ``x``, ``B``,
``C`` (f32 ``dt`` and ``A``), with ``D``. Every program is estimated at the full sequence (``--seq``/``--seqs``
may ask for a slice, whose times are then scaled by ``8192 / seq``, the ``scale`` of each record, but a slice
misleads: the model charges every XLA op a fixed cost that a scaled slice multiplies, and XLA lays out and
fuses a small program differently). The forward takes seconds to a minute; the static profile of a forward +
backward of ours at 8192 tokens needs more than this machine's 24 GB, so ``bench`` extrapolates ours' forward +
backward from slices of 2048 and 4096 tokens, fitting ``a + b * seq`` to each of the model's time and the floor
(:func:`estimate_affine`; the records say so in ``method``). The peer's forward + backward fits at the full size
on v5e (about 12 GB), while its 4096-token slice did not (the profile's memory is not monotonic in the size); on
v6e neither fits, and it was extrapolated from 1024 and 2048 tokens (``--affine-impls chunked_xla --affine 1024
2048``). ``--check-affine`` runs the extrapolation on the forwards, whose full-size estimates exist.

* ``tune`` -> ``ssd_blocks.json``: on v5e and v6e, forward alone, every chunk in {128, 256} and heads per step
  in {8, 16, 32}; the fastest wins (within 1%: the smaller VMEM plan) among chunks no wider than the MXU (a
  wider chunk only adds vector work, so a gain the model gives it has no physical reason). v5p and v4 copy
  v5e's choice.
* ``bench`` -> ``ssd_bench.json``: on v5e and v6e, forward and forward + backward: ours (default blocks; forward +
  backward once with each backward, the Pallas reverse pass ``kernels/_ssd_bwd.py`` and the VJP of the chunked XLA
  algorithm, keys ``ours+pallas_bwd`` / ``ours+xla_bwd`` and field ``backward``) and
  :func:`kernels.scan.chunked.ssd_chunked_xla` (chunk 128 and 256), with
  the roofline on both sides: HBM (``x``, ``B``, ``C`` read once, ``y`` written once) and MXU (the chunked
  algorithm's useful matmul FLOPs at the chip's bf16 peak).

Each estimate runs in a child process, results are written after each one (a run resumes). Run it under the
shared lock::

  flock /tmp/tpu-heavy.lock nice -n 10 python tools/tune_ssd.py tune
  flock /tmp/tpu-heavy.lock nice -n 10 python tools/tune_ssd.py bench
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

from kernels.scan import chunked as ssd

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels", "data")
BLOCKS_OUT = os.path.join(DATA, "ssd_blocks.json")
BENCH_OUT = os.path.join(DATA, "ssd_bench.json")

SHAPE = dict(batch=1, seq=8192, heads=32, head_dim=64, groups=1, state=128)
GENERATIONS = ("v5e", "v6e")
CHUNKS = (128, 256)
HEADS_PER_STEP = (8, 16, 32)
TIE = 0.01
KERNEL_VERSION = 5  # 1: forward kernel (slabs of 128 lanes, heads unrolled per step); 2: + Pallas backward; 3: D as per-head rows;
# 4: the backward sums Q over sublanes on the VPU
# 5: chunk-local cumulative sums as a matmul with a triangle of ones, not jnp.cumsum
BACKWARDS = ("pallas", "xla")  # ours' backward in fwdbwd records: kernels/_ssd_bwd.py or ssd_chunked_xla's VJP


def problem(seq: int):
  s = dict(SHAPE, seq=seq)
  return ssd._Problem(s["batch"], seq, s["heads"], s["head_dim"], s["groups"], s["state"], jnp.dtype(jnp.bfloat16),
                      True, False)


def flops(seq: int, chunk: int, mode: str) -> int:
  """The chunked algorithm's useful matmul FLOPs (forward; a backward does about twice the forward's)."""
  return ssd._flops(problem(seq), chunk) * (3 if mode == "fwdbwd" else 1)


def bytes_moved(seq: int, mode: str) -> int:
  """Compulsory HBM bytes: forward reads x, B, C (bf16) and dt (f32), writes y; forward + backward also reads
  dy and writes dx, dB, dC, ddt."""
  s = SHAPE
  x = s["batch"] * seq * s["heads"] * s["head_dim"] * 2
  bc = 2 * s["batch"] * seq * s["groups"] * s["state"] * 2
  dt = s["batch"] * seq * s["heads"] * 4
  fwd = 2 * x + bc + dt
  return fwd if mode == "fwd" else 2 * fwd + x


def _program(cfg):
  s = dict(SHAPE, seq=cfg["seq"])
  b, t, h, p, g, n = (s[k] for k in ("batch", "seq", "heads", "head_dim", "groups", "state"))
  sds, bf = jax.ShapeDtypeStruct, jnp.bfloat16
  args = [sds((b, t, h, p), bf), sds((b, t, h), jnp.float32), sds((h,), jnp.float32), sds((b, t, g, n), bf),
          sds((b, t, g, n), bf), sds((h,), jnp.float32)]
  if cfg["impl"] == "ours":
    blocks = ssd.BlockSizes(cfg.get("chunk_size"), cfg.get("heads_per_step"))
    fwd = lambda x, dt, A, B, C, D: ssd.ssd(x, dt, A, B, C, D=D, block_sizes=blocks,  # noqa: E731
                                            backward=cfg.get("backward"))
  elif cfg["impl"] == "chunked_xla":
    fwd = lambda x, dt, A, B, C, D: ssd.ssd_chunked_xla(x, dt, A, B, C, D=D, chunk_size=cfg["chunk_size"])  # noqa: E731
  else:
    raise ValueError(cfg["impl"])
  if cfg["mode"] == "fwd":
    return fwd, args

  def fwdbwd(x, dt, A, B, C, D, dy):
    y, vjp = jax.vjp(fwd, x, dt, A, B, C, D)
    return y, vjp(dy)
  return fwdbwd, args + [args[0]]


def _chunk(cfg) -> int:
  """The chunk a configuration runs at: its own, or ours' default for its generation."""
  return cfg.get("chunk_size") or ssd.default_block_sizes(cfg["generation"]).chunk_size


def estimate(cfg) -> dict:
  """One estimate at ``cfg["seq"]`` tokens, every time scaled to SHAPE's seq."""
  fn, args = _program(cfg)
  chunk = _chunk(cfg)
  e = kernels.estimate_tpu(fn, *args, generation=cfg["generation"], flops=flops(cfg["seq"], chunk, cfg["mode"]),
                           bytes_accessed=bytes_moved(cfg["seq"], cfg["mode"]))
  r = e.record()
  scale = SHAPE["seq"] / cfg["seq"]
  for k in ("us", "model_us", "floor_us"):
    r[k] = round(r[k] * scale, 3)
  r["hbm_bytes"] = int(r["hbm_bytes"] * scale)
  r.update(scale=scale, estimated_seq=cfg["seq"], compile_seconds=round(e.compile_seconds, 1),
           vmem_bytes=e.vmem_bytes)
  return r


def estimate_isolated(cfg) -> dict:
  return result_tables.run_child([os.path.abspath(__file__), "one", json.dumps(cfg)])


def estimate_affine(cfg, seqs) -> dict:
  """The full sequence's estimate extrapolated from two slices, for programs whose static profile at the full
  size needs more RAM than this machine has: the model's time and the floor are each fitted as ``a + b * seq``
  through the two slices (a fixed cost is not multiplied, unlike a scaled slice), then floored as usual."""
  s1, s2 = seqs
  r1, r2 = (estimate_isolated(dict(cfg, seq=s)) for s in (s1, s2))
  if "us" not in r1 or "us" not in r2:
    return r2 if "us" not in r2 else r1
  full = SHAPE["seq"]

  def at(k):  # the records hold slice times scaled by full / seq: unscale, then fit a line through the two
    y1, y2 = r1[k] * s1 / full, r2[k] * s2 / full
    return y1 + (y2 - y1) * (full - s1) / (s2 - s1)

  r = dict(r2)
  for k in ("model_us", "floor_us"):
    r[k] = round(at(k), 3)
  r["hbm_bytes"] = int(round(at("hbm_bytes")))
  r["us"] = max(r["model_us"], r["floor_us"])
  r["floored"] = r["floor_us"] > r["model_us"]
  chunk = _chunk(cfg)
  roof = roofline(cfg["generation"], cfg["mode"], chunk)
  r["fraction_of_roofline"] = round(max(roof["hbm_us"], roof["mxu_us"]) / r["us"], 4)
  r["valid"] = bool(r1.get("valid", True) and r2.get("valid", True) and r["fraction_of_roofline"] <= 1.0)
  r.update(scale=None, estimated_seq=None, affine_from={str(s1): r1, str(s2): r2},
           method=f"affine extrapolation to {full} tokens from slices of {s1} and {s2}")
  return r


def roofline(gen: str, mode: str, chunk: int) -> dict:
  """Both sides of the roofline at SHAPE, in microseconds: HBM (compulsory bytes at the published bandwidth)
  and MXU (useful matmul FLOPs at the bf16 peak), and which binds."""
  chip = kernels.get_chip(gen)
  hbm = bytes_moved(SHAPE["seq"], mode) / chip.hbm_bandwidth * 1e6
  mxu = flops(SHAPE["seq"], chunk, mode) / chip.peak("bfloat16") * 1e6
  return {"hbm_us": round(hbm, 3), "mxu_us": round(mxu, 3), "binds": "MXU" if mxu > hbm else "HBM",
          "bytes": bytes_moved(SHAPE["seq"], mode), "flops": flops(SHAPE["seq"], chunk, mode)}


def _header(description):
  return {"description": description, "generated_by": "tools/tune_ssd.py", "kind": "compiler estimate (floored)",
          "environment": {"jax": jax.__version__, "python": platform.python_version()}, "shape": SHAPE}


def tune(args):
  table = result_tables.load(BLOCKS_OUT) or _header("")
  table["description"] = (
      "Default chunk_size and heads_per_step of kernels.ssd per TPU generation, chosen from compiler estimates "
      "(libtpu's static cost model, floored at the HBM bandwidth; estimates, not measurements) of the forward at "
      f"{SHAPE} bf16, estimated at the full sequence (see tools/tune_ssd.py). Within 1% "
      "of the fastest, the smaller VMEM plan wins. v5p and v4 copy v5e (not swept; v4 has no cost model).")
  defaults = table.setdefault("defaults", {})
  for gen in args.generations:
    sweep = {}
    for L in CHUNKS:
      for hb in HEADS_PER_STEP:
        cfg = dict(generation=gen, impl="ours", mode="fwd", seq=args.seq, chunk_size=L, heads_per_step=hb)
        sweep[(L, hb)] = r = estimate_isolated(cfg)
        print(gen, L, hb, r.get("us"), r.get("model_us"), r.get("error", ""), flush=True)
    # A chunk wider than the MXU (256 on v5e) doubles the intra-chunk vector work per token for no MXU gain:
    # whatever the model says of it has no physical reason, so it is swept and recorded but not eligible.
    scores = {k: r["us"] for k, r in sweep.items() if "us" in r and r.get("valid", True)
              and k[0] <= ssd._mxu_chunk(gen)}
    if not scores:
      print(f"{gen}: no candidate estimated; entry left as it was", flush=True)
      continue
    best = min(scores.values())
    p = problem(SHAPE["seq"])
    L, hb = min((k for k, us in scores.items() if us <= best * (1 + TIE)),
                key=lambda k: (ssd._vmem_bytes(p, *k), scores[k]))
    defaults[gen] = {"chunk_size": L, "heads_per_step": hb, "forward": sweep[(L, hb)],
                     "sweep": {f"{k[0]}x{k[1]}": ({"us": v["us"], "model_us": v["model_us"]} if "us" in v else v)
                               for k, v in sorted(sweep.items())},
                     "kernel": KERNEL_VERSION, "tuned": datetime.date.today().isoformat()}
    if gen == "v5e":
      for other in ("v5p", "v4"):
        defaults[other] = {"chunk_size": L, "heads_per_step": hb,
                           "source": "v5e's choice (not swept; libtpu has no cost model for v4)"}
    result_tables.save(table, BLOCKS_OUT)


def bench(args):
  table = result_tables.load(BENCH_OUT) or _header("")
  table["description"] = (
      f"kernels.scan.chunked against the plain-JAX chunked SSD (kernels.scan.chunked.ssd_chunked_xla) at {SHAPE}, bf16 x, B, C, f32 "
      "state: compiler estimates (libtpu's static cost model), not measurements, made at estimated_seq tokens "
      "(the full sequence: scale 1), or extrapolated from two slices where a record's `method` says so. us is "
      "the floored estimate: the model's time (model_us), never less than the program's counted HBM bytes at the "
      "published bandwidth (floor_us). roofline: hbm_us (compulsory bytes at the published bandwidth) and mxu_us "
      "(the chunked algorithm's useful matmul FLOPs, at the generation's default chunk, at the bf16 peak; forward + "
      "backward counted as 3x the forward). Ours' forward + backward records say which backward they ran (backward: "
      "'pallas', the reverse-chunk kernel of kernels/_ssd_bwd.py, or 'xla', the VJP of ssd_chunked_xla); with the "
      "Pallas backward the forward also writes the state entering each chunk.")
  table["roofline"] = {f"{gen}/{mode}": roofline(gen, mode, ssd.default_block_sizes(gen).chunk_size)
                       for gen in GENERATIONS for mode in ("fwd", "fwdbwd")}
  results = table.setdefault("results", {})
  for seq in args.seqs:
   for gen in args.generations:
    for impl, chunks in (("ours", (None,)), ("chunked_xla", CHUNKS)):
      if impl not in args.impls:
        continue
      for L in chunks:
        if L is not None and L not in args.chunks:
          continue
        for mode in args.modes:
          for backward in (BACKWARDS if impl == "ours" and mode == "fwdbwd" else (None,)):
            if backward is not None and backward not in args.backwards:
              continue
            name = impl if backward is None else f"{impl}+{backward}_bwd"
            key = f"{gen}/{name}{'' if L is None else f'@{L}'}/{mode}/{seq}"
            if key in results and "us" in results[key] and not args.force:
              continue
            cfg = dict(generation=gen, impl=impl, mode=mode, seq=seq)
            if L is not None:
              cfg["chunk_size"] = L
            if backward is not None:
              cfg["backward"] = backward
            if mode in args.affine_modes and impl in args.affine_impls:
              r = estimate_affine(cfg, args.affine)
            else:
              r = estimate_isolated(cfg)
            r.update(cfg)
            if impl == "ours":
              r["kernel"] = KERNEL_VERSION
              r["blocks"] = ssd.default_block_sizes(gen).as_dict()
            results[key] = r
            print(key, r.get("us"), r.get("model_us"), r.get("floor_us"), r.get("error", ""), flush=True)
            result_tables.save(table, BENCH_OUT)
  if args.check_affine:
    check_affine(table, args)


def check_affine(table, args):
  """How far the affine extrapolation lands from a full-size estimate, on the forwards (whose full-size
  estimates fit in RAM): ``affine_check`` in the table, one entry per program, both floored times."""
  check = table.setdefault("affine_check", {})
  full = SHAPE["seq"]
  for gen in args.generations:
    for impl, L in (("ours", None), ("chunked_xla", 256)):
      name = impl if L is None else f"{impl}@{L}"
      ref = table["results"].get(f"{gen}/{name}/fwd/{full}", {})
      if "us" not in ref:
        continue
      cfg = dict(generation=gen, impl=impl, mode="fwd", seq=full)
      if L is not None:
        cfg["chunk_size"] = L
      r = estimate_affine(cfg, args.affine)
      if "us" in r:
        check[f"{gen}/{name}/fwd"] = {"full_us": ref["us"], "affine_us": r["us"], "ratio": round(r["us"] / ref["us"], 4),
                                      "slices": list(args.affine)}
        print("affine check", gen, name, ref["us"], r["us"], flush=True)
      result_tables.save(table, BENCH_OUT)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("job", choices=("tune", "bench", "one"))
  ap.add_argument("config", nargs="?", help="(one) a JSON configuration, used internally")
  ap.add_argument("--generations", nargs="*", default=list(GENERATIONS))
  ap.add_argument("--seq", type=int, default=SHAPE["seq"], help="(tune) tokens estimated (times scaled to SHAPE's seq)")
  ap.add_argument("--seqs", type=int, nargs="*", default=[SHAPE["seq"]],
                  help="(bench) the sequence lengths estimated, each scaled to SHAPE's seq")
  ap.add_argument("--modes", nargs="*", default=["fwd", "fwdbwd"])
  ap.add_argument("--affine-modes", nargs="*", default=["fwdbwd"],
                  help="(bench) modes extrapolated from two slices (their full-size profile needs too much RAM)")
  ap.add_argument("--affine-impls", nargs="*", default=["ours"], help="(bench) programs extrapolated in those modes")
  ap.add_argument("--affine", type=int, nargs=2, default=[2048, 4096], help="(bench) the two slices")
  ap.add_argument("--check-affine", action="store_true", help="(bench) compare the extrapolation with full-size forwards")
  ap.add_argument("--backwards", nargs="*", default=list(BACKWARDS), help="(bench) ours' backwards estimated")
  ap.add_argument("--impls", nargs="*", default=["ours", "chunked_xla"], help="(bench) programs estimated")
  ap.add_argument("--chunks", type=int, nargs="*", default=list(CHUNKS), help="(bench) chunked_xla's chunks")
  ap.add_argument("--force", action="store_true")
  args = ap.parse_args(argv)
  if args.job == "one":
    result_tables.print_result(estimate, args.config)
    return
  (tune if args.job == "tune" else bench)(args)


if __name__ == "__main__":
  main()
