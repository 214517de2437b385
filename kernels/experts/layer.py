"""Mixture-of-experts routing and a whole SwiGLU MoE feed-forward layer on the grouped matmul.

``route(x, router_w, top_k=...)`` scores every token against every expert, picks each
token's ``top_k`` experts and returns a :class:`Routing`: the expert ids and combine
weights per token, the assignments sorted by expert with the group sizes, which
assignments a capacity dropped, and the auxiliary losses. ``moe(x, router_w, w_gate,
w_up, w_down, top_k=...)`` is the whole layer on :func:`kernels.experts.grouped.gmm`;
:func:`moe_reference` is the same layer run densely (every expert on every token, then
masked), the oracle of the tests.

How routing works
-----------------

*Scores.* ``logits = x @ router_w`` (f32 accumulation). ``scoring="softmax"`` turns them
into probabilities over the experts (Switch, GShard, Mixtral); ``scoring="sigmoid"``
scores each expert on its own (DeepSeek-V3). A token's experts are the ``top_k`` highest
``scores + expert_bias``: the bias (the auxiliary-loss-free balancing of DeepSeek-V3)
steers *selection* only; the combine weights are the unbiased scores of the chosen
experts, divided by their sum when ``normalize_weights`` (the default).

*Ties* are broken toward the lower expert id (``lax.top_k`` is documented to put the
lower index first among equal values), so routing is a deterministic function of the
scores.

*Sorting by expert.* The ``tokens * top_k`` assignments (flat index ``t * top_k + s`` for
token ``t``'s ``s``-th choice) are sorted by expert with one ``lax.sort`` on two keys:
the expert, then the assignment's *priority* ``s * tokens + t``: every token's first
choice before any second choice, and within a choice, earlier tokens first (GShard's
order). The keys are unique, so the order is deterministic. ``Routing.order`` lists the
assignments in that order, and ``Routing.group_sizes[e]`` counts expert ``e``'s rows:
rows ``[sum(group_sizes[:e]), sum(group_sizes[:e+1]))`` of the permuted tokens go to
expert ``e``. Gathering the tokens in this order turns ``experts`` small matmuls of
data-dependent sizes into one grouped matmul over a single ``[tokens * top_k, d]`` array.

*Capacity.* ``capacity_factor=None`` is dropless: every assignment is computed.
Otherwise each expert takes at most ``capacity = ceil(capacity_factor * tokens * top_k /
experts)`` assignments, the first ones in priority order; the rest are *dropped*:
they sort after every kept one (``sum(group_sizes)`` is then less than
``tokens * top_k``; the grouped matmul leaves those rows zero), their combine weight is
zero, and ``Routing.dropped`` marks them. A token whose every choice was dropped gets a
zero output: the layer's residual connection carries it.

*Auxiliary losses.* ``load_balancing_loss = experts * sum_e f_e * P_e`` (Switch
Transformer, eq. 4, with top-k): ``f_e`` is the fraction of the assignments that chose
expert ``e`` (before drops; not differentiable) and ``P_e`` the mean router probability
of expert ``e`` over tokens (for sigmoid scoring, the scores normalised per token). It is
1 when routing is uniform and grows with imbalance; its gradient pushes probability away
from overloaded experts. ``z_loss = mean_t logsumexp(logits_t)^2`` (ST-MoE) keeps the
router logits small. Both are f32 scalars; the caller weights them.

How the layer works
-------------------

``moe`` routes, then *permutes* the tokens (a gather of row ``order // top_k``, so each
token appears once per choice), then runs the gate and up projections as one grouped
matmul over the experts' concatenated ``[d, 2f]`` weights with ``activation(gate) * up``
computed in its epilogue (:func:`_gate_up`: gmm's kernel in its ``glu`` form, each step
holding gate columns and the matching up columns; it writes the two halves, which the
backward needs, and their product, so nothing reads them back for the product), then
the down projection as a second ``gmm``, then *combines*: each token gathers its
``top_k`` rows (by ``Routing.position``) and sums them weighted by the routing weights,
in f32. The two grouped matmuls share one custom VJP (:func:`_experts`): the product's
backward runs in the epilogue of the ``gmm`` that computes its incoming gradient
(``dy @ w_down^T``, which so never goes to HBM), and writes ``d [gate | up]`` for gmm's
backward of the gate-and-up matmul. Where that kernel's plan does not fit (experts wider
than one column block), the product's backward is a small Pallas kernel of its own
(:func:`_glu`).

The permutations are gathers both ways: each forward gathers rows, and its custom VJP
gathers the cotangent by the inverse permutation (the dispatch's summing a token's
``top_k`` copies) instead of the scatter-add that automatic differentiation would emit
for a gather (a scatter is serialised on a TPU). A gather that feeds a sum over a
token's choices is written as ``top_k`` gathers of ``[tokens, d]`` added elementwise,
not as one ``[tokens, top_k, d]`` gather reduced over its middle axis
(:func:`_gather_sum`). Rows are gathered in their own dtype and widened to f32 after: a
gather is written to HBM, and f32 rows would double its bytes. The grouped matmuls'
backward is otherwise :func:`kernels.experts.grouped.gmm`'s own (a ``gmm`` with the transposed weights
for the activations, a ``tgmm`` for the weights).

Passing ``w_up=None`` with ``w_gate`` of shape ``[experts, d, 2f]`` (the gate weights in
the first ``f`` columns, the up weights in the last) skips the concatenation, which
otherwise copies both weight tensors on every call (and their gradients back).

``aux`` holds ``load_balancing_loss``, ``z_loss``, ``expert_load`` (assignments that chose
each expert, before drops), ``group_sizes`` (rows each expert computed) and
``dropped_fraction``.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.experts import grouped as gmm_mod
from kernels.experts import grouped_kernels as K
from kernels.base import calls
from kernels.base import partition
from kernels.base import tiling
from kernels.base.backend import dispatch, target_chip
from kernels.base.errors import KernelError, VmemOverflowError, check
from kernels.base.hardware import get_chip

# the module, not the function kernels.gmm that the package's namespace exports under its name


__all__ = ["Routing", "expert_capacity", "moe", "moe_reference", "route"]

SCORINGS = ("softmax", "sigmoid")
ACTIVATIONS = {"silu": jax.nn.silu, "gelu": functools.partial(jax.nn.gelu, approximate=True),
               "relu": jax.nn.relu}


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["expert_ids", "weights", "dropped", "order", "position", "group_sizes",
                                "expert_load", "load_balancing_loss", "z_loss"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Routing:
  """Where each token goes (see the module docstring). ``tokens * top_k`` assignments,
  flat index ``t * top_k + s`` for token ``t``'s ``s``-th choice."""

  expert_ids: jax.Array
  """``[tokens, top_k]`` int32: each token's experts, best first."""
  weights: jax.Array
  """``[tokens, top_k]`` f32: combine weights (0 for a dropped assignment)."""
  dropped: jax.Array
  """``[tokens, top_k]`` bool: assignments over their expert's capacity (all False when dropless)."""
  order: jax.Array
  """``[tokens * top_k]`` int32: the assignments sorted by expert, kept ones first, dropped ones last."""
  position: jax.Array
  """``[tokens, top_k]`` int32: each assignment's row in the sorted order (the inverse of ``order``)."""
  group_sizes: jax.Array
  """``[experts]`` int32: kept assignments per expert (rows of each group in the sorted order)."""
  expert_load: jax.Array
  """``[experts]`` int32: assignments that chose each expert, before capacity drops."""
  load_balancing_loss: jax.Array
  """f32 scalar: ``experts * sum_e f_e * P_e`` (Switch Transformer)."""
  z_loss: jax.Array
  """f32 scalar: ``mean_t logsumexp(logits_t)^2`` (ST-MoE)."""

  @property
  def token_ids(self) -> jax.Array:
    """``[tokens * top_k]``: the token of each row of the sorted order."""
    return self.order // self.expert_ids.shape[1]


