"""pFedMe (Dinh, Tran, Nguyen 2020, "Personalized Federated Learning with Moreau Envelopes", NeurIPS 2020,
arXiv:2006.08848), Algorithm 1.

Client i's personalised model is the proximal point of its loss f_i at the global model w:

    theta_hat_i(w) = argmin_theta  f_i(theta) + (lambda/2) ||theta - w||^2,
    F_i(w) = min_theta ...  (the Moreau envelope),   grad F_i(w) = lambda (w - theta_hat_i(w)).

Round t of Algorithm 1, for each sampled client i, from w_{i,0} = w^t, local steps r = 0, ..., R-1:

    sample a batch D;  theta~_i <- K steps of gradient descent (personal_lr) on
                                  h_i(theta; w_{i,r}, D) = f_i(theta; D) + (lambda/2) ||theta - w_{i,r}||^2
    w_{i,r+1} = w_{i,r} - eta lambda (w_{i,r} - theta~_i)          (eta: the experiment's `lr`)
    server:  w^{t+1} = (1 - beta) w^t + beta * mean_{i in S_t} w_{i,R}

Each local step is one step of the engine's optimiser on the loss `moreau_loss(K)`: it solves the inner
problem on the batch (`torch.func.grad`, from a detached copy of w) and returns
f(theta~; D) + (lambda/2) ||w - theta~||^2 with theta~ held fixed, whose gradient in w is
lambda (w - theta~), the estimate of grad F_i(w): plain SGD with lr eta is the update above. The
recorded `train_loss` is the mean of that value, the batch estimate of F_i(w_{i,r}).

Decisions where the paper is silent or its code differs:

* Local steps: R = one step per batch of the experiment's local_epochs epochs (batch_size = |D|).
* Inner solver start: every step starts theta from the current w_{i,r} (cold start). The authors' code
  (CharlieDinh/pFedMe, FLAlgorithms/users/userpFedMe.py) and PFLlib (TsingZ0/PFLlib,
  system/flcore/clients/clientpFedMe.py) keep theta across steps (it starts at w^t each round); an
  engine's loss has no state across batches. theta~ is computed as w + d, d the displacement from 0,
  so K = 1 and lambda = personal_lr = 1 make the gradient grad f_i(w; D) exactly: pFedMe is then
  FedAvg bit for bit (tested). The inner steps are plain gradient descent: no momentum, no weight
  decay (PFLlib's optimiser adds an L2 term mu = 0.001).
* The outer step is the experiment's optimiser on grad F_i: the paper's step for optimizer=sgd with
  momentum 0 and weight_decay 0; with the default momentum 0.9 it is heavy-ball SGD on F_i, with Adam Adam.
* Personalised model: Algorithm 1 does not say which theta is evaluated (the last step's theta~_i is
  the natural reading). In both codes the list theta~ aliases the model's parameters, which are then
  reset to the local w_{i,R} (FLAlgorithms/users/userbase.py and system/flcore/clients/clientbase.py,
  `update_parameters`), so what they evaluate is w_{i,R}. Here, after the local steps, the client
  solves the inner problem at its final w_{i,R}: `personal_epochs` epochs (default 1) of the
  experiment's optimiser on f_i(theta) + (lambda/2)||theta - w_{i,R}||^2 from w_{i,R} (objective `prox`,
  stream `pfedme`, as Ditto's personal phase; an engine's loss cannot hand back its theta~), and keeps
  theta_i as client state: it never travels, starts at w^0 and moves only when i is sampled.
  `personal_epochs=0` keeps w_{i,R}, what the codes evaluate. Each client predicts with its own
  theta_i; the global w is also scored on the global test set (`global_model_acc`). The authors'
  server trains every client every round (FLAlgorithms/servers/serverpFedMe.py) and averages only the
  sampled ones; here only sampled clients train.
* Aggregation: the paper's mean is uniform (1/S); the authors' code weights by n_i
  (FLAlgorithms/servers/serverbase.py, `persionalized_aggregate_parameters`). `weighting=samples` (the
  default, FedAvg's) or `uniform`; `aggregation` (robust rules) replaces the mean, then
  beta mixes it with w^t and `server_opt` steps from the mixed model. beta = 1 is FedAvg's server.
* Defaults lambda = 15, K = 5, personal_lr = 0.1, beta = 1: the authors' MNIST setting (its result file
  names, e.g. results/Mnist_pFedMe_0.005_1_15_5u_20b_20_5_0.1_avg.h5: eta 0.005, beta 1, lambda 15,
  K 5, personal lr 0.1). The inner solve costs K gradient evaluations per local step.
* Engines: the sequential engine and the vectorized engine (vmap over clients, the inner
  `torch.func.grad` nested under the outer one), eager or compiled, run the same loss and agree to
  float tolerance (tests/test_pfedme.py). Not tried: CUDA graphs of the step (on for compiled CUDA runs).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from fedprism.algorithms.aggregation import client_weights
from fedprism.algorithms.base import ClientState, Inference, Plan, TrainJob, Update, register
from fedprism.algorithms.fedavg import FedAvg
from fedprism.algorithms.fedprox import prox_job
from fedprism.hparams import Param
from fedprism.objectives import ce


@functools.lru_cache(maxsize=None)
def moreau_loss(k: int):
    """The loss of one local step with K = k inner steps (one function per k, so engines reuse their
    compiled steps). extras: `lam` and `personal_lr`, one number per client."""
    def loss(model, w, x, y, weight, extras):
        lam, plr = extras["lam"], extras["personal_lr"]
        anchor = w.detach()                                                  # w_{i,r}, held fixed

        def h(d):                                                            # h_i(w_{i,r} + d; w_{i,r}, D)
            return ce(model, anchor + d, x, y, weight, extras) + 0.5 * lam * (d * d).sum()

        d = torch.zeros_like(anchor)
        for _ in range(k):                                                   # theta~ = w_{i,r} + d
            d = d - plr * torch.func.grad(h)(d)
        d = d.detach()
        pull = (w - anchor) - d                                              # w - theta~, value -d
        return ce(model, anchor + d, x, y, weight, extras).detach() + 0.5 * lam * (pull * pull).sum()
    return loss


@register
class PFedMe(FedAvg):
    name = "pfedme"
    paper = "Dinh, Tran, Nguyen 2020, arXiv:2006.08848"
    personalized = True
    #: its local objective evaluates the model at other parameters than its own (the mixed model, the inner
    #: step, the inner problem): the fused training kernels cannot take it, so `train.kernels = auto` is aten
    #: here and `fused` is refused (`fedprism.kernels.fused.WithStem`)
    fused_training = False
    client_state = {"theta": ClientState(("P",), init="model")}
    params = {
        "lam": Param(15.0, "lambda: personal objective f_i(theta) + (lambda/2)||theta - w||^2",
                     lambda v: v > 0, "a number > 0"),
        "k": Param(5, "K: gradient steps of the inner solve per local step", lambda v: v >= 1,
                   "an integer >= 1"),
        "personal_lr": Param(0.1, "learning rate of the inner solve", lambda v: v > 0, "a number > 0"),
        "beta": Param(1.0, "server: w <- (1 - beta) w + beta * mean of the local models", lambda v: v > 0,
                      "a number > 0"),
        "personal_epochs": Param(1, "epochs of the final solve for theta_i at the local model (0: keep it)",
                                 lambda v: v >= 0, "an integer >= 0"),
        "weighting": FedAvg.params["weighting"],
    }

    def client_update(self, plan: Plan, trainer, rnd: int, cstate: dict) -> Update:
        """R local steps of Algorithm 1 from w^t (uploaded), then theta_i at w_{i,R} (kept)."""
        S, w_t, hp = plan.clients, plan.start, self.hp
        ex = {"lam": torch.full((len(S),), hp["lam"]),
              "personal_lr": torch.full((len(S),), hp["personal_lr"])}
        local = trainer.train(TrainJob(S, w_t, loss=moreau_loss(hp["k"]), extras=ex), rnd)        # w_{i,R}
        w_R = local.params
        theta = trainer.train(prox_job(S, w_R, w_R, hp["lam"], epochs=hp["personal_epochs"],
                                       stream="pfedme"), rnd)
        return Update(S, {"params": w_R}, local.n_samples, {"train_loss": local.loss},
                      client_state={"theta": theta.params})

    def aggregate(self, state: dict, rnd: int, update: Update) -> dict:
        """w^{t+1} = (1 - beta) w^t + beta * mean of the w_{i,R} (then the server optimiser, if any)."""
        avg = self.server.average(update.params, client_weights(update, self.hp["weighting"]),
                                  update.sent.get("params"))
        beta = self.hp["beta"]
        mixed = avg if beta == 1 else (1 - beta) * state["w"].to(torch.float64) + beta * avg
        self.server.update(state, "w", mixed)
        return {}

    # -- evaluation: each client predicts with its own theta_i -------------------------------------
    def eval_payload(self, state: dict, clients: np.ndarray) -> dict:
        return {}

    def inference(self, trainer, clients, payload: dict, cstate: dict) -> Inference:
        return Inference({"personal": cstate["theta"]})

    def extra_models(self, state: dict) -> dict:
        return {"global": state["w"]}
