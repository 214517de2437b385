"""kernels.gemm.api: the Pallas GEMM against its pure-JAX reference and a float64 NumPy oracle.

Everything but the ``tpu_aot`` tests runs the kernel in interpret mode on the CPU,
on small shapes with small blocks, so grids have several steps in every dimension.

Tolerances (|out - expected| <= ATOL + RTOL * |expected|, inputs ~ N(0, 1) scaled
so outputs are O(1)):

* float32 in and out: f32 accumulation in a different order than the oracle's
  float64 sum: 2e-5 absolute and relative (observed ~1e-6).
* bfloat16 out: one rounding of the f32 result to bf16 (8 significant bits, half
  an ulp = 2^-9 relative); kernel and reference may round an f32 value that sits
  on a boundary differently, so one ulp: 2^-7 relative, 2e-2 absolute near zero.
* int8 (quantized): products and sums are exact in int32; the f32 epilogue is the
  same code in kernel and reference, so they agree to f32 rounding (1e-6).
* gradients: computed by the same kernel in f32: 1e-4 relative to the largest entry.
"""
import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental.pallas import tpu as pltpu
from scipy import special

import kernels
from kernels.gemm.api import BlockSizes, matmul, matmul_reference

# The module itself (for its helpers): once kernels/__init__.py exports the matmul
# function, the attribute kernels.matmul is that function, not this module.
from kernels.gemm import api as mm

TOL = {
    "float32": dict(atol=2e-5, rtol=2e-5),
    "bfloat16": dict(atol=2e-2, rtol=2 ** -7),
}
GRAD_RTOL = 1e-4
SMALL = BlockSizes(32, 128, 128)  # several grid steps on every axis for the shapes below
ACTIVATIONS = ["relu", "gelu", "gelu_tanh", "silu"]


def rand(shape, dtype=jnp.float32, seed=0, scale=None):
  """N(0, 1) / sqrt(last dim) in ``dtype``, so products of two of them are O(1)."""
  x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
  return jnp.asarray(x / math.sqrt(scale or shape[-1]), dtype)


def f64(x):
  return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


# --- an independent float64 / NumPy oracle -----------------------------------------


def np_keep_mask(seed, rows, cols, rate):
  """The dropout hash, re-implemented in NumPy uint32 arithmetic (wrapping)."""
  def fmix(h):
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))
  with np.errstate(over="ignore"):
    seed = np.asarray(seed).astype(np.int32).view(np.uint32)
    h = fmix(rows.astype(np.uint32) * np.uint32(0x9E3779B1) + seed)
    h = fmix(h ^ (cols.astype(np.uint32) * np.uint32(0x85EBCA77)))
  return (h >> np.uint32(8)) >= np.uint32(round(rate * (1 << 24)))


def np_act(z, activation):
  if activation is None:
    return z
  if activation == "relu":
    return np.maximum(z, 0)
  if activation == "gelu":
    return 0.5 * z * (1 + special.erf(z / np.sqrt(2)))
  if activation == "gelu_tanh":
    return 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z ** 3)))
  if activation == "silu":
    return z / (1 + np.exp(-z))
  raise ValueError(activation)


def oracle(a, b, *, transpose_a=False, transpose_b=False, bias=None, activation=None, dropout_rate=0.0,
           dropout_key=None, a_scale=None, b_scale=None):
  a, b = f64(a), f64(b)
  if transpose_a:
    a = np.swapaxes(a, -1, -2)
  if transpose_b:
    b = np.swapaxes(b, -1, -2)
  z = np.matmul(a, b)
  if a_scale is not None:
    z = z * f64(a_scale).reshape(f64(a_scale).shape[:-1] + (-1, 1)) if f64(a_scale).ndim else z * f64(a_scale)
    z = z * f64(b_scale).reshape(-1)[None, :] if f64(b_scale).ndim else z * f64(b_scale)
  if bias is not None:
    z = z + f64(bias)
  y = np_act(z, activation)
  if dropout_rate:
    seed = np.asarray(mm.dropout_seed(dropout_key))
    m, n = y.shape[-2:]
    flat = y.reshape(-1, n)
    rows, cols = np.meshgrid(np.arange(flat.shape[0]), np.arange(n), indexing="ij")
    flat = np.where(np_keep_mask(seed, rows, cols, dropout_rate), flat / (1 - dropout_rate), 0.0)
    y = flat.reshape(y.shape)
  return y


def assert_close(out, expected, dtype):
  out = f64(out)
  np.testing.assert_allclose(out, expected, **TOL[jnp.dtype(dtype).name])


def run(a, b, interpret=True, **kw):
  kw.setdefault("block_sizes", SMALL)
  return matmul(a, b, implementation="pallas", interpret=interpret, **kw)


def operands(m, k, n, dtype=jnp.float32, transpose_a=False, transpose_b=False, batch_a=(), batch_b=(), seed=0):
  a = rand(batch_a + ((k, m) if transpose_a else (m, k)), dtype, seed, scale=k)
  b = rand(batch_b + ((n, k) if transpose_b else (k, n)), dtype, seed + 1, scale=1)
  return a, b


# --- forward -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("transpose_a,transpose_b", list(itertools.product([False, True], repeat=2)))
def test_transposes_match_oracle_and_reference(dtype, transpose_a, transpose_b):
  a, b = operands(96, 300, 200, dtype, transpose_a, transpose_b)
  kw = dict(transpose_a=transpose_a, transpose_b=transpose_b)
  blocks = BlockSizes(128 if transpose_a else 32, 128, 128)  # transposed A: M is its lane dim
  out = run(a, b, block_sizes=blocks, **kw)
  assert out.shape == (96, 200) and out.dtype == dtype
  assert_close(out, oracle(a, b, **kw), dtype)
  assert_close(out, f64(matmul_reference(a, b, **kw)), dtype)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_bias_and_activation(activation):
  a, b = operands(64, 256, 256)
  bias = rand((256,), seed=7, scale=1)
  out = run(a, b, bias=bias, activation=activation)
  assert_close(out, oracle(a, b, bias=bias, activation=activation), jnp.float32)


