"""Sent140, LEAF's tweet sentiment task (Caldas et al. 2018, "LEAF: A Benchmark for Federated Settings",
arXiv:1812.01097) on Sentiment140 (Go, Bhayani, Huang 2009, "Twitter Sentiment Classification using
Distant Supervision"): 1.6 million tweets labelled negative or positive by their emoticons, one natural
client per Twitter user (`partition=natural`).

Token data: each tweet is ``SEQ_LEN`` = 25 word ids (int64 ``[n, 25]``; LEAF's sent140 models read 25
words), from a vocabulary built from the training tweets: id 0 pads a short tweet at its end, id 1 is
a word outside the vocabulary, ids 2.. are the ``WORDS`` = 10 000 most frequent training tokens (ties by
the token), so ``vocab_size`` is always 10 002 (ids beyond the tokens there are unused). Tokens are
LEAF's (``split_line``: ``[\\w']+`` runs and the punctuation ``.,!?;``), lower-cased; a tweet of more
than 25 tokens is cut after the 25th. Classes: 0 negative, 1 positive.

Read from either of two sources:

* LEAF's preprocessed JSON output (``data/train/*.json``, ``data/test/*.json`` from LEAF's
  ``preprocess.sh``): ``user_data[user]`` holds ``x``, LEAF's raw rows ``[id, date, query, user, text]``
  (the text is read from index 4; a bare string is taken as the text), and ``y``, the polarity (0 or
  1, or the raw file's 0 / 4). LEAF's train files give the train split and its test files the test
  split. Generated locally, so no digest covers it: used with an ``UnverifiedDataWarning``.
* The Sentiment140 archive ``trainingandtestdata.zip`` (what `fedprism data download sent140` fetches
  from its authors' page; no checksum is published, so it is trusted on first use) or its
  ``training.1600000.processed.noemoticon.csv`` (latin-1 CSV: polarity 0/4, id, date, query, user,
  text). LEAF's sampling is not repeated; its per-user split is: users with fewer than
  ``min_samples`` tweets (default 3, LEAF's ``-k``) are dropped, and within each user a seeded random
  ``round(test_fraction * n)`` of its n tweets (default 0.1, LEAF's ``--tf 0.9``) go to test (loader
  options ``seed``, ``test_fraction``, ``min_samples``; runs use the defaults). Rows that do not parse
  are skipped and counted. The archive's ``testdata.manual.2009.06.14.csv`` (with a neutral class, no
  users in common) is not read.

Each user keeps its id (`fedprism.data.leaf.group_ids`), so a natural client's local test set is its own
user's test tweets.
"""

from __future__ import annotations

import csv
import io
import re
import tempfile
import zipfile
import zlib
from collections import Counter
from pathlib import Path

import numpy as np

from fedprism.data import leaf
from fedprism.data.base import DATASETS, Dataset, DatasetSpec, FileSet, float_option, int_option
from fedprism.data.download import RemoteFile
from fedprism.data.files import read_files
from fedprism.errors import DataError

SEQ_LEN = 25
WORDS = 10_000
PAD, UNKNOWN = 0, 1
VOCAB_SIZE = WORDS + 2
CLASSES = ("negative", "positive")
ARCHIVE = "trainingandtestdata.zip"
CSV = "training.1600000.processed.noemoticon.csv"
MAX_CSV_BYTES = 1 << 30
_TOKEN = re.compile(r"[\w']+|[.,!?;]")
_KEYS = ("x_train", "y_train", "g_train", "x_test", "y_test", "g_test", "users", "vocab", "skipped")
_POLARITY = {0: 0, 1: 1, 4: 1, "0": 0, "1": 1, "4": 1}


def tokens(text: str) -> list[str]:
    """LEAF's ``split_line`` tokens of a tweet, lower-cased."""
    return _TOKEN.findall(text.lower())


def vocabulary(texts: list[str]) -> list[str]:
    """The ``WORDS`` most frequent tokens of ``texts`` (ties by the token): id 2 + position."""
    counts = Counter(t for s in texts for t in tokens(s))
    return [w for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:WORDS]]


def encode(texts: list[str], vocab: list[str]) -> np.ndarray:
    """uint16 [n, SEQ_LEN]: each tweet's first SEQ_LEN token ids, padded with PAD at the end."""
    index = {w: i + 2 for i, w in enumerate(vocab)}
    out = np.full((len(texts), SEQ_LEN), PAD, np.uint16)
    for r, s in enumerate(texts):
        ids = [index.get(t, UNKNOWN) for t in tokens(s)[:SEQ_LEN]]
        out[r, :len(ids)] = ids
    return out


def _polarity(v: object, where: str) -> int:
    try:
        return _POLARITY[v]                       # type: ignore[index]
    except (KeyError, TypeError):
        raise DataError(f"{where}: polarity {v!r}; expected 0 or 1 (or the raw file's 0 / 4)") from None


