"""APFL, adaptive personalized federated learning (Deng, Kamani, Mahdavi 2020, "Adaptive Personalized
Federated Learning", arXiv:2003.13461), Algorithm 1 with the adaptive mixing weight (Eq. 10).

Each client k keeps a local model v_k and a mixing weight alpha_k; its personalized model is

    v_bar_k = alpha_k v_k + (1 - alpha_k) w

Algorithm 1, one local step of client k (iterate t - 1 -> t, one minibatch xi^t, step size eta):

    w_k     <- w_k - eta grad f_k(w_k; xi)                          the client's copy of the global model
    v_k     <- v_k - eta grad_v f_k(v_bar_k; xi) = v_k - eta alpha_k grad f_k(v_bar_k; xi)
    alpha_k <- alpha_k - eta grad_alpha f_k(v_bar_k; xi)
             = alpha_k - eta <v_k - w_k, grad f_k(v_bar_k; xi)>                          (Eq. 10)

all three at the previous iterate (v_bar_k of step t - 1). Every tau = E epochs the sampled clients send
w_k, the server averages them (FedAvg: n_k / N_t weights, `weighting`) and the next round starts from
the average. Inference: the mixed model alpha_k v_k + (1 - alpha_k) w with the current global w.

How it is computed here (decisions):

* One training job per round over the concatenated vector z = [w_k; v_k; alpha_k] (2P + 1 numbers per
  client) with one vmap-safe loss

      L(z) = f(w) + (f(v_bar) - stop_grad(f(v_bar))),
      v_bar = a v + (1 - a) stop_grad(w),   a = clip(alpha, 0, 1)

  Its gradient is exactly Algorithm 1's three directions: dL/dw = grad f(w) (the mixed term sees w
  through stop_grad only), dL/dv = a grad f(v_bar), dL/dalpha = <v - w, grad f(v_bar)> (Eq. 10's), all
  at the same iterate and on the same minibatch, so one optimiser step on z is one step of Algorithm 1
  (simultaneous updates, as written; both engines run it, the vectorized one under vmap). Its value is
  f(w) exactly (the second term is x - x = 0), so the training loss reported is the uploaded model's,
  as FedAvg's is.
* Optimiser: the experiment's, coordinate-wise on z (SGD with momentum 0.9 in this protocol, so v and
  alpha get momentum as w does); the paper uses plain SGD with one step size eta_t for all three, and
  that is what `momentum=0` gives. The optimiser state starts fresh each round. Weight decay, if the
  experiment sets any (this protocol: 0), applies to all three as well.
* alpha is updated at every local step (Eq. 10 is written per local iteration, with the step's eta_t
  and sample xi^t). The authors' code (MLOPTPSU/FedTorch, apfl.py) updates it once per round, at the
  first minibatch, and adds a 0.02 alpha term to its gradient; neither is in the paper and neither is
  done here.
* Clipping to [0, 1]: the mixing uses a = clip(alpha, 0, 1) at every step (so v_bar is always a convex
  combination), and the stored alpha_k is clipped to [0, 1] at the end of each round. A step that
  takes alpha outside [0, 1] leaves the mixing at the boundary; the clip's gradient is then 0, so
  alpha stays outside until the end of the round, where the projection puts it on the boundary (a
  projection applied once per round instead of after every step). At exactly 0 or 1 the gradient
  still flows (the clip passes it at its bounds), so a clipped alpha can move back inside.
* Mixing in parameter space, as the paper defines v_bar; the authors' code and FL-bench mix the two
  models' logits instead.
* `alpha_mode=fixed` keeps alpha_k = `alpha` for ever (the paper's APFL with a given alpha; alpha is
  masked out of training). With alpha = 0, w trains exactly as a FedAvg client and v_bar = w: APFL is
  FedAvg bit for bit (tested). With alpha = 1 the personalized model is v_k alone, trained on its own
  loss (a Local model that also trains the global model).
* Default alpha = 0.5 (initial value in adaptive mode): the authors' code's default
  (`--fed_personal_alpha 0.5`) and the middle of the fixed values the paper compares (0.25, 0.5,
  0.75); the adaptive mode is the default (the paper's adaptive APFL).
* v_k and alpha_k are declared client state (v_k starts at the run's initial model, alpha_k at
  `alpha`); they never travel: the upload is w_k alone (bytes up equal FedAvg's), the evaluation
  payload is the global w (as FedAvg's), and the client mixes it with its own v_k and alpha_k.
  A never-sampled client predicts with alpha v^0 + (1 - alpha) w.
* The global model w is also scored on the global test set every evaluation (`global_model_acc`).
"""

