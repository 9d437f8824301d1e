"""Local-only training (the Fed-PRISM technical report's fourth algorithm).

Every client keeps its own model as client state (it never leaves the client), starts from the
common initial model and never communicates: nothing goes down, nothing goes up.
Decision: by default a client trains when it is sampled (`local.participation=sampled`), so Local
gets the same cohorts and the same local work per round as every other method (the FedPrism paper's
protocol, section 4: "each selected client performs E local epochs"). `participation=all` trains
every client every round (1/fraction times the compute).
"""

from __future__ import annotations

import numpy as np

from fedprism.algorithms.base import Algorithm, ClientState, Inference, Plan, TrainJob, Update, register
from fedprism.hparams import Param


@register
class Local(Algorithm):
    name = "local"
    paper = "local training without communication (baseline)"
    params = {
        "participation": Param("sampled", "which clients train each round", choices=("sampled", "all")),
    }
    client_state = {"w": ClientState(("P",), init="model")}

    @classmethod
    def cohort(cls, hp: dict, clients: int, fraction: float) -> int:
        return clients if hp["participation"] == "all" else super().cohort(hp, clients, fraction)

    def upload(self) -> dict:
        return {}

    def init_state(self) -> dict:
        return {}

    def plan(self, state: dict, rnd: int, clients: np.ndarray) -> Plan:
        return Plan(np.arange(self.ctx.num_clients) if self.hp["participation"] == "all" else clients)

    def client_update(self, plan: Plan, trainer, rnd: int, cstate: dict) -> Update:
        t = trainer.train(TrainJob(plan.clients, cstate["w"].clone()), rnd)
        return Update(plan.clients, {}, t.n_samples, {"train_loss": t.loss}, client_state={"w": t.params})

    def aggregate(self, state: dict, rnd: int, update: Update) -> dict:
        return {}

    def eval_payload(self, state: dict, clients: np.ndarray) -> dict:
        return {}

    def inference(self, trainer, clients, payload, cstate) -> Inference:
        return Inference({"model": cstate["w"]})
