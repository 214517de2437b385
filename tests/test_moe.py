"""kernels.experts.layer: routing against a NumPy reference, the layer against its dense reference.

The layer runs ``gmm`` in interpret mode on the CPU (small shapes). ``moe_reference`` runs
every expert on every token in f32 at the highest precision and masks.

Tolerances (|out - expected| <= atol + rtol * |expected|):

* routing: expert ids, order, positions, group sizes and drops exactly; weights and losses
  to 1e-6 relative (f32 softmax in a different order than NumPy's float64).
* layer, f32: 1e-5 relative to the largest output (the grouped matmul accumulates in f32
  in another order; observed ~1e-7).
* layer, bf16: the gate/up product and the activation product are rounded to bf16 before
  the down projection (the reference keeps f32): 3e-2 of the largest output.
* gradients, f32: 1e-4 of each gradient's largest entry.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels
from tests import run_program
from kernels.experts.layer import Routing, expert_capacity, moe_reference
from kernels.experts.layer import moe as moe_eager
from kernels.experts.layer import route as route_eager

# Jitted: one compile per shape instead of one per op (hypothesis draws many shapes).
_STATIC = ("top_k", "scoring", "normalize_weights", "capacity_factor", "activation", "implementation", "interpret")
route = jax.jit(route_eager, static_argnames=_STATIC[:4])
moe = jax.jit(moe_eager, static_argnames=_STATIC)


def rand(shape, seed=0, scale=1.0, dtype=jnp.float32):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * scale, dtype)


def layer(tokens=24, d=32, experts=4, f=16, seed=0, dtype=jnp.float32):
  return (rand((tokens, d), seed, dtype=dtype), rand((d, experts), seed + 1),
          rand((experts, d, f), seed + 2, d ** -0.5, dtype), rand((experts, d, f), seed + 3, d ** -0.5, dtype),
          rand((experts, f, d), seed + 4, f ** -0.5, dtype))


# ---------------------------------------------------------------------------------
# Routing vs NumPy
# ---------------------------------------------------------------------------------


def np_route(x, w, top_k, scoring="softmax", normalize=True, bias=None, capacity_factor=None):
  """float64 NumPy, one token and one assignment at a time."""
  x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
  logits = x @ w
  t, e = logits.shape
  if scoring == "softmax":
    z = np.exp(logits - logits.max(-1, keepdims=True))
    probs = z / z.sum(-1, keepdims=True)
  else:
    probs = 1 / (1 + np.exp(-logits))
  sel = probs + (0 if bias is None else np.asarray(bias, np.float64))
  ids = np.stack([np.argsort(-sel[i], kind="stable")[:top_k] for i in range(t)])  # ties: lower id first
  wts = np.take_along_axis(probs, ids, -1)
  if normalize:
    wts = wts / wts.sum(-1, keepdims=True)
  cap = None if capacity_factor is None else int(np.ceil(capacity_factor * t * top_k / e))
  taken = np.zeros(e, int)
  dropped = np.zeros((t, top_k), bool)
  for s in range(top_k):  # priority: every token's first choice, then second choices, ...
    for i in range(t):
      ex = ids[i, s]
      if cap is not None and taken[ex] >= cap:
        dropped[i, s] = True
      else:
        taken[ex] += 1
  wts = np.where(dropped, 0, wts)
  load = np.bincount(ids.reshape(-1), minlength=e)
  order = []
  for ex in range(e):  # kept rows of each expert in priority order, then the dropped ones
    order += [i * top_k + s for s in range(top_k) for i in range(t) if ids[i, s] == ex and not dropped[i, s]]
  order += [i * top_k + s for ex in range(e) for s in range(top_k) for i in range(t)
            if ids[i, s] == ex and dropped[i, s]]
  p = probs / probs.sum(-1, keepdims=True)
  lb = e * np.sum(load / (t * top_k) * p.mean(0))
  lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
  return dict(expert_ids=ids, weights=wts, dropped=dropped, order=np.array(order), group_sizes=taken,
              expert_load=load, load_balancing_loss=lb, z_loss=np.mean(lse ** 2))


def assert_routing(r: Routing, want: dict):
  for name in ("expert_ids", "dropped", "order", "group_sizes", "expert_load"):
    np.testing.assert_array_equal(np.asarray(getattr(r, name)), want[name], err_msg=name)
  np.testing.assert_allclose(np.asarray(r.weights), want["weights"], rtol=1e-5, atol=1e-6)
  for name in ("load_balancing_loss", "z_loss"):
    np.testing.assert_allclose(float(getattr(r, name)), want[name], rtol=1e-5, err_msg=name)
  n = r.order.shape[0]
  np.testing.assert_array_equal(np.asarray(r.order)[np.asarray(r.position).reshape(-1)], np.arange(n))


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("top_k, capacity_factor", [(1, None), (2, None), (3, 1.0), (2, 0.5)])
def test_route_matches_numpy(scoring, top_k, capacity_factor):
  x, w = rand((40, 16), 0), rand((16, 6), 1)
  r = route(x, w, top_k=top_k, scoring=scoring, capacity_factor=capacity_factor)
  assert_routing(r, np_route(x, w, top_k, scoring, capacity_factor=capacity_factor))
  if capacity_factor is not None:
    assert int(r.group_sizes.max()) <= expert_capacity(40, 6, top_k, capacity_factor)


def test_expert_bias_selects_but_does_not_weigh():
  x, w = rand((32, 8), 2), rand((8, 8), 3)
  bias = jnp.asarray([2.0, 0, 0, 0, 0, 0, 0, -2.0], jnp.float32)  # sigmoid scores lie in (0, 1)
  r = route(x, w, top_k=2, scoring="sigmoid", expert_bias=bias, normalize_weights=False)
  assert_routing(r, np_route(x, w, 2, "sigmoid", normalize=False, bias=bias))
  assert int(r.expert_load[0]) == 32 and int(r.expert_load[7]) == 0  # the bias moved the choices


def test_ties_break_toward_the_lower_expert_id():
  x = jnp.zeros((12, 8), jnp.float32)  # every logit 0: all experts tie
  r = route(x, rand((8, 5), 4), top_k=3, capacity_factor=1.0)
  want = np_route(x, rand((8, 5), 4), 3, capacity_factor=1.0)
  assert_routing(r, want)
  np.testing.assert_array_equal(np.asarray(r.expert_ids), np.tile([0, 1, 2], (12, 1)))
  # capacity ceil(1.0 * 12 * 3 / 5) = 8 per expert: tokens 8.. lose every choice, in token order
  assert np.asarray(r.dropped)[:8].sum() == 0 and np.asarray(r.dropped)[8:].all()
  # partial ties: two experts equal, the lower id wins
  xt = jnp.ones((4, 2), jnp.float32)
  wt = jnp.asarray([[1.0, 2.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0]], jnp.float32)
  np.testing.assert_array_equal(np.asarray(route(xt, wt, top_k=1).expert_ids), [[1]] * 4)


def test_capacity_drops_second_choices_before_first():
  # 8 tokens all prefer expert 0 then expert 1; capacity ceil(1.0 * 8 * 2 / 4) = 4
  x = jnp.ones((8, 1), jnp.float32)
  w = jnp.asarray([[3.0, 2.0, 1.0, 0.0]], jnp.float32)
  r = route(x, w, top_k=2, capacity_factor=1.0)
  assert_routing(r, np_route(x, w, 2, capacity_factor=1.0))
  d = np.asarray(r.dropped)
  assert not d[:4].any() and d[4:].all()  # expert 0 and 1 each keep tokens 0..3
  np.testing.assert_array_equal(np.asarray(r.group_sizes), [4, 4, 0, 0])
  assert float(jnp.abs(r.weights[4:]).max()) == 0


def test_load_balancing_loss_is_one_when_uniform_and_grows_with_skew():
  x = jnp.zeros((16, 4), jnp.float32)
  r = route(x, jnp.zeros((4, 4)), top_k=4)  # every expert chosen by every token, uniform probs
  np.testing.assert_allclose(float(r.load_balancing_loss), 1.0, rtol=1e-6)
  skew = route(jnp.ones((16, 1)), jnp.asarray([[5.0, 0, 0, 0]]), top_k=1)
  assert float(skew.load_balancing_loss) > 3.0


@settings(max_examples=5, deadline=None)
@given(tokens=st.integers(1, 33), experts=st.integers(1, 9), k=st.integers(1, 4),
       scoring=st.sampled_from(["softmax", "sigmoid"]), cf=st.sampled_from([None, 0.3, 1.0, 2.0]),
       seed=st.integers(0, 100), quantize=st.booleans())
def test_route_hypothesis(tokens, experts, k, scoring, cf, seed, quantize):
  k = min(k, experts)
  x, w = rand((tokens, 8), seed), rand((8, experts), seed + 1)
  if quantize:  # coarse values: many exact ties
    x, w = jnp.round(x), jnp.round(w)
  assert_routing(route(x, w, top_k=k, scoring=scoring, capacity_factor=cf), np_route(x, w, k, scoring,
                                                                                     capacity_factor=cf))


# ---------------------------------------------------------------------------------
# The layer vs the dense reference
# ---------------------------------------------------------------------------------


def assert_layer_close(y, want, dtype):
  y, want = np.asarray(y, np.float32), np.asarray(want, np.float32)
  scale = np.abs(want).max()
  tol = 1e-5 if dtype == jnp.float32 else 3e-2
  assert np.abs(y - want).max() <= tol * scale, (np.abs(y - want).max(), scale)


@pytest.mark.parametrize("dtype, top_k, capacity_factor, scoring, activation", [
    (jnp.float32, 2, None, "softmax", "silu"), (jnp.float32, 2, 0.6, "softmax", "silu"),
    (jnp.float32, 3, 1.0, "sigmoid", "gelu"), (jnp.bfloat16, 1, None, "softmax", "relu"),
    (jnp.bfloat16, 3, 0.6, "sigmoid", "silu")])
def test_layer_matches_dense_reference(dtype, top_k, capacity_factor, scoring, activation):
  args = layer(dtype=dtype)
  kw = dict(top_k=top_k, capacity_factor=capacity_factor, scoring=scoring, activation=activation)
  y, aux = moe(*args, interpret=True, **kw)
  want, want_aux = moe_reference(*args, **kw)
  assert y.dtype == dtype and y.shape == args[0].shape
  assert_layer_close(y, want, dtype)
  for name in ("expert_load", "group_sizes"):
    np.testing.assert_array_equal(np.asarray(aux[name]), np.asarray(want_aux[name]))
  if capacity_factor is not None and capacity_factor < 1:
    assert float(aux["dropped_fraction"]) > 0


def test_concatenated_weights_and_all_dropped_token():
  x, rw, wg, wu, wd = layer()
  y, _ = moe(x, rw, wg, wu, wd, top_k=2, capacity_factor=0.4, interpret=True)
  y2, _ = moe(x, rw, jnp.concatenate([wg, wu], 2), None, wd, top_k=2, capacity_factor=0.4, interpret=True)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(y2))
  r = route(x, rw, top_k=2, capacity_factor=0.4)
  gone = np.asarray(r.dropped).all(1)
  assert gone.any()  # some token lost both choices: its output is exactly zero
  assert np.abs(np.asarray(y)[gone]).max() == 0


def test_skewed_and_empty_experts():
  x, rw, wg, wu, wd = layer(tokens=20, experts=6)
  bias = jnp.asarray([3.0, 0, 0, 0, -3.0, 0], jnp.float32)  # every token picks expert 0, none expert 4
  r = route(x, rw, top_k=2, expert_bias=bias)
  assert int(r.group_sizes[4]) == 0 and int(r.group_sizes[0]) == 20
  y, _ = moe(x, rw, wg, wu, wd, top_k=2, expert_bias=bias, interpret=True)
  assert_layer_close(y, moe_reference(x, rw, wg, wu, wd, top_k=2, expert_bias=bias)[0], jnp.float32)


@settings(max_examples=2, deadline=None)
@given(tokens=st.integers(1, 20), experts=st.integers(1, 6), k=st.integers(1, 3), d=st.sampled_from([8, 24]),
       f=st.sampled_from([8, 16]), cf=st.sampled_from([None, 0.5, 1.25]), seed=st.integers(0, 50))
def test_layer_hypothesis(tokens, experts, k, d, f, cf, seed):
  args = layer(tokens, d, experts, f, seed)
  k = min(k, experts)
  y, _ = moe(*args, top_k=k, capacity_factor=cf, interpret=True)
  assert_layer_close(y, moe_reference(*args, top_k=k, capacity_factor=cf)[0], jnp.float32)


def _loss(fn, **kw):
  def loss(x, rw, wg, wu, wd):
    y, aux = fn(x, rw, wg, wu, wd, **kw)
    return jnp.sum(y * jnp.cos(y)) + aux["load_balancing_loss"] + 0.1 * aux["z_loss"]
  return loss


@pytest.mark.parametrize("dtype, top_k, capacity_factor, scoring", [
    (jnp.float32, 2, None, "softmax"), (jnp.float32, 2, 0.6, "sigmoid"), (jnp.bfloat16, 2, None, "softmax")])
def test_gradients_match_dense_reference(dtype, top_k, capacity_factor, scoring):
  args = layer(dtype=dtype)
  kw = dict(top_k=top_k, capacity_factor=capacity_factor, scoring=scoring)
  got = jax.grad(_loss(moe, interpret=True, **kw), argnums=range(5))(*args)
  want = jax.grad(_loss(moe_reference, **kw), argnums=range(5))(*args)
  tol = 1e-4 if dtype == jnp.float32 else 5e-2
  for name, a, g, w in zip(("x", "router_w", "w_gate", "w_up", "w_down"), args, got, want):
    assert g.dtype == a.dtype, name
    w = np.asarray(w, np.float32)
    assert np.abs(np.asarray(g, np.float32) - w).max() <= tol * np.abs(w).max(), name


def test_permutation_vjps_are_gathers():
  x, rw, *_ = layer()
  r = route(x, rw, top_k=3)
  from kernels.experts.layer import _combine, _dispatch
  g = rand((x.shape[0] * 3, x.shape[1]), 9)
  _, vjp = jax.vjp(lambda x: _dispatch(x, r.order, r.position, 3), x)
  _, want = jax.vjp(lambda x: x[r.order // 3], x)
  np.testing.assert_allclose(np.asarray(vjp(g)[0]), np.asarray(want(g)[0]), rtol=1e-6, atol=1e-6)
  # The combine, against automatic differentiation of the plain expression (a scatter-add).
  plain = lambda y, w: jnp.einsum("tkd,tk->td", y[r.position.reshape(-1)].reshape(*w.shape, -1), w)  # noqa: E731
  y_got, vjp = jax.vjp(lambda y, w: _combine(y, w, r.order, r.position), g, r.weights)
  y_want, want = jax.vjp(plain, g, r.weights)
  np.testing.assert_allclose(np.asarray(y_got), np.asarray(y_want), rtol=1e-5, atol=1e-6)
  dy = rand(y_got.shape, 10)
  for a, b in zip(vjp(dy), want(dy)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
  for f in (lambda x: jnp.sum(_dispatch(x, r.order, r.position, 3) ** 2),
            lambda y: jnp.sum(_combine(y, r.weights, r.order, r.position) ** 2)):
    arg = x if f.__code__.co_varnames[0] == "x" else g
    jaxpr = jax.make_jaxpr(jax.grad(f))(arg)
    assert "scatter" not in str(jaxpr)
    # Gathers of whole rows and no [tokens, top_k, d] value anywhere, forward or backward:
    # the sums over a token's choices add aligned [tokens, d] rows, with no middle-axis reduction.
    eqns = list(_eqns(jaxpr.jaxpr))
    assert any(e.primitive.name == "gather" for e in eqns)
    assert all(len(v.aval.shape) <= 2 for e in eqns for v in e.outvars), [
        (e.primitive.name, v.aval.shape) for e in eqns for v in e.outvars if len(v.aval.shape) > 2]


@pytest.mark.parametrize("rows, f", [(200, 128), (1100, 256), (40, 384)])
@pytest.mark.parametrize("activation", ["silu", "gelu", "relu"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_glu_backward_kernel_matches_autodiff(rows, f, activation, dtype):
  # Row counts that leave a partial last block (1100 rows: blocks of 1024), column blocks of 128,
  # 256 and 384; d gate and d up against XLA's autodiff of the same product.
  from kernels.experts.layer import _glu, _glu_xla
  h, d = rand((rows, 2 * f), 1, 2.0, dtype), rand((rows, f), 2, 1.0, dtype)
  y, vjp = jax.vjp(lambda h: _glu(h, activation, interpret=True), h)
  want_y, want_vjp = jax.vjp(lambda h: _glu_xla(h, activation), h)
  got, want = vjp(d)[0], want_vjp(d)[0]
  assert got.dtype == dtype and got.shape == h.shape
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want_y, np.float32))
  tol = 1e-5 if dtype == jnp.float32 else 2 ** -7  # bf16: one rounding of the f32 result apart
  scale = np.abs(np.asarray(want, np.float32)).max()
  assert np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32)).max() <= tol * scale


def test_glu_backward_runs_the_kernel_only_where_f_fits_its_blocks():
  from kernels.experts.layer import _glu

  def kernels_in(f):
    h, d = rand((16, 2 * f)), rand((16, f))
    jaxpr = jax.make_jaxpr(lambda h, d: jax.vjp(lambda h: _glu(h, "silu", interpret=True), h)[1](d))(h, d)
    return [e for e in _eqns(jaxpr.jaxpr) if e.primitive.name == "pallas_call"]
  assert len(kernels_in(128)) == 1
  assert not kernels_in(96)  # f not a multiple of 128: XLA's backward


def test_gradients_match_dense_reference_with_the_glu_kernel():
  # f = 128: the layer's activation backward runs the Pallas kernel (f = 16 elsewhere runs XLA's).
  args = layer(tokens=16, d=32, experts=4, f=128)
  got = jax.grad(_loss(moe, interpret=True, top_k=2), argnums=range(5))(*args)
  want = jax.grad(_loss(moe_reference, top_k=2), argnums=range(5))(*args)
  for name, g, w in zip(("x", "router_w", "w_gate", "w_up", "w_down"), got, want):
    w = np.asarray(w, np.float32)
    assert np.abs(np.asarray(g, np.float32) - w).max() <= 1e-4 * np.abs(w).max(), name


GATE_UP_CASES = [  # (group sizes, k, f, blocks): the fused kernel's paths
    ([100, 0, 200, 84], 256, 256, (128, 128, 256)),     # groups straddling tiles, an empty group; 2 n tiles
    ([384, 0, 0, 0], 384, 128, (128, 256, 256)),        # one group over every tile; a K tail (384 = 256 + 128)
    ([0, 37, 0, 200], 128, 384, (256, 128, 256)),       # rows past the sizes' sum (zeros); 3 n tiles
    ([50, 50, 50, 50], 256, 256, None),                 # the default blocks (one n tile)
]


@pytest.mark.parametrize("sizes, k, f, blocks", GATE_UP_CASES)
@pytest.mark.parametrize("activation", ["silu", "gelu", "relu"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_gate_up_kernel_matches_gmm_then_the_product(sizes, k, f, blocks, activation, dtype):
  # The gate-and-up gmm with the activation product in its epilogue (one kernel), against the
  # grouped-matmul reference then the product, forward and gradients (d lhs, d w).
  from kernels.experts.grouped import gmm_reference
  from kernels.experts.layer import _gate_up, _glu_xla
  m, gs = 384, jnp.asarray(sizes, jnp.int32)
  lhs, w = rand((m, k), 1, 1.0, dtype), rand((4, k, 2 * f), 2, k ** -0.5, dtype)
  d = rand((m, f), 3, 1.0, dtype)
  fused = lambda lhs, w: _gate_up(lhs, w, gs, activation, block_sizes=blocks, implementation="pallas",  # noqa: E731
                                  interpret=True)
  ref = lambda lhs, w: _glu_xla(gmm_reference(lhs, w, gs), activation)  # noqa: E731
  assert any(e.params.get("name") == "gmm_glu" for e in _eqns(jax.make_jaxpr(fused)(lhs, w).jaxpr)
             if e.primitive.name == "pallas_call")
  y, vjp = jax.vjp(fused, lhs, w)
  want_y, want_vjp = jax.vjp(ref, lhs, w)
  assert y.dtype == dtype and y.shape == (m, f)
  assert not np.asarray(y, np.float32)[sum(sizes):].any()  # rows past the groups: zero
  # f32: the same sums in another order; bf16: h is rounded to bf16 before the product in both
  tol = 1e-5 if dtype == jnp.float32 else 2 ** -6
  for got, want in [(y, want_y), *zip(vjp(d), want_vjp(d))]:
    want = np.asarray(want, np.float32)
    assert np.abs(np.asarray(got, np.float32) - want).max() <= tol * max(np.abs(want).max(), 1e-30)


def test_the_layer_fuses_the_product_into_its_gate_up_gmm_only_where_f_fits():
  from kernels.experts.layer import _gate_up

  def names(f, blocks=None):
    lhs, w, gs = rand((64, 32)), rand((4, 32, 2 * f)), jnp.asarray([16, 16, 16, 16], jnp.int32)
    run = lambda lhs, w: _gate_up(lhs, w, gs, "silu", block_sizes=blocks, interpret=True)  # noqa: E731
    def fwd_bwd(lhs, w):
      y, vjp = jax.vjp(run, lhs, w)
      return vjp(y)
    jaxpr = jax.make_jaxpr(fwd_bwd)(lhs, w)
    return sorted(e.params["name"] for e in _eqns(jaxpr.jaxpr) if e.primitive.name == "pallas_call")
  # forward: one kernel; backward: the product's kernel, then gmm's d lhs and tgmm's d w
  assert names(128) == ["glu_backward", "gmm", "gmm_glu", "tgmm"]
  assert names(96) == ["gmm", "gmm", "tgmm"]  # f not a multiple of 128: gmm, XLA's product and its backward
  # blocks of 128 columns for n = 2f = 256: the fused kernel takes all 128 gate and up columns a step,
  # one pass over the rows against gmm's two
  assert names(128, (128, 128, 128)) == ["glu_backward", "gmm", "gmm_glu", "tgmm"]


@pytest.mark.parametrize("sizes, k, f, activation, dtype", [
    ((300, 0, 500, 150, 74), 256, 256, "silu", jnp.float32),    # an empty group, straddled tiles
    ((200, 200, 100, 0, 300), 640, 384, "gelu", jnp.bfloat16),  # rows past the sum
    ((1000, 24, 0, 0, 0), 128, 128, "relu", jnp.float32),       # skewed, three empty groups
])
def test_the_experts_backward_runs_the_product_s_backward_inside_the_grouped_matmul(sizes, k, f, activation,
                                                                                       dtype):
  """kernels.experts.layer._experts: the activation product's backward runs in the epilogue of the kernel
  that computes its incoming gradient, which writes d [gate | up] for gmm's backward. Its value
  and all three gradients against the same layer on XLA, in interpret mode."""
  from kernels.experts.layer import _experts
  m, e = 1100, len(sizes)
  xs, dy = rand((m, k), 1).astype(dtype), rand((m, k), 2).astype(dtype)
  wgu = (rand((e, k, 2 * f), 3) / np.sqrt(k)).astype(dtype)
  wd = (rand((e, f, k), 4) / np.sqrt(f)).astype(dtype)
  gs = jnp.asarray(sizes, jnp.int32)
  run = lambda impl: lambda *w: _experts(*w, gs, activation, implementation=impl,  # noqa: E731
                                         interpret=True if impl == "pallas" else None)
  y, vjp = jax.vjp(run("pallas"), xs, wgu, wd)
  want_y, want_vjp = jax.vjp(run("xla"), xs, wgu, wd)
  names = [e.params["name"] for e in _eqns(jax.make_jaxpr(lambda *a: jax.vjp(run("pallas"), *a)[1](dy))(
      xs, wgu, wd).jaxpr) if e.primitive.name == "pallas_call"]
  assert sorted(names) == ["gmm", "gmm", "gmm_glu", "gmm_glu_bwd", "tgmm", "tgmm"], names
  tol = 1e-5 if dtype == jnp.float32 else 2 ** -6
  for got, want in [(y, want_y), *zip(vjp(dy), want_vjp(dy))]:
    want = np.asarray(want, np.float32)
    assert np.abs(np.asarray(got, np.float32) - want).max() <= tol * max(np.abs(want).max(), 1e-30)
  assert not np.asarray(y, np.float32)[sum(sizes):].any()  # rows past the sum are zero


def test_the_experts_run_apart_where_the_fused_plans_do_not_apply():
  from kernels.experts.layer import _experts

  def names(f, blocks=None):
    xs, gs = rand((64, 32)), jnp.asarray([16, 16, 16, 16], jnp.int32)
    wgu, wd = rand((4, 32, 2 * f)), rand((4, f, 32))
    run = lambda *a: _experts(*a, gs, "silu", block_sizes=blocks, interpret=True)  # noqa: E731
    jaxpr = jax.make_jaxpr(lambda *a: jax.vjp(run, *a)[1](rand((64, 32))))(xs, wgu, wd)
    return sorted(e.params["name"] for e in _eqns(jaxpr.jaxpr) if e.primitive.name == "pallas_call")
  assert names(128) == ["gmm", "gmm", "gmm_glu", "gmm_glu_bwd", "tgmm", "tgmm"]
  # f not a multiple of 128: gmm, XLA's product and its backward, gmm
  assert names(96) == ["gmm"] * 4 + ["tgmm"] * 2
  # f wider than gmm's column block (2048 by default): the product's backward a kernel of its own
  assert names(3200) == ["glu_backward", "gmm", "gmm", "gmm", "gmm_glu", "tgmm", "tgmm"]
  # explicit blocks: the forward fused, the product's backward a kernel of its own
  assert names(128, (128, 128, 128)) == ["glu_backward", "gmm", "gmm", "gmm", "gmm_glu", "tgmm", "tgmm"]


def _eqns(jaxpr):
  """Every equation of ``jaxpr``, nested ones (custom VJPs, jit calls) included."""
  for e in jaxpr.eqns:
    yield e
    for p in e.params.values():
      for j in (p if isinstance(p, (list, tuple)) else [p]):
        if hasattr(j, "jaxpr") and hasattr(j.jaxpr, "eqns"):
          yield from _eqns(j.jaxpr)
        elif hasattr(j, "eqns"):
          yield from _eqns(j)


def test_jit_composes():
  args = layer()
  f = jax.jit(lambda *a: moe(*a, top_k=2, capacity_factor=1.0, interpret=True))
  y, aux = f(*args)
  assert_layer_close(y, moe_reference(*args, top_k=2, capacity_factor=1.0)[0], jnp.float32)
  assert aux["load_balancing_loss"].shape == ()


# ---------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------


def _bad(argument, **overrides):
  x, rw, wg, wu, wd = layer()
  kw = dict(x=x, router_w=rw, w_gate=wg, w_up=wu, w_down=wd, top_k=2)
  kw.update(overrides)
  with pytest.raises(kernels.KernelError) as e:
    moe_eager(**kw)
  assert e.value.argument == argument, str(e.value)


def test_bad_input_names_the_argument():
  x, rw, wg, wu, wd = layer()
  _bad("top_k", top_k=5)
  _bad("top_k", top_k=0)
  _bad("x", x=x[None])
  _bad("router_w", router_w=rw[:5])
  _bad("w_gate", w_gate=wg[:3])           # 3 experts, the router has 4
  _bad("w_up", w_up=wu[:, :, :8])
  _bad("w_down", w_down=wd[:3])
  _bad("w_down", w_down=wd[:, :8])
  _bad("w_gate", w_gate=wg[0])
  _bad("scoring", scoring="tanh")
  _bad("capacity_factor", capacity_factor=0.0)
  _bad("expert_bias", expert_bias=jnp.zeros(5))
  _bad("activation", activation="swish")
  with pytest.raises(kernels.KernelError, match="top_k"):
    route_eager(x, rw, top_k=9)


# ---------------------------------------------------------------------------------
# Compiles for every TPU generation
# ---------------------------------------------------------------------------------


_AOT_PROGRAM = """
import re, sys, jax, jax.numpy as jnp, kernels
from kernels.experts.layer import moe
gen, which, bf16, sds = sys.argv[1], sys.argv[2], jnp.bfloat16, jax.ShapeDtypeStruct

