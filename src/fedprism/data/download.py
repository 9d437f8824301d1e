"""Explicit dataset downloads from the official mirrors, checksum-verified and atomic.

This is the only module of fedprism that touches the network, and only when the user asks for it
(`fedprism data download <name>` or `load_dataset(..., download=True)`).

Each file is streamed to a temporary ``<name>.<random>.part`` file in the destination folder while its
SHA-256 and MD5 are computed; only when every known checksum matches is it renamed (atomically) to its
final name. A mismatch deletes the partial file and raises :class:`DataError`, so the destination never
holds a file that failed verification (nor the folder, when the failed attempt created it). A ``.part``
file left by a killed process (SIGKILL) and untouched for ``STALE_PART_S`` is removed by the next fetch
of that file; ``fedprism data download`` turns SIGTERM into the clean exit of Ctrl-C.

Checksum policy, one of three per file (a :class:`RemoteFile` must declare one; a file with no checksum
and no trust-on-first-use declaration is refused when it is defined). Which files a dataset has, with
their checksums and mirrors, is declared by the dataset itself (``DatasetSpec.files.remote`` in its
module of :mod:`fedprism.data.sets`); this module holds no per-dataset table.

* **pinned SHA-256 and MD5**: the MD5 values are the ones the dataset authors and torchvision publish;
  the SHA-256 values are published ones, cross-checked against each other. Both are verified.
* **pinned MD5 only**, where only an MD5 is published: it is verified at download and at every load;
  MD5 catches corrupt and truncated files but is no defence against a deliberately crafted substitute.
* **trust on first use**, where no checksum is published: the first download records the file's size,
  SHA-256 and MD5 in ``<file>.tofu.json`` next to it; every later download and every load is checked
  against that record (``fedprism.data.integrity``). The first copy itself is trusted unverified; delete
  both files to start over.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from fedprism.errors import ConfigError, DataError
from fedprism.machine import cache_root

__all__ = ["RemoteFile", "REMOTE", "mirrored", "remote_files", "cache_root", "download_dir", "download", "fetch",
           "file_digests", "tofu_record_path", "read_tofu_record"]

Opener = Callable[..., IO[bytes]]
"""``opener(url, timeout=...)`` returning a readable binary stream usable in a ``with`` statement
(default: ``urllib.request.urlopen`` with a User-Agent header)."""

_CHUNK = 1 << 20
#: a `.part` file of this file untouched for this long is a killed download's: removed at the next fetch
STALE_PART_S = 600.0
_USER_AGENT = "fedprism-dataset-download/1 (+urllib)"


@dataclass(frozen=True)
class RemoteFile:
    """One file to download: its local name, the mirrors to try in order, and how it is verified.

    ``sha256`` / ``md5``: published checksums (every one given is verified). ``tofu=True`` declares that
    none is published: the first download is recorded and later ones must match the record. A file
    must have a checksum or ``tofu=True``, never both, never neither.
    """

    filename: str
    urls: tuple[str, ...]
    sha256: str | None = None
    md5: str | None = None
    tofu: bool = False

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError(f"RemoteFile {self.filename!r} needs at least one URL")
        if Path(self.filename).name != self.filename or self.filename in ("", ".", ".."):
            raise ValueError(f"RemoteFile filename must be a plain file name, got {self.filename!r}")
        for algo, length in (("sha256", 64), ("md5", 32)):
            value = getattr(self, algo)
            if value is not None and (len(value) != length or any(c not in "0123456789abcdefABCDEF"
                                                                  for c in value)):
                raise ValueError(f"RemoteFile {self.filename!r}: {algo} must be {length} hex digits, "
                                 f"got {value!r}")
        pinned = self.sha256 is not None or self.md5 is not None
        if pinned == bool(self.tofu):
            raise ValueError(f"RemoteFile {self.filename!r} needs a published checksum (sha256 and/or md5) "
                             "or tofu=True when none is published, not both and not neither")


def mirrored(filename: str, bases: Sequence[str], sha256: str | None, md5: str | None) -> RemoteFile:
    """The file `filename` at each mirror of `bases` (folder URLs ending in '/'), with its checksums."""
    return RemoteFile(filename, tuple(b + filename for b in bases), sha256=sha256, md5=md5)


def remote_files() -> dict[str, tuple[RemoteFile, ...]]:
    """Dataset name -> its official files, for every registered dataset that can be downloaded (read from
    the datasets' specs, so a dataset module or plugin that declares files is downloadable)."""
    from fedprism.data.base import DATASETS

    return {name: spec.files.remote for name, spec in DATASETS.all().items() if spec.downloadable}


def __getattr__(name: str):
    if name == "REMOTE":                # the table this module held before datasets declared their files
        return remote_files()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def download_dir(name: str) -> Path:
    """Where :func:`download` puts a dataset by default: ``<cache_root()>/data/<name>``."""
    return cache_root() / "data" / name


def file_digests(path: str | Path) -> dict[str, str]:
    """SHA-256 and MD5 (hex) of a local file, read in chunks."""
    sha, md5 = hashlib.sha256(), hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            sha.update(chunk)
            md5.update(chunk)
    return {"sha256": sha.hexdigest(), "md5": md5.hexdigest()}


def _mismatch(remote: RemoteFile, digests: dict[str, str]) -> str | None:
    """Describe the first published checksum that does not match, or None when all of them match.

    Only the checksums given are compared: a file with an MD5 alone is checked by its MD5 alone. A file
    with none (``tofu=True``) is checked against its first-use record by :func:`fetch` instead.
    """
    for algo in ("sha256", "md5"):
        expected = getattr(remote, algo)
        if expected is not None and digests[algo] != expected.lower():
            return f"{algo.upper()} mismatch: expected {expected.lower()}, got {digests[algo]}"
    return None


# ----------------------------------------------------------------------------- trust on first use

_TOFU_SUFFIX = ".tofu.json"


def tofu_record_path(path: str | Path) -> Path:
    """Where the trust-on-first-use record of a downloaded file lives: ``<file>.tofu.json`` beside it."""
    path = Path(path)
    return path.with_name(path.name + _TOFU_SUFFIX)


def read_tofu_record(path: str | Path) -> dict | None:
    """The first-use record of file ``path`` ({file, size, sha256, md5, url, recorded}), or None when
    there is none. A record that cannot be read or lacks a field is a :class:`DataError` naming it."""
    rec_path = tofu_record_path(path)
    if not rec_path.is_file():
        return None
    try:
        rec = json.loads(rec_path.read_text(encoding="utf-8"))
        ok = (isinstance(rec, dict) and rec.get("file") == Path(path).name
              and isinstance(rec.get("size"), int) and not isinstance(rec.get("size"), bool)
              and isinstance(rec.get("sha256"), str) and len(rec["sha256"]) == 64
              and int(rec["sha256"], 16) >= 0)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, ValueError) as e:
        raise DataError(f"{rec_path}: cannot read the trust-on-first-use record ({type(e).__name__}: {e}); "
                        f"delete it and {Path(path).name}, then download again") from None
    if not ok:
        raise DataError(f"{rec_path}: not a trust-on-first-use record of {Path(path).name} (needs 'file', "
                        f"an integer 'size' and a 64-hex-digit 'sha256'); delete it and {Path(path).name}, "
                        "then download again")
    return rec


