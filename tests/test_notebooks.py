"""Notebooks are tests: every ``notebooks/*.md`` must run top to bottom on a CPU.

Each notebook is executed with nbclient in a ``python3`` kernel (the Python running
pytest), in ``notebooks/``, with a generous hang guard per cell (tests.HANG_SECONDS). A failure names the
notebook, the cell, the start of its source and the error.

An executed notebook is stored in the jupyter-cache that myst-nb uses for the site
(``_build/.jupyter_cache``, see ``conf.py``), under the key myst-nb computes: the
notebook is read exactly as myst-nb reads it, and jupyter-cache hashes its code
cells and kernelspec. So ``make docs`` after ``make test`` does not execute the
notebooks again, and a notebook whose code has not changed since its last
successful run (here or in ``make docs``) is not executed again either. The key
does not cover the ``kernels`` package itself: ``NOTEBOOKS_REEXECUTE=1`` runs every
notebook regardless (and refreshes the cache); CI starts from an empty cache.

The notebooks are independent (each runs in its own kernel), so pytest-xdist spreads
them over its workers like any other test. jupyter-cache is not safe for concurrent
writers: it creates its sqlite database without a lock (two processes starting on an
empty cache race to create the tables) and stores a notebook in several unguarded
steps (files, record, cache truncation). Every access to the cache therefore holds an
exclusive ``fcntl`` lock on ``_build/.jupyter_cache.lock``; the execution does not.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import HANG_SECONDS

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
CELL_TIMEOUT = HANG_SECONDS  # a hang guard, not a speed test (tests/__init__.py)
KERNEL_NAME = "python3"
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


# Reading a notebook the way the site does needs myst-nb (the `docs` extra; `make test`
# installs it). Without it there is no cache key to share, so the tests are skipped.
pytest.importorskip("myst_nb", reason="executing the notebooks needs myst-nb (the `docs` extra)")


def _load_conf():
    spec = importlib.util.spec_from_file_location("_site_conf", ROOT / "conf.py")
    conf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conf)
    return conf


CONF = _load_conf()
CACHE_PATH = Path(CONF.nb_execution_cache_path)
CACHE_LOCK = CACHE_PATH.with_name(CACHE_PATH.name + ".lock")


@contextlib.contextmanager
def cache_lock():
    """Exclusive, cross-process lock for the jupyter-cache (and the kernelspec install).

    Held only while reading or writing the cache, never while a notebook executes.
    """
    CACHE_LOCK.parent.mkdir(parents=True, exist_ok=True)
    with open(CACHE_LOCK, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # released when the file is closed
        yield


def _is_text_notebook(path: Path) -> bool:
    from myst_nb.core.read import is_myst_markdown_notebook

    return is_myst_markdown_notebook(path.read_text(encoding="utf-8"))


NOTEBOOKS = sorted(p for p in NOTEBOOK_DIR.glob("*.md") if _is_text_notebook(p))


def read_notebook(path: Path):
    """The notebook myst-nb builds from ``path`` (same reader, same MyST configuration)."""
    from myst_nb.core.read import read_myst_markdown_notebook
    from myst_parser.config.main import MdParserConfig

    md_config = MdParserConfig(
        enable_extensions=set(CONF.myst_enable_extensions),
        heading_anchors=getattr(CONF, "myst_heading_anchors", 0),
    )
    return read_myst_markdown_notebook(
        path.read_text(encoding="utf-8"), config=md_config, add_source_map=True, path=str(path)
    )


def _kernel_python() -> str:
    """The Python executable the ``python3`` kernel will run; installs the spec if missing."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        spec = KernelSpecManager().get_kernel_spec(KERNEL_NAME)
    except NoSuchKernel:
        subprocess.run([sys.executable, "-m", "ipykernel", "install", "--sys-prefix", "--name", KERNEL_NAME],
                       check=True, capture_output=True)
        spec = KernelSpecManager().get_kernel_spec(KERNEL_NAME)
    exe = spec.argv[0]
    # jupyter_client runs these names with sys.executable (KernelManager.format_kernel_cmd).
    if exe in {"python", f"python{sys.version_info[0]}", "python%i.%i" % sys.version_info[:2]}:
        return sys.executable
    return exe


