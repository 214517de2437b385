"""The FFT family, fft_conv and conv2d on a device mesh (issue 56).

Numerics: 8 CPU devices (tests/conftest.py), interpret mode, Explicit mode (arrays sharded by
their types) and Auto mode (``kernels.sharding`` rules), forward and ``jax.grad`` against the same
call on one device. A split that only slices locally runs the very same kernel on the same rows, so
those agree to float32 rounding of a different XLA fusion (1e-5 relative to the largest value);
the four-step FFT reorders the arithmetic (a twiddle between two shorter transforms): 1e-4. A
channel-split conv2d adds partial sums in another order: 1e-4 (float32).

AOT: compiled for v5e 2x4 (one on v5p 2x2x2), asserting the collectives in the HLO and each
chip's argument memory (its local share).
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import kernels
from kernels.base import backend
from kernels.base.errors import KernelError

COLLECTIVES = ("all-to-all(", "collective-permute(", "all-reduce(", "all-gather(", "reduce-scatter(")


def _need8():
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 devices (tests/conftest.py asks for 8 CPU devices)")


@pytest.fixture(scope="module")
def mesh():
  _need8()
  return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)


@pytest.fixture(scope="module")
def auto_mesh():
  _need8()
  return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def _rng(seed=0):
  return np.random.default_rng(seed)


def _complex(shape, seed=0):
  r = _rng(seed)
  return jnp.asarray(r.standard_normal(shape) + 1j * r.standard_normal(shape), jnp.complex64)


def _real(shape, seed=0, dtype=jnp.float32):
  return jnp.asarray(_rng(seed).standard_normal(shape), dtype)


def _close(a, b, tol):
  a, b = jax.tree.map(np.asarray, (a, b))
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert u.shape == v.shape
    scale = max(float(np.abs(v).max()), 1e-30)
    assert float(np.abs(u - v).max()) <= tol * scale, (float(np.abs(u - v).max()), scale)


def _loss(fn, seed=1):
  """A real loss of fn's output(s) with fixed random weights (a generic cotangent)."""
  def loss(*args):
    out = fn(*args)
    total = 0.0
    for i, y in enumerate(jax.tree.leaves(out)):
      w = _real(y.shape, seed + i)
      total = total + jnp.sum(jnp.real(y) * w) + (jnp.sum(jnp.imag(y) * w[::-1]) if jnp.iscomplexobj(y) else 0.0)
    return total
  return loss


def _check(fn, args, specs, mesh, *, tol, grad=True):
  """fn on sharded args (Explicit mode) == fn on one device, forward and gradient; the output
  keeps the sharding of the input's logical dimensions."""
  with backend.dry_run():
    want = jax.jit(fn)(*args)
    gwant = jax.jit(jax.grad(_loss(fn), argnums=tuple(range(len(args)))))(*args) if grad else None
    with jax.set_mesh(mesh):
      sharded = [jax.tree.map(lambda a, s=s: jax.device_put(a, s), a) for a, s in zip(args, specs)]
      got = jax.jit(fn)(*sharded)
      ggot = jax.jit(jax.grad(_loss(fn), argnums=tuple(range(len(args)))))(*sharded) if grad else None
  _close(got, want, tol)
  if grad:
    _close(ggot, gwant, tol)
  return got


# ------------------------------------------------------------------------------------------ fft


@pytest.mark.parametrize("spec, rows", [
    (P("data", None), 8),  # batch: local
    (P("data", "model"), 8),  # batch local, fft axis: pencil over model
    (P(None, ("data", "model")), 8),  # pencil over all 8
    (P(None, "model"), 3),  # 3 rows over 4 devices: four-step
])
def test_fft_split_equals_single_device(mesh, spec, rows):
  tol = 1e-4 if rows % 4 else 1e-5
  got = _check(kernels.fft, (_complex((rows, 256)),), (spec,), mesh, tol=tol)
  assert jax.typeof(got).sharding.spec == spec


def test_ifft_planes_split_equal_single_device(mesh):
  x = _complex((8, 256))
  planes = (jnp.real(x), jnp.imag(x))
  fn = lambda p: kernels.ifft(p, norm="ortho")  # noqa: E731
  got = _check(fn, (planes,), (P("data", "model"),), mesh, tol=1e-5)
  assert isinstance(got, tuple) and len(got) == 2
  # four-step on planes, over all 8 devices (2 rows)
  _check(fn, ((planes[0][:2], planes[1][:2]),), (P(None, ("data", "model")),), mesh, tol=1e-4)


def test_fft_of_a_middle_axis_and_real_input(mesh):
  x = _real((4, 256, 6))
  _check(lambda x: kernels.fft(x, axis=1), (x,), (P("data", "model", None),), mesh, tol=1e-5)


