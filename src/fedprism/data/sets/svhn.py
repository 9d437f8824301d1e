"""SVHN cropped digits (Netzer et al. 2011, "Reading digits in natural images with unsupervised feature
learning"): 32x32 colour house-number digits from the official ``train_32x32.mat`` / ``test_32x32.mat``
(the extra set is not read); the digit 0, stored as label 10, becomes label 0."""

from __future__ import annotations

from pathlib import Path

from fedprism.data.base import DATASETS, DatasetSpec, FileSet
from fedprism.data.cache import Raw
from fedprism.data.download import mirrored
from fedprism.data.files import load_images
from fedprism.data.formats import DIGIT_CLASSES, read_svhn_mat

FILES = {"train": "train_32x32.mat", "test": "test_32x32.mat"}
_MIRROR = ("http://ufldl.stanford.edu/housenumbers/",)


def find(d: Path) -> dict[str, Path] | str:
    missing = [f for f in FILES.values() if not (d / f).is_file()]
    if len(missing) == len(FILES):
        return "no .mat files"
    if missing:
        return f"incomplete: missing {', '.join(missing)}"
    return {k: d / f for k, f in FILES.items()}


def decode(files: dict[str, Path], scratch: Path) -> Raw:
    return Raw(*read_svhn_mat(files["train"]), *read_svhn_mat(files["test"]), list(DIGIT_CLASSES))


def load(pad32: bool = False, root: str | Path | None = None, *, download: bool = False,
         cache_dir: str | Path | None | bool = None):
    return load_images(SPEC, decode, pad32, root, download, cache_dir)


SPEC = DATASETS.register(DatasetSpec(
    name="svhn",
    load=load,
    summary="SVHN cropped digits: 32x32 colour, 73 257 train / 26 032 test (Netzer et al. 2011)",
    class_names=DIGIT_CLASSES,
    input_shape=(3, 32, 32),
    mean=(0.4377, 0.4438, 0.4728), std=(0.1980, 0.2010, 0.1970),
    files=FileSet(
        find=find,
        needed=", ".join(FILES.values()),
        remote=(mirrored("train_32x32.mat", _MIRROR,
                         "435e94d69a87fde4fd4d7f3dd208dfc32cb6ae8af2240d066de1df7508d083b8",
                         "e26dedcc434d2e4c54c9b2d4a06d8373"),
                mirrored("test_32x32.mat", _MIRROR,
                         "cdce80dfb2a2c4c6160906d0bd7c68ec5a99d7ca4831afa54f09182025b6a75b",
                         "eb5a983be6a315427106f1b164d9cef3")),
    ),
))
