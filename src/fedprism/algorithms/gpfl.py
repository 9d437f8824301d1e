"""GPFL (Zhang, Hua, Wang, Song, Xue, Ma, Cao, Guan 2023, "GPFL: Simultaneously Learning Global and
Personalized Feature Information for Personalized Federated Learning", ICCV, arXiv:2308.10279): a shared
feature extractor phi, a Conditional Valve (CoV) that turns its feature into a global and a personalized
feature, a Global Category Embedding layer (GCE) that guides the global feature, and a personal head.

The model's declared split: f = phi(x) is the body's output (width d, the head's input), the head is the
model's own classifier head. Client i's parts and objective (numbered here):

  GCE: a table of C class embeddings e_1..e_C in R^d (shared).
    (1)  g = (1/C) sum_c e_c                           the global conditional input
    (2)  p_i = sum_c (n_ic / n_i) e_c                  client i's personalized conditional input
  CoV: two branches of Linear(d, d) -> ReLU -> LayerNorm(d) (shared), for a conditional input v:
    (3)  gamma(v), beta(v);   CoV(f, v) = ReLU(f * (gamma(v) + 1) + beta(v))
    (4)  f^G = CoV(f, g),   f^P = CoV(f, p_i)
  losses on a batch:
    (5)  L_P   = CE(head_i(f^P), y)                                              the personalized task
    (6)  L_alg = CE(cos(f^G, e_c)_{c=1..C}, y)       angle-level guidance: a softmax over the cosine
                                                     similarities of f^G to the C embeddings
    (7)  L_mlg = mean_b || f^G_b - e~_{y_b} ||_2     magnitude-level guidance, to the received (frozen)
                                                     embeddings e~
    (8)  R     = ||theta_CoV||^2 + ||E||^2           parameter magnitude of the CoV and the GCE
    (9)  L_i = L_P + L_alg + lambda L_mlg + (mu / 2) R
  prediction of client i: head_i(CoV(phi(x), p_i))
  server: phi, CoV and GCE are averaged, (10) sum_i (n_i / N_t) (phi_i, CoV_i, GCE_i); the head stays.

Decisions where the paper is silent, or its code (PFLlib, TsingZ0/PFLlib, clientgpfl.py, servergpfl.py)
is followed:

* Embedding sizes: the embeddings, the conditional inputs and the CoV's layers all have the width d of the
  model's penultimate features (`Context.feature_dim`: 64 for `mlp`, 84 for `lenet5`), as PFLlib's
  `feature_dim`; the CoV then has 2 (d^2 + d) + 4 d parameters (8 576 for d = 64) and the GCE C d (640 for
  ten classes). No extra projection is added to the registered models (their parameters are unchanged).
* The CoV and the GCE start from PyTorch's default initialisers (Linear: Kaiming-uniform weights and
  uniform biases in +-1/sqrt(d); LayerNorm: ones and zeros; Embedding: N(0, 1)), drawn from a generator
  seeded by the run seed, so every client and both engines start from the same ones.
* (1)-(2) are computed from the GCE the client receives this round, and n_ic from its own training labels
  (counted on the client). PFLlib computes them from the client's previous GCE before overwriting it.
* (7) is the per-sample Euclidean distance averaged over the batch; PFLlib takes the norm of the whole
  batch's difference matrix (the square root of the summed squares), which grows with the batch size.
* (8) with mu / 2: its gradient mu theta is PFLlib's `weight_decay=mu` on the CoV's and GCE's optimisers.
  The body and the head get the experiment's weight decay only.
* Local training: the experiment's optimiser on all of (phi, CoV, GCE, head) at once for the experiment's
  epochs (PFLlib steps three SGD optimisers with the same learning rate on every batch), as one vector
  [model; CoV; GCE] with fresh optimiser state each round, on the default stream `train`.
* The server average (10) is the shared server step on [phi; CoV; GCE] (`averages = ("shared",)`:
  `gpfl.aggregation`, `gpfl.server_opt`); `weighting=samples` is PFLlib's n_i / N_t.
* A client's head starts as the run's initial head and changes only when it trains; a never-sampled client
  (or a held-out newcomer) predicts with the initial head on the current body, CoV and its own p_i.
* The objective evaluates parts of a longer vector, which the fused training kernels cannot take:
  `train.kernels = auto` is aten for GPFL and `fused` is refused (`fused_training`).

Defaults: lambda = 0.01 and mu = 0.1, the values PFLlib's GPFL is run with (`-lam 0.01 -mu 0.1`).

Exact statements (tested): with lambda = mu = 0 the objective is L_P + L_alg, value and gradient, and the
received embeddings e~ play no part; (1)-(8) by hand on made-up numbers; the valve with gamma = beta = 0 is
ReLU(f).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from fedprism.algorithms.base import Inference, TensorSpec, TrainJob, Update, register
from fedprism.algorithms.fedproto import check_feature_dim
from fedprism.algorithms.partial import WEIGHTING, PartialSharing
from fedprism.hparams import Param

#: the LayerNorm's epsilon (torch's default)
LN_EPS = 1e-5

#: the client-state row of the client's own model (partial sharing's declaration)
LOCAL = next(iter(PartialSharing.client_state))


# -- the Conditional Valve and the GCE (pure functions on flat vectors) -----------------------------------
def cov_size(d: int) -> int:
    """Parameters of the CoV: two branches of Linear(d, d) and LayerNorm(d)."""
    return 2 * (d * d + d) + 4 * d


def cov_parts(cov: torch.Tensor, d: int) -> dict[str, torch.Tensor]:
    """The CoV's tensors from its flat vector: per branch (`g`amma, `b`eta) W [d, d], b [d], ln_w [d], ln_b [d]."""
    sizes = [d * d, d, d, d] * 2
    names = ["gW", "gb", "gln_w", "gln_b", "bW", "bb", "bln_w", "bln_b"]
    parts = dict(zip(names, cov.split(sizes, dim=-1)))
    parts["gW"], parts["bW"] = parts["gW"].reshape(d, d), parts["bW"].reshape(d, d)
    return parts


