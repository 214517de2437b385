"""Benchmarks kernels.fft against XLA and plain-JAX matmul DFTs, with the TPU compiler's cost model.

``bench`` -> ``kernels/data/fft_bench.json``. Every number is a **compiler estimate**
(``kernels.estimate_tpu``, libtpu's static cost model), never a measurement, stored with
:meth:`kernels.perf.tpu.Estimate.record`: ``us`` is the floored estimate (the model's time, but
never less than the program's counted HBM bytes at the published bandwidth).

Cases (complex data as float32 planes for ours; complex64 for the others, which is what they take):

* ``fft4096``: ``fft`` of a batch of 1024 rows of N = 4096: ours at each precision;
  ``jnp.fft.fft`` (XLA's FFT); ``dft_matmul`` (FNet's method: one dense complex64 ``x @ F_N``
  at ``Precision.HIGHEST``); ``two_stage_jax`` (the same four-step factorisation written in
  plain JAX: two einsums at HIGHEST, the twiddle and the transpose, left to XLA).
* ``fft65536``: batch 16, N = 65536: ours (highest), ``jnp.fft.fft``, ``two_stage_jax``.
* ``conv``: ``fft_conv`` at ``[8, 768, 8192]`` causal, forward and forward + backward (of ``u``
  and ``k``), against the ``jnp.fft.rfft`` / ``irfft`` composition. Ours is the fused kernel;
  its forward + backward is the sum of two estimates, the forward kernel as it runs under
  differentiation (``mode="fwd_save"``: it also writes ``u``'s spectrum for the backward) and
  the backward kernel (``mode="bwd"``); the sum's ``method`` says so. The whole program's
  profile passed 17 GB of RAM.

**Slices.** libtpu's cost model of XLA's FFT takes minutes and GB of RAM at the full batch
(over 8 GB at 1024 x 4096). Every program is therefore estimated on a slice of the batch
(``rows`` of ``full_rows``; all of them are independent rows, so the work and the bytes are
linear in the rows) and ``us`` is scaled by ``full_rows / rows``; the record keeps
the factor (``slice_scale``). ``fraction_of_roofline`` is the roofline over ``us``, the roofline
being the larger of the HBM time of each input read once and each output written once and the
MXU time of the matmul FLOPs our kernel needs at one bf16 pass (``flops``), at the full batch.

Run it under the shared lock::

  flock /tmp/tpu-heavy.lock nice -n 10 python tools/tune_fft.py bench
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import results as result_tables  # noqa: E402  (tools/results.py: the JSON tables)
import kernels  # noqa: E402  (first: enables the cost model before JAX loads libtpu)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from kernels.fourier import transforms as kfft
from kernels.fourier import long_conv

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels", "data")
BENCH_OUT = os.path.join(DATA, "fft_bench.json")
GENERATIONS = ("v5e", "v6e")
CASES = {  # name: (full rows, estimated rows, n)
    "fft4096": (1024, 256, 4096),  # 256 rows: two grid steps of the 128-row blocks
    "fft65536": (16, 16, 65536),
}
CONV = (8, 768, 8192)  # batch, channels, seq
CONV_SLICE = (8, 8)  # estimated batch, channels (full / slice = 96): the whole batch, one channel block
KERNEL_VERSION = 2  # stage 1 on the VPU
CONV_VERSION = 4  # the fused fft_conv, first stage on the VPU
HIGHEST = lax.Precision.HIGHEST


def _dft64(n):
  j = np.arange(n)
  ang = -2 * np.pi * ((j[:, None] * j[None, :]) % n) / n
  return np.exp(1j * ang).astype(np.complex64)


def dft_matmul(x):
  """FNet's DFT: one dense ``[B, N] x [N, N]`` complex64 matmul."""
  return jnp.dot(x, jnp.asarray(_dft64(x.shape[-1])), precision=HIGHEST)


def two_stage_jax(x):
  """The four-step factorisation in plain JAX: ``N = S * 128``; S-point DFT (einsum), twiddle,
  128-point DFT (einsum), transpose; XLA decides the layouts and fusions."""
  b, n = x.shape
  s = n // 128
  a = x.reshape(b, s, 128)
  y = jnp.einsum("ks,bsf->bkf", jnp.asarray(_dft64(s)), a, precision=HIGHEST)
  k2, f = np.arange(s)[:, None], np.arange(128)[None, :]
  y = y * jnp.asarray(np.exp(-2j * np.pi * ((k2 * f) % n) / n).astype(np.complex64))
  z = jnp.einsum("bkf,fj->bkj", y, jnp.asarray(_dft64(128)), precision=HIGHEST)
  return jnp.swapaxes(z, 1, 2).reshape(b, n)


def _kernel_flops(rows, n):
  """The least matmul work of our kernel's routes, at one pass: 3 real products (Gauss) of one dense DFT
  (``n <= 512``) or of one 128-point stage (stage 1 is butterflies on the VPU)."""
  inner = n if n <= kfft.DENSE_MAX else 128
  return 3 * 2 * rows * n * inner


