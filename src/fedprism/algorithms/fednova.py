"""FedNova (Wang, Liu, Liang, Joshi, Poor 2020, "Tackling the Objective Inconsistency Problem in
Heterogeneous Federated Optimization", NeurIPS 2020, arXiv:2007.07481): normalized averaging.

Round t, on the sampled clients S with weights p_i (n_i / sum_{j in S} n_j, the paper's data ratios).
Client i trains tau_i local steps of SGD (learning rate eta, momentum rho) from x and returns y_i. With the
equations numbered here:

    (1)  a_i     = tau_i                                                   plain SGD (rho = 0)
         a_i     = [tau_i - rho (1 - rho^tau_i) / (1 - rho)] / (1 - rho)   SGD with momentum rho
    (2)  d_i     = (x - y_i) / a_i                                         the normalized update
    (3)  tau_eff = sum_{i in S} p_i a_i                                    the effective number of steps
    (4)  x      <- x - tau_eff sum_{i in S} p_i d_i

a_i is ||a_i||_1 of the paper's aggregation vector of client i's local gradients: the sum of the
coefficients with which its steps' gradients enter y_i - x. With momentum the k-th of tau steps moves
by eta (1 - rho^k) / (1 - rho) times a constant gradient, and (1) is their sum (`effective_steps`; the
authors' code, JYWa/FedNova, accumulates the same sum step by step: counter <- rho counter + 1,
a_i <- a_i + counter, with tau_eff = sum_i p_i a_i as in (3)). FedAvg
is (4) with every a_i replaced by the common tau_eff: a client that took more steps than others counts
as much as its data, not as much as its steps, so the average no longer drifts towards the objectives of
the clients that train longest.

How (4) is computed. (4) is sum_i p_i z_i with, for each client, its model rescaled to tau_eff normalized
steps,

    (5)  z_i = x - tau_eff d_i = y_i + s_i (x - y_i),    s_i = (a_i - tau_eff) / a_i = sum_j p_j (a_i - a_j) / a_i

(sum_j p_j = 1). The server forms z_i in float64 and averages them through the shared server step, the
very call FedAvg averages y_i with. When every client took as many steps as the others (a_i all equal),
every a_i - a_j is an exact zero, s_i = 0, z_i = y_i exactly, and the round is FedAvg's bit for bit (with
the same weighting); writing (4) as x - tau_eff sum p_i (x - y_i) / a_i would give it only up to
rounding, since neither (x - y_i) / a * a nor x - sum_i p_i (x - y_i) is exact in floating point.

Decisions where the paper is silent or this protocol differs:

* tau_i is the number of steps the client's engine took (`Trained.steps`: epochs x ceil(n_i / B)), so
  clients with more data take more steps, the heterogeneity FedNova corrects. The client sends y_i (its
  model, as FedAvg's clients do) and tau_i (an int32 scalar); the server computes a_i (1) with the
  experiment's momentum (`ctx.train.momentum`, known on every side) and d_i (2). The paper's clients
  send d_i and a_i: the same P + 1 numbers, and y_i keeps FedAvg's average exact as explained above.
* SGD only: `optimizer=adam` is a ConfigError (Adam rescales every coordinate; no a_i describes it).
  Momentum is torch's SGD momentum (dampening 0, no Nesterov), its buffer fresh at every round, which is
  the recursion (1) assumes.
* Weight decay (`weight_decay`) is not covered by its own a_i: it is treated as part of the local
  gradient, as every method here treats it, and a_i follows from tau_i and rho alone. The proximal
  variant (FedProx's local objective, a_i = [1 - (1 - eta mu)^tau_i] / (eta mu) in the paper) is not
  covered either: the local objective is the experiment's cross-entropy, and FedNova has no mu.
* p_i: `weighting=samples` (default), the paper's n_i / n over the sampled clients; `uniform` gives
  1/|S|. The same p_i weigh tau_eff (3) and the average (4).
* A client with tau_i = 0 (no local step: epochs 0) has a_i = 0 and no d_i: it counts as d_i = 0, its
  z_i is x (it moves nothing), and its a_i = 0 still enters tau_eff.
* The average of (4) goes through the shared server step (`averages = ("w",)`): `fednova.aggregation`
  applies a robust rule to the rescaled models z_i (5) in place of the p-weighted mean, and
  `fednova.server_opt` takes the result of (4) as the average (Delta = -tau_eff sum p_i d_i): `avgm` is
  the paper's FedNova with server momentum, `server_lr` its global learning rate. The defaults (`mean`,
  `none`) are (4).
"""

