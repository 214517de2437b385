"""How a kernel partitions itself over a device mesh under ``jit``.

Mosaic kernels cannot be partitioned by XLA: on a mesh, each must run inside a ``shard_map`` on its
local shards. Every public kernel therefore starts with :func:`plan`, which finds out how its
operands are split, and, when they are split at all, runs the kernel once per device inside one
``shard_map`` (as MaxText wraps each kernel), with whatever collective the split needs.

Each kernel names the dimensions of its operands with *logical* names (``"batch"``, ``"seq"``,
``"heads"``, ``"embed"``, ``"experts"``, ...; the table is in the docs' sharding page). A logical
dimension is split over the same mesh axes in every operand that has it. Where the split comes from:

- *Explicit sharding* (``jax.sharding.AxisType.Explicit``, JAX's recommended mode): from the
  operands' types, ``jax.typeof(x).sharding``. Nothing to pass. An operand that another operand's
  split does not reach (a replicated norm scale when the hidden axis is split) is sliced locally,
  which moves no data; two operands that split one logical dimension differently are an error,
  never a silent all-gather.
- *Auto sharding* (JAX's default): traced values carry no split, so the caller names it once,
  ``with kernels.sharding(mesh, batch="data", heads="model"):``. On a multi-device mesh without
  it, :func:`plan` raises a :class:`~kernels.base.errors.KernelError` that says so (Mosaic's
  "cannot be automatically partitioned" must never reach a user).
- *Inside a user's own* ``shard_map`` the mesh axes are manual: the kernel runs as it is, on the
  local shard (``kernels.base.calls.pallas_call`` declares its outputs' varying axes).

Our own ``shard_map`` uses ``check_vma=False``: we write its ``out_specs`` ourselves, and JAX's CPU
interpreters cannot yet run kernels that carry varying types. Its transpose reduces the gradient
of an operand replicated over an axis once over that axis, as a data-parallel gradient must be.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Any, Callable, Mapping

import jax
from jax.sharding import AxisType, PartitionSpec as P

from kernels.base.errors import KernelError

_RULES: contextvars.ContextVar = contextvars.ContextVar("kernels_sharding_rules", default=None)


def _axes(entry) -> tuple[str, ...]:
  """A PartitionSpec entry (None, a name or a tuple of names) as a tuple of mesh axis names."""
  if entry is None:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def _entry(axes: tuple[str, ...]):
  return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


@contextlib.contextmanager
def sharding(mesh, rules: Mapping[str, Any] | None = None, **named):
  """Names, for the kernels called inside, which mesh axes split each logical dimension.

  Needed in JAX's default (Auto) sharding mode, where traced values do not carry their split;
  explicitly sharded arrays need nothing. For example, batch over ``data`` and heads over
  ``model``::

      with kernels.sharding(mesh, batch="data", heads="model"):
        out = jax.jit(kernels.flash_attention)(q, k, v, causal=True)

  Args:
    mesh: a ``jax.sharding.Mesh``.
    rules: logical dimension name -> a mesh axis name, a tuple of them, or None; ``named`` (keyword
      arguments) adds more.
  """
  table = dict(rules or {}, **named)
  for name, entry in table.items():
    check_axes = _axes(entry)
    bad = [a for a in check_axes if a not in mesh.axis_names]
    if bad or not isinstance(name, str):
      raise KernelError(str(name), entry, f"names mesh axes {bad} that the mesh {tuple(mesh.axis_names)} does not have")
  token = _RULES.set((mesh, {k: _axes(v) for k, v in table.items()}))
  try:
    yield mesh
  finally:
    _RULES.reset(token)


def _mesh_size(mesh) -> int:
  return math.prod(mesh.shape.values()) if mesh is not None and mesh.axis_names else 1


@dataclasses.dataclass(frozen=True)
class Plan:
  """How one call is split: the mesh, and each logical dimension's mesh axes."""
  op: str
  mesh: Any
  axes: Mapping[str, tuple[str, ...]]  # logical name -> mesh axes (only the split ones)
  explicit: bool

  def of(self, name: str) -> tuple[str, ...]:
    """The mesh axes that split logical dimension ``name`` (empty: not split)."""
    return self.axes.get(name, ())

  def size(self, name: str) -> int:
    return math.prod(self.mesh.shape[a] for a in self.of(name))

  def spec(self, dims) -> P:
    """The PartitionSpec of an operand whose dimensions have logical names ``dims``."""
    return P(*(_entry(self.of(d)) if d is not None else None for d in dims))

  def run(self, local: Callable, operands: Mapping[str, Any], dims: Mapping[str, tuple], out_dims):
    """``local(**operands)`` on every device's shards, in one ``shard_map``.

    ``dims`` gives each operand's logical dimension names; ``out_dims`` is a pytree of tuples with
    the result's structure (a tuple of names per output array)."""
    given = [n for n, x in operands.items() if x is not None]
    args = []
    for n in given:
      x = operands[n]
      want = self.spec(dims[n])
      if self.explicit and hasattr(x, "shape"):
        have = jax.typeof(x).sharding.spec
        if tuple(have) + (None,) * (len(x.shape) - len(have)) != tuple(want) + (None,) * (len(x.shape) - len(want)):
          x = jax.sharding.reshard(x, jax.sharding.NamedSharding(self.mesh, want))  # only ever a local slice: conflicts were rejected by plan()
      args.append(x)
    names = lambda t: isinstance(t, tuple) and all(e is None or isinstance(e, str) for e in t)  # noqa: E731
    out_specs = jax.tree.map(self.spec, out_dims, is_leaf=names)

    def body(*local_args):
      return local(**dict(zip(given, local_args)))

    f = jax.shard_map(body, mesh=self.mesh, in_specs=tuple(self.spec(dims[n]) for n in given),
                      out_specs=out_specs, check_vma=False)
    return f(*args)


