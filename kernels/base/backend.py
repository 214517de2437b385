"""Backend choice: which implementation serves a call, and on which platform.

Every public kernel takes ``implementation=None | "pallas" | "xla"`` and
``interpret=None | bool | pltpu.InterpretParams`` and hands them to :func:`dispatch`:

========================  ==================  =====================================
implementation            interpret           runs
========================  ==================  =====================================
``None``                  ``None``/``False``  Pallas (Mosaic) when lowered for TPU, XLA otherwise
``None``                  ``True``/params     Pallas in interpret mode
``"pallas"``              ``None``            Mosaic on TPU, interpret mode elsewhere
``"pallas"``              ``False``           always the real Mosaic kernel
``"pallas"``              ``True``/params     interpret mode
``"xla"``                 (ignored)           the pure-JAX reference path
========================  ==================  =====================================

The choice follows the platform the function is *lowered for*
(:func:`jax.lax.platform_dependent`), not the host's default backend, so compiling
for TPU ahead of time on a CPU host gets the Mosaic kernel.

An implementation that cannot serve a request raises :class:`NotImplementedError`
while tracing. With ``implementation=None`` the next one is tried; if none fits,
:class:`~kernels.base.errors.NoImplementationError` lists every reason.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable

import jax

from kernels.base import calls
from kernels.base.errors import KernelError, NoImplementationError
from kernels.base.hardware import Chip, get_chip

IMPLEMENTATIONS = (None, "pallas", "xla")

_target: contextvars.ContextVar[Chip | None] = contextvars.ContextVar("kernels_target_chip", default=None)
_dry_run: contextvars.ContextVar[bool] = contextvars.ContextVar("kernels_dry_run", default=False)


@contextlib.contextmanager
def target(chip):
  """Within this block, kernels tune themselves for ``chip`` (used by AOT compilation)."""
  token = _target.set(get_chip(chip) if chip is not None else None)
  try:
    yield
  finally:
    _target.reset(token)


@contextlib.contextmanager
def dry_run():
  """Rehearse TPU-only code on any machine: within this block, ``implementation=None`` runs each
  Pallas kernel in interpret mode (instead of XLA) wherever it is not lowered for TPU, and
  :func:`kernels.benchmark` times a single call. The notebooks run their TPU-only measuring cells
  this way on a CPU, at tiny sizes, so CI executes every line a TPU user will: a check that the
  code runs, never a measurement."""
  token = _dry_run.set(True)
  try:
    yield
  finally:
    _dry_run.reset(token)


def in_dry_run() -> bool:
  """True inside :func:`dry_run`."""
  return _dry_run.get()


def target_chip() -> Chip | None:
  """The TPU generation kernels are being traced for: the AOT target, else the local TPU, else None."""
  chip = _target.get()
  if chip is not None:
    return chip
  try:
    dev = jax.devices()[0]
  except RuntimeError:  # pragma: no cover
    return None
  return get_chip(dev.device_kind) if dev.platform == "tpu" else None


class _Unavailable(Exception):
  """Carries a branch's NotImplementedError out of platform_dependent, tagged with its name."""

  def __init__(self, name: str, error: NotImplementedError):
    super().__init__(name, error)
    self.name, self.error = name, error


def _tagged(name: str, fn: Callable) -> Callable:
  def run(*args):
    try:
      return fn(*args)
    except NoImplementationError:
      raise
    except NotImplementedError as e:
      raise _Unavailable(name, e) from e
  return run


def check_implementation(implementation, interpret) -> None:
  if implementation not in IMPLEMENTATIONS:
    raise KernelError("implementation", implementation, 'must be None, "pallas" or "xla"')
  if implementation == "xla" and interpret:
    raise KernelError("interpret", interpret, 'interpret mode applies to implementation="pallas" only')


def dispatch(op: str, *args: Any, pallas: Callable[..., Any], xla: Callable[..., Any],
             implementation: str | None = None, interpret=None, prefer_xla: str | None = None) -> Any:
  """Runs ``op`` on ``args`` with the chosen implementation.

  Args:
    op: the kernel's public name, for error messages.
    *args: array arguments (pytrees allowed); static options belong in the callables.
    pallas: ``pallas(*args, interpret=...)`` builds the Pallas kernel; ``interpret`` is
      ``False`` for Mosaic, or ``True``/``pltpu.InterpretParams`` for interpret mode.
    xla: ``xla(*args)``, the pure-JAX implementation.
    prefer_xla: a reason to skip Pallas when ``implementation`` is None (e.g. a problem
      too small to beat XLA); documented by the kernel that passes it.
  """
  check_implementation(implementation, interpret)
  args = calls.common_varying(args)  # inside a shard_map: one varying type for all (kernels.base.calls)
  if any(getattr(a, "size", 1) == 0 for a in jax.tree.leaves(args)):
    # nothing to compute (an empty batch, no output channels...): XLA gives the empty (or zero) result,
    # where a Pallas grid of length 0 cannot run
    return _run_only("xla", xla, args, op)
  if interpret is None and implementation is None and _dry_run.get():
    interpret = True  # a dry run exercises the kernel itself (interpret mode off TPU), not the XLA fallback
  reasons: dict[str, str] = {}

  if implementation == "xla":
    return _run_only("xla", xla, args, op)

  mosaic = _tagged("pallas", lambda *a: pallas(*a, interpret=False))
  emulated = _tagged("pallas", lambda *a: pallas(*a, interpret=interpret if interpret else True))
  if implementation == "pallas":
    try:
      if interpret is None:
        return jax.lax.platform_dependent(*args, tpu=mosaic, default=emulated)
      return (mosaic if interpret is False else emulated)(*args)
    except _Unavailable as e:
      raise NoImplementationError(op, {"pallas": str(e.error)}) from e.error

  # implementation=None: Pallas first, then XLA.
  if prefer_xla:
    reasons["pallas"] = prefer_xla
  else:
    try:
      if interpret:
        return emulated(*args)
      return jax.lax.platform_dependent(*args, tpu=mosaic, default=_tagged("xla", xla))
    except _Unavailable as e:
      reasons[e.name] = str(e.error)
      if e.name == "xla":  # XLA refused while Pallas was fine: Pallas alone, wherever it runs.
        try:
          return jax.lax.platform_dependent(*args, tpu=mosaic, default=emulated)
        except _Unavailable as e2:
          reasons[e2.name] = str(e2.error)
          raise NoImplementationError(op, reasons) from e2.error
  try:
    return _tagged("xla", xla)(*args)
  except _Unavailable as e:
    reasons["xla"] = str(e.error)
    raise NoImplementationError(op, reasons) from e.error


def _run_only(name: str, fn: Callable, args, op: str):
  try:
    return _tagged(name, fn)(*args)
  except _Unavailable as e:
    raise NoImplementationError(op, {name: str(e.error)}) from e.error
