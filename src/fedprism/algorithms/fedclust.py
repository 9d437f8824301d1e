"""FedClust: hard clusters of uploaded models, n_k-weighted FedAvg inside each cluster.

variant=periodic (default; the Fed-PRISM technical report "2nd algorithm", and the FedPrism paper's baseline):
    every C rounds cluster the uploaded models of S_t (K-Means or agglomerative; full vector with
    Euclidean distance as the report writes, or last layer with cosine as the FedPrism paper's baseline),
    match the new labels to the existing cluster models (Hungarian), then
    w_c = sum_{k in C_c} n_k / N_c w_k                                   (the report's Step 3)
    and each client receives its cluster's model (Step 4). Clients never clustered receive the
    global model w_g = n_k-weighted mean of all uploads; a client that reports between two
    clusterings without an assignment joins the cluster whose model is nearest to its upload.
variant=original (Islam et al. 2024):
    round 0 is a one-shot setup: all N clients train from theta_0, upload their final-layer
    weights p_k; agglomerative clustering (average linkage, Euclidean) with a distance threshold
    (`threshold`, 0 = the largest gap in the merge distances) fixes the clusters for the whole run.
    All clients take part in the setup, so there are no newcomers in simulation; on Flower a
    newcomer joins the cluster with the smallest average-linkage distance to its p_j.
`fedclust.server_opt` (the shared server step, `aggregation.ServerStep`): a server optimiser step on every cluster model that
has members in the round and on w_g, one state per model; default `none`: the averages themselves.
"""

from __future__ import annotations

import numpy as np
import torch

from fedprism.algorithms.base import Algorithm, Plan, Update, register
from fedprism.clustering import TooFewPoints, hard_cluster
from fedprism.clustering.matching import match_clusters
from fedprism.hparams import Param


def threshold_clusters(p: np.ndarray, threshold: float = 0.0) -> tuple[np.ndarray, float, np.ndarray]:
    """Average-linkage clustering of the rows of p cut at `threshold` (0: the largest merge gap)."""
    from scipy.cluster.hierarchy import fcluster, linkage

    if len(p) < 2:
        return np.zeros(len(p), dtype=np.int64), threshold, np.zeros(0)
    Z = linkage(p, method="average", metric="euclidean")
    heights = Z[:, 2]
    if threshold <= 0:
        gaps = np.diff(np.concatenate([[0.0], heights]))
        j = int(np.argmax(gaps))
        threshold = float(heights[j] - gaps[j] / 2) if j > 0 else float(heights[0] / 2)
    labels = fcluster(Z, t=threshold, criterion="distance") - 1
    return labels.astype(np.int64), threshold, heights


