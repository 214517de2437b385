"""Benchmarks kernels.conv against XLA and plain-JAX Winograd with the TPU compiler's cost model.

Every number is a **compiler estimate** (``kernels.estimate_tpu``, libtpu's static cost
model), never a measurement, stored with :meth:`kernels.perf.tpu.Estimate.record`: ``us`` is the
floored estimate (the model's time, but never less than the program's counted HBM bytes at
the published bandwidth). ``complete`` is False when the model charged real work 0 cycles
(``unmodeled``; it does so for some XLA convolution fusions): such an estimate is a lower
bound and is never counted as a win or a loss.

* ``bench`` -> ``kernels/data/conv_bench.json``: at the ResNet shapes of issue 20 (N=32:
  56x56x256->256, 28x28x512->512, 14x14x1024->1024; N=8: 224x224x64->64; 3x3, stride 1,
  SAME, bf16), on v5e and v6e, forward (and ``--modes fwdbwd``: forward + backward):
  ``xla`` (``lax.conv_general_dilated``), ``jax_f2`` / ``jax_f4`` (Winograd F(2x2,3x3) /
  F(4x4,3x3) in plain JAX, :func:`winograd_jax`), ``direct`` and ``winograd_f2`` /
  ``winograd_f4`` (our kernels at their default blocks); and, asked for by name
  (``--impls gemm_vmem``), the ceiling of any kernel built on Mosaic's dots: a plain Pallas GEMM
  with the convolution's FLOPs and its operands held in VMEM (:func:`gemm_in_vmem`). The roofline is the direct
  convolution's FLOPs (``2 N H W 9 Cin Cout``) against the compulsory bytes (x, w, y once):
  a Winograd record keeps no fraction of it (:func:`direct_fraction`): it does fewer multiplies,
  so it can pass the direct roofline.
* ``tune`` -> ``kernels/data/conv_blocks.json``: a small sweep of the per-image direct kernel's
  blocks (channels per block x GEMM rows per step) at one shape per generation.
* ``tune_batched`` -> the same file's ``batched_target_rows``: GEMM rows per step of the batched
  direct kernel, at one shape per generation, batch 16.
* ``rules`` -> the same file's ``winograd`` and ``xla``: where ``conv2d(algorithm=None)`` runs a
  Winograd kernel, and where it hands the call to XLA's convolution, from the stored ``bench``
  records (no estimates of its own).

The cost model's profile of our kernels at N=32 grew past 9 GB of memory on the 24 GB build
host (the direct kernel at 28x28x512), so ``--batch`` runs every program of a comparison at a
smaller batch; the record's key and ``shape`` say which.

Run each part under the shared lock, split by generation and shape (each < 10 minutes)::

  flock /tmp/tpu-heavy.lock nice -n 10 python tools/tune_conv.py bench --generations v5e --shapes 28x28x512 --batch 4
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import results as result_tables  # noqa: E402
import kernels  # noqa: E402  (first: enables the cost model before JAX loads libtpu)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from kernels.conv import api as C  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels", "data")
BENCH_OUT = os.path.join(DATA, "conv_bench.json")
BLOCKS_OUT = os.path.join(DATA, "conv_blocks.json")

SHAPES = {"56x56x256": (32, 56, 256), "28x28x512": (32, 28, 512), "14x14x1024": (32, 14, 1024),
          "224x224x64": (8, 224, 64)}
GENERATIONS = ("v5e", "v6e")
IMPLS = ("xla", "jax_f2", "jax_f4", "direct", "winograd_f2", "winograd_f4")
# Not a convolution: the ceiling of any kernel built on Mosaic dots (see gemm_in_vmem); bench it by name.
CEILING = "gemm_vmem"
GEMM_ROWS = (392, 784, 1568, 3136)  # rows per grid step tried for it
KERNEL_VERSION = 2  # 2: batches of 8 images take the batched direct kernel


def winograd_jax(x, w, tile_size: int):
  """Winograd F(m x m, 3 x 3), 3x3 stride 1 SAME, in plain JAX: tiles gathered by strided
  slices, transforms as einsums in f32, the ``(m + 2)^2`` GEMMs in ``x``'s dtype with f32
  accumulation. XLA materialises the transformed tiles in HBM."""
  m, t = tile_size, tile_size + 2
  bt, g, at = (jnp.asarray(a, jnp.float32) for a in C.winograd_matrices(m))
  n, h, wd, c = x.shape
  ht, wt = -(-h // m), -(-wd // m)
  xp = jnp.pad(x, ((0, 0), (1, ht * m + 1 - h), (1, wt * m + 1 - wd), (0, 0)))
  d = jnp.stack([jnp.stack([xp[:, i:i + m * ht:m, j:j + m * wt:m, :] for j in range(t)]) for i in range(t)])
  v = jnp.einsum("ai,bj,ijnpqc->abnpqc", bt, bt, d.astype(jnp.float32)).astype(x.dtype)
  u = jnp.einsum("ai,ijco,bj->abco", g, w.astype(jnp.float32), g).astype(x.dtype)
  mm = jnp.einsum("abnpqc,abco->abnpqo", v, u, preferred_element_type=jnp.float32)
  y = jnp.einsum("ua,vb,abnpqo->npuqvo", at, at, mm)
  return y.reshape(n, ht * m, wt * m, -1)[:, :h, :wd].astype(x.dtype)


def cost(cfg) -> tuple[float, float]:
  """Direct-conv FLOPs and compulsory bytes (x, w, y once; x, w, dy in and dx, dw out for the backward)."""
  n, h, c = cfg["shape"]
  flops = 2 * n * cfg.get("rows", h) * h * 9 * c * c
  x = n * cfg.get("rows", h) * h * c * 2
  wb = 9 * c * c * 2
  if cfg["mode"] == "fwd":
    return flops, 2 * x + wb
  return 3 * flops, 2 * x + wb + 2 * x + wb + 2 * x  # forward, then dx and dw


def gemm_in_vmem(rows: int, depth: int, cols: int, steps: int):
  """A plain Pallas GEMM with a direct convolution's FLOPs and none of its data movement: each of
  ``steps`` grid steps multiplies the same ``[rows, depth]`` bf16 block by the same
  ``[depth, cols]`` block (fetched once: the block index never changes) and writes its
  ``[rows, cols]`` bf16 result. With ``depth = 9 cin``, ``cols = cout`` and ``rows * steps`` the
  output pixels, it is what any convolution kernel built on Mosaic's dots can at best reach."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import tpu as pltpu

  def kernel(x_ref, w_ref, o_ref):
    o_ref[...] = jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32).astype(o_ref.dtype)

  def f(x, w):
    return pl.pallas_call(
        kernel, grid=(steps,), in_specs=[pl.BlockSpec((rows, depth), lambda i: (0, 0)),
                                         pl.BlockSpec((depth, cols), lambda i: (0, 0))],
        out_specs=pl.BlockSpec((rows, cols), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((rows * steps, cols), jnp.bfloat16),
        compiler_params=pltpu.CompilerParams(vmem_limit_bytes=100 << 20), name="gemm_in_vmem")(x, w)
  return f, (jax.ShapeDtypeStruct((rows, depth), jnp.bfloat16), jax.ShapeDtypeStruct((depth, cols), jnp.bfloat16))


def _program(cfg):
  n, h, c = cfg["shape"]
  if cfg["impl"] == CEILING:
    pixels = n * h * h
    return gemm_in_vmem(cfg["gemm_rows"], 9 * c, c, pixels // cfg["gemm_rows"])
  x = jax.ShapeDtypeStruct((n, cfg.get("rows", h), h, c), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((3, 3, c, c), jnp.bfloat16)
  impl = cfg["impl"]
  blocks = C.BlockSizes(**cfg["blocks"]) if cfg.get("blocks") else None
  if impl == "xla":
    f = lambda x, w: C.conv2d_reference(x, w)  # noqa: E731
  elif impl.startswith("jax_f"):
    f = lambda x, w: winograd_jax(x, w, int(impl[-1]))  # noqa: E731
  elif impl == "direct":
    f = lambda x, w: C.conv2d(x, w, algorithm="direct", block_sizes=blocks, implementation="pallas",  # noqa: E731
                              interpret=False)
  else:
    f = lambda x, w: C.conv2d(x, w, algorithm="winograd", tile_size=int(impl[-1]),  # noqa: E731
                              block_sizes=blocks, implementation="pallas", interpret=False)
  if cfg["mode"] == "fwd":
    return f, (x, w)

  def fwdbwd(x, w, dy):
    y, vjp = jax.vjp(f, x, w)
    return (y,) + vjp(dy)
  return fwdbwd, (x, w, x)  # dy: same shape as y (SAME, cin == cout)


def estimate(cfg) -> dict:
  fn, args = _program(cfg)
  flops, bytes_ = cost(cfg)
  e = kernels.estimate_tpu(fn, *args, generation=cfg["generation"], flops=flops, bytes_accessed=bytes_)
  r = e.record()
  r.update(complete=e.complete, compile_seconds=round(e.compile_seconds, 1), flops=flops, bytes=bytes_)
  if e.unmodeled:
    r["notes"] = [n for n in e.notes if "charged 0 cycles" in n][:4]
    r = incomplete(r)
  return r


def incomplete(r: dict) -> dict:
  """An estimate the model left partly uncharged is a lower bound, not an estimate: stored as an
  error with its bound, without ``us`` or a fraction of the roofline."""
  bound = r.pop("us")
  for k in ("fraction_of_roofline", "valid", "floored"):
    r.pop(k, None)
  r.update(lower_bound_us=bound, error=(
      f"incomplete: the cost model charged {', '.join(r.get('unmodeled', [])) or 'part of the work'} 0 cycles "
      f"(model {r.get('model_us')} us, HBM floor {r.get('floor_us')} us): a lower bound, not an estimate"))
  return r


def direct_fraction(r: dict) -> dict:
  """A Winograd record keeps no fraction of the roofline: the roofline here is the *direct*
  convolution's, and Winograd does fewer multiplies, so the ratio can pass 1 without being a
  fraction of anything. The notebook computes it from ``us``, labelled as such."""
  if r.get("impl", "").startswith(("winograd", "jax_f")):
    for k in ("fraction_of_roofline", "valid"):
      r.pop(k, None)
  return r


def estimate_ceiling(cfg) -> dict:
  """:func:`gemm_in_vmem` at each row count of GEMM_ROWS that divides the output pixels: the
  fastest, with the others in ``sweep``."""
  n, h, c = cfg["shape"]
  sweep = {r: estimate_isolated(dict(cfg, gemm_rows=r)) for r in GEMM_ROWS if (n * h * h) % r == 0}
  done = {r: e for r, e in sweep.items() if e.get("us") is not None and e.get("complete")}
  if not done:
    return {"error": "no row count estimated", "sweep": sweep}
  best = min(done, key=lambda r: done[r]["us"])
  return dict(done[best], gemm_rows=best, method=(
      f"plain Pallas GEMM [{best}, {9 * c}] x [{9 * c}, {c}] per step, operands fetched once (in VMEM), "
      f"{n * h * h // best} steps: the direct convolution's FLOPs without its data movement; fastest of "
      f"{sorted(sweep)} rows per step"),
      sweep={str(r): {k: e.get(k) for k in ("us", "model_us", "complete", "error")} for r, e in sweep.items()})


def estimate_isolated(cfg) -> dict:
  return result_tables.run_child([os.path.abspath(__file__), "one", json.dumps(cfg)], timeout=560)


def estimate_by_rows(cfg, block_rows: int, images: int | None = None) -> dict:
  """The program estimated at 1 and 2 row blocks of ``block_rows`` output rows (the same width and
  channels), and the line through the two extended to all of the image's row blocks: for programs
  whose whole profile outgrows this host's memory. Each grid step of a row block does the same
  work, so the second block's increment is the cost of every further block (the first also
  carries the fixed costs: the filter transform, the first fetch of the filter).

  ``images``: estimate the slices at this many images (one batch block of the kernel: 16 bf16
  images, so ``images`` must divide the batch) and extend the line over the batch's blocks of
  images as well: every further block of images repeats the row blocks of the first, with the
  fixed costs paid once. That extension overestimates: for the direct kernel on v5e at
  32x28x28x512 it gave 720.3 us against 653.2 us from the line at the full batch (the model
  charges a grid's steps differently by where they fall), so use it only where the full
  batch's slices outgrow the host, and say so."""
  n, h = cfg["shape"][0], cfg["shape"][1]
  images = images or n
  if images != n and (n % images or images % 8):
    return {"error": f"images={images} must be a multiple of 8 that divides the batch {n}"}
  blocks = -(-h // block_rows) * (n // images)
  small = dict(cfg, shape=[images, *cfg["shape"][1:]])
  one, two = (estimate_isolated(dict(small, rows=k * block_rows)) for k in (1, 2))
  if one.get("us") is None or two.get("us") is None or not (one.get("complete") and two.get("complete")):
    bad = one if one.get("us") is None or not one.get("complete") else two
    return {"error": f"row-block slice not estimated: {bad.get('error')}", "slices": [one, two]}
  line = lambda f: round(one[f] + (blocks - 1) * (two[f] - one[f]), 3)  # noqa: E731
  flops, bytes_ = cost(cfg)
  chip = kernels.get_chip(cfg["generation"])
  roof = max(flops / chip.peak("bfloat16"), bytes_ / chip.hbm_bandwidth) * 1e6
  us = line("us")
  where = f" of {images} images" if images != n else ""
  extent = f"{-(-h // block_rows)} row blocks" + (f" x {n // images} blocks of images" if images != n else "")
  return {"us": us, "model_us": line("model_us"), "floor_us": line("floor_us"), "complete": True,
          "fraction_of_roofline": round(roof / us, 4), "flops": flops, "bytes": bytes_,
          "method": f"line through {block_rows} and {2 * block_rows} rows{where}, extended to {extent}",
          "slices": [{k: r.get(k) for k in ("us", "model_us", "floor_us", "complete")}
                     | {"rows": k * block_rows, "images": images} for k, r in ((1, one), (2, two))]}


def _header(description):
  return {"description": description, "generated_by": "tools/tune_conv.py", "kind": "compiler estimate (floored)",
          "environment": {"jax": jax.__version__, "python": platform.python_version()}}


BENCH_DESCRIPTION = (
    "kernels.conv2d (direct and Winograd kernels, default blocks) against lax.conv_general_dilated (xla) and "
    "Winograd F(2x2,3x3) / F(4x4,3x3) in plain JAX (jax_f2 / jax_f4), 3x3 stride 1 SAME, bf16 in, f32 "
    "accumulate, at ResNet shapes (key: generation/NxHxWxC/impl/mode): compiler estimates (libtpu's static cost "
    "model), not measurements. us is the floored estimate (model_us, never below floor_us, the counted hbm_bytes "
    "at the published bandwidth). complete=false: the model charged some op 0 cycles (unmodeled), so us is a lower "
    "bound that counts neither as a win nor a loss. fraction_of_roofline uses the direct convolution's FLOPs and "
    "the compulsory bytes; Winograd records (winograd_*, jax_f*) keep none, as they do "
    "fewer multiplies and can pass that roofline (the notebook computes the ratio from us).")


def bench(args):
  table = result_tables.load(BENCH_OUT) or _header(BENCH_DESCRIPTION)
  table["description"] = BENCH_DESCRIPTION
  results = table.setdefault("results", {})
  for gen in args.generations:
    for name in args.shapes:
      n, h, c = SHAPES[name]
      n = args.batch or n
      for impl in args.impls:
        for mode in args.modes:
          cfg = dict(generation=gen, impl=impl, mode=mode, shape=[n, h, c])
          key = f"{gen}/{n}x{h}x{h}x{c}/{impl}/{mode}"
          if key in results and results[key].get("kernel") == KERNEL_VERSION and not args.force:
            continue
          if impl == CEILING:
            r = estimate_ceiling(cfg)
          else:
            r = (estimate_by_rows(cfg, args.row_blocks, args.images) if args.row_blocks
                 else estimate_isolated(cfg))
          r.update(cfg, dtype="bfloat16", kernel=KERNEL_VERSION)
          results[key] = direct_fraction(r)
          print(key, r.get("us"), r.get("model_us"), r.get("complete"), r.get("fraction_of_roofline"),
                r.get("error", ""), flush=True)
          result_tables.save(table, BENCH_OUT)


TUNE_SHAPE = "28x28x512"
# Channels per block at ~1024 GEMM rows (at 28x28 every rows target from 896 up takes the whole image).
SWEEP = [dict(block_cin=ci, block_cout=co, target_rows=1024) for ci, co in ((256, 256), (512, 256), (256, 512),
                                                                              (512, 512))]


def tune(args):
  table = result_tables.load(BLOCKS_OUT) or _header("")
  table["description"] = (
      "Default blocks of kernels.conv's direct kernel per TPU generation, from compiler estimates (libtpu's static "
      f"cost model; estimates, not measurements) at {TUNE_SHAPE}->same (batch: see 'batch'), 3x3 stride 1, bf16, "
      "forward: us is the floored estimate. Only complete estimates rank. v5p and v4 copy v5e (not swept; v4 has no "
      "cost model).")
  defaults = table.setdefault("defaults", {})
  n, h, c = SHAPES[TUNE_SHAPE]
  n = args.batch or n
  table["batch"] = n
  for gen in args.generations:
    sweep = {}
    for blocks in SWEEP:
      cfg = dict(generation=gen, impl="direct", mode="fwd", shape=[n, h, c], blocks=blocks)
      r = estimate_isolated(cfg)
      sweep[json.dumps(blocks, sort_keys=True)] = r
      print(gen, blocks, r.get("us"), r.get("complete"), r.get("error", ""), flush=True)
    ok = {k: v["us"] for k, v in sweep.items() if "us" in v and v.get("complete")}
    if not ok:
      continue
    best = min(ok, key=ok.get)
    defaults[gen] = dict(json.loads(best), us=ok[best], kernel=KERNEL_VERSION,
                         tuned=datetime.date.today().isoformat(),
                         sweep={k: {"us": v.get("us"), "complete": v.get("complete"), "error": v.get("error")}
                                for k, v in sweep.items()})
    if gen == "v5e":
      for other in ("v5p", "v4"):
        defaults[other] = dict(json.loads(best), source="v5e's choice (not swept; v4 has no cost model)")
  result_tables.save(table, BLOCKS_OUT)


# The batched kernel at batch 16 (16 bf16 images a step, as at the benchmark's batches): GEMM rows per
# step, i.e. block_h = rows // (width * 16); at 28x28: 2, 4, 7.
BATCHED_SWEEP = (896, 1792, 3136)
BATCHED_TUNE_BATCH = 16


def tune_batched(args):
  """``batched_target_rows`` per generation, from the batched kernel at TUNE_SHAPE, batch 16."""
  table = result_tables.load(BLOCKS_OUT)
  defaults = table.setdefault("defaults", {})
  _, h, c = SHAPES[TUNE_SHAPE]
  for gen in args.generations:
    sweep = {}
    for rows in BATCHED_SWEEP:
      cfg = dict(generation=gen, impl="direct", mode="fwd", shape=[BATCHED_TUNE_BATCH, h, c],
                 blocks=dict(target_rows=rows))
      r = estimate_isolated(cfg)
      sweep[str(rows)] = {"us": r.get("us"), "complete": r.get("complete"), "error": r.get("error")}
      print(gen, "batched", rows, r.get("us"), r.get("complete"), r.get("error", ""), flush=True)
    ok = {k: v["us"] for k, v in sweep.items() if v["us"] is not None and v["complete"]}
    if not ok:
      continue
    best = min(ok, key=ok.get)
    entry = defaults.setdefault(gen, {})
    entry.update(batched_target_rows=int(best), batched=dict(batch=BATCHED_TUNE_BATCH, us=ok[best], kernel=KERNEL_VERSION,
                                                             tuned=datetime.date.today().isoformat(), sweep=sweep))
    if gen == "v5e":
      for other in ("v5p", "v4"):
        defaults.setdefault(other, {}).update(batched_target_rows=int(best))
  result_tables.save(table, BLOCKS_OUT)


# A Winograd tile within this factor of the faster tile's time counts as fast: the smaller tile is
# preferred there, as F(2x2,3x3) stays close to the direct method's accuracy and F(4x4,3x3) does not.
SAME_SPEED = 1.01


def rules(args):
  """``conv_blocks.json`` ``winograd`` and ``xla`` (what ``conv2d(algorithm=None)`` reads), from
  the stored bench records (complete forward estimates only; no estimates of its own).

  * ``winograd``: for each generation and shape where, at the same batch (the largest stored),
    our batched Winograd kernel beats our direct kernel, a rule for that dtype, batch multiple
    (16 images, the batched kernel's block), and that channel count and width or more. The tile:
    F(2x2,3x3) if within ``SAME_SPEED`` of F(4x4,3x3), else the faster.
  * ``xla``: for each generation and shape where, at the largest batch with XLA's estimate and
    at least one of ours, XLA's convolution beats every kernel of ours estimated there, a rule
    for that dtype, a multiple of that batch's kernel block (``gcd(batch, 16)``), and that
    channel count and width or more."""
  bench_table = result_tables.load(BENCH_OUT) or {"results": {}}
  done = {k: r for k, r in bench_table["results"].items() if r.get("us") is not None and r.get("complete")
          and r.get("mode") == "fwd"}
  table = result_tables.load(BLOCKS_OUT)
  table["winograd_description"] = (
      "defaults[gen].winograd: where conv2d(algorithm=None) runs a Winograd kernel (tools/tune_conv.py rules): "
      "inputs of this dtype, a batch that is a multiple of batch_multiple, at least min_cin channels and an output "
      "at least min_width wide; evidence: the stored forward estimates (compiler estimates, floored) at the largest "
      "batch where our direct and Winograd kernels were both estimated completely. Generations without a rule run "
      "the direct kernel.")
  table["xla_description"] = (
      "defaults[gen].xla: where conv2d(algorithm=None, implementation=None) runs XLA's convolution instead of a "
      "kernel of ours (tools/tune_conv.py rules), with the same conditions as a winograd rule; evidence: the stored "
      "forward estimates (compiler estimates, floored) at the largest batch where XLA's and at least one of our "
      "kernels' were complete, XLA's the fastest. It takes precedence over a winograd rule.")
  ours = ("direct", "winograd_f2", "winograd_f4")
  for gen in args.generations:
    found, to_xla = [], []
    for name in args.shapes:
      _, h, c = SHAPES[name]
      at = lambda n, i: done.get(f"{gen}/{n}x{h}x{h}x{c}/{i}/fwd", {}).get("us")  # noqa: E731
      batches = sorted({r["shape"][0] for r in done.values() if r["generation"] == gen
                        and r["shape"][1:] == [h, c] and r["impl"] == "direct" and r["shape"][0] % 16 == 0})
      for n in reversed(batches):
        us = {i: at(n, i) for i in ours}
        if us["winograd_f2"] is None and us["winograd_f4"] is None:
          continue
        fast = min(u for u in (us["winograd_f2"], us["winograd_f4"]) if u is not None)
        if fast < us["direct"]:
          tile = 2 if us["winograd_f2"] is not None and us["winograd_f2"] <= SAME_SPEED * fast else 4
          found.append({"tile_size": tile, "dtype": "bfloat16", "batch_multiple": 16, "min_cin": c, "min_width": h,
                        "evidence": {"shape": [n, h, h, c], "us": us, "kind": "compiler estimate (floored)",
                                     "records": "kernels/data/conv_bench.json"}})
        break
      with_xla = sorted({r["shape"][0] for r in done.values() if r["generation"] == gen and r["impl"] == "xla"
                         and r["shape"][1:] == [h, c] and any(at(r["shape"][0], i) is not None for i in ours)})
      if with_xla:
        n = with_xla[-1]
        us = {i: at(n, i) for i in ("xla", *ours) if at(n, i) is not None}
        if us["xla"] < min(v for i, v in us.items() if i != "xla"):
          to_xla.append({"dtype": "bfloat16", "batch_multiple": math.gcd(n, 16), "min_cin": c, "min_width": h,
                         "evidence": {"shape": [n, h, h, c], "us": us, "kind": "compiler estimate (floored)",
                                      "records": "kernels/data/conv_bench.json"}})
    entry = table["defaults"].setdefault(gen, {})
    entry["winograd"] = sorted(found, key=lambda r: (r["min_cin"], r["min_width"]))
    entry["xla"] = sorted(to_xla, key=lambda r: (r["min_cin"], r["min_width"]))
    print(gen, "winograd:", entry["winograd"], "xla:", entry["xla"], flush=True)
  result_tables.save(table, BLOCKS_OUT)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("job", choices=("bench", "tune", "tune_batched", "rules", "one"))
  ap.add_argument("config", nargs="?", help="(one) a JSON configuration, used internally")
  ap.add_argument("--generations", nargs="*", default=list(GENERATIONS))
  ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
  ap.add_argument("--impls", nargs="*", default=list(IMPLS))
  ap.add_argument("--modes", nargs="*", default=["fwd"])
  ap.add_argument("--force", action="store_true")
  ap.add_argument("--batch", type=int, default=None,
                  help="(bench, tune) override the shape's batch: the cost model's profile of our kernels at N=32 "
                       "grew past 9 GB of memory on this host, so the stored comparison runs every program at a "
                       "smaller N (the key says which)")
  ap.add_argument("--row-blocks", type=int, default=None,
                  help="(bench) estimate at 1 and 2 blocks of this many output rows and extend the line to the "
                       "whole image (method recorded): for programs whose whole profile outgrows this host")
  ap.add_argument("--images", type=int, default=None,
                  help="(bench, with --row-blocks) estimate the row-block slices at this many images (one batch "
                       "block of the kernel, 16 for bf16) and extend the line over the batch's blocks of images too: "
                       "for a batch whose slices outgrow this host (N=32 on v5e)")
  args = ap.parse_args(argv)
  if args.job == "one":
    result_tables.print_result(estimate, args.config)
  else:
    {"bench": bench, "tune": tune, "tune_batched": tune_batched, "rules": rules}[args.job](args)


if __name__ == "__main__":
  main()
