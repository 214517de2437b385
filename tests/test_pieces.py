"""A program cut at its Pallas kernels (kernels/_pieces.py, behind kernels.estimate_tpu_pieces).

Run one after another, the pieces must compute what the program computes: their inputs and
outputs are the values that cross a kernel, so nothing is lost or run twice. Checked in
interpret mode on the CPU through ``jit``, a custom VJP's backward and
``implementation=None``'s platform branches; the estimate itself is checked in
tests/test_tpu_aot.py.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np

import kernels
from kernels.base.backend import target
from kernels.perf import pieces as _pieces
from tests import toy


def program(x, w1, w2):
  h = jnp.tanh(toy.matmul(x, w1, bm=8, bk=128, bn=128, interpret=True))
  y = jax.jit(lambda a: toy.scale_add(a, implementation="pallas", interpret=True))(h @ w2)
  return jnp.sum(y * y), {"y": y}


def normal(shapes, dtype=jnp.float32, seed=0):
  keys = jax.random.split(jax.random.key(seed), len(shapes))
  return [jax.random.normal(k, s, jnp.float32).astype(dtype) for k, s in zip(keys, shapes)]


def test_each_kernel_is_a_piece_and_the_xla_ops_between_two_kernels_are_one():
  c = _pieces.cut(program, *normal([(16, 128), (128, 128), (128, 128)]))
  assert [p.kernel for p in c.pieces] == [True, False, True, False]  # nothing runs before the first kernel
  assert c.pieces[0].primitives == ["pallas_call"] and "tanh" in c.pieces[1].primitives
  assert "reduce_sum" in c.pieces[3].primitives and "dot_general" in c.pieces[1].primitives


def test_pieces_run_in_order_compute_the_program_and_its_gradient():
  args = normal([(16, 128), (128, 128), (128, 128)])
  np.testing.assert_allclose(_pieces.cut(program, *args).run(*args)[0], program(*args)[0], rtol=1e-6)
  grad = jax.grad(lambda *a: program(*a)[0], argnums=2)  # through scale_add's custom VJP
  g = _pieces.cut(grad, *args).run(*args)
  np.testing.assert_allclose(g, grad(*args), rtol=1e-5, atol=1e-5)


def test_the_moe_layer_backward_cut_at_its_grouped_matmuls():
  """implementation=None under a TPU target: the platform branch for TPU is inlined, so the cut
  holds the forward's two grouped matmuls (gate and up fused with the activation product, then
  down) and the backward's gmm and tgmm calls, the first gmm with the product's backward in it
  (f = 128, a multiple of their column blocks)."""
  t, d, e, f, k = 64, 128, 4, 128, 2
  x, rw, wg, wu, wd, dy = normal([(t, d), (d, e), (e, d, f), (e, d, f), (e, f, d), (t, d)], seed=1)
  x, dy = x.astype(jnp.bfloat16), dy.astype(jnp.bfloat16)
  wg, wu, wd = (w.astype(jnp.bfloat16) for w in (wg, wu, wd))

  def loss(x, wg, wu, wd, interpret=None):
    y, _ = kernels.moe(x, rw, wg, wu, wd, top_k=k, interpret=interpret)
    return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))
  with target(kernels.get_chip("v5e")):
    names = [p.name for p in _pieces.cut(jax.grad(loss, argnums=(0, 1, 2, 3)), x, wg, wu, wd).pieces if p.kernel]
  assert sorted(names) == ["gmm"] * 2 + ["gmm_glu", "gmm_glu_bwd"] + ["tgmm"] * 2, names
  g = jax.grad(functools.partial(loss, interpret=True), argnums=(0, 1, 2, 3))
  c = _pieces.cut(g, x, wg, wu, wd)
  assert sum(p.kernel for p in c.pieces) == 6
  for got, want in zip(c.run(x, wg, wu, wd), g(x, wg, wu, wd)):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)


def test_large_xla_dots_are_pieces_of_their_own_with_dots_above():
  """A program on XLA's matmuls: with ``dots_above`` each dot that large is a ``dot`` piece, a
  smaller one stays with the XLA ops around it, and the pieces still compute the program
  and its gradient."""
  def dense(x, w1, w2, r):
    h = jax.nn.silu((x @ w1).astype(jnp.float32)).astype(x.dtype)  # 2 * 64 * 128 * 256 FLOPs
    gate = jax.nn.softmax(x @ r)                                      # 2 * 64 * 128 * 4: small
    return jnp.sum((h @ w2) * gate[:, :1])

  args = normal([(64, 128), (128, 256), (256, 128), (128, 4)])
  c = _pieces.cut(dense, *args, dots_above=1e6)
  assert [p.name for p in c.pieces] == ["dot", "xla", "dot", "xla"], [p.name for p in c.pieces]
  assert not any(p.kernel for p in c.pieces) and "dot_general" in c.pieces[1].primitives  # the small one
  np.testing.assert_allclose(c.run(*args), dense(*args), rtol=1e-5)
  grad = jax.grad(dense, argnums=(0, 1, 2))
  c = _pieces.cut(grad, *args, dots_above=1e6)
  assert sum(p.name == "dot" for p in c.pieces) == 6, [p.name for p in c.pieces]  # 2 forward, 4 backward
  for got, want in zip(c.run(*args), grad(*args)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  assert [p.name for p in _pieces.cut(dense, *args).pieces] == ["xla"]  # without dots_above: one piece
