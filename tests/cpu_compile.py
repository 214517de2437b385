"""XLA:CPU programs compile with LLVM's optimizations off: for the test processes
(tests/conftest.py) and the notebooks' kernels (tests/test_notebooks.py). Import ``kernels``
first (it configures libtpu before JAX loads it)."""


def cpu_programs_compile_unoptimized() -> None:
  """XLA:CPU programs of this process compile with LLVM's optimizations off.

  Interpret-mode tests spend most of their time compiling, not running: every pallas_call is
  traced afresh, discharged into an XLA:CPU program and compiled, then run once on small
  arrays, so LLVM's optimization passes cost more than they save (a third of the CPU time of a
  sample of interpret-mode tests: conv, ssd, attention, norm, fft, moe). The same optimized HLO
  runs; XLA:CPU enables no fast-math either way, so at most a fused multiply-add rounds
  differently, and no tolerance changes. Only the CPU backend: TPU compiles (the AOT tests, the
  cost model) get JAX's options untouched. JAX has no per-backend switch for this
  (`jax_disable_most_optimizations` would reach the TPU compiler too), hence the wrapper; if a
  JAX version renames the private function, the tests run optimized, as before.
  """
  try:
    from jax._src import compiler
  except ImportError:  # pragma: no cover - a JAX without this module: optimized, as before
    return
  original = getattr(compiler, "get_compile_options", None)
  if original is None or getattr(original, "_cpu_unoptimized", False):
    return

  def get_compile_options(*args, **kwargs):
    options = original(*args, **kwargs)
    backend = kwargs.get("backend")
    if backend is not None and getattr(backend, "platform", None) == "cpu":
      options.executable_build_options.debug_options.xla_backend_optimization_level = 0
    return options
  get_compile_options._cpu_unoptimized = True
  compiler.get_compile_options = get_compile_options
