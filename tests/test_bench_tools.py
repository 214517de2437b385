"""The benchmark tools' own machinery: splash's block tables written as arithmetic, and the MoE layer's baselines.

``tools/bench_attention.py`` replaces splash's table lookups by formulas so that libtpu's
cost model (which reads SMEM-prefetched scalars as 0) charges the blocks splash really
runs. These tests check that the replaced kernel computes exactly what splash computes.
``tools/bench_moe.py`` builds the MoE layer's dense baseline and splits a layer in two for
the cost model; these tests check that both compute the layer.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sa = pytest.importorskip("jax.experimental.pallas.ops.tpu.splash_attention")
sk = sys.modules["jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel"]


def _load_tool(name: str):
  """``tools/<name>.py`` as a module (the tools import their siblings from ``tools/``)."""
  sys.path.insert(0, str(ROOT / "tools"))
  spec = importlib.util.spec_from_file_location(f"tools_{name}", ROOT / "tools" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


bench = _load_tool("bench_attention")


def _splash(mask, bq, bkv, bwd):
  kw = dict(block_q=bq, block_kv=bkv, block_kv_compute=bkv)
  if bwd:
    kw.update(block_q_dkv=bq, block_kv_dkv=bkv, block_kv_dkv_compute=bkv, block_q_dq=bq, block_kv_dq=bkv)
  return sa.make_splash_mha(sa.MultiHeadMask([mask] * 2), block_sizes=sa.BlockSizes(**kw),
                            head_shards=1, q_seq_shards=1, interpret=True)


def _run(kernel, s, bwd):
  q, k, v, do = (jax.random.normal(x, (2, s, 128), jnp.float32) for x in jax.random.split(jax.random.key(0), 4))
  jax.clear_caches()  # splash's jit would otherwise reuse the trace made before the swap
  out, pullback = jax.vjp(kernel, q, k, v)
  return [out, *pullback(do)] if bwd else [out]


@pytest.mark.parametrize("kind,s,bq,bkv,window,bwd", [
    ("causal", 1024, 256, 128, None, True),
    ("causal", 1024, 128, 256, None, True),
    ("full", 512, 256, 128, None, True),
    ("local", 1024, 256, 128, 300, False),
])
def test_splash_tables_as_arithmetic_compute_what_splash_computes(kind, s, bq, bkv, window, bwd):
  mask = {"causal": sa.CausalMask((s, s)), "full": sa.FullMask((s, s)),
          "local": sa.LocalMask((s, s), window_size=((window or 1) - 1, 0), offset=0)}[kind]
  kernel = _splash(mask, bq, bkv, bwd)
  want = _run(kernel, s, bwd)
  original, calls = sk._next_nonzero, []
  try:
    bench.splash_tables_as_arithmetic(kernel, s, causal=kind != "full", window=window)
    swapped = sk._next_nonzero
    sk._next_nonzero = lambda *a, **k: (calls.append(1), swapped(*a, **k))[1]
    got = _run(kernel, s, bwd)
  finally:
    sk._next_nonzero = original
  assert calls, "the arithmetic tables were never consulted"
  for g, w in zip(got, want, strict=True):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_splash_tables_as_arithmetic_refuse_tables_they_do_not_match():
  kernel = _splash(sa.CausalMask((1024, 1024)), 256, 128, False)
  original = sk._next_nonzero
  try:
    with pytest.raises(RuntimeError, match="differs from its arithmetic form"):
      bench.splash_tables_as_arithmetic(kernel, 1024, causal=False, window=None)  # claims a full mask
  finally:
    sk._next_nonzero = original


def test_stored_unaligned_matmul_records_match_the_current_default_plan():
  # The notebook's "shapes users bring" table is only honest while each stored record of our kernel
  # was estimated at the blocks a default call plans today: a new tuned entry can move a shape to
  # another class (planner only, no estimate).
  import json
  spec = importlib.util.spec_from_file_location("tools_bench_matmul", ROOT / "tools" / "bench_matmul.py")
  bm = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bm)
  results = json.loads((ROOT / "kernels" / "data" / "matmul_bench.json").read_text())["results"]
  checked = 0
  for gen in bm.UNALIGNED_GENERATIONS:
    for m, k, n in bm.UNALIGNED:
      r = results.get(f"unaligned/{gen}/ours/{m}x{k}x{n}")
      if r is None or "blocks_used" not in r:
        continue
      b = bm.default_plan(gen, m, k, n)["blocks"]
      assert r["blocks_used"] == [b.bm, b.bk, b.bn], (gen, m, k, n, r["blocks_used"], b)
      checked += 1
  assert checked >= len(bm.UNALIGNED)


@pytest.mark.parametrize("group", [16, 64])
def test_dense_capacity_layer_is_the_moe_layer_when_nothing_drops(group):
  """The dense baseline of tools/bench_moe.py computes the same layer: with a capacity that
  drops nothing (capacity factor = experts), in f32, it equals kernels.moe_reference."""
  bm = _load_tool("bench_moe")
  from kernels.experts.layer import moe_reference
  t, d, e, f, k = 64, 32, 4, 16, 2
  keys = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(keys[0], (t, d), jnp.float32)
  rw = jax.random.normal(keys[1], (d, e), jnp.float32)
  wgu = jax.random.normal(keys[2], (e, d, 2 * f), jnp.float32) / np.sqrt(d)
  wd = jax.random.normal(keys[3], (e, f, d), jnp.float32) / np.sqrt(f)
  case = dict(tokens=t, d=d, f=f, experts=e, top_k=k)
  with jax.default_matmul_precision("highest"):
    y, _ = bm.dense_layer(case, capacity_factor=float(e), group=group)(x, rw, wgu, wd)
    want, _ = moe_reference(x, rw, wgu, None, wd, top_k=k)
  np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-4, atol=1e-4)


def test_dense_capacity_layer_drops_per_group():
  """At capacity factor 1.25 a group's overflow is dropped: tokens all routed to one expert
  keep only that expert's capacity per group."""
  bm = _load_tool("bench_moe")
  t, d, e, f, k, group = 64, 8, 4, 8, 1, 16
  x = jnp.ones((t, d), jnp.float32)
  rw = jnp.zeros((d, e), jnp.float32).at[:, 0].set(1.0)  # every token picks expert 0
  wgu = jnp.ones((e, d, 2 * f), jnp.float32)
  wd = jnp.ones((e, f, d), jnp.float32)
  y, _ = bm.dense_layer(dict(tokens=t, d=d, f=f, experts=e, top_k=k), capacity_factor=1.25, group=group)(x, rw, wgu, wd)
  kept = np.asarray(jnp.any(y != 0, axis=1)).reshape(t // group, group).sum(axis=1)
  cap = int(np.ceil(1.25 * group * k / e))
  np.testing.assert_array_equal(kept, [cap] * (t // group))


def test_split_layer_halves_compose_to_the_whole_layer(monkeypatch):
  """tools/bench_moe.py --split estimates a grouped layer as its routing half plus its experts
  half: the halves' values and gradients, chained, are the whole layer's."""
  bm = _load_tool("bench_moe")
  monkeypatch.setitem(bm.CASES, "tiny", dict(tokens=32, d=16, f=8, experts=4, top_k=2))
  monkeypatch.setattr(bm, "_grouped", lambda cfg, gs: lambda sizes: bm.moe_mod._mlp_of(
      lambda lhs, rhs: jax.lax.ragged_dot(lhs, rhs, sizes)))
  cfg = dict(generation="v6e", case="tiny", groups="balanced", impl="ours", mode="fwdbwd", permutation="gather")
  keys = jax.random.split(jax.random.key(1), 5)
  x = jax.random.normal(keys[0], (32, 16), jnp.float32)
  rw = jax.random.normal(keys[1], (16, 4), jnp.float32)
  wgu = jax.random.normal(keys[2], (4, 16, 16), jnp.float32) / 4
  wd = jax.random.normal(keys[3], (4, 8, 16), jnp.float32) / 3
  dy = jax.random.normal(keys[4], (32, 16), jnp.float32)
  with jax.default_matmul_precision("highest"):
    whole_fn, _ = bm.program(cfg)
    value, (dx, drw, dwgu, dwd) = whole_fn(x, rw, wgu, wd, dy)
    routing_fn, _ = bm.program(dict(cfg, part="routing"))
    experts_fn, _ = bm.program(dict(cfg, part="experts"))
    r = bm.moe_mod.route(x, rw, top_k=2)
    r_arrays = tuple(getattr(r, fl.name) for fl in dataclasses.fields(r))
    e_value, (edx, dweights, ewgu, ewd) = experts_fn(x, r_arrays, wgu, wd, dy)
    (r_value, _), (rdx, rdrw) = routing_fn(x, rw, dweights)
  aux = r.load_balancing_loss + r.z_loss
  np.testing.assert_allclose(e_value + aux, value, rtol=1e-5)
  np.testing.assert_allclose(r_value, jnp.sum(r.weights * dweights) + aux, rtol=1e-5)
  for got, want in ((edx + rdx, dx), (rdrw, drw), (ewgu, dwgu), (ewd, dwd)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)


def test_conv_row_block_line_extends_over_rows_and_blocks_of_images(monkeypatch):
  # A program whose cost is fixed + per row block (for every block of images): the line through two
  # slices must give back the whole program's cost, over rows alone and over blocks of images too.
  tune_conv = _load_tool("tune_conv")
  fixed, per = 20.0, 10.0
  seen = []

  def fake(cfg):
    seen.append((cfg["shape"][0], cfg["rows"]))
    us = fixed + per * cfg["rows"] / 4
    return {"us": us, "model_us": us, "floor_us": us / 4, "complete": True}

  monkeypatch.setattr(tune_conv, "estimate_isolated", fake)
  cfg = dict(generation="v5e", impl="winograd_f4", mode="fwd", shape=[32, 28, 512])
  whole = tune_conv.estimate_by_rows(cfg, 4, images=16)
  assert seen == [(16, 4), (16, 8)]
  assert whole["us"] == fixed + per * 7 * 2  # 7 row blocks x 2 blocks of 16 images, the fixed cost once
  assert "2 blocks of images" in whole["method"]
  assert tune_conv.estimate_by_rows(dict(cfg, shape=[16, 28, 512]), 4)["us"] == fixed + per * 7
  assert "error" in tune_conv.estimate_by_rows(cfg, 4, images=12)


def test_conv_rules_derive_the_shipped_default_choices(monkeypatch, tmp_path):
  # conv2d(algorithm=None) reads conv_blocks.json's winograd and xla rules: `tune_conv.py rules`
  # must derive exactly those from the stored estimates in conv_bench.json.
  import json
  import shutil
  tune_conv = _load_tool("tune_conv")
  shipped = json.loads(open(tune_conv.BLOCKS_OUT).read())
  out = tmp_path / "conv_blocks.json"
  shutil.copy(tune_conv.BLOCKS_OUT, out)
  monkeypatch.setattr(tune_conv, "BLOCKS_OUT", str(out))
  tune_conv.main(["rules"])
  derived = json.loads(out.read_text())
  for gen in tune_conv.GENERATIONS:
    for kind in ("winograd", "xla"):
      assert derived["defaults"][gen][kind] == shipped["defaults"][gen][kind], (gen, kind)
  assert derived["defaults"]["v6e"]["xla"] and derived["defaults"]["v5e"]["winograd"]


@pytest.mark.parametrize("widths", [None, (2048, 3072)])
def test_moe_slices_extrapolate_a_line_to_the_full_width(monkeypatch, widths):
  """tools/bench_moe.py, for a program too large to estimate whole: two slices of f (divisors
  of f, or --slice-widths) and the line through them at the full f; each record says which."""
  bm = _load_tool("bench_moe")
  calls = []

  def fake(cfg, max_rss_gb):  # a cost linear in f: 100 us + 2 us per column
    calls.append(cfg["f"])
    return {"us": 100.0 + 2.0 * cfg["f"], "model_us": 2.0 * cfg["f"], "floor_us": 1.0 * cfg["f"],
            "hbm_bytes": 10.0 * cfg["f"], "valid": True}
  monkeypatch.setattr(bm, "estimate_isolated", fake)
  monkeypatch.setattr(bm, "SLICE_WIDTHS", widths)
  cfg = dict(generation="v6e", case="E8_top2", groups="balanced", impl="ours", mode="fwdbwd")
  r = bm.estimate(cfg, 14, skip_full=True)
  full = bm.CASES["E8_top2"]["f"]
  assert calls == list(widths or (full // 8, full // 4))
  assert r["us"] == pytest.approx(100.0 + 2.0 * full) and r["hbm_bytes"] == pytest.approx(10.0 * full)
  assert ("f=2048 and f=3072" in r["scaled"]) == (widths is not None) and sorted(r["slices"]) == sorted(
      f"f={x}" for x in calls)


def test_a_guarded_estimate_is_stopped_with_its_own_children():
  # The sweeps stop an estimate past its RAM limit; the estimate compiles in a child of its own
  # (isolate=True), which must die with it, not go on growing.
  import subprocess
  import time
  results = _load_tool("results")
  grandchild = "import time; time.sleep(120)"
  proc = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys, time; "
                           f"subprocess.Popen([sys.executable, '-c', {grandchild!r}]); time.sleep(120)"])
  deadline = time.time() + 30
  while not results._descendants(proc.pid) and time.time() < deadline:
    time.sleep(0.1)
  kids = results._descendants(proc.pid)
  assert kids and results.rss_gb(proc.pid) > 0
  results.kill_tree(proc)
  assert proc.returncode is not None

  def alive(pid):
    try:
      with open(f"/proc/{pid}/status", encoding="utf-8") as fh:
        return "\tZ" not in next(ln for ln in fh if ln.startswith("State:"))
    except OSError:
      return False
  deadline = time.time() + 10
  while any(alive(k) for k in kids) and time.time() < deadline:
    time.sleep(0.1)
  assert not any(alive(k) for k in kids)


def test_an_estimate_below_the_roofline_is_not_kept():
  results = _load_tool("results")
  ok = {"us": 10.0, "fraction_of_roofline": 0.8}
  assert results.physical(ok) is ok
  r = results.physical({"us": 5.0, "model_us": 5.0, "floor_us": 4.0, "fraction_of_roofline": 1.9})
  assert "us" not in r and "below the roofline" in r["error"] and r["rejected"]["us"] == 5.0


def test_megablox_with_known_groups_computes_what_megablox_computes():
  # tools/peers.py gives megablox its metadata from known group sizes at trace time (so the cost
  # model sees its real grid); the kernel must compute exactly what it computes at run time.
  import importlib
  mb = pytest.importorskip("jax.experimental.pallas.ops.tpu.megablox.ops")
  mbg = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")
  from kernels.perf import traffic
  peers = _load_tool("peers")
  m, k, n, e = 512, 256, 256, 4
  gs = np.array([200, 0, 56, 200], np.int32)  # an empty group, groups across tiles, rows past the sum
  a = jax.random.normal(jax.random.key(0), (m, k), jnp.float32).astype(jnp.bfloat16)
  b = jax.random.normal(jax.random.key(1), (e, k, n), jnp.float32).astype(jnp.bfloat16)
  dy = jax.random.normal(jax.random.key(2), (m, n), jnp.float32)

  def run(a, b, dy):
    out, vjp = jax.vjp(lambda a, b: mb.gmm(a, b, jnp.asarray(gs), jnp.float32, (128, 128, 128), interpret=True), a, b)
    return out, vjp(dy)
  want = jax.jit(run)(a, b, dy)
  original = mbg.make_group_metadata
  try:
    peers.megablox_with_known_groups(gs)
    traced = jax.make_jaxpr(run)(a, b, dy)
    grids = [eq.params["grid_mapping"].grid for eq in traffic.pallas_calls(traced)]
    got = jax.jit(run)(a, b, dy)
  finally:
    mbg.make_group_metadata = original
    jax.clear_caches()
  # every grid static: gmm, its transposed gmm and tgmm; the forward visits tiles 0, 1 (twice: groups 0
  # and 2 share it), 2 and 3 (the empty group has no visit)
  assert len(grids) == 3 and all(isinstance(d, int) for g in grids for d in g), grids
  assert grids[0] == (2, 5, 2), grids
  for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    np.testing.assert_array_equal(np.asarray(w), np.asarray(g))
