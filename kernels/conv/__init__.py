"""2-D convolution: direct implicit-GEMM kernels and fused Winograd (:mod:`~kernels.conv.api`, :mod:`~kernels.conv.winograd`)."""
from kernels.conv.api import (BlockSizes, WinogradFilter, conv2d, conv2d_reference, default_algorithm,
                              default_block_sizes, winograd_filter_transform)

__all__ = ["BlockSizes", "WinogradFilter", "conv2d", "conv2d_reference", "default_algorithm", "default_block_sizes",
           "winograd_filter_transform"]
