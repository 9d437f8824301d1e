"""MkDocs hook for fedprism's documentation site (`mkdocs.yml`).

The guides in `docs/` link to files of the repository outside `docs/` (sources, sweeps, results). MkDocs
cannot publish those, so this hook rewrites each such link to the repository path as code text and
warns about any relative link whose target does not exist; under `strict: true` that warning fails the
build, so a moved or renamed file breaks the site build (and the test that runs it).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

log = logging.getLogger("mkdocs.plugins.fedprism")
LINK = re.compile(r"(?<!!)\[([^\]]+)\]\(([^)\s]+)\)")


def on_page_markdown(markdown: str, page, config, files) -> str:
    docs = Path(config["docs_dir"]).resolve()
    repo = docs.parent
    here = (docs / page.file.src_path).parent

    def fix(m: re.Match) -> str:
        text, target = m.group(1), m.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            return m.group(0)                                  # a URL or an anchor: MkDocs checks anchors
        path = target.split("#", 1)[0]
        resolved = (here / path).resolve()
        if resolved.is_relative_to(docs):
            return m.group(0)                                  # inside docs/: MkDocs validates it
        if not resolved.is_relative_to(repo) or not resolved.exists():
            log.warning("%s links to %s, which is not a file of the repository", page.file.src_path, target)
            return m.group(0)
        rel = resolved.relative_to(repo).as_posix()
        return text if text.strip("`") == rel else f"{text} (`{rel}`)"

    return LINK.sub(fix, markdown)
