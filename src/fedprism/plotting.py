"""Matplotlib set-up shared by every figure fedprism draws (the report's and those a method's package adds
through `Algorithm.report_figures`): the off-screen backend, one font size, and each figure written twice,
as PNG (shown in results.md and embedded in report.html) and as PDF beside it (vector, for a paper), both
without metadata that changes between runs (`save`), so that a committed figure is redrawn to the same
bytes by the same matplotlib."""

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


#: the PDF metadata matplotlib would fill with its version and the current time: left out
PDF_METADATA = {"Creator": None, "Producer": None, "CreationDate": None}


def save(fig, path: Path) -> list[Path]:
    """`fig` as a PNG at `path` (`save_png`) and as a PDF beside it (the same name, `.pdf`; no creation date,
    creator or producer, so the same figure gives the same bytes). Returns both paths, PNG first."""
    path = Path(path)
    save_png(fig, path)
    pdf = path.with_suffix(".pdf")
    fig.savefig(pdf, metadata=PDF_METADATA, bbox_inches="tight", pad_inches=0.1)
    return [path, pdf]
