"""GEMM on the MXU: a tiled Pallas TPU matmul with a fused epilogue.

``matmul(a, b)`` computes ``dropout(act(a @ b + bias))`` in one Pallas kernel,
with in-kernel transposes, leading batch dimensions, any shape and a backward
pass; :func:`quantized_matmul` does the same for int8 (and fp8) operands with
per-row / per-column scales. :func:`matmul_reference` and
:func:`quantized_matmul_reference` are the same computations in plain JAX.

How the kernel works (the facts the notebook explains)
------------------------------------------------------

*Tiling.* The MXU multiplies tiles held in VMEM; HBM holds the operands. The
output ``C[M, N]`` is cut into ``bm x bn`` tiles and the contraction into ``bk``
slices. The grid is ``(M/bm, N/bn, K/bk)`` (plus a leading batch axis when there
are batch dimensions). At step ``(i, j, k)`` Pallas has DMA'd the tile
``A[i, k]`` (``bm x bk``) and ``B[k, j]`` (``bk x bn``) into VMEM -- while the
MXU works on the previous pair (double buffering) -- and the kernel adds
``A[i, k] @ B[k, j]`` into an f32 accumulator ``acc[bm, bn]`` in VMEM scratch.
K is the innermost, sequential ("arbitrary") grid axis, so the output tile stays
resident across it and is written to HBM once, after the last K step. When K
fits one block, consecutive steps share the A tile and Pallas skips its DMA.

*Why big blocks.* Each A tile is read ``N/bn`` times and each B tile ``M/bm``
times. One step loads ``2*bk*(bm+bn)`` bytes (bf16) and does ``2*bm*bk*bn``
FLOPs: ``bm*bn/(bm+bn)`` FLOP per byte. The step is compute bound only above the
chip's ridge point (``peak / HBM bandwidth``): ~240 FLOP/B on v5e, ~560 on v6e.
128x128 tiles give 64 (hopelessly memory bound), 512x1024 give 341 (enough on
v5e), and v6e needs 2048x2048 output tiles (1024) at 8192^3. The limits are VMEM
and the pipeline's ends: blocks are double buffered, and the first step's
A and B tiles must arrive before the MXU starts and the last output tile is
written after it stops, so very large blocks leave a visible share of a 2048^3
problem exposed. That is why the best blocks depend on the problem size.

*VMEM.* The kernel needs ``2*(bm*bk + bk*bn)*itemsize + 2*bm*bn*out_itemsize``
for the pipelined blocks, ``4*bm*bn`` for the accumulator and, for packed
(bf16/int8/fp8) inputs, one more ``bm*bk`` copy of the A tile that Mosaic makes
for the MXU (measured with AOT compiles). :func:`matmul` checks that against the
target chip before lowering (:func:`kernels.base.tiling.vmem_limit`, raising
:class:`~kernels.base.errors.VmemOverflowError`) and raises ``vmem_limit_bytes`` above
the default scoped limit when the blocks need it.

*Block sizes.* :class:`BlockSizes` ``(bm, bk, bn)``. The defaults come from
``kernels/data/matmul_blocks.json``: per generation and input dtype, a list of
problems tuned by ``tools/tune_matmul.py`` with the compiler's cost model; a call
uses the blocks of the nearest tuned problem (:func:`default_block_sizes`), fitted to
its own dimensions: each block shrinks to the smallest legal size that keeps the
number of blocks along its dimension (:func:`fit_block_sizes`), so K = 5000 runs as
two blocks of 2560, not two of 4096 with 39% of the second one padding. v4
has no cost model in libtpu: its entries are v5p's, shrunk to v4's 16 MiB VMEM.

*Accumulation.* Always f32 (int32 for int8) in VMEM. The first K step writes the
accumulator (no zero fill), middle steps add to it, and the last step adds its
product and runs the epilogue on the sum without storing it back: one cast, one
write of the output tile. When K fits one block there is no scratch at all.

*Epilogue (last K step, on the f32 tile).* ``z = acc [* a_scale * b_scale] + bias``,
``y = act(z)`` with ``act`` in ``relu``, ``gelu`` (exact, erf), ``gelu_tanh``,
``silu``; then dropout ``y * keep / (1 - rate)``. The keep mask is a counter-based
hash of ``(seed, row, column)`` (murmur3's 32-bit finaliser, see
:func:`dropout_keep_mask`): any tile computes its part of the mask without
state, and the reference and the backward pass regenerate exactly the same mask.
``row`` counts rows across the flattened batch, so every batch element gets its
own mask. The seed is drawn from ``dropout_key``.

*Transposes* never touch HBM. ``transpose_a`` makes A's block ``(bk, bm)`` with
index map ``(k, i)`` instead of ``(bm, bk)`` / ``(i, k)``, and the in-kernel
``lax.dot_general`` contracts dimension 0 instead of 1 (likewise for B). The MXU
takes a transposed right operand natively; a transposed left operand costs a
transpose of the tile in VMEM (the XLU), not a copy in HBM.

*Any shape.* Nothing is padded in HBM. A block larger than a dimension becomes
the whole dimension (allowed by Mosaic's tiling rule whatever its size); a few
rows (decode) become one packed sublane tile (16 bf16 rows). Edge blocks in M
and N are partial: Pallas reads what exists, the rows/columns beyond the edge
hold stale VMEM, and only the valid part of the output tile is written, so they
cannot leak. In K a partial last block would add garbage (maybe NaN) into real
outputs, so the last K step zeroes the out-of-range columns of A and rows of B
(a select, only on that step, only when ``K % bk != 0``).

*Arrays as XLA stores them.* XLA:TPU stores an array whose minor dimension is not a
multiple of 128 column-major when that pads fewer tiles (``[4096, 50257]``,
``[3000, 777]``; :func:`xla_lays_out_column_major`), and a Pallas call reads and
writes row-major arrays, so XLA would copy such an operand before the kernel (or
the output after it): a whole extra HBM read and write, twice the cost of a decode
step through a vocabulary projection. A default 2-D call reads a column-major
operand through its transpose (the transpose flag flipped; the transpose of a
column-major array is a bitcast) and computes a column-major output as
``C^T = op(B)^T @ op(A)^T`` (``_stored_views``). Calls with explicit blocks keep
their operand roles, and calls with a bias or dropout keep the output copy.

*Batch dimensions.* Leading dimensions broadcast like ``jnp.matmul``. When B has
none and A is not transposed, the batch is folded into M (a free reshape), so the
weights are read once per row-block, not once per batch element. Otherwise a
leading "parallel" grid axis walks the broadcast batch and each operand's index
map turns the flat batch index into its own (broadcast dimensions stay at 0).

*Megacore.* M, N (and batch) grid axes are "parallel", K is "arbitrary"; on v4
and v5p (two TensorCores per device) Mosaic splits the parallel axes between the
cores (the v5p estimate halves; see the tests).

*Backward.* ``custom_vjp``: the forward saves the pre-activation ``z`` (a second
output of the same kernel, in ``out_dtype``) when there is an activation.
Saving costs one extra ``M x N`` write and read; recomputing would cost a whole
second matmul (``2*M*N*K`` FLOPs), so saving wins whenever K is more than a few
dozen. ``dz = act'(z) * keep/(1-rate) * dy`` is elementwise (XLA), then
``dA = dz @ B^T`` and ``dB = A^T @ dz`` run on this same kernel with transpose
flags -- again with no transposed copy -- and ``dbias = sum(dz)`` over rows.
Gradients over broadcast batch dimensions are summed in f32.

*Quantized.* int8 x int8 accumulates exactly in int32; fp8 (``float8_e4m3fn``,
``float8_e5m2``) in f32. Scales are f32 blocks ``(bm, 1)`` and ``(1, bn)`` applied
in the epilogue. Mosaic lowers int8 and fp8 dots on v5e, v5p and v6e but not on
v4 (:data:`MXU_DTYPES`, from AOT compiles); only v6e has an fp8 MXU rate.

*Backend choice* (:func:`kernels.dispatch`): ``implementation=None`` runs the
Pallas kernel when lowered for TPU and the reference (XLA) elsewhere. No shape is
routed to XLA by size (``PREFER_XLA``): no shape class was found where XLA's
advantage has a physical reason that a block choice cannot remove (see *How it
compares*).

*Precision.* For f32 inputs ``precision=None``/``DEFAULT`` uses Mosaic's default
f32 matmul (bf16 passes, the speed of bf16) and ``HIGHEST`` the full-f32
contraction. Mosaic has no 3-pass mode, so ``HIGH`` is served at ``HIGHEST``
(never less precise than asked). bf16, int8 and fp8 inputs ignore ``precision``.

*libtpu's cost model* (``kernels.estimate_tpu``) runs an LLO type check that the
plain compiler does not; two code shapes that compile fine abort it, so the
kernel avoids them: the K-tail select runs on 32-bit values (fp8 through its
int8 bits), and decode blocks are whole 16-row bf16 tiles.

How it compares (the numbers are in the matmul notebook)
--------------------------------------------------------
The notebook and ``kernels/data/matmul_bench.json`` hold the figures: floored
compiler estimates (:func:`kernels.estimate_tpu`), never measurements, beside XLA
and JAX's reference Pallas matmul. The mechanisms behind them:

* Against JAX's ``pallas.ops.tpu.matmul`` at the same blocks, this kernel casts
  and stores each output tile once (JAX's kernel does both at every K step) and
  skips the accumulator's zero fill and last store.
* Where a mid-sized square (2048^3) trails XLA, the cause is the pipeline's exposed
  ends: the first A and B tiles must arrive before the MXU starts, and the last
  output tile leaves after it stops.
* Skinny and decode shapes are memory bound, so the HBM floor sets both programs'
  time. XLA's unfloored estimate looks faster there because XLA:TPU copies one
  whole entry parameter into VMEM by *cross-program prefetch* before the program
  starts and the cost model does not charge that copy; the benchmarks compile
  with ``LIBTPU_INIT_ARGS=--xla_max_cross_program_prefetches=0`` so both read
  HBM. At decode (M=16) the default blocks re-read the activation once per
  column block: a few percent more bytes than XLA, hence a few percent slower.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.base import calls
from kernels.base import partition
from kernels.base import tiling
from kernels.base.backend import dispatch, target_chip
from kernels.base.errors import KernelError, check
# The planner (kernels/_matmul_plan.py): blocks, shape classes, grid plans, stored layouts.
from kernels.gemm.plan import (  # noqa: F401  (some only re-exported, for tools and tests)
    _FALLBACK, CLASS_CAP, SKINNY, BlockSizes, _acc_dtype, _Plan, _plan, _Problem, _stored_views, default_block_sizes,
    fit_block_sizes, xla_lays_out_column_major)

__all__ = ["ACTIVATIONS", "BlockSizes", "default_block_sizes", "dropout_keep_mask", "fit_block_sizes", "matmul",
           "matmul_reference", "quantized_matmul", "quantized_matmul_reference", "xla_lays_out_column_major"]

ACTIVATIONS = (None, "relu", "gelu", "gelu_tanh", "silu")
FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
QUANT_DTYPES = (jnp.dtype(jnp.int8),) + FP8_DTYPES


# ---------------------------------------------------------------------------------
# The epilogue, shared by the kernel, the reference and the backward pass
# ---------------------------------------------------------------------------------

_SQRT_HALF = 0.7071067811865476
_SQRT_2_OVER_PI = 0.7978845608028654


def apply_activation(z, activation: str | None):
  """``act(z)`` in z's dtype (f32 in the kernel)."""
  if activation is None:
    return z
  if activation == "relu":
    return jnp.maximum(z, 0)
  if activation == "gelu":  # exact: z * Phi(z)
    return 0.5 * z * (1 + lax.erf(z * _SQRT_HALF))
  if activation == "gelu_tanh":
    return 0.5 * z * (1 + jnp.tanh(_SQRT_2_OVER_PI * (z + 0.044715 * z * z * z)))
  if activation == "silu":
    return z * jax.nn.sigmoid(z)
  raise KernelError("activation", activation, f"must be one of {ACTIVATIONS}")


