"""kernels.scan.parallel: the dense LTI scan against its lax.scan reference and a float64 oracle.

Everything but the ``tpu_aot`` tests runs the kernels in interpret mode on the CPU, on small
shapes (interpret mode runs each strided load of the sequential loop as a gather: a few seconds
per case), with several segments, so the carries cross segments, and segments of several
chunks where the shapes allow.

Tolerances (states are O(1); A is 0.9 times an orthogonal matrix, so errors are not amplified):

* float32: full-precision products in a different association than the sequential reference
  (the carries go through powers of A): 1e-5 of the largest output, and 1e-5 relative.
* bfloat16 (all operands): the state is rounded to bf16 as an operand of every step, in kernel
  and reference alike, but the two may round a value on a boundary differently and the
  segments' carries are exact f32: 3e-2 of the largest output (a few bf16 ulps).
* gradients: f32, 2e-5 of the largest entry (observed ~1e-6); bf16, 5e-2 of the largest entry.
"""
import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import functools

import kernels
from tests import run_program
from kernels import parallel_scan, parallel_scan_reference

from kernels.scan import parallel as ps


def model(b, t, d, n, o, dtype=jnp.float32, seed=0):
  """x, A, B, C, h0: A is 0.9 x a random orthogonal matrix (a stable, non-normal-free recurrence)."""
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((b, t, d)), dtype)
  A = jnp.asarray(0.9 * np.linalg.qr(rng.standard_normal((n, n)))[0], dtype)
  B = jnp.asarray(rng.standard_normal((d, n)) / np.sqrt(d), dtype)
  C = jnp.asarray(rng.standard_normal((n, o)) / np.sqrt(n), dtype)
  h0 = jnp.asarray(rng.standard_normal((b, n)), jnp.float32)
  return x, A, B, C, h0


def f64(v):
  return np.asarray(jnp.asarray(v, jnp.float32), np.float64)


def oracle(x, A, B, C, h0=None):
  """float64 NumPy, one token at a time."""
  x, A, B, C = f64(x), f64(A), f64(B), f64(C)
  h = np.zeros((x.shape[0], A.shape[0])) if h0 is None else f64(h0)
  y = np.zeros(x.shape[:2] + (C.shape[1],))
  for t in range(x.shape[1]):
    h = h @ A + x[:, t] @ B
    y[:, t] = h @ C
  return y


@functools.cache
def _jitted(options):
  kw = dict(options)
  return jax.jit(lambda x, A, B, C, h0: parallel_scan(x, A, B, C, h0=h0, implementation="pallas", interpret=True,
                                                      **kw))


def call(x, A, B, C, h0=None, **kw):
  """The kernels in interpret mode, under one jit per set of options (eager interpret mode runs op by
  op; a jit reused across calls traces each shape once)."""
  return _jitted(tuple(sorted(kw.items())))(x, A, B, C, h0)


def assert_close(got, want, dtype=jnp.float32):
  got, want = f64(got), f64(want)
  scale = np.abs(want).max()
  if jnp.dtype(dtype) == jnp.float32:
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * scale)
  else:
    np.testing.assert_allclose(got, want, rtol=0, atol=3e-2 * scale)


def assert_grads_close(got, want, dtype=jnp.float32):
  for g, w in zip(got, want):
    assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, w.shape, g.dtype, w.dtype)
    tol = 2e-5 if jnp.dtype(dtype) == jnp.float32 else 5e-2
    np.testing.assert_allclose(f64(g), f64(w), atol=tol * np.abs(f64(w)).max())


# --- forward ---------------------------------------------------------------------------


@pytest.mark.parametrize("segments", [1, 4])
def test_forward_matches_oracle_and_reference(segments):
  x, A, B, C, h0 = model(2, 64, 8, 16, 8)
  y = call(x, A, B, C, h0=h0, num_segments=segments)
  want = oracle(x, A, B, C, h0)
  assert y.shape == (2, 64, 8) and y.dtype == jnp.float32
  assert_close(y, want)
  assert_close(parallel_scan_reference(x, A, B, C, h0=h0), want)


