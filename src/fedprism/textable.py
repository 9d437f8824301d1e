"""Plain-text tables for the command line (the CLI and the demo print with these)."""

from __future__ import annotations


def fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4f}" if v == 0 or abs(v) >= 1e-3 else f"{v:.3g}"
    return str(v)


def table(rows: list[list], header: list[str]) -> str:
    cells = [header] + [[fmt(v) for v in r] for r in rows]
    w = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: "  ".join(c.ljust(w[i]) for i, c in enumerate(r))  # noqa: E731
    return "\n".join([line(cells[0]), "  ".join("-" * x for x in w)] + [line(r) for r in cells[1:]])
