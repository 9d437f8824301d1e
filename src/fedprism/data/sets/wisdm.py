"""WISDM activity recognition (Kwapisz, Weiss, Moore 2011, "Activity Recognition using Cell Phone
Accelerometers", SIGKDD Explorations 12(2)), release v1.1, file `WISDM_ar_v1.1_raw.txt`, as FedSub uses it
(Campana and Delmastro, Section 4.1): 36 users, six activities, 20 Hz tri-axial accelerometer readings cut
into 1-second windows without overlap, each window reduced to the mean of each axis (3 features). Each
window keeps its user, the dataset's natural client (`partition=natural`).

Raw format, one reading per record: `user,activity,timestamp,x,y,z;` (records end with ';', several may
share a line, some lines are blank or truncated). Decisions: a window is 20 consecutive readings of the same
user and activity (a change of user or activity starts a new window; a last partial window is dropped);
records that do not parse (wrong field count, empty or non-numeric or non-finite values, unknown activity)
are skipped and counted.

The raw file is read from the official archive `WISDM_ar_latest.tar.gz` (`read_archive`: only the member
`WISDM_ar_v1.1/WISDM_ar_v1.1_raw.txt`, a regular file, read into memory; nothing is extracted to disk) or
from the extracted file; its windows are cached like decoded images (`fedprism.data.cache`), and each
user's windows are split into train and test with `split_by_user`, then standardised with the training
windows' per-axis mean and std. The archive has no published checksum: its download is trusted on first
use (`fedprism.data.download`, docs/datasets.md).
"""

from __future__ import annotations

import hashlib
import math
import tarfile
import zlib
from pathlib import Path

import numpy as np

from fedprism.data.base import DATASETS, Dataset, DatasetSpec, FileSet, float_option, int_option
from fedprism.data.cache import cache_file, load_npz, save_npz
from fedprism.data.download import RemoteFile
from fedprism.data.files import read_files
from fedprism.errors import DataError

ACTIVITIES = ("Walking", "Jogging", "Upstairs", "Downstairs", "Sitting", "Standing")
RATE_HZ = 20
ARCHIVE = "WISDM_ar_latest.tar.gz"
RAW_FILE = "WISDM_ar_v1.1_raw.txt"
MEMBER = f"WISDM_ar_v1.1/{RAW_FILE}"
MAX_RAW_BYTES = 256 << 20
"""Largest raw file accepted (the real one is about 49 MiB), so a hostile archive cannot exhaust memory."""


