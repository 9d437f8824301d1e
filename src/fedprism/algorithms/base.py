"""The algorithm interface: a state and four functions (DESIGN.md "An algorithm is three functions").

    plan(state, rnd, clients)        -> Plan     what each sampled client starts from + its objective
    client_update(plan, trainer)     -> Update   local work; default: the engine trains plan.start
    aggregate(state, rnd, update)    -> records  the server step (mutates state), returns loggables
    model_for(state, clients)        -> [n, P]   the model each client would use for inference now

Everything is batched over the cohort: `Plan.start` is an `[n, P]` matrix, `Update.params` too,
so the vectorized engine trains a cohort at once and Flower can send row i to node i. The state is a
dict of tensors / numpy arrays / plain Python values, checkpointed with `torch.save`.

Algorithms never see the engine's loop: `client_update` receives a `Trainer` with `train(plan)`,
`evaluate(...)`, `logits(...)` and `features(...)`, which run one client or a whole cohort.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Protocol

import numpy as np
import torch

from fedprism.errors import ConfigError
from fedprism.hparams import Param
from fedprism.params import ParamSpec


@dataclass
class Context:
    """What an algorithm may know about the federation (no raw data)."""

    num_clients: int
    num_classes: int
    spec: ParamSpec
    init: torch.Tensor                 # [P] initial parameters (same seed -> same vector)
    n_train: np.ndarray                # [N] train samples per client
    label_hist: np.ndarray             # [N, classes] train label counts (for PSI-style methods)
    seed: int
    rounds: int
    fraction: float


@dataclass
class Plan:
    """What the sampled clients do this round. Row i of every tensor belongs to clients[i]."""

    clients: np.ndarray                                   # [n] client ids
    start: torch.Tensor                                   # [n, P] start parameters (exact vector sent)
    objective: str = "ce"                                 # name in fedprism.objectives.OBJECTIVES
    extras: dict[str, torch.Tensor] = field(default_factory=dict)   # per-client [n, ...] tensors
    train_mask: torch.Tensor | None = None                # [P] 1 where parameters train (None: all)
    epochs: int | None = None                             # override the experiment's local_epochs
    down_floats: int | None = None                        # floats sent to each client (default P)

    def subset(self, rows: np.ndarray) -> "Plan":
        """The plan for rows `rows` only (e.g. to retry clients one by one after a failure)."""
        t = torch.as_tensor(rows)
        n = len(self.clients)
        ex = {k: (v[t] if v.shape[:1] == (n,) else v) for k, v in self.extras.items()}
        return Plan(self.clients[rows], self.start[t], self.objective, ex, self.train_mask, self.epochs,
                    self.down_floats)


@dataclass
class Update:
    """What came back. `params` are the trained vectors; `start` the vectors that were sent."""

    clients: np.ndarray
    params: torch.Tensor                                  # [n, P]
    start: torch.Tensor                                   # [n, P]
    n_samples: torch.Tensor                               # [n] float64 train samples
    extras: dict[str, Any] = field(default_factory=dict)  # e.g. losses, prototypes, label counts
    up_floats: int | None = None                          # floats sent back per client (default P)
    rejected: dict[int, str] = field(default_factory=dict)  # client id -> reason (filled by the runner)

    @staticmethod
    def concat(parts: list["Update"], like: "Update | None" = None) -> "Update":
        """Row-wise concatenation of updates from the same plan (tensor extras concatenated)."""
        if not parts:
            raise ValueError("no updates to concatenate")
        ex: dict[str, Any] = {}
        for k, v in parts[0].extras.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                ex[k] = torch.cat([p.extras[k] for p in parts])
            else:
                ex[k] = v
        return Update(np.concatenate([p.clients for p in parts]), torch.cat([p.params for p in parts]),
                      torch.cat([p.start for p in parts]), torch.cat([p.n_samples for p in parts]), ex,
                      parts[0].up_floats)

    @property
    def delta(self) -> torch.Tensor:
        return self.params - self.start

    def select(self, keep: np.ndarray) -> "Update":
        """The rows where `keep` is True (used to drop rejected clients)."""
        t = torch.as_tensor(keep)
        ex = {k: (v[t] if isinstance(v, torch.Tensor) and v.shape[:1] == (len(keep),) else v)
              for k, v in self.extras.items()}
        return Update(self.clients[keep], self.params[t], self.start[t], self.n_samples[t], ex,
                      self.up_floats, dict(self.rejected))


class Trainer(Protocol):
    """The engine as an algorithm sees it."""

    def train(self, plan: Plan, rnd: int) -> Update: ...

    def evaluate(self, params: torch.Tensor, clients: np.ndarray, split: str) -> "EvalResult": ...

    def logits(self, params: torch.Tensor, x: torch.Tensor) -> torch.Tensor: ...


@dataclass
class EvalResult:
    """Per-model evaluation sums. `confusion[i]` is model i's [classes, classes] count matrix."""

    correct: torch.Tensor      # [n] int64
    loss_sum: torch.Tensor     # [n] float64
    count: torch.Tensor        # [n] int64
    confusion: torch.Tensor    # [n, C, C] int64 (rows: true, cols: predicted)
    #: correct counts [n] of alternative predictions on the same samples (diagnostics stored beside the
    #: headline metric as `<split>_acc@<name>`, e.g. each stream of fedprism_dual alone)
    alternatives: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def accuracy(self) -> torch.Tensor:
        return self.correct.double() / self.count.clamp(min=1).double()