def test_rfft_irfft_batch_split_equal_single_device(mesh):
  x = _real((8, 4, 256))
  _check(lambda x: kernels.rfft(x), (x,), (P("data", "model"),), mesh, tol=1e-5)
  y = jnp.fft.rfft(x)
  _check(lambda y: kernels.irfft(y), (y,), (P("data", "model"),), mesh, tol=1e-5)


@pytest.mark.parametrize("op, spec", [
    ("fft2", P("data", "model", None)),  # slab: axes[0] ("fft") split -> pencil on it
    ("fft2", P(None, "data", "model")),  # both axes split: two pencils
    ("ifft2", P("data", None, "model")),  # axes[1] ("fft1") split
    ("rfft2", P("data", "model", None)),
    ("irfft2", P("data", "model", None)),
])
def test_2d_split_equals_single_device(mesh, op, spec):
  x = _complex((2, 128, 128)) if op != "rfft2" else _real((2, 128, 128))
  if op == "irfft2":
    x = jnp.fft.rfft2(_real((2, 128, 128)))  # [2, 128, 65]: the halved last axis stays whole
  _check(getattr(kernels, op), (x,), (spec,), mesh, tol=1e-5)


def test_auto_mode_rules(auto_mesh):
  x = _complex((8, 256))
  with backend.dry_run():
    want = kernels.fft(x)
    xs = jax.device_put(x, NamedSharding(auto_mesh, P("data", "model")))
    with kernels.sharding(auto_mesh, batch="data", fft="model"):
      got = jax.jit(kernels.fft)(xs)
      g = jax.jit(jax.grad(_loss(kernels.fft)))(xs)
    _close(got, want, 1e-5)
    _close(g, jax.grad(_loss(kernels.fft))(x), 1e-5)
    # 2-D, the slab split named once
    x2 = _complex((2, 64, 128))
    with kernels.sharding(auto_mesh, batch="data", fft="model"):
      got = jax.jit(kernels.fft2)(jax.device_put(x2, NamedSharding(auto_mesh, P("data", "model"))))
    _close(got, kernels.fft2(x2), 1e-5)


def test_fft_kernel_errors(mesh, auto_mesh):
  with backend.dry_run(), jax.set_mesh(mesh):
    x = jax.device_put(_real((8, 256)), P(None, "model"))
    with pytest.raises(KernelError, match="n // 2 \\+ 1"):
      jax.jit(kernels.rfft)(x)
    with pytest.raises(KernelError, match="pad or truncate"):
      jax.jit(lambda x: kernels.fft(x, n=512))(x)
    # 3 rows over 8 devices, 8^2 does not divide 96: no four-step
    with pytest.raises(KernelError, match="four-step"):
      jax.jit(kernels.fft)(jax.device_put(_complex((3, 96)), P(None, ("data", "model"))))
  with backend.dry_run(), jax.set_mesh(auto_mesh), pytest.raises(KernelError, match="kernels.sharding"):
    jax.jit(kernels.fft)(jax.device_put(_complex((8, 256)), NamedSharding(auto_mesh, P("data"))))


# ------------------------------------------------------------------------------------ fft_conv


def test_fft_conv_batch_and_channels_split(mesh):
  u, k, b = _real((4, 8, 256)), _real((8, 256), 1), _real((8,), 2)
  fn = lambda u, k, b: kernels.fft_conv(u, k, bias=b, implementation="pallas", interpret=True)  # noqa: E731
  _check(fn, (u, k, b), (P("data", "model"), P("model"), P("model")), mesh, tol=1e-5)


def test_fft_conv_seq_split_is_a_kernel_error(mesh):
  with jax.set_mesh(mesh):
    u = jax.device_put(_real((4, 8, 256)), P("data", None, "model"))
    with pytest.raises(KernelError, match="'seq'.*batch \\(local\\), channels \\(local\\)"):
      jax.jit(lambda u: kernels.fft_conv(u, jnp.ones((8, 256))))(u)


# --------------------------------------------------------------------------------------- conv2d


def _conv(implementation="pallas", **kw):
  return lambda x, w, b=None: kernels.conv2d(x, w, bias=b, implementation=implementation, interpret=True, **kw)


@pytest.mark.parametrize("xspec, wspec, bspec, kw", [
    (P("data"), P(), P(), {}),  # batch: local
    (P("data"), P(None, None, None, "model"), P("model"), dict(activation="relu")),  # features: local
    (P(None, None, None, "model"), P(None, None, "model"), P(), dict(activation="gelu")),  # channels: psum
    (P("data", "model"), P(), P(), dict(activation="silu")),  # height: halo
    (P(None, "data", "model"), P(), P(), {}),  # height and width halos
    (P(None, "model", None, "data"), P(None, None, "data"), P(), dict(rhs_dilation=2, implementation=None)),  # dilated (XLA's conv) halo + psum
])
def test_conv2d_split_equals_single_device(mesh, xspec, wspec, bspec, kw):
  x, w, b = _real((2, 16, 16, 8)), _real((3, 3, 8, 16), 1) * 0.3, _real((16,), 2)
  _check(_conv(**kw), (x, w, b), (xspec, wspec, bspec), mesh, tol=1e-4)


