"""Per-FedAvg (Fallah, Mokhtari, Ozdaglar 2020, "Personalized Federated Learning with Theoretical
Guarantees: A Model-Agnostic Meta-Learning Approach", NeurIPS 2020, arXiv:2002.07948), Algorithm 1.

The federation minimises the MAML objective (Eq. 3) F(w) = sum_k p_k f_k(w - alpha grad f_k(w)): a good
start for one step of personalisation. Round t of Algorithm 1, each sampled client k, from w^t:

    for each local step, with independent batches D, D' (and D'' for HF):
        w_tmp <- w - alpha grad f_k(w; D)                                                    (inner step)
        FO:  w <- w - beta grad f_k(w_tmp; D')                                         (Hessian dropped)
        HF:  w <- w - beta (I - alpha grad^2 f_k(w; D'')) grad f_k(w_tmp; D')
    server: w^{t+1} = sum_{k in S_t} (n_k / N_t) w_k                         (FedAvg's aggregation)

Evaluation (personalisation): client k predicts with w_k = w - alpha grad f_k(w) (`eval_steps` such steps
from the received global w); the un-adapted global w is the alternative prediction `global`.

Decisions where the paper is silent or this protocol differs:

* One local step per batch of the experiment (batch_size B): the batch is split into D (positions 0, 2,
  4, ...) and D' (1, 3, ...); HF splits it in three (positions mod 3: D, D', D''). The batches are
  random permutations of the client's data, so the parts are independent draws without replacement;
  an epoch still sees every sample once, in one role (FL-bench's perfedavg client likewise runs
  len(loader) / 2 or / 3 steps of full batches per epoch). Padding sits at the end of the vectorized
  engine's last batch, so both engines form the same parts. A part of a last batch that is empty (fewer
  than 2 or 3 samples) has loss 0 and a zero gradient (tested), as an all-padding part does.
* The direction is written as a loss (`maml_fo`, `maml_hf`): the inner gradient is taken with
  `torch.func.grad` on a detached copy of w, so the engine's own gradient of the loss is exactly the
  Per-FedAvg direction and its value is f_k(w_tmp; D') (the reported train_loss).
* HF's Hessian-vector product is exact, the gradient of <grad f(w; D''), d> (reverse over reverse), not
  the paper's finite difference (with its delta): it costs about two gradients, as the difference
  does, and has no delta to tune. Both variants compile to one graph in the vectorized engine (tested);
  forward over reverse (`torch.func.jvp`) would break that graph in torch 2.13.
* beta is the experiment's client optimiser: its `lr` and its momentum (SGD, momentum 0.9 by default;
  `optimizer=adam` works too). The paper's steps are plain SGD: set `momentum=0`. A `TrainJob` has no
  step size of its own, so there is no `perfedavg.beta`. alpha (`perfedavg.alpha`) is the method's own.
* alpha = 0: Per-FedAvg's step is a plain SGD step, so the method trains with the experiment's `ce` on
  the whole batch (D and D' together) and is FedAvg bit for bit, its evaluation included (tested).
* Evaluation steps are full-batch gradient steps on the client's whole training split, plain
  (no momentum), step alpha: the expectation of the paper's stochastic step, deterministic, and the
  same on a re-scored run and a Flower node (PFLlib's clientperavg.train_one_step uses minibatches).
  `eval_steps` = 0 predicts with the global model exactly. The steps are computed with the trainer's
  differentiable functional model (`Trainer.f`): a `TrainJob` cannot take a plain step of size alpha
  (it uses the experiment's optimiser). BatchNorm
  statistics in these steps are those of chunks of `EVAL_CHUNK` training samples.
* Default alpha = 0.01 (this protocol's `lr`; FL-bench's inner step is its optimiser's lr). The paper
  tunes alpha per data set; `eval_steps` = 1, the paper's one step.
* `perfedavg.server_opt` and `perfedavg.aggregation` act on the averaged models as for FedAvg.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch.func import grad, grad_and_value

from fedprism.algorithms.base import Inference, Plan, TrainJob, Update, register, train_update
from fedprism.algorithms.fedavg import FedAvg
from fedprism.hparams import Param
from fedprism.objectives import ce

EVAL_CHUNK = 1024          # training samples per forward pass of an evaluation step


def _part(x, y, weight, i: int, k: int):
    return x[i::k], y[i::k], weight[i::k]


def _grad(model, w, part) -> torch.Tensor:
    """grad f(w; part): zero for an empty part (`ce` divides by max(1, samples))."""
    return grad(lambda v: ce(model, v, *part, {}))(w)


def _maml(model, w, x, y, weight, extras, hessian: bool) -> torch.Tensor:
    """A loss whose value is f(w_tmp; D') and whose gradient in w is the Per-FedAvg direction."""
    k, alpha, w0 = 3 if hessian else 2, extras["alpha"], w.detach()
    D, D1 = _part(x, y, weight, 0, k), _part(x, y, weight, 1, k)
    w_tmp = w0 - alpha * _grad(model, w0, D)                                   # the inner step
    d, value = grad_and_value(lambda v: ce(model, v, *D1, {}))(w_tmp)             # grad f(w_tmp; D')
    if hessian:                              # (I - alpha grad^2 f(w; D'')) d: exact Hessian-vector product
        D2 = _part(x, y, weight, 2, k)
        d = d - alpha * grad(lambda v: (_grad(model, v, D2) * d).sum())(w0)
    return value.detach() + ((w - w0) * d.detach()).sum()


def maml_fo(model, w, x, y, weight, extras):
    """Per-FedAvg (FO): gradient grad f(w - alpha grad f(w; D); D')."""
    return _maml(model, w, x, y, weight, extras, hessian=False)


def maml_hf(model, w, x, y, weight, extras):
    """Per-FedAvg (HF): gradient (I - alpha grad^2 f(w; D'')) grad f(w - alpha grad f(w; D); D')."""
    return _maml(model, w, x, y, weight, extras, hessian=True)


def adapt(f, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, alpha: float, steps: int) -> torch.Tensor:
    """`steps` full-batch gradient steps w <- w - alpha grad f(w; x, y) (mean cross-entropy)."""
    def mean_ce(v):
        return sum(F.cross_entropy(f(v, x[s:s + EVAL_CHUNK]), y[s:s + EVAL_CHUNK], reduction="sum")
                   for s in range(0, len(y), EVAL_CHUNK)) / len(y)

    for _ in range(steps if len(y) else 0):
        w = w - alpha * grad(mean_ce)(w)
    return w.detach()


def _global(logits: dict, extras: dict) -> torch.Tensor:
    return logits["global"]


@register
class PerFedAvg(FedAvg):
    name = "perfedavg"
    paper = "Fallah, Mokhtari, Ozdaglar 2020, arXiv:2002.07948"
    personalized = True
    #: its local objective evaluates the model at other parameters than its own (the mixed model, the inner
    #: step, the inner problem): the fused training kernels cannot take it, so `train.kernels = auto` is aten
    #: here and `fused` is refused (`fedprism.kernels.fused.WithStem`)
    fused_training = False
    predictions = {"global": "global model, not adapted"}
    params = {
        "variant": Param("fo", "fo: first-order MAML step; hf: with the Hessian-vector product",
                         choices=("fo", "hf")),
        "alpha": Param(0.01, "inner (personalisation) step size alpha", lambda v: 0 <= v < float("inf"),
                       "a finite number >= 0"),
        "eval_steps": Param(1, "gradient steps of size alpha from the global model before predicting",
                            lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
                            "an integer >= 0", eval_only=True),
        "weighting": FedAvg.params["weighting"],
    }

    @classmethod
    def headline(cls, config: dict) -> str:
        steps = config.get(f"{cls.name}.eval_steps", 1) if config.get(f"{cls.name}.alpha", 0.01) else 0
        return f"adapted ({steps} step{'s' * (steps != 1)} of alpha)" if steps else "global model"

    def client_update(self, plan: Plan, trainer, rnd: int, cstate: dict) -> Update:
        """Algorithm 1's local steps from w^t for E epochs (alpha = 0: plain SGD, FedAvg's job)."""
        S, a = plan.clients, self.hp["alpha"]
        if a == 0:
            return train_update(trainer, TrainJob(S, plan.start), rnd)
        loss = maml_hf if self.hp["variant"] == "hf" else maml_fo
        return train_update(trainer, TrainJob(S, plan.start, loss=loss,
                                              extras={"alpha": torch.full((len(S),), float(a))}), rnd)

    def inference(self, trainer, clients: np.ndarray, payload: dict, cstate: dict) -> Inference:
        """Each client adapts the global w with `eval_steps` steps of size alpha on its training split."""
        w, steps, a = payload["params"], self.hp["eval_steps"], self.hp["alpha"]
        if steps == 0 or a == 0:
            return Inference({"global": w})
        dev = trainer.device
        rows = [adapt(trainer.f, w[i].to(dev), *trainer.data(int(c), "train"), a, steps).to(w.device, w.dtype)
                for i, c in enumerate(clients)]
        adapted = torch.stack(rows) if rows else w.clone()
        return Inference({"adapted": adapted, "global": w}, alternatives={"global": _global})

    def extra_models(self, state: dict) -> dict:
        return {"global": state["w"]}