def _text(x: object, where: str) -> str:
    if isinstance(x, str):
        return x
    if isinstance(x, list) and len(x) >= 5 and isinstance(x[4], str):
        return x[4]
    raise DataError(f"{where}: a sample is {str(x)[:60]!r}; LEAF's sent140 rows are [id, date, query, user, "
                    "text]")


def _from_json(files: dict[str, Path]) -> tuple[list[dict], int]:
    splits = []
    for split in ("train", "test"):
        paths = [p for k, p in sorted(files.items()) if k.startswith(split + "/")]
        splits.append(leaf.read_json_split(
            paths, lambda user, xs, ys, where: ([_text(x, where) for x in xs], [_polarity(y, where) for y in ys])))
    return splits, 0


def read_csv_text(files: dict[str, Path]) -> str:
    """The training CSV's text: the archive's member (read in memory) or the file."""
    if "archive" in files:
        path = files["archive"]
        try:
            with zipfile.ZipFile(path) as z:
                infos = [i for i in z.infolist() if i.filename.rsplit("/", 1)[-1] == CSV and not i.is_dir()]
                if len(infos) != 1:
                    raise DataError(f"{path}: the archive holds {CSV} {len(infos)} times; not the Sentiment140 "
                                    "archive")
                if infos[0].file_size > MAX_CSV_BYTES:
                    raise DataError(f"{path}: {CSV} is {infos[0].file_size} bytes, more than the "
                                    f"{MAX_CSV_BYTES} accepted")
                data = z.read(infos[0])
        except (zipfile.BadZipFile, OSError, EOFError, zlib.error, NotImplementedError) as e:
            raise DataError(f"{path}: cannot read the archive ({type(e).__name__}: {e}); it is truncated or "
                            "corrupt, download it again") from None
    else:
        path = files["csv"]
        try:
            if path.stat().st_size > MAX_CSV_BYTES:
                raise DataError(f"{path}: more than the {MAX_CSV_BYTES} bytes accepted; not {CSV}")
            data = path.read_bytes()
        except OSError as e:
            raise DataError(f"{path}: cannot read file ({e.strerror or e})") from None
    return data.decode("latin-1")


def parse_csv(text: str) -> tuple[dict[str, tuple[list[str], list[int]]], int]:
    """user -> (tweets, polarities 0/1) in file order, and the rows skipped (not six fields, a polarity
    other than 0 or 4, an empty user)."""
    users: dict[str, tuple[list[str], list[int]]] = {}
    skipped = 0
    for row in csv.reader(io.StringIO(text)):
        if len(row) != 6 or row[0] not in ("0", "4") or not row[4]:
            skipped += int(bool(row))
            continue
        t, y = users.setdefault(row[4], ([], []))
        t.append(row[5])
        y.append(_POLARITY[row[0]])
    return users, skipped


def split_users(users: dict[str, tuple[list[str], list[int]]], seed: int, test_fraction: float,
                min_samples: int) -> list[dict]:
    """[train, test]: users (by name, in sorted order) with at least ``min_samples`` tweets, each split
    by a seeded random ``round(test_fraction * n)`` of its n tweets to test; one
    ``numpy.random.default_rng(seed)`` stream visits the users in sorted order."""
    rng = np.random.default_rng(seed)
    train: dict = {}
    test: dict = {}
    for u in sorted(users):
        t, y = users[u]
        if len(y) < min_samples:
            continue
        perm = rng.permutation(len(y))
        n_test = int(round(test_fraction * len(y)))
        te, tr = np.sort(perm[:n_test]), np.sort(perm[n_test:])
        if len(tr):
            train[u] = ([t[i] for i in tr], [y[i] for i in tr])
        if len(te):
            test[u] = ([t[i] for i in te], [y[i] for i in te])
    return [train, test]


def _assemble(splits: list[dict], skipped: int, where: object) -> dict[str, np.ndarray]:
    names, gid = leaf.group_ids(list(splits[0]), list(splits[1]))
    vocab = vocabulary([s for u in splits[0] for s in splits[0][u][0]])
    out: dict[str, np.ndarray] = {"users": np.array(names, dtype=str), "vocab": np.array(vocab, dtype=str),
                                  "skipped": np.array(skipped, np.int64)}
    for split, data in zip(("train", "test"), splits):
        users = sorted(data)
        texts = [s for u in users for s in data[u][0]]
        if not texts:
            raise DataError(f"{where}: the {split} split holds no tweets")
        out[f"x_{split}"] = encode(texts, vocab)
        out[f"y_{split}"] = np.array([y for u in users for y in data[u][1]], np.int64)
        out[f"g_{split}"] = np.repeat(np.array([gid[u] for u in users], np.int64),
                                      [len(data[u][1]) for u in users]).astype(np.int64)
    return out


