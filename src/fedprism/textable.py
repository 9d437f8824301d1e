"""Plain-text tables for the command line (the CLI and the demo print with these)."""

from __future__ import annotations


def fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4f}" if v == 0 or abs(v) >= 1e-3 else f"{v:.3g}"
    return str(v)


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
