"""Flash attention on TPU: a Pallas forward and backward with causal / window / segment masks and GQA.

``flash_attention(q, k, v)`` computes ``softmax(scale * q @ k^T + bias, masked) @ v``
one ``block_q x block_kv`` tile at a time, never materialising the ``[q_len, kv_len]``
matrix in HBM (memory O(S) per head, so 128k-token contexts fit). :func:`attention_reference`
is the same computation in plain JAX (the matrix in full), and the oracle of the tests.

How flash attention works
-------------------------

*Layouts.* ``layout="BHSD"`` (``[batch, heads, seq, head_dim]``) is the native
layout: blocks ``(block, head_dim)`` are cut straight out of the 4-D array.
``layout="BSHD"`` (``jax.nn.dot_product_attention``'s) with ``head_dim`` a multiple
of 128 is read in place too: ``[B, S, H, D]`` is reshaped (free) to ``[B, S, H*D]``
and head ``h`` is the ``h``-th 128-lane-aligned column block. With another
``head_dim`` (64, 80, 96) a BSHD call is transposed to BHSD by XLA (an HBM copy of
q, k, v and the output). A ``head_dim`` that is not a multiple of 128 is one full
block (Mosaic's tiling rule allows a block equal to the array dimension).

*Forward.* Grid ``(batch, heads, q_len/block_q, kv_len/block_kv)``, the kv axis
innermost and sequential. Each step computes ``s = q k^T`` on the MXU (f32), applies
the soft cap, bias and masks, and updates the online softmax: a running row maximum
``m``, a running denominator ``l`` and an f32 accumulator ``acc`` in VMEM scratch,
``acc = exp(m_old - m) * acc + exp(s - m) @ v``. The last kv step writes
``acc / l`` and ``lse = m + log(l)`` (an output used by the backward pass).
``scale`` is folded into the q tile (``block_q x head_dim`` multiplies instead of
``block_q x block_kv``). Three details matter to speed: ``m`` is kept lane-replicated,
``(block_q, 128)`` with the row's value in every lane, so using it against a tile is
whole-vreg copies rather than a cross-lane broadcast per step; ``l`` is kept as
``(block_q, 128)`` lane partial sums (whole-vreg adds), reduced across lanes once, at the
end, rather than once per step; and the math of a step walks its kv block in sub-blocks
of ``KV_COMPUTE`` (512) keys, so the f32 score tiles are ``block_q x 512`` (fewer live
temporaries) while the DMA block stays large (fewer grid steps).

*GQA / MQA.* ``k``/``v`` have ``kv_heads`` dividing ``heads``; q head ``h`` reads kv
head ``h // (heads / kv_heads)`` through the index map. Nothing is repeated in HBM.

*Masks.* Key ``j`` is visible to query ``i`` when all of these hold (``off = kv_len -
q_len`` aligns the last query with the last key, so a decode step's queries see the
whole cache):

* ``j < kv_len`` (the tail of the last kv block holds stale VMEM: masked, and its
  ``v`` rows are zeroed so that ``0 * NaN`` cannot reach the output);
* ``causal``: ``j <= i + off``;
* ``sliding_window=W`` with ``causal``: ``i + off - j < W`` (the query and the W-1
  keys before it). **Without** ``causal``: ``|i + off - j| < W``, a symmetric band
  of ``2W - 1`` keys centred on the query's diagonal;
* ``segment_ids``: ``q_segment[i] == kv_segment[j]``;
* ``mask`` (dense, ``True`` = attend).

*Block skipping.* Causal and window structure is known from the program ids, so a
block that it masks completely costs neither compute nor DMA: the kv index map
clamps ``j`` to ``[first, last]`` block that q block ``i`` needs (a repeated block
index makes Pallas skip the copy) and the body is guarded by ``pl.when``. Blocks
wholly inside the visible region run a branch without any mask arithmetic; only
blocks crossing a boundary (the diagonal, the window edge, the kv tail) or calls
with segment ids / a dense mask pay for the masking. Segment ids do not skip blocks.
In the forward, a causal / window block that needs masking is cut into tiles of
``MASKED_TILE`` (512) rows and keys, each of which is skipped, run unmasked or run
masked on its own: a 1024 x 1024 diagonal block does 3/4 of the work, half of it
without masking. With square blocks, q_len == kv_len, no tails and no segments / dense
mask / bias, a block's tile pattern depends only on ``j - i``, so it is worked out when
the kernel is built (:func:`_tile_patterns`): a causal diagonal block runs, per column of
tiles, as its masked diagonal tile plus one tall unmasked tile of every row below it (the
dk/dv kernel: above it), with no per-tile branch; the same holds along a window's edges.

*Folded causal grid.* With square blocks and ``q_len == kv_len`` (the common causal
case), q row ``i`` needs kv blocks ``0..i``; a plain grid spends ``nq - 1 - i`` steps
of every row skipping (~0.35 us each on a TPU, and a pipeline bubble). The forward and
dq grids instead pair row ``u`` with row ``nq - 1 - u``: ``u + 1`` steps for the
first, ``nq - u`` for the second, ``nq + 1`` in all, none skipped. The dk/dv grid
pairs kv blocks the same way, with the GQA group innermost. With a sliding window the
forward and dq grids walk only the ``band`` kv blocks a q block can need, from its
first one on, rather than every kv block with most of them skipped.

*Fully masked rows* (a query with no visible key: ``q_len > kv_len`` with causal,
segments that match nothing, a mask row of ``False``) give output 0, gradient 0
and ``lse = -inf``: the running maximum starts at ``-inf`` and a row whose maximum
is still ``-inf`` subtracts 0 instead, so ``exp`` gives 0, never NaN.

*Sinks* (gpt-oss): a learned per-head logit that joins the softmax denominator but
has no value vector. The online softmax starts from ``m = sink, l = 1`` instead of
``m = -inf, l = 0``; rows then never are fully masked (``lse >= sink``). Its
gradient, ``-sum_i exp(sink - lse_i) * D_i``, is computed in XLA.

*Dropout* on the attention probabilities: ``keep = dropout_keep_mask(seed, row, key)``,
the counter-based hash of :mod:`kernels.matmul`, with ``row = (b * heads + h) *
q_len + i``. The denominator ``l`` sums the probabilities before dropout.

*Backward* (``custom_vjp``). The forward saves ``lse``; ``D = rowsum(dO * O)`` is one
XLA reduction. Two kernels (one when dq is fused, see below):

* dk/dv: grid ``(batch, kv_heads, kv_len/block_kv, group, q_len/block_q)`` (folded when
  causal, see above); the two inner axes walk the q blocks of every q head in the
  group, so dk and dv are summed over the GQA group in VMEM without races. It computes the transposed tile
  ``s^T = k q^T`` (``block_kv x block_q``), which keeps every matmul in the MXU's
  native form (``p^T dO``, ``v dO^T``, ``ds^T q``) and puts ``lse`` and ``D`` on the
  lane axis, as stored.
* dq: the forward's grid, ``dq += ds k``, when not fused (below).

Both skip the blocks the forward skips (the dk/dv index maps clamp the q block).
*Fused dq* (``_Plan.fused_dq``): when the group's f32 dq (``group x q_len x D``) and
its output block fit ``FUSED_DQ_VMEM`` (1/8) of the chip's VMEM, the dk/dv kernel
also adds ``ds^T k`` (``dq += ds k`` from the transposed tile it holds) into a VMEM
accumulator of all the group's q rows and writes dq at the last step of each (batch,
kv head); its kv-block axis is then sequential. The exponentials and the ``s`` and
``dp`` matmuls are then not recomputed by a dq kernel, and q, k, v and dO are not read
a second time. Longer sequences and a bias (whose gradient the dq kernel writes) use
the dq kernel.

*bf16 exponentials on v6e* (its EUP has a bf16 path; v4 and v5 do not) are
implemented for bf16 inputs without dropout (the probabilities go to the MXU in
bf16 anyway; the row sums stay f32) and tested in interpret mode, but off
(``_EXP_BF16``): libtpu's cost model aborts on them, so their speed is unknown.

*Block sizes.* :class:`BlockSizes` ``(block_q, block_kv, block_q_bwd, block_kv_bwd)``;
the defaults per generation come from ``kernels/data/attention_blocks.json``,
written by ``tools/tune_attention.py`` from compiler estimates (the forward: causal
and non-causal at S=8192); without an entry, 1024/1024 forward and 512/512 backward
(512 throughout on v4, 16 MiB of VMEM). Large blocks cost a causal kernel little,
since the masked tiles skip most of a diagonal block, and they mean fewer grid steps
and fewer re-reads of K and V (which are read once per q block).

*What libtpu's cost model cannot see.* It evaluates a scalar ``lax.div`` / ``lax.rem``
as 0. The skip tests are therefore products and comparisons (:func:`_tile_needed`),
the block ranges of the index maps shift when the block is a power of two
(:func:`_floor_div`), and the dk/dv grid has separate group and q-block axes rather
than a divided one. With a division in a block range the model charges one kv block
per causal q row, and a causal estimate comes out faster than the roofline allows.

*libtpu's cost model* (``kernels.estimate_tpu``) aborts the process on some code
shapes that compile fine, so the kernels avoid them: a single block shorter than
its tile (q_len = 1000 in bf16) is rounded up to whole (16, 128) tiles and masked;
the sinks and the dropout seed are (8, 128) VMEM tiles, not SMEM scalars. The
forward with dropout still aborts it (compiles, cannot be estimated), and one
backward (S=2048, GQA, BSHD, 512 blocks) aborted it once in a test run.

*Estimates.* Compiler estimates of this kernel (libtpu's cost model via
:func:`kernels.estimate_tpu`) against XLA, JAX's Pallas flash attention and splash are
stored in ``kernels/data/attention_bench.json`` (``tools/bench_attention.py``) and
``attention_blocks.json`` (``tools/tune_attention.py``); the flash-attention notebook
tabulates them against the roofline.
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

from kernels import tiling
from kernels.backend import dispatch, target_chip
from kernels.hardware import get_chip
from kernels.errors import KernelError, TilingError, check
from kernels.matmul import dropout_keep_mask, dropout_seed

__all__ = ["BlockSizes", "attention_reference", "default_block_sizes", "flash_attention"]

LAYOUTS = ("BSHD", "BHSD")
FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
_NT = (((1,), (1,)), ((), ()))   # a @ b.T
_NN = (((1,), (0,)), ((), ()))   # a @ b
_TN = (((0,), (0,)), ((), ()))   # a.T @ b
NEG_INF = -float("inf")


# ---------------------------------------------------------------------------------
# Block sizes
# ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tiles of the forward (``block_q x block_kv``) and of both backward kernels.

  ``block_kv`` (the lane axis of the score tile) and both backward blocks must be
  multiples of 128, ``block_q`` a multiple of 8 (16 for bf16). A block at least as
  long as its sequence becomes the sequence rounded up to that multiple (the tail
  is masked).
  """

  block_q: int = 512
  block_kv: int = 512
  block_q_bwd: int = 512
  block_kv_bwd: int = 512

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


