"""The vectorized engine: many clients (training) and many models (evaluation) at once.

Same numbers as `SequentialEngine` for the same seed (to float tolerance), computed differently:

* **Training** runs `vmap(grad(objective))` over a `[W, P]` matrix of flat parameter vectors, one row
  per *slot*. Clients of unequal size are packed into the W slots with longest-processing-time-first
  scheduling: `W = floor(sum steps / max steps)` up to `max_slots`, above it the fewest slots that take no
  more steps than `max_slots` would (`slots_for`), and when a slot's client finishes the slot is reloaded
  with the next client's start vector and a zeroed momentum buffer. Only the tail (slots whose queue is
  empty) is masked. Every client sees exactly the batch sequence `batch_order(...)` of the sequential
  engine; the last partial batch is padded and weighted 0/1.
* **Evaluation** scores stacked models: on the global test set all models share one input chunk
  (`vmap(f, in_dims=(0, None))`, which turns conv1 of all models into one wide conv); on per-client
  splits each row carries its own padded input chunk. Correct counts, loss sums and confusion
  matrices are computed inside the same (compiled) function. Chunks have fixed shapes (the last one
  is padded and masked) so `torch.compile(dynamic=False)` compiles few graphs.
* **compile**: `torch.compile` of the vmapped step and evaluation functions. On this project's 2-core
  CPU a cold compile costs ~20 s per training graph and ~12 s per evaluation graph (~2-4 s with a warm
  inductor cache; ~20-65 s per run in all), and eager vmap is no faster than the sequential loop, so
  `"auto"` compiles when the run is long enough to amortise that: the estimated forward FLOPs of the
  whole run (`estimate_run_flops`) reach `AUTO_COMPILE_FLOPS` (CPU, with a C++ compiler) or
  `AUTO_COMPILE_FLOPS_CUDA`. The FedPrism paper workload (LeNet-5, 100 clients, 100 rounds) is ~1e14
  and compiles on CPU and on CUDA; a 20-round MLP on digits (~2e9) does not. If compiling fails, the engine warns
  once and continues eagerly.

BatchNorm models (batch statistics, `fedprism.params`) cannot be padded without changing the
statistics: their partial training batches run unpadded outside the vmap, their global evaluation
uses the sequential engine's chunk boundaries, and their per-client evaluation uses the reference loop.

Dropout models (`fedprism.models.dropout`): every slot carries its client's dropout key for the step
(`engine.base.dropout_key`, built with the schedule), so each client trains with the masks the sequential
engine uses; masks depend on a sample's position in its batch, not on the padding.
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections import defaultdict

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad_and_value, vmap

from fedprism.engine.base import (SHARED_SPLITS, SPLITS, EngineBase, LocalConfig, dropout_keys, iter_epochs,
                                  n_batches, optimizer_state, optimizer_step, trained_mask)
from fedprism.engine.cuda_graph import GraphedStep
from fedprism.federation import Federation
from fedprism.protocol import EvalResult, Trained, TrainJob

AUTO_COMPILE_FLOPS = 2e12
"""compile="auto" on CPU: compile when the run's estimated forward FLOPs reach this (eager CPU runs
at ~20-40 GFLOP/s here, so this is >= 1 minute of work, of which compiling saves more than it costs)."""
AUTO_COMPILE_FLOPS_CUDA = 4e13
"""compile="auto" on CUDA. Measured on an H100 (bench/README.md, "GPU"): eager vmap trained the FedPrism
paper workload's round (10 clients, E=10, LeNet-5) in 1.45 s, compiled in 0.39 s, for a one-time ~36 s
(engine set-up and compilation), so compiling pays after ~35 such rounds: ~4e13 estimated FLOPs (the
100-round paper run is ~1e14)."""

_LADDER = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
"""Widths (models or rows per evaluation call) used when compiling: at most 1.5x padding, few graphs."""


def _bucket(n: int, cap: int) -> int:
    """Smallest ladder width >= n, at most `cap` (compiled graphs are per width)."""
    for b in _LADDER:
        if b >= n:
            return min(b, cap)
    return cap


def lpt_makespan(steps: list[int], slots: int) -> int:
    """Steps the slowest of `slots` LPT queues runs."""
    return max(sum(steps[j] for j in q) for q in lpt_slots(steps, slots)) if steps else 0


def parse_compile(compile: str | bool) -> str:
    """Normalise the `compile` option to 'auto', 'true' or 'false'."""
    if isinstance(compile, bool):
        return "true" if compile else "false"
    c = str(compile).strip().lower()
    if c in ("auto", "true", "false"):
        return c
    if c in ("1", "yes", "on"):
        return "true"
    if c in ("0", "no", "off"):
        return "false"
    raise ValueError(f"compile must be auto, true or false, got {compile!r}")


def lpt_slots(steps: list[int], slots: int) -> list[list[int]]:
    """Longest-processing-time-first assignment of jobs (step counts) to `slots` queues.

    Jobs are taken longest first (ties: lower index first) and appended to the least-loaded queue
    (ties: lower queue index). Returns the job indices of each queue in execution order."""
    queues: list[list[int]] = [[] for _ in range(slots)]
    load = [0] * slots
    for j in sorted(range(len(steps)), key=lambda i: (-steps[i], i)):
        s = min(range(slots), key=lambda q: (load[q], q))
        queues[s].append(j)
        load[s] += steps[j]
    return queues


def ideal_slots(steps: list[int]) -> int:
    """W = floor(sum steps / max steps), clamped to [1, number of clients]."""
    if not steps:
        return 1
    m = max(steps)
    w = sum(steps) // m if m > 0 else len(steps)
    return max(1, min(len(steps), w))


class _Blocks:
    """One slot's schedule as blocks of consecutive steps (one client's epoch each), handed out in pieces
    that fit the chunk being built: `take(limit)` gives (client, first step, rows, sizes) of at most
    `limit` steps, or None when the queue is done."""

    def __init__(self, blocks):
        self._it, self._blk, self._off = blocks, None, 0

    def take(self, limit: int):
        if self._blk is None:
            self._blk, self._off = next(self._it, None), 0
            if self._blk is None:
                return None
        k, j, rows, sizes = self._blk
        o = self._off
        c = min(len(sizes) - o, limit)
        self._off += c
        if self._off == len(sizes):
            self._blk = None
        return k, j + o, rows[o:o + c], sizes[o:o + c]


def unvmappable(model: nn.Module, train_precision: str = "float32") -> str | None:
    """Why `model` cannot run under `torch.func.vmap` (its recurrent layers: PyTorch has no batching rule
    for the fused `aten::lstm` / `gru` / `rnn` kernels; its BatchNorm layers under bf16 autocast, whose
    vmapped backward mixes bf16 and float32 and fails in torch 2.13), or None when it can. `engine=auto`
    then chooses the sequential engine; `engine=vectorized` is refused."""
    rnn = sorted({type(m).__name__ for m in model.modules() if isinstance(m, nn.RNNBase)})
    if rnn:
        return (f"the model holds {', '.join(rnn)} layers, which torch.func.vmap cannot batch (no batching "
                "rule for PyTorch's fused recurrent kernels)")
    if train_precision == "bfloat16" and _has_batchnorm(model):
        return ("train.precision=bfloat16 with BatchNorm layers: the vmapped backward of batch_norm under bf16 "
                "autocast mixes bf16 and float32 tensors and fails (the sequential engine's loop runs it)")
    return None


def _has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def _batch_stats_eval(model: nn.Module) -> bool:
    """Whether a BatchNorm layer of `model` normalises with batch statistics at evaluation (no running
    statistics, `fedprism.params`): then a sample's logits depend on the chunk it is scored in."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) and not getattr(m, "running_stats", False)
               for m in model.modules())


