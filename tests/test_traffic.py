"""The HBM traffic counter (kernels.perf.traffic) and the floored estimate built on it.

The counter is checked on programs whose traffic is known in advance: a copy moves the
array twice; a blocked Pallas matmul re-reads A once per column of output blocks and B
once per row of them; attention re-reads K and V once per q block. Then the floor: no
memory-bound program, ours or XLA's, is estimated faster than its roofline.
"""
import jax
import jax.numpy as jnp
import pytest

import kernels
from kernels.perf import tpu
from kernels.perf import traffic
from tests import toy

bf16 = jnp.bfloat16
MiB = 2**20


def sds(*shape, dtype=bf16):
  return jax.ShapeDtypeStruct(shape, dtype)


# --- HLO text, no compiler needed ------------------------------------------------------

def test_physical_size_pads_to_the_tile_and_skips_vmem():
  (col,) = traffic.parse_shape("f32[8192,1]{1,0:T(8,128)}")
  assert col.logical_bytes == 8192 * 4 and col.physical_bytes == 8192 * 128 * 4 and col.memory_space == 0
  (vm,) = traffic.parse_shape("bf16[8192,4096]{1,0:T(8,128)(2,1)S(1)}")
  assert vm.memory_space == 1 and vm.physical_bytes == 8192 * 4096 * 2
  t = traffic.parse_shape("(f32[2048]{0:T(1024)S(1)}, bf16[16,256]{1,0:T(16,128)(2,1)}, s32[]{:T(128)})")
  assert [a.memory_space for a in t] == [1, 0, 0] and t[1].physical_bytes == 16 * 256 * 2


_LOOP_HLO = """HloModule m, is_scheduled=true

%body (p: (s32[], f32[64,128])) -> (s32[], f32[64,128]) {
  %p = (s32[]{:T(128)}, f32[64,128]{1,0:T(8,128)}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  %one = s32[]{:T(128)} constant(1)
  %next = s32[]{:T(128)} add(%i, %one)
  %x = f32[64,128]{1,0:T(8,128)} get-tuple-element(%p), index=1
  %y = f32[64,128]{1,0:T(8,128)} negate(%x)
  %ar = f32[64,128]{1,0:T(8,128)} all-reduce(%y), replica_groups={}, to_apply=%add
  ROOT %t = (s32[]{:T(128)}, f32[64,128]{1,0:T(8,128)}) tuple(%next, %ar)
}

%cond (q: (s32[], f32[64,128])) -> pred[] {
  %q = (s32[]{:T(128)}, f32[64,128]{1,0:T(8,128)}) parameter(0)
  %j = s32[]{:T(128)} get-tuple-element(%q), index=0
  %n = s32[]{:T(128)} constant(10)
  ROOT %lt = pred[]{:T(512)} compare(%j, %n), direction=LT
}

ENTRY %main (a: f32[64,128]) -> f32[64,128] {
  %a = f32[64,128]{1,0:T(8,128)} parameter(0)
  %zero = s32[]{:T(128)} constant(2)
  %init = (s32[]{:T(128)}, f32[64,128]{1,0:T(8,128)}) tuple(%zero, %a)
  %w = (s32[]{:T(128)}, f32[64,128]{1,0:T(8,128)}) while(%init), condition=%cond, body=%body
  ROOT %r = f32[64,128]{1,0:T(8,128)} get-tuple-element(%w), index=1
}
"""


def test_loop_trip_count_and_collectives_from_hlo_text():
  t = traffic.hlo_traffic(_LOOP_HLO)
  assert t.multiplicity["y"] == 8 and t.multiplicity["a"] == 1  # i = 2 .. 9
  array = 64 * 128 * 4
  assert t.by_op["y"] == 8 * 2 * array and t.by_op["ar"] == 8 * 2 * array
  assert t.collectives == ["ar"] and not t.notes
  assert traffic.compulsory_bytes(_LOOP_HLO) == 2 * array


def test_conditional_branches_are_all_counted():
  hlo = _LOOP_HLO.replace(
      "%w = (s32[]{:T(128)}, f32[64,128]{1,0:T(8,128)}) while(%init), condition=%cond, body=%body",
      "%w = (s32[]{:T(128)}, f32[64,128]{1,0:T(8,128)}) conditional(%zero, %init, %init), "
      "branch_computations={%body, %body2}")
  hlo = hlo.replace("ENTRY", _LOOP_HLO.split("%cond")[0].split("HloModule m, is_scheduled=true")[1]
                    .replace("%body", "%body2").replace("%y =", "%y2 =").replace("(%y)", "(%y2)")
                    .replace("%ar =", "%ar2 =").replace("%ar)", "%ar2)") + "ENTRY")
  t = traffic.hlo_traffic(hlo)
  assert t.multiplicity["y"] == 1 and t.multiplicity["y2"] == 1
  assert any("every branch counted" in n for n in t.notes)


