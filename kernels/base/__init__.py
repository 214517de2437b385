"""The shared mechanics every kernel stands on; imports nothing else of this package.

- :mod:`~kernels.base.env`: process setup before libtpu loads (the cost model's dump flag).
- :mod:`~kernels.base.errors`: :class:`~kernels.base.errors.KernelError` and its kinds, and ``check``.
- :mod:`~kernels.base.hardware`: the TPU generations' numbers (VMEM, MXU, HBM, ICI).
- :mod:`~kernels.base.backend`: ``dispatch``, the choice between Mosaic, interpret mode and XLA.
- :mod:`~kernels.base.tiling`: block shapes, the (8, 128) rule, VMEM budgets, tuned data files.
- :mod:`~kernels.base.roofline`: FLOPs, bytes and the roofline bound.
"""
