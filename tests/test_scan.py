"""kernels.scan.linear: the linear recurrence against its lax.scan reference and a float64 oracle.

Everything but the ``tpu_aot`` tests runs the kernel in interpret mode on the CPU, on small
shapes with small blocks, so grids have several seq chunks (the carry crosses chunks),
several width blocks and a partial last chunk.

Tolerances (|out - expected| <= ATOL + RTOL * |expected|; states are O(1)):

* float32: the tile scan multiplies the gates in a different order than the sequential
  reference: 1e-5 absolute and relative (observed ~5e-7).
* bfloat16 h: one rounding of the f32 state (half an ulp = 2^-9 relative); kernel and
  reference may round a value on a boundary differently: one ulp, 2^-7 relative, and 1e-2
  absolute near zero.
* gradients: f32, 1e-5 of the largest entry (observed ~1e-6; the time-invariant gate's
  gradient sums B x T terms); bf16 inputs, 2^-6 relative and 2e-2 of the largest entry
  (the backward reads the bf16-rounded h for h_{t-1}, the reference its f32 state).
"""
import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental.pallas import tpu as pltpu

import kernels
from tests import run_program
from kernels.scan import linear as scan
from kernels.scan.linear import BlockSizes, linear_scan, linear_scan_reference

TOL = {"float32": dict(atol=1e-5, rtol=1e-5), "bfloat16": dict(atol=1e-2, rtol=2 ** -7)}
SMALL = BlockSizes(16, 128)  # 2 seq chunks (the last partial) x 2 width blocks for [2, 24, 256]
B, T, W = 2, 24, 256
GATES = ["full", "token", "time"]


def rand(shape, dtype=jnp.float32, seed=0, scale=1.0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * scale, dtype)


def gate(kind, dtype=jnp.float32, seed=1, b=B, t=T, w=W):
  """Gates in (0, 1), as a gated RNN has them."""
  shape = {"full": (b, t, w), "token": (b, t, 1), "time": (w,)}[kind]
  return jax.nn.sigmoid(rand(shape, seed=seed) + 1.0).astype(dtype)


def resets(seed=2, b=B, t=T):
  r = np.random.default_rng(seed).random((b, t)) < 0.15
  r[:, 0] = True  # a reset on the first token (drops h0)
  return jnp.asarray(r)


def f64(x):
  return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def oracle(a, b, h0=None, reverse=False, reset=None):
  """float64 NumPy, one token at a time: (h, final state)."""
  a, b = f64(a), f64(b)
  bsz, t, w = b.shape
  a = np.broadcast_to(a, b.shape)
  h = np.zeros((bsz, w)) if h0 is None else f64(h0)
  out = np.zeros(b.shape)
  keep = np.ones((bsz, t)) if reset is None else 1.0 - np.asarray(reset, np.float64)
  for i in (range(t - 1, -1, -1) if reverse else range(t)):
    h = a[:, i] * h * keep[:, i, None] + b[:, i]
    out[:, i] = h
  return out, h


def call(a, b, interpret=True, block_sizes=SMALL, **kw):
  return linear_scan(a, b, implementation="pallas", interpret=interpret, block_sizes=block_sizes, **kw)


def assert_close(out, want, dtype):
  np.testing.assert_allclose(f64(out), want, **TOL[jnp.dtype(dtype).name])


def assert_grads_close(got, want, dtype=jnp.float32):
  for g, w in zip(got, want):
    assert g.shape == w.shape and g.dtype == w.dtype
    scale = np.abs(f64(w)).max()
    if jnp.dtype(dtype) == jnp.float32:
      np.testing.assert_allclose(f64(g), f64(w), atol=1e-5 * scale)
    else:
      np.testing.assert_allclose(f64(g), f64(w), rtol=2 ** -6, atol=2e-2 * scale)


