"""The package's layering (kernels/__init__.py's docstring), checked on every module's imports.

- ``base`` imports nothing of ours;
- ``perf`` imports only ``base`` (and itself);
- a family imports ``base``, its own modules, and other families' public APIs (``kernels.<family>``,
  never their modules);
- ``distributed`` imports ``base``, families and itself;
- nothing in the package imports ``perf`` (only notebooks, tools and tests do);
- no module or folder is named like a public function, and the modules import no cycle.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

import kernels
from tests import run_program

PKG = pathlib.Path(kernels.__file__).parent
FAMILIES = ("gemm", "norm", "attention", "scan", "fourier", "conv", "experts")
WINGS = ("base", "perf", "distributed") + FAMILIES


def _modules():
  """{dotted name: path} of every module of the package."""
  out = {}
  for p in sorted(PKG.rglob("*.py")):
    parts = p.relative_to(PKG.parent).with_suffix("").parts
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    out[name] = p
  return out


def _imports(path: pathlib.Path, name: str, *, top_level_only: bool = False) -> set[str]:
  """The modules of ours that ``path`` imports (``from kernels.x import y`` counts ``kernels.x.y`` when it is a module)."""
  mods = _modules()
  tree = ast.parse(path.read_text())
  nodes = tree.body if top_level_only else ast.walk(tree)
  found = set()
  for node in nodes:
    if isinstance(node, ast.Import):
      found |= {a.name for a in node.names if a.name.startswith("kernels")}
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.startswith("kernels"):
      for a in node.names:
        sub = f"{node.module}.{a.name}"
        found.add(sub if sub in mods else node.module)
  return found


def _wing(module: str) -> str | None:
  parts = module.split(".")
  return parts[1] if len(parts) > 1 else None


def test_every_module_lives_in_a_wing():
  loose = [n for n in _modules() if n.count(".") == 1 and _wing(n) not in WINGS]
  assert not loose, f"modules outside base/, perf/, distributed/ and the family folders: {loose}"


@pytest.mark.parametrize("module", sorted(n for n in _modules() if n != "kernels"))
def test_layering(module):
  path = _modules()[module]
  wing = _wing(module)
  for dep in _imports(path, module):
    if dep == "kernels":
      # `from kernels import x` reaches the flat API: only the root may, and it is the facade.
      pytest.fail(f"{module} imports the top-level package (import the module that defines the name)")
    other = _wing(dep)
    if other == wing:
      continue
    if wing == "base":
      pytest.fail(f"base imports nothing of ours, but {module} imports {dep}")
    assert other != "perf", f"{module} imports the instrument {dep}: only notebooks, tools and tests may"
    if wing == "perf":
      assert other == "base", f"perf imports only base, but {module} imports {dep}"
    elif wing in FAMILIES:
      assert other == "base" or (other in FAMILIES and dep == f"kernels.{other}"), (
          f"{module} imports {dep}: a family imports base and other families' public APIs (kernels.{other})")
    elif wing == "distributed":
      assert other == "base" or other in FAMILIES, f"{module} imports {dep}"


def test_no_module_is_named_like_a_public_function():
  public = set(kernels.__all__) | set(kernels.distributed.__all__)
  clashes = [n for n in _modules() if set(n.split(".")[1:]) & public]
  assert not clashes, f"module paths that a public name shadows: {clashes}"
  import kernels.experts.grouped as gm  # binds the module, not the function
  assert gm.__name__ == "kernels.experts.grouped"


def test_no_import_cycle():
  mods = _modules()
  graph = {n: {d for d in _imports(p, n, top_level_only=True) if d in mods and d != n and not n.startswith(d + ".")}
           for n, p in mods.items()}
  graph = {n: {d for d in deps if not d.startswith(n + ".")} for n, deps in graph.items()}  # a package's own modules
  state = {}

  def visit(n, stack):
    if state.get(n) == 1:
      cycle = stack[stack.index(n):] + [n]
      pytest.fail("import cycle: " + " -> ".join(cycle))
    if state.get(n) == 2:
      return
    state[n] = 1
    for d in sorted(graph[n]):
      visit(d, stack + [n])
    state[n] = 2

  for n in sorted(graph):
    visit(n, [])


def test_public_names_resolve():
  for name in kernels.__all__:
    assert getattr(kernels, name) is not None, name
  for name in kernels.distributed.__all__:
    assert callable(getattr(kernels.distributed, name)) or name == "SEQUENCE_ORDERS", name
  # the module paths from before the folders
  assert kernels.tpu.compile_for_tpu is kernels.compile_for_tpu
  assert kernels.timing.benchmark is kernels.benchmark
  assert kernels.hardware.get_chip is kernels.get_chip
  assert kernels.errors.KernelError is kernels.KernelError
  with pytest.raises(AttributeError):
    kernels.no_such_name  # noqa: B018


def test_distributed_is_reachable_after_import_kernels():
  out = run_program("import kernels; print(kernels.distributed.ring_attention.__name__)")
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == "ring_attention"