def test_unknown_trip_count_is_said():
  hlo = _LOOP_HLO.replace("%n = s32[]{:T(128)} constant(10)", "%n = s32[]{:T(128)} get-tuple-element(%q), index=0")
  t = traffic.hlo_traffic(hlo)
  assert t.multiplicity["y"] == 1 and any("trip count unknown" in n for n in t.notes)


_ASYNC_HLO = """HloModule m, is_scheduled=true

ENTRY %main (x: bf16[8192,1024], dy: bf16[8192,1024]) -> bf16[8192,1024] {
  %x = bf16[8192,1024]{1,0:T(8,128)(2,1)} parameter(0)
  %dy = bf16[8192,1024]{1,0:T(8,128)(2,1)} parameter(1)
  %copy-start = (bf16[8192,1024]{1,0:T(8,128)(2,1)S(1)}, bf16[8192,1024]{1,0:T(8,128)(2,1)}, u32[]{:S(2)}) copy-start(%x)
  %slice-start = ((bf16[8192,1024]{1,0:T(8,128)(2,1)}), bf16[2048,1024]{1,0:T(8,128)(2,1)S(1)}, s32[]{:S(2)}) slice-start(%dy), slice={[0:2048], [0:1024]}
  %copy-done = bf16[8192,1024]{1,0:T(8,128)(2,1)S(1)} copy-done(%copy-start)
  %slice-done = bf16[2048,1024]{1,0:T(8,128)(2,1)S(1)} slice-done(%slice-start)
  %norm.1 = (bf16[8192,1024]{1,0:T(8,128)(2,1)}, f32[8,1,1024]{2,1,0:T(1,128)S(1)}) custom-call(%copy-done, %dy), custom_call_target="tpu_custom_call"
  ROOT %y = bf16[8192,1024]{1,0:T(8,128)(2,1)} get-tuple-element(%norm.1), index=0
}
"""


def test_async_slices_and_pallas_operands_in_vmem():
  array = 8192 * 1024 * 2
  # a Pallas call whose first input and second output XLA placed in VMEM
  walked = traffic.PallasTraffic("norm", 4.0 * array, ((), ()), [], True,
                                 operand_bytes=(array, array, array, array), num_inputs=2)
  t = traffic.hlo_traffic(_ASYNC_HLO, {"norm.1": walked})
  assert t.by_op["slice-start"] == array // 4  # its slice, read from HBM; written to VMEM
  assert "slice-done" not in t.by_op and t.by_op["copy-start"] == array
  assert t.by_op["norm.1"] == 2 * array  # dy read and y written in HBM; x and the partials in VMEM


def test_estimate_arithmetic():
  chip = kernels.get_chip("v5e")
  e = kernels.Estimate("v5e", cycles=int(1.5e5), ops={"f": int(1.5e5)}, clock_hz=chip.clock_hz,
                       hbm_bytes=819e9 * 200e-6, hbm_bandwidth=chip.hbm_bandwidth)
  assert e.model_seconds == pytest.approx(100e-6) and e.floor_seconds == pytest.approx(200e-6)
  assert e.seconds == e.floor_seconds and e.floored and "floored" in str(e) and e.complete
  e.unmodeled.append("all-reduce.1")
  assert not e.complete and not e.valid and "INCOMPLETE" in str(e)


# --- compiled programs ------------------------------------------------------------------

pytestmark_aot = pytest.mark.tpu_aot


@pytestmark_aot
def test_copy_moves_the_array_twice_and_is_floored():
  x = sds(4096, 4096)
  e = kernels.estimate_tpu(lambda x: x * 1, x, generation="v5e")
  assert e.hbm_bytes == 2 * 4096 * 4096 * 2 and e.bytes_method == "counted"
  # the model streams a copy faster than the chip's HBM can: the floor binds
  assert e.model_seconds < e.floor_seconds == pytest.approx(e.hbm_bytes / 819e9) and e.seconds == e.floor_seconds