def test_odd_shapes_single_batch_unbatched():
  # seq 37 (padded to segments of 16), d_in 13, n 130 (two lane slabs, the second mostly padding),
  # d_out 5; batch 1, and the same as an unbatched [seq, d_in] x.
  x, A, B, C, h0 = model(1, 37, 13, 130, 5, seed=2)
  y = call(x[0], A, B, C, h0=h0[0], num_segments=2)
  assert y.shape == (37, 5)
  assert_close(y, oracle(x, A, B, C, h0)[0])


def test_long_segments_of_several_chunks(monkeypatch):
  # 2 segments of 1280 tokens at batch 1, cut into 2 chunks of 640 (Lb = 2 rows; a block of whole
  # segments is switched off): the state crosses chunks in VMEM and segments through the carries.
  monkeypatch.setattr(ps, "WHOLE_SEGMENT_ROWS", 0)
  x, A, B, C, h0 = model(1, 2560, 4, 8, 4, seed=3)
  plan = ps._plan(ps._validate(x, A, B, C, h0, 2, True), 2, True)
  assert plan.grid == (1, 2) and plan.s == 1280
  assert_close(call(x, A, B, C, h0=h0, num_segments=2), oracle(x, A, B, C, h0))


@settings(max_examples=3, deadline=None)
@given(b=st.integers(1, 3), t=st.integers(1, 70), d=st.integers(1, 20), n=st.integers(1, 40),
       o=st.integers(1, 12), segments=st.sampled_from([None, 1, 2, 5]))
def test_hypothesis_shapes(b, t, d, n, o, segments):
  x, A, B, C, h0 = model(b, t, d, n, o, seed=t)
  assert_close(call(x, A, B, C, h0=h0, num_segments=segments), oracle(x, A, B, C, h0))


def test_xla_path_and_float64():
  x, A, B, C, h0 = model(2, 20, 4, 8, 4)
  np.testing.assert_array_equal(parallel_scan(x, A, B, C, h0=h0, implementation="xla"),
                                parallel_scan_reference(x, A, B, C, h0=h0))
  with jax.enable_x64(True):
    args = [jnp.asarray(f64(v)) for v in (x, A, B, C, h0)]
    y = parallel_scan(*args[:4], h0=args[4])  # implementation=None: the kernels refuse float64, XLA serves
    assert y.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(y), oracle(x, A, B, C, h0), rtol=1e-12, atol=1e-12)
    with pytest.raises(kernels.NoImplementationError):
      parallel_scan(*args[:4], implementation="pallas", interpret=True)


# --- backward ----------------------------------------------------------------------------


@pytest.mark.parametrize("segments,checkpoint,chunked", [(1, True, True), (3, False, False)])  # (3, True): bf16
def test_gradients_match_reference_vjp(segments, checkpoint, chunked, monkeypatch):
  if chunked:  # segments cut into chunks of 16 tokens: the reverse carry and the checkpoints cross chunks
    monkeypatch.setattr(ps, "WHOLE_SEGMENT_ROWS", 0)
    monkeypatch.setattr(ps, "MAX_BLOCK_ROWS", 32)
  x, A, B, C, h0 = model(2, 40, 8, 20, 6, seed=4)
  dy = jnp.asarray(np.random.default_rng(5).standard_normal((2, 40, 6)), jnp.float32)
  fn = lambda x, A, B, C, h0: call(x, A, B, C, h0=h0, num_segments=segments, checkpoint=checkpoint)  # noqa: E731
  got = jax.vjp(fn, x, A, B, C, h0)[1](dy)
  want = jax.vjp(lambda x, A, B, C, h0: parallel_scan_reference(x, A, B, C, h0=h0), x, A, B, C, h0)[1](dy)
  assert_grads_close(got, want)


