"""Matplotlib set-up shared by every figure fedprism draws (the report's and those a method's package adds
through `Algorithm.report_figures`): the off-screen backend, one font size, and PNG files without metadata,
so that a committed figure is redrawn to the same bytes by the same matplotlib."""

from __future__ import annotations

from pathlib import Path

#: smallest font on any plot (points)
FONT_PT = 9


def pyplot():
    """matplotlib.pyplot on the Agg backend, with fedprism's font sizes."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.rcParams.update({"font.size": FONT_PT, "axes.titlesize": FONT_PT + 1, "axes.labelsize": FONT_PT,
                         "xtick.labelsize": FONT_PT, "ytick.labelsize": FONT_PT, "legend.fontsize": FONT_PT})
    return plt


def save_png(fig, path: Path) -> None:
    """`fig` as a PNG at `path`: 90 dpi, no metadata, the whole figure (a legend beside the axes may be
    taller than the figure; the saved image holds all of it)."""
    fig.savefig(path, dpi=90, metadata={"Software": None}, bbox_inches="tight", pad_inches=0.1)
