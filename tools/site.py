"""Site helpers called by the Makefile.

    python tools/site.py redirect _build/html   # _build/html/index.html -> en/index.html
    python tools/site.py sync                   # repository URL into the sources; paired notebooks/*.ipynb
    python tools/site.py sync-check             # non-zero if anything ``sync`` writes is stale, or index.md
                                                # does not list every notebook

The notebooks are jupytext MyST Markdown files (``notebooks/<name>.md``), the
source of truth. ``sync`` writes ``notebooks/<name>.ipynb`` next to each one,
without outputs or execution counts, for Colab and Kaggle (which cannot read
MyST). The ``.ipynb`` is a pure function of the ``.md``: cell ids are derived
from the cells' content, so running ``sync`` twice gives identical bytes.

The repository's URL is written in one place, ``pyproject.toml``'s
``[project.urls] Source`` (a fork changes that line and runs ``make sync``).
Everything else derives from it:

* conf.py reads it for the theme's repository button and the Colab/Kaggle
  launch buttons (through :func:`launch_urls`, as the README does);
* ``sync`` writes it into the places that cannot read it at run time:

  - the first code cell of every notebook, which ``pip install``s
    ``<project.name> @ git+<Source>`` on Colab and Kaggle (where the repository
    is not checked out, so the notebook cannot read pyproject.toml);
  - every ``<project.name>[extras] @ git+<url>`` requirement and every
    ``git clone <url>`` (with the ``cd <folder>`` that follows it) in README.md,
    index.md and docs/*.md;
  - README.md's table of Colab/Kaggle badges, between ``<!-- notebooks:begin -->``
    and ``<!-- notebooks:end -->``: one row per notebook, in the order of
    index.md's toctree, titled with the notebook's first heading.

``sync-check`` (run by CI) fails when any of those differs from what ``sync``
writes, when a notebook has no install cell, and when index.md's "Where to
start" section or its toctree leaves out a notebook (``sync`` cannot write
that prose; add the bullet by hand).
"""

from __future__ import annotations

import argparse
import hashlib
import html
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from typing import NamedTuple
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
DEFAULT_LANGUAGE = "en"

#: The branch the launch links open the paired ``.ipynb`` from.
REPOSITORY_BRANCH = "main"
GITHUB_URL = "https://github.com/"
COLAB_URL = "https://colab.research.google.com"
KAGGLE_URL = "https://kaggle.com/kernels/welcome?src="
COLAB_BADGE = f"{COLAB_URL}/assets/colab-badge.svg"
KAGGLE_BADGE = "https://kaggle.com/static/images/open-in-kaggle.svg"


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


def sync_problems(directory: Path = NOTEBOOK_DIR, root: Path = ROOT) -> list[str]:
    """Why ``sync-check`` fails: one line per missing, stale or orphaned ``.ipynb``."""
    directory = Path(directory)
    problems = []
    sources = text_notebooks(directory)
    for md in sources:
        target = md.with_suffix(".ipynb")
        if not target.exists():
            problems.append(f"{_rel(target, root)}: missing (paired with {_rel(md, root)})")
        elif target.read_text(encoding="utf-8") != paired_ipynb(md):
            problems.append(f"{_rel(target, root)}: differs from what `make sync` writes from {_rel(md, root)}")
    stems = {md.stem for md in sources}
    for ipynb in sorted(directory.glob("*.ipynb")):
        if ipynb.stem not in stems:
            md = ipynb.with_suffix(".md")
            problems.append(f"{_rel(ipynb, root)}: no MyST notebook {_rel(md, root)} to pair it with")
    return problems


# --- the repository URL: pyproject.toml's [project.urls] Source ---------------------


class Project(NamedTuple):
    """What the sources derive from ``pyproject.toml``: the distribution name and repository URL."""

    root: Path
    name: str
    url: str  #: ``https://github.com/<owner>/<name>``, no trailing slash

    @classmethod
    def load(cls, root: Path = ROOT) -> "Project":
        root = Path(root)
        with open(root / "pyproject.toml", "rb") as f:
            project = tomllib.load(f)["project"]
        try:
            url = project["urls"]["Source"]
        except KeyError:
            raise SystemExit(f"error: {root / 'pyproject.toml'} has no [project.urls] Source") from None
        try:
            url = check_repository_url(url)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
        return cls(root=root, name=project["name"], url=url)

    @property
    def notebooks(self) -> Path:
        return self.root / "notebooks"

    @property
    def checkout(self) -> str:
        """The folder ``git clone <url>`` creates."""
        return self.url.rsplit("/", 1)[-1]

    def requirement(self, extras: str = "") -> str:
        """``<name><extras> @ git+<url>``, what pip installs this repository's package from."""
        return f"{self.name}{extras} @ git+{self.url}"


