"""Unit tests of tools/site.py (redirect, notebook sync) and tools/i18n.py (.po checks)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The tools drive Sphinx, myst-nb, jupytext and sphinx-intl (the `docs` extra).
pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("myst_nb", "jupytext", "sphinx_intl", "babel")),
    reason="needs the `docs` extra",
)


def _load(name: str, path: Path):
    # tools/ is not a package, and "site" would clash with the standard library module.
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


site_tool = _load("tools_site", ROOT / "tools" / "site.py")
i18n_tool = _load("tools_i18n", ROOT / "tools" / "i18n.py")

NOTEBOOK = textwrap.dedent(
    """\
    ---
    jupytext:
      text_representation:
        extension: .md
        format_name: myst
        format_version: 0.13
        jupytext_version: 1.19.6
    kernelspec:
      display_name: Python 3 (ipykernel)
      language: python
      name: python3
    ---

    # A notebook

    Some text.

    ```{code-cell} ipython3
    x = 1
    ```

    ```{code-cell} ipython3
    :tags: [hide-input]
    x = 1
    ```
    """
)


# --- tools/site.py ------------------------------------------------------------------


def test_redirect(tmp_path):
    (tmp_path / "en").mkdir()
    (tmp_path / "en" / "index.html").write_text("<html></html>")
    assert site_tool.main(["redirect", str(tmp_path)]) == 0
    page = (tmp_path / "index.html").read_text()
    assert 'http-equiv="refresh" content="0; url=en/index.html"' in page
    assert '<a href="en/index.html">' in page


def test_redirect_needs_a_built_site(tmp_path):
    with pytest.raises(SystemExit):
        site_tool.write_redirect(tmp_path)


def test_sync_is_deterministic(tmp_path):
    (tmp_path / "demo.md").write_text(NOTEBOOK)
    (tmp_path / "notes.md").write_text("# Not a notebook\n")
    assert site_tool.sync(tmp_path) == [tmp_path / "demo.ipynb"]
    first = (tmp_path / "demo.ipynb").read_bytes()
    assert site_tool.sync(tmp_path) == []
    assert (tmp_path / "demo.ipynb").read_bytes() == first
    assert site_tool.paired_ipynb(tmp_path / "demo.md") == first.decode()  # fresh read, same bytes
    assert not (tmp_path / "notes.ipynb").exists()
    assert site_tool.sync_problems(tmp_path) == []

    nb = json.loads(first)
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert [c["outputs"] for c in code] == [[], []]
    assert [c["execution_count"] for c in code] == [None, None]
    assert code[1]["metadata"] == {"tags": ["hide-input"]}
    ids = [c["id"] for c in nb["cells"]]
    assert len(set(ids)) == len(ids)  # the two identical "x = 1" cells get distinct ids


def test_sync_check_names_missing_stale_and_orphaned_notebooks(tmp_path):
    (tmp_path / "demo.md").write_text(NOTEBOOK)
    problems = site_tool.sync_problems(tmp_path)
    assert len(problems) == 1 and "demo.ipynb: missing" in problems[0]

    site_tool.sync(tmp_path)
    (tmp_path / "demo.md").write_text(NOTEBOOK.replace("x = 1", "x = 2", 1))
    problems = site_tool.sync_problems(tmp_path)
    assert len(problems) == 1 and "demo.ipynb: differs" in problems[0]

    site_tool.sync(tmp_path)
    (tmp_path / "old.ipynb").write_text("{}")
    problems = site_tool.sync_problems(tmp_path)
    assert len(problems) == 1 and "old.ipynb" in problems[0]


# --- tools/site.py: the repository URL, README's table, index.md ----------------------

OLD_URL = "https://github.com/pallas-kernels/pallas-kernels"
FORK_URL = "https://github.com/someone/tpu-kernels"

PYPROJECT = textwrap.dedent(
    """\
    [project]
    name = "pallas-kernels"
    version = "0.1.0"

    [project.urls]
    Documentation = "https://example.org/docs/"
    Source = "{url}"
    """
)

INSTALL_CELL = textwrap.dedent(
    """\
    ```{{code-cell}} ipython3
    :tags: [remove-cell]

    # On Colab or Kaggle: install this repository's package first.
    import importlib.util, subprocess, sys
    if importlib.util.find_spec("kernels") is None:
        subprocess.check_call([sys.executable, "-m", "pip", "install", "-q",
                               "pallas-kernels @ git+{url}"])
    ```
    """
)


def _notebook(title: str, url: str = OLD_URL, install: bool = True) -> str:
    front, body = NOTEBOOK.split("# A notebook\n")
    return front + f"# {title}\n\nIntro.\n\n" + (INSTALL_CELL.format(url=url) if install else "") + body


README = textwrap.dedent(
    """\
    # Project

    ## Run a notebook on a TPU

    <!-- notebooks:begin -->
    | notebook | old table |
    <!-- notebooks:end -->

    ```bash
    pip install "pallas-kernels[tpu] @ git+{url}"
    ```
    """
)

INDEX = textwrap.dedent(
    """\
    # Home

    ## Where to start

    - {{doc}}`docs/getting_started`: install it.
    {bullets}
    Some closing words.

    ```{{toctree}}
    :maxdepth: 1
    :hidden:

    docs/getting_started
    {toctree}
    ```
    """
)

GETTING_STARTED = textwrap.dedent(
    """\
    # Getting started

    ```bash
    pip install "pallas-kernels[tpu] @ git+{url}"
    git clone {url}
    cd pallas-kernels
    pip install "jax @ git+https://github.com/jax-ml/jax"
    ```
    """
)


def _index(listed: list[str], toctree: list[str] | None = None) -> str:
    toctree = listed if toctree is None else toctree
    return INDEX.format(bullets="".join(f"- {{doc}}`notebooks/{n}`: about {n}.\n" for n in listed),
                        toctree="\n".join(f"notebooks/{n}" for n in toctree))


@pytest.fixture
def repo(tmp_path):
    """A small repository whose sources all name OLD_URL: two notebooks, README, index.md, one doc page."""
    (tmp_path / "pyproject.toml").write_text(PYPROJECT.format(url=OLD_URL))
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "notebooks" / "second.md").write_text(_notebook("Second | notebook"))
    (tmp_path / "notebooks" / "first.md").write_text(_notebook("First notebook"))
    (tmp_path / "README.md").write_text(README.format(url=OLD_URL))
    (tmp_path / "index.md").write_text(_index(["first", "second"]))
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "getting_started.md").write_text(GETTING_STARTED.format(url=OLD_URL))
    site_tool.sync_all(tmp_path)
    assert site_tool.check_all(tmp_path) == []
    return tmp_path


def test_launch_urls():
    urls = site_tool.launch_urls(FORK_URL, "notebooks/matmul.ipynb")
    assert urls == {
        "github": "https://github.com/someone/tpu-kernels/blob/main/notebooks/matmul.ipynb",
        "colab": "https://colab.research.google.com/github/someone/tpu-kernels/blob/main/notebooks/matmul.ipynb",
        "kaggle": "https://kaggle.com/kernels/welcome?src="
                  "https://github.com/someone/tpu-kernels/blob/main/notebooks/matmul.ipynb",
    }
    assert site_tool.check_repository_url(FORK_URL + "/") == FORK_URL
    for bad in ("https://gitlab.com/someone/tpu-kernels", FORK_URL + ".git", "https://github.com/someone"):
        with pytest.raises(ValueError, match="GitHub repository"):
            site_tool.check_repository_url(bad)


def test_sync_writes_readme_table_in_toctree_order(repo):
    readme = (repo / "README.md").read_text()
    table = readme.split("<!-- notebooks:begin -->\n\n")[1].split("\n\n<!-- notebooks:end -->")[0]
    colab = "https://colab.research.google.com/github/pallas-kernels/pallas-kernels/blob/main/notebooks"
    kaggle = f"https://kaggle.com/kernels/welcome?src={OLD_URL}/blob/main/notebooks"
    assert table.splitlines() == [
        "| notebook | Colab (TPU v5e-1) | Kaggle (TPU v5e-8) |",
        "| --- | --- | --- |",
        # titles are the notebooks' first headings (not the "# On Colab" comment in the install cell)
        f"| First notebook | [![Open in Colab]({site_tool.COLAB_BADGE})]({colab}/first.ipynb) "
        f"| [![Open in Kaggle]({site_tool.KAGGLE_BADGE})]({kaggle}/first.ipynb) |",
        f"| Second \\| notebook | [![Open in Colab]({site_tool.COLAB_BADGE})]({colab}/second.ipynb) "
        f"| [![Open in Kaggle]({site_tool.KAGGLE_BADGE})]({kaggle}/second.ipynb) |",
    ]
    # index.md's toctree decides the order, not the file names
    (repo / "index.md").write_text(_index(["second", "first"]))
    site_tool.sync_all(repo)
    readme = (repo / "README.md").read_text()
    assert readme.index("second.ipynb") < readme.index("first.ipynb")


def test_a_fork_changes_one_line(repo):
    pyproject = repo / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace(OLD_URL, FORK_URL))

    problems = site_tool.check_all(repo)
    text = "\n".join(problems)
    for name in ("first", "second"):
        # the requirement is on line 25 of each notebook
        assert (f"notebooks/{name}.md:25: 'pallas-kernels @ git+{OLD_URL}' should be "
                f"'pallas-kernels @ git+{FORK_URL}'") in text
    assert (f"README.md:15: 'pallas-kernels[tpu] @ git+{OLD_URL}' should be "
            f"'pallas-kernels[tpu] @ git+{FORK_URL}'") in text
    assert "README.md: the table of notebooks between <!-- notebooks:begin -->" in text
    assert f"docs/getting_started.md:5: 'git clone {OLD_URL}\\ncd pallas-kernels' should be " in text
    assert site_tool.main(["sync-check", "--root", str(repo)]) == 1

    site_tool.sync_all(repo)
    assert site_tool.check_all(repo) == []
    assert site_tool.main(["sync-check", "--root", str(repo)]) == 0
    for name in ("first", "second"):
        md = (repo / "notebooks" / f"{name}.md").read_text()
        assert f'"pallas-kernels @ git+{FORK_URL}"])' in md and OLD_URL not in md
        nb = json.loads((repo / "notebooks" / f"{name}.ipynb").read_text())
        install = next(c for c in nb["cells"] if c["cell_type"] == "code")
        assert f"pallas-kernels @ git+{FORK_URL}" in "".join(install["source"])
    readme = (repo / "README.md").read_text()
    assert OLD_URL not in readme
    assert f'pip install "pallas-kernels[tpu] @ git+{FORK_URL}"' in readme
    assert "https://colab.research.google.com/github/someone/tpu-kernels/blob/main/notebooks/first.ipynb" in readme
    doc = (repo / "docs" / "getting_started.md").read_text()
    assert f"git clone {FORK_URL}\ncd tpu-kernels\n" in doc
    # another package's git requirement is left alone
    assert 'pip install "jax @ git+https://github.com/jax-ml/jax"' in doc


def test_check_finds_a_drifted_install_cell(repo):
    md = repo / "notebooks" / "second.md"
    md.write_text(md.read_text().replace(OLD_URL, FORK_URL))
    site_tool.sync(repo / "notebooks")  # the .ipynb follows the .md: only the URL check can see this
    problems = site_tool.check_all(repo)
    assert problems == [f"notebooks/second.md:25: 'pallas-kernels @ git+{FORK_URL}' should be "
                        f"'pallas-kernels @ git+{OLD_URL}' (from pyproject.toml's [project.urls] Source)"]
    assert site_tool.main(["sync", "--root", str(repo)]) == 0
    assert OLD_URL in md.read_text() and FORK_URL not in md.read_text()


def test_check_finds_a_drifted_readme(repo):
    readme = repo / "README.md"
    text = readme.read_text()
    readme.write_text(text.replace(f"[tpu] @ git+{OLD_URL}", f"[tpu] @ git+{FORK_URL}"))
    problems = site_tool.check_all(repo)
    assert len(problems) == 1 and problems[0].startswith(f"README.md:15: 'pallas-kernels[tpu] @ git+{FORK_URL}'")

    readme.write_text(text.replace("/notebooks/first.ipynb", "/notebooks/frist.ipynb"))
    problems = site_tool.check_all(repo)
    assert len(problems) == 1 and "the table of notebooks" in problems[0]
    assert problems[0].endswith("(no row for notebooks/first.ipynb)")

    readme.write_text(text.replace("<!-- notebooks:end -->", ""))
    problems = site_tool.check_all(repo)
    assert problems == ["README.md: no <!-- notebooks:begin --> ... <!-- notebooks:end --> markers "
                        "around the table of notebooks"]


def test_check_finds_a_notebook_missing_from_index(repo):
    (repo / "notebooks" / "third.md").write_text(_notebook("Third"))
    problems = site_tool.check_all(repo)
    assert "index.md: 'Where to start' does not list notebooks/third (add a bullet " \
           "{doc}`notebooks/third`: what the notebook shows)" in problems
    assert "index.md: the toctree does not include notebooks/third" in problems
    assert "notebooks/third.ipynb: missing (paired with notebooks/third.md)" in problems
    assert any("no row for notebooks/third.ipynb" in p for p in problems)

    # in the toctree only: the toctree after the section does not count as listing it
    (repo / "index.md").write_text(_index(["first", "second"], toctree=["first", "second", "third"]))
    site_tool.sync_all(repo)
    assert site_tool.check_all(repo) == ["index.md: 'Where to start' does not list notebooks/third "
                                         "(add a bullet {doc}`notebooks/third`: what the notebook shows)"]
    assert site_tool.main(["sync", "--root", str(repo)]) == 1  # sync cannot write the bullet

    (repo / "index.md").write_text(_index(["first", "second", "third"]).replace(
        "{doc}`notebooks/third`", "{doc}`the third one <notebooks/third>`"))
    assert site_tool.check_all(repo) == []

    (repo / "index.md").write_text(_index(["first", "second", "third"]).replace("## Where to start", "## Start"))
    assert site_tool.check_all(repo) == ["index.md: no '## Where to start' section"]


def test_check_finds_a_notebook_without_install_cell(repo):
    (repo / "notebooks" / "third.md").write_text(_notebook("Third", install=False))
    (repo / "index.md").write_text(_index(["first", "second", "third"]))
    site_tool.sync_all(repo)
    problems = site_tool.check_all(repo)
    assert problems == ["notebooks/third.md: the first code cell does not install the package; start the "
                        "notebook with the install cell of the others (pip install "
                        f"\"pallas-kernels @ git+{OLD_URL}\" if `kernels` is missing)"]


def test_this_repository_is_in_sync():
    """index.md lists every notebook, and every source names pyproject.toml's URL."""
    project = site_tool.Project.load(ROOT)
    assert site_tool.source_problems(project) == []
    names = {md.stem for md in site_tool.text_notebooks(project.notebooks)}
    assert {"getting_started", "calibration", "matmul", "norm", "flash_attention"} <= names