@pytest.mark.parametrize("bm,bn", [(512, 1024), (256, 512)])
@pytestmark_aot
def test_pallas_matmul_re_reads_follow_from_its_blocks(bm, bn):
  n, bk = 2048, 1024
  t = tpu.hbm_traffic(lambda a, b: toy.matmul(a, b, bm=bm, bk=bk, bn=bn), sds(n, n), sds(n, n), generation="v6e")
  array = n * n * 2
  assert t.method == "counted" and not t.notes
  assert t.hbm_bytes == array * (n // bn) + array * (n // bm) + array


@pytestmark_aot
def test_attention_re_reads_k_and_v_once_per_q_block():
  b, s, h, d = 1, 1024, 2, 128
  bs = kernels.AttentionBlockSizes(block_q=256, block_kv=256, block_q_bwd=256, block_kv_bwd=256)
  f = lambda q, k, v: kernels.flash_attention(q, k, v, layout="BHSD", block_sizes=bs)  # noqa: E731
  q = sds(b, h, s, d)
  t = tpu.hbm_traffic(f, q, q, q, generation="v5e")
  (kernel,) = [n for n in t.by_op if "flash" in n]
  array = b * h * s * d * 2
  # q read once, o written once, k and v read once per q block (s / 256 = 4); plus a
  # [B, H, S] f32 log-sum-exp row if the forward writes one
  extra = t.by_op[kernel] - array * (1 + 1 + 2 * (s // 256))
  assert extra in (0, b * h * s * 4) and t.method == "counted"


@pytestmark_aot
def test_loop_bodies_are_charged_per_iteration():
  def scan(a):
    return jax.lax.scan(lambda c, x: (c * 0.9 + x, c), jnp.zeros(a.shape[1:], a.dtype), a)[1]
  short = kernels.estimate_tpu(scan, sds(512, 1024, dtype=jnp.float32), generation="v5e")
  long = kernels.estimate_tpu(scan, sds(2048, 1024, dtype=jnp.float32), generation="v5e")
  assert long.cycles / short.cycles == pytest.approx(4, rel=0.05)
  assert long.hbm_bytes == pytest.approx(2 * 2048 * 1024 * 4, rel=0.01)  # read a, write h, a row a step


def _memory_bound():
  x, s = sds(2048, 4096), sds(4096, dtype=jnp.float32)
  nbytes = 2 * 2048 * 4096 * 2

  def copy_pallas(x):
    from jax.experimental import pallas as pl
    spec = pl.BlockSpec((512, 4096), lambda i: (i, 0))
    return pl.pallas_call(lambda i, o: o.__setitem__(..., i[...]), grid=(4,), in_specs=[spec], out_specs=spec,
                          out_shape=x)(x)
  return {
      "copy (XLA)": (lambda x: x * 1, (x,), nbytes),
      "copy (Pallas)": (copy_pallas, (x,), nbytes),
      "gelu (XLA)": (jax.nn.gelu, (x,), nbytes),
      "rms norm (ours)": (lambda x, s: kernels.rms_norm(x, s), (x, s), nbytes),
      "rms norm (XLA)": (lambda x, s: kernels.rms_norm(x, s, implementation="xla"), (x, s), nbytes),
      "layer norm (ours)": (lambda x, s: kernels.layer_norm(x, s, s), (x, s), nbytes),
      "layer norm (XLA)": (lambda x, s: kernels.layer_norm(x, s, s, implementation="xla"), (x, s), nbytes),
      "add-and-norm (ours)": (lambda x, s: kernels.rms_norm(x, s, residual=x), (x, s), 2 * nbytes),
  }


@pytest.mark.parametrize("generation", ["v5e", "v6e"])
@pytest.mark.parametrize("name", list(_memory_bound()))
@pytestmark_aot
def test_no_floored_estimate_beats_the_roofline(name, generation):
  fn, args, nbytes = _memory_bound()[name]
  e = kernels.estimate_tpu(fn, *args, generation=generation, flops=0, bytes_accessed=nbytes)
  assert e.hbm_bytes >= nbytes * 0.999, str(e)
  assert e.fraction_of_roofline <= 1.0 + 1e-9 and e.valid, str(e)


@pytestmark_aot
def test_a_convolution_the_model_leaves_at_zero_makes_the_estimate_incomplete():
  # libtpu 0.0.42's profile charges this 3x3 convolution fusion 0 cycles on v5e (it charges
  # 28x28x512 with the same FLOPs); whichever way a libtpu goes, the estimate must say so.
  def conv(x, w):
    return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
  e = kernels.estimate_tpu(conv, sds(32, 56, 56, 256), sds(3, 3, 256, 256), generation="v5e")
  convs = [n for n in e.ops if e.ops[n] == 0 and n in e.unmodeled]
  if e.model_seconds == 0 or convs:
    assert not e.complete and not e.valid and "INCOMPLETE" in str(e)
    assert e.seconds == e.floor_seconds > 0
  else:
    assert e.complete and e.model_seconds > 0
