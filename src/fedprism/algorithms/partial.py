"""Partial sharing: the server averages some coordinates of the parameter vector, each client keeps the rest.

FedPer and FedRep (the personal layers stay on the client), LG-FedAvg (the lower layers stay), FedBN (the
BatchNorm layers stay) and FedBABU (the head is frozen, so only the body is shared) are one pattern with a
different split and a different local training; `PartialSharing` is that pattern, and each method module
sets the split and its local training:

    server state   s = the shared coordinates; the other coordinates never reach the server
    plan           every sampled client receives s                               (payload 'shared')
    client k       start = its own model with the shared coordinates replaced by s
                   w_k = local training from start (the method's `local_training`)
                   keeps w_k (client state 'local', never sent), uploads w_k's shared coordinates
    aggregate      s <- sum_k n_k s_k / sum_k n_k over the accepted uploads (`weighting=uniform`: the
                   1/|S_t| mean; `aggregation`: a robust rule), then the `server_opt` step on s
                   (the shared server step, `aggregation.ServerStep`); a round without uploads leaves s
                   bit-identical (the runner does not call `aggregate` then)
    inference      client k predicts with its own model, shared coordinates replaced by the current s

Decisions:
* The client state is the client's whole last model ([P], starting as the run's initial model), not
  only its private coordinates: declared client state starts from the model, from zeros or from a
  constant, and the private coordinates must start from the initial model. Only the private
  coordinates of that row are ever read: the shared ones are overwritten by s on every use.
* A client that is not sampled keeps its row bit-identical (the runner writes only returned rows).
* Evaluation sends s (`eval_payload`) and the client fills in its own coordinates (`inference`), so
  evaluation traffic has the training payload's shape and no private coordinate travels either way.
"""

from __future__ import annotations

import numpy as np
import torch

from fedprism.algorithms.aggregation import WEIGHTINGS, client_weights
from fedprism.algorithms.base import Algorithm, ClientState, Inference, Plan, TensorSpec, TrainJob, Update
from fedprism.hparams import Param
from fedprism.protocol import Trained

WEIGHTING = Param("samples", "aggregation weights: n_k (samples, FedAvg) or 1/|S_t| (uniform)",
                  choices=WEIGHTINGS)


class PartialSharing(Algorithm):
    """Base of FedPer, FedRep, FedBN, LG-FedAvg and FedBABU (not registered itself). Subclasses set
    `shared_mask()`."""

    client_state = {"local": ClientState(("P",), init="model")}
    averages = ("shared",)        # the robust rule and the server optimiser act on s (`self.server`)

    def __init__(self, ctx, **hp):
        super().__init__(ctx, **hp)
        keep = self.shared_mask()
        self.shared = torch.nonzero(keep).flatten()                 # indices of the averaged coordinates
        self.mask_shared = keep.to(torch.float32)                   # [P] 1 on shared coordinates
        self.mask_private = 1.0 - self.mask_shared                  # [P] 1 on the client's own coordinates

    def shared_mask(self) -> torch.Tensor:
        """[P] bool: True where the server averages the coordinate."""
        raise NotImplementedError

    # -- helpers -----------------------------------------------------------------------------------------
    def merge(self, local: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
        """[n, P]: the clients' own rows with the shared coordinates replaced by `shared` [n, S]."""
        return local.to(shared.device).index_copy(1, self.shared.to(shared.device), shared.to(local.dtype))

    def take(self, params: torch.Tensor) -> torch.Tensor:
        """[n, S]: the shared coordinates of [n, P] rows."""
        return params.index_select(1, self.shared.to(params.device))

    def local_training(self, clients: np.ndarray, start: torch.Tensor, trainer, rnd: int) -> Trained:
        """Default: the whole model trains for the experiment's epochs, as in FedAvg."""
        return trainer.train(TrainJob(clients, start), rnd)

    # -- the round ---------------------------------------------------------------------------------------
    def upload(self) -> dict:
        return {"shared": TensorSpec((len(self.shared),))}

    def init_state(self) -> dict:
        return {"shared": self.ctx.init[self.shared].clone()}

    def plan(self, state: dict, rnd: int, clients: np.ndarray) -> Plan:
        return Plan(clients, {"shared": state["shared"].expand(len(clients), -1).clone()})

    def client_update(self, plan: Plan, trainer, rnd: int, cstate: dict) -> Update:
        start = self.merge(cstate["local"], plan.payload["shared"])
        t = self.local_training(plan.clients, start, trainer, rnd)
        return Update(plan.clients, {"shared": self.take(t.params)}, t.n_samples, {"train_loss": t.loss},
                      client_state={"local": t.params})

    def aggregate(self, state: dict, rnd: int, update: Update) -> dict:
        w = client_weights(update, self.hp["weighting"])
        avg = self.server.average(update.payload["shared"], w, update.sent.get("shared"))
        self.server.update(state, "shared", avg)
        return {}

    def eval_payload(self, state: dict, clients: np.ndarray) -> dict:
        return {"shared": state["shared"].expand(len(clients), -1)}

    def inference(self, trainer, clients, payload: dict, cstate: dict) -> Inference:
        return Inference({"model": self.merge(cstate["local"], payload["shared"])})
