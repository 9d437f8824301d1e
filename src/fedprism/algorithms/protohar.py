"""ProtoHAR (Cheng, Zhang, Bu, Wang, Wu, Song 2023, "ProtoHAR: Prototype Guided Personalized Federated
Learning for Human Activity Recognition", IEEE Journal of Biomedical and Health Informatics 27(8),
doi:10.1109/JBHI.2023.3275438; no arXiv version).

The model is a shared representation (the body phi, averaged by the server) and a personal classifier
(the head h_i, which never leaves client i), with FedProto's class prototypes steering the representation:

    server -> client i:  phi, C_bar [C, d], present [C]
    client i:            w_i = (phi, h_i)
      head phase:        h_i <- `head_epochs` epochs of CE, phi frozen                    (stream 'head')
      body phase:        phi_i <- E epochs of CE + lambda R_i, h_i frozen                 (stream 'train')
                           R_i = mean over the batch and the d dimensions of
                                 ||f(x) - C_bar_y||^2 for samples with present[y]  (fedproto.prototype_loss)
                         C_i^(j) = mean_{(x, y) in D_i, y = j} f_i(x) with the trained phi_i,  n_ij = |D_i,j|
    client i -> server:  phi_i, C_i [C, d], n_i [C];  keeps (phi_i, h_i)
    server:              phi <- sum_i n_i phi_i / sum_i n_i
                         C_bar_j <- sum_i n_ij C_i^(j) / sum_i n_ij over the reporters with n_ij > 0
    inference:           client i predicts with (phi, h_i): the current shared body, its own head

Source of the schedule. The paper's text was not available here (paywalled; no preprint); the schedule,
the objective and the defaults follow the authors' code (github.com/cheng-haha/ProtoHAR,
FLAlgorithms/users/userProtoHAR.py, FLAlgorithms/servers/serverProtoHAR.py, main.py, runexp.sh), and no
equation numbers can be cited. Decisions:

* Phase order (`order`): `head_first` (default) is the authors' code: the head is fitted to the received
  body, then the body trains under that head with the prototype regulariser. `body_first` runs the body
  phase first and fits the head to the client's trained body afterwards (the order in which the
  abstract names the two parts: correct the representation with the global prototypes, then solve a
  better personalized classifier).
* Epochs: the body phase runs the experiment's E (FedPrism protocol: 10; the authors use 5 on USC-HAD),
  the head phase `head_epochs` = 1 (the authors' `plocal_steps` default; their run script does not set
  it). `head_epochs = 0` switches the head phase off.
* Learning rate: both phases use the experiment's (a TrainJob has no learning rate of its own). The
  authors use 0.01 for the head and 0.001 (USC-HAD) for the body; the FedPrism protocol's 0.01 equals
  their head rate. Each phase starts a fresh optimiser (the authors keep one SGD optimiser per part for
  the whole run). No gradient clipping (the authors clip at norm 50; a TrainJob has no clipping).
* lambda = 1 (default): the authors' run script (`--lamda 1.0` for ProtoHAR). The regulariser is their
  MSE (mean over the batch and the feature dimensions; samples of a class without a global prototype add
  zero); their MMD / L1 / cosine alternatives and the optional exp(beta cos) weighting of prototypes
  (off by default there) are not implemented.
* Local prototypes are true class means over the whole train split with the trained body, computed once
  after local training (the authors sum rep / |D_ic| over the batches of all E epochs, which gives E
  times the mean, in training mode).
* Global prototypes: the server's prototype step is FedProto's (`fedproto.update_prototypes`).
  `aggregate_over=round` (default) averages this round's reporters, as the authors' server does: the body
  changes every round, so an older upload describes features of a body that is gone; a class none of
  this round's reporters has keeps its previous prototype (the authors' server drops it). `seen` averages
  every client's latest upload. `proto_weighting=samples` (default, as in `fedproto`) weights by n_ij;
  `uniform` is the authors' plain mean over clients.
* The body is averaged with weights n_i (the authors' server), all of it (every parameter before the
  model's head, `ParamSpec.body`; the head is the model's classifier, `ParamSpec.head`).
* Client state: the client's whole last model (its head is the personal part; its body is replaced by
  the received phi before every use). Every client starts from the run's initial model; a client never
  sampled predicts with the initial head on the current body. Round 0 has no global prototype: the body
  phase is plain cross-entropy.

Equivalence (tests): with lambda = 0 and head_epochs = 0 every head stays the initial head and the body is
FedAvg's with the head frozen (bit for bit).
"""

from __future__ import annotations

import numpy as np
import torch

from fedprism.algorithms.aggregation import WEIGHTINGS, client_weights
from fedprism.algorithms.base import (Algorithm, ClientState, Inference, Plan, TensorSpec, TrainJob, Update,
                                      register)