# --- tools/i18n.py ------------------------------------------------------------------

HEADER = textwrap.dedent(
    """\
    msgid ""
    msgstr ""
    "Content-Type: text/plain; charset=UTF-8\\n"
    "Language: {lang}\\n"

    """
)


def _write(path: Path, body: str, lang: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(HEADER.format(lang=lang) + textwrap.dedent(body), encoding="utf-8")
    return path


@pytest.fixture
def catalogs(tmp_path):
    pot_dir, locale_dir = tmp_path / "pot", tmp_path / "locale"
    _write(pot_dir / "docs" / "page.pot", """\
        msgid "Title"
        msgstr ""

        msgid "Run `make docs`, then read {doc}`the guide <docs/guide>`."
        msgstr ""
        """)
    return pot_dir, locale_dir


def _po(locale_dir: Path, body: str, name: str = "docs/page") -> Path:
    return _write(locale_dir / "es" / "LC_MESSAGES" / f"{name}.po", body, lang="es")


def test_check_accepts_a_complete_catalog(catalogs):
    pot_dir, locale_dir = catalogs
    _po(locale_dir, """\
        msgid "Title"
        msgstr "Título"

        msgid "Run `make docs`, then read {doc}`the guide <docs/guide>`."
        msgstr "Ejecute `make docs` y lea {doc}`la guía <docs/guide>`."
        """)
    assert i18n_tool.catalog_problems(pot_dir, locale_dir) == []


def test_check_finds_fuzzy_and_untranslated_entries(catalogs):
    pot_dir, locale_dir = catalogs
    _po(locale_dir, """\
        #, fuzzy
        msgid "Title"
        msgstr "Título"

        msgid "Run `make docs`, then read {doc}`the guide <docs/guide>`."
        msgstr ""
        """)
    problems = i18n_tool.catalog_problems(pot_dir, locale_dir)
    assert any("page.po: fuzzy: 'Title'" in p for p in problems), problems
    assert any("page.po: untranslated: 'Run `make docs`" in p for p in problems), problems
    assert len(problems) == 2


def test_check_finds_stale_catalogs(catalogs):
    pot_dir, locale_dir = catalogs
    _po(locale_dir, """\
        msgid "Title"
        msgstr "Título"

        msgid "An old paragraph."
        msgstr "Un párrafo antiguo."

        #~ msgid "Older still."
        #~ msgstr "Más antiguo aún."
        """)
    _po(locale_dir, 'msgid "Gone"\nmsgstr "Ido"\n', name="removed_page")
    problems = i18n_tool.catalog_problems(pot_dir, locale_dir)
    text = "\n".join(problems)
    assert "page.po: stale: msgid missing from the .po (run `make gettext`): 'Run `make docs`" in text
    assert "page.po: stale: msgid no longer in the sources (run `make gettext`): 'An old paragraph.'" in text
    assert "page.po: obsolete entry (run `make gettext`): 'Older still.'" in text
    assert "removed_page.po: stale: there is no page 'removed_page'" in text

    (locale_dir / "es" / "LC_MESSAGES" / "docs" / "page.po").unlink()
    assert any("page.po: missing" in p for p in i18n_tool.catalog_problems(pot_dir, locale_dir))


def test_check_finds_broken_markup(catalogs):
    pot_dir, locale_dir = catalogs
    _po(locale_dir, """\
        msgid "Title"
        msgstr "Título"

        msgid "Run `make docs`, then read {doc}`the guide <docs/guide>`."
        msgstr "Ejecute `make documentos` y lea {doc}`la guía <docs/guia>`."
        """)
    problems = i18n_tool.catalog_problems(pot_dir, locale_dir)
    assert len(problems) == 1 and "markup changed" in problems[0]
    assert "lost `make docs`" in problems[0] and "<docs/guide>" in problems[0]


def test_check_finds_translations_that_would_parse_as_a_list(tmp_path):
    pot_dir, locale_dir = tmp_path / "pot", tmp_path / "locale"
    _write(pot_dir / "page.pot", 'msgid "1. Measured"\nmsgstr ""\n\nmsgid "Two"\nmsgstr ""\n')
    _po(locale_dir, 'msgid "1. Measured"\nmsgstr "1. Medido"\n\nmsgid "Two"\nmsgstr "Dos"\n', name="page")
    problems = i18n_tool.catalog_problems(pot_dir, locale_dir)
    assert len(problems) == 1 and "starts like a Markdown list" in problems[0]
    _po(locale_dir, 'msgid "1. Measured"\nmsgstr "1\\\\. Medido"\n\nmsgid "Two"\nmsgstr "Dos"\n', name="page")
    assert i18n_tool.catalog_problems(pot_dir, locale_dir) == []


def test_protected_markup():
    found = i18n_tool.protected_markup(
        "Use `x`, {py:func}`kernels.perf.tpu.estimate_tpu`, {doc}`a page <docs/api>`, "
        "[JAX](https://jax.dev) and $F/P$ (costs $5 or $6).")
    assert found == {
        "`x`": 1,
        "{py:func}`kernels.perf.tpu.estimate_tpu`": 1,
        "{doc}`... <docs/api>`": 1,
        "(https://jax.dev)": 1,
        "$F/P$": 1,
    }


def test_update_merges_and_drops_obsolete_and_orphaned_catalogs(catalogs):
    pot_dir, locale_dir = catalogs
    page = _po(locale_dir, """\
        msgid "Title"
        msgstr "Título"

        #~ msgid "Older still."
        #~ msgstr "Más antiguo aún."
        """)
    orphan = _po(locale_dir, 'msgid "Gone"\nmsgstr "Ido"\n', name="removed_page")
    i18n_tool.update(pot_dir, locale_dir, ("es",))
    assert not orphan.exists()
    catalog = i18n_tool.read_catalog(page)
    assert not catalog.obsolete
    assert catalog["Title"].string == "Título"
    assert catalog["Run `make docs`, then read {doc}`the guide <docs/guide>`."].string == ""
    problems = i18n_tool.catalog_problems(pot_dir, locale_dir)
    assert len(problems) == 1 and "untranslated" in problems[0]


# --- math typeset offline (issue 55): conf.py ships MathJax with the site, checked in a real browser ---

def _browser():
  browser = site_tool.find_browser()
  if browser is None:
    if os.environ.get("CI"):
      pytest.fail("CI has no headless browser: .ci/run installs chromium-headless-shell")
    pytest.skip("no headless Chromium on PATH (apt-get install chromium-headless-shell)")
  return browser


def _page_with_math(directory: Path, script_src: str) -> Path:
  page = directory / "page.html"
  page.write_text(f'<html><head><script defer src="{script_src}"></script></head><body>'
                  '<div class="math notranslate nohighlight">\\[h_t = a_t \\odot h_{t-1} + b_t,\\]</div>'
                  '<p>and <span class="math notranslate nohighlight">\\(\\mathbb{R}^{d}\\)</span></p></body></html>')
  return page


def test_site_mathjax_typesets_offline_in_a_browser(tmp_path):
  """The files conf.py copies into _static typeset display and inline math with the network cut off."""
  browser = _browser()
  conf = _load("site_conf", ROOT / "conf.py")
  src = conf._mathjax_source()
  static = tmp_path / "_static"
  for rel in conf._MATHJAX_FILES:  # what _copy_mathjax copies, from the same package
    dest = static / "mathjax" / rel
    if (src / rel).is_dir():
      shutil.copytree(src / rel, dest)
    else:
      dest.parent.mkdir(parents=True, exist_ok=True)
      shutil.copyfile(src / rel, dest)
  page = _page_with_math(tmp_path, "_static/" + conf.mathjax_path)
  assert site_tool.math_problems(site_tool.rendered_dom(page, browser)) == (2, [])


def test_math_check_fails_when_mathjax_comes_from_a_cdn(tmp_path):
  """The check's browser has no network: MathJax from a CDN leaves the TeX raw, and the check says so."""
  browser = _browser()
  page = _page_with_math(tmp_path, "https://cdn.jsdelivr.net/npm/mathjax@3/es5/tex-chtml.js")
  n, raw = site_tool.math_problems(site_tool.rendered_dom(page, browser, wait_ms=5000))
  assert n == 2 and len(raw) == 2 and raw[0].startswith("\\[h_t")
