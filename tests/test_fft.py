"""kernels.fourier.transforms: every transform against float64 NumPy, in interpret mode on the CPU.

Error measure: max |out - numpy| / max |numpy| over the whole output (the DFT mixes every
input into every output, so an elementwise relative error is meaningless near zeros).
Bounds, per precision (observed in these tests, at N <= 4096: highest ~6e-7, high ~1e-5,
bfloat16 ~5e-3):

* ``"highest"``: 3e-6; ``"high"`` (bf16x3): 3e-5; ``"bfloat16"`` (one pass): 1.5e-2.

Interpret mode runs the real kernel (both the one-stage and the two-stage code) but slowly,
so shapes stay small: the two-stage paths are exercised at N = 1024 (S = 8), 2048 and 1152 (S = 9).
"""

import jax
import jax.numpy as jnp
import jax.extend
import jax.test_util
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels
from tests import EXTRA_AOT_GENERATIONS, run_program

from kernels.fourier import transforms as kfft
from kernels.fourier import long_conv

BOUND = {"highest": 3e-6, "high": 3e-5, "bfloat16": 1.5e-2}
PALLAS = dict(implementation="pallas", interpret=True)


def crand(shape, seed=0):
  rng = np.random.default_rng(seed)
  return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(np.complex64)


def rel(out, ref):
  out, ref = np.asarray(out, np.complex128), np.asarray(ref, np.complex128)
  return np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30)


@pytest.mark.parametrize("n", [8, 12, 128, 500, 1024])
@pytest.mark.parametrize("precision", kfft.PRECISIONS)
def test_fft_and_ifft_match_numpy(n, precision):
  x = crand((3, n), seed=n)
  y = kfft.fft(jnp.asarray(x), precision=precision, **PALLAS)
  assert y.dtype == jnp.complex64 and y.shape == x.shape
  assert rel(y, np.fft.fft(x.astype(np.complex128))) < BOUND[precision]
  z = kfft.ifft(jnp.asarray(x), precision=precision, **PALLAS)
  assert rel(z, np.fft.ifft(x.astype(np.complex128))) < BOUND[precision]


@pytest.mark.parametrize("norm", [None, "backward", "ortho", "forward"])
def test_norms_and_round_trip(norm):
  x = crand((2, 1024), seed=3)
  ref = np.fft.fft(x.astype(np.complex128), norm=norm)
  y = kfft.fft(jnp.asarray(x), norm=norm, **PALLAS)
  assert rel(y, ref) < BOUND["highest"]
  back = kfft.ifft(y, norm=norm, **PALLAS)
  assert rel(back, x) < BOUND["highest"]


def test_planes_are_native_and_match_complex():
  x = crand((4, 1152), seed=5)  # S = 9: a length with a factor 3
  xr, xi = jnp.asarray(x.real), jnp.asarray(x.imag)
  yr, yi = kfft.fft((xr, xi), **PALLAS)
  assert yr.dtype == jnp.float32 and yi.shape == x.shape
  ref = np.fft.fft(x.astype(np.complex128))
  assert rel(np.asarray(yr) + 1j * np.asarray(yi), ref) < BOUND["highest"]
  y = kfft.fft(jnp.asarray(x), **PALLAS)
  np.testing.assert_allclose(np.asarray(y), np.asarray(yr) + 1j * np.asarray(yi), rtol=0, atol=0)


def test_stage_one_loop_above_s_128():
  # S = 136 > LOOP_ABOVE: stage 1 runs as a fori_loop over the rows in place (one row per block is
  # not allowed: 3 rows are one block of the whole batch).
  x = crand((3, 128 * 136), seed=12)
  assert 128 * 136 <= kfft.block_max("v5e") and 136 > kfft.LOOP_ABOVE
  y = kfft.fft(jnp.asarray(x), precision="high", **PALLAS)
  assert rel(y, np.fft.fft(x.astype(np.complex128))) < BOUND["high"]


def test_vpu_first_stage_fft_matches_numpy():
  # the radix-4/2 FFT across arrays that stage 1 runs on the VPU, on NumPy arrays, at every power of two used
  rng = np.random.default_rng(0)
  for s in (1, 2, 4, 8, 32, 128, 512):
    x = rng.standard_normal((s, 3)) + 1j * rng.standard_normal((s, 3))
    for inverse in (False, True):
      yr, yi = kfft._vpu_fft(list(x.real), list(x.imag), inverse)
      ref = np.fft.ifft(x, axis=0) * s if inverse else np.fft.fft(x, axis=0)
      assert np.abs(np.array(yr) + 1j * np.array(yi) - ref).max() < 1e-12 * s


