"""Result files of the tuning and benchmark scripts (``kernels/data/*.json``).

``save`` writes through a temporary file and renames it, so a sweep killed mid-write
never leaves a truncated table; ``load`` gives ``{}`` for a table not yet written.
``rss_gb`` is a child process's resident memory: the sweeps stop a compile that
would exhaust this machine's shared RAM.
"""
from __future__ import annotations

import json
import os


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


def rss_gb(pid: int) -> float:
  """Resident memory of process ``pid`` in GiB (0 once it has exited)."""
  try:
    with open(f"/proc/{pid}/status", encoding="utf-8") as fh:
      for line in fh:
        if line.startswith("VmRSS:"):
          return int(line.split()[1]) / 2**20
  except OSError:
    pass
  return 0.0
