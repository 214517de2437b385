"""Benchmarks the whole MoE layer (kernels.moe) three ways, with the TPU compiler's cost model.

Every number is a **compiler estimate** (``kernels.estimate_tpu``, libtpu's static cost
model, floored: never less than the program's counted HBM bytes at the published
bandwidth), never a measurement, stored with :meth:`kernels.perf.tpu.Estimate.record` in
``kernels/data/moe_bench.json``.

The layer (SwiGLU, bf16, router f32) is built three ways, with the same routing code
(:func:`kernels.experts.layer.route`, its cost included) and the same permutation, activation and
combine (:func:`kernels.experts.layer._expert_layer`):

* ``ours``: the two grouped matmuls on :func:`kernels.experts.grouped.gmm`'s kernel, dropless, with the activation
  product and its backward inside them (:func:`kernels.experts.layer._experts`; the others run the product apart);
* ``megablox``: the same layer on ``jax.experimental.pallas.ops.tpu.megablox.gmm``
  (its custom VJP), at its default tiling ``(128, 128, 128)`` (``megablox``) and at a
  large tiling ``(512, 1024, 1024)`` clipped to each matmul (``megablox_large``);
* ``dense``: GShard's dense capacity layout at capacity factor 1.25, with the tokens in
  groups of 2048 (``DENSE_GROUP``), each with its own capacity: one-hot dispatch and combine
  tensors ``[groups, 2048, experts * capacity]`` and ``einsum`` for everything.

*Group sizes seen by the cost model.* libtpu's cost model reads scalar-prefetched values
as 0, and both ``gmm`` and megablox scalar-prefetch their group tables. ``ours`` is
therefore estimated with :func:`kernels.experts.grouped.gmm_static_groups` (the same kernel with
the visit tables built from the benchmark's group sizes as constants; see
``kernels/gmm.py``), fed the case's group sizes (balanced: ``tokens * top_k / experts``
each; skewed: the issue's ``[4096, 2048, ..., 64]`` times ``top_k``). The router still
runs on the random inputs, its cost is included, but the grouped matmuls see the
constant sizes. megablox computes its tables and its grid length at run time; the model
cannot know a run-time grid length and charges a fixed number of steps, so megablox gets
its metadata from the same constant sizes, computed by its own code at trace time
(``tools/peers.py``; ``method`` says so). Its tables still read as 0, so each of its
kernels is charged at least its compulsory bytes. The dense layer has no data-dependent
control flow.

*Permutations.* The layer permutes tokens by two XLA row gathers (a plain ``x[idx]``).
libtpu's v5e cost model aborts the process on them, and on v6e the compile with the cost
model's profiling flag fails next to our ``gmm`` (it reserves 127 MiB of VMEM for
temporaries beside the gather, so the kernel's window no longer fits; the same program
compiles without the flag). So every layer is estimated with the gathers replaced by
contiguous copies of the same bytes (``jnp.repeat`` of ``x`` ``top_k`` times, and a flip
of the rows), and their gradients by the copies' own (``permutation: "copy"``), on both
generations and for every implementation. ``--permutation gather`` estimates the layer
as written, and ``--compare-permutations`` estimates both where the gather compiles, which
checks the stand-in (``permutation_check`` in the file). megablox's own group-table code
also contains gathers, so megablox cannot be estimated whole on v5e; in pieces, an XLA
piece whose profile aborts is charged its bytes, and the record is then a lower bound
(``valid`` False, the piece named in ``unmodeled``).

*Pieces.* libtpu's profiled compile fails on VMEM whenever our ``gmm`` shares a program
with XLA work that uses VMEM (a sort, a top-k, a gather), though the plain compile passes.
``--pieces`` estimates a grouped layer with :func:`kernels.estimate_tpu_pieces`: cut at its
Pallas kernels, each kernel alone and the XLA ops between two kernels as one program, the
floored estimates added (``pieces`` in the record lists them). With the gathers in pieces
of their own, the v6e layer can be estimated as written (``--permutation gather``). The
dense layer has no Pallas kernel: in pieces it is cut at its einsums of 1e10 FLOPs or more
(``dots_above``), the dispatch, expert and combine einsums, each estimated alone. Each
piece is estimated in a child process of its own.
``--pieces-check`` estimates stored whole-layer records in pieces (``pieces_check``).

*Size.* A child process estimates each program under ``flock /tmp/tpu-heavy.lock`` and
is stopped above ``--max-rss-gb`` (8). When the full layer does not fit, the program
is estimated at two slices of the experts' hidden width ``f`` (``f/8`` and ``f/4``; ``--f-slices``,
or ``--slice-widths`` for widths that every kernel tiles as it tiles the full ``f``, e.g.
2048 and 3072 at E=8) and extrapolated linearly in ``f`` (every matmul's FLOPs and every
weight's bytes are linear in ``f``; routing, permutations and combine do not depend on
it); such records carry ``"scaled": "linear in f from ..."``, naming the slices. A slice
runs the kernels the full width runs (``_fuses_backward``).

Run::

  flock /tmp/tpu-heavy.lock nice -n 10 python tools/bench_moe.py            # everything missing
  flock /tmp/tpu-heavy.lock nice -n 10 python tools/bench_moe.py --cases E8_top2 --impls ours --force
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import peers  # noqa: E402  (tools/peers.py: megablox with its real grid)
import results as result_tables  # noqa: E402  (tools/results.py: the JSON tables)
import kernels  # noqa: E402  (first: enables the cost model before JAX loads libtpu)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from kernels.base.backend import target  # noqa: E402

from kernels.experts import layer as moe_mod

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "kernels", "data")
OUT = os.path.join(DATA, "moe_bench.json")

CASES = {
    "E8_top2": dict(tokens=8192, d=4096, f=14336, experts=8, top_k=2),      # Mixtral-8x7B's shape
    "E64_top8": dict(tokens=8192, d=2048, f=1408, experts=64, top_k=8),     # fine-grained (OLMoE / DeepSeek-like)
}
SKEW = (4096, 2048, 1024, 512, 256, 128, 64, 64)
GENERATIONS = ("v5e", "v6e")
IMPLS = ("ours", "megablox", "megablox_large", "dense")
MODES = ("fwd", "fwdbwd")
CAPACITY = 1.25
MEGABLOX_LARGE = (512, 1024, 1024)
MAX_RSS_GB = 8.0
V5E_MEGABLOX = ("not estimated: libtpu's v5e cost model aborts the process on megablox's layer (its group-table "
                "code gathers; seen at 512 tokens, d=256, f=512, E=8, forward and forward+backward), so it is not "
                "attempted whole (--pieces charges such a piece its bytes)")
TIMEOUT = 1800


def _case(cfg) -> dict:
  """The case's sizes, with a slice's ``f`` or ``tokens`` (see :func:`estimate`)."""
  c = CASES[cfg["case"]]
  return dict(c, f=cfg.get("f", c["f"]), tokens=cfg.get("tokens", c["tokens"]))


def group_sizes(case: dict, groups: str) -> np.ndarray:
  n, e = case["tokens"] * case["top_k"], case["experts"]
  if groups == "balanced":
    return np.full((e,), n // e, np.int32)
  assert e == len(SKEW) and sum(SKEW) * case["top_k"] == n, (case, groups)
  return np.asarray(SKEW, np.int32) * case["top_k"]


def flops(case: dict, mode: str) -> float:
  """The FLOPs actually needed: three ``[d, f]`` matmuls per kept assignment (``2 * tokens * top_k * d * 3f``);
  the backward twice that (activations and weights)."""
  fwd = 2.0 * case["tokens"] * case["top_k"] * case["d"] * 3 * case["f"]
  return fwd if mode == "fwd" else 3 * fwd


def bytes_needed(case: dict, mode: str) -> float:
  """Compulsory HBM bytes (bf16): the weights and x read, y written; with the backward, dy read and dx and
  the weight gradients written too."""
  w = 3 * case["experts"] * case["d"] * case["f"] * 2
  act = case["tokens"] * case["d"] * 2
  return w + 2 * act if mode == "fwd" else 2 * w + 4 * act


# --- the three layers ------------------------------------------------------------------


def _megablox_gmm(tiling):
  from jax.experimental.pallas.ops.tpu.megablox import ops as mb

  def grouped(gs):
    def run(lhs, rhs):
      m, k = lhs.shape
      n = rhs.shape[2]
      t = tuple(min(a, b) for a, b in zip(tiling, (m, k, n)))
      return mb.gmm(lhs, rhs, gs, lhs.dtype, t)
    return moe_mod._mlp_of(run)  # the activation product between its two gmms, as the layer's own would run apart
  return grouped


def _ours_gmm(static_sizes, blocks=None, fuse_backward=True):
  """Our layer's experts (:func:`kernels.experts.layer._experts`) with the group sizes as constants.
  ``fuse_backward=False``: the activation product's backward as a kernel of its own, as
  ``_experts`` runs it where its fused plan does not fit; a slice of ``f`` must run the
  kernels the full width runs (:func:`_fuses_backward`)."""
  from kernels.experts.grouped import GmmBlockSizes, gmm_static_groups
  bs = GmmBlockSizes(*blocks) if blocks else None
  if bs is not None:  # the custom VJP's gmm and tgmm take the defaults: make these blocks the defaults too
    from kernels.experts import grouped as gm
    gm.default_block_sizes = lambda generation=None, kernel="gmm": bs

  def grouped(gs):
    del gs  # the cost model sees the case's sizes as constants (see the module docstring)

    def run(xs, w_gate_up, w_down, activation):
      kw = dict(block_sizes=bs, implementation="pallas", interpret=False,
                static_sizes=tuple(int(v) for v in static_sizes))
      sizes = jnp.asarray(static_sizes, jnp.int32)
      if fuse_backward:
        return moe_mod._experts(xs, w_gate_up, w_down, sizes, activation, **kw)
      act = moe_mod._gate_up(xs, w_gate_up, sizes, activation, **kw)
      return gmm_static_groups(act, w_down, static_sizes, block_sizes=bs)
    return run
  return grouped


def _fuses_backward(cfg) -> bool:
  """Whether our layer at the case's full size runs the activation product's backward inside
  its grouped matmul (kernels.experts.layer._glu_bwd_plan), on the record's generation."""
  case = CASES[cfg["case"]]
  with target(kernels.get_chip(cfg["generation"])):
    return moe_mod._glu_bwd_plan(case["tokens"] * case["top_k"], case["d"], case["f"], case["experts"],
                                 jnp.bfloat16) is not None


