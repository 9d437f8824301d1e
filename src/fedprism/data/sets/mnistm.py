"""MNIST-M (Ganin and Lempitsky 2015, "Unsupervised Domain Adaptation by Backpropagation",
arXiv:1409.7495): MNIST digits blended over patches of colour photographs (BSDS500), 28x28 RGB, 59 001
train / 9 001 test; one of the Digits domains of FedBN (Li et al. 2021, arXiv:2102.07623).

The copy read is the authors' unpacked release ``mnist_m.tar.gz``: ``mnist_m/mnist_m_train/*.png`` and
``mnist_m/mnist_m_test/*.png`` with ``mnist_m/mnist_m_{train,test}_labels.txt``, one ``<file>.png <digit>``
per line (or the extracted ``mnist_m/`` folder). The tarball is read in memory, member by member (only
regular ``.png`` files of the two image folders and the two label files, each at most
``MAX_MEMBER_BYTES``; nothing is extracted to disk); every labelled image must be present, decode as 28x28
RGB and every image must be labelled. Only an MD5 of the tarball is published (the one pytorch-adapt's
``MNISTM`` class lists): checked at download and at every load.
"""

from __future__ import annotations

import io
import tarfile
import zlib
from pathlib import Path

import numpy as np

from fedprism.data.base import DATASETS, DatasetSpec, FileSet
from fedprism.data.cache import Raw
from fedprism.data.download import RemoteFile
from fedprism.data.files import load_images
from fedprism.data.formats import DIGIT_CLASSES
from fedprism.errors import DataError

ARCHIVE = "mnist_m.tar.gz"
SIDE = 28
MAX_MEMBER_BYTES = 64 << 20
"""Largest member read (a label file is about 1 MiB, an image a few KiB)."""


