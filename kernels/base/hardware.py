"""The hardware table: the figures every roofline and every "% of peak" uses.

Peak rates and bandwidths are per chip, as Google publishes them; VMEM is per
TensorCore. A JAX device on v4 and v5p is one chip with two TensorCores fused as a
*megacore*; on v5e and v6e a chip has one TensorCore.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Mapping

MiB = 1 << 20

_TPU_INFO = "jax/_src/pallas/mosaic/tpu_info.py (JAX's own per-generation table)"
_AOT = "observed: AOT compile with libtpu (kernels.perf.tpu), a block that exceeds it fails"


@dataclasses.dataclass(frozen=True)
class Chip:
  """One accelerator generation (or the host CPU)."""

  name: str
  """Short name used across the project: ``"v4"``, ``"v5e"``, ``"v5p"``, ``"v6e"``, ``"cpu"``."""
  peak_flops: Mapping[str, float]
  """Peak dense ops per second per chip, by input dtype (``"bfloat16"``, ``"int8"``, ...)."""
  hbm_bandwidth: float
  """Main-memory bandwidth per chip, bytes/s."""
  hbm_bytes: float
  vmem_bytes: int
  """VMEM per TensorCore (0 for the CPU)."""
  default_scoped_vmem_bytes: int
  """VMEM a kernel may use unless it raises ``vmem_limit_bytes``."""
  mxu_shape: tuple[int, int]
  mxus_per_core: int
  tensorcores: int
  clock_hz: float
  device_kinds: tuple[str, ...] = ()
  """``jax.Device.device_kind`` strings that mean this chip."""
  topologies: tuple[str, ...] = ()
  """Compile-only topology names to try, newest JAX spelling first."""
  ici_link_bandwidth: float = 0.0
  """Inter-chip interconnect (ICI) bandwidth of one link, one direction, bytes/s."""
  ici_links: int = 0
  """ICI links per chip (4 on a 2-D torus, 6 on a 3-D one)."""
  ici_wraparound: int = 0
  """The shortest slice axis that closes into a ring (a torus wrap-around link): 4 on v4 and v5p
  (any axis of a whole 4-chip cube), 16 on v5e and v6e (full pod axes only)."""
  ici_latency: float | None = None
  """Fixed time of one neighbour transfer, seconds, where a measurement was published (else None)."""
  sources: Mapping[str, str] = dataclasses.field(default_factory=dict)
  nominal: bool = False
  """True when the figures are order-of-magnitude only (the CPU entry)."""

  @property
  def megacore(self) -> bool:
    return self.tensorcores > 1

  def peak(self, dtype: str = "bfloat16") -> float:
    """Peak ops/s for matmul inputs of ``dtype``; f32 inputs use the bf16 MXU rate (default precision)."""
    key = _dtype_name(dtype)
    if key in ("float32", "float16"):
      key = "bfloat16"
    if key.startswith("float8"):
      key = "float8"
    if key in ("uint8",):
      key = "int8"
    if key not in self.peak_flops:
      raise KeyError(f"{self.name} has no native matmul rate for {key}")
    return self.peak_flops[key]

  @property
  def ridge_point(self) -> float:
    """FLOPs per byte at which bf16 compute and HBM time are equal."""
    return self.peak("bfloat16") / self.hbm_bandwidth


def _dtype_name(dtype) -> str:
  import jax.numpy as jnp
  return jnp.dtype(dtype).name


_CLOUD = "https://cloud.google.com/tpu/docs/"
_SCALING_BOOK = "https://jax-ml.github.io/scaling-book/"
_PPERMUTE_FIT = ("the ppermute fit t = {lat} us + bytes / {bw} GB/s on {chip}-8 quoted by issue 22 of this project "
                 "(a published measurement; the fixed part used as the per-transfer latency)")

V4 = Chip(
    name="v4",
    peak_flops={"bfloat16": 275e12, "int8": 275e12},
    hbm_bandwidth=1200e9,
    hbm_bytes=32e9,
    vmem_bytes=16 * MiB,
    default_scoped_vmem_bytes=16 * MiB,
    mxu_shape=(128, 128),
    mxus_per_core=4,
    tensorcores=2,
    clock_hz=1.05e9,
    device_kinds=("TPU v4",),
    topologies=("v4:2x2x1",),
    ici_link_bandwidth=45e9,
    ici_links=6,
    ici_wraparound=4,
    ici_latency=None,
    sources={
        "ici_link_bandwidth": _SCALING_BOOK + "tpus (ICI: 4.5e10 B/s one way per link, 3-D torus, 6 links)",
        "peak_flops": _CLOUD + "v4 (275 TFLOP/s bf16 per chip; int8 runs at the bf16 rate)",
        "hbm_bandwidth": _CLOUD + "v4 (32 GiB HBM2, 1200 GB/s)",
        "hbm_bytes": _CLOUD + "v4",
        "vmem_bytes": _TPU_INFO + "; " + _AOT,
        "default_scoped_vmem_bytes": _AOT,
        "mxu_shape": _TPU_INFO,
        "mxus_per_core": _CLOUD + "system-architecture-tpu-vm (4 MXUs per TensorCore)",
        "tensorcores": _CLOUD + "v4 (2 TensorCores per chip, megacore)",
        "clock_hz": "derived: 275e12 / (2 cores x 4 MXU x 128^2 x 2 FLOP) = 1.05 GHz",
    },
)

V5E = Chip(
    name="v5e",
    peak_flops={"bfloat16": 197e12, "int8": 394e12},
    hbm_bandwidth=819e9,
    hbm_bytes=16e9,
    vmem_bytes=128 * MiB,
    default_scoped_vmem_bytes=16 * MiB,
    mxu_shape=(128, 128),
    mxus_per_core=4,
    tensorcores=1,
    clock_hz=1.5e9,
    device_kinds=("TPU v5 lite", "TPU v5e", "TPU v5litepod"),
    topologies=("v5e:2x2", "v5litepod:2x2"),
    ici_link_bandwidth=45e9,
    ici_links=4,
    ici_wraparound=16,
    ici_latency=None,
    sources={
        "ici_link_bandwidth": _SCALING_BOOK + "tpus (ICI: 4.5e10 B/s one way per link; 2-D, 4 links; wrap-around only on 16-chip axes)",
        "peak_flops": _CLOUD + "v5e (197 TFLOP/s bf16, 394 TOP/s int8 per chip)",
        "hbm_bandwidth": _CLOUD + "v5e (16 GB HBM2, 819 GB/s)",
        "hbm_bytes": _CLOUD + "v5e",
        "vmem_bytes": _TPU_INFO,
        "default_scoped_vmem_bytes": _AOT,
        "mxu_shape": _TPU_INFO,
        "mxus_per_core": _CLOUD + "v5e (4 MXUs per TensorCore)",
        "tensorcores": _CLOUD + "v5e (1 TensorCore per chip)",
        "clock_hz": "derived: 197e12 / (4 MXU x 128^2 x 2 FLOP) = 1.5 GHz",
    },
)

V5P = Chip(
    name="v5p",
    peak_flops={"bfloat16": 459e12, "int8": 918e12},
    hbm_bandwidth=2765e9,
    hbm_bytes=95e9,
    vmem_bytes=64 * MiB,
    default_scoped_vmem_bytes=16 * MiB,
    mxu_shape=(128, 128),
    mxus_per_core=4,
    tensorcores=2,
    clock_hz=1.75e9,
    device_kinds=("TPU v5", "TPU v5p"),
    topologies=("v5p:2x2x1",),
    ici_link_bandwidth=90e9,
    ici_links=6,
    ici_wraparound=4,
    ici_latency=4.6e-6,
    sources={
        "ici_link_bandwidth": _SCALING_BOOK + "tpus (ICI: 9e10 B/s one way per link, 3-D torus, 6 links)",
        "ici_latency": _PPERMUTE_FIT.format(lat=4.6, bw=86.3, chip="v5p"),
        "peak_flops": _CLOUD + "v5p (459 TFLOP/s bf16, 918 TOP/s int8 per chip)",
        "hbm_bandwidth": _CLOUD + "v5p (95 GB HBM2e, 2765 GB/s)",
        "hbm_bytes": _CLOUD + "v5p",
        "vmem_bytes": _TPU_INFO + "; " + _AOT + " (63.94 MiB usable)",
        "default_scoped_vmem_bytes": _AOT,
        "mxu_shape": _TPU_INFO,
        "mxus_per_core": _TPU_INFO,
        "tensorcores": _CLOUD + "v5p (2 TensorCores per chip, megacore)",
        "clock_hz": "derived: 459e12 / (2 cores x 4 MXU x 128^2 x 2 FLOP) = 1.75 GHz",
    },
)

V6E = Chip(
    name="v6e",
    peak_flops={"bfloat16": 918e12, "int8": 1836e12, "float8": 918e12},
    hbm_bandwidth=1640e9,
    hbm_bytes=32e9,
    vmem_bytes=128 * MiB,
    default_scoped_vmem_bytes=32 * MiB,
    mxu_shape=(256, 256),
    mxus_per_core=2,
    tensorcores=1,
    clock_hz=1.75e9,
    device_kinds=("TPU v6 lite", "TPU v6e"),
    topologies=("v6e:2x2",),
    ici_link_bandwidth=90e9,
    ici_links=4,
    ici_wraparound=16,
    ici_latency=2.3e-6,
    sources={
        "ici_link_bandwidth": _SCALING_BOOK + "tpus (ICI: 9e10 B/s one way per link; 2-D, 4 links; wrap-around only on 16-chip axes)",
        "ici_latency": _PPERMUTE_FIT.format(lat=2.3, bw=86.8, chip="v6e"),
        "peak_flops": _CLOUD + "v6e (918 TFLOP/s bf16, 1836 TOP/s int8 per chip); fp8 rate from " + _TPU_INFO,
        "hbm_bandwidth": _CLOUD + "v6e (32 GB, 1640 GB/s)",
        "hbm_bytes": _CLOUD + "v6e",
        "vmem_bytes": _TPU_INFO,
        "default_scoped_vmem_bytes": _AOT,
        "mxu_shape": _TPU_INFO + " (256x256 from v6 on)",
        "mxus_per_core": _CLOUD + "v6e (2 MXUs per TensorCore) and " + _TPU_INFO,
        "tensorcores": _CLOUD + "v6e (1 TensorCore per chip)",
        "clock_hz": ("not published; 1.75 GHz is the clock at which the compiler's cycle estimate of "
                     "XLA's 8192^3 bf16 matmul lands just under the 918 TFLOP/s peak (at 2 GHz it would "
                     "exceed the peak), and matches v5p's clock. Treat v6e absolute times with that caveat."),
    },
)


def _cpu_chip() -> Chip:
  cores = os.cpu_count() or 1
  return Chip(
      name="cpu",
      peak_flops={"bfloat16": cores * 2.5e9 * 32, "float32": cores * 2.5e9 * 32, "int8": cores * 2.5e9 * 64},
      hbm_bandwidth=20e9,
      hbm_bytes=0.0,
      vmem_bytes=0,
      default_scoped_vmem_bytes=0,
      mxu_shape=(0, 0),
      mxus_per_core=0,
      tensorcores=cores,
      clock_hz=2.5e9,
      device_kinds=("cpu",),
      sources={
          "peak_flops": "nominal: cores x 2.5 GHz x 32 f32 FLOP/cycle (two AVX2 FMA pipes); an order of magnitude, not a spec",
          "hbm_bandwidth": "nominal: 20 GB/s, a dual-channel DDR4 order of magnitude",
      },
      nominal=True,
  )


CHIPS: dict[str, Chip] = {c.name: c for c in (V4, V5E, V5P, V6E)}
CHIPS["cpu"] = _cpu_chip()
TPU_GENERATIONS: tuple[str, ...] = ("v4", "v5e", "v5p", "v6e")

_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "trillium": "v6e", "tpu v5 lite": "v5e", "tpu v6 lite": "v6e",
            "tpu v5": "v5p", "tpu v4": "v4", "tpu v5e": "v5e", "tpu v5p": "v5p", "tpu v6e": "v6e"}


def get_chip(name) -> Chip:
  """Looks a chip up by short name (``"v5e"``), device kind (``"TPU v5 lite"``) or ``jax.Device``."""
  from kernels.base.errors import KernelError
  if isinstance(name, Chip):
    return name
  if hasattr(name, "device_kind"):
    name = name.device_kind if name.platform == "tpu" else "cpu"
  key = str(name).strip().lower()
  key = _ALIASES.get(key, key)
  if key in CHIPS:
    return CHIPS[key]
  raise KernelError("generation", name, f"unknown chip; expected one of {sorted(CHIPS)} or a TPU device kind")


def detect(device=None) -> Chip:
  """The chip JAX runs on (the first default device unless ``device`` is given)."""
  import jax
  device = device or jax.devices()[0]
  if device.platform == "tpu":
    return get_chip(device.device_kind)
  return CHIPS["cpu"]


def table() -> list[dict]:
  """The table as rows (for notebooks and docs)."""
  rows = []
  for name in TPU_GENERATIONS:
    c = CHIPS[name]
    rows.append({
        "chip": c.name,
        "bf16 TFLOP/s": c.peak("bfloat16") / 1e12,
        "int8 TOP/s": c.peak_flops.get("int8", float("nan")) / 1e12,
        "HBM GB/s": c.hbm_bandwidth / 1e9,
        "HBM GB": c.hbm_bytes / 1e9,
        "VMEM MiB/core": c.vmem_bytes / MiB,
        "scoped VMEM MiB": c.default_scoped_vmem_bytes / MiB,
        "MXU": f"{c.mxus_per_core}x {c.mxu_shape[0]}x{c.mxu_shape[1]}",
        "TensorCores": c.tensorcores,
        "clock GHz": c.clock_hz / 1e9,
        "ridge FLOP/B": c.ridge_point,
    })
  return rows
