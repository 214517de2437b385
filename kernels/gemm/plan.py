"""The plan of :func:`kernels.matmul`: block sizes, shape classes and XLA's stored layouts.

What the planner decides before any kernel runs, split from ``kernels/matmul.py`` (the
kernel, its epilogue and the public calls) the way splash attention splits its plan:

* :class:`BlockSizes` and :func:`default_block_sizes`: the tuned blocks of the nearest
  *shape class* in ``kernels/data/matmul_blocks.json``;
* :func:`fit_block_sizes`: those blocks fitted to the call's own dimensions (legal for
  Mosaic's tiling rule in each operand's role, balanced so that an unaligned dimension
  pads little);
* ``_plan``: the grid, the K-tail mask and the VMEM limit of one validated problem;
* :func:`xla_lays_out_column_major` and ``_stored_views``: reading and writing 2-D arrays
  in the layout XLA:TPU stores them in, so that no relayout copy surrounds the kernel.

The module docstring of :mod:`kernels.matmul` explains the kernel these plans drive.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
import numpy as np

from kernels.base import tiling
from kernels.base.backend import target_chip
from kernels.base.errors import TilingError, VmemOverflowError, check
from kernels.base.hardware import get_chip


def _acc_dtype(dtype):
  """The accumulator: exact int32 for int8 products, f32 for everything else."""
  return jnp.int32 if dtype == jnp.int8 else jnp.float32


# ---------------------------------------------------------------------------------
# Block sizes
# ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """One grid step's tile: ``A`` block ``bm x bk``, ``B`` block ``bk x bn``, output ``bm x bn``.

  A block larger than the matrix dimension is shrunk to the whole dimension
  (:func:`fit_block_sizes`). Otherwise Mosaic's tiling rule applies to each
  operand's block in its own layout: the last (lane) dimension a multiple of 128,
  the one before (sublane) a multiple of 8. So ``bn`` is a multiple of 128 (it is
  the output's lane dimension), ``bm`` of 8 (of 128 with ``transpose_a``, where M
  is A's lane dimension) and ``bk`` of 128 (of 8 with ``transpose_a`` and not
  ``transpose_b``, where K is the sublane dimension of both operands).
  """

  bm: int = 512
  bk: int = 1024
  bn: int = 1024

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


# Dimensions at least this large count as "large" when a call looks up its shape class.
CLASS_CAP = 2048
# A tuned problem with M or N at most this is a skinny class (decode, small batch, narrow output).
SKINNY = 256

# Used when the table is missing or lacks an entry: the JAX Pallas guide's bf16 choice.
_FALLBACK = BlockSizes(512, 1024, 1024)


def default_block_sizes(generation=None, dtype=jnp.bfloat16, m: int = 4096, k: int = 4096,
                        n: int = 4096, *, keep_whole: bool = True) -> BlockSizes:
  """The shipped default blocks for a problem ``[m, k] @ [k, n]`` on ``generation`` (None: v5e).

  ``kernels/data/matmul_blocks.json`` lists, per generation and input dtype, the
  problems ``tools/tune_matmul.py`` tuned with the compiler's cost model and the
  blocks it chose. A call uses the blocks of the tuned problem nearest to it in
  ``log2`` distance over M, K and N, each capped at :data:`CLASS_CAP`: the small
  dimensions decide the shape class (decode rows, a narrow output, large), so square
  shapes, decode-like shapes and a ``[1000, 3000] @ [3000, 5000]`` (large, not
  "256 rows") each get blocks tuned for their kind. The planner then fits them to
  the call's own dimensions (:func:`fit_block_sizes`).

  In a skinny class (M or N at most :data:`SKINNY`) a block that covers its whole tuned
  dimension stays whole (``keep_whole``), and where the small dimension's block is
  whole so is K's: then the small operand is one block whose index never changes and
  Pallas fetches it once, while cutting K = 5000 into two blocks would fetch it again
  for every block of the large dimension. (The planner falls back to the tuned size
  where a whole dimension does not fit VMEM.)
  """
  gen = get_chip(generation).name if generation is not None else "v5e"
  per_gen = tiling.block_table("matmul").get(gen, {})
  name = jnp.dtype(dtype).name
  # fp8 has no table of its own: one-byte operands tile like int8.
  entries = (per_gen.get(name) or (per_gen.get("int8") if name.startswith("float8") else None)
             or per_gen.get("bfloat16") or [])
  if not entries:
    return _FALLBACK

  def distance(e, cap=None):
    clip = (lambda v: min(v, cap)) if cap else (lambda v: v)  # noqa: E731
    return sum(abs(math.log2(clip(max(x, 1)) / clip(e[name]))) for x, name in ((m, "m"), (k, "k"), (n, "n")))
  # A shape's class is set by its small dimensions: beyond the largest output block
  # (CLASS_CAP) a dimension's size no longer changes which blocks suit it, so the
  # distance is taken on dimensions capped there (ties: the uncapped distance).
  best = min(entries, key=lambda e: (distance(e, CLASS_CAP), distance(e)))
  blocks = [best["bm"], best["bk"], best["bn"]]
  if keep_whole and min(best["m"], best["n"]) <= SKINNY:
    blocks = [max(b, x) if b >= best[d] else b for b, x, d in zip(blocks, (m, k, n), "mkn")]
    if any(best[d] <= SKINNY and blocks[i] >= best[d] for i, d in ((0, "m"), (2, "n"))):
      blocks[1] = max(blocks[1], k)  # the small operand's block is whole: make it the whole operand
  return BlockSizes(*blocks)


def _balance(b: int, d: int, multiple: int) -> int:
  """The smallest legal block that cuts ``d`` into as many blocks as ``b`` does (``b`` legal).

  A tuned block rarely divides a dimension users bring: ``d = 5000`` in blocks of 4096 is
  two blocks holding 8192 rows, 39% of them padding the MXU multiplies all the same. The
  same two blocks of 2560 hold 5120. Never more blocks, never a larger block, so the
  VMEM footprint and the grid only shrink.
  """
  if b >= d:
    return b
  c = tiling.round_up(tiling.cdiv(d, tiling.cdiv(d, b)), multiple)
  return d if c >= d else min(b, c)


def _balance_k(b: int, d: int, multiple: int) -> int:
  """:func:`_balance` for the contraction, which may also take one or two more blocks when that
  pads less (K = 5000 in blocks of at most 2048: four of 1280, not three of 1792). More K
  steps re-read nothing; they only add a step's fixed cost."""
  if b >= d:
    return b
  nb = tiling.cdiv(d, b)
  sizes = [_balance(tiling.round_up(tiling.cdiv(d, j), multiple), d, multiple) for j in (nb, nb + 1, nb + 2)]
  return min((tiling.cdiv(d, c) * c, tiling.cdiv(d, c), c) for c in sizes if c <= b)[2]


