"""The committed results store, built from its dump in results/ (`store.json`, `runs/`, `sweeps/`;
`fedprism.experiment.archive`) once per dump: git holds the dump, not the SQLite file.

The store is built into `.fedprism-cache/committed-store/<key>/fedprism.db` (ignored by git), `<key>` the
SHA-256 of the dump's files (`archive.key`), so a changed dump builds a new store and an unchanged one is
built once, whatever the number of test sessions. The built file's own SHA-256 is kept beside it and
checked when a session first asks for it: a cached store that was written to since is built again.
Tests read it (`Store(readonly=True)`, `mode=ro`) or copy it; the `committed_db` fixture (conftest.py)
gives its path.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
DUMP = RESULTS / "store.json"
CACHE = ROOT / ".fedprism-cache" / "committed-store"
STALE_S = 7 * 86400          # builds of other dumps unused this long are removed


def _sha256(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


@functools.cache
def committed_store() -> Path | None:
    """The path of the store built from the committed dump (built now if needed), or None without a dump."""
    from fedprism.experiment import archive

    if not DUMP.is_file():
        return None
    folder = CACHE / archive.key(RESULTS)[:24]
    db, digest = folder / "fedprism.db", folder / "fedprism.db.sha256"
    if db.is_file() and digest.is_file():
        if digest.read_text().strip() == _sha256(db):
            folder.touch()
            return db
        db.unlink()                                   # written to since it was built: built again
    folder.mkdir(parents=True, exist_ok=True)
    archive.load(RESULTS, db)        # builds it, or finds it built with the same rows by another session
    tmp = digest.with_name(f"{digest.name}.{os.getpid()}")
    tmp.write_text(_sha256(db) + "\n")
    os.replace(tmp, digest)
    for other in CACHE.iterdir():
        try:
            if other != folder and time.time() - other.stat().st_mtime > STALE_S:
                shutil.rmtree(other, ignore_errors=True)
        except OSError:
            pass
    return db
