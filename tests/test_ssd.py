"""kernels.scan.chunked: the chunked SSD kernel against the sequential recurrence (the oracle) and the plain-JAX chunked SSD.

Everything but the ``tpu_aot`` tests runs the kernel in interpret mode on the CPU, on small shapes with
chunks of 128 tokens, so grids cross several chunks (the state is carried in VMEM), several head blocks and
a partial last chunk.

Tolerances (|out - expected| <= ATOL + RTOL * |expected|, with ATOL relative to the output's largest entry):

* float32: the chunked form sums the same terms in another order than the recurrence, and exponentiates
  differences of cumulative sums: 1e-5 of the largest entry (observed ~1e-6).
* bfloat16: the MXU operands are bf16 (the masked intra-chunk matrix, the state for ``C h``, the weighted
  ``x`` for the state update), each rounded to 2^-9: 2e-2 of the largest entry.
* gradients, against the reference's VJP, per cotangent, relative to its largest entry: float32 1e-4 (each
  entry sums up to seq x state terms; observed <= 2e-5, dA the largest); bfloat16 2e-2 (the backward's MXU
  operands are bf16, as the forward's, and the saved chunk states are bf16; observed <= 1e-2). Both backwards
  are tested: the Pallas reverse pass (``backward="pallas"``, kernels/_ssd_bwd.py) and the VJP of the plain-JAX
  chunked SSD (``backward="xla"``).
"""

import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels
from tests import run_program
from kernels.scan.chunked import BlockSizes, gated_linear_attention, gated_linear_attention_reference, ssd, ssd_chunked_xla, \
    ssd_reference

from kernels.scan import chunked as S
TOL = {"float32": 1e-5, "bfloat16": 2e-2}


def rand(shape, seed=0, dtype=jnp.float32, scale=1.0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * scale, dtype)


def inputs(b=1, t=300, h=4, p=64, g=1, n=32, dtype=jnp.float32, D=True, h0=True, reset=False, seed=0):
  """x, dt, A, B, C and the keyword arguments (D, h0, reset) of a Mamba-2-like problem."""
  x = rand((b, t, h, p), seed, dtype)
  dt = jax.nn.softplus(rand((b, t, h), seed + 1) - 1.0)
  A = -jnp.exp(rand((h,), seed + 2, scale=0.5))
  B, C = rand((b, t, g, n), seed + 3, dtype, 0.5), rand((b, t, g, n), seed + 4, dtype, 0.5)
  kw = dict(D=rand((h,), seed + 5) if D else None, h0=rand((b, h, p, n), seed + 6, scale=0.3) if h0 else None,
            reset=resets(b, t, seed + 7) if reset else None)
  return (x, dt, A, B, C), kw


def resets(b, t, seed=7):
  r = np.random.default_rng(seed).random((b, t)) < 0.03
  r[:, 0] = True  # (drops h0)
  r[:, min(t - 1, 130)] = True  # (a reset in the second chunk)
  return jnp.asarray(r)


def f64(v):
  return np.asarray(jnp.asarray(v, jnp.float32), np.float64)


def call(*args, interpret=True, block_sizes=(128, 2), **kw):
  return ssd(*args, implementation="pallas", interpret=interpret, block_sizes=block_sizes, **kw)


def assert_close(got, want, dtype=jnp.float32, tol=None):
  want = f64(want)
  np.testing.assert_allclose(f64(got), want, rtol=0, atol=(tol or TOL[jnp.dtype(dtype).name]) * np.abs(want).max())


# --- forward ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_forward_matches_reference(dtype):
  # 300 tokens: chunks of 128, 128 and a partial 44; 4 heads of 64 in blocks of 2
  args, kw = inputs(dtype=dtype)
  y, h = call(*args, return_final_state=True, **kw)
  ref_y, ref_h = ssd_reference(*args, return_final_state=True, **kw)
  assert y.shape == args[0].shape and y.dtype == dtype and h.shape == (1, 4, 64, 32) and h.dtype == jnp.float32
  assert_close(y, ref_y, dtype)
  assert_close(h, ref_h, dtype)
  # the plain-JAX chunked SSD agrees too
  cy, ch = ssd_chunked_xla(*args, chunk_size=128, return_final_state=True, **kw)
  assert_close(cy, ref_y, dtype)
  assert_close(ch, ref_h, dtype)


