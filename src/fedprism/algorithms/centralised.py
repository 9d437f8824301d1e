"""Centralised learning (CL): one model trained on the pooled training data of every client, the upper
reference of Jimenez-Gutierrez et al. 2025, "Clust-PSI-PFL: A Population Stability Index Approach for
Clustered Non-IID Personalized Federated Learning", arXiv:2512.20363, Table III (row "CL").

Each round is E epochs (`local_epochs`) of minibatch training with the run's optimiser, batch size and
learning rate over the union of all clients' train splits, reshuffled every epoch (`Trainer.train_pooled`).
T rounds are T x E epochs. The model is evaluated like FedAvg's: on each client's test split (local
accuracy, the paper's weighted global accuracy, AD, SDAD) and on the global test set.

Decisions:
* The paper does not say how long CL trains; here it trains as long as the federated methods' clients
  (`rounds` x `local_epochs` epochs) and it is evaluated after every round.
* Nothing is federated: the training is one job of one "client" (the data centre, reported as client 0);
  `bytes_down` / `bytes_up` count one model each way per round and `never_sampled` is not meaningful.
  The runner's cohort (`fraction`) is ignored.
* Needs every client's data in one process: the simulator only (a Flower node holds one client's data).
"""

from __future__ import annotations

import numpy as np
import torch

from fedprism.algorithms.base import Algorithm, Plan, Update, register


@register
class Centralised(Algorithm):
    name = "centralised"
    paper = "the centralised reference (CL) of Jimenez-Gutierrez et al. 2025, arXiv:2512.20363"
    personalized = False
    params = {}
    simulation_only = "it trains on the pooled data of every client; a Flower node holds one client's"

    def init_state(self) -> dict:
        return {"w": self.ctx.init.clone()}

    def plan(self, state: dict, rnd: int, clients: np.ndarray) -> Plan:
        return Plan(np.array([0]), {"params": state["w"].unsqueeze(0).clone()})

    def client_update(self, plan: Plan, trainer, rnd: int, cstate: dict) -> Update:
        pooled = getattr(trainer, "train_pooled", None)
        if pooled is None:
            raise RuntimeError("centralised trains on the pooled data of every client: in the simulator only")
        t = pooled(plan.start[0], np.arange(self.ctx.num_clients), rnd)
        return Update(plan.clients, {"params": t.params}, t.n_samples, {"train_loss": t.loss})

    def aggregate(self, state: dict, rnd: int, update: Update) -> dict:
        state["w"] = update.params[0].clone()
        return {}

    def model_for(self, state: dict, clients: np.ndarray) -> torch.Tensor:
        return state["w"].expand(len(clients), -1)
