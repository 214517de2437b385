"""A communication model for the inter-chip interconnect (ICI): what libtpu's cost model cannot see.

The compiler's static cost model charges collectives 0 cycles, so the time of a multi-chip program
is built here as the compiler estimate of each chip's compute plus this model of its transfers.
Every figure from here is labelled **communication model**: published link bandwidths and a
per-transfer latency, never a measurement.

On a ring of ``n`` chips along one mesh axis (a torus axis, or a snake through a 2-D slice without
wrap-arounds, such as v5e's 2x4), each chip has one link to each neighbour, ``B`` bytes/s each way
(:attr:`kernels.base.hardware.Chip.ici_link_bandwidth`). A transfer of ``b`` bytes to a neighbour takes
``latency + b / B``; sending half each way round the ring uses both links and halves the time. The
ring collectives (as in the scaling book, "How to think about TPUs" and "Sharded matrices"):

==============================  ==========================================================
``all_gather`` (``b`` local)     ``n - 1`` steps of ``b`` bytes (``b / 2`` each way, bidirectional)
``reduce_scatter`` (to ``b``)    the same bytes as an all-gather to ``n b``
``all_to_all`` (``b`` local)     ``b n / 8`` byte-link-times on a bidirectional ring (each chip
                                 sends ``(n - 1) / n`` of ``b``, on average ``n / 4`` hops away)
==============================  ==========================================================

Where a schedule overlaps a step's transfer with its compute, the step costs the larger of the
two; where it does not, their sum (:func:`overlapped`).
"""
from __future__ import annotations

from kernels.base.hardware import Chip, get_chip

ASSUMED_LATENCY = 4.6e-6
"""Per-transfer latency for generations without a published measurement: the larger of the two
published ``ppermute`` fits (v5p's; v6e's is 2.3 us). An assumption, and labelled so."""


def _chip(chip) -> Chip:
  chip = get_chip(chip) if not isinstance(chip, Chip) else chip
  if not chip.ici_link_bandwidth:
    raise ValueError(f"{chip.name} has no ICI figures")
  return chip


def latency(chip) -> float:
  """Fixed seconds per neighbour transfer: the published fit, else :data:`ASSUMED_LATENCY`."""
  chip = _chip(chip)
  return chip.ici_latency if chip.ici_latency is not None else ASSUMED_LATENCY


def ppermute_seconds(nbytes: float, chip, *, links: int = 1) -> float:
  """One neighbour transfer of ``nbytes`` (split over ``links`` links: 2 for half each way)."""
  chip = _chip(chip)
  return latency(chip) + nbytes / (links * chip.ici_link_bandwidth)


def all_gather_seconds(local_bytes: float, n: int, chip, *, bidirectional: bool = True) -> float:
  """A ring all-gather of ``local_bytes`` per chip over ``n`` chips."""
  if n <= 1:
    return 0.0
  return (n - 1) * ppermute_seconds(local_bytes, chip, links=2 if bidirectional and n > 2 else 1)


def reduce_scatter_seconds(result_bytes: float, n: int, chip, *, bidirectional: bool = True) -> float:
  """A ring reduce-scatter whose result is ``result_bytes`` per chip (partial sums of that size move)."""
  return all_gather_seconds(result_bytes, n, chip, bidirectional=bidirectional)


def all_to_all_seconds(local_bytes: float, n: int, chip) -> float:
  """An all-to-all of ``local_bytes`` per chip on a bidirectional ring of ``n`` chips."""
  if n <= 1:
    return 0.0
  chip = _chip(chip)
  hops = sum(min(d, n - d) for d in range(1, n))            # byte-hops per byte sent, summed over peers
  link_seconds = local_bytes / n * hops / (2 * chip.ici_link_bandwidth)  # 2 links out of every chip
  return latency(chip) * (n // 2) + link_seconds


def overlapped(compute: list[float] | float, comm: list[float] | float, *, overlap: bool = True) -> float:
  """Seconds of a schedule of steps: each step ``max(compute, comm)`` when overlapped, else the sum."""
  compute = compute if isinstance(compute, list) else [compute]
  comm = comm if isinstance(comm, list) else [comm] * len(compute)
  if overlap:
    return sum(max(a, b) for a, b in zip(compute, comm))
  return sum(compute) + sum(comm)


def hiding_intensity(chip, *, links: int = 1, dtype: str = "bfloat16") -> float:
  """FLOPs per byte sent above which a step's compute hides its transfer: peak / link bandwidth."""
  chip = _chip(chip)
  return chip.peak(dtype) / (links * chip.ici_link_bandwidth)
