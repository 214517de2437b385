"""Mixture of experts: the grouped matmul, routing and the whole MoE feed-forward layer.

Read :mod:`~kernels.experts.grouped` (``gmm``/``tgmm``: the public functions, plans and custom VJP),
:mod:`~kernels.experts.grouped_kernels` (the Pallas kernels, the fused activation epilogues
included), then :mod:`~kernels.experts.layer` (``route`` and ``moe``).
"""
from kernels.experts.grouped import GmmBlockSizes, gmm, gmm_reference, tgmm, tgmm_reference
from kernels.experts.layer import Routing, expert_capacity, moe, moe_reference, route

__all__ = ["GmmBlockSizes", "Routing", "expert_capacity", "gmm", "gmm_reference", "moe", "moe_reference", "route",
           "tgmm", "tgmm_reference"]
