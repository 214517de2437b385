"""Compiler estimates and compiled memory for the distributed notebook -> kernels/data/distributed_bench.json.

The cost model cannot time collectives (it charges them 0 cycles), so a multi-chip program's time is
built in the notebook from these per-chip compute estimates and the communication model of
:mod:`kernels.perf.ici`. This script records:

* ``ring``: one ring-attention step on one chip, floored compiler estimates: a visiting step
  (zig-zag: ``L`` queries against ``L / 2`` keys, or the reverse, the same FLOPs), forward (flash
  attention with its lse) and backward (:func:`kernels.attention.api.attention_block_grads`); at the
  target size also the diagonal step's forward (causal attention of the local ``L`` tokens) and the
  all-gathered baseline's busiest chip (its ``L`` queries against all ``n L`` keys, causal).
* ``matmul``: the collective matmul's pieces, one step ``[m, k] x [k, f]`` and the whole local
  product ``[n m, k] x [k, f]``.
* ``memory``: the compiled per-chip memory of ring attention (forward and backward) on the v5e 2x4
  topology against a single chip holding the whole sequence.

Usage: ``python tools/bench_distributed.py [--only ring|matmul|memory]`` (run the estimates under
``flock /tmp/tpu-heavy.lock nice -n 10``: each needs a few GB).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import kernels  # noqa: E402  (first: enables the cost model)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from kernels import distributed  # noqa: E402
from kernels.perf import tpu
from kernels.attention.api import attention_block_grads, flash_attention  # noqa: E402
from tools import results  # noqa: E402

OUT = os.path.join(os.path.dirname(__file__), "..", "kernels", "data", "distributed_bench.json")
GENERATIONS = ("v5e", "v6e")
N = 8                                # devices on the ring
HEADS, KV_HEADS, HEAD_DIM = 8, 8, 128
LOCALS = (16384, 4096)               # tokens per chip (the target case first)
# The cases the notebook reads (each estimate takes minutes): the step at both sizes, the whole
# forward (diagonal, visiting, all-gathered baseline) at the target size.
SLICE_HEADS = {16384: 1, 4096: 1}
# (The all-gathered baseline's busiest chip, 16k queries against 128k keys, is not estimated: even at
# one head its profile needs more than 17 GB. The notebook composes it from these blocks.)
NEEDED = {16384: ("diagonal forward", "visiting forward", "visiting backward"),
          4096: ("visiting forward", "visiting backward")}
MATMUL = (8192, 8192, 8192)          # the collective-matmul target: [M, K] x [K, F], x on rows, w on columns
MEMORY_LOCALS = (2048, 8192, 16384)


def _sds(*shape, dtype=jnp.bfloat16):
  return jax.ShapeDtypeStruct(shape, dtype)


def _attn_flops(q_len, kv_len, causal):
  pairs = q_len * kv_len / (2 if causal else 1)
  return 4 * pairs * HEAD_DIM * HEADS  # q k^T and p v


def _estimate(fn, args, generation, flops, scale=1):
  """The floored estimate's record; ``scale`` > 1: the program is a slice (heads) of the real one, whose
  times and bytes are ``scale`` times the slice's (heads are a parallel grid axis of the kernels)."""
  t0 = time.time()
  est = kernels.estimate_tpu(fn, *args, generation=generation, flops=flops, isolate=True)
  rec = est.record()
  if scale > 1:
    rec = {k: v * scale if k in ("us", "model_us", "floor_us", "hbm_bytes") else v for k, v in rec.items()}
    rec["scaled_from_heads"] = HEADS // scale
  print(f"  {generation}: {rec['us']:9.1f} us ({est.label}{f', x{scale} heads' if scale > 1 else ''}) "
        f"in {time.time() - t0:.0f} s", flush=True)
  return rec


