"""Finding, verifying and caching a dataset's files, once for every dataset read from files.

A dataset's :class:`fedprism.data.base.FileSet` says which files make a complete copy; this module
looks for one in :func:`search_paths` (never the network unless ``download=True``), checks every file
against its known digest (:mod:`fedprism.data.integrity`) and, for images, goes through the decoded-array
cache (:mod:`fedprism.data.cache`) and normalises (:func:`images`); token data (text) goes through the same
cache as int64 ids, unnormalised (:func:`load_tokens`). A folder named by ``data.root`` that
lacks the files is an error, never silently passed over; when no folder holds them, the error lists
every folder looked at, why each did not match, and how to get the files.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fedprism.data import download as _download
from fedprism.data import integrity as _integrity
from fedprism.data.base import Dataset, DatasetSpec
from fedprism.data.cache import Raw, cache_file, read_cache, write_cache
from fedprism.errors import ConfigError, DataError

if TYPE_CHECKING:      # torch is imported where tensors are made: finding files needs none
    import torch

__all__ = ["search_paths", "locate", "read_files", "load_images", "images", "to_tensor", "check_raw",
           "load_tokens", "check_token_raw", "ignore_root"]


def search_paths(spec: DatasetSpec, root: str | Path | None = None) -> list[Path]:
    """Folders searched for the dataset, in order: ``root`` if given, ``$FEDPRISM_DATA/<name>``,
    ``$FEDPRISM_DATA``, the spec's own ``files.folders``, then the download folder
    ``<cache root>/data/<name>`` (``~/.cache/fedprism/data/<name>`` unless ``$FEDPRISM_CACHE`` is set)."""
    name = spec.name
    paths: list[Path] = []
    if root is not None:
        if not isinstance(root, (str, os.PathLike)):
            raise ConfigError("root", root, "a folder path")
        paths.append(Path(root).expanduser())
    env = os.environ.get("FEDPRISM_DATA")
    if env:
        paths += [Path(env).expanduser() / name, Path(env).expanduser()]
    if spec.files is not None:
        paths += list(spec.files.folders)
    paths.append(_download.download_dir(name))
    unique: list[Path] = []
    for p in paths:
        if p not in unique:
            unique.append(p)
    return unique


def locate(spec: DatasetSpec, root: str | Path | None) -> tuple[dict[str, Path], Path] | list[tuple[Path, str]]:
    """The first folder holding a complete copy, or every folder looked at with why it did not match."""
    assert spec.files is not None, f"dataset {spec.name} reads no files"
    name, needed = spec.name, spec.files.needed
    looked: list[tuple[Path, str]] = []
    for d in search_paths(spec, root):
        found = spec.files.find(d) if d.is_dir() else "no such folder"
        if isinstance(found, dict):
            return found, d
        if root is not None and not looked:       # an explicit data.root is never silently passed over
            raise DataError(f"data.root {d} does not hold dataset '{name}' ({found}); needed: {needed}. "
                            "Fix data.root, leave it empty to search the default locations, or add "
                            "data.download=true to download it into data.root")
        looked.append((d, found))
    return looked


def missing_error(spec: DatasetSpec, looked: list[tuple[Path, str]]) -> DataError:
    assert spec.files is not None
    name = spec.name
    lines = [f"dataset '{name}' not found. Looked in:"]
    lines += [f"  - {p}  ({why})" for p, why in looked]
    lines.append(f"Needed files: {spec.files.needed}.")
    if spec.files.trust_on_first_use:
        lines.append("Download them (no checksum is published: the first download is recorded and later "
                     f"ones are checked against it) with:\n    fedprism data download {name}")
    elif spec.files.remote:
        lines.append(f"Download them (checksum-verified) with:\n    fedprism data download {name}")
    if spec.files.hint:
        lines.append(f"or, {spec.files.hint}")
    lines.append("or copy them into one of the folders above (set $FEDPRISM_DATA or pass data.root=...).")
    return DataError("\n".join(lines))


def read_files(spec: DatasetSpec, root: str | Path | None, download: bool, cache_dir: str | Path | None | bool
               ) -> tuple[dict[str, Path], Path, dict[str, str], Path | None]:
    """(files, the folder they are in, their integrity status, the cache folder or None): located,
    downloaded first when ``download`` and no folder holds them, and verified."""
    try:
        found = locate(spec, root)
    except DataError:                             # an explicit data.root without the files
        if not download:
            raise
        found = []
    if isinstance(found, list) and download:
        _download.download(spec.name, root)       # into data.root when one is named, else the cache
        found = locate(spec, root)
    if isinstance(found, list):
        raise missing_error(spec, found)
    files, where = found
    integrity = _integrity.verify(spec.name, files)   # before the decoded cache: it is keyed by size and mtime
    if cache_dir is False:
        cache = None
    elif cache_dir is None or cache_dir is True:
        cache = _download.cache_root()
    else:
        cache = Path(cache_dir).expanduser()
    return files, where, integrity, cache


def check_raw(spec: DatasetSpec, raw: Raw, where: object) -> None:
    """Decoded arrays are the spec's: uint8 images of its shape, labels in 0..classes-1, its class count."""
    k, shape = spec.num_classes, spec.input_shape
    for split in ("train", "test"):
        x, y = getattr(raw, f"x_{split}"), getattr(raw, f"y_{split}")
        if x.dtype != np.uint8 or x.ndim != 4 or y.ndim != 1 or len(x) != len(y):
            raise DataError(f"{where}: {split} split has images {x.dtype} {x.shape} and labels {y.shape}")
        if not len(y):
            raise DataError(f"{where}: the {split} split holds no images")
        if x.shape[1:] != shape:
            c, h, w = shape
            raise DataError(f"{where}: {split} images are {'x'.join(map(str, x.shape[1:]))} "
                            f"(channels x height x width); {spec.name} images are {c}x{h}x{w}")
        if y.min() < 0 or y.max() >= k:
            raise DataError(f"{where}: {split} labels must lie in 0..{k - 1}, found {y.min()}..{y.max()}")
    if len(raw.classes) != k:
        raise DataError(f"{where}: {len(raw.classes)} class names, expected {k}")


