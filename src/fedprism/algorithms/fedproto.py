"""FedProto (Tan, Long, Liu, Zhou, Lu, Jiang, Zhang 2022, "FedProto: Federated Prototype Learning across
Heterogeneous Clients", AAAI, arXiv:2105.00243, Algorithm 1).

Only class prototypes travel; no model parameter is ever uploaded or downloaded. Client i keeps its whole
model w_i = (phi_i, head_i) as client state; f_i(x) is the penultimate feature (width d = the input width
of the model's head). Round t:

    server -> client i:  C_bar [C, d], present [C]   (the classes some client has reported)
    client i:            w_i <- E epochs of  CE(head_i(f_i(x)), y) + lambda R_i              Eq. 8
                           R_i = mean over the batch and the d dimensions of
                                 ||f_i(x) - C_bar_y||^2 for samples with present[y], 0 for the others
                         C_i^(j) = mean_{(x, y) in D_i, y = j} f_i(x),  n_ij = |D_i,j|      Eq. 4
    client i -> server:  C_i [C, d], n_i [C]  (a class the client does not have: zero row, count 0)
    server:              C_bar_j = sum_i n_ij C_i^(j) / sum_i n_ij  over the clients with n_ij > 0   Eq. 6

Inference: the client's own model (the head's logits: the headline), and as an alternative prediction
`proto` the nearest global prototype, argmin_j ||f_i(x) - C_bar_j||^2 over the present classes
(stored as `<split>_acc@proto`).

Decisions where the paper is silent or its text and the authors' code (github.com/yuetan031/FedProto)
differ:

* Global prototype weights (`weighting`). Eq. 6 as printed weights C_i^(j) by |D_i,j| / N_j and also
  divides by |N_j|, normalising twice (N_j stands both for the set of clients holding class j and for
  the number of class-j samples); the authors' code (lib/utils.py, proto_aggregation) takes the plain
  mean over clients. Default `samples`: the |D_i,j| weights once normalised, so C_bar_j is the mean
  feature of all class-j samples of the reporting clients and a client holding 2 samples of a class does
  not pull its prototype as hard as one holding 500 (which matters under the Dirichlet label skew of the
  FedPrism protocol). `uniform` is the authors' code.
* Which clients enter Eq. 6 (`aggregate_over`). The paper's experiments train every client every round.
  With partial participation, `seen` (default): the server keeps every client's latest upload and
  averages over all of them. A client's model changes only when it trains and it uploads right after
  training, so its latest upload is its current prototype set: this is Eq. 6 over N_j as with full
  participation. `round`: only this round's reporters; a class none of them has keeps its previous
  global prototype (PFLlib's server drops such classes, which switches their regulariser off).
* The regulariser follows the authors' code rather than the paper's prototype-to-prototype L_R: a
  per-sample squared distance to the global prototype of the sample's class, averaged over the batch and
  the feature dimensions (torch's MSELoss); samples whose class has no global prototype add zero but
  count in the batch mean. Before any prototype exists (round 0) the loss is plain cross-entropy.
* Local prototypes (Eq. 4) are computed once after local training, over the client's whole train set,
  with the trained model (float64 accumulation): true class means. The authors' code averages the
  features of the training batches of the last epoch, taken while the model changes.
* Nearest-prototype inference uses every class with a global prototype, not only the client's own
  classes (the authors' test restricts to the client's label set, which uses knowledge of its test labels).
* Every client starts from the run's common initial model (the paper allows different architectures; the
  FedPrism protocol gives all clients LeNet-5); never-sampled clients keep it. The optimiser state starts
  fresh every round, as in every fedprism method.

Defaults: lambda = 1, the authors' value for MNIST and FEMNIST (README: `--ld 1`; 0.1 for CIFAR-10).
FMNIST, the FedPrism protocol's dataset, is 28x28 grayscale like MNIST, and the regulariser has the
authors' scale (mean over the batch and the d dimensions), so their value carries over. The local epochs,
batch size, learning rate and momentum are the experiment's (FedPrism protocol: E = 10, B = 32, SGD lr
0.01, momentum 0.9).

Equivalence (tests): lambda = 0 is Local training (the same batches, bit for bit).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from fedprism.algorithms.aggregation import WEIGHTINGS, class_prototypes
from fedprism.algorithms.base import (Algorithm, ClientState, Inference, Plan, TensorSpec, TrainJob, Update,
                                      register)
from fedprism.errors import ConfigError
from fedprism.hparams import Param
from fedprism.privacy import clip_rows

#: which clients' prototypes the server averages (see the module docstring)
AGGREGATE_OVER = ("seen", "round")
#: samples per call when computing local prototypes
PROTO_CHUNK = 1024


# -- client side -----------------------------------------------------------------------------------------
def prototype_loss(model, w, x, y, weight, extras):
    """CE(head(f(x)), y) + lam * mean_{batch, d} present[y] ||f(x) - protos[y]||^2 (vmap-safe).

    extras: `protos` [C, d] global prototypes, `present` [C] 1 where a class has one, `lam` scalar."""
    z = model.features(w, x)
    logits = model.head(w, z)
    wsum = weight.sum().clamp(min=1.0)
    ce = (F.cross_entropy(logits, y, reduction="none") * weight).sum() / wsum
    protos = extras["protos"].to(z.dtype)
    onehot = (y[:, None] == torch.arange(protos.shape[0], device=y.device)).to(z.dtype)     # [B, C]
    target = onehot @ protos                                                              # [B, d]
    live = (onehot @ extras["present"].to(z.dtype)) * weight                              # [B]
    reg = (((z - target) ** 2).sum(-1) * live).sum() / (wsum * z.shape[-1])
    return ce + extras["lam"] * reg


def local_prototypes(trainer, clients: np.ndarray, params: torch.Tensor, num_classes: int, ctx=None, rnd: int = 0
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 4 for each client: (protos [n, C, d] float32, counts [n, C] float32) over its train split, with
    the model rows `params` [n, P]. A class the client does not have is a zero row with count 0.

    With `ctx.privacy` (`privacy.epsilon` > 0) each feature vector is clipped to `privacy.clip` and the
    class sums and counts are released with Gaussian noise before they leave the client
    (fedprism.privacy): noisy sum / max(noisy count, 1), noisy count clamped at 0."""
    privacy = getattr(ctx, "privacy", None)
    protos, counts = [], []
    for i, c in enumerate(clients):
        x, y = trainer.data(int(c), "train")
        sums = None
        for s0 in range(0, len(y), PROTO_CHUNK):
            z = trainer.features(params[i:i + 1], x[s0:s0 + PROTO_CHUNK])[0].to(torch.float64)
            if privacy is not None:
                z = clip_rows(z, privacy.clip)
            if sums is None:
                sums = torch.zeros(num_classes, z.shape[-1], dtype=torch.float64, device=z.device)
            sums.index_add_(0, y[s0:s0 + PROTO_CHUNK].to(z.device), z)
        n = torch.bincount(y.cpu(), minlength=num_classes).to(torch.float64)
        if privacy is not None:
            p, n = privacy.prototype_sums(sums.cpu(), n, privacy.generator(ctx.seed, rnd, int(c), "prototypes"))
        else:
            p = sums.cpu() / n.clamp(min=1)[:, None]
        protos.append(p.float())
        counts.append(n.float())
    return torch.stack(protos), torch.stack(counts)


