"""Fed-PRISM server, as in the Fed-PRISM technical report (sections 1-4).

State: global model w_g, K cluster models w_c, soft-assignment map W [N, K].

Round t (the report's section 2):
    w_pers_i = a w_g + (1 - a) sum_c W[i,c] w_c                           (section 4, sent to i in S_t)
    Delta_i  = w_local_i - w_pers_i                                        (step 2)
    w_g     += 1/|S_t| sum_i Delta_i                                       (step 3a; `global_weighting`)
    w_c     += sum_i W[i,c] Delta_i / sum_i W[i,c]   for clusters with sum_i W[i,c] > 0      (step 3b)
    if t mod C == 0: UpdateClusters(S_t)                                   (step 4, section 3)

UpdateClusters (section 3): features Theta_i = w_local_i (kmeans, ward, average, single) or
Delta_i (covariance); hard clusters; centroids = member means; Sim = cos(feature, centroid);
W[i] = softmax over the top-m similarities, 0 elsewhere.

Decisions where the report is silent (README "Design decisions"):
  * Before the first clustering W is uniform (1/K) and every w_c is a copy of w_g. Rounds count from
    0, so the first clustering happens at the end of round 0 (0 mod C == 0) and personalization
    starts at once.
  * Clients never clustered keep the uniform row; clients not in S_t keep their last row.
  * Fewer reporting clients than K, or fewer distinct features: the re-clustering is skipped and
    recorded (`kind=cluster_skipped`).
  * Cluster identity: new hard clusters are matched to the existing cluster models with the
    Hungarian algorithm on the members' previous weights (cost[j,c] = -sum_{i in j} W_old[i,c]);
    when the members carry no previous assignment (all uniform) the cost is the distance between
    the hard cluster's mean local model and each cluster model (in the clustering feature space).
  * Covariance: affinity (1 + R)/2 of the normalised update correlation R (anti-correlated tasks
    get affinity ~0, the graph stays connected); `fedprism.affinity=clip` uses max(R, 0).

Options for the FedPrism paper's variant of the same server (the FedPrism paper's Algorithm 2), defaults = the report's:
`global_weighting=samples`, `temperature` (softmax of Sim/T), `m=K` (all clusters),
`cluster_lr` (w_c moves by cluster_lr times its soft-weighted mean update), `features=last_layer`.
`server_opt` (the shared server step `aggregation.ServerStep`, default `none`): a server optimiser step towards the value of
step 3a for w_g and of step 3b for each cluster model with sum_i W[i,c] > 0 (one state per model).
"""

from __future__ import annotations

import numpy as np
import torch

from fedprism.algorithms.aggregation import client_weights, personalize, soft_cluster_step
from fedprism.algorithms.base import Algorithm, Plan, Update, register
from fedprism.clustering import TooFewPoints, hard_cluster, soft_assign
from fedprism.clustering.matching import match_clusters, overlap_cost
from fedprism.errors import ConfigError
from fedprism.hparams import Param

CLUSTERINGS = ("kmeans", "ward", "average", "single", "covariance")


def recluster(features: np.ndarray, W_old: np.ndarray, models: np.ndarray, k: int, m: int, method: str,
              seed: int, temperature: float = 1.0, affinity: str = "shifted") -> tuple[np.ndarray, np.ndarray, dict]:
    """The report's section 3 for the reporting clients: hard clusters, Hungarian matching, soft top-m rows.

    `models` [K, d] are the cluster models in the feature space (used to match when the members carry
    no previous assignment). Returns (W_new rows [n, K], hard labels mapped to model indices, info).
    Raises TooFewPoints when there are fewer (distinct) points than K. When the clustering finds fewer
    than K clusters (spectral clustering can), rows use min(m, clusters found) and the unmatched cluster
    models get weight 0 in every row (the caller leaves them bit-identical and records it).
    """
    cl = hard_cluster(features, k, method, seed=seed, affinity=affinity)
    found = cl.centroids.shape[0]          # spectral clustering may find fewer than k clusters
    W_soft = soft_assign(features, cl.centroids, min(m, found), temperature)   # columns = hard clusters
    informative = np.abs(W_old - 1.0 / k).sum() > 1e-9
    if informative:
        cost = overlap_cost(cl.labels, W_old)
        how = "overlap"
    else:
        cost = ((cl.centroids[:, None, :] - models[None, :, :]) ** 2).sum(-1)
        how = "centroid"
    perm = match_clusters(cost)                                            # hard cluster j -> model perm[j]
    W_new = np.zeros((len(features), k))                                   # unmatched models get weight 0
    W_new[:, perm] = W_soft
    return W_new, perm[cl.labels], {"matching": how, **cl.info}


