"""Mixed feature + label skew: one image domain and ``n`` classes per client (`domain_mix`; PFPL). The
domain transforms live in :mod:`fedprism.data.domains`."""

from __future__ import annotations

import numpy as np

from fedprism.data.partitions.base import (NUM_DOMAIN_TRANSFORMS, PARTITIONS, PartitionSpec, _bad, _balanced_class_sets,
                                         _check_min_train, _class_pools, _from_counts, _split_among_holders)
from fedprism.hparams import Param


def split(y, num_classes, num_clients, min_train, rng, params):
    """Mixed feature + label skew (PFPL: personalized federated prototype learning in mixed heterogeneous data scenarios, "n-way" label skew plus a random domain per client).

    Client ``i`` draws ``n_i`` uniformly in ``[min_classes, max_classes]`` and holds ``n_i`` distinct
    classes (each class held about equally often; every class is split equally among its holders, so
    per-class counts ``k`` vary with the number of holders). ``min_keep`` < 1 varies ``k`` per client as
    PFPL's protocol does ("we stochastically change the values of n and k for each client"): client ``i``
    keeps a fraction ``u_i`` ~ U[min_keep, 1] of each of its class shares (floor, at least one sample of
    a class it holds), drawn after everything above, so 1 (the default) is the partition every committed
    run had. Domains are assigned balanced and shuffled:
    ``domains = permutation(arange(N) % num_domains)``; the integrator applies
    :func:`fedprism.data.domains.apply_domain` with each client's domain to its samples.
    """
    lo, hi, n_dom = params["min_classes"], params["max_classes"], params["num_domains"]
    if hi < lo:
        raise _bad("max_classes", hi, f"an integer >= partition.min_classes = {lo}")
    order, starts, counts = _class_pools(y, num_classes, rng)
    present = counts > 0
    if hi > present.sum():
        raise _bad("max_classes", hi, f"at most {int(present.sum())} (the number of classes present)")
    k = rng.integers(lo, hi + 1, size=num_clients)
    holders = _balanced_class_sets(rng, present, k, num_classes)
    alloc = _split_among_holders(rng, holders, counts)
    domains = rng.permutation(np.arange(num_clients) % n_dom).astype(np.int64)
    keep = params.get("min_keep", 1.0)
    if keep < 1.0:
        u = rng.uniform(keep, 1.0, size=num_clients)
        alloc = np.where(alloc > 0, np.maximum(np.floor(alloc * u[:, None]), 1), 0).astype(np.int64)
    _check_min_train(alloc.sum(axis=1), min_train, "domain_mix")
    idx, owner = _from_counts(alloc, order, starts, y[order])
    return idx, owner, {"domains": domains}


SPEC = PARTITIONS.register(PartitionSpec("domain_mix", split, {
    "num_domains": Param(4, "number of image domains (fixed transforms in fedprism.data.domains)",
                         lambda v: 1 <= v <= NUM_DOMAIN_TRANSFORMS,
                         f"an integer in [1, {NUM_DOMAIN_TRANSFORMS}]"),
    "min_classes": Param(2, "fewest classes a client holds", lambda v: v >= 1, "an integer >= 1"),
    "max_classes": Param(5, "most classes a client holds", lambda v: v >= 1, "an integer >= 1"),
    "min_keep": Param(1.0, "smallest share of its class allocation a client keeps (each client draws its "
                      "share in [min_keep, 1]: k varies per client; 1: every client keeps all)",
                      lambda v: 0 < v <= 1, "a number in (0, 1]"),
}, title="mixed feature + label skew: one image domain and n classes per client (PFPL)"))
