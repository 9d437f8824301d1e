"""What both engines share: local-training settings, named random streams, the optimiser steps, metrics.

Both engines must give the same numbers for the same seed (tests check it), so everything that
decides *what* is computed lives here; the engines only decide *how* (one client at a time, or many
at once). The engines implement the `fedprism.protocol.Trainer` protocol and import nothing of
`fedprism.algorithms`.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.optim.adam import adam as _torch_adam

from fedprism._alloc import tune_allocator
from fedprism.federation import Federation
from fedprism.machine import cpu_flags
from fedprism.models.pooling import for_inference
from fedprism.objectives import OBJECTIVES
from fedprism.params import Functional
from fedprism.protocol import EvalResult, Loss, Trained, TrainJob
from fedprism.seeds import LEGACY_STREAMS, client_seed, dropout_seed, stream_seed  # noqa: F401 (engine API)

OPTIMIZERS = ("sgd", "adam")
#: evaluation splits: a client's own rows ('local' test, 'train', 'val') or a shared set ('global' test,
#: 'global_val' validation)
SPLITS = ("local", "global", "train", "val", "global_val")
SHARED_SPLITS = ("global", "global_val")


def native_bf16() -> bool | None:
    """Whether this x86 CPU computes bf16 natively (the avx512_bf16 or amx_bf16 flag); None where that is
    not known (another architecture, no /proc/cpuinfo)."""
    import platform

    flags = cpu_flags()
    if platform.machine().lower() not in ("x86_64", "amd64") or flags is None:
        return None
    return bool({"avx512_bf16", "amx_bf16"} & set(flags))


@dataclass(frozen=True)
class LocalConfig:
    """Client-side training settings: SGD with momentum and weight decay (as torch.optim.SGD, dampening 0,
    no Nesterov) or Adam (as torch.optim.Adam: L2 weight decay added to the gradient, no amsgrad)."""

    epochs: int = 1
    batch_size: int = 32
    lr: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0
    eval_chunk: int = 500
    optimizer: str = "sgd"
    #: precision of evaluation forward passes: float32, or bfloat16 (weights and inputs cast, logits
    #: returned as float32; faster where the CPU has native bf16, e.g. AVX512-BF16). Training:
    #: `train_precision`.
    eval_precision: str = "float32"
    #: precision of local training's forward and backward passes: float32, or bfloat16 (mixed precision:
    #: the objective runs under `torch.autocast(device, dtype=torch.bfloat16)`, so convolutions and matrix
    #: products compute in bf16 while parameters, gradients, optimiser state and every vector the server sees
    #: stay float32; `autocast_objective`)
    train_precision: str = "float32"
    #: kernels of evaluation forward passes: "aten" (PyTorch's) or "fused" (each conv -> ReLU -> 2x2
    #: max-pooling block of the model in one CPU kernel, `fedprism.kernels.fused`; logits change at float32
    #: rounding). Training: `train_kernels`.
    eval_kernels: str = "aten"
    #: kernels of local training: "aten", or "fused" (the model's first two such blocks through the fused
    #: kernels' training forwards and backwards, `fedprism.kernels.fused.StemSplit`; the numbers change at
    #: float32 rounding, so the key is part of a run's identity)
    train_kernels: str = "aten"
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8


def _seed_words(seed: int) -> tuple[int, int]:
    """The first two words of a dropout key: (seed mod 2^32, seed div 2^32)."""
    return seed & 0xFFFFFFFF, seed >> 32


def dropout_key(seed: int, step: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The dropout key of local step `step` (0, 1, ... over all epochs) of the job seeded `seed`
    (`dropout_seed`): int64 [3] = (seed mod 2^32, seed div 2^32, step)."""
    return torch.tensor([*_seed_words(seed), step], dtype=torch.int64, device=device)


def dropout_keys(seed: int, first: int, count: int) -> np.ndarray:
    """`dropout_key` of steps first, ..., first + count - 1 at once, as an int64 [count, 3] array (the
    vectorized engine's schedule)."""
    out = np.empty((count, 3), dtype=np.int64)
    out[:, :2] = _seed_words(seed)
    out[:, 2] = np.arange(first, first + count)
    return out