def _manual(mesh) -> bool:
  return any(t == AxisType.Manual for t in getattr(mesh, "axis_types", ()))


def plan(op: str, operands: Mapping[str, Any], dims: Mapping[str, tuple], *, splits: Mapping[str, str]) -> Plan | None:
  """How to split ``op`` over the mesh its operands live on, or None to run it as it is.

  Args:
    op: the kernel's public name, for errors.
    operands: argument name -> array (or None, or a non-array, both ignored).
    dims: argument name -> the logical name of each of its dimensions (None: never split).
    splits: the logical names this kernel can split, each with what it then does (``"local"`` or
      the collective, for the error message that lists the alternatives).

  Raises:
    KernelError: a dimension split that the kernel cannot follow, two operands that split one
      logical dimension differently, a split that does not divide its dimension, or a multi-device
      mesh in Auto mode without :func:`sharding` rules.
  """
  arrays = {n: x for n, x in operands.items() if hasattr(x, "shape") and hasattr(x, "dtype")}
  context = jax.sharding.get_abstract_mesh()
  if _manual(context):
    return None  # inside a shard_map: the operands are already the local shards
  types = {n: jax.typeof(x) for n, x in arrays.items()}
  meshes = [t.sharding.mesh for t in types.values() if getattr(t, "sharding", None) is not None]
  if any(_manual(m) for m in meshes):
    return None
  explicit_meshes = [m for m in meshes if _mesh_size(m) > 1 and AxisType.Explicit in m.axis_types]
  rules = _RULES.get()

  if explicit_meshes:
    mesh = explicit_meshes[0]
    axes: dict[str, tuple[str, ...]] = {}
    seen: dict[str, str] = {}
    for n, t in types.items():
      spec = tuple(t.sharding.spec) + (None,) * (len(t.shape) - len(t.sharding.spec))
      for d, (name, entry) in enumerate(zip(dims[n], spec)):
        got = tuple(a for a in _axes(entry) if mesh.shape[a] > 1)
        if not got:
          continue
        if name is None:
          raise KernelError(n, arrays[n], f"{op} cannot split its dimension {d} (split over {got}); "
                                          f"it splits {_alternatives(splits)}")
        if name in axes and axes[name] != got:
          raise KernelError(n, arrays[n], f"{op}: splits {name!r} (dimension {d}) over {got}, but {seen[name]} "
                                          f"splits it over {axes[name]}: reshard one of them (jax.sharding.reshard)")
        axes[name], seen[name] = got, n
    explicit = True
  elif rules is not None and _mesh_size(rules[0]) > 1:
    mesh, table = rules
    used = {name for n in arrays for name in dims[n] if name is not None}
    axes = {name: tuple(a for a in table[name] if mesh.shape[a] > 1) for name in used if table.get(name)}
    axes = {k: v for k, v in axes.items() if v}
    explicit = False
  else:
    multi = [m for m in meshes + [context] if _mesh_size(m) > 1]
    if multi:
      raise KernelError("sharding", None, (f"{op}: "
          f"the operands live on a {dict(multi[0].shape)} mesh in Auto mode, where a Pallas kernel cannot "
          "see how they are split. Name it once, e.g. `with kernels.sharding(mesh, batch=\"data\", "
          "heads=\"model\"):` around the call, or use explicitly sharded arrays "
          "(jax.make_mesh(..., axis_types=(AxisType.Explicit, ...)) and jax.set_mesh)"))
    return None

  for name, got in axes.items():
    if name not in splits:
      who = next(n for n in arrays if name in dims[n])
      raise KernelError(who, arrays[who], f"{op} cannot split its {name!r} dimension (split over {got}); "
                                          f"it splits {_alternatives(splits)}")
  result = Plan(op, mesh, axes, explicit)
  for n, x in arrays.items():
    for d, name in enumerate(dims[n]):
      k = result.size(name) if name is not None else 1
      if x.shape[d] % k:
        raise KernelError(n, x, f"{op}: dimension {d} ({name!r}, {x.shape[d]}) does not divide into {k} shards "
                                f"over {result.of(name)}")
  return result


