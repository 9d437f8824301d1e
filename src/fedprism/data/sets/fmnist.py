"""Fashion-MNIST (Xiao, Rasul, Vollgraf 2017, "Fashion-MNIST: a novel image dataset for benchmarking
machine learning algorithms", arXiv:1708.07747): 70 000 28x28 greyscale images of ten kinds of clothing,
in the IDX format of MNIST.

Besides the official files (Zalando's mirrors, SHA-256 and MD5 pinned), Debian's ``dataset-fashion-mnist``
package is read from ``/usr/share/datasets/fashion-mnist``: Debian recompressed the upstream gzip files,
so their bytes differ from Zalando's; the digests below are of the package's files (the MD5 values are
the ones the package's own ``md5sums`` lists), and they are as trusted as the official ones.
"""

from __future__ import annotations

from pathlib import Path

from fedprism.data.base import DATASETS, DatasetSpec, FileSet, KnownCopy
from fedprism.data.download import mirrored
from fedprism.data.files import load_images
from fedprism.data.formats import IDX_NEEDED, decode_idx, find_idx

CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
           "Ankle boot")

DEBIAN_FMNIST = Path("/usr/share/datasets/fashion-mnist")
"""Where Debian's ``dataset-fashion-mnist`` package installs the gzipped IDX files."""

_MIRRORS = (
    "https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/fashion/",
    "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
)
_DEBIAN = "Debian package dataset-fashion-mnist"


def load(pad32: bool = False, root: str | Path | None = None, *, download: bool = False,
         cache_dir: str | Path | None | bool = None):
    return load_images(SPEC, lambda files, scratch: decode_idx(files, CLASSES), pad32, root, download, cache_dir)


SPEC = DATASETS.register(DatasetSpec(
    name="fmnist",
    load=load,
    summary="Fashion-MNIST: 28x28 greyscale clothing, 60 000 train / 10 000 test (Xiao et al. 2017, "
            "arXiv:1708.07747)",
    class_names=CLASSES,
    input_shape=(1, 28, 28),
    mean=(0.2860,), std=(0.3530,),
    pad32_auto=True,
    files=FileSet(
        find=find_idx,
        needed=IDX_NEEDED,
        remote=(
            mirrored("train-images-idx3-ubyte.gz", _MIRRORS,
                     "08dc20ab1689590a0bcd66e874647b6ee8464e2d501b5a3f1f78831db19a3fdc",
                     "8d4fb7e6c68d591d4c3dfef9ec88bf0d"),
            mirrored("train-labels-idx1-ubyte.gz", _MIRRORS,
                     "b0197879cbda89f3dc7b894f9fd52b858e68ea4182b6947c9d8c2b67e5f18dcc",
                     "25c81989df183df01b3e8a0aad5dffbe"),
            mirrored("t10k-images-idx3-ubyte.gz", _MIRRORS,
                     "78dcbbfb5a27efaf1b6c1d616caca68560be8766c5bffcb2791df9273a534229",
                     "bef4ecab320f06d8554ea6380940ec79"),
            mirrored("t10k-labels-idx1-ubyte.gz", _MIRRORS,
                     "42bd18137a62d5998cdeae52bf3a0676ac6b706f5cf8439b47bb5b151ae3dccf",
                     "bb300cfdad3c16e7a12a480ee83cd310"),
        ),
        known=(
            KnownCopy("train-images-idx3-ubyte.gz",
                      "b0564c3eedabfbf835052cff8503ea422014ce006caf5b757f851416ee8300c7",
                      "cf8536b0aa1a6ac5fa3f23001093305c", _DEBIAN),
            KnownCopy("train-labels-idx1-ubyte.gz",
                      "0ae29f65d86684f32d1b9c85147786c547b9c6aebcaf235f0400a0cce308b056",
                      "10bea18fdb374794d4bb42e356e600c9", _DEBIAN),
            KnownCopy("t10k-images-idx3-ubyte.gz",
                      "cc1d090a38ace84dfa1aa66e3ada7c336ef481a96936906477e6dd344da56eaa",
                      "f78720b4224f21cce2f2ccf2d7a94c9a", _DEBIAN),
            KnownCopy("t10k-labels-idx1-ubyte.gz",
                      "8d3605d196f4be44669e46906da9733c8131fef761fdbfec72c424d5222f1a05",
                      "0d30e22e447f3c33dab9ed536400ac01", _DEBIAN),
        ),
        folders=(DEBIAN_FMNIST,),
        hint="on Debian/Ubuntu:\n    sudo apt-get install dataset-fashion-mnist",
    ),
))
