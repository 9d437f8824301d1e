"""FedAvg with server momentum (FedAvgM; Hsu, Qi, Brown 2019, arXiv:1909.06335) as an external plugin.

The worked example of docs/writing-a-method.md: a package registers it through the `fedprism.methods`
entry-point group and it runs through `fedprism run`, sweeps, reports and Flower like a built-in method.
"""

import numpy as np

from fedprism.algorithms.aggregation import client_weights, weighted_mean
from fedprism.algorithms.base import Algorithm, Plan, Update
from fedprism.hparams import Param


class FedAvgM(Algorithm):
    name = "fedavgm"
    paper = "Hsu, Qi, Brown 2019, arXiv:1909.06335"
    personalized = False
    params = {"server_momentum": Param(0.9, "beta: v <- beta v + (w - mean of the returned models)",
                                       lambda v: 0 <= v < 1, "a number in [0, 1)")}

    def init_state(self) -> dict:
        return {"w": self.ctx.init.clone(), "v": self.ctx.init.clone() * 0}

    def plan(self, state: dict, rnd: int, clients: np.ndarray) -> Plan:
        return Plan(clients, {"params": state["w"].expand(len(clients), -1).clone()})

    def aggregate(self, state: dict, rnd: int, update: Update) -> dict:
        pseudo_grad = state["w"] - weighted_mean(update.params, client_weights(update))
        state["v"] = self.hp["server_momentum"] * state["v"] + pseudo_grad
        state["w"] = state["w"] - state["v"]
        return {}

    def model_for(self, state: dict, clients: np.ndarray):
        return state["w"].expand(len(clients), -1)
