"""Tiny files in the real formats of the LEAF datasets, EMNIST and Tiny-ImageNet, for offline tests.

* ``write_leaf_json(folder, train, test)``: LEAF's preprocessed output, ``data/train/*.json`` and
  ``data/test/*.json`` with ``users`` / ``num_samples`` / ``user_data``, users spread over two files.
* ``write_tff_h5(path, clients)`` / ``tff_archive(path, members)``: TensorFlow Federated's
  ``examples/<client>/<field>`` HDF5 files, and the ``.tar.bz2`` holding them.
* ``write_emnist_zip(path, split, ...)``: NIST's ``gzip.zip`` with ``gzip/emnist-<split>-*.gz`` IDX files
  and the mapping text, images stored transposed as NIST stores them.
* ``write_tiny_imagenet(folder, ...)``: the CS231n ``tiny-imagenet-200`` layout of JPEG files (optionally
  zipped), with ``wnids.txt``, ``words.txt``, ``train/<wnid>/images``, ``val/val_annotations.txt``.
"""

from __future__ import annotations

import gzip
import io
import json
import struct
import tarfile
import zipfile
from pathlib import Path

import numpy as np


def write_leaf_json(folder: Path, train: dict[str, dict], test: dict[str, dict], files: int = 2) -> Path:
    """Write users' {"x": [...], "y": [...]} into ``folder/data/{train,test}/all_data_<k>_..._niid_0_keep_0
    _{train,test}_9.json`` (LEAF's names), the users split over ``files`` files; returns ``folder``."""
    for split, users in (("train", train), ("test", test)):
        d = folder / "data" / split
        d.mkdir(parents=True, exist_ok=True)
        names = list(users)
        for k in range(files):
            mine = names[k::files]
            obj = {"users": mine, "num_samples": [len(users[u]["y"]) for u in mine],
                   "user_data": {u: users[u] for u in mine}}
            (d / f"all_data_{k}_niid_0_keep_0_{split}_9.json").write_text(json.dumps(obj))
    return folder


def write_tff_h5(path: Path, clients: dict[str, dict[str, np.ndarray]]) -> Path:
    import h5py

    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path, "w") as f:
        ex = f.create_group("examples")
        for cid, fields in clients.items():
            g = ex.create_group(cid)
            for k, v in fields.items():
                g.create_dataset(k, data=v)
    return path


def tff_archive(path: Path, members: dict[str, Path]) -> Path:
    """A ``.tar.bz2`` holding ``members`` (archive name -> local file), as TFF publishes them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:bz2") as tar:
        for name, src in members.items():
            tar.add(src, arcname=name)
    return path


def idx_bytes(a: np.ndarray) -> bytes:
    a = np.ascontiguousarray(a, dtype=np.uint8)
    return struct.pack(">I", 0x0800 + a.ndim) + struct.pack(f">{a.ndim}I", *a.shape) + a.tobytes()


def write_emnist_zip(path: Path, split: str, x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray,
                     y_test: np.ndarray, mapping: list[tuple[int, ...]], other_splits: tuple[str, ...] = ()
                     ) -> Path:
    """NIST's ``gzip.zip``: for ``split`` (and ``other_splits``, same content), the four
    ``gzip/emnist-<split>-{train,test}-{images-idx3,labels-idx1}-ubyte.gz`` (images given upright
    [n, 28, 28], stored transposed) and ``gzip/emnist-<split>-mapping.txt`` ("label ascii..." lines)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as z:
        for s in (split, *other_splits):
            for part, x, y in (("train", x_train, y_train), ("test", x_test, y_test)):
                z.writestr(f"gzip/emnist-{s}-{part}-images-idx3-ubyte.gz",
                           gzip.compress(idx_bytes(np.transpose(x, (0, 2, 1)))))
                z.writestr(f"gzip/emnist-{s}-{part}-labels-idx1-ubyte.gz", gzip.compress(idx_bytes(y)))
            z.writestr(f"gzip/emnist-{s}-mapping.txt",
                       "".join(" ".join(map(str, m)) + "\n" for m in mapping))
    return path


