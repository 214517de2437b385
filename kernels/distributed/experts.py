"""Expert-parallel MoE: the token exchange around each chip's experts (see :mod:`kernels.distributed`).

The computation lives in the experts family (:mod:`kernels.experts.parallel`), whose
:func:`kernels.moe` runs it itself when its experts are split under ``jit`` on a mesh; this is its
entry point for a user's own ``shard_map``.
"""
from __future__ import annotations

from kernels.experts import parallel as _parallel

# ---------------------------------------------------------------------------------
# Expert-parallel MoE
# ---------------------------------------------------------------------------------


def expert_parallel_moe(x, router_w, w_gate, w_up, w_down, *, axis_name, top_k: int, activation: str = "silu",
                        scoring: str = "softmax", normalize_weights: bool = True, expert_bias=None,
                        block_sizes=None, implementation=None, interpret=None):
  """:func:`kernels.moe` (dropless) with the tokens and the experts sharded over ``axis_name``.

  Args:
    x: the local ``[tokens_local, d]`` tokens.
    router_w: ``[d, experts]``, the same on every device.
    w_gate, w_up, w_down: the local experts' weights, ``[experts / n, d, f]`` (or ``w_up=None`` and
      ``w_gate`` the concatenated ``[experts / n, d, 2f]``) and ``[experts / n, f, d]``: device ``p``
      holds experts ``p * experts / n`` onwards.
    axis_name: the mesh axis that splits the tokens and the experts, or a tuple of them (major first).
    top_k, activation, scoring, normalize_weights, expert_bias: as :func:`kernels.moe`.
    block_sizes, implementation, interpret: passed to both grouped matmuls (gate and up with the
      activation product, as in :func:`kernels.moe`, then down).

  Returns:
    ``(y, aux)``: the local ``[tokens_local, d]`` output and :func:`kernels.moe`'s ``aux`` for the whole
    batch (every device gets the same losses, loads and group sizes).
  """
  return _parallel.expert_parallel_moe(
      x, router_w, w_gate, w_up, w_down, axis_name=axis_name, top_k=top_k, activation=activation, scoring=scoring,
      normalize_weights=normalize_weights, expert_bias=expert_bias, block_sizes=block_sizes,
      implementation=implementation, interpret=interpret)