def parse_raw(text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(users [n] int64, labels [n] int64, xyz [n, 3] float32, skipped records) in file order."""
    users, labels, xyz, skipped = [], [], [], 0
    index = {a: i for i, a in enumerate(ACTIVITIES)}
    for rec in text.replace("\n", ";").split(";"):
        rec = rec.strip().strip(",")
        if not rec:
            continue
        f = rec.split(",")
        try:
            if len(f) != 6 or f[1] not in index:
                raise ValueError
            u, x, y, z = int(f[0]), float(f[3]), float(f[4]), float(f[5])
            if not (math.isfinite(x) and math.isfinite(y) and math.isfinite(z)) or not -2 ** 62 < u < 2 ** 62:
                raise ValueError
        except ValueError:
            skipped += 1
            continue
        users.append(u)
        labels.append(index[f[1]])
        xyz.append((x, y, z))
    return (np.asarray(users, np.int64), np.asarray(labels, np.int64),
            np.asarray(xyz, np.float32).reshape(-1, 3), skipped)


def windows(users: np.ndarray, labels: np.ndarray, xyz: np.ndarray, size: int = RATE_HZ
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Non-overlapping windows of `size` readings within runs of equal (user, activity): (features [m, 3]
    = per-axis means, labels [m], users [m])."""
    feats, ys, us = [], [], []
    start = 0
    for i in range(1, len(users) + 1):
        if i == len(users) or users[i] != users[start] or labels[i] != labels[start]:
            for s in range(start, i - size + 1, size):
                feats.append(xyz[s:s + size].mean(0))
                ys.append(labels[start])
                us.append(users[start])
            start = i
    return (np.asarray(feats, np.float32).reshape(-1, 3), np.asarray(ys, np.int64), np.asarray(us, np.int64))


def load_raw(path: str | Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Windows of a `WISDM_ar_v1.1_raw.txt` file: (features [m, 3], labels [m], users [m])."""
    users, labels, xyz, _ = parse_raw(Path(path).read_text(encoding="utf-8", errors="replace"))
    return windows(users, labels, xyz)


def read_archive(path: str | Path) -> str:
    """The text of `WISDM_ar_v1.1/WISDM_ar_v1.1_raw.txt` inside the official archive, read in memory.

    Only that member is read, and only if it is a regular file (not a link, device or folder) of at most
    `MAX_RAW_BYTES`; every other member is ignored and nothing is written to disk, so member names such as
    `../x` or absolute paths cannot place files anywhere. A missing, duplicated or oversized member and an
    unreadable archive are :class:`DataError`s naming the archive.
    """
    path = Path(path)
    found = []
    try:
        with tarfile.open(path, "r:gz") as tar:
            for member in tar:
                if member.name.removeprefix("./") != MEMBER:
                    continue
                if not member.isfile():
                    kind = "a link" if member.issym() or member.islnk() else "not a regular file"
                    raise DataError(f"{path}: member {member.name!r} is {kind}; refusing it (the official "
                                    "archive holds a regular file there)")
                if member.size > MAX_RAW_BYTES:
                    raise DataError(f"{path}: member {member.name!r} is {member.size} bytes, more than the "
                                    f"{MAX_RAW_BYTES} accepted; not the official archive")
                src = tar.extractfile(member)
                assert src is not None
                with src:
                    data = src.read(MAX_RAW_BYTES + 1)
                found.append(data)
    except (tarfile.TarError, OSError, EOFError, zlib.error) as e:
        raise DataError(f"{path}: cannot read the archive ({type(e).__name__}: {e}); "
                        "it is truncated or corrupt, download it again") from e
    if not found:
        raise DataError(f"{path}: the archive lacks {MEMBER}; not the WISDM v1.1 archive")
    if len(found) > 1:
        raise DataError(f"{path}: the archive holds {MEMBER} {len(found)} times; "
                        "refusing an ambiguous archive")
    return found[0].decode("utf-8", errors="replace")


def split_by_user(labels: np.ndarray, users: np.ndarray, seed: int = 0, test_fraction: float = 0.2
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Sorted (train, test) window indices: within each (user, activity), a seeded random
    `round(test_fraction * n)` of its n windows go to test, the rest to train.

    One `numpy.random.default_rng(seed)` stream visits the (user, activity) groups in ascending order, so
    the split depends on the data and `seed` only. Every user keeps the activity mix of its windows in
    both splits. Windows next to each other in time can fall on both sides (a random split, as is usual
    for WISDM; neighbouring 1-second windows are correlated, so test accuracy is optimistic compared
    with a split by time).
    """
    labels, users = np.asarray(labels, np.int64), np.asarray(users, np.int64)
    rng = np.random.default_rng(seed)
    order = np.lexsort((np.arange(len(labels)), labels, users))          # by user, activity, position
    key = users[order] * len(ACTIVITIES) + labels[order]
    bounds = np.flatnonzero(np.diff(key)) + 1 if len(key) else np.zeros(0, np.int64)
    test = []
    for group in np.split(order, bounds) if len(key) else []:
        n_test = int(round(test_fraction * len(group)))
        test.append(rng.permutation(group)[:n_test])
    test_idx = np.sort(np.concatenate(test)) if test else np.zeros(0, np.int64)
    is_test = np.zeros(len(labels), bool)
    is_test[test_idx] = True
    return np.flatnonzero(~is_test).astype(np.int64), test_idx.astype(np.int64)


# ----------------------------------------------------------------------------------- the dataset

_WINDOW_KEYS = ("features", "labels", "users", "skipped")


def _window_digest(arrays: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256(b"wisdm-windows")
    for key in _WINDOW_KEYS:
        a = np.ascontiguousarray(arrays[key])
        h.update(f"{key}{a.dtype.str}{a.shape}".encode())
        h.update(a.data)
    return h.hexdigest()


def _check_windows(arrays: dict[str, np.ndarray], where: object) -> None:
    f, y, u = arrays["features"], arrays["labels"], arrays["users"]
    n = len(f)
    if f.dtype != np.float32 or f.ndim != 2 or f.shape[1] != 3 or y.shape != (n,) or u.shape != (n,):
        raise DataError(f"{where}: windows have features {f.dtype} {f.shape}, labels {y.shape}, "
                        f"users {u.shape}")
    if len(y) and (y.min() < 0 or y.max() >= len(ACTIVITIES)):
        raise DataError(f"{where}: activity labels must lie in 0..{len(ACTIVITIES) - 1}, "
                        f"found {y.min()}..{y.max()}")
    if not np.isfinite(f).all():
        raise DataError(f"{where}: non-finite window features")


def _wisdm_windows(files: dict[str, Path], cache: Path | None) -> dict[str, np.ndarray]:
    """1-second windows (features [m, 3], labels, users) of the raw file, through the decoded cache."""
    cfile = cache_file(SPEC.name, files, cache) if cache is not None else None
    arrays = load_npz(cfile, _WINDOW_KEYS, _window_digest, _check_windows) if cfile is not None else None
    if arrays is not None:
        return arrays
    path = files.get("archive") or files["raw"]
    if "archive" in files:
        text = read_archive(path)
    else:
        try:
            if path.stat().st_size > MAX_RAW_BYTES:
                raise DataError(f"{path}: {path.stat().st_size} bytes, more than the {MAX_RAW_BYTES} "
                                f"accepted; not {RAW_FILE}")
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError as e:
            raise DataError(f"{path}: cannot read file ({e.strerror or e})") from None
    users, labels, xyz, skipped = parse_raw(text)
    features, y, u = windows(users, labels, xyz)
    if len(y) == 0:
        raise DataError(f"{path}: no complete window of {RATE_HZ} readings of one user and activity "
                        f"({len(users)} records parsed, {skipped} skipped); not the WISDM raw data")
    arrays = {"features": features, "labels": y, "users": u, "skipped": np.array(skipped, np.int64)}
    _check_windows(arrays, path)
    if cfile is not None:
        save_npz(cfile, **arrays, digest=np.array(_window_digest(arrays)))
    return arrays


def _load_wisdm(files: dict[str, Path], where: Path, cache: Path | None, seed: int,
                test_fraction: float) -> Dataset:
    """Windows split per user (`split_by_user`), standardised with the training windows' per-axis
    mean and std; each window's user goes to ``groups`` / ``test_groups``."""
    arrays = _wisdm_windows(files, cache)
    x, y, users = arrays["features"], arrays["labels"], arrays["users"]
    tr, te = split_by_user(y, users, seed=seed, test_fraction=test_fraction)
    if len(tr) == 0:
        raise DataError(f"{where}: no training windows left with test_fraction={test_fraction} "
                        f"({len(y)} windows in all)")
    mean = x[tr].astype(np.float64).mean(axis=0)
    std = x[tr].astype(np.float64).std(axis=0)
    std[std == 0] = 1.0
    xs = ((x - mean) / std).astype(np.float32)
    import torch          # here: listing the datasets imports this module, and needs no tensor

    return Dataset(name=SPEC.name,
                   x_train=torch.from_numpy(xs[tr]), y_train=torch.from_numpy(y[tr].astype(np.int64)),
                   x_test=torch.from_numpy(xs[te]), y_test=torch.from_numpy(y[te].astype(np.int64)),
                   classes=list(ACTIVITIES), groups=users[tr].astype(np.int64),
                   test_groups=users[te].astype(np.int64),
                   mean=tuple(float(v) for v in mean), std=tuple(float(v) for v in std),
                   source=f"{where} ({int(arrays['skipped'])} malformed records skipped)")


def find(d: Path) -> dict[str, Path] | str:
    for p in (d / ARCHIVE, d / MEMBER, d / RAW_FILE):
        if p.is_file():
            return {"archive" if p.name == ARCHIVE else "raw": p}
    return f"no {ARCHIVE} and no {RAW_FILE}"


def load(pad32: bool = False, root: str | Path | None = None, *, download: bool = False,
         cache_dir: str | Path | None | bool = None, seed: int = 0, test_fraction: float = 0.2) -> Dataset:
    """The windows split per user (``seed`` 0, ``test_fraction`` 0.2 of each user's windows of each
    activity to test), standardised; each window's user in ``groups`` / ``test_groups``."""
    split = {"seed": int_option("seed", seed, 0),
             "test_fraction": float_option("test_fraction", test_fraction, 0.0, 1.0, open_low=True)}
    files, where, integrity, cache = read_files(SPEC, root, download, cache_dir)
    ds = _load_wisdm(files, where, cache, **split)
    ds.integrity = integrity
    return ds


SPEC = DATASETS.register(DatasetSpec(
    name="wisdm",
    load=load,
    summary="WISDM v1.1 activity recognition: 1-second windows of 20 Hz accelerometer readings as 3 per-axis "
            "means, 36 users (Kwapisz et al. 2011)",
    class_names=ACTIVITIES,
    input_shape=(3,),
    normalisation="per feature, with the training windows' mean and std (computed at load time)",
    natural="user",
    options=("seed", "test_fraction"),
    files=FileSet(
        find=find,
        needed=f"{ARCHIVE}, or {RAW_FILE} (on its own or in WISDM_ar_v1.1/)",
        # no checksum is published: trust on first use (fedprism.data.download)
        remote=(RemoteFile(ARCHIVE, ("https://www.cis.fordham.edu/wisdm/includes/datasets/latest/" + ARCHIVE,),
                           tofu=True),),
    ),
))
