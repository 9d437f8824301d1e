"""SCAFFOLD (Karimireddy et al. 2020, "SCAFFOLD: Stochastic Controlled Averaging for Federated Learning",
arXiv:1910.06378) as an external plugin, written against the public interface only: the training
settings come from `ctx.train` (`fedprism.protocol.TrainSettings`) and the local steps each client took
from `Trained.steps`, never from an engine's internals. The worked example of "Correcting the local
steps" in docs/writing-a-method.md. The built-in `scaffold` (src/fedprism/algorithms/scaffold.py) adds
option I, the global step size and momentum; this example stays registered as `scaffold_plugin`.

Each client i keeps a control variate c_i (client state, zeros at first); the server keeps x and c.
Round t, on the sampled clients S (Algorithm 1, option II):

    y_i <- y_i - lr (g_i(y_i) - c_i + c)              K local steps from y_i = x
    c_i+ = c_i - c + (x - y_i) / (K lr)               option II
    x   <- mean_{i in S} y_i                          (global step size 1: the shared server step)
    c   <- c + (1/N) sum_{i in S} (c_i+ - c_i)

Decisions where the paper is silent:
* The correction is the gradient of the linear term <y, c - c_i> added to the experiment's loss, so it
  goes through the experiment's optimiser as the gradient does: with SGD momentum, weight decay or a
  last batch smaller than the others it is treated as a gradient term (the paper has plain SGD). Adam
  rescales each coordinate, and option II's (x - y_i) / (K lr) is no estimate of the gradient then: it
  is refused.
* K is the steps the client took (`Trained.steps`): epochs x ceil(n_i / B), so clients of unequal size
  have their own K.
* x is averaged through the shared server step (`averages = ("w",)`): the default is the paper's global
  step size 1, uniform over S as in the paper (`scaffold_plugin.weighting=uniform`; `samples` weighs by n_k),
  and `scaffold_plugin.server_opt=avgm scaffold_plugin.server_momentum=0 scaffold_plugin.server_lr=eta_g` is
  its eta_g.
* A client with no step (no training data, epochs 0) keeps its c_i.
"""

from __future__ import annotations

import numpy as np
import torch

from fedprism.algorithms.aggregation import WEIGHTINGS, client_weights
from fedprism.algorithms.base import Algorithm, ClientState, Plan, TensorSpec, TrainJob, Update
from fedprism.errors import ConfigError
from fedprism.hparams import Param
from fedprism.objectives import ce


def corrected_ce(f, w, x, y, weight, extras):
    """Cross-entropy + <w, c - c_i>: its gradient is g_i(w) + c - c_i (vmap-safe)."""
    return ce(f, w, x, y, weight, extras) + (w * extras["correction"]).sum()


def option_two(c_i: torch.Tensor, c: torch.Tensor, x: torch.Tensor, y: torch.Tensor, steps: torch.Tensor,
               lr: float) -> torch.Tensor:
    """c_i+ = c_i - c + (x - y_i) / (K_i lr), row by row, in float64 (rows with K_i = 0 keep c_i)."""
    k = steps.to(torch.float64).unsqueeze(1)
    new = c_i.double() - c.double() + (x.double() - y.double()) / (k.clamp(min=1) * lr)
    return torch.where(k > 0, new, c_i.double()).to(c_i.dtype)


class Scaffold(Algorithm):
    name = "scaffold_plugin"            # the built-in method `scaffold` is src/fedprism/algorithms/scaffold.py
    paper = "Karimireddy et al. 2020, arXiv:1910.06378"
    personalized = False
    averages = ("w",)
    client_state = {"c": ClientState(("P",), init="zeros")}
    params = {"weighting": Param("uniform", "weights of the average of the clients' models: 1/|S| (uniform, the "
                                            "paper) or n_k (samples)", choices=WEIGHTINGS)}

    def __init__(self, ctx, **hp):
        super().__init__(ctx, **hp)
        if ctx.train is None:
            raise ValueError("scaffold_plugin needs the training settings (Context.train)")
        if ctx.train.optimizer != "sgd":
            raise ConfigError("optimizer", ctx.train.optimizer, "sgd: SCAFFOLD's option II estimates the "
                              "gradient as (x - y_i) / (K lr), which holds for SGD steps only")

    def upload(self) -> dict[str, TensorSpec]:
        return {"params": TensorSpec(("P",)), "delta_c": TensorSpec(("P",))}

    def init_state(self) -> dict:
        return {"w": self.ctx.init.clone(), "c": torch.zeros_like(self.ctx.init)}

    def plan(self, state: dict, rnd: int, clients: np.ndarray) -> Plan:
        n = len(clients)
        return Plan(clients, {"params": state["w"].expand(n, -1).clone(), "c": state["c"].expand(n, -1).clone()})

    def client_update(self, plan: Plan, trainer, rnd: int, cstate: dict) -> Update:
        x, c, c_i = plan.start, plan.payload["c"], cstate["c"]
        job = TrainJob(plan.clients, x, loss=corrected_ce, extras={"correction": c - c_i})
        t = trainer.train(job, rnd)
        lr = self.ctx.train.for_job(job).lr
        c_new = option_two(c_i, c, x, t.params, t.steps, lr)
        return Update(t.clients, {"params": t.params, "delta_c": c_new - c_i}, t.n_samples,
                      {"train_loss": t.loss}, client_state={"c": c_new})

    def aggregate(self, state: dict, rnd: int, update: Update) -> dict:
        avg = self.server.average(update.params, client_weights(update, self.hp["weighting"]),
                                  update.sent.get("params"))
        self.server.update(state, "w", avg)
        n = self.ctx.num_clients
        state["c"] = (state["c"].double() + update.payload["delta_c"].double().sum(0) / n).to(state["c"].dtype)
        return {}

    def model_for(self, state: dict, clients: np.ndarray) -> torch.Tensor:
        return state["w"].expand(len(clients), -1)
