"""AOT compilation for TPU and the compiler's cost model (needs jax[tpu]; CI installs it)."""
import jax
import jax.numpy as jnp
import pytest

import kernels
from kernels.perf import tpu
from tests import toy

pytestmark = pytest.mark.tpu_aot

bf16 = jnp.bfloat16


def sds(*shape, dtype=bf16):
  return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize("generation", kernels.TPU_GENERATIONS)
def test_compiles_for_every_generation(generation):
  comp = kernels.compile_for_tpu(toy.matmul, sds(1024, 1024), sds(1024, 1024), generation=generation,
                                 bm=256, bk=512, bn=512)
  assert comp.generation == generation
  assert "tpu_custom_call" in comp.hlo
  # blocks: 2 x (256x512 + 512x512 + 256x512) bf16 + 256x512 f32 scratch = 2.5 MiB
  assert 1 * 2**20 < comp.vmem_bytes <= 4 * 2**20
  assert comp.memory["argument"] == 2 * 1024 * 1024 * 2


def test_compile_without_profile_gives_the_same_program_and_memory():
  """profile=False compiles in a child process without the cost model's flags: same HLO kernel, same memory."""
  args = (sds(1024, 1024), sds(1024, 1024))
  plain = kernels.compile_for_tpu(toy.matmul, *args, generation="v5e", profile=False, bm=256, bk=512, bn=512)
  full = kernels.compile_for_tpu(toy.matmul, *args, generation="v5e", bm=256, bk=512, bn=512)
  assert "tpu_custom_call" in plain.hlo and plain.memory == full.memory and plain.vmem_bytes == full.vmem_bytes


def test_child_compiles_share_one_worker_that_restarts_when_it_dies():
  """Compiles without the profiler reuse one child process (no start-up per compile); a dead one is replaced."""
  worker = kernels.perf.tpu._compile_worker
  worker._stop()  # a fresh worker: one that earlier tests grew past its limits would be replaced mid-test
  args = (sds(256, 256), sds(256, 256))
  kernels.compile_for_tpu(toy.matmul, *args, generation="v4", bm=128, bk=128, bn=128)
  pid = worker._proc.pid
  comp = kernels.compile_for_tpu(toy.matmul, *args, generation="v4", bm=256, bk=128, bn=128)
  assert worker._proc.pid == pid and "tpu_custom_call" in comp.hlo
  worker._proc.kill()
  worker._proc.wait()
  comp = kernels.compile_for_tpu(toy.matmul, *args, generation="v4", bm=128, bk=256, bn=128)
  assert worker._proc.pid != pid and "tpu_custom_call" in comp.hlo


def test_bad_tiling_is_a_kernel_error():
  with pytest.raises(kernels.CompileError) as info:
    kernels.compile_for_tpu(toy.matmul, sds(1024, 1024), sds(1024, 1024), bm=100)
  assert isinstance(info.value, kernels.KernelError) and info.value.kind == "tiling"
  assert "divisible by 8 and 128" in str(info.value) and "TPU v5e" in str(info.value)


@pytest.mark.parametrize("generation", ["v5e", "v4"])
def test_vmem_overflow_is_a_kernel_error(generation):
  # 2 x (2048x2048 + 2048x2048 + 2048x2048) f32 blocks + scratch: 112 MiB, over the 16 MiB default.
  with pytest.raises(kernels.CompileError) as info:
    kernels.compile_for_tpu(toy.matmul, sds(2048, 2048, dtype=jnp.float32), sds(2048, 2048, dtype=jnp.float32),
                            bm=2048, bk=2048, bn=2048, generation=generation)
  assert info.value.kind == "vmem" and "VMEM" in str(info.value)


