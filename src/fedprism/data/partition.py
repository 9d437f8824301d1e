"""Split a labelled dataset across clients the way real federations are skewed.

Every partitioner maps the train labels to one sorted ``int64`` index array per client; the train
arrays are pairwise disjoint. Each client's test indices are then drawn from the official test set
with the client's *train* label pmf (see `local_test_split` below), so local accuracy is measured on the
client's own distribution while the full test set stays available for global accuracy.

Partitions (``PARTITIONS`` lists their parameters; config keys are ``partition.<key>``):

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
                     users); each client's test rows are its own user's held-out samples
==================== ================================================================================

Everything is vectorised numpy (one ``lexsort`` assembles all clients); loops run over clients or
classes only, never over samples, so 60 000 labels over 1 000 clients split in milliseconds.
Randomness comes only from ``numpy.random.Generator`` streams spawned from ``seed``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from fedprism.errors import ConfigError, PartitionError
from fedprism.hparams import Param

__all__ = [
    "PARTITIONS",
    "Partition",
    "label_histograms",
    "local_holdout",
    "make_partition",
    "summarize",
]

# Number of fixed domain transforms in fedprism.data.domains (kept here to avoid an import cycle).
_NUM_DOMAIN_TRANSFORMS = 5


# --------------------------------------------------------------------------------------------------
# Result type
# --------------------------------------------------------------------------------------------------


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


def summarize(part: Partition, y_train: np.ndarray, num_classes: int) -> list[dict]:
    """One row per client: sizes, classes present, dominant class and its share (for printing/storing),
    and the client's domain when the partition assigns domains (``domain_mix``).

    ``part`` may be any object with ``train`` and ``test`` index lists (and optionally ``domains``).
    """
    hist = label_histograms(part.train, np.asarray(y_train), num_classes)
    n_test = [len(t) for t in part.test]
    domains = getattr(part, "domains", None)
    rows = []
    for i, h in enumerate(hist):
        n = int(h.sum())
        present = np.flatnonzero(h)
        dom = int(np.argmax(h)) if n else -1
        rows.append(
            {
                "client": i,
                "n_train": n,
                "n_test": int(n_test[i]),
                "classes": present.tolist(),
                "num_classes": int(present.size),
                "dominant_class": dom,
                "dominant_share": float(h[dom] / n) if n else 0.0,
            }
        )
        if domains is not None:
            rows[-1]["domain"] = int(domains[i])
    return rows


# --------------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------------


def _positive_finite(x: float) -> bool:
    return math.isfinite(x) and x > 0


PARTITIONS: dict[str, dict[str, Param]] = {
    "iid": {},
    "dirichlet": {
        "alpha": Param(0.1, "Dirichlet concentration of each client's class pmf (FedPrism 4.2)",
                       _positive_finite, "a finite number > 0"),
    },
    "dirichlet_per_class": {
        "alpha": Param(0.5, "Dirichlet concentration of each class's split over clients",
                       _positive_finite, "a finite number > 0"),
        "max_tries": Param(1000, "redraws allowed to give every client min_train samples",
                           lambda v: v >= 1, "an integer >= 1"),
    },
    "pathological": {
        "shards_per_client": Param(2, "shards (variant 'shards') or distinct classes (variant 'classes') "
                                      "per client", lambda v: v >= 1, "an integer >= 1"),
        "variant": Param("shards", "'shards': McMahan sorted shards; 'classes': exactly s classes per "
                                   "client (FedRep)", choices=("shards", "classes")),
    },
    "similarity": {
        "s": Param(0.5, "share of the data split IID; the rest is label-sorted (Clust-PSI-PFL)",
                   lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]"),
    },
    "domain_mix": {
        "num_domains": Param(4, "number of image domains (fixed transforms in fedprism.data.domains)",
                             lambda v: 1 <= v <= _NUM_DOMAIN_TRANSFORMS,
                             f"an integer in [1, {_NUM_DOMAIN_TRANSFORMS}]"),
        "min_classes": Param(2, "fewest classes a client holds", lambda v: v >= 1, "an integer >= 1"),
        "max_classes": Param(5, "most classes a client holds", lambda v: v >= 1, "an integer >= 1"),
    },
    "natural": {},
}


def _resolve_params(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """Defaults overlaid with ``params``, each validated by its ``Param``; errors become PartitionError."""
    spec = PARTITIONS[name]
    unknown = sorted(set(params) - set(spec))
    if unknown:
        allowed = ", ".join(sorted(spec)) or "none"
        raise PartitionError(
            f"partition '{name}' has no parameter {', '.join(repr(u) for u in unknown)}; allowed: {allowed}"
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


# --------------------------------------------------------------------------------------------------
# Vectorised helpers
# --------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------
# Partitioners: (y, num_classes, num_clients, min_train, rng, params) -> (idx, owner, extra)
# --------------------------------------------------------------------------------------------------


def _check_min_train(sizes: np.ndarray, min_train: int, what: str) -> None:
    smallest = int(sizes.min())
    if smallest < min_train:
        raise PartitionError(
            f"partition.min_train = {min_train} is not reachable: {what} leaves client "
            f"{int(np.argmin(sizes))} with {smallest} train samples; use fewer clients (clients = "
            f"{len(sizes)}), a lower partition.min_train, or other partition parameters"
        )


def _iid(y, num_classes, num_clients, min_train, rng, params):
    """Uniform random split into ``num_clients`` parts whose sizes differ by at most one."""
    n = len(y)
    perm = rng.permutation(n)
    sizes = np.full(num_clients, n // num_clients, dtype=np.int64)
    sizes[: n % num_clients] += 1
    return perm, np.repeat(np.arange(num_clients), sizes), {}


def _dirichlet_client(y, num_classes, num_clients, min_train, rng, params):
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


def _dirichlet_per_class(y, num_classes, num_clients, min_train, rng, params):
    """Per class over clients (FedArtML / PFLlib / Clust-PSI-PFL).

    For each class, ``p ~ Dir_N(alpha 1)``; clients already at or above the mean size ``n/N`` get no
    share (the balance step); the shuffled class is cut at ``floor(cumsum(p) * n_c)``. The whole draw
    is repeated until every client has ``min_train`` samples (``meta["num_redraws"]`` retries).
    """
    alpha, max_tries = params["alpha"], params["max_tries"]
    order, starts, counts = _class_pools(y, num_classes, rng)
    mean_size = len(y) / num_clients
    classes = np.flatnonzero(counts)
    smallest = 0
    for attempt in range(max_tries):
        alloc = np.zeros((num_clients, num_classes), dtype=np.int64)
        sizes = np.zeros(num_clients, dtype=np.int64)
        for c in classes:
            p = _safe_dirichlet(rng, alpha, num_clients, 1)[0]
            p = p * (sizes < mean_size)
            p = p / p.sum() if p.sum() > 0 else (sizes < mean_size) / (sizes < mean_size).sum()
            cuts = np.floor(np.cumsum(p) * counts[c]).astype(np.int64)[:-1]
            alloc[:, c] = np.diff(np.concatenate([[0], cuts, [counts[c]]]))
            sizes += alloc[:, c]
        smallest = int(sizes.min())
        if smallest >= min_train:
            idx, owner = _from_counts(alloc, order, starts, y[order])
            return idx, owner, {"num_redraws": attempt}
    raise PartitionError(
        f"partition.min_train = {min_train} is not reachable with partition.alpha = {params['alpha']} and "
        f"clients = {num_clients}: no draw in partition.max_tries = {max_tries} gave every client "
        f"{min_train} samples (last smallest client: {smallest}); raise partition.alpha, lower "
        f"partition.min_train or use fewer clients"
    )


def _pathological(y, num_classes, num_clients, min_train, rng, params):
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


def _similarity(y, num_classes, num_clients, min_train, rng, params):
    """Similarity(S) (Clust-PSI-PFL section IV; psi_pfl ``split_dataset_by_percent``).

    Shuffle all indices; the first ``round(S n)`` form the IID pool, the rest are stable-sorted by
    label. Client ``u`` gets the ``u``-th ``floor(n_iid/N)`` slice of the IID pool and the ``u``-th
    ``floor(n_niid/N)`` slice of the sorted pool; remainders are dropped. S=1 is IID, S=0 pathological.
    """
    n = len(y)
    perm = rng.permutation(n)
    n_iid = int(round(params["s"] * n))
    iid_pool, rest = perm[:n_iid], perm[n_iid:]
    rest = rest[np.argsort(y[rest], kind="stable")]
    a, b = n_iid // num_clients, (n - n_iid) // num_clients
    _check_min_train(np.full(num_clients, a + b), min_train, f"partition.s = {params['s']}")
    idx = np.concatenate([iid_pool[: a * num_clients], rest[: b * num_clients]])
    owner = np.concatenate([np.repeat(np.arange(num_clients), a), np.repeat(np.arange(num_clients), b)])
    return idx, owner, {}


def _domain_mix(y, num_classes, num_clients, min_train, rng, params):
    """Mixed feature + label skew (PFPL: personalized federated prototype learning in mixed heterogeneous data scenarios, "n-way" label skew plus a random domain per client).

    Client ``i`` draws ``n_i`` uniformly in ``[min_classes, max_classes]`` and holds ``n_i`` distinct
    classes (each class held about equally often; every class is split equally among its holders, so
    per-class counts ``k`` vary with the number of holders). Domains are assigned balanced and shuffled:
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
    _check_min_train(alloc.sum(axis=1), min_train, "domain_mix")
    domains = rng.permutation(np.arange(num_clients) % n_dom).astype(np.int64)
    idx, owner = _from_counts(alloc, order, starts, y[order])
    return idx, owner, {"domains": domains}