def decode(files: dict[str, Path], seed: int, test_fraction: float, min_samples: int) -> dict[str, np.ndarray]:
    if "archive" in files or "csv" in files:
        users, skipped = parse_csv(read_csv_text(files))
        where = files.get("archive") or files["csv"]
        return _assemble(split_users(users, seed, test_fraction, min_samples), skipped, where)
    return _assemble(*_from_json(files), next(iter(files.values())).parent.parent)


def _check(arrays: dict[str, np.ndarray], where: object) -> None:
    for split in ("train", "test"):
        x, y, g = arrays[f"x_{split}"], arrays[f"y_{split}"], arrays[f"g_{split}"]
        if x.dtype != np.uint16 or x.ndim != 2 or x.shape[1] != SEQ_LEN or y.shape != (len(x),) \
                or g.shape != (len(x),) or not len(y):
            raise DataError(f"{where}: {split} arrays are x {x.dtype} {x.shape}, y {y.shape}, users {g.shape}")
        if int(x.max()) >= VOCAB_SIZE or y.min() < 0 or y.max() > 1 or g.max() >= len(arrays["users"]):
            raise DataError(f"{where}: {split} ids, labels or user ids out of range")


def find(d: Path) -> dict[str, Path] | str:
    if (d / ARCHIVE).is_file():
        return {"archive": d / ARCHIVE}
    if (d / CSV).is_file():
        return {"csv": d / CSV}
    found = leaf.find_json(d)
    if isinstance(found, dict):
        return found
    return f"no {ARCHIVE}, no {CSV}, {found}"


def load(pad32: bool = False, root: str | Path | None = None, *, download: bool = False,
         cache_dir: str | Path | None | bool = None, seed: int = 0, test_fraction: float = 0.1,
         min_samples: int = 3) -> Dataset:
    """Tweets as 25 word ids (vocabulary of the training tweets), polarity 0/1; each tweet's user in
    ``groups`` / ``test_groups``. ``seed``, ``test_fraction`` and ``min_samples`` split the raw CSV per
    user (LEAF's JSON output comes split)."""
    import torch

    opts = {"seed": int_option("seed", seed, 0),
            "test_fraction": float_option("test_fraction", test_fraction, 0.0, 1.0, open_low=True),
            "min_samples": int_option("min_samples", min_samples, 1)}
    files, where, integrity, cache = read_files(SPEC, root, download, cache_dir)
    raw = "archive" in files or "csv" in files
    label = (f"{SPEC.name}-s{opts['seed']}-t{opts['test_fraction']}-k{opts['min_samples']}" if raw
             else SPEC.name)
    a = leaf.cached(label, files, cache, _KEYS, lambda: decode(files, **opts), _check)
    t = {k: torch.from_numpy(a[k].astype(np.int64)) for k in ("x_train", "y_train", "x_test", "y_test")}
    skipped = f"; {int(a['skipped'])} malformed rows skipped" if raw else ""
    return Dataset(name=SPEC.name, x_train=t["x_train"], y_train=t["y_train"], x_test=t["x_test"],
                   y_test=t["y_test"], classes=list(CLASSES), groups=a["g_train"].astype(np.int64),
                   test_groups=a["g_test"].astype(np.int64), vocab_size=VOCAB_SIZE, integrity=integrity,
                   source=f"{where} ({len(a['users'])} users, {len(a['vocab'])} training tokens in the "
                          f"vocabulary{skipped})")


SPEC = DATASETS.register(DatasetSpec(
    name="sent140",
    load=load,
    summary="Sent140 (LEAF): tweet sentiment, 25 word ids from the training tweets' 10 000 most frequent "
            "tokens, one client per user (Caldas et al. 2018; Go et al. 2009)",
    class_names=CLASSES,
    input_shape=(SEQ_LEN,),
    vocab_size=VOCAB_SIZE,
    normalisation="none: token ids (int64 [n, 25]; 0 pads, 1 is a word outside the vocabulary)",
    natural="user",
    options=("seed", "test_fraction", "min_samples"),
    files=FileSet(
        find=find,
        needed=f"{ARCHIVE} (Sentiment140), or {CSV}, or LEAF's preprocessed data/train/*.json and "
               "data/test/*.json",
        # no checksum is published: trust on first use (fedprism.data.download)
        remote=(RemoteFile(ARCHIVE, ("https://cs.stanford.edu/people/alecmgo/" + ARCHIVE,), tofu=True),),
        hint="run LEAF's preprocessing (github.com/TalwalkarLab/leaf, data/sent140/preprocess.sh) and point "
             "data.root at its data/ folder",
    ),
))
