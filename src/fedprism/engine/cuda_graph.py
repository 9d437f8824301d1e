"""The vectorized training step replayed from a CUDA graph (`cuda_graphs`, on by default for compiled
CUDA runs).

On a GPU a compiled step of the paper workload (10 LeNet-5 models, batch 32) is about 0.8 GFLOP, which
the card does in tens of microseconds, but it took about 2 ms (`bench/README.md`, "GPU"): the time went to
the host, launching the step's kernels one by one, gathering the batch and copying the loss. A CUDA graph
(Nvidia's "CUDA Graphs"; `torch.cuda.CUDAGraph`) records those kernels once and replays them with one
launch. Everything a step reads or writes must then live at fixed addresses, so a `GraphedStep` owns the
step's tensors: the stacked parameters `w` and optimiser state `st` (the engine writes a client's start
into its slot and reads its result from it, as before), the step's batch indices `it` (the gather of the
batch from the device-resident training set is inside the graph), batch weights `wt`, active slots `act`,
extras `ex`, mask `m`, dropout keys `dk`, and the per-slot loss `lv` it writes.

The graph replays the very kernels of the compiled step it recorded, on the same inputs, so a replayed
round equals the unrecorded one bit for bit (`tests/test_engine_equivalence.py` on a CUDA machine,
`bench/cuda_graphs.py`). Recording needs two warm-up calls first (compilation, library autotuning) on a
side stream; if recording fails the engine warns once and trains without graphs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class GraphedStep:
    """One recorded step: `set(t, ...)` stages step t's inputs, `replay()` runs it, results in `w`, `st`,
    `lv`. Built by `record`; `step` is the engine's (compiled) step function."""

    def __init__(self, step: Callable, W: int, B: int, P: int, st_like: tuple[torch.Tensor, ...],
                 ex_like: dict[str, torch.Tensor], mask_like: torch.Tensor | None, per_client: bool,
                 dropout: bool, x_train: torch.Tensor, y_train: torch.Tensor):
        dev = x_train.device
        self.step, self.per_client, self.dropout = step, per_client, dropout
        self.xtr, self.ytr = x_train, y_train
        self.w = torch.zeros(W, P, device=dev)
        self.st = tuple(torch.zeros((W, *z.shape[1:]), device=dev, dtype=z.dtype) for z in st_like)
        self.ex = {k: torch.zeros((W, *v.shape[1:]), device=dev, dtype=v.dtype) for k, v in ex_like.items()}
        self.m = None if mask_like is None else torch.zeros_like(mask_like, device=dev)
        self.it = torch.zeros(W, B, dtype=torch.long, device=dev)
        self.wt = torch.zeros(W, B, device=dev)
        self.act = torch.zeros(W, dtype=torch.bool, device=dev)
        self.dk = torch.zeros(W, 3, dtype=torch.long, device=dev) if dropout else None
        self.lv = torch.zeros(W, device=dev)
        self.graph: torch.cuda.CUDAGraph | None = None

    def _call(self):
        ex = dict(self.ex)
        m = ex.pop("__mask__") if self.per_client else self.m
        args = [self.w, self.st, self.xtr[self.it], self.ytr[self.it], self.wt, ex, self.act, m]
        if self.dropout:
            args.append(self.dk)
        return self.step(*args)

    def record(self) -> GraphedStep:
        """Warm up twice on a side stream (compiles; results discarded), then record one step whose
        results are copied into the step's own `w`, `st` and `lv`."""
        side = torch.cuda.Stream(device=self.w.device)
        side.wait_stream(torch.cuda.current_stream(self.w.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._call()
        torch.cuda.current_stream(self.w.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._run()
        self.graph = graph
        return self

    def _run(self) -> None:
        """One step, its results copied into the step's own tensors (what the graph records)."""
        w, st, lv = self._call()
        self.w.copy_(w)
        for z, new in zip(self.st, st):
            z.copy_(new)
        self.lv.copy_(lv)

    def reset(self) -> None:
        """Zero the parameters and state (a fresh job starts as an unrecorded one does)."""
        self.w.zero_()
        for z in self.st:
            z.zero_()

    def set(self, it: torch.Tensor, wt: torch.Tensor, act: torch.Tensor, dk: torch.Tensor | None) -> None:
        self.it.copy_(it, non_blocking=True)
        self.wt.copy_(wt, non_blocking=True)
        self.act.copy_(act, non_blocking=True)
        if self.dk is not None:
            self.dk.copy_(dk, non_blocking=True)

    def replay(self) -> None:
        """Run the recorded step (unrecorded, the same step runs directly: the tests' CPU stand-in)."""
        if self.graph is None:
            self._run()
        else:
            self.graph.replay()


__all__ = ["GraphedStep"]
