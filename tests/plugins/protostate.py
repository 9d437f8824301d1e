"""A test-only method with zero-initialised [C, d] client state (per-class feature sums, never sent).

Each sampled client trains the received model, then adds the penultimate features of its training
samples to its own per-class sums (`sums` [C, d], `counts` [C]); it uploads the model and predicts with
it plus a bias towards the classes it has seen (from `counts`), so the client state changes the scores.
"""

import torch

from fedprism.algorithms.aggregation import client_weights, weighted_mean
from fedprism.algorithms.base import Algorithm, ClientState, Inference, Plan, TrainJob, Update, register
from fedprism.algorithms.base import train_update


@register
class ProtoState(Algorithm):
    name = "test_protostate"
    paper = "test-only"
    client_state = {"sums": ClientState(("C", "d"), init="zeros"), "counts": ClientState(("C",), init="zeros")}

    def init_state(self) -> dict:
        return {"w": self.ctx.init.clone()}

    def plan(self, state, rnd, clients) -> Plan:
        return Plan(clients, {"params": state["w"].expand(len(clients), -1).clone()})

    def client_update(self, plan, trainer, rnd, cstate) -> Update:
        up = train_update(trainer, TrainJob(plan.clients, plan.start), rnd)
        sums, counts = cstate["sums"].clone(), cstate["counts"].clone()
        for i, c in enumerate(plan.clients):
            x, y = trainer.data(int(c), "train")
            z = trainer.features(up.params[i:i + 1], x)[0].float()
            sums[i].index_add_(0, y.to(z.device), z)
            counts[i] += torch.bincount(y, minlength=counts.shape[1]).to(counts.dtype)
        up.client_state = {"sums": sums, "counts": counts}
        return up

    def aggregate(self, state, rnd, update) -> dict:
        if len(update.clients):
            state["w"] = weighted_mean(update.params, client_weights(update))
        return {}

    def model_for(self, state, clients):
        return state["w"].expand(len(clients), -1)

    def inference(self, trainer, clients, payload, cstate) -> Inference:
        prior = torch.log1p(cstate["counts"])                              # [n, C]
        return Inference({"model": payload["params"]}, lambda z, e: z["model"] + e["prior"][:, None, :],
                         extras={"prior": prior})
