"""The forward kernel of :mod:`kernels.attention`: the online softmax over one q block's kv blocks.

Grid ``(batch, heads, q blocks, kv blocks)`` (folded when causal, banded with a window; see
:mod:`kernels.attention.plan`), the kv axis innermost and sequential. The running maximum ``m``
is kept lane-replicated and the denominator ``l`` as lane partial sums, both ``(block_q, 128)``,
so that no step needs a cross-lane op; the math walks the kv block in sub-blocks of
``plan.bkv_compute`` keys. It writes the output and, when asked (a gradient or ``return_residuals``),
``lse``, the backward's residual, lane-dense: one ``(1, block_q)`` row per q block.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.base import calls
from kernels.base import tiling
from kernels.attention.plan import (NEG_INF, _NN, _NT, _block_needed, _branches, _compiler_params, _full_block,
                                     _keep_tile, _masked_tiles, _Plan, _Problem, _q_major_grid, _q_major_ids,
                                     _q_major_inputs, _Refs, _rope_block, _scaled_q_rows, _seq_shape, _seq_spec,
                                     _soft_cap, _visibility_tile, _zero_rows)


_LOG2E, _LN2 = 1.4426950408889634, 0.6931471805599453
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


def _fwd_kernel(*refs, p: _Problem, plan: _Plan, names):
  r = _Refs(refs, names)
  b, h, i, j, first, last, active = _q_major_ids(p, plan, [pl.program_id(a) for a in range(4)])
  bq, bkv = plan.bq, plan.bkv

  @pl.when(first)
  def _init():
    if p.sinks:
      r.m[...] = jnp.broadcast_to(r.sinks[0:1, 0:1] * (_LOG2E if plan.exp2 else 1.0), r.m.shape)
      r.l[...] = jnp.where(lax.broadcasted_iota(jnp.int32, r.l.shape, 1) == 0, 1.0, 0.0)  # sums to 1
    else:
      r.m[...] = jnp.full(r.m.shape, NEG_INF, jnp.float32)
      r.l[...] = jnp.zeros(r.l.shape, jnp.float32)
    if plan.mxu_rowsum:  # columns d.. of acc hold the denominator (the sink's 1 to start with)
      ones_cols = lax.broadcasted_iota(jnp.int32, r.acc.shape, 1) >= p.d
      r.acc[...] = jnp.where(ones_cols, 1.0 if p.sinks else 0.0, 0.0)
    else:
      r.acc[...] = jnp.zeros(r.acc.shape, jnp.float32)
    # the q block stays the same along the kv axis: rotate and scale it once (by log2(e) too for exp2)
    q_scale = p.scale * (_LOG2E if plan.exp2 else 1.0)
    if p.rope is not None:
      r.qs[...] = _rope_block(p, r, r.q, "q", q_scale)
    else:
      r.qs[...] = _scaled_q(r.q, q_scale)

  _exp = jnp.exp2 if plan.exp2 else jnp.exp  # exp2: the logits are in log2 units (q carries log2(e))

  def tile(rows, cols, masked: bool):
    """The online-softmax update of q rows ``rows`` by keys ``cols`` of the kv block (static slices)."""
    q = r.qs[rows, :]
    k, v = (r.k if p.rope is None else r.ks)[cols, :], (r.vx if plan.mxu_rowsum else r.v)[cols, :]
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
      e = _exp((s - m_wide).astype(jnp.bfloat16))
    else:
      e = _exp(s - m_wide)
    alpha = _exp(m_prev - m_use)
    if not plan.mxu_rowsum:  # (else the PV matmul's ones columns sum the row)
      r.l[rows, :] = alpha * r.l[rows, :] + _lane_partials(e.astype(jnp.float32))
    if p.dropout_rate:
      keep = _keep_tile(p, r.seed[0:1, 0:1], b, h, qpos, kpos)
      e = jnp.where(keep, e * (1.0 / (1.0 - p.dropout_rate)), 0.0)
    r.acc[rows, :] = _lanes(alpha, r.acc.shape[1]) * r.acc[rows, :] + lax.dot_general(
        e.astype(v.dtype), v, _NN, preferred_element_type=jnp.float32)
    r.m[rows, :] = m_new

  def step(masked: bool):
    if p.rope is not None:  # the rotated k block, read by every tile of this step
      r.ks[...] = _rope_block(p, r, r.k, "k")
    if plan.mxu_rowsum:  # V and columns of ones: the PV matmul also sums the probabilities
      r.vx[:, :p.d] = r.v[...]
      r.vx[:, p.d:] = jnp.ones((bkv, r.vx.shape[1] - p.d), r.vx.dtype)
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
    if plan.mxu_rowsum:
      acc = r.acc[...]
      l, acc = acc[:, p.d:p.d + 1], acc[:, :p.d]
    else:
      acc = r.acc[...]
      l = r.l[...].sum(axis=1, keepdims=True)  # the lane partial sums -> the row's denominator
    r.o[...] = (acc / jnp.broadcast_to(jnp.where(l > 0, l, 1.0), acc.shape)).astype(r.o.dtype)
    if "lse" in names:
      # lse as a lane-replicated (bq, 128) tile, transposed so that row 0 holds it along lanes:
      # stored (1, bq), not (bq, 1), whose HBM tiles pad each row to 128 lanes
      m = r.m[...] * (_LN2 if plan.exp2 else 1.0)  # (exp2: m in log2 units)
      lw = jnp.broadcast_to(l, m.shape)
      lse = jnp.where(lw > 0, m + jnp.log(jnp.where(lw > 0, lw, 1.0)), NEG_INF)
      r.lse[...] = lse.T[0:1, :]


def _pallas_forward(q, k, v, sinks, bias, seg_q, seg_kv, mask, seed, *, p: _Problem, plan: _Plan, interpret,
                    with_lse: bool = True):
  """q, k, v in the kernel's layout -> (out in that layout, lse [B, H, Sq] f32, or None without ``with_lse``)."""
  bq = plan.bq
  args, names, in_specs = _q_major_inputs(q, k, v, sinks, bias, seg_q, seg_kv, mask, seed, p=p, plan=plan)
  sq = pl.squeezed
  q_ids = functools.partial(_q_major_ids, p, plan)
  out_specs = [_seq_spec(plan, bq, p.d, lambda *g: q_ids(g)[:3])]
  out_shape = [jax.ShapeDtypeStruct(_seq_shape(p, plan, p.h, p.sq), p.dtype)]
  names.append("o")
  if with_lse:
    # [B, H, q blocks, 1, bq]: the block's last two dims are the array's, legal for any bq, and
    # its (1, bq) rows take bq * 4 bytes in HBM (rounded up to 128 lanes)
    out_specs.append(pl.BlockSpec((sq, sq, sq, 1, bq), lambda *g: (*q_ids(g)[:3], 0, 0)))
    out_shape.append(jax.ShapeDtypeStruct((p.b, p.h, plan.nq, 1, bq), jnp.float32))
    names.append("lse")
  names += ["m", "l", "acc", "qs"]
  dacc = tiling.round_up(p.d, _LANES) if plan.mxu_rowsum else p.d   # acc's columns d..: the denominator
  scratch = [pltpu.VMEM((bq, _LANES), jnp.float32), pltpu.VMEM((bq, _LANES), jnp.float32),
             pltpu.VMEM((bq, dacc), jnp.float32),
             pltpu.VMEM((bq, p.d), p.dtype)]
  if p.rope is not None:
    names.append("ks")
    scratch.append(pltpu.VMEM((plan.bkv, p.d), p.dtype))
  if plan.mxu_rowsum:
    names.append("vx")
    scratch.append(pltpu.VMEM((plan.bkv, dacc), p.dtype))
  grid = _q_major_grid(p, plan)
  frac = 0.5 if p.causal else 1.0
  isz = p.dtype.itemsize
  cost = pl.CostEstimate(flops=int(4 * p.b * p.h * p.sq * p.skv * p.d * frac),
                         transcendentals=int(p.b * p.h * p.sq * p.skv * frac),
                         bytes_accessed=int(isz * (2 * q.size + k.size + v.size)))
  call = calls.pallas_call(
      functools.partial(_fwd_kernel, p=p, plan=plan, names=names),
      grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=0, grid=grid, in_specs=in_specs,
                                             out_specs=out_specs, scratch_shapes=scratch),
      out_shape=out_shape, compiler_params=_compiler_params(plan), cost_estimate=cost, interpret=interpret,
      name="flash_attention_fwd")
  outs = call(*args)
  if not with_lse:
    return outs[0], None
  return outs[0], outs[1].reshape(p.b, p.h, plan.nq * bq)[:, :, :p.sq]
