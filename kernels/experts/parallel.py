"""Expert-parallel MoE: the token exchange around each device's experts (see :mod:`kernels.distributed`).

It lives in the experts family, not in :mod:`kernels.distributed`, because :func:`kernels.moe` runs it
itself when its experts are split under ``jit`` on a mesh (:mod:`kernels.base.partition`), and a
family may not import ``kernels.distributed``; :func:`kernels.distributed.expert_parallel_moe` is its
entry point for a user's own ``shard_map``. ``axis_name`` may be one mesh axis or a tuple of them.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kernels.base.backend import check_implementation
from kernels.base.errors import check
from kernels.base.partition import axis_position
from kernels.experts.layer import _check_layer_args, _check_route_args, _combine, _dispatch, _experts, route

# ---------------------------------------------------------------------------------
# Expert-parallel MoE
# ---------------------------------------------------------------------------------


def _exchange_dense(x, in_off, send, out_off, recv, out_rows, axis_name, n):
  """``lax.ragged_all_to_all``'s result, by a dense ``all_to_all`` of per-destination blocks padded to
  ``x``'s row count (XLA:CPU has no ragged all-to-all)."""
  rows = x.shape[0]
  idx = in_off[:, None] + jnp.arange(rows)[None, :]                            # [n, rows]
  blocks = jnp.where((jnp.arange(rows)[None, :] < send[:, None])[..., None], x[jnp.clip(idx, 0, rows - 1)], 0)
  got = lax.all_to_all(blocks, axis_name, 0, 0, tiled=True)                    # [n (source), rows, d]
  offs = lax.all_to_all(out_off, axis_name, 0, 0, tiled=True)                  # where each source's rows go
  dest = offs[:, None] + jnp.arange(rows)[None, :]
  dest = jnp.where(jnp.arange(rows)[None, :] < recv[:, None], dest, out_rows)  # the padding: out of range
  out = jnp.zeros((out_rows,) + x.shape[1:], x.dtype)
  return out.at[dest.reshape(-1)].set(got.reshape((-1,) + x.shape[1:]), mode="drop")


def _exchange_impl(x, in_off, send, out_off, recv, out_rows, axis_name, n):
  def ragged(x, in_off, send, out_off, recv):
    out = jnp.zeros((out_rows,) + x.shape[1:], x.dtype)
    return lax.ragged_all_to_all(x, out, in_off, send, out_off, recv, axis_name=axis_name)
  dense = functools.partial(_exchange_dense, out_rows=out_rows, axis_name=axis_name, n=n)
  return lax.platform_dependent(x, in_off, send, out_off, recv, tpu=ragged, default=dense)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _exchange(x, fwd_offsets, bwd_offsets, out_rows, back_rows, axis_name, n):
  """Rows of ``x`` to other devices (``fwd_offsets = (in_off, send, out_off, recv)``); its transpose
  is the reverse exchange (``bwd_offsets``)."""
  return _exchange_impl(x, *fwd_offsets, out_rows, axis_name, n)


def _exchange_fwd(x, fwd_offsets, bwd_offsets, out_rows, back_rows, axis_name, n):
  return _exchange(x, fwd_offsets, bwd_offsets, out_rows, back_rows, axis_name, n), bwd_offsets


def _exchange_bwd(out_rows, back_rows, axis_name, n, bwd_offsets, g):
  zeros = jax.tree.map(lambda a: np.zeros(a.shape, jax.dtypes.float0), bwd_offsets)
  return _exchange_impl(g, *bwd_offsets, back_rows, axis_name, n), zeros, zeros


_exchange.defvjp(_exchange_fwd, _exchange_bwd)


def _excl_cumsum(x):
  return jnp.cumsum(x) - x


def expert_parallel_moe(x, router_w, w_gate, w_up, w_down, *, axis_name, top_k: int, activation: str = "silu",
                        scoring: str = "softmax", normalize_weights: bool = True, expert_bias=None,
                        block_sizes=None, implementation=None, interpret=None):
  """:func:`kernels.moe` (dropless) with the tokens and the experts sharded over ``axis_name``
  (see :func:`kernels.distributed.expert_parallel_moe`)."""
  y, r = expert_parallel_layer(x, router_w, w_gate, w_up, w_down, axis_name=axis_name, top_k=top_k,
                               activation=activation, scoring=scoring, normalize_weights=normalize_weights,
                               expert_bias=expert_bias, block_sizes=block_sizes, implementation=implementation,
                               interpret=interpret)
  return y, global_aux(x, router_w, r, scoring, axis_name)