def check_repository_url(url: str) -> str:
    """``url`` without a trailing slash; it has to be a GitHub repository (Colab opens only those)."""
    url = url.strip().rstrip("/")
    if not re.fullmatch(re.escape(GITHUB_URL) + r"[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+", url) or url.endswith(".git"):
        raise ValueError(
            f"pyproject.toml's [project.urls] Source is {url!r}; it has to be a GitHub repository "
            f"({GITHUB_URL}<owner>/<name>, no .git): Colab and Kaggle open notebooks from GitHub")
    return url


def launch_urls(repository: str, path: str, branch: str = REPOSITORY_BRANCH) -> dict[str, str]:
    """GitHub, Colab and Kaggle URLs of the file ``path`` (relative to the repository root)."""
    github = f"{repository}/blob/{branch}/{path}"
    return {
        "github": github,
        "colab": f"{COLAB_URL}/github/{github.removeprefix(GITHUB_URL)}",
        "kaggle": f"{KAGGLE_URL}{github}",
    }


def _requirement_re(name: str) -> re.Pattern:
    # PEP 503: names compare case-insensitively, with runs of "-", "_" and "." equal.
    name_re = "[-_.]+".join(re.escape(part) for part in re.split(r"[-_.]+", name))
    return re.compile(
        rf"(?<![\w.-])(?P<name>{name_re})(?P<extras>\[[^\]\s]*\])?[ \t]*@[ \t]*git\+(?P<url>[^\s\"'`)]+)",
        re.IGNORECASE)


GIT_CLONE = re.compile(r"git clone (?P<url>[^\s\"'`]+)(?:\n(?P<indent>[ \t]*)cd (?P<folder>[^\s;&|]+))?")


class Drift(NamedTuple):
    """A place that names the repository differently from pyproject.toml."""

    line: int
    found: str
    expected: str


def render_urls(text: str, project: Project) -> tuple[str, list[Drift]]:
    """``text`` with every requirement and ``git clone`` of this package pointing at ``project.url``."""
    drifts: list[Drift] = []

    def replace(match: re.Match, expected: str) -> str:
        if match.group(0) != expected:
            line = text.count("\n", 0, match.start()) + 1
            drifts.append(Drift(line, match.group(0), expected))
        return expected

    text = _requirement_re(project.name).sub(
        lambda m: replace(m, project.requirement(m.group("extras") or "")), text)
    text = GIT_CLONE.sub(
        lambda m: replace(m, f"git clone {project.url}"
                          + (f"\n{m.group('indent')}cd {project.checkout}" if m.group("folder") else "")), text)
    return text, drifts


def _drift_lines(path: Path, drifts: list[Drift], root: Path) -> list[str]:
    return [f"{_rel(path, root)}:{d.line}: {d.found!r} should be {d.expected!r} "
            "(from pyproject.toml's [project.urls] Source)" for d in drifts]


# --- notebooks: the install cell ----------------------------------------------------

#: The first code cell of a MyST notebook (group ``body``: its source, options included).
FIRST_CODE_CELL = re.compile(r"^(?P<fence>`{3,})\{code-cell\}[^\n]*\n(?P<body>.*?)^(?P=fence)[ \t]*$", re.M | re.S)


def render_install_cell(text: str, project: Project) -> tuple[str | None, list[Drift]]:
    """The notebook ``text`` with its install cell pointing at ``project.url``.

    Returns ``(None, [])`` when the first code cell installs nothing from git.
    """
    cell = FIRST_CODE_CELL.search(text)
    if cell is None or not _requirement_re(project.name).search(cell.group("body")):
        return None, []
    body, drifts = render_urls(cell.group("body"), project)
    first_line = text.count("\n", 0, cell.start("body"))
    drifts = [Drift(d.line + first_line, d.found, d.expected) for d in drifts]
    return text[:cell.start("body")] + body + text[cell.end("body"):], drifts


