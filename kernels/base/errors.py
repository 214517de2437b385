"""Errors raised by kernels, always before Mosaic runs.

Every message names the argument, the value it got and the rule it broke, so a user
never has to decode a lowering error.
"""
from __future__ import annotations

from typing import Any


class KernelError(ValueError):
  """Bad input to a kernel: names the argument, its value and the rule."""

  def __init__(self, argument: str, value: Any = None, rule: str = "", *, message: str | None = None):
    self.argument = argument
    self.value = value
    self.rule = rule
    if message is None:
      message = f"{argument}={_short(value)}: {rule}" if rule else f"{argument}={_short(value)}"
    super().__init__(message)


class TilingError(KernelError):
  """A block shape breaks the TPU tiling rule or does not fit VMEM."""


class VmemOverflowError(TilingError):
  """The blocks (double-buffered) and scratch need more VMEM than the core has."""


class CompileError(KernelError):
  """The TPU compiler (Mosaic or XLA:TPU) rejected a program."""

  def __init__(self, message: str, *, generation: str, details: str = ""):
    self.generation = generation
    self.details = details
    KernelError.__init__(self, "fn", None, message=f"TPU {generation} compile failed: {message}")


class NoImplementationError(KernelError, NotImplementedError):
  """No implementation can serve the request; the message lists each one's reason."""

  def __init__(self, op: str, reasons: dict[str, str], *, argument: str = "implementation", value: Any = None):
    self.op = op
    self.reasons = dict(reasons)
    lines = "; ".join(f"{impl}: {why}" for impl, why in reasons.items())
    what = "" if argument == "implementation" else f" at {argument}={_short(value)}"
    KernelError.__init__(self, argument, value, message=f"{op}: no implementation fits{what} ({lines})")


class EstimatorUnavailableError(RuntimeError):
  """The TPU compiler's static cost model is not enabled in this process."""


def check(condition: bool, argument: str, value: Any, rule: str, *, error: type[KernelError] = KernelError) -> None:
  """Raises ``error(argument, value, rule)`` unless ``condition`` holds."""
  if not condition:
    raise error(argument, value, rule)


def _short(value: Any) -> str:
  shape = getattr(value, "shape", None)
  dtype = getattr(value, "dtype", None)
  if shape is not None and dtype is not None:
    return f"<array {getattr(dtype, 'name', dtype)}{list(shape)}>"
  text = repr(value)
  return text if len(text) <= 80 else text[:77] + "..."
