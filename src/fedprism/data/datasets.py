"""Dataset loaders: local files -> normalised tensors, offline, with a cache of the decoded arrays.

``load_dataset(name)`` looks for the official files in :func:`search_paths` (never the network unless
``download=True``), parses them with numpy / scipy only, checks them (magic numbers, sizes, label
ranges) and returns a :class:`Dataset` of float32 images normalised per channel,
``(x / 255 - mean) / std``, laid out ``[N, C, H, W]`` (``[N, D]`` for tabular data). docs/datasets.md
describes every dataset, where it is looked for and how each file is verified.

The decoded uint8 arrays are cached as ``.npz`` under ``<cache_dir>/decoded/``, keyed by the dataset
name and the names, sizes and mtimes of the source files, and carry a SHA-256 of their content: a cache
file that fails to load or to verify is ignored (with a warning) and rebuilt, never trusted silently.

Pickle is used only for the official CIFAR "python version" batches, only from their expected file
names, and through an unpickler that refuses every global except the few numpy constructors those
files need. ``digits`` (scikit-learn's bundled copy) and ``synthetic`` (FedProx's generator) need no
files at all.

``usps`` (Hull 1994, "A database for handwritten text recognition research") is read from LIBSVM's
``usps.bz2`` / ``usps.t.bz2``; ``wisdm`` (Kwapisz, Weiss, Moore 2011, "Activity recognition using cell
phone accelerometers") from ``WISDM_ar_latest.tar.gz`` through :mod:`fedprism.data.wisdm`, as 3-feature
windows with each window's user in ``groups`` / ``test_groups`` (for ``partition=natural``).
"""

from __future__ import annotations

import bz2
import codecs
import gzip
import hashlib
import os
import pickle
import shutil
import tarfile
import tempfile
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fedprism.data import download as _download
from fedprism.data import integrity as _integrity
from fedprism.data import wisdm as _wisdm
from fedprism.errors import ConfigError, DataError

__all__ = [
    "DATASETS",
    "NORMALIZATION",
    "Dataset",
    "load_dataset",
    "search_paths",
    "read_idx",
    "generate_synthetic",
]

DATASETS = ("fmnist", "mnist", "cifar10", "cifar100", "svhn", "usps", "digits", "synthetic", "wisdm")

NATURAL_CLIENTS = ("synthetic", "wisdm")
"""Datasets whose samples carry their natural client (device or user) in ``groups`` / ``test_groups``."""

DEBIAN_FMNIST = Path("/usr/share/datasets/fashion-mnist")
"""Where Debian's ``dataset-fashion-mnist`` package installs the gzipped IDX files."""

CACHE_VERSION = 1

NORMALIZATION: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "fmnist": ((0.2860,), (0.3530,)),
    "mnist": ((0.1307,), (0.3081,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "svhn": ((0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970)),
    # the values in common use with torchvision's USPS pixels (the conversion read_usps copies); not
    # recomputed here
    "usps": ((0.2469,), (0.2989,)),
    "digits": ((0.3053,), (0.3760,)),  # of images / 16 over all 1797 digits
}
"""Per-channel (mean, std) of the images scaled to [0, 1] (training-set statistics). ``wisdm`` is
standardised with its own training windows' per-axis mean and std at load time instead."""

FMNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                  "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")
_DIGIT_CLASSES = tuple(str(i) for i in range(10))
_NUM_CLASSES = {"fmnist": 10, "mnist": 10, "cifar10": 10, "cifar100": 100, "svhn": 10, "usps": 10}
_IMAGE_SHAPE = {"fmnist": (1, 28, 28), "mnist": (1, 28, 28), "cifar10": (3, 32, 32), "cifar100": (3, 32, 32),
                "svhn": (3, 32, 32), "usps": (1, 16, 16)}
"""[channels, height, width] of each image dataset's official files; other sizes are other data."""


@dataclass
class Dataset:
    """A labelled dataset in memory: normalised float32 inputs, int64 labels, class names.

    ``groups`` / ``test_groups`` give each sample's natural client (``synthetic``: the generator's device,
    ``wisdm``: the user; else None), which ``partition=natural`` uses. ``mean`` / ``std`` are the
    per-channel constants the images were normalised with (per feature for ``wisdm``; empty for data
    left unnormalised); ``source`` says where the data came from.
    """

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    classes: list[str]
    groups: np.ndarray | None = None
    test_groups: np.ndarray | None = None
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()
    source: str = ""
    #: file -> 'sha256 verified...' | 'md5 verified...' | 'unverified: ...' (datasets read from files only)
    integrity: dict[str, str] | None = None

    def __post_init__(self) -> None:
        if len(self.x_train) != len(self.y_train) or len(self.x_test) != len(self.y_test):
            raise ValueError("x and y of a split must have the same number of samples")
        if self.groups is not None and len(self.groups) != len(self.y_train):
            raise ValueError("groups must give one device id per training sample")
        if self.test_groups is not None and len(self.test_groups) != len(self.y_test):
            raise ValueError("test_groups must give one device id per test sample")

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])

    def denormalize(self, x: torch.Tensor) -> torch.Tensor:
        """Undo the per-channel normalisation: images back in [0, 1] (tabular data is returned as is)."""
        if not self.mean:
            return x
        shape = (1, -1) + (1,) * (x.dim() - 2)
        m = torch.tensor(self.mean, dtype=x.dtype, device=x.device).view(shape)
        s = torch.tensor(self.std, dtype=x.dtype, device=x.device).view(shape)
        return x * s + m


