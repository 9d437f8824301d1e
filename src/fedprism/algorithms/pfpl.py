"""PFPL (Zeng, Xing, Shi, Huang, Wang, Cao, Shi 2025, "Personalized federated prototype learning in mixed
heterogeneous data scenarios", Algorithm 1; the paper also calls the method FPFL and pFedPM).

Only prototypes travel; no model parameter is ever uploaded or downloaded. Client i keeps its whole
model w_i = (phi_i, head_i) as client state; f_i(x) is the penultimate feature (width d = the input width
of the model's head). Round t:

    client i -> server:  C_i [C, d], n_i [C]                                          Eq. 2
                           C_i^(k) = mean_{(x, y) in D_i, y = k} f_i(x)  (a class i lacks: zero row, count 0)
    server:              for every class k, cluster the prototypes C_m^(k) of the clients holding k
                           (Algorithm 1, line 9) -> M_i^(k), the other members of i's cluster
                         k_im = weight of client m for client i over M_i^(k), sum_m k_im = 1   (`weighting`)
                         P_i^(k) = sum_{m in M_i^(k)} k_im C_m^(k)
                         Cbar_i^(k) = alpha C_i^(k) + (1 - alpha) P_i^(k)                         Eq. 4
    server -> client i:  Cbar_i [C, d], present_i [C]   (its personalised prototypes, Algorithm 1 lines 10-12)
    client i:            w_i <- E epochs of  CE(F(w_i; x), y) + lambda sum_{k in batch} l_R(Cbar_i^(k), C_i^(k))
                                                                                          Eq. 5 / Eq. 7
                         with C_i^(k) the mean feature of the batch's class-k samples (differentiable)

Inference: the client's own model (the head's logits), as in Local training.

Decisions where the paper is silent or contradicts itself (docs/pfpl.md has the same list):

* Weights of Eq. 4 (`weighting`). As printed, k_im = d_im / sum_m' d_im' grows with the distance d_im:
  the farthest prototype gets the most weight. The text says twice that prototypes of the same domain
  (the near ones) must get more weight and those of other domains less. Default `inverse`:
  k_im proportional to 1 / (d_im + 1e-8); `softmax`: proportional to exp(-d_im / temperature);
  `as_printed`: proportional to d_im (uniform when every distance is 0). d_im is the paper's "L2
  distance", defined there as sum over the d dimensions of (C_i - C_m)^2 (squared Euclidean).
* One set of clients for numerator and denominator (the paper writes M^(k) in one and Phi(k) in the
  other, which would not give weights summing to 1): M_i^(k), client i itself excluded (the printed
  k_ii would be 0 anyway).
* Clustering (`clustering`). The paper clusters same-class prototypes on the server without naming the
  algorithm (FPL, which it builds on, uses FINCH). `finch` (default): the first partition of FINCH
  (Sarfraz, Sharma, Stiefelhagen 2019, "Efficient Parameter-free Clustering Using First Neighbor
  Relations", CVPR): m and m' are linked when one is the other's nearest prototype or both share their
  nearest prototype; clusters are the connected components. It is parameter-free, so the number of
  domains is never told to the server. Distances are the squared Euclidean d_im of the weights (FINCH
  uses cosine; one distance keeps the clustering and the weights consistent). `none`: M_i^(k) is every
  other client holding class k.
* The client's own share (`own_share`). Algorithm 1 has the server "update personalized prototype
  sets" with Eq. 4 (lines 10-11), from the prototypes the clients uploaded, and "send the personalized
  prototype to the corresponding client" (line 12). Default `uploaded`, as written: Cbar_i^(k) =
  alpha C_i^(k) + (1 - alpha) P_i^(k) with C_i^(k) client i's latest upload, compared in Eq. 5 with the
  live batch prototype; alpha = 1 then pulls the features towards the client's own previous prototypes.
  Where client i holds class k but M_i^(k) is empty, its target is its own upload; a class it has not
  uploaded has no target (a client's first round adds no regulariser). `live` reads Eq. 5's two C_i^(k)
  as the same live prototype: Cbar_i^(k) - C_i^(k) = (1 - alpha) (P_i^(k) - C_i^(k)), so the server
  sends P_i and l_R = (1 - alpha)^2 ||P_i^(k) - C_i^(k)||^2 (`distance = squared`) or
  (1 - alpha) ||P_i^(k) - C_i^(k)|| (`norm`); alpha = 1 is then Local training, bit for bit.
* l_R (`distance`). Eq. 7 writes ||Cbar, C||_2 and the paper defines its "L2 distance" as a sum of
  squares. Default `squared` (smooth at 0); `norm` is the Euclidean norm (its gradient is taken at
  max(squared distance / d, 1e-12)). Both are divided by the feature width d (`squared`: the mean over
  the d dimensions, torch's MSELoss, as `fedproto`'s regulariser; `norm`: by sqrt(d)), so lambda keeps
  one scale whatever the model's width (the paper's lambda = 1 with its sum of squares over the 64
  features of fedprism's MLP made the regulariser swamp cross-entropy: local accuracy fell from 0.93 to
  0.63 within 5 rounds on the mixed protocol; lambda = 1 with the mean ends at 0.99, Local at 0.98).
  That scale was picked from a development run's test accuracy and lambda was not re-tuned under it;
  `align_scale = sum` is the paper's scale (no division: on LeNet-5's 84 features lambda weighs the
  regulariser 84 times more than under `mean`), and sweeps/pfpl_mixed_validation.toml chooses lambda at
  each scale on validation data. Default `mean` (the committed runs).
* Regulariser over the batch: a sum over the classes present in the batch of l_R between the batch's
  class mean of features and the class's target (Eq. 5 / Eq. 6 sum over classes), padded samples
  excluded. A class with no target adds zero (`live`: no other client holds it; either way: round 0,
  before any upload). Cross-entropy is the batch mean, written as in `fedproto.prototype_loss` so that a
  zero regulariser gives the default loss's numbers.
* Local prototypes (Eq. 2) are computed once after local training, over the client's whole train set,
  with the trained model (float64 accumulation; `fedproto.local_prototypes`). Algorithm 1 updates them
  during the batches; a true class mean of the final model is what the server is meant to compare.
* Partial participation: the server keeps every client's latest upload (as `fedproto`'s default `seen`)
  and recomputes every client's P_i after each round; a client's model changes only when it trains, and
  it uploads right after training.
* Every client starts from the run's common initial model; never-sampled clients keep it. The optimiser
  state starts fresh every round, as in every fedprism method.

Defaults: alpha = 0.5 (the paper's best values are 0.3, 0.5 and 0.6 on its three datasets), lambda = 1.
The paper chose lambda = 1 by a search in [0, 4] with l_R a sum of squares over its features; here l_R is
the mean over the d features (above), so the same lambda weighs the regulariser d times less: it is a
default of this scale, not the paper's tuned value. Local epochs, batch size, learning rate and momentum
are the experiment's (the paper: 1 epoch, batch 4, SGD lr 0.01, momentum 0.9, weight decay 1e-5, 100
rounds).

Equivalence (tests): lambda = 0, or alpha = 1 with `own_share = live`, is Local training, bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from fedprism.algorithms.base import Inference, Plan, TrainJob, Update, register
from fedprism.algorithms.fedproto import PrototypeClients, local_prototypes
from fedprism.hparams import Param

WEIGHTINGS = ("inverse", "softmax", "as_printed")
CLUSTERINGS = ("finch", "none")
DISTANCES = ("squared", "norm")
OWN_SHARES = ("uploaded", "live")
ALIGN_SCALES = ("mean", "sum")
#: added to distances in the `inverse` weights; floor of the squared distance under `norm`
EPS = 1e-8
NORM_FLOOR = 1e-12


# -- server side ---------------------------------------------------------------------------------------------
def squared_distances(protos: torch.Tensor) -> torch.Tensor:
    """[m, m] float64 sum_d (C_a - C_b)^2 between the rows of protos [m, d] (exact, no matmul expansion)."""
    p = protos.to(torch.float64)
    return ((p[:, None, :] - p[None, :, :]) ** 2).sum(-1)


def first_neighbour_clusters(dist: torch.Tensor) -> np.ndarray:
    """FINCH's first partition of m points from their distance matrix [m, m]: labels [m] (0..K-1).

    a ~ b when b is a's nearest neighbour, a is b's, or both have the same nearest neighbour; clusters are
    the connected components. Ties go to the lower index; one point is one cluster."""
    m = dist.shape[0]
    if m == 1:
        return np.zeros(1, dtype=np.int64)
    d = dist.clone()
    d.fill_diagonal_(float("inf"))
    nn = torch.argmin(d, dim=1).numpy()
    parent = np.arange(m)

    def find(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for a in range(m):                       # a - nn(a) covers all three link rules (shared neighbour: via it)
        ra, rb = find(a), find(int(nn[a]))
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    roots = np.array([find(a) for a in range(m)])
    return np.unique(roots, return_inverse=True)[1].astype(np.int64)


def neighbour_weights(dist: torch.Tensor, weighting: str, temperature: float = 1.0) -> torch.Tensor:
    """k_im over the candidates m of one client: dist [m] (squared Euclidean, float64) -> weights [m]
    summing to 1 (Eq. 4's k_i,m; `inverse` / `softmax` favour near prototypes, `as_printed` far ones)."""
    d = dist.to(torch.float64)
    if weighting == "inverse":
        a = 1.0 / (d + EPS)
    elif weighting == "softmax":
        a = torch.exp(-(d - d.min()) / temperature)
    elif weighting == "as_printed":
        a = d if bool(d.sum() > 0) else torch.ones_like(d)
    else:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
    return a / a.sum()


def neighbour_prototypes(protos: torch.Tensor, counts: torch.Tensor, weighting: str = "inverse",
                         temperature: float = 1.0, clustering: str = "finch"
                         ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """P_i^(k) = sum_{m in M_i^(k)} k_im C_m^(k) for every client i and class k (the server's half of Eq. 4).

    protos [N, C, d] every client's latest prototypes, counts [N, C] (0: the client has no class k).
    Returns (P [N, C, d] in protos' dtype, present [N, C] bool: i holds k and M_i^(k) is not empty,
    clusters [C]: number of clusters of class k's prototypes)."""
    N, C, _ = protos.shape
    out = torch.zeros(protos.shape, dtype=torch.float64)
    present = torch.zeros(N, C, dtype=torch.bool)
    clusters = []
    for k in range(C):
        holders = torch.nonzero(counts[:, k] > 0).flatten()
        if len(holders) == 0:
            clusters.append(0)
            continue
        P = protos[holders, k].to(torch.float64)
        D = squared_distances(P)
        labels = (first_neighbour_clusters(D) if clustering == "finch"
                  else np.zeros(len(holders), dtype=np.int64))
        clusters.append(int(labels.max()) + 1)
        for a, i in enumerate(holders.tolist()):
            members = np.flatnonzero((labels == labels[a]) & (np.arange(len(holders)) != a))
            if members.size == 0:
                continue
            mt = torch.as_tensor(members)
            w = neighbour_weights(D[a, mt], weighting, temperature)
            out[i, k] = w @ P[mt]
            present[i, k] = True
    return out.to(protos.dtype), present, clusters


def personalised_prototypes(protos: torch.Tensor, mix: torch.Tensor, present: torch.Tensor,
                            alpha: float) -> torch.Tensor:
    """Eq. 4: Cbar_i^(k) = alpha C_i^(k) + (1 - alpha) P_i^(k) where client i has a target, else C_i^(k)."""
    mixed = alpha * protos.to(torch.float64) + (1 - alpha) * mix.to(torch.float64)
    return torch.where(present[..., None], mixed, protos.to(torch.float64)).to(protos.dtype)


# -- client side ---------------------------------------------------------------------------------------------
def _pfpl_loss(model, w, x, y, weight, extras, squared: bool, mean: bool = True):
    z = model.features(w, x)
    logits = model.head(w, z)
    wsum = weight.sum().clamp(min=1.0)
    ce = (F.cross_entropy(logits, y, reduction="none") * weight).sum() / wsum
    target = extras["target"].to(z.dtype)                                                  # [C, d]
    onehot = (y[:, None] == torch.arange(target.shape[0], device=y.device)).to(z.dtype) * weight[:, None]
    n = onehot.sum(0)                                                                      # [C]
    local = (onehot.T @ z) / n.clamp(min=1.0)[:, None]           # Eq. 2 on the batch: class means [C, d]
    sq = (target - local) ** 2
    gap = sq.mean(-1) if mean else sq.sum(-1)                     # [C] squared distance (/ d: align_scale=mean)
    dist = gap if squared else torch.sqrt(gap.clamp(min=NORM_FLOOR))
    live = (n > 0).to(z.dtype) * extras["present"].to(z.dtype)
    return ce + extras["coef"] * (dist * live).sum()


def pfpl_loss_squared(model, w, x, y, weight, extras):
    """CE + coef sum_{k in batch} ||T^(k) - C^(k)_batch||^2 / d (vmap-safe).

    extras: `target` [C, d] (Cbar_i, coef = lambda; or P_i under own_share=live, coef = lambda (1 - alpha)^2),
    `present` [C] 1 where class k has a target, `coef` scalar."""
    return _pfpl_loss(model, w, x, y, weight, extras, True)


def pfpl_loss_norm(model, w, x, y, weight, extras):
    """CE + coef sum_{k in batch} ||T^(k) - C^(k)_batch|| / sqrt(d) (vmap-safe; coef = lambda, or
    lambda (1 - alpha) under own_share=live)."""
    return _pfpl_loss(model, w, x, y, weight, extras, False)


def pfpl_loss_squared_sum(model, w, x, y, weight, extras):
    """CE + coef sum_{k in batch} ||T^(k) - C^(k)_batch||^2, the paper's sum of squares (align_scale=sum)."""
    return _pfpl_loss(model, w, x, y, weight, extras, True, mean=False)


def pfpl_loss_norm_sum(model, w, x, y, weight, extras):
    """CE + coef sum_{k in batch} ||T^(k) - C^(k)_batch|| (align_scale=sum)."""
    return _pfpl_loss(model, w, x, y, weight, extras, False, mean=False)


#: (distance, align_scale) -> the client loss
LOSSES = {("squared", "mean"): pfpl_loss_squared, ("norm", "mean"): pfpl_loss_norm,
          ("squared", "sum"): pfpl_loss_squared_sum, ("norm", "sum"): pfpl_loss_norm_sum}


@register
class PFPL(PrototypeClients):
    name = "pfpl"
    paper = "Zeng et al. 2025, Personalized federated prototype learning in mixed heterogeneous data scenarios"
    params = {
        "alpha": Param(0.5, "alpha: share of the client's own prototype in its personalised prototype (Eq. 4); "
                       "1 with own_share=live = Local training", lambda v: 0 <= v <= 1, "a number in [0, 1]"),
        "lam": Param(1.0, "lambda: weight of the prototype consistency regulariser (Eq. 5)", lambda v: v >= 0,
                     "a number >= 0"),
        "weighting": Param("inverse", "weights k_im of the other clients' prototypes (Eq. 4): inverse "
                           "(1/distance, the text), softmax (exp(-distance/temperature)) or as_printed "
                           "(proportional to distance, the printed formula)", choices=WEIGHTINGS),
        "temperature": Param(1.0, "softmax weighting: temperature over squared distances", lambda v: v > 0,
                             "a number > 0"),
        "clustering": Param("finch", "server clustering of same-class prototypes: finch (first-neighbour "
                            "partition) or none (every other holder of the class)", choices=CLUSTERINGS),
        "distance": Param("squared", "l_R of Eq. 7: squared (sum of squares, the paper's 'L2 distance') or "
                          "norm (Euclidean norm)", choices=DISTANCES),
        "own_share": Param("uploaded", "alpha C_i of Eq. 4: uploaded (the client's last upload, mixed on the "
                           "server: Algorithm 1) or live (the batch prototype: alpha = 1 is Local)",
                           choices=OWN_SHARES),
        "align_scale": Param("mean", "scale of l_R: mean (the squared distance divided by the feature width d, "
                             "the norm by sqrt(d)) or sum (the paper's sum of squares over the d features)",
                             choices=ALIGN_SCALES, new=True),
    }
    def init_state(self) -> dict:
        C, d, N = self.ctx.num_classes, self.ctx.feature_dim, self.ctx.num_clients
        return {"client_protos": torch.zeros(N, C, d), "client_counts": torch.zeros(N, C),
                "mix": torch.zeros(N, C, d), "present": torch.zeros(N, C, dtype=torch.bool)}

    def plan(self, state: dict, rnd: int, clients: np.ndarray) -> Plan:
        """Send each sampled client its personalised prototypes Cbar_i (Eq. 4; P_i under own_share=live)
        and where it has a target."""
        S = torch.as_tensor(clients)
        if self.hp["own_share"] == "live":
            return Plan(clients, {"target": state["mix"][S].clone(),
                                  "present": state["present"][S].to(torch.float32)})
        own = state["client_protos"][S]
        cbar = personalised_prototypes(own, state["mix"][S], state["present"][S], self.hp["alpha"])
        return Plan(clients, {"target": cbar, "present": (state["client_counts"][S] > 0).to(torch.float32)})

    def client_update(self, plan: Plan, trainer, rnd: int, cstate: dict) -> Update:
        """LocalUpdate of Algorithm 1: train the own model with Eq. 5, then report Eq. 2's prototypes."""
        S, hp = plan.clients, self.hp
        squared = hp["distance"] == "squared"
        coef = hp["lam"] * ((1 - hp["alpha"]) ** (2 if squared else 1) if hp["own_share"] == "live" else 1.0)
        extras = {"target": plan.payload["target"], "present": plan.payload["present"],
                  "coef": torch.full((len(S),), float(coef))}
        loss = LOSSES[hp["distance"], hp["align_scale"]]
        t = trainer.train(TrainJob(S, cstate["w"].clone(), loss=loss, extras=extras), rnd)
        protos, counts = local_prototypes(trainer, S, t.params, self.ctx.num_classes, self.ctx, rnd)
        return Update(S, {"protos": protos, "counts": counts}, t.n_samples, {"train_loss": t.loss},
                      client_state={"w": t.params})

    def aggregate(self, state: dict, rnd: int, update: Update) -> dict:
        """Keep the latest uploads, cluster each class's prototypes, recompute every client's P_i (Eq. 4)."""
        S = torch.as_tensor(update.clients)
        state["client_protos"][S] = update.payload["protos"].to(state["client_protos"].dtype)
        state["client_counts"][S] = update.payload["counts"].to(state["client_counts"].dtype)
        mix, present, clusters = neighbour_prototypes(state["client_protos"], state["client_counts"],
                                                      self.hp["weighting"], self.hp["temperature"],
                                                      self.hp["clustering"])
        state["mix"], state["present"] = mix, present
        return {"pfpl_clusters": {"per_class": clusters}}

    def eval_payload(self, state: dict, clients: np.ndarray) -> dict:
        return {}

    def inference(self, trainer, clients, payload: dict, cstate: dict) -> Inference:
        return Inference({"model": cstate["w"]})
