"""Per client over classes, ``q_i ~ Dir(alpha 1)``, equal sizes (`dirichlet`; FedPrism paper 4.2, Hsu et al.
2019, arXiv:1909.06335)."""

from __future__ import annotations

import numpy as np

from fedprism.data.partitions.base import (PARTITIONS, PartitionSpec, _class_pools, _from_counts, _largest_remainder,
                                         _positive_finite, _safe_dirichlet)
from fedprism.hparams import Param


def split(y, num_classes, num_clients, min_train, rng, params):
    """Per client over classes (FedPrism paper, section 4.2): ``q_i ~ Dir(alpha 1)``, ``n_i = floor(n/N)``.

    Client ``i`` asks for ``n_i * q_i`` samples (largest-remainder rounding). When a class runs out,
    ``q_i`` is renormalised over the classes that remain and the shortfall is drawn again (repeated
    until it is filled); if every class ``q_i`` favours is gone, the shortfall follows the remaining
    pool. Clients are served in a seeded random order so the clients hurt by exhaustion are not always
    the last indices. ``meta["num_redraws"]`` counts clients that met a shortfall. The realised train
    pmf (not ``q_i``) is what the test split follows.
    """
    alpha = params["alpha"]
    order, starts, counts = _class_pools(y, num_classes, rng)
    present = counts > 0
    q = np.zeros((num_clients, num_classes))
    q[:, present] = _safe_dirichlet(rng, alpha, int(present.sum()), num_clients)
    size = len(y) // num_clients
    want = _largest_remainder(np.full(num_clients, size, dtype=np.int64), q)
    # Serve clients in a seeded random order. Everyone before the first shortfall gets ``want`` as is
    # (one cumsum); from there on clients are served one at a time with the renormalised redraw.
    serve = rng.permutation(num_clients)
    cum = np.cumsum(want[serve], axis=0)
    fits = (cum <= counts).all(axis=1)
    first_short = int(np.argmin(fits)) if not fits.all() else num_clients
    alloc = np.zeros((num_clients, num_classes), dtype=np.int64)
    alloc[serve[:first_short]] = want[serve[:first_short]]
    avail = counts - (cum[first_short - 1] if first_short > 0 else 0)
    redraws = 0
    for i in serve[first_short:]:
        take = np.minimum(want[i], avail)
        need = size - int(take.sum())
        redraws += need > 0
        while need > 0:
            avail_after = avail - take
            w = np.where(avail_after > 0, q[i], 0.0)
            if w.sum() <= 0:                      # every class q_i favours is gone: follow the pool
                w = avail_after.astype(float)
            extra = np.minimum(_largest_remainder(np.array([need]), (w / w.sum())[None, :])[0], avail_after)
            take = take + extra
            need -= int(extra.sum())
        alloc[i] = take
        avail = avail - take
    idx, owner = _from_counts(alloc, order, starts, y[order])
    return idx, owner, {"num_redraws": int(redraws)}


SPEC = PARTITIONS.register(PartitionSpec("dirichlet", split, {
    "alpha": Param(0.1, "Dirichlet concentration of each client's class pmf (FedPrism 4.2)",
                   _positive_finite, "a finite number > 0"),
}, title="per client over classes, p_i ~ Dir(alpha 1), equal sizes (FedPrism 4.2; Hsu et al. 2019)"))
