"""Kernels inside a user's own ``jax.shard_map`` with JAX's default ``check_vma=True``.

A ``pallas_call`` there needs each output's varying mesh axes declared
(:func:`kernels.base.calls.pallas_call`), and a kernel's custom VJP needs its primals of one
varying type (:func:`kernels.base.calls.common_varying`, applied by ``dispatch``), so that a
replicated parameter's gradient is reduced over the mesh exactly once. Interpret mode on a CPU
cannot follow varying axes inside a kernel body (JAX's interpreters), so these are compiled for a
multi-chip TPU ahead of time, where Mosaic's lowering is what checks them.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import kernels
from kernels.base import calls


def test_varying_axes_are_empty_outside_a_shard_map():
  x = jnp.ones((4, 128))
  assert calls.varying_axes(x, (x, None)) == frozenset()
  assert calls.common_varying((x, 3)) == (x, 3)


def _compile(fn, *args):
  c = kernels.compile_for_tpu(fn, *args, generation="v5e", profile=False)
  return c.hlo


@pytest.mark.tpu_aot
def test_kernels_inside_a_user_shard_map_with_check_vma_compile_on_v5e_2x4():
  from kernels.perf import tpu
  mesh = tpu.tpu_mesh("v5e:2x4", ("data", "model"), (2, 4))

  def sds(shape, spec, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

  def fwd_and_grad(local, in_specs, out_spec, *args):
    f = jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_spec)  # check_vma=True, JAX's default
    loss = lambda *a: (f(*a).astype(jnp.float32) ** 2).sum()  # noqa: E731
    return _compile(f, *args), _compile(jax.grad(loss, argnums=tuple(range(len(args)))), *args)

  # rms_norm: rows over data, the scale replicated: its gradient is all-reduced once, nothing else moves.
  hlo, grad = fwd_and_grad(lambda x, s: kernels.rms_norm(x, s), (P("data"), P()), P("data"),
                           sds((8, 256, 1024), P("data")), sds((1024,), P()))
  assert hlo.count("tpu_custom_call") == 1 and "all-reduce" not in hlo
  assert grad.count("all-reduce(") == 1

  # flash attention: batch over data, heads over model: no collective forward or backward.
  q = sds((4, 512, 8, 128), P("data", None, "model"))
  hlo, grad = fwd_and_grad(lambda q, k, v: kernels.flash_attention(q, k, v, causal=True),
                           (P("data", None, "model"),) * 3, P("data", None, "model"), q, q, q)
  assert hlo.count("tpu_custom_call") == 1
  for text in (hlo, grad):
    assert not any(c in text for c in ("all-reduce(", "all-gather(", "collective-permute(", "all-to-all("))

  # matmul: rows over data, the weight replicated: its gradient is all-reduced once.
  hlo, grad = fwd_and_grad(lambda x, w: kernels.matmul(x, w), (P("data"), P()), P("data"),
                           sds((2048, 1024), P("data")), sds((1024, 1024), P()))
  assert hlo.count("tpu_custom_call") == 1 and "all-reduce" not in hlo
  assert grad.count("all-reduce(") == 1


def test_check_vma_false_shard_map_still_runs_in_interpret_mode():
  """The kernels.distributed idiom (check_vma=False) is unchanged: nothing is cast, interpret mode runs."""
  devices = np.array(jax.devices()[:2])
  if devices.size < 2:
    pytest.skip("needs 2 devices (tests/conftest.py asks for 8 CPU devices)")
  mesh = jax.sharding.Mesh(devices, ("data",))
  x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 16, 128)), jnp.float32)
  s = jnp.ones((128,), jnp.float32)
  f = jax.shard_map(lambda x, s: kernels.rms_norm(x, s, implementation="pallas", interpret=True), mesh=mesh,
                    in_specs=(P("data"), P()), out_specs=P("data"), check_vma=False)
  np.testing.assert_allclose(np.asarray(jax.jit(f)(x, s)), np.asarray(kernels.rms_norm_reference(x, s)),
                             atol=1e-5, rtol=1e-5)


@pytest.mark.tpu_aot
def test_ring_attention_inside_a_user_shard_map_with_check_vma_compiles_forward_and_backward():
  from kernels import distributed as dist
  from kernels.perf import tpu
  mesh = tpu.tpu_mesh("v5e:2x4", ("x",), (8,))
  q = jax.ShapeDtypeStruct((1, 2048, 8, 128), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "x")))
  f = jax.shard_map(lambda q, k, v: dist.ring_attention(q, k, v, axis_name="x", causal=True), mesh=mesh,
                    in_specs=(P(None, "x"),) * 3, out_specs=P(None, "x"))  # check_vma=True, JAX's default
  assert "collective-permute" in _compile(f, q, q, q)
  loss = lambda q, k, v: f(q, k, v).astype(jnp.float32).sum()  # noqa: E731
  assert "collective-permute" in _compile(jax.grad(loss, argnums=(0, 1, 2)), q, q, q)
