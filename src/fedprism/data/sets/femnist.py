"""FEMNIST, the federated EMNIST of LEAF (Caldas et al. 2018, "LEAF: A Benchmark for Federated Settings",
arXiv:1812.01097): 28x28 handwritten digits and letters of NIST Special Database 19, 62 classes
(0-9, A-Z, a-z), one natural client per writer (`partition=natural`).

Read from either of two files (:mod:`fedprism.data.leaf`):

* TensorFlow Federated's copy, ``fed_emnist.tar.bz2`` (what `fedprism data download femnist` fetches,
  checked against the SHA-256 TFF publishes in ``tff.simulation.datasets.emnist.load_data``) or its
  extracted ``fed_emnist_train.h5`` / ``fed_emnist_test.h5``: ``examples/<writer>/pixels`` float
  [n, 28, 28] in [0, 1] and ``examples/<writer>/label`` [n]; 3400 writers, each in both files.
* LEAF's preprocessed JSON output (``data/train/*.json``, ``data/test/*.json`` written by LEAF's
  ``preprocess.sh``, with whatever sampling it was run with): ``user_data[writer]`` holds ``x``, lists
  of 784 floats in [0, 1] (row-major 28x28), and ``y``, labels 0..61. Generated locally, so no digest
  covers it: it is used with an ``UnverifiedDataWarning``.

Decisions: both sources store ``pixel / 255`` with 1.0 for the white paper; the loader rounds to the
nearest 1/255 and inverts, ``255 - round(255 x)``, so strokes are bright on a black background as in
MNIST and EMNIST (and ``data.pad32`` pads with background). Inputs are then scaled to [0, 1] and not
standardised (mean 0, std 1). The train files give the train split and the test files the test split;
each writer keeps its id (`fedprism.data.leaf.group_ids`), so a natural client's local test set is its
own writer's test samples.
"""

from __future__ import annotations

import shutil
import string
import tempfile
from pathlib import Path

import numpy as np

from fedprism.data import leaf
from fedprism.data.base import DATASETS, DatasetSpec, FileSet
from fedprism.data.download import mirrored
from fedprism.data.files import images, read_files
from fedprism.errors import DataError

CLASSES = tuple(string.digits + string.ascii_uppercase + string.ascii_lowercase)
ARCHIVE = "fed_emnist.tar.bz2"
H5 = ("fed_emnist_train.h5", "fed_emnist_test.h5")
TFF_SHA256 = "fe1ed5a502cea3a952eb105920bff8cffb32836b5173cb18a57a32c3606f3ea0"
_KEYS = ("x_train", "y_train", "g_train", "x_test", "y_test", "g_test", "users")


def to_uint8(pixels: np.ndarray, where: object) -> np.ndarray:
    """LEAF / TFF pixels (floats in [0, 1], 1.0 = paper) -> uint8 [n, 1, 28, 28], strokes bright."""
    x = np.asarray(pixels, dtype=np.float64)
    if x.ndim != 2 or x.shape[1] != 784:
        x = x.reshape(len(x), -1) if x.ndim >= 2 else x
    if x.ndim != 2 or x.shape[1] != 784:
        raise DataError(f"{where}: images of {x.shape[1:] if x.ndim else x.shape} values; FEMNIST images are "
                        "28x28 = 784 values")
    if len(x) and (not np.isfinite(x).all() or x.min() < 0 or x.max() > 1):
        raise DataError(f"{where}: pixel values must lie in [0, 1], found {np.nanmin(x)}..{np.nanmax(x)}")
    return (255 - np.rint(x * 255)).astype(np.uint8).reshape(-1, 1, 28, 28)


def _labels(y: object, where: object) -> np.ndarray:
    a = np.asarray(y)
    if a.ndim != 1 or (len(a) and (a.dtype.kind not in "iu" or a.min() < 0 or a.max() >= len(CLASSES))):
        raise DataError(f"{where}: labels must be integers in 0..{len(CLASSES) - 1}, found "
                        f"{a.dtype} {a.min() if a.size else ''}..{a.max() if a.size else ''}")
    return a.astype(np.int64)


def _assemble(splits: list[dict[str, tuple[np.ndarray, np.ndarray]]], where: object) -> dict[str, np.ndarray]:
    names, ids = leaf.group_ids(list(splits[0]), list(splits[1]))
    out: dict[str, np.ndarray] = {"users": np.array(names, dtype=str)}
    for split, data in zip(("train", "test"), splits):
        users = sorted(data)
        xs = [data[u][0] for u in users]
        ys = [data[u][1] for u in users]
        out[f"x_{split}"] = np.concatenate(xs) if xs else np.zeros((0, 1, 28, 28), np.uint8)
        out[f"y_{split}"] = np.concatenate(ys) if ys else np.zeros(0, np.int64)
        out[f"g_{split}"] = np.repeat(np.array([ids[u] for u in users], np.int64),
                                      [len(y) for y in ys]).astype(np.int64)
        if not len(out[f"y_{split}"]):
            raise DataError(f"{where}: the {split} files hold no samples")
    return out


