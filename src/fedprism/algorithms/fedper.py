"""FedPer (Arivazhagan, Aggarwal, Singh, Choudhary 2019, "Federated Learning with Personalization Layers",
arXiv:1912.00818): base layers shared through FedAvg, personalization layers kept by each client.

The model is split into base layers W_B (shared) and personalization layers W_P (client j's own W_Pj):

    client j (sampled in round t):  (W_B, W_Pj) <- E epochs of SGD on (W_B^t, W_Pj), both parts jointly
                                    keep W_Pj; upload W_B
    server (FedAvg on W_B):         W_B^{t+1} = sum_{j in S_t} (n_j / N_t) W_B,j,   N_t = sum_{j in S_t} n_j
    inference of client j:          (W_B^{t+1}, W_Pj)

(`fedprism.algorithms.partial` is this pattern: server state, payloads, client state, inference.)

Parameters (`fedper.<name>`):
* `personal` = which layers stay on the client: `head` (default) is the model's declared classifier head
  (`ParamSpec.head`, one linear layer for every built-in model); an integer k is the last k layers with
  parameters, not counting BatchNorm layers (a BatchNorm layer after the first personal layer is
  personal with it), and k = 0 shares everything. The FedPrism paper cites FedPer but does not run it
  and gives no split; Arivazhagan et al. compare several numbers of personalization layers and fix none
  for other models; the FedRep authors' code (lgcollins/FedRep, main_fedrep.py, `w_glob_keys`) keeps
  exactly the final linear layer local for FedPer and for FedRep. Hence the default.
* `weighting` = `samples` (n_j / N_t, as FedAvg here) or `uniform` (1/|S_t|).

Decisions where the paper is silent:
* Local training: the experiment's loss, optimiser and epochs (the FedPrism protocol: SGD lr 0.01,
  momentum 0.9, E = 10, B = 32), a fresh optimiser state each round, on the default 'train' stream,
  so that `personal=0` is FedAvg bit for bit (tested).
* A client's personalization layers start as the run's initial model's and change only when it trains.
  A client never sampled predicts with the initial head on the current base.
* The whole parameter vector of the client's last local model is its client state (only its personal
  coordinates are read; see `partial`); nothing of the personal layers is in any payload, so they never
  count in bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedprism.algorithms.base import register
from fedprism.algorithms.partial import WEIGHTING, PartialSharing
from fedprism.errors import ConfigError
from fedprism.hparams import Param
from fedprism.params import ParamSpec


@dataclass(frozen=True)
class LayersOrHead(Param):
    """'head' or a number of layers k >= 0."""

    def validate(self, key, value):
        if value == "head":
            return value
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(key, value, self.allowed)
        return value


PERSONAL = LayersOrHead("head", "layers kept by the client: head (the model's classifier head) or the last k "
                        "layers (BatchNorm layers not counted; 0 = share everything)",
                        allowed="'head' or an integer >= 0 (the number of personal layers)")


def personal_slice(spec: ParamSpec, personal: str | int, key: str = "personal") -> slice:
    """The slice of the personal layers: the head, or the last k layers that are not BatchNorm layers
    together with everything after the first of them."""
    if personal == "head":
        return spec.head
    if personal == 0:
        return slice(spec.size, spec.size)
    bn = {(s.start, s.stop) for s in spec.batchnorm}
    layers = [s for _, s in spec.layers if (s.start, s.stop) not in bn]
    if personal > len(layers):
        raise ConfigError(key, personal, f"at most {len(layers)} (the model's layers, BatchNorm not counted)")
    return slice(layers[-personal].start, spec.size)


@register
class FedPer(PartialSharing):
    name = "fedper"
    paper = "Arivazhagan, Aggarwal, Singh, Choudhary 2019, arXiv:1912.00818"
    params = {"personal": PERSONAL, "weighting": WEIGHTING}

    def shared_mask(self) -> torch.Tensor:
        keep = torch.ones(self.ctx.spec.size, dtype=torch.bool)
        keep[personal_slice(self.ctx.spec, self.hp["personal"], f"{self.name}.personal")] = False
        return keep
