"""Mamba-2's chunked state-space duality (SSD), and gated linear attention, in Pallas.

``ssd(x, dt, A, B, C)`` runs the selective state-space recurrence of Mamba-2 over
``[batch, seq, heads, head_dim]`` inputs, per head ``h``::

    h_t = exp(dt_t * A) * h_{t-1} + dt_t * (x_t ⊗ B_t)      # state [head_dim, state], f32
    y_t = h_t · C_t + D * x_t

with ``B``, ``C`` shared by the heads of a group (``groups`` divides ``heads``, as keys
and values are shared in GQA). :func:`ssd_reference` is the recurrence itself, a
``lax.scan`` over time (the oracle); :func:`ssd_chunked_xla` is the chunked algorithm in
plain JAX (the ``ssd_minimal`` form of the Mamba-2 paper), the XLA peer.
:func:`gated_linear_attention` is the same kernel with queries, keys and values.

The chunked form
----------------

Cut the sequence into chunks of ``L`` tokens. Within a chunk write the decay as
cumulative sums of ``a_t = dt_t * A`` (f32): ``cs_t = a_0 + ... + a_t``. Then the decay
from token ``s`` to token ``t >= s`` is ``exp(cs_t - cs_s)``, a *difference* of sums,
never a product of many small factors, and every exponent is <= 0 when ``A < 0``. With
``h`` the state entering the chunk::

    y_t   = sum_{s<=t} (C_t · B_s) exp(cs_t - cs_s) dt_s x_s   (intra-chunk: an L x L matrix times x)
          + exp(cs_t) C_t · h                                (the state carried in)
    h_new = exp(cs_{L-1}) h + sum_s exp(cs_{L-1} - cs_s) dt_s x_s ⊗ B_s   (the chunk's state update)

Three matmuls per head and chunk, all on the MXU (bf16 operands for bf16 inputs, f32
accumulation): the masked ``(C B^T ∘ decay) x``, ``C h`` and ``B^T (w x)``. ``C B^T`` is
shared by the heads of a group and computed once per chunk. The exponentials, masks and
scalings are VPU/EUP work on ``L x L`` tiles.

How the SSD kernel works
------------------------

*Layout: tokens along lanes.* The kernel works on ``x^T``: per head a ``[head_dim, L]``
tile, tokens along the 128 lanes, so a head of 64 channels fills its vector registers
and per-token scalars scale it with a cheap sublane broadcast. ``x`` is passed as
``[batch, heads, head_dim, seq]`` and ``y`` comes back so: a transpose in JAX, which XLA
makes a bitcast when ``x`` is laid out with the sequence minor (what XLA:TPU picks for a
``head_dim`` below 128, to avoid padding it to 128 lanes; otherwise it is one copy of
each). ``B`` and ``C`` are read the same way, ``[batch, groups, state, seq]``, and their
block index follows the head block (``group = head // (heads / groups)``), as GQA
kernels do. The grid is ``(batch, head blocks, chunks)``, semantics parallel, parallel,
arbitrary; a step takes ``L`` tokens of ``heads_per_step`` heads (unrolled).

*State.* The f32 state of the block's heads, ``[heads_per_step * head_dim, state]``, lives
in a VMEM scratch across the chunks, set from ``h0`` at the first chunk and written out
after the last. Nothing but ``y`` and the final state reaches HBM.

*Matmuls.* Per step, ``(C B^T)^T`` once per group; per head the intra-chunk product
``y^T = (dt x)^T S^T`` (``S^T`` stationary in the MXU, head_dim rows streamed); and for all
the block's heads at once, ``h C^T`` (the carried state's contribution) and the state
update ``(w x)^T B``, with ``C^T`` or ``B`` stationary and ``heads_per_step * head_dim``
rows streamed.

*Per-token scalars.* The chunk-local cumulative sums of ``dt * A`` (f32, computed by XLA:
``O(seq x heads)``, 1/head_dim of ``x``, as a matmul with a triangle of ones, because
``jnp.cumsum`` lowers to a reduce-window that costs L additions per element) and ``dt`` reach the kernel as rows ``[batch, heads,
1, seq]`` (along lanes, the ``t`` axis), and the sums once more as columns ``[batch, head
blocks, seq, heads_per_step]`` (along sublanes: the ``s`` axis of ``S^T``).

*Resets.* ``reset`` (``[batch, seq]`` bool, True on each document's first token) becomes
a chunk-local segment number (a cumulative count of resets within the chunk): the intra
matrix keeps ``(t, s)`` only within a segment, the carried state reaches only the tokens
before the chunk's first reset, and only the last segment's tokens (and the carried
state, if the chunk has no reset) enter the next state.

*Ragged sequences.* The last chunk may be partial: the tokens (lanes) of ``x``, ``B`` and
``C`` past the end (stale VMEM, maybe NaN) are replaced by zeros before any product, and the
per-token scalars are padded with zeros by XLA.

*Chunk size and heads per step* (``kernels/data/ssd_blocks.json``, ``tools/tune_ssd.py``):
without a table entry the chunk is the MXU width (128 on v4/v5e/v5p, 256 on v6e). The
tuning (compiler estimates) keeps 128 on v6e too, where 256 only ties: the intra-chunk
work per token (the ``L x L`` decay matrices on the VPU, ``S^T`` loaded into the MXU per
head) grows with ``L``, and a chunk wider than the MXU is not a candidate. More heads per
step let the state's matmuls stream more rows past one stationary ``C^T`` or ``B``.

*Backward* (``custom_vjp``), two of them, chosen by ``backward=`` (None: ``DEFAULT_BACKWARD``):

* ``"pallas"``: a reverse pass over the chunks in Pallas (:mod:`kernels.scan.chunked_bwd`, where the
  chunked gradients are derived), grid ``(batch, head blocks, chunks reversed)``, carrying the
  gradient of the state entering each chunk in an f32 VMEM scratch. It needs the states entering
  the chunks, which the forward kernel writes when it is differentiated (``save_states``:
  ``[batch, chunks, heads * head_dim, state]`` in ``x``'s dtype; storing them costs fewer HBM
  bytes than recomputing them). It produces ``dx``, ``dB``, ``dC`` (summed over a group's heads),
  ``dD``, ``dh0`` and per-token rows from which XLA gets the log-decay's and ``dt``'s gradients in
  ``O(seq x heads)``. Resets, ragged chunks, ``h0`` and the final state's cotangent are handled.
* ``"xla"``: the VJP of :func:`ssd_chunked_xla` (chunked like the forward: intra-chunk matrices,
  per-chunk states, a scan over chunks), recomputed from the inputs.

The default is ``"pallas"``: at the benchmark shape its forward + backward is estimated faster
than with the XLA VJP on v5e and v6e (compiler estimates, floored: ``kernels/data/ssd_bench.json``
and the scan notebook).

*Gated linear attention* (:func:`gated_linear_attention`): ``S_t = exp(g_t) S_{t-1} + k_t v_t^T``,
``o_t = q_t · S_t`` is the same recurrence with ``x = v``, ``B = k``, ``C = q``, the
per-token log-decay ``g_t`` in place of ``dt_t * A`` and an input scale of 1 in place of
``dt_t``; the kernel takes the log-decay and the input scale separately.

*Backend choice* (:func:`kernels.dispatch`): ``implementation=None`` runs the Pallas
kernel when lowered for TPU and :func:`ssd_chunked_xla` elsewhere; float64 runs only on
the XLA paths.

*Estimates.* ``tools/tune_ssd.py bench`` stores compiler estimates (libtpu's cost model,
floored at the HBM bandwidth; not measurements) of the kernel and of
:func:`ssd_chunked_xla` at Mamba-2's shape (seq 8192, 32 heads x 64, state 128, bf16) in
``kernels/data/ssd_bench.json``. The cost model finds the kernel bound by its vector
work and its MXU passes (a per-head ``S^T`` loaded for head_dim = 64 streamed rows),
well above both the HBM and the MXU sides of the roofline.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.scan import chunked_bwd as _ssd_bwd
from kernels.base import calls
from kernels.base import partition
from kernels.base import tiling
from kernels.base.backend import dispatch, target_chip
from kernels.base.errors import KernelError, TilingError, check
from kernels.base.hardware import get_chip

__all__ = ["BlockSizes", "default_block_sizes", "gated_linear_attention", "gated_linear_attention_reference",
           "ssd", "ssd_chunked_xla", "ssd_reference"]

KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
FLOAT_DTYPES = KERNEL_DTYPES + (jnp.dtype(jnp.float64), jnp.dtype(jnp.float16))
# The Pallas path's backward when ``backward=None``: "pallas" (kernels/_ssd_bwd.py) or "xla" (the VJP of
# ssd_chunked_xla). Pallas: its forward + backward is estimated faster on v5e and v6e (kernels/data/ssd_bench.json).
DEFAULT_BACKWARD = "pallas"


# ---------------------------------------------------------------------------------
# Block sizes
# ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tokens per chunk and heads per grid step.

  ``chunk_size`` must be a multiple of 128 unless it covers the sequence;
  ``heads_per_step`` must divide ``heads`` and be a multiple or a divisor of the heads
  per group. ``None`` picks the per-generation default.
  """

  chunk_size: int | None = None
  heads_per_step: int | None = None

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)


