"""The long convolution :func:`kernels.fft_conv`, and the fused kernel behind :func:`kernels.fft_conv`: FFT, spectral product and inverse FFT in one kernel.

``y = u * k`` for a signal ``u`` ``[batch, channels, seq]`` and a per-channel filter ``k``
``[channels, seq]`` (Hyena, FlashFFTConv). One grid step holds ``rows`` channels of two batch
rows in VMEM and does everything there; HBM sees ``u`` read once, ``y`` written once and ``k``
read once per channel block.

*Two real rows in one complex transform.* ``u`` and ``k`` are real, so batch rows ``b`` and
``b + B/2`` of one channel ride as ``z = u_lo + i u_hi``: ``ifft(fft(z) * K)`` is
``(u_lo * k) + i (u_hi * k)`` because ``K = fft(k)`` belongs to a real filter.

*No transposes, no digit reversal.* With ``n = 128 a + b`` (column chunk ``a`` of a row, lane
``b``) and ``k = k2 + S k1``, the forward transform is an ``S``-point FFT across the block's
column chunks on the VPU (each chunk ``[rows, 128]`` is whole vregs, so its butterflies move
no data: :func:`kernels.fourier.transforms._vpu_fft`), the twiddle ``W_N^(b k2)`` and ``F_128`` across the
lanes (a right matmul whose M dimension is every ``(k2, row)`` of the block). That leaves
the spectrum as ``Z[k2, row, k1]``: not the natural order, which a standalone FFT must
restore with a transpose. A convolution never needs the natural order: the filter's
spectrum is made by the same steps, so it is in the same order, and the inverse undoes the
steps in reverse (``conj F_128`` on the right, the conjugate twiddle, the inverse FFT across
chunks), which lands each output chunk of ``y`` in place.

*Row width.* ``L = 128`` lanes, or 256 on v6e (:func:`lane_width`): the ``F_L`` matmul's
weight is ``L x L``, and only ``L = 256`` fills v6e's 256 x 256 MXU. (libtpu's cost model
charges the two widths alike on v6e; the padded MXU count halves.) Elsewhere here 128 stands for ``L``.

*Zero padding is free.* A causal convolution is a circular one of length ``n = 2 seq`` with
both signals zero in their second half, and only the first half of the result is kept. The
zero chunks enter the butterflies as ``None``, which the first radix steps skip, and the
inverse computes only the first ``S/2`` output chunks: the zeros are never stored or
multiplied.

*The filter's spectrum* is computed in the kernel too, at the first batch step of each
channel block (the batch is the inner, sequential grid axis), and kept in VMEM scratch for
the other batch steps: ``k`` is read from HBM once.

*Backward: one kernel for both gradients.* ``du`` is a correlation of ``dy`` with ``k``
(``ifft(DY conj K)``); ``dk`` is the correlation of ``dy`` with ``u`` summed over the batch.
Under differentiation the forward kernel also writes the packed pairs' spectra ``U`` (in its
own order), as XLA's ``rfft`` composition keeps ``rfft(u)``: twice the bytes of an f32
``u``, as the padded transform is twice as long and complex. The backward kernel
transforms ``dy`` once per step, inverts ``DY conj K`` into ``du``, and accumulates
``conj(U) DY`` in VMEM across the batch steps, inverting the sum once per channel block
into ``dk``: two transforms per batch pair (three without the saved ``U``, four with two
separate kernels). With packed rows the real part of that last inverse is exactly
``corr(dy_lo, u_lo) + corr(dy_hi, u_hi)``; the cross terms land in the imaginary part,
which is dropped.

Matmul precision, the Gauss three-product complex matmul and the bf16 splits are those of
:mod:`kernels.fft`.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.base import calls
from kernels.base import partition
from kernels.base import tiling
from kernels.base.backend import dispatch, target_chip
from kernels.base.errors import check
from kernels.base.hardware import get_chip
from kernels.fourier.transforms import (DENSE_MAX, LANES, PRECISIONS, TWO_STAGE_MAX, _cmul_mat, _gauss, _is_array, _phase,
                                        _split, _twiddle, _vpu_fft, fft, ifft, vpu_factors)

MAX_ROWS = 8  # channels per grid step: a chunk of 8 rows is one vreg tall


def supported(t: int, causal: bool, chip=None) -> bool:
  """True when the fused kernel takes sequence length ``t`` on ``chip`` (else ``fft_conv`` composes
  transform calls): ``t`` a multiple of 128, a two-stage padded length, and ``MAX_ROWS`` channels'
  blocks and temporaries within VMEM."""
  n = 2 * t if causal else t
  if not (t % LANES == 0 and DENSE_MAX < n <= TWO_STAGE_MAX) or vpu_factors(n // lane_width(t, chip)) is None:
    return False
  return MAX_ROWS * _per_row(n, t, 4, 6) <= _budget(chip)


def lane_width(t: int, chip=None) -> int:
  """The width ``L`` of a column chunk: the MXU's side (256 on v6e) when it divides ``seq`` and
  leaves at least 8 data chunks, else 128. The matmul of each transform is
  ``[S * rows, L] x [L, L]``, so a 256-wide MXU is filled only when ``L`` is 256."""
  side = get_chip(chip or "v5e").mxu_shape[0]
  return side if side > LANES and t % side == 0 and t // side >= 8 else LANES


@functools.lru_cache(maxsize=32)
def _matrices(n: int, width: int, precision: str) -> tuple:
  """The kernel's constant inputs for transform length ``n`` viewed as ``S`` chunks of ``L = width``
  lanes: groups (twiddle, F_L, conj F_L, conj twiddle / n), DFTs as Gauss triples of bf16 pieces."""
  s = n // width
  a, j = np.arange(s), np.arange(width)
  tw = _phase(n, a[:, None], j[None, :], False)
  f2 = _gauss(*_phase(width, j[:, None], j[None, :], False), precision)
  g2 = _gauss(*_phase(width, j[:, None], j[None, :], True), precision)
  itw = tuple(p / n for p in _phase(n, a[:, None], j[None, :], True))
  groups, flat, layout = (tw, f2, g2, itw), [], []
  for g in groups:
    items = [m for part in g for m in part] if isinstance(g[0], tuple) else [np.asarray(m, np.float32) for m in g]
    flat += items
    layout.append(len(items))
  return tuple(flat), tuple(layout)


def _unflatten(vals, layout, precision):
  k = len(_split(np.zeros(1), precision))
  out, i = [], 0
  for c in layout:
    g = vals[i:i + c]
    out.append(tuple(tuple(g[j * k:(j + 1) * k]) for j in range(3)) if c == 3 * k else tuple(g))
    i += c
  return out


def _chunks(ref, h: int, s: int, w: int) -> list:
  """A block of rows ``[rows, t]`` as its ``S`` column chunks ``[rows, L]`` (None beyond the ``h`` that hold
  the signal: the zero padding, never stored)."""
  return [ref[:, j * w:(j + 1) * w].astype(jnp.float32) for j in range(h)] + [None] * (s - h)


def _dense(parts, like):
  return [jnp.zeros_like(like) if p is None else p for p in parts]


def _forward(xr, xi, tw, f2, precision):
  """Spectra of a block's rows given as chunk lists (``xi`` all None: real rows): ``[S * rows, L]``
  planes with rows in ``(k2, r)`` order, the kernel's own order (see the module doc)."""
  ys = _twiddle(*_vpu_fft(xr, xi, inverse=False), tw)
  like = next(y[0] for y in ys if y[0] is not None)
  yr, yi = (jnp.concatenate(_dense([y[part] for y in ys], like)) for part in (0, 1))
  return _cmul_mat(yr, yi, f2, precision, left=False)


