"""WISDM activity recognition (Kwapisz, Weiss, Moore 2011, "Activity Recognition using Cell Phone
Accelerometers", SIGKDD Explorations 12(2)), release v1.1, file `WISDM_ar_v1.1_raw.txt`, as FedSub uses it
(Campana and Delmastro, Section 4.1): 36 users, six activities, 20 Hz tri-axial accelerometer readings cut
into 1-second windows without overlap, each window reduced to the mean of each axis (3 features).

Raw format, one reading per record: `user,activity,timestamp,x,y,z;` (records end with ';', several may
share a line, some lines are blank or truncated). Decisions: a window is 20 consecutive readings of the same
user and activity (a change of user or activity starts a new window; a last partial window is dropped);
records that do not parse (wrong field count, empty or non-numeric or non-finite values, unknown activity)
are skipped and counted.

`dataset=wisdm` (`fedprism.data.datasets.load_dataset`) reads the raw file from the official archive
`WISDM_ar_latest.tar.gz` (`read_archive`: only the member `WISDM_ar_v1.1/WISDM_ar_v1.1_raw.txt`, a regular
file, read into memory; nothing is extracted to disk) or from the extracted file, and splits each user's
windows into train and test with `split_by_user`. The archive has no published checksum: its download is
trusted on first use (`fedprism.data.download`, docs/datasets.md).
"""

from __future__ import annotations

import math
import tarfile
import zlib
from pathlib import Path

import numpy as np

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
