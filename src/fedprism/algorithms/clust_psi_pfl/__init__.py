"""Clust-PSI-PFL (Jimenez-Gutierrez, Hassanzadeh, Solans, Elbamby, Kourtellis, Anagnostopoulos,
Chatzigiannakis, Vitaletti 2025, "Clust-PSI-PFL: A Population Stability Index Approach for Clustered
Non-IID Personalized Federated Learning", arXiv:2512.20363), section III and its "PSI-based algorithm
for selecting the number of clusters".

Before training (once), from the label counts n_ic every client reports:

    P(c)   = sum_i n_ic / sum_i n_i,   P_i(c) = n_ic / n_i
    PSI_i  = sum_c (P(c) - P_i(c)) ln(P(c) / P_i(c))               (Eq. 1, the Jeffreys divergence)
    PSI_ic = (P(c) - P_i(c)) ln(P(c) / P_i(c))                     (Eq. 2)
    WPSI^L = sum_i (n_i / N) PSI_i                                 (Eq. 3; recorded with the run)
    x_i    = [PSI_i, PSI_i1, .., PSI_iC], X z-scored per column
    for j = 2 .. K-1: z^(j) = KMeans++(X, j); s(j) = silhouette(X, z^(j))
    tau    = the smallest j with the largest s(j)                  (strict '>' in the loop)

then one FedAvg model per cluster, trained independently; each client is trained and evaluated with
its cluster's model. The PSI arithmetic is `fedprism.data.heterogeneity.psi` / `wpsi`, the tau search
`fedprism.clustering.choose_k_silhouette`, the averaging `aggregation.average` (robust rules:
`clust_psi_pfl.aggregation`) followed by `aggregation.server_step` (`clust_psi_pfl.server_opt`, one
optimiser state per cluster model).

Decisions where the paper is silent (docs/clust_psi_pfl.md):

* Label counts: `ctx.label_hist`, i.e. the clients' differentially private releases when
  `privacy.epsilon` > 0 (never the raw data). They travel once, before round 0: `setup_bytes` declares
  that message (C counts of 8 bytes per client, N clients) and the runner adds it to round 0's
  `bytes_up`. The clustering itself runs in `init_state`.
* Zero probabilities: `eps` (default 1e-6) added to both pmfs without renormalising, as the authors'
  code; `smoothing=laplace` adds `eps` to every count and renormalises. Classes no client holds are
  left out. Columns of X with zero variance standardise to 0 (population std, ddof 0).
* K-Means: k-means++ with `n_init=10` and `random_state` = the run seed (sklearn's default n_init
  changed with its version). A j for which the features have fewer than j distinct rows, or for which
  K-Means returns fewer than j non-empty clusters (identical rows), is skipped. `max_clusters` caps the
  search (0: K-1 as in the paper); `clusters` > 0 fixes tau (the authors' `--tau-clusters`).
* No feasible j (K <= 2, or every client has the same label pmf): one cluster (FedAvg), recorded.
  `allow_single_cluster=true` reproduces the authors' code instead: j = 1 competes with score 0.
* Sampling (`sampling=global`, default): the paper's protocol (section IV-A, "at each round, a
  fraction q=0.5 of the K clients is sampled uniformly without replacement"; section III: "training
  proceeds as in FedAvg, except that aggregation is performed independently for each of the tau
  clusters"), i.e. the runner's cohort, the same one every method of a comparison sees. A cluster then
  gets about q of its members on average, none in some rounds. `sampling=per_cluster` runs each cluster
  as its own FedAvg federation instead: every round cluster c samples max(floor(q |c|), 1) of its
  members, uniformly without replacement, from a stream seeded by (run seed, round, c), and the union
  (about qN clients) replaces the runner's cohort; every cluster trains every round.
  `min_per_cluster=2` (with `per_cluster`) is the authors' reference code: one federation per cluster
  with fraction q and at least two fit clients, i.e. min(|c|, max(floor(q |c|), 2)) members. Their code
  replicates a cluster of one client so that two fit; here that member trains once and its model is
  the cluster's (two copies trained with one seed from one model average to that model). Default 1:
  the rule above, and the committed run ids.
* A client whose counts were not known at clustering (a Flower node that joins later; no client in a
  simulation) joins the cluster of the nearest centroid in the standardised space, with the column
  means and deviations of the initial clients; it is fixed when it is first sampled (record `joined`).
  A client that has reported no counts at all is placed as if it held the global pmf.
* Aggregation inside a cluster: n_k-weighted (`weighting=samples`, FedAvg's) or uniform; a cluster with
  no participant this round keeps its model bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedprism.algorithms.aggregation import WEIGHTINGS, client_weights
from fedprism.algorithms.base import Algorithm, Plan, Update, register
from fedprism.clustering import TooFewPoints, choose_k_silhouette, hard_cluster
from fedprism.data.heterogeneity import PSI_EPS, psi, wpsi
from fedprism.hparams import Param

#: bytes of one reported label count (int64, or float64 for a DP release)
COUNT_BYTES = 8


def psi_features(hist: np.ndarray, eps: float = PSI_EPS, smoothing: str = "additive",
                 global_hist: np.ndarray | None = None) -> np.ndarray:
    """x_i = [PSI_i, PSI_i1 .. PSI_iC] (Eqs. 1-2) of every row of `hist` [n, C] (label counts) against the
    global pmf of `global_hist` (default: the pooled rows). A row without counts is given the global pmf."""
    h = np.clip(np.asarray(hist, dtype=np.float64), 0.0, None)
    g = h.sum(0) if global_hist is None else np.asarray(global_hist, dtype=np.float64)
    empty = h.sum(1) <= 0
    if empty.any():
        h = h.copy()
        h[empty] = g
    total, terms = psi(h, g, eps=eps, smoothing=smoothing)
    return np.concatenate([total[:, None], terms], axis=1)


def zscore(x: np.ndarray, mean: np.ndarray | None = None, std: np.ndarray | None = None
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Column-wise (x - mean) / std (population std); constant columns give 0. Returns (z, mean, std).

    A column is constant when its largest and smallest values are equal: its std is then set to 0 exactly
    (numpy's mean of equal values can carry a rounding residue, e.g. the mean of 0.1 three times, which
    would leave a std of about 1e-17 and blow the column's residues up to +-1)."""
    mean = x.mean(0) if mean is None else mean
    std = np.where(x.max(0) == x.min(0), 0.0, x.std(0)) if std is None else std
    safe = np.where(std > 0, std, 1.0)
    return np.where(std > 0, (x - mean) / safe, 0.0), mean, std


