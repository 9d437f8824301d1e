"""Label-skewed shards (`pathological`; McMahan et al. 2017, arXiv:1602.05629) or exactly ``s`` classes per
client (FedRep, arXiv:2102.07078; LG-FedAvg, arXiv:2001.01523)."""

from __future__ import annotations

import numpy as np

from fedprism.data.partitions.base import (PARTITIONS, PartitionSpec, _bad, _balanced_class_sets, _check_min_train,
                                         _class_pools, _from_counts, _split_among_holders)
from fedprism.hparams import Param


def split(y, num_classes, num_clients, min_train, rng, params):
    """Label-skewed shards (McMahan et al. 2017; FedRep / LG-FedAvg class variant).

    ``variant="shards"`` (McMahan et al.): stable sort by label, cut into ``N*s`` near-equal shards, each
    client gets ``s`` random shards (a client may get one class twice, a shard may straddle two).
    ``variant="classes"`` (FedRep / LG-FedAvg): each client gets exactly ``s`` distinct classes (chosen
    so classes are held about equally often) and every class is split equally among its holders.
    """
    s, n = params["shards_per_client"], len(y)
    if params["variant"] == "classes":
        order, starts, counts = _class_pools(y, num_classes, rng)
        present = counts > 0
        if s > present.sum():
            raise _bad("shards_per_client", s,
                       f"at most {int(present.sum())} (the number of classes present) with variant 'classes'")
        holders = _balanced_class_sets(rng, present, np.full(num_clients, s), num_classes)
        alloc = _split_among_holders(rng, holders, counts)
        _check_min_train(alloc.sum(axis=1), min_train, f"shards_per_client = {s} (variant 'classes')")
        idx, owner = _from_counts(alloc, order, starts, y[order])
        return idx, owner, {}
    n_shards = num_clients * s
    if n_shards > n:
        raise _bad("shards_per_client", s,
                   f"num_clients * shards_per_client = {n_shards} shards exceeds the {n} train samples; "
                   f"use at most {max(n // num_clients, 1)} shards per client or fewer clients")
    order = np.argsort(y, kind="stable")
    shard_sizes = np.full(n_shards, n // n_shards, dtype=np.int64)
    shard_sizes[: n % n_shards] += 1
    shard_owner = np.empty(n_shards, dtype=np.int64)
    shard_owner[rng.permutation(n_shards)] = np.arange(n_shards) // s
    _check_min_train(np.bincount(shard_owner, weights=shard_sizes, minlength=num_clients).astype(np.int64),
                     min_train, f"shards_per_client = {s}")
    return order, np.repeat(shard_owner, shard_sizes), {"shard_size": int(n // n_shards)}


SPEC = PARTITIONS.register(PartitionSpec("pathological", split, {
    "shards_per_client": Param(2, "shards (variant 'shards') or distinct classes (variant 'classes') "
                                  "per client", lambda v: v >= 1, "an integer >= 1"),
    "variant": Param("shards", "'shards': McMahan sorted shards; 'classes': exactly s classes per "
                               "client (FedRep)", choices=("shards", "classes")),
}, title="McMahan sorted shards, or exactly s distinct classes per client (FedRep / LG-FedAvg)"))
