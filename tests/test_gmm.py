"""kernels.experts.grouped: gmm and tgmm against lax.ragged_dot and a float64 oracle, over skewed and empty groups.

Everything but the ``tpu_aot`` tests runs the kernels in interpret mode on the CPU, on small
shapes with 128-row/column blocks, so grids have several m-tiles (tiles straddling group
boundaries), several K steps and several n-tiles, and partial last tiles.

Tolerances (|out - expected| <= ATOL + RTOL * |expected|, entries O(sqrt(k))):

* float32 (interpret mode computes the f32 dots exactly on the CPU): 1e-4 absolute and relative
  (sums of k <= 384 products in a different order; observed ~3e-5 absolute).
* bfloat16 output: one rounding of the f32 sum (2^-8 relative), and the oracle is computed on the
  bf16 inputs in float64: 2^-7 relative, 2e-2 absolute.
* quantized rhs: the f32 product of bf16 lhs and exactly converted int8/fp8 rhs, scaled, rounded
  to the output dtype: as bfloat16 (or float32) above.
"""

import jax
import jax.test_util
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels
from tests import run_program
from kernels.experts import grouped_kernels as K
from kernels.base.errors import KernelError, TilingError

from kernels.experts import grouped as gm

TOL = {"float32": dict(atol=1e-4, rtol=1e-4), "bfloat16": dict(atol=2e-2, rtol=2 ** -7)}
SMALL = (128, 128, 128)
M, KD, N = 300, 256, 384  # 3 m-tiles (last partial), 2 K steps, 3 n-tiles
SIZES = {
    "balanced": [75, 75, 75, 75],
    "skewed": [200, 60, 30, 10],
    "empty": [0, 150, 0, 150],
    "short": [10, 0, 20, 100],  # sums to 130 < 300: the rest of the rows are zero
    "none": [0, 0, 0, 0],
    "one": [300, 0, 0, 0],
}


def rand(shape, dtype=jnp.float32, seed=0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32), dtype)


def f64(x):
  return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def oracle_gmm(lhs, rhs, sizes, transpose_rhs=False, scale=None):
  lhs, rhs = f64(lhs), f64(rhs)
  if transpose_rhs:
    rhs = rhs.transpose(0, 2, 1)
  out = np.zeros((lhs.shape[0], rhs.shape[2]))
  start = 0
  for g, s in enumerate(sizes):
    out[start:start + s] = lhs[start:start + s] @ rhs[g] * (1.0 if scale is None else f64(scale)[g])
    start += s
  return out


def oracle_tgmm(lhs, rhs, sizes):
  lhs, rhs = f64(lhs), f64(rhs)
  out = np.zeros((len(sizes), lhs.shape[0], rhs.shape[1]))
  start = 0
  for g, s in enumerate(sizes):
    out[g] = lhs[:, start:start + s] @ rhs[start:start + s]
    start += s
  return out


def call_gmm(lhs, rhs, sizes, **kw):
  kw.setdefault("block_sizes", SMALL)
  return kernels.gmm(lhs, rhs, jnp.asarray(sizes, jnp.int32), implementation="pallas", interpret=True, **kw)


def call_tgmm(lhs, rhs, sizes, **kw):
  kw.setdefault("block_sizes", SMALL)
  return kernels.tgmm(lhs, rhs, jnp.asarray(sizes, jnp.int32), implementation="pallas", interpret=True, **kw)


def assert_close(out, want, dtype):
  np.testing.assert_allclose(f64(out), want, **TOL[jnp.dtype(dtype).name])


