"""2-D convolution in Pallas: direct implicit-GEMM kernels and fused Winograd F(2x2,3x3) / F(4x4,3x3).

``conv2d(x, w)`` takes NHWC inputs and HWIO filters and means exactly
``jax.lax.conv_general_dilated(x, w, strides, padding, rhs_dilation=...,
dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=...)``, with an optional
fused ``bias`` and ``activation`` (``y = act(conv + bias)``). :func:`conv2d_reference`
is that XLA call (the fallback path).

Convolution as shifted GEMMs ("direct")
---------------------------------------

Output pixel ``(r, c)`` is ``sum_{dy, dx} x[r s + dy, c s + dx, :] @ w[dy, dx]``: ``kh kw``
matmuls of the *shifted* input against one filter tap each. The kernel never builds the
im2col matrix in HBM. Each grid step ``(batch, output-row block, cout block, cin block)``
holds, in VMEM, the input rows its output rows need (the row block plus a ``kh - 1`` row
halo: overlapping windows fetched with ``pl.Element`` offsets, so the halo is re-read, not
copied) and all of the (padded) width. It forms each tap's ``[rows * width, cin]`` operand by
a strided VMEM load, and accumulates the ``kh kw`` products (bf16 in, f32 out on the MXU) in an
f32 scratch across the cin blocks (the last grid axis, the reduction). The epilogue adds the
bias, applies the activation and writes the block once.

*Why an f32 copy of the input block.* Taps shift the input along W, which lives on
sublanes; an unaligned sublane window of packed bf16 makes libtpu's cost model abort the
process, and a strided one (stride > 1) does not lower ("strided load with non 32-bit
data"). So each step casts its input block to an f32 VMEM scratch once and loads every tap
from it (unaligned and strided loads are native for 32-bit), casting the tap back to the
compute dtype for the MXU. The reshape of a tap ``[rows, width, cin] -> [rows * width, cin]``
needs ``width`` to be a multiple of 8: the output width is padded to one. (Two alternatives were
estimated slower or did not compile: multiplying unshifted bf16 rows and shifting the f32
products, and DMA windows of the input shifted by one column, which are not tile-aligned.)

*Batches of 8 images ("batched").* When the batch is a multiple of 8, the convolution is
stride 1 (undilated, ungrouped) and has at least 128 channels in and out, a second kernel
avoids shifted reads altogether. Each step
takes ``nb`` images and swaps their axis onto the sublanes, row by row
(``[nb, width, c] -> [width, nb, c]`` in VMEM), so that rows and columns are both leading,
untiled axes. Every tap ``(dy, dx)`` is then a slice of leading axes, and its
``[rows * width * nb, cin]`` operand a free reshape, whatever the width (no padding to 8
columns). The output goes back to NHWC by the same swap, row by row. ``nb`` is 8 with an f32
staging buffer (one f32 sublane tile), or 16 for bf16 batches of 16 (one packed bf16 tile),
which stages in bf16 and saves the cast of every tap. A step takes all of ``cin`` unless
VMEM says otherwise (no cin grid axis, no accumulator round trips); ``block_h`` comes from
the shipped ``batched_target_rows``. The ``kh kw`` taps are unrolled: a loop over kernel
rows was estimated slower (one iteration's products cannot overlap the next's).

*Blocks.* ``kernels/data/conv_blocks.json`` holds the defaults, from a sweep of the channels
per block (``tools/tune_conv.py tune``): 512 in and 512 out on v5e and v6e, which spread the
f32 copy over more output channels. Where a plan does not fit the chip's VMEM (v4's 16 MiB),
the default channel blocks are halved (down to 128), then the row block.

*What the wrapper pads (HBM bytes).* The input is padded once by XLA: the conv's own
padding, rows up to a whole number of row blocks plus the halo, columns up to the padded
output width's receptive field, and channels up to a whole number of cin blocks (only when
cin exceeds the block and does not divide). That is one extra read and write of the input
(``2 N Hp Wp Cp`` bytes times the itemsize) unless no padding is needed. The output is
computed at ``round_up(Wo, 8)`` columns in VMEM, but written at its true height and width
(the last row block is partial); only padded output channels cost a slice copy. Each input block is read once per cout block.

Winograd F(m x m, 3 x 3)
------------------------

For 3x3, stride 1, undilated, ungrouped convolutions (``algorithm="winograd"``,
``tile_size`` 2 or 4): the output is cut into ``m x m`` tiles, each computed from an
``(m + 2) x (m + 2)`` input tile ``d`` as ``A^T [ (G g G^T) . (B^T d B) ] A``, the product
``.`` being elementwise per tile and a GEMM over channels. One kernel does it all per grid
step: the input transform ``B^T d B`` in f32 on the VPU (adds and small constant multiplies,
tiles gathered with stride-``m`` f32 loads), the ``(m + 2)^2`` channel GEMMs on the MXU
(bf16 in, f32 accumulated over cin blocks), then the output transform ``A^T M A``, bias,
activation and a strided store into the output block. Transformed tiles never reach HBM.
The multiplications fall from ``9 m^2`` per tile and channel pair to ``(m + 2)^2``: 2.25x
(F(2x2,3x3)) and 4x (F(4x4,3x3)) fewer MXU FLOPs; the transforms cost VPU work that grows
with ``cin`` and ``cout`` but not with their product.

*Batches of 8 or 16 images* (the batched direct kernel's conditions) take a second Winograd
kernel, :mod:`kernels.conv.winograd`: images on the sublanes, the input staged by tile phase
so every tile entry is a slice of leading axes, the transforms in loops over tile rows and
128-lane groups, one ``[rows, cin] x [cin, cout]`` GEMM per transform position, and the whole
transformed filter as one block (fetched once) where VMEM allows.

The filter transform ``U = G g G^T`` runs in XLA, as exact f32 sums of constant multiples. :func:`winograd_filter_transform`
returns it as a :class:`WinogradFilter` that a layer can cache per weight update and pass to
``conv2d`` as ``w`` (with ``algorithm="winograd"`` or None); such a filter is forward-only
(no gradient flows through it).

*Numerics.* The transforms are exact in real arithmetic but amplify rounding: F(2x2,3x3)'s
matrices hold 0, +-1 and 1/2. F(4x4,3x3) interpolates at 0, +-2/3, +-3/2 rather than Lavin's
0, +-1, +-2 (whose matrices hold 5 in ``B`` and 8 in ``A``): its entries stay below 3.4 and its
f32 error within 10x of the direct conv's (several times smaller than with Lavin's points; the
tests bound it and the conv notebook measures it). F(4x4,3x3) is unsafe where rounding
dominates: bf16 operands (the transformed tiles and filters are rounded to bf16 for the MXU,
errors of several 1e-2 relative), and large magnitudes or wide dynamic ranges in the
input, where cancellations in ``B^T d B`` lose the small terms. The tests and
``tools/tune_conv.py`` state the measured errors.

Backward (``custom_vjp``)
-------------------------

``dx`` of a stride-1 undilated conv is the conv of ``dy`` with the spatially flipped,
IO-transposed filter and padding ``k - 1 - p`` per side: it runs on the direct kernels (the
batched one for batches of 8).
Strided ``dx`` runs on XLA's transposed convolution (``jax.vjp`` of
``lax.conv_general_dilated``): the dilated ``dy`` would make the direct kernel multiply
``s^2 - 1`` zeros per useful product. ``dw`` (the correlation of ``x`` with ``dy``) is XLA's
convolution in every case. With an activation, the backward pass recomputes the
pre-activation with the forward kernel (one more forward conv) to form ``dz``.

``feature_group_count > 1`` and ``rhs_dilation != (1, 1)`` run on the XLA path (the Pallas
path raises NotImplementedError so dispatch falls back).

Which program ``algorithm=None`` runs
-------------------------------------

From shipped data, not from a heuristic: ``tools/tune_conv.py rules`` reads the stored
compiler estimates (``conv_bench.json``) and writes rules per generation into
``conv_blocks.json``. A ``winograd`` rule picks a Winograd tile where a Winograd kernel beat
the direct one; an ``xla`` rule hands the call to XLA's convolution (with
``implementation=None``) where XLA beat every kernel of ours at the same batch. Each rule
covers its dtype, a multiple of its batch, and its channel count and width or more, for
3x3 stride-1 convolutions. :func:`default_algorithm` says what a call will run.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.base import calls
from kernels.base import partition
from kernels.base import tiling
from kernels.base.backend import dispatch, target_chip
from kernels.base.errors import KernelError, VmemOverflowError, check
from kernels.base.hardware import get_chip
from kernels.gemm import apply_activation
from kernels.conv import winograd as WB
from kernels.conv.winograd import lincomb as _lincomb

ACTIVATIONS = (None, "relu", "silu", "gelu", "gelu_tanh")
ALGORITHMS = (None, "direct", "winograd")
KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
DIMENSION_NUMBERS = ("NHWC", "HWIO", "NHWC")


# --- Winograd matrices (Lavin & Gray, 2016) -------------------------------------

# F(2x2,3x3): Lavin's matrices (points 0, +-1 and infinity), as derived in the conv notebook.
# F(4x4,3x3): Cook-Toom from the points 0, +-2/3, +-3/2 and infinity. Lavin's 0, +-1, +-2 put 4
# and 5 in B^T, 8 in A^T and 1/24 in G; the reciprocal pairs keep every entry between 1/4 and
# 3.4 in magnitude, which cuts the transforms' rounding error several-fold in f32 and in bf16
# (the conv notebook measures it) with the same number of nonzeros, i.e. the same VPU work.
POINTS_F4 = (0, Fraction(2, 3), Fraction(-2, 3), Fraction(3, 2), Fraction(-3, 2))


def _cook_toom(points, r: int = 3):
  """``(B^T, G, A^T)`` of F(m, r), ``m = len(points) - r + 2``, built exactly (rationals) from the
  finite interpolation points and infinity, so that ``y = A^T [(G g) * (B^T d)]`` is the valid
  correlation: ``A^T[i, j] = p_j^i``; ``G[j, k] = p_j^k / |f_j|`` with ``f_j = prod_{l != j}
  (p_j - p_l)``; row ``j`` of ``B^T`` the coefficients of ``sign(f_j) prod_{l != j} (x - p_l)``,
  and for infinity those of ``prod_l (x - p_l)``."""
  p = [Fraction(v) for v in points]
  n = len(p) + 1
  m = n - r + 1

  def poly(skip=None):  # coefficients, lowest power first, of prod_{l != skip} (x - p_l)
    c = [Fraction(1)]
    for j, q in enumerate(p):
      if j != skip:
        c = [(c[i - 1] if i else 0) - q * (c[i] if i < len(c) else 0) for i in range(len(c) + 1)]
    return c
  f = [math.prod(q - o for i, o in enumerate(p) if i != j) for j, q in enumerate(p)]
  bt = [[v * (1 if f[j] > 0 else -1) for v in poly(j)] + [0] for j in range(n - 1)] + [poly()]
  g = [[q ** k / abs(f[j]) for k in range(r)] for j, q in enumerate(p)] + [[0] * (r - 1) + [1]]
  at = [[q ** i for q in p] + [int(i == m - 1)] for i in range(m)]
  return tuple(np.array([[float(v) for v in row] for row in mat], np.float64) for mat in (bt, g, at))


_F4 = _cook_toom(POINTS_F4)
_BT = {
    2: np.array([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]], np.float64),
    4: _F4[0],
}
_G = {
    2: np.array([[1, 0, 0], [.5, .5, .5], [.5, -.5, .5], [0, 0, 1]], np.float64),
    4: _F4[1],
}
_AT = {
    2: np.array([[1, 1, 1, 0], [0, 1, -1, -1]], np.float64),
    4: _F4[2],
}


def winograd_matrices(tile_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """``(B^T, G, A^T)`` of F(m x m, 3 x 3), ``m = tile_size`` (2 or 4), in float64."""
  _check_tile(tile_size)
  return _BT[tile_size], _G[tile_size], _AT[tile_size]


def _check_tile(tile_size):
  check(tile_size in (2, 4), "tile_size", tile_size, "must be 2 (F(2x2,3x3)) or 4 (F(4x4,3x3))")


@functools.partial(jax.tree_util.register_dataclass, data_fields=["u"], meta_fields=["tile_size"])
@dataclasses.dataclass(frozen=True)
class WinogradFilter:
  """A transformed 3x3 filter, ``u = G w G^T``: ``[m + 2, m + 2, cin, cout]`` float32.

  Built by :func:`winograd_filter_transform`; pass it to :func:`conv2d` as ``w`` to skip the
  transform (forward only: no gradient flows to the raw filter through it).
  """

  u: jax.Array
  tile_size: int

  @property
  def shape(self):  # the raw filter's HWIO shape, for validation
    return (3, 3) + tuple(self.u.shape[2:])

  @property
  def dtype(self):
    return self.u.dtype

  @property
  def ndim(self):
    return 4


def winograd_filter_transform(w, tile_size: int = 4) -> WinogradFilter:
  """``G w G^T`` of a 3x3 HWIO filter, in float32: compute it once per weight update and pass
  the result to :func:`conv2d` as ``w`` (see :class:`WinogradFilter`)."""
  _check_tile(tile_size)
  check(hasattr(w, "shape") and w.ndim == 4 and tuple(w.shape[:2]) == (3, 3), "w", w,
        "must be a 3x3 HWIO filter [3, 3, cin, cout]")
  # exact f32 sums of constant multiples, elementwise: libtpu's static profile of the
  # equivalent HIGHEST-precision einsum grew past 14 GB of host memory at 512 channels
  wf = w.astype(jnp.float32)
  rows = WB.transform_1d(_G[tile_size], [wf[i] for i in range(3)])  # (G w)[a]: [3, cin, cout]
  u = jnp.stack([jnp.stack(WB.transform_1d(_G[tile_size], [r[j] for j in range(3)])) for r in rows])
  return WinogradFilter(u, tile_size)


# --- block sizes ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Per grid step: ``block_h`` output rows, ``block_cout`` output and ``block_cin`` input
  channels. None picks the per-generation default (multiples of the MXU width: 128 on
  v4/v5e/v5p, 256 on v6e; ``block_h`` so a step's GEMM has ~``target_rows`` rows)."""

  block_h: int | None = None
  block_cout: int | None = None
  block_cin: int | None = None
  target_rows: int | None = None

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