def test_bf16_epilogue_with_f32_bias_and_out_dtype():
  a, b = operands(64, 256, 256, jnp.bfloat16)
  bias = rand((256,), seed=3, scale=1)
  out = run(a, b, bias=bias, activation="gelu", out_dtype=jnp.float32)
  assert out.dtype == jnp.float32
  # bf16 inputs, exact products, f32 accumulation and epilogue: f32-tight against the oracle
  assert_close(out, oracle(a, b, bias=bias, activation="gelu"), jnp.float32)


@pytest.mark.parametrize("rate", [0.1, 0.5])
def test_dropout_mask_is_exactly_the_reference(rate):
  a, b = operands(96, 128, 256)
  key = jax.random.key(42)
  kw = dict(bias=rand((256,), seed=5, scale=1), activation="relu", dropout_rate=rate, dropout_key=key)
  out = np.asarray(run(a, b, **kw))
  ref = np.asarray(matmul_reference(a, b, **kw))
  pre = np.asarray(matmul_reference(a, b, bias=kw["bias"], activation="relu"))
  # the same elements are dropped, bit for bit, and the survivors are scaled by 1/(1-rate)
  np.testing.assert_array_equal(out == 0, ref == 0)
  assert_close(out, oracle(a, b, **kw), jnp.float32)
  kept = (out != 0) & (pre != 0)
  np.testing.assert_allclose(out[kept], pre[kept] / (1 - rate), rtol=2e-5, atol=2e-5)
  # the NumPy re-implementation of the hash agrees: it is a spec, not an accident
  rows, cols = np.meshgrid(np.arange(96), np.arange(256), indexing="ij")
  mask = np_keep_mask(np.asarray(mm.dropout_seed(key)), rows, cols, rate)
  np.testing.assert_array_equal(np.asarray(mm.dropout_keep_mask(mm.dropout_seed(key), jnp.asarray(rows, jnp.int32),
                                                                jnp.asarray(cols, jnp.int32), rate)), mask)
  assert abs((~mask).mean() - rate) < 0.02


def test_dropout_differs_by_key_and_batch_element():
  a, b = operands(32, 128, 128, batch_a=(2,))
  kw = dict(dropout_rate=0.5)
  one = np.asarray(run(a, b, dropout_key=jax.random.key(0), **kw))
  two = np.asarray(run(a, b, dropout_key=jax.random.key(1), **kw))
  assert (one == 0).mean() == pytest.approx(0.5, abs=0.05)
  assert ((one == 0) != (two == 0)).mean() > 0.3
  assert ((one[0] == 0) != (one[1] == 0)).mean() > 0.3  # each batch element its own mask


