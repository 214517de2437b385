"""A diagonal linear recurrence ``h_t = a_t * h_{t-1} + b_t`` (a linear scan), in Pallas.

``linear_scan(a, b)`` runs the recurrence elementwise over ``[batch, seq, width]``
(the state update of Griffin's RG-LRU, of Mamba-style selective scans with a diagonal
state, of LRU and S4D with complex gates) and returns every state. Options: an initial
state ``h0``, running from the last token to the first (``reverse=True``), dropping
the state at document boundaries (``reset``), and returning the final state.
:func:`linear_scan_reference` is the same recurrence as a plain ``lax.scan``.

How the scan kernel works
-------------------------

*Memory bound.* A step is a multiply and an add per element: with bf16 ``a`` and ``b``
and a bf16 ``h``, 2 FLOPs for 6 bytes. The time is the bytes moved over the HBM
bandwidth, so the kernel reads ``a`` and ``b`` once and writes ``h`` once, and keeps
the vector work of a block shorter than its DMAs.

*Tiling.* Blocks of ``(1, seq_chunk, width_block)`` over ``[B, T, W]``; the grid is
``(batch, width blocks, seq chunks)`` with semantics parallel, parallel, arbitrary:
lanes and batch rows are independent (on v4 and v5p the two TensorCores share them),
while the seq chunks run in order. The f32 state of the block's lanes lives in a VMEM
scratch ``[1, width_block]`` across the chunks, set to ``h0`` at the first chunk.

*Inside a block.* The rows are processed a *tile* at a time: 8 rows for f32 operands,
16 when an operand is bf16 (the native tile of a packed dtype), by up to a couple of
thousand lanes (16 f32 vector registers per operand). Each 8-row group of a tile (one f32
vector register per 128 lanes) is a log-step (Hillis-Steele) scan held in registers:
each row holds a pair ``(A, B)`` meaning ``h = A * h_before + B``. The carry enters
first: the group's first row becomes ``(0, A * carry + B)``. Then 3 steps combine each
row with the row ``k`` = 1, 2, 4 above it (rolled along sublanes),
``(A, B) <- (A * A_k, A * B_k + B)``, and ``B`` is ``h``. The rolls wrap around, but what
wraps always lands on a row whose product ``A`` already holds the first row's 0, so no
step needs a mask: 3 vector operations a step, not 5. A 16-row tile chains its
two groups; the carry becomes the last row. Each step depends on the one before, so a
tile is wide: the 16 registers of a step issue while the first ones are still in flight.
Tiles run in a ``lax.fori_loop`` (a few unrolled), for each slice of lanes in turn.

*Gates.* ``a`` may be ``[B, T, W]``; ``[B, T, 1]`` (one gate per token, broadcast
across lanes); or ``[W]`` (time-invariant, one ``(1, width_block)`` block). A
``reset`` is folded into a per-token f32 ``[B, T, 1]`` stream before the kernel: the
gate itself times ``1 - reset`` for per-token gates, else ``1 - reset`` alone, which
multiplies the gate in the kernel (4 bytes a token).

*Reverse.* ``reverse=True`` runs from the last token to the first: the index maps visit
the chunks in reverse order, the tile loop runs backward and the tile scan rolls the
other way. Nothing is flipped in HBM.

*Ragged sequences.* A sequence that is not a multiple of the tile is one partial last
chunk (the chunk is rounded up to whole tiles; Pallas reads stale values past the end
and drops what is written there). Its rows past the end are replaced by the identity
``(a, b) = (1, 0)`` with a select before the scan, so they leave the carry unchanged in
either direction and stale values (maybe NaN) never reach it.

*Complex recurrences.* Complex gates and inputs (``complex64``; or their real and
imaginary planes passed as pairs, ``a=(a_re, a_im)``, ``b=(b_re, b_im)``) run the same
kernels on two planes per operand with complex products. complex64 arrays are split
into planes (and ``h`` joined back) by XLA, which costs a pass over memory each way:
pass planes to avoid it.

*Backward* (``custom_vjp``, its own Pallas kernel). With ``A_t`` the effective gate
(``a_t``, times ``1 - reset_t``), the gradient of the state is a scan in the opposite
direction, ``g_t = dy_t + A_{t+1} g_{t+1}``, started from the cotangent of the final
state; then ``db_t = g_t``, ``da_t = g_t * h_{t-1}`` (times ``1 - reset_t``) and
``dh0 = A_0 g_0`` (with complex planes, the conjugates of ``A`` and ``h``: the planes are a
real function). The shifted gate ``A_{t+1}`` comes from rolling the tile's gates by
one row, its last row carried from the tile processed before. ``h_{t-1}`` comes from
the forward's output ``h`` (as stored, so rounded to bf16 for bf16 ``b``) rolled one
row; its edge row is the last row of the neighbouring tile of the VMEM block or, at a
chunk's first row, the state the forward carried into that chunk: the forward saves it
(``[B, chunks, 1, W]`` f32, one row per chunk) when it runs under autodiff. The
backward therefore reads ``a``, ``h`` and ``dy`` and writes ``da`` and ``db``: with the
forward, 8 arrays moved where one fused program would need 6. Per-token gates reduce
``da`` across lanes in the kernel (one partial sum per width block, summed by XLA);
time-invariant gates accumulate it per batch row in a VMEM scratch, summed over the
batch by XLA.

*Block sizes.* ``kernels/data/scan_blocks.json`` (``tools/tune_scan.py``: compiler
estimates, floored, per generation and dtype) holds the default ``seq_chunk`` and
``width_block``; :func:`fit_block_sizes` shrinks them until the VMEM plan fits.

*Backend choice* (:func:`kernels.dispatch`): ``implementation=None`` runs the Pallas
kernel when lowered for TPU and the reference (``lax.scan``) elsewhere. float64
(with x64 enabled) runs only on the reference path.

*Estimates.* ``tools/tune_scan.py bench`` stores compiler estimates (libtpu's cost
model, floored at the HBM bandwidth; not measurements) of the kernels, of ``lax.scan``,
``lax.associative_scan`` and Griffin's Pallas scan at ``[8, 4096, 2048]`` bf16 in
``kernels/data/scan_bench.json``.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.base import calls
from kernels.base import partition
from kernels.base import tiling
from kernels.base.backend import dispatch, target_chip
from kernels.base.errors import KernelError, TilingError, check
from kernels.base.hardware import get_chip

__all__ = ["BlockSizes", "default_block_sizes", "fit_block_sizes", "linear_scan", "linear_scan_reference"]

KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
REAL_DTYPES = KERNEL_DTYPES + (jnp.dtype(jnp.float64),)
COMPLEX_DTYPES = (jnp.dtype(jnp.complex64), jnp.dtype(jnp.complex128))
GATES = ("full", "token", "time")  # a: [B, T, W], [B, T, 1], [W]


# ---------------------------------------------------------------------------------
# Block sizes
# ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tokens per seq chunk and lanes per width block (each grid step is ``seq_chunk x width_block``).

  ``None`` picks the per-generation default. ``seq_chunk`` must be a multiple of the
  row tile (8, or 16 when an operand is bf16) unless it covers the sequence;
  ``width_block`` a multiple of 128 unless it covers the width.
  """

  seq_chunk: int | None = None
  width_block: int | None = None

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