def test_mosaic_failure_is_readable():
  def bad(x):  # int8 multiply is not supported by Mosaic's vector unit
    from jax.experimental import pallas as pl

    def k(x_ref, o_ref):
      o_ref[...] = x_ref[...] * x_ref[...]
    return pl.pallas_call(k, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
  with pytest.raises(kernels.CompileError) as info:
    kernels.compile_for_tpu(bad, sds(32, 128, dtype=jnp.int8))
  assert info.value.kind == "mosaic" and "i8" in str(info.value)


def test_validation_errors_pass_through_unchanged():
  with pytest.raises(kernels.KernelError, match="implementation"):
    kernels.compile_for_tpu(lambda x: toy.scale_add(x, implementation="cuda"), sds(16, 128))


@pytest.mark.skipif(not tpu.estimator_available(), reason="this libtpu has no static cost model (jax 0.7)")
def test_estimate_is_positive_labelled_and_below_roofline():
  flops, nbytes = kernels.matmul_cost(1024, 1024, 1024)
  e = kernels.estimate_tpu(toy.matmul, sds(1024, 1024), sds(1024, 1024), generation="v5e",
                           bm=512, bk=1024, bn=1024, flops=flops, bytes_accessed=nbytes)
  assert e.cycles > 0 and e.model_seconds == pytest.approx(e.cycles / 1.5e9) and e.seconds >= e.model_seconds
  assert e.label == "compiler estimate, TPU v5e" and "compiler estimate" in str(e)
  assert e.valid and 0 < e.fraction_of_roofline <= 1
  assert any("matmul" in name or "pallas" in name for name in e.ops)


def test_estimate_in_pieces_sums_its_pieces_and_prices_a_kernel_as_alone():
  """estimate_tpu_pieces: the XLA ops before, between and after two kernels are three programs;
  each kernel's piece is the same program as the kernel estimated alone."""
  def prog(a, b):
    h = toy.matmul(jnp.tanh(a), b, bm=256, bk=512, bn=512)
    return jnp.sum(toy.matmul(h * 2, b, bm=256, bk=512, bn=512).astype(jnp.float32) ** 2)
  args = sds(1024, 1024), sds(1024, 1024)
  e = kernels.estimate_tpu_pieces(prog, *args, generation="v5e")
  names = [n for n, _ in e.pieces]
  kinds = [n.split(":")[1] for n in names]
  assert kinds[::2] == ["xla"] * 3 and "xla" not in kinds[1::2] and len(kinds) == 5, names
  assert e.seconds == pytest.approx(sum(p.seconds for _, p in e.pieces))
  assert e.seconds >= max(e.model_seconds, e.floor_seconds) * (1 - 1e-9) and e.complete
  alone = kernels.estimate_tpu(toy.matmul, *args, generation="v5e", bm=256, bk=512, bn=512)
  assert e.pieces[1][1].cycles == alone.cycles and e.pieces[1][1].hbm_bytes == alone.hbm_bytes
  rec = e.record()
  assert [p["name"] for p in rec["pieces"]] == names and [p["kernel"] for p in rec["pieces"]] == [
      False, True, False, True, False]


def test_a_program_of_constants_is_estimated_for_the_tpu():
  # A piece cut from a program can take no argument (it computes from constants); with no argument to
  # carry the placement, jit would lower it for the CPU.
  c = jnp.arange(1024, dtype=jnp.int32)
  e = kernels.estimate_tpu(lambda: jnp.cumsum(c) * 2, generation="v5e", isolate=True)
  assert e.cycles > 0 and e.hbm_bytes >= 1024 * 4  # (XLA folds the constants: the output, at least)


def test_an_xla_piece_whose_profile_aborts_is_charged_its_bytes_and_leaves_the_estimate_incomplete(monkeypatch):
  # v5e's cost model aborts its process on some gathers (megablox's group tables). In pieces, such an
  # XLA piece is charged its bytes and named in ``unmodeled``: a lower bound, never a silent 0. (The
  # abort itself takes a minute to provoke: it is simulated at the child process's boundary.)
  from kernels.perf import tpu
  real = tpu.estimate_tpu

  def aborting(fn, *args, **kw):
    if not any(eq.primitive.name == "pallas_call" for eq in jax.make_jaxpr(fn)(*args).eqns):
      raise RuntimeError("TPU v5e static cost model failed in its child process (exit -6): ")
    return real(fn, *args, **kw)
  monkeypatch.setattr(tpu, "estimate_tpu", aborting)

  def prog(a, b):
    return jnp.sum(toy.matmul(jnp.tanh(a), b, bm=256, bk=512, bn=512).astype(jnp.float32))
  args = sds(1024, 1024), sds(1024, 1024)
  e = kernels.estimate_tpu_pieces(prog, *args, generation="v5e", isolate=True)
  (n0, p0), (n1, p1), (n2, p2) = e.pieces
  assert not e.complete and not e.record()["valid"] and len(e.unmodeled) == 2, e.unmodeled
  assert p0.cycles == p2.cycles == 0 and p0.hbm_bytes >= 2 * 1024 * 1024 * 2 and p0.seconds == p0.floor_seconds
  assert p1.complete and p1.cycles > 0
  with pytest.raises(RuntimeError, match="child process"):  # without isolation an abort is not expected
    kernels.estimate_tpu_pieces(prog, *args, generation="v5e")


def test_a_pallas_kernel_the_model_does_not_charge_makes_the_estimate_incomplete():
  # libtpu's cost model charges some Pallas kernels 0 cycles without a word (here: 5-D blocks).
  # Such a kernel must land in ``unmodeled``: the estimate is then incomplete, never a silent 0.
  from jax.experimental import pallas as pl

  def five_d(x):
    spec = pl.BlockSpec((2, 1, 8, 128, 128), lambda i: (0, i, 0, 0, 0))
    return pl.pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] * 2.0), grid=(4,),
                          in_specs=[spec], out_specs=spec, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          name="five_d")(x)
  e = kernels.estimate_tpu(five_d, jax.ShapeDtypeStruct((2, 4, 8, 128, 128), jnp.float32), generation="v5e")
  (name,) = [n for n in e.ops if n.startswith("five_d")]
  assert (e.ops[name] == 0) == (name in e.unmodeled)
  assert e.complete == (e.ops[name] > 0) and (e.valid or not e.complete)