# --- forward ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", GATES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_forward_matches_oracle_and_reference(kind, dtype):
  a, b, h0 = gate(kind, dtype), rand((B, T, W), dtype), rand((B, W), seed=3)
  h, last = call(a, b, h0=h0, return_final_state=True)
  ref_h, ref_last = linear_scan_reference(a, b, h0=h0, return_final_state=True)
  want, want_last = oracle(a, b, h0)
  assert h.shape == b.shape and h.dtype == dtype and last.shape == (B, W) and last.dtype == jnp.float32
  assert_close(h, want, dtype)
  assert_close(ref_h, want, dtype)
  np.testing.assert_allclose(f64(last), want_last, **TOL["float32"])  # (the final state is never rounded)
  np.testing.assert_allclose(f64(ref_last), want_last, **TOL["float32"])


@pytest.mark.parametrize("kind", GATES)
def test_reverse_and_reset(kind):
  a, b, h0, reset = gate(kind), rand((B, T, W)), rand((B, W), seed=3), resets()
  for reverse, rst in ((True, None), (False, reset), (True, reset)):
    h, last = call(a, b, h0=h0, reverse=reverse, reset=rst, return_final_state=True)
    want, want_last = oracle(a, b, h0, reverse, rst)
    assert_close(h, want, jnp.float32)
    np.testing.assert_allclose(f64(last), want_last, **TOL["float32"])


def test_reset_on_every_token_is_b():
  a, b = gate("full"), rand((B, T, W))
  for reverse in (False, True):
    h = call(a, b, h0=rand((B, W), seed=3), reverse=reverse, reset=jnp.ones((B, T), bool))
    np.testing.assert_array_equal(np.asarray(h), np.asarray(b))


def test_odd_shapes_single_batch():
  # seq 13 (not a multiple of the tile: one oversized chunk, rows past the end masked), width 200
  # (not a multiple of 128: the whole width is one block), batch 1; bf16 b with an f32 gate.
  a, b = gate("full", b=1, t=13, w=200), rand((1, 13, 200), jnp.bfloat16)
  for reverse in (False, True):
    h, last = call(a, b, reverse=reverse, return_final_state=True, block_sizes=None)
    want, want_last = oracle(a, b, reverse=reverse)
    assert_close(h, want, jnp.bfloat16)
    np.testing.assert_allclose(f64(last), want_last, **TOL["float32"])


def test_stale_vmem_past_the_end_never_reaches_the_carry():
  # Interpret mode that fills out-of-bounds reads and never-written VMEM with NaN: the rows past the
  # sequence (and the lanes past the width, for the per-token gate's lane sums) must stay out.
  ip = pltpu.InterpretParams(out_of_bounds_reads="uninitialized", uninitialized_memory="nan")
  for kind, reverse in (("token", True), ("time", False)):
    a, b = gate(kind, w=200), rand((B, T, 200))
    fn = lambda a, b, h0: call(a, b, h0=h0, reverse=reverse, return_final_state=True, interpret=ip)  # noqa: E731
    (h, last), vjp = jax.vjp(fn, a, b, rand((B, 200), seed=3))
    grads = vjp((rand(b.shape, seed=4), rand((B, 200), seed=5)))
    for x in (h, last) + tuple(grads):
      assert np.isfinite(np.asarray(x)).all(), (kind, reverse)
    assert_close(h, oracle(a, b, rand((B, 200), seed=3), reverse)[0], jnp.float32)


def test_long_sequence_in_few_chunks():
  # 4096 tokens at batch 1: the carry crosses 4 chunks of 1024 (64 tiles each); HBM stays O(T x W).
  a, b = gate("full", b=1, t=4096, w=128), rand((1, 4096, 128), scale=0.1)
  h, last = call(a, b, block_sizes=BlockSizes(1024, 128), return_final_state=True)
  want, want_last = oracle(a, b)
  assert_close(h, want, jnp.float32)
  np.testing.assert_allclose(f64(last), want_last, **TOL["float32"])


@pytest.mark.parametrize("kind,dtype,reverse", [("full", jnp.bfloat16, False), ("token", jnp.float32, True),
                                                 ("time", jnp.bfloat16, True)])