_FALLBACK = (512, 1024)  # without a table entry


def default_block_sizes(generation=None, dtype=jnp.bfloat16, width: int = 2048) -> BlockSizes:
  """The shipped default blocks for ``width`` on ``generation`` (None: v5e).

  ``kernels/data/scan_blocks.json`` holds, per generation and dtype, the blocks
  ``tools/tune_scan.py`` found fastest at a tuned width; a call takes the nearest tuned
  width's entry (the width block at most the width). :func:`fit_block_sizes` then
  shrinks them to fit VMEM.
  """
  gen = get_chip(generation).name if generation is not None else "v5e"
  entries = tiling.block_table("scan").get(gen, {}).get(jnp.dtype(dtype).name, [])
  if not entries:
    return BlockSizes(*_FALLBACK)
  best = min(entries, key=lambda e: abs(math.log2(width / e["width"])))
  return BlockSizes(best["seq_chunk"], best["width_block"])


def _tile_rows(dtypes) -> int:
  """Rows per tile: the largest native sublane tile among the operands' dtypes."""
  return max(tiling.sublane_multiple(d) for d in dtypes)


def _vmem_bytes(seq_chunk: int, width_block: int, p, *, backward: bool) -> int:
  """VMEM plan of one kernel: double-buffered blocks plus the scratch (carries, accumulators)."""
  block = (seq_chunk, width_block)
  big = [(block, p.b_dtype)] * (3 if backward else 2)  # b, h (forward); h, dy, db (backward)
  if p.gate == "full":
    big += [(block, p.a_dtype)] * (2 if backward else 1)  # a (and da)
  n_tok = p.planes if p.gate == "token" else int(p.has_reset)
  small = [((seq_chunk, 1), jnp.float32)] * (n_tok + (backward and p.gate == "token"))  # (+ da's partial sums)
  small += [((1, width_block), jnp.float32)] * (3 + (p.gate == "time"))  # h0, final state, start rows, [W] gate
  blocks = [blk for blk in big + small for _ in range(p.planes)]
  scratch = [((1, width_block), jnp.float32)] * p.planes * (3 if backward else 1)
  return tiling.vmem_footprint(blocks, scratch=scratch)


