"""IFCA, the Iterative Federated Clustering Algorithm (Ghosh et al. 2020, Algorithm 1, option II).

The server keeps K cluster models theta_1..theta_K and sends all K to every sampled client (down
K*P floats). Client i, on its own train data:

    j_hat = argmin_j F_i(theta_j)                     loss of every model, eval mode, ties: random
    th_i  = LocalUpdate(theta_{j_hat})                send (j_hat, th_i)

Server (model averaging):  theta_j = sum_{i: j_hat_i = j} a_i th_i / sum a_i   if anyone chose j,
else theta_j stays bit-identical. a_i = n_i (`weighting=samples`, as FedAvg here) or 1
(`uniform`, the paper and its reference code).

Initialisation (`init`):
  * `random`: K independent random models. Model 0 is the run's initial model; model j > 0 permutes
    the entries of every parameter tensor of it with a generator seeded by (seed, j). PyTorch's
    default initialisers draw the entries of a tensor i.i.d., so a permutation is an independent
    draw from the same distribution, for any architecture, without knowing how it was built.
  * `warmup`: `warmup_rounds` rounds of FedAvg on one model, then K copies of it. The copies tie
    on every client, and the random tie-break spreads the clients over them to break symmetry.

Decisions where the paper is silent:
  * Ties (|F_ij - min_j F_ij| <= 1e-7 relative) are broken by a client-side RNG seeded by
    (seed, round, client), so a client's choice does not depend on its cohort or the engine.
  * `model_for(i)` is the model client i chose when it was last sampled. A client that never chose (never sampled, or
    only during warm-up) does at evaluation what an IFCA client does at inference: it picks the
    lowest-loss model on its own train data (the `evaluate` hook; `model_for` alone returns model 0).

`ifca.server_opt` (the shared server step, `aggregation.ServerStep`): a server optimiser step on each chosen cluster model
from its average, one optimiser state per cluster model (during warm-up the K equal copies take the same
step); default `none`: the average itself.
"""

from __future__ import annotations

import numpy as np
import torch

from fedprism.algorithms.aggregation import WEIGHTINGS, client_weights
from fedprism.algorithms.base import Algorithm, Inference, Plan, TensorSpec, TrainJob, Update, register, train_update
from fedprism.hparams import Param

TIE_RTOL = 1e-7


def permuted_inits(init: torch.Tensor, spec, k: int, seed: int) -> torch.Tensor:
    """[k, P]: row 0 = init, row j = init with the entries of every parameter tensor permuted."""
    out = init.expand(k, -1).clone()
    for j in range(1, k):
        g = torch.Generator().manual_seed(int(np.random.SeedSequence([seed, j, 0x1FCA]).generate_state(1)[0]))
        for a, b in zip(spec.offsets[:-1], spec.offsets[1:]):
            out[j, a:b] = init[a:b][torch.randperm(b - a, generator=g)]
    return out


def choose(losses: np.ndarray, clients: np.ndarray, key: list[int]) -> np.ndarray:
    """argmin_j of each row of `losses` [n, K]; ties broken by an RNG seeded by (*key, client)."""
    out = np.empty(len(clients), dtype=np.int64)
    for r, (row, c) in enumerate(zip(losses, clients)):
        row = np.where(np.isnan(row), np.inf, row)      # a diverged model's NaN loss: never preferred
        m = row.min()
        ties = np.flatnonzero(row <= m + TIE_RTOL * max(abs(m), 1e-12))
        out[r] = ties[0] if len(ties) == 1 else np.random.default_rng([*key, int(c)]).choice(ties)
    return out