def _inverse(pr, pi, h, g2, itw, precision):
  """Inverse transforms of ``[S * rows, L]`` spectra in the kernel's order: the first ``h`` chunks of
  the real and imaginary planes (what is not used is never computed)."""
  s = itw[0].shape[0]
  vr, vi = _cmul_mat(pr, pi, g2, precision, left=False)
  rows = vr.shape[0] // s
  ws = _twiddle([vr[k * rows:(k + 1) * rows] for k in range(s)], [vi[k * rows:(k + 1) * rows] for k in range(s)], itw)
  outr, outi = _vpu_fft([w[0] for w in ws], [w[1] for w in ws], inverse=True)
  return outr[:h], outi[:h]


def _filter_and_invert(zr, zi, kr, ki, lo, hi, bias_ref, out_ref, h, w, g2, itw, precision):
  """``ifft(Z K)`` of a packed pair's spectrum into ``out_ref``'s two rows, plus ``bias`` times the
  pair's input chunks (``lo``, ``hi``) when there is one."""
  pr, pi = zr * kr - zi * ki, zr * ki + zi * kr
  outs = _inverse(pr, pi, h, g2, itw, precision)
  for part, (chunks, x) in enumerate(zip(outs, (lo, hi))):
    for j in range(h):
      y = chunks[j] if bias_ref is None else chunks[j] + bias_ref[...] * x[j]
      out_ref[part, 0, :, j * w:(j + 1) * w] = y