def grouped_layer(case, make_grouped):
  k = case["top_k"]

  def layer(x, rw, w_gate_up, w_down):
    r = moe_mod.route(x, rw, top_k=k)
    y = moe_mod._expert_layer(x, r, w_gate_up, w_down, "silu", make_grouped(r.group_sizes))
    return y, r.load_balancing_loss + r.z_loss
  return layer


DENSE_GROUP = 2048  # tokens per capacity group of the dense layer (a sequence's worth, as in MaxText)


def dense_layer(case, capacity_factor=CAPACITY, group=DENSE_GROUP):
  """GShard's dense capacity layout: the tokens in groups of ``group``, each group routed with
  its own capacity (as GShard and MaxText's dense path do: the one-hot dispatch and combine
  tensors are ``[groups, group, experts * capacity]``, so their einsums cost ``group / tokens``
  of one group of all tokens), then einsums for everything."""
  k, e, t = case["top_k"], case["experts"], case["tokens"]
  g = min(group, t)
  if t % g:
    raise ValueError(f"tokens {t} is not a multiple of the dense layer's group {g}")
  cap = moe_mod.expert_capacity(g, e, k, capacity_factor)

  def layer(x, rw, w_gate_up, w_down):
    d, n_groups = x.shape[1], t // g
    r = jax.vmap(lambda xg: moe_mod.route(xg, rw, top_k=k, capacity_factor=capacity_factor))(x.reshape(n_groups, g, d))
    starts = jnp.cumsum(r.group_sizes, axis=-1) - r.group_sizes                       # [G, e]
    slot = r.position - jnp.take_along_axis(starts, r.expert_ids.reshape(n_groups, -1), 1).reshape(r.position.shape)
    col = jnp.where(r.dropped, e * cap, r.expert_ids * cap + slot)                      # [G, g, k]; e * cap: dropped
    onehot = jax.nn.one_hot(col, e * cap, dtype=x.dtype)                                # [G, g, k, e * cap]
    dispatch = jnp.sum(onehot, axis=2)                                                  # [G, g, e * cap]
    combine = jnp.einsum("Gtkx,Gtk->Gtx", onehot, r.weights.astype(x.dtype))
    xe = jnp.einsum("Gtx,Gtd->Gxd", dispatch, x.reshape(n_groups, g, d))
    xe = xe.reshape(n_groups, e, cap, d).transpose(1, 0, 2, 3).reshape(e, n_groups * cap, d)
    h = jnp.einsum("ecd,edf->ecf", xe, w_gate_up)
    # XLA's activation backward, not kernels.moe's kernel: wired into this [experts, capacity, 2f]
    # layout (flattened to rows), the kernel made this layer slower in pieces (v6e, E8: the forward's
    # piece around the activation grew by more than the backward's shrank).
    f = w_gate_up.shape[2] // 2
    a = (jax.nn.silu(h[..., :f].astype(jnp.float32)) * h[..., f:].astype(jnp.float32)).astype(x.dtype)
    ye = jnp.einsum("ecf,efd->ecd", a, w_down)
    ye = ye.reshape(e, n_groups, cap, d).transpose(1, 0, 2, 3).reshape(n_groups, e * cap, d)
    y = jnp.einsum("Gtx,Gxd->Gtd", combine, ye).reshape(t, d)
    return y, jnp.mean(r.load_balancing_loss + r.z_loss)
  return layer


