"""Local DP-SGD through Opacus: sample-level differential privacy of what a client trains on its data.

Opt-in with `dp.local = dpsgd` (with `dp.local_clip` C, `dp.local_noise` z, `dp.local_delta`). Every local
training of a qualifying method (`DPSGD_METHODS`) runs DP-SGD (Abadi, Chu, Goodfellow, McMahan, Mironov,
Talwar, Zhang 2016, "Deep Learning with Differential Privacy", CCS 2016, arXiv:1607.00133) instead of the
engine's plain step, with Opacus (Yousefpour et al. 2021, "Opacus: User-Friendly Differential Privacy Library
in PyTorch", arXiv:2109.12298) doing the private part of each step:

* the batch: Poisson sampling, each of the client's n_i training samples independently with probability
  q_i = min(1, B / n_i) (B = `batch_size`), for T_i = epochs x ceil(n_i / B) steps, as many as the plain
  loop takes (`fedprism.engine.base.n_batches`); the draws come from a named stream of the run seed;
* the per-sample gradients: Opacus' `GradSampleModule` (hooks on a copy of the run's model holding the
  current parameters), of the per-sample cross-entropy;
* clipping and noise: Opacus' `DPOptimizer.pre_step`: each per-sample gradient g_j scaled by
  min(1, C / (||g_j|| + 1e-6)) (Opacus' constant), summed, N(0, (z C)^2) added to every coordinate of the
  sum, and the sum divided by the expected batch size min(B, n_i) (Opacus' convention for a mean loss): the
  noise's standard deviation on the gradient the optimiser gets is z C / min(B, n_i);
* the step itself: fedprism's optimiser (`fedprism.engine.base.optimizer_step_`: SGD with momentum and
  weight decay, or Adam) on that gradient, plus, for FedProx's and Ditto's proximal objective, the exact
  gradient mu (w - anchor) of the penalty: it reads no sample, so adding it is post-processing.

The epsilon a client has spent is that of its steps so far at (q_i, z) by Opacus' RDP accountant
(`opacus.accountants.RDPAccountant`, Mironov, Talwar, Zhang 2019, "Renyi Differential Privacy of the Sampled
Gaussian Mechanism", arXiv:1908.10530) at `dp.local_delta`, under add/remove-one-sample adjacency within
the client's data. docs/privacy.md has the decisions (which methods qualify, what is and is not covered).
"""

from __future__ import annotations

import copy
import functools
import math
import secrets
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from fedprism.errors import ConfigError
from fedprism.seeds import stream_seed

#: values of `dp.local`
LOCAL_DP = ("none", "dpsgd")

_NO_KEY = torch.zeros(0, dtype=torch.int64)      # a seeded dropout layer without a key: the identity

#: the methods whose every local training is SGD on the cross-entropy of one whole model (FedProx and Ditto's
#: personal phase: plus a proximal penalty that reads no sample), so DP-SGD replaces their step as it is
DPSGD_METHODS = {
    "fedavg": "E epochs of plain SGD from the global model",
    "fedprox": "plain SGD plus the proximal penalty mu/2 ||w - w^t||^2, whose gradient reads no sample",
    "local": "plain SGD on the client's own model (which never leaves the client)",
    "ditto": "the global phase is plain SGD and the personal phase plain SGD plus a proximal penalty",
}

#: why some methods do not qualify (the refusal's text); any other method: `_GENERIC`
_WHY_NOT = {
    "scaffold": "its local steps add the control variates c - c_k to the gradient and it uploads a control "
                "variate computed from the local iterates",
    "fednova": "it uploads the normalised steps of its local run, a second data-dependent quantity",
    "moon": "its model-contrastive loss couples every sample with the global and previous models' features",
    "fedproto": "it shares class prototypes (privacy.epsilon protects those)",
    "protohar": "it shares class prototypes (privacy.epsilon protects those)",
    "fedper": "it trains part of the model under a mask (body shared, head personal)",
    "fedrep": "it trains the head and the body in separate masked phases",
    "fedbabu": "it trains the body under a mask with a frozen head",
    "lg_fedavg": "it trains under a mask (local body, global head)",
    "fedbn": "its models keep BatchNorm statistics, which mix the samples of a batch",
    "apfl": "its objective mixes the global and the personal model's logits",
    "pfedme": "its inner problem solves a Moreau envelope with K steps per batch",
    "perfedavg": "its MAML step differentiates through a gradient step (second-order terms)",
    "feddyn": "its objective adds a linear term of the client's previous gradients",
    "qffl": "it uploads the loss-weighted update and the loss, both data-dependent",
}
_GENERIC = ("its local training is not plain SGD on the cross-entropy of one whole model (a masked, "
            "multi-model, feature-level or second-order objective, or an upload beside the model)")


