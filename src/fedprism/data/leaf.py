"""Readers shared by the LEAF datasets (Caldas et al. 2018, "LEAF: A Benchmark for Federated Settings",
arXiv:1812.01097) and their TensorFlow-Federated copies: one client per writer, speaking role or user.

Two on-disk forms are read, each checked as it is read (a malformed file is a :class:`DataError` naming
the file and what is wrong):

* **LEAF's preprocessed JSON output** (what LEAF's ``preprocess.sh`` writes into ``data/train/`` and
  ``data/test/``): every ``*.json`` file holds ``{"users": [...], "num_samples": [...], "user_data":
  {user: {"x": [...], "y": [...]}}}``; each user is in one file of a split. :func:`find_json` finds the
  two folders, :func:`read_json_split` reads one split.
* **TensorFlow Federated's HDF5 files** (``<prefix>_train.h5`` / ``<prefix>_test.h5``, alone or in the
  ``.tar.bz2`` TFF publishes with a SHA-256): ``examples/<client>/<field>`` datasets.
  :func:`h5_clients` reads them; :func:`extract_members` takes just the named regular-file members out
  of the archive into a temporary folder (nothing else is written, member paths are never followed).

LEAF's train files become fedprism's train split and its test files the test split. Each user keeps a
group id (``Dataset.groups`` / ``test_groups``): the index of its name among all user names of both
splits, sorted (:func:`group_ids`), so ``partition=natural`` gives client i the i-th user with training
samples and that user's own test samples as its local test set. With LEAF's per-sample split
(``-t sample``, each user's samples divided between train and test) every client has local test
samples; with its per-user split (``-t user``) the test users have no client and their samples are
counted as unused by the partition.

Decoded arrays go through the decoded-array cache (:func:`cached`), keyed by the files' names, sizes and
modification times, with a digest of their own content, as the image datasets' are.
"""

from __future__ import annotations

import json
import shutil
import tarfile
import tempfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from fedprism.data.cache import arrays_digest, cache_file, load_npz, save_npz
from fedprism.errors import DataError

__all__ = ["find_json", "read_json_split", "group_ids", "h5_clients", "extract_members", "cached",
           "MAX_JSON_BYTES"]

MAX_JSON_BYTES = 4 << 30
"""Largest LEAF JSON file read (LEAF's own files are at most a few hundred MiB)."""


# ----------------------------------------------------------------------------------- LEAF JSON


def find_tff(d: Path, archive: str, h5: tuple[str, str]) -> dict[str, Path] | str:
    """A LEAF dataset's files in folder ``d``: TensorFlow Federated's ``archive``, else its two ``h5`` files
    (in ``d`` or ``d/datasets``), else LEAF's JSON output (`find_json`); or what is missing."""
    if (d / archive).is_file():
        return {"archive": d / archive}
    for base in (d, d / "datasets"):
        if all((base / n).is_file() for n in h5):
            return {"train_h5": base / h5[0], "test_h5": base / h5[1]}
    found = find_json(d)
    if isinstance(found, dict):
        return found
    return f"no {archive}, no {h5[0]} + {h5[1]}, {found}"


def find_json(d: Path) -> dict[str, Path] | str:
    """``{"train/<file>": path, ..., "test/<file>": path}`` for LEAF's ``train/`` and ``test/`` folders of
    ``*.json`` files in ``d`` or ``d/data`` (where LEAF writes them), else why not."""
    for base in (d, d / "data"):
        tr, te = base / "train", base / "test"
        if tr.is_dir() or te.is_dir():
            a = sorted(p for p in tr.glob("*.json") if p.is_file()) if tr.is_dir() else []
            b = sorted(p for p in te.glob("*.json") if p.is_file()) if te.is_dir() else []
            if a and b:
                return {**{f"train/{p.name}": p for p in a}, **{f"test/{p.name}": p for p in b}}
            missing = " and ".join(s for s, f in (("train/*.json", a), ("test/*.json", b)) if not f)
            return f"LEAF folders in {base} lack {missing}"
    return "no LEAF train/ and test/ folders of *.json"


def _read_json(path: Path) -> dict:
    try:
        size = path.stat().st_size
        if size > MAX_JSON_BYTES:
            raise DataError(f"{path}: {size} bytes, more than the {MAX_JSON_BYTES} accepted for a LEAF file")
        with open(path, "rb") as f:
            obj = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise DataError(f"{path}: cannot read LEAF JSON ({type(e).__name__}: {e}); the file is truncated "
                        "or corrupt, run LEAF's preprocessing again") from None
    if not isinstance(obj, dict) or not {"users", "num_samples", "user_data"} <= set(obj):
        have = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise DataError(f"{path}: not a LEAF data file: needs 'users', 'num_samples' and 'user_data', "
                        f"has {have}")
    return obj


