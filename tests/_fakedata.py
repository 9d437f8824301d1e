"""Tiny fake datasets in the real on-disk formats, for tests that must run offline and fast.

``write_fake(name, folder)`` writes a complete, tiny copy of dataset ``name`` (IDX files for
fmnist/mnist, pickled batches or the .tar.gz for cifar10/cifar100, .mat files for svhn) and returns the
exact uint8 images ([N, C, H, W]), labels and class names that a loader must give back. Every class
appears in both splits. ``isolate(monkeypatch, tmp_path)`` points fedprism's data and cache folders at
``tmp_path`` so that a test never sees the real ~/.cache or /usr/share/datasets. ``write_usps`` writes
LIBSVM-format ``usps.bz2`` / ``usps.t.bz2``; ``write_wisdm`` the WISDM v1.1 raw text (with the malformed
records the real file has) inside ``WISDM_ar_latest.tar.gz``, with the windows a loader must find.

    from _fakedata import isolate, write_fake
    fake = write_fake("fmnist", tmp_path / "fm", n_train=200, n_test=50)
    ds = load_dataset("fmnist", root=tmp_path / "fm")
"""

from __future__ import annotations

import bz2
import gzip
import io
import pickle
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FMNIST_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                  "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]
DIGITS = [str(i) for i in range(10)]


