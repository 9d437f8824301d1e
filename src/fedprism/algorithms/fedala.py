"""FedALA (Zhang, Hua, Wang, Song, Xue, Ma, Guan 2023, "FedALA: Adaptive Local Aggregation for Personalized
Federated Learning", AAAI, arXiv:2212.01197), Algorithm 1 with the ALA module (its lines 6 to 16, as the
authors' README says of their ALA.py). Equations are numbered here, in the order of the method's steps.

Each client keeps its last local model theta_i. Before it trains in round t it does not overwrite theta_i
with the downloaded global model Theta^{t-1}; it aggregates the two element-wise (Adaptive Local
Aggregation):

    theta_hat_i^t = theta_i^{t-1} + (Theta^{t-1} - theta_i^{t-1}) (.) W_i                            (1)

and only on the top p layers; the lower layers take the global model as it is:

    theta_hat_i^t = theta_i^{t-1} + (Theta^{t-1} - theta_i^{t-1}) (.) [1^{|theta| - p}; W_i^p]       (2)

W_i^p is learned on a random s% of the client's training data D_i^{s,t}, one gradient step per batch,
clipped to [0, 1] (sigma(w) = max(0, min(1, w))):

    W_i^p <- sigma( W_i^p - eta grad_{theta_hat_i^t} L(theta_hat_i^t; D_i^{s,t}) (.) (Theta^{t-1} - theta_i^{t-1}) )
                                                                                                     (3)

(the chain rule through (2): d theta_hat / d W = Theta - theta), with theta_hat recomputed from the new
W after every batch. W_i^p starts at ones (a first ALA is Theta itself), is kept by the client between
rounds, is trained until convergence in the client's first ALA and for one epoch in every later one. Then
the client trains theta_hat_i^t with the experiment's local training (E epochs), keeps the result as its
new theta_i^t and uploads it; the server averages the uploads as FedAvg does:

    Theta^t = sum_{i in S_t} (n_i / N_t) theta_i^t                                                   (4)

(`averages = ("w",)`: the shared robust rules and server optimisers apply to Theta.)

Parameters (`fedala.<name>`): `layers` = p (default 1: the classifier layer; the authors' code `-p 2`
counts the weight and the bias of that one layer), `rand_percent` = s (80), `eta` (1.0), `threshold` and
`window` (the convergence test of the first ALA), `max_epochs` (its cap), `weighting` (FedAvg's).

Decisions where the paper is silent or its code differs (the authors' code: TsingZ0/FedALA,
system/utils/ALA.py, also in PFLlib):

* Layers. "Top p layers" counts layers with parameters, not counting BatchNorm layers, as `fedper.personal`
  does (`fedper.personal_slice`): a BatchNorm layer above the lowest ALA layer is aggregated with it. p = 0
  is no ALA at all: the client starts from Theta, FedAvg's client exactly (tested bit for bit).
* Element-wise aggregation is computed as torch.lerp(theta, Theta, W), which gives Theta exactly where
  W = 1 and theta exactly where W = 0 (theta + (Theta - theta) W may miss Theta by a rounding): with
  eta = 0, W stays at ones and FedALA is FedAvg bit for bit (tested).
* eta = 1.0, s = 80: the authors' defaults (main.py). eta is the weights' own learning rate, not the
  client's lr (the paper sets them apart); `ctx.train.batch_size` (the experiment's B) is the batch size of
  the weight learning, as in the authors' code (the client's batch size).
* The sample D_i^{s,t}: max(1, floor(s/100 n_i)) rows drawn without replacement from the client's training
  rows with the stream of (run seed, round, client, 'fedala') (`fedprism.seeds.stream_seed`), independent of
  the cohort and the engine; every epoch of the weight learning visits them in that order, batches of B,
  the last one possibly smaller (the authors' code takes a contiguous window at a random offset; its
  copies of ALA.py differ on the last partial batch, `drop_last=True` in some, which with B > s n_i
  learns nothing, `drop_last=False` in others).
* The loss is the plain mean cross-entropy of theta_hat at each batch, the model without dropout.
* Convergence of the first ALA: the authors' test, train until more than `window` (10) epoch losses are
  recorded and the population standard deviation of the last `window` is below `threshold` (0.1), capped
  at `max_epochs` (100; the authors' code has no cap). An epoch's loss is the sample-weighted mean of its
  batch losses, each taken before that batch's step (the authors' code records the last batch's loss only).
* "First participation" is the first ALA with something to learn: while the client's top layers equal
  Theta's exactly (its first round is round 0, where both are the initial model; or the server's model has
  not changed since), the gradient of (3) is zero, W is left as it is and the start phase is not spent
  (the authors' code skips ALA when the first parameter tensors agree, keeping its start phase too).
* A client's whole last model (`theta`, [P], starting at the initial model), its weights (`W`, [P], ones,
  only the top layers' coordinates are read) and whether its start phase is spent (`started`) are client
  state: nothing of them travels; the upload is the trained model, as in FedAvg.
* Evaluation: a client predicts with its own last local model theta_i (Algorithm 1's output, "the local
  models"); a client never sampled predicts with the initial model. The alternative prediction `ala` is
  (2) with the current global model and the client's current W, without learning (what it would start
  its next training from), stored as `<split>_acc@ala`. The global model is also scored on the global
  test set (`global_model_acc`).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from fedprism.algorithms.base import ClientState, Inference, Plan, TrainJob, Update, register
from fedprism.algorithms.fedavg import FedAvg
from fedprism.algorithms.fedper import personal_slice
from fedprism.errors import ConfigError
from fedprism.hparams import Param
from fedprism.seeds import stream_seed

#: the random stream of the ALA sample
STREAM = "fedala"


def _int_at_least(low: int):
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low


# -- the ALA module: pure functions --------------------------------------------------------------------
def ala_model(theta: torch.Tensor, global_w: torch.Tensor, W: torch.Tensor, top: slice) -> torch.Tensor:
    """(2): Theta below `top`, lerp(theta, Theta, W) on `top` ([P] vectors; `top` a slice of P)."""
    out = global_w.clone()
    out[top] = torch.lerp(theta[top], global_w[top], W[top].to(theta.dtype))
    return out


def ala_sample(n: int, percent: float, seed: int, rnd: int, client: int) -> np.ndarray:
    """The rows of D_i^{s,t}: max(1, floor(s/100 n)) of n rows (none of none), in a seeded random order."""
    if n <= 0:
        return np.zeros(0, dtype=np.int64)
    k = max(1, int(np.floor(percent / 100.0 * n)))
    return np.random.default_rng(stream_seed(seed, rnd, client, STREAM)).permutation(n)[:k]


def ala_step(f, theta: torch.Tensor, global_w: torch.Tensor, W: torch.Tensor, top: slice, x: torch.Tensor,
             y: torch.Tensor, eta: float) -> tuple[torch.Tensor, float]:
    """(3) on one batch: (the new W [P], the batch's mean cross-entropy at the old W)."""
    hat = ala_model(theta, global_w, W, top).detach()
    with torch.enable_grad():
        v = hat[top].clone().requires_grad_(True)
        full = torch.cat([hat[:top.start], v, hat[top.stop:]])
        loss = F.cross_entropy(f(full, x), y)
        (g,) = torch.autograd.grad(loss, v)
    out = W.clone()
    out[top] = torch.clamp(W[top] - eta * (g * (global_w[top] - theta[top])).to(W.dtype), 0.0, 1.0)
    return out, float(loss.detach())


def learn_weights(f, theta: torch.Tensor, global_w: torch.Tensor, W: torch.Tensor, top: slice, x: torch.Tensor,
                  y: torch.Tensor, eta: float, batch_size: int, start_phase: bool, threshold: float = 0.1,
                  window: int = 10, max_epochs: int = 100) -> tuple[torch.Tensor, list[float]]:
    """The weight learning of one ALA on the sample (x, y): one epoch, or in the start phase epochs until
    the last `window` epoch losses have a (population) standard deviation below `threshold`, at most
    `max_epochs`. Returns (W, the epoch losses)."""
    losses: list[float] = []
    if len(y) == 0:
        return W, losses
    while True:
        total = 0.0
        for s in range(0, len(y), batch_size):
            W, loss = ala_step(f, theta, global_w, W, top, x[s:s + batch_size], y[s:s + batch_size], eta)
            total += loss * len(y[s:s + batch_size])
        losses.append(total / len(y))
        if not start_phase or len(losses) >= max_epochs:
            return W, losses
        if len(losses) > window and float(np.std(losses[-window:])) < threshold:
            return W, losses


def _own(z, e):
    return z["own"]


def _ala(z, e):
    return z["ala"]


@register
class FedALA(FedAvg):
    name = "fedala"
    paper = "Zhang et al. 2023, FedALA, AAAI, arXiv:2212.01197"
    personalized = True
    client_state = {"theta": ClientState(("P",), init="model"), "W": ClientState(("P",), init=1.0),
                    "started": ClientState((1,), init="zeros")}
    predictions = {"ala": "ALA of the current global model (2), not trained"}
    params = {
        "layers": Param(1, "p: the top layers aggregated element-wise (BatchNorm not counted; 0: no ALA, FedAvg's "
                        "start)", _int_at_least(0), "an integer >= 0"),
        "rand_percent": Param(80.0, "s: percent of the client's training rows the weights learn on",
                              lambda v: 0 < v <= 100, "a number in (0, 100]"),
        "eta": Param(1.0, "eta: learning rate of the ALA weights W (3)", lambda v: v >= 0, "a number >= 0"),
        "threshold": Param(0.1, "first ALA: stop when the std of the last `window` epoch losses is below this",
                           lambda v: v >= 0, "a number >= 0"),
        "window": Param(10, "first ALA: epoch losses in the convergence test", _int_at_least(1),
                        "an integer >= 1"),
        "max_epochs": Param(100, "first ALA: at most this many epochs of weight learning", _int_at_least(1),
                            "an integer >= 1"),
        "weighting": FedAvg.params["weighting"],
    }

    def __init__(self, ctx, **hp):
        super().__init__(ctx, **hp)
        self.top = personal_slice(ctx.spec, self.hp["layers"], f"{self.name}.layers")
        if ctx.train is None and self.hp["layers"] > 0:
            raise ConfigError(f"{self.name}.layers", self.hp["layers"], "0 unless the context has the training "
                              "settings (ctx.train: the weights learn in batches of its batch_size)")

    @classmethod
    def headline(cls, config: dict) -> str:
        return "own local model"

    def client_update(self, plan: Plan, trainer, rnd: int, cstate: dict) -> Update:
        """(2)-(3) for each sampled client, then E epochs of local training from theta_hat."""
        S, glob = plan.clients, plan.start
        theta = cstate["theta"].to(glob.device, glob.dtype)
        W, started = cstate["W"].clone(), cstate["started"].clone()
        starts, epochs = [], torch.zeros(len(S))
        for i, c in enumerate(S):
            if self.top.start == self.top.stop:                             # p = 0: Theta itself
                starts.append(glob[i].clone())
                continue
            top = self.top
            if torch.equal(theta[i, top], glob[i, top]):                    # nothing to learn ((3) is zero)
                starts.append(ala_model(theta[i], glob[i], W[i], top))
                continue
            dev = trainer.device
            x, y = trainer.data(int(c), "train")
            rows = torch.as_tensor(ala_sample(len(y), self.hp["rand_percent"], self.ctx.seed, rnd, int(c)),
                                   device=y.device)
            w_new, losses = learn_weights(
                trainer.f, theta[i].to(dev), glob[i].to(dev), W[i].to(dev), top, x[rows].to(dev), y[rows].to(dev),
                self.hp["eta"], self.ctx.train.batch_size, bool(started[i, 0] == 0), self.hp["threshold"],
                self.hp["window"], self.hp["max_epochs"])
            W[i] = w_new.to(W.device, W.dtype)
            started[i] = 1.0
            epochs[i] = len(losses)
            starts.append(ala_model(theta[i], glob[i], W[i], top))
        t = trainer.train(TrainJob(S, torch.stack(starts)), rnd)
        return Update(S, {"params": t.params}, t.n_samples, {"train_loss": t.loss, "ala_epochs": epochs},
                      client_state={"theta": t.params, "W": W, "started": started})

    # -- evaluation: the own local model; ALA of the current global model as the alternative -----------
    def eval_payload(self, state: dict, clients: np.ndarray) -> dict:
        return {"params": state["w"].expand(len(clients), -1)}

    def inference(self, trainer, clients, payload: dict, cstate: dict) -> Inference:
        glob = payload["params"]
        theta = cstate["theta"].to(glob.device, glob.dtype)
        ala = torch.stack([ala_model(theta[i], glob[i], cstate["W"][i].to(glob.device), self.top)
                           for i in range(len(clients))]) if len(clients) else glob.clone()
        return Inference({"own": theta, "ala": ala}, _own, {"ala": _ala})

    def extra_models(self, state: dict) -> dict:
        return {"global": state["w"]}
