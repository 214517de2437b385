"""kernels.distributed on 8 simulated CPU devices (tests/conftest.py sets
``--xla_force_host_platform_device_count=8``), every kernel in TPU interpret mode, against the
single-device kernels' references; and AOT compiles for the v5e 2x4 and v5p 2x2x2 topologies.

Tolerances: float32 results within 5e-5 of the single-device reference (the ring reorders the
softmax's sums: a few float32 ulps); bfloat16 within 3e-2 (bf16 rounding of each block's output)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import kernels
from kernels import distributed as D
from kernels.base.errors import KernelError

F32_TOL, BF16_TOL = 5e-5, 3e-2
SEQ = P(None, "x")


def _mesh(n, names=("x",), shape=None):
  devices = jax.devices()
  if len(devices) < n:
    pytest.skip(f"needs {n} devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  return Mesh(np.array(devices[:n]).reshape(shape or (n,)), names)


def _smap(f, mesh, in_specs, out_specs):
  return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False))


def _close(got, want, tol):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


def _normal(i, shape, dtype=jnp.float32):
  return jax.random.normal(jax.random.fold_in(jax.random.PRNGKey(0), i), shape, jnp.float32).astype(dtype)


# --- ring attention -----------------------------------------------------------------------------

RING_CASES = [  # devices, causal, sequence order, kv heads, segments, layout, dtype
    (4, True, "natural", 2, False, "BSHD", jnp.float32),   # GQA: 2 kv heads travel, 4 q heads stay
    (8, True, "natural", 1, False, "BSHD", jnp.float32),   # MQA, 8 devices
    (2, False, "natural", 4, True, "BSHD", jnp.float32),   # not causal, packed documents
    (4, True, "zigzag", 2, True, "BHSD", jnp.float32),     # the caller holds the zig-zag order
    (4, True, "natural", 2, False, "BSHD", jnp.bfloat16),
]


@pytest.mark.parametrize("n,causal,order,kvh,segments,layout,dtype", RING_CASES)
def test_ring_attention_equals_single_device_forward_and_backward(n, causal, order, kvh, segments, layout, dtype):
  mesh = _mesh(n)
  b, s, h, d = 1, n * 64, 4, 64
  q, k, v, do = (_normal(j, (b, s, hh, d), dtype) for j, hh in enumerate((h, kvh, kvh, h)))
  # a document boundary inside a device's block, and a document of one device's first chunk
  segs = jnp.asarray(np.repeat([0, 1, 2], [s // 3, s // 2, s - s // 3 - s // 2])[None]) if segments else None
  if layout == "BHSD":
    q, k, v, do = (jnp.swapaxes(x, 1, 2) for x in (q, k, v, do))
  seq = P(None, None, "x") if layout == "BHSD" else SEQ
  ring = _smap(lambda q, k, v, sg: D.ring_attention(q, k, v, axis_name="x", causal=causal, segment_ids=sg,
                                                    layout=layout, sequence_order=order, interpret=True),
               mesh, (seq, seq, seq, SEQ if segments else None), seq)
  axis = 2 if layout == "BHSD" else 1
  if order == "zigzag":  # the caller's arrays are in zig-zag order; compare in natural order
    idx = D.zigzag_indices(s, n)
    inv = np.argsort(idx)
    run = lambda q, k, v: jnp.take(ring(*(jnp.take(x, idx, axis) for x in (q, k, v)),  # noqa: E731
                                        None if segs is None else segs[:, idx]), inv, axis)
  else:
    run = lambda q, k, v: ring(q, k, v, segs)  # noqa: E731
  ref = functools.partial(kernels.attention_reference, causal=causal, segment_ids=segs, layout=layout)
  out, vjp = jax.vjp(run, q, k, v)
  out_ref, vjp_ref = jax.vjp(ref, q, k, v)
  tol = F32_TOL if dtype == jnp.float32 else BF16_TOL
  _close(out, out_ref, tol)
  for g, g_ref in zip(vjp(do), vjp_ref(do)):
    _close(g, g_ref, tol if dtype == jnp.float32 else 6e-2)  # bf16: the ring sums n bf16-rounded partials


def test_zigzag_order_balances_causal_work():
  """Device i holds chunks i and 2n-1-i: each device's visible (query, key) chunk pairs are equal."""
  for n in (2, 4, 8):
    idx = D.zigzag_indices(2 * n * 3, n).reshape(n, 2, 3)[:, :, 0] // 3  # chunk ids per device
    work = [sum(int(kc <= qc) for qc in idx[i] for j in range(n) for kc in idx[j]) for i in range(n)]
    contiguous = [sum(int(kc <= qc) for qc in (2 * i, 2 * i + 1) for kc in range(2 * n)) for i in range(n)]
    assert max(work) == min(work) == 2 * n + 1  # the busiest device = the mean
    assert max(contiguous) / np.mean(contiguous) >= (1.5 if n >= 4 else 1.4)  # what the zig-zag order avoids


