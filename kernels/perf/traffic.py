"""HBM traffic of a compiled TPU program, counted from the program itself.

libtpu's cost model lets a program move more bytes per second than the chip's HBM
can, so :func:`kernels.estimate_tpu` floors its time at ``hbm_bytes / bandwidth``.
This module counts ``hbm_bytes``:

* **Pallas calls** (``tpu_custom_call`` in the HLO): from the traced ``pallas_call``,
  by walking its grid in order and evaluating every BlockSpec's index map. Pallas's
  pipeline fetches an input block again only when its block index changes from the
  previous step, and writes an output block back when its index changes (and at the
  end), so the traffic is the sum of those blocks' bytes, clipped at the array's edge.
  An operand or result that XLA placed in VMEM (``S(1)`` on the custom call) moves no
  HBM bytes inside the kernel; the copy that put it there is charged to XLA.
  Refs left in HBM (``memory_space=ANY``: the kernel's own DMAs) and index maps that
  read scalar-prefetched tables cannot be walked; they count as compulsory bytes
  (each read once, each written once), and the result says so.
* **XLA ops**: from the optimised HLO. Every op that executes reads its operands that
  live in HBM and writes its results that live in HBM (memory space 0; ``S(1)`` is VMEM,
  ``S(6)`` SMEM). Inside a fusion, an operand consumed only by slices is charged the
  slices, and a fusion rooted in an in-place ``dynamic-update-slice`` writes only the
  update. An asynchronous ``slice-start`` reads its slice, not the whole operand. Sizes are physical: padded to the layout's tile (an f32 ``[R, 1]`` column in
  HBM occupies a whole 128-lane tile per 8 rows).
* **Loops**: ops inside a ``while`` run once per iteration. The trip count comes from
  the HLO (``known_trip_count``, or the loop's ``i < N`` condition on a counter that
  starts at a constant and steps by a constant). The same multiplicities scale the cost
  model's cycles, which it charges a loop body once.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Iterable

import numpy as np

# Version of these counting rules, stored with every count (``Estimate.record()``'s
# ``counter``): 2 charges an asynchronous slice its slice and skips a Pallas call's operands
# that XLA placed in VMEM (1 charged both in full). A later version only ever counts less,
# so a stored estimate the floor did not set keeps its time.
COUNTER_VERSION = 2

# --- HLO text -----------------------------------------------------------------------

_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
             "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5}
_ARRAY = re.compile(r"([a-z]+\d*[a-z0-9]*)\[([\d,]*)\](\{[^{}]*\})?")
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
                "collective-broadcast", "ragged-all-to-all", "send", "recv")
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
         "replica-id", "opt-barrier", "add-dependency", "copy-done", "all-reduce-done", "all-gather-done",
         "collective-permute-done", "async-done", "async-update", "send-done", "recv-done", "domain",
         "slice-done"}


@dataclasses.dataclass(frozen=True)
class Array:
  dtype: str
  dims: tuple[int, ...]
  memory_space: int
  physical_bytes: float
  logical_bytes: float


def _itemsize(dtype: str) -> float:
  if dtype in _ITEMSIZE:
    return _ITEMSIZE[dtype]
  if dtype.startswith("f8") or dtype.startswith("f4"):
    return 1 if dtype.startswith("f8") else 0.5
  return 4


def parse_shape(text: str) -> list[Array]:
  """The arrays of an HLO shape (a tuple gives several), with memory space and padded size."""
  out = []
  for dtype, dims_s, layout in _ARRAY.findall(text):
    if dtype in ("token",):
      continue
    dims = tuple(int(d) for d in dims_s.split(",") if d)
    isz = _itemsize(dtype)
    logical = isz * math.prod(dims)
    space, physical = 0, logical
    if layout:
      body = layout[1:-1]
      m = re.search(r"S\((\d+)\)", body)
      space = int(m.group(1)) if m else 0
      order_s, _, rest = body.partition(":")
      tile = re.match(r"T\(([\d,]+)\)", rest)
      if tile and dims:
        order = [int(d) for d in order_s.split(",") if d] or list(range(len(dims)))[::-1]
        phys = [dims[d] for d in reversed(order)]  # major to minor
        t = [int(v) for v in tile.group(1).split(",")]
        for i, size in enumerate(t[-len(phys):][::-1]):  # tile the most minor dims
          j = len(phys) - 1 - i
          phys[j] = -(-phys[j] // size) * size
        physical = isz * math.prod(phys)
    out.append(Array(dtype, dims, space, physical, logical))
  return out


def _hbm(arrays: Iterable[Array]) -> float:
  """Bytes of the arrays that live in HBM (scalars live in SMEM or registers)."""
  return sum(a.physical_bytes for a in arrays if a.memory_space == 0 and a.dims)


@dataclasses.dataclass
class Instr:
  name: str
  shape: str
  opcode: str
  operands: list[str]
  attrs: str
  args: str = ""
  """The text inside the opcode's parentheses (a parameter's number, a constant's value)."""

  @property
  def arrays(self) -> list[Array]:
    return parse_shape(self.shape)

  def called(self, key: str) -> list[str]:
    m = re.search(r"\b" + key + r"=(\{[^}]*\}|%?[\w.\-]+)", self.attrs)
    return re.findall(r"%?([\w.\-]+)", m.group(1)) if m else []


