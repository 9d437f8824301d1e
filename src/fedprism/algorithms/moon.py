"""MOON, model-contrastive federated learning (Li, He, Song 2021, "Model-Contrastive Federated Learning",
CVPR 2021, arXiv:2103.16257), Algorithm 1.

Client i, sampled in round t, receives the global model w^t and keeps its previous local model w_{t-1}^i.
For an input x let z = R_w(x), z_glob = R_{w^t}(x), z_prev = R_{w_{t-1}^i}(x) be the representations of
the model being trained, the global model and the previous local model. The model-contrastive loss pulls
z towards the global representation and pushes it from the previous local one (numbered here):

    (1)  l_con = -log( exp(sim(z, z_glob) / tau) / (exp(sim(z, z_glob) / tau) + exp(sim(z, z_prev) / tau)) )
    (2)  l     = l_sup(w; (x, y)) + mu l_con(w; w^t; w_{t-1}^i; x)

sim is the cosine similarity, l_sup the cross-entropy. The client minimises the mean of (2) over its
batches from w^t for E local epochs, uploads w_t^i and keeps it as its next previous model; the server
averages as FedAvg does:

    (3)  w^{t+1} = sum_{i in S_t} (n_i / N_t) w_t^i

Decisions where the paper is silent or this protocol differs:

* Representation: the model's body output, `model.features(w, x)` (the input of its classifier head),
  with no projection head. The paper's networks add a projection head (a two-layer MLP) between the
  base encoder and the output layer; here the model is the run's registered model, the same for every
  method of a comparison, and a projection head would be parameters only MOON trains and sends. The
  head is trained by l_sup on the body output as usual.
* The two frozen models (w^t and w_{t-1}^i) are constants of the loss: no gradient flows into them, and
  their representations are computed without dropout (a model with dropout applies the step's mask to
  the model being trained only), so the targets of (1) do not change with the step's noise.
* The previous local model is declared client state (`ClientState(("P",), init="model")`): it never
  travels (bytes up and down are FedAvg's), survives checkpoints and Flower restarts, and moves only
  when the client trains. Before a client first trains it is the run's initial model w^0: in round 0
  (w^t = w^0 too) z_glob = z_prev, so (1) is the constant log 2 with zero gradient and the first round
  is FedAvg's; a client first sampled later is pushed from w^0.
* (1) is averaged over the batch's real samples (padding rows of the vectorized engine weigh 0), as
  l_sup is. sim is torch's cosine similarity (eps 1e-8).
* mu = 0: the client trains the experiment's own objective (the plain cross-entropy path; (1) and the two
  extra forward passes are skipped), so MOON is FedAvg bit for bit (tested through the runner); the
  previous model is still kept.
* Aggregation (3): n_k-weighted (`weighting=samples`, the paper's FedAvg server), or `uniform`, through
  the shared server step (`averages = ("w",)`: `moon.aggregation`, `moon.server_opt`).
* Defaults: tau = 0.5, the paper's temperature and the authors' code default (QinbinLi/MOON, main.py:
  `--temperature 0.5`); mu = 1, the authors' code default (`--mu 1`), from the grid the paper tunes mu
  over ({0.1, 1, 5, 10}; it reports 5 best for CIFAR-10, the value of the code's README example, and 1 for
  CIFAR-100 and Tiny-ImageNet).
* (1) with one previous model is the authors' code with its default `--model_buffer_size 1`: the
  cross-entropy of the logits [sim(z, z_glob), sim(z, z_prev)] / tau with the target 0; the code adds
  both terms per batch as CE + mu l_con, the batch means, as (2) here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fedprism.algorithms.base import ClientState, Plan, TrainJob, Update, register
from fedprism.algorithms.fedavg import FedAvg
from fedprism.hparams import Param
from fedprism.objectives import ce


def contrastive(z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor, tau) -> torch.Tensor:
    """(1) per sample ([B]): -log(e^{a} / (e^{a} + e^{b})) = logaddexp(a, b) - a, with a = sim(z, z_glob)
    / tau and b = sim(z, z_prev) / tau (cosine similarities over the last dimension)."""
    a = F.cosine_similarity(z, z_glob, dim=-1) / tau
    b = F.cosine_similarity(z, z_prev, dim=-1) / tau
    return torch.logaddexp(a, b) - a


def moon_loss(f, w, x, y, weight, extras):
    """(2) on one batch: cross-entropy + mu x the weighted mean of (1), with extras `glob` (w^t), `prev`
    (w_{t-1}^i), `mu` and `tau` (vmap-safe)."""
    frozen = getattr(f, "f", f)                    # the model without the step's dropout key (`params.Keyed`)
    z = f.features(w, x)
    l_con = contrastive(z, frozen.features(extras["glob"], x), frozen.features(extras["prev"], x), extras["tau"])
    return ce(f, w, x, y, weight, extras) + extras["mu"] * (l_con * weight).sum() / weight.sum().clamp(min=1.0)


@register
class Moon(FedAvg):
    name = "moon"
    paper = "Li, He, Song 2021, arXiv:2103.16257"
    personalized = False
    #: its local objective evaluates the global and the previous model's features on the batch (other
    #: parameters than its own): the fused training kernels cannot take it, so `train.kernels = auto` is
    #: aten here and `fused` is refused
    fused_training = False
    client_state = {"prev": ClientState(("P",), init="model")}
    params = {
        "mu": Param(1.0, "mu: local loss CE + mu x the model-contrastive loss (0: FedAvg)", lambda v: v >= 0,
                    "a number >= 0"),
        "tau": Param(0.5, "tau: temperature of the model-contrastive loss", lambda v: v > 0, "a number > 0"),
        "weighting": FedAvg.params["weighting"],
    }

    def client_update(self, plan: Plan, trainer, rnd: int, cstate: dict) -> Update:
        """(2) from w^t for E epochs; upload w_t^i and keep it as the previous local model."""
        S, w_t = plan.clients, plan.start
        mu = float(self.hp["mu"])
        if mu == 0:                                     # the plain objective: FedAvg's client
            job = TrainJob(S, w_t)
        else:
            n, dev = len(S), w_t.device
            job = TrainJob(S, w_t, loss=moon_loss,
                           extras={"glob": w_t, "prev": cstate["prev"].to(dev, w_t.dtype),
                                   "mu": torch.full((n,), mu, device=dev),
                                   "tau": torch.full((n,), float(self.hp["tau"]), device=dev)})
        t = trainer.train(job, rnd)
        return Update(t.clients, {"params": t.params}, t.n_samples, {"train_loss": t.loss},
                      client_state={"prev": t.params})

    def client_side_inference(self) -> bool:
        """The clients predict with the server's model: the previous local model only shapes training."""
        return False