def test_vpu_128_point_dft_down_the_sublanes():
  # stage 2 of the 128-row route: 16 points across vregs, the twiddle, a swap, 8 points (NumPy arrays here)
  x = crand((128, 128), seed=1).astype(np.complex128)
  for inverse in (False, True):
    tw = kfft._matrices(4096, inverse, 1.0, "highest", "vpu_lanes")[1]
    yr, yi = kfft._vpu_dft128(x.real, x.imag, tw, inverse)
    ref = np.fft.ifft(x, axis=0) * 128 if inverse else np.fft.fft(x, axis=0)
    assert np.abs(np.asarray(yr) + 1j * np.asarray(yi) - ref).max() < 1e-5


@pytest.mark.parametrize("n, batch, path", [(1024, 130, "vpu_lanes"), (2048, 5, "vpu"), (1152, 4, "mxu")])
def test_two_stage_paths(n, batch, path):
  # the three two-stage paths: 128-row blocks transposed on whole tiles (a ragged last block here),
  # 16-row blocks (a strided store and a per-row transpose), and S = 9 (stage 1 as DFT matmuls)
  assert kfft.plan(batch, n, "v5e")[0] == path
  x = crand((batch, n), seed=n)
  for f, ref in ((kfft.fft, np.fft.fft), (kfft.ifft, np.fft.ifft)):
    assert rel(f(jnp.asarray(x), precision="high", **PALLAS), ref(x.astype(np.complex128))) < BOUND["high"]


def test_axis_n_padding_truncation_and_batch_shapes():
  x = crand((3, 20, 2), seed=7)
  for n, axis in ((32, 1), (16, 1), (None, 0), (5, -1)):
    y = kfft.fft(jnp.asarray(x), n=n, axis=axis, **PALLAS)
    assert rel(y, np.fft.fft(x.astype(np.complex128), n=n, axis=axis)) < BOUND["highest"]


def test_real_input_is_promoted_for_fft():
  x = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
  assert rel(kfft.fft(jnp.asarray(x), **PALLAS), np.fft.fft(x.astype(np.float64))) < BOUND["highest"]


@settings(max_examples=6, deadline=None)
@given(n=st.sampled_from([1, 2, 3, 7, 16, 30, 64, 100, 243, 256, 343, 512]), batch=st.integers(1, 9),
       lead=st.integers(0, 2), inverse=st.booleans(), precision=st.sampled_from(kfft.PRECISIONS))
def test_hypothesis_lengths_and_batches(n, batch, lead, inverse, precision):
  shape = (batch,) + (2,) * lead + (n,)
  x = crand(shape, seed=n + batch)
  f, ref = (kfft.ifft, np.fft.ifft) if inverse else (kfft.fft, np.fft.fft)
  assert rel(f(jnp.asarray(x), precision=precision, **PALLAS), ref(x.astype(np.complex128))) < BOUND[precision]


@pytest.mark.parametrize("n", [16, 15, 1024])
def test_rfft_irfft(n):
  x = np.random.default_rng(n).standard_normal((2, n)).astype(np.float32)
  y = kfft.rfft(jnp.asarray(x), **PALLAS)
  ref = np.fft.rfft(x.astype(np.float64))
  assert y.shape == ref.shape and rel(y, ref) < BOUND["highest"]
  back = kfft.irfft(y, n=n, **PALLAS)
  assert back.dtype == jnp.float32 and rel(back, x) < BOUND["highest"]
  h = crand((2, 9), seed=1)  # an arbitrary (not Hermitian-consistent) half spectrum, odd and even n
  for m in (16, 17, None):
    assert rel(kfft.irfft(jnp.asarray(h), n=m, **PALLAS), np.fft.irfft(h.astype(np.complex128), n=m)) < 1e-5


