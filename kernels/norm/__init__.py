"""Layer norm and RMS norm, with a fused residual add: kernels that only move bytes (:mod:`~kernels.norm.api`)."""
from kernels.norm.api import (BlockSizes, default_block_sizes, layer_norm, layer_norm_reference, rms_norm,
                              rms_norm_reference)

__all__ = ["BlockSizes", "default_block_sizes", "layer_norm", "layer_norm_reference", "rms_norm", "rms_norm_reference"]
