"""kernels.attention.api: the Pallas flash attention against its pure-JAX reference.

Everything but the ``tpu_aot`` tests runs the kernels in interpret mode on the CPU,
on small problems (seq 100-300, 1-4 heads) with 128-wide blocks, so the grids have
several q and kv blocks, partial tail blocks, diagonal blocks and skipped blocks.

Oracles: :func:`attention_reference` (the whole logit matrix in f32, the same
masks), checked itself against ``jax.nn.dot_product_attention`` where that API
covers the case; gradients against ``jax.vjp`` of the reference.

Tolerances: f32 in and out: the online softmax sums in another order than the
reference, 2e-5 absolute (outputs O(1)); bf16: both cast the probabilities to bf16
before ``p @ v`` and round the output once, but the kernel folds the scale into q
(one extra bf16 rounding of q), so 2e-2 absolute. Gradients: f32, 1e-4 relative
to the largest entry.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental.pallas import tpu as pltpu

import kernels
from tests import EXTRA_AOT_GENERATIONS

# The module (flash_attention the function is exported from kernels/__init__.py).
from kernels.attention import api as att
# Its plan and masks: the tuning constants the tests shrink to fit small problems live here.
from kernels.attention import plan as plan_mod
BlockSizes = att.BlockSizes
SMALL = BlockSizes(128, 128, 128, 128)
ATOL = {"float32": 2e-5, "bfloat16": 2e-2}
GRAD_RTOL = 1e-4


def rand(shape, dtype=jnp.float32, seed=0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def qkv(b=1, sq=300, skv=None, h=2, kvh=1, d=64, dtype=jnp.float32, layout="BSHD", seed=0):
  skv = sq if skv is None else skv
  def shape(s, n):
    return (b, s, n, d) if layout == "BSHD" else (b, n, s, d)
  return rand(shape(sq, h), dtype, seed), rand(shape(skv, kvh), dtype, seed + 1), rand(shape(skv, kvh), dtype, seed + 2)


def run(q, k, v, interpret=True, **kw):
  kw.setdefault("block_sizes", SMALL)
  return att.flash_attention(q, k, v, implementation="pallas", interpret=interpret, **kw)


def close(out, ref, dtype=jnp.float32):
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=ATOL[jnp.dtype(dtype).name],
                             rtol=0)


def grads_close(kw, q, k, v, extra=(), argnums=(0, 1, 2), blocks=SMALL):
  """Gradients of a fixed random projection of the output: kernel VJP vs the reference's."""
  ct = None

  def loss(f):
    def g(*args):
      out = f(*args[:3], **dict(kw, **dict(zip([n for n, _ in extra], args[3:]))))
      w = jnp.asarray(np.random.default_rng(9).standard_normal(out.shape), jnp.float32)
      return (out.astype(jnp.float32) * w).sum()
    return g
  args = (q, k, v) + tuple(x for _, x in extra)
  ours = jax.grad(loss(lambda *a, **k2: run(*a, block_sizes=blocks, **k2)), argnums=argnums)(*args)
  ref = jax.grad(loss(att.attention_reference), argnums=argnums)(*args)
  for a, b in zip(ours, ref):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.isfinite(a).all()
    np.testing.assert_allclose(a, b, atol=GRAD_RTOL * max(1.0, np.abs(b).max()), rtol=0)
  del ct


# --- the reference itself ------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_reference_matches_jax_nn(causal):
  q, k, v = qkv(sq=200, h=4, kvh=2, d=64)
  ref = att.attention_reference(q, k, v, causal=causal)
  expected = jax.nn.dot_product_attention(q, k, v, is_causal=causal)
  np.testing.assert_allclose(ref, expected, atol=2e-5)


# --- forward ----------------------------------------------------------------------------

FEATURES = [
    dict(),
    dict(causal=True),
    dict(causal=True, sliding_window=100),
    dict(sliding_window=70),                       # symmetric band without causal
    dict(causal=True, logits_soft_cap=3.0, scale=0.3),
]


@pytest.mark.parametrize("layout", ["BSHD", "BHSD"])
@pytest.mark.parametrize("kw", FEATURES, ids=lambda kw: ",".join(kw) or "plain")
def test_forward_features(kw, layout):
  q, k, v = qkv(sq=300, h=2, kvh=1, d=64, layout=layout)
  out, lse = run(q, k, v, layout=layout, return_residuals=True, **kw)
  ref, ref_lse = att.attention_reference(q, k, v, layout=layout, return_residuals=True, **kw)
  assert out.shape == q.shape and lse.shape == (1, 2, 300) and lse.dtype == jnp.float32
  close(out, ref)
  close(lse, ref_lse)


@pytest.mark.parametrize("sq,skv,h,kvh,d", [
    (256, 256, 4, 4, 128),    # MHA, head_dim 128: BSHD read in place
    (200, 300, 4, 1, 96),     # MQA, cross-attention, odd head_dim
    (3, 260, 2, 2, 80),       # decode: a few queries against a longer cache
    (300, 130, 2, 1, 64),     # more queries than keys: causal rows before the cache see nothing
    (130, 200, 2, 1, 256),    # head_dim 256: m, l and alpha tiled over two 128-lane groups
])
def test_odd_shapes_gqa_and_cross_attention(sq, skv, h, kvh, d):
  q, k, v = qkv(sq=sq, skv=skv, h=h, kvh=kvh, d=d)
  for causal in (False, True):
    out, lse = run(q, k, v, causal=causal, return_residuals=True)
    ref, ref_lse = att.attention_reference(q, k, v, causal=causal, return_residuals=True)
    close(out, ref)
    np.testing.assert_allclose(lse, ref_lse, atol=2e-5)
  if sq > skv:  # causal rows i < sq - skv have no key: output 0, lse -inf
    assert np.all(np.asarray(out)[:, :sq - skv] == 0) and np.all(np.isneginf(np.asarray(lse)[:, :, :sq - skv]))


def test_bf16(monkeypatch):
  q, k, v = qkv(sq=256, h=4, kvh=2, d=128, dtype=jnp.bfloat16)
  for kw in ({}, dict(causal=True, sliding_window=64)):
    out = run(q, k, v, **kw)
    assert out.dtype == jnp.bfloat16
    close(out, att.attention_reference(q, k, v, **kw), jnp.bfloat16)
  monkeypatch.setattr(plan_mod, "_EXP_BF16", True)  # off by default (libtpu's cost model aborts on it)
  with kernels.base.backend.target("v6e"):  # traced for v6e: the forward's exponentials run in bf16
    assert att._plan(att._validate(q, k, v, causal=True, segment_ids=None, sliding_window=None, logits_soft_cap=None,
                                   scale=None, bias=None, mask=None, sinks=None, dropout_rate=0.0, dropout_key=None,
                                   layout="BSHD")[0], SMALL, backward=False).exp_bf16
    close(run(q, k, v, causal=True), att.attention_reference(q, k, v, causal=True), jnp.bfloat16)


