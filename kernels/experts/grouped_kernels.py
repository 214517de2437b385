"""The grouped-matmul Pallas kernels behind :func:`kernels.gmm` and :func:`kernels.tgmm`.

Group metadata (the visit tables), the two kernel bodies and their ``pallas_call``s. The
public module :mod:`kernels.gmm` explains the design; this one is its mechanics.

*Visit tables.* The rows (tokens) are cut into m-tiles of ``tm`` rows. A *visit* is one
(m-tile, group) pair whose rows intersect; the grid's visit axis walks them in row order,
so a tile straddling a group boundary is visited once per group it holds. The tables have a
static length, ``m_tiles + E`` (the most visits any sizes need; see :func:`visit_count`);
the entries past the real visits are *padding* (they repeat the last visit's blocks and do
nothing). The grid's visit axis is only as long as the real visits: a run-time grid bound
when the sizes are traced, a Python int when they are concrete. Padding steps would each
cost a grid step's fixed overhead, as many as there are experts per n-tile.

The tables are int32 arrays, computed by :func:`gmm_tables` / :func:`tgmm_tables` either
with ``jax.numpy`` from a traced ``group_sizes`` (they are then scalar-prefetched into SMEM
and read with ``ref[i]``) or with NumPy from concrete sizes: then :class:`Tables` turns each
one into a step function of its index built from Python constants, so the same kernel body
and index maps run with compile-time offsets (the estimation method: libtpu's cost model
reads scalar-prefetched values as 0).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.base import calls
from kernels.base import tiling

# ---------------------------------------------------------------------------------
# Visit tables
# ---------------------------------------------------------------------------------

# gmm tables, each of length V (the visit axis): the output m-tile, the group (E = no compute:
# the rows past the sum of group sizes, and padding), and the m-tile and group whose lhs/rhs
# blocks the visit's index maps name (a no-compute visit names the last computing visit's, so
# nothing is fetched), and whether the group covers the whole m-tile (1) or the tile straddles
# a boundary (0). That flag is a table, not a comparison of the group's start with the tile's
# row in the kernel, because libtpu's cost model mis-evaluates such a comparison of two lookups
# (on about half the visits), which made its estimates of tall tiles impossibly fast. For the
# same reason a straddled tile's sub-tiles that meet the group are a table too: the first and
# last of them (see _gmm_kernel).
GMM_TABLES = ("tile", "group", "data_tile", "data_group", "full", "sub_first", "sub_last")
# tgmm tables: the m-tile read, the group written, flags (FIRST: the group's first visit,
# LAST: its last, COMPUTE: the visit adds a product; an empty group has one visit, FIRST|LAST),
# and whether the group covers the whole tile (a table for the reason given above).
TGMM_TABLES = ("tile", "group", "flags", "full")
FIRST, LAST, COMPUTE = 1, 2, 4


def visit_count(m: int, tm: int, experts: int) -> int:
  """The static length of the visit axis: at most one visit per m-tile, plus one per boundary
  between non-empty groups inside a tile (E - 1 of them with the tail after the groups' sum,
  or one per empty group in tgmm), rounded up to ``m_tiles + E``."""
  return tiling.cdiv(m, tm) + experts


def _offsets(xp, group_sizes, m: int):
  """[E + 1] group starts and the end, clipped to [0, m] (negative sizes count as 0)."""
  gs = xp.maximum(group_sizes.astype(xp.int32), 0)
  ends = xp.minimum(xp.cumsum(gs), m).astype(xp.int32)
  return xp.concatenate([xp.zeros((1,), xp.int32), ends])


def _visits(xp, starts, ends, tm: int, visit_empty: bool):
  """Per group: its number of visits and first tile."""
  nonempty = ends > starts
  first = starts // tm
  last = xp.maximum(ends - 1, 0) // tm
  count = xp.where(nonempty, last - first + 1, 1 if visit_empty else 0)
  return count.astype(xp.int32), first.astype(xp.int32)


def _locate(xp, count, v):
  """For visit indices ``v``: the group each falls in and its index within the group's visits."""
  cum = xp.cumsum(count)
  g = xp.searchsorted(cum, v, side="right").astype(xp.int32)
  g_c = xp.minimum(g, count.shape[0] - 1)
  before = (cum - count)[g_c]
  return g, g_c, (v - before).astype(xp.int32), cum[-1]


