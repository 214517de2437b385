"""Compile for TPU and estimate TPU time on a host that has no TPU.

* :func:`compile_for_tpu` runs the real Mosaic and XLA:TPU compilers against a
  compile-only TPU device (``jax.experimental.topologies``). VMEM overflows, bad
  tilings and unsupported ops fail here exactly as they would on a TPU.
* :func:`estimate_tpu` reads the compiler's static cost model: with
  ``--xla_jf_dump_static_llo_profile_to`` set before libtpu loads (``import kernels``
  does it on hosts without a TPU), every compile writes ``estimated_cycles`` per op.
  Cycles divided by the chip clock give the model's time. The model's faults, and what
  :class:`Estimate` does about each:

  - its HBM is faster than the chip's, and it rewards DMAs in flight beyond what HBM
    delivers (a plain copy comes out at about 2x the published bandwidth on v5e and
    v6e): ``seconds`` is floored at the program's HBM bytes (:func:`hbm_traffic`,
    counted from the program) over the published bandwidth;
  - it charges a while loop's body once: each op's cycles are multiplied by its loop's
    trip count, read from the compiled HLO;
  - it charges collectives (and some convolution fusions) 0 cycles: they are listed in
    ``unmodeled`` and the estimate is marked incomplete;
  - it reads scalar-prefetched values as 0 and evaluates scalar div/rem as 0, so control
    flow that depends on them is not simulated: an estimate faster than the roofline is
    flagged invalid;
  - it aborts the process on a few programs (``isolate=True`` contains that).
* :func:`hbm_traffic` counts the bytes a compiled program moves between HBM and the chip.
* :func:`estimate_tpu_pieces` estimates a program as the sum of its pieces cut at its
  Pallas kernels, for programs whose profiled compile fails though the plain one passes.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import hashlib
import json
import os
import re
import tempfile
import threading
import time
from typing import Any, Callable

import jax
import numpy as np

from kernels.base import env as _env
from kernels.perf import traffic
from kernels.base.backend import target
from kernels.base.errors import CompileError, EstimatorUnavailableError, KernelError
from kernels.base.hardware import TPU_GENERATIONS, Chip, get_chip
from kernels.base.roofline import Roofline, roofline

_lock = threading.RLock()


@contextlib.contextmanager
def _quiet_stderr():
  """Sends C-level stderr (libtpu's host warnings) to a file; yields a reader for it.

  The file is named (``$TMPDIR/kernels-libtpu-stderr-<pid>-*.log``) and removed on the way out: if
  libtpu ends the process inside (an unknown flag's exit(1), a compiler CHECK failure's abort), its
  last words stay there instead of vanishing with an anonymous file."""
  sink = tempfile.NamedTemporaryFile(mode="w+b", prefix=f"kernels-libtpu-stderr-{os.getpid()}-", suffix=".log",
                                     delete=False)
  try:
    with sink:
      try:
        saved = os.dup(2)
      except OSError:  # pragma: no cover - no fd 2
        yield lambda: ""
        return
      os.dup2(sink.fileno(), 2)
      try:
        yield lambda: (sink.seek(0), sink.read().decode(errors="replace"))[1]
      finally:
        os.dup2(saved, 2)
        os.close(saved)
  finally:  # (not reached when libtpu ends the process: the file keeps what it said)
    os.remove(sink.name)


@functools.cache
def tpu_device(generation: str = "v5e") -> jax.Device:
  """A compile-only TPU device of ``generation`` (v4, v5e, v5p or v6e)."""
  chip = get_chip(generation)
  if chip.name not in TPU_GENERATIONS:
    raise KernelError("generation", generation, f"must be a TPU generation, one of {TPU_GENERATIONS}")
  from jax.experimental import topologies
  errors = []
  with _lock, _quiet_stderr():
    for name in chip.topologies:
      try:
        return topologies.get_topology_desc(topology_name=name, platform="tpu").devices[0]
      except Exception as e:  # noqa: BLE001 - try the next spelling
        errors.append(f"{name}: {str(e).splitlines()[0][:200]}")
  raise RuntimeError(f"no compile-only TPU {chip.name} device (is jax[tpu] installed?): " + "; ".join(errors))


def available() -> bool:
  """True if libtpu is installed, so TPU programs can be compiled here."""
  try:
    tpu_device("v5e")
    return True
  except Exception:  # noqa: BLE001
    return False


@functools.cache
def tpu_mesh(topology: str, axis_names: tuple[str, ...] = ("x",), shape: tuple[int, ...] | None = None, *,
             explicit: bool = False):
  """A :class:`jax.sharding.Mesh` of compile-only TPU devices of a multi-chip ``topology`` (e.g.
  ``"v5e:2x4"``, Kaggle's v5e-8; ``"v5p:2x2x2"``), its devices in the topology's order reshaped to
  ``shape`` (default: one axis); its axes are ``AxisType.Explicit`` if ``explicit``, else Auto. Give
  :func:`compile_for_tpu` arguments sharded on it (``jax.ShapeDtypeStruct(..., sharding=NamedSharding(mesh,
  spec))``) to compile a multi-chip program."""
  from jax.experimental import topologies
  with _lock, _quiet_stderr():
    devices = topologies.get_topology_desc(topology_name=topology, platform="tpu").devices
  shape = shape or (len(devices),)
  if int(np.prod(shape)) != len(devices) or len(shape) != len(axis_names):
    raise KernelError("shape", shape, f"must have one size per axis name {axis_names} and hold the "
                      f"{len(devices)} devices of {topology}")
  kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
  mesh = jax.sharding.Mesh(np.array(devices).reshape(shape), tuple(axis_names), axis_types=(kind,) * len(shape))
  _mesh_topology[mesh] = f"{topology} {','.join(axis_names)} {','.join(map(str, shape))}" + (" explicit" if explicit else "")
  return mesh


_mesh_topology: dict = {}  # tpu_mesh -> "topology axes shape", how a child process rebuilds it


def _multichip_mesh(args):
  """The :func:`tpu_mesh` that arguments are sharded on, if any (a multi-chip program)."""
  for x in jax.tree.leaves(args):
    sharding = getattr(x, "sharding", None)
    if getattr(sharding, "num_devices", 1) > 1:
      return sharding.mesh
  return None


def _on(device) -> jax.sharding.NamedSharding:
  return jax.sharding.NamedSharding(jax.sharding.Mesh(np.array([device]), ("x",)), jax.sharding.PartitionSpec())


def _abstract(args, device) -> Any:
  sharding = _on(device)

  def leaf(x):
    if getattr(getattr(x, "sharding", None), "num_devices", 1) > 1:
      return x  # placed on a multi-chip mesh by the caller
    if hasattr(x, "shape") and hasattr(x, "dtype"):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    return x
  return jax.tree.map(leaf, args)


@dataclasses.dataclass
class TpuCompilation:
  """A program compiled for a TPU generation."""

  generation: str
  compiled: Any
  """The :class:`jax.stages.Compiled` object (None when compiled in a child process)."""
  hlo: str
  """Optimised HLO text of the compiled module."""
  vmem_bytes: int | None
  """Scoped VMEM reserved by the program's most demanding op, Pallas kernel or XLA fusion
  (``used_scoped_memory_configs`` in the compiled HLO), or None if no op reports it."""
  memory: dict
  """``memory_analysis()`` of the program in bytes: argument, output, temp, generated code."""
  compile_seconds: float

  def __str__(self) -> str:
    vmem = "n/a" if self.vmem_bytes is None else f"{self.vmem_bytes / 2**20:.2f} MiB"
    return (f"compiled for TPU {self.generation} in {self.compile_seconds:.1f} s; kernel VMEM {vmem}; "
            f"temp HBM {self.memory.get('temp', 0) / 2**20:.1f} MiB")


def _vmem_from_hlo(hlo: str) -> int | None:
  sizes = []
  for block in re.findall(r'used_scoped_memory_configs\\?"\s*:\s*\[(.*?)\]', hlo):
    total = 0
    for space, size in re.findall(r'memory_space\\?"\s*:\s*\\?"(\d+)\\?"[^}]*?size\\?"\s*:\s*\\?"(\d+)', block):
      if space == "1":  # VMEM
        total += int(size)
    sizes.append(total)
  return max(sizes) if sizes else None


def _memory(compiled) -> dict:
  try:
    m = compiled.memory_analysis()
  except Exception:  # noqa: BLE001
    return {}
  if m is None:
    return {}
  return {"argument": m.argument_size_in_bytes, "output": m.output_size_in_bytes,
          "temp": m.temp_size_in_bytes, "generated_code": m.generated_code_size_in_bytes}


_VMEM_PAT = re.compile(r"(vmem|scoped vmem|VMEM)", re.I)


def _readable(e: Exception, generation: str) -> CompileError:
  text = str(e)
  lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
  if "Ran out of memory in memory space vmem" in text or "scoped vmem limit" in text or "exceed memory" in text and _VMEM_PAT.search(text):
    m = (re.search(r"Scoped allocation with size ([\d.]+\w?) and limit ([\d.]+\w?)", text)
         or re.search(r"Used ([\d.]+\w?) of ([\d.]+\w?) vmem", text))
    what = f"needs {m.group(1)} of VMEM but the limit is {m.group(2)}" if m else "out of VMEM"
    err = CompileError(f"{what}: use smaller blocks or raise vmem_limit_bytes", generation=generation, details=text)
    err.kind = "vmem"
    return err
  if "block shape" in text and "divisible by" in text:
    err = CompileError(lines[0], generation=generation, details=text)
    err.kind = "tiling"
    return err
  key = next((ln for ln in lines if "Mosaic failed" in ln or "Not implemented" in ln or "error" in ln.lower()),
             lines[0] if lines else type(e).__name__)
  detail = next((ln for ln in lines if ln.startswith("Not implemented") or "MLIR operation" in ln), "")
  err = CompileError(f"{type(e).__name__}: {key}" + (f" ({detail})" if detail and detail != key else ""),
                     generation=generation, details=text)
  err.kind = "mosaic" if "Mosaic" in text else "xla"
  return err


def _plain(args):
  """``args`` as unsharded ShapeDtypeStructs (for tracing)."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x, args)


def dynamic_grid_kernels(f, args, chip) -> list[str]:
  """The Pallas kernels of ``f(*args)`` whose grid has a run-time bound (e.g. :func:`kernels.gmm`'s
  visit axis). libtpu's static profiler can abort the process on them (seen compiling in this
  process), so such programs are compiled without it, and estimated in a child process."""
  plain = _plain(args)
  try:
    with _lock, target(chip):
      jaxpr = jax.make_jaxpr(f)(*plain)
  except Exception:  # noqa: BLE001 - the compile that follows reports it
    return []
  return [str(e.params.get("name") or "pallas_call")
          for e in traffic.pallas_calls(jaxpr) if e.params["grid_mapping"].num_dynamic_grid_bounds]


# The static profiler aborts the whole process when it meets a chip it cannot model
# (v4: "Dma latency model is currently only supported on VF/VL/GF/GL"). While it is on,
# other generations compile in a child process without it (see _compile_elsewhere).
PROFILED_GENERATIONS = ("v5e", "v5p", "v6e")


class _Worker:
  """One long-lived child process that compiles exported programs without the profiler.

  Started on first use and restarted after ``RECYCLE`` compiles or past ``MAX_RSS`` bytes
  (JAX's caches grow with every program; CI machines have little memory to spare) or if
  it dies; its stdin closing (this process exiting) ends it.
  """

  RECYCLE = 40
  MAX_RSS = 3 << 30

  def __init__(self):
    self._proc = None
    self._served = 0
    self._lock = threading.Lock()

  def _start(self):
    import subprocess
    import sys
    env = dict(os.environ, KERNELS_STATIC_PROFILE="0", JAX_PLATFORMS="cpu")
    self._stderr = tempfile.TemporaryFile(mode="w+")
    self._proc = subprocess.Popen([sys.executable, "-m", "kernels.perf.compile_worker", "--serve"], env=env, text=True,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr)
    self._served = 0

  def _stop(self):
    if self._proc is not None:
      self._proc.stdin.close()
      self._proc.wait()
      self._proc = None
      self._stderr.close()

  def _rss(self) -> int:
    try:
      with open(f"/proc/{self._proc.pid}/status") as fh:
        return next(int(ln.split()[1]) << 10 for ln in fh if ln.startswith("VmRSS:"))
    except (OSError, StopIteration):
      return 0

  def request(self, path: str, generation: str, topology: str | None = None) -> dict:
    with self._lock:
      if (self._proc is None or self._proc.poll() is not None or self._served >= self.RECYCLE
          or self._rss() > self.MAX_RSS):
        self._stop()
        self._start()
      self._served += 1
      try:
        self._proc.stdin.write(f"{path} {generation} {topology or ''}\n")
        self._proc.stdin.flush()
        while True:
          line = self._proc.stdout.readline()
          if not line or line.startswith("{"):
            break
      except BrokenPipeError:
        line = ""
      if not line:  # it died: report its last words and start afresh next time
        code = self._proc.wait()
        self._stderr.seek(0)
        last_words = self._stderr.read()[-2000:]
        self._stderr.close()
        self._proc = None
        raise RuntimeError(f"TPU {generation} compile worker died (exit {code}): {last_words}")
      return json.loads(line)


_compile_worker = _Worker()


def _compile_elsewhere(f, args, chip: Chip, mode: str = "compile", topology: str | None = None) -> TpuCompilation:
  """Exports the program for TPU here, then compiles it in a child process: without the
  profiler (``mode="compile"``), or with it (``"estimate"``; the profile lands in ``_profiles``)."""
  import subprocess
  import sys
  from jax import export
  t0 = time.perf_counter()
  plain = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)
                                                      if topology else None) if hasattr(x, "shape") else x, args)
  with _lock, target(chip):
    try:
      # The blob is compiled at once by this same JAX, so custom calls without a stability
      # guarantee across versions (ragged_all_to_all) are fine.
      blob = export.export(f, platforms=("tpu",), disabled_checks=[
          export.DisabledSafetyCheck.custom_call("ragged_all_to_all")])(*plain).serialize()
    except KernelError:
      raise
    except Exception as e:  # noqa: BLE001
      raise _readable(e, chip.name) from e
  with tempfile.NamedTemporaryFile(suffix=".jaxexport", delete=False) as fh:
    fh.write(blob)
  try:
    if mode == "compile":
      out = _compile_worker.request(fh.name, chip.name, topology)
    else:  # the profiler may abort its process: one process per estimate
      env = dict(os.environ, KERNELS_STATIC_PROFILE="1", JAX_PLATFORMS="cpu")
      proc = subprocess.run([sys.executable, "-m", "kernels.perf.compile_worker", fh.name, chip.name, mode],
                            capture_output=True, text=True, env=env, timeout=3600)
      lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
      if not lines:
        raise RuntimeError(f"TPU {chip.name} static cost model failed in its child process "
                           f"(exit {proc.returncode}): {proc.stderr[-2000:]}")
      out = json.loads(lines[-1])
  finally:
    os.remove(fh.name)
  if out["ok"] is None:
    raise RuntimeError(f"TPU {chip.name} compile worker: {out['message']}")
  if not out["ok"]:
    err = CompileError(out["message"], generation=chip.name, details=out.get("details", ""))
    err.kind = out.get("kind", "xla")
    raise err
  if out.get("ops"):
    _profiles[_profile_key(chip.name, out["hlo"])] = {k: int(v) for k, v in out["ops"].items()}
  return TpuCompilation(chip.name, None, out["hlo"], out["vmem_bytes"], out["memory"], time.perf_counter() - t0)