# Used when the table lacks the generation: 1024 x 1024 forward tiles (fewer grid steps and
# fewer re-reads of K and V than 512-row blocks), 512 x 512 backward (more live f32 temporaries
# per tile); v4's 16 MiB of VMEM takes 512 x 512 tiles throughout.
_FALLBACK = BlockSizes(1024, 1024, 512, 512)
_FALLBACK_SMALL_VMEM = BlockSizes(512, 512, 512, 512)


def default_block_sizes(generation=None, dtype=jnp.bfloat16, head_dim: int = 128) -> BlockSizes:
  """The shipped defaults for ``generation`` (None: v5e), from ``kernels/data/attention_blocks.json``."""
  gen = generation or "v5e"
  per_gen = tiling.block_table("attention").get(gen, {})
  entry = per_gen.get(jnp.dtype(dtype).name)
  if entry is None:
    entry = per_gen.get("bfloat16")
  if not entry:
    entry = dataclasses.asdict(_FALLBACK_SMALL_VMEM if gen == "v4" else _FALLBACK)
  fields = {f.name for f in dataclasses.fields(BlockSizes)}
  blocks = BlockSizes(**{k: v for k, v in entry.items() if k in fields})
  if head_dim > 128 and jnp.dtype(dtype).itemsize == 4:  # f32 and a wide head: halve the tiles' VMEM
    blocks = BlockSizes(*(max(128, b // 2) for b in dataclasses.astuple(blocks)))
  return blocks


# ---------------------------------------------------------------------------------
# Validation
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


def _is_array(x):
  return hasattr(x, "shape") and hasattr(x, "dtype")


def _validate(q, k, v, *, causal, segment_ids, sliding_window, logits_soft_cap, scale, bias, mask, sinks,
              dropout_rate, dropout_key, layout) -> tuple[_Problem, Any, Any]:
  check(layout in LAYOUTS, "layout", layout, f"must be one of {LAYOUTS}")
  for name, x in (("q", q), ("k", k), ("v", v)):
    check(_is_array(x), name, x, "must be an array")
    check(x.ndim == 4, name, x, f"must have rank 4 ([batch, {'seq, heads' if layout == 'BSHD' else 'heads, seq'}, "
          f"head_dim] for layout={layout!r}), got rank {x.ndim}")
    check(jnp.dtype(x.dtype) in FLOAT_DTYPES, name, x,
          f"dtype {jnp.dtype(x.dtype).name} is not supported; use bfloat16 or float32")
  check(k.dtype == q.dtype, "k", k, f"must have q's dtype {jnp.dtype(q.dtype).name}")
  check(v.dtype == q.dtype, "v", v, f"must have q's dtype {jnp.dtype(q.dtype).name}")
  if layout == "BSHD":
    (b, sq, h, d), (bk, skv, kvh, dk), (bv, sv, hv, dv) = q.shape, k.shape, v.shape
  else:
    (b, h, sq, d), (bk, kvh, skv, dk), (bv, hv, sv, dv) = q.shape, k.shape, v.shape
  check(min(b, sq, h, d) > 0, "q", q, "every dimension must be positive")
  check(bk == b, "k", k, f"batch {bk} differs from q's {b}")
  check(dk == d, "k", k, f"head_dim {dk} differs from q's {d}")
  check(skv > 0 and kvh > 0, "k", k, "every dimension must be positive")
  check(h % kvh == 0, "k", k, f"kv heads ({kvh}) must divide q heads ({h}) (GQA/MQA)")
  check((bv, sv, hv) == (b, skv, kvh), "v", v, f"must match k's batch, kv_len and kv heads {(b, skv, kvh)}")
  check(dv == d, "v", v, f"head_dim {dv} differs from q's {d} (this kernel needs equal head dims)")
  check(isinstance(causal, bool), "causal", causal, "must be a bool")

  window = None
  if sliding_window is not None:
    check(isinstance(sliding_window, (int, np.integer)) and not isinstance(sliding_window, bool)
          and sliding_window > 0, "sliding_window", sliding_window, "must be a positive int (or None)")
    window = int(sliding_window)
  softcap = None
  if logits_soft_cap is not None:
    check(isinstance(logits_soft_cap, (int, float)) and logits_soft_cap > 0, "logits_soft_cap", logits_soft_cap,
          "must be a positive number (or None)")
    softcap = float(logits_soft_cap)
  if scale is None:
    scale = 1.0 / math.sqrt(d)
  check(isinstance(scale, (int, float)) and math.isfinite(scale), "scale", scale, "must be a finite number")

  seg_q = seg_kv = None
  if segment_ids is not None:
    if isinstance(segment_ids, (tuple, list)):
      check(len(segment_ids) == 2, "segment_ids", segment_ids, "must be one array or a (q, kv) pair")
      seg_q, seg_kv = segment_ids
    else:
      check(sq == skv, "segment_ids", segment_ids,
            f"one array serves self-attention only (q_len {sq} != kv_len {skv}); pass (q_segment_ids, kv_segment_ids)")
      seg_q = seg_kv = segment_ids
    for x, n in ((seg_q, sq), (seg_kv, skv)):
      check(_is_array(x) and tuple(x.shape) == (b, n), "segment_ids", x, f"must have shape {(b, n)} ([batch, seq])")
      check(jnp.issubdtype(x.dtype, jnp.integer), "segment_ids", x, "must be an integer array")

  def dense(name, x, floating):
    if x is None:
      return None
    check(_is_array(x) and x.ndim == 4, name, x, f"must be a rank-4 array [batch or 1, heads or 1, {sq}, {skv}]")
    ok = x.shape[0] in (1, b) and x.shape[1] in (1, h) and tuple(x.shape[2:]) == (sq, skv)
    check(ok, name, x, f"must have shape [{b} or 1, {h} or 1, {sq}, {skv}] ([batch, heads, q_len, kv_len])")
    if floating:
      check(jnp.issubdtype(x.dtype, jnp.floating), name, x, "must be a floating-point array")
    else:
      check(x.dtype == jnp.bool_, name, x, "must be a boolean array (True = attend)")
    return (int(x.shape[0]), int(x.shape[1]))

  mask_shape = dense("mask", mask, False)
  bias_shape = dense("bias", bias, True)
  if sinks is not None:
    check(_is_array(sinks) and tuple(sinks.shape) == (h,), "sinks", sinks, f"must have shape ({h},), one per q head")
    check(jnp.issubdtype(sinks.dtype, jnp.floating), "sinks", sinks, "must be a floating-point array")
  check(isinstance(dropout_rate, (int, float)) and 0 <= dropout_rate < 1, "dropout_rate", dropout_rate,
        "must be a float in [0, 1)")
  if dropout_rate:
    check(dropout_key is not None, "dropout_key", dropout_key, "is required when dropout_rate > 0")
    check(_is_array(dropout_key) and (jnp.issubdtype(dropout_key.dtype, jax.dtypes.prng_key)
                                      or (dropout_key.dtype == jnp.uint32 and dropout_key.shape == (2,))),
          "dropout_key", dropout_key, "must be a JAX PRNG key (jax.random.key or jax.random.PRNGKey)")
  p = _Problem(b=int(b), h=int(h), kvh=int(kvh), sq=int(sq), skv=int(skv), d=int(d), dtype=jnp.dtype(q.dtype),
               layout=layout, causal=causal, window=window, softcap=softcap, scale=float(scale),
               segments=segment_ids is not None, mask_shape=mask_shape, bias_shape=bias_shape,
               sinks=sinks is not None, dropout_rate=float(dropout_rate))
  return p, seg_q, seg_kv


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
# Reference (pure JAX)
# ---------------------------------------------------------------------------------


def _to_bhsd(x, layout):
  return jnp.swapaxes(x, 1, 2) if layout == "BSHD" else x


def _reference(q, k, v, sinks, bias, seg_q, seg_kv, mask, seed, *, p: _Problem):
  """Canonical BHSD in, (out BHSD in q's dtype, lse [B, H, Sq] f32) out."""
  q5 = q.reshape(p.b, p.kvh, p.group, p.sq, p.d)
  s = jnp.einsum("bkgqd,bksd->bkgqs", q5, k, preferred_element_type=jnp.float32) * p.scale
  s = _soft_cap(s, p.softcap)
  s = s.reshape(p.b, p.h, p.sq, p.skv)
  if bias is not None:
    s = s + bias.astype(jnp.float32)
  qpos = lax.broadcasted_iota(jnp.int32, (p.sq, p.skv), 0)
  kpos = lax.broadcasted_iota(jnp.int32, (p.sq, p.skv), 1)
  vis = _visible(p, qpos, kpos)
  vis = jnp.ones((1, 1, p.sq, p.skv), bool) if vis is None else vis[None, None]
  if seg_q is not None:
    vis = vis & (seg_q[:, None, :, None] == seg_kv[:, None, None, :])
  if mask is not None:
    vis = vis & mask
  s = jnp.where(vis, s, NEG_INF)
  m = jnp.max(s, axis=-1, keepdims=True)
  if sinks is not None:
    m = jnp.maximum(m, sinks.astype(jnp.float32)[None, :, None, None])
  m = lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
  e = jnp.exp(s - m)
  l = e.sum(axis=-1, keepdims=True)
  if sinks is not None:
    l = l + jnp.exp(sinks.astype(jnp.float32)[None, :, None, None] - m)
  safe_l = jnp.where(l > 0, l, 1.0)
  lse = jnp.where(l > 0, m + jnp.log(safe_l), NEG_INF)[..., 0]
  probs = e / safe_l
  if p.dropout_rate:
    rows = _dropout_rows(p, lax.broadcasted_iota(jnp.int32, s.shape, 0), lax.broadcasted_iota(jnp.int32, s.shape, 1),
                         lax.broadcasted_iota(jnp.int32, s.shape, 2))
    keep = dropout_keep_mask(seed, rows, lax.broadcasted_iota(jnp.int32, s.shape, 3), p.dropout_rate)
    probs = jnp.where(keep, probs * (1.0 / (1.0 - p.dropout_rate)), 0.0)
  probs = probs.astype(v.dtype).reshape(p.b, p.kvh, p.group, p.sq, p.skv)
  out = jnp.einsum("bkgqs,bksd->bkgqd", probs, v, preferred_element_type=jnp.float32)
  return out.reshape(p.b, p.h, p.sq, p.d).astype(q.dtype), lse


def _finish(out, lse, p: _Problem, return_residuals):
  out = _to_bhsd(out, p.layout)  # BHSD -> the caller's layout (the swap is its own inverse)
  return (out, lse) if return_residuals else out


def attention_reference(q, k, v, *, causal=False, segment_ids=None, sliding_window=None, logits_soft_cap=None,
                        scale=None, bias=None, mask=None, sinks=None, dropout_rate=0.0, dropout_key=None,
                        layout="BSHD", return_residuals=False):
  """Pure-JAX :func:`flash_attention`: the whole ``[q_len, kv_len]`` logit matrix in f32, same masks and dropout."""
  p, seg_q, seg_kv = _validate(q, k, v, causal=causal, segment_ids=segment_ids, sliding_window=sliding_window,
                               logits_soft_cap=logits_soft_cap, scale=scale, bias=bias, mask=mask, sinks=sinks,
                               dropout_rate=dropout_rate, dropout_key=dropout_key, layout=layout)
  seed = dropout_seed(dropout_key) if p.dropout_rate else None
  out, lse = _reference(_to_bhsd(q, layout), _to_bhsd(k, layout), _to_bhsd(v, layout), sinks, bias, seg_q, seg_kv,
                        mask, seed, p=p)
  return _finish(out, lse, p, return_residuals)


# ---------------------------------------------------------------------------------
# The Pallas kernels
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


def _kv_compute(bkv: int) -> int:
  """Keys per sub-block of the forward's math in a kv block of ``bkv`` keys."""
  return KV_COMPUTE if bkv % KV_COMPUTE == 0 else bkv


# The forward cuts a causal / window block that needs masking into tiles of at most this many
# rows and keys: most of a diagonal block is then either skipped or run without mask arithmetic.
MASKED_TILE = 512


def _masked_tile(block: int) -> int:
  return MASKED_TILE if block % MASKED_TILE == 0 else block


def _plan(p: _Problem, blocks: BlockSizes | None, backward: bool) -> _Plan:
  chip = target_chip()
  if blocks is None:
    blocks = default_block_sizes(chip.name if chip else None, p.dtype, p.d)
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
    limit = _vmem(p, max(bq, bkv), max(bq, bkv), 2, 2, 2, blocks, extra=dq_bytes if fused_dq else 0, temps=8)
  else:
    bq = _fit(blocks.block_q, p.sq, tiling.sublane_multiple(p.dtype), "block_q", blocks)
    bkv = _fit(blocks.block_kv, p.skv, 128, "block_kv", blocks)
    limit = _vmem(p, bq, bkv, 2, 2, 1, blocks, temp_cols=_kv_compute(bkv))
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
               *patterns, fused_dq)


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


_LANES = 128  # m is kept lane-replicated and l as lane partial sums, (bq, 128): no cross-lane op per step


def _lanes(x, n: int):
  """A lane-replicated ``(rows, 128)`` array as ``(rows, n)``: whole-vreg copies (n a multiple of
  128) or a lane slice, never a cross-lane broadcast."""
  if n == x.shape[1]:
    return x
  if n % x.shape[1] == 0:
    return jnp.tile(x, (1, n // x.shape[1]))
  return x[:, :n] if n < x.shape[1] else jnp.broadcast_to(x[:, :1], (x.shape[0], n))


def _lane_partials(x):
  """``(rows, n)`` -> ``(rows, 128)``: the sum of its 128-lane column groups (whole-vreg adds).
  The forward keeps the softmax denominator as such lane partial sums and reduces across
  lanes once, at the end, instead of a cross-lane sum (XLU work) per kv sub-block."""
  out = x[:, :_LANES]
  for c in range(1, x.shape[1] // _LANES):
    out = out + x[:, c * _LANES:(c + 1) * _LANES]
  return out


def _scaled_q(q_ref, scale):
  return _scaled_q_rows(q_ref, slice(None), scale)


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


def _fwd_kernel(*refs, p: _Problem, plan: _Plan, names):
  r = _Refs(refs, names)
  b, h, i, j, first, last, active = _q_major_ids(p, plan, [pl.program_id(a) for a in range(4)])
  bq, bkv = plan.bq, plan.bkv

  @pl.when(first)
  def _init():
    if p.sinks:
      r.m[...] = jnp.broadcast_to(r.sinks[0:1, 0:1], r.m.shape)
      r.l[...] = jnp.where(lax.broadcasted_iota(jnp.int32, r.l.shape, 1) == 0, 1.0, 0.0)  # sums to 1
    else:
      r.m[...] = jnp.full(r.m.shape, NEG_INF, jnp.float32)
      r.l[...] = jnp.zeros(r.l.shape, jnp.float32)
    r.acc[...] = jnp.zeros(r.acc.shape, jnp.float32)
    r.qs[...] = _scaled_q(r.q, p.scale)  # the q block stays the same along the kv axis: scale it once

  def tile(rows, cols, masked: bool):
    """The online-softmax update of q rows ``rows`` by keys ``cols`` of the kv block (static slices)."""
    q = r.qs[rows, :]
    k, v = r.k[cols, :], r.v[cols, :]
    nr, bkc = q.shape[0], k.shape[0]
    k0 = j * bkv + cols.start  # first key of the tile
    if masked and p.skv % bkv:
      k = _zero_rows(k, p.skv - k0)
      v = _zero_rows(v, p.skv - k0)
    s = lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32)
    s = _soft_cap(s, p.softcap)
    if p.bias_shape is not None:
      s = s + r.bias[rows, cols].astype(jnp.float32)
    qpos = i * bq + rows.start + lax.broadcasted_iota(jnp.int32, (nr, 1), 0)
    kpos = k0 + lax.broadcasted_iota(jnp.int32, (1, bkc), 1)
    if masked:
      s = jnp.where(_visibility_tile(p, r, qpos, kpos, b, h, i, cols, rows), s, NEG_INF)
    m_prev = r.m[rows, :]  # (rows, 128): the row's value in every lane
    m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
    # a row with nothing visible yet keeps m = -inf: subtract 0 so exp gives 0, not NaN
    m_use = jnp.where(m_new == NEG_INF, 0.0, m_new) if masked else m_new
    m_wide = _lanes(m_use, bkc)
    if plan.exp_bf16:  # bf16 in, bf16 out: the probabilities go to the MXU in bf16 anyway
      e = jnp.exp((s - m_wide).astype(jnp.bfloat16))
      part = _lane_partials(e.astype(jnp.float32))
    else:
      e = jnp.exp(s - m_wide)
      part = _lane_partials(e)
    alpha = jnp.exp(m_prev - m_use)
    r.l[rows, :] = alpha * r.l[rows, :] + part
    if p.dropout_rate:
      keep = _keep_tile(p, r.seed[0:1, 0:1], b, h, qpos, kpos)
      e = jnp.where(keep, e * (1.0 / (1.0 - p.dropout_rate)), 0.0)
    r.acc[rows, :] = _lanes(alpha, p.d) * r.acc[rows, :] + lax.dot_general(
        e.astype(v.dtype), v, _NN, preferred_element_type=jnp.float32)
    r.m[rows, :] = m_new

  def step(masked: bool):
    # kv sub-blocks: smaller f32 temporaries, same DMA block
    bkc = plan.bkv_compute
    if not masked or (plan.bq_masked, plan.bkv_masked) == (bq, bkc):
      for c in range(bkv // bkc):
        tile(pl.ds(0, bq), pl.ds(c * bkc, bkc), masked)
      return
    # A block crossing the causal diagonal / window edge: cut it into (bq_masked, bkv_masked)
    # tiles, each skipped, run unmasked or run masked on its own (a 1024 x 1024 diagonal block
    # in 512 x 512 tiles: one skipped, one unmasked, two masked).
    _masked_tiles(p, plan, i, j, plan.bq_masked, plan.bkv_masked, tile)

  if plan.folded or plan.band:
    needed = active
  elif p.skips:
    needed = _block_needed(p, bq, bkv, i, j)
  else:
    needed = True
  _branches(needed, _full_block(p, bq, bkv, i, j, q_tail=False), step)

  @pl.when(last)
  def _finish():
    l = r.l[...].sum(axis=1, keepdims=True)  # the lane partial sums -> the row's denominator
    r.o[...] = (r.acc[...] / jnp.broadcast_to(jnp.where(l > 0, l, 1.0), r.acc.shape)).astype(r.o.dtype)
    m = r.m[:, :1]
    r.lse[...] = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), NEG_INF)


def _dq_kernel(*refs, p: _Problem, plan: _Plan, names):
  r = _Refs(refs, names)
  b, h, i, j, first, last, active = _q_major_ids(p, plan, [pl.program_id(a) for a in range(4)])
  bq, bkv = plan.bq, plan.bkv

  @pl.when(first)
  def _init():
    r.acc[...] = jnp.zeros(r.acc.shape, jnp.float32)

  def tile(rows, cols, masked: bool):
    """dq of q rows ``rows`` from keys ``cols`` of the kv block (static slices)."""
    q = _scaled_q_rows(r.q, rows, p.scale)
    k, v, do = r.k[cols, :], r.v[cols, :], r.do[rows, :]
    nr, nc = q.shape[0], k.shape[0]
    k0 = j * bkv + cols.start
    if masked and p.skv % bkv:
      k = _zero_rows(k, p.skv - k0)
      v = _zero_rows(v, p.skv - k0)
    s = lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32)
    t = None
    if p.softcap is not None:
      t = jnp.tanh(s * (1.0 / p.softcap))
      s = p.softcap * t
    if p.bias_shape is not None:
      s = s + r.bias[rows, cols].astype(jnp.float32)
    qpos = i * bq + rows.start + lax.broadcasted_iota(jnp.int32, (nr, 1), 0)
    kpos = k0 + lax.broadcasted_iota(jnp.int32, (1, nc), 1)
    if masked:
      s = jnp.where(_visibility_tile(p, r, qpos, kpos, b, h, i, cols, rows), s, NEG_INF)
    e = jnp.exp(s - r.lse[rows, :])   # lse of a row with nothing visible is +inf here (see f_bwd): e = 0
    dp = lax.dot_general(do, v, _NT, preferred_element_type=jnp.float32)
    if p.dropout_rate:
      keep = _keep_tile(p, r.seed[0:1, 0:1], b, h, qpos, kpos)
      dp = jnp.where(keep, dp * (1.0 / (1.0 - p.dropout_rate)), 0.0)
    ds = e * (dp - r.delta[rows, :])
    if p.bias_shape is not None:
      r.dbias[rows, cols] = ds
    if t is not None:
      ds = ds * (1.0 - t * t)
    r.acc[rows, :] += lax.dot_general(ds.astype(k.dtype), k, _NN, preferred_element_type=jnp.float32)

  def step(masked: bool):
    if masked and plan.bq_masked:
      _masked_tiles(p, plan, i, j, plan.bq_masked, plan.bkv_masked, tile)
    else:
      tile(pl.ds(0, bq), pl.ds(0, bkv), masked)

  if plan.folded or plan.band:
    needed = active
  elif p.skips:
    needed = _block_needed(p, bq, bkv, i, j)
    if p.bias_shape is not None:  # the bias gradient tile of a skipped block is zero
      @pl.when(jnp.logical_not(needed))
      def _zero():
        r.dbias[...] = jnp.zeros(r.dbias.shape, r.dbias.dtype)
  else:
    needed = True
  _branches(needed, _full_block(p, bq, bkv, i, j, q_tail=False), step)

  @pl.when(last)
  def _finish():
    r.dq[...] = (r.acc[...] * p.scale).astype(r.dq.dtype)


def _dkv_kernel(*refs, p: _Problem, plan: _Plan, names):
  r = _Refs(refs, names)
  b, kh, j, g, i, first, last, active = _kv_major_ids(p, plan, [pl.program_id(a) for a in range(5)])
  h = kh * p.group + g
  bq, bkv = plan.bq, plan.bkv

  @pl.when(first)
  def _init():
    r.dk_acc[...] = jnp.zeros(r.dk_acc.shape, jnp.float32)
    r.dv_acc[...] = jnp.zeros(r.dv_acc.shape, jnp.float32)

  if plan.fused_dq:  # dq of the whole group accumulates over every step of one (batch, kv head)
    inner = [pl.program_id(a) for a in (2, 3, 4)]
    sizes = _kv_major_grid(p, plan)[2:]
    slab_first = _all([x == 0 for x in inner])
    slab_last = _all([x == n - 1 for x, n in zip(inner, sizes)])

    @pl.when(slab_first)
    def _init_dq():
      r.dq_acc[...] = jnp.zeros(r.dq_acc.shape, jnp.float32)

  def tile(kv_rows, q_cols, masked: bool):
    """dk, dv of keys ``kv_rows`` of the kv block from q rows ``q_cols`` (static slices)."""
    q = _scaled_q_rows(r.q, q_cols, p.scale)
    k, v, do = r.k[kv_rows, :], r.v[kv_rows, :], r.do[q_cols, :]
    nk, nq_ = k.shape[0], q.shape[0]
    r0 = i * bq + q_cols.start
    if masked and p.sq % bq:
      q = _zero_rows(q, p.sq - r0)
      do = _zero_rows(do, p.sq - r0)
    if masked and plan.fused_dq and p.skv % bkv:  # stale keys past kv_len would reach dq through ds^T k
      k0 = j * bkv + kv_rows.start
      k = _zero_rows(k, p.skv - k0)
      v = _zero_rows(v, p.skv - k0)
    st = lax.dot_general(k, q, _NT, preferred_element_type=jnp.float32)   # (keys, queries): s transposed
    tt = None
    if p.softcap is not None:
      tt = jnp.tanh(st * (1.0 / p.softcap))
      st = p.softcap * tt
    if p.bias_shape is not None:
      st = st + r.bias[kv_rows, q_cols].astype(jnp.float32)
    qpos = r0 + lax.broadcasted_iota(jnp.int32, (1, nq_), 1)
    kpos = j * bkv + kv_rows.start + lax.broadcasted_iota(jnp.int32, (nk, 1), 0)
    if masked:
      st = jnp.where(_visibility_tile(p, r, qpos, kpos, b, h, i, kv_rows, q_cols, transposed=True), st, NEG_INF)
    et = jnp.exp(st - r.lse[:, q_cols])
    keep = None
    if p.dropout_rate:
      keep = _keep_tile(p, r.seed[0:1, 0:1], b, h, qpos, kpos)
      pd = jnp.where(keep, et * (1.0 / (1.0 - p.dropout_rate)), 0.0)
    else:
      pd = et
    r.dv_acc[kv_rows, :] += lax.dot_general(pd.astype(do.dtype), do, _NN, preferred_element_type=jnp.float32)
    dpt = lax.dot_general(v, do, _NT, preferred_element_type=jnp.float32)
    if keep is not None:
      dpt = jnp.where(keep, dpt * (1.0 / (1.0 - p.dropout_rate)), 0.0)
    dst = et * (dpt - r.delta[:, q_cols])
    if tt is not None:
      dst = dst * (1.0 - tt * tt)
    r.dk_acc[kv_rows, :] += lax.dot_general(dst.astype(q.dtype), q, _NN, preferred_element_type=jnp.float32)
    if plan.fused_dq:  # dq rows of this tile += ds k (ds^T is what we hold: contract its key axis)
      row0 = i * bq + q_cols.start
      rows = pl.ds(pl.multiple_of(row0, 8) if bq % 8 == 0 else row0, nq_)
      r.dq_acc[g, rows, :] += lax.dot_general(dst.astype(k.dtype), k, _TN, preferred_element_type=jnp.float32)

  def step(masked: bool):
    if masked and plan.bq_masked:
      _masked_tiles(p, plan, i, j, plan.bkv_masked, plan.bq_masked, tile, transposed=True)
    else:
      tile(pl.ds(0, bkv), pl.ds(0, bq), masked)

  if p.skips:
    needed = active if plan.folded else _block_needed(p, bq, bkv, i, j)
  else:
    needed = True
  _branches(needed, _full_block(p, bq, bkv, i, j, q_tail=True), step)

  @pl.when(last)
  def _finish():
    r.dk[...] = r.dk_acc[...].astype(r.dk.dtype)
    r.dv[...] = r.dv_acc[...].astype(r.dv.dtype)

  if plan.fused_dq:
    @pl.when(slab_last)
    def _finish_dq():
      if plan.inplace_bshd:  # (q_len, group * D): head gm is the gm-th D-wide column block
        for gm in range(p.group):
          r.dq[:, gm * p.d:(gm + 1) * p.d] = (r.dq_acc[gm, :p.sq, :] * p.scale).astype(r.dq.dtype)
      else:
        r.dq[...] = (r.dq_acc[:, :p.sq, :] * p.scale).astype(r.dq.dtype)


# --- specs ---------------------------------------------------------------------------


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
  return args, names, in_specs


def _pallas_forward(q, k, v, sinks, bias, seg_q, seg_kv, mask, seed, *, p: _Problem, plan: _Plan, interpret):
  """q, k, v in the kernel's layout -> (out in that layout, lse [B, H, Sq] f32)."""
  bq = plan.bq
  args, names, in_specs = _q_major_inputs(q, k, v, sinks, bias, seg_q, seg_kv, mask, seed, p=p, plan=plan)
  sq = pl.squeezed
  q_ids = functools.partial(_q_major_ids, p, plan)
  out_specs = [_seq_spec(plan, bq, p.d, lambda *g: q_ids(g)[:3]),
               pl.BlockSpec((sq, sq, bq, 1), lambda *g: (*q_ids(g)[:3], 0))]
  out_shape = [jax.ShapeDtypeStruct(_seq_shape(p, plan, p.h, p.sq), p.dtype),
               jax.ShapeDtypeStruct((p.b, p.h, p.sq, 1), jnp.float32)]
  names += ["o", "lse", "m", "l", "acc", "qs"]
  scratch = [pltpu.VMEM((bq, _LANES), jnp.float32), pltpu.VMEM((bq, _LANES), jnp.float32),
             pltpu.VMEM((bq, p.d), jnp.float32),
             pltpu.VMEM((bq, p.d), p.dtype)]
  grid = _q_major_grid(p, plan)
  frac = 0.5 if p.causal else 1.0
  isz = p.dtype.itemsize
  cost = pl.CostEstimate(flops=int(4 * p.b * p.h * p.sq * p.skv * p.d * frac),
                         transcendentals=int(p.b * p.h * p.sq * p.skv * frac),
                         bytes_accessed=int(isz * (2 * q.size + k.size + v.size)))
  call = pl.pallas_call(
      functools.partial(_fwd_kernel, p=p, plan=plan, names=names),
      grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=0, grid=grid, in_specs=in_specs,
                                             out_specs=out_specs, scratch_shapes=scratch),
      out_shape=out_shape, compiler_params=_compiler_params(plan), cost_estimate=cost, interpret=interpret,
      name="flash_attention_fwd")
  out, lse = call(*args)
  return out, lse.reshape(p.b, p.h, p.sq)


def _pallas_backward(q, k, v, sinks, bias, seg_q, seg_kv, mask, seed, lse, delta, do, *, p: _Problem, plan: _Plan,
                     interpret):
  """Returns dq, dk, dv (kernel layout) and dlogits [B, H, Sq, Skv] f32 when there is a bias."""
  dq = dlogits = None
  if not plan.fused_dq:
    dq, dlogits = _dq_call(q, k, v, sinks, bias, seg_q, seg_kv, mask, seed, lse, delta, do, p=p, plan=plan,
                           interpret=interpret)
  dk, dv, fused = _dkv_call(q, k, v, sinks, bias, seg_q, seg_kv, mask, seed, lse, delta, do, p=p, plan=plan,
                            interpret=interpret)
  return (fused if plan.fused_dq else dq), dk, dv, dlogits


def _dq_call(q, k, v, sinks, bias, seg_q, seg_kv, mask, seed, lse, delta, do, *, p: _Problem, plan: _Plan,
             interpret):
  """The dq kernel on the forward's grid -> (dq, dlogits or None)."""
  bq, bkv = plan.bq, plan.bkv
  sq = pl.squeezed
  isz = p.dtype.itemsize
  frac = 0.5 if p.causal else 1.0
  sq_pad = lse.shape[-1]   # lse and delta come padded to whole q blocks
  q_ids = functools.partial(_q_major_ids, p, plan)
  row_stat = pl.BlockSpec((sq, sq, bq, 1), lambda *g: (*q_ids(g)[:3], 0))
  extra = [("do", do, _seq_spec(plan, bq, p.d, lambda *g: q_ids(g)[:3])),
           ("lse", lse.reshape(p.b, p.h, sq_pad, 1), row_stat),
           ("delta", delta.reshape(p.b, p.h, sq_pad, 1), row_stat)]
  args, names, in_specs = _q_major_inputs(q, k, v, sinks, bias, seg_q, seg_kv, mask, seed, p=p, plan=plan,
                                          extra=extra)
  out_specs = [_seq_spec(plan, bq, p.d, lambda *g: q_ids(g)[:3])]
  out_shape = [jax.ShapeDtypeStruct(_seq_shape(p, plan, p.h, p.sq), p.dtype)]
  names.append("dq")
  if p.bias_shape is not None:
    out_specs.append(pl.BlockSpec((sq, sq, bq, bkv), lambda *g: q_ids(g)[:4]))
    out_shape.append(jax.ShapeDtypeStruct((p.b, p.h, p.sq, p.skv), jnp.float32))
    names.append("dbias")
  names.append("acc")
  cost = pl.CostEstimate(flops=int(6 * p.b * p.h * p.sq * p.skv * p.d * frac),
                         transcendentals=int(p.b * p.h * p.sq * p.skv * frac),
                         bytes_accessed=int(isz * (3 * q.size + k.size + v.size)))
  call = pl.pallas_call(
      functools.partial(_dq_kernel, p=p, plan=plan, names=names),
      grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=0, grid=_q_major_grid(p, plan),
                                             in_specs=in_specs, out_specs=out_specs,
                                             scratch_shapes=[pltpu.VMEM((bq, p.d), jnp.float32)]),
      out_shape=out_shape, compiler_params=_compiler_params(plan), cost_estimate=cost, interpret=interpret,
      name="flash_attention_dq")
  outs = call(*args)
  return outs[0], (outs[1] if p.bias_shape is not None else None)


