"""Tiny-ImageNet (Le and Yang 2015, "Tiny ImageNet Visual Recognition Challenge", Stanford CS231n): 200
ImageNet classes, 64x64 colour JPEGs, 500 training and 50 validation images per class.

Read from the CS231n archive ``tiny-imagenet-200.zip`` (what `fedprism data download tinyimagenet`
fetches from http://cs231n.stanford.edu/; Stanford publishes no checksum, its MD5 is the one
independent loaders list, e.g. the ``TinyImageNet`` class of pytorch-fgvc-dataset, checked at download
and at every load) or from its extracted folder ``tiny-imagenet-200/`` (used unverified, with a
warning). Layout: ``wnids.txt`` (the 200 WordNet ids, one a line), ``words.txt`` (``wnid<TAB>names``),
``train/<wnid>/images/*.JPEG``, ``val/images/*.JPEG`` with ``val/val_annotations.txt``
(``file<TAB>wnid<TAB>box``); ``test/`` has no labels and is not read.

Decisions: class i is the i-th WordNet id of ``wnids.txt``, named by the first of its names in
``words.txt`` (the id itself when absent); the labelled validation images are the test split (the
challenge's test labels were never published). Training images are read class by class in that order,
each class's files by name; validation images by file name. Every JPEG is decoded with Pillow, must be
64x64, and is converted to RGB (the archive holds some greyscale images); members are read from the zip
in memory (each at most ``MAX_JPEG_BYTES``), nothing is extracted. Normalisation: the per-channel
constants in common use for Tiny-ImageNet.
"""

from __future__ import annotations

import io
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

from fedprism.data.base import DATASETS, DatasetSpec, FileSet
from fedprism.data.cache import Raw
from fedprism.data.download import RemoteFile
from fedprism.data.files import load_images
from fedprism.errors import DataError

ARCHIVE = "tiny-imagenet-200.zip"
FOLDER = "tiny-imagenet-200"
MD5 = "90528d7ca1a48142e341f4ef8d21d0de"
NUM_CLASSES = 200
SIZE = 64
MAX_JPEG_BYTES = 1 << 20
"""Largest JPEG member read (the real ones are a few KB)."""


class _Source:
    """The files of one copy, read by their path below ``tiny-imagenet-200/``: a zip or a folder."""

    def __init__(self, files: dict[str, Path]):
        self.where = files.get("archive") or files["wnids"].parent
        self.zip: zipfile.ZipFile | None = None
        self.names: dict[str, zipfile.ZipInfo] = {}
        if "archive" in files:
            try:
                self.zip = zipfile.ZipFile(files["archive"])
                prefix = FOLDER + "/"
                self.names = {i.filename[len(prefix):]: i for i in self.zip.infolist()
                              if i.filename.startswith(prefix) and not i.is_dir()}
            except (zipfile.BadZipFile, OSError, EOFError) as e:
                raise DataError(f"{self.where}: cannot read the archive ({type(e).__name__}: {e}); it is "
                                "truncated or corrupt, download it again") from None

    def close(self) -> None:
        if self.zip is not None:
            self.zip.close()

    def name(self, rel: str) -> str:
        """A member's name in messages: ``archive:tiny-imagenet-200/rel``, or the file's path."""
        return f"{self.where}:{FOLDER}/{rel}" if self.zip is not None else str(self.where / rel)

    def read(self, rel: str, limit: int) -> bytes:
        where = self.name(rel)
        try:
            if self.zip is not None:
                info = self.names.get(rel)
                if info is None:
                    raise DataError(f"{self.where}: the archive lacks {FOLDER}/{rel}")
                if info.file_size > limit:
                    raise DataError(f"{where}: {info.file_size} bytes, more than the {limit} accepted")
                return self.zip.read(info)
            p = self.where / rel
            if not p.is_file():
                raise DataError(f"{self.where}: lacks {rel}")
            if p.stat().st_size > limit:
                raise DataError(f"{where}: {p.stat().st_size} bytes, more than the {limit} accepted")
            return p.read_bytes()
        except (zipfile.BadZipFile, OSError, EOFError, zlib.error, NotImplementedError) as e:
            raise DataError(f"{where}: cannot read ({type(e).__name__}: {e}); the copy is truncated or corrupt"
                            ) from None

    def listdir(self, rel: str) -> list[str]:
        """The file names directly in folder ``rel``, sorted."""
        if self.zip is not None:
            pre = rel.rstrip("/") + "/"
            return sorted(n[len(pre):] for n in self.names if n.startswith(pre) and "/" not in n[len(pre):])
        d = self.where / rel
        return sorted(p.name for p in d.iterdir() if p.is_file()) if d.is_dir() else []

    def text(self, rel: str) -> str:
        return self.read(rel, 64 << 20).decode("utf-8", errors="replace")


