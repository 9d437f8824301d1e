"""FedAvg (McMahan et al. 2017; technical report 002, "3rd algorithm").

    w^{t+1} = sum_{k in S_t} (n_k / N_t) w_k^{t+1},   N_t = sum_{k in S_t} n_k          (002 Step 3)

Participant-normalised weights (specs/algorithms.md section 1 pitfall), float64 accumulation.
`fedavg.weighting=uniform` gives the 1/|S_t| mean that Fed-PRISM's global stream uses.
"""

from __future__ import annotations

import numpy as np
import torch

from fedprism.algorithms.base import Algorithm, Plan, Update, register, weighted_mean
from fedprism.hparams import Param


@register
class FedAvg(Algorithm):
    name = "fedavg"
    paper = "McMahan et al. 2017; report 002 (3rd algorithm)"
    personalized = False
    params = {
        "weighting": Param("samples", "aggregation weights: n_k (samples) or 1/|S_t| (uniform)",
                           choices=("samples", "uniform")),
    }

    def init_state(self) -> dict:
        return {"w": self.ctx.init.clone()}

    def plan(self, state: dict, rnd: int, clients: np.ndarray) -> Plan:
        return Plan(clients, state["w"].expand(len(clients), -1).clone())

    def aggregate(self, state: dict, rnd: int, update: Update) -> dict:
        if len(update.clients):
            w = update.n_samples if self.hp["weighting"] == "samples" else torch.ones(len(update.clients))
            state["w"] = weighted_mean(update.params, w)
        return {}

    def model_for(self, state: dict, clients: np.ndarray) -> torch.Tensor:
        return state["w"].expand(len(clients), -1)
