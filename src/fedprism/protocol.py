"""The ground floor: the types an algorithm, an engine, the runner and a Flower node exchange.

This module imports nothing of fedprism except `params` and `errors`, so `engine/` and `algorithms/`
both build on it without importing each other. The interface itself (`Algorithm`) lives in
`fedprism.algorithms.base`; `docs/architecture.md` draws the whole data flow.

    TrainSettings the experiment's local-training settings, read-only (`Context.train`)
    Plan          server -> clients: a named set of tensors per client (`payload`), rows [n, ...]
    Update        clients -> server: a named set of tensors per client, checked against the method's
                  declared upload (`TensorSpec`), plus the sample count and training diagnostics
    ClientState   a declaration of per-client state that never leaves the client (shape, initialiser)
    TrainJob      one local training of a cohort: start vectors, loss, per-client extras and masks,
                  epochs, a named random stream, the optimiser
    Inference     which model(s) a client predicts with and how their logits combine
    EvalResult    per-model evaluation sums
    Trainer       the engine as an algorithm sees it (train, evaluate, logits, features, data)
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Protocol

import numpy as np
import torch

from fedprism.params import Functional, ParamSpec

Rows = dict[str, torch.Tensor]
"""Named tensors with one row per client ([n, ...]); row i belongs to clients[i]."""


def _take(rows: Rows, index: torch.Tensor) -> Rows:
    return {k: v[index] for k, v in rows.items()}


def payload_bytes(rows: Rows) -> int:
    """Bytes of every tensor of every row, element sizes as stored (the wire size of a payload that travels
    as it is held; `Algorithm.wire_bytes` counts a method's own encoding)."""
    return int(sum(v.numel() * v.element_size() for v in rows.values()))


@dataclass(frozen=True)
class TrainSettings:
    """The experiment's local-training settings, read-only: what `client_update`'s default training (and
    every `TrainJob` that leaves `epochs` and `optimizer` as None) trains with. `ctx.train` on every side
    (the simulator, a Flower node, a Flower server), built from the same configuration as the engine's
    settings. A method that corrects local steps (SCAFFOLD's control variates, FedNova's normalisation)
    reads them here, and the steps each client took from `Trained.steps`.

    optimizer     'sgd' (torch.optim.SGD: momentum, dampening 0, no Nesterov) or 'adam' (torch.optim.Adam)
    lr            the client learning rate
    momentum      SGD momentum (0: plain SGD; Adam ignores it)
    weight_decay  L2 weight decay added to the gradient
    batch_size    samples per local step (the last batch of an epoch may be smaller)
    local_epochs  passes over the client's training data
    adam_betas, adam_eps   Adam's constants
    """

    optimizer: str
    lr: float
    momentum: float
    weight_decay: float
    batch_size: int
    local_epochs: int
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8

    @classmethod
    def of(cls, local: Any) -> "TrainSettings":
        """The settings of an engine's `LocalConfig` (`fedprism.engine.base`)."""
        return cls(optimizer=str(local.optimizer), lr=float(local.lr), momentum=float(local.momentum),
                   weight_decay=float(local.weight_decay), batch_size=int(local.batch_size),
                   local_epochs=int(local.epochs), adam_betas=tuple(local.betas), adam_eps=float(local.eps))

    def for_job(self, job: "TrainJob") -> "TrainSettings":
        """What `job` trains with: its own `epochs` and `optimizer` where it sets them."""
        return replace(self, local_epochs=self.local_epochs if job.epochs is None else int(job.epochs),
                       optimizer=self.optimizer if job.optimizer is None else job.optimizer)

    def steps(self, n_samples: int, epochs: int | None = None) -> int:
        """Local steps of a client with `n_samples` training samples: one per batch, `local_epochs` (or
        `epochs`) passes, the last batch of each kept (as the engines do; no samples: one empty batch per
        epoch). `Trained.steps` holds what the engine counted."""
        e = self.local_epochs if epochs is None else int(epochs)
        return e * max(1, -(-int(n_samples) // self.batch_size))


@dataclass
class Context:
    """What an algorithm may know about the federation (no raw data). `train`: the experiment's
    local-training settings (`TrainSettings`; None only in a Context built by hand without them)."""

    num_clients: int
    num_classes: int
    spec: ParamSpec
    init: torch.Tensor                 # [P] initial parameters (same seed -> same vector)
    n_train: np.ndarray                # [N] train samples per client
    label_hist: np.ndarray             # [N, classes] train label counts
    seed: int
    rounds: int
    fraction: float
    feature_dim: int = 0               # width of the model's penultimate features (prototype methods)
    privacy: Any = None                # fedprism.privacy.Privacy when `privacy.epsilon` > 0, else None
    train: TrainSettings | None = None  # the local-training settings (lr, momentum, batch size, epochs, ...)
    dp: Any = None                     # fedprism.privacy.UpdateDP when `dp.clip` > 0 (DP-FedAvg), else None
    compress: Any = None               # fedprism.compression.Compressor when `compress` is set, else None
    attack: Any = None                 # fedprism.attacks.Attack when `attack.fraction` > 0 (Byzantine clients)


# -- declarations ------------------------------------------------------------------------------------
def _dims(shape: tuple, ctx: Context) -> tuple[int, ...]:
    """Resolve symbolic dimensions: 'P' parameters, 'C' classes, 'd' feature width, 'N' clients."""
    table = {"P": ctx.spec.size, "C": ctx.num_classes, "d": ctx.feature_dim, "N": ctx.num_clients}
    return tuple(table[s] if isinstance(s, str) else int(s) for s in shape)


@dataclass(frozen=True)
class TensorSpec:
    """One named tensor of a message, per client: shape (symbols 'P', 'C', 'd' allowed), dtype, and
    optional bounds for integer tensors (e.g. a cluster index in [0, K))."""

    shape: tuple = ("P",)
    dtype: torch.dtype = torch.float32
    low: float | None = None
    high: float | None = None          # exclusive

    def resolve(self, ctx: Context) -> "TensorSpec":
        return replace(self, shape=_dims(self.shape, ctx))

    def problem(self, name: str, t: Any) -> str | None:
        """Why one client's row `t` does not match (None when it does). `self` must be resolved."""
        if not isinstance(t, torch.Tensor):
            return f"{name}: a tensor expected, got {type(t).__name__}"
        if tuple(t.shape) != tuple(self.shape):
            return f"{name}: wrong shape {tuple(t.shape)}, expected {tuple(self.shape)}"
        if t.dtype != self.dtype:
            return f"{name}: wrong dtype {t.dtype}, expected {self.dtype}"
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return f"{name}: non-finite values (NaN/Inf)"
        if self.low is not None and t.numel() and bool((t < self.low).any()):
            return f"{name}: values below {self.low:g}"
        if self.high is not None and t.numel() and bool((t >= self.high).any()):
            return f"{name}: values >= {self.high:g}"
        return None


@dataclass(frozen=True)
class ClientState:
    """Per-client state that lives on the client: in memory in the simulator, in the checkpoint of a
    run, and in a Flower node's persistent `Context.state`. Never part of a message.

    `init`: 'model' (the run's initial parameter vector, shape ('P',)), 'zeros', or a number to fill.
    """

    shape: tuple = ("P",)
    init: str | float = "model"
    dtype: torch.dtype = torch.float32

    def initial(self, ctx: Context, n: int) -> torch.Tensor:
        """[n, *shape] initial rows."""
        shape = _dims(self.shape, ctx)
        if self.init == "model":
            if shape != (ctx.spec.size,):
                raise ValueError(f"init='model' needs shape ('P',), got {self.shape}")
            return ctx.init.to(self.dtype).expand(n, -1).clone()
        fill = 0.0 if self.init == "zeros" else float(self.init)
        return torch.full((n, *shape), fill, dtype=self.dtype)


# -- messages ----------------------------------------------------------------------------------------
@dataclass
class Plan:
    """What the server sends the sampled clients this round: `payload[name][i]` goes to clients[i].

    'params' is, by convention, the start vector of the default local training.
    """

    clients: np.ndarray
    payload: Rows = field(default_factory=dict)

    @property
    def start(self) -> torch.Tensor:
        return self.payload["params"]

    def subset(self, rows: np.ndarray) -> "Plan":
        return Plan(self.clients[rows], _take(self.payload, torch.as_tensor(rows)))

    @property
    def bytes(self) -> int:
        return payload_bytes(self.payload)


@dataclass
class Update:
    """What came back from the clients that finished their work.

    payload       the tensors they sent (checked against `Algorithm.upload`; counted in bytes_up as they
                  travel, `Algorithm.wire_bytes`)
    n_samples     [n] float64 train samples (metadata: a scalar per client, not counted)
    metrics       [n] per-client diagnostics (e.g. 'train_loss'; not counted)
    client_state  new rows of the clients' own state (stays on the client; never sent)
    sent          the plan rows these clients received (filled by the runner; server-side only)
    """

    clients: np.ndarray
    payload: Rows = field(default_factory=dict)
    n_samples: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float64))
    metrics: Rows = field(default_factory=dict)
    client_state: Rows = field(default_factory=dict)
    sent: Rows = field(default_factory=dict)
    rejected: dict[int, str] = field(default_factory=dict)

    @property
    def params(self) -> torch.Tensor:
        return self.payload["params"]

    @property
    def start(self) -> torch.Tensor:
        return self.sent["params"]

    @property
    def delta(self) -> torch.Tensor:
        return self.params - self.start

    @property
    def bytes(self) -> int:
        return payload_bytes(self.payload)

    def nonfinite_state(self) -> dict[int, str]:
        """{client: why} for the clients whose new `client_state` rows hold NaN or Inf (their training
        diverged): such a reply is not used and the client keeps the state it had."""
        n = len(self.clients)

        def bad_rows(rows: Rows) -> dict[int, list[str]]:
            out: dict[int, list[str]] = {}
            for k, v in rows.items():
                if n and isinstance(v, torch.Tensor) and v.is_floating_point():
                    for i in torch.nonzero(~torch.isfinite(v.reshape(n, -1)).all(1)).flatten().tolist():
                        out.setdefault(i, []).append(k)
            return out

        state = bad_rows(self.client_state)
        upload = bad_rows(self.payload) if state else {}          # scanned only to explain a rejection
        # the upload is named too: it tells a diverged local training from a diverged state-only step
        return {int(self.clients[i]): f"client state {names[0]!r}: non-finite values (NaN/Inf)"
                + (f"; its upload {', '.join(map(repr, upload[i]))} too" if i in upload else "")
                for i, names in state.items()}

    def select(self, keep: np.ndarray) -> "Update":
        """The rows where `keep` (bool [n]) is True."""
        t = torch.as_tensor(np.asarray(keep, dtype=bool))
        return Update(self.clients[np.asarray(keep, dtype=bool)], _take(self.payload, t), self.n_samples[t],
                      _take(self.metrics, t), _take(self.client_state, t), _take(self.sent, t), dict(self.rejected))

    @staticmethod
    def concat(parts: list["Update"]) -> "Update":
        if not parts:
            raise ValueError("no updates to concatenate")

        def cat(name: str) -> Rows:
            keys = getattr(parts[0], name).keys()
            return {k: torch.cat([getattr(p, name)[k] for p in parts]) for k in keys}

        return Update(np.concatenate([p.clients for p in parts]), cat("payload"),
                      torch.cat([p.n_samples for p in parts]), cat("metrics"), cat("client_state"), cat("sent"))


# -- local training ----------------------------------------------------------------------------------
Loss = Callable[..., torch.Tensor]
"""`loss(model, w, x, y, weight, extras) -> scalar`: `model(w, x)` gives logits, `model.features(w, x)`
the penultimate features and `model.head(w, z)` the logits of features; `weight` [B] is 1 for real
samples, 0 for padding; `extras` holds this client's rows of `TrainJob.extras`. Must be vmap-safe."""


@dataclass
class TrainJob:
    """One local training of a cohort (row i: clients[i]).

    loss       an objective name of `fedprism.objectives.OBJECTIVES` or a `Loss` callable
    extras     per-client tensors [n, ...] handed to the loss (anchors, prototypes, weights)
    mask       [P] or [n, P]: 1 where parameters train (None: all)
    epochs     None: the experiment's local_epochs
    stream     name of the random stream that orders the batches ('train' is the default stream; two
               trainings in one round use two names so their orders are independent), or one name per
               row (a tuple: what `train_together` builds when it runs several jobs as one)
    optimizer  None: the experiment's optimizer ('sgd' or 'adam'); the state starts fresh every job
    """

    clients: np.ndarray
    start: torch.Tensor
    loss: str | Loss = "ce"
    extras: Rows = field(default_factory=dict)
    mask: torch.Tensor | None = None
    epochs: int | None = None
    stream: str | tuple[str, ...] = "train"
    optimizer: str | None = None

    def stream_of(self, row: int) -> str:
        """The stream name of row `row`."""
        return self.stream if isinstance(self.stream, str) else self.stream[row]

    def subset(self, rows: np.ndarray) -> "TrainJob":
        t = torch.as_tensor(rows)
        mask = self.mask[t] if self.mask is not None and self.mask.dim() == 2 else self.mask
        stream = (self.stream if isinstance(self.stream, str)
                  else tuple(self.stream[int(r)] for r in np.asarray(rows)))
        return replace(self, clients=self.clients[rows], start=self.start[t], extras=_take(self.extras, t),
                       mask=mask, stream=stream)


def fusible(jobs: "list[TrainJob]") -> bool:
    """Whether `jobs` can run as one job (`fuse_jobs`): the same objective, optimiser and epochs, no
    parameter mask, and extras with the same names and row shapes. Their clients may repeat."""
    a = jobs[0]
    for b in jobs[1:]:
        if (b.loss is not a.loss and b.loss != a.loss) or b.optimizer != a.optimizer or b.epochs != a.epochs:
            return False
        if a.mask is not None or b.mask is not None or a.extras.keys() != b.extras.keys():
            return False
        if any(a.extras[k].shape[1:] != b.extras[k].shape[1:] for k in a.extras):
            return False
    return True


def fuse_jobs(jobs: "list[TrainJob]") -> "TrainJob":
    """Several compatible jobs (`fusible`) as one job whose rows are theirs in order, each row keeping its
    job's stream, so its batch order and dropout masks are those it would have had alone."""
    streams = tuple(j.stream_of(r) for j in jobs for r in range(len(j.clients)))
    dev = jobs[0].start.device
    return replace(jobs[0], clients=np.concatenate([j.clients for j in jobs]),
                   start=torch.cat([j.start.to(dev) for j in jobs]),
                   extras={k: torch.cat([j.extras[k] for j in jobs]) for k in jobs[0].extras}, stream=streams)


@dataclass
class Trained:
    """The result of a TrainJob: trained vectors, samples seen per client, mean training loss, and the
    local optimiser steps each client took (`steps`: counted by the engine that trained, the same in both
    engines and on a Flower node; None only in a Trained a method builds itself)."""

    clients: np.ndarray
    params: torch.Tensor                # [n, P]
    n_samples: torch.Tensor             # [n] float64 train samples of each client
    loss: torch.Tensor                  # [n] float64 sample-weighted mean loss
    steps: torch.Tensor | None = None   # [n] int64 local steps (batches) each client trained


# -- evaluation --------------------------------------------------------------------------------------
@dataclass
class EvalResult:
    """Per-model evaluation sums. `confusion[i]` is model i's [classes, classes] count matrix."""

    correct: torch.Tensor      # [n] int64
    loss_sum: torch.Tensor     # [n] float64
    count: torch.Tensor        # [n] int64
    confusion: torch.Tensor    # [n, C, C] int64 (rows: true, cols: predicted)
    #: correct counts [n] of alternative predictions on the same samples (diagnostics stored beside the
    #: headline metric as `<split>_acc@<name>`)
    alternatives: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def accuracy(self) -> torch.Tensor:
        return self.correct.double() / self.count.clamp(min=1).double()

    @staticmethod
    def empty(n: int, classes: int) -> "EvalResult":
        z = torch.zeros(n, dtype=torch.long)
        return EvalResult(z, z.double(), z.clone(), torch.zeros(n, classes, classes, dtype=torch.long))

    @staticmethod
    def concat(parts: list["EvalResult"], classes: int) -> "EvalResult":
        if not parts:
            return EvalResult.empty(0, classes)
        shared = set.intersection(*[set(r.alternatives) for r in parts])
        return EvalResult(torch.cat([r.correct for r in parts]), torch.cat([r.loss_sum for r in parts]),
                          torch.cat([r.count for r in parts]), torch.cat([r.confusion for r in parts]),
                          {k: torch.cat([r.alternatives[k] for r in parts]) for k in sorted(shared)})


Combine = Callable[[Rows, Rows], torch.Tensor]
"""(logits of each stream {name: [m, B, C]}, the `Inference.extras` rows of those m clients) -> the
logits the clients predict with ([m, B, C])."""


@dataclass
class Inference:
    """How clients predict: `streams[name]` [n, P] models; `combine` mixes their logits (None: the one
    stream is the prediction), with per-client tensors `extras` [n, ...] (e.g. a label prior);
    `alternatives` are diagnostic predictions from the same logits, stored as `<split>_acc@<name>`.
    Streams are run in their dict order (one stacked call per client on local splits).

    `features` names the streams that yield penultimate features ([m, B, d], `Trainer.features`) instead
    of logits, for predictions computed on the representation (e.g. the nearest class prototype);
    `combine` and `alternatives` receive them under their stream's name. The headline must be logits:
    with feature streams, `combine` is required unless the first stream yields logits."""

    streams: Rows
    combine: Combine | None = None
    alternatives: dict[str, Combine] = field(default_factory=dict)
    extras: Rows = field(default_factory=dict)
    features: tuple[str, ...] = ()

    @property
    def single(self) -> torch.Tensor | None:
        """The model rows when the prediction is one stream's own (the cached, exact fast path)."""
        if self.combine is None and len(self.streams) == 1 and not self.alternatives and not self.features:
            return next(iter(self.streams.values()))
        return None


class Trainer(Protocol):
    """The engine as an algorithm sees it (the simulator's engines and a Flower node's engine).

    `f` is the model as a function of its flat parameter vector (`f(w, x)` logits, `f.features`,
    `f.head`), differentiable, for a method's own gradient steps outside
    a `TrainJob` (Per-FedAvg's adaptation before it predicts); `logits` / `features` score without
    gradients at the evaluation precision."""

    device: torch.device
    f: Functional

    def train(self, job: TrainJob, rnd: int) -> Trained: ...

    def evaluate(self, params: torch.Tensor, clients: np.ndarray, split: str) -> EvalResult: ...

    def logits(self, params: torch.Tensor, x: torch.Tensor) -> torch.Tensor: ...

    def features(self, params: torch.Tensor, x: torch.Tensor) -> torch.Tensor: ...

    def data(self, client: int, split: str) -> tuple[torch.Tensor, torch.Tensor]: ...


def train_together(trainer: Trainer, jobs: list[TrainJob], rnd: int) -> list[Trained]:
    """Independent local trainings of one round (no job's start depends on another's result), in order.

    A trainer that runs many models at once and says so (`fuses_jobs = True`: the vectorized engine) runs
    compatible jobs (`fusible`) as one job (`fuse_jobs`): one pass over twice the models, which costs
    about one pass where the per-step overhead dominates (a GPU). Every row keeps its own job's stream,
    so its batch order and dropout masks are unchanged. Any other trainer runs the jobs one by one."""
    if len(jobs) < 2 or not getattr(trainer, "fuses_jobs", False) or not fusible(jobs):
        return [trainer.train(j, rnd) for j in jobs]
    t, out, i = trainer.train(fuse_jobs(jobs), rnd), [], 0
    for j in jobs:
        rows = slice(i, i + len(j.clients))
        out.append(Trained(j.clients, t.params[rows].to(j.start.device), t.n_samples[rows], t.loss[rows],
                           None if t.steps is None else t.steps[rows]))
        i += len(j.clients)
    return out


__all__ = ["ClientState", "Combine", "Context", "EvalResult", "Inference", "Loss", "Plan", "Rows", "TensorSpec",
           "TrainJob", "TrainSettings", "Trained", "Trainer", "Update", "fusible", "fuse_jobs", "payload_bytes",
           "train_together"]