def _install_cell_missing(md: Path, project: Project) -> str:
    return (f"{_rel(md, project.root)}: the first code cell does not install the package; start the notebook "
            f"with the install cell of the others (pip install \"{project.requirement()}\" if `kernels` is missing)")


def notebook_title(md: Path) -> str:
    """The first ``# `` heading of a MyST notebook (outside its front matter and code)."""
    lines = Path(md).read_text(encoding="utf-8").splitlines()
    if lines and lines[0].strip() == "---":
        end = next((i for i, line in enumerate(lines[1:], 1) if line.strip() == "---"), 0)
        lines = lines[end + 1:]
    fence = None
    for line in lines:
        stripped = line.lstrip()
        if fence:
            if stripped.startswith(fence) and not stripped[len(fence):].strip():
                fence = None
        elif m := re.match(r"(`{3,}|~{3,}|:{3,})", stripped):
            fence = m.group(1)
        elif m := re.match(r"#\s+(.+?)\s*#*\s*$", line):
            return m.group(1)
    return Path(md).stem


# --- index.md: "Where to start" and the toctree -------------------------------------

INDEX = "index.md"
WHERE_TO_START = "Where to start"
DOC_ROLE = re.compile(r"\{doc\}`(?:[^`<]*<)?(?P<target>[^`<>]+?)>?`")


def _doc_name(target: str) -> str:
    return target.strip().removeprefix("/").removeprefix("./").removesuffix(".md").removesuffix(".ipynb")


def index_section(text: str, title: str = WHERE_TO_START) -> str | None:
    """The body of the ``## <title>`` section of ``text``, up to the next heading or fenced block."""
    heading = re.search(rf"^##[ \t]+{re.escape(title)}[ \t]*$", text, re.M)
    if heading is None:
        return None
    rest = text[heading.end():]
    end = re.search(r"^(?:#{1,2}[ \t]|`{3,}|:{3,})", rest, re.M)
    return rest[:end.start()] if end else rest


def toctree_entries(text: str) -> list[str]:
    """The documents the ``{toctree}`` directives of a MyST page list, in order."""
    entries = []
    for block in re.finditer(r"^(?P<fence>`{3,}|:{3,})\{toctree\}[^\n]*\n(?P<body>.*?)^(?P=fence)[ \t]*$",
                             text, re.M | re.S):
        for line in block.group("body").splitlines():
            line = line.strip()
            if not line or line.startswith(":"):
                continue
            m = re.fullmatch(r".*<(?P<target>[^<>]+)>", line)
            entries.append(_doc_name(m.group("target") if m else line))
    return entries


def index_problems(project: Project, notebooks: list[Path] | None = None) -> list[str]:
    """index.md has to list every notebook under "Where to start" and in its toctree."""
    index = project.root / INDEX
    if notebooks is None:
        notebooks = text_notebooks(project.notebooks)
    text = index.read_text(encoding="utf-8")
    names = [_doc_name(md.relative_to(project.root).as_posix()) for md in notebooks]
    problems = []
    section = index_section(text)
    if section is None:
        problems.append(f"{_rel(index, project.root)}: no '## {WHERE_TO_START}' section")
    else:
        listed = {_doc_name(m.group("target")) for m in DOC_ROLE.finditer(section)}
        problems += [f"{_rel(index, project.root)}: '{WHERE_TO_START}' does not list {name} (add a bullet "
                     f"{{doc}}`{name}`: what the notebook shows)" for name in names if name not in listed]
    toctree = toctree_entries(text)
    problems += [f"{_rel(index, project.root)}: the toctree does not include {name}"
                 for name in names if name not in toctree]
    return problems


def notebooks_in_site_order(project: Project) -> list[Path]:
    """The notebooks in the order of index.md's toctree; any it leaves out follow, sorted."""
    notebooks = text_notebooks(project.notebooks)
    index = project.root / INDEX
    order = toctree_entries(index.read_text(encoding="utf-8")) if index.exists() else []

    def key(md: Path):
        name = _doc_name(md.relative_to(project.root).as_posix())
        return (order.index(name), "") if name in order else (len(order), md.name)

    return sorted(notebooks, key=key)


# --- README.md: the table of launch badges ------------------------------------------