PERMUTATION = "copy"  # --permutation: the stand-ins (see the module docstring), or "gather" as written


def permutation(cfg) -> str:
  return cfg.get("permutation") or PERMUTATION


def _copy_standins():
  """Replaces the layer's two row gathers by contiguous copies of the same bytes (see the module docstring)."""
  moe_mod._dispatch = lambda x, order, position, top_k: jnp.repeat(x, top_k, axis=0)   # reads x, writes N rows
  moe_mod._combine = lambda ys, w, order, position: jnp.einsum(                           # reads and writes N rows,
      "tkd,tk->td", jnp.flip(ys, axis=0).reshape(*w.shape, -1).astype(jnp.float32),        # then the weighted sum
      w.astype(jnp.float32)).astype(ys.dtype)


def _grouped(cfg, gs):
  impl = cfg["impl"]
  if impl == "ours":
    return _ours_gmm(gs, cfg.get("blocks"), fuse_backward=_fuses_backward(cfg))
  peers.megablox_with_known_groups(gs)  # its real grid (tools/peers.py)
  return _megablox_gmm((128, 128, 128) if impl == "megablox" else MEGABLOX_LARGE)


PARTS = ("routing", "experts")
PIECES = result_tables.PIECES
DENSE_PIECES = ("sum of pieces cut at the einsums of 1e10 FLOPs or more (kernels.estimate_tpu_pieces, dots_above), "
                "each estimated and floored alone")
