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
``acc / l`` and, when a gradient or ``return_residuals`` needs it, ``lse = m + log(l)``
(the backward's residual): in inference the kernel has no lse output. lse is stored
lane-dense, a ``(1, block_q)`` row per q block (the lane-replicated ``(block_q, 128)``
tile transposed), since a ``[B, H, Sq, 1]`` array's HBM tiles pad each row to 128 lanes.
``scale`` is folded into the q tile (``block_q x head_dim`` multiplies instead of
``block_q x block_kv``). Three details matter to speed: ``m`` is kept lane-replicated,
``(block_q, 128)`` with the row's value in every lane, so using it against a tile is
whole-vreg copies rather than a cross-lane broadcast per step; ``l`` is kept as
``(block_q, 128)`` lane partial sums (whole-vreg adds), reduced across lanes once, at the
end, rather than once per step; and the math of a step walks its kv block in sub-blocks
of ``KV_COMPUTE`` (512) keys, so the f32 score tiles are ``block_q x 512`` (fewer live
temporaries) while the DMA block stays large (fewer grid steps).
Two more cut the vector work per score, which binds on v6e and at small head dims (the
MXU's time per pair is the same at head_dim 64 as at 128 on v5e, and at 64, 128 and 256
on v6e's 256-wide arrays). *exp2* (``_Plan.exp2``; not with a soft cap or a bias): the
scale of the q tile carries ``log2(e)``, so the scores are in base-2 units and the
exponentials are ``exp2`` (``exp(x)`` is ``exp2(x * log2(e))``), one multiply per score fewer; ``lse``
is converted back at the end. *The denominator from the MXU* (``_Plan.mxu_rowsum``,
head_dim not a multiple of 128, no dropout): each V block is copied into a VMEM tile
padded with columns of ones, so the PV matmul, whose output tile is padded to whole MXU
columns anyway, also sums each row's probabilities into ``acc``'s extra columns, and
``l``'s vector adds are gone.

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

*RoPE* (``rope=RotaryEmbedding(...)``): q and k are rotated inside the kernels rather than
by an HBM pass of :func:`kernels.rope` over each. The forward rotates (and scales) a q block
once, at its first kv step, into the VMEM scratch the steps read, and a k block at every step
(each q block reads it again). A block's cos / sin rows are composed in VMEM by the angle
addition formulas from the rows of positions ``0 .. block - 1`` (a constant block index:
fetched once) and one row per block, its first position's: fetching a block's f32 rows at every
step would move four times the bytes of the bf16 k block. The backward kernels rotate the q / k
tiles they load and rotate dq and dk back by the opposite angle before writing them (the fused
dq: each tile's contribution, before it is added); the rotation is
:func:`kernels.attention.rotary.rotate_tile`, the RoPE kernel's own. Keys sit at positions ``0 ..
kv_len - 1``, queries at ``kv_len - q_len + i``; the XLA path is :func:`kernels.rope_reference`
of q and k, then the reference.

*Backward* (``custom_vjp``). The forward saves ``lse``; ``D = rowsum(dO * O)`` is one
XLA reduction. Two kernels (one when dq is fused, see below):

* dk/dv: grid ``(batch, kv_heads, kv_len/block_kv, group, q_len/block_q)`` (folded when
  causal, see above); the two inner axes walk the q blocks of every q head in the
  group, so dk and dv are summed over the GQA group in VMEM without races. It computes the transposed tile
  ``s^T = k q^T`` (``block_kv x block_q``), which keeps every matmul in the MXU's
  native form (``p^T dO``, ``v dO^T``, ``ds^T q``) and puts ``lse`` and ``D`` on the
  lane axis, as stored.
* dq: the forward's grid, ``dq += ds k``, when not fused (below); it reads ``lse`` and ``D``
  along lanes too and transposes them into columns once per q block.

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
the defaults per generation and head_dim (64, 128, 256; other head dims take the
nearest above) come from ``kernels/data/attention_blocks.json``,
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

*Where the code is.* This module holds :class:`BlockSizes` and the per-generation
defaults, the validation, the reference and :func:`flash_attention` with its
``custom_vjp``. The rest is split as JAX's splash attention is: the plan and the masks
(blocks fitted to a problem, the grids, which blocks and tiles are skipped, run unmasked
or masked, the index maps that clamp to the needed blocks, the BlockSpecs) in
``kernels/_attention_plan.py``, the forward kernel in ``kernels/_attention_fwd.py``, the
dk/dv and dq kernels in ``kernels/_attention_bwd.py``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kernels.base import partition
from kernels.base import tiling
from kernels.attention.backward import _pallas_backward
from kernels.attention.forward import _pallas_forward
from kernels.attention.plan import (NEG_INF, _dropout_rows, _in_layout, _make_plan, _out_layout, _Plan, _Problem,
                                     _soft_cap, _visible)
from kernels.base.backend import dispatch, target_chip
from kernels.base.errors import KernelError, VmemOverflowError, check
from kernels.gemm import dropout_keep_mask, dropout_seed
from kernels.attention.rotary import RotaryEmbedding, _rotate_xla

__all__ = ["BlockSizes", "attention_reference", "default_block_sizes", "flash_attention"]

LAYOUTS = ("BSHD", "BHSD")
FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


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


def _head_dim_class(head_dim: int) -> str:
  """The tuned head_dim whose blocks a head_dim takes: 64 up to 64, 128 up to 128, else 256."""
  return "64" if head_dim <= 64 else "128" if head_dim <= 128 else "256"


def default_block_sizes(generation=None, dtype=jnp.bfloat16, head_dim: int = 128) -> BlockSizes:
  """The shipped defaults for ``generation`` (None: v5e) and ``head_dim``, from
  ``kernels/data/attention_blocks.json``: an entry per generation (tuned at head_dim 128), whose
  ``by_head_dim`` entries (64, 256) override its forward blocks for the head dims nearest them."""
  gen = generation or "v5e"
  per_gen = tiling.block_table("attention").get(gen, {})
  entry = per_gen.get(jnp.dtype(dtype).name)
  if entry is None:
    entry = per_gen.get("bfloat16")
  if not entry:
    entry = dataclasses.asdict(_FALLBACK_SMALL_VMEM if gen == "v4" else _FALLBACK)
  fields = {f.name for f in dataclasses.fields(BlockSizes)}
  by_d = entry.get("by_head_dim", {}).get(_head_dim_class(head_dim), {})
  entry = {**entry, **{k: v for k, v in by_d.items() if k in fields}}
  blocks = BlockSizes(**{k: v for k, v in entry.items() if k in fields})
  if head_dim > 128 and jnp.dtype(dtype).itemsize == 4:  # f32 and a wide head: halve the tiles' VMEM
    blocks = BlockSizes(*(max(128, b // 2) for b in dataclasses.astuple(blocks)))
  return blocks


# ---------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------


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


def _with_rope(p: _Problem, rope) -> _Problem:
  """``p`` carrying the resolved rotary embedding (validated against the shapes), or ``p`` when None."""
  if rope is None:
    return p
  check(isinstance(rope, RotaryEmbedding), "rope", rope, "must be a kernels.RotaryEmbedding or None")
  r = rope.resolved(p.d)
  check(p.sq <= p.skv, "rope", rope, f"needs q_len <= kv_len: queries sit at positions kv_len - q_len + i, "
        f"keys at j (q_len {p.sq} > kv_len {p.skv} would give negative positions)")
  if r.max_position is not None:
    check(p.skv <= r.max_position, "rope", rope,
          f"max_position {r.max_position} must be at least kv_len {p.skv} (the last key's position + 1)")
  return dataclasses.replace(p, rope=r)


def _rope_xla(x, p: _Problem, first: int):
  """RoPE of q (``first = kv_len - q_len``) or k (``first = 0``) in XLA: positions ``first + row``."""
  x = x if p.layout == "BSHD" else jnp.swapaxes(x, 1, 2)
  cos, sin = p.rope.table(first + x.shape[1], p.d)
  y = _rotate_xla(x, jnp.asarray(cos[first:]), jnp.asarray(sin[first:]), rotary_dim=p.rope.rotary_dim,
                  interleaved=p.rope.interleaved)
  return y if p.layout == "BSHD" else jnp.swapaxes(y, 1, 2)


def _rope_reference(q, k, v, sinks, bias, seg_q, seg_kv, mask, seed, *, p: _Problem, return_residuals):
  """The XLA path: RoPE of q and k (when ``p.rope``), then :func:`_reference`, in the caller's layout."""
  if p.rope is not None:
    q, k = _rope_xla(q, p, p.offset), _rope_xla(k, p, 0)
  out, lse = _reference(_to_bhsd(q, p.layout), _to_bhsd(k, p.layout), _to_bhsd(v, p.layout), sinks, bias, seg_q,
                        seg_kv, mask, seed, p=p)
  return _finish(out, lse, p, return_residuals)


# ---------------------------------------------------------------------------------
# Reference (pure JAX)
# ---------------------------------------------------------------------------------


def _to_bhsd(x, layout):
  return jnp.swapaxes(x, 1, 2) if layout == "BSHD" else x


def _scores(q, k, bias, seg_q, seg_kv, mask, *, p: _Problem):
  """Canonical BHSD q, k -> the f32 logits ``[B, H, Sq, Skv]``, ``NEG_INF`` where masked."""
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
  return jnp.where(vis, s, NEG_INF)


def _reference(q, k, v, sinks, bias, seg_q, seg_kv, mask, seed, *, p: _Problem):
  """Canonical BHSD in, (out BHSD in q's dtype, lse [B, H, Sq] f32) out."""
  s = _scores(q, k, bias, seg_q, seg_kv, mask, p=p)
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
                        layout="BSHD", return_residuals=False, rope=None):
  """Pure-JAX :func:`flash_attention`: the whole ``[q_len, kv_len]`` logit matrix in f32, same masks and dropout
  (and with ``rope``, :func:`kernels.rope_reference` of q and k first)."""
  p, seg_q, seg_kv = _validate(q, k, v, causal=causal, segment_ids=segment_ids, sliding_window=sliding_window,
                               logits_soft_cap=logits_soft_cap, scale=scale, bias=bias, mask=mask, sinks=sinks,
                               dropout_rate=dropout_rate, dropout_key=dropout_key, layout=layout)
  p = _with_rope(p, rope)
  seed = dropout_seed(dropout_key) if p.dropout_rate else None
  return _rope_reference(q, k, v, sinks, bias, seg_q, seg_kv, mask, seed, p=p, return_residuals=return_residuals)


# ---------------------------------------------------------------------------------
# The Pallas path: plan, forward, custom_vjp backward
# ---------------------------------------------------------------------------------


def _plan(p: _Problem, blocks: BlockSizes | None, backward: bool) -> _Plan:
  """The plan of one kernel call: ``blocks`` (None: the target generation's defaults) fitted to ``p``.

  Default blocks that do not fit the chip's VMEM (f32 on v4's 16 MiB, say) are halved, down to 128,
  until they do: a default call never fails on its blocks. Blocks a caller chose are kept or rejected."""
  if blocks is not None:
    return _make_plan(p, blocks, backward)
  chip = target_chip()
  blocks = default_block_sizes(chip.name if chip else None, p.dtype, p.d)
  while True:
    try:
      return _make_plan(p, blocks, backward)
    except VmemOverflowError:
      smaller = BlockSizes(*(max(128, b // 2) for b in dataclasses.astuple(blocks)))
      if smaller == blocks:
        raise
      blocks = smaller


def _float0(x):
  return None if x is None else np.zeros(x.shape, jax.dtypes.float0)


def _pallas_grads(q, k, v, sinks, bias, seg_q, seg_kv, mask, seed, out, lse, do, *, p: _Problem, blocks,
                  interpret):
  """The backward kernels: (dq, dk, dv, dsinks, dbias) in the caller's layout, given the softmax's ``lse``
  ``[B, H, Sq]`` and the output ``out`` it normalised (``delta = rowsum(dO * out)``). ``out`` and ``lse``
  may be those of a larger attention that this call's keys are part of (ring attention's blocks): the
  gradients are then this block's share."""
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
  return dq, dk, dv, dsinks, dbias


def _pallas_path(q, k, v, sinks, bias, seg_q, seg_kv, mask, seed, *, p: _Problem, blocks, interpret,
                 return_residuals):
  """Caller-layout q, k, v -> out in the caller's layout (and lse with ``return_residuals``);
  differentiable (custom_vjp). Undifferentiated and without ``return_residuals``, the kernel
  writes no lse."""
  fplan = _plan(p, blocks, backward=False)

  def forward(q, k, v, sinks, bias, seg_q, seg_kv, mask, seed, with_lse):
    out, lse = _pallas_forward(_in_layout(q, p, fplan), _in_layout(k, p, fplan), _in_layout(v, p, fplan), sinks,
                               bias, seg_q, seg_kv, mask, seed, p=p, plan=fplan, interpret=interpret,
                               with_lse=with_lse)
    return _out_layout(out, p, fplan, p.h), lse

  def result(out, lse):
    return (out, lse) if return_residuals else out

  @jax.custom_vjp
  def f(q, k, v, sinks, bias, seg_q, seg_kv, mask, seed):
    return result(*forward(q, k, v, sinks, bias, seg_q, seg_kv, mask, seed, with_lse=return_residuals))

  def f_fwd(q, k, v, sinks, bias, seg_q, seg_kv, mask, seed):
    out, lse = forward(q, k, v, sinks, bias, seg_q, seg_kv, mask, seed, with_lse=True)
    return result(out, lse), (q, k, v, sinks, bias, seg_q, seg_kv, mask, seed, out, lse)

  def f_bwd(res, cts):
    q, k, v, sinks, bias, seg_q, seg_kv, mask, seed, out, lse = res
    do = cts[0] if return_residuals else cts  # the lse output is a residual for callers, not differentiated
    dq, dk, dv, dsinks, dbias = _pallas_grads(q, k, v, sinks, bias, seg_q, seg_kv, mask, seed, out, lse, do, p=p,
                                              blocks=blocks, interpret=interpret)
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


# ---------------------------------------------------------------------------------
# On a mesh (kernels.base.partition)
# ---------------------------------------------------------------------------------

_SPLITS = {"batch": "local", "heads": "local", "seq": "ring attention (kernels.distributed.ring_attention)"}


def _on_mesh(p, q, k, v, seg_q, seg_kv, bias, mask, sinks, dropout_key, options):
  """:func:`flash_attention` split over a mesh, or None where nothing is split.

  Batch and heads split locally (a kv head stays with its q heads: GQA groups are contiguous; a
  single kv head is replicated). A split sequence (q's and k/v's, over one mesh axis) runs ring
  attention, zig-zag balanced when causal. Dense ``bias`` and ``mask`` split along batch and heads
  only; dropout's mask is a function of global indices, so it cannot be drawn per shard."""
  seq = ("batch", "seq", "heads", None) if p.layout == "BSHD" else ("batch", "heads", "seq", None)
  kv = tuple(None if n == "heads" and p.kvh == 1 and p.h > 1 else n for n in seq)

  def dense(x):  # [batch?, heads?, q_len, kv_len], broadcast dims (size 1) never split
    if x is None:
      return ()
    names = ("batch", "heads", None, None)[-x.ndim:]
    return tuple(n if x.shape[i] > 1 else None for i, n in enumerate(names))
  operands = dict(q=q, k=k, v=v, seg_q=seg_q, seg_kv=seg_kv if seg_kv is not seg_q else None, bias=bias,
                  mask=mask, sinks=sinks)
  dims = dict(q=seq, k=kv, v=kv, seg_q=("batch", "seq"), seg_kv=("batch", "seq"), bias=dense(bias),
              mask=dense(mask), sinks=("heads",))
  split = partition.plan("flash_attention", operands, dims, splits=_SPLITS)
  if split is None:
    return None
  check(not (options["dropout_rate"] and split.axes), "dropout_rate", options["dropout_rate"],
        "flash_attention on a mesh cannot draw the single-device dropout mask per shard")
  ring = split.of("seq")
  if ring:
    check(len(ring) == 1, "q", q, f"the sequence is split over {ring}: ring attention runs over one mesh axis")
    for name in ("logits_soft_cap", "rope", "return_residuals"):
      check(not options[name], name, options[name], "is not supported with a split sequence (ring attention)")
    for name, x in (("bias", bias), ("mask", mask), ("sinks", sinks)):
      check(x is None, name, x, "is not supported with a split sequence (ring attention): a dense "
            "[q_len, kv_len] array would be all-gathered; use causal, sliding_window or segment_ids")

  def local(q, k, v, seg_q=None, seg_kv=None, bias=None, mask=None, sinks=None):
    segs = None if seg_q is None else seg_q if seg_kv is None else (seg_q, seg_kv)
    if ring:
      if isinstance(segs, tuple):
        check(False, "segment_ids", segs, "ring attention takes one segment_ids array (self-attention)")
      return partition.collective("flash_attention.seq")(
          q, k, v, axis_name=ring[0], causal=options["causal"], segment_ids=segs,
          sliding_window=options["sliding_window"], scale=options["scale"], layout=options["layout"],
          block_sizes=options["block_sizes"], implementation=options["implementation"],
          interpret=options["interpret"])
    return flash_attention(q, k, v, segment_ids=segs, bias=bias, mask=mask, sinks=sinks, dropout_key=dropout_key,
                           **options)
  out_dims = (seq, ("batch", "heads", "seq")) if options["return_residuals"] else seq
  return split.run(local, operands, dims, out_dims)


def flash_attention(q, k, v, *, causal=False, segment_ids=None, sliding_window=None, logits_soft_cap=None,
                    scale=None, bias=None, mask=None, sinks=None, dropout_rate=0.0, dropout_key=None,
                    layout="BSHD", return_residuals=False, rope=None, block_sizes=None, implementation=None,
                    interpret=None):
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
    rope: a :class:`kernels.RotaryEmbedding`: q and k are rotated inside the kernels (forward and
      backward; the gradients are with respect to the unrotated q and k), keys at positions
      ``0 .. kv_len - 1`` and queries at ``kv_len - q_len + i`` (the last query aligned with the last
      key, as ``causal``), so ``q_len <= kv_len``. Per-token positions are not supported (use
      :func:`kernels.rope` on q and k, then this without ``rope``).
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
  p = _with_rope(p, rope)
  blocks = _check_blocks(block_sizes)
  options = dict(causal=causal, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, scale=scale,
                 dropout_rate=dropout_rate, layout=layout, return_residuals=return_residuals, rope=rope,
                 block_sizes=block_sizes, implementation=implementation, interpret=interpret)
  sharded = _on_mesh(p, q, k, v, seg_q, seg_kv, bias, mask, sinks, dropout_key, options)
  if sharded is not None:
    return sharded
  seed = dropout_seed(dropout_key) if p.dropout_rate else None

  def xla(q, k, v, sinks, bias, seg_q, seg_kv, mask, seed):
    return _rope_reference(q, k, v, sinks, bias, seg_q, seg_kv, mask, seed, p=p, return_residuals=return_residuals)

  def pallas(q, k, v, sinks, bias, seg_q, seg_kv, mask, seed, interpret):
    return _pallas_path(q, k, v, sinks, bias, seg_q, seg_kv, mask, seed, p=p, blocks=blocks, interpret=interpret,
                        return_residuals=return_residuals)

  # both return out, or (out, lse) with return_residuals: the kernel writes lse only when it is used
  return dispatch("flash_attention", q, k, v, sinks, bias, seg_q, seg_kv, mask, seed, pallas=pallas, xla=xla,
                  implementation=implementation, interpret=interpret)


# ---------------------------------------------------------------------------------
# One block of a larger attention: the gradients given the whole softmax's lse (ring attention)
# ---------------------------------------------------------------------------------


def _reference_grads(q, k, v, seg_q, seg_kv, out, lse, do, *, p: _Problem):
  """Pure-JAX :func:`_pallas_grads` (no bias, mask, sinks or dropout): ``ds = P * (dP - delta)`` with
  ``P = exp(s - lse)``, pulled back through the logits' own VJP (scale, soft cap, masks)."""
  q, k, v, do, out = (_to_bhsd(x, p.layout) for x in (q, k, v, do, out))
  s, pull = jax.vjp(lambda q, k: _scores(q, k, None, seg_q, seg_kv, None, p=p), q, k)
  lse = jnp.where(lse == NEG_INF, jnp.inf, lse)[..., None]
  probs = jnp.exp(s - lse).reshape(p.b, p.kvh, p.group, p.sq, p.skv)
  do5 = do.astype(jnp.float32).reshape(p.b, p.kvh, p.group, p.sq, p.d)
  dv = jnp.einsum("bkgqs,bkgqd->bksd", probs, do5)
  dp = jnp.einsum("bkgqd,bksd->bkgqs", do5, v.astype(jnp.float32))
  delta = jnp.sum(do.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
  ds = probs * (dp - delta.reshape(p.b, p.kvh, p.group, p.sq, 1))
  dq, dk = pull(ds.reshape(s.shape))
  return tuple(_to_bhsd(x, p.layout).astype(p.dtype) for x in (dq, dk, dv))


def attention_block_grads(q, k, v, out, lse, do, *, causal=False, segment_ids=None, scale=None, layout="BSHD",
                          block_sizes=None, implementation=None, interpret=None):
  """``(dq, dk, dv)`` of the keys ``k``/``v`` as one block of a larger attention.

  ``out`` (q's layout) and ``lse`` (``[batch, heads, q_len]`` f32) are the *whole* attention's output
  and log-normaliser for these queries, over every key block; the result is the share of the
  gradient that flows through this block: ``ds = exp(s - lse) * (dO v^T - rowsum(dO * out))``.
  Summed over the blocks it is the gradient of the whole. Called with the attention's own ``out``
  and ``lse`` it is :func:`flash_attention`'s backward. Ring attention (:mod:`kernels.distributed`)
  calls it once per visiting key block. The Pallas path is the backward kernels of
  :func:`flash_attention`; the XLA path the reference's logits and their VJP.
  """
  p, seg_q, seg_kv = _validate(q, k, v, causal=causal, segment_ids=segment_ids, sliding_window=None,
                               logits_soft_cap=None, scale=scale, bias=None, mask=None, sinks=None,
                               dropout_rate=0.0, dropout_key=None, layout=layout)
  check(tuple(out.shape) == tuple(q.shape), "out", out, f"must have q's shape {tuple(q.shape)}")
  check(tuple(do.shape) == tuple(q.shape), "do", do, f"must have q's shape {tuple(q.shape)}")
  check(tuple(lse.shape) == (p.b, p.h, p.sq), "lse", lse, f"must have shape {(p.b, p.h, p.sq)} ([batch, heads, q_len])")
  blocks = _check_blocks(block_sizes)

  def pallas(q, k, v, seg_q, seg_kv, out, lse, do, interpret):
    return _pallas_grads(q, k, v, None, None, seg_q, seg_kv, None, None, out, lse, do, p=p, blocks=blocks,
                         interpret=interpret)[:3]

  def xla(q, k, v, seg_q, seg_kv, out, lse, do):
    return _reference_grads(q, k, v, seg_q, seg_kv, out, lse, do, p=p)

  return dispatch("flash_attention (block gradients)", q, k, v, seg_q, seg_kv, out, lse, do, pallas=pallas, xla=xla,
                  implementation=implementation, interpret=interpret)
