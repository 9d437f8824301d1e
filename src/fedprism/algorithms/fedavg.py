"""FedAvg (McMahan et al. 2017, "Communication-Efficient Learning of Deep Networks from Decentralized
Data", arXiv:1602.05629); the Fed-PRISM technical report's third algorithm.

    w^{t+1} = sum_{k in S_t} (n_k / N_t) w_k^{t+1},   N_t = sum_{k in S_t} n_k

Participant-normalised weights, float64 accumulation (`fedprism.algorithms.aggregation`).
`fedavg.weighting=uniform` gives the 1/|S_t| mean that Fed-PRISM's global stream uses.

`fedavg.server_opt` turns the server step into FedAvgM (`avgm`; Hsu, Qi, Brown 2019, "Measuring the
Effects of Non-Identical Data Distribution for Federated Visual Classification", arXiv:1909.06335) or
FedAdagrad / FedYogi / FedAdam (Reddi et al. 2021, "Adaptive Federated Optimization",
arXiv:2003.00295), applied to Delta_t = (the average above) - w^t, and `fedavg.aggregation` replaces
the weighted mean by a robust rule: both are the shared server step of every method that averages
models (`averages = ("w",)`, `aggregation.ServerStep`). The default `none` keeps w^{t+1} = the average.
Ditto's, APFL's, FedProx's, Per-FedAvg's and pFedMe's global model w inherit this step.
"""

from __future__ import annotations

import numpy as np
import torch

from fedprism.algorithms.aggregation import WEIGHTINGS, client_weights
from fedprism.algorithms.base import Algorithm, Plan, Update, register
from fedprism.hparams import Param


@register
class FedAvg(Algorithm):
    name = "fedavg"
    paper = "McMahan et al. 2017, arXiv:1602.05629"
    personalized = False
    averages = ("w",)             # the robust rule and the server optimiser act on w (`self.server`)
    params = {
        "weighting": Param("samples", "aggregation weights: n_k (samples) or 1/|S_t| (uniform)", choices=WEIGHTINGS),
    }

    def init_state(self) -> dict:
        return {"w": self.ctx.init.clone()}

    def plan(self, state: dict, rnd: int, clients: np.ndarray) -> Plan:
        return Plan(clients, {"params": state["w"].expand(len(clients), -1).clone()})

    def aggregate(self, state: dict, rnd: int, update: Update) -> dict:
        avg = self.server.average(update.params, client_weights(update, self.hp["weighting"]),
                                  update.sent.get("params"))
        self.server.update(state, "w", avg)
        return {}

    def model_for(self, state: dict, clients: np.ndarray) -> torch.Tensor:
        return state["w"].expand(len(clients), -1)