def load_images(spec: DatasetSpec, decode: Callable[[dict[str, Path], Path], Raw], pad32: bool,
                root: str | Path | None, download: bool, cache_dir: str | Path | None | bool) -> Dataset:
    """An image dataset read from files: located, verified, decoded by ``decode(files, scratch)`` (or read
    from the decoded cache), checked against the spec and normalised with its mean and std."""
    files, where, integrity, cache = read_files(spec, root, download, cache_dir)
    scratch = cache if cache is not None else Path(tempfile.gettempdir())
    cfile = cache_file(spec.name, files, cache) if cache is not None else None
    raw = read_cache(cfile, lambda r, p: check_raw(spec, r, p)) if cfile is not None else None
    if raw is None:
        raw = decode(files, scratch)
        check_raw(spec, raw, where)
        if cfile is not None:
            write_cache(cfile, raw)
    ds = images(spec, raw.x_train, raw.y_train, raw.x_test, raw.y_test, raw.classes, 255.0, pad32, str(where))
    ds.integrity = integrity
    return ds


def to_tensor(x: np.ndarray, scale: float, mean: tuple[float, ...], std: tuple[float, ...],
              pad32: bool) -> torch.Tensor:
    """[N, C, H, W] -> float32 ``(x / scale - mean) / std``, zero-padded to 32x32 first if asked."""
    import torch

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