# --- visit tables --------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SIZES))
@pytest.mark.parametrize("tm", [256, 128, 64])
def test_tables_numpy_and_jax_agree_and_cover_every_row_once(name, tm):
  sizes = np.array(SIZES[name], np.int32)
  for build in (K.gmm_tables, K.tgmm_tables):
    t_np = build(sizes, M, tm, xp=np)
    t_jx = build(jnp.asarray(sizes), M, tm, xp=jnp)
    for key in t_np:
      np.testing.assert_array_equal(t_np[key], np.asarray(t_jx[key]), err_msg=f"{build.__name__} {key}")
  t = K.gmm_tables(sizes, M, tm, xp=np)
  off = t["offsets"]
  covered = np.zeros(M, int)
  for tile, g in zip(t["tile"], t["group"]):
    rows = np.arange(tile * tm, min(tile * tm + tm, M))
    covered[rows[(rows >= off[g]) & (rows < off[g + 1])]] += 1
  real = np.unique(np.stack([t["tile"], t["group"]], 1), axis=0)  # padding repeats the last visit
  assert len(real) <= K.visit_count(M, tm, len(sizes))
  assert (covered >= 1).all()
  visited_groups = set(t["group"][t["group"] < len(sizes)])
  assert visited_groups == {g for g, s in enumerate(sizes) if s > 0}  # empty groups are never visited
  # The per-visit gates the kernels read (tables, not comparisons: see GMM_TABLES) are the
  # row ranges' intersections.
  sub = K._sub_rows(tm)
  for i, (tile, g) in enumerate(zip(t["tile"], t["group"])):
    lo, hi = off[min(g, len(sizes))], off[min(g, len(sizes)) + 1]
    assert t["full"][i] == (lo <= tile * tm and hi >= tile * tm + tm)
    meets = [s for s in range(tm // sub) if tile * tm + s * sub < hi and tile * tm + (s + 1) * sub > lo]
    if g < len(sizes):
      assert meets == list(range(t["sub_first"][i], t["sub_last"][i] + 1)), (i, meets)
  tt = K.tgmm_tables(sizes, M, tm, xp=np)
  starts, ends = tt["offsets"][:-1], tt["offsets"][1:]
  for i, (tile, g) in enumerate(zip(tt["tile"], tt["group"])):
    assert tt["full"][i] == (starts[g] <= tile * tm and ends[g] >= tile * tm + tm)


def test_static_lookup_runs_reproduce_the_tables():
  rng = np.random.default_rng(0)
  for t in range(500):
    n = int(rng.integers(1, 12))
    vals = [int(v) for v in (rng.integers(0, 3, n).cumsum() if t % 2 else rng.integers(-3, 3, n))]
    got = [max((s for s in K._segments(vals) if s[0] <= i), key=lambda s: s[0]) for i in range(n)]
    assert [a + b * (i - p) for i, (p, a, b) in enumerate(got)] == vals
  assert len(K._segments(list(range(16)) + [15] * 8)) == 2  # a tile table: one run per slope


# --- gmm forward ---------------------------------------------------------------------------


@pytest.mark.parametrize("name,dtype", [(n, jnp.float32) for n in SIZES]
                         + [(n, jnp.bfloat16) for n in ("balanced", "skewed", "empty")])
def test_gmm_matches_oracle_and_ragged_dot(name, dtype):
  sizes = SIZES[name]
  lhs, rhs = rand((M, KD), dtype, 1), rand((4, KD, N), dtype, 2)
  out = call_gmm(lhs, rhs, sizes)
  assert out.shape == (M, N) and out.dtype == dtype
  assert_close(out, oracle_gmm(lhs, rhs, sizes), dtype)
  rd = jax.lax.ragged_dot(lhs, rhs, jnp.asarray(sizes, jnp.int32), preferred_element_type=jnp.float32)
  assert_close(out, f64(rd), dtype)
  assert_close(kernels.gmm_reference(lhs, rhs, jnp.asarray(sizes, jnp.int32)), oracle_gmm(lhs, rhs, sizes), dtype)


@pytest.mark.parametrize("name", ["skewed", "short"])
def test_gmm_transpose_rhs_and_f32_output(name):
  sizes = SIZES[name]
  lhs, rhs = rand((M, KD), jnp.bfloat16, 3), rand((4, N, KD), jnp.bfloat16, 4)
  out = call_gmm(lhs, rhs, sizes, transpose_rhs=True, preferred_element_type=jnp.float32,
                 block_sizes=(256, 128, 128))  # straddled tiles computed in 128-row sub-tiles
  assert out.dtype == jnp.float32
  assert_close(out, oracle_gmm(lhs, rhs, sizes, transpose_rhs=True), jnp.float32)


def test_gmm_odd_shapes_and_k_tail():
  # k = 200 is not a multiple of tk = 128: the last K block's stale columns are zeroed.
  m, k, n, sizes = 77, 200, 130, [30, 0, 47]
  lhs, rhs = rand((m, k), seed=5), rand((3, k, n), seed=6)
  assert_close(call_gmm(lhs, rhs, sizes), oracle_gmm(lhs, rhs, sizes), jnp.float32)
  assert_close(call_gmm(lhs, rhs, sizes, block_sizes=(512, 512, 512)), oracle_gmm(lhs, rhs, sizes), jnp.float32)


@pytest.mark.parametrize("name", ["skewed", "empty", "short"])
def test_static_offsets_kernel_equals_dynamic(name):
  sizes = SIZES[name]
  lhs, rhs = rand((M, KD), seed=7), rand((4, KD, N), seed=8)
  dyn = call_gmm(lhs, rhs, sizes)
  static = gm.gmm_static_groups(lhs, rhs, np.array(sizes), block_sizes=SMALL, interpret=True)
  np.testing.assert_array_equal(np.asarray(static), np.asarray(dyn))
  lt, rt = rand((KD, M), seed=9), rand((M, N), seed=10)
  np.testing.assert_array_equal(np.asarray(gm.tgmm_static_groups(lt, rt, np.array(sizes), block_sizes=SMALL,
                                                                 interpret=True)),
                                np.asarray(call_tgmm(lt, rt, sizes)))


def _visit_axes(fn, *args):
  """The visit-axis length of each grouped-matmul kernel in ``fn``'s jaxpr (a tracer for a run-time bound)."""
  from kernels.perf import traffic
  jaxpr = jax.make_jaxpr(fn)(*args)
  out = []
  for e in traffic.pallas_calls(jaxpr):
    gm_ = e.params["grid_mapping"]
    out.append((e.params["name"], gm_.grid, gm_.num_dynamic_grid_bounds))
  return out


def test_the_visit_axis_holds_only_real_visits():
  # A static axis of m_tiles + E would spend a grid step on every unused visit. Balanced
  # sizes on whole tiles visit each m-tile once: gmm's axis is m_tiles long, tgmm's too.
  lhs, rhs, lt, rt = rand((M, KD)), rand((4, KD, N)), rand((KD, M)), rand((M, N))
  balanced = np.array([128, 128, 0, 44])  # tiles of 128: three visits (the last tile's rows end at the sum)
  (name, grid, dyn), = _visit_axes(lambda a, b: gm.gmm_static_groups(a, b, balanced, block_sizes=(128, 128, 128)),
                                   lhs, rhs)
  assert (name, grid[1], dyn) == ("gmm", 3, 0)
  (name, grid, dyn), = _visit_axes(lambda a, b: gm.tgmm_static_groups(a, b, balanced, block_sizes=(128, 128, 128)),
                                   lt, rt)
  assert (name, grid[2], dyn) == ("tgmm", 4, 0)  # the empty group has its one (zero-writing) visit
  # With traced sizes the axis is a run-time bound (the real count, from the tables).
  (name, grid, dyn), = _visit_axes(lambda a, b, g: kernels.gmm(a, b, g, implementation="pallas", interpret=True,
                                                               block_sizes=(128, 128, 128)),
                                   lhs, rhs, jnp.asarray(balanced, jnp.int32))
  assert name == "gmm" and dyn == 1
  t = K.gmm_tables(jnp.asarray(balanced, jnp.int32), M, 128)
  assert int(t["visits"]) == 3 == K.gmm_tables(balanced, M, 128, xp=np)["visits"]


def test_traced_group_sizes_under_jit():
  lhs, rhs = rand((M, KD), seed=11), rand((4, KD, N), seed=12)
  f = jax.jit(lambda a, b, g: call_gmm(a, b, g))
  for sizes in (SIZES["skewed"], SIZES["empty"]):  # one compile, two sizes
    assert_close(f(lhs, rhs, jnp.asarray(sizes, jnp.int32)), oracle_gmm(lhs, rhs, sizes), jnp.float32)


@settings(max_examples=6, deadline=None)
@given(sizes=st.lists(st.integers(0, 90), min_size=1, max_size=6), extra=st.integers(0, 40),
       k=st.sampled_from([128, 160, 256]), n=st.sampled_from([128, 200]), bf16=st.booleans(),
       tm=st.sampled_from([128, 256]))
def test_hypothesis_skewed_and_empty_groups(sizes, extra, k, n, bf16, tm):
  m = max(1, sum(sizes) + extra)
  dtype = jnp.bfloat16 if bf16 else jnp.float32
  lhs, rhs = rand((m, k), dtype, 13), rand((len(sizes), k, n), dtype, 14)
  out = call_gmm(lhs, rhs, sizes, block_sizes=(tm, 128, 128))
  assert_close(out, oracle_gmm(lhs, rhs, sizes), dtype)
  lt, rt = rand((k, m), dtype, 15), rand((m, n), dtype, 16)
  assert_close(call_tgmm(lt, rt, sizes, block_sizes=(tm, 128, 128)), oracle_tgmm(lt, rt, sizes), dtype)


@pytest.mark.parametrize("qdtype,transpose_rhs", [(jnp.int8, False), (jnp.float8_e4m3fn, True)])
def test_quantized_rhs_with_per_channel_scales(qdtype, transpose_rhs):
  sizes = SIZES["short"]
  lhs = rand((M, KD), jnp.bfloat16, 26)
  w = np.random.default_rng(27).standard_normal((4, N, KD) if transpose_rhs else (4, KD, N)) * 3
  rhs = jnp.asarray(np.clip(np.round(w), -127, 127).astype(np.int8)) if qdtype == jnp.int8 else jnp.asarray(w, qdtype)
  scale = jnp.asarray(np.random.default_rng(28).uniform(0.01, 0.1, (4, N)), jnp.float32)
  want = oracle_gmm(lhs, rhs.astype(jnp.float32), sizes, transpose_rhs=transpose_rhs, scale=scale)
  for out_dtype in (jnp.bfloat16, jnp.float32):
    out = call_gmm(lhs, rhs, sizes, transpose_rhs=transpose_rhs, rhs_scale=scale, preferred_element_type=out_dtype)
    assert out.dtype == out_dtype
    assert_close(out, want, out_dtype)
  ref = kernels.gmm_reference(lhs, rhs, jnp.asarray(sizes, jnp.int32), transpose_rhs=transpose_rhs,
                              rhs_scale=scale[:, None, :])
  assert_close(ref, want, jnp.bfloat16)


# --- tgmm ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name,dtype", [(n, jnp.float32) for n in ("balanced", "skewed", "empty", "short", "none")]
                         + [(n, jnp.bfloat16) for n in ("skewed", "empty")])
def test_tgmm_matches_oracle_and_reference(name, dtype):
  sizes = SIZES[name]
  lhs, rhs = rand((KD, M), dtype, 17), rand((M, N), dtype, 18)
  out = call_tgmm(lhs, rhs, sizes)
  assert out.shape == (4, KD, N) and out.dtype == dtype
  want = oracle_tgmm(lhs, rhs, sizes)
  assert_close(out, want, dtype)
  assert_close(kernels.tgmm_reference(lhs, rhs, jnp.asarray(sizes, jnp.int32)), want, dtype)
  for g, s in enumerate(sizes):
    if s == 0:
      assert not np.asarray(out[g], np.float32).any()


# --- backward ------------------------------------------------------------------------------


@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.parametrize("name", ["skewed", "short"])
def test_gradients_match_reference_vjp(transpose_rhs, name):
  sizes = jnp.asarray(SIZES[name], jnp.int32)
  lhs = rand((M, KD), seed=19)
  rhs = rand((4, N, KD) if transpose_rhs else (4, KD, N), seed=20)
  dout = rand((M, N), seed=21)

  def grads(impl):
    f = lambda a, b: kernels.gmm(a, b, sizes, transpose_rhs=transpose_rhs, block_sizes=SMALL,  # noqa: E731
                                 implementation=impl, interpret=True if impl == "pallas" else None)
    return jax.vjp(f, lhs, rhs)[1](dout)
  for got, want in zip(grads("pallas"), grads("xla")):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4 * float(jnp.abs(want).max()) + 1e-5)


