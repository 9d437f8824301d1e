"""Where `fedprism tune` searches the built-in methods' own keys (docs/tuning.md).

A method written today declares a key's search space beside the key, `Param(..., space=Space(...))`
(`fedprism.hparams.Space`). The built-in methods declare theirs here, one entry per method beside its
`params`, because a method's source file is what identifies its stored runs (the code fingerprint of
`fedprism.experiment.provenance`): a line added to `fedprox.py` would mark every stored FedProx run as
produced by other code. `Algorithm.search_space()` joins the two (a `Param.space` first, this table
over it) with the experiment keys that declare a space (`lr`); a study file overrides any of them.

The ranges are the ones the methods' papers searched, where they say, widened to a decade or so around
the default otherwise:
* FedProx mu: {0.001, 0.01, 0.1, 0.5, 1} in Li et al. 2020, "Federated Optimization in Heterogeneous
  Networks", arXiv:1812.06127 -> [1e-4, 1] log.
* Ditto lambda: {0.01, 0.1, 1, 2} in Li et al. 2021, "Ditto: Fair and Robust Federated Learning Through
  Personalization", arXiv:2012.04221 -> [0.01, 10] log.
* APFL alpha: {0.25, 0.5, 0.75} (its initial value under adaptive mixing) in Deng, Kamani, Mahdavi 2020,
  "Adaptive Personalized Federated Learning", arXiv:2003.13461 -> [0.1, 0.9].
* FedRep's head epochs: 10 in Collins et al. 2021, "Exploiting Shared Representations for Personalized
  Federated Learning", arXiv:2102.07078 -> [1, 10] integers.
* MOON mu: {0.1, 1, 5, 10} in Li, He, Song 2021, "Model-Contrastive Federated Learning",
  arXiv:2103.16257 -> [0.01, 10] log.
* pFedMe lambda {15, 20, 30}, personal lr {0.01, 0.05, 0.1} in Dinh, Tran, Nguyen 2020, "Personalized
  Federated Learning with Moreau Envelopes", arXiv:2006.08848.
Clust-PSI-PFL's number of clusters (0: chosen by silhouette), FedPrism's and Fed-PRISM's mixing weights,
temperatures and cluster counts are searched around their defaults (docs/clust_psi_pfl.md and the
methods' module docstrings).
"""

from __future__ import annotations

from fedprism.hparams import Space

_LOG_WEIGHT = Space(0.01, 10.0, "log")       # a proximal or prototype weight around its default of 1

#: method -> {its key (without the method prefix) -> Space}
SPACES: dict[str, dict[str, Space]] = {
    "fedprox": {"mu": Space(1e-4, 1.0, "log")},
    "ditto": {"lam": Space(0.01, 10.0, "log")},
    "apfl": {"alpha": Space(0.1, 0.9)},
    "fedrep": {"head_epochs": Space(1, 10, integer=True)},
    "clust_psi_pfl": {"clusters": Space(choices=(0, 2, 3, 4))},
    "fedprism_dual": {"alpha": Space(0.5, 0.9), "beta": Space(0.0, 0.1), "temperature": Space(0.01, 1.0, "log"),
                      "k": Space(2, 5, integer=True)},
    "fedprism": {"alpha": Space(0.0, 1.0), "temperature": Space(0.1, 10.0, "log"), "k": Space(2, 5, integer=True)},
    "moon": {"mu": _LOG_WEIGHT, "tau": Space(0.1, 1.0)},
    "feddyn": {"alpha": Space(1e-4, 0.1, "log")},
    "pfedme": {"lam": Space(1.0, 30.0, "log"), "personal_lr": Space(0.01, 0.5, "log")},
    "perfedavg": {"alpha": Space(1e-3, 0.1, "log")},
    "fedproto": {"lam": _LOG_WEIGHT},
    "fedpac": {"lam": _LOG_WEIGHT},
    "protohar": {"lam": _LOG_WEIGHT},
    "pfpl": {"alpha": Space(0.0, 1.0), "lam": _LOG_WEIGHT},
    "gpfl": {"lam": Space(1e-3, 1.0, "log"), "mu": Space(0.01, 1.0, "log")},
    "fedamp": {"mu": Space(0.01, 1.0, "log"), "self_weight": Space(0.0, 1.0)},
    "fedsoft": {"lam": Space(0.01, 1.0, "log")},
    "qffl": {"q": Space(0.0, 5.0)},
    "scaffold": {"global_lr": Space(0.1, 2.0, "log")},
    "fedala": {"eta": Space(0.1, 2.0, "log")},
    "fedbabu": {"finetune_epochs": Space(1, 10, integer=True)},
    "ifca": {"k": Space(2, 5, integer=True)},
    "fedclust": {"k": Space(2, 5, integer=True)},
    "fedem": {"m": Space(2, 5, integer=True)},
    "fedfomo": {"epsilon": Space(0.0, 1.0)},
}
