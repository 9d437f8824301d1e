"""FedEM (Marfoq, Neglia, Bellet, Kameni, Vidal 2021, "Federated Multi-Task Learning under a Mixture of
Distributions", NeurIPS, arXiv:2108.10252, Algorithm 1): every client's distribution is a mixture of M
shared components, D_t(x, y) = sum_m pi_tm D~_m(x, y), and client t's model is the mixture of M shared
component models h_{theta_m} with its own weights pi_t (numbered here):

    (1)  p_t(y | x) = sum_m pi_tm p_m(y | x),   p_m(y | x) = softmax(h_{theta_m}(x))_y

Client t (sampled in round k) receives theta^k_1..theta^k_M and holds pi^k_t (its client state):

    E-step  (2)  q_t(z = m | x, y) = pi^k_tm exp(-l(h_{theta^k_m}(x), y)) / sum_m' pi^k_tm' exp(-l(h_{theta^k_m'}(x), y))
                                      for every training sample (x, y) of the client; l = cross-entropy
    M-step  (3)  pi^{k+1}_tm = (1 / n_t) sum_{(x, y) in D_t} q_t(z = m | x, y)
            (4)  theta_{t,m} <- E epochs of SGD from theta^k_m on  sum_{(x,y)} q_t(z = m | x, y) l(h_theta(x), y) / n_t
    client -> server: theta_{t,1..M}                        (pi_t never leaves the client)
    server  (5)  theta^{k+1}_m = sum_{t in S_k} (n_t / N_k) theta_{t,m}   for each m      (`weighting`)

Prediction of client t: (1) with its current pi_t and the server's current components.

Equivalence (tested): M = 1 is FedAvg bit for bit. With one component (2) is softmax of one entry, q = 1
exactly; (4) multiplies every sample's loss by 1.0, which is exact, so the local steps are FedAvg's; (5) is
FedAvg's average; and the prediction is the one component's logits (the single-stream fast path).

Decisions where the paper is silent, or its code (omarfoq/FedEM, client.py `MixtureClient`,
learners/learners_ensemble.py) is followed:

* Order of the steps: as the authors' client, the E-step (2) with the received components and the
  client's previous pi, then (3) pi from those responsibilities, then (4) with the same responsibilities.
* Where (2) is evaluated. The engines' local objective sees a batch (x, y), not sample indices, so the
  responsibilities that weight a training batch in (4) are (2) computed on that batch inside the objective,
  from the received (frozen) components theta^k_m and pi^k_t, with no gradient: the very formula of the
  E-step, evaluated where it is used. (3) comes from (2) over the client's whole training split at the
  evaluation precision (`Trainer.logits`). For a model without BatchNorm or dropout both are (2) on the same
  samples (up to float rounding of the two forward paths); a BatchNorm model's losses depend on the batch
  (batch statistics everywhere, `fedprism.params`), so there (4)'s weights are (2) on the training batch
  while (3) uses evaluation chunks. The frozen components run without dropout (`params.Keyed`), as MOON's
  frozen models do.
* (4) trains the M components as one vector [theta_1; ...; theta_M] with the objective
  sum_m mean_batch(q_m l_m): the terms are separable, so each component receives exactly the gradient of its
  own weighted loss and the experiment's optimiser (SGD with momentum, weight decay) acts coordinate-wise
  as on M separate trainings; all M see the same batch order (the default stream `train`, so M = 1 has
  FedAvg's), while the authors' learners each iterate their own shuffled loader. The batch mean divides by
  the batch size, as the authors' `(loss_vec @ weights) / batch_size`. `train_loss` is that objective.
* Component initialisation: M independent random models, component 0 the run's initial model, component
  m > 0 the initial model with the entries of each parameter tensor permuted by a generator seeded by
  (seed, m) (an independent draw from PyTorch's i.i.d. initialisers; `ifca.permuted_inits`). The paper
  initialises the components independently at random; with M = 1 this is FedAvg's initial model.
* pi_t starts uniform (1/M), as the authors' `learners_weights`; it is declared client state, changes only
  when the client trains, and a never-sampled client (and a held-out newcomer, `data.unseen_clients`)
  predicts with the uniform mixture. A weight that underflows to 0 stays 0 (log 0 = -inf in (2)), as EM does.
* (5) is the shared server step for each component (`averages = ("w",)`, one row per component:
  `fedem.aggregation`, `fedem.server_opt`); `weighting = samples` is the paper's n_t / N_k.
* The prediction's logits are log sum_m pi_tm softmax(h_m(x)) (computed as a log-sum-exp in float64), so
  the stored loss is the mixture's negative log-likelihood; with M = 1 it is the component's own logits.
* The objective evaluates the model at the frozen components' parameters, which the fused training kernels
  cannot take: `train.kernels = auto` is aten for FedEM and `fused` is refused (`fused_training`).

Defaults: M = 3, the number of components of the paper's experiments; the local epochs, batch size and
optimiser are the experiment's.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from fedprism.algorithms.aggregation import WEIGHTINGS, client_weights
from fedprism.algorithms.base import (Algorithm, ClientState, Inference, Plan, TensorSpec, TrainJob, Update,
                                      register)
from fedprism.algorithms.ifca import permuted_inits
from fedprism.hparams import Param

#: training samples per call of the E-step's forward pass
CHUNK = 1024


# -- the E-step and the M-step's weights (pure functions) ------------------------------------------------
def responsibilities(log_pi: torch.Tensor, losses: torch.Tensor) -> torch.Tensor:
    """(2): q [..., M] = softmax_m(log pi_m - l_m) of per-sample losses `losses` [..., M] and log weights
    `log_pi` [M] (broadcast), in the losses' dtype."""
    return torch.softmax(log_pi.to(losses.dtype) - losses, dim=-1)