_MXU = {"v4": 128, "v5e": 128, "v5p": 128, "v6e": 256}


def default_block_sizes(generation=None) -> BlockSizes:
  """The shipped default: ``kernels/data/conv_blocks.json`` where a sweep filled it, else two
  MXU widths of channels per block and ~1024 GEMM rows per step."""
  gen = get_chip(generation).name if generation is not None else "v5e"
  mxu = _MXU.get(gen, 128)
  entry = tiling.block_table("conv").get(gen, {})
  return BlockSizes(None, entry.get("block_cout", 2 * mxu), entry.get("block_cin", 2 * mxu),
                    entry.get("target_rows", 1024))


# --- validation -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Conv:
  n: int
  h: int
  w: int
  cin: int
  cout: int
  kh: int
  kw: int
  strides: tuple
  pads: tuple  # ((top, bottom), (left, right))
  dilation: tuple
  groups: int
  ho: int
  wo: int


def _pair(v, name):
  if isinstance(v, (int, np.integer)):
    v = (int(v), int(v))
  check(isinstance(v, (tuple, list)) and len(v) == 2 and all(isinstance(a, (int, np.integer)) and a >= 1 for a in v),
        name, v, "must be a positive int or a pair of positive ints")
  return tuple(int(a) for a in v)


def _validate(x, w, strides, padding, rhs_dilation, feature_group_count, bias) -> _Conv:
  check(hasattr(x, "shape") and x.ndim == 4, "x", x, "must be rank 4, NHWC [batch, height, width, cin]")
  check(hasattr(w, "shape") and w.ndim == 4, "w", w, "must be rank 4, HWIO [kh, kw, cin / groups, cout]")
  check(jnp.issubdtype(x.dtype, jnp.floating), "x", x, "must be floating point")
  check(jnp.issubdtype(w.dtype, jnp.floating), "w", w, "must be floating point")
  strides, dilation = _pair(strides, "strides"), _pair(rhs_dilation, "rhs_dilation")
  g = feature_group_count
  check(isinstance(g, (int, np.integer)) and g >= 1, "feature_group_count", g, "must be a positive int")
  n, h, wd, cin = x.shape
  kh, kw, wcin, cout = w.shape
  check(cin % g == 0, "feature_group_count", g, f"must divide the input channels cin={cin}")
  check(cout % g == 0, "feature_group_count", g, f"must divide the output channels cout={cout}")
  check(wcin * g == cin, "w", w, f"HWIO filter has {wcin} input channels; x has cin={cin} with "
        f"feature_group_count={g}, so w needs cin / groups = {cin // g} (is x NHWC and w HWIO?)")
  ekh, ekw = (kh - 1) * dilation[0] + 1, (kw - 1) * dilation[1] + 1
  if isinstance(padding, str):
    check(padding.upper() in ("SAME", "VALID"), "padding", padding,
          'must be "SAME", "VALID" or ((top, bottom), (left, right))')
    pads = tuple(tuple(p) for p in lax.padtype_to_pads((h, wd), (ekh, ekw), strides, padding.upper()))
  else:
    ok = (isinstance(padding, (tuple, list)) and len(padding) == 2
          and all(isinstance(p, (tuple, list)) and len(p) == 2 and all(isinstance(a, (int, np.integer)) for a in p)
                  for p in padding))
    check(ok, "padding", padding, 'must be "SAME", "VALID" or ((top, bottom), (left, right)) of ints')
    pads = tuple((int(a), int(b)) for a, b in padding)
  ho = (h + sum(pads[0]) - ekh) // strides[0] + 1
  wo = (wd + sum(pads[1]) - ekw) // strides[1] + 1
  check(ho >= 1 and wo >= 1, "padding", padding,
        f"leaves no output: the padded input {h + sum(pads[0])}x{wd + sum(pads[1])} is smaller than the "
        f"(dilated) kernel {ekh}x{ekw}")
  if bias is not None:
    check(hasattr(bias, "shape") and tuple(bias.shape) == (cout,), "bias", bias, f"must be [cout] = [{cout}]")
  return _Conv(n, h, wd, cin, cout, kh, kw, strides, pads, dilation, g, ho, wo)


