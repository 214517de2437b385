"""Block shapes: the TPU tiling rule and the VMEM budget, checked before lowering.

A TPU vector register holds an (8, 128) tile of 32-bit values: 8 *sublanes* by 128
*lanes*. Mosaic therefore needs the last two dimensions of every block to be
multiples of (8, 128), or to span the whole array dimension. Narrower dtypes pack
more rows per sublane (bf16: 16, int8: 32), so those multiples are what keep a
block free of relayouts.
"""
from __future__ import annotations

import functools
import json
import math
import os
from typing import Iterable, Sequence

import jax.numpy as jnp

from kernels.base.errors import TilingError, VmemOverflowError
from kernels.base.hardware import MiB, get_chip

LANES = 128
SUBLANES = 8


DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data")


@functools.cache
def block_table(kernel: str) -> dict:
  """The ``defaults`` of ``kernels/data/<kernel>_blocks.json`` (per generation, then dtype), or {} without one.

  The tables are written by ``tools/tune_<kernel>.py``; call ``block_table.cache_clear()`` after rewriting one.
  """
  try:
    with open(os.path.join(DATA_DIR, f"{kernel}_blocks.json"), encoding="utf-8") as fh:
      return json.load(fh).get("defaults", {})
  except FileNotFoundError:
    return {}


def cdiv(a: int, b: int) -> int:
  return -(-a // b)


def round_up(a: int, b: int) -> int:
  return cdiv(a, b) * b


def sublane_multiple(dtype) -> int:
  """Rows per native tile for ``dtype``: 8 for 32-bit, 16 for 16-bit, 32 for 8-bit."""
  return SUBLANES * max(1, 4 // jnp.dtype(dtype).itemsize)


def check_block_shape(argument: str, block_shape: Sequence[int | None], array_shape: Sequence[int]) -> None:
  """Enforces Mosaic's rule: last two block dims divisible by (8, 128) or equal to the array's.

  Raises :class:`~kernels.base.errors.TilingError` naming ``argument``.
  """
  if len(block_shape) != len(array_shape):
    raise TilingError(argument, tuple(block_shape),
                      f"block rank {len(block_shape)} differs from array rank {len(array_shape)} {tuple(array_shape)}")
  for i, (b, a) in enumerate(zip(block_shape, array_shape)):
    if b is not None and (b <= 0 or b > a and len(array_shape) - i > 2):
      raise TilingError(argument, tuple(block_shape), f"block dim {i} = {b} must be in [1, {a}]")
  rules = ((-1, LANES), (-2, SUBLANES)) if len(array_shape) >= 2 else ((-1, LANES),)
  for axis, multiple in rules:
    b, a = block_shape[axis], array_shape[axis]
    if b is None or b == a or b % multiple == 0:
      continue
    raise TilingError(
        argument, tuple(block_shape),
        f"the last two block dims must be divisible by ({SUBLANES}, {LANES}) or equal the array dims "
        f"{tuple(array_shape[-2:])}; dim {axis} is {b}")


def block_bytes(shape: Sequence[int], dtype) -> int:
  """Bytes a block occupies in VMEM, after padding to the native (sublane, lane) tile."""
  shape = list(shape) or [1]
  if len(shape) == 1:
    shape = [1] + shape
  rows = round_up(shape[-2], sublane_multiple(dtype))
  cols = round_up(shape[-1], LANES)
  return math.prod(shape[:-2]) * rows * cols * jnp.dtype(dtype).itemsize


def vmem_footprint(blocks: Iterable[tuple[Sequence[int], object]], scratch: Iterable[tuple[Sequence[int], object]] = (),
                   buffers: int = 2) -> int:
  """VMEM bytes for pipelined ``blocks`` (each ``buffers``-deep) plus single-buffered ``scratch``."""
  return (buffers * sum(block_bytes(s, d) for s, d in blocks)
          + sum(block_bytes(s, d) for s, d in scratch))


def vmem_limit(footprint: int, chip="v5e", argument: str = "block_sizes", value=None, headroom: float = 1.25) -> int | None:
  """The ``vmem_limit_bytes`` a kernel should ask for, or None if the default scoped limit suffices.

  Raises :class:`~kernels.base.errors.VmemOverflowError` when even the whole VMEM is too small.
  """
  c = get_chip(chip)
  need = int(footprint * headroom) + 1 * MiB
  if need <= c.default_scoped_vmem_bytes:
    return None
  if need > c.vmem_bytes:
    raise VmemOverflowError(
        argument, value,
        f"needs ~{footprint / MiB:.1f} MiB of VMEM (double-buffered blocks + scratch) but TPU {c.name} "
        f"has {c.vmem_bytes / MiB:.0f} MiB per core; use smaller blocks")
  return min(round_up(need, MiB), c.vmem_bytes)