def _i32(c: int):
  """The int32 with the bits of the uint32 ``c`` (the hash works in wrapping int32)."""
  return np.int32(np.uint32(c).view(np.int32))


def _fmix32(h):
  # murmur3's finaliser: every input bit flips each output bit with probability ~1/2.
  h = h ^ lax.shift_right_logical(h, jnp.int32(16))
  h = h * _i32(0x85EBCA6B)
  h = h ^ lax.shift_right_logical(h, jnp.int32(13))
  h = h * _i32(0xC2B2AE35)
  return h ^ lax.shift_right_logical(h, jnp.int32(16))


def dropout_keep_mask(seed, rows, cols, rate: float):
  """True where dropout keeps an element: a counter-based hash of ``(seed, row, col)``.

  ``seed`` is an int32 scalar, ``rows``/``cols`` int32 arrays of global indices
  (rows counted across the flattened batch). Keeps with probability ``1 - rate``
  (to 2^-24). Stateless, so kernel tiles, the reference and the backward pass
  all draw the same mask.
  """
  h = _fmix32(rows * _i32(0x9E3779B1) + seed)
  h = _fmix32(h ^ (cols * _i32(0x85EBCA77)))
  threshold = int(round(rate * (1 << 24)))
  return lax.shift_right_logical(h, jnp.int32(8)) >= threshold


