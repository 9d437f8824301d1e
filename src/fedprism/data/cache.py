"""The decoded-array cache: ``.npz`` files under ``<cache_dir>/decoded/`` that carry a SHA-256 of their
own content.

A dataset read from files is decoded once; the decoded arrays are saved keyed by the dataset name and
the names, sizes and mtimes of the source files (:func:`cache_file`), so a changed file gives a new key.
A cache file that fails to load or to verify is ignored with a warning and rebuilt, never trusted
silently; one that cannot be written is only a warning. Files are written atomically (a temporary file,
then a rename) and read with ``allow_pickle=False``.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["CACHE_VERSION", "Raw", "cache_file", "digest", "read_cache", "write_cache", "save_npz", "load_npz"]

CACHE_VERSION = 1


@dataclass
class Raw:
    """Decoded arrays as stored in the cache: uint8 images [N, C, H, W] (or int64 token ids [N, seq_len],
    `fedprism.data.files.load_tokens`) and int64 labels."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    classes: list[str]


def digest(raw: Raw) -> str:
    """SHA-256 of the arrays (dtype, shape and bytes) and class names."""
    h = hashlib.sha256()
    for a in (raw.x_train, raw.y_train, raw.x_test, raw.y_test):
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.data)
    h.update("\0".join(raw.classes).encode())
    return h.hexdigest()


def cache_file(name: str, files: dict[str, Path], cache_dir: Path) -> Path:
    """``<cache_dir>/decoded/<name>-<24 hex digits>.npz``, keyed by the dataset name and each source file's
    key, name, size and mtime."""
    h = hashlib.sha256(f"fedprism-decoded-v{CACHE_VERSION}\0{name}".encode())
    for key in sorted(files):
        st = files[key].stat()
        h.update(f"\0{key}\0{files[key].name}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return cache_dir / "decoded" / f"{name}-{h.hexdigest()[:24]}.npz"


def load_npz(path: Path, keys: tuple[str, ...], digest_of: Callable[[dict[str, np.ndarray]], str],
             check: Callable[[dict[str, np.ndarray], Path], None]) -> dict[str, np.ndarray] | None:
    """The arrays ``keys`` of the cache file ``path``, or None when it is absent; a file that fails to load,
    whose stored ``digest`` differs from ``digest_of(arrays)`` or that fails ``check`` is ignored with a
    warning."""
    if not path.is_file():
        return None
    try:
        with open(path, "rb") as f, np.load(f, allow_pickle=False) as z:
            arrays = {k: z[k] for k in keys}
            stored = str(z["digest"])
        if stored != digest_of(arrays):
            raise ValueError("content digest mismatch")
        check(arrays, path)
    except Exception as e:  # zipfile.BadZipFile, KeyError, ValueError, OSError, EOFError, DataError
        warnings.warn(f"ignoring corrupt dataset cache {path} ({type(e).__name__}: {e}); rebuilding it",
                      RuntimeWarning, stacklevel=4)
        return None
    return arrays


def save_npz(path: Path, **arrays: np.ndarray) -> None:
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


_RAW_KEYS = ("x_train", "y_train", "x_test", "y_test", "classes")


def _raw(arrays: dict[str, np.ndarray]) -> Raw:
    return Raw(arrays["x_train"], arrays["y_train"], arrays["x_test"], arrays["y_test"],
               [str(c) for c in arrays["classes"]])


def read_cache(path: Path, check: Callable[[Raw, object], None]) -> Raw | None:
    """The cached decoded arrays, or None when absent or failing the digest or ``check(raw, path)``."""
    arrays = load_npz(path, _RAW_KEYS, lambda a: digest(_raw(a)), lambda a, p: check(_raw(a), p))
    return None if arrays is None else _raw(arrays)


def write_cache(path: Path, raw: Raw) -> None:
    save_npz(path, x_train=raw.x_train, y_train=raw.y_train, x_test=raw.x_test, y_test=raw.y_test,
             classes=np.array(raw.classes, dtype=str), digest=np.array(digest(raw)))


def arrays_digest(tag: str, keys: tuple[str, ...]):
    """``digest(arrays)``: the SHA-256 of ``tag`` and, for each of ``keys`` in order, the array's dtype,
    shape and bytes: the content digest a decoded-array cache file is saved with and checked against
    (``save_npz`` / ``load_npz``)."""
    import hashlib

    import numpy as np

    def digest(arrays) -> str:
        h = hashlib.sha256(tag.encode())
        for key in keys:
            a = np.ascontiguousarray(arrays[key])
            h.update(f"{key}{a.dtype.str}{a.shape}".encode())
            h.update(a.tobytes())
        return h.hexdigest()
    return digest
