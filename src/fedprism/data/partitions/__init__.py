"""Split a labelled dataset across clients the way real federations are skewed.

Every partitioner maps the train labels to one sorted ``int64`` index array per client; the train
arrays are pairwise disjoint. Each client's test indices are then drawn from the official test set
with the client's *train* label pmf (`splits`), so local accuracy is measured on the client's own
distribution while the full test set stays available for global accuracy.

One module per partition, each declaring a `PartitionSpec` (its ``partition.<key>`` parameters and its
function) on the `PARTITIONS` registry (`base` says what a spec declares); `fedprism partitions` lists
them. Built in:

==================== ================================================================================
``iid``              uniform random split into near-equal parts
``dirichlet``        per client over classes, ``p_i ~ Dir(alpha 1)``, equal sizes (FedPrism 4.2,
                     Hsu et al. 2019)
``dirichlet_per_class`` per class over clients with the balance and minimum-size steps (FedArtML,
                     Clust-PSI-PFL, PFLlib ``dir``)
``pathological``     McMahan sorted shards (``variant="shards"``) or exactly ``s`` distinct classes per
                     client (``variant="classes"``, FedRep / LG-FedAvg)
``similarity``       Similarity(S): an IID share ``S`` plus label-sorted slices (Clust-PSI-PFL)
``domain_mix``       mixed feature + label skew: one image domain and ``n`` classes per client (PFPL;
                     the domain transforms live in :mod:`fedprism.data.domains`)
``natural``          one client per natural user or device of the data (``groups=``, e.g. the WISDM
                     users), or per value of a named column (``partition.column``); each client's test
                     rows are its own user's held-out samples
``quantity``         quantity skew: client sizes from ``Dir(beta)`` or a power law, labels IID (Li et al.
                     2022, arXiv:2102.02079)
``feature_noise``    feature skew: IID labels, client i's inputs plus Gaussian noise of std
                     ``sigma * i / N`` (Li et al. 2022), applied once when the federation is built
``user_shift``       per-user feature shift: Dirichlet labels, one fixed rotation, translation, contrast,
                     brightness and noise per client (classes mean the same everywhere; a FedSub substitute)
==================== ================================================================================

Partitions of other packages come through the ``fedprism.partitions`` entry-point group or
`register_partition` (docs/adding-a-partition.md). Shared code: `base` (types, registry, vectorised
helpers), `splits` (test splits, local hold-out), `summary` (per-client summaries).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from fedprism.data.partitions.base import (PARTITIONS, Partition, PartitionSpec, _assemble, _bad, _check_min_train,
                                           _positive_finite, _resolve_params, label_histograms)
from fedprism.data.partitions.splits import _test_split, local_holdout
from fedprism.data.partitions.summary import summarize
from fedprism.errors import PartitionError
from fedprism.hparams import Param
from fedprism.registry import suggest

__all__ = ["PARTITIONS", "Partition", "PartitionSpec", "label_histograms", "local_holdout", "make_partition",
           "register_partition", "summarize"]


def register_partition(name: str, split: Callable[..., Any] | PartitionSpec,
                       params: dict[str, Param] | None = None, title: str = "") -> PartitionSpec:
    """Register a partition in this process: ``split(y, num_classes, num_clients, min_train, rng, params)
    -> (idx, owner, extra)`` (`PartitionSpec` says what each is) with its ``partition.<key>`` parameters,
    or a whole `PartitionSpec`. Not a built-in partition's name; registering a name again replaces it.
    Returns the registered spec. A partition of an installed package is better declared in its
    ``fedprism.partitions`` entry-point group (then every process, Flower nodes included, has it)."""
    spec = split if isinstance(split, PartitionSpec) else PartitionSpec(name, split, dict(params or {}), title)
    if PARTITIONS.is_builtin(name):
        raise ValueError(f"register_partition: {name!r} is a built-in partition; give yours a name of its own")
    spec = PARTITIONS.register(spec, name=name)
    import sys

    federation = sys.modules.get("fedprism.experiment.federation")
    if federation is not None:          # its cached federations of `name` were split by the function replaced
        federation.clear_federations()
    return spec


def _labels(y: Any, name: str) -> np.ndarray:
    y = np.asarray(y)
    if y.ndim != 1:
        raise PartitionError(f"{name} must be a 1-D array of class labels, got shape {y.shape}")
    if y.size and not np.issubdtype(y.dtype, np.integer):
        if not (np.issubdtype(y.dtype, np.floating) and np.all(np.mod(y, 1) == 0)):
            raise PartitionError(f"{name} must hold integer class labels 0..C-1, got dtype {y.dtype}")
    y = y.astype(np.int64)
    if y.size and y.min() < 0:
        raise PartitionError(f"{name} must hold class labels >= 0, found {int(y.min())}")
    return y


def _int_arg(key: str, value: Any, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo:
        raise PartitionError(f"{key} = {value!r} is not valid: an integer >= {lo}")
    return int(value)


def make_partition(name: str, y_train: np.ndarray, y_test: np.ndarray, num_clients: int, seed: int,
                   min_train: int = 10, min_test: int = 1, test_ratio: float | None = None,
                   *, groups: Any = None, test_groups: Any = None, **params: Any) -> Partition:
    """Split ``y_train`` over ``num_clients`` with partition ``name`` and draw matching test splits.

    ``params`` are the partition's parameters (``PARTITIONS[name].params``); unknown ones are errors.
    ``min_train`` / ``min_test`` are the fewest train / test samples a client may get; ``test_ratio``
    sets test size per train sample (default ``len(y_test)/len(y_train)``). The same arguments and
    seed always give the same partition. Raises :class:`PartitionError` for impossible requests.

    ``natural`` needs ``groups`` / ``test_groups`` (each train / test sample's user or device id, as
    :class:`fedprism.data.datasets.Dataset` records them) and exactly one client per train group;
    client i gets the samples of the i-th smallest id, its test rows are that user's own test samples
    (``meta["client_groups"]`` lists the ids), and ``test_ratio`` does not apply. The other partitions
    ignore ``groups``.
    """
    if not isinstance(name, str) or name not in PARTITIONS:
        names = PARTITIONS.names()
        hint = suggest(name, names) if isinstance(name, str) else ""
        raise PartitionError(f"partition = {name!r} is not valid: one of {', '.join(names)}{hint}")
    spec = PARTITIONS.get(name)
    resolved = _resolve_params(name, params)
    y_train, y_test = _labels(y_train, "y_train"), _labels(y_test, "y_test")
    num_clients = _int_arg("clients", num_clients, 1)          # the config key's name in messages
    seed = _int_arg("seed", seed, 0)
    min_train = _int_arg("min_train", min_train, 1)
    min_test = _int_arg("min_test", min_test, 0)
    if test_ratio is not None and (isinstance(test_ratio, bool) or not isinstance(test_ratio, (int, float))
                                   or not _positive_finite(float(test_ratio))):
        raise PartitionError(f"test_ratio = {test_ratio!r} is not valid: None or a finite number > 0")
    n = len(y_train)
    if spec.natural:
        return _make_natural(spec, y_train, y_test, num_clients, seed, min_train, min_test, test_ratio, groups,
                             test_groups, resolved)
    if num_clients * min_train > n:
        raise PartitionError(
            f"clients = {num_clients} is not valid: with partition.min_train = {min_train} the {n} train "
            f"samples allow at most {n // min_train} clients"
        )
    if min_test > max(len(y_test), 1):     # each client's test split would repeat the whole test set
        raise _bad("min_test", min_test, f"at most the {len(y_test)} samples of the test set")
    num_classes = int(max(y_train.max(initial=-1), y_test.max(initial=-1))) + 1

    rng_train, rng_test = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2))
    idx, owner, extra = spec.split(y_train, num_classes, num_clients, min_train, rng_train, resolved)
    train = _assemble(idx, owner, num_clients)
    _check_min_train(np.array([len(t) for t in train]), min_train, f"partition '{name}'")
    test, test_meta = _test_split(train, y_train, y_test, num_classes, min_test,
                                  None if test_ratio is None else float(test_ratio), rng_test)
    domains = extra.pop("domains", None)
    used = int(sum(len(t) for t in train))
    meta = {
        "partition": name,
        "params": resolved,
        "seed": seed,
        "num_clients": num_clients,
        "num_classes": num_classes,
        "min_train": min_train,
        "min_test": min_test,
        "test_ratio": (len(y_test) / n) if test_ratio is None else float(test_ratio),
        "num_redraws": 0,
        "n_train_used": used,
        "n_train_unused": n - used,
        **extra,
        **test_meta,
    }
    if domains is not None:
        meta["client_domains"] = domains.tolist()        # per-client domain, for per-domain accuracy
    return Partition(train=train, test=test, domains=domains, meta=meta)


def _make_natural(spec: PartitionSpec, y_train: np.ndarray, y_test: np.ndarray, num_clients: int, seed: int, min_train: int,
                  min_test: int, test_ratio: float | None, groups: Any, test_groups: Any,
                  resolved: dict | None = None) -> Partition:
    if test_ratio is not None:
        raise PartitionError(f"test_ratio = {test_ratio!r} is not valid for partition '{spec.name}': each "
                             "client's test rows are its own user's held-out samples; leave test_ratio unset")
    train, test, test_meta = spec.split(y_train, y_test, num_clients, min_train, min_test, groups, test_groups)
    n = len(y_train)
    used = int(sum(len(t) for t in train))
    meta = {
        "partition": spec.name,
        # the parameters away from their defaults only (`natural`'s `column`): a natural partition of the
        # dataset's own clients records {} as before it had parameters
        "params": {k: v for k, v in (resolved or {}).items() if v != spec.params[k].default},
        "seed": seed,
        "num_clients": num_clients,
        "num_classes": int(max(y_train.max(initial=-1), y_test.max(initial=-1))) + 1,
        "min_train": min_train,
        "min_test": min_test,
        "test_ratio": len(y_test) / n if n else 0.0,
        "num_redraws": 0,
        "n_train_used": used,
        "n_train_unused": n - used,
        **test_meta,
    }
    return Partition(train=train, test=test, meta=meta)