def test_bf16_forward_and_gradients():
  x, A, B, C, h0 = model(2, 48, 16, 32, 16, jnp.bfloat16, seed=1)
  dy = jnp.asarray(np.random.default_rng(7).standard_normal((2, 48, 16)), jnp.bfloat16)

  def forward_and_vjp(x, A, B, C, h0, dy):  # (one jit: the forward traced once)
    y, vjp = jax.vjp(lambda *b: parallel_scan(*b[:4], h0=b[4], num_segments=3, implementation="pallas",
                                              interpret=True), x, A, B, C, h0)
    return y, vjp(dy)
  y, got = jax.jit(forward_and_vjp)(x, A, B, C, h0, dy)
  ref, want = jax.vjp(lambda *a: parallel_scan_reference(*a[:4], h0=a[4]), x, A, B, C, h0)
  want = want(dy)
  assert y.dtype == jnp.bfloat16
  assert_close(y, ref, jnp.bfloat16)
  assert_close(y, oracle(x, A, B, C, h0), jnp.bfloat16)
  assert [g.dtype for g in got] == [jnp.bfloat16] * 4 + [jnp.float32]
  assert_grads_close(got, want, jnp.bfloat16)


def test_check_grads():
  # The reference in float64 (numerical against automatic derivatives), and the kernels' VJP
  # in f32 against numerical derivatives of the kernels themselves (reverse mode only: custom_vjp).
  x, A, B, C, h0 = model(1, 6, 3, 4, 2, seed=8)
  with jax.enable_x64(True):
    args = tuple(jnp.asarray(f64(v)) for v in (x, A, B, C, h0))
    jax.test_util.check_grads(lambda *a: parallel_scan_reference(*a[:4], h0=a[4]), args, order=1,
                              modes=["fwd", "rev"])
  fn = lambda *a: call(*a[:4], h0=a[4], num_segments=2)  # noqa: E731
  jax.test_util.check_grads(fn, (x, A, B, C, h0), order=1, modes=["rev"], atol=2e-2, rtol=2e-2, eps=1e-2)


def test_jit_vmap_compose():
  x, A, B, C, h0 = model(2, 24, 4, 8, 4, seed=9)
  f = jax.jit(jax.vmap(lambda x: call(x, A, B, C, num_segments=2)))  # vmap over batch of unbatched x
  assert_close(f(x), oracle(x, A, B, C))
  g = jax.jit(jax.grad(lambda A: jnp.sum(call(x, A, B, C, num_segments=2) ** 2)))(A)
  w = jax.grad(lambda A: jnp.sum(parallel_scan_reference(x, A, B, C) ** 2))(A)
  assert_grads_close([g], [w])


# --- bad input, planning -----------------------------------------------------------------


def _bad(argument, **overrides):
  x, A, B, C, _ = model(2, 24, 8, 16, 4)
  kw = dict(x=x, A=A, B=B, C=C, implementation="pallas", interpret=True)
  kw.update(overrides)
  with pytest.raises(kernels.KernelError) as info:
    parallel_scan(kw.pop("x"), kw.pop("A"), kw.pop("B"), kw.pop("C"), **kw)
  assert info.value.argument == argument, str(info.value)
  assert argument in str(info.value)
  return str(info.value)


def test_bad_input_names_the_argument():
  assert "int32" in _bad("x", x=jnp.ones((2, 24, 8), jnp.int32))
  assert "floating" in _bad("A", A=jnp.ones((16, 16), jnp.int32))
  assert "float16" in _bad("C", C=jnp.ones((16, 4), jnp.float16))
  assert "[batch, seq, d_in]" in _bad("x", x=jnp.ones((2, 3, 24, 8)))
  assert "square" in _bad("A", A=jnp.ones((16, 8)))
  assert "(8, 16)" in _bad("B", B=jnp.ones((9, 16)))
  assert "(16, d_out)" in _bad("C", C=jnp.ones((15, 4)))
  assert "(2, 16)" in _bad("h0", h0=jnp.ones((1, 16)))
  assert "floating" in _bad("h0", h0=jnp.ones((2, 16), jnp.int32))
  _bad("num_segments", num_segments=0)
  _bad("num_segments", num_segments=2.0)
  _bad("checkpoint", checkpoint=None)
  _bad("implementation", implementation="cuda")