def test_ring_attention_rejects_bad_input():
  mesh = _mesh(2)
  q = jnp.zeros((1, 2 * 63, 2, 64))
  with pytest.raises(KernelError, match="must be even"):
    _smap(lambda q: D.ring_attention(q, q, q, axis_name="x", causal=True, interpret=True), mesh, (SEQ,), SEQ)(q)
  with pytest.raises(KernelError, match="sequence_order"):
    _smap(lambda q: D.ring_attention(q, q, q, axis_name="x", sequence_order="striped"), mesh, (SEQ,), SEQ)(q)
  with pytest.raises(KernelError, match="sliding_window"):
    _smap(lambda q: D.ring_attention(q, q, q, axis_name="x", sliding_window=8), mesh, (SEQ,), SEQ)(q)
  with pytest.raises(KernelError, match="axis_name"):
    D.ring_attention(q, q, q, axis_name="x")  # outside shard_map


# --- collective matmuls ---------------------------------------------------------------------------


@pytest.mark.parametrize("n,bidirectional,dtype", [(4, True, jnp.float32), (8, False, jnp.float32),
                                                   (8, True, jnp.bfloat16), (2, True, jnp.float32)])
def test_collective_matmuls_equal_the_collective_then_matmul(n, bidirectional, dtype):
  mesh = _mesh(n)
  tol = F32_TOL * 4 if dtype == jnp.float32 else BF16_TOL
  # x sharded on rows (data), w on columns (model): the layer at the start of a tensor-parallel MLP
  x, w = _normal(1, (n * 16, 256), dtype), _normal(2, (256, n * 32), dtype)
  ag = _smap(lambda x, w: D.all_gather_matmul(x, w, axis_name="x", bidirectional=bidirectional, interpret=True),
             mesh, (P("x"), P(None, "x")), P(None, "x"))
  want = jnp.dot(x, w, preferred_element_type=jnp.float32)
  _close(ag(x, w), want, tol)
  # its VJP (autodiff through the ring of ppermutes) is that of all_gather then matmul
  ct = _normal(5, want.shape, dtype)
  grads = jax.vjp(ag, x, w)[1](ct)
  grads_ref = jax.vjp(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(dtype), x, w)[1](ct)
  for g, g_ref in zip(grads, grads_ref):  # bf16: relative to the largest entry (sums of bf16-rounded partials)
    _close(g, g_ref, 4 * tol if dtype == jnp.float32 else 0.01 * float(jnp.max(jnp.abs(g_ref))))

  xr, wr = _normal(3, (n * 16, n * 64), dtype), _normal(4, (n * 64, 128), dtype)
  rs = _smap(lambda x, w: D.matmul_reduce_scatter(x, w, axis_name="x", bidirectional=bidirectional,
                                                  interpret=True), mesh, (P(None, "x"), P("x")), P("x"))
  _close(rs(xr, wr), jnp.dot(xr, wr, preferred_element_type=jnp.float32), tol)


def test_collective_matmul_errors():
  mesh = _mesh(4)
  x = jnp.zeros((4 * 6, 64))
  with pytest.raises(KernelError, match="multiple of the 4 devices"):
    _smap(lambda x: D.matmul_reduce_scatter(x, jnp.zeros((64, 8)), axis_name="x"), mesh, (P(),), P("x"))(x[:10])
  with pytest.raises(KernelError, match="w"):
    _smap(lambda x: D.all_gather_matmul(x, jnp.zeros((32, 8)), axis_name="x"), mesh, (P("x"),), P())(x)