def compile_for_tpu(fn: Callable, *args, generation: str = "v5e", profile: bool = True,
                    **kwargs) -> TpuCompilation:
  """Compiles ``fn(*args, **kwargs)`` for a TPU ``generation`` on any host.

  ``args`` may be arrays or :class:`jax.ShapeDtypeStruct` (pytrees allowed); ``kwargs``
  are static. Kernels traced here see :func:`kernels.base.backend.target_chip` ==
  ``generation`` and pick that generation's defaults. Compiler failures become a
  :class:`~kernels.base.errors.CompileError` (a :class:`KernelError`) whose ``kind`` is
  ``"vmem"``, ``"tiling"``, ``"mosaic"`` or ``"xla"``.

  Arguments sharded on a :func:`tpu_mesh` compile a multi-chip program (without the profiler: the
  cost model charges collectives nothing, see :mod:`kernels.perf.ici`).
  ``profile=False`` compiles in a child process without the cost model's profiling
  flags (where this process has them): much faster for a large program whose memory
  or HLO is all that is wanted, but :func:`estimate_tpu` cannot reuse the compilation.
  """
  chip = get_chip(generation)
  f = jax.jit(functools.partial(fn, **kwargs)) if kwargs else jax.jit(fn)
  mesh = _multichip_mesh(args)
  if (_env.STATIC_PROFILE_DIR is not None and os.environ.get("KERNELS_STATIC_PROFILE") != "0"
      and (not profile or chip.name not in PROFILED_GENERATIONS or mesh is not None
           or dynamic_grid_kernels(f, args, chip))):
    # Multi-chip programs too: the cost model cannot time their collectives, and profiling makes
    # their compiles about 6x slower. A run-time grid bound can make the profiler abort.
    return _compile_elsewhere(f, args, chip, topology=_mesh_topology.get(mesh) if mesh is not None else None)
  device = tpu_device(chip.name)
  abstract = _abstract(args, device)
  if not any(hasattr(x, "shape") for x in jax.tree.leaves(abstract)):
    # No argument to carry the TPU placement (a program of constants, e.g. a piece cut from
    # one): jit would lower it for the default CPU backend.
    f = jax.jit(functools.partial(fn, **kwargs) if kwargs else fn, out_shardings=_on(device))
  t0 = time.perf_counter()
  folder = _env.STATIC_PROFILE_DIR
  with _lock, target(chip), _quiet_stderr():
    if folder:
      for path in glob.glob(os.path.join(folder, "*")):
        os.remove(path)
    try:
      compiled = f.lower(*abstract).compile()
    except KernelError:
      raise
    except Exception as e:  # noqa: BLE001 - every compiler failure gets a readable error
      raise _readable(e, chip.name) from e
    hlo = compiled.as_text() or ""
    if folder:
      # Remember the cost profile: JAX reuses executables, and a reused one writes none.
      ops = _read_profile(folder)
      key = _profile_key(chip.name, hlo)
      if ops:
        _profiles[key] = ops
  return TpuCompilation(chip.name, compiled, hlo, _vmem_from_hlo(hlo), _memory(compiled),
                        time.perf_counter() - t0)