def _dkv_call(q, k, v, sinks, bias, seg_q, seg_kv, mask, seed, lse, delta, do, *, p: _Problem, plan: _Plan,
              interpret):
  """The dk/dv kernel: grid (batch, kv head, kv block, q head in the group, q block) -> (dk, dv, dq
  when ``plan.fused_dq`` else None)."""
  bq, bkv, nq = plan.bq, plan.bkv, plan.nq
  G = p.group
  sq = pl.squeezed
  isz = p.dtype.itemsize
  frac = 0.5 if p.causal else 1.0
  sq_pad = lse.shape[-1]

  def qids(*g):  # -> (b, q head, i, j)
    b, kh, j, gi, i = _kv_major_ids(p, plan, g)[:5]
    if p.skips and not plan.folded:
      lo, hi = _q_range(p, bq, bkv, nq, j)
      i = _clamp(i, lo, hi)
    return b, kh * G + gi, i, j

  def kvids(*g):  # -> (b, kv head, j)
    return _kv_major_ids(p, plan, g)[:3]

  args, names, in_specs = _small_inputs(p, seed, sinks, lambda *g: qids(*g)[1])
  in_specs = in_specs + [_seq_spec(plan, bq, p.d, lambda *g: qids(*g)[:3]),
              _seq_spec(plan, bkv, p.d, kvids),
              _seq_spec(plan, bkv, p.d, kvids),
              _seq_spec(plan, bq, p.d, lambda *g: qids(*g)[:3]),
              pl.BlockSpec((sq, sq, 1, bq), lambda *g: (lambda b, h, i, j: (b, h, 0, i))(*qids(*g))),
              pl.BlockSpec((sq, sq, 1, bq), lambda *g: (lambda b, h, i, j: (b, h, 0, i))(*qids(*g)))]
  args = args + [q, k, v, do, lse.reshape(p.b, p.h, 1, sq_pad), delta.reshape(p.b, p.h, 1, sq_pad)]
  names += ["q", "k", "v", "do", "lse", "delta"]
  if p.segments:
    in_specs += [pl.BlockSpec((sq, 1, bq), lambda *g: (lambda b, h, i, j: (b, 0, i))(*qids(*g))),
                 pl.BlockSpec((sq, bkv, 1), lambda *g: (g[0], kvids(*g)[2], 0))]
    args += [seg_q.astype(jnp.int32).reshape(p.b, 1, p.sq), seg_kv.astype(jnp.int32).reshape(p.b, p.skv, 1)]
    names += ["segq", "segk"]
  if p.mask_shape is not None:
    in_specs.append(_dense_block(p, p.mask_shape, bq, bkv, qids, transposed=True))
    args.append(jnp.swapaxes(mask, 2, 3).astype(jnp.int8))
    names.append("mask")
  if p.bias_shape is not None:
    in_specs.append(_dense_block(p, p.bias_shape, bq, bkv, qids, transposed=True))
    args.append(jnp.swapaxes(bias, 2, 3))
    names.append("bias")
  kv_spec = _seq_spec(plan, bkv, p.d, kvids)
  kv_shape = jax.ShapeDtypeStruct(_seq_shape(p, plan, p.kvh, p.skv), p.dtype)
  out_specs, out_shape = [kv_spec, kv_spec], [kv_shape, kv_shape]
  scratch = [pltpu.VMEM((bkv, p.d), jnp.float32), pltpu.VMEM((bkv, p.d), jnp.float32)]
  names += ["dk", "dv"]
  if plan.fused_dq:  # one (group, q_len, D) block per (batch, kv head), written at its last step
    if plan.inplace_bshd:
      out_specs.append(pl.BlockSpec((sq, p.sq, G * p.d), lambda *g: (g[0], 0, g[1])))
    else:
      out_specs.append(pl.BlockSpec((sq, G, p.sq, p.d), lambda *g: (g[0], g[1], 0, 0)))
    out_shape.append(jax.ShapeDtypeStruct(_seq_shape(p, plan, p.h, p.sq), p.dtype))
    names.append("dq")
  names += ["dk_acc", "dv_acc"]
  if plan.fused_dq:
    scratch.append(pltpu.VMEM((G, nq * bq, p.d), jnp.float32))
    names.append("dq_acc")
  cost = pl.CostEstimate(flops=int((10 if plan.fused_dq else 8) * p.b * p.h * p.sq * p.skv * p.d * frac),
                         transcendentals=int(p.b * p.h * p.sq * p.skv * frac),
                         bytes_accessed=int(isz * (2 * q.size + 2 * k.size + 2 * v.size)))
  call = pl.pallas_call(
      functools.partial(_dkv_kernel, p=p, plan=plan, names=names),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=0, grid=_kv_major_grid(p, plan), in_specs=in_specs,
          out_specs=out_specs, scratch_shapes=scratch),
      out_shape=out_shape, cost_estimate=cost, interpret=interpret, name="flash_attention_dkv",
      # fused, dq sums over the kv blocks too: only batch and kv head stay parallel
      compiler_params=_compiler_params(plan, inner=3, parallel=2) if plan.fused_dq else
      _compiler_params(plan, inner=2))
  outs = call(*args)
  return outs[0], outs[1], (outs[2] if plan.fused_dq else None)