@dataclass
class _Raw:
    """Decoded arrays as stored in the cache: uint8 images [N, C, H, W] and int64 labels."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    classes: list[str]


# --------------------------------------------------------------------------------------- names & paths


def _check_name(name: object) -> str:
    if not isinstance(name, str) or name.lower() not in DATASETS:
        raise ConfigError("dataset", name, f"one of {', '.join(DATASETS)}")
    return name.lower()


def search_paths(name: str, root: str | Path | None = None) -> list[Path]:
    """Folders searched for dataset ``name``, in order.

    ``root`` if given, ``$FEDPRISM_DATA/<name>``, ``$FEDPRISM_DATA``, Debian's
    ``/usr/share/datasets/fashion-mnist`` (fmnist only), then the download folder
    ``<cache root>/data/<name>`` (``~/.cache/fedprism/data/<name>`` unless ``$FEDPRISM_CACHE`` is set).
    """
    name = _check_name(name)
    paths: list[Path] = []
    if root is not None:
        if not isinstance(root, (str, os.PathLike)):
            raise ConfigError("root", root, "a folder path")
        paths.append(Path(root).expanduser())
    env = os.environ.get("FEDPRISM_DATA")
    if env:
        paths += [Path(env).expanduser() / name, Path(env).expanduser()]
    if name == "fmnist":
        paths.append(DEBIAN_FMNIST)
    paths.append(_download.download_dir(name))
    unique: list[Path] = []
    for p in paths:
        if p not in unique:
            unique.append(p)
    return unique


# ------------------------------------------------------------------------------------ file layouts

_IDX_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}


@dataclass(frozen=True)
class _CifarLayout:
    folder: str
    archive: str
    train: tuple[str, ...]
    test: tuple[str, ...]
    meta: str
    label_key: bytes
    names_key: bytes

    @property
    def members(self) -> tuple[str, ...]:
        return self.train + self.test + (self.meta,)


_CIFAR = {
    "cifar10": _CifarLayout("cifar-10-batches-py", "cifar-10-python.tar.gz",
                            tuple(f"data_batch_{i}" for i in range(1, 6)), ("test_batch",),
                            "batches.meta", b"labels", b"label_names"),
    "cifar100": _CifarLayout("cifar-100-python", "cifar-100-python.tar.gz", ("train",), ("test",),
                             "meta", b"fine_labels", b"fine_label_names"),
}
_SVHN_FILES = {"train": "train_32x32.mat", "test": "test_32x32.mat"}
_USPS_FILES = {"train": "usps", "test": "usps.t"}


def _find_each(d: Path, files: dict[str, str], ext: str, none: str) -> dict[str, Path] | str:
    """Each of `files` (key -> base name) in `d`, compressed (`ext`) or plain; or why not."""
    found, missing = {}, []
    for key, base in files.items():
        hit = next((p for p in (d / f"{base}{ext}", d / base) if p.is_file()), None)
        if hit is None:
            missing.append(f"{base}[{ext}]")
        else:
            found[key] = hit
    if not found:
        return none
    return f"incomplete: missing {', '.join(missing)}" if missing else found


def _find_idx(d: Path) -> dict[str, Path] | str:
    return _find_each(d, _IDX_FILES, ".gz", "no IDX files")


def _find_cifar(layout: _CifarLayout, d: Path) -> dict[str, Path] | str:
    for folder in (d / layout.folder, d):
        if all((folder / m).is_file() for m in layout.members):
            return {m: folder / m for m in layout.members}
    if (d / layout.archive).is_file():
        return {"archive": d / layout.archive}
    sub = d / layout.folder
    if sub.is_dir():
        missing = [m for m in layout.members if not (sub / m).is_file()]
        return f"incomplete: {layout.folder}/ lacks {', '.join(missing)}"
    return f"no {layout.folder}/ folder and no {layout.archive}"


def _find_svhn(d: Path) -> dict[str, Path] | str:
    missing = [f for f in _SVHN_FILES.values() if not (d / f).is_file()]
    if len(missing) == len(_SVHN_FILES):
        return "no .mat files"
    if missing:
        return f"incomplete: missing {', '.join(missing)}"
    return {k: d / f for k, f in _SVHN_FILES.items()}


def _find_usps(d: Path) -> dict[str, Path] | str:
    return _find_each(d, _USPS_FILES, ".bz2", "no usps[.bz2] / usps.t[.bz2] files")


def _find_wisdm(d: Path) -> dict[str, Path] | str:
    for p in (d / _wisdm.ARCHIVE, d / _wisdm.MEMBER, d / _wisdm.RAW_FILE):
        if p.is_file():
            return {"archive" if p.name == _wisdm.ARCHIVE else "raw": p}
    return f"no {_wisdm.ARCHIVE} and no {_wisdm.RAW_FILE}"


def _find(name: str, d: Path) -> dict[str, Path] | str:
    if not d.is_dir():
        return "no such folder"
    if name in ("fmnist", "mnist"):
        return _find_idx(d)
    if name in _CIFAR:
        return _find_cifar(_CIFAR[name], d)
    if name == "usps":
        return _find_usps(d)
    if name == "wisdm":
        return _find_wisdm(d)
    return _find_svhn(d)


def _needed(name: str) -> str:
    if name in ("fmnist", "mnist"):
        return ", ".join(f"{b}[.gz]" for b in _IDX_FILES.values())
    if name in _CIFAR:
        lay = _CIFAR[name]
        return f"{lay.archive}, or the folder {lay.folder}/ with {', '.join(lay.members)}"
    if name == "usps":
        return "usps.bz2, usps.t.bz2 (LIBSVM format; also accepted decompressed as usps, usps.t)"
    if name == "wisdm":
        return f"{_wisdm.ARCHIVE}, or {_wisdm.RAW_FILE} (on its own or in WISDM_ar_v1.1/)"
    return ", ".join(_SVHN_FILES.values())


def _locate(name: str, root: str | Path | None) -> tuple[dict[str, Path], Path] | list[tuple[Path, str]]:
    """The first folder holding a complete copy, or every folder looked at with why it did not match."""
    looked: list[tuple[Path, str]] = []
    for d in search_paths(name, root):
        found = _find(name, d)
        if isinstance(found, dict):
            return found, d
        if root is not None and not looked:       # an explicit data.root is never silently passed over
            raise DataError(f"data.root {d} does not hold dataset '{name}' ({found}); needed: {_needed(name)}. "
                            "Fix data.root, leave it empty to search the default locations, or add "
                            "data.download=true to download it into data.root")
        looked.append((d, found))
    return looked


def _missing_error(name: str, looked: list[tuple[Path, str]]) -> DataError:
    lines = [f"dataset '{name}' not found. Looked in:"]
    lines += [f"  - {p}  ({why})" for p, why in looked]
    lines.append(f"Needed files: {_needed(name)}.")
    if name == "wisdm":
        lines.append("Download them (no checksum is published: the first download is recorded and later "
                     f"ones are checked against it) with:\n    fedprism data download {name}")
    else:
        lines.append(f"Download them (checksum-verified) with:\n    fedprism data download {name}")
    if name == "fmnist":
        lines.append("or, on Debian/Ubuntu:\n    sudo apt-get install dataset-fashion-mnist")
    lines.append("or copy them into one of the folders above (set $FEDPRISM_DATA or pass data.root=...).")
    return DataError("\n".join(lines))


# --------------------------------------------------------------------------------------------- IDX

_IDX_DTYPES = {0x08: np.dtype(np.uint8), 0x09: np.dtype(np.int8), 0x0B: np.dtype(">i2"),
               0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}


def read_idx(path: str | Path, ndim: int | None = None) -> np.ndarray:
    """Parse an IDX file (gzip-compressed or raw, detected by content) into a numpy array.

    Checks the magic number (two zero bytes, a known type code, and ``ndim`` dimensions if given) and
    that the data is exactly as long as the big-endian dimensions say; raises :class:`DataError` naming
    the file and the problem otherwise.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            gz = f.read(2) == b"\x1f\x8b"
        with (gzip.open(path, "rb") if gz else open(path, "rb")) as f:
            data = f.read()
    except (OSError, EOFError, zlib.error) as e:
        what = "corrupt or truncated gzip stream" if gz else "cannot read file"
        raise DataError(f"{path}: {what} ({type(e).__name__}: {e})") from e
    if len(data) < 4:
        raise DataError(f"{path}: truncated IDX file: {len(data)} bytes, not even a magic number")
    magic = int.from_bytes(data[:4], "big")
    nd, code = data[3], data[2]
    if data[:2] != b"\0\0" or code not in _IDX_DTYPES or (ndim is not None and nd != ndim):
        expect = f"0x{0x800 + ndim:08x} (unsigned bytes, {ndim}-d)" if ndim is not None else "0x0000TTDD"
        raise DataError(f"{path}: bad IDX magic number 0x{magic:08x}, expected {expect}; "
                        "this is not the right IDX file")
    header = 4 + 4 * nd
    if len(data) < header:
        raise DataError(f"{path}: truncated IDX header: {nd} dimensions need {header} bytes, "
                        f"the file has {len(data)}")
    dims = tuple(int(v) for v in np.frombuffer(data, ">u4", count=nd, offset=4))
    dtype = _IDX_DTYPES[code]
    count = 1
    for d in dims:                       # Python ints: no int64 wrap-around for a forged header
        count *= d
    expected, got = count * dtype.itemsize, len(data) - header
    if got < expected:
        raise DataError(f"{path}: truncated: dims {dims} need {expected} bytes of data, "
                        f"the file has {got} (download it again)")
    if got > expected:
        raise DataError(f"{path}: {got - expected} unexpected bytes after the {expected} bytes "
                        f"of data for dims {dims}; corrupt file")
    return np.frombuffer(data, dtype, count=count, offset=header).reshape(dims)