# --- the static cost model --------------------------------------------------------


@dataclasses.dataclass
class Estimate:
  """A **compiler estimate** of TPU run time (never a measurement), floored by bandwidth.

  ``seconds`` is the headline: the cost model's time, but never less than the program's
  HBM bytes divided by the chip's published bandwidth. The model alone
  (``model_seconds``) lets memory-bound programs move bytes faster than any TPU can.
  Even the floor is optimistic: a clean published copy sweep on a TPU reached 87% of the
  spec bandwidth on large arrays, and less below 32 MiB.
  """

  generation: str
  cycles: int
  """The cost model's cycles, each op's multiplied by how often it runs (loop trip counts)."""
  ops: dict[str, int]
  """Cycles per HLO op as charged (Pallas kernels appear under their kernel name)."""
  clock_hz: float
  roofline: Roofline | None = None
  compile_seconds: float = 0.0
  vmem_bytes: int | None = None
  hbm_bytes: float = 0.0
  """Bytes the compiled program moves between HBM and the chip (:mod:`kernels.perf.traffic`)."""
  hbm_bandwidth: float = 0.0
  """The chip's published HBM bandwidth, bytes/s."""
  bytes_method: str = "counted"
  """``"counted"`` from the program; ``"partly compulsory"`` when some parts could not be
  walked and count each input once and each output once; ``"compulsory"`` for all of it."""
  unmodeled: list[str] = dataclasses.field(default_factory=list)
  """Ops that do real work but that the model charged 0 cycles (collectives, some
  convolution fusions) or charged once for many runs (loops of unknown trip count)."""
  notes: list[str] = dataclasses.field(default_factory=list)
  pieces: list[tuple[str, "Estimate"]] = dataclasses.field(default_factory=list)
  """For :func:`estimate_tpu_pieces`: each piece's own estimate, in program order."""

  @property
  def model_seconds(self) -> float:
    """The cost model's own time (never the headline)."""
    return self.cycles / self.clock_hz

  @property
  def floor_seconds(self) -> float:
    """``hbm_bytes`` at the published HBM bandwidth."""
    return self.hbm_bytes / self.hbm_bandwidth if self.hbm_bandwidth else 0.0

  @property
  def seconds(self) -> float:
    """The floored estimate: ``max(model_seconds, floor_seconds)``; for pieces, the sum of
    each piece's (they run one after another, each bound by its own compute or bytes)."""
    if self.pieces:
      return sum(p.seconds for _, p in self.pieces)
    return max(self.model_seconds, self.floor_seconds)

  @property
  def floored(self) -> bool:
    """True when the bandwidth floor, not the model, sets ``seconds`` (of some piece)."""
    if self.pieces:
      return any(p.floored for _, p in self.pieces)
    return self.floor_seconds > self.model_seconds

  @property
  def complete(self) -> bool:
    """False when the model left real work uncharged (see ``unmodeled``): such an estimate
    is a lower bound and cannot meet a target."""
    return not self.unmodeled

  @property
  def label(self) -> str:
    return f"compiler estimate, TPU {self.generation}"

  @property
  def fraction_of_roofline(self) -> float | None:
    """Roofline time / estimated time (1.0 = at the bound); None without flops/bytes."""
    return None if self.roofline is None else self.roofline.fraction(self.seconds)

  @property
  def valid(self) -> bool:
    """False when the estimate beats the roofline, which no real run can (the cost model
    did not see data-dependent control flow, e.g. scalar-prefetched block tables), or is
    incomplete."""
    f = self.fraction_of_roofline
    return self.complete and (f is None or f <= 1.0 + 1e-9)

  @property
  def flops_per_second(self) -> float | None:
    return None if self.roofline is None else self.roofline.flops / self.seconds

  def as_dict(self) -> dict:
    return {"generation": self.generation, "kind": "compiler estimate (floored)", "seconds": self.seconds,
            "model_seconds": self.model_seconds, "floor_seconds": self.floor_seconds,
            "hbm_bytes": self.hbm_bytes, "bytes_method": self.bytes_method, "floored": self.floored,
            "cycles": self.cycles, "fraction_of_roofline": self.fraction_of_roofline, "valid": self.valid,
            "complete": self.complete, "unmodeled": list(self.unmodeled)}

  def record(self) -> dict:
    """The fields a stored table keeps (``kernels/data/*.json``): ``us`` is the floored
    estimate; the model's own time and the floor stay beside it."""
    r = {"us": round(self.seconds * 1e6, 3), "model_us": round(self.model_seconds * 1e6, 3),
         "floor_us": round(self.floor_seconds * 1e6, 3), "hbm_bytes": int(self.hbm_bytes),
         "bytes_method": self.bytes_method, "counter": traffic.COUNTER_VERSION, "floored": self.floored,
         "valid": self.valid}
    if self.fraction_of_roofline is not None:
      r["fraction_of_roofline"] = round(self.fraction_of_roofline, 4)
    if self.unmodeled:
      r["unmodeled"] = list(self.unmodeled)
    if self.pieces:
      r["pieces"] = [dict(name=n, kernel=n.split(":", 1)[1] not in ("xla", "dot"),
                          **{k: p.record()[k] for k in ("us", "model_us", "floor_us")}) for n, p in self.pieces]
    return r

  def __str__(self) -> str:
    s = f"{self.seconds * 1e6:,.1f} us ({self.label}"
    if self.floored:
      s += (f"; floored: {self.hbm_bytes / 2**20:,.1f} MiB at the published {self.hbm_bandwidth / 1e9:,.0f} GB/s, "
            f"the cost model said {self.model_seconds * 1e6:,.1f} us")
    s += ")"
    f = self.fraction_of_roofline
    if f is not None:
      s += f", {100 * f:.1f}% of roofline"
      if f > 1.0 + 1e-9:
        s += " -- INVALID: faster than the roofline; the cost model missed data-dependent control flow"
    if self.unmodeled:
      s += f" -- INCOMPLETE: not charged by the model: {', '.join(self.unmodeled[:4])}"
    return s