def fwd_bwd(top_k, capacity_factor):
  def loss(x, rw, wg, wu, wd, dy):
    y, aux = moe(x, rw, wg, wu, wd, top_k=top_k, capacity_factor=capacity_factor)
    return jnp.sum(y.astype(jnp.float32) * dy) + aux["load_balancing_loss"] + aux["z_loss"]
  return jax.value_and_grad(loss, argnums=range(5))

def layer_args(t, d, e, f):
  return (sds((t, d), bf16), sds((d, e), jnp.float32), sds((e, d, f), bf16), sds((e, d, f), bf16),
          sds((e, f, d), bf16), sds((t, d), bf16))

# The benchmark cases (tools/bench_moe.py, dropless): (tokens, d, f, experts, top_k)
BENCH = {"E8_top2": (8192, 4096, 14336, 8, 2), "E64_top8": (8192, 2048, 1408, 64, 8)}
if which in BENCH:  # the default blocks at the layer's own matmul shapes (gate and up fused: n = 2f)
  t, d, f, e, top_k = BENCH[which]
  comp = kernels.compile_for_tpu(fwd_bwd(top_k, None), *layer_args(t, d, e, f), generation=gen)
  # 6 grouped matmuls: 2 forward (gate and up with the activation product in one), 2 gmm for d lhs
  # (at E=64 the first with the product's backward in it), 2 tgmm for d rhs. The product's
  # backward is a kernel of its own at E=8 (f = 14336 takes several column blocks), and the
  # product runs apart on v4 at E=64 (16 MiB of VMEM).
  fwd = gen != "v4" or which != "E64_top8"
  bwd = fwd and which == "E64_top8"
  assert comp.hlo.count("tpu_custom_call") == (6 if bwd else 7), comp.hlo.count("tpu_custom_call")
  assert ("gmm_glu" in comp.hlo) == fwd and ("gmm_glu_bwd" in comp.hlo) == bwd, gen
  assert comp.vmem_bytes < kernels.get_chip(gen).vmem_bytes
  print("ok")
  sys.exit(0)
