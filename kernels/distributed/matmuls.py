"""Collective matmuls: the all-gather and the reduce-scatter hidden behind the matmul's steps (see :mod:`kernels.distributed`)."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from kernels.base.backend import check_implementation
from kernels.base.errors import check
from kernels.distributed.ring import _axis, _shift
from kernels.gemm.api import matmul

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


