"""What both engines share: local-training settings, seeded batch orders, the SGD step, metrics.

Both engines must give the same numbers for the same seed (a test checks it), so everything that
decides *what* is computed lives here; the engines only decide *how* (one client at a time, or many
at once).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from fedprism.algorithms.base import EvalResult, Plan, Update
from fedprism.federation import Federation
from fedprism.objectives import OBJECTIVES
from fedprism.params import Functional


@dataclass(frozen=True)
class LocalConfig:
    """Client-side training settings (SGD with momentum and weight decay, as torch.optim.SGD)."""

    epochs: int = 1
    batch_size: int = 32
    lr: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0
    eval_chunk: int = 500


def client_seed(seed: int, rnd: int, client: int) -> int:
    """Seed of client `client`'s shuffling stream in round `rnd` (independent of cohort and engine)."""
    return int((seed * 1_000_003 + rnd * 7_919 + client * 104_729 + 17) % (2**62))


def batch_order(n: int, epochs: int, batch_size: int, seed: int) -> list[torch.Tensor]:
    """Index batches for `epochs` passes over n samples, reshuffled each epoch; last batch kept
    (drop_last=False, specs section 1 pitfalls)."""
    g = torch.Generator().manual_seed(seed)
    out: list[torch.Tensor] = []
    for _ in range(epochs):
        perm = torch.randperm(n, generator=g)
        out.extend(perm.split(batch_size))
    return out


def sgd_step(w: torch.Tensor, g: torch.Tensor, buf: torch.Tensor, cfg: LocalConfig, mask=None) -> None:
    """In-place torch.optim.SGD step (dampening 0, nesterov off) on flat vectors (any leading dims)."""
    if cfg.weight_decay:
        g = g + cfg.weight_decay * w
    if mask is not None:
        g = g * mask
    if cfg.momentum:
        buf.mul_(cfg.momentum).add_(g)
        g = buf
    w.sub_(cfg.lr * g)


def confusion(y: torch.Tensor, pred: torch.Tensor, c: int) -> torch.Tensor:
    return torch.bincount(y * c + pred, minlength=c * c).view(c, c)


class EngineBase:
    """Holds the federation on the device and the functional model; implements the Trainer protocol."""

    name = "base"

    def __init__(self, fed: Federation, model: torch.nn.Module, cfg: LocalConfig, seed: int,
                 device: str | torch.device = "cpu"):
        self.fed = fed.to(device)
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.f = Functional(self.model)
        self.spec = self.f.spec
        self.cfg = cfg
        self.seed = seed
        self._train_idx = [torch.as_tensor(i, dtype=torch.long, device=self.device) for i in fed.train_idx]
        self._test_idx = [torch.as_tensor(i, dtype=torch.long, device=self.device) for i in fed.test_idx]
        self.samples_trained = 0

    # -- shared helpers ---------------------------------------------------------------------------
    def _orders(self, plan: Plan, rnd: int) -> list[list[torch.Tensor]]:
        epochs = self.cfg.epochs if plan.epochs is None else plan.epochs
        return [batch_order(len(self._train_idx[c]), epochs, self.cfg.batch_size, client_seed(self.seed, rnd, int(c)))
                for c in plan.clients]

    def _update(self, plan: Plan, params: torch.Tensor, extras: dict | None = None) -> Update:
        n = torch.tensor([len(self._train_idx[c]) for c in plan.clients], dtype=torch.float64)
        return Update(plan.clients, params, plan.start, n, extras or {})

    def _split(self, client: int, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        if split == "global":
            return self.fed.x_test, self.fed.y_test
        if split == "local":
            i = self._test_idx[client]
            return self.fed.x_test[i], self.fed.y_test[i]
        if split == "train":
            i = self._train_idx[client]
            return self.fed.x_train[i], self.fed.y_train[i]
        raise ValueError(f"split must be local, global or train, got {split!r}")

    def objective(self, name: str):
        try:
            return OBJECTIVES[name]
        except KeyError:
            raise ValueError(f"unknown objective {name!r}; known: {sorted(OBJECTIVES)}") from None

    @torch.inference_mode()
    def logits(self, params: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[n, B, classes] logits of n models on one shared input batch."""
        return torch.stack([self.f(p, x) for p in params])

    @torch.inference_mode()
    def evaluate_one(self, flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[int, float, torch.Tensor]:
        c = self.fed.num_classes
        correct, loss, conf = 0, 0.0, torch.zeros(c, c, dtype=torch.long, device=self.device)
        for s in range(0, len(y), self.cfg.eval_chunk):
            out = self.f(flat, x[s : s + self.cfg.eval_chunk])
            yy = y[s : s + self.cfg.eval_chunk]
            pred = out.argmax(-1)
            correct += int((pred == yy).sum())
            loss += float(F.cross_entropy(out, yy, reduction="sum"))
            conf += confusion(yy, pred, c)
        return correct, loss, conf

    def evaluate(self, params: torch.Tensor, clients: np.ndarray, split: str) -> EvalResult:
        """Model row i scored on client clients[i]'s split ('local', 'train') or on the global test set."""
        rows = [self.evaluate_one(params[k].to(self.device), *self._split(int(c), split))
                for k, c in enumerate(clients)]
        counts = [len(self._split(int(c), split)[1]) for c in clients]
        return EvalResult(
            correct=torch.tensor([r[0] for r in rows], dtype=torch.long),
            loss_sum=torch.tensor([r[1] for r in rows], dtype=torch.float64),
            count=torch.tensor(counts, dtype=torch.long),
            confusion=torch.stack([r[2].cpu() for r in rows]) if rows else
            torch.zeros(0, self.fed.num_classes, self.fed.num_classes, dtype=torch.long),
        )