def test_reference_matches_float64_oracle():
  # The f32 reference and the f32 kernel against the same recurrence in float64.
  args, kw = inputs(t=200)
  y = call(*args, **kw)
  with jax.enable_x64(True):
    a64 = [jnp.asarray(f64(v)) for v in args]
    kw64 = dict(kw, D=jnp.asarray(f64(kw["D"])), h0=jnp.asarray(f64(kw["h0"])))
    want = ssd_reference(*a64, **kw64)
    assert want.dtype == jnp.float64
    chunked = ssd(*a64, **kw64)  # float64: the XLA path (the chunked SSD)
    assert chunked.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(chunked), np.asarray(want), rtol=0, atol=1e-12 * np.abs(want).max())
    with pytest.raises(kernels.NoImplementationError, match="float64"):
      ssd(*a64, implementation="pallas", interpret=True)
  assert_close(y, want)
  assert_close(ssd_reference(*args, **kw), want)


@pytest.mark.parametrize("g,hb", [(2, 4), (4, 4), (2, 2)])
def test_resets_and_groups(g, hb):
  # groups of 4, 2 or 1 heads: a head block inside one group (B/C block chosen by the index map) or
  # spanning several (each head reads its own group's rows)
  args, kw = inputs(b=2, t=260, h=4, g=g, reset=True)
  y, h = call(*args, block_sizes=(128, hb), return_final_state=True, **kw)
  ref_y, ref_h = ssd_reference(*args, return_final_state=True, **kw)
  assert_close(y, ref_y)
  assert_close(h, ref_h)


def test_reset_on_every_token_forgets_the_past():
  args, kw = inputs(t=140, D=False)
  x, dt, A, B, C = args
  y = call(*args, h0=kw["h0"], reset=jnp.ones((1, 140), bool))
  # each token alone: y_t = dt_t (C_t . B_t) x_t
  want = dt[..., None] * jnp.sum(C * B, axis=-1)[:, :, :, None] * x
  assert_close(y, want)


def test_odd_shapes_single_batch():
  # seq 13 (one chunk, rounded up to the row tile), head_dim 48 and state 40 (not multiples of 128), three
  # heads in three groups (the block spans the groups), batch 1; and bf16 with seq 13 and head_dim 64
  args, kw = inputs(t=13, h=3, p=48, g=3, n=40, reset=True)
  y, h = call(*args, block_sizes=None, return_final_state=True, **kw)
  ref_y, ref_h = ssd_reference(*args, return_final_state=True, **kw)
  assert_close(y, ref_y)
  assert_close(h, ref_h)
  args, kw = inputs(t=13, h=2, n=16, dtype=jnp.bfloat16, h0=False)
  assert_close(call(*args, block_sizes=None, **kw), ssd_reference(*args, **kw), jnp.bfloat16)


def test_head_dim_multiple_of_128_and_long_decay():
  # head_dim 128, one head per step; strong decay (dt * A down to about -30 per token) stays finite:
  # the decays are differences of cumulative sums
  args, kw = inputs(t=256, h=2, p=128, n=16)
  x, dt, A, B, C = args
  dt = dt * 10.0
  y = call(x, dt, A * 3.0, B, C, block_sizes=(128, 1), **kw)
  assert np.isfinite(np.asarray(y)).all()
  assert_close(y, ssd_reference(x, dt, A * 3.0, B, C, **kw))


@settings(max_examples=2, deadline=None)
@given(b=st.integers(1, 2), t=st.integers(1, 200), h=st.sampled_from([2, 4]), p=st.sampled_from([32, 64]),
       g=st.sampled_from([1, 2]), n=st.sampled_from([8, 24]), bf16=st.booleans(), reset=st.booleans())