def test_wide_width_block_in_several_lane_slices(kind, dtype, reverse):
  # One 2200-wide block: the kernels walk it in lane slices of 16 vector registers per operand
  # (bf16: 1024 + 1024 + 152 lanes; f32: 2048 + 152), each slice's carry kept apart; forward
  # and backward, with resets.
  w = 2200
  a, b, h0, reset = gate(kind, dtype, b=1, w=w), rand((1, T, w), dtype), rand((1, w), seed=3), resets(b=1)
  kw = dict(reverse=reverse, reset=reset)
  h, vjp = jax.vjp(lambda a, b, h0: call(a, b, h0=h0, block_sizes=BlockSizes(16, w), **kw), a, b, h0)
  assert_close(h, oracle(a, b, h0, reverse, reset)[0], dtype)
  dy = rand(b.shape, dtype, seed=4)
  want = jax.vjp(lambda a, b, h0: linear_scan_reference(a, b, h0=h0, **kw), a, b, h0)[1](dy)
  assert_grads_close(vjp(dy), want, dtype)


def test_complex_arrays_and_planes():
  # An LRU: complex time-invariant gate of modulus < 1, complex inputs.
  W2 = 128  # (2 seq chunks, the last partial; one width block)
  rng = np.random.default_rng(7)
  lam = jnp.asarray(0.95 * np.exp(1j * rng.uniform(0, np.pi, W2)), jnp.complex64)
  b = jnp.asarray(rng.standard_normal((1, 24, W2)) + 1j * rng.standard_normal((1, 24, W2)), jnp.complex64)
  h0 = jnp.asarray(rng.standard_normal((1, W2)) + 1j * rng.standard_normal((1, W2)), jnp.complex64)
  h, last = call(lam, b, h0=h0, return_final_state=True, reverse=True)
  ref, ref_last = linear_scan_reference(lam, b, h0=h0, return_final_state=True, reverse=True)
  assert h.dtype == jnp.complex64 and last.dtype == jnp.complex64
  np.testing.assert_allclose(np.asarray(h), np.asarray(ref), atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(np.asarray(last), np.asarray(ref_last), atol=2e-5, rtol=2e-5)
  # the same as (real, imaginary) pairs, per-element gates, with gradients
  a = jnp.broadcast_to(lam, (1, 24, W2))
  planes = lambda z: (jnp.real(z), jnp.imag(z))  # noqa: E731
  hp = call(planes(a), planes(b), h0=planes(h0), reverse=True)
  assert isinstance(hp, tuple) and len(hp) == 2
  np.testing.assert_allclose(np.asarray(hp[0] + 1j * hp[1]), np.asarray(ref), atol=2e-5, rtol=2e-5)
  dy = planes(rand((1, 24, W2), seed=8) + 1j * rand((1, 24, W2), seed=9))
  got = jax.vjp(lambda a, b: call(a, b, reset=resets(b=1, t=24)), planes(a), planes(b))[1](dy)
  want = jax.vjp(lambda a, b: linear_scan_reference(a, b, reset=resets(b=1, t=24)), planes(a), planes(b))[1](dy)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(f64(g), f64(w), atol=1e-5 * np.abs(f64(w)).max())
  # complex64 arrays differentiate as JAX's complex convention has it
  dz = dy[0] + 1j * dy[1]
  got = jax.vjp(lambda a, b: call(a, b), lam, b)[1](dz)
  want = jax.vjp(lambda a, b: linear_scan_reference(a, b), lam, b)[1](dz)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5 * np.abs(np.asarray(w)).max())


@settings(max_examples=4, deadline=None)
@given(b=st.integers(1, 2), t=st.integers(1, 40), w=st.integers(1, 300), kind=st.sampled_from(GATES),
       bf16=st.booleans(), reverse=st.booleans(), with_reset=st.booleans(),
       blocks=st.sampled_from([(16, 128), (32, 256), None]))
