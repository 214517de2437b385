"""One look for every figure on the site, so that a reader learns it once.

Why: the notebooks compare the same implementations again and again. Left to
matplotlib's colour cycle, "ours" is blue in one panel and red in the next, and lines
appear that no legend names. Here each implementation has one colour and one marker in
every panel of every notebook, size axes read 1k, 2k, 4k (never 2x10^3), and every
title says what its numbers are: a compiler estimate for a TPU generation, a
measurement on a named device, or something computed exactly.

Colours: Okabe-Ito's (safe for the common colour-vision deficiencies) for ours, XLA and
the attention peers, Paul Tol's muted scheme for the rest, chosen so that the kernels
that share a notebook (attention; matmul; scans; mixture-of-experts) are far apart.
Twelve colours cannot all be told apart by every reader, so each implementation also
has its own marker: no two differ by colour alone. Black is the roofline, grey the HBM
floor; :func:`other` gives greys with hollow markers to things that are not
implementations (algorithms, chips, hardware units).
"""
from __future__ import annotations

import re

import numpy as np

from kernels.base.hardware import get_chip

# name: (colour, marker, aliases). The name is also the legend label.
_STYLES = {
    "ours": ("#0072B2", "o", ("pallas", "kernels", "our kernel", "this package")),
    "XLA": ("#E69F00", "s", ("jnp", "xla reference", "reference", "jnp.fft", "jnp fft", "xla fft")),
    "JAX flash_attention": ("#009E73", "^", ("jax flash", "jax fa", "flash attention jax")),
    "splash": ("#CC79A7", "D", ("jax splash", "splash attention")),
    "JAX Pallas matmul": ("#882255", "v", ("jax pallas", "pallas guide matmul", "guide matmul")),
    "lax.scan": ("#56B4E9", "<", ("scan",)),
    "lax.associative_scan": ("#AA4499", ">", ("associative scan",)),
    "Griffin (recurrentgemma)": ("#999933", "P", ("griffin", "recurrentgemma")),
    "plain-JAX chunked SSD": ("#117733", "X", ("chunked ssd", "ssd")),
    "megablox gmm": ("#CC6677", "h", ("megablox", "gmm")),
    "ragged_dot": ("#332288", "p", ("lax ragged dot",)),
    "dense capacity einsum": ("#44AA99", "d", ("capacity einsum", "dense einsum")),
    "tokamax": ("#DDCC77", "*", ("tokamax layer_norm",)),
    "MaxText": ("#EE3377", "x", ("maxtext rope",)),
    "DFT matmul (FNet)": ("#D55E00", "8", ("dft matmul", "fnet", "dense dft")),
    "two-stage plain JAX": ("#88CCEE", "H", ("two stage jax", "plain jax two stage", "four step jax")),
    "ours (Winograd)": ("#661100", "$W$", ("our winograd", "winograd kernel")),
    "plain-JAX Winograd": ("#6699CC", "$w$", ("jax winograd", "plain jax winograd")),
    "roofline": ("#000000", None, ()),
    "HBM floor": ("#777777", None, ("copy", "hbm copy")),
}
REFERENCE_LINES = ("roofline", "HBM floor")
IMPLEMENTATIONS = tuple(n for n in _STYLES if n not in REFERENCE_LINES)


_key = lambda name: re.sub(r"[\s._\-]+", " ", name.lower()).strip()
_ALIASES = {_key(a): n for n, (_, _, aliases) in _STYLES.items() for a in (n, *aliases)}


def find(label: str) -> str | None:
    """The implementation a label names (all of it, or its start up to ':', ',' or '('), else None."""
    return _ALIASES.get(_key(label)) or _ALIASES.get(_key(re.split(r"[:,(]", label)[0]))


def of(name: str, **overrides) -> dict:
    """``dict(color, marker, label)`` for ``ax.plot(x, y, **of("xla"))``; keywords override; KeyError if unknown."""
    canonical = _ALIASES.get(_key(name))
    if canonical is None:
        raise KeyError(f"no figure style for {name!r}; known: {', '.join(_STYLES)}")
    color, marker, _ = _STYLES[canonical]
    dashes = dict(ls="--") if canonical == "HBM floor" else {}
    return {**dict(color=color, marker=marker, label=canonical), **dashes, **overrides}


_GREYS, _LINES, _HOLLOW = ("#222222", "#666666", "#AAAAAA"), ("-", "--", ":", "-."), ("o", "s", "^", "D")


def other(i: int, label: str, **overrides) -> dict:
    """The i-th style for a series that is not an implementation: grey, its own dash, hollow marker."""
    return dict(color=_GREYS[i % 3], ls=_LINES[i % 4], marker=_HOLLOW[i % 4], mfc="white", label=label) | overrides


def plain_size(v: float) -> str:
    """128 -> '128', 1024 -> '1k', 16384 -> '16k', 1536 -> '1.5k', 2**20 -> '1M'."""
    for unit, suffix in ((2 ** 20, "M"), (2 ** 10, "k")):
        if v >= unit and (2 * v / unit).is_integer():
            return f"{v / unit:g}{suffix}"
    return f"{v:g}"


