"""FedProx (Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith 2020, "Federated Optimization in Heterogeneous
Networks", MLSys 2020, arXiv:1812.06127), Algorithm 2.

Client k, sampled in round t, receives w^t and approximately minimises (Eq. 2)

    h_k(w; w^t) = F_k(w) + (mu/2) ||w - w^t||^2,      grad: grad F_k(w) + mu (w - w^t)

from w^t, for the experiment's E local epochs (the objective `prox` of `fedprism.objectives`, anchor
w^t, written as a loss term so that it holds for SGD with momentum and for Adam alike). The server
averages the returned models as FedAvg does:

    w^{t+1} = sum_{k in S_t} (n_k / N_t) w_k^{t+1}          (`weighting=samples`; `uniform`: 1/|S_t|)

Decisions where the paper is silent or differs from this protocol:

* Anchor: the model the client received this round (the plan's `params`), a frozen copy; it does not
  move with the local iterate. Nothing extra travels: the client keeps the received vector itself.
* mu = 0 trains with the same `prox` objective and gives FedAvg bit for bit (the penalty and its
  gradient are exact zeros), which the tests check through the whole runner.
* Systems heterogeneity: the paper lets stragglers return gamma-inexact solutions (a random number of
  epochs in [1, E) for a fraction of the devices, its 0 %, 50 %, 90 % settings). This protocol has
  no stragglers: every sampled client runs E epochs (the paper's 0 % stragglers setting).
* Default mu = 0.01. The paper picks mu from {0.001, 0.01, 0.1, 1} per data set (1 for its convex
  multinomial-logistic models on MNIST and FEMNIST and for the synthetic data, 0.001 for Shakespeare,
  0.01 for Sent140) and gives no value for Fashion-MNIST with a CNN. Under this protocol (SGD lr 0.01 with
  momentum 0.9, effective step lr / (1 - 0.9) = 0.1; E = 10 epochs of ~19 batches, ~190 steps) the
  proximal gradient contracts w - w^t by about 0.1 mu per step: mu = 1 keeps a client within ~10
  steps' drift of w^t (most of the 10 epochs would be wasted), mu = 0.1 damps the drift of a round by
  a factor ~e^-1.9, mu = 0.01 by ~17 %. 0.01 is also the value tuned for FedProx on Fashion-MNIST
  with a CNN, 100 clients and Dirichlet label splits (grid {0.001, 0.01, 0.1}, Adam clients) by
  Jimenez-Gutierrez et al., "Clust-PSI-PFL: A Population Stability Index Approach for Clustered
  Non-IID Personalized Federated Learning", Table II. Set `fedprox.mu` for another of the paper's values.
* `fedprox.server_opt` (avgm, adagrad, yogi, adam) applies a server optimiser to the averaged update and
  `fedprox.aggregation` a robust rule, as for FedAvg (the shared server step, `aggregation.ServerStep`);
  defaults `none` and `mean`.
"""

from __future__ import annotations

import torch

from fedprism.algorithms.base import Plan, TrainJob, Update, register, train_update
from fedprism.algorithms.fedavg import FedAvg
from fedprism.hparams import Param


def prox_job(clients, start: torch.Tensor, anchor: torch.Tensor, mu: float, **kw) -> TrainJob:
    """The TrainJob that minimises F_k(w) + (mu/2)||w - anchor_k||^2 from `start` (FedProx: start =
    anchor = w^t; Ditto's personal phase: start v_k, anchor w^t)."""
    return TrainJob(clients, start, loss="prox",
                    extras={"anchor": anchor, "mu": torch.full((len(clients),), float(mu))}, **kw)


@register
class FedProx(FedAvg):
    name = "fedprox"
    paper = "Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith 2020, arXiv:1812.06127"
    personalized = False
    params = {
        "mu": Param(0.01, "proximal weight: local loss F_k(w) + (mu/2)||w - w^t||^2", lambda v: v >= 0,
                    "a number >= 0"),
        "weighting": FedAvg.params["weighting"],
    }

    def client_update(self, plan: Plan, trainer, rnd: int, cstate: dict) -> Update:
        """min_w F_k(w) + (mu/2)||w - w^t||^2 from w^t for E epochs; upload w_k^{t+1}."""
        return train_update(trainer, prox_job(plan.clients, plan.start, plan.start, self.hp["mu"]), rnd)
