"""The plan and the masks of :mod:`kernels.attention`: what every flash-attention kernel shares.

* :class:`_Problem`, the validated call (shapes, dtype, layout, masks), and the visibility rules
  the reference and the kernels both apply (:func:`_visible`, the dropout hash's rows);
* :class:`_Plan`, fitted to a problem by :func:`_make_plan`: block sizes, the VMEM limit, the
  forward's kv sub-blocks, the masked tiles of a block crossing the causal diagonal or a window
  edge and their static patterns (:func:`_tile_patterns`), the folded causal grid, the window band,
  whether the backward fuses dq;
* the grids and their program ids (q-major for the forward and dq kernels, kv-major for dk/dv),
  and the block ranges the index maps clamp to, so that a step over a fully masked block re-uses
  the block already in VMEM (no DMA);
* the tests of which blocks and tiles need masking, and the pieces of a kernel body that run a
  block as skipped, unmasked or masked tiles;
* the BlockSpecs and layouts of the operands.

The skip tests and block ranges use products, comparisons and shifts only, never a scalar
division: libtpu's cost model evaluates ``lax.div`` / ``lax.rem`` as 0 (see the module
docstring of :mod:`kernels.attention`). The forward kernel is in :mod:`kernels.attention.forward`,
the backward kernels in :mod:`kernels.attention.backward`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.base import tiling
from kernels.base.backend import target_chip
from kernels.base.errors import TilingError, check
from kernels.base.hardware import get_chip
from kernels.gemm import dropout_keep_mask
from kernels.attention.rotary import compose_rows, rotate_tile

_NT = (((1,), (1,)), ((), ()))   # a @ b.T
_NN = (((1,), (0,)), ((), ()))   # a @ b
_TN = (((0,), (0,)), ((), ()))   # a.T @ b
NEG_INF = -float("inf")


# ---------------------------------------------------------------------------------
# The problem
# ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Problem:
  b: int
  h: int
  kvh: int
  sq: int
  skv: int
  d: int
  dtype: Any
  layout: str
  causal: bool
  window: int | None
  softcap: float | None
  scale: float
  segments: bool
  mask_shape: tuple[int, int] | None   # (batch or 1, heads or 1) of the dense mask
  bias_shape: tuple[int, int] | None
  sinks: bool
  dropout_rate: float
  rope: Any = None   # a resolved kernels.attention.rotary.RotaryEmbedding: q and k rotate inside the kernels

  @property
  def group(self) -> int:
    return self.h // self.kvh

  @property
  def offset(self) -> int:
    return self.skv - self.sq

  @property
  def skips(self) -> bool:
    return self.causal or self.window is not None

  @property
  def always_masked(self) -> bool:
    return self.segments or self.mask_shape is not None


# ---------------------------------------------------------------------------------
# Masks, shared by the reference and the kernels
# ---------------------------------------------------------------------------------


def _visible(p: _Problem, qpos, kpos):
  """Causal / window / kv-length visibility of key ``kpos`` to query ``qpos`` (broadcasting), or None."""
  ok = None

  def both(a, c):
    return c if a is None else jnp.logical_and(a, c)
  diag = qpos + p.offset
  if p.causal:
    ok = both(ok, kpos <= diag)
  if p.window is not None:
    ok = both(ok, diag - kpos < p.window)
    if not p.causal:
      ok = both(ok, kpos - diag < p.window)
  return ok


def _soft_cap(s, cap):
  return s if cap is None else cap * jnp.tanh(s * (1.0 / cap))


def _dropout_rows(p: _Problem, b, h, qpos):
  """The dropout hash's row counter: one per (batch, head, query)."""
  return (b * p.h + h) * p.sq + qpos


def _keep_tile(p: _Problem, seed, b, h, qpos, kpos):
  """The dropout keep mask of one tile, hashed on full tiles (a (n, 1) int32 column
  through the hash aborts libtpu's cost model)."""
  shape = jnp.broadcast_shapes(qpos.shape, kpos.shape)
  rows = jnp.broadcast_to(_dropout_rows(p, b, h, qpos), shape)
  return dropout_keep_mask(seed, rows, jnp.broadcast_to(kpos, shape), p.dropout_rate)