def check_config(out: dict) -> None:
    """`dp.local` against the method and the engine (ConfigError naming `dp.local` or `engine`)."""
    if out.get("dp.local", "none") == "none":
        return
    m = out["method"]
    if m not in DPSGD_METHODS:
        raise ConfigError("dp.local", out["dp.local"], f"none for method={m}: local DP-SGD replaces plain "
                          f"local SGD steps, and {m} does not train that way: {_WHY_NOT.get(m, _GENERIC)}; "
                          f"the methods that qualify are {', '.join(sorted(DPSGD_METHODS))} "
                          "(docs/privacy.md)")
    if out["engine"] == "vectorized":
        raise ConfigError("engine", "vectorized", "auto or sequential with dp.local=dpsgd (Opacus computes "
                          "per-sample gradients one client at a time; engine=auto runs the sequential loop)")


def check_model(module: torch.nn.Module, name: str) -> None:
    """A model Opacus can take: no layer that mixes the samples of a batch (BatchNorm: a sample's gradient
    would depend on the others), by Opacus' `ModuleValidator`, else ConfigError naming `model`. Layers
    without a per-sample gradient rule of their own get one from functorch (Opacus' fallback)."""
    from opacus.validators import ModuleValidator

    errors = ModuleValidator.validate(module, strict=False)
    if errors:
        raise ConfigError("model", name, "a model without BatchNorm or other layers that mix the samples of "
                          f"a batch with dp.local=dpsgd (Opacus: {'; '.join(str(e) for e in errors[:3])})")


def rdp_epsilon(z: float, q: float, steps: int, delta: float) -> float:
    """Opacus' RDP accountant: epsilon at `delta` of `steps` DP-SGD steps of noise multiplier z at sampling
    rate q (0 without steps, inf without noise)."""
    if steps <= 0:
        return 0.0
    if z <= 0:
        return math.inf
    from opacus.accountants import RDPAccountant

    acc = RDPAccountant()
    acc.history = [(float(z), float(q), int(steps))]
    return float(acc.get_epsilon(delta))


