"""Small Pallas kernels used by the tests of the shared mechanics."""
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import kernels

TRACED = []  # which implementation was traced, for backend tests


def _scale_add_kernel(x_ref, o_ref):
  o_ref[...] = x_ref[...] * 2 + 1


def scale_add_pallas(x, *, interpret, block_rows=8, unsupported=None):
  TRACED.append(("pallas", interpret))
  if unsupported:
    raise NotImplementedError(unsupported)
  return _scale_add_vjp(x, interpret, block_rows)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _scale_add_vjp(x, interpret, block_rows):
  return _scale_add_call(x, interpret, block_rows)


_scale_add_vjp.defvjp(lambda x, interpret, block_rows: (_scale_add_call(x, interpret, block_rows), None),
                      lambda interpret, block_rows, _, g: (2 * g,))


def _scale_add_call(x, interpret, block_rows):
  rows, cols = x.shape
  spec = pl.BlockSpec((block_rows, cols), lambda i: (i, 0))
  return pl.pallas_call(_scale_add_kernel, grid=(rows // block_rows,), in_specs=[spec], out_specs=spec,
                        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), interpret=interpret)(x)


def scale_add_reference(x, unsupported=None):
  TRACED.append(("xla", None))
  if unsupported:
    raise NotImplementedError(unsupported)
  return x * 2 + 1


def scale_add(x, *, implementation=None, interpret=None, pallas_unsupported=None, xla_unsupported=None,
              block_rows=8):
  return kernels.dispatch(
      "scale_add", x,
      pallas=functools.partial(scale_add_pallas, unsupported=pallas_unsupported, block_rows=block_rows),
      xla=functools.partial(scale_add_reference, unsupported=xla_unsupported),
      implementation=implementation, interpret=interpret)


def matmul(a, b, *, bm=512, bk=1024, bn=1024, interpret=False):
  """The JAX Pallas guide's blocked matmul: f32 VMEM accumulator, K innermost."""
  m, k = a.shape
  n = b.shape[1]

  def kernel(a_ref, b_ref, o_ref, acc_ref):
    @pl.when(pl.program_id(2) == 0)
    def _():
      acc_ref[...] = jnp.zeros_like(acc_ref)

    acc_ref[...] += jnp.dot(a_ref[...], b_ref[...], preferred_element_type=jnp.float32)

    @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
    def _():
      o_ref[...] = acc_ref[...].astype(o_ref.dtype)

  return pl.pallas_call(
      kernel, grid=(m // bm, n // bn, k // bk),
      in_specs=[pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)), pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j))],
      out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
      out_shape=jax.ShapeDtypeStruct((m, n), a.dtype),
      scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=interpret)(a, b)