def expert_capacity(tokens: int, experts: int, top_k: int, capacity_factor: float) -> int:
  """Assignments an expert may take: ``ceil(capacity_factor * tokens * top_k / experts)``."""
  return int(math.ceil(capacity_factor * tokens * top_k / experts))


# ---------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------


def _check_route_args(x, router_w, top_k, scoring, expert_bias, capacity_factor):
  check(getattr(x, "ndim", None) == 2, "x", x, "must be [tokens, d] (rank 2)")
  check(x.shape[0] >= 1, "x", x, "needs at least one token")
  check(jnp.issubdtype(x.dtype, jnp.floating), "x", x, "must be a floating-point array")
  check(getattr(router_w, "ndim", None) == 2, "router_w", router_w, "must be [d, experts] (rank 2)")
  check(router_w.shape[0] == x.shape[1], "router_w", router_w,
        f"must have d={x.shape[1]} rows, the width of x {list(x.shape)}")
  experts = router_w.shape[1]
  check(experts >= 1, "router_w", router_w, "needs at least one expert")
  check(isinstance(top_k, int) and not isinstance(top_k, bool) and 1 <= top_k <= experts, "top_k", top_k,
        f"must be an int in [1, experts={experts}]")
  check(scoring in SCORINGS, "scoring", scoring, f"must be one of {SCORINGS}")
  if expert_bias is not None:
    check(getattr(expert_bias, "shape", None) == (experts,), "expert_bias", expert_bias,
          f"must be [experts={experts}], one bias per expert")
  if capacity_factor is not None:
    check(isinstance(capacity_factor, (int, float)) and not isinstance(capacity_factor, bool)
          and capacity_factor > 0, "capacity_factor", capacity_factor, "must be None (dropless) or a number > 0")


def _check_layer_args(x, router_w, w_gate, w_up, w_down, activation):
  experts, d = router_w.shape[1], x.shape[1]
  check(getattr(w_gate, "ndim", None) == 3, "w_gate", w_gate, "must be [experts, d, f] (rank 3)")
  check(getattr(w_down, "ndim", None) == 3, "w_down", w_down, "must be [experts, f, d] (rank 3)")
  for name, w in (("w_gate", w_gate), ("w_down", w_down)) + ((("w_up", w_up),) if w_up is not None else ()):
    check(w.shape[0] == experts, name, w, f"must have experts={experts} (router_w's columns) in dim 0")
  check(w_gate.shape[1] == d, "w_gate", w_gate, f"must be [experts, d={d}, f]")
  if w_up is None:
    check(w_gate.shape[2] % 2 == 0, "w_gate", w_gate,
          "with w_up=None must be the concatenated [experts, d, 2f] gate and up weights (even last dim)")
    f = w_gate.shape[2] // 2
  else:
    check(getattr(w_up, "ndim", None) == 3 and w_up.shape == w_gate.shape, "w_up", w_up,
          f"must have w_gate's shape {list(w_gate.shape)}")
    f = w_gate.shape[2]
  check(w_down.shape[1:] == (f, d), "w_down", w_down, f"must be [experts, f={f}, d={d}]")
  check(activation in ACTIVATIONS, "activation", activation, f"must be one of {tuple(ACTIVATIONS)}")


# ---------------------------------------------------------------------------------
# Routing
# ---------------------------------------------------------------------------------