def test_hypothesis_shapes(b, t, h, p, g, n, bf16, reset):
  dtype = jnp.bfloat16 if bf16 else jnp.float32
  args, kw = inputs(b, t, h, p, g, n, dtype, reset=reset, seed=t)
  assert_close(call(*args, block_sizes=(128, None), **kw), ssd_reference(*args, **kw), dtype)


def test_gated_linear_attention_is_the_ssd_kernel():
  b, t, h, dk, dv = 1, 150, 2, 32, 64
  q, k, v = rand((b, t, h, dk), 1, scale=0.5), rand((b, t, h, dk), 2, scale=0.5), rand((b, t, h, dv), 3)
  g = -jax.nn.softplus(rand((b, t, h), 4))  # log-decay <= 0
  h0 = rand((b, h, dv, dk), 5)
  kw = dict(h0=h0, reset=resets(b, t), return_final_state=True)
  o, s = gated_linear_attention(q, k, v, g, implementation="pallas", interpret=True, block_sizes=(128, 2), **kw)
  ref_o, ref_s = gated_linear_attention_reference(q, k, v, g, **kw)
  assert_close(o, ref_o)
  assert_close(s, ref_s)
  # the same thing by hand: one token's update S = exp(g) S + v k^T, o = S q
  s1 = jnp.exp(g[0, 0, 0]) * 0 + jnp.outer(v[0, 0, 0], k[0, 0, 0])  # (reset on token 0 drops h0)
  np.testing.assert_allclose(np.asarray(ref_o[0, 0, 0]), np.asarray(s1 @ q[0, 0, 0]), rtol=1e-5, atol=1e-5)


def test_xla_implementation_and_default_path():
  args, kw = inputs(t=140)
  got = ssd(*args, implementation="xla", **kw)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(ssd_chunked_xla(*args, chunk_size=128, **kw)))
  np.testing.assert_array_equal(np.asarray(ssd(*args, **kw)), np.asarray(got))  # None on CPU: XLA


# --- gradients ---------------------------------------------------------------------------


def _vjp(fn, args, kw, cts):
  x, dt, A, B, C = args

  def f(x, dt, A, B, C, D, h0):
    return fn(x, dt, A, B, C, **dict(kw, D=D, h0=h0), return_final_state=True)
  return jax.vjp(f, x, dt, A, B, C, kw["D"], kw["h0"])[1](cts)


GRAD_TOL = {"float32": 1e-4, "bfloat16": 2e-2}


def _check_grads_against_reference(args, kw, backward, block_sizes=(128, 2), dtype=jnp.float32):
  b, _, h, p = args[0].shape
  cts = (rand(args[0].shape, 11, dtype), rand((b, h, p, args[3].shape[-1]), 12))
  got = _vjp(lambda *a, **k: call(*a, block_sizes=block_sizes, backward=backward, **k), args, kw, cts)
  want = _vjp(ssd_reference, args, kw, cts)
  for name, gv, wv in zip(("x", "dt", "A", "B", "C", "D", "h0"), got, want):
    assert gv.shape == wv.shape and gv.dtype == wv.dtype, name
    assert np.abs(f64(wv)).max() > 0 or name == "h0", name  # (h0's is 0 when token 0 resets)
    assert_close(gv, wv, tol=GRAD_TOL[jnp.dtype(dtype).name])


@pytest.mark.parametrize("backward", ["pallas", "xla"])
def test_gradients_match_reference_vjp(backward):
  # resets (one on token 0: h0's gradient is 0) and two groups of two heads, one head block per group
  args, kw = inputs(t=140, g=2, reset=True)
  _check_grads_against_reference(args, kw, backward)


@pytest.mark.parametrize("t,g,hb,reset", [(300, 1, 2, False), (260, 4, 4, True), (200, 2, 1, False)])
def test_pallas_backward_shapes(t, g, hb, reset):
  # a ragged last chunk with h0 and D (300 = 128 + 128 + 44); a head block spanning four groups; blocks of
  # one head, two per group (dB, dC summed over the blocks of a group)
  args, kw = inputs(b=2 if reset else 1, t=t, g=g, reset=reset)
  _check_grads_against_reference(args, kw, "pallas", block_sizes=(128, hb))


