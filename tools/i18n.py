"""Translation workflow of the site (Spanish: ``docs/locale/es/LC_MESSAGES``).

    python tools/i18n.py update   # extract messages, merge them into the .po files
    python tools/i18n.py check    # fail on untranslated, fuzzy or stale entries

``update`` runs Sphinx's gettext builder (without executing notebooks: only the
text of pages and of notebook Markdown cells is translatable, never code or
outputs) into ``_build/gettext``, then merges the ``.pot`` files into one ``.po``
file per page with sphinx-intl (``docs/locale/es/LC_MESSAGES/<docname>.po``, plus
``sphinx.po`` for the strings of ``docs/_templates``). Obsolete ``#~`` entries and
the ``.po`` files of pages that no longer exist are removed. A message whose
English text changed comes back *fuzzy*, with the old translation, for review.

``check`` regenerates the ``.pot`` files in a temporary directory and fails
(listing file and msgid) if a ``.po`` file is missing, has a msgid the sources no
longer have or lacks one they have (stale), has an untranslated, fuzzy or obsolete
entry, or if a translation dropped or altered MyST markup that must survive
translation verbatim: inline code, role names and targets, link URLs and math.
It also rejects a translation that Markdown would read as a list, heading or
quote (``1. Foo``): Sphinx would silently keep the English text.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCALE_DIR = ROOT / "docs" / "locale"
POT_DIR = ROOT / "_build" / "gettext"
LANGUAGES = ("es",)
LINE_WIDTH = 76


# --- extraction ---------------------------------------------------------------------


def build_pot(outdir: Path, doctreedir: Path | None = None) -> Path:
    """Runs the gettext builder on the site into ``outdir`` (old ``.pot`` files removed)."""
    outdir = Path(outdir)
    for old in outdir.rglob("*.pot") if outdir.exists() else ():
        old.unlink()
    cmd = [sys.executable, "-m", "sphinx", "-b", "gettext", "-q",
           "-D", "nb_execution_mode=off",
           "-d", str(doctreedir or outdir / ".doctrees"),
           str(ROOT), str(outdir)]
    result = subprocess.run(cmd, cwd=ROOT)
    if result.returncode != 0:
        raise SystemExit(f"error: the gettext build failed: {' '.join(cmd)}")
    return outdir


def pot_files(pot_dir: Path) -> dict[str, Path]:
    """``{"docs/methodology": path/to/docs/methodology.pot, ...}``."""
    pot_dir = Path(pot_dir)
    return {p.relative_to(pot_dir).with_suffix("").as_posix(): p
            for p in sorted(pot_dir.rglob("*.pot")) if ".doctrees" not in p.parts}


def po_files(locale_dir: Path, language: str) -> dict[str, Path]:
    base = Path(locale_dir) / language / "LC_MESSAGES"
    return {p.relative_to(base).with_suffix("").as_posix(): p for p in sorted(base.rglob("*.po"))}


def read_catalog(path: Path):
    from babel.messages.pofile import read_po

    with open(path, "rb") as f:
        return read_po(f, abort_invalid=True)


def write_catalog(path: Path, catalog) -> None:
    from sphinx_intl.catalog import dump_po

    dump_po(str(path), catalog, width=LINE_WIDTH, ignore_obsolete=True)


# --- update -------------------------------------------------------------------------


def update(pot_dir: Path = POT_DIR, locale_dir: Path = LOCALE_DIR, languages=LANGUAGES) -> None:
    """Merges the ``.pot`` files of ``pot_dir`` into the ``.po`` files of ``locale_dir``."""
    from sphinx_intl.basic import update as intl_update

    intl_update(str(locale_dir), str(pot_dir), tuple(languages), line_width=LINE_WIDTH, ignore_obsolete=True)
    pots = pot_files(pot_dir)
    for language in languages:
        for name, po in po_files(locale_dir, language).items():
            if name not in pots:
                po.unlink()
                po.with_suffix(".mo").unlink(missing_ok=True)
                print(f"Removed: {po} (no such page any more)")
                continue
            catalog = read_catalog(po)
            if catalog.obsolete:
                catalog.obsolete.clear()
                write_catalog(po, catalog)
                print(f"Dropped obsolete entries: {po}")


# --- check --------------------------------------------------------------------------

_ROLE = re.compile(r"\{(?P<name>[\w:.+-]+)\}(?P<ticks>`+)(?P<body>.+?)(?P=ticks)", re.S)
_CODE = re.compile(r"(?P<ticks>`+)(?P<body>.+?)(?P=ticks)", re.S)
_LINK_URL = re.compile(r"\]\((?P<url>[^)\s]+)\)")
_MATH = re.compile(r"(?<![\\$])\$(?!\s)(?P<body>[^$\n]+?)(?<!\s)\$(?!\d)")
_BLOCK_START = re.compile(r"\s{0,3}(\d{1,9}[.)]|[-*+]|#{1,6}|>)(\s|$)")
_EXPLICIT_TARGET = re.compile(r"<(?P<target>[^<>]+)>\s*$")


def protected_markup(text: str) -> collections.Counter:
    """The pieces of a MyST message that a translation must keep verbatim."""
    found: collections.Counter = collections.Counter()
    rest = []
    last = 0
    for m in _ROLE.finditer(text):
        rest.append(text[last:m.start()])
        last = m.end()
        body = m.group("body")
        target = _EXPLICIT_TARGET.search(body)
        if target and m.group("name") not in ("math", "code"):
            found[f"{{{m.group('name')}}}`... <{target.group('target')}>`"] += 1
        else:
            found[f"{{{m.group('name')}}}`{body}`"] += 1
    rest.append(text[last:])
    plain = "".join(rest)
    no_code = []
    last = 0
    for m in _CODE.finditer(plain):
        no_code.append(plain[last:m.start()])
        last = m.end()
        found[m.group(0)] += 1
    no_code.append(plain[last:])
    plain = "".join(no_code)
    for m in _LINK_URL.finditer(plain):
        found[f"({m.group('url')})"] += 1
    for m in _MATH.finditer(plain):
        found[m.group(0)] += 1
    return found


def _short(msgid: str, width: int = 100) -> str:
    text = " ".join(str(msgid).split())
    return repr(text if len(text) <= width else text[: width - 3] + "...")


def catalog_problems(pot_dir: Path, locale_dir: Path = LOCALE_DIR, languages=LANGUAGES) -> list[str]:
    """Every reason the translations are not complete and current, one line each."""
    problems = []
    pots = pot_files(pot_dir)
    for language in languages:
        pos = po_files(locale_dir, language)
        base = Path(locale_dir) / language / "LC_MESSAGES"
        for name in sorted(set(pots) | set(pos)):
            shown = _rel(base / f"{name}.po")
            if name not in pos:
                problems.append(f"{shown}: missing (run `make gettext`)")
                continue
            if name not in pots:
                problems.append(f"{shown}: stale: there is no page {name!r} any more (run `make gettext`)")
                continue
            template = read_catalog(pots[name])
            catalog = read_catalog(pos[name])
            wanted = {(m.context, m.id) for m in template if m.id}
            have = {(m.context, m.id) for m in catalog if m.id}
            for context, msgid in sorted(wanted - have, key=str):
                problems.append(f"{shown}: stale: msgid missing from the .po (run `make gettext`): {_short(msgid)}")
            for context, msgid in sorted(have - wanted, key=str):
                problems.append(f"{shown}: stale: msgid no longer in the sources (run `make gettext`): {_short(msgid)}")
            for message in catalog:
                if not message.id:
                    continue
                strings = message.string if isinstance(message.string, (list, tuple)) else [message.string]
                if message.fuzzy:
                    problems.append(f"{shown}: fuzzy: {_short(message.id)}")
                elif not all(strings):
                    problems.append(f"{shown}: untranslated: {_short(message.id)}")
                elif isinstance(message.id, str) and _BLOCK_START.match(strings[0]):
                    # Sphinx parses each msgstr on its own: "1. Foo" becomes a list, the
                    # node type no longer matches and the English text is kept silently.
                    problems.append(f"{shown}: translation starts like a Markdown list, heading or quote; "
                                    f"escape it (e.g. `1\\.`): {_short(message.id)}")
                elif isinstance(message.id, str):
                    lost = protected_markup(message.id) - protected_markup(strings[0])
                    added = protected_markup(strings[0]) - protected_markup(message.id)
                    if lost or added:
                        detail = "; ".join([f"lost {k}" for k in sorted(lost)] + [f"added {k}" for k in sorted(added)])
                        problems.append(f"{shown}: markup changed ({detail}): {_short(message.id)}")
            for message in catalog.obsolete.values():
                problems.append(f"{shown}: obsolete entry (run `make gettext`): {_short(message.id)}")
    return problems


def _rel(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


# --- command line -------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/i18n.py", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("update", help="extract messages and merge them into docs/locale/<lang>/LC_MESSAGES")
    p.add_argument("--pot-dir", type=Path, default=POT_DIR)
    p = sub.add_parser("check", help="fail on untranslated, fuzzy or stale .po entries")
    p.add_argument("--pot-dir", type=Path, default=None,
                   help="compare with these .pot files instead of regenerating them")
    args = parser.parse_args(argv)

    if args.command == "update":
        build_pot(args.pot_dir, ROOT / "_build" / "doctrees" / "gettext")
        update(args.pot_dir)
        print(f"Translate the entries of {_rel(LOCALE_DIR)}/<lang>/LC_MESSAGES/*.po, then run `make translations-check`.")
        return 0

    if args.pot_dir is not None:
        problems = catalog_problems(args.pot_dir)
    else:
        with tempfile.TemporaryDirectory(prefix="pallas-gettext-") as tmp:
            problems = catalog_problems(build_pot(Path(tmp) / "pot", Path(tmp) / "doctrees"))
    for line in problems:
        print(f"error: {line}", file=sys.stderr)
    if problems:
        print(f"{len(problems)} translation problem(s).", file=sys.stderr)
        return 1
    counts = {lang: len(po_files(LOCALE_DIR, lang)) for lang in LANGUAGES}
    print("translations complete and current: " + ", ".join(f"{n} {lang} catalog(s)" for lang, n in counts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