def test_bf16_gradients_have_input_dtypes():
  sizes = jnp.asarray(SIZES["empty"], jnp.int32)
  lhs, rhs = rand((M, KD), jnp.bfloat16, 22), rand((4, KD, N), jnp.bfloat16, 23)
  f = lambda a, b: call_gmm(a, b, sizes).astype(jnp.float32).sum()  # noqa: E731
  da, db = jax.grad(f, argnums=(0, 1))(lhs, rhs)
  assert da.dtype == jnp.bfloat16 and db.dtype == jnp.bfloat16
  assert not np.asarray(db[0], np.float32).any() and not np.asarray(db[2], np.float32).any()  # empty groups


def test_check_grads_reference_f64():
  with jax.enable_x64(True):
    sizes = jnp.asarray([3, 0, 5], jnp.int32)
    lhs = jnp.asarray(np.random.default_rng(0).standard_normal((10, 4)))
    rhs = jnp.asarray(np.random.default_rng(1).standard_normal((3, 4, 5)))
    jax.test_util.check_grads(lambda a, b: kernels.gmm(a, b, sizes), (lhs, rhs), order=1, modes=["rev"])


# --- errors --------------------------------------------------------------------------------


def test_bad_input_names_the_argument():
  lhs, rhs = rand((M, KD)), rand((4, KD, N))
  gs = jnp.asarray([100, 100, 100, 100], jnp.int32)
  cases = [
      (dict(group_sizes=gs), "group_sizes"),  # sums to 400 > 300 tokens
      (dict(group_sizes=jnp.asarray([1, 2, 3], jnp.int32)), "group_sizes"),  # 3 groups, 4 experts
      (dict(group_sizes=jnp.asarray([1.0, 2, 3, 4])), "group_sizes"),  # not integers
      (dict(group_sizes=jnp.asarray([-1, 2, 3, 4], jnp.int32)), "group_sizes"),
      (dict(rhs=rand((4, KD + 1, N))), "rhs"),
      (dict(rhs=rand((4, KD, N), jnp.bfloat16)), "rhs"),  # dtype differs from lhs
      (dict(rhs=rand((4, KD, N)).astype(jnp.int8)), "rhs_scale"),  # quantized without scales
      (dict(lhs=rand((M, KD, 1))), "lhs"),
      (dict(block_sizes=(100, 128, 128)), "block_sizes"),
      (dict(transpose_rhs=1), "transpose_rhs"),
  ]
  for kw, arg in cases:
    args = dict(lhs=lhs, rhs=rhs, group_sizes=jnp.asarray([75] * 4, jnp.int32)) | kw
    with pytest.raises(KernelError) as e:
      kernels.gmm(args.pop("lhs"), args.pop("rhs"), args.pop("group_sizes"), implementation="pallas",
                  interpret=True, **args)
    assert e.value.argument == arg, (kw, e.value)
  with pytest.raises(KernelError, match="group_sizes"):
    kernels.tgmm(rand((KD, M)), rand((M, N)), gs, interpret=True)
  with pytest.raises(KernelError, match="rhs"):
    kernels.tgmm(rand((KD, M)), rand((M + 1, N)), jnp.asarray([75] * 4, jnp.int32))
  with pytest.raises(TilingError):
    call_gmm(lhs, rhs, [75] * 4, block_sizes=(128, 100, 128))