def test_pallas_backward_without_d_h0_or_final_state():
  args, kw = inputs(t=150, D=False, h0=False)
  loss = lambda fn: lambda x, dt, A, B, C: jnp.sum(jnp.sin(fn(x, dt, A, B, C)))  # noqa: E731
  got = jax.grad(loss(lambda *a: call(*a, backward="pallas")), argnums=range(5))(*args)
  want = jax.grad(loss(ssd_reference), argnums=range(5))(*args)
  for gv, wv in zip(got, want):
    assert_close(gv, wv, tol=1e-4)


@pytest.mark.parametrize("backward", ["pallas", "xla"])
def test_bf16_gradients_have_input_dtypes(backward):
  args, kw = inputs(t=140, dtype=jnp.bfloat16)
  cts = (rand(args[0].shape, 11, jnp.bfloat16), rand((1, 4, 64, 32), 12))
  got = _vjp(lambda *a, **k: call(*a, backward=backward, **k), args, kw, cts)
  assert [v.dtype for v in got] == [jnp.bfloat16, jnp.float32, jnp.float32, jnp.bfloat16, jnp.bfloat16,
                                    jnp.float32, jnp.float32]
  want = _vjp(ssd_reference, args, kw, cts)
  for gv, wv in zip(got, want):
    assert_close(gv, wv, tol=GRAD_TOL["bfloat16"])


def test_gated_linear_attention_gradients():
  b, t, h, dk, dv = 1, 150, 2, 32, 64
  q, k, v = rand((b, t, h, dk), 1, scale=0.5), rand((b, t, h, dk), 2, scale=0.5), rand((b, t, h, dv), 3)
  g = -jax.nn.softplus(rand((b, t, h), 4))
  kw = dict(h0=rand((b, h, dv, dk), 5), reset=resets(b, t))
  loss = lambda fn: lambda *a: jnp.sum(jnp.cos(fn(*a, **kw)))  # noqa: E731
  pallas = lambda *a, **k: gated_linear_attention(*a, implementation="pallas", interpret=True,  # noqa: E731
                                                  block_sizes=(128, 2), backward="pallas", **k)
  got = jax.grad(loss(pallas), argnums=range(4))(q, k, v, g)
  want = jax.grad(loss(gated_linear_attention_reference), argnums=range(4))(q, k, v, g)
  for gv, wv in zip(got, want):
    assert_close(gv, wv, tol=1e-4)


def test_check_grads_float64():
  # the reference and the chunked SSD (the backward's algorithm), numerically, in float64
  with jax.enable_x64(True):
    args, kw = inputs(t=6, h=2, p=2, g=1, n=2, reset=True)
    a64 = [jnp.asarray(f64(v)) for v in args]
    D, h0 = jnp.asarray(f64(kw["D"])), jnp.asarray(f64(kw["h0"]))
    for fn, modes in ((ssd_reference, ["rev"]), (lambda *a, **k: ssd_chunked_xla(*a, chunk_size=4, **k), ["rev"])):
      f = lambda x, dt, A, B, C, D, h0: fn(x, dt, A, B, C, D=D, h0=h0, reset=kw["reset"],  # noqa: E731
                                           return_final_state=True)
      jax.test_util.check_grads(f, (*a64, D, h0), order=1, modes=modes)


def test_jit_grad_vmap_compose():
  args, kw = inputs(t=140, reset=True)
  loss = lambda fn: lambda x, dt, r: jnp.sum(fn(x, dt, *args[2:], reset=r, D=kw["D"]) ** 2)  # noqa: E731
  got = jax.jit(jax.grad(loss(call), argnums=(0, 1)))(args[0], args[1], kw["reset"])
  want = jax.grad(loss(ssd_reference), argnums=(0, 1))(args[0], args[1], kw["reset"])
  for gv, wv in zip(got, want):
    assert_close(gv, wv, tol=1e-4)
  xs = jnp.stack([args[0], args[0] * 0.5])
  out = jax.vmap(lambda x: call(x, *args[1:]))(xs)
  assert_close(out[1], ssd_reference(args[0] * 0.5, *args[1:]))


