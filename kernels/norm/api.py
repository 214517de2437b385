"""Layer norm and RMS norm over the last axis, with a fused residual add, in Pallas.

``layer_norm(x, scale, bias)`` computes ``(x - mean) / sqrt(var + eps) * scale + bias``
and ``rms_norm(x, scale)`` computes ``x / sqrt(mean(x^2) + eps) * scale``, each row of
the last axis on its own. With ``residual=r`` both first form ``h = x + r`` and return
``(norm(h), h)``: the add-and-norm of a transformer block in one pass over memory.
:func:`layer_norm_reference` and :func:`rms_norm_reference` are the same computations
in plain JAX (what XLA fuses on its own).

How the norm kernels work
-------------------------

*Memory bound.* A norm does ~8 FLOPs per element and moves 2 bytes in and 2 out
(bf16): about 2 FLOP/byte, two orders of magnitude below any TPU's ridge point. Its
time is the bytes it moves divided by the HBM bandwidth, so the goals are to move each
byte once and to keep the vector work of a block shorter than its DMAs.

*Tiling.* Rows are independent. The input ``[R, H]`` (leading dimensions flattened,
a free reshape) is cut into blocks of ``rows x H``: the whole row is in VMEM, so the
statistics need no second pass over HBM. The grid is ``(cdiv(R, rows),)``, one
"parallel" axis: on v4 and v5p the two TensorCores of a megacore take half the blocks
each. Every block moves through Pallas's own pipeline (one DMA per block and array,
double-buffered), inputs and outputs alike. A width that is not a multiple of 128
(1000, 4000) is the block's whole last dimension, which Mosaic's tiling rule allows;
nothing is padded in HBM. A partial last row block is harmless in the forward pass:
Pallas writes back only the rows that exist.

*Chunks.* Inside a block the math runs a few rows at a time (16 rows of bf16 at
H=4096, about 64 KiB of f32; 8 in the forward kernel), in a loop: a whole block's f32
temporaries would not fit the 64 vector registers, and every spilled op pays a VMEM
load and store. Even one chunk's f32 rows (64 registers at H=4096) spill, because they
live across the row reduction. So at widths of 4096 and more (multiples of 256) the
fused add-and-norm forward and every backward *stream*: one sweep reads the chunk 256
lanes at a time and keeps only lane-partial row sums, a second sweep re-reads the rows
from the VMEM block for the outputs (:func:`_backward_streamed_kernel`). Re-reading
VMEM costs loads and unpacks; spilling cost stores, and v5e issues one vector store
per cycle.

*No extra DMAs.* The kernels used to write their outputs back themselves, as several
DMAs per block, and to read a lone input block as two DMAs of half the rows. Both were
removed: they won only in the compiler's cost model, which rewards DMAs in flight beyond
what HBM can deliver; under the bandwidth floor of :func:`kernels.estimate_tpu` they
move the same bytes and gain nothing.

*Rows per block.* Big enough that the ~0.35 us fixed cost of a grid step is small
against its DMA, small enough to double-buffer in VMEM. The defaults come from
``kernels/data/norm_blocks.json`` (``tools/tune_norm.py``, compiler-estimate sweeps
per generation): a call takes the tuned rows of the nearest tuned width, scaled to
keep the block's bytes, and :func:`fit_block_sizes` shrinks them until the VMEM plan
(double-buffered blocks plus the f32 temporaries) fits the chip.

*Numerics.* Inputs and outputs are bf16 or f32; statistics are always f32. The
variance is two-pass within the block, ``mean((x - mean(x))^2)``: the row is already
in VMEM, so the second pass costs VPU work, not HBM traffic. The one-pass formula
``mean(x^2) - mean(x)^2`` subtracts two nearly equal numbers when ``|mean| >> std``
and loses every digit (see the notebook).

*Fused residual.* Unfused, ``h = x + r`` writes ``h`` to HBM and the norm reads it
back: ``2 reads + 1 write`` then ``1 read + 1 write``. Fused, the kernel reads ``x``
and ``r`` once and writes ``h`` and ``y``: one full read of ``h`` saved (and XLA
cannot always fuse across the two outputs). ``h`` is rounded to the input dtype
before it is normalised, so the norm and the stored ``h`` agree exactly. The add itself
runs in the input dtype (:func:`_add_native`): the same bits as the reference's f32 add
rounded once, and on v6e, which adds bf16 natively, no unpacking to f32 and packing back.

*Backward* (``custom_vjp``, all in one Pallas kernel). The forward saves its input
(``h`` with a residual, else ``x``), which the backward re-reads with ``dy``. When the
backward streams (below), the forward also saves each row's statistics (``rstd``, and
the mean for layer norm: 4 bytes a row each, lane-dense), so the backward, which the
cost model finds bound by vector work rather than by HBM, does not recompute them.
Narrower rows recompute them. With ``c = h - mean`` (layer) or ``c = h`` (RMS),
``rstd = 1/sqrt(mean(c^2) + eps)``, ``xhat = c * rstd`` and ``g = dy * scale``::

  dx     = rstd * (g - xhat * mean(g * xhat) [- mean(g)])
         = g * rstd + c * (-rstd^3 * mean(dy * c * scale)) [- rstd * mean(g)]
  dscale = sum over rows of dy * xhat,   dbias = sum over rows of dy

The second form is what the kernel computes: ``dy * c`` serves both ``dx`` and
``dscale``, and ``xhat`` is never formed, a few vector ops per element fewer. The
streamed backward forms ``u = dy * rstd`` and ``us = u * scale`` once per element, in
one sweep down the block's column slices that writes ``us [+ dh]`` to an f32 VMEM
scratch and gathers the row sums ``k`` needs (``sum(us * c) = rstd * sum(g * c)``) and
the column sums of ``dscale`` (``u * c``); a last sweep adds ``h * k`` (the row's term)
and stores ``dx``. With a residual, the cotangent of the returned ``h`` is added to
``dx`` in the kernel, and ``x`` and ``r`` both receive it. ``dscale`` and ``dbias`` are
column sums over all rows: each grid step accumulates its chunks into an ``(8, H)`` f32
scratch (plain vector adds), then writes its own ``[1, H]`` partial sum to a
``[blocks, 1, H]`` output (so the row axis stays "parallel" with no race between
cores), and a tiny XLA sum adds the partials. A partial last block would add stale
VMEM (maybe NaN) to those sums, so its out-of-range rows are zeroed with a select
first.

*Backend choice* (:func:`kernels.dispatch`): ``implementation=None`` runs the Pallas
kernel when lowered for TPU and the reference (XLA) elsewhere.

*Estimates.* ``tools/tune_norm.py bench`` stores compiler estimates (libtpu's cost
model, not measurements) of both kernels and of XLA's jnp composition at 8192 rows in
``kernels/data/norm_bench.json``. The notebook tabulates them against the HBM roofline
and against XLA, and shows where the model is known to be unreliable (it lets XLA's
own fusions on v6e stream faster than any Pallas DMA).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.base import partition
from kernels.base import calls
from kernels.base import tiling
from kernels.base.backend import dispatch, target_chip
from kernels.base.errors import KernelError, check
from kernels.base.hardware import get_chip

__all__ = ["BlockSizes", "default_block_sizes", "fit_block_sizes", "layer_norm", "layer_norm_reference",
           "rms_norm", "rms_norm_reference"]

FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
KINDS = ("layer", "rms")


# ---------------------------------------------------------------------------------
# Block sizes
# ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Rows per grid step of the forward and of the backward kernel (each block is ``rows x H``).

  ``None`` picks the per-generation default. A value at least the number of rows
  becomes all the rows; otherwise it must be a multiple of 8 (Mosaic's sublane rule).
  """

  rows: int | None = None
  backward_rows: int | None = None

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


