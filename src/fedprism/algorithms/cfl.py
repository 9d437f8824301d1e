"""CFL, Clustered Federated Learning (Sattler, Mueller, Samek 2020).

Every client belongs to one cluster c with model theta_c (at first one cluster: FedAvg). Round t:

    Delta_i   = LocalTrain(theta_c, D_i) - theta_c               relative to what was sent
    mean_norm = || sum_{i in c, S_t} a_i Delta_i ||               norm of the mean, a_i = n_i / N_c
    max_norm  = max_{i in c, S_t} ||Delta_i||
    if t >= warmup and |c| >= min_size and mean_norm < eps1 and max_norm > eps2:
        (c1, c2)  = argmin max_{i in c1, j in c2} cos(Delta_i, Delta_j)    (optimal bipartition)
        gamma_max = sqrt((1 - max cross cosine) / 2);  split if gamma == 0 or gamma_max > gamma
        both children start from theta_c
    theta_c  += sum_{i in c, S_t} a_i Delta_i     per (new) cluster, a_i renormalised in the cluster;
                                                   a cluster without participants stays bit-identical
    (`cfl.server_opt`, the shared server step `aggregation.ServerStep`: a server optimiser step towards that value instead,
    one state per cluster model, a split's child with fresh state; default `none`)

Splits are tested on every cluster every round, so clustering is recursive (a tree). Defaults:
eps1 = 0.4, eps2 = 1.6, no split before round 20, only clusters with more than 2 clients (the
authors' notebook). eps1/eps2 scale with lr, epochs and model size: every round logs mean_norm and
max_norm per cluster (record `cfl`) so they can be set from data. Decisions: optimal
min-max cut (`bipartition=complete` reproduces the notebook / FL-bench), n_i-weighted mean (`weighting=
uniform` is the notebook's), gamma threshold optional (0.5 reproduces Clust-PSI-PFL).

Partial participation: the trigger uses this round's participants; the
cosine matrix uses every member's most recent Delta (stale for members not sampled this round; the
server keeps N x P floats). Members that never reported a Delta go with the larger child.
The notebook's "keep the cached pre-split model with the best validation accuracy" is not done.
"""

from __future__ import annotations

import numpy as np
import torch

from fedprism.algorithms.aggregation import (WEIGHTINGS, client_weights,
                                             weighted_mean)
from fedprism.algorithms.base import Algorithm, Plan, Update, register
from fedprism.clustering import max_cross_similarity, optimal_bipartition, pairwise_cosine
from fedprism.errors import ConfigError
from fedprism.hparams import Param


