"""Row-block kernels that write their outputs back to HBM themselves, as several DMAs in flight.

A Pallas grid step computes one block of rows, and Pallas's own pipeline writes each
output block back as one DMA. In the TPU compiler's cost model one DMA streams well
below the HBM bandwidth, several in flight go faster, and the write-back of a step
hides little of the next step's compute (a bf16 kernel at 8192 x 4096 that reads each
512-row block as two DMAs and does four multiplications per element, v6e, compiler
estimates: 45.1 us with Pallas's write-back, 33.9 us with each block written back by the
kernel as two DMAs, 33.2 us as four).

So here a kernel computes block ``b`` into one of two VMEM buffers, and at the start
of the next step it starts ``split`` DMAs of block ``b`` (one per slice of rows),
which run while it computes block ``b + 1`` into the other buffer; it waits for them
at the end of that step. A DMA is started and waited for in the same grid step: the
cost model cannot match a wait with a DMA started in an earlier step (libtpu aborts:
"No DMA issue node found for sync flag"). The last step of each core writes its own
block and waits for it.

The grid is ``(cores, steps)``. On megacore chips (v4, v5p) the leading "parallel"
axis gives each TensorCore a contiguous run of blocks; the trailing axis is
"arbitrary" (in order), since each step finishes the previous step's DMAs. With an odd
number of blocks on two cores the last step of the second core is past the end: it
computes nothing (:attr:`Writer.valid`), and its inputs' index maps repeat the last
block, so Pallas fetches nothing for it.

Inputs, and small outputs such as per-block partial sums, keep Pallas's pipeline:
index them with :meth:`RowBlocks.block_of`.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels import tiling


@dataclasses.dataclass(frozen=True)
class RowBlocks:
  """``n_rows`` rows in blocks of ``rows``, the blocks shared out among ``cores`` TensorCores."""

  n_rows: int
  rows: int
  cores: int = 1

  def __post_init__(self):
    object.__setattr__(self, "cores", max(1, min(self.cores, self.n_blocks)))

  @property
  def n_blocks(self) -> int:
    return tiling.cdiv(self.n_rows, self.rows)

  @property
  def steps(self) -> int:
    """Grid steps per core."""
    return tiling.cdiv(self.n_blocks, self.cores)

  @property
  def grid(self) -> tuple[int, int]:
    return (self.cores, self.steps)

  @property
  def dimension_semantics(self) -> tuple[str, str]:
    return ("parallel", "arbitrary")

  @property
  def has_idle_step(self) -> bool:
    """True when the last core's last step is past the last block."""
    return self.cores * self.steps > self.n_blocks

  @property
  def tail(self) -> int:
    """Rows in the last block."""
    return self.n_rows - (self.n_blocks - 1) * self.rows

  def block(self, c, j):
    """The block grid step ``(c, j)`` computes (``n_blocks`` on an idle step)."""
    return c * self.steps + j

  def block_of(self, c, j):
    """The block an index map should name at ``(c, j)``: :meth:`block`, clamped to the last block."""
    return jnp.minimum(self.block(c, j), self.n_blocks - 1) if self.has_idle_step else self.block(c, j)

  def spec(self, block_shape: Sequence[int], index: Callable | None = None) -> pl.BlockSpec:
    """A pipelined BlockSpec whose index map is ``index(block)`` (default: ``(block, 0, ...)``)."""
    rest = (0,) * (len(block_shape) - 1)
    index = index or (lambda b: (b,) + rest)
    return pl.BlockSpec(tuple(block_shape), lambda c, j: index(self.block_of(c, j)))