@dataclasses.dataclass
class Computation:
  name: str
  instrs: dict[str, Instr]
  root: str | None
  entry: bool = False


def _balanced(s: str, i: int) -> int:
  """Index just past the bracket group that opens at ``s[i]``."""
  pairs = {"(": ")", "[": "]", "{": "}"}
  stack = [pairs[s[i]]]
  j = i + 1
  while stack and j < len(s):
    c = s[j]
    if c in pairs:
      stack.append(pairs[c])
    elif c == stack[-1]:
      stack.pop()
    elif c == '"':  # skip strings (backend configs hold braces)
      j = s.index('"', j + 1) if '"' in s[j + 1:] else len(s)
      while s[j - 1] == "\\":
        j = s.index('"', j + 1)
    j += 1
  return j


def _parse_instr(line: str) -> Instr | None:
  m = re.match(r"\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*", line)
  if not m:
    return None
  i = m.end()
  if line[i] == "(":
    j = _balanced(line, i)
  else:
    j = i
    while j < len(line) and line[j] != " ":
      j = _balanced(line, j) if line[j] in "{[" else j + 1
  shape = line[i:j]
  rest = line[j:].lstrip()
  op = re.match(r"([\w\-]+)\(", rest)
  if not op:
    return None
  k = _balanced(rest, op.end() - 1)
  args = rest[op.end():k - 1]
  return Instr(m.group(2), shape, op.group(1), re.findall(r"%([\w.\-]+)", args), rest[k:], args)


def parse_hlo(text: str) -> dict[str, Computation]:
  comps: dict[str, Computation] = {}
  cur: Computation | None = None
  for line in text.splitlines():
    head = re.match(r"(ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s*->\s*.*\{\s*$", line)
    if head and not line.startswith(" "):
      cur = Computation(head.group(2), {}, None, bool(head.group(1)))
      comps[cur.name] = cur
      continue
    if line.startswith("}"):
      cur = None
      continue
    if cur is None:
      continue
    ins = _parse_instr(line)
    if ins:
      cur.instrs[ins.name] = ins
      if line.lstrip().startswith("ROOT"):
        cur.root = ins.name
  return comps


def _const(comp: Computation, name: str) -> int | None:
  """The integer a scalar names, through copies and converts."""
  seen = 0
  while name in comp.instrs and seen < 8:
    ins = comp.instrs[name]
    if ins.opcode == "constant":
      m = re.fullmatch(r"\s*(-?\d+)\s*", ins.args)
      return int(m.group(1)) if m else None
    if ins.opcode in ("copy", "convert", "bitcast") and ins.operands:
      name, seen = ins.operands[0], seen + 1
      continue
    return None
  return None


