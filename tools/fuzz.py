"""Fuzzes every public kernel family against float64 oracles written here, independently of the package.

Each case draws a random configuration (shapes with odd and size-1 dimensions, float32 or bfloat16,
the kernel's options, small legal block sizes), runs the kernel with ``implementation="pallas",
interpret=True`` (some cases with ``implementation=None``, which is XLA on a CPU) and compares its
outputs with a float64 NumPy oracle; on a subset of cases it also compares ``jax.vjp`` of the kernel
with ``jax.vjp`` of the same oracle run by ``jax.numpy`` in float64 (``jax.enable_x64``). The oracles
are written from the docstrings (each family's ``oracle`` function below is generic over the array
module ``xp``: NumPy for the forward check, jax.numpy for the gradients); none calls the package's
``*_reference`` functions. Malformed inputs (wrong ranks, shapes, dtypes, options) must raise
``kernels.KernelError`` whose ``.argument`` names the argument; any other exception is a failure.

    python tools/fuzz.py --seed 0 --cases 100                 # every family, 100 cases each
    python tools/fuzz.py --family attention --seed 0 --case 17   # one case, to reproduce a failure
    python tools/fuzz.py --seed 0 --first 100 --cases 900 --log runs.jsonl   # cases 100..999 only

A case is a pure function of ``(seed, family, case)``, so a failure reproduces on its own. Exit
status 1 on any failure. ``make fuzz`` runs ``FUZZ_CASES`` cases per family (default 1000).

A long run splits into pieces with identical results: ``--first K --cases N`` runs cases K..K+N-1 and
malformed inputs K/5..(K+N)/5-1 (by default one per five cases), so pieces split at multiples of 5
add up to the whole run. ``--log PATH`` appends each family's counts to PATH as a JSON line.

Tolerances (|got - want| <= atol * max(1, max|want|) + rtol * |want| elementwise, the oracle in float64
on the same dtype-rounded inputs) are stated per family and dtype beside each family; inputs are
scaled so outputs are O(1). Gradients: max|got - want| <= tol * max(1, max|want|).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
import traceback
import zlib
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __name__ == "__main__":
  sys.path.insert(0, ROOT)
  # One core: XLA:CPU runs these small programs no slower single-threaded, and the machine is shared.
  os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")

import kernels  # noqa: E402  (before JAX initialises a backend)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import scipy.special  # noqa: E402  (a dependency of jax)

F32, BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)
PALLAS = dict(implementation="pallas", interpret=True)
INT32_MIN, INT32_MAX = -2 ** 31, 2 ** 31 - 1


class Mismatch(AssertionError):
  """The kernel disagrees with the oracle (or with its own documentation)."""


_worst = [0.0]  # the largest error / tolerance ratio of the comparisons since the last reset (calibration)


# ---------------------------------------------------------------------------------
# Random data and comparisons
# ---------------------------------------------------------------------------------


def pick(rng, options):
  return options[int(rng.integers(len(options)))]


def chance(rng, p: float) -> bool:
  return bool(rng.random() < p)


def dim(rng, hi: int, lo: int = 1, one: float = 0.15) -> int:
  """A dimension in [lo, hi], size 1 with probability ``one`` and small sizes favoured."""
  if lo <= 1 and chance(rng, one):
    return 1
  if chance(rng, 0.5):
    return int(rng.integers(lo, max(lo, hi // 4) + 1))
  return int(rng.integers(lo, hi + 1))


def normal(rng, shape, dtype=F32, scale=1.0, loc=0.0):
  x = rng.standard_normal(tuple(shape)) * scale + loc
  return jnp.asarray(np.asarray(x, np.float32), dtype)


def to64(x) -> np.ndarray:
  """An array (JAX or NumPy, any float or complex dtype) as float64 or complex128 NumPy."""
  x = np.asarray(x)
  return x.astype(np.complex128 if np.iscomplexobj(x) else np.float64)


def round_to(x64, dtype) -> np.ndarray:
  """float64 values rounded as the kernel stores them (through float32, then to ``dtype``)."""
  return to64(np.asarray(x64, np.float32).astype(jnp.dtype(dtype)))


def _where(x) -> str:
  return ",".join(str(int(i)) for i in x)


def close(what: str, got, want, atol: float, rtol: float = 0.0, *, dtype=None, shape=None, floor: float = 1.0):
  """Elementwise ``|got - want| <= atol * max(floor, max|want|) + rtol * |want|``; non-finite entries must match.

  ``floor=1`` for outputs of order one; a tiny floor makes ``atol`` relative to the largest entry."""
  if dtype is not None and jnp.dtype(got.dtype) != jnp.dtype(dtype):
    raise Mismatch(f"{what}: dtype {jnp.dtype(got.dtype).name}, documented {jnp.dtype(dtype).name}")
  want = np.asarray(want)
  if shape is None:
    shape = want.shape
  if tuple(got.shape) != tuple(shape):
    raise Mismatch(f"{what}: shape {tuple(got.shape)}, expected {tuple(shape)}")
  g = to64(got)
  fin = np.isfinite(want)
  if not np.array_equal(np.isfinite(g), fin) or not np.array_equal(g[~fin], want[~fin]):
    bad = np.argwhere(np.isfinite(g) != fin)
    at = _where(bad[0]) if len(bad) else "?"
    raise Mismatch(f"{what}: non-finite entries differ (first at [{at}]: got {g[tuple(bad[0])] if len(bad) else '?'}, "
                   f"want {want[tuple(bad[0])] if len(bad) else '?'})")
  if not fin.any():
    return
  scale = max(floor, float(np.abs(want[fin]).max()))
  err = np.where(fin, np.abs(g - np.where(fin, want, 0)), 0.0)
  bound = atol * scale + rtol * np.abs(np.where(fin, want, 0))
  excess = err - bound
  _worst[0] = max(_worst[0], float(np.max(np.where(fin, err / np.maximum(bound, 1e-300), 0.0))))
  if (excess > 0).any():
    i = np.unravel_index(int(np.argmax(excess)), excess.shape)
    raise Mismatch(f"{what}: |got - want| = {err[i]:.3g} at [{_where(i)}] (got {g[i]:.6g}, want {want[i]:.6g}); "
                   f"max error {err.max():.3g}, tolerance atol={atol:g} x {scale:.3g} + rtol={rtol:g}")


def close_grad(what: str, got, want, tol: float, *, dtype=None, floor: float = 1.0):
  """A gradient: ``max|got - want| <= tol * max(floor, max|want|)``, every entry finite."""
  if dtype is not None and jnp.dtype(got.dtype) != jnp.dtype(dtype):
    raise Mismatch(f"d{what}: dtype {jnp.dtype(got.dtype).name}, expected {jnp.dtype(dtype).name} (the primal's)")
  want = np.asarray(want)
  if tuple(got.shape) != want.shape:
    raise Mismatch(f"d{what}: shape {tuple(got.shape)}, expected {want.shape}")
  g = to64(got)
  if not np.isfinite(g).all():
    raise Mismatch(f"d{what}: {int((~np.isfinite(g)).sum())} non-finite entries (first at "
                   f"[{_where(np.argwhere(~np.isfinite(g))[0])}])")
  if want.size == 0:
    return
  scale = max(floor, float(np.abs(want).max()))
  err = np.abs(g - want)
  _worst[0] = max(_worst[0], float(err.max() / (tol * scale)))
  if err.max() > tol * scale:
    i = np.unravel_index(int(np.argmax(err)), err.shape)
    raise Mismatch(f"d{what}: max |got - want| = {err.max():.3g} at [{_where(i)}] (got {g[i]:.6g}, want {want[i]:.6g}) "
                   f"> {tol:g} x {scale:.3g}")


def grads64(oracle: Callable, primals, cotangent):
  """``jax.vjp`` of ``oracle(jnp, *primals)`` in float64 (or complex128), as NumPy arrays."""
  with jax.enable_x64(True):
    p64 = [jnp.asarray(to64(p)) for p in primals]
    ct = jax.tree.map(lambda c: jnp.asarray(to64(c)), cotangent)
    _, pull = jax.vjp(lambda *a: oracle(jnp, *a), *p64)
    return [np.asarray(g) for g in pull(ct)]


def check_vjp(kernel_fn: Callable, oracle: Callable, primals, names, tol: float, rng, *, tols=None, floor=1.0):
  """Compares ``jax.vjp(kernel_fn)`` with the float64 ``jax.vjp`` of ``oracle`` under a random cotangent."""
  out, pull = jax.vjp(kernel_fn, *primals)
  ct = jax.tree.map(lambda o: _cotangent(rng, o), out)
  got = pull(ct)
  want = grads64(oracle, primals, ct)
  for name, p, g, w in zip(names, primals, got, want):
    # a gradient stored in bfloat16 carries half an ulp (2^-9) of each entry on top of the kernel's error
    extra = 2 ** -8 if jnp.dtype(p.dtype) == BF16 else 0.0
    close_grad(name, g, w, (tols or {}).get(name, tol) + extra, dtype=p.dtype, floor=floor)


def _cotangent(rng, o):
  if jnp.issubdtype(o.dtype, jnp.complexfloating):
    return jnp.asarray(rng.standard_normal(o.shape) + 1j * rng.standard_normal(o.shape), o.dtype)
  return normal(rng, o.shape, o.dtype)


def xsp(xp):
  """The special functions of array module ``xp``."""
  return scipy.special if xp is np else jax.scipy.special


def time_scan(xp, step, carry, xs):
  """``step(carry, x_t) -> (carry, y_t)`` over the leading axis of the arrays ``xs``: a plain loop for
  NumPy, ``lax.scan`` for jax.numpy (one compiled loop, so the float64 gradients stay cheap)."""
  if xp is np:
    ys = []
    for t in range(xs[0].shape[0]):
      carry, y = step(carry, [x[t] for x in xs])
      ys.append(y)
    return carry, np.stack(ys)
  return jax.lax.scan(lambda c, x: step(c, list(x)), carry, tuple(xs))


def impl_kw(rng, p_xla: float = 0.15) -> dict:
  """Mostly the Pallas kernel in interpret mode; sometimes implementation=None (XLA on a CPU)."""
  return dict(implementation=None) if chance(rng, p_xla) else dict(PALLAS)


def describe(x) -> Any:
  """A short printable form of a configuration value."""
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return f"{getattr(x.dtype, 'name', x.dtype)}{list(x.shape)}"
  if isinstance(x, (tuple, list)):
    return type(x)(describe(v) for v in x)
  if dataclasses.is_dataclass(x) and not isinstance(x, type):
    return f"{type(x).__name__}({', '.join(f'{k}={describe(v)}' for k, v in dataclasses.asdict(x).items())})"
  return x


@dataclasses.dataclass(frozen=True)
class Family:
  case: Callable        # rng -> (config dict, check()); check raises on a disagreement
  malformed: Callable   # rng -> (label, argument, call()); call must raise KernelError naming argument


FAMILIES: dict[str, Family] = {}  # each family's section below registers itself

# The public functions each family calls (tests/test_fuzz.py checks that every public kernel is covered).
COVERAGE = {
    "matmul": ("matmul",), "quantized_matmul": ("quantized_matmul",), "norm": ("layer_norm", "rms_norm"),
    "rope": ("rope",), "attention": ("flash_attention", "RotaryEmbedding"), "linear_scan": ("linear_scan",),
    "ssd": ("ssd", "gated_linear_attention"), "parallel_scan": ("parallel_scan",), "gmm": ("gmm",), "tgmm": ("tgmm",),
    "route": ("route",), "moe": ("moe",), "fft": ("fft", "ifft", "rfft", "irfft", "fft2", "ifft2", "rfft2", "irfft2"),
    "fft_conv": ("fft_conv",), "conv2d": ("conv2d", "winograd_filter_transform"),
}


# In a malformed input's expected arguments: a correctly empty result is also fine (a zero-size
# dimension is not always an error; a raw exception never is).
EMPTY = "<or an empty result>"


def malformed_call(rng, fn, args, kw, bad):
  """One of ``bad`` (label, argument, overrides) applied to a valid call: positions by index, keywords by name."""
  label, argument, over = pick(rng, bad)
  args, kw = list(args), dict(kw)
  for key, value in over.items():
    if isinstance(key, int):
      args[key] = value
    else:
      kw[key] = value
  return label, argument, lambda: fn(*args, **kw)


def bad_values(rng, *values):
  """One of several wrong values (the caller lists them)."""
  return pick(rng, list(values))


# ---------------------------------------------------------------------------------
# Shared oracle pieces
# ---------------------------------------------------------------------------------


def activation(xp, z, name):
  if name is None:
    return z
  if name == "relu":
    return xp.maximum(z, 0)
  if name == "gelu":  # exact: z * Phi(z)
    return 0.5 * z * (1 + xsp(xp).erf(z / math.sqrt(2)))
  if name == "gelu_tanh":
    return 0.5 * z * (1 + xp.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z ** 3)))
  if name == "silu":  # z * sigmoid(z), written with tanh so that no exp overflows
    return z * 0.5 * (1 + xp.tanh(z / 2))
  raise ValueError(name)


def dropout_keep(key, rows, cols, rate: float) -> np.ndarray:
  """matmul's documented dropout mask: murmur3's finaliser of (seed, row, column), in wrapping uint32."""
  seed = np.asarray(jax.random.bits(key, (), jnp.uint32)).astype(np.uint32)

  def fmix(h):
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))
  with np.errstate(over="ignore"):
    h = fmix(np.asarray(rows).astype(np.uint32) * np.uint32(0x9E3779B1) + seed)
    h = fmix(h ^ (np.asarray(cols).astype(np.uint32) * np.uint32(0x85EBCA77)))
  return (h >> np.uint32(8)) >= np.uint32(round(rate * (1 << 24)))


# ---------------------------------------------------------------------------------
# matmul and quantized_matmul
# ---------------------------------------------------------------------------------
# Tolerances. float32 out: f32 sums of <= 300 O(1/sqrt(k)) products in another order: 2e-5. bfloat16 out:
# one rounding of the f32 result (half an ulp, 2^-9) on top of that: 2^-8 relative, 1e-3 absolute.
# Gradients: f32 1e-4 of the largest entry; bf16 operands (gradients stored in bf16, the saved
# pre-activation rounded to out_dtype) 2e-2.
MM_TOL = {"float32": dict(atol=2e-5, rtol=2e-5), "bfloat16": dict(atol=1e-3, rtol=2 ** -8)}
MM_GRAD_TOL = {"float32": 1e-4, "bfloat16": 2e-2}
ACTIVATIONS = (None, "relu", "gelu", "gelu_tanh", "silu")


def matmul_oracle(xp, a, b, bias, *, transpose_a, transpose_b, act, keep=None, rate=0.0, a_scale=None,
                  b_scale=None):
  """``dropout(act(op(a) @ op(b) [* a_scale * b_scale] + bias))``, batch dimensions broadcast."""
  if transpose_a:
    a = xp.swapaxes(a, -1, -2)
  if transpose_b:
    b = xp.swapaxes(b, -1, -2)
  z = xp.matmul(a, b)
  if a_scale is not None:
    z = z * a_scale * b_scale
  if bias is not None:
    z = z + xp.reshape(bias, (-1,))
  y = activation(xp, z, act)
  if rate:
    y = xp.where(keep, y / (1 - rate), 0.0)
  return y


def _mm_batches(rng):
  """Leading batch shapes for a and b that broadcast like jnp.matmul."""
  return pick(rng, [((), ()), ((), ()), ((2,), ()), ((), (3,)), ((2,), (2,)), ((2, 1), (3,)), ((1,), (2,)),
                    ((2, 2), (1, 2))])


def _mm_blocks(rng, m, k, n, transpose_a, transpose_b, dtype):
  """None (the defaults) or legal small blocks (BlockSizes' tiling rule), several grid steps where possible."""
  if chance(rng, 0.2):
    return None
  sub = 16 if dtype == BF16 else 8
  bm = pick(rng, [128, 256]) if transpose_a else pick(rng, [sub, 2 * sub, 32, 64, 128])
  bk = pick(rng, [8, 16, 32, 128]) if (transpose_a and not transpose_b) else pick(rng, [128, 256])
  if transpose_a and not transpose_b and dtype == BF16:
    bk = max(bk, 16)
  bn = pick(rng, [128, 256])
  return kernels.BlockSizes(bm, bk, bn)


def _mm_dropout(rng, batch, m, n, rate):
  key = jax.random.key(int(rng.integers(2 ** 31)))
  rows = np.arange(math.prod(batch) * m).reshape(batch + (m, 1))
  cols = np.arange(n).reshape((1,) * len(batch) + (1, n))
  return key, dropout_keep(key, rows, cols, rate)


def case_matmul(rng):
  dtype = pick(rng, [F32, BF16])
  m, k, n = dim(rng, 200), dim(rng, 300), dim(rng, 300)
  ta, tb = chance(rng, 0.5), chance(rng, 0.5)
  ab, bb = _mm_batches(rng)
  a = normal(rng, ab + ((k, m) if ta else (m, k)), dtype, 1 / math.sqrt(k))
  b = normal(rng, bb + ((n, k) if tb else (k, n)), dtype)
  bias = normal(rng, pick(rng, [(n,), (1, n)]), pick(rng, [F32, BF16]), 0.5) if chance(rng, 0.5) else None
  act = pick(rng, ACTIVATIONS)
  out_dtype = pick(rng, [None, F32, BF16])
  precision = pick(rng, [None, "highest", "high", "default"]) if dtype == F32 else None
  batch = tuple(np.broadcast_shapes(ab, bb))
  rate, key, keep = 0.0, None, None
  if chance(rng, 0.2):
    rate = pick(rng, [0.1, 0.5])
    key, keep = _mm_dropout(rng, batch, m, n, rate)
  blocks = _mm_blocks(rng, m, k, n, ta, tb, dtype)
  impl = impl_kw(rng)
  grad = chance(rng, 0.35)
  kw = dict(transpose_a=ta, transpose_b=tb, bias=bias, activation=act, out_dtype=out_dtype, precision=precision,
            dropout_rate=rate, dropout_key=key, block_sizes=blocks, **impl)
  config = dict(a=describe(a), b=describe(b), grad=grad, **{k_: describe(v) for k_, v in kw.items()})

  def check():
    out = kernels.matmul(a, b, **kw)
    odt = jnp.dtype(out_dtype or dtype)
    okw = dict(transpose_a=ta, transpose_b=tb, act=act, keep=keep, rate=rate)
    want = matmul_oracle(np, to64(a), to64(b), None if bias is None else to64(bias), **okw)
    close("out", out, want, **MM_TOL[odt.name], dtype=odt, shape=batch + (m, n))
    if grad:
      args = (a, b) + ((bias,) if bias is not None else ())
      check_vjp(lambda a, b, *c: kernels.matmul(a, b, **dict(kw, bias=c[0] if c else None)),
                lambda xp, a, b, *c: matmul_oracle(xp, a, b, c[0] if c else None, **okw),
                args, ["a", "b", "bias"], MM_GRAD_TOL["bfloat16" if BF16 in (dtype, odt) else "float32"], rng)
  return config, check


QUANT = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def _quantized(rng, shape, dtype):
  if dtype == jnp.int8:
    return jnp.asarray(rng.integers(-127, 128, shape), jnp.int8)
  return jnp.asarray(np.asarray(rng.standard_normal(shape) * 2, np.float32), dtype)


def case_quantized_matmul(rng):
  dtype = pick(rng, QUANT)
  m, k, n = dim(rng, 150), dim(rng, 300), dim(rng, 260)
  ta, tb = chance(rng, 0.3), chance(rng, 0.5)
  ab, bb = _mm_batches(rng)
  a = _quantized(rng, ab + ((k, m) if ta else (m, k)), dtype)
  b = _quantized(rng, bb + ((n, k) if tb else (k, n)), dtype)
  amp = 1 / (math.sqrt(k) * (80 if dtype == jnp.int8 else 4))  # scales that make the outputs O(1)
  a_scale = jnp.asarray(np.abs(rng.standard_normal(pick(rng, [(), (m,), (m, 1), ab + (m,), ab + (m, 1)]))) * amp + amp,
                        jnp.float32)
  b_scale = jnp.asarray(np.abs(rng.standard_normal(pick(rng, [(), (n,), (1, n), bb + (n,), bb + (1, n)]))) + 0.5,
                        pick(rng, [F32, BF16]))
  bias = normal(rng, (n,), F32, 0.5) if chance(rng, 0.5) else None
  act = pick(rng, ACTIVATIONS)
  out_dtype = pick(rng, [None, F32, BF16])
  batch = tuple(np.broadcast_shapes(ab, bb))
  rate, key, keep = 0.0, None, None
  if chance(rng, 0.2):
    rate = pick(rng, [0.1, 0.5])
    key, keep = _mm_dropout(rng, batch, m, n, rate)
  blocks = _mm_blocks(rng, m, k, n, ta, tb, BF16)  # packed 8-bit operands: bf16's row tile at least
  if blocks is not None and not ta:
    blocks = kernels.BlockSizes(max(blocks.bm, 32), blocks.bk, blocks.bn)
  impl = impl_kw(rng)
  kw = dict(transpose_a=ta, transpose_b=tb, bias=bias, activation=act, out_dtype=out_dtype, dropout_rate=rate,
            dropout_key=key, block_sizes=blocks, **impl)
  config = dict(a=describe(a), b=describe(b), a_scale=describe(a_scale), b_scale=describe(b_scale),
                **{k_: describe(v) for k_, v in kw.items()})

  def check():
    out = kernels.quantized_matmul(a, b, a_scale, b_scale, **kw)
    odt = jnp.dtype(out_dtype or F32)
    sa, sb = to64(a_scale), to64(b_scale)
    # by the shapes drawn, not a guess from the last axes: a batch (2, 1) + (m,) with m = 1 looks like (2,) + (m, 1)
    sa = sa if sa.ndim == 0 or sa.shape in ((m, 1), ab + (m, 1)) else sa[..., None]
    sb = sb if sb.ndim == 0 or sb.shape in ((1, n), bb + (1, n)) else sb[..., None, :]
    want = matmul_oracle(np, to64(a), to64(b), None if bias is None else to64(bias), transpose_a=ta, transpose_b=tb,
                         act=act, keep=keep, rate=rate, a_scale=sa, b_scale=sb)
    # int8 sums are exact in int32, fp8 products exact in f32: the float32 / bfloat16 tolerances above
    close("out", out, want, **MM_TOL[odt.name], dtype=odt, shape=batch + (m, n))
  return config, check


# ---------------------------------------------------------------------------------
# layer_norm and rms_norm
# ---------------------------------------------------------------------------------
# Tolerances. float32: f32 statistics summed in another order, on rows whose mean is at most ten
# spreads away: 2e-5. bfloat16 out: one rounding (2^-9) of the f32 result: 2^-8 relative, 2e-3 absolute.
# h = x + residual is rounded to x's dtype by both sides: the same half ulp. Gradients: f32 1e-4 of
# the largest entry; bf16 2e-2.
NORM_TOL = {"float32": dict(atol=2e-5, rtol=2e-5), "bfloat16": dict(atol=2e-3, rtol=2 ** -8)}
NORM_GRAD_TOL = {"float32": 1e-4, "bfloat16": 2e-2}


def norm_oracle(xp, h, scale, bias, *, kind, eps):
  """``(h - mean) / sqrt(var + eps) * scale + bias`` (layer) or ``h / sqrt(mean(h^2) + eps) * scale`` (rms)."""
  v = h - xp.mean(h, axis=-1, keepdims=True) if kind == "layer" else h
  y = v / xp.sqrt(xp.mean(v * v, axis=-1, keepdims=True) + eps)
  if scale is not None:
    y = y * scale
  if bias is not None:
    y = y + bias
  return y


def case_norm(rng):
  kind = pick(rng, ["layer", "rms"])
  dtype = pick(rng, [F32, BF16])
  hidden = dim(rng, 300)
  lead = pick(rng, [(dim(rng, 40),), (dim(rng, 4), dim(rng, 12)), (), (dim(rng, 2), dim(rng, 3), dim(rng, 5))])
  loc, spread = pick(rng, [(0.0, 1.0), (1.0, 0.3), (0.0, 0.05), (2.0, 1.0)])
  x = normal(rng, lead + (hidden,), dtype, spread, loc)
  residual = normal(rng, lead + (hidden,), dtype, 0.5) if chance(rng, 0.4) else None
  scale = normal(rng, (hidden,), pick(rng, [F32, BF16]), 0.2, 1.0) if chance(rng, 0.7) else None
  bias = normal(rng, (hidden,), pick(rng, [F32, BF16]), 0.1) if kind == "layer" and chance(rng, 0.6) else None
  eps = pick(rng, [1e-6, 1e-5, 1e-2, 0.5])
  rows = math.prod(lead)
  blocks = pick(rng, [None, 8, 16, 24, rows, (pick(rng, [8, 16, 32]), pick(rng, [8, 16, 32])), 4096])
  if isinstance(blocks, tuple):
    blocks = kernels.norm.api.BlockSizes(*blocks)
  impl = impl_kw(rng)
  grad = chance(rng, 0.4)
  kw = dict(eps=eps, residual=residual, block_sizes=blocks, **impl)
  config = dict(kind=kind, x=describe(x), scale=describe(scale), bias=describe(bias), grad=grad,
                **{k: describe(v) for k, v in kw.items()})

  def run(x, residual, scale, bias):
    k = dict(kw, residual=residual)
    return kernels.layer_norm(x, scale, bias, **k) if kind == "layer" else kernels.rms_norm(x, scale, **k)

  def check():
    out = run(x, residual, scale, bias)
    tol = NORM_TOL[dtype.name]
    h = to64(x) if residual is None else round_to(to64(x) + to64(residual), dtype)
    want = norm_oracle(np, h, None if scale is None else to64(scale), None if bias is None else to64(bias), kind=kind,
                       eps=eps)
    if residual is not None:
      if not isinstance(out, tuple) or len(out) != 2:
        raise Mismatch(f"with a residual the result must be (y, h), got {type(out).__name__}")
      close("h", out[1], h, **tol, dtype=dtype)
      out = out[0]
    close("y", out, want, **tol, dtype=dtype)
    if grad:
      names = ["x"] + (["residual"] if residual is not None else []) + (["scale"] if scale is not None else []) + (
          ["bias"] if bias is not None else [])
      args = [x] + [v for v in (residual, scale, bias) if v is not None]

      def unpack(a):
        d = dict(zip(names, a))
        return d["x"], d.get("residual"), d.get("scale"), d.get("bias")

      def oracle(xp, *a):
        x_, r_, s_, b_ = unpack(a)
        h_ = x_ if r_ is None else x_ + r_
        y_ = norm_oracle(xp, h_, s_, b_, kind=kind, eps=eps)
        return y_ if r_ is None else (y_, h_)
      tols = {n: NORM_GRAD_TOL["bfloat16" if BF16 in (a.dtype, dtype) else "float32"] for n, a in zip(names, args)}
      check_vjp(lambda *a: run(*unpack(a)), oracle, args, names, NORM_GRAD_TOL[dtype.name], rng, tols=tols)
  return config, check


def malformed_matmul(rng):
  m, k, n = dim(rng, 40), dim(rng, 300), dim(rng, 200)
  dtype = pick(rng, [F32, BF16])
  a, b = normal(rng, (m, k), dtype), normal(rng, (k, n), dtype)
  kw = dict(block_sizes=kernels.BlockSizes(32, 128, 128), **PALLAS)
  other = F32 if dtype == BF16 else BF16
  bad = [
      ("a of rank 1", "a", {0: a[0]}),
      ("b of rank 1", "b", {1: b[:, 0]}),
      ("a a Python list", "a", {0: [[1.0] * k] * m}),
      ("a None", "a", {0: None}),
      ("inner dimensions differ", "b", {1: normal(rng, (k + dim(rng, 5), n), dtype)}),
      ("M = 0", "a", {0: jnp.zeros((0, k), dtype)}),
      ("an empty batch", ("a", "b", EMPTY), {0: jnp.zeros((0, m, k), dtype)}),
      ("N = 0", ("a", "b"), {1: jnp.zeros((k, 0), dtype)}),
      ("int32 operands", "a", {0: jnp.ones((m, k), jnp.int32), 1: jnp.ones((k, n), jnp.int32)}),
      ("int8 operands (quantized_matmul's)", "a", {0: jnp.ones((m, k), jnp.int8), 1: jnp.ones((k, n), jnp.int8)}),
      ("float16 operands", "a", {0: a.astype(jnp.float16), 1: b.astype(jnp.float16)}),
      ("complex operands", "a", {0: a.astype(jnp.complex64), 1: b.astype(jnp.complex64)}),
      ("b of another dtype", "b", {1: b.astype(other)}),
      ("batch dimensions that do not broadcast", "b",
       {0: normal(rng, (2, m, k), dtype), 1: normal(rng, (3, k, n), dtype)}),
      ("unknown activation", "activation", {"activation": bad_values(rng, "tanh", "RELU", 3, "")}),
      ("dropout_rate out of [0, 1)", "dropout_rate",
       {"dropout_rate": bad_values(rng, 1.0, -0.1, 1.5, float("nan"), "0.1"), "dropout_key": jax.random.key(0)}),
      ("dropout without a key", "dropout_key", {"dropout_rate": 0.5}),
      ("dropout_key not a key", "dropout_key", {"dropout_rate": 0.5, "dropout_key": bad_values(rng, 3, jnp.zeros(3))}),
      ("bias of the wrong shape", "bias", {"bias": normal(rng, bad_values(rng, (n + 1,), (n, 1), (2, n)))}),
      ("integer bias", "bias", {"bias": jnp.ones((n,), jnp.int32)}),
      ("integer out_dtype", "out_dtype", {"out_dtype": bad_values(rng, jnp.int8, jnp.int32, jnp.float16)}),
      ("unknown precision", "precision", {"precision": bad_values(rng, "ultra", 7, ("highest", "default"))}),
      ("unknown implementation", "implementation", {"implementation": bad_values(rng, "cuda", "mosaic", 1)}),
      ("interpret with implementation='xla'", "interpret", {"implementation": "xla", "interpret": True}),
      ("transpose flag not a bool", bad_values(rng, "transpose_a", "transpose_b"), {}),
      ("block_sizes of two values", "block_sizes", {"block_sizes": (32, 128)}),
      ("block_sizes off the tiling rule", "block_sizes",
       {"block_sizes": bad_values(rng, kernels.BlockSizes(20, 128, 128), kernels.BlockSizes(32, 100, 128),
                                  kernels.BlockSizes(32, 128, 200))}),
      ("non-positive block_sizes", "block_sizes", {"block_sizes": bad_values(rng, (0, 128, 128), (-8, 128, 128))}),
      ("block_sizes a string", "block_sizes", {"block_sizes": "large"}),
  ]
  label, argument, over = pick(rng, bad)
  if label == "transpose flag not a bool":
    over = {argument: bad_values(rng, 1, "yes", None)}
  if label.startswith("block_sizes off") and over["block_sizes"].bm == 20:
    a, b = normal(rng, (64, k), dtype), normal(rng, (k, n), dtype)  # M larger than the block
  if label.startswith("block_sizes off") and over["block_sizes"].bk == 100:
    a, b = normal(rng, (m, 300), dtype), normal(rng, (300, n), dtype)
  if label.startswith("block_sizes off") and over["block_sizes"].bn == 200:
    a, b = normal(rng, (m, k), dtype), normal(rng, (k, 300), dtype)
  return malformed_call(rng, kernels.matmul, (a, b), kw, [(label, argument, over)])


def malformed_quantized_matmul(rng):
  m, k, n = dim(rng, 40), dim(rng, 200), dim(rng, 200)
  dtype = pick(rng, QUANT)
  a, b = _quantized(rng, (m, k), dtype), _quantized(rng, (k, n), dtype)
  sa, sb = jnp.ones((m,), jnp.float32), jnp.ones((n,), jnp.float32)
  kw = dict(block_sizes=kernels.BlockSizes(32, 128, 128), **PALLAS)
  bad = [
      ("float32 operands (matmul's)", "a", {0: normal(rng, (m, k)), 1: normal(rng, (k, n))}),
      ("int8 a with fp8 b", "b", {1: _quantized(rng, (k, n), QUANT[1] if dtype == QUANT[0] else QUANT[0])}),
      ("a_scale of the wrong length", "a_scale", {2: jnp.ones((m + 1,), jnp.float32)}),
      ("a_scale per column", "a_scale", {2: jnp.ones((1, m + 1), jnp.float32)}),
      ("b_scale of the wrong length", "b_scale", {3: jnp.ones((n + 2,), jnp.float32)}),
      ("integer b_scale", "b_scale", {3: jnp.ones((n,), jnp.int32)}),
      ("a_scale a Python float", "a_scale", {2: 0.5}),
      ("a_scale None", "a_scale", {2: None}),
      ("inner dimensions differ", "b", {1: _quantized(rng, (k + 1, n), dtype)}),
      ("a of rank 1", "a", {0: a[0]}),
      ("unknown activation", "activation", {"activation": "tanh"}),
      ("dropout without a key", "dropout_key", {"dropout_rate": 0.25}),
      ("float16 out_dtype", "out_dtype", {"out_dtype": jnp.float16}),
      ("bias of the wrong shape", "bias", {"bias": jnp.ones((n + 1,))}),
      ("block_sizes off the tiling rule", "block_sizes", {"block_sizes": kernels.BlockSizes(32, 128, 100),
                                                          1: _quantized(rng, (k, 300), dtype),
                                                          3: jnp.ones((300,), jnp.float32)}),
  ]
  return malformed_call(rng, kernels.quantized_matmul, (a, b, sa, sb), kw, bad)


FAMILIES["matmul"] = Family(case_matmul, malformed_matmul)
FAMILIES["quantized_matmul"] = Family(case_quantized_matmul, malformed_quantized_matmul)


def malformed_norm(rng):
  kind = pick(rng, ["layer", "rms"])
  rows, hidden = dim(rng, 40), dim(rng, 200)
  dtype = pick(rng, [F32, BF16])
  x = normal(rng, (rows, hidden), dtype)
  fn = kernels.layer_norm if kind == "layer" else kernels.rms_norm
  kw = dict(block_sizes=8, **PALLAS)
  bad = [
      ("x of integers", "x", {0: jnp.ones((rows, hidden), jnp.int32)}),
      ("x float16", "x", {0: x.astype(jnp.float16)}),
      ("x a Python list", "x", {0: [1.0, 2.0, 3.0]}),
      ("x a scalar", "x", {0: jnp.float32(1.0)}),
      ("x with no features", "x", {0: jnp.zeros((rows, 0), dtype)}),
      ("x with no rows", ("x", EMPTY), {0: jnp.zeros((0, hidden), dtype)}),
      ("scale of the wrong length", "scale", {1: normal(rng, (hidden + dim(rng, 3),))}),
      ("scale of rank 2", "scale", {1: normal(rng, (1, hidden))}),
      ("integer scale", "scale", {1: jnp.ones((hidden,), jnp.int32)}),
      ("eps not positive", "eps", {"eps": bad_values(rng, 0.0, -1e-5, float("nan"), float("inf"), "1e-6", None)}),
      ("residual of another shape", "residual", {"residual": normal(rng, (rows + 1, hidden), dtype)}),
      ("residual of another dtype", "residual",
       {"residual": normal(rng, (rows, hidden), F32 if dtype == BF16 else BF16)}),
      ("block_sizes of three values", "block_sizes", {"block_sizes": (8, 8, 8)}),
      ("negative block_sizes", "block_sizes",
       {"block_sizes": bad_values(rng, -8, 0, kernels.norm.api.BlockSizes(-8, 8))}),
      ("block rows off the sublane rule", "block_sizes", {"block_sizes": 12, 0: normal(rng, (40, hidden), dtype)}),
      ("block_sizes a float", "block_sizes", {"block_sizes": 8.0}),
      ("unknown implementation", "implementation", {"implementation": "cuda"}),
  ]
  if kind == "layer":
    bad.append(("bias of the wrong length", "bias", {2: normal(rng, (hidden + 1,))}))
    bad.append(("integer bias", "bias", {2: jnp.ones((hidden,), jnp.int32)}))
  return malformed_call(rng, fn, (x, normal(rng, (hidden,))) + ((None,) if kind == "layer" else ()), kw, bad)


FAMILIES["norm"] = Family(case_norm, malformed_norm)


# ---------------------------------------------------------------------------------
# rope (and the rotation flash_attention fuses)
# ---------------------------------------------------------------------------------
# Tolerances. float32: the kernel composes each angle from four float64-built digit angles in f32
# (a few ulp of cos/sin) and the oracle turns by pos * inv_freq in float64 (2^-53 of angles up to
# 2^31 rad, ~2e-7): 1e-5. bfloat16 out: one rounding (2^-9) of the f32 result: 2^-8 relative, 2e-3
# absolute. Gradients (the rotation back): f32 1e-5, bf16 2e-2 of the largest entry.
ROPE_TOL = {"float32": dict(atol=1e-5, rtol=1e-5), "bfloat16": dict(atol=2e-3, rtol=2 ** -8)}
ROPE_GRAD_TOL = {"float32": 1e-5, "bfloat16": 2e-2}


def rope_inv_freq(rotary_dim: int, theta: float, scaling) -> np.ndarray:
  """``theta ** (-2 i / rotary_dim)`` in float64, with linear or Llama 3.1 context scaling."""
  freq = 1.0 / np.power(float(theta), np.arange(rotary_dim // 2, dtype=np.float64) * 2.0 / rotary_dim)
  if scaling is None:
    return freq
  if isinstance(scaling, (int, float)):
    return freq / float(scaling)
  if scaling.kind == "linear":
    return freq / scaling.factor
  # Llama 3.1: short wavelengths keep their frequency, long ones are divided by factor, a smooth blend between
  old = scaling.original_max_position
  wavelen = 2 * math.pi / freq
  smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
  out = np.where(wavelen < old / scaling.high_freq_factor, freq,
                 np.where(wavelen > old / scaling.low_freq_factor, freq / scaling.factor,
                          (1 - smooth) * freq / scaling.factor + smooth * freq))
  return out


def rope_oracle(xp, x, positions, *, head_dim, rotary_dim, theta, interleaved, scaling):
  """Rotates pairs of the first ``rotary_dim`` features of ``x`` [batch, seq, heads, head_dim] by
  ``position * inv_freq`` (angles in float64 from the integer positions [batch, seq])."""
  rd = rotary_dim or head_dim
  angle = np.asarray(positions, np.float64)[..., None] * rope_inv_freq(rd, theta, scaling)  # [b, s, rd/2]
  cos, sin = np.cos(angle)[:, :, None, :], np.sin(angle)[:, :, None, :]
  rot, rest = x[..., :rd], x[..., rd:]
  if interleaved:
    x1, x2 = rot[..., 0::2], rot[..., 1::2]
  else:
    x1, x2 = rot[..., :rd // 2], rot[..., rd // 2:]
  y1, y2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
  if interleaved:
    y = xp.reshape(xp.stack([y1, y2], axis=-1), rot.shape)
  else:
    y = xp.concatenate([y1, y2], axis=-1)
  return xp.concatenate([y, rest], axis=-1)


def _rope_options(rng, head_dim):
  rotary_dim = None if chance(rng, 0.5) else 2 * int(rng.integers(1, head_dim // 2 + 1))
  theta = pick(rng, [10000.0, 500000.0, 1e6, 2.5, 100.0])
  interleaved = chance(rng, 0.4)
  scaling = pick(rng, [None, None, 2.0, 0.5, kernels.RopeScaling("linear", 4.0),
                       kernels.RopeScaling("llama3", 8.0, 1.0, 4.0, int(pick(rng, [16, 64, 8192]))),
                       kernels.RopeScaling("llama3", 2.0, 2.0, 8.0, 32)])
  return dict(theta=theta, rotary_dim=rotary_dim, interleaved=interleaved, scaling=scaling)


def _positions(rng, b, s):
  """Integer positions [b, s]: within the sequence, past it (decode), huge, negative, int32's extremes."""
  kind = pick(rng, ["arange", "offset", "random", "huge", "negative", "extremes", "mixed"])
  if kind == "arange":
    p = np.broadcast_to(np.arange(s), (b, s))
  elif kind == "offset":
    p = np.arange(s)[None] + rng.integers(0, 200000, (b, 1))
  elif kind == "random":
    p = rng.integers(0, 4 * s + 8, (b, s))
  elif kind == "huge":
    p = rng.integers(2 ** 20, INT32_MAX, (b, s), endpoint=True)
  elif kind == "negative":
    p = -rng.integers(0, 10 ** int(rng.integers(1, 10)), (b, s), endpoint=True)
  elif kind == "extremes":
    p = rng.choice(np.array([INT32_MIN, INT32_MIN + 1, INT32_MAX, INT32_MAX - 1, -1, 0, 1, 2 ** 24, -2 ** 24, 255,
                             256, 65535, 65536, -65536]), (b, s))
  else:
    p = rng.integers(INT32_MIN, INT32_MAX, (b, s), endpoint=True)
  return kind, np.asarray(p, np.int64)


def case_rope(rng):
  dtype = pick(rng, [F32, BF16])
  b, s, h = dim(rng, 3), dim(rng, 80), dim(rng, 4)
  head_dim = 2 * dim(rng, 80)
  opts = _rope_options(rng, head_dim)
  x = normal(rng, (b, s, h, head_dim), dtype)
  pos_kind, pos = (None, None) if chance(rng, 0.3) else _positions(rng, b, s)
  pos_dtype = pick(rng, [jnp.int32, jnp.int32, jnp.int32, jnp.uint32, jnp.int16])
  if pos is not None and not (np.iinfo(pos_dtype).min <= pos.min() and pos.max() <= np.iinfo(pos_dtype).max):
    pos_dtype = jnp.int32
  positions = None if pos is None else jnp.asarray(pos, pos_dtype)
  traced = pos is not None and chance(rng, 0.3)  # under jit the kernel cannot read the positions
  max_position = None
  if chance(rng, 0.3):
    if pos is None:
      max_position = s + int(rng.integers(0, 50))
    elif pos.min() >= 0:
      max_position = int(pos.max()) + 1 + int(rng.integers(0, 50))
    elif traced:
      # a promise the traced positions break: they still turn by their own angle
      max_position = int(rng.integers(1, 100))
  blocks = pick(rng, [None, s, kernels.RopeBlockSizes(s), 8 * int(rng.integers(1, s // 8 + 1)) if s >= 8 else s])
  impl = impl_kw(rng)
  grad = chance(rng, 0.35)
  kw = dict(opts, max_position=max_position, block_sizes=blocks, **impl)
  config = dict(x=describe(x), positions=pos_kind and f"{pos_kind} {describe(positions)}", traced=traced, grad=grad,
                **{k: describe(v) for k, v in kw.items()})

  def run(x):
    if traced:
      return jax.jit(lambda x, p: kernels.rope(x, p, **kw))(x, positions)
    return kernels.rope(x, positions, **kw)

  def check():
    want_pos = np.broadcast_to(np.arange(s), (b, s)) if pos is None else pos
    okw = dict(head_dim=head_dim, **{k: v for k, v in opts.items()})
    want = rope_oracle(np, to64(x), want_pos, **okw)
    close("out", run(x), want, **ROPE_TOL[dtype.name], dtype=dtype)
    if grad:
      check_vjp(run, lambda xp, x: rope_oracle(xp, x, want_pos, **okw), [x], ["x"], ROPE_GRAD_TOL[dtype.name], rng)
  return config, check


def malformed_rope(rng):
  b, s, h, d = dim(rng, 2), dim(rng, 40), dim(rng, 3), 2 * dim(rng, 40)
  x = normal(rng, (b, s, h, d))
  pos = jnp.asarray(rng.integers(0, 100, (b, s)), jnp.int32)
  bad = [
      ("x of rank 3", "x", {0: jnp.zeros((b, s, d))}),
      ("x of integers", "x", {0: jnp.zeros((b, s, h, d), jnp.int32)}),
      ("odd head_dim", "x", {0: jnp.zeros((b, s, h, d + 1))}),
      ("x a list", "x", {0: [[1.0]]}),
      ("odd rotary_dim", "rotary_dim", {"rotary_dim": 1 + 2 * int(rng.integers(0, d // 2))}),
      ("rotary_dim above head_dim", "rotary_dim", {"rotary_dim": d + 2}),
      ("rotary_dim 0", "rotary_dim", {"rotary_dim": bad_values(rng, 0, -2, 4.0)}),
      ("positions of another shape", "positions", {1: jnp.zeros((b, s + 1), jnp.int32)}),
      ("positions of floats", "positions", {1: jnp.zeros((b, s), jnp.float32)}),
      ("positions of bools", "positions", {1: jnp.zeros((b, s), bool)}),
      ("uint32 positions past int32", "positions", {1: jnp.full((b, s), 2 ** 31 + int(rng.integers(0, 1000)),
                                                                jnp.uint32)}),
      ("x with no tokens", ("x", EMPTY), {0: jnp.zeros((b, 0, h, d)), 1: None}),
      ("x with no batch", ("x", EMPTY), {0: jnp.zeros((0, s, h, d)), 1: jnp.zeros((0, s), jnp.int32)}),
      ("positions past max_position", "positions", {1: pos + 100, "max_position": 100}),
      ("negative positions with max_position", "positions", {1: pos - 101, "max_position": 200}),
      ("max_position below seq without positions", "max_position",
       {1: None, "max_position": max(1, s - 1 - int(rng.integers(0, s)))} if s > 1 else {1: None, "max_position": 0}),
      ("max_position not an int", "max_position", {"max_position": bad_values(rng, 0, -5, 10.5, "100")}),
      ("theta <= 1", "theta", {"theta": bad_values(rng, 1.0, 0.5, 0, -10000.0, "10000", float("nan"))}),
      ("unknown scaling", "scaling", {"scaling": bad_values(rng, "yarn", kernels.RopeScaling("ntk", 2.0),
                                                            kernels.RopeScaling("linear", 0.0),
                                                            kernels.RopeScaling("llama3", 8.0, 4.0, 1.0))}),
      ("interleaved not a bool", "interleaved", {"interleaved": bad_values(rng, 1, "yes", None)}),
      ("block_sizes off the sublane rule", "block_sizes", {0: jnp.zeros((1, 32, 2, 64)), 1: None,
                                                           "block_sizes": bad_values(rng, 12, kernels.RopeBlockSizes(5),
                                                                                     -8, 0)}),
      ("block_sizes a tuple", "block_sizes", {"block_sizes": (8, 8)}),
      ("unknown implementation", "implementation", {"implementation": "triton"}),
  ]
  return malformed_call(rng, kernels.rope, (x, pos), dict(PALLAS), bad)


FAMILIES["rope"] = Family(case_rope, malformed_rope)


# ---------------------------------------------------------------------------------
# flash_attention
# ---------------------------------------------------------------------------------
# Tolerances. float32: the online softmax sums in another order than the oracle: 2e-5 (outputs and
# lse O(1)). bfloat16: the kernel folds the scale into q (one more bf16 rounding of q) and rounds the
# probabilities to bf16 before p @ v: 3e-2 absolute. Gradients: f32 2e-4, bf16 4e-2 of the largest entry.
ATT_TOL = {"float32": dict(atol=2e-5), "bfloat16": dict(atol=3e-2)}
ATT_GRAD_TOL = {"float32": 2e-4, "bfloat16": 4e-2}


def attention_visible(b, h, sq, skv, *, causal, window, segments, mask) -> np.ndarray:
  """[b, h, sq, skv] booleans: key j visible to query i (the last query aligned with the last key)."""
  i = np.arange(sq)[:, None]
  j = np.arange(skv)[None, :]
  diag = i + skv - sq
  vis = np.ones((sq, skv), bool)
  if causal:
    vis &= j <= diag
  if window is not None:
    vis &= (j > diag - window) if causal else (np.abs(j - diag) <= window - 1)
  vis = np.broadcast_to(vis, (b, h, sq, skv))
  if segments is not None:
    qs, ks = segments
    vis = vis & (qs[:, None, :, None] == ks[:, None, None, :])
  if mask is not None:
    vis = vis & mask
  return np.broadcast_to(vis, (b, h, sq, skv))


def attention_oracle(xp, q, k, v, bias, sinks, *, vis, scale, cap, layout, lse=False):
  """softmax(mask(cap(scale q k^T) + bias)) v with optional sink logits; rows that see nothing are 0."""
  if layout == "BSHD":
    q, k, v = (xp.swapaxes(t, 1, 2) for t in (q, k, v))
  groups = q.shape[1] // k.shape[1]
  k, v = xp.repeat(k, groups, axis=1), xp.repeat(v, groups, axis=1)
  s = scale * xp.einsum("bhqd,bhkd->bhqk", q, k)
  if cap is not None:
    s = cap * xp.tanh(s / cap)
  if bias is not None:
    s = s + bias
  seen = vis.any(-1, keepdims=True)
  if sinks is not None:
    sink = xp.reshape(sinks, (1, -1, 1, 1))
    m = xp.maximum(xp.max(xp.where(vis, s, -1e300), axis=-1, keepdims=True), sink)
  else:
    m = xp.where(seen, xp.max(xp.where(vis, s, -1e300), axis=-1, keepdims=True), 0.0)
  p = xp.where(vis, xp.exp(xp.where(vis, s, m) - m), 0.0)
  denom = xp.sum(p, axis=-1, keepdims=True)
  if sinks is not None:
    denom = denom + xp.exp(sink - m)
  live = denom > 0
  safe = xp.where(live, denom, 1.0)
  out = xp.einsum("bhqk,bhkd->bhqd", p, v) / safe
  if layout == "BSHD":
    out = xp.swapaxes(out, 1, 2)
  if not lse:
    return out
  return out, xp.where(live, m + xp.log(safe), -np.inf)[..., 0]


def _segments(rng, b, n):
  if chance(rng, 0.5):  # packed documents: runs of equal ids
    cuts = np.sort(rng.integers(0, n, (b, int(rng.integers(0, 4)))), axis=1)
    return np.stack([np.searchsorted(c, np.arange(n), side="right") for c in cuts]).astype(np.int32)
  return rng.integers(0, 3, (b, n)).astype(np.int32)


def case_attention(rng):
  dtype = pick(rng, [F32, BF16])
  b, kvh, group = dim(rng, 2), dim(rng, 2), pick(rng, [1, 1, 2, 3])
  h = kvh * group
  d = pick(rng, [16, 32, 64, 64, 80, 128])
  sq, skv = dim(rng, 260), dim(rng, 260)
  rope = None
  if chance(rng, 0.2):
    sq = min(sq, skv)
    opts = _rope_options(rng, d)
    rope = kernels.RotaryEmbedding(**opts, max_position=pick(rng, [None, skv, skv + 7]))
  layout = pick(rng, ["BSHD", "BHSD"])

  def shaped(s, n):
    return (b, s, n, d) if layout == "BSHD" else (b, n, s, d)
  q = normal(rng, shaped(sq, h), dtype)
  k, v = normal(rng, shaped(skv, kvh), dtype), normal(rng, shaped(skv, kvh), dtype)
  causal = chance(rng, 0.5)
  window = int(rng.integers(1, max(sq, skv) + 20)) if chance(rng, 0.3) else None
  cap = pick(rng, [1.0, 5.0, 30.0]) if chance(rng, 0.2) else None
  scale = pick(rng, [0.5, 1.5]) / math.sqrt(d) if chance(rng, 0.3) else None
  bias = normal(rng, (pick(rng, [1, b]), pick(rng, [1, h]), sq, skv), pick(rng, [F32, dtype])) if chance(rng, 0.15) \
      else None
  mask = np.asarray(rng.random((pick(rng, [1, b]), pick(rng, [1, h]), sq, skv)) < pick(rng, [0.3, 0.8])) \
      if chance(rng, 0.15) else None
  sinks = normal(rng, (h,), F32) if chance(rng, 0.2) else None
  segments = None
  if chance(rng, 0.2):
    segments = (_segments(rng, b, sq), _segments(rng, b, skv)) if sq != skv or chance(rng, 0.5) else None
    if segments is None:
      ids = _segments(rng, b, sq)
      segments = (ids, ids)
      seg_arg = jnp.asarray(ids)
    else:
      seg_arg = (jnp.asarray(segments[0]), jnp.asarray(segments[1]))
  residuals = chance(rng, 0.4)
  blocks = None
  if chance(rng, 0.75):
    blocks = kernels.AttentionBlockSizes(pick(rng, [16, 32, 64, 128] if dtype == BF16 else [8, 16, 32, 64, 128]),
                                         pick(rng, [128, 256]), pick(rng, [128, 256]), pick(rng, [128, 256]))
  impl = impl_kw(rng)
  grad = chance(rng, 0.3)
  kw = dict(causal=causal, sliding_window=window, logits_soft_cap=cap, scale=scale,
            mask=None if mask is None else jnp.asarray(mask), segment_ids=seg_arg if segments else None, layout=layout,
            rope=rope, block_sizes=blocks, **impl)
  config = dict(q=describe(q), k=describe(k), v=describe(v), bias=describe(bias), sinks=describe(sinks),
                return_residuals=residuals, grad=grad, **{k_: describe(v_) for k_, v_ in kw.items()})

  def rotated(xp, q, k):
    if rope is None:
      return q, k
    okw = dict(head_dim=d, rotary_dim=rope.rotary_dim, theta=rope.theta, interleaved=rope.interleaved,
               scaling=rope.scaling)
    if layout == "BHSD":
      q, k = xp.swapaxes(q, 1, 2), xp.swapaxes(k, 1, 2)
    q = rope_oracle(xp, q, np.broadcast_to(np.arange(sq) + skv - sq, (b, sq)), **okw)
    k = rope_oracle(xp, k, np.broadcast_to(np.arange(skv), (b, skv)), **okw)
    if layout == "BHSD":
      q, k = xp.swapaxes(q, 1, 2), xp.swapaxes(k, 1, 2)
    return q, k

  vis = attention_visible(b, h, sq, skv, causal=causal, window=window, segments=segments, mask=mask)
  okw = dict(vis=vis, scale=1 / math.sqrt(d) if scale is None else scale, cap=cap, layout=layout)

  def check():
    out = kernels.flash_attention(q, k, v, bias=bias, sinks=sinks, return_residuals=residuals, **kw)
    q64, k64 = rotated(np, to64(q), to64(k))
    want, want_lse = attention_oracle(np, q64, k64, to64(v), None if bias is None else to64(bias),
                                      None if sinks is None else to64(sinks), lse=True, **okw)
    if residuals:
      out, lse = out
      close("lse", lse, want_lse, **ATT_TOL[dtype.name], dtype=F32)
    close("out", out, want, **ATT_TOL[dtype.name], dtype=dtype)
    if grad:
      names = ["q", "k", "v"] + (["bias"] if bias is not None else []) + (["sinks"] if sinks is not None else [])
      args = [q, k, v] + [t for t in (bias, sinks) if t is not None]

      def split(a):
        extra = dict(zip(names[3:], a[3:]))
        return a[0], a[1], a[2], extra.get("bias"), extra.get("sinks")

      def kernel_fn(*a):
        q_, k_, v_, bias_, sinks_ = split(a)
        return kernels.flash_attention(q_, k_, v_, bias=bias_, sinks=sinks_, **kw)

      def oracle(xp, *a):
        q_, k_, v_, bias_, sinks_ = split(a)
        q_, k_ = rotated(xp, q_, k_)
        return attention_oracle(xp, q_, k_, v_, bias_, sinks_, **okw)
      check_vjp(kernel_fn, oracle, args, names, ATT_GRAD_TOL[dtype.name], rng)
  return config, check


def malformed_attention(rng):
  b, s, kvh, group, d = dim(rng, 2), dim(rng, 64), dim(rng, 2), pick(rng, [1, 2]), pick(rng, [32, 64])
  h = kvh * group
  dtype = pick(rng, [F32, BF16])
  q, k, v = normal(rng, (b, s, h, d), dtype), normal(rng, (b, s, kvh, d), dtype), normal(rng, (b, s, kvh, d), dtype)
  other = F32 if dtype == BF16 else BF16
  bad = [
      ("q of rank 3", "q", {0: q[0]}),
      ("q a list", "q", {0: [1.0, 2.0]}),
      ("k of another head_dim", "k", {1: normal(rng, (b, s, kvh, d // 2), dtype)}),
      ("kv heads that do not divide q heads", "k", {1: normal(rng, (b, s, h + 1, d), dtype),
                                                    2: normal(rng, (b, s, h + 1, d), dtype)}),
      ("v of another kv_len", "v", {2: normal(rng, (b, s + 1, kvh, d), dtype)}),
      ("k of another batch", "k",
       {1: normal(rng, (b + 1, s, kvh, d), dtype), 2: normal(rng, (b + 1, s, kvh, d), dtype)}),
      ("k of another dtype", "k", {1: k.astype(other)}),
      ("v of another dtype", "v", {2: v.astype(other)}),
      ("float16 inputs", "q", {0: q.astype(jnp.float16), 1: k.astype(jnp.float16), 2: v.astype(jnp.float16)}),
      ("integer inputs", "q", {0: jnp.ones(q.shape, jnp.int32), 1: jnp.ones(k.shape, jnp.int32),
                               2: jnp.ones(v.shape, jnp.int32)}),
      ("empty q", "q", {0: jnp.zeros((b, 0, h, d), dtype)}),
      ("unknown layout", "layout", {"layout": bad_values(rng, "SBHD", "bshd", None)}),
      ("causal not a bool", "causal", {"causal": bad_values(rng, 1, "yes", None)}),
      ("sliding_window not positive", "sliding_window", {"sliding_window": bad_values(rng, 0, -3, 2.5, True)}),
      ("logits_soft_cap not positive", "logits_soft_cap",
       {"logits_soft_cap": bad_values(rng, 0.0, -1.0, "3", float("nan"))}),
      ("scale not finite", "scale", {"scale": bad_values(rng, float("nan"), float("inf"), "0.1")}),
      ("dropout_rate out of [0, 1)", "dropout_rate", {"dropout_rate": bad_values(rng, 1.0, -0.1),
                                                      "dropout_key": jax.random.key(0)}),
      ("dropout without a key", "dropout_key", {"dropout_rate": 0.5}),
      ("segment_ids of another length", "segment_ids", {"segment_ids": jnp.zeros((b, s + 1), jnp.int32)}),
      ("float segment_ids", "segment_ids", {"segment_ids": jnp.zeros((b, s), jnp.float32)}),
      ("segment_ids a triple", "segment_ids", {"segment_ids": (jnp.zeros((b, s), jnp.int32),) * 3}),
      ("mask of the wrong shape", "mask", {"mask": jnp.ones((1, h, s, s + 1), bool)}),
      ("float mask", "mask", {"mask": jnp.ones((1, h, s, s), jnp.float32)}),
      ("bias of the wrong heads", "bias", {"bias": jnp.ones((1, h + 1, s, s))}),
      ("bias of the wrong rank", "bias", {"bias": jnp.ones((s, s))}),
      ("sinks of the wrong length", "sinks", {"sinks": jnp.ones((h + 1,))}),
      ("block_sizes of three values", "block_sizes", {"block_sizes": (1, 2, 3)}),
      ("block_kv not a multiple of 128", "block_sizes",
       {"block_sizes": kernels.AttentionBlockSizes(32, 100, 128, 128), 0: normal(rng, (b, 300, h, d), dtype),
        1: normal(rng, (b, 300, kvh, d), dtype), 2: normal(rng, (b, 300, kvh, d), dtype)}),
      ("rope not a RotaryEmbedding", "rope", {"rope": dict(theta=1e4)}),
      ("rope with more queries than keys", "rope", {"rope": kernels.RotaryEmbedding(),
                                                    0: normal(rng, (b, s + 1, h, d), dtype)}),
      ("rope's max_position below kv_len", "rope", {"rope": kernels.RotaryEmbedding(max_position=max(1, s - 1))}
       if s > 1 else {"rope": dict()}),
      ("rope's rotary_dim odd", "rotary_dim", {"rope": kernels.RotaryEmbedding(rotary_dim=d - 1)}),
      ("rope's theta <= 1", "theta", {"rope": kernels.RotaryEmbedding(theta=0.5)}),
      ("unknown implementation", "implementation", {"implementation": "cuda"}),
  ]
  return malformed_call(rng, kernels.flash_attention, (q, k, v), dict(PALLAS), bad)


FAMILIES["attention"] = Family(case_attention, malformed_attention)


# ---------------------------------------------------------------------------------
# linear_scan
# ---------------------------------------------------------------------------------
# Tolerances. The state is f32 in both kernels; over <= 100 steps of contracting gates the f32
# rounding stays near 1e-6 of the largest state: 1e-5 (float32 out and the final state, which is
# f32 whatever the inputs). bfloat16 out: one rounding (2^-9): 2^-8 relative, 2e-3 absolute.
# Gradients: f32 1e-4, bf16 inputs 2e-2 of the largest entry.
SCAN_TOL = {"float32": dict(atol=1e-5, rtol=1e-5), "bfloat16": dict(atol=2e-3, rtol=2 ** -8)}
SCAN_GRAD_TOL = {"float32": 1e-4, "bfloat16": 2e-2}


def scan_oracle(xp, a, b, h0, *, reset, reverse):
  """``h_t = a_t * h_{t-1} + b_t`` (``h_{t+1}`` when reversed); ``reset[:, t]`` drops the incoming state.

  ``a`` is [batch, seq, width], [batch, seq, 1] or [width]. Returns (every state, the last one).
  """
  batch, seq, width = b.shape
  h = xp.zeros((batch, width), b.dtype) if h0 is None else h0 + xp.zeros((batch, width), b.dtype)
  a = xp.broadcast_to(a, (batch, seq, a.shape[-1]) if a.ndim == 1 else a.shape)
  drop = np.zeros((batch, seq), bool) if reset is None else reset
  xs = [xp.moveaxis(a, 1, 0), xp.moveaxis(b, 1, 0), np.moveaxis(drop, 1, 0)]
  if reverse:
    xs = [x[::-1] for x in xs]

  def step(h, x):
    a_t, b_t, drop_t = x
    h = a_t * xp.where(drop_t[:, None], 0.0, h) + b_t
    return h, h
  h, hs = time_scan(xp, step, h, xs)
  hs = xp.moveaxis(hs[::-1] if reverse else hs, 0, 1)
  return hs, h


def case_linear_scan(rng):
  form = pick(rng, ["real", "real", "real", "complex", "pairs"])
  dtype = pick(rng, [F32, BF16]) if form != "complex" else jnp.dtype(jnp.complex64)
  batch, seq, width = dim(rng, 3), dim(rng, 64), dim(rng, 300)
  gate = pick(rng, ["full", "token", "time"])
  gshape = {"full": (batch, seq, width), "token": (batch, seq, 1), "time": (width,)}[gate]
  # gates in (0, 1) (or inside the unit disc), some near 1 so the state remembers
  mag = 1 / (1 + np.exp(-rng.standard_normal(gshape) * 2 - pick(rng, [0.0, 3.0])))
  b_np = rng.standard_normal((batch, seq, width))
  h0_np = rng.standard_normal((batch, width)) if chance(rng, 0.4) else None
  if form == "real":
    a = jnp.asarray(mag.astype(np.float32), pick(rng, [dtype, F32, BF16]))
    b = jnp.asarray(b_np.astype(np.float32), dtype)
    h0 = None if h0_np is None else jnp.asarray(h0_np.astype(np.float32), pick(rng, [F32, BF16]))
  else:
    phase = np.exp(1j * rng.uniform(-np.pi, np.pi, gshape))
    ac, bc = mag * phase, b_np + 1j * rng.standard_normal(b_np.shape)
    hc = None if h0_np is None else h0_np + 1j * rng.standard_normal(h0_np.shape)
    if form == "complex":
      a, b = jnp.asarray(ac, jnp.complex64), jnp.asarray(bc, jnp.complex64)
      h0 = None if hc is None else jnp.asarray(hc, jnp.complex64)
    else:
      def planes(z, dt):
        return (jnp.asarray(z.real.astype(np.float32), dt), jnp.asarray(z.imag.astype(np.float32), dt))
      a, b = planes(ac, pick(rng, [dtype, F32])), planes(bc, dtype)
      h0 = None if hc is None else planes(hc, F32)
  reset = np.asarray(rng.random((batch, seq)) < 0.1) if chance(rng, 0.3) else None
  reverse = chance(rng, 0.4)
  final = chance(rng, 0.5)
  bf16 = any(jnp.dtype(x.dtype) == BF16 for x in jax.tree.leaves((a, b)))
  tile = 16 if bf16 else 8
  blocks = pick(rng, [None, (tile * int(rng.integers(1, 4)), pick(rng, [128, 256])), (seq, width),
                      kernels.ScanBlockSizes(tile, None), kernels.ScanBlockSizes(None, 128)])
  if isinstance(blocks, tuple):
    blocks = kernels.ScanBlockSizes(*blocks)
  impl = impl_kw(rng)
  grad = chance(rng, 0.35)
  kw = dict(h0=h0, reverse=reverse, reset=None if reset is None else jnp.asarray(reset), return_final_state=final,
            block_sizes=blocks, **impl)
  config = dict(form=form, gate=gate, a=describe(a), b=describe(b), grad=grad,
                **{k: describe(v) for k, v in kw.items()})

  def joined(xp, x):  # a pair of planes as one complex array
    return x[0] + 1j * x[1] if isinstance(x, (tuple, list)) else x

  def check():
    out = kernels.linear_scan(a, b, **kw)
    h_all, h_last = scan_oracle(np, joined(np, jax.tree.map(to64, a)), joined(np, jax.tree.map(to64, b)),
                                None if h0 is None else joined(np, jax.tree.map(to64, h0)), reset=reset,
                                reverse=reverse)
    if final:
      out, last = out
    tol = SCAN_TOL["bfloat16" if bf16 and form != "complex" else "float32"]
    out_tol = SCAN_TOL[BF16.name if jnp.dtype(jax.tree.leaves(b)[0].dtype) == BF16 else "float32"]
    if form == "pairs":
      close("h.real", out[0], h_all.real, **out_tol, dtype=b[0].dtype)
      close("h.imag", out[1], h_all.imag, **out_tol, dtype=b[0].dtype)
      if final:
        close("h_last.real", last[0], h_last.real, **SCAN_TOL["float32"], dtype=F32)
        close("h_last.imag", last[1], h_last.imag, **SCAN_TOL["float32"], dtype=F32)
    else:
      if form == "complex":
        if out.dtype != jnp.complex64:
          raise Mismatch(f"h: dtype {out.dtype}, documented complex64")
        close("h.real", out.real, h_all.real, **out_tol)
        close("h.imag", out.imag, h_all.imag, **out_tol)
      else:
        close("h", out, h_all, **out_tol, dtype=b.dtype)
      if final:
        if form == "complex":
          close("h_last.real", last.real, h_last.real, **SCAN_TOL["float32"])
          close("h_last.imag", last.imag, h_last.imag, **SCAN_TOL["float32"])
        else:
          close("h_last", last, h_last, **SCAN_TOL["float32"], dtype=F32)
    del tol
    if grad:
      leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
      leaves_h = [] if h0 is None else jax.tree.leaves(h0)
      na, nb = len(leaves_a), len(leaves_b)
      args = leaves_a + leaves_b + leaves_h
      names = ([f"a{i}" for i in range(na)] + [f"b{i}" for i in range(nb)] + [f"h0_{i}" for i in range(len(leaves_h))])

      def regroup(flat):
        g = lambda xs: tuple(xs) if len(xs) == 2 else xs[0]  # noqa: E731
        return g(flat[:na]), g(flat[na:na + nb]), (g(flat[na + nb:]) if leaves_h else None)

      def kernel_fn(*flat):
        a_, b_, h0_ = regroup(flat)
        return kernels.linear_scan(a_, b_, **dict(kw, h0=h0_))

      def oracle(xp, *flat):
        a_, b_, h0_ = regroup(flat)
        hs, hl = scan_oracle(xp, joined(xp, a_), joined(xp, b_), None if h0_ is None else joined(xp, h0_),
                             reset=reset, reverse=reverse)
        if form == "pairs":
          hs, hl = (xp.real(hs), xp.imag(hs)), (xp.real(hl), xp.imag(hl))
        return (hs, hl) if final else hs
      check_vjp(kernel_fn, oracle, args, names, SCAN_GRAD_TOL["bfloat16" if bf16 else "float32"], rng)
  return config, check


def malformed_linear_scan(rng):
  batch, seq, width = dim(rng, 2), dim(rng, 40), dim(rng, 200)
  dtype = pick(rng, [F32, BF16])
  a, b = normal(rng, (batch, seq, width), dtype), normal(rng, (batch, seq, width), dtype)
  kw = dict(block_sizes=kernels.ScanBlockSizes(16, 128), **PALLAS)
  bad = [
      ("a of a shape that is no gate form", "a", {0: normal(rng, (batch, seq, width + 1 + int(rng.integers(5))))}),
      ("a [width + 1]", "a", {0: normal(rng, (width + 1,))}),
      ("b of rank 2", "b", {0: normal(rng, (seq, width)), 1: normal(rng, (seq, width))}),
      ("b empty", "b", {0: jnp.zeros((batch, 0, width)), 1: jnp.zeros((batch, 0, width))}),
      ("integer a", "a", {0: jnp.ones((batch, seq, width), jnp.int32)}),
      ("integer b", "b", {1: jnp.ones((batch, seq, width), jnp.int32)}),
      ("float16 b", "b", {1: b.astype(jnp.float16)}),
      ("complex a with real b", "a", {0: a.astype(jnp.complex64)}),
      ("a pair with b an array", "b", {0: (a, a)}),
      ("a pair of three planes", "a", {0: (a, a, a), 1: (b, b, b)}),
      ("a pair of mismatched planes", "a", {0: (a, a[:, :, :1]), 1: (b, b)}),
      ("h0 of the wrong width", "h0", {"h0": normal(rng, (batch, width + 1))}),
      ("integer h0", "h0", {"h0": jnp.ones((batch, width), jnp.int32)}),
      ("h0 a pair for arrays", "h0", {"h0": (normal(rng, (batch, width)),) * 2}),
      ("integer reset", "reset", {"reset": jnp.zeros((batch, seq), jnp.int32)}),
      ("reset of another length", "reset", {"reset": jnp.zeros((batch, seq + 1), bool)}),
      ("reverse not a bool", "reverse", {"reverse": bad_values(rng, 1, "yes", None)}),
      ("return_final_state not a bool", "return_final_state", {"return_final_state": bad_values(rng, 1, None)}),
      ("block_sizes of three values", "block_sizes", {"block_sizes": (1, 2, 3)}),
      ("non-positive block_sizes", "block_sizes", {"block_sizes": bad_values(rng, kernels.ScanBlockSizes(-8, 128),
                                                                              (0, 128), (8.0, 128))}),
      ("seq_chunk off the row tile", "block_sizes", {"block_sizes": kernels.ScanBlockSizes(12, 128),
                                                      0: normal(rng, (1, 40, 16)), 1: normal(rng, (1, 40, 16))}),
      ("width_block not a multiple of 128", "block_sizes",
       {"block_sizes": kernels.ScanBlockSizes(16, 100), 0: normal(rng, (1, 16, 300)), 1: normal(rng, (1, 16, 300))}),
      ("unknown implementation", "implementation", {"implementation": "cuda"}),
  ]
  return malformed_call(rng, kernels.linear_scan, (a, b), kw, bad)


FAMILIES["linear_scan"] = Family(case_linear_scan, malformed_linear_scan)


# ---------------------------------------------------------------------------------
# ssd and gated_linear_attention
# ---------------------------------------------------------------------------------
# Tolerances. float32: the chunked algorithm forms decays as exponentials of cumulative sums and
# contracts over the state and the chunk in f32: 5e-5 of the largest output (outputs are O(1-10)).
# bfloat16 inputs (x, B, C; products on the MXU with f32 sums, the output rounded once): 3e-2 of the
# largest output. Gradients: f32 5e-4, bf16 5e-2 of the largest entry.
SSD_TOL = {"float32": dict(atol=5e-5, rtol=5e-5), "bfloat16": dict(atol=3e-2, rtol=2 ** -7)}
SSD_GRAD_TOL = {"float32": 5e-4, "bfloat16": 5e-2}


def ssd_oracle(xp, x, log_decay, scale, B, C, D, h0, *, reset):
  """Per head ``h_t = exp(log_decay_t) h_{t-1} + scale_t x_t B_t^T`` ([head_dim, state]) and
  ``y_t = h_t C_t + D x_t``; head ``i`` reads group ``i // (heads // groups)`` of B and C. Returns (y, h_last)."""
  batch, seq, heads, p = x.shape
  rep = heads // B.shape[2]
  B, C = xp.repeat(B, rep, axis=2), xp.repeat(C, rep, axis=2)
  h = xp.zeros((batch, heads, p, B.shape[-1]), x.dtype) if h0 is None else h0 + xp.zeros((1,), x.dtype)
  u = x if scale is None else x * scale[..., None]
  drop = np.zeros((batch, seq), bool) if reset is None else reset

  def step(h, inp):
    x_t, u_t, g_t, b_t, c_t, drop_t = inp
    h = xp.exp(g_t)[:, :, None, None] * xp.where(drop_t[:, None, None, None], 0.0, h) + u_t[..., None] * b_t[:, :, None]
    y = xp.einsum("bhpn,bhn->bhp", h, c_t)
    return h, (y if D is None else y + D[None, :, None] * x_t)
  h, ys = time_scan(xp, step, h, [xp.moveaxis(t, 1, 0) for t in (x, u, log_decay, B, C)] + [np.moveaxis(drop, 1, 0)])
  return xp.moveaxis(ys, 0, 1), h


def _ssd_sizes(rng, seq):
  """chunk_size: a multiple of 128 or at least seq (or None for the default)."""
  return pick(rng, [None, seq + int(rng.integers(0, 20)), 128, 256] if seq > 128 else [None, seq, seq + 5, 128])


def _heads_per_step(rng, heads, groups):
  per_group = heads // groups
  ok = [n for n in range(1, heads + 1) if heads % n == 0 and (n % per_group == 0 or per_group % n == 0)]
  return pick(rng, ok)


def case_ssd(rng):
  gla = chance(rng, 0.35)
  dtype = pick(rng, [F32, BF16])
  batch, seq = dim(rng, 2), dim(rng, 300) if chance(rng, 0.3) else dim(rng, 140)
  groups = dim(rng, 2)
  heads = groups * pick(rng, [1, 1, 2, 3])
  p, n = dim(rng, 40), dim(rng, 40)
  chunk = _ssd_sizes(rng, seq)
  blocks = None if chance(rng, 0.5) else kernels.SsdBlockSizes(None, _heads_per_step(rng, heads, groups))
  reset = np.asarray(rng.random((batch, seq)) < 0.05) if chance(rng, 0.25) else None
  final = chance(rng, 0.5)
  backward = pick(rng, [None, "pallas", "xla"])
  impl = impl_kw(rng)
  grad = chance(rng, 0.3)
  kw = dict(chunk_size=chunk, reset=None if reset is None else jnp.asarray(reset), return_final_state=final,
            block_sizes=blocks, backward=backward, **impl)
  if gla:  # gated_linear_attention: one group per head, no input scale, log_decay in place of dt * A
    heads = groups
    q, k = normal(rng, (batch, seq, heads, n), dtype), normal(rng, (batch, seq, heads, n), dtype, 1 / math.sqrt(n))
    v = normal(rng, (batch, seq, heads, p), dtype)
    log_decay = jnp.asarray(-np.log1p(np.exp(rng.standard_normal((batch, seq, heads)))).astype(np.float32) * 0.5,
                            pick(rng, [F32, BF16]))
    h0 = normal(rng, (batch, heads, p, n), F32) if chance(rng, 0.3) else None
    kw["h0"] = h0
    kw["block_sizes"] = None if blocks is None else kernels.SsdBlockSizes(None, _heads_per_step(rng, heads, heads))
    args, names = [q, k, v, log_decay] + ([h0] if h0 is not None else []), ["q", "k", "v", "log_decay", "h0"]
    config = dict(fn="gated_linear_attention", q=describe(q), k=describe(k), v=describe(v),
                  log_decay=describe(log_decay), grad=grad, **{k_: describe(v_) for k_, v_ in kw.items()})

    def run(q, k, v, g, *h):
      return kernels.gated_linear_attention(q, k, v, g, **dict(kw, h0=h[0] if h else None))

    def oracle(xp, q, k, v, g, *h):
      y, hl = ssd_oracle(xp, v, g, None, k, q, None, h[0] if h else None, reset=reset)
      return (y, hl) if final else y
  else:
    x = normal(rng, (batch, seq, heads, p), dtype)
    dt = jnp.asarray((np.log1p(np.exp(rng.standard_normal((batch, seq, heads)))) * 0.5).astype(np.float32),
                     pick(rng, [F32, BF16]))
    A = jnp.asarray(-np.exp(rng.uniform(-1.5, 0.5, heads)).astype(np.float32))
    B = normal(rng, (batch, seq, groups, n), dtype)
    C = normal(rng, (batch, seq, groups, n), dtype, 1 / math.sqrt(n))
    D = normal(rng, (heads,), F32) if chance(rng, 0.5) else None
    h0 = normal(rng, (batch, heads, p, n), F32) if chance(rng, 0.3) else None
    args = [x, dt, A, B, C] + [t for t in (D, h0) if t is not None]
    names = ["x", "dt", "A", "B", "C"] + (["D"] if D is not None else []) + (["h0"] if h0 is not None else [])
    config = dict(fn="ssd", x=describe(x), dt=describe(dt), A=describe(A), B=describe(B), C=describe(C),
                  D=describe(D), h0=describe(h0), grad=grad, **{k_: describe(v_) for k_, v_ in kw.items()})

    def unpack(a):
      extra = dict(zip(names[5:], a[5:]))
      return a[:5], extra.get("D"), extra.get("h0")

    def run(*a):
      (x_, dt_, A_, B_, C_), D_, h0_ = unpack(a)
      return kernels.ssd(x_, dt_, A_, B_, C_, D=D_, h0=h0_, **kw)

    def oracle(xp, *a):
      (x_, dt_, A_, B_, C_), D_, h0_ = unpack(a)
      y, hl = ssd_oracle(xp, x_, dt_ * A_, dt_, B_, C_, D_, h0_, reset=reset)
      return (y, hl) if final else y

  def check():
    out = run(*args)
    want = oracle(np, *[to64(t) for t in args])
    tol = SSD_TOL[dtype.name]
    if final:
      close("h_last", out[1], want[1], **tol, dtype=F32)
      out, want = out[0], want[0]
    close("y", out, want, **tol, dtype=dtype)
    if grad:
      check_vjp(run, oracle, args, names, SSD_GRAD_TOL[dtype.name], rng)
  return config, check


def malformed_ssd(rng):
  batch, seq, groups, n, p = dim(rng, 2), dim(rng, 60), dim(rng, 2), dim(rng, 16), dim(rng, 16)
  heads = 2 * groups
  dtype = pick(rng, [F32, BF16])
  x, dt = normal(rng, (batch, seq, heads, p), dtype), normal(rng, (batch, seq, heads))
  A = -jnp.ones((heads,))
  B, C = normal(rng, (batch, seq, groups, n), dtype), normal(rng, (batch, seq, groups, n), dtype)
  kw = dict(chunk_size=128 if seq > 128 else seq, **PALLAS)
  if chance(rng, 0.3):  # gated_linear_attention's own checks
    q, v, g = normal(rng, (batch, seq, heads, n), dtype), normal(rng, (batch, seq, heads, p), dtype), dt
    bad = [
        ("k of another key_dim", "k", {1: normal(rng, (batch, seq, heads, n + 1), dtype)}),
        ("v of another seq", "v", {2: normal(rng, (batch, seq + 1, heads, p), dtype)}),
        ("log_decay of the wrong shape", "log_decay", {3: normal(rng, (batch, seq, heads + 1))}),
        ("integer log_decay", "log_decay", {3: jnp.zeros((batch, seq, heads), jnp.int32)}),
        ("q of rank 3", "q", {0: q[0]}),
        ("h0 of the wrong shape", "h0", {"h0": normal(rng, (batch, heads, n, p + 1))}),
    ]
    return malformed_call(rng, kernels.gated_linear_attention, (q, q, v, g), kw, bad)
  bad = [
      ("x of rank 3", "x", {0: x[0]}),
      ("dt of the wrong heads", "dt", {1: normal(rng, (batch, seq, heads + 1))}),
      ("A of the wrong length", "A", {2: -jnp.ones((heads + 1,))}),
      ("groups that do not divide heads", "B", {3: normal(rng, (batch, seq, heads + 1, n), dtype),
                                                4: normal(rng, (batch, seq, heads + 1, n), dtype)}),
      ("C of another state size", "C", {4: normal(rng, (batch, seq, groups, n + 1), dtype)}),
      ("integer x", "x", {0: jnp.ones(x.shape, jnp.int32)}),
      ("no tokens", ("x", EMPTY), {0: jnp.zeros((batch, 0, heads, p), dtype), 1: jnp.zeros((batch, 0, heads)),
                                    3: jnp.zeros((batch, 0, groups, n), dtype),
                                    4: jnp.zeros((batch, 0, groups, n), dtype), "chunk_size": None}),
      ("integer dt", "dt", {1: jnp.ones(dt.shape, jnp.int32)}),
      ("B of another dtype", "B", {3: B.astype(F32 if dtype == BF16 else BF16)}),
      ("integer reset", "reset", {"reset": jnp.zeros((batch, seq), jnp.int32)}),
      ("reset of another length", "reset", {"reset": jnp.zeros((batch, seq + 1), bool)}),
      ("h0 [head_dim, state] swapped", "h0", {"h0": normal(rng, (batch, heads, n + 1, p))}),
      ("D of rank 2", "D", {"D": normal(rng, (1, heads))}),
      ("return_final_state not a bool", "return_final_state", {"return_final_state": 1}),
      ("chunk_size not a multiple of 128", "chunk_size", {"chunk_size": 100, 0: normal(rng, (1, 300, heads, p), dtype),
                                                         1: normal(rng, (1, 300, heads)),
                                                         3: normal(rng, (1, 300, groups, n), dtype),
                                                         4: normal(rng, (1, 300, groups, n), dtype)}),
      ("chunk_size not positive", "chunk_size", {"chunk_size": bad_values(rng, 0, -128)}),
      ("heads_per_step that does not divide heads", "block_sizes",
       {"block_sizes": kernels.SsdBlockSizes(None, heads + 1)}),
      ("unknown backward", "backward", {"backward": bad_values(rng, "triton", 1)}),
      ("unknown implementation", "implementation", {"implementation": "cuda"}),
  ]
  return malformed_call(rng, kernels.ssd, (x, dt, A, B, C), kw, bad)


FAMILIES["ssd"] = Family(case_ssd, malformed_ssd)


# ---------------------------------------------------------------------------------
# parallel_scan
# ---------------------------------------------------------------------------------
# Tolerances. float32 (full-precision products): the segments' corrections multiply by powers of A:
# 5e-5 of the largest output. All-bf16 parameters multiply bf16 operands, the state rounded to bf16
# at every step: 5e-2 of the largest output; a bf16 x alone rounds the output once (2^-8 relative).
# Gradients: f32 5e-4, bf16 operands 5e-2 of the largest entry.
PSCAN_TOL = {"float32": dict(atol=5e-5, rtol=5e-5), "bfloat16": dict(atol=5e-2, rtol=2 ** -7),
             "bf16_out": dict(atol=2e-3, rtol=2 ** -8)}
PSCAN_GRAD_TOL = {"float32": 5e-4, "bfloat16": 5e-2}


def pscan_oracle(xp, x, A, B, C, h0):
  """``h_t = h_{t-1} A + x_t B``, ``y_t = h_t C`` for x [batch, seq, d_in] (or [seq, d_in])."""
  unbatched = x.ndim == 2
  if unbatched:
    x = x[None]
    h0 = None if h0 is None else h0[None]
  h = xp.zeros((x.shape[0], A.shape[0]), x.dtype) if h0 is None else h0 + xp.zeros((1,), x.dtype)

  def step(h, inp):
    h = h @ A + inp[0] @ B
    return h, h @ C
  _, ys = time_scan(xp, step, h, [xp.moveaxis(x, 1, 0)])
  y = xp.moveaxis(ys, 0, 1)
  return y[0] if unbatched else y


def case_parallel_scan(rng):
  all_bf16 = chance(rng, 0.3)
  seq, d_in, n, d_out = dim(rng, 120), dim(rng, 24), dim(rng, 24), dim(rng, 24)
  batched = chance(rng, 0.75)
  batch = dim(rng, 3)
  dts = [BF16] * 4 if all_bf16 else [pick(rng, [F32, F32, BF16]) for _ in range(4)]
  a = rng.standard_normal((n, n))
  a = a / max(np.linalg.norm(a, 2), 1e-9) * rng.uniform(0.3, 0.95)  # contracting: the state stays O(1)
  x = normal(rng, ((batch,) if batched else ()) + (seq, d_in), dts[0])
  A = jnp.asarray(a.astype(np.float32), dts[1])
  B = normal(rng, (d_in, n), dts[2], 1 / math.sqrt(d_in))
  C = normal(rng, (n, d_out), dts[3], 1 / math.sqrt(n))
  h0 = normal(rng, ((batch,) if batched else ()) + (n,), pick(rng, [F32, BF16])) if chance(rng, 0.35) else None
  segments = pick(rng, [None, 1, 2, 3, int(rng.integers(1, seq + 1))])
  checkpoint = chance(rng, 0.5)
  impl = impl_kw(rng)
  grad = chance(rng, 0.3)
  kw = dict(num_segments=segments, checkpoint=checkpoint, **impl)
  args = [x, A, B, C] + ([h0] if h0 is not None else [])
  names = ["x", "A", "B", "C", "h0"][:len(args)]
  config = dict(x=describe(x), A=describe(A), B=describe(B), C=describe(C), h0=describe(h0), grad=grad,
                **{k: describe(v) for k, v in kw.items()})

  def run(x, A, B, C, *h):
    return kernels.parallel_scan(x, A, B, C, h0=h[0] if h else None, **kw)

  def oracle(xp, x, A, B, C, *h):
    return pscan_oracle(xp, x, A, B, C, h[0] if h else None)

  def check():
    out = run(*args)
    tol = PSCAN_TOL["bfloat16" if all_bf16 else ("bf16_out" if dts[0] == BF16 else "float32")]
    close("y", out, oracle(np, *[to64(t) for t in args]), **tol, dtype=dts[0])
    if grad:
      check_vjp(run, oracle, args, names, PSCAN_GRAD_TOL["bfloat16" if BF16 in dts else "float32"], rng)
  return config, check


def malformed_parallel_scan(rng):
  batch, seq, d_in, n, d_out = dim(rng, 2), dim(rng, 30), dim(rng, 8), dim(rng, 8), dim(rng, 8)
  x, A = normal(rng, (batch, seq, d_in)), normal(rng, (n, n), scale=0.1)
  B, C = normal(rng, (d_in, n)), normal(rng, (n, d_out))
  bad = [
      ("integer x", "x", {0: jnp.ones((batch, seq, d_in), jnp.int32)}),
      ("x of rank 4", "x", {0: jnp.ones((2, batch, seq, d_in))}),
      ("x of rank 1", "x", {0: jnp.ones((d_in,))}),
      ("no tokens", ("x", EMPTY), {0: jnp.zeros((batch, 0, d_in))}),
      ("A not square", "A", {1: normal(rng, (n, n + 1))}),
      ("integer A", "A", {1: jnp.ones((n, n), jnp.int32)}),
      ("B of the wrong d_in", "B", {2: normal(rng, (d_in + 1, n))}),
      ("C of the wrong state", "C", {3: normal(rng, (n + 1, d_out))}),
      ("float16 C", "C", {3: C.astype(jnp.float16)}),
      ("h0 of the wrong batch", "h0", {"h0": normal(rng, (batch + 1, n))}),
      ("integer h0", "h0", {"h0": jnp.ones((batch, n), jnp.int32)}),
      ("num_segments not a positive int", "num_segments", {"num_segments": bad_values(rng, 0, -1, 2.0, "2", True)}),
      ("checkpoint not a bool", "checkpoint", {"checkpoint": bad_values(rng, None, 1, "yes")}),
      ("unknown implementation", "implementation", {"implementation": "cuda"}),
  ]
  return malformed_call(rng, kernels.parallel_scan, (x, A, B, C), dict(PALLAS), bad)


FAMILIES["parallel_scan"] = Family(case_parallel_scan, malformed_parallel_scan)


# ---------------------------------------------------------------------------------
# gmm and tgmm
# ---------------------------------------------------------------------------------
# Tolerances (lhs scaled by 1/sqrt(k), so entries are O(1)). float32 out: f32 sums in another order:
# 2e-5. bfloat16 out: one rounding (2^-9): 2^-8 relative, 1e-3 absolute. Quantized rhs: int8/fp8
# values convert exactly and are scaled in f32: as the output dtype. Gradients: f32 1e-4, bf16 2e-2.
GMM_TOL = {"float32": dict(atol=2e-5, rtol=2e-5), "bfloat16": dict(atol=1e-3, rtol=2 ** -8)}
GMM_GRAD_TOL = {"float32": 1e-4, "bfloat16": 2e-2}


def group_rows(sizes, tokens: int) -> list[tuple[int, int]]:
  """Each group's rows [start, end): a negative size counts as 0 and the running sum stops at ``tokens``."""
  rows, start = [], 0
  for s in np.asarray(sizes, np.int64):
    end = min(start + max(int(s), 0), tokens)
    rows.append((start, end))
    start = end
  return rows


def _masks(rows, tokens):
  masks = np.zeros((len(rows), tokens))
  for g, (s, e) in enumerate(rows):
    masks[g, s:e] = 1.0
  return masks


def gmm_oracle(xp, lhs, rhs, *, rows, transpose_rhs, scale=None):
  """Rows of group g are ``lhs[rows] @ rhs[g]`` (times ``scale[g]``); rows past the last group are 0."""
  masks = _masks(rows, lhs.shape[0])
  out = 0.0
  for g in range(len(rows)):
    w = xp.swapaxes(rhs[g], 0, 1) if transpose_rhs else rhs[g]
    part = (lhs * masks[g][:, None]) @ w
    out = out + (part if scale is None else part * xp.reshape(scale[g], (1, -1)))
  return out + xp.zeros((lhs.shape[0], rhs.shape[1] if transpose_rhs else rhs.shape[2]))


def tgmm_oracle(xp, lhs, rhs, *, rows):
  """``out[g] = lhs[:, rows of g] @ rhs[rows of g]``: [experts, k, n], zero for an empty group."""
  masks = _masks(rows, lhs.shape[1])
  return xp.stack([(lhs * masks[g][None, :]) @ rhs for g in range(len(rows))])


def _group_sizes(rng, experts, tokens, traced):
  kind = pick(rng, ["balanced", "skewed", "empty", "short", "none", "one", "random"] + (["clipped"] if traced else []))
  if kind == "balanced":
    sizes = np.full(experts, tokens // experts)
  elif kind == "skewed":
    w = np.sort(rng.dirichlet(np.full(experts, 0.3)))[::-1]
    sizes = np.floor(w * tokens).astype(np.int64)
  elif kind == "empty":
    sizes = rng.multinomial(tokens, np.full(experts, 1 / experts)) * (rng.random(experts) < 0.5)
  elif kind == "short":
    sizes = rng.multinomial(int(rng.integers(0, tokens + 1)), np.full(experts, 1 / experts))
  elif kind == "none":
    sizes = np.zeros(experts, np.int64)
  elif kind == "one":
    sizes = np.zeros(experts, np.int64)
    sizes[int(rng.integers(experts))] = tokens
  elif kind == "random":
    sizes = rng.multinomial(tokens, rng.dirichlet(np.ones(experts)))
  else:  # traced only: negative sizes and a sum past tokens, which the kernel clips
    sizes = rng.integers(-tokens // 2, tokens, experts)
  return kind, np.asarray(sizes, np.int64)


def _gmm_blocks(rng):
  if chance(rng, 0.2):
    return None
  return (pick(rng, [128, 256, 512]), pick(rng, [128, 256, 512]), pick(rng, [128, 256, 512]))


def case_gmm(rng):
  experts = dim(rng, 6)
  tokens, k, n = dim(rng, 400), dim(rng, 300), dim(rng, 300)
  dtype = pick(rng, [F32, BF16])
  quant = pick(rng, [None] * 4 + list(QUANT))
  transpose_rhs = chance(rng, 0.4)
  traced = chance(rng, 0.3)
  kind, sizes = _group_sizes(rng, experts, tokens, traced)
  lhs = normal(rng, (tokens, k), dtype, 1 / math.sqrt(k))
  rshape = (experts, n, k) if transpose_rhs else (experts, k, n)
  rhs = normal(rng, rshape, dtype) if quant is None else _quantized(rng, rshape, quant)
  scale = None
  if quant is not None:
    amp = 1 / 80 if quant == jnp.int8 else 0.5
    scale = jnp.asarray((rng.uniform(0.5, 1.5, pick(rng, [(experts, n), (experts, 1, n)])) * amp).astype(np.float32),
                        pick(rng, [F32, BF16]))
  pet = pick(rng, [None, F32, BF16])
  blocks = _gmm_blocks(rng)
  impl = impl_kw(rng)
  grad = quant is None and chance(rng, 0.35)
  kw = dict(transpose_rhs=transpose_rhs, preferred_element_type=pet, rhs_scale=scale, block_sizes=blocks, **impl)
  config = dict(lhs=describe(lhs), rhs=describe(rhs), group_sizes=f"{kind} {sizes.tolist()}", traced=traced, grad=grad,
                **{k_: describe(v) for k_, v in kw.items()})
  gs = jnp.asarray(sizes, jnp.int32)

  def run(lhs, rhs):
    if traced:
      return jax.jit(lambda a, b, g: kernels.gmm(a, b, g, **kw))(lhs, rhs, gs)
    return kernels.gmm(lhs, rhs, gs, **kw)
  rows = group_rows(sizes, tokens)

  def check():
    out = run(lhs, rhs)
    odt = jnp.dtype(pet or dtype)
    want = gmm_oracle(np, to64(lhs), to64(rhs), rows=rows, transpose_rhs=transpose_rhs,
                      scale=None if scale is None else to64(scale))
    close("out", out, want, **GMM_TOL[odt.name], dtype=odt, shape=(tokens, n))
    if grad:
      check_vjp(run, lambda xp, a, b: gmm_oracle(xp, a, b, rows=rows, transpose_rhs=transpose_rhs), [lhs, rhs],
                ["lhs", "rhs"], GMM_GRAD_TOL["bfloat16" if BF16 in (dtype, odt) else "float32"], rng)
  return config, check


def case_tgmm(rng):
  experts = dim(rng, 6)
  tokens, k, n = dim(rng, 400), dim(rng, 200), dim(rng, 200)
  dtype = pick(rng, [F32, BF16])
  traced = chance(rng, 0.3)
  kind, sizes = _group_sizes(rng, experts, tokens, traced)
  lhs = normal(rng, (k, tokens), dtype, 1 / math.sqrt(tokens))
  rhs = normal(rng, (tokens, n), dtype)
  pet = pick(rng, [None, F32, BF16])
  blocks = _gmm_blocks(rng)
  impl = impl_kw(rng)
  kw = dict(preferred_element_type=pet, block_sizes=blocks, **impl)
  config = dict(lhs=describe(lhs), rhs=describe(rhs), group_sizes=f"{kind} {sizes.tolist()}", traced=traced,
                **{k_: describe(v) for k_, v in kw.items()})
  gs = jnp.asarray(sizes, jnp.int32)

  def check():
    if traced:
      out = jax.jit(lambda a, b, g: kernels.tgmm(a, b, g, **kw))(lhs, rhs, gs)
    else:
      out = kernels.tgmm(lhs, rhs, gs, **kw)
    odt = jnp.dtype(pet or dtype)
    want = tgmm_oracle(np, to64(lhs), to64(rhs), rows=group_rows(sizes, tokens))
    close("out", out, want, **GMM_TOL[odt.name], dtype=odt, shape=(experts, k, n))
  return config, check


def malformed_gmm(rng, transposed=False):
  experts, tokens, k, n = dim(rng, 4), dim(rng, 200), dim(rng, 160), dim(rng, 160)
  dtype = pick(rng, [F32, BF16])
  sizes = jnp.asarray(rng.multinomial(tokens, np.full(experts, 1 / experts)), jnp.int32)
  kw = dict(block_sizes=(128, 128, 128), **PALLAS)
  if transposed:
    lhs, rhs = normal(rng, (k, tokens), dtype), normal(rng, (tokens, n), dtype)
    bad = [
        ("lhs of rank 3", "lhs", {0: lhs[None]}),
        ("no tokens", "lhs", {0: jnp.zeros((k, 0), dtype), 1: jnp.zeros((0, n), dtype),
                              2: jnp.zeros((experts,), jnp.int32)}),
        ("rhs of another token count", "rhs", {1: normal(rng, (tokens + 1, n), dtype)}),
        ("rhs of another dtype", "rhs", {1: rhs.astype(F32 if dtype == BF16 else BF16)}),
        ("integer lhs", "lhs", {0: jnp.ones((k, tokens), jnp.int32), 1: jnp.ones((tokens, n), jnp.int32)}),
        ("group sizes summing past tokens", "group_sizes", {2: sizes.at[0].add(1)}),
        ("a negative group size", "group_sizes", {2: sizes.at[0].set(-1)}),
        ("float group sizes", "group_sizes", {2: sizes.astype(jnp.float32)}),
        ("group sizes of rank 2", "group_sizes", {2: sizes[None]}),
        ("no groups", "group_sizes", {2: jnp.zeros((0,), jnp.int32)}),
        ("group sizes a list", "group_sizes", {2: [tokens]}),
        ("block_sizes off 128", "block_sizes", {"block_sizes": (100, 128, 128), 0: normal(rng, (k, 300), dtype),
                                                1: normal(rng, (300, n), dtype)}),
        ("unknown preferred_element_type", "preferred_element_type", {"preferred_element_type": jnp.int8}),
        ("unknown implementation", "implementation", {"implementation": "cuda"}),
    ]
    return malformed_call(rng, kernels.tgmm, (lhs, rhs, sizes), kw, bad)
  lhs, rhs = normal(rng, (tokens, k), dtype), normal(rng, (experts, k, n), dtype)
  bad = [
      ("lhs of rank 3", "lhs", {0: lhs[None]}),
      ("lhs a list", "lhs", {0: [[1.0]]}),
      ("no tokens", "lhs", {0: jnp.zeros((0, k), dtype), 2: jnp.zeros((experts,), jnp.int32)}),
      ("rhs of rank 2", "rhs", {1: rhs[0]}),
      ("rhs contracting another k", "rhs", {1: normal(rng, (experts, k + 1, n), dtype)}),
      ("rhs of another dtype", "rhs", {1: rhs.astype(F32 if dtype == BF16 else BF16)}),
      ("int8 rhs without rhs_scale", "rhs_scale", {1: _quantized(rng, (experts, k, n), QUANT[0])}),
      ("rhs_scale with a float rhs", "rhs_scale", {"rhs_scale": jnp.ones((experts, n))}),
      ("rhs_scale of the wrong shape", "rhs_scale", {1: _quantized(rng, (experts, k, n), QUANT[0]),
                                                     "rhs_scale": jnp.ones((experts, n + 1))}),
      ("group sizes of another expert count", "group_sizes", {2: jnp.zeros((experts + 1,), jnp.int32)}),
      ("group sizes summing past tokens", "group_sizes", {2: sizes.at[-1].add(1 + int(rng.integers(10)))}),
      ("a negative group size", "group_sizes", {2: sizes.at[0].set(-1)}),
      ("float group sizes", "group_sizes", {2: sizes.astype(jnp.float32)}),
      ("integer lhs", "lhs", {0: jnp.ones((tokens, k), jnp.int32), 1: jnp.ones((experts, k, n), jnp.int32)}),
      ("transpose_rhs not a bool", "transpose_rhs", {"transpose_rhs": bad_values(rng, 1, None)}),
      ("block_sizes off 128", "block_sizes", {"block_sizes": (100, 128, 128), 0: normal(rng, (300, k), dtype)}),
      ("block_sizes of two values", "block_sizes", {"block_sizes": (128, 128)}),
      ("unknown preferred_element_type", "preferred_element_type", {"preferred_element_type": jnp.int32}),
      ("unknown implementation", "implementation", {"implementation": "cuda"}),
  ]
  return malformed_call(rng, kernels.gmm, (lhs, rhs, sizes), kw, bad)


FAMILIES["gmm"] = Family(case_gmm, malformed_gmm)
FAMILIES["tgmm"] = Family(case_tgmm, lambda rng: malformed_gmm(rng, transposed=True))


# ---------------------------------------------------------------------------------
# route and moe
# ---------------------------------------------------------------------------------
# Tolerances. Routing: expert ids, drops, the kept order and the counts exactly; combine weights and
# losses in f32: 1e-5 (bf16 x: the router logits from bf16 operands, f32 sums: the same). The layer:
# float32 5e-5 of the largest output; bfloat16 (the grouped matmuls' bf16 outputs, the activation
# product rounded to bf16 before the down projection) 3e-2. Gradients: f32 5e-4, bf16 5e-2; the router's
# alone (XLA, f32 sums; bf16 gradients summed over the tokens and rounded once) f32 1e-4, bf16 1e-2.
ROUTE_TOL = dict(atol=1e-5, rtol=1e-5)
ROUTE_GRAD_TOL = {"float32": 1e-4, "bfloat16": 1e-2}
MOE_TOL = {"float32": dict(atol=5e-5, rtol=5e-5), "bfloat16": dict(atol=3e-2, rtol=2 ** -7)}
MOE_GRAD_TOL = {"float32": 5e-4, "bfloat16": 5e-2}


def routing_choice(logits, *, top_k, scoring, expert_bias, capacity_factor):
  """NumPy: (expert ids [t, k], kept [t, k], the kept assignments in sorted order, counts) from float64 logits."""
  tokens, experts = logits.shape
  scores = _scores(np, logits, scoring)
  sel = scores + (0.0 if expert_bias is None else expert_bias)
  ids = np.argsort(-sel, axis=1, kind="stable")[:, :top_k]  # ties: the lower expert id first
  kept = np.ones((tokens, top_k), bool)
  if capacity_factor is not None:
    capacity = math.ceil(capacity_factor * tokens * top_k / experts)
    taken = np.zeros(experts, int)
    for s in range(top_k):  # priority s * tokens + t: first choices first, then earlier tokens
      for t in range(tokens):
        e = ids[t, s]
        kept[t, s] = taken[e] < capacity
        taken[e] += kept[t, s]
  order = [t * top_k + s for e in range(experts) for s in range(top_k) for t in range(tokens)
           if ids[t, s] == e and kept[t, s]]
  return ids, kept, order


def _scores(xp, logits, scoring):
  if scoring == "softmax":
    z = logits - xp.max(logits, axis=1, keepdims=True)
    return xp.exp(z) / xp.sum(xp.exp(z), axis=1, keepdims=True)
  return 1 / (1 + xp.exp(-logits))


def routing_oracle(xp, x, router_w, *, ids, kept, scoring, normalize):
  """Combine weights [t, k] (0 where dropped), load-balancing loss and z-loss, differentiable in x and router_w."""
  tokens, experts = x.shape[0], router_w.shape[1]
  logits = x @ router_w
  scores = _scores(xp, logits, scoring)
  onehot = (ids[..., None] == np.arange(experts)).astype(np.float64)  # [t, k, e]
  w = xp.einsum("tke,te->tk", onehot, scores)
  if normalize:
    w = w / xp.sum(w, axis=1, keepdims=True)
  w = w * kept
  frac = onehot.sum((0, 1)) / (tokens * ids.shape[1])  # before drops, not differentiable
  probs = scores if scoring == "softmax" else scores / xp.sum(scores, axis=1, keepdims=True)
  lb = experts * xp.sum(frac * xp.mean(probs, axis=0))
  m = xp.max(logits, axis=1, keepdims=True)
  lse = (m + xp.log(xp.sum(xp.exp(logits - m), axis=1, keepdims=True)))[:, 0]
  return w, lb, xp.mean(lse ** 2)


def moe_oracle(xp, x, router_w, w_gate, w_up, w_down, *, ids, kept, scoring, normalize, act):
  """``y[t] = sum_s w[t, s] (act(x w_gate[e]) * (x w_up[e])) w_down[e]``, every expert run densely, then picked."""
  w, lb, z = routing_oracle(xp, x, router_w, ids=ids, kept=kept, scoring=scoring, normalize=normalize)
  if w_up is None:
    f = w_gate.shape[-1] // 2
    w_gate, w_up = w_gate[..., :f], w_gate[..., f:]
  gate = xp.einsum("td,edf->etf", x, w_gate)
  if act == "silu":
    a = gate * 0.5 * (1 + xp.tanh(gate / 2))
  elif act == "gelu":  # the tanh approximation
    a = 0.5 * gate * (1 + xp.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate ** 3)))
  else:
    a = xp.maximum(gate, 0)
  dense = xp.einsum("etf,efd->etd", a * xp.einsum("td,edf->etf", x, w_up), w_down)  # [e, t, d]
  onehot = (ids[..., None] == np.arange(w_down.shape[0])).astype(np.float64)  # [t, k, e]
  y = xp.einsum("tk,tke,etd->td", w, onehot, dense)
  return y, lb, z


def _router(rng, tokens, d, experts, top_k, scoring, bias, dtype):
  """x and router_w whose top-k choice has a clear margin (no near-ties that rounding could flip)."""
  for _ in range(50):
    x = normal(rng, (tokens, d), dtype)
    rw = normal(rng, (d, experts), dtype, 1 / math.sqrt(d))
    sel = _scores(np, to64(x) @ to64(rw), scoring) + (0.0 if bias is None else to64(bias))
    srt = -np.sort(-sel, axis=1)
    if top_k == experts or (srt[:, top_k - 1] - srt[:, top_k]).min() > 1e-3:
      return x, rw
  raise RuntimeError("no routing without near-ties in 50 draws")


def _routing_problem(rng, max_tokens):
  experts = int(rng.integers(2, 7))
  top_k = int(rng.integers(1, min(3, experts) + 1))
  tokens, d = dim(rng, max_tokens), dim(rng, 32)
  scoring = pick(rng, ["softmax", "sigmoid"])
  bias = normal(rng, (experts,), F32, 0.3) if chance(rng, 0.25) else None
  capacity = pick(rng, [None, None, 0.5, 1.0, 1.5])
  return experts, top_k, tokens, d, scoring, bias, capacity


def case_route(rng):
  experts, top_k, tokens, d, scoring, bias, capacity = _routing_problem(rng, 64)
  dtype = pick(rng, [F32, BF16])
  normalize = chance(rng, 0.7)
  x, rw = _router(rng, tokens, d, experts, top_k, scoring, bias, dtype)
  grad = chance(rng, 0.4)
  kw = dict(top_k=top_k, scoring=scoring, normalize_weights=normalize, expert_bias=bias, capacity_factor=capacity)
  config = dict(x=describe(x), router_w=describe(rw), grad=grad, **{k: describe(v) for k, v in kw.items()})

  route = jax.jit(lambda x, rw: kernels.route(x, rw, **kw))  # one compile, not one per eager op

  def check():
    r = route(x, rw)
    logits = to64(x) @ to64(rw)
    ids, kept, order = routing_choice(logits, top_k=top_k, scoring=scoring,
                                      expert_bias=None if bias is None else to64(bias), capacity_factor=capacity)
    exact = [("expert_ids", r.expert_ids, ids), ("dropped", r.dropped, ~kept),
             ("group_sizes", r.group_sizes, np.bincount(ids[kept], minlength=experts)),
             ("expert_load", r.expert_load, np.bincount(ids.ravel(), minlength=experts))]
    for name, got, want in exact:
      if tuple(got.shape) != want.shape or not np.array_equal(np.asarray(got), want):
        raise Mismatch(f"{name}: got {np.asarray(got).tolist()}, want {want.tolist()}")
    got_order = np.asarray(r.order)
    n_kept = len(order)
    if got_order.shape != (tokens * top_k,) or not np.array_equal(got_order[:n_kept], order):
      raise Mismatch(f"order: kept assignments {got_order[:n_kept].tolist()}, want {order}")
    if sorted(got_order[n_kept:].tolist()) != sorted(np.flatnonzero(~kept.ravel()).tolist()):
      raise Mismatch(f"order: the tail {got_order[n_kept:].tolist()} is not the dropped assignments")
    inverse = np.empty(tokens * top_k, int)
    inverse[got_order] = np.arange(tokens * top_k)
    if not np.array_equal(np.asarray(r.position).ravel(), inverse):
      raise Mismatch(f"position is not the inverse of order: {np.asarray(r.position).tolist()}")
    w, lb, z = routing_oracle(np, to64(x), to64(rw), ids=ids, kept=kept, scoring=scoring, normalize=normalize)
    close("weights", r.weights, w, **ROUTE_TOL, dtype=F32)
    close("load_balancing_loss", r.load_balancing_loss, lb, **ROUTE_TOL, dtype=F32)
    close("z_loss", r.z_loss, z, **ROUTE_TOL, dtype=F32)
    if grad:
      okw = dict(ids=ids, kept=kept, scoring=scoring, normalize=normalize)

      def run(x, rw):
        r = route(x, rw)
        return r.weights, r.load_balancing_loss, r.z_loss
      check_vjp(run, lambda xp, x, rw: routing_oracle(xp, x, rw, **okw), [x, rw], ["x", "router_w"],
                ROUTE_GRAD_TOL[dtype.name], rng)
  return config, check


def case_moe(rng):
  experts, top_k, tokens, d, scoring, bias, capacity = _routing_problem(rng, 40)
  dtype = pick(rng, [F32, BF16])
  f = dim(rng, 48)
  normalize = chance(rng, 0.7)
  act = pick(rng, ["silu", "gelu", "relu"])
  x, rw = _router(rng, tokens, d, experts, top_k, scoring, bias, dtype)
  wg, wu = normal(rng, (experts, d, f), dtype, 1 / math.sqrt(d)), normal(rng, (experts, d, f), dtype, 1 / math.sqrt(d))
  wd = normal(rng, (experts, f, d), dtype, 1 / math.sqrt(f))
  fused = chance(rng, 0.3)  # w_up=None and w_gate the concatenated [experts, d, 2f]
  if fused:
    wg, wu = jnp.concatenate([wg, wu], axis=-1), None
  impl = impl_kw(rng)
  grad = chance(rng, 0.3)
  kw = dict(top_k=top_k, activation=act, capacity_factor=capacity, scoring=scoring, normalize_weights=normalize,
            expert_bias=bias, **impl)
  config = dict(x=describe(x), router_w=describe(rw), w_gate=describe(wg), w_up=describe(wu), w_down=describe(wd),
                grad=grad, **{k: describe(v) for k, v in kw.items()})

  def check():
    y, aux = kernels.moe(x, rw, wg, wu, wd, **kw)
    logits = to64(x) @ to64(rw)
    ids, kept, _ = routing_choice(logits, top_k=top_k, scoring=scoring,
                                  expert_bias=None if bias is None else to64(bias), capacity_factor=capacity)
    okw = dict(ids=ids, kept=kept, scoring=scoring, normalize=normalize, act=act)
    want, lb, z = moe_oracle(np, to64(x), to64(rw), to64(wg), None if wu is None else to64(wu), to64(wd), **okw)
    close("y", y, want, **MOE_TOL[dtype.name], dtype=dtype)
    close("load_balancing_loss", aux["load_balancing_loss"], lb, **ROUTE_TOL)
    close("z_loss", aux["z_loss"], z, **ROUTE_TOL)
    for name, want_counts in (("expert_load", np.bincount(ids.ravel(), minlength=experts)),
                              ("group_sizes", np.bincount(ids[kept], minlength=experts))):
      if not np.array_equal(np.asarray(aux[name]), want_counts):
        raise Mismatch(f"aux[{name!r}]: got {np.asarray(aux[name]).tolist()}, want {want_counts.tolist()}")
    close("dropped_fraction", aux["dropped_fraction"], np.float64((~kept).mean()), atol=1e-7)
    if grad:
      args = [x, rw, wg] + ([wu] if wu is not None else []) + [wd]
      names = ["x", "router_w", "w_gate"] + (["w_up"] if wu is not None else []) + ["w_down"]

      def split(a):
        return (a[0], a[1], a[2], a[3], a[4]) if wu is not None else (a[0], a[1], a[2], None, a[3])

      def run(*a):
        y, aux = kernels.moe(*split(a), **kw)
        return y, aux["load_balancing_loss"], aux["z_loss"]
      check_vjp(run, lambda xp, *a: moe_oracle(xp, *split(a), **okw), args, names, MOE_GRAD_TOL[dtype.name], rng)
  return config, check


def malformed_moe(rng):
  experts, top_k, tokens, d, scoring, bias, capacity = _routing_problem(rng, 24)
  f = dim(rng, 16)
  x, rw = normal(rng, (tokens, d)), normal(rng, (d, experts))
  wg, wu, wd = normal(rng, (experts, d, f)), normal(rng, (experts, d, f)), normal(rng, (experts, f, d))
  if chance(rng, 0.3):  # route's own checks
    bad = [
        ("top_k above experts", "top_k", {"top_k": experts + 1}),
        ("top_k 0", "top_k", {"top_k": bad_values(rng, 0, -1, 1.5)}),
        ("x of rank 3", "x", {0: x[None]}),
        ("router_w of another d", "router_w", {1: normal(rng, (d + 1, experts))}),
        ("unknown scoring", "scoring", {"scoring": bad_values(rng, "tanh", "", None)}),
        ("capacity_factor not positive", "capacity_factor",
         {"capacity_factor": bad_values(rng, 0.0, -1.0, float("nan"))}),
        ("no tokens", ("x", EMPTY), {0: jnp.zeros((0, d))}),
        ("expert_bias of the wrong length", "expert_bias", {"expert_bias": jnp.zeros(experts + 1)}),
        ("integer x", "x", {0: jnp.ones((tokens, d), jnp.int32)}),
    ]
    return malformed_call(rng, kernels.route, (x, rw), dict(top_k=top_k), bad)
  bad = [
      ("top_k above experts", "top_k", {"top_k": experts + 1}),
      ("top_k 0", "top_k", {"top_k": 0}),
      ("x of rank 3", "x", {0: x[None]}),
      ("router_w of another d", "router_w", {1: normal(rng, (d + 1, experts))}),
      ("w_gate of another expert count", "w_gate", {2: normal(rng, (experts + 1, d, f))}),
      ("w_gate of rank 2", "w_gate", {2: wg[0]}),
      ("w_up of another f", "w_up", {3: normal(rng, (experts, d, f + 1))}),
      ("w_down of another expert count", "w_down", {4: normal(rng, (experts + 1, f, d))}),
      ("w_down of another f", "w_down", {4: normal(rng, (experts, f + 1, d))}),
      ("w_up=None with an odd w_gate", "w_gate", {2: normal(rng, (experts, d, 2 * f + 1)), 3: None}),
      ("unknown scoring", "scoring", {"scoring": "tanh"}),
      ("no tokens", ("x", EMPTY), {0: jnp.zeros((0, d))}),
      ("capacity_factor not positive", "capacity_factor", {"capacity_factor": bad_values(rng, 0.0, -0.5)}),
      ("expert_bias of the wrong length", "expert_bias", {"expert_bias": jnp.zeros(experts + 2)}),
      ("unknown activation", "activation", {"activation": bad_values(rng, "swish", "tanh", None)}),
      ("unknown implementation", "implementation", {"implementation": "cuda"}),
  ]
  return malformed_call(rng, kernels.moe, (x, rw, wg, wu, wd), dict(top_k=top_k, **PALLAS), bad)


FAMILIES["route"] = Family(case_route, malformed_moe)
FAMILIES["moe"] = Family(case_moe, malformed_moe)


# ---------------------------------------------------------------------------------
# fft, ifft, rfft, irfft, fft2, ifft2, rfft2, irfft2
# ---------------------------------------------------------------------------------
# Tolerances, as max |got - want| / max |want| (a DFT mixes every input into every output, so an
# elementwise relative error means nothing near zeros), per precision: "highest" (f32-level) 1e-5,
# "high" (bf16x3) 1e-4, "bfloat16" (one bf16 pass) 2e-2; the 2-D transforms compose two: 3e-2 at
# "bfloat16". The XLA path (implementation=None) is f32 FFT: "highest"'s bound. Gradients are
# transforms too: the same bounds.
FFT_BOUND = {"highest": 1e-5, "high": 1e-4, "bfloat16": 2e-2}
FFT_OPS = ("fft", "ifft", "rfft", "irfft", "fft2", "ifft2", "rfft2", "irfft2")


def dft(xp, x, n, axis, norm, inverse):
  """The DFT of length ``n`` along ``axis`` by its matrix (``x`` zero-padded or truncated to ``n``)."""
  x = xp.moveaxis(x, axis, -1)
  m = x.shape[-1]
  if n < m:
    x = x[..., :n]
  elif n > m:
    x = xp.concatenate([x, xp.zeros(x.shape[:-1] + (n - m,), x.dtype)], axis=-1)
  jk = np.outer(np.arange(n), np.arange(n)) % n  # exact phases: j * k reduced mod n in integers
  f = np.exp((2j if inverse else -2j) * np.pi * jk / n)
  scale = {None: 1 / n if inverse else 1.0, "backward": 1 / n if inverse else 1.0, "ortho": 1 / math.sqrt(n),
           "forward": 1.0 if inverse else 1 / n}[norm]
  return xp.moveaxis((x @ f) * scale, -1, axis)


def idft_real(xp, x, n, axis, norm):
  """irfft: the real signal of length ``n`` whose spectrum's first n//2 + 1 entries are ``x`` (Hermitian)."""
  x = xp.moveaxis(x, axis, -1)
  half = n // 2 + 1
  if x.shape[-1] >= half:
    x = x[..., :half]
  else:
    x = xp.concatenate([x, xp.zeros(x.shape[:-1] + (half - x.shape[-1],), x.dtype)], axis=-1)
  full = xp.concatenate([x, xp.conj(x[..., 1:n - n // 2][..., ::-1])], axis=-1)
  return xp.moveaxis(xp.real(dft(xp, full, n, -1, norm, True)), -1, axis)


def fft_oracle(xp, x, *, op, n, axis, norm, s=None, axes=None):
  if op in ("fft", "ifft"):
    return dft(xp, x, n or x.shape[axis], axis, norm, op == "ifft")
  if op == "rfft":
    m = n or x.shape[axis]
    y = dft(xp, x, m, axis, norm, False)
    return xp.moveaxis(xp.moveaxis(y, axis, -1)[..., :m // 2 + 1], -1, axis)
  if op == "irfft":
    return idft_real(xp, x, n or 2 * (x.shape[axis] - 1), axis, norm)
  axes = tuple(a % x.ndim for a in axes)
  if op in ("fft2", "ifft2"):
    for i, a in enumerate(axes):
      x = dft(xp, x, s[i] if s else x.shape[a], a, norm, op == "ifft2")
    return x
  if op == "rfft2":
    x = fft_oracle(xp, x, op="rfft", n=s[-1] if s else None, axis=axes[-1], norm=norm)
    for i, a in enumerate(axes[:-1]):
      x = dft(xp, x, s[i] if s else x.shape[a], a, norm, False)
    return x
  for i, a in enumerate(axes[:-1]):  # irfft2: the inverse on the leading axes, then irfft on the last
    x = dft(xp, x, s[i] if s else x.shape[a], a, norm, True)
  return idft_real(xp, x, s[-1] if s else 2 * (x.shape[axes[-1]] - 1), axes[-1], norm)


def _fft_length(rng, small=512):
  """A length the Pallas kernels take: any up to 512 (one stage), or a multiple of 128 (two stages)."""
  if chance(rng, 0.15):
    return pick(rng, [640, 768, 1024, 1152, 2048])
  return dim(rng, small)


def _complex(rng, shape):
  return jnp.asarray(rng.standard_normal(shape) + 1j * rng.standard_normal(shape), jnp.complex64)


def case_fft(rng):
  op = pick(rng, FFT_OPS)
  precision = pick(rng, ["highest", "high", "bfloat16"])
  norm = pick(rng, [None, "backward", "ortho", "forward"])
  impl = impl_kw(rng)
  grad = chance(rng, 0.3)
  kw = dict(norm=norm, precision=precision, **impl)
  two_d = op.endswith("2")
  pairs = False
  if not two_d:
    rank = pick(rng, [1, 2, 2, 3])
    axis = int(rng.integers(-rank, rank))
    length = _fft_length(rng)
    n = None if chance(rng, 0.6) else _fft_length(rng)
    if op == "irfft":  # the output length n must be a kernel length; the input holds n // 2 + 1 or so
      out_n = n if n is not None else None
      if out_n is None:
        length = max(2, min(length, 257))
        out_n = 2 * (length - 1)
        if out_n > 512 and out_n % 128:
          length, out_n = 129, 256
      elif chance(rng, 0.7):
        length = out_n // 2 + 1 + int(rng.integers(-2, 3))
        length = max(1, length)
    shape = [dim(rng, 4) for _ in range(rank)]
    shape[axis] = length
    while math.prod(shape) > 4096 and max(shape) > 1:  # keep each case small
      j = int(np.argmax([d if i != axis % rank else 0 for i, d in enumerate(shape)]))
      if shape[j] == 1:
        break
      shape[j] = 1
    real = op == "rfft" or (op == "fft" and chance(rng, 0.2))
    x = normal(rng, shape) if real else _complex(rng, shape)
    pairs = op in ("fft", "ifft") and not real and chance(rng, 0.3)
    kw.update(n=n, axis=axis)
    okw = dict(op=op, n=n, axis=axis, norm=norm)
  else:
    rank = pick(rng, [2, 3])
    axes = pick(rng, [(-2, -1), (-2, -1), (0, -1), (1, 0)] if rank == 3 else [(-2, -1), (1, 0), (0, 1)])
    shape = [dim(rng, 3)] * rank
    for a in axes:
      shape[a] = dim(rng, 40)
    if op == "irfft2":
      shape[axes[-1]] = max(2, shape[axes[-1]])
    s = None if chance(rng, 0.6) else tuple(dim(rng, 40) for _ in axes)
    x = normal(rng, shape) if op == "rfft2" else _complex(rng, shape)
    kw.update(s=s, axes=axes)
    okw = dict(op=op, n=None, axis=None, norm=norm, s=s, axes=axes)
  fn = getattr(kernels, op)
  bound = FFT_BOUND[precision] * (1.5 if two_d and precision == "bfloat16" else 1.0)
  config = dict(op=op, x=describe(x), pairs=pairs, grad=grad, **{k: describe(v) for k, v in kw.items()})

  def run(*planes):
    if pairs:
      return fn((planes[0], planes[1]), **kw)
    return fn(planes[0], **kw)

  def oracle(xp, *planes):
    z = planes[0] + 1j * planes[1] if pairs else planes[0]
    y = fft_oracle(xp, z, **okw)
    return (xp.real(y), xp.imag(y)) if pairs else y

  args = [jnp.real(x), jnp.imag(x)] if pairs else [x]

  def check():
    out = run(*args)
    want = oracle(np, *[to64(a) for a in args])
    if pairs:
      scale = max(np.abs(want[0]).max(initial=0), np.abs(want[1]).max(initial=0), 1e-30)
      close("real", out[0], want[0], atol=bound * scale, floor=1.0, dtype=F32)
      close("imag", out[1], want[1], atol=bound * scale, floor=1.0, dtype=F32)
    else:
      odt = F32 if op in ("irfft", "irfft2") else jnp.dtype(jnp.complex64)
      close("out", out, want, atol=bound, floor=1e-30, dtype=odt)
    if grad:
      check_vjp(run, oracle, args, ["x.real", "x.imag"] if pairs else ["x"], bound, rng, floor=1e-30)
  return config, check


def malformed_fft(rng):
  op = pick(rng, FFT_OPS)
  fn = getattr(kernels, op)
  length = dim(rng, 64, lo=2)
  x = normal(rng, (2, length)) if op in ("rfft", "rfft2") else _complex(rng, (2, length))
  bad = [
      ("unknown norm", "norm", {"norm": bad_values(rng, "both", "unitary", 1)}),
      ("unknown precision", "precision", {"precision": bad_values(rng, "ultra", "float32", None)}),
      ("unknown implementation", "implementation", {"implementation": "cuda"}),
      ("x a list", "x", {0: [1.0, 2.0]}),
      ("an empty batch", ("x", EMPTY), {0: jnp.zeros((0, length), x.dtype)}),
  ]
  if op.endswith("2"):
    bad += [
        ("axes naming one axis twice", "axes", {"axes": (1, 1)}),
        ("axes out of range", "axes", {"axes": (0, 5)}),
        ("s of another length than axes", "s", {"s": (4, 4, 4)}),
        ("s with a zero", "s", {"s": (2, 0)}),
        ("x of rank 1", ("x", "axes"), {0: x[0]}),
    ]
  else:
    bad += [
        ("n of 0", "n", {"n": bad_values(rng, 0, -4)}),
        ("n not an int", "n", {"n": bad_values(rng, 4.0, "8")}),
        ("axis out of range", "axis", {"axis": bad_values(rng, 2, -3, 7)}),
        ("a length no Pallas kernel takes", "n", {"n": pick(rng, [1031, 1543, 2053]), "implementation": "pallas"}),
        ("an empty transform axis", ("x", "n"), {0: jnp.zeros((2, 0), x.dtype)}),
    ]
  if op in ("ifft", "irfft", "ifft2", "irfft2"):  # (a forward transform promotes a real or integer x)
    bad.append(("a real x for an inverse transform", "x", {0: normal(rng, (2, length))}))
    bad.append(("an integer x for an inverse transform", "x", {0: jnp.ones((2, length), jnp.int32)}))
  if op in ("fft", "ifft"):
    bad.append(("a pair of planes of two shapes", "x", {0: (normal(rng, (2, length)), normal(rng, (2, length + 1)))}))
    bad.append(("a pair of integer planes", "x", {0: (jnp.ones((2, length), jnp.int32),) * 2}))
    bad.append(("a pair of complex planes", "x", {0: (x, x)}))
  if op in ("rfft", "rfft2"):
    bad.append(("a complex x for rfft", "x", {0: _complex(rng, (2, length))}))
  return malformed_call(rng, fn, (x,), dict(PALLAS), bad)


FAMILIES["fft"] = Family(case_fft, malformed_fft)


# ---------------------------------------------------------------------------------
# fft_conv
# ---------------------------------------------------------------------------------
# Tolerances, as max |got - want| / max |want| (two transforms and a product): "highest" 2e-5, "high"
# 2e-4, "bfloat16" 3e-2. Gradients (two more transforms): the same.
FFT_CONV_BOUND = {"highest": 2e-5, "high": 2e-4, "bfloat16": 3e-2}


def fft_conv_oracle(xp, u, k, bias, *, causal):
  """``y[t] = sum_{j <= t} k[j] u[t - j]`` (causal) or ``sum_j k[j] u[(t - j) mod seq]``, plus ``bias * u``."""
  seq = u.shape[-1]
  t, j = np.arange(seq)[:, None], np.arange(seq)[None, :]
  idx = (t - j) % seq
  keep = (j <= t) if causal else np.ones((seq, seq), bool)
  y = xp.einsum("bctj,cj->bct", u[..., idx] * keep, k)
  if bias is not None:
    y = y + bias[:, None] * u
  return y


def case_fft_conv(rng):
  causal = chance(rng, 0.6)
  if chance(rng, 0.25):  # lengths that can run fused (a multiple of 128, padded length over 512)
    seq = pick(rng, [384, 512, 640, 1024] if causal else [640, 768, 1024])
  elif causal:
    seq = dim(rng, 256) if chance(rng, 0.7) else 64 * int(rng.integers(5, 9))
  else:
    seq = dim(rng, 512)
  batch, channels = dim(rng, 3), dim(rng, 4)
  precision = pick(rng, ["highest", "high", "bfloat16"])
  u = normal(rng, (batch, channels, seq), pick(rng, [F32, F32, BF16]))
  k = normal(rng, (channels, seq), u.dtype, 1 / math.sqrt(seq))
  bias = normal(rng, (channels,), F32) if chance(rng, 0.4) else None
  impl = impl_kw(rng)
  grad = chance(rng, 0.3)
  kw = dict(causal=causal, precision=precision, **impl)
  config = dict(u=describe(u), k=describe(k), bias=describe(bias), grad=grad,
                **{k_: describe(v) for k_, v in kw.items()})
  args = [u, k] + ([bias] if bias is not None else [])

  def run(u, k, *b):
    return kernels.fft_conv(u, k, bias=b[0] if b else None, **kw)

  def oracle(xp, u, k, *b):
    return fft_conv_oracle(xp, u, k, b[0] if b else None, causal=causal)

  def check():
    out = run(*args)
    close("y", out, oracle(np, *[to64(a) for a in args]), atol=FFT_CONV_BOUND[precision], floor=1e-30, dtype=F32)
    if grad:
      check_vjp(run, oracle, args, ["u", "k", "bias"], FFT_CONV_BOUND[precision], rng, floor=1e-30)
  return config, check


def malformed_fft_conv(rng):
  batch, channels, seq = dim(rng, 2), dim(rng, 3), dim(rng, 128, lo=2)
  u, k = normal(rng, (batch, channels, seq)), normal(rng, (channels, seq))
  bad = [
      ("u of rank 2", "u", {0: u[0]}),
      ("k of another length", "k", {1: normal(rng, (channels, seq + 1))}),
      ("k of other channels", "k", {1: normal(rng, (channels + 1, seq))}),
      ("k of rank 3", "k", {1: k[None]}),
      ("integer u", "u", {0: jnp.ones((batch, channels, seq), jnp.int32)}),
      ("complex u", "u", {0: u.astype(jnp.complex64)}),
      ("an empty batch", ("u", EMPTY), {0: jnp.zeros((0, channels, seq))}),
      ("bias of the wrong length", "bias", {"bias": jnp.ones((channels + 1,))}),
      ("causal not a bool", "causal", {"causal": bad_values(rng, 1, "yes", None)}),
      ("unknown precision", "precision", {"precision": "ultra"}),
      ("unknown implementation", "implementation", {"implementation": "cuda"}),
  ]
  return malformed_call(rng, kernels.fft_conv, (u, k), dict(PALLAS), bad)


FAMILIES["fft_conv"] = Family(case_fft_conv, malformed_fft_conv)


# ---------------------------------------------------------------------------------
# conv2d
# ---------------------------------------------------------------------------------
# Tolerances (weights scaled so outputs are O(1)). float32: direct 2e-5; Winograd's transforms amplify
# rounding: F(2x2,3x3) 5e-5, F(4x4,3x3) 2e-4. bfloat16: direct 1e-2 (one rounding of the f32 result and
# the bf16 MXU operands); Winograd rounds the transformed tiles and filters to bf16: 2e-2 (F2), 6e-2 (F4).
# Gradients: f32 2e-4 (Winograd 1e-3), bf16 5e-2; bf16 Winograd 1e-1: the bias and filter gradients sum
# act'(z) * dy over the image, and z carries the forward's 6e-2 (a correct kernel reached 5.4e-2).
CONV_TOL = {("direct", "float32"): 2e-5, ("winograd2", "float32"): 5e-5, ("winograd4", "float32"): 2e-4,
            ("direct", "bfloat16"): 1e-2, ("winograd2", "bfloat16"): 2e-2, ("winograd4", "bfloat16"): 6e-2}
CONV_GRAD_TOL = {("direct", "float32"): 2e-4, ("winograd", "float32"): 1e-3, ("direct", "bfloat16"): 5e-2,
                 ("winograd", "bfloat16"): 1e-1}


def conv_pads(size, k, stride, dilation, padding):
  """(before, after) padding of one spatial axis; "SAME" keeps ceil(size / stride) outputs, split low first."""
  ek = (k - 1) * dilation + 1
  if padding == "VALID":
    return 0, 0
  total = max((-(-size // stride) - 1) * stride + ek - size, 0)
  return total // 2, total - total // 2


def conv_oracle(xp, x, w, bias, *, strides, pads, dilation, groups, act):
  """NHWC x HWIO: the sum over filter taps of strided, dilated windows times the tap's [cin/g, cout] slice."""
  n, _, _, cin = x.shape
  kh, kw, cg, cout = w.shape
  (pt, pb), (pl, pr) = pads
  x = x[:, max(-pt, 0):x.shape[1] - max(-pb, 0), max(-pl, 0):x.shape[2] - max(-pr, 0)]  # negative padding crops
  x = xp.pad(x, ((0, 0), (max(pt, 0), max(pb, 0)), (max(pl, 0), max(pr, 0)), (0, 0)))
  ho = (x.shape[1] - (kh - 1) * dilation[0] - 1) // strides[0] + 1
  wo = (x.shape[2] - (kw - 1) * dilation[1] - 1) // strides[1] + 1
  out = xp.zeros((n, ho, wo, cout))
  for i in range(kh):
    for j in range(kw):
      r, c = i * dilation[0], j * dilation[1]
      win = x[:, r:r + (ho - 1) * strides[0] + 1:strides[0], c:c + (wo - 1) * strides[1] + 1:strides[1]]
      part = xp.einsum("nhwgc,cgo->nhwgo", xp.reshape(win, (n, ho, wo, groups, cg)),
                       xp.reshape(w[i, j], (cg, groups, cout // groups)))
      out = out + xp.reshape(part, (n, ho, wo, cout))
  if bias is not None:
    out = out + bias
  return activation(xp, out, act)


def case_conv2d(rng):
  dtype = pick(rng, [F32, BF16])
  wino = chance(rng, 0.35)
  n, h, wd = dim(rng, 2), dim(rng, 14), dim(rng, 14)
  if wino:
    kh = kw = 3
    strides, dilation, groups = (1, 1), (1, 1), 1
    cin, cout = dim(rng, 8), dim(rng, 8)
  else:
    kh, kw = dim(rng, 4), dim(rng, 4)
    strides = (dim(rng, 3), dim(rng, 3))
    dilation = (dim(rng, 2), dim(rng, 2))
    groups = pick(rng, [1, 1, 2, 3])
    cin, cout = groups * dim(rng, 4), groups * dim(rng, 4)
  padding = pick(rng, ["SAME", "VALID", "explicit", "explicit"])
  if padding == "explicit":
    lo = -1 if chance(rng, 0.15) else 0
    padding = tuple(tuple(int(v) for v in rng.integers(lo, 3, 2)) for _ in range(2))
  pads = tuple(conv_pads(s, k, st, d, padding) for s, k, st, d in zip((h, wd), (kh, kw), strides, dilation)) \
      if isinstance(padding, str) else padding
  for axis, (size, k, st, d) in enumerate(zip((h, wd), (kh, kw), strides, dilation)):
    if size + sum(pads[axis]) < (k - 1) * d + 1:  # no output: grow the input until there is one
      grow = (k - 1) * d + 1 - size - sum(pads[axis])
      if axis == 0:
        h += grow
      else:
        wd += grow
  if isinstance(padding, str):
    pads = tuple(conv_pads(s, k, st, d, padding) for s, k, st, d in zip((h, wd), (kh, kw), strides, dilation))
  x = normal(rng, (n, h, wd, cin), dtype)
  w = normal(rng, (kh, kw, cin // groups, cout), dtype, 1 / math.sqrt(kh * kw * cin // groups))
  bias = normal(rng, (cout,), pick(rng, [F32, dtype]), 0.5) if chance(rng, 0.5) else None
  act = pick(rng, ACTIVATIONS)
  algorithm = pick(rng, ["winograd", "winograd", None]) if wino else pick(rng, ["direct", "direct", None])
  tile = pick(rng, [None, 2, 4]) if algorithm == "winograd" else None
  prefilter = algorithm == "winograd" and chance(rng, 0.15)
  block_h = None if chance(rng, 0.3) else 4 * int(rng.integers(1, 3)) if wino else int(rng.integers(1, 9))
  blocks = None if block_h is None else kernels.ConvBlockSizes(block_h=block_h)
  out_dtype = pick(rng, [None, F32, BF16])
  precision = pick(rng, [None, "highest"]) if dtype == F32 else None
  impl = impl_kw(rng)
  if prefilter:
    impl = dict(PALLAS)
  if groups > 1 or dilation != (1, 1):  # the Pallas kernels refuse these (NoImplementationError): XLA serves them
    impl = dict(implementation=pick(rng, [None, "xla"]))
  grad = not prefilter and chance(rng, 0.3)
  kw = dict(strides=strides, padding=padding, rhs_dilation=dilation, feature_group_count=groups, activation=act,
            algorithm=algorithm, tile_size=tile, out_dtype=out_dtype, precision=precision, block_sizes=blocks, **impl)
  config = dict(x=describe(x), w=describe(w), bias=describe(bias), prefiltered=prefilter, grad=grad,
                **{k_: describe(v) for k_, v in kw.items()})
  kind = f"winograd{tile or 4}" if wino else "direct"
  okw = dict(strides=strides, pads=pads, dilation=dilation, groups=groups, act=act)

  def run(x, w, *b):
    return kernels.conv2d(x, w, bias=b[0] if b else None, **kw)

  def check():
    wt = kernels.winograd_filter_transform(w, tile or 4) if prefilter else w
    out = run(x, wt, *([bias] if bias is not None else []))
    odt = jnp.dtype(out_dtype or dtype)
    want = conv_oracle(np, to64(x), to64(w), None if bias is None else to64(bias), **okw)
    rtol = 2 ** -8 if odt == BF16 else 0.0
    close("out", out, want, atol=CONV_TOL[(kind, dtype.name)], rtol=rtol, dtype=odt)
    if grad:
      args = [x, w] + ([bias] if bias is not None else [])
      tol = CONV_GRAD_TOL[("winograd" if wino else "direct", "bfloat16" if BF16 in (dtype, odt) else "float32")]
      check_vjp(run, lambda xp, x, w, *b: conv_oracle(xp, x, w, b[0] if b else None, **okw), args, ["x", "w", "bias"],
                tol, rng)
  return config, check


def malformed_conv2d(rng):
  n, h, wd, cin, cout = dim(rng, 2), dim(rng, 10, lo=3), dim(rng, 10, lo=3), 2 * dim(rng, 3), 2 * dim(rng, 3)
  x, w = normal(rng, (n, h, wd, cin)), normal(rng, (3, 3, cin, cout))
  bad = [
      ("x of rank 3", "x", {0: x[0]}),
      ("w of rank 3", "w", {1: w[0]}),
      ("w of other input channels", "w", {1: normal(rng, (3, 3, cin + 1, cout))}),
      ("integer x", "x", {0: jnp.ones(x.shape, jnp.int32)}),
      ("integer w", "w", {1: jnp.ones(w.shape, jnp.int32)}),
      ("an empty batch", ("x", EMPTY), {0: jnp.zeros((0, h, wd, cin))}),
      ("no output channels", ("w", EMPTY), {1: jnp.zeros((3, 3, cin, 0))}),
      ("feature_group_count that does not divide cin", "feature_group_count",
       {"feature_group_count": cin + 1}),
      ("feature_group_count 0", "feature_group_count", {"feature_group_count": bad_values(rng, 0, -1, 1.5)}),
      ("winograd with strides", "algorithm", {"algorithm": "winograd", "strides": (2, 2)}),
      ("winograd with a 5x5 filter", "algorithm", {"algorithm": "winograd", 1: normal(rng, (5, 5, cin, cout))}),
      ("winograd with dilation", "algorithm", {"algorithm": "winograd", "rhs_dilation": (2, 1)}),
      ("unknown padding", "padding", {"padding": bad_values(rng, "FULL", ((1, 1),), ((1, 1), (1,)), 3,
                                                            ((1.5, 1), (1, 1)))}),
      ("padding that leaves no output", "padding", {"padding": "VALID", 0: normal(rng, (n, 2, 2, cin))}),
      ("tile_size 3", "tile_size", {"algorithm": "winograd", "tile_size": bad_values(rng, 3, 8, 0)}),
      ("tile_size with direct", "tile_size", {"algorithm": "direct", "tile_size": 2}),
      ("unknown algorithm", "algorithm", {"algorithm": bad_values(rng, "fft", "im2col", 1)}),
      ("unknown activation", "activation", {"activation": bad_values(rng, "tanh", "RELU")}),
      ("strides 0", "strides", {"strides": bad_values(rng, 0, (0, 1), (1, 2, 3), (1.0, 1))}),
      ("rhs_dilation 0", "rhs_dilation", {"rhs_dilation": bad_values(rng, 0, (1, 0))}),
      ("bias of the wrong length", "bias", {"bias": jnp.zeros((cout + 1,))}),
      ("block_cin not a multiple of 128", "block_sizes", {"block_sizes": kernels.ConvBlockSizes(block_cin=100)}),
      ("block_h not positive", "block_sizes", {"block_sizes": kernels.ConvBlockSizes(block_h=bad_values(rng, 0, -2))}),
      ("winograd block_h off the tile", "block_sizes", {"algorithm": "winograd", "tile_size": 4,
                                                        "block_sizes": kernels.ConvBlockSizes(block_h=6)}),
      ("block_sizes a tuple", "block_sizes", {"block_sizes": (4, 128, 128)}),
      ("a WinogradFilter with algorithm='direct'", "w",
       {1: kernels.winograd_filter_transform(w), "algorithm": "direct"}),
      ("feature_group_count > 1 on the Pallas kernels", "implementation",
       {"feature_group_count": 2, 1: normal(rng, (3, 3, cin // 2, cout))}),
      ("rhs_dilation on the Pallas kernels", "implementation",
       {"rhs_dilation": (2, 2), 0: normal(rng, (n, 9, 9, cin))}),
      ("a WinogradFilter on XLA", "implementation", {1: kernels.winograd_filter_transform(w), "implementation": "xla",
                                                     "interpret": None}),
      ("unknown implementation", "implementation", {"implementation": "cuda"}),
  ]
  return malformed_call(rng, kernels.conv2d, (x, w), dict(PALLAS), bad)


FAMILIES["conv2d"] = Family(case_conv2d, malformed_conv2d)


# ---------------------------------------------------------------------------------
# The registry and the runner
# ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Failure:
  family: str
  seed: int
  case: int
  kind: str  # "case" or "malformed"
  config: Any
  error: str

  def repro(self) -> str:
    flag = "--case" if self.kind == "case" else "--malformed-case"
    return f"python tools/fuzz.py --family {self.family} --seed {self.seed} {flag} {self.case}"


@dataclasses.dataclass
class Stats:
  family: str
  cases: int = 0
  passed: int = 0
  malformed: int = 0
  malformed_passed: int = 0
  case_seconds: float = 0.0
  malformed_seconds: float = 0.0
  worst: float = 0.0  # the largest error / tolerance ratio among passing cases
  first_case: int | None = None       # the smallest case index run
  first_malformed: int | None = None  # the smallest malformed input index run
  failures: list = dataclasses.field(default_factory=list)

  @property
  def failed(self) -> int:
    return self.cases - self.passed

  def record(self, seed: int) -> dict:
    """The counts as one JSON-able dict (``--log``): enough to add up the pieces of a split run."""
    ids = lambda kind: sorted(f.case for f in self.failures if f.kind == kind)  # noqa: E731
    return dict(family=self.family, seed=seed, cases=self.cases, first_case=self.first_case, passed=self.passed,
                malformed=self.malformed, first_malformed=self.first_malformed,
                malformed_passed=self.malformed_passed, failed_cases=ids("case"),
                failed_malformed=ids("malformed"), case_seconds=round(self.case_seconds, 1),
                malformed_seconds=round(self.malformed_seconds, 1), worst=round(self.worst, 3))

  def line(self) -> str:
    per = self.case_seconds / self.cases if self.cases else 0.0
    return (f"{self.family:16s} cases {self.cases:5d} run, {self.passed:5d} passed, {self.failed:4d} failed; "
            f"malformed {self.malformed:4d} checked, {self.malformed - self.malformed_passed:3d} failed; "
            f"{per:6.2f} s/case; worst error {self.worst:.2f} of tolerance")


def _rng(seed: int, family: str, case: int, stream: int) -> np.random.Generator:
  # A case depends on (seed, family, case) only, so `--family F --case K` reproduces it alone.
  return np.random.default_rng([seed, zlib.crc32(family.encode()), stream, case])


def _error_text(e: BaseException) -> str:
  text = f"{type(e).__name__}: {e}"
  if not isinstance(e, (Mismatch, kernels.KernelError)):
    tb = traceback.extract_tb(e.__traceback__)
    if tb:
      text += f" (at {os.path.relpath(tb[-1].filename, ROOT)}:{tb[-1].lineno})"
  return text if len(text) <= 2000 else text[:2000] + " ..."


def run_case(family: str, seed: int, case: int) -> Failure | None:
  config = "(not generated)"
  try:
    config, check = FAMILIES[family].case(_rng(seed, family, case, 0))
    check()
  except Exception as e:  # noqa: BLE001  (any exception is a finding)
    return Failure(family, seed, case, "case", config, _error_text(e))
  return None


def run_malformed(family: str, seed: int, case: int) -> Failure | None:
  label, argument = "(not generated)", None
  try:
    label, argument, call = FAMILIES[family].malformed(_rng(seed, family, case, 1))
    try:
      result = call()
      jax.block_until_ready(result)
    except kernels.KernelError as e:
      names = (argument,) if isinstance(argument, str) else tuple(argument)
      if e.argument not in names:
        raise Mismatch(f"KernelError names {e.argument!r}, expected {' or '.join(map(repr, names))}: {e}") from None
      return None
    if EMPTY in argument and all(getattr(leaf, "size", 1) == 0 for leaf in jax.tree.leaves(result)):
      return None
    raise Mismatch(f"no KernelError (expected one naming {argument!r}); returned {describe(result)}")
  except Exception as e:  # noqa: BLE001
    return Failure(family, seed, case, "malformed", dict(input=label, argument=argument), _error_text(e))


def fuzz(families, seed: int, cases: int, malformed: int, *, first: int = 0, malformed_first: int = 0,
         only_case=None, only_malformed=None, out=print):
  """Runs the families; returns their Stats (one line each printed by ``out``, with every failure).

  Cases ``first .. first + cases - 1`` and malformed inputs ``malformed_first .. malformed_first + malformed - 1``."""
  all_stats = []
  for family in families:
    stats = Stats(family)
    case_ids = ([] if only_malformed is not None else
                [only_case] if only_case is not None else range(first, first + cases))
    stats.first_case = min(case_ids, default=None)
    for k in case_ids:
      t0 = time.perf_counter()
      _worst[0] = 0.0
      failure = run_case(family, seed, k)
      stats.case_seconds += time.perf_counter() - t0
      stats.cases += 1
      if failure is None:
        stats.passed += 1
        stats.worst = max(stats.worst, _worst[0])
      else:
        stats.failures.append(failure)
        _report(failure, out)
    bad_ids = ([] if only_case is not None else
               [only_malformed] if only_malformed is not None else range(malformed_first, malformed_first + malformed))
    stats.first_malformed = min(bad_ids, default=None)
    for k in bad_ids:
      t0 = time.perf_counter()
      failure = run_malformed(family, seed, k)
      stats.malformed_seconds += time.perf_counter() - t0
      stats.malformed += 1
      if failure is None:
        stats.malformed_passed += 1
      else:
        stats.failures.append(failure)
        _report(failure, out)
    out(stats.line())
    all_stats.append(stats)
  return all_stats


def _report(f: Failure, out):
  out(f"FAIL {f.family} {f.kind} {f.case} (seed {f.seed}): {f.error}\n  config: {f.config}\n  reproduce: {f.repro()}")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--cases", type=int, default=100, help="random cases per family")
  parser.add_argument("--family", action="append", choices=sorted(FAMILIES), help="repeatable; default: all")
  parser.add_argument("--first", type=int, default=0, help="the first case (cases FIRST..FIRST+CASES-1 run)")
  parser.add_argument("--malformed", type=int, default=None,
                      help="malformed inputs per family, from FIRST/5 (default: one per five cases, at least 1)")
  parser.add_argument("--log", default=None, help="append each family's counts to this file as a JSON line")
  parser.add_argument("--case", type=int, default=None, help="run only this case (reproduces a failure)")
  parser.add_argument("--malformed-case", type=int, default=None, help="run only this malformed input")
  args = parser.parse_args(argv)
  # Interpret mode spends its time compiling small XLA:CPU programs; LLVM's optimizations cost more
  # than they save there (tests/cpu_compile.py, which the test suite uses too).
  from tests.cpu_compile import cpu_programs_compile_unoptimized
  cpu_programs_compile_unoptimized()
  # malformed inputs first/5 .. (first+cases)/5 - 1, so that pieces split at multiples of 5 add up to the whole run
  malformed_first = args.first // 5
  malformed = (args.malformed if args.malformed is not None
               else max(1, (args.first + args.cases) // 5 - malformed_first))
  families = args.family or list(FAMILIES)
  t0 = time.perf_counter()
  stats = fuzz(families, args.seed, args.cases, malformed, first=args.first, malformed_first=malformed_first,
               only_case=args.case, only_malformed=args.malformed_case, out=lambda s: print(s, flush=True))
  if args.log:
    with open(args.log, "a") as f:
      for s in stats:
        f.write(json.dumps(s.record(args.seed)) + "\n")
  failed = sum(len(s.failures) for s in stats)
  print(f"total: {sum(s.cases for s in stats)} cases, {sum(s.malformed for s in stats)} malformed inputs, "
        f"{failed} failures, {time.perf_counter() - t0:.0f} s", flush=True)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