def test_2d_transforms():
  x = crand((2, 12, 16), seed=11)
  c = x.astype(np.complex128)
  assert rel(kfft.fft2(jnp.asarray(x), **PALLAS), np.fft.fft2(c)) < BOUND["highest"]
  assert rel(kfft.ifft2(jnp.asarray(x), s=(8, 20), **PALLAS), np.fft.ifft2(c, s=(8, 20))) < BOUND["highest"]
  assert rel(kfft.fft2(jnp.asarray(x), axes=(0, 2), norm="ortho", **PALLAS),
             np.fft.fft2(c, axes=(0, 2), norm="ortho")) < BOUND["highest"]
  r = x.real
  y = kfft.rfft2(jnp.asarray(r), **PALLAS)
  assert rel(y, np.fft.rfft2(r.astype(np.float64))) < BOUND["highest"]
  assert rel(kfft.irfft2(y, s=r.shape[-2:], **PALLAS), r) < BOUND["highest"]


def test_long_length_four_step_matches_numpy():
  # Above one block the transform is two kernel calls with XLA transposes and the twiddle between
  # them; the logic is the same at any split, so check it on a small one (1024 x 3).
  x = crand((2, 1024 * 3), seed=2)
  yr, yi = kfft._long_rows(jnp.asarray(x.real), jnp.asarray(x.imag), inverse=False, scale=1.0,
                           precision="highest", interpret=True, split=(1024, 3))
  assert rel(np.asarray(yr) + 1j * np.asarray(yi), np.fft.fft(x.astype(np.complex128))) < BOUND["highest"]
  assert kfft._long_split(2 ** 20) == (1024, 1024) and kfft._long_split(2 ** 17) is not None


@pytest.mark.parametrize("n", [1000, 600])
def test_lengths_above_512_not_multiples_of_128_take_two_calls(n):
  # supported_length says yes (a product of two one-stage lengths): the kernel must split them
  # rather than reshape them into 128 lanes
  x = crand((2, n), seed=n)
  assert kfft.supported_length(n)
  y = kfft.fft(jnp.asarray(x), **PALLAS)
  assert rel(y, np.fft.fft(x.astype(np.complex128))) < BOUND["highest"]
  dy = crand((2, n), seed=n + 1)
  g = jax.vjp(lambda v: kfft.fft(v, **PALLAS), jnp.asarray(x))[1](jnp.asarray(dy))[0]
  g_ref = jax.vjp(jnp.fft.fft, jnp.asarray(x))[1](jnp.asarray(dy))[0]
  assert rel(g, g_ref) < BOUND["highest"]


def test_gradients():
  kw = dict(norm="ortho", **PALLAS)
  small = jnp.asarray(crand((2, 24), seed=4))
  jax.test_util.check_grads(lambda v: kfft.fft(v, **kw), (small,), order=1, modes=("rev",), atol=2e-2, rtol=2e-2)
  x = jnp.asarray(crand((2, 1024), seed=4))
  # VJPs against jnp.fft's (the conjugate transform), complex arrays and planes
  for f, g in ((kfft.fft, jnp.fft.fft), (kfft.ifft, jnp.fft.ifft)):
    ct = jnp.asarray(crand((2, 1024), seed=6))
    ours = jax.vjp(lambda v: f(v, **PALLAS), x)[1](ct)[0]
    ref = jax.vjp(lambda v: g(v), x)[1](ct)[0]
    assert rel(ours, ref) < BOUND["highest"]
  xr, xi = jnp.real(x), jnp.imag(x)
  loss = lambda a, b: jnp.sum(jnp.abs(lax_complex(*kfft.fft((a, b), **PALLAS))) ** 2)  # noqa: E731
  ref_loss = lambda a, b: jnp.sum(jnp.abs(jnp.fft.fft(lax_complex(a, b))) ** 2)  # noqa: E731
  for ours, ref in zip(jax.grad(loss, (0, 1))(xr, xi), jax.grad(ref_loss, (0, 1))(xr, xi)):
    assert rel(ours, ref) < 1e-5
  r = jnp.real(x)
  ours = jax.grad(lambda v: jnp.sum(jnp.abs(kfft.rfft(v, **PALLAS)) ** 2))(r)
  ref = jax.grad(lambda v: jnp.sum(jnp.abs(jnp.fft.rfft(v)) ** 2))(r)
  assert rel(ours, ref) < 1e-5
  h = jnp.asarray(crand((2, 9), seed=8))
  ct = jnp.asarray(np.random.default_rng(0).standard_normal((2, 16)).astype(np.float32))
  ours = jax.vjp(lambda v: kfft.irfft(v, n=16, **PALLAS), h)[1](ct)[0]
  ref = jax.vjp(lambda v: jnp.fft.irfft(v, n=16), h)[1](ct)[0]
  assert rel(ours, ref) < 1e-5


