"""tools/fuzz.py on a small fixed-seed slice: every kernel family against its float64 oracle.

The full run is ``make fuzz`` (1000 random cases per family, minutes to an hour each); this slice
runs a few cases and malformed inputs per family, so that CI notices an oracle or a kernel drifting
apart and a fuzzer that stopped running anything.
"""
from __future__ import annotations

import importlib.util
import inspect
import json
import sys
from pathlib import Path

import jax
import pytest

import kernels

ROOT = Path(__file__).resolve().parents[1]
SEED = 0
CASES = 3      # random configurations per family
MALFORMED = 4  # malformed inputs per family


def _load(name: str, path: Path):
  # tools/ is not a package; the module is registered before it runs (its dataclasses look it up).
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  spec.loader.exec_module(module)
  return module


fuzz = _load("tools_fuzz", ROOT / "tools" / "fuzz.py")


@pytest.mark.parametrize("family", sorted(fuzz.FAMILIES))
def test_fuzz_slice_has_no_failures(family):
  lines = []
  (stats,) = fuzz.fuzz([family], SEED, CASES, MALFORMED, out=lines.append)
  assert stats.cases == CASES and stats.malformed == MALFORMED, lines  # the slice ran what it was asked to
  assert not stats.failures, "\n".join(lines)
  assert stats.passed == CASES and stats.malformed_passed == MALFORMED


def test_every_public_kernel_has_a_family():
  kernels_in_api = {name for name in kernels.__all__ if callable(getattr(kernels, name))
                    and not isinstance(getattr(kernels, name), type) and name != "dispatch"
                    and "implementation" in inspect.signature(getattr(kernels, name)).parameters}
  covered = {name for names in fuzz.COVERAGE.values() for name in names}
  assert kernels_in_api | {"route"} <= covered, sorted(kernels_in_api - covered)
  assert set(fuzz.COVERAGE) == set(fuzz.FAMILIES)


def test_a_case_reproduces_from_its_seed():
  # `--family F --seed S --case K` must rebuild the configuration that failed
  first, _ = fuzz.FAMILIES["matmul"].case(fuzz._rng(SEED, "matmul", 5, 0))
  again, _ = fuzz.FAMILIES["matmul"].case(fuzz._rng(SEED, "matmul", 5, 0))
  other, _ = fuzz.FAMILIES["matmul"].case(fuzz._rng(SEED + 1, "matmul", 5, 0))
  assert first == again and first != other


def test_a_disagreement_and_a_raw_error_are_failures(monkeypatch):
  # the harness itself: a kernel that is off by 1%, or that raises something other than a
  # KernelError on malformed input, is reported with the command that reproduces it
  real = kernels.rms_norm
  monkeypatch.setattr(kernels, "rms_norm", lambda *a, **k: jax.tree.map(lambda y: y * 1.01, real(*a, **k)))
  found = [f for f in (fuzz.run_case("norm", SEED, k) for k in range(6)) if f is not None]
  assert found and all("--family norm --seed 0 --case" in f.repro() for f in found)

  def raw(*args, **kwargs):
    raise IndexError("a raw error")
  monkeypatch.setattr(kernels, "layer_norm", raw)
  monkeypatch.setattr(kernels, "rms_norm", raw)
  bad = fuzz.run_malformed("norm", SEED, 0)
  assert bad is not None and "IndexError" in bad.error and "--malformed-case 0" in bad.repro()


def test_a_run_splits_into_pieces_that_add_up(tmp_path):
  # `--first K --cases N` runs cases K..K+N-1 and malformed inputs K/5..(K+N)/5-1, so pieces of a long run
  # split at multiples of 5 run exactly what the whole run would; `--log` keeps each family's counts
  log = tmp_path / "counts.jsonl"
  for first in (0, 5):
    assert fuzz.main(["--family", "tgmm", "--first", str(first), "--cases", "5", "--log", str(log)]) == 0
  first, second = [json.loads(line) for line in log.read_text().splitlines()]
  assert (first["first_case"], first["cases"], first["first_malformed"], first["malformed"]) == (0, 5, 0, 1)
  assert (second["first_case"], second["cases"], second["first_malformed"], second["malformed"]) == (5, 5, 1, 1)
  assert second["passed"] == 5 and second["malformed_passed"] == 1 and second["failed_cases"] == []