def _alternatives(splits: Mapping[str, str]) -> str:
  return ", ".join(f"{k} ({v})" for k, v in splits.items()) or "nothing"



def leading_dims(n: int) -> tuple[str, ...]:
  """Logical names of ``n`` leading (row) dimensions: ``batch``, then ``seq`` last if n >= 2, and
  ``batch1``, ``batch2``... between; all split locally by the kernels that take any leading dims."""
  if n <= 0:
    return ()
  if n == 1:
    return ("batch",)
  return ("batch",) + tuple(f"batch{i}" for i in range(1, n - 1)) + ("seq",)


# Collectives that a family's split needs but that live in kernels.distributed (built on the families,
# so a family cannot import it): kernels.distributed registers them when it is imported, which
# `import kernels` always does.
_COLLECTIVES: dict[str, Callable] = {}


def register(name: str, fn: Callable) -> Callable:
  """Makes ``fn`` the collective called ``name`` (e.g. ``"flash_attention.seq"``: ring attention)."""
  _COLLECTIVES[name] = fn
  return fn


def collective(name: str) -> Callable:
  if name not in _COLLECTIVES:
    raise KernelError("sharding", name, "needs kernels.distributed: `import kernels` (not only a family) first")
  return _COLLECTIVES[name]


def axis_position(axis_name) -> tuple[int, Any]:
  """(size, this device's index) of a mesh axis, or of several taken together (a tuple of names,
  major first, as one PartitionSpec entry splits a dimension over them). Inside a ``shard_map``."""
  from jax import lax
  names = _axes(axis_name)
  if not names or not all(isinstance(a, str) for a in names):
    raise KernelError("axis_name", axis_name, "must be a mesh axis name or a tuple of them")
  try:
    n = math.prod(int(lax.axis_size(a)) for a in names)
  except NameError as e:
    raise KernelError("axis_name", axis_name, "is not a bound mesh axis: call this inside jax.shard_map over a "
                                              "mesh with that axis") from e
  return n, lax.axis_index(names if len(names) > 1 else names[0])
