"""Rotary position embeddings (RoPE) in Pallas, with a cached sin/cos table.

``rope(x, positions)`` rotates each pair of features of ``x`` (``[batch, seq, heads,
head_dim]``, the layout of :func:`kernels.flash_attention`) by an angle proportional to
the token's position: pair ``i`` turns by ``position * theta ** (-2 i / rotary_dim)``.
:func:`rope_reference` is the same rotation written with slices and concatenations.

Conventions
-----------

*Half-split* (``interleaved=False``, GPT-NeoX, Llama, the default): pair ``i`` is
features ``(i, i + rotary_dim / 2)``. *Interleaved* (``interleaved=True``, GPT-J): pair
``i`` is features ``(2 i, 2 i + 1)``. With ``rotary_dim < head_dim`` only the first
``rotary_dim`` features rotate; the rest pass through (GPT-NeoX's partial rotary).
``scaling`` stretches the context: a number ``f`` (or ``RopeScaling("linear", f)``)
divides every position by ``f`` (position interpolation); ``RopeScaling("llama3", ...)``
rescales the low frequencies only, as Llama 3.1 does.

The table cache
---------------

:func:`rope_table` builds, once per ``(max_position, head_dim, rotary_dim, theta,
interleaved, scaling, dtype)``, two ``[max_position, head_dim]`` tables in the layout the
kernel consumes: ``cos`` (1 on pass-through features) and a *signed* ``sin`` (minus on
the first feature of each pair, 0 on pass-through features). The angles are computed in
float64 with NumPy, so a position of a million still turns by the right angle: the
common ``position * inv_freq`` product in float32 errs by up to ``position * 2**-24``
radians, 0.06 rad at a million. The tables live in float32.

How the RoPE kernel works
-------------------------

*Memory bound.* A rotation is 3 FLOPs per element against 4 bytes (bf16 in and out),
so the time is the bytes over the HBM bandwidth: the kernel reads ``x`` once, writes the
result once, and reads the table rows once per block of tokens.

*Rotation without shuffles.* For the features of a head, ``y = x * cos + partner(x) *
sin``, where ``partner`` swaps the two features of each pair and ``sin`` carries the
sign. The partner is two lane rotations (``pltpu.roll``) and a select: by
``rotary_dim / 2`` lanes for the half-split convention, by one lane for the interleaved
one. Blocks are ``[1, block_seq, heads, head_dim]``, so heads sit on sublanes and the
table rows ``[block_seq, head_dim]`` broadcast across them.

*Positions.* Without ``positions`` (``0 .. seq - 1``) the table rows are the blocks of
the table itself; the grid is ``(seq blocks, batch)`` with batch innermost, so a block
of table rows is fetched once for all the batch. With ``positions``, any int32 position
turns by its own angle, whatever ``seq``: a decode step at position 100,000 of a
one-token ``x`` is the normal case. The position is written in base 256 (four digits
cover every int32), each digit ``d`` at place ``256**l`` looks up the float64-built cos
and signed sin of ``d * 256**l * inv_freq`` in a ``[4, 256, head_dim]`` table, and the
angle addition formulas (:func:`compose_rows`'s) sum the four angles in float32, a few
ulp from the float64 angle. A negative position turns by the negative angle (cos alike,
sin negated), never by another position's. XLA does the lookups and the sums, then hands
the kernel ``[batch, seq, head_dim]`` rows twice in float32: per token, ``8 head_dim``
bytes against the ``4 heads head_dim`` bytes of bf16 ``x`` in and out, so ``2 / heads``
more traffic. ``max_position`` is a promise about the positions: concrete positions
outside ``[0, max_position)`` raise :class:`~kernels.base.errors.KernelError`; under
``jit`` they cannot be read, and still get their own angle.

*Lane-sparse heads.* With ``head_dim`` below or not a multiple of 128, the layout a Pallas
call needs for ``[batch, seq, heads, head_dim]`` pads every head to 128 lanes (and few heads
to a whole sublane tile) in HBM, so the kernel moves up to several times the bytes; XLA's
own fusion picks a dense layout for the same array. ``implementation=None`` then runs the
XLA path (``implementation="pallas"`` still runs the kernel).

*Backward.* A rotation is orthogonal: the gradient is the rotation by the opposite
angle, the same kernel with the sign of ``sin`` flipped (``custom_vjp``).

*Fused into attention.* :class:`RotaryEmbedding` holds these options for
``kernels.flash_attention(..., rope=...)``, which rotates q and k tiles in VMEM with
:func:`rotate_tile` (this kernel's rotation) and builds each block's rows with
:func:`compose_rows`, saving this kernel's HBM pass over q and k.
"""
from __future__ import annotations

