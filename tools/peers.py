"""megablox's grouped matmul as the cost model can read it (tools/tune_gmm.py, tools/bench_moe.py).

megablox computes its group tables and the number of m-tiles to visit at run time
(``make_group_metadata``), and the m-tile count is a grid dimension. libtpu's cost model
cannot know a run-time grid length: it charges megablox's kernel a fixed number of m
visits whatever the rows and groups (on v5e and v6e alike, the same time for 2048 and
8192 rows). So a benchmark with known group sizes computes megablox's metadata from
them at trace time, with megablox's own function: its kernel then runs its real grid.
Its index maps still read the tables from SMEM, which the model reads as 0, so its
DMAs are undercounted: each kernel is charged at least its compulsory bytes (the floor).
"""
from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np

_MODULE = "jax.experimental.pallas.ops.tpu.megablox.gmm"
METHOD = ("megablox as written, its group tables and grid length computed by its own make_group_metadata from "
          "the case's group sizes at trace time (so the model sees the real number of steps); its tables still "
          "read as 0 by the cost model, so each kernel is charged at least its compulsory bytes")


def megablox_with_known_groups(sizes) -> None:
  """From now on in this process, megablox's ``gmm`` and ``tgmm`` take their metadata from
  ``sizes`` (the case's group sizes), not from the sizes they are given."""
  mbg = importlib.import_module(_MODULE)
  original = getattr(mbg, "_make_group_metadata_at_run_time", mbg.make_group_metadata)
  mbg._make_group_metadata_at_run_time = original  # noqa: SLF001
  sizes = jnp.asarray(np.asarray(sizes, np.int32))

  def at_trace_time(*, group_sizes, m, tm, start_group, num_nonzero_groups, visit_empty_groups=True):
    del group_sizes, start_group  # the case's sizes; no expert sharding here (offset 0)
    with jax.ensure_compile_time_eval():
      tables, num_tiles = original(group_sizes=sizes, m=m, tm=tm, start_group=jnp.int32(0),
                                   num_nonzero_groups=num_nonzero_groups, visit_empty_groups=visit_empty_groups)
      return tuple(np.asarray(t) for t in tables), int(num_tiles)
  mbg.make_group_metadata = at_trace_time
  jax.clear_caches()  # megablox's gmm is jitted: a trace from before would keep its run-time grid