@dataclass
class FakeData:
    """What a loader must return for a fake dataset: uint8 images [N, C, H, W], int64 labels."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    classes: list[str]
    folder: Path


def isolate(monkeypatch, tmp_path: Path) -> Path:
    """Send FEDPRISM_CACHE to ``tmp_path/cache``, unset FEDPRISM_DATA, hide Debian's FMNIST copy, and
    forget the known dataset digests (fake files are reported unverified, never mismatched)."""
    from fedprism.data import integrity

    # fake files carry official names but not the official bytes: no known digests for them
    monkeypatch.setattr(integrity, "KNOWN", {})
    monkeypatch.setattr(integrity, "KNOWN_MD5", {})
    monkeypatch.setenv("FEDPRISM_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("FEDPRISM_DATA", raising=False)
    search_folders(monkeypatch, "fmnist", tmp_path / "no-debian-fmnist")
    return tmp_path / "cache"


def search_folders(monkeypatch, name: str, *folders: Path) -> None:
    """Make dataset `name` search `folders` instead of the extra folders its spec names (Debian's
    /usr/share/datasets/fashion-mnist), for the rest of the test."""
    from dataclasses import replace

    from fedprism.data.base import DATASETS

    import sys

    spec = DATASETS.get(name)                 # registered now, so the original comes back afterwards
    patched = replace(spec, files=replace(spec.files, folders=tuple(folders)))
    monkeypatch.setitem(DATASETS._items, name, patched)            # what load_dataset looks up
    monkeypatch.setattr(sys.modules[spec.module], "SPEC", patched)  # what the dataset's loader reads


def _images(rng: np.random.Generator, n: int, shape: tuple[int, ...]) -> np.ndarray:
    return rng.integers(0, 256, size=(n, *shape), dtype=np.uint8)


def _labels(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """Every class at least once when n >= k, then random, shuffled."""
    y = np.concatenate([np.arange(min(n, k)), rng.integers(0, k, max(0, n - k))])
    return rng.permutation(y).astype(np.int64)


# ------------------------------------------------------------------------------------------- IDX


def idx_bytes(array: np.ndarray, magic: int | None = None) -> bytes:
    """The IDX encoding of a uint8 array (``magic`` overrides the header's magic number)."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    if magic is None:
        magic = 0x0800 + array.ndim
    header = magic.to_bytes(4, "big") + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    return header + array.tobytes()


def write_idx(path: str | Path, array: np.ndarray, magic: int | None = None) -> Path:
    """Write an IDX file, gzip-compressed when ``path`` ends with .gz."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = idx_bytes(array, magic)
    path.write_bytes(gzip.compress(data, mtime=0) if path.suffix == ".gz" else data)
    return path


def write_idx_dataset(folder: str | Path, n_train: int = 30, n_test: int = 12, gz: bool = True,
                      seed: int = 0, classes: list[str] | None = None, size: int = 28) -> FakeData:
    """train-/t10k- images and labels IDX files (28x28 by default) in ``folder``."""
    folder = Path(folder)
    rng = np.random.default_rng(seed)
    ext = ".gz" if gz else ""
    xtr, xte = _images(rng, n_train, (size, size)), _images(rng, n_test, (size, size))
    ytr, yte = _labels(rng, n_train, 10), _labels(rng, n_test, 10)
    write_idx(folder / f"train-images-idx3-ubyte{ext}", xtr)
    write_idx(folder / f"train-labels-idx1-ubyte{ext}", ytr.astype(np.uint8))
    write_idx(folder / f"t10k-images-idx3-ubyte{ext}", xte)
    write_idx(folder / f"t10k-labels-idx1-ubyte{ext}", yte.astype(np.uint8))
    return FakeData(xtr[:, None], ytr, xte[:, None], yte, list(classes or DIGITS), folder)


# ----------------------------------------------------------------------------------------- CIFAR


def _pickle(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=2)


def write_cifar(folder: str | Path, name: str = "cifar10", n_per_batch: int = 6, n_test: int = 10,
                seed: int = 0, archive: bool = False) -> FakeData:
    """CIFAR "python version" files: ``folder/cifar-10-batches-py/`` (5 train batches, test batch,
    batches.meta) or ``folder/cifar-100-python/`` (train, test, meta with fine and coarse labels);
    with ``archive=True`` the official .tar.gz in ``folder`` instead of the extracted folder."""
    folder = Path(folder)
    rng = np.random.default_rng(seed)
    if name == "cifar10":
        sub, k, label_key = "cifar-10-batches-py", 10, b"labels"
        train_files = [f"data_batch_{i}" for i in range(1, 6)]
        names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
        meta = ("batches.meta", {b"label_names": [n.encode() for n in names], b"num_cases_per_batch": 10000})
        test_file, tar_name = "test_batch", "cifar-10-python.tar.gz"
    elif name == "cifar100":
        sub, k, label_key = "cifar-100-python", 100, b"fine_labels"
        train_files = ["train"]
        names = [f"class_{i:03d}" for i in range(100)]
        meta = ("meta", {b"fine_label_names": [n.encode() for n in names],
                         b"coarse_label_names": [f"super_{i}".encode() for i in range(20)]})
        test_file, tar_name = "test", "cifar-100-python.tar.gz"
    else:
        raise ValueError(name)
    stage = folder / (".stage-" + sub if archive else sub)
    per_file = n_per_batch if name == "cifar10" else max(n_per_batch, k)
    n_total = per_file * len(train_files)
    x_all, y_all = _images(rng, n_total, (3, 32, 32)), _labels(rng, n_total, k)
    for i, fname in enumerate(train_files):
        x, y = x_all[i * per_file:(i + 1) * per_file], y_all[i * per_file:(i + 1) * per_file]
        batch = {b"batch_label": f"training batch {i + 1} of {len(train_files)}".encode(),
                 b"data": x.reshape(per_file, -1), label_key: [int(v) for v in y],
                 b"filenames": [f"img_{i}_{j}.png".encode() for j in range(per_file)]}
        if name == "cifar100":
            batch[b"coarse_labels"] = [int(v) // 5 for v in y]
        _pickle(stage / fname, batch)
    n_te = n_test if name == "cifar10" else max(n_test, k)
    xte, yte = _images(rng, n_te, (3, 32, 32)), _labels(rng, n_te, k)
    test = {b"batch_label": b"testing batch 1 of 1", b"data": xte.reshape(n_te, -1),
            label_key: [int(v) for v in yte]}
    if name == "cifar100":
        test[b"coarse_labels"] = [int(v) // 5 for v in yte]
    _pickle(stage / test_file, test)
    _pickle(stage / meta[0], meta[1])
    if archive:
        with tarfile.open(folder / tar_name, "w:gz") as tar:
            tar.add(stage, arcname=sub)
        for p in stage.iterdir():
            p.unlink()
        stage.rmdir()
    return FakeData(x_all, y_all, xte, yte, names, folder)


# ------------------------------------------------------------------------------------------ SVHN


def write_svhn(folder: str | Path, n_train: int = 20, n_test: int = 12, seed: int = 0) -> FakeData:
    """train_32x32.mat / test_32x32.mat with X [32, 32, 3, N] uint8 and y [N, 1] in 1..10 (10 = digit 0)."""
    from scipy.io import savemat

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    out = []
    for fname, n in (("train_32x32.mat", n_train), ("test_32x32.mat", n_test)):
        x, y = _images(rng, n, (3, 32, 32)), _labels(rng, n, 10)
        stored_y = np.where(y == 0, 10, y).astype(np.uint8)[:, None]
        savemat(folder / fname, {"X": np.ascontiguousarray(x.transpose(2, 3, 1, 0)), "y": stored_y})
        out += [x, y]
    return FakeData(*out, DIGITS, folder)


# ------------------------------------------------------------------------------------------ USPS


def usps_line(image: np.ndarray, label: int) -> str:
    """One LIBSVM line of a 16x16 uint8 image: ``label+1`` then ``index:value`` with value in [-1, 1]
    chosen so that ``uint8((value + 1) / 2 * 255)`` gives the pixel back; pixel 127 is written as an
    absent index (value 0, the sparse convention); a trailing space as in the LIBSVM files."""
    parts = [str(int(label) + 1)]
    for i, px in enumerate(np.asarray(image, np.uint8).reshape(-1), 1):
        if px == 127:
            continue
        v = 1.0 if px == 255 else (int(px) + 0.5) / 127.5 - 1.0
        parts.append(f"{i}:{v:.6f}")
    return " ".join(parts) + " \n"


def write_usps(folder: str | Path, n_train: int = 30, n_test: int = 12, seed: int = 0,
               compress: bool = True) -> FakeData:
    """usps.bz2 / usps.t.bz2 (LIBSVM format, labels 1..10 for digits 0..9); plain usps / usps.t when
    ``compress=False``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    out = []
    for base, n in (("usps", n_train), ("usps.t", n_test)):
        x, y = _images(rng, n, (1, 16, 16)), _labels(rng, n, 10)
        x[:, :, 0, 0], x[:, :, 0, 1], x[:, :, 0, 2] = 0, 255, 127      # both ends and an absent index
        text = "".join(usps_line(img, lab) for img, lab in zip(x, y)).encode("ascii")
        if compress:
            (folder / f"{base}.bz2").write_bytes(bz2.compress(text))
        else:
            (folder / base).write_bytes(text)
        out += [x, y]
    return FakeData(*out, DIGITS, folder)


# ----------------------------------------------------------------------------------------- WISDM

WISDM_ACTIVITIES = ["Walking", "Jogging", "Upstairs", "Downstairs", "Sitting", "Standing"]


@dataclass
class FakeWisdm:
    """A WISDM raw text and the windows a parser must find in it, in file order."""

    text: str
    features: np.ndarray     # [m, 3] per-axis means of 20 readings
    labels: np.ndarray       # [m] activity index
    users: np.ndarray        # [m] user id
    skipped: int             # records that must not parse
    path: Path | None = None


def wisdm_text(runs: list[tuple[int, str, int]] | None = None, seed: int = 0) -> FakeWisdm:
    """Raw text in the `user,activity,timestamp,x,y,z;` format, one run of readings per (user, activity,
    n) in ``runs``, with what the real file has besides: blank lines, a record ending ',;', several
    records on one line, CRLF line ends, and records that must be skipped (truncated, an empty field, an
    unknown activity, a non-numeric and a non-finite value) between the readings of a run."""
    rng = np.random.default_rng(seed)
    if runs is None:
        runs = [(u, a, n) for u in (33, 7, 12) for a, n in (("Walking", 205), ("Jogging", 167), ("Sitting", 83))]
    lines: list[str] = []
    feats, labels, users = [], [], []
    skipped = 0
    junk = ["{u},Jogging,1,2.0,;", "{u},Walking,49105962326000,,1.5,2.0;", "{u},Flying,1,1,1,1;",
            "{u},Sitting,12,abc,0.1,0.2;", "{u},Standing,12,nan,0.1,0.2;"]
    for r, (u, act, n) in enumerate(runs):
        xyz = np.round(rng.normal(0, 5, (n, 3)), 4).astype(np.float32)
        t0 = 49105962326000 + 10**9 * r
        for i in range(n):
            rec = f"{u},{act},{t0 + 50_000_000 * i},{xyz[i, 0]},{xyz[i, 1]},{xyz[i, 2]}"
            if i % 50 == 7:
                lines.append(rec + ",;")                            # trailing comma before ';'
            elif i % 50 == 11 and lines:
                lines[-1] += rec + ";"                              # two records on one line
            else:
                lines.append(rec + ";")
            if i % 40 == 13:
                lines.append(junk[(i // 40 + r) % len(junk)].format(u=u))
                skipped += 1
            if i % 60 == 17:
                lines.append("")
        for s in range(0, n - 19, 20):
            feats.append(xyz[s:s + 20].astype(np.float32).mean(0))
            labels.append(WISDM_ACTIVITIES.index(act))
            users.append(u)
    text = "\r\n".join(lines[: len(lines) // 2]) + "\r\n" + "\n".join(lines[len(lines) // 2:]) + "\n"
    return FakeWisdm(text, np.asarray(feats, np.float32).reshape(-1, 3), np.asarray(labels, np.int64),
                     np.asarray(users, np.int64), skipped)


def wisdm_archive_bytes(text: str, member: str = "WISDM_ar_v1.1/WISDM_ar_v1.1_raw.txt",
                        extra: list[tarfile.TarInfo] | None = None) -> bytes:
    """A .tar.gz laid out as the official WISDM_ar_latest.tar.gz: the raw text and the other v1.1 files."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 0
            tar.addfile(info, io.BytesIO(data))
        add("WISDM_ar_v1.1/readme.txt", b"Readme file for WISDM's activity prediction dataset v1.1\n")
        add(member, text.encode("utf-8"))
        add("WISDM_ar_v1.1/WISDM_ar_v1.1_transformed.arff", b"@relation person_activities_labeled\n")
        for info in extra or []:
            tar.addfile(info, io.BytesIO(b"x" * info.size) if info.isfile() else None)
    return buf.getvalue()


def write_wisdm(folder: str | Path, archive: bool = True, seed: int = 0,
                runs: list[tuple[int, str, int]] | None = None) -> FakeWisdm:
    """``folder/WISDM_ar_latest.tar.gz`` (or the extracted ``WISDM_ar_v1.1/WISDM_ar_v1.1_raw.txt``)."""
    folder = Path(folder)
    fake = wisdm_text(runs, seed)
    if archive:
        folder.mkdir(parents=True, exist_ok=True)
        fake.path = folder / "WISDM_ar_latest.tar.gz"
        fake.path.write_bytes(wisdm_archive_bytes(fake.text))
    else:
        fake.path = folder / "WISDM_ar_v1.1" / "WISDM_ar_v1.1_raw.txt"
        fake.path.parent.mkdir(parents=True, exist_ok=True)
        fake.path.write_bytes(fake.text.encode("utf-8"))
    return fake


# ------------------------------------------------------------------------------------------- any


def write_fake(name: str, folder: str | Path, n_train: int = 30, n_test: int = 12, seed: int = 0,
               **kw) -> FakeData:
    """A tiny fake copy of dataset ``name`` in ``folder`` (loadable with ``root=folder``)."""
    if name in ("fmnist", "mnist"):
        classes = FMNIST_CLASSES if name == "fmnist" else DIGITS
        return write_idx_dataset(folder, n_train, n_test, seed=seed, classes=classes, **kw)
    if name == "cifar10":
        return write_cifar(folder, name, n_per_batch=max(2, -(-n_train // 5)), n_test=n_test, seed=seed, **kw)
    if name == "cifar100":
        return write_cifar(folder, name, n_per_batch=n_train, n_test=n_test, seed=seed, **kw)
    if name == "svhn":
        return write_svhn(folder, n_train, n_test, seed=seed)
    if name == "usps":
        return write_usps(folder, n_train, n_test, seed=seed, **kw)
    raise ValueError(f"no fake files for dataset {name!r}")
