"""FedFomo (Zhang, Sapra, Fidler, Yeung, Alvarez 2021, "Personalized Federated Learning with First Order Model
Optimization", ICLR, arXiv:2012.08565), Algorithm 1.

No global model. The server keeps every client's latest uploaded model theta_n and an affinity matrix P
[N, N]. In round t each sampled client i downloads M models of other clients, chosen by P with
epsilon-greedy exploration, and weighs each by how much it lowers its own validation loss per unit of
distance (a first-order estimate of the optimal weighting; equations numbered here):

    w_{i,n} = ( L_i(theta_i^{t-1}) - L_i(theta_n^t) ) / || theta_n^t - theta_i^{t-1} ||              (1)
    w_{i,n} <- max(w_{i,n}, 0) / sum_n max(w_{i,n}, 0)                                                (2)
    theta_i^t = theta_i^{t-1} + sum_n w_{i,n} (theta_n^t - theta_i^{t-1})                            (3)

L_i is client i's loss on its validation split. Then theta_i^t trains with the experiment's local
training (E epochs) and is uploaded; the server stores it as client i's model and adds the client's
(unclipped) weights to its row of the affinity matrix, P_{i,n} <- P_{i,n} + w_{i,n}.

Download rule: with probability epsilon_t the M models are drawn uniformly at random
(exploration), otherwise they are the M with the largest P_{i,n} (exploitation).

Parameters (`fedfomo.<name>`): `m` = M, `epsilon`, `epsilon_decay`, `val_split`.

Decisions where the paper is silent or its code differs (the authors' code NVlabs/FedFomo, PFLlib's
clientfomo.py / serverfomo.py):

* Validation split. With `data.val_fraction` > 0, each client's own validation rows (held out of its
  training rows by the federation) are L_i's data. Without them, L_i is taken on `val_split` (default 0.2,
  the authors' `--train_split 0.8`) of the client's training rows, max(1, floor(0.2 n_i)) of them, drawn
  once per client with the stream of (run seed, client, 'fedfomo_val') and the same in every round. These
  rows are NOT held out of local training (the engines train on a client's whole training split), so this
  L_i is a training loss and favours the client's own model; set `data.val_fraction` for a held-out L_i.
  A client with no rows at all gives every weight 0.
* M = 5 (PFLlib's default; the authors' "5 models" runs download 4 others beside the own model);
  epsilon = 0.3 decayed linearly by 0.05 per round, epsilon_t = max(0, epsilon - 0.05 t) (the authors'
  `--client_weight_epsilon 0.3 --client_weight_epsilon_decay 0.05`). The coin and the random picks use the
  stream of (run seed, round, client, 'fedfomo') (`fedprism.seeds.stream_seed`): the same in any cohort.
* Candidates are the clients other than i that have uploaded at least once (the server holds no model of
  the others yet): fewer than M candidates send them all; in round 0 nothing is sent and each client
  trains its own model. Exploitation breaks ties of P at random (P starts at zero, so round 1 is random).
* The own model theta_i^{t-1} is the client's own (client state, never downloaded): its last trained
  model, the initial model before its first round.
* (1) with theta_n = theta_i (distance 0) gives w = 0. If every weight is <= 0, theta_i is unchanged.
  (3) is computed in float64 from the normalised weights. L_i is the mean cross-entropy over the
  validation rows (float64 sums), the models without dropout.
* The distance in (1) is the Euclidean norm of theta_n - theta_i (as PFLlib's clientfomo.py, which adds
  1e-5 to it); the authors' code defaults to the L1 norm (`--model_delta_norm l1`, federated/utils.py
  `compute_parameter_difference`), which its README commands keep.
* P is updated with the raw weights of (1) (negative ones lower the affinity of a harmful model), as
  PFLlib does; the authors' code (federation.py, `update_client_weights`) adds them divided by
  |sum_n w_{i,n}|. Only accepted uploads update P. P starts at zero (PFLlib: the identity, which only
  concerns the own model, never a candidate here; the authors' code: 0.1 for the own model, 0 elsewhere).
* Exploration: one coin per client and round decides between M random models and the top M. The authors'
  code (client.py, `get_federating_clients`) tosses the coin for each of the M picks in turn, so a
  download can mix top and random models.
* Messages: a plan row holds the M models and their client ids (-1 pads a row with fewer than M); only
  the real ones travel (`encode`), 4 P + 8 bytes each. The upload is the trained model and the M raw
  weights (zeros on padding).
* Evaluation: each client predicts with its own model (client state); a client never sampled with the
  initial model. The server's models are one per client (`server_models`).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from fedprism.algorithms.base import Algorithm, ClientState, Inference, Plan, TensorSpec, TrainJob, Update, register
from fedprism.hparams import Param
from fedprism.seeds import stream_seed

#: the random streams of the download choice and of the validation carve-out
STREAM, VAL_STREAM = "fedfomo", "fedfomo_val"
#: validation rows per forward pass
CHUNK = 1024


# -- pure functions ---------------------------------------------------------------------------------------
def epsilon_at(epsilon: float, decay: float, rnd: int) -> float:
    """epsilon_t = max(0, epsilon - decay t)."""
    return max(0.0, epsilon - decay * rnd)


def choose_models(affinity_row: np.ndarray, candidates: np.ndarray, m: int, eps: float,
                  rng: np.random.Generator) -> np.ndarray:
    """The ids to send: all candidates when there are at most m; else with probability eps m at random,
    otherwise the m with the largest affinity (ties at random)."""
    candidates = np.asarray(candidates, dtype=np.int64)
    if len(candidates) <= m:
        return candidates
    explore = rng.random() < eps
    if explore:
        return np.sort(rng.choice(candidates, size=m, replace=False))
    order = np.lexsort((rng.random(len(candidates)), -affinity_row[candidates]))
    return np.sort(candidates[order[:m]])


def fomo_weights(own_loss: float, losses: torch.Tensor, dists: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(1)-(2): (raw w_n [m] float64, normalised weights [m] float64; all zero when no w_n > 0)."""
    losses, dists = losses.to(torch.float64), dists.to(torch.float64)
    gain = own_loss - losses
    raw = torch.where(dists > 0, gain / torch.where(dists > 0, dists, torch.ones_like(dists)), torch.zeros_like(gain))
    pos = raw.clamp(min=0)
    total = pos.sum()
    return raw, (pos / total if total > 0 else torch.zeros_like(pos))