def route(x, router_w, *, top_k: int, scoring: str = "softmax", normalize_weights: bool = True,
          expert_bias=None, capacity_factor: float | None = None) -> Routing:
  """Routes ``x`` ``[tokens, d]`` to ``top_k`` of ``router_w``'s ``[d, experts]`` experts.

  Args:
    x: ``[tokens, d]`` token activations.
    router_w: ``[d, experts]`` router weights.
    top_k: experts per token, ``1 <= top_k <= experts``.
    scoring: ``"softmax"`` (probabilities over experts) or ``"sigmoid"`` (independent scores).
    normalize_weights: divide each token's combine weights by their sum.
    expert_bias: ``[experts]`` added to the scores for selection only (auxiliary-loss-free balancing).
    capacity_factor: ``None`` for dropless routing, else each expert keeps at most
      :func:`expert_capacity` assignments (first choices first, then earlier tokens).

  Returns:
    A :class:`Routing`. Gradients flow to ``x`` and ``router_w`` through the combine
    weights and the two losses; the choice of experts is piecewise constant.
  """
  _check_route_args(x, router_w, top_k, scoring, expert_bias, capacity_factor)
  tokens, experts = x.shape[0], router_w.shape[1]
  n = tokens * top_k
  acc = jnp.float64 if jnp.promote_types(x.dtype, router_w.dtype) == jnp.float64 else jnp.float32
  logits = jnp.dot(x, router_w, preferred_element_type=acc).astype(acc)
  probs = jax.nn.softmax(logits, axis=-1) if scoring == "softmax" else jax.nn.sigmoid(logits)
  select = probs if expert_bias is None else probs + lax.stop_gradient(expert_bias).astype(acc)
  _, ids = lax.top_k(lax.stop_gradient(select), top_k)  # ties: the lower expert id first
  ids = ids.astype(jnp.int32)
  # A one-hot product, not take_along_axis: its gradient would be a scatter, which libtpu's
  # cost model aborts on (and a TPU serialises); this one is dense.
  weights = jnp.sum(probs[:, None, :] * jax.nn.one_hot(ids, experts, dtype=acc), axis=-1)
  if normalize_weights:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)

  flat = ids.reshape(n)
  a = jnp.arange(n, dtype=jnp.int32)
  priority = (a % top_k) * tokens + a // top_k  # first choices of all tokens, then second choices, ...
  sorted_e, _, perm = lax.sort((flat, priority, a), num_keys=2)
  load = jnp.sum(flat[:, None] == jnp.arange(experts, dtype=jnp.int32), axis=0, dtype=jnp.int32)
  if capacity_factor is None:
    order, group_sizes = perm, load
    dropped = jnp.zeros((tokens, top_k), bool)
  else:
    cap = expert_capacity(tokens, experts, top_k, capacity_factor)
    starts = jnp.cumsum(load) - load
    kept_sorted = a - starts[sorted_e] < cap
    group = jnp.where(kept_sorted, sorted_e, experts)  # dropped ones after every kept one
    _, order = lax.sort((group, perm), num_keys=1, is_stable=True)
    group_sizes = jnp.minimum(load, cap)
    _, dropped = lax.sort((perm, ~kept_sorted), num_keys=1)  # back to assignment order
    dropped = dropped.reshape(tokens, top_k)
    weights = jnp.where(dropped, 0, weights)
  _, position = lax.sort((order, a), num_keys=1)  # the inverse permutation, by a sort (no scatter)
  position = position.reshape(tokens, top_k)

  frac = load.astype(acc) / n
  p = probs if scoring == "softmax" else probs / jnp.sum(probs, axis=-1, keepdims=True)
  lb_loss = experts * jnp.sum(frac * jnp.mean(p, axis=0))
  z_loss = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
  return Routing(ids, weights, dropped, order, position, group_sizes, load, lb_loss, z_loss)


# ---------------------------------------------------------------------------------
# Permutations: gathers both ways
# ---------------------------------------------------------------------------------


