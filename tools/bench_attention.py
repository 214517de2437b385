"""Compiler estimates of attention on TPU: ours against XLA and JAX's Pallas kernels.

For each case (sequence length, head dim, causal or not, forward or forward+backward,
GQA, sliding window) and each TPU generation in ``--generations`` it estimates:

* ``xla``: ``jax.nn.dot_product_attention(..., implementation="xla")``;
* ``jax_flash``: ``jax.experimental.pallas.ops.tpu.flash_attention`` at its default
  block sizes and at a few others (``--tune``);
* ``splash``: the multi-head splash attention kernel
  (``jax.experimental.pallas.ops.tpu.splash_attention``, ``CausalMask`` / ``FullMask`` /
  ``LocalMask``) at its default block sizes and a few others. Splash picks its blocks
  from tables in SMEM, which libtpu's cost model reads as zeros; for the estimate its
  table lookup is replaced by the same tables written as arithmetic, checked against
  splash's own (``splash_tables_as_arithmetic``). Before that (until 2026-11-23) the
  model charged splash for skipping almost every block, and its figures were void;
* ``ours``: ``kernels.flash_attention`` at its defaults and a few other forward block
  sizes (when the module exists).

Every number is a **compiler estimate** (``kernels.estimate_tpu``), never a
measurement. Each peer gets its inputs in its own native layout (XLA:
``[batch, seq, heads, head_dim]``; ours and JAX's flash: ``[batch, heads, seq, head_dim]``
(ours with ``layout="BHSD"``); splash: ``[heads, seq, head_dim]``, batch 1), so no layout
change is timed. (Ours in its default BSHD layout reads each head's rows in place, a
strided DMA the cost model charges more for: non-causal S=4096, D=128, 2 heads, v5e,
131.0 us against 110.9 us in BHSD, 2026-11-23.) The Pallas
peers have no grouped-query attention: for the GQA case K and V are repeated to the
query heads inside the timed function, as a user of those kernels would do. JAX's
flash kernel has no sliding window, so it is absent from that case. Splash does not
scale the logits: it gets q already multiplied by ``1/sqrt(D)``, and that elementwise
pass is not timed (scaling inside the timed function lets XLA place a small q in VMEM,
and libtpu's cost model aborts on the kernel's VMEM-to-VMEM copy).

Conventions (stored in the JSON):

* FLOPs: ``4 * B * H * D * pairs`` for the forward pass, where ``pairs`` is the number
  of (query, key) pairs attended: ``S^2`` without a mask, ``S (S + 1) / 2`` causal,
  ``sum_i min(i + 1, W)`` for a causal sliding window of ``W`` keys. The backward pass
  counts 2.5x the forward (5 matmuls of the same size against 2, the usual convention),
  so forward+backward = 3.5x forward.
* Bytes: each tensor read or written once: forward reads q, k, v and writes o;
  forward+backward adds reading q, k, v, o, dO and writing dq, dk, dv.
* Forward+backward is ``jax.vjp`` of the attention applied to a cotangent dO passed as
  an input (the gradient of ``sum(out * dO)`` with respect to q, k, v).

Each estimate runs in a child process (libtpu's cost model can abort a process) and
takes ``/tmp/tpu-heavy.lock`` while it runs, so other helpers' heavy jobs interleave.
Results are written to ``kernels/data/attention_bench.json`` after every estimate; a
rerun skips what is stored (``--force`` redoes it). Work is ordered by importance: the
target case (causal forward, S=8192, D=128) first, then the rest.

Usage::

  python tools/bench_attention.py                          # everything, in order of importance
  python tools/bench_attention.py --only target            # just the S=8192 D=128 causal forward
  python tools/bench_attention.py --peers ours             # re-estimate ours only
  python tools/bench_attention.py --memory                 # temp HBM of XLA vs flash, S=1k..16k (compile only)
  python tools/bench_attention.py --rope                   # RoPE fused into the kernel vs kernels.rope + it vs XLA
  # while another job holds the lock: short estimates only, each stopped after 75 s
  python tools/bench_attention.py --only target --no-lock --timeout 75

An estimate stopped by --timeout is stored as "not estimated: the estimate took longer
than ..." and is retried by a later run with a longer timeout (with the lock).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import fcntl
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import results as result_tables  # noqa: E402  (tools/results.py: the JSON tables)
import kernels  # noqa: E402  (first: enables the cost model before JAX loads libtpu)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "kernels", "data", "attention_bench.json")
LOCK = "/tmp/tpu-heavy.lock"
GENERATIONS = ("v5e", "v6e")
PEERS = ("xla", "jax_flash", "splash", "ours")
DTYPE = "bfloat16"

# Heads per shape: batch 1 and 2 heads keep the Pallas grids in the low thousands (the
# estimate's cost grows with grid steps) and XLA's estimate within this machine's RAM (at
# 8 heads and S=8192 the estimating process was killed for memory); the head count only
# scales the work.
HEADS = {64: 2, 128: 2, 256: 2}


# --- cases ------------------------------------------------------------------------

def case(s, d, causal, bwd, heads=None, kv_heads=None, window=None, batch=1):
  h = heads or HEADS[d]
  return {"batch": batch, "seq": s, "heads": h, "kv_heads": kv_heads or h, "head_dim": d,
          "causal": causal, "window": window, "backward": bwd}


def case_key(c) -> str:
  k = f"{'fwdbwd' if c['backward'] else 'fwd'}_{'causal' if c['causal'] else 'full'}_S{c['seq']}_D{c['head_dim']}"
  k += f"_B{c['batch']}_H{c['heads']}"
  if c["kv_heads"] != c["heads"]:
    k += f"_KV{c['kv_heads']}"
  if c["window"]:
    k += f"_W{c['window']}"
  return k


def cases_in_order():
  """All cases, most important first."""
  out = [case(8192, 128, True, False)]                                   # the target
  out += [case(8192, 128, False, False), case(8192, 128, True, True)]
  for s in (4096, 16384, 2048, 1024):
    out += [case(s, 128, True, False), case(s, 128, False, False)]
  out += [case(4096, 128, True, False, heads=8, kv_heads=2), case(8192, 128, True, False, window=1024)]
  for s in (4096, 2048, 1024, 16384):
    out += [case(s, 128, True, True)]
  for s in (8192, 4096, 2048, 1024, 16384):
    out += [case(s, 128, False, True)]
  for s in (8192, 4096, 2048, 1024, 16384):
    out += [case(s, 64, True, False), case(s, 64, False, False)]
  out += [case(4096, 128, True, True, heads=8, kv_heads=2), case(8192, 128, True, True, window=1024)]
  for s in (8192, 4096, 2048, 1024, 16384):
    out += [case(s, 64, True, True), case(s, 64, False, True)]
  for s in (8192, 4096):  # issue 23: head_dim 256 (64 is above)
    out += [case(s, 256, True, False), case(s, 256, False, False)]
  for s in (4096,):
    out += [case(s, 256, True, True), case(s, 256, False, True)]
  return out


def pairs(s, causal, window) -> int:
  """(query, key) pairs attended with q_len = kv_len = s."""
  if window:
    w = min(window, s)  # causal window of w keys, the query's own included
    return w * (w + 1) // 2 + (s - w) * w
  return s * (s + 1) // 2 if causal else s * s


def cost(c) -> tuple[float, float]:
  """(FLOPs, bytes) of a case under the conventions in the module docstring."""
  b, s, h, hk, d = c["batch"], c["seq"], c["heads"], c["kv_heads"], c["head_dim"]
  flops = 4.0 * b * h * d * pairs(s, c["causal"], c["window"])
  isz = jnp.dtype(DTYPE).itemsize
  q = b * s * h * d * isz
  kv = b * s * hk * d * isz
  nbytes = (q + 2 * kv + q)
  if c["backward"]:
    flops *= 3.5
    nbytes += (q + 2 * kv + 2 * q) + (q + 2 * kv)
  return flops, float(nbytes)


# --- the peers --------------------------------------------------------------------

def _sds(shape):
  return jax.ShapeDtypeStruct(shape, jnp.dtype(DTYPE))


def _with_vjp(f, bwd):
  if not bwd:
    return f

  def g(q, k, v, do):
    out, pullback = jax.vjp(f, q, k, v)
    return pullback(do)
  return g


# --- splash's block tables, written as arithmetic for the cost model -----------------
#
# Splash decides which kv block a grid step loads, and whether it computes at all, from
# tables prefetched into SMEM (``data_next``, ``block_mask``), read in one function,
# ``_next_nonzero``. libtpu's cost model reads every SMEM-prefetched scalar as 0, so it
# charges splash for running no block at all (estimates below the roofline) or for the
# wrong ones. For the estimate, ``_next_nonzero`` is replaced by the same tables written
# as products, shifts and comparisons, which the model evaluates; each formula is first
# checked entry by entry against splash's own tables, and the replaced kernel against
# the original in interpret mode (``tests/test_bench_tools.py``). The kernel body, block
# sizes and grid are splash's own.

def _log2(n):
  if n & (n - 1):
    raise NotImplementedError(f"splash's tables as arithmetic need power-of-two blocks, got {n}")
  return n.bit_length() - 1


def _splash_table_formula(bq, bkv, nkv, *, causal, window, dkv):
  """``(h, i, j) -> (next, block_mask)`` for a causal / full / local mask on a square
  problem, matching splash's shrunk tables."""
  sq, skv = _log2(bq), _log2(bkv)

  def full_block(i, j):
    ok = True
    if causal:
      ok = (j + 1) * bkv - 1 <= i * bq
    if window:
      ok = jnp.logical_and(ok, i * bq + bq - 1 - j * bkv <= window - 1)
    return ok

  def f(h, i, j):
    del h
    if not dkv:  # rows are q blocks; splash packs each row's visible kv blocks to the left
      lo = jnp.maximum((i * bq - (window - 1)) >> skv, 0) if window else 0 * i
      hi = jnp.minimum(((i + 1) * bq - 1) >> skv, nkv - 1) if causal else 0 * i + nkv - 1
      real = lo + j
      vis = real <= hi
      nxt = jnp.where(vis, real, 0)
      bm = jnp.where(vis, jnp.where(full_block(i, real), 2, 1), 0)
    else:  # columns are kv blocks; splash packs each column's visible q blocks to the bottom,
      # which for causal / full leaves every q block in its own row
      if window:
        raise NotImplementedError("splash's dk/dv tables for a local mask are not written as arithmetic")
      vis = i >= ((j * bkv) >> sq) if causal else i >= 0
      nxt = jnp.where(vis, i, 0)
      bm = jnp.where(vis, jnp.where(full_block(i, j), 2, 1), 0)
    return nxt, bm
  return f