def gmm_tables(group_sizes, m: int, tm: int, xp=jnp) -> dict:
  """gmm's visit tables (``xp``: ``jnp`` for traced sizes, ``np`` for concrete ones) and the
  ``offsets`` [E + 2]: group starts, the start of the tail (rows past the sum) and ``m``."""
  experts = group_sizes.shape[0]
  v_len = visit_count(m, tm, experts)
  off = _offsets(xp, group_sizes, m)
  offsets = xp.concatenate([off, xp.full((1,), m, xp.int32)])  # the tail is group E: [sum, m)
  count, first = _visits(xp, offsets[:-1], offsets[1:], tm, visit_empty=False)
  v = xp.arange(v_len, dtype=xp.int32)
  g, g_c, within, total = _locate(xp, count, v)
  real = v < total
  tile = first[g_c] + within
  last_v = xp.maximum(total - 1, 0)
  tile = xp.where(real, tile, tile[last_v])  # (the tail is a group: at least one real visit)
  group = xp.where(real, g_c, experts).astype(xp.int32)
  compute = group < experts
  # The last computing visit at or before each visit (its blocks stay in VMEM); 0 before any.
  idx = xp.where(compute, v, -1)
  last_c = _cummax(xp, idx)
  data_tile = xp.where(last_c >= 0, tile[xp.maximum(last_c, 0)], 0).astype(xp.int32)
  data_group = xp.where(last_c >= 0, group[xp.maximum(last_c, 0)], 0).astype(xp.int32)
  start, end = offsets[xp.minimum(group, experts)], offsets[xp.minimum(group, experts) + 1]
  row0 = tile * tm
  full = xp.logical_and(start <= row0, end >= row0 + tm).astype(xp.int32)
  # The sub-tiles [row0 + s * sub, + sub) that meet [start, end) are s = sub_first .. sub_last.
  sub = _sub_rows(tm)
  sub_first = xp.clip((start - row0) // sub, 0, tm // sub - 1)
  sub_last = xp.clip((end - 1 - row0) // sub, -1, tm // sub - 1)
  return dict(tile=tile.astype(xp.int32), group=group, data_tile=data_tile, data_group=data_group,
              full=full, sub_first=sub_first.astype(xp.int32), sub_last=sub_last.astype(xp.int32),
              offsets=offsets.astype(xp.int32), visits=_count(xp, total))


def tgmm_tables(group_sizes, m: int, tm: int, xp=jnp) -> dict:
  """tgmm's visit tables and ``offsets`` [E + 1] (group starts and the sum)."""
  experts = group_sizes.shape[0]
  v_len = visit_count(m, tm, experts)
  off = _offsets(xp, group_sizes, m)
  starts, ends = off[:-1], off[1:]
  count, first = _visits(xp, starts, ends, tm, visit_empty=True)
  v = xp.arange(v_len, dtype=xp.int32)
  g, g_c, within, total = _locate(xp, count, v)
  real = v < total
  nonempty = (ends > starts)[g_c]
  compute = real & nonempty
  tile_raw = first[g_c] + within
  # Empty groups' visits and padding read the blocks of the last computing visit (no DMA).
  idx = xp.where(compute, v, -1)
  last_c = _cummax(xp, idx)
  tile = xp.where(last_c >= 0, tile_raw[xp.maximum(last_c, 0)], 0)
  flags = (xp.where(real & (within == 0), FIRST, 0) | xp.where(real & (within == count[g_c] - 1), LAST, 0)
           | xp.where(compute, COMPUTE, 0))
  group = xp.where(real, g_c, experts - 1)
  full = xp.logical_and(starts[group] <= tile * tm, ends[group] >= tile * tm + tm)
  return dict(tile=tile.astype(xp.int32), group=group.astype(xp.int32), flags=flags.astype(xp.int32),
              full=full.astype(xp.int32), offsets=off.astype(xp.int32), visits=_count(xp, total))


def _count(xp, total):
  """The number of real visits: the grid's visit axis (a Python int for concrete sizes)."""
  return int(total) if xp is np else total.astype(jnp.int32)


def _cummax(xp, x):
  return np.maximum.accumulate(x) if xp is np else lax.cummax(x)


@dataclasses.dataclass(frozen=True)
class Tables:
  """Reads the visit tables and offsets inside the kernel and its index maps.

  Dynamic: the tables are one scalar-prefetched int32 array (``prefetch``) and a lookup is
  ``ref[base + i]``. Static: ``values`` holds them as Python ints and a lookup is a
  piecewise-linear function of ``i`` over Python constants (a chain of selects, one per
  run of constant slope: tile indices mostly step by one, groups stay constant).
  """
  names: tuple[str, ...]
  lengths: tuple[int, ...]
  values: tuple[tuple[int, ...], ...] | None = None  # static mode

  @staticmethod
  def build(tables: dict, names: tuple[str, ...], static: bool):
    """(Tables, the flat array to prefetch or None)."""
    names = names + ("offsets",)
    arrays = [tables[n] for n in names]
    lengths = tuple(int(a.shape[0]) for a in arrays)
    if static:
      return Tables(names, lengths, tuple(tuple(int(x) for x in np.asarray(a)) for a in arrays)), None
    return Tables(names, lengths), jnp.concatenate(arrays)

  @property
  def static(self) -> bool:
    return self.values is not None

  def get(self, refs, name: str, i):
    """The entry ``i`` (a traced int32 scalar) of table ``name``; ``refs``: the prefetch refs."""
    k = self.names.index(name)
    if not self.static:
      return refs[0][sum(self.lengths[:k]) + i]
    out = None
    for p, a, b in _segments(self.values[k]):  # piecewise linear: a + b * (i - p) from i = p on
      seg = jnp.int32(a) if b == 0 else jnp.int32(a - b * p) + jnp.int32(b) * i
      out = seg if out is None else jnp.where(i >= p, seg, out)
    return out


def _segments(vals) -> list[tuple[int, int, int]]:
  """``vals`` as runs ``(start, value at start, slope)`` of a constant integer slope, greedily
  longest first: the few scalar ops a static lookup costs (a selects chain, one per run)."""
  out, j, n = [], 0, len(vals)
  while j < n:
    slope = vals[j + 1] - vals[j] if j + 1 < n else 0
    e = j + 1
    while e < n and vals[e] - vals[e - 1] == slope:
      e += 1
    out.append((j, vals[j], slope))
    j = e
  return out


# ---------------------------------------------------------------------------------
# Shared pieces
# ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Plan:
  """The blocks of one call (each already legal for its array) and the grid's sizes."""
  tm: int
  tk: int
  tn: int
  m: int
  k: int
  n: int
  experts: int

  @property
  def m_tiles(self):
    return tiling.cdiv(self.m, self.tm)

  @property
  def k_tiles(self):
    return tiling.cdiv(self.k, self.tk)

  @property
  def n_tiles(self):
    return tiling.cdiv(self.n, self.tn)

  @property
  def visits(self):
    return visit_count(self.m, self.tm, self.experts)


def _zero_tail(x, axis: int, valid: int):
  """``x`` with the entries at index >= ``valid`` along ``axis`` set to 0 (stale VMEM past K)."""
  if valid >= x.shape[axis]:
    return x
  keep = lax.broadcasted_iota(jnp.int32, x.shape, axis) < valid
  wide = jnp.int32 if jnp.issubdtype(x.dtype, jnp.integer) or x.dtype.itemsize == 1 else jnp.float32
  if x.dtype.itemsize == 1 and not jnp.issubdtype(x.dtype, jnp.integer):  # fp8: select on its bits
    bits = lax.bitcast_convert_type(x, jnp.int8).astype(jnp.int32)
    return lax.bitcast_convert_type(jnp.where(keep, bits, 0).astype(jnp.int8), x.dtype)
  return jnp.where(keep, x.astype(wide), 0).astype(x.dtype)


def _operand(x, compute_dtype):
  """A tile as the MXU takes it: quantized rhs tiles are converted to the lhs dtype."""
  return x if x.dtype == compute_dtype else x.astype(compute_dtype)


# ---------------------------------------------------------------------------------
# gmm: out[rows of g] = lhs[rows of g] @ rhs[g]
# ---------------------------------------------------------------------------------


SUB_ROWS = 128  # rows per sub-tile of a straddled tile (see _gmm_kernel)


def _sub_rows(tm: int) -> int:
  return SUB_ROWS if tm > SUB_ROWS and tm % SUB_ROWS == 0 else tm


def _gmm_kernel(*refs, tables: Tables, plan: Plan, transpose_rhs: bool, has_scale: bool, glu=None, glu_bwd=None):
  """One (n-tile, visit, K block) step.

  A visit whose group covers its m-tile multiplies the whole tile. A visit of a tile that
  straddles group boundaries multiplies only the 128-row sub-tiles its group intersects
  (each its own MXU dot into its rows of the accumulator), so a tile shared by several
  small groups costs about one tile of MXU work, not one per group; its write is masked
  to the group's rows.

  ``glu`` (an elementwise activation): the gate-and-up form. Two rhs blocks, the gate
  columns and the matching up columns, each with its own accumulator and output (``h``'s
  two halves, kept for the backward), and a third output ``glu(gate) * up`` computed from
  the two as stored (rounded to their dtype), in f32.

  ``glu_bwd`` (the same activation): the backward form, behind the down projection. The
  product is ``d act`` (the incoming gradient times the down weights, transposed); two
  more inputs are the forward's gate and up blocks, and the one output ``[m, 2n]`` (its
  block all ``2n`` columns: ``tn = n``) holds ``d gate`` and then ``d up`` (the activation
  product's gradient), so ``d act`` never goes to HBM.
  """
  n_pref = 0 if tables.static else 1
  n_rhs = 2 if glu is not None else 1
  pref = refs[:n_pref]
  lhs_ref, rhs_refs = refs[n_pref], refs[n_pref + 1:n_pref + 1 + n_rhs]
  rest = refs[n_pref + 1 + n_rhs:]
  scale_ref = rest[0] if has_scale else None
  rest = rest[1:] if has_scale else rest
  gu_refs = rest[:2] if glu_bwd is not None else ()
  rest = rest[2:] if glu_bwd is not None else rest
  n_out = 3 if glu is not None else 1
  o_refs, acc_refs = rest[:n_rhs], rest[n_out:]
  a_ref = rest[2] if glu is not None else None
  v, kk = pl.program_id(1), pl.program_id(2)
  nk = plan.k_tiles
  g = tables.get(pref, "group", v)
  tile = tables.get(pref, "tile", v)
  compute = g < plan.experts
  start = tables.get(pref, "offsets", g)
  end = tables.get(pref, "offsets", g + 1)
  row0 = tile * plan.tm
  full = tables.get(pref, "full", v) > 0  # the group covers the whole tile (see GMM_TABLES)
  k_valid = plan.k - (nk - 1) * plan.tk
  sub = _sub_rows(plan.tm)

  def product(x, last: bool, rhs_ref):
    y = rhs_ref[...]
    if last and k_valid < plan.tk:
      x = _zero_tail(x, 1, k_valid)
      y = _zero_tail(y, 1 if transpose_rhs else 0, k_valid)
    y = _operand(y, x.dtype)
    dims = (((1,), (1,)), ((), ())) if transpose_rhs else (((1,), (0,)), ((), ()))
    return lax.dot_general(x, y, dims, preferred_element_type=jnp.float32)

  def scaled(val):
    return val * scale_ref[...] if has_scale else val

  def cols(half):  # all the block's columns, or (glu_bwd) those of one half
    return slice(None) if half is None else pl.ds(half * plan.tn, plan.tn)

  def store(ref, val, r=0, half=None):  # rows r : r + len(val) of the block
    ref[pl.ds(r, val.shape[0]), cols(half)] = val

  def masked_store(ref, val, r=0, half=None):  # the same, only the rows of this visit's group
    n = val.shape[0]
    rows = row0 + r + lax.broadcasted_iota(jnp.int32, (n, 1), 0)
    mask = jnp.logical_and(rows >= start, rows < end)
    at = (pl.ds(r, n), cols(half))
    ref[at] = jnp.where(mask, val, ref[at])

  def write(vals, put):
    """The f32 results out; with glu, their product from the halves as stored, by row chunks
    (``sub`` rows: small f32 temporaries beside the step's blocks); with glu_bwd, the
    product's gradient, by row chunks too."""
    if glu_bwd is not None:
      o = o_refs[0]
      for r in range(0, plan.tm, sub):
        # d act as the unfused layer stores it (rounded to the output dtype), then the
        # activation product's backward: d gate = act'(gate) * d act * up, d up = d act * act(gate).
        d = vals[0][r:r + sub].astype(o.dtype).astype(jnp.float32)
        gate, up = (ref[pl.ds(r, sub), :].astype(jnp.float32) for ref in gu_refs)
        a, vjp = jax.vjp(glu_bwd, gate)
        put(o, vjp(d * up)[0].astype(o.dtype), r, 0)
        put(o, (d * a).astype(o.dtype), r, 1)
      return
    for val, o in zip(vals, o_refs):
      put(o, scaled(val).astype(o.dtype))
    if glu is not None:
      for r in range(0, plan.tm, sub):
        gate, up = (o[pl.ds(r, sub), :].astype(jnp.float32) for o in o_refs)
        put(a_ref, (glu(gate) * up).astype(a_ref.dtype), r)

  # One dot site per path (the whole tile, each sub-tile): the unrolled MXU code is what
  # libtpu's backend spends its compile time on, and a site per K-step kind (first / middle /
  # last) tripled it. So the accumulator is zeroed on the first K step and every step adds;
  # a K tail (k_valid < tk) adds a masked site for the last step. With one K step the
  # products go straight out (no accumulator round trip for the whole tile).
  # The sub-tile sites stay unrolled, not a lax.fori_loop over row offsets (which would
  # compile once instead of tm / 128 times): libtpu's static profiler, which every gmm
  # estimate goes through, ran out of this machine's 24 GB on a toy kernel that looped
  # 8 dots inside its body; the same 8 dots unrolled were estimated without trouble.
  one = nk == 1
  tail = k_valid < plan.tk and not one
  kinds = [(kk < nk - 1, False), (kk == nk - 1, True)] if tail else [(None, one)]

  def add(rows, when, last: bool):
    def body():
      if rows is None:  # the whole tile
        ps = [product(lhs_ref[...], last, r) for r in rhs_refs]
        if one:
          write(ps, store)
        else:
          for acc, p in zip(acc_refs, ps):
            acc[...] += p
      else:
        for acc, r in zip(acc_refs, rhs_refs):
          p = product(lhs_ref[rows, :], last, r)
          if one:
            acc[rows, :] = p
          else:
            acc[rows, :] += p
    body() if when is None else pl.when(when)(body)

  if not one:
    @pl.when(jnp.logical_and(compute, kk == 0))
    def _():
      for acc in acc_refs:
        acc[...] = jnp.zeros_like(acc)

  @pl.when(jnp.logical_and(compute, full))
  def _():
    for when, last in kinds:
      add(None, when, last)
    if not one:
      @pl.when(kk == nk - 1)
      def _():
        write([acc[...] for acc in acc_refs], store)

  @pl.when(jnp.logical_and(compute, jnp.logical_not(full)))
  def _():
    sub_first, sub_last = tables.get(pref, "sub_first", v), tables.get(pref, "sub_last", v)
    for s in range(plan.tm // sub):
      hit = jnp.logical_and(sub_first <= s, s <= sub_last)
      for when, last in kinds:
        add(pl.ds(s * sub, sub), hit if when is None else jnp.logical_and(hit, when), last)

    @pl.when(kk == nk - 1)
    def _():
      write([acc[...] for acc in acc_refs], masked_store)

  @pl.when(jnp.logical_and(jnp.logical_not(compute), kk == nk - 1))
  def _():  # rows of the tail (past the groups' sum)
    for o in o_refs + ((a_ref,) if glu is not None else ()):
      for half in ([0, 1] if glu_bwd is not None else [None]):
        masked_store(o, jnp.zeros((plan.tm, plan.tn), o.dtype), 0, half)


def gmm_call(lhs, rhs, rhs_scale, tables_dict, *, plan: Plan, transpose_rhs: bool, out_dtype, static: bool,
             interpret, vmem_limit, glu=None, glu_bwd=None, gate_up=None):
  """One pallas_call of the gmm kernel: ``lhs`` [m, k], ``rhs`` [E, k, n] (or [E, n, k]),
  ``rhs_scale`` None or f32 [E, 1, n]; ``tables_dict`` from :func:`gmm_tables`.

  ``glu`` (an elementwise activation): ``rhs`` is the concatenated ``[E, k, 2f]`` gate and up
  weights and the plan is for ``n = f``, with ``f`` a multiple of ``tn``. Returns the three
  ``[m, f]`` arrays gate, up and ``glu(gate) * up``: the gate blocks are rhs column block
  ``j``, the up blocks ``j + f / tn`` (the same array passed twice).

  ``glu_bwd`` (the activation) and ``gate_up`` (the forward's gate and up, ``[m, n]`` each),
  with ``tn = n``: the result is ``[m, 2n]``, the gradients of gate and then of up from the
  product's gradient ``lhs @ rhs``, which stays in VMEM. (One output block of all ``2n``
  columns, not two blocks a step: libtpu's cost model charges nothing for a kernel whose
  output block is ``(2, tm, tn)`` of a ``[2, m, n]`` array.)"""
  tables, flat = Tables.build(tables_dict, GMM_TABLES, static)
  tm, tk, tn, nk = plan.tm, plan.tk, plan.tn, plan.k_tiles
  pref_n = 0 if static else 1
  if glu is not None:
    assert not transpose_rhs and rhs_scale is None and plan.n % tn == 0 and rhs.shape[2] == 2 * plan.n
  if glu_bwd is not None:
    assert rhs_scale is None and glu is None and tn == plan.n and all(a.shape == (plan.m, plan.n) for a in gate_up)
  nf = plan.n_tiles

  def ids(args):
    j, v, kk = args[:3]
    pref = args[3:3 + pref_n]
    return j, v, kk, pref

  def k_of(kk, g):  # a no-compute visit stays on the last K block (no DMA)
    return jnp.where(g < plan.experts, kk, nk - 1)

  def lhs_map(*args):
    j, v, kk, pref = ids(args)
    return tables.get(pref, "data_tile", v), k_of(kk, tables.get(pref, "group", v))

  def data_map(*args):  # a block of the forward's gate or up, beside the output's
    j, v, kk, pref = ids(args)
    return tables.get(pref, "data_tile", v), j

  def rhs_map(*args, shift=0):
    j, v, kk, pref = ids(args)
    kb = k_of(kk, tables.get(pref, "group", v))
    g = tables.get(pref, "data_group", v)
    return (g, j + shift, kb) if transpose_rhs else (g, kb, j + shift)

  def scale_map(*args):
    j, v, kk, pref = ids(args)
    return tables.get(pref, "data_group", v), 0, j

  def out_map(*args):
    j, v, kk, pref = ids(args)
    return tables.get(pref, "tile", v), j

  sq = pl.squeezed
  rhs_block = (sq, tn, tk) if transpose_rhs else (sq, tk, tn)
  in_specs = [pl.BlockSpec((tm, tk), lhs_map), pl.BlockSpec(rhs_block, rhs_map)]
  args = [lhs, rhs]
  if glu is not None:  # the up columns: the same array, f / tn blocks further
    in_specs.append(pl.BlockSpec(rhs_block, functools.partial(rhs_map, shift=nf)))
    args.append(rhs)
  if rhs_scale is not None:
    in_specs.append(pl.BlockSpec((sq, 1, tn), scale_map))
    args.append(rhs_scale)
  if glu_bwd is not None:
    in_specs += [pl.BlockSpec((tm, tn), data_map)] * 2
    args += list(gate_up)
  outs = 3 if glu is not None else 1
  halves = 2 if glu is not None else 1
  grid = (plan.n_tiles, tables_dict["visits"], nk)
  if glu_bwd is not None:
    out_specs = [pl.BlockSpec((tm, 2 * tn), out_map)]
    out_shape = [jax.ShapeDtypeStruct((plan.m, 2 * plan.n), out_dtype)]
  else:
    out_specs = [pl.BlockSpec((tm, tn), out_map)] * outs
    out_shape = [jax.ShapeDtypeStruct((plan.m, plan.n), out_dtype)] * outs
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=pref_n, grid=grid, in_specs=in_specs, out_specs=out_specs,
      scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)] * halves)
  flops = 2 * plan.m * plan.k * plan.n * halves
  item = jnp.dtype(out_dtype).itemsize
  # glu_bwd: gate and up in, d gate and d up out, m * n each
  mn_arrays = 4 if glu_bwd is not None else outs
  nbytes = (lhs.size * lhs.dtype.itemsize * plan.n_tiles + rhs.size * rhs.dtype.itemsize
            + mn_arrays * plan.m * plan.n * item)
  act = glu if glu is not None else glu_bwd
  name = "gmm_glu" if glu is not None else "gmm_glu_bwd" if glu_bwd is not None else "gmm"
  call = calls.pallas_call(
      functools.partial(_gmm_kernel, tables=tables, plan=plan, transpose_rhs=transpose_rhs,
                        has_scale=rhs_scale is not None, glu=glu, glu_bwd=glu_bwd),
      grid_spec=grid_spec, out_shape=out_shape,
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary"),
                                           vmem_limit_bytes=vmem_limit),
      cost_estimate=pl.CostEstimate(flops=flops, transcendentals=plan.m * plan.n if act is not None else 0,
                                    bytes_accessed=int(nbytes)),
      interpret=interpret, name=name)
  result = call(*([flat] if flat is not None else []), *args)
  return tuple(result) if glu is not None else result[0]


