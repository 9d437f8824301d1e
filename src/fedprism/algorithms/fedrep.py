"""FedRep (Collins, Hassani, Mokhtari, Shakkottai 2021, "Exploiting Shared Representations for Personalized
Federated Learning", arXiv:2102.07078, Algorithm 1): a shared representation phi, learned by all clients,
and a local head h_i per client, the objective  min_phi (1/n) sum_i min_{h_i} f_i(h_i o phi)  (the paper's
problem (2)).

Round t (Algorithm 1), for every sampled client i:

    h_i <- tau_h epochs of SGD on f_i(h, phi^t) in h, phi^t frozen        (head phase, from i's own h_i)
    phi_i <- tau epochs of SGD on f_i(h_i, phi) in phi, h_i frozen        (body phase, from phi^t)
    keep h_i; upload phi_i
    server:  phi^{t+1} = sum_{i in S_t} (n_i / N_t) phi_i                  (`weighting`; see below)
    inference of client i: h_i o phi^{t+1}

The head is the model's declared classifier head (`ParamSpec.head`); the representation is the body
(`ParamSpec.body`). `fedrep.personal` takes FedPer's values (`fedprism.algorithms.fedper`) for other
splits. The two phases are two `TrainJob`s with complementary masks (masked coordinates get no gradient
and no weight decay, so they stay bit-identical: tested) on two named random streams, 'fedrep_head'
and 'fedrep_body', so the two phases see independent batch orders.

Defaults (`fedrep.<name>`):
* `head_epochs` = 10, `body_epochs` = 1: the authors' CIFAR-10 script (lgcollins/FedRep,
  scripts/FedRep_cifar10_2shards.sh: `--local_ep 11 --local_rep_ep 1`, i.e. 10 head epochs then 1
  representation epoch; models/Update.py trains the head first). These replace the experiment's
  `local_epochs` for FedRep: 11 passes over the local data per round against E = 10 for the other
  methods of the FedPrism protocol, as in the authors' comparison (their FedAvg runs 1 local epoch).
* `personal` = head (the final linear layer: the authors' `w_glob_keys` keep every other layer global).
* `weighting` = samples (n_i / N_t, as FedAvg here). Algorithm 1 averages uniformly (1/|S_t|), the
  authors' code weights by n_i; on the FedPrism protocol's equal-size clients both are the same, and
  `weighting=uniform` gives the paper's mean everywhere.

Decisions where the paper is silent or its code differs:
* Optimiser: the experiment's (the FedPrism protocol: SGD lr 0.01, momentum 0.9, B = 32), with fresh
  state for each phase. The authors' code keeps one SGD (momentum 0.5, weight decay 1e-4) across both
  phases, so the head's momentum from the head phase leaks into the body phase; here the head is
  exactly frozen in the body phase and the body exactly in the head phase.
* `train_loss` is the mean training loss over both phases (epoch-weighted: every epoch sees each
  sample once).
* A client's head starts as the run's initial model's head and changes only when it trains; a client
  never sampled predicts with the initial head on the current representation. The whole vector of the
  client's last local model is its client state (only the head is read, see `partial`); the head is in
  no payload and never counts in bytes.
"""

from __future__ import annotations

import numpy as np
import torch

from fedprism.algorithms.base import TrainJob, register
from fedprism.algorithms.fedper import PERSONAL, FedPer
from fedprism.algorithms.partial import WEIGHTING
from fedprism.errors import ConfigError
from fedprism.hparams import Param
from fedprism.protocol import Trained


@register
class FedRep(FedPer):
    name = "fedrep"
    paper = "Collins, Hassani, Mokhtari, Shakkottai 2021, arXiv:2102.07078, Algorithm 1"
    params = {
        "head_epochs": Param(10, "tau_h: epochs on the head with the body frozen (first)", lambda v: v >= 0,
                             "an integer >= 0"),
        "body_epochs": Param(1, "tau: epochs on the body with the head frozen (second)", lambda v: v >= 0,
                             "an integer >= 0"),
        "personal": PERSONAL,
        "weighting": WEIGHTING,
    }

    @classmethod
    def check_params(cls, hp: dict) -> None:
        if hp["head_epochs"] + hp["body_epochs"] == 0:
            raise ConfigError("fedrep.body_epochs", hp["body_epochs"], "head_epochs + body_epochs > 0")

    def local_training(self, clients: np.ndarray, start: torch.Tensor, trainer, rnd: int) -> Trained:
        phases = [(self.mask_private, self.hp["head_epochs"], "fedrep_head"),    # h_i, phi^t frozen
                  (self.mask_shared, self.hp["body_epochs"], "fedrep_body")]     # phi, h_i frozen
        w, loss, seen, t = start, torch.zeros(len(clients), dtype=torch.float64), 0, None
        for mask, epochs, stream in phases:
            if epochs:
                t = trainer.train(TrainJob(clients, w, mask=mask, epochs=epochs, stream=stream), rnd)
                w, loss, seen = t.params, loss + epochs * t.loss, seen + epochs
        return Trained(clients, w, t.n_samples, loss / seen)      # check_params: at least one phase runs
