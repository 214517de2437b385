"""Computes the compiler estimates the calibration notebook compares with published TPU measurements.

    python tools/calibrate.py --out kernels/data/calibration_v5e.json
    python tools/calibrate.py --only pallas-512x1024x1024/1024 xla/1024   # a subset, printed only

For each case it asks libtpu's static cost model (:func:`kernels.estimate_tpu`) how
many cycles a bf16 matmul takes on a TPU generation, and records cycles, seconds,
fraction of peak and of the roofline, plus the versions of jax and libtpu that
produced them. The cases are the ones the JAX Pallas TPU matmul guide measured on a
TPU v5e (https://docs.jax.dev/en/latest/pallas/tpu/matmul.html):

* the guide's blocked matmul, bm=512, bk=1024, bn=1024 (f32 VMEM accumulator, K
  innermost and "arbitrary"), at 1024^3, 4096^3 and 8192^3;
* XLA's ``a @ b`` at the same sizes;
* the same Pallas kernel with 128^3 blocks at 1024^3 and 4096^3 (32768 grid steps);
* on v6e, XLA and the 512/1024/1024 kernel at 8192^3 (a check of the 1.75 GHz
  clock that kernels/hardware.py assumes for v6e: at that clock no estimate may
  exceed the 918 TFLOP/s peak).

The 8192^3 compiles take about three minutes each with the cost model on, which is
why their results are stored in a file instead of being recomputed by the notebook.
The whole run takes 10 to 15 minutes on a 2-core CPU.
"""
from __future__ import annotations

import kernels  # noqa: I001  (first: enables the cost model before libtpu loads)

import argparse
import datetime
import functools
import importlib.metadata
import json
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "kernels" / "data" / "calibration_v5e.json"
DTYPE = jnp.bfloat16


# --- the kernels (the notebook defines the same two functions) ----------------------


