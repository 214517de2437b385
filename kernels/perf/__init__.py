"""The measuring instrument: compile for TPU ahead of time, estimate, count bytes, time, price collectives.

Only notebooks, tools and tests import this package; no kernel does (``tests/test_layout.py``).

- :mod:`~kernels.perf.tpu`: ``compile_for_tpu``, ``estimate_tpu`` (the floored estimate),
  ``estimate_tpu_pieces``, ``hbm_traffic``.
- :mod:`~kernels.perf.traffic`: the HBM byte counter (Pallas grids walked block by block, XLA ops from HLO).
- :mod:`~kernels.perf.pieces`: a program cut at its Pallas kernels, for estimates of big programs.
- :mod:`~kernels.perf.compile_worker`: the subprocess that compiles one program at a time.
- :mod:`~kernels.perf.timing`: wall-clock ``benchmark`` on a real device.
- :mod:`~kernels.perf.ici`: the inter-chip link model for collectives.
- :mod:`~kernels.perf.style`: one colour and marker per implementation, for every figure.
"""
from kernels.perf import ici, pieces, style, timing, tpu, traffic  # noqa: F401
from kernels.perf.timing import Measurement, benchmark
from kernels.perf.tpu import (Estimate, TpuCompilation, compile_for_tpu, estimate_tpu, estimate_tpu_pieces,
                              estimator_available, hbm_traffic)

__all__ = ["Estimate", "Measurement", "TpuCompilation", "benchmark", "compile_for_tpu", "estimate_tpu",
           "estimate_tpu_pieces", "estimator_available", "hbm_traffic"]
