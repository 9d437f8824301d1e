"""CIFAR-10 (Krizhevsky 2009, "Learning multiple layers of features from tiny images"): 60 000 32x32
colour images of ten classes, from the official "python version" archive (read through the restricted
unpickler of :mod:`fedprism.data.formats`; the class names come from its ``batches.meta``)."""

from __future__ import annotations

from pathlib import Path

from fedprism.data.base import DATASETS, DatasetSpec, FileSet
from fedprism.data.download import mirrored
from fedprism.data.files import load_images
from fedprism.data.formats import CifarLayout, decode_cifar, find_cifar

LAYOUT = CifarLayout("cifar-10-batches-py", "cifar-10-python.tar.gz", tuple(f"data_batch_{i}" for i in range(1, 6)),
                     ("test_batch",), "batches.meta", b"labels", b"label_names")


def load(pad32: bool = False, root: str | Path | None = None, *, download: bool = False,
         cache_dir: str | Path | None | bool = None):
    return load_images(SPEC, lambda files, scratch: decode_cifar(LAYOUT, SPEC.num_classes, files, scratch),
                       pad32, root, download, cache_dir)


SPEC = DATASETS.register(DatasetSpec(
    name="cifar10",
    load=load,
    summary="CIFAR-10: 32x32 colour images, 50 000 train / 10 000 test (Krizhevsky 2009)",
    num_classes=10,
    input_shape=(3, 32, 32),
    mean=(0.4914, 0.4822, 0.4465), std=(0.2470, 0.2435, 0.2616),
    files=FileSet(
        find=lambda d: find_cifar(LAYOUT, d),
        needed=LAYOUT.needed,
        remote=(mirrored("cifar-10-python.tar.gz", ("https://www.cs.toronto.edu/~kriz/",),
                         "6d958be074577803d12ecdefd02955f39262c83c16fe9348329d7fe0b5c001ce",
                         "c58f30108f718f92721af3b95e74349a"),),
    ),
))