t, d, e, f = 256, 256, 8, 256
args = layer_args(t, d, e, f)
for top_k, cf in ((2, 1.25),):  # the capacity path: drops, and rows past the sum
  comp = kernels.compile_for_tpu(fwd_bwd(top_k, cf), *args, generation=gen)
  # the Pallas grouped matmuls (2 forward, 2 for d lhs and 2 tgmm for d rhs), the activation's
  # product and its backward inside the first of each
  assert comp.hlo.count("tpu_custom_call") >= 6, comp.hlo.count("tpu_custom_call")
  assert "gmm_glu_bwd" in comp.hlo, gen
  assert comp.vmem_bytes is None or comp.vmem_bytes < kernels.get_chip(gen).vmem_bytes
  # The permutations move rows in the activations' dtype, both ways: a gather is written to
  # HBM, so an f32 gather of [tokens * top_k, d] rows would double its bytes.
  wide = re.compile(rf"\\s*(ROOT )?%[\\w.-]*gather[\\w.-]* = f32\\[{t * top_k},{d}\\]")
  assert not [line for line in comp.hlo.splitlines() if wide.match(line)], gen
print("ok")
"""


@pytest.mark.tpu_aot
@pytest.mark.parametrize("generation", kernels.TPU_GENERATIONS)
def test_aot_compiles_forward_and_backward(generation):
  _aot(generation, "small")


@pytest.mark.tpu_aot
@pytest.mark.parametrize("case", ["E8_top2", "E64_top8"])
@pytest.mark.parametrize("generation", kernels.TPU_GENERATIONS)
def test_aot_compiles_benchmark_shapes(generation, case):
  # The layer's grouped matmuls at the benchmark shapes are kernels of their own: gate and up fused
  # (n = 2f, e.g. one 2816-wide block at E=64), down (k = f, rhs not transposed), and their backward
  # gmm and tgmm. tests/test_gmm.py compiles gmm's own benchmark shapes, not these.
  _aot(generation, case)


def _aot(generation, which):
  import os
  env = dict(os.environ, KERNELS_STATIC_PROFILE="0")
  proc = run_program(_AOT_PROGRAM, generation, which, env=env)
  assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]
