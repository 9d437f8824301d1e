"""FedSoft (Ruan & Joe-Wong 2022, "FedSoft: Soft Clustered Federated Learning with Proximal Local
Updating", AAAI, arXiv:2112.06053, Algorithm 1).

Each client's data is a mixture of S sources with importance weights u_ks (sum_s u_ks = 1). The server
keeps S cluster models c_s; each client keeps its own personalised model w_k (client state; the cluster
models are never loaded into it). Round t, for the cohort:

    server -> client k:  c_1 .. c_S                                            [S, P]
    client k, every tau rounds (importance estimation, Sec. 4):
        s*(xi) = argmin_s loss(c_s; xi) over its training samples
        n_ks = #{xi : s*(xi) = s};  n_ks <- sigma n_k where n_ks = 0;  u_ks = n_ks / n_k
    client k:  w_k <- E epochs on  h_k(w) = F_k(w) + (lambda/2) sum_s u_ks ||w - c_s||^2   from w_k  (Eq. 4)
    client k -> server:  w_k [P], u_k [S]
    server:    v_sk = u_ks n_k / sum_k' u_k's n_k'   (over the cohort),   c_s = sum_k v_sk w_k     (Eq. 5)

Inference: each client's own w_k (the headline); the cluster models are stored as extra models.

Decisions where the paper is silent or our interface differs from its code (github.com/ycruan/FedSoft):

* The proximal term sum_s u_ks ||w - c_s||^2 has the gradient (sum_s u_ks)(w - cbar_k) with
  cbar_k = sum_s u_ks c_s / sum_s u_ks, so local training is FedProx's objective anchored at cbar_k with
  mu = lambda sum_s u_ks (the same steps; the reported training loss omits a constant).
* Which clients estimate and train. The paper estimates importance on every client every tau rounds and
  samples K clients per cluster with probabilities v_s.; the runner contacts only the round's cohort,
  so here the cohort is the run's `selection` (uniform by default) and a client re-estimates its u_k
  when it is sampled in a round t with t % tau == 0 or when it has never estimated (u_k = 1/S before
  that). The server averages over the cohort with the "without selection" weights of Eq. 5. With S = 1
  this is FedProx anchored at c_1 with mu = lambda, averaged like FedAvg over the cohort (tested).
* Cluster models start from S independent initialisations (the run's initial model with its parameters
  permuted per model, as IFCA's random init); a cluster no cohort member weighs keeps its model.
* The smoother sigma keeps every u_ks > 0 (no renormalisation after smoothing, as the authors' code).

Defaults: S = 2 (`k`), lambda = 0.1 and sigma = 1e-4 (the authors' MNIST values), tau = 2.
`fedsoft.server_opt` (the shared server step, `aggregation.ServerStep`) takes a server optimiser step on each cluster model
from its Eq. 5 average (one optimiser state per cluster; default `none`: Eq. 5 itself).
`fedsoft.aggregation` replaces Eq. 5's weighted mean of cluster s by a robust rule with the same weights
v_s. (`aggregation.average`; default `mean`: Eq. 5 bit for bit). Clients train from their own w_k, which
the server never sees, so `clipped_mean` clips each returned model's distance from c_s, the model it is
averaged into.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from fedprism.algorithms.base import (Algorithm, ClientState, Inference, Plan, TensorSpec, TrainJob, Update,
                                      register)
from fedprism.algorithms.ifca import permuted_inits
from fedprism.hparams import Param

#: samples per forward pass of the importance estimation
CHUNK = 1024


def importance(trainer, client: int, clusters: torch.Tensor, sigma: float) -> torch.Tensor:
    """u_k [S] of one client: the share of its training samples each cluster model fits best (lowest
    per-sample cross-entropy; ties: lower s), zero shares smoothed to sigma."""
    x, y = trainer.data(int(client), "train")
    S, counts = clusters.shape[0], torch.zeros(clusters.shape[0], dtype=torch.float64)
    for s0 in range(0, len(y), CHUNK):
        logits = trainer.logits(clusters, x[s0:s0 + CHUNK])                       # [S, B, C]
        yy = y[s0:s0 + CHUNK].to(logits.device)
        loss = torch.stack([F.cross_entropy(logits[s], yy, reduction="none") for s in range(S)])
        counts += torch.bincount(loss.argmin(0).cpu(), minlength=S).to(torch.float64)
    n = max(len(y), 1)
    return torch.where(counts > 0, counts, torch.full_like(counts, sigma * n)) / n


@register
class FedSoft(Algorithm):
    name = "fedsoft"
    paper = "Ruan & Joe-Wong 2022, FedSoft, AAAI, arXiv:2112.06053"
    params = {
        "k": Param(2, "S: number of cluster models (sources)", lambda v: isinstance(v, int) and v >= 1,
                   "an integer >= 1"),
        "lam": Param(0.1, "lambda: proximal weight of h_k (Eq. 4)", lambda v: v >= 0, "a number >= 0"),
        "sigma": Param(1e-4, "smoother of zero importance shares", lambda v: 0 < v < 1, "a number in (0, 1)"),
        "tau": Param(2, "importance re-estimation period in rounds", lambda v: isinstance(v, int) and v >= 1,
                     "an integer >= 1"),
    }
    #: a server step on each cluster model after Eq. 5; Eq. 5's weighted mean, or a robust rule with the same weights
    averages = ("c",)
    client_state = {"w": ClientState(("P",), init="model")}      # + u [S], sized in __init__

    def __init__(self, ctx, **hp):
        super().__init__(ctx, **hp)
        self.client_state = {"w": ClientState(("P",), init="model"), "u": ClientState((self.hp["k"],), init="zeros")}

    @classmethod
    def headline(cls, config: dict) -> str:
        return "own model w_k"

    def upload(self) -> dict:
        return {"params": TensorSpec(("P",)), "u": TensorSpec((self.hp["k"],))}

    @classmethod
    def server_models(cls, hp: dict, clients: int, cohort: int) -> dict:
        return {"k": hp["k"] * (cohort + 1)}    # the S cluster models, and a copy of them for each of a cohort

    def init_state(self) -> dict:
        return {"c": permuted_inits(self.ctx.init, self.ctx.spec, self.hp["k"], self.ctx.seed)}

    def plan(self, state: dict, rnd: int, clients: np.ndarray) -> Plan:
        return Plan(clients, {"clusters": state["c"].expand(len(clients), -1, -1).clone()})

    def client_update(self, plan: Plan, trainer, rnd: int, cstate: dict) -> Update:
        """Estimate u_k (every tau rounds, or first time), then E epochs of Eq. 4 from w_k."""
        S, hp = plan.clients, self.hp
        c = plan.payload["clusters"]                                               # [n, S, P]
        u = cstate["u"].to(torch.float64).clone()
        for i, k in enumerate(S):
            if rnd % hp["tau"] == 0 or float(u[i].sum()) == 0:
                u[i] = importance(trainer, int(k), c[i], hp["sigma"])
        mass = u.sum(1)                                                            # [n]
        anchor = (torch.einsum("ns,nsp->np", u, c.to(torch.float64)) / mass[:, None]).to(c.dtype)
        job = TrainJob(S, cstate["w"].to(c.dtype).clone(), loss="prox",
                       extras={"anchor": anchor, "mu": (hp["lam"] * mass).to(torch.float32)})
        t = trainer.train(job, rnd)
        return Update(S, {"params": t.params, "u": u.to(torch.float32)}, t.n_samples, {"train_loss": t.loss},
                      client_state={"w": t.params, "u": u.to(torch.float32)})

    def aggregate(self, state: dict, rnd: int, update: Update) -> dict:
        """Eq. 5 over the cohort: c_s = sum_k v_sk w_k, v_sk = u_ks n_k / sum_k' u_k's n_k'."""
        a = update.payload["u"].to(torch.float64) * update.n_samples.to(torch.float64)[:, None]   # [n, S]
        total = a.sum(0)
        x, server = update.params.to(torch.float64), self.server
        for s in range(state["c"].shape[0]):
            if total[s] > 0:
                avg = ((a[:, s] / total[s]) @ x if server.rule == "mean"
                       else server.average(x, a[:, s], state["c"][s].expand(len(x), -1)))
                server.update(state, "c", avg, rows=s)
        return {"fedsoft_importance": {"clients": update.clients.tolist(),
                                       "u": [[round(float(v), 6) for v in row] for row in update.payload["u"]]}}

    # -- evaluation: each client predicts with its own w_k ------------------------------------------
    def eval_payload(self, state: dict, clients: np.ndarray) -> dict:
        return {}

    def inference(self, trainer, clients, payload: dict, cstate: dict) -> Inference:
        return Inference({"personal": cstate["w"]})

    def extra_models(self, state: dict) -> dict:
        return {f"cluster{s}": state["c"][s] for s in range(state["c"].shape[0])}