def dropout_seed(key) -> jax.Array:
  """The int32 seed of the dropout hash, drawn from a JAX PRNG key."""
  if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    key = jax.random.wrap_key_data(key)
  return lax.bitcast_convert_type(jax.random.bits(key, (), jnp.uint32), jnp.int32)


def _epilogue(acc, *, bias, activation, dropout_rate, seed, rows, cols, a_scale=None, b_scale=None):
  """f32 accumulator tile -> (pre-activation z, output y), both f32."""
  z = acc.astype(jnp.float32)
  if a_scale is not None:
    z = z * a_scale.astype(jnp.float32)
  if b_scale is not None:
    z = z * b_scale.astype(jnp.float32)
  if bias is not None:
    z = z + bias.astype(jnp.float32)
  y = apply_activation(z, activation)
  if dropout_rate:
    keep = dropout_keep_mask(seed, rows, cols, dropout_rate)
    y = jnp.where(keep, y * (1.0 / (1.0 - dropout_rate)), 0.0)
  return z, y


# ---------------------------------------------------------------------------------
# Validation: every error is a KernelError naming the argument, raised before lowering
# ---------------------------------------------------------------------------------


def _precision(precision):
  if precision is None:
    return None
  if isinstance(precision, (tuple, list)):
    check(len(precision) == 2 and precision[0] == precision[1], "precision", precision,
          "per-operand precision is not supported; pass one value")
    precision = precision[0]
  try:
    p = lax.Precision(precision)
  except Exception as e:  # noqa: BLE001
    raise KernelError("precision", precision, "must be None, 'default', 'high', 'highest' or a lax.Precision") from e
  # Mosaic has no bf16_3x contraction: HIGH is served at HIGHEST (more precise, never less).
  return None if p == lax.Precision.DEFAULT else lax.Precision.HIGHEST


def _check_operand(name: str, x, dtypes, hint: str):
  check(hasattr(x, "shape") and hasattr(x, "dtype"), name, x, "must be an array")
  check(x.ndim >= 2, name, x, f"must have rank >= 2 (got rank {x.ndim}); use x[None, :] or x[:, None] for a vector")
  check(jnp.dtype(x.dtype) in dtypes, name, x,
        f"dtype {jnp.dtype(x.dtype).name} is not supported; {hint}")


def _validate(a, b, *, transpose_a, transpose_b, bias, activation, out_dtype, precision, dropout_rate,
              dropout_key, quantized=False) -> _Problem:
  if quantized:
    dtypes, hint = QUANT_DTYPES, "quantized_matmul takes int8, float8_e4m3fn or float8_e5m2"
  else:
    dtypes, hint = FLOAT_DTYPES, "matmul takes bfloat16 or float32 (int8/fp8: use quantized_matmul)"
  _check_operand("a", a, dtypes, hint)
  _check_operand("b", b, dtypes, hint)
  check(a.dtype == b.dtype, "b", b, f"must have a's dtype {jnp.dtype(a.dtype).name}; cast one operand first")
  check(isinstance(transpose_a, bool), "transpose_a", transpose_a, "must be a bool")
  check(isinstance(transpose_b, bool), "transpose_b", transpose_b, "must be a bool")

  m, k = (a.shape[-1], a.shape[-2]) if transpose_a else a.shape[-2:]
  kb, n = (b.shape[-1], b.shape[-2]) if transpose_b else b.shape[-2:]
  check(k == kb, "b", b, f"inner dimensions differ: a{'.T' if transpose_a else ''} is {m}x{k}, "
        f"b{'.T' if transpose_b else ''} is {kb}x{n}")
  check(m > 0 and k > 0 and n > 0, "a", a, "M, K and N must all be positive")
  try:
    batch = tuple(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
  except ValueError:
    raise KernelError("b", b, f"batch dimensions {tuple(b.shape[:-2])} do not broadcast with a's "
                      f"{tuple(a.shape[:-2])}") from None
  pad = lambda s: (1,) * (len(batch) - len(s)) + tuple(s)  # noqa: E731

  check(activation in ACTIVATIONS, "activation", activation, f"must be one of {ACTIVATIONS}")
  check(isinstance(dropout_rate, (int, float)) and 0 <= dropout_rate < 1, "dropout_rate", dropout_rate,
        "must be a float in [0, 1)")
  if dropout_rate:
    check(dropout_key is not None, "dropout_key", dropout_key, "is required when dropout_rate > 0")
    check(hasattr(dropout_key, "dtype") and (jnp.issubdtype(dropout_key.dtype, jax.dtypes.prng_key)
                                             or (dropout_key.dtype == jnp.uint32 and dropout_key.shape == (2,))),
          "dropout_key", dropout_key, "must be a JAX PRNG key (jax.random.key or jax.random.PRNGKey)")
  if bias is not None:
    check(hasattr(bias, "shape") and tuple(bias.shape) in ((n,), (1, n)), "bias", bias,
          f"must have shape ({n},) (one value per output column)")
    check(jnp.issubdtype(bias.dtype, jnp.floating), "bias", bias, "must be a floating-point array")

  if quantized:
    default_out = jnp.float32
  else:
    default_out = a.dtype
  out_dtype = jnp.dtype(default_out if out_dtype is None else out_dtype)
  check(out_dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)), "out_dtype", out_dtype,
        "must be bfloat16 or float32")
  prec = _precision(precision)
  return _Problem(m=int(m), k=int(k), n=int(n), batch=batch, a_batch=pad(a.shape[:-2]), b_batch=pad(b.shape[:-2]),
                  transpose_a=transpose_a, transpose_b=transpose_b, dtype=jnp.dtype(a.dtype), out_dtype=out_dtype,
                  has_bias=bias is not None, activation=activation, dropout_rate=float(dropout_rate),
                  precision=prec, quantized=quantized)


# ---------------------------------------------------------------------------------
# The reference (pure JAX): the same computation, f32 accumulation, one cast
# ---------------------------------------------------------------------------------