def _trip_count(comps: dict[str, Computation], parent: Computation, w: Instr) -> int | None:
  m = re.search(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"', w.attrs)
  if m:
    return int(m.group(1))
  cond = comps.get((w.called("condition") or [""])[0])
  body = comps.get((w.called("body") or [""])[0])
  if cond is None or body is None or cond.root is None or not w.operands:
    return None
  cmp = cond.instrs[cond.root]
  direction = re.search(r"direction=(\w+)", cmp.attrs)
  if cmp.opcode != "compare" or not direction or len(cmp.operands) != 2:
    return None
  a, b = (cond.instrs.get(o) for o in cmp.operands)
  if a is None or b is None:
    return None
  d = direction.group(1)
  if a.opcode != "get-tuple-element":  # bound on the left: N > i
    a, b = b, a
    d = {"GT": "LT", "GE": "LE", "LT": "GT", "LE": "GE"}.get(d, d)
  idx = re.search(r"index=(\d+)", a.attrs)
  bound = _const(cond, b.name)
  init_tuple = parent.instrs.get(w.operands[0])
  if idx is None or bound is None or init_tuple is None or init_tuple.opcode != "tuple":
    return None
  k = int(idx.group(1))
  start = _const(parent, init_tuple.operands[k]) if k < len(init_tuple.operands) else None
  root = body.instrs.get(body.root or "")
  if start is None or root is None or root.opcode != "tuple" or k >= len(root.operands):
    return None
  step_ins = body.instrs.get(root.operands[k])
  step = None
  if step_ins is not None and step_ins.opcode == "add":
    step = next((s for s in (_const(body, o) for o in step_ins.operands) if s is not None), None)
  if not step or step <= 0:
    return None
  if d == "LT":
    return max(0, -(-(bound - start) // step))
  if d == "LE":
    return max(0, (bound - start) // step + 1)
  return None


def multiplicities(comps: dict[str, Computation]) -> tuple[dict[str, int], list[str]]:
  """How many times each instruction of the executed computations runs, and notes on loops
  whose trip count could not be read (their bodies count once)."""
  mult: dict[str, int] = {}
  notes: list[str] = []
  entry = next((c for c in comps.values() if c.entry), None)
  if entry is None:
    return mult, ["no ENTRY computation in the HLO"]

  def visit(comp: Computation, times: int, depth: int = 0):
    if depth > 32:
      return
    for ins in comp.instrs.values():
      mult[ins.name] = mult.get(ins.name, 0) + times
      if ins.opcode == "while":
        n = _trip_count(comps, comp, ins)
        if n is None:
          notes.append(f"loop {ins.name}: trip count unknown, its body is counted once")
          n = 1
        for c in ins.called("body") + ins.called("condition"):
          if c in comps:
            visit(comps[c], times * n, depth + 1)
      elif ins.opcode == "conditional":
        for c in ins.called("branch_computations") + ins.called("true_computation") + ins.called("false_computation"):
          if c in comps:
            visit(comps[c], times, depth + 1)  # every branch once: an upper bound on traffic
        notes.append(f"conditional {ins.name}: every branch counted")
      elif ins.opcode in ("call", "async-start") or (ins.opcode == "custom-call" and "called_computations" in ins.attrs):
        for c in ins.called("to_apply") + ins.called("calls") + ins.called("called_computations"):
          if c in comps and not comps[c].name.startswith("fused"):
            visit(comps[c], times, depth + 1)
  visit(entry, 1)
  return mult, notes


def _fusion_bytes(comps: dict[str, Computation], parent: Computation, ins: Instr) -> float:
  """HBM bytes a fusion moves: operands (charged their slices when only sliced) and results
  (an in-place dynamic-update-slice writes only its update)."""
  fused = comps.get((ins.called("calls") or [""])[0])
  operand_arrays = [parse_shape(parent.instrs[o].shape) if o in parent.instrs else [] for o in ins.operands]
  out_bytes = _hbm(ins.arrays)
  if fused is None:
    return sum(_hbm(a) for a in operand_arrays) + out_bytes
  params: dict[int, str] = {}
  users: dict[str, list[Instr]] = {}
  for f in fused.instrs.values():
    if f.opcode == "parameter" and f.args.strip().isdigit():
      params[int(f.args)] = f.name
    for o in f.operands:
      users.setdefault(o, []).append(f)
  in_place: set[int] = set()
  root = fused.instrs.get(fused.root or "")
  roots = [fused.instrs[o] for o in root.operands if o in fused.instrs] if root and root.opcode == "tuple" else [root]
  name_to_param = {v: k for k, v in params.items()}
  for r in roots:
    if r is not None and r.opcode == "dynamic-update-slice":
      buf = r.operands[0]
      while buf in fused.instrs and fused.instrs[buf].opcode == "bitcast":
        buf = fused.instrs[buf].operands[0]
      upd = fused.instrs.get(r.operands[1])
      if buf in name_to_param and upd is not None:
        in_place.add(name_to_param[buf])
        whole = _hbm(parse_shape(r.shape))
        out_bytes -= whole
        out_bytes += whole and sum(a.logical_bytes for a in upd.arrays)
  total = out_bytes
  for k, arrays in enumerate(operand_arrays):
    if k in in_place or not arrays or arrays[0].memory_space != 0:
      continue
    p = params.get(k)
    us = users.get(p, []) if p else []
    if us and all(u.opcode in ("dynamic-slice", "slice", "gather") and u.operands[0] == p for u in us):
      total += sum(sum(a.logical_bytes for a in u.arrays) for u in us)
    else:
      total += _hbm(arrays)
  return total


def _has(comps, ins: Instr, opcode: str) -> bool:
  fused = comps.get((ins.called("calls") or [""])[0])
  return fused is not None and any(f.opcode == opcode for f in fused.instrs.values())


@dataclasses.dataclass
class Traffic:
  """HBM bytes of a compiled program, and what was learnt counting them."""

  hbm_bytes: float
  multiplicity: dict[str, int]
  """How many times each HLO instruction runs (loop trip counts)."""
  by_op: dict[str, float]
  notes: list[str]
  pallas_calls: list[str]
  """Names of the Pallas (tpu_custom_call) instructions, in program order."""
  collectives: list[str]
  convolutions: list[str]
  fusion_cycles: dict[str, int] = dataclasses.field(default_factory=dict)
  """The compiler's own per-fusion cost estimate (``estimated_cycles`` in the HLO's backend
  config), per execution: information only, not validated against the profile."""
  compulsory_bytes: float = 0.0
  """Each argument read once and each result written once."""
  method: str = "counted"
  """``"counted"``, or ``"partly compulsory"`` when some part could not be walked."""


def _pallas_bytes(comp: Computation, ins: Instr, t: PallasTraffic) -> float:
  """One execution of Pallas call ``ins``: its walked traffic, less the operands and results
  XLA placed in VMEM (the BlockSpec'd inputs are the call's last operands, after any
  scalar-prefetch ones; its results are the outputs)."""
  if not t.operand_bytes:
    return t.hbm_bytes
  n_in = t.num_inputs
  results = ins.arrays
  if len(ins.operands) < n_in or len(results) != len(t.operand_bytes) - n_in:
    return t.hbm_bytes
  operands = ins.operands[len(ins.operands) - n_in:] if n_in else []
  in_vmem = [any(a.memory_space == 1 for a in comp.instrs[o].arrays) if o in comp.instrs else False
             for o in operands] + [a.memory_space == 1 for a in results]
  return sum(b for b, vmem in zip(t.operand_bytes, in_vmem) if not vmem)


def hlo_traffic(hlo: str, pallas: dict[str, PallasTraffic] | None = None) -> Traffic:
  """Counts the HBM bytes of an optimised TPU HLO module. ``pallas`` maps a Pallas custom
  call's instruction name to its walked traffic (:func:`match_pallas`); a call missing from
  it is charged its operands and results once."""
  comps = parse_hlo(hlo)
  mult, notes = multiplicities(comps)
  walked = pallas or {}
  by_op: dict[str, float] = {}
  pallas, collectives, convs = [], [], []
  fusion_cycles: dict[str, int] = {}
  for comp in comps.values():
    for ins in comp.instrs.values():
      times = mult.get(ins.name, 0)
      if not times or ins.opcode in _FREE or ins.opcode in ("while", "conditional", "call"):
        continue
      base = ins.opcode.removesuffix("-start")
      if base in _COLLECTIVES:
        collectives.append(ins.name)
      if ins.opcode == "custom-call":
        target = re.search(r'custom_call_target="([^"]+)"', ins.attrs)
        target = target.group(1) if target else ""
        if target == "AllocateBuffer":
          continue
        if target == "tpu_custom_call":
          pallas.append(ins.name)
          if ins.name in walked:
            by_op[ins.name] = times * _pallas_bytes(comp, ins, walked[ins.name])
            continue
          notes.append(f"Pallas call {ins.name}: not walked, charged its operands and results once")
      if ins.opcode == "fusion":
        b = _fusion_bytes(comps, comp, ins)
        cyc = re.search(r'"estimated_cycles"\s*:\s*"(\d+)"', ins.attrs)
        if cyc:
          fusion_cycles[ins.name] = int(cyc.group(1))
        if _has(comps, ins, "convolution"):
          convs.append(ins.name)
      elif ins.opcode == "dynamic-update-slice":
        upd = comp.instrs.get(ins.operands[1]) if len(ins.operands) > 1 else None
        b = (_hbm(ins.arrays) and sum(a.logical_bytes for a in upd.arrays)) if upd else _hbm(ins.arrays)
        b += _hbm(upd.arrays) if upd else 0
      elif ins.opcode == "slice-start":
        *src, dest, _ = ins.arrays  # ((source), destination, context)
        b = (dest.physical_bytes if any(a.memory_space == 0 for a in src) else 0) + _hbm([dest])
      elif ins.opcode == "copy-start":
        arrays = ins.arrays  # (destination, source, context)
        b = _hbm(arrays[:2])
      else:
        if ins.opcode == "convolution":
          convs.append(ins.name)
        b = _hbm(ins.arrays) + sum(_hbm(comp.instrs[o].arrays) for o in ins.operands if o in comp.instrs)
      if b:
        by_op[ins.name] = times * b
  return Traffic(sum(by_op.values()), mult, by_op, notes, pallas, collectives, convs, fusion_cycles,
                 compulsory_bytes(hlo))


def compulsory_bytes(hlo: str) -> float:
  """Each argument read once and each result written once (the ENTRY computation's HBM
  parameters and root): what any implementation must move."""
  comps = parse_hlo(hlo)
  entry = next((c for c in comps.values() if c.entry), None)
  if entry is None:
    return 0.0
  total = sum(_hbm(i.arrays) for i in entry.instrs.values() if i.opcode == "parameter")
  if entry.root:
    total += _hbm(entry.instrs[entry.root].arrays)
  return total


# --- Pallas calls, from the traced program ------------------------------------------


@dataclasses.dataclass
class PallasTraffic:
  name: str
  hbm_bytes: float
  out_shapes: tuple
  notes: list[str]
  walked: bool
  operand_bytes: tuple[float, ...] = ()
  """Bytes per BlockSpec'd operand: the inputs, then the outputs (sums to ``hbm_bytes``)."""
  num_inputs: int = 0


_MAX_GRID = 1 << 22


def _jaxprs_in(params: dict) -> Iterable[Any]:
  from jax.extend import core as jcore
  for v in params.values():
    for x in (v if isinstance(v, (tuple, list)) else (v,)):
      if isinstance(x, jcore.ClosedJaxpr):
        yield x.jaxpr
      elif isinstance(x, jcore.Jaxpr):
        yield x


def pallas_calls(jaxpr, platform: str = "tpu") -> list[Any]:
  """The ``pallas_call`` equations a traced program runs when lowered for ``platform``
  (``jax.lax.platform_dependent`` branches for other platforms are skipped)."""
  out = []

  def walk(j):
    for eqn in j.eqns:
      name = eqn.primitive.name
      if name == "pallas_call":
        out.append(eqn)
        continue
      if name == "cond" and eqn.params.get("branches_platforms"):
        plats = eqn.params["branches_platforms"]
        pick = next((i for i, p in enumerate(plats) if p and platform in p), None)
        if pick is None:
          pick = next((i for i, p in enumerate(plats) if p is None), 0)
        walk(eqn.params["branches"][pick].jaxpr)
        continue
      if name == "custom_vjp_call" and "call_jaxpr" in eqn.params:
        walk(eqn.params["call_jaxpr"].jaxpr)
        continue
      for sub in _jaxprs_in(eqn.params):
        walk(sub)
  walk(getattr(jaxpr, "jaxpr", jaxpr))
  return out


def _dims(block_shape, array_shape):
  """Per dimension: (kind, size) with kind 'blocked' (index is a block number), 'element'
  (index is an element offset) or 'squeezed' (one element)."""
  from jax._src.pallas import core as pc
  out = []
  for b, n in zip(block_shape, array_shape):
    if b is None or isinstance(b, getattr(pc, "Squeezed", ())) or b is getattr(pc, "squeezed", object()):
      out.append(("squeezed", 1))
    elif isinstance(b, getattr(pc, "Element", ())):
      out.append(("element", int(b.block_size)))
    elif isinstance(b, getattr(pc, "Blocked", ())):
      out.append(("blocked", int(b.block_size)))
    elif isinstance(b, int):
      out.append(("blocked", b))
    else:
      raise NotImplementedError(f"block dimension {b!r}")
  return out


def _grid_indices(grid: tuple[int, ...]) -> list[np.ndarray]:
  return [g.reshape(-1) for g in np.meshgrid(*[np.arange(n, dtype=np.int32) for n in grid], indexing="ij")]


def _tdiv(a, b):
  q = np.abs(a) // np.abs(b)
  return np.where((a < 0) != (b < 0), -q, q)


_NP = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "max": np.maximum, "min": np.minimum,
       "div": _tdiv, "rem": lambda a, b: a - b * _tdiv(a, b), "neg": np.negative, "abs": np.abs,
       "lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal, "eq": np.equal,
       "ne": np.not_equal, "and": np.logical_and, "or": np.logical_or, "not": np.logical_not,
       "sign": np.sign, "square": np.square, "shift_left": np.left_shift,
       "shift_right_arithmetic": np.right_shift, "shift_right_logical": np.right_shift,
       "select_n": lambda p, *cases: np.choose(np.asarray(p, np.int64), np.broadcast_arrays(*cases)),
       "clamp": lambda lo, x, hi: np.clip(x, lo, hi)}


def _eval_jaxpr(jaxpr, consts, args):
  """Evaluates an index map's integer jaxpr on NumPy arrays (one entry per grid step)."""
  from jax.extend import core as jcore
  env = {}

  def read(v):
    return np.asarray(v.val) if isinstance(v, jcore.Literal) else env[v]
  for v, x in zip(jaxpr.constvars, consts):
    env[v] = np.asarray(x)
  for v, x in zip(jaxpr.invars, args):
    env[v] = x
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    name = eqn.primitive.name
    if name in _NP:
      out = [_NP[name](*ins)]
    elif name in ("convert_element_type", "copy", "copy_p", "optimization_barrier"):
      out = ins
    elif name == "integer_pow":
      out = [ins[0] ** eqn.params["y"]]
    elif name in ("pjit", "jit", "closed_call", "core_call", "remat"):
      sub = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
      out = _eval_jaxpr(sub.jaxpr, sub.consts, ins)
    else:
      raise NotImplementedError(f"index map primitive {name}")
    for v, x in zip(eqn.outvars, out):
      env[v] = x
  return [read(v) for v in jaxpr.outvars]


class _Opaque:
  """A scalar-prefetched operand: its values are data, unknown when the program is compiled."""


def _eval_index_map(closed, idx: list) -> list[np.ndarray]:
  n = len(idx[0])
  res = _eval_jaxpr(closed.jaxpr, closed.consts, [i.astype(np.int64) if isinstance(i, np.ndarray) else i for i in idx])
  return [np.broadcast_to(np.asarray(r, np.int64), (n,)) for r in res]


def _runs(indices: list[np.ndarray]) -> np.ndarray:
  """Mask of the steps whose block index differs from the previous step's (step 0 included)."""
  n = len(indices[0]) if indices else 1
  new = np.zeros(n, dtype=bool)
  new[0] = True
  for ix in indices:
    new[1:] |= ix[1:] != ix[:-1]
  return new


def pallas_call_traffic(eqn) -> PallasTraffic:
  """HBM bytes one execution of a traced ``pallas_call`` moves through its BlockSpecs."""
  gm = eqn.params["grid_mapping"]
  name = str(eqn.params.get("name") or getattr(eqn.params.get("name_and_src_info"), "name", "pallas_call"))
  outs = tuple((tuple(a.shape), str(a.dtype)) for a in eqn.params.get("out_avals", ()))
  notes: list[str] = []
  grid = tuple(int(g) for g in gm.grid)
  n_steps = math.prod(grid) if grid else 1
  n_in, n_out = gm.num_inputs, gm.num_outputs
  mappings = list(gm.block_mappings)[:n_in + n_out]
  walkable = n_steps <= _MAX_GRID and not getattr(gm, "num_dynamic_grid_bounds", 0)
  idx = _grid_indices(grid) if walkable and grid else [np.zeros(1, np.int32)] * 0
  per: list[float] = []
  for k, bm in enumerate(mappings):
    aval = bm.array_aval if hasattr(bm, "array_aval") else bm.array_shape_dtype
    shape, itemsize = tuple(aval.shape), np.dtype(aval.dtype).itemsize
    whole = itemsize * math.prod(shape)
    space = str(getattr(bm.block_aval, "memory_space", "") or "")
    manual = "any" in space.lower() or "hbm" in space.lower()
    why = None
    if manual:
      why = "left in HBM for the kernel's own DMAs"
    elif not walkable:
      why = f"grid of {n_steps} steps not walked"
    if why:
      per.append(whole)
      notes.append(f"{name} {'input' if k < n_in else 'output'} {k if k < n_in else k - n_in}: {why}; "
                   "charged once (compulsory bytes)")
      continue
    try:
      dims = _dims(bm.block_shape, shape)
    except NotImplementedError as e:
      per.append(whole)
      notes.append(f"{name}: {e}; charged once")
      continue
    if not grid:
      starts = [np.zeros(1, np.int64)] * len(dims)
      new = np.ones(1, bool)
    else:
      try:  # scalar-prefetch operands are opaque: an index map that reads them cannot be walked
        starts = _eval_index_map(bm.index_map_jaxpr, idx + [_Opaque()] * gm.num_index_operands)
      except (NotImplementedError, TypeError) as e:
        per.append(whole)
        why = "index map reads scalar-prefetched data" if gm.num_index_operands else str(e)
        notes.append(f"{name} {'input' if k < n_in else 'output'} {k if k < n_in else k - n_in}: {why}; "
                     "charged once (compulsory bytes)")
        continue
      new = _runs(starts)
    size = np.ones(int(new.sum()), dtype=np.float64)
    for (kind, b), n, s in zip(dims, shape, starts):
      s = np.asarray(s, np.int64)[new]
      begin = s * b if kind == "blocked" else s
      size *= np.clip(np.minimum(begin + b, n) - begin, 0, None)
    per.append(itemsize * float(size.sum()))
  return PallasTraffic(name, sum(per), outs, notes, not notes, tuple(per), n_in)


def hlo_shape_key(shape: str) -> tuple:
  return tuple((a.dims, a.dtype) for a in parse_shape(shape))


_HLO_DTYPE = {"bfloat16": "bf16", "float32": "f32", "float16": "f16", "int32": "s32", "int8": "s8",
              "uint8": "u8", "bool": "pred", "float64": "f64", "int16": "s16", "uint32": "u32",
              "float8_e4m3fn": "f8e4m3fn", "float8_e5m2": "f8e5m2", "int64": "s64", "complex64": "c64"}


def match_pallas(hlo: str, traced: list[PallasTraffic]) -> dict[str, PallasTraffic]:
  """Pairs each Pallas custom call of the HLO with its traced ``pallas_call``: by kernel name
  (the instruction's name less its ``.N`` suffix) and result shapes."""
  comps = parse_hlo(hlo)
  out: dict[str, PallasTraffic] = {}
  for comp in comps.values():
    for ins in comp.instrs.values():
      if ins.opcode != "custom-call" or 'custom_call_target="tpu_custom_call"' not in ins.attrs:
        continue
      base = re.sub(r"\.\d+$", "", ins.name)
      shapes = hlo_shape_key(ins.shape)
      same_shape = [t for t in traced if tuple((d, _HLO_DTYPE.get(dt, dt)) for d, dt in t.out_shapes) == shapes]
      named = [t for t in traced if t.name == base] or [t for t in traced if base.startswith(t.name)]
      # name and shapes; else the name; else the shapes, if they single one traffic out
      pick = next((t for t in named if t in same_shape), None) or (named[0] if named else None)
      if pick is None and len({t.hbm_bytes for t in same_shape}) == 1:
        pick = same_shape[0]
      if pick is not None:
        out[ins.name] = pick
  return out