def _float0(x):
  return None if x is None else np.zeros(x.shape, jax.dtypes.float0)


def _pallas_path(q, k, v, sinks, bias, seg_q, seg_kv, mask, seed, *, p: _Problem, blocks, interpret):
  """Caller-layout q, k, v -> (out in the caller's layout, lse); differentiable (custom_vjp)."""
  fplan = _plan(p, blocks, backward=False)

  def forward(q, k, v, sinks, bias, seg_q, seg_kv, mask, seed):
    out, lse = _pallas_forward(_in_layout(q, p, fplan), _in_layout(k, p, fplan), _in_layout(v, p, fplan), sinks,
                               bias, seg_q, seg_kv, mask, seed, p=p, plan=fplan, interpret=interpret)
    return _out_layout(out, p, fplan, p.h), lse

  @jax.custom_vjp
  def f(q, k, v, sinks, bias, seg_q, seg_kv, mask, seed):
    return forward(q, k, v, sinks, bias, seg_q, seg_kv, mask, seed)

  def f_fwd(q, k, v, sinks, bias, seg_q, seg_kv, mask, seed):
    out, lse = forward(q, k, v, sinks, bias, seg_q, seg_kv, mask, seed)
    return (out, lse), (q, k, v, sinks, bias, seg_q, seg_kv, mask, seed, out, lse)

  def f_bwd(res, cts):
    q, k, v, sinks, bias, seg_q, seg_kv, mask, seed, out, lse = res
    do, _ = cts  # the lse output is a residual for callers, not differentiated
    bplan = _plan(p, blocks, backward=True)
    # A row with nothing visible has lse = -inf; as +inf, exp(s - lse) is 0 for its (masked, -inf) logits.
    # lse and delta are padded to whole q blocks (+inf, 0), so the dk/dv kernel, which reads them
    # along lanes, never sees stale VMEM past q_len (0 * NaN would reach dk and dv).
    pad = ((0, 0), (0, 0), (0, bplan.nq * bplan.bq - p.sq))
    lse = jnp.pad(jnp.where(lse == NEG_INF, jnp.inf, lse), pad, constant_values=jnp.inf)
    delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)   # [B, H, Sq] or [B, Sq, H]
    if p.layout == "BSHD":
      delta = jnp.swapaxes(delta, 1, 2)
    delta = jnp.pad(delta, pad)
    dq, dk, dv, dlogits = _pallas_backward(
        _in_layout(q, p, bplan), _in_layout(k, p, bplan), _in_layout(v, p, bplan), sinks, bias, seg_q, seg_kv, mask,
        seed, lse, delta, _in_layout(do.astype(p.dtype), p, bplan), p=p, plan=bplan, interpret=interpret)
    dq, dk, dv = _out_layout(dq, p, bplan, p.h), _out_layout(dk, p, bplan, p.kvh), _out_layout(dv, p, bplan, p.kvh)
    dsinks = dbias = None
    if sinks is not None:  # d lse_i / d sink = exp(sink - lse_i); d out_i / d sink = -out_i * that
      w = jnp.exp(sinks.astype(jnp.float32)[None, :, None] - lse)   # 0 on the padding
      dsinks = (-(w * delta).sum(axis=(0, 2))).astype(sinks.dtype)
    if bias is not None:
      axes = tuple(a for a in (0, 1) if bias.shape[a] == 1)
      dbias = (dlogits.sum(axis=axes, keepdims=True) if axes else dlogits).astype(bias.dtype)
    return dq, dk, dv, dsinks, dbias, _float0(seg_q), _float0(seg_kv), _float0(mask), _float0(seed)

  f.defvjp(f_fwd, f_bwd)
  return f(q, k, v, sinks, bias, seg_q, seg_kv, mask, seed)