def test_segments_and_fully_masked_rows():
  q, k, v = qkv(b=2, sq=260, h=2, kvh=1)
  seg = np.repeat(np.arange(4), 65)[None].repeat(2, 0)
  seg[1, :100] = 7
  seg = jnp.asarray(seg, jnp.int32)
  close(run(q, k, v, segment_ids=seg, causal=True), att.attention_reference(q, k, v, segment_ids=seg, causal=True))
  # cross-attention segments where some queries match no key: zero rows, zero gradients
  kv_seg = jnp.asarray(np.repeat(np.arange(2), 130)[None].repeat(2, 0), jnp.int32)
  q_seg = jnp.asarray(np.repeat(np.arange(4), 65)[None].repeat(2, 0), jnp.int32)
  kw = dict(segment_ids=(q_seg, kv_seg))
  out, lse = run(q, k, v, return_residuals=True, **kw)
  close(out, att.attention_reference(q, k, v, **kw))
  dead = np.asarray(q_seg) >= 2
  assert np.all(np.asarray(out)[dead] == 0) and np.all(np.isneginf(np.asarray(lse).transpose(0, 2, 1)[dead]))
  dq = jax.grad(lambda q: run(q, k, v, **kw).sum())(q)
  assert np.isfinite(np.asarray(dq)).all() and np.all(np.asarray(dq)[dead] == 0)


def test_mask_bias_and_sinks():
  q, k, v = qkv(sq=200, skv=260, h=2, kvh=1)
  mask = jnp.asarray(np.random.default_rng(3).random((1, 2, 200, 260)) < 0.7).at[0, 0, 5].set(False)
  bias = rand((2, 1, 200, 260), seed=4)
  q2, k2, v2 = (jnp.concatenate([x, x], 0) for x in (q, k, v))
  sinks = jnp.asarray([0.5, -1.0])
  kw = dict(mask=mask, bias=bias, sinks=sinks, causal=True)
  out, lse = run(q2, k2, v2, return_residuals=True, **kw)
  ref, ref_lse = att.attention_reference(q2, k2, v2, return_residuals=True, **kw)
  close(out, ref)
  close(lse, ref_lse)
  # sinks: a row that sees nothing has output 0 and lse = sink
  out = run(q, k, v, mask=mask, sinks=sinks)
  assert np.all(np.asarray(out)[0, 5, 0] == 0)


@pytest.mark.parametrize("kw", [
    dict(causal=True, sliding_window=150),
    dict(segments=True, logits_soft_cap=3.0),
    dict(mask=True, bias=True, sinks=True, causal=True),
    dict(dropout_rate=0.3, causal=True),
], ids=lambda kw: ",".join(kw))
def test_kv_sub_blocks(kw, monkeypatch):
  # The forward's math walks each kv block in sub-blocks of KV_COMPUTE keys: 3 per 384-key block
  # here, the last one partly past the kv length (300), with every per-tile feature sliced to match.
  monkeypatch.setattr(plan_mod, "KV_COMPUTE", 128)
  q, k, v = qkv(sq=260, skv=300, h=2, kvh=1)
  kw = dict(kw)
  rng = np.random.default_rng(5)
  if kw.pop("segments", False):
    kw["segment_ids"] = (jnp.asarray(np.repeat(np.arange(4), 65)[None], jnp.int32),
                         jnp.asarray(np.repeat(np.arange(4), 75)[None], jnp.int32))
  if kw.pop("mask", False):
    kw["mask"] = jnp.asarray(rng.random((1, 2, 260, 300)) < 0.7)
  if kw.pop("bias", False):
    kw["bias"] = rand((1, 2, 260, 300), seed=4)
  if kw.pop("sinks", False):
    kw["sinks"] = jnp.asarray([0.5, -1.0])
  if "dropout_rate" in kw:
    kw["dropout_key"] = jax.random.key(3)
  blocks = BlockSizes(128, 384, 128, 128)
  out, lse = run(q, k, v, block_sizes=blocks, return_residuals=True, **kw)
  ref, ref_lse = att.attention_reference(q, k, v, return_residuals=True, **kw)
  close(out, ref)
  close(lse, ref_lse)


@pytest.mark.parametrize("kw", [
    dict(causal=True),
    dict(causal=True, sliding_window=150),
    dict(sliding_window=100),
    dict(causal=True, segments=True),
    dict(causal=True, bias=True, sinks=True),
    dict(causal=True, longer_q=True),
], ids=lambda kw: ",".join(kw))
def test_masked_tiles(kw, monkeypatch):
  # A causal / window block that needs masking runs as (MASKED_TILE x MASKED_TILE) tiles, each
  # skipped, unmasked or masked on its own, forward and backward: 256-blocks in 128-tiles here, a kv tail past 300 keys,
  # the diagonal offset by kv_len - q_len (and, with longer_q, rows that see nothing).
  monkeypatch.setattr(plan_mod, "KV_COMPUTE", 128)
  monkeypatch.setattr(plan_mod, "MASKED_TILE", 128)
  kw = dict(kw)
  sq, skv = (330, 300) if kw.pop("longer_q", False) else (260, 300)
  q, k, v = qkv(sq=sq, skv=skv, h=2, kvh=1)
  if kw.pop("segments", False):
    kw["segment_ids"] = (jnp.asarray(np.repeat(np.arange(4), 65)[None], jnp.int32),
                         jnp.asarray(np.repeat(np.arange(4), 75)[None], jnp.int32))
  if kw.pop("bias", False):
    kw["bias"] = rand((1, 2, sq, skv), seed=4)
  if kw.pop("sinks", False):
    kw["sinks"] = jnp.asarray([0.5, -1.0])
  blocks = BlockSizes(256, 256, 256, 256)
  plan = att._plan(att._validate(q, k, v, layout="BSHD", causal=kw.get("causal", False), segment_ids=None,
                                 sliding_window=kw.get("sliding_window"), logits_soft_cap=None, scale=None,
                                 bias=None, mask=None, sinks=None, dropout_rate=0.0, dropout_key=None)[0],
                   blocks, backward=False)
  assert (plan.bq_masked, plan.bkv_masked) == (128, 128)
  out, lse = run(q, k, v, block_sizes=blocks, return_residuals=True, **kw)
  ref, ref_lse = att.attention_reference(q, k, v, return_residuals=True, **kw)
  close(out, ref)
  close(lse, ref_lse)
  grads_close(kw, q, k, v, blocks=blocks)   # the dq and dk/dv kernels cut their blocks the same way


