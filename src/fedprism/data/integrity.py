"""Every dataset file read from disk is checked against its known digest first.

Known digests are what each dataset declares in its spec (``DatasetSpec.files``): the official files it
downloads (``files.remote``, what `fedprism data download` fetches) and other published copies
(``files.known``, such as the files of Debian's `dataset-fashion-mnist` package, whose bytes differ from
the upstream ones because Debian recompressed them).

For each file, the strongest available check is made, in this order:

1. a known SHA-256 (`KNOWN`): the published digest of every official file that has one;
2. a known MD5 (`KNOWN_MD5`) for official files with no published SHA-256: verified, and the result says
   `md5 verified` (MD5 catches corruption, not a crafted substitute);
3. a trust-on-first-use record beside the file (`<file>.tofu.json`, written by the first download of a
   file with no published checksum): its size and SHA-256 must match the record.

* A file whose check fails: `DataError` naming the file, the expected and the actual digest (a corrupt,
  truncated or substituted file is never decoded).
* A file with none of the three (raw, un-gzipped IDX files; CIFAR batches outside their tarball; a file
  with no published checksum not obtained through `fedprism data download`; any file of a name we do not
  know): a loud `UnverifiedDataWarning` per file, and the file is listed as unverified in the result
  (`Dataset.integrity`).

`KNOWN` and `KNOWN_MD5` cover the built-in datasets (built on first use); a registered dataset's files are
checked against its own spec. Each file is hashed once per process: digests are cached by (path, size,
mtime), so loading the same dataset again (every run of a sweep) costs a `stat`, not a read.
"""

from __future__ import annotations

from functools import partial
from hashlib import md5 as _hashlib_md5
from hashlib import sha256 as _sha256
import warnings
from pathlib import Path

from fedprism.data import download as _download
from fedprism.errors import DataError

_CHUNK = 1 << 20
_md5 = partial(_hashlib_md5, usedforsecurity=False)


class UnverifiedDataWarning(UserWarning):
    """A dataset file was used that no known checksum covers."""


def _specs(specs=None) -> list:
    if specs is not None:
        return list(specs)
    from fedprism.data.base import builtin_specs

    return builtin_specs()


def _known(specs=None) -> dict[tuple[str, str], tuple[str, ...]]:
    """(dataset, file name) -> acceptable SHA-256 digests: the official files and other known copies of
    `specs` (default: the built-in datasets)."""
    out: dict[tuple[str, str], tuple[str, ...]] = {}
    for spec in _specs(specs):
        if spec.files is None:
            continue
        for fname, sha in [(f.filename, f.sha256) for f in spec.files.remote] + \
                          [(k.filename, k.sha256) for k in spec.files.known]:
            if sha:
                out[(spec.name, fname)] = out.get((spec.name, fname), ()) + (sha.lower(),)
    return out


def _known_md5(specs=None) -> dict[tuple[str, str], tuple[str, ...]]:
    """Official files whose only published checksum is an MD5."""
    return {(spec.name, f.filename): (f.md5.lower(),) for spec in _specs(specs) if spec.files is not None
            for f in spec.files.remote if f.md5 and not f.sha256}


def __getattr__(name: str):
    """`KNOWN` and `KNOWN_MD5`, built from the built-in datasets' specs the first time they are read (a
    test may replace them: `verify` reads whatever the module holds)."""
    if name in ("KNOWN", "KNOWN_MD5"):
        value = _known() if name == "KNOWN" else _known_md5()
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _tables(dataset: str) -> tuple[dict, dict, tuple]:
    """(SHA-256 table, MD5 table, remote files) for `dataset`: the module's tables for a built-in, its
    own spec's for a registered one."""
    from fedprism.data.base import DATASETS

    spec = DATASETS.get(dataset)
    remote = spec.files.remote if spec.files is not None else ()
    if DATASETS.is_builtin(dataset):
        g = globals()
        return (g["KNOWN"] if "KNOWN" in g else __getattr__("KNOWN"),
                g["KNOWN_MD5"] if "KNOWN_MD5" in g else __getattr__("KNOWN_MD5"), remote)
    return _known([spec]), _known_md5([spec]), remote