def _decode_idx(files: dict[str, Path], classes: tuple[str, ...]) -> _Raw:
    out = {}
    for split in ("train", "test"):
        ipath, lpath = files[f"{split}_images"], files[f"{split}_labels"]
        images, labels = read_idx(ipath, ndim=3), read_idx(lpath, ndim=1)
        if len(labels) != len(images):
            raise DataError(f"{lpath} has {len(labels)} labels but {ipath} has {len(images)} images; "
                            "the files do not belong together")
        out[split] = (images[:, None], labels.astype(np.int64))
    return _Raw(*out["train"], *out["test"], list(classes))


# ------------------------------------------------------------------------------------------- CIFAR

_NP_RECONSTRUCT = np.zeros(1).__reduce__()[0]  # numpy's ndarray._reconstruct, whatever its module
_PICKLE_GLOBALS: dict[tuple[str, str], object] = {
    ("numpy.core.multiarray", "_reconstruct"): _NP_RECONSTRUCT,
    ("numpy._core.multiarray", "_reconstruct"): _NP_RECONSTRUCT,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("_codecs", "encode"): codecs.encode,
}


class _CifarUnpickler(pickle.Unpickler):
    """Unpickler for the official CIFAR batches: numpy arrays, lists, dicts and strings, nothing else."""

    def find_class(self, module: str, name: str) -> object:
        try:
            return _PICKLE_GLOBALS[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"refusing global {module}.{name} (not in a CIFAR batch)") from None