def _dot_dims(nd_a: int, nd_b: int, transpose_a: bool, transpose_b: bool):
  """dot_general dimension numbers for 3-D (batch, rows, cols) operands or 2-D tiles."""
  if nd_a == 3:
    return (((1 if transpose_a else 2,), (2 if transpose_b else 1,)), ((0,), (0,)))
  return (((0 if transpose_a else 1,), (1 if transpose_b else 0,)), ((), ()))


def _reference(a, b, bias, seed, a_scale, b_scale, *, p: _Problem):
  batch = p.batch

  def flat(x, own):  # (*own, r, c) -> (prod(batch), r, c); copies only an operand that broadcasts
    x = x if own == batch else jnp.broadcast_to(x.reshape(own + x.shape[-2:]), batch + x.shape[-2:])
    return x.reshape((math.prod(batch),) + x.shape[-2:])
  a3, b3 = flat(a, p.a_batch), flat(b, p.b_batch)
  acc_type = _acc_dtype(p.dtype)
  a3, b3 = calls.mxu_operands(a3, b3)
  acc = lax.dot_general(a3, b3, _dot_dims(3, 3, p.transpose_a, p.transpose_b), precision=p.precision,
                        preferred_element_type=acc_type)
  nb = acc.shape[0]
  rows = lax.broadcasted_iota(jnp.int32, (nb * p.m, p.n), 0)
  cols = lax.broadcasted_iota(jnp.int32, (nb * p.m, p.n), 1)
  if a_scale is not None:  # (prod(a_batch), M, 1) and (prod(b_batch), 1, N), see _scales
    a_scale = jnp.broadcast_to(a_scale.reshape(p.a_batch + (p.m, 1)), batch + (p.m, 1)).reshape(nb * p.m, 1)
    b_scale = jnp.broadcast_to(b_scale.reshape(p.b_batch + (1, p.n)), batch + (p.m, p.n)).reshape(nb * p.m, p.n)
  _, y = _epilogue(acc.reshape(nb * p.m, p.n), bias=None if bias is None else bias.reshape(1, p.n),
                   activation=p.activation, dropout_rate=p.dropout_rate, seed=seed, rows=rows, cols=cols,
                   a_scale=a_scale, b_scale=b_scale)
  return y.astype(p.out_dtype).reshape(batch + (p.m, p.n))


def matmul_reference(a, b, *, transpose_a=False, transpose_b=False, bias=None, activation=None, out_dtype=None,
                     precision=None, dropout_rate=0.0, dropout_key=None):
  """Pure-JAX :func:`matmul`: same arguments (minus tiling), same epilogue, same dropout mask."""
  p = _validate(a, b, transpose_a=transpose_a, transpose_b=transpose_b, bias=bias, activation=activation,
                out_dtype=out_dtype, precision=precision, dropout_rate=dropout_rate, dropout_key=dropout_key)
  seed = dropout_seed(dropout_key) if p.dropout_rate else None
  return _reference(a, b, bias, seed, None, None, p=p)


# ---------------------------------------------------------------------------------
# The Pallas kernel
# ---------------------------------------------------------------------------------


