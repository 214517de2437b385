"""The backward of :func:`kernels.ssd`: a reverse pass over chunks, in Pallas.

Notation (per head, one chunk of ``L`` tokens, see :mod:`kernels.ssd`): ``cs_t`` the chunk-local
cumulative sums of the log-decay ``a_t``, ``sc_t`` the input scale (``dt_t``), ``h`` the state
entering the chunk, ``h'`` the state leaving it, ``S[t, s] = (C_t · B_s) exp(cs_t - cs_s)`` for
``s <= t`` (0 otherwise, and across a reset), ``u_s = sc_s x_s`` the scaled input, and::

    y_t = sum_s S[t, s] u_s + i_t (h C_t) + D x_t        i_t = exp(cs_t)           (into)
    h'  = e h + sum_s w_s u_s ⊗ B_s                      w_s = exp(cs_end - cs_s)  (weight), e = exp(cs_end)

(with resets, ``i_t = 0`` after the chunk's first reset, ``w_s = 0`` before its last one and ``e = 0``
if it has one). Given ``dy`` and ``dh'`` (the gradient of the state leaving the chunk), the chain rule
gives, chunk by chunk from the last one (``dh'`` of the last chunk is the cotangent of the final
state)::

    du_s  = sum_t S[t, s] dy_t + w_s dh' B_s          dx_s = sc_s du_s + D dy_s      dsc_s = x_s · du_s
    dh    = e dh' + sum_t i_t dy_t ⊗ C_t              (the gradient of the state entering the chunk)
    dCB[t, s] = sum_heads exp(cs_t - cs_s) (u_s · dy_t)   (s <= t, same segment; summed over the group's heads)
    dC_t  = sum_s dCB[t, s] B_s + sum_heads i_t h^T dy_t
    dB_s  = sum_t dCB[t, s] C_t + sum_heads w_s dh'^T u_s

and for the cumulative sums, each exponential ``exp(cs_t - cs_s)`` sends its term's contribution
``+`` to ``cs_t`` and ``-`` to ``cs_s``. With ``Q[t, s] = S[t, s] (u_s · dy_t)`` (the intra terms),
``R_t = i_t dy_t · (h C_t)`` and ``W_s = w_s u_s · (dh' B_s)`` (the state-update terms)::

    dcs_t = sum_s Q[t, s] - sum_u Q[u, t] + R_t - W_t + [t = end] <dh', h'>,   <dh', h'> = e <dh', h> + sum_s W_s

Both sums of ``Q`` are taken from the one matrix (rounded to the matmul dtype), as two thin MXU
products with a row of ones (the sum over lanes would be a cross-lane XLU reduction per row):
with bf16 inputs, taking one of them from ``du`` instead (``sum_u Q[u, t] + W_t = u_t · du_t``)
rounds the two sides differently, and the intra terms, which cancel in the chunk's sum, no longer
do (``dA`` was off by 20%). The gradient of the per-token log-decay is then the
reverse cumulative sum of ``dcs`` within each chunk (XLA, ``O(seq x heads)``), and ``dt``, ``A``
follow from ``a = dt * A`` by JAX's autodiff outside the ``custom_vjp``; ``dD`` is the sum of
``x_t · dy_t`` (a per-token row from the kernel, summed by XLA).

*The states entering the chunks* (``h`` above) are written by the forward kernel when the forward
is differentiated (``save_states``), in ``x``'s dtype: ``[batch, chunks, heads * head_dim, state]``,
``4 * state / L`` bytes per token and channel in f32 (4 at ``L = 128``, twice ``x``'s bf16), half
that in bf16. Recomputing them instead would need a forward state pass that reads ``x``, ``B`` and
``dt`` again *and* writes the same states to HBM (the reverse pass needs them last-chunk first), so
storing is strictly fewer bytes. bf16 storage loses nothing the forward keeps: it rounds the state
to bf16 for its ``C h`` matmul too, and the backward uses ``h`` only through bf16 matmuls and the
``e <dh', h>`` term.

*Kernel.* Grid ``(batch, head blocks, chunks reversed)`` (parallel, parallel, arbitrary), the
forward's chunk and heads per step (fewer heads if a step would not fit VMEM: 16 on v4 at the
benchmark shape) and the same transposed layout (tokens along lanes). ``dh`` (f32,
``[heads_per_step * head_dim, state]``) lives in a VMEM scratch, set from the final state's
cotangent at the first step (the last chunk) and written out as ``dh0`` after the last step. Per
step, on the MXU (bf16 operands for bf16 inputs, f32 accumulation): per group ``(C B^T)^T`` (as in
the forward), ``dC^T += B^T dCB^T`` and ``dB^T += C^T dCB``; per head ``(u · dy)^T`` (contracting
head_dim) and ``du^T = dy^T S`` ; for all the block's heads at once ``h C^T`` (for ``R``), ``dh' B^T``,
``dh'^T (w u)^T``, ``h^T (i dy)^T`` and ``(i dy)^T C``; and per head one of the two sums of ``Q``
(a row of ones times ``Q^T``, which yields it as a row without a cross-lane reduction). The ``L x L``
exponentials, masks, the ``dCB`` accumulation and the other sum of ``Q`` (over sublanes: cheaper on
the VPU than a second pass through the MXU) are VPU work.

``dB`` and ``dC`` come out per head block in f32 and XLA sums the blocks that share a group (none
when a block covers whole groups, as at the default blocks). Resets and a ragged last chunk are
handled as in the forward (stale lanes past the end are zeroed before any product).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.base import calls
from kernels.base import tiling
from kernels.base.backend import target_chip
from kernels.base.hardware import get_chip


def vmem_bytes(p, L: int, hb: int) -> int:
  """VMEM of one backward step: double-buffered blocks, scratch and the live values of a head."""
  gb = max(1, hb // p.heads_per_group)
  P, N = p.head_dim, p.state
  blocks = [((hb, P, L), p.dtype)] * 3  # x, dy, dx (transposed)
  blocks += [((gb, N, L), p.dtype)] * 2 + [((gb, N, L), jnp.float32)] * 2  # B, C; dB, dC
  blocks += [((hb, 1, L), jnp.float32)] * 5 + [((L, hb), jnp.float32)]  # rows (cs, sc, dcs, dsc, dD), cs columns
  blocks += [((hb * P, N), p.dtype)] + [((hb * P, N), jnp.float32)] * 2  # entering state, dh_T, dh0
  blocks += [((hb, 1, L), jnp.float32)]  # D
  if p.has_reset:
    blocks += [((1, L), jnp.float32), ((L, 1), jnp.float32)]
  scratch = [((hb * P, N), jnp.float32), ((gb, L, L), jnp.float32), ((gb, L, L), jnp.float32)]
  scratch += [((hb * P, L), p.dtype)] * 2  # (i dy)^T, (w u)^T
  scratch += [((hb * P, L), jnp.float32)] * 2  # h C^T, dh' B^T (values)
  scratch += [((L, L), jnp.float32)] * 6 + [((P, L), jnp.float32)] * 8  # live values of a head
  return tiling.vmem_footprint(blocks, scratch=scratch)


def heads_per_step(p, L: int, hb: int, chip) -> int:
  """The forward's heads per step, or fewer if the backward's step would not fit the chip's VMEM (v4's 16 MiB
  at 32 heads x 64): the largest valid divisor of ``hb`` that fits."""
  hpg = p.heads_per_group
  for h in range(hb, 0, -1):
    if hb % h == 0 and p.heads % h == 0 and (hpg % h == 0 or h % hpg == 0):
      if int(vmem_bytes(p, L, h) * 1.25) + (1 << 20) <= chip.vmem_bytes:
        return h
  return 1


def flops(p, L: int) -> int:
  """Useful MXU FLOPs of the backward: per chunk and group C B^T, B^T dCB^T, C^T dCB; per head
  (u . dy)^T and dy^T S (L x L x head_dim each) and five head_dim x state x L products."""
  chunks = p.batch * tiling.cdiv(p.seq, L)
  return 2 * chunks * (3 * p.groups * L * L * p.state + p.heads * (2 * L * L * p.head_dim + 5 * L * p.state * p.head_dim))


def split_refs(refs, *groups):
  """A kernel's refs cut into consecutive groups, in order. A group is a count, or ``(count,
  present)`` for an optional operand: absent, it takes no refs and stands as ``count`` Nones."""
  out, i = [], 0
  for g in groups:
    n, present = g if isinstance(g, tuple) else (g, True)
    out.append(tuple(refs[i:i + n]) if present else (None,) * n)
    i += n if present else 0
  assert i == len(refs), (i, len(refs))
  return out


def chunk_inputs(p, L: int, c, gb: int, b_ref, c_ref, segr_ref, segc_ref):
  """What both kernels (forward and backward) derive first from a chunk's inputs:

  * ``clean``: zeroes the tokens (lanes) past the sequence's end (stale VMEM, maybe NaN);
  * ``B^T``, ``C^T`` per group of the block, ``[state, L]``, cleaned;
  * the intra-chunk mask ``[s, t]``: ``s <= t`` (and, with resets, in the same segment);
  * with resets, ``(first, in_last, keep_carry)``: ``t`` precedes the chunk's first reset (the
    carried state reaches it), ``s`` is in the chunk's last segment, and the chunk has no reset
    (the state carries across it); without resets, three Nones.
  """
  if p.seq % L:
    valid = (lax.broadcasted_iota(jnp.int32, (1, L), 1) + c * L) < p.seq
    clean = lambda v: jnp.where(valid, v, jnp.zeros_like(v))  # noqa: E731
  else:
    clean = lambda v: v  # noqa: E731
  Bt = [clean(b_ref[g]) for g in range(gb)]
  Ct = [clean(c_ref[g]) for g in range(gb)]
  s_idx = lax.broadcasted_iota(jnp.int32, (L, L), 0)  # source token s along sublanes
  t_idx = lax.broadcasted_iota(jnp.int32, (L, L), 1)  # target token t along lanes
  mask = s_idx <= t_idx
  if not p.has_reset:
    return clean, Bt, Ct, mask, (None, None, None)
  segr, segc = segr_ref[...], segc_ref[...]  # (1, L), (L, 1)
  return clean, Bt, Ct, mask & (segc == segr), (segr == 0.0, segr == segr[:, L - 1:L], segr[:, L - 1:L] == 0.0)


def _backward_kernel(*refs, p, plan):
  """One chunk (the grid's last chunk first) of ``hb`` heads, transposed like the forward."""
  L, hb = plan.L, plan.hb
  hpg = p.heads_per_group
  ((x_ref, dy_ref, b_ref, c_ref, csr_ref, scr_ref, csc_ref), (segr_ref, segc_ref), (d_ref,), (h_ref, dhT_ref),
   (dx_ref, db_ref, dc_ref, dcs_ref, dsc_ref), (dd_ref,), (dh0_ref, dh_ref, cb_ref, dcb_ref, idy_ref, xw_ref)) = \
      split_refs(refs, 7, (2, p.has_reset), (1, p.has_d), 2, 5, (1, p.has_d), 6)

  step = pl.program_id(2)
  c = plan.n_chunks - 1 - step  # the chunk this step works on
  P = p.head_dim
  mm = p.dtype
  f32 = jnp.float32
  prec = lax.Precision.HIGHEST if p.dtype == jnp.float32 else None
  dot = functools.partial(lax.dot_general, preferred_element_type=f32, precision=prec)
  NN, TT, NT = (((1,), (0,)), ((), ())), (((0,), (0,)), ((), ())), (((1,), (1,)), ((), ()))  # A B, A^T B, A B^T

  @pl.when(step == 0)
  def _():
    dh_ref[...] = dhT_ref[...]

  gb = max(1, hb // hpg)
  hpb = hb // gb  # heads of the block per group
  clean, Bt, Ct, mask, (first, in_last, keep_carry) = chunk_inputs(p, L, c, gb, b_ref, c_ref, segr_ref, segc_ref)
  is_end = lax.broadcasted_iota(jnp.int32, (1, L), 1) == L - 1
  ones8 = jnp.ones((8, L), mm)
  for g in range(gb):
    cb_ref[g] = dot(Bt[g], Ct[g], TT)  # (C B^T)^T [s, t] = B_s . C_t
    dcb_ref[g] = jnp.zeros((L, L), f32)

  h_mm = h_ref[...].astype(mm)  # (hb * P, N): the state entering the chunk
  dh_new = dh_ref[...]  # (hb * P, N) f32: the gradient of the state leaving it
  dh_mm = dh_new.astype(mm)
  rows_of = lambda g: slice(g * hpb * P, (g + 1) * hpb * P)  # noqa: E731
  hc = [dot(h_mm[rows_of(g)], Ct[g], NN) for g in range(gb)]  # h C^T  [hpb * P, L]
  dhb = [dot(dh_mm[rows_of(g)], Bt[g], NN) for g in range(gb)]  # dh' B^T [hpb * P, L]
  ends = []
  for hl in range(hb):
    g = hl // hpg if hb > hpg else 0
    local = hl - g * hpb
    rows_h = slice(hl * P, (hl + 1) * P)
    rows_l = slice(local * P, (local + 1) * P)
    xt = clean(x_ref[hl]).astype(f32)  # (P, L)
    dyt_mm = clean(dy_ref[hl])  # (dy arrives in the matmul dtype)
    dyt = dyt_mm.astype(f32)
    cs_row, sc_row = csr_ref[hl], scr_ref[hl]  # (1, L)
    cs_end = csc_ref[L - 1:L, hl:hl + 1]  # (1, 1)
    decay = jnp.exp(jnp.where(mask, cs_row - csc_ref[:, hl:hl + 1], -jnp.inf))  # exp(cs_t - cs_s) [s, t]
    into = jnp.exp(cs_row)
    w = jnp.exp(cs_end - cs_row)
    end = jnp.exp(cs_end)
    if p.has_reset:
      into = jnp.where(first, into, 0.0)
      w = jnp.where(in_last, w, 0.0)
      end = jnp.where(keep_carry, end, 0.0)
    ut = xt * sc_row  # u^T = (sc x)^T
    udy = dot(ut.astype(mm), dyt_mm, TT)  # [s, t] = u_s . dy_t
    st = cb_ref[g] * decay  # S^T
    q = st * udy  # Q^T
    dcb_ref[g] += decay * udy
    dst = dhb[g][rows_l] * w  # w_s (dh' B_s)
    du = dot(dyt_mm, st.astype(mm), NT) + dst  # du^T [P, L]: sum_t S[t, s] dy_t + w_s dh' B_s
    dx = du * sc_row
    if p.has_d:
      dx = dx + dyt * d_ref[hl]
      dd_ref[hl] = jnp.sum(xt * dyt, axis=0, keepdims=True)
    dx_ref[hl] = dx.astype(dx_ref.dtype)
    dsc = jnp.sum(xt * du, axis=0, keepdims=True)  # (1, L)
    r = into * jnp.sum(dyt * hc[g][rows_l], axis=0, keepdims=True)  # R_t
    ws = jnp.sum(ut * dst, axis=0, keepdims=True)  # W_s
    carry = end * jnp.sum(dh_new[rows_h] * h_ref[rows_h].astype(f32), axis=(0, 1), keepdims=True)  # e <dh', h>
    # both sums of Q, as rows, from the one (rounded) matrix, so that the intra terms cancel in the chunk's
    # sum up to f32 accumulation order: sum_s Q[t, s] over sublanes on the VPU, and sum_u Q[u, s] over lanes
    # on the MXU (a row of ones times Q^T: no cross-lane reduction, no transpose)
    q_mm = q.astype(mm)
    qsum = jnp.sum(q_mm.astype(f32), axis=0, keepdims=True) - dot(ones8, q_mm, NT)[0:1]
    dcs_ref[hl] = qsum + r - ws + jnp.where(is_end, carry + jnp.sum(ws), 0.0)
    dsc_ref[hl] = dsc
    idy_ref[rows_h] = (dyt * into).astype(mm)
    xw_ref[rows_h] = (ut * w).astype(mm)
    ends.append(end)
  for g in range(gb):
    rows_g = rows_of(g)
    dcb = dcb_ref[g].astype(mm)
    dc_ref[g] = dot(Bt[g], dcb, NN) + dot(h_mm[rows_g], idy_ref[rows_g], TT)
    db_ref[g] = dot(Ct[g], dcb, NT) + dot(dh_mm[rows_g], xw_ref[rows_g], TT)
    dh_ref[rows_g] = dot(idy_ref[rows_g], Ct[g], NT)  # sum_t i_t dy_t ⊗ C_t
  for hl in range(hb):
    rows_h = slice(hl * P, (hl + 1) * P)
    dh_ref[rows_h] += dh_new[rows_h] * ends[hl]

  @pl.when(step == plan.n_chunks - 1)
  def _():
    dh0_ref[...] = dh_ref[...]


def chunk_cumsum(a, axis: int = 2, reverse: bool = False):
  """Cumulative sums along ``axis`` of ``a`` (f32 or f64; a chunk's tokens), as one matmul with a triangle
  of ones at full precision: the products are exact and the sums are float additions, as in a sequential
  cumsum. (XLA:TPU lowers ``jnp.cumsum`` to a reduce-window as wide as the chunk: L additions per element.)
  ``reverse``: the sums over the tokens at or after each one."""
  L = a.shape[axis]
  m, l = jnp.arange(L)[:, None], jnp.arange(L)[None, :]
  tri = ((m >= l) if reverse else (m <= l)).astype(a.dtype)  # [source m, target l]
  out = jnp.tensordot(a, tri, axes=((axis,), (0,)), precision=lax.Precision.HIGHEST)
  return jnp.moveaxis(out, -1, axis)


def token_operands(logdecay, scale, reset, D, p, L: int, nc: int, hb: int, chunk):
  """The per-token operands both kernels read after their token blocks, and their BlockSpecs
  (``chunk(c)``: the chunk of grid step ``c``): the chunk-local cumulative sums of the log-decay
  (f32, padded) as rows ``[b, heads, 1, T]`` and as columns ``[b, head blocks, T, hb]``, the
  input scale as rows; with resets the chunk-local segment numbers as a row and a column; and
  ``D`` as per-head rows (:func:`d_rows`)."""
  f32 = jnp.float32
  H, Tp = p.heads, nc * L
  pad = Tp - p.seq
  a = jnp.pad(logdecay.astype(f32), ((0, 0), (0, pad), (0, 0)))
  cs = chunk_cumsum(a.reshape(p.batch, nc, L, H)).reshape(p.batch, Tp, H)
  sc = jnp.pad(scale.astype(f32), ((0, 0), (0, pad), (0, 0)))
  rows = lambda v: jnp.swapaxes(v, 1, 2).reshape(p.batch, H, 1, Tp)  # noqa: E731
  row = pl.BlockSpec((None, hb, 1, L), lambda b, h, c: (b, h, 0, chunk(c)))
  args = [rows(cs), rows(sc), jnp.swapaxes(cs.reshape(p.batch, Tp, H // hb, hb), 1, 2)]
  specs = [row, row, pl.BlockSpec((None, None, L, hb), lambda b, h, c: (b, h, chunk(c), 0))]
  if p.has_reset:
    r = jnp.pad(reset, ((0, 0), (0, pad))).reshape(p.batch, nc, L).astype(jnp.int32)
    seg = jnp.cumsum(r, axis=2).astype(f32).reshape(p.batch, Tp)
    args += [seg.reshape(p.batch, 1, Tp), seg.reshape(p.batch, Tp, 1)]
    specs += [pl.BlockSpec((None, 1, L), lambda b, h, c: (b, 0, chunk(c))),
              pl.BlockSpec((None, L, 1), lambda b, h, c: (b, chunk(c), 0))]
  if p.has_d:
    args.append(d_rows(D, H, L))
    specs.append(pl.BlockSpec((hb, 1, L), lambda b, h, c: (h, 0, 0)))
  return args, specs


def d_rows(D, heads: int, L: int):
  """``D`` as one row per head, ``[heads, 1, L]`` f32 with every entry ``D[h]``: the kernels scale a head's
  ``[head_dim, L]`` tile by it with a sublane broadcast. (A ``[head_dim, 1]`` column would need a lane
  broadcast per head and step, which the cost model charges about as much as the whole ``D x`` term.)"""
  return jnp.broadcast_to(D.astype(jnp.float32)[:, None, None], (heads, 1, L))


def backward(x, scale, logdecay, B, C, D, reset, states, dy, dhT, *, p, plan, interpret):
  """The cotangents of ``(x, scale, logdecay, B, C, D, h0)`` (``D``'s is None without ``D``), from the
  forward's entering states ``[b, chunks, h * p, n]``, ``dy`` ``[b, t, h, p]`` and ``dhT`` ``[b, h, p, n]``."""
  chip = target_chip() or get_chip("v5e")
  plan = dataclasses.replace(plan, hb=heads_per_step(p, plan.L, plan.hb, chip))
  L, hb = plan.L, plan.hb
  nc = plan.n_chunks
  Tp = nc * L
  H, P, N, G = p.heads, p.head_dim, p.state, p.groups
  hpg = p.heads_per_group
  gb = max(1, hb // hpg)
  nhb = H // hb
  f32 = jnp.float32
  tr = lambda v: jnp.transpose(v, (0, 2, 3, 1))  # noqa: E731  tokens last
  rc = lambda c: nc - 1 - c  # noqa: E731  the grid walks the chunks backwards

  gmap = (lambda h: h) if hb > hpg else (lambda h: lax.div(h * hb, hpg))
  tok = pl.BlockSpec((None, hb, P, L), lambda b, h, c: (b, h, 0, rc(c)))
  grp = pl.BlockSpec((None, gb, N, L), lambda b, h, c: (b, gmap(h), 0, rc(c)))
  row = pl.BlockSpec((None, hb, 1, L), lambda b, h, c: (b, h, 0, rc(c)))
  scalars, scalar_specs = token_operands(logdecay, scale, reset, D, p, L, nc, hb, rc)
  in_specs = [tok, tok, grp, grp] + scalar_specs
  args = [tr(x), tr(dy.astype(p.dtype)), tr(B), tr(C)] + scalars
  state_spec = pl.BlockSpec((None, hb * P, N), lambda b, h, c: (b, h, 0))
  args += [states, dhT.astype(f32).reshape(p.batch, H * P, N)]
  in_specs += [pl.BlockSpec((None, None, hb * P, N), lambda b, h, c: (b, rc(c), h, 0)), state_spec]

  part = pl.BlockSpec((None, None, gb, N, L), lambda b, h, c: (b, h, 0, 0, rc(c)))
  out_specs = [tok, part, part, row, row]
  out_shape = [jax.ShapeDtypeStruct((p.batch, H, P, p.seq), p.dtype),
               jax.ShapeDtypeStruct((p.batch, nhb, gb, N, p.seq), f32),
               jax.ShapeDtypeStruct((p.batch, nhb, gb, N, p.seq), f32),
               jax.ShapeDtypeStruct((p.batch, H, 1, Tp), f32), jax.ShapeDtypeStruct((p.batch, H, 1, Tp), f32)]
  if p.has_d:
    out_specs.append(row)
    out_shape.append(jax.ShapeDtypeStruct((p.batch, H, 1, Tp), f32))
  out_specs.append(state_spec)
  out_shape.append(jax.ShapeDtypeStruct((p.batch, H * P, N), f32))
  isz = p.dtype.itemsize
  bytes_accessed = (3 * x.size + 2 * B.size + states.size) * isz + 2 * p.batch * nhb * gb * N * p.seq * 4 \
      + 2 * p.batch * H * P * N * 4
  out = calls.pallas_call(
      functools.partial(_backward_kernel, p=p, plan=plan),
      grid=(p.batch, nhb, nc),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      scratch_shapes=[pltpu.VMEM((hb * P, N), f32), pltpu.VMEM((gb, L, L), f32), pltpu.VMEM((gb, L, L), f32),
                      pltpu.VMEM((hb * P, L), p.dtype), pltpu.VMEM((hb * P, L), p.dtype)],
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"),
                                           vmem_limit_bytes=tiling.vmem_limit(vmem_bytes(p, L, hb), chip)),
      cost_estimate=pl.CostEstimate(flops=int(flops(p, L)), transcendentals=int(p.batch * Tp * H * (L + 3)),
                                    bytes_accessed=int(bytes_accessed)),
      interpret=interpret, name="ssd_bwd",
  )(*args)
  dxt, db, dc, dcs, dsc = out[:5]
  dd = out[5] if p.has_d else None
  dh0 = out[-1].reshape(p.batch, H, P, N)
  dx = jnp.transpose(dxt, (0, 3, 1, 2))
  # dB, dC: [b, head blocks, groups of the block, n, t] -> [b, t, groups, n], summing the blocks of a group
  fold = lambda v: jnp.transpose(v.reshape(p.batch, G, -1, N, p.seq).sum(axis=2), (0, 3, 1, 2))  # noqa: E731
  dB, dC = fold(db), fold(dc)
  # d(log-decay)_t = sum of dcs over the chunk's tokens u >= t (a reverse cumulative sum within each chunk)
  dcs = dcs.reshape(p.batch, H, nc, L)
  dlog = chunk_cumsum(dcs, axis=3, reverse=True).reshape(p.batch, H, Tp)[:, :, :p.seq]
  dscale = dsc.reshape(p.batch, H, Tp)[:, :, :p.seq]
  dD = None if dd is None else dd.reshape(p.batch, H, Tp).sum(axis=(0, 2))
  return dx, jnp.swapaxes(dscale, 1, 2), jnp.swapaxes(dlog, 1, 2), dB, dC, dD, dh0