# --- sequence-parallel scan -------------------------------------------------------------------------


@pytest.mark.parametrize("n,reverse,gate", [(4, False, "element"), (2, True, "token"), (4, True, "time")])
def test_sequence_parallel_linear_scan_equals_single_device(n, reverse, gate):
  mesh = _mesh(n)
  b, s, w = 2, n * 24, 128
  shape = {"element": (b, s, w), "token": (b, s, 1), "time": (w,)}[gate]
  a = jax.random.uniform(jax.random.PRNGKey(1), shape, jnp.float32, 0.6, 1.0)
  x = _normal(2, (b, s, w))
  reset = jax.random.bernoulli(jax.random.PRNGKey(3), 0.04, (b, s)).at[:, s // n].set(True)  # one on a boundary
  h0 = _normal(4, (b, w))
  a_spec = P() if gate == "time" else SEQ

  def f(a, x, reset, h0):
    return D.sequence_parallel_linear_scan(a, x, axis_name="x", h0=h0, reset=reset, reverse=reverse,
                                           return_final_state=True, interpret=True)
  run = _smap(f, mesh, (a_spec, SEQ, SEQ, P()), (SEQ, P()))
  ref = lambda a, x, h0: kernels.linear_scan_reference(a, x, h0=h0, reset=reset, reverse=reverse,  # noqa: E731
                                                       return_final_state=True)
  (h, last), (h_ref, last_ref) = run(a, x, reset, h0), ref(a, x, h0)
  _close(h, h_ref, F32_TOL)
  _close(last, last_ref, F32_TOL)
  loss = lambda fn: lambda a, x, h0: jnp.sum(jnp.sin(fn(a, x, h0)[0])) + jnp.sum(fn(a, x, h0)[1])  # noqa: E731
  grads = jax.grad(loss(lambda a, x, h0: run(a, x, reset, h0)), (0, 1, 2))(a, x, h0)
  for g, g_ref in zip(grads, jax.grad(loss(ref), (0, 1, 2))(a, x, h0)):
    _close(g, g_ref, 2e-4)  # the gate's gradient sums over the sequence


# --- expert-parallel MoE ---------------------------------------------------------------------------


@pytest.mark.parametrize("n,experts,top_k,skewed", [(4, 8, 3, False), (2, 4, 1, True), (8, 16, 2, True)])
def test_expert_parallel_moe_equals_single_device(n, experts, top_k, skewed):
  mesh = _mesh(n)
  tokens, d, f = n * 8, 128, 128
  x, router_w = _normal(0, (tokens, d)), _normal(1, (d, experts))
  bias = None
  if skewed:  # selection biased: most tokens to expert 0 (one device's), the last quarter of the experts empty
    bias = jnp.zeros((experts,)).at[0].set(1.0).at[experts - experts // 4:].set(-9.0)
  w_gate, w_up, w_down = (_normal(j, shape) * 0.1 for j, shape in
                          ((2, (experts, d, f)), (3, (experts, d, f)), (4, (experts, f, d))))
  ep = _smap(lambda *a: D.expert_parallel_moe(*a, axis_name="x", top_k=top_k, expert_bias=bias, interpret=True),
             mesh, (P("x"), P(), P("x"), P("x"), P("x")), (P("x"), P()))
  single = lambda *a: kernels.moe(*a, top_k=top_k, expert_bias=bias, implementation="xla")  # noqa: E731
  args = (x, router_w, w_gate, w_up, w_down)
  (y, aux), (y_ref, aux_ref) = ep(*args), single(*args)
  if skewed:
    assert int(aux_ref["group_sizes"][-1]) == 0 and int(aux_ref["group_sizes"][0]) > tokens // 2
  _close(y, y_ref, F32_TOL)
  for key in aux_ref:
    _close(aux[key], aux_ref[key], 1e-5 if key != "z_loss" else 1e-4)

  def loss(fn):
    def f(*a):
      y, aux = fn(*a)
      return jnp.sum(jnp.sin(y)) + aux["load_balancing_loss"] + 0.1 * aux["z_loss"]
    return f
  for g, g_ref in zip(jax.grad(loss(ep), range(5))(*args), jax.grad(loss(single), range(5))(*args)):
    _close(g, g_ref, 1e-4)


def test_expert_parallel_moe_errors():
  mesh = _mesh(4)
  x, rw, w = jnp.zeros((16, 128)), jnp.zeros((128, 6)), jnp.zeros((6, 128, 128))
  with pytest.raises(KernelError, match="divide evenly"):
    _smap(lambda x: D.expert_parallel_moe(x, rw, w, w, w, axis_name="x", top_k=2), mesh, (P("x"),), (P("x"), P()))(x)
  rw = jnp.zeros((128, 8))
  with pytest.raises(KernelError, match="w_gate"):  # the full expert set, not this device's
    _smap(lambda x: D.expert_parallel_moe(x, rw, jnp.zeros((8, 128, 128)), None, jnp.zeros((8, 128, 128)),
                                          axis_name="x", top_k=2), mesh, (P("x"),), (P("x"), P()))(x)


# --- the Pallas ring all-gather ---------------------------------------------------------------------


@pytest.mark.parametrize("n,bidirectional,dtype", [(8, True, jnp.float32), (4, False, jnp.bfloat16),
                                                   (2, True, jnp.float32)])
def test_ring_all_gather_equals_all_gather(n, bidirectional, dtype):
  mesh = _mesh(n)
  x = _normal(0, (n * 16, 128), dtype)
  params = pltpu.InterpretParams(detect_races=True)
  got = _smap(lambda x: D.ring_all_gather(x, axis_name="x", bidirectional=bidirectional, interpret=params),
              mesh, (P("x"),), P())(x)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(x))  # a copy: bit for bit
  from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
  assert ipc.races is not None and not ipc.races.races_found


# --- a 2-D mesh: data x model -----------------------------------------------------------------------


def test_two_dimensional_mesh_data_by_model():
  """On a 2 x 4 ``data`` x ``model`` mesh: ring attention and the sequence-parallel scan over 'model' with the
  batch sharded over 'data', and the all-gather matmul over 'model', forward and backward."""
  mesh = _mesh(8, ("data", "model"), (2, 4))
  q, k, v, do = (_normal(j, (2, 4 * 32, 2, 64)) for j in range(4))
  spec = P("data", "model")
  ring = _smap(lambda q, k, v: D.ring_attention(q, k, v, axis_name="model", causal=True, interpret=True), mesh,
               (spec,) * 3, spec)
  ref = functools.partial(kernels.attention_reference, causal=True)
  (out, vjp), (out_ref, vjp_ref) = jax.vjp(ring, q, k, v), jax.vjp(ref, q, k, v)
  _close(out, out_ref, F32_TOL)
  for g, g_ref in zip(vjp(do), vjp_ref(do)):
    _close(g, g_ref, F32_TOL)

  a = jax.random.uniform(jax.random.PRNGKey(1), (2, 4 * 16, 128), jnp.float32, 0.6, 1.0)
  x = _normal(5, (2, 4 * 16, 128))
  scan = _smap(lambda a, x: D.sequence_parallel_linear_scan(a, x, axis_name="model", interpret=True), mesh,
               (spec, spec), spec)
  ct = _normal(6, x.shape)
  _close(scan(a, x), kernels.linear_scan_reference(a, x), F32_TOL)
  for g, g_ref in zip(jax.vjp(scan, a, x)[1](ct), jax.vjp(kernels.linear_scan_reference, a, x)[1](ct)):
    _close(g, g_ref, 2e-4)

  xm, wm = _normal(7, (4 * 16, 128)), _normal(8, (128, 4 * 32))
  ag = _smap(lambda x, w: D.all_gather_matmul(x, w, axis_name="model", interpret=True), mesh,
             (P("model"), P(None, "model")), P(None, "model"))
  ct = _normal(9, (4 * 16, 4 * 32))
  _close(ag(xm, wm), xm @ wm, 4 * F32_TOL)
  for g, g_ref in zip(jax.vjp(ag, xm, wm)[1](ct), jax.vjp(jnp.dot, xm, wm)[1](ct)):
    _close(g, g_ref, 4 * F32_TOL)


# --- AOT: multi-chip topologies ------------------------------------------------------------------------

TOPOLOGIES = [("v5e", "v5e:2x4"), ("v5p", "v5p:2x2x2")]


@pytest.mark.tpu_aot
@pytest.mark.parametrize("generation,topology", TOPOLOGIES)
def test_aot_compiles_on_multichip_topologies(generation, topology):
  """Every distributed program, forward and backward, compiles for an 8-chip slice; ring attention's
  per-chip memory is the local blocks' (O(seq / devices))."""
  from kernels.perf import tpu
  mesh = tpu.tpu_mesh(topology, ("x",))
  n = mesh.size
  sds = lambda shape, spec, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype,  # noqa: E731
                                                                    sharding=NamedSharding(mesh, spec))
  smap = lambda f, i, o: jax.shard_map(f, mesh=mesh, in_specs=i, out_specs=o, check_vma=False)  # noqa: E731
  s_local = 2048
  q, kv = sds((1, n * s_local, 8, 128), SEQ), sds((1, n * s_local, 2, 128), SEQ)
  ring = smap(lambda q, k, v: D.ring_attention(q, k, v, axis_name="x", causal=True), (SEQ,) * 3, SEQ)
  grad = jax.grad(lambda q, k, v: jnp.sum(ring(q, k, v).astype(jnp.float32)), (0, 1, 2))
  c = tpu.compile_for_tpu(grad, q, kv, kv, generation=generation)
  local_inputs = (8 + 2 + 2) * s_local * 128 * 2
  assert c.memory["temp"] < 12 * local_inputs, c.memory  # O(S / n): a few copies of the local blocks

  windowed = smap(lambda q, k, v: D.ring_attention(q, k, v, axis_name="x", causal=True, sliding_window=4096),
                  (SEQ,) * 3, SEQ)
  tpu.compile_for_tpu(jax.grad(lambda q, k, v: jnp.sum(windowed(q, k, v).astype(jnp.float32)), (0, 1, 2)), q, kv, kv,
                      generation=generation)

  x, w = sds((n * 256, 1024), P("x")), sds((1024, 512), P())
  tpu.compile_for_tpu(smap(lambda x, w: D.all_gather_matmul(x, w, axis_name="x"), (P("x"), P()), P("x")), x, w,
                      generation=generation)
  xr, wr = sds((n * 256, n * 128), P(None, "x")), sds((n * 128, 512), P("x"))
  tpu.compile_for_tpu(smap(lambda x, w: D.matmul_reduce_scatter(x, w, axis_name="x"), (P(None, "x"), P("x")),
                           P("x")), xr, wr, generation=generation)

  e, d, f, t = 2 * n, 512, 256, n * 128
  moe_args = (sds((t, d), P("x")), sds((d, e), P()), sds((e, d, f), P("x")), sds((e, d, f), P("x")),
              sds((e, f, d), P("x")))
  ep = smap(lambda *a: D.expert_parallel_moe(*a, axis_name="x", top_k=2)[0], (P("x"), P(), P("x"), P("x"), P("x")),
            P("x"))
  c = tpu.compile_for_tpu(jax.grad(lambda *a: jnp.sum(ep(*a).astype(jnp.float32)), range(5)), *moe_args,
                          generation=generation)
  assert "ragged-all-to-all" in c.hlo  # on TPU the exchange is the ragged collective

  a, b = sds((2, n * 1024, 512), SEQ), sds((2, n * 1024, 512), SEQ)
  scan = smap(lambda a, b: D.sequence_parallel_linear_scan(a, b, axis_name="x"), (SEQ, SEQ), SEQ)
  tpu.compile_for_tpu(jax.grad(lambda a, b: jnp.sum(scan(a, b).astype(jnp.float32)), (0, 1)), a, b,
                      generation=generation)
  xs, bc = sds((1, n * 1024, 8, 64), SEQ), sds((1, n * 1024, 1, 128), SEQ)
  dt, a_log = sds((1, n * 1024, 8), SEQ, jnp.float32), sds((8,), P(), jnp.float32)
  ssd = smap(lambda x, dt, A, B, C: D.sequence_parallel_ssd(x, dt, A, B, C, axis_name="x"), (SEQ, SEQ, P(), SEQ, SEQ),
             SEQ)
  tpu.compile_for_tpu(jax.grad(lambda *a: jnp.sum(ssd(*a).astype(jnp.float32)), (0, 3, 4)), xs, dt, a_log, bc, bc,
                      generation=generation)
  tpu.compile_for_tpu(smap(lambda x: D.ring_all_gather(x, axis_name="x"), (P("x"),), P()),
                      sds((n * 16, 1024), P("x")), generation=generation)


