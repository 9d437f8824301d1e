"""The reference engine: one client at a time, one batch at a time, on pre-loaded tensors."""

from __future__ import annotations

import torch

from fedprism.engine.base import EngineBase, optimizer_state, optimizer_step, resolve_loss
from fedprism.protocol import Trained, TrainJob


class SequentialEngine(EngineBase):
    name = "sequential"

    def train(self, job: TrainJob, rnd: int) -> Trained:
        loss_fn, cfg = resolve_loss(job.loss), self._config(job)
        mask = None if job.mask is None else job.mask.to(self.device)
        out = torch.empty_like(job.start)
        losses = torch.zeros(len(job.clients), dtype=torch.float64)
        for k, (c, (_, batches)) in enumerate(zip(job.clients, self._orders(job, rnd))):
            idx = self._train_idx[int(c)]
            extras = {n: v[k].to(self.device) for n, v in job.extras.items()}
            m = mask[k] if mask is not None and mask.dim() == 2 else mask
            w = job.start[k].to(self.device, copy=True)
            st = optimizer_state(cfg, w)
            total, count = 0.0, 0
            for b in batches():
                bi = idx[b.to(self.device)]
                x, y = self.fed.x_train[bi], self.fed.y_train[bi]
                wr = w.detach().requires_grad_(True)
                loss = loss_fn(self.f, wr, x, y, torch.ones(len(y), device=self.device), extras)
                (g,) = torch.autograd.grad(loss, wr)
                with torch.no_grad():
                    w, st = optimizer_step(w, g, st, cfg, m)
                total += float(loss.detach()) * len(y)
                count += len(y)
                self.samples_trained += len(y)
            out[k] = w.to(out.device)
            losses[k] = total / max(1, count)
        return Trained(job.clients, out, self._n_train(job.clients), losses)