def profile_model(model: nn.Module, input_shape: tuple[int, ...], device: torch.device,
                  dtype: torch.dtype = torch.float32) -> tuple[int, float]:
    """(largest per-sample output of any leaf module in floats, forward FLOPs per sample).

    The first is the unit of the evaluation memory budget; the second feeds compile="auto".
    FLOPs count convolutions and linear layers (2 per multiply-add); other layers are ignored. `dtype`: the
    inputs' (int64 for token ids)."""
    sizes: list[int] = []
    flops = [0.0]

    def hook(m, inp, out):
        o = out[0] if out.dim() else out
        sizes.append(o.numel())
        if isinstance(m, nn.modules.conv._ConvNd):
            k = m.weight[0].numel()                      # in_channels / groups * prod(kernel)
            flops[0] += 2.0 * o.numel() * k
        elif isinstance(m, nn.Linear):
            flops[0] += 2.0 * m.in_features * m.out_features

    hooks = [m.register_forward_hook(hook) for m in model.modules() if not list(m.children())]
    was = model.training
    model.eval()                 # a plain call in training mode would move running statistics in place
    try:
        with torch.no_grad():
            model(torch.zeros((1, *input_shape), device=device, dtype=dtype))
    finally:
        model.train(was)
        for h in hooks:
            h.remove()
    return (max(sizes) if sizes else 1), flops[0]


def estimate_run_flops(fwd_flops: float, fed: Federation, epochs: int, rounds: int,
                       fraction: float = 0.1) -> float:
    """Forward-equivalent FLOPs of a run: every round, `fraction` of the clients train `epochs` epochs
    (x3 for the backward pass) and every client's model is scored on the global test set."""
    train = 3.0 * epochs * fraction * float(sum(len(i) for i in fed.train_idx))
    evaluate = float(fed.num_clients) * (len(fed.y_test) + float(np.mean([len(i) for i in fed.test_idx] or [0])))
    return fwd_flops * rounds * (train + evaluate)