# --- the XLA path -------------------------------------------------------------------


def _epilogue(z, bias, activation):
  if bias is not None:
    z = z + bias.astype(jnp.float32)
  return apply_activation(z, activation)


def _lax_conv(x, w, c: _Conv, precision=None, preferred=jnp.float32):
  return lax.conv_general_dilated(x, w, c.strides, c.pads, rhs_dilation=c.dilation,
                                  dimension_numbers=DIMENSION_NUMBERS, feature_group_count=c.groups,
                                  precision=precision, preferred_element_type=preferred)


def conv2d_reference(x, w, *, strides=(1, 1), padding="SAME", rhs_dilation=(1, 1), feature_group_count=1,
                     bias=None, activation=None, precision=None, out_dtype=None):
  """:func:`conv2d` in plain JAX: ``lax.conv_general_dilated`` (f32 accumulation), bias and
  activation in f32, the result in ``out_dtype`` (default ``x``'s dtype)."""
  check(activation in ACTIVATIONS, "activation", activation, f"must be one of {ACTIVATIONS}")
  if isinstance(w, WinogradFilter):
    raise KernelError("w", w, "a WinogradFilter runs on the Pallas Winograd kernel only; pass the raw filter")
  c = _validate(x, w, strides, padding, rhs_dilation, feature_group_count, bias)
  z = _lax_conv(x, w.astype(x.dtype), c, precision)
  return _epilogue(z, bias, activation).astype(out_dtype or x.dtype)


# --- the direct kernel --------------------------------------------------------------


def _round_blocks(total: int, want: int, multiple: int = 128) -> int:
  """The channel block: the whole axis if it fits ``want``, else ``want`` (a multiple of 128)."""
  if total <= want:
    return total
  return max(multiple, want // multiple * multiple)


def _stage(x_ref, xf_ref, c: int):
  """Casts the input block ``[rows, wp, c]`` to the f32 scratch ``[ceil(c / 128), rows, wp, 128]``:
  Mosaic's strided loads need a 128-lane base memref, so channels go in 128-lane groups."""
  for g in range(xf_ref.shape[0]):
    lanes = min(128, c - 128 * g)
    if lanes == 128:
      xf_ref[g] = x_ref[0, :, :, 128 * g:128 * (g + 1)].astype(jnp.float32)
    else:
      xf_ref[g, :, :, :lanes] = x_ref[0, :, :, 128 * g:128 * g + lanes].astype(jnp.float32)


def _window(xf_ref, r, q, c: int):
  """``[rows, cols, c]`` of the staged block at the row/column indexers ``r``, ``q``."""
  parts = [xf_ref[pl.ds(g, 1), r, q, :][0] for g in range(xf_ref.shape[0])]  # (ds: interpret mode)
  last = c - 128 * (len(parts) - 1)
  if last < 128:
    parts[-1] = parts[-1][..., :last]
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)


def _tap(xf_ref, dy, dx, rows, cols, sh, sw, c):
  """The ``[rows, cols, c]`` f32 window of tap ``(dy, dx)`` at the strides."""
  r = pl.ds(dy, rows, stride=sh) if sh > 1 else pl.ds(dy, rows)
  q = pl.ds(dx, cols, stride=sw) if sw > 1 else pl.ds(dx, cols)
  return _window(xf_ref, r, q, c)


