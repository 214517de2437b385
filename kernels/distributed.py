"""Multi-chip kernels: ring attention, collective matmuls, a sequence-parallel scan, expert-parallel MoE
and a Pallas ring all-gather, each called inside :func:`jax.shard_map` with ``axis_name=``.

Every function here runs *per device*, on the local shard, and talks to the other devices of the
mesh axis ``axis_name`` through JAX's collectives (``lax.ppermute``, ``lax.all_gather``,
``lax.all_to_all``, ``lax.ragged_all_to_all``) or, in :func:`ring_all_gather`, Pallas remote DMAs.
The local work is this package's single-chip kernels (:func:`kernels.flash_attention`,
:func:`kernels.matmul`, :func:`kernels.linear_scan`, :func:`kernels.gmm`), so ``implementation=`` and
``interpret=`` pass straight through to them. Wrap the call in ``jax.shard_map(..., check_vma=False)``,
as any ``pallas_call`` needs.

Why a ring
----------
A TPU slice is a 2-D or 3-D torus (v5e: 2-D, no wrap-around below 16 chips on an axis; v4 and v5p:
3-D with wrap-arounds), and a mesh axis laid along it is a ring of neighbours joined by ICI links.
Sending a block to the next chip while computing on the block in hand turns one big collective
(an all-gather, a reduce-scatter) into ``n - 1`` neighbour exchanges, each hidden behind a piece of
the computation when that piece takes longer than the transfer, i.e. when the arithmetic intensity
of a step (FLOPs per byte sent) exceeds the chip's FLOP/s over its link bandwidth. XLA runs each
``ppermute`` asynchronously (``collective-permute-start`` / ``-done``) and schedules the independent
compute between them; nothing here waits on a transfer that the next step does not need.

Ring attention
--------------
:func:`ring_attention`: q, k and v are sharded along the sequence. Each device keeps its q block and
passes its k/v block around the ring; at each of the ``n`` steps it runs :func:`flash_attention` on its
q block against the k/v block in hand (``return_residuals=True`` gives the block's log-sum-exp) and
merges the block's output into its running output by the log-sum-exp rule
``lse = logaddexp(lse_a, lse_b)``, ``o = o_a exp(lse_a - lse) + o_b exp(lse_b - lse)``. Memory per chip
is the local blocks: O(S / n).

*Causal balance.* With the sequence cut into ``n`` contiguous blocks, device ``i`` needs only the k/v of
devices ``0..i``: the last device works ``n`` steps, the first one. The zig-zag order (as in
Megatron's context parallelism) cuts the sequence into ``2n`` chunks and gives device ``i`` chunks
``i`` and ``2n - 1 - i``. Then at step 0 the device runs plain causal attention on its own two chunks
(in increasing order, so the causal mask of the local sequence is the right one), and at every other
step the visiting k/v comes from device ``j``: if ``j < i``, its first chunk is wholly visible to both
local q chunks and its second chunk to neither (run: all of q against the first k/v half); if
``j > i``, only the local second q chunk sees anything, and sees all of it (run: the second q half
against all of k/v). Every step is the same work, ``2 C^2`` for chunks of ``C`` tokens, on every
device; the masked halves are skipped, not computed and masked. ``sequence_order="natural"`` (the
default) takes and returns the sequence sharded contiguously and moves the chunks to the zig-zag
order and back with two ``ppermute`` each way; ``"zigzag"`` skips that for a model that keeps its
activations in zig-zag order (:func:`zigzag_indices` gives the global order).

*Sliding windows* need no ring: with ``causal`` and a window of ``W`` tokens a device needs only the
``W - 1`` keys before its block, from the ``ceil((W - 1) / L)`` devices before it, and every device
then does the same work in the natural order. Each such block (only the rows the window reaches)
comes by one ``ppermute``; one windowed :func:`flash_attention` runs over them and the local keys, its
``kv_len - q_len`` offset placing each query where it sits in the sequence; keys that wrapped round
the ring from the last devices get a segment id no query has. Its gradient is flash attention's and
the transposed ``ppermute`` transfers.

*Backward* (``custom_vjp``): the forward saves only its inputs, output and log-sum-exp. The backward
walks the ring again: each step runs the flash-attention backward kernels on the local q against the
visiting k/v block with the *whole* attention's ``lse`` and ``out``
(:func:`kernels.attention.attention_block_grads`), adds to the local dq, and adds the block's dk/dv to
f32 accumulators that travel around the ring with k and v; one more step brings each accumulator home.
GQA moves only the kv heads.

*Why ``ppermute`` between kernel calls, not remote DMAs inside the flash kernel.* XLA already runs
each ``ppermute`` asynchronously and overlaps it with the kernel of the same step, which is all a
fused remote DMA would buy here; the flash-attention kernels stay the single-chip kernels, tuned
and tested as such; and the transfers stay visible to XLA's scheduler and to the communication
model. :func:`ring_all_gather` shows the remote-DMA way.

Collective matmuls
------------------
:func:`all_gather_matmul` (``x`` sharded on rows, ``w`` local): instead of all-gathering ``x`` and then
multiplying, each step multiplies the row block in hand by ``w`` while the block moves on. Bidirectional
(the default, for an even row count and 3 or more devices): half of each block travels each way
round the ring, so each step sends half the bytes on each of two links. :func:`matmul_reduce_scatter`
(``x`` sharded on the contraction): each step adds the local partial product of one row block to an
f32 accumulator that moves on; after ``n`` steps each device holds its row block's total.

Sequence-parallel scan
----------------------
:func:`sequence_parallel_linear_scan`: ``h_t = a_t h_{t-1} + b_t`` with the sequence sharded. Each
device scans its shard from a zero state (the local final state ``L``) and reduces its gates to the
shard's transfer ``A = prod_t a_t``; one ``all_gather`` of ``(A, L)`` lets every device combine the
shards before it, ``c_{j+1} = A_j c_j + L_j``, into its incoming state; a second local scan from that
state gives ``h``. Two passes over the local ``a`` and ``b`` and one ``all_gather`` of
``2 x batch x width`` per device, whatever the sequence length. :func:`sequence_parallel_ssd` does
the same for Mamba-2's SSD, whose shard transfer is the decay ``exp(sum_t dt_t A)`` per head.

Expert-parallel MoE
-------------------
:func:`expert_parallel_moe`: the tokens are sharded over the ``axis_name`` devices and so are the
experts (device ``p`` holds experts ``p E/n .. (p+1) E/n - 1``). Each device routes its tokens
(:func:`kernels.route`) and sorts its assignments by expert; then the rows for each device's experts
are exchanged (``lax.ragged_all_to_all`` on TPU: each pair of devices sends exactly its rows), the
received rows are sorted by local expert, the two grouped matmuls run (as in :func:`kernels.moe`: gate
and up with the activation product, then down, whose backward also runs the product's), and the results go
back by the reverse exchange. Dropless: every device's receive buffer has room for the
worst case, ``n x tokens_local x min(top_k, experts_local)`` rows. The auxiliary losses are those of
the whole batch (the per-expert counts and mean router probabilities are summed over the devices),
so the layer equals :func:`kernels.moe` on the whole batch, forward and backward.

*XLA:CPU has no ragged all-to-all*: off TPU the exchange is a dense ``lax.all_to_all`` of per-device
blocks padded to the worst case, then the same offsets; the two are the same function of their
inputs, and the tests check the offsets on the CPU path and compile the ragged one for TPU.

Pallas ring all-gather
----------------------
:func:`ring_all_gather` is ``lax.all_gather(x, axis_name, tiled=True)`` written as one Pallas kernel with
remote DMAs (:func:`jax.experimental.pallas.tpu.make_async_remote_copy`): at step ``s`` each device
forwards to its right neighbour the block it received at step ``s - 1`` straight from and to HBM
(bidirectional: the top half of each block travels right and the bottom half left, two DMAs in flight
on two links). Each step's receive has its own DMA semaphore, so a neighbour running ahead cannot
signal a semaphore that is still being waited on. It is the teaching example of the distributed
notebook, compared there with ``lax.all_gather``; the other functions use XLA's collectives.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels import attention as _attention
from kernels.backend import check_implementation, dispatch
from kernels.errors import KernelError, check
from kernels.matmul import matmul
from kernels.moe import _check_layer_args, _check_route_args, _combine, _dispatch, _experts, route
from kernels.scan import linear_scan

__all__ = ["all_gather_matmul", "expert_parallel_moe", "matmul_reduce_scatter", "ring_all_gather", "ring_attention",
           "sequence_parallel_linear_scan", "sequence_parallel_ssd", "zigzag_indices"]

SEQUENCE_ORDERS = ("natural", "zigzag")


# ---------------------------------------------------------------------------------
# Ring mechanics
# ---------------------------------------------------------------------------------


def _axis(axis_name) -> tuple[int, jax.Array]:
  """(the axis size, a static int; this device's index on it, traced)."""
  check(isinstance(axis_name, str), "axis_name", axis_name, "must be the name of one mesh axis (a str)")
  try:
    n = lax.axis_size(axis_name)
  except NameError as e:
    raise KernelError("axis_name", axis_name, "is not a bound mesh axis: call this inside "
                                 "jax.shard_map over a mesh with that axis") from e
  return int(n), lax.axis_index(axis_name)


def _shift(tree, axis_name, n: int, offset: int = 1):
  """Every device's ``tree`` sent ``offset`` places round the ring (device ``i`` to ``i + offset``)."""
  perm = [(j, (j + offset) % n) for j in range(n)]
  return jax.tree.map(lambda x: None if x is None else lax.ppermute(x, axis_name, perm), tree)


def _slice(x, axis: int, start: int, stop: int):
  return None if x is None else lax.slice_in_dim(x, start, stop, axis=axis)


def zigzag_indices(seq_len: int, num_devices: int) -> np.ndarray:
  """The global token order that ring attention's ``sequence_order="zigzag"`` expects: the sequence
  cut into ``2 n`` chunks, device ``i`` holding chunks ``i`` and ``2n - 1 - i`` (``x[..., idx, ...]``
  reorders a natural-order array; ``np.argsort(idx)`` undoes it)."""
  check(seq_len % (2 * num_devices) == 0, "seq_len", seq_len, f"must be a multiple of 2 x {num_devices} devices")
  c = seq_len // (2 * num_devices)
  chunks = [k for i in range(num_devices) for k in (i, 2 * num_devices - 1 - i)]
  return np.concatenate([np.arange(k * c, (k + 1) * c) for k in chunks])


def _zigzag_perms(n: int):
  """The two ppermutes that move natural-order halves to the zig-zag order: the first half of device
  ``d`` (chunk ``2d``) and its second half (chunk ``2d + 1``) each go to chunk ``c``'s zig-zag owner."""
  owner = lambda c: c if c < n else 2 * n - 1 - c  # noqa: E731
  return [(d, owner(2 * d)) for d in range(n)], [(d, owner(2 * d + 1)) for d in range(n)]


def _to_zigzag(x, axis_name, n: int, i, axis: int):
  """Natural-order local shard -> this device's zig-zag chunks ``[i, 2n - 1 - i]``."""
  if x is None:
    return None
  half = x.shape[axis] // 2
  first, second = _zigzag_perms(n)
  a = lax.ppermute(_slice(x, axis, 0, half), axis_name, first)    # an even chunk
  b = lax.ppermute(_slice(x, axis, half, 2 * half), axis_name, second)  # an odd chunk
  even = i % 2 == 0  # chunk i has i's parity; chunk 2n - 1 - i the other
  return jnp.where(even, jnp.concatenate([a, b], axis), jnp.concatenate([b, a], axis))


def _from_zigzag(x, axis_name, n: int, i, axis: int):
  """The inverse of :func:`_to_zigzag`."""
  half = x.shape[axis] // 2
  lo, hi = _slice(x, axis, 0, half), _slice(x, axis, half, 2 * half)
  even = i % 2 == 0
  first, second = _zigzag_perms(n)
  inv = lambda perm: [(b, a) for a, b in perm]  # noqa: E731
  a = lax.ppermute(jnp.where(even, lo, hi), axis_name, inv(first))   # the even chunk, home as a first half
  b = lax.ppermute(jnp.where(even, hi, lo), axis_name, inv(second))  # the odd chunk, as a second half
  return jnp.concatenate([a, b], axis)


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


# ---------------------------------------------------------------------------------
# Collective matmuls
# ---------------------------------------------------------------------------------


def _check_matmul(x, w):
  for name, a in (("x", x), ("w", w)):
    check(getattr(a, "ndim", None) == 2, name, a, "must be a 2-D array")
  check(x.shape[1] == w.shape[0], "w", w, f"must have {x.shape[1]} rows (x's columns, the contraction)")
  check(x.dtype == w.dtype, "w", w, f"must have x's dtype {jnp.dtype(x.dtype).name}")


def all_gather_matmul(x, w, *, axis_name, bidirectional=True, out_dtype=None, block_sizes=None,
                      implementation=None, interpret=None):
  """``all_gather(x, axis_name, tiled=True) @ w`` with the gather overlapped with the matmul.

  Args:
    x: the local ``[m, k]`` row block of an ``[n * m, k]`` array sharded over ``axis_name``.
    w: the local ``[k, f]`` (typically a column block of a weight sharded over another axis).
    bidirectional: send half of each block each way round the ring (needs ``m`` even and 3 or more
      devices; otherwise one direction).
    out_dtype, block_sizes, implementation, interpret: passed to :func:`kernels.matmul`.

  Returns:
    ``[n * m, f]``: every device's rows times the local ``w``, rows in device order.
  """
  _check_matmul(x, w)
  check_implementation(implementation, interpret)
  n, i = _axis(axis_name)
  m, f = x.shape[0], w.shape[1]
  out_dtype = jnp.dtype(out_dtype or x.dtype)
  mm = lambda a: matmul(a, w, out_dtype=out_dtype, block_sizes=block_sizes, implementation=implementation,  # noqa: E731
                        interpret=interpret)
  out = jnp.zeros((n * m, f), out_dtype)
  both = bidirectional and m % 2 == 0 and n > 2
  h = m // 2

  def place(out, blk, s):
    y = mm(blk)
    if not both:
      return lax.dynamic_update_slice_in_dim(out, y, ((i - s) % n) * m, 0)
    out = lax.dynamic_update_slice_in_dim(out, y[:h], ((i - s) % n) * m, 0)   # top half: from device i - s
    return lax.dynamic_update_slice_in_dim(out, y[h:], ((i + s) % n) * m + h, 0)  # bottom: from i + s

  def shift(blk):
    if not both:
      return _shift(blk, axis_name, n)
    return jnp.concatenate([_shift(blk[:h], axis_name, n, 1), _shift(blk[h:], axis_name, n, -1)])

  def step(s, carry):  # the next block in flight while this one is multiplied
    out, blk = carry
    nxt = shift(blk)
    return place(out, blk, s), nxt

  out, blk = lax.fori_loop(0, n - 1, step, (out, x))
  return place(out, blk, n - 1)


def matmul_reduce_scatter(x, w, *, axis_name, bidirectional=True, out_dtype=None, block_sizes=None,
                          implementation=None, interpret=None):
  """``psum_scatter(x @ w, axis_name, scatter_dimension=0, tiled=True)`` with the reduction overlapped
  with the matmul.

  Args:
    x: the local ``[M, k]`` (typically activations whose contraction dimension is sharded over
      ``axis_name``: this device's ``k`` columns); ``M`` a multiple of the axis size.
    w: the local ``[k, f]`` rows of the weight.
    bidirectional: half of each row block's accumulator travels each way round the ring (needs
      ``M / n`` even and 3 or more devices; otherwise one direction).
    out_dtype, block_sizes, implementation, interpret: passed to :func:`kernels.matmul`, whose
      partial products are accumulated in f32.

  Returns:
    ``[M / n, f]``: this device's row block of the sum over devices of ``x @ w``.
  """
  _check_matmul(x, w)
  check_implementation(implementation, interpret)
  n, i = _axis(axis_name)
  check(x.shape[0] % n == 0, "x", x, f"its rows ({x.shape[0]}) must be a multiple of the {n} devices of "
        f"{axis_name!r}")
  m = x.shape[0] // n
  out_dtype = jnp.dtype(out_dtype or x.dtype)
  mm = lambda a: matmul(a, w, out_dtype=jnp.float32, block_sizes=block_sizes,  # noqa: E731
                        implementation=implementation, interpret=interpret)
  rows = lambda start, size: lax.dynamic_slice_in_dim(x, start, size, 0)  # noqa: E731
  both = bidirectional and m % 2 == 0 and n > 2
  h = m // 2

  def partial(s):  # this device's share of the row block(s) whose accumulator(s) it holds at step s
    if not both:
      return mm(rows(((i - 1 - s) % n) * m, m))
    # the top halves' accumulators move right, the bottom halves' left
    return mm(jnp.concatenate([rows(((i - 1 - s) % n) * m, h), rows(((i + 1 + s) % n) * m + h, h)]))

  def shift(acc):
    if not both:
      return _shift(acc, axis_name, n)
    return jnp.concatenate([_shift(acc[:h], axis_name, n, 1), _shift(acc[h:], axis_name, n, -1)])

  # The accumulator arriving at step s was sent after step s - 1; step s's product does not wait for it.
  acc = lax.fori_loop(1, n, lambda s, acc: shift(acc) + partial(s), partial(0))
  return acc.astype(out_dtype)


# ---------------------------------------------------------------------------------
# Sequence-parallel linear scan
# ---------------------------------------------------------------------------------


def sequence_parallel_linear_scan(a, b, *, axis_name, h0=None, reverse=False, reset=None, return_final_state=False,
                                  block_sizes=None, implementation=None, interpret=None):
  """:func:`kernels.linear_scan` with the sequence sharded over ``axis_name`` (device ``i`` holding the
  ``i``-th contiguous block of steps); equal to the scan of the whole sequence.

  Args:
    a, b, reset: the local blocks of :func:`kernels.linear_scan`'s arguments (``a`` per element
      ``[batch, seq_local, width]``, per token ``[batch, seq_local, 1]`` or time-invariant ``[width]``);
      real or complex64 arrays (not plane pairs).
    h0: the state before the global first step (``[batch, width]``, the same on every device), or None.
    reverse: scan from the global last step down (the carries then flow from the last device).
    return_final_state: also return the global final state (on every device).
    block_sizes, implementation, interpret: passed to both local :func:`kernels.linear_scan` calls.

  Returns:
    The local block of ``h`` (and the global final state with ``return_final_state``).
  """
  for name, x in (("a", a), ("b", b)):
    check(hasattr(x, "shape") and hasattr(x, "dtype"), name, x,
          "must be an array (plane pairs are not supported here: pass complex64 arrays)")
  check_implementation(implementation, interpret)
  n, i = _axis(axis_name)
  kw = dict(reverse=reverse, reset=reset, block_sizes=block_sizes, implementation=implementation,
            interpret=interpret)
  _, last = linear_scan(a, b, return_final_state=True, **kw)  # this shard from a zero state
  # The shard's transfer: the product of its gates, the state dropped where a reset is set.
  steps = b.shape[1]
  gates = a.astype(last.dtype) if a.ndim == 3 else jnp.broadcast_to(a.astype(last.dtype), (1, steps, a.shape[0]))
  if reset is not None:
    gates = gates * (~reset)[..., None].astype(gates.dtype)
  transfer = jnp.broadcast_to(jnp.prod(gates, axis=1), last.shape)
  carries, c = _carries(lax.all_gather(transfer, axis_name), lax.all_gather(last, axis_name), h0, n, reverse)
  h = linear_scan(a, b, h0=carries[i], **kw)
  return (h, c) if return_final_state else h


def _carries(transfers, lasts, h0, n: int, reverse: bool):
  """The state entering each shard (stacked, in device order) and the final state, from every
  shard's transfer (gathered, ``[n, ...]``, applied by ``*``) and its final state from zero."""
  c = jnp.zeros_like(lasts[0]) if h0 is None else h0.astype(lasts.dtype)
  carries = []
  for j in (range(n) if not reverse else range(n - 1, -1, -1)):
    carries.append(c)
    c = transfers[j] * c + lasts[j]
  return jnp.stack(carries if not reverse else carries[::-1]), c


def sequence_parallel_ssd(x, dt, A, B, C, *, axis_name, D=None, h0=None, reset=None, return_final_state=False,
                          chunk_size=None, block_sizes=None, implementation=None, interpret=None):
  """:func:`kernels.ssd` (Mamba-2) with the sequence sharded over ``axis_name``; equal to the SSD of
  the whole sequence.

  The same three steps as :func:`sequence_parallel_linear_scan`: a local SSD from a zero state (its
  final state ``[batch, heads, head_dim, state]``), one ``all_gather`` of the final states and the
  shards' decays ``exp(sum_t dt_t A)`` (zero where the shard holds a reset), and a second local SSD
  from the incoming state. Arguments as :func:`kernels.ssd`, each array the local block of the
  sequence (``A``, ``D`` and ``h0`` the same on every device).
  """
  check_implementation(implementation, interpret)
  n, i = _axis(axis_name)
  kw = dict(D=D, reset=reset, chunk_size=chunk_size, block_sizes=block_sizes, implementation=implementation,
            interpret=interpret)
  from kernels.ssd import ssd
  _, last = ssd(x, dt, A, B, C, return_final_state=True, **kw)           # [batch, heads, head_dim, state]
  decay = jnp.exp(jnp.sum(dt.astype(jnp.float32) * A.astype(jnp.float32), axis=1))   # [batch, heads]
  if reset is not None:
    decay = jnp.where(jnp.any(reset, axis=1)[:, None], 0.0, decay)
  transfer = decay[:, :, None, None].astype(last.dtype)
  carries, final = _carries(lax.all_gather(transfer, axis_name), lax.all_gather(last, axis_name), h0, n, False)
  y = ssd(x, dt, A, B, C, h0=carries[i], **kw)
  return (y, final) if return_final_state else y


# ---------------------------------------------------------------------------------
# Expert-parallel MoE
# ---------------------------------------------------------------------------------


def _exchange_dense(x, in_off, send, out_off, recv, out_rows, axis_name, n):
  """``lax.ragged_all_to_all``'s result, by a dense ``all_to_all`` of per-destination blocks padded to
  ``x``'s row count (XLA:CPU has no ragged all-to-all)."""
  rows = x.shape[0]
  idx = in_off[:, None] + jnp.arange(rows)[None, :]                            # [n, rows]
  blocks = jnp.where((jnp.arange(rows)[None, :] < send[:, None])[..., None], x[jnp.clip(idx, 0, rows - 1)], 0)
  got = lax.all_to_all(blocks, axis_name, 0, 0, tiled=True)                    # [n (source), rows, d]
  offs = lax.all_to_all(out_off, axis_name, 0, 0, tiled=True)                  # where each source's rows go
  dest = offs[:, None] + jnp.arange(rows)[None, :]
  dest = jnp.where(jnp.arange(rows)[None, :] < recv[:, None], dest, out_rows)  # the padding: out of range
  out = jnp.zeros((out_rows,) + x.shape[1:], x.dtype)
  return out.at[dest.reshape(-1)].set(got.reshape((-1,) + x.shape[1:]), mode="drop")


def _exchange_impl(x, in_off, send, out_off, recv, out_rows, axis_name, n):
  def ragged(x, in_off, send, out_off, recv):
    out = jnp.zeros((out_rows,) + x.shape[1:], x.dtype)
    return lax.ragged_all_to_all(x, out, in_off, send, out_off, recv, axis_name=axis_name)
  dense = functools.partial(_exchange_dense, out_rows=out_rows, axis_name=axis_name, n=n)
  return lax.platform_dependent(x, in_off, send, out_off, recv, tpu=ragged, default=dense)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _exchange(x, fwd_offsets, bwd_offsets, out_rows, back_rows, axis_name, n):
  """Rows of ``x`` to other devices (``fwd_offsets = (in_off, send, out_off, recv)``); its transpose
  is the reverse exchange (``bwd_offsets``)."""
  return _exchange_impl(x, *fwd_offsets, out_rows, axis_name, n)


def _exchange_fwd(x, fwd_offsets, bwd_offsets, out_rows, back_rows, axis_name, n):
  return _exchange(x, fwd_offsets, bwd_offsets, out_rows, back_rows, axis_name, n), bwd_offsets


def _exchange_bwd(out_rows, back_rows, axis_name, n, bwd_offsets, g):
  zeros = jax.tree.map(lambda a: np.zeros(a.shape, jax.dtypes.float0), bwd_offsets)
  return _exchange_impl(g, *bwd_offsets, back_rows, axis_name, n), zeros, zeros


_exchange.defvjp(_exchange_fwd, _exchange_bwd)


def _excl_cumsum(x):
  return jnp.cumsum(x) - x


def expert_parallel_moe(x, router_w, w_gate, w_up, w_down, *, axis_name, top_k: int, activation: str = "silu",
                        scoring: str = "softmax", normalize_weights: bool = True, expert_bias=None,
                        block_sizes=None, implementation=None, interpret=None):
  """:func:`kernels.moe` (dropless) with the tokens and the experts sharded over ``axis_name``.

  Args:
    x: the local ``[tokens_local, d]`` tokens.
    router_w: ``[d, experts]``, the same on every device.
    w_gate, w_up, w_down: the local experts' weights, ``[experts / n, d, f]`` (or ``w_up=None`` and
      ``w_gate`` the concatenated ``[experts / n, d, 2f]``) and ``[experts / n, f, d]``: device ``p``
      holds experts ``p * experts / n`` onwards.
    top_k, activation, scoring, normalize_weights, expert_bias: as :func:`kernels.moe`.
    block_sizes, implementation, interpret: passed to both grouped matmuls (gate and up with the
      activation product, as in :func:`kernels.moe`, then down).

  Returns:
    ``(y, aux)``: the local ``[tokens_local, d]`` output and :func:`kernels.moe`'s ``aux`` for the whole
    batch (every device gets the same losses, loads and group sizes).
  """
  _check_route_args(x, router_w, top_k, scoring, expert_bias, None)
  n, i = _axis(axis_name)
  experts = router_w.shape[1]
  check(experts % n == 0, "router_w", router_w, f"its {experts} experts must divide evenly over the {n} devices "
        f"of {axis_name!r}")
  el = experts // n
  check(getattr(w_gate, "ndim", None) == 3 and w_gate.shape[0] == el, "w_gate", w_gate,
        f"must hold this device's {el} experts in dim 0 ([experts / n, d, f])")
  full = lambda w: None if w is None else jax.ShapeDtypeStruct((experts,) + w.shape[1:], w.dtype)  # noqa: E731
  _check_layer_args(x, router_w, full(w_gate), full(w_up), full(w_down), activation)
  check_implementation(implementation, interpret)

  tokens = x.shape[0]
  r = route(x, router_w, top_k=top_k, scoring=scoring, normalize_weights=normalize_weights,
            expert_bias=expert_bias)
  xs = _dispatch(x, r.order, r.position, top_k)                          # [tokens * top_k, d], by expert
  sizes = lax.all_gather(r.group_sizes, axis_name)                        # [n (source), experts]
  per_dev = sizes.reshape(n, n, el).sum(-1)                               # [source, destination] rows
  send, recv = per_dev[i], per_dev[:, i]
  # where my rows for device p land in p's buffer: after the rows of the sources before me
  out_off = jnp.sum(jnp.where(jnp.arange(n)[:, None] < i, per_dev, 0), axis=0)
  in_off, recv_off = _excl_cumsum(send), _excl_cumsum(recv)
  back_off = jnp.sum(jnp.where(jnp.arange(n)[None, :] < i, per_dev, 0), axis=1)  # my rows' place at each source
  rows = n * tokens * min(top_k, el)                                      # the worst case any device receives
  fwd = (in_off, send, out_off, recv)
  bwd = (recv_off, recv, back_off, send)
  buf = _exchange(xs, fwd, bwd, rows, tokens * top_k, axis_name, n)   # by (source, local expert)

  # Sort the received rows by local expert (sources in order within an expert).
  mine = lax.dynamic_slice_in_dim(sizes, i * el, el, axis=1)               # [source, local expert]
  bounds = jnp.cumsum(mine.reshape(-1))                                    # segment ends, (source, expert) order
  seg = jnp.searchsorted(bounds, jnp.arange(rows), side="right")
  expert_of_row = jnp.where(seg < n * el, seg % el, el)                   # the padding after every expert
  a = jnp.arange(rows, dtype=jnp.int32)
  _, perm = lax.sort((expert_of_row.astype(jnp.int32), a), num_keys=1, is_stable=True)
  _, inv = lax.sort((perm, a), num_keys=1)
  local_sizes = mine.sum(0).astype(jnp.int32)

  w_gate_up = w_gate if w_up is None else jnp.concatenate([w_gate, w_up], axis=2)
  kw = dict(block_sizes=block_sizes, implementation=implementation, interpret=interpret)
  # the experts as in kernels.moe: the activation product and its backward inside the grouped matmuls
  ys = _experts(buf[perm], w_gate_up.astype(x.dtype), w_down.astype(x.dtype), local_sizes, activation,
                **kw)[inv]                                                # back to (source, expert) order
  back = _exchange(ys, bwd, fwd, tokens * top_k, rows, axis_name, n)  # my rows, by expert
  y = _combine(back, r.weights, r.order, r.position).astype(x.dtype)
  return y, _global_aux(x, router_w, r, scoring, axis_name)


def _global_aux(x, router_w, r, scoring, axis_name):
  """:func:`kernels.moe`'s ``aux`` of the whole batch, from every device's routing."""
  acc = jnp.float32
  logits = jnp.dot(x, router_w, preferred_element_type=acc).astype(acc)
  probs = jax.nn.softmax(logits, axis=-1) if scoring == "softmax" else jax.nn.sigmoid(logits)
  probs = probs if scoring == "softmax" else probs / jnp.sum(probs, axis=-1, keepdims=True)
  load = lax.psum(r.expert_load, axis_name)
  group_sizes = lax.psum(r.group_sizes, axis_name)
  n_assign = lax.psum(r.expert_ids.size, axis_name)
  mean_p = lax.pmean(jnp.mean(probs, axis=0), axis_name)
  experts = router_w.shape[1]
  lb = experts * jnp.sum(load.astype(acc) / n_assign * mean_p)
  z = lax.pmean(r.z_loss, axis_name)
  return {"load_balancing_loss": lb, "z_loss": z, "expert_load": load, "group_sizes": group_sizes,
          "dropped_fraction": 1.0 - jnp.sum(group_sizes) / n_assign}


# ---------------------------------------------------------------------------------
# A Pallas ring all-gather (remote DMA)
# ---------------------------------------------------------------------------------


def _ring_all_gather_kernel(x_ref, o_ref, local_sem, send_sems, recv_sems, *, axis_name, n, bidirectional):
  me = lax.axis_index(axis_name)
  right, left = lax.rem(me + 1, n), lax.rem(me + n - 1, n)
  # Both neighbours must have entered the kernel (their output buffer exists) before we write to it.
  barrier = pltpu.get_barrier_semaphore()
  for peer in (left, right):
    pl.semaphore_signal(barrier, 1, device_id=(peer,))  # mesh coordinates along axis_name
  pl.semaphore_wait(barrier, 2)
  local = pltpu.make_async_copy(x_ref, o_ref.at[me], local_sem)
  local.start()
  local.wait()
  rows = x_ref.shape[0]
  h = rows // 2 if bidirectional else rows
  for s in range(n - 1):
    # Forward what arrived last step (at step 0: our own block); receive the next one into its own slot.
    slot_r = lax.rem(me - s + n, n)  # travels right
    copies = [pltpu.make_async_remote_copy(
        src_ref=o_ref.at[slot_r, pl.ds(0, h)], dst_ref=o_ref.at[slot_r, pl.ds(0, h)], send_sem=send_sems.at[0],
        recv_sem=recv_sems.at[0, s], device_id=(right,))]
    if bidirectional:
      slot_l = lax.rem(me + s, n)  # travels left
      copies.append(pltpu.make_async_remote_copy(
          src_ref=o_ref.at[slot_l, pl.ds(h, rows - h)], dst_ref=o_ref.at[slot_l, pl.ds(h, rows - h)],
          send_sem=send_sems.at[1], recv_sem=recv_sems.at[1, s], device_id=(left,)))
    for c in copies:
      c.start()
    for c in copies:
      c.wait()


def ring_all_gather(x, *, axis_name, bidirectional=True, implementation=None, interpret=None):
  """``lax.all_gather(x, axis_name, tiled=True)`` as a Pallas kernel of remote DMAs round the ring.

  The remote DMAs address neighbours by their index along ``axis_name``, so the mesh must have
  that one axis (``Mesh(devices, (axis_name,))``).

  Args:
    x: the local block, ``[rows, ...]``.
    bidirectional: the top half of every block travels right and the bottom half left (needs an
      even ``rows`` and 3 or more devices; otherwise everything travels right).
    implementation, interpret: ``"xla"`` is ``lax.all_gather``; see :func:`kernels.dispatch`.

  Returns:
    ``[n * rows, ...]``: every device's block, in device order.
  """
  check(hasattr(x, "shape") and x.ndim >= 1 and x.shape[0] > 0, "x", x, "must be an array of rank >= 1")
  n, _ = _axis(axis_name)
  bidirectional = bool(bidirectional and x.shape[0] % 2 == 0 and n > 2)

  def pallas(x, interpret):
    if interpret is True:  # remote DMAs and semaphores need the TPU interpreter (it simulates every device)
      interpret = pltpu.InterpretParams()
    kernel = functools.partial(_ring_all_gather_kernel, axis_name=axis_name, n=n, bidirectional=bidirectional)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n,) + x.shape, x.dtype),
        in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec(memory_space=pl.ANY),
        scratch_shapes=[pltpu.SemaphoreType.DMA, pltpu.SemaphoreType.DMA((2,)),
                        pltpu.SemaphoreType.DMA((2, max(n - 1, 1)))],
        compiler_params=pltpu.CompilerParams(collective_id=0, has_side_effects=True),
        interpret=interpret,
    )(x)
    return out.reshape((n * x.shape[0],) + x.shape[1:])

  return dispatch("ring_all_gather", x, pallas=pallas, xla=lambda x: lax.all_gather(x, axis_name, tiled=True),
                  implementation=implementation, interpret=interpret)