def _flat_batch_index(g, full: tuple[int, ...], own: tuple[int, ...]):
  """Flat batch index of an operand with batch shape ``own`` for output batch index ``g``."""
  if own == full:
    return g
  if math.prod(own) == 1:
    return 0
  index, own_stride, full_stride = 0, 1, 1
  for d_full, d_own in zip(reversed(full), reversed(own)):
    if d_own != 1:
      index = index + ((g // full_stride) % d_full) * own_stride
    own_stride *= d_own
    full_stride *= d_full
  return index


def _zero_tail(x, axis: int, valid: int):
  """Zeroes ``x`` from index ``valid`` on along ``axis``.

  The select runs on 32-bit values: a select on packed bf16/int8 vregs feeds the MXU
  a type libtpu's LLO checker rejects. fp8 is selected through its bits (int8, zero is
  0x00), since converting f32 back to fp8 trips the same checker on v6e.
  """
  keep = lax.broadcasted_iota(jnp.int32, x.shape, axis) < valid
  if x.dtype in FP8_DTYPES:
    bits = lax.bitcast_convert_type(x, jnp.int8)
    return lax.bitcast_convert_type(jnp.where(keep, bits.astype(jnp.int32), 0).astype(jnp.int8), x.dtype)
  wide = jnp.int32 if jnp.issubdtype(x.dtype, jnp.integer) else jnp.float32
  return jnp.where(keep, x.astype(wide), 0).astype(x.dtype)


def _kernel(*refs, p: _Problem, plan: _Plan):
  it = iter(refs)
  seed_ref = next(it) if p.dropout_rate else None
  a_ref, b_ref = next(it), next(it)
  bias_ref = next(it) if p.has_bias else None
  as_ref, bs_ref = (next(it), next(it)) if p.quantized else (None, None)
  o_ref = next(it)
  z_ref = next(it) if plan.save_z else None
  acc_ref = next(it, None)

  ids = [pl.program_id(d) for d in range(len(plan.grid))]
  g, i, j, k = ids if plan.nbatch > 1 else [0] + ids
  nk = plan.grid[-1]
  acc_dtype = _acc_dtype(p.dtype)
  dims = _dot_dims(2, 2, p.transpose_a, p.transpose_b)

  def product(masked: bool):
    x, y = a_ref[...], b_ref[...]
    if masked:  # zero the K tail of the last block (it holds stale VMEM, maybe NaN)
      valid = p.k - (nk - 1) * plan.bk
      ka = 0 if p.transpose_a else 1
      kb = 1 if p.transpose_b else 0
      x = _zero_tail(x, ka, valid)
      y = _zero_tail(y, kb, valid)
    x, y = calls.mxu_operands(x, y)
    return lax.dot_general(x, y, dims, precision=p.precision, preferred_element_type=acc_dtype)

  def finish(acc):
    shape = (plan.bm, plan.bn)
    rows = cols = seed = None
    if p.dropout_rate:
      rows = (g * p.m + i * plan.bm) + lax.broadcasted_iota(jnp.int32, shape, 0)
      cols = j * plan.bn + lax.broadcasted_iota(jnp.int32, shape, 1)
      seed = seed_ref[0]
    z, y = _epilogue(acc, bias=bias_ref[...] if p.has_bias else None, activation=p.activation,
                     dropout_rate=p.dropout_rate, seed=seed, rows=rows, cols=cols,
                     a_scale=as_ref[...] if p.quantized else None, b_scale=bs_ref[...] if p.quantized else None)
    o_ref[...] = y.astype(o_ref.dtype)
    if z_ref is not None:
      z_ref[...] = z.astype(z_ref.dtype)

  if nk == 1:  # the whole contraction in one step: no accumulator
    finish(product(plan.mask_k))
    return

  @pl.when(k == 0)
  def _first():
    acc_ref[...] = product(False)

  @pl.when(jnp.logical_and(k > 0, k < nk - 1))
  def _middle():
    acc_ref[...] += product(False)

  @pl.when(k == nk - 1)
  def _last():
    finish(acc_ref[...] + product(plan.mask_k))


def _pallas_matmul(a, b, bias, seed, a_scale, b_scale, *, p: _Problem, plan: _Plan, interpret):
  """One pallas_call. ``a``/``b`` are 3-D (own flat batch, rows, cols); the output (nbatch, M, N)."""
  bm, bk, bn = plan.bm, plan.bk, plan.bn
  batched = plan.nbatch > 1
  full = p.batch

  # Index maps get the grid indices, then the scalar-prefetch refs (the dropout seed): keep the
  # first len(grid) and name them (g, i, j, k), g = 0 without a batch axis.
  def ids(gids):
    return gids if batched else (0,) + tuple(gids)

  def a_map(*gids):
    g, i, _, k = ids(gids[:len(plan.grid)])
    ga = _flat_batch_index(g, full, p.a_batch)
    return (ga, k, i) if p.transpose_a else (ga, i, k)

  def b_map(*gids):
    g, _, j, k = ids(gids[:len(plan.grid)])
    gb = _flat_batch_index(g, full, p.b_batch)
    return (gb, j, k) if p.transpose_b else (gb, k, j)

  def o_map(*gids):
    g, i, j, _ = ids(gids[:len(plan.grid)])
    return (g, i, j)

  def col_map(*gids):
    _, _, j, _ = ids(gids[:len(plan.grid)])
    return (0, j)

  def row_map(*gids):
    g, i, _, _ = ids(gids[:len(plan.grid)])
    return (_flat_batch_index(g, full, p.a_batch), i, 0)

  def bcol_map(*gids):
    g, _, j, _ = ids(gids[:len(plan.grid)])
    return (_flat_batch_index(g, full, p.b_batch), 0, j)

  sq = pl.squeezed
  in_specs = [pl.BlockSpec((sq, bk, bm) if p.transpose_a else (sq, bm, bk), a_map),
              pl.BlockSpec((sq, bn, bk) if p.transpose_b else (sq, bk, bn), b_map)]
  args = [a, b]
  if p.has_bias:
    in_specs.append(pl.BlockSpec((1, bn), col_map))
    args.append(bias.reshape(1, p.n))
  if p.quantized:
    in_specs += [pl.BlockSpec((sq, bm, 1), row_map), pl.BlockSpec((sq, 1, bn), bcol_map)]
    args += [a_scale, b_scale]
  out_block = pl.BlockSpec((sq, bm, bn), o_map)
  out_shape = jax.ShapeDtypeStruct((plan.nbatch, p.m, p.n), p.out_dtype)
  out_specs, out_shapes = [out_block], [out_shape]
  if plan.save_z:
    out_specs.append(out_block)
    out_shapes.append(out_shape)
  acc_dtype = _acc_dtype(p.dtype)
  scratch = [pltpu.VMEM((bm, bn), acc_dtype)] if plan.grid[-1] > 1 else []

  semantics = ("parallel",) * (len(plan.grid) - 1) + ("arbitrary",)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=1 if p.dropout_rate else 0, grid=plan.grid, in_specs=in_specs,
      out_specs=out_specs, scratch_shapes=scratch)
  isz = jnp.dtype(p.dtype).itemsize
  cost = pl.CostEstimate(
      flops=2 * plan.nbatch * p.m * p.n * p.k, transcendentals=0,
      bytes_accessed=isz * (a.size + b.size) + jnp.dtype(p.out_dtype).itemsize * plan.nbatch * p.m * p.n)
  call = calls.pallas_call(
      functools.partial(_kernel, p=p, plan=plan),
      grid_spec=grid_spec, out_shape=out_shapes,
      compiler_params=pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=plan.vmem_limit),
      cost_estimate=cost, interpret=interpret, name="matmul")
  prefetch = [seed.reshape(1)] if p.dropout_rate else []
  outs = call(*prefetch, *args)
  return outs if plan.save_z else (outs[0], None)


def _as3d(x, own_batch):
  """(*batch, r, c) -> (prod(batch), r, c): a free reshape."""
  return x.reshape((math.prod(own_batch),) + x.shape[-2:])


def _plain(x, y, *, x_batch, y_batch, batch, tx, ty, dtype, out_dtype, precision, interpret):
  """``x @ y`` (3-D operands, transposes by flag, no epilogue) on the kernel: the backward's workhorse."""
  rows, k = (x.shape[-1], x.shape[-2]) if tx else x.shape[-2:]
  n = y.shape[-2] if ty else y.shape[-1]
  q = _Problem(m=rows, k=k, n=n, batch=batch, a_batch=x_batch, b_batch=y_batch, transpose_a=tx, transpose_b=ty,
               dtype=jnp.dtype(dtype), out_dtype=jnp.dtype(out_dtype), has_bias=False, activation=None,
               dropout_rate=0.0, precision=precision)
  if math.prod(y_batch) == 1 and not tx and math.prod(batch) > 1:  # fold the batch into the rows
    q = dataclasses.replace(q, m=rows * math.prod(batch), batch=(), a_batch=(), b_batch=())
    out = _plain(x.reshape(1, -1, k), y, x_batch=(), y_batch=(), batch=(), tx=False, ty=ty, dtype=dtype,
                 out_dtype=out_dtype, precision=precision, interpret=interpret)
    return out.reshape(math.prod(batch), rows, n)
  plan = _plan(q, None, save_z=False)
  return _pallas_matmul(x, y, None, None, None, None, p=q, plan=plan, interpret=interpret)[0]


def _sum_to_batch(x, full, own):
  """Sums a (prod(full), r, c) gradient over the batch dims an operand was broadcast along."""
  if own == full:
    return x
  x = x.reshape(full + x.shape[-2:])
  axes = tuple(d for d, (f, o) in enumerate(zip(full, own)) if o == 1 and f != 1)
  x = x.sum(axis=axes, keepdims=True, dtype=jnp.float32) if axes else x
  return x.reshape((math.prod(own),) + x.shape[-2:])


