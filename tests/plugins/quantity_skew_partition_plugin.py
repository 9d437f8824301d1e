"""Quantity skew (Li, Diao, Chen, He 2022, "Federated Learning on Non-IID Data Silos: An Experimental
Study", arXiv:2102.02079, section 4.3) as an external partition plugin.

The worked example of docs/adding-a-partition.md: a package registers it through the
`fedprism.partitions` entry-point group and it runs through `fedprism run`, sweeps, reports and Flower
like a built-in partition, its `partition.beta` key included.
"""

import math

import numpy as np

from fedprism.data.partitions import PartitionSpec
from fedprism.errors import PartitionError
from fedprism.hparams import Param


def split(y, num_classes, num_clients, min_train, rng, params):
    """Client sizes follow q ~ Dir(beta 1_N); the samples are shuffled and cut at floor(cumsum(q) n), so
    every client's labels follow the whole data's. As in the paper's code, the proportions are drawn
    again until every client holds `min_train` samples (at most `max_tries` draws)."""
    n = len(y)
    for attempt in range(params["max_tries"]):
        q = rng.dirichlet(np.full(num_clients, params["beta"]))
        cuts = np.floor(np.cumsum(q) * n).astype(np.int64)[:-1]
        sizes = np.diff(np.concatenate([[0], cuts, [n]]))
        if sizes.min() >= min_train:
            order = rng.permutation(n)
            return order, np.repeat(np.arange(num_clients), sizes), {"num_redraws": attempt}
    raise PartitionError(f"partition.min_train = {min_train} is not reachable with partition.beta = "
                         f"{params['beta']} and clients = {num_clients}: no draw in partition.max_tries = "
                         f"{params['max_tries']} gave every client {min_train} samples; raise partition.beta "
                         "or use fewer clients")


SPEC = PartitionSpec(
    name="quantity_skew",
    split=split,
    params={
        "beta": Param(0.5, "Dirichlet concentration of the client sizes (small: a few large clients)",
                      lambda v: math.isfinite(v) and v > 0, "a finite number > 0"),
        "max_tries": Param(100, "draws of the sizes allowed to give every client min_train samples",
                           lambda v: v >= 1, "an integer >= 1"),
    },
    title="client sizes ~ Dir(beta), labels IID (Li et al. 2022, arXiv:2102.02079)",
)