def _load_pickle(path: Path) -> dict[bytes, object]:
    try:
        with open(path, "rb") as f:
            obj = _CifarUnpickler(f, encoding="bytes").load()
    except Exception as e:  # a truncated/corrupt pickle can fail in many ways; all mean the same
        raise DataError(f"{path}: cannot unpickle ({type(e).__name__}: {e}); "
                        "the file is truncated or corrupt, download it again") from e
    if not isinstance(obj, dict):
        raise DataError(f"{path}: expected a dict, found {type(obj).__name__}; not a CIFAR file")
    return {(k.encode() if isinstance(k, str) else k): v for k, v in obj.items()}


def _cifar_batch(path: Path, label_key: bytes) -> tuple[np.ndarray, np.ndarray]:
    d = _load_pickle(path)
    if b"data" not in d or label_key not in d:
        keys = ", ".join(sorted(k.decode(errors="replace") for k in d if isinstance(k, bytes)))
        raise DataError(f"{path}: not a CIFAR batch: needs 'data' and '{label_key.decode()}', has {keys}")
    try:
        data = np.asarray(d[b"data"])
        raw = np.asarray(d[label_key])
    except (ValueError, TypeError) as e:      # ragged lists and the like
        raise DataError(f"{path}: 'data' or '{label_key.decode()}' is not an array ({e}); "
                        "corrupt file") from None
    if raw.dtype.kind not in "iu" or raw.ndim != 1:
        raise DataError(f"{path}: '{label_key.decode()}' is {raw.dtype} {raw.shape}, "
                        "expected integer labels [N]")
    labels = raw.astype(np.int64)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise DataError(f"{path}: 'data' is {data.dtype} {data.shape}, expected uint8 [N, 3072]")
    if len(labels) != len(data):
        raise DataError(f"{path}: {len(labels)} labels for {len(data)} images")
    return data.reshape(-1, 3, 32, 32), labels


def _cifar_names(path: Path, key: bytes, expected: int) -> list[str]:
    d = _load_pickle(path)
    names = d.get(key)
    if not isinstance(names, list) or len(names) != expected:
        raise DataError(f"{path}: '{key.decode()}' should list {expected} class names")
    return [n.decode() if isinstance(n, bytes) else str(n) for n in names]


def _extract_cifar(layout: _CifarLayout, archive: Path, into: Path) -> Path:
    """Extract just the expected batch files of ``archive`` into a fresh temporary folder of ``into``."""
    into.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{layout.folder}-", dir=into))
    wanted = {f"{layout.folder}/{m}": m for m in layout.members}
    try:
        with tarfile.open(archive, "r:gz") as tar:
            for member in tar:
                member_name = member.name.removeprefix("./")
                if member_name in wanted and member.isfile():
                    src = tar.extractfile(member)
                    assert src is not None
                    with src, open(tmp / wanted.pop(member_name), "wb") as dst:
                        shutil.copyfileobj(src, dst)
    except (tarfile.TarError, OSError, EOFError, zlib.error) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise DataError(f"{archive}: cannot read the archive ({type(e).__name__}: {e}); "
                        "it is truncated or corrupt, download it again") from e
    if wanted:
        shutil.rmtree(tmp, ignore_errors=True)
        raise DataError(f"{archive}: the archive lacks {', '.join(sorted(wanted))}")
    return tmp


def _decode_cifar(name: str, files: dict[str, Path], scratch: Path) -> _Raw:
    layout = _CIFAR[name]
    tmp = None
    if "archive" in files:
        tmp = _extract_cifar(layout, files["archive"], scratch)
        files = {m: tmp / m for m in layout.members}
    try:
        splits = []
        for members in (layout.train, layout.test):
            parts = [_cifar_batch(files[m], layout.label_key) for m in members]
            splits += [np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])]
        classes = _cifar_names(files[layout.meta], layout.names_key, _NUM_CLASSES[name])
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return _Raw(*splits, classes)


# -------------------------------------------------------------------------------------------- SVHN


def _svhn_mat(path: Path) -> tuple[np.ndarray, np.ndarray]:
    import scipy.io

    try:
        mat = scipy.io.loadmat(path, variable_names=["X", "y"])
    except Exception as e:  # scipy raises ValueError, TypeError, OSError, ... on bad files
        raise DataError(f"{path}: cannot read MATLAB file ({type(e).__name__}: {e}); "
                        "it is truncated or corrupt, download it again") from e
    x, y = mat.get("X"), mat.get("y")
    if x is None or y is None:
        raise DataError(f"{path}: no 'X' and 'y' variables; not an SVHN cropped-digits file")
    if x.dtype != np.uint8 or x.ndim != 4 or x.shape[:3] != (32, 32, 3):
        raise DataError(f"{path}: 'X' is {x.dtype} {x.shape}, expected uint8 [32, 32, 3, N]")
    y = np.asarray(y).reshape(-1).astype(np.int64)
    if len(y) != x.shape[3]:
        raise DataError(f"{path}: {len(y)} labels for {x.shape[3]} images")
    y[y == 10] = 0  # SVHN stores the digit 0 as label 10
    return np.ascontiguousarray(x.transpose(3, 2, 0, 1)), y


def _decode_svhn(files: dict[str, Path]) -> _Raw:
    return _Raw(*_svhn_mat(files["train"]), *_svhn_mat(files["test"]), list(_DIGIT_CLASSES))


# -------------------------------------------------------------------------------------------- USPS

_USPS_SIDE = 16