def decode_jpeg(data: bytes, where: object) -> np.ndarray:
    """One JPEG -> uint8 [3, 64, 64] (greyscale and other modes converted to RGB)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as im:
            if im.size != (SIZE, SIZE):
                raise DataError(f"{where}: a {im.size[0]}x{im.size[1]} image; Tiny-ImageNet images are "
                                f"{SIZE}x{SIZE}")
            arr = np.asarray(im.convert("RGB"), dtype=np.uint8)
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        raise DataError(f"{where}: cannot decode the JPEG ({type(e).__name__}: {e}); the file is corrupt"
                        ) from None
    return arr.transpose(2, 0, 1)


def _names(src: _Source) -> tuple[list[str], list[str]]:
    wnids = [w.strip() for w in src.text("wnids.txt").splitlines() if w.strip()]
    if len(wnids) != NUM_CLASSES or len(set(wnids)) != NUM_CLASSES:
        raise DataError(f"{src.where}: wnids.txt lists {len(wnids)} WordNet ids ({len(set(wnids))} distinct); "
                        f"Tiny-ImageNet has {NUM_CLASSES}")
    words: dict[str, str] = {}
    try:
        text = src.text("words.txt")
    except DataError:
        text = ""
    for line in text.splitlines():
        wnid, _, names = line.partition("\t")
        words[wnid.strip()] = names.split(",")[0].strip()
    return wnids, [words.get(w) or w for w in wnids]


def decode(files: dict[str, Path], scratch: Path | None = None,
           progress: Callable[[int], None] | None = None) -> Raw:
    """Train images class by class (``wnids.txt`` order, files by name), the labelled validation images
    as the test split (by file name); uint8 [N, 3, 64, 64]."""
    src = _Source(files)
    try:
        wnids, classes = _names(src)
        index = {w: i for i, w in enumerate(wnids)}
        xs, ys = [], []
        for c, w in enumerate(wnids):
            names = [n for n in src.listdir(f"train/{w}/images") if n.upper().endswith(".JPEG")]
            if not names:
                raise DataError(f"{src.where}: no training images in train/{w}/images")
            for n in names:
                xs.append(decode_jpeg(src.read(f"train/{w}/images/{n}", MAX_JPEG_BYTES),
                                      src.name(f"train/{w}/images/{n}")))
                ys.append(c)
        ann: dict[str, int] = {}
        for k, line in enumerate(src.text("val/val_annotations.txt").splitlines(), 1):
            if not line.strip():
                continue
            f = line.split("\t")
            if len(f) < 2 or f[1] not in index or f[0] in ann:
                raise DataError(f"{src.where}: val/val_annotations.txt line {k} is not 'file<TAB>wnid...' with a "
                                f"wnid of wnids.txt, once per file: {line[:80]!r}")
            ann[f[0]] = index[f[1]]
        present = set(src.listdir("val/images"))
        missing = sorted(set(ann) - present)
        if missing:
            raise DataError(f"{src.where}: val/images lacks {len(missing)} annotated images ({missing[0]}...)")
        vx, vy = [], []
        for n in sorted(ann):
            vx.append(decode_jpeg(src.read(f"val/images/{n}", MAX_JPEG_BYTES), src.name(f"val/images/{n}")))
            vy.append(ann[n])
        if not vx:
            raise DataError(f"{src.where}: val/val_annotations.txt annotates no image")
    finally:
        src.close()
    return Raw(np.stack(xs), np.asarray(ys, np.int64), np.stack(vx), np.asarray(vy, np.int64), classes)


def find(d: Path) -> dict[str, Path] | str:
    if (d / ARCHIVE).is_file():
        return {"archive": d / ARCHIVE}
    for folder in (d / FOLDER, d):
        if (folder / "wnids.txt").is_file() and (folder / "train").is_dir() and \
                (folder / "val" / "val_annotations.txt").is_file():
            return {"wnids": folder / "wnids.txt", "val_annotations": folder / "val" / "val_annotations.txt"}
    return f"no {ARCHIVE} and no {FOLDER}/ with wnids.txt, train/ and val/val_annotations.txt"


def load(pad32: bool = False, root: str | Path | None = None, *, download: bool = False,
         cache_dir: str | Path | None | bool = None):
    return load_images(SPEC, decode, pad32, root, download, cache_dir)


SPEC = DATASETS.register(DatasetSpec(
    name="tinyimagenet",
    load=load,
    summary="Tiny-ImageNet: 64x64 colour images of 200 ImageNet classes, 100 000 train / 10 000 validation "
            "(Le and Yang 2015)",
    num_classes=NUM_CLASSES,
    input_shape=(3, SIZE, SIZE),
    mean=(0.4802, 0.4481, 0.3975), std=(0.2770, 0.2691, 0.2821),
    files=FileSet(
        find=find,
        needed=f"{ARCHIVE} (CS231n), or its extracted {FOLDER}/ (wnids.txt, words.txt, train/, val/)",
        # Stanford publishes no checksum: the MD5 independent loaders list (checked at every load)
        remote=(RemoteFile(ARCHIVE, ("http://cs231n.stanford.edu/" + ARCHIVE,), md5=MD5),),
    ),
))