def test_a_run_time_grid_bound_compiles_without_the_profiler_and_is_estimated_in_a_child():
  # libtpu's static profiler can abort the process on a Pallas grid with a run-time bound (kernels.gmm's
  # visit axis): such a program compiles without it here, and is estimated in a child process.
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import tpu as pltpu

  def dynamic(x, steps):
    spec = pl.BlockSpec((8, 128), lambda i, s: (i, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=(steps[0],), in_specs=[spec], out_specs=spec)
    return pl.pallas_call(lambda s_ref, x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] * 2.0), grid_spec=grid_spec,
                          out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), name="dynamic")(steps, x)
  args = (jax.ShapeDtypeStruct((64, 128), jnp.float32), jax.ShapeDtypeStruct((1,), jnp.int32))
  assert kernels.perf.tpu.dynamic_grid_kernels(jax.jit(dynamic), args, kernels.get_chip("v5e")) == ["dynamic"]
  comp = kernels.compile_for_tpu(dynamic, *args, generation="v5e")
  assert "tpu_custom_call" in comp.hlo
  e = kernels.estimate_tpu(dynamic, *args, generation="v5e")
  assert any(n.startswith("dynamic") and c > 0 for n, c in e.ops.items())


def test_estimate_orders_block_sizes():
  # 2048^3: 128x128 output tiles re-read A and B 4x more than 512x512 tiles; the estimate must see it.
  n = 2048
  flops, nbytes = kernels.matmul_cost(n, n, n)
  small = kernels.estimate_tpu(toy.matmul, sds(n, n), sds(n, n), bm=128, bk=512, bn=128,
                               flops=flops, bytes_accessed=nbytes)
  large = kernels.estimate_tpu(toy.matmul, sds(n, n), sds(n, n), bm=512, bk=1024, bn=512,
                               flops=flops, bytes_accessed=nbytes)
  assert large.seconds < small.seconds
  assert large.valid and small.valid
  assert large.fraction_of_roofline > 0.8


def test_estimate_of_same_program_twice_is_stable():
  args = (sds(512, 512), sds(512, 512))
  a = kernels.estimate_tpu(toy.matmul, *args, bm=256, bk=256, bn=256)
  b = kernels.estimate_tpu(toy.matmul, *args, bm=256, bk=256, bn=256)
  assert a.cycles == b.cycles


def test_estimate_flags_impossible_results():
  e = kernels.estimate_tpu(lambda a, b: a @ b, sds(256, 256), sds(256, 256), flops=1e15, bytes_accessed=1.0)
  assert not e.valid and "INVALID" in str(e)


def test_v4_cannot_be_estimated_but_compiles():
  with pytest.raises(kernels.EstimatorUnavailableError, match="v4"):
    kernels.estimate_tpu(toy.matmul, sds(512, 512), sds(512, 512), generation="v4", bm=256, bk=256, bn=256)


def test_xla_memory_analysis():
  comp = kernels.compile_for_tpu(lambda a, b: jax.nn.softmax(a @ b.T, axis=-1), sds(2048, 128), sds(2048, 128))
  assert comp.memory["output"] == 2048 * 2048 * 2
  assert tpu.estimator_available()


def test_estimate_after_compile_of_the_same_program():
  # JAX reuses the executable of an identical program; its cost profile must still be found.
  f = lambda a, b: (a @ b) * 3
  args = (sds(384, 256), sds(256, 512))
  comp = kernels.compile_for_tpu(f, *args)
  e = kernels.estimate_tpu(f, *args)
  assert e.cycles > 0 and comp.hlo


def test_isolated_estimate_matches_in_process():
  # isolate=True estimates in a child process (a profiler crash cannot take this one down).
  args = (sds(512, 512), sds(512, 512))
  here = kernels.estimate_tpu(toy.matmul, *args, generation="v5e", bm=256, bk=256, bn=256)
  child = kernels.estimate_tpu(toy.matmul, *args, generation="v5e", bm=256, bk=256, bn=256, isolate=True)
  assert child.cycles == here.cycles > 0 and child.label == here.label
