"""Quantity skew: clients hold different amounts of data with the same label distribution (`quantity`;
Li, Diao, Chen, He 2022, "Federated Learning on Non-IID Data Silos: An Experimental Study",
arXiv:2102.02079, section 4.3)."""

from __future__ import annotations

import math

import numpy as np

from fedprism.data.partitions.base import PARTITIONS, PartitionSpec, _positive_finite
from fedprism.errors import PartitionError
from fedprism.hparams import Param


def client_sizes(num_clients: int, n: int, rng: np.random.Generator, params: dict) -> np.ndarray:
    """Each client's number of samples (they sum to ``n``).

    ``sizes = "dirichlet"``: shares ``q ~ Dir(beta 1_N)`` (the paper's quantity-based skew), cut by `sizes_of`.
    ``sizes = "power_law"``: shares ``q_r proportional to r^(-exponent)`` for the ranks ``r = 1..N``, cut by
    `sizes_of` in rank order, then the ranks are given to the clients in a seeded random order, so the largest
    client is not always client 0 (a Zipf law of client sizes, as the per-device sample counts of the LEAF
    datasets follow; ``exponent = 0`` is equal sizes).
    """
    if params["sizes"] == "dirichlet":
        return sizes_of(rng.dirichlet(np.full(num_clients, params["beta"])), n)
    ranks = rng.permutation(num_clients)
    return power_law_sizes(num_clients, n, params["exponent"])[ranks]


def power_law_sizes(num_clients: int, n: int, exponent: float) -> np.ndarray:
    """The sizes of the ranks 1..N under the power law (largest first)."""
    w = np.arange(1, num_clients + 1, dtype=float) ** -exponent
    return sizes_of(w / w.sum(), n)


def sizes_of(q: np.ndarray, n: int) -> np.ndarray:
    """Client sizes from shares: the shuffled samples are cut at ``floor(cumsum(q) n)`` (the paper's code),
    so the sizes sum to ``n`` and every sample is used."""
    cuts = np.floor(np.cumsum(q)[:-1] * n).astype(np.int64)
    return np.diff(np.concatenate([[0], np.minimum(cuts, n), [n]]))


def split(y, num_classes, num_clients, min_train, rng, params):
    """Client sizes from `client_sizes`; the samples are shuffled (one permutation) and cut by `sizes_of`, so
    every client's labels are an IID sample of the whole data's.

    Decision where the paper is silent on the power law: its sizes are fixed by the exponent (only their
    order is random), so a draw that leaves a client below ``partition.min_train`` is refused at once,
    naming the largest exponent that would do. A Dirichlet draw is repeated, as in the paper's code, until
    every client holds ``partition.min_train`` samples (at most ``partition.max_tries`` draws;
    ``meta["num_redraws"]`` counts the repeats). The permutation is drawn after the sizes, from the same
    stream."""
    n = len(y)
    tries = params["max_tries"] if params["sizes"] == "dirichlet" else 1
    for attempt in range(tries):
        sizes = client_sizes(num_clients, n, rng, params)
        if sizes.min() >= min_train:
            order = rng.permutation(n)
            return order, np.repeat(np.arange(num_clients), sizes), {"num_redraws": attempt,
                                                                      "client_sizes": sizes.tolist()}
    if params["sizes"] == "power_law":
        best = _largest_exponent(num_clients, n, min_train)
        fix = (f"use partition.exponent <= {math.floor(best * 1000) / 1000:g}" if best is not None
               else f"use fewer than {num_clients} clients")
        raise PartitionError(f"partition.min_train = {min_train} is not reachable with partition.sizes = power_law, "
                             f"partition.exponent = {params['exponent']} and clients = {num_clients}: the smallest "
                             f"client gets {int(sizes.min())} of the {n} samples; {fix}, or lower partition.min_train")
    raise PartitionError(f"partition.min_train = {min_train} is not reachable with partition.beta = {params['beta']} "
                         f"and clients = {num_clients}: no draw in partition.max_tries = {params['max_tries']} gave "
                         f"every client {min_train} of the {n} samples; raise partition.beta or use fewer clients")


def _largest_exponent(num_clients: int, n: int, min_train: int) -> float | None:
    """The largest power-law exponent (to 1e-3) whose smallest client holds `min_train` samples; None when
    not even equal sizes do."""
    def smallest(a: float) -> int:
        return int(power_law_sizes(num_clients, n, a).min())

    if smallest(0.0) < min_train:
        return None
    lo, hi = 0.0, 64.0
    while hi - lo > 1e-3:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if smallest(mid) >= min_train else (lo, mid)
    return lo


SPEC = PARTITIONS.register(PartitionSpec("quantity", split, {
    "sizes": Param("dirichlet", "how the client sizes are drawn: dirichlet (shares q ~ Dir(beta 1_N)) or power_law "
                   "(q_i proportional to rank^-exponent, ranks in a seeded random order)",
                   choices=("dirichlet", "power_law")),
    "beta": Param(0.5, "sizes=dirichlet: concentration of the shares (small: a few large clients; Li et al. 2022 "
                  "use 0.5)", _positive_finite, "a finite number > 0"),
    "exponent": Param(1.0, "sizes=power_law: the exponent a of q_i ~ rank^-a (0: equal sizes; 1: Zipf)",
                      lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0"),
    "max_tries": Param(100, "sizes=dirichlet: draws allowed to give every client partition.min_train samples",
                       lambda v: v >= 1, "an integer >= 1"),
}, title="quantity skew: client sizes from Dir(beta) or a power law, labels IID (Li et al. 2022, arXiv:2102.02079)"))