def nearest_prototype(z: torch.Tensor, protos: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    """Scores [m, B, C] = -||z - protos_j||^2 (-inf for absent classes): argmax is the nearest prototype.

    z [m, B, d] features, protos [m, C, d], present [m, C]. Exact per class (no matmul expansion)."""
    protos = protos.to(z.device, z.dtype)
    d2 = torch.stack([((z - protos[:, None, j]) ** 2).sum(-1) for j in range(protos.shape[1])], -1)
    return torch.where(present[:, None, :].to(z.device) > 0, -d2, torch.full_like(d2, float("-inf")))


def _head(z, e):
    return z["model"]


def _proto(z, e):
    return nearest_prototype(z["features"], e["protos"], e["present"])


# -- server side -------------------------------------------------------------------------------------------
def prototype_state(ctx, aggregate_over: str) -> dict:
    """Server state of the global prototypes (and every client's latest upload for `seen`)."""
    C, d, N = ctx.num_classes, ctx.feature_dim, ctx.num_clients
    state = {"protos": torch.zeros(C, d), "present": torch.zeros(C, dtype=torch.bool)}
    if aggregate_over == "seen":
        state["client_protos"] = torch.zeros(N, C, d)
        state["client_counts"] = torch.zeros(N, C)
    return state


def update_prototypes(state: dict, update: Update, weighting: str, aggregate_over: str) -> None:
    """Eq. 6 on the server state: over every client's latest upload (`seen`) or this round's (`round`;
    classes none of them has keep their previous prototype)."""
    protos, counts = update.payload["protos"], update.payload["counts"]
    if aggregate_over == "seen":
        S = torch.as_tensor(update.clients)
        state["client_protos"][S] = protos.to(state["client_protos"].dtype)
        state["client_counts"][S] = counts.to(state["client_counts"].dtype)
        state["protos"], state["present"] = class_prototypes(state["client_protos"], state["client_counts"],
                                                             weighting)
    else:
        mean, present = class_prototypes(protos, counts, weighting)
        state["protos"][present] = mean[present].to(state["protos"].dtype)
        state["present"] |= present


def prototype_rows(state: dict, n: int) -> dict:
    """The global prototypes and the presence mask, one row per client."""
    return {"protos": state["protos"].expand(n, -1, -1).clone(),
            "present": state["present"].to(torch.float32).expand(n, -1).clone()}


def check_feature_dim(ctx, method: str) -> None:
    if ctx.feature_dim <= 0:
        raise ConfigError("model", f"feature width {ctx.feature_dim}", f"a model whose head starts with a Linear "
                          f"layer ({method} needs the width of the penultimate features)")


class PrototypeClients(Algorithm):
    """What FedProto and PFPL share: each client keeps its whole model as client state, uploads its class
    prototypes [C, d] and counts [C] (Eq. 4, through `local_prototypes`, so `privacy.epsilon` applies),
    and predicts with its own model's head."""

    client_state = {"w": ClientState(("P",), init="model")}
    shares_prototypes = True             # `privacy.epsilon` releases them with DP (fedprism.privacy)

    def __init__(self, ctx, **hp):
        super().__init__(ctx, **hp)
        check_feature_dim(ctx, self.name)

    @classmethod
    def headline(cls, config: dict) -> str:
        return "own model (head)"

    def upload(self) -> dict:
        return {"protos": TensorSpec(("C", "d")), "counts": TensorSpec(("C",), low=0)}


@register
class FedProto(PrototypeClients):
    name = "fedproto"
    paper = "Tan et al. 2022, FedProto, AAAI, arXiv:2105.00243"
    params = {
        "lam": Param(1.0, "lambda: weight of the prototype regulariser (Eq. 8)", lambda v: v >= 0,
                     "a number >= 0"),
        "weighting": Param("samples", "global prototype: samples (|D_ij|-weighted, Eq. 6) or uniform "
                           "(plain mean over clients, the authors' code)", choices=WEIGHTINGS),
        "aggregate_over": Param("seen", "global prototype over every client's latest upload (seen) or this "
                                "round's reporters (round)", choices=AGGREGATE_OVER),
    }
    predictions = {"proto": "nearest global prototype"}

    def init_state(self) -> dict:
        return prototype_state(self.ctx, self.hp["aggregate_over"])

    def plan(self, state: dict, rnd: int, clients: np.ndarray) -> Plan:
        return Plan(clients, prototype_rows(state, len(clients)))

    def client_update(self, plan: Plan, trainer, rnd: int, cstate: dict) -> Update:
        """LocalUpdate of Algorithm 1: train the own model with Eq. 8, then report Eq. 4's prototypes."""
        S = plan.clients
        extras = {"protos": plan.payload["protos"], "present": plan.payload["present"],
                  "lam": torch.full((len(S),), float(self.hp["lam"]))}
        t = trainer.train(TrainJob(S, cstate["w"].clone(), loss=prototype_loss, extras=extras), rnd)
        protos, counts = local_prototypes(trainer, S, t.params, self.ctx.num_classes, self.ctx, rnd)
        return Update(S, {"protos": protos, "counts": counts}, t.n_samples, {"train_loss": t.loss},
                      client_state={"w": t.params})

    def aggregate(self, state: dict, rnd: int, update: Update) -> dict:
        update_prototypes(state, update, self.hp["weighting"], self.hp["aggregate_over"])
        return {}

    def eval_payload(self, state: dict, clients: np.ndarray) -> dict:
        return prototype_rows(state, len(clients))

    def inference(self, trainer, clients, payload: dict, cstate: dict) -> Inference:
        """The own model's head (headline) and its features for the nearest-prototype alternative."""
        w = cstate["w"]
        return Inference({"model": w, "features": w}, _head, {"proto": _proto},
                         extras={"protos": payload["protos"], "present": payload["present"]},
                         features=("features",))
