"""The Fourier transforms on a device mesh (issue 56): how ``fft`` and friends partition themselves.

Every public transform (:func:`~kernels.fourier.transforms.fft`, ``ifft``, ``rfft``, ``irfft``,
``fft2``, ``ifft2``, ``rfft2``, ``irfft2``) is wrapped by :func:`partitioned`, which calls
:func:`kernels.base.partition.plan` and, when the operands are split, runs the transform once per
device inside one ``shard_map``. Logical dimension names:

- the dimensions that are *not* transformed: :func:`~kernels.base.partition.leading_dims` over them,
  in order (``batch``, ``batch1``, ..., ``seq``). Split: purely local, no collective.
- the transformed axis: ``"fft"``; for the 2-D (n-D) transforms ``axes[0]`` is ``"fft"`` and
  ``axes[i]`` is ``"fft{i}"`` (``"fft1"`` for the second).

*A split transformed axis: the pencil decomposition* (Lu et al., "Large-scale discrete Fourier
transform on TPUs"). Each device holds ``[M, N / k]`` (``M`` rows: every other dimension, local
shares included; ``k`` devices along the axis). One ``all_to_all`` swaps which axis is split:
each device then holds full-length rows, ``[M / k, N]``; the single-device kernel transforms them;
a second ``all_to_all`` puts the split back on the transformed axis. Two collectives, each moving
``(k - 1) / k`` of the data once, and the output is split exactly like the input (natural
frequency order). For the 2-D transforms the same happens per axis: an unsplit axis is
transformed locally (the other axes are its rows), a split one by the pencil, so a slab-split
``fft2`` (``axes[0]`` split) costs one local transform and two all-to-alls.

*Too few rows* (``M`` not a multiple of ``k``, e.g. one long signal): the four-step (Cooley-Tukey)
decomposition ``N = N1 * N2`` with ``k`` dividing both. Index ``n = N2 n1 + n2``: a device's
contiguous block is a slice of ``n1``. All-to-all so each device holds every ``n1`` of a slice of
``n2``, ``N1``-point transforms, the twiddle ``W_N^(n2 k1)``, all-to-all to every ``n2`` of a slice
of ``k1``, ``N2``-point transforms, and a third all-to-all (plus a local transpose) back to the
natural order, split like the input. It needs ``k^2`` to divide ``N`` (else a KernelError).

Not supported (a :class:`~kernels.base.errors.KernelError` that says so): ``n`` (or ``s``) other
than the axis' own length when that axis is split (pad or truncate before sharding it);
``rfft``'s split output axis (``n // 2 + 1`` frequencies do not split evenly: transform
``(x, zeros)`` with ``fft``, whose output keeps the split) and ``irfft``'s split input axis.
"""
from __future__ import annotations

import functools
import inspect
import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from kernels.base import partition
from kernels.base.errors import KernelError

_OPS = {  # name -> (inverse, real-in (rfft), real-out (irfft), 2-D)
    "fft": (False, False, False, False), "ifft": (True, False, False, False),
    "rfft": (False, True, False, False), "irfft": (True, False, True, False),
    "fft2": (False, False, False, True), "ifft2": (True, False, False, True),
    "rfft2": (False, True, False, True), "irfft2": (True, False, True, True),
}
PENCIL = "all-to-all transposes (pencil decomposition)"


def _is_array(x) -> bool:
  return hasattr(x, "shape") and hasattr(x, "dtype")


def _operands(x):
  """The arrays of ``x`` (a complex or real array, or a (real, imag) pair) by the name errors use."""
  if isinstance(x, (tuple, list)):
    if len(x) == 2 and all(_is_array(v) for v in x) and tuple(x[0].shape) == tuple(x[1].shape):
      return {"x[0]": x[0], "x[1]": x[1]}
    return None
  return {"x": x} if _is_array(x) else None


def _names(ndim: int, transformed: dict[int, str]) -> tuple:
  lead = iter(partition.leading_dims(ndim - len(transformed)))
  return tuple(transformed[d] if d in transformed else next(lead) for d in range(ndim))


def _axis_name(i: int) -> str:
  return "fft" if i == 0 else f"fft{i}"


