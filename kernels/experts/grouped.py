"""Grouped matmul for mixture-of-experts layers: :func:`gmm` and its weight gradient :func:`tgmm`.

``gmm(lhs, rhs, group_sizes)`` multiplies consecutive row groups of ``lhs [tokens, k]``
(tokens sorted by expert) by their expert's matrix ``rhs[g] [k, n]``: rows
``offsets[g]:offsets[g + 1]`` of the result are ``lhs[those rows] @ rhs[g]``, where
``offsets`` are the running sums of ``group_sizes``; rows past the sum are zero.
``tgmm(lhs, rhs, group_sizes)`` is the other contraction (megablox's convention):
``lhs [k, tokens]``, ``rhs [tokens, n]``, ``out[g] = lhs[:, rows of g] @ rhs[rows of g]``,
the gradient of ``rhs`` in ``gmm``; an empty group gives zeros.
:func:`gmm_reference` and :func:`tgmm_reference` are the same in plain JAX
(``lax.ragged_dot`` / ``lax.ragged_dot_general``).

How the kernels work
--------------------

*Visits.* The rows are cut into m-tiles of ``tm`` rows. A *visit* is an (m-tile, group)
pair whose rows intersect. The grid's middle axis walks the visits in row order, so a
tile that straddles a group boundary is visited once per group it holds, and a group
of 0 rows is never visited by gmm: empty groups cost nothing. The visit tables (per
visit: its m-tile, its group, which blocks to read, and whether the group covers the
tile) and the group offsets are computed from ``group_sizes`` at run time by a few XLA
ops and scalar-prefetched into SMEM, where the index maps and the kernel read them. The
tables have a static length, ``m_tiles + E`` (the most visits any sizes need), but the
grid's visit axis is a run-time bound, the number of real visits: a static axis of
``m_tiles + E`` would spend a grid step's fixed overhead on each unused visit, up to E
per n-tile and K step (with E=8 and 1024-row tiles, 16 of 32 steps at balanced sizes).
libtpu's profiler can abort the process on a run-time grid bound, so
:func:`kernels.compile_for_tpu` compiles such programs without it and
:func:`kernels.estimate_tpu` estimates them in a child process.

*gmm.* Grid ``(n tiles, visits, k tiles)``, semantics (parallel, arbitrary,
arbitrary). Step ``(j, v, kk)`` multiplies the lhs block ``(tile(v), kk)`` by the rhs
block ``(group(v), kk, j)`` into an f32 VMEM accumulator ``[tm, tn]`` (K innermost: the
first step zeroes it and every step adds, so each path has one dot site, which keeps
libtpu's compile time down; with one K step the product goes straight out). A visit whose group does not cover the tile
multiplies only the 128-row sub-tiles its group intersects (one smaller dot each), so a
tile shared by several small groups costs about one tile of MXU work in all, though
each group's rhs block is still fetched. At the last K step the visit writes its rows
of the output block: all of them (a plain store) when the group covers the tile, else
a select on the rows in ``[start, end)`` of its group,
keeping the rows other visits of the same tile wrote (they are consecutive visits, so
the output block stays in VMEM between them and goes to HBM once). The rows past the
sum of the group sizes form one more "group" whose visits write zeros and read
nothing (their index maps repeat the last computing visit's blocks). With
``transpose_rhs`` the rhs block is ``(tn, tk)`` and the MXU takes it transposed.

*tgmm.* Grid ``(k tiles, n tiles, visits)``: the visits (over the token dimension, the
contraction) are innermost and the output block ``[group(v), i, j]`` stays in VMEM
while consecutive visits belong to the same group. Each visit computes
``lhs[:, tile] @ rhs[tile]`` with the rows outside the group selected to zero in both
operands (only in a tile the group does not cover; the rest of a partial tile is other
groups' rows or stale VMEM). A group's first visit sets the f32 accumulator, later ones
add, and its last writes the block; a group seen in one visit (its rows fit one tile)
writes its product straight out, skipping the accumulator's VMEM round trip, the
common case with tall tiles. An empty group has one visit that reads nothing and writes zeros
(the ``[E, k, n]`` result must be written); rows past the sum are never read.

*Backward* (``custom_vjp``). ``d lhs = gmm(d out, rhs, transpose_rhs=not
transpose_rhs)`` and ``d rhs = tgmm`` of ``lhs`` and ``d out``. tgmm's kernel also
takes its left operand token-major (``[tokens, k]``, contracting dimension 0 on the
MXU), so the backward never transposes ``lhs`` or ``d out`` in HBM.

*Quantized rhs.* int8 or float8 ``rhs`` with ``rhs_scale`` (one f32 scale per expert and
output column, ``[E, n]``): each rhs tile is converted to ``lhs``'s dtype in VMEM, the
products accumulate in f32, and the visit's group's scales multiply the sum once,
before the write (``kernels.quantized_matmul``'s per-channel convention). Not
differentiable.

*Block sizes.* :class:`GmmBlockSizes` ``(tm, tk, tn)``; the defaults per generation are
in ``kernels/data/gmm_blocks.json`` (``tools/tune_gmm.py``). Each block is a multiple of
128 or covers its dimension. Smaller ``tm`` wastes less work at group boundaries (a
straddled tile is multiplied once per group it holds), larger tiles move fewer bytes
per FLOP.

*Estimating it.* libtpu's cost model reads scalar-prefetched values as 0, so an
estimate of the dynamic kernel sees every visit in group 0, tile 0, and no DMA moves:
it is not trustworthy. :func:`gmm_static_groups` and :func:`tgmm_static_groups` run the
same kernel bodies and index maps with the visit tables built by NumPy from concrete
group sizes and read as Python constants (a step function of the visit index), so the
compiler sees the real block sequence; the tests check in interpret mode that they give
the dynamic kernel's results.

*Backend choice* (:func:`kernels.dispatch`): ``implementation=None`` runs the Pallas
kernels when lowered for TPU and the references elsewhere.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kernels.experts import grouped_kernels as K
from kernels.base import partition
from kernels.base import tiling
from kernels.base.backend import dispatch, target_chip
from kernels.base.errors import KernelError, TilingError, check
from kernels.base.hardware import get_chip

__all__ = ["GmmBlockSizes", "default_block_sizes", "gmm", "gmm_reference", "gmm_static_groups", "tgmm",
           "tgmm_reference", "tgmm_static_groups"]

FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
QUANT_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
# The quantized rhs dtypes the Pallas kernel lowers for, per generation (AOT compiles, see the tests);
# elsewhere implementation=None runs the XLA reference.
QUANT_RHS_LOWERS = {gen: ("int8", "float8_e4m3fn", "float8_e5m2") for gen in ("v4", "v5e", "v5p", "v6e")}


# ---------------------------------------------------------------------------------
# Block sizes
# ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GmmBlockSizes:
  """Rows per m-tile, contraction per K step, output columns per n-tile.

  ``None`` picks the per-generation default. Each must be a multiple of 128 or at least
  its dimension (then the block covers it). For :func:`tgmm`, ``tk`` and ``tn`` tile the
  ``[k, n]`` result and ``tm`` the (contracted) tokens.
  """

  tm: int | None = None
  tk: int | None = None
  tn: int | None = None

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


_FALLBACK = {"gmm": (512, 1024, 1024), "tgmm": (512, 1024, 1024)}


def default_block_sizes(generation=None, kernel: str = "gmm") -> GmmBlockSizes:
  """The shipped default blocks of ``kernel`` ("gmm" or "tgmm") on ``generation`` (None: v5e),
  from ``kernels/data/gmm_blocks.json``."""
  gen = get_chip(generation).name if generation is not None else "v5e"
  entry = tiling.block_table("gmm").get(gen, {}).get(kernel)
  if not entry:
    return GmmBlockSizes(*_FALLBACK[kernel])
  return GmmBlockSizes(entry["tm"], entry["tk"], entry["tn"])


def _check_blocks(block_sizes) -> GmmBlockSizes:
  if block_sizes is None:
    return GmmBlockSizes()
  if isinstance(block_sizes, (tuple, list)) and len(block_sizes) == 3:
    block_sizes = GmmBlockSizes(*block_sizes)
  check(isinstance(block_sizes, GmmBlockSizes), "block_sizes", block_sizes,
        "must be None, a GmmBlockSizes or a (tm, tk, tn) tuple")
  for name in ("tm", "tk", "tn"):
    v = getattr(block_sizes, name)
    check(v is None or (isinstance(v, int) and not isinstance(v, bool) and v > 0), "block_sizes", block_sizes,
          f"{name} must be a positive int or None")
  return block_sizes


def _legal(b: int, d: int, name: str, blocks) -> int:
  if b >= d:
    return d
  if b % tiling.LANES:
    raise TilingError("block_sizes", blocks, f"{name}={b} must be a multiple of {tiling.LANES} or cover its "
                      f"dimension ({d})")
  return b


def _vmem_bytes(kernel: str, tm, tk, tn, lhs_dtype, rhs_dtype, out_dtype, k: int | None = None) -> int:
  if kernel == "gmm":
    blocks = [((tm, tk), lhs_dtype), ((tk, tn), rhs_dtype), ((tm, tn), out_dtype), ((1, tn), jnp.float32)]
    scratch = [((tm, tn), jnp.float32), ((tm, tk), lhs_dtype)]  # accumulator; Mosaic's copy of the lhs tile
    # Mosaic gives each dot's f32 result its own VMEM: the whole-tile dot and the sub-tile dots,
    # tm rows each, counted for three K-step variants where K takes several blocks. The kernel
    # now has one (two with a K tail), so this over-counts there, by more than half for the E8
    # backward's d lhs kernel; it is kept because the shipped blocks and every stored estimate
    # were chosen under it.
    scratch += [((tm, tn), jnp.float32)] * (2 * (1 if k is not None and tk >= k else 3))
    if jnp.dtype(rhs_dtype) != jnp.dtype(lhs_dtype):
      scratch.append(((tk, tn), lhs_dtype))  # the converted rhs tile
  else:
    blocks = [((tk, tm), lhs_dtype), ((tm, tn), rhs_dtype), ((tk, tn), out_dtype)]
    # the accumulator, the product (one live [tk, tn] f32 value), and the masked copies
    scratch = [((tk, tn), jnp.float32), ((tk, tn), jnp.float32), ((tk, tm), lhs_dtype), ((tm, tn), rhs_dtype)]
  return tiling.vmem_footprint(blocks, scratch=scratch)


def _plan(kernel: str, m: int, k: int, n: int, experts: int, blocks: GmmBlockSizes, lhs_dtype, rhs_dtype,
          out_dtype, chip=None):
  """(Plan, vmem_limit): explicit sizes checked, defaults filled and shrunk to fit VMEM."""
  chip = chip or target_chip()
  d = default_block_sizes(chip.name if chip else None, kernel)
  explicit = [v is not None for v in (blocks.tm, blocks.tk, blocks.tn)]
  tm = _legal(blocks.tm or d.tm, m, "tm", blocks)
  tk = _legal(blocks.tk or d.tk, k, "tk", blocks)
  # gmm: a default tn within 1.5x of n becomes n (one n-tile reads lhs once instead of twice).
  # tgmm keeps its tn: a wider [tk, tn] f32 product does not fit VMEM beside its blocks.
  widen = kernel == "gmm" and n <= 1.5 * d.tn
  tn = _legal(blocks.tn or (n if widen else d.tn), n, "tn", blocks)
  c = get_chip(chip or "v5e")

  def need(tm, tk, tn):
    return _vmem_bytes(kernel, tm, tk, tn, lhs_dtype, rhs_dtype, out_dtype, k)
  while 1.25 * need(tm, tk, tn) + (1 << 20) > c.vmem_bytes:  # shrink the defaults (never an explicit size)
    options = [(v, i) for i, (v, e) in enumerate(zip((tm, tk, tn), explicit)) if not e and v > 128 and v % 256 == 0]
    if not options:
      break
    _, i = max(options)
    tm, tk, tn = [v // 2 if j == i else v for j, v in enumerate((tm, tk, tn))]

  def even(b, dim):  # the same number of blocks, split evenly: no mostly-empty last block on the MXU
    return b if b >= dim else min(b, tiling.round_up(tiling.cdiv(dim, tiling.cdiv(dim, b)), tiling.LANES))
  tk = tk if explicit[1] else even(tk, k)  # e.g. k = 14336 (gmm's backward) at tk = 4096: 4 blocks of 3584
  tn = tn if explicit[2] else even(tn, n)
  limit = tiling.vmem_limit(need(tm, tk, tn), c, value=blocks)
  return K.Plan(tm, tk, tn, m, k, n, experts), limit


# ---------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------


def _is_array(x) -> bool:
  return hasattr(x, "shape") and hasattr(x, "dtype")


def _check_group_sizes(group_sizes, experts_name: str, experts: int, tokens: int):
  check(_is_array(group_sizes), "group_sizes", group_sizes, "must be an integer array [experts]")
  check(jnp.issubdtype(group_sizes.dtype, jnp.integer), "group_sizes", group_sizes,
        f"must have an integer dtype (int32), not {jnp.dtype(group_sizes.dtype).name}")
  check(group_sizes.ndim == 1, "group_sizes", group_sizes, "must be 1-D: one size per expert")
  check(group_sizes.shape[0] == experts, "group_sizes", group_sizes,
        f"has {group_sizes.shape[0]} groups but {experts_name} has {experts} experts")
  check(experts > 0, "group_sizes", group_sizes, "must have at least one group")
  if not isinstance(group_sizes, jax.core.Tracer):
    gs = np.asarray(group_sizes)
    check(bool((gs >= 0).all()), "group_sizes", group_sizes, "sizes must be non-negative")
    check(int(gs.sum()) <= tokens, "group_sizes", group_sizes,
          f"sum to {int(gs.sum())}, more than the {tokens} tokens (rows)")


def _float_dtype(name, x, allowed, what):
  d = jnp.dtype(x.dtype)
  check(d in allowed, name, x, f"dtype {d.name} is not supported; {what}")
  return d


def _out_dtype(preferred_element_type, default):
  if preferred_element_type is None:
    return jnp.dtype(default)
  d = jnp.dtype(preferred_element_type)
  check(d in FLOAT_DTYPES + (jnp.dtype(jnp.float64),), "preferred_element_type", preferred_element_type,
        "must be None, float32 or bfloat16")
  return d


@dataclasses.dataclass(frozen=True)
class _Problem:
  m: int
  k: int
  n: int
  experts: int
  transpose_rhs: bool
  lhs_dtype: jnp.dtype
  rhs_dtype: jnp.dtype
  out_dtype: jnp.dtype
  quantized: bool


def _validate_gmm(lhs, rhs, group_sizes, transpose_rhs, preferred_element_type, rhs_scale) -> _Problem:
  check(_is_array(lhs) and lhs.ndim == 2, "lhs", lhs, "must be a 2-D array [tokens, k]")
  check(_is_array(rhs) and rhs.ndim == 3, "rhs", rhs,
        "must be a 3-D array [experts, k, n] ([experts, n, k] with transpose_rhs=True)")
  check(isinstance(transpose_rhs, bool), "transpose_rhs", transpose_rhs, "must be True or False")
  m, k = lhs.shape
  experts = rhs.shape[0]
  rk, n = (rhs.shape[2], rhs.shape[1]) if transpose_rhs else rhs.shape[1:]
  check(rk == k, "rhs", rhs, f"contracts over {rk} but lhs has k={k} columns "
        f"({'[experts, n, k]' if transpose_rhs else '[experts, k, n]'} expected)")
  check(m > 0 and k > 0 and n > 0, "lhs", lhs, "tokens, k and n must be positive")
  _check_group_sizes(group_sizes, "rhs", experts, m)
  ld = _float_dtype("lhs", lhs, FLOAT_DTYPES + (jnp.dtype(jnp.float64),),
                    "lhs must be bfloat16 or float32 (float64 on the XLA path)")
  rd = _float_dtype("rhs", rhs, FLOAT_DTYPES + (jnp.dtype(jnp.float64),) + QUANT_DTYPES,
                    "rhs must be bfloat16, float32, int8 or float8 (with rhs_scale)")
  quantized = rd in QUANT_DTYPES
  if quantized:
    check(rhs_scale is not None, "rhs_scale", rhs_scale, f"is required with {rd.name} rhs (per-channel scales)")
  else:
    check(rd == ld, "rhs", rhs, f"must have lhs's dtype ({ld.name}) unless quantized (int8/float8), not {rd.name}")
  if rhs_scale is not None:
    check(quantized, "rhs_scale", rhs_scale, "applies to int8/float8 rhs only")
    check(_is_array(rhs_scale) and jnp.issubdtype(rhs_scale.dtype, jnp.floating), "rhs_scale", rhs_scale,
          "must be a floating-point array")
    check(tuple(rhs_scale.shape) in ((experts, n), (experts, 1, n)), "rhs_scale", rhs_scale,
          f"must have shape {(experts, n)} (one scale per expert and output column) or {(experts, 1, n)}")
  od = _out_dtype(preferred_element_type, ld)
  return _Problem(m, k, n, experts, transpose_rhs, ld, rd, od, quantized)


def _validate_tgmm(lhs, rhs, group_sizes, preferred_element_type) -> _Problem:
  check(_is_array(lhs) and lhs.ndim == 2, "lhs", lhs, "must be a 2-D array [k, tokens]")
  check(_is_array(rhs) and rhs.ndim == 2, "rhs", rhs, "must be a 2-D array [tokens, n]")
  k, m = lhs.shape
  check(rhs.shape[0] == m, "rhs", rhs, f"has {rhs.shape[0]} tokens (rows) but lhs [k, tokens] has {m}")
  check(m > 0 and k > 0 and rhs.shape[1] > 0, "lhs", lhs, "tokens, k and n must be positive")
  check(_is_array(group_sizes), "group_sizes", group_sizes, "must be an integer array [experts]")
  experts = group_sizes.shape[0] if group_sizes.ndim == 1 else -1
  _check_group_sizes(group_sizes, "group_sizes", experts, m)
  ld = _float_dtype("lhs", lhs, FLOAT_DTYPES + (jnp.dtype(jnp.float64),),
                    "lhs must be bfloat16 or float32 (float64 on the XLA path)")
  rd = _float_dtype("rhs", rhs, FLOAT_DTYPES + (jnp.dtype(jnp.float64),), "rhs must be bfloat16 or float32")
  check(rd == ld, "rhs", rhs, f"must have lhs's dtype ({ld.name}), not {rd.name}")
  od = _out_dtype(preferred_element_type, ld)
  return _Problem(m, k, rhs.shape[1], experts, False, ld, rd, od, False)


# ---------------------------------------------------------------------------------
# References (pure JAX)
# ---------------------------------------------------------------------------------


def _row_groups(group_sizes, m: int):
  """The group of each row ([m] int32; E for rows past the sum)."""
  ends = jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0))
  return jnp.searchsorted(ends, jnp.arange(m, dtype=jnp.int32), side="right").astype(jnp.int32)


def _clipped_sizes(group_sizes, m: int):
  """The sizes as the kernels read them (a negative size counts as 0, the running sum stops at ``m``):
  ``lax.ragged_dot`` takes them as they are, so a negative size would move the groups after it."""
  ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0)), m)
  return jnp.diff(ends, prepend=0)


def _gmm_xla(lhs, rhs, group_sizes, rhs_scale, *, p: _Problem):
  w = jnp.swapaxes(rhs, 1, 2) if p.transpose_rhs else rhs
  acc = jnp.float64 if jnp.float64 in (p.lhs_dtype, p.out_dtype) else jnp.float32
  if p.quantized:
    w = w.astype(p.lhs_dtype)
  out = lax.ragged_dot(lhs, w, _clipped_sizes(group_sizes, p.m), preferred_element_type=acc)
  gid = _row_groups(group_sizes, p.m)
  if p.quantized:
    scale = rhs_scale.reshape(p.experts, p.n).astype(jnp.float32)
    out = out * jnp.take(scale, jnp.minimum(gid, p.experts - 1), axis=0)
  out = jnp.where((gid < p.experts)[:, None], out, 0)  # rows past the sum are zero
  return out.astype(p.out_dtype)


def _tgmm_xla(lhs, rhs, group_sizes, *, p: _Problem):
  acc = jnp.float64 if jnp.float64 in (p.lhs_dtype, p.out_dtype) else jnp.float32
  gid = _row_groups(group_sizes, p.m)
  rhs = jnp.where((gid < p.experts)[:, None], rhs, 0)  # rows past the sum take no part
  dims = lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((1,), (0,)), ((), ())),
                                       lhs_ragged_dimensions=[1], rhs_group_dimensions=[])
  out = lax.ragged_dot_general(lhs, rhs, _clipped_sizes(group_sizes, p.m), dims, preferred_element_type=acc)
  return out.astype(p.out_dtype)


def gmm_reference(lhs, rhs, group_sizes, *, transpose_rhs=False, preferred_element_type=None, rhs_scale=None):
  """Pure-JAX :func:`gmm` (``lax.ragged_dot``, accumulated in f32; rows past the sum zero)."""
  p = _validate_gmm(lhs, rhs, group_sizes, transpose_rhs, preferred_element_type, rhs_scale)
  return _gmm_xla(lhs, rhs, group_sizes, rhs_scale, p=p)


def tgmm_reference(lhs, rhs, group_sizes, *, preferred_element_type=None):
  """Pure-JAX :func:`tgmm` (``lax.ragged_dot_general`` with a ragged contraction, f32 sums)."""
  p = _validate_tgmm(lhs, rhs, group_sizes, preferred_element_type)
  return _tgmm_xla(lhs, rhs, group_sizes, p=p)


# ---------------------------------------------------------------------------------
# The Pallas path
# ---------------------------------------------------------------------------------


def _tables(which: str, group_sizes, static_sizes, m: int, tm: int):
  build = K.gmm_tables if which == "gmm" else K.tgmm_tables
  if static_sizes is not None:
    return build(np.asarray(static_sizes, np.int32), m, tm, xp=np), True
  return build(group_sizes, m, tm, xp=jnp), False


def _run_gmm(lhs, rhs, group_sizes, rhs_scale, *, transpose_rhs, out_dtype, blocks, static_sizes, interpret):
  m, k = lhs.shape
  experts = rhs.shape[0]
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  plan, limit = _plan("gmm", m, k, n, experts, blocks, lhs.dtype, rhs.dtype, out_dtype)
  tables, static = _tables("gmm", group_sizes, static_sizes, m, plan.tm)
  scale = None if rhs_scale is None else rhs_scale.reshape(experts, 1, n).astype(jnp.float32)
  return K.gmm_call(lhs, rhs, scale, tables, plan=plan, transpose_rhs=transpose_rhs, out_dtype=out_dtype,
                    static=static, interpret=interpret, vmem_limit=limit)


def _run_tgmm(lhs, rhs, group_sizes, *, experts, lhs_tokens_major, out_dtype, blocks, static_sizes, interpret):
  if lhs_tokens_major:
    m, k = lhs.shape
  else:
    k, m = lhs.shape
  n = rhs.shape[1]
  plan, limit = _plan("tgmm", m, k, n, experts, blocks, lhs.dtype, rhs.dtype, out_dtype)
  tables, static = _tables("tgmm", group_sizes, static_sizes, m, plan.tm)
  return K.tgmm_call(lhs, rhs, tables, plan=plan, lhs_tokens_major=lhs_tokens_major, out_dtype=out_dtype,
                     static=static, interpret=interpret, vmem_limit=limit)


def _check_kernel_dtypes(p: _Problem):
  if p.lhs_dtype not in FLOAT_DTYPES or p.out_dtype not in FLOAT_DTYPES:
    raise NotImplementedError(f"the Pallas kernels take bfloat16 and float32, not {p.lhs_dtype.name} lhs and "
                              f"{p.out_dtype.name} output (float64 runs on the XLA path)")


def _gmm_pallas(lhs, rhs, group_sizes, rhs_scale, *, p: _Problem, blocks, static_sizes, interpret):
  _check_kernel_dtypes(p)
  chip = target_chip()
  if p.quantized and not interpret and chip is not None and p.rhs_dtype.name not in QUANT_RHS_LOWERS[chip.name]:
    raise NotImplementedError(f"{p.rhs_dtype.name} rhs does not lower on TPU {chip.name} (Mosaic cannot convert it "
                              f"there); supported: {', '.join(QUANT_RHS_LOWERS[chip.name]) or 'none'}")
  run = functools.partial(_run_gmm, blocks=blocks, static_sizes=static_sizes, interpret=interpret)
  if p.quantized:  # not differentiable
    return run(lhs, rhs, group_sizes, rhs_scale, transpose_rhs=p.transpose_rhs, out_dtype=p.out_dtype)

  @jax.custom_vjp
  def f(lhs, rhs, group_sizes):
    return run(lhs, rhs, group_sizes, None, transpose_rhs=p.transpose_rhs, out_dtype=p.out_dtype)

  def f_fwd(lhs, rhs, group_sizes):
    return f(lhs, rhs, group_sizes), (lhs, rhs, group_sizes)

  def f_bwd(res, dout):
    lhs, rhs, group_sizes = res
    return (*_gmm_backward(lhs, rhs, group_sizes, dout, p=p, static_sizes=static_sizes, interpret=interpret), None)

  f.defvjp(f_fwd, f_bwd)
  return f(lhs, rhs, group_sizes)


def _gmm_backward(lhs, rhs, group_sizes, dout, *, p: _Problem, static_sizes, interpret):
  """``(d lhs, d rhs)`` of ``gmm(lhs, rhs)`` at ``dout``: a gmm against the transposed ``rhs``
  and a tgmm, at their default blocks (also the fused gate-and-up kernel's, kernels.moe)."""
  dout = dout.astype(p.lhs_dtype)
  none = GmmBlockSizes()
  dlhs = _run_gmm(dout, rhs, group_sizes, None, transpose_rhs=not p.transpose_rhs, out_dtype=p.lhs_dtype,
                  blocks=none, static_sizes=static_sizes, interpret=interpret)
  if p.transpose_rhs:  # rhs [E, n, k]: d rhs[g] = dout[rows]^T @ lhs[rows]
    drhs = _run_tgmm(dout, lhs, group_sizes, experts=p.experts, lhs_tokens_major=True, out_dtype=p.rhs_dtype,
                     blocks=none, static_sizes=static_sizes, interpret=interpret)
  else:  # rhs [E, k, n]: d rhs[g] = lhs[rows]^T @ dout[rows]
    drhs = _run_tgmm(lhs, dout, group_sizes, experts=p.experts, lhs_tokens_major=True, out_dtype=p.rhs_dtype,
                     blocks=none, static_sizes=static_sizes, interpret=interpret)
  return dlhs, drhs


def _tgmm_pallas(lhs, rhs, group_sizes, *, p: _Problem, blocks, static_sizes, interpret):
  _check_kernel_dtypes(p)
  return _run_tgmm(lhs, rhs, group_sizes, experts=p.experts, lhs_tokens_major=False, out_dtype=p.out_dtype,
                   blocks=blocks, static_sizes=static_sizes, interpret=interpret)


# ---------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------


def gmm(lhs, rhs, group_sizes, *, transpose_rhs=False, preferred_element_type=None, rhs_scale=None,
        block_sizes=None, implementation=None, interpret=None):
  """Grouped matmul: rows ``offsets[g]:offsets[g + 1]`` of the result are ``lhs[rows] @ rhs[g]``.

  Args:
    lhs: ``[tokens, k]``, bfloat16 or float32, rows sorted by group.
    rhs: ``[experts, k, n]`` (``[experts, n, k]`` with ``transpose_rhs=True``), ``lhs``'s
      dtype, or int8 / float8 with ``rhs_scale``.
    group_sizes: ``[experts]`` integer (int32) rows per group, summing to at most
      ``tokens``; rows past the sum come out zero. Concrete sizes are checked (a sum
      above ``tokens`` or a negative size is a :class:`~kernels.base.errors.KernelError`);
      traced sizes are clipped (a negative size counts as 0, the running sum stops at
      ``tokens``).
    transpose_rhs: ``rhs`` is ``[experts, n, k]``.
    preferred_element_type: the result's dtype (None: ``lhs``'s); sums are f32.
    rhs_scale: per-channel dequantization scales ``[experts, n]`` (or ``[experts, 1, n]``)
      for int8 / float8 ``rhs``: ``out = (lhs @ rhs[g]) * rhs_scale[g]``.
    block_sizes: :class:`GmmBlockSizes` or ``(tm, tk, tn)``; None for the defaults.
    implementation, interpret: see :func:`kernels.dispatch`.

  Returns:
    ``[tokens, n]``. Differentiable in ``lhs`` and ``rhs`` (the backward runs
    :func:`gmm` and :func:`tgmm`'s kernel) unless ``rhs`` is quantized.

  Sharded (under ``jit`` on a mesh, see :mod:`kernels.base.partition`): ``rhs``'s ``n``
  (``features``) splits locally. Its experts (``experts``, with ``group_sizes`` and
  ``rhs_scale``) split as expert parallelism: ``lhs`` stays whole on every device, each device
  runs its own groups' rows (``lhs`` rotated so they come first: rows of other groups give
  zeros), and one ``psum`` over the experts' axes adds the disjoint rows (exact: the other
  devices add zeros). ``k`` (``contract``, in ``lhs`` and ``rhs``) splits with a ``psum`` of the
  f32 partial products. The token rows never split: their groups are global.
  """
  p = _validate_gmm(lhs, rhs, group_sizes, transpose_rhs, preferred_element_type, rhs_scale)
  blocks = _check_blocks(block_sizes)
  split = _gmm_partition(lhs, rhs, group_sizes, rhs_scale, transpose_rhs)
  if split is not None:
    return _gmm_sharded(split, p, lhs, rhs, group_sizes, rhs_scale, block_sizes, implementation, interpret)
  return dispatch(
      "gmm", lhs, rhs, group_sizes, rhs_scale,
      pallas=lambda lhs, rhs, gs, sc, interpret: _gmm_pallas(lhs, rhs, gs, sc, p=p, blocks=blocks,
                                                             static_sizes=None, interpret=interpret),
      xla=lambda lhs, rhs, gs, sc: _gmm_xla(lhs, rhs, gs, sc, p=p),
      implementation=implementation, interpret=interpret)


def tgmm(lhs, rhs, group_sizes, *, preferred_element_type=None, block_sizes=None, implementation=None,
         interpret=None):
  """Grouped transposed matmul: ``out[g] = lhs[:, rows of g] @ rhs[rows of g]`` (``gmm``'s weight gradient).

  Args:
    lhs: ``[k, tokens]``, bfloat16 or float32.
    rhs: ``[tokens, n]``, ``lhs``'s dtype.
    group_sizes: ``[experts]`` integer, as in :func:`gmm`; rows past the sum are ignored.
    preferred_element_type: the result's dtype (None: ``lhs``'s); sums are f32.
    block_sizes: :class:`GmmBlockSizes` ``(tm, tk, tn)``: ``tm`` tiles the tokens,
      ``tk`` and ``tn`` the result.
    implementation, interpret: see :func:`kernels.dispatch`.

  Returns:
    ``[experts, k, n]``; an empty group's slice is zero. Not differentiable itself.

  Sharded (under ``jit`` on a mesh): ``k`` (``contract``, as in the :func:`gmm` whose weight
  gradient this is) and ``n`` (``features``) split locally; a split ``experts`` (of
  ``group_sizes``, or named by :func:`kernels.sharding`) gives each device its own groups'
  slice of the result, from its groups' rows (no collective). The token rows never split.
  """
  p = _validate_tgmm(lhs, rhs, group_sizes, preferred_element_type)
  blocks = _check_blocks(block_sizes)
  dims = dict(lhs=("contract", None), rhs=(None, "features"), group_sizes=("experts",))
  operands = dict(lhs=lhs, rhs=rhs, group_sizes=group_sizes)
  split = partition.plan("tgmm", operands, dims, splits=_TGMM_SPLITS)
  if split is not None:
    ex = split.of("experts")

    def local(lhs, rhs, group_sizes, all_sizes):
      if ex:
        start = _group_start(all_sizes, group_sizes.shape[0], ex, p.m)
        lhs, rhs = jnp.roll(lhs, -start, axis=1), jnp.roll(rhs, -start, axis=0)  # this device's rows first
      return tgmm(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type, block_sizes=block_sizes,
                  implementation=implementation, interpret=interpret)
    return split.run(local, dict(operands, all_sizes=group_sizes), dict(dims, all_sizes=(None,)),
                     ("experts", "contract", "features"))
  return dispatch(
      "tgmm", lhs, rhs, group_sizes,
      pallas=lambda lhs, rhs, gs, interpret: _tgmm_pallas(lhs, rhs, gs, p=p, blocks=blocks, static_sizes=None,
                                                          interpret=interpret),
      xla=lambda lhs, rhs, gs: _tgmm_xla(lhs, rhs, gs, p=p),
      implementation=implementation, interpret=interpret)


# ---------------------------------------------------------------------------------
# Sharded: one shard_map around the kernel (kernels.base.partition)
# ---------------------------------------------------------------------------------

_GMM_SPLITS = {"experts": "expert parallelism: each device its groups' rows, one psum of the disjoint rows",
               "features": "local", "contract": "psum of the partial products"}
_TGMM_SPLITS = {"experts": "each device its groups' slice, from its groups' rows", "features": "local",
                "contract": "local"}


def _gmm_dims(transpose_rhs: bool, rhs_scale):
  w = ("experts", "features", "contract") if transpose_rhs else ("experts", "contract", "features")
  scale = None if rhs_scale is None else ("experts",) + (None,) * (rhs_scale.ndim - 2) + ("features",)
  return dict(lhs=(None, "contract"), rhs=w, group_sizes=("experts",), rhs_scale=scale)


def _gmm_partition(lhs, rhs, group_sizes, rhs_scale, transpose_rhs):
  operands = dict(lhs=lhs, rhs=rhs, group_sizes=group_sizes, rhs_scale=rhs_scale)
  return partition.plan("gmm", operands, _gmm_dims(transpose_rhs, rhs_scale), splits=_GMM_SPLITS)


def _group_start(all_sizes, local_groups: int, axes, m: int):
  """The first row of this device's groups: the sizes of the groups before them, summed as the
  kernel reads them (negative sizes count as 0, the running sum stops at ``m``)."""
  _, i = partition.axis_position(axes)
  before = jnp.arange(all_sizes.shape[0]) < i * local_groups
  return jnp.minimum(jnp.sum(jnp.where(before, jnp.maximum(all_sizes.astype(jnp.int32), 0), 0)), m)


def _gmm_sharded(split, p: _Problem, lhs, rhs, group_sizes, rhs_scale, block_sizes, implementation, interpret):
  """gmm on every device's shards (see :func:`gmm`'s "Sharded")."""
  ex, kx = split.of("experts"), split.of("contract")
  operands = dict(lhs=lhs, rhs=rhs, group_sizes=group_sizes, rhs_scale=rhs_scale, all_sizes=group_sizes)
  dims = dict(_gmm_dims(p.transpose_rhs, rhs_scale), all_sizes=(None,))

  def local(lhs, rhs, group_sizes, all_sizes, rhs_scale=None):
    start = _group_start(all_sizes, rhs.shape[0], ex, p.m) if ex else None
    if ex:
      lhs = jnp.roll(lhs, -start, axis=0)  # this device's groups' rows first; the rest past their sum: zeros
    out = gmm(lhs, rhs, group_sizes, transpose_rhs=p.transpose_rhs, rhs_scale=rhs_scale,
              preferred_element_type=jnp.float32 if kx else p.out_dtype, block_sizes=block_sizes,
              implementation=implementation, interpret=interpret)
    if ex:
      out = jnp.roll(out, start, axis=0)
    if ex or kx:
      out = lax.psum(out, tuple(ex) + tuple(kx))
    return out.astype(p.out_dtype)
  return split.run(local, operands, dims, (None, "features"))


def _static_sizes(group_sizes):
  check(isinstance(group_sizes, (np.ndarray, list, tuple)), "group_sizes", group_sizes,
        "must be concrete (a NumPy array or a list) for the static-offsets kernel")
  gs = np.asarray(group_sizes)
  check(np.issubdtype(gs.dtype, np.integer), "group_sizes", group_sizes, "must be integers")
  return gs.astype(np.int32)


def gmm_static_groups(lhs, rhs, group_sizes, *, transpose_rhs=False, preferred_element_type=None, rhs_scale=None,
                      block_sizes=None, interpret=False):
  """:func:`gmm`'s Pallas kernel with the group sizes known at compile time.

  The same kernel body and index maps, with the visit tables and offsets built by NumPy
  from the concrete ``group_sizes`` and embedded as constants instead of prefetched:
  the way to estimate the kernel with libtpu's cost model (which reads prefetched
  scalars as 0). Differentiable like :func:`gmm` (its backward also static).
  """
  gs = _static_sizes(group_sizes)
  p = _validate_gmm(lhs, rhs, gs, transpose_rhs, preferred_element_type, rhs_scale)
  return _gmm_pallas(lhs, rhs, jnp.asarray(gs), rhs_scale, p=p, blocks=_check_blocks(block_sizes),
                     static_sizes=tuple(int(x) for x in gs), interpret=interpret)


def tgmm_static_groups(lhs, rhs, group_sizes, *, preferred_element_type=None, block_sizes=None, interpret=False):
  """:func:`tgmm`'s Pallas kernel with the group sizes known at compile time (see :func:`gmm_static_groups`)."""
  gs = _static_sizes(group_sizes)
  p = _validate_tgmm(lhs, rhs, gs, preferred_element_type)
  return _tgmm_pallas(lhs, rhs, jnp.asarray(gs), p=p, blocks=_check_blocks(block_sizes),
                      static_sizes=tuple(int(x) for x in gs), interpret=interpret)