def test_conv2d_winograd_filter_split(mesh):
  x, w, b = _real((2, 16, 16, 8)), _real((3, 3, 8, 16), 1) * 0.3, _real((16,), 2)
  u = kernels.winograd_filter_transform(w)
  fn = _conv(activation="relu", algorithm="winograd")
  with backend.dry_run():
    want = fn(x, u, b)
    with jax.set_mesh(mesh):
      us = kernels.WinogradFilter(jax.device_put(u.u, P(None, None, "model")), u.tile_size)
      got = jax.jit(fn)(jax.device_put(x, P("data", None, None, "model")), us, b)
      _close(got, want, 1e-4)
      got = jax.jit(fn)(jax.device_put(x, P(None, "data", "model")), u, b)  # halos on both axes
      _close(got, want, 1e-4)


def test_conv2d_auto_mode(auto_mesh):
  x, w, b = _real((2, 16, 16, 8)), _real((3, 3, 8, 16), 1) * 0.3, _real((16,), 2)
  fn = _conv(activation="relu")
  want = fn(x, w, b)
  put = lambda a, s: jax.device_put(a, NamedSharding(auto_mesh, s))  # noqa: E731
  with kernels.sharding(auto_mesh, batch="data", channels="model"):
    got = jax.jit(fn)(put(x, P("data", None, None, "model")), put(w, P(None, None, "model")), b)
    g = jax.jit(jax.grad(_loss(fn), argnums=(0, 1, 2)))(put(x, P("data")), put(w, P()), b)
  _close(got, want, 1e-4)
  _close(g, jax.grad(_loss(fn), argnums=(0, 1, 2))(x, w, b), 1e-4)


def test_conv2d_kernel_errors(mesh):
  x, w = _real((2, 16, 16, 8)), _real((3, 3, 8, 16), 1)
  with jax.set_mesh(mesh):
    xh = jax.device_put(x, P(None, "model"))
    with pytest.raises(KernelError, match="VALID"):
      jax.jit(_conv(padding="VALID"))(xh, w)
    with pytest.raises(KernelError, match="stride 1"):
      jax.jit(_conv(strides=2))(xh, w)
    xc = jax.device_put(x, P(None, None, None, "model"))
    with pytest.raises(KernelError, match="grouped"):
      jax.jit(_conv(feature_group_count=2))(xc, jax.device_put(_real((3, 3, 4, 16)), P(None, None, "model")))
    with pytest.raises(KernelError, match="reshard"):  # x splits channels over model, w over data
      jax.jit(_conv())(xc, jax.device_put(w, P(None, None, "data")))
    with pytest.raises(KernelError, match="reaches 3 rows"):  # 7x7 filter, shards of 2 rows
      jax.jit(_conv())(jax.device_put(_real((2, 8, 16, 8)), P(None, "model")), _real((7, 7, 8, 16)))


# ------------------------------------------------------------------------------------------ AOT


def _tpu_mesh(topology="v5e:2x4", shape=(2, 4), names=("data", "model")):
  from kernels.perf import tpu
  return tpu.tpu_mesh(topology, names, shape, explicit=True)


def _sds(mesh, shape, spec, dtype=jnp.float32):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def _compile(fn, *args, generation="v5e"):
  return kernels.compile_for_tpu(fn, *args, generation=generation, profile=False)


