"""scikit-learn's bundled copy of the UCI optical handwritten digits (Alpaydin, Kaynak 1998): 1 797 8x8
greyscale images with values 0..16, no files to read. A seeded stratified split gives train and test."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedprism.data.base import DATASETS, DatasetSpec, float_option, int_option
from fedprism.data.files import ignore_root, images
from fedprism.data.formats import DIGIT_CLASSES


def load(pad32: bool = False, root: str | Path | None = None, *, seed: int = 0, test_fraction: float = 0.25):
    """The 1797 digits (values 0..16, scaled by 16), a stratified train/test split seeded by ``seed``."""
    ignore_root(SPEC.name, root)
    seed = int_option("seed", seed, 0)
    test_fraction = float_option("test_fraction", test_fraction, 0.0, 1.0, open_low=True)
    from sklearn.datasets import load_digits  # imported here: sklearn takes seconds to import
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    x = bunch.images.astype(np.float32)[:, None]  # [N, 1, 8, 8], values 0..16
    y = bunch.target.astype(np.int64)
    tr, te = train_test_split(np.arange(len(y)), test_size=test_fraction, stratify=y, random_state=seed)
    tr, te = np.sort(tr), np.sort(te)
    return images(SPEC, x[tr], y[tr], x[te], y[te], list(DIGIT_CLASSES), 16.0, pad32,
                  "sklearn.datasets.load_digits")


SPEC = DATASETS.register(DatasetSpec(
    name="digits",
    load=load,
    summary="scikit-learn's bundled 8x8 digits (values 0..16), 1 797 images, split 75/25 by seed; no files",
    class_names=DIGIT_CLASSES,
    input_shape=(1, 8, 8),
    mean=(0.3053,), std=(0.3760,),            # of images / 16 over all 1797 digits
    options=("seed", "test_fraction"),
))
