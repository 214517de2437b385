import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernels
from kernels.base import backend
from tests import toy


@pytest.fixture(autouse=True)
def _clear():
  toy.TRACED.clear()


def x():
  return jnp.arange(16 * 128, dtype=jnp.float32).reshape(16, 128)


def expected():
  return np.asarray(x()) * 2 + 1


def test_xla_on_request():
  np.testing.assert_array_equal(toy.scale_add(x(), implementation="xla"), expected())
  assert toy.TRACED == [("xla", None)]


def test_pallas_on_cpu_runs_interpret_mode():
  out = jax.jit(lambda v: toy.scale_add(v, implementation="pallas"))(x())
  np.testing.assert_array_equal(out, expected())
  # both branches of platform_dependent are traced: Mosaic for TPU, interpret for the rest
  assert ("pallas", True) in toy.TRACED and ("pallas", False) in toy.TRACED


def test_default_on_cpu_is_xla_and_matches():
  out = toy.scale_add(x())
  np.testing.assert_array_equal(out, expected())
  hlo = jax.jit(toy.scale_add).lower(x()).as_text()
  assert "tpu_custom_call" not in hlo  # lowered for CPU: the XLA branch only


def test_interpret_true_forces_pallas():
  toy.scale_add(x(), interpret=True)
  assert toy.TRACED == [("pallas", True)]


def test_fallback_when_pallas_cannot_serve():
  out = toy.scale_add(x(), pallas_unsupported="block too small")
  np.testing.assert_array_equal(out, expected())
  assert toy.TRACED[-1] == ("xla", None)


def test_explicit_pallas_does_not_fall_back():
  with pytest.raises(kernels.NoImplementationError, match="pallas: block too small"):
    toy.scale_add(x(), implementation="pallas", pallas_unsupported="block too small")


def test_no_implementation_names_every_reason():
  with pytest.raises(kernels.NoImplementationError) as info:
    toy.scale_add(x(), pallas_unsupported="no int4 on this chip", xla_unsupported="no reference for int4")
  msg = str(info.value)
  assert "no int4 on this chip" in msg and "no reference for int4" in msg and "scale_add" in msg
  assert isinstance(info.value, NotImplementedError) and isinstance(info.value, ValueError)
  assert info.value.reasons == {"pallas": "no int4 on this chip", "xla": "no reference for int4"}


def test_xla_refusing_falls_back_to_pallas():
  out = toy.scale_add(x(), xla_unsupported="no reference")
  np.testing.assert_array_equal(out, expected())


@pytest.mark.parametrize("bad", ["mosaic", "triton", 1])
def test_bad_implementation_is_a_kernel_error(bad):
  with pytest.raises(kernels.KernelError, match="implementation"):
    toy.scale_add(x(), implementation=bad)


def test_interpret_with_xla_is_rejected():
  with pytest.raises(kernels.KernelError, match="interpret"):
    toy.scale_add(x(), implementation="xla", interpret=True)


@pytest.mark.parametrize("implementation", [None, "pallas", "xla"])
def test_composes_with_grad_and_vmap(implementation):
  f = lambda v: toy.scale_add(v, implementation=implementation).sum()
  np.testing.assert_array_equal(jax.grad(f)(x()), np.full((16, 128), 2.0))
  batched = jax.vmap(lambda v: toy.scale_add(v, implementation=implementation))(jnp.stack([x(), x()]))
  np.testing.assert_array_equal(batched, np.stack([expected()] * 2))


def test_target_chip_context():
  assert backend.target_chip() is None  # CPU host
  with backend.target("v6e"):
    assert backend.target_chip().name == "v6e"
  assert backend.target_chip() is None


@pytest.mark.tpu_aot
def test_lowering_for_tpu_gets_the_mosaic_kernel():
  comp = kernels.compile_for_tpu(toy.scale_add, jax.ShapeDtypeStruct((16, 128), jnp.float32), generation="v5e")
  assert "tpu_custom_call" in comp.hlo
  comp = kernels.compile_for_tpu(lambda v: toy.scale_add(v, implementation="xla"),
                                 jax.ShapeDtypeStruct((16, 128), jnp.float32), generation="v5e")
  assert "tpu_custom_call" not in comp.hlo


def test_dry_run_runs_the_kernel_in_interpret_mode_and_times_once():
  """kernels.base.backend.dry_run: implementation=None takes the Pallas kernel (interpret mode) off TPU,
  and benchmark makes one timed call, so a notebook's TPU-only cell can be rehearsed on a CPU."""
  import jax.numpy as jnp
  from kernels.base import backend
  calls = []
  run = lambda impl: backend.dispatch(  # noqa: E731
      "op", jnp.ones(4), pallas=lambda x, interpret: calls.append(("pallas", interpret)) or x,
      xla=lambda x: calls.append(("xla", None)) or x, implementation=impl)
  run(None)
  with backend.dry_run():
    assert backend.in_dry_run()
    run(None)
    run("xla")
    m = kernels.benchmark(lambda x: x * 2, jnp.ones(4))
  assert not backend.in_dry_run()
  assert calls == [("xla", None), ("pallas", True), ("xla", None)]
  assert len(m.times) == 1



def test_an_old_jax_is_an_import_error_that_says_what_to_do(monkeypatch):
  import importlib.metadata
  from kernels.base import env
  monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.7.2")
  with pytest.raises(ImportError, match=r"kernels needs jax >= 0\.10\.2, found jax 0\.7\.2: run `pip install -U"):
    env.check_jax_version()
  monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.10.2")
  env.check_jax_version()


# Empty inputs the fuzzer found reaching a Pallas grid of length 0 (a raw TypeError or
# ZeroDivisionError): each gives the empty result XLA gives, on the Pallas path too.
_EMPTY_CASES = {
    "rope, no batch": lambda: (kernels.rope(jnp.zeros((0, 8, 2, 128)), jnp.zeros((0, 8), jnp.int32)), (0, 8, 2, 128)),
    "rope, no tokens": lambda: (kernels.rope(jnp.zeros((1, 0, 2, 128))), (1, 0, 2, 128)),
    "matmul, empty batch": lambda: (kernels.matmul(jnp.zeros((0, 8, 16)), jnp.zeros((0, 16, 8))), (0, 8, 8)),
    "fft, empty batch": lambda: (kernels.fft(jnp.zeros((0, 16), jnp.complex64)), (0, 16)),
    "fft_conv, empty batch": lambda: (kernels.fft_conv(jnp.zeros((0, 4, 32)), jnp.zeros((4, 32))), (0, 4, 32)),
    "conv2d, no output channels": lambda: (kernels.conv2d(jnp.zeros((1, 8, 8, 4)), jnp.zeros((3, 3, 4, 0))),
                                           (1, 8, 8, 0)),
}


@pytest.mark.parametrize("case", sorted(_EMPTY_CASES))
def test_an_empty_input_gives_an_empty_result_on_the_pallas_path(case):
  from kernels.base.backend import dry_run
  with dry_run():  # implementation=None means the Pallas kernel (interpret mode), as on a TPU
    out, shape = _EMPTY_CASES[case]()
  assert out.shape == shape


def test_fft_of_an_empty_axis_names_x():
  with pytest.raises(kernels.KernelError, match=r"^x=.*axis 1 is empty"):
    kernels.fft(jnp.zeros((2, 0), jnp.complex64))