def matmul_kernel(x_ref, y_ref, z_ref, acc_ref, *, nsteps):
  """One (bm, bn) output block; the grid's last axis walks K, accumulating in f32 VMEM."""
  @pl.when(pl.program_id(2) == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  acc_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

  @pl.when(pl.program_id(2) == nsteps - 1)
  def _():
    z_ref[...] = acc_ref[...].astype(z_ref.dtype)


def pallas_matmul(x, y, *, bm=512, bk=1024, bn=1024):
  """The JAX Pallas TPU matmul guide's blocked matmul (grid (M/bm, N/bn, K/bk))."""
  m, k = x.shape
  _, n = y.shape
  return pl.pallas_call(
      functools.partial(matmul_kernel, nsteps=k // bk),
      grid=(m // bm, n // bn, k // bk),
      in_specs=[pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
                pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j))],
      out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
      scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
      out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
  )(x, y)


def xla_matmul(x, y):
  return x @ y


# --- the cases -----------------------------------------------------------------------


def case(kernel: str, size: int, generation: str, blocks=None) -> dict:
  name = (f"pallas-{'x'.join(map(str, blocks))}" if kernel == "pallas" else "xla") + f"/{size}"
  if generation != "v5e":
    name += f"@{generation}"
  return {"name": name, "kernel": kernel, "size": size, "generation": generation,
          "blocks": None if blocks is None else dict(zip(("bm", "bk", "bn"), blocks))}


GUIDE_BLOCKS = (512, 1024, 1024)
CASES = [
    case("pallas", 1024, "v5e", GUIDE_BLOCKS),
    case("xla", 1024, "v5e"),
    case("pallas", 1024, "v5e", (128, 128, 128)),
    case("pallas", 4096, "v5e", (128, 128, 128)),
    case("pallas", 4096, "v5e", GUIDE_BLOCKS),
    case("xla", 4096, "v5e"),
    case("pallas", 8192, "v5e", GUIDE_BLOCKS),
    case("xla", 8192, "v5e"),
    case("pallas", 8192, "v6e", GUIDE_BLOCKS),
    case("xla", 8192, "v6e"),
]


def program(c: dict):
  """(function, argument specs, FLOPs, roofline bytes) of case ``c`` (``tools/refloor.py`` counts its HBM bytes)."""
  n = c["size"]
  x = jax.ShapeDtypeStruct((n, n), DTYPE)
  flops, bytes_accessed = kernels.matmul_cost(n, n, n, DTYPE)
  fn = functools.partial(pallas_matmul, **c["blocks"]) if c["kernel"] == "pallas" else xla_matmul
  return fn, (x, x), flops, bytes_accessed


def run_case(c: dict) -> dict:
  fn, args, flops, bytes_accessed = program(c)
  t0 = time.perf_counter()
  est = kernels.estimate_tpu(fn, *args, generation=c["generation"], flops=flops, bytes_accessed=bytes_accessed)
  wall = time.perf_counter() - t0
  chip = kernels.get_chip(c["generation"])
  return {
      **c,
      "dtype": jnp.dtype(DTYPE).name,
      "label": est.label,
      "cycles": est.cycles,
      "clock_hz": est.clock_hz,
      "seconds": est.seconds,
      "model_seconds": est.model_seconds,
      "floor_seconds": est.floor_seconds,
      "hbm_bytes": est.hbm_bytes,
      "bytes_method": est.bytes_method,
      "floored": est.floored,
      "flops": flops,
      "bytes_accessed": bytes_accessed,
      "tflops_per_second": flops / est.seconds / 1e12,
      "fraction_of_peak": flops / est.seconds / chip.peak(DTYPE),
      "fraction_of_roofline": est.fraction_of_roofline,
      "roofline_seconds": est.roofline.seconds,
      "valid": est.valid,
      "vmem_bytes": est.vmem_bytes,
      "compile_seconds": round(est.compile_seconds, 1),
      "wall_seconds": round(wall, 1),
      "ops": est.ops,
  }


def environment() -> dict:
  return {
      "jax": jax.__version__,
      "jaxlib": importlib.metadata.version("jaxlib"),
      "libtpu": importlib.metadata.version("libtpu"),
      "python": platform.python_version(),
      "host": f"{platform.machine()}, {platform.system()}",
  }


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON file to write (default: {DEFAULT_OUT})")
  parser.add_argument("--only", nargs="*", metavar="NAME", help="run only these cases and print them (no file written); "
                      "names: " + ", ".join(c["name"] for c in CASES))
  parser.add_argument("--resume", action="store_true",
                      help="keep the cases already in --out (same environment) and compute only the missing ones")
  args = parser.parse_args(argv)

  if not kernels.estimator_available():
    print("error: the TPU compiler's cost model is not available (is jax[tpu] installed? "
          "on a TPU host set KERNELS_STATIC_PROFILE=1)", file=sys.stderr)
    return 1
  selected = CASES
  if args.only:
    unknown = set(args.only) - {c["name"] for c in CASES}
    if unknown:
      parser.error(f"unknown case(s) {sorted(unknown)}")
    selected = [c for c in CASES if c["name"] in args.only]

  doc = {
      "description": ("Compiler estimates (libtpu's static LLO cost model, via kernels.estimate_tpu) of bf16 "
                      "matmuls: the JAX Pallas TPU matmul guide's blocked kernel and XLA's a @ b. Computed by "
                      "tools/calibrate.py; these are estimates, not measurements."),
      "kernel": ("pallas: the guide's kernel, grid (M/bm, N/bn, K/bk), f32 VMEM scratch accumulator zeroed at "
                 "k == 0 and written at the last k, dimension_semantics (parallel, parallel, arbitrary); "
                 "xla: jnp a @ b (bf16 in, bf16 out)"),
      "date": datetime.date.today().isoformat(),
      "environment": environment(),
      "cases": [],
  }
  if args.resume and args.out.exists():
    old = json.loads(args.out.read_text(encoding="utf-8"))
    if old.get("environment") == doc["environment"]:
      doc["cases"] = old["cases"]
      doc["date"] = old.get("date", doc["date"])
      done = {(r["name"], r["generation"]) for r in doc["cases"]}
      selected = [c for c in selected if (c["name"], c.get("generation", "v5e")) not in done]
  total = time.perf_counter()
  for c in selected:
    print(f"{c['name']:<32s} ...", end=" ", flush=True)
    r = run_case(c)
    doc["cases"].append(r)
    print(f"{r['cycles']:>10d} cycles  {r['seconds'] * 1e3:8.3f} ms  {100 * r['fraction_of_peak']:5.1f}% of peak  "
          f"valid={r['valid']}  ({r['wall_seconds']:.0f} s)", flush=True)
    if not args.only:  # write after every case, so a long run that is interrupted keeps what it computed
      doc["total_seconds"] = round(time.perf_counter() - total, 1)
      args.out.parent.mkdir(parents=True, exist_ok=True)
      args.out.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
  print(f"done in {time.perf_counter() - total:.0f} s" + ("" if args.only else f"; wrote {args.out}"))
  return 0


if __name__ == "__main__":
  sys.exit(main())
