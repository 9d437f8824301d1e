"""Every dataset file read from disk is checked against its known digest first.

Known digests: the official files of `fedprism.data.download.REMOTE` (what `fedprism data download`
fetches) and the files of Debian's `dataset-fashion-mnist` package (`/usr/share/datasets/fashion-mnist`:
Debian recompressed the upstream gzip files, so their bytes differ from Zalando's; the digests below
are of the package's files, whose MD5 values are the ones the package's own `md5sums` lists).

For each file, the strongest available check is made, in this order:

1. a known SHA-256 (`KNOWN`): the published digest of every official file that has one;
2. a known MD5 (`KNOWN_MD5`) for official files with no published SHA-256 (USPS): verified, and the
   result says `md5 verified` (MD5 catches corruption, not a crafted substitute);
3. a trust-on-first-use record beside the file (`<file>.tofu.json`, written by the first download of a
   file with no published checksum, WISDM): its size and SHA-256 must match the record.

* A file whose check fails: `DataError` naming the file, the expected and the actual digest (a corrupt,
  truncated or substituted file is never decoded).
* A file with none of the three (raw, un-gzipped IDX files; CIFAR batches outside their tarball; a
  WISDM file not obtained through `fedprism data download wisdm`; any file of a name we do not know):
  a loud `UnverifiedDataWarning` per file, and the file is listed as unverified in the result
  (`Dataset.integrity`).

Each file is hashed once per process: digests are cached by (path, size, mtime), so loading the same
dataset again (every run of a sweep) costs a `stat`, not a read.
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

#: Debian `dataset-fashion-mnist` (the files of /usr/share/datasets/fashion-mnist): SHA-256 (computed
#: from the installed package) with the MD5 the package's md5sums file lists for it
DEBIAN_FMNIST = {
    "train-images-idx3-ubyte.gz": ("b0564c3eedabfbf835052cff8503ea422014ce006caf5b757f851416ee8300c7",
                                   "cf8536b0aa1a6ac5fa3f23001093305c"),
    "train-labels-idx1-ubyte.gz": ("0ae29f65d86684f32d1b9c85147786c547b9c6aebcaf235f0400a0cce308b056",
                                   "10bea18fdb374794d4bb42e356e600c9"),
    "t10k-images-idx3-ubyte.gz": ("cc1d090a38ace84dfa1aa66e3ada7c336ef481a96936906477e6dd344da56eaa",
                                  "f78720b4224f21cce2f2ccf2d7a94c9a"),
    "t10k-labels-idx1-ubyte.gz": ("8d3605d196f4be44669e46906da9733c8131fef761fdbfec72c424d5222f1a05",
                                  "0d30e22e447f3c33dab9ed536400ac01"),
}


class UnverifiedDataWarning(UserWarning):
    """A dataset file was used that no known checksum covers."""


def _known() -> dict[tuple[str, str], tuple[str, ...]]:
    out: dict[tuple[str, str], tuple[str, ...]] = {}
    for name, files in _download.REMOTE.items():
        for f in files:
            if f.sha256:
                out[(name, f.filename)] = out.get((name, f.filename), ()) + (f.sha256.lower(),)
    for fname, (sha, _md5) in DEBIAN_FMNIST.items():
        out[("fmnist", fname)] = out.get(("fmnist", fname), ()) + (sha,)
    return out


def _known_md5() -> dict[tuple[str, str], tuple[str, ...]]:
    """Official files whose only published checksum is an MD5."""
    return {(name, f.filename): (f.md5.lower(),) for name, files in _download.REMOTE.items() for f in files
            if f.md5 and not f.sha256}


#: (dataset, file name) -> acceptable SHA-256 digests
KNOWN: dict[tuple[str, str], tuple[str, ...]] = _known()

#: (dataset, file name) -> acceptable MD5 digests, for official files with no published SHA-256
KNOWN_MD5: dict[tuple[str, str], tuple[str, ...]] = _known_md5()

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
    status: dict[str, str] = {}
    for path in sorted(set(files.values()), key=str):
        expected = KNOWN.get((dataset, path.name))
        if expected:
            actual = sha256_of(path)
            if actual not in expected:
                raise _mismatch_error(dataset, path, "SHA-256", expected, actual)
            status[str(path)] = "sha256 verified"
            continue
        expected = KNOWN_MD5.get((dataset, path.name))
        if expected:
            actual = md5_of(path)
            if actual not in expected:
                raise _mismatch_error(dataset, path, "MD5", expected, actual, " (only an MD5 is published)")
            status[str(path)] = "md5 verified (only an MD5 is published)"
            continue
        tofu = any(f.tofu and f.filename == path.name for f in _download.REMOTE.get(dataset, ()))
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