def init_cov(d: int, generator: torch.Generator) -> torch.Tensor:
    """PyTorch's default initialisation of the two branches (Linear: U(+-1/sqrt(d)) for weight and bias,
    which is Kaiming-uniform with a = sqrt(5); LayerNorm: ones, zeros), flat."""
    bound = 1.0 / d ** 0.5
    out = []
    for _ in range(2):
        out += [(torch.rand(d * d, generator=generator) * 2 - 1) * bound,
                (torch.rand(d, generator=generator) * 2 - 1) * bound, torch.ones(d), torch.zeros(d)]
    return torch.cat(out)


def _branch(v, W, b, ln_w, ln_b):
    return F.layer_norm(F.relu(v @ W.T + b), (W.shape[0],), ln_w, ln_b, LN_EPS)


def valve(cov: torch.Tensor, f: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """(3): ReLU(f * (gamma(v) + 1) + beta(v)) for features f [B, d] and a conditional input v [d]."""
    q = cov_parts(cov, f.shape[-1])
    gamma = _branch(v, q["gW"], q["gb"], q["gln_w"], q["gln_b"])
    beta = _branch(v, q["bW"], q["bb"], q["bln_w"], q["bln_b"])
    return F.relu(f * (gamma + 1) + beta)


def conditional_inputs(emb: torch.Tensor, fractions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(1) and (2): g = mean of the embeddings emb [C, d], p = sum_c fractions_c emb_c ([C] label fractions)."""
    return emb.mean(0), fractions.to(emb.dtype) @ emb


def angle_loss(fg: torch.Tensor, emb: torch.Tensor, y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(6): the weighted batch mean of CE over the cosine similarities of fg [B, d] to the embeddings [C, d]."""
    cos = F.normalize(fg, dim=-1) @ F.normalize(emb, dim=-1).T
    return (F.cross_entropy(cos, y, reduction="none") * weight).sum() / weight.sum().clamp(min=1.0)


def magnitude_loss(fg: torch.Tensor, frozen: torch.Tensor, y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(7): the weighted batch mean of ||fg_b - frozen_{y_b}||_2 (frozen [C, d]; gradient 0 where the
    distance is 0, vmap-safe)."""
    onehot = (y[:, None] == torch.arange(frozen.shape[0], device=y.device)).to(fg.dtype)
    ss = ((fg - onehot @ frozen.to(fg.dtype)) ** 2).sum(-1)
    pos = ss > 0
    dist = torch.where(pos, torch.where(pos, ss, torch.ones_like(ss)).sqrt(), torch.zeros_like(ss))
    return (dist * weight).sum() / weight.sum().clamp(min=1.0)


def split_vector(z: torch.Tensor, P: int, d: int, C: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(model [P], CoV [cov_size(d)], GCE [C, d]) of the training vector z = [model; CoV; GCE]."""
    Q = cov_size(d)
    return z[..., :P], z[..., P:P + Q], z[..., P + Q:P + Q + C * d].reshape(*z.shape[:-1], C, d)


def gpfl_loss(model, z, x, y, weight, extras):
    """(9) on one batch (vmap-safe). extras: `g`, `p` [d] the conditional inputs, `frozen` [C d] the received
    embeddings, `lam`, `mu` scalars."""
    d, C = extras["p"].shape[-1], extras["frozen"].shape[-1] // extras["p"].shape[-1]
    w, cov, emb = split_vector(z, model.spec.size, d, C)
    f = model.features(w, x)
    wsum = weight.sum().clamp(min=1.0)
    logits = model.head(w, valve(cov, f, extras["p"]))
    L_P = (F.cross_entropy(logits, y, reduction="none") * weight).sum() / wsum
    fg = valve(cov, f, extras["g"])
    loss = L_P + angle_loss(fg, emb, y, weight)
    loss = loss + extras["lam"] * magnitude_loss(fg, extras["frozen"].reshape(C, d), y, weight)
    return loss + 0.5 * extras["mu"] * ((cov * cov).sum() + (emb * emb).sum())


@register
class GPFL(PartialSharing):
    name = "gpfl"
    paper = "Zhang et al. 2023, ICCV, arXiv:2308.10279"
    params = {
        "lam": Param(0.01, "lambda: weight of the magnitude-level guidance (7)", lambda v: v >= 0, "a number >= 0"),
        "mu": Param(0.1, "mu: weight of the CoV and GCE parameter magnitude (8), as (mu / 2) R", lambda v: v >= 0,
                    "a number >= 0"),
        "weighting": WEIGHTING,
    }
    #: the objective slices [model; CoV; GCE]: the fused training kernels cannot take it
    fused_training = False

    def __init__(self, ctx, **hp):
        super().__init__(ctx, **hp)
        check_feature_dim(ctx, self.name)
        self.d, self.C, self.P = ctx.feature_dim, ctx.num_classes, ctx.spec.size
        self.S = len(self.shared)                       # the body's coordinates
        self.Q = cov_size(self.d)

    @classmethod
    def headline(cls, config: dict) -> str:
        return "body + personalized valve + own head"

    def shared_mask(self) -> torch.Tensor:
        keep = torch.ones(self.ctx.spec.size, dtype=torch.bool)
        keep[self.ctx.spec.head] = False
        return keep

    def upload(self) -> dict:
        return {"shared": TensorSpec((self.S + self.Q + self.C * self.d,))}

    def init_state(self) -> dict:
        seed = int(np.random.SeedSequence([self.ctx.seed, 0x6F1]).generate_state(1)[0])
        g = torch.Generator().manual_seed(seed)
        cov = init_cov(self.d, g)
        emb = torch.randn(self.C * self.d, generator=g)
        return {"shared": torch.cat([self.ctx.init[self.shared], cov, emb])}

    # -- client side ---------------------------------------------------------------------------------
    def parts(self, local: torch.Tensor, shared: torch.Tensor):
        """(model rows [n, P], CoV [n, Q], GCE [n, C, d]) of the clients' own rows and the received vector."""
        S, Q = self.S, self.Q
        w = self.merge(local, shared[:, :S])
        return w, shared[:, S:S + Q], shared[:, S + Q:].reshape(len(shared), self.C, self.d)

    def fractions(self, trainer, clients: np.ndarray) -> torch.Tensor:
        """[n, C] float32 n_ic / n_i of each client's training labels (uniform for a client without any)."""
        out = []
        for c in clients:
            y = trainer.data(int(c), "train")[1].cpu()
            n = torch.bincount(y, minlength=self.C).to(torch.float64)
            out.append(n / n.sum() if n.sum() > 0 else torch.full((self.C,), 1.0 / self.C, dtype=torch.float64))
        return torch.stack(out).float() if out else torch.zeros(0, self.C)

    def client_update(self, plan, trainer, rnd: int, cstate: dict) -> Update:
        S = plan.clients
        n = len(S)
        w, cov, emb = self.parts(cstate[LOCAL], plan.payload["shared"])
        g, p = self._inputs(emb, self.fractions(trainer, S))                     # (1), (2)
        extras = {"g": g, "p": p, "frozen": emb.reshape(n, -1).clone(),
                  "lam": torch.full((n,), float(self.hp["lam"])), "mu": torch.full((n,), float(self.hp["mu"]))}
        z = torch.cat([w, cov, emb.reshape(n, -1)], dim=1)
        t = trainer.train(TrainJob(S, z, loss=gpfl_loss, extras=extras), rnd)
        w_new = t.params[:, :self.P]
        shared = torch.cat([self.take(w_new), t.params[:, self.P:]], dim=1)
        return Update(S, {"shared": shared}, t.n_samples, {"train_loss": t.loss}, client_state={LOCAL: w_new})

    def _inputs(self, emb: torch.Tensor, fractions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(1), (2) for each client: ([n, d], [n, d]) from emb [n, C, d] and fractions [n, C]."""
        pairs = [conditional_inputs(emb[i], fractions[i]) for i in range(len(emb))]
        if not pairs:
            return emb.new_zeros(0, self.d), emb.new_zeros(0, self.d)
        return torch.stack([a for a, _ in pairs]), torch.stack([b for _, b in pairs])

    def inference(self, trainer, clients, payload: dict, cstate: dict) -> Inference:
        """head_i(CoV(phi(x), p_i)): the body's features, then the valve and the own head on them."""
        w, cov, emb = self.parts(cstate[LOCAL], payload["shared"])
        _, p = self._inputs(emb, self.fractions(trainer, np.asarray(clients)))
        head = trainer.f.head

        def combine(z, e):
            fp = torch.func.vmap(valve)(e["cov"].to(z["features"].dtype), z["features"], e["p"].to(z["features"].dtype))
            return torch.func.vmap(head)(e["w"].to(fp.dtype), fp)
        return Inference({"features": w}, combine, extras={"w": w, "cov": cov, "p": p}, features=("features",))
