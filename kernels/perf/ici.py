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


def all_reduce_seconds(nbytes: float, n: int, chip, *, bidirectional: bool = True) -> float:
  """A ring all-reduce of ``nbytes`` per chip: a reduce-scatter to ``nbytes / n``, then an all-gather."""
  return (reduce_scatter_seconds(nbytes / n, n, chip, bidirectional=bidirectional)
          + all_gather_seconds(nbytes / n, n, chip, bidirectional=bidirectional))


_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
          "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16}


def _shape_bytes(text: str) -> int:
  """Bytes of the first array shape in ``text`` (``bf16[2,512,8,128]{...}``)."""
  import re
  m = re.search(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]", text)
  if not m or m.group(1) not in _BYTES:
    return 0
  dims = [int(d) for d in m.group(2).split(",") if d]
  size = 1
  for d in dims:
    size *= d
  return size * _BYTES[m.group(1)]


def _group_size(line: str) -> int:
  import re
  m = re.search(r"replica_groups=\{\{([0-9,]*)\}", line)
  if m:
    return len(m.group(1).split(","))
  m = re.search(r"replica_groups=\[([0-9,]+)\]<=", line)  # iota form: [groups, size]
  if m:
    return int(m.group(1).split(",")[-1])
  m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\S*\))?\s*\{([^}]*)\}", line)  # mesh[...] {axes}
  if m:
    sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
    size = 1
    for axis in re.findall(r"'([^']+)'", m.group(2)):
      size *= int(sizes.get(axis, 1))
    return size
  m = re.search(r"source_target_pairs=", line)
  return 2 if m else 1


def hlo_collectives(hlo: str) -> list[dict]:
  """The collectives of a compiled (per-chip) HLO module: kind, bytes of one chip's operand (its
  result for all-gather), and the number of chips in each group. Async pairs count once."""
  import re
  found = []
  for line in hlo.splitlines():
    m = re.search(r"=\s*(.*?)\s(all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all)(-start)?\(",
                  line)
    if not m:
      continue
    kind, result = m.group(2), m.group(1)
    if m.group(3):  # an async start's (operand, result, ...) tuple: the operand comes first
      nbytes = _shape_bytes(result)
    else:  # a combined collective's result is a tuple of all its operands
      nbytes = sum(_shape_bytes(t) for t in re.findall(r"[a-z]+[0-9]*[a-z0-9]*\[[0-9,]*\]", result))
    found.append({"kind": kind, "bytes": nbytes, "chips": _group_size(line)})
  return found


def collectives_seconds(collectives: list[dict], chip, *, trips: int = 1) -> float:
  """The communication model's seconds for :func:`hlo_collectives`' list, run one after another (no
  overlap with compute); ``trips`` multiplies collectives inside a loop body the HLO lists once (the
  caller knows the trip count). A lower-level view than the schedule-aware models above."""
  total = 0.0
  for c in collectives:
    n, b = c["chips"], c["bytes"]
    if c["kind"] == "all-reduce":
      total += all_reduce_seconds(b, n, chip)
    elif c["kind"] == "all-gather":
      total += all_gather_seconds(b / n, n, chip)
    elif c["kind"] == "reduce-scatter":
      total += reduce_scatter_seconds(b, n, chip)
    elif c["kind"] == "all-to-all":
      total += all_to_all_seconds(b, n, chip)
    else:
      total += ppermute_seconds(b, chip)
  return total * trips


def hlo_seconds(hlo: str, chip, *, trips: int = 1) -> float:
  """:func:`collectives_seconds` of a compiled program's HLO."""
  return collectives_seconds(hlo_collectives(hlo), chip, trips=trips)
