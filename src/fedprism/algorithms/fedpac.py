"""FedPAC (Xu, Tong, Huang 2023, "Personalized Federated Learning with Feature Alignment and Classifier
Collaboration", ICLR, arXiv:2306.11867, Algorithm 1): a shared feature extractor theta aligned to global
class prototypes, a personal classifier head phi_i per client, and heads combined across clients with
weights from a small quadratic program on feature statistics.

The model's declared split (`ParamSpec.body` / `ParamSpec.head`): f_theta(x) is the body's output (the
head's input, width d), phi the classifier head. Client i holds its own model (client state) and, in
round t, receives theta^t, the global prototypes c^t (and its combined head phi_hat_i^t, see below).
Numbered here:

  feature statistics, with the received theta^t, before training (n_i samples, n_ik of class k,
  p_i(k) = n_ik / n_i, mu_ik the mean of f_theta(x) over class k):
    (1)  h_ik = p_i(k) mu_ik                                                                  [C, d]
    (2)  V_i = (1 / n_i) sum_k [ p_i(k) mean_{x in class k} ||f_theta(x)||^2 - ||h_ik||^2 ]   scalar
  local training, from (theta^t, phi_i):
    (3)  phi_i <- tau_h epochs of SGD on  (1/n_i) sum l(phi(f_theta(x)), y)             theta frozen
    (4)  theta_i <- tau epochs of SGD on  (1/n_i) sum [ l(phi_i(f_theta(x)), y)
                                             + lambda ||f_theta(x) - c_y||^2 / d ]       phi_i frozen
  local prototypes, with the trained theta_i:
    (5)  c_ik = mean_{x in class k} f_{theta_i}(x)
  client -> server: theta_i, phi_i, (c_ik, n_ik)_k, V_i, (h_ik)_k
  server, over the round's clients S_t:
    (6)  theta^{t+1} = sum_{i in S_t} (n_i / N_t) theta_i
    (7)  c_k^{t+1} = sum_i n_ik c_ik / sum_i n_ik                       (classes some client of S_t holds)
    (8)  alpha_i = argmin_{alpha in simplex} alpha^T (diag(V) + D^(i)) alpha,
           D^(i)_jj' = sum_k <h_ik - h_jk, h_ik - h_j'k>                           (j, j' in S_t)
    (9)  phi_hat_i = sum_j alpha_ij phi_j        client i predicts with (theta^{t+1}, phi_hat_i)
                                                 and starts its next round's (3) from phi_hat_i

(8) is the paper's bias-variance estimate of the combined head's error: V_j the variance term of head j,
the quadratic form of the differences of h the bias between client i's and client j's feature
distributions; it is convex (diag(V) >= 0 plus a Gram matrix).

Solving (8) (`simplex_qp`). The paper solves it with an off-the-shelf solver (the authors' code calls
CVXPY). Here: accelerated projected gradient (FISTA) on the simplex in float64, step 1 / L with L = 2 x the
largest eigenvalue of Q, from the uniform point, with the Euclidean projection onto the simplex by sorting
(Duchi et al. 2008); at most `QP_ITERS` iterations, stopping when a projected gradient step from alpha moves
it by less than `QP_TOL` (max norm: alpha is then a fixed point of the step, i.e. optimal). For these small, well-scaled problems (|S_t| variables) that is the solver's optimum to
about 1e-9 (tested against exact KKT enumeration and closed forms); with Q = 0 every alpha is optimal and
the uniform start is returned. As the authors' code, weights below 1e-3 are set to 0 and the rest
renormalised (`ALPHA_EPS`).

Equivalence (tested): lambda = 0 and `collaborate=false` is FedRep (Algorithm 1 of Collins et al. 2021,
`fedprism.algorithms.fedrep`) with tau_h = `head_epochs` and tau = `body_epochs` bit for bit: the same two
masked phases on the same two streams, the same loss and the same body average (the statistics and
prototypes are still computed and uploaded, so only the bytes differ).

Decisions where the paper is silent or its code (JianXu95/FedPAC, methods/fedpac.py, tools.py) is followed:

* (2) is the authors' `statistics_extraction` formula, computed on the client's whole training split in
  float64 with the received body, before local training (as PFLlib's FedPAC client does when it receives
  the model); (5) after local training, with the trained body (the authors' `local_protos2`).
* (4)'s alignment term is the squared distance averaged over the batch and the d feature dimensions (the
  authors' `nn.MSELoss`, FedProto's `prototype_loss`); a sample whose class has no global prototype adds 0
  (PFLlib's FedPAC; the authors fall back to the client's own pre-training prototype). Round 0 has no
  global prototype, so its (4) is plain cross-entropy, as in the authors' code (`if round > 0`).
* (7) over this round's clients; a class none of them holds keeps its previous prototype
  (`fedproto.update_prototypes(..., "round")`; the authors rebuild the dictionary from the round).
* (8)-(9) over the round's clients that returned (at least one); a client with only itself gets its own
  head. The combined head is server state (one row per client, `[N, |phi|]`): the server sends it back
  with the client's next plan and its evaluation payload (the client cannot be written to between
  rounds), so it counts in bytes down. A client that was never combined uses its own head.
* `collaborate=false` skips (8)-(9): every client keeps its own head (FedRep's / FedPer's head).
* `privacy.epsilon` > 0 is refused: the prototypes and statistics would leave the clients without noise.
* Heads are combined coordinate-wise in float64 and rounded once to float32.
* Optimiser: the experiment's (the authors use SGD with momentum 0.5, weight decay 5e-4 and a head
  learning rate of 0.1), with fresh state in each phase; the phases train on FedRep's streams
  ('fedrep_head', 'fedrep_body'), so the batch orders are FedRep's.
* The server step of (6) is the shared one (`averages = ("shared",)`: `fedpac.aggregation`,
  `fedpac.server_opt`); `weighting=samples` is the paper's n_i / N_t.

Defaults: lambda = 1 (the authors' `--lam 1.0`), head_epochs = 1 (their `epoch_classifier = 1`),
body_epochs unset = the experiment's local_epochs (their `local_ep_rep = local_epoch`).
"""