def mixture_weights(q: torch.Tensor) -> torch.Tensor:
    """(3): pi [M] = the mean of the responsibilities q [n, M] over the samples (float64)."""
    return q.to(torch.float64).mean(0)


def component_losses(trainer, client: int, models: torch.Tensor) -> torch.Tensor:
    """[n_t, M] float64: l(h_{theta_m}(x), y) of every training sample of `client` under each of `models`
    [M, P], at the evaluation precision."""
    x, y = trainer.data(int(client), "train")
    out = []
    for s0 in range(0, len(y), CHUNK):
        logits = trainer.logits(models, x[s0:s0 + CHUNK]).to(torch.float64)          # [M, B, C]
        yy = y[s0:s0 + CHUNK].to(logits.device)
        M, B, C = logits.shape
        ce = F.cross_entropy(logits.reshape(M * B, C), yy.repeat(M), reduction="none").view(M, B)
        out.append(ce.T.cpu())
    return torch.cat(out) if out else torch.zeros(0, len(models), dtype=torch.float64)


def fedem_loss(model, z, x, y, weight, extras):
    """(4) on one batch, for the M components stacked in z = [theta_1; ...; theta_M]:
    sum_m sum_b weight_b q_bm l_m(b) / sum_b weight_b, with q (2) from the frozen components `start` [M P]
    and `log_pi` [M] (extras), without gradient (vmap-safe)."""
    P = model.spec.size
    M = z.shape[-1] // P
    frozen = getattr(model, "f", model)            # the model without the step's dropout key (`params.Keyed`)
    start, wsum = extras["start"], weight.sum().clamp(min=1.0)
    fixed = torch.stack([F.cross_entropy(frozen(start[m * P:(m + 1) * P], x), y, reduction="none")
                         for m in range(M)], -1)                                       # [B, M]
    q = responsibilities(extras["log_pi"], fixed).detach()       # constants of the objective (extras only)
    total = 0.0
    for m in range(M):
        losses = F.cross_entropy(model(z[m * P:(m + 1) * P], x), y, reduction="none")
        total = total + ((losses * q[:, m]) * weight).sum() / wsum
    return total


def mixture_logits(streams: dict, extras: dict) -> torch.Tensor:
    """(1) as logits [m, B, C]: log sum_m pi_m softmax(h_m(x)), float64 log-sum-exp over the components
    (streams `c0`, `c1`, ... in order; extras `pi` [m, M])."""
    names = sorted(streams, key=lambda s: int(s[1:]))
    logp = torch.stack([F.log_softmax(streams[s].to(torch.float64), -1) for s in names])     # [M, m, B, C]
    log_pi = extras["pi"].to(torch.float64).clamp(min=0).log().T[:, :, None, None]           # [M, m, 1, 1]
    return torch.logsumexp(log_pi + logp, dim=0)


