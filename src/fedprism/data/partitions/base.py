"""What a partition is to the rest of fedprism: a `PartitionSpec` registered on `PARTITIONS`, the
`Partition` it produces, and the vectorised helpers the built-in partitioners share.

A partition is one module of `fedprism.data.partitions` (module `iid.py` holds the partition `iid`),
declaring its parameters (`partition.<key>` config keys, each a `fedprism.hparams.Param`) and its
function, and registering both as one `PartitionSpec`. Partitions of other packages come through the
`fedprism.partitions` entry-point group or `fedprism.register_partition`. `make_partition`
(`fedprism.data.partitions`) validates the common arguments, calls the function and draws each client's
test split (`splits`); nothing else names a partition.

Everything is vectorised numpy (one ``lexsort`` assembles all clients); loops run over clients or
classes only, never over samples. Randomness comes only from ``numpy.random.Generator`` streams.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np

from fedprism.errors import ConfigError, PartitionError
from fedprism.hparams import Param
from fedprism.registry import Registry

#: the partition.* keys of every partition: `make_partition`'s own arguments, not a partition's parameters
COMMON_KEYS = ("min_train", "min_test")

# Number of fixed domain transforms in fedprism.data.domains (kept here to avoid an import cycle).
NUM_DOMAIN_TRANSFORMS = 5


@dataclass
class Partition:
    """Per-client train and test indices (sorted ``int64``), optional domain ids and provenance.

    ``train[i]`` indexes the train labels, ``test[i]`` the official test labels. ``test`` arrays of
    different clients are disjoint unless ``meta["test_with_replacement"]`` is true (a class's test
    pool ran out and was reused across clients). ``domains`` is set by ``domain_mix`` only.
    """

    train: list[np.ndarray]
    test: list[np.ndarray]
    domains: np.ndarray | None = None
    meta: dict = field(default_factory=dict)

    @property
    def num_clients(self) -> int:
        return len(self.train)

    @property
    def n_train(self) -> np.ndarray:
        """[clients] number of train samples per client."""
        return np.array([len(t) for t in self.train], dtype=np.int64)

    @property
    def n_test(self) -> np.ndarray:
        """[clients] number of test samples per client."""
        return np.array([len(t) for t in self.test], dtype=np.int64)

    def hist(self, y: np.ndarray, num_classes: int, split: str = "train") -> np.ndarray:
        """[clients, classes] label counts of the ``"train"`` or ``"test"`` split (``y`` of that split)."""
        if split not in ("train", "test"):
            raise ValueError(f"split={split!r} is not valid: 'train' or 'test'")
        return label_histograms(self.train if split == "train" else self.test, y, num_classes)

    def train_sample_domains(self, n_train: int) -> np.ndarray:
        """[n_train] domain id of every train sample (its client's domain; -1 where unused).

        Lets the caller transform the train set once per domain with
        :func:`fedprism.data.domains.apply_domains`. Raises if the partition has no domains.
        """
        if self.domains is None:
            raise ValueError("this partition has no domains (only 'domain_mix' assigns them)")
        out = np.full(n_train, -1, dtype=np.int64)
        for idx, d in zip(self.train, self.domains):
            out[idx] = d
        return out


def label_histograms(index_lists: list[np.ndarray], y: np.ndarray, num_classes: int) -> np.ndarray:
    """[clients, classes] label counts of ``y[index_lists[i]]`` for every client (one ``bincount``)."""
    y = np.asarray(y)
    n = len(index_lists)
    if n == 0:
        return np.zeros((0, num_classes), dtype=np.int64)
    lens = np.fromiter((len(i) for i in index_lists), dtype=np.int64, count=n)
    if lens.sum() == 0:
        return np.zeros((n, num_classes), dtype=np.int64)
    flat = np.concatenate([np.asarray(i, dtype=np.int64) for i in index_lists])
    owner = np.repeat(np.arange(n, dtype=np.int64), lens)
    return np.bincount(owner * num_classes + y[flat], minlength=n * num_classes).reshape(n, num_classes)



def _positive_finite(x: float) -> bool:
    return math.isfinite(x) and x > 0


@dataclass(frozen=True)
class PartitionSpec:
    """One partition, declared.

    name:    the config value (`partition=NAME`)
    split:   the partitioner. ``split(y, num_classes, num_clients, min_train, rng, params) -> (idx, owner,
             extra)``: train indices ``idx`` and the client owning each (``owner``, same length; indices
             left out are unused), ``extra`` a dict merged into the partition's metadata (``"domains"``: an
             int array, one image domain per client). ``y`` are the int64 train labels, ``rng`` a numpy
             Generator seeded from the run's seed, ``params`` the resolved ``partition.*`` values. Each
             client's test split is then drawn from the official test set with its train label pmf.
    params:  key -> `fedprism.hparams.Param` (its default, validity check and help; `fedprism partitions`)
    title:   one line: what it does and where it comes from (paper, year, arXiv id)
    natural: the clients are the data's own users or devices: ``split`` is then called as
             ``split(y_train, y_test, num_clients, min_train, min_test, groups, test_groups) -> (train,
             test, meta)`` with each sample's group id and makes the test split itself (``natural``)
    perturb: a partition that skews the inputs as well as the split (``feature_noise``):
             ``perturb(x, client, num_clients, split, seed, params) -> x`` returns client ``client``'s rows
             ``x`` of ``split`` ("train", or "test" for its local test rows) as that client holds them. The
             federation calls it once per client and split when it is built, so it must be a pure function
             of its arguments (seeded from ``seed``); the global test set is never perturbed.
    """

    name: str
    split: Callable[..., Any]
    params: dict[str, Param] = field(default_factory=dict)
    title: str = ""
    natural: bool = False
    perturb: Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        # the module that declared it is its function's: a plugin cannot take a built-in's name (`Registry`)
        object.__setattr__(self, "__module__", getattr(self.split, "__module__", None) or type(self).__module__)


def _make(name: str, obj: Any) -> PartitionSpec:
    if isinstance(obj, PartitionSpec):
        return obj if obj.name == name else replace(obj, name=name)
    raise TypeError(f"partition {name!r}: {obj!r} is not a fedprism.data.partitions.PartitionSpec "
                    "(register_partition(name, split, params) makes one from a function)")


def _check(name: str, spec: PartitionSpec) -> None:
    import inspect

    if not callable(spec.split):
        raise TypeError(f"partition {name!r}: split {spec.split!r} is not callable")
    if spec.perturb is not None and not callable(spec.perturb):
        raise TypeError(f"partition {name!r}: perturb {spec.perturb!r} is not callable")
    if not isinstance(spec.params, dict):
        raise TypeError(f"partition {name!r}: params is {spec.params!r}, not a dict of key -> Param")
    for key, p in spec.params.items():
        if not isinstance(key, str) or not key or "." in key or not isinstance(p, Param):
            raise TypeError(f"partition {name!r}: params[{key!r}] = {p!r}; each key is a name without dots "
                            "and each value a fedprism.hparams.Param")
        if key in COMMON_KEYS:
            raise ValueError(f"partition {name!r}: params[{key!r}]: partition.{key} is a key of every partition "
                             "(make_partition's own argument); give the parameter another name")
    try:
        inspect.signature(spec.split).bind(*range(7 if spec.natural else 6))
    except TypeError as e:
        want = ("split(y_train, y_test, num_clients, min_train, min_test, groups, test_groups)" if spec.natural
                else "split(y, num_classes, num_clients, min_train, rng, params)")
        raise TypeError(f"partition {name!r}: {spec.split!r} cannot be called as {want} ({e})") from None
    except ValueError:                  # no signature to read: checked when it is called
        pass


#: name -> PartitionSpec: the built-in partitions (modules of `fedprism.data.partitions`) and registered ones
PARTITIONS: Registry[PartitionSpec] = Registry("partition", "fedprism.data.partitions",
                                               skip=("base", "splits", "summary"), check=_check, make=_make)
#: `partition=flwr:CLASS`: a partitioner of Flower Datasets (`fedprism.data.flwr_partitions`), made on first use
PARTITIONS.family("flwr", "fedprism.data.flwr_partitions:spec_for")


def _resolve_params(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """Defaults overlaid with ``params``, each validated by its ``Param``; errors become PartitionError."""
    spec = PARTITIONS.get(name, "partition").params
    unknown = sorted(set(params) - set(spec))
    if unknown:
        allowed = ", ".join(sorted(spec)) or "none"
        from fedprism.registry import suggest

        raise PartitionError(
            f"partition '{name}' has no parameter {', '.join(repr(u) for u in unknown)}"
            f"{suggest(unknown[0], sorted(spec))}; allowed: {allowed}"
        )
    out = {}
    for key, p in spec.items():
        value = params.get(key, p.default)
        try:
            out[key] = p.validate(f"partition.{key}", value)
        except ConfigError as e:
            raise PartitionError(str(e)) from None
    return out


def _bad(key: str, value: object, allowed: str) -> PartitionError:
    return PartitionError(f"partition.{key} = {value!r} is not valid: {allowed}")


def _assemble(idx: np.ndarray, owner: np.ndarray, num_clients: int) -> list[np.ndarray]:
    """Group ``idx`` by ``owner`` into one sorted int64 array per client (one lexsort, one split)."""
    idx = np.asarray(idx, dtype=np.int64)
    owner = np.asarray(owner, dtype=np.int64)
    order = np.lexsort((idx, owner))
    counts = np.bincount(owner, minlength=num_clients)
    return np.split(idx[order], np.cumsum(counts)[:-1])


def _class_pools(y: np.ndarray, num_classes: int, rng: np.random.Generator | None):
    """Indices grouped by class: (order, starts, counts); within a class shuffled when ``rng`` is given.

    ``order[starts[c]:starts[c] + counts[c]]`` are the indices of class ``c``.
    """
    if rng is None:
        order = np.argsort(y, kind="stable")
    else:
        perm = rng.permutation(len(y))
        order = perm[np.argsort(y[perm], kind="stable")]
    counts = np.bincount(y, minlength=num_classes).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    return order.astype(np.int64), starts, counts


def _from_counts(alloc: np.ndarray, order: np.ndarray, starts: np.ndarray, y_sorted: np.ndarray):
    """Hand out class pools by a [clients, classes] count matrix (column sums <= class sizes).

    Client ``i`` receives the next ``alloc[i, c]`` indices of class ``c``'s pool, clients in index order.
    Returns (idx, owner) for :func:`_assemble`.
    """
    n_clients, n_classes = alloc.shape
    demand = alloc.sum(axis=0)
    rank = np.arange(len(order)) - starts[y_sorted]          # position of each sample within its class
    idx = order[rank < demand[y_sorted]]                      # first demand[c] of each class, class-major
    owner = np.repeat(np.tile(np.arange(n_clients), n_classes), alloc.T.ravel())
    return idx, owner


def _largest_remainder(totals: np.ndarray, pmf: np.ndarray) -> np.ndarray:
    """Integer rows summing to ``totals`` that follow ``pmf`` rows (largest-remainder rounding).

    Classes with zero probability never receive a count.
    """
    raw = totals[:, None] * pmf
    base = np.floor(raw).astype(np.int64)
    rem = totals - base.sum(axis=1)
    frac = np.where(pmf > 0, raw - base, -1.0)
    rank = np.argsort(np.argsort(-frac, axis=1, kind="stable"), axis=1, kind="stable")
    return base + (rank < rem[:, None])


def _safe_dirichlet(rng: np.random.Generator, alpha: float, k: int, size: int) -> np.ndarray:
    """``size`` draws from Dir(alpha 1_k); a degenerate row (underflow at tiny alpha) becomes one-hot."""
    p = rng.dirichlet(np.full(k, alpha), size=size)
    bad = ~np.isfinite(p).all(axis=1) | (p.sum(axis=1) <= 0)
    if bad.any():
        p[bad] = 0.0
        p[bad, rng.integers(k, size=int(bad.sum()))] = 1.0
    return p


def _balanced_class_sets(rng: np.random.Generator, present: np.ndarray, k_per_client: np.ndarray,
                         num_classes: int) -> np.ndarray:
    """[clients, classes] 0/1 holder matrix: client i holds k_i distinct classes among ``present``.

    Greedy: each client takes the k_i least-held classes so far, ties broken at random, so every class
    is held by about the same number of clients and the class combinations are random.
    """
    held = np.zeros(num_classes)
    held[~present] = np.inf
    out = np.zeros((len(k_per_client), num_classes), dtype=bool)
    for i, k in enumerate(k_per_client):
        chosen = np.argsort(held + rng.random(num_classes), kind="stable")[:k]
        out[i, chosen] = True
        held[chosen] += 1
    return out


def _split_among_holders(rng: np.random.Generator, holders: np.ndarray,
                         class_counts: np.ndarray) -> np.ndarray:
    """[clients, classes] counts: every class split as equally as possible among its holders.

    The ``n_c mod h_c`` leftover samples go one each to holders chosen at random.
    """
    n_clients, n_classes = holders.shape
    alloc = np.zeros((n_clients, n_classes), dtype=np.int64)
    for c in range(n_classes):
        who = np.flatnonzero(holders[:, c])
        if who.size == 0:
            continue
        base, extra = divmod(int(class_counts[c]), who.size)
        alloc[who, c] = base
        alloc[rng.permutation(who)[:extra], c] += 1
    return alloc


def _check_min_train(sizes: np.ndarray, min_train: int, what: str) -> None:
    smallest = int(sizes.min())
    if smallest < min_train:
        raise PartitionError(
            f"partition.min_train = {min_train} is not reachable: {what} leaves client "
            f"{int(np.argmin(sizes))} with {smallest} train samples; use fewer clients (clients = "
            f"{len(sizes)}), a lower partition.min_train, or other partition parameters"
        )