def ring(table):
  for gen in GENERATIONS:
    for L in LOCALS:
      # The cost model's profile of an 8-head backward block needs more than 17 GB at 4k tokens: one head
      # (and one kv head) is estimated and scaled by 8, checked on the diagonal step (both stored).
      h = SLICE_HEADS.get(L, HEADS)
      scale = HEADS // h
      q, kv, kv_half = _sds(1, L, h, HEAD_DIM), _sds(1, L, h * KV_HEADS // HEADS, HEAD_DIM), \
          _sds(1, L // 2, h * KV_HEADS // HEADS, HEAD_DIM)
      lse = _sds(1, h, L, dtype=jnp.float32)
      cases = {
          "diagonal forward": (lambda q, k, v: flash_attention(q, k, v, causal=True, return_residuals=True),
                               (q, kv, kv), _attn_flops(L, L, True)),
          "diagonal backward": (lambda q, k, v, o, l, do: attention_block_grads(q, k, v, o, l, do, causal=True),
                                (q, kv, kv, q, lse, q), 2.5 * _attn_flops(L, L, True)),
          "visiting forward": (lambda q, k, v: flash_attention(q, k, v, return_residuals=True),
                               (q, kv_half, kv_half), _attn_flops(L, L // 2, False)),
          "visiting backward": (lambda q, k, v, o, l, do: attention_block_grads(q, k, v, o, l, do),
                                (q, kv_half, kv_half, q, lse, q), 2.5 * _attn_flops(L, L // 2, False)),
          # the all-gathered baseline: the last chip's L queries against all N * L keys
          "gathered busiest forward": (lambda q, k, v: flash_attention(q, k, v, causal=True, return_residuals=True),
                                       (q, _sds(1, N * L, kv.shape[2], HEAD_DIM), _sds(1, N * L, kv.shape[2], HEAD_DIM)),
                                       4 * HEAD_DIM * HEADS * (L * (N - 1) * L + L * L / 2)),
      }
      for name, (fn, args, flops) in cases.items():
        if name not in NEEDED[L]:
          continue
        key = f"{gen}/L{L}/{name}" + (f" (from {h} head)" if scale > 1 and name == "diagonal forward" else "")
        if key in table and "error" not in table[key]:  # a failed estimate is tried again
          continue
        print(key, flush=True)
        try:
          table[key] = _estimate(fn, args, gen, flops / scale, scale)
        except Exception as e:  # noqa: BLE001 - recorded, shown as missing
          table[key] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        results.save(table, OUT)


def matmul(table):
  M, K, F = MATMUL
  m, f = M // N, F // N
  for gen in GENERATIONS:
    for name, (rows, cols) in {"step": (m, f), "whole": (M, f)}.items():
      key = f"{gen}/matmul/{name}"
      if key in table:
        continue
      print(key, flush=True)
      table[key] = _estimate(lambda a, b: kernels.matmul(a, b), (_sds(rows, K), _sds(K, cols)), gen, 2 * rows * K * cols)
      results.save(table, OUT)


def _ring_grad(mesh, spec):
  fwd = jax.shard_map(lambda q, k, v: distributed.ring_attention(q, k, v, axis_name="x", causal=True), mesh=mesh,
                      in_specs=(spec,) * 3, out_specs=spec, check_vma=False)
  return fwd, jax.grad(lambda q, k, v: jnp.sum(fwd(q, k, v).astype(jnp.float32)), (0, 1, 2))


def memory(table):
  spec = P(None, "x")
  # against the device count: the same 64k-token sequence on 4 chips (v5e 2x2); 8 chips and one chip below
  key = "v5e/memory/S65536/n4"
  if key not in table:
    mesh = tpu.tpu_mesh("v5e:2x2")
    sh = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(mesh, spec))  # noqa: E731
    c = tpu.compile_for_tpu(_ring_grad(mesh, spec)[1], sh(1, 65536, HEADS, HEAD_DIM), sh(1, 65536, KV_HEADS, HEAD_DIM),
                            sh(1, 65536, KV_HEADS, HEAD_DIM), generation="v5e")
    table[key] = {"devices": 4, "local_tokens": 65536 // 4, "ring forward+backward": c.memory}
    print(key, {k: round(v / 2**20, 1) for k, v in c.memory.items()}, "MiB", flush=True)
    results.save(table, OUT)
  mesh = tpu.tpu_mesh("v5e:2x4")
  for L in MEMORY_LOCALS:
    key = f"v5e/memory/L{L}"
    if key in table:
      continue
    sh = lambda *s: jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(mesh, spec))  # noqa: E731
    q, kv = sh(1, N * L, HEADS, HEAD_DIM), sh(1, N * L, KV_HEADS, HEAD_DIM)
    fwd, grad = _ring_grad(mesh, spec)
    rec = {"devices": N, "local_tokens": L}
    for name, fn in (("ring forward", fwd), ("ring forward+backward", grad)):
      c = tpu.compile_for_tpu(fn, q, kv, kv, generation="v5e")
      rec[name] = c.memory
      print(key, name, {k: round(v / 2**20, 1) for k, v in c.memory.items()}, "MiB", flush=True)
    single = lambda q, k, v: flash_attention(q, k, v, causal=True)  # noqa: E731
    sq, skv = _sds(1, N * L, HEADS, HEAD_DIM), _sds(1, N * L, KV_HEADS, HEAD_DIM)
    for name, fn in (("one chip forward", single),
                     ("one chip forward+backward", jax.grad(lambda q, k, v: jnp.sum(single(q, k, v).astype(
                         jnp.float32)), (0, 1, 2)))):
      c = tpu.compile_for_tpu(fn, sq, skv, skv, generation="v5e", profile=False)
      rec[name] = c.memory
      print(key, name, {k: round(v / 2**20, 1) for k, v in c.memory.items()}, "MiB", flush=True)
    table[key] = rec
    results.save(table, OUT)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--only", choices=("ring", "matmul", "memory"))
  args = ap.parse_args()
  table = results.load(OUT)
  table["_config"] = {"devices": N, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": "bfloat16",
                      "matmul": MATMUL, "jax": jax.__version__}
  for part in (memory, matmul, ring):
    if args.only in (None, part.__name__):
      part(table)
  results.save(table, OUT)


if __name__ == "__main__":
  main()
