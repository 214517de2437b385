"""Site helpers called by the Makefile.

    python tools/site.py redirect _build/html   # _build/html/index.html -> en/index.html
    python tools/site.py sync                   # notebooks/*.md -> paired notebooks/*.ipynb
    python tools/site.py sync-check             # non-zero if a paired .ipynb is missing/stale

The notebooks are jupytext MyST Markdown files (``notebooks/<name>.md``), the
source of truth. ``sync`` writes ``notebooks/<name>.ipynb`` next to each one,
without outputs or execution counts, for Colab and Kaggle (which cannot read
MyST). The ``.ipynb`` is a pure function of the ``.md``: cell ids are derived
from the cells' content, so running ``sync`` twice gives identical bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import html
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
DEFAULT_LANGUAGE = "en"


# --- redirect -----------------------------------------------------------------------


def redirect_html(target: str) -> str:
    """A page that sends the browser to ``target`` (a relative URL)."""
    url = html.escape(target, quote=True)
    return f"""<!DOCTYPE html>
<html lang="en">
  <head>
    <meta charset="utf-8">
    <title>Pallas TPU kernels</title>
    <meta http-equiv="refresh" content="0; url={url}">
    <script>window.location.replace({target!r} + window.location.hash);</script>
  </head>
  <body>
    <p>Redirecting to <a href="{url}">{url}</a>.</p>
  </body>
</html>
"""


def write_redirect(directory: Path, language: str = DEFAULT_LANGUAGE) -> Path:
    directory = Path(directory)
    if not (directory / language / "index.html").is_file():
        raise SystemExit(f"error: {directory / language / 'index.html'} does not exist; build the site first")
    path = directory / "index.html"
    path.write_text(redirect_html(f"{language}/index.html"), encoding="utf-8")
    return path


# --- notebooks ----------------------------------------------------------------------


def is_text_notebook(path: Path) -> bool:
    """True if ``path`` is a jupytext MyST notebook (the same test myst-nb applies)."""
    from myst_nb.core.read import is_myst_markdown_notebook

    return is_myst_markdown_notebook(path.read_text(encoding="utf-8"))


def text_notebooks(directory: Path = NOTEBOOK_DIR) -> list[Path]:
    """The MyST notebooks of ``directory``, sorted; other ``.md`` files are skipped."""
    return sorted(p for p in Path(directory).glob("*.md") if is_text_notebook(p))


def _cell_id(cell, seen: set[str]) -> str:
    digest = hashlib.sha1(f"{cell.cell_type}\n{cell.source}".encode("utf-8")).hexdigest()
    base = digest[:8]
    cell_id, n = base, 1
    while cell_id in seen:  # identical cells: keep ids unique and stable
        cell_id = f"{base}-{n}"
        n += 1
    seen.add(cell_id)
    return cell_id


def paired_ipynb(md_path: Path) -> str:
    """The ``.ipynb`` text ``sync`` writes for ``md_path``: no outputs, stable bytes."""
    import jupytext
    import nbformat

    nb = jupytext.read(md_path, fmt="md:myst")
    seen: set[str] = set()
    for cell in nb.cells:
        cell.id = _cell_id(cell, seen)
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    nb.nbformat, nb.nbformat_minor = 4, 5
    nbformat.validate(nb)
    return jupytext.writes(nb, fmt="ipynb")


def sync(directory: Path = NOTEBOOK_DIR) -> list[Path]:
    """Writes every paired ``.ipynb`` that is missing or differs; returns those written."""
    written = []
    for md in text_notebooks(directory):
        target = md.with_suffix(".ipynb")
        text = paired_ipynb(md)
        if not target.exists() or target.read_text(encoding="utf-8") != text:
            target.write_text(text, encoding="utf-8")
            written.append(target)
    return written


def sync_problems(directory: Path = NOTEBOOK_DIR) -> list[str]:
    """Why ``sync-check`` fails: one line per missing, stale or orphaned ``.ipynb``."""
    directory = Path(directory)
    problems = []
    sources = text_notebooks(directory)
    for md in sources:
        target = md.with_suffix(".ipynb")
        if not target.exists():
            problems.append(f"{_rel(target)}: missing (paired with {_rel(md)})")
        elif target.read_text(encoding="utf-8") != paired_ipynb(md):
            problems.append(f"{_rel(target)}: differs from what `make sync` writes from {_rel(md)}")
    stems = {md.stem for md in sources}
    for ipynb in sorted(directory.glob("*.ipynb")):
        if ipynb.stem not in stems:
            problems.append(f"{_rel(ipynb)}: no MyST notebook {_rel(ipynb.with_suffix('.md'))} to pair it with")
    return problems


def _rel(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


# --- command line -------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/site.py", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("redirect", help="write DIR/index.html redirecting to en/index.html")
    p.add_argument("directory", type=Path)
    p.add_argument("--language", default=DEFAULT_LANGUAGE)
    for name, text in (("sync", "write the paired .ipynb of every notebooks/*.md"),
                       ("sync-check", "fail if a paired .ipynb is missing or stale")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--notebooks", type=Path, default=NOTEBOOK_DIR, help="notebook folder (default: notebooks/)")
    args = parser.parse_args(argv)

    if args.command == "redirect":
        print(f"wrote {write_redirect(args.directory, args.language)}")
        return 0
    if args.command == "sync":
        written = sync(args.notebooks)
        for path in written:
            print(f"wrote {_rel(path)}")
        print(f"{len(written)} notebook(s) updated, {len(text_notebooks(args.notebooks)) - len(written)} already in sync")
        return 0
    problems = sync_problems(args.notebooks)
    for line in problems:
        print(f"error: {line}", file=sys.stderr)
    if problems:
        print("Run `make sync` and commit the .ipynb files.", file=sys.stderr)
        return 1
    print(f"{len(text_notebooks(args.notebooks))} paired notebook(s) in sync")
    return 0


if __name__ == "__main__":
    sys.exit(main())