def splash_tables_as_arithmetic(kernel, seq, *, causal, window):
  """Replace splash's ``_next_nonzero`` by checked arithmetic for ``kernel``'s tables."""
  import numpy as np
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
  bs = kernel.kwargs["block_sizes"]
  formulas = {}
  for name, bq, bkv, dkv in (("fwd_mask_info", bs.block_q, bs.block_kv, False),
                             ("dq_mask_info", bs.block_q_dq, bs.block_kv_dq, False),
                             ("dkv_mask_info", bs.block_q_dkv, bs.block_kv_dkv, True)):
    mi = getattr(kernel, name, None)
    if mi is None or bq is None:
      continue
    if mi.mask_next is not None:
      raise NotImplementedError("splash's partial-mask tables are not written as arithmetic")
    dn, bm = np.asarray(mi.data_next), np.asarray(mi.block_mask)
    if any((a != a[:1]).any() for a in (dn, bm)):
      raise NotImplementedError("splash's tables differ between heads")
    key = (dkv, bm.shape[1:])
    try:
      f = _splash_table_formula(bq, bkv, seq // bkv, causal=causal, window=window, dkv=dkv)
    except NotImplementedError as e:  # raised only if a kernel that reads this table is traced
      formulas.setdefault(key, (e, (bq, bkv)))
      continue
    i, j = np.indices(bm.shape[1:], dtype=np.int32)
    got = [np.asarray(x) for x in f(0, jnp.asarray(i), jnp.asarray(j))]
    if not (np.array_equal(got[0], dn[0]) and np.array_equal(got[1], bm[0])):
      raise RuntimeError(f"splash's {name} differs from its arithmetic form")
    if key in formulas and formulas[key][1] != (bq, bkv):
      raise NotImplementedError("two splash tables of one shape with different blocks")
    formulas[key] = (f, (bq, bkv))

  def next_nonzero(h, i, j, data_next_ref, block_mask_ref, m_next_ref, next_i=False):
    if block_mask_ref is None:
      return sk._original_next_nonzero(h, i, j, data_next_ref, block_mask_ref, m_next_ref, next_i)
    f = formulas[(next_i, tuple(block_mask_ref.shape[1:]))][0]
    if isinstance(f, Exception):
      raise f
    nxt, bm = f(h, i, j)
    return nxt, None, bm > 0, True  # should_not_mask is True without partial-mask tables

  if not hasattr(sk, "_original_next_nonzero"):
    sk._original_next_nonzero = sk._next_nonzero
  sk._next_nonzero = next_nonzero


def build(peer, c, blocks):
  """(function, abstract args) of ``peer`` on case ``c`` with ``blocks`` (None = defaults)."""
  b, s, h, hk, d = c["batch"], c["seq"], c["heads"], c["kv_heads"], c["head_dim"]
  causal, window, bwd = c["causal"], c["window"], c["backward"]
  scale = 1.0 / math.sqrt(d)
  if peer in ("xla", "ours"):  # XLA: [B, S, H, D]; ours: its native [B, H, S, D] (layout="BHSD")
    shapes = [(b, s, h, d), (b, s, hk, d), (b, s, hk, d)]
    if peer == "ours":
      shapes = [(b, h, s, d), (b, hk, s, d), (b, hk, s, d)]
    if peer == "xla":
      def f(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, scale=scale, implementation="xla",
                                            local_window_size=(window - 1, 0) if window else None)
    else:
      import importlib
      att = importlib.import_module("kernels.attention.api").flash_attention
      extra = {} if blocks is None else {"block_sizes": _ours_blocks(blocks)}
      if window:
        extra["sliding_window"] = window

      def f(q, k, v):
        return att(q, k, v, causal=causal, scale=scale, layout="BHSD", **extra)
  elif peer == "jax_flash":  # [B, H, S, D]
    from jax.experimental.pallas.ops.tpu import flash_attention as fa
    if window:
      raise NotImplementedError("JAX's flash_attention has no sliding window")
    shapes = [(b, h, s, d), (b, hk, s, d), (b, hk, s, d)]
    bs = None if blocks is None else fa.BlockSizes(**blocks)

    def f(q, k, v):
      if hk != h:
        k, v = jnp.repeat(k, h // hk, axis=1), jnp.repeat(v, h // hk, axis=1)
      return fa.flash_attention(q, k, v, causal=causal, sm_scale=scale, block_sizes=bs)
  elif peer == "splash":  # [H, S, D], batch 1
    from jax.experimental.pallas.ops.tpu import splash_attention as sa
    if b != 1:
      raise NotImplementedError("splash is estimated at batch 1")
    shapes = [(h, s, d), (hk, s, d), (hk, s, d)]
    if window:
      m = sa.LocalMask((s, s), window_size=(window - 1, 0), offset=0)
    elif causal:
      m = sa.CausalMask((s, s))
    else:
      m = sa.FullMask((s, s))
    bs = None if blocks is None else sa.BlockSizes(**blocks)
    kernel = sa.make_splash_mha(sa.MultiHeadMask([m] * h), block_sizes=bs, head_shards=1, q_seq_shards=1)
    splash_tables_as_arithmetic(kernel, s, causal=causal or bool(window), window=window)
    # The mask tables go in as arguments: as constants folded into the program, libtpu's
    # cost model aborts ("Unsupported DMA direction"), as arguments it estimates them.
    leaves, tree = jax.tree.flatten(kernel)
    tables = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]

    def make(*leaves):
      kern = jax.tree.unflatten(tree, leaves)

      def f(q, k, v):
        if hk != h:
          k, v = jnp.repeat(k, h // hk, axis=0), jnp.repeat(v, h // hk, axis=0)
        return kern(q, k, v)  # q comes pre-scaled (see the module docstring)
      return f
    n = 4 if bwd else 3

    def g(*a):
      return _with_vjp(make(*a[n:]), bwd)(*a[:n])
    shapes = [(h, s, d), (hk, s, d), (hk, s, d)] + ([(h, s, d)] if bwd else [])
    return g, [_sds(x) for x in shapes] + tables
  elif peer in ROPE_PEERS:  # all three in [B, S, H, D] (the layout kernels.rope reads)
    shapes = [(b, s, h, d), (b, s, hk, d), (b, s, hk, d)]
    f = _rope_peer(peer, causal, scale)
  else:
    raise ValueError(peer)
  if bwd:
    shapes.append(shapes[0])
  return _with_vjp(f, bwd), [_sds(x) for x in shapes]


# --- RoPE fused into the kernel (--rope) -----------------------------------------------
#
# flash_attention(..., rope=RotaryEmbedding()) rotates q and k in VMEM; the unfused program runs
# kernels.rope on q and k (an HBM pass over each, forward and backward) and then flash_attention;
# XLA's is kernels.rope_reference then jax.nn.dot_product_attention(implementation="xla"). The
# stored hbm_bytes are the compiler's counted traffic of each whole program.

ROPE_PEERS = ("ours_rope_fused", "ours_rope_unfused", "xla_rope")
# 2 heads, as the other cases (at 8 heads the cost model's process took more than 8 GB of RAM, and at
# S=8192 even with 2); the traffic saved scales with the heads. XLA fits at S=4096 only (XLA_TOO_BIG).
ROPE_CASES = [case(s, 128, True, bwd) for s in (2048, 4096, 8192) for bwd in (False, True)]


ROPE_SHAPES = {case_key(c): c for c in ROPE_CASES}
ROPE_HEADER = {
    "description": "RoPE + causal attention, [batch, seq, heads, head_dim] bf16 in [B, S, H, D]: "
                   "ours_rope_fused = flash_attention(q, k, v, rope=RotaryEmbedding()) (q and k rotated in "
                   "VMEM); ours_rope_unfused = kernels.rope on q and k, then flash_attention; xla_rope = "
                   "kernels.rope_reference then jax.nn.dot_product_attention(implementation='xla'). "
                   "us: compiler estimate (floored); hbm_bytes: the compiler's counted HBM traffic of the "
                   "whole program (forward, or jax.vjp forward+backward).",
    "script": "tools/bench_attention.py --rope",
}


def _rope_peer(peer, causal, scale):
  import importlib
  km = importlib.import_module("kernels")
  rope = km.RotaryEmbedding()
  if peer == "ours_rope_fused":
    return lambda q, k, v: km.flash_attention(q, k, v, causal=causal, scale=scale, rope=rope)
  if peer == "ours_rope_unfused":
    return lambda q, k, v: km.flash_attention(rope(q), rope(k), v, causal=causal, scale=scale)
  return lambda q, k, v: jax.nn.dot_product_attention(rope.reference(q), rope.reference(k), v, is_causal=causal,
                                                      scale=scale, implementation="xla")


def _save_rope_entry(path, key, gen, peer, record):
  """Stores one record, re-reading the file first (another run may have stored others meanwhile)."""
  table = result_tables.load(path) or _header()
  rt = table.setdefault("rope", {"results": {}})
  rt.update({k: v for k, v in ROPE_HEADER.items() if k not in rt})
  rt["results"].setdefault(key, {"shape": ROPE_SHAPES[key]}).setdefault(gen, {})[peer] = record
  result_tables.save(table, path)


def run_rope(args):
  """Estimates of the three RoPE programs on ROPE_CASES, stored under ``"rope"`` in the table."""
  table = result_tables.load(args.out) or _header()
  rt = table.setdefault("rope", dict(ROPE_HEADER, results={}))
  peers = [p for p in ROPE_PEERS if p in args.peers] or ROPE_PEERS
  for c in ROPE_CASES:
    key = case_key(c)
    if args.only and key not in args.only.split(","):
      continue
    for gen in args.generations:
      for peer in peers:
        res = rt["results"].setdefault(key, {"shape": c}).setdefault(gen, {})
        timed_out = res.get(peer, {}).get("error", "").startswith("not estimated: the estimate took")
        if peer in res and not args.force and not (timed_out and ESTIMATE_TIMEOUT > args.timeout):
          continue
        if args.deadline and time.time() > args.deadline:
          print("deadline reached: stopping", flush=True)
          return
        if peer == "xla_rope" and c["seq"] * c["heads"] >= 8192 * 2:
          res[peer] = {"error": XLA_TOO_BIG}
        else:
          t0 = time.time()
          res[peer] = estimate_isolated(peer, c, gen, None)
          res[peer]["wall_seconds"] = round(time.time() - t0, 1)
          res[peer]["date"] = datetime.date.today().isoformat()
        _save_rope_entry(args.out, key, gen, peer, res[peer])
        r = res[peer]
        print(gen, key, peer, f"{r['us']:.1f} us, {r['hbm_bytes'] / 2**20:.1f} MiB" if "us" in r else r["error"],
              flush=True)


def _ours_blocks(blocks):
  import importlib
  mod = importlib.import_module("kernels.attention.api")
  return mod.BlockSizes(**blocks)


def ours_available() -> bool:
  try:
    import importlib
    return hasattr(importlib.import_module("kernels.attention.api"), "flash_attention")
  except Exception:  # noqa: BLE001
    return False


# Block sizes tried besides each kernel's defaults (None). JAX's flash: forward blocks
# (block_q, block_k_major, block_k) and, for the backward, the same sizes for dkv and dq.
def _jf(bq, bkm, bk, bwd):
  d = {"block_q": bq, "block_k_major": bkm, "block_k": bk, "block_b": 1}
  if bwd:
    d.update(block_q_major_dkv=bq, block_k_major_dkv=bkm, block_k_dkv=bk, block_q_dkv=bq,
             block_k_major_dq=bkm, block_k_dq=bk, block_q_dq=bq)
  else:  # the forward ignores these, but BlockSizes wants them for the custom_vjp
    d.update(block_q_major_dkv=128, block_k_major_dkv=128, block_k_dkv=128, block_q_dkv=128,
             block_k_major_dq=128, block_k_dq=128, block_q_dq=128)
  return d


def _sp(bq, bkv, bkvc, bwd):
  d = {"block_q": bq, "block_kv": bkv, "block_kv_compute": bkvc}
  if bwd:
    d.update(block_q_dkv=bq, block_kv_dkv=bkv, block_kv_dkv_compute=bkvc, block_q_dq=bq, block_kv_dq=bkv)
  return d


TARGET = case(8192, 128, True, False)
def _ours(bq, bkv, _compute, bwd):
  # (ours computes in KV_COMPUTE-key sub-blocks whatever bkv is; the backward tries 512 blocks)
  return {"block_q": bq, "block_kv": bkv, "block_q_bwd": 512, "block_kv_bwd": 512}


SWEEP = {  # (block_q, block_k_major or block_kv, block_k or block_kv_compute)
    "jax_flash": ((512, 512, 512), (1024, 1024, 512), (1024, 512, 512)),
    "splash": ((512, 512, 512), (1024, 1024, 512), (1024, 512, 512), (1024, 2048, 512), (2048, 2048, 512)),
    "ours": ((1024, 1024, None), (2048, 1024, None), (512, 512, None)),  # (default on v5e, v6e: 2048 / 2048)
}


def _make_blocks(peer, triple, bwd):
  return {"jax_flash": _jf, "splash": _sp, "ours": _ours}[peer](*triple, bwd)


def candidates(peer, c, table=None, gen=None):
  """Block sizes to try for ``peer`` on ``c``: the defaults (None) first, then others.

  On the target case, every block triple in SWEEP; on the other cases, the two best
  triples of the target case on the same generation, or on another one when it has none
  there (a full sweep everywhere does not fit in the time an estimate takes on this
  machine)."""
  if peer not in SWEEP:
    return [None]
  s, bwd = c["seq"], c["backward"]
  triples = list(SWEEP[peer])
  if case_key(c) != case_key(TARGET) and table is not None:
    tried = table["cases"].get(case_key(TARGET), {}).get("results", {}).get(gen, {}).get(peer, {}).get("tried", {})
    ranked = sorted((r["us"], name) for name, r in tried.items() if "us" in r and name != "default")
    if not ranked:  # no estimate of the target on this generation (splash aborts on v5e): the other's best
      for other in table["cases"].get(case_key(TARGET), {}).get("results", {}).values():
        tried = other.get(peer, {}).get("tried", {})
        ranked = ranked or sorted((r["us"], name) for name, r in tried.items() if "us" in r and name != "default")
    triples = []
    for _, name in ranked[:2]:
      d = json.loads(name)
      key = "block_k_major" if peer == "jax_flash" else "block_kv"
      minor = "block_k" if peer == "jax_flash" else "block_kv_compute"
      triples.append((d["block_q"], d[key], d.get(minor)))
  out = [None]
  for t in triples:
    if t[0] <= s and t[1] <= s:
      out.append(_make_blocks(peer, t, bwd))
  return out


# --- one estimate (child process) ----------------------------------------------------

def estimate_here(peer, c, gen, blocks):
  fn, args = build(peer, c, blocks)
  flops, nbytes = cost(c)
  t0 = time.time()
  e = kernels.estimate_tpu(fn, *args, generation=gen, flops=flops, bytes_accessed=nbytes, dtype=DTYPE)
  if e.cycles == 0:
    raise RuntimeError("the cost model reported 0 cycles")
  rl = e.roofline
  return {**e.record(), "tflops": round(flops / e.seconds / 1e12, 2),
          "fraction_of_mxu_peak": round(flops / e.seconds / rl.peak, 4),
          "vmem_mib": None if e.vmem_bytes is None else round(e.vmem_bytes / 2**20, 2),
          "estimate_seconds": round(time.time() - t0, 1)}


HOLDING_LOCK = False  # --hold-lock: the whole run holds it (taken once, in main)
ESTIMATE_TIMEOUT = 3600
MAX_RSS_GB = 8.0  # this machine has 24 GB shared by several jobs (--max-rss-gb when alone)


# XLA:TPU may copy one entry parameter into VMEM before the program starts ("cross-program
# prefetch"); the cost model does not charge that copy, and on a Pallas kernel's input it
# makes the kernel read VMEM (estimates faster than the roofline) or aborts the cost model
# (splash: "Unsupported DMA direction"). Every program here is compiled without it.
NO_CROSS_PROGRAM_PREFETCH = "--xla_max_cross_program_prefetches=0"


def _child_env():
  env = dict(os.environ)
  env["LIBTPU_INIT_ARGS"] = (env.get("LIBTPU_INIT_ARGS", "") + " " + NO_CROSS_PROGRAM_PREFETCH).strip()
  return env


def estimate_isolated(peer, c, gen, blocks, timeout=None):
  """:func:`estimate_here` in a child process holding the shared heavy-work lock.

  The child is stopped if it takes more than MAX_RSS_GB of RAM (estimating XLA's attention
  at S=8192 takes more than 17 GB: the cost model's memory grows with the score matrix)."""
  timeout = timeout or ESTIMATE_TIMEOUT
  cmd = [sys.executable, os.path.abspath(__file__), "--one", json.dumps([peer, c, gen, blocks])]
  with open(LOCK, "a") as lk:
    if not HOLDING_LOCK:
      fcntl.flock(lk, fcntl.LOCK_EX)
    try:
      with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=_child_env())
        t0, peak = time.time(), 0.0
        while proc.poll() is None:
          time.sleep(1)
          peak = max(peak, result_tables.rss_gb(proc.pid))
          if peak > MAX_RSS_GB or time.time() - t0 > timeout:
            result_tables.kill_tree(proc)
            why = (f"the estimating process exceeded {MAX_RSS_GB:.0f} GB of RAM" if peak > MAX_RSS_GB
                   else f"the estimate took longer than {timeout} s")
            return {"error": f"not estimated: {why}"}
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    finally:
      if not HOLDING_LOCK:
        fcntl.flock(lk, fcntl.LOCK_UN)
  lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
  if not lines:
    tail = [ln for ln in stderr.splitlines() if ln.startswith("F") or "Error" in ln]
    return {"error": "the compiler or its cost model crashed: " + (tail[-1][:200] if tail else f"exit {proc.returncode}")}
  r = json.loads(lines[-1])
  r["peak_rss_gb"] = round(peak, 1)
  return r


# --- storage ------------------------------------------------------------------------

SPLASH_BWD_V5E = ("not estimated: libtpu's cost model aborts the process on splash's backward kernels on "
                  "v5e ('Unsupported DMA direction: 10 on VL/VLP')")


XLA_TOO_BIG = ("not estimated: estimating XLA's attention at S=8192 (2 heads) took more than 17 GB of RAM "
               "before it was stopped, and this machine has 24 GB")


def _header():
  return {
      "kind": "compiler estimate (kernels.estimate_tpu, libtpu's static cost model)",
      "dtype": DTYPE,
      "script": "tools/bench_attention.py",
      "conventions": {
          "flops": "4*B*H*D*pairs forward (pairs = S^2, S(S+1)/2 causal, sum_i min(i+1, W) causal sliding "
                   "window); backward = 2.5x forward, so forward+backward = 3.5x forward",
          "bytes": "forward: read q, k, v, write o; forward+backward adds read q, k, v, o, dO and write dq, dk, dv",
          "backward": "jax.vjp of the attention, cotangent dO passed as an input",
          "layouts": "xla [B,S,H,D]; ours (layout='BHSD') and jax_flash [B,H,S,D]; splash [H,S,D] (batch 1); "
                     "Pallas peers repeat K/V heads for GQA inside the timed function",
          "scale": "1/sqrt(D); splash gets q pre-scaled (the scaling pass is not timed)",
          "compiler": "libtpu flag --xla_max_cross_program_prefetches=0 (an input prefetched into VMEM before "
                      "the program is not charged by the cost model)",
      },
      "jax": jax.__version__, "host": platform.node(), "cases": {},
  }


def _best(entry):
  ok = [(r["us"], name) for name, r in entry["tried"].items() if "us" in r]
  if not ok:
    return None
  us, name = min(ok)
  return {"blocks": name, **entry["tried"][name]}


def run(args):
  table = result_tables.load(args.out) or _header()
  table.setdefault("cases", {})
  cs = cases_in_order()
  if args.only == "target":
    cs = cs[:1]
  elif args.only:
    cs = [c for c in cs if case_key(c) in args.only.split(",")]
  peers = [p for p in args.peers if p != "ours" or ours_available()]
  if "ours" in args.peers and "ours" not in peers:
    print("kernels.flash_attention is not available: skipping ours", flush=True)
  t_all = time.time()
  for _ in (0,):
    for c in cs:
      key = case_key(c)
      for gen in args.generations:
        for peer in peers:
          if args.deadline and time.time() > args.deadline:
            print("deadline reached: stopping", flush=True)
            return
          cands = candidates(peer, c, table, gen)
          cands = cands if args.tune else cands[:1]
          if args.no_peer_defaults and peer in ("jax_flash", "splash") and len(cands) > 1:
            cands = cands[1:]  # their 128-blocks defaults are never the best peer: save the estimate
          if args.max_candidates:
            cands = cands[:args.max_candidates]
          for blocks in cands:
            name = "default" if blocks is None else json.dumps(blocks, sort_keys=True)
            entry = table["cases"].setdefault(key, {"shape": c, "flops": cost(c)[0], "bytes": cost(c)[1],
                                                    "results": {}})
            pe = entry["results"].setdefault(gen, {}).setdefault(peer, {"tried": {}})
            timed_out = pe["tried"].get(name, {}).get("error", "").startswith("not estimated: the estimate took")
            if name in pe["tried"] and not args.force and not (timed_out and ESTIMATE_TIMEOUT > args.timeout):
              continue
            if peer == "jax_flash" and c["window"]:
              continue
            if peer == "xla" and c["seq"] * c["heads"] >= 8192 * 2:
              pe["tried"][name] = {"error": XLA_TOO_BIG}
              pe["default"], pe["best"] = pe["tried"].get("default"), _best(pe)
              result_tables.save(table, args.out)
              continue
            if peer == "splash" and c["backward"] and gen == "v5e":
              pe["tried"][name] = {"error": SPLASH_BWD_V5E}
              pe["default"], pe["best"] = pe["tried"].get("default"), _best(pe)
              result_tables.save(table, args.out)
              continue
            t0 = time.time()
            r = estimate_isolated(peer, c, gen, blocks)
            r["wall_seconds"] = round(time.time() - t0, 1)
            r["date"] = datetime.date.today().isoformat()
            pe["tried"][name] = r
            pe["default"] = pe["tried"].get("default")
            pe["best"] = _best(pe)
            result_tables.save(table, args.out)
            what = (f"{r['us']:.1f} us, {100 * r['fraction_of_roofline']:.1f}% of roofline"
                    if "us" in r else r["error"][:160])
            print(f"[{time.time() - t_all:6.0f} s] {gen} {key} {peer} {name}: {what} "
                  f"({r['wall_seconds']} s)", flush=True)


# --- memory: temp HBM of the compiled program -----------------------------------------

MEM_OUT = os.path.join(ROOT, "kernels", "data", "attention_memory.json")


def memory_here(peer, s, bwd, gen="v5e", d=128, h=8):
  """``memory_analysis()`` of the compiled program (bytes) for a causal case of length ``s``."""
  fn, args = build(peer, case(s, d, True, bwd, heads=h), None)
  comp = kernels.compile_for_tpu(fn, *args, generation=gen)
  return {**comp.memory, "compile_seconds": round(comp.compile_seconds, 2)}


def run_memory(args):
  """Temp HBM of each peer's compiled program on v5e, S = 1k..16k (compiles only, no estimates)."""
  if os.environ.get("KERNELS_STATIC_PROFILE") != "0":  # the cost model makes compiles 10-20x slower
    env = dict(os.environ, KERNELS_STATIC_PROFILE="0")
    sys.exit(subprocess.run([sys.executable, os.path.abspath(__file__), *sys.argv[1:]], env=env).returncode)
  table = result_tables.load(MEM_OUT) or {
      "kind": "memory_analysis() of the program compiled for TPU v5e (kernels.compile_for_tpu), bytes",
      "shape": "batch 1, 8 heads, head_dim 128, bfloat16, causal; fwd = forward, fwdbwd = jax.vjp",
      "script": "tools/bench_attention.py --memory", "jax": jax.__version__, "results": {}}
  peers = [p for p in args.peers if p != "ours" or ours_available()]
  for bwd in (False, True):
    for peer in peers:
      for s in (1024, 2048, 4096, 8192, 16384):
        key = f"{'fwdbwd' if bwd else 'fwd'}/{peer}/{s}"
        if key in table["results"] and not args.force:
          continue
        try:
          r = memory_here(peer, s, bwd)
        except Exception as e:  # noqa: BLE001
          r = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        table["results"][key] = r
        result_tables.save(table, MEM_OUT)
        print(key, r, flush=True)


def main():
  global MAX_RSS_GB
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--one", help=argparse.SUPPRESS)
  p.add_argument("--generations", nargs="+", default=list(GENERATIONS))
  p.add_argument("--peers", nargs="+", default=list(PEERS))
  p.add_argument("--only", default="", help="'target' or comma-separated case keys")
  p.add_argument("--no-tune", dest="tune", action="store_false", help="defaults only")
  p.add_argument("--force", action="store_true")
  p.add_argument("--max-candidates", type=int, default=0, help="estimate at most this many block sizes per peer")
  p.add_argument("--no-peer-defaults", action="store_true",
                 help="skip JAX flash's and splash's default (128) blocks, estimate only their tuned ones")
  p.add_argument("--minutes", type=float, default=0, help="stop starting estimates after this many minutes")
  p.add_argument("--out", default=OUT)
  p.add_argument("--no-lock", action="store_true", help="do not take the lock: for a few short estimates "
                 "(under a minute each, the shared machine's rule), each stopped after --timeout seconds")
  p.add_argument("--timeout", type=float, default=75)
  p.add_argument("--max-rss-gb", type=float, default=MAX_RSS_GB, help="stop an estimating process that "
                 "takes more RAM than this (the default leaves room for other jobs)")
  p.add_argument("--hold-lock", action="store_true", help="take the heavy-work lock once for the whole run "
                 "(otherwise once per estimate); --minutes counts from when it is taken")
  p.add_argument("--memory", action="store_true", help="temp HBM of the compiled programs (no estimates)")
  p.add_argument("--rope", action="store_true", help="RoPE fused into the kernel against kernels.rope + the "
                 "kernel and XLA (stored under 'rope')")
  args = p.parse_args()
  MAX_RSS_GB = args.max_rss_gb
  if args.one:
    peer, c, gen, blocks = json.loads(args.one)
    try:
      r = estimate_here(peer, c, gen, blocks)
    except Exception as e:  # noqa: BLE001 - the parent stores the reason
      r = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
    print(json.dumps(r), flush=True)
    return
  if args.memory:
    run_memory(args)
    return
  global HOLDING_LOCK, ESTIMATE_TIMEOUT
  if args.no_lock:  # short estimates only: each is stopped after --timeout seconds
    HOLDING_LOCK, ESTIMATE_TIMEOUT = True, args.timeout
  if args.hold_lock:
    lk = open(LOCK, "a")
    fcntl.flock(lk, fcntl.LOCK_EX)
    HOLDING_LOCK = True
  args.deadline = time.time() + 60 * args.minutes if args.minutes else None
  if args.rope:
    run_rope(args)
    return
  run(args)


if __name__ == "__main__":
  main()