def _share(*nbytes):
  """Per-chip argument bytes: each argument's local share, in 512-byte allocations."""
  return sum(-(-int(b) // 512) * 512 for b in nbytes)


def _out_planes(fn):
  """``fn`` with its complex result returned as planes: a multi-chip program exported with a complex64
  result on an Explicit mesh aborts libtpu's Shardy import in the compile worker
  (``import_shardy_attrs.cc: funcResultSharding.getNumOperands() == 1 (2 vs. 1)``)."""
  def f(*args):
    y = fn(*args)
    return (jnp.real(y), jnp.imag(y)) if not isinstance(y, tuple) and jnp.iscomplexobj(y) else y
  return f


def _collectives(hlo):
  """Each collective's count, as ``"all-to-all("`` etc.; an async pair (``-start(`` / ``-done(``) counts once."""
  found = {}
  for op in COLLECTIVES:
    n = len(re.findall(rf" {re.escape(op[:-1])}(?:-start)?\(", hlo))
    if n:
      found[op] = n
  return found


@pytest.mark.tpu_aot
def test_aot_fft_pencil_and_local_splits_on_v5e_2x4():
  mesh = _tpu_mesh()
  # fft axis over all 8 chips: two all-to-alls (one per plane pair), nothing else
  x = _sds(mesh, (64, 8192), P(None, ("data", "model")), jnp.complex64)
  c = _compile(_out_planes(kernels.fft), x)
  assert _collectives(c.hlo) == {"all-to-all(": 2}, _collectives(c.hlo)
  assert c.memory["argument"] == _share(64 * 8192 * 8 // 8)
  g = _compile(_out_planes(jax.grad(lambda x: jnp.sum(jnp.real(kernels.fft(x)) ** 2))), x)
  assert set(_collectives(g.hlo)) == {"all-to-all("}
  # batch over data, the transformed axis over model (plane pair)
  xr = _sds(mesh, (64, 8192), P("data", "model"))
  c = _compile(lambda a, b: kernels.fft((a, b)), xr, xr)
  assert _collectives(c.hlo) == {"all-to-all(": 2}
  assert c.memory["argument"] == _share(64 * 8192 * 4 // 8, 64 * 8192 * 4 // 8)
  # batch only: local
  c = _compile(_out_planes(kernels.fft), _sds(mesh, (64, 8192), P(("data", "model")), jnp.complex64))
  assert _collectives(c.hlo) == {}
  # fft2, slab split: one pencil
  c = _compile(_out_planes(kernels.fft2), _sds(mesh, (8, 1024, 1024), P("data", "model"), jnp.complex64))
  assert _collectives(c.hlo) == {"all-to-all(": 2}


@pytest.mark.tpu_aot
def test_aot_fft_four_step_on_v5p_2x2x2():
  mesh = _tpu_mesh("v5p:2x2x2", (8,), ("x",))
  c = _compile(_out_planes(kernels.fft), _sds(mesh, (1, 65536), P(None, "x"), jnp.complex64), generation="v5p")
  assert _collectives(c.hlo) == {"all-to-all(": 3}, _collectives(c.hlo)
  assert c.memory["argument"] == _share(65536 * 8 // 8)


@pytest.mark.tpu_aot
def test_aot_fft_conv_local_on_v5e_2x4():
  mesh = _tpu_mesh()
  u, k = _sds(mesh, (8, 64, 4096), P("data", "model")), _sds(mesh, (64, 4096), P("model"))
  c = _compile(lambda u, k: kernels.fft_conv(u, k), u, k)
  assert _collectives(c.hlo) == {}
  assert c.memory["argument"] == _share(8 * 64 * 4096 * 4 // 8, 64 * 4096 * 4 // 4)
  g = _compile(jax.grad(lambda u, k: jnp.sum(kernels.fft_conv(u, k) ** 2), argnums=(0, 1)), u, k)
  assert set(_collectives(g.hlo)) == {"all-reduce("}  # k's gradient summed over the batch shards


@pytest.mark.tpu_aot
def test_aot_conv2d_splits_on_v5e_2x4():
  mesh = _tpu_mesh()
  bf = jnp.bfloat16
  x = (8, 64, 64, 128)
  w = (3, 3, 128, 256)
  # batch over data, features over model: local
  c = _compile(lambda x, w, b: kernels.conv2d(x, w, bias=b, activation="relu"), _sds(mesh, x, P("data"), bf),
               _sds(mesh, w, P(None, None, None, "model"), bf), _sds(mesh, (256,), P("model")))
  assert _collectives(c.hlo) == {}
  assert c.memory["argument"] == _share(8 * 64 * 64 * 128 * 2 // 2, 9 * 128 * 256 * 2 // 4, 256 * 4 // 4)
  # channels over model: one all-reduce (512 channels: 128 a chip, no tile padding in the argument layout)
  c = _compile(lambda x, w: kernels.conv2d(x, w, activation="relu"),
               _sds(mesh, (8, 64, 64, 512), P("data", None, None, "model"), bf),
               _sds(mesh, (3, 3, 512, 256), P(None, None, "model"), bf))
  assert _collectives(c.hlo) == {"all-reduce(": 1}
  assert c.memory["argument"] == _share(8 * 64 * 64 * 512 * 2 // 8, 9 * 512 * 256 * 2 // 4)
  # height over model: halos, two collective-permutes
  c = _compile(lambda x, w: kernels.conv2d(x, w), _sds(mesh, x, P("data", "model"), bf), _sds(mesh, w, P(), bf))
  assert _collectives(c.hlo) == {"collective-permute(": 2}
  assert c.memory["argument"] == _share(8 * 64 * 64 * 128 * 2 // 8, 9 * 128 * 256 * 2)