# ---------------------------------------------------------------------------------
# The plan: blocks, VMEM, masked tiles
# ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Plan:
  bq: int
  bkv: int
  nq: int
  nkv: int
  inplace_bshd: bool     # BSHD read in place as [B, S, H*D]
  vmem_limit: int | None
  exp_bf16: bool = False  # forward exponentials in bf16 (v6e's EUP has a bf16 path; v4/v5 do not)
  bkv_compute: int = 0    # forward: keys per sub-block of the math inside a kv block
  bq_masked: int = 0      # forward, causal / window: a block that needs masking runs in
  bkv_masked: int = 0     # (bq_masked, bkv_masked) tiles, each skipped, unmasked or masked
  folded: bool = False    # causal q-major kernels: q rows i and nq-1-i share a grid row (no skipped steps)
  band: int = 0           # sliding window, q-major kernels: grid steps per q row (kv blocks lo(i)..), 0 = all
  # Square blocks, q_len == kv_len, no tails, causal / window structure only: the tile pattern of a
  # block that needs masking depends only on d = j - i. ((d, ((row0, rows, col0, cols, masked), ...)), ...)
  patterns: tuple = ()    # (q rows, kv cols): the forward and dq kernels
  patterns_t: tuple = ()  # (kv rows, q cols): the dk/dv kernel
  fused_dq: bool = False  # backward: the dk/dv kernel also accumulates dq in VMEM (no dq kernel)
  mxu_rowsum: bool = False  # forward, head_dim < 128: the softmax denominator from the PV matmul (see below)
  exp2: bool = False      # forward: exponentials as exp2 of logits in log2 units (log2(e) folded into q's scale)


def _fit(block: int, n: int, multiple: int, name: str, blocks) -> int:
  check(isinstance(block, (int, np.integer)) and block > 0, "block_sizes", blocks, f"{name} must be a positive int")
  if block >= n:  # one block: whole native tiles (a partial tile aborts libtpu's cost model), tail masked
    return tiling.round_up(n, multiple)
  if block % multiple:
    raise TilingError("block_sizes", blocks, f"{name}={block} must be a multiple of {multiple} "
                      f"(or at least the sequence length {n})")
  return int(block)


def _vmem(p: _Problem, bq: int, bkv: int, nblocks_q: int, nblocks_kv: int, acc: int, blocks,
          temp_cols: int | None = None, extra: int = 0, temps: int = 4) -> int | None:
  """VMEM limit for a kernel with ``nblocks_*`` pipelined (bq|bkv, D) tiles and ``acc`` f32 accumulators;
  its f32 temporaries are ``(bq, temp_cols)`` tiles (``temp_cols``: bkv, or the forward's sub-block)."""
  d = p.d
  pipelined = [((bq, d), p.dtype)] * nblocks_q + [((bkv, d), p.dtype)] * nblocks_kv
  pipelined += [((bq, 1), jnp.float32)] * 2 + [((1, bkv), jnp.float32)]
  if p.mask_shape or p.bias_shape:
    pipelined += [((bq, bkv), jnp.float32)] * 2
  # f32 accumulators, m / l, and the live (bq, bkv) f32 temporaries (scores, probabilities, dp, ds)
  scratch = ([((bq, d), jnp.float32)] * acc + [((bq, 128), jnp.float32)] * 2
             + [((bq, temp_cols or bkv), jnp.float32)] * temps)
  footprint = tiling.vmem_footprint(pipelined, scratch=scratch) + extra
  chip = target_chip()
  return tiling.vmem_limit(footprint, chip or "v5e", argument="block_sizes", value=blocks)


# bf16 exponentials on v6e: correct in interpret mode and compiles, but libtpu's cost model
# aborts on it, so it stays off until it can be estimated (set True to try it on a v6e).
_EXP_BF16 = False
# The forward's math runs on kv sub-blocks of this many keys inside a kv block (the DMA block stays
# bkv): smaller f32 score tiles, fewer temporaries live at once.
KV_COMPUTE = 512


# The forward with a head_dim that leaves free lanes in the PV matmul's output (64: half of a
# 128-lane tile) appends columns of ones to each V block in VMEM, so that the same matmul also
# sums each row's probabilities: the MXU's output tile is padded to 128 (v4/v5) or 256 (v6e)
# columns anyway, and the vector adds of the denominator's partial sums (one per score vreg)
# are gone. Not with dropout (the denominator sums the probabilities before they are dropped).
_MXU_ROWSUM = True


# exp(x) is exp2(x * log2(e)) on the TPU's EUP: with log2(e) folded into the scale of the q block
# (once per q block) the forward's exponentials are exp2 of its logits, one vector multiply per
# score element fewer. Not with a soft cap or a bias (they act on logits in natural units).
_EXP2 = True


def _exp2(p: _Problem) -> bool:
  return _EXP2 and p.softcap is None and p.bias_shape is None


def _mxu_rowsum(p: _Problem) -> bool:
  return _MXU_ROWSUM and p.d % 128 != 0 and not p.dropout_rate


def _kv_compute(bkv: int) -> int:
  """Keys per sub-block of the forward's math in a kv block of ``bkv`` keys."""
  return KV_COMPUTE if bkv % KV_COMPUTE == 0 else bkv


# The forward cuts a causal / window block that needs masking into tiles of at most this many
# rows and keys: most of a diagonal block is then either skipped or run without mask arithmetic.
MASKED_TILE = 512


def _masked_tile(block: int) -> int:
  return MASKED_TILE if block % MASKED_TILE == 0 else block