_PARTITIONERS: dict[str, Callable] = {
    "iid": _iid,
    "dirichlet": _dirichlet_client,
    "dirichlet_per_class": _dirichlet_per_class,
    "pathological": _pathological,
    "similarity": _similarity,
    "domain_mix": _domain_mix,
}


# --------------------------------------------------------------------------------------------------
# Test split
# --------------------------------------------------------------------------------------------------


def _test_split(train, y_train, y_test, num_classes, min_test, test_ratio, rng):
    """Each client's test indices: its train label pmf applied to the official test set.

    Size ``max(min_test, round(n_train_i * ratio))`` with ``ratio = test_ratio`` or
    ``len(y_test)/len(y_train)``; per-class counts by largest-remainder rounding. Each class's shuffled
    test pool is handed out to clients in turn, disjoint while it lasts; when a class's demand exceeds
    its pool the pool is walked again from the start (reuse across clients, recorded in the meta).
    Classes absent from the test set are dropped from the client's pmf before rounding.
    """
    n_clients = len(train)
    meta = {"test_with_replacement": False, "test_reused_classes": [], "test_reused_samples": 0,
            "clients_without_test": 0}
    if len(y_test) == 0:
        meta["clients_without_test"] = n_clients
        return [np.zeros(0, dtype=np.int64) for _ in range(n_clients)], meta
    hist = label_histograms(train, y_train, num_classes).astype(float)
    ratio = len(y_test) / len(y_train) if test_ratio is None else test_ratio
    n_test = np.maximum(np.rint(hist.sum(axis=1) * ratio).astype(np.int64), min_test)
    order, starts, counts = _class_pools(y_test, num_classes, rng)
    hist[:, counts == 0] = 0.0
    mass = hist.sum(axis=1)
    n_test[mass == 0] = 0
    pmf = np.divide(hist, mass[:, None], out=np.zeros_like(hist), where=mass[:, None] > 0)
    alloc = _largest_remainder(n_test, pmf)
    demand = alloc.sum(axis=0)
    idx_parts, owner_parts = [], []
    for c in np.flatnonzero(demand):
        pos = np.arange(demand[c]) % counts[c]                 # cyclic walk: reuse only past the pool
        idx_parts.append(order[starts[c] + pos])
        owner_parts.append(np.repeat(np.arange(n_clients), alloc[:, c]))
        if demand[c] > counts[c]:
            meta["test_reused_classes"].append(int(c))
            meta["test_reused_samples"] += int(demand[c] - counts[c])
    meta["test_with_replacement"] = bool(meta["test_reused_classes"])
    meta["clients_without_test"] = int((n_test == 0).sum())
    if not idx_parts:
        return [np.zeros(0, dtype=np.int64) for _ in range(n_clients)], meta
    return _assemble(np.concatenate(idx_parts), np.concatenate(owner_parts), n_clients), meta