def lax_complex(a, b):
  return jax.lax.complex(a, b)


def test_xla_fallback_for_unsupported_lengths():
  x = jnp.asarray(crand((2, 1031), seed=9))  # a prime above 512
  assert not kfft.supported_length(1031)
  y = kfft.fft(x, interpret=None)  # implementation=None on CPU: XLA
  assert rel(y, np.fft.fft(np.asarray(x, np.complex128))) < 1e-5
  with pytest.raises(kernels.KernelError, match="Pallas FFT takes lengths"):
    kfft.fft(x, **PALLAS)
  with pytest.raises(NotImplementedError):
    kfft.fft(x, **PALLAS)
  y = kfft.fft(x, implementation="xla")
  assert rel(y, np.fft.fft(np.asarray(x, np.complex128))) < 1e-5


def test_supported_lengths():
  for n in [8, 16, 1024, 4096, 16384, 65536, 2 ** 17, 2 ** 20, 3 * 128, 5 * 7 * 128]:
    assert kfft.supported_length(n), n
  assert kfft.supported_length(1000)  # 8 x 125: two one-stage calls
  assert not kfft.supported_length(1031) and not kfft.supported_length(2 ** 20 + 128)
  assert kfft.block_max("v4") < 65536 <= kfft.block_max("v5e")


def test_bad_input_is_a_kernel_error():
  x = jnp.zeros((2, 16), jnp.complex64)
  r = jnp.zeros((2, 16), jnp.float32)
  cases = [
      lambda: kfft.ifft(r),  # real input to ifft
      lambda: kfft.irfft(r),
      lambda: kfft.fft(x, precision="fp8"),
      lambda: kfft.fft(x, norm="both"),
      lambda: kfft.fft(x, axis=2),
      lambda: kfft.fft(x, n=0),
      lambda: kfft.fft((r, jnp.zeros((2, 8)))),
      lambda: kfft.fft(jnp.zeros((2, 16), bool)),
      lambda: kfft.fft2(x, s=(4, 4, 4)),  # s and axes mismatched
      lambda: kfft.fft2(x, axes=(0, 0)),
      lambda: kfft.fft2(x, axes=(0, 5)),
      lambda: kfft.rfft(x),  # complex input to rfft
      lambda: kfft.fft(x, implementation="cuda"),
  ]
  for case in cases:
    with pytest.raises(kernels.KernelError):
      case()


def test_matrices_are_cached():
  kfft._matrices.cache_clear()
  a = kfft._matrices(4096, False, 1.0, "highest")
  b = kfft._matrices(4096, False, 1.0, "highest")
  assert a is b and kfft._matrices.cache_info().hits == 1


def direct_conv(u, k, causal, bias):
  """float64 NumPy, by definition: linear (causal) or circular convolution along the last axis."""
  u, k = np.asarray(u, np.float64), np.asarray(k, np.float64)
  b, c, t = u.shape
  y = np.zeros((b, c, t))
  for j in range(t):  # y[t] += k[j] u[t - j]
    if causal:
      y[..., j:] += k[None, :, j:j + 1] * u[..., :t - j]
    else:
      y += k[None, :, j:j + 1] * np.roll(u, j, axis=-1)
  return y + (0 if bias is None else u * np.asarray(bias, np.float64)[:, None])


@pytest.mark.parametrize("causal,batch,with_bias", [(True, 3, True), (False, 2, False)])
def test_fft_conv_matches_direct_convolution(causal, batch, with_bias):
  rng = np.random.default_rng(0)
  c, t = 3, 64
  u = rng.standard_normal((batch, c, t)).astype(np.float32)
  k = rng.standard_normal((c, t)).astype(np.float32)
  bias = rng.standard_normal(c).astype(np.float32) if with_bias else None
  ref = direct_conv(u, k, causal, bias)
  y = long_conv.fft_conv(jnp.asarray(u), jnp.asarray(k), causal=causal, bias=None if bias is None else jnp.asarray(bias),
                    **PALLAS)
  assert y.shape == u.shape and rel(y, ref) < 1e-5
  assert rel(long_conv.fft_conv_reference(u, k, causal=causal, bias=bias), ref) < 1e-5