def _make_plan(p: _Problem, blocks, backward: bool) -> _Plan:
  """The plan of the forward (``backward=False``) or backward kernels for ``blocks``, a
  :class:`kernels.attention.api.BlockSizes`."""
  chip = target_chip()
  inplace = p.layout == "BSHD" and p.d % 128 == 0
  fused_dq = False
  if backward:
    bq = _fit(blocks.block_q_bwd, p.sq, 128, "block_q_bwd", blocks)
    bkv = _fit(blocks.block_kv_bwd, p.skv, 128, "block_kv_bwd", blocks)
    dq_bytes = _fused_dq_bytes(p, bq)
    vmem = get_chip(chip.name if chip else "v5e").vmem_bytes
    fused_dq = p.bias_shape is None and dq_bytes <= vmem * FUSED_DQ_VMEM
    # (the backward's tile math keeps ~8 (bkv, bq) f32 temporaries live: s, p, dp, ds and their
    # casts; with 2048 blocks Mosaic asked for 135 MiB on v5e and v6e, which have 128)
    limit = _vmem(p, max(bq, bkv), max(bq, bkv), 2, 2, 2, blocks,
                  extra=(dq_bytes if fused_dq else 0) + _rope_vmem(p, bq, bkv), temps=8)
  else:
    bq = _fit(blocks.block_q, p.sq, tiling.sublane_multiple(p.dtype), "block_q", blocks)
    bkv = _fit(blocks.block_kv, p.skv, 128, "block_kv", blocks)
    # the ones-extended V block and the accumulator's extra columns; RoPE's tables and rotated k
    extra = (bkv * tiling.round_up(p.d, 128) * p.dtype.itemsize + bq * 128 * 4) if _mxu_rowsum(p) else 0
    limit = _vmem(p, bq, bkv, 2, 2, 1, blocks, temp_cols=_kv_compute(bkv), extra=extra + _rope_vmem(p, bq, bkv))
  exp_bf16 = (_EXP_BF16 and not backward and chip is not None and chip.name == "v6e" and p.dtype == jnp.bfloat16
              and not p.dropout_rate)
  bkc = bkv if backward else _kv_compute(bkv)
  if backward:  # the dq / dk-dv kernels: masked tiles for causal / window blocks (not with a bias:
    # the bias gradient of a skipped tile would have to be zeroed), 0 = whole blocks
    tiles = ((_masked_tile(bq), _masked_tile(bkv)) if p.skips and p.bias_shape is None
             and (_masked_tile(bq), _masked_tile(bkv)) != (bq, bkv) else (0, 0))
  else:
    tiles = (_masked_tile(bq), _masked_tile(bkv)) if p.skips else (bq, bkc)
  nq, nkv = tiling.cdiv(p.sq, bq), tiling.cdiv(p.skv, bkv)
  # Square causal blocks on the diagonal: q row i needs kv blocks 0..i. Pairing row i with row
  # nq-1-i fills a grid row of nq+1 steps exactly, so no grid step is spent skipping.
  folded = (p.causal and p.window is None and p.sq == p.skv and bq == bkv and nq > 1
            and p.bias_shape is None)
  # A sliding window: q row i needs at most `band` kv blocks from lo(i) on, so the grid walks only those.
  band = _band(p, bq, bkv, nq, nkv) if p.window is not None and not folded and p.bias_shape is None else 0
  patterns = ((), ())
  if (p.skips and not p.always_masked and p.bias_shape is None and p.sq == p.skv and bq == bkv
      and p.skv % bkv == 0 and tiles[0] == tiles[1] and 0 < tiles[0] < bq):
    patterns = tuple(_tile_patterns(p, bq, tiles[0], nq, transposed=t) for t in (False, True))
  return _Plan(bq, bkv, nq, nkv, inplace, limit, exp_bf16, bkc, *tiles, folded, band if band < nkv else 0,
               *patterns, fused_dq, mxu_rowsum=not backward and _mxu_rowsum(p),
               exp2=not backward and _exp2(p))


# The backward's dk/dv kernel also computes dq (ds^T k, from the ds it already has) into a VMEM
# accumulator of all the q rows of its GQA group, when that takes at most this fraction of the
# chip's VMEM (with the dq output block); else a separate dq kernel recomputes s, p and dp. Fused,
# the exponentials and two of the five matmuls are not done twice.
FUSED_DQ_VMEM = 1 / 8


def _fused_dq_bytes(p: _Problem, bq: int) -> int:
  """VMEM of the fused dq: the f32 accumulator (group, q blocks * bq, D) and the double-buffered
  (group, q_len, D) output block."""
  rows = tiling.cdiv(p.sq, bq) * bq
  return p.group * p.d * (4 * rows + 2 * p.sq * p.dtype.itemsize)


