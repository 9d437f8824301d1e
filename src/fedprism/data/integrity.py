"""Every dataset file read from disk is checked against its known SHA-256 first.

Known digests: the official files of `fedprism.data.download.REMOTE` (what `fedprism data download`
fetches) and the files of Debian's `dataset-fashion-mnist` package (`/usr/share/datasets/fashion-mnist`:
Debian recompressed the upstream gzip files, so their bytes differ from Zalando's; the digests below
are of the package's files, whose MD5 values are the ones the package's own `md5sums` lists).

* A file whose name has known digests and whose content matches none: `DataError` naming the file,
  the expected and the actual digest (a corrupt, truncated or substituted file is never decoded).
* A file with no known digest (raw, un-gzipped IDX files; CIFAR batches outside their tarball; any
  file of a name we do not know): a loud `UnverifiedDataWarning` per file, and the file is listed as
  unverified in the result (`Dataset.integrity`).

Each file is hashed once per process: digests are cached by (path, size, mtime), so loading the same
dataset again (every run of a sweep) costs a `stat`, not a read.
"""

from __future__ import annotations

from hashlib import sha256 as _sha256
import warnings
from pathlib import Path

from fedprism.data import download as _download
from fedprism.errors import DataError

_CHUNK = 1 << 20

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


#: (dataset, file name) -> acceptable SHA-256 digests
KNOWN: dict[tuple[str, str], tuple[str, ...]] = _known()

_digests: dict[tuple[str, int, int], str] = {}


def sha256_of(path: str | Path) -> str:
    """SHA-256 of a file, computed once per (path, size, mtime) per process."""
    p = Path(path)
    st = p.stat()
    key = (str(p.resolve()), st.st_size, st.st_mtime_ns)
    digest = _digests.get(key)
    if digest is None:
        h = _sha256()
        try:
            with open(p, "rb") as f:
                for chunk in iter(lambda: f.read(_CHUNK), b""):
                    h.update(chunk)
        except OSError as e:
            raise DataError(f"{p}: cannot read the file to verify it ({e.strerror or e})") from None
        digest = _digests[key] = h.hexdigest()
    return digest


def verify(dataset: str, files: dict[str, Path]) -> dict[str, str]:
    """Check every file; {path: 'sha256 verified' | 'unverified: ...'}, DataError on a mismatch."""
    status: dict[str, str] = {}
    for path in sorted(set(files.values()), key=str):
        expected = KNOWN.get((dataset, path.name))
        if not expected:
            status[str(path)] = "unverified: no known SHA-256 for this file name"
            warnings.warn(f"dataset {dataset}: {path} is UNVERIFIED (no known SHA-256 for {path.name!r}); "
                          "its content is used as it is", UnverifiedDataWarning, stacklevel=3)
            continue
        actual = sha256_of(path)
        if actual not in expected:
            exp = expected[0] if len(expected) == 1 else " or ".join(expected)
            raise DataError(f"{path}: SHA-256 mismatch for dataset {dataset}: expected {exp}, got {actual}; "
                            "the file is corrupt, truncated or not the official one (delete it and run "
                            f"`fedprism data download {dataset}`)")
        status[str(path)] = "sha256 verified"
    return status