def _pallas_path(a, b, bias, seed, *, p: _Problem, blocks: BlockSizes | None, interpret, as_stored=False):
  """The differentiable Pallas implementation (custom_vjp around one pallas_call).

  ``as_stored`` (default blocks, 2-D operands as the caller passed them): read and write the
  arrays in the layouts XLA:TPU stores them in (``_stored_views``)."""
  if as_stored and blocks is None and not p.batch:  # caller's blocks keep the roles they were chosen for
    q, swap, flip_a, flip_b = _stored_views(p)
    if swap:
      a, b = b, a
    a = jnp.swapaxes(a, -1, -2) if flip_a else a
    b = jnp.swapaxes(b, -1, -2) if flip_b else b
    out = _pallas_path(a, b, bias, seed, p=q, blocks=None, interpret=interpret)
    return out.T if swap else out
  a3, b3 = _as3d(a, p.a_batch), _as3d(b, p.b_batch)

  def forward(a3, b3, bias, seed, save_z):
    plan = _plan(p, blocks, save_z=save_z)
    return _pallas_matmul(a3, b3, bias, seed, None, None, p=p, plan=plan, interpret=interpret)

  @jax.custom_vjp
  def f(a3, b3, bias, seed):
    return forward(a3, b3, bias, seed, False)[0]

  def f_fwd(a3, b3, bias, seed):
    y, z = forward(a3, b3, bias, seed, p.activation is not None)
    return y, (a3, b3, bias, seed, z)

  def f_bwd(res, dy):
    a3, b3, bias, seed, z = res
    dz = dy.astype(jnp.float32)
    if p.dropout_rate:  # the same hash, regenerated: no mask was stored
      rows = lax.broadcasted_iota(jnp.int32, dz.shape, 0) * p.m + lax.broadcasted_iota(jnp.int32, dz.shape, 1)
      cols = lax.broadcasted_iota(jnp.int32, dz.shape, 2)
      dz = jnp.where(dropout_keep_mask(seed, rows, cols, p.dropout_rate), dz * (1.0 / (1.0 - p.dropout_rate)), 0.0)
    if p.activation is not None:
      _, act_vjp = jax.vjp(lambda t: apply_activation(t, p.activation), z.astype(jnp.float32))
      dz = act_vjp(dz)[0]
    dbias = None if bias is None else dz.sum(axis=(0, 1)).reshape(bias.shape).astype(bias.dtype)
    g = dz.astype(p.dtype)  # the MXU takes the cotangent in the input dtype
    common = dict(batch=p.batch, dtype=p.dtype, precision=p.precision, interpret=interpret)
    reduce_a = p.a_batch != p.batch
    reduce_b = p.b_batch != p.batch
    # Z = A_eff @ B_eff with A_eff = a or a.T, B_eff = b or b.T; dA_eff = dZ @ B_eff.T, dB_eff = A_eff.T @ dZ.
    if not p.transpose_a:   # da = dZ @ B_eff.T
      da = _plain(g, b3, x_batch=p.batch, y_batch=p.b_batch, tx=False, ty=not p.transpose_b,
                  out_dtype=jnp.float32 if reduce_a else a3.dtype, **common)
    else:                   # da = (dZ @ B_eff.T).T = B_eff @ dZ.T
      da = _plain(b3, g, x_batch=p.b_batch, y_batch=p.batch, tx=p.transpose_b, ty=True,
                  out_dtype=jnp.float32 if reduce_a else a3.dtype, **common)
    if not p.transpose_b:   # db = A_eff.T @ dZ
      db = _plain(a3, g, x_batch=p.a_batch, y_batch=p.batch, tx=not p.transpose_a, ty=False,
                  out_dtype=jnp.float32 if reduce_b else b3.dtype, **common)
    else:                   # db = (A_eff.T @ dZ).T = dZ.T @ A_eff
      db = _plain(g, a3, x_batch=p.batch, y_batch=p.a_batch, tx=True, ty=p.transpose_a,
                  out_dtype=jnp.float32 if reduce_b else b3.dtype, **common)
    da = _sum_to_batch(da, p.batch, p.a_batch).astype(a3.dtype)
    db = _sum_to_batch(db, p.batch, p.b_batch).astype(b3.dtype)
    dseed = None if seed is None else np.zeros(seed.shape, jax.dtypes.float0)
    return da, db, dbias, dseed

  f.defvjp(f_fwd, f_bwd)
  return f(a3, b3, bias, seed).reshape(p.batch + (p.m, p.n))


# Backend choice for implementation=None: a reason to send work to XLA, or None. The
# kernel serves every shape on TPU: where XLA's estimate is ahead, the cause is the
# block choice or an uncharged cross-program prefetch (module docstring), not something
# only XLA can do, so no size threshold is set. Off TPU, dispatch runs the reference.
PREFER_XLA = None


def _check_blocks(block_sizes):
  if block_sizes is None or isinstance(block_sizes, BlockSizes):
    return block_sizes
  if isinstance(block_sizes, (tuple, list)) and len(block_sizes) == 3:
    return BlockSizes(*block_sizes)
  raise KernelError("block_sizes", block_sizes, "must be None, a BlockSizes or a (bm, bk, bn) tuple")


def _fold(a, b, p: _Problem):
  """A[..., M, K] @ B[K, N] with A untransposed is one (batch*M, K) @ (K, N) problem: reshape, no copy."""
  if p.transpose_a or len(p.batch) == 0 or math.prod(p.b_batch) != 1 or b.ndim != 2:
    return a, p
  rows = math.prod(p.batch) * p.m
  return a.reshape(rows, p.k), dataclasses.replace(p, m=rows, batch=(), a_batch=(), b_batch=())


# ---------------------------------------------------------------------------------
# On a mesh (kernels.base.partition)
# ---------------------------------------------------------------------------------

_MATMUL_SPLITS = {"batch": "local", "seq": "local", "features": "local",
                  "contract": "local partial products, then a psum before the epilogue"}


def _matmul_dims(a, b, transpose_a, transpose_b):
  """Logical names: a ``[..., rows, contract]``, b ``[..., contract, features]``, out ``[..., rows, features]``.
  Rows are ``batch`` for a 2-D ``a``, else ``seq`` after a's batch dims (see partition.leading_dims)."""
  lead = partition.leading_dims(a.ndim - 1)  # a's batch dims, then its rows
  rows_a = lead + ("contract",)
  if transpose_a:
    rows_a = rows_a[:-2] + rows_a[:-3:-1]
  nb = b.ndim - 2
  b_batch = lead[:-1][-nb:] if 0 < nb <= len(lead) - 1 else (None,) * nb
  dims_b = b_batch + (("features", "contract") if transpose_b else ("contract", "features"))
  return rows_a, dims_b, lead + ("features",)


