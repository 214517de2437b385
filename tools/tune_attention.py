"""Tunes kernels.attention's default block sizes with the TPU compiler's cost model.

For each generation tuned (v5e and v6e by default) it estimates the forward of
``flash_attention`` (bf16, batch 1, head_dim 128, BHSD, no mask; 2 heads at S=8192)
at a few ``(block_q, block_kv)`` candidates, causal and not, and ranks them by the
geometric mean of the two; then, with that forward, the forward + backward
(``jax.vjp``, non-causal, 8 heads at S=4096: at S=8192 one estimate needs over 8 GB)
at a few ``(block_q_bwd, block_kv_bwd)`` candidates. Each pick is the smallest
blocks within 2% of the fastest. Every number is a **compiler estimate**
(``kernels.estimate_tpu``), never a measurement; each estimate runs in a child
process (libtpu's cost model can abort a process). Run it under the shared lock::

  flock /tmp/tpu-heavy.lock .venv/bin/python tools/tune_attention.py --force
  flock /tmp/tpu-heavy.lock .venv/bin/python tools/tune_attention.py --generations v6e --forward-only --force

(Until 2026-11-23 the causal estimates were not usable: libtpu's cost model evaluates a
scalar integer division as 0, and the kernel's block ranges were divisions, so the model
charged one kv block per causal q row. The kernel now uses products and shifts there.)

``--head-dim 64`` (or 256) tunes only the forward blocks at that head_dim (candidates
1024 x 1024 and 2048 x 2048, causal and not, S = 4096 and 8192, 2 heads, ranked by the
geometric mean of the four estimates) into the generation's ``by_head_dim`` entry, which
:func:`kernels.attention.api.default_block_sizes` uses for head dims nearest it::

  flock /tmp/tpu-heavy.lock .venv/bin/python tools/tune_attention.py --head-dim 64 --generations v6e v5e

Generations not tuned get derived entries: v5p uses v5e's blocks (same 128x128
MXUs; 64 MiB of VMEM is enough for them), v4 uses v5p's, shrunk until the kernel's
VMEM plan fits v4's 16 MiB. Results go to ``kernels/data/attention_blocks.json``
after every generation; existing entries are kept unless ``--force``.

Roofline FLOPs: forward ``4 * S^2 * D`` per head, halved for causal; forward +
backward counts the 7 ``S x S x D`` matmuls the kernels run (2 forward, 5 backward),
3.5x the forward.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import results as result_tables  # noqa: E402  (tools/results.py: the JSON tables)
import kernels  # noqa: E402  (first: enables the cost model before JAX loads libtpu)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from kernels.attention import api as att
from kernels.base import backend  # noqa: E402
from kernels.base.errors import KernelError  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels", "data",
                   "attention_blocks.json")
HEAD_DIM = 128
FWD_SEQ, FWD_HEADS = 8192, 2   # the targets' problem
BWD_SEQ, BWD_HEADS = 4096, 8   # same FLOPs; a fwd+bwd estimate at S=8192 needs over 8 GB
# Few candidates: a fwd+bwd estimate at S=4096 takes ~4 minutes on a 2-core host.
FWD_CANDIDATES = [(1024, 1024), (2048, 1024), (2048, 2048)]
BWD_CANDIDATES = [(512, 512), (1024, 1024)]


def _problem(seq, heads, causal, head_dim=HEAD_DIM):
  q = jax.ShapeDtypeStruct((1, heads, seq, head_dim), jnp.bfloat16)
  fwd_flops = 4 * seq * seq * head_dim * heads * (0.5 if causal else 1.0)
  return q, fwd_flops, 4 * q.size * 2


def program(seq, heads, blocks, backward, causal=False, head_dim=HEAD_DIM):
  """(function, argument specs, FLOPs, roofline bytes) of the program :func:`_estimate` estimates
  (``tools/refloor.py`` counts its HBM bytes)."""
  q, fwd_flops, nbytes = _problem(seq, heads, causal, head_dim)

  def f(q, k, v):
    return att.flash_attention(q, k, v, causal=causal, layout="BHSD", block_sizes=blocks)
  fn = f
  flops = fwd_flops
  if backward:
    fn = jax.grad(lambda q, k, v: f(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    flops = 3.5 * fwd_flops
  return fn, (q, q, q), flops, nbytes


def _estimate(gen, seq, heads, blocks, backward, causal=False, head_dim=HEAD_DIM):
  fn, args, flops, nbytes = program(seq, heads, blocks, backward, causal, head_dim)
  t0 = time.time()
  est = kernels.estimate_tpu(fn, *args, generation=gen, isolate=True, flops=flops, bytes_accessed=nbytes)
  row = {**est.record(), "wall_seconds": round(time.time() - t0)}
  print(f"  {gen} D={head_dim} S={seq} {'causal ' if causal else ''}{'fwd+bwd' if backward else 'fwd'} "
        f"{dataclasses.astuple(blocks)}: {row}", flush=True)
  return row


# A bigger block must be more than this much faster to be chosen (more VMEM, less to skip).
TIE = 0.02


def _pick(results, keys):
  """The smallest block (by area) within TIE of the fastest estimate."""
  fastest = min(e["us"] for _, e in results)
  near = [(b, e) for b, e in results if e["us"] <= (1 + TIE) * fastest]
  return min(near, key=lambda c: (c[0][keys[0]] * c[0][keys[1]], c[1]["us"]))


def tune(gen, old=None):
  """A table entry for ``gen``; with ``old`` (a stored entry), only the forward is retuned."""
  fwd = []
  for bq, bkv in FWD_CANDIDATES:
    blocks = att.BlockSizes(bq, bkv, 512, 512)
    try:
      full = _estimate(gen, FWD_SEQ, FWD_HEADS, blocks, False)
      causal = _estimate(gen, FWD_SEQ, FWD_HEADS, blocks, False, causal=True)
    except (RuntimeError, KernelError) as e:
      print(f"  {gen} fwd {(bq, bkv)} failed: {str(e)[:200]}", flush=True)
      continue
    score = {"us": round((full["us"] * causal["us"]) ** 0.5, 2), "non_causal": full, "causal": causal}
    fwd.append(({"block_q": bq, "block_kv": bkv}, score))
  best_fwd, best_fwd_est = _pick(fwd, ("block_q", "block_kv"))
  fwd_problem = {"batch": 1, "heads": FWD_HEADS, "head_dim": HEAD_DIM, "seq": FWD_SEQ, "causal": "both (geometric mean)",
                 "dtype": "bfloat16"}
  if old is not None:
    return {**old, **best_fwd, "forward_problem": fwd_problem, "forward": best_fwd_est,
            "forward_candidates": [dict(**b, **e) for b, e in fwd], "forward_tuned": datetime.date.today().isoformat()}
  bwd = []
  for bq, bkv in BWD_CANDIDATES:
    blocks = att.BlockSizes(best_fwd["block_q"], best_fwd["block_kv"], bq, bkv)
    try:
      bwd.append(({"block_q_bwd": bq, "block_kv_bwd": bkv}, _estimate(gen, BWD_SEQ, BWD_HEADS, blocks, True)))
    except (RuntimeError, KernelError) as e:
      print(f"  {gen} bwd {(bq, bkv)} failed: {str(e)[:200]}", flush=True)
  best_bwd, best_bwd_est = _pick(bwd, ("block_q_bwd", "block_kv_bwd"))
  return dict(**best_fwd, **best_bwd, forward_problem=fwd_problem,
              problem={"batch": 1, "heads": BWD_HEADS, "head_dim": HEAD_DIM, "seq": BWD_SEQ, "causal": False,
                       "dtype": "bfloat16"},
              forward=best_fwd_est, forward_backward=best_bwd_est,
              forward_candidates=[dict(**b, **e) for b, e in fwd],
              backward_candidates=[dict(**b, **e) for b, e in bwd],
              kind="compiler estimate", tuned=datetime.date.today().isoformat())


# Head dims other than 128 (issue 23): forward blocks only, tuned at both target lengths.
HEAD_DIM_SEQS = (4096, 8192)
HEAD_DIM_CANDIDATES = [(1024, 1024), (2048, 2048)]  # (2048, 1024) never led at head_dim 128


def tune_head_dim(gen, head_dim, deadline=None):
  """A ``by_head_dim`` entry: the forward blocks at ``head_dim``, ranked by the geometric mean of the
  causal and non-causal estimates at S = 4096 and 8192 (2 heads); the backward keeps the
  generation's blocks."""
  fwd = []
  for bq, bkv in HEAD_DIM_CANDIDATES:
    if deadline and time.time() > deadline:
      break
    blocks = att.BlockSizes(bq, bkv, 512, 512)
    score = {}
    try:
      for seq in HEAD_DIM_SEQS:
        for causal in (False, True):
          score[f"{'causal' if causal else 'non_causal'}_S{seq}"] = _estimate(gen, seq, FWD_HEADS, blocks, False,
                                                                             causal, head_dim)
    except (RuntimeError, KernelError) as e:
      print(f"  {gen} D={head_dim} fwd {(bq, bkv)} failed: {str(e)[:200]}", flush=True)
      continue
    prod = 1.0
    for r in score.values():
      prod *= r["us"]
    fwd.append(({"block_q": bq, "block_kv": bkv}, {"us": round(prod ** (1 / len(score)), 2), **score}))
  if not fwd:
    return None
  best, best_est = _pick(fwd, ("block_q", "block_kv"))
  return {**best, "forward_problem": {"batch": 1, "heads": FWD_HEADS, "head_dim": head_dim,
                                      "seq": list(HEAD_DIM_SEQS), "causal": "both (geometric mean over causal, "
                                      "non-causal and the sequence lengths)", "dtype": "bfloat16"},
          "forward": best_est, "forward_candidates": [dict(**b, **e) for b, e in fwd],
          "kind": "compiler estimate", "tuned": datetime.date.today().isoformat()}


