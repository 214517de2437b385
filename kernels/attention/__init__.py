"""Flash attention and rotary position embeddings.

Read :mod:`~kernels.attention.api` first (the public function, its reference and the custom VJP),
then :mod:`~kernels.attention.plan` (grids, masks, block sizes), :mod:`~kernels.attention.forward`
and :mod:`~kernels.attention.backward` (the kernels). :mod:`~kernels.attention.rotary` is RoPE,
standalone or fused into attention's kernels.
"""
from kernels.attention.api import BlockSizes, attention_reference, default_block_sizes, flash_attention
from kernels.attention.rotary import (BlockSizes as RopeBlockSizes, RopeScaling, RotaryEmbedding, rope, rope_reference,
                                      rope_table)

__all__ = ["BlockSizes", "RopeBlockSizes", "RopeScaling", "RotaryEmbedding", "attention_reference",
           "default_block_sizes", "flash_attention", "rope", "rope_reference", "rope_table"]
