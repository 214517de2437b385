"""Cuts a traced program into pieces at its Pallas kernels (for :func:`kernels.estimate_tpu_pieces`).

The program's jaxpr is flattened (``jit`` calls, custom-derivative calls and
``lax.platform_dependent`` branches for TPU are inlined) and its equations are split into
runs: each ``pallas_call`` alone, and the XLA equations between two kernels as one run.
With ``dots_above``, each ``dot_general`` of at least that many FLOPs is a piece of its
own too: the cut of a program built on XLA's matmuls (a dense layer) where another is
built on Pallas kernels. Each piece becomes a function of the values it reads from
earlier pieces (or from the program's inputs) that returns the values later pieces (or
the program's outputs) read. A TPU core runs a program's ops one after another, and XLA
cannot fuse an op into a Pallas kernel, so the pieces' times come close to the program's;
what differs is the fusions that would have crossed a kernel (each piece's outputs go
through HBM, as a kernel's inputs and outputs do).
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
from typing import Any, Callable

import jax
from jax.extend import core as jcore

_INLINE = ("pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
           "custom_vjp_call_jaxpr", "remat", "checkpoint")


@dataclasses.dataclass
class _Eqn:
  prim: Any
  params: dict
  ins: list   # ("v", id) or ("lit", value)
  outs: list  # ids
  kernel: bool
  ctx: Any = None
  pulled: bool = False  # recomputed here from an earlier XLA piece (see _with_producers)
  alone: bool = False   # a piece of its own: a kernel, or a dot over ``dots_above`` FLOPs


@dataclasses.dataclass
class Piece:
  """One piece: a Pallas kernel (``kernel``, ``name`` the kernel's), a large XLA dot (``name``
  ``"dot"``) or a run of XLA equations (``"xla"``), as ``fn(*inputs)``."""
  name: str
  kernel: bool
  fn: Callable
  inputs: list  # jax.ShapeDtypeStruct per argument
  primitives: list[str]
  reads: list[int] = dataclasses.field(default_factory=list)   # the values it takes, by id
  writes: list[int] = dataclasses.field(default_factory=list)  # the values it returns, by id


@dataclasses.dataclass
class Cut:
  """A program as its pieces: ``inputs`` are the ids of its flattened arguments, ``outputs``
  its flattened results as ids or ``("lit", value)``."""
  pieces: list[Piece]
  inputs: list[int]
  outputs: list
  treedef: Any

  def run(self, *args):
    """The program's results computed piece by piece (what the cut claims to preserve)."""
    env = dict(zip(self.inputs, jax.tree.leaves(args)))
    for p in self.pieces:
      env.update(zip(p.writes, p.fn(*(env[i] for i in p.reads))))
    return jax.tree.unflatten(self.treedef, [env[x] if k == "v" else x for k, x in self.outputs])


def _sub(params, key):
  j = params[key]
  return (j.jaxpr, j.consts) if hasattr(j, "jaxpr") else (j, ())


def _flatten(jaxpr, consts, in_refs, eqns: list, fresh, avals: dict, platform="tpu") -> list:
  """Appends ``jaxpr``'s equations, inlined, to ``eqns``; returns its outputs as refs."""
  env = {}

  def read(a):
    return ("lit", a.val) if isinstance(a, jcore.Literal) else env[a]

  for v, c in zip(jaxpr.constvars, consts):
    env[v] = ("lit", c)
  for v, r in zip(jaxpr.invars, in_refs):
    env[v] = r
  for e in jaxpr.eqns:
    name, ins = e.primitive.name, [read(a) for a in e.invars]
    sub = None
    if name in _INLINE:
      key = next((k for k in ("jaxpr", "call_jaxpr", "fun_jaxpr") if k in e.params), None)
      sub = _sub(e.params, key) if key else None
    elif name == "cond" and e.params.get("branches_platforms"):
      plats = e.params["branches_platforms"]
      pick = next((i for i, p in enumerate(plats) if p and platform in p), None)
      if pick is None:
        pick = next((i for i, p in enumerate(plats) if p is None), 0)
      b = e.params["branches"][pick]
      sub, ins = (b.jaxpr, b.consts), ins[1:]
    if sub is not None:
      outs = _flatten(sub[0], sub[1], ins, eqns, fresh, avals, platform)
    else:
      outs = []
      for v in e.outvars:
        i = next(fresh)
        avals[i] = v.aval
        outs.append(("v", i))
      eqns.append(_Eqn(e.primitive, dict(e.params), ins, [i for _, i in outs], name == "pallas_call", e.ctx,
                       alone=name == "pallas_call"))
    for v, r in zip(e.outvars, outs):
      if not isinstance(v, jcore.DropVar):
        env[v] = r
  return [read(a) for a in jaxpr.outvars]


# Ops XLA fuses into their consumers rather than write to HBM: layout changes, slices,
# broadcasts, iotas, converts and elementwise arithmetic.
_CHEAP = frozenset("""broadcast_in_dim convert_element_type reshape iota squeeze expand_dims transpose rev
select_n neg exp exp2 log log1p logistic tanh abs sign sqrt rsqrt integer_pow copy copy_p pad add sub mul div
max min eq ne lt le gt ge and or not square slice concatenate""".split())


def _nbytes(aval) -> int:
  return int(aval.size) * aval.dtype.itemsize


