"""Fourier transforms as butterflies on the VPU and DFT matmuls on the MXU, and the long convolution.

:mod:`~kernels.fourier.transforms` holds the transforms (``fft``, ``ifft``, ``rfft``, ``irfft`` and
the 2-D ones); :mod:`~kernels.fourier.long_conv` builds ``fft_conv`` on them (one way: the
transforms do not import the convolution); :mod:`~kernels.fourier.sharded` is how the transforms
partition themselves on a device mesh (the pencil decomposition for a split transformed axis).
"""
from kernels.fourier.long_conv import fft_conv, fft_conv_fuses, fft_conv_reference
from kernels.fourier.transforms import fft, fft2, ifft, ifft2, irfft, irfft2, rfft, rfft2

__all__ = ["fft", "fft2", "fft_conv", "fft_conv_fuses", "fft_conv_reference", "ifft", "ifft2", "irfft", "irfft2",
           "rfft", "rfft2"]
