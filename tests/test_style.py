"""The shared figure style (kernels/style.py), and a guard that no notebook figure bypasses it."""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from kernels.perf import style  # noqa: E402
from kernels.perf.style import plot_roofline  # noqa: E402

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.md"))

# Every implementation the issue names, today's and the coming peers.
NAMES = ["ours", "XLA", "JAX flash_attention", "splash", "JAX Pallas matmul", "lax.scan", "lax.associative_scan",
         "Griffin (recurrentgemma)", "plain-JAX chunked SSD", "megablox gmm", "ragged_dot", "dense capacity einsum",
         "tokamax", "MaxText", "DFT matmul (FNet)", "two-stage plain JAX", "ours (Winograd)", "plain-JAX Winograd", "roofline", "HBM floor"]


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


@pytest.mark.parametrize("name", NAMES)
def test_every_name_resolves_to_a_colour_marker_and_its_own_label(name):
    s = style.of(name)
    assert s["label"] == name
    assert re.fullmatch(r"#[0-9A-F]{6}", s["color"])
    if name not in style.REFERENCE_LINES:
        assert s["marker"]


def test_colours_and_markers_are_distinct():
    every = [style.of(n) for n in NAMES]
    assert len({s["color"] for s in every}) == len(NAMES)
    impls = [style.of(n) for n in style.IMPLEMENTATIONS]
    assert len({s["marker"] for s in impls}) == len(impls)
    assert set(style.IMPLEMENTATIONS) | set(style.REFERENCE_LINES) == set(NAMES)
    assert style.of("roofline")["color"] == "#000000"


@pytest.mark.parametrize("alias, name", [
    ("xla", "XLA"), ("XLA", "XLA"), ("pallas", "ours"), ("Ours", "ours"), ("jax_flash", "JAX flash_attention"),
    ("JAX splash", "splash"), ("jax_pallas", "JAX Pallas matmul"), ("lax scan", "lax.scan"),
    ("recurrentgemma", "Griffin (recurrentgemma)"), ("megablox", "megablox gmm"), ("copy", "HBM floor"),
])
def test_aliases_share_the_style(alias, name):
    assert style.of(alias) == style.of(name)


def test_unknown_names_raise_and_overrides_win():
    with pytest.raises(KeyError):
        style.of("some other kernel")
    assert style.of("ours", label="ours: 1024³", ls="--") == {**style.of("ours"), "label": "ours: 1024³", "ls": "--"}
    assert style.find("ours: 1024³") == "ours" and style.find("pallas 512x1024x1024") is None


def test_size_ticks_are_plain():
    assert [style.plain_size(v) for v in (128, 256, 1024, 2048, 4096, 8192, 16384, 1536, 2 ** 20)] == \
        ["128", "256", "1k", "2k", "4k", "8k", "16k", "1.5k", "1M"]
    fig, ax = plt.subplots()
    ax.plot([128, 16384], [1, 2])
    ax.set_xscale("log")
    style.plain_ticks(ax, "x")
    fig.canvas.draw()
    labels = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
    assert {"128", "256", "1k", "2k", "4k", "8k", "16k"} <= set(labels)
    assert not any(re.search(r"10\^|\\times|\$", t) for t in labels), labels
    style.plain_ticks(ax, "x", [1024, 4096])
    fig.canvas.draw()
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1k", "4k"]


def test_titles_must_say_what_they_show():
    fig, ax = plt.subplots()
    with pytest.raises(ValueError):
        style.title(ax, "speed")
    with pytest.raises(ValueError):
        style.title(ax, "speed", "TPU v5e")
    style.title(ax, "speed", style.estimate("v5e"))
    assert ax.get_title() == "speed\ncompiler estimate, TPU v5e"
    style.title(fig, "sweep", style.estimate("v5e", "v6e"), style.measured("TPU v5 lite"))
    assert fig.get_suptitle() == "sweep\ncompiler estimate, TPU v5e, v6e; measured on TPU v5 lite"
    assert style.measured().startswith("measured on ") and style.computed("exactly") == "computed exactly"


def test_one_legend_names_every_line_across_panels():
    fig, (a, b) = plt.subplots(1, 2)
    a.plot([1, 2], [1, 2], **style.of("ours"))
    b.plot([1, 2], [2, 1], **style.of("ours"))
    b.plot([1, 2], [1, 1], **style.of("xla"))
    leg = style.legend(fig)
    assert [t.get_text() for t in leg.get_texts()] == ["ours", "XLA"]
    b.plot([1, 2], [3, 3], color="green")  # a line no entry names
    with pytest.raises(ValueError):
        style.legend(fig)


def test_plot_roofline_styles_points_that_name_an_implementation():
    fig, ax = plt.subplots()
    plot_roofline(ax, "v5e", points=[("ours: 1024³", 300, 1e14), ("ours: 4096³", 1000, 1.5e14), ("XLA", 300, 9e13)])
    points = [ln for ln in ax.get_lines() if len(ln.get_xdata()) == 1]
    assert [(ln.get_color(), ln.get_marker()) for ln in points] == \
        [(style.of(n)["color"], style.of(n)["marker"]) for n in ("ours", "ours", "XLA")]
    leg = style.legend(ax)
    texts = [t.get_text() for t in leg.get_texts()]  # implementations first, each once
    assert texts[:3] == ["ours", "XLA", "v5e roofline"] and texts[3].startswith("ridge point") and len(texts) == 4
    assert {t.get_text() for t in ax.texts} == {"1024³", "4096³"}


def _code_cells(path):
    return re.findall(r"```\{code-cell\}[^\n]*\n(.*?)```", path.read_text(encoding="utf-8"), re.S)


def test_notebook_figures_go_through_the_style():
    plotting = re.compile(r"plt\.subplots|\.(plot|loglog|semilog[xy]|bar|axhline|axvline)\(|plot_roofline\(")
    n = 0
    for path in NOTEBOOKS:
        for cell in _code_cells(path):
            if plotting.search(cell):
                n += 1
                assert "style." in cell, f"{path.name}: a figure that does not use kernels.perf.style:\n{cell[:300]}"
            # titles only through style.title (which insists on estimate / measured / computed) ...
            assert not re.search(r"\.set_title\(|\.suptitle\(|\btitle=", cell), f"{path.name}: {cell[:300]}"
            # ... and no colours from matplotlib's cycle, which change from panel to panel
            assert not re.search(r"""["'](C\d|tab:\w+)["']""", cell), f"{path.name}: {cell[:300]}"
    assert n >= 10, f"only {n} plotting cells found: is the walker still reading the notebooks?"
