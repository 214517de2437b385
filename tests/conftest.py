import os
import re

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# 8 CPU devices for the multi-chip tests (tests/test_distributed.py), set before JAX starts; every
# other test runs on the first one, as before.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import kernels  # noqa: E402,F401  (before JAX initialises a backend: enables the TPU cost model)
import pytest  # noqa: E402


# Interpret mode: XLA:CPU programs compile without LLVM's optimizations (see tests/cpu_compile.py).
from tests.cpu_compile import cpu_programs_compile_unoptimized  # noqa: E402

cpu_programs_compile_unoptimized()

# The AOT tests that also run in CI's second pass (Python 3.12, newest jax), marked `aot_smoke`
# here rather than in the test files. That pass selects
#     -m "not notebook and (newest_jax or aot_smoke)"
# i.e. the unit and interpret-mode tests marked `newest_jax` (below) plus this list: the
# TPU lowering of each kernel at its defaults, forward and backward, on one generation each (spread
# over the generations), the child-process compile path (v4), the compiler-error classification
# and the cost model. The full AOT matrix (every kernel, v4/v5e/v5p/v6e, defaults and benchmark
# configurations) runs once, in `make test`. A new kernel adds its entry here.
# A run that selects `aot_smoke` fails if an entry no longer names a collected test.
AOT_SMOKE = (
    # kernels.perf.tpu: compile in process (cost-model flags) and in a child process (v4), readable
    # compiler errors, the static cost model
    "tests/test_tpu_aot.py::test_compiles_for_every_generation[v5e]",
    "tests/test_tpu_aot.py::test_compiles_for_every_generation[v4]",
    "tests/test_tpu_aot.py::test_child_compiles_share_one_worker_that_restarts_when_it_dies",
    "tests/test_tpu_aot.py::test_bad_tiling_is_a_kernel_error",
    "tests/test_tpu_aot.py::test_vmem_overflow_is_a_kernel_error[v5e]",
    "tests/test_tpu_aot.py::test_mosaic_failure_is_readable",
    "tests/test_tpu_aot.py::test_estimate_is_positive_labelled_and_below_roofline",
    "tests/test_backend.py::test_lowering_for_tpu_gets_the_mosaic_kernel",
    # one compile per kernel, forward and backward, at its defaults
    "tests/test_matmul.py::test_aot_compiles_at_defaults[v6e]",
    "tests/test_attention.py::test_aot_forward_and_backward_at_defaults[v5e]",
    "tests/test_norm.py::test_aot_compiles_forward_and_backward[v5p]",
    "tests/test_scan.py::test_aot_compiles_forward_and_backward[v6e]",
    "tests/test_rope.py::test_aot_compiles_forward_and_backward[v5p]",
    "tests/test_ssd.py::test_aot_compiles_forward_and_backward[v5e]",
    "tests/test_parallel_scan.py::test_aot_compiles_forward_and_backward[v5e]",
    "tests/test_gmm.py::test_aot_compiles_forward_and_backward[v4]",
    "tests/test_moe.py::test_aot_compiles_forward_and_backward[v5e]",
    "tests/test_fft.py::test_aot_compiles_forward_and_backward[v4-paths]",
    "tests/test_conv.py::test_aot_compiles_forward_and_backward[direct-None-v5e]",
    "tests/test_conv.py::test_aot_compiles_forward_and_backward[winograd-4-v5e]",
    "tests/test_distributed.py::test_aot_compiles_on_multichip_topologies[v5e-v5e:2x4]",
)

# The unit and interpret-mode tests CI's newest-jax pass runs, marked `newest_jax` here: what the
# jax version can break in a kernel's use (forward against its reference, gradients, composition
# with jit/vmap/grad/shard_map, the errors bad input gets) in every module, plus the cheap modules
# whole. The deeper interpret-mode properties (hypothesis shape sweeps, race detection, stale VMEM,
# float64 check_grads) test the kernels' own logic, which the version does not change: they run once,
# in `make test`. This keeps about half of that pass's CPU time (CI's 30-minute budget).
NEWEST_JAX_NAMES = re.compile(r"match|gradient|equal|compose|bad_input|reference|kernel_error")
NEWEST_JAX_MODULES = ("test_backend.py", "test_hardware_roofline.py", "test_style.py", "test_site_tools.py",
                      "test_traffic.py")

# Scheduling. xdist (`--dist loadgroup`) hands tests out one at a time, in collection order, to
# whichever worker is free: starting with the longest tests (notebooks, 1-3 min each, then the
# AOT compiles) keeps both workers busy to the end instead of leaving one with a long tail.
_ORDER = ("notebook", "tpu_aot")


def pytest_addoption(parser):
  parser.addoption(
      "--one-variant", action="store_true",
      help="run each parametrized test function with its first parameters only (CI's newest-jax pass: "
           "every code path once on the newest jax; the full parameter matrix runs in `make test`)")


def _tpu_aot_available() -> bool:
  from kernels.perf import tpu
  return tpu.available()


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the markers must be on the items by then
def pytest_collection_modifyitems(config, items):
  by_id = {item.nodeid: item for item in items}
  for nodeid in AOT_SMOKE:
    if nodeid in by_id:
      by_id[nodeid].add_marker(pytest.mark.aot_smoke)
  for item in items:
    if "tpu_aot" not in item.keywords and "notebook" not in item.keywords and (
        NEWEST_JAX_NAMES.search(getattr(item, "originalname", item.name))
        or item.nodeid.split("::")[0].endswith(NEWEST_JAX_MODULES)):
      item.add_marker(pytest.mark.newest_jax)
  if "aot_smoke" in (config.option.markexpr or "") and not any("::" in arg for arg in config.args):
    stale = [nodeid for nodeid in AOT_SMOKE if nodeid not in by_id]
    if stale:
      raise pytest.UsageError(f"tests/conftest.py AOT_SMOKE names tests that were not collected: {stale}")

  # AOT tests need libtpu (jax[tpu]); CI installs it, so there they always run.
  if any("tpu_aot" in item.keywords for item in items) and not _tpu_aot_available():
    if os.environ.get("CI"):
      raise pytest.UsageError("CI must run the AOT TPU tests, but libtpu is not installed")
    skip = pytest.mark.skip(reason="jax[tpu] (libtpu) not installed")
    for item in items:
      if "tpu_aot" in item.keywords:
        item.add_marker(skip)

  if config.getoption("one_variant"):
    seen, keep, drop = set(), [], []
    for item in items:
      fn = (item.nodeid.split("::")[0], getattr(item, "originalname", item.name))
      (drop if fn in seen and "aot_smoke" not in item.keywords else keep).append(item)
      seen.add(fn)
    if drop:
      config.hook.pytest_deselected(items=drop)
      items[:] = keep

  def rank(item):
    return next((i for i, mark in enumerate(_ORDER) if item.get_closest_marker(mark)), len(_ORDER))
  items.sort(key=rank)  # stable: within a rank, collection order