def per_cluster_count(fraction: float, size: int, least: int = 1) -> int:
    """Members a cluster of `size` clients trains in a round with `sampling=per_cluster`:
    min(size, max(floor(q size), least)). `least` = 1 keeps every cluster training; `least` = 2 is the
    authors' code (each cluster a federation with fraction q and at least two fit clients), under which a
    cluster of one or two clients trains whole every round."""
    if size <= 0:
        return 0
    return min(size, max(int(np.floor(fraction * size + 1e-9)), least, 1))


@dataclass
class PsiClustering:
    """The result of the clustering phase (what `init_state` keeps and records)."""

    labels: np.ndarray          # [n] cluster of each clustered client, 0..tau-1
    tau: int
    scores: dict[int, float]    # silhouette s(j) of every feasible j
    centroids: np.ndarray       # [tau, C+1] in the standardised space
    mean: np.ndarray            # [C+1] column means of the initial clients' features
    std: np.ndarray             # [C+1] their population standard deviations
    wpsi: float
    reason: str = ""            # why one cluster, when it is one


def psi_clusters(hist: np.ndarray, eps: float = PSI_EPS, smoothing: str = "additive", seed: int = 0,
                 clusters: int = 0, max_clusters: int = 0, allow_single_cluster: bool = False) -> PsiClustering:
    """The paper's tau selection on label counts `hist` [K, C]: PSI features, z-score, K-Means++ for
    j = 2..K-1 (or up to `max_clusters`), the smallest j at the largest silhouette."""
    h = np.clip(np.asarray(hist, dtype=np.float64), 0.0, None)
    x = psi_features(h, eps, smoothing)
    z, mean, std = zscore(x)
    K = len(z)
    w = wpsi(h, eps=eps, smoothing=smoothing) if h.sum() > 0 else 0.0
    scores: dict[int, float] = {}
    reason = ""
    if clusters > 0:
        tau = clusters
    else:
        top = K - 1 if max_clusters <= 0 else min(max_clusters, K - 1)
        try:
            tau, scores = choose_k_silhouette(z, range(2, top + 1), "kmeans", seed, allow_single_cluster)
        except TooFewPoints as e:
            tau, reason = 1, f"no feasible number of clusters in 2..{top}: {e}"
    try:
        cl = hard_cluster(z, tau, "kmeans", seed=seed)
    except TooFewPoints as e:
        if clusters <= 0:
            raise
        tau, reason = 1, f"clusters={clusters} is infeasible ({e}): one cluster"
        cl = hard_cluster(z, 1, "kmeans", seed=seed)
    if tau == 1 and not reason:
        reason = "no silhouette above 0 (allow_single_cluster)"
    return PsiClustering(cl.labels.astype(np.int64), int(tau), scores, cl.centroids, mean, std, w, reason)