# --- bad input ---------------------------------------------------------------------------


def _bad(argument, error=kernels.KernelError, fn=ssd, **overrides):
  args, kw = inputs(t=140)
  names = ("x", "dt", "A", "B", "C")
  pos = dict(zip(names, args))
  for k_ in list(overrides):
    if k_ in pos:
      pos[k_] = overrides.pop(k_)
  kw.update(implementation="pallas", interpret=True)
  kw.update(overrides)
  with pytest.raises(error) as info:
    fn(*[pos[n] for n in names], **kw)
  assert info.value.argument == argument, str(info.value)
  assert argument in str(info.value)
  return str(info.value)


def test_bad_input_names_the_argument():
  assert "[batch, seq, heads, head_dim]" in _bad("x", x=rand((140, 4, 64)))
  assert "(1, 140, 4)" in _bad("dt", dt=rand((1, 140, 3)))
  assert "(4,)" in _bad("A", A=rand((5,)))
  assert "divide" in _bad("B", B=rand((1, 140, 3, 32)), C=rand((1, 140, 3, 32)))
  assert "shape" in _bad("C", C=rand((1, 140, 1, 16)))
  assert "floating" in _bad("x", x=jnp.ones((1, 140, 4, 64), jnp.int32))
  assert "floating" in _bad("dt", dt=jnp.ones((1, 140, 4), jnp.int32))
  assert "dtype" in _bad("B", B=rand((1, 140, 1, 32), dtype=jnp.bfloat16))
  assert "boolean" in _bad("reset", reset=jnp.zeros((1, 140), jnp.int32))
  assert "(1, 140)" in _bad("reset", reset=jnp.zeros((1, 141), bool))
  assert "(1, 4, 64, 32)" in _bad("h0", h0=rand((1, 4, 32, 64)))
  assert "(4,)" in _bad("D", D=rand((1, 4)))
  _bad("return_final_state", return_final_state=1)
  assert "multiple of 128" in _bad("chunk_size", kernels.TilingError, chunk_size=100)
  _bad("chunk_size", chunk_size=0)
  assert "heads_per_step" in _bad("block_sizes", kernels.TilingError, block_sizes=BlockSizes(128, 3))
  # 4 heads in 2 groups: a block of 4 heads spans both groups (fine), one of 3 would not divide 4
  assert "divide" in _bad("block_sizes", kernels.TilingError, block_sizes=BlockSizes(128, 3), B=rand((1, 140, 2, 32)),
                          C=rand((1, 140, 2, 32)))
  _bad("implementation", implementation="cuda")
  _bad("backward", backward="triton")
  q = rand((1, 20, 2, 8))
  with pytest.raises(kernels.KernelError) as info:
    gated_linear_attention(q, q, rand((1, 20, 3, 8)), rand((1, 20, 2)))
  assert info.value.argument == "v"


def test_default_blocks_fit_every_generation():
  for gen in kernels.TPU_GENERATIONS:
    d = S.default_block_sizes(gen)
    assert d.chunk_size == (256 if gen == "v6e" else 128) or S.tiling.block_table("ssd").get(gen)
    p = S._Problem(1, 8192, 32, 64, 1, 128, jnp.dtype(jnp.bfloat16), True, True)
    with kernels.base.backend.target(gen):
      plan = S._plan(p, BlockSizes())
    need = S._vmem_bytes(p, plan.L, plan.hb, save_states=True)
    assert need < kernels.get_chip(gen).vmem_bytes and 32 % plan.hb == 0
    # the backward takes the forward's heads per step, or fewer where its step would not fit (v4)
    hb = S._ssd_bwd.heads_per_step(p, plan.L, plan.hb, kernels.get_chip(gen))
    assert plan.hb % hb == 0 and S._ssd_bwd.vmem_bytes(p, plan.L, hb) * 1.25 < kernels.get_chip(gen).vmem_bytes
    assert hb == (16 if gen == "v4" else plan.hb)


# --- ahead-of-time compilation for TPU ---------------------------------------------------

