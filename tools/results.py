"""Result files of the tuning and benchmark scripts (``kernels/data/*.json``).

``save`` writes through a temporary file and renames it, so a sweep killed mid-write
never leaves a truncated table; ``load`` gives ``{}`` for a table not yet written.
``rss_gb`` is a child process's resident memory: the sweeps stop a compile that
would exhaust this machine's shared RAM.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

# The method text of a record estimated as a sum of pieces (kernels.estimate_tpu_pieces).
PIECES = "sum of pieces cut at the Pallas kernels (kernels.estimate_tpu_pieces), each estimated and floored alone"


def load(path: str) -> dict:
  if os.path.exists(path):
    with open(path, encoding="utf-8") as fh:
      return json.load(fh)
  return {}


def save(table: dict, path: str) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as fh:
    json.dump(table, fh, indent=1)
    fh.write("\n")
  os.replace(tmp, path)


def _descendants(pid: int) -> list[int]:
  out, todo = [], [pid]
  while todo:
    p = todo.pop()
    try:
      for task in os.listdir(f"/proc/{p}/task"):
        with open(f"/proc/{p}/task/{task}/children", encoding="utf-8") as fh:
          kids = [int(c) for c in fh.read().split()]
          out += kids
          todo += kids
    except (OSError, ValueError):
      pass
  return out


def kill_tree(proc) -> None:
  """Kills a ``subprocess.Popen`` and every process under it, then reaps it: an estimate's own
  child (``isolate=True``) would otherwise go on computing, and growing, after its parent died."""
  for pid in _descendants(proc.pid):
    try:
      os.kill(pid, signal.SIGKILL)
    except OSError:
      pass
  proc.kill()
  proc.wait()


def rss_gb(pid: int) -> float:
  """Resident memory of process ``pid`` and its descendants in GiB (0 once it has exited): an
  estimate may compile in child processes of its own (``isolate=True``)."""
  total = 0.0
  for p in [pid, *_descendants(pid)]:
    try:
      with open(f"/proc/{p}/status", encoding="utf-8") as fh:
        total += next((int(ln.split()[1]) for ln in fh if ln.startswith("VmRSS:")), 0) / 2**20
    except (OSError, ValueError):
      pass
  return total


def physical(r: dict) -> dict:
  """``r``, unless its time is below the roofline (``fraction_of_roofline`` above 1), which no chip
  can do: then the cost model did not charge all the work (it reads scalar-prefetched tables as
  0), and the record keeps only an error and the rejected figures."""
  if r.get("fraction_of_roofline", 0) <= 1.001:
    return r
  return {"error": f"not kept: the estimate ({r['us']:,.1f} us) is below the roofline ({r['fraction_of_roofline']:.0%} "
                   "of its time), which no chip can do; the cost model did not charge all the work",
          "rejected": {k: r.get(k) for k in ("us", "model_us", "floor_us", "fraction_of_roofline", "unmodeled")}}


def run_child(argv: list[str], timeout: float = 3600) -> dict:
  """Runs ``python argv...`` (a sweep's ``one`` job, which prints its result as a JSON line) and
  returns that result, or ``{"error": ...}`` (the child's last error line) if it printed none."""
  try:
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    return {"error": f"timed out after {timeout:.0f} s"}
  lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
  if not lines:
    tail = [ln for ln in proc.stderr.splitlines() if ln.startswith("F") or "Error" in ln]
    return {"error": tail[-1][:300] if tail else f"exit {proc.returncode}"}
  return json.loads(lines[-1])


def print_result(fn, config: str) -> None:
  """A sweep's ``one`` job: prints ``fn(json.loads(config))`` as one JSON line, or the error it raised
  (what :func:`run_child` reads back in the parent)."""
  try:
    print(json.dumps(fn(json.loads(config))))
  except Exception as e:  # noqa: BLE001 - reported to the parent
    first = str(e).splitlines()[0][:300] if str(e) else ""
    print(json.dumps({"error": f"{type(e).__name__}: {first}"}))