def test_fft_conv_gradients():
  rng = np.random.default_rng(1)
  u = jnp.asarray(rng.standard_normal((2, 2, 12)).astype(np.float32))
  k = jnp.asarray(rng.standard_normal((2, 12)).astype(np.float32))
  bias = jnp.asarray(rng.standard_normal(2).astype(np.float32))
  ct = jnp.asarray(rng.standard_normal((2, 2, 12)).astype(np.float32))
  ours = jax.vjp(lambda u, k, b: long_conv.fft_conv(u, k, bias=b, **PALLAS), u, k, bias)[1](ct)
  ref = jax.vjp(lambda u, k, b: long_conv.fft_conv_reference(u, k, bias=b), u, k, bias)[1](ct)
  for a, b in zip(ours, ref):
    assert rel(a, b) < 1e-5
  jax.test_util.check_grads(lambda u, k: long_conv.fft_conv(u, k, **PALLAS), (u, k), order=1, modes=("rev",),
                            atol=1e-2, rtol=1e-2)


def _pallas_names(fn, *args):
  """The names of the Pallas kernels ``fn`` calls, in nested jaxprs too (custom_vjp, platform_dependent)."""
  names = []

  def walk(jaxpr):
    for e in jaxpr.eqns:
      if e.primitive.name == "pallas_call":
        names.append(str(e.params.get("name")))
        continue
      for v in e.params.values():
        for sub in (v if isinstance(v, (tuple, list)) else (v,)):
          if isinstance(sub, jax.extend.core.ClosedJaxpr):
            walk(sub.jaxpr)
          elif isinstance(sub, jax.extend.core.Jaxpr):
            walk(sub)
  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return names


# (batch, channels, seq, causal, bias, dtype): odd batch (a zero partner row), channels that are
# not a multiple of the 8 per grid step, the smallest fused length (S = 6), circular, bf16 input,
# and the stacked left matmuls (S and seq / 128 multiples of 8: seq 1024 causal, 2048 circular)
FUSED = [(2, 3, 512, True, True, np.float32), (3, 10, 384, True, False, np.float32),
         (4, 2, 1024, False, True, np.float32), (1, 4, 640, False, False, np.float32),
         (2, 2, 512, True, False, jnp.bfloat16), (3, 2, 1024, True, True, np.float32),
         (2, 1, 2048, False, False, np.float32)]


@pytest.mark.parametrize("b,c,t,causal,with_bias,dtype", FUSED)
def test_fused_fft_conv_matches_direct_convolution_and_gradients(b, c, t, causal, with_bias, dtype):
  rng = np.random.default_rng(b * 100 + c)
  u = jnp.asarray(rng.standard_normal((b, c, t)), dtype)
  k = jnp.asarray(rng.standard_normal((c, t)), dtype)
  bias = jnp.asarray(rng.standard_normal(c), dtype) if with_bias else None
  dy = jnp.asarray(rng.standard_normal((b, c, t)), jnp.float32)
  f = lambda u, k, bias: long_conv.fft_conv(u, k, causal=causal, bias=bias, **PALLAS)  # noqa: E731
  assert _pallas_names(lambda u, k: f(u, k, bias), u, k) == ["fft_conv"]  # one fused kernel, nothing composed
  y, vjp = jax.vjp(f, u, k, bias)
  un, kn = np.asarray(u, np.float64), np.asarray(k, np.float64)
  assert y.shape == u.shape and y.dtype == jnp.float32
  assert rel(y, direct_conv(un, kn, causal, None if bias is None else np.asarray(bias, np.float64))) < 2e-6
  ours = vjp(dy)
  ref = jax.vjp(lambda u, k, bias: long_conv.fft_conv_reference(u.astype(jnp.float32), k.astype(jnp.float32),
                                                           causal=causal, bias=bias), u, k, bias)[1](dy)
  bound = 2e-6 if dtype == np.float32 else 1e-2  # bf16 gradients are rounded to bf16
  for name, a, r in zip(("du", "dk", "dbias"), ours, ref):
    if r is None:
      assert a is None
      continue
    assert a.dtype == dtype and rel(a, r) < bound, name