def _mxu_chunk(gen: str) -> int:
  return 256 if gen == "v6e" else 128


def default_block_sizes(generation=None) -> BlockSizes:
  """The shipped defaults for ``generation`` (None: v5e): ``kernels/data/ssd_blocks.json``, or
  a chunk as wide as the MXU (128; 256 on v6e) and up to 16 heads per step without an entry."""
  gen = get_chip(generation).name if generation is not None else "v5e"
  entry = tiling.block_table("ssd").get(gen, {})
  return BlockSizes(entry.get("chunk_size", _mxu_chunk(gen)), entry.get("heads_per_step", 16))


# ---------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Problem:
  batch: int
  seq: int
  heads: int
  head_dim: int
  groups: int
  state: int
  dtype: jnp.dtype  # of x, B, C
  has_d: bool
  has_reset: bool

  @property
  def heads_per_group(self) -> int:
    return self.heads // self.groups


def _is_array(v) -> bool:
  return hasattr(v, "shape") and hasattr(v, "dtype")


def _float(name, v):
  check(_is_array(v), name, v, "must be an array")
  d = jnp.dtype(v.dtype)
  check(jnp.issubdtype(d, jnp.floating), name, v, f"must be floating point (float32, bfloat16 or float64), not {d.name}")


def _validate(x, dt, A, B, C, D, h0, reset, return_final_state, names=("x", "dt", "A", "B", "C")) -> _Problem:
  nx, ndt, nA, nB, nC = names
  for name, v in ((nx, x), (ndt, dt), (nB, B), (nC, C)):
    _float(name, v)
  check(x.ndim == 4 and x.size > 0, nx, x, "must be [batch, seq, heads, head_dim] with at least one element")
  batch, seq, heads, head_dim = x.shape
  check(tuple(dt.shape) == (batch, seq, heads), ndt, dt, f"must have shape {(batch, seq, heads)} ([batch, seq, heads])")
  if A is not None:
    _float(nA, A)
    check(tuple(A.shape) == (heads,), nA, A, f"must have shape {(heads,)} ([heads])")
  check(B.ndim == 4 and tuple(B.shape[:2]) == (batch, seq), nB, B,
        f"must be [batch, seq, groups, state] with batch, seq = {(batch, seq)}")
  groups, state = B.shape[2:]
  check(groups > 0 and state > 0, nB, B, "groups and state must be positive")
  check(heads % groups == 0, nB, B, f"groups ({groups}) must divide heads ({heads})")
  check(tuple(C.shape) == tuple(B.shape), nC, C, f"must have {nB}'s shape {tuple(B.shape)}")
  check(jnp.dtype(B.dtype) == jnp.dtype(x.dtype), nB, B, f"must have {nx}'s dtype {jnp.dtype(x.dtype).name}")
  check(jnp.dtype(C.dtype) == jnp.dtype(x.dtype), nC, C, f"must have {nx}'s dtype {jnp.dtype(x.dtype).name}")
  if D is not None:
    _float("D", D)
    check(tuple(D.shape) == (heads,), "D", D, f"must have shape {(heads,)} ([heads])")
  if h0 is not None:
    _float("h0", h0)
    check(tuple(h0.shape) == (batch, heads, head_dim, state), "h0", h0,
          f"must have shape {(batch, heads, head_dim, state)} ([batch, heads, head_dim, state])")
  if reset is not None:
    check(_is_array(reset), "reset", reset, "must be a boolean array or None")
    check(jnp.dtype(reset.dtype) == jnp.bool_, "reset", reset, f"must be boolean, not {jnp.dtype(reset.dtype).name}")
    check(tuple(reset.shape) == (batch, seq), "reset", reset, f"must have shape {(batch, seq)} ([batch, seq])")
  check(isinstance(return_final_state, bool), "return_final_state", return_final_state, "must be True or False")
  return _Problem(batch, seq, heads, head_dim, groups, state, jnp.dtype(x.dtype), D is not None, reset is not None)


