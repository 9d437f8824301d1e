"""q-FFL by q-FedAvg (Li, Sanjabi, Beirami, Smith 2020, "Fair Resource Allocation in Federated Learning",
ICLR 2020, arXiv:1905.10497), its q-FedAvg algorithm.

q-FFL minimises f_q(w) = sum_k p_k F_k^{q+1}(w) / (q + 1): q > 0 weighs the clients with a larger loss
more, so the accuracy is spread more evenly over the clients; q = 0 is FedAvg's objective. q-FedAvg, round
t, on the sampled clients S, with the equations numbered here:

    (1)  F_k       = F_k(w^t)                           client k's loss at the received model
    (2)  wbar_k    = E epochs of local SGD from w^t     (learning rate eta)
    (3)  Delta w_k = L (w^t - wbar_k),   L = 1 / eta    the paper's Lipschitz estimate
    (4)  Delta_k   = F_k^q Delta w_k
    (5)  h_k       = q F_k^{q-1} ||Delta w_k||^2 + L F_k^q
    (6)  w^{t+1}   = w^t - sum_{k in S} Delta_k / sum_{k in S} h_k

How (6) is computed. With A = L sum_k F_k^q, B = sum_k q F_k^{q-1} ||Delta w_k||^2 (so sum_k h_k = A + B)
and m = sum_k F_k^q wbar_k / sum_k F_k^q, the F^q-weighted mean of the returned models, (6) is

    (7)  w^{t+1} = m + (B / (A + B)) (w^t - m)

the F^q-weighted average of the local models, pulled back towards w^t by the share of the curvature
estimate that the update norms make up. The server computes m through the shared server step (the call
FedAvg averages with) and (7) in float64. At q = 0 the weights F_k^0 are exact ones, B is taken as 0 (its
terms are 0 x F_k^{-1}), and (7) is m + 0 (w^t - m) = m: FedAvg's uniform mean (`fedavg.weighting=uniform`,
the paper's sampling by p_k followed by a uniform average) bit for bit, which the tests check through the
runner. Written as (6) it would be FedAvg's only up to rounding (w - sum (w - wbar_k) / |S| is not the mean
of the wbar_k in floating point).

Decisions where the paper is silent or this protocol differs:

* F_k (1) is the mean cross-entropy of the received model w^t over all the client's training samples,
  evaluated before the local training as the engine evaluates (`trainer.evaluate(..., "train")`: the
  model without dropout noise, at the evaluation precision), not the running loss of the first epoch,
  as the authors' code does (litian96/fair_flearn, flearn/trainers/qffedavg.py: `c.get_loss()`, "the whole
  training data, with respect to the starting point"). A client without training samples has F_k = 0.
* F_k + 1e-10 is used for F_k in (4)-(7), so that F_k^{q-1} stays finite when a client's loss is 0 and
  q < 1 (an offset far below any loss the runs see; the authors' code adds the same 1e-10).
* The client sends wbar_k and F_k (P + 1 numbers, float32 like every row); the server forms Delta w_k,
  Delta_k and h_k (3)-(5). The paper's clients send Delta_k and h_k: as many numbers; wbar_k keeps
  FedAvg's average exact at q = 0 and lets the shared robust rules compare models.
* L = 1 / eta with eta the experiment's client learning rate (`ctx.train.lr`), as in the paper, whatever
  the momentum (the paper's local solver is plain SGD; with momentum rho, Delta w_k is about 1 / (1 - rho)
  times larger and the pull-back B / (A + B) is stronger). `optimizer=adam` is a ConfigError: Adam's
  steps are not eta times a gradient, so (3) estimates nothing. Weight decay is part of the local
  gradient, as for every method.
* Sampling: the runner's cohort (uniform without replacement), the same as every method of a comparison
  sees; the paper samples with probabilities p_k (n_k / n) and then averages uniformly. So, as in the
  paper, the sample sizes n_k do not weigh (6) (no `weighting` parameter).
* m goes through the shared server step (`averages = ("w",)`): `qffl.aggregation` replaces the
  F^q-weighted mean by a robust rule with the same weights (B still sums every accepted client), and
  `qffl.server_opt` takes (7) as the average. The defaults (`mean`, `none`) are (6).
* Default q = 1; the paper tunes q per data set (q = 0 is FedAvg; the authors' code's README runs its
  Vehicle demo with q = 5). Under this protocol's SGD with
  momentum 0.9, L = 1 / eta makes ||Delta w_k||^2 large against L F_k^q, and the pull-back of (7) slows
  training at any q > 0: set `qffl.q` (and the momentum) for the data set at hand.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from fedprism.algorithms.base import Algorithm, Plan, TensorSpec, TrainJob, Update, register, sgd_settings
from fedprism.hparams import Param

#: added to every F_k before the powers F_k^q, F_k^{q-1} (keeps them finite at F_k = 0)
LOSS_OFFSET = 1e-10


def local_losses(trainer, params: torch.Tensor, clients: np.ndarray) -> torch.Tensor:
    """(1): F_k, float64 [n], the mean cross-entropy of row k of `params` on client k's training samples (0
    for a client without any)."""
    r = trainer.evaluate(params, clients, "train")
    return r.loss_sum.to(torch.float64) / r.count.clamp(min=1).to(torch.float64)


def qffl_step(w: torch.Tensor, y: torch.Tensor, sent: torch.Tensor, losses: torch.Tensor, q: float, lr: float,
              average) -> torch.Tensor:
    """(3)-(7): w^{t+1}, float64 [P], from the current model w [P], the returned models y [n, P], the rows
    the clients were sent `sent` [n, P], their losses F_k [n] and q, eta; `average(y, weights, sent)` is the
    server step's averaging (float64 [P]), given F_k^q. q = 0: the uniform average itself."""
    F = losses.to(torch.float64) + LOSS_OFFSET
    Fq = F ** q
    m = average(y, Fq, sent)
    if q == 0:
        return m
    L = 1.0 / lr
    d = sent.to(torch.float64) - y.to(torch.float64)
    norms = (L * L) * (d * d).sum(1)                                   # ||Delta w_k||^2
    A = L * Fq.sum()
    B = (q * F ** (q - 1.0) * norms).sum()
    return m + (B / (A + B)) * (w.to(torch.float64) - m)