@register
class ClustPsiPfl(Algorithm):
    name = "clust_psi_pfl"
    paper = "Jimenez-Gutierrez et al. 2025, arXiv:2512.20363"
    params = {
        "eps": Param(PSI_EPS, "zero-probability guard of PSI: added to both pmfs (additive) or to every count "
                     "(laplace)", lambda v: v >= 0, "a number >= 0"),
        "smoothing": Param("additive", "additive (the authors' code: eps added to P_i(c) and P(c)) or laplace "
                           "(eps added to the counts, renormalised)", choices=("additive", "laplace")),
        "clusters": Param(0, "fixed number of clusters tau (0: chosen by the silhouette search)",
                          lambda v: v >= 0, "an integer >= 0"),
        "max_clusters": Param(0, "largest tau the silhouette search tries (0: K-1, the paper)",
                              lambda v: v >= 0, "an integer >= 0"),
        "allow_single_cluster": Param(False, "the authors' code: tau = 1 competes with silhouette 0"),
        "sampling": Param("global", "global: the runner's cohort, q of all clients (the paper); per_cluster: "
                          "each cluster samples max(floor(q |c|), min_per_cluster) of its members per round",
                          choices=("global", "per_cluster")),
        "weighting": Param("samples", "per-cluster average: n_k (samples, FedAvg) or 1 (uniform)",
                           choices=WEIGHTINGS),
        "min_per_cluster": Param(1, "with sampling=per_cluster: the fewest members a cluster trains per round, "
                                 "min(|c|, max(floor(q |c|), this)); 2 is the authors' code (every cluster of "
                                 "at most two clients trains whole)", lambda v: v >= 1, "an integer >= 1",
                                 new=True),
    }
    averages = ("w",)                # the tau cluster models

    @classmethod
    def check_params(cls, hp: dict) -> None:
        from fedprism.errors import ConfigError

        if hp["smoothing"] == "laplace" and hp["eps"] <= 0:
            raise ConfigError("clust_psi_pfl.eps", hp["eps"], "a pseudo-count > 0 with smoothing=laplace")
        if hp["min_per_cluster"] != 1 and hp["sampling"] != "per_cluster":
            raise ConfigError("clust_psi_pfl.min_per_cluster", hp["min_per_cluster"],
                              "1 unless clust_psi_pfl.sampling=per_cluster (the global cohort is the runner's)")

    # -- clustering (once, before round 0) -------------------------------------------------------
    def _hist(self) -> np.ndarray:
        return np.clip(np.asarray(self.ctx.label_hist, dtype=np.float64), 0.0, None)

    def init_state(self) -> dict:
        hp, h = self.hp, self._hist()
        known = h.sum(1) > 0
        cl = psi_clusters(h[known], hp["eps"], hp["smoothing"], self.ctx.seed, hp["clusters"],
                          hp["max_clusters"], hp["allow_single_cluster"])
        assign = torch.full((self.ctx.num_clients,), -1, dtype=torch.long)
        assign[torch.as_tensor(np.flatnonzero(known))] = torch.as_tensor(cl.labels)
        P = self.ctx.init.numel()
        return {"w": self.ctx.init.expand(cl.tau, -1).clone(), "assign": assign,
                "global_hist": torch.as_tensor(h[known].sum(0)),
                "scaler": torch.as_tensor(np.stack([cl.mean, cl.std])), "centroids": torch.as_tensor(cl.centroids),
                "psi": {"wpsi": cl.wpsi, "tau": cl.tau, "silhouette": {str(k): v for k, v in cl.scores.items()},
                        "eps": hp["eps"], "smoothing": hp["smoothing"], "clustered": int(known.sum()),
                        "reason": cl.reason}}

    def setup_bytes(self) -> tuple[int, int]:
        """The one-off message before round 0: every client uploads its C label counts."""
        return 0, self.ctx.num_clients * self.ctx.num_classes * COUNT_BYTES

    def _nearest(self, state: dict, clients: np.ndarray) -> np.ndarray:
        """Nearest centroid in the standardised space, with the initial clients' scaler (late clients)."""
        x = psi_features(self._hist()[clients], self.hp["eps"], self.hp["smoothing"],
                         state["global_hist"].numpy())
        mean, std = state["scaler"].numpy()
        z, _, _ = zscore(x, mean, std)
        d = ((z[:, None, :] - state["centroids"].numpy()[None]) ** 2).sum(-1)
        return d.argmin(1).astype(np.int64)

    def clusters_of(self, state: dict, clients: np.ndarray) -> np.ndarray:
        """Each client's cluster: its assignment, or the nearest centroid for a client not yet assigned."""
        clients = np.asarray(clients, dtype=np.int64)
        a = state["assign"][torch.as_tensor(clients)].numpy().copy()
        late = a < 0
        if late.any():
            a[late] = self._nearest(state, clients[late])
        return a

    # -- the round -------------------------------------------------------------------------------
    @property
    def own_cohort(self) -> bool:
        return self.hp["sampling"] == "per_cluster"

    def plan(self, state: dict, rnd: int, clients: np.ndarray) -> Plan:
        if self.hp["sampling"] == "per_cluster":
            a = self.clusters_of(state, np.arange(self.ctx.num_clients))
            picked = []
            for c in range(len(state["w"])):
                members = np.flatnonzero(a == c)
                if len(members) == 0:
                    continue
                m = per_cluster_count(self.ctx.fraction, len(members), self.hp["min_per_cluster"])
                rng = np.random.default_rng([self.ctx.seed, rnd, c, 0xC751])
                picked.append(rng.choice(members, size=m, replace=False))
            clients = np.sort(np.concatenate(picked)) if picked else np.asarray(clients)[:0]
        a = self.clusters_of(state, clients)
        return Plan(clients, {"params": state["w"][torch.as_tensor(a)].clone()})

    def setup_records(self, state: dict) -> dict:
        """The clustering made before round 0 (`init_state`): its PSI summary and every client's cluster."""
        return {"psi": dict(state["psi"]),
                "clusters": {"clients": np.arange(self.ctx.num_clients), "labels": state["assign"].numpy().copy()}}

    def aggregate(self, state: dict, rnd: int, update: Update) -> dict:
        records: dict = {}
        S = torch.as_tensor(update.clients)
        late = state["assign"][S] < 0
        if late.any():
            j = self.clusters_of(state, update.clients[late.numpy()])
            state["assign"][S[late]] = torch.as_tensor(j)
            records["joined"] = {"clients": update.clients[late.numpy()], "labels": j}
        a = state["assign"][S]
        x, w, server = update.params, client_weights(update, self.hp["weighting"]), self.server
        sent = update.sent.get("params")
        for c in torch.unique(a).tolist():
            sel = a == c
            server.update(state, "w", server.average(x[sel], w[sel], None if sent is None else sent[sel]), rows=c)
        return records

    def model_for(self, state: dict, clients: np.ndarray) -> torch.Tensor:
        return state["w"][torch.as_tensor(self.clusters_of(state, clients))]