@register
class FedPrism(Algorithm):
    name = "fedprism"
    paper = "the Fed-PRISM technical report (sections 1-4)"
    params = {
        "k": Param(5, "number of cluster models K", lambda v: v >= 1, "an integer >= 1"),
        "m": Param(2, "clusters each client is softly assigned to (1 <= m <= K)", lambda v: v >= 1,
                   "an integer >= 1"),
        "every": Param(10, "re-cluster every C rounds (t mod C == 0)", lambda v: v >= 1, "an integer >= 1"),
        "alpha": Param(0.5, "ensemble coefficient a on the global model", lambda v: 0 <= v <= 1,
                       "a number in [0, 1]"),
        "clustering": Param("kmeans", "hard clustering method", choices=CLUSTERINGS),
        "global_weighting": Param("uniform", "global step: 1/|S_t| (Fed-PRISM report) or n_i/N_t (FedPrism paper)",
                                  choices=("uniform", "samples")),
        "temperature": Param(1.0, "softmax temperature T over the top-m cosine similarities",
                             lambda v: v > 0, "a number > 0"),
        "cluster_lr": Param(1.0, "cluster learning rate (1 = the Fed-PRISM report)", lambda v: 0 < v <= 1,
                            "a number in (0, 1]"),
        "update": Param("delta", "delta: w += mean Delta (Fed-PRISM report); model: average returned models (FedPrism paper)",
                        choices=("delta", "model")),
        "features": Param("full", "clustering features: full vector (Fed-PRISM report) or last layer (FedPrism paper)",
                          choices=("full", "last_layer")),
        "affinity": Param("shifted", "covariance affinity: (1+R)/2 or max(R,0)", choices=("shifted", "clip")),
    }
    averages = ("w_g", "w_c")        # a server step on w_g and on each cluster model that moved (`_server_step`)

    @classmethod
    def clusters(cls, hp: dict) -> int:
        return hp["k"]

    @classmethod
    def clusters_cohort(cls, hp: dict) -> bool:
        return True                  # UpdateClusters runs on S_t

    @classmethod
    def server_models(cls, hp: dict, clients: int, cohort: int) -> dict:
        return {"k": 3 * hp["k"]}    # w_c, and a working copy of each and of its update in `aggregate`

    @classmethod
    def check_params(cls, hp: dict) -> None:
        if hp["m"] > hp["k"]:
            raise ConfigError("fedprism.m", hp["m"], f"an integer in [1, fedprism.k={hp['k']}]")

    # -- state -----------------------------------------------------------------------------------
    def init_state(self) -> dict:
        K, N = self.hp["k"], self.ctx.num_clients
        w_g = self.ctx.init.clone()
        return {
            "w_g": w_g,
            "w_c": w_g.expand(K, -1).clone(),
            "W": torch.full((N, K), 1.0 / K, dtype=torch.float64),
            "clustered": torch.zeros(N, dtype=torch.bool),
        }

    def _feature_slice(self) -> slice:
        return self.ctx.spec.last_layer if self.hp["features"] == "last_layer" else slice(None)

    # -- the four functions --------------------------------------------------------------------------
    def plan(self, state: dict, rnd: int, clients: np.ndarray) -> Plan:
        return Plan(clients, {"params": self.model_for(state, clients)})

    def aggregate(self, state: dict, rnd: int, update: Update) -> dict:
        records: dict = {}
        self._server_step(state, update)
        if self._recluster_due(rnd):
            records.update(self._update_clusters(state, rnd, update))
        return records

    def _server_step(self, state: dict, update: Update) -> None:
        """Global step (3a) and soft-weighted cluster step (3b) with the rows of W used this round.

        The shared server step (`self.server`): the robust rule averages (`fedprism.aggregation`), and the
        value each step gives is the server optimiser's average (`fedprism.server_opt`), for w_g and for
        every cluster model with Z_c > 0 (the others keep model and state)."""
        hp, server = self.hp, self.server
        S = torch.as_tensor(update.clients)
        w = client_weights(update, hp["global_weighting"])
        rb = server.robust
        W_S = state["W"][S]
        if hp["update"] == "delta":                  # the rows are updates already (clipped around 0)
            delta = update.delta
            g = state["w_g"].double() + server.average(delta, w)
            c = soft_cluster_step(state["w_c"], W_S, delta, hp["cluster_lr"], robust=rb)
        else:
            sent = update.sent.get("params")
            g = server.average(update.params, w, sent)
            c = soft_cluster_step(state["w_c"], W_S, update.params, hp["cluster_lr"], toward=True, robust=rb,
                                  sent=sent)
        server.update(state, "w_g", g)
        live = torch.nonzero(W_S.to(torch.float64).sum(0) > 0).flatten().tolist()
        if live:
            server.update(state, "w_c", c[live], rows=live)

    def _recluster_due(self, rnd: int) -> bool:
        """The report's step 4: UpdateClusters when t mod C == 0 (rounds count from 0)."""
        return rnd % self.hp["every"] == 0

    def _cluster_features(self, state: dict, update: Update) -> tuple[np.ndarray, np.ndarray]:
        """(clients, features [n, d]) that UpdateClusters runs on: the reporting clients (the Fed-PRISM report)."""
        sl = self._feature_slice()
        base = update.delta if self.hp["clustering"] == "covariance" else update.params
        return update.clients, base[:, sl].double().cpu().numpy()

    def _update_clusters(self, state: dict, rnd: int, update: Update) -> dict:
        hp = self.hp
        sl = self._feature_slice()
        clients, feats = self._cluster_features(state, update)
        models = state["w_c"][:, sl].double().cpu().numpy()
        if hp["clustering"] == "covariance":
            models = models - state["w_g"][sl].double().cpu().numpy()
        S = torch.as_tensor(clients)
        try:
            W_new, labels, info = recluster(feats, state["W"][S].numpy(), models, hp["k"], hp["m"],
                                            hp["clustering"], seed=self.ctx.seed * 100_003 + rnd,
                                            temperature=hp["temperature"], affinity=hp["affinity"])
        except TooFewPoints as e:
            return {"cluster_skipped": {"reason": str(e), "clients": clients}}
        state["W"][S] = torch.as_tensor(W_new, dtype=torch.float64)
        state["clustered"][S] = True
        records = {"clusters": {"clients": clients, "labels": labels, "W": W_new.round(6), **info}}
        if info["k_found"] < hp["k"]:          # the run goes on; models without a cluster stay as they are
            records["cluster_short"] = {"k": hp["k"], "k_found": info["k_found"], "clients": clients,
                                        "unused_models": sorted(set(range(hp["k"])) - set(labels.tolist()))}
        return records

    def model_for(self, state: dict, clients: np.ndarray) -> torch.Tensor:
        rows = state["W"][torch.as_tensor(clients)]
        return personalize(state["w_g"], state["w_c"], rows, self.hp["alpha"])

    def extra_models(self, state: dict) -> dict[str, torch.Tensor]:
        return {"global": state["w_g"]}