from __future__ import annotations

import numpy as np
import torch

from fedprism.algorithms.aggregation import client_weights
from fedprism.algorithms.base import Inference, Plan, TensorSpec, TrainJob, Update, register
from fedprism.algorithms.fedproto import (PROTO_CHUNK, check_feature_dim, local_prototypes, prototype_loss,
                                          prototype_rows, prototype_state, update_prototypes)
from fedprism.algorithms.partial import WEIGHTING, PartialSharing
from fedprism.errors import ConfigError
from fedprism.hparams import Param
from fedprism.protocol import Trained

#: the client-state row of the client's own model (partial sharing's declaration)
LOCAL = next(iter(PartialSharing.client_state))

#: the phases' random streams: FedRep's (see the module docstring)
HEAD_STREAM, BODY_STREAM = "fedrep_head", "fedrep_body"
#: the QP solver's iteration cap and stopping tolerance (max-norm change of alpha in one iteration)
QP_ITERS, QP_TOL = 20000, 1e-12
#: combination weights below this are set to 0 and the rest renormalised (the authors' `eps`)
ALPHA_EPS = 1e-3


def _epochs_ok(v) -> bool:
    return v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0)


# -- the quadratic program (8) -------------------------------------------------------------------------------
def project_simplex(v: torch.Tensor) -> torch.Tensor:
    """The Euclidean projection of v [n] onto {a >= 0, sum a = 1} (Duchi, Shalev-Shwartz, Singer, Chandra
    2008, "Efficient Projections onto the l1-Ball for Learning in High Dimensions", Fig. 1)."""
    u, _ = torch.sort(v, descending=True)
    css = torch.cumsum(u, 0) - 1.0
    k = torch.arange(1, len(v) + 1, dtype=v.dtype)
    rho = int(torch.nonzero(u - css / k > 0).max())
    return (v - css[rho] / (rho + 1)).clamp(min=0)


def simplex_qp(Q: torch.Tensor, iters: int = QP_ITERS, tol: float = QP_TOL) -> torch.Tensor:
    """argmin_{a in simplex} a^T Q a for a symmetric positive semi-definite Q [n, n]: accelerated projected
    gradient (FISTA) in float64 from the uniform point, step 1 / (2 lambda_max(Q))."""
    Q = Q.to(torch.float64)
    Q = (Q + Q.T) / 2
    n = Q.shape[0]
    a = torch.full((n,), 1.0 / n, dtype=torch.float64)
    L = 2.0 * float(torch.linalg.eigvalsh(Q).max()) if n else 0.0
    if n <= 1 or not L > 0:
        return a
    y, t = a.clone(), 1.0
    for _ in range(iters):
        a_next = project_simplex(y - (2.0 * (Q @ y)) / L)
        t_next = (1.0 + (1.0 + 4.0 * t * t) ** 0.5) / 2.0
        y = a_next + ((t - 1.0) / t_next) * (a_next - a)
        a, t = a_next, t_next
        # stop at a fixed point of the projected gradient step taken from a itself (FISTA's momentum can
        # repeat an iterate on a face of the simplex before the optimum)
        if float((project_simplex(a - (2.0 * (Q @ a)) / L) - a).abs().max()) < tol:
            break
    return a