DENSE_DOTS_ABOVE = 1e10  # the dense layer's dispatch, expert and combine einsums; not its router


def part_program(cfg):
  """One of the two halves of a grouped layer (``cfg["part"]``), forward or forward + backward:
  ``routing`` (:func:`kernels.experts.layer.route`: router matmul, softmax, top-k, sort; its backward
  from the combine weights' and the losses' cotangents) and ``experts`` (the layer after
  routing, with the routing as inputs; its backward to ``x``, the combine weights and both
  weights). A TPU runs a program's ops one after another, so the two estimates add up to
  the layer's, apart from the routing outputs' one extra HBM round trip."""
  case = _case(cfg)
  if permutation(cfg) == "copy":
    _copy_standins()
  k = case["top_k"]
  t, d, e, f = case["tokens"], case["d"], case["experts"], case["f"]
  sds, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
  x, rw = sds((t, d), bf16), sds((d, e), jnp.float32)
  route = lambda x, rw: moe_mod.route(x, rw, top_k=k)  # noqa: E731
  if cfg["part"] == "routing":
    if cfg["mode"] == "fwd":
      return route, [x, rw]

    def routing_fb(x, rw, dweights):
      def loss(x, rw):
        r = route(x, rw)
        return jnp.sum(r.weights * dweights) + r.load_balancing_loss + r.z_loss, r
      return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, rw)
    return routing_fb, [x, rw, sds((t, k), jnp.float32)]
  # The routing goes in as a tuple of its arrays (the estimator exports programs, and a
  # Routing is not a serializable pytree).
  fields = [fl.name for fl in dataclasses.fields(moe_mod.Routing)]
  r = jax.eval_shape(route, x, rw)
  r_in = tuple(getattr(r, name) for name in fields)
  grouped = _grouped(cfg, group_sizes(case, cfg["groups"]))
  w = [sds((e, d, 2 * f), bf16), sds((e, f, d), bf16)]

  def experts(x, r_arrays, wgu, wd, **replace):
    r = moe_mod.Routing(**dict(zip(fields, r_arrays), **replace))
    return moe_mod._expert_layer(x, r, wgu, wd, "silu", grouped(r.group_sizes))
  if cfg["mode"] == "fwd":
    return experts, [x, r_in, *w]

  def experts_fb(x, r_arrays, wgu, wd, dy):
    def loss(x, weights, wgu, wd):
      y = experts(x, r_arrays, wgu, wd, weights=weights)
      return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))
    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(x, r_arrays[fields.index("weights")], wgu, wd)
  return experts_fb, [x, r_in, *w, sds((t, d), bf16)]