def partitioned(op: str):
  """Wraps the public transform ``op``: :func:`~kernels.base.partition.plan`, and a local function
  (the transform itself, or the pencil for a split transformed axis) run in one ``shard_map``."""
  _, real_in, real_out, two_d = _OPS[op]

  def deco(f):
    sig = inspect.signature(f)

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
      try:
        bound = sig.bind(*args, **kwargs)
      except TypeError:
        return f(*args, **kwargs)
      bound.apply_defaults()
      a = bound.arguments
      x, norm = a["x"], a["norm"]
      kw = dict(precision=a["precision"], implementation=a["implementation"], interpret=a["interpret"])
      operands = _operands(x)
      if operands is None:
        return f(*args, **kwargs)  # malformed: the transform's own validation says why
      ndim = len(next(iter(operands.values())).shape)
      if two_d:
        axes, sizes = a["axes"], a["s"]
        if axes is None:
          axes = tuple(range(-len(sizes), 0)) if isinstance(sizes, (tuple, list)) else (-2, -1)
        if not (isinstance(axes, (tuple, list)) and all(isinstance(v, int) and not isinstance(v, bool)
                                                        and -ndim <= v < ndim for v in axes)
                and len({v % ndim for v in axes}) == len(axes)):
          return f(*args, **kwargs)
        axes = tuple(v % ndim for v in axes)
        if sizes is not None and not (isinstance(sizes, (tuple, list)) and len(sizes) == len(axes)):
          return f(*args, **kwargs)
        sizes = tuple(sizes) if sizes is not None else (None,) * len(axes)
      else:
        axis = a["axis"]
        if not (isinstance(axis, int) and not isinstance(axis, bool) and -ndim <= axis < ndim):
          return f(*args, **kwargs)
        axes, sizes = (axis % ndim,), (a["n"],)
      names = {ax: _axis_name(i) for i, ax in enumerate(axes)}
      dims = _names(ndim, names)
      # rfft's output axis / irfft's input axis (the last transformed one) holds n // 2 + 1 frequencies
      halved = axes[-1] if (real_in or real_out) else None
      splits = {d: "local" for d in dims if d not in names.values()}
      splits.update({nm: PENCIL for ax, nm in names.items() if ax != halved})
      try:
        split = partition.plan(op, operands, {k: dims for k in operands}, splits=splits)
      except KernelError as e:
        if halved is not None and f"{names[halved]!r} dimension" in str(e):
          raise KernelError(e.argument, e.value, message=f"{e} ({op}'s {'output' if real_in else 'input'} along "
                            f"that axis holds n // 2 + 1 frequencies, which do not split evenly: transform "
                            f"(x, zeros) with fft / take the real part of ifft, which keep the split)") from e
        raise
      if split is None:
        return f(*args, **kwargs)
      for ax, nm in names.items():
        if split.of(nm):
          want = next(iter(operands.values())).shape[ax]
          size = sizes[axes.index(ax)]
          if size is not None and size != want:
            raise KernelError("s" if two_d else "n", size, f"{op}: the transformed axis {ax} is split over "
                              f"{split.of(nm)}, so the length must be the axis' own ({want}): pad or truncate "
                              "before sharding it")
      pairs = len(operands) == 2

      def local(**ops):
        v = (ops["x[0]"], ops["x[1]"]) if pairs else ops["x"]
        if not any(split.of(nm) for nm in names.values()):
          out = f(**dict(bound.arguments, x=v))
        else:
          out = _split_transform(op, v, axes, sizes, [split.of(names[ax]) for ax in axes],
                                 [split.size(names[ax]) for ax in axes], norm, kw)
        return list(out) if isinstance(out, tuple) else out

      out_planes = pairs and not real_out
      out = split.run(local, operands, {k: dims for k in operands}, [dims, dims] if out_planes else dims)
      return tuple(out) if out_planes else out

    return wrapper

  return deco


def _split_transform(op, v, axes, sizes, mesh_axes, ks, norm, kw):
  """``op`` inside the shard_map: the transforms along ``axes`` one at a time, as the single-device
  function orders them, each local or (split axis) the pencil / four-step."""
  from kernels.fourier import transforms as T
  inverse = _OPS[op][0]
  if op in ("fft", "ifft", "fft2", "ifft2"):
    steps = [(ax, n, "ifft" if inverse else "fft") for ax, n in zip(axes, sizes)][::-1]
  elif op in ("rfft", "rfft2"):
    steps = [(axes[-1], sizes[-1], "rfft")] + [(ax, n, "fft") for ax, n in zip(axes[:-1], sizes[:-1])][::-1]
  else:  # irfft, irfft2
    if isinstance(v, tuple):
      v = lax.complex(v[0].astype(jnp.float32), v[1].astype(jnp.float32))
    steps = [(ax, n, "ifft") for ax, n in zip(axes[:-1], sizes[:-1])] + [(axes[-1], sizes[-1], "irfft")]
  split_of = dict(zip(axes, zip(mesh_axes, ks)))
  for ax, n, name in steps:
    fn = getattr(T, name)
    names, k = split_of[ax]
    if not names:
      v = fn(v, n, ax, norm, **kw)
    else:  # only fft / ifft reach here: rfft's and irfft's halved axis cannot be split (plan refused)
      v = distributed(v, ax, names, k, inverse=name == "ifft", norm=norm, kw=kw)
  return v


# --- the distributed 1-D transform, inside the shard_map --------------------------------------------


def _map(v, fn):
  return tuple(fn(a) for a in v) if isinstance(v, tuple) else fn(v)