def test_fused_fft_conv_backward_is_one_kernel_and_check_grads():
  rng = np.random.default_rng(7)
  u = jnp.asarray(rng.standard_normal((2, 2, 384)).astype(np.float32))
  k = jnp.asarray(rng.standard_normal((2, 384)).astype(np.float32) / 20)
  grad = lambda u, k: jax.grad(lambda u, k: long_conv.fft_conv(u, k, **PALLAS).sum(), (0, 1))(u, k)  # noqa: E731
  assert sorted(_pallas_names(grad, u, k)) == ["fft_conv", "fft_conv_bwd"]
  jax.test_util.check_grads(lambda u, k: long_conv.fft_conv(u, k, **PALLAS), (u, k), order=1, modes=("rev",),
                            atol=1e-2, rtol=1e-2)


def test_fused_fft_conv_no_races_on_two_cores():
  # As on megacore chips: two cores share the "parallel" channel-block axis while each walks the
  # batch pairs in order (the filter's spectrum and dk's accumulator live across those steps).
  from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
  from jax.experimental.pallas import tpu as pltpu
  rng = np.random.default_rng(5)
  u = jnp.asarray(rng.standard_normal((4, 10, 384)).astype(np.float32))
  k = jnp.asarray(rng.standard_normal((10, 384)).astype(np.float32))
  ip = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)
  y, vjp = jax.vjp(lambda u, k: long_conv.fft_conv(u, k, implementation="pallas", interpret=ip), u, k)
  assert ipc.races is not None and not ipc.races.races_found
  du, dk = vjp(y)
  assert ipc.races is not None and not ipc.races.races_found
  ref_du, ref_dk = jax.vjp(lambda u, k: long_conv.fft_conv_reference(u, k), u, k)[1](y)
  assert rel(du, ref_du) < 2e-6 and rel(dk, ref_dk) < 2e-6


@pytest.mark.parametrize("causal", [True, False])
def test_fused_fft_conv_256_wide_rows_for_v6e(causal):
  # v6e's 256-wide MXU: rows viewed as [S, 256] (seq 2048: 8 data rows), traced for v6e
  from kernels.base.backend import target
  from kernels.fourier import long_conv as fft_conv
  assert fft_conv.lane_width(2048, "v6e") == 256 and fft_conv.lane_width(2048, "v5e") == 128
  assert fft_conv.lane_width(1024, "v6e") == 128  # 4 data rows of 256: too few
  rng = np.random.default_rng(11)
  u = jnp.asarray(rng.standard_normal((2, 2, 2048)).astype(np.float32))
  k = jnp.asarray(rng.standard_normal((2, 2048)).astype(np.float32))
  dy = jnp.asarray(rng.standard_normal((2, 2, 2048)).astype(np.float32))
  with target("v6e"):
    y, vjp = jax.vjp(lambda u, k: long_conv.fft_conv(u, k, causal=causal, **PALLAS), u, k)
    grads = vjp(dy)
  assert rel(y, direct_conv(np.asarray(u, np.float64), np.asarray(k, np.float64), causal, None)) < 2e-6
  ref = jax.vjp(lambda u, k: long_conv.fft_conv_reference(u, k, causal=causal), u, k)[1](dy)
  for a, r in zip(grads, ref):
    assert rel(a, r) < 2e-6


@pytest.mark.parametrize("precision", ["high", "bfloat16"])
def test_fused_fft_conv_precisions(precision):
  rng = np.random.default_rng(3)
  u = rng.standard_normal((2, 2, 1024)).astype(np.float32)  # the stacked left matmuls
  k = rng.standard_normal((2, 1024)).astype(np.float32)
  y = long_conv.fft_conv(jnp.asarray(u), jnp.asarray(k), precision=precision, **PALLAS)
  assert rel(y, direct_conv(u.astype(np.float64), k.astype(np.float64), True, None)) < BOUND[precision]


def test_fft_conv_bad_input():
  u, k = jnp.zeros((2, 3, 16)), jnp.zeros((3, 16))
  for case in (lambda: long_conv.fft_conv(u, k[:2]), lambda: long_conv.fft_conv(u[0], k),
               lambda: long_conv.fft_conv(u, k, bias=jnp.zeros(4)), lambda: long_conv.fft_conv(u.astype(jnp.complex64), k),
               lambda: long_conv.fft_conv(u, k, causal=1)):
    with pytest.raises(kernels.KernelError):
      case()


# --- ahead-of-time compilation for TPU ---------------------------------------------------

