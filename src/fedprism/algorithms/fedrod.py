"""FedRoD (Chen, Chao 2022, "On Bridging Generic and Personalized Federated Learning for Image
Classification", ICLR, arXiv:2107.00778): Federated Robust Decoupling, the linear personalized head.

The model is a body f(x; theta) with two heads on its features z = f(x; theta): the generic head
g(z; psi), shared through FedAvg, and client m's personal head h(z; phi_m), kept by the client. Two losses:

  generic (body and generic head, the balanced risk, with the balanced softmax of Ren et al. 2020):
      L_BSM(theta, psi; x, y) = -log( N_{m,y} exp(g_y(z)) / sum_c N_{m,c} exp(g_c(z)) )
                              = CE(g(z) + log N_m, y),   N_{m,c} = client m's training samples of class c

  personal (the personal head on top of the generic logits, the empirical risk):
      L_P(phi_m; x, y) = CE(g(z; psi) + h(z; phi_m), y)      (no gradient into theta or psi)

  client m prediction:  y_hat = argmax_c [ g_c(z; psi) + h_c(z; phi_m) ]
  server:               (theta, psi)^{t+1} = sum_{m in S_t} (n_m / N_t) (theta_m, psi_m)    (FedAvg)

(`averages = ("w",)`: the shared robust rules and server optimisers apply to (theta, psi).) The generic
head alone (`<split>_acc@generic`, and the global model on the global test set, `global_model_acc`) is the
paper's generic-FL prediction.

Parameters (`fedrod.<name>`): `generic_loss` = `bsm` (the paper) or `ce` (plain cross-entropy, an
ablation: with it and `personal_epochs=0` FedRoD is FedAvg bit for bit, tested), `personal_epochs`,
`weighting` (FedAvg's).

Decisions where the paper is silent or its code differs (PFLlib, clientrod.py):

* The personal head is the paper's linear variant: a copy of the model's declared classifier head
  (`ParamSpec.head`), on the same features. The paper's hypernetwork variant is not implemented.
* It starts at zero (PFLlib copies the initial generic head): the first prediction is the generic one,
  and with `personal_epochs=0` it stays zero, so FedRoD is "FedAvg with the balanced softmax" exactly (the
  generic model of such a run is that method's bit for bit, tested). Cross-entropy still moves a zero
  linear head (its gradient is z (softmax - onehot)).
* Order of the two losses. PFLlib takes, on every batch, a step of L_BSM on (theta, psi) and a step of
  L_P on phi with the features of the same forward pass. Here they are two passes of the experiment's
  local training: first E epochs of L_BSM from the received (theta, psi) on the default stream `train`
  (so the generic model is trained exactly as a FedAvg client with that loss trains), then
  `personal_epochs` epochs (unset: E) of L_P on the personal head alone (a parameter mask), on top of the
  body and generic head the first pass produced, on its own stream `fedrod_personal`. The personal head
  thus fits the body it is used with right after training; at evaluation it sits on the current global
  body, as in PFLlib, where a client predicts with the model it received.
* The class prior enters L_BSM as log N_{m,c}, exponent 1: Ren et al.'s balanced softmax, as PFLlib's
  clientrod.py (`balanced_softmax_loss`: logits + log N) computes it.
* N_{m,c} are the client's own label counts of its training rows, counted on the client (never sent; with
  `privacy.epsilon` the server's released counts are not used for this). A class the client does not hold
  has log N = -1e30 instead of -inf: it leaves the softmax normaliser exactly as -inf would (exp
  underflows to 0), and a padded batch row of such a class stays finite.
* The personal head is client state: a [P] row of which only the head's coordinates are read (zeros
  elsewhere); it never travels, and the upload is the generic model, as in FedAvg (bytes equal FedAvg's).
  A client never sampled predicts with a zero personal head: the generic model.
* Optimiser: the experiment's (SGD with momentum by default) for both passes, with a fresh state each.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from fedprism.algorithms.base import ClientState, Inference, Plan, TrainJob, Update, register
from fedprism.algorithms.fedavg import FedAvg
from fedprism.hparams import Param

#: log N_{m,c} of a class the client does not hold (stands for log 0 = -inf)
LOG_ZERO = -1e30
#: the random stream of the personal pass
STREAM = "fedrod_personal"
GENERIC_LOSSES = ("bsm", "ce")


def _epochs_ok(v) -> bool:
    return v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0)


def log_prior(counts: torch.Tensor) -> torch.Tensor:
    """log N_{m,c} of label counts [..., C] (LOG_ZERO where a count is 0), float32."""
    counts = counts.to(torch.float64)
    return torch.where(counts > 0, counts.clamp(min=1).log(), torch.full_like(counts, LOG_ZERO)).float()


def _weighted_ce(logits, y, weight):
    losses = F.cross_entropy(logits, y, reduction="none")
    return (losses * weight).sum() / weight.sum().clamp(min=1.0)


def balanced_softmax_loss(model, w, x, y, weight, extras):
    """L_BSM: cross-entropy of the logits shifted by the client's log label counts (`extras['log_prior']`)."""
    logits = model(w, x)
    return _weighted_ce(logits + extras["log_prior"].to(logits.dtype), y, weight)