def split_for(rows: int, row: Sequence[int], dtype, want: int) -> int:
  """The largest ``s <= want`` (a power of two) whose slices of ``rows / s`` rows keep VMEM tiles whole."""
  least = 1 if len(row) > 1 else tiling.sublane_multiple(dtype)  # (wide rows: a row is a leading dim)
  s = max(1, want)
  while s > 1 and (rows % s or (rows // s) % least):
    s //= 2
  return s


class Outputs:
  """Host side: out_shape, out_specs and scratch for ``[n_rows, *row]`` outputs (``(row, dtype)``
  pairs) that a kernel writes back itself, as ``split`` DMAs per block each (see :func:`split_for`).
  ``hbm=True`` places them in HBM (False in interpret mode, which has no memory spaces).

  A DMA may not end in the middle of an HBM tile of 16-bit rows (Mosaic accepts a last slice of 2,
  4, 8 or 16 bf16 rows, not 6), so when the last block of 16-bit rows is ragged by other than a
  whole tile, the outputs are left to Pallas's pipeline (:attr:`manual` is False): the same
  kernel body, the same results. ``manual=False`` asks for that pipeline outright.
  """

  def __init__(self, blocks: RowBlocks, outputs: Sequence[tuple[Sequence[int], object]], split: int, *,
               hbm: bool = True, manual: bool = True):
    self.blocks = blocks
    self.outputs = [(tuple(row), jnp.dtype(dtype)) for row, dtype in outputs]
    self.split = split
    self.hbm = hbm
    whole = [len(row) > 1 or dtype.itemsize >= 4 for row, dtype in self.outputs]  # (wide rows: rows are leading)
    least = max((1 if w else tiling.sublane_multiple(d)) for w, (_, d) in zip(whole, self.outputs))
    self.manual = manual and (blocks.n_blocks == 1 or blocks.tail % least == 0)

  def out_shape(self) -> list:
    make = (lambda s, d: pltpu.HBM(s, d)) if self.hbm else jax.ShapeDtypeStruct
    return [make((self.blocks.n_rows,) + row, dtype) for row, dtype in self.outputs]

  def out_specs(self) -> list:
    if not self.manual:
      return [self.blocks.spec((self.blocks.rows,) + row) for row, _ in self.outputs]
    return [pl.BlockSpec(memory_space=pl.ANY) for _ in self.outputs]

  def scratch_shapes(self) -> list:
    """Two VMEM buffers per output, then one DMA semaphore per output and slice."""
    if not self.manual:
      return []
    bufs = [pltpu.VMEM((2, self.blocks.rows) + row, dtype) for row, dtype in self.outputs]
    return bufs + [pltpu.SemaphoreType.DMA((len(self.outputs), self.split))]

  def kernel(self, body: Callable, n_inputs: int) -> Callable:
    """A Pallas kernel around ``body``, a kernel for one block that writes these outputs into VMEM.

    The pallas_call's outputs must list these outputs first and its scratch must end with
    :meth:`scratch_shapes`. ``body`` gets the same refs with these outputs' HBM refs (after the
    ``n_inputs`` inputs) replaced by this step's VMEM buffers and without this scratch, and
    ``block=`` the block index. It is not called on an idle step.
    """
    n_out, n_scratch = len(self.outputs), len(self.scratch_shapes())

    def kernel(*refs):
      refs = list(refs)
      if not self.manual:
        b = self.blocks.block(pl.program_id(0), pl.program_id(1))
        run = lambda: body(*refs, block=b)  # noqa: E731
        if self.blocks.has_idle_step:
          pl.when(b < self.blocks.n_blocks)(run)
        else:
          run()
        return
      hbm, scratch = refs[n_inputs:n_inputs + n_out], refs[len(refs) - n_scratch:]
      w = self.writer(hbm, scratch)
      w.begin()
      inner = refs[:n_inputs] + [w.out(k) for k in range(n_out)] + refs[n_inputs + n_out:len(refs) - n_scratch]
      run = lambda: body(*inner, block=w.b)  # noqa: E731
      if self.blocks.has_idle_step:
        pl.when(w.valid)(run)
      else:
        run()
      w.end()
    return kernel

  def writer(self, hbm_refs, scratch_refs) -> "Writer":
    """In the kernel: ``hbm_refs`` (the outputs) and the refs of :meth:`scratch_shapes`, in order."""
    n = len(self.outputs)
    return Writer(self, list(hbm_refs), list(scratch_refs[:n]), scratch_refs[n])


class Writer:
  """Kernel side. Call :meth:`begin` first, write block rows into :meth:`out`, then :meth:`end`."""

  def __init__(self, outputs: Outputs, hbm_refs, bufs, sem):
    self.o, self.blocks = outputs, outputs.blocks
    self.hbm, self.bufs, self.sem = hbm_refs, bufs, sem
    self.c, self.j = pl.program_id(0), pl.program_id(1)
    self.b = self.blocks.block(self.c, self.j)
    self.slot = self.j % 2

  @property
  def valid(self):
    """Whether this step has a block to compute (False only on an idle step)."""
    return self.b < self.blocks.n_blocks

  def out(self, k: int):
    """Output ``k``'s VMEM buffer for this step's block: ``[rows, *row]``."""
    return self.bufs[k].at[self.slot]

  def _copies(self, block, slot, sizes: Sequence[tuple[int, int]]):
    out = []
    for k in range(len(self.o.outputs)):
      for n, (start, size) in enumerate(sizes):
        src = self.bufs[k].at[slot, pl.ds(start, size)]
        if self.blocks.n_blocks == 1:  # (rows need not be a multiple of 8 then: say so statically)
          at = start
        else:
          at = pl.multiple_of(block * self.blocks.rows + start, math.gcd(self.blocks.rows, start or self.blocks.rows))
        dst = self.hbm[k].at[pl.ds(at, size)]
        out.append(pltpu.make_async_copy(src, dst, self.sem.at[k, n]))
    return out

  def _each(self, block, slot, op: str):
    """Starts (or waits for) the DMAs of ``block`` from buffer ``slot``: static sizes, so the
    last block of a ragged row count has its own (shorter) set."""
    blocks = self.blocks

    def run(rows):
      part = blocks.rows // self.o.split
      sizes = [(s, min(part, rows - s)) for s in range(0, rows, part)]
      for cp in self._copies(block, slot, sizes):
        getattr(cp, op)()

    if blocks.tail == blocks.rows:
      run(blocks.rows)
      return
    last = blocks.n_blocks - 1
    pl.when(block == last)(lambda: run(blocks.tail))
    pl.when(block != last)(lambda: run(blocks.rows))

  def begin(self):
    """Starts writing the previous step's block (it is written while this step computes)."""
    pl.when(self.j >= 1)(lambda: self._each(self.b - 1, 1 - self.slot, "start"))

  def end(self):
    """Waits for the previous block; on the core's last step, writes this block and waits."""
    pl.when(self.j >= 1)(lambda: self._each(self.b - 1, 1 - self.slot, "wait"))

    def last():
      self._each(self.b, self.slot, "start")
      self._each(self.b, self.slot, "wait")
    cond = self.j == self.blocks.steps - 1
    pl.when(jnp.logical_and(cond, self.valid) if self.blocks.has_idle_step else cond)(last)