def jpeg(img: np.ndarray, mode: str = "RGB") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(img, mode=mode).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def write_tiny_imagenet(folder: Path, wnids: list[str], per_class: int = 3, val_per_class: int = 2,
                        seed: int = 0, zipped: bool = False, gray: int | None = None) -> dict:
    """The ``tiny-imagenet-200/`` layout (or its ``.zip``) with flat-colour 64x64 JPEGs, one colour per
    image, so that decoding is exact up to JPEG's rounding; returns what a loader must find: the
    expected mean colour and label of every train and val image in the loader's order (train: wnids in
    ``wnids.txt`` order, images by name; val: by file name). ``gray``: index of a train image written as
    a grayscale JPEG (the real data has some)."""
    rng = np.random.default_rng(seed)
    files: dict[str, bytes] = {}
    root = "tiny-imagenet-200/"
    files[root + "wnids.txt"] = "".join(w + "\n" for w in wnids).encode()
    words = "".join(f"{w}\tclass {w[-3:]}, other name\n" for w in wnids) + "n99999999\tunused entry\n"
    files[root + "words.txt"] = words.encode()
    train_colours, train_labels = [], []
    k = 0
    for c, w in enumerate(wnids):
        boxes = []
        for i in range(per_class):
            colour = rng.integers(20, 236, 3).astype(np.uint8)
            name = f"{w}_{i}.JPEG"
            if gray is not None and k == gray:
                colour = np.repeat(colour[:1], 3)
                files[root + f"train/{w}/images/{name}"] = jpeg(np.full((64, 64), colour[0], np.uint8), "L")
            else:
                files[root + f"train/{w}/images/{name}"] = jpeg(np.broadcast_to(colour, (64, 64, 3)).copy())
            boxes.append(f"{name}\t0\t0\t63\t63\n")
            train_colours.append(colour)
            train_labels.append(c)
            k += 1
        files[root + f"train/{w}/{w}_boxes.txt"] = "".join(boxes).encode()
    ann, val_colours, val_labels = [], [], []
    j = 0
    for c, w in enumerate(wnids):
        for _ in range(val_per_class):
            colour = rng.integers(20, 236, 3).astype(np.uint8)
            files[root + f"val/images/val_{j}.JPEG"] = jpeg(np.broadcast_to(colour, (64, 64, 3)).copy())
            ann.append((f"val_{j}.JPEG", w, colour, c))
            j += 1
    files[root + "val/val_annotations.txt"] = "".join(f"{n}\t{w}\t0\t0\t63\t63\n" for n, w, _, _ in ann).encode()
    files[root + "test/images/test_0.JPEG"] = jpeg(np.zeros((64, 64, 3), np.uint8))
    for n, _, colour, c in sorted(ann, key=lambda a: a[0]):
        val_colours.append(colour)
        val_labels.append(c)
    folder.mkdir(parents=True, exist_ok=True)
    if zipped:
        path = folder / "tiny-imagenet-200.zip"
        with zipfile.ZipFile(path, "w") as z:
            for name, data in files.items():
                z.writestr(name, data)
    else:
        path = folder / "tiny-imagenet-200"
        for name, data in files.items():
            p = folder / name
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
    # train order: wnids order, image names sorted (as strings)
    order = []
    k = 0
    for c, w in enumerate(wnids):
        names = [f"{w}_{i}.JPEG" for i in range(per_class)]
        idx = sorted(range(per_class), key=lambda i: names[i])
        order += [k + i for i in idx]
        k += per_class
    return {"path": path, "train_colours": np.array(train_colours)[order],
            "train_labels": np.array(train_labels)[order], "val_colours": np.array(val_colours),
            "val_labels": np.array(val_labels)}