def program(cfg):
  if cfg.get("part"):
    return part_program(cfg)
  case = _case(cfg)
  if permutation(cfg) == "copy":
    _copy_standins()
  gs = group_sizes(case, cfg["groups"])
  layer = dense_layer(case) if cfg["impl"] == "dense" else grouped_layer(case, _grouped(cfg, gs))
  t, d, e, f = case["tokens"], case["d"], case["experts"], case["f"]
  sds, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
  args = [sds((t, d), bf16), sds((d, e), jnp.float32), sds((e, d, 2 * f), bf16), sds((e, f, d), bf16)]
  if cfg["mode"] == "fwd":
    return (lambda *a: layer(*a)[0]), args

  def loss(x, rw, wgu, wd, dy):
    y, aux = layer(x, rw, wgu, wd)
    return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)) + aux
  return jax.value_and_grad(loss, argnums=(0, 1, 2, 3)), args + [sds((t, d), bf16)]


def estimate_here(cfg) -> dict:
  fn, args = program(cfg)
  case = _case(cfg)
  whole = not cfg.get("part")
  # In pieces, each piece is estimated in a child process of its own, so that the memory of
  # one piece's profile is returned before the next (in one process E=64 reached 13 GB). The
  # dense layer, which has no Pallas kernel, is cut at its large einsums instead.
  estimator = (functools.partial(kernels.estimate_tpu_pieces, isolate=True,
                                 dots_above=DENSE_DOTS_ABOVE if cfg["impl"] == "dense" else None)
               if cfg.get("in_pieces") else kernels.estimate_tpu)
  e = estimator(fn, *args, generation=cfg["generation"], flops=flops(case, cfg["mode"]) if whole else None,
                bytes_accessed=bytes_needed(case, cfg["mode"]) if whole else None)
  r = e.record()
  r.update(compile_seconds=round(e.compile_seconds, 1))
  return r


def estimate_split(cfg, max_rss_gb) -> dict:
  """The layer as the sum of its two halves' floored estimates (see :func:`part_program`)."""
  parts = {p: estimate_isolated(dict(cfg, part=p), max_rss_gb) for p in PARTS}
  if not all("us" in r for r in parts.values()):
    return {"error": "split: " + "; ".join(f"{p}: {r.get('error', 'ok')}" for p, r in parts.items()), "parts": parts}
  out = {key: round(sum(r[key] for r in parts.values()), 3) for key in ("us", "model_us", "floor_us")}
  out["hbm_bytes"] = sum(r["hbm_bytes"] for r in parts.values())
  out["valid"] = all(r.get("valid", True) for r in parts.values())
  unmodeled = [u for r in parts.values() for u in r.get("unmodeled", [])]
  if unmodeled:
    out["unmodeled"] = unmodeled
  case = CASES[cfg["case"]]
  rl = kernels.roofline_of(flops(case, cfg["mode"]), bytes_needed(case, cfg["mode"]),
                           kernels.get_chip(cfg["generation"]), "bfloat16")
  out["fraction_of_roofline"] = round(rl.seconds / (out["us"] * 1e-6), 4)
  out["valid"] = out["valid"] and out["fraction_of_roofline"] <= 1.0
  out["split"] = "sum of the routing and experts halves, each estimated whole"
  out["parts"] = parts
  return out