from __future__ import annotations

import torch

from fedprism.algorithms.base import ClientState, Inference, Plan, TrainJob, Update, register
from fedprism.algorithms.fedavg import FedAvg
from fedprism.hparams import Param
from fedprism.objectives import ce


def split(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w, v, alpha) of z = [w; v; alpha] (last dimension 2P + 1)."""
    P = (z.shape[-1] - 1) // 2
    return z[..., :P], z[..., P:2 * P], z[..., 2 * P]


def apfl_loss(model, z, x, y, weight, extras):
    """f(w) + (f(v_bar) - stop_grad f(v_bar)) with v_bar = a v + (1 - a) stop_grad(w), a = clip(alpha, 0, 1):
    value f(w); gradient (grad f(w), a grad f(v_bar), <v - w, grad f(v_bar)>) = Algorithm 1's step."""
    w, v, alpha = split(z)
    a = alpha.clamp(0.0, 1.0)
    mixed = ce(model, a * v + (1 - a) * w.detach(), x, y, weight, extras)
    return ce(model, w, x, y, weight, extras) + (mixed - mixed.detach())


def mix(alpha: torch.Tensor, v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """alpha_k v_k + (1 - alpha_k) w_k per row, in float64, in w's dtype."""
    a = alpha.to(torch.float64).reshape(-1, 1)
    return (a * v.to(torch.float64) + (1 - a) * w.to(torch.float64)).to(w.dtype)


@register
class APFL(FedAvg):
    name = "apfl"
    paper = "Deng, Kamani, Mahdavi 2020, arXiv:2003.13461"
    personalized = True
    #: its local objective evaluates the model at other parameters than its own (the mixed model, the inner
    #: step, the inner problem): the fused training kernels cannot take it, so `train.kernels = auto` is aten
    #: here and `fused` is refused (`fedprism.kernels.fused.WithStem`)
    fused_training = False
    params = {
        "alpha": Param(0.5, "mixing weight alpha_k of the local model (initial value when adaptive)",
                       lambda v: 0 <= v <= 1, "a number in [0, 1]"),
        "alpha_mode": Param("adaptive", "alpha_k learnt by Eq. 10 (adaptive) or kept at `alpha` (fixed)",
                            choices=("adaptive", "fixed")),
        "weighting": FedAvg.params["weighting"],
    }
    #: the declaration (`__init__` starts alpha at the configured value)
    client_state = {"v": ClientState(("P",), init="model"), "alpha": ClientState((), init=0.5)}

    def __init__(self, ctx, **hp):
        super().__init__(ctx, **hp)
        self.client_state = {"v": ClientState(("P",), init="model"),
                             "alpha": ClientState((), init=float(self.hp["alpha"]))}

    def client_update(self, plan: Plan, trainer, rnd: int, cstate: dict) -> Update:
        """E epochs of Algorithm 1's local steps on [w; v_k; alpha_k]; upload w_k, keep v_k and alpha_k."""
        S, w = plan.clients, plan.start
        v = cstate["v"].to(w.device, w.dtype)
        alpha = cstate["alpha"].to(w.device, w.dtype)
        z = torch.cat([w, v, alpha.reshape(-1, 1)], dim=1)
        mask = None
        if self.hp["alpha_mode"] == "fixed":
            mask = torch.ones(z.shape[1], dtype=z.dtype, device=z.device)
            mask[-1] = 0
        t = trainer.train(TrainJob(S, z, loss=apfl_loss, mask=mask), rnd)
        w_new, v_new, a_new = split(t.params)
        return Update(S, {"params": w_new.contiguous()}, t.n_samples, {"train_loss": t.loss},
                      client_state={"v": v_new.contiguous(), "alpha": a_new.clamp(0.0, 1.0).contiguous()})

    # -- evaluation: the mixed model, built on the client ------------------------------------------
    def inference(self, trainer, clients, payload: dict, cstate: dict) -> Inference:
        w = payload["params"]
        return Inference({"mixed": mix(cstate["alpha"].to(w.device), cstate["v"].to(w.device), w)})

    def extra_models(self, state: dict) -> dict:
        return {"global": state["w"]}
