"""Client selection: which m_t = max(floor(qN), 1) clients take part in round t (`selection = ...`).

A pluggable step of the round loop (`Experiment.run`, in process and on Flower): every method can use
every rule. The default `uniform` is the seeded uniform draw every committed run used, unchanged. The
other rules read only what the server knows: the clients' reported label counts (`ctx.label_hist`,
differentially private with `privacy.epsilon`), their sizes, the current models' losses (Power-of-
Choice asks the candidates), and a simulated per-client latency (HACCS).

* `uniform`: m_t clients without replacement from a stream seeded by (seed, round) only.
* `poc`, Power-of-Choice (Cho, Wang, Joshi 2020, "Client Selection in Federated Learning: Convergence
  Analysis and Power-of-Choice Selection Strategies", arXiv:2010.01243, Algorithm 1 "pow-d"): a
  candidate set of d clients drawn without replacement with probabilities n_k / n; each candidate
  computes the loss of the model it would be sent (`Algorithm.model_for`) on its training data; the m_t
  candidates with the largest mean loss take part (ties: lower client id). d = `selection.d`, with
  m_t <= d <= N; `selection.d = 0` (default) means d = min(N, 2 m_t). Each round's candidates and
  their losses are stored (`selection` record); the loss queries are not counted in the round's bytes.
* `haccs`, histogram-clustered selection (Wolfrath, Sreekumar, Kumar, Wang, Chandra 2022, "HACCS:
  Heterogeneity-Aware Clustered Client Selection for Accelerated Federated Learning", IPDPS): clients
  are grouped once by their label distributions (K-Means with m_t groups on the normalised label
  counts, seeded; at most N groups); each round every group contributes clients in turn until m_t are
  chosen. Within a group, with probability rho the fastest client not chosen yet this round (lowest
  simulated latency), otherwise a uniformly random one. Latency: a seeded log-normal value per client
  (`exp(N(0, 1))`, the same for the whole run), stored with the run as a `latency` record. Decisions
  where the paper's description leaves freedom: the clustering algorithm (the paper uses density-based
  clustering; we fix the number of groups to m_t so that a round can cover every group) and rho as the
  probability of the latency-greedy pick.
* `fedcls`, label-information group sampling (Li & Wu 2022, "FedCLS: A Federated Learning Client
  Selection Algorithm Based on Cluster Label Information", IEEE VTC2022-Fall): each client's label
  presence vector b_k[c] = 1 if its count of class c is at least tau x its largest class count; the
  first client is drawn uniformly (seeded by round), then each next client maximises the Hamming
  distance between its b_k and the union of the chosen clients' vectors (the classes it adds plus those
  it lacks), ties drawn uniformly. tau = `selection.tau`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

RULES = ("uniform", "poc", "haccs", "fedcls")


def cohort_size(num_clients: int, fraction: float) -> int:
    return max(int(math.floor(fraction * num_clients + 1e-9)), 1)


def sample_clients(seed: int, rnd: int, num_clients: int, fraction: float) -> np.ndarray:
    """m_t = max(floor(qN), 1) clients without replacement from a stream seeded by (seed, round)
    only, so every method sees the same cohorts."""
    m = cohort_size(num_clients, fraction)
    rng = np.random.default_rng([seed, rnd, 0x5A3])
    return np.sort(rng.choice(num_clients, size=m, replace=False))


def _rng(seed: int, rnd: int, tag: int) -> np.random.Generator:
    return np.random.default_rng([seed, rnd, tag])


def poc_candidates(seed: int, rnd: int, n_train: np.ndarray, d: int) -> np.ndarray:
    """d candidates without replacement, probabilities n_k / n (Power-of-Choice step 1), sorted."""
    p = np.asarray(n_train, dtype=np.float64)
    p = p / p.sum() if p.sum() > 0 else np.full(len(p), 1.0 / len(p))
    return np.sort(_rng(seed, rnd, 0x90C).choice(len(p), size=d, replace=False, p=p))


def poc_choose(candidates: np.ndarray, losses: np.ndarray, m: int) -> np.ndarray:
    """The m candidates with the largest loss (NaN counts as the largest; ties: lower client id)."""
    loss = np.where(np.isnan(losses), np.inf, losses)
    order = sorted(range(len(candidates)), key=lambda i: (-loss[i], int(candidates[i])))
    return np.sort(candidates[order[:m]])


def latencies(seed: int, num_clients: int) -> np.ndarray:
    """HACCS: each client's simulated latency, exp(N(0, 1)), seeded by the run seed only."""
    return np.exp(_rng(seed, 0, 0x1A7).standard_normal(num_clients))