def _tile_patterns(p: _Problem, b: int, t: int, n: int, transposed: bool) -> tuple:
  """The static tile plans of the blocks that need masking (see ``_Plan.patterns``).

  With square ``b``-blocks and q_len == kv_len, whether a (query, key) pair is visible under
  causal / window structure depends only on key - query, so a block's pattern of ``t``-tiles
  (skipped, unmasked, masked) depends only on ``d = j - i``. Down each column of tiles (kv tiles;
  q tiles for the dk/dv kernel, whose rows are keys) runs of equal status merge into one tall
  tile: a causal diagonal block becomes, per column, its masked diagonal tile and one unmasked
  tile of all the rows below. A tall tile streams more rows past each MXU weight load, and no
  tile needs a ``pl.when``. Evaluated at plan time: the tile tests get Python ints here and
  return Python bools."""
  out = []
  for d in range(-(n - 1), n):
    r0, r1, c0, c1 = 0, b - 1, d * b, d * b + b - 1  # block (0, d): visibility is shift-invariant
    if not _tile_needed(p, r0, r1, c0, c1) or _full_tile(p, r0, r1, c0, c1):
      continue
    tiles = []
    for c in range(b // t):
      runs = []
      for a in range(b // t):
        q0, k0 = (c * t, d * b + a * t) if transposed else (a * t, d * b + c * t)
        status = (0 if not _tile_needed(p, q0, q0 + t - 1, k0, k0 + t - 1)
                  else 1 if _full_tile(p, q0, q0 + t - 1, k0, k0 + t - 1) else 2)
        if runs and runs[-1][0] == status:
          runs[-1][2] += 1
        else:
          runs.append([status, a, 1])
      tiles += [(a * t, m * t, c * t, t, status == 2) for status, a, m in runs if status]
    out.append((d, tuple(tiles)))
  return tuple(out)


# ---------------------------------------------------------------------------------
# Grids, and the blocks a step needs
# ---------------------------------------------------------------------------------


def _q_major_ids(p: _Problem, plan: _Plan, g):
  """Grid ids of the forward / dq kernels -> ``(b, h, i, j, first, last, active)``: q block i, kv
  block j, whether the step starts / ends row i's accumulation, and whether it runs at all.

  Folded (causal, square blocks), grid row ``u`` runs q row ``u`` on kv blocks ``0..u``, then
  q row ``nq-1-u`` on ``0..nq-1-u``: ``nq + 1`` steps. With ``nq`` odd the middle row pairs
  with itself and its second half is inactive (kv block held, so no DMA)."""
  b, h, x, t = g[:4]
  if plan.band:  # kv blocks lo(i) .. hi(i); the idle steps past hi hold its block (no DMA)
    lo, hi = _kv_range(p, plan.bq, plan.bkv, plan.nkv, x)
    return b, h, x, _clamp(lo + t, lo, hi), t == 0, t == plan.band - 1, lo + t <= hi
  if not plan.folded:
    return b, h, x, t, t == 0, t == plan.nkv - 1, True
  nq, u = plan.nq, x
  second = t > u
  i = jnp.where(second, nq - 1 - u, u)
  j = jnp.where(second, t - u - 1, t)
  active = True
  if nq % 2:
    active = jnp.logical_not(jnp.logical_and(second, 2 * u == nq - 1))
    j = jnp.where(active, j, u)
  first = jnp.logical_or(t == 0, jnp.logical_and(t == u + 1, active))
  last = jnp.logical_or(t == u, jnp.logical_and(t == nq, active))
  return b, h, i, j, first, last, active


def _band(p: _Problem, bq: int, bkv: int, nq: int, nkv: int) -> int:
  """The most kv blocks any q block needs (numpy twin of :func:`_kv_range`)."""
  r0 = np.arange(nq) * bq
  r1 = np.minimum(r0 + bq - 1, p.sq - 1)
  lo, hi = np.zeros(nq, np.int64), np.full(nq, nkv - 1)
  if p.causal:
    hi = np.minimum(hi, np.floor_divide(r1 + p.offset, bkv))
  if p.window is not None:
    lo = np.floor_divide(np.maximum(r0 + p.offset - p.window + 1, 0), bkv)
    if not p.causal:
      hi = np.minimum(hi, np.floor_divide(r1 + p.offset + p.window - 1, bkv))
  return int(max(1, (hi - lo + 1).max()))


def _kv_major_ids(p: _Problem, plan: _Plan, g):
  """Grid ids of the dk/dv kernel -> ``(b, kv head, j, group member, i, first, last, active)``.

  Plain grid ``(b, kv head, kv block j, group member, q block i)``. Folded (causal, square
  blocks), ``(b, kv head, u, t, group member)``: kv block ``u`` takes q blocks ``u..nq-1``, then
  kv block ``nkv-1-u`` takes ``nkv-1-u..nq-1``, ``nq + 1`` steps, each for every q head of the
  group (innermost, so that dk and dv of one kv block are summed over consecutive steps)."""
  if not plan.folded:
    b, kh, j, gm, i = g[:5]
    return b, kh, j, gm, i, jnp.logical_and(gm == 0, i == 0), jnp.logical_and(gm == p.group - 1, i == plan.nq - 1), True
  b, kh, u, t, gm = g[:5]
  nq = plan.nq
  second = t >= nq - u
  j = jnp.where(second, plan.nkv - 1 - u, u)
  i = jnp.where(second, t - 1, u + t)
  active = True
  if nq % 2:
    active = jnp.logical_not(jnp.logical_and(second, 2 * u == nq - 1))
    i = jnp.where(active, i, nq - 1)
  first = jnp.logical_and(gm == 0, jnp.logical_or(t == 0, jnp.logical_and(t == nq - u, active)))
  last = jnp.logical_and(gm == p.group - 1, jnp.logical_or(t == nq - 1 - u, jnp.logical_and(t == nq, active)))
  return b, kh, j, gm, i, first, last, active


def _kv_major_grid(p: _Problem, plan: _Plan):
  if plan.folded:
    return (p.b, p.kvh, tiling.cdiv(plan.nkv, 2), plan.nq + 1, p.group)
  return (p.b, p.kvh, plan.nkv, p.group, plan.nq)


def _q_major_grid(p: _Problem, plan: _Plan):
  if plan.folded:
    return (p.b, p.h, tiling.cdiv(plan.nq, 2), plan.nq + 1)
  return (p.b, p.h, plan.nq, plan.band or plan.nkv)


def _floor_div(x, n: int):
  """floor(x / n) for traced int32 ``x`` >= -n (only -1 is needed below 0).

  A power of two is an arithmetic shift. That is not for speed: libtpu's cost model
  evaluates a scalar ``lax.div`` / ``lax.rem`` as 0, so a block range computed with
  them makes the model skip blocks that run (a causal forward's estimate came out
  faster than its roofline); shifts, products and comparisons it evaluates correctly."""
  if n & (n - 1) == 0:
    return lax.shift_right_arithmetic(x, jnp.int32(n.bit_length() - 1))
  return jnp.where(x < 0, -1, lax.div(jnp.maximum(x, 0), n))


def _kv_range(p: _Problem, bq: int, bkv: int, nkv: int, i):
  """First and last kv block that q block ``i`` needs (last < first: none)."""
  r0 = i * bq
  r1 = jnp.minimum(i * bq + bq - 1, p.sq - 1)
  lo, hi = jnp.int32(0), jnp.int32(nkv - 1)
  if p.causal:
    hi = jnp.minimum(hi, _floor_div(r1 + p.offset, bkv))
  if p.window is not None:
    lo = _floor_div(jnp.maximum(r0 + p.offset - p.window + 1, 0), bkv)
    if not p.causal:
      hi = jnp.minimum(hi, _floor_div(r1 + p.offset + p.window - 1, bkv))
  return lo, hi


def _q_range(p: _Problem, bq: int, bkv: int, nq: int, j):
  """First and last q block that kv block ``j`` is visible to (last < first: none)."""
  c0 = j * bkv
  c1 = jnp.minimum(j * bkv + bkv - 1, p.skv - 1)
  lo, hi = jnp.int32(0), jnp.int32(nq - 1)
  if p.causal:
    lo = _floor_div(jnp.maximum(c0 - p.offset, 0), bq)
  if p.window is not None:
    hi = jnp.minimum(hi, _floor_div(c1 + p.window - 1 - p.offset, bq))
    if not p.causal:
      lo = _floor_div(jnp.maximum(c0 - p.offset - p.window + 1, 0), bq)
  return jnp.minimum(lo, nq - 1), hi


def _clamp(x, lo, hi):
  return jnp.minimum(jnp.maximum(x, lo), jnp.maximum(hi, lo))


# ---------------------------------------------------------------------------------
# Which blocks and tiles need masking
# ---------------------------------------------------------------------------------


def _full_block(p: _Problem, bq: int, bkv: int, i, j, q_tail: bool):
  """True (traced) when every (query, key) pair of block (i, j) is visible: no masking needed.

  ``q_tail``: also require the q block to lie inside q_len (the dk/dv kernel reads q rows
  as columns, so the q tail must be masked there)."""
  return _full_tile(p, i * bq, i * bq + bq - 1, j * bkv, j * bkv + bkv - 1, q_tail and p.sq % bq != 0,
                    p.skv % bkv != 0)


def _full_tile(p: _Problem, r0, r1, c0, c1, q_tail: bool = False, kv_tail: bool = True):
  """True (traced) when every pair of query rows ``r0..r1`` x keys ``c0..c1`` is visible.
  Products and comparisons only: the cost model evaluates those (not divisions)."""
  if p.always_masked:
    return False
  conds = []
  if kv_tail:
    conds.append(c1 < p.skv)
  if q_tail:
    conds.append(r1 < p.sq)
  if p.causal:
    conds.append(c1 <= r0 + p.offset)
  if p.window is not None:
    conds.append(c0 >= r1 + p.offset - p.window + 1)
    if not p.causal:
      conds.append(c1 <= r0 + p.offset + p.window - 1)
  return _all(conds)


def _all(conds):
  """The conjunction of ``conds``: traced, or a Python bool when every one is (no conds: True)."""
  if all(isinstance(c, (bool, np.bool_)) for c in conds):
    return all(conds)
  return functools.reduce(jnp.logical_and, conds)


def _block_needed(p: _Problem, bq: int, bkv: int, i, j):
  """True (traced) unless causal / window structure masks all of block (i, j): the body's
  skip test (the index maps clamp with :func:`_kv_range` / :func:`_q_range`)."""
  return _tile_needed(p, i * bq, jnp.minimum(i * bq + bq - 1, p.sq - 1), j * bkv,
                      jnp.minimum(j * bkv + bkv - 1, p.skv - 1))


def _tile_needed(p: _Problem, r0, r1, c0, c1):
  """True (traced) unless causal / window structure or the kv tail masks every pair of query
  rows ``r0..r1`` x keys ``c0..c1``."""
  conds = [c0 < p.skv]
  if p.causal:
    conds.append(c0 <= r1 + p.offset)
  if p.window is not None:
    conds.append(c1 >= r0 + p.offset - p.window + 1)
    if not p.causal:
      conds.append(c0 <= r1 + p.offset + p.window - 1)
  return _all(conds)


# ---------------------------------------------------------------------------------
# Shared by the kernel bodies
# ---------------------------------------------------------------------------------


def _zero_rows(x, valid):
  """Zeroes rows ``valid..`` of a tile (they hold stale VMEM past the sequence's end)."""
  keep = lax.broadcasted_iota(jnp.int32, x.shape, 0) < valid
  return jnp.where(keep, x.astype(jnp.float32), 0.0).astype(x.dtype)


def _branches(needed, full, step):
  """Runs ``step(masked)`` under ``pl.when``: unmasked where the block is full, masked elsewhere.

  ``needed`` and ``full`` are traced booleans or Python constants (no skipping / never full)."""
  def when(cond, fn):
    if cond is True:
      fn()
    elif cond is not False:
      pl.when(cond)(fn)

  def both(a, b):
    if a is False or b is False:
      return False
    if a is True:
      return b
    return a if b is True else jnp.logical_and(a, b)
  when(both(needed, full), lambda: step(False))
  not_full = (not full) if isinstance(full, bool) else jnp.logical_not(full)
  when(both(needed, not_full), lambda: step(True))


def _scaled_q_rows(q_ref, rows, scale):
  q = q_ref[rows, :]
  return (q.astype(jnp.float32) * scale).astype(q.dtype)


class _Refs:
  """Named access to a kernel's positional refs."""

  def __init__(self, refs, names):
    refs = list(refs)
    assert len(refs) == len(names), (len(refs), names)
    self.__dict__.update(zip(names, refs))


def _visibility_tile(p, r, qpos, kpos, b, h, i_ids, kv_cols=slice(None), q_rows=slice(None), transposed=False):
  """The full visibility predicate of one tile (positions broadcast to the tile's orientation);
  ``q_rows`` / ``kv_cols``: the sub-tile of the segment / mask tiles, which are ``(q, kv)``, or
  ``(kv, q)`` when ``transposed`` (the dk/dv kernel)."""
  vis = _visible(p, qpos, kpos)
  kv_ok = kpos < p.skv
  vis = kv_ok if vis is None else jnp.logical_and(vis, kv_ok)
  vis = jnp.logical_and(vis, qpos < p.sq)
  if p.segments:
    if transposed:
      vis = jnp.logical_and(vis, r.segq[:, q_rows] == r.segk[kv_cols, :])
    else:
      vis = jnp.logical_and(vis, r.segq[q_rows, :] == r.segk[:, kv_cols])
  if p.mask_shape is not None:
    vis = jnp.logical_and(vis, (r.mask[kv_cols, q_rows] if transposed else r.mask[q_rows, kv_cols]) != 0)
  return vis


def _masked_tiles(p: _Problem, plan: _Plan, i, j, rows: int, cols: int, tile, transposed=False):
  """Runs a block that needs masking as ``(rows, cols)`` tiles (q rows x kv keys, or kv x q when
  ``transposed``), each skipped, unmasked or masked: ``tile(row_slice, col_slice, masked)``."""
  patterns = plan.patterns_t if transposed else plan.patterns
  if patterns:  # the block's tile pattern is known statically
    _pattern_tiles(patterns, i, j, tile)
    return
  bq, bkv = plan.bq, plan.bkv
  n_r, n_c = (bkv, bq) if transposed else (bq, bkv)
  for a in range(n_r // rows):
    for c in range(n_c // cols):
      if transposed:
        c0, r0, nk, nq_ = j * bkv + a * rows, i * bq + c * cols, rows, cols
      else:
        r0, c0, nq_, nk = i * bq + a * rows, j * bkv + c * cols, rows, cols
      needed = _tile_needed(p, r0, r0 + nq_ - 1, c0, c0 + nk - 1)
      full = _full_tile(p, r0, r0 + nq_ - 1, c0, c0 + nk - 1, q_tail=transposed and p.sq % bq != 0,
                        kv_tail=p.skv % bkv != 0)
      _branches(needed, full, functools.partial(tile, pl.ds(a * rows, rows), pl.ds(c * cols, cols)))


def _pattern_tiles(patterns, i, j, tile):
  """Runs a block that needs masking by its static tile pattern (``plan.patterns``): with one
  possible pattern directly, else under ``pl.when(j - i == d)`` for each."""
  for d, tiles in patterns:
    def run(tiles=tiles):
      for r0, nr, c0, nc, masked in tiles:
        tile(pl.ds(r0, nr), pl.ds(c0, nc), masked)
    if len(patterns) == 1:
      run()
    else:
      pl.when(j - i == d)(run)


# ---------------------------------------------------------------------------------
# Block specs and layouts
# ---------------------------------------------------------------------------------


def _seq_spec(plan: _Plan, block: int, d: int, fn):
  """BlockSpec of a q/k/v-like operand: ``fn(*grid ids) -> (batch, head, seq block)``.

  Native BHSD arrays take a (block, D) tile of [B, H, S, D]; BSHD read in place is
  [B, S, H*D] and head h is the h-th D-wide column block."""
  sq = pl.squeezed
  if plan.inplace_bshd:
    return pl.BlockSpec((sq, block, d), lambda *g: (lambda b, h, s: (b, s, h))(*fn(*g)))
  return pl.BlockSpec((sq, sq, block, d), lambda *g: (lambda b, h, s: (b, h, s, 0))(*fn(*g)))


def _in_layout(x, p: _Problem, plan: _Plan):
  """The caller's array as the kernel reads it (a free reshape, or an XLA transpose to BHSD)."""
  if p.layout == "BHSD":
    return x
  if plan.inplace_bshd:
    return x.reshape(x.shape[0], x.shape[1], -1)
  return jnp.swapaxes(x, 1, 2)


def _out_layout(x, p: _Problem, plan: _Plan, heads: int):
  if p.layout == "BHSD":
    return x
  if plan.inplace_bshd:
    return x.reshape(x.shape[0], x.shape[1], heads, p.d)
  return jnp.swapaxes(x, 1, 2)


def _seq_shape(p: _Problem, plan: _Plan, heads: int, seq: int):
  return (p.b, seq, heads * p.d) if plan.inplace_bshd else (p.b, heads, seq, p.d)


def _dense_block(p: _Problem, shape, bq: int, bkv: int, fn, transposed=False):
  """BlockSpec of a dense mask / bias ``[Bm, Hm, Sq, Skv]`` (``[Bm, Hm, Skv, Sq]`` transposed)."""
  bm, hm = shape

  def index(*g):
    b, h, i, j = fn(*g)
    bb = b if bm > 1 else 0
    hh = h if hm > 1 else 0
    return (bb, hh, j, i) if transposed else (bb, hh, i, j)
  sq = pl.squeezed
  return pl.BlockSpec((sq, sq, bkv, bq) if transposed else (sq, sq, bq, bkv), index)


def _small_inputs(p: _Problem, seed, sinks, head):
  """The dropout seed and the sinks as small VMEM tiles (an (8, 128) tile each; as SMEM
  scalars they abort libtpu's cost model). ``head(*grid ids)`` is the q head of a step."""
  args, names, specs = [], [], []
  if p.dropout_rate:
    args.append(jnp.full((8, 128), seed, jnp.int32))
    names.append("seed")
    specs.append(pl.BlockSpec((8, 128), lambda *g: (0, 0)))
  if p.sinks:
    args.append(jnp.broadcast_to(sinks.astype(jnp.float32)[:, None, None], (p.h, 8, 128)))
    names.append("sinks")
    specs.append(pl.BlockSpec((pl.squeezed, 8, 128), lambda *g: (head(*g), 0, 0)))
  return args, names, specs


def _compiler_params(plan: _Plan, inner: int = 1, parallel: int = 3):
  """``parallel`` parallel grid axes, then ``inner`` sequential ones (the accumulation)."""
  return pltpu.CompilerParams(dimension_semantics=("parallel",) * parallel + ("arbitrary",) * inner,
                              vmem_limit_bytes=plan.vmem_limit)


def _q_major_inputs(q, k, v, sinks, bias, seg_q, seg_kv, mask, seed, *, p: _Problem, plan: _Plan, extra=()):
  """(args, names, in_specs) of a kernel on the forward's grid ``(b, h, q block i, kv block j)``:
  the small inputs, q, k, v, the ``extra`` ``(name, array, BlockSpec)`` triples, then the segment
  ids, mask and bias. K/V-side blocks use ``j`` clamped to the kv blocks row block ``i`` can see,
  so a skipped step re-uses the block already in VMEM (no DMA)."""
  bq, bkv, nkv, G = plan.bq, plan.bkv, plan.nkv, p.group
  sq = pl.squeezed

  def ids(*g):  # -> (b, h, i, j clamped)
    b, h, i, j = _q_major_ids(p, plan, g)[:4]
    if p.skips and not (plan.folded or plan.band):
      lo, hi = _kv_range(p, bq, bkv, nkv, i)
      j = _clamp(j, lo, hi)
    return b, h, i, j

  args, names, in_specs = _small_inputs(p, seed, sinks, lambda *g: g[1])
  kv_spec = _seq_spec(plan, bkv, p.d, lambda *g: (g[0], _floor_div(g[1], G), ids(*g)[3]))
  in_specs = in_specs + [_seq_spec(plan, bq, p.d, lambda *g: ids(*g)[:3]), kv_spec, kv_spec]
  args = args + [q, k, v]
  names += ["q", "k", "v"]
  for name, array, spec in extra:
    names.append(name)
    args.append(array)
    in_specs.append(spec)
  if p.segments:
    in_specs += [pl.BlockSpec((sq, bq, 1), lambda *g: (g[0], ids(*g)[2], 0)),
                 pl.BlockSpec((sq, 1, bkv), lambda *g: (g[0], 0, ids(*g)[3]))]
    args += [seg_q.astype(jnp.int32).reshape(p.b, p.sq, 1), seg_kv.astype(jnp.int32).reshape(p.b, 1, p.skv)]
    names += ["segq", "segk"]
  if p.mask_shape is not None:
    in_specs.append(_dense_block(p, p.mask_shape, bq, bkv, ids))
    args.append(mask.astype(jnp.int8))
    names.append("mask")
  if p.bias_shape is not None:
    in_specs.append(_dense_block(p, p.bias_shape, bq, bkv, ids))
    args.append(bias)
    names.append("bias")
  if p.rope is not None:
    _add_rope_inputs(p, plan, lambda *g: ids(*g)[2], lambda *g: ids(*g)[3], args, names, in_specs)
  return args, names, in_specs


# ---------------------------------------------------------------------------------
# Rotary embedding inside the kernels (``p.rope``)
# ---------------------------------------------------------------------------------
# A block's cos / sin rows are composed in VMEM from two small tables by the angle addition
# formulas: the rows of positions 0 .. block - 1 (the same for every block: a constant block
# index, so fetched once per kernel) and one row per block, its first position's. Fetching a
# block's [block, D] f32 rows instead would move 8 bytes per feature at every grid step that
# changes the block, four times the bf16 k or q block itself.


def _rope_tables(p: _Problem, block: int, n: int, first: int):
  """(offset ``[2, block, D]``, base ``[n, 2, D]``) f32: cos and signed sin of positions
  ``0 .. block - 1`` and of the block starts ``first + i * block`` (from the cached float64-built table)."""
  cos, sin = p.rope.table(max(block, first + (n - 1) * block + 1), p.d)
  starts = first + np.arange(n) * block
  return np.stack([cos[:block], sin[:block]]), np.stack([cos[starts], sin[starts]], axis=1)


def _add_rope_inputs(p: _Problem, plan: _Plan, q_block, kv_block, args, names, specs):
  """Appends the q-side and kv-side rotary tables; ``q_block(*g)`` / ``kv_block(*g)``: a step's blocks.
  Queries sit at positions ``kv_len - q_len + row`` (the last query aligned with the last key), keys at their row."""
  sq = pl.squeezed
  for side, block, n, first, index in (("q", plan.bq, plan.nq, p.offset, q_block),
                                       ("k", plan.bkv, plan.nkv, 0, kv_block)):
    offset, base = _rope_tables(p, block, n, first)
    args += [offset, base]
    names += [f"r{side}_off", f"r{side}_base"]
    specs += [pl.BlockSpec((2, block, p.d), lambda *g: (0, 0, 0)), pl.BlockSpec((sq, 2, p.d), _row_map(index))]


def _row_map(index):
  return lambda *g: (index(*g), 0, 0)


def _rope_vmem(p: _Problem, bq: int, bkv: int) -> int:
  """VMEM of the rotary embedding: the double-buffered tables, the rotated q / k scratch, f32 temporaries."""
  if p.rope is None:
    return 0
  tables = 2 * (2 * (bq + bkv) * p.d * 4 + 2 * 8 * p.d * 4)
  return tables + (bq + bkv) * p.d * p.dtype.itemsize + 6 * max(bq, bkv) * p.d * 4


def _rope_rows(r, side: str, rows=slice(None)):
  """A block's (cos, signed sin), f32 ``[rows, D]``, composed from its base row and the offset rows."""
  base, offset = getattr(r, f"r{side}_base"), getattr(r, f"r{side}_off")
  return compose_rows(base[...], offset[:, rows, :])


def _rope_rotate(p: _Problem, x, cs, inverse: bool = False):
  """``x`` rotated (f32) by the rows ``cs`` = (cos, signed sin); ``inverse``: by the opposite angles."""
  return rotate_tile(x.astype(jnp.float32), cs[0], cs[1], rotary_dim=p.rope.rotary_dim,
                     interleaved=p.rope.interleaved, inverse=inverse)


def _rope_block(p: _Problem, r, x_ref, side: str, scale: float = 1.0):
  """A whole q / k block rotated (and scaled) in the input dtype: what the matmuls read."""
  y = _rope_rotate(p, x_ref[...], _rope_rows(r, side))
  return (y * scale if scale != 1.0 else y).astype(x_ref.dtype)