def fit_block_sizes(blocks: BlockSizes, m: int, k: int, n: int, dtype=jnp.bfloat16,
                    transpose_a: bool = False, transpose_b: bool = False, *, legalize: bool = False,
                    balance: bool | None = None) -> BlockSizes:
  """The blocks the kernel really uses for ``[m, k] @ [k, n]``.

  A block larger than its dimension becomes the whole dimension, except that a few
  rows of untransposed A (decode shapes) are rounded up to whole packed sublane
  tiles (16 bf16 rows, 32 int8 rows), the block hanging over the array's edge:
  Mosaic compiles 8-row bf16 blocks, but libtpu's LLO type check (run by its cost
  model) rejects the MXU operands they produce.

  With ``legalize`` (default blocks, which are tuned for other shapes) a block that
  breaks the tiling rule in its role here is rounded up to the multiple the rule asks
  (128 where the dimension is some operand's lane dimension), or to the whole
  dimension when that is smaller: a default call never fails on its blocks. Blocks a
  caller chose are not changed; the planner rejects illegal ones by name.

  ``balance`` (default: ``legalize``) then shrinks each block to the smallest legal size
  that still cuts its dimension into the same number of blocks (``_balance``): the
  tuned blocks' shape class, fitted to the problem's own dimensions, so an unaligned
  dimension pays for less than one tiling multiple of padding per block.
  """
  bm, bk, bn = (min(blocks.bm, m), min(blocks.bk, k), min(blocks.bn, n))
  sub = tiling.sublane_multiple(dtype)
  if legalize:
    def legal(b: int, d: int, multiple: int) -> int:
      return b if b == d or b % multiple == 0 else min(d, tiling.round_up(b, multiple))
    # M is A's lane dimension when A is transposed; K is a lane dimension unless both
    # operands hold it on sublanes (A transposed, B not); N is the output's lanes.
    bm = legal(bm, m, tiling.LANES if transpose_a else sub)
    bk = legal(bk, k, tiling.SUBLANES if transpose_a and not transpose_b else tiling.LANES)
    bn = legal(bn, n, tiling.LANES)
  if legalize if balance is None else balance:
    bm = _balance(bm, m, tiling.LANES if transpose_a else sub)
    bk = _balance_k(bk, k, tiling.SUBLANES if transpose_a and not transpose_b else tiling.LANES)
    bn = _balance(bn, n, tiling.LANES)
  if bm == m and m % sub and not transpose_a:
    bm = min(blocks.bm, tiling.round_up(m, sub))
  return BlockSizes(bm, bk, bn)