def histogram_groups(label_hist: np.ndarray, groups: int, seed: int) -> np.ndarray:
    """HACCS: group id of every client, K-Means (seeded, 10 starts) on the normalised label counts."""
    from sklearn.cluster import KMeans

    h = np.asarray(label_hist, dtype=np.float64)
    x = h / np.maximum(h.sum(1, keepdims=True), 1e-12)
    k = max(1, min(groups, len(np.unique(x, axis=0))))
    if k == 1:
        return np.zeros(len(x), dtype=np.int64)
    return KMeans(n_clusters=k, n_init=10, random_state=seed).fit_predict(x).astype(np.int64)


def haccs_choose(seed: int, rnd: int, groups: np.ndarray, latency: np.ndarray, m: int, rho: float) -> np.ndarray:
    """Round-robin over groups (in a seeded per-round order); in each group the fastest unchosen client
    with probability rho, else a uniformly random unchosen one."""
    rng = _rng(seed, rnd, 0x4AC)
    members = {g: list(np.flatnonzero(groups == g)) for g in np.unique(groups)}
    order = [int(g) for g in rng.permutation(sorted(members))]
    chosen: list[int] = []
    taken: set[int] = set()              # membership in O(1): a group's scan is linear in its size
    while len(chosen) < m:
        for g in order:
            left = [c for c in members[g] if c not in taken]
            if not left or len(chosen) == m:
                continue
            if rng.random() < rho:
                chosen.append(int(min(left, key=lambda c: (latency[c], c))))
            else:
                chosen.append(int(left[rng.integers(len(left))]))
            taken.add(chosen[-1])
    return np.sort(np.asarray(chosen, dtype=np.int64))


def presence(label_hist: np.ndarray, tau: float) -> np.ndarray:
    """FedCLS: b_k[c] = 1 if count_kc >= tau * max_c count_kc (and count_kc > 0)."""
    h = np.asarray(label_hist, dtype=np.float64)
    return ((h >= tau * h.max(1, keepdims=True)) & (h > 0)).astype(np.int8)


def fedcls_choose(seed: int, rnd: int, b: np.ndarray, m: int, first: int | None = None) -> np.ndarray:
    """Greedy Hamming diversity: a uniform first client (or `first`), then argmax |b_k XOR union|
    (ties uniform)."""
    rng = _rng(seed, rnd, 0xC15)
    n = len(b)
    chosen = [int(rng.integers(n)) if first is None else int(first)]
    union = b[chosen[0]].copy()
    free = np.ones(n, dtype=bool)
    free[chosen[0]] = False
    while len(chosen) < m:
        dist = np.where(free, (b != union[None, :]).sum(1), -1)
        best = np.flatnonzero(dist == dist.max())
        k = int(best[rng.integers(len(best))])
        chosen.append(k)
        union |= b[k]
        free[k] = False
    return np.sort(np.asarray(chosen, dtype=np.int64))


@dataclass
class Selector:
    """The run's selection rule with what it keeps for the whole run (HACCS groups and latencies)."""

    rule: str
    seed: int
    num_clients: int
    fraction: float
    n_train: np.ndarray
    label_hist: np.ndarray
    d: int = 0
    rho: float = 0.95
    tau: float = 0.1
    _groups: np.ndarray | None = field(default=None, repr=False)
    _latency: np.ndarray | None = field(default=None, repr=False)

    @property
    def m(self) -> int:
        return cohort_size(self.num_clients, self.fraction)

    def records(self) -> list[tuple]:
        """What the rule fixes for the whole run, stored at round 0."""
        if self.rule == "haccs":
            return [("latency", None, {"latency": [round(float(v), 6) for v in self.latency]}),
                    ("haccs_groups", None, {"groups": [int(g) for g in self.groups]})]
        return []

    @property
    def latency(self) -> np.ndarray:
        if self._latency is None:
            self._latency = latencies(self.seed, self.num_clients)
        return self._latency

    @property
    def groups(self) -> np.ndarray:
        if self._groups is None:
            self._groups = histogram_groups(self.label_hist, self.m, self.seed)
        return self._groups

    def select(self, rnd: int, loss_of=None) -> tuple[np.ndarray, dict]:
        """(cohort of round rnd, a record for the round or {}); `loss_of(candidates)` -> mean losses
        of the models the candidates would get (Power-of-Choice only)."""
        if self.rule == "uniform":
            return sample_clients(self.seed, rnd, self.num_clients, self.fraction), {}
        if self.rule == "poc":
            cand = poc_candidates(self.seed, rnd, self.n_train, self.d)
            losses = np.asarray(loss_of(cand), dtype=np.float64)
            chosen = poc_choose(cand, losses, self.m)
            return chosen, {"candidates": cand.tolist(), "losses": [float(v) for v in losses]}
        if self.rule == "haccs":
            return haccs_choose(self.seed, rnd, self.groups, self.latency, self.m, self.rho), {}
        if self.rule == "fedcls":
            return fedcls_choose(self.seed, rnd, presence(self.label_hist, self.tau), self.m), {}
        raise ValueError(f"selection must be one of {RULES}, got {self.rule!r}")