@register
class FedEM(Algorithm):
    name = "fedem"
    paper = "Marfoq, Neglia, Bellet, Kameni, Vidal 2021, arXiv:2108.10252, Algorithm 1"
    params = {
        "m": Param(3, "M: number of mixture components (shared component models)", lambda v: v >= 1,
                   "an integer >= 1"),
        "weighting": Param("samples", "component average (5): n_t (samples, the paper) or 1/|S_k| (uniform)",
                           choices=WEIGHTINGS),
    }
    averages = ("w",)                      # the M component models, one row each (`self.server`)
    #: the objective evaluates the frozen components: the fused training kernels cannot take it
    fused_training = False
    #: the declaration (`__init__` sizes pi to M and starts it at 1/M)
    client_state = {"pi": ClientState((1,), init=1.0, dtype=torch.float64)}

    def __init__(self, ctx, **hp):
        super().__init__(ctx, **hp)
        M = self.hp["m"]
        self.client_state = {"pi": ClientState((M,), init=1.0 / M, dtype=torch.float64)}

    @classmethod
    def server_models(cls, hp: dict, clients: int, cohort: int) -> dict:
        return {"m": hp["m"] * (cohort + 1)}     # the M components and a copy for every client of a cohort

    @classmethod
    def headline(cls, config: dict) -> str:
        return "mixture of the components (own weights)"

    def upload(self) -> dict:
        return {"models": TensorSpec((self.hp["m"], "P"))}

    def init_state(self) -> dict:
        return {"w": permuted_inits(self.ctx.init, self.ctx.spec, self.hp["m"], self.ctx.seed)}

    def plan(self, state: dict, rnd: int, clients: np.ndarray) -> Plan:
        w = state["w"]
        return Plan(clients, {"models": w.expand(len(clients), *w.shape).clone()})

    def client_update(self, plan: Plan, trainer, rnd: int, cstate: dict) -> Update:
        """(2) and (3) on the client's training split, then (4) from the received components."""
        S, models = plan.clients, plan.payload["models"]                     # [n, M, P]
        n, M, P = models.shape
        pi = cstate["pi"].to(torch.float64)
        log_pi = pi.clamp(min=0).log()
        new_pi = torch.stack([mixture_weights(responsibilities(log_pi[i], component_losses(trainer, c, models[i])))
                              for i, c in enumerate(S)]) if n else pi.clone()
        start = models.reshape(n, M * P)
        job = TrainJob(S, start.clone(), loss=fedem_loss, extras={"start": start.clone(), "log_pi": log_pi.float()})
        t = trainer.train(job, rnd)
        return Update(t.clients, {"models": t.params.view(n, M, P)}, t.n_samples, {"train_loss": t.loss},
                      client_state={"pi": new_pi})

    def aggregate(self, state: dict, rnd: int, update: Update) -> dict:
        """(5) for each component, through the shared server step."""
        a = client_weights(update, self.hp["weighting"])
        x, sent = update.payload["models"], update.sent.get("models")
        for m in range(self.hp["m"]):
            avg = self.server.average(x[:, m], a, None if sent is None else sent[:, m])
            self.server.update(state, "w", avg, rows=m)
        return {}

    def model_for(self, state: dict, clients: np.ndarray) -> torch.Tensor:
        """Component 0 (the whole model of a client is the mixture, `inference`)."""
        return state["w"][0].expand(len(clients), -1)

    def eval_payload(self, state: dict, clients: np.ndarray) -> dict:
        w = state["w"]
        return {"models": w.expand(len(clients), *w.shape)}

    def inference(self, trainer, clients, payload: dict, cstate: dict) -> Inference:
        """(1) with the client's own pi; M = 1: the component's own logits (the exact single-stream path)."""
        models = payload["models"]
        if models.shape[1] == 1:
            return Inference({"model": models[:, 0]})
        streams = {f"c{m}": models[:, m] for m in range(models.shape[1])}
        return Inference(streams, mixture_logits, extras={"pi": cstate["pi"]})
