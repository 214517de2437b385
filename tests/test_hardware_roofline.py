import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels
from kernels.base import hardware
from kernels.base import roofline
from kernels.base import tiling


def test_table_has_every_generation_with_sources():
  for name in ("v4", "v5e", "v5p", "v6e", "cpu"):
    chip = kernels.get_chip(name)
    assert chip.peak("bfloat16") > 0 and chip.hbm_bandwidth > 0
    for field in ("peak_flops", "hbm_bandwidth"):
      assert chip.sources.get(field), (name, field)
  for name in kernels.TPU_GENERATIONS:
    chip = kernels.get_chip(name)
    for field in ("vmem_bytes", "mxu_shape", "tensorcores", "clock_hz", "default_scoped_vmem_bytes"):
      assert chip.sources.get(field), (name, field)
  assert len(hardware.table()) == 4


def test_published_figures():
  assert kernels.get_chip("v5e").peak("bfloat16") == 197e12
  assert kernels.get_chip("v6e").hbm_bandwidth == 1640e9
  assert kernels.get_chip("v4").megacore and kernels.get_chip("v5p").megacore
  assert not kernels.get_chip("v5e").megacore
  assert kernels.get_chip("v6e").mxu_shape == (256, 256)


@pytest.mark.parametrize("kind,name", [("TPU v5 lite", "v5e"), ("TPU v6 lite", "v6e"), ("TPU v5", "v5p"),
                                       ("TPU v4", "v4"), ("v5litepod", "v5e"), ("V6E", "v6e")])
def test_device_kinds(kind, name):
  assert kernels.get_chip(kind).name == name


def test_unknown_chip_is_a_kernel_error():
  with pytest.raises(kernels.KernelError, match="generation"):
    kernels.get_chip("v9x")


def test_detect_on_cpu():
  assert kernels.detect().name == "cpu"


def test_roofline_known_numbers():
  # 8192^3 bf16 on v5e: 1.0995e12 FLOPs / 197e12 = 5.581 ms, compute-bound.
  flops, nbytes = kernels.matmul_cost(8192, 8192, 8192)
  assert flops == 2 * 8192**3 and nbytes == 3 * 2 * 8192**2
  r = roofline.roofline(flops, nbytes, "v5e")
  assert r.seconds == pytest.approx(5.5813e-3, rel=1e-4)
  assert r.bound == "compute"
  assert r.intensity == pytest.approx(8192 / 3)
  assert r.ridge_point == pytest.approx(197e12 / 819e9)
  assert r.fraction(2 * r.seconds) == pytest.approx(0.5)
  # An elementwise f32 op over 1 GiB read + 1 GiB written is memory-bound: 2 GiB / 819 GB/s.
  m = roofline.roofline(2**28, 2**31, "v5e", dtype="float32")
  assert m.bound == "memory" and m.seconds == pytest.approx(2**31 / 819e9)
  assert m.attainable_flops() == pytest.approx(m.intensity * 819e9)


def test_roofline_int8_uses_int8_peak():
  r = roofline.roofline(1e12, 1.0, "v5e", dtype=jnp.int8)
  assert r.seconds == pytest.approx(1e12 / 394e12)


def test_tiling_rule():
  tiling.check_block_shape("block", (8, 128), (64, 256))
  tiling.check_block_shape("block", (64, 100), (64, 100))  # equal to the array dims
  tiling.check_block_shape("block", (2, 16, 256), (4, 100, 512))
  with pytest.raises(kernels.TilingError, match=r"block_q=.*divisible by \(8, 128\)"):
    tiling.check_block_shape("block_q", (12, 128), (64, 256))
  with pytest.raises(kernels.TilingError, match="dim -1 is 100"):
    tiling.check_block_shape("block_k", (8, 100), (64, 256))
  with pytest.raises(kernels.KernelError, match="rank"):
    tiling.check_block_shape("block", (8,), (64, 256))


def test_vmem_budget():
  assert tiling.sublane_multiple(jnp.float32) == 8
  assert tiling.sublane_multiple(jnp.bfloat16) == 16
  assert tiling.sublane_multiple(jnp.int8) == 32
  assert tiling.block_bytes((1, 1), jnp.float32) == 8 * 128 * 4  # padded to a native tile
  fp = tiling.vmem_footprint([((512, 1024), jnp.bfloat16), ((1024, 1024), jnp.bfloat16), ((512, 1024), jnp.bfloat16)],
                             scratch=[((512, 1024), jnp.float32)])
  assert fp == 2 * (1 + 2 + 1) * 2**20 + 2 * 2**20
  assert tiling.vmem_limit(4 * 2**20, "v5e") is None
  assert tiling.vmem_limit(fp, "v5e") is None  # 10 MiB x 1.25 headroom + 1 MiB fits the 16 MiB default
  big = tiling.vmem_limit(40 * 2**20, "v5e")
  assert 40 * 2**20 < big <= 128 * 2**20
  with pytest.raises(kernels.VmemOverflowError, match="v4 has 16 MiB"):
    tiling.vmem_limit(40 * 2**20, "v4", argument="block_sizes")


def test_kernel_error_message_names_argument_value_rule():
  e = kernels.KernelError("eps", -1.0, "must be > 0")
  assert str(e) == "eps=-1.0: must be > 0" and isinstance(e, ValueError)
  e = kernels.KernelError("x", np.zeros((3, 5), np.int32), "must be floating point")
  assert "x=<array int32[3, 5]>" in str(e)


def test_benchmark_on_cpu_names_device_and_rates():
  a = jnp.ones((256, 256), jnp.float32)
  flops, nbytes = kernels.matmul_cost(256, 256, 256, jnp.float32)
  m = kernels.benchmark(lambda a: a @ a, a, flops=flops, bytes_accessed=nbytes, dtype=jnp.float32, reps=5)
  assert m.device == "cpu" and m.label == "measured on cpu"
  assert len(m.times) >= 5 and m.median > 0
  lo, hi = m.spread
  assert lo <= m.median <= hi
  assert m.flops_per_second == pytest.approx(flops / m.median)
  assert 0 < m.fraction_of_peak
  assert "measured on cpu" in str(m)
