"""Kernels that partition themselves under ``jit`` on a mesh (kernels.base.partition): norms, matmul,
attention and RoPE. Numerics on 8 CPU devices in interpret mode (a (2, 4) ``("data", "model")`` mesh),
Explicit and Auto mode, forward and gradients against the single-device reference; then the real
lowering, compiled ahead of time for ``v5e:2x4`` and ``v5p:2x2x2``, with its collectives counted.

Tolerances, as max |sharded - reference| / max |reference|, f32: 2e-5 forward and gradients (a split
contraction or hidden axis sums in another order; ring attention merges blocks by their lse)."""
from __future__ import annotations

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import kernels
from kernels.base.backend import dry_run

TOL = 2e-5


def _mesh(kind):
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 devices (tests/conftest.py asks for 8 CPU devices)")
  return jax.make_mesh((2, 4), ("data", "model"), axis_types=(kind,) * 2)


def _rel(got, want):
  return float(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32)).max() / jnp.abs(want).max())


def _check(fn, ref, args, specs, rules, argnums):
  """fn on args split by specs (Explicit mode) and by rules (Auto mode) equals ref, forward and grad."""
  want = ref(*args)
  weights = jax.random.normal(jax.random.key(1), want.shape, jnp.float32)
  loss = lambda f: lambda *a: (f(*a).astype(jnp.float32) * weights).sum()  # noqa: E731
  gwant = jax.grad(loss(ref), argnums=argnums)(*args)
  mesh = _mesh(AxisType.Explicit)
  with jax.set_mesh(mesh), dry_run():
    placed = [jax.device_put(a, s) for a, s in zip(args, specs)]
    out = jax.jit(fn)(*placed)
    grads = jax.jit(jax.grad(loss(fn), argnums=argnums))(*placed)
  if out.shape == args[0].shape:  # an elementwise-shaped result is split like the first operand
    assert _padded(out.sharding.spec, out.ndim) == _padded(specs[0], out.ndim), out.sharding.spec
  assert _rel(out, want) < TOL
  for g, w in zip(grads, gwant):
    assert _rel(g, w) < TOL
  auto = _mesh(AxisType.Auto)
  with kernels.sharding(auto, **rules), dry_run():
    out = jax.jit(fn)(*args)
    grads = jax.jit(jax.grad(loss(fn), argnums=argnums))(*args)
  assert _rel(out, want) < TOL
  for g, w in zip(grads, gwant):
    assert _rel(g, w) < TOL


def _padded(spec, n):
  return tuple(spec) + (None,) * (n - len(spec))


