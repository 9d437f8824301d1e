"""Per class over clients with the balance and minimum-size steps (`dirichlet_per_class`; FedArtML,
Clust-PSI-PFL arXiv:2512.20363, PFLlib ``dir``)."""

from __future__ import annotations

import numpy as np

from fedprism.data.partitions.base import PARTITIONS, PartitionSpec, _class_pools, _from_counts, _positive_finite, _safe_dirichlet
from fedprism.errors import PartitionError
from fedprism.hparams import Param


def split(y, num_classes, num_clients, min_train, rng, params):
    """Per class over clients (FedArtML / PFLlib / Clust-PSI-PFL).

    For each class, ``p ~ Dir_N(alpha 1)``; clients already at or above the mean size ``n/N`` get no
    share (the balance step); the shuffled class is cut at ``floor(cumsum(p) * n_c)``. The whole draw
    is repeated until every client has ``min_train`` samples (``meta["num_redraws"]`` retries).
    """
    alpha, max_tries = params["alpha"], params["max_tries"]
    order, starts, counts = _class_pools(y, num_classes, rng)
    mean_size = len(y) / num_clients
    classes = np.flatnonzero(counts)
    smallest = 0
    for attempt in range(max_tries):
        alloc = np.zeros((num_clients, num_classes), dtype=np.int64)
        sizes = np.zeros(num_clients, dtype=np.int64)
        for c in classes:
            p = _safe_dirichlet(rng, alpha, num_clients, 1)[0]
            p = p * (sizes < mean_size)
            p = p / p.sum() if p.sum() > 0 else (sizes < mean_size) / (sizes < mean_size).sum()
            cuts = np.floor(np.cumsum(p) * counts[c]).astype(np.int64)[:-1]
            alloc[:, c] = np.diff(np.concatenate([[0], cuts, [counts[c]]]))
            sizes += alloc[:, c]
        smallest = int(sizes.min())
        if smallest >= min_train:
            idx, owner = _from_counts(alloc, order, starts, y[order])
            return idx, owner, {"num_redraws": attempt}
    raise PartitionError(
        f"partition.min_train = {min_train} is not reachable with partition.alpha = {params['alpha']} and "
        f"clients = {num_clients}: no draw in partition.max_tries = {max_tries} gave every client "
        f"{min_train} samples (last smallest client: {smallest}); raise partition.alpha, lower "
        f"partition.min_train or use fewer clients"
    )


SPEC = PARTITIONS.register(PartitionSpec("dirichlet_per_class", split, {
    "alpha": Param(0.5, "Dirichlet concentration of each class's split over clients",
                   _positive_finite, "a finite number > 0"),
    "max_tries": Param(1000, "redraws allowed to give every client min_train samples",
                       lambda v: v >= 1, "an integer >= 1"),
}, title="per class over clients, with the balance and minimum-size steps (FedArtML, Clust-PSI-PFL, PFLlib dir)"))
