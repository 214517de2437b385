"""Unit tests of tools/site.py (redirect, notebook sync) and tools/i18n.py (.po checks)."""

from __future__ import annotations

import importlib.util
import json
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
    assert site_tool.main(["sync-check", "--notebooks", str(tmp_path)]) == 1


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
        "Use `x`, {py:func}`kernels.tpu.estimate_tpu`, {doc}`a page <docs/api>`, "
        "[JAX](https://jax.dev) and $F/P$ (costs $5 or $6).")
    assert found == {
        "`x`": 1,
        "{py:func}`kernels.tpu.estimate_tpu`": 1,
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
