"""Shakespeare, LEAF's next-character prediction task (Caldas et al. 2018, "LEAF: A Benchmark for Federated
Settings", arXiv:1812.01097; the task of McMahan et al. 2017, arXiv:1602.05629): the lines of each speaking
role of The Complete Works of William Shakespeare, one natural client per role (`partition=natural`).

Token data: each sample is 80 character ids (int64 ``[n, 80]``) and its label the id of the character
that follows; ids index LEAF's 80-character vocabulary (``VOCAB``, LEAF's ``ALL_LETTERS`` in
``models/utils/language_utils.py``), which is also the 80 classes (``vocab_size`` 80).

Read from either of two files (:mod:`fedprism.data.leaf`):

* TensorFlow Federated's copy, ``shakespeare.tar.bz2`` (what `fedprism data download shakespeare`
  fetches, checked against the SHA-256 TFF publishes in ``tff.simulation.datasets.shakespeare
  .load_data``) or its extracted ``shakespeare_train.h5`` / ``shakespeare_test.h5``:
  ``examples/<role>/snippets``, the role's lines, each role in both files. Each role's lines of one file
  are made into samples as LEAF's ``txt_to_data`` makes them from the file LEAF writes them to: each
  line followed by a newline, every newline replaced by a space, runs of two or more spaces collapsed to one, then every window of 80
  consecutive characters with the character after it (stride 1).
* LEAF's preprocessed JSON output (``data/train/*.json``, ``data/test/*.json`` from LEAF's
  ``preprocess.sh``): ``user_data[role]`` holds ``x``, strings of 80 characters, and ``y``, the next
  characters. Generated locally, so no digest covers it: used with an ``UnverifiedDataWarning``.

Decisions: a sample holding a character outside the 80 (the TFF text has a few, such as ``|``) is
dropped and counted (``Dataset.source``), as no id exists for it. The train file gives the train split
and the test file the test split; each role keeps its id (`fedprism.data.leaf.group_ids`), so a natural
client's local test set is its own role's test samples.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

import numpy as np

from fedprism.data import leaf
from fedprism.data.base import DATASETS, Dataset, DatasetSpec, FileSet
from fedprism.data.download import mirrored
from fedprism.data.files import read_files
from fedprism.errors import DataError

VOCAB = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
"""LEAF's 80 characters, in LEAF's order (id = position)."""
SEQ_LEN = 80
ARCHIVE = "shakespeare.tar.bz2"
H5 = ("shakespeare_train.h5", "shakespeare_test.h5")
TFF_SHA256 = "0285be9906cb5f268092eee4edeeacfc2af4574f2941f7cc2f08a321d7f5c707"
CLASSES = tuple("\\n" if c == "\n" else c for c in VOCAB)
_KEYS = ("x_train", "y_train", "g_train", "x_test", "y_test", "g_test", "users", "skipped")
_TABLE = np.full(0x110000, -1, np.int16)
_TABLE[[ord(c) for c in VOCAB]] = np.arange(len(VOCAB))


def ids(text: str) -> np.ndarray:
    """Each character's id in ``VOCAB``, -1 for a character outside it."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype="<u4")
    return _TABLE[codes].astype(np.int16)


def leaf_text(lines: list[str]) -> str:
    """A role's lines as LEAF's ``txt_to_data`` reads the file LEAF wrote them to (each line followed by a
    newline): newlines to spaces, runs of two or more spaces to one."""
    return re.sub(r"   *", " ", "".join(line + "\n" for line in lines).replace("\n", " "))


def windows(text: str, seq_len: int = SEQ_LEN) -> tuple[np.ndarray, np.ndarray, int]:
    """(x uint8 [n, seq_len], y uint8 [n], dropped): every window of ``seq_len`` characters of ``text`` and
    the character after it (stride 1), without the windows that hold a character outside ``VOCAB``."""
    a = ids(text)
    if len(a) <= seq_len:
        return np.zeros((0, seq_len), np.uint8), np.zeros(0, np.uint8), 0
    w = np.lib.stride_tricks.sliding_window_view(a, seq_len + 1)
    ok = (w >= 0).all(axis=1)
    w = w[ok].astype(np.uint8)
    return w[:, :seq_len], w[:, seq_len], int((~ok).sum())


def _convert(role: str, xs: list, ys: list, where: str) -> tuple[np.ndarray, np.ndarray, int]:
    """One role's LEAF samples -> (x uint8 [n, 80], y uint8 [n], samples dropped)."""
    if not all(isinstance(s, str) and len(s) == SEQ_LEN for s in xs) or \
            not all(isinstance(c, str) and len(c) == 1 for c in ys):
        raise DataError(f"{where}: 'x' must hold strings of {SEQ_LEN} characters and 'y' single characters")
    x = ids("".join(xs)).reshape(-1, SEQ_LEN)
    y = ids("".join(ys))
    ok = (x >= 0).all(axis=1) & (y >= 0)
    return x[ok].astype(np.uint8), y[ok].astype(np.uint8), int((~ok).sum())


def _from_json(files: dict[str, Path]) -> tuple[list[dict], int]:
    splits, skipped = [], 0
    for split in ("train", "test"):
        paths = [p for k, p in sorted(files.items()) if k.startswith(split + "/")]
        data = leaf.read_json_split(paths, _convert)
        skipped += sum(d for _, _, d in data.values())
        splits.append({role: (x, y) for role, (x, y, _) in data.items()})
    return splits, skipped