def test_default_segments_and_plans_fit_every_generation():
  assert ps.default_num_segments(1, 131072) == ps.TARGET_ROWS
  assert ps.default_num_segments(ps.TARGET_ROWS, 131072) == 1
  assert ps.default_num_segments(3, 131072) == 128  # 3 x 128 >= 256
  assert ps.default_num_segments(1, 100) == 1  # (segments of at least MIN_SEGMENT tokens)
  for gen in kernels.TPU_GENERATIONS:
    chip = kernels.get_chip(gen)
    for b, t, d, n in ((1, 131072, 256, 256), (8, 4096, 512, 512), (1, 37, 13, 130), (512, 2048, 64, 64)):
      x, A, B, C = (jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((b, t, d), (n, n), (d, n), (n, d)))
      p = ps._validate(x, A, B, C, None, None, True)
      with kernels.base.backend.target(gen):
        plan = ps._plan(p, None, True)
      assert plan.rows % plan.lb == 0 and plan.s % plan.tj == 0 and plan.tj % 16 == 0
      assert plan.segments * plan.s >= t and plan.n % 128 == 0
      assert 1.25 * ps._vmem_bytes(p, plan.lb, plan.tj, plan.n, True) + (1 << 20) <= chip.vmem_bytes


# --- ahead-of-time compilation for TPU ---------------------------------------------------

_AOT_PROGRAMS = """
import sys, jax, jax.numpy as jnp, kernels
gen, sds = sys.argv[1], jax.ShapeDtypeStruct

def fwd_bwd(**kw):  # the forward and the backward of x, A, B, C and h0, as one program
  def f(x, A, B, C, h0, dy):
    y, vjp = jax.vjp(lambda x, A, B, C, h0: kernels.parallel_scan(x, A, B, C, h0=h0, **kw), x, A, B, C, h0)
    return y, vjp(dy)
  return f

def args(b, t, d, n, o, dt):
  return (sds((b, t, d), dt), sds((n, n), dt), sds((d, n), dt), sds((n, o), dt), sds((b, n), jnp.float32),
          sds((b, t, o), dt))

# Odd shapes (seq, d_in, n, d_out not multiples of 8 or 128, batch 1 and 3), f32 and bf16, both
# checkpoint modes, one segment and several; then the benchmark shape at its defaults.
for shape, kw, calls in (((3, 50, 200, 130, 70, jnp.float32), {}, 2),
                         ((1, 300, 13, 64, 5, jnp.bfloat16), dict(checkpoint=False), 4),
                         ((1, 8192, 256, 256, 256, jnp.bfloat16), {}, 4)):
  comp = kernels.compile_for_tpu(fwd_bwd(**kw), *args(*shape), generation=gen, profile=False)
  assert comp.hlo.count("tpu_custom_call") == calls, (shape, comp.hlo.count("tpu_custom_call"))
  assert comp.vmem_bytes < kernels.get_chip(gen).vmem_bytes
print("ok")
"""


def _run(program, *argv):
  # In a fresh process without the cost model's flags (a static profile makes big compiles slow).
  import os
  env = dict(os.environ, KERNELS_STATIC_PROFILE="0")
  proc = run_program(program, *argv, env=env)
  assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]
  return proc.stdout


@pytest.mark.tpu_aot
@pytest.mark.parametrize("generation", kernels.TPU_GENERATIONS)
def test_aot_compiles_forward_and_backward(generation):
  _run(_AOT_PROGRAMS, generation)


_LONG = """
import jax, jax.numpy as jnp, kernels
sds, T, W = jax.ShapeDtypeStruct, 131072, 256

def f(x, A, B, C, h0, dy):
  y, vjp = jax.vjp(lambda x, A, B, C, h0: kernels.parallel_scan(x, A, B, C, h0=h0), x, A, B, C, h0)
  return y, vjp(dy)

seq = sds((1, T, W), jnp.bfloat16)
comp = kernels.compile_for_tpu(f, seq, *[sds((W, W), jnp.bfloat16)] * 3, sds((1, W), jnp.float32), seq,
                               generation="v5e", profile=False)
x_bytes = T * W * 2
m = comp.memory
# arguments x and dy, outputs y and dx (and the small gradients); the temporaries (the states
# saved at chunk boundaries, the carries) a fraction of one [seq, width] array.
assert m["argument"] < 2.1 * x_bytes and m["output"] < 2.1 * x_bytes and m["temp"] < 0.25 * x_bytes, m
print("ok", m)
"""


@pytest.mark.tpu_aot
def test_128k_tokens_at_batch_1_hold_o_seq_width_in_hbm():
  _run(_LONG)