README = "README.md"
TABLE_BEGIN = "<!-- notebooks:begin -->"
TABLE_END = "<!-- notebooks:end -->"
TABLE_HEADER = "| notebook | Colab (TPU v5e-1) | Kaggle (TPU v5e-8) |\n| --- | --- | --- |\n"


def notebook_table(project: Project, notebooks: list[Path]) -> str:
    """README's table: one row per notebook, with Colab and Kaggle badges opening its ``.ipynb``."""
    rows = [TABLE_HEADER]
    for md in notebooks:
        urls = launch_urls(project.url, md.with_suffix(".ipynb").relative_to(project.root).as_posix())
        title = notebook_title(md).replace("|", r"\|")
        rows.append(f"| {title} | [![Open in Colab]({COLAB_BADGE})]({urls['colab']}) "
                    f"| [![Open in Kaggle]({KAGGLE_BADGE})]({urls['kaggle']}) |\n")
    return "".join(rows)


def render_readme(text: str, project: Project, notebooks: list[Path]) -> tuple[str, list[str]]:
    """README ``text`` with a fresh table of notebooks; the list says what was stale in it."""
    begin, end = text.find(TABLE_BEGIN), text.find(TABLE_END)
    if begin < 0 or end < begin:
        return text, [f"{README}: no {TABLE_BEGIN} ... {TABLE_END} markers around the table of notebooks"]
    start = begin + len(TABLE_BEGIN)
    old, new = text[start:end], "\n\n" + notebook_table(project, notebooks) + "\n"
    problems = []
    if old != new:
        missing = [md.with_suffix(".ipynb").relative_to(project.root).as_posix() for md in notebooks]
        missing = [path for path in missing if f"/blob/{REPOSITORY_BRANCH}/{path})" not in old]
        why = f" (no row for {', '.join(missing)})" if missing else ""
        problems.append(f"{README}: the table of notebooks between {TABLE_BEGIN} and {TABLE_END} "
                        f"differs from what `make sync` writes{why}")
    return text[:start] + new + text[end:], problems


# --- every source that names the repository -----------------------------------------

#: Pages whose ``pip install ... @ git+`` and ``git clone`` commands name this repository.
DOCUMENTS = (README, INDEX, "docs/*.md")


def _documents(root: Path) -> list[Path]:
    return sorted({p for pattern in DOCUMENTS for p in Path(root).glob(pattern) if p.is_file()})


def render_sources(project: Project) -> tuple[dict[Path, str], list[str]]:
    """What ``sync`` writes into the sources (path -> text), and the problems it found."""
    files: dict[Path, str] = {}
    problems: list[str] = []
    for md in text_notebooks(project.notebooks):
        text, drifts = render_install_cell(md.read_text(encoding="utf-8"), project)
        if text is None:
            problems.append(_install_cell_missing(md, project))
            continue
        files[md] = text
        problems += _drift_lines(md, drifts, project.root)
    notebooks = notebooks_in_site_order(project)
    for path in _documents(project.root):
        text, drifts = render_urls(path.read_text(encoding="utf-8"), project)
        problems += _drift_lines(path, drifts, project.root)
        if path == project.root / README:
            text, stale = render_readme(text, project, notebooks)
            problems += stale
        files[path] = text
    return files, problems


def sync_sources(project: Project) -> list[Path]:
    """Writes the repository URL and README's table into the sources; returns the files changed."""
    files, _ = render_sources(project)
    written = []
    for path, text in files.items():
        if path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            written.append(path)
    return written


def source_problems(project: Project) -> list[str]:
    """Why ``sync-check`` fails, apart from the paired ``.ipynb``."""
    _, problems = render_sources(project)
    if (project.root / INDEX).exists():
        problems += index_problems(project)
    else:
        problems.append(f"{INDEX}: missing")
    return problems


def sync_all(root: Path = ROOT) -> list[Path]:
    """``make sync``: the URL and README's table into the sources, then the paired ``.ipynb``."""
    project = Project.load(root)
    return sync_sources(project) + sync(project.notebooks)


def check_all(root: Path = ROOT) -> list[str]:
    """``make sync-check``: every problem, one line each."""
    project = Project.load(root)
    return source_problems(project) + sync_problems(project.notebooks, project.root)


def _rel(path: Path, root: Path = ROOT) -> str:
    try:
        return Path(path).resolve().relative_to(Path(root).resolve()).as_posix()
    except ValueError:
        return str(path)


