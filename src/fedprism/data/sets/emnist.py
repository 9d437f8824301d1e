"""EMNIST (Cohen, Afshar, Tapson, van Schaik 2017, "EMNIST: an extension of MNIST to handwritten letters",
arXiv:1702.05373): 28x28 handwritten digits and letters of NIST Special Database 19 in MNIST's format, in
six splits (option ``split``, config key ``data.emnist.split``):

=========  ========  ================================================================
split      classes   what
=========  ========  ================================================================
byclass    62        0-9, A-Z, a-z (the default; unbalanced)
bymerge    47        byclass with the 15 letters whose cases look alike merged
balanced   47        bymerge with the same number of samples per class
letters    26        A-Z, each upper and lower case together (labels 1..26 in the file)
digits     10        0-9, balanced
mnist      10        0-9, MNIST's sizes
=========  ========  ================================================================

Read from NIST's ``gzip.zip`` (what `fedprism data download emnist` fetches, from
https://biometrics.nist.gov/cs_links/EMNIST/; NIST publishes no checksum, its MD5 is the one torchvision's
``EMNIST`` class lists, checked at download and at every load) or from its extracted
``gzip/emnist-<split>-{train,test}-{images-idx3,labels-idx1}-ubyte.gz`` and ``emnist-<split>-mapping.txt``
(used unverified, with a warning). Only the chosen split's five members are read from the archive, in
memory, each decompressed up to ``MAX_IDX_BYTES``; nothing is extracted to disk.

Decisions: NIST stores each image transposed (column-major, as the MATLAB conversion wrote it); the
loader transposes it back, so letters are upright as in MNIST. Labels are renumbered from 0 (the
letters split's 1..26 become 0..25); the class names come from the split's mapping file (ASCII codes;
a class of two codes, such as the letters' upper and lower case, is named "A/a"). Pixels are scaled to
[0, 1] and not standardised (mean 0, std 1), for every split alike. EMNIST keeps no writer ids: its
per-writer form is ``femnist``.
"""

from __future__ import annotations

import re
import zipfile
import zlib
from pathlib import Path

import numpy as np

from fedprism.data import leaf
from fedprism.data.base import DATASETS, DatasetSpec, FileSet
from fedprism.data.download import RemoteFile
from fedprism.data.files import images, read_files
from fedprism.data.formats import parse_idx
from fedprism.errors import ConfigError, DataError

SPLITS = {"byclass": 62, "bymerge": 47, "balanced": 47, "letters": 26, "digits": 10, "mnist": 10}
ARCHIVE = "gzip.zip"
MD5 = "58c8d27c78d21e728a6bc7b3cc06412e"
MAX_IDX_BYTES = 1 << 30
"""Largest decompressed IDX member accepted (the largest real one, byclass's train images, is 547 MB)."""
_KEYS = ("x_train", "y_train", "x_test", "y_test", "classes")
_PARTS = {"train_images": "train-images-idx3-ubyte.gz", "train_labels": "train-labels-idx1-ubyte.gz",
          "test_images": "test-images-idx3-ubyte.gz", "test_labels": "test-labels-idx1-ubyte.gz"}


def members(split: str) -> dict[str, str]:
    """part -> file name of a split's five files (the archive holds them under ``gzip/``)."""
    return {**{k: f"emnist-{split}-{v}" for k, v in _PARTS.items()}, "mapping": f"emnist-{split}-mapping.txt"}


def gunzip(data: bytes, where: object, limit: int | None = None) -> bytes:
    """The decompressed bytes of a gzip stream, refused beyond ``limit`` (default ``MAX_IDX_BYTES``)."""
    limit = MAX_IDX_BYTES if limit is None else limit
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        out = d.decompress(data, limit + 1)
    except zlib.error as e:
        raise DataError(f"{where}: corrupt or truncated gzip stream ({e})") from None
    if len(out) > limit:
        raise DataError(f"{where}: decompresses to more than the {limit} bytes accepted; not an EMNIST file")
    if not d.eof:
        raise DataError(f"{where}: truncated gzip stream")
    return out


def parse_mapping(text: str, where: object, expected: int) -> tuple[int, list[str]]:
    """(the first label, the class names) of a mapping file: one "label code [code...]" line per class,
    labels consecutive."""
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            nums = [int(v) for v in line.split()]
            if len(nums) < 2 or not all(0 < c < 0x110000 for c in nums[1:]):
                raise ValueError
        except ValueError:
            raise DataError(f"{where}: line {n} is not 'label ascii-code...': {line[:60]!r}") from None
        rows.append((nums[0], "/".join(chr(c) for c in nums[1:])))
    rows.sort()
    labels = [r[0] for r in rows]
    if len(rows) != expected or labels != list(range(labels[0], labels[0] + expected)):
        raise DataError(f"{where}: maps {len(rows)} labels {labels[:3]}...; this split has {expected} "
                        "consecutive labels")
    return labels[0], [r[1] for r in rows]