def test_hypothesis_shapes(b, t, w, kind, bf16, reverse, with_reset, blocks):
  dtype = jnp.bfloat16 if bf16 else jnp.float32
  a, x = gate(kind, dtype, b=b, t=t, w=w), rand((b, t, w), dtype, seed=t * 1000 + w)
  reset = resets(b=b, t=t) if with_reset else None
  h = call(a, x, reverse=reverse, reset=reset, block_sizes=blocks)
  assert_close(h, oracle(a, x, None, reverse, reset)[0], dtype)


def test_xla_implementation_is_the_reference():
  a, b = gate("token"), rand((B, T, W))
  out = linear_scan(a, b, reset=resets(), implementation="xla", return_final_state=True)
  ref = linear_scan_reference(a, b, reset=resets(), return_final_state=True)
  for x, y in zip(out, ref):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  np.testing.assert_array_equal(np.asarray(linear_scan(a, b)), np.asarray(linear_scan_reference(a, b)))  # None: XLA here


def test_float64_runs_on_the_xla_path():
  with jax.enable_x64(True):
    a, b = jnp.asarray(f64(gate("full"))), jnp.asarray(f64(rand((B, T, W))))
    h, last = linear_scan(a, b, return_final_state=True)
    assert h.dtype == jnp.float64 and last.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(h), oracle(a, b)[0], rtol=1e-12, atol=1e-12)
    with pytest.raises(kernels.NoImplementationError, match="float64"):
      linear_scan(a, b, implementation="pallas", interpret=True)


# --- gradients ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", GATES)
@pytest.mark.parametrize("reverse,with_reset", [(False, False), (True, True)])
def test_gradients_match_reference_vjp(kind, reverse, with_reset):
  a, b, h0 = gate(kind), rand((B, T, W)), rand((B, W), seed=3)
  reset = resets() if with_reset else None
  cts = (rand((B, T, W), seed=4), rand((B, W), seed=5))  # h's and the final state's cotangents

  def vjp(fn):
    return jax.vjp(lambda a, b, h0: fn(a, b, h0=h0, reverse=reverse, reset=reset, return_final_state=True),
                   a, b, h0)[1](cts)
  assert_grads_close(vjp(call), vjp(linear_scan_reference))


def test_bf16_gradients_have_input_dtypes():
  a, b, h0 = gate("full", jnp.bfloat16), rand((B, T, W), jnp.bfloat16), rand((B, W), jnp.bfloat16, seed=3)
  dy = rand((B, T, W), jnp.bfloat16, seed=4)
  got = jax.vjp(lambda a, b, h0: call(a, b, h0=h0), a, b, h0)[1](dy)
  want = jax.vjp(lambda a, b, h0: linear_scan_reference(a, b, h0=h0), a, b, h0)[1](dy)
  assert [g.dtype for g in got] == [jnp.bfloat16] * 3
  assert_grads_close(got, want, jnp.bfloat16)


def test_check_grads_reference_f64():
  with jax.enable_x64(True):
    a = jnp.asarray(f64(gate("full", b=1, t=6, w=3)))
    b, h0 = jnp.asarray(f64(rand((1, 6, 3)))), jnp.asarray(f64(rand((1, 3), seed=3)))
    reset = jnp.asarray([[False, False, True, False, False, False]])
    f = lambda a, b, h0: linear_scan_reference(a, b, h0=h0, reset=reset, return_final_state=True)  # noqa: E731
    jax.test_util.check_grads(f, (a, b, h0), order=1, modes=["fwd", "rev"])