def _with_producers(run: list[_Eqn], eqns: list[_Eqn], avals: dict) -> list[_Eqn]:
  """``run`` with the cheap XLA ops that produce its inputs in earlier pieces recomputed at its
  start, as XLA's fusion recomputes a broadcast, a convert or a slice in each consumer
  instead of writing it out. Without this each piece would write out, say, the f32 copies of
  an activation that the backward reads, HBM traffic the whole program does not have. An
  input is replaced by the cheap ops that make it (its cone) only if the cone's own inputs
  that the piece does not read already are no larger than it, so no piece reads more."""
  producer = {i: (n, e) for n, e in enumerate(eqns) for i in e.outs}
  defined = {i for e in run for i in e.outs}
  inputs = {x for e in run for k, x in e.ins if k == "v" and x not in defined}

  def cone(v):
    """The cheap XLA equations that compute ``v`` from earlier values, and those values."""
    eq, leaves, stack = {}, set(), [v]
    while stack:
      x = stack.pop()
      n_e = producer.get(x)
      if n_e is None or n_e[1].kernel or n_e[1].prim.name not in _CHEAP or len(eq) > 256:
        leaves.add(x)
      elif n_e[0] not in eq:
        eq[n_e[0]] = n_e[1]
        stack += [y for k, y in n_e[1].ins if k == "v"]
    return eq, leaves

  pulled: dict[int, _Eqn] = {}
  changed = True
  while changed:
    changed = False
    for v in sorted(inputs, key=lambda x: -_nbytes(avals[x])):
      eq, leaves = cone(v)
      if not eq or sum(_nbytes(avals[x]) for x in leaves - inputs) > _nbytes(avals[v]):
        continue
      pulled.update(eq)
      inputs = (inputs - {v}) | leaves
      for e in eq.values():  # the cone's other outputs are computed here too
        inputs -= set(e.outs)
      changed = True
      break
  return [dataclasses.replace(pulled[n], pulled=True) for n in sorted(pulled)] + run


def _dot_flops(e: _Eqn, avals: dict) -> float:
  (contract, _), _ = e.params["dimension_numbers"]
  k, x = e.ins[0]
  shape = avals[x].shape if k == "v" else x.shape
  size = 1
  for d in contract:
    size *= shape[d]
  return 2.0 * float(avals[e.outs[0]].size) * size


def _kernel_name(params) -> str:
  debug = getattr(params.get("jaxpr"), "debug_info", None)
  return str(params.get("name") or getattr(debug, "func_name", None) or "pallas_call")


def _run(eqns: list[_Eqn], in_ids: list[int], out_ids: list[int]) -> Callable:
  def fn(*args):
    env = dict(zip(in_ids, args))
    for e in eqns:
      vals = [env[x] if k == "v" else x for k, x in e.ins]
      params = e.prim.get_bind_params(e.params)
      subfuns, params = params if isinstance(params, tuple) else ((), params)  # (older jax: a pair)
      with e.ctx.manager if e.ctx is not None else contextlib.nullcontext():
        res = e.prim.bind(*subfuns, *vals, **params)
      res = res if e.prim.multiple_results else [res]
      env.update(zip(e.outs, res))
    return tuple(env[i] for i in out_ids)
  return fn


def cut(f: Callable, *args, dots_above: float | None = None) -> Cut:
  """``f(*args)`` (arrays or ShapeDtypeStructs) cut at its Pallas kernels, in program order,
  and at its ``dot_general`` ops of at least ``dots_above`` FLOPs if given. Trace under the
  target's :func:`kernels.base.backend.target` so that dispatch picks the kernels."""
  closed, shape = jax.make_jaxpr(f, return_shape=True)(*args)
  fresh, avals, eqns = itertools.count(), {}, []
  in_refs = []
  for v in closed.jaxpr.invars:
    i = next(fresh)
    avals[i] = v.aval
    in_refs.append(("v", i))
  outs = _flatten(closed.jaxpr, closed.consts, in_refs, eqns, fresh, avals)
  if dots_above is not None:
    for e in eqns:
      e.alone = e.alone or (e.prim.name == "dot_general" and _dot_flops(e, avals) >= dots_above)
  # runs: each kernel (or large dot) alone, the XLA equations between them together; a dot
  # piece, like an XLA one, recomputes the cheap producers XLA would fuse into its operands
  runs = [list(g) for _, g in itertools.groupby(eqns, key=lambda e: (e.alone, id(e) if e.alone else 0))]
  runs = [run if run[0].kernel else _with_producers(run, eqns, avals) for run in runs]
  needed_later = [set() for _ in runs]  # ids read by runs after run r, or returned
  later = {i for k, i in outs if k == "v"}
  for r in range(len(runs) - 1, -1, -1):
    needed_later[r] = set(later)
    own = {i for e in runs[r] for i in e.outs}
    later |= {x for e in runs[r] for k, x in e.ins if k == "v" and x not in own}
  out = []
  for r, run in enumerate(runs):
    defined = [i for e in run for i in e.outs]
    dset = set(defined)
    ins = list(dict.fromkeys(x for e in run for k, x in e.ins if k == "v" and x not in dset))
    live = [i for e in run if not e.pulled for i in e.outs if i in needed_later[r]]
    if not live:
      continue  # dead code: XLA drops it from the program too
    kernel = run[0].kernel
    name = _kernel_name(run[0].params) if kernel else "dot" if run[-1].alone else "xla"
    sds = [jax.ShapeDtypeStruct(avals[i].shape, avals[i].dtype) for i in ins]
    out.append(Piece(name, kernel, _run(run, ins, live), sds, [e.prim.name for e in run], ins, live))
  return Cut(out, [i for _, i in in_refs], outs, jax.tree.structure(shape))
