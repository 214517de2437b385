"""The roofline: the fastest a kernel can possibly run on a chip.

A kernel that performs ``flops`` operations and moves ``bytes_accessed`` bytes
between HBM and the core cannot finish sooner than the larger of
``flops / peak`` and ``bytes_accessed / bandwidth``. Its arithmetic intensity
``flops / bytes_accessed`` against the chip's ridge point ``peak / bandwidth``
says which of the two binds.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from kernels.base.hardware import Chip, get_chip


@dataclasses.dataclass(frozen=True)
class Roofline:
  """Lower-bound time of a kernel on one chip."""

  chip: Chip
  flops: float
  bytes_accessed: float
  dtype: str = "bfloat16"

  @property
  def peak(self) -> float:
    return self.chip.peak(self.dtype)

  @property
  def compute_seconds(self) -> float:
    return self.flops / self.peak

  @property
  def memory_seconds(self) -> float:
    return self.bytes_accessed / self.chip.hbm_bandwidth

  @property
  def seconds(self) -> float:
    """The lower bound: max(compute time, memory time)."""
    return max(self.compute_seconds, self.memory_seconds)

  @property
  def intensity(self) -> float:
    """Arithmetic intensity, FLOPs per byte of HBM traffic."""
    return self.flops / self.bytes_accessed if self.bytes_accessed else float("inf")

  @property
  def ridge_point(self) -> float:
    """Intensity above which the chip is compute-bound for this dtype."""
    return self.peak / self.chip.hbm_bandwidth

  @property
  def bound(self) -> str:
    return "compute" if self.intensity >= self.ridge_point else "memory"

  def fraction(self, seconds: float) -> float:
    """Fraction of the roofline reached by a kernel taking ``seconds`` (1.0 = at the bound)."""
    return self.seconds / seconds

  def attainable_flops(self) -> float:
    """FLOP/s the roofline allows at this intensity."""
    return min(self.peak, self.intensity * self.chip.hbm_bandwidth)

  def __str__(self) -> str:
    return (f"roofline on {self.chip.name}: {self.seconds * 1e6:.1f} us ({self.bound}-bound; "
            f"intensity {self.intensity:.1f} FLOP/B, ridge {self.ridge_point:.1f} FLOP/B)")


def roofline(flops: float, bytes_accessed: float, chip="v5e", dtype="bfloat16") -> Roofline:
  """The roofline of a kernel with the given cost on ``chip`` (a name, device kind or :class:`Chip`)."""
  return Roofline(get_chip(chip), float(flops), float(bytes_accessed), _name(dtype))


def matmul_cost(m: int, k: int, n: int, dtype="bfloat16", out_dtype=None, batch: int = 1) -> tuple[float, float]:
  """(FLOPs, minimum HBM bytes) of ``[m,k] @ [k,n]``: each operand read once, the output written once."""
  isz = jnp.dtype(dtype).itemsize
  osz = jnp.dtype(out_dtype or dtype).itemsize
  flops = 2.0 * batch * m * k * n
  bytes_accessed = batch * (isz * (m * k + k * n) + osz * m * n)
  return flops, float(bytes_accessed)


def _name(dtype) -> str:
  return jnp.dtype(dtype).name
