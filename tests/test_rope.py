"""kernels.attention.rotary: the rotation against its reference and a float64 NumPy oracle, the table cache, gradients.

Everything but the ``tpu_aot`` tests runs the kernel in interpret mode on the CPU, on small
shapes with small blocks (several seq blocks, the last partial).

Tolerances (|out - expected| <= ATOL + RTOL * |expected|; inputs are O(1)):

* float32: kernel and reference compute the same two products in float32 in the same order;
  against the float64 oracle, the float32 table and products: 2e-6 absolute.
* bfloat16: one rounding of the float32 result (2^-8 relative); kernel and reference may
  round a value on a boundary differently: one ulp, 2^-7 relative, and 1e-2 absolute.
"""

import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels
from kernels.attention import rotary as R
from kernels.attention.rotary import BlockSizes, RopeScaling, rope, rope_reference, rope_table

TOL = {"float32": dict(atol=2e-6, rtol=2e-6), "bfloat16": dict(atol=1e-2, rtol=2 ** -7)}


def rand(shape, dtype=jnp.float32, seed=0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32), dtype)


def oracle(x, positions, *, theta=10000.0, rotary_dim=None, interleaved=False, inv_freq=None):
  """float64 NumPy, pair by pair, straight from the definition."""
  x = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
  b, s, _, d = x.shape
  r = rotary_dim or d
  pos = np.broadcast_to(np.arange(s), (b, s)) if positions is None else np.asarray(positions)
  inv = theta ** (-np.arange(0, r, 2) / r) if inv_freq is None else inv_freq
  ang = pos[..., None].astype(np.float64) * inv  # [b, s, r/2]
  c, sn = np.cos(ang)[:, :, None], np.sin(ang)[:, :, None]
  out = x.copy()
  i1, i2 = (slice(0, r, 2), slice(1, r, 2)) if interleaved else (slice(0, r // 2), slice(r // 2, r))
  a, bb = x[..., i1], x[..., i2]
  out[..., i1], out[..., i2] = a * c - bb * sn, bb * c + a * sn
  return out


def close(got, want, dtype):
  np.testing.assert_allclose(np.asarray(jnp.asarray(got, jnp.float32)), np.asarray(want, np.float32),
                             **TOL[jnp.dtype(dtype).name])


def run(x, positions=None, **kw):
  return rope(x, positions, implementation="pallas", interpret=True, **kw)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [None, 32])
@pytest.mark.parametrize("with_positions", [False, True])
def test_matches_oracle_and_reference(interleaved, rotary_dim, with_positions):
  x = rand((2, 40, 3, 64))  # 3 seq blocks of 16, the last partial
  pos = jnp.asarray(np.random.default_rng(1).integers(0, 300, (2, 40))) if with_positions else None
  kw = dict(rotary_dim=rotary_dim, interleaved=interleaved, max_position=300 if with_positions else None)
  got = run(x, pos, block_sizes=BlockSizes(16), **kw)
  close(got, oracle(x, pos, rotary_dim=rotary_dim, interleaved=interleaved), jnp.float32)
  # the same float32 products (XLA may fuse them into an FMA: an ulp apart)
  np.testing.assert_allclose(np.asarray(got), np.asarray(rope_reference(x, pos, **kw)), atol=1e-6, rtol=1e-6)


@settings(max_examples=6, deadline=None)
@given(b=st.integers(1, 2), s=st.integers(1, 37), h=st.integers(1, 5), d=st.sampled_from([8, 64, 128, 256]),
       frac=st.sampled_from([1.0, 0.5, 0.25]), interleaved=st.booleans(), bf16=st.booleans(), seed=st.integers(0, 99))
def test_hypothesis_shapes(b, s, h, d, frac, interleaved, bf16, seed):
  r = max(2, int(d * frac) // 2 * 2)
  dtype = jnp.bfloat16 if bf16 else jnp.float32
  x = rand((b, s, h, d), dtype, seed)
  got = run(x, rotary_dim=r, interleaved=interleaved, block_sizes=BlockSizes(8 if s > 8 else s))
  assert got.dtype == dtype and got.shape == x.shape
  close(got, rope_reference(x, rotary_dim=r, interleaved=interleaved), dtype)
  close(got, oracle(x, None, rotary_dim=r, interleaved=interleaved), dtype)


def test_default_blocks_and_bf16():
  x = rand((1, 300, 4, 128), jnp.bfloat16, seed=3)
  close(run(x), oracle(x, None), jnp.bfloat16)


def test_large_positions_keep_their_angle():
  """The table is built in float64: at position ~2^16 the float32 product pos * inv_freq errs by up to ~2e-3 rad."""
  pos = jnp.asarray([[65_521, 70_000 - 1, 5, 0]])
  x = rand((1, 4, 1, 128), seed=4)
  got = run(x, pos, max_position=70_000)
  close(got, oracle(x, pos), jnp.float32)
  inv = 10000.0 ** (-np.arange(0, 128, 2, dtype=np.float32) / np.float32(128))
  p = np.asarray(pos[0, :2])[:, None]
  f32_error = np.abs(p.astype(np.float32) * inv - p * inv.astype(np.float64)).max()
  assert f32_error > 1e-4  # the float32 product's rounding: such a table would fail the tolerance above


@pytest.mark.parametrize("implementation", ["pallas", "xla"])
def test_decode_positions_past_the_sequence_turn_by_their_own_angle(implementation):
  """Issue 55: one decode step at position 1000, and 37 tokens at 5 .. 41, gave NaN (the table had seq rows)."""
  kw = dict(implementation=implementation, interpret=True if implementation == "pallas" else None)
  x = rand((1, 1, 2, 128), seed=5)
  pos = jnp.asarray([[1000]])
  got = rope(x, pos, **kw)
  assert np.isfinite(np.asarray(got)).all()
  close(got, oracle(x, pos), jnp.float32)
  x37 = rand((1, 37, 2, 128), seed=6)
  pos37 = jnp.arange(37)[None] + 5
  close(rope(x37, pos37, **kw), oracle(x37, pos37), jnp.float32)
  close(rope_reference(x37, pos37), oracle(x37, pos37), jnp.float32)
  # under jit, where the positions cannot be read
  close(jax.jit(lambda x, p: rope(x, p, **kw))(x37, pos37), oracle(x37, pos37), jnp.float32)


@pytest.mark.parametrize("implementation", ["pallas", "xla"])
def test_negative_and_extreme_positions_never_borrow_another_angle(implementation):
  """Issue 55: position -1 with max_position=16 rotated as position 15. Now a negative position turns
  backwards by its own angle, and every int32 keeps its float64 angle within a few ulp."""
  kw = dict(implementation=implementation, interpret=True if implementation == "pallas" else None)
  x = rand((1, 8, 1, 128), seed=7)
  pos = jnp.asarray([[0, 1, 2, -1, -1000, 2**31 - 1, -(2**31), 123_456_789]], jnp.int32)
  got = rope(x, pos, **kw)
  close(got, oracle(x, pos), jnp.float32)
  as15 = rope(x, jnp.full((1, 8), 15), **kw)
  assert not np.allclose(np.asarray(got[0, 3]), np.asarray(as15[0, 3]))
  # a position and its negative: the same cos, the opposite sin, so rotating back recovers x
  back = rope(rope(x, pos, **kw), -pos, **kw)
  np.testing.assert_allclose(np.asarray(back[0, :5]), np.asarray(x[0, :5]), atol=1e-5)


def test_positions_outside_max_position_are_a_kernel_error_when_concrete():
  x = rand((1, 4, 2, 64))
  for bad in ([[0, 1, 2, 16]], [[0, 1, 2, -1]]):
    with pytest.raises(kernels.KernelError, match=r"positions.*\[0, max_position=16\)"):
      rope(x, jnp.asarray(bad), max_position=16)
    with pytest.raises(kernels.KernelError, match="positions"):
      rope_reference(x, jnp.asarray(bad), max_position=16)
  # traced: not checkable, and still the position's own angle, never NaN
  pos = jnp.asarray([[0, 1, 2, 16]])
  got = jax.jit(lambda x, p: rope(x, p, max_position=16, implementation="pallas", interpret=True))(x, pos)
  close(got, oracle(x, pos), jnp.float32)
  with pytest.raises(kernels.KernelError, match="int32"):
    rope(x, np.asarray([[0, 1, 2, 2**40]], np.int64))


def test_scaling_linear_and_llama3():
  d, theta = 128, 500000.0
  inv = theta ** (-np.arange(0, d, 2) / d)
  x, pos = rand((1, 16, 2, d), seed=5), jnp.asarray(np.arange(0, 16 * 997, 997)[None])
  close(run(x, pos, theta=theta, scaling=4.0, max_position=16 * 997),
        oracle(x, pos, inv_freq=inv / 4.0), jnp.float32)
  # Llama 3.1's rule, written out independently (Meta's reference, in NumPy):
  sc = RopeScaling("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192)
  wl = 2 * np.pi / inv
  want = []
  for f, w in zip(inv, wl):
    if w < 8192 / 4.0:
      want.append(f)
    elif w > 8192 / 1.0:
      want.append(f / 8.0)
    else:
      t = (8192 / w - 1.0) / (4.0 - 1.0)
      want.append((1 - t) * f / 8.0 + t * f)
  close(run(x, pos, theta=theta, scaling=sc, max_position=16 * 997), oracle(x, pos, inv_freq=np.array(want)),
        jnp.float32)


def test_table_is_cached_and_in_the_kernels_layout():
  a = rope_table(128, 64, rotary_dim=32, theta=10000.0)
  assert rope_table(128, 64, rotary_dim=32, theta=10000.0) is a  # built once per key
  cos, sin = a
  assert cos.shape == sin.shape == (128, 64) and cos.dtype == np.float32
  np.testing.assert_array_equal(cos[:, 32:], 1.0)  # pass-through features
  np.testing.assert_array_equal(sin[:, 32:], 0.0)
  inv = 10000.0 ** (-np.arange(0, 32, 2) / 32)
  np.testing.assert_allclose(sin[:, :16], -np.sin(np.arange(128)[:, None] * inv), atol=1e-7)
  np.testing.assert_allclose(sin[:, 16:32], np.sin(np.arange(128)[:, None] * inv), atol=1e-7)


def test_rotary_embedding_config_and_composed_rows():
  """RotaryEmbedding (the config flash_attention fuses) runs rope with its options and shares its table;
  compose_rows (the fused kernel's angle addition) gives the table's rows of a shifted block."""
  cfg = kernels.RotaryEmbedding(rotary_dim=32, interleaved=True, scaling=2.0)
  x = rand((1, 40, 2, 64), seed=3)
  np.testing.assert_array_equal(np.asarray(cfg(x, implementation="xla")),
                                np.asarray(rope(x, rotary_dim=32, interleaved=True, scaling=2.0, implementation="xla")))
  np.testing.assert_array_equal(np.asarray(cfg.reference(x)),
                                np.asarray(rope_reference(x, rotary_dim=32, interleaved=True, scaling=2.0)))
  assert cfg.table(100, 64)[0] is rope_table(100, 64, rotary_dim=32, interleaved=True, scaling=RopeScaling("linear", 2.0))[0]
  cos, sin = cfg.table(5000, 64)
  base = np.stack([cos[4096], sin[4096]])
  c2, s2 = R.compose_rows(base, np.stack([cos[:128], sin[:128]]))
  np.testing.assert_allclose(np.asarray(c2), cos[4096:4224], atol=2e-6, rtol=0)
  np.testing.assert_allclose(np.asarray(s2), sin[4096:4224], atol=2e-6, rtol=0)
  with pytest.raises(kernels.KernelError, match="rotary_dim"):
    kernels.RotaryEmbedding(rotary_dim=3).resolved(64)
  with pytest.raises(kernels.KernelError, match="max_position"):
    kernels.RotaryEmbedding(max_position=0).resolved(64)



@pytest.mark.parametrize("interleaved", [False, True])
def test_gradients(interleaved):
  x = rand((1, 24, 2, 64), seed=6)
  pos = jnp.asarray(np.random.default_rng(7).integers(0, 50, (1, 24)))
  kw = dict(interleaved=interleaved, rotary_dim=48, max_position=50, block_sizes=BlockSizes(8))
  f = lambda x: run(x, pos, **kw)
  # linear in x, so large finite-difference steps are exact up to float32 rounding
  jax.test_util.check_grads(f, (x,), order=1, modes=("rev",), eps=0.5, atol=1e-3, rtol=1e-3)
  dy = rand(x.shape, seed=8)
  got = jax.vjp(f, x)[1](dy)[0]
  want = jax.vjp(lambda x: rope_reference(x, pos, interleaved=interleaved, rotary_dim=48, max_position=50), x)[1](dy)[0]
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=2e-6)


def test_composes_with_jit_and_vmap():
  x = rand((3, 2, 16, 2, 64), seed=9)
  f = jax.jit(jax.vmap(lambda x: run(x, block_sizes=BlockSizes(8))))
  np.testing.assert_allclose(np.asarray(f(x)), np.asarray(jax.vmap(rope_reference)(x)), atol=2e-6)


def test_default_implementation_on_cpu_is_xla_and_agrees():
  x = rand((2, 20, 2, 64), seed=10)
  np.testing.assert_allclose(np.asarray(rope(x)), np.asarray(run(x)), atol=2e-6)


@pytest.mark.parametrize("call, argument", [
    (lambda: rope(jnp.zeros((2, 8, 64))), "x"),
    (lambda: rope(jnp.zeros((1, 8, 2, 64), jnp.int32)), "x"),
    (lambda: rope(jnp.zeros((1, 8, 2, 63))), "x"),
    (lambda: rope(jnp.zeros((1, 8, 2, 64)), rotary_dim=65), "rotary_dim"),
    (lambda: rope(jnp.zeros((1, 8, 2, 64)), rotary_dim=30 + 1), "rotary_dim"),
    (lambda: rope(jnp.zeros((1, 8, 2, 64)), jnp.zeros((1, 7), jnp.int32)), "positions"),
    (lambda: rope(jnp.zeros((1, 8, 2, 64)), jnp.zeros((1, 8))), "positions"),
    (lambda: rope(jnp.zeros((1, 8, 2, 64)), max_position=4), "max_position"),
    (lambda: rope(jnp.zeros((1, 8, 2, 64)), theta=0.5), "theta"),
    (lambda: rope(jnp.zeros((1, 8, 2, 64)), scaling="yarn"), "scaling"),
    (lambda: rope(jnp.zeros((1, 8, 2, 64)), scaling=RopeScaling("llama3", 8.0, 4.0, 1.0)), "scaling"),
    (lambda: run(jnp.zeros((1, 32, 2, 64)), block_sizes=BlockSizes(12)), "block_sizes"),
])
def test_bad_input_names_the_argument(call, argument):
  with pytest.raises(kernels.KernelError) as info:
    call()
  assert info.value.argument == argument


BENCH = (8, 4096, 32, 128)  # the notebook's benchmark shape


def _sds(shape, dtype=jnp.bfloat16):
  return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.tpu_aot
@pytest.mark.parametrize("generation", kernels.TPU_GENERATIONS)
def test_aot_compiles_forward_and_backward(generation):
  def fwdbwd(x, dy):
    y, vjp = jax.vjp(lambda x: rope(x, implementation="pallas"), x)
    return y, vjp(dy)[0]
  comp = kernels.compile_for_tpu(fwdbwd, _sds(BENCH), _sds(BENCH), generation=generation, profile=False)
  assert comp.hlo.count("tpu_custom_call") == 2  # the rotation and its transpose


@pytest.mark.tpu_aot
@pytest.mark.parametrize("generation", kernels.TPU_GENERATIONS)
def test_aot_compiles_variants(generation):
  """Positions gathered by XLA, interleaved pairs, partial rotary, head_dim 64 and 256, f32."""
  def f(x64, x256, pos):
    return (rope(x64, pos, interleaved=True, rotary_dim=32, max_position=8192, implementation="pallas"),
            rope(x256, implementation="pallas"))
  comp = kernels.compile_for_tpu(f, _sds((2, 1024, 8, 64)), _sds((2, 1024, 4, 256), jnp.float32),
                                 _sds((2, 1024), jnp.int32), generation=generation, profile=False)
  assert comp.hlo.count("tpu_custom_call") == 2


@pytest.mark.tpu_aot
def test_default_dispatch_on_tpu_runs_xla_for_lane_sparse_heads():
  """head_dim 64 pads to 128 lanes in the layout a Pallas call reads: the default runs XLA there."""
  sparse = kernels.compile_for_tpu(lambda x: rope(x), _sds((2, 256, 8, 64)), generation="v5e", profile=False)
  dense = kernels.compile_for_tpu(lambda x: rope(x), _sds((2, 256, 8, 128)), generation="v5e", profile=False)
  assert "tpu_custom_call" not in sparse.hlo and "tpu_custom_call" in dense.hlo


def test_interleaved_must_be_a_bool():
  """Found by tools/fuzz.py: a non-bool `interleaved` ran (as truthy) instead of raising."""
  x = rand((1, 4, 1, 8))
  for bad in ("yes", 1, None):
    with pytest.raises(kernels.KernelError, match="interleaved") as e:
      rope(x, interleaved=bad)
    assert e.value.argument == "interleaved"
    with pytest.raises(kernels.KernelError, match="interleaved"):
      rope_reference(x, interleaved=bad)