def test_xla_path_is_the_reference():
  sizes = SIZES["skewed"]
  lhs, rhs = rand((M, KD), seed=24), rand((4, KD, N), seed=25)
  out = kernels.gmm(lhs, rhs, jnp.asarray(sizes, jnp.int32))  # CPU, implementation=None: XLA
  assert_close(out, oracle_gmm(lhs, rhs, sizes), jnp.float32)


@pytest.mark.parametrize("implementation", [None, "pallas"])
def test_traced_sizes_are_clipped_on_both_paths(implementation):
  # Traced sizes are clipped as documented: a negative size counts as 0 and the running sum stops at
  # the tokens. The XLA path handed them to lax.ragged_dot unclipped, where the -130 moved the last
  # group's rows back to 70..80 (found by tools/fuzz.py, tgmm seed 0 case 761).
  sizes, clipped = [200, -130, 10, 150], [200, 0, 10, 90]
  kw = dict(implementation=implementation, interpret=True if implementation else None, block_sizes=SMALL)
  lhs, rhs = rand((M, KD), seed=26), rand((4, KD, N), seed=27)
  out = jax.jit(lambda a, b, g: kernels.gmm(a, b, g, **kw))(lhs, rhs, jnp.asarray(sizes, jnp.int32))
  assert_close(out, oracle_gmm(lhs, rhs, clipped), jnp.float32)
  lt, rt = rand((KD, M), seed=28), rand((M, N), seed=29)
  out = jax.jit(lambda a, b, g: kernels.tgmm(a, b, g, **kw))(lt, rt, jnp.asarray(sizes, jnp.int32))
  assert_close(out, oracle_tgmm(lt, rt, clipped), jnp.float32)