def _conv_kernel(*refs, s, h, w, precision, layout, has_bias, save_spectrum):
  nm = sum(layout)
  tw, f2, g2, itw = _unflatten([m[...] for m in refs[:nm]], layout, precision)
  k_ref, u_ref = refs[nm:nm + 2]
  bias_ref = refs[nm + 2] if has_bias else None
  y_ref, *zs_refs, kr_s, ki_s = refs[nm + 2 + has_bias:]

  @pl.when(pl.program_id(1) == 0)  # the filter's spectrum, once per channel block
  def _():
    zr, zi = _forward(_chunks(k_ref, h, s, w), [None] * s, tw, f2, precision)
    kr_s[...] = zr.reshape(kr_s.shape)
    ki_s[...] = zi.reshape(ki_s.shape)

  lo, hi = _chunks(u_ref.at[0, 0], h, s, w), _chunks(u_ref.at[1, 0], h, s, w)
  zr, zi = _forward(lo, hi, tw, f2, precision)
  zr, zi = zr.reshape(kr_s.shape), zi.reshape(kr_s.shape)
  if save_spectrum:  # the packed pair's spectrum, for the backward pass
    zs_refs[0][0] = zr
    zs_refs[1][0] = zi
  _filter_and_invert(zr.reshape(-1, w), zi.reshape(-1, w), kr_s[...].reshape(-1, w), ki_s[...].reshape(-1, w),
                     lo, hi, bias_ref, y_ref, h, w, g2, itw, precision)


def _bwd_kernel(*refs, s, h, w, precision, layout, has_bias):
  """``du`` (a correlation of ``dy`` with ``k``) and ``dk`` (``conj(U) DY`` summed over the batch
  steps, inverted at the last): ``dy``'s transform is made once and serves both; ``U`` is the
  spectrum the forward kernel saved."""
  nm = sum(layout)
  tw, f2, g2, itw = _unflatten([m[...] for m in refs[:nm]], layout, precision)
  k_ref, d_ref, zr_ref, zi_ref = refs[nm:nm + 4]
  bias_ref = refs[nm + 4] if has_bias else None
  du_ref, dk_ref, kr_s, ki_s, ar_s, ai_s = refs[nm + 4 + has_bias:]
  b = pl.program_id(1)
  shape = kr_s.shape

  @pl.when(b == 0)  # conj K, once per channel block; the dk accumulator starts at zero
  def _():
    zr, zi = _forward(_chunks(k_ref, h, s, w), [None] * s, tw, f2, precision)
    kr_s[...] = zr.reshape(shape)
    ki_s[...] = -zi.reshape(shape)
    ar_s[...] = jnp.zeros_like(ar_s)
    ai_s[...] = jnp.zeros_like(ai_s)

  lo, hi = _chunks(d_ref.at[0, 0], h, s, w), _chunks(d_ref.at[1, 0], h, s, w)
  dr, di = _forward(lo, hi, tw, f2, precision)
  dr, di = dr.reshape(shape), di.reshape(shape)
  ur, ui = zr_ref[0], zi_ref[0]
  ar_s[...] += ur * dr + ui * di  # conj(U) DY
  ai_s[...] += ur * di - ui * dr
  _filter_and_invert(dr.reshape(-1, w), di.reshape(-1, w), kr_s[...].reshape(-1, w), ki_s[...].reshape(-1, w),
                     lo, hi, bias_ref, du_ref, h, w, g2, itw, precision)

  @pl.when(b == pl.num_programs(1) - 1)
  def _():
    dk = _inverse(ar_s[...].reshape(-1, w), ai_s[...].reshape(-1, w), h, g2, itw, precision)[0]
    for j in range(h):
      dk_ref[:, j * w:(j + 1) * w] = dk[j]


def _per_row(n: int, t: int, u_itemsize: int, scratch: int) -> int:
  """VMEM bytes per channel in a grid step: the double-buffered pair, k / dk and spectrum blocks,
  the scratch planes and the kernel's temporaries."""
  return (2 * 2 * 2 * t * (2 * u_itemsize + 4) + 2 * 2 * t * 4 + 2 * 2 * n * 4 + scratch * n * 4 + 16 * n * 4)