def read_json_split(paths: list[Path], convert: Callable[[str, list, list, str], Any] | None = None
                    ) -> dict[str, Any]:
    """user -> ``convert(user, x list, y list, where)`` (default: ``(x, y)``) over the LEAF files ``paths``
    of one split; each file's users are converted before the next file is read, so only one file's
    JSON is held in memory at a time.

    Each file must list its users in ``users`` with their sample counts in ``num_samples``, and hold
    for each ``user_data[user]`` an ``x`` and a ``y`` of that many entries; a user found in two files
    of the split is refused (LEAF writes each user once).
    """
    out: dict[str, Any] = {}
    for path in paths:
        obj = _read_json(path)
        users, counts, data = obj["users"], obj["num_samples"], obj["user_data"]
        if not isinstance(users, list) or not isinstance(counts, list) or not isinstance(data, dict) \
                or len(users) != len(counts):
            raise DataError(f"{path}: 'users' and 'num_samples' must be lists of one length and 'user_data' "
                            "an object")
        for user, n in zip(users, counts):
            if not isinstance(user, str) or isinstance(n, bool) or not isinstance(n, int):
                raise DataError(f"{path}: user {user!r} with num_samples {n!r}: a name and an integer")
            entry = data.get(user)
            if not isinstance(entry, dict) or not isinstance(entry.get("x"), list) \
                    or not isinstance(entry.get("y"), list):
                raise DataError(f"{path}: user_data[{user!r}] must hold lists 'x' and 'y'")
            if not len(entry["x"]) == len(entry["y"]) == n:
                raise DataError(f"{path}: user {user!r} has num_samples {n} but {len(entry['x'])} x and "
                                f"{len(entry['y'])} y")
            if user in out:
                raise DataError(f"{path}: user {user!r} appears in two files of the same split")
            where = f"{path}: user {user!r}"
            out[user] = (entry["x"], entry["y"]) if convert is None else convert(user, entry["x"], entry["y"],
                                                                                 where)
        del obj, data
    return out


def group_ids(train_users: list[str], test_users: list[str]) -> tuple[list[str], dict[str, int]]:
    """(every user name of both splits, sorted; name -> its index there, the group id)."""
    names = sorted(set(train_users) | set(test_users))
    return names, {u: i for i, u in enumerate(names)}


# ------------------------------------------------------------------------------------- TFF HDF5


def h5_clients(path: Path, fields: tuple[str, ...]) -> Iterator[tuple[str, dict[str, np.ndarray]]]:
    """(client id, {field: array}) for every ``examples/<client>`` group of a TFF HDF5 file, in sorted
    client order; a missing group or field is a DataError naming the file."""
    try:
        import h5py
    except ImportError:                         # a dependency of fedprism: only a broken install lacks it
        raise DataError(f"{path}: reading TensorFlow Federated's HDF5 files needs h5py "
                        "(pip install h5py)") from None
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise DataError(f"{path}: cannot open as HDF5 ({e}); the file is truncated or corrupt") from None
    with f:
        ex = f.get("examples")
        if not isinstance(ex, h5py.Group):
            raise DataError(f"{path}: no 'examples' group; not a TensorFlow Federated client file")
        for cid in sorted(ex):
            g = ex[cid]
            if not isinstance(g, h5py.Group) or any(not isinstance(g.get(k), h5py.Dataset) for k in fields):
                raise DataError(f"{path}: client {cid!r} lacks {' / '.join(fields)}")
            try:
                yield cid, {k: g[k][()] for k in fields}
            except (OSError, ValueError) as e:
                raise DataError(f"{path}: cannot read client {cid!r} ({e}); the file is corrupt") from None


def extract_members(archive: Path, names: tuple[str, ...], into: Path) -> dict[str, Path]:
    """Extract the regular-file members whose base names are ``names`` (in any folder of the archive,
    once each) into a fresh temporary folder of ``into``: {name: path}. The caller removes the folder
    (``shutil.rmtree(path.parent)``). Links, devices, duplicates and missing members are refused."""
    into.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=archive.name + "-", dir=into))
    out: dict[str, Path] = {}
    try:
        with tarfile.open(archive, "r:*") as tar:
            for member in tar:
                base = member.name.rstrip("/").rsplit("/", 1)[-1]
                if base not in names:
                    continue
                if not member.isfile():
                    raise DataError(f"{archive}: member {member.name!r} is not a regular file; refusing it")
                if base in out:
                    raise DataError(f"{archive}: holds {base} twice; refusing an ambiguous archive")
                src = tar.extractfile(member)
                assert src is not None
                with src, open(tmp / base, "wb") as dst:
                    shutil.copyfileobj(src, dst)
                out[base] = tmp / base
    except (tarfile.TarError, OSError, EOFError, zlib.error, ValueError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise DataError(f"{archive}: cannot read the archive ({type(e).__name__}: {e}); "
                        "it is truncated or corrupt, download it again") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    missing = [n for n in names if n not in out]
    if missing:
        shutil.rmtree(tmp, ignore_errors=True)
        raise DataError(f"{archive}: the archive lacks {', '.join(missing)}")
    return out


# ------------------------------------------------------------------------------- decoded cache


def cached(name: str, files: dict[str, Path], cache: Path | None, keys: tuple[str, ...],
           build: Callable[[], dict[str, np.ndarray]], check: Callable[[dict[str, np.ndarray], Any], None]
           ) -> dict[str, np.ndarray]:
    """The arrays ``keys`` that ``build()`` decodes from ``files``, read from the decoded-array cache of
    ``cache`` when present and intact (``check`` passes, the content digest matches), else built,
    checked and saved."""
    digest = arrays_digest(f"fedprism-{name}-arrays", keys)
    cfile = cache_file(name, files, cache) if cache is not None else None
    arrays = load_npz(cfile, keys, digest, check) if cfile is not None else None
    if arrays is not None:
        return arrays
    arrays = build()
    check(arrays, next(iter(files.values())).parent)
    if cfile is not None:
        save_npz(cfile, **arrays, digest=np.array(digest(arrays)))
    return arrays
