"""LG-FedAvg (Liang, Liu, Ziyin, Allen, Auerbach, Brent, Salakhutdinov, Morency 2020, "Think Locally, Act
Globally: Federated Learning with Local and Global Representations", arXiv:2001.01523): each device keeps
its own lower layers (a local representation theta^l_m), the server averages the top layers (the global
model theta^g) with FedAvg.

    device m (sampled in round t):  (theta^l_m, theta^g_m) <- E epochs of SGD on the supervised loss of
                                    theta^g o theta^l_m, from (its own theta^l_m, the received theta^g_t),
                                    both parts jointly; keep theta^l_m, upload theta^g_m
    server (FedAvg on theta^g):     theta^g_{t+1} = sum_{m in S_t} (n_m / N_t) theta^g_m    (`weighting`)
    inference of device m:          theta^g_{t+1} o theta^l_m

It is FedPer's pattern with the split turned over: FedPer shares the lower layers and keeps the top ones,
LG-FedAvg shares the top layers and keeps the lower ones (`fedprism.algorithms.partial`: server state,
payloads, client state, inference).

Parameters (`lg_fedavg.<name>`):
* `shared` = which layers the server averages: `head` (default) is the model's declared classifier head
  (`ParamSpec.head`, one linear layer for every built-in model); an integer k is the top k layers with
  parameters, BatchNorm layers not counted (FedPer's count, `fedper.personal_slice`), and k = the number
  of layers shares everything (FedAvg bit for bit, tested); k = 0 is refused (nothing would be shared).
  The paper leaves the split to the model; the authors' scripts (pliang279/LG-FedAvg,
  scripts/main_lg_mnist.sh: `--num_layers_keep 3`) make the top three of their MLP's five layers global;
  the FedBABU authors' LG-FedAvg baseline (jhoon-oh/FedBABU, main_lg.py, `w_glob_keys`) and PFLlib
  (TsingZ0/PFLlib, system/flcore/clients/clientlg.py, `set_parameters`) share exactly the final linear
  layer. Hence the default: the built-in models are small, and the head is the one split every model has.
* `weighting` = `samples` (n_m / N_t, as FedAvg here) or `uniform` (1/|S_t|, the authors' code:
  main_lg.py divides the sum of the uploads by the number of sampled devices). On the FedPrism
  protocol's equal-size clients both are the same.

Decisions where the paper is silent or its code differs:
* No warm start: the authors' runs start LG-FedAvg from a model FedAvg trained first (main_lg.py,
  `--load_fed`), here it starts from the run's initial model like every other method; a warm start is a
  FedAvg run followed by this one, not part of the method.
* Local objective: the experiment's supervised loss on the whole model (the paper's supervised variant;
  its unsupervised and fair local-representation objectives are not implemented), with the experiment's
  optimiser and epochs (the FedPrism protocol: SGD lr 0.01, momentum 0.9, E = 10, B = 32), a fresh
  optimiser state each round, on the default 'train' stream, so that sharing everything is FedAvg bit
  for bit (tested).
* Selection of the best local models: the authors' code keeps, for each device, the best model on its
  test split seen so far (main_lg.py, `best_net_list`); that selects on test data and is not done: every
  client predicts with its last local layers and the current global layers.
* A client's local layers start as the run's initial model's and change only when it trains; a client
  never sampled predicts with the initial lower layers under the current global layers. The whole vector
  of the client's last local model is its client state (only its local coordinates are read, see
  `partial`); no local coordinate is in any payload or counted in bytes.
"""

from __future__ import annotations

import torch

from fedprism.algorithms.base import register
from fedprism.algorithms.fedper import LayersOrHead, personal_slice
from fedprism.algorithms.partial import WEIGHTING, PartialSharing
from fedprism.errors import ConfigError

SHARED = LayersOrHead("head", "layers the server averages: head (the model's classifier head) or the top k "
                      "layers (BatchNorm layers not counted; all of them = FedAvg)",
                      allowed="'head' or an integer >= 1 (the number of global layers)")


@register
class LGFedAvg(PartialSharing):
    name = "lg_fedavg"
    paper = "Liang, Liu, Ziyin, Allen, Auerbach, Brent, Salakhutdinov, Morency 2020, arXiv:2001.01523"
    params = {"shared": SHARED, "weighting": WEIGHTING}

    @classmethod
    def check_params(cls, hp: dict) -> None:
        if hp["shared"] == 0:
            raise ConfigError(f"{cls.name}.shared", 0, SHARED.allowed)

    def shared_mask(self) -> torch.Tensor:
        keep = torch.zeros(self.ctx.spec.size, dtype=torch.bool)
        keep[personal_slice(self.ctx.spec, self.hp["shared"], f"{self.name}.shared")] = True   # the top
        return keep