def _program(cfg):
  impl, case = cfg["impl"], cfg["case"]
  f32, c64 = jnp.float32, jnp.complex64
  if case == "conv":
    b, c = CONV_SLICE
    t = CONV[2]
    u, k = jax.ShapeDtypeStruct((b, c, t), f32), jax.ShapeDtypeStruct((c, t), f32)
    precision = cfg.get("precision", "highest")
    fwd = (lambda u, k: long_conv.fft_conv(u, k, precision=precision, implementation="pallas", interpret=False)) \
        if impl == "ours" else long_conv.fft_conv_reference
    if cfg["mode"] == "fwd":
      return fwd, (u, k)
    from kernels.fourier import long_conv as fft_conv
    if cfg["mode"] == "fwd_save":  # our forward under differentiation: it also writes u's spectrum
      return (lambda u, k: fft_conv._conv_call(u, k, None, causal=True, precision=precision, interpret=False,
                                               save_spectrum=True)), (u, k)
    if cfg["mode"] == "bwd":  # our backward kernel alone (du and dk, from the saved spectrum)
      w = fft_conv.lane_width(t, cfg["generation"])
      spectrum = jax.ShapeDtypeStruct((2, b // 2, 2 * t // w, c, w), f32)
      return (lambda z, k, dy: fft_conv._bwd_call(z, k, None, dy, causal=True, precision=precision,
                                                  interpret=False)), (spectrum, k, u)

    def fwdbwd(u, k, dy):
      y, vjp = jax.vjp(fwd, u, k)
      return y, vjp(dy)
    return fwdbwd, (u, k, u)
  _, rows, n = CASES[case]
  if impl == "ours":
    x = jax.ShapeDtypeStruct((rows, n), f32)
    return (lambda a, b: kfft.fft((a, b), precision=cfg["precision"], implementation="pallas", interpret=False),
            (x, x))
  x = jax.ShapeDtypeStruct((rows, n), c64)
  return {"jnp_fft": jnp.fft.fft, "dft_matmul": dft_matmul, "two_stage_jax": two_stage_jax}[impl], (x,)


def _scale(cfg) -> float:
  if cfg["case"] == "conv":
    return (CONV[0] * CONV[1]) / (CONV_SLICE[0] * CONV_SLICE[1])
  full, rows, _ = CASES[cfg["case"]]
  return full / rows


def _roofline_us(cfg, gen) -> float:
  chip = kernels.get_chip(gen)
  if cfg["case"] == "conv":  # the fused kernels' transforms: one 128-point matmul stage each (stage 1 on the VPU)
    b, c, t = CONV
    fwd_io, bwd_io = 4 * (2 * b * c * t + c * t), 4 * (3 * b * c * t + 2 * c * t)
    fwd_tf, bwd_tf = c + b * c, 2 * c + b * c  # transforms: k, the packed pairs' fft and ifft; k, dy, du, dk
    one = 3 * 2 * (2 * t) * 128  # the matmul stage of one transform of length 2t, one pass
    fwd, bwd = cfg["mode"] in ("fwd", "fwd_save", "fwdbwd"), cfg["mode"] in ("bwd", "fwdbwd")
    io = fwd * fwd_io + bwd * bwd_io
    flops = one * (fwd * fwd_tf + bwd * bwd_tf)
  else:
    full, _, n = CASES[cfg["case"]]
    io = 16 * full * n
    flops = _kernel_flops(full, n)
  return 1e6 * max(io / chip.hbm_bandwidth, flops / chip.peak("bfloat16"))


def estimate(cfg) -> dict:
  fn, args = _program(cfg)
  e = kernels.estimate_tpu(fn, *args, generation=cfg["generation"])
  r = e.record()
  scale = _scale(cfg)
  r.update(slice_scale=scale, us=round(r["us"] * scale, 3), model_us=round(r["model_us"] * scale, 3),
           floor_us=round(r["floor_us"] * scale, 3), compile_seconds=round(e.compile_seconds, 1))
  return r


def _configs(generations):
  for gen in generations:
    for precision in kfft.PRECISIONS:
      yield dict(generation=gen, case="fft4096", impl="ours", precision=precision)
    for impl in ("jnp_fft", "dft_matmul", "two_stage_jax"):
      yield dict(generation=gen, case="fft4096", impl=impl)
    yield dict(generation=gen, case="fft65536", impl="ours", precision="highest")
    for impl in ("jnp_fft", "two_stage_jax"):
      yield dict(generation=gen, case="fft65536", impl=impl)
    for precision in ("highest", "high"):  # ours: fwd_save + bwd gives fwdbwd (see _conv_fwdbwd)
      for mode in ("fwd", "fwd_save", "bwd"):
        yield dict(generation=gen, case="conv", impl="ours", precision=precision, mode=mode)
    for mode in ("fwd", "fwdbwd"):
      yield dict(generation=gen, case="conv", impl="jnp_fft", mode=mode)


def _conv_fwdbwd(results: dict) -> None:
  """Our fft_conv forward + backward: the sum of the estimates of the forward kernel as it runs under
  differentiation (``fwd_save``) and of the backward kernel."""
  for key in [k for k in results if "/conv/ours/" in k and k.endswith("/fwd")]:
    fwd, bwd = results.get(key + "_save", {}), results.get(key[:-len("fwd")] + "bwd", {})
    out = key[:-len("fwd")] + "fwdbwd"
    if "us" not in fwd or "us" not in bwd:
      results[out] = dict(fwd, mode="fwdbwd", error="no estimate of " + ("the forward" if "us" not in fwd else "the backward"))
      results[out].pop("us", None)
      continue
    r = {k: round(fwd[k] + bwd[k], 3) for k in ("us", "model_us", "floor_us")}
    r.update({k: fwd[k] for k in ("generation", "case", "impl", "precision", "slice_scale", "kernel")},
             mode="fwdbwd", method="sum of two estimates: the forward kernel saving u's spectrum, and the backward kernel")
    cfg = {k: r[k] for k in ("generation", "case", "impl", "precision", "mode")}
    r["fraction_of_roofline"] = round(_roofline_us(cfg, cfg["generation"]) / r["us"], 4)
    results[out] = r


def _run_capped(cfg, max_gb: float) -> dict:
  """The ``one`` job in a child process, stopped if its resident memory passes ``max_gb``."""
  import subprocess  # noqa: PLC0415
  import time  # noqa: PLC0415
  proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "one", json.dumps(cfg)],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
  while proc.poll() is None:
    if result_tables.rss_gb(proc.pid) > max_gb:
      result_tables.kill_tree(proc)
      return {"error": f"stopped: the estimate passed {max_gb} GB of RAM"}
    time.sleep(0.5)
  lines = [ln for ln in proc.stdout.read().splitlines() if ln.startswith("{")]
  return json.loads(lines[-1]) if lines else {"error": f"exit {proc.returncode}"}


def _key(cfg):
  return "/".join(str(cfg[k]) for k in ("generation", "case", "impl", "precision", "mode") if k in cfg)


def bench(args):
  out = args.out or BENCH_OUT
  table = result_tables.load(out) or {}
  table.update({
      "description": (
          "kernels.fourier.transforms against XLA's FFT and plain-JAX matmul DFTs: compiler estimates (libtpu's static cost model), "
          "not measurements. us is the floored estimate (the model's time, never less than the counted HBM bytes at "
          "the published bandwidth), estimated on a slice of the batch and scaled by slice_scale to the "
          "full batch (rows are independent: work and bytes are linear in them). fraction_of_roofline: the roofline, "
          "max(HBM time of each input read once and each output written once, MXU time of one 128-point DFT stage "
          "as a matmul at one bf16 pass, the least matmul work of the kernel's routes) at the full batch, over us "
          "(for conv: that stage for each of the fused kernels' transforms). Cases: fft4096 = fft of [1024, 4096] complex; fft65536 = [16, 65536]; conv = fft_conv at "
          "[8, 768, 8192] causal (fwd, fwd+bwd of u and k) against the jnp.fft.rfft/irfft composition."),
      "generated_by": "tools/tune_fft.py", "kind": "compiler estimate (floored)",
      "environment": {"jax": jax.__version__, "python": platform.python_version()}})
  results = table.setdefault("results", {})
  for cfg in _configs(args.generations):
    key = _key(cfg)
    version = CONV_VERSION if cfg["case"] == "conv" else KERNEL_VERSION
    if key in results and "us" in results[key] and results[key].get("kernel") == version and not args.force:
      continue
    if args.only and not any(o in key for o in args.only):
      continue
    r = _run_capped(cfg, args.max_gb)
    r.update(cfg, kernel=version)
    if "us" in r:  # the roofline as a fraction: a bound, not a time anything ran in
      r["fraction_of_roofline"] = round(_roofline_us(cfg, cfg["generation"]) / r["us"], 4)
    results[key] = r
    print(key, r.get("us"), r.get("error", ""), flush=True)
    _conv_fwdbwd(results)
    result_tables.save(table, out)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("job", choices=("bench", "one"))
  ap.add_argument("config", nargs="?", help="(one) a JSON configuration, used internally")
  ap.add_argument("--generations", nargs="*", default=list(GENERATIONS))
  ap.add_argument("--only", nargs="*", default=None, help="only keys containing one of these strings")
  ap.add_argument("--force", action="store_true")
  ap.add_argument("--out", default=None, help="the table to write (default kernels/data/fft_bench.json)")
  ap.add_argument("--max-gb", type=float, default=4.0, help="stop an estimate whose RAM passes this")
  args = ap.parse_args(argv)
  if args.job == "one":
    result_tables.print_result(estimate, args.config)
    return
  bench(args)


if __name__ == "__main__":
  main()
