"""scikit-learn's bundled copy of the UCI optical handwritten digits (Alpaydin, Kaynak 1998): 1 797 8x8
greyscale images with values 0..16, no files to read. A seeded stratified split gives train and test."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedprism.data import download as _download
from fedprism.data.base import DATASETS, DatasetSpec, float_option, int_option
from fedprism.data.cache import Raw, cache_file, read_cache, write_cache
from fedprism.data.files import ignore_root, images
from fedprism.data.formats import DIGIT_CLASSES


def load(pad32: bool = False, root: str | Path | None = None, *, seed: int = 0, test_fraction: float = 0.25,
         cache_dir: str | Path | None | bool = None):
    """The 1797 digits (values 0..16, scaled by 16), a stratified train/test split seeded by ``seed``.
    ``cache_dir`` holds the split (`split`; ``False``: no cache)."""
    ignore_root(SPEC.name, root)
    seed = int_option("seed", seed, 0)
    test_fraction = float_option("test_fraction", test_fraction, 0.0, 1.0, open_low=True)
    raw = split(seed, test_fraction, cache_dir)
    return images(SPEC, raw.x_train, raw.y_train, raw.x_test, raw.y_test, list(DIGIT_CLASSES), 16.0, pad32,
                  "sklearn.datasets.load_digits")


def split(seed: int, test_fraction: float, cache_dir: str | Path | None | bool = None) -> Raw:
    """scikit-learn's digits split by ``train_test_split`` (stratified, ``random_state=seed``), read from the
    decoded-array cache (`fedprism.data.cache`) when it holds it: importing scikit-learn, and scipy with
    it, takes longer than a short run on digits (bench/startup.py). The cache key holds scikit-learn's
    bundled file and its package file (name, size, modification time: another installation is another
    key), numpy's version, the seed and the test fraction; a cached split is the same arrays, bit for bit,
    verified by their digest when read."""
    path = None if cache_dir is False else _split_file(seed, test_fraction, cache_dir)
    if path is not None:
        raw = read_cache(path, _check_split)
        if raw is not None:
            return raw
    from sklearn.datasets import load_digits  # imported here: sklearn takes seconds to import
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    x = bunch.images.astype(np.float32)[:, None]  # [N, 1, 8, 8], values 0..16
    y = bunch.target.astype(np.int64)
    tr, te = train_test_split(np.arange(len(y)), test_size=test_fraction, stratify=y, random_state=seed)
    tr, te = np.sort(tr), np.sort(te)
    raw = Raw(x[tr], y[tr], x[te], y[te], list(DIGIT_CLASSES))
    if path is not None:
        write_cache(path, raw)
    return raw


def _split_file(seed: int, test_fraction: float, cache_dir: str | Path | None | bool) -> Path | None:
    """Where the split of (seed, test_fraction) is cached, or None when scikit-learn's files are not found
    without importing it (then nothing is cached)."""
    import importlib.util

    try:
        found = importlib.util.find_spec("sklearn")
    except (ImportError, ValueError):
        return None
    if found is None or not found.origin:
        return None
    package = Path(found.origin)
    files = {"package": package, "digits": package.parent / "datasets" / "data" / "digits.csv.gz"}
    if not all(f.is_file() for f in files.values()):
        return None
    folder = _download.cache_root() if cache_dir is None or cache_dir is True else Path(cache_dir).expanduser()
    return cache_file(f"digits-split-{seed}-{test_fraction!r}-numpy{np.__version__}", files, folder)


def _check_split(raw: Raw, where: object) -> None:
    n_tr, n_te = len(raw.y_train), len(raw.y_test)
    if (raw.x_train.shape[1:] != (1, 8, 8) or raw.x_test.shape[1:] != (1, 8, 8) or len(raw.x_train) != n_tr
            or len(raw.x_test) != n_te or n_tr + n_te != 1797 or list(raw.classes) != list(DIGIT_CLASSES)):
        raise ValueError(f"{where}: not a split of the 1797 digits")


SPEC = DATASETS.register(DatasetSpec(
    name="digits",
    load=load,
    summary="scikit-learn's bundled 8x8 digits (values 0..16), 1 797 images, split 75/25 by seed; no files",
    class_names=DIGIT_CLASSES,
    input_shape=(1, 8, 8),
    mean=(0.3053,), std=(0.3760,),            # of images / 16 over all 1797 digits
    options=("seed", "test_fraction"),
))