def _gather_sum(rows, position, weights=None):
  """``sum_s weights[:, s] * rows[position[:, s]]`` in f32: one row gather per choice, each
  added to the sum. Written as ``top_k`` gathers of ``[tokens, d]`` rather than one
  ``[tokens, top_k, d]`` gather reduced over its middle axis. XLA:TPU writes each gather
  to HBM either way (a gather does not fuse into its consumer), so the bytes are the same;
  the difference is the sum. Summing ``top_k`` aligned ``[tokens, d]`` arrays is
  elementwise work, while reducing over the middle axis sums rows that share a packed
  bf16 sublane tile, which libtpu's cost model charges far above the bytes' time."""
  acc = None
  for s in range(position.shape[1]):
    v = rows[position[:, s]].astype(jnp.float32)
    if weights is not None:
      v = v * weights[:, s:s + 1].astype(jnp.float32)
    acc = v if acc is None else acc + v
  return acc


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _dispatch(x, order, position, top_k):
  """``x[order // top_k]``: each token once per choice, sorted by expert."""
  return x[order // top_k]


def _dispatch_fwd(x, order, position, top_k):
  return _dispatch(x, order, position, top_k), (order, position)


def _dispatch_bwd(top_k, res, g):
  order, position = res
  return _gather_sum(g, position).astype(g.dtype), None, None


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


@jax.custom_vjp
def _combine(ys, weights, order, position):
  """``y[t] = sum_s weights[t, s] * ys[position[t, s]]``: the sorted rows back to their
  tokens, weighted and summed (f32 sum, ``ys``'s dtype out)."""
  return _gather_sum(ys, position, weights).astype(ys.dtype)


def _combine_fwd(ys, weights, order, position):
  return _combine(ys, weights, order, position), (ys, weights, order, position)


def _combine_bwd(res, g):
  ys, weights, order, position = res
  top_k = position.shape[1]
  g32 = g.astype(jnp.float32)
  # d ys[p] = weights[a] * g[token of a] for the assignment a = order[p]: one gather of g.
  # (Gathered in g's dtype and widened after: a gather is written to HBM, and f32 rows would
  # double its bytes and its consumer's.)
  dys = (g[order // top_k].astype(jnp.float32) * weights.reshape(-1)[order][:, None].astype(jnp.float32)
         ).astype(ys.dtype)
  # d weights[t, s] = <g[t], ys[position[t, s]]>: a row gather per choice, then a row dot.
  dw = jnp.stack([jnp.sum(g32 * ys[position[:, s]].astype(jnp.float32), axis=-1) for s in range(top_k)], axis=1)
  return dys, dw.astype(weights.dtype), None, None


_combine.defvjp(_combine_fwd, _combine_bwd)


# ---------------------------------------------------------------------------------
# The activation product, and its backward kernel
# ---------------------------------------------------------------------------------


def _glu_xla(h, activation):
  f = h.shape[1] // 2
  return (ACTIVATIONS[activation](h[:, :f].astype(jnp.float32)) * h[:, f:].astype(jnp.float32)).astype(h.dtype)


def _glu_backward_kernel(g_ref, u_ref, d_ref, o_ref, *, activation):
  # Step (i, j, half) writes column block j of d gate (half 0) or of d up (half 1). Both halves
  # read the same three input blocks, and Pallas does not fetch a block again when its index
  # does not change between consecutive steps, so each input is read from HBM once.
  act = ACTIVATIONS[activation]
  f32 = lambda ref: ref[...].astype(jnp.float32)  # noqa: E731

  @pl.when(pl.program_id(2) == 0)
  def _():
    o_ref[...] = jax.vjp(act, f32(g_ref))[1](f32(d_ref) * f32(u_ref))[0].astype(o_ref.dtype)

  @pl.when(pl.program_id(2) == 1)
  def _():
    o_ref[...] = (f32(d_ref) * act(f32(g_ref))).astype(o_ref.dtype)


GLU_BLOCK_ELEMENTS = 2**20  # elements per block: 2 MiB of bf16 (compiler estimates: smaller blocks pay per-step overhead)


def _glu_plan(rows: int, f: int, itemsize: int) -> tuple[int, int, int | None]:
  """``(tm, tn, vmem_limit_bytes)``: ``tn`` the widest multiple of 128 up to 2048 that
  divides ``f``; ``tm`` the most rows, a power of two from 8 to 1024, with at most
  :data:`GLU_BLOCK_ELEMENTS` per block and the step's VMEM within the core's."""
  chip = target_chip() or get_chip("v5e")
  tn = max(t for t in range(128, min(f, 2048) + 1, 128) if f % t == 0)
  per_element = 8 * itemsize + 3 * 4  # three inputs and one output, double-buffered; f32 temporaries
  tm = 1024
  while tm > 8 and (tm * tn > GLU_BLOCK_ELEMENTS or 1.25 * tm * tn * per_element + 2**20 > chip.vmem_bytes):
    tm //= 2
  tm = rows if rows <= tm else tm
  return tm, tn, tiling.vmem_limit(tm * tn * per_element, chip, argument="h", value=f"[{rows}, {2 * f}]")


def _glu_backward_pallas(h, d, *, activation, interpret, up=None):
  """``d [gate | up]`` as one ``[rows, 2f]`` array, from ``h`` ``[rows, 2f]`` (gate then up), or
  from the gate ``h`` ``[rows, f]`` and ``up`` ``[rows, f]`` (the fused gate-and-up kernel's)."""
  rows, f = d.shape
  tm, tn, limit = _glu_plan(rows, f, jnp.dtype(h.dtype).itemsize)
  nf = f // tn
  shift = nf if up is None else 0
  return calls.pallas_call(
      functools.partial(_glu_backward_kernel, activation=activation),
      grid=(tiling.cdiv(rows, tm), nf, 2),
      in_specs=[pl.BlockSpec((tm, tn), lambda i, j, s: (i, j)),            # gate
                pl.BlockSpec((tm, tn), lambda i, j, s: (i, j + shift)),    # up
                pl.BlockSpec((tm, tn), lambda i, j, s: (i, j))],           # d act
      out_specs=pl.BlockSpec((tm, tn), lambda i, j, s: (i, j + s * nf)),
      out_shape=jax.ShapeDtypeStruct((rows, 2 * f), h.dtype),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"),
                                           vmem_limit_bytes=limit),
      interpret=interpret, name="glu_backward")(h, h if up is None else up, d)


def _glu(h, activation: str = "silu", *, implementation=None, interpret=None):
  """``activation(h[:, :f]) * h[:, f:]`` for ``h`` ``[rows, 2f]`` (f32 math, ``h``'s dtype out).

  The forward is XLA's: one fusion reads ``h`` and writes the product. The backward is a
  Pallas kernel that reads ``h`` and the cotangent once and writes ``d h`` once. XLA's
  autodiff writes the gradients of the two halves, then reads them back and writes them
  again, zero-padded and added, as ``[rows, 2f]``: 1.8x the bytes. The kernel needs ``f``
  a multiple of 128 (its column blocks); otherwise the backward is XLA's.
  """

  @jax.custom_vjp
  def run(h):
    return _glu_xla(h, activation)

  def run_fwd(h):
    return run(h), h

  def run_bwd(h, d):
    f = d.shape[1]
    xla = lambda h, d: jax.vjp(functools.partial(_glu_xla, activation=activation), h)[1](d)[0]  # noqa: E731
    if f % 128 or implementation == "xla":
      return (xla(h, d),)
    pallas = functools.partial(_glu_backward_pallas, activation=activation)
    return (dispatch("moe", h, d, pallas=pallas, xla=xla, implementation=implementation, interpret=interpret),)

  run.defvjp(run_fwd, run_bwd)
  return run(h)


def _gate_up_vmem(tm: int, tk: int, tb: int, k: int, dtype) -> int:
  """The fused kernel's VMEM: the double-buffered lhs block, two weight blocks and three output
  blocks; two f32 accumulators, Mosaic's copy of the lhs tile, each dot's f32 result (the
  whole tile and the sub-tiles, per half, twice with a K tail) and the product's row-chunk
  temporaries (see ``kernels.experts.grouped_kernels._gmm_kernel``)."""
  sites = 2 if k % tk and k > tk else 1
  blocks = [((tm, tk), dtype)] + [((tk, tb), dtype)] * 2 + [((tm, tb), dtype)] * 3
  scratch = ([((tm, tb), jnp.float32)] * 2 + [((tm, tk), dtype)] + [((tm, tb), jnp.float32)] * (4 * sites)
             + [((K._sub_rows(tm), tb), jnp.float32)] * 3)
  return tiling.vmem_footprint(blocks, scratch=scratch)


def _gate_up_plan(m: int, k: int, f: int, experts: int, blocks, dtype):
  """The fused gate-and-up kernel's ``(plan, vmem_limit)``, or None (then gmm and the
  activation product run apart). From gmm's plan for ``n = 2f`` (its ``tm`` and ``tk``):
  each step holds ``tb`` gate columns and the matching up columns, ``tb`` a multiple of
  128 that divides ``f``, the nearest to half of gmm's ``tn`` that fits VMEM (the same MXU
  work and weight bytes per step). None where no such ``tb`` makes at most as many
  passes over the rows as gmm's ``tn`` does, or where ``f`` is not a multiple of 128 (the
  backward's kernel, :func:`_glu_backward_pallas`, needs it)."""
  chip = target_chip() or get_chip("v5e")
  if f % 128:
    return None
  plan, _ = gmm_mod._plan("gmm", m, k, 2 * f, experts, blocks, dtype, dtype, dtype)
  half = plan.tn / 2
  for tb in sorted((t for t in range(128, f + 1, 128) if f % t == 0), key=lambda t: abs(math.log(t / half))):
    if f // tb > plan.n_tiles:  # more passes over the rows than gmm's
      continue
    try:
      limit = tiling.vmem_limit(_gate_up_vmem(plan.tm, plan.tk, tb, k, dtype), chip)
    except VmemOverflowError:
      continue
    return dataclasses.replace(plan, tn=tb, n=f), limit
  return None


def _gate_up_pallas(lhs, w, group_sizes, *, p, activation, blocks, static_sizes, interpret):
  gmm_mod._check_kernel_dtypes(p)
  m, k = lhs.shape
  f = w.shape[2] // 2
  planned = _gate_up_plan(m, k, f, p.experts, blocks, lhs.dtype)
  if planned is None:  # gmm's kernel, then the activation product (its backward kernel where f allows)
    h = gmm_mod._gmm_pallas(lhs, w, group_sizes, None, p=p, blocks=blocks, static_sizes=static_sizes,
                            interpret=interpret)
    return _glu(h, activation, implementation="pallas", interpret=interpret)
  plan, limit = planned

  def run(lhs, w, group_sizes):
    tables, static = gmm_mod._tables("gmm", group_sizes, static_sizes, m, plan.tm)
    return K.gmm_call(lhs, w, None, tables, plan=plan, transpose_rhs=False, out_dtype=p.out_dtype, static=static,
                      interpret=interpret, vmem_limit=limit, glu=ACTIVATIONS[activation])

  @jax.custom_vjp
  def fused(lhs, w, group_sizes):
    return run(lhs, w, group_sizes)[2]

  def fused_fwd(lhs, w, group_sizes):
    gate, up, act = run(lhs, w, group_sizes)
    return act, (lhs, w, group_sizes, gate, up)

  def fused_bwd(res, d):
    lhs, w, group_sizes, gate, up = res
    dh = _glu_backward_pallas(gate, d.astype(gate.dtype), activation=activation, interpret=interpret, up=up)
    dlhs, dw = gmm_mod._gmm_backward(lhs, w, group_sizes, dh, p=p, static_sizes=static_sizes, interpret=interpret)
    return dlhs, dw, None

  fused.defvjp(fused_fwd, fused_bwd)
  return fused(lhs, w, group_sizes)


def _gate_up(lhs, w, group_sizes, activation: str, *, block_sizes=None, implementation=None, interpret=None,
             static_sizes=None):
  """``act(lhs @ w[g][:, :f]) * (lhs @ w[g][:, f:])`` for the rows of each group ``g``: the
  gate-and-up grouped matmul and the activation product, ``[rows, f]``.

  The Pallas path is one kernel (gmm's, in its ``glu`` form): each step multiplies the
  rows by gate columns and by the matching up columns and writes both halves (the
  backward needs them) and their product. Unfused, the product was an XLA fusion that
  read ``h`` back from HBM. The backward is :func:`_glu`'s kernel, then gmm's.
  ``static_sizes``: the group sizes as compile-time constants (the estimation method of
  :func:`kernels.experts.grouped.gmm_static_groups`)."""
  p = gmm_mod._validate_gmm(lhs, w, group_sizes, False, None, None)
  blocks = gmm_mod._check_blocks(block_sizes)
  return dispatch(
      "moe", lhs, w, group_sizes,
      pallas=lambda lhs, w, gs, interpret: _gate_up_pallas(lhs, w, gs, p=p, activation=activation, blocks=blocks,
                                                           static_sizes=static_sizes, interpret=interpret),
      xla=lambda lhs, w, gs: _glu_xla(gmm_mod._gmm_xla(lhs, w, gs, None, p=p), activation),
      implementation=implementation, interpret=interpret)


def _glu_bwd_vmem(tm: int, tk: int, tn: int, k: int, dtype) -> int:
  """The fused backward kernel's VMEM (``kernels.experts.grouped_kernels._gmm_kernel`` with ``glu_bwd``):
  gmm's blocks for the product ``d act`` (lhs, transposed rhs), the gate and up blocks, and
  the output block (both halves); the accumulator, Mosaic's copy of the lhs tile, each dot's
  f32 result (as gmm's plan counts them) and the epilogue's row-chunk temporaries."""
  sites = 2 * (1 if tk >= k else 3)
  blocks = [((tm, tk), dtype), ((tn, tk), dtype)] + [((tm, tn), dtype)] * 4
  scratch = ([((tm, tn), jnp.float32), ((tm, tk), dtype)] + [((tm, tn), jnp.float32)] * sites
             + [((K._sub_rows(tm), tn), jnp.float32)] * 6)
  return tiling.vmem_footprint(blocks, scratch=scratch)


def _glu_bwd_plan(m: int, k: int, f: int, experts: int, dtype):
  """``(plan, vmem_limit)`` of the fused backward kernel for ``d act = dy [m, k] @ w_down[g]^T``
  (``w_down`` ``[E, f, k]``), or None. Its output block is all ``2f`` columns of a row tile
  (``tn = f``), so it runs where gmm's own plan for that product takes ``f`` in one block
  and the extra blocks still fit VMEM; otherwise (wide experts, as at E=8) the product's
  backward is a kernel of its own."""
  chip = target_chip() or get_chip("v5e")
  plan, _ = gmm_mod._plan("gmm", m, k, f, experts, gmm_mod.GmmBlockSizes(), dtype, dtype, dtype)
  if plan.tn < f or f % 128:
    return None
  try:
    return plan, tiling.vmem_limit(_glu_bwd_vmem(plan.tm, plan.tk, f, k, dtype), chip)
  except VmemOverflowError:
    return None


def _experts_pallas(xs, wgu, wd, group_sizes, *, activation, blocks, static_sizes, interpret):
  """The experts' two grouped matmuls, ``gmm(act(xs @ gate) * (xs @ up), w_down)``, as Pallas
  kernels, with one custom VJP over both, so that the backward of the activation product
  runs inside the kernel that computes its incoming gradient (``d act = dy @ w_down^T``):
  that kernel reads the forward's gate and up blocks and writes ``d [gate | up]``,
  ``[rows, 2f]``, for gmm's own backward of the gate-and-up matmul. Unfused, ``d act`` went
  to HBM and a separate kernel read it back with gate and up. Where a plan does not fit
  (:func:`_glu_bwd_plan`: experts whose ``f`` takes more than one column block), the
  kernels run apart (:func:`_gate_up`, then :func:`kernels.experts.grouped.gmm`)."""
  m, k = xs.shape
  experts, f = wd.shape[0], wd.shape[1]
  p_gu = gmm_mod._validate_gmm(xs, wgu, group_sizes, False, None, None)
  p_d = gmm_mod._validate_gmm(jax.ShapeDtypeStruct((m, f), xs.dtype), wd, group_sizes, False, None, None)
  gmm_mod._check_kernel_dtypes(p_gu)
  run_down = functools.partial(gmm_mod._run_gmm, transpose_rhs=False, out_dtype=p_d.out_dtype, blocks=blocks,
                               static_sizes=static_sizes, interpret=interpret)
  up_plan = _gate_up_plan(m, k, f, experts, blocks, xs.dtype)
  back_plan = _glu_bwd_plan(m, k, f, experts, xs.dtype) if up_plan else None
  if back_plan is None or (blocks.tm, blocks.tk, blocks.tn) != (None, None, None):
    # apart (explicit blocks too: the fused backward runs at the default blocks)
    act = _gate_up_pallas(xs, wgu, group_sizes, p=p_gu, activation=activation, blocks=blocks,
                          static_sizes=static_sizes, interpret=interpret)
    return gmm_mod._gmm_pallas(act, wd, group_sizes, None, p=p_d, blocks=blocks, static_sizes=static_sizes,
                               interpret=interpret)
  act_fn = ACTIVATIONS[activation]

  def forward(xs, wgu, wd, gs):
    plan, limit = up_plan
    tables, static = gmm_mod._tables("gmm", gs, static_sizes, m, plan.tm)
    gate, up, act = K.gmm_call(xs, wgu, None, tables, plan=plan, transpose_rhs=False, out_dtype=p_gu.out_dtype,
                               static=static, interpret=interpret, vmem_limit=limit, glu=act_fn)
    return run_down(act, wd, gs, None), (gate, up, act)

  @jax.custom_vjp
  def mlp(xs, wgu, wd, gs):
    return forward(xs, wgu, wd, gs)[0]

  def mlp_fwd(xs, wgu, wd, gs):
    ys, saved = forward(xs, wgu, wd, gs)
    return ys, (xs, wgu, wd, gs, *saved)

  def mlp_bwd(res, dy):
    xs, wgu, wd, gs, gate, up, act = res
    dy = dy.astype(xs.dtype)
    plan, limit = back_plan
    tables, static = gmm_mod._tables("gmm", gs, static_sizes, m, plan.tm)
    dgu = K.gmm_call(dy, wd, None, tables, plan=plan, transpose_rhs=True, out_dtype=xs.dtype, static=static,
                     interpret=interpret, vmem_limit=limit, glu_bwd=act_fn, gate_up=(gate, up))
    dwd = gmm_mod._run_tgmm(act, dy, gs, experts=experts, lhs_tokens_major=True, out_dtype=p_d.rhs_dtype,
                            blocks=gmm_mod.GmmBlockSizes(), static_sizes=static_sizes, interpret=interpret)
    dxs, dwgu = gmm_mod._gmm_backward(xs, wgu, gs, dgu, p=p_gu, static_sizes=static_sizes, interpret=interpret)
    return dxs, dwgu, dwd, None

  mlp.defvjp(mlp_fwd, mlp_bwd)
  return mlp(xs, wgu, wd, group_sizes)


def _experts(xs, w_gate_up, w_down, group_sizes, activation: str, *, block_sizes=None, implementation=None,
             interpret=None, static_sizes=None):
  """``gmm(act(xs @ w_gate_up[:, :, :f]) * (xs @ w_gate_up[:, :, f:]), w_down)`` over the
  groups: the experts' part of the layer, ``[rows, d]`` (:func:`_experts_pallas`).
  ``static_sizes``: the group sizes as compile-time constants (the estimation method of
  :func:`kernels.experts.grouped.gmm_static_groups`)."""
  p = gmm_mod._validate_gmm(xs, w_gate_up, group_sizes, False, None, None)
  m, f = xs.shape[0], w_down.shape[1]
  p_d = gmm_mod._validate_gmm(jax.ShapeDtypeStruct((m, f), xs.dtype), w_down, group_sizes, False, None, None)
  blocks = gmm_mod._check_blocks(block_sizes)
  return dispatch(
      "moe", xs, w_gate_up, w_down, group_sizes,
      pallas=lambda xs, wgu, wd, gs, interpret: _experts_pallas(
          xs, wgu, wd, gs, activation=activation, blocks=blocks, static_sizes=static_sizes, interpret=interpret),
      xla=lambda xs, wgu, wd, gs: gmm_mod._gmm_xla(
          _glu_xla(gmm_mod._gmm_xla(xs, wgu, gs, None, p=p), activation), wd, gs, None, p=p_d),
      implementation=implementation, interpret=interpret)


def _mlp_of(plain, *, implementation=None, interpret=None):
  """The experts' part of the layer, ``mlp(xs, w_gate_up, w_down, activation)``, from a grouped
  matmul ``plain(lhs, rhs)``: the matmul, :func:`_glu`, the matmul. How the layer runs on
  another grouped matmul (``tools/bench_moe.py``'s megablox)."""
  def run(xs, w_gate_up, w_down, activation):
    act = _glu(plain(xs, w_gate_up), activation, implementation=implementation, interpret=interpret)
    return plain(act, w_down)
  return run


# ---------------------------------------------------------------------------------
# The layer
# ---------------------------------------------------------------------------------


def moe(x, router_w, w_gate, w_up, w_down, *, top_k: int, activation: str = "silu",
        capacity_factor: float | None = None, scoring: str = "softmax", normalize_weights: bool = True,
        expert_bias=None, block_sizes=None, implementation=None, interpret=None):
  """A SwiGLU mixture-of-experts feed-forward layer on the grouped matmul.

  ``y[t] = sum_s weights[t, s] * (act(x[t] @ w_gate[e]) * (x[t] @ w_up[e])) @ w_down[e]``
  with ``e = expert_ids[t, s]``, over the assignments a capacity kept.

  Args:
    x: ``[tokens, d]``.
    router_w: ``[d, experts]``.
    w_gate, w_up: ``[experts, d, f]``; or ``w_up=None`` and ``w_gate`` the concatenated
      ``[experts, d, 2f]`` (gate columns first).
    w_down: ``[experts, f, d]``.
    top_k, scoring, normalize_weights, expert_bias, capacity_factor: as in :func:`route`.
    activation: ``"silu"`` (SwiGLU), ``"gelu"`` (GeGLU, tanh approximation) or ``"relu"``.
    block_sizes, implementation, interpret: passed to both :func:`kernels.experts.grouped.gmm` calls.

  Returns:
    ``(y, aux)``: ``y`` ``[tokens, d]`` in ``x``'s dtype; ``aux`` a dict of
    ``load_balancing_loss``, ``z_loss`` (f32 scalars, differentiable), ``expert_load``,
    ``group_sizes`` (int32 ``[experts]``) and ``dropped_fraction``.

  Sharded (under ``jit`` on a mesh, see :mod:`kernels.base.partition`): the tokens
  (``batch``) split locally, each device routing its own; ``aux`` is still the whole batch's
  (loads and group sizes summed, the mean router probabilities and ``z_loss`` averaged over
  the token shards, so the losses equal the single-device ones). With ``capacity_factor`` and
  split tokens the capacity applies per token shard (each device's tokens compete for its
  own :func:`expert_capacity`), as in GShard. A split ``experts`` dimension (of ``w_gate``,
  ``w_up`` and ``w_down``) runs expert parallelism
  (:func:`kernels.distributed.expert_parallel_moe`, dropless): the tokens are also split over
  the experts' axes (sliced locally if the batch is not already split there, and gathered
  back after), and the routed tokens travel to their experts' devices and back. A split ffn
  width (``mlp``: ``w_gate``/``w_up``'s last dim, ``w_down``'s middle one) gives partial
  outputs added by one ``psum`` (in ``x``'s dtype); a concatenated ``w_gate`` is then sliced
  on each device. ``d`` and the router never split.
  """
  _check_route_args(x, router_w, top_k, scoring, expert_bias, capacity_factor)
  _check_layer_args(x, router_w, w_gate, w_up, w_down, activation)
  operands = dict(x=x, router_w=router_w, w_gate=w_gate, w_up=w_up, w_down=w_down, expert_bias=expert_bias)
  dims = _moe_dims(w_up)
  split = partition.plan("moe", operands, dims, splits=_MOE_SPLITS)
  kw = dict(top_k=top_k, activation=activation, capacity_factor=capacity_factor, scoring=scoring,
            normalize_weights=normalize_weights, block_sizes=block_sizes, implementation=implementation,
            interpret=interpret)
  if split is not None:
    return _moe_sharded(split, operands, dims, **kw)
  y, r = _local_layer(x, router_w, w_gate, w_up, w_down, expert_bias=expert_bias, **kw)
  return y, _aux(r)


def _local_layer(x, router_w, w_gate, w_up, w_down, *, top_k, activation, capacity_factor, scoring,
                 normalize_weights, expert_bias, block_sizes, implementation, interpret):
  """The layer on one device: ``(y, routing)``."""
  r = route(x, router_w, top_k=top_k, scoring=scoring, normalize_weights=normalize_weights,
            expert_bias=expert_bias, capacity_factor=capacity_factor)
  w_gate_up = w_gate if w_up is None else jnp.concatenate([w_gate, w_up], axis=2)
  kw = dict(block_sizes=block_sizes, implementation=implementation, interpret=interpret)

  def mlp(xs, wgu, wd, activation):
    return _experts(xs, wgu, wd, r.group_sizes, activation, **kw)
  return _expert_layer(x, r, w_gate_up, w_down, activation, mlp), r


# ---------------------------------------------------------------------------------
# Sharded: one shard_map around the layer (kernels.base.partition)
# ---------------------------------------------------------------------------------

_MOE_SPLITS = {"batch": "local: routing is per token, the aux losses those of the whole batch",
               "experts": "expert parallelism (kernels.distributed.expert_parallel_moe: the routed tokens "
                          "exchanged by two all-to-alls)",
               "mlp": "local partial products, one psum"}


def _moe_dims(w_up):
  # The concatenated [experts, d, 2f] gate-and-up weight is never split along 2f (a shard would
  # hold gate columns only, or up columns only): with "mlp" split each device slices its columns.
  gate = ("experts", None, "mlp") if w_up is not None else ("experts", None, None)
  return dict(x=("batch", None), router_w=(None, None), w_gate=gate, w_up=("experts", None, "mlp"),
              w_down=("experts", "mlp", None), expert_bias=(None,))


def _moe_sharded(split, operands, dims, *, capacity_factor, scoring, **kw):
  """:func:`moe` on every device's shards (see :func:`moe`'s "Sharded")."""
  from kernels.experts.parallel import expert_parallel_layer, global_aux  # (it imports this module)
  tok, ex, mx = split.of("batch"), split.of("experts"), split.of("mlp")
  extra = tuple(a for a in ex if a not in tok)  # expert axes the tokens are not split over: split them there
  x = operands["x"]
  if ex and capacity_factor is not None:
    raise KernelError("capacity_factor", capacity_factor, "moe with its experts split (expert parallelism) is "
                      "dropless: capacity_factor must be None (or split only the tokens and the ffn width)")
  local_tokens = x.shape[0] // split.size("batch")
  sub = math.prod(split.mesh.shape[a] for a in extra)
  if local_tokens % sub:
    raise KernelError("x", x, f"moe: the {local_tokens} tokens on each device do not divide over the {sub} devices "
                              f"of the experts' axes {extra}, which expert parallelism splits them over")

  def local(x, router_w, w_gate, w_down, w_up=None, expert_bias=None):
    if w_up is None and mx:  # this device's gate and up columns of the concatenated weight
      f = w_gate.shape[2] // 2
      nm, j = partition.axis_position(mx)
      w_gate, w_up = (lax.dynamic_slice_in_dim(w_gate, o + j * (f // nm), f // nm, 2) for o in (0, f))
    if ex:
      if extra:  # these tokens are on every device of `extra`: each takes its part
        n, j = partition.axis_position(extra)
        x = lax.dynamic_slice_in_dim(x, j * (x.shape[0] // n), x.shape[0] // n, 0)
      y, r = expert_parallel_layer(x, router_w, w_gate, w_up, w_down, axis_name=ex, scoring=scoring,
                                   expert_bias=expert_bias, **kw)
      if extra:
        y = lax.all_gather(y, extra, axis=0, tiled=True)
    else:
      y, r = _local_layer(x, router_w, w_gate, w_up, w_down, capacity_factor=capacity_factor, scoring=scoring,
                          expert_bias=expert_bias, **kw)
    if mx:  # each device's part of the ffn width: partial outputs
      y = lax.psum(y, mx)
    token_axes = tuple(tok) + extra
    return [y, global_aux(x, router_w, r, scoring, token_axes) if token_axes else _aux(r)]

  aux_dims = {"load_balancing_loss": (), "z_loss": (), "expert_load": (None,), "group_sizes": (None,),
              "dropped_fraction": ()}
  y, aux = split.run(local, operands, dims, [("batch", None), aux_dims])
  return y, aux


def _expert_layer(x, r: Routing, w_gate_up, w_down, activation: str, mlp):
  """Permute, the experts, and the combine: the layer after routing. ``mlp(xs, w_gate_up,
  w_down, activation)`` runs the two grouped matmuls with the activation product between
  them (:func:`_experts`, or :func:`_mlp_of` around another grouped matmul, as
  ``tools/bench_moe.py`` runs it on megablox's)."""
  top_k = r.expert_ids.shape[1]
  xs = _dispatch(x, r.order, r.position, top_k)                                  # [tokens * top_k, d]
  ys = mlp(xs, w_gate_up.astype(x.dtype), w_down.astype(x.dtype), activation)   # [tokens * top_k, d]
  return _combine(ys, r.weights, r.order, r.position).astype(x.dtype)


def _aux(r: Routing) -> dict:
  n = r.expert_ids.size
  return {"load_balancing_loss": r.load_balancing_loss, "z_loss": r.z_loss, "expert_load": r.expert_load,
          "group_sizes": r.group_sizes, "dropped_fraction": 1.0 - jnp.sum(r.group_sizes) / n}


def moe_reference(x, router_w, w_gate, w_up, w_down, *, top_k: int, activation: str = "silu",
                  capacity_factor: float | None = None, scoring: str = "softmax", normalize_weights: bool = True,
                  expert_bias=None):
  """The same layer run densely: every expert on every token (f32, or f64 for f64 inputs, at
  the highest matmul precision), then each token's outputs weighted by its combine
  weights, zero for experts it did not choose or that dropped it. Same routing, same
  ``(y, aux)``."""
  _check_route_args(x, router_w, top_k, scoring, expert_bias, capacity_factor)
  _check_layer_args(x, router_w, w_gate, w_up, w_down, activation)
  r = route(x, router_w, top_k=top_k, scoring=scoring, normalize_weights=normalize_weights,
            expert_bias=expert_bias, capacity_factor=capacity_factor)
  acc = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
  if w_up is None:
    f = w_gate.shape[2] // 2
    w_gate, w_up = w_gate[:, :, :f], w_gate[:, :, f:]
  xf, wg, wu, wd = (a.astype(acc) for a in (x, w_gate, w_up, w_down))
  hi = lax.Precision.HIGHEST
  g = jnp.einsum("td,edf->etf", xf, wg, precision=hi)
  u = jnp.einsum("td,edf->etf", xf, wu, precision=hi)
  out = jnp.einsum("etf,efd->etd", ACTIVATIONS[activation](g) * u, wd, precision=hi)
  tokens, experts = x.shape[0], router_w.shape[1]
  dense_w = jnp.einsum("tk,tke->te", r.weights.astype(acc), jax.nn.one_hot(r.expert_ids, experts, dtype=acc))
  y = jnp.einsum("te,etd->td", dense_w, out, precision=hi).astype(x.dtype)
  return y, _aux(r)