# Run in the kernel before the first cell: XLA:CPU programs (the notebooks' interpret-mode
# checks) compile without LLVM's optimizations, as in the test processes (tests/cpu_compile.py;
# TPU compiles and estimates are untouched). `kernels` first, as every notebook imports it; the
# names are deleted, so the notebook's namespace is as before.
_KERNEL_SETUP = (
    "import kernels as _k, importlib.util as _u; "
    f"_s = _u.spec_from_file_location('_cpu_compile', {str(ROOT / 'tests' / 'cpu_compile.py')!r}); "
    "_m = _u.module_from_spec(_s); _s.loader.exec_module(_m); _m.cpu_programs_compile_unoptimized(); "
    "del _k, _u, _s, _m")


def _cell_excerpt(source: str, lines: int = 6) -> str:
    head = source.splitlines()[:lines]
    more = "\n    ..." if len(source.splitlines()) > lines else ""
    return "\n".join(f"    {line}" for line in head) + more


def _describe_failure(path: Path, notebook, index: int | None, err: Exception) -> str:
    """Notebook, cell index, start of the cell's source, and the error with its traceback."""
    from nbclient.exceptions import CellExecutionError

    if index is None:
        where = "before the first cell"
        cell = None
    else:
        cell = notebook.cells[index]
        ordinal = sum(c.cell_type == "code" for c in notebook.cells[: index + 1])
        where = f"cell {index} (code cell #{ordinal}), which starts:\n{_cell_excerpt(cell.source)}"
    if isinstance(err, CellExecutionError):
        tracebacks = [
            "\n".join(out.get("traceback", []))
            for out in (cell.get("outputs", []) if cell is not None else [])
            if out.get("output_type") == "error"
        ]
        detail = _ANSI.sub("", tracebacks[-1] if tracebacks else err.traceback)
        error = f"{err.ename}: {err.evalue}\n\n{detail}"
    else:
        error = f"timed out after {CELL_TIMEOUT} s: {err}"
    return f"{path.relative_to(ROOT)} failed in {where}\n\n{error}"


@pytest.mark.notebook  # (no xdist_group: the workers share the cache through cache_lock)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook(path: Path, monkeypatch):
    from jupyter_cache import get_cache
    from jupyter_cache.base import CacheBundleIn
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError

    notebook = read_notebook(path)
    cache = get_cache(str(CACHE_PATH))
    with cache_lock():  # (the first access creates the database)
        try:
            record = cache.match_cache_notebook(notebook)
        except KeyError:
            record = None
    if record is not None and os.environ.get("NOTEBOOKS_REEXECUTE") != "1":
        # The same code already ran successfully (here or in `make docs`).  The cache key
        # does not cover the `kernels` package: set NOTEBOOKS_REEXECUTE=1 to run anyway.
        print(f"{path.name}: executed notebook found in {CACHE_PATH} (ID={record.pk}), not re-executed")
        return

    with cache_lock():  # two workers must not install the kernelspec at once
        kernel_python = _kernel_python()
    assert os.path.realpath(kernel_python) == os.path.realpath(sys.executable), (
        f"the {KERNEL_NAME!r} kernel runs {kernel_python}, not this environment's {sys.executable}; "
        f"run `{sys.executable} -m ipykernel install --sys-prefix`")

    # libtpu takes a process lockfile: the kernel and this process may both load it.
    monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    current = {"index": None}
    client = NotebookClient(
        notebook,
        timeout=CELL_TIMEOUT,
        kernel_name=KERNEL_NAME,
        extra_arguments=[f"--IPKernelApp.exec_lines={_KERNEL_SETUP}"],
        allow_errors=False,
        record_timing=False,  # as myst-nb: timings would change the cached cell metadata
        resources={"metadata": {"path": str(NOTEBOOK_DIR)}},
        on_cell_execute=lambda cell, cell_index: current.update(index=cell_index),
    )
    start = time.perf_counter()
    failure = None
    try:
        client.execute()
    except (CellExecutionError, CellTimeoutError) as err:
        failure = _describe_failure(path, notebook, current["index"], err)
    if failure is not None:  # outside the except block: no chained exception in the report
        pytest.fail(failure, pytrace=False)
    seconds = time.perf_counter() - start

    with cache_lock():
        record = cache.cache_notebook_bundle(
            CacheBundleIn(notebook, str(path), data={"execution_seconds": seconds}),
            check_validity=False,
            overwrite=True,
        )
        # The docs build must find it: match a freshly read copy, as myst-nb will.
        matched = cache.match_cache_notebook(read_notebook(path)).pk
    assert matched == record.pk
    print(f"{path.name}: executed in {seconds:.1f} s, cached as ID={record.pk} in {CACHE_PATH}")
