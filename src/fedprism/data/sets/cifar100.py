"""CIFAR-100 (Krizhevsky 2009, "Learning multiple layers of features from tiny images"): 60 000 32x32
colour images of 100 fine classes, from the official "python version" archive (read through the
restricted unpickler of :mod:`fedprism.data.formats`; the class names come from its ``meta``)."""

from __future__ import annotations

from pathlib import Path

from fedprism.data.base import DATASETS, DatasetSpec, FileSet
from fedprism.data.download import mirrored
from fedprism.data.files import load_images
from fedprism.data.formats import CifarLayout, decode_cifar, find_cifar

LAYOUT = CifarLayout("cifar-100-python", "cifar-100-python.tar.gz", ("train",), ("test",), "meta",
                     b"fine_labels", b"fine_label_names")


def load(pad32: bool = False, root: str | Path | None = None, *, download: bool = False,
         cache_dir: str | Path | None | bool = None):
    return load_images(SPEC, lambda files, scratch: decode_cifar(LAYOUT, SPEC.num_classes, files, scratch),
                       pad32, root, download, cache_dir)


SPEC = DATASETS.register(DatasetSpec(
    name="cifar100",
    load=load,
    summary="CIFAR-100: 32x32 colour images, 100 fine classes, 50 000 train / 10 000 test (Krizhevsky 2009)",
    num_classes=100,
    input_shape=(3, 32, 32),
    mean=(0.5071, 0.4865, 0.4409), std=(0.2673, 0.2564, 0.2762),
    files=FileSet(
        find=lambda d: find_cifar(LAYOUT, d),
        needed=LAYOUT.needed,
        remote=(mirrored("cifar-100-python.tar.gz", ("https://www.cs.toronto.edu/~kriz/",),
                         "85cd44d02ba6437773c5bbd22e183051d648de2e7d6b014e1ef29b855ba677a7",
                         "eb9058c3a382ffc7106e4002c42a8d85"),),
    ),
))