def test_sequence_parallel_ssd_equals_single_device():
  n = 4
  mesh = _mesh(n)
  b, s, h, p, g, st = 1, n * 128, 2, 64, 1, 128
  x = _normal(0, (b, s, h, p))
  dt = jax.nn.softplus(_normal(1, (b, s, h)))
  A = -jnp.exp(_normal(2, (h,)))
  B, C = _normal(3, (b, s, g, st)) * 0.3, _normal(4, (b, s, g, st)) * 0.3
  reset = jnp.zeros((b, s), bool).at[:, 200].set(True)  # a document starts inside the second shard
  run = _smap(lambda x, dt, B, C, reset: D.sequence_parallel_ssd(x, dt, A, B, C, axis_name="x", reset=reset,
                                                                 chunk_size=128, return_final_state=True,
                                                                 interpret=True),
              mesh, (SEQ, SEQ, SEQ, SEQ, SEQ), (SEQ, P()))
  ref = lambda x, dt, B, C, reset: kernels.ssd_reference(x, dt, A, B, C, reset=reset,  # noqa: E731
                                                         return_final_state=True)
  args = (x, dt, B, C, reset)
  (y, last), (y_ref, last_ref) = run(*args), ref(*args)
  _close(y, y_ref, 2e-4)
  _close(last, last_ref, 2e-4)
  ct = _normal(5, y.shape)
  grads = jax.vjp(lambda x, dt, B, C: run(x, dt, B, C, reset)[0], *args[:4])[1](ct)
  grads_ref = jax.vjp(lambda x, dt, B, C: ref(x, dt, B, C, reset)[0], *args[:4])[1](ct)
  for gg, gr in zip(grads, grads_ref):
    _close(gg, gr, 2e-4 * max(1.0, float(jnp.max(jnp.abs(gr)))))


