"""Child process for :mod:`kernels.perf.tpu`: compiles (or estimates) exported programs.

Usage: ``python -m kernels.perf.compile_worker FILE GENERATION [compile|estimate]`` compiles
one program and prints one JSON line; ``python -m kernels.perf.compile_worker --serve``
compiles without the profiler, one program per line of stdin (``FILE GENERATION
[TOPOLOGY AXES SHAPE [explicit]]``, the last ones for a multi-chip program: see ``tpu.tpu_mesh``),
answering each with one JSON line, until stdin closes.

``compile`` runs without the static profiler (TPU v4, which the profiler cannot model,
and compiles that want only the HLO and memory); ``estimate`` runs with it and also
returns the cost profile, so a profiler crash ends this process, not the caller's. A
serving worker saves the start-up (Python, JAX, libtpu: seconds) that a process per
compile would pay every time.
"""
import json
import os
import sys

SERVE = sys.argv[1:2] == ["--serve"]
MODE = "compile" if SERVE else (sys.argv[3] if len(sys.argv) > 3 else "compile")
os.environ["KERNELS_STATIC_PROFILE"] = "1" if MODE == "estimate" else "0"


def compile_one(path: str, generation: str, topology: str = "") -> dict:
  import jax
  from jax import export

  from kernels.perf import tpu
  from kernels.base.errors import CompileError
  with open(path, "rb") as fh:
    exp = export.deserialize(bytearray(fh.read()))
  avals = exp.in_avals
  if topology:  # a multi-chip program: its arguments sharded as exported, on the same topology's mesh
    name, axes, shape, *kind = topology.split()
    mesh = tpu.tpu_mesh(name, tuple(axes.split(",")), tuple(int(d) for d in shape.split(",")),
                        explicit=kind == ["explicit"])
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh) for a, sh in zip(avals, exp.in_shardings_jax(mesh))]
  args, kwargs = jax.tree.unflatten(exp.in_tree, avals)
  try:
    comp = tpu.compile_for_tpu(exp.call, *args, generation=generation, **kwargs)
  except CompileError as e:
    return {"ok": False, "message": str(e).split(": ", 1)[-1].replace(f"TPU {generation} compile failed: ", ""),
            "kind": getattr(e, "kind", "xla"), "details": e.details}
  out = {"ok": True, "hlo": comp.hlo, "vmem_bytes": comp.vmem_bytes, "memory": comp.memory}
  if MODE == "estimate":
    out["ops"] = tpu._profiles.get(tpu._profile_key(generation, comp.hlo), {})
  return out


def serve() -> None:
  for line in sys.stdin:
    path, generation, *topology = line.split(" ", 2)
    try:
      out = compile_one(path, generation, topology[0].strip() if topology else "")
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
      out = {"ok": None, "message": f"{type(e).__name__}: {e}"}
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
  if SERVE:
    serve()
  else:
    print(json.dumps(compile_one(sys.argv[1], sys.argv[2])))
