"""Byzantine clients, for studying the robust aggregation rules (`attack.*`): a seeded share of the clients
uploads a crafted model in place of the one it trained (model poisoning).

With s_k the model client k was sent and y_k the model it trained, a Byzantine client uploads

    sign_flip   x_k = s_k - lambda (y_k - s_k)     its update reversed and scaled by lambda (`attack.scale`);
                                                   the sign-flipping attack of Li, Xu, Chen, Giannakis, Ling
                                                   2019, "RSA: Byzantine-Robust Stochastic Aggregation
                                                   Methods for Distributed Learning from Heterogeneous
                                                   Datasets", AAAI 2019, arXiv:1811.03761
    gaussian    x_k = s_k + lambda e,  e ~ N(0, I)  an upload unrelated to its data, the Gaussian Byzantine
                                                   workers of Blanchard, El Mhamdi, Guerraoui, Stainer 2017,
                                                   "Machine Learning with Adversaries: Byzantine Tolerant
                                                   Gradient Descent", NeurIPS 2017

Decisions where those papers are silent (they attack gradients of one shared model; here the uploads are
client models):

* Who: floor(`attack.fraction` x N) of the N clients, drawn once from a stream seeded by the run seed only
  (`byzantine_clients`), so every method of a comparison faces the same clients; they are sampled as any
  other client (a round's cohort holds a varying number of them) and train as any other, only their upload
  is replaced. The draw is independent of `data.unseen_clients`' (a held-out client never uploads).
* What: every floating-point upload tensor that has a row of the same name and shape in what the client
  was sent (the model, `params` or `shared`: `poisoned_names`); other tensors (SCAFFOLD's delta_c,
  q-FFL's loss, FedNova's step count, the sample count) are sent as computed; a prototype method's global
  prototypes, sent and returned with the same shape, are crafted the same way. A method whose upload holds
  no such tensor (IFCA's one model of K, FedSoft, FedEM) is refused before training (`check_attack`).
* The crafted rows are finite, so they pass the update checks like a real adversary's (the runner rejects
  only malformed or non-finite rows); under `compress` they are encoded like any upload, under DP-FedAvg
  clipped like any update.
* e is drawn per (seed, round, client) (`stream_seed`, stream "attack"): a run is reproducible and a
  resumed one identical.
* In-process runs only: on Flower the Byzantine clients are the deployment's own nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedprism.protocol import Rows, Update
from fedprism.seeds import stream_seed

KINDS = ("sign_flip", "gaussian")


def byzantine_clients(seed: int, num_clients: int, fraction: float) -> np.ndarray:
    """The floor(fraction x N) Byzantine clients, sorted; drawn without replacement from a stream seeded by
    the run seed only; empty at fraction 0."""
    k = int(np.floor(fraction * num_clients + 1e-9)) if fraction > 0 else 0
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    rng = np.random.default_rng([seed, 0xB1A5])
    return np.sort(rng.choice(num_clients, size=k, replace=False)).astype(np.int64)


def poisoned_names(payload: Rows, sent: Rows) -> list[str]:
    """The upload tensors a Byzantine client crafts: floating point, with a sent row of the same name and
    shape (the model it was sent and trained)."""
    return sorted(k for k, v in payload.items() if isinstance(v, torch.Tensor) and v.is_floating_point()
                  and isinstance(sent.get(k), torch.Tensor) and tuple(sent[k].shape) == tuple(v.shape))


def check_attack(algo, state: dict, fraction: float) -> None:
    """`attack.fraction` > 0: refuse, before training, a method whose upload holds no tensor a Byzantine
    client would craft (`poisoned_names` of its declared upload against one client's round-0 plan, built
    from a copy of the initial server state)."""
    import copy

    from fedprism.errors import ConfigError

    c = np.zeros(1, dtype=np.int64)
    plan = algo.plan(copy.deepcopy(state), 0, c)
    upload = algo.upload()
    sent = plan.payload
    if not any(s.dtype.is_floating_point and isinstance(sent.get(k), torch.Tensor)
               and tuple(sent[k].shape[1:]) == tuple(s.resolve(algo.ctx).shape) for k, s in upload.items()):
        raise ConfigError("attack.fraction", fraction, f"0 for method={algo.name}: its upload "
                          f"({', '.join(sorted(upload))}) holds no model measured against one the client was "
                          "sent (a tensor of the same name and shape in its plan), so a Byzantine client has "
                          "nothing to craft")


def craft(kind: str, scale: float, sent: torch.Tensor, trained: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One Byzantine upload from the row it was sent and the row it trained (the module's equations)."""
    s = sent.to(trained.dtype)
    if kind == "sign_flip":
        return s - scale * (trained - s)
    if kind == "gaussian":
        return s + scale * torch.randn(trained.shape, generator=gen, dtype=torch.float64).to(trained.dtype)
    raise ValueError(f"attack.kind={kind!r}: one of {', '.join(KINDS)}")


@dataclass(frozen=True)
class Attack:
    """The run's Byzantine clients (`attack.fraction` > 0) and what they send."""

    clients: np.ndarray          # sorted ids
    kind: str
    scale: float
    seed: int

    @classmethod
    def of(cls, cfg, num_clients: int) -> "Attack | None":
        fraction = float(cfg.get("attack.fraction", 0.0) or 0.0)
        if fraction <= 0:
            return None
        return cls(byzantine_clients(cfg["seed"], num_clients, fraction), cfg["attack.kind"],
                   float(cfg["attack.scale"]), int(cfg["seed"]))

    def poison(self, up: Update, sent: Rows, rnd: int) -> Update:
        """`up` with the Byzantine clients' rows of every model-shaped upload tensor replaced; `sent`: the
        plan rows of `up.clients`, in their order."""
        bad = np.flatnonzero(np.isin(up.clients, self.clients))
        if len(bad) == 0:
            return up
        names = poisoned_names(up.payload, sent)      # (check_attack refused a method without any)
        payload = dict(up.payload)
        for name in names:
            rows = payload[name].clone()
            for i in bad:
                gen = torch.Generator().manual_seed(stream_seed(self.seed, rnd, int(up.clients[i]), f"attack:{name}"))
                rows[i] = craft(self.kind, self.scale, sent[name][i], rows[i], gen)
            payload[name] = rows
        return Update(up.clients, payload, up.n_samples, up.metrics, up.client_state, up.sent, dict(up.rejected))