def _scale_dims(s, out_dims, column: bool):
  """A quantized matmul's scale, one per row (``column=False``) or per column, in any shape it takes:
  ``()``, ``[n]``, ``[n, 1]`` / ``[1, n]``, or those after the batch dims."""
  name = out_dims[-1] if column else out_dims[-2]
  shape = tuple(getattr(s, "shape", ()))
  if not shape:
    return ()
  as_vec = len(shape) >= 2 and shape[-2 if column else -1] == 1
  k, tail = (len(shape) - 2, (None, name) if column else (name, None)) if as_vec else (len(shape) - 1, (name,))
  batch = out_dims[:-2]
  return (batch[len(batch) - k:] if k else ()) + tail


def _split(op, a, b, bias, dropout_rate, operands, dims, out_dims, local_full, local_partial, epilogue):
  """``op`` on a mesh: rows, batch and features split locally; a split contraction multiplies the
  local slices (``local_partial``: f32 partial products when an epilogue follows, else the output
  dtype), adds them up with one psum, then applies ``epilogue``."""
  split = partition.plan(op, operands, dims, splits=_MATMUL_SPLITS)
  if split is None:
    return None
  check(not (dropout_rate and split.axes), "dropout_rate", dropout_rate,
        f"{op} on a mesh cannot draw the single-device dropout mask per shard; apply dropout after the call "
        "(kernels.gemm.dropout_keep_mask)")

  def local(**kw):
    if not split.of("contract"):
      return local_full(**kw)
    return epilogue(lax.psum(local_partial(**kw), split.of("contract")), kw.get("bias"))
  return split.run(local, operands, dims, out_dims)


def _epilogue_xla(z, bias, activation, out_dtype):
  if bias is not None:
    z = z + bias.astype(jnp.float32)
  return apply_activation(z, activation).astype(out_dtype)


def matmul(a, b, *, transpose_a=False, transpose_b=False, bias=None, activation=None, out_dtype=None,
           precision=None, dropout_rate=0.0, dropout_key=None, block_sizes=None, implementation=None,
           interpret=None):
  """``dropout(act(op(a) @ op(b) + bias))`` in one Pallas TPU kernel; ``op`` transposes on request.

  Args:
    a: ``[..., M, K]`` (``[..., K, M]`` with ``transpose_a``), bfloat16 or float32.
    b: ``[..., K, N]`` (``[..., N, K]`` with ``transpose_b``), a's dtype. Batch
      dimensions of ``a`` and ``b`` broadcast like ``jnp.matmul``.
    bias: ``[N]``, added in f32 before the activation.
    activation: None, ``"relu"``, ``"gelu"`` (exact), ``"gelu_tanh"`` or ``"silu"``.
    out_dtype: bfloat16 or float32; defaults to the input dtype. Accumulation is f32.
    precision: for f32 inputs, ``None``/``"default"`` or ``"highest"`` (``"high"`` runs as highest).
    dropout_rate, dropout_key: inverted dropout after the activation; the mask is
      :func:`dropout_keep_mask` of a seed drawn from ``dropout_key``.
    block_sizes: a :class:`BlockSizes` (or ``(bm, bk, bn)``); None uses the
      per-generation default of :func:`default_block_sizes`.
    implementation, interpret: see :func:`kernels.dispatch`.

  Returns:
    ``[*batch, M, N]`` in ``out_dtype``. Differentiable in ``a``, ``b`` and ``bias``.

  Raises:
    KernelError: bad input, naming the argument, before anything is lowered.
  """
  p = _validate(a, b, transpose_a=transpose_a, transpose_b=transpose_b, bias=bias, activation=activation,
                out_dtype=out_dtype, precision=precision, dropout_rate=dropout_rate, dropout_key=dropout_key)
  blocks = _check_blocks(block_sizes)
  dims_a, dims_b, out_dims = _matmul_dims(a, b, transpose_a, transpose_b)
  kw = dict(transpose_a=transpose_a, transpose_b=transpose_b, precision=precision, block_sizes=block_sizes,
            implementation=implementation, interpret=interpret)
  split = _split("matmul", a, b, bias, p.dropout_rate, dict(a=a, b=b, bias=bias),
                 dict(a=dims_a, b=dims_b, bias=("features",)), out_dims,
                 lambda a, b, bias=None: matmul(a, b, bias=bias, activation=activation, out_dtype=out_dtype, **kw),
                 # without an epilogue, the partial products are summed in the output dtype, as XLA's
                 # partitioned a @ b does (and as XLA:TPU narrows an f32 sum followed by a cast anyway)
                 lambda a, b, bias=None: matmul(a, b, out_dtype=jnp.float32 if bias is not None or activation
                                                else out_dtype, **kw),
                 lambda z, bias: _epilogue_xla(z, bias, p.activation, p.out_dtype))
  if split is not None:
    return split
  seed = dropout_seed(dropout_key) if p.dropout_rate else None
  shape = p.batch + (p.m, p.n)
  as_stored = a.ndim == 2 and b.ndim == 2  # arrays whose TPU layout XLA picks by a known rule
  a, p = _fold(a, b, p)
  out = dispatch(
      "matmul", a, b, bias, seed,
      pallas=lambda a, b, bias, seed, interpret: _pallas_path(a, b, bias, seed, p=p, blocks=blocks,
                                                              interpret=interpret, as_stored=as_stored),
      xla=lambda a, b, bias, seed: _reference(a, b, bias, seed, None, None, p=p),
      implementation=implementation, interpret=interpret, prefer_xla=PREFER_XLA)
  return out.reshape(shape)


# ---------------------------------------------------------------------------------
# Quantized: int8 x int8 (int32 accumulation) or fp8 x fp8 (f32), scales in the epilogue
# ---------------------------------------------------------------------------------

# Input dtypes Mosaic's MXU lowering accepts, by generation (observed with AOT compiles in
# jax 0.10.2 / libtpu 0.0.42: v4 rejects int8 and fp8 right operands with
# "CompileTimeMosaicUnsupportedRhsType"). v5e and v5p have no fp8 MXU rate: Mosaic accepts
# fp8 there but it runs no faster than bf16.
MXU_DTYPES = {
    "v4": ("bfloat16", "float32"),
    "v5e": ("bfloat16", "float32", "int8", "float8_e4m3fn", "float8_e5m2"),
    "v5p": ("bfloat16", "float32", "int8", "float8_e4m3fn", "float8_e5m2"),
    "v6e": ("bfloat16", "float32", "int8", "float8_e4m3fn", "float8_e5m2"),
}