class StateStore:
    """The simulator's client-side store: rows of `state[key]` ([N, P] tensors).

    An algorithm with per-client parts that never travel (`Algorithm.client_state`, e.g. fedprism_dual's
    private components and specialists) reads and writes them only through `rows` / `write`, so the
    same `client_update` runs in the simulator (this class) and on a Flower node
    (`fedprism.flower.node.NodeStore`, the node's own rows kept in its Flower `Context.state`).
    """

    def __init__(self, state: dict[str, Any]):
        self.state = state

    def rows(self, key: str, clients: np.ndarray) -> torch.Tensor:
        return self.state[key][torch.as_tensor(np.asarray(clients), dtype=torch.long)]

    def write(self, key: str, clients: np.ndarray, values: torch.Tensor) -> None:
        t = self.state[key]
        t[torch.as_tensor(np.asarray(clients), dtype=torch.long)] = values.to(t.device, t.dtype)


class Algorithm:
    """Base class. Subclasses set `name`, `params` and override the four functions."""

    name: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    params: ClassVar[dict[str, Param]] = {}
    personalized: ClassVar[bool] = True   # False: one shared model (global acc computed once)
    #: per-client rows kept on the client, never in a message (state keys of [N, P] in the simulator)
    client_state: ClassVar[tuple[str, ...]] = ()

    def __init__(self, ctx: Context, **hp: Any):
        self.ctx = ctx
        self.hp = self.resolve(hp)

    @classmethod
    def resolve(cls, hp: dict[str, Any]) -> dict[str, Any]:
        """Validate method parameters (keys without the method prefix); fill defaults."""
        out = {}
        for k in hp:
            if k not in cls.params:
                allowed = ", ".join(f"{cls.name}.{p}" for p in cls.params) or "none"
                raise ConfigError(f"{cls.name}.{k}", hp[k], f"unknown parameter; {cls.name} takes {allowed}")
        for k, p in cls.params.items():
            out[k] = p.validate(f"{cls.name}.{k}", hp[k]) if k in hp else p.default
        cls.check_params(out)
        return out

    @classmethod
    def check_params(cls, hp: dict[str, Any]) -> None:
        """Cross-parameter checks (e.g. m <= K); raise ConfigError."""

    # -- the four functions --------------------------------------------------------------------
    def init_state(self) -> dict[str, Any]:
        raise NotImplementedError

    def plan(self, state: dict[str, Any], rnd: int, clients: np.ndarray) -> Plan:
        raise NotImplementedError

    def client_update(self, plan: Plan, trainer: Trainer, rnd: int) -> Update:
        return trainer.train(plan, rnd)

    def aggregate(self, state: dict[str, Any], rnd: int, update: Update) -> dict[str, Any]:
        raise NotImplementedError

    def model_for(self, state: dict[str, Any], clients: np.ndarray) -> torch.Tensor:
        raise NotImplementedError

    # -- optional hooks --------------------------------------------------------------------------
    def evaluate(self, state: dict[str, Any], trainer: Trainer, clients: np.ndarray, split: str) -> EvalResult | None:
        """Custom evaluation (e.g. dual-stream routing); None means: evaluate `model_for` rows."""
        return None

    def eval_payload(self, state: dict[str, Any], clients: np.ndarray) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """What the server sends client i for its evaluation on its own side (rows [n, P], extras [n, ...]).

        Only algorithms with `client_state` need it (a Flower node adds its own rows in
        `evaluate_client`); the default is the inference model itself."""
        return self.model_for(state, clients), {}

    def evaluate_client(self, trainer: Trainer, clients: np.ndarray, rows: torch.Tensor,
                        extras: dict[str, torch.Tensor], split: str) -> EvalResult:
        """The client-side evaluation of `eval_payload` rows, with `self.client_store` bound to the client's
        own store (a Flower node)."""
        return trainer.evaluate(rows, clients, split)

    def extra_models(self, state: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Extra shared models to score on the global test set (e.g. {'global': w_g})."""
        return {}


def evaluate_rows(trainer: Trainer, rows: torch.Tensor, clients: np.ndarray, split: str) -> EvalResult:
    """`trainer.evaluate(rows, clients, split)`, scoring identical rows once on the shared global test set
    (e.g. 100 clients holding K cluster models: K evaluations, not 100). Exact."""
    if split != "global" or len(rows) < 2:
        return trainer.evaluate(rows, clients, split)
    uniq, inverse = torch.unique(rows, dim=0, return_inverse=True)
    if len(uniq) == len(rows):
        return trainer.evaluate(rows, clients, split)
    rep = torch.empty(len(uniq), dtype=torch.long)
    rep[inverse] = torch.arange(len(rows))          # one representative row of each distinct model
    r = trainer.evaluate(rows[rep], np.asarray(clients)[rep.numpy()], split)
    return EvalResult(r.correct[inverse], r.loss_sum[inverse], r.count[inverse], r.confusion[inverse],
                      {k: v[inverse] for k, v in r.alternatives.items()})


REGISTRY: dict[str, type[Algorithm]] = {}


def register(cls: type[Algorithm]) -> type[Algorithm]:
    REGISTRY[cls.name] = cls
    return cls


def weighted_mean(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum_k w_k x_k / sum_k w_k over rows, accumulated in float64 (specs 0.1). w must sum > 0."""
    w64 = w.to(torch.float64)
    s = w64.sum()
    if not s > 0:
        raise ValueError("weights sum to zero; the caller must keep the previous value")
    return ((w64 / s) @ x.to(torch.float64)).to(x.dtype)
