"""Process set-up that must happen before libtpu loads.

libtpu reads its flags once, when JAX first initialises a TPU backend or builds a
compile-only TPU topology. Importing :mod:`kernels` before that lets us:

* turn on the compiler's static cost model (``--xla_jf_dump_static_llo_profile_to``)
  on hosts without a TPU, writing into a dump folder private to this process;
* allow several processes to load libtpu at once (pytest workers, notebook kernels);
* keep JAX from probing for a TPU that is not there (which prints warnings).

On a host with a TPU attached nothing is changed unless ``KERNELS_STATIC_PROFILE=1``:
the cost model slows every TPU compile by an order of magnitude.
"""
from __future__ import annotations

import atexit
import glob
import os
import shutil
import sys
import tempfile

_FLAG = "--xla_jf_dump_static_llo_profile_to"
JAX_FLOOR = (0, 10, 2)  # pyproject.toml's floor, the version CI tests


def check_jax_version() -> None:
  """An ImportError that says what to do when the installed jax is older than the package supports
  (Colab's and Kaggle's TPU runtimes ship jax 0.7.2), instead of failures deep inside a kernel."""
  import importlib.metadata
  import re
  try:
    version = importlib.metadata.version("jax")
  except importlib.metadata.PackageNotFoundError:
    return  # jax's own import will say so
  found = tuple(int(p) for p in re.findall(r"\d+", version)[:3])
  if found < JAX_FLOOR:
    floor = ".".join(map(str, JAX_FLOOR))
    raise ImportError(f"kernels needs jax >= {floor}, found jax {version}: run `pip install -U \"jax[tpu]>={floor}\"` "
                      "(on Colab or Kaggle, then restart the runtime)")


def tpu_attached() -> bool:
  """True if this host has a TPU device node (TPU VMs, Colab and Kaggle TPU runtimes)."""
  if os.environ.get("KERNELS_ASSUME_TPU") == "1":
    return True
  if glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*"):
    return True
  if any(os.environ.get(v) for v in ("TPU_ACCELERATOR_TYPE", "TPU_NAME", "COLAB_TPU_ADDR", "TPU_WORKER_HOSTNAMES")):
    return True
  for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):  # TPU chips are Google (0x1ae0) PCI devices
    try:
      with open(vendor) as fh:
        if fh.read().strip() == "0x1ae0":
          return True
    except OSError:
      pass
  return False


def _libtpu_loaded() -> bool:
  # jax keeps initialised PJRT plugins here; the tpu plugin means libtpu read its flags.
  xb = sys.modules.get("jax._src.xla_bridge")
  if xb is None:
    return False
  return "tpu" in getattr(xb, "_backends", {}) or "tpu" in getattr(xb, "_plugins_initialized", set())


def _profile_dir_from_flags() -> str | None:
  for tok in os.environ.get("LIBTPU_INIT_ARGS", "").split():
    if tok.startswith(_FLAG + "="):
      return tok.split("=", 1)[1]
  return None


def setup() -> str | None:
  """Prepares the environment; returns the static-profile dump folder, if enabled."""
  want = os.environ.get("KERNELS_STATIC_PROFILE")
  on_tpu = tpu_attached()
  enable = want == "1" or (want is None and not on_tpu)
  if not on_tpu:
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("TPU_STDERR_LOG_LEVEL", "3")
    if "JAX_PLATFORMS" not in os.environ and "jax" not in sys.modules:
      # Without a TPU, JAX would still try the TPU plugin for its default backend.
      # Compile-only TPU devices (kernels.perf.tpu) do not need that backend.
      if not _gpu_plugin_installed():
        os.environ["JAX_PLATFORMS"] = "cpu"
    elif "jax" in sys.modules and not os.environ.get("JAX_PLATFORMS"):
      _restrict_jax_to_cpu_if_uninitialised()
  if want == "0":  # also strips a flag inherited from a parent process
    os.environ["LIBTPU_INIT_ARGS"] = " ".join(
        t for t in os.environ.get("LIBTPU_INIT_ARGS", "").split() if not t.startswith(_FLAG + "="))
    return None
  existing = _profile_dir_from_flags()
  inherited = existing and os.path.basename(existing).startswith("kernels-llo-") and \
      not os.path.basename(existing).startswith(f"kernels-llo-{os.getpid()}-")
  if existing and not inherited:
    return existing  # set by the user, or by an earlier import in this process
  if _libtpu_loaded():
    return existing or None
  others = [t for t in os.environ.get("LIBTPU_INIT_ARGS", "").split() if not t.startswith(_FLAG + "=")]
  if not enable:
    os.environ["LIBTPU_INIT_ARGS"] = " ".join(others)
    return None
  # One folder per process: a parent's folder (inherited through the environment) is not ours.
  folder = tempfile.mkdtemp(prefix=f"kernels-llo-{os.getpid()}-")
  atexit.register(shutil.rmtree, folder, ignore_errors=True)
  # --undefok: a libtpu without the cost model (jax 0.7's libtpu 0.0.23) would otherwise print
  # "ERROR: Unknown command line flag" and exit(1) when it loads; with it, it ignores the flag
  # (and writes no profile: see static_profiler_in_libtpu).
  undefok = f"--undefok={_FLAG[2:]}"
  others = [t for t in others if t != undefok]
  os.environ["LIBTPU_INIT_ARGS"] = " ".join(others + [f"{_FLAG}={folder}", undefok])
  return folder


def static_profiler_in_libtpu() -> bool:
  """True if the installed libtpu knows the cost model's flag (libtpu 0.0.23, jax 0.7's, does not)."""
  global _HAS_PROFILER
  if _HAS_PROFILER is None:
    import importlib.util
    import mmap
    try:
      path = os.environ.get("TPU_LIBRARY_PATH")  # where jax itself looks first
      if not path:
        spec = importlib.util.find_spec("libtpu")
        path = os.path.join(os.path.dirname(spec.origin), "libtpu.so")
      with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as m:
        _HAS_PROFILER = m.find(_FLAG[2:].encode()) >= 0
    except (AttributeError, TypeError, OSError, ValueError):
      _HAS_PROFILER = False
  return _HAS_PROFILER


_HAS_PROFILER: bool | None = None


def _gpu_plugin_installed() -> bool:
  import importlib.util
  return any(importlib.util.find_spec(m) is not None
             for m in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin"))


def _restrict_jax_to_cpu_if_uninitialised() -> None:
  try:
    import jax
    from jax._src import xla_bridge as xb
    if not getattr(xb, "_backends", None) and not _gpu_plugin_installed():
      jax.config.update("jax_platforms", "cpu")
  except Exception:  # pragma: no cover - best effort, never fatal
    pass


check_jax_version()
STATIC_PROFILE_DIR = setup()