def collaboration_matrix(V: torch.Tensor, h: torch.Tensor, i: int) -> torch.Tensor:
    """(8)'s Q for client row i: diag(V) + D^(i), D^(i)_jj' = sum_k <h_ik - h_jk, h_ik - h_j'k> (float64).
    V [n], h [n, C, d]."""
    a = (h[i:i + 1] - h).to(torch.float64).reshape(len(h), -1)        # [n, C d]
    return torch.diag(V.to(torch.float64)) + a @ a.T


def combination_weights(V: torch.Tensor, h: torch.Tensor, eps: float = ALPHA_EPS) -> torch.Tensor:
    """[n, n]: row i = client i's alpha_i of (8), weights below `eps` set to 0 and the row renormalised."""
    out = torch.stack([simplex_qp(collaboration_matrix(V, h, i)) for i in range(len(V))])
    out = torch.where(out < eps, torch.zeros_like(out), out)
    return out / out.sum(1, keepdim=True)


# -- client side --------------------------------------------------------------------------------------------
def feature_statistics(trainer, clients: np.ndarray, params: torch.Tensor, num_classes: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(1) and (2) for each client over its training split with the model rows `params` [n, P]:
    (V [n] float64, h [n, C, d] float32)."""
    Vs, hs = [], []
    for i, c in enumerate(clients):
        x, y = trainer.data(int(c), "train")
        sums = sq = None
        for s0 in range(0, len(y), PROTO_CHUNK):
            z = trainer.features(params[i:i + 1], x[s0:s0 + PROTO_CHUNK])[0].to(torch.float64).cpu()
            if sums is None:
                sums = torch.zeros(num_classes, z.shape[-1], dtype=torch.float64)
                sq = torch.zeros(num_classes, dtype=torch.float64)
            yy = y[s0:s0 + PROTO_CHUNK].cpu()
            sums.index_add_(0, yy, z)
            sq.index_add_(0, yy, (z * z).sum(-1))
        n_k = torch.bincount(y.cpu(), minlength=num_classes).to(torch.float64)
        n = max(float(n_k.sum()), 1.0)
        p = n_k / n
        mu = sums / n_k.clamp(min=1)[:, None]
        h = p[:, None] * mu
        V = (p * sq / n_k.clamp(min=1) - (h * h).sum(-1)).sum() / n
        Vs.append(V)
        hs.append(h.float())
    return torch.stack(Vs), torch.stack(hs)


@register
class FedPAC(PartialSharing):
    name = "fedpac"
    paper = "Xu, Tong, Huang 2023, ICLR, arXiv:2306.11867, Algorithm 1"
    shares_prototypes = True             # its upload holds class prototypes (privacy.epsilon is refused below)
    params = {
        "lam": Param(1.0, "lambda: weight of the feature alignment to the global prototypes (4)", lambda v: v >= 0,
                     "a number >= 0"),
        "head_epochs": Param(1, "tau_h: epochs on the head with the body frozen (3), first", lambda v: v >= 0,
                             "an integer >= 0"),
        "body_epochs": Param(None, "tau: epochs on the body with the head frozen (4), second (unset: the "
                             "experiment's local_epochs)", _epochs_ok, "an integer >= 0 (unset: local_epochs)"),
        "collaborate": Param(True, "combine the clients' heads with the weights of the quadratic program (8)-(9)"),
        "weighting": WEIGHTING,
    }

    def __init__(self, ctx, **hp):
        super().__init__(ctx, **hp)
        check_feature_dim(ctx, self.name)
        if ctx.privacy is not None:
            raise ConfigError("privacy.epsilon", getattr(ctx.privacy, "epsilon", None),
                              f"0 for method={self.name}: its prototypes and feature statistics (1), (5) leave "
                              "the client without noise")
        self.head = ctx.spec.head
        self.H = self.head.stop - self.head.start

    @classmethod
    def check_params(cls, hp: dict) -> None:
        if hp["head_epochs"] == 0 and hp["body_epochs"] == 0:
            raise ConfigError("fedpac.body_epochs", 0, "head_epochs + body_epochs > 0")

    @classmethod
    def headline(cls, config: dict) -> str:
        return "shared body + combined head"

    def shared_mask(self) -> torch.Tensor:
        keep = torch.ones(self.ctx.spec.size, dtype=torch.bool)
        keep[self.ctx.spec.head] = False
        return keep

    # -- declarations ------------------------------------------------------------------------------------
    def upload(self) -> dict:
        return {"shared": TensorSpec((len(self.shared),)), "head": TensorSpec((self.H,)),
                "protos": TensorSpec(("C", "d")), "counts": TensorSpec(("C",), low=0), "V": TensorSpec(()),
                "h": TensorSpec(("C", "d"))}

    @classmethod
    def server_models(cls, hp: dict, clients: int, cohort: int) -> dict:
        return {}

    # -- the round ---------------------------------------------------------------------------------------
    def init_state(self) -> dict:
        state = {"shared": self.ctx.init[self.shared].clone(), **prototype_state(self.ctx, "round")}
        if self.hp["collaborate"]:
            N = self.ctx.num_clients
            state["heads"] = self.ctx.init[self.head].expand(N, -1).clone()
            state["combined"] = torch.zeros(N, dtype=torch.bool)
        return state

    def _rows(self, state: dict, clients: np.ndarray) -> dict:
        n = len(clients)
        rows = {"shared": state["shared"].expand(n, -1).clone(), **prototype_rows(state, n)}
        if self.hp["collaborate"]:
            idx = torch.as_tensor(clients, dtype=torch.long)
            rows["head"] = state["heads"][idx].clone()
            rows["combined"] = state["combined"][idx].to(torch.float32)
        return rows

    def plan(self, state: dict, rnd: int, clients: np.ndarray) -> Plan:
        return Plan(clients, self._rows(state, clients))

    def model(self, local: torch.Tensor, payload: dict) -> torch.Tensor:
        """[n, P]: the clients' own rows with the received body, and the combined head where there is one."""
        w = self.merge(local, payload["shared"])
        if "head" in payload:
            use = payload["combined"].to(w.device)[:, None] > 0
            w[:, self.head] = torch.where(use, payload["head"].to(w.device, w.dtype), w[:, self.head])
        return w

    def local_training(self, clients: np.ndarray, start: torch.Tensor, trainer, rnd: int, protos=None) -> Trained:
        """(3) then (4): two masked phases (FedRep's); (4) with the alignment term once a global prototype
        exists and lambda > 0."""
        n = len(clients)
        lam = float(self.hp["lam"])
        body_loss, extras = "ce", {}
        if protos is not None and lam > 0 and bool(protos["present"].any()):
            body_loss = prototype_loss
            extras = {"protos": protos["protos"], "present": protos["present"],
                      "lam": torch.full((n,), lam)}
        phases = [(self.mask_private, self.hp["head_epochs"], HEAD_STREAM, "ce", {}),
                  (self.mask_shared, self.hp["body_epochs"], BODY_STREAM, body_loss, extras)]
        E = self.ctx.train.local_epochs if self.ctx.train is not None else None
        w, loss, seen, t = start, torch.zeros(n, dtype=torch.float64), 0, None
        for mask, epochs, stream, objective, ex in phases:
            e = E if epochs is None else epochs
            if e:
                t = trainer.train(TrainJob(clients, w, loss=objective, extras=ex, mask=mask, epochs=epochs,
                                           stream=stream), rnd)
                w, loss, seen = t.params, loss + e * t.loss, seen + e
        return Trained(clients, w, t.n_samples, loss / seen)      # check_params: at least one phase runs

    def client_update(self, plan: Plan, trainer, rnd: int, cstate: dict) -> Update:
        S, C = plan.clients, self.ctx.num_classes
        start = self.model(cstate[LOCAL], plan.payload)
        V, h = feature_statistics(trainer, S, start, C)                          # (1), (2) with theta^t
        t = self.local_training(S, start, trainer, rnd, plan.payload)              # (3), (4)
        protos, counts = local_prototypes(trainer, S, t.params, C)                # (5)
        payload = {"shared": self.take(t.params), "head": t.params[:, self.head].clone(), "protos": protos,
                   "counts": counts, "V": V.float(), "h": h}
        return Update(S, payload, t.n_samples, {"train_loss": t.loss}, client_state={LOCAL: t.params})

    def aggregate(self, state: dict, rnd: int, update: Update) -> dict:
        """(6) through the shared server step, (7), and (8)-(9) for every client of the round."""
        w = client_weights(update, self.hp["weighting"])
        avg = self.server.average(update.payload["shared"], w, update.sent.get("shared"))
        self.server.update(state, "shared", avg)
        update_prototypes(state, update, "samples", "round")
        if not self.hp["collaborate"]:
            return {}
        alpha = combination_weights(update.payload["V"].double(), update.payload["h"])     # [n, n]
        heads = (alpha @ update.payload["head"].double()).to(state["heads"].dtype)
        idx = torch.as_tensor(update.clients, dtype=torch.long)
        state["heads"][idx] = heads
        state["combined"][idx] = True
        return {}

    def eval_payload(self, state: dict, clients: np.ndarray) -> dict:
        rows = {"shared": state["shared"].expand(len(clients), -1)}
        if self.hp["collaborate"]:
            idx = torch.as_tensor(clients, dtype=torch.long)
            rows["head"] = state["heads"][idx]
            rows["combined"] = state["combined"][idx].to(torch.float32)
        return rows

    def inference(self, trainer, clients, payload: dict, cstate: dict) -> Inference:
        return Inference({"model": self.model(cstate[LOCAL], payload)})