def expert_parallel_layer(x, router_w, w_gate, w_up, w_down, *, axis_name, top_k: int, activation: str = "silu",
                          scoring: str = "softmax", normalize_weights: bool = True, expert_bias=None,
                          block_sizes=None, implementation=None, interpret=None):
  """:func:`expert_parallel_moe`'s output and this device's :class:`~kernels.experts.layer.Routing`
  (its ``aux`` is :func:`global_aux` of the routing, over the axes that split the tokens).
  Arguments as :func:`kernels.distributed.expert_parallel_moe`.
  """
  _check_route_args(x, router_w, top_k, scoring, expert_bias, None)
  n, i = axis_position(axis_name)
  experts = router_w.shape[1]
  check(experts % n == 0, "router_w", router_w, f"its {experts} experts must divide evenly over the {n} devices "
        f"of {axis_name!r}")
  el = experts // n
  check(getattr(w_gate, "ndim", None) == 3 and w_gate.shape[0] == el, "w_gate", w_gate,
        f"must hold this device's {el} experts in dim 0 ([experts / n, d, f])")
  full = lambda w: None if w is None else jax.ShapeDtypeStruct((experts,) + w.shape[1:], w.dtype)  # noqa: E731
  _check_layer_args(x, router_w, full(w_gate), full(w_up), full(w_down), activation)
  check_implementation(implementation, interpret)

  tokens = x.shape[0]
  r = route(x, router_w, top_k=top_k, scoring=scoring, normalize_weights=normalize_weights,
            expert_bias=expert_bias)
  xs = _dispatch(x, r.order, r.position, top_k)                          # [tokens * top_k, d], by expert
  sizes = lax.all_gather(r.group_sizes, axis_name)                        # [n (source), experts]
  per_dev = sizes.reshape(n, n, el).sum(-1)                               # [source, destination] rows
  send, recv = per_dev[i], per_dev[:, i]
  # where my rows for device p land in p's buffer: after the rows of the sources before me
  out_off = jnp.sum(jnp.where(jnp.arange(n)[:, None] < i, per_dev, 0), axis=0)
  in_off, recv_off = _excl_cumsum(send), _excl_cumsum(recv)
  back_off = jnp.sum(jnp.where(jnp.arange(n)[None, :] < i, per_dev, 0), axis=1)  # my rows' place at each source
  rows = n * tokens * min(top_k, el)                                      # the worst case any device receives
  fwd = (in_off, send, out_off, recv)
  bwd = (recv_off, recv, back_off, send)
  buf = _exchange(xs, fwd, bwd, rows, tokens * top_k, axis_name, n)   # by (source, local expert)

  # Sort the received rows by local expert (sources in order within an expert).
  mine = lax.dynamic_slice_in_dim(sizes, i * el, el, axis=1)               # [source, local expert]
  bounds = jnp.cumsum(mine.reshape(-1))                                    # segment ends, (source, expert) order
  seg = jnp.searchsorted(bounds, jnp.arange(rows), side="right")
  expert_of_row = jnp.where(seg < n * el, seg % el, el)                   # the padding after every expert
  a = jnp.arange(rows, dtype=jnp.int32)
  _, perm = lax.sort((expert_of_row.astype(jnp.int32), a), num_keys=1, is_stable=True)
  _, inv = lax.sort((perm, a), num_keys=1)
  local_sizes = mine.sum(0).astype(jnp.int32)

  w_gate_up = w_gate if w_up is None else jnp.concatenate([w_gate, w_up], axis=2)
  kw = dict(block_sizes=block_sizes, implementation=implementation, interpret=interpret)
  # the experts as in kernels.moe: the activation product and its backward inside the grouped matmuls
  ys = _experts(buf[perm], w_gate_up.astype(x.dtype), w_down.astype(x.dtype), local_sizes, activation,
                **kw)[inv]                                                # back to (source, expert) order
  back = _exchange(ys, bwd, fwd, tokens * top_k, rows, axis_name, n)  # my rows, by expert
  y = _combine(back, r.weights, r.order, r.position).astype(x.dtype)
  return y, r


def global_aux(x, router_w, r, scoring, axis_name):
  """:func:`kernels.moe`'s ``aux`` of the whole batch, from every device's routing ``r`` of its
  own tokens (``axis_name``: the mesh axes that split the tokens, a name or a tuple)."""
  acc = jnp.float32
  logits = jnp.dot(x, router_w, preferred_element_type=acc).astype(acc)
  probs = jax.nn.softmax(logits, axis=-1) if scoring == "softmax" else jax.nn.sigmoid(logits)
  probs = probs if scoring == "softmax" else probs / jnp.sum(probs, axis=-1, keepdims=True)
  load = lax.psum(r.expert_load, axis_name)
  group_sizes = lax.psum(r.group_sizes, axis_name)
  n_assign = lax.psum(r.expert_ids.size, axis_name)
  mean_p = lax.pmean(jnp.mean(probs, axis=0), axis_name)
  experts = router_w.shape[1]
  lb = experts * jnp.sum(load.astype(acc) / n_assign * mean_p)
  z = lax.pmean(r.z_loss, axis_name)
  return {"load_balancing_loss": lb, "z_loss": z, "expert_load": load, "group_sizes": group_sizes,
          "dropped_fraction": 1.0 - jnp.sum(group_sizes) / n_assign}


