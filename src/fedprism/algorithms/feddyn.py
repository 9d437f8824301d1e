"""FedDyn (Acar, Zhao, Matas Navarro, Mattina, Whatmough, Saligrama 2021, "Federated Learning Based on
Dynamic Regularization", ICLR 2021, arXiv:2111.04263), Algorithm 1.

m clients; P_t the clients active in round t. The server keeps the model theta^{t-1} and the state h^{t-1}
(h^0 = 0); client k keeps g_k = grad L_k(theta_k^{t-1}), the gradient of its loss at its last local model
(0 before it first trains). Round t (the equations in the order of Algorithm 1, numbered here):

    (1)  theta_k^t = argmin_theta  L_k(theta) - <g_k, theta> + (alpha/2) ||theta - theta^{t-1}||^2
    (2)  g_k      <- g_k - alpha (theta_k^t - theta^{t-1})          the first-order condition of (1) at its
                                                                    minimum: grad L_k(theta_k^t)
    (3)  h^t       = h^{t-1} - alpha (1/m) sum_{k in P_t} (theta_k^t - theta^{t-1})
    (4)  theta^t   = (1/|P_t|) sum_{k in P_t} theta_k^t - (1/alpha) h^t

(1) and (2) run on the clients (k in P_t), (3) and (4) on the server. The linear term moves each
client's stationary point onto the global objective's: at a consensus theta_k = theta, sum_k g_k = 0.

Decisions where the paper is silent or this protocol differs:

* (1) is minimised approximately, as every method here trains: the experiment's E local epochs of its
  optimiser from theta^{t-1}, on the objective written as a loss term (`dyn_loss`), so it holds for SGD
  with momentum and for Adam alike (the paper's analysis assumes the exact minimiser). The experiment's
  weight decay, when set, adds to (1) as it does for every method. (2) is the paper's update, from the
  first-order condition, not a gradient evaluated again.
* g_k is declared client state (`ClientState(("P",), init="zeros")`): it never travels, survives
  checkpoints and Flower restarts, and moves only when k trains. The upload is theta_k^t alone, so bytes
  up and down are FedAvg's.
* m in (3) is the federation's clients (`ctx.num_clients`), the paper's 1/m over all devices; only the
  clients whose reply was accepted enter the sum (a failed or rejected client is not in P_t).
* alpha = 0 is FedAvg by definition: (1) is L_k alone (the client trains the experiment's own objective,
  the plain cross-entropy path), g_k stays 0 by (2), h stays 0 by (3), and (4)'s h^t / alpha, 0 / 0, is
  taken as 0: theta^t is the mean of the returned models. (This is not the limit alpha -> 0: h^t / alpha =
  -sum_{s <= t} (1/m) sum_k (theta_k^s - theta^{s-1}) does not vanish with alpha; alpha = 0 is defined
  as the method without its regulariser, FedAvg bit for bit, which the tests check through the runner.)
* The mean of (4) is uniform over P_t, as printed (`weighting=uniform`); `samples` weighs it by n_k. Only
  the mean changes: h (3) is the printed 1/m sum either way. At alpha = 0, `feddyn.weighting=uniform` is
  `fedavg.weighting=uniform` and `feddyn.weighting=samples` is FedAvg's default.
* The mean of (4) goes through the shared server step (`averages = ("w",)`): `feddyn.aggregation`
  replaces it by a robust rule (krum, bulyan, median, ...); h (3) still sums every accepted client's
  update, as printed, so a rule guards the mean and not h. `feddyn.server_opt` takes theta^t of (4) in
  place of the average (Delta = theta^t - theta^{t-1}); the default `none` is (4).
* h is kept in float64 (it accumulates over rounds); theta^t is rounded once to the model's dtype. g_k is
  updated in float64 and stored in float32, as every client row.
* alpha is the same for every client, as printed. The authors' code (alpemreacar/FedDyn,
  utils_methods.py, train_FedDyn) uses alpha / (n_k / nbar) in client k's objective (1) (nbar: the mean
  client size) and keeps (1/m) sum_s (theta_k^s - theta^{s-1}) per client, so its server model is (4)
  with h^t / alpha = -(1/m) sum_k sum_s (theta_k^s - theta^{s-1}) whatever the per-client alpha; with
  clients of equal size the two agree.
* Default alpha = 0.01, the value of the authors' CIFAR-10 example (example_cifar_10.py: alpha_coef = 1e-2);
  the paper tunes alpha per data set.
"""

from __future__ import annotations

import numpy as np
import torch

