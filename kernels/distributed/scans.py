"""Sequence-parallel scans: the linear scan and the SSD over a sequence sharded across chips (see :mod:`kernels.distributed`)."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from kernels.base.backend import check_implementation
from kernels.base.errors import check
from kernels.distributed.ring import _axis
from kernels.scan.linear import linear_scan

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
  from kernels.scan.chunked import ssd
  _, last = ssd(x, dt, A, B, C, return_final_state=True, **kw)           # [batch, heads, head_dim, state]
  decay = jnp.exp(jnp.sum(dt.astype(jnp.float32) * A.astype(jnp.float32), axis=1))   # [batch, heads]
  if reset is not None:
    decay = jnp.where(jnp.any(reset, axis=1)[:, None], 0.0, decay)
  transfer = decay[:, :, None, None].astype(last.dtype)
  carries, final = _carries(lax.all_gather(transfer, axis_name), lax.all_gather(last, axis_name), h0, n, False)
  y = ssd(x, dt, A, B, C, h0=carries[i], **kw)
  return (y, final) if return_final_state else y


