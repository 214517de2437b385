"""kernels.pipeline: row blocks written back by the kernel's own DMAs, on one core or two."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels import pipeline


@pytest.mark.parametrize("n_rows,rows,cores,grid,idle,tail", [
    (64, 16, 1, (1, 4), False, 16),
    (64, 16, 2, (2, 2), False, 16),
    (70, 16, 2, (2, 3), True, 6),    # 5 blocks on two cores: the second core's last step is idle
    (16, 16, 2, (1, 1), False, 16),  # one block: one core
    (5, 5, 1, (1, 1), False, 5),
])
def test_row_blocks(n_rows, rows, cores, grid, idle, tail):
  b = pipeline.RowBlocks(n_rows, rows, cores)
  assert (b.grid, b.has_idle_step, b.tail) == (grid, idle, tail)
  seen = sorted(b.block(c, j) for c in range(b.grid[0]) for j in range(b.grid[1]))
  assert seen[:b.n_blocks] == list(range(b.n_blocks))  # every block once, in order per core
  assert all(s == b.n_blocks for s in seen[b.n_blocks:])  # then at most one idle step


def test_split_keeps_tiles_whole():
  assert pipeline.split_for(512, (4096,), jnp.bfloat16, 4) == 4
  assert pipeline.split_for(32, (4096,), jnp.bfloat16, 4) == 2   # slices of 16 rows (bf16 tile)
  assert pipeline.split_for(32, (4096,), jnp.float32, 4) == 4    # slices of 8 rows (f32 tile)
  assert pipeline.split_for(100, (1000,), jnp.bfloat16, 4) == 1
  assert pipeline.split_for(3, (512, 128), jnp.bfloat16, 4) == 1  # wide rows: any row count
  assert pipeline.split_for(6, (512, 128), jnp.bfloat16, 4) == 2


def _multiples(n_rows, rows, cores, split, n_out, dtype, interpret):
  """x -> (2x, 3x, ...): ``n_out`` outputs that the kernel writes back itself."""
  blocks = pipeline.RowBlocks(n_rows, rows, cores)
  outs = pipeline.Outputs(blocks, [((128,), dtype)] * n_out, split, hbm=not interpret)

  def body(x_ref, *refs, block):
    del block
    for k, o in enumerate(refs):
      o[...] = x_ref[...] * (k + 2)

  return pl.pallas_call(
      outs.kernel(body, 1), grid=blocks.grid, in_specs=[blocks.spec((rows, 128))],
      out_specs=outs.out_specs(), out_shape=outs.out_shape(), scratch_shapes=outs.scratch_shapes(),
      compiler_params=pltpu.CompilerParams(dimension_semantics=blocks.dimension_semantics),
      interpret=pltpu.InterpretParams(detect_races=True) if interpret else False)


@pytest.mark.parametrize("n_rows,rows,cores,split,n_out,dtype,manual", [
    (64, 16, 1, 2, 1, jnp.float32, True), (70, 16, 2, 2, 2, jnp.float32, True), (72, 16, 2, 1, 1, jnp.float32, True),
    (40, 8, 2, 4, 1, jnp.float32, True), (13, 13, 1, 1, 2, jnp.float32, True),
    (96, 32, 2, 2, 2, jnp.bfloat16, True), (13, 13, 1, 1, 1, jnp.bfloat16, True),
    (70, 32, 2, 2, 1, jnp.bfloat16, False)])  # a last block of 6 bf16 rows: Pallas's pipeline writes it
def test_every_row_is_written_once(n_rows, rows, cores, split, n_out, dtype, manual):
  blocks = pipeline.RowBlocks(n_rows, rows, cores)
  assert pipeline.Outputs(blocks, [((128,), dtype)], split).manual == manual
  x = jnp.asarray(np.random.default_rng(0).standard_normal((n_rows, 128)), dtype)
  out = _multiples(n_rows, rows, cores, split, n_out, dtype, True)(x)
  for k, o in enumerate(out):
    np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(x * (k + 2), np.float32))
  from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
  assert ipc.races is not None and not ipc.races.races_found


@pytest.mark.tpu_aot
@pytest.mark.parametrize("generation", ["v5e", "v5p"])
@pytest.mark.parametrize("n_rows", [96, 70, 68])
def test_aot_compiles(generation, n_rows):
  # Blocks of 32 bf16 rows on the generation's cores (two on v5p), two outputs written as two DMAs a
  # block (16 rows each, the bf16 tile). 96 rows: 3 blocks (an idle step on two cores); 70: a last
  # block of 6 rows, left to Pallas's pipeline; 68: a last block of 4 rows, likewise.
  import kernels
  call = _multiples(n_rows, 32, kernels.get_chip(generation).tensorcores, 2, 2, jnp.bfloat16, False)
  comp = kernels.compile_for_tpu(call, jax.ShapeDtypeStruct((n_rows, 128), jnp.bfloat16), generation=generation)
  assert comp.hlo.count('custom_call_target="tpu_custom_call"') == 1