# Without a table entry: blocks of ~2 MiB of input (forward) and ~1 MiB (backward). Smaller forward
# blocks pay the fixed cost of a grid step more often; larger ones gain little and cost VMEM.
_FALLBACK_BYTES = (2 << 20, 1 << 20)


def _pow2_floor(n: float) -> int:
  return 1 << max(0, int(math.floor(math.log2(max(n, 1)))))


def default_block_sizes(generation=None, dtype=jnp.bfloat16, hidden: int = 4096, kind: str = "layer",
                        residual: bool = False) -> BlockSizes:
  """The shipped default rows per block for width ``hidden`` on ``generation`` (None: v5e).

  ``kernels/data/norm_blocks.json`` holds, per generation and dtype, the rows
  ``tools/tune_norm.py`` found fastest for a few widths, for layer and RMS norm each
  (fused add-and-norm, forward and forward + backward). A call takes the nearest
  tuned width (log2 distance) and scales its rows to keep the block's bytes, rounded
  down to a power of two (at least 8). Before use, :func:`fit_block_sizes` shrinks
  them to fit VMEM.
  """
  gen = get_chip(generation).name if generation is not None else "v5e"
  entries = tiling.block_table("norm").get(gen, {}).get(jnp.dtype(dtype).name, [])
  entries = ([e for e in entries if e.get("kind", kind) == kind and e.get("residual", residual) == residual]
             or entries)
  if not entries:
    isz = jnp.dtype(dtype).itemsize
    return BlockSizes(*(_pow2_floor(b / (hidden * isz)) for b in _FALLBACK_BYTES))
  best = min(entries, key=lambda e: abs(math.log2(hidden / e["hidden"])))
  scale = best["hidden"] / hidden
  # (Other keys of an entry, such as the estimates or an old table's output_dmas, are ignored.)
  return BlockSizes(_pow2_floor(best["rows"] * scale), _pow2_floor(best["backward_rows"] * scale))


# A row of at least this many bytes (and a multiple of 128 wide) is laid out as (H/128, 128) tiles:
# the block is then (rows, H/128, 128), whose rows are a leading dimension with no multiple-of-8
# rule, so a block can hold 1, 2, 3... rows of 65536 (8 would not fit v4's 16 MiB of VMEM).
WIDE_ROW_BYTES = 64 * 1024


def _wide(hidden: int, dtype) -> bool:
  return hidden % tiling.LANES == 0 and hidden * jnp.dtype(dtype).itemsize >= WIDE_ROW_BYTES