@pytest.mark.parametrize("m,k,n", [(100, 300, 77), (1, 200, 130), (7, 129, 1), (33, 1, 40), (130, 100, 260)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_odd_shapes(m, k, n, dtype):
  # analogues of 1000x3000x777, M=1, K not a multiple of 128 (masked tail), K < bk, N=1
  a, b = operands(m, k, n, dtype)
  out = run(a, b, bias=rand((n,), seed=2, scale=1), activation="silu")
  assert out.shape == (m, n)
  assert_close(out, oracle(a, b, bias=rand((n,), seed=2, scale=1), activation="silu"), dtype)


def test_k_tail_is_masked_even_when_vmem_holds_nan():
  # TPU interpret mode that fills never-written VMEM and out-of-bounds reads with NaN:
  # the stale tail of the last K block must not reach the output.
  params = pltpu.InterpretParams(out_of_bounds_reads="uninitialized", uninitialized_memory="nan")
  a, b = operands(40, 300, 136)
  out = run(a, b, interpret=params)
  assert np.isfinite(np.asarray(out)).all()
  assert_close(out, oracle(a, b), jnp.float32)


def test_no_races_in_the_pipeline():
  from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
  a, b = operands(64, 256, 256)
  out = run(a, b, interpret=pltpu.InterpretParams(detect_races=True), bias=rand((256,), seed=1, scale=1),
            activation="gelu")
  assert_close(out, oracle(a, b, bias=rand((256,), seed=1, scale=1), activation="gelu"), jnp.float32)
  assert ipc.races is not None and not ipc.races.races_found


@pytest.mark.parametrize("batch_a,batch_b,transpose_a", [
    ((2, 3), (), False),       # folded into M: one 2-D problem
    ((2, 3), (3,), False),     # broadcast batch grid axis
    ((), (2,), False),         # A broadcast along B's batch
    ((2, 1), (1, 3), True),    # both broadcast, transposed A (no folding possible)
])
def test_batch_dims(batch_a, batch_b, transpose_a):
  a, b = operands(40, 128, 136, transpose_a=transpose_a, batch_a=batch_a, batch_b=batch_b)
  kw = dict(transpose_a=transpose_a, bias=rand((136,), seed=4, scale=1), activation="relu")
  out = run(a, b, block_sizes=BlockSizes(128 if transpose_a else 16, 128, 128), **kw)
  expected = oracle(a, b, **kw)
  assert out.shape == expected.shape
  assert_close(out, expected, jnp.float32)
  assert_close(out, f64(matmul_reference(a, b, **kw)), jnp.float32)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(m=st.integers(1, 160), k=st.integers(1, 300), n=st.integers(1, 300), transpose_a=st.booleans(),
       transpose_b=st.booleans(), bf16=st.booleans(), bm=st.sampled_from([16, 64, 128]),
       bk=st.sampled_from([128, 256]), bn=st.sampled_from([128, 256]))
def test_hypothesis_shapes(m, k, n, transpose_a, transpose_b, bf16, bm, bk, bn):
  dtype = jnp.bfloat16 if bf16 else jnp.float32
  a, b = operands(m, k, n, dtype, transpose_a, transpose_b, seed=m + k + n)
  blocks = BlockSizes(max(bm, 128) if transpose_a else bm, bk, bn)
  kw = dict(transpose_a=transpose_a, transpose_b=transpose_b)
  assert_close(run(a, b, block_sizes=blocks, **kw), oracle(a, b, **kw), dtype)


def test_precision_highest_and_default():
  a, b = operands(32, 256, 128)
  for precision in (None, "default", "highest", jax.lax.Precision.HIGH):
    assert_close(run(a, b, precision=precision), oracle(a, b), jnp.float32)


def test_default_blocks_run():
  a, b = operands(64, 384, 256, jnp.bfloat16)
  assert_close(matmul(a, b, interpret=True), oracle(a, b), jnp.bfloat16)


@pytest.mark.parametrize("m,k,n,transpose_a,transpose_b,views", [
    (256, 136, 200, False, False, (True, False, True)),   # C^T computed; b (stored column-major) read transposed
    (40, 256, 200, False, False, (False, False, True)),   # only b read through its transpose
    (200, 256, 136, False, True, (True, False, False)),   # C^T with the caller's transpose flags swapped
    (256, 136, 200, True, True, (True, True, False)),
])
def test_default_call_reads_arrays_as_stored(m, k, n, transpose_a, transpose_b, views):
  """Unaligned shapes at default blocks: the output computed transposed and operands read through
  their transposes (where XLA:TPU stores them column-major) give the same values and gradients."""
  a, b = operands(m, k, n, transpose_a=transpose_a, transpose_b=transpose_b)
  kw = dict(transpose_a=transpose_a, transpose_b=transpose_b, activation="gelu")
  p = mm._validate(a, b, bias=None, out_dtype=None, precision=None, dropout_rate=0.0, dropout_key=None, **kw)
  assert mm._stored_views(p)[1:] == views
  ct = rand((m, n), seed=5, scale=1)
  out, vjp = jax.vjp(lambda a, b: matmul(a, b, implementation="pallas", interpret=True, **kw), a, b)
  grads, ref_grads = vjp(ct), jax.vjp(lambda a, b: matmul_reference(a, b, **kw), a, b)[1](ct)
  assert_close(out, oracle(a, b, **kw), jnp.float32)
  for g, r in zip(grads, ref_grads):
    assert g.shape == r.shape
    np.testing.assert_allclose(g, r, rtol=GRAD_RTOL, atol=GRAD_RTOL * float(jnp.abs(r).max()))


def test_xla_implementation_is_the_reference():
  a, b = operands(64, 128, 128)
  kw = dict(bias=rand((128,), seed=1, scale=1), activation="gelu_tanh", dropout_rate=0.2,
            dropout_key=jax.random.key(3))
  np.testing.assert_array_equal(matmul(a, b, implementation="xla", **kw), matmul_reference(a, b, **kw))
  np.testing.assert_array_equal(matmul(a, b, **kw), matmul_reference(a, b, **kw))  # CPU default: XLA


# --- quantized ---------------------------------------------------------------------

QUANT = [jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2]


def quantized_operands(m, k, n, dtype, transpose_a=False, transpose_b=False, batch_a=(), seed=0):
  rng = np.random.default_rng(seed)
  if jnp.dtype(dtype) == jnp.int8:
    make = lambda shape: jnp.asarray(rng.integers(-128, 128, shape), jnp.int8)  # noqa: E731
  else:
    make = lambda shape: jnp.asarray(rng.standard_normal(shape), dtype)  # noqa: E731
  a = make(batch_a + ((k, m) if transpose_a else (m, k)))
  b = make((n, k) if transpose_b else (k, n))
  a_scale = jnp.asarray(rng.uniform(0.5, 1.5, batch_a + (m,)) / k, jnp.float32)
  b_scale = jnp.asarray(rng.uniform(0.5, 1.5, (n,)) / 100, jnp.float32)
  return a, b, a_scale, b_scale


@pytest.mark.parametrize("dtype", QUANT)
@pytest.mark.parametrize("transpose_a,transpose_b", [(False, False), (True, True)])
def test_quantized_matches_oracle(dtype, transpose_a, transpose_b):
  # K = 300: a masked K tail in the narrow dtype; int8 sums are exact in int32
  a, b, sa, sb = quantized_operands(72, 300, 200, dtype, transpose_a, transpose_b)
  bias = rand((200,), seed=3, scale=1)
  kw = dict(transpose_a=transpose_a, transpose_b=transpose_b, bias=bias, activation="gelu")
  blocks = BlockSizes(128 if transpose_a else 32, 128, 128)
  out = mm.quantized_matmul(a, b, sa, sb, implementation="pallas", interpret=True, block_sizes=blocks, **kw)
  assert out.dtype == jnp.float32 and out.shape == (72, 200)
  ref = mm.quantized_matmul_reference(a, b, sa, sb, **kw)
  np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(f64(out), oracle(a, b, a_scale=sa, b_scale=sb, **kw), rtol=1e-5, atol=1e-5)


def test_quantized_scales_batch_dropout_and_bf16_out():
  a, b, sa, sb = quantized_operands(40, 128, 136, jnp.int8, batch_a=(2, 3))
  kw = dict(activation="relu", dropout_rate=0.3, dropout_key=jax.random.key(0), out_dtype=jnp.bfloat16)
  out = mm.quantized_matmul(a, b, sa, sb[None, :], interpret=True, block_sizes=BlockSizes(32, 128, 128), **kw)
  ref = mm.quantized_matmul_reference(a, b, sa, sb, **kw)
  assert out.shape == (2, 3, 40, 136) and out.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(out) == 0, np.asarray(ref) == 0)
  assert_close(out, f64(ref), jnp.bfloat16)
  # scalar (per-tensor) scales and M=1
  a, b, _, _ = quantized_operands(1, 200, 128, jnp.int8)
  out = mm.quantized_matmul(a, b, jnp.float32(0.5), jnp.float32(0.25), interpret=True)
  np.testing.assert_allclose(f64(out), f64(a) @ f64(b) * 0.125, rtol=1e-6)


def test_quantized_bad_input():
  a, b, sa, sb = quantized_operands(64, 128, 128, jnp.int8)
  cases = [("a", dict(a=a.astype(jnp.bfloat16), b=b.astype(jnp.bfloat16))), ("b", dict(b=b.astype(jnp.float8_e4m3fn))),
           ("a_scale", dict(a_scale=jnp.ones((128,)))), ("b_scale", dict(b_scale=jnp.ones((64,)))),
           ("a_scale", dict(a_scale=jnp.ones((64,), jnp.int32))), ("b", dict(b=b[:100]))]
  for argument, override in cases:
    kw = dict(a=a, b=b, a_scale=sa, b_scale=sb)
    kw.update(override)
    with pytest.raises(kernels.KernelError) as info:
      mm.quantized_matmul(kw["a"], kw["b"], kw["a_scale"], kw["b_scale"], interpret=True)
    assert info.value.argument == argument, str(info.value)


# --- composition -----------------------------------------------------------------


def test_jit_vmap_grad_compose():
  a, b = operands(32, 128, 128)
  f = jax.jit(lambda a, b: run(a, b, activation="relu"))
  assert_close(f(a, b), oracle(a, b, activation="relu"), jnp.float32)
  stacked = jnp.stack([a, 2 * a])
  out = jax.vmap(lambda x: run(x, b))(stacked)
  assert_close(out, oracle(stacked, b), jnp.float32)
  g = jax.jit(jax.grad(lambda a: run(a, b, activation="silu").sum()))(a)
  g_ref = jax.grad(lambda a: matmul_reference(a, b, activation="silu").sum())(a)
  np.testing.assert_allclose(g, g_ref, rtol=GRAD_RTOL, atol=GRAD_RTOL * float(jnp.abs(g_ref).max()))


# --- gradients -------------------------------------------------------------------


def _grads(fn, a, b, bias, ct):
  out, vjp = jax.vjp(fn, a, b, bias)
  return out, vjp(ct)


@pytest.mark.parametrize("transpose_a,transpose_b,activation", [
    (False, False, "gelu"), (True, False, "relu"), (False, True, "silu"), (True, True, "gelu_tanh"),
    (False, False, None)])
def test_gradients_match_reference_vjp(transpose_a, transpose_b, activation):
  a, b = operands(48, 160, 136, transpose_a=transpose_a, transpose_b=transpose_b)
  bias = rand((136,), seed=9, scale=1)
  kw = dict(transpose_a=transpose_a, transpose_b=transpose_b, activation=activation, dropout_rate=0.25,
            dropout_key=jax.random.key(7))
  blocks = BlockSizes(128 if transpose_a else 16, 128, 128)
  ct = rand((48, 136), seed=11, scale=1)
  out, grads = _grads(lambda a, b, c: run(a, b, bias=c, block_sizes=blocks, **kw), a, b, bias, ct)
  ref_out, ref_grads = _grads(lambda a, b, c: matmul_reference(a, b, bias=c, **kw), a, b, bias, ct)
  assert_close(out, f64(ref_out), jnp.float32)
  for name, g, r in zip(("a", "b", "bias"), grads, ref_grads):
    assert g.shape == r.shape and g.dtype == r.dtype, name
    np.testing.assert_allclose(g, r, rtol=GRAD_RTOL, atol=GRAD_RTOL * float(jnp.abs(r).max()), err_msg=name)


def test_gradients_with_broadcast_batch():
  a, b = operands(24, 128, 128, transpose_a=True, batch_a=(2, 1), batch_b=(3,))
  bias = rand((128,), seed=2, scale=1)
  ct = rand((2, 3, 24, 128), seed=3, scale=1)
  kw = dict(transpose_a=True, activation="gelu")
  _, grads = _grads(lambda a, b, c: run(a, b, bias=c, block_sizes=BlockSizes(128, 128, 128), **kw), a, b, bias, ct)
  _, ref = _grads(lambda a, b, c: matmul_reference(a, b, bias=c, **kw), a, b, bias, ct)
  for g, r in zip(grads, ref):
    assert g.shape == r.shape
    np.testing.assert_allclose(g, r, rtol=GRAD_RTOL, atol=GRAD_RTOL * float(jnp.abs(r).max()))


def test_bf16_gradients_have_input_dtypes():
  a, b = operands(32, 128, 128, jnp.bfloat16)
  bias = rand((128,), jnp.float32, seed=1, scale=1)
  ga, gb, gc = jax.grad(lambda a, b, c: run(a, b, bias=c, activation="relu").astype(jnp.float32).sum(),
                        argnums=(0, 1, 2))(a, b, bias)
  assert (ga.dtype, gb.dtype, gc.dtype) == (jnp.bfloat16, jnp.bfloat16, jnp.float32)
  ra, rb, rc = jax.grad(lambda a, b, c: matmul_reference(a, b, bias=c, activation="relu").astype(jnp.float32).sum(),
                        argnums=(0, 1, 2))(a, b, bias)
  for g, r in ((ga, ra), (gb, rb), (gc, rc)):
    np.testing.assert_allclose(f64(g), f64(r), rtol=2e-2, atol=2e-2 * float(jnp.abs(r.astype(jnp.float32)).max()))


def test_check_grads_f32():
  a, b = operands(16, 128, 128)
  bias = rand((128,), seed=1, scale=1)
  from jax.test_util import check_grads
  check_grads(lambda a, b, c: run(a, b, bias=c, activation="gelu_tanh"), (a, b, bias), order=1,
              modes=("rev",), atol=1e-2, rtol=1e-2, eps=1e-3)


# --- bad input: a KernelError naming the argument, before lowering -----------------------


def _bad(argument, error=kernels.KernelError, **overrides):
  a, b = operands(64, 128, 128)
  kw = dict(a=a, b=b, implementation="pallas", interpret=True, block_sizes=SMALL)
  kw.update(overrides)
  with pytest.raises(error) as info:
    matmul(kw.pop("a"), kw.pop("b"), **kw)
  assert info.value.argument == argument, str(info.value)
  assert argument in str(info.value)
  return str(info.value)


def test_bad_input_names_the_argument():
  m = _bad("b", b=rand((127, 128)))
  assert "inner dimensions" in m and "64x128" in m and "127x128" in m
  assert "rank" in _bad("a", a=rand((128,)))
  assert "rank" in _bad("b", b=rand((128,)))
  assert "int32" in _bad("a", a=jnp.ones((64, 128), jnp.int32), b=jnp.ones((128, 128), jnp.int32))
  assert "quantized_matmul" in _bad("a", a=jnp.ones((64, 128), jnp.int8), b=jnp.ones((128, 128), jnp.int8))
  assert "float16" in _bad("a", a=jnp.ones((64, 128), jnp.float16), b=jnp.ones((128, 128), jnp.float16))
  assert "dtype" in _bad("b", b=rand((128, 128), jnp.bfloat16))
  assert "broadcast" in _bad("b", a=rand((2, 64, 128)), b=rand((3, 128, 128)))
  _bad("activation", activation="tanh")
  _bad("dropout_rate", dropout_rate=1.0, dropout_key=jax.random.key(0))
  _bad("dropout_rate", dropout_rate=-0.1)
  _bad("dropout_key", dropout_rate=0.5)
  _bad("dropout_key", dropout_rate=0.5, dropout_key=3)
  assert "(128,)" in _bad("bias", bias=rand((64,)))
  _bad("out_dtype", out_dtype=jnp.int8)
  _bad("precision", precision="ultra")
  _bad("implementation", implementation="cuda")
  _bad("transpose_a", transpose_a=1)
  _bad("block_sizes", block_sizes=(1, 2))
  assert "divisible" in _bad("block_sizes", kernels.TilingError, block_sizes=BlockSizes(20, 128, 128))
  assert "divisible" in _bad("block_sizes", kernels.TilingError, block_sizes=BlockSizes(32, 100, 128))


def test_vmem_overflow_is_caught_before_lowering():
  big = jax.ShapeDtypeStruct((8192, 8192), jnp.bfloat16)
  with pytest.raises(kernels.VmemOverflowError) as info:
    jax.eval_shape(lambda a, b: matmul(a, b, implementation="pallas", interpret=True,
                                       block_sizes=BlockSizes(4096, 4096, 4096)), big, big)
  assert info.value.argument == "block_sizes" and "VMEM" in str(info.value)


# --- block sizes -----------------------------------------------------------------


def test_block_sizes_defaults_and_fitting():
  for gen in kernels.TPU_GENERATIONS:
    for shape in [(4096, 4096, 4096), (2048, 2048, 2048), (16, 4096, 4096)]:
      blocks = mm.default_block_sizes(gen, jnp.bfloat16, *shape)
      assert isinstance(blocks, BlockSizes) and blocks.bk % 128 == 0 and blocks.bn % 128 == 0
      assert blocks.bm % 16 == 0
  assert mm.default_block_sizes(None) == mm.default_block_sizes("v5e")
  assert mm.fit_block_sizes(BlockSizes(512, 1024, 1024), 1000, 300, 77) == BlockSizes(512, 300, 77)
  assert mm.fit_block_sizes(BlockSizes(512, 1024, 1024), 1, 4096, 4096) == BlockSizes(16, 1024, 1024)
  assert mm.fit_block_sizes(BlockSizes(512, 1024, 1024), 8, 4096, 4096, jnp.int8) == BlockSizes(32, 1024, 1024)
  assert mm.fit_block_sizes(BlockSizes(512, 1024, 1024), 8, 4096, 4096, transpose_a=True) == BlockSizes(8, 1024, 1024)
  with pytest.raises(dataclasses.FrozenInstanceError):
    BlockSizes().bm = 3


def _default_plan(gen, dtype, m, k, n, ta, tb):
  sd = lambda shape: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
  a, b = sd((k, m) if ta else (m, k)), sd((n, k) if tb else (k, n))
  quant = jnp.dtype(dtype) == jnp.int8
  p = mm._validate(a, b, transpose_a=ta, transpose_b=tb, bias=None, activation=None, out_dtype=None,
                   precision=None, dropout_rate=0.0, dropout_key=None, quantized=quant)
  with kernels.base.backend.target(gen):
    return mm._plan(p, None, save_z=False)


def test_default_blocks_are_legal_for_every_dimension_from_1_to_2048():
  """Every table entry a default call can pick, legalized for every M, K and N in 1..2048 and each
  transpose combination, passes Mosaic's tiling rule on all three operand blocks. (fit_block_sizes
  legalizes each dimension from that dimension alone, so the diagonal m = k = n = d covers them all;
  the test below checks that claim on whole plans.)"""
  table = kernels.base.tiling.block_table("matmul")
  checked = 0
  for dtype in (jnp.bfloat16, jnp.float32, jnp.int8):
    candidates = {mm._FALLBACK} | {BlockSizes(e["bm"], e["bk"], e["bn"]) for per_gen in table.values()
                                   for e in per_gen.get(jnp.dtype(dtype).name, [])}
    for blocks, ta, tb in itertools.product(candidates, (False, True), (False, True)):
      for d in range(1, 2049):
        bm, bk, bn = dataclasses.astuple(mm.fit_block_sizes(blocks, d, d, d, dtype, ta, tb, legalize=True))
        kernels.base.tiling.check_block_shape("a", (bk, bm) if ta else (bm, bk), (d, d))
        kernels.base.tiling.check_block_shape("b", (bn, bk) if tb else (bk, bn), (d, d))
        kernels.base.tiling.check_block_shape("out", (bm, bn), (d, d))
        checked += 1
  assert checked > 3 * 4 * 2048


@settings(max_examples=400, deadline=None, derandomize=True)
@given(m=st.integers(1, 2048), k=st.integers(1, 2048), n=st.integers(1, 2048), ta=st.booleans(), tb=st.booleans(),
       gen=st.sampled_from(kernels.TPU_GENERATIONS), dtype=st.sampled_from([jnp.bfloat16, jnp.float32, jnp.int8]))
def test_default_plan_never_fails(m, k, n, ta, tb, gen, dtype):
  """The whole default plan (table lookup, legalization, tiling and VMEM checks) for random shapes."""
  plan = _default_plan(gen, dtype, m, k, n, ta, tb)
  assert plan.grid[-3:] == (math.ceil(m / plan.bm), math.ceil(n / plan.bn), math.ceil(k / plan.bk))


def test_default_plan_with_transposed_a_at_every_small_m():
  """The reported failure: matmul(a, b, transpose_a=True), a (489, 62), b (489, 372), raised TilingError
  (a bm=16 default against an M of 62, which is A's lane dimension). Every M from 1 to 130 plans; a few run."""
  for gen in kernels.TPU_GENERATIONS:
    for m in range(1, 131):
      _default_plan(gen, jnp.bfloat16, m, 489, 372, True, False)
  for m in (62, 130):
    a = jax.random.normal(jax.random.key(0), (489, m), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (489, 372), jnp.float32)
    got = matmul(a, b, transpose_a=True, implementation="pallas", interpret=True)
    np.testing.assert_allclose(got, matmul_reference(a, b, transpose_a=True), rtol=2e-5, atol=2e-4)


# Shapes users bring: M, K, N in the thousands, none a multiple of 512; vocabulary projections;
# decode and small-batch rows (the notebook's "unaligned" sweep, and a few more).
UNALIGNED = [(1000, 3000, 5000), (3000, 5000, 7000), (7000, 1000, 3000), (5000, 7000, 1000), (2048, 4096, 32000),
             (4096, 4096, 50257), (16, 4096, 50257), (128, 7000, 3000), (256, 5000, 7000), (50257, 4096, 4096),
             (1, 50257, 1000), (32000, 1000, 7000)]


@pytest.mark.parametrize("gen", kernels.TPU_GENERATIONS)
def test_default_blocks_fit_unaligned_shapes(gen):
  """The block chooser over shape classes (plans only, no compiles): at every unaligned shape, each
  transpose combination and in the views the default call runs (:func:`_stored_views`), the plan is
  legal and fits VMEM (the planner raises otherwise), and each block is the tuned one balanced: no
  larger, no more blocks, less than one tiling multiple of padding per block."""
  rng = np.random.default_rng(0)
  shapes = UNALIGNED + [tuple(int(x) for x in rng.integers(1, 60000, 3)) for _ in range(10)]
  for dtype, (m, k, n), ta, tb in itertools.product((jnp.bfloat16, jnp.float32), shapes, (False, True),
                                                     (False, True)):
    base = _default_plan(gen, dtype, m, k, n, ta, tb)
    p = mm._validate(jax.ShapeDtypeStruct((k, m) if ta else (m, k), dtype),
                     jax.ShapeDtypeStruct((n, k) if tb else (k, n), dtype), transpose_a=ta, transpose_b=tb,
                     bias=None, activation=None, out_dtype=None, precision=None, dropout_rate=0.0, dropout_key=None)
    q = mm._stored_views(p)[0]
    with kernels.base.backend.target(gen):
      plan = mm._plan(q, None, save_z=False)
    for prob, pl_ in ((p, base), (q, plan)):
      # (a skinny class may keep a dimension whole: checked against the tuned blocks otherwise)
      tuned = mm.fit_block_sizes(mm.default_block_sizes(gen, dtype, prob.m, prob.k, prob.n, keep_whole=False),
                                 prob.m, prob.k, prob.n, dtype, prob.transpose_a, prob.transpose_b, legalize=True,
                                 balance=False)
      sub = kernels.base.tiling.sublane_multiple(dtype)
      # (K may take up to two more blocks when that pads less: more K steps re-read nothing)
      for d, b, b0, multiple, extra in (
          (prob.m, pl_.bm, tuned.bm, 128 if prob.transpose_a else sub, 0),
          (prob.k, pl_.bk, tuned.bk, 8 if prob.transpose_a and not prob.transpose_b else 128, 2),
          (prob.n, pl_.bn, tuned.bn, 128, 0)):
        if b >= d:
          continue
        assert b <= b0 and math.ceil(d / b) <= math.ceil(d / b0) + extra, (gen, m, k, n, ta, tb, b, b0)
        assert math.ceil(d / b) * b <= math.ceil(d / b0) * b0, (gen, m, k, n, ta, tb, b, b0)
        if b < d:
          assert math.ceil(d / b) * b - d < math.ceil(d / b) * multiple, (gen, m, k, n, ta, tb, d, b)


def test_balanced_blocks_cut_the_padding():
  # K = 5000 in the tuned 4096: two blocks, 8192 rows -> two of 2560, 5120 rows.
  assert mm.fit_block_sizes(BlockSizes(1024, 4096, 1024), 3000, 5000, 7000, legalize=True) == \
      BlockSizes(1008, 2560, 1024)
  # ... and in blocks of at most 2048: four of 1280 (5120 rows), not three of 1792 (5376)
  assert mm.fit_block_sizes(BlockSizes(1024, 2048, 1024), 3000, 5000, 7000, legalize=True).bk == 1280
  assert mm.fit_block_sizes(BlockSizes(1024, 4096, 1024), 3000, 5000, 7000, legalize=True, balance=False) == \
      BlockSizes(1024, 4096, 1024)
  # a skinny class keeps a whole tuned dimension whole (256 x 4096 x 4096 on v5e: bk = K)
  assert mm.default_block_sizes("v5e", jnp.bfloat16, 200, 5000, 3000).bk == 5000
  assert mm.default_block_sizes("v5e", jnp.bfloat16, 200, 5000, 3000, keep_whole=False).bk == 4096
  # caller's blocks are kept as given
  assert mm.fit_block_sizes(BlockSizes(1024, 4096, 1024), 3000, 5000, 7000) == BlockSizes(1024, 4096, 1024)


def test_layout_rule():
  # XLA:TPU's default layouts of 2-D parameters, observed with AOT compiles (v4, v5e, v6e alike):
  # column-major exactly where that pads fewer (8, 128) tiles.
  column = [(4096, 50257), (7000, 1000), (256, 5000), (128, 7000), (3000, 777), (7000, 3000), (1024, 1000)]
  row = [(16, 4096), (5000, 7000), (1000, 3000), (3000, 5000), (1000, 5000), (5000, 1000), (4096, 32000),
         (50257, 4096), (1000, 50257), (999, 256), (1000, 128)]
  assert all(mm.xla_lays_out_column_major(s, jnp.bfloat16) for s in column)
  assert not any(mm.xla_lays_out_column_major(s, jnp.bfloat16) for s in row)


# --- ahead-of-time compilation for TPU -----------------------------------------------

sds = jax.ShapeDtypeStruct
bf16 = jnp.bfloat16


@pytest.mark.tpu_aot
@pytest.mark.parametrize("generation", kernels.TPU_GENERATIONS)
def test_aot_compiles_at_defaults(generation):
  comp = kernels.compile_for_tpu(lambda a, b: matmul(a, b), sds((2048, 2048), bf16), sds((2048, 2048), bf16),
                                 generation=generation, profile=False)
  assert "tpu_custom_call" in comp.hlo and comp.vmem_bytes > 1 << 20
  # an odd shape: M and K not multiples of the blocks (partial M block, masked K tail), with epilogue.
  # (Dims whose padding XLA:TPU would avoid by a column-major default layout, e.g. N=777, make XLA
  # insert a relayout copy before the kernel; see the module docstring.)
  comp = kernels.compile_for_tpu(
      lambda a, b, c: matmul(a, b, bias=c, activation="gelu", dropout_rate=0.1, dropout_key=jax.random.key(0)),
      sds((1000, 3000), bf16), sds((3000, 768), bf16), sds((768,), jnp.float32), generation=generation,
      profile=False)
  assert "tpu_custom_call" in comp.hlo


def _hlo_ops(hlo: str) -> set[str]:
  import re
  return set(re.findall(r"= \S+ ([a-z][\w-]*)\(", hlo))


@pytest.mark.tpu_aot
@pytest.mark.parametrize("generation", kernels.TPU_GENERATIONS)
def test_aot_unaligned_shapes_compile_without_relayout_copies(generation):
  # Two shapes of the unaligned benchmark: the vocabulary projection at decode (B [4096, 50257] is
  # stored column-major) and [7000, 1000] @ [1000, 3000] (A and the output column-major). The
  # default call reads and writes them as stored: no copy op before or after the kernel.
  # (profile=False: libtpu's cost model aborts the process on v5p's decode kernel with B read
  # transposed; the compiler itself is fine.)
  for m, k, n in ((16, 4096, 50257), (7000, 1000, 3000)):
    comp = kernels.compile_for_tpu(lambda a, b: matmul(a, b), sds((m, k), bf16), sds((k, n), bf16),
                                   generation=generation, profile=False)
    assert _hlo_ops(comp.hlo) <= {"parameter", "bitcast", "custom-call"}, (m, k, n, _hlo_ops(comp.hlo))


@pytest.mark.tpu_aot
def test_layout_rule_matches_xla():
  import re
  for shape in [(4096, 50257), (7000, 1000), (256, 5000), (5000, 7000), (1000, 5000), (999, 256)]:
    comp = kernels.compile_for_tpu(lambda x: x + 1, sds(shape, bf16), generation="v5e", profile=False)
    layout = re.search(r"entry_computation_layout=\{\(\S+?\{([0-9,]+)", comp.hlo).group(1)
    assert (layout == "0,1") == mm.xla_lays_out_column_major(shape, bf16), (shape, layout)


@pytest.mark.tpu_aot
def test_aot_transposes_batch_and_backward():
  # Transposes happen in the kernel (index maps + dot dimension numbers): no transpose or
  # copy op in HBM, forward or backward.
  for ta, tb in itertools.product([False, True], repeat=2):
    comp = kernels.compile_for_tpu(lambda a, b: matmul(a, b, transpose_a=ta, transpose_b=tb, activation="relu"),
                                   sds((4, 512, 512), bf16), sds((1024, 512) if tb else (512, 1024), bf16),
                                   profile=False)
    assert _hlo_ops(comp.hlo) <= {"parameter", "bitcast", "custom-call", "reshape"}, _hlo_ops(comp.hlo)
  grad = jax.grad(lambda a, b, c: matmul(a, b, bias=c, activation="silu", transpose_b=True).astype(jnp.float32).sum(),
                  argnums=(0, 1, 2))
  comp = kernels.compile_for_tpu(grad, sds((512, 1024), bf16), sds((768, 1024), bf16), sds((768,), jnp.float32),
                                 generation="v5p", profile=False)
  assert comp.hlo.count("tpu_custom_call") >= 3  # forward, dA and dB all on the kernel
  assert not _hlo_ops(comp.hlo) & {"transpose", "copy"}, _hlo_ops(comp.hlo)


@pytest.mark.tpu_aot
def test_aot_raises_vmem_limit_for_large_blocks():
  # 2 x (1024x2048 + 2048x1024 + 1024x1024) bf16 + 1024x1024 f32 = 24 MiB: above v5e's 16 MiB default
  comp = kernels.compile_for_tpu(lambda a, b: matmul(a, b, block_sizes=BlockSizes(1024, 2048, 1024)),
                                 sds((2048, 4096), bf16), sds((4096, 2048), bf16), generation="v5e",
                                 profile=False)
  assert comp.vmem_bytes > 16 * 2 ** 20


@pytest.mark.tpu_aot
def test_aot_f32_precisions():
  for precision in (None, "highest"):
    kernels.compile_for_tpu(lambda a, b: matmul(a, b, precision=precision), sds((512, 512), jnp.float32),
                            sds((512, 512), jnp.float32), generation="v5e", profile=False)


@pytest.mark.tpu_aot
def test_estimate_below_roofline_and_near_xla():
  n = 1024
  flops, nbytes = kernels.matmul_cost(n, n, n)
  ours = kernels.estimate_tpu(lambda a, b: matmul(a, b), sds((n, n), bf16), sds((n, n), bf16), generation="v5e",
                              flops=flops, bytes_accessed=nbytes)
  xla = kernels.estimate_tpu(lambda a, b: a @ b, sds((n, n), bf16), sds((n, n), bf16), generation="v5e",
                             flops=flops, bytes_accessed=nbytes)
  assert ours.valid and xla.valid
  assert xla.seconds / ours.seconds > 0.97, (str(ours), str(xla))


@pytest.mark.tpu_aot
@pytest.mark.parametrize("generation", kernels.TPU_GENERATIONS)
def test_aot_quantized(generation):
  def q(a, b, sa, sb):
    return mm.quantized_matmul(a, b, sa, sb, activation="relu", out_dtype=bf16, implementation="pallas")
  for dtype in (jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2):
    # (a [1024, 3000] fp8 would get an XLA relayout copy before the kernel, which crashes libtpu's cost model)
    args = (sds((1000, 3000), dtype), sds((3000, 768), dtype), sds((1000,), jnp.float32), sds((768,), jnp.float32))
    if jnp.dtype(dtype).name in mm.MXU_DTYPES[generation]:
      assert "tpu_custom_call" in kernels.compile_for_tpu(q, *args, generation=generation, profile=False).hlo
    else:  # v4: Mosaic has no int8/fp8 MXU path; Pallas refuses with a KernelError naming dtype and chip
      rule = f"{jnp.dtype(dtype).name} matmul does not lower on TPU {generation}"
      with pytest.raises(kernels.KernelError, match=rule):
        kernels.compile_for_tpu(q, *args, generation=generation)


@pytest.mark.tpu_aot
def test_megacore_splits_the_parallel_axes(monkeypatch):
  # v5p has two TensorCores per device: with M and N "parallel" Mosaic gives each core half the
  # grid, so the estimate is ~half of the same kernel with every axis "arbitrary".
  def estimate():
    flops, nbytes = kernels.matmul_cost(1024, 1024, 1024)
    return kernels.estimate_tpu(lambda a, b: matmul(a, b, block_sizes=BlockSizes(256, 1024, 256)),
                                sds((1024, 1024), bf16), sds((1024, 1024), bf16), generation="v5p",
                                flops=flops, bytes_accessed=nbytes).seconds
  parallel = estimate()
  original = pltpu.CompilerParams

  def sequential(dimension_semantics=None, **kw):
    return original(dimension_semantics=("arbitrary",) * len(dimension_semantics), **kw)
  monkeypatch.setattr(pltpu, "CompilerParams", sequential)
  assert parallel < 0.6 * estimate()


@pytest.mark.parametrize("n", [16, 32, 64, 96])
def test_bf16_narrow_output_under_jit_in_interpret_mode(n):
  """XLA:CPU has no bf16 x bf16 -> f32 dot for 64 or fewer columns ("Unsupported element type for
  DotThunk"); in interpret mode the kernel widens its bf16 operands, which gives the MXU's products."""
  rng = np.random.default_rng(n)
  a = jnp.asarray(rng.standard_normal((64, 64)), jnp.bfloat16)
  b = jnp.asarray(rng.standard_normal((64, n)), jnp.bfloat16)
  got = jax.jit(lambda a, b: kernels.matmul(a, b, implementation="pallas", interpret=True))(a, b)
  want = np.asarray(a, np.float32) @ np.asarray(b, np.float32)
  np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2 ** -7, atol=2e-2)