def plain_ticks(ax, axis: str = "x", ticks=None) -> None:
    """Size ticks as 128, 1k, 2k, 16k: at ``ticks`` if given, else at powers of two on a log axis."""
    from matplotlib import ticker
    for a in ((ax.xaxis, ax.yaxis) if axis == "both" else (getattr(ax, f"{axis}axis"),)):
        if ticks is not None:
            a.set_major_locator(ticker.FixedLocator(list(ticks)))
        elif a.get_scale() == "log":
            a.set_major_locator(ticker.LogLocator(base=2))
        a.set_major_formatter(ticker.FuncFormatter(lambda v, _: plain_size(v)))
        a.set_minor_locator(ticker.NullLocator())


def estimate(*generations: str, what: str = "estimate") -> str:
    """'compiler estimate, TPU v5e' (or 'compiler memory analysis, TPU v5e, v6e')."""
    return f"compiler {what}, TPU {', '.join(generations)}"


def measured(device: str | None = None) -> str:
    """'measured on <device>'; by default the device this process computes on ('CPU', 'TPU v5 lite')."""
    if device is None:
        import jax
        d = jax.devices()[0]
        device = "CPU" if d.platform == "cpu" else d.device_kind
    return f"measured on {device}"


def comm_model(*generations: str) -> str:
    """'communication model, TPU v5e': ICI transfer times from published figures (:mod:`kernels.perf.ici`)."""
    return f"communication model, TPU {', '.join(generations)}"


def computed(how: str) -> str:
    """For exact numbers that are neither estimated nor measured: 'computed <how>'."""
    return f"computed {how}"


_SOURCE = re.compile(r"compiler [a-z ]+, TPU v\d|communication model, TPU v\d|measured on \S|computed \S")


def title(ax_or_fig, text: str, *sources: str, **kw) -> None:
    """A title (suptitle on a Figure) ending with its sources: :func:`estimate`, :func:`comm_model`, :func:`measured`, :func:`computed`."""
    if not sources or not all(_SOURCE.search(s) for s in sources):
        raise ValueError(f"title {text!r} must say what it shows (estimate/measured/computed): {sources}")
    full = "\n".join(filter(None, [text, "; ".join(sources)]))
    kw.setdefault("fontsize", 10)
    (ax_or_fig.suptitle if hasattr(ax_or_fig, "suptitle") else ax_or_fig.set_title)(full, **kw)


def legend(ax_or_fig, on=None, **kw):
    """One legend for an axes or a whole figure (drawn on axes ``on`` if given), one entry per
    label; raises ValueError if a line is drawn that no entry names (by colour, marker, dashes)."""
    from matplotlib.colors import to_hex
    axes = ax_or_fig.axes if hasattr(ax_or_fig, "suptitle") else [ax_or_fig]
    lines = [ln for ax in axes for ln in ax.get_lines()]
    look = lambda ln: (to_hex(ln.get_color()), ln.get_marker(), ln.get_linestyle())
    named = {look(ln) for ln in lines if not ln.get_label().startswith("_")}
    unnamed = [look(ln) for ln in lines if look(ln) not in named]
    if unnamed:
        raise ValueError(f"lines without a legend entry (colour, marker, dashes): {unnamed}")
    entries = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    rank = list(_STYLES)  # implementations in one order everywhere (ours first), the rest as drawn
    entries = dict(sorted(entries.items(), key=lambda e: rank.index(find(e[0])) if find(e[0]) else len(rank)))
    kw.setdefault("frameon", False)
    kw.setdefault("fontsize", 8)
    return (ax_or_fig if on is None else on).legend(list(entries.values()), list(entries), **kw)


def plot_roofline(ax, chip="v5e", points=(), dtype="bfloat16", intensity_range=(0.1, 1e4)):
  """Draws the roofline of ``chip`` on a matplotlib ``ax``.

  ``points`` is an iterable of ``(label, intensity, flops_per_second)``; each is drawn
  as a marker, so a kernel's achieved (or estimated) rate sits under the roof. A label
  that names an implementation (``"ours"``, or ``"ours: 1024³"``; see
  :func:`find`) takes that implementation's colour and marker from
  this module, appears once in the legend, and the text after ``':'`` is
  written beside the point.
  """
  c = get_chip(chip)
  peak = c.peak(dtype)
  x = np.logspace(np.log10(intensity_range[0]), np.log10(intensity_range[1]), 256)
  ax.loglog(x, np.minimum(peak, x * c.hbm_bandwidth) / 1e12, lw=1.5,
            **of("roofline", label=f"{c.name} roofline"))
  ridge = peak / c.hbm_bandwidth
  ax.axvline(ridge, color="gray", ls=":", lw=1, label=f"ridge point ({ridge:.0f} FLOP/B)")
  named = set()
  for label, intensity, rate in points:
    impl = find(label)
    if impl is None:
      ax.loglog([intensity], [rate / 1e12], "o", label=label)
      continue
    ax.loglog([intensity], [rate / 1e12], ls="none", **of(impl, label=("_" if impl in named else "") + impl))
    named.add(impl)
    note = label.split(":", 1)[1].strip() if ":" in label else ""
    if note:
      ax.annotate(note, (intensity, rate / 1e12), xytext=(0, -6), textcoords="offset points", fontsize=7,
                  rotation=90, ha="center", va="top")
  ax.set_xlabel("arithmetic intensity (FLOP/byte)")
  ax.set_ylabel("TFLOP/s")
  ax.grid(True, which="both", alpha=0.3)
  return ax