import dataclasses
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

KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
_LANE_SPARSE = ("head_dim is not a multiple of 128: the [..., heads, head_dim] layout a Pallas call reads "
                "pads each head to 128 lanes in HBM, while XLA's own fusion picks a dense layout, so XLA moves "
                "fewer bytes (implementation='pallas' still runs the kernel)")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Context extension of the rotary frequencies.

  ``kind="linear"``: every position is divided by ``factor`` (position interpolation).
  ``kind="llama3"``: Llama 3.1's rule. Wavelengths shorter than
  ``original_max_position / high_freq_factor`` keep their frequency, longer than
  ``original_max_position / low_freq_factor`` divide it by ``factor``, and those between
  blend the two smoothly.
  """

  kind: str = "linear"
  factor: float = 1.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position: int = 8192


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tokens per block (``block_seq``); None picks the per-generation default."""

  block_seq: int | None = None

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


_FALLBACK_BLOCK_BYTES = 2 * 2**20  # without a table entry: ~2 MiB of x per block


def default_block_sizes(generation=None, dtype=jnp.bfloat16, heads: int = 32, head_dim: int = 128,
                        seq: int | None = None) -> BlockSizes:
  """The shipped default: ``kernels/data/rope_blocks.json`` holds, per generation, the bytes of
  ``x`` per block that ``tools/tune_rope.py`` found fastest; the tokens per block follow from
  the row size (a power of two, at least 8, at most the sequence)."""
  gen = get_chip(generation).name if generation is not None else "v5e"
  entry = tiling.block_table("rope").get(gen, {})
  target = entry.get("block_bytes", _FALLBACK_BLOCK_BYTES)
  row = heads * head_dim * jnp.dtype(dtype).itemsize
  rows = 2 ** max(3, int(math.log2(max(1, target // row))))
  return BlockSizes(rows if seq is None or rows < seq else seq)


def _inv_freq(rotary_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
  inv = theta ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
  if scaling is None:
    return inv
  if scaling.kind == "linear":
    return inv / scaling.factor
  # llama3
  low_wavelen = scaling.original_max_position / scaling.low_freq_factor
  high_wavelen = scaling.original_max_position / scaling.high_freq_factor
  wavelen = 2 * np.pi / inv
  scaled = np.where(wavelen > low_wavelen, inv / scaling.factor, inv)
  smooth = ((scaling.original_max_position / wavelen - scaling.low_freq_factor)
            / (scaling.high_freq_factor - scaling.low_freq_factor))
  blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
  medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return np.where(medium, blended, scaled)


def _feature_layout(head_dim: int, rotary_dim: int, interleaved: bool) -> tuple[np.ndarray, np.ndarray]:
  """Per feature: the index of its frequency (or -1 for pass-through) and the sign of its sin."""
  j = np.arange(head_dim)
  if interleaved:
    freq, sign = j // 2, np.where(j % 2 == 0, -1.0, 1.0)
  else:
    half = rotary_dim // 2
    freq, sign = j % half, np.where(j < half, -1.0, 1.0)
  rotary = j < rotary_dim
  return np.where(rotary, freq, -1), np.where(rotary, sign, 0.0)


@functools.lru_cache(maxsize=32)
def _table(max_position, head_dim, rotary_dim, theta, interleaved, scaling, dtype_name):
  freq, sign = _feature_layout(head_dim, rotary_dim, interleaved)
  angle = np.arange(max_position, dtype=np.float64)[:, None] * _inv_freq(rotary_dim, theta, scaling)[None, :]
  angle = angle[:, np.maximum(freq, 0)]
  cos = np.where(freq >= 0, np.cos(angle), 1.0)
  sin = np.sin(angle) * sign
  return cos.astype(dtype_name), sin.astype(dtype_name)


_DIGITS, _BASE = 4, 256  # positions in base 256: four digits cover every int32


@functools.lru_cache(maxsize=32)
def _digit_table(head_dim, rotary_dim, theta, interleaved, scaling):
  """cos and signed sin of ``d * 256**l * inv_freq`` for digit ``d`` at place ``l``: ``[4, 256, head_dim]`` each."""
  freq, sign = _feature_layout(head_dim, rotary_dim, interleaved)
  place = float(_BASE) ** np.arange(_DIGITS)
  pos = place[:, None] * np.arange(_BASE, dtype=np.float64)[None, :]  # [4, 256], exact in float64
  angle = pos[..., None] * _inv_freq(rotary_dim, theta, scaling)[None, None, :]
  angle = angle[..., np.maximum(freq, 0)]
  cos = np.where(freq >= 0, np.cos(angle), 1.0)
  return cos.astype(np.float32), (np.sin(angle) * sign).astype(np.float32)


def _position_rows(positions, head_dim, rotary_dim, theta, interleaved, scaling):
  """cos and signed sin rows ``[batch, seq, head_dim]`` (float32) of each token's own position (see the module doc)."""
  cos_t, sin_t = _digit_table(head_dim, rotary_dim, theta, interleaved, scaling)
  pos = positions.astype(jnp.int32)
  mag = jnp.abs(pos).astype(jnp.uint32)  # |-2**31| wraps to 2**31 in uint32, as wanted
  cos = sin = None
  for place in range(_DIGITS):
    digit = ((mag >> (8 * place)) & (_BASE - 1)).astype(jnp.int32)
    c = jnp.take(jnp.asarray(cos_t[place]), digit, axis=0, mode="clip")
    s = jnp.take(jnp.asarray(sin_t[place]), digit, axis=0, mode="clip")
    cos, sin = (c, s) if cos is None else (cos * c - sin * s, sin * c + cos * s)
  return cos, jnp.where((pos < 0)[..., None], -sin, sin)


def rope_table(max_position: int, head_dim: int, *, rotary_dim: int | None = None, theta: float = 10000.0,
               interleaved: bool = False, scaling=None, dtype=jnp.float32) -> tuple[np.ndarray, np.ndarray]:
  """The cached ``(cos, signed sin)`` tables, ``[max_position, head_dim]`` each (see the module doc).

  Built in float64 and cast to ``dtype`` once per key; a repeated call returns the same arrays.
  """
  rotary_dim, scaling = _check_options(head_dim, rotary_dim, theta, scaling)
  check(isinstance(max_position, (int, np.integer)) and max_position >= 1, "max_position", max_position,
        "must be a positive int")
  return _table(int(max_position), head_dim, rotary_dim, float(theta), bool(interleaved), scaling,
                jnp.dtype(dtype).name)


def _check_options(head_dim, rotary_dim, theta, scaling):
  rotary_dim = head_dim if rotary_dim is None else rotary_dim
  check(isinstance(rotary_dim, (int, np.integer)) and 2 <= rotary_dim <= head_dim and rotary_dim % 2 == 0,
        "rotary_dim", rotary_dim, f"must be an even int in [2, head_dim={head_dim}]")
  check(isinstance(theta, (int, float)) and theta > 1, "theta", theta, "must be a number > 1")
  if isinstance(scaling, (int, float)) and not isinstance(scaling, bool):
    scaling = RopeScaling("linear", float(scaling))
  check(scaling is None or isinstance(scaling, RopeScaling), "scaling", scaling,
        "must be None, a positive number (linear) or a RopeScaling")
  if scaling is not None:
    check(scaling.kind in ("linear", "llama3"), "scaling", scaling, 'kind must be "linear" or "llama3"')
    check(scaling.factor > 0, "scaling", scaling, "factor must be > 0")
    if scaling.kind == "llama3":
      check(scaling.high_freq_factor > scaling.low_freq_factor > 0 and scaling.original_max_position > 0,
            "scaling", scaling, "llama3 needs high_freq_factor > low_freq_factor > 0 and original_max_position > 0")
  return int(rotary_dim), scaling


@dataclasses.dataclass(frozen=True)
class RotaryEmbedding:
  """A rotary embedding configuration, to fuse into :func:`kernels.flash_attention` (``rope=``).

  The fields are :func:`rope`'s options: ``theta``, ``rotary_dim`` (None: all of ``head_dim``),
  ``interleaved``, ``scaling`` and ``max_position`` (None: no bound; else positions are promised to
  stay below it, and checked where they are concrete). Calling it, ``RotaryEmbedding(...)(x)``, runs the standalone :func:`rope` kernel
  with these options (positions ``0 .. seq - 1`` unless given).
  """

  theta: float = 10000.0
  rotary_dim: int | None = None
  interleaved: bool = False
  scaling: RopeScaling | float | None = None
  max_position: int | None = None

  def resolved(self, head_dim: int) -> "RotaryEmbedding":
    """Validated for ``head_dim`` (KernelError naming the field otherwise): ``rotary_dim`` an int,
    ``scaling`` a :class:`RopeScaling` or None."""
    check(isinstance(self.interleaved, bool), "interleaved", self.interleaved, "must be a bool")
    rotary_dim, scaling = _check_options(head_dim, self.rotary_dim, self.theta, self.scaling)
    if self.max_position is not None:
      check(isinstance(self.max_position, (int, np.integer)) and self.max_position >= 1, "max_position",
            self.max_position, "must be a positive int or None")
    return dataclasses.replace(self, theta=float(self.theta), rotary_dim=rotary_dim, scaling=scaling)

  def table(self, size: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """The cached float32 ``(cos, signed sin)`` tables of positions ``0 .. size - 1`` (:func:`rope_table`)."""
    r = self.resolved(head_dim)
    return rope_table(size, head_dim, rotary_dim=r.rotary_dim, theta=r.theta, interleaved=r.interleaved,
                      scaling=r.scaling)

  def __call__(self, x, positions=None, **kwargs):
    return rope(x, positions, theta=self.theta, rotary_dim=self.rotary_dim, interleaved=self.interleaved,
                scaling=self.scaling, max_position=self.max_position, **kwargs)

  def reference(self, x, positions=None):
    return rope_reference(x, positions, theta=self.theta, rotary_dim=self.rotary_dim,
                          interleaved=self.interleaved, scaling=self.scaling, max_position=self.max_position)


@dataclasses.dataclass(frozen=True)
class _Problem:
  batch: int
  seq: int
  heads: int
  head_dim: int
  rotary_dim: int
  dtype: jnp.dtype


def _validate(x, positions, rotary_dim, theta, scaling, max_position, interleaved=False):
  check(hasattr(x, "shape") and x.ndim == 4, "x", x, "must be [batch, seq, heads, head_dim]")
  check(isinstance(interleaved, (bool, np.bool_)), "interleaved", interleaved, "must be True or False")
  check(jnp.issubdtype(x.dtype, jnp.floating), "x", x, "must be floating point")
  b, s, h, d = x.shape
  check(d % 2 == 0, "x", x, f"head_dim {d} must be even")
  rotary_dim, scaling = _check_options(d, rotary_dim, theta, scaling)
  if positions is not None:
    check(hasattr(positions, "shape") and tuple(positions.shape) == (b, s), "positions", positions,
          f"must be [batch, seq] = {[b, s]}")
    check(jnp.issubdtype(positions.dtype, jnp.integer), "positions", positions, "must be an integer array")
    if jnp.dtype(positions.dtype).itemsize > 4 or jnp.dtype(positions.dtype) == jnp.uint32:
      _check_concrete_range(positions, -2**31, 2**31, "int32's range")
  if max_position is not None:
    check(isinstance(max_position, (int, np.integer)) and max_position >= 1, "max_position", max_position,
          "must be a positive int")
    check(positions is not None or max_position >= s, "max_position", max_position,
          f"must be at least seq = {s} when positions is None")
    if positions is not None:
      _check_concrete_range(positions, 0, int(max_position), f"[0, max_position={int(max_position)})")
  return _Problem(b, s, h, d, rotary_dim, jnp.dtype(x.dtype)), scaling


def _check_concrete_range(positions, lo: int, hi: int, what: str):
  """Concrete positions (not traced under ``jit``) must lie in ``[lo, hi)``."""
  try:
    v = np.asarray(positions)
  except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    return  # traced under jit: not readable here
  if v.size:
    bad = v[(v < lo) | (v >= hi)]
    if bad.size:
      check(False, "positions", positions, f"must lie in {what}; {bad.size} do not (e.g. {bad.flat[0]})")


def _cos_sin(p: "_Problem", positions, theta, interleaved, scaling, max_position):
  """The cos and signed sin rows of every token: the table's first ``seq`` rows, or each position's own."""
  if positions is None:
    cos, sin = rope_table(max_position or p.seq, p.head_dim, rotary_dim=p.rotary_dim, theta=theta,
                          interleaved=interleaved, scaling=scaling)
    return jnp.asarray(cos[:p.seq]), jnp.asarray(sin[:p.seq])
  return _position_rows(positions, p.head_dim, p.rotary_dim, float(theta), bool(interleaved), scaling)


def _partner(x, rotary_dim: int, interleaved: bool):
  """Each rotary feature's pair partner (pass-through features: themselves), by slicing."""
  r = rotary_dim
  rot, rest = x[..., :r], x[..., r:]
  if interleaved:
    pairs = rot.reshape(*rot.shape[:-1], r // 2, 2)
    swapped = jnp.stack([pairs[..., 1], pairs[..., 0]], axis=-1).reshape(rot.shape)
  else:
    swapped = jnp.concatenate([rot[..., r // 2:], rot[..., :r // 2]], axis=-1)
  return jnp.concatenate([swapped, rest], axis=-1) if rest.shape[-1] else swapped


def _rotate_xla(x, cos, sin, *, rotary_dim: int, interleaved: bool):
  """``x * cos + partner(x) * sin`` in float32, the partner built by slicing (independent of the kernel's rolls).

  The partner is taken in ``x``'s dtype before the float32 products, which lets XLA fuse the
  whole rotation into one pass over ``x``.
  """
  if cos.ndim == 2:
    cos, sin = cos[None], sin[None]
  cos, sin = cos[:, :, None, :], sin[:, :, None, :]
  partner = _partner(x, rotary_dim, interleaved)
  return (x.astype(jnp.float32) * cos + partner.astype(jnp.float32) * sin).astype(x.dtype)


def rope_reference(x, positions=None, *, theta=10000.0, rotary_dim=None, interleaved=False, scaling=None,
                   max_position=None):
  """RoPE in plain JAX, in float32 (the result in ``x``'s dtype): the textbook slices and concatenations."""
  p, scaling = _validate(x, positions, rotary_dim, theta, scaling, max_position, interleaved)
  cos, sin = _cos_sin(p, positions, theta, interleaved, scaling, max_position)
  return _rotate_xla(x, cos, sin, rotary_dim=p.rotary_dim, interleaved=interleaved)


def rotate_tile(x, cos, sin, *, rotary_dim: int, interleaved: bool, inverse: bool = False):
  """The in-kernel rotation of an f32 tile whose last axis (lanes) is ``head_dim``:
  ``x * cos + partner(x) * sin`` (``inverse``: ``- partner(x) * sin``, the opposite angle).

  ``cos`` and the signed ``sin`` broadcast against ``x`` (the :func:`rope_table` layout). The
  partner is two lane rotations and a select. Shared by the RoPE kernel and the rotary
  embedding fused into :func:`kernels.flash_attention`."""
  ax = x.ndim - 1
  d = x.shape[ax]
  lane = jax.lax.broadcasted_iota(jnp.int32, x.shape, ax)
  shift = 1 if interleaved else rotary_dim // 2
  ahead = pltpu.roll(x, d - shift, ax)  # x[j + shift]
  behind = pltpu.roll(x, shift, ax)  # x[j - shift]
  first = (lane % 2 == 0) if interleaved else (lane < shift)
  partner = jnp.where(first, ahead, behind)
  return x * cos - partner * sin if inverse else x * cos + partner * sin


def compose_rows(base, offset):
  """cos and signed sin of the angles ``a + b`` from those of ``a`` (``base``, ``[2, head_dim]``:
  row 0 cos, row 1 signed sin) and of ``b`` (``offset``, ``[2, rows, head_dim]``), by the angle
  addition formulas (the sign of the signed sin squares away): ``cos = Ca Cb - Sa Sb``,
  ``sin = Sa Cb + Ca Sb``. In f32 this adds a few ulp to the float64-built table's rounding.
  Pass-through features (cos 1, sin 0) stay so."""
  ca, sa = base[0:1, :], base[1:2, :]
  cb, sb = offset[0], offset[1]
  return ca * cb - sa * sb, sa * cb + ca * sb


def _kernel(x_ref, cos_ref, sin_ref, o_ref, *, p: _Problem, interleaved: bool, inverse: bool):
  x = x_ref[0].astype(jnp.float32)  # [block_seq, heads, head_dim]
  cos = cos_ref[...].reshape(-1, 1, p.head_dim)
  sin = sin_ref[...].reshape(-1, 1, p.head_dim)
  y = rotate_tile(x, cos, sin, rotary_dim=p.rotary_dim, interleaved=interleaved, inverse=inverse)
  o_ref[0] = y.astype(o_ref.dtype)


def _vmem_bytes(p: _Problem, block_seq: int) -> int:
  x_block = [((block_seq, p.heads, p.head_dim), p.dtype)] * 2
  tables = [((block_seq, p.head_dim), jnp.float32)] * 2
  temps = 6 * tiling.block_bytes((block_seq, p.heads, p.head_dim), jnp.float32)  # f32 x, rolls, products
  return tiling.vmem_footprint(x_block + tables) + temps


def _plan(p: _Problem, blocks: BlockSizes) -> int:
  chip = target_chip()
  gen = chip.name if chip is not None and chip.name in ("v4", "v5e", "v5p", "v6e") else None
  if blocks.block_seq is not None:
    bs = blocks.block_seq
    check(bs == p.seq or (1 <= bs <= p.seq and bs % 8 == 0), "block_sizes", blocks,
          f"block_seq must be a multiple of 8 in [8, seq={p.seq}], or equal seq")
    tiling.vmem_limit(_vmem_bytes(p, bs), chip or "v5e", value=blocks)
    return bs
  bs = default_block_sizes(gen, p.dtype, p.heads, p.head_dim, p.seq).block_seq
  c = chip or get_chip("v5e")
  while bs > 8 and int(_vmem_bytes(p, bs) * 1.25) + 2**20 > c.default_scoped_vmem_bytes:
    bs = max(8, bs // 2 // 8 * 8)  # within the default scoped VMEM
  return bs


def _pallas_rotate(x, cos, sin, *, p: _Problem, interleaved: bool, block_seq: int, inverse: bool, interpret):
  """One kernel launch; ``cos``/``sin`` are ``[seq, head_dim]`` (shared by the batch) or ``[batch, seq, head_dim]``."""
  shared = cos.ndim == 2
  grid = (tiling.cdiv(p.seq, block_seq), p.batch)
  x_spec = pl.BlockSpec((1, block_seq, p.heads, p.head_dim), lambda i, b: (b, i, 0, 0))
  if shared:
    t_spec = pl.BlockSpec((block_seq, p.head_dim), lambda i, b: (i, 0))
  else:
    t_spec = pl.BlockSpec((None, block_seq, p.head_dim), lambda i, b: (b, i, 0))
  chip = target_chip() or get_chip("v5e")
  limit = tiling.vmem_limit(_vmem_bytes(p, block_seq), chip)
  params = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"),
                                vmem_limit_bytes=limit)
  kernel = functools.partial(_kernel, p=p, interleaved=interleaved, inverse=inverse)
  return calls.pallas_call(
      kernel, grid=grid, in_specs=[x_spec, t_spec, t_spec], out_specs=x_spec,
      out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), compiler_params=params,
      interpret=interpret, name="rope" if not inverse else "rope_transpose",
      cost_estimate=pl.CostEstimate(flops=3 * x.size, transcendentals=0,
                                    bytes_accessed=2 * x.size * x.dtype.itemsize + 2 * cos.size * 4),
  )(x, cos, sin)


def _pallas_entry(x, cos, sin, *, p: _Problem, interleaved: bool, blocks: BlockSizes, interpret):
  if p.dtype not in KERNEL_DTYPES:
    raise NotImplementedError(f"the Pallas kernel takes float32 and bfloat16, not {p.dtype.name} "
                              "(other dtypes run on the XLA path)")
  block_seq = _plan(p, blocks)
  run = functools.partial(_pallas_rotate, p=p, interleaved=interleaved, block_seq=block_seq, interpret=interpret)

  @jax.custom_vjp
  def f(x, cos, sin):
    return run(x, cos, sin, inverse=False)

  def f_fwd(x, cos, sin):
    return f(x, cos, sin), (cos, sin)

  def f_bwd(res, dy):
    cos, sin = res
    return run(dy, cos, sin, inverse=True), jnp.zeros_like(cos), jnp.zeros_like(sin)

  f.defvjp(f_fwd, f_bwd)
  return f(x, cos, sin)


def _check_blocks(block_sizes) -> BlockSizes:
  if block_sizes is None:
    return BlockSizes()
  if isinstance(block_sizes, int):
    return BlockSizes(block_sizes)
  check(isinstance(block_sizes, BlockSizes), "block_sizes", block_sizes, "must be a rope BlockSizes, an int or None")
  return block_sizes


def rope(x, positions=None, *, theta=10000.0, rotary_dim=None, interleaved=False, scaling=None,
         max_position=None, block_sizes=None, implementation=None, interpret=None):
  """Rotary position embeddings of ``x``, ``[batch, seq, heads, head_dim]``.

  Args:
    x: queries or keys, float32 or bfloat16 (other floats run on the XLA path).
    positions: ``[batch, seq]`` integer positions, any int32 (past ``seq`` for a decode step, offset
      for a packed batch; negative ones turn backwards); None for ``0 .. seq - 1``.
    theta: the base of the frequencies, ``inv_freq_i = theta ** (-2 i / rotary_dim)``.
    rotary_dim: how many leading features rotate (even); None for all of ``head_dim``.
    interleaved: pairs ``(2 i, 2 i + 1)`` (GPT-J) instead of ``(i, i + rotary_dim / 2)`` (GPT-NeoX, Llama).
    scaling: None; a number (linear position interpolation); or a :class:`RopeScaling`.
    max_position: None, or a bound the positions promise to stay below: with concrete
      ``positions``, one outside ``[0, max_position)`` raises :class:`~kernels.base.errors.KernelError`
      (traced ones cannot be read, and turn by their own angle). Without ``positions``, at least ``seq``.
    block_sizes: a :class:`BlockSizes` or tokens per block; None for the per-generation default.
    implementation, interpret: see :func:`kernels.dispatch`.

  Returns:
    The rotated ``x``, same shape and dtype (computed in float32). Differentiable in ``x``
    (the backward pass is the same kernel rotating the other way).

  Raises:
    KernelError: bad input, naming the argument, before anything is lowered.
  """
  p, scaling = _validate(x, positions, rotary_dim, theta, scaling, max_position, interleaved)
  blocks = _check_blocks(block_sizes)
  if x.size == 0:  # no tokens, batch or heads: nothing to rotate
    return x
  dims = ("batch", "seq", "heads", None)
  split = partition.plan("rope", dict(x=x, positions=positions), dict(x=dims, positions=("batch", "seq")),
                         splits={"batch": "local", "seq": "local (with the global positions)", "heads": "local"})
  if split is not None:
    if split.of("seq") and positions is None:  # each shard rotates by its tokens' global positions
      positions = jnp.broadcast_to(jnp.arange(p.seq, dtype=jnp.int32), (p.batch, p.seq))
      max_position = max_position or p.seq
    return split.run(lambda x, positions=None: rope(
        x, positions, theta=theta, rotary_dim=rotary_dim, interleaved=interleaved, scaling=scaling,
        max_position=max_position, block_sizes=block_sizes, implementation=implementation, interpret=interpret),
        dict(x=x, positions=positions), dict(x=dims, positions=("batch", "seq")), dims)
  cos, sin = _cos_sin(p, positions, theta, interleaved, scaling, max_position)
  return dispatch(
      "rope", x, cos, sin,
      pallas=lambda x, cos, sin, interpret: _pallas_entry(x, cos, sin, p=p, interleaved=interleaved,
                                                          blocks=blocks, interpret=interpret),
      xla=functools.partial(_rotate_xla, rotary_dim=p.rotary_dim, interleaved=interleaved),
      implementation=implementation, interpret=interpret,
      prefer_xla=None if p.head_dim % 128 == 0 else _LANE_SPARSE)
