"""Similarity(S): an IID share ``S`` plus label-sorted slices (`similarity`; Clust-PSI-PFL, arXiv:2512.20363)."""

from __future__ import annotations

import numpy as np

from fedprism.data.partitions.base import PARTITIONS, PartitionSpec, _check_min_train
from fedprism.hparams import Param


def split(y, num_classes, num_clients, min_train, rng, params):
    """Similarity(S) (Clust-PSI-PFL section IV; psi_pfl ``split_dataset_by_percent``).

    Shuffle all indices; the first ``round(S n)`` form the IID pool, the rest are stable-sorted by
    label. Client ``u`` gets the ``u``-th ``floor(n_iid/N)`` slice of the IID pool and the ``u``-th
    ``floor(n_niid/N)`` slice of the sorted pool; remainders are dropped. S=1 is IID, S=0 pathological.
    """
    n = len(y)
    perm = rng.permutation(n)
    n_iid = int(round(params["s"] * n))
    iid_pool, rest = perm[:n_iid], perm[n_iid:]
    rest = rest[np.argsort(y[rest], kind="stable")]
    a, b = n_iid // num_clients, (n - n_iid) // num_clients
    _check_min_train(np.full(num_clients, a + b), min_train, f"partition.s = {params['s']}")
    idx = np.concatenate([iid_pool[: a * num_clients], rest[: b * num_clients]])
    owner = np.concatenate([np.repeat(np.arange(num_clients), a), np.repeat(np.arange(num_clients), b)])
    return idx, owner, {}


SPEC = PARTITIONS.register(PartitionSpec("similarity", split, {
    "s": Param(0.5, "share of the data split IID; the rest is label-sorted (Clust-PSI-PFL)",
               lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]"),
}, title="Similarity(S): an IID share S plus label-sorted slices (Clust-PSI-PFL)"))
