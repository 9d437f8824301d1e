"""Office-Caltech10 (Gong, Shi, Sha, Grauman 2012, "Geodesic Flow Kernel for Unsupervised Domain
Adaptation", CVPR 2012): the 10 classes shared by Office-31's three sites (amazon, dslr, webcam) and
Caltech-256 (caltech), 2 533 photographs; one natural client per site (`partition=natural`), the feature
skew of FedBN (Li et al. 2021, arXiv:2102.07623).

Layout read: FedBN's release ``office_caltech_10_dataset.zip`` (or its extracted folder), images in
``office_caltech_10/<site>/<class>/*.jpg`` for the sites amazon, caltech, dslr, webcam and the classes
below. The zip is read in memory (image members only, each at most ``MAX_MEMBER_BYTES``; nothing is
extracted); FedBN's own ``<site>_{train,test}.pkl`` split lists are pickles and are not read (fedprism
unpickles nothing but CIFAR's batches, through a restricted unpickler). Every image is decoded with Pillow,
converted to RGB and resized to ``size`` x ``size`` (bilinear; option ``size``, default 64); an image that
does not decode is a DataError naming it.

Split (decision: FedBN's lists are not read): within each (site, class), a seeded ``round(test_fraction *
n)`` go to test (``seed`` 0, ``test_fraction`` 0.2). Normalisation: ImageNet's per-channel mean and std,
the constants used with photographs of this kind. Site ids: 0 amazon, 1 caltech, 2 dslr, 3 webcam. No
checksum is published: the download is trusted on first use.
"""

from __future__ import annotations

import hashlib
import io
import zipfile
import zlib
from pathlib import Path

import numpy as np

from fedprism.data.base import DATASETS, Dataset, DatasetSpec, FileSet, float_option, int_option
from fedprism.data.cache import cache_file, load_npz, save_npz
from fedprism.data.download import RemoteFile
from fedprism.data.files import images, read_files
from fedprism.data.grouped import split_within_groups
from fedprism.errors import DataError

SITES = ("amazon", "caltech", "dslr", "webcam")
GROUP_NAMES = SITES            # by domain id, for the report's per-domain table
CLASSES = ("back_pack", "bike", "calculator", "headphones", "keyboard", "laptop_computer", "monitor", "mouse",
           "mug", "projector")
ARCHIVE = "office_caltech_10_dataset.zip"
FOLDER = "office_caltech_10"
MAX_MEMBER_BYTES = 64 << 20
_EXT = (".jpg", ".jpeg", ".png")


