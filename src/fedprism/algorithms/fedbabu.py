"""FedBABU (Oh, Kim, Yun 2022, "FedBABU: Towards Enhanced Representation for Federated Image
Classification", ICLR 2022, arXiv:2106.06042): federated training updates and averages only the body;
the head stays at its random initialisation, shared by every client; each client personalises by
fine-tuning the global model on its own data before it predicts.

The model is a body theta_ext (`ParamSpec.body`) and a head theta_cls (`ParamSpec.head`, the final
linear layer), theta_cls = theta_cls^0 for the whole of federated training:

    client k (sampled in round t):  theta_ext,k <- E epochs of SGD on (theta_ext^t, theta_cls^0) in the
                                    body, the head frozen; upload theta_ext,k
    server (FedAvg on the body):    theta_ext^{t+1} = sum_{k in S_t} (n_k / N_t) theta_ext,k     (`weighting`)
    evaluation of client k:         theta_k <- tau epochs of SGD on its training data from
                                    (theta_ext^{t+1}, theta_cls^0), the whole model (`finetune=full`) or
                                    the head alone (`finetune=head`); predict with theta_k

The global model (theta_ext^{t+1}, theta_cls^0) is also scored on the same samples, stored as the
alternative prediction `global` (`<split>_acc@global`): the un-fine-tuned global model.

Parameters (`fedbabu.<name>`; `finetune_epochs` and `finetune` change only evaluation, `eval_only`):
* `finetune_epochs` = tau = 5: the authors' personalisation code (jhoon-oh/FedBABU, analysis.ipynb,
  `personalization_epoch = 5`; utils/options.py, `--ft_ep`, default 5). 0 predicts with the global
  model, exactly (tested).
* `finetune` = `full` (default) or `head` (the body frozen). The abstract speaks of fine-tuning the head;
  the authors' personalisation code (analysis.ipynb) fine-tunes body and head together, at one learning
  rate, and so does the default.
* `weighting` = samples (n_k / N_t, as FedAvg here) or uniform (1/|S_t|). The authors' code adds the
  bodies and divides by the number of sampled clients; on the FedPrism protocol's equal-size clients
  both are the same.

Decisions where the paper is silent or its code differs:
* The head is frozen by `TrainJob(mask=body)`: it gets no gradient and no weight decay and stays
  bit-identical to the initial head (tested); the authors' code sets the head's learning rate to 0
  (models/Update.py), which is the same with their weight decay 0. Since every client knows theta_cls^0
  (the run's initial model), the head is never sent: plan, upload and evaluation payload are the body.
  No client state is kept: a client's model is (received body, initial head).
* Fine-tuning optimiser: the experiment's (the FedPrism protocol: SGD lr 0.01, momentum 0.9, B = 32),
  fresh state. The authors fine-tune at lr 1e-3 after training at lr 0.1, momentum 0.9, no weight
  decay; a `TrainJob` has no learning rate of its own, so fine-tuning uses the training learning rate.
* Fine-tuning round: `inference` gets no round number, and the model it builds must depend only on
  what the client received (the evaluator may build it block by block, a re-scored run and a Flower
  node must build the same one). So the batch order is the 'finetune' stream of round
  `FINETUNE_ROUND` = 0 at every evaluation: a pure function of (seed, client), independent of the
  training streams (another name), and the same fine-tuning from the same body gives the same model.
* The fine-tuned model is thrown away after the evaluation (the paper personalises once, from the
  final global model); the next evaluation fine-tunes the new global model again. Every evaluation
  therefore costs tau local epochs on every evaluated client.
* The authors evaluate the best global model over rounds (selected on test accuracy); here the model of
  the evaluated round.
"""

from __future__ import annotations

import numpy as np
import torch

from fedprism.algorithms.base import Inference, TrainJob, Update, register
from fedprism.algorithms.partial import WEIGHTING, PartialSharing
from fedprism.hparams import Param

FINETUNE_ROUND = 0          # the round of the fine-tuning stream (see the module docstring)


def _global(logits: dict, extras: dict) -> torch.Tensor:
    return logits["global"]


@register
class FedBABU(PartialSharing):
    name = "fedbabu"
    paper = "Oh, Kim, Yun 2022, ICLR 2022, arXiv:2106.06042"
    client_state = {}                       # the head is the initial model's: nothing of its own to keep
    predictions = {"global": "global model, not fine-tuned"}
    params = {
        "finetune_epochs": Param(5, "tau: epochs of fine-tuning from the global model before predicting "
                                 "(0: the global model)", lambda v: v >= 0, "an integer >= 0",
                                 eval_only=True),
        "finetune": Param("full", "what fine-tuning trains: full (body and head) or head (body frozen)",
                          choices=("full", "head"), eval_only=True),
        "weighting": WEIGHTING,
    }

    @classmethod
    def headline(cls, config: dict) -> str:
        tau = config.get(f"{cls.name}.finetune_epochs", 5)
        what = config.get(f"{cls.name}.finetune", "full")
        return f"fine-tuned ({what}, {tau} epochs)" if tau else "global model"

    def shared_mask(self) -> torch.Tensor:
        keep = torch.ones(self.ctx.spec.size, dtype=torch.bool)
        keep[self.ctx.spec.head] = False                                 # the body is averaged
        return keep

    def global_model(self, body: torch.Tensor) -> torch.Tensor:
        """[n, P]: the received bodies [n, S] under the initial head."""
        return self.merge(self.ctx.init.expand(len(body), -1), body)

    def client_update(self, plan, trainer, rnd: int, cstate: dict) -> Update:
        S = plan.clients
        t = trainer.train(TrainJob(S, self.global_model(plan.payload["shared"]), mask=self.mask_shared), rnd)
        return Update(S, {"shared": self.take(t.params)}, t.n_samples, {"train_loss": t.loss})

    def inference(self, trainer, clients: np.ndarray, payload: dict, cstate: dict) -> Inference:
        w = self.global_model(payload["shared"])
        tau = self.hp["finetune_epochs"]
        if tau == 0:
            return Inference({"global": w})
        mask = None if self.hp["finetune"] == "full" else self.mask_private
        ft = trainer.train(TrainJob(clients, w, mask=mask, epochs=tau, stream="finetune"), FINETUNE_ROUND)
        return Inference({"finetuned": ft.params, "global": w}, alternatives={"global": _global})