def _normal(*shape, seed=0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


# --- numerics -----------------------------------------------------------------------------------

@pytest.mark.parametrize("split", ["rows", "hidden"])
def test_layer_norm_split(split):
  x, s, b = _normal(4, 16, 256), _normal(256, seed=1), _normal(256, seed=2)
  spec, rules = ((P("data", "model"), dict(batch="data", seq="model")) if split == "rows"
                 else (P("data", None, "model"), dict(batch="data", embed="model")))
  _check(lambda x, s, b: kernels.layer_norm(x, s, b), kernels.layer_norm_reference, (x, s, b), (spec, P(), P()),
         rules, (0, 1, 2))


def test_rms_norm_with_residual_hidden_split():
  x, r, s = _normal(8, 256), _normal(8, 256, seed=1), _normal(256, seed=2)
  f = lambda x, r, s: kernels.rms_norm(x, s, residual=r)[0]  # noqa: E731
  ref = lambda x, r, s: kernels.rms_norm_reference(x, s, residual=r)[0]  # noqa: E731
  _check(f, ref, (x, r, s), (P("data", "model"), P("data", "model"), P()), dict(batch="data", embed="model"),
         (0, 1, 2))


@pytest.mark.parametrize("split", ["rows", "rows+features", "contract", "rows+contract"])
def test_matmul_split(split):
  a, b, bias = _normal(64, 256), _normal(256, 128, seed=1), _normal(128, seed=2)
  specs, rules = {
      "rows": ((P("data"), P(), P()), dict(batch="data")),
      "rows+features": ((P("data"), P(None, "model"), P()), dict(batch="data", features="model")),
      "contract": ((P(None, "model"), P("model"), P()), dict(contract="model")),
      "rows+contract": ((P("data", "model"), P("model"), P()), dict(batch="data", contract="model")),
  }[split]
  kw = dict(activation="gelu", precision="highest")
  _check(lambda a, b, bias: kernels.matmul(a, b, bias=bias, **kw),
         lambda a, b, bias: kernels.matmul_reference(a, b, bias=bias, **kw), (a, b, bias), specs, rules, (0, 1, 2))


@pytest.mark.parametrize("split", ["batch+heads", "seq"])
def test_flash_attention_split(split):
  q, k, v = _normal(2, 256, 8, 128), _normal(2, 256, 4, 128, seed=1), _normal(2, 256, 4, 128, seed=2)
  spec, rules = ((P("data", None, "model"), dict(batch="data", heads="model")) if split == "batch+heads"
                 else (P("data", "model"), dict(batch="data", seq="model")))
  _check(lambda q, k, v: kernels.flash_attention(q, k, v, causal=True),
         lambda q, k, v: kernels.attention_reference(q, k, v, causal=True), (q, k, v), (spec,) * 3, rules, (0, 1, 2))


@pytest.mark.parametrize("split", ["batch+heads", "seq"])
def test_rope_split_uses_global_positions(split):
  x = _normal(2, 64, 4, 128)
  spec, rules = ((P("data", None, "model"), dict(batch="data", heads="model")) if split == "batch+heads"
                 else (P("data", "model"), dict(batch="data", seq="model")))
  _check(kernels.rope, kernels.rope_reference, (x,), (spec,), rules, (0,))


# --- errors -------------------------------------------------------------------------------------

def test_auto_mesh_without_rules_is_a_kernel_error_that_says_what_to_pass():
  mesh = _mesh(AxisType.Auto)
  x = jax.device_put(_normal(8, 256), NamedSharding(mesh, P("data")))
  with pytest.raises(kernels.KernelError, match=r"kernels\.sharding\(mesh"):
    jax.jit(kernels.rms_norm)(x)


def test_unsplittable_and_conflicting_splits_are_kernel_errors():
  mesh = _mesh(AxisType.Explicit)
  with jax.set_mesh(mesh):
    q = jax.device_put(_normal(2, 64, 4, 128), P(None, None, None, "model"))  # head_dim split
    with pytest.raises(kernels.KernelError, match=r"^q=.*cannot split its dimension 3"):
      jax.jit(kernels.flash_attention)(q, q, q)
    a = jax.device_put(_normal(64, 256), P("data"))
    b = jax.device_put(_normal(256, 128), P("model"))  # a's K is whole, b's K split: a reshard, not ours
    with pytest.raises(kernels.KernelError, match=r"splits 'contract'"):
      jax.jit(kernels.matmul)(jax.device_put(_normal(64, 256), P(None, "data")), b)
    with pytest.raises(kernels.KernelError, match=r"^dropout_rate="):
      jax.jit(lambda a, b: kernels.matmul(a, b, dropout_rate=0.1, dropout_key=jax.random.key(0)))(a, b)


def test_rules_name_mesh_axes_that_exist():
  with pytest.raises(kernels.KernelError, match=r"^heads='tensor'"):
    with kernels.sharding(_mesh(AxisType.Auto), heads="tensor"):
      pass


def test_one_device_and_a_user_shard_map_are_unchanged():
  x = _normal(8, 256)
  assert _rel(jax.jit(kernels.rms_norm)(x), kernels.rms_norm_reference(x)) < 1e-6
  mesh = _mesh(AxisType.Explicit)
  f = jax.shard_map(lambda x: kernels.rms_norm(x, implementation="pallas", interpret=True), mesh=mesh,
                    in_specs=P("data"), out_specs=P("data"), check_vma=False)
  with jax.set_mesh(mesh):
    assert _rel(jax.jit(f)(jax.device_put(x, P("data"))), kernels.rms_norm_reference(x)) < 1e-6


# --- the real lowering, ahead of time -----------------------------------------------------------

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")


def collectives(hlo: str) -> dict[str, int]:
  """Collective ops in compiled HLO, by kind (async pairs counted once, by their start)."""
  counts = {c: len(re.findall(rf"(?<![\w%.-]){c}(-start)?\(", hlo)) for c in COLLECTIVES}
  return {c: n for c, n in counts.items() if n}


def _aot(topology, shape, explicit=True):
  from kernels.perf import tpu
  axes = ("data", "model") if len(shape) == 2 else ("data", "model", "expert")
  return tpu.tpu_mesh(topology, axes, shape, explicit=explicit)


def _compile(mesh, fn, shapes_specs, generation, rules=None):
  args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, sp)) for s, d, sp in shapes_specs]
  ctx = kernels.sharding(mesh, **rules) if rules is not None else contextlib.nullcontext()
  with ctx:
    return kernels.compile_for_tpu(fn, *args, generation=generation, profile=False)


BF = jnp.bfloat16


@pytest.mark.tpu_aot
@pytest.mark.parametrize("topology,shape,generation", [("v5e:2x4", (2, 4), "v5e"), ("v5p:2x2x2", (2, 4), "v5p")])
def test_local_splits_compile_without_collectives(topology, shape, generation):
  mesh = _aot(topology, shape)
  cases = [
      (lambda x, s: kernels.rms_norm(x, s), [((8, 512, 1024), BF, P("data", "model")), ((1024,), BF, P())]),
      (lambda a, b: kernels.matmul(a, b), [((2048, 1024), BF, P("data")), ((1024, 1024), BF, P(None, "model"))]),
      (lambda q, k, v: kernels.flash_attention(q, k, v, causal=True),
       [((4, 1024, 8, 128), BF, P("data", None, "model"))] * 3),
      (lambda x: kernels.rope(x), [((4, 1024, 8, 128), BF, P("data", "model"))]),
  ]
  for fn, args in cases:
    c = _compile(mesh, fn, args, generation)
    assert collectives(c.hlo) == {} and c.hlo.count("tpu_custom_call") >= 1
    local = sum(int(np.prod(s)) * jnp.dtype(d).itemsize // int(np.prod([mesh.shape[a] for e in sp for a in
                ((e,) if isinstance(e, str) else e or ())])) for s, d, sp in args)
    assert c.memory["argument"] <= local * 1.01 + 4096, (c.memory, local)  # the local share, not the whole


