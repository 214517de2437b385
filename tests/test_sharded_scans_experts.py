"""Scans and experts partition themselves under ``jit`` on a mesh (issue 56, :mod:`kernels.base.partition`).

Per kernel, on 8 CPU devices in interpret mode, in Explicit mode (sharded arrays) and in Auto mode
(``kernels.sharding`` rules): the forward and ``jax.grad`` equal the single-device result. Then the
ahead-of-time TPU compiles on v5e:2x4 (and one on v5p:2x2x2), whose HLO holds exactly the collectives
the split needs and whose per-chip arguments are the local shares. Then the splits that cannot be
followed: a KernelError naming the argument.

Tolerances: everything here is float32. Forwards agree to 1e-5 relative (the sequence-parallel
forms reassociate the carry products; the psums add partial sums in another order); gradients to
2e-4 relative of their largest entry (the same, through the backward kernels).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import kernels
from kernels.base.errors import KernelError

PALLAS = dict(implementation="pallas", interpret=True)
COLLECTIVES = ("all-reduce(", "all-gather(", "collective-permute(", "all-to-all(", "ragged-all-to-all(",
               "reduce-scatter(")


def _mesh(explicit: bool):
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 devices (tests/conftest.py asks for 8 CPU devices)")
  kind = AxisType.Explicit if explicit else AxisType.Auto
  return jax.make_mesh((2, 4), ("data", "model"), axis_types=(kind,) * 2)


def _rng(seed=0):
  return np.random.default_rng(seed)


def _normal(rng, *shape, scale=1.0):
  return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)


def _close(got, want, rtol):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
    assert g.shape == w.shape
    np.testing.assert_allclose(g, w, rtol=0, atol=rtol * max(1.0, float(np.abs(w).max())))


def _check(fn, args, specs, *, rules=None, argnums=None, fwd_rtol=1e-5, grad_rtol=2e-4):
  """``fn(*args)`` and the gradient of ``sum(fn(*args) * cotangent)`` under jit on the (2, 4)
  mesh (Explicit mode if ``rules`` is None: the arguments placed by ``specs``; else Auto mode
  with those rules) against the single-device values."""
  argnums = tuple(range(len(args))) if argnums is None else argnums
  want = fn(*args)
  cot = jax.tree.map(lambda y: jnp.asarray(_rng(7).standard_normal(y.shape), y.dtype)
                     if jnp.issubdtype(y.dtype, jnp.floating) else None, want)

  def loss(*a):
    out = fn(*a)
    return sum(jnp.sum(y * c) for y, c in zip(jax.tree.leaves(out), jax.tree.leaves(cot)))
  want_grad = jax.grad(loss, argnums)(*args)
  mesh = _mesh(explicit=rules is None)
  if rules is None:
    with jax.set_mesh(mesh):
      placed = [a if s is None else jax.device_put(a, P(*s)) for a, s in zip(args, specs)]
      got = jax.jit(fn)(*placed)
      got_grad = jax.jit(jax.grad(loss, argnums))(*placed)
  else:
    placed = [a if s is None else jax.device_put(a, NamedSharding(mesh, P(*s))) for a, s in zip(args, specs)]
    with kernels.sharding(mesh, **rules):
      got = jax.jit(fn)(*placed)
      got_grad = jax.jit(jax.grad(loss, argnums))(*placed)
  _close(got, want, fwd_rtol)
  _close(got_grad, want_grad, grad_rtol)
  return got


# ---------------------------------------------------------------------------------
# linear_scan
# ---------------------------------------------------------------------------------


def _scan_args(rng, batch=2, seq=64, width=256):
  a = jnp.asarray(rng.uniform(0.6, 1.0, (batch, seq, width)), jnp.float32)
  b = _normal(rng, batch, seq, width)
  h0 = _normal(rng, batch, width)
  reset = jnp.asarray(rng.uniform(size=(batch, seq)) < 0.05)
  return a, b, h0, reset


@pytest.mark.parametrize("reverse", [False, True])
def test_linear_scan_sequence_split_equals_single_device_explicit(reverse):
  a, b, h0, reset = _scan_args(_rng())

  def fn(a, b, h0):
    return kernels.linear_scan(a, b, h0=h0, reset=reset, reverse=reverse, return_final_state=True, **PALLAS)
  rows = ("data", "model", None)
  h, last = _check(fn, (a, b, h0), (rows, rows, ("data", None)))
  assert jax.typeof(h).sharding.spec == P("data", "model", None)
  assert jax.typeof(last).sharding.spec in (P("data", None), P("data"))  # replicated over the sequence's axis


def test_linear_scan_auto_mode_batch_width_and_sequence_over_two_axes():
  a, b, h0, reset = _scan_args(_rng(1), batch=2, seq=64, width=256)
  fn = lambda a, b, h0: kernels.linear_scan(a, b, h0=h0, reset=reset, return_final_state=True, **PALLAS)  # noqa: E731
  _check(fn, (a, b, h0), (None, None, None), rules=dict(batch="data", embed="model"))
  _check(fn, (a, b, h0), (None, None, None), rules=dict(seq=("data", "model")))


def test_linear_scan_time_invariant_gate_and_width_split():
  rng = _rng(2)
  _, b, h0, _ = _scan_args(rng)
  a = jnp.asarray(rng.uniform(0.6, 1.0, (256,)), jnp.float32)
  fn = lambda a, b, h0: kernels.linear_scan(a, b, h0=h0, **PALLAS)  # noqa: E731
  _check(fn, (a, b, h0), (("model",), ("data", None, "model"), ("data", "model")))
  _check(fn, (a, b, h0), (None, ("data", "model", None), ("data", None)))


# ---------------------------------------------------------------------------------
# ssd and gated linear attention
# ---------------------------------------------------------------------------------


def _ssd_args(rng, batch=2, seq=512, heads=4, head_dim=16, groups=2, state=16):
  x = _normal(rng, batch, seq, heads, head_dim)
  dt = jnp.asarray(rng.uniform(0.01, 0.1, (batch, seq, heads)), jnp.float32)
  A = -jnp.asarray(rng.uniform(0.5, 2.0, (heads,)), jnp.float32)
  B, C = _normal(rng, batch, seq, groups, state), _normal(rng, batch, seq, groups, state)
  D = _normal(rng, heads)
  h0 = _normal(rng, batch, heads, head_dim, state)
  return x, dt, A, B, C, D, h0


def test_ssd_sequence_split_equals_single_device_explicit():
  x, dt, A, B, C, D, h0 = _ssd_args(_rng(3))
  reset = jnp.zeros((2, 512), bool).at[1, 300].set(True)

  def fn(x, dt, A, B, C, D, h0):
    return kernels.ssd(x, dt, A, B, C, D=D, h0=h0, reset=reset, chunk_size=128, return_final_state=True, **PALLAS)
  t = ("data", "model")
  _check(fn, (x, dt, A, B, C, D, h0), (t, t, None, t, t, None, ("data",)))


def test_ssd_heads_split_takes_the_groups_along_or_replicates_one_group_auto():
  x, dt, A, B, C, D, h0 = _ssd_args(_rng(4), seq=128, heads=8, groups=4)

  def fn(x, dt, A, B, C, D, h0):
    return kernels.ssd(x, dt, A, B, C, D=D, h0=h0, chunk_size=128, return_final_state=True, **PALLAS)
  _check(fn, (x, dt, A, B, C, D, h0), (None,) * 7, rules=dict(batch="data", heads="model"))
  _check(fn, (x, dt, A, B[:, :, :1], C[:, :, :1], D, h0), (None,) * 7, rules=dict(heads="model"))


def test_gated_linear_attention_sequence_and_heads_split_explicit():
  rng = _rng(5)
  q, k, v = (_normal(rng, 2, 256, 4, 16, scale=0.5) for _ in range(3))
  log_decay = -jnp.asarray(rng.uniform(0.01, 0.2, (2, 256, 4)), jnp.float32)
  fn = lambda q, k, v, g: kernels.gated_linear_attention(q, k, v, g, chunk_size=128, return_final_state=True,  # noqa: E731
                                                         **PALLAS)
  s = (None, "data", "model")
  _check(fn, (q, k, v, log_decay), (s, s, s, s))


# ---------------------------------------------------------------------------------
# parallel_scan
# ---------------------------------------------------------------------------------


def test_parallel_scan_batch_split_equals_single_device_and_sequence_split_is_an_error():
  rng = _rng(6)
  x = _normal(rng, 8, 64, 32)
  A = _normal(rng, 32, 32, scale=0.1)
  B, C = _normal(rng, 32, 32, scale=0.2), _normal(rng, 32, 16, scale=0.2)
  fn = lambda x, A, B, C: kernels.parallel_scan(x, A, B, C, num_segments=2, **PALLAS)  # noqa: E731
  _check(fn, (x, A, B, C), (("data",), None, None, None))
  _check(fn, (x, A, B, C), (None,) * 4, rules=dict(batch=("data", "model")))
  with jax.set_mesh(_mesh(True)):
    xs = jax.device_put(x, P("data", "model"))
    with pytest.raises(KernelError, match=r"x=.*no sequence-parallel form.*linear_scan or ssd"):
      jax.jit(fn)(xs, A, B, C)


# ---------------------------------------------------------------------------------
# gmm, tgmm
# ---------------------------------------------------------------------------------

GROUP_SIZES = jnp.asarray([10, 40, 0, 70, 33, 1, 50, 20], jnp.int32)  # 224 of 256 rows: a zero tail


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_gmm_expert_feature_and_contraction_splits_explicit(transpose_rhs):
  rng = _rng(8)
  lhs = _normal(rng, 256, 256, scale=0.1)
  rhs = _normal(rng, 8, 256, 128, scale=0.1)
  if transpose_rhs:
    rhs = jnp.swapaxes(rhs, 1, 2)
  fn = lambda l, r: kernels.gmm(l, r, GROUP_SIZES, transpose_rhs=transpose_rhs, **PALLAS)  # noqa: E731
  k_of = (lambda e, k, n: (e, n, k)) if transpose_rhs else (lambda e, k, n: (e, k, n))
  _check(fn, (lhs, rhs), (None, k_of("model", None, "data")))       # experts and features
  _check(fn, (lhs, rhs), ((None, "data"), k_of("model", "data", None)))  # experts and contraction


def test_gmm_and_tgmm_expert_parallel_auto():
  rng = _rng(9)
  lhs = _normal(rng, 256, 128, scale=0.1)
  rhs = _normal(rng, 8, 128, 128, scale=0.1)
  fn = lambda l, r: kernels.gmm(l, r, GROUP_SIZES, **PALLAS)  # noqa: E731
  _check(fn, (lhs, rhs), (None, None), rules=dict(experts=("data", "model")))
  dout = _normal(rng, 256, 128)
  want = kernels.tgmm(lhs.T, dout, GROUP_SIZES, **PALLAS)
  mesh = _mesh(explicit=False)
  with kernels.sharding(mesh, experts="model", contract="data"):
    got = jax.jit(lambda a, b: kernels.tgmm(a, b, GROUP_SIZES, **PALLAS))(lhs.T, dout)
  _close(got, want, 1e-5)
  with jax.set_mesh(_mesh(True)):  # Explicit: the group sizes split over the experts' axis
    got = jax.jit(lambda a, b, g: kernels.tgmm(a, b, g, **PALLAS))(
        lhs.T, jax.device_put(dout, P(None, "data")), jax.device_put(GROUP_SIZES, P("model")))
    assert jax.typeof(got).sharding.spec == P("model", None, "data")
  _close(got, want, 1e-5)


# ---------------------------------------------------------------------------------
# moe
# ---------------------------------------------------------------------------------


def _moe_args(rng, tokens=64, d=128, f=128, experts=8):
  s = 0.3
  return (_normal(rng, tokens, d, scale=s), _normal(rng, d, experts, scale=s), _normal(rng, experts, d, f, scale=s),
          _normal(rng, experts, d, f, scale=s), _normal(rng, experts, f, d, scale=s))


def _moe(*a, **kw):
  y, aux = kernels.moe(*a, top_k=2, **PALLAS, **kw)
  return y, aux["load_balancing_loss"], aux["z_loss"], aux["expert_load"], aux["group_sizes"], aux["dropped_fraction"]


def test_moe_tokens_and_experts_split_explicit():
  args = _moe_args(_rng(10))
  _check(_moe, args, (("data",), None, ("model",), ("model",), ("model",)))  # experts over a tokens-free axis
  _check(_moe, args, ((("data", "model"),), None, ("model",), ("model",), ("model",)))  # over the tokens' axes too


def test_moe_tokens_and_ffn_split_auto_and_concatenated_gate_up():
  x, rw, wg, wu, wd = _moe_args(_rng(11))
  _check(_moe, (x, rw, wg, wu, wd), (None,) * 5, rules=dict(batch="data", mlp="model"))
  wgu = jnp.concatenate([wg, wu], axis=2)
  fn = lambda x, rw, wgu, wd: _moe(x, rw, wgu, None, wd)  # noqa: E731
  _check(fn, (x, rw, wgu, wd), (None,) * 4, rules=dict(batch="data", mlp="model", experts=None))


def test_moe_capacity_with_split_tokens_is_per_shard():
  x, rw, wg, wu, wd = _moe_args(_rng(12))
  with jax.set_mesh(_mesh(True)):
    y, aux = jax.jit(lambda x: kernels.moe(x, rw, wg, wu, wd, top_k=2, capacity_factor=1.0, **PALLAS))(
        jax.device_put(x, P("data")))
  halves = [kernels.moe(h, rw, wg, wu, wd, top_k=2, capacity_factor=1.0, **PALLAS) for h in (x[:32], x[32:])]
  _close(y, jnp.concatenate([h[0] for h in halves]), 1e-5)
  _close(aux["group_sizes"], halves[0][1]["group_sizes"] + halves[1][1]["group_sizes"], 0)


# ---------------------------------------------------------------------------------
# Splits that cannot be followed
# ---------------------------------------------------------------------------------


def test_unsupported_splits_are_kernel_errors_naming_the_argument():
  mesh = _mesh(True)
  rng = _rng(13)
  with jax.set_mesh(mesh):
    # ssd: 2 groups over 4 head shards
    x, dt, A, B, C, D, h0 = _ssd_args(rng, seq=128)
    t = (None, None, "model")
    with pytest.raises(KernelError, match=r"^B=.*2 groups do not divide over the 4 shards"):
      jax.jit(lambda *a: kernels.ssd(*a, **PALLAS))(*(jax.device_put(v, P(*t)) for v in (x, dt)), A, B, C)
    # ssd: groups split without the heads
    with pytest.raises(KernelError, match=r"^B=.*groups split only along with the heads"):
      jax.jit(lambda *a: kernels.ssd(*a, **PALLAS))(x, dt, A, *(jax.device_put(v, P(None, None, "data"))
                                                                 for v in (B, C)))
    # gmm: the token rows never split
    lhs, rhs = _normal(rng, 256, 128), _normal(rng, 8, 128, 128)
    with pytest.raises(KernelError, match=r"^lhs=.*gmm cannot split its dimension 0"):
      jax.jit(lambda l, r: kernels.gmm(l, r, GROUP_SIZES, **PALLAS))(jax.device_put(lhs, P("data")), rhs)
    # moe: expert parallelism is dropless
    x, rw, wg, wu, wd = _moe_args(rng)
    with pytest.raises(KernelError, match=r"^capacity_factor=.*dropless"):
      jax.jit(lambda *w: kernels.moe(x, rw, *w, top_k=2, capacity_factor=1.0, **PALLAS))(
          *(jax.device_put(w, P("model")) for w in (wg, wu, wd)))
    # moe: the router is never split
    with pytest.raises(KernelError, match=r"^router_w=.*moe cannot split"):
      jax.jit(lambda rw: kernels.moe(x, rw, wg, wu, wd, top_k=2, **PALLAS))(jax.device_put(rw, P(None, "model")))
    # linear_scan: plane pairs over a split sequence
    a, b, _, _ = _scan_args(rng)
    sp = lambda v: jax.device_put(v, P(None, "model"))  # noqa: E731
    with pytest.raises(KernelError, match=r"^a=.*complex64 arrays, not \(real, imaginary\) plane pairs"):
      jax.jit(lambda *v: kernels.linear_scan((v[0], v[1]), (v[2], v[3]), **PALLAS))(sp(a), sp(a * 0), sp(b), sp(b))
  # Auto mode on a multi-device mesh without rules
  placed = jax.device_put(a, NamedSharding(_mesh(False), P("data")))
  with pytest.raises(KernelError, match=r"kernels.sharding"):
    jax.jit(lambda a: kernels.linear_scan(a, a, **PALLAS))(placed)


# ---------------------------------------------------------------------------------
# Ahead-of-time TPU compiles: the collectives in the HLO, the per-chip bytes
# ---------------------------------------------------------------------------------


def _aot(topology="v5e:2x4", generation="v5e"):
  from kernels.perf import tpu
  mesh = tpu.tpu_mesh(topology, ("data", "model"), (2, 4), explicit=True)

  def sds(shape, spec, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P(*spec)))

  def compile_(fn, *args):
    with jax.set_mesh(mesh):
      c = kernels.compile_for_tpu(fn, *args, generation=generation, profile=False)
    counts = {k.rstrip("("): c.hlo.count(k) for k in COLLECTIVES if c.hlo.count(k)}
    return c, counts

  def local_bytes(*args):
    return sum(int(np.prod(a.sharding.shard_shape(a.shape))) * jnp.dtype(a.dtype).itemsize for a in args)
  return mesh, sds, compile_, local_bytes


def _assert_arguments(c, expected: int):
  # small operands (group sizes) are padded to the TPU's 512-byte alignment
  assert expected <= c.memory["argument"] <= expected + 1024, (c.memory, expected)


@pytest.mark.tpu_aot
def test_aot_scans_on_v5e_2x4():
  _, sds, compile_, local_bytes = _aot()
  # linear_scan: batch and width local: no collective; the sequence split: two all-gathers.
  a = sds((8, 1024, 512), ("data", None, "model"))
  c, counts = compile_(lambda a, b: kernels.linear_scan(a, b), a, a)
  assert counts == {} and "tpu_custom_call" in c.hlo
  _assert_arguments(c, local_bytes(a, a))
  a = sds((8, 1024, 512), ("data", "model", None))
  c, counts = compile_(lambda a, b: kernels.linear_scan(a, b), a, a)
  assert counts == {"all-gather": 2}  # the shards' final states and gate products
  _assert_arguments(c, local_bytes(a, a))
  # ssd, the sequence split: the same two all-gathers; heads split: none.
  x, dt = sds((2, 1024, 8, 64), ("data", "model")), sds((2, 1024, 8), ("data", "model"), jnp.float32)
  A, bc = sds((8,), (None,), jnp.float32), sds((2, 1024, 1, 128), ("data", "model"))
  c, counts = compile_(lambda *v: kernels.ssd(*v, chunk_size=256), x, dt, A, bc, bc)
  # the final states' all-gather; XLA writes the tiny decays' one (f32[4, 1, 8]) as an all-reduce of
  # a dynamic-update-slice
  assert counts == {"all-gather": 1, "all-reduce": 1}, counts
  _assert_arguments(c, local_bytes(x, dt, A, bc, bc))
  x, dt = sds((2, 1024, 8, 64), ("data", None, "model")), sds((2, 1024, 8), ("data", None, "model"), jnp.float32)
  bc = sds((2, 1024, 4, 128), ("data", None, "model"))
  c, counts = compile_(lambda *v: kernels.ssd(*v), x, dt, A, bc, bc)
  assert counts == {}


@pytest.mark.tpu_aot
def test_aot_scan_gradient_on_v5p_2x2x2():
  _, sds, compile_, local_bytes = _aot("v5p:2x2x2", "v5p")
  a = sds((8, 1024, 512), ("data", "model", None))
  loss = lambda a, b: jnp.sum(kernels.linear_scan(a, b).astype(jnp.float32))  # noqa: E731
  c, counts = compile_(jax.grad(loss, (0, 1)), a, a)
  # forward: the two all-gathers; backward: their transposes, which XLA combines into one all-reduce
  # of the pair ([4, batch_local, width] f32 each), sliced on each device
  assert counts == {"all-gather": 2, "all-reduce": 1}, counts
  _assert_arguments(c, local_bytes(a, a))


@pytest.mark.tpu_aot
def test_aot_experts_on_v5e_2x4():
  _, sds, compile_, local_bytes = _aot()
  lhs, gs = sds((1024, 512), (None, None)), sds((8,), (None,), jnp.int32)
  # gmm: experts split: one all-reduce of the disjoint rows; features split: none; contraction: one.
  rhs = sds((8, 512, 512), ("model", None, None))
  c, counts = compile_(lambda l, r, g: kernels.gmm(l, r, g), lhs, rhs, gs)
  assert counts == {"all-reduce": 1}
  _assert_arguments(c, local_bytes(lhs, rhs, gs))
  rhs = sds((8, 512, 512), (None, None, "model"))
  c, counts = compile_(lambda l, r, g: kernels.gmm(l, r, g), lhs, rhs, gs)
  assert counts == {}
  _assert_arguments(c, local_bytes(lhs, rhs, gs))
  lhs_k, rhs = sds((1024, 512), (None, "data")), sds((8, 512, 512), ("model", "data", None))
  c, counts = compile_(lambda l, r, g: kernels.gmm(l, r, g), lhs_k, rhs, gs)
  assert counts == {"all-reduce": 1}  # one psum over both axes
  # tgmm: experts split over group_sizes: each device its groups; the one collective gathers the 8
  # group sizes (the first row of a device's groups needs the sizes before them).
  c, counts = compile_(lambda a, b, g: kernels.tgmm(a, b, g), sds((512, 1024), (None, None)),
                       sds((1024, 512), (None, "data")), sds((8,), ("model",), jnp.int32))
  assert counts == {"all-reduce": 1}, counts
  assert all("s32[8]" in line for line in c.hlo.splitlines() if "all-reduce(" in line)
  # moe: tokens over data and ffn over model: one all-reduce of the partial outputs (plus the aux
  # losses' small all-reduces over the token axis).
  x = sds((1024, 512), ("data", None))
  rw = sds((512, 8), (None, None))
  w, wd = sds((8, 512, 256), (None, None, "model")), sds((8, 256, 512), (None, "model", None))
  c, counts = compile_(lambda *a: kernels.moe(*a, top_k=2), x, rw, w, w, wd)
  assert set(counts) == {"all-reduce"}, counts
  _assert_arguments(c, local_bytes(x, rw, w, w, wd))
  # moe: experts over model (tokens sliced there): the ragged all-to-alls out and back, one all-gather of y.
  w, wd = sds((8, 512, 256), ("model", None, None)), sds((8, 256, 512), ("model", None, None))
  c, counts = compile_(lambda *a: kernels.moe(*a, top_k=2), x, rw, w, w, wd)
  assert counts.get("ragged-all-to-all") == 2 and counts.get("all-gather", 0) >= 1, counts
  _assert_arguments(c, local_bytes(x, rw, w, w, wd))