@register
class IFCA(Algorithm):
    name = "ifca"
    paper = "Ghosh et al. 2020 (Algorithm 1, option II); FedPrism paper 4.4 (5)"
    params = {
        "k": Param(5, "number of cluster models K", lambda v: v >= 1, "an integer >= 1"),
        "init": Param("random", "K independent random models, or K copies after a FedAvg warm-up",
                      choices=("random", "warmup")),
        "warmup_rounds": Param(5, "FedAvg rounds before the K copies (init=warmup)", lambda v: v >= 1,
                               "an integer >= 1"),
        "weighting": Param("samples", "per-cluster average: n_i (samples) or 1 (uniform, as the paper)",
                           choices=WEIGHTINGS),
    }
    averages = ("w",)                # the K cluster models

    @classmethod
    def clusters(cls, hp: dict) -> int:
        return hp["k"]

    @classmethod
    def server_models(cls, hp: dict, clients: int, cohort: int) -> dict:
        return {"k": hp["k"] * (cohort + 1)}    # every client of a cohort scores all K models: a copy each

    def init_state(self) -> dict:
        K = self.hp["k"]
        if self.hp["init"] == "random":
            w = permuted_inits(self.ctx.init, self.ctx.spec, K, self.ctx.seed)
        else:
            w = self.ctx.init.expand(K, -1).clone()
        return {"w": w, "assign": torch.full((self.ctx.num_clients,), -1, dtype=torch.long)}

    def _warming(self, rnd: int) -> bool:
        return self.hp["init"] == "warmup" and rnd < self.hp["warmup_rounds"]

    def upload(self) -> dict:
        return {"params": TensorSpec(("P",)), "cluster": TensorSpec((), torch.int32, low=0, high=self.hp["k"])}

    # -- the round ------------------------------------------------------------------------------
    def plan(self, state: dict, rnd: int, clients: np.ndarray) -> Plan:
        models = state["w"][:1] if self._warming(rnd) else state["w"]          # what goes down
        return Plan(clients, {"models": models.expand(len(clients), *models.shape)})

    def _choose(self, trainer, clients: np.ndarray, models: torch.Tensor, key: list[int]) -> np.ndarray:
        """j_hat = argmin_j F_i(theta_j) on each client's train data (models [n, K, P])."""
        n, K, P = models.shape
        if K == 1:
            return np.zeros(n, dtype=np.int64)
        r = trainer.evaluate(models.reshape(n * K, P), np.repeat(clients, K), "train")
        losses = (r.loss_sum / r.count.clamp(min=1)).view(n, K).numpy()
        return choose(losses, clients, key)

    def client_update(self, plan: Plan, trainer, rnd: int, cstate: dict) -> Update:
        models = plan.payload["models"]                                         # [n, K, P]
        j = self._choose(trainer, plan.clients, models, [self.ctx.seed, rnd])
        start = models[torch.arange(len(j)), torch.as_tensor(j)]
        up = train_update(trainer, TrainJob(plan.clients, start), rnd)
        up.payload["cluster"] = torch.as_tensor(j, dtype=torch.int32)            # th_i and j_hat
        return up

    def aggregate(self, state: dict, rnd: int, update: Update) -> dict:
        a = client_weights(update, self.hp["weighting"])
        j = update.payload["cluster"].long()
        x, server = update.params, self.server
        models = update.sent.get("models")                                      # what each client started from
        if self._warming(rnd):                                                  # FedAvg on K copies
            start = None if models is None else models[:, 0]
            K = len(state["w"])             # the K equal copies take the same step (and keep equal states)
            server.update(state, "w", server.average(x, a, start).expand(K, -1), rows=list(range(K)))
            return {}
        start = None if models is None else models[torch.arange(len(j)), j]
        for c in torch.unique(j).tolist():
            sel = j == c
            server.update(state, "w", server.average(x[sel], a[sel], None if start is None else start[sel]), rows=c)
        state["assign"][torch.as_tensor(update.clients)] = j
        return {"clusters": {"clients": update.clients, "labels": j.numpy()}}

    def model_for(self, state: dict, clients: np.ndarray) -> torch.Tensor:
        return state["w"][state["assign"][torch.as_tensor(clients)].clamp(min=0)]

    # -- evaluation -----------------------------------------------------------------------------
    def eval_payload(self, state: dict, clients: np.ndarray) -> dict:
        w = state["w"]
        return {"models": w.expand(len(clients), *w.shape), "choice": state["assign"][torch.as_tensor(clients)]}

    def inference(self, trainer, clients, payload: dict, cstate: dict) -> Inference:
        """The model each client chose when it was last sampled; a client that never chose picks the
        lowest-train-loss model now, as an IFCA client does at inference."""
        models, choice = payload["models"], payload["choice"]
        n = len(clients)
        rows = models[torch.arange(n), choice.clamp(min=0)].clone()
        todo = np.flatnonzero(choice.numpy() < 0)
        w = models[0] if n else models
        if len(todo) and not bool((w == w[0]).all()):
            pick = self._choose(trainer, np.asarray(clients)[todo], models[torch.as_tensor(todo)],
                                [self.ctx.seed, 0x1FCA])
            rows[torch.as_tensor(todo)] = models[torch.as_tensor(todo), torch.as_tensor(pick)]
        return Inference({"model": rows})
