"""FedPrism, the paper's method (seed 000, section 3, Algorithms 1-2): Prism decomposition + dual stream.

Built on the Fed-PRISM server of report 002 (`fedprism.algorithms.fedprism`): the global step, the
soft-weighted cluster step, K-Means re-clustering with Hungarian identity and the soft assignment are
that module's code (`FedPrism._server_step`, `_update_clusters` -> `recluster`, `soft_cluster_step`,
`personalize`); this module adds what the paper adds: per-client private components P_i, local
specialists L_i, adaptive alpha_i and confidence-routed inference.

Client i (Algorithm 1), with gamma_i = 1 - alpha_i - beta:
    L_i <- train(L_i; D_i)                                            Path A: the local specialist
    P_i <- train(P_i; D_i)                                            Path B step 1: private component
    W_i  = alpha_i G + beta sum_k w_ik C_k + gamma_i P_i              Eq. 1 / line 13
    W'_i = train(W_i; D_i);   h_i = last layer (weights + bias) of W'_i          lines 14-16
Server (Algorithm 2):
    G   <- sum_i n_i/N_t W'_i                                         line 10 (`global_weighting`)
    C_k <- C_k + eta_cluster (sum_i w_ik W'_i / Z_k - C_k)   if Z_k = sum_i w_ik > 0      lines 12-18
    re-cluster: K-Means on h_i; w_ik = softmax_k(cos(h_i, mu_k) / tau)                    lines 21-25
    Delta_i = ||W'_i - C_k*|| - ||W'_i - G||;  alpha_i <- clip(alpha_i + eta_alpha Delta_i) lines 28-31
Inference (Eq. 2-3):  lambda(x) = max softmax(L_i(x) / T);  z = lambda z_L + (1 - lambda) z_W.

Parameters (`fedprism_dual.<name>`): k, m, every, warmup, cluster_on, clustering, features,
temperature (tau), cluster_lr (eta_cluster), global_weighting, alpha, beta, alpha_mode, alpha_lr
(eta_alpha), alpha_signal, components, inference_weight, inference_temperature (T). The names shared
with `fedprism` mean the same thing there.

Decisions where the paper is silent or inconsistent (copy to the README):

* Messages. Down: the server sends each client its pre-mixed shared part
  alpha_i G + beta sum_k w_ik C_k (P floats) and gamma_i (1 float): `Plan.start` and
  `Plan.extras["gamma"]`, `down_floats = P + 1`. The client builds the same W_i as from Algorithm 2
  line 6's literal message (G, all K cluster models, w_i, alpha_i: (K+1) P + K + 1 floats), at 1/(K+1)
  of the traffic. Up: W'_i only (`up_floats = P`); h_i is a slice of W'_i, so it costs nothing extra.
  P_i and L_i never travel (`client_state = ("private", "expert")`): in the simulator they live in
  `state["private"]` / `state["expert"]` ([N, P], checkpointed with the state so a resumed run is
  exact); on a Flower node, in the node's own `Context.state` (`fedprism.flower.node.NodeStore`; the
  server's state has no such keys). `client_update` and `evaluate_client` reach them only through
  `self.client_store` (`rows` / `write`), never through Plan or Update. Evaluation on Flower sends
  each node the same (shared part, gamma_i) as training and the node scores its routed streams. The
  uploaded W'_i is trained from a start that contains gamma_i P_i: that is the paper's protocol.
* What the private update trains (Algorithm 1 line 10): P_i as a stand-alone model, the same
  objective and epochs as every local training, from its persisted value. Then it enters W_i.
  Configurations where P_i has weight 0 forever (components pure_global / global_cluster /
  pure_cluster, or full with fixed alpha and alpha + beta = 1) skip that training: it cannot change
  any number. Likewise the specialist is not trained when `inference_weight = 0` (it is never used).
* Initial values: G, every C_k, every P_i and every L_i start as the run's common initial model, so
  W_i = init in round 0 whatever the coefficients; alpha_i starts at `alpha` (0.9, with beta 0.1: the
  paper's "Full FedPrism" equals its alpha = 0.9, beta = 0.1 row, Tables 3/5); w_i uniform (1/K).
* alpha_i bounds: clipped to [0, 1 - beta] (not [0, 1]) so that gamma_i = 1 - alpha_i - beta >= 0 and
  every mixing row (alpha_i, beta w_i1 .. beta w_iK, gamma_i) is non-negative and sums to 1.
* alpha signal (line 29 names one C_k): k* = the client's highest-weight cluster in the row w_i it
  trained with this round (ties: lowest index); G and C_k* are the models *before* this round's
  server step (the superscript (t)). Norms are over the whole parameter vector.
  `alpha_signal=relative` (default) uses Delta_i / (||W'_i - C_k*|| + ||W'_i - G||), in [-1, 1], so that
  eta_alpha means the same for any model size; `raw` is line 29 literally. Default eta_alpha = 0.1.
  Only clients the server accepted move their alpha_i; others keep theirs.
* Re-clustering: at the end of round t (0-based) when t >= warmup and (t - warmup) % every == 0.
  Defaults every = 10 (section 4.5), warmup = 0 (first clustering after round 0, when the backbones'
  classifiers already tell the label mixes apart; Algorithm 2's "t > Warmup" is warmup = Warmup + 1,
  every = 1). Features h_i = last layer (weights + bias, `ParamSpec.last_layer`) of W'_i. Soft rows use
  every cluster (m = 0 means m = K: Algorithm 2 line 24 normalises over all k) with tau = 0.1 (cosines
  lie in [-1, 1]; tau = 1 would make the rows almost uniform). `cluster_on=reporting` (Algorithm 2:
  the clients of S_t) or `seen` (the latest h_i of every client seen so far, a server-side cache:
  more stable when `every` > 1). Cluster identity, skipped clusterings (fewer points than K) and
  never-clustered clients (uniform rows) follow the 002 server.
* eta_cluster (`cluster_lr`) = 0.5 by default (the paper gives no value; 1 would replace a cluster
  model by the mean of the ~2 backbones it got this round).
* Shuffling streams: the engine seeds batch orders by (seed, rnd, client). The backbone uses `rnd`
  itself (so beta = 0, fixed alpha = 1 is FedAvg bit for bit), the private component
  `rnd + 1_000_000`, the specialist `rnd + 2_000_000`: three independent orders per round.
* Inference model W_i (the "Backbone" stream) for evaluation: alpha_i G + beta sum_k w_ik C_k + gamma_i
  P_i built from the current state (the model the client would build now; `model_for`), not the
  last trained W'_i. Routed logits z (Eq. 3) give the prediction (argmax) and the loss (cross-entropy
  of z). A fixed `inference_weight` w in [0, 1] replaces lambda(x) (Tables 4 / 10); w = 0 is exactly the
  backbone, w = 1 exactly the specialist. Every evaluation
  also stores, from the same logits, each stream alone (`local_acc@backbone`, `global_acc@expert`, ...)
  and the routed accuracy at other temperatures (`global_acc@T=5`, ...: `DIAGNOSTIC_TEMPERATURES`).
* Components (Tables 3 / 9) as mixing coefficients (global, cluster, private):
  full (alpha_i, beta, 1 - alpha_i - beta); global_cluster (alpha_i, 1 - alpha_i, 0), beta unused;
  pure_global (1, 0, 0); pure_cluster (0, 1, 0); pure_private (0, 0, 1). alpha adapts only in full
  and global_cluster (with `alpha_mode=adaptive`). The dual stream stays on in every configuration.
* Routing temperature T (`inference_temperature`, Eq. 2; the paper gives no value): 5. With T = 1 a
  specialist trained on one or two classes is confident on images of the classes it never saw (its
  softmax has nowhere else to go), lambda(x) ~ 1 almost everywhere, and the routed prediction on the
  global test set is barely better than the specialist's own (FMNIST Dirichlet 0.1: 37.4 % vs 34.0 %).
  Dividing by T flattens the specialist's softmax where its margin is small, which hands those inputs
  to the backbone, while inputs it knows keep margins large enough for lambda to stay high. Rule used
  to fix T on the paper configuration (results/README.md, the T=1 run's stored diagnostics): the
  largest T of `DIAGNOSTIC_TEMPERATURES` whose routed local accuracy is at least the specialist's
  alone at the final round and within 0.5 points of it at every evaluation of the second half of
  training: T = 5 (routed Glob 48.3 %, Loc 96.3 %; T = 10: 58.8 % / 96.2 % but up to 1.8 points of
  local accuracy below the specialist in rounds 60-80). Every run stores the other T values as well.
* Clustering methods: kmeans (the paper), ward, average, single; not covariance (the 002 update
  correlation needs Delta_i = W'_i - W_i, and W_i contains the private P_i the server never sees).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from fedprism.algorithms.base import EvalResult, Plan, StateStore, Trainer, Update, register
from fedprism.algorithms.fedprism import FedPrism, personalize
from fedprism.errors import ConfigError
from fedprism.hparams import Param

COMPONENTS = ("full", "pure_global", "global_cluster", "pure_cluster", "pure_private")
#: `rnd` offsets of the three local trainings of one round (see the module docstring)
PRIVATE_STREAM = 1_000_000
EXPERT_STREAM = 2_000_000
#: routing temperatures T scored beside the configured one at every evaluation (diagnostics: training
#: does not depend on T, so one run tells how Eq. 2 behaves for each; `<split>_acc@T=<T>` metrics)
DIAGNOSTIC_TEMPERATURES = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0)
#: fixed values of the 002 server's options that Algorithm 2 implies
_FIXED = {"update": "model", "affinity": "shifted"}


def _inference_weight_ok(v: Any) -> bool:
    if v is None or v == "auto":
        return True
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1


def route(z_expert: torch.Tensor | None, z_backbone: torch.Tensor | None, weight: float | None,
          temperature: float = 1.0) -> torch.Tensor:
    """Eq. 2-3: z = lambda z_L + (1 - lambda) z_W, lambda(x) = max softmax(z_L / T) (or a fixed weight).

    With a fixed weight 0 (1) the expert (backbone) logits may be None and are not needed.
    """
    if weight is not None:
        if weight == 0:
            return z_backbone
        if weight == 1:
            return z_expert
        return weight * z_expert + (1 - weight) * z_backbone
    lam = torch.softmax(z_expert / temperature, dim=-1).amax(-1, keepdim=True)
    return lam * z_expert + (1 - lam) * z_backbone


@register
class FedPrismDual(FedPrism):
    name = "fedprism_dual"
    paper = "FedPrism paper (seed 000) section 3, Algorithms 1-2"
    client_state = ("private", "expert")
    params = {
        "k": Param(5, "number of cluster models K", lambda v: v >= 1, "an integer >= 1"),
        "m": Param(0, "clusters per soft row (0 = all K, Algorithm 2)", lambda v: v >= 0, "an integer >= 0"),
        "every": Param(10, "re-cluster every C rounds after the warm-up (1 = Algorithm 2)", lambda v: v >= 1,
                       "an integer >= 1"),
        "warmup": Param(0, "first re-clustering at the end of this round (0-based)", lambda v: v >= 0,
                        "an integer >= 0"),
        "cluster_on": Param("reporting", "cluster the clients of S_t (reporting) or every client seen (seen)",
                            choices=("reporting", "seen")),
        "clustering": Param("kmeans", "hard clustering of the h_i",
                            choices=("kmeans", "ward", "average", "single")),
        "features": Param("last_layer", "clustering feature h_i: last layer of W'_i (paper) or all of it",
                          choices=("last_layer", "full")),
        "temperature": Param(0.1, "tau: w_ik ~ exp(cos(h_i, mu_k) / tau)", lambda v: v > 0, "a number > 0"),
        "cluster_lr": Param(0.5, "eta_cluster: C_k moves this far toward its soft-weighted mean",
                            lambda v: 0 < v <= 1, "a number in (0, 1]"),
        "global_weighting": Param("samples", "G = n_i/N_t (paper) or 1/|S_t| mean of the W'_i",
                                  choices=("samples", "uniform")),
        "alpha": Param(0.9, "initial global weight alpha_i", lambda v: 0 <= v <= 1, "a number in [0, 1]"),
        "beta": Param(0.1, "cluster weight beta", lambda v: 0 <= v <= 1, "a number in [0, 1]"),
        "alpha_mode": Param("adaptive", "alpha_i adapts (Algorithm 2 D) or stays fixed",
                            choices=("adaptive", "fixed")),
        "alpha_lr": Param(0.1, "eta_alpha", lambda v: v >= 0, "a number >= 0"),
        "alpha_signal": Param("relative", "Delta_i raw (line 29) or divided by the sum of both distances",
                              choices=("relative", "raw")),
        "components": Param("full", "which Prism components the backbone mixes", choices=COMPONENTS),
        "inference_weight": Param(None, "specialist weight at inference: auto (confidence routing, Eq. 2) "
                                  "or a fixed number in [0, 1]", _inference_weight_ok,
                                  "auto or a number in [0, 1]"),
        "inference_temperature": Param(5.0, "T in lambda(x) = max softmax(Expert(x) / T)", lambda v: v > 0,
                                       "a number > 0"),
    }

    def __init__(self, ctx, **hp: Any):
        super().__init__(ctx, **hp)
        self.hp = {**self.hp, **_FIXED, "m": self.hp["m"] or self.hp["k"]}
        self.client_store = None          # StateStore (simulator) or a Flower node's NodeStore

    @classmethod
    def check_params(cls, hp: dict) -> None:
        if hp["m"] > hp["k"]:
            raise ConfigError("fedprism_dual.m", hp["m"],
                              f"an integer in [0, fedprism_dual.k={hp['k']}] (0 = all)")
        if hp["components"] == "full" and hp["alpha"] + hp["beta"] > 1 + 1e-12:
            raise ConfigError("fedprism_dual.alpha", hp["alpha"],
                              f"a number in [0, 1 - beta] = [0, {1 - hp['beta']:g}] "
                              "(gamma = 1 - alpha - beta >= 0)")
        w = hp["inference_weight"]
        hp["inference_weight"] = None if w in (None, "auto") else float(w)

    # -- structure ---------------------------------------------------------------------------------
    @property
    def adaptive(self) -> bool:
        return self.hp["alpha_mode"] == "adaptive" and self.hp["components"] in ("full", "global_cluster")

    @property
    def alpha_max(self) -> float:
        return 1.0 - self.hp["beta"] if self.hp["components"] == "full" else 1.0

    @property
    def uses_private(self) -> bool:
        c, hp = self.hp["components"], self.hp
        has_room = hp["alpha"] + hp["beta"] < 1 - 1e-12
        return c == "pure_private" or (c == "full" and (self.adaptive or has_room))

    @property
    def uses_expert(self) -> bool:
        return self.hp["inference_weight"] != 0

    def mixing(self, alpha: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(global, cluster, private) coefficients [n] float64 for clients with global weights `alpha`."""
        a = alpha.to(torch.float64)
        one, zero = torch.ones_like(a), torch.zeros_like(a)
        c = self.hp["components"]
        if c == "full":
            b = torch.full_like(a, self.hp["beta"])
            return a, b, (1 - a - b).clamp(min=0)
        if c == "global_cluster":
            return a, 1 - a, zero
        return {"pure_global": (one, zero, zero), "pure_cluster": (zero, one, zero),
                "pure_private": (zero, zero, one)}[c]

    # -- state ---------------------------------------------------------------------------------------
    def init_state(self) -> dict:
        state = super().init_state()
        N, init = self.ctx.num_clients, self.ctx.init
        fixed = {"pure_global": 1.0, "pure_cluster": 0.0, "pure_private": 0.0}
        a0 = fixed.get(self.hp["components"], self.hp["alpha"])
        state["alpha"] = torch.full((N,), a0, dtype=torch.float64)
        # client-side store (never part of a message): private components and local specialists
        state["private"] = init.expand(N, -1).clone()
        state["expert"] = init.expand(N, -1).clone()
        if self.hp["cluster_on"] == "seen":
            d = len(range(self.ctx.spec.size)[self._feature_slice()])
            state["h"] = torch.zeros(N, d, dtype=torch.float64)
            state["h_seen"] = torch.zeros(N, dtype=torch.bool)
        return state

    def _shared(self, state: dict, clients: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The server's part alpha_i G + beta sum_k w_ik C_k [n, P] and gamma_i [n] (float64)."""
        S = torch.as_tensor(clients)
        a, b, g = self.mixing(state["alpha"][S])
        return personalize(state["w_g"], state["w_c"], state["W"][S], a, b), g

    @staticmethod
    def _add_private(shared: torch.Tensor, gamma: torch.Tensor, private: torch.Tensor) -> torch.Tensor:
        return (shared.double() + gamma.to(torch.float64)[:, None] * private.double()).to(shared.dtype)

    # -- the four functions ----------------------------------------------------------------------------
    def plan(self, state: dict, rnd: int, clients: np.ndarray) -> Plan:
        self.client_store = StateStore(state)   # the simulator's client-side store (module docstring)
        shared, gamma = self._shared(state, clients)
        return Plan(clients, shared, extras={"gamma": gamma.to(torch.float32)},
                    down_floats=self.ctx.spec.size + 1)

    def client_update(self, plan: Plan, trainer: Trainer, rnd: int) -> Update:
        """Algorithm 1 for the cohort: three engine trainings (specialists, private parts, backbones)."""
        if self.client_store is None:
            raise RuntimeError("fedprism_dual: plan() must run before client_update() "
                               "(it binds the client store)")
        store, S = self.client_store, plan.clients
        new_expert = new_private = None
        if self.uses_expert:                                                  # Path A
            new_expert = trainer.train(Plan(S, store.rows("expert", S).clone()), rnd + EXPERT_STREAM).params
        private = store.rows("private", S)
        if self.uses_private:                                                 # Path B, step 1
            new_private = trainer.train(Plan(S, private.clone()), rnd + PRIVATE_STREAM).params
            private = new_private
        start = self._add_private(plan.start, plan.extras["gamma"], private.to(plan.start.device))  # step 2
        up = trainer.train(Plan(S, start), rnd)
        # commit the client-side state only once all three trainings succeeded
        if new_expert is not None:
            store.write("expert", S, new_expert)
        if new_private is not None:
            store.write("private", S, new_private)
        return Update(plan.clients, up.params, plan.start, up.n_samples,
                      {"train_loss": up.extras.get("train_loss")} if "train_loss" in up.extras else {},
                      up_floats=self.ctx.spec.size)

    def aggregate(self, state: dict, rnd: int, update: Update) -> dict:
        if len(update.clients) == 0:
            return {}
        S = torch.as_tensor(update.clients)
        g_old, c_old, W_used = state["w_g"].clone(), state["w_c"].clone(), state["W"][S].clone()
        if self.hp["cluster_on"] == "seen":
            state["h"][S] = update.params[:, self._feature_slice()].double().cpu()
            state["h_seen"][S] = True
        records = super().aggregate(state, rnd, update)          # lines 9-26 (002 server code)
        if self.adaptive:                                         # lines 27-31
            ks = W_used.argmax(1)
            W = update.params.double()
            d_c = (W - c_old[ks].double()).norm(dim=1)
            d_g = (W - g_old.double()).norm(dim=1)
            sig = d_c - d_g
            if self.hp["alpha_signal"] == "relative":
                tot = d_c + d_g
                sig = torch.where(tot > 0, sig / tot.clamp(min=1e-300), torch.zeros_like(sig))
            new = (state["alpha"][S] + self.hp["alpha_lr"] * sig).clamp(0.0, self.alpha_max)
            state["alpha"][S] = new
            records["alpha"] = {"clients": update.clients, "alpha": new.numpy().round(6),
                                "signal": sig.numpy().round(6), "cluster": ks.numpy()}
        return records

    def _recluster_due(self, rnd: int) -> bool:
        w = self.hp["warmup"]
        return rnd >= w and (rnd - w) % self.hp["every"] == 0

    def _cluster_features(self, state: dict, update: Update) -> tuple[np.ndarray, np.ndarray]:
        if self.hp["cluster_on"] == "seen":
            clients = np.flatnonzero(state["h_seen"].numpy())
            return clients, state["h"][torch.as_tensor(clients)].numpy()
        return super()._cluster_features(state, update)

    def model_for(self, state: dict, clients: np.ndarray) -> torch.Tensor:
        """The backbone stream W_i = alpha_i G + beta sum_k w_ik C_k + gamma_i P_i (for evaluation)."""
        shared, gamma = self._shared(state, clients)
        return self._add_private(shared, gamma, state["private"][torch.as_tensor(clients)])

    # -- dual-stream evaluation (Eq. 2-3) ------------------------------------------------------------------
    def evaluate(self, state: dict, trainer: Trainer, clients: np.ndarray, split: str) -> EvalResult:
        """Routed predictions of every client's (specialist, backbone) pair on its split.

        On Flower (`trainer.remote`) the streams exist only on the nodes: the trainer sends each client
        its `eval_payload` and the node scores it with `evaluate_client`.
        """
        if getattr(trainer, "remote", False):
            rows, extras = self.eval_payload(state, clients)
            return trainer.evaluate_payload(self, rows, extras, np.asarray(clients), split)
        S = torch.as_tensor(np.asarray(clients))
        return self.score_streams(trainer, clients, self.model_for(state, clients), state["expert"][S], split)

    def eval_payload(self, state: dict, clients: np.ndarray) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The server's part of the backbone and gamma_i: what `plan` sends, so P_i and L_i stay home."""
        shared, gamma = self._shared(state, clients)
        return shared, {"gamma": gamma}

    def evaluate_client(self, trainer: Trainer, clients: np.ndarray, rows: torch.Tensor,
                        extras: dict[str, torch.Tensor], split: str) -> EvalResult:
        store = self.client_store
        backbone = self._add_private(rows, extras["gamma"].reshape(-1), store.rows("private", clients).to(rows.device))
        return self.score_streams(trainer, clients, backbone, store.rows("expert", clients), split)

    def score_streams(self, trainer: Trainer, clients: np.ndarray, backbone: torch.Tensor, expert: torch.Tensor,
                      split: str) -> EvalResult:
        """Eq. 2-3 scores of (backbone, specialist) row pairs on each client's split.

        Both streams' logits come from `trainer.logits` on chunks of the test samples (`eval_chunk`)
        for groups of clients. On the global test set the specialists' logits are cached per client
        (keyed by a hash of the specialist's parameters, so exact): only the ~fraction of specialists
        that trained since the last evaluation are run again, which halves the evaluation work.
        """
        if split not in ("local", "global", "train"):
            raise ValueError(f"split must be local, global or train, got {split!r}")
        clients = np.asarray(clients)
        n, C = len(clients), self.ctx.num_classes
        weight, T = self.hp["inference_weight"], self.hp["inference_temperature"]
        need_b, need_e = weight != 1, weight != 0
        # the engine's preferred call shape (the vectorized engine: eval_models x eval_samples, compiled)
        chunk = int(getattr(trainer, "eval_samples", 0) or getattr(getattr(trainer, "cfg", None), "eval_chunk", 500)
                    or 500)
        dev = torch.device(getattr(trainer, "device", "cpu"))
        width = getattr(trainer, "eval_models", None)
        budget = chunk * width if width else 1 << (18 if dev.type == "cuda" else 13)  # model-samples per call
        correct = torch.zeros(n, dtype=torch.long)
        loss = torch.zeros(n, dtype=torch.float64)
        count = torch.zeros(n, dtype=torch.long)
        conf = torch.zeros(n, C, C, dtype=torch.long)
        alt: dict[str, torch.Tensor] = {}       # diagnostics: each stream alone, other temperatures

        def score(rows: slice, x: torch.Tensor, y: torch.Tensor, z_e: torch.Tensor | None = None) -> None:
            m = rows.stop - rows.start
            run_e = need_e and z_e is None
            stacks = [p[rows] for p, live in ((expert, run_e), (backbone, need_b)) if live]
            z = trainer.logits(torch.cat(stacks), x) if stacks else None      # [len(stacks) * m, B, C]
            if run_e:
                z_e = z[:m]
            z_b = z[-m:] if need_b else None
            out = route(z_e, z_b, weight, T).float()
            yy = y.to(out.device).expand(m, -1)
            pred = out.argmax(-1)
            correct[rows] += (pred == yy).sum(1).cpu()
            loss[rows] += F.cross_entropy(out.reshape(-1, C), yy.reshape(-1), reduction="none") \
                .view(m, -1).double().sum(1).cpu()
            count[rows] += len(y)
            own = torch.arange(m, device=out.device)[:, None] * (C * C)
            cells = (own + yy * C + pred).reshape(-1)
            conf[rows] += torch.bincount(cells, minlength=m * C * C).view(m, C, C).cpu()
            if z_e is None or z_b is None:
                return
            others = {"backbone": z_b, "expert": z_e}
            if weight is None:
                others.update({f"T={t:g}": route(z_e, z_b, None, t) for t in DIAGNOSTIC_TEMPERATURES if t != T})
            for name, z_alt in others.items():
                hit = (z_alt.argmax(-1) == yy).sum(1).cpu()
                alt.setdefault(name, torch.zeros(n, dtype=torch.long))[rows] += hit

        with torch.no_grad():
            if split == "global":
                x_all, y_all = trainer._split(int(clients[0]) if n else 0, "global")
                cached = None
                if need_e:
                    cached = self._expert_logits(trainer, expert, clients, x_all, chunk, budget)
                streams = max(1, int(need_b) + int(need_e and cached is None))
                per = max(1, budget // (chunk * streams))
                ids = torch.as_tensor(clients)
                for g0 in range(0, n, per):
                    rows = slice(g0, min(n, g0 + per))
                    for s0 in range(0, len(y_all), chunk):
                        z_e = None if cached is None else cached[ids[rows], s0:s0 + chunk]
                        score(rows, x_all[s0:s0 + chunk], y_all[s0:s0 + chunk], z_e)
            else:
                for i, c in enumerate(clients):
                    x_all, y_all = trainer._split(int(c), split)
                    for s0 in range(0, len(y_all), chunk):
                        score(slice(i, i + 1), x_all[s0:s0 + chunk], y_all[s0:s0 + chunk])
        return EvalResult(correct, loss, count, conf, alt)

    #: largest specialist-logit cache on the global test set (bytes); beyond it logits are recomputed
    EXPERT_CACHE_BYTES = 512 << 20

    def _expert_logits(self, trainer: Trainer, expert: torch.Tensor, clients: np.ndarray, x: torch.Tensor,
                       chunk: int, budget: int) -> torch.Tensor | None:
        """[N, N_test, C] specialist logits on the global test set, refreshed for changed specialists."""
        N, C = self.ctx.num_clients, self.ctx.num_classes
        if N * len(x) * C * 4 > self.EXPERT_CACHE_BYTES:
            return None
        cache = getattr(self, "_cache", None)
        if cache is None or cache["trainer"] is not trainer or cache["n_test"] != len(x):
            cache = self._cache = {"trainer": trainer, "n_test": len(x), "hash": [b""] * N, "logits": None}
        rows = expert.detach().to("cpu", torch.float32).contiguous().numpy()
        hashes = [hashlib.blake2b(r.tobytes(), digest_size=16).digest() for r in rows]
        stale = [i for i, c in enumerate(clients) if cache["hash"][int(c)] != hashes[i]]
        if stale:
            per = max(1, budget // chunk)
            for g0 in range(0, len(stale), per):
                grp = stale[g0:g0 + per]
                params = expert[torch.as_tensor(grp)]
                for s0 in range(0, len(x), chunk):
                    z = trainer.logits(params, x[s0:s0 + chunk])
                    if cache["logits"] is None:
                        cache["logits"] = torch.zeros(N, len(x), C, device=z.device, dtype=z.dtype)
                    cache["logits"][torch.as_tensor(clients[grp]), s0:s0 + chunk] = z
            for i in stale:
                cache["hash"][int(clients[i])] = hashes[i]
        return cache["logits"]