def complete_linkage_bipartition(sim: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Two clusters of complete-linkage agglomeration on 1 - sim (the notebook's split)."""
    from scipy.cluster.hierarchy import fcluster, linkage
    from scipy.spatial.distance import squareform

    d = np.clip(1.0 - sim, 0.0, 2.0)
    np.fill_diagonal(d, 0.0)
    lab = fcluster(linkage(squareform(d, checks=False), "complete"), 2, "maxclust")
    first = lab == lab[0]
    return np.flatnonzero(first), np.flatnonzero(~first)


@register
class CFL(Algorithm):
    name = "cfl"
    paper = "Sattler, Mueller, Samek 2020; FedPrism paper 4.4 (6)"
    params = {
        "eps1": Param(0.4, "split only if the norm of the cluster's mean update is below eps1",
                      lambda v: v >= 0, "a number >= 0"),
        "eps2": Param(1.6, "... and the largest client update norm is above eps2", lambda v: v >= 0,
                      "a number >= 0"),
        "gamma": Param(0.0, "split only if gamma_max > gamma (0 = no threshold)", lambda v: 0 <= v < 1,
                       "a number in [0, 1)"),
        "warmup": Param(20, "no split before this round", lambda v: v >= 0, "an integer >= 0"),
        "min_size": Param(3, "only clusters with at least this many clients split", lambda v: v >= 2,
                          "an integer >= 2"),
        "weighting": Param("samples", "update average: n_i (samples) or 1 (uniform, the notebook)",
                           choices=WEIGHTINGS),
        "bipartition": Param("optimal", "optimal min-max cut (paper) or complete linkage (notebook)",
                             choices=("optimal", "complete")),
    }
    averages = ("w",)                # a server step on each cluster model (a split's child starts with fresh state)

    @classmethod
    def server_models(cls, hp: dict, clients: int, cohort: int) -> dict:
        return {"clients": clients}             # every client's last update (`delta`), for the split test

    @classmethod
    def check_cohort(cls, hp: dict, clients: int, cohort: int, fraction: float) -> None:
        if cohort < 2 <= clients and hp["eps1"] <= hp["eps2"]:
            raise ConfigError("fraction", fraction, f"at least {2 / clients:g} for cfl with clients={clients}: "
                              "with one client a round the mean update is that client's update, so the split "
                              "test (mean norm < cfl.eps1 <= cfl.eps2 < max norm) can never pass and CFL stays "
                              "FedAvg")

    def init_state(self) -> dict:
        N = self.ctx.num_clients
        return {"w": self.ctx.init.clone().unsqueeze(0), "assign": torch.zeros(N, dtype=torch.long),
                "delta": torch.zeros(N, self.ctx.init.numel()), "has_delta": torch.zeros(N, dtype=torch.bool)}

    def plan(self, state: dict, rnd: int, clients: np.ndarray) -> Plan:
        return Plan(clients, {"params": self.model_for(state, clients).clone()})

    def aggregate(self, state: dict, rnd: int, update: Update) -> dict:
        hp, S, D = self.hp, torch.as_tensor(update.clients), update.delta
        a = client_weights(update, hp["weighting"])
        state["delta"][S], state["has_delta"][S] = D, True
        norms, splits = {"cluster": [], "mean_norm": [], "max_norm": []}, []
        for c in range(len(state["w"])):
            sel = state["assign"][S] == c
            if not sel.any():
                continue
            mean_norm = float(weighted_mean(D[sel].double(), a[sel]).norm())
            max_norm = float(D[sel].double().norm(dim=1).max())
            for k, v in (("cluster", c), ("mean_norm", mean_norm), ("max_norm", max_norm)):
                norms[k].append(v)
            members = torch.nonzero(state["assign"] == c).flatten()
            known = members[state["has_delta"][members]]
            if (rnd >= hp["warmup"] and len(members) >= hp["min_size"] and len(known) >= 2
                    and mean_norm < hp["eps1"] and max_norm > hp["eps2"]):
                split = self._split(state, c, members, known)
                if split is not None:
                    splits.append({"round": rnd, "mean_norm": mean_norm, "max_norm": max_norm, **split})
        for c in torch.unique(state["assign"][S]).tolist():                      # per-cluster FedAvg of Delta
            sel = state["assign"][S] == c
            self.server.update(state, "w", state["w"][c] + self.server.average(D[sel], a[sel]).to(D.dtype), rows=c)
        records: dict = {"cfl": norms}
        if splits:
            records["cfl_split"] = splits
            records["clusters"] = {"clients": np.arange(self.ctx.num_clients),
                                   "labels": state["assign"].numpy()}
        return records

    def _split(self, state: dict, c: int, members: torch.Tensor, known: torch.Tensor) -> dict | None:
        """Bipartition cluster c by the cosine of its members' last updates; None if gamma refuses."""
        sim = pairwise_cosine(state["delta"][known].double().numpy())
        cut = optimal_bipartition if self.hp["bipartition"] == "optimal" else complete_linkage_bipartition
        i1, i2 = cut(sim)
        gamma_max = float(np.sqrt(max(0.0, 1.0 - max_cross_similarity(sim, i1, i2)) / 2))
        if self.hp["gamma"] > 0 and not gamma_max > self.hp["gamma"]:
            return None
        side2 = known[torch.as_tensor(i2)]
        unknown = members[~state["has_delta"][members]]
        if len(i2) > len(i1):                                                    # the larger child
            side2 = torch.cat([side2, unknown])
        new = len(state["w"])
        state["w"] = torch.cat([state["w"], state["w"][c : c + 1].clone()])      # both start from theta_c
        state["assign"][side2] = new
        return {"parent": c, "child": new, "gamma_max": gamma_max,
                "left": known[torch.as_tensor(i1)].numpy(), "right": side2.numpy()}

    def model_for(self, state: dict, clients: np.ndarray) -> torch.Tensor:
        return state["w"][state["assign"][torch.as_tensor(clients)]]
