"""Plain-text tables for the command line (the CLI and the demo print with these)."""

from __future__ import annotations


def fmt(v) -> str:
    """A table cell: '' for None, floats at 4 decimals, anything else as text with control characters
    escaped (`fedprism.errors.printable`: a run label cannot write a terminal escape sequence)."""
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4f}" if v == 0 or abs(v) >= 1e-3 else f"{v:.3g}"
    from fedprism.errors import printable

    return printable(v)


def table(rows: list[list], header: list[str], width: int | None = None) -> str:
    """Columns padded to their widest cell. With `width`, a last column that would run past it is wrapped
    there (at least 30 characters a line), its continuation lines indented to the column."""
    import textwrap

    cells = [header] + [[fmt(v) for v in r] for r in rows]
    w = [max(len(r[i]) for r in cells) for i in range(len(header))]
    indent = sum(w[:-1]) + 2 * (len(w) - 1)
    room = None if width is None or indent + w[-1] <= width else max(width - indent, 30)
    if room is not None:
        w[-1] = min(w[-1], room)

    def line(r):
        head = "  ".join(c.ljust(w[i]) for i, c in enumerate(r[:-1]))
        last = textwrap.wrap(r[-1], room, break_on_hyphens=False) if room is not None and len(r[-1]) > room else [r[-1]]
        out = [(head + "  " + last[0]) if r[:-1] else last[0]] + [" " * indent + x for x in last[1:]]
        return "\n".join(x.rstrip() for x in out)

    return "\n".join([line(cells[0]), "  ".join("-" * x for x in w)] + [line(r) for r in cells[1:]])


def size_text(b: float) -> str:
    """Bytes as GB (2^30) from 1 GB up, else as MB (2^20), one decimal: '4.6 GB', '0.2 MB'."""
    return f"{b / 2**30:.1f} GB" if b >= 2**30 else f"{b / 2**20:.1f} MB"


def md_cell(text: object) -> str:
    """Text for a markdown table cell: a `|` in a run label (e.g. "FedAvg | S 0.03") escaped, so that it
    does not split the cell (the HTML page reads it back as a `|`)."""
    return str(text).replace("|", "\\|")


def mean_pm(vals, scale: float = 100.0, fmt: str = ".2f") -> str:
    """'mean ± std' of the values that are not None, times `scale` (± is the sample std over seeds, ddof=1;
    one value: the value alone; none: '-')."""
    import numpy as np

    v = [x for x in vals if x is not None]
    if not v:
        return "-"
    a = np.asarray(v, dtype=float) * scale
    return f"{a.mean():{fmt}} ± {a.std(ddof=1):{fmt}}" if len(a) > 1 else f"{a.mean():{fmt}}"