_HLO_OP = re.compile(r'hlo_op_estimate\s*\{[^}]*?hlo_op_name:\s*"([^"]*)"[^}]*?estimated_cycles:\s*(\d+)', re.S)
_profiles: dict[str, dict[str, int]] = {}  # cost profile per compiled program


def _profile_key(generation: str, hlo: str) -> str:
  return hashlib.sha256((generation + hlo).encode()).hexdigest()


def _read_profile(folder: str) -> dict[str, int]:
  ops: dict[str, int] = {}
  for path in sorted(glob.glob(os.path.join(folder, "*.textproto"))):
    with open(path, encoding="utf-8", errors="replace") as fh:
      for name, cycles in _HLO_OP.findall(fh.read()):
        ops[name] = ops.get(name, 0) + int(cycles)
  return ops


def estimator_available() -> bool:
  """True if this process can produce compiler estimates (libtpu installed and with the cost model,
  flag set before it loaded)."""
  return _env.STATIC_PROFILE_DIR is not None and _env.static_profiler_in_libtpu() and available()


def hbm_traffic(fn: Callable, *args, generation: str = "v5e", compilation: TpuCompilation | None = None,
                **kwargs) -> traffic.Traffic:
  """Counts the HBM bytes ``fn(*args, **kwargs)`` moves on ``generation`` (compiling it
  unless ``compilation`` is given): Pallas calls by walking their grids, XLA ops from the
  optimised HLO, loop bodies times their trip counts."""
  chip = get_chip(generation)
  comp = compilation or compile_for_tpu(fn, *args, generation=chip.name, **kwargs)
  f = functools.partial(fn, **kwargs) if kwargs else fn
  plain = _plain(args)
  notes: list[str] = []
  pallas: dict[str, traffic.PallasTraffic] = {}
  partial = False
  if "tpu_custom_call" in comp.hlo:
    try:
      with _lock, target(chip):
        jaxpr = jax.make_jaxpr(f)(*plain)
      walked = [traffic.pallas_call_traffic(e) for e in traffic.pallas_calls(jaxpr)]
      for name, t in traffic.match_pallas(comp.hlo, walked).items():
        pallas[name] = t
        notes += t.notes
        partial |= not t.walked
    except Exception as e:  # noqa: BLE001 - counting never blocks an estimate
      notes.append(f"Pallas calls not walked ({type(e).__name__}: {str(e)[:200]}); charged once")
  t = traffic.hlo_traffic(comp.hlo, pallas)
  partial |= any("not walked" in n for n in t.notes)
  return dataclasses.replace(t, notes=notes + t.notes, method="partly compulsory" if partial else "counted")


