"""SCAFFOLD (Karimireddy, Kale, Mohri, Reddi, Stich, Suresh 2020, "SCAFFOLD: Stochastic Controlled Averaging
for Federated Learning", ICML 2020, arXiv:1910.06378), Algorithm 1.

The server keeps the model x and the control variate c; each client i keeps its control variate c_i (client
state, never sent). Round t, on the sampled clients S of the N clients, with the equations numbered here:

    (1)  y_i  <- y_i - eta (g_i(y_i) + c - c_i)            K_i local steps from y_i = x (learning rate eta)
    (2)  c_i+  = g_i(x)                                   option I: the local gradient at the server model
    (2') c_i+  = c_i - c + (x - y_i) / (K_i eta)          option II: from the local steps' displacement
    (3)  Delta x_i = y_i - x,   Delta c_i = c_i+ - c_i     sent to the server; the client keeps c_i <- c_i+
    (4)  x   <- x + eta_g (1/|S|) sum_{i in S} Delta x_i  global step size eta_g
    (5)  c   <- c + (|S|/N) (1/|S|) sum_{i in S} Delta c_i = c + (1/N) sum_{i in S} Delta c_i

c - c_i estimates the difference between the global and the client's gradient, so (1) follows the global
objective's direction on every client (the client drift FedAvg suffers from non-i.i.d. data). With c and
every c_i zero (the start) and before any correction, (1) is FedAvg's local training; (4) with eta_g = 1
is FedAvg's uniform average.

Decisions where the paper is silent or this protocol differs:

* The correction c - c_i enters (1) as the gradient of the linear term <y, c - c_i> added to the
  experiment's cross-entropy (`corrected_ce`), so it goes through the experiment's optimiser with the
  gradient: with SGD momentum or weight decay it is treated as a gradient term (the paper has plain SGD).
  The term is written (y - stop_gradient(y)) . (c - c_i): its value is an exact zero, so the training loss
  the run records is the plain cross-entropy of the iterates, and its gradient is c - c_i exactly.
* SGD only: `optimizer=adam` is a ConfigError. Adam rescales every coordinate of the corrected gradient,
  so (1) is no longer a corrected SGD step, and option II's displacement no estimate of the gradient.
* Option II with momentum (a generalisation; the paper has rho = 0): K_i in (2') is replaced by
  a(K_i, rho) = [K_i - rho (1 - rho^K_i) / (1 - rho)] / (1 - rho), the sum of the coefficients with which
  a constant gradient moves y_i over K_i steps of SGD with momentum rho (FedNova's a_i,
  `fednova.effective_steps`; Wang et al. 2020, arXiv:2007.07481). Dividing by K_i alone would make c_i
  about 1 / (1 - rho) times the gradient (10 x at the default momentum 0.9) and over-correct (1) by that
  factor. rho = 0 gives K_i, the paper's (2').
* K_i is the number of steps the client took (`Trained.steps`: epochs x ceil(n_i / B)), so clients of
  unequal size have their own K_i. Under option II a client that took no step (epochs 0) keeps its c_i.
* Option I: g_i(x) is the gradient at x of the client's mean cross-entropy over all its training
  samples, the "additional pass over the local data" the paper describes, computed before the local
  training with the model without dropout noise (`trainer.f`), in chunks of the batch size (the sum of the
  per-sample losses over n_i, so the chunking changes nothing but rounding). Weight decay is the
  optimiser's, the same for every client, and is not part of f_i. A client without training samples
  has g_i = 0.
* Names: the server state holds x as `w` and c as `c`; the client state holds c_i as `c_i` (a name of its
  own: client state never shares a name with the server state).
* The control variates start at zero (c = c_i = 0, the paper's experiments). c is kept in float64 on the
  server (it accumulates over rounds) and sent as float32; c_i is a float32 row, computed in float64.
  Only clients whose reply was accepted enter (4) and (5) (a failed client keeps its c_i), so
  c = (1/N) sum_i c_i holds at every round, up to rounding.
* (4) goes through the shared server step (`averages = ("w",)`): `scaffold.weighting=uniform` (default) is
  the paper's 1/|S|, `samples` weighs by n_i; `scaffold.aggregation` replaces the mean of the y_i by a
  robust rule. eta_g is `scaffold.global_lr` (default 1): the server forms x + eta_g (mean - x), written as
  mean + (eta_g - 1)(mean - x) so that eta_g = 1 is the mean itself, FedAvg's round bit for bit; a
  `scaffold.server_opt` other than `none` then takes that point as the average (Delta = eta_g Delta x).
  (5) is the printed sum over every accepted client, whatever the rule.
* Default `option=II`: the paper notes that option I may be more stable but option II is cheaper and
  usually suffices, and uses option II in all its experiments. Default eta_g = 1: the server takes the
  plain mean of the y_i (FedAvg's server step).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from fedprism.algorithms.aggregation import WEIGHTINGS, client_weights
from fedprism.algorithms.base import Algorithm, ClientState, Plan, TensorSpec, TrainJob, Update, register, sgd_settings
from fedprism.algorithms.fednova import effective_steps
from fedprism.hparams import Param
from fedprism.objectives import ce


def corrected_ce(f, w, x, y, weight, extras):
    """(1)'s objective: cross-entropy + (w - stop_gradient(w)) . (c - c_i). The added term is an exact zero
    (so the value is the cross-entropy), its gradient is c - c_i (vmap-safe)."""
    return ce(f, w, x, y, weight, extras) + ((w - w.detach()) * extras["correction"]).sum()


def option_one(f, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, chunk: int) -> torch.Tensor:
    """(2): g_i(w), the gradient of (1/n) sum_j CE(f(w, x_j), y_j) over all n samples, float32 [P], one pass in
    chunks of `chunk` samples, accumulated in float64 (zeros when n = 0)."""
    n = len(y)
    out = torch.zeros(w.shape, dtype=torch.float64, device=w.device)
    if n == 0:
        return out.to(w.dtype)
    v = w.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        for s in range(0, n, chunk):
            loss = F.cross_entropy(f(v, x[s:s + chunk]), y[s:s + chunk], reduction="sum") / n
            (g,) = torch.autograd.grad(loss, v)
            out += g.double()
    return out.to(w.dtype)


def option_two(c_i: torch.Tensor, c: torch.Tensor, x: torch.Tensor, y: torch.Tensor, steps: torch.Tensor,
               lr: float, momentum: float = 0.0) -> torch.Tensor:
    """(2'): c_i - c + (x - y_i) / (a(K_i, rho) lr), row by row, in float64, returned in c_i's dtype; a(K, 0) =
    K (the paper), a(K, rho) FedNova's effective steps for momentum rho. Rows with K_i = 0 keep c_i."""
    a = effective_steps(steps, momentum).unsqueeze(1)
    live = steps.unsqueeze(1) > 0
    new = c_i.double() - c.double() + (x.double() - y.double()) / (torch.where(live, a, torch.ones_like(a)) * lr)
    return torch.where(live, new, c_i.double()).to(c_i.dtype)


def server_model(avg: torch.Tensor, x: torch.Tensor, global_lr: float) -> torch.Tensor:
    """(4): x + eta_g (avg - x), float64, written avg + (eta_g - 1)(avg - x): at eta_g = 1 it adds an exact
    zero, so the result is avg bit for bit."""
    avg = avg.to(torch.float64)
    return avg + (global_lr - 1.0) * (avg - x.to(torch.float64))


def server_variate(c: torch.Tensor, delta_c: torch.Tensor, num_clients: int) -> torch.Tensor:
    """(5): c + (1/N) sum_{i in S} Delta c_i, float64 [P]."""
    return c.to(torch.float64) + delta_c.to(torch.float64).sum(0) / num_clients


@register
class Scaffold(Algorithm):
    name = "scaffold"
    paper = "Karimireddy et al. 2020, arXiv:1910.06378"
    personalized = False
    averages = ("w",)
    client_state = {"c_i": ClientState(("P",), init="zeros")}
    params = {
        "option": Param("II", "control-variate update: I (c_i = the local gradient at x, one more pass over the "
                        "data) or II (c_i - c + (x - y_i) / (K eta), no extra pass)", choices=("I", "II")),
        "global_lr": Param(1.0, "eta_g: x <- x + eta_g (mean of the y_i - x) (1: the mean)",
                           lambda v: v > 0 and math.isfinite(v), "a finite number > 0"),
        "weighting": Param("uniform", "weights of the mean of the y_i: 1/|S| (uniform, the paper) or n_i (samples)",
                           choices=WEIGHTINGS),
    }

    def __init__(self, ctx, **hp):
        super().__init__(ctx, **hp)
        sgd_settings(ctx, self.name, "SCAFFOLD corrects SGD steps by c - c_i, and option II estimates the "
                     "gradient from their displacement; Adam rescales both")

    def upload(self) -> dict[str, TensorSpec]:
        return {"params": TensorSpec(("P",)), "delta_c": TensorSpec(("P",))}

    def init_state(self) -> dict:
        return {"w": self.ctx.init.clone(), "c": torch.zeros(self.ctx.init.shape, dtype=torch.float64)}

    def plan(self, state: dict, rnd: int, clients: np.ndarray) -> Plan:
        n = len(clients)
        c = state["c"].to(self.ctx.init.dtype)
        return Plan(clients, {"params": state["w"].expand(n, -1).clone(), "c": c.expand(n, -1).clone()})

    def client_update(self, plan: Plan, trainer, rnd: int, cstate: dict) -> Update:
        """Option I's gradient at x (before training), then (1) from x, then (2) or (2'); upload (3)."""
        x, c = plan.start, plan.payload["c"]
        c_i = cstate["c_i"].to(x.device, x.dtype)
        if self.hp["option"] == "I":
            dev = trainer.device
            rows = []
            for k, client in enumerate(plan.clients):
                xs, ys = trainer.data(int(client), "train")
                rows.append(option_one(trainer.f, x[k].to(dev), xs.to(dev), ys.to(dev),
                                       self.ctx.train.batch_size).to(x.device))
            grads = torch.stack(rows) if rows else torch.zeros_like(x)
        job = TrainJob(plan.clients, x, loss=corrected_ce, extras={"correction": c - c_i})
        t = trainer.train(job, rnd)
        if self.hp["option"] == "I":
            c_new = grads
        else:
            s = self.ctx.train.for_job(job)
            c_new = option_two(c_i, c, x, t.params, t.steps.to(x.device), s.lr, s.momentum)
        return Update(t.clients, {"params": t.params, "delta_c": c_new - c_i}, t.n_samples,
                      {"train_loss": t.loss}, client_state={"c_i": c_new})

    def aggregate(self, state: dict, rnd: int, update: Update) -> dict:
        """(4) through the shared server step, (5)."""
        avg = self.server.average(update.params, client_weights(update, self.hp["weighting"]),
                                  update.sent.get("params"))
        self.server.update(state, "w", server_model(avg, state["w"], float(self.hp["global_lr"])))
        state["c"] = server_variate(state["c"], update.payload["delta_c"], self.ctx.num_clients)
        return {}

    def client_side_inference(self) -> bool:
        """The clients predict with the server's model: c_i only corrects training."""
        return False

    def model_for(self, state: dict, clients: np.ndarray) -> torch.Tensor:
        return state["w"].expand(len(clients), -1)
