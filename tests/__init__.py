# Generations for the AOT tests of options and alternative paths. Each kernel's defaults and
# benchmark configurations compile on all four generations (kernels.TPU_GENERATIONS); a test of
# one more option or path compiles on the two ends of the range instead: v4 (128x128 MXU, 16 MiB
# of VMEM, so the smallest blocks and its own plans) and v6e (256x256 MXU, 128 MiB, the largest
# blocks). v5e and v5p lie between them on both counts. (CI's 30-minute budget.)
EXTRA_AOT_GENERATIONS = ("v4", "v6e")

import os
import subprocess
import sys

# A guard against a hung child process, not a speed test: generous, so that a slow or loaded machine is
# never red for being slow (a fresh `make test` on a loaded machine once lost two AOT tests at 600 s).
# A real hang is still bounded, here and by CI's own time limit.
HANG_SECONDS = float(os.environ.get("KERNELS_TEST_HANG_SECONDS", "3600"))


def run_program(program: str, *argv: str, env=None) -> subprocess.CompletedProcess:
  """``python -c program *argv`` in a fresh process, its output captured, with the hang guard above."""
  try:
    return subprocess.run([sys.executable, "-c", program, *argv], capture_output=True, text=True,
                          timeout=HANG_SECONDS, env=env)
  except subprocess.TimeoutExpired as e:
    raise AssertionError(f"the child process did not exit in {HANG_SECONDS:.0f} s (KERNELS_TEST_HANG_SECONDS): "
                         f"a hang, not slowness; its stderr ends: {(e.stderr or b'')[-2000:]!r}") from None