def decode_image(data: bytes, where: str, size: int) -> np.ndarray:
    """Image bytes -> uint8 [3, size, size] (RGB, bilinear resize)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as im:
            rgb = im.convert("RGB").resize((size, size), Image.BILINEAR)
            a = np.asarray(rgb, dtype=np.uint8)
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise DataError(f"{where}: not a decodable image ({type(e).__name__}: {e})") from None
    return np.ascontiguousarray(a.transpose(2, 0, 1))


def _place(rel: str) -> tuple[int, int, str] | None:
    """``<site>/<class>/<file>`` (below office_caltech_10/) -> (site id, class id, file), else None."""
    parts = rel.split("/")
    if (len(parts) != 3 or parts[0] not in SITES or parts[1] not in CLASSES
            or not parts[2].lower().endswith(_EXT)):
        return None
    return SITES.index(parts[0]), CLASSES.index(parts[1]), parts[2]


def read_images(files: dict[str, Path], size: int) -> dict[str, np.ndarray]:
    """Every image of the release: x uint8 [n, 3, size, size], class, site, in (site, class, file) order."""
    items: list[tuple[int, int, str, bytes, str]] = []
    if "archive" in files:
        path = files["archive"]
        try:
            with zipfile.ZipFile(path) as z:
                for info in z.infolist():
                    name = info.filename
                    if not name.startswith(FOLDER + "/") or info.is_dir():
                        continue
                    place = _place(name[len(FOLDER) + 1:])
                    if place is None:
                        continue
                    if info.file_size > MAX_MEMBER_BYTES:
                        raise DataError(f"{path}: member {name} is {info.file_size} bytes, more than "
                                        f"{MAX_MEMBER_BYTES}")
                    with z.open(info) as f:
                        items.append((*place, f.read(MAX_MEMBER_BYTES + 1), f"{path}:{name}"))
        except (zipfile.BadZipFile, OSError, EOFError, zlib.error) as e:
            raise DataError(f"{path}: cannot read the zip archive ({type(e).__name__}: {e}); it is truncated "
                            "or corrupt, download it again") from e
    else:
        base = files["folder"]
        for p in sorted(base.glob("*/*/*")):
            place = _place(p.relative_to(base).as_posix())
            if place is not None and p.is_file():
                items.append((*place, p.read_bytes(), str(p)))
    names = [(s, c, f) for s, c, f, _, _ in items]
    if len(set(names)) != len(names):
        raise DataError(f"{next(iter(files.values()))}: an image appears twice; refusing an ambiguous copy")
    items.sort(key=lambda t: t[:3])
    present = {s for s, *_ in items}
    if len(present) != len(SITES):
        missing = [SITES[s] for s in range(len(SITES)) if s not in present]
        raise DataError(f"{next(iter(files.values()))}: no images of {', '.join(missing)} "
                        f"({FOLDER}/<site>/<class>/*.jpg); not the Office-Caltech10 release")
    x = np.stack([decode_image(data, where, size) for *_, data, where in items])
    return {"x": x, "y": np.array([c for _, c, *_ in items], np.int64),
            "site": np.array([s for s, *_ in items], np.int64)}


_KEYS = ("x", "y", "site")


def _digest(arrays: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256(b"office-caltech10")
    for key in _KEYS:
        a = np.ascontiguousarray(arrays[key])
        h.update(f"{key}{a.dtype.str}{a.shape}".encode())
        h.update(a.data)
    return h.hexdigest()


def _checker(size: int):
    def check(arrays: dict[str, np.ndarray], where: object) -> None:
        x, y, s = arrays["x"], arrays["y"], arrays["site"]
        if (x.dtype != np.uint8 or x.shape[1:] != (3, size, size) or y.shape != (len(x),)
                or s.shape != (len(x),)):
            raise DataError(f"{where}: images {x.dtype} {x.shape}, classes {y.shape}, sites {s.shape}")
    return check


def find(d: Path) -> dict[str, Path] | str:
    if (d / ARCHIVE).is_file():
        return {"archive": d / ARCHIVE}
    folder = d / FOLDER if (d / FOLDER).is_dir() else d
    if all((folder / s).is_dir() for s in SITES):
        return {"folder": folder}
    return f"no {ARCHIVE} and no {FOLDER}/ with {', '.join(SITES)}/"


def load(pad32: bool = False, root: str | Path | None = None, *, download: bool = False,
         cache_dir: str | Path | None | bool = None, size: int = 64, seed: int = 0,
         test_fraction: float = 0.2) -> Dataset:
    """The 2 533 images at ``size`` x ``size``, split within each (site, class); each image's site in
    ``groups`` / ``test_groups``."""
    size = int_option("size", size, 8)
    seed = int_option("seed", seed, 0)
    test_fraction = float_option("test_fraction", test_fraction, 0.0, 1.0, open_low=True)
    files, where, integrity, cache = read_files(SPEC, root, download, cache_dir)
    keyed = files if "archive" in files else {}            # a folder's images are not keyed by one file
    cfile = cache_file(f"{SPEC.name}-{size}", keyed, cache) if cache is not None and keyed else None
    arrays = load_npz(cfile, _KEYS, _digest, _checker(size)) if cfile is not None else None
    if arrays is None:
        arrays = read_images(files, size)
        if cfile is not None:
            save_npz(cfile, **arrays, digest=np.array(_digest(arrays)))
    x, y, site = arrays["x"], arrays["y"], arrays["site"]
    tr, te = split_within_groups(y, site, seed=seed, test_fraction=test_fraction)
    if not len(tr) or not len(te):
        raise DataError(f"{where}: {len(tr)} training and {len(te)} test images with test_fraction="
                        f"{test_fraction}; both splits must be non-empty")
    ds = images(SPEC, x[tr], y[tr], x[te], y[te], list(CLASSES), 255.0, False, str(where))
    ds.groups, ds.test_groups = site[tr], site[te]
    ds.integrity = integrity
    return ds


SPEC = DATASETS.register(DatasetSpec(
    name="office_caltech10",
    load=load,
    summary="Office-Caltech10: 2 533 photographs, 10 classes, sites amazon/caltech/dslr/webcam as natural "
            "clients (Gong et al. 2012; FedBN's layout, arXiv:2102.07623)",
    class_names=CLASSES,
    input_shape=(3, 64, 64),
    mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225),
    natural="domain",
    options=("size", "seed", "test_fraction"),
    config_keys=(("data.image_size", "size"),),
    files=FileSet(
        find=find,
        needed=f"{ARCHIVE} (FedBN's release) or its extracted {FOLDER}/ with "
               f"{', '.join(SITES)}/<class>/*.jpg",
        # no checksum is published: trust on first use (fedprism.data.download)
        remote=(RemoteFile(ARCHIVE,
                           ("https://huggingface.co/datasets/Jemary/FedBN_Dataset/resolve/main/" + ARCHIVE,),
                           tofu=True),),
    ),
))
