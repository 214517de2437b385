"""Pallas TPU kernels, their pure-JAX references, and the tools to check and time them.

The API is flat: ``kernels.flash_attention``, ``kernels.matmul``, ``kernels.moe`` and so on
(``kernels.__all__``), plus the multi-chip kernels in ``kernels.distributed``. Inside, the
package is layered, and the folders say how:

- ``base/``: errors, hardware, dispatch, tiling, roofline, process setup. Imports nothing of ours.
- ``perf/``: the measuring instrument (AOT compile, cost-model estimates, byte counting, pieces,
  timing, the ICI model, figure style). Imports only ``base``; only notebooks, tools and tests
  import it. Its public names are re-exported here, loaded on first use.
- one folder per kernel family: ``gemm/``, ``norm/``, ``attention/`` (with RoPE), ``scan/``
  (linear scan, SSD, parallel scan), ``fourier/`` (FFT, long convolution), ``conv/``,
  ``experts/`` (grouped matmul, routing, MoE). A family imports ``base``, its own modules, and
  other families' public APIs (their package ``__init__``).
- ``distributed/``: the multi-chip kernels, built from the families.

No module or folder is named like a public function, so ``import kernels.experts.grouped as gm``
always binds a module. ``tests/test_layout.py`` enforces these rules.

``import kernels`` first prepares the process for the TPU compiler's cost model
(see :mod:`kernels.base.env`); import it before JAX initialises a backend.
"""
import importlib as _importlib

from kernels.base import env as _env  # noqa: F401  (must run before libtpu loads)
from kernels.base.backend import dispatch, target_chip
from kernels.base.errors import (CompileError, EstimatorUnavailableError, KernelError, NoImplementationError,
                                 TilingError, VmemOverflowError)
from kernels.base.partition import sharding
from kernels.base.hardware import CHIPS, TPU_GENERATIONS, Chip, detect, get_chip
from kernels.base.roofline import Roofline, matmul_cost, roofline as roofline_of
from kernels.gemm import BlockSizes, matmul, matmul_reference, quantized_matmul
from kernels.attention import (BlockSizes as AttentionBlockSizes, RopeBlockSizes, RopeScaling, RotaryEmbedding,
                               attention_reference, flash_attention, rope, rope_reference, rope_table)
from kernels.norm import layer_norm, layer_norm_reference, rms_norm, rms_norm_reference
from kernels.scan import (ScanBlockSizes, SsdBlockSizes, gated_linear_attention, gated_linear_attention_reference,
                          linear_scan, linear_scan_reference, parallel_scan, parallel_scan_reference, ssd,
                          ssd_chunked_xla, ssd_reference)
from kernels.experts import (GmmBlockSizes, Routing, expert_capacity, gmm, gmm_reference, moe, moe_reference, route,
                             tgmm, tgmm_reference)
from kernels.conv import (BlockSizes as ConvBlockSizes, WinogradFilter, conv2d, conv2d_reference,
                          default_algorithm as conv2d_default_algorithm, winograd_filter_transform)
from kernels.fourier import fft, fft2, fft_conv, fft_conv_reference, ifft, ifft2, irfft, irfft2, rfft, rfft2
from kernels import distributed  # noqa: F401  (kernels.distributed.ring_attention works after `import kernels`)

__version__ = "0.1.0"

# The instrument (kernels.perf), loaded on first use: a kernel never needs it.
_PERF = {"Estimate": "tpu", "TpuCompilation": "tpu", "compile_for_tpu": "tpu", "estimate_tpu": "tpu",
         "estimate_tpu_pieces": "tpu", "estimator_available": "tpu", "hbm_traffic": "tpu",
         "Measurement": "timing", "benchmark": "timing"}
# Module paths from before the package had folders (kernels.tpu.estimate_tpu still works).
_MOVED = {"errors": "base.errors", "hardware": "base.hardware", "backend": "base.backend", "tiling": "base.tiling",
          "roofline": "base.roofline", "tpu": "perf.tpu", "traffic": "perf.traffic", "timing": "perf.timing",
          "style": "perf.style", "ici": "perf.ici", "perf": "perf", "base": "base"}


def __getattr__(name):
  if name in _PERF:
    return getattr(_importlib.import_module(f"kernels.perf.{_PERF[name]}"), name)
  if name in _MOVED:
    return _importlib.import_module(f"kernels.{_MOVED[name]}")
  raise AttributeError(f"module 'kernels' has no attribute {name!r}")


def __dir__():
  return sorted(set(globals()) | set(_PERF) | set(_MOVED))


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
    "matmul_cost", "roofline_of", "sharding", "target_chip",
]