@dataclasses.dataclass(frozen=True)
class _Problem:
  """A validated call: shapes, dtypes and options, all static."""

  m: int
  k: int
  n: int
  batch: tuple[int, ...]          # broadcast batch shape of the output
  a_batch: tuple[int, ...]        # A's batch dims, left-padded with 1s to len(batch)
  b_batch: tuple[int, ...]
  transpose_a: bool
  transpose_b: bool
  dtype: Any                      # input dtype
  out_dtype: Any
  has_bias: bool
  activation: str | None
  dropout_rate: float
  precision: Any
  quantized: bool = False


@dataclasses.dataclass(frozen=True)
class _Plan:
  """How one problem is laid on the grid: effective blocks, grid, VMEM."""

  bm: int
  bk: int
  bn: int
  nbatch: int            # grid extent of the batch axis (1: no batch axis)
  grid: tuple[int, ...]
  mask_k: bool           # K % bk != 0: the last K step zeroes the tail
  vmem_limit: int | None
  save_z: bool


def _plan(p: _Problem, blocks: BlockSizes | None, *, save_z: bool) -> _Plan:
  if blocks is not None:
    return _plan_blocks(p, blocks, save_z=save_z, default=False)
  chip = target_chip()
  gen = chip.name if chip else None
  whole = default_block_sizes(gen, p.dtype, p.m, p.k, p.n)
  try:
    return _plan_blocks(p, whole, save_z=save_z, default=True)
  except VmemOverflowError:  # a whole dimension too large for VMEM: the tuned blocks themselves
    plain = default_block_sizes(gen, p.dtype, p.m, p.k, p.n, keep_whole=False)
    if plain == whole:
      raise
    return _plan_blocks(p, plain, save_z=save_z, default=True)


def _plan_blocks(p: _Problem, blocks: BlockSizes, *, save_z: bool, default: bool) -> _Plan:
  chip = target_chip()
  for name in ("bm", "bk", "bn"):
    v = getattr(blocks, name)
    check(isinstance(v, (int, np.integer)) and v > 0, "block_sizes", blocks, f"{name} must be a positive int")
  bm, bk, bn = dataclasses.astuple(fit_block_sizes(blocks, p.m, p.k, p.n, p.dtype, p.transpose_a, p.transpose_b,
                                                   legalize=default))
  # Mosaic's tiling rule on each operand's 2-D block, in its own (rows, cols) layout.
  a_block, a_shape = ((bk, bm), (p.k, p.m)) if p.transpose_a else ((bm, bk), (p.m, p.k))
  b_block, b_shape = ((bn, bk), (p.n, p.k)) if p.transpose_b else ((bk, bn), (p.k, p.n))
  try:
    tiling.check_block_shape("block_sizes", a_block, a_shape)
    tiling.check_block_shape("block_sizes", b_block, b_shape)
    tiling.check_block_shape("block_sizes", (bm, bn), (p.m, p.n))
  except TilingError as e:
    raise TilingError("block_sizes", blocks, f"{e.rule} (A block {a_block} of {a_shape}, "
                      f"B block {b_block} of {b_shape}, output block {(bm, bn)})") from None
  nk = tiling.cdiv(p.k, bk)
  acc_dtype = _acc_dtype(p.dtype)
  outs = [((bm, bn), p.out_dtype)] * (2 if save_z else 1)
  small = [((1, bn), jnp.float32)] if p.has_bias else []
  if p.quantized:
    small += [((bm, 1), jnp.float32), ((1, bn), jnp.float32)]
  # Besides the double-buffered blocks and the accumulator, Mosaic keeps a copy of a
  # packed (bf16, int8, fp8) A tile for the MXU: measured with AOT compiles on v5e, the
  # VMEM a kernel reserves is these plus 0-0.9 MiB, which vmem_limit's headroom covers.
  scratch = [((bm, bn), acc_dtype)] if nk > 1 else []
  if jnp.dtype(p.dtype).itemsize < 4:
    scratch.append((a_block, p.dtype))
  footprint = tiling.vmem_footprint([(a_block, p.dtype), (b_block, p.dtype)] + outs + small, scratch=scratch)
  limit = tiling.vmem_limit(footprint, chip or "v5e", argument="block_sizes", value=blocks)
  nbatch = math.prod(p.batch)
  grid = ((nbatch,) if nbatch > 1 else ()) + (tiling.cdiv(p.m, bm), tiling.cdiv(p.n, bn), nk)
  return _Plan(bm, bk, bn, nbatch, grid, p.k % bk != 0, limit, save_z)