# --- math typeset offline, checked in a real browser -------------------------------------

BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome")
MATH_PAGES = ("docs/methodology.html", "notebooks/scan.html")  # pages with display and inline math


def find_browser() -> str | None:
    """A headless Chromium on PATH (Debian's ``chromium-headless-shell`` or ``chromium``), or None."""
    return next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)


def rendered_dom(page: Path, browser: str, wait_ms: int = 20000) -> str:
    """The page's DOM after its scripts ran, in headless Chromium with every network request sent to a
    dead proxy: a formula typeset here was typeset from the site's own files, as on a machine offline."""
    with tempfile.TemporaryDirectory() as profile:
        out = subprocess.run(
            [browser, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}",
             "--proxy-server=http://127.0.0.1:9", "--proxy-bypass-list=<-loopback>",
             "--allow-file-access-from-files", f"--virtual-time-budget={wait_ms}", "--dump-dom",
             page.resolve().as_uri()],
            capture_output=True, text=True, timeout=300)
    if out.returncode != 0 or "<html" not in out.stdout:
        raise RuntimeError(f"{browser} could not render {page}: {out.stderr[-2000:]}")
    return out.stdout


_MATH = re.compile(r'<(div|span) class="math[^"]*"[^>]*>(.*?)</\1>', re.S)


def math_problems(dom: str) -> tuple[int, list[str]]:
    """(formulas found, those left as raw TeX): MathJax replaces each formula's TeX by an ``mjx-container``."""
    found = _MATH.findall(dom)
    raw = [body.strip()[:80] for _, body in found if "<mjx-container" not in body]
    return len(found), raw


def check_math(site: Path, languages=("en", "es"), pages=MATH_PAGES) -> list[str]:
    browser = find_browser()
    if browser is None:
        return [f"no headless browser on PATH (one of {', '.join(BROWSERS)}; Debian: apt-get install "
                "chromium-headless-shell)"]
    problems = []
    for lang in languages:
        for rel in pages:
            page = site / lang / rel
            if not page.is_file():
                problems.append(f"{page}: missing (build the site first: make docs)")
                continue
            n, raw = math_problems(rendered_dom(page, browser))
            if n == 0:
                problems.append(f"{page}: no formula found (the check would prove nothing)")
            elif raw:
                problems.append(f"{page}: {len(raw)} of {n} formulas not typeset, e.g. {raw[0]!r}")
            else:
                print(f"{page.relative_to(site)}: {n} formulas typeset offline")
    return problems


# --- command line -------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/site.py", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("redirect", help="write DIR/index.html redirecting to en/index.html")
    p.add_argument("directory", type=Path)
    p.add_argument("--language", default=DEFAULT_LANGUAGE)
    p = sub.add_parser("check-math", help="fail unless the built site's formulas typeset in a headless browser, offline")
    p.add_argument("directory", type=Path, help="the built site (_build/html)")
    for name, text in (("sync", "write pyproject's repository URL into the sources, README's table of "
                                "notebooks and the paired .ipynb of every notebooks/*.md"),
                       ("sync-check", "fail if anything `sync` writes is stale or index.md leaves out a notebook")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--root", type=Path, default=ROOT, help="repository root (default: this checkout)")
    args = parser.parse_args(argv)

    if args.command == "redirect":
        print(f"wrote {write_redirect(args.directory, args.language)}")
        return 0
    if args.command == "check-math":
        problems = check_math(args.directory)
        for line in problems:
            print(f"error: {line}", file=sys.stderr)
        return 1 if problems else 0
    notebooks = Project.load(args.root).notebooks
    if args.command == "sync":
        written = sync_all(args.root)
        for path in written:
            print(f"wrote {_rel(path, args.root)}")
        print(f"{len(written)} file(s) updated")
    problems = check_all(args.root)
    for line in problems:
        print(f"error: {line}", file=sys.stderr)
    if problems:
        if args.command == "sync-check":
            print("Run `make sync` and commit what it writes; it cannot fix a missing install cell "
                  "or a notebook missing from index.md.", file=sys.stderr)
        return 1
    if args.command == "sync-check":
        print(f"{len(text_notebooks(notebooks))} notebook(s), their .ipynb, install cells, README.md, "
              "index.md and docs in sync with pyproject.toml")
    return 0


if __name__ == "__main__":
    sys.exit(main())
