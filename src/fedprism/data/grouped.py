"""Helpers shared by the datasets whose samples carry their natural client (a subject, a US state, an image
domain): a seeded train/test split within each (group, class), and reading one member of a zip archive in
memory, safely.

Used by :mod:`fedprism.data.sets.uci_har`, :mod:`fedprism.data.sets.acsincome` and
:mod:`fedprism.data.sets.office_caltech10`.
"""

from __future__ import annotations

import zipfile
import zlib
from pathlib import Path

import numpy as np

from fedprism.errors import DataError

__all__ = ["split_within_groups", "read_zip_member", "zip_members"]


def split_within_groups(labels: np.ndarray, groups: np.ndarray, seed: int = 0, test_fraction: float = 0.2
                        ) -> tuple[np.ndarray, np.ndarray]:
    """Sorted (train, test) indices: within each (group, label), a seeded random ``round(test_fraction * n)``
    of its n samples go to test, the rest to train.

    One ``numpy.random.default_rng(seed)`` stream visits the (group, label) pairs in ascending order, so the
    split depends on the data and ``seed`` only; every group keeps its label mix in both splits (the
    stratified per-client split of FedSub, Campana and Delmastro, Section 4.4, and the 80/20 split
    Clust-PSI-PFL uses where a dataset has no official test set).
    """
    labels, groups = np.asarray(labels, np.int64), np.asarray(groups, np.int64)
    if labels.shape != groups.shape or labels.ndim != 1:
        raise ValueError(f"labels {labels.shape} and groups {groups.shape} must be 1-D of one length")
    rng = np.random.default_rng(seed)
    order = np.lexsort((np.arange(len(labels)), labels, groups))        # by group, label, position
    g, y = groups[order], labels[order]
    change = (np.diff(g) != 0) | (np.diff(y) != 0)
    bounds = np.flatnonzero(change) + 1
    is_test = np.zeros(len(labels), bool)
    for block in (np.split(order, bounds) if len(order) else []):
        n_test = int(round(test_fraction * len(block)))
        is_test[rng.permutation(block)[:n_test]] = True
    return np.flatnonzero(~is_test).astype(np.int64), np.flatnonzero(is_test).astype(np.int64)


def zip_members(path: Path) -> list[zipfile.ZipInfo]:
    """The members of a zip archive; an unreadable archive is a :class:`DataError` naming it."""
    try:
        with zipfile.ZipFile(path) as z:
            return z.infolist()
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise DataError(f"{path}: cannot read the zip archive ({type(e).__name__}: {e}); it is truncated "
                        "or corrupt, download it again") from e


def read_zip_member(path: Path, member: str, max_bytes: int) -> bytes:
    """The bytes of member ``member`` of zip archive ``path``, read in memory (nothing is extracted to disk,
    so member names such as ``../x`` cannot place files anywhere). A missing, duplicated, oversized or
    corrupt member is a :class:`DataError` naming the archive."""
    try:
        with zipfile.ZipFile(path) as z:
            infos = [i for i in z.infolist() if i.filename == member]
            if not infos:
                raise DataError(f"{path}: the archive lacks {member}")
            if len(infos) > 1:
                raise DataError(f"{path}: the archive holds {member} {len(infos)} times; refusing an "
                                "ambiguous archive")
            info = infos[0]
            if info.is_dir() or info.file_size > max_bytes:
                what = "a folder" if info.is_dir() else f"{info.file_size} bytes"
                raise DataError(f"{path}: member {member} is {what}; a regular file of at most {max_bytes} "
                                "bytes is accepted")
            with z.open(info) as f:
                data = f.read(max_bytes + 1)
    except (zipfile.BadZipFile, OSError, EOFError, zlib.error, NotImplementedError) as e:
        raise DataError(f"{path}: cannot read {member} from the archive ({type(e).__name__}: {e}); it is "
                        "truncated or corrupt, download it again") from e
    if len(data) > max_bytes:
        raise DataError(f"{path}: member {member} holds more than {max_bytes} bytes")
    return data