@register
class FedClust(Algorithm):
    name = "fedclust"
    paper = "the Fed-PRISM technical report (2nd algorithm); Islam et al. 2024 (variant=original)"
    params = {
        "variant": Param("periodic", "periodic (the Fed-PRISM report / FedPrism baseline) or original (Islam et al.)",
                         choices=("periodic", "original")),
        "k": Param(5, "number of clusters (periodic variant)", lambda v: v >= 1, "an integer >= 1"),
        "every": Param(1, "re-cluster every C rounds (periodic variant)", lambda v: v >= 1, "an integer >= 1"),
        "clustering": Param("kmeans", "kmeans, ward, average or single", choices=("kmeans", "ward", "average", "single")),
        "features": Param("full", "full vector (the Fed-PRISM report) or last layer (FedPrism baseline, original)",
                          choices=("full", "last_layer")),
        "metric": Param("euclidean", "euclidean (the Fed-PRISM report) or cosine (rows L2-normalised first)",
                        choices=("euclidean", "cosine")),
        "threshold": Param(0.0, "original variant: distance threshold (0 = largest merge gap)",
                           lambda v: v >= 0, "a number >= 0"),
    }
    averages = ("w_c", "w_g")        # a server step on every cluster model and on w_g

    @classmethod
    def clusters(cls, hp: dict) -> int | None:
        return hp["k"] if hp["variant"] == "periodic" else None    # original: a threshold finds them

    @classmethod
    def clusters_cohort(cls, hp: dict) -> bool:
        return hp["variant"] == "periodic"

    @classmethod
    def server_models(cls, hp: dict, clients: int, cohort: int) -> dict:
        return {"k": 3 * hp["k"]} if hp["variant"] == "periodic" else {}

    def init_state(self) -> dict:
        w = self.ctx.init.clone()
        k = self.hp["k"] if self.hp["variant"] == "periodic" else 1
        return {"w_g": w, "w_c": w.expand(k, -1).clone(),
                "assign": torch.full((self.ctx.num_clients,), -1, dtype=torch.long)}

    def plan(self, state: dict, rnd: int, clients: np.ndarray) -> Plan:
        if self.hp["variant"] == "original" and rnd == 0:
            clients = np.arange(self.ctx.num_clients)        # one-shot setup: everybody from theta_0
        return Plan(clients, {"params": self.model_for(state, clients).clone()})

    def _features(self, params: torch.Tensor) -> np.ndarray:
        sl = self.ctx.spec.last_layer if self.hp["features"] == "last_layer" else slice(None)
        f = params[:, sl].double().cpu().numpy()
        if self.hp["metric"] == "cosine":
            f = f / np.maximum(np.linalg.norm(f, axis=1, keepdims=True), 1e-12)
        return f

    def aggregate(self, state: dict, rnd: int, update: Update) -> dict:
        S = torch.as_tensor(update.clients)
        records: dict = {}
        if self.hp["variant"] == "original" and rnd == 0:
            labels, thr, heights = threshold_clusters(self._features(update.params), self.hp["threshold"])
            state["assign"][S] = torch.as_tensor(labels)
            state["w_c"] = self.ctx.init.expand(int(labels.max()) + 1, -1).clone()
            records["clusters"] = {"clients": update.clients, "labels": labels, "threshold": thr,
                                   "merge_heights": heights}
        elif self.hp["variant"] == "periodic" and rnd % self.hp["every"] == 0:
            feats = self._features(update.params)
            try:
                cl = hard_cluster(feats, self.hp["k"], self.hp["clustering"], seed=self.ctx.seed * 100_003 + rnd)
            except TooFewPoints as e:
                records["cluster_skipped"] = {"reason": str(e), "clients": update.clients}
            else:
                prev = state["assign"][S].numpy()
                K = self.hp["k"]
                if (prev >= 0).any():       # members' previous clusters: keep identities (overlap)
                    cost = np.zeros((K, K))
                    for j in range(K):
                        for c in prev[(cl.labels == j) & (prev >= 0)]:
                            cost[j, c] -= 1.0
                else:                       # no history: nearest cluster model in feature space
                    cost = ((cl.centroids[:, None] - self._features(state["w_c"])[None]) ** 2).sum(-1)
                perm = match_clusters(cost)
                state["assign"][S] = torch.as_tensor(perm[cl.labels])
                records["clusters"] = {"clients": update.clients, "labels": perm[cl.labels]}
        new = (state["assign"][S] < 0).numpy()
        if new.any() and (state["assign"] >= 0).any():    # newcomers between clusterings: nearest model
            k = len(state["w_c"])
            d = ((self._features(update.params[torch.as_tensor(new)])[:, None]
                  - self._features(state["w_c"])[None]) ** 2).sum(-1)
            live = np.isin(np.arange(k), state["assign"][state["assign"] >= 0].numpy())
            d[:, ~live] = np.inf
            state["assign"][S[torch.as_tensor(new)]] = torch.as_tensor(d.argmin(1))
            records["joined"] = {"clients": update.clients[new], "labels": d.argmin(1)}
        a = state["assign"][S]
        x, n, server, sent = update.params, update.n_samples, self.server, update.sent.get("params")
        for c in torch.unique(a[a >= 0]).tolist():
            sel = a == c
            server.update(state, "w_c", server.average(x[sel], n[sel], None if sent is None else sent[sel]), rows=c)
        server.update(state, "w_g", server.average(x, n, sent))
        return records

    def model_for(self, state: dict, clients: np.ndarray) -> torch.Tensor:
        a = state["assign"][torch.as_tensor(clients)]
        out = state["w_g"].expand(len(clients), -1).clone()
        has = a >= 0
        out[has] = state["w_c"][a[has]]
        return out