# --- block sizes ---------------------------------------------------------------------------


def test_default_blocks_fit_every_generation():
  for gen in kernels.TPU_GENERATIONS:
    chip = kernels.get_chip(gen)
    for kernel in ("gmm", "tgmm"):
      d = gm.default_block_sizes(gen, kernel)
      for (m, k, n) in ((8192, 4096, 14336), (65536, 2048, 1408), (65536, 1408, 2048), (100, 64, 200)):
        plan, _ = gm._plan(kernel, m, k, n, 8, gm.GmmBlockSizes(), jnp.bfloat16, jnp.bfloat16, jnp.bfloat16,
                           chip=chip)
        assert plan.tm in (m, d.tm) or plan.tm % 128 == 0
        need = gm._vmem_bytes(kernel, plan.tm, plan.tk, plan.tn, jnp.bfloat16, jnp.bfloat16, jnp.bfloat16)
        assert need < chip.vmem_bytes


# --- ahead-of-time compilation for TPU -------------------------------------------------------

_AOT_PROGRAMS = """
import sys, importlib, numpy as np, jax, jax.numpy as jnp, kernels
from kernels.experts import grouped as gm
gen, bf16, sds = sys.argv[1], jnp.bfloat16, jax.ShapeDtypeStruct
i32 = jnp.int32

def fwd_bwd(transpose_rhs=False):
  def f(lhs, rhs, gs, dout):
    out, vjp = jax.vjp(lambda a, b: kernels.gmm(a, b, gs, transpose_rhs=transpose_rhs), lhs, rhs)
    return out, vjp(dout)
  return f

# Odd shapes at the default blocks: gmm forward + backward (gmm and tgmm), transposed rhs, tgmm alone.
m, k, n, e = 300, 200, 260, 5
comp = kernels.compile_for_tpu(lambda *a: [fwd_bwd()(*a[:4]), fwd_bwd(True)(a[0], a[4], a[2], a[3]),
                                           kernels.tgmm(a[5], a[3], a[2])],
                               sds((m, k), bf16), sds((e, k, n), bf16), sds((e,), i32), sds((m, n), bf16),
                               sds((e, n, k), bf16), sds((k, m), bf16), generation=gen)
assert comp.hlo.count("tpu_custom_call") == 7, comp.hlo
# The benchmark shapes (full size), dynamic and static group sizes.
m, k, n, e = 8192, 4096, 14336, 8
skewed = np.array([4096, 2048, 1024, 512, 256, 128, 64, 64])
args = (sds((m, k), bf16), sds((e, k, n), bf16), sds((e,), i32), sds((m, n), bf16))
comp = kernels.compile_for_tpu(fwd_bwd(), *args, generation=gen)
assert comp.hlo.count("tpu_custom_call") == 3 and comp.vmem_bytes < kernels.get_chip(gen).vmem_bytes
if gen == "v6e":  # the estimation variant: the same kernel body, tables as constants (generation-blind code)
  comp = kernels.compile_for_tpu(lambda a, b: gm.gmm_static_groups(a, b, skewed), *args[:2], generation=gen)
  assert comp.hlo.count("tpu_custom_call") == 1
m, k, n, e = 65536, 2048, 1408, 64
comp = kernels.compile_for_tpu(fwd_bwd(), sds((m, k), bf16), sds((e, k, n), bf16), sds((e,), i32),
                               sds((m, n), bf16), generation=gen)
assert comp.hlo.count("tpu_custom_call") == 3
# Quantized rhs (converted to bf16 in VMEM) where Mosaic lowers it, else the XLA fallback.
for q in (jnp.int8, jnp.float8_e4m3fn):
  comp = kernels.compile_for_tpu(lambda a, b, g, s: kernels.gmm(a, b, g, rhs_scale=s), sds((300, 256), bf16),
                                 sds((4, 256, 384), q), sds((4,), i32), sds((4, 384), jnp.float32), generation=gen)
  want = 1 if jnp.dtype(q).name in gm.QUANT_RHS_LOWERS[gen] else 0
  assert comp.hlo.count("tpu_custom_call") == want, (gen, q)
print("ok")
"""


@pytest.mark.tpu_aot
@pytest.mark.parametrize("generation", kernels.TPU_GENERATIONS)
def test_aot_compiles_forward_and_backward(generation):
  import os
  env = dict(os.environ, KERNELS_STATIC_PROFILE="0")
  proc = run_program(_AOT_PROGRAMS, generation, env=env)
  assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]