def _bump_recompile_limit(n: int = 64) -> None:
    """Distinct shapes (slot counts, model counts, objectives) each need a graph; allow enough."""
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name) and getattr(cfg, name) < n:
            setattr(cfg, name, n)


class _MaybeCompiled:
    """`fn`, compiled with torch.compile(dynamic=False) when enabled; falls back to eager on failure."""

    _warned = False

    def __init__(self, fn, enabled: bool):
        self.fn = fn
        self.cfn = torch.compile(fn, dynamic=False) if enabled else None

    def __call__(self, *args):
        if self.cfn is not None:
            try:
                return self.cfn(*args)
            except Exception as e:  # noqa: BLE001 - any compiler failure: the eager function is exact
                if not _MaybeCompiled._warned:
                    warnings.warn(f"torch.compile failed ({type(e).__name__}: {str(e)[:200]}); "
                                  "the vectorized engine continues without compiling", RuntimeWarning,
                                  stacklevel=2)
                    _MaybeCompiled._warned = True
                self.cfn = None
        return self.fn(*args)


class VectorizedEngine(EngineBase):
    """Trains a cohort with vmapped SGD over LPT slots and evaluates stacked models in batches.

    Parameters beyond EngineBase:
      compile      "auto" | "true" | "false" | bool (see the module docstring);
      rounds       length of the run, used by compile="auto" (with the model's FLOPs and the data sizes);
      max_slots    cap on training slots (default: 16 on CPU, 256 on CUDA);
      eval_models  most models scored at once (default 10 on CPU: measured 20-35% faster than 100 models
                   x 100 samples at the same memory; 100 on CUDA);
      eval_samples samples per evaluation chunk on the shared test set (default: from eval_memory);
      eval_memory  activation budget in bytes for one evaluation chunk (default 512 MiB on CPU,
                   4 GiB on CUDA);
      fuse_jobs    run a round's independent compatible trainings as one pass
                   (`fedprism.protocol.train_together`; default: on CUDA only). A row's batch order and
                   dropout masks do not change, its arithmetic only at rounding level (the slot count
                   changes the batched kernels, as `max_slots` does), so the CPU default keeps stored runs
                   bit for bit; on this project's CPU the fused pass costs what the two it replaces
                   cost (bench/README.md, `bench/dual_cost.py`).
      cuda_graphs  replay each training step from a CUDA graph (`fedprism.engine.cuda_graph`; default: on
                   for compiled CUDA runs). The same kernels on the same inputs, so the same bits; one
                   launch per step instead of one per kernel. Needs a CUDA device.
    """

    name = "vectorized"

    def __init__(self, fed: Federation, model: nn.Module, cfg: LocalConfig, seed: int,
                 device: str | torch.device = "cpu", compile: str | bool = "auto", rounds: int = 1,
                 max_slots: int | None = None, eval_models: int | None = None, eval_samples: int | None = None,
                 eval_memory: int | None = None, fuse_jobs: bool | None = None,
                 cuda_graphs: bool | None = None):
        why = unvmappable(model, cfg.train_precision)
        if why:
            from fedprism.errors import ConfigError
            raise ConfigError("engine", "vectorized", f"auto or sequential for this model: {why}")
        super().__init__(fed, model, cfg, seed, device)
        mode = parse_compile(compile)
        cuda = self.device.type == "cuda"
        self.fuses_jobs = cuda if fuse_jobs is None else bool(fuse_jobs)
        act, self.fwd_flops = profile_model(self.model, fed.input_shape, self.device, fed.x_train.dtype)
        self.estimated_flops = estimate_run_flops(self.fwd_flops, self.fed, cfg.epochs, max(1, int(rounds)))
        if mode == "auto":
            have_cc = cuda or shutil.which(os.environ.get("CXX", "g++")) is not None or shutil.which("c++")
            need = AUTO_COMPILE_FLOPS_CUDA if cuda else AUTO_COMPILE_FLOPS
            self.compiled = bool(have_cc) and self.estimated_flops >= need
        else:
            self.compiled = mode == "true"
        if self.compiled:
            _bump_recompile_limit()
        if cuda_graphs and not cuda:
            raise ValueError(f"cuda_graphs=true needs a CUDA device; this engine runs on {self.device}")
        self.cuda_graphs = (cuda and self.compiled) if cuda_graphs is None else bool(cuda_graphs)
        self._graphs: dict[tuple, GraphedStep] = {}
        self.max_slots = int(max_slots) if max_slots else (256 if cuda else 16)
        eval_models = int(eval_models) if eval_models else (100 if cuda else 10)
        if self.max_slots < 1 or eval_models < 1:
            raise ValueError("max_slots and eval_models must be >= 1")
        self.batchnorm = _has_batchnorm(self.model)          # training: partial batches run unpadded
        #: BatchNorm on batch statistics in evaluation too: exact chunks, own splits by the reference loop
        self.eval_batch_stats = _batch_stats_eval(self.model)
        self.eval_models = int(eval_models)
        budget = eval_memory or ((4 << 30) if cuda else (512 << 20))
        if self.eval_batch_stats:
            self.eval_samples = cfg.eval_chunk           # must match the reference chunks exactly
        elif eval_samples:
            self.eval_samples = int(eval_samples)
        else:
            s = budget // (2 * 4 * act * self.eval_models)
            self.eval_samples = int(max(16, min(1000, s)))
        # own-input rows (local / train splits): short chunks, many rows
        self.own_samples = 64 if not cuda else 256
        self.own_rows = int(max(1, min(1024, budget // (2 * 4 * act * self.own_samples))))
        self._train_idx_np = [np.asarray(i, dtype=np.int64) for i in fed.train_idx]
        self.schedule_entries = 1 << 21              # batch entries of the schedule built at once
        self.step_overhead = 32.0 if cuda else 1.0   # fixed cost of a step, in units of one slot's work
        self._slot_graphs: set[int] = set()
        self._steps: dict[str, _MaybeCompiled] = {}
        self._eval_shared = _MaybeCompiled(self._eval_shared_fn, self.compiled)
        self._eval_own = _MaybeCompiled(self._eval_own_fn, self.compiled)
        self._logits = _MaybeCompiled(self._logits_fn, self.compiled)

    # -- training -------------------------------------------------------------------------------
    def _step_fn(self, loss, cfg: LocalConfig, per_client_mask: bool) -> _MaybeCompiled:
        key = (loss, cfg.optimizer, per_client_mask)
        if key not in self._steps:
            obj, f = self.objective(loss), self.f
            if f.running:
                return self._steps.setdefault(key, self._running_step_fn(obj, cfg))
            if f.dropout:
                # each slot's own dropout key (`dropout_key`): the masks of its client's step
                def loss_of(flat, x, y, wt, extras, dkey):
                    return obj(f.keyed(dkey), flat, x, y, wt, extras)

                vg = vmap(grad_and_value(loss_of))

                def step(w, st, x, y, wt, extras, active, mask, dkey):
                    g, lv = vg(w, x, y, wt, extras, dkey)
                    w, st = optimizer_step(w, g, st, cfg, mask, active.unsqueeze(1))
                    return w, st, lv
            else:
                def loss_of(flat, x, y, wt, extras):
                    return obj(f, flat, x, y, wt, extras)

                # train.kernels=fused: the fused blocks' gradients by the kernels (`fedprism.kernels.fused`)
                vg = vmap(self.stem.grad_and_value(obj) if self.stem is not None else grad_and_value(loss_of))

                def step(w, st, x, y, wt, extras, active, mask):
                    g, lv = vg(w, x, y, wt, extras)
                    w, st = optimizer_step(w, g, st, cfg, mask, active.unsqueeze(1))
                    return w, st, lv

            self._steps[key] = _MaybeCompiled(step, self.compiled)
        return self._steps[key]

    def _running_step_fn(self, obj, cfg: LocalConfig) -> _MaybeCompiled:
        """The training step of a model with running statistics: the objective in training mode
        (`Functional.with_stats`: batch statistics, recorded per slot), the optimiser on the parameters
        only (`trained_mask`), then each active slot's buffer section moved by its batch statistics
        (`Functional.apply_running`); the step's signature is the other steps'."""
        f, trainable = self.f, self.trainable

        if f.dropout:
            def loss_of(flat, x, y, wt, extras, dkey):
                return obj(f.keyed(dkey), flat, x, y, wt, extras)
        else:
            def loss_of(flat, x, y, wt, extras):
                return obj(f, flat, x, y, wt, extras)

        vg = vmap(grad_and_value(f.with_stats(loss_of), has_aux=True))

        def step(w, st, x, y, wt, extras, active, mask, *dkey):
            g, (lv, stats) = vg(w, x, y, wt, extras, *dkey)
            act = active.unsqueeze(1)
            w, st = optimizer_step(w, g, st, cfg, trained_mask(mask, trainable), act)
            return f.apply_running(w, stats, mask, act), st, lv

        return _MaybeCompiled(step, self.compiled)

    def slot_time(self, steps: list[int], k: int) -> float:
        """Estimated time of training a cohort with these step counts in k slots, in units of one slot's
        work in one step: LPT makespan x (k + step_overhead)."""
        return lpt_makespan(steps, k) * (k + self.step_overhead)

    def slots_for(self, steps: list[int]) -> int:
        """Number of vmap slots for a cohort with these step counts.

        The LPT ideal `floor(sum/max)` where it is at most max_slots. Above the cap, the fewest slots
        whose LPT makespan is the cap's: the same steps with fewer rows in each, so never slower than
        the cap whatever a step's fixed cost (20 clients of equal steps run two waves in 16 slots and
        in 10). When compiling, a slot count that already has a graph is reused if its estimated time,
        makespan x (slots + step_overhead), is within 15% of the choice's: a new graph costs ~20 s on
        CPU."""
        w = ideal_slots(steps)
        if w > self.max_slots:
            span = lpt_makespan(steps, self.max_slots)
            w = next(k for k in range(1, self.max_slots + 1) if lpt_makespan(steps, k) <= span)
        if not self.compiled or w in self._slot_graphs:
            self._slot_graphs.add(w)
            return w

        def cost(k: int) -> float:
            return self.slot_time(steps, k)

        known = sorted(self._slot_graphs)
        if known:
            best = min(known, key=cost)
            if cost(best) <= 1.15 * cost(w):
                return best
        self._slot_graphs.add(w)
        return w

    def train(self, job: TrainJob, rnd: int) -> Trained:
        dev, B, cfg = self.device, self.cfg.batch_size, self._config(job)
        n = len(job.clients)
        start = job.start.to(dev, torch.float32)
        per_client = job.mask is not None and job.mask.dim() == 2
        mask = None if job.mask is None or per_client else job.mask.to(dev, start.dtype)
        extras = {k: v.to(dev) for k, v in job.extras.items()}
        if per_client:
            extras["__mask__"] = job.mask.to(dev, start.dtype)
        for k, v in extras.items():
            if v.dim() == 0 or v.shape[0] != n:
                raise ValueError(f"TrainJob.extras[{k!r}] must have one row per client ({n}), got shape "
                                 f"{tuple(v.shape)}")
        losses = torch.zeros(n, dtype=torch.float64)
        if n == 0:
            return Trained(job.clients, job.start.clone(), self._n_train(job.clients), losses,
                           torch.zeros(0, dtype=torch.int64))
        args = self._order_args(job, rnd)
        steps = [n_batches(n, e, B) for n, e, _ in args]
        taken = torch.tensor(steps, dtype=torch.int64)   # every scheduled step runs (`Trained.steps`)
        out = start.clone()                       # clients with no steps (epochs=0) keep their start
        busy = [k for k in range(n) if steps[k] > 0]
        if not busy:
            return Trained(job.clients, out.to(job.start.device, job.start.dtype), self._n_train(job.clients), losses,
                           taken)
        W = self.slots_for([steps[k] for k in busy])
        queues = [[busy[j] for j in q] for q in lpt_slots([steps[k] for k in busy], W)]
        T = max(sum(steps[k] for k in q) for q in queues)
        counts = torch.zeros(n, dtype=torch.float64)
        drop = ([self._dropout_seed(rnd, int(c), job.stream_of(k)) for k, c in enumerate(job.clients)]
                if self.f.dropout else None)

        def epochs_of(q: list[int]):
            """(client, first step, rows [batches, B], batch sizes) of a slot's queue, an epoch at a time."""
            for k in q:
                gidx = self._train_idx_np[int(job.clients[k])]
                n, e, seed = args[k]
                nb = n_batches(n, 1, B)                   # n = 0: one empty batch per epoch, as split() gives
                sizes = np.full(nb, B, dtype=np.int64)
                sizes[-1] = n - (nb - 1) * B
                for ep, perm in enumerate(iter_epochs(n, e, seed)):
                    rows = np.zeros(nb * B, dtype=np.int64)
                    rows[:n] = gidx[perm.numpy()]
                    yield k, ep * nb, rows.reshape(nb, B), sizes

        slots = [_Blocks(epochs_of(q)) for q in queues]
        step = self._step_fn(job.loss, cfg, per_client)
        w = torch.zeros(W, start.shape[1], device=dev, dtype=start.dtype)
        st = optimizer_state(cfg, w)
        ex = {k: torch.zeros((W, *v.shape[1:]), device=dev, dtype=v.dtype) for k, v in extras.items()}
        gs = self._graphed(step, w, st, ex, mask, per_client, drop is not None) if self.cuda_graphs \
            else None
        if gs is not None:                        # the graph's own tensors stand in for w, st, ex, mask
            gs.reset()
            w, st, ex = gs.w, gs.st, gs.ex
            if mask is not None:
                gs.m.copy_(mask)
        xtr, ytr = self.fed.x_train, self.fed.y_train
        # the schedule is built on the CPU a chunk of steps at a time (about 2M batch entries), so
        # memory does not grow with the number of epochs; each chunk is moved once
        chunk = max(1, min(T, self.schedule_entries // max(1, W * B)))
        for t0 in range(0, T, chunk):
            L = min(chunk, T - t0)
            idx = np.zeros((L, W, B), dtype=np.int64)
            wt = np.zeros((L, W, B), dtype=np.float32)
            owner = np.full((L, W), -1, dtype=np.int64)
            bsz = np.zeros((L, W), dtype=np.float64)
            dkeys = np.zeros((L, W, 3), dtype=np.int64) if drop is not None else None
            starts: dict[int, list[tuple[int, int]]] = defaultdict(list)
            ends: dict[int, list[tuple[int, int]]] = defaultdict(list)
            partial: dict[int, list[tuple[int, int, torch.Tensor]]] = defaultdict(list)
            for s, blocks in enumerate(slots):       # a block of steps at a time: no per-step Python
                t = 0
                while t < L and (blk := blocks.take(L - t)) is not None:
                    k, j, rows, sz = blk
                    c = len(sz)
                    idx[t:t + c, s] = rows
                    wt[t:t + c, s] = np.arange(B) < sz[:, None]
                    owner[t:t + c, s] = k
                    bsz[t:t + c, s] = sz
                    counts[k] += float(sz.sum())
                    if dkeys is not None:
                        dkeys[t:t + c, s] = dropout_keys(drop[k], j, c)
                    if j == 0:
                        starts[t].append((s, k))
                    if j + c == steps[k]:
                        ends[t + c - 1].append((s, k))
                    if self.batchnorm:                     # partial batches run unpadded, outside the vmap
                        for i in np.flatnonzero(sz < B):
                            partial[t + i].append((s, k, torch.from_numpy(rows[i, :sz[i]].copy())))
                            idx[t + i, s], wt[t + i, s] = 0, 0.0
                    t += c
            idx, wt, owner, bsz = (torch.from_numpy(a) for a in (idx, wt, owner, bsz))
            active = owner >= 0
            for t, lst in partial.items():
                for s, _, _ in lst:
                    active[t, s] = False
            idx, wt, active = idx.to(dev), wt.to(dev), active.to(dev)
            if dkeys is not None:
                dkeys = torch.from_numpy(dkeys).to(dev)
            lvals = torch.zeros(L, W, device=dev, dtype=torch.float64)
            for t in range(L):
                for s, k in starts.get(t, ()):
                    w[s] = start[k]
                    for z in st:
                        z[s] = 0
                    for name, v in extras.items():
                        ex[name][s] = v[k]
                if gs is not None:
                    gs.set(idx[t], wt[t], active[t], None if dkeys is None else dkeys[t])
                    gs.replay()
                    lvals[t] = gs.lv
                else:
                    it = idx[t]
                    m = ex.pop("__mask__") if per_client else mask
                    if dkeys is None:
                        w, st, lv = step(w, st, xtr[it], ytr[it], wt[t], ex, active[t], m)
                    else:
                        w, st, lv = step(w, st, xtr[it], ytr[it], wt[t], ex, active[t], m, dkeys[t])
                    if per_client:
                        ex["__mask__"] = m
                    lvals[t] = lv
                for s, k, bi in partial.get(t, ()):
                    lvals[t, s] = self._single_step(job.loss, cfg, w, st, s, k, bi.to(dev), extras,
                                                    ex["__mask__"][s] if per_client else mask,
                                                    None if dkeys is None else dkeys[t, s])
                for s, k in ends.get(t, ()):
                    out[k] = w[s]
            # per-client mean loss, weighted by batch sizes (as the sequential engine), summed in step order
            lv_cpu = lvals.cpu() * bsz
            sel = owner >= 0
            losses.index_add_(0, owner[sel], lv_cpu[sel])
        losses /= counts.clamp(min=1)
        self.samples_trained += int(counts.sum())
        return Trained(job.clients, out.to(job.start.device, job.start.dtype), self._n_train(job.clients), losses,
                       taken)

    def _graphed(self, step, w, st, ex, mask, per_client: bool, dropout: bool) -> GraphedStep | None:
        """The recorded step for these shapes (recorded on first use), or None when recording fails (the
        engine then warns once and trains without graphs)."""
        key = (id(step), tuple(w.shape), self.cfg.batch_size, per_client, mask is None, dropout,
               tuple((k, tuple(v.shape), v.dtype) for k, v in ex.items()),
               self.fed.x_train.data_ptr(), self.fed.y_train.data_ptr())     # the graph gathers from these
        if key not in self._graphs:
            try:
                self._graphs[key] = GraphedStep(step, w.shape[0], self.cfg.batch_size, w.shape[1], st, ex,
                                                mask, per_client, dropout, self.fed.x_train,
                                                self.fed.y_train).record()
            except Exception as e:  # noqa: BLE001 - any recording failure: the unrecorded step is exact
                warnings.warn(f"recording the training step as a CUDA graph failed ({type(e).__name__}: "
                              f"{str(e)[:200]}); the engine continues without CUDA graphs",
                              RuntimeWarning, stacklevel=3)
                self.cuda_graphs = False
                return None
        return self._graphs[key]

    def _single_step(self, loss, cfg, w, st, s, k, bi, extras, mask, dkey=None) -> torch.Tensor:
        """One unpadded step of slot s (BatchNorm models' partial batches), in place; `dkey` its dropout key."""
        obj = self.objective(loss)
        ex = {n: v[k] for n, v in extras.items() if n != "__mask__"}
        x, y = self.fed.x_train[bi], self.fed.y_train[bi]
        ones = torch.ones(len(y), device=self.device)
        f = self.f.keyed(dkey)
        g, (lv, stats) = grad_and_value(self.f.with_stats(lambda p: obj(f, p, x, y, ones, ex)),
                                        has_aux=True)(w[s].clone())
        ws, sts = optimizer_step(w[s].clone(), g, tuple(z[s].clone() for z in st), cfg,
                                 trained_mask(mask, self.trainable))
        w[s] = self.f.apply_running(ws, stats, mask)
        for z, v in zip(st, sts):
            z[s] = v
        return lv.detach().double()

    # -- evaluation -----------------------------------------------------------------------------
    def _metrics(self, out, y, valid):
        c = self.num_classes
        pred = out.argmax(-1)
        correct = ((pred == y).to(out.dtype) * valid).sum(-1)
        ce = F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="none").view_as(valid)
        loss = (ce * valid).sum(-1)
        conf = torch.einsum("msc,msd->mcd", F.one_hot(y, c).to(out.dtype) * valid.unsqueeze(-1),
                            F.one_hot(pred, c).to(out.dtype))
        return correct, loss, conf

    def _eval_shared_fn(self, params, x, y, valid):
        out = self._logits_fn(params, x)
        m = params.shape[0]
        return self._metrics(out, y.expand(m, -1), valid.expand(m, -1))

    def _eval_own_fn(self, params, x, y, valid):
        return self._metrics(self._at_eval_precision(vmap(self.f), params, x), y, valid)

    def _logits_fn(self, params, x):
        """[n, B, classes] float32 logits of n models on one shared batch, at the evaluation precision."""
        return self._at_eval_precision(vmap(self.f, in_dims=(0, None)), params, x)

    def _empty_result(self, n: int) -> EvalResult:
        return EvalResult.empty(n, self.num_classes)

    @torch.no_grad()
    def evaluate(self, params: torch.Tensor, clients: np.ndarray, split: str) -> EvalResult:
        """Model row i scored on client clients[i]'s split ('local', 'train') or on the global test set."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        clients = np.asarray(clients)
        n = len(clients)
        if params.dim() != 2 or params.shape[0] != n:
            raise ValueError(f"params must be [len(clients), P] = [{n}, P], got {tuple(params.shape)}")
        if n == 0:
            return self._empty_result(0)
        params = params.to(self.device, torch.float32)
        if split in SHARED_SPLITS:
            return self._evaluate_shared(params, *self.data(0, split))
        if self.eval_batch_stats:
            return super().evaluate(params, clients, split)
        if split == "val" and self.fed.val_idx is None:
            raise ValueError("this federation has no validation splits (data.val_fraction=0)")
        idx = {"local": self.fed.test_idx, "train": self.fed.train_idx, "val": self.fed.val_idx}[split]
        x_all, y_all = self.fed.local_xy() if split == "local" else (self.fed.x_train, self.fed.y_train)
        return self._evaluate_own(params, [np.asarray(idx[int(c)], dtype=np.int64) for c in clients], x_all, y_all)

    def _evaluate_shared(self, params, x, y) -> EvalResult:
        n, dev, c = params.shape[0], self.device, self.num_classes
        N = len(y)
        M = _bucket(n, self.eval_models) if self.compiled else min(n, self.eval_models)
        S = self.eval_samples
        correct = torch.zeros(n, device=dev, dtype=torch.float64)
        loss = torch.zeros(n, device=dev, dtype=torch.float64)
        conf = torch.zeros(n, c, c, device=dev, dtype=torch.float64)
        for g0 in range(0, n, M):
            m = min(M, n - g0)
            p = params[g0 : g0 + m]
            if m < M:   # pad the last model group: one graph per width
                p = torch.cat([p, p[:1].expand(M - m, -1)])
            for s0 in range(0, N, S):
                xs, ys = x[s0 : s0 + S], y[s0 : s0 + S]
                k = len(ys)
                valid = torch.ones(k, device=dev)
                if k < S and not self.eval_batch_stats:   # pad the last sample chunk (masked)
                    xs = torch.cat([xs, xs[:1].expand(S - k, *xs.shape[1:])])
                    ys = torch.cat([ys, ys[:1].expand(S - k)])
                    valid = torch.cat([valid, torch.zeros(S - k, device=dev)])
                cr, ls, cf = self._eval_shared(p, xs, ys, valid)
                correct[g0 : g0 + m] += cr[:m]
                loss[g0 : g0 + m] += ls[:m]
                conf[g0 : g0 + m] += cf[:m]
        return EvalResult(correct.round().long().cpu(), loss.cpu(), torch.full((n,), N, dtype=torch.long),
                          conf.round().long().cpu())

    def _evaluate_own(self, params, idx_list: list[np.ndarray], x_all, y_all) -> EvalResult:
        """Each model on its own samples: rows of (model, <= S sample indices), padded and masked."""
        n, dev, c = params.shape[0], self.device, self.num_classes
        S, R = self.own_samples, self.own_rows
        row_model, row_idx, row_len = [], [], []
        for i, ix in enumerate(idx_list):
            ix = torch.from_numpy(ix)
            for s0 in range(0, len(ix), S):
                row_model.append(i)
                row_idx.append(ix[s0 : s0 + S])
                row_len.append(min(S, len(ix) - s0))
        counts = torch.tensor([len(ix) for ix in idx_list], dtype=torch.long)
        correct = torch.zeros(n, device=dev, dtype=torch.float64)
        loss = torch.zeros(n, device=dev, dtype=torch.float64)
        conf = torch.zeros(n, c, c, device=dev, dtype=torch.float64)
        nr = len(row_model)
        if nr:
            R = _bucket(nr, R) if self.compiled else min(R, nr)
            total = -(-nr // R) * R
            rm = torch.zeros(total, dtype=torch.long)
            rm[:nr] = torch.tensor(row_model)
            ri = torch.zeros(total, S, dtype=torch.long)
            rv = torch.zeros(total, S)
            for r, (ix, m) in enumerate(zip(row_idx, row_len)):
                ri[r, :m] = ix
                rv[r, :m] = 1.0
            rm, ri, rv = rm.to(dev), ri.to(dev), rv.to(dev)
            for r0 in range(0, total, R):
                mm, ii = rm[r0 : r0 + R], ri[r0 : r0 + R]
                cr, ls, cf = self._eval_own(params[mm], x_all[ii], y_all[ii], rv[r0 : r0 + R])
                correct.index_add_(0, mm, cr.double())
                loss.index_add_(0, mm, ls.double())
                conf.index_add_(0, mm, cf.double())
        return EvalResult(correct.round().long().cpu(), loss.cpu(), counts, conf.round().long().cpu())

    @torch.no_grad()
    def logits(self, params: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[n, B, classes] logits of n models on one shared input batch (groups of `eval_models`).

        Compiled like the evaluation when the engine is and the batch has the shared-chunk size
        `eval_samples` (other sizes, e.g. clients' own test splits, run eager: no graph per size); the
        last group is padded to the full width so that one graph serves every call.
        """
        params = params.to(self.device, torch.float32)
        x = x.to(self.device)
        n, M = params.shape[0], self.eval_models
        if n == 0:
            return torch.zeros(0, len(x), self.num_classes, device=self.device)
        compiled = self.compiled and len(x) == self.eval_samples
        out = []
        for g0 in range(0, n, M):
            p = params[g0 : g0 + M]
            m = len(p)
            if compiled and m < M:
                p = torch.cat([p, p[:1].expand(M - m, -1)])
            out.append(self._logits(p, x)[:m] if compiled else self._logits.fn(p, x))
        return torch.cat(out)

    @torch.no_grad()
    def logits_own(self, params: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[n, B, classes] logits of model i on its own batch x[i] (x: [n, B, ...]), eager, in groups of
        `eval_models` (the shapes vary with the clients' split sizes: no graph per shape)."""
        return self._own(vmap(self.f), params, x)

    @torch.no_grad()
    def features_own(self, params: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[n, B, d] penultimate features of model i on its own batch x[i]."""
        return self._own(vmap(self.f.features), params, x, cast=False)

    def _own(self, fn, params: torch.Tensor, x: torch.Tensor, cast: bool = True) -> torch.Tensor:
        """`fn` (vmapped over model and input) on n >= 1 models in groups of `eval_models`."""
        params, x = params.to(self.device, torch.float32), x.to(self.device)
        M = self.eval_models
        run = (lambda p, xs: self._at_eval_precision(fn, p, xs)) if cast else fn
        return torch.cat([run(params[g:g + M], x[g:g + M]) for g in range(0, len(params), M)])


__all__ = ["VectorizedEngine", "unvmappable", "lpt_slots", "ideal_slots", "lpt_makespan", "parse_compile", "profile_model",
           "estimate_run_flops", "AUTO_COMPILE_FLOPS", "AUTO_COMPILE_FLOPS_CUDA"]