# libtpu's cost model aborts on some programs; the message says which are known to.
_KNOWN_ABORTS = {
    "Unsupported DMA direction": ("libtpu's cost model aborts on this program ('Unsupported DMA direction'); "
                                  "known for lax.ragged_dot and megablox's group-table code on v5e"),
    "No DMA issue node found": ("libtpu's cost model aborts when a kernel waits in one grid step for a DMA "
                                "started in an earlier one ('No DMA issue node found for sync flag')"),
}


def estimate_tpu(fn: Callable, *args, generation: str = "v5e", flops: float | None = None,
                 bytes_accessed: float | None = None, dtype="bfloat16", isolate: bool = False,
                 **kwargs) -> Estimate:
  """The TPU compiler's static estimate of ``fn(*args, **kwargs)`` on ``generation``, floored.

  ``seconds`` is ``max(model time, hbm_bytes / published bandwidth)``, with ``hbm_bytes``
  counted from the compiled program (:func:`hbm_traffic`) and the model's cycles of each
  op multiplied by its loop trip count (the model charges a loop body once). Ops the
  model charged 0 cycles though they do real work are listed in ``unmodeled``.

  With ``flops`` and ``bytes_accessed`` the result carries the roofline, the fraction
  of it reached, and ``valid=False`` if the estimate is impossibly fast. The cost of
  estimating grows with the number of grid steps: keep grids in the low thousands.

  ``isolate=True`` exports the program and estimates it in a child process. libtpu's
  cost model aborts the whole process on a few programs; isolated, that becomes a
  ``RuntimeError`` here. It also returns the child's memory to the system afterwards,
  which matters for large problems (an 8192^3 matmul takes several GB).
  """
  folder = _env.STATIC_PROFILE_DIR
  if folder is None and not isolate:
    raise EstimatorUnavailableError(
        "the TPU compiler's static cost model is off in this process: import kernels before JAX "
        "initialises a TPU backend, and on a TPU host set KERNELS_STATIC_PROFILE=1 first")
  if not _env.static_profiler_in_libtpu():
    import importlib.metadata
    raise EstimatorUnavailableError(
        f"the installed libtpu ({importlib.metadata.version('libtpu')}, jax {jax.__version__}) has no static "
        f"cost model ({_env._FLAG}): estimates need a newer jax[tpu]; compile_for_tpu still works")
  chip = get_chip(generation)
  if chip.name not in PROFILED_GENERATIONS:
    raise EstimatorUnavailableError(
        f"the TPU compiler's cost model cannot model TPU {chip.name} (libtpu: 'Dma latency model is only "
        f"supported on' {', '.join(PROFILED_GENERATIONS)}); compile_for_tpu still compiles for it")
  f = jax.jit(functools.partial(fn, **kwargs)) if kwargs else jax.jit(fn)
  # A run-time grid bound can make libtpu's profiler abort the process: estimate it in a child.
  if isolate or dynamic_grid_kernels(f, args, chip):
    try:
      comp = _compile_elsewhere(f, args, chip, mode="estimate")
    except RuntimeError as e:
      known = next((why for key, why in _KNOWN_ABORTS.items() if key in str(e)), None)
      if known:
        raise RuntimeError(f"{known}. {e}") from e
      raise
  else:
    comp = compile_for_tpu(fn, *args, generation=chip.name, **kwargs)
  ops = _profiles.get(_profile_key(chip.name, comp.hlo))
  if not ops:
    raise EstimatorUnavailableError(
        f"libtpu wrote no static profile to {folder}: it was probably loaded before kernels set "
        "LIBTPU_INIT_ARGS (import kernels first, in a fresh process)")
  t = hbm_traffic(fn, *args, generation=chip.name, compilation=comp, **kwargs)
  charged = {name: c * t.multiplicity.get(name, 1) for name, c in ops.items()}
  # collectives, convolutions and Pallas kernels the model charged nothing (it does that silently to
  # some kernels, e.g. one writing a 5-D block) though they move bytes
  unmodeled = [n for n in t.collectives + t.convolutions + t.pallas_calls
               if ops.get(n, 0) == 0 and t.by_op.get(n, 0) > 0]
  unmodeled += [n.split(": ")[0] for n in t.notes if "trip count unknown" in n]
  if sum(ops.values()) <= 0 and not unmodeled:
    raise EstimatorUnavailableError(
        f"the static profile of this program on TPU {chip.name} adds up to 0 cycles "
        f"(ops: {', '.join(sorted(ops)[:5])}): the cost model did not model it, so there is no estimate")
  notes = list(t.notes)
  for n in unmodeled:
    if n in t.fusion_cycles:
      notes.append(f"{n}: charged 0 cycles by the profile; the compiler's fusion cost model says "
                   f"{t.fusion_cycles[n]:,} cycles (not validated, not counted)")
  if t.method != "counted":
    notes.append("some traffic counted as compulsory bytes (each input read once, each output written once)")
  rl = roofline(flops, bytes_accessed, chip, dtype) if flops is not None and bytes_accessed is not None else None
  return Estimate(chip.name, sum(charged.values()), charged, chip.clock_hz, rl, comp.compile_seconds,
                  comp.vmem_bytes, t.hbm_bytes, chip.hbm_bandwidth, t.method, unmodeled, notes)