def _check_blocks(chunk_size, block_sizes) -> BlockSizes:
  if block_sizes is None:
    block_sizes = BlockSizes()
  if isinstance(block_sizes, (tuple, list)) and len(block_sizes) == 2:
    block_sizes = BlockSizes(*block_sizes)
  check(isinstance(block_sizes, BlockSizes), "block_sizes", block_sizes,
        "must be None, a BlockSizes or a (chunk_size, heads_per_step) tuple")
  if chunk_size is not None:
    check(block_sizes.chunk_size is None, "chunk_size", chunk_size, "give chunk_size or block_sizes.chunk_size, not both")
    block_sizes = dataclasses.replace(block_sizes, chunk_size=chunk_size)
  for name in ("chunk_size", "heads_per_step"):
    v = getattr(block_sizes, name)
    check(v is None or (isinstance(v, int) and not isinstance(v, bool) and v > 0),
          "chunk_size" if name == "chunk_size" else "block_sizes", v, f"{name} must be a positive int or None")
  return block_sizes


# ---------------------------------------------------------------------------------
# The reference (pure JAX, sequential) and the plain-JAX chunked SSD
# ---------------------------------------------------------------------------------


def _state_dtype(dtype):
  return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def _reference_core(x, scale, logdecay, B, C, D, h0, reset):
  """Sequential recurrence over time: h = exp(logdecay) h (dropped at resets) + scale x ⊗ B."""
  batch, seq, heads, p = x.shape
  groups, n = B.shape[2:]
  f = _state_dtype(x.dtype)
  rep = heads // groups
  h = jnp.zeros((batch, heads, p, n), f) if h0 is None else h0.astype(f)
  keep = jnp.ones((batch, seq), f) if reset is None else (~reset).astype(f)

  def step(h, inp):
    xt, st, at, bt, ct, kt = inp  # [b,h,p], [b,h], [b,h], [b,g,n], [b,g,n], [b]
    bt, ct = jnp.repeat(bt, rep, axis=1), jnp.repeat(ct, rep, axis=1)
    h = (jnp.exp(at) * kt[:, None])[..., None, None] * h + (st[..., None] * xt)[..., None] * bt[:, :, None, :]
    y = jnp.einsum("bhpn,bhn->bhp", h, ct, precision=lax.Precision.HIGHEST)
    return h, y

  inputs = (x.astype(f), scale.astype(f), logdecay.astype(f), B.astype(f), C.astype(f), keep)
  h, y = lax.scan(step, h, tuple(jnp.moveaxis(v, 1, 0) for v in inputs))
  y = jnp.moveaxis(y, 0, 1)
  if D is not None:
    y = y + D.astype(f)[:, None] * x.astype(f)
  return y.astype(x.dtype), h


def ssd_reference(x, dt, A, B, C, *, D=None, h0=None, reset=None, return_final_state=False):
  """The recurrence of :func:`ssd`, one token at a time (``lax.scan``), state in f32 (f64 for f64 ``x``).

  Returns ``y`` (``x``'s dtype) and, with ``return_final_state``, the final state
  ``[batch, heads, head_dim, state]``.
  """
  _validate(x, dt, A, B, C, D, h0, reset, return_final_state)
  f = _state_dtype(x.dtype)
  y, h = _reference_core(x, dt, dt.astype(f) * A.astype(f), B, C, D, h0, reset)
  return (y, h) if return_final_state else y


def _segsum_mask(seg):
  """[..., L] chunk-local segment numbers -> [..., L(t), L(s)] True where s <= t in the same segment."""
  L = seg.shape[-1]
  causal = jnp.tril(jnp.ones((L, L), bool))
  return causal & (seg[..., :, None] == seg[..., None, :])


