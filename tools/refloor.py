"""Re-states stored compiler estimates on the floored estimate, without re-estimating them.

``kernels.estimate_tpu`` floors its time at the program's HBM bytes over the published
bandwidth (:class:`kernels.perf.tpu.Estimate`). Tables written before that hold the cost
model's time alone, which stays valid for the program that was estimated; what is
missing is that program's counted HBM bytes. For every stored estimate this script
rebuilds the program its tool estimated (with the tool's own builder:
``calibrate.program``, ``bench_matmul._program``, ``tune_matmul.program``,
``tune_attention.program``, ``bench_attention.build``; same blocks, layouts, libtpu
flags; attention_blocks' candidates on the kernels of the commits that estimated them),
counts its bytes with :func:`kernels.perf.tpu.hbm_traffic` in a child process that
only compiles (``KERNELS_STATIC_PROFILE=0``: no cost model, much faster), and writes back

* ``model_us`` = the stored ``us``, ``hbm_bytes``, ``bytes_method``,
  ``floor_us`` = ``hbm_bytes`` / the chip's published HBM bandwidth, ``floored``;
* ``us`` = ``max(model_us, floor_us)``, and every figure derived from it
  (``fraction_of_roofline``, ``valid``, ``tflops``, ``fraction_of_mxu_peak``, speed ratios,
  the attention tuner's geometric means, ``best``).

The calibration table keeps its own units (``seconds``, ``model_seconds``,
``floor_seconds``, as ``tools/calibrate.py`` writes them). The run is resumable: an entry
that already has ``floor_us`` (``floor_seconds``) is skipped, and the table is saved after
every few entries. Entries are processed in batches, one child process per batch, so the
memory of large compiles is returned.

Usage::

  nice -n 10 .venv/bin/python tools/refloor.py calibration
  nice -n 10 .venv/bin/python tools/refloor.py matmul_bench matmul_blocks
  nice -n 10 .venv/bin/python tools/refloor.py attention_bench --limit 20
  .venv/bin/python tools/refloor.py attention_bench --list      # what would run, in order
  .venv/bin/python tools/refloor.py attention_bench --sync      # only recompute derived fields
  nice -n 10 .venv/bin/python tools/refloor.py matmul_bench --recount  # floored records, newer counter

A newer byte counter (``kernels.perf.traffic.COUNTER_VERSION``, stored as ``counter``) only ever
counts less, so only the records the floor set can change: ``--recount`` counts those again.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

TOOLS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TOOLS)
DATA = os.path.join(ROOT, "kernels", "data")
sys.path.insert(0, ROOT)
os.environ.setdefault("KERNELS_STATIC_PROFILE", "0")  # this process never estimates

import results as result_tables  # noqa: E402  (tools/results.py)

TABLES = {
    "calibration": "calibration_v5e.json",
    "matmul_bench": "matmul_bench.json",
    "matmul_blocks": "matmul_blocks.json",
    "attention_blocks": "attention_blocks.json",
    "attention_bench": "attention_bench.json",
    "norm_bench": "norm_bench.json",
    "norm_blocks": "norm_blocks.json",
}
SENTENCE = ("us is the floored compiler estimate: the cost model's time (model_us), never less than the "
            "program's counted HBM bytes at the published bandwidth (floor_us)")
SENTENCE_SECONDS = ("seconds is the floored compiler estimate: the cost model's time (model_seconds), never less "
                    "than the program's counted HBM bytes at the published bandwidth (floor_seconds)")
NO_CROSS_PROGRAM_PREFETCH = "--xla_max_cross_program_prefetches=0"

# tools/tune_attention.py estimated the forward + backward candidates of
# attention_blocks.json with the kernel of commit d7ddba2 (2026-11-22: a separate dq kernel;
# the fused dq came later) and the forward blocks then chosen; the forward candidates were
# estimated with the kernel of commit 72bcfd9 (2026-11-23, before the static tile patterns).
# Their bytes are counted on those kernels (kernels/ of that commit, with today's byte
# counter: kernels/tpu.py and kernels/traffic.py).
ATTENTION_BWD_FORWARD_BLOCKS = {"v5e": (1024, 1024), "v6e": (2048, 1024)}
ATTENTION_BLOCKS_KERNELS = {"forward": "72bcfd9", "backward": "d7ddba2"}


def kernels_tree(commit):
  """A folder holding ``kernels/`` as of ``commit`` with today's byte counter (made once)."""
  folder = os.path.join(tempfile.gettempdir(), f"refloor-kernels-{commit}")
  import shutil
  if not os.path.exists(os.path.join(folder, "kernels", "attention.py")):
    os.makedirs(folder, exist_ok=True)
    archive = subprocess.run(["git", "-C", ROOT, "archive", commit, "kernels"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
  for f in ("tpu.py", "traffic.py"):  # today's counter, every time
    shutil.copy(os.path.join(ROOT, "kernels", f), os.path.join(folder, "kernels", f))
  return folder


# --- the child: rebuild programs, count their bytes -----------------------------------


def _program(spec):
  """(function, argument specs, flops, roofline bytes, roofline dtype) of a stored entry's program."""
  import importlib
  tool = importlib.import_module(spec["tool"])
  if spec["tool"] == "calibrate":
    fn, args, flops, nbytes = tool.program(spec["case"])
    return fn, args, flops, nbytes, "bfloat16"
  if spec["tool"] == "bench_matmul":
    import kernels
    fn, args, used = tool._program(spec["kind"], spec["generation"], spec["m"], spec["k"], spec["n"], spec["blocks"])
    if spec["blocks"] is not None and used is not None and [used.bm, used.bk, used.bn] != list(spec["blocks"]):
      raise RuntimeError(f"blocks {spec['blocks']} fitted to {used}, not the stored blocks")
    return (fn, args, *kernels.matmul_cost(spec["m"], spec["k"], spec["n"]), "bfloat16")
  if spec["tool"] == "tune_matmul":
    blocks = tool.mm.BlockSizes(*spec["blocks"]) if spec["blocks"] else None
    fn, args, flops, nbytes = tool.program(spec["dtype"], spec["m"], spec["k"], spec["n"], blocks)
    return fn, args, flops, nbytes, spec["dtype"]
  if spec["tool"] == "tune_attention":
    fn, args, flops, nbytes = tool.program(spec["seq"], spec["heads"], tool.att.BlockSizes(*spec["blocks"]),
                                           spec["backward"], spec["causal"])
    return fn, args, flops, nbytes, "bfloat16"
  if spec["tool"] == "tune_norm":
    fn, args = tool._program(spec["cfg"])
    return fn, args, 0, tool.bytes_moved(spec["cfg"]), "bfloat16"
  if spec["tool"] == "bench_attention":
    fn, args = tool.build(spec["peer"], spec["case"], spec["blocks"])
    return (fn, args, *tool.cost(spec["case"]), tool.DTYPE)
  raise ValueError(spec["tool"])


def child(specs):
  """Counts each spec's HBM bytes; prints one JSON line per spec."""
  import kernels  # noqa: F401  (first: libtpu's flags)
  from kernels.base.roofline import roofline
  from kernels.perf import traffic
  from kernels.perf.tpu import hbm_traffic
  for spec in specs:
    t0 = time.time()
    try:
      fn, args, flops, nbytes, dtype = _program(spec)
      t = hbm_traffic(fn, *args, generation=spec["generation"])
      rl = roofline(flops, nbytes, spec["generation"], dtype)
      out = {"id": spec["id"], "hbm_bytes": float(t.hbm_bytes), "bytes_method": t.method,
             "counter": traffic.COUNTER_VERSION,
             "compulsory_bytes": float(t.compulsory_bytes), "roofline_us": rl.seconds * 1e6, "flops": flops,
             "peak": rl.peak, "notes": t.notes[:5], "seconds": round(time.time() - t0, 1)}
    except Exception as e:  # noqa: BLE001 - reported to the parent
      import traceback
      traceback.print_exc()
      out = {"id": spec["id"], "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
    print(json.dumps(out), flush=True)


def run_child(specs, flags, timeout, max_rss_gb, kernels_tree=None):
  """Runs :func:`child` on ``specs`` in a fresh process compiled with libtpu ``flags``; {id: result}."""
  env = dict(os.environ, KERNELS_STATIC_PROFILE="0", LIBTPU_INIT_ARGS=flags)
  if kernels_tree:
    env["REFLOOR_KERNELS_TREE"] = kernels_tree
  with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
    json.dump(specs, fh)
  try:
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
      proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", fh.name], stdout=out,
                              stderr=err, text=True, env=env)
      t0, why = time.time(), None
      while proc.poll() is None:
        time.sleep(1)
        if result_tables.rss_gb(proc.pid) > max_rss_gb:
          why = f"the counting process exceeded {max_rss_gb:g} GB of RAM"
        elif time.time() - t0 > timeout:
          why = f"the batch took longer than {timeout:g} s"
        if why:
          result_tables.kill_tree(proc)
      out.seek(0)
      err.seek(0)
      lines = [json.loads(ln) for ln in out.read().splitlines() if ln.startswith("{")]
      tail = [ln for ln in err.read().splitlines() if ln.strip()][-3:]
  finally:
    os.remove(fh.name)
  got = {r["id"]: r for r in lines}
  if len(got) < len(specs):
    why = why or f"the counting process ended (exit {proc.returncode}): " + " | ".join(t[:200] for t in tail)
    for s in specs:
      got.setdefault(s["id"], {"id": s["id"], "error": why, "crashed": True})
  return got


# --- writing back --------------------------------------------------------------------

_RECORD_KEYS = ("us", "model_us", "floor_us", "hbm_bytes", "bytes_method", "counter", "floored", "valid",
                "fraction_of_roofline")
COUNTER = None  # kernels.perf.traffic.COUNTER_VERSION (read in main: importing kernels loads libtpu)
RECOUNT = None  # "floored" (--recount) or "all" (--recount-all): records counted by an older counter


def _todo(r) -> bool:
  """Whether record ``r`` is re-floored: not yet floored, or (``--recount``) floored on an older
  count (``--recount-all``: every record of an older count)."""
  floored = "floor_us" in r or "floor_seconds" in r
  if RECOUNT:
    return floored and r.get("counter", 1) < COUNTER and (RECOUNT == "all" or bool(r.get("floored")))
  return "us" in r and not floored


def _bandwidth(gen):
  import kernels
  return kernels.get_chip(gen).hbm_bandwidth


def refloor_record(r, res, gen, flops=None, peak=None):
  """Re-states the record ``r`` (``us`` = the model's time) on the floored estimate, in place."""
  if "model_us" in r:  # (a recount: the model's time was kept beside the floored one)
    if r.get("fraction_of_roofline"):  # (as a fraction of the model's time, as if never floored)
      r["fraction_of_roofline"] = r["fraction_of_roofline"] * r["us"] / r["model_us"]
    r["us"] = r["model_us"]
  model_us = r["us"]
  old_fraction = r.get("fraction_of_roofline")
  old_roofline_us = old_fraction * model_us if old_fraction else None
  floor_us = res["hbm_bytes"] / _bandwidth(gen) * 1e6
  us = max(model_us, floor_us)
  frac = res["roofline_us"] / us
  new = {"us": round(us, 3), "model_us": model_us, "floor_us": round(floor_us, 3), "hbm_bytes": int(res["hbm_bytes"]),
         "bytes_method": res["bytes_method"], "counter": res["counter"], "floored": floor_us > model_us,
         "valid": frac <= 1.0 + 1e-9 and not r.get("unmodeled"), "fraction_of_roofline": round(frac, 4)}
  if flops is not None and "tflops" in r:
    new["tflops"] = round(flops / us / 1e6, 2)
  if flops is not None and "fraction_of_mxu_peak" in r:
    new["fraction_of_mxu_peak"] = round(flops / (us * 1e-6) / peak, 4)
  out = {}
  for k, v in r.items():  # the record's fields where "us" was (Estimate.record()'s order), the rest in place
    if k == "us":
      out.update({f: new[f] for f in _RECORD_KEYS})
    elif k not in _RECORD_KEYS:
      out[k] = new.get(k, v)
  r.clear()
  r.update(out)
  return _check(old_roofline_us, res["roofline_us"], old_fraction)


def _check(old, new, fraction=None):
  """A warning when the stored roofline (fraction * time) is not the one recomputed, beyond the
  rounding of the stored fraction (4 decimals)."""
  if old is None or new <= 0:
    return None
  if abs(old - new) / new > 1e-3 + (0.5e-4 / fraction if fraction else 0.0):
    return f"stored roofline {old:.3f} us differs from the recomputed {new:.3f} us"
  return None


def refloor_calibration_case(c, res):
  if "model_seconds" in c:  # (a recount)
    c["seconds"] = c["model_seconds"]
  model_s = c["seconds"]
  if abs(c["cycles"] / c["clock_hz"] - model_s) > 1e-9 * max(model_s, 1e-12) + 1e-12:
    raise RuntimeError(f"{c['name']}: stored seconds is not cycles / clock")
  floor_s = res["hbm_bytes"] / _bandwidth(c["generation"])
  s = max(model_s, floor_s)
  warn = _check(c["roofline_seconds"] * 1e6, res["roofline_us"])
  new = {"seconds": s, "model_seconds": model_s, "floor_seconds": floor_s, "hbm_bytes": res["hbm_bytes"],
         "bytes_method": res["bytes_method"], "counter": res["counter"], "floored": floor_s > model_s}
  derived = {"tflops_per_second": c["flops"] / s / 1e12, "fraction_of_peak": c["flops"] / s / res["peak"],
             "fraction_of_roofline": c["roofline_seconds"] / s, "valid": c["roofline_seconds"] / s <= 1.0 + 1e-9}
  out = {}
  for k, v in c.items():
    if k in new:
      continue
    out[k] = derived.get(k, v)
    if k == "clock_hz":  # the new fields go where tools/calibrate.py writes them
      out.update(new)
  c.clear()
  c.update(out)
  return warn


# --- the tables: jobs and derived fields ---------------------------------------------


def jobs_calibration(table):
  out = []
  for c in table["cases"]:
    if not _todo(c):
      continue
    spec = {"tool": "calibrate", "generation": c["generation"],
            "case": {k: c[k] for k in ("name", "kernel", "size", "generation", "blocks")}}
    out.append((c["name"], spec, "", lambda res, c=c: refloor_calibration_case(c, res)))
  return out


def jobs_matmul_bench(table):
  out = []
  for key, r in table["results"].items():
    if not _todo(r):
      continue
    blocks = r.get("blocks_used") or r.get("blocks")
    spec = {"tool": "bench_matmul", "kind": r["kind"], "generation": r["generation"], "m": r["m"], "k": r["k"],
            "n": r["n"], "blocks": blocks}
    flags = "" if r.get("cross_program_prefetch", True) else NO_CROSS_PROGRAM_PREFETCH
    out.append((key, spec, flags, lambda res, r=r: refloor_record(r, res, r["generation"])))
  return out


def jobs_matmul_blocks(table):
  out = []
  for gen, per_dtype in table["defaults"].items():
    for dtype, entries in per_dtype.items():
      for e in entries:
        for field, blocks, flags in (("estimate", [e["bm"], e["bk"], e["bn"]], ""), ("xla", None, ""),
                                     ("xla_no_cross_program_prefetch", None, NO_CROSS_PROGRAM_PREFETCH)):
          r = e.get(field)
          if not r or not _todo(r):
            continue
          spec = {"tool": "tune_matmul", "generation": gen, "dtype": dtype, "m": e["m"], "k": e["k"], "n": e["n"],
                  "blocks": blocks}
          out.append((f"{gen}/{dtype}/{e['m']}x{e['k']}x{e['n']}/{field}", spec, flags,
                      lambda res, r=r, gen=gen: refloor_record(r, res, gen)))
  return out


def sync_matmul_blocks(table):
  for per_dtype in table["defaults"].values():
    for entries in per_dtype.values():
      for e in entries:
        ours = e.get("estimate") or {}
        for key in ("xla", "xla_no_cross_program_prefetch"):
          x = e.get(key) or {}
          if "us" in ours and "us" in x:
            e["speed_vs_" + key] = round(x["us"] / ours["us"], 4)


def jobs_attention_blocks(table):
  out = []
  for gen, per_dtype in table["defaults"].items():
    e = per_dtype.get("bfloat16", {})
    fp = e.get("forward_problem")
    for cand in e.get("forward_candidates", []):
      for causal in (False, True):
        r = cand["causal" if causal else "non_causal"]
        if not _todo(r):
          continue
        blocks = [cand["block_q"], cand["block_kv"], 512, 512]
        spec = {"tool": "tune_attention", "generation": gen, "seq": fp["seq"], "heads": fp["heads"],
                "blocks": blocks, "backward": False, "causal": causal,
                "kernels_at": ATTENTION_BLOCKS_KERNELS["forward"]}
        out.append((f"{gen}/forward/{cand['block_q']}x{cand['block_kv']}/{'causal' if causal else 'non_causal'}",
                    spec, "", lambda res, r=r, gen=gen: refloor_record(r, res, gen)))
    p = e.get("problem")
    for cand in e.get("backward_candidates", []):
      if not _todo(cand):
        continue
      blocks = [*ATTENTION_BWD_FORWARD_BLOCKS[gen], cand["block_q_bwd"], cand["block_kv_bwd"]]
      spec = {"tool": "tune_attention", "generation": gen, "seq": p["seq"], "heads": p["heads"], "blocks": blocks,
              "backward": True, "causal": bool(p["causal"]), "kernels_at": ATTENTION_BLOCKS_KERNELS["backward"]}
      out.append((f"{gen}/forward_backward/{cand['block_q_bwd']}x{cand['block_kv_bwd']}", spec, "",
                  lambda res, r=cand, gen=gen: refloor_record(r, res, gen)))
  return out


def _pick(cands, keys, tie=0.02):
  """tools/tune_attention.py's rule: the smallest blocks within ``tie`` of the fastest."""
  fastest = min(c["us"] for c in cands)
  near = [c for c in cands if c["us"] <= (1 + tie) * fastest]
  return min(near, key=lambda c: (c[keys[0]] * c[keys[1]], c["us"]))


def sync_attention_blocks(table, log=print):
  for gen, per_dtype in table["defaults"].items():
    e = per_dtype.get("bfloat16", {})
    fwd = e.get("forward_candidates", [])
    for cand in fwd:
      if "floor_us" in cand["non_causal"] and "floor_us" in cand["causal"]:
        cand["us"] = round((cand["non_causal"]["us"] * cand["causal"]["us"]) ** 0.5, 2)
    chosen = [c for c in fwd if (c["block_q"], c["block_kv"]) == (e["block_q"], e["block_kv"])]
    if chosen and "us" in chosen[0]:
      e["forward"] = {k: v for k, v in chosen[0].items() if k not in ("block_q", "block_kv")}
    if fwd and all("floor_us" in c["causal"] and "floor_us" in c["non_causal"] for c in fwd):
      p = _pick(fwd, ("block_q", "block_kv"))
      if (p["block_q"], p["block_kv"]) != (e["block_q"], e["block_kv"]):
        log(f"{gen}: on the floored estimates the forward pick would be {p['block_q']}/{p['block_kv']}, "
            f"not the stored {e['block_q']}/{e['block_kv']}")
    bwd = e.get("backward_candidates", [])
    chosen = [c for c in bwd if (c["block_q_bwd"], c["block_kv_bwd"]) == (e["block_q_bwd"], e["block_kv_bwd"])]
    if chosen:
      e["forward_backward"] = {k: v for k, v in chosen[0].items() if k not in ("block_q_bwd", "block_kv_bwd")}
    if bwd and all("floor_us" in c for c in bwd):
      p = _pick(bwd, ("block_q_bwd", "block_kv_bwd"))
      if (p["block_q_bwd"], p["block_kv_bwd"]) != (e["block_q_bwd"], e["block_kv_bwd"]):
        log(f"{gen}: on the floored estimates the backward pick would be {p['block_q_bwd']}/{p['block_kv_bwd']}, "
            f"not the stored {e['block_q_bwd']}/{e['block_kv_bwd']}")


_TARGET_CASES = ("fwd_causal_S8192_D128_B1_H2", "fwd_full_S8192_D128_B1_H2", "fwdbwd_causal_S8192_D128_B1_H2",
                 "fwdbwd_causal_S4096_D128_B1_H2", "fwdbwd_full_S4096_D128_B1_H2")


def jobs_attention_bench(table):
  """Most displayed first: the notebook's target case (every configuration), its other target
  cases, then each kernel's default and best configuration of every case, then the rest."""
  out = []
  for key, entry in table["cases"].items():
    c = entry["shape"]
    for gen, per_peer in entry["results"].items():
      for peer, pe in per_peer.items():
        best = (pe.get("best") or {}).get("blocks")
        for name, r in pe["tried"].items():
          if not _todo(r):
            continue
          if key == _TARGET_CASES[0]:
            rank = 0
          elif key in _TARGET_CASES:
            rank = 1
          elif name in ("default", best):
            rank = 2
          else:
            rank = 3
          blocks = None if name == "default" else json.loads(name)
          spec = {"tool": "bench_attention", "generation": gen, "peer": peer, "case": c, "blocks": blocks}
          out.append((rank, c["seq"] * c["heads"] * (3 if c["backward"] else 1),
                      (f"{key}/{gen}/{peer}/{name}", spec, NO_CROSS_PROGRAM_PREFETCH,
                       lambda res, r=r, gen=gen, flops=entry["flops"]: refloor_record(r, res, gen, flops, res["peak"]))))
  out.sort(key=lambda t: (t[0], t[1]))
  return [t[2] for t in out]


def sync_attention_bench(table):
  for entry in table["cases"].values():
    for per_peer in entry["results"].values():
      for pe in per_peer.values():
        tried = pe["tried"]
        pe["default"] = tried.get("default")
        ok = [(r["us"], name) for name, r in tried.items() if "us" in r]
        if not ok:
          pe["best"] = None
          continue
        old = (pe.get("best") or {}).get("blocks")
        us, name = min(ok)
        if old in tried and "us" in tried[old] and tried[old]["us"] <= us:
          name = old  # a tie keeps the stored best
        pe["best"] = {"blocks": name, **tried[name]}


def jobs_norm_bench(table):
  out = []
  for key, r in table["results"].items():
    if not _todo(r):
      continue
    cfg = {k: r[k] for k in ("generation", "impl", "kind", "dtype", "hidden", "residual", "mode") if k in r}
    spec = {"tool": "tune_norm", "generation": r["generation"], "cfg": {**cfg, **r.get("blocks", {})}}
    out.append((key, spec, "", lambda res, r=r: refloor_record(r, res, r["generation"])))
  return out


def jobs_norm_blocks(table):
  """The three records of each tuned entry (v4's are v5p's copies, made again by sync); the
  tuner's sweeps keep the figures it ranked on."""
  out = []
  for gen, per_dtype in table["defaults"].items():
    if gen == "v4":
      continue
    for dtype, entries in per_dtype.items():
      for e in entries:
        for field, mode in (("forward", "fwd"), ("forward_under_grad", "fwdgrad"),
                            ("forward_and_backward", "fwdbwd")):
          r = e.get(field)
          if not r or not _todo(r):
            continue
          cfg = {"generation": gen, "impl": "ours", "kind": e.get("kind", "layer"), "dtype": dtype,
                 "hidden": e["hidden"], "residual": e.get("residual", True), "mode": mode, "rows": e["rows"],
                 "backward_rows": e["backward_rows"]}
          key = f"{gen}/{cfg['kind']}/{e['hidden']}/{'residual' if cfg['residual'] else 'plain'}/{field}"
          out.append((key, {"tool": "tune_norm", "generation": gen, "cfg": cfg}, "",
                      lambda res, r=r, gen=gen: refloor_record(r, res, gen)))
  return out


JOBS = {"calibration": jobs_calibration, "matmul_bench": jobs_matmul_bench, "matmul_blocks": jobs_matmul_blocks,
        "attention_blocks": jobs_attention_blocks, "attention_bench": jobs_attention_bench,
        "norm_bench": jobs_norm_bench, "norm_blocks": jobs_norm_blocks}


def sync(name, table, log=print):
  """Derived fields and the table's description."""
  if name == "norm_blocks":
    if "v5p" in table["defaults"]:
      table["defaults"]["v4"] = {"bfloat16": [dict(e, source="v5p's choice (libtpu has no cost model for v4)")
                                              for e in table["defaults"]["v5p"]["bfloat16"]]}
    return
  if name == "norm_bench":
    return
  if name == "calibration":
    if SENTENCE_SECONDS not in table.get("description", ""):
      table["description"] = table["description"].rstrip() + " " + SENTENCE_SECONDS + "."
    return
  if name == "matmul_blocks":
    sync_matmul_blocks(table)
  elif name == "attention_blocks":
    sync_attention_blocks(table, log)
    table.setdefault("refloored", {})["programs"] = (
        f"hbm_bytes counted on the kernels tools/tune_attention.py estimated: forward_candidates on kernels/ of "
        f"commit {ATTENTION_BLOCKS_KERNELS['forward']}, backward_candidates on commit "
        f"{ATTENTION_BLOCKS_KERNELS['backward']} (separate dq kernel) under the forward blocks then chosen ("
        + ", ".join(f"{g} {q}/{kv}" for g, (q, kv) in ATTENTION_BWD_FORWARD_BLOCKS.items()) + ")")
  elif name == "attention_bench":
    sync_attention_bench(table)
    conv = table.setdefault("conventions", {})
    conv["us"] = SENTENCE
    return
  if SENTENCE not in table.get("description", ""):
    table["description"] = table["description"].rstrip() + " " + SENTENCE + "."


def run_table(name, args):
  path = os.path.join(args.data, TABLES[name])
  table = result_tables.load(path)
  jobs = JOBS[name](table)
  if args.limit is not None:
    jobs = jobs[:args.limit]
  if args.list:
    for key, spec, flags, _ in jobs:
      print(name, key, flags)
    return
  print(f"{name}: {len(jobs)} entries to re-floor", flush=True)
  done, failed, t_all = 0, [], time.time()
  # Batches of one tool and one set of libtpu flags (flags are read when libtpu loads); an
  # entry whose batch's process died is retried alone.
  pending = [(j, False) for j in jobs]
  while pending:
    (first, alone) = pending[0]
    batch = [(j, a) for j, a in pending if j[2] == first[2] and j[1]["tool"] == first[1]["tool"] and a == alone
             and j[1].get("kernels_at") == first[1].get("kernels_at")]
    batch = batch[:1 if alone else args.batch]
    pending = [p for p in pending if p not in batch]
    specs = [{**spec, "id": key} for (key, spec, _, _), _ in batch]
    t0 = time.time()
    at = first[1].get("kernels_at")
    tree = args.kernels_tree or (kernels_tree(at) if at else None)
    got = run_child(specs, first[2], args.timeout, args.max_rss_gb, tree)
    retry = []
    for (key, spec, flags, apply), _ in batch:
      res = got[key]
      if "error" in res:
        if res.get("crashed") and len(batch) > 1:
          retry.append(((key, spec, flags, apply), True))
          continue
        failed.append((key, res["error"]))
        print(f"  {key}: NOT COUNTED: {res['error']}", flush=True)
        continue
      warn = apply(res)
      done += 1
      floor = res["hbm_bytes"] / _bandwidth(spec["generation"]) * 1e6
      print(f"  {key}: {res['hbm_bytes'] / 2**20:,.2f} MiB ({res['bytes_method']}), floor {floor:,.2f} us, "
            f"roofline {res['roofline_us']:,.2f} us [{res['seconds']} s]" + (f" WARNING: {warn}" if warn else "")
            + (f" notes: {res['notes']}" if res.get("notes") else ""), flush=True)
    pending = retry + pending
    sync(name, table)
    table.setdefault("refloored", {}).update({"by": "tools/refloor.py", "date": datetime.date.today().isoformat()})
    result_tables.save(table, path)
    print(f"[{time.time() - t_all:6.0f} s] {name}: {done}/{len(jobs)} re-floored, batch of {len(batch)} in "
          f"{time.time() - t0:.0f} s", flush=True)
  sync(name, table)
  result_tables.save(table, path)
  print(f"{name}: {done} re-floored, {len(failed)} not counted" + "".join(f"\n  {k}: {e}" for k, e in failed),
        flush=True)


def report(name, args):
  """Counts of re-floored, floored and over-roofline entries of a table."""
  table = result_tables.load(os.path.join(args.data, TABLES[name]))
  recs = []

  def walk(x, path):
    if isinstance(x, dict):
      if "floor_us" in x or "floor_seconds" in x:
        recs.append((path, x))
        return
      copies = (("default", "best") if "tried" in x else ()) + (
          ("forward", "forward_backward") if "forward_candidates" in x else ())  # copies of other records
      for k, v in x.items():
        if k not in copies:
          walk(v, f"{path}/{k}")
    elif isinstance(x, list):
      for i, v in enumerate(x):
        walk(v, f"{path}/{v.get('name', i) if isinstance(v, dict) else i}")
  walk(table, "")
  floored = [(p, r) for p, r in recs if r.get("floored")]
  over = [(p, r) for p, r in recs if (r.get("fraction_of_roofline") or 0) > 1.005]
  print(f"{name}: {len(recs)} re-floored records, {len(floored)} floored, {len(over)} above 1.005 of the roofline")
  for p, r in sorted(floored, key=lambda t: -t[1].get("floor_us", 1e6 * t[1].get("floor_seconds", 0))
                     / max(t[1].get("model_us", 1e6 * t[1].get("model_seconds", 0)), 1e-9)):
    model = r.get("model_us", 1e6 * r.get("model_seconds", 0))
    floor = r.get("floor_us", 1e6 * r.get("floor_seconds", 0))
    print(f"  floored {p}: model {model:,.2f} us, floor {floor:,.2f} us ({floor / model:.2f}x)")
  for p, r in over:
    print(f"  OVER ROOFLINE {p}: {r['fraction_of_roofline']}")


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  if argv[:1] == ["--child"]:
    tree = os.environ.get("REFLOOR_KERNELS_TREE")
    if tree:
      sys.path.insert(0, tree)
    with open(argv[1], encoding="utf-8") as fh:
      child(json.load(fh))
    return
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("tables", nargs="+", choices=list(TABLES), help="which tables, in order")
  ap.add_argument("--limit", type=int, help="re-floor at most this many entries per table")
  ap.add_argument("--batch", type=int, default=6, help="entries per child process")
  ap.add_argument("--timeout", type=float, default=3600, help="seconds per child process")
  ap.add_argument("--max-rss-gb", type=float, default=10.0)
  ap.add_argument("--data", default=DATA, help="folder of the tables")
  ap.add_argument("--list", action="store_true", help="print the entries that would be re-floored")
  ap.add_argument("--sync", action="store_true", help="only recompute the derived fields")
  ap.add_argument("--recount", action="store_true", help="count again the floored records whose bytes an older "
                  "counter (kernels.perf.traffic.COUNTER_VERSION) counted; the floor binds there, so their time can move")
  ap.add_argument("--recount-all", action="store_true", help="count again every record an older counter counted "
                  "(their hbm_bytes are shown; a time the floor did not set stays)")
  ap.add_argument("--report", action="store_true", help="print floored and over-roofline entries")
  ap.add_argument("--kernels-tree", help="count with the kernels/ package in this folder (default: this tree's, "
                  "or the commit an entry names)")
  args = ap.parse_args(argv)
  global COUNTER, RECOUNT
  from kernels.perf import traffic
  COUNTER = traffic.COUNTER_VERSION
  RECOUNT = "all" if args.recount_all else "floored" if args.recount else None
  for name in args.tables:
    if args.report:
      report(name, args)
    elif args.sync:
      path = os.path.join(args.data, TABLES[name])
      table = result_tables.load(path)
      sync(name, table)
      result_tables.save(table, path)
    else:
      run_table(name, args)


if __name__ == "__main__":
  main()
