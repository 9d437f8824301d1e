"""Each client's test rows: its train label pmf applied to the official test set (`test_split`), or a
seeded, stratified hold-out of its own rows (`local_holdout`, `data.local_test=split`)."""

from __future__ import annotations

import math

import numpy as np

from fedprism.data.partitions.base import _assemble, _class_pools, _largest_remainder, label_histograms


def _test_split(train, y_train, y_test, num_classes, min_test, test_ratio, rng):
    """Each client's test indices: its train label pmf applied to the official test set.

    Size ``max(min_test, round(n_train_i * ratio))`` with ``ratio = test_ratio`` or
    ``len(y_test)/len(y_train)``; per-class counts by largest-remainder rounding. Each class's shuffled
    test pool is handed out to clients in turn, disjoint while it lasts; when a class's demand exceeds
    its pool the pool is walked again from the start (reuse across clients, recorded in the meta).
    Classes absent from the test set are dropped from the client's pmf before rounding.
    """
    n_clients = len(train)
    meta = {"test_with_replacement": False, "test_reused_classes": [], "test_reused_samples": 0,
            "clients_without_test": 0}
    if len(y_test) == 0:
        meta["clients_without_test"] = n_clients
        return [np.zeros(0, dtype=np.int64) for _ in range(n_clients)], meta
    hist = label_histograms(train, y_train, num_classes).astype(float)
    ratio = len(y_test) / len(y_train) if test_ratio is None else test_ratio
    n_test = np.maximum(np.rint(hist.sum(axis=1) * ratio).astype(np.int64), min_test)
    order, starts, counts = _class_pools(y_test, num_classes, rng)
    hist[:, counts == 0] = 0.0
    mass = hist.sum(axis=1)
    n_test[mass == 0] = 0
    pmf = np.divide(hist, mass[:, None], out=np.zeros_like(hist), where=mass[:, None] > 0)
    alloc = _largest_remainder(n_test, pmf)
    demand = alloc.sum(axis=0)
    idx_parts, owner_parts = [], []
    for c in np.flatnonzero(demand):
        pos = np.arange(demand[c]) % counts[c]                 # cyclic walk: reuse only past the pool
        idx_parts.append(order[starts[c] + pos])
        owner_parts.append(np.repeat(np.arange(n_clients), alloc[:, c]))
        if demand[c] > counts[c]:
            meta["test_reused_classes"].append(int(c))
            meta["test_reused_samples"] += int(demand[c] - counts[c])
    meta["test_with_replacement"] = bool(meta["test_reused_classes"])
    meta["clients_without_test"] = int((n_test == 0).sum())
    if not idx_parts:
        return [np.zeros(0, dtype=np.int64) for _ in range(n_clients)], meta
    return _assemble(np.concatenate(idx_parts), np.concatenate(owner_parts), n_clients), meta


def local_holdout(idx: list[np.ndarray], y: np.ndarray, fraction: float, seed: int, min_test: int = 1
                  ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Split each client's own rows into (train, test): the protocol "a random train/test split of
    80%/20%" of Jimenez-Gutierrez et al. 2025, "Clust-PSI-PFL: A Population Stability Index Approach for
    Clustered Non-IID Personalized Federated Learning", arXiv:2512.20363, section IV-A, applied per client
    (`data.local_test = "split"`, `fraction` = `data.local_test_fraction`).

    Client k with n rows, n_c of class c:
        T   = min(max(floor(fraction n + 1/2), min_test), n - 1)     test rows (at least one train row;
                                                                      none for n <= 1)
        T_c = largest-remainder rounding of fraction n_c to a total of T (ties: a seeded order), so the
              test rows follow the client's label mix as closely as integers allow (stratified)
        the T_c test rows of class c: the first T_c of a seeded permutation of the client's class-c rows
    Seeded by (seed, k) alone (`numpy.random.default_rng([seed, 0x7E57, k])`): a client's split does not
    depend on the other clients. Both outputs are sorted index arrays into the same pool as `idx`,
    disjoint, and together they are exactly `idx[k]`."""
    if not 0.0 < float(fraction) < 1.0:
        raise ValueError(f"fraction must be in (0, 1), got {fraction!r}")
    y = np.asarray(y)
    train, test = [], []
    for k, rows in enumerate(idx):
        rows = np.asarray(rows, dtype=np.int64)
        n = len(rows)
        T = min(max(int(math.floor(fraction * n + 0.5)), int(min_test)), max(n - 1, 0))
        rng = np.random.default_rng([int(seed), 0x7E57, k])
        classes, inverse = np.unique(y[rows], return_inverse=True)
        n_c = np.bincount(inverse, minlength=len(classes))
        raw = fraction * n_c
        t_c = np.minimum(np.floor(raw).astype(np.int64), n_c)
        rem = T - int(t_c.sum())                              # >= 0: sum_c floor(fraction n_c) <= T
        tie = rng.permutation(len(classes))                   # seeded tie-break between equal remainders
        frac = raw - t_c
        if rem > 0:                                           # largest remainders first, where rows remain
            order = np.lexsort((tie, -frac))
            for c in order:
                if rem == 0:
                    break
                if t_c[c] < n_c[c]:
                    t_c[c] += 1
                    rem -= 1
            while rem > 0:                                    # min_test above fraction n: fill anywhere
                c = next(c for c in np.lexsort((tie, -(n_c - t_c))) if t_c[c] < n_c[c])
                t_c[c] += 1
                rem -= 1
        held = np.zeros(n, dtype=bool)
        for c in range(len(classes)):
            members = np.flatnonzero(inverse == c)
            held[members[rng.permutation(len(members))[: t_c[c]]]] = True
        train.append(np.sort(rows[~held]))
        test.append(np.sort(rows[held]))
    return train, test

