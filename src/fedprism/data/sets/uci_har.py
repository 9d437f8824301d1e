"""UCI HAR, human activity recognition using smartphones (Anguita, Ghio, Oneto, Parra, Reyes-Ortiz 2013, "A
Public Domain Dataset for Human Activity Recognition Using Smartphones", ESANN 2013): 30 subjects, six
activities, 10 299 windows of 2.56 s, each described by the 561 published time- and frequency-domain
features (already scaled to [-1, 1] by the authors, so they are used as published). Each window keeps its
subject, the dataset's natural client (`partition=natural`: one client per subject).

Format of the official archive ``UCI HAR Dataset.zip`` (or its extracted folder ``UCI HAR Dataset/``):
``train/X_train.txt`` and ``test/X_test.txt`` hold one window per line, 561 numbers separated by blanks;
``y_*.txt`` one activity 1..6 per line, ``subject_*.txt`` one subject 1..30 per line, in the same order;
``activity_labels.txt`` names the activities. Only these six files are read, in memory, each at most
``MAX_MEMBER_BYTES``; nothing is extracted to disk.

Splits (option ``split``):

* ``subject`` (default): the official train and test windows are pooled and, within each (subject,
  activity), a seeded ``round(test_fraction * n)`` of the n windows go to test
  (:func:`fedprism.data.grouped.split_within_groups`): every subject has local training and test data,
  the per-user stratified split of FedSub (Campana and Delmastro, Section 4.4). Neighbouring windows
  overlap by 50 %, so test accuracy is optimistic compared with a split by time.
* ``official``: the authors' split by subject, 21 training and 9 test subjects; `partition=natural` then
  gives the 21 training subjects, with no local test data (a global-model protocol).

The archive has no published checksum: its download is trusted on first use (docs/datasets.md).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedprism.data.base import DATASETS, Dataset, DatasetSpec, FileSet, float_option, int_option
from fedprism.data.cache import arrays_digest, cache_file, load_npz, save_npz
from fedprism.data.download import RemoteFile
from fedprism.data.files import read_files
from fedprism.data.grouped import read_zip_member, split_within_groups
from fedprism.errors import ConfigError, DataError

ACTIVITIES = ("WALKING", "WALKING_UPSTAIRS", "WALKING_DOWNSTAIRS", "SITTING", "STANDING", "LAYING")
FEATURES = 561
ARCHIVE = "UCI HAR Dataset.zip"
FOLDER = "UCI HAR Dataset"
MEMBERS = {f"{kind}_{split}": f"{split}/{kind.upper() if kind == 'x' else kind}_{split}.txt"
           for split in ("train", "test") for kind in ("x", "y", "subject")}
MAX_MEMBER_BYTES = 256 << 20
"""Largest member read (the real X_train.txt is about 63 MiB), so a hostile archive cannot exhaust memory."""
SPLITS = ("subject", "official")


def parse_matrix(text: str, where: str) -> np.ndarray:
    """Lines of exactly ``FEATURES`` finite numbers -> float32 [n, FEATURES]."""
    rows = [ln for ln in text.splitlines() if ln.strip()]
    try:
        values = np.array(" ".join(rows).split(), dtype=np.float64)
    except ValueError as e:
        raise DataError(f"{where}: a value is not a number ({e})") from None
    if values.size != len(rows) * FEATURES:
        bad = next((i for i, r in enumerate(rows) if len(r.split()) != FEATURES), None)
        line = bad + 1 if bad is not None else "?"
        raise DataError(f"{where}: line {line} does not hold {FEATURES} numbers; "
                        "not a UCI HAR feature file")
    if not np.isfinite(values).all():
        raise DataError(f"{where}: non-finite feature values")
    return values.reshape(len(rows), FEATURES).astype(np.float32)


def parse_ints(text: str, where: str, low: int, high: int) -> np.ndarray:
    """One integer in [low, high] per non-blank line -> int64 [n]."""
    try:
        v = np.array([int(t) for t in text.split()], dtype=np.int64)
    except ValueError as e:
        raise DataError(f"{where}: not one integer per line ({e})") from None
    if len(v) != len([ln for ln in text.splitlines() if ln.strip()]):
        raise DataError(f"{where}: not one integer per line")
    if v.size and (v.min() < low or v.max() > high):
        raise DataError(f"{where}: values must lie in {low}..{high}, found {v.min()}..{v.max()}")
    return v


def _texts(files: dict[str, Path]) -> dict[str, tuple[str, str]]:
    """key -> (text, where) of the six files, from the archive or the extracted folder."""
    out = {}
    for key, member in MEMBERS.items():
        if "archive" in files:
            path = files["archive"]
            data = read_zip_member(path, f"{FOLDER}/{member}", MAX_MEMBER_BYTES)
            where = f"{path}:{FOLDER}/{member}"
        else:
            path = files[key]
            try:
                if path.stat().st_size > MAX_MEMBER_BYTES:
                    raise DataError(f"{path}: more than {MAX_MEMBER_BYTES} bytes; not a UCI HAR file")
                data = path.read_bytes()
            except OSError as e:
                raise DataError(f"{path}: cannot read file ({e.strerror or e})") from None
            where = str(path)
        out[key] = (data.decode("ascii", errors="replace"), where)
    return out


_KEYS = ("x_train", "y_train", "s_train", "x_test", "y_test", "s_test")


_digest = arrays_digest("uci-har", _KEYS)


def _check(arrays: dict[str, np.ndarray], where: object) -> None:
    for split in ("train", "test"):
        x, y, s = arrays[f"x_{split}"], arrays[f"y_{split}"], arrays[f"s_{split}"]
        if x.dtype != np.float32 or x.ndim != 2 or x.shape[1] != FEATURES or y.shape != (len(x),) \
                or s.shape != (len(x),):
            raise DataError(f"{where}: {split} has features {x.dtype} {x.shape}, activities {y.shape}, "
                            f"subjects {s.shape}; they must be [n, {FEATURES}], [n], [n]")
        if not len(x):
            raise DataError(f"{where}: the {split} split holds no windows")
        if y.min() < 0 or y.max() >= len(ACTIVITIES):
            raise DataError(f"{where}: activities must lie in 1..{len(ACTIVITIES)}")


def decode(files: dict[str, Path], cache: Path | None) -> dict[str, np.ndarray]:
    """The official splits as arrays (features, activity 0..5, subject), through the decoded cache."""
    cfile = cache_file(SPEC.name, files, cache) if cache is not None else None
    arrays = load_npz(cfile, _KEYS, _digest, _check) if cfile is not None else None
    if arrays is not None:
        return arrays
    texts = _texts(files)
    arrays = {}
    for split in ("train", "test"):
        arrays[f"x_{split}"] = parse_matrix(*texts[f"x_{split}"])
        arrays[f"y_{split}"] = parse_ints(*texts[f"y_{split}"], 1, len(ACTIVITIES)) - 1
        arrays[f"s_{split}"] = parse_ints(*texts[f"subject_{split}"], 1, 10 ** 6)
        n = {k: len(arrays[f"{k}_{split}"]) for k in ("x", "y", "s")}
        if len(set(n.values())) != 1:
            raise DataError(f"{texts[f'x_{split}'][1]}: {n['x']} windows, {n['y']} activities and {n['s']} "
                            f"subjects in the {split} files; they must be equal")
    _check(arrays, next(iter(files.values())))
    if cfile is not None:
        save_npz(cfile, **arrays, digest=np.array(_digest(arrays)))
    return arrays


def find(d: Path) -> dict[str, Path] | str:
    if (d / ARCHIVE).is_file():
        return {"archive": d / ARCHIVE}
    for base in (d / FOLDER, d):
        paths = {k: base / m for k, m in MEMBERS.items()}
        present = [p for p in paths.values() if p.is_file()]
        if len(present) == len(paths):
            return paths
        if present:
            missing = sorted(str(p.relative_to(base)) for p in paths.values() if not p.is_file())
            return f"incomplete: missing {', '.join(missing)}"
    return f"no {ARCHIVE} and no {FOLDER}/"


def load(pad32: bool = False, root: str | Path | None = None, *, download: bool = False,
         cache_dir: str | Path | None | bool = None, split: str = "subject", seed: int = 0,
         test_fraction: float = 0.2) -> Dataset:
    """The 561-feature windows; each window's subject in ``groups`` / ``test_groups`` (see the module
    docstring for ``split``; ``seed`` and ``test_fraction`` apply to ``split="subject"``)."""
    if split not in SPLITS:
        raise ConfigError("split", split, f"one of {', '.join(SPLITS)}")
    seed = int_option("seed", seed, 0)
    test_fraction = float_option("test_fraction", test_fraction, 0.0, 1.0, open_low=True)
    files, where, integrity, cache = read_files(SPEC, root, download, cache_dir)
    a = decode(files, cache)
    if split == "official":
        xtr, ytr, gtr, xte, yte, gte = (a[k] for k in _KEYS)
    else:
        x = np.concatenate([a["x_train"], a["x_test"]])
        y = np.concatenate([a["y_train"], a["y_test"]])
        g = np.concatenate([a["s_train"], a["s_test"]])
        tr, te = split_within_groups(y, g, seed=seed, test_fraction=test_fraction)
        xtr, ytr, gtr, xte, yte, gte = x[tr], y[tr], g[tr], x[te], y[te], g[te]
        if not len(te):
            raise DataError(f"{where}: no test windows with test_fraction={test_fraction} ({len(y)} windows)")
    import torch          # here: listing the datasets imports this module, and needs no tensor

    ds = Dataset(name=SPEC.name, x_train=torch.from_numpy(np.ascontiguousarray(xtr)),
                 y_train=torch.from_numpy(ytr.astype(np.int64)),
                 x_test=torch.from_numpy(np.ascontiguousarray(xte)),
                 y_test=torch.from_numpy(yte.astype(np.int64)),
                 classes=list(ACTIVITIES), groups=gtr.astype(np.int64), test_groups=gte.astype(np.int64),
                 source=f"{where} (split={split})")
    ds.integrity = integrity
    return ds


SPEC = DATASETS.register(DatasetSpec(
    name="uci_har",
    load=load,
    summary="UCI HAR: 10 299 smartphone windows, 561 features, 6 activities, 30 subjects "
            "(Anguita et al. 2013)",
    class_names=ACTIVITIES,
    input_shape=(FEATURES,),
    normalisation="none (the published features are already scaled to [-1, 1])",
    natural="subject",
    options=("split", "seed", "test_fraction"),
    files=FileSet(
        find=find,
        needed=f"{ARCHIVE}, or its extracted {FOLDER}/ with train/ and test/ X_*, y_*, subject_*.txt",
        # no checksum is published: trust on first use (fedprism.data.download)
        remote=(RemoteFile(ARCHIVE, (
            "https://archive.ics.uci.edu/ml/machine-learning-databases/00240/UCI%20HAR%20Dataset.zip",
            "https://d396qusza40orc.cloudfront.net/getdata%2Fprojectfiles%2FUCI%20HAR%20Dataset.zip"),
            tofu=True),),
    ),
))
