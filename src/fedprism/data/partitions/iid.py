"""Uniform random split into near-equal parts (`iid`)."""

from __future__ import annotations

import numpy as np

from fedprism.data.partitions.base import PARTITIONS, PartitionSpec


def split(y, num_classes, num_clients, min_train, rng, params):
    """Uniform random split into ``num_clients`` parts whose sizes differ by at most one."""
    n = len(y)
    perm = rng.permutation(n)
    sizes = np.full(num_clients, n // num_clients, dtype=np.int64)
    sizes[: n % num_clients] += 1
    return perm, np.repeat(np.arange(num_clients), sizes), {}


SPEC = PARTITIONS.register(PartitionSpec("iid", split, {}, title="uniform random split into near-equal parts"))
