"""The batched Winograd kernel of :mod:`kernels.conv`: images on the sublanes, tiles by phase.

Each grid step ``(image blocks of nb, row blocks, cout blocks, cin blocks)`` takes ``nb``
images (8, or 16 for bf16) and ``bh = pt m`` output rows. Three phases, each a loop so the
kernel body stays small:

1. *Stage.* Input row ``r`` (``[nb, width, c]``) is swapped to ``[width, nb, c]``, as in the
   batched direct kernel, and split by phase: ``xt[r % m, q % m, r // m, q // m] = x[r, q]``.
   The ``(p, q)`` entry of every tile in a tile row is then one slice of leading axes,
   ``xt[p % m, q % m, i + p // m, q // m : q // m + wt]``, a ``[wt nb, c]`` operand with no
   shifted or strided load.
2. *Input transform and GEMMs.* ``V = B^T d B`` per tile row and 128-lane group, in f32 on
   the VPU, as two passes of a 1-D transform whose rows of equal magnitude share their even
   and odd parts; then one ``[pt wt nb, cin] x [cin, cout]`` GEMM per transform position on
   the MXU (bf16 in, f32 out), in a loop over the ``(m + 2)^2`` positions.
3. *Output transform.* ``A^T M A``, bias and activation per tile row and lane group, then
   the ``m`` output rows of each tile row are interleaved by column phase and swapped back
   to NHWC.

The transformed filter ``U`` is one block of ``[(m + 2)^2, cin, cout]`` when it fits, so it
is fetched once for the whole grid. GEMM rows per step are ``pt wt nb``: with ``pt = 1`` at
28x28 and 16 images, 112.
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
from kernels.gemm import apply_activation

LANES = 128  # the transforms run one 128-lane group at a time: short live ranges, a small body


def lincomb(coeffs, terms):
  """``sum_i coeffs[i] * terms[i]`` skipping zeros and unit multiplies (VPU adds)."""
  out = None
  for a, t in zip(coeffs, terms):
    if a == 0:
      continue
    v = t if a == 1 else (-t if a == -1 else t * float(a))
    out = v if out is None else out + v
  return out


def transform_1d(mat, terms):
  """``mat @ terms`` for a list of arrays. Rows equal in magnitude (F(4x4,3x3)'s points come in
  pairs ``+-p``) share work: ``E + O`` and ``E - O``, with ``E`` the terms where their signs agree
  and ``O`` the rest, which halves the multiplies."""
  mat = np.asarray(mat)
  out, done = [None] * mat.shape[0], set()
  for i in range(mat.shape[0]):
    if i in done:
      continue
    j = next((j for j in range(i + 1, mat.shape[0]) if j not in done
              and np.array_equal(np.abs(mat[i]), np.abs(mat[j])) and np.any(mat[i] != mat[j])), None)
    if j is None:
      out[i] = lincomb(mat[i], terms)
      done.add(i)
      continue
    e = lincomb(np.where(mat[i] == mat[j], mat[i], 0), terms)
    o = lincomb(np.where(mat[i] != mat[j], mat[i], 0), terms)
    out[i], out[j] = (o, -o) if e is None else (e + o, e - o)
    done |= {i, j}
  return out


def _loop2(n1, n2, body):
  """``body(i, g)`` for ``i < n1``, ``g < n2``: nested fori loops (no scalar div/rem)."""
  def outer(i, carry):
    def inner(g, carry):
      body(i, g)
      return carry
    return lax.fori_loop(0, n2, inner, carry)
  lax.fori_loop(0, n1, outer, 0)


@dataclasses.dataclass(frozen=True)
class Plan:
  m: int
  nb: int  # images per step
  pt: int  # tile rows per step (bh = pt m)
  wt: int  # tiles across (padded so wt nb fills whole sublane tiles)
  bc: int
  bco: int
  cin_p: int
  cout_p: int
  row_blocks: int

  @property
  def bh(self) -> int:
    return self.pt * self.m

  @property
  def rows_in(self) -> int:  # input rows per step: the tile rows plus one tile row of halo
    return (self.pt + 1) * self.m

  @property
  def wp(self) -> int:
    return (self.wt + 1) * self.m

  @property
  def hp(self) -> int:
    return (self.row_blocks - 1) * self.bh + self.rows_in

  @property
  def u_resident(self) -> bool:
    return self.bc == self.cin_p and self.bco == self.cout_p

  @property
  def gemm_rows(self) -> int:
    return self.pt * self.wt * self.nb


def make_plan(n, ho, wo, cin, cout, *, m, nb, pt, bc, bco, dtype) -> Plan:
  sub = tiling.sublane_multiple(dtype)
  wt = tiling.cdiv(wo, m)
  while (wt * nb) % sub:
    wt += 1
  return Plan(m, nb, pt, wt, bc, bco, tiling.round_up(cin, bc), tiling.round_up(cout, bco), tiling.cdiv(ho, pt * m))


def staging_dtype(nb: int):
  return jnp.bfloat16 if nb == 16 else jnp.float32


def vmem_bytes(p: Plan, x_dtype, out_dtype, wo: int) -> int:
  t = p.m + 2
  u = ((t * t, p.bc, p.bco), x_dtype)
  blocks = [((p.nb, p.rows_in, p.wp, p.bc), x_dtype), ((1, p.bco), jnp.float32), ((p.nb, p.bh, wo, p.bco), out_dtype)]
  blocks += [] if p.u_resident else [u]
  scratch = [u] if p.u_resident else []
  scratch += [((t * t, p.gemm_rows, p.bco), jnp.float32),
             ((p.m * p.m * (p.pt + 1) * (p.wt + 1), p.nb, p.bc), staging_dtype(p.nb)),
             ((t * t, p.wt * p.nb, min(LANES, p.bc)), jnp.float32),
             ((t * t, p.gemm_rows, p.bc), x_dtype)]
  temps = 2 * tiling.block_bytes((p.gemm_rows, max(p.bc, p.bco)), jnp.float32)
  return tiling.vmem_footprint(blocks, scratch) + temps


def _kernel(x_ref, u_ref, b_ref, o_ref, acc_ref, xt_ref, s_ref, v_ref, *, bt, at, m, pt, wt, wo, nk, activation,
            cdt, precision):
  k = pl.program_id(3)
  t = m + 2
  nb, _, _, c = x_ref.shape
  rows = wt * nb  # GEMM rows per tile row

  def stage(i, carry):  # xt[p0, q0, i, j] = x[:, i m + p0, j m + q0], images on the sublanes
    for p0 in range(m):
      xr = x_ref[:, pl.ds(i * m + p0, 1)].reshape(nb, (wt + 1) * m, c).astype(xt_ref.dtype)
      xr = jnp.swapaxes(xr, 0, 1).reshape(wt + 1, m, nb, c)
      for q0 in range(m):
        xt_ref[p0, q0, pl.ds(i, 1)] = xr[:, q0][None]
    return carry
  lax.fori_loop(0, pt + 1, stage, 0)

  lg = min(LANES, c)

  def input_transform(i, g):  # V[a, b] of tile row i, lane group g
    lanes = pl.ds(pl.multiple_of(g * lg, lg), lg)
    for p in range(t):
      d = [xt_ref[p % m, q % m, pl.ds(i + p // m, 1), pl.ds(q // m, wt), :, lanes].reshape(rows, lg)
           .astype(jnp.float32) for q in range(t)]
      for b, v in enumerate(transform_1d(bt, d)):
        s_ref[p * t + b] = v
    for b in range(t):
      for a, v in enumerate(transform_1d(bt, [s_ref[p * t + b] for p in range(t)])):
        v_ref[a * t + b, pl.ds(pl.multiple_of(i * rows, 8), rows), lanes] = v.astype(v_ref.dtype)
  _loop2(pt, c // lg, input_transform)

  def gemm(pos, carry):
    prod = jnp.dot(v_ref[pos].astype(cdt), u_ref[pos].astype(cdt), preferred_element_type=jnp.float32,
                   precision=precision)
    if nk == 1:
      acc_ref[pos] = prod
    else:
      acc_ref[pos] = jnp.where(k == 0, prod, acc_ref[pos] + prod)
    return carry
  lax.fori_loop(0, t * t, gemm, 0)

  @pl.when(k == nk - 1)
  def _():
    co = o_ref.shape[-1]
    lo = min(LANES, co)

    def output_transform(i, g):  # Y = A^T M A of tile row i, lane group g, then m output rows
      lanes = pl.ds(pl.multiple_of(g * lo, lo), lo)
      r = pl.ds(pl.multiple_of(i * rows, 8), rows)
      bias = b_ref[:, lanes].astype(jnp.float32)
      z = [transform_1d(at, [acc_ref[a * t + b, r, lanes] for b in range(t)]) for a in range(t)]
      ys = [transform_1d(at, [z[a][vv] for a in range(t)]) for vv in range(m)]  # ys[vv][uu]
      for uu in range(m):
        row = jnp.stack([apply_activation(ys[vv][uu] + bias, activation).reshape(wt, nb, lo) for vv in range(m)],
                        axis=1).reshape(wt * m, nb, lo)[:wo]  # columns interleaved by phase
        o_ref[:, pl.ds(i * m + uu, 1), :, lanes] = jnp.swapaxes(row, 0, 1)[:, None].astype(o_ref.dtype)
    _loop2(pt, co // lo, output_transform)


def call(xp, u, b, p: Plan, *, ho, wo, bt, at, activation, out_dtype, precision, vmem_limit, interpret, cdt):
  """``xp``: the input padded to ``[n, p.hp, p.wp, p.cin_p]``; ``u``: ``[(m+2)^2, cin_p, cout_p]``;
  ``b``: ``[1, cout_p]`` f32. Returns ``[n, ho, wo, cout_p]``."""
  n = xp.shape[0]
  t = p.m + 2
  nk = p.cin_p // p.bc
  grid = (n // p.nb, p.row_blocks, p.cout_p // p.bco, nk)
  x_spec = pl.BlockSpec((pl.Element(p.nb), pl.Element(p.rows_in), pl.Element(p.wp), pl.Element(p.bc)),
                        lambda n, i, j, k: (n * p.nb, i * p.bh, 0, k * p.bc))
  # the whole transformed filter in one block is fetched once: one buffer, not two
  u_spec = pl.BlockSpec((t * t, p.bc, p.bco), lambda n, i, j, k: (0, k, j),
                        **({"pipeline_mode": pl.Buffered(1)} if p.u_resident else {}))
  b_spec = pl.BlockSpec((1, p.bco), lambda n, i, j, k: (0, j))
  o_spec = pl.BlockSpec((p.nb, p.bh, wo, p.bco), lambda n, i, j, k: (n, i, 0, j))
  scratch = [pltpu.VMEM((t * t, p.gemm_rows, p.bco), jnp.float32),
             pltpu.VMEM((p.m, p.m, p.pt + 1, p.wt + 1, p.nb, p.bc), staging_dtype(p.nb)),
             pltpu.VMEM((t * t, p.wt * p.nb, min(LANES, p.bc)), jnp.float32),
             pltpu.VMEM((t * t, p.gemm_rows, p.bc), cdt)]
  kernel = functools.partial(_kernel, bt=bt, at=at, m=p.m, pt=p.pt, wt=p.wt, wo=wo, nk=nk, activation=activation,
                             cdt=cdt, precision=precision)
  steps = grid[0] * grid[1] * grid[2] * grid[3]
  flops = 2 * steps * t * t * p.gemm_rows * p.bc * p.bco
  bytes_ = (xp.size * xp.dtype.itemsize * grid[2] + u.size * u.dtype.itemsize
            * (1 if grid[2] * grid[3] == 1 else grid[0] * grid[1]) + n * ho * wo * p.cout_p * jnp.dtype(out_dtype).itemsize)
  return calls.pallas_call(
      kernel, grid=grid, in_specs=[x_spec, u_spec, b_spec], out_specs=o_spec,
      out_shape=jax.ShapeDtypeStruct((n, ho, wo, p.cout_p), out_dtype),  # the last row block is partial
      scratch_shapes=scratch,
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
                                           vmem_limit_bytes=vmem_limit),
      interpret=interpret, name=f"conv2d_winograd_f{p.m}_batched",
      cost_estimate=pl.CostEstimate(flops=flops, transcendentals=0, bytes_accessed=bytes_),
  )(xp, u, b)
