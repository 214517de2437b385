import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import kernels  # noqa: E402,F401  (before JAX initialises a backend: enables the TPU cost model)
import pytest  # noqa: E402


def _tpu_aot_available() -> bool:
  from kernels import tpu
  return tpu.available()


def pytest_collection_modifyitems(config, items):
  # AOT tests need libtpu (jax[tpu]); CI installs it, so there they always run.
  if any("tpu_aot" in item.keywords for item in items) and not _tpu_aot_available():
    if os.environ.get("CI"):
      raise pytest.UsageError("CI must run the AOT TPU tests, but libtpu is not installed")
    skip = pytest.mark.skip(reason="jax[tpu] (libtpu) not installed")
    for item in items:
      if "tpu_aot" in item.keywords:
        item.add_marker(skip)