def _budget(chip) -> int:
  return min(get_chip(chip or "v5e").vmem_bytes // 2, 48 << 20)


def _plan(c: int, n: int, t: int, u_itemsize: int, chip, scratch: int):
  """Channels per grid step (all of them up to 8, else 8: a block's rows are sublanes) and the VMEM footprint."""
  rows = min(MAX_ROWS, c)
  return rows, _per_row(n, t, u_itemsize, scratch) * rows


def _pair(u):
  """``[B, C, t]`` as ``[2, B/2, C, t]`` (a free reshape of the leading axis; an odd batch gets one zero row)."""
  b, c, t = u.shape
  if b % 2:
    u = jnp.pad(u, ((0, 1), (0, 0), (0, 0)))
    b += 1
  return u.reshape(2, b // 2, c, t)


def _specs(mats, rows, t, w, bias):
  full = lambda m: pl.BlockSpec(m.shape, lambda ci, bi: (0,) * m.ndim)  # noqa: E731
  chan = pl.BlockSpec((rows, t), lambda ci, bi: (ci, 0))
  pair = pl.BlockSpec((2, 1, rows, t), lambda ci, bi: (0, bi, ci, 0))
  bias_spec = [] if bias is None else [pl.BlockSpec((rows, w), lambda ci, bi: (ci, 0))]
  return [full(m) for m in mats], chan, pair, bias_spec


def _bias_rows(bias, c, w):
  return [] if bias is None else [jnp.broadcast_to(bias.astype(jnp.float32)[:, None], (c, w))]


def _call(kernel, name, u, k, bias, spectrum, out_shape, out_specs, flops, bytes_accessed, *, causal, precision,
          interpret, temps, **options):
  """One of the two kernels on grid (channel blocks, batch pairs): the pair is the inner, sequential axis.
  ``u`` ``[B, C, t]`` (``dy`` for the backward), ``spectrum`` the saved pair of ``[B/2, S, C, L]`` planes or None."""
  b, c, t = u.shape
  chip = target_chip()
  w = lane_width(t, chip)
  n, h = (2 * t if causal else t), t // w
  s = n // w
  rows, need = _plan(c, n, t, u.dtype.itemsize, chip, temps)
  flat, layout = _matrices(n, w, precision)
  mats = [jnp.asarray(m) for m in flat]
  mat_bytes = sum(int(m.size) * m.dtype.itemsize for m in mats)
  mat_specs, chan, pair, bias_spec = _specs(mats, rows, t, w, bias)
  u5 = _pair(u)
  sshape = (u5.shape[1], s, c, w)  # one plane of the saved spectrum, in the kernel's (k2, channel) order
  sspec = pl.BlockSpec((1, s, rows, w), lambda ci, bi: (bi, 0, ci, 0))
  spectrum_in = [] if spectrum is None else list(spectrum)
  passes = {"bfloat16": 1, "high": 3, "highest": 6}[precision]
  return calls.pallas_call(
      functools.partial(kernel, s=s, h=h, w=w, precision=precision, layout=layout, has_bias=bias is not None,
                        **options),
      grid=(tiling.cdiv(c, rows), u5.shape[1]),
      in_specs=mat_specs + [chan, pair] + [sspec] * len(spectrum_in) + bias_spec,
      out_specs=out_specs(chan, pair, sspec),
      out_shape=out_shape(u5.shape, (c, t), sshape),
      scratch_shapes=[pltpu.VMEM((s, rows, w), jnp.float32)] * temps,
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "arbitrary"),
          vmem_limit_bytes=tiling.vmem_limit(need + 2 * mat_bytes, chip or "v5e", argument="u", value=u.shape)),
      cost_estimate=pl.CostEstimate(flops=flops(passes, u5.shape[1] * c, s, h, w), transcendentals=0,
                                    bytes_accessed=bytes_accessed(u5.size, 2 * math.prod(sshape)) + mat_bytes),
      interpret=interpret, name=name)(*mats, k, u5, *spectrum_in, *_bias_rows(bias, c, w))


def _fft_flops(passes, s, h, w):
  """Matmul FLOPs of one complex row's transform (3 real products): ``F_L`` on each of the ``S`` chunks."""
  del h
  return 3 * 2 * passes * s * w * w


