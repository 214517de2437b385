"""Discrete Fourier transforms in Pallas, on the VPU and the MXU: ``fft``, ``ifft``, ``rfft``, ``irfft`` and 2-D.

A TPU has no butterfly unit; its matrix unit (MXU: 128 x 128 on v4/v5e/v5p, 256 x 256 on
v6e) multiplies dense matrices, which is why FNet and Lu et al. ("Large-scale discrete
Fourier transform on TPUs") compute the DFT as matrix products. These kernels factor a
length-``N`` transform of a batch of rows (Cooley-Tukey, "four-step") into two stages and
put each where it is cheapest: butterflies on the VPU where the layout lets them work on
whole vregs, and a 128-point DFT matmul on the MXU where it does not (or where one bf16
pass is enough).

How the FFT kernel works
------------------------

*Layout.* The native data is a pair of float32 planes, ``(real, imag)``, each
``[rows, N]``. complex64 arrays are split into planes (and joined back) by XLA, which costs
one pass over memory each way: pass planes to avoid it. A grid step takes a block of ``R``
rows of both planes into VMEM, transforms them there, and writes the ``R`` output rows:
HBM is read once and written once.

*Two stages* (``N = S * 128``, ``512 < N <= 65536``). Inside the block each row is viewed
as a matrix ``A[s, f]`` with ``n = 128 s + f``. With ``k = S k1 + k2`` (``k1 < 128``,
``k2 < S``)::

    X[S k1 + k2] = sum_f W_128^(f k1) * W_N^(f k2) * sum_s W_S^(s k2) A[s, f]

1. stage 1, an ``S``-point DFT over ``s``. Column chunk ``s`` of the block (lanes
   ``128 s .. 128 s + 127`` of every row) is already a ``[R, 128]`` array of whole vregs, so
   for ``S`` a power of two stage 1 is a radix-4 FFT *across* those arrays on the VPU
   (:func:`_vpu_fft`): every twiddle inside it is one constant per array, the recursion's
   index shuffles are Python list slicing, and the arithmetic is plain f32 (exact to float32
   rounding at every ``precision``). Other ``S`` (9, 25, ...) take ``Y[r] = F_S @ A[r]`` per
   row on the MXU after a relayout of the block to ``[R, S, 128]``;
2. the twiddle ``Y[k2, f] *= W_N^(f k2)`` on the VPU (the ``norm`` scale is folded into it);
3. stage 2, the 128-point DFT over ``f``: ``Z = Y @ F_128``, one matmul whose M dimension is
   every ``(row, k2)`` of the block (the shape the MXU likes best: a constant 128 x 128
   weight, many rows);
4. ``Z[r, k2, k1]`` belongs at ``k = S k1 + k2``: a transpose per row into natural order (no
   digit reversal is ever stored).

Steps 3 and 4 take one of two routes (:func:`plan`):

* *128-row blocks* (``S <= 128``, a batch of at least 128, when VMEM allows): a block holds
  one row per lane, and every move is a whole-tile one. Each ``[128 r, 128 f]`` array of
  stage 1 is transposed (the XLU), which puts ``f`` down the sublanes; there the 128-point
  DFT is a VPU FFT too (:func:`_vpu_dft128`: 16 points across vregs, a twiddle, a swap of
  sublanes and a leading axis, 8 points across vregs), in f32 and with no matmul passes.
  At ``"bfloat16"`` one MXU pass is cheaper, so stage 2 is the matmul and its ``[r, k1]``
  tiles are transposed instead. A swap of ``k2`` and ``k1`` then lines up each 128-wide
  output chunk, which is transposed back.
* *16-row blocks* (otherwise): ``Y`` is stored in ``(row, k2)`` order by a sublane-strided
  store, stage 2 is the matmul, and each row's ``[S, 128]`` result is transposed.

*One stage* (``N <= 512``, any length): ``X = A @ F_N``, a dense DFT matmul on the block.

*Why butterflies on the VPU, and when the MXU.* An FFT needs ~5 log2(N) flops per element;
a DFT matmul stage needs ~6 x 128 per element and pass, and float32 accuracy takes six bf16
passes (each with its operand splits and sums on the VPU). The VPU's rate is far below the
MXU's, but a butterfly across whole vregs costs one VPU operation per flop and moves no
data, so where the layout puts the transform's axis across vregs (the chunks for stage 1;
the sublanes, after a tile transpose, for stage 2) the butterflies win at every precision
but one bf16 pass. Across the lanes a butterfly would need lane shuffles, so the 16-row
route keeps the matmul there. The trade-offs are measured in the FFT notebook.

*Complex products: 3 real matmuls (Gauss), not 4.* ``(Xr + i Xi) @ (Fr + i Fi)`` is
``P1 = (Xr + Xi) @ Fr``, ``P2 = Xr @ (Fi - Fr)``, ``P3 = Xi @ (Fr + Fi)``, real part
``P1 - P3``, imaginary ``P1 + P2``. The matrix sums are precomputed; the data sum is one
VPU add per element. The MXU is the bottleneck at 128-point stages, and every precision
pass multiplies its work, so one product saved is 25% of the matmul time in every mode
(the sums cost a little accuracy; the errors below include it).

*Precision* (``precision=``) sets the passes of each matmul; the butterflies are f32 at
every precision, so on the 128-row route ``"high"`` and ``"highest"`` both give float32
accuracy (no matmul at all). Errors as ``max |error| / max |X|`` against float64 NumPy at
N = 1024 to 4096 on the 16-row route (interpret mode): ``"bfloat16"``, one bf16 pass (data and matrices rounded to
bf16, f32 accumulation; ~4e-3); ``"high"``, bf16x3 (each operand split into a high and a
low bf16 piece, ``hi*hi + hi*lo + lo*hi``; ~1e-5); ``"highest"`` (default), bf16x6 (three
pieces each, the six products down to 2^-24, smallest first; ~2e-7, float32 level). The
matrices are split on the host (rounding); the data in the kernel by truncating the f32 bit
pattern (the top 16 bits are exactly a bf16, the rest exactly an f32). An f32 matmul at
``Precision.HIGHEST`` (Mosaic's own 6-pass emulation) measured the same cost and a larger
error (6e-7), and a split by rounding through bf16 and back made libtpu's cost model abort.

*Matrices.* The DFT matrices, their Gauss sums, the twiddles and their bf16 splits are
built in float64 NumPy once per ``(N, direction, scale, precision)`` and cached
(:func:`_matrices`); a call passes them to the kernel as inputs with a constant block
index, so each is DMAed to VMEM once per kernel launch.

*Longer transforms* (``N > 65536``, up to ``2^20`` and beyond): ``N = N1 * N2`` with both
halves handled by the kernel above; the same four-step factorisation one level up, with
the transposes and the twiddle done by XLA between two kernel calls (several HBM round
trips: the data no longer fits a VMEM block). Lengths above 512 that are not multiples of
128 but split into two one-call lengths (``1000 = 25 * 40``) take the same path.

*Other lengths.* The kernel takes any ``N <= 512``, any multiple of 128 up to 65536 and
products of two such lengths (so lengths with factors 2, 3, 5, 7 are covered in those
ranges); others (a prime above 512) raise ``NotImplementedError`` from the Pallas path,
and ``implementation=None`` falls back to ``jnp.fft`` (XLA).

*Backward* (``custom_vjp``). A DFT is linear: on the real planes the transpose of
``x -> c F x`` is ``g -> c conj(F) g``, the same kernel in the other direction with the
same scale. complex64 inputs go through the planes, so JAX's complex convention comes out
right by itself.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.base import calls
from kernels.base import tiling
from kernels.base.backend import dispatch, target_chip
from kernels.base.errors import NoImplementationError, check
from kernels.base.hardware import get_chip
from kernels.fourier.sharded import partitioned

__all__ = ["fft", "ifft", "rfft", "irfft", "fft2", "ifft2", "rfft2", "irfft2",
           "PRECISIONS", "block_max", "plan", "supported_length", "vpu_stage1"]

PRECISIONS = ("bfloat16", "high", "highest")
NORMS = (None, "backward", "ortho", "forward")
LANES = 128
DENSE_MAX = 512  # one dense stage up to here
LOOP_ABOVE = 128  # MXU stage 1: a loop over rows (not unrolled) above this S
LANE_ROWS = 128  # rows per block on the transposing path: one row per lane
TWO_STAGE_MAX = 128 * 512  # S = N / 128 <= 512


def block_max(chip=None) -> int:
  """The longest two-stage length whose 8-row block fits ``chip``'s VMEM (65536, or 16384 on v4's 16 MiB)."""
  c = get_chip(chip or "v5e")
  usable = ((c.vmem_bytes - (1 << 20)) / 1.25) * 0.9
  return max(DENSE_MAX, min(TWO_STAGE_MAX, int(usable // (8 * _vmem_per_row(1))) // LANES * LANES))


def _block_length(n: int, nmax: int) -> bool:
  return 1 <= n <= DENSE_MAX or (n % LANES == 0 and n <= nmax)


def supported_length(n: int, chip=None) -> bool:
  """True when the Pallas kernel takes length ``n`` on ``chip`` (else the XLA fallback serves it):
  ``n <= 512``, or a multiple of 128 up to :func:`block_max` in one call, or a product of two such
  lengths (two calls)."""
  nmax = block_max(chip)
  return _block_length(n, nmax) or _long_split(n, nmax) is not None


@functools.lru_cache(maxsize=256)
def _long_split(n: int, nmax: int | None = None):
  """``(N1, N2)`` with ``N1 * N2 = n``, both one-call lengths, as balanced as possible; or None."""
  nmax = nmax or block_max()
  best = None
  for n1 in range(2, min(n, nmax) + 1):
    if n % n1 == 0 and _block_length(n1, nmax) and _block_length(n // n1, nmax):
      if best is None or abs(math.log(n1 / (n // n1))) < abs(math.log(best[0] / best[1])):
        best = (n1, n // n1)
  return best


# ---------------------------------------------------------------------------------
# Precomputed matrices (float64 NumPy, cached)
# ---------------------------------------------------------------------------------


def _phase(n: int, a, b, inverse: bool):
  """``exp(-+2 pi i a b / n)`` in float64, with ``a b`` reduced mod ``n`` in integers."""
  ab = (np.asarray(a, np.int64) * np.asarray(b, np.int64)) % n
  ang = (2 * np.pi / n) * ab * (1 if inverse else -1)
  return np.cos(ang), np.sin(ang)


_PARTS = {"bfloat16": 1, "high": 2, "highest": 3}  # bf16 pieces per operand


def _split(m: np.ndarray, precision: str) -> tuple:
  """One matrix as the kernel's operands in ``precision``: 1, 2 or 3 bf16 pieces summing to it."""
  parts, rest = [], np.asarray(m, np.float64)
  for _ in range(_PARTS[precision]):
    part = rest.astype(np.float32).astype(jnp.bfloat16)
    parts.append(part)
    rest = rest - part.astype(np.float64)
  return tuple(parts)


