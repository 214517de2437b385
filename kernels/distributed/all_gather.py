"""A Pallas ring all-gather by remote DMA, the teaching example (see :mod:`kernels.distributed`)."""
from __future__ import annotations

import functools

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.base import calls
from kernels.base.backend import dispatch
from kernels.base.errors import check
from kernels.distributed.ring import _axis

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
    out = calls.pallas_call(
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