@pytest.mark.tpu_aot
def test_collective_splits_compile_to_the_expected_collectives_on_v5e_2x4():
  mesh = _aot("v5e:2x4", (2, 4))
  # hidden split: one all-reduce of the [rows] sum of squares; rows over data stay local
  c = _compile(mesh, lambda x, s: kernels.rms_norm(x, s), [((8, 512, 1024), BF, P("data", None, "model")),
                                                           ((1024,), BF, P())], "v5e")
  assert collectives(c.hlo) == {"all-reduce": 1}
  # contraction split: one all-reduce of the f32 partial products
  c = _compile(mesh, lambda a, b: kernels.matmul(a, b), [((2048, 1024), BF, P("data", "model")),
                                                         ((1024, 1024), BF, P("model"))], "v5e")
  assert collectives(c.hlo) == {"all-reduce": 1}
  # sequence split, causal: ring attention, zig-zag balanced: only permutes
  c = _compile(mesh, lambda q, k, v: kernels.flash_attention(q, k, v, causal=True),
               [((4, 2048, 8, 128), BF, P("data", "model"))] * 3, "v5e")
  found = collectives(c.hlo)
  assert set(found) == {"collective-permute"}, found


@pytest.mark.tpu_aot
def test_auto_mode_rules_compile_like_explicit_mode():
  mesh = _aot("v5e:2x4", (2, 4), explicit=False)
  c = _compile(mesh, lambda q, k, v: kernels.flash_attention(q, k, v, causal=True),
               [((4, 1024, 8, 128), BF, P("data", None, "model"))] * 3, "v5e", rules=dict(batch="data", heads="model"))
  assert collectives(c.hlo) == {} and c.hlo.count("tpu_custom_call") == 1


@pytest.mark.tpu_aot
def test_replicated_parameters_get_one_gradient_reduction():
  mesh = _aot("v5e:2x4", (2, 4))
  loss = lambda x, w: kernels.matmul(x, w).astype(jnp.float32).sum()  # noqa: E731
  c = _compile(mesh, jax.grad(loss, argnums=(0, 1)), [((2048, 1024), BF, P(("data", "model"))),
                                                      ((1024, 1024), BF, P())], "v5e")
  assert collectives(c.hlo) == {"all-reduce": 1}
  loss = lambda x, s: kernels.rms_norm(x, s).astype(jnp.float32).sum()  # noqa: E731
  c = _compile(mesh, jax.grad(loss, argnums=(0, 1)), [((8, 512, 1024), BF, P("data", "model")),
                                                      ((1024,), BF, P())], "v5e")
  assert collectives(c.hlo) == {"all-reduce": 1}


def test_hlo_collectives_reads_every_replica_group_form_and_combined_results():
  from kernels.perf import ici
  hlo = "\n".join([
      "  %a = bf16[8192,8192]{1,0} all-reduce(%f), channel_id=1, replica_groups=mesh['axis_0'=1,'axis_1'=8] "
      "{'axis_1'}, use_global_device_ids=true",
      "  %r = f32[8192]{0} all-reduce(%f), replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], "
      "device_ids=([2,4]T(1,0)) {'axis_1'}, use_global_device_ids=true",
      "  %b = (bf16[64,128]{1,0}, f32[64]{0}) all-reduce(%x, %y), replica_groups={{0,1,2,3},{4,5,6,7}}",
      "  %c = f32[8,128]{1,0} all-gather(%z), replica_groups=[4,2]<=[8], dimensions={0}",
      "  %d = (bf16[2,512]{1,0}, bf16[2,512]{1,0}, u32[], u32[]) collective-permute-start(%w), "
      "source_target_pairs={{0,1},{1,0}}",
      "  %e = bf16[2,512]{1,0} collective-permute-done(%d)",
  ])
  assert ici.hlo_collectives(hlo) == [
      {"kind": "all-reduce", "bytes": 8192 * 8192 * 2, "chips": 8},
      {"kind": "all-reduce", "bytes": 8192 * 4, "chips": 4},
      {"kind": "all-reduce", "bytes": 64 * 128 * 2 + 64 * 4, "chips": 4},
      {"kind": "all-gather", "bytes": 8 * 128 * 4, "chips": 2},
      {"kind": "collective-permute", "bytes": 2 * 512 * 2, "chips": 2},
  ]
  assert ici.hlo_seconds(hlo, "v5e") > ici.all_reduce_seconds(8192 * 8192 * 2, 8, "v5e")