def deterministic_cudnn() -> None:
    """Make cuDNN pick deterministic algorithms, process-wide (every engine on a CUDA device calls it).

    By default cuDNN may choose convolution backward algorithms that accumulate with atomics, whose
    order, and so whose rounding, changes from call to call. Measured on an H200 (torch 2.11): two
    engines training the same job of the Clust-PSI-PFL CIFAR CNN (3x3 convolutions, 32-128 channels)
    ended up to 0.5 apart in a parameter after one epoch of SGD, while LeNet-5's convolutions repeated
    exactly; with deterministic algorithms both repeat bit for bit, with and without CUDA graphs
    (`tests/test_engine_equivalence.py::test_cuda_graphs_give_the_same_bits`). A run that does not repeat
    cannot resume exactly, so the engines trade whatever speed the faster algorithms had for that."""
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def iter_epochs(n: int, epochs: int, seed: int) -> Iterator[torch.Tensor]:
    """One permutation of range(n) per epoch, drawn lazily from one generator seeded `seed`; epoch e's
    batches are its consecutive `batch_size` pieces (`iter_batches`)."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        yield torch.randperm(n, generator=g)


def iter_batches(n: int, epochs: int, batch_size: int, seed: int) -> Iterator[torch.Tensor]:
    """Index batches for `epochs` passes over n samples, reshuffled each epoch; last batch kept
    (drop_last=False). Lazy: one epoch's permutation at a time, so memory does not grow with epochs;
    the generator is drawn in the same order as an eager list, so the batches are the same."""
    for perm in iter_epochs(n, epochs, seed):
        yield from perm.split(batch_size)


def n_batches(n: int, epochs: int, batch_size: int) -> int:
    """len(list(iter_batches(n, epochs, batch_size, seed))) without drawing anything."""
    return epochs * max(1, -(-n // batch_size))      # n = 0: one empty batch per epoch, as split() gives


def batch_order(n: int, epochs: int, batch_size: int, seed: int) -> list[torch.Tensor]:
    """The batches of `iter_batches` as a list (tests and small tools; the engines iterate lazily)."""
    return list(iter_batches(n, epochs, batch_size, seed))


def optimizer_state(cfg: LocalConfig, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Fresh optimiser state for parameters shaped like `w`: SGD (buf,), Adam (m, v, steps)."""
    if cfg.optimizer == "adam":
        return torch.zeros_like(w), torch.zeros_like(w), torch.zeros(w.shape[:-1] + (1,), dtype=w.dtype,
                                                                      device=w.device)
    return (torch.zeros_like(w),)


def _effective_grad(w: torch.Tensor, g: torch.Tensor, cfg: LocalConfig,
                    mask: torch.Tensor | None) -> torch.Tensor:
    """The gradient an update uses: L2 weight decay added (as torch.optim), then the mask applied, so that
    masked coordinates get neither gradient nor decay."""
    if cfg.weight_decay:
        g = g + cfg.weight_decay * w
    return g if mask is None else g * mask