@pytest.mark.parametrize("n,window,segments", [(4, 24, False), (4, 100, True)])
def test_ring_attention_sliding_window_is_a_halo(n, window, segments):
  """A window shorter than a block (one neighbour's last rows) and one spanning two devices."""
  mesh = _mesh(n)
  b, s, h, d = 1, n * 64, 4, 64
  q, k, v, do = (_normal(j, (b, s, hh, d)) for j, hh in enumerate((h, 2, 2, h)))
  segs = jnp.asarray(np.repeat([0, 1], [s // 2 + 7, s - s // 2 - 7])[None]) if segments else None
  ring = _smap(lambda q, k, v, sg: D.ring_attention(q, k, v, axis_name="x", causal=True, sliding_window=window,
                                                    segment_ids=sg, interpret=True),
               mesh, (SEQ, SEQ, SEQ, SEQ if segments else None), SEQ)
  run = lambda q, k, v: ring(q, k, v, segs)  # noqa: E731
  ref = functools.partial(kernels.attention_reference, causal=True, sliding_window=window, segment_ids=segs)
  (out, vjp), (out_ref, vjp_ref) = jax.vjp(run, q, k, v), jax.vjp(ref, q, k, v)
  _close(out, out_ref, F32_TOL)
  for g, g_ref in zip(vjp(do), vjp_ref(do)):
    _close(g, g_ref, F32_TOL)