def read_usps(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Parse a LIBSVM-format USPS file (bzip2-compressed or plain, detected by content).

    Each line is ``label index:value ...`` with labels 1..10 (digit = label - 1) and up to 256 features
    with indices 1..256 in increasing order and values in [-1, 1]; an absent index is 0 (the LIBSVM
    sparse convention). Pixels are ``uint8(float32((v + 1) / 2 * 255))``, truncated as torchvision's
    ``USPS`` class does, so the normalisation constants in common use apply. Returns uint8 images
    [N, 1, 16, 16] and int64 labels 0..9; a malformed line is a :class:`DataError` naming the file, the
    line number and the bad token.
    """
    path = Path(path)
    bz = False
    try:
        with open(path, "rb") as f:
            bz = f.read(3) == b"BZh"
        with (bz2.open(path, "rb") if bz else open(path, "rb")) as f:
            data = f.read()
    except (OSError, EOFError, ValueError) as e:  # bz2: OSError 'Invalid data stream', EOFError if cut
        what = "corrupt or truncated bzip2 stream" if bz else "cannot read file"
        raise DataError(f"{path}: {what} ({type(e).__name__}: {e}); download it again") from e
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: byte {e.start} is not ASCII; not a LIBSVM text file") from None
    dim = _USPS_SIDE * _USPS_SIDE
    rows: list[np.ndarray] = []
    labels: list[int] = []
    for no, line in enumerate(text.splitlines(), 1):
        tokens = line.split()
        if not tokens:
            continue
        where = f"{path}: line {no}"
        try:
            label = int(tokens[0])
        except ValueError:
            raise DataError(f"{where}: label {tokens[0][:40]!r} is not an integer 1..10") from None
        if not 1 <= label <= 10:
            raise DataError(f"{where}: label {label} is out of range; USPS labels are 1..10")
        row = np.zeros(dim, np.float32)
        last = 0
        for tok in tokens[1:]:
            idx_s, sep, val_s = tok.partition(":")
            try:
                if not sep:
                    raise ValueError
                idx, val = int(idx_s), float(val_s)
            except ValueError:
                raise DataError(f"{where}: feature {tok[:40]!r} is not index:value") from None
            if not last < idx <= dim:
                raise DataError(f"{where}: feature index {idx} is not valid: indices run 1..{dim}, "
                                f"increasing (previous {last})")
            if not -1.0 - 1e-6 <= val <= 1.0 + 1e-6:  # also refuses nan
                raise DataError(f"{where}: feature {idx} = {val_s[:40]!r} is outside [-1, 1]")
            row[idx - 1] = val
            last = idx
        rows.append(row)
        labels.append(label - 1)
    if not rows:
        raise DataError(f"{path}: no samples; the file is empty or truncated, download it again")
    x = np.clip(np.stack(rows), np.float32(-1), np.float32(1))
    pixels = ((x + np.float32(1)) / np.float32(2) * np.float32(255)).astype(np.uint8)
    return pixels.reshape(-1, 1, _USPS_SIDE, _USPS_SIDE), np.asarray(labels, np.int64)


def _decode_usps(files: dict[str, Path]) -> _Raw:
    return _Raw(*read_usps(files["train"]), *read_usps(files["test"]), list(_DIGIT_CLASSES))


# ------------------------------------------------------------------------------------------- cache


def _check_raw(name: str, raw: _Raw, where: object) -> None:
    k = _NUM_CLASSES[name]
    for split in ("train", "test"):
        x, y = getattr(raw, f"x_{split}"), getattr(raw, f"y_{split}")
        if x.dtype != np.uint8 or x.ndim != 4 or y.ndim != 1 or len(x) != len(y):
            raise DataError(f"{where}: {split} split has images {x.dtype} {x.shape} and labels {y.shape}")
        if not len(y):
            raise DataError(f"{where}: the {split} split holds no images")
        if x.shape[1:] != _IMAGE_SHAPE[name]:
            c, h, w = _IMAGE_SHAPE[name]
            raise DataError(f"{where}: {split} images are {'x'.join(map(str, x.shape[1:]))} "
                            f"(channels x height x width); {name} images are {c}x{h}x{w}")
        if y.min() < 0 or y.max() >= k:
            raise DataError(f"{where}: {split} labels must lie in 0..{k - 1}, found {y.min()}..{y.max()}")
    if len(raw.classes) != k:
        raise DataError(f"{where}: {len(raw.classes)} class names, expected {k}")


def _digest(raw: _Raw) -> str:
    h = hashlib.sha256()
    for a in (raw.x_train, raw.y_train, raw.x_test, raw.y_test):
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.data)
    h.update("\0".join(raw.classes).encode())
    return h.hexdigest()


def _cache_file(name: str, files: dict[str, Path], cache_dir: Path) -> Path:
    h = hashlib.sha256(f"fedprism-decoded-v{CACHE_VERSION}\0{name}".encode())
    for key in sorted(files):
        st = files[key].stat()
        h.update(f"\0{key}\0{files[key].name}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return cache_dir / "decoded" / f"{name}-{h.hexdigest()[:24]}.npz"


def _read_cache(path: Path, name: str) -> _Raw | None:
    """The cached arrays, or None when absent; a cache that fails any check is ignored with a warning."""
    if not path.is_file():
        return None
    try:
        with open(path, "rb") as f, np.load(f, allow_pickle=False) as z:
            raw = _Raw(z["x_train"], z["y_train"], z["x_test"], z["y_test"], [str(c) for c in z["classes"]])
            stored = str(z["digest"])
        if stored != _digest(raw):
            raise ValueError("content digest mismatch")
        _check_raw(name, raw, path)
    except Exception as e:  # zipfile.BadZipFile, KeyError, ValueError, OSError, EOFError, DataError
        warnings.warn(f"ignoring corrupt dataset cache {path} ({type(e).__name__}: {e}); rebuilding it",
                      RuntimeWarning, stacklevel=3)
        return None
    return raw


def _save_npz(path: Path, **arrays: np.ndarray) -> None:
    """Write atomically (temporary file + rename); a cache that cannot be written is only a warning."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.stem + ".", suffix=".part", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600
        os.replace(tmp, path)
        tmp = None
    except OSError as e:
        warnings.warn(f"could not write dataset cache {path}: {e}", RuntimeWarning, stacklevel=4)
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def _write_cache(path: Path, raw: _Raw) -> None:
    _save_npz(path, x_train=raw.x_train, y_train=raw.y_train, x_test=raw.x_test, y_test=raw.y_test,
              classes=np.array(raw.classes, dtype=str), digest=np.array(_digest(raw)))


# ------------------------------------------------------------------------------------------- WISDM

_WINDOW_KEYS = ("features", "labels", "users", "skipped")


def _window_digest(arrays: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256(b"wisdm-windows")
    for key in _WINDOW_KEYS:
        a = np.ascontiguousarray(arrays[key])
        h.update(f"{key}{a.dtype.str}{a.shape}".encode())
        h.update(a.data)
    return h.hexdigest()


def _check_windows(arrays: dict[str, np.ndarray], where: object) -> None:
    f, y, u = arrays["features"], arrays["labels"], arrays["users"]
    n = len(f)
    if f.dtype != np.float32 or f.ndim != 2 or f.shape[1] != 3 or y.shape != (n,) or u.shape != (n,):
        raise DataError(f"{where}: windows have features {f.dtype} {f.shape}, labels {y.shape}, "
                        f"users {u.shape}")
    if len(y) and (y.min() < 0 or y.max() >= len(_wisdm.ACTIVITIES)):
        raise DataError(f"{where}: activity labels must lie in 0..{len(_wisdm.ACTIVITIES) - 1}, "
                        f"found {y.min()}..{y.max()}")
    if not np.isfinite(f).all():
        raise DataError(f"{where}: non-finite window features")


def _read_windows_cache(path: Path) -> dict[str, np.ndarray] | None:
    """The cached windows, or None when absent; a cache that fails any check is ignored with a warning."""
    if not path.is_file():
        return None
    try:
        with open(path, "rb") as f, np.load(f, allow_pickle=False) as z:
            arrays = {k: z[k] for k in _WINDOW_KEYS}
            stored = str(z["digest"])
        if stored != _window_digest(arrays):
            raise ValueError("content digest mismatch")
        _check_windows(arrays, path)
    except Exception as e:  # zipfile.BadZipFile, KeyError, ValueError, OSError, EOFError, DataError
        warnings.warn(f"ignoring corrupt dataset cache {path} ({type(e).__name__}: {e}); rebuilding it",
                      RuntimeWarning, stacklevel=4)
        return None
    return arrays


def _wisdm_windows(files: dict[str, Path], cache: Path | None) -> dict[str, np.ndarray]:
    """1-second windows (features [m, 3], labels, users) of the raw file, through the decoded cache."""
    cfile = _cache_file("wisdm", files, cache) if cache is not None else None
    arrays = _read_windows_cache(cfile) if cfile is not None else None
    if arrays is not None:
        return arrays
    path = files.get("archive") or files["raw"]
    if "archive" in files:
        text = _wisdm.read_archive(path)
    else:
        try:
            if path.stat().st_size > _wisdm.MAX_RAW_BYTES:
                raise DataError(f"{path}: {path.stat().st_size} bytes, more than the {_wisdm.MAX_RAW_BYTES} "
                                f"accepted; not {_wisdm.RAW_FILE}")
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            raise DataError(f"{path}: cannot read file ({e.strerror or e})") from None
    users, labels, xyz, skipped = _wisdm.parse_raw(text)
    features, y, u = _wisdm.windows(users, labels, xyz)
    if len(y) == 0:
        raise DataError(f"{path}: no complete window of {_wisdm.RATE_HZ} readings of one user and activity "
                        f"({len(users)} records parsed, {skipped} skipped); not the WISDM raw data")
    arrays = {"features": features, "labels": y, "users": u, "skipped": np.array(skipped, np.int64)}
    _check_windows(arrays, path)
    if cfile is not None:
        _save_npz(cfile, **arrays, digest=np.array(_window_digest(arrays)))
    return arrays


def _load_wisdm(files: dict[str, Path], where: Path, cache: Path | None, seed: int,
                test_fraction: float) -> Dataset:
    """Windows split per user (`wisdm.split_by_user`), standardised with the training windows' per-axis
    mean and std; each window's user goes to ``groups`` / ``test_groups``."""
    arrays = _wisdm_windows(files, cache)
    x, y, users = arrays["features"], arrays["labels"], arrays["users"]
    tr, te = _wisdm.split_by_user(y, users, seed=seed, test_fraction=test_fraction)
    if len(tr) == 0:
        raise DataError(f"{where}: no training windows left with test_fraction={test_fraction} "
                        f"({len(y)} windows in all)")
    mean = x[tr].astype(np.float64).mean(axis=0)
    std = x[tr].astype(np.float64).std(axis=0)
    std[std == 0] = 1.0
    xs = ((x - mean) / std).astype(np.float32)
    return Dataset(name="wisdm",
                   x_train=torch.from_numpy(xs[tr]), y_train=torch.from_numpy(y[tr].astype(np.int64)),
                   x_test=torch.from_numpy(xs[te]), y_test=torch.from_numpy(y[te].astype(np.int64)),
                   classes=list(_wisdm.ACTIVITIES), groups=users[tr].astype(np.int64),
                   test_groups=users[te].astype(np.int64),
                   mean=tuple(float(v) for v in mean), std=tuple(float(v) for v in std),
                   source=f"{where} ({int(arrays['skipped'])} malformed records skipped)")


# ---------------------------------------------------------------------------------- to tensors


def _to_tensor(x: np.ndarray, scale: float, mean: tuple[float, ...], std: tuple[float, ...],
               pad32: bool) -> torch.Tensor:
    """[N, C, H, W] -> float32 ``(x / scale - mean) / std``, zero-padded to 32x32 first if asked."""
    t = torch.from_numpy(np.array(x, dtype=np.float32))  # a fresh, writable copy
    t.div_(scale)
    if pad32:
        n, c, h, w = t.shape
        if h > 32 or w > 32:
            raise ConfigError("data.pad32", True, f"only for images up to 32x32, these are {h}x{w}")
        top, left = (32 - h) // 2, (32 - w) // 2
        padded = torch.zeros(n, c, 32, 32, dtype=t.dtype)
        padded[:, :, top:top + h, left:left + w] = t
        t = padded
    m = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
    return t.sub_(m).div_(s)


def _images(name: str, xtr: np.ndarray, ytr: np.ndarray, xte: np.ndarray, yte: np.ndarray,
            classes: list[str], scale: float, pad32: bool, source: str) -> Dataset:
    mean, std = NORMALIZATION[name]
    return Dataset(name=name,
                   x_train=_to_tensor(xtr, scale, mean, std, pad32),
                   y_train=torch.from_numpy(np.asarray(ytr, dtype=np.int64).copy()),
                   x_test=_to_tensor(xte, scale, mean, std, pad32),
                   y_test=torch.from_numpy(np.asarray(yte, dtype=np.int64).copy()),
                   classes=list(classes), mean=mean, std=std, source=source)


# ------------------------------------------------------------------------------- bundled / generated


def _int_kw(key: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ConfigError(key, value, f"an integer >= {low}")
    return int(value)


def _float_kw(key: str, value: object, low: float, high: float | None = None,
              open_low: bool = False) -> float:
    bad = isinstance(value, bool) or not isinstance(value, (int, float, np.floating))
    if not bad:
        v = float(value)  # type: ignore[arg-type]
        bad = not np.isfinite(v) or v < low or (open_low and v == low) or (high is not None and v >= high)
    if bad:
        interval = f"{'(' if open_low else '['}{low}, {high if high is not None else 'inf'})"
        raise ConfigError(key, value, f"a number in {interval}")
    return float(value)  # type: ignore[arg-type]


def _load_digits(pad32: bool = False, seed: int = 0, test_fraction: float = 0.25) -> Dataset:
    """scikit-learn's bundled 8x8 digits (1797 images, 0..16), stratified train/test split."""
    seed = _int_kw("seed", seed, 0)
    test_fraction = _float_kw("test_fraction", test_fraction, 0.0, 1.0, open_low=True)
    from sklearn.datasets import load_digits  # imported here: sklearn takes seconds to import
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    x = bunch.images.astype(np.float32)[:, None]  # [N, 1, 8, 8], values 0..16
    y = bunch.target.astype(np.int64)
    tr, te = train_test_split(np.arange(len(y)), test_size=test_fraction, stratify=y, random_state=seed)
    tr, te = np.sort(tr), np.sort(te)
    return _images("digits", x[tr], y[tr], x[te], y[te], list(_DIGIT_CLASSES), 16.0, pad32,
                   "sklearn.datasets.load_digits")


def generate_synthetic(alpha: float = 1.0, beta: float = 1.0, num_devices: int = 30, seed: int = 0,
                       test_fraction: float = 0.2, iid: bool = False) -> Dataset:
    """FedProx's Synthetic(alpha, beta) data (Li et al. 2020): 60 features, 10 classes, natural devices.

    For device k: ``u_k ~ N(0, alpha)``, ``W_k ~ N(u_k, 1)`` [60x10], ``b_k ~ N(u_k, 1)``;
    ``B_k ~ N(0, beta)``, ``v_k ~ N(B_k, 1)`` [60], ``x ~ N(v_k, Sigma)`` with ``Sigma = diag(j^-1.2)``;
    ``y = argmax softmax(W_k x + b_k)``; ``n_k = int(lognormal(4, 2)) + 50`` samples. As in the FedProx
    generator, alpha and beta are used as standard deviations. ``iid=True`` gives Synthetic-IID (one
    global W, b; ``v_k = B_k``). Each device's samples are split ``test_fraction`` to test; the device
    ids are kept in ``groups`` / ``test_groups``. Features are left unnormalised, as in FedProx.
    """
    alpha = _float_kw("alpha", alpha, 0.0)
    beta = _float_kw("beta", beta, 0.0)
    num_devices = _int_kw("num_devices", num_devices, 1)
    seed = _int_kw("seed", seed, 0)
    test_fraction = _float_kw("test_fraction", test_fraction, 0.0, 1.0, open_low=True)
    if not isinstance(iid, bool):
        raise ConfigError("iid", iid, "true or false")

    dim, k = 60, 10
    rng = np.random.default_rng(seed)
    sizes = rng.lognormal(4, 2, num_devices).astype(np.int64) + 50
    u = rng.normal(0.0, alpha, num_devices)
    big_b = rng.normal(0.0, beta, num_devices)
    sd = np.arange(1, dim + 1, dtype=np.float64) ** (-1.2 / 2)  # sqrt of the diagonal covariance
    if iid:
        w_global, b_global = rng.normal(0.0, 1.0, (dim, k)), rng.normal(0.0, 1.0, k)
    parts: dict[str, list[np.ndarray]] = {key: [] for key in ("xtr", "ytr", "gtr", "xte", "yte", "gte")}
    for dev in range(num_devices):
        v = np.full(dim, big_b[dev]) if iid else rng.normal(big_b[dev], 1.0, dim)
        if iid:
            w, b = w_global, b_global
        else:
            w, b = rng.normal(u[dev], 1.0, (dim, k)), rng.normal(u[dev], 1.0, k)
        n = int(sizes[dev])
        x = v + rng.standard_normal((n, dim)) * sd
        y = np.argmax(x @ w + b, axis=1)  # argmax of softmax = argmax of the logits
        order = rng.permutation(n)
        n_test = int(round(test_fraction * n))
        te, tr = order[:n_test], order[n_test:]
        for tag, idx in (("tr", tr), ("te", te)):
            parts["x" + tag].append(x[idx])
            parts["y" + tag].append(y[idx])
            parts["g" + tag].append(np.full(len(idx), dev, dtype=np.int64))
    cat = {key: np.concatenate(v) for key, v in parts.items()}
    return Dataset(
        name="synthetic",
        x_train=torch.from_numpy(cat["xtr"].astype(np.float32)),
        y_train=torch.from_numpy(cat["ytr"].astype(np.int64)),
        x_test=torch.from_numpy(cat["xte"].astype(np.float32)),
        y_test=torch.from_numpy(cat["yte"].astype(np.int64)),
        classes=list(_DIGIT_CLASSES),
        groups=cat["gtr"],
        test_groups=cat["gte"],
        source=f"synthetic(alpha={alpha}, beta={beta}, num_devices={num_devices}, seed={seed}, iid={iid})",
    )


# ------------------------------------------------------------------------------------------ entry

_OPTIONS: dict[str, tuple[str, ...]] = {
    "digits": ("seed", "test_fraction"),
    "synthetic": ("alpha", "beta", "num_devices", "seed", "test_fraction", "iid"),
    "wisdm": ("seed", "test_fraction"),
}


def _decoder(name: str, scratch: Path) -> Callable[[dict[str, Path]], _Raw]:
    if name == "fmnist":
        return lambda files: _decode_idx(files, FMNIST_CLASSES)
    if name == "mnist":
        return lambda files: _decode_idx(files, _DIGIT_CLASSES)
    if name in _CIFAR:
        return lambda files: _decode_cifar(name, files, scratch)
    if name == "usps":
        return _decode_usps
    return _decode_svhn


def load_dataset(name: str, root: str | Path | None = None, download: bool = False, pad32: bool = False,
                 cache_dir: str | Path | None | bool = None, **kw: object) -> Dataset:
    """Load dataset ``name`` (one of :data:`DATASETS`) as normalised tensors, offline.

    Files are looked for in :func:`search_paths`; when none holds a complete copy, ``download=True``
    fetches the official files first, otherwise a :class:`DataError` lists every folder looked at and
    the command that gets the data. ``pad32=True`` zero-pads smaller images to 32x32 (28x28: 2 pixels
    each side) *before* normalising, so the padding equals the black background (for LeNet-5 on
    FMNIST, FedPrism paper 4.3). ``cache_dir`` holds the decoded-array cache and the temporary CIFAR
    extraction (default ``$FEDPRISM_CACHE`` or ``~/.cache/fedprism``; ``False`` disables the cache).
    ``digits`` and ``synthetic`` are built in and read no files: a ``root`` is only warned about.
    Extra options: ``digits`` takes ``seed``, ``test_fraction``; ``synthetic`` takes those of
    :func:`generate_synthetic`; ``wisdm`` takes ``seed`` (0) and ``test_fraction`` (0.2) of its per-user
    split (:func:`fedprism.data.wisdm.split_by_user`).
    """
    name = _check_name(name)
    for key, value in (("download", download), ("pad32", pad32)):
        if not isinstance(value, bool):
            raise ConfigError(key, value, "true or false")
    allowed = _OPTIONS.get(name, ())
    for key, value in kw.items():
        if key not in allowed:
            opts = f"only {', '.join(allowed)}" if allowed else "no extra options"
            raise ConfigError(key, value, f"dataset '{name}' takes {opts}")
    if root is not None and name in ("digits", "synthetic"):
        warnings.warn(f"dataset {name} is built in (no files): data.root {str(root)!r} is not read",
                      UserWarning, stacklevel=2)
    if name == "digits":
        return _load_digits(pad32=pad32, **kw)  # type: ignore[arg-type]
    if name == "synthetic":
        if pad32:
            raise ConfigError("data.pad32", pad32, "false for the synthetic (tabular) dataset")
        return generate_synthetic(**kw)  # type: ignore[arg-type]
    if name == "wisdm":
        if pad32:
            raise ConfigError("data.pad32", pad32, "false for the wisdm (tabular) dataset")
        split = {"seed": _int_kw("seed", kw.get("seed", 0), 0),
                 "test_fraction": _float_kw("test_fraction", kw.get("test_fraction", 0.2), 0.0, 1.0,
                                            open_low=True)}

    try:
        found = _locate(name, root)
    except DataError:                             # an explicit data.root without the files
        if not download:
            raise
        found = []
    if isinstance(found, list) and download:
        _download.download(name, root)            # into data.root when one is named, else the cache
        found = _locate(name, root)
    if isinstance(found, list):
        raise _missing_error(name, found)
    files, where = found
    integrity = _integrity.verify(name, files)    # before the decoded cache: it is keyed by size and mtime

    if cache_dir is False:
        cache = None
    elif cache_dir is None or cache_dir is True:
        cache = _download.cache_root()
    else:
        cache = Path(cache_dir).expanduser()
    if name == "wisdm":
        ds = _load_wisdm(files, where, cache, **split)
        ds.integrity = integrity
        return ds
    scratch = cache if cache is not None else Path(tempfile.gettempdir())
    cfile = _cache_file(name, files, cache) if cache is not None else None
    raw = _read_cache(cfile, name) if cfile is not None else None
    if raw is None:
        raw = _decoder(name, scratch)(files)
        _check_raw(name, raw, where)
        if cfile is not None:
            _write_cache(cfile, raw)
    ds = _images(name, raw.x_train, raw.y_train, raw.x_test, raw.y_test, raw.classes, 255.0, pad32, str(where))
    ds.integrity = integrity
    return ds