def optimizer_step(w: torch.Tensor, g: torch.Tensor, st: tuple[torch.Tensor, ...], cfg: LocalConfig,
                   mask: torch.Tensor | None = None, active: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """One optimiser step on flat vectors (any leading dims), out of place: (new w, new state).

    The one update rule of both engines. `active` ([rows, 1] bool) leaves inactive rows (the vectorized
    engine's idle slots) and their state untouched. Masked coordinates (mask 0) get no gradient and no
    weight decay, so SGD and Adam leave them bit-identical."""
    def keep(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        return new if active is None else torch.where(active, new, old)

    g = _effective_grad(w, g, cfg, mask)
    if cfg.optimizer == "adam":
        m, v, t = st
        b1, b2 = cfg.betas
        t = keep(t + 1, t)
        m = keep(torch.lerp(m, g, 1 - b1), m)
        v = keep(v * b2 + (1 - b2) * g * g, v)
        step = cfg.lr / (1 - b1 ** t)
        denom = v.sqrt() / (1 - b2 ** t).sqrt() + cfg.eps
        return keep(w - step * (m / denom), w), (m, v, t)
    (buf,) = st
    if cfg.momentum:
        buf = keep(buf * cfg.momentum + g, buf)
        g = buf
    return keep(w - cfg.lr * g, w), (buf,)


def optimizer_step_(w: torch.Tensor, g: torch.Tensor, st: tuple[torch.Tensor, ...], cfg: LocalConfig,
                    mask: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """`optimizer_step` in place on one model's own w and state (the eager loops: the sequential engine and
    pooled training); the vectorized engine traces `optimizer_step`, which Inductor fuses into one loop.

    SGD: the same operations in the same order, so the same bits. Adam: torch's fused Adam kernel
    (`torch.optim.adam.adam(fused=True)`, one pass over w, g, m and v instead of a dozen), with our weight
    decay and mask applied to the gradient first as in `optimizer_step`; it matches `optimizer_step` to
    float32 rounding (`tests/test_api_v2.py`). On the Clust-PSI-PFL FMNIST CNN (8 M parameters) one Adam
    step took 5.5 ms instead of 69 ms on one core (`bench/README.md, "step_cost"`). Masked coordinates get a zero
    gradient, zero moments and so a zero update: they stay bit-identical here too."""
    g = _effective_grad(w, g, cfg, mask)
    if cfg.optimizer == "adam":
        m, v, t = st
        b1, b2 = cfg.betas
        try:
            _torch_adam([w], [g], [m], [v], [], [t], fused=True, amsgrad=False, beta1=b1, beta2=b2,
                        lr=cfg.lr, weight_decay=0.0, eps=cfg.eps, maximize=False)
        except RuntimeError:          # a device without the fused kernel: the reference formula
            w_new, (m_new, v_new, t_new) = optimizer_step(w, g, st, cfg)
            w.copy_(w_new), m.copy_(m_new), v.copy_(v_new), t.copy_(t_new)
        return w, (m, v, t)
    (buf,) = st
    if cfg.momentum:
        buf.mul_(cfg.momentum).add_(g)
        g = buf
    w.sub_(cfg.lr * g)
    return w, (buf,)


def trained_mask(mask: torch.Tensor | None, trainable: torch.Tensor | None) -> torch.Tensor | None:
    """The mask an optimiser step uses: a job's `mask` ([P] or [n, P], None: every coordinate) with the
    buffer section (running statistics, `trainable` 0) left out, or `mask` itself for a vector of
    parameters only (so those runs compute exactly what they did)."""
    if trainable is None:
        return mask
    return trainable if mask is None else mask * trainable


def confusion(y: torch.Tensor, pred: torch.Tensor, c: int) -> torch.Tensor:
    return torch.bincount(y * c + pred, minlength=c * c).view(c, c)


PRECISIONS = ("float32", "bfloat16")


def autocast_objective(obj: Loss, device_type: str) -> Loss:
    """`obj` with its forward pass under `torch.autocast(device_type, dtype=torch.bfloat16)` and its loss
    returned as float32 (`train.precision=bfloat16`). Autocast casts the float32 parameters and inputs to
    bf16 at each convolution and matrix product and leaves the rest (losses, normalisations, the
    objectives' penalty terms on the flat vector) in float32; autograd records the casts, so the backward
    pass computes in bf16 where the forward did and hands back a float32 gradient of the float32 vector.
    Parameters, optimiser state and the server's vectors are never bf16 (mixed precision as in
    "Mixed Precision Training", Micikevicius et al., 2018, arXiv:1710.03740; bf16 needs no loss scaling:
    its exponent range is float32's)."""

    def run(f, flat, x, y, wt, extras):
        with torch.autocast(device_type, dtype=torch.bfloat16):
            loss = obj(f, flat, x, y, wt, extras)
        return loss.float()

    functools.update_wrapper(run, obj)
    return run


def resolve_loss(loss: str | Loss) -> Loss:
    if callable(loss):
        return loss
    try:
        return OBJECTIVES[loss]
    except KeyError:
        raise ValueError(f"unknown objective {loss!r}; known: {sorted(OBJECTIVES)}") from None


class EngineBase:
    """Holds the federation on the device and the functional model; implements the Trainer protocol."""

    name = "base"

    def __init__(self, fed: Federation, model: torch.nn.Module, cfg: LocalConfig, seed: int,
                 device: str | torch.device = "cpu"):
        tune_allocator()             # process-wide malloc thresholds, on first engine (fedprism._alloc)
        if cfg.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {cfg.optimizer!r}")
        self.fed = fed.to(device)
        self.device = torch.device(device)
        if self.device.type == "cuda":
            deterministic_cudnn()
        self.model = model.to(self.device)
        self.f = Functional(self.model, for_inference(self.model))
        self.spec = self.f.spec
        self.cfg = cfg
        self.eval_fused = False      # eval.kernels=fused applied (inference copy with fused blocks)
        from fedprism.kernels import KERNELS
        for name in ("eval_kernels", "train_kernels"):
            if getattr(cfg, name) not in KERNELS:
                raise ValueError(f"{name} must be one of {KERNELS} (a configuration's `auto` is resolved by "
                                 f"fedprism.kernels.resolve), got {getattr(cfg, name)!r}")
        if cfg.eval_kernels == "fused":
            self._require_kernels("eval.kernels=fused")
            self._fuse_eval_kernels()
        for key, name in (("eval.precision", "eval_precision"), ("train.precision", "train_precision")):
            if getattr(cfg, name) not in PRECISIONS:
                raise ValueError(f"{name} must be one of {PRECISIONS}, got {getattr(cfg, name)!r}")
            if getattr(cfg, name) == "bfloat16" and self.device.type == "cpu" and native_bf16() is False:
                warnings.warn(f"{key}=bfloat16 on a CPU without native bf16 (no avx512_bf16 or "
                              "amx_bf16 flag in /proc/cpuinfo): bf16 arithmetic is emulated here and runs "
                              "several times slower than float32 (bench/README.md, bf16: 0.25x on an AVX2 "
                              "CPU). "
                              f"The setting is kept (it is part of the run's identity); {key}=float32 is the "
                              "faster one here", stacklevel=3)
        if cfg.train_precision == "bfloat16" and cfg.train_kernels == "fused":
            raise ValueError("train_kernels='fused' computes in float32 only; train_precision='bfloat16' "
                             "trains through PyTorch's kernels (train_kernels='aten')")
        #: the fused blocks' training gradient (`fedprism.kernels.fused.StemSplit`), or None
        self.stem = None
        if cfg.train_kernels == "fused":
            self._require_kernels("train.kernels=fused")
            from fedprism.kernels.fused import StemSplit
            # (a model with running statistics trains through `Functional.with_stats`: no fused stems)
            self.stem = StemSplit(self.f) if StemSplit.qualifies(self.f) and not self.f.running else None
        #: float32 [P] on the device, 1 on parameters and 0 on the buffer section (running statistics), which
        #: no optimiser steps (`fedprism.params`); None for a vector of parameters only
        t = self.spec.trainable
        self.trainable = None if t is None else t.to(self.device)
        self.seed = seed
        self._train_idx = [torch.as_tensor(i, dtype=torch.long, device=self.device) for i in fed.train_idx]
        self._test_idx = [torch.as_tensor(i, dtype=torch.long, device=self.device) for i in fed.test_idx]
        self._val_idx = None if fed.val_idx is None else \
            [torch.as_tensor(i, dtype=torch.long, device=self.device) for i in fed.val_idx]
        self.samples_trained = 0

    def _require_kernels(self, key: str) -> None:
        """The fused kernels loaded, or a `RuntimeError` that says why they cannot run here. An engine
        never falls back on its own: the kernels a run uses are part of its identity, so a configuration's
        are resolved to what can run before its run id is computed (`fedprism.kernels.resolve`)."""
        from fedprism.kernels import build

        if self.device.type != "cpu":
            raise RuntimeError(f"{key}: a CPU kernel, and this engine is on {self.device}; use aten (a "
                               "configuration's `auto` resolves to it there)")
        if not build.load("fused"):
            raise RuntimeError(f"{key}: the fused kernels are unavailable ({build.unavailable_reason()}); use aten "
                               "(`fedprism kernels status` says why; a configuration's `auto` and `fused` "
                               "resolve to aten where they cannot run)")

    def _fuse_eval_kernels(self) -> None:
        """`eval_kernels = fused`: the inference copy of the model gets fused blocks
        (`fedprism.kernels.fused.fuse_stems`) where any qualify."""
        from fedprism.kernels import fused

        base = self.f.inference_module if self.f.inference_module is not None else self.model
        done = fused.fuse_stems(base)
        if done is not None:
            self.f.inference_module = done
            self.eval_fused = True

    def set_rows(self, train_idx: list, test_idx: list, val_idx: list | None = None) -> None:
        """Replace every client's train / local test / validation rows (indices into the same pools): a
        time-varying local dataset (`fedprism.data.drift`). The federation object the engine was built from
        is not changed (a sweep shares it between runs)."""
        from dataclasses import replace as _replace
        self.fed = _replace(self.fed, train_idx=list(train_idx), test_idx=list(test_idx),
                            val_idx=None if val_idx is None else list(val_idx))
        t = lambda idx: [torch.as_tensor(i, dtype=torch.long, device=self.device) for i in idx]  # noqa: E731
        self._train_idx, self._test_idx = t(train_idx), t(test_idx)
        self._val_idx = None if val_idx is None else t(val_idx)
        if hasattr(self, "_train_idx_np"):
            self._train_idx_np = [np.asarray(i, dtype=np.int64) for i in train_idx]

    # -- shared helpers ---------------------------------------------------------------------------
    def _order_args(self, job: TrainJob, rnd: int) -> list[tuple[int, int, int]]:
        """Per client of the job: (samples n, epochs, seed) of its batch order (`iter_batches`)."""
        epochs = self.cfg.epochs if job.epochs is None else job.epochs
        return [(len(self._train_idx[int(c)]), epochs, stream_seed(self.seed, rnd, int(c), job.stream_of(k)))
                for k, c in enumerate(job.clients)]

    def _orders(self, job: TrainJob, rnd: int) -> list[tuple[int, Callable[[], Iterator[torch.Tensor]]]]:
        """Per client of the job: (number of batches, a function giving its lazy batch iterator)."""
        B = self.cfg.batch_size
        return [(n_batches(n, e, B), functools.partial(iter_batches, n, e, B, seed))
                for n, e, seed in self._order_args(job, rnd)]

    def _config(self, job: TrainJob) -> LocalConfig:
        if job.optimizer is None or job.optimizer == self.cfg.optimizer:
            return self.cfg
        if job.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {job.optimizer!r}")
        from dataclasses import replace
        return replace(self.cfg, optimizer=job.optimizer)

    def _n_train(self, clients) -> torch.Tensor:
        return torch.tensor([len(self._train_idx[c]) for c in clients], dtype=torch.float64)

    def data(self, client: int, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) of client `client`'s split: 'train', 'local' (its test split), 'global' (the shared test
        set), 'val' (its validation rows) or 'global_val' (the global validation set)."""
        if split == "global":
            return self.fed.x_test, self.fed.y_test
        if split == "global_val":
            if self.fed.x_val is None:
                raise ValueError("this federation has no global validation set (data.global_val=0)")
            return self.fed.x_val, self.fed.y_val
        if split == "val":
            if self._val_idx is None:
                raise ValueError("this federation has no validation splits (data.val_fraction=0)")
            i = self._val_idx[client]
            return self.fed.x_train[i], self.fed.y_train[i]
        if split == "local":
            i = self._test_idx[client]
            x, y = self.fed.local_xy()           # the official test set, or the clients' own held-out rows
            return x[i], y[i]
        if split == "train":
            i = self._train_idx[client]
            return self.fed.x_train[i], self.fed.y_train[i]
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")

    def _dropout_seed(self, rnd: int, client: int, stream: str) -> int | None:
        """The job's dropout seed (`dropout_seed`), None for a model without dropout layers."""
        return dropout_seed(self.seed, rnd, client, stream) if self.f.dropout else None

    def objective(self, loss: str | Loss) -> Loss:
        """The training objective `loss` at the run's training precision: itself for float32, under
        bf16 autocast for bfloat16 (`autocast_objective`). Every local training step of both engines takes
        its objective from here."""
        obj = resolve_loss(loss)
        return obj if self.cfg.train_precision == "float32" else autocast_objective(obj, self.device.type)

    def _local_sgd(self, w: torch.Tensor, rows: torch.Tensor, batches, loss_fn, cfg: LocalConfig, mask,
                   extras: dict, drop: int | None = None) -> tuple[torch.Tensor, float]:
        """One model's local training, a step per batch of positions into `rows` (global train indices):
        the sequential engine's per-client loop and the pooled reference share it. `drop`: the dropout
        seed (`dropout_seed`; step j trains with `dropout_key(drop, j)`). Returns (w, mean loss)."""
        st = optimizer_state(cfg, w)
        total, count = 0.0, 0
        fused_gv = None if self.stem is None else self.stem.grad_and_value(loss_fn)    # train.kernels=fused
        step_mask = trained_mask(mask, self.trainable)
        stats = ()
        for j, b in enumerate(batches):
            bi = rows[b.to(self.device)]
            x, y = self.fed.x_train[bi], self.fed.y_train[bi]
            ones = torch.ones(len(y), device=self.device)
            if fused_gv is not None:           # (models with dropout never qualify)
                g, loss = fused_gv(w.detach(), x, y, ones, extras)
            else:
                wr = w.detach().requires_grad_(True)
                f = self.f if drop is None else self.f.keyed(dropout_key(drop, j, self.device))
                if self.f.running:             # training mode: batch statistics, recorded
                    loss, stats = self.f.with_stats(lambda p: loss_fn(f, p, x, y, ones, extras))(wr)
                else:
                    loss = loss_fn(f, wr, x, y, ones, extras)
                (g,) = torch.autograd.grad(loss, wr)
            with torch.no_grad():
                w, st = optimizer_step_(w, g, st, cfg, step_mask)
                if stats:
                    self.f.apply_running(w, stats, mask)
            total += float(loss.detach()) * len(y)
            count += len(y)
            self.samples_trained += len(y)
        return w, total / max(1, count)

    def train_pooled(self, start: torch.Tensor, clients, rnd: int, stream: str = "pooled") -> Trained:
        """One model [1, P] trained from `start` [P] on the union of `clients`' train rows (the centralised
        reference: minibatches drawn from the pooled data), E epochs with the run's optimiser. Needs every
        client's data in this process, so only the simulator's engines have it."""
        cfg = self.cfg
        idx = torch.cat([self._train_idx[int(c)] for c in clients])
        batches = iter_batches(len(idx), cfg.epochs, cfg.batch_size, stream_seed(self.seed, rnd, 0, stream))
        w, loss = self._local_sgd(start.to(self.device, copy=True), idx, batches, self.objective("ce"), cfg, None,
                                  {}, self._dropout_seed(rnd, 0, stream))
        return Trained(np.asarray(clients)[:1], w.unsqueeze(0).to(start.device),
                       torch.tensor([float(len(idx))], dtype=torch.float64),
                       torch.tensor([loss], dtype=torch.float64),
                       torch.tensor([n_batches(len(idx), cfg.epochs, cfg.batch_size)], dtype=torch.int64))

    @property
    def num_classes(self) -> int:
        return self.fed.num_classes

    @property
    def eval_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.cfg.eval_precision == "bfloat16" else torch.float32

    def _at_eval_precision(self, forward, params: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """`forward(params, x)` at the run's evaluation precision, as float32 logits (`.to` of a tensor
        that already has the dtype is the tensor itself: float32 is unchanged). Every evaluation
        forward pass of both engines goes through here."""
        dt = self.eval_dtype
        return forward(params.to(dt), x.to(dt) if x.is_floating_point() else x).float()   # token ids stay int64

    def _forward_eval(self, flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Logits of one model for evaluation."""
        return self._at_eval_precision(self.f, flat, x)

    @torch.inference_mode()
    def logits(self, params: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[n, B, classes] logits of n models on one shared input batch."""
        return torch.stack([self._forward_eval(p, x) for p in params])

    @torch.inference_mode()
    def features(self, params: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[n, B, d] penultimate features of n models on one shared input batch."""
        return torch.stack([self.f.features(p.to(self.device), x.to(self.device)) for p in params])

    @torch.inference_mode()
    def evaluate_one(self, flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[int, float, torch.Tensor]:
        c = self.fed.num_classes
        correct, loss, conf = 0, 0.0, torch.zeros(c, c, dtype=torch.long, device=self.device)
        for s in range(0, len(y), self.cfg.eval_chunk):
            out = self._forward_eval(flat, x[s : s + self.cfg.eval_chunk])
            yy = y[s : s + self.cfg.eval_chunk]
            pred = out.argmax(-1)
            correct += int((pred == yy).sum())
            loss += float(F.cross_entropy(out, yy, reduction="sum"))
            conf += confusion(yy, pred, c)
        return correct, loss, conf

    def evaluate(self, params: torch.Tensor, clients: np.ndarray, split: str) -> EvalResult:
        """Model row i scored on client clients[i]'s split ('local', 'train') or on the global test set."""
        rows = [self.evaluate_one(params[k].to(self.device), *self.data(int(c), split))
                for k, c in enumerate(clients)]
        counts = [len(self.data(int(c), split)[1]) for c in clients]
        return EvalResult(
            correct=torch.tensor([r[0] for r in rows], dtype=torch.long),
            loss_sum=torch.tensor([r[1] for r in rows], dtype=torch.float64),
            count=torch.tensor(counts, dtype=torch.long),
            confusion=torch.stack([r[2].cpu() for r in rows]) if rows else
            torch.zeros(0, self.fed.num_classes, self.fed.num_classes, dtype=torch.long),
        )
