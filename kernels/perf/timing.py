"""Wall-clock timing on the device JAX runs on.

:func:`benchmark` compiles and warms up, then times repetitions with
``block_until_ready`` and reports the median and spread, FLOP/s, bytes/s and the
fraction of the detected chip's peak. Every result names the device it ran on:
a number measured on a CPU says nothing about a TPU.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

import jax
import numpy as np

from kernels.base.backend import in_dry_run
from kernels.base.hardware import Chip, detect
from kernels.base.roofline import Roofline


@dataclasses.dataclass
class Measurement:
  """Measured wall-clock times of one function on one device."""

  device: str
  """``device_kind`` of the device, e.g. ``"TPU v5 lite"`` or ``"cpu"``."""
  chip: Chip
  times: np.ndarray
  """Seconds per call, one entry per repetition."""
  flops: float | None = None
  bytes_accessed: float | None = None
  dtype: str = "bfloat16"

  @property
  def median(self) -> float:
    return float(np.median(self.times))

  @property
  def spread(self) -> tuple[float, float]:
    """(25th, 75th) percentile of the per-call time."""
    return float(np.percentile(self.times, 25)), float(np.percentile(self.times, 75))

  @property
  def label(self) -> str:
    return f"measured on {self.device}"

  @property
  def flops_per_second(self) -> float | None:
    return None if self.flops is None else self.flops / self.median

  @property
  def bytes_per_second(self) -> float | None:
    return None if self.bytes_accessed is None else self.bytes_accessed / self.median

  @property
  def fraction_of_peak(self) -> float | None:
    """Achieved FLOP/s over the chip's peak (or bytes/s over its bandwidth when no FLOPs)."""
    if self.flops:
      return self.flops_per_second / self.chip.peak(self.dtype)
    if self.bytes_accessed:
      return self.bytes_per_second / self.chip.hbm_bandwidth
    return None

  @property
  def fraction_of_roofline(self) -> float | None:
    if self.flops is None or self.bytes_accessed is None:
      return None
    return Roofline(self.chip, self.flops, self.bytes_accessed, self.dtype).fraction(self.median)

  def as_dict(self) -> dict:
    return {"device": self.device, "kind": "measured", "median_s": self.median, "p25_s": self.spread[0],
            "p75_s": self.spread[1], "reps": len(self.times), "fraction_of_peak": self.fraction_of_peak}

  def __str__(self) -> str:
    lo, hi = self.spread
    s = f"{self.median * 1e6:,.1f} us (IQR {lo * 1e6:,.1f}-{hi * 1e6:,.1f}, n={len(self.times)}; {self.label})"
    if self.flops_per_second is not None:
      s += f", {self.flops_per_second / 1e12:.2f} TFLOP/s"
    if self.bytes_per_second is not None:
      s += f", {self.bytes_per_second / 1e9:.1f} GB/s"
    f = self.fraction_of_peak
    if f is not None:
      s += f", {100 * f:.1f}% of {self.chip.name} peak" + (" (nominal CPU peak)" if self.chip.nominal else "")
    return s


def benchmark(fn: Callable, *args, flops: float | None = None, bytes_accessed: float | None = None,
              dtype="bfloat16", warmup: int = 2, reps: int = 10, min_seconds: float = 0.0, **kwargs) -> Measurement:
  """Times ``jax.jit(fn)(*args, **kwargs)`` on the device its inputs live on.

  Compilation and ``warmup`` calls are excluded. At least ``reps`` calls are timed,
  more while their total stays under ``min_seconds``.
  """
  import functools
  if in_dry_run():  # a rehearsal of the code (kernels.base.backend.dry_run), not a measurement
    warmup, reps, min_seconds = 0, 1, 0.0
  f = jax.jit(functools.partial(fn, **kwargs)) if kwargs else jax.jit(fn)
  out = f(*args)
  jax.block_until_ready(out)
  for _ in range(warmup):
    jax.block_until_ready(f(*args))
  times = []
  start = time.perf_counter()
  while len(times) < reps or (time.perf_counter() - start) < min_seconds:
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    times.append(time.perf_counter() - t0)
    if len(times) >= 10_000:
      break
  leaves = [x for x in jax.tree.leaves(out) if hasattr(x, "devices")]
  device = next(iter(leaves[0].devices())) if leaves else jax.devices()[0]
  kind = device.device_kind if device.platform == "tpu" else device.platform
  from kernels.base.roofline import _name
  return Measurement(kind, detect(device), np.asarray(times), flops, bytes_accessed, _name(dtype))