def _all_to_all(v, names, split_axis, concat_axis):
  """One ``all_to_all`` for an array or both planes of a pair (stacked: one collective)."""
  if isinstance(v, tuple):
    s = lax.all_to_all(jnp.stack(v), names, split_axis + 1, concat_axis + 1, tiled=True)
    return s[0], s[1]
  return lax.all_to_all(v, names, split_axis, concat_axis, tiled=True)


def distributed(v, axis: int, names: tuple, k: int, *, inverse: bool, norm, kw):
  """The 1-D (i)fft along ``axis`` of local shards ``v`` (an array or a plane pair) whose axis is
  split over mesh axes ``names`` (``k`` devices): the pencil when the other dimensions' rows divide by
  ``k``, else the four-step decomposition. The result is split like the input."""
  from kernels.fourier import transforms as T
  fn = T.ifft if inverse else T.fft
  first = v[0] if isinstance(v, tuple) else v
  lead = first.shape[:axis] + first.shape[axis + 1:]
  rows, length = math.prod(lead), first.shape[axis]
  v = _map(v, lambda a: jnp.moveaxis(a, axis, -1).reshape(rows, length))
  joined = not isinstance(v, tuple) and jnp.iscomplexobj(v)
  if joined:  # XLA splits a complex collective into two: move (real, imag) planes, stacked, in one
    v = (jnp.real(v), jnp.imag(v))
  if rows % k == 0:  # the pencil: full rows of a slice of the batch
    v = _all_to_all(v, names, 0, 1)  # [rows / k, N]
    v = fn(v, None, -1, norm, **kw)
    if not isinstance(v, tuple):  # a real input's complex spectrum
      v, joined = (jnp.real(v), jnp.imag(v)), True
    v = _all_to_all(v, names, 1, 0)  # [rows, N / k]
  else:
    if not isinstance(v, tuple):  # real input
      v, joined = (v.astype(jnp.float32), jnp.zeros(v.shape, jnp.float32)), True
    v = _four_step(v, names, k, rows, length * k, inverse=inverse, norm=norm, kw=kw)
  v = _map(v, lambda a: jnp.moveaxis(a.reshape(lead[:axis] + lead[axis:] + (length,)), -1, axis))
  return lax.complex(*v) if joined else v


def factors(n: int, k: int):
  """``(N1, N2)``, ``N1 * N2 = n``, ``k`` dividing both, the kernel's lengths preferred, balanced."""
  from kernels.fourier import transforms as T
  cands = [(a, n // a) for a in range(k, n // k + 1, k) if n % a == 0 and (n // a) % k == 0]
  if not cands:
    return None
  return min(cands, key=lambda p: (not (T.supported_length(p[0]) and T.supported_length(p[1])),
                                   abs(math.log(p[0] / p[1]))))


def _four_step(v, names, k, rows, n, *, inverse, norm, kw):
  from kernels.fourier import transforms as T
  nf = factors(n, k)
  if nf is None:
    raise KernelError("x", None, f"fft: the transformed axis (length {n}) is split over {names} ({k} devices) and "
                      f"the other dimensions hold {rows} rows per device, not a multiple of {k}: the four-step "
                      f"decomposition that serves this needs {k}^2 to divide {n}. Split another dimension or "
                      "fewer devices along the transformed one")
  n1, n2 = nf
  unscaled = dict(norm="forward" if inverse else "backward", **kw)
  fn = T.ifft if inverse else T.fft
  v = _map(v, lambda a: a.reshape(rows, n1 // k, n2))  # n = N2 n1 + n2; this device: a slice of n1
  v = _all_to_all(v, names, 2, 1)  # [rows, N1, N2 / k]: every n1, a slice of n2
  v = fn(v, None, 1, **unscaled)  # -> k1
  # the twiddle W_N^(n2 k1) at this device's n2
  sign = 1.0 if inverse else -1.0
  k1, n2g = np.meshgrid(np.arange(n1), np.arange(n2), indexing="ij")
  phase = sign * 2 * np.pi * ((k1 * n2g) % n) / n
  table = jnp.asarray(np.stack([np.cos(phase), np.sin(phase)]).astype(np.float32))  # [2, N1, N2]
  d = lax.axis_index(names)
  tw = lax.dynamic_slice_in_dim(table, d * (n2 // k), n2 // k, axis=2)
  c, s = tw[0], tw[1]
  r, i = v  # planes
  v = (r * c - i * s, r * s + i * c)
  v = _all_to_all(v, names, 1, 2)  # [rows, N1 / k, N2]: a slice of k1, every n2
  v = fn(v, None, 2, **unscaled)  # -> k2; X[k1 + N1 k2]
  v = _all_to_all(v, names, 2, 1)  # [rows, N1, N2 / k]: every k1, a slice of k2 (natural order is k2-major)
  v = _map(v, lambda a: jnp.swapaxes(a, 1, 2).reshape(rows, n // k))
  scale = T._scale(norm, n, inverse)
  if scale != 1.0:
    v = _map(v, lambda a: a * jnp.asarray(scale, jnp.float32).astype(a.dtype))
  return v