_digests: dict[tuple[str, int, int] | tuple[str, int, int, str], str] = {}


def _digest_of(path: str | Path, algo: str) -> str:
    p = Path(path)
    st = p.stat()
    key = (str(p.resolve()), st.st_size, st.st_mtime_ns) + (() if algo == "sha256" else (algo,))
    digest = _digests.get(key)
    if digest is None:
        h = _sha256() if algo == "sha256" else _md5()
        try:
            with open(p, "rb") as f:
                for chunk in iter(lambda: f.read(_CHUNK), b""):
                    h.update(chunk)
        except OSError as e:
            raise DataError(f"{p}: cannot read the file to verify it ({e.strerror or e})") from None
        digest = _digests[key] = h.hexdigest()
    return digest


def sha256_of(path: str | Path) -> str:
    """SHA-256 of a file, computed once per (path, size, mtime) per process."""
    return _digest_of(path, "sha256")


def md5_of(path: str | Path) -> str:
    """MD5 of a file, computed once per (path, size, mtime) per process."""
    return _digest_of(path, "md5")


def _mismatch_error(dataset: str, path: Path, algo: str, expected: tuple[str, ...], actual: str,
                    what: str = "") -> DataError:
    exp = expected[0] if len(expected) == 1 else " or ".join(expected)
    return DataError(f"{path}: {algo} mismatch for dataset {dataset}{what}: expected {exp}, got {actual}; "
                     "the file is corrupt, truncated or not the official one (delete it and run "
                     f"`fedprism data download {dataset}`)")


def verify(dataset: str, files: dict[str, Path]) -> dict[str, str]:
    """Check every file; {path: 'sha256 verified' | 'md5 verified ...' | 'sha256 verified against the
    trust-on-first-use record ...' | 'unverified: ...'}, DataError on a mismatch."""
    known, known_md5, remote = _tables(dataset)
    status: dict[str, str] = {}
    for path in sorted(set(files.values()), key=str):
        expected = known.get((dataset, path.name))
        if expected:
            actual = sha256_of(path)
            if actual not in expected:
                raise _mismatch_error(dataset, path, "SHA-256", expected, actual)
            status[str(path)] = "sha256 verified"
            continue
        expected = known_md5.get((dataset, path.name))
        if expected:
            actual = md5_of(path)
            if actual not in expected:
                raise _mismatch_error(dataset, path, "MD5", expected, actual, " (only an MD5 is published)")
            status[str(path)] = "md5 verified (only an MD5 is published)"
            continue
        tofu = any(f.tofu and f.filename == path.name for f in remote)
        record = _download.read_tofu_record(path) if tofu else None     # only files declared tofu have one
        if record is not None:
            when = f" of {record.get('recorded', 'an unknown date')}"
            size = path.stat().st_size
            if size != record["size"]:
                raise DataError(f"{path}: size {size} bytes, but the trust-on-first-use record "
                                f"{_download.tofu_record_path(path)}{when} says {record['size']}; the file "
                                "changed since its first download (delete it and run "
                                f"`fedprism data download {dataset}`)")
            actual = sha256_of(path)
            if actual != record["sha256"].lower():
                raise _mismatch_error(dataset, path, "SHA-256", (record["sha256"].lower(),), actual,
                                      f" (trust-on-first-use record{when})")
            status[str(path)] = f"sha256 verified against the trust-on-first-use record{when}"
            continue
        if tofu:
            record_name = _download.tofu_record_path(path).name
            why = (f"no published checksum and no trust-on-first-use record {record_name} beside it; "
                   f"`fedprism data download {dataset}` fetches a copy and records it")
        else:
            why = f"no known SHA-256 for {path.name!r}"
        status[str(path)] = f"unverified: {why}"
        warnings.warn(f"dataset {dataset}: {path} is UNVERIFIED ({why}); its content is used as it is",
                      UnverifiedDataWarning, stacklevel=3)
    return status