def _row_shape(hidden: int, dtype) -> tuple[int, ...]:
  """How one row is laid out in the kernel: ``(H,)``, or ``(H/128, 128)`` for wide rows."""
  return (hidden // tiling.LANES, tiling.LANES) if _wide(hidden, dtype) else (hidden,)


def _vec_shape(hidden: int, dtype) -> tuple[int, int]:
  """How a ``[H]`` parameter is laid out: ``(1, H)`` or ``(H/128, 128)``."""
  return (hidden // tiling.LANES, tiling.LANES) if _wide(hidden, dtype) else (1, hidden)


def _acc_shape(hidden: int, dtype) -> tuple[int, int]:
  """A grid step's f32 accumulator of column sums: ``(8, H)`` (one row per sublane, so adding a
  chunk's rows into it is plain vector adds, not a sublane reduction), or ``(H/128, 128)`` for wide
  rows. The step writes it out summed to ``_vec_shape`` (a (nblocks, 8, H) output would be 8x
  bigger, and XLA then places such outputs in VMEM and runs out of it in forward+backward programs)."""
  return _vec_shape(hidden, dtype) if _wide(hidden, dtype) else (tiling.SUBLANES, hidden)


def _vmem_bytes(rows: int, hidden: int, dtype, *, backward: bool, residual: bool, params: int) -> int:
  """VMEM plan of one kernel: double-buffered blocks plus room for the f32 temporaries the
  compiler spills (those of one unrolled chunk loop body, see _for_each_chunk)."""
  block = (rows,) + _row_shape(hidden, dtype)
  big = [(block, dtype)] * ((4 if residual else 3) if backward else (4 if residual else 2))
  small = ([(_vec_shape(hidden, dtype), jnp.float32)] * params
           + ([(_vec_shape(hidden, dtype), jnp.float32), (_acc_shape(hidden, dtype), jnp.float32)] * params
              if backward else []))
  # Spills come from the chunks of one unrolled loop body, not from the whole block.
  chunk = min(rows, _chunk_rows(rows, hidden, dtype) * _UNROLL if backward else _FORWARD_UNROLL_ROWS)
  temps = [((chunk,) + _row_shape(hidden, dtype), jnp.float32)] * (4 if backward else 3)
  if not backward and _streams(hidden, dtype, rows):  # the saved statistics' columns (see _n_stats)
    temps.append(((2, rows, tiling.LANES), jnp.float32))
  if backward and _streams(hidden, dtype, rows):  # no chunk temporaries; row coefficients and scale rows
    # (the f32 part of dx is counted twice: Mosaic asked for ~5 MiB beyond one copy of it at 256 x
    # 4096 rows of layer norm on v5e)
    temps = [((4, rows, tiling.LANES), jnp.float32), ((rows, hidden), jnp.float32), ((rows, hidden), jnp.float32),
             ((tiling.sublane_multiple(dtype), hidden), jnp.float32)]
  return tiling.vmem_footprint(big + small, scratch=temps)


def fit_block_sizes(blocks: BlockSizes, n_rows: int, hidden: int, dtype=jnp.bfloat16, *, residual=False,
                    params: int = 2, chip=None) -> BlockSizes:
  """The rows the kernels really use: all rows if the block covers them, else a power of two (at
  least 8, or 1 for wide rows) whose VMEM plan fits ``chip``."""
  c = get_chip(chip or "v5e")
  least = 1 if _wide(hidden, dtype) else 8
  out = []
  for backward, rows in ((False, max(blocks.rows, least)), (True, max(blocks.backward_rows, least))):
    # Halve until the plan, with vmem_limit's headroom, fits the core's VMEM (or rows reach 8: then
    # the kernel raises VmemOverflowError, e.g. 65536-wide f32 rows with a residual on v4's 16 MiB).
    while rows > least and 1.25 * _vmem_bytes(min(rows, n_rows), hidden, dtype, backward=backward,
                                          residual=residual, params=params) + (1 << 20) > c.vmem_bytes:
      rows //= 2
    out.append(n_rows if rows >= n_rows else rows)
  return BlockSizes(*out)


# ---------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Problem:
  kind: str
  n_rows: int
  hidden: int
  shape: tuple[int, ...]
  dtype: jnp.dtype
  eps: float
  has_residual: bool
  has_scale: bool
  has_bias: bool


def _check_param(name: str, p, hidden: int):
  if p is None:
    return
  check(hasattr(p, "shape") and hasattr(p, "dtype"), name, p, "must be an array or None")
  check(tuple(p.shape) == (hidden,), name, p, f"must have shape ({hidden},), one value per element of x's last axis")
  check(jnp.issubdtype(p.dtype, jnp.floating), name, p, "must be a floating-point array")


def _validate(kind, x, scale, bias, residual, eps) -> _Problem:
  check(hasattr(x, "shape") and hasattr(x, "dtype"), "x", x, "must be an array")
  check(jnp.dtype(x.dtype) in FLOAT_DTYPES, "x", x,
        f"dtype {jnp.dtype(x.dtype).name} is not supported; {kind}_norm takes bfloat16 or float32")
  check(x.ndim >= 1 and x.size > 0, "x", x, "must have rank >= 1 and at least one element")
  hidden = int(x.shape[-1])
  _check_param("scale", scale, hidden)
  _check_param("bias", bias, hidden)
  if residual is not None:
    check(hasattr(residual, "shape") and hasattr(residual, "dtype"), "residual", residual, "must be an array or None")
    check(tuple(residual.shape) == tuple(x.shape), "residual", residual, f"must have x's shape {tuple(x.shape)}")
    check(residual.dtype == x.dtype, "residual", residual, f"must have x's dtype {jnp.dtype(x.dtype).name}")
  check(isinstance(eps, (int, float)) and not isinstance(eps, bool) and math.isfinite(eps) and eps > 0, "eps", eps,
        "must be a positive finite float (it keeps 1/sqrt(var + eps) finite)")
  return _Problem(kind, math.prod(x.shape[:-1]), hidden, tuple(x.shape), jnp.dtype(x.dtype), float(eps),
                  residual is not None, scale is not None, bias is not None)


def _check_blocks(block_sizes):
  if block_sizes is None:
    return BlockSizes()
  if isinstance(block_sizes, int) and not isinstance(block_sizes, bool):
    return BlockSizes(block_sizes, block_sizes)
  if isinstance(block_sizes, BlockSizes):
    return block_sizes
  if isinstance(block_sizes, (tuple, list)) and len(block_sizes) == 2:
    return BlockSizes(*block_sizes)
  raise KernelError("block_sizes", block_sizes, "must be None, an int, a BlockSizes or a (rows, backward_rows) tuple")


# ---------------------------------------------------------------------------------
# The reference (pure JAX)
# ---------------------------------------------------------------------------------


def _add(x, residual):
  """``h = x + residual`` rounded to x's dtype (what the kernel stores and normalises)."""
  return (x.astype(jnp.float32) + residual.astype(jnp.float32)).astype(x.dtype)


def _add_native(x, residual):
  """:func:`_add` in the kernels: one add in x's dtype. A correctly rounded add of two bf16 values
  equals their f32 sum rounded to bf16 (that sum is exact, or its error is far below half a bf16
  ulp), and v6e adds bf16 natively instead of unpacking both to f32 and packing the sum. Compiled
  kernels only: an interpreted kernel runs as XLA on the host, which may keep a bf16 sum in f32
  (excess precision) and normalise the unrounded value, so interpret mode uses :func:`_add`."""
  return x + residual


def _normalize(hf, kind, eps, axes=(-1,)):
  """f32 rows -> (xhat, mean, rstd): two-pass statistics over ``axes`` (the row; mean 0 for RMS)."""
  mean = jnp.mean(hf, axis=axes, keepdims=True) if kind == "layer" else 0.0
  xc = hf - mean if kind == "layer" else hf
  rstd = lax.rsqrt(jnp.mean(xc * xc, axis=axes, keepdims=True) + eps)
  return xc * rstd, mean, rstd


def _reference(x, residual, scale, bias, *, p: _Problem):
  h = x if residual is None else _add(x, residual)
  y, _, _ = _normalize(h.astype(jnp.float32), p.kind, p.eps)
  if scale is not None:
    y = y * scale.astype(jnp.float32)
  if bias is not None:
    y = y + bias.astype(jnp.float32)
  y = y.astype(x.dtype)
  return y if residual is None else (y, h)


def layer_norm_reference(x, scale=None, bias=None, *, eps=1e-6, residual=None):
  """Pure-JAX :func:`layer_norm` (f32 statistics, two-pass variance): what XLA fuses itself."""
  return _reference(x, residual, scale, bias, p=_validate("layer", x, scale, bias, residual, eps))


def rms_norm_reference(x, scale=None, *, eps=1e-6, residual=None):
  """Pure-JAX :func:`rms_norm` (f32 statistics)."""
  return _reference(x, residual, scale, None, p=_validate("rms", x, scale, None, residual, eps))


# ---------------------------------------------------------------------------------
# The Pallas kernels
# ---------------------------------------------------------------------------------


# The math runs on chunks of CHUNK_BYTES of f32 rows at a time, never on the whole block: a whole
# block's f32 temporaries do not fit the 64 vector registers, so Mosaic spills all of them to VMEM
# and every op pays a load and a store.
CHUNK_BYTES = 64 << 10
_UNROLL = 8  # chunk loops longer than this run as a fori_loop unrolled this many times
# The forward kernel's chunks may be 8 rows even in bf16 (half a packed vector register; one f32
# register row), and its loop is unrolled over 256 rows: fewer f32 rows live across the row
# reduction, and more chunks to interleave. The backward kernel was estimated slower so and
# keeps its own chunks and unroll.
_FORWARD_CHUNK_ROWS = 8
_FORWARD_UNROLL_ROWS = 256


def _chunk_rows(rows: int, hidden: int, dtype, least: int | None = None) -> int:
  """Rows per chunk: a multiple of ``least`` (the dtype's sublane tile; 1 for wide rows), about
  CHUNK_BYTES of f32."""
  if _wide(hidden, dtype):
    return 1
  least = least or tiling.sublane_multiple(dtype)
  c = max(least, _pow2_floor(CHUNK_BYTES / (4 * hidden)))
  return rows if c >= rows else c


def _for_each_chunk(rows: int, chunk: int, body, unroll: int = _UNROLL):
  """Calls ``body(start, size)`` over ``rows`` rows in chunks (``start``: an int, or a traced
  multiple of ``chunk``)."""
  n, rem = divmod(rows, chunk)
  if n <= unroll:
    for j in range(n):
      body(j * chunk, chunk)
  else:
    def step(j, carry):
      body(pl.multiple_of(j * chunk, chunk), chunk)
      return carry
    lax.fori_loop(0, n, step, 0, unroll=unroll)
  if rem:
    body(n * chunk, rem)


def _forward_kernel(*refs, p: _Problem, rows: int, native_add: bool):
  refs = list(refs)
  x_ref = refs.pop(0)
  r_ref = refs.pop(0) if p.has_residual else None
  s_ref = refs.pop(0) if p.has_scale else None
  b_ref = refs.pop(0) if p.has_bias else None
  y_ref = refs.pop(0)
  h_out = refs.pop(0) if p.has_residual else None
  stats_out, cols = (refs.pop(0), refs.pop(0)) if refs else (None, None)  # saved statistics (+ scratch)
  if p.has_residual and _streams(p.hidden, p.dtype, rows):
    _forward_streamed(x_ref, r_ref, s_ref, b_ref, y_ref, h_out, cols, p=p, rows=rows,
                      native_add=native_add)
    if cols is not None:
      _pack_row_stats(cols, stats_out, rows)
    return
  axes = tuple(range(1, len(y_ref.shape)))  # the row: (H,) or (H/128, 128)
  scale = s_ref[...].astype(jnp.float32) if s_ref is not None else None
  bias = b_ref[...].astype(jnp.float32) if b_ref is not None else None

  def chunk(start, size):
    at = pl.ds(start, size)
    h = x_ref[at]
    if r_ref is not None:
      h = (_add_native if native_add else _add)(h, r_ref[at])
      h_out[at] = h
    y, mean, rstd = _normalize(h.astype(jnp.float32), p.kind, p.eps, axes)
    if cols is not None:
      for n, v in enumerate(_row_stats(p, mean, rstd)):
        cols[n, at, :] = v
    if scale is not None:
      y = y * scale
    if bias is not None:
      y = y + bias
    y_ref[at] = y.astype(y_ref.dtype)

  c = _chunk_rows(rows, p.hidden, p.dtype, _FORWARD_CHUNK_ROWS)
  _for_each_chunk(rows, c, chunk, max(1, _FORWARD_UNROLL_ROWS // c))
  if cols is not None:
    _pack_row_stats(cols, stats_out, rows)


def _accumulate(acc_ref, v, wide: bool):
  """Adds the rows of chunk ``v`` into the column-sum accumulator ``acc_ref`` (see _acc_shape)."""
  if wide:
    acc_ref[...] += jnp.sum(v, axis=0)
  elif v.shape[0] % tiling.SUBLANES == 0:
    acc_ref[...] += jnp.sum(v.reshape(-1, tiling.SUBLANES, v.shape[-1]), axis=0)
  else:  # a block of fewer rows than a tile (all the rows there are)
    acc_ref[0:1, :] += jnp.sum(v, axis=0, keepdims=True)


# Streamed sweeps (widths >= STREAM_MIN_WIDTH, multiples of STREAM_COLS): the chunk's rows are read
# from the VMEM block slice by slice (STREAM_COLS lanes at a time) in one sweep for the statistics and
# again for the outputs, so no f32 temporary of a whole row lives across the row reduction. The
# whole-chunk form above keeps such temporaries, and the compiler spills them: on v5e (one vector
# store slot per bundle) most of the RMS backward's stores were spills. Narrow rows spill little,
# so there the second sweep's re-reads are pure cost (the layer-norm backward at width 1024 was
# estimated slower streamed), hence the minimum width.
STREAM_COLS = 256
STREAM_MIN_WIDTH = 4096
STREAM_STEPS = 512  # column-slice steps unrolled per loop (a fully unrolled 512 x 4096 block; less unrolled is slower)


def _streams(hidden: int, dtype, rows: int) -> bool:
  """Whether a block of ``rows x hidden`` runs as streamed column sweeps."""
  return (hidden >= STREAM_MIN_WIDTH and hidden % STREAM_COLS == 0 and not _wide(hidden, dtype)
          and rows % tiling.sublane_multiple(dtype) == 0)



# Saved statistics. When the backward streams, the forward under jax.grad also writes each row's
# statistics (rstd, and the mean for layer norm), so the backward's first sweep does not recompute
# them: for RMS that drops the sum of squares, two of its ~18 vector ops per element (layer also drops
# its mean sweep). They are stored lane-dense, (rows/128, n_stats, 128) f32 per block: 4 bytes a row
# and statistic, where a (rows, 1) column would be padded to 128 lanes in HBM. Both passes' blocks
# must then be multiples of 128 rows.
def _n_stats(p: _Problem) -> int:
  return 2 if p.kind == "layer" else 1  # (mean,) rstd


def _saves_stats(p: _Problem, plan: BlockSizes) -> bool:
  """Whether the forward saves the row statistics for the backward (which then streams)."""
  lane_rows = all(r % tiling.LANES == 0 for r in (plan.rows, plan.backward_rows))
  return lane_rows and _streams(p.hidden, p.dtype, plan.backward_rows)


def _row_stats(p: _Problem, mean, rstd) -> list:
  return [mean, rstd] if p.kind == "layer" else [rstd]


def _group(start):
  """(row // 128, row % 128) of a non-negative block row (lax.div/rem: jnp's floor division lowers
  through sign, which needs a TPU backend at trace time)."""
  if isinstance(start, int):
    return divmod(start, tiling.LANES)
  return lax.div(start, tiling.LANES), lax.rem(start, tiling.LANES)


def _lane_of_row(c: int, lane0):
  """(c, 128) mask: lane == lane0 + row, i.e. each row's slot among its 128-row group's lanes."""
  lane = lax.broadcasted_iota(jnp.int32, (c, tiling.LANES), 1)
  return lane == lane0 + lax.broadcasted_iota(jnp.int32, (c, tiling.LANES), 0)


def _pack_row_stats(cols, out, rows: int):
  """(n_stats, rows, 1) per-row columns -> the lane-dense (rows/128, n_stats, 128) block. Done once
  per grid step: building the lane-dense rows chunk by chunk serialises the forward's chunk loop on
  the stores and loads of the same row (the chunks can no longer overlap)."""
  diag = _lane_of_row(tiling.LANES, 0)
  for g in range(rows // tiling.LANES):
    for n in range(out.shape[1]):
      v = cols[n, pl.ds(g * tiling.LANES, tiling.LANES), :]
      out[g, pl.ds(n, 1), :] = jnp.sum(jnp.where(diag, v, 0.0), axis=0, keepdims=True)


def _get_row_stat(ref, n: int, start, c: int):
  """Statistic ``n`` of the block's rows start..start+c, as (c, 1)."""
  q, lane0 = _group(start)
  row = ref[q, pl.ds(n, 1), :]
  return jnp.sum(jnp.where(_lane_of_row(c, lane0), row, 0.0), axis=1, keepdims=True)


def _n_coefs(p: _Problem) -> int:
  """Per-row values the streamed backward keeps between its sweeps."""
  return 2 if p.kind == "rms" else 4  # rstd [, mean], sum(us * c) [, sum(us)]


def _lane_parts(v):
  """(C, STREAM_COLS) -> (C, 128): the lane tiles added together (partial row sums, no lane reduction)."""
  out = v[:, 0:tiling.LANES]
  for t in range(1, v.shape[1] // tiling.LANES):
    out = out + v[:, t * tiling.LANES:(t + 1) * tiling.LANES]
  return out


def _row_sum(parts):
  """The row sums of a list of (C, 128) partial sums, as (C, 1)."""
  return jnp.sum(functools.reduce(lambda a, b: a + b, parts), axis=1, keepdims=True)


def _sweep_loop(n_chunks: int, n_cols: int, body, init):
  return lax.fori_loop(0, n_chunks, body, init, unroll=max(1, min(n_chunks, STREAM_STEPS // n_cols)))


def _forward_streamed(x_ref, r_ref, s_ref, b_ref, y_ref, h_out, stat_cols, *, p: _Problem, rows: int,
                      native_add: bool):
  """Fused add-and-norm forward in streamed sweeps: h = x + r is stored slice by slice, then re-read
  from the output block for the statistics and for y."""
  C, W = tiling.sublane_multiple(p.dtype), STREAM_COLS
  n_cols, inv_h = p.hidden // W, 1.0 / p.hidden

  def chunk(j, carry):
    at = pl.ds(pl.multiple_of(j * C, C), C)
    load = lambda t: h_out[at, pl.ds(t * W, W)].astype(jnp.float32)  # noqa: E731
    for t in range(n_cols):
      cols = pl.ds(t * W, W)
      h_out[at, cols] = (_add_native if native_add else _add)(x_ref[at, cols], r_ref[at, cols])
    mean = _row_sum([_lane_parts(load(t)) for t in range(n_cols)]) * inv_h if p.kind == "layer" else 0.0
    centred = lambda t: load(t) - mean if p.kind == "layer" else load(t)  # noqa: E731
    rstd = lax.rsqrt(_row_sum([_lane_parts(centred(t) ** 2) for t in range(n_cols)]) * inv_h + p.eps)
    if stat_cols is not None:
      for n, v in enumerate(_row_stats(p, mean, rstd)):
        stat_cols[n, at, :] = v
    for t in range(n_cols):
      cols = pl.ds(t * W, W)
      y = centred(t) * rstd
      if s_ref is not None:
        y = y * s_ref[:, cols].astype(jnp.float32)
      if b_ref is not None:
        y = y + b_ref[:, cols].astype(jnp.float32)
      y_ref[at, cols] = y.astype(y_ref.dtype)
    return carry

  lax.fori_loop(0, rows // C, chunk, 0, unroll=min(rows // C, _UNROLL))  # (fully unrolled is slower here)


def _backward_streamed_kernel(*refs, p: _Problem, rows: int, saved_stats: bool):
  """The backward in streamed sweeps over the block. (1) Each row's statistics: the forward's, or
  one sweep here. (2) Column slice by column slice down the block: the part of dx that needs no row
  sum, ``u * scale [+ dh]`` with ``u = dy * rstd``, into an f32 VMEM scratch; the row sums that ``k``
  needs (into the coefficient scratch); and the column sums of dscale and dbias, in registers.
  (3) Per chunk of rows, ``k`` [and ``b``], then ``dx = part + h * k [+ b]``. Each input element is
  unpacked from bf16 once in (2) and ``h`` once more in (3): two sweeps that each formed ``u`` and
  unpacked ``h`` and ``dy`` cost more vector work in the cost model."""
  refs = list(refs)
  h_ref, dy_ref = refs.pop(0), refs.pop(0)
  dh_ref = refs.pop(0) if p.has_residual else None
  s_ref = refs.pop(0) if p.has_scale else None
  saved = refs.pop(0) if saved_stats else None  # the forward's row statistics
  dx_ref = refs.pop(0)
  sum_outs = [refs.pop(0) for _ in range(int(p.has_scale) + int(p.has_bias))]  # dscale, dbias partials
  coef = refs.pop(0)  # (n_coefs, rows, 128) f32: per-row values, broadcast along the lanes
  part = refs.pop(0)  # (rows, H) f32: dx without its row-sum term
  s_rows = refs.pop(0) if s_ref is not None else None
  layer = p.kind == "layer"
  RSTD, MEAN = 0, 1  # coef rows: rstd [, mean], then the row sums of us * c [and of us]
  GC = 2 if layer else 1
  G = GC + 1
  C, W = tiling.sublane_multiple(p.dtype), STREAM_COLS
  n_cols, n_chunks, inv_h, f32 = p.hidden // W, rows // C, 1.0 / p.hidden, jnp.float32
  ragged = p.n_rows % rows != 0  # the last block's out-of-range rows hold stale VMEM (maybe NaN)
  block_start = pl.program_id(0) * rows if ragged else None

  def load(ref, at, t):
    return ref[at, pl.ds(t * W, W)].astype(f32)

  def put(n, at, v):
    coef[n, at, :] = jnp.broadcast_to(v, (C, tiling.LANES))

  def widen(v):  # (C, 128) -> (C, W)
    return jnp.concatenate([v] * (W // tiling.LANES), axis=1)

  # The scale broadcast down C rows once per step: broadcasting it at each use costs a sublane
  # rotate per vector.
  if s_rows is not None:
    for t in range(n_cols):
      s_rows[:, pl.ds(t * W, W)] = jnp.broadcast_to(s_ref[:, pl.ds(t * W, W)].astype(f32), (C, W))

  def stats(j, carry):  # (1)
    at = pl.ds(pl.multiple_of(j * C, C), C)
    for n in (GC, G) if layer else (GC,):
      put(n, at, 0.0)
    if saved is not None:
      put(RSTD, at, _get_row_stat(saved, _n_stats(p) - 1, j * C, C))
      if layer:
        put(MEAN, at, _get_row_stat(saved, 0, j * C, C))
      return carry
    mean = _row_sum([_lane_parts(load(h_ref, at, t)) for t in range(n_cols)]) * inv_h if layer else 0.0
    cc = [_lane_parts((load(h_ref, at, t) - mean) ** 2) for t in range(n_cols)]
    put(RSTD, at, lax.rsqrt(_row_sum(cc) * inv_h + p.eps))
    if layer:
      put(MEAN, at, mean)
    return carry

  _sweep_loop(n_chunks, n_cols, stats, 0)

  def slice_(t, carry):  # (2); a loop over slices (not unrolled), so no load is shared across them
    cols = pl.ds(pl.multiple_of(t * W, W), W)

    def step(j, accs):
      at = pl.ds(j * C, C)
      h, dy = h_ref[at, cols].astype(f32), dy_ref[at, cols].astype(f32)
      c = h - widen(coef[MEAN, at, :]) if layer else h
      u = dy * widen(coef[RSTD, at, :])  # serves dx (u * scale) and dscale (u * c)
      us = u * s_rows[:, cols] if s_rows is not None else u  # = g * rstd
      part[at, cols] = us + dh_ref[at, cols].astype(f32) if dh_ref is not None else us
      for n, v in zip((GC, G), [us * c] + ([us] if layer else [])):
        coef[n, at, :] += _lane_parts(v)
      terms = ([u * c] if p.has_scale else []) + ([dy] if p.has_bias else [])
      if ragged:  # keep the out-of-range rows out of the column sums
        valid = block_start + j * C + lax.broadcasted_iota(jnp.int32, (C, 1), 0) < p.n_rows
        terms = [jnp.where(valid, v, 0.0) for v in terms]
      return tuple(a + v for a, v in zip(accs, terms))

    accs = tuple(jnp.zeros((C, W), f32) for _ in sum_outs)
    for j in range(n_chunks):  # (static rows: the compiler sees that the chunks' stores do not alias)
      accs = step(j, accs)
    for out, a in zip(sum_outs, accs):
      out[:, cols] = jnp.sum(a, axis=0, keepdims=True)
    return carry

  lax.fori_loop(0, n_cols, slice_, 0)

  def finish(j, carry):  # (3): k = -rstd^3 mean(g c) = -rstd^2 sum(us c) / H
    at = pl.ds(pl.multiple_of(j * C, C), C)
    rstd = coef[RSTD, at, :]
    k = -(rstd * rstd) * (jnp.sum(coef[GC, at, :], axis=1, keepdims=True) * inv_h)
    if layer:  # (h - mean) * k - rstd * mean(g) = h * k + b
      b = widen(-coef[MEAN, at, :] * k - jnp.sum(coef[G, at, :], axis=1, keepdims=True) * inv_h)
    k = widen(k)
    for t in range(n_cols):
      cols = pl.ds(t * W, W)
      dx = part[at, cols] + load(h_ref, at, t) * k
      dx_ref[at, cols] = (dx + b if layer else dx).astype(dx_ref.dtype)
    return carry

  _sweep_loop(n_chunks, n_cols, finish, 0)


def _backward_kernel(*refs, p: _Problem, rows: int):
  refs = list(refs)
  h_ref, dy_ref = refs.pop(0), refs.pop(0)
  dh_ref = refs.pop(0) if p.has_residual else None
  s_ref = refs.pop(0) if p.has_scale else None
  dx_ref = refs.pop(0)
  sums_out = refs[:int(p.has_scale) + int(p.has_bias)]  # this step's column sums: dscale, dbias
  accs = refs[len(sums_out):] or sums_out  # their f32 accumulators (scratch; the outputs for wide rows)
  ds_ref = accs[0] if p.has_scale else None
  db_ref = accs[-1] if p.has_bias else None
  axes = tuple(range(1, len(dx_ref.shape)))  # the row: (H,) or (H/128, 128)
  wide = len(axes) == 2
  scale = s_ref[...].astype(jnp.float32) if s_ref is not None else None
  for ref in accs:
    ref[...] = jnp.zeros(ref.shape, ref.dtype)
  ragged = p.n_rows % rows != 0  # the last block's out-of-range rows hold stale VMEM (maybe NaN)
  # (read here, not in the chunk loop: interpret mode cannot lower program_id inside a fori_loop)
  block_start = pl.program_id(0) * rows if ragged else None

  def chunk(start, size):
    at = pl.ds(start, size)
    hf = h_ref[at].astype(jnp.float32)
    c = hf - jnp.mean(hf, axis=axes, keepdims=True) if p.kind == "layer" else hf
    rstd = lax.rsqrt(jnp.mean(c * c, axis=axes, keepdims=True) + p.eps)
    dy = dy_ref[at].astype(jnp.float32)
    # dx = rstd * (g - xhat * mean(g * xhat) [- mean(g)]) with xhat = c * rstd, g = dy * scale, in
    # the form with the fewest vector ops per element (the kernel is VPU-bound in the cost model).
    dyc = dy * c
    gc = jnp.mean(dyc * scale if scale is not None else dyc, axis=axes, keepdims=True)
    g = dy * scale if scale is not None else dy
    dx = g * rstd + c * (-(rstd * rstd * rstd) * gc)
    if p.kind == "layer":
      dx = dx - rstd * jnp.mean(g, axis=axes, keepdims=True)
    if dh_ref is not None:
      dx = dx + dh_ref[at].astype(jnp.float32)
    dx_ref[at] = dx.astype(dx_ref.dtype)
    if ds_ref is None and db_ref is None:
      return
    dxhat = dyc * rstd  # dy * xhat
    if ragged:  # keep the out-of-range rows (stale VMEM, maybe NaN) out of the column sums
      first = block_start + start
      valid = first + lax.broadcasted_iota(jnp.int32, (size,) + (1,) * len(axes), 0) < p.n_rows
      dy = jnp.where(valid, dy, 0.0)
      dxhat = jnp.where(valid, dxhat, 0.0)
    if ds_ref is not None:
      _accumulate(ds_ref, dxhat, wide)
    if db_ref is not None:
      _accumulate(db_ref, dy, wide)

  _for_each_chunk(rows, _chunk_rows(rows, p.hidden, p.dtype), chunk)
  if not wide:
    for out, acc in zip(sums_out, accs):
      out[...] = jnp.sum(acc[...], axis=0, keepdims=True)


def _rows_plan(p: _Problem, rows: int, backward: bool):
  """Checks a row count against the tiling rule and VMEM; returns (grid, vmem_limit)."""
  row = _row_shape(p.hidden, p.dtype)
  tiling.check_block_shape("block_sizes", (rows,) + row, (p.n_rows,) + row)
  chip = target_chip()
  params = int(p.has_scale) + int(p.has_bias)
  footprint = _vmem_bytes(rows, p.hidden, p.dtype, backward=backward, residual=p.has_residual, params=params)
  limit = tiling.vmem_limit(footprint, chip or "v5e", argument="block_sizes", value=rows)
  return (tiling.cdiv(p.n_rows, rows),), limit


def _plan(p: _Problem, blocks: BlockSizes) -> BlockSizes:
  """Rows per block of each pass: explicit rows as given (all rows if they cover them), else the
  per-generation default fitted to VMEM."""
  for name in ("rows", "backward_rows"):
    v = getattr(blocks, name)
    check(v is None or (isinstance(v, int) and not isinstance(v, bool) and v > 0), "block_sizes", blocks,
          f"{name} must be a positive int or None")
  chip = target_chip()
  default = default_block_sizes(chip.name if chip else None, p.dtype, p.hidden, p.kind, p.has_residual)
  fitted = fit_block_sizes(default, p.n_rows, p.hidden, p.dtype, residual=p.has_residual,
                           params=int(p.has_scale) + int(p.has_bias), chip=chip)
  return BlockSizes(min(blocks.rows, p.n_rows) if blocks.rows else fitted.rows,
                    min(blocks.backward_rows, p.n_rows) if blocks.backward_rows else fitted.backward_rows)


def _bytes(p: _Problem, backward: bool) -> int:
  n = p.n_rows * p.hidden * p.dtype.itemsize
  if backward:
    return n * (4 if p.has_residual else 3)
  return n * (4 if p.has_residual else 2)


# On megacore chips (v4, v5p) Mosaic shares the blocks of a "parallel" grid axis among the two
# TensorCores; no step depends on another (each writes its own output blocks and partial sums).
_SEMANTICS = ("parallel",)


def _vec_spec(p: _Problem):
  """The BlockSpec of a whole ``[H]`` parameter."""
  return pl.BlockSpec(_vec_shape(p.hidden, p.dtype), lambda i: (0, 0))


def _row_spec(p: _Problem, rows: int):
  """The BlockSpec of a block of ``rows`` rows of a ``[R, *row]`` array."""
  row = _row_shape(p.hidden, p.dtype)
  zeros = (0,) * len(row)
  return pl.BlockSpec((rows,) + row, lambda i: (i,) + zeros)


def _in_hbm(a, interpret):
  """``a`` constrained to stay in HBM (the backward kernel's row operands).

  Left free, XLA may place them in VMEM (a 16 or 64 MiB array fits in v5e's 128 MiB) without
  leaving room for the VMEM the kernel itself asks for, and the program then fails to compile
  ("Ran out of memory in memory space vmem"; seen in forward + backward programs at 8192 x 1024
  and 8192 x 4096 on v5e). The forward kernel's operands did not cause it and stay free. The
  price is what XLA's VMEM placement would have saved: the backward's operands are always read
  from HBM."""
  return a if interpret else pltpu.with_memory_space_constraint(a, pltpu.HBM)


def _stats_spec(p: _Problem, rows: int):
  """The saved statistics of a block of ``rows`` rows (a multiple of 128): see _n_stats."""
  return (pl.BlockSpec((rows // tiling.LANES, _n_stats(p), tiling.LANES), lambda i: (i, 0, 0)),
          jax.ShapeDtypeStruct((tiling.cdiv(p.n_rows, tiling.LANES), _n_stats(p), tiling.LANES), jnp.float32))


def _pallas_forward(x, r, scale, bias, *, p: _Problem, rows: int, interpret, save_stats: bool = False):
  """(y, h or None, the rows' statistics or None)."""
  grid, limit = _rows_plan(p, rows, backward=False)
  row_block = _row_spec(p, rows)
  args, in_specs = [x], [row_block]
  if p.has_residual:
    args.append(r)
    in_specs.append(row_block)
  for v in (scale, bias):
    if v is not None:
      args.append(v.reshape(_vec_shape(p.hidden, p.dtype)))
      in_specs.append(_vec_spec(p))
  # y [, h]: left where XLA puts them (constrained to HBM, the program gained a copy of y)
  out_shape = [jax.ShapeDtypeStruct(x.shape, p.dtype)] * (2 if p.has_residual else 1)
  out_specs, scratch = [row_block] * len(out_shape), []
  if save_stats:
    spec, shape = _stats_spec(p, rows)
    out_specs.append(spec)
    out_shape.append(shape)
    scratch.append(pltpu.VMEM((_n_stats(p), rows, 1), jnp.float32))
  call = calls.pallas_call(
      functools.partial(_forward_kernel, p=p, rows=rows, native_add=not interpret), grid=grid,
      in_specs=in_specs, out_specs=out_specs, out_shape=out_shape, scratch_shapes=scratch,
      compiler_params=pltpu.CompilerParams(dimension_semantics=_SEMANTICS, vmem_limit_bytes=limit),
      cost_estimate=pl.CostEstimate(flops=8 * p.n_rows * p.hidden, transcendentals=p.n_rows,
                                    bytes_accessed=_bytes(p, False)),
      interpret=interpret, name=f"{p.kind}_norm")
  outs = list(call(*args))
  return outs[0], (outs[1] if p.has_residual else None), (outs[-1] if save_stats else None)


def _column_sum(partials, p: _Problem):
  """The ``[H]`` column sum from the grid steps' partial sums (a tiny XLA reduction)."""
  return partials.sum(axis=0).reshape(p.hidden)


def _pallas_backward(h, dy, dh, scale, stats, *, p: _Problem, rows: int, interpret):
  grid, limit = _rows_plan(p, rows, backward=True)
  vec = _vec_shape(p.hidden, p.dtype)
  row_block = _row_spec(p, rows)
  args, in_specs = [_in_hbm(h, interpret), _in_hbm(dy, interpret)], [row_block] * 2
  if p.has_residual:
    args.append(_in_hbm(dh, interpret))
    in_specs.append(row_block)
  if p.has_scale:
    args.append(scale.reshape(vec))
    in_specs.append(_vec_spec(p))
  if stats is not None:
    args.append(stats)
    in_specs.append(_stats_spec(p, rows)[0])
  # dx is placed in HBM: left free, XLA put it in VMEM when a program returned it twice (as the
  # gradient of x and of the residual), next to the kernel's own VMEM, and then ran out of VMEM
  # (8192 x 4096 bf16 on v5e, v5p and v6e, compiled with the static cost model's flags set).
  # (Interpret mode has no memory spaces.)
  dx_shape = jax.ShapeDtypeStruct(h.shape, p.dtype) if interpret else pltpu.HBM(h.shape, p.dtype)
  # One f32 partial column sum per grid step: no two steps (or cores) write the same block.
  n_sums = int(p.has_scale) + int(p.has_bias)
  out_specs = [row_block] + [pl.BlockSpec((None,) + vec, lambda i: (i, 0, 0))] * n_sums
  out_shape = [dx_shape] + [jax.ShapeDtypeStruct((grid[0],) + vec, jnp.float32)] * n_sums
  wide = _wide(p.hidden, p.dtype)  # (wide rows accumulate straight into the output block)
  if _streams(p.hidden, p.dtype, rows):
    kernel = functools.partial(_backward_streamed_kernel, p=p, rows=rows, saved_stats=stats is not None)
    scratch = [pltpu.VMEM((_n_coefs(p), rows, tiling.LANES), jnp.float32),
               pltpu.VMEM((rows, p.hidden), jnp.float32)]
    if p.has_scale:
      scratch.append(pltpu.VMEM((tiling.sublane_multiple(p.dtype), p.hidden), jnp.float32))
  else:
    kernel = functools.partial(_backward_kernel, p=p, rows=rows)
    scratch = [] if wide else [pltpu.VMEM(_acc_shape(p.hidden, p.dtype), jnp.float32)] * n_sums
  call = calls.pallas_call(
      kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape, scratch_shapes=scratch,
      compiler_params=pltpu.CompilerParams(dimension_semantics=_SEMANTICS, vmem_limit_bytes=limit),
      cost_estimate=pl.CostEstimate(flops=12 * p.n_rows * p.hidden, transcendentals=p.n_rows,
                                    bytes_accessed=_bytes(p, True)),
      interpret=interpret, name=f"{p.kind}_norm_backward")
  outs = list(call(*args))
  dx = outs.pop(0)
  dscale = _column_sum(outs.pop(0), p).astype(scale.dtype) if p.has_scale else None
  return dx, dscale, outs


def _pallas_path(x, r, scale, bias, *, p: _Problem, blocks: BlockSizes, interpret):
  """The differentiable Pallas implementation on ``[rows, *row_shape]`` operands."""
  plan = _plan(p, blocks)

  save = _saves_stats(p, plan)

  @jax.custom_vjp
  def f(x, r, scale, bias):
    y, h, _ = _pallas_forward(x, r, scale, bias, p=p, rows=plan.rows, interpret=interpret)
    return y if h is None else (y, h)

  def f_fwd(x, r, scale, bias):
    y, h, stats = _pallas_forward(x, r, scale, bias, p=p, rows=plan.rows, interpret=interpret, save_stats=save)
    return (y if h is None else (y, h)), (x if h is None else h, scale, bias, stats)

  def f_bwd(res, ct):
    h, scale, bias, stats = res
    dy, dh = ct if p.has_residual else (ct, None)
    dx, dscale, rest = _pallas_backward(h, dy, dh, scale, stats, p=p, rows=plan.backward_rows,
                                        interpret=interpret)
    dbias = _column_sum(rest[0], p).astype(bias.dtype) if p.has_bias else None
    return dx, (dx if p.has_residual else None), dscale, dbias

  f.defvjp(f_fwd, f_bwd)
  return f(x, r, scale, bias)


def _split_hidden(kind, x, scale, bias, residual, eps, axes):
  """The norm of rows whose hidden axis is split over mesh ``axes`` (inside the shard_map): each
  device sums its part of each row's moments, one small ``psum`` per moment adds them up, and the
  normalisation stays local. XLA fuses it: one read for the moments, one read and write for y."""
  h = x if residual is None else _add(x, residual)
  hf = h.astype(jnp.float32)
  n = hf.shape[-1] * math.prod(lax.psum(1, a) for a in axes)
  mean = lax.psum(hf.sum(-1, keepdims=True), axes) / n if kind == "layer" else 0.0
  xc = hf - mean
  rstd = lax.rsqrt(lax.psum((xc * xc).sum(-1, keepdims=True), axes) / n + eps)
  y = xc * rstd
  if scale is not None:
    y = y * scale.astype(jnp.float32)
  if bias is not None:
    y = y + bias.astype(jnp.float32)
  y = y.astype(x.dtype)
  return y if residual is None else (y, h)


def _norm(kind, x, scale, bias, residual, eps, block_sizes, implementation, interpret):
  p = _validate(kind, x, scale, bias, residual, eps)
  rows = partition.leading_dims(x.ndim - 1) + ("embed",)
  operands = dict(x=x, residual=residual, scale=scale, bias=bias)
  dims = dict(x=rows, residual=rows, scale=("embed",), bias=("embed",))
  split = partition.plan(f"{kind}_norm", operands, dims,
                         splits={**{d: "local" for d in rows[:-1]}, "embed": "psum of the row moments"})
  if split is not None:
    def local(x, residual=None, scale=None, bias=None):
      if split.of("embed"):
        return _split_hidden(kind, x, scale, bias, residual, eps, split.of("embed"))
      return _norm(kind, x, scale, bias, residual, eps, block_sizes, implementation, interpret)
    return split.run(local, operands, dims, (rows, rows) if residual is not None else rows)
  blocks = _check_blocks(block_sizes)
  row = _row_shape(p.hidden, p.dtype)
  flat = lambda a: None if a is None else a.reshape((p.n_rows,) + row)  # noqa: E731  (free reshapes)
  unflat = lambda a: None if a is None else a.reshape(p.shape)  # noqa: E731
  out = dispatch(
      f"{kind}_norm", flat(x), flat(residual), scale, bias,
      pallas=lambda x, r, s, b, interpret: _pallas_path(x, r, s, b, p=p, blocks=blocks, interpret=interpret),
      xla=lambda x, r, s, b: jax.tree.map(flat, _reference(x.reshape(p.shape), unflat(r), s, b, p=p)),
      implementation=implementation, interpret=interpret)
  if p.has_residual:
    return out[0].reshape(p.shape), out[1].reshape(p.shape)
  return out.reshape(p.shape)


def layer_norm(x, scale=None, bias=None, *, eps=1e-6, residual=None, block_sizes=None, implementation=None,
               interpret=None):
  """Layer norm over the last axis: ``(h - mean(h)) / sqrt(var(h) + eps) * scale + bias``.

  Args:
    x: ``[..., H]``, bfloat16 or float32; any leading dimensions, any ``H``.
    scale, bias: ``[H]`` (any float dtype) or None (no scale / no bias).
    eps: a positive float added to the variance.
    residual: None, or ``[..., H]`` like ``x``: then ``h = x + residual`` (rounded to
      x's dtype) is normalised and returned too, in the same pass over memory.
    block_sizes: a :class:`BlockSizes`, an int (rows for both passes), or None for the
      per-generation default (:func:`default_block_sizes`).
    implementation, interpret: see :func:`kernels.dispatch`.

  Returns:
    ``y`` (x's shape and dtype), or ``(y, h)`` with a residual. Differentiable in
    ``x``, ``residual``, ``scale`` and ``bias`` (the backward pass is a Pallas kernel).

  Raises:
    KernelError: bad input, naming the argument, before anything is lowered.
  """
  return _norm("layer", x, scale, bias, residual, eps, block_sizes, implementation, interpret)


def rms_norm(x, scale=None, *, eps=1e-6, residual=None, block_sizes=None, implementation=None, interpret=None):
  """RMS norm over the last axis: ``h / sqrt(mean(h^2) + eps) * scale``.

  Same arguments and conventions as :func:`layer_norm` (no bias).
  """
  return _norm("rms", x, scale, None, residual, eps, block_sizes, implementation, interpret)