def fit_block_sizes(blocks: BlockSizes, seq: int, width: int, dtype=jnp.bfloat16, *, chip=None) -> BlockSizes:
  """The blocks the kernels really use for a ``[*, seq, width]`` problem of bf16 or f32 ``a``
  and ``b`` with a full gate: each covers its dimension or is a multiple of the tile, and halved
  (seq_chunk first, while it is the larger) until both kernels' VMEM plans fit ``chip``."""
  c = get_chip(chip or "v5e")
  rows = _tile_rows([dtype])
  tc = min(tiling.round_up(seq, rows), max(rows, blocks.seq_chunk // rows * rows))
  wb = width if blocks.width_block >= width else max(tiling.LANES, blocks.width_block // tiling.LANES * tiling.LANES)
  p = _Problem(1, seq, width, "full", jnp.dtype(dtype), jnp.dtype(dtype), 1, False, False, False)

  def fits(tc, wb):
    need = max(_vmem_bytes(tc, wb, p, backward=bw) for bw in (False, True))
    return 1.25 * need + (1 << 20) <= c.vmem_bytes
  while not fits(tc, wb):
    if tc > 128:
      tc = tc // 2 // rows * rows
    elif wb > tiling.LANES:
      wb = max(tiling.LANES, wb // 2 // tiling.LANES * tiling.LANES)
    else:
      break
  return BlockSizes(tc, wb)


# ---------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Problem:
  batch: int
  seq: int
  width: int
  gate: str  # "full", "token" or "time"
  a_dtype: jnp.dtype  # (of a plane)
  b_dtype: jnp.dtype
  planes: int  # 1 real, 2 complex
  reverse: bool
  has_reset: bool
  complex_arrays: bool  # complex64 arrays (True) or plane pairs (False) when planes == 2

  @property
  def rows(self) -> int:
    return _tile_rows([self.a_dtype, self.b_dtype])


def _is_array(x) -> bool:
  return hasattr(x, "shape") and hasattr(x, "dtype")


def _planes_of(name: str, x):
  """``x`` as a tuple of planes: ``(x,)`` for a real array, ``(re, im)`` for a pair."""
  if isinstance(x, (tuple, list)):
    check(len(x) == 2 and all(_is_array(v) for v in x), name, x,
          "a tuple must be the (real, imaginary) pair of planes: two arrays")
    check(x[0].shape == x[1].shape and x[0].dtype == x[1].dtype, name, x,
          "its real and imaginary planes must have the same shape and dtype")
    check(jnp.dtype(x[0].dtype) in REAL_DTYPES, name, x,
          f"planes must be float32 or bfloat16 (float64 on the XLA path), not {jnp.dtype(x[0].dtype).name}")
    return tuple(x)
  check(_is_array(x), name, x, "must be an array (or a (real, imaginary) pair of arrays)")
  return (x,)


def _validate(a, b, h0, reset, reverse, return_final_state) -> _Problem:
  pairs = [isinstance(v, (tuple, list)) for v in (a, b)]
  check(pairs[0] == pairs[1], "a" if pairs[1] else "b", a if pairs[1] else b,
        "a and b must both be (real, imaginary) pairs of planes, or both arrays")
  ap, bp = _planes_of("a", a), _planes_of("b", b)
  complex_arrays = False
  if not pairs[0]:
    kinds = []
    for name, v in (("a", a), ("b", b)):
      d = jnp.dtype(v.dtype)
      check(d in REAL_DTYPES + COMPLEX_DTYPES, name, v,
            f"dtype {d.name} is not supported; linear_scan takes float32 or bfloat16 (float64 on the XLA path), "
            "or complex64")
      kinds.append(d in COMPLEX_DTYPES)
    check(kinds[0] == kinds[1], "a", a, "a and b must both be real or both be complex")
    complex_arrays = kinds[0]
  check(bp[0].ndim == 3 and bp[0].size > 0, "b", b, "must be [batch, seq, width] with at least one element")
  batch, seq, width = bp[0].shape
  shape = tuple(ap[0].shape)
  gates = {(batch, seq, width): "full", (batch, seq, 1): "token", (width,): "time"}
  check(shape in gates, "a", a, f"must have shape {(batch, seq, width)} (b's), {(batch, seq, 1)} (one gate per "
        f"token) or {(width,)} (time-invariant), not {shape}")
  if h0 is not None:
    hp = _planes_of("h0", h0)
    check(len(hp) == len(ap), "h0", h0, "must be a pair of planes exactly when a and b are")
    check(tuple(hp[0].shape) == (batch, width), "h0", h0, f"must have shape {(batch, width)} ([batch, width])")
    d = jnp.dtype(hp[0].dtype)
    check(d in (COMPLEX_DTYPES if complex_arrays else REAL_DTYPES), "h0", h0,
          "must be a floating-point array (complex when a and b are complex)")
  if reset is not None:
    check(_is_array(reset), "reset", reset, "must be a boolean array or None")
    check(jnp.dtype(reset.dtype) == jnp.bool_, "reset", reset, f"must be boolean, not {jnp.dtype(reset.dtype).name}")
    check(tuple(reset.shape) == (batch, seq), "reset", reset, f"must have shape {(batch, seq)} ([batch, seq])")
  check(isinstance(reverse, bool), "reverse", reverse, "must be True or False")
  check(isinstance(return_final_state, bool), "return_final_state", return_final_state, "must be True or False")
  plane = lambda v: jnp.dtype(jnp.finfo(v.dtype).dtype if complex_arrays else v.dtype)  # noqa: E731
  return _Problem(batch, seq, width, gates[shape], plane(ap[0]), plane(bp[0]), 2 if (pairs[0] or complex_arrays) else 1,
                  reverse, reset is not None, complex_arrays)


def _check_blocks(block_sizes) -> BlockSizes:
  if block_sizes is None:
    return BlockSizes()
  if isinstance(block_sizes, (tuple, list)) and len(block_sizes) == 2:
    block_sizes = BlockSizes(*block_sizes)
  check(isinstance(block_sizes, BlockSizes), "block_sizes", block_sizes,
        "must be None, a BlockSizes or a (seq_chunk, width_block) tuple")
  for name in ("seq_chunk", "width_block"):
    v = getattr(block_sizes, name)
    check(v is None or (isinstance(v, int) and not isinstance(v, bool) and v > 0), "block_sizes", block_sizes,
          f"{name} must be a positive int or None")
  return block_sizes


# ---------------------------------------------------------------------------------
# The reference (pure JAX)
# ---------------------------------------------------------------------------------


def _to_arrays(p: _Problem, a, b, h0):
  """Plane pairs joined into complex arrays (the reference computes on arrays)."""
  if p.planes == 2 and not p.complex_arrays:
    join = lambda v: None if v is None else lax.complex(*(x.astype(jnp.float32) for x in v))  # noqa: E731
    return join(a), join(b), join(h0)
  return a, b, h0


def _reference(a, b, h0, reset, *, p: _Problem):
  """``lax.scan`` over time in the state dtype (f32, complex64, or f64 for f64 inputs)."""
  a, b, h0 = _to_arrays(p, a, b, h0)
  state = jnp.result_type(jnp.float32, a.dtype, b.dtype)
  time_gate = a.astype(state) if p.gate == "time" else None  # (the same every step: not scanned over)
  at = None if p.gate == "time" else jnp.swapaxes(a, 0, 1).astype(state)  # [T, B, W or 1]
  bt = jnp.swapaxes(b, 0, 1).astype(state)
  keep = None if reset is None else jnp.swapaxes(~reset, 0, 1)[..., None]
  h = jnp.zeros((p.batch, p.width), state) if h0 is None else h0.astype(state)

  def step(h, x):
    a_t, b_t, keep_t = x
    if keep_t is not None:
      h = jnp.where(keep_t, h, 0)
    h = (time_gate if a_t is None else a_t) * h + b_t
    return h, h

  last, hs = lax.scan(step, h, (at, bt, keep), reverse=p.reverse)
  hs = jnp.swapaxes(hs, 0, 1).astype(b.dtype)
  if p.planes == 2 and not p.complex_arrays:
    return (jnp.real(hs).astype(p.b_dtype), jnp.imag(hs).astype(p.b_dtype)), (jnp.real(last), jnp.imag(last))
  return hs, last


def linear_scan_reference(a, b, *, h0=None, reverse=False, reset=None, return_final_state=False):
  """Pure-JAX :func:`linear_scan`: a ``lax.scan`` over time with the state in float32
  (complex64 for complex inputs, float64 for float64 inputs). Same arguments and results."""
  p = _validate(a, b, h0, reset, reverse, return_final_state)
  h, last = _reference(a, b, h0, reset, p=p)
  return (h, last) if return_final_state else h


# ---------------------------------------------------------------------------------
# The Pallas kernels
# ---------------------------------------------------------------------------------

# A tile is rows x (16384 / rows / planes) lanes: 16 f32 vector registers per operand, so each
# dependent step of the log scan has 16 independent registers to issue while the last one finishes.
TILE_ELEMENTS = 16384
UNROLL = 4  # tiles unrolled per fori_loop step


def _mul(x, y):
  """Product of two values given as plane tuples: (re,) or (re, im) (complex product)."""
  if len(x) == 1 or len(y) == 1:
    s, v = (x[0], y) if len(x) == 1 else (y[0], x)
    return tuple(s * u for u in v)
  return (x[0] * y[0] - x[1] * y[1], x[0] * y[1] + x[1] * y[0])


def _add(x, y):
  return tuple(u + v for u, v in zip(x, y))


def _conj(x):
  """The complex conjugate of a plane tuple (a real value is its own)."""
  return x if len(x) == 1 else (x[0], -x[1])


def _identity(v, valid, one: bool):
  """``v`` with the rows where ``valid`` is False set to 1 (``one``) or 0 (complex: 1 + 0i)."""
  return tuple(jnp.where(valid, u, 1.0 if one and i == 0 else 0.0) for i, u in enumerate(v))


def _roll(v, shift: int, rows: int):
  """Rolls the rows (sublanes) of each plane: row r moves to r + shift (mod rows)."""
  return tuple(pltpu.roll(u, shift % rows, 0) for u in v)


def _scan_rows(A, B, carry, down: bool):
  """``h = A * h_before + B`` over the rows of a tile from ``carry`` (the state before its first
  row processed). Returns (h, the carry after the tile).

  Each 8-row group (one f32 vector register per 128 lanes) takes the carry into its first row,
  ``B <- A * carry + B`` with that row's gate set to 0, and then three log steps of
  ``(A, B) <- (A * A', A * B' + B)``, where ``'`` is the pair rolled 1, 2, 4 rows. The rolls are
  cyclic, but what wraps around always lands on a row whose gate product already holds that 0, so
  no step needs a mask, and after the last step B is h itself. (A value that wraps is multiplied by
  0: an inf or NaN in a row also reaches the up to 7 rows of its group before it. Finite inputs are
  exact.) The groups are chained through the carry."""
  rows = A[0].shape[0]
  sub = tiling.SUBLANES
  row = lax.broadcasted_iota(jnp.int32, (sub,) + A[0].shape[1:], 0)
  first = row == (0 if down else sub - 1)
  groups = list(range(0, rows, sub))
  h_of = {}
  for g in (groups if down else groups[::-1]):
    at = slice(g, g + sub)
    a, b = tuple(u[at] for u in A), tuple(u[at] for u in B)
    b = tuple(jnp.where(first, u, v) for u, v in zip(_add(_mul(a, carry), b), b))
    a = tuple(jnp.where(first, 0.0, u) for u in a)
    k = 1
    while k < sub:
      shift = k if down else -k
      bs = _roll(b, shift, sub)
      if 2 * k < sub:  # (the last step needs no gate product)
        a, b = _mul(a, _roll(a, shift, sub)), _add(_mul(a, bs), b)
      else:
        b = _add(_mul(a, bs), b)
      k *= 2
    h_of[g] = b
    carry = tuple(v[sub - 1:] if down else v[:1] for v in b)
  h = tuple(jnp.concatenate([h_of[g][i] for g in groups], axis=0) if len(groups) > 1 else h_of[0][i]
            for i in range(len(A)))
  return h, carry


def _lane_slices(wb: int, rows: int, planes: int):
  """Static (offset, size) lane slices of a width block."""
  size = max(tiling.LANES, TILE_ELEMENTS // (rows * planes) // tiling.LANES * tiling.LANES)
  return [(o, min(size, wb - o)) for o in range(0, wb, size)]


def _tile_loop(n: int, backward_in_memory: bool, body, carry):
  """``body(tile_index, carry)`` over the ``n`` tiles of a block, in memory order or backward."""
  def step(i, c):
    k = n - 1 - i if backward_in_memory else i
    return body(k, c)
  return lax.fori_loop(0, n, step, carry, unroll=min(UNROLL, n))


class _Refs:
  """Pops a kernel's refs in order, as plane tuples."""

  def __init__(self, refs):
    self.refs = list(refs)

  def take(self, n: int):
    out, self.refs = tuple(self.refs[:n]), self.refs[n:]
    return out


def _gate(p: _Problem, a_refs, tok_refs, at, lanes, shape):
  """The effective gate A of a tile (f32 planes of ``shape``): a (per element or time-invariant)
  times the per-token stream (the per-token gate, or 1 - reset)."""
  parts = []
  if p.gate == "full":
    parts.append(tuple(r[at, lanes].astype(jnp.float32) for r in a_refs))
  elif p.gate == "time":
    parts.append(tuple(r[:, lanes] for r in a_refs))
  if tok_refs:
    parts.append(tuple(r[at, :] for r in tok_refs))
  A = parts[0] if len(parts) == 1 else _mul(*parts)
  return tuple(jnp.broadcast_to(u, shape) for u in A)


def _chunk_index(p: _Problem, n_chunks: int, backward: bool):
  """The chunk of the sequence that grid step ``c`` visits (in memory order)."""
  against = p.reverse != backward  # visits chunks last to first
  return lambda c: n_chunks - 1 - c if against else c


def _forward_kernel(*refs, p: _Problem, tc: int, wb: int, n_chunks: int, save_starts: bool):
  r = _Refs(refs)
  n = p.planes
  a_refs = r.take(n if p.gate != "token" else 0)
  tok_refs = r.take(n if p.gate == "token" else int(p.has_reset))
  b_refs, h0_refs = r.take(n), r.take(n)
  h_refs, last_refs = r.take(n), r.take(n)
  start_refs = r.take(n if save_starts else 0)
  carry_refs = r.take(n)
  rows = p.rows
  c = pl.program_id(2)

  @pl.when(c == 0)
  def _():
    for cr, hr in zip(carry_refs, h0_refs):
      cr[...] = hr[...]

  for sr, cr in zip(start_refs, carry_refs):  # the state entering this chunk, for the backward
    sr[...] = cr[...]
  ragged = p.seq % tc != 0
  first = _chunk_index(p, n_chunks, False)(c) * tc  # (program_id outside the loop: interpret mode)
  down = not p.reverse
  for off, ls in _lane_slices(wb, rows, p.planes):
    lanes = pl.ds(off, ls)

    def tile(k, carry, lanes=lanes, ls=ls):
      at = pl.ds(pl.multiple_of(k * rows, rows), rows)
      A = _gate(p, a_refs, tok_refs, at, lanes, (rows, ls))
      B = tuple(br[at, lanes].astype(jnp.float32) for br in b_refs)
      if ragged:  # rows past the sequence: the identity, so they leave the carry as it is
        valid = first + k * rows + lax.broadcasted_iota(jnp.int32, (rows, ls), 0) < p.seq
        A, B = _identity(A, valid, one=True), _identity(B, valid, one=False)
      h, carry = _scan_rows(A, B, carry, down)
      for hr, v in zip(h_refs, h):
        hr[at, lanes] = v.astype(hr.dtype)
      return carry

    carry = tuple(cr[:, lanes] for cr in carry_refs)
    carry = _tile_loop(tc // rows, not down, tile, carry)
    for cr, v in zip(carry_refs, carry):
      cr[:, lanes] = v
  for lr, cr in zip(last_refs, carry_refs):
    lr[...] = cr[...]


def _backward_kernel(*refs, p: _Problem, tc: int, wb: int, n_chunks: int):
  r = _Refs(refs)
  n = p.planes
  a_refs = r.take(n if p.gate != "token" else 0)
  tok_refs = r.take(n if p.gate == "token" else int(p.has_reset))
  h_refs, dy_refs, start_refs, dlast_refs = r.take(n), r.take(n), r.take(n), r.take(n)
  db_refs, da_refs, dh0_refs = r.take(n), r.take(n), r.take(n)
  g_refs, an_refs = r.take(n), r.take(n)  # carries: g of the row processed last, and its gate A
  acc_refs = r.take(n if p.gate == "time" else 0)
  rows = p.rows
  c = pl.program_id(2)

  @pl.when(c == 0)
  def _():
    for i, (gr, dr, ar) in enumerate(zip(g_refs, dlast_refs, an_refs)):
      gr[...] = dr[...]
      ar[...] = jnp.full(ar.shape, 1.0 if i == 0 else 0.0, jnp.float32)
    for acc in acc_refs:
      acc[...] = jnp.zeros(acc.shape, jnp.float32)

  ragged = p.seq % tc != 0
  first = _chunk_index(p, n_chunks, True)(c) * tc
  up = not p.reverse  # the backward runs against the forward: upward when the forward ran down
  n_tiles = tc // rows
  ragged_lanes = p.width % wb != 0 and p.gate == "token"  # stale lanes must stay out of the lane sums
  lane0 = pl.program_id(1) * wb
  for s, (off, ls) in enumerate(_lane_slices(wb, rows, p.planes)):
    lanes = pl.ds(off, ls)
    starts = tuple(sr[:, lanes] for sr in start_refs)

    def tile(k, carry, lanes=lanes, ls=ls, s=s, off=off, starts=starts):
      g_in, a_in, acc = carry
      at = pl.ds(pl.multiple_of(k * rows, rows), rows)
      row = lax.broadcasted_iota(jnp.int32, (rows, ls), 0)
      # (Complex planes: the backward of h = A h' + b as a real function of the planes multiplies by
      # conj(A) and conj(h'); JAX's convention for complex64 arrays follows from real/imag/complex.)
      A = _conj(_gate(p, a_refs, tok_refs, at, lanes, (rows, ls)))
      dy = tuple(dr[at, lanes].astype(jnp.float32) for dr in dy_refs)
      h = tuple(hr[at, lanes].astype(jnp.float32) for hr in h_refs)
      # h_{t-1} (the state before row t in the forward's order): h rolled one row, with its edge row
      # from the neighbouring tile, or at the chunk's edge the state the forward carried into it.
      nb = jnp.clip(k - 1 if up else k + 1, 0, n_tiles - 1)
      edge_row = rows - 1 if up else 0
      nb_at = pl.ds(pl.multiple_of(nb * rows, rows), rows)
      edge = tuple(hr[nb_at, lanes][edge_row:edge_row + 1].astype(jnp.float32) for hr in h_refs)
      at_edge = (k == 0) if up else (k == n_tiles - 1)
      edge = tuple(jnp.where(at_edge, s_, e) for s_, e in zip(starts, edge))
      edge_in = row == (0 if up else rows - 1)
      h_prev = _conj(tuple(jnp.where(edge_in, e, u) for e, u in zip(edge, _roll(h, 1 if up else -1, rows))))
      if ragged:
        t = first + k * rows + row
        valid = t < p.seq
        A, dy = _identity(A, valid, one=True), _identity(dy, valid, one=False)
        prev_valid = (t + (-1 if up else 1)) < p.seq  # (reverse: row seq-1's h_{t-1} is the carry in: h0)
        h_prev = tuple(jnp.where(prev_valid, u, s_) for u, s_ in zip(h_prev, _conj(starts)))
      # g_t = dy_t + A_{t+1} g_{t+1}: the gates rolled one row toward the rows processed first.
      a_next = tuple(jnp.where(row == (rows - 1 if up else 0), e, u)
                     for e, u in zip(a_in, _roll(A, -1 if up else 1, rows)))
      g, g_out = _scan_rows(a_next, dy, g_in, down=not up)
      for dr, v in zip(db_refs, g):
        dr[at, lanes] = v.astype(dr.dtype)
      gh = _mul(g, h_prev)  # d(A_t) = g_t h_{t-1}
      if p.gate == "full":
        da = _mul(gh, tuple(tr[at, :] for tr in tok_refs)) if tok_refs else gh
        for dr, v in zip(da_refs, da):
          dr[at, lanes] = v.astype(dr.dtype)
      elif p.gate == "token":
        if ragged_lanes:
          ok = lane0 + off + lax.broadcasted_iota(jnp.int32, (rows, ls), 1) < p.width
          gh = tuple(jnp.where(ok, u, 0.0) for u in gh)
        for dr, v in zip(da_refs, gh):
          part = jnp.sum(v, axis=1, keepdims=True)
          dr[at, :] = part if s == 0 else dr[at, :] + part
      else:
        if tok_refs:
          gh = _mul(gh, tuple(tr[at, :] for tr in tok_refs))
        if ragged:
          gh = tuple(jnp.where(valid, u, 0.0) for u in gh)
        acc = _add(acc, gh)
      return g_out, tuple(v[:1] if up else v[rows - 1:] for v in A), acc

    acc0 = tuple(jnp.zeros((rows, ls), jnp.float32) for _ in acc_refs)
    carry = (tuple(gr[:, lanes] for gr in g_refs), tuple(ar[:, lanes] for ar in an_refs), acc0)
    g_out, a_out, acc = _tile_loop(n_tiles, up, tile, carry)
    for gr, v in zip(g_refs, g_out):
      gr[:, lanes] = v
    for ar, v in zip(an_refs, a_out):
      ar[:, lanes] = v
    for ar, v in zip(acc_refs, acc):
      ar[:, lanes] += jnp.sum(v, axis=0, keepdims=True)
  dh0 = _mul(tuple(ar[...] for ar in an_refs), tuple(gr[...] for gr in g_refs))  # dh0 = A_0 g_0 (conj(A_0))
  for dr, v in zip(dh0_refs, dh0):
    dr[...] = v
  if p.gate == "time":
    for dr, acc in zip(da_refs, acc_refs):
      dr[...] = acc[...]


# --- pallas_call wrappers -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Plan:
  tc: int
  wb: int

  def grid(self, p: _Problem):
    return (p.batch, tiling.cdiv(p.width, self.wb), tiling.cdiv(p.seq, self.tc))


def _plan(p: _Problem, blocks: BlockSizes) -> _Plan:
  """The blocks of a call: explicit sizes checked against the tiling rule, else the
  per-generation default fitted to VMEM; raises before lowering if the plan cannot fit."""
  chip = target_chip()
  rows = p.rows
  fitted = fit_block_sizes(default_block_sizes(chip.name if chip else None, p.b_dtype, p.width), p.seq, p.width,
                           p.b_dtype if rows == 8 else jnp.bfloat16, chip=chip)
  tc, wb = blocks.seq_chunk or fitted.seq_chunk, blocks.width_block or fitted.width_block
  if tc >= p.seq:
    tc = tiling.round_up(p.seq, rows)
  elif tc % rows:
    raise TilingError("block_sizes", blocks, f"seq_chunk={tc} must be a multiple of {rows} (the row tile of "
                      f"{p.a_dtype.name} a and {p.b_dtype.name} b) or cover the sequence ({p.seq})")
  wb = min(wb, p.width)
  tiling.check_block_shape("block_sizes", (tc, wb), (max(tc, p.seq), p.width))
  for backward in (False, True):
    tiling.vmem_limit(_vmem_bytes(tc, wb, p, backward=backward), chip or "v5e", value=blocks)
  return _Plan(tc, wb)


def _limit(p: _Problem, plan: _Plan, backward: bool):
  return tiling.vmem_limit(_vmem_bytes(plan.tc, plan.wb, p, backward=backward), target_chip() or "v5e")


_SEMANTICS = ("parallel", "parallel", "arbitrary")


def _specs(p: _Problem, plan: _Plan, backward: bool):
  """BlockSpecs of a [B, T, W] array, a [B, T, 1] stream, a [1, W] gate, a [B, 1, W] row,
  a [B, chunks, 1, W] per-chunk row and a [B, width blocks, T, 1] per-token partial sum."""
  tc, wb = plan.tc, plan.wb
  cm = _chunk_index(p, plan.grid(p)[2], backward)
  return dict(
      seq=pl.BlockSpec((None, tc, wb), lambda b, w, c: (b, cm(c), w)),
      tok=pl.BlockSpec((None, tc, 1), lambda b, w, c: (b, cm(c), 0)),
      vec=pl.BlockSpec((1, wb), lambda b, w, c: (0, w)),
      row=pl.BlockSpec((None, 1, wb), lambda b, w, c: (b, 0, w)),
      start=pl.BlockSpec((None, None, 1, wb), lambda b, w, c: (b, cm(c), 0, w)),
      part=pl.BlockSpec((None, None, tc, 1), lambda b, w, c: (b, w, cm(c), 0)))


def _gate_args(p: _Problem, a, tok, specs):
  """The gate operands: a (full or time-invariant planes) and the per-token stream."""
  args, in_specs = [], []
  if p.gate == "full":
    args += list(a)
    in_specs += [specs["seq"]] * p.planes
  elif p.gate == "time":
    args += [v.reshape(1, p.width).astype(jnp.float32) for v in a]
    in_specs += [specs["vec"]] * p.planes
  args += list(tok)
  in_specs += [specs["tok"]] * len(tok)
  return args, in_specs


def _bytes(p: _Problem, backward: bool) -> int:
  n = p.batch * p.seq * p.width * p.planes
  a = n * p.a_dtype.itemsize if p.gate == "full" else 0
  b = n * p.b_dtype.itemsize
  return (2 * a + 3 * b) if backward else (a + 2 * b)


def _call(kernel, *, p: _Problem, plan: _Plan, backward: bool, interpret, **kw):
  """The pallas_call of one of the kernels on ``plan``'s grid (its specs, shapes and scratch in ``kw``)."""
  return calls.pallas_call(
      functools.partial(kernel, p=p, tc=plan.tc, wb=plan.wb, n_chunks=plan.grid(p)[2]), grid=plan.grid(p),
      compiler_params=pltpu.CompilerParams(dimension_semantics=_SEMANTICS,
                                           vmem_limit_bytes=_limit(p, plan, backward)),
      cost_estimate=pl.CostEstimate(flops=(6 if backward else 2) * p.batch * p.seq * p.width * p.planes ** 2,
                                    transcendentals=0, bytes_accessed=_bytes(p, backward)),
      interpret=interpret, name="linear_scan_backward" if backward else "linear_scan", **kw)


def _pallas_forward(a, tok, b, h0, *, p: _Problem, plan: _Plan, interpret, save_starts: bool):
  """(h planes, final state planes, per-chunk start states or ())."""
  specs = _specs(p, plan, False)
  grid = plan.grid(p)
  args, in_specs = _gate_args(p, a, tok, specs)
  args += list(b) + [v.reshape(p.batch, 1, p.width) for v in h0]
  in_specs += [specs["seq"]] * p.planes + [specs["row"]] * p.planes
  out_shape = ([jax.ShapeDtypeStruct((p.batch, p.seq, p.width), p.b_dtype)] * p.planes
               + [jax.ShapeDtypeStruct((p.batch, 1, p.width), jnp.float32)] * p.planes)
  out_specs = [specs["seq"]] * p.planes + [specs["row"]] * p.planes
  if save_starts:
    out_shape += [jax.ShapeDtypeStruct((p.batch, grid[2], 1, p.width), jnp.float32)] * p.planes
    out_specs += [specs["start"]] * p.planes
  call = _call(functools.partial(_forward_kernel, save_starts=save_starts), p=p, plan=plan, backward=False,
               interpret=interpret, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
               scratch_shapes=[pltpu.VMEM((1, plan.wb), jnp.float32)] * p.planes)
  outs = call(*args)
  n = p.planes
  return tuple(outs[:n]), tuple(v.reshape(p.batch, p.width) for v in outs[n:2 * n]), tuple(outs[2 * n:])


def _pallas_backward(a, tok, h, starts, dy, dlast, *, p: _Problem, plan: _Plan, interpret):
  """(db planes, da planes (per element, or partial sums: see below), dh0 planes)."""
  specs = _specs(p, plan, True)
  grid = plan.grid(p)
  args, in_specs = _gate_args(p, a, tok, specs)
  args += list(h) + list(dy) + list(starts) + [v.reshape(p.batch, 1, p.width) for v in dlast]
  in_specs += [specs["seq"]] * (2 * p.planes) + [specs["start"]] * p.planes + [specs["row"]] * p.planes
  seq = jax.ShapeDtypeStruct((p.batch, p.seq, p.width), p.b_dtype)
  row = jax.ShapeDtypeStruct((p.batch, 1, p.width), jnp.float32)
  if p.gate == "full":
    da_shape, da_spec = jax.ShapeDtypeStruct((p.batch, p.seq, p.width), p.a_dtype), specs["seq"]
  elif p.gate == "token":  # per token, one partial sum per width block
    da_shape, da_spec = jax.ShapeDtypeStruct((p.batch, grid[1], p.seq, 1), jnp.float32), specs["part"]
  else:  # per batch row
    da_shape, da_spec = row, specs["row"]
  n = p.planes
  scratch = [pltpu.VMEM((1, plan.wb), jnp.float32)] * (n * (3 if p.gate == "time" else 2))
  call = _call(_backward_kernel, p=p, plan=plan, backward=True, interpret=interpret, in_specs=in_specs,
               out_specs=[specs["seq"]] * n + [da_spec] * n + [specs["row"]] * n,
               out_shape=[seq] * n + [da_shape] * n + [row] * n, scratch_shapes=scratch)
  outs = call(*args)
  return tuple(outs[:n]), tuple(outs[n:2 * n]), tuple(v.reshape(p.batch, p.width) for v in outs[2 * n:])


def _token_stream(p: _Problem, a, keep):
  """The per-token f32 [B, T, 1] planes: the per-token gate times keep, or keep alone."""
  if p.gate == "token":
    return tuple(v.astype(jnp.float32) * keep if keep is not None else v.astype(jnp.float32) for v in a)
  return () if keep is None else (keep,)


def _pallas_path(a, b, h0, keep, *, p: _Problem, blocks: BlockSizes, interpret):
  """The differentiable Pallas implementation on plane tuples (h0: f32 planes; keep: [B, T, 1] f32 or None)."""
  if p.a_dtype not in KERNEL_DTYPES or p.b_dtype not in KERNEL_DTYPES:
    raise NotImplementedError(f"the Pallas kernel takes float32 and bfloat16, not {p.a_dtype.name} a and "
                              f"{p.b_dtype.name} b (float64 runs on the XLA path)")
  plan = _plan(p, blocks)

  def run(a, b, h0, keep, save):
    return _pallas_forward(a, _token_stream(p, a, keep), b, h0, p=p, plan=plan, interpret=interpret,
                           save_starts=save)

  # (keep is an argument, not a closure: a custom_vjp must not close over traced arrays)
  @jax.custom_vjp
  def f(a, b, h0, keep):
    h, last, _ = run(a, b, h0, keep, False)
    return h, last

  def f_fwd(a, b, h0, keep):
    h, last, starts = run(a, b, h0, keep, True)
    return (h, last), (a, h, starts, keep)

  def f_bwd(res, ct):
    a, h, starts, keep = res
    dy, dlast = ct
    dlast = tuple(v.astype(jnp.float32) for v in dlast)
    db, da, dh0 = _pallas_backward(a, _token_stream(p, a, keep), h, starts, dy, dlast, p=p, plan=plan,
                                   interpret=interpret)
    if p.gate == "token":  # d(a * keep) / da = keep
      da = tuple(v.sum(axis=1) * keep if keep is not None else v.sum(axis=1) for v in da)
    elif p.gate == "time":
      da = tuple(v.sum(axis=(0, 1)) for v in da)
    dkeep = None if keep is None else jnp.zeros_like(keep)
    return tuple(v.astype(u.dtype) for v, u in zip(da, a)), db, dh0, dkeep

  f.defvjp(f_fwd, f_bwd)
  return f(a, b, h0, keep)


def _split(v):
  return (jnp.real(v), jnp.imag(v))


def _pallas_entry(a, b, h0, reset, *, p: _Problem, blocks: BlockSizes, interpret):
  """Arrays (or plane pairs) in, the reference's results out, through the Pallas path."""
  if p.complex_arrays:
    a, b = _split(a), _split(b)
    h0 = None if h0 is None else _split(h0)
  elif p.planes == 1:
    a, b, h0 = (a,), (b,), (None if h0 is None else (h0,))
  h0 = (tuple(jnp.zeros((p.batch, p.width), jnp.float32) for _ in range(p.planes)) if h0 is None
        else tuple(v.astype(jnp.float32) for v in h0))
  keep = None if reset is None else (~reset).astype(jnp.float32)[..., None]
  h, last = _pallas_path(tuple(a), tuple(b), h0, keep, p=p, blocks=blocks, interpret=interpret)
  if p.complex_arrays:
    return lax.complex(*h), lax.complex(*last)
  return (h, last) if p.planes == 2 else (h[0], last[0])


def linear_scan(a, b, *, h0=None, reverse=False, reset=None, return_final_state=False, block_sizes=None,
                implementation=None, interpret=None):
  """The diagonal linear recurrence ``h_t = a_t * h_{t-1} + b_t``, elementwise, with f32 state.

  Args:
    a: the gates: ``[batch, seq, width]`` like ``b``, ``[batch, seq, 1]`` (one gate per
      token, broadcast across the width) or ``[width]`` (the same at every step).
    b: the inputs, ``[batch, seq, width]``, float32 or bfloat16.
    h0: the state before the first step, ``[batch, width]`` (any float dtype; carried in
      float32); None for zeros.
    reverse: run from ``t = seq - 1`` down to 0: ``h_t = a_t * h_{t+1} + b_t``, with
      ``h0`` entering at ``t = seq - 1``.
    reset: None, or ``[batch, seq]`` bool: where True, the state coming into step ``t``
      is dropped, ``h_t = a_t * 0 + b_t`` (packed documents: set it on each document's
      first token). With ``reverse=True`` it drops the state coming from ``t + 1``
      (set it on each document's *last* token).
    return_final_state: also return the state after the last step processed.
    block_sizes: a :class:`BlockSizes` or a ``(seq_chunk, width_block)`` tuple; None for
      the per-generation default (:func:`default_block_sizes`).
    implementation, interpret: see :func:`kernels.dispatch`.

  ``a``, ``b`` (and ``h0``) may be complex64 (LRU, S4D): then ``h`` is complex64 and the
  products are complex. Or pass the real and imaginary planes as pairs,
  ``a=(a_re, a_im)``, ``b=(b_re, b_im)``, ``h0=(h0_re, h0_im)`` (each plane real, float32
  or bfloat16): ``h`` (and the final state) come back as pairs, and no complex array is
  ever built in HBM. float64 (with x64 enabled) runs on the XLA path only.

  Non-finite inputs: the Pallas kernel's in-register scan multiplies some values by an exact
  0 (see the module's notes), so an inf or NaN in ``a`` or ``b`` at one step may also turn
  up to 7 of the steps processed just before it into NaN (the reference leaves them
  finite). Every step processed after it is non-finite on both paths.

  Returns:
    ``h``, every state, ``[batch, seq, width]`` in ``b``'s dtype; with
    ``return_final_state``, ``(h, h_last)`` where ``h_last`` is ``[batch, width]``
    float32 (complex64 for complex inputs), the state after ``t = seq - 1`` (after
    ``t = 0`` when reversed), unrounded. Differentiable in ``a``, ``b`` and ``h0`` (the
    backward pass is a Pallas kernel); composes with jit, vmap and ``jax.shard_map``.

  Sharded (under ``jit`` on a mesh, see :mod:`kernels.base.partition`): ``batch`` and the
  width (``embed``) split locally; a split sequence (``seq``, over one mesh axis or several)
  runs the sequence-parallel scan (:func:`kernels.distributed.sequence_parallel_linear_scan`:
  two local passes and one ``all_gather`` of each shard's final state and gate product), and
  the final state is then the whole sequence's, replicated over the sequence's mesh axes. A
  split sequence needs arrays (real or complex64), not plane pairs.

  Raises:
    KernelError: bad input, naming the argument, before anything is lowered.
  """
  p = _validate(a, b, h0, reset, reverse, return_final_state)
  blocks = _check_blocks(block_sizes)
  split = _partition(a, b, h0, reset, p)
  if split is not None:
    return _sharded(split, p, a, b, h0, reset, return_final_state, block_sizes, implementation, interpret)
  h, last = dispatch(
      "linear_scan", a, b, h0, reset,
      pallas=lambda a, b, h0, reset, interpret: _pallas_entry(a, b, h0, reset, p=p, blocks=blocks,
                                                              interpret=interpret),
      xla=lambda a, b, h0, reset: _reference(a, b, h0, reset, p=p),
      implementation=implementation, interpret=interpret)
  return (h, last) if return_final_state else h


# ---------------------------------------------------------------------------------
# Sharded: one shard_map around the kernel (kernels.base.partition)
# ---------------------------------------------------------------------------------

_ROWS = ("batch", "seq", "embed")
_GATE_DIMS = {"full": _ROWS, "token": ("batch", "seq", None), "time": ("embed",)}
_SPLITS = {"batch": "local", "embed": "local",
           "seq": "the sequence-parallel scan: one all_gather of each shard's final state and gate product"}


def _named(name: str, x):
  """An argument as named operands: an array as itself, a plane pair as ``name`` and ``name_im``."""
  if isinstance(x, (tuple, list)):
    return {name: x[0], f"{name}_im": x[1]}
  return {name: x}


def _operands(a, b, h0, reset, p: _Problem):
  operands = {**_named("a", a), **_named("b", b), **_named("h0", h0), "reset": reset}
  gate = _GATE_DIMS[p.gate]
  dims = {"a": gate, "a_im": gate, "b": _ROWS, "b_im": _ROWS, "h0": ("batch", "embed"), "h0_im": ("batch", "embed"),
          "reset": ("batch", "seq")}
  return operands, dims


def _partition(a, b, h0, reset, p: _Problem):
  operands, dims = _operands(a, b, h0, reset, p)
  split = partition.plan("linear_scan", operands, dims, splits=_SPLITS)
  if split is not None and split.of("seq") and p.planes == 2 and not p.complex_arrays:
    raise KernelError("a", a, "linear_scan over a split sequence needs complex64 arrays, not (real, imaginary) "
                              "plane pairs (or split only batch and width)")
  return split


def _sharded(split, p: _Problem, a, b, h0, reset, return_final_state, block_sizes, implementation, interpret):
  """linear_scan on every device's shards: local, or the sequence-parallel scan when ``seq`` is split."""
  pairs = isinstance(b, (tuple, list))
  reverse = p.reverse
  operands, dims = _operands(a, b, h0, reset, p)
  seq = split.of("seq")

  def join(ops, name):  # a plane pair back as a tuple
    return (ops[name], ops[f"{name}_im"]) if f"{name}_im" in ops else ops.get(name)

  def local(**ops):
    a, b, h0 = join(ops, "a"), join(ops, "b"), join(ops, "h0")
    kw = dict(h0=h0, reverse=reverse, reset=ops.get("reset"), return_final_state=True, block_sizes=block_sizes,
              implementation=implementation, interpret=interpret)
    if seq:
      from kernels.scan.sequence import sequence_parallel_linear_scan  # (it imports this module)
      h, last = sequence_parallel_linear_scan(a, b, axis_name=seq, **kw)
    else:
      h, last = linear_scan(a, b, **kw)  # inside the shard_map: plan() returns None
    return [list(h), list(last)] if pairs else [h, last]

  planes = [_ROWS, _ROWS] if pairs else _ROWS
  states = [("batch", "embed")] * 2 if pairs else ("batch", "embed")
  h, last = split.run(local, operands, dims, [planes, states])
  if pairs:
    h, last = tuple(h), tuple(last)
  return (h, last) if return_final_state else h
