"""Tunes kernels.rope's block size and benchmarks it against XLA, with the TPU compiler's cost model.

Two jobs, two files in ``kernels/data/``; every number is a **compiler estimate**
(``kernels.estimate_tpu``, libtpu's static cost model), never a measurement, stored with
:meth:`kernels.perf.tpu.Estimate.record`: ``us`` is the floored estimate (the model's time, but
never less than the program's counted HBM bytes at the published bandwidth).

* ``tune`` -> ``rope_blocks.json``: on v5e and v6e, at ``[8, 4096, 32, 128]`` bf16 without
  positions, ``block_seq`` in {8, 16, ..., 512} (64 KiB to 4 MiB of ``x`` per block), forward
  + (forward and backward); within 1% of the best, the smallest block wins. The entry is
  stored as bytes of ``x`` per block, so other head counts and widths keep the block size in
  bytes. v5p and v4 copy v5e's entry, and say so.
* ``bench`` -> ``rope_bench.json``: ours (default blocks), XLA (``implementation="xla"``,
  the fallback: the textbook slices, in float32) and MaxText's formulation (:func:`maxtext_style`:
  sin and cos on the fly, products in bf16) at ``[8, 4096, 32, 128]`` and
  ``[8, 4096, 8, 64]`` bf16, with and without positions, forward and forward + backward.
  Where the cost model aborts or charges the program 0 cycles there is no estimate: the
  record keeps the error and the program's counted HBM bytes at the published bandwidth
  (``floor_us``, a lower bound, kind "HBM floor only").

Each estimate runs in a child process (the cost model can abort one). Run it under the shared lock::

  flock /tmp/tpu-heavy.lock nice -n 10 python tools/tune_rope.py tune
  flock /tmp/tpu-heavy.lock nice -n 10 python tools/tune_rope.py bench
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

from kernels.attention import rotary as R  # noqa: E402
from kernels.base.hardware import get_chip  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels", "data")
BLOCKS_OUT = os.path.join(DATA, "rope_blocks.json")
BENCH_OUT = os.path.join(DATA, "rope_bench.json")

TUNE_SHAPE = (8, 4096, 32, 128)
BENCH_SHAPES = ((8, 4096, 32, 128), (8, 4096, 8, 64))
GENERATIONS = ("v5e", "v6e")
BLOCK_SEQS = (8, 16, 32, 64, 128, 256, 512)
TIE = 0.01
MAX_POSITION = 8192
KERNEL_VERSION = 1


def bytes_moved(cfg) -> int:
  """Compulsory bytes: x in and out (and dy in, dx out for the backward). No table: the angles can be
  computed on the fly (MaxText's formulation does), so table rows are not compulsory."""
  b, s, h, d = cfg["shape"]
  x = b * s * h * d * jnp.dtype(cfg["dtype"]).itemsize
  return (4 if cfg["mode"] == "fwdbwd" else 2) * x


def maxtext_style(x, positions, theta=10000.0):
  """The rotation as MaxText's ``RotaryEmbedding`` writes it (half-split): sin and cos computed from
  float32 positions on the fly, cast to ``x``'s dtype, products in that dtype, halves split and
  concatenated. Written here from its published formula, as the common plain-JAX peer."""
  d = x.shape[-1]
  timescale = theta ** (2 * jnp.arange(d // 2, dtype=jnp.float32) / d)
  angle = positions.astype(jnp.float32)[:, :, None, None] / timescale
  sin, cos = jnp.sin(angle).astype(x.dtype), jnp.cos(angle).astype(x.dtype)
  first, second = jnp.split(x, 2, axis=-1)
  return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def _program(cfg):
  b, s, h, d = cfg["shape"]
  x = jax.ShapeDtypeStruct((b, s, h, d), jnp.dtype(cfg["dtype"]))
  pos = jax.ShapeDtypeStruct((b, s), jnp.int32)
  impl = "pallas" if cfg["impl"] == "ours" else "xla"
  blocks = R.BlockSizes(cfg["block_seq"]) if cfg.get("block_seq") else None
  kw = dict(implementation=impl, block_sizes=blocks) if impl == "pallas" else dict(implementation=impl)
  if cfg["impl"] == "maxtext":
    arange = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    rot = (maxtext_style if cfg["positions"] else lambda x: maxtext_style(x, arange))  # noqa: E731
    args = (x, pos) if cfg["positions"] else (x,)
  elif cfg["positions"]:
    rot = lambda x, p: R.rope(x, p, max_position=MAX_POSITION, **kw)  # noqa: E731
    args = (x, pos)
  else:
    rot = lambda x: R.rope(x, **kw)  # noqa: E731
    args = (x,)
  if cfg["mode"] == "fwd":
    return rot, args

  def fwdbwd(*a):
    y, vjp = jax.vjp(lambda x: rot(x, *a[1:-1]), a[0])
    return y, vjp(a[-1])[0]
  return fwdbwd, args + (x,)


def estimate(cfg) -> dict:
  fn, args = _program(cfg)
  try:
    e = kernels.estimate_tpu(fn, *args, generation=cfg["generation"], flops=0, bytes_accessed=bytes_moved(cfg))
    r = e.record()
    r.update(compile_seconds=round(e.compile_seconds, 1))
  except kernels.EstimatorUnavailableError as err:
    r = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}", **floor_only(cfg)}
  r.update(bytes=bytes_moved(cfg))
  return r


def estimate_isolated(cfg) -> dict:
  r = result_tables.run_child([os.path.abspath(__file__), "one", json.dumps(cfg)])
  if "error" in r and "floor_us" not in r:  # the process died (libtpu aborted): count the bytes alone
    r.update(result_tables.run_child([os.path.abspath(__file__), "floor", json.dumps(cfg)]))
  return r


def floor_only(cfg) -> dict:
  fn, args = _program(cfg)
  comp = kernels.compile_for_tpu(fn, *args, generation=cfg["generation"], profile=False)
  t = kernels.hbm_traffic(fn, *args, generation=cfg["generation"], compilation=comp)
  bw = get_chip(cfg["generation"]).hbm_bandwidth
  return {"kind": "HBM floor only", "hbm_bytes": t.hbm_bytes, "floor_us": round(t.hbm_bytes / bw * 1e6, 2)}


def _header(description):
  return {"description": description, "generated_by": "tools/tune_rope.py", "kind": "compiler estimate (floored)",
          "environment": {"jax": jax.__version__, "python": platform.python_version()}}


def tune(args):
  table = _header(
      "Default block of kernels.rope per TPU generation, as bytes of x per block (block_seq = that over the bytes "
      "of one token's heads x head_dim, a power of two). Chosen from compiler estimates (libtpu's static cost model; "
      "estimates, not measurements) at [8, 4096, 32, 128] bf16 without positions: us is the floored estimate. "
      "Ranked on forward + (forward and backward) us; within 1% of the best, the smallest block wins. v5p and v4 "
      "copy v5e (not swept; v4 has no cost model).")
  table["shape"] = list(TUNE_SHAPE)
  defaults = table.setdefault("defaults", {})
  b, s, h, d = TUNE_SHAPE
  row = h * d * 2
  for gen in args.generations:
    sweep = {}
    for bs in BLOCK_SEQS:
      for mode in ("fwd", "fwdbwd"):
        cfg = dict(generation=gen, impl="ours", dtype="bfloat16", mode=mode, shape=list(TUNE_SHAPE),
                   positions=False, block_seq=bs)
        sweep[(bs, mode)] = r = estimate_isolated(cfg)
        print(gen, bs, mode, r.get("us"), r.get("model_us"), r.get("error", ""), flush=True)
    scores = {bs: sweep[(bs, "fwd")]["us"] + sweep[(bs, "fwdbwd")]["us"] for bs in BLOCK_SEQS
              if "us" in sweep[(bs, "fwd")] and "us" in sweep[(bs, "fwdbwd")]}
    if not scores:
      print(f"{gen}: no candidate estimated", flush=True)
      continue
    best = min(scores.values())
    bs = min(k for k, v in scores.items() if v <= best * (1 + TIE))
    defaults[gen] = {"block_bytes": bs * row, "block_seq_at_tuned_shape": bs,
                     "forward": sweep[(bs, "fwd")], "forward_and_backward": sweep[(bs, "fwdbwd")],
                     "sweep": {f"{k[0]}/{k[1]}": ({"us": v["us"], "model_us": v["model_us"]} if "us" in v else v)
                               for k, v in sorted(sweep.items())},
                     "kernel": KERNEL_VERSION, "tuned": datetime.date.today().isoformat()}
    if gen == "v5e":
      for other in ("v5p", "v4"):
        defaults[other] = {"block_bytes": bs * row, "source": "v5e's choice (not swept; v4 has no cost model)"}
  result_tables.save(table, BLOCKS_OUT)


def bench(args):
  table = result_tables.load(BENCH_OUT) or _header("")
  table["description"] = (
      "kernels.attention.rotary against XLA (implementation='xla': the textbook slices in float32, which XLA splits into "
      "two passes) and MaxText's formulation (sin and cos computed on the fly from float32 positions, products in "
      "bf16) at [8, 4096, heads, head_dim] bf16, with and without positions (max_position 8192), forward "
      "and forward + backward: compiler estimates (libtpu's static cost model), not measurements. us is the "
      "floored estimate (model_us, never less than floor_us, the counted hbm_bytes at the published bandwidth). "
      "Where the cost model aborted or charged the program 0 cycles, the record has an error and only floor_us "
      "(kind 'HBM floor only', a lower bound). bytes is the compulsory traffic: x in and out (dy in and dx out "
      "too for the backward); the table is not compulsory (the angles can be computed on the fly).")
  results = table.setdefault("results", {})
  for gen in args.generations:
    for shape in BENCH_SHAPES:
      for positions in (False, True):
        for impl in args.impls:
          for mode in ("fwd", "fwdbwd"):
            cfg = dict(generation=gen, impl=impl, dtype="bfloat16", mode=mode, shape=list(shape), positions=positions)
            key = f"{gen}/{'x'.join(map(str, shape))}/{'positions' if positions else 'arange'}/{impl}/{mode}"
            if key in results and results[key].get("kernel") == KERNEL_VERSION and not args.force:
              continue
            r = estimate_isolated(cfg)
            r.update(cfg)
            r["kernel"] = KERNEL_VERSION
            if impl == "ours":
              with kernels.base.backend.target(gen):
                r["block_seq"] = R.default_block_sizes(gen, jnp.bfloat16, shape[2], shape[3], shape[1]).block_seq
            results[key] = r
            print(key, r.get("us"), r.get("model_us"), r.get("floor_us"), r.get("error", ""), flush=True)
            result_tables.save(table, BENCH_OUT)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("job", choices=("tune", "bench", "one", "floor"))
  ap.add_argument("config", nargs="?", help="(one, floor) a JSON configuration, used internally")
  ap.add_argument("--generations", nargs="*", default=list(GENERATIONS))
  ap.add_argument("--impls", nargs="*", default=["ours", "xla", "maxtext"])
  ap.add_argument("--force", action="store_true", help="(bench) re-estimate records already stored")
  args = ap.parse_args(argv)
  if args.job == "one":
    result_tables.print_result(estimate, args.config)
  elif args.job == "floor":
    result_tables.print_result(floor_only, args.config)
  else:
    {"tune": tune, "bench": bench}[args.job](args)


if __name__ == "__main__":
  main()
