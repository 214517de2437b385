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
time is the bytes it moves divided by the HBM bandwidth, so the only goals are to
move each byte once and to keep the DMA engines busy.

*Tiling.* Rows are independent. The input ``[R, H]`` (leading dimensions flattened,
a free reshape) is cut into blocks of ``rows x H``: the whole row is in VMEM, so the
statistics need no second pass over HBM. The grid is ``(cdiv(R, rows),)``, one
"parallel" axis (on v4 and v5p the two TensorCores of a megacore take half the
blocks each). A width that is not a multiple of 128 (1000, 5120 is fine, 4000) is
the block's whole last dimension, which Mosaic's tiling rule allows; nothing is
padded in HBM. A partial last row block is harmless in the forward pass: Pallas
writes back only the rows that exist.

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
before it is normalised, so the norm and the stored ``h`` agree exactly.

*Backward* (``custom_vjp``, all in one Pallas kernel). The forward saves only its
input (``h`` with a residual, else ``x``); the backward re-reads it with ``dy`` and
recomputes the row statistics (cheaper than writing and reading them, in a
memory-bound kernel). With ``xhat = (h - mean) * rstd`` and ``g = dy * scale``::

  dx     = rstd * (g - mean(g) - xhat * mean(g * xhat))      (layer norm)
  dx     = rstd * (g - xhat * mean(g * xhat))                (RMS norm)
  dscale = sum over rows of dy * xhat,   dbias = sum over rows of dy

With a residual, the cotangent of the returned ``h`` is added to ``dx`` in the kernel,
and ``x`` and ``r`` both receive it. ``dscale`` and ``dbias`` are column sums over all
rows: each grid step writes its own ``[1, H]`` f32 partial sums to a ``[blocks, 1, H]``
output (so the row axis stays "parallel" with no race between cores) and a tiny XLA
sum adds the partials. A partial last block would add stale VMEM (maybe NaN) to those
sums, so its out-of-range rows are zeroed with a select first.

*Backend choice* (:func:`kernels.dispatch`): ``implementation=None`` runs the Pallas
kernel when lowered for TPU and the reference (XLA) elsewhere.

*Estimates.* ``tools/tune_norm.py bench`` stores compiler estimates (libtpu's cost
model, not measurements) of both kernels and of XLA's jnp composition at 8192 rows in
``kernels/data/norm_bench.json``; the notebook tabulates them against the nominal HBM
roofline and against the model's own copy bandwidth (the model's HBM is about twice the
published figure, so memory-bound estimates can beat the nominal roofline). Known weak
spots there: the backward kernel spills registers (its f32 temporaries are whole
blocks) and streams below the model's copy bandwidth, and XLA's RMS norm forward is
estimated faster than this kernel's on v6e.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels import tiling
from kernels.backend import dispatch, target_chip
from kernels.errors import KernelError, TilingError, check
from kernels.hardware import get_chip

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


_TABLE_PATH = os.path.join(os.path.dirname(__file__), "data", "norm_blocks.json")
# Without a table entry: blocks of ~2 MiB of input (forward) and ~1 MiB (backward). (Compiler
# estimates, v5e, 8192 x 4096 bf16 layer norm forward: 1 MiB blocks 121.6 us, 2 MiB 110.4 us, 4 MiB 109.3 us.)
_FALLBACK_BYTES = (2 << 20, 1 << 20)


@functools.cache
def _block_table() -> dict:
  try:
    with open(_TABLE_PATH, encoding="utf-8") as fh:
      return json.load(fh).get("defaults", {})
  except FileNotFoundError:
    return {}


def _pow2_floor(n: float) -> int:
  return 1 << max(0, int(math.floor(math.log2(max(n, 1)))))