def _gauss(fr: np.ndarray, fi: np.ndarray, precision: str) -> tuple:
  """The three matrices of a Gauss complex product, ``(Fr, Fi - Fr, Fr + Fi)``, split for ``precision``."""
  return tuple(_split(m, precision) for m in (fr, fi - fr, fr + fi))


@functools.lru_cache(maxsize=64)
def _matrices(n: int, inverse: bool, scale: float, precision: str, path: str = "mxu") -> tuple:
  """The kernel's constant inputs for length ``n``: (stage-1 DFT, twiddle planes, stage-2 DFT),
  each DFT as Gauss triples of split matrices, without the stage-1 DFT when stage 1 runs on
  the VPU. The ``norm`` scale multiplies the last step that is not a matmul operand split (the
  twiddle; the dense DFT itself with one stage)."""
  if n <= DENSE_MAX:
    j = np.arange(n)
    fr, fi = _phase(n, j[:, None], j[None, :], inverse)
    return (_gauss(fr * scale, fi * scale, precision),)
  s = n // LANES
  tr, ti = _phase(n, np.arange(s)[:, None], np.arange(LANES)[None, :], inverse)  # [k2, f]
  tw = (np.asarray(tr * scale, np.float32), np.asarray(ti * scale, np.float32))
  j = np.arange(LANES)
  f2 = _gauss(*_phase(LANES, j[:, None], j[None, :], inverse), precision)
  if stage2_on_vpu(path, precision):  # stage 2 on the VPU: its twiddle W_128^(b k_a) at row 8 k_a + b
    ka, b = np.divmod(np.arange(LANES), 8)
    tw2 = tuple(np.repeat(np.asarray(p, np.float32)[:, None], LANES, axis=1) for p in _phase(LANES, ka, b, inverse))
    return (tw, tw2)
  if vpu_stage1(n):
    return (tw, f2)
  j = np.arange(s)
  return (_gauss(*_phase(s, j[:, None], j[None, :], inverse), precision), tw, f2)