def images(spec: DatasetSpec, xtr: np.ndarray, ytr: np.ndarray, xte: np.ndarray, yte: np.ndarray,
           classes: list[str], scale: float, pad32: bool, source: str) -> Dataset:
    """A Dataset of images ``x`` (uint8 or float [N, C, H, W]) normalised with the spec's mean and std."""
    import torch

    mean, std = spec.mean, spec.std
    return Dataset(name=spec.name,
                   x_train=to_tensor(xtr, scale, mean, std, pad32),
                   y_train=torch.from_numpy(np.asarray(ytr, dtype=np.int64).copy()),
                   x_test=to_tensor(xte, scale, mean, std, pad32),
                   y_test=torch.from_numpy(np.asarray(yte, dtype=np.int64).copy()),
                   classes=list(classes), mean=mean, std=std, source=source)


def check_token_raw(spec: DatasetSpec, raw: Raw, where: object) -> None:
    """Decoded token arrays are the spec's: int64 ``[n, seq_len]`` ids in 0..vocab_size-1 (the spec's
    ``input_shape`` ``(seq_len,)`` when declared), labels in 0..classes-1, its class count."""
    k, shape, vocab = spec.num_classes, spec.input_shape, spec.vocab_size
    for split in ("train", "test"):
        x, y = getattr(raw, f"x_{split}"), getattr(raw, f"y_{split}")
        if x.dtype != np.int64 or x.ndim != 2 or y.ndim != 1 or len(x) != len(y):
            raise DataError(f"{where}: {split} split has token ids {x.dtype} {x.shape} and labels {y.shape}; "
                            "expected int64 [samples, seq_len] and one label per sample")
        if not len(y):
            raise DataError(f"{where}: the {split} split holds no samples")
        if shape is not None and x.shape[1:] != shape:
            raise DataError(f"{where}: {split} sequences have {x.shape[1]} tokens; {spec.name} sequences have "
                            f"{shape[0]}")
        if x.min() < 0 or x.max() >= vocab:
            raise DataError(f"{where}: {split} token ids must lie in 0..{vocab - 1} (vocab_size {vocab}), found "
                            f"{x.min()}..{x.max()}")
        if k is not None and (y.min() < 0 or y.max() >= k):
            raise DataError(f"{where}: {split} labels must lie in 0..{k - 1}, found {y.min()}..{y.max()}")
    if k is not None and len(raw.classes) != k:
        raise DataError(f"{where}: {len(raw.classes)} class names, expected {k}")


def load_tokens(spec: DatasetSpec, decode: Callable[[dict[str, Path], Path], Raw], root: str | Path | None,
                download: bool, cache_dir: str | Path | None | bool) -> Dataset:
    """A token dataset read from files (``spec.vocab_size`` > 0): located, verified, decoded by
    ``decode(files, scratch)`` into int64 ids (or read from the decoded cache, which keeps the int64 arrays
    as they are), checked against the spec (:func:`check_token_raw`) and returned unnormalised."""
    import torch

    if not spec.vocab_size:
        raise ValueError(f"dataset {spec.name!r}: load_tokens is for token data (a spec with vocab_size > 0)")
    files, where, integrity, cache = read_files(spec, root, download, cache_dir)
    scratch = cache if cache is not None else Path(tempfile.gettempdir())
    cfile = cache_file(spec.name, files, cache) if cache is not None else None
    raw = read_cache(cfile, lambda r, p: check_token_raw(spec, r, p)) if cfile is not None else None
    if raw is None:
        raw = decode(files, scratch)
        check_token_raw(spec, raw, where)
        if cfile is not None:
            write_cache(cfile, raw)

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.asarray(a, dtype=np.int64).copy())

    return Dataset(name=spec.name, x_train=t(raw.x_train), y_train=t(raw.y_train), x_test=t(raw.x_test),
                   y_test=t(raw.y_test), classes=list(raw.classes), source=str(where), integrity=integrity,
                   vocab_size=spec.vocab_size)


def ignore_root(name: str, root: str | Path | None) -> None:
    """Warn that a dataset with no files (bundled or generated) does not read ``data.root``."""
    if root is not None:
        warnings.warn(f"dataset {name} is built in (no files): data.root {str(root)!r} is not read",
                      UserWarning, stacklevel=4)