def _conv_call(u, k, bias, *, causal, precision, interpret, save_spectrum=False):
  """``y = u * k (+ bias u)``, ``[B, C, t]`` f32; with ``save_spectrum`` also the packed pairs'
  spectra, a (real, imaginary) pair of ``[B/2, S, C, L]`` planes in the kernel's order, for the backward."""
  b, c, t = u.shape
  out = _call(_conv_kernel, "fft_conv", u, k, bias, None,
              out_shape=lambda pshape, cshape, sshape: [jax.ShapeDtypeStruct(pshape, jnp.float32)]
              + [jax.ShapeDtypeStruct(sshape, jnp.float32)] * (2 * save_spectrum),
              out_specs=lambda chan, pair, sspec: [pair] + [sspec] * (2 * save_spectrum),
              flops=lambda p, rows, s, h, w: 2 * rows * _fft_flops(p, s, h, w),
              bytes_accessed=lambda size, ssize: size * (u.dtype.itemsize + 4) + k.size * k.dtype.itemsize
              + 4 * ssize * save_spectrum,
              causal=causal, precision=precision, interpret=interpret, temps=2, save_spectrum=save_spectrum)
  y = out[0].reshape(-1, c, t)[:b]
  return (y, tuple(out[1:])) if save_spectrum else y


def _bwd_call(spectrum, k, bias, dy, *, causal, precision, interpret):
  """``(du [B, C, t], dk [C, t])``, f32, from the forward's saved ``spectrum`` of ``u``: one kernel,
  ``dy``'s transform shared by both."""
  b, c, t = dy.shape
  du, dk = _call(_bwd_kernel, "fft_conv_bwd", dy, k, bias, spectrum,
                 out_shape=lambda pshape, cshape, sshape: (jax.ShapeDtypeStruct(pshape, jnp.float32),
                                                           jax.ShapeDtypeStruct(cshape, jnp.float32)),
                 out_specs=lambda chan, pair, sspec: (pair, chan),
                 flops=lambda p, rows, s, h, w: 2 * rows * _fft_flops(p, s, h, w),
                 bytes_accessed=lambda size, ssize: size * (dy.dtype.itemsize + 4) + 4 * ssize + 2 * k.size * 4,
                 causal=causal, precision=precision, interpret=interpret, temps=4)
  return du.reshape(-1, c, t)[:b], dk.reshape(c, t)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def fused_conv(u, k, bias, causal, precision, interpret):
  """``u * k (+ bias u)`` by the fused kernel; differentiable in ``u``, ``k`` and ``bias``."""
  return _conv_call(u, k, bias, causal=causal, precision=precision, interpret=interpret)


def _fwd(u, k, bias, causal, precision, interpret):
  y, spectrum = _conv_call(u, k, bias, causal=causal, precision=precision, interpret=interpret, save_spectrum=True)
  return y, (u, k, bias, spectrum)


def _bwd(causal, precision, interpret, res, dy):
  u, k, bias, spectrum = res
  du, dk = _bwd_call(spectrum, k, bias, dy, causal=causal, precision=precision, interpret=interpret)
  db = None if bias is None else jnp.einsum("bct,bct->c", dy, u.astype(jnp.float32)).astype(bias.dtype)
  return du.astype(u.dtype), dk.astype(k.dtype), db


fused_conv.defvjp(_fwd, _bwd)


# ---------------------------------------------------------------------------------
# Long convolution
# ---------------------------------------------------------------------------------