# ---------------------------------------------------------------------------------
# The kernel
# ---------------------------------------------------------------------------------


def _pieces(a, precision: str) -> list:
  """f32 data ``a`` as 1, 2 or 3 bf16 pieces summing to it: the top 16 bits of the f32 pattern
  are exactly a bf16 and the rest is exactly an f32, so truncation splits without rounding."""
  parts, rest = [], a
  for i in range(_PARTS[precision]):
    if i + 1 < _PARTS[precision]:
      top = lax.bitcast_convert_type(lax.bitcast_convert_type(rest, jnp.uint32) & jnp.uint32(0xFFFF0000),
                                     jnp.float32)
      parts.append(top.astype(jnp.bfloat16))
      rest = rest - top
    else:
      parts.append(rest.astype(jnp.bfloat16))
  return parts


def _dot(a, mats, precision: str, left: bool):
  """``m @ a`` (left) or ``a @ m`` for f32 data ``a`` and a matrix given as bf16 pieces ``mats``.

  The data is split the same way (``a = a1 + a2 + a3``, each bf16) and the products whose
  pieces' scales add to at most 2^-16 (bf16x3) or 2^-24 (bf16x6) are summed, smallest first;
  each is one bf16 MXU pass with f32 accumulation.
  """
  def mm(x, m):
    x, m = calls.mxu_operands(x, m)  # f32 in interpret mode (XLA:CPU's bf16 dots)
    return jnp.dot(m, x, preferred_element_type=jnp.float32) if left else \
        jnp.dot(x, m, preferred_element_type=jnp.float32)
  parts = _pieces(a, precision)
  if precision == "bfloat16":
    return mm(parts[0], mats[0])
  if precision == "high":
    return mm(parts[0], mats[0]) + (mm(parts[1], mats[0]) + mm(parts[0], mats[1]))
  a1, a2, a3 = parts
  m1, m2, m3 = mats
  small = (mm(a1, m3) + mm(a3, m1)) + mm(a2, m2)
  return mm(a1, m1) + ((mm(a1, m2) + mm(a2, m1)) + small)


def _cmul_mat(xr, xi, g, precision: str, left: bool):
  """Complex ``F @ X`` (left) or ``X @ F`` with Gauss's three real products; ``g`` = (Fr, Fi-Fr, Fr+Fi)."""
  p1 = _dot(xr + xi, g[0], precision, left)
  p2 = _dot(xr, g[1], precision, left)
  p3 = _dot(xi, g[2], precision, left)
  return p1 - p3, p1 + p2


def vpu_factors(s: int):
  """``s`` as the radices the VPU FFT uses (4 first, then 2, 3, 5, 7), or None if another prime divides it."""
  out = []
  for p in (4, 2, 3, 5, 7):
    while s % p == 0 and s > 1:
      out.append(p)
      s //= p
  return out if s == 1 else None


def vpu_stage1(n: int) -> bool:
  """True when stage 1 of length ``n`` runs on the VPU: two stages with ``S = n / 128`` a power of two."""
  s = n // LANES
  return n > DENSE_MAX and n % LANES == 0 and s & (s - 1) == 0


