"""MNIST (LeCun, Bottou, Bengio, Haffner 1998, "Gradient-based learning applied to document
recognition"): 70 000 28x28 greyscale handwritten digits, IDX files, SHA-256 and MD5 pinned."""

from __future__ import annotations

from pathlib import Path

from fedprism.data.base import DATASETS, DatasetSpec, FileSet
from fedprism.data.download import mirrored
from fedprism.data.files import load_images
from fedprism.data.formats import DIGIT_CLASSES, IDX_NEEDED, decode_idx, find_idx

_MIRRORS = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
)


def load(pad32: bool = False, root: str | Path | None = None, *, download: bool = False,
         cache_dir: str | Path | None | bool = None):
    return load_images(SPEC, lambda files, scratch: decode_idx(files, DIGIT_CLASSES), pad32, root, download,
                       cache_dir)


SPEC = DATASETS.register(DatasetSpec(
    name="mnist",
    load=load,
    summary="MNIST: 28x28 greyscale handwritten digits, 60 000 train / 10 000 test (LeCun et al. 1998)",
    class_names=DIGIT_CLASSES,
    input_shape=(1, 28, 28),
    mean=(0.1307,), std=(0.3081,),
    pad32_auto=True,
    files=FileSet(
        find=find_idx,
        needed=IDX_NEEDED,
        remote=(
            mirrored("train-images-idx3-ubyte.gz", _MIRRORS,
                     "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609",
                     "f68b3c2dcbeaaa9fbdd348bbdeb94873"),
            mirrored("train-labels-idx1-ubyte.gz", _MIRRORS,
                     "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c",
                     "d53e105ee54ea40749a09fcbcd1e9432"),
            mirrored("t10k-images-idx3-ubyte.gz", _MIRRORS,
                     "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
                     "9fb629c4189551a2d022fa330f9573f3"),
            mirrored("t10k-labels-idx1-ubyte.gz", _MIRRORS,
                     "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6",
                     "ec29112dd5afa0611ce80d1b7f02629c"),
        ),
    ),
))
