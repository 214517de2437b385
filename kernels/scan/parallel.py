"""A dense linear time-invariant state-space scan, ``h_t = h_{t-1} @ A + x_t @ B``, ``y_t = h_t @ C``, in Pallas.

``parallel_scan(x, A, B, C)`` runs the recurrence of a linear time-invariant state-space
model with dense matrices over ``x`` ``[batch, seq, d_in]`` (or ``[seq, d_in]``), with
``A`` ``[n, n]``, ``B`` ``[d_in, n]``, ``C`` ``[n, d_out]`` and an optional initial state
``h0`` ``[batch, n]``, and returns ``y`` ``[batch, seq, d_out]``.
:func:`parallel_scan_reference` is the same model as a plain ``lax.scan``.

How it works
------------

*Why segments.* Each step is a ``[rows, n] @ [n, n]`` matmul that depends on the step
before it. With the batch alone on the MXU's M side (one row at batch 1), every step
waits for the MXU's latency (about 0.1 us on v5e, compiler estimate) and the MXU idles:
128k tokens at batch 1 would take ~13 ms however small ``n`` is. So the sequence is cut
into ``L = num_segments`` segments of ``s`` tokens, and the segments run side by side:
each step is a ``[batch * L, n] @ [n, n]`` matmul, ``s`` steps in all.

*Three phases* (forward):

1. **ends** (Pallas): each segment scanned from a zero state; only its last state
   ``e_l`` is written (``[batch * L, n]`` f32).
2. **carries** (XLA): the state entering each segment, ``start_{l+1} = start_l @ A^s +
   e_l`` with ``start_0 = h0``. ``A^s`` comes from repeated squaring; the recurrence over
   the ``L`` segments is a log-step (Hillis-Steele) scan of ``[batch, L, n]`` against
   ``A^s, A^2s, A^4s, ...``: ``log2 L`` small batched matmuls, no loop. XLA is as good as
   Pallas here (a few MFLOP), so it stays in XLA.
3. **outputs** (Pallas): each segment scanned again from its true start state, writing
   ``y = h @ C``. Rescanning costs a second pass over ``x`` and a second sequential loop,
   but it is cheaper than correcting stored local states: a correction
   ``start_l @ A^(j+1) @ C`` needs the same sequential loop (or ``s`` matrices
   ``A^j C``, ``s * n * d_out`` floats, too big for VMEM), and storing local states costs
   ``seq * n`` f32 of HBM both ways.

With ``L = 1`` phases 1 and 2 are skipped: one pass, the plain recurrence in VMEM.

*Inside a grid step.* The grid is ``(row blocks, chunks)`` over ``x`` viewed as
``[batch * L, s, d_in]`` (rows: (batch, segment) pairs; parallel, arbitrary). A block
holds ``Lb`` rows by ``tj`` tokens. First ``U = X @ B`` for the whole block, one big MXU
matmul into VMEM (f32); then ``tj`` sequential steps ``h = h @ A + U[:, j]``, the state
``h`` ``[Lb, n]`` f32 in registers/VMEM, each step's row ``j`` of every segment read with a
strided load (stride ``tj``; Mosaic's strided loads want 128-lane memrefs, so ``U`` and
the states are held as ``n / 128`` lane slabs); then ``Y = H @ C``, one big matmul. The
state is carried across chunks in a VMEM scratch. ``n`` is padded to a multiple of 128
with zeros in ``A``, ``B``, ``C`` (the padded state lanes stay 0); ``seq`` is padded
with zero tokens to ``L * s`` (``s`` a multiple of 16), and the padded outputs dropped.

*Precision.* The state is f32 throughout. The products take the parameters' dtype: with
bf16 ``x``, ``A``, ``B`` and ``C`` the state is rounded to bf16 as the MXU's operand of
each step (f32 accumulation), as the reference does; with any f32 operand, f32 products
at full precision.

*Backward* (``custom_vjp``). With ``gy_t = dy_t @ C^T`` the state's cotangent runs
backwards, ``g_t = gy_t + g_{t+1} @ A^T``: the same dense scan in reverse, segmented the
same way (local reverse scans, carries ``gfirst_l = e_l + gfirst_{l+1} @ (A^T)^s`` in
XLA, then the full reverse pass). The full pass also forms ``dx = G @ B^T``,
``dA = sum_t h_{t-1}^T g_t``, ``dB = sum_t x_t^T g_t`` and ``dC = sum_t h_t^T dy_t``
(per row block, summed by XLA) and ``dh0 = g_0 @ A^T``. It needs the forward states:

* ``checkpoint=True`` (default): the forward saves only the state entering each chunk
  (``[chunks, batch * L, n]`` f32: ``1 / tj`` of the states); the backward recomputes
  the inside of each chunk with the same sequential loop before its reverse loop. HBM
  stays O(seq x width): the residuals are ``x`` and these rows.
* ``checkpoint=False``: the forward also writes every state ``h_{t-1}``
  (``[batch, seq, n]`` f32) and the backward reads it, replacing the recompute loop by
  one matmul ``H = H_prev @ A + X @ B``.

*Whole segments per block.* When a block of ``Lb`` segments of ``s`` tokens has at most
:data:`WHOLE_SEGMENT_ROWS` tokens, ``tj = s``: the block is contiguous in HBM and the
grid has one step per row block. Longer segments are cut into chunks; the block is then
``Lb`` strided pieces. (libtpu's cost model charges 0 cycles to the kernels in that case:
their estimates are only floors, see the notebook.)

*Choosing ``num_segments``* (:func:`default_num_segments`): segments are worth their
second pass only while the rows on the MXU are too few to hide its latency. The rule:
``L = 1`` when ``batch`` alone reaches :data:`TARGET_ROWS` rows; else the smallest power
of two with ``batch * L >= TARGET_ROWS``, capped so that segments keep at least
:data:`MIN_SEGMENT` tokens. ``tools/tune_parallel_scan.py segments`` checks the rule against
compiler estimates (``kernels/data/parallel_scan_bench.json``).

*Backend choice* (:func:`kernels.dispatch`): ``implementation=None`` runs the Pallas
kernels when lowered for TPU and the reference elsewhere; float64 runs on the
reference only.

*Names.* ``kernels.parallel_scan`` is the function (the package exports it flat); this
module is ``importlib.import_module("kernels.scan.parallel")``.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.base import calls
from kernels.base import partition
from kernels.base import tiling
from kernels.base.backend import dispatch, target_chip
from kernels.base.errors import KernelError, check
from kernels.base.hardware import get_chip

__all__ = ["default_num_segments", "parallel_scan", "parallel_scan_reference"]

KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
REAL_DTYPES = KERNEL_DTYPES + (jnp.dtype(jnp.float64),)
TARGET_ROWS = 256
"""Rows per sequential matmul the default segmentation aims for (see :func:`default_num_segments`)."""
MIN_SEGMENT = 64
"""Fewest tokens per segment the default segmentation makes."""
SEQ_MULTIPLE = 16  # tokens per segment are a multiple of this (the bf16 sublane tile)
MAX_BLOCK_ROWS = 2048  # Lb * tj: tokens of one grid step (each f32 slab of [Lb * tj, n] is 4 * 2048 * n bytes)
WHOLE_SEGMENT_ROWS = 4096  # up to this many tokens a block holds whole segments (one chunk per segment)
HIGHEST = lax.Precision.HIGHEST


# ---------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Problem:
  batch: int
  seq: int
  d_in: int
  n: int
  d_out: int
  x_dtype: jnp.dtype
  cd: jnp.dtype  # the products' operand dtype
  unbatched: bool


def _is_array(v) -> bool:
  return hasattr(v, "shape") and hasattr(v, "dtype")


def _floating(name, v):
  check(_is_array(v), name, v, "must be an array")
  d = jnp.dtype(v.dtype)
  check(d in REAL_DTYPES, name, v, f"must be floating point: float32 or bfloat16 (float64 on the XLA path), "
        f"not {d.name}")


def _validate(x, A, B, C, h0, num_segments, checkpoint) -> _Problem:
  for name, v in (("x", x), ("A", A), ("B", B), ("C", C)):
    _floating(name, v)
  check(x.ndim in (2, 3) and x.size > 0, "x", x, "must be [batch, seq, d_in] or [seq, d_in], with elements")
  unbatched = x.ndim == 2
  batch, seq, d_in = (1,) + tuple(x.shape) if unbatched else tuple(x.shape)
  check(A.ndim == 2 and A.shape[0] == A.shape[1] and A.shape[0] > 0, "A", A, "must be a square [n, n] matrix")
  n = A.shape[0]
  check(tuple(B.shape) == (d_in, n), "B", B, f"must have shape {(d_in, n)} ([d_in, n]: x's last dim, A's size)")
  check(C.ndim == 2 and C.shape[0] == n and C.shape[1] > 0, "C", C, f"must have shape ({n}, d_out) ([n, d_out])")
  if h0 is not None:
    _floating("h0", h0)
    want = (n,) if unbatched else (batch, n)
    check(tuple(h0.shape) == want, "h0", h0, f"must have shape {want} ([batch, n]; [n] for an unbatched x)")
  check(num_segments is None or (isinstance(num_segments, int) and not isinstance(num_segments, bool)
                                 and num_segments > 0), "num_segments", num_segments,
        "must be None or a positive int")
  check(isinstance(checkpoint, bool), "checkpoint", checkpoint, "must be True or False")
  dts = [jnp.dtype(v.dtype) for v in (x, A, B, C)]
  cd = jnp.dtype(jnp.bfloat16) if all(d == jnp.bfloat16 for d in dts) else jnp.dtype(jnp.result_type(*dts))
  return _Problem(batch, seq, d_in, n, C.shape[1], jnp.dtype(x.dtype), cd, unbatched)


# ---------------------------------------------------------------------------------
# The reference (pure JAX)
# ---------------------------------------------------------------------------------


def _dot(a, b, cd):
  """``a @ b`` with operands in ``cd`` and an f32 (f64 for float64) result."""
  out = jnp.float64 if cd == jnp.float64 else jnp.float32
  return jnp.matmul(a.astype(cd), b.astype(cd), preferred_element_type=out,
                    precision=None if cd == jnp.bfloat16 else HIGHEST)


def _reference(x, A, B, C, h0, *, p: _Problem):
  xb = x[None] if p.unbatched else x
  acc = jnp.float64 if p.cd == jnp.float64 else jnp.float32
  h = jnp.zeros((p.batch, p.n), acc) if h0 is None else h0.reshape(p.batch, p.n).astype(acc)
  u = _dot(xb, B, p.cd)  # [batch, seq, n]

  def step(h, u_t):
    h = _dot(h, A, p.cd) + u_t
    return h, h
  _, hs = lax.scan(step, h, jnp.swapaxes(u, 0, 1))
  y = _dot(jnp.swapaxes(hs, 0, 1), C, p.cd).astype(x.dtype)
  return y[0] if p.unbatched else y


def parallel_scan_reference(x, A, B, C, *, h0=None):
  """:func:`parallel_scan` as a ``lax.scan`` over time (``x @ B`` and ``h @ C`` as whole-sequence matmuls)."""
  p = _validate(x, A, B, C, h0, None, True)
  return _reference(x, A, B, C, h0, p=p)


# ---------------------------------------------------------------------------------
# Planning: segments and blocks
# ---------------------------------------------------------------------------------


def default_num_segments(batch: int, seq: int) -> int:
  """Segments for a ``[batch, seq, *]`` problem: 1 when ``batch >= TARGET_ROWS``, else the smallest
  power of two with ``batch * L >= TARGET_ROWS``, at most ``seq // MIN_SEGMENT`` (and at least 1)."""
  if batch >= TARGET_ROWS:
    return 1
  want = 1
  while batch * want < TARGET_ROWS:
    want *= 2
  cap = 1
  while cap * 2 <= seq // MIN_SEGMENT:
    cap *= 2
  return max(1, min(want, cap))