def estimate_isolated(cfg, max_rss_gb) -> dict:
  """:func:`estimate_here` in a child process, stopped above ``max_rss_gb`` of RAM or after TIMEOUT."""
  cmd = [sys.executable, os.path.abspath(__file__), "one", json.dumps(cfg)]
  with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
    proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
    t0, peak = time.time(), 0.0
    while proc.poll() is None:
      time.sleep(1)
      peak = max(peak, result_tables.rss_gb(proc.pid))
      if peak > max_rss_gb or time.time() - t0 > TIMEOUT:
        result_tables.kill_tree(proc)
        return {"error": (f"exceeded {max_rss_gb:g} GB of RAM" if peak > max_rss_gb
                          else f"took longer than {TIMEOUT} s"), "peak_rss_gb": round(peak, 1)}
    out.seek(0)
    err.seek(0)
    stdout, stderr = out.read(), err.read()
  lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
  if not lines:
    tail = [ln for ln in stderr.splitlines() if ln.startswith("F") or "Error" in ln]
    return {"error": "the compiler or its cost model failed: " + (tail[-1][:300] if tail else f"exit {proc.returncode}")}
  r = json.loads(lines[-1])
  r["peak_rss_gb"] = round(peak, 1)
  return r


F_SLICES = (8, 4)  # --f-slices: the divisors of f of the two slices
SLICE_WIDTHS = None  # --slice-widths: the two slices' sizes instead (e.g. 2048 3072: multiples of every tile)
SLICE_DIM = "f"    # --slice-dim: "f", or "tokens" (for the dense layer, whose one-hot tensors do not shrink with f)