def _scale(name, s, own_batch_shape, rows: int, column: bool):
  """A per-row (``column=False``) or per-column scale as f32 (prod(batch), rows, 1) or (prod(batch), 1, cols)."""
  check(hasattr(s, "shape") and hasattr(s, "dtype") and jnp.issubdtype(s.dtype, jnp.floating), name, s,
        "must be a floating-point array")
  own = tuple(own_batch_shape)
  vec = (1, rows) if column else (rows, 1)
  allowed = [(), (rows,), vec, own + (rows,), own + vec]
  check(tuple(s.shape) in allowed, name, s,
        f"must have shape {allowed[1]} ({'one per output column' if column else 'one per output row'}), "
        f"{vec}, {own + (rows,)} or be a scalar")
  s = s.astype(jnp.float32)
  if s.shape in ((), (rows,), vec):
    s = jnp.broadcast_to(s.reshape(vec) if s.ndim else s, own + vec)
  return s.reshape((math.prod(own),) + vec)


def _quantized_inputs(a, b, a_scale, b_scale, kw):
  p = _validate(a, b, quantized=True, **kw)
  a_s = _scale("a_scale", a_scale, a.shape[:-2], p.m, column=False)
  b_s = _scale("b_scale", b_scale, b.shape[:-2], p.n, column=True)
  return p, a_s, b_s


def quantized_matmul_reference(a, b, a_scale, b_scale, *, transpose_a=False, transpose_b=False, bias=None,
                               activation=None, out_dtype=None, dropout_rate=0.0, dropout_key=None):
  """Pure-JAX :func:`quantized_matmul`."""
  kw = dict(transpose_a=transpose_a, transpose_b=transpose_b, bias=bias, activation=activation, out_dtype=out_dtype,
            precision=None, dropout_rate=dropout_rate, dropout_key=dropout_key)
  p, a_s, b_s = _quantized_inputs(a, b, a_scale, b_scale, kw)
  seed = dropout_seed(dropout_key) if p.dropout_rate else None
  return _reference(a, b, bias, seed, a_s, b_s, p=p)


def quantized_matmul(a, b, a_scale, b_scale, *, transpose_a=False, transpose_b=False, bias=None, activation=None,
                     out_dtype=None, dropout_rate=0.0, dropout_key=None, block_sizes=None, implementation=None,
                     interpret=None):
  """``dropout(act((op(a) @ op(b)) * a_scale[:, None] * b_scale[None, :] + bias))`` for quantized operands.

  ``a`` and ``b`` are both int8 (products summed exactly in int32 in VMEM) or both
  float8 (``float8_e4m3fn`` or ``float8_e5m2``, summed in f32). ``a_scale`` holds one
  dequantization scale per output row (``[M]``, ``[M, 1]``, per batch ``[..., M]``, or
  a scalar), ``b_scale`` one per output column (``[N]``, ``[1, N]``, ``[..., N]``, or a
  scalar): the usual per-token activation / per-channel weight quantization. The
  scales, bias, activation and dropout are applied in f32 at the last K step, and
  the output (default float32, or bfloat16) is written once. Not differentiable.

  Where Mosaic cannot lower the dtype for the target TPU (int8 and fp8 on v4; see
  :data:`MXU_DTYPES`) the Pallas implementation refuses: ``implementation="pallas"``
  raises a :class:`~kernels.base.errors.KernelError` naming the dtype and the generation,
  ``implementation=None`` falls back to XLA.
  """
  kw = dict(transpose_a=transpose_a, transpose_b=transpose_b, bias=bias, activation=activation, out_dtype=out_dtype,
            precision=None, dropout_rate=dropout_rate, dropout_key=dropout_key)
  p, a_s, b_s = _quantized_inputs(a, b, a_scale, b_scale, kw)
  blocks = _check_blocks(block_sizes)
  dims_a, dims_b, out_dims = _matmul_dims(a, b, transpose_a, transpose_b)
  call = dict(transpose_a=transpose_a, transpose_b=transpose_b, block_sizes=block_sizes,
              implementation=implementation, interpret=interpret)
  split = _split("quantized_matmul", a, b, bias, p.dropout_rate,
                 dict(a=a, b=b, a_scale=a_scale, b_scale=b_scale, bias=bias),
                 dict(a=dims_a, b=dims_b, a_scale=_scale_dims(a_scale, out_dims, False),
                      b_scale=_scale_dims(b_scale, out_dims, True), bias=("features",)), out_dims,
                 lambda a, b, a_scale, b_scale, bias=None: quantized_matmul(
                     a, b, a_scale, b_scale, bias=bias, activation=activation, out_dtype=out_dtype, **call),
                 lambda a, b, a_scale, b_scale, bias=None: quantized_matmul(
                     a, b, a_scale, b_scale, out_dtype=jnp.float32, **call),
                 lambda z, bias: _epilogue_xla(z, bias, p.activation, p.out_dtype))
  if split is not None:
    return split
  seed = dropout_seed(dropout_key) if p.dropout_rate else None
  shape = p.batch + (p.m, p.n)
  folded, q = _fold(a, b, p)
  if q is not p:
    a, a_s, p = folded, a_s.reshape(1, q.m, 1), q

  def pallas(a, b, bias, seed, a_s, b_s, interpret):
    chip = target_chip()
    if not interpret and chip is not None and p.dtype.name not in MXU_DTYPES.get(chip.name, ()):
      raise NotImplementedError(f"{p.dtype.name} matmul does not lower on TPU {chip.name} (Mosaic has no "
                                f"{p.dtype.name} MXU path there; supported: {', '.join(MXU_DTYPES[chip.name])})")
    plan = _plan(p, blocks, save_z=False)
    out = _pallas_matmul(_as3d(a, p.a_batch), _as3d(b, p.b_batch), bias, seed, a_s, b_s, p=p, plan=plan,
                         interpret=interpret)[0]
    return out.reshape(p.batch + (p.m, p.n))

  out = dispatch("quantized_matmul", a, b, bias, seed, a_s, b_s, pallas=pallas,
                 xla=lambda a, b, bias, seed, a_s, b_s: _reference(a, b, bias, seed, a_s, b_s, p=p),
                 implementation=implementation, interpret=interpret, prefer_xla=PREFER_XLA)
  return out.reshape(shape)