def fomo_update(theta: torch.Tensor, models: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(3): theta + sum_n w_n (theta_n - theta), float64, returned in theta's dtype."""
    t = theta.to(torch.float64)
    if len(weights) == 0 or not bool((weights > 0).any()):
        return theta.clone()
    step = (weights.to(torch.float64)[:, None] * (models.to(torch.float64) - t)).sum(0)
    return (t + step).to(theta.dtype)


def mean_ce(f, params: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[k] float64 mean cross-entropy of each model row of `params` [k, P] on (x, y)."""
    out = torch.zeros(len(params), dtype=torch.float64)
    if len(y) == 0:
        return out
    with torch.no_grad():
        for j, p in enumerate(params):
            out[j] = sum(float(F.cross_entropy(f(p, x[s:s + CHUNK]), y[s:s + CHUNK], reduction="sum"))
                         for s in range(0, len(y), CHUNK)) / len(y)
    return out


def validation_rows(trainer, client: int, val_split: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """L_i's data: the client's validation rows, else a fixed `val_split` of its training rows."""
    try:
        x, y = trainer.data(client, "val")
        if len(y):
            return x, y
    except ValueError:                    # the federation has no validation splits (data.val_fraction = 0)
        pass
    x, y = trainer.data(client, "train")
    if len(y) == 0:
        return x, y
    k = max(1, int(np.floor(val_split * len(y))))
    rows = np.random.default_rng(stream_seed(seed, 0, client, VAL_STREAM)).permutation(len(y))[:k]
    idx = torch.as_tensor(np.sort(rows), device=y.device)
    return x[idx], y[idx]


@register
class FedFomo(Algorithm):
    name = "fedfomo"
    paper = "Zhang et al. 2021, FedFomo, ICLR, arXiv:2012.08565"
    personalized = True
    client_state = {"theta": ClientState(("P",), init="model")}
    params = {
        "m": Param(5, "M: models of other clients each sampled client downloads",
                   lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "an integer >= 1"),
        "epsilon": Param(0.3, "epsilon: probability of downloading M random models instead of the top M by "
                         "affinity", lambda v: 0 <= v <= 1, "a number in [0, 1]"),
        "epsilon_decay": Param(0.05, "epsilon_t = max(0, epsilon - epsilon_decay t)", lambda v: v >= 0,
                               "a number >= 0"),
        "val_split": Param(0.2, "without data.val_fraction: share of the training rows L_i is taken on (not held "
                           "out of training)", lambda v: 0 < v <= 1, "a number in (0, 1]"),
    }

    @classmethod
    def headline(cls, config: dict) -> str:
        return "own model"

    @classmethod
    def server_models(cls, hp: dict, clients: int, cohort: int) -> dict:
        return {"clients": clients}

    def upload(self) -> dict:
        return {"params": TensorSpec(("P",)), "weights": TensorSpec((self.hp["m"],))}

    def init_state(self) -> dict:
        N = self.ctx.num_clients
        return {"models": self.ctx.init.expand(N, -1).clone(), "affinity": torch.zeros(N, N, dtype=torch.float64),
                "seen": torch.zeros(N, dtype=torch.bool)}

    def plan(self, state: dict, rnd: int, clients: np.ndarray) -> Plan:
        M, P = self.hp["m"], self.ctx.spec.size
        eps = epsilon_at(self.hp["epsilon"], self.hp["epsilon_decay"], rnd)
        seen = state["seen"].numpy()
        affinity = state["affinity"].numpy()
        models = torch.zeros(len(clients), M, P, dtype=state["models"].dtype)
        ids = torch.full((len(clients), M), -1, dtype=torch.int64)
        for r, c in enumerate(clients):
            cands = np.flatnonzero(seen & (np.arange(len(seen)) != int(c)))
            rng = np.random.default_rng(stream_seed(self.ctx.seed, rnd, int(c), STREAM))
            chosen = choose_models(affinity[int(c)], cands, M, eps, rng)
            ids[r, :len(chosen)] = torch.as_tensor(chosen, dtype=torch.int64)
            models[r, :len(chosen)] = state["models"][torch.as_tensor(chosen, dtype=torch.long)]
        return Plan(clients, {"models": models, "ids": ids})

    def client_update(self, plan: Plan, trainer, rnd: int, cstate: dict) -> Update:
        """(1)-(3) for each sampled client from its validation loss, then E epochs of local training."""
        S, M = plan.clients, self.hp["m"]
        theta = cstate["theta"]
        starts, raws = [], torch.zeros(len(S), M)
        for i, c in enumerate(S):
            valid = plan.payload["ids"][i] >= 0
            own = theta[i]
            if bool(valid.any()):
                dev = trainer.device
                models = plan.payload["models"][i][valid].to(own.dtype)
                x, y = validation_rows(trainer, int(c), self.hp["val_split"], self.ctx.seed)
                losses = mean_ce(trainer.f, torch.cat([own[None], models]).to(dev), x.to(dev), y.to(dev))
                dists = torch.linalg.vector_norm(models.to(torch.float64) - own.to(torch.float64), dim=1)
                raw, w = fomo_weights(float(losses[0]), losses[1:], dists)
                raws[i, :len(raw)] = raw.float()
                own = fomo_update(own, models, w)
            starts.append(own)
        t = trainer.train(TrainJob(S, torch.stack(starts)), rnd)
        return Update(S, {"params": t.params, "weights": raws}, t.n_samples, {"train_loss": t.loss},
                      client_state={"theta": t.params})

    def aggregate(self, state: dict, rnd: int, update: Update) -> dict:
        """Store each accepted client's model; P_{i,n} += w_{i,n} for the models it was sent."""
        ids, weights = update.sent["ids"], update.payload["weights"]
        for r, c in enumerate(update.clients):
            c = int(c)
            state["models"][c] = update.params[r].to(state["models"].dtype)
            state["seen"][c] = True
            valid = ids[r] >= 0
            state["affinity"][c, ids[r][valid]] += weights[r][valid].to(torch.float64)
        return {}

    # -- the wire: only the real downloaded models travel ----------------------------------------------
    def encode(self, kind: str, row: dict) -> dict:
        if kind != "plan":
            return row
        valid = row["ids"][0] >= 0
        return {"models": row["models"][:, valid], "ids": row["ids"][:, valid]}

    def decode(self, kind: str, wire: dict) -> dict:
        if kind != "plan":
            return wire
        M, P = self.hp["m"], self.ctx.spec.size
        ids, models = wire.get("ids"), wire.get("models")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] > M \
                or ids.dtype != torch.int64 or bool((ids < 0).any()):
            raise ValueError(f"ids: expected [1, k] int64 client ids, k <= {M}")
        k = ids.shape[1]
        if not isinstance(models, torch.Tensor) or tuple(models.shape) != (1, k, P):
            raise ValueError(f"models: expected shape (1, {k}, {P})")
        full_ids = torch.full((1, M), -1, dtype=torch.int64)
        full_ids[:, :k] = ids
        full = torch.zeros(1, M, P, dtype=models.dtype)
        full[:, :k] = models
        return {"models": full, "ids": full_ids}

    # -- evaluation: each client's own model -----------------------------------------------------------
    def model_for(self, state: dict, clients: np.ndarray) -> torch.Tensor:
        return state["models"][torch.as_tensor(np.asarray(clients), dtype=torch.long)]

    def eval_payload(self, state: dict, clients: np.ndarray) -> dict:
        return {}

    def inference(self, trainer, clients, payload: dict, cstate: dict) -> Inference:
        return Inference({"own": cstate["theta"]})