def _root(n: int, e: int, inverse: bool) -> tuple:
  """``exp(-+2 pi i e / n)`` as two Python floats, exact at multiples of a quarter turn."""
  e %= n
  if (4 * e) % n == 0:
    c, s = ((1.0, 0.0), (0.0, -1.0), (-1.0, 0.0), (0.0, 1.0))[4 * e // n]
    return c, -s if inverse else s
  ang = 2 * math.pi * e / n * (1 if inverse else -1)
  return math.cos(ang), math.sin(ang)


def _add(x, y):
  return x if y is None else y if x is None else x + y


def _sub(x, y):
  return x if y is None else -y if x is None else x - y


def _neg(x):
  return None if x is None else -x


def _cmul(a, b, c, d):
  """``(a + ib) (c + id)`` for arrays (``a`` or ``b`` None: zero)."""
  mul = lambda x, y: None if x is None else x * y  # noqa: E731
  return _sub(mul(a, c), mul(b, d)), _add(mul(a, d), mul(b, c))


def _twiddle(xr: list, xi: list, tw, rows: int = 1) -> list:
  """``(xr[k] + i xi[k])`` times rows ``rows k .. rows (k + 1)`` of the twiddle planes ``tw``, for each ``k``."""
  tr, ti = tw
  return [_cmul(a, b, tr[rows * k:rows * (k + 1)], ti[rows * k:rows * (k + 1)]) for k, (a, b) in enumerate(zip(xr, xi))]


def _cscale(a, b, c: float, d: float):
  """``(a + ib) (c + id)`` for arrays ``a``, ``b`` (None: zero) and constants ``c``, ``d``;
  multiplying by 1, -1 or +-i is free."""
  if d == 0.0 and c in (1.0, -1.0):
    return (a, b) if c == 1.0 else (_neg(a), _neg(b))
  if c == 0.0 and d in (1.0, -1.0):
    return (_neg(b), a) if d == 1.0 else (b, _neg(a))
  return _cmul(a, b, c, d)


def _vpu_fft(xr: list, xi: list, inverse: bool) -> tuple:
  """The DFT of the sequence ``xr[j] + i xi[j]`` (a count of f32 arrays with factors 2, 3, 5, 7), in natural order.

  Mixed-radix decimation in time (:func:`vpu_factors`: radix 4 first, then 2, 3, 5, 7; the
  last three as small dense DFTs with constant coefficients). Every twiddle is one constant
  for a whole array, so on TPU this is f32 vreg arithmetic with no lane or sublane movement;
  the index shuffles of the recursion are Python list slicing, which moves no data. ``None``
  stands for a zero array (zero padding, a real input) and costs nothing."""
  n = len(xr)
  if n == 1:
    return list(xr), list(xi)
  p = vpu_factors(n)[0]
  m = n // p
  subs = [_vpu_fft(xr[q::p], xi[q::p], inverse) for q in range(p)]
  outr, outi = [None] * n, [None] * n
  for k in range(m):
    a = [_cscale(subs[q][0][k], subs[q][1][k], *_root(n, q * k, inverse)) for q in range(p)]
    if p == 2:
      (ar, ai), (br, bi) = a
      outr[k], outi[k], outr[k + m], outi[k + m] = _add(ar, br), _add(ai, bi), _sub(ar, br), _sub(ai, bi)
      continue
    if p != 4:  # 3, 5, 7: a small dense DFT with constant coefficients
      for t in range(p):
        acc = a[0]
        for q in range(1, p):
          c = _cscale(*a[q], *_root(p, q * t, inverse))
          acc = (_add(acc[0], c[0]), _add(acc[1], c[1]))
        outr[k + m * t], outi[k + m * t] = acc
      continue
    (a0r, a0i), (a1r, a1i), (a2r, a2i), (a3r, a3i) = a
    b0r, b0i, b1r, b1i = _add(a0r, a2r), _add(a0i, a2i), _sub(a0r, a2r), _sub(a0i, a2i)
    b2r, b2i, b3r, b3i = _add(a1r, a3r), _add(a1i, a3i), _sub(a1r, a3r), _sub(a1i, a3i)
    tr, ti = (_neg(b3i), b3r) if inverse else (b3i, _neg(b3r))  # W_4 b3: -i b3 forward, +i b3 inverse
    outr[k], outi[k] = _add(b0r, b2r), _add(b0i, b2i)
    outr[k + 2 * m], outi[k + 2 * m] = _sub(b0r, b2r), _sub(b0i, b2i)
    outr[k + m], outi[k + m] = _add(b1r, tr), _add(b1i, ti)
    outr[k + 3 * m], outi[k + 3 * m] = _sub(b1r, tr), _sub(b1i, ti)
  return outr, outi


def stage2_on_vpu(path: str, precision: str) -> bool:
  """True when stage 2 runs on the VPU too: 128-row blocks, at ``"high"`` or ``"highest"`` (at
  ``"bfloat16"`` one MXU pass is cheaper than the VPU's 128-point FFT)."""
  return path == "vpu_lanes" and precision != "bfloat16"


def _two_stage_vpu(x_refs, o_refs, scratch, tw, stage2, *, n: int, rows: int, precision: str, inverse: bool,
                   lane_rows: bool):
  """Stage 1 on the VPU; the twiddle; stage 2 and the transpose into natural order (see the module doc)."""
  s = n // LANES
  xr_ref, xi_ref = x_refs
  ar, ai = _vpu_fft([xr_ref[:, j * LANES:(j + 1) * LANES] for j in range(s)],
                    [xi_ref[:, j * LANES:(j + 1) * LANES] for j in range(s)], inverse)
  ys = _twiddle(ar, ai, tw)  # [r, f] for each k2
  if not lane_rows:  # 16-row blocks: the stage-2 operand in (r, k2) row order by a strided store, then per row
    for k2, y in enumerate(ys):
      for part, ref in zip(y, scratch):
        ref[pl.ds(k2, rows, stride=s), :] = part
    zs = _cmul_mat(scratch[0][...], scratch[1][...], stage2, precision, left=False)  # Z[r, k2, k1]
    for z, o_ref in zip(zs, o_refs):
      o_ref[...] = jnp.swapaxes(z.reshape(rows, s, LANES), 1, 2).reshape(rows, n)
    return
  if precision == "bfloat16":  # one MXU pass over rows (k2, r), each k2's [r, k1] then transposed
    zs = _cmul_mat(jnp.concatenate([y[0] for y in ys]), jnp.concatenate([y[1] for y in ys]), stage2, precision,
                   left=False)
    cols = [[z[k2 * rows:(k2 + 1) * rows].T for z in zs] for k2 in range(s)]
  else:
    cols = [_vpu_dft128(y[0].T, y[1].T, stage2, inverse) for y in ys]
  for part, o_ref in enumerate(o_refs):  # [k2, k1, r] -> rows k = S k1 + k2: chunk j is rows 128 j .. 128 j + 127
    u = jnp.swapaxes(jnp.stack([c[part] for c in cols]), 0, 1).reshape(s, LANES, rows)
    for j in range(s):
      o_ref[:, j * LANES:(j + 1) * LANES] = u[j].T


def _vpu_dft128(yr, yi, tw, inverse: bool) -> list:
  """The 128-point DFT down the sublanes of ``[128 f, lanes]`` planes, on the VPU, in natural order.

  ``f = 8 a + b``: a 16-point FFT across the 16 vregs ``a``, the twiddle ``W_128^(b k_a)``
  (``tw``, row ``8 k_a + b``), a swap of ``a`` and ``b`` (sublanes to a leading axis) and an
  8-point FFT across ``b``, which leaves ``k = k_a + 16 k_b`` in row order."""
  vr, vi = _vpu_fft([yr[8 * a:8 * a + 8] for a in range(16)], [yi[8 * a:8 * a + 8] for a in range(16)], inverse)
  v = _twiddle(vr, vi, tw, rows=8)
  vr, vi = (jnp.swapaxes(jnp.stack([t[part] for t in v]), 0, 1) for part in (0, 1))  # [b, k_a, lanes]
  wr, wi = _vpu_fft([vr[b] for b in range(8)], [vi[b] for b in range(8)], inverse)
  return [jnp.concatenate(wr), jnp.concatenate(wi)]


def _kernel(*refs, n: int, rows: int, precision: str, layout, path: str = "mxu", inverse: bool = False):
  """One block of ``rows`` rows: refs are the matrices (flattened by ``layout``), x planes, out planes, scratch."""
  nm = sum(layout)
  mats, (xr_ref, xi_ref, or_ref, oi_ref), scratch = refs[:nm], refs[nm:nm + 4], refs[nm + 4:]
  vals = [m[...] for m in mats]
  groups, i = [], 0
  for c in layout:
    groups.append(vals[i:i + c])
    i += c
  k = len(_split(np.zeros(1), precision))

  def gauss(flat):
    return tuple(tuple(flat[j * k:(j + 1) * k]) for j in range(3))

  if n <= DENSE_MAX:
    yr, yi = _cmul_mat(xr_ref[...], xi_ref[...], gauss(groups[0]), precision, left=False)
    or_ref[...] = yr
    oi_ref[...] = yi
    return
  if path != "mxu":
    stage2 = groups[1] if stage2_on_vpu(path, precision) else gauss(groups[1])
    _two_stage_vpu((xr_ref, xi_ref), (or_ref, oi_ref), scratch, groups[0], stage2, n=n, rows=rows,
                   precision=precision, inverse=inverse, lane_rows=path == "vpu_lanes")
    return
  s = n // LANES
  f1, f2 = gauss(groups[0]), gauss(groups[2])
  tr, ti = groups[1]
  yr_ref, yi_ref = scratch
  def stage1(ar, ai):  # an S-point DFT down the sublanes of one row, then the twiddle (times the norm scale)
    yr, yi = _cmul_mat(ar, ai, f1, precision, left=True)
    return yr * tr - yi * ti, yr * ti + yi * tr

  if s <= LOOP_ABOVE:  # unrolled: the MXU work of consecutive rows overlaps
    ar = xr_ref[...].reshape(rows, s, LANES)
    ai = xi_ref[...].reshape(rows, s, LANES)
    for r in range(rows):
      yr_ref[r], yi_ref[r] = stage1(ar[r], ai[r])
  else:  # a loop over rows in place (each row's matmuls are long enough; the compile stays small)
    yr_ref[...] = xr_ref[...].reshape(rows, s, LANES)
    yi_ref[...] = xi_ref[...].reshape(rows, s, LANES)

    def body(r, carry):
      yr_ref[r], yi_ref[r] = stage1(yr_ref[r], yi_ref[r])
      return carry
    lax.fori_loop(0, rows, body, 0, unroll=2)
  yr = yr_ref[...].reshape(rows * s, LANES)
  yi = yi_ref[...].reshape(rows * s, LANES)
  zr, zi = _cmul_mat(yr, yi, f2, precision, left=False)  # stage 2: 128-point DFTs, M = every row
  or_ref[...] = jnp.swapaxes(zr.reshape(rows, s, LANES), 1, 2).reshape(rows, n)
  oi_ref[...] = jnp.swapaxes(zi.reshape(rows, s, LANES), 1, 2).reshape(rows, n)


def _vmem_per_row(n: int, path: str = "mxu") -> int:
  """VMEM bytes a block row needs: 4 planes double-buffered + the stage scratch and temporaries
  (more temporaries on the 128-row path: its stacks and swaps)."""
  return 4 * n * (4 * 2 + (4 if path == "vpu_lanes" else 2) + 8)


def _budget(c) -> int:
  return min(c.vmem_bytes // 2, 48 << 20)


def plan(batch: int, n: int, chip=None) -> tuple:
  """``(path, rows)``: the kernel path for length ``n`` and the rows per grid step.

  ``"dense"`` (one stage); ``"vpu_lanes"`` (stage 1 on the VPU, 128 rows a block so the
  transpose works on whole 128 x 128 tiles; S <= 128, a batch of at least 128, when it fits
  VMEM); ``"vpu"`` (stage 1 on the VPU, 16 rows); ``"mxu"`` (stage 1 as DFT matmuls, for S
  not a power of two). Rows are a multiple of 8, or the whole batch, within ``chip``'s VMEM."""
  c = get_chip(chip or "v5e")
  if n <= DENSE_MAX:
    path, cap = "dense", 256
  elif not vpu_stage1(n):
    path, cap = "mxu", 16  # its stage-1 loop is unrolled per row
  elif n // LANES <= LANES and batch >= LANE_ROWS and LANE_ROWS * _vmem_per_row(n, "vpu_lanes") <= _budget(c):
    return "vpu_lanes", LANE_ROWS
  else:
    path, cap = "vpu", 16
  r = max(8, min(cap, _budget(c) // _vmem_per_row(n, path) // 8 * 8))
  return path, batch if batch <= r else r


def block_rows(batch: int, n: int, chip=None) -> int:
  """Rows per grid step (see :func:`plan`)."""
  return plan(batch, n, chip)[1]


def _mat_inputs(n, inverse, scale, precision, path="mxu"):
  mats = _matrices(n, inverse, scale, precision, path)
  flat, layout = [], []
  for group in mats:
    if isinstance(group[0], tuple):  # a Gauss triple of split matrices
      items = [m for part in group for m in part]
    else:
      items = list(group)
    flat += items
    layout.append(len(items))
  return [jnp.asarray(m) for m in flat], tuple(layout)


def _fft_rows(xr, xi, *, inverse: bool, scale: float, precision: str, interpret):
  """The kernel on ``[B, N]`` f32 planes (N a kernel length), no autodiff."""
  batch, n = xr.shape
  chip = target_chip()
  path, rows = plan(batch, n, chip)
  mats, layout = _mat_inputs(n, inverse, scale, precision, path)
  full = lambda m: pl.BlockSpec(m.shape, lambda i: (0,) * m.ndim)  # noqa: E731
  row = pl.BlockSpec((rows, n), lambda i: (i, 0))
  s = n // LANES
  scratch = {"dense": [], "mxu": [pltpu.VMEM((rows, s, LANES), jnp.float32)] * 2,
             "vpu": [pltpu.VMEM((rows * s, LANES), jnp.float32)] * 2, "vpu_lanes": []}[path]
  mat_bytes = sum(int(m.size) * m.dtype.itemsize for m in mats)
  need = _vmem_per_row(n, path) * rows + 2 * mat_bytes
  limit = tiling.vmem_limit(need, chip or "v5e", argument="n", value=n)
  passes = {"bfloat16": 1, "high": 3, "highest": 6}[precision]
  inner = 0 if stage2_on_vpu(path, precision) else {"dense": n, "mxu": s + LANES}.get(path, LANES)
  flops = 3 * 2 * batch * n * inner * passes  # the MXU's share
  out = calls.pallas_call(
      functools.partial(_kernel, n=n, rows=rows, precision=precision, layout=layout, path=path, inverse=inverse),
      grid=(tiling.cdiv(batch, rows),),
      in_specs=[full(m) for m in mats] + [row, row],
      out_specs=[row, row],
      out_shape=[jax.ShapeDtypeStruct((batch, n), jnp.float32)] * 2,
      scratch_shapes=scratch,
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",), vmem_limit_bytes=limit),
      cost_estimate=pl.CostEstimate(flops=flops, transcendentals=0, bytes_accessed=16 * batch * n + mat_bytes),
      interpret=interpret, name="ifft" if inverse else "fft")(*mats, xr, xi)
  return out[0], out[1]


def _long_rows(xr, xi, *, inverse, scale, precision, interpret, split=None):
  """``N = N1 * N2`` beyond one block: four-step with XLA transposes between two kernel calls.

  With ``n = N2 a + b`` (``a < N1``, ``b < N2``) and ``k = c + N1 d``:
  ``X[c + N1 d] = sum_b W_N2^(b d) W_N^(b c) sum_a W_N1^(a c) x[N2 a + b]``.
  """
  batch, n = xr.shape
  n1, n2 = split or _long_split(n, block_max(target_chip()))
  xr = jnp.swapaxes(xr.reshape(batch, n1, n2), 1, 2).reshape(batch * n2, n1)
  xi = jnp.swapaxes(xi.reshape(batch, n1, n2), 1, 2).reshape(batch * n2, n1)
  yr, yi = _fft_rows(xr, xi, inverse=inverse, scale=1.0, precision=precision, interpret=interpret)  # [(B, b), c]
  tr, ti = _phase(n, np.arange(n2)[:, None], np.arange(n1)[None, :], inverse)  # [b, c]
  tr, ti = jnp.asarray(tr * scale, jnp.float32), jnp.asarray(ti * scale, jnp.float32)
  yr, yi = yr.reshape(batch, n2, n1), yi.reshape(batch, n2, n1)
  yr, yi = yr * tr - yi * ti, yr * ti + yi * tr
  yr = jnp.swapaxes(yr, 1, 2).reshape(batch * n1, n2)
  yi = jnp.swapaxes(yi, 1, 2).reshape(batch * n1, n2)
  zr, zi = _fft_rows(yr, yi, inverse=inverse, scale=1.0, precision=precision, interpret=interpret)  # [(B, c), d]
  zr = jnp.swapaxes(zr.reshape(batch, n1, n2), 1, 2).reshape(batch, n)
  zi = jnp.swapaxes(zi.reshape(batch, n1, n2), 1, 2).reshape(batch, n)
  return zr, zi


def _transform(xr, xi, *, inverse, scale, precision, interpret):
  # two calls beyond one block, and for lengths above 512 that are not multiples of 128 (1000 = 8 x 125)
  if not _block_length(xr.shape[-1], block_max(target_chip())):
    return _long_rows(xr, xi, inverse=inverse, scale=scale, precision=precision, interpret=interpret)
  return _fft_rows(xr, xi, inverse=inverse, scale=scale, precision=precision, interpret=interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _planes(xr, xi, inverse, scale, precision, interpret):
  return _transform(xr, xi, inverse=inverse, scale=scale, precision=precision, interpret=interpret)


def _planes_fwd(xr, xi, inverse, scale, precision, interpret):
  return _planes(xr, xi, inverse, scale, precision, interpret), None


def _planes_bwd(inverse, scale, precision, interpret, _, ct):
  gr, gi = ct
  gr, gi = _transform(gr.astype(jnp.float32), gi.astype(jnp.float32), inverse=not inverse, scale=scale,
                      precision=precision, interpret=interpret)
  return gr, gi


_planes.defvjp(_planes_fwd, _planes_bwd)


# ---------------------------------------------------------------------------------
# Validation and the public API
# ---------------------------------------------------------------------------------


def _is_array(x) -> bool:
  return hasattr(x, "shape") and hasattr(x, "dtype")


@dataclasses.dataclass(frozen=True)
class _Input:
  planes: bool  # a (real, imag) pair
  real: bool  # a real array (no imaginary part)
  dtype: jnp.dtype  # of the plane / real array, or complex dtype
  shape: tuple


def _validate(x, name: str = "x", *, complex_required: bool = False) -> _Input:
  if isinstance(x, (tuple, list)):
    check(len(x) == 2 and all(_is_array(v) for v in x), name, x,
          "a tuple must be the (real, imaginary) pair of float planes: two arrays")
    check(tuple(x[0].shape) == tuple(x[1].shape) and x[0].dtype == x[1].dtype, name, x,
          "its real and imaginary planes must have the same shape and dtype")
    d = jnp.dtype(x[0].dtype)
    check(jnp.issubdtype(d, jnp.floating), name, x, f"planes must be real floating point, not {d.name}")
    return _Input(True, False, d, tuple(x[0].shape))
  check(_is_array(x), name, x, "must be an array (or a (real, imaginary) pair of float planes)")
  d = jnp.dtype(x.dtype)
  is_complex = jnp.issubdtype(d, jnp.complexfloating)
  check(is_complex or jnp.issubdtype(d, jnp.floating) or jnp.issubdtype(d, jnp.integer), name, x,
        f"dtype {d.name} is not supported: pass complex64, a real float array or a (real, imag) pair")
  if complex_required:
    check(is_complex, name, x, f"must be complex (complex64) or a (real, imag) pair of planes, not {d.name}")
  return _Input(False, not is_complex, d, tuple(x.shape))


def _check_common(inp: _Input, name, x, n, axis, norm, precision):
  check(len(inp.shape) >= 1, name, x, "must have at least one dimension")
  check(norm in NORMS, "norm", norm, 'must be None, "backward", "ortho" or "forward"')
  check(precision in PRECISIONS, "precision", precision, f"must be one of {PRECISIONS}")
  check(isinstance(axis, int) and not isinstance(axis, bool) and -len(inp.shape) <= axis < len(inp.shape),
        "axis", axis, f"must be an int in [-{len(inp.shape)}, {len(inp.shape)})")
  if n is not None:
    check(isinstance(n, int) and not isinstance(n, bool) and n >= 1, "n", n, "must be a positive int or None")


def _scale(norm, n: int, inverse: bool) -> float:
  if norm == "ortho":
    return 1.0 / math.sqrt(n)
  if (norm in (None, "backward")) == inverse:
    return 1.0 / n
  return 1.0


def _resize(v, n: int, axis: int):
  """Zero-pad or truncate ``v`` to ``n`` along ``axis`` (as ``jnp.fft`` does with ``n=``)."""
  m = v.shape[axis]
  if n == m:
    return v
  if n < m:
    return lax.slice_in_dim(v, 0, n, axis=axis)
  pad = [(0, 0)] * v.ndim
  pad[axis] = (0, n - m)
  return jnp.pad(v, pad)


def _pallas_1d(xr, xi, *, n, axis, inverse, scale, precision, interpret):
  """Planes in, planes out, along ``axis`` (length ``n`` after padding), through the kernel."""
  chip = target_chip()
  if not supported_length(n, chip):
    raise NotImplementedError(f"the Pallas FFT takes lengths <= {DENSE_MAX}, multiples of {LANES} up to "
                              f"{block_max(chip)} and products of two such lengths; not n={n}")
  xr, xi = (_resize(v.astype(jnp.float32), n, axis) for v in (xr, xi))
  xr, xi = jnp.moveaxis(xr, axis, -1), jnp.moveaxis(xi, axis, -1)
  shape = xr.shape
  yr, yi = _planes(xr.reshape(-1, n), xi.reshape(-1, n), inverse, scale, precision, interpret)
  return jnp.moveaxis(yr.reshape(shape), -1, axis), jnp.moveaxis(yi.reshape(shape), -1, axis)


def _xla_1d(xr, xi, *, n, axis, inverse, scale, precision):
  """``jnp.fft`` (XLA's FFT) with the kernel's conventions: unscaled transform times ``scale``."""
  del precision
  x = lax.complex(xr, xi)
  y = jnp.fft.ifft(x, n=n, axis=axis, norm="forward") if inverse else jnp.fft.fft(x, n=n, axis=axis)
  y = y * scale if scale != 1.0 else y
  return jnp.real(y), jnp.imag(y)


def _complex_transform(x, n, axis, norm, precision, implementation, interpret, *, inverse: bool, name: str):
  inp = _validate(x, complex_required=False)
  _check_common(inp, "x", x, n, axis, norm, precision)
  axis = axis % len(inp.shape)
  check(n is not None or inp.shape[axis] >= 1, "x", x, f"axis {axis} is empty: nothing to transform (pass n to pad)")
  n = inp.shape[axis] if n is None else n
  check(n >= 1, "n", n, "must be positive")
  scale = _scale(norm, n, inverse)
  if inp.planes:
    xr, xi = x
  elif inp.real:
    xr = x if jnp.issubdtype(inp.dtype, jnp.floating) else x.astype(jnp.float32)
    xi = jnp.zeros_like(xr)
  else:
    xr, xi = jnp.real(x), jnp.imag(x)
  try:
    yr, yi = dispatch(
        name, xr, xi,
        pallas=lambda a, b, interpret: _pallas_1d(a, b, n=n, axis=axis, inverse=inverse, scale=scale,
                                                  precision=precision, interpret=interpret),
        xla=lambda a, b: _xla_1d(a, b, n=n, axis=axis, inverse=inverse, scale=scale, precision=precision),
        implementation=implementation, interpret=interpret)
  except NoImplementationError as e:
    if supported_length(n, target_chip()):
      raise
    raise NoImplementationError(name, e.reasons, argument="n", value=n) from e
  if inp.planes:
    return yr, yi
  return lax.complex(yr, yi)


@partitioned("fft")
def fft(x, n=None, axis=-1, norm=None, *, precision="highest", implementation=None, interpret=None):
  """The discrete Fourier transform along ``axis``, as ``jnp.fft.fft``, computed on the MXU.

  Args:
    x: complex64 (or a real array, promoted), or the **native form**: a ``(real, imag)`` pair
      of float32 planes of one shape (no complex array is ever built; the result is a pair).
    n, axis, norm: as ``jnp.fft.fft`` (``n`` zero-pads or truncates).
    precision: ``"highest"`` (f32-level, default), ``"high"`` (bf16x3) or ``"bfloat16"``
      (one bf16 pass).
    implementation, interpret: see :func:`kernels.dispatch`. Lengths the kernel does not
      take (see :func:`supported_length`) run on ``jnp.fft`` with ``implementation=None``.

  Returns:
    complex64 like ``jnp.fft.fft``, or a ``(real, imag)`` pair for a pair. Differentiable
    (the backward pass is the conjugate transform, the same kernel).
  """
  return _complex_transform(x, n, axis, norm, precision, implementation, interpret, inverse=False, name="fft")


@partitioned("ifft")
def ifft(x, n=None, axis=-1, norm=None, *, precision="highest", implementation=None, interpret=None):
  """The inverse DFT along ``axis``, as ``jnp.fft.ifft``; ``x`` must be complex (or a plane pair).

  See :func:`fft` for the arguments; a real array is a :class:`KernelError` (``ifft`` of
  real data is almost always a bug: pass ``(x, zeros)`` to mean it).
  """
  _validate(x, complex_required=True)
  return _complex_transform(x, n, axis, norm, precision, implementation, interpret, inverse=True, name="ifft")


def _real_input(x, name="x"):
  check(_is_array(x), name, x, "must be a real array")
  d = jnp.dtype(x.dtype)
  check(jnp.issubdtype(d, jnp.floating) or jnp.issubdtype(d, jnp.integer), name, x,
        f"must be real (float32, bfloat16 or an integer dtype), not {d.name}")
  return x if jnp.issubdtype(d, jnp.floating) else x.astype(jnp.float32)


@partitioned("rfft")
def rfft(x, n=None, axis=-1, norm=None, *, precision="highest", implementation=None, interpret=None):
  """The DFT of real ``x`` along ``axis``, its ``n // 2 + 1`` non-negative frequencies, as ``jnp.fft.rfft``.

  The kernel transforms ``(x, 0)`` as a complex signal and keeps the first half: twice the
  arithmetic a packed real transform would do. Returns complex64.
  """
  x = _real_input(x)
  check(isinstance(axis, int) and not isinstance(axis, bool) and -x.ndim <= axis < x.ndim, "axis", axis,
        f"must be an int in [-{x.ndim}, {x.ndim})")
  axis = axis % x.ndim
  n = x.shape[axis] if n is None else n
  y = _complex_transform(x, n, axis, norm, precision, implementation, interpret, inverse=False, name="rfft")
  return lax.slice_in_dim(y, 0, n // 2 + 1, axis=axis)


def _hermitian_full(x, n: int, axis: int):
  """The length-``n`` spectrum whose first ``n // 2 + 1`` entries are ``x`` (padded or cut), the rest
  ``conj(x[n - k])``: what ``irfft`` inverts (the imaginary parts at 0 and ``n / 2`` drop out)."""
  m = n // 2 + 1
  x = _resize(x, m, axis)
  tail = lax.slice_in_dim(x, 1, n - m + 1, axis=axis)  # x[1 .. n - m]
  return jnp.concatenate([x, jnp.conj(jnp.flip(tail, axis=axis))], axis=axis)


@partitioned("irfft")
def irfft(x, n=None, axis=-1, norm=None, *, precision="highest", implementation=None, interpret=None):
  """The inverse of :func:`rfft`, as ``jnp.fft.irfft``: a real signal of length ``n`` (default
  ``2 * (m - 1)`` for ``m`` input frequencies). ``x`` must be complex.

  The kernel inverts the full Hermitian spectrum (built by XLA) and keeps the real part.
  """
  inp = _validate(x, complex_required=True)
  if inp.planes:
    x = lax.complex(x[0].astype(jnp.float32), x[1].astype(jnp.float32))
  check(isinstance(axis, int) and not isinstance(axis, bool) and -x.ndim <= axis < x.ndim, "axis", axis,
        f"must be an int in [-{x.ndim}, {x.ndim})")
  axis = axis % x.ndim
  n = 2 * (x.shape[axis] - 1) if n is None else n
  check(isinstance(n, int) and n >= 1, "n", n, "must be a positive int (the output length)")
  full = _hermitian_full(x, n, axis)
  y = _complex_transform(full, n, axis, norm, precision, implementation, interpret, inverse=True, name="irfft")
  return jnp.real(y)


def _axes_and_sizes(x_ndim: int, s, axes):
  if axes is None:
    axes = tuple(range(-len(s), 0)) if s is not None else (-2, -1)
  check(isinstance(axes, (tuple, list)) and all(isinstance(a, int) and not isinstance(a, bool) for a in axes),
        "axes", axes, "must be a sequence of ints")
  axes = tuple(a % x_ndim if -x_ndim <= a < x_ndim else None for a in axes)
  check(None not in axes, "axes", axes, f"every axis must be in [-{x_ndim}, {x_ndim})")
  check(len(set(axes)) == len(axes), "axes", axes, "must not repeat an axis")
  if s is not None:
    check(isinstance(s, (tuple, list)) and len(s) == len(axes), "s", s,
          f"must have one length per axis: {len(axes)} for axes={axes}")
    check(all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in s), "s", s,
          "lengths must be positive ints")
  return axes, (tuple(s) if s is not None else None)


def _ndim(x):
  return x[0].ndim if isinstance(x, (tuple, list)) else x.ndim


@partitioned("fft2")
def fft2(x, s=None, axes=(-2, -1), norm=None, *, precision="highest", implementation=None, interpret=None):
  """The 2-D DFT over ``axes``, as ``jnp.fft.fft2``: :func:`fft` along each axis, last first."""
  _validate(x)
  axes, s = _axes_and_sizes(_ndim(x), s, axes)
  for i in reversed(range(len(axes))):
    x = fft(x, None if s is None else s[i], axes[i], norm, precision=precision, implementation=implementation,
            interpret=interpret)
  return x


@partitioned("ifft2")
def ifft2(x, s=None, axes=(-2, -1), norm=None, *, precision="highest", implementation=None, interpret=None):
  """The 2-D inverse DFT over ``axes``, as ``jnp.fft.ifft2``."""
  _validate(x, complex_required=True)
  axes, s = _axes_and_sizes(_ndim(x), s, axes)
  for i in reversed(range(len(axes))):
    x = ifft(x, None if s is None else s[i], axes[i], norm, precision=precision, implementation=implementation,
             interpret=interpret)
  return x


@partitioned("rfft2")
def rfft2(x, s=None, axes=(-2, -1), norm=None, *, precision="highest", implementation=None, interpret=None):
  """The 2-D DFT of real ``x``, as ``jnp.fft.rfft2``: :func:`rfft` on the last axis, :func:`fft` on the others."""
  x = _real_input(x)
  axes, s = _axes_and_sizes(x.ndim, s, axes)
  kw = dict(precision=precision, implementation=implementation, interpret=interpret)
  x = rfft(x, None if s is None else s[-1], axes[-1], norm, **kw)
  for i in reversed(range(len(axes) - 1)):
    x = fft(x, None if s is None else s[i], axes[i], norm, **kw)
  return x


@partitioned("irfft2")
def irfft2(x, s=None, axes=(-2, -1), norm=None, *, precision="highest", implementation=None, interpret=None):
  """The inverse of :func:`rfft2`, as ``jnp.fft.irfft2``: :func:`ifft` on the leading axes, :func:`irfft` on the last."""
  _validate(x, complex_required=True)
  axes, s = _axes_and_sizes(_ndim(x), s, axes)
  if isinstance(x, (tuple, list)):
    x = lax.complex(x[0].astype(jnp.float32), x[1].astype(jnp.float32))
  kw = dict(precision=precision, implementation=implementation, interpret=interpret)
  for i in range(len(axes) - 1):
    x = ifft(x, None if s is None else s[i], axes[i], norm, **kw)
  return irfft(x, None if s is None else s[-1], axes[-1], norm, **kw)