def xla_lays_out_column_major(shape, dtype) -> bool:
  """True where XLA:TPU stores a 2-D array ``shape`` column-major by default.

  TPU arrays live in (sublane, 128) tiles, so a minor dimension that is not a multiple of
  128 is padded. XLA:TPU picks, for an array whose layout is its choice (a jitted
  function's parameters and results), the dimension order that pads less: row-major
  unless column-major holds strictly fewer padded elements (observed with AOT compiles on
  v4, v5e and v6e: ``[4096, 50257]``, ``[7000, 1000]``, ``[256, 5000]`` are column-major,
  ``[5000, 7000]``, ``[3000, 5000]``, ``[1000, 5000]`` row-major). ``dtype`` is unused:
  XLA compares 8-row tiles for 16- and 32-bit types alike.
  """
  if len(shape) != 2:
    return False
  # XLA counts 8-row tiles here for every dtype (bf16's [1000, 5000] stays row-major).
  r, c = shape
  pad = lambda rows, cols: tiling.round_up(rows, tiling.SUBLANES) * tiling.round_up(cols, tiling.LANES)  # noqa: E731
  return pad(c, r) < pad(r, c)


def _stored_views(p: _Problem) -> tuple[_Problem, bool, bool, bool]:
  """How a default 2-D call reads the arrays as XLA:TPU stores them.

  A Pallas call takes row-major operands and writes a row-major output; for an operand
  XLA stores column-major (:func:`xla_lays_out_column_major`) it would insert a relayout
  copy -- a whole extra HBM read and write of the array -- before the kernel, and for a
  column-major output one after it. The transpose of a column-major array is row-major
  in the same bytes (a free bitcast), so:

  * a column-major output ``C = op(A) @ op(B)`` is computed as ``C^T = op(B)^T @ op(A)^T``
    (operands swapped, transposes flipped) and returned transposed -- not with a bias or
    dropout, whose row and column roles the kernel does not swap;
  * a column-major operand is read through its transpose with its ``transpose_*`` flag
    flipped (the MXU takes a transposed right operand natively; a transposed left one
    costs a tile transpose in VMEM, not HBM traffic).

  Returns the problem the kernel runs and whether the output is swapped and each
  operand (of the swapped problem) read transposed.
  """
  swap = not p.has_bias and not p.dropout_rate and xla_lays_out_column_major((p.m, p.n), p.out_dtype)
  if swap:
    p = dataclasses.replace(p, m=p.n, n=p.m, transpose_a=not p.transpose_b, transpose_b=not p.transpose_a)
  flip_a = xla_lays_out_column_major((p.k, p.m) if p.transpose_a else (p.m, p.k), p.dtype)
  flip_b = xla_lays_out_column_major((p.n, p.k) if p.transpose_b else (p.k, p.n), p.dtype)
  p = dataclasses.replace(p, transpose_a=p.transpose_a != flip_a, transpose_b=p.transpose_b != flip_b)
  return p, swap, flip_a, flip_b
