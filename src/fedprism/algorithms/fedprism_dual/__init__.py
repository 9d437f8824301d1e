"""FedPrism, the paper's method (FedPrism paper, arXiv:2603.08252, section 3, Algorithms 1-2): Prism
decomposition + dual stream.

Built on the Fed-PRISM server of the technical report (`fedprism.algorithms.fedprism`): the global step, the
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
  alpha_i G + beta sum_k w_ik C_k (P floats) and gamma_i (1 float): payload 'params' and 'gamma'.
  The client builds the same W_i as from Algorithm 2 line 6's literal message (G, all K cluster
  models, w_i, alpha_i: (K+1) P + K + 1 floats), at 1/(K+1) of the traffic. Up: W'_i only ('params');
  h_i is a slice of W'_i, so it costs nothing extra. P_i and L_i never travel: they are declared
  client state (`client_state`), kept by the runner (in memory and in checkpoints in the simulator, in
  each node's `Context.state` on Flower); `client_update` receives their rows and returns the new
  ones. Evaluation sends each client the same (shared part, gamma_i) as training (`eval_payload`) and
  the client predicts from its own streams (`inference`). The uploaded W'_i is trained from a start
  that contains gamma_i P_i: that is the paper's protocol.
* What the private update trains (Algorithm 1 line 10): P_i as a stand-alone model, the same
  objective and epochs as every local training, from its persisted value. Then it enters W_i.
  Configurations where P_i has weight 0 forever (components pure_global / global_cluster /
  pure_cluster, or full with fixed alpha and alpha + beta = 1) skip that training: it cannot change
  any number. Likewise the specialist is not trained when `inference_weight = 0` (it is never used).
* `private_source=specialist` (default `own`): P_i and L_i are one persisted model. Algorithm 1 lines 7
  and 10 apply the same update to the same initial value on the same data, so with the pseudocode's
  deterministic gradient steps L_i^(t) = P_i^(t) at every t; what tells them apart in `own` is only that
  they draw separate batch orders. Sharing them saves one of the three local trainings per participation
  and one N x P client state (`tests/test_fedprism_dual.py` shows it equals `own` with the private
  model trained on the specialist's batch order, bit for bit). Default `own` keeps the stored runs.
* Initial values: G, every C_k, every P_i and every L_i start as the run's common initial model, so
  W_i = init in round 0 whatever the coefficients; alpha_i starts at `alpha` (0.9, with beta 0.1: the
  paper's "Full FedPrism" equals its alpha = 0.9, beta = 0.1 row, Tables 3/5); w_i uniform (1/K).
* alpha_i bounds: clipped to [0, 1 - beta] (not [0, 1]) so that gamma_i = 1 - alpha_i - beta >= 0 and
  every mixing row (alpha_i, beta w_i1 .. beta w_iK, gamma_i) is non-negative and sums to 1.
  `alpha_rule=as_printed` runs lines 28-31 literally instead: raw Delta, the C_k of line 29 with k = K
  (the value the loop of lines 12-19 leaves), alpha clipped to [0, 1], gamma_i = 1 - alpha_i - beta
  (negative when alpha_i > 1 - beta).
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
  never-clustered clients (uniform rows) follow the Fed-PRISM server.
* eta_cluster (`cluster_lr`) = 0.5 by default (the paper gives no value; 1 would replace a cluster
  model by the mean of the ~2 backbones it got this round).
* Shuffling streams: three named random streams per round (`TrainJob.stream`): the backbone trains on
  the default stream 'train' (so beta = 0, fixed alpha = 1 is FedAvg bit for bit), the private
  component on 'private', the specialist on 'expert': three independent batch orders. The specialist
  and private trainings depend on nothing of this round, so they go to the engine together
  (`train_together`: one vectorized pass on a GPU, each row on its own stream); the backbone's start
  needs the new P_i and trains after them.
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
* Clustering methods: kmeans (the paper), ward, average, single; not covariance (the Fed-PRISM server's update
  correlation needs Delta_i = W'_i - W_i, and W_i contains the private P_i the server never sees).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch

from fedprism.algorithms.aggregation import personalize
from fedprism.algorithms.base import ClientState, Inference, Plan, TrainJob, Update, register
from fedprism.algorithms.fedprism import FedPrism
from fedprism.errors import ConfigError
from fedprism.hparams import Param
from fedprism.protocol import train_together

COMPONENTS = ("full", "pure_global", "global_cluster", "pure_cluster", "pure_private")
#: routing temperatures T scored beside the configured one at every evaluation (diagnostics: training
#: does not depend on T, so one run tells how Eq. 2 behaves for each; `<split>_acc@T=<T>` metrics)
DIAGNOSTIC_TEMPERATURES = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0)
#: fixed values of the Fed-PRISM server's options that Algorithm 2 implies
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


ROUTINGS = ("confidence", "seen_mass", "prior", "margin")
"""How the specialist and the backbone combine at inference (`routing`, evaluation-only):

    confidence  lambda(x) = max softmax(z_L / T)                       (the paper's Eq. 2)
    margin      lambda(x) = p_1 - p_2 of softmax(z_L / T)              (top-1 minus top-2 probability)
    seen_mass   lambda(x) = sum_{y seen by the client} softmax(z_W)_y   (the backbone's belief that x is of a
                                                                        class the client has; its own label
                                                                        counts, never sent)
    and z = lambda z_L + (1 - lambda) z_W for these three;
    prior       log p(y|x) = log softmax(z_W) + log softmax(z_L) - log pi_i(y), pi_i the client's label
                distribution with add-one smoothing: a product of the two experts with the specialist's
                label prior divided out (the backbone's training prior is close to uniform).
"""


def routing_weight(rule: str, z_e: torch.Tensor, z_b: torch.Tensor, seen: torch.Tensor | None,
                   temperature: float) -> torch.Tensor:
    """lambda(x) [m, B, 1] of the mixing rules (confidence, margin, seen_mass)."""
    if rule == "confidence":
        return torch.softmax(z_e / temperature, dim=-1).amax(-1, keepdim=True)
    if rule == "margin":
        top = torch.softmax(z_e / temperature, dim=-1).topk(2, dim=-1).values
        return (top[..., :1] - top[..., 1:2])
    if rule == "seen_mass":
        return (torch.softmax(z_b, dim=-1) * seen[:, None, :]).sum(-1, keepdim=True)
    raise ValueError(f"routing must be one of {ROUTINGS}, got {rule!r}")


def combine(rule: str, z_e: torch.Tensor, z_b: torch.Tensor, extras: dict, temperature: float) -> torch.Tensor:
    """The routed logits of one rule (see ROUTINGS)."""
    if rule == "prior":
        log_prior = torch.log(extras["prior"]).to(z_e.dtype)[:, None, :]
        return torch.log_softmax(z_b, -1) + torch.log_softmax(z_e, -1) - log_prior
    lam = routing_weight(rule, z_e, z_b, extras.get("seen"), temperature)
    return lam * z_e + (1 - lam) * z_b


def _shared(name: str, **changes: Any) -> Param:
    """The Fed-PRISM server's parameter `name`, with this method's default / help / choices."""
    return replace(FedPrism.params[name], **changes)


@register
class FedPrismDual(FedPrism):
    name = "fedprism_dual"
    paper = "FedPrism paper, arXiv:2603.08252, section 3, Algorithms 1-2"
    client_state = {"private": ClientState(("P",), init="model"), "expert": ClientState(("P",), init="model")}
    predictions = {"backbone": "backbone alone", "expert": "expert alone",
                   **{f"T={t:g}": f"T={t:g}" for t in DIAGNOSTIC_TEMPERATURES},
                   **{r: f"routing {r}" for r in ROUTINGS if r != "confidence"}}
    params = {
        "k": FedPrism.params["k"],
        "m": Param(0, "clusters per soft row (0 = all K, Algorithm 2)", lambda v: v >= 0, "an integer >= 0"),
        "every": _shared("every", help="re-cluster every C rounds after the warm-up (1 = Algorithm 2)"),
        "warmup": Param(0, "first re-clustering at the end of this round (0-based)", lambda v: v >= 0,
                        "an integer >= 0"),
        "cluster_on": Param("reporting", "cluster the clients of S_t (reporting) or every client seen (seen)",
                            choices=("reporting", "seen")),
        "clustering": _shared("clustering", help="hard clustering of the h_i",
                              choices=("kmeans", "ward", "average", "single")),
        "features": _shared("features", default="last_layer",
                            help="clustering feature h_i: last layer of W'_i (paper) or all of it"),
        "temperature": _shared("temperature", default=0.1, help="tau: w_ik ~ exp(cos(h_i, mu_k) / tau)"),
        "cluster_lr": _shared("cluster_lr", default=0.5,
                              help="eta_cluster: C_k moves this far toward its soft-weighted mean"),
        "global_weighting": _shared("global_weighting", default="samples",
                                    help="G = n_i/N_t (paper) or 1/|S_t| mean of the W'_i"),
        "alpha": _shared("alpha", default=0.9, help="initial global weight alpha_i"),
        "beta": Param(0.1, "cluster weight beta", lambda v: 0 <= v <= 1, "a number in [0, 1]"),
        "alpha_mode": Param("adaptive", "alpha_i adapts (Algorithm 2 D) or stays fixed",
                            choices=("adaptive", "fixed")),
        "alpha_lr": Param(0.1, "eta_alpha", lambda v: v >= 0, "a number >= 0"),
        "alpha_signal": Param("relative", "Delta_i raw (line 29) or divided by the sum of both distances",
                              choices=("relative", "raw")),
        "alpha_rule": Param("reading", "reading: the module docstring's reading of Algorithm 2 lines 28-31 (k* = the "
                            "client's top cluster, alpha in [0, 1 - beta], gamma >= 0); as_printed: the lines "
                            "literally (raw Delta with C_K, the cluster index the loop of lines 12-19 ends on; "
                            "alpha clipped to [0, 1]; gamma = 1 - alpha - beta, negative when alpha > 1 - beta)",
                            choices=("reading", "as_printed"), new=True),
        "components": Param("full", "which Prism components the backbone mixes", choices=COMPONENTS),
        "private_source": Param("own", "own: P_i trained on its own batch order (stream 'private'); specialist: "
                                "P_i is L_i (Algorithm 1 lines 7 and 10 are the same update of the same start on "
                                "the same data), one training fewer per participation",
                                choices=("own", "specialist"), new=True),
        "inference_weight": Param(None, "specialist weight at inference: auto (confidence routing, Eq. 2) "
                                  "or a fixed number in [0, 1]", _inference_weight_ok,
                                  "auto or a number in [0, 1]", eval_only=True),
        "inference_temperature": Param(5.0, "T in lambda(x) = max softmax(Expert(x) / T)", lambda v: v > 0,
                                       "a number > 0", eval_only=True),
        "routing": Param("confidence", "how the specialist and the backbone combine (confidence: Eq. 2; margin; "
                         "seen_mass; prior: see fedprism_dual.ROUTINGS)", choices=ROUTINGS, eval_only=True, new=True),
    }                                # + the shared server step on G and the C_k (FedPrism.averages, _server_step)

    def __init__(self, ctx, **hp: Any):
        super().__init__(ctx, **hp)
        self.hp = {**self.hp, **_FIXED, "m": self.hp["m"] or self.hp["k"]}
        if self.private_is_specialist:                      # one persisted model serves as P_i and L_i
            self.client_state = {"expert": ClientState(("P",), init="model")}

    @classmethod
    def headline(cls, config: dict[str, Any]) -> str:
        w = config.get(f"{cls.name}.inference_weight")
        if w is None or w == "auto":
            rule = config.get(f"{cls.name}.routing", "confidence")
            t = f"T={config.get(f'{cls.name}.inference_temperature', 1.0):g}"
            return f"routed, {t}" if rule == "confidence" else f"routed, {rule}" + (f", {t}" if rule == "margin" else "")
        return f"fixed specialist weight {w:g}"

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

    @classmethod
    def clusters_cohort(cls, hp: dict) -> bool:
        return hp["cluster_on"] == "reporting"          # `seen` clusters every client seen so far

    @classmethod
    def server_models(cls, hp: dict, clients: int, cohort: int) -> dict:
        out = super().server_models(hp, clients, cohort)
        if hp["cluster_on"] == "seen" and hp["features"] == "full":
            out["cluster_on"] = 4 * clients   # every client's last feature (d = P) in float64, and a copy
        return out

    # -- structure ---------------------------------------------------------------------------------
    @property
    def adaptive(self) -> bool:
        return self.hp["alpha_mode"] == "adaptive" and self.hp["components"] in ("full", "global_cluster")

    @property
    def as_printed(self) -> bool:
        return self.hp["alpha_rule"] == "as_printed"

    @property
    def alpha_max(self) -> float:
        return 1.0 - self.hp["beta"] if self.hp["components"] == "full" and not self.as_printed else 1.0

    @property
    def uses_private(self) -> bool:
        c, hp = self.hp["components"], self.hp
        has_room = hp["alpha"] + hp["beta"] < 1 - 1e-12
        return c == "pure_private" or (c == "full" and (self.adaptive or has_room))

    @property
    def uses_expert(self) -> bool:
        return self.hp["inference_weight"] != 0 or self.private_is_specialist

    @property
    def private_is_specialist(self) -> bool:
        return self.hp["private_source"] == "specialist"

    def _private(self, cstate: dict) -> torch.Tensor:
        return cstate["expert" if self.private_is_specialist else "private"]

    def mixing(self, alpha: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(global, cluster, private) coefficients [n] float64 for clients with global weights `alpha`."""
        a = alpha.to(torch.float64)
        one, zero = torch.ones_like(a), torch.zeros_like(a)
        c = self.hp["components"]
        if c == "full":
            b = torch.full_like(a, self.hp["beta"])
            return a, b, (1 - a - b) if self.as_printed else (1 - a - b).clamp(min=0)
        if c == "global_cluster":
            return a, 1 - a, zero
        return {"pure_global": (one, zero, zero), "pure_cluster": (zero, one, zero),
                "pure_private": (zero, zero, one)}[c]

    # -- state ---------------------------------------------------------------------------------------
    def init_state(self) -> dict:
        state = super().init_state()
        N = self.ctx.num_clients
        fixed = {"pure_global": 1.0, "pure_cluster": 0.0, "pure_private": 0.0}
        a0 = fixed.get(self.hp["components"], self.hp["alpha"])
        state["alpha"] = torch.full((N,), a0, dtype=torch.float64)
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

    # -- the round -------------------------------------------------------------------------------------
    def plan(self, state: dict, rnd: int, clients: np.ndarray) -> Plan:
        shared, gamma = self._shared(state, clients)
        return Plan(clients, {"params": shared, "gamma": gamma.to(torch.float32)})

    def client_update(self, plan: Plan, trainer, rnd: int, cstate: dict) -> Update:
        """Algorithm 1 for the cohort: three trainings (specialists, private parts, backbones)."""
        S, new, jobs = plan.clients, {}, {}
        if self.uses_expert:                                                  # Path A
            jobs["expert"] = TrainJob(S, cstate["expert"].clone(), stream="expert")
        if self.uses_private and not self.private_is_specialist:              # Path B, step 1
            jobs["private"] = TrainJob(S, cstate["private"].clone(), stream="private")
        # Path A and step 1 of Path B are independent: one pass where the engine fuses jobs (GPU)
        new = {k: t.params for k, t in zip(jobs, train_together(trainer, list(jobs.values()), rnd))}
        private = self._private(cstate)
        if self.private_is_specialist:                                        # step 1 is Path A's update
            private = new.get("expert", private)
        elif self.uses_private:
            private = new["private"]
        start = self._add_private(plan.start, plan.payload["gamma"], private.to(plan.start.device))  # step 2
        t = trainer.train(TrainJob(S, start), rnd)
        return Update(S, {"params": t.params}, t.n_samples, {"train_loss": t.loss}, client_state=new)

    def aggregate(self, state: dict, rnd: int, update: Update) -> dict:
        S = torch.as_tensor(update.clients)
        g_old, c_old, W_used = state["w_g"].clone(), state["w_c"].clone(), state["W"][S].clone()
        if self.hp["cluster_on"] == "seen":
            state["h"][S] = update.params[:, self._feature_slice()].double().cpu()
            state["h_seen"][S] = True
        records = super().aggregate(state, rnd, update)          # lines 9-26 (the server's code)
        if self.adaptive:                                         # lines 27-31
            ks = W_used.argmax(1)
            if self.as_printed:                                   # line 29 literally: C_k with k = K
                ks = torch.full_like(ks, self.hp["k"] - 1)
            W = update.params.double()
            d_c = (W - c_old[ks].double()).norm(dim=1)
            d_g = (W - g_old.double()).norm(dim=1)
            sig = d_c - d_g
            if self.hp["alpha_signal"] == "relative" and not self.as_printed:
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
        """The server's part of the backbone (without gamma_i P_i, which only the client holds)."""
        return self._shared(state, clients)[0]

    # -- dual-stream inference (Eq. 2-3) ------------------------------------------------------------------
    def eval_payload(self, state: dict, clients: np.ndarray) -> dict:
        """The server's part of the backbone and gamma_i: what `plan` sends, so P_i and L_i stay home."""
        shared, gamma = self._shared(state, clients)
        return {"params": shared, "gamma": gamma}

    def inference(self, trainer, clients, payload: dict, cstate: dict) -> Inference:
        """Backbone W_i = shared part + gamma_i P_i (built from the current state, the model the client
        would build now) and the specialist L_i, routed by Eq. 2-3; each stream alone and the routing at
        the other `DIAGNOSTIC_TEMPERATURES` are stored as alternative predictions."""
        weight, T = self.hp["inference_weight"], self.hp["inference_temperature"]
        params = payload["params"]
        backbone = self._add_private(params, payload["gamma"].reshape(-1), self._private(cstate).to(params.device))
        if weight == 0:
            return Inference({"backbone": backbone})
        if weight == 1:
            return Inference({"expert": cstate["expert"]})
        rule = self.hp["routing"]
        alternatives = {"backbone": lambda z, e: z["backbone"], "expert": lambda z, e: z["expert"]}
        extras = self._label_prior(clients, cstate["expert"].device)
        if weight is None:
            alternatives.update({f"T={t:g}": (lambda z, e, t=t: route(z["expert"], z["backbone"], None, t))
                                 for t in DIAGNOSTIC_TEMPERATURES if not (rule == "confidence" and t == T)})
            alternatives.update({r: (lambda z, e, r=r: combine(r, z["expert"], z["backbone"], e, T))
                                 for r in ROUTINGS if r not in ("confidence", rule)})
            head = lambda z, e: combine(rule, z["expert"], z["backbone"], e, T)  # noqa: E731
        else:
            head = lambda z, e: route(z["expert"], z["backbone"], weight, T)  # noqa: E731
        return Inference({"expert": cstate["expert"], "backbone": backbone}, head, alternatives, extras)

    def _label_prior(self, clients, device) -> dict:
        """Each client's own label distribution (add-one smoothed) and seen-class mask, from its train label
        counts (`ctx.label_hist`, which a client knows of itself; computed once per federation)."""
        C = self.ctx.num_classes
        counts = torch.as_tensor(self.ctx.label_hist[np.asarray(clients, dtype=np.int64)], dtype=torch.float64)
        prior = (counts + 1) / (counts.sum(1, keepdim=True) + C)
        return {"prior": prior.float().to(device), "seen": (counts > 0).float().to(device)}