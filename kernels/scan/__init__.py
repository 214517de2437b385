"""Recurrences: the diagonal linear scan, Mamba-2's chunked SSD, and the parallel scan of a dense LTI system.

- :mod:`~kernels.scan.linear`: ``linear_scan``, ``h_t = a_t * h_{t-1} + b_t``.
- :mod:`~kernels.scan.chunked` (and :mod:`~kernels.scan.chunked_bwd`, its reverse pass): ``ssd`` and
  ``gated_linear_attention``, the chunked state-space duality.
- :mod:`~kernels.scan.parallel`: ``parallel_scan``, segments of a dense linear time-invariant system side by side.
"""
from kernels.scan.chunked import (BlockSizes as SsdBlockSizes, gated_linear_attention, gated_linear_attention_reference,
                                  ssd, ssd_chunked_xla, ssd_reference)
from kernels.scan.linear import BlockSizes as ScanBlockSizes, linear_scan, linear_scan_reference
from kernels.scan.parallel import parallel_scan, parallel_scan_reference

__all__ = ["ScanBlockSizes", "SsdBlockSizes", "gated_linear_attention", "gated_linear_attention_reference",
           "linear_scan", "linear_scan_reference", "parallel_scan", "parallel_scan_reference", "ssd", "ssd_chunked_xla",
           "ssd_reference"]