def test_jit_vmap_grad_shard_map_compose():
  a, b = gate("full"), rand((2, B, T, W))
  f = jax.jit(jax.vmap(lambda b: call(a, b)))  # (vmap over a leading axis: the batching rule adds a grid axis)
  want = np.stack([oracle(a, x)[0] for x in b])
  assert_close(f(b), want, jnp.float32)
  g = jax.grad(lambda a: jnp.sum(call(a, b[0]) ** 2))(a)
  w = jax.grad(lambda a: jnp.sum(linear_scan_reference(a, b[0]) ** 2))(a)
  assert_grads_close([g], [w])
  # reset traced under jit (its keep stream enters the custom_vjp as an argument), per-token gates
  at = gate("token")
  g = jax.jit(jax.grad(lambda a, r: jnp.sum(call(a, b[0], reset=r) ** 2)))(at, resets())
  w = jax.grad(lambda a: jnp.sum(linear_scan_reference(a, b[0], reset=resets()) ** 2))(at)
  assert_grads_close([g], [w])
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
  spec = jax.sharding.PartitionSpec("x")
  # (check_vma=False, as for any pallas_call: its outputs carry no varying-axes annotation)
  sm = jax.shard_map(lambda a, b: call(a, b), mesh=mesh, in_specs=(spec, spec), out_specs=spec, check_vma=False)
  assert_close(jax.jit(sm)(a, b[0]), want[0], jnp.float32)


def test_no_races_on_two_cores():
  # As on megacore chips: the parallel batch and width axes shared by two cores, race detection on;
  # 2 batch rows x 2 width blocks x 2 chunks, forward and backward (the time-invariant gate's
  # accumulator and the start states cross the chunks).
  from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
  ip = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)
  a, b, reset = gate("time"), rand((B, 32, W)), resets(t=32)
  got = jax.vjp(lambda a, b: call(a, b, reset=reset, interpret=ip), a, b)[1](rand((B, 32, W), seed=4))
  want = jax.vjp(lambda a, b: linear_scan_reference(a, b, reset=reset), a, b)[1](rand((B, 32, W), seed=4))
  assert_grads_close(got, want)
  assert ipc.races is not None and not ipc.races.races_found


# --- bad input ---------------------------------------------------------------------------


def _bad(argument, error=kernels.KernelError, **overrides):
  kw = dict(a=gate("full"), b=rand((B, T, W)), implementation="pallas", interpret=True, block_sizes=SMALL)
  kw.update(overrides)
  with pytest.raises(error) as info:
    linear_scan(kw.pop("a"), kw.pop("b"), **kw)
  assert info.value.argument == argument, str(info.value)
  assert argument in str(info.value)
  return str(info.value)


def test_bad_input_names_the_argument():
  assert "(2, 24, 1)" in _bad("a", a=rand((B, T, 7)))
  assert "(256,)" in _bad("a", a=rand((W + 1,)))
  assert "[batch, seq, width]" in _bad("b", b=rand((T, W)))
  assert "int32" in _bad("a", a=jnp.ones((B, T, W), jnp.int32))
  assert "int32" in _bad("b", b=jnp.ones((B, T, W), jnp.int32))
  assert "float16" in _bad("b", b=jnp.ones((B, T, W), jnp.float16))
  assert "complex" in _bad("a", a=gate("full").astype(jnp.complex64))
  assert "pair" in _bad("b", a=(gate("full"),) * 2)
  assert "(2, 256)" in _bad("h0", h0=rand((B, W + 1)))
  assert "floating" in _bad("h0", h0=jnp.ones((B, W), jnp.int32))
  assert "boolean" in _bad("reset", reset=jnp.zeros((B, T), jnp.int32))
  assert "(2, 24)" in _bad("reset", reset=jnp.zeros((B, T + 1), bool))
  _bad("reverse", reverse=1)
  _bad("block_sizes", block_sizes=(1, 2, 3))
  _bad("block_sizes", block_sizes=BlockSizes(-8, 128))
  assert "multiple of 8" in _bad("block_sizes", kernels.TilingError, block_sizes=BlockSizes(12, 128))
  assert "multiple of 16" in _bad("block_sizes", kernels.TilingError, b=rand((B, T, W), jnp.bfloat16),
                                  block_sizes=BlockSizes(8, 128))
  assert "divisible" in _bad("block_sizes", kernels.TilingError, block_sizes=BlockSizes(16, 100))
  _bad("implementation", implementation="cuda")