def estimate_tpu_pieces(fn: Callable, *args, generation: str = "v5e", flops: float | None = None,
                        bytes_accessed: float | None = None, dtype="bfloat16", isolate: bool = False,
                        dots_above: float | None = None, **kwargs) -> Estimate:
  """:func:`estimate_tpu` of ``fn(*args, **kwargs)`` as the sum of its pieces, cut at its
  Pallas kernels: each kernel alone, and the XLA ops between two kernels as one program
  (``kernels/_pieces.py``). Each piece is estimated and floored on its own, and
  ``seconds`` is their sum: a TPU core runs the ops one after another, and no XLA op fuses
  into a Pallas kernel. The sum is not the whole's estimate: values that cross a kernel go
  through HBM, some fusions are lost, and each piece is floored alone, so it usually comes
  out above it (the MoE notebook compares the two where both exist).

  For programs the profiled compile rejects whole: libtpu's compile with the cost model's
  flag reserves about 100 to 130 MiB of VMEM for XLA temporaries beside a Pallas kernel's
  window (a sort, a gather or a top-k beside a kernel with a large window), though the
  plain compile of the same program passes. A piece that the model charges nothing
  because it only reshapes or slices is charged its bytes at the published bandwidth.

  ``dots_above`` (FLOPs) also cuts at each XLA ``dot_general`` that large, each estimated
  alone (pieces named ``dot``): the same cut for a program built on XLA's matmuls, whose
  whole profile can outgrow the machine's memory.
  """
  from kernels.perf import pieces as _pieces
  chip = get_chip(generation)
  f = functools.partial(fn, **kwargs) if kwargs else fn
  with _lock, target(chip):
    parts = _pieces.cut(f, *_plain(args), dots_above=dots_above).pieces
  done: list[tuple[str, Estimate]] = []
  for i, p in enumerate(parts):
    label = f"{i}:{p.name}"
    try:
      e = estimate_tpu(p.fn, *p.inputs, generation=chip.name, isolate=isolate)
    except RuntimeError as err:  # (EstimatorUnavailableError is one)
      # An XLA piece of layout ops only, which the model charges nothing, is charged its bytes. So
      # is one whose profile aborts its child process (v5e's model on some gathers), but then its
      # own work is unmodeled and the estimate only a lower bound.
      aborted = isolate and "failed in its child process" in str(err)
      if p.kernel or not (aborted or "adds up to 0 cycles" in str(err)):
        raise
      comp = compile_for_tpu(p.fn, *p.inputs, generation=chip.name, profile=False) if aborted else None
      t = hbm_traffic(p.fn, *p.inputs, generation=chip.name, compilation=comp)
      e = Estimate(chip.name, 0, {}, chip.clock_hz, None, 0.0, None, t.hbm_bytes, chip.hbm_bandwidth, t.method,
                   ["the cost model aborted on this piece (charged its bytes)"] if aborted else [])
    done.append((label, e))
  rl = roofline(flops, bytes_accessed, chip, dtype) if flops is not None and bytes_accessed is not None else None
  ops: dict[str, int] = {}
  for name, e in done:
    for op, c in e.ops.items():
      ops[f"{name}/{op}"] = c
  methods = {e.bytes_method for _, e in done}
  return Estimate(chip.name, sum(e.cycles for _, e in done), ops, chip.clock_hz, rl,
                  sum(e.compile_seconds for _, e in done),
                  max((e.vmem_bytes or 0 for _, e in done), default=None), sum(e.hbm_bytes for _, e in done),
                  chip.hbm_bandwidth, methods.pop() if len(methods) == 1 else "partly compulsory",
                  [f"{name}/{u}" for name, e in done for u in e.unmodeled],
                  [f"{name}: {n}" for name, e in done for n in e.notes], done)


def estimates_table(rows: list[tuple[str, Estimate]]) -> list[dict]:
  """Flattens labelled estimates into table rows (every row says it is a compiler estimate)."""
  out = []
  for name, e in rows:
    d = {"config": name, "TPU": e.generation, "kind": "compiler estimate (floored)", "time (us)": e.seconds * 1e6,
         "model (us)": e.model_seconds * 1e6, "HBM floor (us)": e.floor_seconds * 1e6}
    if e.fraction_of_roofline is not None:
      d["% of roofline"] = 100 * e.fraction_of_roofline
      d["valid"] = e.valid
    out.append(d)
  return out