_AOT_PROGRAMS = """
import sys, importlib, jax, jax.numpy as jnp, kernels
from kernels.fourier import transforms as kfft
from kernels.fourier import long_conv
gen, which, f32, sds = sys.argv[1], sys.argv[2], jnp.float32, jax.ShapeDtypeStruct
P = dict(implementation="pallas", interpret=False)

def fwd_bwd(n, precision, batch):
  def f(a, b, ga, gb):
    out, vjp = jax.vjp(lambda a, b: kfft.fft((a, b), precision=precision, **P), a, b)
    return out, vjp((ga, gb))
  x = sds((batch, n), f32)
  return kernels.compile_for_tpu(f, x, x, x, x, generation=gen)

def check(comp, calls=2):
  assert comp.hlo.count("tpu_custom_call") >= calls, comp.hlo
  assert comp.vmem_bytes < kernels.get_chip(gen).vmem_bytes

if which == "bench":  # the benchmark configurations: [1024, 4096] (two precisions), fft_conv [8, 768, 8192]
  for precision in ("highest", "bfloat16"):
    check(fwd_bwd(4096, precision, 1024))
  u, k = sds((8, 768, 8192), f32), sds((768, 8192), f32)
  def conv(u, k, dy):
    y, vjp = jax.vjp(lambda u, k: long_conv.fft_conv(u, k, **P), u, k)
    return y, vjp(dy)
  check(kernels.compile_for_tpu(conv, u, k, u, generation=gen), 2)  # the fused forward, the backward
elif which == "paths":  # each kernel path: one stage, two stages (odd S, unrolled; S > 128, looped), bf16x3, [16, 65536]
  for n, precision in ((8, "highest"), (1152, "high"), (16384, "highest"), (65536, "highest")):
    check(fwd_bwd(n, precision, 16))
else:  # fused fft_conv: S = 6 (odd batch, bias, channels not a multiple of 8), circular, bf16 input at "high"
  for (b, c, t), causal, dtype, precision in (((3, 10, 384), True, f32, "highest"), ((2, 8, 2048), False, f32, "highest"),
                                              ((2, 8, 4096), True, jnp.bfloat16, "high")):
    def conv(u, k, bias, dy):
      y, vjp = jax.vjp(lambda u, k, bias: long_conv.fft_conv(u, k, bias=bias, causal=causal, precision=precision, **P),
                       u, k, bias)
      return y, vjp(dy)
    check(kernels.compile_for_tpu(conv, sds((b, c, t), dtype), sds((c, t), dtype), sds((c,), dtype),
                                  sds((b, c, t), f32), generation=gen))
print("ok")
"""


@pytest.mark.tpu_aot
@pytest.mark.parametrize("generation,which", [(g, "bench") for g in kernels.TPU_GENERATIONS] + [
    (g, which) for which in ("paths", "conv") for g in EXTRA_AOT_GENERATIONS])  # the plans differ in rows only
def test_aot_compiles_forward_and_backward(generation, which):
  import os
  env = dict(os.environ, KERNELS_STATIC_PROFILE="0")
  proc = run_program(_AOT_PROGRAMS, generation, which, env=env)
  assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


# --- issue 55: inputs no earlier test drew --------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(128, 3), (512, 3)])
@pytest.mark.parametrize("inverse", [False, True])
def test_bfloat16_precision_along_a_leading_axis_under_jit(shape, inverse):
  """XLA:CPU has no bf16 x bf16 -> f32 dot for this layout ("Unsupported element type for DotThunk"):
  in interpret mode the kernel widens its bf16 pieces to f32, which gives the same products."""
  rng = np.random.default_rng(0)
  x = (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(np.complex64)
  fn, ref = (kernels.ifft, np.fft.ifft) if inverse else (kernels.fft, np.fft.fft)
  y = np.asarray(jax.jit(lambda x: fn(x, axis=0, precision="bfloat16", implementation="pallas",
                                      interpret=True))(x))
  want = ref(x.astype(np.complex128), axis=0)
  assert np.abs(y - want).max() / np.abs(want).max() < 1e-2  # one bf16 pass


@pytest.mark.parametrize("fn", ["rfft", "irfft", "fft", "ifft"])
def test_unsupported_length_names_the_length_and_the_function(fn):
  x = jnp.ones((2, 64), jnp.complex64 if fn in ("irfft", "ifft") else jnp.float32)
  with pytest.raises(kernels.NoImplementationError, match=rf"^{fn}: no implementation fits at n=1031 ") as e:
    getattr(kernels, fn)(x, n=1031, implementation="pallas", interpret=True)
  assert e.value.argument == "n" and e.value.value == 1031
