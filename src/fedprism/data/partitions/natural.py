"""One client per natural user or device of the data (`natural`; ``groups=``, e.g. the WISDM users); each
client's test rows are its own user's held-out samples."""

from __future__ import annotations

from typing import Any

import numpy as np

from fedprism.data.partitions.base import PARTITIONS, PartitionSpec, _assemble, _check_min_train
from fedprism.errors import PartitionError
from fedprism.hparams import Param


def _group_ids(groups: Any, n: int, name: str) -> np.ndarray:
    g = np.asarray(groups)
    if g.ndim != 1 or len(g) != n:
        raise PartitionError(f"{name} must give one user/device id per sample: {n} ids expected, "
                             f"got shape {g.shape}")
    if g.size and not np.issubdtype(g.dtype, np.integer):
        raise PartitionError(f"{name} must hold integer user/device ids, got dtype {g.dtype}")
    return g.astype(np.int64)


def split(y_train: np.ndarray, y_test: np.ndarray, num_clients: int, min_train: int, min_test: int,
             groups: Any, test_groups: Any) -> tuple[list[np.ndarray], list[np.ndarray], dict]:
    """Client i holds every train and test sample of the i-th smallest group id (user or device)."""
    if groups is None or test_groups is None:
        from fedprism.data.base import natural_datasets

        raise PartitionError("partition = 'natural' is not valid for this data: it gives each client the "
                             "samples of one user or device, and the data records none (datasets with "
                             f"natural clients: {', '.join(natural_datasets())})")
    g_tr = _group_ids(groups, len(y_train), "groups")
    g_te = _group_ids(test_groups, len(y_test), "test_groups")
    users = np.unique(g_tr)
    if num_clients != len(users):
        raise PartitionError(f"clients = {num_clients} is not valid for partition 'natural': the data "
                             f"has {len(users)} users/devices with train samples, one client each, so set "
                             f"clients = {len(users)}")
    train = _assemble(np.arange(len(g_tr)), np.searchsorted(users, g_tr), num_clients)
    _check_min_train(np.array([len(t) for t in train]), min_train, "partition 'natural'")
    known = np.isin(g_te, users)
    test = _assemble(np.flatnonzero(known), np.searchsorted(users, g_te[known]), num_clients)
    n_test = np.array([len(t) for t in test])
    if len(n_test) and n_test.min() < min_test:
        i = int(np.argmin(n_test))
        raise PartitionError(f"partition.min_test = {min_test} is not reachable: user {int(users[i])} "
                             f"(client {i}) has {int(n_test[i])} test samples; use a lower "
                             "partition.min_test")
    meta = {"client_groups": users.tolist(), "test_with_replacement": False, "test_reused_classes": [],
            "test_reused_samples": 0, "clients_without_test": int((n_test == 0).sum()),
            "n_test_unused": int((~known).sum())}
    return train, test, meta


def column_groups(columns: dict | None, test_columns: dict | None, column: str, dataset: str
                  ) -> tuple[np.ndarray, np.ndarray]:
    """``partition.column``: each train and test sample's group id from the named column of the data
    (``Dataset.columns`` / ``test_columns``: a US state, a writer id, a hospital), for ``partition=natural``
    on data whose loader does not declare its natural clients or on another column than the one it declares.

    The ids number the column's distinct values in sorted order over both splits together (so client i holds
    the i-th smallest value that has train rows: the order of ``natural``); values may be integers, strings or
    booleans. A missing column, or one holding floats or missing values, is a PartitionError naming the key,
    the column and the columns there are."""
    have = sorted(set(columns or {}) & set(test_columns or {}))
    if column not in have:
        from fedprism.registry import suggest

        listed = (f"one of its columns: {', '.join(have)}{suggest(column, have)}" if have else
                  "a column of the data, and this dataset's loader gives none (hf: datasets give their "
                  "integer, string and boolean columns)")
        raise PartitionError(f"partition.column = {column!r} is not valid for dataset '{dataset}': {listed}")
    tr, te = np.asarray(columns[column]), np.asarray(test_columns[column])
    for part in (tr, te):
        kind = part.dtype.kind
        if kind == "f" or (kind == "O" and any(v is None for v in part)):
            raise PartitionError(f"partition.column = {column!r} is not valid for dataset '{dataset}': a column of "
                                 f"integers, strings or booleans with no missing values (one client per value); "
                                 f"it holds {'floats' if kind == 'f' else 'missing values'}")
    both = np.concatenate([tr.astype(str) if tr.dtype.kind in "OUS" else tr,
                           te.astype(str) if te.dtype.kind in "OUS" else te])
    _, ids = np.unique(both, return_inverse=True)
    ids = ids.astype(np.int64).reshape(-1)
    return ids[:len(tr)], ids[len(tr):]


SPEC = PARTITIONS.register(PartitionSpec("natural", split, {
    "column": Param("", "the data column whose values are the clients (a state, a writer id; `column_groups`); "
                    "'' = the natural clients the dataset declares", lambda v: "\0" not in v,
                    "a column name, or '' (the dataset's own natural clients)", new=True),
}, natural=True, title="one client per natural user or device of the data, or per value of partition.column"))
