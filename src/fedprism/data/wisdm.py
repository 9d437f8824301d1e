"""WISDM activity recognition (Kwapisz, Weiss, Moore 2011, "Activity Recognition using Cell Phone
Accelerometers", SIGKDD Explorations 12(2)), release v1.1, file `WISDM_ar_v1.1_raw.txt`, as FedSub uses it
(Campana and Delmastro, Section 4.1): 36 users, six activities, 20 Hz tri-axial accelerometer readings cut
into 1-second windows without overlap, each window reduced to the mean of each axis (3 features).

Raw format, one reading per record: `user,activity,timestamp,x,y,z;` (records end with ';', several may
share a line, some lines are blank or truncated). Decisions: a window is 20 consecutive readings of the same
user and activity (a change of user or activity starts a new window; a last partial window is dropped);
records that do not parse (wrong field count, non-numeric values, unknown activity) are skipped and counted.

Not wired into `dataset=` yet, and no download: the archive's SHA-256 is not pinned here (see docs/fedsub.md).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

ACTIVITIES = ("Walking", "Jogging", "Upstairs", "Downstairs", "Sitting", "Standing")
RATE_HZ = 20


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