def decode_png(data: bytes, where: str, side: int = SIDE) -> np.ndarray:
    """PNG bytes -> uint8 [3, side, side]; anything else (another size, undecodable) is a DataError."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as im:
            if im.size != (side, side):
                raise DataError(f"{where}: a {im.size[0]}x{im.size[1]} image; MNIST-M images are "
                                f"{side}x{side}")
            rgb = np.asarray(im.convert("RGB"), dtype=np.uint8)
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise DataError(f"{where}: not a decodable PNG image ({type(e).__name__}: {e})") from None
    return np.ascontiguousarray(rgb.transpose(2, 0, 1))


def parse_labels(text: str, where: str) -> dict[str, int]:
    """``<file>.png <digit>`` lines -> {file: digit}; a malformed line or a repeated file is a DataError."""
    out: dict[str, int] = {}
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[0].endswith(".png") or not parts[1].isdigit() or int(parts[1]) > 9:
            raise DataError(f"{where}: line {n} {line!r} is not '<file>.png <digit 0-9>'")
        if parts[0] in out:
            raise DataError(f"{where}: {parts[0]} is labelled twice (line {n})")
        out[parts[0]] = int(parts[1])
    if not out:
        raise DataError(f"{where}: no labels")
    return out


def _split(labels: dict[str, int], images: dict[str, bytes], where: str) -> tuple[np.ndarray, np.ndarray]:
    missing = sorted(set(labels) - set(images))
    extra = sorted(set(images) - set(labels))
    if missing or extra:
        raise DataError(f"{where}: {len(missing)} labelled images missing ({', '.join(missing[:3])}) and "
                        f"{len(extra)} images without a label ({', '.join(extra[:3])})")
    names = sorted(labels)
    x = np.stack([decode_png(images[n], f"{where}/{n}") for n in names])
    return x, np.array([labels[n] for n in names], np.int64)


def read_tarball(path: Path) -> Raw:
    """The two splits of ``mnist_m.tar.gz``, read in memory (see the module docstring)."""
    texts: dict[str, str] = {}
    images: dict[str, dict[str, bytes]] = {"train": {}, "test": {}}
    try:
        with tarfile.open(path, "r:gz") as tar:
            for m in tar:
                name = m.name.removeprefix("./")
                parts = name.split("/")
                if len(parts) == 2 and parts[0] == "mnist_m" and parts[1] in ("mnist_m_train_labels.txt",
                                                                              "mnist_m_test_labels.txt"):
                    split = parts[1].split("_")[2]
                elif (len(parts) == 3 and parts[0] == "mnist_m"
                      and parts[1] in ("mnist_m_train", "mnist_m_test")
                      and parts[2].endswith(".png")):
                    split = parts[1].split("_")[2]
                else:
                    continue
                if not m.isfile():
                    raise DataError(f"{path}: member {m.name!r} is not a regular file; refusing it")
                if m.size > MAX_MEMBER_BYTES:
                    raise DataError(f"{path}: member {m.name!r} is {m.size} bytes, more than "
                                    f"{MAX_MEMBER_BYTES}")
                src = tar.extractfile(m)
                assert src is not None
                with src:
                    data = src.read(MAX_MEMBER_BYTES + 1)
                if len(parts) == 2:
                    texts[split] = data.decode("ascii", errors="replace")
                else:
                    if parts[2] in images[split]:
                        raise DataError(f"{path}: member {m.name!r} appears twice; refusing an ambiguous "
                                        "archive")
                    images[split][parts[2]] = data
    except (tarfile.TarError, OSError, EOFError, zlib.error) as e:
        raise DataError(f"{path}: cannot read the archive ({type(e).__name__}: {e}); it is truncated or "
                        "corrupt, download it again") from e
    out = []
    for split in ("train", "test"):
        if split not in texts:
            raise DataError(f"{path}: the archive lacks mnist_m/mnist_m_{split}_labels.txt; not the MNIST-M "
                            "release")
        where = f"{path}:mnist_m/mnist_m_{split}"
        out += _split(parse_labels(texts[split], f"{where}_labels.txt"), images[split], where)
    return Raw(*out, list(DIGIT_CLASSES))


def read_folder(folder: Path) -> Raw:
    """The extracted ``mnist_m/`` folder."""
    out = []
    for split in ("train", "test"):
        labels_file = folder / f"mnist_m_{split}_labels.txt"
        labels = parse_labels(labels_file.read_text(encoding="ascii", errors="replace"), str(labels_file))
        d = folder / f"mnist_m_{split}"
        images = {p.name: p.read_bytes() for p in d.glob("*.png") if p.is_file()}
        out += _split(labels, images, str(d))
    return Raw(*out, list(DIGIT_CLASSES))


def find(d: Path) -> dict[str, Path] | str:
    if (d / ARCHIVE).is_file():
        return {"archive": d / ARCHIVE}
    folder = d / "mnist_m" if (d / "mnist_m").is_dir() else d
    need = [folder / f for f in ("mnist_m_train_labels.txt", "mnist_m_test_labels.txt")]
    folders = (folder / "mnist_m_train", folder / "mnist_m_test")
    if all(p.is_file() for p in need) and all(f.is_dir() for f in folders):
        return {"train_labels": need[0], "test_labels": need[1]}
    return f"no {ARCHIVE} and no extracted mnist_m/"


def decode(files: dict[str, Path], scratch: Path) -> Raw:
    return read_tarball(files["archive"]) if "archive" in files else read_folder(files["train_labels"].parent)


def load(pad32: bool = False, root: str | Path | None = None, *, download: bool = False,
         cache_dir: str | Path | None | bool = None):
    return load_images(SPEC, decode, pad32, root, download, cache_dir)


SPEC = DATASETS.register(DatasetSpec(
    name="mnistm",
    load=load,
    summary="MNIST-M: MNIST digits over colour photo patches, 28x28 RGB, 59 001 train / 9 001 test "
            "(Ganin and Lempitsky 2015, arXiv:1409.7495)",
    class_names=DIGIT_CLASSES,
    input_shape=(3, SIDE, SIDE),
    mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5),
    pad32_auto=True,
    files=FileSet(
        find=find,
        needed=f"{ARCHIVE} (the authors' unpacked release) or its extracted mnist_m/ folder",
        # MD5 only: the value pytorch-adapt's MNISTM class lists for this copy; no SHA-256 is published
        remote=(RemoteFile(ARCHIVE,
                           ("https://cornell.box.com/shared/static/jado7quprg6hzzdubvwzh9umr75damwi",),
                           md5="859df31c91afe82e80e5012ba928f279"),),
    ),
))
