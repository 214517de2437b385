"""GEMM on the MXU: ``matmul`` with a fused epilogue, and ``quantized_matmul``.

Read :mod:`~kernels.gemm.api` (the kernel, its reference and the public functions), then
:mod:`~kernels.gemm.plan` (block sizes, shape classes and grid plans, from the tuned data).
The epilogue's activation and the dropout hash are shared with attention and convolution.
"""
from kernels.gemm.api import (ACTIVATIONS, BlockSizes, apply_activation, default_block_sizes, dropout_keep_mask,
                              dropout_seed, matmul, matmul_reference, quantized_matmul, quantized_matmul_reference)

__all__ = ["ACTIVATIONS", "BlockSizes", "apply_activation", "default_block_sizes", "dropout_keep_mask", "dropout_seed",
           "matmul", "matmul_reference", "quantized_matmul", "quantized_matmul_reference"]
