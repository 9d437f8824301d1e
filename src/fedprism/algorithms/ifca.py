"""IFCA, the Iterative Federated Clustering Algorithm (Ghosh et al. 2020, Algorithm 1, option II).

The server keeps K cluster models theta_1..theta_K and sends all K to every sampled client (down
K*P floats). Client i, on its own train data (specs/algorithms.md section 4):

    j_hat = argmin_j F_i(theta_j)                     loss of every model, eval mode, ties: random
    th_i  = LocalUpdate(theta_{j_hat})                send (j_hat, th_i)

Server (model averaging):  theta_j = sum_{i: j_hat_i = j} a_i th_i / sum a_i   if anyone chose j,
else theta_j stays bit-identical (specs 0.8). a_i = n_i (`weighting=samples`, as FedAvg here) or 1
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
  * `model_for(i)` is the model client i chose when it was last sampled (specs section 4: "uses the
    assignment computed on the client's train data"). A client that never chose (never sampled, or
    only during warm-up) does at evaluation what an IFCA client does at inference: it picks the
    lowest-loss model on its own train data (the `evaluate` hook; `model_for` alone returns model 0).
"""

from __future__ import annotations

import numpy as np
import torch

from fedprism.algorithms.base import Algorithm, Plan, Update, evaluate_rows, register, weighted_mean
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
                           choices=("samples", "uniform")),
    }

    def init_state(self) -> dict:
        K = self.hp["k"]
        if self.hp["init"] == "random":
            w = permuted_inits(self.ctx.init, self.ctx.spec, K, self.ctx.seed)
        else:
            w = self.ctx.init.expand(K, -1).clone()
        return {"w": w, "assign": torch.full((self.ctx.num_clients,), -1, dtype=torch.long)}

    def _warming(self, rnd: int) -> bool:
        return self.hp["init"] == "warmup" and rnd < self.hp["warmup_rounds"]

    # -- the four functions --------------------------------------------------------------------
    def plan(self, state: dict, rnd: int, clients: np.ndarray) -> Plan:
        models = state["w"][:1] if self._warming(rnd) else state["w"]          # what goes down
        n, (K, P) = len(clients), models.shape
        return Plan(clients, self.model_for(state, clients).clone(),
                    extras={"models": models.expand(n, K, P)}, down_floats=K * P)

    def client_update(self, plan: Plan, trainer, rnd: int) -> Update:
        models = plan.extras["models"]                                          # [n, K, P]
        n, K, P = models.shape
        if K == 1:
            j = np.zeros(n, dtype=np.int64)
        else:
            r = trainer.evaluate(models.reshape(n * K, P), np.repeat(plan.clients, K), "train")
            losses = (r.loss_sum / r.count.clamp(min=1)).view(n, K).numpy()
            j = choose(losses, plan.clients, [self.ctx.seed, rnd])
        start = models[torch.arange(n), torch.as_tensor(j)]
        up = trainer.train(Plan(plan.clients, start, epochs=plan.epochs), rnd)
        up.extras["cluster"] = torch.as_tensor(j)
        up.up_floats = P + 1                                                    # th_i and j_hat
        return up

    def aggregate(self, state: dict, rnd: int, update: Update) -> dict:
        if len(update.clients) == 0:
            return {}
        a = update.n_samples if self.hp["weighting"] == "samples" else torch.ones(len(update.clients))
        j = update.extras["cluster"]
        if self._warming(rnd):                                                  # FedAvg on K copies
            state["w"][:] = weighted_mean(update.params, a)
            return {}
        for c in torch.unique(j).tolist():
            sel = j == c
            state["w"][c] = weighted_mean(update.params[sel], a[sel])
        state["assign"][torch.as_tensor(update.clients)] = j
        return {"clusters": {"clients": update.clients, "labels": j.numpy()}}

    def model_for(self, state: dict, clients: np.ndarray) -> torch.Tensor:
        return state["w"][state["assign"][torch.as_tensor(clients)].clamp(min=0)]

    def evaluate(self, state: dict, trainer, clients: np.ndarray, split: str):
        """Clients that never chose pick the lowest-train-loss model now (IFCA inference)."""
        todo = np.flatnonzero(state["assign"][torch.as_tensor(clients)].numpy() < 0)
        w = state["w"]
        if len(todo) == 0 or bool((w == w[0]).all()):
            return None                                                         # model_for is exact
        K, P = w.shape
        r = trainer.evaluate(w.repeat(len(todo), 1), np.repeat(clients[todo], K), "train")
        losses = (r.loss_sum / r.count.clamp(min=1)).view(len(todo), K).numpy()
        rows = self.model_for(state, clients).clone()
        pick = choose(losses, clients[todo], [self.ctx.seed, 0x1FCA])
        rows[torch.as_tensor(todo)] = w[torch.as_tensor(pick)]
        return evaluate_rows(trainer, rows, clients, split)      # K distinct models on the global set
