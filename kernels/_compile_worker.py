"""Child process for :mod:`kernels.tpu`: compiles (or estimates) an exported program.

Usage: ``python -m kernels._compile_worker FILE GENERATION [compile|estimate]``;
prints one JSON line. ``compile`` runs without the static profiler (TPU v4, which
the profiler cannot model); ``estimate`` runs with it and also returns the cost
profile, so a profiler crash ends this process, not the caller's.
"""
import json
import os
import sys

MODE = sys.argv[3] if len(sys.argv) > 3 else "compile"
os.environ["KERNELS_STATIC_PROFILE"] = "1" if MODE == "estimate" else "0"


def main(path: str, generation: str) -> None:
  import jax
  from jax import export

  from kernels import tpu
  from kernels.errors import CompileError
  with open(path, "rb") as fh:
    exp = export.deserialize(bytearray(fh.read()))
  args, kwargs = jax.tree.unflatten(exp.in_tree, exp.in_avals)
  try:
    comp = tpu.compile_for_tpu(exp.call, *args, generation=generation, **kwargs)
  except CompileError as e:
    print(json.dumps({"ok": False, "message": str(e).split(": ", 1)[-1].replace(f"TPU {generation} compile failed: ", ""),
                      "kind": getattr(e, "kind", "xla"), "details": e.details}))
    return
  out = {"ok": True, "hlo": comp.hlo, "vmem_bytes": comp.vmem_bytes, "memory": comp.memory}
  if MODE == "estimate":
    out["ops"] = tpu._profiles.get(tpu._profile_key(generation, comp.hlo), {})
  print(json.dumps(out))


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2])
