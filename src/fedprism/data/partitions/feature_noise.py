"""Noise-based feature skew: an IID split in which client i's inputs carry Gaussian noise of standard
deviation ``sigma * i / N`` (`feature_noise`; Li, Diao, Chen, He 2022, "Federated Learning on Non-IID Data
Silos: An Experimental Study", arXiv:2102.02079, section 4.2, ``x_hat ~ Gau(sigma * i / N)``)."""

from __future__ import annotations

import math

import numpy as np

from fedprism.data.partitions import iid
from fedprism.data.partitions.base import PARTITIONS, PartitionSpec
from fedprism.hparams import Param

#: a constant of the noise streams, so that they are independent of every other stream of the run seed
NOISE_STREAM = 0x401E

#: the noise stream of each split a client's rows come from
SPLITS = {"train": 0, "test": 1}


def split(y, num_classes, num_clients, min_train, rng, params):
    """The labels are split IID (`iid`: near-equal sizes, one seeded permutation); the skew is in the
    inputs (`perturb`). ``meta["noise_std"]`` lists each client's standard deviation."""
    idx, owner, extra = iid.split(y, num_classes, num_clients, min_train, rng, params)
    return idx, owner, {**extra, "noise_std": [noise_std(i, num_clients, params["sigma"])
                                               for i in range(num_clients)]}


def noise_std(client: int, num_clients: int, sigma: float) -> float:
    """``sigma * i / N`` for client i of N (client 0 keeps clean inputs)."""
    return sigma * client / num_clients


def perturb(x, client: int, num_clients: int, split: str, seed: int, params: dict):
    """Client ``client``'s inputs ``x`` (its rows of one split, in the order of its sorted index list) with
    its Gaussian noise added.

    Decisions where the paper is silent or where its code differs:

    * The noise is drawn **once**, when the federation is built, from the stream
      ``numpy.random.default_rng([seed, NOISE_STREAM, client, SPLITS[split]])`` (float32 standard normals, one
      per input value, in row order), not again at every epoch as the paper's code (a torchvision transform)
      does: so the data is a fixed array that both engines, a resumed run and a Flower node holding the client
      see bit for bit, and its fingerprint identifies the run's data.
    * It is added to the inputs as the models see them, after normalisation (per-channel standardised images,
      standardised tabular features): ``sigma`` is in units of the normalised inputs. The paper's code adds it
      after ToTensor (and after Normalize for CIFAR-10).
    * The client's local test rows get noise of the same level, drawn from the client's own test stream, so
      local accuracy is measured on the client's own feature distribution; the global test set stays clean.
    """
    import torch

    std = noise_std(client, num_clients, params["sigma"])
    if std == 0 or x.numel() == 0:
        return x
    rng = np.random.default_rng([int(seed), NOISE_STREAM, int(client), SPLITS[split]])
    noise = torch.from_numpy(rng.standard_normal(tuple(x.shape), dtype=np.float32))
    return x + noise * np.float32(std)


SPEC = PARTITIONS.register(PartitionSpec("feature_noise", split, {
    "sigma": Param(0.1, "noise level: client i of N gets Gaussian noise of std sigma*i/N on its inputs (in "
                   "units of the normalised inputs; Li et al. 2022 use 0.1)",
                   lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0"),
}, title="feature skew: IID labels, client i's inputs + Gaussian noise of std sigma*i/N (Li et al. 2022, "
         "arXiv:2102.02079)", perturb=perturb))
