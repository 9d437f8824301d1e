"""Explicit dataset downloads from the official mirrors, checksum-verified and atomic.

This is the only module of fedprism that touches the network, and only when the user asks for it
(`fedprism data download <name>` or `load_dataset(..., download=True)`).

Each file is streamed to a temporary ``<name>.<random>.part`` file in the destination folder while its
SHA-256 and MD5 are computed; only when every known checksum matches is it renamed (atomically) to its
final name. A mismatch deletes the partial file and raises :class:`DataError`, so the destination never
holds an unverified file.

Checksums: the MD5 values are the ones the dataset authors and torchvision publish; the SHA-256 values
are the ones published by Keras (CIFAR), the torchvision prototype datasets (CIFAR-100, SVHN) and
several independent checksum lists (MNIST, Fashion-MNIST), cross-checked against each other. Both are
verified when known.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from fedprism.errors import ConfigError, DataError

__all__ = ["RemoteFile", "REMOTE", "cache_root", "download_dir", "download", "fetch", "file_digests"]

Opener = Callable[..., IO[bytes]]
"""``opener(url, timeout=...)`` returning a readable binary stream usable in a ``with`` statement
(default: ``urllib.request.urlopen`` with a User-Agent header)."""

_CHUNK = 1 << 20
_USER_AGENT = "fedprism-dataset-download/1 (+urllib)"


@dataclass(frozen=True)
class RemoteFile:
    """One file to download: its local name, the mirrors to try in order, and its known checksums."""

    filename: str
    urls: tuple[str, ...]
    sha256: str | None = None
    md5: str | None = None

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError(f"RemoteFile {self.filename!r} needs at least one URL")
        if Path(self.filename).name != self.filename or self.filename in ("", ".", ".."):
            raise ValueError(f"RemoteFile filename must be a plain file name, got {self.filename!r}")


def _mirrored(filename: str, bases: Sequence[str], sha256: str, md5: str) -> RemoteFile:
    return RemoteFile(filename, tuple(b + filename for b in bases), sha256=sha256, md5=md5)


_FMNIST_MIRRORS = (
    "https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/fashion/",
    "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
)
_MNIST_MIRRORS = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
)

REMOTE: dict[str, tuple[RemoteFile, ...]] = {
    "fmnist": (
        _mirrored("train-images-idx3-ubyte.gz", _FMNIST_MIRRORS,
                  "08dc20ab1689590a0bcd66e874647b6ee8464e2d501b5a3f1f78831db19a3fdc",
                  "8d4fb7e6c68d591d4c3dfef9ec88bf0d"),
        _mirrored("train-labels-idx1-ubyte.gz", _FMNIST_MIRRORS,
                  "b0197879cbda89f3dc7b894f9fd52b858e68ea4182b6947c9d8c2b67e5f18dcc",
                  "25c81989df183df01b3e8a0aad5dffbe"),
        _mirrored("t10k-images-idx3-ubyte.gz", _FMNIST_MIRRORS,
                  "78dcbbfb5a27efaf1b6c1d616caca68560be8766c5bffcb2791df9273a534229",
                  "bef4ecab320f06d8554ea6380940ec79"),
        _mirrored("t10k-labels-idx1-ubyte.gz", _FMNIST_MIRRORS,
                  "42bd18137a62d5998cdeae52bf3a0676ac6b706f5cf8439b47bb5b151ae3dccf",
                  "bb300cfdad3c16e7a12a480ee83cd310"),
    ),
    "mnist": (
        _mirrored("train-images-idx3-ubyte.gz", _MNIST_MIRRORS,
                  "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609",
                  "f68b3c2dcbeaaa9fbdd348bbdeb94873"),
        _mirrored("train-labels-idx1-ubyte.gz", _MNIST_MIRRORS,
                  "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c",
                  "d53e105ee54ea40749a09fcbcd1e9432"),
        _mirrored("t10k-images-idx3-ubyte.gz", _MNIST_MIRRORS,
                  "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
                  "9fb629c4189551a2d022fa330f9573f3"),
        _mirrored("t10k-labels-idx1-ubyte.gz", _MNIST_MIRRORS,
                  "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6",
                  "ec29112dd5afa0611ce80d1b7f02629c"),
    ),
    "cifar10": (
        _mirrored("cifar-10-python.tar.gz", ("https://www.cs.toronto.edu/~kriz/",),
                  "6d958be074577803d12ecdefd02955f39262c83c16fe9348329d7fe0b5c001ce",
                  "c58f30108f718f92721af3b95e74349a"),
    ),
    "cifar100": (
        _mirrored("cifar-100-python.tar.gz", ("https://www.cs.toronto.edu/~kriz/",),
                  "85cd44d02ba6437773c5bbd22e183051d648de2e7d6b014e1ef29b855ba677a7",
                  "eb9058c3a382ffc7106e4002c42a8d85"),
    ),
    "svhn": (
        _mirrored("train_32x32.mat", ("http://ufldl.stanford.edu/housenumbers/",),
                  "435e94d69a87fde4fd4d7f3dd208dfc32cb6ae8af2240d066de1df7508d083b8",
                  "e26dedcc434d2e4c54c9b2d4a06d8373"),
        _mirrored("test_32x32.mat", ("http://ufldl.stanford.edu/housenumbers/",),
                  "cdce80dfb2a2c4c6160906d0bd7c68ec5a99d7ca4831afa54f09182025b6a75b",
                  "eb5a983be6a315427106f1b164d9cef3"),
    ),
}
"""Official files of every downloadable dataset (``digits`` and ``synthetic`` need no download)."""


def cache_root() -> Path:
    """Root of fedprism's caches: ``$FEDPRISM_CACHE`` if set, else ``~/.cache/fedprism``."""
    env = os.environ.get("FEDPRISM_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fedprism"


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
    """Describe the first checksum that does not match, or None when all known ones match."""
    for algo in ("sha256", "md5"):
        expected = getattr(remote, algo)
        if expected is not None and digests[algo] != expected.lower():
            return f"{algo.upper()} mismatch: expected {expected.lower()}, got {digests[algo]}"
    return None


def _default_opener(url: str, timeout: float) -> IO[bytes]:
    req = urllib.request.Request(url, headers={"User-Agent": _USER_AGENT})
    return urllib.request.urlopen(req, timeout=timeout)  # noqa: S310 (URLs come from REMOTE or the caller)


def fetch(remote: RemoteFile, dest_dir: str | Path, *, opener: Opener | None = None,
          timeout: float = 60.0) -> Path:
    """Download one file into ``dest_dir`` (trying each mirror in turn) and verify it.

    A file already present with matching checksums is kept as is (one that does not match is replaced
    only by a verified download). Raises :class:`DataError` naming every mirror tried and what went
    wrong; a failed download leaves nothing new at the destination.
    """
    dest_dir = Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    final = dest_dir / remote.filename
    if final.is_file() and _mismatch(remote, file_digests(final)) is None:
        return final
    open_url = opener or _default_opener
    problems: list[str] = []
    for url in remote.urls:
        fd, tmp_name = tempfile.mkstemp(prefix=remote.filename + ".", suffix=".part", dir=dest_dir)
        tmp = Path(tmp_name)
        try:
            sha, md5 = hashlib.sha256(), hashlib.md5(usedforsecurity=False)
            with os.fdopen(fd, "wb") as out, open_url(url, timeout=timeout) as response:
                for chunk in iter(lambda: response.read(_CHUNK), b""):
                    out.write(chunk)
                    sha.update(chunk)
                    md5.update(chunk)
            problem = _mismatch(remote, {"sha256": sha.hexdigest(), "md5": md5.hexdigest()})
            if problem is None:
                os.chmod(tmp, 0o644)  # mkstemp creates 0600
                os.replace(tmp, final)
                return final
            problems.append(f"{url}: {problem}")
        except (OSError, ValueError) as e:  # URLError, HTTPError and timeouts are OSErrors
            problems.append(f"{url}: {type(e).__name__}: {e}")
        finally:
            tmp.unlink(missing_ok=True)
    lines = "\n".join(f"  - {p}" for p in problems)
    raise DataError(f"could not download {remote.filename} to {dest_dir}:\n{lines}\n"
                    "A checksum mismatch means a corrupt or tampered file; nothing was kept.")


def download(name: str, dest: str | Path | None = None, *, files: Iterable[RemoteFile] | None = None,
             opener: Opener | None = None, timeout: float = 60.0) -> Path:
    """Download every official file of dataset ``name`` into ``dest`` (default :func:`download_dir`).

    ``files`` replaces the official list and ``opener`` replaces ``urllib.request.urlopen`` (both for
    tests and private mirrors). Returns the destination folder, which ``load_dataset`` searches.
    """
    if files is None:
        if name not in REMOTE:
            raise ConfigError("dataset", name, f"downloadable datasets are {', '.join(REMOTE)}")
        files = REMOTE[name]
    target = Path(dest).expanduser() if dest is not None else download_dir(name)
    for remote in files:
        fetch(remote, target, opener=opener, timeout=timeout)
    return target