def _problem(q, k, v, **kw):
  args = dict(causal=False, segment_ids=None, sliding_window=None, logits_soft_cap=None, scale=None, bias=None,
              mask=None, sinks=None, dropout_rate=0.0, dropout_key=None, layout="BSHD")
  return att._validate(q, k, v, **dict(args, **kw))[0]


@pytest.mark.parametrize("sq", [512, 300, 384], ids=["4_blocks", "3_blocks_tail", "3_blocks"])
@pytest.mark.parametrize("extra", [False, True], ids=["plain", "segments_sinks_dropout_gqa"])
def test_folded_causal_grid(sq, extra):
  # Causal with square blocks: the forward and dq grids pair q row i with row nq-1-i (nq + 1 steps
  # per grid row, none skipped); with nq odd the middle row's second half is idle.
  kw = dict(causal=True)
  h, kvh = (4, 2) if extra else (2, 1)
  q, k, v = qkv(sq=sq, h=h, kvh=kvh)
  if extra:
    kw.update(segment_ids=jnp.asarray(np.repeat(np.arange(3), -(-sq // 3))[None, :sq], jnp.int32),
              sinks=jnp.linspace(-1.0, 1.0, h), dropout_rate=0.25, dropout_key=jax.random.key(1))
  plan = att._plan(_problem(q, k, v, causal=True), SMALL, backward=False)
  assert plan.folded and plan.nq == -(-sq // 128)
  out, lse = run(q, k, v, return_residuals=True, **kw)
  ref, ref_lse = att.attention_reference(q, k, v, return_residuals=True, **kw)
  close(out, ref)
  close(lse, ref_lse)
  grads_close(kw, q, k, v)


@pytest.mark.parametrize("sq,block,tile,kw", [
    (1024, 512, 128, dict(causal=True)),         # 4 tiles a side: tall tiles of 384, 256, 128 rows
    (768, 256, 128, dict(causal=True, extra=True)),  # nq = 3 (the middle row idle), GQA 4/2, sinks, dropout
    (1024, 256, 128, dict(causal=True, sliding_window=300)),  # window edges: 3 patterns (d = -2, -1, 0)
    (1024, 512, 128, dict(sliding_window=200)),  # symmetric window: 3 patterns (d = -1, 0, 1)
], ids=["causal_4x4_tiles", "causal_odd_nq_gqa_sinks_dropout", "causal_window", "window"])
def test_static_tile_patterns(sq, block, tile, kw, monkeypatch):
  # Square blocks, q_len == kv_len, no segments / mask: a block that needs masking has a tile
  # pattern fixed by j - i, run as runs of tall tiles (no pl.when per tile) in the forward, dq
  # and dk/dv kernels.
  monkeypatch.setattr(plan_mod, "KV_COMPUTE", 128)
  monkeypatch.setattr(plan_mod, "MASKED_TILE", tile)
  kw = dict(kw)
  extra = kw.pop("extra", False)
  h, kvh = (4, 2) if extra else (2, 1)
  q, k, v = qkv(sq=sq, h=h, kvh=kvh)
  if extra:
    kw.update(sinks=jnp.linspace(-1.0, 1.0, h), dropout_rate=0.2, dropout_key=jax.random.key(2))
  blocks = BlockSizes(block, block, block, block)
  structure = {x: kw[x] for x in ("causal", "sliding_window") if x in kw}
  for backward in (False, True):
    plan = att._plan(_problem(q, k, v, **structure), blocks, backward=backward)
    n = {0: 1, 300: 3, 200: 3}[kw.get("sliding_window", 0)]
    assert plan.bq_masked == tile and len(plan.patterns) == len(plan.patterns_t) == n
    for d, tiles in plan.patterns + plan.patterns_t:  # each (row, col) tile cell at most once
      cells = [(r // tile + a, c // tile) for r, nr, c, nc, _ in tiles for a in range(nr // tile)]
      assert len(cells) == len(set(cells)) and all(nc == tile for *_, nc, _ in tiles)
  assert not att._plan(_problem(q, k, v, segment_ids=jnp.zeros((1, sq), jnp.int32), **structure),
                       blocks, backward=False).patterns
  out, lse = run(q, k, v, block_sizes=blocks, return_residuals=True, **kw)
  ref, ref_lse = att.attention_reference(q, k, v, return_residuals=True, **kw)
  close(out, ref)
  close(lse, ref_lse)
  grads_close(kw, q, k, v, blocks=blocks)


@pytest.mark.parametrize("kw", [dict(causal=True), dict(), dict(sliding_window=70, kvh=2), dict(causal=True, skv=390)],
                         ids=["causal", "full", "window_gqa", "causal_cross_kv_tail"])
def test_fused_and_separate_dq(kw, monkeypatch):
  # dq is computed by the dk/dv kernel (a VMEM accumulator of the whole group's q rows) when that
  # fits FUSED_DQ_VMEM of the chip's VMEM, else by its own kernel: both give the reference's grads.
  kw = dict(kw)
  kvh, skv = kw.pop("kvh", 1), kw.pop("skv", None)
  q, k, v = qkv(sq=300, skv=skv, h=4, kvh=kvh)
  prob = _problem(q, k, v, **kw)
  assert att._plan(prob, SMALL, backward=True).fused_dq
  assert not att._plan(_problem(q, k, v, bias=rand((1, 4, 300, skv or 300), seed=5), **kw), SMALL,
                       backward=True).fused_dq  # the dq kernel writes the bias gradient
  grads_close(kw, q, k, v)
  monkeypatch.setattr(plan_mod, "FUSED_DQ_VMEM", 0.0)
  assert not att._plan(prob, SMALL, backward=True).fused_dq
  grads_close(kw, q, k, v)


def test_backward_blocks_too_big_for_vmem():
  # 2048-blocks in the backward need ~135 MiB of VMEM (Mosaic's own count on v5e and v6e, which
  # have 128): a clear error naming block_sizes, raised while tracing, before Mosaic runs.
  from kernels.base.backend import target
  from kernels.base.errors import VmemOverflowError
  q = jax.ShapeDtypeStruct((1, 2, 4096, 128), jnp.bfloat16)
  f = functools.partial(att.flash_attention, causal=True, layout="BHSD", block_sizes=BlockSizes(2048, 2048, 2048, 2048))
  grad = jax.grad(lambda q, k, v: f(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
  for gen in ("v5e", "v6e"):
    with target(gen), pytest.raises(VmemOverflowError, match="block_sizes"):
      jax.eval_shape(grad, q, q, q)
    with target(gen):
      jax.eval_shape(jax.grad(lambda q, k, v: att.flash_attention(  # the default 1024-blocks fit
          q, k, v, causal=True, layout="BHSD", implementation="pallas").astype(jnp.float32).sum()), q, q, q)


def test_fused_dq_needs_vmem():
  # The fused dq holds (group, q_len, D) in VMEM: at 128k tokens it is the separate dq kernel.
  p = _problem(*qkv(sq=131072, h=1, kvh=1, d=128, dtype=jnp.bfloat16), causal=True)
  assert not att._plan(p, BlockSizes(1024, 1024, 1024, 1024), backward=True).fused_dq
  p = _problem(*qkv(sq=8192, h=1, kvh=1, d=128, dtype=jnp.bfloat16), causal=True)
  assert att._plan(p, BlockSizes(1024, 1024, 1024, 1024), backward=True).fused_dq


@pytest.mark.parametrize("causal,skv", [(True, 1000), (False, 1000), (True, 900)],
                         ids=["causal_window", "window", "causal_window_rows_see_nothing"])
def test_window_band_grid(causal, skv):
  # A sliding window: the q-major grids walk only the kv blocks lo(i).. a q block can see
  # (2 of 8 causal, 3 of 8 symmetric here), idle steps past hi(i) doing nothing. With
  # kv_len < q_len the first 100 queries see no key at all (output 0, lse -inf).
  q, k, v = qkv(sq=1000, skv=skv, h=4, kvh=2)
  kw = dict(causal=causal, sliding_window=100)
  plan = att._plan(_problem(q, k, v, **kw), SMALL, backward=False)
  assert 0 < plan.band <= 3 and plan.nkv == -(-skv // 128)
  out, lse = run(q, k, v, return_residuals=True, **kw)
  ref, ref_lse = att.attention_reference(q, k, v, return_residuals=True, **kw)
  close(out, ref)
  close(lse, ref_lse)
  grads_close(kw, q, k, v)


def test_dropout_is_exactly_the_reference():
  q, k, v = qkv(b=2, sq=256, h=2, kvh=1)
  kw = dict(dropout_rate=0.3, dropout_key=jax.random.key(7), causal=True)
  out = run(q, k, v, **kw)
  close(out, att.attention_reference(q, k, v, **kw))
  plain = att.attention_reference(q, k, v, causal=True)
  assert np.abs(np.asarray(out) - np.asarray(plain)).max() > 0.1  # dropout did something
  other = run(q, k, v, **dict(kw, dropout_key=jax.random.key(8)))
  assert np.abs(np.asarray(out) - np.asarray(other)).max() > 0.1
  grads_close(kw, q, k, v)


def test_stale_vmem_never_reaches_outputs():
  # interpret mode that fills uninitialised VMEM and out-of-bounds reads with NaN
  params = pltpu.InterpretParams(out_of_bounds_reads="uninitialized", uninitialized_memory="nan")
  q, k, v = qkv(sq=200, skv=300, h=2, kvh=1)
  kw = dict(causal=True)
  out = run(q, k, v, interpret=params, **kw)
  close(out, att.attention_reference(q, k, v, **kw))
  g = jax.grad(lambda q, k, v: run(q, k, v, interpret=params, **kw).sum(), argnums=(0, 1, 2))(q, k, v)
  assert all(np.isfinite(np.asarray(x)).all() for x in g)


@pytest.mark.parametrize("tiles", [False, True], ids=["blocks", "masked_tiles"])
def test_no_races(tiles, monkeypatch):
  # causal, q_len == kv_len: the folded grids; with tiles, 256-blocks cut into 128-tiles
  from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
  blocks = SMALL
  if tiles:
    monkeypatch.setattr(plan_mod, "MASKED_TILE", 128)
    blocks = BlockSizes(256, 256, 256, 256)
  q, k, v = qkv(sq=512 if tiles else 256, h=2, kvh=1)
  params = pltpu.InterpretParams(detect_races=True)
  out = run(q, k, v, interpret=params, causal=True, block_sizes=blocks)
  assert ipc.races is not None and not ipc.races.races_found
  jax.grad(lambda q, k, v: run(q, k, v, interpret=params, causal=True, block_sizes=blocks).sum(),
           argnums=(0, 1, 2))(q, k, v)
  assert ipc.races is not None and not ipc.races.races_found
  close(out, att.attention_reference(q, k, v, causal=True))


@settings(max_examples=5, deadline=None, derandomize=True)
@given(sq=st.integers(1, 300), skv=st.integers(1, 300), group=st.sampled_from([1, 2]), d=st.sampled_from([64, 128]),
       causal=st.booleans(), window=st.sampled_from([None, 50, 200]), bq=st.sampled_from([64, 128]))
def test_hypothesis_shapes(sq, skv, group, d, causal, window, bq):
  q, k, v = qkv(sq=sq, skv=skv, h=group, kvh=1, d=d, seed=sq + skv)
  kw = dict(causal=causal, sliding_window=window)
  close(run(q, k, v, block_sizes=BlockSizes(bq, 128, 128, 128), **kw), att.attention_reference(q, k, v, **kw))


def test_xla_implementation_is_the_reference():
  q, k, v = qkv(sq=100)
  np.testing.assert_array_equal(att.flash_attention(q, k, v, causal=True, implementation="xla"),
                                att.attention_reference(q, k, v, causal=True))
  np.testing.assert_array_equal(att.flash_attention(q, k, v), att.attention_reference(q, k, v))  # CPU: XLA


# --- backward ------------------------------------------------------------------------------


@pytest.mark.parametrize("kw,shape", [
    (dict(), dict(sq=300, h=2, kvh=1, d=64)),
    (dict(causal=True), dict(sq=300, h=4, kvh=2, d=128)),
    (dict(causal=True, sliding_window=90, logits_soft_cap=2.0), dict(sq=256, skv=300, h=2, kvh=1, d=64)),
    (dict(sliding_window=60), dict(sq=200, skv=140, h=2, kvh=2, d=80, layout="BHSD")),
], ids=["plain", "causal-gqa", "window-softcap-cross", "band-bhsd"])
def test_gradients(kw, shape):
  layout = shape.get("layout", "BSHD")
  q, k, v = qkv(**shape)
  grads_close(dict(kw, layout=layout), q, k, v)


def test_gradients_segments_mask_bias_sinks():
  q, k, v = qkv(sq=256, skv=200, h=2, kvh=1, d=64)
  seg = (jnp.asarray(np.repeat([0, 1], 128)[None], jnp.int32), jnp.asarray(np.repeat([0, 1], 100)[None], jnp.int32))
  mask = jnp.asarray(np.random.default_rng(1).random((1, 1, 256, 200)) < 0.8)
  extra = [("bias", rand((1, 2, 256, 200), seed=5)), ("sinks", jnp.asarray([0.3, -0.2]))]
  grads_close(dict(segment_ids=seg, mask=mask, causal=True), q, k, v, extra=extra, argnums=(0, 1, 2, 3, 4))


def test_gradients_through_return_residuals():
  # With return_residuals the custom_vjp's primal and cotangent are (out, lse), without them out
  # alone (the inference kernel writes no lse): the same gradients, the same lse and output.
  q, k, v = qkv(sq=200, h=2, kvh=1, d=64)
  kw = dict(causal=True, sinks=jnp.asarray([0.3, -0.2]))
  w = rand((1, 200, 2, 64), seed=9)
  plain = jax.grad(lambda *a: (run(*a, **kw) * w).sum(), argnums=(0, 1, 2))(q, k, v)
  res = jax.grad(lambda *a: (run(*a, return_residuals=True, **kw)[0] * w).sum(), argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(plain, res):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  (out, lse), vjp = jax.vjp(lambda *a: run(*a, return_residuals=True, **kw), q, k, v)
  ref, ref_lse = att.attention_reference(q, k, v, return_residuals=True, **kw)
  close(out, ref)
  close(lse, ref_lse)
  assert all(np.isfinite(np.asarray(g)).all() for g in vjp((w, jnp.zeros_like(lse))))


# --- bad input ----------------------------------------------------------------------------


def _bad(argument, **kw):
  q, k, v = qkv(sq=64, h=4, kvh=2)
  args = dict(q=q, k=k, v=v)
  for name in ("q", "k", "v"):
    if name in kw:
      args[name] = kw.pop(name)
  with pytest.raises(kernels.KernelError) as info:
    att.flash_attention(args["q"], args["k"], args["v"], interpret=True, **kw)
  assert info.value.argument == argument, str(info.value)
  return str(info.value)


def test_bad_input_names_the_argument():
  q, k, v = qkv(sq=64, h=4, kvh=2)
  assert "head_dim" in _bad("k", k=rand((1, 64, 2, 32)))
  assert "divide" in _bad("k", k=rand((1, 64, 3, 64)), v=rand((1, 64, 3, 64)))
  _bad("v", v=rand((1, 64, 1, 64)))
  assert "rank" in _bad("q", q=rand((64, 4, 64)))
  assert "float16" in _bad("q", q=q.astype(jnp.float16), k=k.astype(jnp.float16), v=v.astype(jnp.float16))
  _bad("k", k=k.astype(jnp.bfloat16))
  _bad("layout", layout="SBHD")
  _bad("sliding_window", sliding_window=0)
  _bad("sliding_window", sliding_window=-3)
  _bad("logits_soft_cap", logits_soft_cap=0.0)
  _bad("dropout_rate", dropout_rate=1.0, dropout_key=jax.random.key(0))
  _bad("dropout_rate", dropout_rate=-0.1)
  _bad("dropout_key", dropout_rate=0.5)
  assert "shape" in _bad("segment_ids", segment_ids=jnp.zeros((1, 63), jnp.int32))
  _bad("segment_ids", segment_ids=jnp.zeros((1, 64), jnp.float32))
  _bad("mask", mask=jnp.ones((1, 4, 64, 63), bool))
  _bad("mask", mask=jnp.ones((1, 4, 64, 64), jnp.float32))
  _bad("bias", bias=jnp.ones((1, 3, 64, 64)))
  _bad("sinks", sinks=jnp.ones((2,)))
  _bad("block_sizes", block_sizes=(1, 2, 3))
  assert "multiple of 128" in _bad("block_sizes", block_sizes=BlockSizes(32, 100, 128, 128),
                                   q=rand((1, 300, 4, 64)), k=rand((1, 300, 2, 64)), v=rand((1, 300, 2, 64)))
  _bad("implementation", implementation="cuda")


def test_default_block_sizes():
  for gen in kernels.TPU_GENERATIONS:
    blocks = att.default_block_sizes(gen)
    assert isinstance(blocks, BlockSizes) and blocks.block_kv % 128 == 0 and blocks.block_kv_bwd % 128 == 0
  assert att.default_block_sizes(None) == att.default_block_sizes("v5e")
  # the tuned defaults of v5e / v6e: a causal S=8192 forward runs folded, in 512 x 512 masked tiles
  from kernels.base import backend
  p, _, _ = att._validate(*qkv(sq=8192, h=1, kvh=1, d=128, dtype=jnp.bfloat16), causal=True, segment_ids=None,
                          sliding_window=None, logits_soft_cap=None, scale=None, bias=None, mask=None, sinks=None,
                          dropout_rate=0.0, dropout_key=None, layout="BSHD")
  for gen in ("v5e", "v6e"):
    with backend.target(gen):
      plan = att._plan(p, None, backward=False)
      assert plan.folded and (plan.bq_masked, plan.bkv_masked) == (512, 512), plan


def test_default_block_sizes_per_head_dim():
  # issue 23: per-(generation, head_dim) defaults; head dims in between take the class above them
  table = att.tiling.block_table("attention")
  for gen in kernels.TPU_GENERATIONS:
    by_d = table[gen]["bfloat16"].get("by_head_dim", {})
    for d in ("64", "256"):
      assert d in by_d, (gen, d)
      blocks = att.default_block_sizes(gen, jnp.bfloat16, int(d))
      assert (blocks.block_q, blocks.block_kv) == (by_d[d]["block_q"], by_d[d]["block_kv"])
      assert blocks.block_q_bwd == table[gen]["bfloat16"]["block_q_bwd"]  # the backward's stay
    assert att.default_block_sizes(gen, jnp.bfloat16, 32) == att.default_block_sizes(gen, jnp.bfloat16, 64)
    assert att.default_block_sizes(gen, jnp.bfloat16, 96) == att.default_block_sizes(gen, jnp.bfloat16, 128)
    assert att.default_block_sizes(gen, jnp.bfloat16, 192) == att.default_block_sizes(gen, jnp.bfloat16, 256)


@pytest.mark.parametrize("gen", kernels.TPU_GENERATIONS)
def test_default_plan_at_tuned_head_dims(gen):
  # The default plans of the tuned head dims at the lengths they were tuned for (and 16k), causal or
  # not, bf16 and f32, forward and backward: the table's blocks fit, or are halved until they do.
  for d in (64, 128, 256):
    for s in (4096, 8192, 16384):
      for causal in (False, True):
        for dtype in (jnp.bfloat16, jnp.float32):
          q = jax.ShapeDtypeStruct((1, 2, s, d), dtype)
          p, _, _ = att._validate(q, q, q, causal=causal, segment_ids=None, sliding_window=None,
                                  logits_soft_cap=None, scale=None, bias=None, mask=None, sinks=None,
                                  dropout_rate=0.0, dropout_key=None, layout="BHSD")
          with kernels.base.backend.target(gen):
            fwd = att._plan(p, None, backward=False)
            att._plan(p, None, backward=True)
          assert fwd.mxu_rowsum == (d == 64)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(sq=st.integers(1, 2048), skv=st.integers(1, 2048), d=st.sampled_from([32, 64, 96, 128, 192, 256]),
       causal=st.booleans(), bf16=st.booleans(), gqa=st.booleans(), gen=st.sampled_from(kernels.TPU_GENERATIONS))
def test_default_plan_never_fails(sq, skv, d, causal, bf16, gqa, gen):
  """The default plan (table lookup, fitting, tiling, VMEM), forward and backward, for any sequence
  lengths in 1..2048 and the usual head sizes: a default call never fails on its blocks."""
  dtype = jnp.bfloat16 if bf16 else jnp.float32
  q = jax.ShapeDtypeStruct((1, sq, 4, d), dtype)
  k = jax.ShapeDtypeStruct((1, skv, 2 if gqa else 4, d), dtype)
  p, _, _ = att._validate(q, k, k, causal=causal and sq == skv, segment_ids=None, sliding_window=None,
                          logits_soft_cap=None, scale=None, bias=None, mask=None, sinks=None, dropout_rate=0.0,
                          dropout_key=None, layout="BSHD")
  with kernels.base.backend.target(gen):
    for backward in (False, True):
      att._plan(p, None, backward)


# --- ahead-of-time compilation for TPU ------------------------------------------------------

sds = jax.ShapeDtypeStruct
bf16 = jnp.bfloat16


def compile_plain(fn, args, generation):
  """compile_for_tpu in a child process without libtpu's cost model, which aborts the
  process on some of these programs (dropout; some GQA/BSHD shapes) that compile fine."""
  return kernels.perf.tpu._compile_elsewhere(jax.jit(fn), args, kernels.get_chip(generation))


@pytest.mark.tpu_aot
@pytest.mark.parametrize("generation", kernels.TPU_GENERATIONS)
def test_aot_forward_and_backward_at_defaults(generation):
  q, kv = sds((1, 2048, 8, 128), bf16), sds((1, 2048, 2, 128), bf16)

  def f(q, k, v):
    return att.flash_attention(q, k, v, causal=True)
  comp = compile_plain(f, (q, kv, kv), generation)
  assert comp.hlo.count("tpu_custom_call") == 1
  # BSHD with head_dim 128 is read in place: no transpose or copy in HBM
  assert "transpose(" not in comp.hlo
  grad = jax.grad(lambda q, k, v: f(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
  comp = compile_plain(grad, (q, kv, kv), generation)
  assert comp.hlo.count("tpu_custom_call") >= 2  # forward, dk/dv (with dq fused, else a dq kernel too)
  # odd shapes and every option
  q, kv = sds((2, 1000, 4, 80), bf16), sds((2, 1000, 2, 80), bf16)
  opts = (sds((2, 1000), jnp.int32), sds((4,), jnp.float32))

  def everything(q, k, v, s, sk, **kw):
    return att.flash_attention(q, k, v, segment_ids=s, sinks=sk, sliding_window=256, logits_soft_cap=30.0, **kw)
  comp = compile_plain(everything, (q, kv, kv) + opts, generation)
  assert "tpu_custom_call" in comp.hlo
  # with lse (odd q blocks: its (1, block_q) rows need not be whole lane tiles)
  comp = compile_plain(functools.partial(everything, return_residuals=True), (q, kv, kv) + opts, generation)
  assert "tpu_custom_call" in comp.hlo
  drop = functools.partial(everything, dropout_rate=0.1, dropout_key=jax.random.key(0))
  comp = compile_plain(drop, (q, kv, kv) + opts, generation)
  assert "tpu_custom_call" in comp.hlo
  # decode: 8 queries against a 4097-token cache
  comp = compile_plain(lambda q, k, v: att.flash_attention(q, k, v, causal=True),
                       (sds((4, 8, 8, 128), bf16), sds((4, 4097, 1, 128), bf16), sds((4, 4097, 1, 128), bf16)),
                       generation)
  assert "tpu_custom_call" in comp.hlo


@pytest.mark.tpu_aot
def test_aot_lse_written_only_when_needed_and_compact():
  # Issue 23, item 3. Inference writes only the output. lse, when written (return_residuals, or a
  # gradient's residual), is [B, H, Sq] f32 in HBM, not [B, H, Sq, 1], whose (8, 128) tiles pad
  # each row to 128 lanes (512 bytes a row). Neither the forward nor the backward makes the padded copy.
  b, h, s, d = 1, 8, 8192, 128  # (shorter, the padded lse fitted in VMEM and did not show)
  q = sds((b, h, s, d), bf16)
  out_bytes, lse_bytes = b * h * s * d * 2, b * h * s * 4
  f = functools.partial(att.flash_attention, causal=True, layout="BHSD")
  mem = compile_plain(f, (q, q, q), "v5e").memory
  assert mem["output"] == out_bytes and mem["temp"] < lse_bytes, mem
  mem = compile_plain(functools.partial(f, return_residuals=True), (q, q, q), "v5e").memory
  assert out_bytes + lse_bytes <= mem["output"] < out_bytes + 2 * lse_bytes and mem["temp"] < lse_bytes, mem

  for fused in (True, False):  # dq in the dk/dv kernel, or in its own
    def vjp(q, k, v, do):  # a new function each time: jit's cache would return the first trace
      return jax.vjp(f, q, k, v)[1](do)
    with pytest.MonkeyPatch.context() as mp:
      mp.setattr(plan_mod, "FUSED_DQ_VMEM", 1 / 8 if fused else 0.0)
      comp = compile_plain(vjp, (q, q, q, q), "v5e")
    assert comp.hlo.count("tpu_custom_call") == (2 if fused else 3)
    mem = comp.memory
    # temporaries: lse and D (and their padding to whole q blocks), never a 128-lane padded copy
    assert 3 * out_bytes <= mem["output"] < 3 * out_bytes + lse_bytes and mem["temp"] <= 8 * lse_bytes, (fused, mem)


@pytest.mark.tpu_aot
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward_backward"])
def test_causal_estimate_charges_every_visible_block(backward):
  # libtpu's cost model evaluates a scalar lax.div / lax.rem as 0. When the block ranges of the
  # causal skip were divisions, it charged only the first kv block of every q row: the causal
  # forward came out at 189% of its roofline. Products, comparisons and shifts it evaluates
  # correctly. 8 x 8 blocks, 36 visible: causal must cost over 0.45 of the full problem.
  if not kernels.estimator_available():
    pytest.skip("the TPU cost model is not loaded in this process")
  s, h, d = 4096, 1, 128
  q = sds((1, h, s, d), bf16)
  blocks = BlockSizes(512, 512, 512, 512)
  est = {}
  for causal in (True, False):
    fwd = functools.partial(att.flash_attention, causal=causal, layout="BHSD", block_sizes=blocks)
    fn = jax.grad(lambda q, k, v: fwd(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)) if backward else fwd
    flops = 4 * h * d * s * (s + 1 if causal else 2 * s) / 2 * (3.5 if backward else 1.0)
    est[causal] = kernels.estimate_tpu(fn, q, q, q, generation="v5e", flops=flops, bytes_accessed=4 * 2 * h * s * d)
  assert est[True].valid, str(est[True])
  assert est[True].seconds > 0.45 * est[False].seconds, (str(est[True]), str(est[False]))


@pytest.mark.tpu_aot
@pytest.mark.parametrize("generation", EXTRA_AOT_GENERATIONS)
def test_aot_folded_tiled_and_banded_grids(generation, monkeypatch):
  # Mosaic compiles the folded causal grids with static tile patterns and the window's band grid,
  # forward and backward, with dq fused into the dk/dv kernel and (FUSED_DQ_VMEM = 0) in its own
  # kernel (v4: its default 512 blocks, folded without tiles, dq in its own kernel).
  q = sds((1, 4, 4096, 128), bf16)
  kv = sds((1, 2, 4096, 128), bf16)
  blocks = None if generation == "v4" else BlockSizes(1024, 1024, 1024, 1024)
  for fused in (True, False):
    monkeypatch.setattr(plan_mod, "FUSED_DQ_VMEM", 1 / 8 if fused else 0.0)
    for kw in (dict(causal=True), dict(causal=True, sliding_window=1024)):
      f = functools.partial(att.flash_attention, layout="BHSD", block_sizes=blocks, **kw)
      grad = jax.grad(lambda q, k, v: f(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
      comp = compile_plain(grad, (q, kv, kv), generation)
      assert comp.hlo.count("tpu_custom_call") == (2 if fused and generation != "v4" else 3)


# --- RoPE inside the kernel ---------------------------------------------------------------
# flash_attention(..., rope=RotaryEmbedding(...)) against the brief's oracle: the reference on
# kernels.rope_reference(q) and kernels.rope_reference(k) (queries at positions kv_len - q_len + i),
# forward and jax.vjp gradients with respect to the unrotated q, k, v. Tolerances: f32 as above
# (2e-5 output, 1e-4 of the largest gradient entry); bf16 2e-2 output and 2e-2 of the largest
# gradient entry (the reference rounds the rotated q and k to bf16, then scales in f32; the
# kernel rotates and scales in f32 and rounds once).

ROPE_GRAD_TOL = {"float32": GRAD_RTOL, "bfloat16": 2e-2}


def rope_oracle(rope, q, k, v, layout="BSHD", **kw):
  """attention_reference(rope_reference(q), rope_reference(k), v), built from the public pieces."""
  def rot(x, first):
    x = x if layout == "BSHD" else jnp.swapaxes(x, 1, 2)
    pos = jnp.broadcast_to(first + jnp.arange(x.shape[1]), x.shape[:2])
    y = dataclasses.replace(rope, max_position=skv).reference(x, pos)  # (the table must reach kv_len)
    return y if layout == "BSHD" else jnp.swapaxes(y, 1, 2)
  sq, skv = (q.shape[1], k.shape[1]) if layout == "BSHD" else (q.shape[2], k.shape[2])
  return att.attention_reference(rot(q, skv - sq), rot(k, 0), v, layout=layout, **kw)


def rope_close(rope, q, k, v, blocks=SMALL, **kw):
  dtype = jnp.dtype(q.dtype).name
  out, vjp = jax.vjp(lambda *a: run(*a, rope=rope, block_sizes=blocks, **kw), q, k, v)
  ref, ref_vjp = jax.vjp(lambda *a: rope_oracle(rope, *a, **kw), q, k, v)
  close(out, ref, q.dtype)
  ct = rand(out.shape, seed=9).astype(out.dtype)
  for a, b in zip(vjp(ct), ref_vjp(ct)):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.isfinite(a).all()
    np.testing.assert_allclose(a, b, atol=ROPE_GRAD_TOL[dtype] * max(1.0, np.abs(b).max()), rtol=0)
  return out


@pytest.mark.parametrize("rope_kw,shape,kw", [
    (dict(), dict(sq=256, h=2, kvh=1, d=128), dict(causal=True)),
    (dict(interleaved=True), dict(sq=200, h=4, kvh=2, d=64), dict()),
    (dict(rotary_dim=32), dict(sq=256, h=2, kvh=2, d=64, layout="BHSD"), dict(causal=True)),
    (dict(rotary_dim=64, interleaved=True, scaling=kernels.RopeScaling("llama3", 8.0, original_max_position=64)),
     dict(sq=128, skv=300, h=2, kvh=1, d=128), dict(causal=True, sliding_window=100)),
    (dict(theta=500000.0), dict(sq=256, h=2, kvh=1, d=128, dtype=jnp.bfloat16), dict(causal=True)),
], ids=["half-causal-gqa", "interleaved-full-tail", "partial-bhsd", "partial-interleaved-llama3-decode-window",
        "bf16"])
def test_rope_in_kernel_matches_rope_then_reference(rope_kw, shape, kw):
  rope = kernels.RotaryEmbedding(**rope_kw)
  q, k, v = qkv(**shape)
  out = rope_close(rope, q, k, v, layout=shape.get("layout", "BSHD"), **kw)
  # the rotation is not a no-op here
  assert np.abs(np.asarray(out, np.float32) - np.asarray(run(q, k, v, layout=shape.get("layout", "BSHD"), **kw),
                                                           np.float32)).max() > 0.05


def test_rope_with_separate_dq_kernel_and_default_blocks(monkeypatch):
  rope = kernels.RotaryEmbedding(rotary_dim=96)
  q, k, v = qkv(sq=300, h=2, kvh=1, d=128)
  rope_close(rope, q, k, v, blocks=None, causal=True)  # one block (the sequence rounded up)
  monkeypatch.setattr(plan_mod, "FUSED_DQ_VMEM", 0.0)  # dq in its own kernel, rotated back there
  rope_close(rope, q, k, v, causal=True)


def test_rope_composes_with_jit_vmap_and_the_xla_path():
  rope = kernels.RotaryEmbedding(interleaved=True)
  q, k, v = qkv(b=2, sq=128, h=2, kvh=1, d=64)
  f = jax.jit(lambda q, k, v: run(q[None], k[None], v[None], rope=rope, causal=True)[0])
  out = jax.vmap(f)(q, k, v)
  close(out, rope_oracle(rope, q, k, v, causal=True))
  g = jax.jit(jax.vmap(jax.grad(lambda q, k, v: f(q, k, v).sum(), argnums=(0, 1))))(q, k, v)
  g_ref = jax.grad(lambda q, k: rope_oracle(rope, q, k, v, causal=True).sum(), argnums=(0, 1))(q, k)
  for a, b in zip(g, g_ref):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=GRAD_RTOL * max(1.0, np.abs(b).max()), rtol=0)
  xla = att.flash_attention(q, k, v, rope=rope, causal=True, implementation="xla")
  np.testing.assert_allclose(np.asarray(xla), np.asarray(rope_oracle(rope, q, k, v, causal=True)), atol=1e-6, rtol=0)
  np.testing.assert_array_equal(np.asarray(xla), np.asarray(att.attention_reference(q, k, v, rope=rope, causal=True)))


def test_rope_bad_input_names_the_argument():
  q, k, v = qkv(sq=64, h=4, kvh=2)
  assert "RotaryEmbedding" in _bad("rope", rope=dict(theta=1e4))
  assert "q_len <= kv_len" in _bad("rope", rope=kernels.RotaryEmbedding(), q=rand((1, 65, 4, 64)))
  assert "max_position" in _bad("rope", rope=kernels.RotaryEmbedding(max_position=32))
  _bad("rotary_dim", rope=kernels.RotaryEmbedding(rotary_dim=33))
  _bad("rotary_dim", rope=kernels.RotaryEmbedding(rotary_dim=128))  # > head_dim 64
  _bad("theta", rope=kernels.RotaryEmbedding(theta=1.0))
  _bad("scaling", rope=kernels.RotaryEmbedding(scaling="yarn"))
  _bad("interleaved", rope=kernels.RotaryEmbedding(interleaved=1))
  with pytest.raises(kernels.KernelError):
    att.attention_reference(q, k, v, rope=kernels.RotaryEmbedding(max_position=10))


@pytest.mark.tpu_aot
@pytest.mark.parametrize("generation", EXTRA_AOT_GENERATIONS)
def test_aot_rope_forward_and_backward_at_defaults(generation):
  # RoPE inside the kernels: one custom call forward (no rotation pass over q or k in HBM), BSHD
  # read in place, and the backward's kernels (dk/dv with dq fused, or a dq kernel too).
  q, kv = sds((1, 2048, 8, 128), bf16), sds((1, 2048, 2, 128), bf16)
  rope = kernels.RotaryEmbedding(rotary_dim=64, interleaved=True)

  def f(q, k, v):
    return att.flash_attention(q, k, v, causal=True, rope=rope)
  comp = compile_plain(f, (q, kv, kv), generation)
  assert comp.hlo.count("tpu_custom_call") == 1 and "transpose(" not in comp.hlo
  grad = jax.grad(lambda q, k, v: f(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
  comp = compile_plain(grad, (q, kv, kv), generation)
  assert comp.hlo.count("tpu_custom_call") >= 2


@pytest.mark.tpu_aot
@pytest.mark.parametrize("generation", kernels.TPU_GENERATIONS)
def test_aot_tuned_head_dims_at_defaults(generation):
  # issue 23: the per-head_dim defaults (by_head_dim) compile: head_dim 64 (the denominator from the
  # PV matmul, exp2), causal; head_dim 256 non-causal, and its forward + backward, causal
  for d, causal, backward in ((64, True, False), (256, False, False), (256, True, True)):
    q = sds((1, 2, 4096, d), bf16)
    f = functools.partial(att.flash_attention, causal=causal, layout="BHSD")
    fn = jax.grad(lambda q, k, v: f(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)) if backward else f
    comp = compile_plain(fn, (q, q, q), generation)
    n = comp.hlo.count("tpu_custom_call")
    assert n >= 2 if backward else n == 1, (d, causal, n)  # backward: dk/dv (dq fused, or a dq kernel)


@pytest.mark.parametrize("rowsum,exp2", [(True, True), (False, False)])
def test_forward_variants_denominator_and_exp2(rowsum, exp2, monkeypatch):
  # issue 23: the denominator from the PV matmul (head_dim < 128) and exp2 with log2(e) in q's
  # scale, on and off, with sinks (the denominator starts at 1) and lse (converted back from base 2)
  monkeypatch.setattr(plan_mod, "_MXU_ROWSUM", rowsum)
  monkeypatch.setattr(plan_mod, "_EXP2", exp2)
  q, k, v = qkv(sq=200, h=2, kvh=1, d=64)
  sinks = jnp.asarray([0.4, -1.0])
  p = att._validate(q, k, v, causal=True, segment_ids=None, sliding_window=None, logits_soft_cap=None, scale=None,
                    bias=None, mask=None, sinks=sinks, dropout_rate=0.0, dropout_key=None, layout="BSHD")[0]
  plan = att._plan(p, SMALL, backward=False)
  assert (plan.mxu_rowsum, plan.exp2) == (rowsum, exp2)
  out, lse = run(q, k, v, causal=True, sinks=sinks, return_residuals=True)
  ref, ref_lse = att.attention_reference(q, k, v, causal=True, sinks=sinks, return_residuals=True)
  close(out, ref)
  np.testing.assert_allclose(lse, ref_lse, atol=2e-5)