def personal_head_loss(model, w, x, y, weight, extras):
    """L_P: cross-entropy of the generic logits (the head of `extras['generic']`, fixed) plus the personal
    head's (the head of `w`) on the features of `w`'s body (frozen by the job's mask)."""
    z = model.features(w, x).detach()
    generic = model.head(extras["generic"], z).detach()
    return _weighted_ce(generic + model.head(w, z), y, weight)


def with_head(w: torch.Tensor, head_rows: torch.Tensor, head: slice) -> torch.Tensor:
    """[n, P] rows of `w` with the head coordinates of `head_rows`."""
    out = w.clone()
    out[:, head] = head_rows[:, head].to(w.device, w.dtype)
    return out


def _sum(z, e):
    return z["generic"] + z["personal"]


def _generic(z, e):
    return z["generic"]


@register
class FedRoD(FedAvg):
    name = "fedrod"
    paper = "Chen, Chao 2022, ICLR, arXiv:2107.00778"
    personalized = True
    client_state = {"phi": ClientState(("P",), init="zeros")}
    predictions = {"generic": "generic head alone (balanced softmax)"}
    params = {
        "generic_loss": Param("bsm", "loss of the body and generic head: bsm (balanced softmax, the paper) or ce",
                              choices=GENERIC_LOSSES),
        "personal_epochs": Param(None, "epochs of the personal head on top of the generic logits (unset: the "
                                 "experiment's local_epochs; 0: the head stays zero)", _epochs_ok,
                                 "an integer >= 0 (unset: local_epochs)"),
        "weighting": FedAvg.params["weighting"],
    }

    def __init__(self, ctx, **hp):
        super().__init__(ctx, **hp)
        self.head = ctx.spec.head
        self.head_mask = torch.zeros(ctx.spec.size)
        self.head_mask[self.head] = 1.0

    @classmethod
    def headline(cls, config: dict) -> str:
        return "generic + personal head"

    def client_prior(self, trainer, clients: np.ndarray) -> torch.Tensor:
        """[n, C] log label counts of the clients' training rows, counted on the clients."""
        C = self.ctx.num_classes
        return torch.stack([log_prior(torch.bincount(trainer.data(int(c), "train")[1].cpu(), minlength=C)[:C])
                            for c in clients])

    def client_update(self, plan: Plan, trainer, rnd: int, cstate: dict) -> Update:
        """The generic pass (uploaded), then the personal pass (kept)."""
        S, w_t = plan.clients, plan.start
        if self.hp["generic_loss"] == "ce":
            job = TrainJob(S, w_t)
        else:
            job = TrainJob(S, w_t, loss=balanced_softmax_loss, extras={"log_prior": self.client_prior(trainer, S)})
        g = trainer.train(job, rnd)
        phi = cstate["phi"].to(g.params.device, g.params.dtype)
        if self.hp["personal_epochs"] != 0:
            p = trainer.train(TrainJob(S, with_head(g.params, phi, self.head), loss=personal_head_loss,
                                       extras={"generic": g.params.clone()}, mask=self.head_mask.to(g.params.device),
                                       epochs=self.hp["personal_epochs"], stream=STREAM), rnd)
            phi = with_head(torch.zeros_like(g.params), p.params, self.head)
        return Update(S, {"params": g.params}, g.n_samples, {"train_loss": g.loss}, client_state={"phi": phi})

    # -- evaluation: generic logits + personal logits on the current global model ----------------------
    def eval_payload(self, state: dict, clients: np.ndarray) -> dict:
        return {"params": state["w"].expand(len(clients), -1)}

    def inference(self, trainer, clients, payload: dict, cstate: dict) -> Inference:
        w = payload["params"]
        return Inference({"generic": w, "personal": with_head(w, cstate["phi"], self.head)}, _sum,
                         {"generic": _generic})

    def extra_models(self, state: dict) -> dict:
        return {"global": state["w"]}