def local_holdout(idx: list[np.ndarray], y: np.ndarray, fraction: float, seed: int, min_test: int = 1
                  ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Split each client's own rows into (train, test): the protocol "a random train/test split of
    80%/20%" of Jimenez-Gutierrez et al. 2025, "Clust-PSI-PFL: A Population Stability Index Approach for
    Clustered Non-IID Personalized Federated Learning", arXiv:2512.20363, section IV-A, applied per client
    (`data.local_test = "split"`, `fraction` = `data.local_test_fraction`).

    Client k with n rows, n_c of class c:
        T   = min(max(floor(fraction n + 1/2), min_test), n - 1)     test rows (at least one train row;
                                                                      none for n <= 1)
        T_c = largest-remainder rounding of fraction n_c to a total of T (ties: a seeded order), so the
              test rows follow the client's label mix as closely as integers allow (stratified)
        the T_c test rows of class c: the first T_c of a seeded permutation of the client's class-c rows
    Seeded by (seed, k) alone (`numpy.random.default_rng([seed, 0x7E57, k])`): a client's split does not
    depend on the other clients. Both outputs are sorted index arrays into the same pool as `idx`,
    disjoint, and together they are exactly `idx[k]`."""
    if not 0.0 < float(fraction) < 1.0:
        raise ValueError(f"fraction must be in (0, 1), got {fraction!r}")
    y = np.asarray(y)
    train, test = [], []
    for k, rows in enumerate(idx):
        rows = np.asarray(rows, dtype=np.int64)
        n = len(rows)
        T = min(max(int(math.floor(fraction * n + 0.5)), int(min_test)), max(n - 1, 0))
        rng = np.random.default_rng([int(seed), 0x7E57, k])
        classes, inverse = np.unique(y[rows], return_inverse=True)
        n_c = np.bincount(inverse, minlength=len(classes))
        raw = fraction * n_c
        t_c = np.minimum(np.floor(raw).astype(np.int64), n_c)
        rem = T - int(t_c.sum())                              # >= 0: sum_c floor(fraction n_c) <= T
        tie = rng.permutation(len(classes))                   # seeded tie-break between equal remainders
        frac = raw - t_c
        if rem > 0:                                           # largest remainders first, where rows remain
            order = np.lexsort((tie, -frac))
            for c in order:
                if rem == 0:
                    break
                if t_c[c] < n_c[c]:
                    t_c[c] += 1
                    rem -= 1
            while rem > 0:                                    # min_test above fraction n: fill anywhere
                c = next(c for c in np.lexsort((tie, -(n_c - t_c))) if t_c[c] < n_c[c])
                t_c[c] += 1
                rem -= 1
        held = np.zeros(n, dtype=bool)
        for c in range(len(classes)):
            members = np.flatnonzero(inverse == c)
            held[members[rng.permutation(len(members))[: t_c[c]]]] = True
        train.append(np.sort(rows[~held]))
        test.append(np.sort(rows[held]))
    return train, test


# --------------------------------------------------------------------------------------------------
# Natural clients
# --------------------------------------------------------------------------------------------------


def _group_ids(groups: Any, n: int, name: str) -> np.ndarray:
    g = np.asarray(groups)
    if g.ndim != 1 or len(g) != n:
        raise PartitionError(f"{name} must give one user/device id per sample: {n} ids expected, "
                             f"got shape {g.shape}")
    if g.size and not np.issubdtype(g.dtype, np.integer):
        raise PartitionError(f"{name} must hold integer user/device ids, got dtype {g.dtype}")
    return g.astype(np.int64)


def _natural(y_train: np.ndarray, y_test: np.ndarray, num_clients: int, min_train: int, min_test: int,
             groups: Any, test_groups: Any) -> tuple[list[np.ndarray], list[np.ndarray], dict]:
    """Client i holds every train and test sample of the i-th smallest group id (user or device)."""
    if groups is None or test_groups is None:
        raise PartitionError("partition = 'natural' is not valid for this data: it gives each client the "
                             "samples of one user or device, and the data records none (datasets with "
                             "natural clients: synthetic, wisdm)")
    g_tr = _group_ids(groups, len(y_train), "groups")
    g_te = _group_ids(test_groups, len(y_test), "test_groups")
    users = np.unique(g_tr)
    if num_clients != len(users):
        raise PartitionError(f"clients = {num_clients} is not valid for partition 'natural': the data "
                             f"has {len(users)} users/devices with train samples, one client each, so set "
                             f"clients = {len(users)}")
    train = _assemble(np.arange(len(g_tr)), np.searchsorted(users, g_tr), num_clients)
    _check_min_train(np.array([len(t) for t in train]), min_train, "partition 'natural'")
    known = np.isin(g_te, users)
    test = _assemble(np.flatnonzero(known), np.searchsorted(users, g_te[known]), num_clients)
    n_test = np.array([len(t) for t in test])
    if len(n_test) and n_test.min() < min_test:
        i = int(np.argmin(n_test))
        raise PartitionError(f"partition.min_test = {min_test} is not reachable: user {int(users[i])} "
                             f"(client {i}) has {int(n_test[i])} test samples; use a lower "
                             "partition.min_test")
    meta = {"client_groups": users.tolist(), "test_with_replacement": False, "test_reused_classes": [],
            "test_reused_samples": 0, "clients_without_test": int((n_test == 0).sum()),
            "n_test_unused": int((~known).sum())}
    return train, test, meta


# --------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------


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

    ``params`` are the partition's parameters (``PARTITIONS[name]``); unknown ones are errors.
    ``min_train`` / ``min_test`` are the fewest train / test samples a client may get; ``test_ratio``
    sets test size per train sample (default ``len(y_test)/len(y_train)``). The same arguments and
    seed always give the same partition. Raises :class:`PartitionError` for impossible requests.

    ``natural`` needs ``groups`` / ``test_groups`` (each train / test sample's user or device id, as
    :class:`fedprism.data.datasets.Dataset` records them) and exactly one client per train group;
    client i gets the samples of the i-th smallest id, its test rows are that user's own test samples
    (``meta["client_groups"]`` lists the ids), and ``test_ratio`` does not apply. The other partitions
    ignore ``groups``.
    """
    if name not in PARTITIONS:
        raise PartitionError(f"partition = {name!r} is not valid: one of {', '.join(PARTITIONS)}")
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
    if name == "natural":
        return _make_natural(y_train, y_test, num_clients, seed, min_train, min_test, test_ratio, groups,
                             test_groups)
    if num_clients * min_train > n:
        raise PartitionError(
            f"clients = {num_clients} is not valid: with partition.min_train = {min_train} the {n} train "
            f"samples allow at most {n // min_train} clients"
        )
    if min_test > max(len(y_test), 1):     # each client's test split would repeat the whole test set
        raise _bad("min_test", min_test, f"at most the {len(y_test)} samples of the test set")
    num_classes = int(max(y_train.max(initial=-1), y_test.max(initial=-1))) + 1

    rng_train, rng_test = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2))
    idx, owner, extra = _PARTITIONERS[name](y_train, num_classes, num_clients, min_train, rng_train, resolved)
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


def _make_natural(y_train: np.ndarray, y_test: np.ndarray, num_clients: int, seed: int, min_train: int,
                  min_test: int, test_ratio: float | None, groups: Any, test_groups: Any) -> Partition:
    if test_ratio is not None:
        raise PartitionError(f"test_ratio = {test_ratio!r} is not valid for partition 'natural': each "
                             "client's test rows are its own user's held-out samples; leave test_ratio unset")
    train, test, test_meta = _natural(y_train, y_test, num_clients, min_train, min_test, groups, test_groups)
    n = len(y_train)
    used = int(sum(len(t) for t in train))
    meta = {
        "partition": "natural",
        "params": {},
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