def test_vmem_overflow_is_caught_before_lowering():
  big = jax.ShapeDtypeStruct((1, 65536, 65536), jnp.float32)
  with pytest.raises(kernels.VmemOverflowError) as info:
    jax.eval_shape(lambda a, b: linear_scan(a, b, implementation="pallas", interpret=True,
                                            block_sizes=BlockSizes(8192, 65536)), big, big)
  assert info.value.argument == "block_sizes" and "VMEM" in str(info.value)


# --- block sizes -------------------------------------------------------------------------


def test_default_blocks_fit_every_generation():
  for gen in kernels.TPU_GENERATIONS:
    chip = kernels.get_chip(gen)
    for width in (128, 200, 2048, 8192):
      for dtype in (jnp.bfloat16, jnp.float32):
        d = scan.default_block_sizes(gen, dtype, width)
        f = scan.fit_block_sizes(d, 4096, width, dtype, chip=gen)
        rows = scan._tile_rows([dtype])
        assert f.seq_chunk % rows == 0 and (f.width_block % 128 == 0 or f.width_block == width)
        p = scan._Problem(1, 4096, width, "full", jnp.dtype(dtype), jnp.dtype(dtype), 1, False, True, False)
        for backward in (False, True):
          need = scan._vmem_bytes(f.seq_chunk, f.width_block, p, backward=backward)
          assert kernels.base.tiling.vmem_limit(need, chip) is None or need < chip.vmem_bytes
  assert scan.default_block_sizes(None) == scan.default_block_sizes("v5e")


# --- ahead-of-time compilation for TPU ---------------------------------------------------

_AOT_PROGRAMS = """
import sys, jax, jax.numpy as jnp, kernels
from kernels import linear_scan
gen, bf16, f32, sds = sys.argv[1], jnp.bfloat16, jnp.float32, jax.ShapeDtypeStruct

def fwd_bwd(**kw):  # forward (with the final state) and the backward of a, b and h0, as one program
  def f(a, b, h0, dy, dlast):
    out, vjp = jax.vjp(lambda a, b, h0: linear_scan(a, b, h0=h0, return_final_state=True, **kw), a, b, h0)
    return out, vjp((dy, dlast))
  return f

# Each gate kind (reverse, reset), an odd width, a ragged sequence, at the default blocks, in one program.
bsz, t, w = 2, 300, 200
reset = jnp.zeros((bsz, t), bool)
cases = ((sds((bsz, t, w), bf16), dict(reverse=True)), (sds((bsz, t, 1), bf16), dict(reset=reset)),
         (sds((w,), f32), dict(reset=reset, reverse=True)))
tail = (sds((bsz, t, w), bf16), sds((bsz, w), f32), sds((bsz, t, w), bf16), sds((bsz, w), f32))
programs = lambda *args: [fwd_bwd(**kw)(*args[5 * i:5 * i + 5]) for i, (_, kw) in enumerate(cases)]
comp = kernels.compile_for_tpu(programs, *[x for a, _ in cases for x in (a,) + tail], generation=gen)
assert comp.hlo.count("tpu_custom_call") == 6, comp.hlo  # forward and backward of each, all Pallas
# The benchmark shape, [8, 4096, 2048] bf16, at the default blocks.
big, row = sds((8, 4096, 2048), bf16), sds((8, 2048), f32)
comp = kernels.compile_for_tpu(fwd_bwd(), big, big, row, big, row, generation=gen)
assert comp.hlo.count("tpu_custom_call") == 2 and comp.vmem_bytes < kernels.get_chip(gen).vmem_bytes
print("ok")
"""


@pytest.mark.tpu_aot
@pytest.mark.parametrize("generation", kernels.TPU_GENERATIONS)
def test_aot_compiles_forward_and_backward(generation):
  # In a fresh process without the cost model's flags: with them, libtpu's static profile of the
  # benchmark shape (hundreds of grid steps) made its compile 50 s instead of 2 on v5e.
  import os
  env = dict(os.environ, KERNELS_STATIC_PROFILE="0")
  proc = run_program(_AOT_PROGRAMS, generation, env=env)
  assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]