def estimate(cfg, max_rss_gb, skip_full=False) -> dict:
  """The full program, else linear in ``SLICE_DIM`` (``f``, or ``tokens``) from two slices of it,
  ``1 / F_SLICES[i]`` of the full size (``skip_full``: the slices only). Every cost is linear
  in ``f``; in ``tokens`` every cost but the weights' bytes is linear (routing's sort aside,
  and the dense layer's capacity groups are whole at these slices), and the weights' bytes
  are the line's intercept."""
  one = estimate_split if cfg.get("split") else estimate_isolated
  r = ({"error": "the full program was not attempted (--skip-full: it had exceeded the RAM limit before)"}
       if skip_full else one(cfg, max_rss_gb))
  if "us" in r or not (skip_full or "RAM" in r.get("error", "")):
    return r
  dim = SLICE_DIM
  full = CASES[cfg["case"]][dim]
  s1, s2 = F_SLICES
  assert full % s1 == 0 and full % s2 == 0 and s1 > s2, F_SLICES
  x1, x2 = SLICE_WIDTHS or (full // s1, full // s2)
  assert 0 < x1 < x2 < full, (x1, x2)
  if dim == "tokens" and cfg["impl"] == "dense":
    assert x1 % DENSE_GROUP == 0 and x2 % DENSE_GROUP == 0, "a tokens slice must hold whole capacity groups"
  parts = [one(dict(cfg, **{dim: x}), max_rss_gb) for x in (x1, x2)]
  if not all("us" in p for p in parts):
    return {"error": f"full size: {r['error']}; slices: " + "; ".join(p.get("error", "ok") for p in parts)}
  named = (f"{dim}={x1} and {dim}={x2}" if SLICE_WIDTHS else f"{dim}/{s1} and {dim}/{s2}")
  out = {"scaled": f"linear in {dim} from {named} (" + (
             "the full program was not attempted: it had exceeded the RAM limit before" if skip_full
             else "the full program exceeded the RAM limit") + ")",
         "slices": {f"{dim}={x}": p for x, p in zip((x1, x2), parts)}}
  for key in ("us", "model_us", "floor_us", "hbm_bytes"):
    a, b = parts[0][key], parts[1][key]          # the line through the two slices, at the full size
    out[key] = round(a + (b - a) * (full - x1) / (x2 - x1), 3)
  out["floored"] = out["floor_us"] >= out["model_us"]
  out["valid"] = all(p.get("valid", False) for p in parts)
  case = CASES[cfg["case"]]
  chip = kernels.get_chip(cfg["generation"])
  rl = kernels.roofline_of(flops(case, cfg["mode"]), bytes_needed(case, cfg["mode"]), chip, "bfloat16")
  out["fraction_of_roofline"] = round(rl.seconds / (out["us"] * 1e-6), 4)
  return out


def method(impl: str) -> str:
  return {"ours": "gmm_static_groups: the case's group sizes as compile-time constants",
          "megablox": peers.METHOD,
          "megablox_large": peers.METHOD,
          "dense": "no data-dependent control flow"}[impl]


def bench(args):
  table = result_tables.load(OUT) or {}
  table.update({
      "description": (
          "The whole SwiGLU MoE layer (bf16; router f32) forward and forward+backward, built three ways on the same "
          "routing code: ours (kernels.gmm), megablox gmm (default tiling 128x128x128; and 512x1024x1024 clipped, "
          "'megablox_large'), and GShard's dense capacity einsum (capacity factor 1.25, tokens in groups of 2048). Compiler estimates (libtpu's "
          "static cost model), not measurements: us is the floored estimate (never less than the program's counted "
          "HBM bytes at the published bandwidth). Each record's 'method' says what group sizes the cost model saw. "
          "fraction_of_roofline: the FLOPs actually needed (2 * tokens * top_k * d * 3f, x3 with the backward) and "
          "compulsory bytes at the chip's peak, over us."),
      "generated_by": "tools/bench_moe.py", "kind": "compiler estimate (floored)",
      "environment": {"jax": jax.__version__, "python": platform.python_version()},
      "cases": CASES, "skewed_group_sizes_top1": list(SKEW), "capacity_factor": CAPACITY})
  results = table.setdefault("results", {})
  for gen in args.generations:
    for case in args.cases:
      for groups in args.groups:
        if groups == "skewed" and CASES[case]["experts"] != len(SKEW):
          continue
        for impl in args.impls:
          for mode in args.modes:
            key = f"{gen}/{case}/{groups}/{impl}/{mode}"
            if args.pieces:
              key += "/pieces"  # beside the whole-program record of the same layer, if any
            if args.split_check:  # the split against a stored whole-layer estimate
              whole = results.get(key, {})
              if "us" in whole and not whole.get("split") and impl != "dense":
                c = estimate_split(dict(whole, split=True), args.max_rss_gb)
                table.setdefault("split_check", {})[key] = {"whole_us": whole["us"], "split_us": c.get("us"),
                                                            "error": c.get("error")}
                print(key, "whole", whole["us"], "split", c.get("us"), c.get("error", ""), flush=True)
                result_tables.save(table, OUT)
              continue
            if args.pieces_check:  # the sum of pieces against a stored whole-layer estimate
              whole = results.get(key, {})
              if "us" in whole and not whole.get("split") and not whole.get("in_pieces") and impl != "dense":
                cfg = {k: whole[k] for k in ("generation", "case", "groups", "impl", "mode", "permutation")}
                c = estimate_isolated(dict(cfg, in_pieces=True), args.max_rss_gb)
                table.setdefault("pieces_check", {})[key] = {"whole_us": whole["us"], "pieces_us": c.get("us"),
                                                             "error": c.get("error"), "pieces": c.get("pieces")}
                print(key, "whole", whole["us"], "pieces", c.get("us"), c.get("error", ""), flush=True)
                result_tables.save(table, OUT)
              continue
            if key in results and "us" in results[key] and not args.force:
              continue
            cfg = dict(generation=gen, case=case, groups=groups, impl=impl, mode=mode)
            cfg["permutation"] = permutation(cfg)
            if impl == "ours" and args.ours_blocks:
              cfg["blocks"] = list(args.ours_blocks)
            t0 = time.time()
            if gen == "v5e" and impl.startswith("megablox") and not args.pieces:
              r = {"error": V5E_MEGABLOX}
            else:
              if args.split and impl != "dense":
                cfg["split"] = True
              if args.pieces:
                cfg["in_pieces"] = True
              r = estimate(cfg, args.max_rss_gb, args.skip_full)
            r = result_tables.physical(r)
            r.update(cfg, method=method(impl), date=datetime.date.today().isoformat())
            if cfg.get("blocks"):
              r["method"] += f"; blocks {tuple(cfg['blocks'])}, not the defaults"
            if cfg.get("in_pieces"):
              r["method"] += "; " + (DENSE_PIECES if impl == "dense" else PIECES)
            results[key] = r
            print(key, r.get("us"), r.get("error", ""), f"{time.time() - t0:.0f}s", flush=True)
            result_tables.save(table, OUT)
            if args.compare_permutations and cfg["permutation"] == "gather" and impl != "dense":
              check = dict(cfg, permutation="copy")
              c = estimate(check, args.max_rss_gb)
              c.update(check)
              table.setdefault("permutation_check", {})[key] = {
                  "gather_us": r.get("us"), "copy_us": c.get("us"), "error": c.get("error")}
              print(key, "copy stand-in:", c.get("us"), c.get("error", ""), flush=True)
              result_tables.save(table, OUT)


def main(argv=None):
  global TIMEOUT, F_SLICES, SLICE_WIDTHS, PERMUTATION, SLICE_DIM
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("job", choices=("bench", "one"), nargs="?", default="bench")
  ap.add_argument("config", nargs="?", help="(one) a JSON configuration, used internally")
  ap.add_argument("--generations", nargs="*", default=list(GENERATIONS))
  ap.add_argument("--cases", nargs="*", default=list(CASES))
  ap.add_argument("--groups", nargs="*", default=["balanced", "skewed"])
  ap.add_argument("--impls", nargs="*", default=list(IMPLS))
  ap.add_argument("--modes", nargs="*", default=list(MODES))
  ap.add_argument("--max-rss-gb", type=float, default=MAX_RSS_GB)
  ap.add_argument("--force", action="store_true")
  ap.add_argument("--timeout", type=float, default=TIMEOUT, help="seconds per estimate")
  ap.add_argument("--skip-full", action="store_true",
                  help="go straight to the f/8 and f/4 slices (for programs whose full size exceeded the RAM limit)")
  ap.add_argument("--slice-dim", choices=("f", "tokens"), default=SLICE_DIM)
  ap.add_argument("--f-slices", nargs=2, type=int, default=list(F_SLICES),
                  help="the divisors of f of the two slices when the full program does not fit (default 8 4)")
  ap.add_argument("--slice-widths", nargs=2, type=int, metavar=("A", "B"),
                  help="the two slices' sizes instead of --f-slices' divisors (any A < B < the full size)")
  ap.add_argument("--permutation", choices=("copy", "gather"), default=PERMUTATION)
  ap.add_argument("--split-check", action="store_true",
                  help="estimate the split of each stored whole-layer record and keep both (split_check)")
  ap.add_argument("--split", action="store_true",
                  help="estimate a grouped layer as the sum of its routing and experts halves (estimate_split)")
  ap.add_argument("--pieces", action="store_true",
                  help="estimate a grouped layer as the sum of its pieces cut at the Pallas kernels (estimate_tpu_pieces)")
  ap.add_argument("--pieces-check", action="store_true",
                  help="estimate each stored whole-layer record in pieces and keep both (pieces_check)")
  ap.add_argument("--ours-blocks", nargs=3, type=int, metavar=("TM", "TK", "TN"),
                  help="ours with these gmm/tgmm blocks instead of the per-generation defaults (said in 'method')")
  ap.add_argument("--compare-permutations", action="store_true",
                  help="on v6e, also estimate the copy stand-ins of the permutations (permutation_check)")
  args = ap.parse_args(argv)
  TIMEOUT = args.timeout
  F_SLICES = tuple(args.f_slices)
  SLICE_WIDTHS = tuple(args.slice_widths) if args.slice_widths else None
  PERMUTATION = args.permutation
  SLICE_DIM = args.slice_dim
  if args.job == "one":
    result_tables.print_result(estimate_here, args.config)
  else:
    bench(args)


if __name__ == "__main__":
  main()