def _chunked_core(x, scale, logdecay, B, C, D, h0, reset, chunk: int):
  """The chunked SSD in plain JAX (see the module docstring), all chunks at once, then a scan over chunks."""
  batch, seq, heads, p = x.shape
  groups, n = B.shape[2:]
  f = _state_dtype(x.dtype)
  rep = heads // groups
  L = min(chunk, seq)
  nc = -(-seq // L)
  pad = nc * L - seq
  padt = lambda v: jnp.pad(v, [(0, 0), (0, pad)] + [(0, 0)] * (v.ndim - 2)) if pad else v  # noqa: E731
  xc = padt(x).reshape(batch, nc, L, heads, p)
  Bc = padt(B).reshape(batch, nc, L, groups, n)
  Cc = padt(C).reshape(batch, nc, L, groups, n)
  sc = padt(scale.astype(f)).reshape(batch, nc, L, heads)
  cs = _ssd_bwd.chunk_cumsum(padt(logdecay.astype(f)).reshape(batch, nc, L, heads))  # [b,c,l,h]
  if reset is None:
    seg = jnp.zeros((batch, nc, L), jnp.int32)
  else:
    seg = jnp.cumsum(padt(reset).reshape(batch, nc, L).astype(jnp.int32), axis=2)
  mask = _segsum_mask(seg)[:, :, None]  # [b,c,1,l,s]
  cst = jnp.moveaxis(cs, 3, 2)  # [b,c,h,l]
  diff = jnp.where(mask, cst[..., :, None] - cst[..., None, :], -jnp.inf)
  decay = jnp.exp(diff)  # [b,c,h,l,s]
  prec = lax.Precision.HIGHEST if x.dtype != jnp.bfloat16 else None
  cb = jnp.einsum("bclgn,bcsgn->bcgls", Cc, Bc, preferred_element_type=f, precision=prec)
  cb = jnp.repeat(cb, rep, axis=2)  # [b,c,h,l,s]
  m = (cb * decay * jnp.moveaxis(sc, 3, 2)[..., None, :]).astype(x.dtype)
  y = jnp.einsum("bchls,bcshp->bclhp", m, xc, preferred_element_type=f, precision=prec)
  # the chunk's own state: sum_s exp(cs_end - cs_s) scale_s x_s ⊗ B_s (only the last segment)
  last = seg[..., -1:]
  w = jnp.exp(cs[:, :, -1:, :] - cs) * sc * (seg == last)[..., None]  # [b,c,l,h]
  xw = (xc * w[..., None]).astype(x.dtype).reshape(batch, nc, L, groups, rep, p)
  states = jnp.einsum("bclgn,bclgrp->bcgrpn", Bc, xw, preferred_element_type=f,
                      precision=prec).reshape(batch, nc, heads, p, n)
  carry = jnp.exp(cs[:, :, -1, :]) * (last[..., 0] == 0)[..., None]  # [b,c,h]: the state's decay over a chunk
  hinit = jnp.zeros((batch, heads, p, n), f) if h0 is None else h0.astype(f)

  def step(h, inp):
    st, a = inp
    return a[..., None, None] * h + st, h  # (state after the chunk, state entering it)

  hlast, hprev = lax.scan(step, hinit, (jnp.moveaxis(states, 1, 0), jnp.moveaxis(carry, 1, 0)))
  hprev = jnp.moveaxis(hprev, 0, 1)  # [b,c,h,p,n]
  into = jnp.exp(cs) * (seg == 0)[..., None]  # [b,c,l,h]: the carried state's decay to each token
  Ch = jnp.einsum("bclgn,bcgrpn->bclgrp", Cc, hprev.astype(x.dtype).reshape(batch, nc, groups, rep, p, n),
                  preferred_element_type=f, precision=prec).reshape(batch, nc, L, heads, p)
  y = y + Ch * into[..., None]
  y = y.reshape(batch, nc * L, heads, p)[:, :seq]
  if D is not None:
    y = y + D.astype(f)[:, None] * x.astype(f)
  return y.astype(x.dtype), hlast


def ssd_chunked_xla(x, dt, A, B, C, *, D=None, chunk_size=128, h0=None, reset=None, return_final_state=False):
  """:func:`ssd` as the chunked algorithm in plain JAX (the Mamba-2 paper's ``ssd_minimal``,
  with resets, ``h0`` and a ``lax.scan`` over the chunk states): the XLA peer of the kernel.

  Its matmuls take ``x``'s dtype (bf16 in, f32 accumulation); intermediate arrays are
  ``[batch, chunks, heads, chunk, chunk]`` (``seq x heads x chunk`` elements).
  """
  p = _validate(x, dt, A, B, C, D, h0, reset, return_final_state)
  check(isinstance(chunk_size, int) and chunk_size > 0, "chunk_size", chunk_size, "must be a positive int")
  f = _state_dtype(p.dtype)
  y, h = _chunked_core(x, dt, dt.astype(f) * A.astype(f), B, C, D, h0, reset, chunk_size)
  return (y, h) if return_final_state else y


# ---------------------------------------------------------------------------------
# The Pallas kernel
# ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Plan:
  L: int  # tokens per chunk
  hb: int  # heads per grid step
  n_chunks: int

  def grid(self, p: _Problem):
    return (p.batch, p.heads // self.hb, self.n_chunks)


def _valid_hb(p: _Problem, hb: int) -> bool:
  hpg = p.heads_per_group
  return p.heads % hb == 0 and (hpg % hb == 0 or hb % hpg == 0)


def _vmem_bytes(p: _Problem, L: int, hb: int, save_states: bool = False) -> int:
  gb = max(1, hb // p.heads_per_group)
  blocks = [((hb, p.head_dim, L), p.dtype)] * 2  # x, y (transposed)
  blocks += [((gb, p.state, L), p.dtype)] * 2  # B, C (transposed)
  blocks += [((hb, 1, L), jnp.float32)] * 2 + [((L, hb), jnp.float32)]  # per-token rows (cs, dt), cs columns
  blocks += [((hb, p.head_dim, p.state), jnp.float32)] * 2  # h0, final state
  blocks += [((hb, 1, L), jnp.float32)]  # D
  if p.has_reset:
    blocks += [((1, L), jnp.float32), ((L, 1), jnp.float32)]
  if save_states:
    blocks += [((hb * p.head_dim, p.state), p.dtype)]
  scratch = [((hb * p.head_dim, p.state), jnp.float32), ((gb, L, L), jnp.float32), ((hb * p.head_dim, L), p.dtype)]
  scratch += [((L, L), jnp.float32)] * 4 + [((p.head_dim, L), jnp.float32)] * 6  # live values of a head
  return tiling.vmem_footprint(blocks, scratch=scratch)


def _plan(p: _Problem, blocks: BlockSizes) -> _Plan:
  chip = target_chip()
  d = default_block_sizes(chip.name if chip else None)
  L = blocks.chunk_size or d.chunk_size
  if L >= p.seq:
    L = tiling.round_up(p.seq, tiling.LANES)  # (tokens lie along lanes: a whole lane tile, the tail masked)
  elif L % tiling.LANES:
    raise TilingError("chunk_size", L, f"must be a multiple of {tiling.LANES} (its tokens lie along lanes in the "
                      f"kernel's per-token rows) or cover the sequence ({p.seq})")
  if blocks.heads_per_step is not None:
    hb = blocks.heads_per_step
    if not _valid_hb(p, hb):
      raise TilingError("block_sizes", blocks, f"heads_per_step={hb} must divide heads ({p.heads}) and divide or be "
                        f"a multiple of the heads per group ({p.heads_per_group})")
  else:
    options = [h for h in range(1, p.heads + 1) if _valid_hb(p, h) and h <= max(d.heads_per_step, 1)]
    hb = max(options) if options else p.heads
  tiling.vmem_limit(_vmem_bytes(p, L, hb), chip or "v5e", value=blocks)
  return _Plan(L, hb, tiling.cdiv(p.seq, L))


def _flops(p: _Problem, L: int) -> int:
  """Useful MXU FLOPs of the chunked forward: per chunk, C B^T per group, and per head the
  masked L x L matrix times x, C h and B^T (w x)."""
  chunks = p.batch * tiling.cdiv(p.seq, L)
  return 2 * chunks * (p.groups * L * L * p.state + p.heads * (L * L * p.head_dim + 2 * L * p.state * p.head_dim))


def _forward_kernel(*refs, p: _Problem, plan: _Plan, save_states: bool = False):
  """One chunk of ``hb`` heads, transposed: tokens along lanes (x^T is [head_dim, L] per head).

  With ``save_states`` it also writes the state entering each chunk (in ``x``'s dtype), for the backward."""
  L, hb = plan.L, plan.hb
  hpg = p.heads_per_group
  ((x_ref, b_ref, c_ref, csr_ref, scr_ref, csc_ref), (segr_ref, segc_ref), (d_ref,), (h0_ref, y_ref, hT_ref),
   (states_ref,), (state_ref, cb_ref, xw_ref)) = \
      _ssd_bwd.split_refs(refs, 6, (2, p.has_reset), (1, p.has_d), 3, (1, save_states), 3)

  c = pl.program_id(2)
  P = p.head_dim
  mm_dtype = p.dtype
  prec = lax.Precision.HIGHEST if p.dtype == jnp.float32 else None

  @pl.when(c == 0)
  def _():
    state_ref[...] = h0_ref[...]

  if save_states:
    states_ref[...] = state_ref[...].astype(states_ref.dtype)

  gb = max(1, hb // hpg)
  clean, Bt, Ct, mask, (first, in_last, keep_carry) = _ssd_bwd.chunk_inputs(p, L, c, gb, b_ref, c_ref, segr_ref,
                                                                            segc_ref)
  for g in range(gb):  # (C B^T)^T [s, t] = B_s . C_t, once per group
    cb_ref[g] = lax.dot_general(Bt[g], Ct[g], (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32,
                                precision=prec)

  # the carried state's contribution for all the block's heads at once: h C (one matmul per group, C^T
  # stationary in the MXU, hb * head_dim rows streamed)
  hpb = hb // gb  # heads of the block per group
  state_mm = state_ref[...].astype(mm_dtype)  # (hb * P, N)
  y_state = [jnp.dot(state_mm[g * hpb * P:(g + 1) * hpb * P], Ct[g], preferred_element_type=jnp.float32,
                     precision=prec) for g in range(gb)]
  for hl in range(hb):
    g = hl // hpg if hb > hpg else 0
    rows_h = slice(hl * P, (hl + 1) * P)
    xt = clean(x_ref[hl])  # (P, L)
    cs_row, sc_row = csr_ref[hl], scr_ref[hl]  # (1, L)
    cs_end = csc_ref[L - 1:L, hl:hl + 1]  # (1, 1)
    # the intra-chunk matrix, transposed: (C B^T)^T [s, t] exp(cs_t - cs_s), s <= t (same segment)
    decay = jnp.exp(jnp.where(mask, cs_row - csc_ref[:, hl:hl + 1], -jnp.inf))
    xdt = (xt.astype(jnp.float32) * sc_row).astype(mm_dtype)  # scale_s x_s
    y = jnp.dot(xdt, (cb_ref[g] * decay).astype(mm_dtype), preferred_element_type=jnp.float32, precision=prec)
    # the carried state: exp(cs_t) h C_t
    into = jnp.exp(cs_row)
    w = jnp.exp(cs_end - cs_row) * sc_row  # token s's weight in the chunk's state update
    end = jnp.exp(cs_end)
    if p.has_reset:
      into = jnp.where(first, into, 0.0)
      w = jnp.where(in_last, w, 0.0)
      end = jnp.where(keep_carry, end, 0.0)
    local = hl - g * hpb
    y = y + y_state[g][local * P:(local + 1) * P] * into
    if p.has_d:
      y = y + xt.astype(jnp.float32) * d_ref[hl]
    y_ref[hl] = y.astype(y_ref.dtype)
    xw_ref[rows_h] = (xt.astype(jnp.float32) * w).astype(mm_dtype)
    state_ref[rows_h] = state_ref[rows_h] * end
  # the chunk's state update for all the block's heads: h += (w x)^T B (B stationary, hb * head_dim rows)
  for g in range(gb):
    rows_g = slice(g * hpb * P, (g + 1) * hpb * P)
    state_ref[rows_g] += lax.dot_general(xw_ref[rows_g], Bt[g], (((1,), (1,)), ((), ())),
                                         preferred_element_type=jnp.float32, precision=prec)

  @pl.when(c == plan.n_chunks - 1)
  def _():
    hT_ref[...] = state_ref[...]


def _pallas_forward(x, scale, logdecay, B, C, D, h0, reset, *, p: _Problem, plan: _Plan, interpret,
                    save_states=False):
  """y [b, t, h, p] and the final state [b, h, p, n] f32, through the kernel; with ``save_states`` also the
  state entering each chunk, [b, chunks, h * p, n] in ``x``'s dtype (for the backward)."""
  L, hb = plan.L, plan.hb
  nc = plan.n_chunks
  Tp = nc * L
  H, P, N = p.heads, p.head_dim, p.state
  hpg = p.heads_per_group
  gb = max(1, hb // hpg)
  f32 = jnp.float32
  # tokens last (x^T per head): a bitcast when XLA lays x out with seq minor, as it does for head_dim < 128
  xt = jnp.transpose(x, (0, 2, 3, 1))  # [b, h, p, t]
  bt, ct = jnp.transpose(B, (0, 2, 3, 1)), jnp.transpose(C, (0, 2, 3, 1))  # [b, g, n, t]

  gmap = (lambda h: h) if hb > hpg else (lambda h: lax.div(h * hb, hpg))  # (lax.div: floor division lowers a sign op)
  in_specs = [
      pl.BlockSpec((None, hb, P, L), lambda b, h, c: (b, h, 0, c)),
      pl.BlockSpec((None, gb, N, L), lambda b, h, c: (b, gmap(h), 0, c)),
      pl.BlockSpec((None, gb, N, L), lambda b, h, c: (b, gmap(h), 0, c)),
  ]
  # per-token scalars (chunk-local cumulative sums of the log-decay, the input scale, resets, D)
  scalars, scalar_specs = _ssd_bwd.token_operands(logdecay, scale, reset, D, p, L, nc, hb, lambda c: c)
  in_specs += scalar_specs
  args = [xt, bt, ct] + scalars
  state_spec = pl.BlockSpec((None, hb * P, N), lambda b, h, c: (b, h, 0))
  args.append(h0.astype(f32).reshape(p.batch, H * P, N))
  in_specs.append(state_spec)
  chip = target_chip() or get_chip("v5e")
  bytes_accessed = 2 * x.size * p.dtype.itemsize + 2 * B.size * p.dtype.itemsize + 2 * p.batch * H * P * N * 4
  out_specs = [pl.BlockSpec((None, hb, P, L), lambda b, h, c: (b, h, 0, c)), state_spec]
  out_shape = [jax.ShapeDtypeStruct((p.batch, H, P, p.seq), p.dtype), jax.ShapeDtypeStruct((p.batch, H * P, N), f32)]
  if save_states:
    out_specs.append(pl.BlockSpec((None, None, hb * P, N), lambda b, h, c: (b, c, h, 0)))
    out_shape.append(jax.ShapeDtypeStruct((p.batch, nc, H * P, N), p.dtype))
    bytes_accessed += p.batch * nc * H * P * N * p.dtype.itemsize
  out = calls.pallas_call(
      functools.partial(_forward_kernel, p=p, plan=plan, save_states=save_states),
      grid=plan.grid(p),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      scratch_shapes=[pltpu.VMEM((hb * P, N), f32), pltpu.VMEM((gb, L, L), f32), pltpu.VMEM((hb * P, L), p.dtype)],
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"),
                                           vmem_limit_bytes=tiling.vmem_limit(_vmem_bytes(p, L, hb, save_states), chip)),
      cost_estimate=pl.CostEstimate(flops=int(_flops(p, L)), transcendentals=int(p.batch * Tp * H * (L + 3)),
                                    bytes_accessed=int(bytes_accessed)),
      interpret=interpret, name="ssd",
  )(*args)
  y, hT = jnp.transpose(out[0], (0, 3, 1, 2)), out[1].reshape(p.batch, H, P, N)
  return (y, hT, out[2]) if save_states else (y, hT)


def _pallas_path(x, scale, logdecay, B, C, D, h0, reset, *, p: _Problem, blocks: BlockSizes, interpret,
                 backward=None):
  """The differentiable Pallas forward; the backward is the Pallas reverse pass (:mod:`kernels.scan.chunked_bwd`)
  or, with ``backward="xla"``, the chunked XLA algorithm's VJP."""
  if p.dtype not in KERNEL_DTYPES:
    raise NotImplementedError(f"the Pallas kernel takes float32 and bfloat16, not {p.dtype.name} "
                              "(float64 runs on the XLA path)")
  plan = _plan(p, blocks)
  backward = backward or DEFAULT_BACKWARD
  if h0 is None:
    h0 = jnp.zeros((p.batch, p.heads, p.head_dim, p.state), jnp.float32)
  if D is None:
    D = jnp.zeros((p.heads,), jnp.float32)  # (a differentiable placeholder; the kernel skips it)
  # (reset enters the custom_vjp as a float argument, not a closure: a custom_vjp must not close over
  # traced arrays, and a bool argument would need a float0 cotangent)
  keep = jnp.zeros((p.batch, p.seq), jnp.float32) if reset is None else reset.astype(jnp.float32)
  rst = lambda keep: (keep > 0.5) if p.has_reset else None  # noqa: E731

  def fwd(x, scale, logdecay, B, C, D, h0, keep, save_states=False):
    return _pallas_forward(x, scale, logdecay, B, C, D if p.has_d else None, h0, rst(keep), p=p, plan=plan,
                           interpret=interpret, save_states=save_states)

  def xla(x, scale, logdecay, B, C, D, h0, keep):
    return _chunked_core(x, scale, logdecay, B, C, D if p.has_d else None, h0, rst(keep), plan.L)

  @jax.custom_vjp
  def f(*args):
    return fwd(*args)

  def f_fwd(*args):
    if backward == "xla":
      return fwd(*args), (args, None)
    y, hT, states = fwd(*args, save_states=True)
    return (y, hT), (args, states)

  def f_bwd(res, ct):
    args, states = res
    dy, dh = ct
    if backward == "xla":
      _, vjp = jax.vjp(lambda *a: xla(*a, args[-1]), *args[:-1])
      return vjp((dy, dh.astype(jnp.float32))) + (jnp.zeros_like(args[-1]),)
    x, scale, logdecay, B, C, D, h0, keep = args
    grads = _ssd_bwd.backward(x, scale, logdecay, B, C, D, rst(keep), states, dy, dh, p=p, plan=plan,
                              interpret=interpret)
    dD = grads[5] if p.has_d else jnp.zeros_like(D)
    grads = grads[:5] + (dD, grads[6])
    return tuple(g.astype(a.dtype) for g, a in zip(grads, args[:-1])) + (jnp.zeros_like(keep),)

  f.defvjp(f_fwd, f_bwd)
  return f(x, scale, logdecay, B, C, D, h0.astype(jnp.float32), keep)


def _run(op, x, scale, logdecay, B, C, D, h0, reset, *, p, blocks, implementation, interpret, backward=None):
  check(backward in (None, "pallas", "xla"), "backward", backward, 'must be None, "pallas" or "xla"')
  chunk = blocks.chunk_size or default_block_sizes(getattr(target_chip(), "name", None)).chunk_size
  return dispatch(
      op, x, scale, logdecay, B, C, D, h0, reset,
      pallas=lambda *a, interpret: _pallas_path(*a, p=p, blocks=blocks, interpret=interpret, backward=backward),
      xla=lambda *a: _chunked_core(*a, chunk),
      implementation=implementation, interpret=interpret)


def ssd(x, dt, A, B, C, *, D=None, chunk_size=None, h0=None, reset=None, return_final_state=False,
        block_sizes=None, implementation=None, interpret=None, backward=None):
  """Mamba-2's selective state space (SSD) in chunked form, state in f32.

  Per head, ``h_t = exp(dt_t * A) * h_{t-1} + dt_t * (x_t ⊗ B_t)`` (state ``[head_dim,
  state]``) and ``y_t = h_t · C_t + D * x_t``.

  Args:
    x: ``[batch, seq, heads, head_dim]``, float32 or bfloat16 (float64 on the XLA path).
    dt: ``[batch, seq, heads]``, the step sizes (already softplus-ed), any float dtype
      (used in f32).
    A: ``[heads]``, the (negative) decay rates.
    B, C: ``[batch, seq, groups, state]``, ``x``'s dtype; ``groups`` divides ``heads``
      and head ``h`` reads group ``h // (heads // groups)``.
    D: None or ``[heads]``, the skip connection.
    chunk_size: tokens per chunk: a multiple of 128 or at least ``seq``; None for the
      per-generation default (:func:`default_block_sizes`).
    h0: None or the state before the first token, ``[batch, heads, head_dim, state]``.
    reset: None or ``[batch, seq]`` bool: True on a document's first token drops the
      state coming into it (packed documents), as in :func:`kernels.linear_scan`.
    return_final_state: also return the state after the last token (f32).
    block_sizes: a :class:`BlockSizes` (``chunk_size``, ``heads_per_step``) or a tuple.
    implementation, interpret: see :func:`kernels.dispatch`.
    backward: the Pallas path's backward: ``"pallas"`` (the reverse-chunk kernel),
      ``"xla"`` (the VJP of :func:`ssd_chunked_xla`) or None (``DEFAULT_BACKWARD``). The
      XLA path always differentiates :func:`ssd_chunked_xla`.

  Returns:
    ``y`` ``[batch, seq, heads, head_dim]`` in ``x``'s dtype; with ``return_final_state``,
    ``(y, h_last)``. Differentiable in every array argument.

  Sharded (under ``jit`` on a mesh, see :mod:`kernels.base.partition`): ``batch`` and
  ``heads`` split locally, ``B`` and ``C``'s ``groups`` along with the heads (replicated
  when there is one group; otherwise the groups must divide over the heads' shards); a split
  sequence (``seq``) runs the sequence-parallel SSD
  (:func:`kernels.distributed.sequence_parallel_ssd`: two local passes, one ``all_gather``
  of each shard's final state and decay), the final state then the whole sequence's,
  replicated over the sequence's mesh axes.

  Raises:
    KernelError: bad input, naming the argument, before anything is lowered.
  """
  _float("A", A)
  p = _validate(x, dt, A, B, C, D, h0, reset, return_final_state)
  blocks = _check_blocks(chunk_size, block_sizes)
  operands = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, h0=h0, reset=reset)
  split = _partition("ssd", operands, _SSD_DIMS, p, "B")
  if split is not None:
    from kernels.scan.sequence import sequence_parallel_ssd  # (it imports this module)

    def local(x, dt, A, B, C, D=None, h0=None, reset=None):
      kw = dict(D=D, h0=h0, reset=reset, return_final_state=True, chunk_size=chunk_size, block_sizes=block_sizes,
                implementation=implementation, interpret=interpret, backward=backward)
      if split.of("seq"):
        return list(sequence_parallel_ssd(x, dt, A, B, C, axis_name=split.of("seq"), **kw))
      return list(ssd(x, dt, A, B, C, **kw))
    y, h = split.run(local, operands, _SSD_DIMS, [_SSD_DIMS["x"], _SSD_DIMS["h0"]])
    return (y, h) if return_final_state else y
  f = _state_dtype(p.dtype)
  logdecay = dt.astype(f) * A.astype(f)
  y, h = _run("ssd", x, dt, logdecay, B, C, D, h0, reset, p=p, blocks=blocks, implementation=implementation,
              interpret=interpret, backward=backward)
  return (y, h) if return_final_state else y


def _gla_args(q, k, v, log_decay):
  check(_is_array(q) and q.ndim == 4, "q", q, "must be [batch, seq, heads, key_dim]")
  check(_is_array(k) and tuple(k.shape) == tuple(q.shape), "k", k, f"must have q's shape {tuple(q.shape)}")
  check(_is_array(v) and v.ndim == 4 and tuple(v.shape[:3]) == tuple(q.shape[:3]), "v", v,
        f"must be [batch, seq, heads, value_dim] with batch, seq, heads = {tuple(q.shape[:3])}")
  check(_is_array(log_decay), "log_decay", log_decay, "must be an array")
  return jnp.ones(tuple(v.shape[:3]), jnp.float32)


def gated_linear_attention_reference(q, k, v, log_decay, *, h0=None, reset=None, return_final_state=False):
  """:func:`gated_linear_attention` one token at a time (``lax.scan``)."""
  ones = _gla_args(q, k, v, log_decay)
  _validate(v, log_decay, None, k, q, None, h0, reset, return_final_state, names=("v", "log_decay", "A", "k", "q"))
  y, h = _reference_core(v, ones, log_decay, k, q, None, h0, reset)
  return (y, h) if return_final_state else y


def gated_linear_attention(q, k, v, log_decay, *, chunk_size=None, h0=None, reset=None, return_final_state=False,
                           block_sizes=None, implementation=None, interpret=None, backward=None):
  """Gated linear attention with a per-token scalar decay per head, on the SSD kernel.

  ``S_t = exp(log_decay_t) * S_{t-1} + v_t ⊗ k_t`` (state ``[value_dim, key_dim]`` per head,
  f32) and ``o_t = S_t · q_t``: :func:`ssd` with ``x = v``, ``B = k``, ``C = q`` (one group
  per head), ``dt * A`` replaced by ``log_decay`` and the input scale ``dt`` by 1. No
  ``1/sqrt(key_dim)`` scaling is applied: scale ``q`` first if wanted.

  Args:
    q, k: ``[batch, seq, heads, key_dim]``; v: ``[batch, seq, heads, value_dim]``, all one
      float dtype (float32 or bfloat16 for the kernel).
    log_decay: ``[batch, seq, heads]``, ``log`` of the decay (<= 0), any float dtype.
    chunk_size, h0 (``[batch, heads, value_dim, key_dim]``), reset, return_final_state,
    block_sizes, implementation, interpret, backward: as in :func:`ssd`.

  Sharded like :func:`ssd` (``batch`` and ``heads`` local, a split ``seq`` the sequence-parallel
  form, with the shard's decay ``exp(sum_t log_decay_t)``).
  """
  ones = _gla_args(q, k, v, log_decay)
  p = _validate(v, log_decay, None, k, q, None, h0, reset, return_final_state,
                names=("v", "log_decay", "A", "k", "q"))
  blocks = _check_blocks(chunk_size, block_sizes)
  operands = dict(q=q, k=k, v=v, log_decay=log_decay, h0=h0, reset=reset)
  split = _partition("gated_linear_attention", operands, _GLA_DIMS, p, None)  # (one group per head)
  if split is not None:
    from kernels.scan.sequence import sequence_parallel_gated_linear_attention  # (it imports this module)

    def local(q, k, v, log_decay, h0=None, reset=None):
      kw = dict(h0=h0, reset=reset, return_final_state=True, chunk_size=chunk_size, block_sizes=block_sizes,
                implementation=implementation, interpret=interpret, backward=backward)
      if split.of("seq"):
        return list(sequence_parallel_gated_linear_attention(q, k, v, log_decay, axis_name=split.of("seq"), **kw))
      return list(gated_linear_attention(q, k, v, log_decay, **kw))
    y, h = split.run(local, operands, _GLA_DIMS, [_GLA_DIMS["v"], _GLA_DIMS["h0"]])
    return (y, h) if return_final_state else y
  y, h = _run("gated_linear_attention", v, ones, log_decay.astype(_state_dtype(p.dtype)), k, q, None, h0, reset,
              p=p, blocks=blocks, implementation=implementation, interpret=interpret, backward=backward)
  return (y, h) if return_final_state else y


# ---------------------------------------------------------------------------------
# Sharded: one shard_map around the kernel (kernels.base.partition)
# ---------------------------------------------------------------------------------

_TOKENS = ("batch", "seq", "heads", None)
_SSD_DIMS = dict(x=_TOKENS, dt=("batch", "seq", "heads"), A=("heads",), D=("heads",),
                 B=("batch", "seq", "groups", None), C=("batch", "seq", "groups", None),
                 h0=("batch", "heads", None, None), reset=("batch", "seq"))
_GLA_DIMS = dict(q=_TOKENS, k=_TOKENS, v=_TOKENS, log_decay=("batch", "seq", "heads"),
                 h0=("batch", "heads", None, None), reset=("batch", "seq"))
_SPLITS = {"batch": "local", "heads": "local", "groups": "along with heads",
           "seq": "the sequence-parallel form: one all_gather of each shard's final state and decay"}


def _partition(op: str, operands, dims, p: _Problem, b_name: str):
  """The plan of a call, its ``groups`` following its ``heads``: split the same way when the
  groups divide over the heads' shards, replicated when there is one group."""
  split = partition.plan(op, operands, dims, splits=_SPLITS)
  if split is None or b_name is None:
    return split
  heads, groups = split.of("heads"), split.of("groups")
  b = operands[b_name]
  if groups and groups != heads:
    raise KernelError(b_name, b, f"{op}: splits its groups over {groups} but the heads over {heads or 'nothing'}: "
                                 "the groups split only along with the heads, over the same mesh axes")
  if heads and p.groups > 1 and not groups:
    k = split.size("heads")
    if p.groups % k:
      raise KernelError(b_name, b, f"{op}: its {p.groups} groups do not divide over the {k} shards of the heads "
                                   f"(split over {heads}): use one group (replicated), a multiple of {k} groups, "
                                   "or split the heads over fewer devices")
    split = dataclasses.replace(split, axes={**split.axes, "groups": heads})
  return split
