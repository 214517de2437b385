"""Ring attention: flash attention over a sequence sharded along a ring of chips (see :mod:`kernels.distributed`)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kernels.attention import api as _attention
from kernels.base import partition
from kernels.base.backend import check_implementation
from kernels.base.errors import check
from kernels.distributed.ring import SEQUENCE_ORDERS, _axis, _from_zigzag, _shift, _slice, _to_zigzag

# ---------------------------------------------------------------------------------
# Ring attention
# ---------------------------------------------------------------------------------


def _merge(o1, l1, o2, l2, lse_axis_to_layout):
  """Two partial attentions over disjoint key sets -> the attention over both (log-sum-exp rule)."""
  m = jnp.maximum(l1, l2)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  w1, w2 = jnp.exp(l1 - m), jnp.exp(l2 - m)
  tot = w1 + w2
  lse = jnp.where(tot > 0, m + jnp.log(jnp.where(tot > 0, tot, 1.0)), -jnp.inf)
  safe = jnp.where(tot > 0, tot, 1.0)
  o = o1 * lse_axis_to_layout(w1 / safe) + o2 * lse_axis_to_layout(w2 / safe)
  return o, lse


def ring_attention(q, k, v, *, axis_name, causal=False, segment_ids=None, sliding_window=None, scale=None,
                   layout="BSHD", sequence_order="natural", block_sizes=None, implementation=None, interpret=None):
  """Attention over a sequence sharded along ``axis_name``: equal to :func:`kernels.flash_attention` of
  the whole sequence, with O(seq / devices) memory per chip. Call inside ``jax.shard_map``.

  Args:
    q: the local ``[batch, seq_local, heads, head_dim]`` (``layout="BSHD"``) or BHSD block.
    k, v: the local ``[batch, seq_local, kv_heads, head_dim]`` blocks (GQA: only these travel).
    axis_name: the mesh axis the sequence is sharded over.
    causal: causal attention over the global sequence.
    segment_ids: ``[batch, seq_local]`` ints, the local block of the global ids (packed documents);
      with ``sliding_window``, ids equal to ``-2**31`` are reserved.
    sliding_window: ``W`` with ``causal`` (a query sees itself and the ``W - 1`` keys before it): no
      ring then, only a halo: each device receives the last ``W - 1`` keys and values before its
      block from the ``ceil((W - 1) / seq_local)`` devices before it (one ``ppermute`` each) and runs
      one windowed :func:`kernels.flash_attention` over them and its own; the work is balanced
      without reordering (``sequence_order`` must be ``"natural"``). Not supported without ``causal``.
    scale: as :func:`kernels.flash_attention`.
    layout: ``"BSHD"`` or ``"BHSD"``.
    sequence_order: ``"natural"`` (the sequence sharded contiguously: device ``i`` holds tokens
      ``i * seq_local ..``; with ``causal`` the blocks are moved to the zig-zag order and back) or
      ``"zigzag"`` (the caller already holds :func:`zigzag_indices`' order; nothing is moved).
      Without ``causal`` the order does not matter and nothing is moved.
    block_sizes, implementation, interpret: passed to every :func:`kernels.flash_attention` call.

  Returns:
    The local block of the output, in q's layout, dtype and sequence order. Differentiable in q, k, v.
  """
  check(layout in _attention.LAYOUTS, "layout", layout, f"must be one of {_attention.LAYOUTS}")
  check(sequence_order in SEQUENCE_ORDERS, "sequence_order", sequence_order, f"must be one of {SEQUENCE_ORDERS}")
  check_implementation(implementation, interpret)
  p, _, _ = _attention._validate(q, k, v, causal=causal, segment_ids=segment_ids, sliding_window=sliding_window,
                                 logits_soft_cap=None, scale=scale, bias=None, mask=None, sinks=None,
                                 dropout_rate=0.0, dropout_key=None, layout=layout)
  check(p.sq == p.skv, "k", k, f"the local q and k/v blocks must be equally long (got {p.sq} and {p.skv}): "
        "ring attention shards one sequence")
  n, i = _axis(axis_name)
  if sliding_window is not None:
    check(causal, "sliding_window", sliding_window, "needs causal=True in ring_attention (a symmetric band "
          "would need the blocks after this one too)")
    check(sequence_order == "natural", "sequence_order", sequence_order,
          "must be 'natural' with sliding_window (a window balances the work in the natural order)")
    return _windowed(q, k, v, segment_ids, axis_name=axis_name, n=n, i=i, window=int(p.window), scale=p.scale,
                     layout=layout, block_sizes=block_sizes, implementation=implementation, interpret=interpret)
  zigzag = causal and n > 1
  if zigzag:
    check(p.sq % 2 == 0, "q", q, f"causal ring attention cuts each local block in two (zig-zag); its length "
          f"{p.sq} must be even")
  seq_axis = 1 if layout == "BSHD" else 2
  move = zigzag and sequence_order == "natural"
  if move:
    q, k, v = (_to_zigzag(x, axis_name, n, i, seq_axis) for x in (q, k, v))
    segment_ids = _to_zigzag(segment_ids, axis_name, n, i, 1)
  out = _ring(q, k, v, segment_ids, axis_name=axis_name, n=n, causal=causal, zigzag=zigzag, scale=p.scale,
              layout=layout, block_sizes=block_sizes, implementation=implementation, interpret=interpret)
  return _from_zigzag(out, axis_name, n, i, seq_axis) if move else out


_NO_SEGMENT = np.iinfo(np.int32).min  # the segment of keys before the sequence's start (sliding windows)


def _windowed(q, k, v, seg, *, axis_name, n, i, window, scale, layout, block_sizes, implementation, interpret):
  """Causal sliding-window attention over a contiguously sharded sequence: a halo, not a ring."""
  seq_axis = 1 if layout == "BSHD" else 2
  L = q.shape[seq_axis]
  halo = min(window - 1, (n - 1) * L)  # keys before this block that a query of it can see
  own = jnp.zeros((q.shape[0], L), jnp.int32) if seg is None else seg.astype(jnp.int32)
  ks, vs, ss = [], [], []
  for d in range(-(-halo // L), 0, -1):  # the blocks of devices i - d, oldest first
    start = max(0, d * L - halo)  # only the rows the window reaches
    take = lambda x, axis: _slice(x, axis, start, L)  # noqa: E731
    kd, vd, sd = _shift((take(k, seq_axis), take(v, seq_axis), take(own, 1)), axis_name, n, d)
    ks.append(kd)
    vs.append(vd)
    ss.append(jnp.where(i >= d, sd, _NO_SEGMENT))  # device i - d wrapped round the ring: before the start
  keys = jnp.concatenate(ks + [k], seq_axis)
  values = jnp.concatenate(vs + [v], seq_axis)
  # kv_len - q_len = halo: query r sits at key position halo + r, as in the global sequence
  return _attention.flash_attention(q, keys, values, causal=True, sliding_window=window,
                                    segment_ids=(own, jnp.concatenate(ss + [own], 1)), scale=scale, layout=layout,
                                    block_sizes=block_sizes, implementation=implementation, interpret=interpret)


def _ring(q, k, v, seg, *, axis_name, n, causal, zigzag, scale, layout, block_sizes, implementation, interpret):
  seq_axis = 1 if layout == "BSHD" else 2
  L = q.shape[seq_axis]
  C = L // 2
  kw = dict(scale=scale, layout=layout, block_sizes=block_sizes, implementation=implementation,
            interpret=interpret)
  to_layout = (lambda l: jnp.swapaxes(l, 1, 2)[..., None]) if layout == "BSHD" else (lambda l: l[..., None])

  def pad_rows(x, axis, value):  # a result for q's second half -> all of q's rows (the first half `value`)
    widths = [(0, 0)] * x.ndim
    widths[axis] = (C, 0)
    return jnp.pad(x, widths, constant_values=value)

  def fwd_block(q, k, v, sq, skv, causal):
    seg = None if sq is None else (sq, skv)
    out, lse = _attention.flash_attention(q, k, v, causal=causal, segment_ids=seg, return_residuals=True, **kw)
    return out.astype(jnp.float32), lse

  def visiting_fwd(q, kc, vc, sq, sc, earlier):
    """A visiting k/v block (not this device's): all of it against all of q, or, zig-zag, one half."""
    if not zigzag:
      return fwd_block(q, kc, vc, sq, sc, False)

    def from_earlier():  # its first chunk precedes both of ours; its second follows both
      return fwd_block(q, _slice(kc, seq_axis, 0, C), _slice(vc, seq_axis, 0, C), sq, _slice(sc, 1, 0, C), False)

    def from_later():  # only our second chunk sees it, and sees all of it
      o, l = fwd_block(_slice(q, seq_axis, C, L), kc, vc, _slice(sq, 1, C, L), sc, False)
      return pad_rows(o, seq_axis, 0.0), pad_rows(l, 2, -jnp.inf)
    return lax.cond(earlier, from_earlier, from_later)

  def grads_block(q, k, v, sq, skv, out, lse, do, causal):
    seg = None if sq is None else (sq, skv)
    dq, dk, dv = _attention.attention_block_grads(q, k, v, out, lse, do, causal=causal, segment_ids=seg, **kw)
    return dq.astype(jnp.float32), dk.astype(jnp.float32), dv.astype(jnp.float32)

  def visiting_grads(q, kc, vc, sq, sc, out, lse, do, earlier):
    if not zigzag:
      return grads_block(q, kc, vc, sq, sc, out, lse, do, False)

    def from_earlier():
      dq, dk, dv = grads_block(q, _slice(kc, seq_axis, 0, C), _slice(vc, seq_axis, 0, C), sq, _slice(sc, 1, 0, C),
                               out, lse, do, False)
      pad = lambda x: jnp.pad(x, [(0, C) if a == seq_axis else (0, 0) for a in range(x.ndim)])  # noqa: E731
      return dq, pad(dk), pad(dv)

    def from_later():
      h = lambda x: _slice(x, seq_axis, C, L)  # noqa: E731
      dq, dk, dv = grads_block(h(q), kc, vc, _slice(sq, 1, C, L), sc, h(out), _slice(lse, 2, C, L), h(do), False)
      return pad_rows(dq, seq_axis, 0.0), dk, dv
    return lax.cond(earlier, from_earlier, from_later)

  def forward(q, k, v, seg):
    i = lax.axis_index(axis_name)
    o, lse = fwd_block(q, k, v, seg, seg, causal)  # step 0: this device's own k/v

    def step(s, carry):  # one loop body, so each kernel is compiled once whatever n is
      o, lse, kv = carry
      # The next block in flight while this one computes. The last step's shift is not needed:
      # one extra k/v transfer, hidden behind that step, buys a single loop body.
      nxt = _shift(kv, axis_name, n)
      o2, l2 = visiting_fwd(q, kv[0], kv[1], seg, kv[2], (i - s) % n < i)
      o, lse = _merge(o, lse, o2, l2, to_layout)
      return o, lse, nxt

    if n > 1:
      o, lse, _ = lax.fori_loop(1, n, step, (o, lse, _shift((k, v, seg), axis_name, n)))
    return o.astype(q.dtype), lse

  @jax.custom_vjp
  def f(q, k, v, seg):
    return forward(q, k, v, seg)[0]

  def f_fwd(q, k, v, seg):
    out, lse = forward(q, k, v, seg)
    return out, (q, k, v, seg, out, lse)

  def f_bwd(res, do):
    q, k, v, seg, out, lse = res
    i = lax.axis_index(axis_name)
    dq, dk, dv = grads_block(q, k, v, seg, seg, out, lse, do, causal)
    dkv = _shift((dk, dv), axis_name, n)  # the accumulators travel with their k/v block

    def step(s, carry):
      dq, dkv, kv = carry
      nxt = _shift(kv, axis_name, n)
      dq_s, dk, dv = visiting_grads(q, kv[0], kv[1], seg, kv[2], out, lse, do, (i - s) % n < i)
      dkv = _shift((dkv[0] + dk, dkv[1] + dv), axis_name, n)  # after the last step: home
      return dq + dq_s, dkv, nxt

    if n > 1:
      dq, dkv, _ = lax.fori_loop(1, n, step, (dq, dkv, _shift((k, v, seg), axis_name, n)))
    return dq.astype(q.dtype), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype), None

  f.defvjp(f_fwd, f_bwd)
  return f(q, k, v, seg)




partition.register("flash_attention.seq", ring_attention)