@register
class QFFL(Algorithm):
    name = "qffl"
    paper = "Li, Sanjabi, Beirami, Smith 2020, arXiv:1905.10497"
    personalized = False
    averages = ("w",)
    params = {
        "q": Param(1.0, "fairness q of min sum_k p_k F_k^(q+1) / (q+1): 0 is FedAvg (uniform), larger q weighs the "
                   "clients with a larger loss more", lambda v: v >= 0 and math.isfinite(v), "a finite number >= 0"),
    }

    def __init__(self, ctx, **hp):
        super().__init__(ctx, **hp)
        sgd_settings(ctx, self.name, "q-FedAvg estimates the gradient as (w - wbar_k) / eta, which holds for SGD "
                     "steps only")

    def upload(self) -> dict[str, TensorSpec]:
        return {"params": TensorSpec(("P",)), "loss": TensorSpec(())}

    def init_state(self) -> dict:
        return {"w": self.ctx.init.clone()}

    def plan(self, state: dict, rnd: int, clients: np.ndarray) -> Plan:
        return Plan(clients, {"params": state["w"].expand(len(clients), -1).clone()})

    def client_update(self, plan: Plan, trainer, rnd: int, cstate: dict) -> Update:
        """(1) at w^t, then (2); wbar_k and F_k go up."""
        losses = local_losses(trainer, plan.start, plan.clients)
        t = trainer.train(TrainJob(plan.clients, plan.start), rnd)
        return Update(t.clients, {"params": t.params, "loss": losses.to(torch.float32).to(t.params.device)},
                      t.n_samples, {"train_loss": t.loss})

    def aggregate(self, state: dict, rnd: int, update: Update) -> dict:
        """(3)-(7), the F^q-weighted mean through the shared server step."""
        sent = update.sent.get("params")
        if sent is None:
            sent = state["w"].expand_as(update.params)
        new = qffl_step(state["w"], update.params, sent, update.payload["loss"], float(self.hp["q"]),
                        self.ctx.train.lr, self.server.average)
        self.server.update(state, "w", new)
        return {}

    def model_for(self, state: dict, clients: np.ndarray) -> torch.Tensor:
        return state["w"].expand(len(clients), -1)
