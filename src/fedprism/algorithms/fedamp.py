"""FedAMP and HeurFedAMP, attentive message passing (Huang et al. 2021).

The server keeps every client's last personalized model w_j. For a sampled client i it builds the
cloud model over i's neighbours j (the other clients that have uploaded at least once):

    u_i = sum_j xi_ij w_j,   xi_ii = 1 - sum_{j != i} xi_ij                            (rows sum to 1)
    attention=distance (FedAMP):     xi_ij = alpha_k A'(||w_i - w_j||^2),  A'(x) = exp(-x/sigma)/sigma
    attention=cosine (HeurFedAMP):   xi_ij = (1 - xi_ii) softmax_{j != i}(sigma cos(w_i, w_j)),
                                     xi_ii = `self_weight`

and sends it down. The client solves  min_w F_i(w) + (mu/2)||w - u_i||^2  from u_i (the proximal
point, objective `prox`; `start=personal` starts from w_i as PFLlib does) and uploads w_i, which is
also its inference model. `mu` is the paper's lambda/alpha_k, decoupled from the attention step so
that a small alpha_k does not freeze the clients.

mu = 0.1 by default (neither paper gives its value for FMNIST; PFLlib's lamda = alphaK = 1 gives 1). The
rule: the largest mu in {1, 0.1, 0} whose personalized models fit their own data as well as Local's (mean
local accuracy within 0.5 points of Local's). Measured at FMNIST Dirichlet 0.5, paper configuration,
round 29 (sweep `sweeps/ablation_fedamp_mu.toml`): mu = 1 gives Loc 69.08 % against Local's 81.31 % (the
anchor to u_i holds the clients back), mu = 0.1 81.11 %, mu = 0 82.72 %. The same rule on the clients' validation
rows (10 % of each client's training rows held out; sweep `sweeps/fedamp_mu_validation.toml`) picks 0.1
again: Local 81.08 %, mu = 1 69.45 %, mu = 0.1 80.98 %, mu = 0 82.47 %.

Guards :
  * distance: xi_ii >= 0 needs alpha_k <= sigma/(N-1) (A' <= 1/sigma); checked at construction for a
    numeric sigma. `alpha_k=max` (default) uses sigma/m_i (m_i = i's neighbours), so xi_ij =
    exp(-d_ij/sigma)/m_i and the self-weight 1 - mean_j exp(-d_ij/sigma) is ~0 next to identical
    peers and ~1 far from all of them.
  * `sigma=auto` (default) sets the kernel width from the data once, at the first message passing
    with two distinct known models, so that FedAMP cannot silently become Local training because
    ||w_i - w_j||^2 grows with P: distance: sigma = median off-diagonal ||w_i - w_j||^2; cosine:
    sigma = 1 / median(1 - cos) (exp(sigma cos) is a kernel of width 1/sigma on 1 - cos). The value
    is recorded (record `fedamp`); a numeric alpha_k above sigma/(N-1) is then capped there. As the
    personalized models move apart the squared distances grow while sigma stays, so the attention drifts
    toward self-only (xi_ii -> 1): every round records the mean and minimum self-weight of the clients
    that uploaded (record `fedamp_attention`). `sigma_update=every_round` re-derives sigma from the
    current models each round instead (the same median rule), which keeps the kernel's scale fixed
    relative to the spread of the models.
    Until sigma is known (round 0: all models equal) u_i = w_i.
Equivalences (tests): cosine with self_weight=1 (or distance with alpha_k=0) and mu=0 is Local;
cosine with sigma=0, self_weight=1/N and mu=0 under full participation is uniform FedAvg.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedprism.algorithms.base import Algorithm, Plan, TrainJob, Update, register, train_update
from fedprism.algorithms.fedprox import prox_job
from fedprism.clustering import cosine_matrix
from fedprism.errors import ConfigError
from fedprism.hparams import Param


@dataclass(frozen=True)
class NumberOr(Param):
    """A number (checked by `check`) or one keyword such as 'auto'."""

    word: str = "auto"

    def validate(self, key, value):
        if value == self.word:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(key, value, f"{self.word!r} or {self.allowed}")
        if self.check is not None and not self.check(value):
            raise ConfigError(key, value, f"{self.word!r} or {self.allowed}")
        return float(value)


@register
class FedAMP(Algorithm):
    name = "fedamp"
    paper = "Huang et al. 2021 (FedAMP, HeurFedAMP); FedPrism paper 4.4 (5)"
    params = {
        "attention": Param("distance", "distance: alpha_k A'(||w_i-w_j||^2) (FedAMP); cosine: HeurFedAMP",
                           choices=("distance", "cosine")),
        "sigma": NumberOr("auto", "kernel: distance width in A' / cosine multiplier; auto = from the data",
                          lambda v: v >= 0, "a number >= 0 (> 0 for attention=distance)"),
        "alpha_k": NumberOr("max", "attention step (distance); max = sigma/#neighbours", lambda v: v >= 0,
                            "a number >= 0", word="max"),
        "self_weight": Param(0.1, "HeurFedAMP self-attention xi_ii (attention=cosine)", lambda v: 0 <= v <= 1,
                             "a number in [0, 1]"),
        "mu": Param(0.1, "client proximal weight (mu/2)||w - u_i||^2 (the paper's lambda/alpha_k)",
                    lambda v: v >= 0, "a number >= 0"),
        "start": Param("cloud", "local training starts from u_i (cloud, paper) or w_i (personal, PFLlib)",
                       choices=("cloud", "personal")),
        "sigma_update": Param("once", "sigma=auto: set once, at the first message passing (once), or again "
                              "from the current models every round (every_round)", choices=("once", "every_round"),
                              new=True),
    }

    @classmethod
    def server_models(cls, hp: dict, clients: int, cohort: int) -> dict:
        return {"clients": 2 * clients}         # every client's w_i, and the cloud models u_i of a round

    @classmethod
    def check_params(cls, hp: dict) -> None:
        if hp["attention"] == "distance" and hp["sigma"] != "auto" and not hp["sigma"] > 0:
            raise ConfigError("fedamp.sigma", hp["sigma"], "a number > 0 or 'auto' for attention=distance")

    def __init__(self, ctx, **hp):
        super().__init__(ctx, **hp)
        sigma, alpha, n1 = self.hp["sigma"], self.hp["alpha_k"], max(ctx.num_clients - 1, 1)
        if self.hp["attention"] == "distance" and sigma != "auto" and alpha != "max" and alpha > sigma / n1:
            raise ConfigError("fedamp.alpha_k", alpha, f"at most sigma/(N-1) = {sigma}/{n1} = "
                              f"{sigma / n1:.4g}, else the self-weight xi_ii is negative (or use 'max')")

    def init_state(self) -> dict:
        N = self.ctx.num_clients
        sigma = None if self.hp["sigma"] == "auto" else self.hp["sigma"]
        return {"w": self.ctx.init.expand(N, -1).clone(), "known": torch.zeros(N, dtype=torch.bool),
                "sigma": sigma}

    # -- attention -----------------------------------------------------------------------------
    def _kernel_input(self, rows: torch.Tensor, peers: torch.Tensor) -> np.ndarray:
        """Squared distances (distance) or 1 - cos (cosine) of every row to every peer, float64."""
        if self.hp["attention"] == "distance":
            return (torch.cdist(rows.double(), peers.double()) ** 2).numpy()
        return 1.0 - cosine_matrix(rows.double().numpy(), peers.double().numpy())

    def attention(self, state: dict, clients: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(xi [n, M], peer ids [M]): row r gives client clients[r]'s weights over the peers.

        Neighbours of i are the other clients that have uploaded at least once (the server's cached
        w_j); a client with no neighbour, or before sigma is known, gets u_i = w_i.
        """
        known = state["known"].numpy()
        peers = np.flatnonzero(known | np.isin(np.arange(len(known)), clients))
        x = self._kernel_input(state["w"][torch.as_tensor(clients)], state["w"][torch.as_tensor(peers)])
        other = peers[None, :] != np.asarray(clients)[:, None]
        nb = other & known[peers][None, :]
        sigma, xi = state["sigma"], np.zeros_like(x)
        if sigma is not None:
            if self.hp["attention"] == "distance":
                a = self.hp["alpha_k"]
                a = sigma / np.maximum(nb.sum(1, keepdims=True), 1) if a == "max" else \
                    min(a, sigma / max(self.ctx.num_clients - 1, 1))
                xi = np.where(nb, a * np.exp(-x / sigma) / sigma, 0.0)
            else:
                x0 = np.where(nb, x, np.inf).min(1, keepdims=True)               # stable softmax
                e = np.exp(np.where(nb, -sigma * (x - np.where(np.isfinite(x0), x0, 0.0)), -np.inf))
                z = e.sum(1, keepdims=True)
                xi = (1.0 - self.hp["self_weight"]) * np.divide(e, z, out=np.zeros_like(e), where=z > 0)
        xi[~other] = 1.0 - xi.sum(1)
        return xi, peers

    def _auto_sigma(self, state: dict) -> float | None:
        peers = torch.nonzero(state["known"]).flatten()
        if len(peers) < 2:
            return None
        x = self._kernel_input(state["w"][peers], state["w"][peers])
        off = x[~np.eye(len(peers), dtype=bool)]
        med = float(np.median(off))
        if not med > 1e-12:
            return None
        return med if self.hp["attention"] == "distance" else 1.0 / med

    # -- the four functions --------------------------------------------------------------------
    def plan(self, state: dict, rnd: int, clients: np.ndarray) -> Plan:
        xi, peers = self.attention(state, clients)
        u = (torch.as_tensor(xi) @ state["w"][torch.as_tensor(peers)].double()).float()
        start = u if self.hp["start"] == "cloud" else state["w"][torch.as_tensor(clients)].clone()
        if self.hp["start"] == "cloud" or self.hp["mu"] == 0:
            return Plan(clients, {"params": start})
        return Plan(clients, {"params": start, "anchor": u})

    def client_update(self, plan: Plan, trainer, rnd: int, cstate: dict) -> Update:
        """min_w F_i(w) + (mu/2)||w - u_i||^2 from the received start (the proximal point u_i itself
        unless `start=personal`)."""
        mu, anchor = self.hp["mu"], plan.payload.get("anchor", plan.start)
        if mu == 0:
            return train_update(trainer, TrainJob(plan.clients, plan.start), rnd)
        return train_update(trainer, prox_job(plan.clients, plan.start, anchor, mu), rnd)

    def aggregate(self, state: dict, rnd: int, update: Update) -> dict:
        records: dict = {}
        if state["sigma"] is not None:                              # diagnostic: how much attention stays home
            xi, peers = self.attention(state, update.clients)
            own = peers[None, :] == np.asarray(update.clients)[:, None]
            records["fedamp_attention"] = {"sigma": state["sigma"], "self_weight_mean": float(xi[own].mean()),
                                           "self_weight_min": float(xi[own].min())}
        S = torch.as_tensor(update.clients)
        state["w"][S] = update.params
        state["known"][S] = True
        if self.hp["sigma"] == "auto" and (state["sigma"] is None or self.hp["sigma_update"] == "every_round"):
            sigma = self._auto_sigma(state)
            if sigma is not None and sigma != state["sigma"]:
                state["sigma"] = sigma
                records["fedamp"] = {"sigma": sigma, "round": rnd}
        return records

    def model_for(self, state: dict, clients: np.ndarray) -> torch.Tensor:
        return state["w"][torch.as_tensor(clients)]