def _convert(user: str, x: list, y: list, where: str) -> tuple[np.ndarray, np.ndarray]:
    """One writer's LEAF lists -> (uint8 images, labels)."""
    try:
        px = np.asarray(x, dtype=np.float64) if x else np.zeros((0, 784))
    except (ValueError, TypeError):
        raise DataError(f"{where}: 'x' is not a list of 784 numbers per sample") from None
    return to_uint8(px, where), _labels(y, where)


def read_json(files: dict[str, Path]) -> dict[str, np.ndarray]:
    """The LEAF JSON files -> arrays (uint8 images, labels, writer ids, writer names)."""
    splits = []
    for split in ("train", "test"):
        paths = [p for k, p in sorted(files.items()) if k.startswith(split + "/")]
        splits.append(leaf.read_json_split(paths, _convert))
    return _assemble(splits, next(iter(files.values())).parent.parent)


def read_h5(train: Path, test: Path) -> dict[str, np.ndarray]:
    """TFF's two HDF5 files -> arrays (uint8 images, labels, writer ids, writer names)."""
    splits = []
    for path in (train, test):
        data = {}
        for cid, f in leaf.h5_clients(path, ("pixels", "label")):
            where = f"{path}: client {cid!r}"
            y = _labels(np.asarray(f["label"]).reshape(-1), where)
            x = to_uint8(f["pixels"], where)
            if len(x) != len(y):
                raise DataError(f"{where}: {len(x)} images but {len(y)} labels")
            data[cid] = (x, y)
        splits.append(data)
    return _assemble(splits, train)


def _check(arrays: dict[str, np.ndarray], where: object) -> None:
    for split in ("train", "test"):
        x, y, g = arrays[f"x_{split}"], arrays[f"y_{split}"], arrays[f"g_{split}"]
        if x.dtype != np.uint8 or x.shape[1:] != (1, 28, 28) or y.shape != (len(x),) or g.shape != (len(x),):
            raise DataError(f"{where}: {split} arrays are images {x.dtype} {x.shape}, labels {y.shape}, "
                            f"writers {g.shape}")
        if len(y) and (y.min() < 0 or y.max() >= len(CLASSES) or g.min() < 0 or g.max() >= len(arrays["users"])):
            raise DataError(f"{where}: {split} labels or writer ids out of range")


def decode(files: dict[str, Path], scratch: Path) -> dict[str, np.ndarray]:
    if "archive" in files:
        got = leaf.extract_members(files["archive"], H5, scratch)
        try:
            return read_h5(got[H5[0]], got[H5[1]])
        finally:
            shutil.rmtree(got[H5[0]].parent, ignore_errors=True)
    if "train_h5" in files:
        return read_h5(files["train_h5"], files["test_h5"])
    return read_json(files)


def find(d: Path) -> dict[str, Path] | str:
    return leaf.find_tff(d, ARCHIVE, H5)


def load(pad32: bool = False, root: str | Path | None = None, *, download: bool = False,
         cache_dir: str | Path | None | bool = None):
    """The writers' images (strokes bright, in [0, 1]); each sample's writer in ``groups`` /
    ``test_groups``."""
    files, where, integrity, cache = read_files(SPEC, root, download, cache_dir)
    scratch = cache if cache is not None else Path(tempfile.gettempdir())
    arrays = leaf.cached(SPEC.name, files, cache, _KEYS, lambda: decode(files, scratch), _check)
    ds = images(SPEC, arrays["x_train"], arrays["y_train"], arrays["x_test"], arrays["y_test"], list(CLASSES),
                255.0, pad32, f"{where} ({len(arrays['users'])} writers)")
    ds.groups, ds.test_groups = arrays["g_train"].astype(np.int64), arrays["g_test"].astype(np.int64)
    ds.integrity = integrity
    return ds


SPEC = DATASETS.register(DatasetSpec(
    name="femnist",
    load=load,
    summary="FEMNIST (LEAF): 28x28 handwritten digits and letters, 62 classes, one client per writer "
            "(Caldas et al. 2018)",
    class_names=CLASSES,
    input_shape=(1, 28, 28),
    mean=(0.0,), std=(1.0,),
    normalisation="none: pixels inverted to bright strokes on black, scaled to [0, 1]",
    natural="writer",
    pad32_auto=True,
    files=FileSet(
        find=find,
        needed=f"{ARCHIVE} (TensorFlow Federated), or {H5[0]} and {H5[1]}, or LEAF's preprocessed "
               "data/train/*.json and data/test/*.json",
        remote=(mirrored(ARCHIVE, ("https://storage.googleapis.com/tff-datasets-public/",), TFF_SHA256, None),),
        hint="run LEAF's preprocessing (github.com/TalwalkarLab/leaf, data/femnist/preprocess.sh) and point "
             "data.root at its data/ folder",
    ),
))
