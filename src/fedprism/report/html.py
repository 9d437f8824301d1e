"""report.html: the markdown report as one self-contained page (`fedprism report --html`).

Tables, headings and captions come from results.md (the subset of markdown the report writes:
headings, pipe tables, images, emphasis, code spans, paragraphs); plots are embedded as base64 PNG
data URIs; a section explains each method that appears. No script, font, style sheet or image is
fetched from anywhere: the file can be mailed or opened offline.
"""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path

CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 2em auto; max-width: 1200px;
       padding: 0 1em; color: #222; line-height: 1.45; }
h1 { border-bottom: 2px solid #444; } h2 { border-bottom: 1px solid #bbb; margin-top: 2em; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: right; }
th:first-child, td:first-child, td.t { text-align: left; }
thead th { background: #eef; } tbody tr:nth-child(even) { background: #f7f7f7; }
figure { margin: 1em 0; } figure img { max-width: 100%; border: 1px solid #ddd; }
figcaption { font-size: 0.9em; color: #444; }
code { background: #f2f2f2; padding: 0 3px; }
dt { font-weight: bold; margin-top: 0.6em; }
"""

_IMG = re.compile(r"^!\[(?P<alt>.*)\]\((?P<src>[^)]+)\)$")       # the caption may hold brackets (a label's)


def _inline(text: str) -> str:
    t = html.escape(text, quote=False)
    t = re.sub(r"`([^`]+)`", r"<code>\1</code>", t)
    t = re.sub(r"\*\*([^*]+)\*\*", r"<strong>\1</strong>", t)
    t = re.sub(r"(?<![*\w])\*([^*]+)\*(?![*\w])", r"<em>\1</em>", t)
    return t


def _numeric(cell: str) -> bool:
    return bool(re.match(r"^\**[-+]?\d", cell)) or cell in ("-", "")


def _cells(line: str) -> list[str]:
    cells = re.split(r"(?<!\\)\|", line.strip().strip("|"))     # `\|` is a pipe inside a cell (a label)
    return [c.strip().replace("\\|", "|") for c in cells]


def _data_uri(path: Path) -> str | None:
    if not path.is_file():
        return None
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode("ascii")


def md_to_html(md: str, base: Path) -> str:
    """The report's markdown as HTML; images under `base` embedded, captions as <figcaption>."""
    lines = md.splitlines()
    out: list[str] = []
    para: list[str] = []
    i = 0

    def flush() -> None:
        if para:
            out.append(f"<p>{_inline(' '.join(para))}</p>")
            para.clear()

    while i < len(lines):
        line = lines[i]
        m = _IMG.match(line.strip())
        if line.startswith("#"):
            flush()
            level = len(line) - len(line.lstrip("#"))
            out.append(f"<h{level}>{_inline(line[level:].strip())}</h{level}>")
        elif line.startswith("|") and i + 1 < len(lines) and set(lines[i + 1].replace("|", "").strip()) <= {"-", ":"}:
            flush()
            head = _cells(line)
            out.append("<table><thead><tr>" + "".join(f"<th>{_inline(c)}</th>" for c in head) + "</tr></thead><tbody>")
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                out.append("<tr>" + "".join(("<td>" if _numeric(c) else '<td class="t">') + _inline(c) + "</td>"
                                            for c in _cells(lines[i])) + "</tr>")
                i += 1
            out.append("</tbody></table>")
            continue
        elif m:
            flush()
            uri = _data_uri(base / m["src"])
            cap = ""
            # the report writes the caption as the next non-empty line, in italics
            j = i + 1
            while j < len(lines) and not lines[j].strip():
                j += 1
            if j < len(lines) and lines[j].startswith("*") and lines[j].endswith("*") and not lines[j].startswith("**"):
                cap, i = lines[j][1:-1], j
            if uri is not None:
                out.append(f'<figure><img src="{uri}" alt="{html.escape(m["alt"])}">'
                           f"<figcaption>{_inline(cap or m['alt'])}</figcaption></figure>")
        elif not line.strip():
            flush()
        else:
            para.append(line.strip())
        i += 1
    flush()
    return "\n".join(out)


def method_notes(methods: list[str]) -> str:
    """A definition list: each method's name, paper and the first paragraph of its docstring."""
    from fedprism.algorithms import REGISTRY

    items = []
    for name in methods:
        cls = REGISTRY.find(name)
        if cls is None:
            continue
        doc = (cls.__doc__ or "").strip().split("\n\n")[0]
        doc = " ".join(doc.split())
        paper = getattr(cls, "paper", "") or ""
        items.append(f"<dt><code>{html.escape(name)}</code>{' — ' + html.escape(paper) if paper else ''}</dt>"
                     f"<dd>{_inline(doc)}</dd>")
    if not items:
        return ""
    return "<h2>Methods in this report</h2>\n<dl>\n" + "\n".join(items) + "\n</dl>"


def render_html(md: str, base: Path, methods: list[str], extra: str = "") -> str:
    """The page: the report's markdown, then `extra` (HTML: the leaderboard's section with `fedprism report
    --html --leaderboard`), then the notes on the methods."""
    body = md_to_html(md, base) + ("\n" + extra if extra else "")
    notes = method_notes(methods)
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>fedprism results</title><style>{CSS}</style></head>\n<body>\n{body}\n{notes}\n</body></html>\n")