def _record_mismatch(rec: dict, size: int, digests: dict[str, str]) -> str | None:
    if size != rec["size"]:
        return (f"size {size} bytes differs from the {rec['size']} bytes recorded on first use "
                f"({rec.get('recorded')})")
    if digests["sha256"] != rec["sha256"].lower():
        return (f"SHA-256 mismatch with the first-use record ({rec.get('recorded')}): expected "
                f"{rec['sha256'].lower()}, got {digests['sha256']}")
    return None


def _write_tofu_record(final: Path, size: int, digests: dict[str, str], url: str) -> None:
    rec = {"file": final.name, "size": size, "sha256": digests["sha256"], "md5": digests["md5"], "url": url,
           "recorded": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "policy": "trust on first use: no published checksum; later downloads and loads must match"}
    rec_path = tofu_record_path(final)
    fd, tmp = tempfile.mkstemp(prefix=rec_path.name + ".", suffix=".part", dir=rec_path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(rec, f, indent=1)
        os.chmod(tmp, 0o644)
        os.replace(tmp, rec_path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def _default_opener(url: str, timeout: float) -> IO[bytes]:
    req = urllib.request.Request(url, headers={"User-Agent": _USER_AGENT})
    return urllib.request.urlopen(req, timeout=timeout)  # noqa: S310 (URLs come from a spec or the caller)


def fetch(remote: RemoteFile, dest_dir: str | Path, *, opener: Opener | None = None,
          timeout: float = 60.0) -> Path:
    """Download one file into ``dest_dir`` (trying each mirror in turn) and verify it.

    A file already present with matching checksums is kept as is (one that does not match is replaced
    only by a verified download). For a ``tofu`` file the checksums are those of its first-use record
    (:func:`tofu_record_path`); without a record the download is trusted and recorded. Raises
    :class:`DataError` naming every mirror tried and what went wrong; a failed download leaves nothing
    new at the destination.
    """
    dest_dir = Path(dest_dir)
    created = not dest_dir.exists()
    dest_dir.mkdir(parents=True, exist_ok=True)
    final = dest_dir / remote.filename
    for old in dest_dir.glob(f"{glob.escape(remote.filename)}.*.part"):   # a killed download's leftovers
        try:
            if time.time() - old.stat().st_mtime > STALE_PART_S:
                old.unlink()
        except OSError:
            pass
    record = read_tofu_record(final) if remote.tofu else None
    if final.is_file():
        if remote.tofu:
            size = final.stat().st_size
            if record is not None and _record_mismatch(record, size, file_digests(final)) is None:
                return final
        elif _mismatch(remote, file_digests(final)) is None:
            return final
    try:
        return _fetch_mirrors(remote, final, record, opener or _default_opener, timeout)
    finally:                               # failed, interrupted (Ctrl-C, SIGTERM in the CLI) or done
        if created and not final.exists():
            try:
                dest_dir.rmdir()           # the folder this attempt created, if it stayed empty
            except OSError:
                pass


def _fetch_mirrors(remote: RemoteFile, final: Path, record: dict | None, open_url: Opener,
                   timeout: float) -> Path:
    """`fetch`'s downloads: each mirror in turn into a `.part` file, verified, renamed to `final`."""
    dest_dir = final.parent
    problems: list[str] = []
    mismatched = False
    for url in remote.urls:
        fd, tmp_name = tempfile.mkstemp(prefix=remote.filename + ".", suffix=".part", dir=dest_dir)
        tmp = Path(tmp_name)
        try:
            sha, md5, size = hashlib.sha256(), hashlib.md5(usedforsecurity=False), 0
            with os.fdopen(fd, "wb") as out, open_url(url, timeout=timeout) as response:
                for chunk in iter(lambda: response.read(_CHUNK), b""):
                    out.write(chunk)
                    sha.update(chunk)
                    md5.update(chunk)
                    size += len(chunk)
            digests = {"sha256": sha.hexdigest(), "md5": md5.hexdigest()}
            if remote.tofu:
                problem = _record_mismatch(record, size, digests) if record is not None else None
            else:
                problem = _mismatch(remote, digests)
            if problem is None:
                if remote.tofu and record is None:
                    _write_tofu_record(final, size, digests, url)   # before the file: never a file without it
                os.chmod(tmp, 0o644)  # mkstemp creates 0600
                os.replace(tmp, final)
                return final
            problems.append(f"{url}: {problem}")
            mismatched = True
        except (OSError, ValueError) as e:  # URLError, HTTPError and timeouts are OSErrors
            problems.append(f"{url}: {type(e).__name__}: {e}")
        finally:
            tmp.unlink(missing_ok=True)
    lines = "\n".join(f"  - {p}" for p in problems)
    why = ("A checksum mismatch means a corrupt or tampered file; nothing was kept." if mismatched
           else "Nothing was kept.")
    raise DataError(f"could not download {remote.filename} to {dest_dir}:\n{lines}\n{why}")


def download(name: str, dest: str | Path | None = None, *, files: Iterable[RemoteFile] | None = None,
             opener: Opener | None = None, timeout: float = 60.0) -> Path:
    """Download every official file of dataset ``name`` into ``dest`` (default :func:`download_dir`).

    ``files`` replaces the official list and ``opener`` replaces ``urllib.request.urlopen`` (both for
    tests and private mirrors). Returns the destination folder, which ``load_dataset`` searches.
    """
    if files is None:
        remote = remote_files()
        if name not in remote:
            from fedprism.registry import suggest

            raise ConfigError("dataset", name, f"downloadable datasets are {', '.join(remote)}"
                              + suggest(name, list(remote)), kind="")
        files = remote[name]
    target = Path(dest).expanduser() if dest is not None else download_dir(name)
    for remote in files:
        fetch(remote, target, opener=opener, timeout=timeout)
    return target
