"""Sequence-parallel scans: the linear scan, the SSD and gated linear attention over a sequence
split across devices (inside a ``shard_map``; see :mod:`kernels.distributed` for the method).

They live in the family, not in :mod:`kernels.distributed`, because the family's own public
functions run them when their sequence axis is split under ``jit`` on a mesh
(:mod:`kernels.base.partition`), and a family may not import ``kernels.distributed``;
:mod:`kernels.distributed.scans` wraps the first two as its public multi-chip kernels.

All three are the same three steps: a local scan from a zero state (its final state), one
``all_gather`` of every shard's final state and *transfer* (what the shard does to a state
entering it: the product of its gates, or its decay, zero past a reset), the state entering each
shard combined from those, and a second local scan from it. ``axis_name`` is one mesh axis or a
tuple of them (the sequence split over several axes, major first, as a PartitionSpec entry).
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from kernels.base.backend import check_implementation
from kernels.base.errors import check
from kernels.base.partition import axis_position
from kernels.scan.chunked import gated_linear_attention, ssd
from kernels.scan.linear import linear_scan


def _carries(transfers, lasts, h0, n: int, reverse: bool):
  """The state entering each shard (stacked, in device order) and the final state, from every
  shard's transfer (gathered, ``[n, ...]``, applied by ``*``) and its final state from zero."""
  c = jnp.zeros_like(lasts[0]) if h0 is None else h0.astype(lasts.dtype)
  carries = []
  for j in (range(n) if not reverse else range(n - 1, -1, -1)):
    carries.append(c)
    c = transfers[j] * c + lasts[j]
  return jnp.stack(carries if not reverse else carries[::-1]), c


def sequence_parallel_linear_scan(a, b, *, axis_name, h0=None, reverse=False, reset=None, return_final_state=False,
                                  block_sizes=None, implementation=None, interpret=None):
  """:func:`kernels.linear_scan` on the local block of a sequence split over ``axis_name`` (see
  :func:`kernels.distributed.sequence_parallel_linear_scan`, which documents the arguments)."""
  for name, x in (("a", a), ("b", b)):
    check(hasattr(x, "shape") and hasattr(x, "dtype"), name, x,
          "must be an array (plane pairs are not supported here: pass complex64 arrays)")
  check_implementation(implementation, interpret)
  n, i = axis_position(axis_name)
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


def _chunked(run, x_name, x, logdecay, h0, reset, axis_name, return_final_state, implementation, interpret):
  """The SSD's and gated linear attention's sequence-parallel form: ``run(h0=..., return_final_state=True)``
  is the local call, ``logdecay`` ``[batch, seq_local, heads]`` its per-token log decay."""
  check_implementation(implementation, interpret)
  n, i = axis_position(axis_name)
  _, last = run(h0=None)                                                   # [batch, heads, head_dim, state]
  decay = jnp.exp(jnp.sum(logdecay.astype(jnp.float32), axis=1))           # [batch, heads]
  if reset is not None:
    decay = jnp.where(jnp.any(reset, axis=1)[:, None], 0.0, decay)
  transfer = decay[:, :, None, None].astype(last.dtype)
  carries, final = _carries(lax.all_gather(transfer, axis_name), lax.all_gather(last, axis_name), h0, n, False)
  y, _ = run(h0=carries[i])
  return (y, final) if return_final_state else y


def sequence_parallel_ssd(x, dt, A, B, C, *, axis_name, D=None, h0=None, reset=None, return_final_state=False,
                          chunk_size=None, block_sizes=None, implementation=None, interpret=None, backward=None):
  """:func:`kernels.ssd` on the local block of a sequence split over ``axis_name`` (see
  :func:`kernels.distributed.sequence_parallel_ssd`); the shard's transfer is its decay
  ``exp(sum_t dt_t A)`` per head."""
  def run(h0):
    return ssd(x, dt, A, B, C, D=D, h0=h0, reset=reset, return_final_state=True, chunk_size=chunk_size,
               block_sizes=block_sizes, implementation=implementation, interpret=interpret, backward=backward)
  logdecay = dt.astype(jnp.float32) * A.astype(jnp.float32)
  return _chunked(run, "x", x, logdecay, h0, reset, axis_name, return_final_state, implementation, interpret)


def sequence_parallel_gated_linear_attention(q, k, v, log_decay, *, axis_name, h0=None, reset=None,
                                             return_final_state=False, chunk_size=None, block_sizes=None,
                                             implementation=None, interpret=None, backward=None):
  """:func:`kernels.gated_linear_attention` on the local block of a sequence split over
  ``axis_name``; the shard's transfer is ``exp(sum_t log_decay_t)`` per head."""
  def run(h0):
    return gated_linear_attention(q, k, v, log_decay, h0=h0, reset=reset, return_final_state=True,
                                  chunk_size=chunk_size, block_sizes=block_sizes, implementation=implementation,
                                  interpret=interpret, backward=backward)
  return _chunked(run, "v", v, log_decay, h0, reset, axis_name, return_final_state, implementation, interpret)
