"""Sequence-parallel scans: the linear scan and the SSD over a sequence sharded across chips (see :mod:`kernels.distributed`).

The computation lives in the scan family (:mod:`kernels.scan.sequence`), whose public kernels run
it themselves when their sequence axis is split under ``jit`` on a mesh; these are its entry
points for a user's own ``shard_map``.
"""
from __future__ import annotations

from kernels.scan import sequence as _sequence

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
    axis_name: the mesh axis that splits the sequence, or a tuple of them (major first).
    h0: the state before the global first step (``[batch, width]``, the same on every device), or None.
    reverse: scan from the global last step down (the carries then flow from the last device).
    return_final_state: also return the global final state (on every device).
    block_sizes, implementation, interpret: passed to both local :func:`kernels.linear_scan` calls.

  Returns:
    The local block of ``h`` (and the global final state with ``return_final_state``).
  """
  return _sequence.sequence_parallel_linear_scan(
      a, b, axis_name=axis_name, h0=h0, reverse=reverse, reset=reset, return_final_state=return_final_state,
      block_sizes=block_sizes, implementation=implementation, interpret=interpret)


def sequence_parallel_ssd(x, dt, A, B, C, *, axis_name, D=None, h0=None, reset=None, return_final_state=False,
                          chunk_size=None, block_sizes=None, implementation=None, interpret=None):
  """:func:`kernels.ssd` (Mamba-2) with the sequence sharded over ``axis_name``; equal to the SSD of
  the whole sequence.

  The same three steps as :func:`sequence_parallel_linear_scan`: a local SSD from a zero state (its
  final state ``[batch, heads, head_dim, state]``), one ``all_gather`` of the final states and the
  shards' decays ``exp(sum_t dt_t A)`` (zero where the shard holds a reset), and a second local SSD
  from the incoming state. Arguments as :func:`kernels.ssd`, each array the local block of the
  sequence (``A``, ``D`` and ``h0`` the same on every device); ``axis_name`` one mesh axis or a tuple.
  """
  return _sequence.sequence_parallel_ssd(
      x, dt, A, B, C, axis_name=axis_name, D=D, h0=h0, reset=reset, return_final_state=return_final_state,
      chunk_size=chunk_size, block_sizes=block_sizes, implementation=implementation, interpret=interpret)
