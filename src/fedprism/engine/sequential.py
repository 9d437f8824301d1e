"""The reference engine: one client at a time, one batch at a time, on pre-loaded tensors."""

from __future__ import annotations

import torch

from fedprism.engine.base import EngineBase
from fedprism.protocol import Trained, TrainJob


class SequentialEngine(EngineBase):
    name = "sequential"

    def train(self, job: TrainJob, rnd: int) -> Trained:
        loss_fn, cfg = self.objective(job.loss), self._config(job)
        mask = None if job.mask is None else job.mask.to(self.device)
        out = torch.empty_like(job.start)
        losses = torch.zeros(len(job.clients), dtype=torch.float64)
        steps = torch.zeros(len(job.clients), dtype=torch.int64)
        dp = getattr(self, "local_dp", None)         # dp.local=dpsgd (fedprism.local_dp): Opacus' DP-SGD steps
        if dp is not None:
            dp.check_job(job)
        for k, (c, (_, batches)) in enumerate(zip(job.clients, self._orders(job, rnd))):
            idx = self._train_idx[int(c)]
            extras = {n: v[k].to(self.device) for n, v in job.extras.items()}
            if dp is not None:
                w, losses[k], steps[k] = dp.train(
                    self, job.start[k].to(self.device, copy=True), idx, self.cfg.epochs if job.epochs is None
                    else job.epochs, job.loss, extras, cfg, int(c), rnd, job.stream_of(k),
                    self._dropout_seed(rnd, int(c), job.stream_of(k)))
                out[k] = w.to(out.device)
                continue
            m = mask[k] if mask is not None and mask.dim() == 2 else mask
            taken = _Counted(batches())                   # the steps this client takes (`Trained.steps`)
            w, losses[k] = self._local_sgd(job.start[k].to(self.device, copy=True), idx, taken, loss_fn, cfg, m,
                                           extras, self._dropout_seed(rnd, int(c), job.stream_of(k)))
            out[k] = w.to(out.device)
            steps[k] = taken.count
        return Trained(job.clients, out, self._n_train(job.clients), losses, steps)


class _Counted:
    """An iterator of batches that counts what it gave: one local step per batch."""

    def __init__(self, it):
        self._it, self.count = iter(it), 0

    def __iter__(self):
        return self

    def __next__(self):
        b = next(self._it)
        self.count += 1
        return b
