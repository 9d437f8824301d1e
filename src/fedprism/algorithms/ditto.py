"""Ditto (Li, Hu, Beirami, Smith 2021, "Ditto: Fair and Robust Federated Learning Through
Personalization", ICML 2021, arXiv:2012.04387), Algorithm 1.

Two objectives: the global one, G(w) = sum_k p_k F_k(w) (FedAvg's), and for every client k the personal
one (Eq. 1, h_k)

    min_{v_k} h_k(v_k; w*) = F_k(v_k) + (lambda/2) ||v_k - w*||^2.

Round t of Algorithm 1, for each sampled client k:

    w_k^t <- UPDATE_GLOBAL(w^t): E local epochs of F_k from w^t                 (global phase, uploaded)
    v_k   <- s local iterations of  v_k - eta (grad F_k(v_k) + lambda (v_k - w^t))    (personal phase)
    server: w^{t+1} <- sum_{k in S_t} (n_k / N_t) w_k^t                       (FedAvg's aggregation)

Inference: each client predicts with its own v_k.

Decisions where the paper is silent or its code differs:

* Order of the two phases. Algorithm 1 lists the global update first and the personal one second; the
  authors' TensorFlow code (litian96/ditto, flearn/trainers_MTL/ditto.py) interleaves them minibatch
  by minibatch (a personal step, then a global step on the same batch); PFLlib runs the whole personal
  phase first. The personal phase is anchored at the received w^t (the frozen round-start
  model, not the client's moving global copy), so the two phases do not read each other's results
  and their order changes no number. They run global first, as listed.
* Random streams. The global phase trains from w^t on the default stream `train`, exactly as a FedAvg
  client does, so Ditto's global model is FedAvg's bit for bit at the same seed (tested). The personal
  phase has its own stream `ditto`: its batch order is independent of the global phase's (the
  authors' code shares each minibatch between the two updates; here they are two passes).
* Personal iterations s: the authors' code runs as many personal as global steps (the same
  `local_iters` for both); `ditto.personal_epochs` defaults to the experiment's E (local_epochs).
* v_k is declared client state (`ClientState(("P",), init="model")`): it starts at the run's initial
  model w^0, moves only when k is sampled, never travels (not in the upload, not in any message: the
  upload is the global-phase model alone, so bytes up equal FedAvg's) and survives checkpoints and
  Flower restarts. Evaluation sends nothing (the client already holds v_k); a never-sampled client
  predicts with w^0.
* The proximal term is the squared norm, written as a loss term (objective `prox`, anchor w^t), so it
  holds for the experiment's optimiser (SGD with momentum here, Adam with `optimizer=adam`); the
  optimiser state starts fresh in each phase.
* Aggregation: n_k-weighted mean of the participants (`weighting=samples`, FedAvg's); the authors'
  code samples clients with probability proportional to n_k and averages uniformly, which has the
  same expectation. `weighting=uniform` gives the 1/|S_t| mean.
* lambda = 1 by default: the value of the authors' Fashion-MNIST scripts (litian96/ditto,
  run_fashion_clean_ditto_lam1.sh: lam 1, 10 clients per round) and the value most often used after
  them (FedRep's code, lam_ditto = 1). lambda is fixed (the paper's
  optional per-client selection of lambda on validation data is not implemented).
* The global model w is also scored on the global test set every evaluation (`global_model_acc`).
"""

from __future__ import annotations

import numpy as np

from fedprism.algorithms.base import ClientState, Inference, Plan, TrainJob, Update, register
from fedprism.algorithms.fedavg import FedAvg
from fedprism.algorithms.fedprox import prox_job
from fedprism.hparams import Param


def _epochs_ok(v) -> bool:
    return v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0)


@register
class Ditto(FedAvg):
    name = "ditto"
    paper = "Li, Hu, Beirami, Smith 2021, arXiv:2012.04387"
    personalized = True
    client_state = {"v": ClientState(("P",), init="model")}
    params = {
        "lam": Param(1.0, "lambda: personal objective F_k(v) + (lambda/2)||v - w^t||^2", lambda v: v >= 0,
                     "a number >= 0"),
        "personal_epochs": Param(None, "epochs of the personal phase (unset: the experiment's local_epochs)",
                                 _epochs_ok, "an integer >= 0 (unset: local_epochs)"),
        "weighting": FedAvg.params["weighting"],
    }

    def client_update(self, plan: Plan, trainer, rnd: int, cstate: dict) -> Update:
        """Algorithm 1 for the cohort: the global phase (uploaded) and the personal phase (kept)."""
        S, w_t = plan.clients, plan.start
        glob = trainer.train(TrainJob(S, w_t), rnd)                                   # w_k^t, stream 'train'
        v = cstate["v"].to(w_t.device, w_t.dtype).clone()
        pers = trainer.train(prox_job(S, v, w_t, self.hp["lam"], epochs=self.hp["personal_epochs"],
                                      stream="ditto"), rnd)                           # v_k, anchor w^t
        return Update(S, {"params": glob.params}, glob.n_samples, {"train_loss": glob.loss},
                      client_state={"v": pers.params})

    # -- evaluation: each client predicts with its own v_k ------------------------------------------
    def eval_payload(self, state: dict, clients: np.ndarray) -> dict:
        return {}

    def inference(self, trainer, clients, payload: dict, cstate: dict) -> Inference:
        return Inference({"personal": cstate["v"]})

    def extra_models(self, state: dict) -> dict:
        return {"global": state["w"]}