_AOT_PROGRAMS = """
import sys, jax, jax.numpy as jnp, kernels
from kernels import ssd, gated_linear_attention
gen, bf16, f32, sds = sys.argv[1], jnp.bfloat16, jnp.float32, jax.ShapeDtypeStruct

def fwd_bwd(fn, **kw):  # forward (with the final state) and the backward, as one program
  def f(x, dt, A, B, C, dy, dh):
    out, vjp = jax.vjp(lambda *a: fn(*a, return_final_state=True, **kw), x, dt, A, B, C)
    return out, vjp((dy, dh))
  return f

# odd shapes (ragged seq, head_dim 48, state 40, groups spanning the head block) with resets and D, at the
# default blocks; and gated linear attention
b, t, h, p, g, n = 2, 300, 6, 48, 3, 40
args = (sds((b, t, h, p), bf16), sds((b, t, h), f32), sds((h,), f32), sds((b, t, g, n), bf16),
        sds((b, t, g, n), bf16), sds((b, t, h, p), bf16), sds((b, h, p, n), f32))
for backward, calls in (("pallas", 2), ("xla", 1)):  # the backward kernel, or the chunked XLA algorithm's VJP
  comp = kernels.compile_for_tpu(fwd_bwd(ssd, D=jnp.ones((h,)), reset=jnp.zeros((b, t), bool), backward=backward),
                                 *args, generation=gen, profile=False)
  assert comp.hlo.count("tpu_custom_call") == calls, comp.hlo
gla = lambda q, k, v, ld, **kw: gated_linear_attention(q, k, v, ld, **kw)
comp = kernels.compile_for_tpu(gla, sds((1, 384, 4, 64), bf16), sds((1, 384, 4, 64), bf16),
                               sds((1, 384, 4, 64), bf16), sds((1, 384, 4), f32), generation=gen, profile=False)
assert comp.hlo.count("tpu_custom_call") == 1
# the benchmark shape: seq 8192, 32 heads x 64, state 128, one group, bf16, forward and backward
b, t, h, p, g, n = 1, 8192, 32, 64, 1, 128
args = (sds((b, t, h, p), bf16), sds((b, t, h), f32), sds((h,), f32), sds((b, t, g, n), bf16),
        sds((b, t, g, n), bf16), sds((b, t, h, p), bf16), sds((b, h, p, n), f32))
for backward, calls in (("pallas", 2), ("xla", 1)):
  comp = kernels.compile_for_tpu(fwd_bwd(ssd, D=jnp.ones((h,)), backward=backward), *args, generation=gen,
                                 profile=False)
  assert comp.hlo.count("tpu_custom_call") == calls and comp.vmem_bytes < kernels.get_chip(gen).vmem_bytes
print("ok")
"""


@pytest.mark.tpu_aot
@pytest.mark.parametrize("generation", kernels.TPU_GENERATIONS)
def test_aot_compiles_forward_and_backward(generation):
  # in a fresh process without the cost model's flags (as tests/test_scan.py does)
  import os
  env = dict(os.environ, KERNELS_STATIC_PROFILE="0")
  proc = run_program(_AOT_PROGRAMS, generation, env=env)
  assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.tpu_aot
def test_128k_tokens_forward_memory_is_linear():
  # batch 1, 131072 tokens, 32 heads x 64, state 128, bf16: the compiled forward's HBM (arguments, output,
  # temporaries) stays a small multiple of seq x heads x head_dim
  b, t, h, p, n = 1, 131072, 32, 64, 128
  sds = jax.ShapeDtypeStruct
  args = (sds((b, t, h, p), jnp.bfloat16), sds((b, t, h), jnp.float32), sds((h,), jnp.float32),
          sds((b, t, 1, n), jnp.bfloat16), sds((b, t, 1, n), jnp.bfloat16))
  comp = kernels.compile_for_tpu(lambda *a: ssd(*a, return_final_state=True), *args, generation="v5e",
                                 profile=False)
  total = comp.memory["argument"] + comp.memory["output"] + comp.memory["temp"]
  assert comp.hlo.count("tpu_custom_call") == 1
  assert total < 4 * t * h * p * 2, comp.memory  # x and y are 2 x seq x width bf16 each