def decode(files: dict[str, Path], split: str) -> dict[str, np.ndarray]:
    """The split's images (upright, uint8 [n, 1, 28, 28]), labels from 0 and class names."""
    names = members(split)
    raw: dict[str, bytes] = {}
    if "archive" in files:
        archive = files["archive"]
        try:
            with zipfile.ZipFile(archive) as z:
                index = {i.filename.rsplit("/", 1)[-1]: i for i in z.infolist() if not i.is_dir()}
                lacking = [n for n in names.values() if n not in index]
                if lacking:
                    have = sorted({m.group(1) for f in index if (m := re.match(r"emnist-(\w+)-mapping", f))})
                    raise DataError(f"{archive}: the archive lacks {', '.join(lacking)} (splits there: "
                                    f"{', '.join(have) or 'none'})")
                for part, n in names.items():
                    if index[n].file_size > MAX_IDX_BYTES:
                        raise DataError(f"{archive}: member {n} is {index[n].file_size} bytes, more than "
                                        f"the {MAX_IDX_BYTES} accepted")
                    raw[part] = z.read(index[n])
        except (zipfile.BadZipFile, OSError, EOFError, zlib.error, NotImplementedError) as e:
            raise DataError(f"{archive}: cannot read the archive ({type(e).__name__}: {e}); it is truncated "
                            "or corrupt, download it again") from None
        where = {part: f"{archive}:{n}" for part, n in names.items()}
    else:
        lacking = [n for n in names.values() if n not in files]
        if lacking:
            have = sorted({m.group(1) for f in files if (m := re.match(r"emnist-(\w+)-mapping", f))})
            raise DataError(f"{next(iter(files.values())).parent} lacks {', '.join(lacking)} (splits there: "
                            f"{', '.join(have) or 'none'})")
        where = {part: files[n] for part, n in names.items()}
        for part, n in names.items():
            try:
                raw[part] = files[n].read_bytes()
            except OSError as e:
                raise DataError(f"{files[n]}: cannot read file ({e.strerror or e})") from None
    first, classes = parse_mapping(raw["mapping"].decode("ascii", errors="replace"), where["mapping"],
                                   SPLITS[split])
    out: dict[str, np.ndarray] = {"classes": np.array(classes, dtype=str)}
    for s in ("train", "test"):
        x = parse_idx(gunzip(raw[f"{s}_images"], where[f"{s}_images"]), where[f"{s}_images"], ndim=3)
        y = parse_idx(gunzip(raw[f"{s}_labels"], where[f"{s}_labels"]), where[f"{s}_labels"], ndim=1)
        if x.dtype != np.uint8 or x.shape[1:] != (28, 28) or len(x) != len(y):
            raise DataError(f"{where[f'{s}_images']}: {x.dtype} images {x.shape} with {len(y)} labels; EMNIST "
                            "holds one uint8 28x28 image per label")
        y = y.astype(np.int64) - first
        if len(y) and (y.min() < 0 or y.max() >= len(classes)):
            raise DataError(f"{where[f'{s}_labels']}: labels {y.min() + first}..{y.max() + first} outside the "
                            f"mapping's {first}..{first + len(classes) - 1}")
        out[f"x_{s}"] = np.ascontiguousarray(np.transpose(x, (0, 2, 1)))[:, None]
        out[f"y_{s}"] = y
    return out


def _check(arrays: dict[str, np.ndarray], where: object) -> None:
    k = len(arrays["classes"])
    for s in ("train", "test"):
        x, y = arrays[f"x_{s}"], arrays[f"y_{s}"]
        if x.dtype != np.uint8 or x.shape[1:] != (1, 28, 28) or y.shape != (len(x),) or not len(y):
            raise DataError(f"{where}: {s} split has images {x.dtype} {x.shape} and labels {y.shape}")
        if y.min() < 0 or y.max() >= k:
            raise DataError(f"{where}: {s} labels must lie in 0..{k - 1}")


def find(d: Path) -> dict[str, Path] | str:
    if (d / ARCHIVE).is_file():
        return {"archive": d / ARCHIVE}
    for base in (d / "gzip", d):
        got = {p.name: p for p in base.glob("emnist-*") if p.is_file()} if base.is_dir() else {}
        if any(all(n in got for n in members(s).values()) for s in SPLITS):
            return got
    return f"no {ARCHIVE} and no complete split of emnist-<split>-* files in gzip/"


def load(pad32: bool = False, root: str | Path | None = None, *, download: bool = False,
         cache_dir: str | Path | None | bool = None, split: str = "byclass"):
    """One split's images, upright, in [0, 1]; its classes named from its mapping file."""
    if split not in SPLITS:
        from fedprism.registry import suggest

        raise ConfigError("split", split, f"one of {', '.join(SPLITS)}{suggest(str(split), list(SPLITS))}")
    files, where, integrity, cache = read_files(SPEC, root, download, cache_dir)
    arrays = leaf.cached(f"{SPEC.name}-{split}", files, cache, _KEYS, lambda: decode(files, split), _check)
    ds = images(SPEC, arrays["x_train"], arrays["y_train"], arrays["x_test"], arrays["y_test"],
                [str(c) for c in arrays["classes"]], 255.0, pad32, f"{where} (split {split})")
    ds.integrity = integrity
    return ds


SPEC = DATASETS.register(DatasetSpec(
    name="emnist",
    load=load,
    summary="EMNIST: 28x28 handwritten digits and letters in six splits, byclass (62 classes, the default), "
            "bymerge, balanced (47), letters (26), digits, mnist (10) (Cohen et al. 2017)",
    input_shape=(1, 28, 28),
    mean=(0.0,), std=(1.0,),
    normalisation="none: pixels scaled to [0, 1]",
    pad32_auto=True,
    options=("split",),
    config_keys=(("data.emnist.split", "split"),),
    files=FileSet(
        find=find,
        needed=f"{ARCHIVE} (NIST), or its gzip/emnist-<split>-{{train,test}}-{{images-idx3,labels-idx1}}"
               "-ubyte.gz and emnist-<split>-mapping.txt",
        # NIST publishes no checksum: the MD5 torchvision's EMNIST class lists (checked at every load)
        remote=(RemoteFile(ARCHIVE, ("https://biometrics.nist.gov/cs_links/EMNIST/" + ARCHIVE,), md5=MD5),),
    ),
))