def fft_conv(u, k, *, causal=True, bias=None, precision="highest", implementation=None, interpret=None):
  """A long convolution of ``u`` ``[batch, channels, seq]`` with a per-channel filter ``k``
  ``[channels, seq]`` by FFT, as in Hyena and FlashFFTConv: ``y = u * k (+ u * bias)``.

  ``causal=True`` is the linear convolution ``y[t] = sum_{j <= t} k[j] u[t - j]`` (both
  zero-padded to ``2 * seq``, so nothing wraps around); ``causal=False`` the circular one of
  length ``seq``. ``bias`` (``[channels]``, Hyena's ``D``) adds ``bias[c] * u``.

  **Fused** (see :func:`fft_conv_fuses`): one kernel does the filter's transform, the
  signal's, the spectral product and the inverse in VMEM, with no transposes and the zero
  padding never stored (see the module's docstring). Under differentiation it also saves
  the signal's spectrum, and the backward is one more kernel (``du``, a correlation with
  ``k``; ``dk``, the correlation with ``u`` summed over the batch in VMEM). Other lengths
  compose the transform kernels above with the pointwise product in XLA (spectra make HBM
  round trips). Either way two batch rows ride in one complex transform (``u`` and ``k`` are
  real), and ``implementation=None`` falls back to :func:`fft_conv_reference` where Pallas
  cannot serve.

  On a mesh (see :func:`kernels.sharding`): ``batch`` and ``channels`` splits are local (``k``'s and
  ``bias``' channels split along); a split ``seq`` is a KernelError (the causal convolution's zero
  padding to ``2 * seq`` and the product of whole spectra need the full sequence: split batch or
  channels instead, or reshard ``seq`` first).

  Returns:
    ``[batch, channels, seq]`` float32.
  """
  check(_is_array(u) and u.ndim == 3, "u", u, "must be a [batch, channels, seq] real array")
  check(_is_array(k) and k.ndim == 2, "k", k, "must be a [channels, seq] real array")
  for name, v in (("u", u), ("k", k)):
    check(jnp.issubdtype(v.dtype, jnp.floating), name, v, f"must be real floating point, not {jnp.dtype(v.dtype).name}")
  b, c, t = u.shape
  check(tuple(k.shape) == (c, t), "k", k, f"must have shape {(c, t)} ([channels, seq] of u)")
  if bias is not None:
    check(_is_array(bias) and tuple(bias.shape) == (c,), "bias", bias, f"must have shape {(c,)} ([channels])")
  check(isinstance(causal, bool), "causal", causal, "must be True or False")
  check(precision in PRECISIONS, "precision", precision, f"must be one of {PRECISIONS}")
  operands, dims = dict(u=u, k=k, bias=bias), dict(u=("batch", "channels", "seq"), k=("channels", "seq"),
                                                   bias=("channels",))
  split = partition.plan("fft_conv", operands, dims, splits={"batch": "local", "channels": "local"})
  if split is not None:  # batch and channels (k's and bias' along) are independent: each device convolves its own
    def local(u, k, bias=None):
      return fft_conv(u, k, causal=causal, bias=bias, precision=precision, implementation=implementation,
                      interpret=interpret)
    return split.run(local, operands, dims, dims["u"])

  def pallas(u, k, bias, interpret):
    if supported(t, causal, target_chip()):
      return fused_conv(u, k, bias, causal, precision, interpret)
    return _composed_conv(u, k, bias, causal=causal, precision=precision, interpret=interpret)
  return dispatch("fft_conv", u, k, bias, pallas=pallas,
                  xla=lambda u, k, bias: fft_conv_reference(u, k, causal=causal, bias=bias),
                  implementation=implementation, interpret=interpret)


def _composed_conv(u, k, bias, *, causal, precision, interpret):
  """The convolution from separate transform calls, the product in XLA between them (lengths the fused kernel does not take)."""
  b, _, t = u.shape
  n = 2 * t if causal else t
  kw = dict(precision=precision, implementation="pallas", interpret=interpret)
  u32, k32 = u.astype(jnp.float32), k.astype(jnp.float32)
  half = (b + 1) // 2
  lo, hi = u32[:half], u32[half:]
  if hi.shape[0] < half:  # odd batch: the last imaginary row is zeros
    hi = jnp.pad(hi, ((0, half - hi.shape[0]), (0, 0), (0, 0)))
  kr, ki = fft((k32, jnp.zeros_like(k32)), n=n, **kw)
  zr, zi = fft((lo, hi), n=n, **kw)
  pr, pi = zr * kr - zi * ki, zr * ki + zi * kr
  yr, yi = ifft((pr, pi), **kw)
  y = jnp.concatenate([yr[..., :t], yi[..., :t]], axis=0)[:b]
  if bias is not None:
    y = y + u32 * bias.astype(jnp.float32)[:, None]
  return y


def fft_conv_fuses(seq: int, causal: bool = True) -> bool:
  """True when :func:`fft_conv` at sequence length ``seq`` runs as one fused kernel on the target
  chip: ``seq`` a multiple of 128 whose padded transform length (``2 * seq``, or ``seq`` when
  circular) is in (512, 65536], with 8 channels' blocks within the chip's VMEM."""
  return supported(seq, causal, target_chip())


def fft_conv_reference(u, k, *, causal=True, bias=None):
  """:func:`fft_conv` with ``jnp.fft.rfft`` / ``irfft`` (XLA's FFT): the composition it is benchmarked against."""
  t = u.shape[-1]
  n = 2 * t if causal else t
  y = jnp.fft.irfft(jnp.fft.rfft(u.astype(jnp.float32), n=n) * jnp.fft.rfft(k.astype(jnp.float32), n=n), n=n)[..., :t]
  if bias is not None:
    y = y + u.astype(jnp.float32) * bias.astype(jnp.float32)[:, None]
  return y
