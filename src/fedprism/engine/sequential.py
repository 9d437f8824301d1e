"""The reference engine: one client at a time, one batch at a time, on pre-loaded tensors."""

from __future__ import annotations

import torch

from fedprism.algorithms.base import Plan, Update
from fedprism.engine.base import EngineBase, sgd_step


class SequentialEngine(EngineBase):
    name = "sequential"

    def train(self, plan: Plan, rnd: int) -> Update:
        obj = self.objective(plan.objective)
        mask = None if plan.train_mask is None else plan.train_mask.to(self.device)
        out = torch.empty_like(plan.start)
        losses = torch.zeros(len(plan.clients), dtype=torch.float64)
        for k, (c, order) in enumerate(zip(plan.clients, self._orders(plan, rnd))):
            idx = self._train_idx[int(c)]
            extras = {n: v[k].to(self.device) for n, v in plan.extras.items()}
            w = plan.start[k].to(self.device, copy=True)
            buf = torch.zeros_like(w)
            total = 0.0
            for b in order:
                bi = idx[b.to(self.device)]
                x, y = self.fed.x_train[bi], self.fed.y_train[bi]
                wr = w.detach().requires_grad_(True)
                loss = obj(self.f, wr, x, y, torch.ones(len(y), device=self.device), extras)
                (g,) = torch.autograd.grad(loss, wr)
                with torch.no_grad():
                    sgd_step(w, g, buf, self.cfg, mask)
                total += float(loss.detach()) * len(y)
                self.samples_trained += len(y)
            out[k] = w.to(out.device)
            losses[k] = total / max(1, sum(len(b) for b in order))
        return self._update(plan, out, {"train_loss": losses})
