"""``pallas_call`` as every kernel here calls it: inside a ``shard_map``, and in interpret mode.

Mosaic kernels cannot be partitioned automatically: under ``jit`` on a mesh, each kernel must run
inside a ``shard_map`` on its local shards. This module holds what every kernel needs for that.

*Inside a shard_map, with check_vma.* JAX tracks, for each value inside a ``shard_map``, the mesh
axes along which it varies from device to device. A ``pallas_call`` cannot infer that for its
outputs, so :func:`pallas_call` (a drop-in for ``pl.pallas_call``) declares it: the outputs vary
along every axis that any input varies along, and inputs that vary along fewer axes are first
marked varying along the rest (``lax.pcast(..., to="varying")``), whose transpose is the ``psum``
that a replicated operand's gradient needs, exactly once. (On a CPU, interpret mode cannot follow
those axes yet: JAX's interpreters either reject the kernel body's mix of varying and invariant values
or, with several devices, can deadlock; there, use ``check_vma=False``. On a TPU the declaration is
what Mosaic's lowering needs, and it is checked by compiling for TPU ahead of time.)

*Interpret mode.* While a kernel is traced for interpret mode, :func:`mxu_operands` widens bf16 dot
operands, which XLA:CPU cannot always multiply.
"""
from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

# True while a kernel is traced for interpret mode (set by pallas_call below).
_INTERPRETING = contextvars.ContextVar("kernels_interpreting", default=False)


@contextlib.contextmanager
def _interpreting(interpret):
  token = _INTERPRETING.set(bool(interpret))
  try:
    yield
  finally:
    _INTERPRETING.reset(token)


def mxu_operands(*xs):
  """A kernel's dot operands, as the MXU takes them; in interpret mode, bf16 ones widened to f32.

  XLA:CPU has no bf16 x bf16 -> f32 dot for every shape ("Unsupported element type for DotThunk":
  a matmul with 64 or fewer columns, an FFT along a leading axis). A bf16 product is exact in f32 and
  the dots accumulate in f32 either way, so the widened dot gives the MXU's result."""
  if not _INTERPRETING.get():
    return xs
  return tuple(x.astype(jnp.float32) if getattr(x, "dtype", None) == jnp.bfloat16 else x for x in xs)


def _manual_axis_type(x):
  return getattr(jax.typeof(x), "manual_axis_type", None) if hasattr(x, "shape") else None


def varying_axes(*args) -> frozenset:
  """The mesh axes along which any of ``args`` (pytrees) varies; empty outside a shard_map."""
  axes = set()
  for leaf in jax.tree.leaves(args):
    mat = _manual_axis_type(leaf)
    if mat is not None:
      axes |= set(mat.varying)
  return frozenset(axes)


def _to_varying(x, axes: frozenset):
  """``x`` marked as varying along ``axes`` (the ones it does not vary along already)."""
  mat = _manual_axis_type(x)
  if mat is None or not axes:
    return x
  missing = tuple(sorted(axes - set(mat.varying)))
  return lax.pcast(x, missing, to="varying") if missing else x


def common_varying(args):
  """``args`` (a pytree) with every array marked varying along the union of their varying axes.

  :func:`~kernels.base.backend.dispatch` applies it before a kernel's ``custom_vjp``: inside, every
  primal then has one type, so the backward's cotangents match it, and the casts' transposes sum a
  replicated operand's gradient over the axes it was broadcast along, once."""
  axes = varying_axes(args)
  if not axes:
    return args
  return jax.tree.map(lambda a: _to_varying(a, axes) if hasattr(a, "shape") else a, args)


def _varying_struct(s, template):
  """``s`` (a ShapeDtypeStruct) with the manual axis type of ``template`` (a traced array)."""
  return jax.ShapeDtypeStruct(s.shape, s.dtype, manual_axis_type=_manual_axis_type(template))


def pallas_call(kernel, out_shape, *, interpret=False, **kwargs):
  """``pl.pallas_call`` that also works inside a ``shard_map`` with ``check_vma=True`` (see the module doc)."""
  def call(*args):
    axes = varying_axes(args)
    shapes = out_shape
    if axes:
      args = common_varying(args)
      template = next(a for a in jax.tree.leaves(args) if _manual_axis_type(a) is not None)
      shapes = jax.tree.map(lambda s: _varying_struct(s, template), out_shape)
    with _interpreting(interpret):  # the kernel is traced inside (see mxu_operands)
      return pl.pallas_call(kernel, out_shape=shapes, interpret=interpret, **kwargs)(*args)
  return call
