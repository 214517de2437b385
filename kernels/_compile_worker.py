"""Child process for :func:`kernels.tpu.compile_for_tpu`: compiles an exported program.

Usage: ``python -m kernels._compile_worker FILE GENERATION``; prints one JSON line.
"""
import json
import os
import sys

os.environ["KERNELS_STATIC_PROFILE"] = "0"


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
  print(json.dumps({"ok": True, "hlo": comp.hlo, "vmem_bytes": comp.vmem_bytes, "memory": comp.memory}))


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2])