# ---------------------------------------------------------------------------------
# tgmm: out[g] = lhs[:, rows of g] @ rhs[rows of g]
# ---------------------------------------------------------------------------------


def _tgmm_kernel(*refs, tables: Tables, plan: Plan, lhs_tokens_major: bool):
  n_pref = 0 if tables.static else 1
  pref = refs[:n_pref]
  lhs_ref, rhs_ref, o_ref, acc_ref = refs[n_pref:n_pref + 4]
  v = pl.program_id(2)
  g = tables.get(pref, "group", v)
  tile = tables.get(pref, "tile", v)
  flags = tables.get(pref, "flags", v)
  first = (flags & FIRST) != 0
  last = (flags & LAST) != 0
  compute = (flags & COMPUTE) != 0
  start = tables.get(pref, "offsets", g)
  end = tables.get(pref, "offsets", g + 1)
  row0 = tile * plan.tm
  full = tables.get(pref, "full", v) > 0  # the group covers the whole tile (see TGMM_TABLES)

  def product(masked: bool):
    x, y = lhs_ref[...], rhs_ref[...]
    if masked:  # only the group's rows (the rest is other groups' or stale VMEM)
      rows_y = row0 + lax.broadcasted_iota(jnp.int32, (plan.tm, 1), 0)
      keep_y = jnp.logical_and(rows_y >= start, rows_y < end)
      y = jnp.where(keep_y, y, jnp.zeros((), y.dtype))
      if lhs_tokens_major:
        x = jnp.where(keep_y, x, jnp.zeros((), x.dtype))
      else:
        cols = row0 + lax.broadcasted_iota(jnp.int32, (1, plan.tm), 1)
        x = jnp.where(jnp.logical_and(cols >= start, cols < end), x, jnp.zeros((), x.dtype))
    dims = (((0,), (0,)), ((), ())) if lhs_tokens_major else (((1,), (0,)), ((), ()))
    return lax.dot_general(x, y, dims, preferred_element_type=jnp.float32)

  # A group seen in one visit (every group whose rows fit one m-tile) writes its product
  # straight out; the accumulator round trip (zero, add, copy out) costs [tk, tn] f32 of
  # VMEM loads and stores per pass, comparable to the dot's own time at these sizes.
  single = jnp.logical_and(first, last)

  @pl.when(jnp.logical_and(single, jnp.logical_not(compute)))
  def _():  # an empty group: its weight gradient is zero
    o_ref[...] = jnp.zeros_like(o_ref)

  def visit(masked: bool):  # one dot per branch: Mosaic gives each dot's result its own VMEM
    p = product(masked)

    @pl.when(single)
    def _():
      o_ref[...] = p.astype(o_ref.dtype)

    @pl.when(jnp.logical_and(first, jnp.logical_not(last)))
    def _():
      acc_ref[...] = p

    @pl.when(jnp.logical_not(first))
    def _():
      acc_ref[...] += p

  pl.when(jnp.logical_and(compute, full))(functools.partial(visit, False))
  pl.when(jnp.logical_and(compute, jnp.logical_not(full)))(functools.partial(visit, True))

  @pl.when(jnp.logical_and(last, jnp.logical_not(first)))
  def _():
    o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def tgmm_call(lhs, rhs, tables_dict, *, plan: Plan, lhs_tokens_major: bool, out_dtype, static: bool, interpret,
              vmem_limit):
  """One pallas_call of the tgmm kernel: ``lhs`` [k, m] (or [m, k] with ``lhs_tokens_major``),
  ``rhs`` [m, n]; the result [E, k, n]. Grid (k tiles, n tiles, visits)."""
  tables, flat = Tables.build(tables_dict, TGMM_TABLES, static)
  tm, tk, tn = plan.tm, plan.tk, plan.tn
  pref_n = 0 if static else 1

  def ids(args):
    return args[0], args[1], args[2], args[3:3 + pref_n]

  def lhs_map(*args):
    i, j, v, pref = ids(args)
    t = tables.get(pref, "tile", v)
    return (t, i) if lhs_tokens_major else (i, t)

  def rhs_map(*args):
    i, j, v, pref = ids(args)
    return tables.get(pref, "tile", v), j

  def out_map(*args):
    i, j, v, pref = ids(args)
    return tables.get(pref, "group", v), i, j

  sq = pl.squeezed
  in_specs = [pl.BlockSpec((tm, tk) if lhs_tokens_major else (tk, tm), lhs_map), pl.BlockSpec((tm, tn), rhs_map)]
  grid = (plan.k_tiles, plan.n_tiles, tables_dict["visits"])
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=pref_n, grid=grid, in_specs=in_specs,
      out_specs=pl.BlockSpec((sq, tk, tn), out_map), scratch_shapes=[pltpu.VMEM((tk, tn), jnp.float32)])
  flops = 2 * plan.m * plan.k * plan.n
  nbytes = (lhs.size * lhs.dtype.itemsize * plan.n_tiles + rhs.size * rhs.dtype.itemsize * plan.k_tiles
            + plan.experts * plan.k * plan.n * jnp.dtype(out_dtype).itemsize)
  call = calls.pallas_call(
      functools.partial(_tgmm_kernel, tables=tables, plan=plan, lhs_tokens_major=lhs_tokens_major),
      grid_spec=grid_spec, out_shape=jax.ShapeDtypeStruct((plan.experts, plan.k, plan.n), out_dtype),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"),
                                           vmem_limit_bytes=vmem_limit),
      cost_estimate=pl.CostEstimate(flops=flops, transcendentals=0, bytes_accessed=int(nbytes)),
      interpret=interpret, name="tgmm")
  return call(*([flat] if flat is not None else []), lhs, rhs)