def _fits(gen, blocks, backward, head_dim=HEAD_DIM):
  p = att._Problem(b=1, h=BWD_HEADS, kvh=BWD_HEADS, sq=8192, skv=8192, d=head_dim, dtype=jnp.dtype(jnp.bfloat16),
                   layout="BHSD", causal=True, window=None, softcap=None, scale=1.0, segments=False, mask_shape=None,
                   bias_shape=None, sinks=False, dropout_rate=0.0)
  try:
    with backend.target(gen):
      att._plan(p, blocks, backward=backward)
    return True
  except KernelError:
    return False


def derive(table):
  keys = ("block_q", "block_kv", "block_q_bwd", "block_kv_bwd")
  if "v5e" in table and "v5p" not in table:
    e = table["v5e"]["bfloat16"]
    table["v5p"] = {"bfloat16": {**{k: e[k] for k in keys}, "derived_from": "v5e (not tuned on v5p)"}}
  src = table.get("v5p", {}).get("bfloat16")
  if src and "v4" not in table:
    b = [src[k] for k in keys]
    while not _fits("v4", att.BlockSizes(*b), backward=False):   # forward and backward shrink apart
      b[0], b[1] = max(128, b[0] // 2), max(128, b[1] // 2)
    while not _fits("v4", att.BlockSizes(*b), backward=True):
      b[2], b[3] = max(128, b[2] // 2), max(128, b[3] // 2)
    table["v4"] = {"bfloat16": {**dict(zip(keys, b)), "derived_from": "v5p, shrunk to fit 16 MiB of VMEM"}}
  # the head_dim entries: v5p takes v5e's, v4 v5p's shrunk to fit
  for gen, src_gen in (("v5p", "v5e"), ("v4", "v5p")):
    dst = table.get(gen, {}).get("bfloat16")
    by_d = table.get(src_gen, {}).get("bfloat16", {}).get("by_head_dim", {})
    if not dst or "derived_from" not in dst or not by_d:
      continue
    dst["by_head_dim"] = {}
    for d, e in by_d.items():
      b = [e["block_q"], e["block_kv"], dst["block_q_bwd"], dst["block_kv_bwd"]]
      while gen == "v4" and not _fits("v4", att.BlockSizes(*b), backward=False, head_dim=int(d)):
        b[0], b[1] = max(128, b[0] // 2), max(128, b[1] // 2)
      dst["by_head_dim"][d] = {"block_q": b[0], "block_kv": b[1],
                               "derived_from": f"{src_gen}{', shrunk to fit 16 MiB of VMEM' if gen == 'v4' else ''}"}


def main():
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--generations", nargs="+", default=["v5e", "v6e"])
  ap.add_argument("--force", action="store_true")
  ap.add_argument("--forward-only", action="store_true", help="retune the forward blocks, keep the backward's")
  ap.add_argument("--head-dim", type=int, default=HEAD_DIM,
                  help="tune the forward blocks of this head_dim (64, 256) into the generation's by_head_dim")
  ap.add_argument("--minutes", type=float, default=0, help="start no candidate after this many minutes")
  args = ap.parse_args()
  table = result_tables.load(OUT).get("defaults", {})
  if args.head_dim != HEAD_DIM:
    deadline = time.time() + 60 * args.minutes if args.minutes else None
    for gen in args.generations:
      by_d = table[gen]["bfloat16"].setdefault("by_head_dim", {})
      if str(args.head_dim) in by_d and not args.force:
        print(f"{gen} D={args.head_dim}: already tuned (--force to redo)")
        continue
      entry = tune_head_dim(gen, args.head_dim, deadline)
      if entry is None:
        continue
      by_d[str(args.head_dim)] = entry
      by_d = dict(sorted(by_d.items(), key=lambda kv: int(kv[0])))
      table[gen]["bfloat16"]["by_head_dim"] = by_d
      derive(table)
      _save(table)
    return
  for gen in args.generations:
    if gen in table and "derived_from" not in table[gen].get("bfloat16", {}) and not args.force:
      print(f"{gen}: already tuned (--force to redo)")
      continue
    old = table.get(gen, {}).get("bfloat16") if args.forward_only else None
    table[gen] = {"bfloat16": tune(gen, old if old and "derived_from" not in old else None)}
    for g in ("v5p", "v4"):
      if g != gen and "derived_from" in table.get(g, {}).get("bfloat16", {}):
        del table[g]
    derive(table)
    _save(table)


def _save(table):
  data = {
      "description": "Default BlockSizes of kernels.attention per TPU generation (bfloat16; float32 with "
                     "head_dim > 128 halves them), tuned at head_dim 128; an entry's by_head_dim (64, 256) "
                     "overrides its forward blocks for those head dims. Chosen by tools/tune_attention.py from "
                     "compiler estimates (libtpu's static cost model via kernels.estimate_tpu) of the forward "
                     "and forward + backward at the problem stated in each entry: estimates, not measurements. "
                     "us is the floored compiler estimate: the cost model's time (model_us), never less than the "
                     "program's counted HBM bytes at the published bandwidth (floor_us).",
      "generated_by": "tools/tune_attention.py",
      "environment": {"jax": jax.__version__, "python": platform.python_version()},
      "defaults": dict(sorted(table.items())),
  }
  result_tables.save(data, OUT)
  print(f"wrote {OUT}", flush=True)


if __name__ == "__main__":
  main()