@dataclasses.dataclass(frozen=True)
class _Plan:
  segments: int  # L
  s: int  # tokens per segment (a multiple of SEQ_MULTIPLE)
  rows: int  # batch * L
  lb: int  # rows per block
  tj: int  # tokens per chunk
  n: int  # n padded to lanes

  @property
  def k(self) -> int:
    return self.n // tiling.LANES

  @property
  def grid(self):
    return (self.rows // self.lb, self.s // self.tj)


def _largest_divisor(m: int, cap: int, ok=lambda d: True) -> int:
  best = None
  for d in range(1, min(m, cap) + 1):
    if m % d == 0 and ok(d):
      best = d
  return best


def _vmem_bytes(p: _Problem, lb: int, tj: int, n: int, checkpoint: bool) -> int:
  """The larger VMEM plan of the forward and backward kernels: double-buffered blocks, the
  weights single-buffered (their block never changes), the f32 slabs of scratch."""
  xb, cdb, r, f32 = p.x_dtype, p.cd, lb * tj, jnp.float32
  weights = [((n, n), cdb), ((p.d_in, n), cdb), ((n, p.d_out), cdb)]
  states = [] if checkpoint else [((lb, tj, n), f32)]
  fwd = (tiling.vmem_footprint([((lb, tj, p.d_in), xb), ((lb, tj, p.d_out), xb), ((lb, n), f32)] * 1 + states,
                               scratch=[((lb, n), f32)] + [((r, n), f32)] * (2 if checkpoint else 3))
         + tiling.vmem_footprint(weights, buffers=1))
  bwd = (tiling.vmem_footprint([((lb, tj, p.d_in), xb)] * 2 + [((lb, tj, p.d_out), xb)] + [((lb, n), f32)] * 3
                               + [((n, n), f32), ((p.d_in, n), f32), ((n, p.d_out), f32)] + states,
                               scratch=[((lb, n), f32)] + [((r, n), f32)] * 5)
         + tiling.vmem_footprint(weights * 2, buffers=1))
  return max(fwd, bwd)


def _plan(p: _Problem, num_segments: int | None, checkpoint: bool) -> _Plan:
  chip = target_chip() or get_chip("v5e")
  L = num_segments or default_num_segments(p.batch, p.seq)
  L = min(L, p.seq)
  s = tiling.round_up(tiling.cdiv(p.seq, L), SEQ_MULTIPLE)
  rows = p.batch * L
  n = tiling.round_up(p.n, tiling.LANES)
  lb = _largest_divisor(rows, TARGET_ROWS, lambda d: d % 8 == 0 or d == rows) or rows
  m = s // SEQ_MULTIPLE

  def tj_for(lb, cap_rows):
    return SEQ_MULTIPLE * _largest_divisor(m, max(1, cap_rows // lb // SEQ_MULTIPLE))
  cap = MAX_BLOCK_ROWS
  tj = s if lb * s <= WHOLE_SEGMENT_ROWS else tj_for(lb, cap)
  while 1.25 * _vmem_bytes(p, lb, tj, n, checkpoint) + (1 << 20) > chip.vmem_bytes:
    if tj > SEQ_MULTIPLE:
      cap //= 2
      tj = tj_for(lb, cap)
    else:
      smaller = _largest_divisor(rows, lb - 1, lambda d: d % 8 == 0)
      if not smaller:
        break
      lb = smaller
  tiling.vmem_limit(_vmem_bytes(p, lb, tj, n, checkpoint), chip, argument="x", value=None)
  return _Plan(L, s, rows, lb, tj, n)


def _limit(p, plan, checkpoint):
  return tiling.vmem_limit(_vmem_bytes(p, plan.lb, plan.tj, plan.n, checkpoint), target_chip() or "v5e",
                           argument="x")


# ---------------------------------------------------------------------------------
# The kernels
# ---------------------------------------------------------------------------------


def _kdot(a, b, cd):
  return jnp.dot(a.astype(cd), b.astype(cd), preferred_element_type=jnp.float32,
                 precision=None if cd == jnp.bfloat16 else HIGHEST)


def _tdot(a, b, cd):
  """``a^T @ b`` (contracting the rows of both), f32."""
  return lax.dot_general(a.astype(cd), b.astype(cd), (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32,
                         precision=None if cd == jnp.bfloat16 else HIGHEST)


def _put(slabs, v):
  """Writes ``[r, n]`` ``v`` into the ``[k, r, 128]`` lane slabs."""
  for q in range(slabs.shape[0]):
    slabs[q] = v[:, q * tiling.LANES:(q + 1) * tiling.LANES]


def _get(slabs):
  k = slabs.shape[0]
  return jnp.concatenate([slabs[q] for q in range(k)], axis=1) if k > 1 else slabs[0]


def _sequential(h, a, u_slabs, out_slabs, prev_slabs, *, lb, tj, cd, reverse=False):
  """``tj`` steps ``h = h @ a + u[:, j]`` over the block's rows (segments), ``h`` ``[lb, n]`` f32.
  Row ``j`` of every segment is a strided load (stride ``tj``) from each lane slab; the new state
  goes to ``out_slabs`` and (if given) the state before the step to ``prev_slabs``."""
  k = u_slabs.shape[0]
  L = tiling.LANES

  def body(i, h):
    j = tj - 1 - i if reverse else i
    rows = pl.ds(j, lb, stride=tj)
    if prev_slabs is not None:
      for q in range(k):
        prev_slabs.at[q][rows, :] = h[:, q * L:(q + 1) * L]
    u = [u_slabs.at[q][rows, :] for q in range(k)]
    h = _kdot(h, a, cd) + (jnp.concatenate(u, axis=1) if k > 1 else u[0])
    if out_slabs is not None:
      for q in range(k):
        out_slabs.at[q][rows, :] = h[:, q * L:(q + 1) * L]
    return h
  return lax.fori_loop(0, tj, body, h, unroll=8 if tj % 8 == 0 else 1)


def _forward_kernel(*refs, plan: _Plan, p: _Problem, mode: str, save_all: bool):
  """mode "ends": each segment from zero, its last state out. mode "out": from the start states, y out,
  with the state entering each chunk (and, with save_all, every h_{t-1})."""
  lb, tj, cd = plan.lb, plan.tj, p.cd
  if mode == "ends":
    x_ref, a_ref, b_ref, end_ref, h_ref, u_s = refs
    h_s = hp_s = None
  else:
    x_ref, a_ref, b_ref, c_ref, start_ref, y_ref, cs_ref, *rest = refs
    hp_ref = rest.pop(0) if save_all else None
    h_ref, u_s, h_s = rest[:3]
    hp_s = rest[3] if save_all else None
  c = pl.program_id(1)

  @pl.when(c == 0)
  def _():
    h_ref[...] = jnp.zeros_like(h_ref) if mode == "ends" else start_ref[...]

  x = x_ref[...].reshape(lb * tj, p.d_in)
  _put(u_s, _kdot(x, b_ref[...], cd))
  if mode == "out":
    cs_ref[...] = h_ref[...]
  h = _sequential(h_ref[...], a_ref[...], u_s, h_s, hp_s, lb=lb, tj=tj, cd=cd)
  h_ref[...] = h
  if mode == "ends":
    @pl.when(c == plan.grid[1] - 1)
    def _():
      end_ref[...] = h
  else:
    y_ref[...] = _kdot(_get(h_s), c_ref[...], cd).reshape(lb, tj, p.d_out).astype(y_ref.dtype)
    if save_all:
      hp_ref[...] = _get(hp_s).reshape(lb, tj, plan.n)


def _backward_kernel(*refs, plan: _Plan, p: _Problem, mode: str, checkpoint: bool):
  """The reverse scan ``g_t = dy_t @ C^T + g_{t+1} @ A^T`` over a block, chunks visited last to first.
  mode "ends": from zero after each segment, g at its first token out. mode "grads": from the true
  carries, with dx, and dA, dB, dC accumulated per row block."""
  lb, tj, cd, n = plan.lb, plan.tj, p.cd, plan.n
  if mode == "ends":
    dy_ref, ct_ref, at_ref, gfirst_ref, g_ref, gy_s = refs
  else:
    (dy_ref, ct_ref, at_ref, gnext_ref, x_ref, a_ref, b_ref, bt_ref, hin_ref,
     dx_ref, gfirst_ref, da_ref, db_ref, dc_ref, g_ref, gy_s, g_s, u_s, h_s, hp_s) = refs
  c = pl.program_id(1)
  last = c == plan.grid[1] - 1  # (the chunk visited last: the first of each segment)

  @pl.when(c == 0)
  def _():
    g_ref[...] = jnp.zeros_like(g_ref) if mode == "ends" else gnext_ref[...]
    if mode == "grads":
      da_ref[...] = jnp.zeros_like(da_ref)
      db_ref[...] = jnp.zeros_like(db_ref)
      dc_ref[...] = jnp.zeros_like(dc_ref)

  dy = dy_ref[...].reshape(lb * tj, p.d_out)
  _put(gy_s, _kdot(dy, ct_ref[...], cd))
  g = _sequential(g_ref[...], at_ref[...], gy_s, None if mode == "ends" else g_s, None, lb=lb, tj=tj, cd=cd,
                  reverse=True)
  g_ref[...] = g

  @pl.when(last)
  def _():
    gfirst_ref[...] = g

  if mode == "ends":
    return
  x = x_ref[...].reshape(lb * tj, p.d_in)
  u = _kdot(x, b_ref[...], cd)
  if checkpoint:  # the inside of the chunk recomputed from the state entering it
    _put(u_s, u)
    _sequential(hin_ref[...], a_ref[...], u_s, h_s, hp_s, lb=lb, tj=tj, cd=cd)
    hp, h = _get(hp_s), _get(h_s)
  else:
    hp = hin_ref[...].reshape(lb * tj, n)
    h = _kdot(hp, a_ref[...], cd) + u
  G = _get(g_s)
  dx_ref[...] = _kdot(G, bt_ref[...], cd).reshape(lb, tj, p.d_in).astype(dx_ref.dtype)
  da_ref[...] += _tdot(hp, G, cd)
  db_ref[...] += _tdot(x, G, cd)
  dc_ref[...] += _tdot(h, dy, cd)


# --- pallas_call wrappers -----------------------------------------------------------


def _params(p, plan, checkpoint):
  return pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                              vmem_limit_bytes=_limit(p, plan, checkpoint))


def _specs(plan: _Plan, reverse: bool):
  nc = plan.grid[1]
  cm = (lambda c: nc - 1 - c) if reverse else (lambda c: c)

  def seq(w):
    return pl.BlockSpec((plan.lb, plan.tj, w), lambda r, c: (r, cm(c), 0))

  def full(shape):  # (weights: one buffer, fetched once)
    return pl.BlockSpec(shape, lambda r, c: (0,) * len(shape), pipeline_mode=pl.Buffered(1))
  row = pl.BlockSpec((plan.lb, plan.n), lambda r, c: (r, 0))
  chunk_row = pl.BlockSpec((None, plan.lb, plan.n), lambda r, c: (cm(c), r, 0))

  def acc(shape):
    return pl.BlockSpec((None,) + shape, lambda r, c: (r, 0, 0))
  return seq, full, row, chunk_row, acc


def _slabs(plan):
  return pltpu.VMEM((plan.k, plan.lb * plan.tj, tiling.LANES), jnp.float32)


def _cost(p, plan, passes, extra_bytes=0):
  tokens = plan.rows * plan.s
  flops = 2 * tokens * (passes * plan.n * plan.n + p.d_in * plan.n + p.d_out * plan.n)
  return pl.CostEstimate(flops=int(flops), transcendentals=0,
                         bytes_accessed=int(tokens * (p.d_in + p.d_out) * p.x_dtype.itemsize + extra_bytes))


def _ends(x3, a, b, *, p, plan, checkpoint, interpret):
  seq, full, row, _, _ = _specs(plan, False)
  n = plan.n
  return calls.pallas_call(
      functools.partial(_forward_kernel, plan=plan, p=p, mode="ends", save_all=False), grid=plan.grid,
      in_specs=[seq(p.d_in), full((n, n)), full((p.d_in, n))], out_specs=row,
      out_shape=jax.ShapeDtypeStruct((plan.rows, n), jnp.float32),
      scratch_shapes=[pltpu.VMEM((plan.lb, n), jnp.float32), _slabs(plan)],
      compiler_params=_params(p, plan, checkpoint), cost_estimate=_cost(p, plan, 1),
      interpret=interpret, name="parallel_scan_ends")(x3, a, b)


def _outputs(x3, a, b, c, starts, *, p, plan, save_all, checkpoint, interpret):
  seq, full, row, chunk_row, _ = _specs(plan, False)
  n, nc = plan.n, plan.grid[1]
  out_shape = [jax.ShapeDtypeStruct((plan.rows, plan.s, p.d_out), p.x_dtype),
               jax.ShapeDtypeStruct((nc, plan.rows, n), jnp.float32)]
  out_specs = [seq(p.d_out), chunk_row]
  if save_all:
    out_shape.append(jax.ShapeDtypeStruct((plan.rows, plan.s, n), jnp.float32))
    out_specs.append(seq(n))
  outs = calls.pallas_call(
      functools.partial(_forward_kernel, plan=plan, p=p, mode="out", save_all=save_all), grid=plan.grid,
      in_specs=[seq(p.d_in), full((n, n)), full((p.d_in, n)), full((n, p.d_out)), row],
      out_specs=out_specs, out_shape=out_shape,
      scratch_shapes=[pltpu.VMEM((plan.lb, n), jnp.float32)] + [_slabs(plan)] * (3 if save_all else 2),
      compiler_params=_params(p, plan, checkpoint),
      cost_estimate=_cost(p, plan, 1, 4 * plan.rows * plan.s * n * save_all),
      interpret=interpret, name="parallel_scan")(x3, a, b, c, starts)
  return outs[0], outs[1], (outs[2] if save_all else None)


def _bwd_ends(dy3, ct, at, *, p, plan, checkpoint, interpret):
  seq, full, row, _, _ = _specs(plan, True)
  n = plan.n
  return calls.pallas_call(
      functools.partial(_backward_kernel, plan=plan, p=p, mode="ends", checkpoint=checkpoint), grid=plan.grid,
      in_specs=[seq(p.d_out), full((p.d_out, n)), full((n, n))], out_specs=row,
      out_shape=jax.ShapeDtypeStruct((plan.rows, n), jnp.float32),
      scratch_shapes=[pltpu.VMEM((plan.lb, n), jnp.float32), _slabs(plan)],
      compiler_params=_params(p, plan, checkpoint), cost_estimate=_cost(p, plan, 1),
      interpret=interpret, name="parallel_scan_backward_ends")(dy3, ct, at)


def _grads(dy3, ct, at, gnext, x3, a, b, bt, hin, *, p, plan, checkpoint, interpret):
  seq, full, row, chunk_row, acc = _specs(plan, True)
  n, nr = plan.n, plan.grid[0]
  hin_spec = chunk_row if checkpoint else seq(n)
  f32 = jnp.float32
  return calls.pallas_call(
      functools.partial(_backward_kernel, plan=plan, p=p, mode="grads", checkpoint=checkpoint), grid=plan.grid,
      in_specs=[seq(p.d_out), full((p.d_out, n)), full((n, n)), row, seq(p.d_in), full((n, n)), full((p.d_in, n)),
                full((n, p.d_in)), hin_spec],
      out_specs=[seq(p.d_in), row, acc((n, n)), acc((p.d_in, n)), acc((n, p.d_out))],
      out_shape=[jax.ShapeDtypeStruct((plan.rows, plan.s, p.d_in), p.x_dtype),
                 jax.ShapeDtypeStruct((plan.rows, n), f32), jax.ShapeDtypeStruct((nr, n, n), f32),
                 jax.ShapeDtypeStruct((nr, p.d_in, n), f32), jax.ShapeDtypeStruct((nr, n, p.d_out), f32)],
      scratch_shapes=[pltpu.VMEM((plan.lb, n), f32)] + [_slabs(plan)] * 5,
      compiler_params=_params(p, plan, checkpoint),
      cost_estimate=_cost(p, plan, 2 + checkpoint, 4 * plan.rows * plan.s * n * (not checkpoint)),
      interpret=interpret, name="parallel_scan_backward")(dy3, ct, at, gnext, x3, a, b, bt, hin)


# --- carries across segments (XLA) ----------------------------------------------------


def _matpow(a, e: int):
  """``a^e`` (f32, full precision) by repeated squaring."""
  out, sq = None, a
  while e:
    if e & 1:
      out = sq if out is None else jnp.matmul(out, sq, precision=HIGHEST)
    e >>= 1
    if e:
      sq = jnp.matmul(sq, sq, precision=HIGHEST)
  return out


def _carries(e, P, init):
  """``starts[:, 0] = init``, ``starts[:, l + 1] = starts[:, l] @ P + e[:, l]`` for ``e`` ``[batch, L, n]``:
  a log-step scan over the segments (offsets 1, 2, 4, ... against P, P^2, P^4, ...)."""
  L = e.shape[1]
  w = e.at[:, 0].add(jnp.matmul(init, P, precision=HIGHEST))
  k, Pk = 1, P
  while k < L:
    shifted = jnp.matmul(w[:, :-k], Pk, precision=HIGHEST)
    w = w + jnp.pad(shifted, ((0, 0), (k, 0), (0, 0)))
    k *= 2
    if k < L:
      Pk = jnp.matmul(Pk, Pk, precision=HIGHEST)
  return jnp.concatenate([init[:, None], w[:, :-1]], axis=1)


# --- the differentiable Pallas path ----------------------------------------------------


def _pallas_path(x3, a, b, c, h0, *, p: _Problem, plan: _Plan, checkpoint: bool, interpret):
  """On padded operands: x3 ``[rows, s, d_in]``, a/b/c padded to ``plan.n`` in ``p.cd``, h0 ``[batch, n]`` f32."""
  L, kw = plan.segments, dict(p=p, plan=plan, checkpoint=checkpoint, interpret=interpret)

  def starts_of(x3, a, b, h0):
    if L == 1:
      return h0
    e = _ends(x3, a, b, **kw).reshape(p.batch, L, plan.n)
    return _carries(e, _matpow(a.astype(jnp.float32), plan.s), h0).reshape(plan.rows, plan.n)

  @jax.custom_vjp
  def f(x3, a, b, c, h0):
    return _outputs(x3, a, b, c, starts_of(x3, a, b, h0), save_all=False, **kw)[0]

  def f_fwd(x3, a, b, c, h0):
    y, cs, hp = _outputs(x3, a, b, c, starts_of(x3, a, b, h0), save_all=not checkpoint, **kw)
    return y, (x3, a, b, c, cs if checkpoint else hp)

  def f_bwd(res, dy3):
    x3, a, b, c, hin = res
    at, bt, ct = a.T, b.T, c.T
    if L == 1:
      gnext = jnp.zeros((plan.rows, plan.n), jnp.float32)
    else:
      e = _bwd_ends(dy3, ct, at, **kw).reshape(p.batch, L, plan.n)
      pt = _matpow(at.astype(jnp.float32), plan.s)
      gnext = _carries(e[:, ::-1], pt, jnp.zeros((p.batch, plan.n), jnp.float32))[:, ::-1]
      gnext = gnext.reshape(plan.rows, plan.n)
    dx, gfirst, da, db, dc = _grads(dy3, ct, at, gnext, x3, a, b, bt, hin, **kw)
    g0 = gfirst.reshape(p.batch, L, plan.n)[:, 0]
    dh0 = jnp.matmul(g0, at.astype(jnp.float32), precision=HIGHEST)
    return dx, da.sum(0).astype(a.dtype), db.sum(0).astype(b.dtype), dc.sum(0).astype(c.dtype), dh0

  f.defvjp(f_fwd, f_bwd)
  return f(x3, a, b, c, h0)


def _pallas_entry(x, A, B, C, h0, *, p: _Problem, num_segments, checkpoint, interpret):
  if p.cd not in KERNEL_DTYPES or p.x_dtype not in KERNEL_DTYPES:
    raise NotImplementedError("the Pallas kernels take float32 and bfloat16 (float64 runs on the XLA path)")
  plan = _plan(p, num_segments, checkpoint)
  pad_n = plan.n - p.n
  a = jnp.pad(A.astype(p.cd), ((0, pad_n), (0, pad_n)))
  b = jnp.pad(B.astype(p.cd), ((0, 0), (0, pad_n)))
  c = jnp.pad(C.astype(p.cd), ((0, pad_n), (0, 0)))
  h = (jnp.zeros((p.batch, p.n), jnp.float32) if h0 is None
       else h0.reshape(p.batch, p.n).astype(jnp.float32))
  h = jnp.pad(h, ((0, 0), (0, pad_n)))
  xb = x[None] if p.unbatched else x
  total = plan.segments * plan.s
  if total != p.seq:
    xb = jnp.pad(xb, ((0, 0), (0, total - p.seq), (0, 0)))
  x3 = xb.reshape(plan.rows, plan.s, p.d_in)
  y = _pallas_path(x3, a, b, c, h, p=p, plan=plan, checkpoint=checkpoint, interpret=interpret)
  y = y.reshape(p.batch, total, p.d_out)[:, :p.seq]
  return y[0] if p.unbatched else y


# Why no sequence-parallel form: across devices it would be this kernel's own segments (a local
# scan per shard, the carries, a rescan), but a shard's transfer is the dense matrix A^s, the carry
# chain a dense [batch, n] x [n, n] product per device, and the backward a second such chain in
# A^T; the kernel returns no final state to build it from, and its segments already spread the
# sequence over the MXU on one chip. So a split sequence is an error that names the alternatives.
_NO_SEQUENCE_SPLIT = ("its dense n x n transition makes each shard's transfer the dense matrix A^seq_local and "
                      "needs a final state the kernel does not return, so it has no sequence-parallel form here "
                      "(its segments already parallelise the sequence on one chip). Split batch instead, gather the "
                      "sequence first (jax.sharding.reshard(x, P(batch_axes, None, None))), or use linear_scan or "
                      "ssd, which run sequence-parallel")


def parallel_scan(x, A, B, C, *, h0=None, num_segments=None, checkpoint=True, implementation=None, interpret=None):
  """A dense linear time-invariant state-space model: ``h_t = h_{t-1} @ A + x_t @ B``, ``y_t = h_t @ C``.

  Args:
    x: the inputs, ``[batch, seq, d_in]`` (or ``[seq, d_in]``), float32 or bfloat16.
    A: the state transition, ``[n, n]``.
    B: the input matrix, ``[d_in, n]``.
    C: the output matrix, ``[n, d_out]``.
    h0: the state before the first token, ``[batch, n]`` (``[n]`` for an unbatched ``x``);
      None for zeros. Carried in float32.
    num_segments: how many segments the sequence is cut into (they are scanned side by
      side, then corrected); None for :func:`default_num_segments`. 1 runs the plain
      recurrence in one pass.
    checkpoint: True to save only the state entering each chunk for the backward pass,
      which recomputes the states inside it; False to save every state (``[batch, seq, n]``
      float32 more in HBM, one sequential loop fewer in the backward).
    implementation, interpret: see :func:`kernels.dispatch`.

  The state is float32. Products take the parameters' dtype: all of ``x``, ``A``, ``B``,
  ``C`` bf16 multiplies bf16 operands (the state rounded to bf16 as an operand of each
  step, accumulated in f32); otherwise float32 at full precision. float64 (with x64) runs
  on the XLA path only.

  Returns:
    ``y``, ``[batch, seq, d_out]`` (``[seq, d_out]`` for an unbatched ``x``) in ``x``'s
    dtype. Differentiable in ``x``, ``A``, ``B``, ``C`` and ``h0`` (Pallas backward).

  Sharded (under ``jit`` on a mesh, see :mod:`kernels.base.partition`): ``batch`` splits
  locally; the sequence does not split (see ``_NO_SEQUENCE_SPLIT``: gather it first).

  Raises:
    KernelError: bad input (shapes that do not match, non-floating dtypes), naming the
      argument, before anything is lowered.
  """
  p = _validate(x, A, B, C, h0, num_segments, checkpoint)
  batched = x.ndim == 3
  rows = ("batch", "seq", None) if batched else ("seq", None)
  dims = dict(x=rows, A=(None, None), B=(None, None), C=(None, None), h0=("batch", None) if batched else (None,))
  operands = dict(x=x, A=A, B=B, C=C, h0=h0)
  split = partition.plan("parallel_scan", operands, dims, splits={"batch": "local", "seq": "never: it has no sequence-parallel form"})
  if split is not None:
    if split.of("seq"):
      raise KernelError("x", x, f"parallel_scan cannot split its sequence (split over {split.of('seq')}): "
                                + _NO_SEQUENCE_SPLIT)

    def local(x, A, B, C, h0=None):
      return parallel_scan(x, A, B, C, h0=h0, num_segments=num_segments, checkpoint=checkpoint,
                           implementation=implementation, interpret=interpret)
    return split.run(local, operands, dims, rows)
  return dispatch(
      "parallel_scan", x, A, B, C, h0,
      pallas=lambda x, A, B, C, h0, interpret: _pallas_entry(x, A, B, C, h0, p=p, num_segments=num_segments,
                                                             checkpoint=checkpoint, interpret=interpret),
      xla=lambda x, A, B, C, h0: _reference(x, A, B, C, h0, p=p),
      implementation=implementation, interpret=interpret)
