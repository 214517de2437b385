"""Pallas TPU kernels, their pure-JAX references, and the tools to check and time them.

``import kernels`` first prepares the process for the TPU compiler's cost model
(see :mod:`kernels._env`); import it before JAX initialises a backend.
"""
from kernels import _env  # noqa: F401  (must run before libtpu loads)
from kernels import backend, errors, hardware, roofline, style, tiling, timing, tpu, traffic
from kernels.backend import dispatch, target_chip
from kernels.errors import (CompileError, EstimatorUnavailableError, KernelError, NoImplementationError,
                            TilingError, VmemOverflowError)
from kernels.matmul import BlockSizes, matmul, matmul_reference, quantized_matmul
from kernels.attention import BlockSizes as AttentionBlockSizes, attention_reference, flash_attention
from kernels.norm import layer_norm, layer_norm_reference, rms_norm, rms_norm_reference
from kernels.scan import BlockSizes as ScanBlockSizes, linear_scan, linear_scan_reference
from kernels.rope import BlockSizes as RopeBlockSizes, RopeScaling, RotaryEmbedding, rope, rope_reference, rope_table
from kernels.ssd import (BlockSizes as SsdBlockSizes, gated_linear_attention, gated_linear_attention_reference,
                         ssd, ssd_chunked_xla, ssd_reference)
from kernels.parallel_scan import parallel_scan, parallel_scan_reference  # (the names shadow the module: see it)
from kernels.gmm import GmmBlockSizes, gmm, gmm_reference, tgmm, tgmm_reference
from kernels.moe import Routing, expert_capacity, moe, moe_reference, route
from kernels.conv import (BlockSizes as ConvBlockSizes, WinogradFilter, conv2d, conv2d_reference,
                          default_algorithm as conv2d_default_algorithm,
                          winograd_filter_transform)
from kernels.fft import fft, fft2, fft_conv, fft_conv_reference, ifft, ifft2, irfft, irfft2, rfft, rfft2
from kernels.hardware import CHIPS, TPU_GENERATIONS, Chip, detect, get_chip
from kernels.roofline import Roofline, matmul_cost, roofline as roofline_of
from kernels.timing import Measurement, benchmark
from kernels.tpu import Estimate, TpuCompilation, compile_for_tpu, estimate_tpu, estimate_tpu_pieces, estimator_available, hbm_traffic

__version__ = "0.1.0"

__all__ = [
    "BlockSizes", "matmul", "matmul_reference", "quantized_matmul",
    "AttentionBlockSizes", "attention_reference", "flash_attention",
    "layer_norm", "layer_norm_reference", "rms_norm", "rms_norm_reference",
    "ScanBlockSizes", "linear_scan", "linear_scan_reference",
    "RopeBlockSizes", "RopeScaling", "RotaryEmbedding", "rope", "rope_reference", "rope_table",
    "SsdBlockSizes", "gated_linear_attention", "gated_linear_attention_reference", "ssd", "ssd_chunked_xla",
    "ssd_reference",
    "parallel_scan", "parallel_scan_reference",
    "GmmBlockSizes", "gmm", "gmm_reference", "tgmm", "tgmm_reference",
    "Routing", "expert_capacity", "moe", "moe_reference", "route",
    "ConvBlockSizes", "WinogradFilter", "conv2d", "conv2d_default_algorithm", "conv2d_reference",
    "winograd_filter_transform",
    "fft", "fft2", "fft_conv", "fft_conv_reference", "ifft", "ifft2", "irfft", "irfft2", "rfft", "rfft2",
    "CHIPS", "TPU_GENERATIONS", "Chip", "CompileError", "Estimate", "EstimatorUnavailableError", "KernelError",
    "Measurement", "NoImplementationError", "Roofline", "TilingError", "TpuCompilation", "VmemOverflowError",
    "benchmark", "compile_for_tpu", "detect", "dispatch", "estimate_tpu", "estimate_tpu_pieces", "estimator_available", "get_chip",
    "hbm_traffic",
    "matmul_cost", "roofline_of", "target_chip",
]
