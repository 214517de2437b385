"""The ring's mechanics: neighbour shifts and the zig-zag sequence order (see :mod:`kernels.distributed`)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kernels.base.errors import KernelError, check

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


