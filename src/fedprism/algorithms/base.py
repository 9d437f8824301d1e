"""The algorithm interface (docs/architecture.md, docs/writing-a-method.md).

An algorithm is a server state and these functions, all batched over the cohort (row i of every
tensor belongs to clients[i]):

    init_state()                                   -> server state (dict of tensors / arrays / values)
    plan(state, rnd, clients)                      -> Plan     the payload each sampled client receives
    client_update(plan, trainer, rnd, cstate)      -> Update   local work on the client: the upload, and
                                                               the client's new state rows
    aggregate(state, rnd, update)                  -> records  the server step (mutates state)
    eval_payload(state, clients)                   -> rows     what the server sends for evaluation
    inference(trainer, clients, payload, cstate)   -> Inference  client side: the model(s) it predicts
                                                               with and how their logits combine

Declarations (class attributes / methods): `params` (typed hyper-parameters; `eval_only=True` marks
those that change only inference), `client_state` (per-client state the runner keeps on the client
side: in memory, in checkpoints, in a Flower node's state), `upload()` (name -> TensorSpec of every
tensor a client sends; anything else is rejected), `predictions` (alternative predictions the
evaluation stores, for the report's headings).

The wire: messages hold fixed-shape rows in memory; `encode(kind, row)` / `decode(kind, wire)` say how
one client's row travels (default: as it is), and `wire_bytes(kind, rows)` counts it. The runner's
`bytes_down` / `bytes_up` are `wire_bytes('plan', ...)` / `wire_bytes('update', ...)`, in process and on
Flower alike, and the Flower codec sends the encoded rows (FedSub's sparse subnetworks).

`cstate` is the clients' own rows of the declared client state ({} when none is declared);
`client_update` returns the new rows in `Update.client_state` and never writes state by side effect.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, ClassVar

import numpy as np
import torch

from fedprism.errors import ConfigError
from fedprism.hparams import Param
from fedprism.registry import Registry
from fedprism.protocol import (ClientState, Context, EvalResult, Inference, Plan, Rows, TensorSpec, Trained,
                               Trainer, TrainJob, TrainSettings, Update, payload_bytes, train_together)

__all__ = ["Algorithm", "ClientState", "Context", "EvalResult", "Inference", "Plan", "REGISTRY", "TensorSpec",
           "Trained", "Trainer", "TrainJob", "TrainSettings", "Update", "register", "train_together",
           "train_update"]


def sgd_settings(ctx: Context, method: str, why: str) -> Any:
    """The run's training settings (`ctx.train`) for a method whose server or client step is derived from
    SGD steps (SCAFFOLD, FedNova, q-FFL): refuses another optimiser with `why` (ConfigError on `optimizer`)."""
    if ctx.train is None:
        raise ValueError(f"{method} needs the training settings (Context.train): {why}")
    if ctx.train.optimizer != "sgd":
        raise ConfigError("optimizer", ctx.train.optimizer, f"sgd: {why}")
    return ctx.train


def train_update(trainer: Trainer, job: TrainJob, rnd: int) -> Update:
    """Run `job` and wrap the result as the usual upload: the trained vectors as 'params'."""
    t = trainer.train(job, rnd)
    return Update(t.clients, {"params": t.params}, t.n_samples, {"train_loss": t.loss})


class Algorithm:
    """Base class. Subclasses set `name`, `params` and override the functions they need."""

    name: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    params: ClassVar[dict[str, Param]] = {}
    personalized: ClassVar[bool] = True   # False: one shared model (global acc computed once)
    #: per-client state that never leaves the client (name -> declaration)
    client_state: ClassVar[dict[str, ClientState]] = {}
    #: alternative predictions stored beside the headline metrics (name -> report row label), in report order
    predictions: ClassVar[dict[str, str]] = {}
    #: True when clients upload class prototypes: `privacy.epsilon` then plans one DP release per round
    #: (fedprism.privacy) and the method must release them through `fedproto.local_prototypes(..., ctx, rnd)`
    shares_prototypes: ClassVar[bool] = False
    #: why the method cannot run on Flower, where each node holds one client's data ("" = it can):
    #: `fedprism.flower.settings.check_flower_config` refuses it before anything starts
    simulation_only: ClassVar[str] = ""
    #: the server-state keys of the models the method averages from client rows (e.g. ("w",)). Declaring
    #: them gives the method the shared server-step options (`<name>.aggregation*`, the robust rule, and
    #: `<name>.server_*`, the server optimiser: `aggregation.SERVER_STEP_PARAMS`, added to `params`) and
    #: `self.server`, the `aggregation.ServerStep` composed from them, through which it averages
    averages: ClassVar[tuple[str, ...]] = ()
    #: the method's own parameters (`params` without the shared server-step options); set per class
    own_params: ClassVar[dict[str, Param]] = {}

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        from fedprism.algorithms.aggregation import compose_params
        compose_params(cls)

    @property
    def server(self):
        """The run's server step (`aggregation.ServerStep`): `server.average(x, w, sent)` with the robust
        rule of `<name>.aggregation`, `server.update(state, key, avg, rows)` with the server optimiser of
        `<name>.server_opt`, for the keys in `averages`. Composed from `self.hp` when asked for, so it
        always follows the method's parameters."""
        from fedprism.algorithms.aggregation import ServerStep
        if not self.averages:
            raise AttributeError(f"{type(self).__name__} declares no averaged models (`averages`), so it has no "
                                 "server step")
        return ServerStep(self.hp, tuple(self.averages), getattr(self.ctx, "dp", None), self._buffer_mask())

    def _buffer_mask(self) -> torch.Tensor | None:
        """bool over the averaged vector: True on the buffer section (running statistics, `fedprism.params`),
        which a server optimiser leaves at the plain average; None for a model without one. A method that
        averages a subset of the coordinates (`partial.PartialSharing`: the index tensor `shared`) gets the
        mask of that subset."""
        spec = getattr(self.ctx, "spec", None)
        if spec is None or not spec.buffer_names:
            return None
        mask = spec.trainable == 0
        shared = getattr(self, "shared", None)
        return mask[shared] if isinstance(shared, torch.Tensor) and shared.dim() == 1 else mask

    @property
    def own_cohort(self) -> bool:
        """True when `plan` replaces the runner's cohort by one the method draws itself (then only the
        default `selection=uniform` is allowed)."""
        return False

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
        if "server_opt" in cls.params:           # `auto` server steps (aggregation.normalise_server_opt)
            from fedprism.algorithms.aggregation import normalise_server_opt
            normalise_server_opt(out)
        cls.check_params(out)
        return out

    @classmethod
    def check_params(cls, hp: dict[str, Any]) -> None:
        """Cross-parameter checks (e.g. m <= K); raise ConfigError."""

    @classmethod
    def headline(cls, config: dict[str, Any]) -> str:
        """How a run of this configuration predicts (the report's heading of its headline numbers)."""
        return "prediction"

    @classmethod
    def eval_only(cls) -> frozenset[str]:
        """Parameters that change only inference: not part of a run's training identity."""
        return frozenset(k for k, p in cls.params.items() if p.eval_only)

    # -- declarations --------------------------------------------------------------------------
    def upload(self) -> dict[str, TensorSpec]:
        """Every tensor a client sends, per client (default: its trained parameter vector)."""
        return {"params": TensorSpec(("P",))}

    def setup_bytes(self) -> tuple[int, int]:
        """(down, up) bytes of a one-off exchange before round 0 that is not a round's payload (e.g. label
        counts every client reports once); the runner adds them to round 0's `bytes_down` / `bytes_up`."""
        return 0, 0

    def setup_records(self, state: dict[str, Any]) -> dict[str, Any]:
        """Records of a one-off setup before round 0 (e.g. a clustering of the clients made in
        `init_state`), stored with round 0 before `aggregate`'s records, whether or not round 0 has updates."""
        return {}

    # -- the wire --------------------------------------------------------------------------------
    #: the kinds of message a row belongs to: server -> client `plan`, client -> server `client_update`'s
    #: payload, server -> client `eval_payload`
    WIRE_KINDS: ClassVar[tuple[str, ...]] = ("plan", "update", "eval")

    def encode(self, kind: str, row: Rows) -> Rows:
        """One client's row ([1, ...] tensors) of a message of `kind` as it travels. Default: unchanged.
        A method with a compact encoding returns other [1, ...] tensors, and `decode` must give the row
        back exactly."""
        return row

    def decode(self, kind: str, wire: Rows) -> Rows:
        """The row `encode` made `wire` from; ValueError naming the field when `wire` is malformed."""
        return wire

    def wire_bytes(self, kind: str, rows: Rows) -> int:
        """Bytes of every client's row of a message of `kind` ([n, ...] tensors) as it travels (`encode`,
        element sizes as stored): the runner's `bytes_down` ('plan') and `bytes_up` ('update')."""
        if type(self).encode is Algorithm.encode:
            return payload_bytes(rows)
        n = len(next(iter(rows.values()))) if rows else 0
        return sum(payload_bytes(self.encode(kind, {k: v[i:i + 1] for k, v in rows.items()})) for i in range(n))

    # -- the round -------------------------------------------------------------------------------
    def init_state(self) -> dict[str, Any]:
        raise NotImplementedError

    def plan(self, state: dict[str, Any], rnd: int, clients: np.ndarray) -> Plan:
        raise NotImplementedError

    def client_update(self, plan: Plan, trainer: Trainer, rnd: int, cstate: Rows) -> Update:
        """Default: train the received 'params' with the experiment's loss and optimiser, upload them."""
        return train_update(trainer, TrainJob(plan.clients, plan.start), rnd)

    def aggregate(self, state: dict[str, Any], rnd: int, update: Update) -> dict[str, Any]:
        """The server step of round `rnd`: mutates `state`, returns the round's records. The runner calls it
        only with at least one accepted client (`runner.aggregate_records`): a round without updates leaves
        the server state as it is, so a method needs no guard for an empty update."""
        raise NotImplementedError

    def model_for(self, state: dict[str, Any], clients: np.ndarray) -> torch.Tensor:
        """The server's idea of each client's inference model (the default evaluation payload)."""
        raise NotImplementedError

    # -- evaluation --------------------------------------------------------------------------------
    def eval_payload(self, state: dict[str, Any], clients: np.ndarray) -> Rows:
        """What the server sends each client for its evaluation (default: its inference model)."""
        return {"params": self.model_for(state, clients)}

    def inference(self, trainer: Trainer, clients: np.ndarray, payload: Rows, cstate: Rows) -> Inference:
        """On the client side: the model(s) each client predicts with (default: the received one)."""
        return Inference({"model": payload["params"]})

    # -- evaluation options every method takes (`eval.finetune`, `data.unseen_clients`) -------------------
    def fresh_client_state(self, clients: np.ndarray) -> Rows:
        """The declared initial rows of the client state (`ClientState.initial`) for `clients`: the state
        of a client that has never trained."""
        return {k: d.initial(self.ctx, len(clients)) for k, d in self.client_state.items()}

    def newcomer_payload(self, state: dict[str, Any], clients: np.ndarray) -> Rows:
        """What the server sends `clients` that never took part in training (`data.unseen_clients`) for their
        evaluation. Default: `eval_payload`, i.e. what it sends any client whose per-client server state is
        still the initial one (a held-out client is never in a cohort, so its rows never changed): FedAvg's
        global model, IFCA's K models with no choice made yet."""
        return self.eval_payload(state, clients)

    def newcomer_inference(self, trainer: Trainer, clients: np.ndarray, payload: Rows, cstate: Rows) -> Inference:
        """On a newcomer's side: the model(s) it predicts with, given `newcomer_payload`'s rows and fresh
        client state (`fresh_client_state`). Default: `inference`, the method's own rule for a client that
        has never trained (IFCA: the lowest-loss cluster model on its training rows; Local: the initial
        model; a prototype method: the global prototypes). Override where a newcomer is treated otherwise."""
        return self.inference(trainer, clients, payload, cstate)

    def finetune_start(self, inference: Inference, payload: Rows, cstate: Rows) -> torch.Tensor:
        """[n, P]: the model each client fine-tunes under `eval.finetune` (the "+FT" prediction), given the
        inference it predicts with, the payload it received and its client state. Default: the client's
        inference model where it is one parametric model (`Inference.single`: one stream of logits, no
        combination, no alternative); a method whose prediction is not one model (several streams, prototypes
        on features) overrides this with the model it would send the client, or is refused: the default
        raises a ConfigError naming the method and the key (checked before training,
        `evaluate.check_finetune`)."""
        rows = inference.single
        if rows is None:
            raise ConfigError("eval.finetune", None, f"0 for method={self.name}: its prediction is not one "
                              f"parametric model (streams {', '.join(map(repr, inference.streams))}"
                              + (f", features {', '.join(map(repr, inference.features))}" if inference.features
                                 else "") + "), and it does not say which model a client would fine-tune "
                              "(Algorithm.finetune_start)")
        return rows

    def client_side_inference(self) -> bool:
        """True when inference needs the client (its state or its data): on Flower it runs on the nodes."""
        return bool(self.client_state) or type(self).inference is not Algorithm.inference

    def extra_models(self, state: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Extra shared models to score on the global test set (e.g. {'global': w_g})."""
        return {}

    # -- sizes the run layer bounds before anything is allocated (`fedprism.experiment.limits`) ----
    #    Each takes the method's resolved hyper-parameters `hp` (keys without the `<method>.` prefix).
    @classmethod
    def clusters(cls, hp: dict[str, Any]) -> int | None:
        """K of a configuration that trains K cluster models (its key is `<method>.k`), None when it trains
        none: K must not exceed the clients, and a round's cohort when `clusters_cohort`."""
        return None

    @classmethod
    def clusters_cohort(cls, hp: dict[str, Any]) -> bool:
        """True when the clustering runs on the clients of one round only, so that a cohort smaller than K
        can never be clustered (a clustering of fewer points than clusters is skipped, every round)."""
        return False

    @classmethod
    def cohort(cls, hp: dict[str, Any], clients: int, fraction: float) -> int:
        """Clients a round trains: floor(fraction x clients), at least 1 (`selection.cohort_size`); a method
        whose `plan` trains others (Local's `participation=all`) says how many."""
        from fedprism.selection import cohort_size

        return min(clients, cohort_size(clients, fraction))

    @classmethod
    def check_cohort(cls, hp: dict[str, Any], clients: int, cohort: int, fraction: float) -> None:
        """ConfigError for hyper-parameters that cannot work with `cohort` of `clients` clients a round (CFL's
        split test with one client a round); known before any data is read."""

    @classmethod
    def server_models(cls, hp: dict[str, Any], clients: int, cohort: int) -> dict[str, int]:
        """The models of P float32 parameters the server holds at once beyond the global one, working copies
        included, by the key that sets their number: `{"k": 3 * K}` for K cluster models, `{"clients": N}`
        for one model per client kept at the server. The client state (`client_state`) is counted from its
        declaration and not here. Default: none."""
        return {}

    # -- the method's own parts beyond the round: a method package's companion modules --------------
    @classmethod
    def companion(cls, part: str) -> ModuleType | None:
        """The module `part` beside the method: `<package>.<part>` of the first class of the method's
        resolution order that is a package named like its method (`fedprism/algorithms/fedprism_dual/`
        holds `gate.py` and `report.py`), None when there is none. A method grows a run-time extra (a
        learned gate, a report section) as a file of its package without a line of its class changing,
        so the code fingerprint of its stored runs (`fedprism.experiment.provenance`) stays; a method of
        one file overrides the hooks below instead."""
        for klass in cls.__mro__:
            module = sys.modules.get(getattr(klass, "__module__", ""))
            name = getattr(klass, "name", "")
            if (module is None or not hasattr(module, "__path__") or not name
                    or module.__name__.rsplit(".", 1)[-1] != name):
                continue
            if importlib.util.find_spec(f"{module.__name__}.{part}") is None:
                return None
            return importlib.import_module(f"{module.__name__}.{part}")
        return None

    @classmethod
    def learned_gate(cls) -> Any:
        """The learned routing gate over this method's inference streams (`eval.gate=learned`), or None
        when its inference has no two streams to route between. An object (a module) with
        `check_config(config)` (ConfigError for keys the gate cannot work with), `check_memory(fed,
        memory)` (ConfigError before training when its rows would not fit) and `metrics(experiment,
        state)` (its candidate routings' metrics at the final evaluation). Default: the method package's
        `gate` companion."""
        return cls.companion("gate")

    @classmethod
    def report_sections(cls, store: Any, groups: dict[str, dict[str, list[dict]]]) -> list[str]:
        """Markdown lines of the report sections that only this method's runs have (after the tables every
        run has). `store`: the results store, read-only; `groups`: setting -> row label -> runs (dicts
        with `run_id`, `config`, `final`), this method's runs only. Default: `sections(store, groups)` of
        the method package's `report` companion, else none."""
        part = cls.companion("report")
        return part.sections(store, groups) if part is not None and hasattr(part, "sections") else []

    @classmethod
    def report_figures(cls, store: Any, run: dict, label: str, setting: str,
                       stem: str) -> list[tuple[str, str, Callable[[Path], list[Path]]]]:
        """Figures of one run of this method beyond the report's own: (file name, caption, draw) where
        `draw(path)` writes the figure to `path` and returns the paths written. `stem` ends every name the
        report gives a run's figure (`_<method>_<label>_<setting>_seed<seed>.png`). Default: `figures(...)`
        of the method package's `report` companion, else none."""
        part = cls.companion("report")
        if part is None or not hasattr(part, "figures"):
            return []
        return part.figures(store, run, label, setting, stem)

    @classmethod
    def search_space(cls) -> dict[str, Any]:
        """Where `fedprism tune` searches this method's own keys: `{"<method>.<key>": Space}` from each
        param's `space`, then the built-in table `algorithms/spaces.py` (the built-in methods declare
        theirs there, so that their files, which identify their stored runs, stay as they are). The
        experiment keys with a space (`lr`) and a study file's overrides are added by the tuner."""
        from fedprism.algorithms.spaces import SPACES

        out = {f"{cls.name}.{k}": p.space for k, p in cls.params.items() if getattr(p, "space", None) is not None}
        table = SPACES.get(cls.name, {}) if cls.__module__ == f"fedprism.algorithms.{cls.name}" or \
            cls.__module__.startswith(f"fedprism.algorithms.{cls.name}.") else {}
        out.update({f"{cls.name}.{k}": sp for k, sp in table.items() if k in cls.params})
        return out

    #: True when the server step reads the uploads only through their weighted mean, sum_k a_k x_k / sum_k a_k
    #: with a_k = n_k (`<method>.weighting=samples`) or 1 (`uniform`), at `<method>.aggregation=mean`: what
    #: secure aggregation gives the server (Flower's SecAgg+) and what FedBuff's buffered step averages
    #: (docs/systems.md). A method declares it here; the built-ins that qualify are listed in
    #: `SUM_ONLY_BUILTINS` below, so that their files, which identify their stored runs, stay as they are.
    sums_uploads: ClassVar[bool] = False

    @classmethod
    def sum_weighting(cls, hp: dict[str, Any], why: str = "secure aggregation") -> str:
        """The weighting (`samples` or `uniform`) whose weighted mean of the uploads is all this method's
        server step needs under the parameters `hp`; a ConfigError saying why not otherwise (`why`: what asks,
        for the message): a method that reads individual uploads (clusters, similarities, a robust rule)."""
        builtin = cls.name in SUM_ONLY_BUILTINS and (cls.__module__ == f"fedprism.algorithms.{cls.name}")
        if not (cls.sums_uploads or builtin):
            raise ConfigError("method", cls.name, f"a method whose server needs only the sum of the uploads for "
                              f"{why} ({', '.join(SUM_ONLY_BUILTINS)}); {cls.name}'s server step reads each "
                              "client's upload (it does not declare Algorithm.sums_uploads)")
        rule = hp.get("aggregation", "mean")
        if rule != "mean":
            raise ConfigError(f"{cls.name}.aggregation", rule, f"mean for {why}: the robust rule {rule} looks at "
                              "every upload, and the server sees only their sum")
        weighting = hp.get("weighting", "samples")
        if weighting not in ("samples", "uniform"):
            raise ConfigError(f"{cls.name}.weighting", weighting, f"samples or uniform for {why}")
        return weighting

    @classmethod
    def partition_study(cls) -> Callable[..., list[Path]] | None:
        """The method's study of partitions alone, without training (`fedprism report --partition-study
        DATASET`): `write(dataset, out, seeds=..., plots=...)` writes it under the folder `out` and returns
        the paths written (a bad seed is a ConfigError before anything is written); None when the method
        has none. Default: `write_partition_study` of the method package's `study` companion, else None."""
        part = cls.companion("study")
        return getattr(part, "write_partition_study", None) if part is not None else None


def _check_method(name: str, cls: Any) -> None:
    """What `register` refuses: anything but an Algorithm subclass, a class registered under a name other
    than its own, a params entry that is not a Param (each would fail only once a run starts)."""
    if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
        raise TypeError(f"register() takes a subclass of fedprism.Algorithm, not {cls!r}")
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no `name`")
    if not isinstance(cls.name, str) or "." in cls.name or any(c.isspace() for c in cls.name):
        raise ValueError(f"{cls.__name__}.name = {cls.name!r}: a method name is a string without dots or "
                         "spaces (its keys are `name.key`)")
    if cls.name != name:
        raise ValueError(f"{cls.__name__}.name = {cls.name!r} registered as {name!r}: a method is registered "
                         "under its own name (configurations and stored runs name it)")
    for key, p in cls.params.items():
        if not isinstance(p, Param):
            raise TypeError(f"{cls.__name__}.params[{key!r}] is {p!r}: each parameter is a "
                            "fedprism.hparams.Param")


#: the built-in methods whose server step reads the uploads only through their weighted mean (the
#: `Algorithm.sums_uploads` declaration for methods whose files identify stored runs): FedAvg and the methods
#: that inherit its server step unchanged (FedProx, MOON, Ditto, APFL, Per-FedAvg) and pFedMe, whose step
#: mixes the mean into the model. Not FedDyn (its h divides by the cohort size), SCAFFOLD (control variates),
#: FedNova / q-FFL (per-client normalisers), nor any clustering, similarity or prototype method.
SUM_ONLY_BUILTINS = ("fedavg", "fedprox", "moon", "ditto", "apfl", "perfedavg", "pfedme")

#: modules of `fedprism.algorithms` that hold shared code, not a method (every other module `x.py` holds
#: the method `x` and registers it when imported; `fedprism methods` lists them without importing them)
SHARED_MODULES = ("base", "aggregation", "partial", "spaces")

#: name -> method class. Built-in methods are imported when first named (`REGISTRY["fedavg"]`), plugins
#: come through the `fedprism.methods` entry-point group or `register`.
REGISTRY: Registry[type[Algorithm]] = Registry("method", "fedprism.algorithms", skip=SHARED_MODULES,
                                               check=_check_method)


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Add a method to the registry under `cls.name` (usable by `fedprism run`, sweeps, reports, Flower).

    Registering a name again replaces the earlier class (a notebook cell run twice), except a built-in
    method's name: a plugin cannot silently stand in for `fedavg`. A reload of the built-in's own module
    (IPython's autoreload) replaces it."""
    if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
        raise TypeError(f"register() takes a subclass of fedprism.Algorithm, not {cls!r}")
    _check_method(cls.name, cls)
    return REGISTRY.register(cls, name=cls.name)