def default_block_sizes(generation=None, dtype=jnp.bfloat16, hidden: int = 4096, kind: str = "layer",
                        residual: bool = False) -> BlockSizes:
  """The shipped default rows per block for width ``hidden`` on ``generation`` (None: v5e).

  ``kernels/data/norm_blocks.json`` holds, per generation and dtype, the rows
  ``tools/tune_norm.py`` found fastest for a few widths. A call takes the nearest
  tuned width (log2 distance) and scales its rows to keep the block's bytes, rounded
  down to a power of two (at least 8). Before use, :func:`fit_block_sizes` shrinks
  them to fit VMEM.
  """
  gen = get_chip(generation).name if generation is not None else "v5e"
  entries = _block_table().get(gen, {}).get(jnp.dtype(dtype).name, [])
  entries = ([e for e in entries if e.get("kind", kind) == kind and e.get("residual", residual) == residual]
             or entries)
  if not entries:
    isz = jnp.dtype(dtype).itemsize
    return BlockSizes(*(_pow2_floor(b / (hidden * isz)) for b in _FALLBACK_BYTES))
  best = min(entries, key=lambda e: abs(math.log2(hidden / e["hidden"])))
  scale = best["hidden"] / hidden
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
  """How a ``[H]`` parameter (and a partial column sum) is laid out: ``(1, H)`` or ``(H/128, 128)``."""
  return (hidden // tiling.LANES, tiling.LANES) if _wide(hidden, dtype) else (1, hidden)


def _vmem_bytes(rows: int, hidden: int, dtype, *, backward: bool, residual: bool, params: int) -> int:
  """VMEM plan of one kernel: double-buffered blocks plus the f32 temporaries of the math."""
  block = (rows,) + _row_shape(hidden, dtype)
  big = [(block, dtype)] * ((4 if residual else 3) if backward else (4 if residual else 2))
  small = [(_vec_shape(hidden, dtype), jnp.float32)] * (params + (params if backward else 0))
  temps = [(block, jnp.float32)] * (4 if backward else 3)
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


def _normalize(hf, kind, eps, axes=(-1,)):
  """f32 rows -> (xhat, rstd): two-pass statistics over ``axes`` (the row)."""
  if kind == "layer":
    xc = hf - jnp.mean(hf, axis=axes, keepdims=True)
  else:
    xc = hf
  rstd = lax.rsqrt(jnp.mean(xc * xc, axis=axes, keepdims=True) + eps)
  return xc * rstd, rstd


def _reference(x, residual, scale, bias, *, p: _Problem):
  h = x if residual is None else _add(x, residual)
  y, _ = _normalize(h.astype(jnp.float32), p.kind, p.eps)
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


def _forward_kernel(*refs, p: _Problem):
  refs = list(refs)
  x_ref = refs.pop(0)
  r_ref = refs.pop(0) if p.has_residual else None
  s_ref = refs.pop(0) if p.has_scale else None
  b_ref = refs.pop(0) if p.has_bias else None
  y_ref = refs.pop(0)
  h = x_ref[...]
  if p.has_residual:
    h = _add(h, r_ref[...])
    refs.pop(0)[...] = h
  y, _ = _normalize(h.astype(jnp.float32), p.kind, p.eps, tuple(range(1, h.ndim)))
  if s_ref is not None:
    y = y * s_ref[...].astype(jnp.float32)
  if b_ref is not None:
    y = y + b_ref[...].astype(jnp.float32)
  y_ref[...] = y.astype(y_ref.dtype)


def _backward_kernel(*refs, p: _Problem, rows: int):
  refs = list(refs)
  h_ref, dy_ref = refs.pop(0), refs.pop(0)
  dh_ref = refs.pop(0) if p.has_residual else None
  s_ref = refs.pop(0) if p.has_scale else None
  dx_ref = refs.pop(0)
  ds_ref = refs.pop(0) if p.has_scale else None
  db_ref = refs.pop(0) if p.has_bias else None
  axes = tuple(range(1, len(h_ref.shape)))  # the row: (H,) or (H/128, 128)
  xhat, rstd = _normalize(h_ref[...].astype(jnp.float32), p.kind, p.eps, axes)
  dy = dy_ref[...].astype(jnp.float32)
  g = dy * s_ref[...].astype(jnp.float32) if s_ref is not None else dy
  gx = jnp.mean(g * xhat, axis=axes, keepdims=True)
  dx = g - xhat * gx
  if p.kind == "layer":
    dx = dx - jnp.mean(g, axis=axes, keepdims=True)
  dx = dx * rstd
  if dh_ref is not None:
    dx = dx + dh_ref[...].astype(jnp.float32)
  dx_ref[...] = dx.astype(dx_ref.dtype)
  if ds_ref is None and db_ref is None:
    return
  if p.n_rows % rows:  # the last block's out-of-range rows hold stale VMEM (maybe NaN): keep them out of the sums
    row = pl.program_id(0) * rows + lax.broadcasted_iota(jnp.int32, (rows,) + (1,) * len(axes), 0)
    valid = row < p.n_rows
    dy = jnp.where(valid, dy, 0.0)
    xhat = jnp.where(valid, xhat, 0.0)
  wide = len(axes) == 2  # partial sums: (1, H) or (H/128, 128)
  if ds_ref is not None:
    ds_ref[...] = jnp.sum(dy * xhat, axis=0, keepdims=not wide)
  if db_ref is not None:
    db_ref[...] = jnp.sum(dy, axis=0, keepdims=not wide)


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


def _specs(p: _Problem, rows: int):
  """BlockSpecs of a row block and of a whole ``[H]`` parameter."""
  row = _row_shape(p.hidden, p.dtype)
  zeros = (0,) * len(row)
  return (pl.BlockSpec((rows,) + row, lambda i: (i,) + zeros),
          pl.BlockSpec(_vec_shape(p.hidden, p.dtype), lambda i: (0, 0)))


def _pallas_forward(x, r, scale, bias, *, p: _Problem, rows: int, interpret):
  grid, limit = _rows_plan(p, rows, backward=False)
  row_block, vec_block = _specs(p, rows)
  args, in_specs = [x], [row_block]
  if p.has_residual:
    args.append(r)
    in_specs.append(row_block)
  for v in (scale, bias):
    if v is not None:
      args.append(v.reshape(_vec_shape(p.hidden, p.dtype)))
      in_specs.append(vec_block)
  out_shape = [jax.ShapeDtypeStruct(x.shape, p.dtype)] * (2 if p.has_residual else 1)
  call = pl.pallas_call(
      functools.partial(_forward_kernel, p=p), grid=grid, in_specs=in_specs,
      out_specs=[row_block] * len(out_shape), out_shape=out_shape,
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",), vmem_limit_bytes=limit),
      cost_estimate=pl.CostEstimate(flops=8 * p.n_rows * p.hidden, transcendentals=p.n_rows,
                                    bytes_accessed=_bytes(p, False)),
      interpret=interpret, name=f"{p.kind}_norm")
  outs = call(*args)
  return outs[0], (outs[1] if p.has_residual else None)


def _pallas_backward(h, dy, dh, scale, *, p: _Problem, rows: int, interpret):
  grid, limit = _rows_plan(p, rows, backward=True)
  nblocks = grid[0]
  row_block, vec_block = _specs(p, rows)
  vec = _vec_shape(p.hidden, p.dtype)
  args, in_specs = [h, dy], [row_block, row_block]
  if p.has_residual:
    args.append(dh)
    in_specs.append(row_block)
  if p.has_scale:
    args.append(scale.reshape(vec))
    in_specs.append(vec_block)
  # One f32 partial column sum per grid step: no two steps (or cores) write the same block.
  partial_block = pl.BlockSpec((None,) + vec, lambda i: (i, 0, 0))
  partial_shape = jax.ShapeDtypeStruct((nblocks,) + vec, jnp.float32)
  out_specs = [row_block] + [partial_block] * (int(p.has_scale) + int(p.has_bias))
  out_shape = [jax.ShapeDtypeStruct(h.shape, p.dtype)] + [partial_shape] * (len(out_specs) - 1)
  call = pl.pallas_call(
      functools.partial(_backward_kernel, p=p, rows=rows), grid=grid, in_specs=in_specs,
      out_specs=out_specs, out_shape=out_shape,
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",), vmem_limit_bytes=limit),
      cost_estimate=pl.CostEstimate(flops=12 * p.n_rows * p.hidden, transcendentals=p.n_rows,
                                    bytes_accessed=_bytes(p, True)),
      interpret=interpret, name=f"{p.kind}_norm_backward")
  outs = list(call(*args))
  dx = outs.pop(0)
  dscale = outs.pop(0).sum(axis=0).reshape(p.hidden).astype(scale.dtype) if p.has_scale else None
  return dx, dscale, outs


def _pallas_path(x, r, scale, bias, *, p: _Problem, blocks: BlockSizes, interpret):
  """The differentiable Pallas implementation on ``[rows, *row_shape]`` operands."""
  plan = _plan(p, blocks)

  @jax.custom_vjp
  def f(x, r, scale, bias):
    y, h = _pallas_forward(x, r, scale, bias, p=p, rows=plan.rows, interpret=interpret)
    return y if h is None else (y, h)

  def f_fwd(x, r, scale, bias):
    y, h = _pallas_forward(x, r, scale, bias, p=p, rows=plan.rows, interpret=interpret)
    return (y if h is None else (y, h)), (x if h is None else h, scale, bias)

  def f_bwd(res, ct):
    h, scale, bias = res
    dy, dh = ct if p.has_residual else (ct, None)
    dx, dscale, rest = _pallas_backward(h, dy, dh, scale, p=p, rows=plan.backward_rows, interpret=interpret)
    dbias = rest[0].sum(axis=0).reshape(p.hidden).astype(bias.dtype) if p.has_bias else None
    return dx, (dx if p.has_residual else None), dscale, dbias

  f.defvjp(f_fwd, f_bwd)
  return f(x, r, scale, bias)


def _norm(kind, x, scale, bias, residual, eps, block_sizes, implementation, interpret):
  p = _validate(kind, x, scale, bias, residual, eps)
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
