"""Sphinx configuration for the bilingual (en/es) Pallas TPU kernels site.

The Sphinx source directory is the repository root. Build one language with::

    python -m sphinx -b html -D language=es . _build/html/es

(``make docs`` builds both languages and the redirecting ``_build/html/index.html``).
"""

from __future__ import annotations

import html
import importlib.util
import os
import shutil
import sys
import tomllib
from pathlib import Path

from docutils import nodes
from sphinx import addnodes
from sphinx.transforms import SphinxTransform

ROOT = Path(__file__).resolve().parent

# Import the package under documentation from this checkout (autodoc).
sys.path.insert(0, str(ROOT))
# libtpu takes a process lockfile; the Sphinx process (autodoc imports) and the
# notebook kernels myst-nb starts may both load it.  Kernels inherit this env.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

with open(ROOT / "pyproject.toml", "rb") as _f:
    _pyproject = tomllib.load(_f)["project"]


def _load_site_tool():
    # tools/ is not a package, and "site" would clash with the standard library module.
    spec = importlib.util.spec_from_file_location("_pallas_kernels_site_tool", ROOT / "tools" / "site.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: tools/site.py builds the launch links; README.md's badges come from the same function.
_site_tool = _load_site_tool()

# -- Project -----------------------------------------------------------------
project = "Pallas TPU kernels"
author = "pallas-kernels maintainers"
copyright = "pallas-kernels maintainers"
release = _pyproject["version"]
version = release
#: The one place the repository's URL is written: pyproject.toml's [project.urls] Source.
REPOSITORY_URL = _site_tool.check_repository_url(_pyproject["urls"]["Source"])
#: Where the site is published; each language lives under ``<DOCS_URL><lang>/``.
DOCS_URL = _pyproject["urls"]["Documentation"].rstrip("/") + "/"
REPOSITORY_BRANCH = _site_tool.REPOSITORY_BRANCH

# -- General -----------------------------------------------------------------
extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "sphinx.ext.mathjax",
]
root_doc = "index"
templates_path = ["docs/_templates"]
html_static_path = ["docs/_static"]
exclude_patterns = [
    ".venv*",
    "_build",
    ".ci",
    "tests",
    "tools",
    "kernels",
    "README.md",
    "**/*.py",
    "notebooks/*.ipynb",
    "docs/locale",
    "docs/_templates",
    "docs/_static",
    ".hypothesis",
    ".pytest_cache",
    "**/.ipynb_checkpoints",
    "*.egg-info",
    ".git",
    ".github",
]
# myst-nb registers ``.md`` (and ``.ipynb``) for its parser.  A ``.md`` file is
# read as a notebook only when its front matter has ``jupytext`` ->
# ``text_representation`` -> ``format_name: myst``; any other ``.md`` is parsed
# as a plain MyST page.
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}

# -- MyST --------------------------------------------------------------------
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 3

# -- myst-nb -----------------------------------------------------------------
# tests/test_notebooks.py executes the notebooks and stores them in this same
# cache, so ``make docs`` after ``make test`` does not execute them again.
nb_execution_mode = "cache"
nb_execution_cache_path = str(ROOT / "_build" / ".jupyter_cache")
nb_execution_timeout = 3600  # a hang guard, not a speed limit: a slow machine must not fail the build
nb_execution_raise_on_error = True
nb_execution_show_tb = True

# -- autodoc -----------------------------------------------------------------
autodoc_member_order = "bysource"
autodoc_typehints = "description"
napoleon_google_docstring = True
napoleon_numpy_docstring = True

# -- i18n --------------------------------------------------------------------
language = "en"
locale_dirs = ["docs/locale/"]
gettext_compact = False
gettext_uuid = False
gettext_location = False
gettext_auto_build = True

#: Languages the site is built in: code -> name of the language in itself.
LANGUAGES = {"en": "English", "es": "Español"}

# -- HTML --------------------------------------------------------------------
html_theme = "sphinx_book_theme"
html_title = project
html_css_files = ["site.css"]
html_theme_options = {
    "repository_url": REPOSITORY_URL,
    "repository_branch": REPOSITORY_BRANCH,
    "path_to_docs": "",
    "use_repository_button": True,
    "launch_buttons": {
        "colab_url": _site_tool.COLAB_URL,
        "notebook_interface": "jupyterlab",
    },
    "home_page_in_toc": True,
    # The sidebar has a search field; no second one in a top bar.
    "navbar_persistent": [],
    # Language switcher first, then the theme's own buttons.
    "article_header_end": ["language-switcher.html", "article-header-buttons.html"],
}

def _is_notebook_page(app, pagename: str) -> bool:
    return "kernelspec" in app.env.metadata.get(pagename, {})


def _add_language_links(app, pagename, templatename, context, doctree):
    """Link every page to the same page in each other language.

    Both languages are built side by side (``_build/html/<lang>/``), so the link
    climbs out of the page's own directory and out of the language directory.
    """
    current = app.config.language or "en"
    target = app.builder.get_target_uri(pagename)
    up = "../" * (target.count("/") + 1)
    context["language_links"] = [
        {
            "code": code,
            "name": name,
            "url": f"{up}{code}/{target}",
            "absolute_url": f"{DOCS_URL}{code}/{target}",
            "current": code == current,
        }
        for code, name in LANGUAGES.items()
    ]