def _from_h5(train: Path, test: Path) -> tuple[list[dict], int]:
    splits, skipped = [], 0
    for path in (train, test):
        data = {}
        for cid, f in leaf.h5_clients(path, ("snippets",)):
            raw = np.asarray(f["snippets"]).reshape(-1)
            try:
                lines = [s.decode("utf-8") if isinstance(s, bytes) else str(s) for s in raw]
            except UnicodeDecodeError:
                raise DataError(f"{path}: client {cid!r}: snippets are not UTF-8 text") from None
            x, y, dropped = windows(leaf_text(lines))
            skipped += dropped
            data[cid] = (x, y)
        splits.append(data)
    return splits, skipped


def _assemble(splits: list[dict], skipped: int, where: object) -> dict[str, np.ndarray]:
    names, gid = leaf.group_ids(list(splits[0]), list(splits[1]))
    out: dict[str, np.ndarray] = {"users": np.array(names, dtype=str), "skipped": np.array(skipped, np.int64)}
    for split, data in zip(("train", "test"), splits):
        roles = sorted(data)
        out[f"x_{split}"] = np.concatenate([data[r][0] for r in roles] or [np.zeros((0, SEQ_LEN), np.uint8)])
        out[f"y_{split}"] = np.concatenate([data[r][1] for r in roles] or [np.zeros(0, np.uint8)])
        out[f"g_{split}"] = np.repeat(np.array([gid[r] for r in roles], np.int64),
                                      [len(data[r][1]) for r in roles]).astype(np.int64)
        if not len(out[f"y_{split}"]):
            raise DataError(f"{where}: the {split} file gives no sample of {SEQ_LEN + 1} characters of the "
                            "vocabulary")
    return out


def decode(files: dict[str, Path], scratch: Path) -> dict[str, np.ndarray]:
    if "archive" in files:
        got = leaf.extract_members(files["archive"], H5, scratch)
        try:
            return _assemble(*_from_h5(got[H5[0]], got[H5[1]]), files["archive"])
        finally:
            shutil.rmtree(got[H5[0]].parent, ignore_errors=True)
    if "train_h5" in files:
        return _assemble(*_from_h5(files["train_h5"], files["test_h5"]), files["train_h5"].parent)
    return _assemble(*_from_json(files), next(iter(files.values())).parent.parent)


def _check(arrays: dict[str, np.ndarray], where: object) -> None:
    for split in ("train", "test"):
        x, y, g = arrays[f"x_{split}"], arrays[f"y_{split}"], arrays[f"g_{split}"]
        if x.dtype != np.uint8 or x.ndim != 2 or x.shape[1] != SEQ_LEN or y.shape != (len(x),) \
                or g.shape != (len(x),):
            raise DataError(f"{where}: {split} arrays are x {x.dtype} {x.shape}, y {y.shape}, roles {g.shape}")
        if len(y) and (max(int(x.max()), int(y.max())) >= len(VOCAB) or g.max() >= len(arrays["users"])):
            raise DataError(f"{where}: {split} ids or role ids out of range")


def find(d: Path) -> dict[str, Path] | str:
    return leaf.find_tff(d, ARCHIVE, H5)


def load(pad32: bool = False, root: str | Path | None = None, *, download: bool = False,
         cache_dir: str | Path | None | bool = None) -> Dataset:
    """80-character windows as int64 ids and the next character's id; each sample's role in ``groups`` /
    ``test_groups``."""
    import torch

    files, where, integrity, cache = read_files(SPEC, root, download, cache_dir)
    scratch = cache if cache is not None else Path(tempfile.gettempdir())
    a = leaf.cached(SPEC.name, files, cache, _KEYS, lambda: decode(files, scratch), _check)
    t = {k: torch.from_numpy(a[k].astype(np.int64)) for k in ("x_train", "y_train", "x_test", "y_test")}
    return Dataset(name=SPEC.name, x_train=t["x_train"], y_train=t["y_train"], x_test=t["x_test"],
                   y_test=t["y_test"], classes=list(CLASSES), groups=a["g_train"].astype(np.int64),
                   test_groups=a["g_test"].astype(np.int64), vocab_size=len(VOCAB), integrity=integrity,
                   source=f"{where} ({len(a['users'])} roles; {int(a['skipped'])} samples with a character "
                          "outside the vocabulary dropped)")


SPEC = DATASETS.register(DatasetSpec(
    name="shakespeare",
    load=load,
    summary="Shakespeare (LEAF): next character after 80, LEAF's 80-character vocabulary, one client per "
            "speaking role (Caldas et al. 2018)",
    class_names=CLASSES,
    input_shape=(SEQ_LEN,),
    vocab_size=len(VOCAB),
    normalisation="none: token ids (int64 [n, 80])",
    natural="role",
    files=FileSet(
        find=find,
        needed=f"{ARCHIVE} (TensorFlow Federated), or {H5[0]} and {H5[1]}, or LEAF's preprocessed "
               "data/train/*.json and data/test/*.json",
        remote=(mirrored(ARCHIVE, ("https://storage.googleapis.com/tff-datasets-public/",), TFF_SHA256, None),),
        hint="run LEAF's preprocessing (github.com/TalwalkarLab/leaf, data/shakespeare/preprocess.sh) and "
             "point data.root at its data/ folder",
    ),
))