@dataclass
class LocalDPSGD:
    """The run's local DP-SGD: clip C, noise multiplier z, delta, noise source, run seed. The engine calls
    `train` for each client of a job; `steps[c]` counts client c's DP-SGD steps at rate `rate[c]`, and
    `round_steps` those of the round now running (the runner stores them and resets it)."""

    clip: float
    noise: float
    delta: float
    source: str = "seeded"
    seed: int = 0
    steps: dict[int, int] = field(default_factory=dict)
    rate: dict[int, float] = field(default_factory=dict)
    round_steps: dict[int, int] = field(default_factory=dict)
    #: the round whose steps `steps` does not hold yet (the runner rebuilds `steps` from the store otherwise)
    next_round: int = 0

    @classmethod
    def of(cls, cfg) -> "LocalDPSGD | None":
        if cfg.get("dp.local", "none") == "none":
            return None
        return cls(cfg["dp.local_clip"], cfg["dp.local_noise"], cfg["dp.local_delta"],
                   cfg.get("privacy.noise", "seeded"), cfg["seed"])

    # -- accounting ---------------------------------------------------------------------------------------
    def record(self, client: int, q: float, steps: int) -> None:
        """Client `client` took `steps` DP-SGD steps at rate q (one q per client: B / n_i)."""
        c = int(client)
        if c in self.rate and self.rate[c] != q:
            raise ValueError(f"client {c}'s sampling rate changed from {self.rate[c]} to {q}; the accountant "
                             "keeps one rate per client")
        self.rate[c] = float(q)
        self.steps[c] = self.steps.get(c, 0) + int(steps)
        self.round_steps[c] = self.round_steps.get(c, 0) + int(steps)

    def epsilons(self) -> dict[int, float]:
        """Each client that has trained: the epsilon its steps so far spent (`rdp_epsilon`)."""
        return {c: _eps_cached(self.noise, self.rate[c], s, self.delta)
                for c, s in sorted(self.steps.items())}

    def round_metrics(self) -> dict[str, float]:
        """`dpsgd_epsilon_max` / `dpsgd_epsilon_mean` over the clients that have trained so far (finite
        epsilons only: none with z = 0), `dpsgd_steps` this round (all clients), `dpsgd_q_min` / `_max`."""
        out: dict[str, float] = {"dpsgd_steps": float(sum(self.round_steps.values()))}
        if self.steps:
            qs = [self.rate[c] for c in self.steps]
            out.update(dpsgd_q_min=min(qs), dpsgd_q_max=max(qs))
            eps = list(self.epsilons().values())
            if all(math.isfinite(e) for e in eps):
                out.update(dpsgd_epsilon_max=max(eps), dpsgd_epsilon_mean=float(np.mean(eps)))
        return out

    # -- the training ---------------------------------------------------------------------------------------
    def _generators(self, rnd: int, client: int, stream: str, device: torch.device
                    ) -> tuple[torch.Generator, torch.Generator]:
        """(batch draws, on the CPU; noise, on the model's device, where Opacus draws it): named streams of
        the run seed; the noise from OS entropy with `privacy.noise=system`."""
        batches = torch.Generator().manual_seed(
            stream_seed(self.seed, rnd, client, f"dpsgd_batches:{stream}"))
        noise = torch.Generator(device=device).manual_seed(
            secrets.randbits(63) if self.source == "system" else
            stream_seed(self.seed, rnd, client, f"dpsgd_noise:{stream}"))
        return batches, noise

    def _module(self, engine):
        """A copy of the engine's model wrapped in Opacus' GradSampleModule (one per engine), its trainable
        parameters in the order of the flat vector, and its seeded dropout layers."""
        cached = getattr(engine, "_dpsgd_module", None)
        if cached is not None:
            return cached
        from opacus.grad_sample import GradSampleModule

        from fedprism.params import dropout_layers

        base = copy.deepcopy(engine.model).to(engine.device)
        base.train()
        params = dict(base.named_parameters())
        order = [params[n] for n in engine.spec.names]
        gsm = GradSampleModule(base, loss_reduction="mean")
        drops = [m for _, m in dropout_layers(base)]
        for i, m in enumerate(drops):            # the numbering `Functional` gives them: the same masks
            m.salt = i
        engine._dpsgd_module = cached = (gsm, order, drops)
        return cached

    @staticmethod
    def check_job(job) -> None:
        """The jobs DP-SGD takes: the cross-entropy (`ce`) or the proximal objective (`prox`: its anchor and
        mu only), on the whole model (no mask). A qualifying method never sends another (a RuntimeError here
        is a method that changed)."""
        loss = job.loss if isinstance(job.loss, str) else getattr(job.loss, "__name__", repr(job.loss))
        if loss not in ("ce", "prox") or job.mask is not None or set(job.extras) - {"anchor", "mu"}:
            raise RuntimeError(f"dp.local=dpsgd takes plain local training (objective ce or prox, no mask), "
                               f"not objective {loss} with mask {job.mask is not None} and extras "
                               f"{sorted(job.extras)}")

    def train(self, engine, w: torch.Tensor, rows: torch.Tensor, epochs: int, loss: str, extras: dict,
              cfg, client: int, rnd: int, stream: str, drop: int | None) -> tuple[torch.Tensor, float, int]:
        """One client's local DP-SGD from w [P] on its train rows: (w, mean loss of the batches, steps)."""
        from opacus.optimizers import DPOptimizer

        from fedprism.engine.base import dropout_key, n_batches, optimizer_state, optimizer_step_

        gsm, params, drops = self._module(engine)
        n, B = len(rows), cfg.batch_size
        q = min(1.0, B / n) if n else 1.0
        T = n_batches(n, epochs, B)
        g_batch, g_noise = self._generators(rnd, client, stream, engine.device)
        opt = DPOptimizer(torch.optim.SGD(params, lr=0.0), noise_multiplier=self.noise,
                          max_grad_norm=self.clip, expected_batch_size=max(1, min(B, n)),
                          loss_reduction="mean", generator=g_noise)
        anchor = extras.get("anchor")
        mu = None if anchor is None else float(extras["mu"])
        st = optimizer_state(cfg, w)
        total, count = 0.0, 0
        for j in range(T):
            pick = torch.rand(n, generator=g_batch) < q if q < 1 else torch.ones(n, dtype=torch.bool)
            bi = rows[pick.nonzero().squeeze(1).to(rows.device)]
            opt.zero_grad(set_to_none=True)
            with torch.no_grad():
                for p, v in zip(params, engine.spec.unflatten(w).values()):
                    p.copy_(v)
            if len(bi):
                for m in drops:
                    m.key = dropout_key(drop, j, engine.device) if drop is not None else _NO_KEY
                x, y = engine.fed.x_train[bi], engine.fed.y_train[bi]
                out = F.cross_entropy(gsm(x), y)
                with warnings.catch_warnings():     # Opacus' hooks on a model whose input needs no gradient
                    warnings.filterwarnings("ignore", message="Full backward hook is firing")
                    out.backward()
                total += float(out.detach()) * len(y)
                count += len(y)
                engine.samples_trained += len(y)
            else:                                   # an empty Poisson batch: the step is noise only
                for p in params:
                    p.grad_sample = torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device)
            opt.pre_step()                          # Opacus: clip, sum, noise, / expected batch size
            g = torch.cat([p.grad.reshape(-1) for p in params]).to(w.dtype)
            if anchor is not None and mu:
                g = g + mu * (w - anchor)
            with torch.no_grad():
                w, st = optimizer_step_(w, g, st, cfg)
        for m in drops:
            m.key = _NO_KEY
        self.record(client, q, T)
        return w, total / max(1, count), T


@functools.lru_cache(maxsize=4096)
def _eps_cached(z: float, q: float, steps: int, delta: float) -> float:
    return rdp_epsilon(z, q, steps, delta)