from __future__ import annotations

import numpy as np
import torch

from fedprism.algorithms.aggregation import WEIGHTINGS, client_weights
from fedprism.algorithms.base import Algorithm, Plan, TensorSpec, TrainJob, Update, register, sgd_settings
from fedprism.hparams import Param


def effective_steps(steps: torch.Tensor, rho: float) -> torch.Tensor:
    """(1): a_i, float64 [n], from the local steps tau_i [n] and the SGD momentum rho in [0, 1): tau_i for
    rho = 0, else [tau_i - rho (1 - rho^tau_i) / (1 - rho)] / (1 - rho), the sum over k = 1..tau_i of
    (1 - rho^k) / (1 - rho)."""
    tau = steps.to(torch.float64)
    if rho == 0:
        return tau
    return (tau - rho * (1.0 - rho ** tau) / (1.0 - rho)) / (1.0 - rho)


def rescaled_models(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """(5): z_i = y_i + s_i (x - y_i), s_i = sum_j p_j (a_i - a_j) / a_i, float64 [n, P], so that
    sum_i p_i z_i = x - tau_eff sum_i p_i (x - y_i) / a_i (4). x: [P] or [n, P] (the model each client
    was sent); a, p: [n] (p summing to 1). Equal a_i give z_i = y_i exactly; a_i = 0 gives z_i = x."""
    a64, p64 = a.to(torch.float64), p.to(torch.float64)
    x64 = x.to(torch.float64).expand_as(y)
    y64 = y.to(torch.float64)
    live = a64 > 0
    s = (p64[None, :] * (a64[:, None] - a64[None, :])).sum(1) / torch.where(live, a64, torch.ones_like(a64))
    z = y64 + s[:, None] * (x64 - y64)
    return torch.where(live[:, None], z, x64)


def tau_eff(a: torch.Tensor, p: torch.Tensor) -> float:
    """(3): sum_i p_i a_i (p summing to 1)."""
    return float((p.to(torch.float64) * a.to(torch.float64)).sum())


@register
class FedNova(Algorithm):
    name = "fednova"
    paper = "Wang, Liu, Liang, Joshi, Poor 2020, arXiv:2007.07481"
    personalized = False
    averages = ("w",)
    params = {
        "weighting": Param("samples", "p_i of tau_eff = sum p_i a_i and of x - tau_eff sum p_i d_i: n_i (samples, the "
                           "paper) or 1/|S| (uniform)", choices=WEIGHTINGS),
    }

    def __init__(self, ctx, **hp):
        super().__init__(ctx, **hp)
        sgd_settings(ctx, self.name, "FedNova normalizes each client's update by a_i, the steps of SGD (with "
                     "momentum) it took; Adam's steps have no such a_i")

    def upload(self) -> dict[str, TensorSpec]:
        return {"params": TensorSpec(("P",)), "steps": TensorSpec((), torch.int32, low=0)}

    def init_state(self) -> dict:
        return {"w": self.ctx.init.clone()}

    def plan(self, state: dict, rnd: int, clients: np.ndarray) -> Plan:
        return Plan(clients, {"params": state["w"].expand(len(clients), -1).clone()})

    def client_update(self, plan: Plan, trainer, rnd: int, cstate: dict) -> Update:
        """FedAvg's local training from x; y_i and tau_i go up."""
        t = trainer.train(TrainJob(plan.clients, plan.start), rnd)
        return Update(t.clients, {"params": t.params, "steps": t.steps.to(torch.int32)}, t.n_samples,
                      {"train_loss": t.loss})

    def aggregate(self, state: dict, rnd: int, update: Update) -> dict:
        """(1)-(5): the rescaled models z_i averaged by the shared server step."""
        w = client_weights(update, self.hp["weighting"])
        p = w / w.sum()
        a = effective_steps(update.payload["steps"], self.ctx.train.momentum)
        sent = update.sent.get("params")
        z = rescaled_models(state["w"] if sent is None else sent, update.params, a, p)
        self.server.update(state, "w", self.server.average(z, w, sent))
        return {}

    def model_for(self, state: dict, clients: np.ndarray) -> torch.Tensor:
        return state["w"].expand(len(clients), -1)
