"""USPS (Hull 1994, "A database for handwritten text recognition research"): 9 298 16x16 greyscale
digits, read from LIBSVM's ``usps.bz2`` / ``usps.t.bz2`` (:func:`fedprism.data.formats.read_usps`).

Only an MD5 of these files is published (torchvision's ``USPS`` class lists these values): it is verified
at download and at every load; MD5 catches corrupt and truncated files but is no defence against a
deliberately crafted substitute. The normalisation constants are the values in common use with
torchvision's USPS pixels (the conversion ``read_usps`` copies); they are not recomputed here.
"""

from __future__ import annotations

from pathlib import Path

from fedprism.data.base import DATASETS, DatasetSpec, FileSet
from fedprism.data.cache import Raw
from fedprism.data.download import mirrored
from fedprism.data.files import load_images
from fedprism.data.formats import DIGIT_CLASSES, find_each, read_usps

FILES = {"train": "usps", "test": "usps.t"}
_LIBSVM_MULTICLASS = ("https://www.csie.ntu.edu.tw/~cjlin/libsvmtools/datasets/multiclass/",)


def find(d: Path) -> dict[str, Path] | str:
    return find_each(d, FILES, ".bz2", "no usps[.bz2] / usps.t[.bz2] files")


def decode(files: dict[str, Path], scratch: Path) -> Raw:
    return Raw(*read_usps(files["train"]), *read_usps(files["test"]), list(DIGIT_CLASSES))


def load(pad32: bool = False, root: str | Path | None = None, *, download: bool = False,
         cache_dir: str | Path | None | bool = None):
    return load_images(SPEC, decode, pad32, root, download, cache_dir)


SPEC = DATASETS.register(DatasetSpec(
    name="usps",
    load=load,
    summary="USPS: 16x16 greyscale handwritten digits, 7 291 train / 2 007 test (Hull 1994)",
    class_names=DIGIT_CLASSES,
    input_shape=(1, 16, 16),
    mean=(0.2469,), std=(0.2989,),
    files=FileSet(
        find=find,
        needed="usps.bz2, usps.t.bz2 (LIBSVM format; also accepted decompressed as usps, usps.t)",
        # MD5 only: no SHA-256 is published
        remote=(mirrored("usps.bz2", _LIBSVM_MULTICLASS, None, "ec16c51db3855ca6c91edd34d0e9b197"),
                mirrored("usps.t.bz2", _LIBSVM_MULTICLASS, None, "8ea070ee2aca1ac39742fdd1ef5ed118")),
    ),
))