def _check_blocks(block_sizes):
  if block_sizes is None or isinstance(block_sizes, BlockSizes):
    return block_sizes
  if isinstance(block_sizes, (tuple, list)) and len(block_sizes) in (2, 4):
    return BlockSizes(*block_sizes) if len(block_sizes) == 4 else BlockSizes(*block_sizes, *block_sizes)
  raise KernelError("block_sizes", block_sizes,
                    "must be None, a BlockSizes or a (block_q, block_kv[, block_q_bwd, block_kv_bwd]) tuple")


def flash_attention(q, k, v, *, causal=False, segment_ids=None, sliding_window=None, logits_soft_cap=None,
                    scale=None, bias=None, mask=None, sinks=None, dropout_rate=0.0, dropout_key=None,
                    layout="BSHD", return_residuals=False, block_sizes=None, implementation=None, interpret=None):
  """Multi-head attention ``softmax(mask(cap(scale * q k^T) + bias)) v`` without the score matrix in HBM.

  Args:
    q: ``[batch, q_len, heads, head_dim]`` (``layout="BSHD"``, as ``jax.nn.dot_product_attention``)
      or ``[batch, heads, q_len, head_dim]`` (``layout="BHSD"``); bfloat16 or float32.
    k, v: ``[batch, kv_len, kv_heads, head_dim]`` (or BHSD), q's dtype; ``kv_heads`` divides
      ``heads`` (GQA / MQA: q head ``h`` uses kv head ``h // (heads // kv_heads)``).
    causal: query ``i`` sees keys ``j <= i + kv_len - q_len`` (the last query aligns with the last key).
    segment_ids: ``[batch, seq]`` ints (self-attention) or a pair ``(q_ids [batch, q_len],
      kv_ids [batch, kv_len])``; attention only within equal ids.
    sliding_window: ``W``; with ``causal`` a query sees itself and the ``W - 1`` keys before it,
      without ``causal`` the keys within distance ``W - 1`` on either side of its diagonal.
    logits_soft_cap: ``c``: logits become ``c * tanh(logits / c)`` (after scaling, before bias).
    scale: multiplies ``q k^T``; default ``1 / sqrt(head_dim)``.
    bias: additive float ``[batch or 1, heads or 1, q_len, kv_len]``, differentiable (read per block: slower).
    mask: boolean ``[batch or 1, heads or 1, q_len, kv_len]``, True = attend.
    sinks: ``[heads]`` learned logits that join each row's softmax denominator (no value), differentiable.
    dropout_rate, dropout_key: dropout on the attention probabilities, the mask a hash of
      ``(seed, batch, head, query, key)`` that :func:`attention_reference` reproduces exactly.
    layout: ``"BSHD"`` or ``"BHSD"`` (for q, k, v and the output).
    return_residuals: also return ``lse`` ``[batch, heads, q_len]`` f32, the log of each row's softmax
      denominator (``-inf`` for a row with no visible key and no sink).
    block_sizes: a :class:`BlockSizes`; None uses the per-generation defaults.
    implementation, interpret: see :func:`kernels.dispatch`.

  Returns:
    The output in q's layout and dtype (and ``lse`` with ``return_residuals``). Rows that see no key
    are 0. Differentiable in q, k, v, bias and sinks.

  Raises:
    KernelError: bad input, naming the argument, before anything is lowered.
  """
  p, seg_q, seg_kv = _validate(q, k, v, causal=causal, segment_ids=segment_ids, sliding_window=sliding_window,
                               logits_soft_cap=logits_soft_cap, scale=scale, bias=bias, mask=mask, sinks=sinks,
                               dropout_rate=dropout_rate, dropout_key=dropout_key, layout=layout)
  check(isinstance(return_residuals, bool), "return_residuals", return_residuals, "must be a bool")
  blocks = _check_blocks(block_sizes)
  seed = dropout_seed(dropout_key) if p.dropout_rate else None

  def xla(q, k, v, sinks, bias, seg_q, seg_kv, mask, seed):
    out, lse = _reference(_to_bhsd(q, layout), _to_bhsd(k, layout), _to_bhsd(v, layout), sinks, bias, seg_q, seg_kv,
                          mask, seed, p=p)
    return _to_bhsd(out, layout), lse

  def pallas(q, k, v, sinks, bias, seg_q, seg_kv, mask, seed, interpret):
    return _pallas_path(q, k, v, sinks, bias, seg_q, seg_kv, mask, seed, p=p, blocks=blocks, interpret=interpret)

  out, lse = dispatch("flash_attention", q, k, v, sinks, bias, seg_q, seg_kv, mask, seed, pallas=pallas, xla=xla,
                      implementation=implementation, interpret=interpret)
  return (out, lse) if return_residuals else out