def _set_base_url(app, config):
    """Canonical URLs (``<link rel="canonical">``) point into this language's tree."""
    if not config.html_baseurl:
        config.html_baseurl = f"{DOCS_URL}{config.language or 'en'}/"


def _add_notebook_launch_links(app, pagename, templatename, context, doctree):
    """Colab and Kaggle links on notebook pages.

    The links open the paired ``.ipynb`` (kept in sync with the MyST ``.md`` by
    ``make sync``), since neither Colab nor Kaggle reads MyST markdown.  They
    are shown both in the theme's "launch" dropdown and as badges under the
    page title.  Runs after the theme (priority 501) built its buttons.
    """
    if not _is_notebook_page(app, pagename):
        return
    # The paired, output-free .ipynb of the page, on GitHub.
    urls = _site_tool.launch_urls(REPOSITORY_URL, f"{pagename}.ipynb", REPOSITORY_BRANCH)
    colab, kaggle = urls["colab"], urls["kaggle"]
    context["notebook_launch"] = {"colab": colab, "kaggle": kaggle}

    for group in context.get("header_buttons", []):
        if group.get("label") != "launch-buttons":
            continue
        for button in group["buttons"]:
            if button.get("text") == "Colab":
                button["url"] = colab  # always the .ipynb, even if not synced
        group["buttons"].append(
            {
                "type": "link",
                "text": "Kaggle",
                "tooltip": "Kaggle",
                "icon": "fab fa-kaggle",
                "url": kaggle,
            }
        )

    badges = app.builder.templates.render("notebook-launch.html", context)
    body = context.get("body", "")
    end_of_title = body.find("</h1>")
    if end_of_title >= 0:
        end_of_title += len("</h1>")
        context["body"] = body[:end_of_title] + badges + body[end_of_title:]
    else:
        context["body"] = badges + body


#: myst-nb's labels for hidden cells (``hide-input`` and similar tags).  myst-nb has
#: no translations; docs/_templates/translatable-strings.html lists them so that
#: ``make gettext`` extracts them into sphinx.po, and this handler applies them.
NB_PROMPTS = [
    f"{verb} code cell {kind}"
    for verb in ("Show", "Hide")
    for kind in ("content", "source", "output", "outputs")
]


def _translate_notebook_prompts(app, pagename, templatename, context, doctree):
    if not _is_notebook_page(app, pagename) or "body" not in context:
        return
    body = context["body"]
    for text in NB_PROMPTS:
        translated = app.translator.gettext(text)
        if translated != text:
            body = body.replace(f'admonition-title">{text}</p>', f'admonition-title">{html.escape(translated)}</p>')
    context["body"] = body


class UntranslatableDocstrings(SphinxTransform):
    """Keep API docstrings out of the message catalogs.

    Docstrings change with the code (owned by the kernel authors) and the API
    reference is kept in English; only the prose around it is translated.
    Runs before the i18n ``Locale`` transform (priority 20).
    """

    default_priority = 15

    def apply(self, **kwargs):
        for node in self.document.findall(nodes.TextElement):
            if "docstring of " in (node.source or "") or _inside_object_description(node):
                node["translatable"] = False


def _inside_object_description(node) -> bool:
    """True for text autodoc generates for an object (signature, docstring, fields)."""
    parent = node.parent
    while parent is not None:
        if isinstance(parent, addnodes.desc):
            return True
        parent = parent.parent
    return False


# -- Math, offline -------------------------------------------------------------
# MathJax 3 is served from the site itself, not a CDN: a page opened from _build/html on a machine
# without internet still typesets its formulas (tools/site.py check-math verifies it in a browser).
# The files come from the sphinx-mathjax-offline package (MathJax 3.2.2); only the combined TeX/CHTML
# component, its fonts and the TeX extensions it may autoload are copied, not the package's 24 MB.
mathjax_path = "mathjax/tex-chtml.js"
_MATHJAX_FILES = ("tex-chtml.js", "output/chtml/fonts/woff-v2", "input/tex/extensions", "ui", "a11y")


def _mathjax_source() -> Path:
    spec = importlib.util.find_spec("sphinx-mathjax-offline")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the docs need the sphinx-mathjax-offline package (pip install -e '.[docs]')")
    return Path(list(spec.submodule_search_locations)[0]) / "static" / "mathjax"


def _copy_mathjax(app, exc):
    if exc is not None or app.builder.format != "html":
        return
    from sphinx.util.fileutil import copy_asset  # noqa: PLC0415

    src = _mathjax_source()
    for rel in _MATHJAX_FILES:
        dest = Path(app.outdir) / "_static" / "mathjax" / rel
        if (src / rel).is_dir():
            copy_asset(str(src / rel), str(dest))
        else:
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / rel, dest)


def setup(app):
    app.connect("build-finished", _copy_mathjax)
    app.connect("config-inited", _set_base_url)
    app.connect("html-page-context", _add_language_links)
    app.connect("html-page-context", _add_notebook_launch_links, priority=600)
    app.connect("html-page-context", _translate_notebook_prompts)
    app.add_transform(UntranslatableDocstrings)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