from fedprism.algorithms.fedproto import (AGGREGATE_OVER, check_feature_dim, local_prototypes, prototype_loss,
                                          prototype_rows, prototype_state, update_prototypes)
from fedprism.hparams import Param

ORDERS = ("head_first", "body_first")


@register
class ProtoHAR(Algorithm):
    name = "protohar"
    paper = "Cheng et al. 2023, ProtoHAR, IEEE JBHI, doi:10.1109/JBHI.2023.3275438"
    params = {
        "lam": Param(1.0, "lambda: weight of the prototype regulariser in the body phase", lambda v: v >= 0,
                     "a number >= 0"),
        "head_epochs": Param(1, "epochs of the head phase (0: no head phase)", lambda v: v >= 0,
                             "an integer >= 0"),
        "order": Param("head_first", "head phase then body phase (the authors' code) or the reverse",
                       choices=ORDERS),
        "proto_weighting": Param("samples", "global prototype: samples (n_ij-weighted) or uniform (plain mean "
                                 "over clients, the authors' code)", choices=WEIGHTINGS),
        "aggregate_over": Param("round", "global prototype over this round's reporters (round) or every "
                                "client's latest upload (seen)", choices=AGGREGATE_OVER),
    }
    #: the shared server step (robust rule, server optimiser) acts on the body; prototypes: a per-class weighted mean
    averages = ("body",)
    client_state = {"w": ClientState(("P",), init="model")}
    shares_prototypes = True             # `privacy.epsilon` releases them with DP (fedprism.privacy)

    def __init__(self, ctx, **hp):
        super().__init__(ctx, **hp)
        check_feature_dim(ctx, self.name)
        spec = ctx.spec
        self.body = spec.body
        self.mask_body = torch.zeros(spec.size)
        self.mask_body[spec.body] = 1.0
        self.mask_head = 1.0 - self.mask_body

    @classmethod
    def headline(cls, config: dict) -> str:
        return "shared body, own head"

    def upload(self) -> dict:
        return {"body": TensorSpec((self.body.stop - self.body.start,)), "protos": TensorSpec(("C", "d")),
                "counts": TensorSpec(("C",), low=0)}

    def init_state(self) -> dict:
        return {"body": self.ctx.init[self.body].clone(), **prototype_state(self.ctx, self.hp["aggregate_over"])}

    def _rows(self, state: dict, n: int) -> dict:
        return {"body": state["body"].expand(n, -1).clone(), **prototype_rows(state, n)}

    def _with_body(self, w: torch.Tensor, body: torch.Tensor) -> torch.Tensor:
        """[n, P]: the clients' own models with the body replaced by `body` [n, P_body]."""
        w = w.clone()
        w[:, self.body] = body.to(w.device, w.dtype)
        return w

    def plan(self, state: dict, rnd: int, clients: np.ndarray) -> Plan:
        return Plan(clients, self._rows(state, len(clients)))

    def client_update(self, plan: Plan, trainer, rnd: int, cstate: dict) -> Update:
        S, hp = plan.clients, self.hp
        w = self._with_body(cstate["w"], plan.payload["body"])
        extras = {"protos": plan.payload["protos"], "present": plan.payload["present"],
                  "lam": torch.full((len(S),), float(hp["lam"]))}

        def head_phase(w: torch.Tensor) -> torch.Tensor:
            if hp["head_epochs"] == 0:
                return w
            return trainer.train(TrainJob(S, w, mask=self.mask_head, epochs=hp["head_epochs"], stream="head"),
                                 rnd).params

        if hp["order"] == "head_first":
            w = head_phase(w)
        t = trainer.train(TrainJob(S, w, loss=prototype_loss, extras=extras, mask=self.mask_body), rnd)
        w = t.params
        protos, counts = local_prototypes(trainer, S, w, self.ctx.num_classes, self.ctx, rnd)   # body only
        if hp["order"] == "body_first":
            w = head_phase(w)
        return Update(S, {"body": w[:, self.body].clone(), "protos": protos, "counts": counts}, t.n_samples,
                      {"train_loss": t.loss}, client_state={"w": w})

    def aggregate(self, state: dict, rnd: int, update: Update) -> dict:
        avg = self.server.average(update.payload["body"], client_weights(update), update.sent.get("body"))
        self.server.update(state, "body", avg)
        update_prototypes(state, update, self.hp["proto_weighting"], self.hp["aggregate_over"])
        return {}

    def eval_payload(self, state: dict, clients: np.ndarray) -> dict:
        return {"body": state["body"].expand(len(clients), -1)}

    def inference(self, trainer, clients, payload: dict, cstate: dict) -> Inference:
        return Inference({"model": self._with_body(cstate["w"], payload["body"])})