def _direct_kernel(x_ref, w_ref, b_ref, o_ref, acc_ref, xf_ref, *, kh, kw, sh, sw, bh, wo_p, nk, activation,
                   cdt, precision):
  k = pl.program_id(3)

  @pl.when(k == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  c = x_ref.shape[-1]
  _stage(x_ref, xf_ref, c)

  def row(dy, part):  # a loop over kernel rows: the fully unrolled kh*kw body made the cost model's profile blow up
    for dx in range(kw):
      lhs = _tap(xf_ref, dy, dx, bh, wo_p, sh, sw, c).reshape(bh * wo_p, c).astype(cdt)
      part = part + jnp.dot(lhs, w_ref[dy, dx].astype(cdt), preferred_element_type=jnp.float32,
                            precision=precision)
    return part
  acc_ref[...] += lax.fori_loop(0, kh, row, jnp.zeros(acc_ref.shape, jnp.float32))

  @pl.when(k == nk - 1)
  def _():
    y = apply_activation(acc_ref[...] + b_ref[...].astype(jnp.float32), activation)
    o_ref[0] = y.reshape(bh, wo_p, y.shape[-1])[:, :o_ref.shape[2]].astype(o_ref.dtype)  # drop the padded columns


@dataclasses.dataclass(frozen=True)
class _Plan:
  bh: int
  bc: int
  bco: int
  cin_p: int
  cout_p: int
  ho_p: int
  wo_p: int
  rows_in: int
  hp: int
  wp: int


def _plan(c: _Conv, blocks: BlockSizes, *, tile: int = 1) -> _Plan:
  chip = target_chip()
  gen = chip.name if chip is not None and chip.name in _MXU else None
  d = default_block_sizes(gen)
  sh, sw = c.strides
  bc = _round_blocks(c.cin, blocks.block_cin or d.block_cin)
  bco = _round_blocks(c.cout, blocks.block_cout or d.block_cout)
  wo_p = tiling.round_up(c.wo, 8 * tile)
  if blocks.block_h is not None:
    bh = blocks.block_h
    check(isinstance(bh, int) and bh >= 1 and bh % tile == 0, "block_sizes", blocks,
          f"block_h must be a positive multiple of the tile size {tile}")
  else:
    rows = blocks.target_rows or d.target_rows
    bh = max(1, rows // wo_p)
    bh = min(bh, tiling.round_up(c.ho, tile))
    bh = max(tile, bh // tile * tile)
  nb = tiling.cdiv(c.ho, bh)
  rows_in = (bh - 1) * sh + c.kh
  hp = (nb - 1) * bh * sh + rows_in
  wp = (wo_p - 1) * sw + c.kw
  return _Plan(bh, bc, bco, tiling.round_up(c.cin, bc), tiling.round_up(c.cout, bco), nb * bh, wo_p, rows_in, hp, wp)


def _pad_input(x, c: _Conv, p: _Plan):
  """Conv padding, then rows/columns up to the plan's extent (negative pads crop), channels to cin_p."""
  (pt, _), (pleft, _) = c.pads
  cfg = [(0, 0, 0), (pt, p.hp - c.h - pt, 0), (pleft, p.wp - c.w - pleft, 0), (0, p.cin_p - c.cin, 0)]
  if all(a == 0 and b == 0 for a, b, _ in cfg):
    return x
  return lax.pad(x, jnp.zeros((), x.dtype), cfg)


def _vmem(p: _Plan, x_dtype, w_taps, out_dtype, m_rows, acc_slots=1) -> int:
  blocks = [((p.rows_in, p.wp, p.bc), x_dtype), ((w_taps, p.bc, p.bco), x_dtype), ((1, p.bco), jnp.float32),
            ((m_rows, p.bco), out_dtype)]
  scratch = [((acc_slots * m_rows, p.bco), jnp.float32),
             ((tiling.cdiv(p.bc, 128), p.rows_in, p.wp, 128), jnp.float32)]
  temps = 3 * tiling.block_bytes((m_rows, max(p.bc, p.bco)), jnp.float32)
  return tiling.vmem_footprint(blocks, scratch) + temps


def _direct_vmem(p: _Plan, c: _Conv, x_dtype, out_dtype) -> int:
  return _vmem(p, x_dtype, c.kh * c.kw, out_dtype, p.bh * p.wo_p)


def _winograd_vmem(p: _Plan, c: _Conv, m: int, x_dtype, out_dtype) -> int:
  t, wt = m + 2, p.wo_p // m
  return (_vmem(p, x_dtype, t * t, out_dtype, p.bh // m * wt, acc_slots=t * t)
          + tiling.block_bytes((p.bh, p.wo_p, p.bco), jnp.float32)
          + 2 * t * tiling.block_bytes((p.rows_in, wt, max(p.bc, p.bco)), jnp.float32))


def _fitted_plan(c: _Conv, blocks: BlockSizes, need, *, tile: int = 1, plan=None) -> _Plan:
  """:func:`_plan`, with its default blocks shrunk until ``need(plan)`` bytes fit the chip's
  VMEM: first the channel blocks, halved down to 128 (the tuned 512 x 512 channels hold
  4.7 MB of bf16 3x3 weights, double-buffered more than half of v4's 16 MiB), then the row
  block. Sizes given explicitly are kept (a plan that cannot fit is a VmemOverflowError)."""
  chip = target_chip() or get_chip("v5e")
  free_cin, free_cout, free_h = blocks.block_cin is None, blocks.block_cout is None, blocks.block_h is None
  while True:
    p = (plan or _plan)(c, blocks, tile=tile)
    try:
      tiling.vmem_limit(need(p), chip)
      return p
    except VmemOverflowError:
      pass
    half = lambda v: max(128, v // 2 // 128 * 128)  # noqa: E731
    if free_cin and p.bc > 128 and p.bc >= p.bco:
      blocks = dataclasses.replace(blocks, block_cin=half(p.bc))
    elif free_cout and p.bco > 128:
      blocks = dataclasses.replace(blocks, block_cout=half(p.bco))
    elif free_cin and p.bc > 128:
      blocks = dataclasses.replace(blocks, block_cin=half(p.bc))
    elif free_h and p.bh > tile:
      per_row = p.wo_p * (plan.keywords["nb"] if plan is not None else 1)  # GEMM rows per output row
      blocks = dataclasses.replace(blocks, target_rows=max(1, p.bh // 2) * per_row)
    else:
      return p


def _cdt(x_dtype, precision):
  return jnp.dtype(x_dtype)


def _operands(x, w, bias, c: _Conv, p: _Plan):
  """The padded input, the filter (or transformed filter) with channels padded to whole
  blocks, and the bias as an f32 ``[1, cout_p]`` row (zeros without one)."""
  if p.cin_p != c.cin or p.cout_p != c.cout:
    w = jnp.pad(w, ((0, 0), (0, 0), (0, p.cin_p - c.cin), (0, p.cout_p - c.cout)))
  b = jnp.zeros((p.cout_p,), jnp.float32) if bias is None else jnp.pad(bias.astype(jnp.float32),
                                                                           (0, p.cout_p - c.cout))
  return _pad_input(x, c, p), w, b.reshape(1, p.cout_p)


def _direct_pallas(kernel, x, w, bias, c: _Conv, p: _Plan, nb: int, scratch, vmem: int, *, out_dtype, interpret,
                   name):
  """The pallas_call both direct kernels share: grid ``(image blocks of nb, row blocks, cout
  blocks, cin blocks)``, the input rows with their halo as overlapping ``pl.Element`` windows."""
  sh = c.strides[0]
  xp, wq, b = _operands(x, w.astype(x.dtype), bias, c, p)
  nk = p.cin_p // p.bc
  grid = (c.n // nb, p.ho_p // p.bh, p.cout_p // p.bco, nk)
  x_spec = pl.BlockSpec((pl.Element(nb), pl.Element(p.rows_in), pl.Element(p.wp), pl.Element(p.bc)),
                        lambda n, i, j, k: (n * nb, i * p.bh * sh, 0, k * p.bc if nk > 1 else 0))
  w_spec = pl.BlockSpec((c.kh, c.kw, p.bc, p.bco), lambda n, i, j, k: (0, 0, k, j))
  b_spec = pl.BlockSpec((1, p.bco), lambda n, i, j, k: (0, j))
  o_spec = pl.BlockSpec((nb, p.bh, c.wo, p.bco), lambda n, i, j, k: (n, i, 0, j))
  limit = tiling.vmem_limit(vmem, target_chip() or get_chip("v5e"))
  flops = 2 * c.n * p.ho_p * p.wo_p * p.cin_p * p.cout_p * c.kh * c.kw
  bytes_ = (xp.size * x.dtype.itemsize * (p.cout_p // p.bco) + wq.size * wq.dtype.itemsize * grid[0] * grid[1]
            + c.n * c.ho * c.wo * p.cout_p * jnp.dtype(out_dtype).itemsize)
  out = calls.pallas_call(
      functools.partial(kernel, nk=nk), grid=grid, in_specs=[x_spec, w_spec, b_spec], out_specs=o_spec,
      out_shape=jax.ShapeDtypeStruct((c.n, c.ho, c.wo, p.cout_p), out_dtype),  # the last row block is partial
      scratch_shapes=scratch,
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
                                           vmem_limit_bytes=limit),
      interpret=interpret, name=name,
      cost_estimate=pl.CostEstimate(flops=flops, transcendentals=0, bytes_accessed=bytes_),
  )(xp, wq, b)
  return out[..., :c.cout] if p.cout_p != c.cout else out


def _direct_call(x, w, bias, c: _Conv, p: _Plan, *, activation, out_dtype, precision, interpret):
  sh, sw = c.strides
  kernel = functools.partial(_direct_kernel, kh=c.kh, kw=c.kw, sh=sh, sw=sw, bh=p.bh, wo_p=p.wo_p,
                             activation=activation, cdt=_cdt(x.dtype, precision), precision=precision)
  scratch = [pltpu.VMEM((p.bh * p.wo_p, p.bco), jnp.float32),
             pltpu.VMEM((tiling.cdiv(p.bc, 128), p.rows_in, p.wp, 128), jnp.float32)]
  return _direct_pallas(kernel, x, w, bias, c, p, 1, scratch, _direct_vmem(p, c, x.dtype, out_dtype),
                        out_dtype=out_dtype, interpret=interpret, name="conv2d_direct")


# --- the batched direct kernel: images on the sublanes ------------------------------

BATCH_BLOCK = 8  # images per block: one f32 sublane tile (16, one packed bf16 tile, where the batch allows)


def batch_block(c: _Conv, dtype) -> int | None:
  """Images per block of the batched kernel, or None where it does not apply (strides, dilation,
  groups, a batch that is not a whole number of blocks, or fewer than 128 channels in or out,
  where the compiled kernel on v4 needed 1.6x our VMEM estimate). bf16 batches of 16 stage in
  bf16, 16 images to a packed tile, and skip the per-tap casts; others stage 8 images in f32."""
  if c.strides != (1, 1) or c.dilation != (1, 1) or c.groups != 1 or c.n % BATCH_BLOCK or min(c.cin, c.cout) < 128:
    return None
  return 2 * BATCH_BLOCK if jnp.dtype(dtype) == jnp.bfloat16 and c.n % (2 * BATCH_BLOCK) == 0 else BATCH_BLOCK


def _staging_dtype(nb: int):
  return jnp.bfloat16 if nb == 2 * BATCH_BLOCK else jnp.float32


def _batched_kernel(x_ref, w_ref, b_ref, o_ref, acc_ref, xt_ref, *, kh, kw, bh, wo, nk, activation, cdt,
                    precision):
  k = pl.program_id(3)

  @pl.when(k == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  nb, rows_in, _, c = x_ref.shape
  for r in range(rows_in):  # [nb, wp, c] -> [wp, nb, c]: images onto the sublanes, rows and columns leading
    xt_ref[r] = jnp.swapaxes(x_ref[:, r].astype(xt_ref.dtype), 0, 1)

  def row(dy, part):  # each tap is a slice of leading axes: no shifted or strided loads
    for dx in range(kw):
      lhs = xt_ref[pl.ds(dy, bh), pl.ds(dx, wo)].reshape(bh * wo * nb, c).astype(cdt)
      part = part + jnp.dot(lhs, w_ref[dy, dx].astype(cdt), preferred_element_type=jnp.float32,
                            precision=precision)
    return part
  part = jnp.zeros(acc_ref.shape, jnp.float32)
  for dy in range(kh):
    part = row(dy, part)
  acc_ref[...] += part

  @pl.when(k == nk - 1)
  def _():
    y = apply_activation(acc_ref[...] + b_ref[...].astype(jnp.float32), activation)
    y = y.reshape(bh, wo, nb, y.shape[-1])
    for h in range(bh):  # back to NHWC: images leading again
      o_ref[:, h] = jnp.swapaxes(y[h], 0, 1).astype(o_ref.dtype)


def _batched_plan(c: _Conv, blocks: BlockSizes, *, tile: int = 1, nb: int = BATCH_BLOCK) -> _Plan:
  """Like :func:`_plan`, but a step's GEMM has ``block_h * wo * nb`` rows (about the shipped
  ``batched_target_rows``), no width padding (the width is a leading axis here), and all of
  ``cin`` per step unless VMEM says otherwise."""
  chip = target_chip()
  gen = chip.name if chip is not None and chip.name in _MXU else None
  d = default_block_sizes(gen)
  bc = _round_blocks(c.cin, blocks.block_cin or c.cin)  # all of cin unless VMEM says otherwise (_fitted_plan)
  bco = _round_blocks(c.cout, blocks.block_cout or d.block_cout)
  if blocks.block_h is not None:
    bh = blocks.block_h
  else:
    rows = blocks.target_rows or tiling.block_table("conv").get(gen or "v5e", {}).get("batched_target_rows", 1792)
    bh = min(c.ho, max(1, rows // (c.wo * nb)))
    bh = tiling.cdiv(c.ho, tiling.cdiv(c.ho, bh))  # the same steps, balanced: no mostly-empty last block
  nb = tiling.cdiv(c.ho, bh)
  rows_in = bh + c.kh - 1
  return _Plan(bh, bc, bco, tiling.round_up(c.cin, bc), tiling.round_up(c.cout, bco), nb * bh, c.wo, rows_in,
               (nb - 1) * bh + rows_in, c.wo + c.kw - 1)


def _batched_vmem(p: _Plan, c: _Conv, nb: int, x_dtype, out_dtype) -> int:
  m_rows = p.bh * p.wo_p * nb
  blocks = [((nb, p.rows_in, p.wp, p.bc), x_dtype), ((c.kh * c.kw, p.bc, p.bco), x_dtype),
            ((1, p.bco), jnp.float32), ((nb, p.bh, p.wo_p, p.bco), out_dtype)]
  scratch = [((m_rows, p.bco), jnp.float32), ((p.rows_in, p.wp, nb, p.bc), _staging_dtype(nb))]
  temps = 3 * tiling.block_bytes((m_rows, max(p.bc, p.bco)), jnp.float32)
  return tiling.vmem_footprint(blocks, scratch) + temps


def _batched_call(x, w, bias, c: _Conv, p: _Plan, nb: int, *, activation, out_dtype, precision, interpret):
  kernel = functools.partial(_batched_kernel, kh=c.kh, kw=c.kw, bh=p.bh, wo=c.wo, activation=activation,
                             cdt=_cdt(x.dtype, precision), precision=precision)
  scratch = [pltpu.VMEM((p.bh * c.wo * nb, p.bco), jnp.float32),
             pltpu.VMEM((p.rows_in, p.wp, nb, p.bc), _staging_dtype(nb))]
  return _direct_pallas(kernel, x, w, bias, c, p, nb, scratch, _batched_vmem(p, c, nb, x.dtype, out_dtype),
                        out_dtype=out_dtype, interpret=interpret, name="conv2d_direct_batched")


def _direct(x, w, bias, c: _Conv, blocks: BlockSizes, *, activation, out_dtype, precision, interpret):
  """The direct convolution: the batched kernel where it applies, else the per-image one."""
  nb = batch_block(c, x.dtype)
  chip = target_chip() or get_chip("v5e")
  for nb in sorted({nb, BATCH_BLOCK}, reverse=True) if nb else ():  # 16, else 8 images, else per image (v4's VMEM)
    p = _fitted_plan(c, blocks, lambda p: _batched_vmem(p, c, nb, x.dtype, out_dtype),
                     plan=functools.partial(_batched_plan, nb=nb))
    try:
      tiling.vmem_limit(_batched_vmem(p, c, nb, x.dtype, out_dtype), chip)
    except VmemOverflowError:
      continue
    return _batched_call(x, w, bias, c, p, nb, activation=activation, out_dtype=out_dtype, precision=precision,
                         interpret=interpret)
  p = _fitted_plan(c, blocks, lambda p: _direct_vmem(p, c, x.dtype, out_dtype))
  return _direct_call(x, w, bias, c, p, activation=activation, out_dtype=out_dtype, precision=precision,
                      interpret=interpret)


# --- the Winograd kernel ------------------------------------------------------------


def _winograd_kernel(x_ref, u_ref, b_ref, o_ref, acc_ref, xf_ref, y_ref, *, m, bh, wt, nk, activation, cdt,
                     precision):
  k = pl.program_id(3)
  t = m + 2
  bt, at = _BT[m], _AT[m]
  pt = bh // m

  @pl.when(k == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  c = x_ref.shape[-1]
  _stage(x_ref, xf_ref, c)
  rows = bh + 2
  # Column j of every tile (stride-m f32 loads): [rows, wt, c].
  cols = [_window(xf_ref, pl.ds(0, rows), pl.ds(j, wt, stride=m), c) for j in range(t)]
  for b in range(t):
    tb = _lincomb(bt[b], cols)  # (d B)[:, b] for every tile column, all rows
    # Row i of every tile: rows i, i + m, ... (a leading-dim regroup).
    padded = jnp.concatenate([tb, jnp.zeros((m * pt + t - rows, wt, c), jnp.float32)], axis=0) \
        if m * pt + t > rows else tb
    r = [padded[i:i + m * pt].reshape(pt, m, wt, c)[:, 0] for i in range(t)]
    for a in range(t):
      v = _lincomb(bt[a], r).reshape(pt * wt, c).astype(cdt)  # (B^T d B)[a, b], every tile
      acc_ref[a * t + b] += jnp.dot(v, u_ref[a, b].astype(cdt), preferred_element_type=jnp.float32,
                                    precision=precision)

  @pl.when(k == nk - 1)
  def _():
    mm = [[acc_ref[a * t + b] for b in range(t)] for a in range(t)]
    bias = b_ref[...].astype(jnp.float32)
    for uu in range(m):
      z = [_lincomb(at[uu], [mm[a][b] for a in range(t)]) for b in range(t)]
      for vv in range(m):
        y = apply_activation(_lincomb(at[vv], z) + bias, activation)
        co = y.shape[-1]
        if co % 128:
          y = jnp.concatenate([y, jnp.zeros((y.shape[0], 128 - co % 128), y.dtype)], axis=-1)
        y = y.reshape(pt, wt, y.shape[-1])
        for g in range(y_ref.shape[0]):  # strided stores into 128-lane groups (see _stage)
          y_ref[pl.ds(g, 1), pl.ds(uu, pt, stride=m), pl.ds(vv, wt, stride=m), :] = y[None, ..., 128 * g:128 * (g + 1)]
    co = o_ref.shape[-1]
    o_ref[0] = _window(y_ref, pl.ds(0, bh), pl.ds(0, o_ref.shape[2]), co).astype(o_ref.dtype)


def _winograd_call(x, u, bias, c: _Conv, p: _Plan, m: int, *, activation, out_dtype, precision, interpret):
  t = m + 2
  xp, uq, b = _operands(x, u.astype(x.dtype) if x.dtype == jnp.bfloat16 else u, bias, c, p)
  nk = p.cin_p // p.bc
  wt = p.wo_p // m
  pt = p.bh // m
  grid = (c.n, p.ho_p // p.bh, p.cout_p // p.bco, nk)
  x_spec = pl.BlockSpec((pl.Element(1), pl.Element(p.rows_in), pl.Element(p.wp), pl.Element(p.bc)),
                        lambda n, i, j, k: (n, i * p.bh, 0, k * p.bc if nk > 1 else 0))
  u_spec = pl.BlockSpec((t, t, p.bc, p.bco), lambda n, i, j, k: (0, 0, k, j))
  b_spec = pl.BlockSpec((1, p.bco), lambda n, i, j, k: (0, j))
  o_spec = pl.BlockSpec((1, p.bh, c.wo, p.bco), lambda n, i, j, k: (n, i, 0, j))
  chip = target_chip() or get_chip("v5e")
  limit = tiling.vmem_limit(_winograd_vmem(p, c, m, x.dtype, out_dtype), chip)
  kernel = functools.partial(_winograd_kernel, m=m, bh=p.bh, wt=wt, nk=nk, activation=activation,
                             cdt=_cdt(x.dtype, precision), precision=precision)
  flops = 2 * c.n * pt * (p.ho_p // p.bh) * wt * t * t * p.cin_p * p.cout_p
  bytes_ = (xp.size * x.dtype.itemsize * (p.cout_p // p.bco) + uq.size * uq.dtype.itemsize * grid[0] * grid[1]
            + c.n * c.ho * c.wo * p.cout_p * jnp.dtype(out_dtype).itemsize)
  out = calls.pallas_call(
      kernel, grid=grid, in_specs=[x_spec, u_spec, b_spec], out_specs=o_spec,
      out_shape=jax.ShapeDtypeStruct((c.n, c.ho, c.wo, p.cout_p), out_dtype),  # the last row block is partial
      scratch_shapes=[pltpu.VMEM((t * t, pt * wt, p.bco), jnp.float32),
                      pltpu.VMEM((tiling.cdiv(p.bc, 128), p.rows_in, p.wp, 128), jnp.float32),
                      pltpu.VMEM((tiling.cdiv(p.bco, 128), p.bh, p.wo_p, 128), jnp.float32)],
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
                                           vmem_limit_bytes=limit),
      interpret=interpret, name=f"conv2d_winograd_f{m}",
      cost_estimate=pl.CostEstimate(flops=flops, transcendentals=0, bytes_accessed=bytes_),
  )(xp, uq, b)
  if out.shape != (c.n, c.ho, c.wo, c.cout):
    out = out[:, :c.ho, :c.wo, :c.cout]
  return out


def _winograd_plan(c: _Conv, m: int, nb: int, blocks: BlockSizes, x_dtype, out_dtype):
  """The batched Winograd plan: one tile row per step (``block_h`` overrides), all channels per
  step where VMEM allows (the transformed filter is then fetched once), else cout, then cin,
  halved down to 128. None if nothing fits."""
  chip = target_chip() or get_chip("v5e")
  pt = blocks.block_h // m if blocks.block_h else 1
  cin, cout = tiling.round_up(c.cin, 128), tiling.round_up(c.cout, 128)  # whole 128-lane groups
  bc = _round_blocks(cin, blocks.block_cin or cin)
  bco = _round_blocks(cout, blocks.block_cout or cout)
  while True:
    p = WB.make_plan(c.n, c.ho, c.wo, c.cin, c.cout, m=m, nb=nb, pt=pt, bc=bc, bco=bco, dtype=x_dtype)
    try:
      return p, tiling.vmem_limit(WB.vmem_bytes(p, x_dtype, out_dtype, c.wo), chip)
    except VmemOverflowError:
      pass
    if blocks.block_cout is None and bco > 128 and bco >= bc:
      bco = max(128, bco // 2 // 128 * 128)
    elif blocks.block_cin is None and bc > 128:
      bc = max(128, bc // 2 // 128 * 128)
    else:
      return None


def _winograd_batched(x, u, bias, c: _Conv, m: int, blocks: BlockSizes, *, activation, out_dtype, precision,
                      interpret):
  """The batched Winograd kernel (:mod:`kernels.conv.winograd`) where it applies (the batched
  direct kernel's conditions, and block_h a multiple of the tile), else None."""
  nb = batch_block(c, x.dtype)
  if nb is None or (blocks.block_h is not None and blocks.block_h % m):
    return None
  planned = _winograd_plan(c, m, nb, blocks, x.dtype, out_dtype)
  if planned is None:
    return None
  p, limit = planned
  t = m + 2
  (pt_, _), (pleft, _) = c.pads
  xp = lax.pad(x, jnp.zeros((), x.dtype), [(0, 0, 0), (pt_, p.hp - c.h - pt_, 0), (pleft, p.wp - c.w - pleft, 0),
                                           (0, p.cin_p - c.cin, 0)])
  uq = jnp.pad(u.astype(x.dtype), ((0, 0), (0, 0), (0, p.cin_p - c.cin), (0, p.cout_p - c.cout)))
  b = jnp.zeros((p.cout_p,), jnp.float32) if bias is None else jnp.pad(bias.astype(jnp.float32),
                                                                           (0, p.cout_p - c.cout))
  out = WB.call(xp, uq.reshape(t * t, p.cin_p, p.cout_p), b.reshape(1, p.cout_p), p, ho=c.ho, wo=c.wo,
                bt=_BT[m], at=_AT[m], activation=activation, out_dtype=out_dtype, precision=precision,
                vmem_limit=limit, interpret=interpret, cdt=_cdt(x.dtype, precision))
  return out[..., :c.cout] if p.cout_p != c.cout else out


def winograd_eligible(c: _Conv) -> bool:
  return (c.kh, c.kw) == (3, 3) and c.strides == (1, 1) and c.dilation == (1, 1) and c.groups == 1


# --- entry, custom_vjp ------------------------------------------------------------------


def _forward(x, w, bias, c: _Conv, *, algorithm, tile, blocks, activation, out_dtype, precision, interpret):
  if algorithm == "winograd":
    u = w.u if isinstance(w, WinogradFilter) else winograd_filter_transform(w, tile).u
    batched = _winograd_batched(x, u, bias, c, tile, blocks, activation=activation, out_dtype=out_dtype,
                                precision=precision, interpret=interpret)
    if batched is not None:
      return batched
    p = _fitted_plan(c, blocks, lambda p: _winograd_vmem(p, c, tile, x.dtype, out_dtype), tile=tile)
    return _winograd_call(x, u, bias, c, p, tile, activation=activation, out_dtype=out_dtype,
                          precision=precision, interpret=interpret)
  return _direct(x, w, bias, c, blocks, activation=activation, out_dtype=out_dtype, precision=precision,
                 interpret=interpret)


def _transposed(c: _Conv) -> _Conv:
  """The conv computing dx from dy (stride 1, undilated): flipped filter, padding k - 1 - p."""
  (pt, pb), (pleft, pr) = c.pads
  pads = ((c.kh - 1 - pt, c.kh - 1 - pb), (c.kw - 1 - pleft, c.kw - 1 - pr))
  return _Conv(c.n, c.ho, c.wo, c.cout, c.cin, c.kh, c.kw, (1, 1), pads, (1, 1), 1, c.h, c.w)


def _pallas_entry(x, w, bias, *, c: _Conv, algorithm, tile, blocks, activation, out_dtype, precision, interpret):
  if c.groups != 1:
    raise NotImplementedError("feature_group_count > 1 runs on the XLA path")
  if c.dilation != (1, 1):
    raise NotImplementedError("rhs_dilation != (1, 1) runs on the XLA path")
  if jnp.dtype(x.dtype) not in KERNEL_DTYPES:
    raise NotImplementedError(f"the Pallas kernels take float32 and bfloat16, not {jnp.dtype(x.dtype).name}")
  fwd = functools.partial(_forward, c=c, algorithm=algorithm, tile=tile, blocks=blocks, precision=precision,
                          interpret=interpret)
  if isinstance(w, WinogradFilter):
    return fwd(x, w, bias, activation=activation, out_dtype=out_dtype)
  has_bias = bias is not None
  bias_in = bias if has_bias else jnp.zeros((c.cout,), jnp.float32)

  @jax.custom_vjp
  def f(x, w, b):
    return fwd(x, w, b if has_bias else None, activation=activation, out_dtype=out_dtype)

  def f_fwd(x, w, b):
    return f(x, w, b), (x, w, b)

  def f_bwd(res, dy):
    x, w, b = res
    if activation is not None:  # recompute the pre-activation, then dz = dy * act'(z)
      z = fwd(x, w, b if has_bias else None, activation=None, out_dtype=jnp.float32)
      _, act_vjp = jax.vjp(lambda z: apply_activation(z, activation), z)
      dz = act_vjp(dy.astype(jnp.float32))[0]
    else:
      dz = dy.astype(jnp.float32)
    db = jnp.sum(dz, axis=(0, 1, 2)).astype(b.dtype)
    dz_c = dz.astype(x.dtype)
    if c.strides == (1, 1):
      ct = _transposed(c)
      w_t = jnp.transpose(w[::-1, ::-1], (0, 1, 3, 2)).astype(x.dtype)
      dx = _direct(dz_c, w_t, None, ct, blocks, activation=None, out_dtype=x.dtype, precision=precision,
                   interpret=interpret)
      dw = jax.vjp(lambda w: _lax_conv(x, w, c, precision, preferred=jnp.float32), w.astype(x.dtype))[1](dz)[0]
    else:  # strided dx: XLA's transposed convolution (see the module doc)
      _, conv_vjp = jax.vjp(lambda x, w: _lax_conv(x, w, c, precision, preferred=jnp.float32), x, w.astype(x.dtype))
      dx, dw = conv_vjp(dz)
    return dx.astype(x.dtype), dw.astype(w.dtype), db

  f.defvjp(f_fwd, f_bwd)
  return f(x, w, bias_in)


def _check_blocks(block_sizes) -> BlockSizes:
  if block_sizes is None:
    return BlockSizes()
  check(isinstance(block_sizes, BlockSizes), "block_sizes", block_sizes, "must be a conv BlockSizes or None")
  for name in ("block_h", "block_cout", "block_cin", "target_rows"):
    v = getattr(block_sizes, name)
    check(v is None or (isinstance(v, int) and v >= 1), "block_sizes", block_sizes, f"{name} must be a positive int")
  for name in ("block_cout", "block_cin"):
    v = getattr(block_sizes, name)
    check(v is None or v % 128 == 0, "block_sizes", block_sizes, f"{name} must be a multiple of 128")
  return block_sizes


def _rule_applies(rule: dict, c: _Conv, dtype) -> bool:
  """A shipped rule covers inputs of its dtype, a batch that is a multiple of its
  ``batch_multiple``, and at least its channel count and output width."""
  return (jnp.dtype(dtype).name == rule.get("dtype") and c.n % rule.get("batch_multiple", 1) == 0
          and c.cin >= rule.get("min_cin", 1 << 30) and c.wo >= rule.get("min_width", 1 << 30))


def _rules(kind: str) -> list:
  chip = target_chip()
  return tiling.block_table("conv").get(chip.name if chip is not None else "v5e", {}).get(kind, [])


def _prefer_xla(c: _Conv, dtype) -> str | None:
  """Why ``algorithm=None`` hands this call to XLA, or None. Only where the shipped tuning data
  (conv_blocks.json ``xla``, written by ``tools/tune_conv.py rules``) records complete estimates
  of XLA's convolution beating every kernel of ours at the same batch, for 3x3 stride-1
  convolutions of this dtype, batch multiple, channel count and width or more."""
  if not winograd_eligible(c):
    return None
  for rule in _rules("xla"):
    if _rule_applies(rule, c, dtype):
      ev = rule.get("evidence", {})
      return (f"the shipped tuning data has XLA's convolution faster than our kernels here "
              f"({ev.get('kind', 'compiler estimates')} at {ev.get('shape')}: {ev.get('us')})")
  return None


def _preferred_algorithm(c: _Conv, dtype) -> tuple[str, int | None]:
  """Our kernel for algorithm=None: Winograd only where the shipped tuning data (conv_blocks.json
  ``winograd``, written by ``tools/tune_conv.py rules``) records complete estimates of a Winograd
  kernel beating the direct kernel, for inputs of this dtype, batch multiple, channel count and
  width or more."""
  if not winograd_eligible(c):
    return "direct", None
  for rule in _rules("winograd"):
    if _rule_applies(rule, c, dtype):
      return "winograd", rule["tile_size"]
  return "direct", None


def default_algorithm(x, w, *, strides=(1, 1), padding="SAME", rhs_dilation=(1, 1),
                      feature_group_count=1) -> tuple[str, int | None]:
  """What :func:`conv2d` with ``algorithm=None`` and ``implementation=None`` runs for these
  arguments on the target chip (:func:`kernels.base.backend.target_chip`, v5e off TPU):
  ``("winograd", tile_size)``, ``("direct", None)``, or ``("xla", None)`` where the shipped
  tuning data has XLA's convolution ahead of our kernels (with ``implementation="pallas"``
  such a call runs :func:`_preferred_algorithm`'s kernel instead). ``x`` and ``w`` may be
  arrays or ``jax.ShapeDtypeStruct``."""
  c = _validate(x, w, strides, padding, rhs_dilation, feature_group_count, None)
  return ("xla", None) if _prefer_xla(c, x.dtype) else _preferred_algorithm(c, x.dtype)


_SPLITS = {
    "batch": "local", "features": "local (w's output channels and bias along)",
    "channels": "a psum of partial convolutions (all-reduce)",
    "height": "a halo exchange (collective-permute; stride 1, an output as tall as the input)",
    "width": "a halo exchange (collective-permute; stride 1, an output as wide as the input)",
}
_CONV_DIMS = dict(x=("batch", "height", "width", "channels"), w=(None, None, "channels", "features"),
                  bias=("features",))


def _halo(x, axis: int, names: tuple, k: int, lo: int, hi: int):
  """``x``'s local rows along ``axis`` with ``lo`` rows of the previous device before them and ``hi``
  of the next after them (zeros past the ends: the convolution's zero padding), by ``ppermute``."""
  parts, m = [x], x.shape[axis]
  if lo:
    parts.insert(0, lax.ppermute(lax.slice_in_dim(x, m - lo, m, axis=axis), names, [(i, i + 1) for i in range(k - 1)]))
  if hi:
    parts.append(lax.ppermute(lax.slice_in_dim(x, 0, hi, axis=axis), names, [(i + 1, i) for i in range(k - 1)]))
  return jnp.concatenate(parts, axis) if len(parts) > 1 else x


def _split_conv(x, w, bias, c: _Conv, activation, out_dtype, kw):
  """conv2d on a mesh (issue 56), or None when nothing is split. Per split logical dimension:
  ``batch`` and ``features`` (w's O, bias along) are local; ``channels`` (x's C and w's I) is a
  partial convolution per device, then one psum in f32, and only then the bias (once) and the
  activation; ``height`` / ``width`` exchange halos with the neighbouring devices (``ppermute`` of
  the rows the filter reaches past the shard: ``top`` rows from the previous device, ``bottom`` from
  the next, zeros at the ends), then convolve the widened shard without padding on that axis.
  Halos need stride 1 and a same-size output on that axis (``"SAME"``, or explicit padding summing
  to the dilated kernel's extent minus one): ``"VALID"`` and strided outputs do not split evenly (a
  KernelError). A :class:`WinogradFilter` splits like ``w`` (its ``u``: ``[m+2, m+2, cin, cout]``)."""
  pre = isinstance(w, WinogradFilter)
  operands = dict(x=x, w=w.u if pre else w, bias=bias)
  split = partition.plan("conv2d", operands, _CONV_DIMS, splits=_SPLITS)
  if split is None:
    return None
  if c.groups > 1 and (split.of("channels") or split.of("features")):
    raise KernelError("feature_group_count", c.groups, "conv2d: a grouped convolution cannot split its channels or "
                      f"features (split over {split.of('channels') or split.of('features')}): split batch, height "
                      "or width")
  ekh, ekw = (c.kh - 1) * c.dilation[0] + 1, (c.kw - 1) * c.dilation[1] + 1
  for i, (name, size, ext) in enumerate((("height", c.h, ekh), ("width", c.w, ekw))):
    if split.of(name):
      lo, hi = c.pads[i]
      check(c.strides[i] == 1, "strides", c.strides, f"conv2d: {name} is split over {split.of(name)}, which "
            "needs stride 1 along it (a halo exchange): split batch or features instead")
      check(lo + hi == ext - 1 and lo >= 0 and hi >= 0, "padding", c.pads,
            f"conv2d: {name} is split over {split.of(name)}, which needs an output of the input's {name} "
            f"(\"SAME\" padding: {ext - 1} in all along it, not {lo + hi}); \"VALID\" does not split evenly: "
            "split batch or features instead")
      check(max(lo, hi) <= size // split.size(name), "x", x, f"conv2d: the filter reaches {max(lo, hi)} rows "
            f"past a shard of {size // split.size(name)} along {name}: split {name} over fewer devices")
  pads = tuple((0, 0) if split.of(name) else c.pads[i] for i, name in enumerate(("height", "width")))

  def local(x, w, bias=None):
    for i, name in enumerate(("height", "width")):
      if split.of(name):
        x = _halo(x, 1 + i, split.of(name), split.size(name), *c.pads[i])
    w = WinogradFilter(w, kw["tile_size"]) if pre else w
    if split.of("channels"):
      z = conv2d(x, w, padding=pads, bias=None, activation=None, out_dtype=jnp.float32, **kw)
      return _epilogue(lax.psum(z, split.of("channels")), bias, activation).astype(out_dtype)
    return conv2d(x, w, padding=pads, bias=bias, activation=activation, out_dtype=out_dtype, **kw)

  return lambda: split.run(local, operands, _CONV_DIMS, ("batch", "height", "width", "features"))


def conv2d(x, w, *, strides=(1, 1), padding="SAME", rhs_dilation=(1, 1), feature_group_count=1, bias=None,
           activation=None, algorithm=None, tile_size=None, precision=None, out_dtype=None, block_sizes=None,
           implementation=None, interpret=None):
  """2-D convolution, NHWC x HWIO -> NHWC, with a fused ``bias`` and ``activation``.

  Args:
    x: ``[batch, height, width, cin]``, float32 or bfloat16 for the Pallas kernels.
    w: ``[kh, kw, cin / groups, cout]`` (cast to ``x``'s dtype), or a :class:`WinogradFilter`
      from :func:`winograd_filter_transform` (Winograd only, forward only).
    strides, padding, rhs_dilation, feature_group_count: as in ``lax.conv_general_dilated``;
      padding is ``"SAME"``, ``"VALID"`` or ``((top, bottom), (left, right))``.
    bias: ``[cout]`` or None, added in f32 before the activation.
    activation: None, ``"relu"``, ``"silu"``, ``"gelu"`` (exact) or ``"gelu_tanh"``.
    algorithm: ``"direct"``, ``"winograd"`` (3x3, stride 1, undilated, ungrouped; else
      KernelError) or None: Winograd where the shipped tuning data says it wins, else direct;
      and with ``implementation=None``, XLA's convolution where that data has XLA ahead of
      both (:func:`default_algorithm` says which).
    tile_size: Winograd's output tile, 2 (F(2x2,3x3)) or 4 (F(4x4,3x3), the default).
    precision: passed to the kernels' dots and to XLA's conv.
    out_dtype: the result dtype (default ``x``'s).
    block_sizes: a :class:`BlockSizes`; None for the per-generation default.
    implementation, interpret: see :func:`kernels.dispatch`.

  On a mesh (explicitly sharded arrays, or :func:`kernels.sharding` rules) the logical dimensions
  are x ``(batch, height, width, channels)``, w ``(-, -, channels, features)``, bias ``(features,)``:
  batch and features split locally; channels split gives a partial convolution per device and one
  f32 psum, then bias and activation; height / width split exchange halos with the neighbours
  (``ppermute``; stride 1 and "SAME"-size padding on that axis only). See ``_split_conv``.

  Returns:
    ``[batch, ho, wo, cout]``. Differentiable in ``x``, ``w`` and ``bias`` (see the module doc
    for which kernels the backward pass uses).

  Raises:
    KernelError: bad input, naming the argument, before anything is lowered.
  """
  check(activation in ACTIVATIONS, "activation", activation, f"must be one of {ACTIVATIONS}")
  check(algorithm in ALGORITHMS, "algorithm", algorithm, f"must be one of {ALGORITHMS}")
  if tile_size is not None:
    _check_tile(tile_size)
  check(algorithm == "winograd" or tile_size is None or algorithm is None, "tile_size", tile_size,
        'applies to algorithm="winograd" only')
  pre = isinstance(w, WinogradFilter)
  if pre:
    check(algorithm in (None, "winograd"), "w", w, 'a WinogradFilter needs algorithm="winograd" (or None)')
    check(tile_size in (None, w.tile_size), "tile_size", tile_size,
          f"differs from the WinogradFilter's tile_size={w.tile_size}")
    check(w.u.ndim == 4 and w.u.shape[:2] == (w.tile_size + 2,) * 2, "w", w,
          "WinogradFilter.u must be [m + 2, m + 2, cin, cout]")
    check(implementation != "xla", "implementation", implementation,
          "a WinogradFilter runs on the Pallas Winograd kernel only")
    algorithm, tile_size = "winograd", w.tile_size
  c = _validate(x, w, strides, padding, rhs_dilation, feature_group_count, bias)
  split = _split_conv(x, w, bias, c, activation, jnp.dtype(out_dtype or x.dtype), dict(
      strides=strides, rhs_dilation=rhs_dilation, feature_group_count=feature_group_count, algorithm=algorithm,
      tile_size=tile_size, precision=precision, block_sizes=block_sizes, implementation=implementation,
      interpret=interpret))
  if split is not None:
    return split()
  prefer_xla = None
  out_dtype = jnp.dtype(out_dtype or x.dtype)
  blocks = _check_blocks(block_sizes)
  if algorithm == "winograd":
    check(winograd_eligible(c), "algorithm", algorithm,
          f"winograd serves 3x3, stride 1, undilated, ungrouped convolutions; got kernel {c.kh}x{c.kw}, "
          f"strides {c.strides}, rhs_dilation {c.dilation}, feature_group_count {c.groups}")
    tile = tile_size or 4
  elif algorithm == "direct":
    tile = None
  else:
    algorithm, tile = _preferred_algorithm(c, x.dtype) if tile_size is None else ("winograd", tile_size)
    if algorithm == "winograd" and not winograd_eligible(c):
      algorithm, tile = "direct", None
    if tile_size is None and not pre:
      prefer_xla = _prefer_xla(c, x.dtype)
  pallas = functools.partial(_pallas_entry, c=c, algorithm=algorithm, tile=tile, blocks=blocks,
                             activation=activation, out_dtype=out_dtype, precision=precision)

  def xla(x, w, bias):
    z = _lax_conv(x, w.astype(x.dtype), c, precision)
    return _epilogue(z, bias, activation).astype(out_dtype)

  if x.shape[0] == 0:  # an empty batch: nothing to compute, and a Pallas grid of length 0 cannot run
    check(not pre, "x", x, "must hold at least one image with a transformed (Winograd) filter")
    return xla(x, w, bias)
  if pre:  # a transformed filter has no XLA path: the Pallas kernel (interpret mode off TPU)
    return dispatch("conv2d", x, w, bias, pallas=pallas, xla=xla, implementation=implementation or "pallas",
                    interpret=interpret)
  return dispatch("conv2d", x, w, bias, pallas=pallas, xla=xla, implementation=implementation,
                  interpret=interpret, prefer_xla=prefer_xla)