from fedprism.algorithms.aggregation import WEIGHTINGS, client_weights
from fedprism.algorithms.base import ClientState, Plan, TrainJob, Update, register
from fedprism.algorithms.fedavg import FedAvg
from fedprism.hparams import Param
from fedprism.objectives import ce


def dyn_loss(f, w, x, y, weight, extras):
    """(1): L_k(w) - <g_k, w> + (alpha/2) ||w - theta^{t-1}||^2, with extras `g`, `anchor` (theta^{t-1})
    and `alpha` (vmap-safe). Its gradient is grad L_k(w) - g_k + alpha (w - theta^{t-1})."""
    d = w - extras["anchor"]
    return ce(f, w, x, y, weight, extras) - (w * extras["g"]).sum() + 0.5 * extras["alpha"] * (d * d).sum()


def gradient_state(g: torch.Tensor, theta_k: torch.Tensor, theta: torch.Tensor, alpha: float) -> torch.Tensor:
    """(2): g_k - alpha (theta_k^t - theta^{t-1}), row by row, computed in float64, in g's dtype."""
    return (g.double() - alpha * (theta_k.double() - theta.double())).to(g.dtype)


def server_state(h: torch.Tensor, theta_k: torch.Tensor, theta: torch.Tensor, alpha: float, m: int) -> torch.Tensor:
    """(3): h^{t-1} - alpha (1/m) sum_k (theta_k^t - theta^{t-1}), float64 [P]; theta [n, P] or [P]."""
    return h.double() - alpha * (theta_k.double() - theta.double()).sum(0) / m


def server_model(avg: torch.Tensor, h: torch.Tensor, alpha: float) -> torch.Tensor:
    """(4): the clients' average minus h^t / alpha, float64 [P]; alpha = 0: the average itself (h = 0,
    the correction taken as 0: FedAvg)."""
    return avg if alpha == 0 else avg.double() - h.double() / alpha


@register
class FedDyn(FedAvg):
    name = "feddyn"
    paper = "Acar et al. 2021, arXiv:2111.04263"
    personalized = False
    client_state = {"g": ClientState(("P",), init="zeros")}
    params = {
        "alpha": Param(0.01, "alpha: local objective L_k(w) - <g_k, w> + (alpha/2)||w - w^t||^2 and server model "
                       "mean - h/alpha (0: FedAvg)", lambda v: v >= 0, "a number >= 0"),
        "weighting": Param("uniform", "the mean of the returned models in theta^t: 1/|P_t| (uniform, the paper) or "
                           "n_k (samples)", choices=WEIGHTINGS),
    }

    def init_state(self) -> dict:
        return {"w": self.ctx.init.clone(), "h": torch.zeros(self.ctx.init.shape, dtype=torch.float64)}

    def client_update(self, plan: Plan, trainer, rnd: int, cstate: dict) -> Update:
        """(1) from theta^{t-1} for E epochs, then (2); upload theta_k^t."""
        S, theta = plan.clients, plan.start
        alpha = float(self.hp["alpha"])
        g = cstate["g"].to(theta.device, theta.dtype)
        if alpha == 0:                                  # L_k alone: FedAvg's client (g_k stays 0)
            t = trainer.train(TrainJob(S, theta), rnd)
            return Update(t.clients, {"params": t.params}, t.n_samples, {"train_loss": t.loss},
                          client_state={"g": g.clone()})
        job = TrainJob(S, theta, loss=dyn_loss,
                       extras={"g": g, "anchor": theta, "alpha": torch.full((len(S),), alpha, device=theta.device)})
        t = trainer.train(job, rnd)
        return Update(t.clients, {"params": t.params}, t.n_samples, {"train_loss": t.loss},
                      client_state={"g": gradient_state(g, t.params, theta, alpha)})

    def aggregate(self, state: dict, rnd: int, update: Update) -> dict:
        """(3) and (4), the mean of (4) through the shared server step."""
        alpha = float(self.hp["alpha"])
        avg = self.server.average(update.params, client_weights(update, self.hp["weighting"]),
                                  update.sent.get("params"))
        if alpha > 0:
            state["h"] = server_state(state["h"], update.params, update.start, alpha, self.ctx.num_clients)
        self.server.update(state, "w", server_model(avg, state["h"], alpha))
        return {}

    def client_side_inference(self) -> bool:
        """The clients predict with the server's model: g_k only shapes training."""
        return False

    def model_for(self, state: dict, clients: np.ndarray) -> torch.Tensor:
        return state["w"].expand(len(clients), -1)
