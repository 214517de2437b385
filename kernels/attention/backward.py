"""The backward kernels of :mod:`kernels.attention`: dk/dv (with dq fused when it fits) and dq.

Both recompute the probabilities from the forward's ``lse`` and ``D = rowsum(dO * O)``.

* dk/dv: grid ``(batch, kv heads, kv blocks, group, q blocks)`` (folded when causal), the two
  inner axes walking the q blocks of every q head in the GQA group, so dk and dv are summed over
  the group in VMEM without races. It computes the transposed tile ``s^T = k q^T``, which keeps
  every matmul in the MXU's native form and puts ``lse`` and ``D`` on the lane axis, as stored.
  When ``plan.fused_dq``, it also accumulates dq for all the group's q rows in VMEM.
* dq: the forward's grid, ``dq += ds k``, when dq is not fused (long sequences, a bias, whose
  gradient it writes). It reads ``lse`` and ``D`` as lane rows too (compact in HBM) and
  transposes them into ``(bq, 1)`` columns once per q block.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.base import calls
from kernels.attention.plan import (NEG_INF, _NN, _NT, _TN, _all, _block_needed, _branches, _clamp,
                                     _compiler_params, _dense_block, _full_block, _keep_tile, _kv_major_grid,
                                     _kv_major_ids, _masked_tiles, _Plan, _Problem, _q_major_grid, _q_major_ids,
                                     _q_major_inputs, _q_range, _Refs, _add_rope_inputs, _rope_block, _rope_rotate,
                                     _rope_rows, _scaled_q_rows, _seq_shape, _seq_spec, _small_inputs,
                                     _visibility_tile, _zero_rows)


def _dq_kernel(*refs, p: _Problem, plan: _Plan, names):
  r = _Refs(refs, names)
  b, h, i, j, first, last, active = _q_major_ids(p, plan, [pl.program_id(a) for a in range(4)])
  bq, bkv = plan.bq, plan.bkv

  @pl.when(first)
  def _init():
    r.acc[...] = jnp.zeros(r.acc.shape, jnp.float32)
    # lse and D arrive as (1, bq) lane rows (compact in HBM); the tiles want (bq, 1) columns:
    # transpose once per q block, not per step
    for row, col in ((r.lse, r.lse_col), (r.delta, r.delta_col)):
      col[...] = jnp.broadcast_to(row[...], (128, bq)).T[:, :1]
    if p.rope is not None:  # the rotated, scaled q block, once per q block
      r.qs[...] = _rope_block(p, r, r.q, "q", p.scale)

  def tile(rows, cols, masked: bool):
    """dq of q rows ``rows`` from keys ``cols`` of the kv block (static slices)."""
    q = _scaled_q_rows(r.q, rows, p.scale) if p.rope is None else r.qs[rows, :]
    k, v, do = (r.k if p.rope is None else r.ks)[cols, :], r.v[cols, :], r.do[rows, :]
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
    e = jnp.exp(s - r.lse_col[rows, :])   # lse of a row with nothing visible is +inf here (see f_bwd): e = 0
    dp = lax.dot_general(do, v, _NT, preferred_element_type=jnp.float32)
    if p.dropout_rate:
      keep = _keep_tile(p, r.seed[0:1, 0:1], b, h, qpos, kpos)
      dp = jnp.where(keep, dp * (1.0 / (1.0 - p.dropout_rate)), 0.0)
    ds = e * (dp - r.delta_col[rows, :])
    if p.bias_shape is not None:
      r.dbias[rows, cols] = ds
    if t is not None:
      ds = ds * (1.0 - t * t)
    r.acc[rows, :] += lax.dot_general(ds.astype(k.dtype), k, _NN, preferred_element_type=jnp.float32)

  def step(masked: bool):
    if p.rope is not None:
      r.ks[...] = _rope_block(p, r, r.k, "k")
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
    dq = r.acc[...] * p.scale
    if p.rope is not None:  # the gradient of the rotated q, rotated back (the rotation is orthogonal)
      dq = _rope_rotate(p, dq, _rope_rows(r, "q"), inverse=True)
    r.dq[...] = dq.astype(r.dq.dtype)


def _dkv_kernel(*refs, p: _Problem, plan: _Plan, names):
  r = _Refs(refs, names)
  b, kh, j, g, i, first, last, active = _kv_major_ids(p, plan, [pl.program_id(a) for a in range(5)])
  h = kh * p.group + g
  bq, bkv = plan.bq, plan.bkv

  @pl.when(first)
  def _init():
    r.dk_acc[...] = jnp.zeros(r.dk_acc.shape, jnp.float32)
    r.dv_acc[...] = jnp.zeros(r.dv_acc.shape, jnp.float32)
    if p.rope is not None:  # the k block stays for the whole accumulation: rotate it once
      r.ks[...] = _rope_block(p, r, r.k, "k")

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
    q = _scaled_q_rows(r.q, q_cols, p.scale) if p.rope is None else r.qs[q_cols, :]
    k, v, do = (r.k if p.rope is None else r.ks)[kv_rows, :], r.v[kv_rows, :], r.do[q_cols, :]
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
      dq = lax.dot_general(dst.astype(k.dtype), k, _TN, preferred_element_type=jnp.float32)
      if p.rope is not None:  # rotated back per tile: the accumulator spans every q block
        dq = _rope_rotate(p, dq, _rope_rows(r, "q", q_cols), inverse=True)
      r.dq_acc[g, rows, :] += dq

  def step(masked: bool):
    if p.rope is not None:  # the q block changes every step
      r.qs[...] = _rope_block(p, r, r.q, "q", p.scale)
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
    if p.rope is not None:
      r.dk[...] = _rope_rotate(p, r.dk_acc[...], _rope_rows(r, "k"), inverse=True).astype(r.dk.dtype)
    else:
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
  row_stat = pl.BlockSpec((sq, sq, 1, bq), lambda *g: (lambda b, h, i: (b, h, 0, i))(*q_ids(g)[:3]))
  extra = [("do", do, _seq_spec(plan, bq, p.d, lambda *g: q_ids(g)[:3])),
           ("lse", lse.reshape(p.b, p.h, 1, sq_pad), row_stat),
           ("delta", delta.reshape(p.b, p.h, 1, sq_pad), row_stat)]
  args, names, in_specs = _q_major_inputs(q, k, v, sinks, bias, seg_q, seg_kv, mask, seed, p=p, plan=plan,
                                          extra=extra)
  out_specs = [_seq_spec(plan, bq, p.d, lambda *g: q_ids(g)[:3])]
  out_shape = [jax.ShapeDtypeStruct(_seq_shape(p, plan, p.h, p.sq), p.dtype)]
  names.append("dq")
  if p.bias_shape is not None:
    out_specs.append(pl.BlockSpec((sq, sq, bq, bkv), lambda *g: q_ids(g)[:4]))
    out_shape.append(jax.ShapeDtypeStruct((p.b, p.h, p.sq, p.skv), jnp.float32))
    names.append("dbias")
  names += ["acc", "lse_col", "delta_col"]
  scratch = [pltpu.VMEM((bq, p.d), jnp.float32), pltpu.VMEM((bq, 1), jnp.float32), pltpu.VMEM((bq, 1), jnp.float32)]
  if p.rope is not None:
    names += ["qs", "ks"]
    scratch += [pltpu.VMEM((bq, p.d), p.dtype), pltpu.VMEM((bkv, p.d), p.dtype)]
  cost = pl.CostEstimate(flops=int(6 * p.b * p.h * p.sq * p.skv * p.d * frac),
                         transcendentals=int(p.b * p.h * p.sq * p.skv * frac),
                         bytes_accessed=int(isz * (3 * q.size + k.size + v.size)))
  call = calls.pallas_call(
      functools.partial(_dq_kernel, p=p, plan=plan, names=names),
      grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=0, grid=_q_major_grid(p, plan),
                                             in_specs=in_specs, out_specs=out_specs,
                                             scratch_shapes=scratch),
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
  if p.rope is not None:
    _add_rope_inputs(p, plan, lambda *g: qids(*g)[2], lambda *g: kvids(*g)[2], args, names, in_specs)
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
  if p.rope is not None:
    names += ["qs", "ks"]
    scratch += [pltpu.VMEM((bq, p.d), p.dtype), pltpu.VMEM((bkv, p.d), p.dtype)]
  cost = pl.CostEstimate(flops=int((10 if plan.fused_dq else 8) * p.b * p.h * p.sq * p.skv * p.d * frac),
                         transcendentals=int(p.b * p.h * p.sq * p.skv * frac),
                         bytes_accessed=int(isz * (2 * q.size + 2 * k.size + 2 * v.size)))
  call = calls.pallas_call(
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
