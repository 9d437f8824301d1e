"""Local-only training (report 002, "4th algorithm: local computation for all clients").

Every client keeps its own model, starts from the common initial model and never communicates.
Decision: by default a client trains when it is sampled (`local.participation=sampled`), so Local
gets the same cohorts and the same local work per round as every other method (the FedPrism paper's
protocol, section 4: "each selected client performs E local epochs"). `participation=all` trains
every client every round (002 read literally; 1/R times the compute).
"""

from __future__ import annotations

import numpy as np
import torch

from fedprism.algorithms.base import Algorithm, Plan, Update, register
from fedprism.hparams import Param


@register
class Local(Algorithm):
    name = "local"
    paper = "report 002 (4th algorithm); FedPrism paper 4.4"
    params = {
        "participation": Param("sampled", "which clients train each round", choices=("sampled", "all")),
    }

    def init_state(self) -> dict:
        return {"w": self.ctx.init.expand(self.ctx.num_clients, -1).clone()}

    def cohort(self, sampled: np.ndarray) -> np.ndarray:
        return np.arange(self.ctx.num_clients) if self.hp["participation"] == "all" else sampled

    def plan(self, state: dict, rnd: int, clients: np.ndarray) -> Plan:
        clients = self.cohort(clients)
        return Plan(clients, state["w"][torch.as_tensor(clients)].clone(), down_floats=0)

    def client_update(self, plan: Plan, trainer, rnd: int) -> Update:
        up = trainer.train(plan, rnd)
        up.up_floats = 0
        return up

    def aggregate(self, state: dict, rnd: int, update: Update) -> dict:
        state["w"][torch.as_tensor(update.clients)] = update.params
        return {}

    def model_for(self, state: dict, clients: np.ndarray) -> torch.Tensor:
        return state["w"][torch.as_tensor(clients)]
