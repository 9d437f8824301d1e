"""File formats of the built-in datasets, decoded with numpy and scipy only, each checked as it is read.

* IDX (MNIST, Fashion-MNIST): :func:`read_idx`, gzip-compressed or raw; magic number, dimensions and
  length checked.
* CIFAR "python version" batches: read through :class:`CifarUnpickler`, which refuses every global
  except the few numpy constructors those files need, only from the expected member names
  (:class:`CifarLayout`), extracted from the archive into a temporary folder.
* SVHN cropped digits (MATLAB ``.mat``): :func:`read_svhn_mat`.
* LIBSVM text (USPS): :func:`read_usps`, bzip2-compressed or plain.

Every malformed input is a :class:`fedprism.errors.DataError` naming the file and what is wrong. A
dataset module combines these with :func:`find_each` (which of a folder's files are there) into its
``FileSet`` and decoder.
"""

from __future__ import annotations

import bz2
import codecs
import gzip
import pickle
import shutil
import tarfile
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedprism.data.cache import Raw
from fedprism.errors import DataError

__all__ = ["IDX_FILES", "CifarLayout", "CifarUnpickler", "decode_cifar", "decode_idx", "find_cifar", "find_each",
           "parse_idx", "read_idx", "read_svhn_mat", "read_usps"]

DIGIT_CLASSES = tuple(str(i) for i in range(10))
"""The class names of the digit datasets: '0'..'9'."""


def find_each(d: Path, files: dict[str, str], ext: str, none: str) -> dict[str, Path] | str:
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


# --------------------------------------------------------------------------------------------- IDX

IDX_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
"""The four IDX files of MNIST and Fashion-MNIST (key -> base name; ``.gz`` or plain)."""


def find_idx(d: Path) -> dict[str, Path] | str:
    return find_each(d, IDX_FILES, ".gz", "no IDX files")


IDX_NEEDED = ", ".join(f"{b}[.gz]" for b in IDX_FILES.values())

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
    return parse_idx(data, path, ndim)


def parse_idx(data: bytes, path: object, ndim: int | None = None) -> np.ndarray:
    """The array of IDX bytes ``data`` (already decompressed), checked as :func:`read_idx` checks a file;
    ``path`` names where the bytes came from in errors (a file, or an archive member)."""
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


def decode_idx(files: dict[str, Path], classes: tuple[str, ...]) -> Raw:
    out = {}
    for split in ("train", "test"):
        ipath, lpath = files[f"{split}_images"], files[f"{split}_labels"]
        images, labels = read_idx(ipath, ndim=3), read_idx(lpath, ndim=1)
        if len(labels) != len(images):
            raise DataError(f"{lpath} has {len(labels)} labels but {ipath} has {len(images)} images; "
                            "the files do not belong together")
        out[split] = (images[:, None], labels.astype(np.int64))
    return Raw(*out["train"], *out["test"], list(classes))


# ------------------------------------------------------------------------------------------- CIFAR


@dataclass(frozen=True)
class CifarLayout:
    """Where a CIFAR "python version" archive keeps its batches and which keys hold labels and names."""

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

    @property
    def needed(self) -> str:
        return f"{self.archive}, or the folder {self.folder}/ with {', '.join(self.members)}"


def find_cifar(layout: CifarLayout, d: Path) -> dict[str, Path] | str:
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

_NP_RECONSTRUCT = np.zeros(1).__reduce__()[0]  # numpy's ndarray._reconstruct, whatever its module
_PICKLE_GLOBALS: dict[tuple[str, str], object] = {
    ("numpy.core.multiarray", "_reconstruct"): _NP_RECONSTRUCT,
    ("numpy._core.multiarray", "_reconstruct"): _NP_RECONSTRUCT,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("_codecs", "encode"): codecs.encode,
}


class CifarUnpickler(pickle.Unpickler):
    """Unpickler for the official CIFAR batches: numpy arrays, lists, dicts and strings, nothing else."""

    def find_class(self, module: str, name: str) -> object:
        try:
            return _PICKLE_GLOBALS[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"refusing global {module}.{name} (not in a CIFAR batch)") from None


def _load_pickle(path: Path) -> dict[bytes, object]:
    try:
        with open(path, "rb") as f:
            obj = CifarUnpickler(f, encoding="bytes").load()
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


def _extract_cifar(layout: CifarLayout, archive: Path, into: Path) -> Path:
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


def decode_cifar(layout: CifarLayout, num_classes: int, files: dict[str, Path], scratch: Path) -> Raw:
    """The batches of `files` (the members, or the archive, extracted into a temporary folder of
    `scratch` and removed afterwards)."""
    tmp = None
    if "archive" in files:
        tmp = _extract_cifar(layout, files["archive"], scratch)
        files = {m: tmp / m for m in layout.members}
    try:
        splits = []
        for members in (layout.train, layout.test):
            parts = [_cifar_batch(files[m], layout.label_key) for m in members]
            splits += [np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])]
        classes = _cifar_names(files[layout.meta], layout.names_key, num_classes)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return Raw(*splits, classes)


# -------------------------------------------------------------------------------------------- SVHN


def read_svhn_mat(path: Path) -> tuple[np.ndarray, np.ndarray]:
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
