"""The round loop: config -> federation -> algorithm + engine -> rounds -> store (docs/architecture.md).

`Experiment.run` is a short loop over `Experiment.round`: the cohort's work and the server step
(`train_round`), the evaluation when due, the round's counts, the store. What a run does around that
(class drift, evaluation sampling, the learned gate, the `scalars=DIR` files, checkpoints, progress) are
callbacks (experiment/callbacks.py, experiment/scalars.py), and the objects it runs (federation, model,
context, engine, algorithm, callbacks) come from the composition root, experiment/build.py, whose
factories are re-exported here.

Resumable: after every round the algorithm's server state and the clients' own state are checkpointed
beside the database, and every random stream is a pure function of (seed, round, client, stream name),
so a resumed run reaches exactly the numbers of an uninterrupted one.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from fedprism.algorithms.base import Algorithm
from fedprism.errors import ConfigError
from fedprism.experiment.build import (_check_logits, _check_plugin_model, _free_disk, build_engine,  # noqa: F401
                                       check_runnable, drift_schedule, feature_dim, local_config, make_algorithm,
                                       make_context, make_model, make_selector, privacy_plan, rescore_callbacks,
                                       round_callbacks, warn_if_nothing_personal)
from fedprism.experiment.callbacks import Callback, Loop, Round
from fedprism.experiment.checkpoint import CheckpointRefused
from fedprism.experiment.clientstore import ClientStore, StoreMismatch, make_store
from fedprism.experiment.config import Config, prefer_stored
from fedprism.experiment.evaluate import Evaluator, check_finetune, sample_eval_clients, summarize
from fedprism.experiment.federation import build_federation, resolve_model_name, unseen_mask  # noqa: F401
from fedprism.experiment.failures import stop_on_failure
from fedprism.experiment.fresh import settle_stored
from fedprism.experiment.provenance import capture, set_threads
from fedprism.experiment.result import RunResult, divergence_note  # noqa: F401 (divergence_note: public here)
from fedprism.experiment.store import Store, StoreError
from fedprism.experiment.systems_run import final_system_metrics, system_run
from fedprism.federation import Federation
from fedprism.hparams import plain
from fedprism.privacy import LABEL_RELEASES, Privacy
from fedprism.attacks import check_attack
from fedprism.compression import client_work
from fedprism.protocol import Plan, TensorSpec, Update
from fedprism.selection import Selector, cohort_size, sample_clients  # noqa: F401 (sample_clients: public here)


def validate_update(update: Update, upload: dict[str, TensorSpec]) -> tuple[Update, dict[int, str]]:
    """Reject (never stop the round for) client rows whose payload does not match the declared upload:
    a missing or unexpected tensor, a wrong shape or dtype, NaN/Inf, out-of-range indices, or a sample
    count that is not a finite non-negative number."""
    n = len(update.clients)
    bad: dict[int, str] = {}
    extra = sorted(set(update.payload) - set(upload))
    missing = sorted(set(upload) - set(update.payload))
    for k in update.payload:
        v = update.payload[k]
        if not isinstance(v, torch.Tensor) or v.dim() == 0 or v.shape[0] != n:
            missing.append(k)
    if extra or missing:
        why = "; ".join([f"unexpected tensor {k!r}" for k in extra] + [f"missing tensor {k!r}" for k in missing])
        return update.select(np.zeros(n, bool)), {int(c): why for c in update.clients}
    ns = update.n_samples
    for i, c in enumerate(update.clients):
        for k, spec in upload.items():
            why = spec.problem(k, update.payload[k][i])
            if why is not None:
                bad[int(c)] = why
                break
        else:
            if not (math.isfinite(float(ns[i])) and float(ns[i]) >= 0):
                bad[int(c)] = f"n_samples: {float(ns[i])!r} is not a finite number >= 0"
            elif float(ns[i]) == 0:             # as a Flower server refuses it (flower.server)
                bad[int(c)] = "n_samples: 0 samples: an update without weight"
    if not bad:
        return update, bad
    keep = np.array([int(c) not in bad for c in update.clients])
    return update.select(keep), bad


class MethodError(RuntimeError):
    """A method's `client_update` returned what no client reply can be, or raised for every client of a
    round in process: a bug of the method, reported with what was wrong (and the traceback)."""


def malformed_round(rejected: dict[int, str], plan: Plan, rnd: int, method: str) -> None:
    """In process, every client of a round of two or more rejected for the form of its reply (a wrong shape
    or dtype, a missing tensor, a sample count that is negative or no number), is the method's bug:
    `MethodError` naming the first reason (it was stored as 'finished' and 'diverged'). A round of one
    client, non-finite values (training that diverged) and replies of 0 samples (no weight, as a Flower
    server refuses them) stay per-client rejections."""
    if len(plan.clients) < 2 or len(rejected) < len(plan.clients):
        return
    if any("non-finite" in why or "0 samples" in why for why in rejected.values()):
        return
    first = int(plan.clients[0])
    raise MethodError(f"every client of round {rnd + 1} sent {method} a reply no round can use; client "
                      f"{first}: {rejected.get(first, next(iter(rejected.values())))}")


def aggregate_records(algo: Algorithm, state: dict, rnd: int, update: Update) -> dict:
    """The server step of round `rnd` and its records: at round 0 `algo.setup_records(state)` first, then
    `algo.aggregate(...)`'s records (None: none). A `MethodError` names the hook when either returns
    something else (a list would fail later, deep in the store).

    The runner's promise to every method: `aggregate` is never called with an empty update. A round in
    which no client's reply was accepted (all failed, were rejected, or nobody was sampled) leaves the
    server state as it is, so no method needs a guard of its own."""
    recs = _records(algo, "setup_records", algo.setup_records(state)) if rnd == 0 else {}
    dp = getattr(algo.ctx, "dp", None)
    if dp is not None:                   # DP-FedAvg counts this round's noisy averages (privacy.UpdateDP)
        dp.begin_round(rnd)
    if len(update.clients) == 0:
        return recs
    return {**recs, **_records(algo, "aggregate", algo.aggregate(state, rnd, update))}


def _records(algo: Algorithm, hook: str, recs: object) -> dict:
    if recs is None:
        return {}
    if not isinstance(recs, dict) or not all(isinstance(k, str) for k in recs):
        raise MethodError(f"{type(algo).__name__}.{hook} returned {type(recs).__name__}: it returns a "
                          "dict of the round's records (str keys) or None")
    return recs


def _shape_checks(hook: str, kind: type, obj: object) -> tuple[Callable[[str], None], list[int]]:
    """What `check_plan` and `check_reply` share: `bad(what)` raises the `MethodError` naming the hook;
    obj must be a `kind` whose `clients` are a 1-D integer numpy array, each client once."""
    def bad(what: str) -> None:
        raise MethodError(f"{hook} returned {what}")

    if not isinstance(obj, kind):
        bad(f"a {type(obj).__name__}, not a fedprism.protocol.{kind.__name__}")
    c = obj.clients
    if not isinstance(c, np.ndarray) or c.ndim != 1 or (c.size and not np.issubdtype(c.dtype, np.integer)):
        bad(f"clients {c!r}: expected a 1-D integer numpy array of client indices")
    ids = c.tolist()
    if len(set(ids)) != len(ids):
        bad(f"clients {ids[:10]} with repeats: each client appears once")
    return bad, ids


def _one_row_each(bad: Callable[[str], None], part: str, rows: object, n: int) -> None:
    if not isinstance(rows, dict):
        bad(f"{part} of type {type(rows).__name__}: expected a dict of tensors")
    for k, v in rows.items():
        if not isinstance(v, torch.Tensor) or v.dim() == 0 or v.shape[0] != n:
            shape = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            bad(f"{part}[{k!r}] of {shape} for {n} client(s): expected a tensor with one row per client")


def check_plan(plan: object, num_clients: int, method: str) -> Plan:
    """The shape of a `Plan` before any client works on it: a Plan of distinct client indices in
    0 .. num_clients - 1 (a 1-D integer numpy array) with one row of every payload tensor per client. A
    plan may hold clients the selector did not sample (FedClust's one-shot first round plans every client),
    but a negative index would silently train another client's data."""
    bad, ids = _shape_checks(f"{method}.plan", Plan, plan)
    outside = [i for i in ids if not 0 <= i < num_clients]
    if outside:
        bad(f"clients {outside[:5]}: the federation's clients are 0..{num_clients - 1}")
    _one_row_each(bad, "payload", plan.payload, len(ids))
    return plan


def check_reply(update: object, plan: Plan, method: str) -> None:
    """The shape of an `Update` before anything reads it: an Update, of clients of the plan (each once),
    with one n_samples value and one row of every payload, metric and client-state tensor per client.
    Rows that fail their declared upload spec are rejected per client later (`validate_update`)."""
    bad, ids = _shape_checks(f"{method}.client_update", Update, update)
    stray = sorted(set(ids) - set(plan.clients.tolist()))
    if stray:
        bad(f"clients {stray[:5]} that the round's plan does not hold")
    n = len(ids)
    if not isinstance(update.n_samples, torch.Tensor) or tuple(update.n_samples.shape) != (n,):
        bad(f"n_samples {update.n_samples!r}: expected a tensor of one value per client ({n})")
    for part in ("payload", "metrics", "client_state"):
        _one_row_each(bad, part, getattr(update, part), n)


def receive(update: Update | None, plan: Plan, clients: ClientStore | None, upload: dict[str, TensorSpec],
            method: str = "the method", compress: Any = None) -> tuple[Update, dict[int, str]]:
    """What the server does with the clients' replies before aggregating: the clients keep their new
    state (the simulator writes it to `clients`), the rows each client was sent are attached
    (`Update.sent`), and rows that do not match the declared upload are rejected. A client whose new state
    holds NaN/Inf is rejected whole: its state stays as it was, as a Flower node keeps it (`node.train`).
    No reply at all (`update` None) is an empty update. Under `compress` (fedprism.compression) the rows
    travel encoded: they are checked against the encoded upload (`Compressor.wire_spec`) and decoded, a row
    that fails either is rejected, and the decoded rows are checked as any upload is."""
    if update is None:
        return Update(plan.clients[:0], sent=plan.subset(np.zeros(0, dtype=np.int64)).payload), {}
    check_reply(update, plan, method)
    diverged = update.nonfinite_state()            # these clients keep their state; their upload is unused
    if diverged:
        update = update.select(np.array([int(c) not in diverged for c in update.clients], dtype=bool))
    if clients is not None and update.client_state:
        clients.write(update.clients, update.client_state)
    pos = {int(c): i for i, c in enumerate(plan.clients)}
    update.sent = plan.subset(np.array([pos[int(c)] for c in update.clients], dtype=np.int64)).payload
    undecoded: dict[int, str] = {}
    if compress is not None and compress.encoded(update.payload):   # (a Flower server decodes in `trust`)
        update, undecoded = validate_update(update, compress.wire_spec(upload))
        update, failed = compress.decode_update(update, update.sent, upload)
        undecoded.update(failed)
    kept, bad = validate_update(update, upload)
    return kept, {**diverged, **undecoded, **bad}


class Simulator:
    """An algorithm driven round by round in process, without a store: for notebooks and tests.

        sim = Simulator(algo, engine)
        plan, update, records = sim.round(rnd, clients)
        sim.state, sim.clients.data, sim.inference(), sim.evaluate("local")
    """

    def __init__(self, algo: Algorithm, engine, state: dict | None = None, storage: str = "memory",
                 folder: str | None = None):
        self.algo, self.engine = algo, engine
        self.state = algo.init_state() if state is None else state
        if storage == "mmap" and folder is None and algo.client_state:
            import shutil
            import tempfile
            import weakref
            folder = tempfile.mkdtemp(prefix="fedprism-rows-")
            weakref.finalize(self, shutil.rmtree, folder, True)
        self.clients = make_store(storage, algo.client_state, algo.ctx, folder)
        self.upload = {k: spec.resolve(algo.ctx) for k, spec in algo.upload().items()}

    def round(self, rnd: int, clients: np.ndarray) -> tuple[Plan, Update, dict]:
        c, n = np.asarray(clients), self.algo.ctx.num_clients
        if c.ndim != 1 or (c.size and (not np.issubdtype(c.dtype, np.integer) or c.min() < 0 or c.max() >= n
                                       or len(np.unique(c)) != len(c))):
            raise ValueError(f"Simulator.round: clients {clients!r} are not distinct client indices in "
                             f"0..{n - 1}")
        plan = check_plan(self.algo.plan(self.state, rnd, c), n, type(self.algo).__name__)
        update, failed = _local_work(self.algo, plan, self.engine, rnd, self.clients)
        update, rejected = receive(update, plan, self.clients, self.upload, type(self.algo).__name__,
                                   self.algo.ctx.compress)
        update.rejected = {**failed, **rejected}
        return plan, update, aggregate_records(self.algo, self.state, rnd, update)

    def inference(self, clients: np.ndarray | None = None):
        c = np.arange(self.algo.ctx.num_clients) if clients is None else np.asarray(clients)
        return self.algo.inference(self.engine, c, self.algo.eval_payload(self.state, c), self.clients.rows(c))

    def evaluate(self, split: str, clients: np.ndarray | None = None):
        from fedprism.experiment.evaluate import StreamScorer, score_inference

        c = np.arange(self.algo.ctx.num_clients) if clients is None else np.asarray(clients)
        return score_inference(self.engine, StreamScorer(self.engine, self.algo.ctx.num_clients),
                               self.inference(c), c, split)


def _local_work(algo: Algorithm, plan: Plan, engine, rnd: int, clients: ClientStore | None,
                errors: dict[int, Exception] | None = None) -> tuple[Update | None, dict[int, str]]:
    """Run the cohort; if it fails, retry client by client and record the ones that fail (their
    exceptions, tracebacks included, into `errors` when given)."""
    try:
        return client_work(algo, plan, engine, rnd, clients.rows(plan.clients) if clients else {}), {}
    except Exception as e:  # noqa: BLE001 - a client failure must not stop the run
        if len(plan.clients) == 1:
            if errors is not None:
                errors[int(plan.clients[0])] = e
            return None, {int(plan.clients[0]): f"{type(e).__name__}: {e}"}
    parts, failed = [], {}
    for r in range(len(plan.clients)):
        up, f = _local_work(algo, plan.subset(np.array([r])), engine, rnd, clients, errors)
        failed.update(f)
        if up is not None:
            parts.append(up)
    return (Update.concat(parts) if parts else None), failed


def privacy_metrics(cfg: Config, privacy: Privacy | None) -> dict[str, float]:
    """What the run spent: epsilon of the most-sampled client's releases (its label counts once, its
    prototypes each round it was sampled, for a prototype method), at the run's delta."""
    if privacy is None:
        return {}
    k = 0
    if privacy.releases > LABEL_RELEASES and cfg.get("selection", "uniform") != "uniform":
        k = cfg["rounds"]                          # adaptive cohorts: the worst case, every round
    elif privacy.releases > LABEL_RELEASES:
        n = cfg["clients"]
        times = np.zeros(n, dtype=np.int64)
        held = unseen_mask(cfg)                    # `data.unseen_clients`: cohorts of the seen clients
        seen = np.arange(n) if held is None else np.flatnonzero(~held)
        for rnd in range(cfg["rounds"]):
            times[seen[sample_clients(cfg["seed"], rnd, len(seen), cfg["fraction"])]] += 1
        k = int(times.max())
    return {"dp_epsilon": privacy.spent(LABEL_RELEASES + k), "dp_delta": privacy.delta,
            "dp_noise_multiplier": privacy.z, "dp_target_epsilon": privacy.epsilon}


def update_privacy_metrics(cfg: Config, history: list[dict]) -> dict[str, float]:
    """DP-FedAvg's final metrics (`dp.clip` > 0): the epsilon spent over the whole run (the last round's
    `dpfedavg_epsilon`; absent when infinite, `dp.noise_multiplier=0`), its delta, the noise multiplier, the
    clip and the sampling rate."""
    out: dict[str, float] = {}
    if cfg.get("dp.clip", 0.0) > 0:
        out.update({"dpfedavg_delta": cfg["dp.target_delta"], "dpfedavg_noise_multiplier": cfg["dp.noise_multiplier"],
                    "dpfedavg_clip": cfg["dp.clip"]})
        qs = [h["dpfedavg_q"] for h in history if "dpfedavg_q" in h]
        if qs:
            out["dpfedavg_q"] = min(qs)
        eps = [h["dpfedavg_epsilon"] for h in history if "dpfedavg_epsilon" in h]
        if eps and cfg["dp.noise_multiplier"] > 0:
            out["dpfedavg_epsilon"] = eps[-1]
    return out


def local_dp_metrics(cfg: Config, history: list[dict]) -> dict[str, float]:
    """Local DP-SGD's final metrics (`dp.local=dpsgd`): the epsilon spent by the clients after the last round
    (`dpsgd_epsilon_max`, `dpsgd_epsilon_mean`; absent when infinite, `dp.local_noise=0`), the delta, the
    noise multiplier, the clip, the sampling rates' range and the steps of the whole run."""
    if cfg.get("dp.local", "none") == "none":
        return {}
    out = {"dpsgd_delta": cfg["dp.local_delta"], "dpsgd_noise_multiplier": cfg["dp.local_noise"],
           "dpsgd_clip": cfg["dp.local_clip"], "dpsgd_steps": float(sum(h.get("dpsgd_steps", 0) for h in history))}
    last = history[-1] if history else {}
    out.update({k: last[k] for k in ("dpsgd_epsilon_max", "dpsgd_epsilon_mean", "dpsgd_q_min", "dpsgd_q_max")
                if k in last})
    return out


class Experiment:
    """One configured run. `run()` executes or resumes it and stores everything.

    `run()` uses only `cfg`, `store`, `sweep`, `progress`, `run_id`, `ctx`, `engine` (any Trainer),
    `algo`, `clients` (the simulator's client-side state, None when clients hold it themselves) and
    `upload`, plus the hooks `local_work`, `extra_records` and `evaluate_round`: the Flower ServerApp
    (`fedprism.flower`) subclasses it with remote clients and no data on the server.
    """

    #: whether this run's final state may be re-scored for, and taken from, runs of the same training
    #: identity (`rescore_source`). A Flower run trains on its nodes, and what they send back is theirs to
    #: say: it neither lends its final state to an in-process run nor takes one from it.
    shares_final = True
    #: whether the replies come from this process's own `client_update`, so a round whose every reply is
    #: malformed is the method's bug (`malformed_round`); a Flower node's reply is the node's to answer for
    trusts_clients = True

    def __init__(self, cfg: Config, store: Store, fed: Federation | None = None, progress: bool = False,
                 sweep: str | None = None):
        if not isinstance(cfg, Config):
            raise TypeError(f"Experiment: cfg is a {type(cfg).__name__}; pass a resolved configuration, "
                            "fedprism.config(...) or fedprism.experiment.config.resolve(dict)")
        if not isinstance(store, Store):
            raise TypeError(f"Experiment: store is a {type(store).__name__}; pass a "
                            "fedprism.experiment.store.Store (Store(path) opens or creates one)")
        if sweep is not None and not isinstance(sweep, str):
            raise TypeError(f"Experiment: sweep = {sweep!r}; a sweep's name (str) or None")
        cfg = prefer_stored(cfg, store)       # `auto` kernels: a stored run with PyTorch's is this run
        self.cfg, self.store, self.sweep = cfg, store, sweep
        self.progress = progress
        self.run_id = cfg.run_id
        self.fed = fed if fed is not None else build_federation(cfg)
        self.model = make_model(cfg, self.fed.input_shape, self.fed.num_classes, self.fed.vocab_size)
        check_runnable(cfg, self.fed, sum(p.numel() for p in self.model.parameters()), store.path)
        self.ctx = make_context(cfg, self.model, self.fed.n_train, self.fed.label_hist())
        self.engine = build_engine(cfg, self.fed, self.model, self.ctx)
        self.algo: Algorithm = make_algorithm(cfg, self.ctx, self.fed.input_shape)
        warn_if_nothing_personal(cfg, self.algo, self.fed.input_shape)
        self.clients: ClientStore | None = self.client_store()
        self.upload = {k: spec.resolve(self.ctx) for k, spec in self.algo.upload().items()}
        self.drift = drift_schedule(cfg, self.fed)
        self._drifted = None
        #: `data.unseen_clients`: [N] bool of the held-out clients (None: off); they are never in a plan
        self.unseen = unseen_mask(cfg)
        #: `system.*`: availability, speeds, deadline, FedBuff (experiment/systems_run.py); None: off
        self.system = system_run(cfg, self.ctx, self.algo)
        if cfg.get("eval.finetune", 0):          # a method that cannot say what it fine-tunes: refused now
            check_finetune(self.algo, self.engine, self.initial_layout(), cfg["eval.finetune"])
        if self.ctx.attack is not None:          # a method whose upload holds no model to poison: refused now
            check_attack(self.algo, self.initial_layout(), cfg["attack.fraction"])

    def client_store(self) -> ClientStore:
        """The simulator's store of the clients' own state (`state.storage`; methods without client
        state keep the empty memory store, whatever the key says)."""
        return make_store(self.cfg.get("state.storage", "memory"), self.algo.client_state, self.ctx,
                          self.store.rows_dir(self.run_id))

    #: how the entry point that built this run says to run it again when a finished run of other code
    #: is stored under its id (`fedprism.experiment.fresh`); None: `fresh_fix()`'s default
    fix: str | None = None

    def fresh_fix(self) -> str:
        """The way to run this run again under the current code, for a `ProvenanceMismatch`."""
        from fedprism.experiment.fresh import default_fix

        return self.fix or default_fix(self)

    def forget_stored(self) -> bool:
        """`--fresh`: drop what the store holds of this run (rounds, rows, checkpoint) so that `run()`
        starts it again; False when it holds nothing. Called once the run is built, so a configuration or
        data that cannot run loses nothing; the run's lock is taken first, so a run that another process
        is executing is refused (`RunBusyError`) and kept."""
        held = self.store.run(self.run_id) is not None
        if held:
            self.store.lock(self.run_id)
            self.store.forget(self.run_id)
            self.clients = self.client_store()      # its row files (state.storage=mmap) went with the run
        # the final state kept for this training identity goes too: `--fresh` trains again (a kept state
        # that cannot be used, `CheckpointRefused`, is cleared this way, as a checkpoint is)
        dropped = self.shares_final and self.store.drop_final(self.cfg.train_id)
        return held or dropped

    def eval_sample(self, rnd: int) -> np.ndarray | None:
        """The clients scored at round `rnd` under `eval.clients` (None: every client; always at the final
        round)."""
        k, N = int(self.cfg.get("eval.clients", 0) or 0), self.ctx.num_clients
        if k == 0 or k >= N or rnd == self.cfg["rounds"] - 1:
            return None
        return sample_eval_clients(self.cfg["seed"], rnd, N, k)

    def apply_drift(self, rnd: int, evaluator: Evaluator | None) -> int:
        """Give the engine round `rnd`'s local data under `drift.*` (fedprism.data.drift; a Flower node
        applies the same `DriftedData` to its own slice); the evaluator's per-client scores are dropped
        when the data change. Returns the number of absent (client, class) pairs (0 without drift)."""
        schedule = getattr(self, "drift", None)
        if schedule is None:
            return 0
        from fedprism.data.drift import DriftedData
        if getattr(self, "_drifted", None) is None or self._drifted.schedule is not schedule:
            self._drifted = DriftedData(schedule, self.fed)
        if self._drifted.apply(self.engine, rnd) and evaluator is not None:
            evaluator.forget()
        return schedule.absent(rnd)

    # -- hooks (overridden by the Flower ServerApp) -------------------------------------------------
    def local_work(self, plan: Plan, rnd: int) -> tuple[Update | None, dict[int, str]]:
        """The sampled clients' work: (update of the clients that succeeded, failed client -> reason).

        A client that raises is recorded and the round goes on without it. When every client of a
        round of two or more raises, in process that is the method's bug, not the clients' bad luck:
        the run stops with a `MethodError` chained to the first client's exception (it was stored as
        'finished' with a note about non-finite values). A round of one client cannot tell the two
        apart and records the failure."""
        errors: dict[int, Exception] = {}
        update, failed = _local_work(self.algo, plan, self.engine, rnd, self.clients, errors)
        if update is None and len(plan.clients) > 1 and len(errors) == len(plan.clients):
            first = int(plan.clients[0])
            raise MethodError(f"every client of round {rnd + 1} raised in {type(self.algo).__name__}"
                              f".client_update (client {first}: {failed[first]})") from errors[first]
        return update, failed

    def extra_records(self, rnd: int) -> list[tuple[str, int | None, Any]]:
        """Further (kind, client, data) records to store with round `rnd`."""
        return []

    def partition_records(self) -> list[tuple[str, int | None, Any]]:
        """Per-client facts of the partition, stored with round 0: each client's domain under `domain_mix`
        (kind `client_domain`), from which the report computes per-domain accuracy."""
        fed = getattr(self, "fed", None)
        doms = (fed.meta if fed is not None else {}).get("client_domains") or []
        return [("client_domain", int(c), {"domain": int(d)}) for c, d in enumerate(doms)]

    def evaluate_round(self, evaluator: Evaluator, state: dict, clients: np.ndarray | None = None
                       ) -> tuple[dict, list[tuple]]:
        """Round metrics and per-client rows of one evaluation (of `clients`; default every client)."""
        t_eval = time.time()
        scores = evaluator(self.algo, state, self.clients if self.clients is not None else {}, clients)
        return self.round_metrics(scores, state, t_eval)

    def round_metrics(self, scores, state: dict, t_eval: float) -> tuple[dict, list[tuple]]:
        """Round metrics (summary, extra models on the global test set, timing) and per-client rows."""
        metrics = summarize(scores)
        for name, w in self.algo.extra_models(state).items():
            r = self.engine.evaluate(w.unsqueeze(0), np.array([0]), "global")
            metrics[f"{name}_model_acc"] = float(r.accuracy[0])
        metrics["eval_s"] = time.time() - t_eval
        metrics["models_evaluated"] = scores.evaluated
        if len(scores.clients) < self.ctx.num_clients:          # `eval.clients`: a sampled round
            metrics["eval_clients"] = len(scores.clients)
        client_rows = [(int(c), scores.local_acc[j], scores.local_loss[j], scores.global_acc[j],
                        int(scores.n_test[j]), scores.local_f1[j]) for j, c in enumerate(scores.clients)]
        return metrics, client_rows

    def gate(self, state: dict, metrics: dict) -> dict:
        """`eval.gate=learned`: the learned gate's candidate routings at the final evaluation
        (the method's `learned_gate`); its time goes into the round's `eval_s` and `gate_s`."""
        if self.cfg["eval.gate"] == "none":
            return {}
        t = time.time()
        out = dict(type(self.algo).learned_gate().metrics(self, state))
        out["gate_s"] = time.time() - t
        out["eval_s"] = metrics.get("eval_s", 0.0) + out["gate_s"]
        return out

    def initial_state(self) -> dict:
        """The algorithm's server state at round 0."""
        return self.algo.init_state()

    def evaluator(self) -> Evaluator:
        """The run's Evaluator: local and global test splits, plus the validation splits the config asks for."""
        validation = tuple(s for s, on in (("val", self.cfg["data.val_fraction"] > 0),
                                           ("global_val", self.cfg["data.global_val"] > 0)) if on)
        return Evaluator(self.engine, self.ctx.num_clients, self.cfg["eval.global"], validation,
                         finetune=self.cfg.get("eval.finetune", 0), unseen=getattr(self, "unseen", None))

    # -- state beside the store ---------------------------------------------------------------------
    def _snapshot(self, rnd: int, state: dict, seen: np.ndarray, elapsed: float) -> dict:
        snap = {"run_id": self.run_id, "round": rnd, "state": state, "seen": seen, "elapsed": elapsed}
        if getattr(self, "system", None) is not None:
            snap["system"] = self.system.snapshot()
        if self.clients is not None:
            snap.update(self.clients.snapshot())
        return snap

    def _restore(self, snap: dict, folder=None) -> dict:
        """The server state of a checkpoint (or kept final state); the client store is brought to it
        (`folder`: where a kept final state's row files are). Raises StoreMismatch when the checkpoint's
        client state is not what the method declares, or the row files of `state.storage=mmap` cannot be
        those of the checkpoint."""
        if self.clients is not None:
            self.clients.restore(snap, folder)
        return snap["state"]

    def restore_final(self, kept: dict) -> dict:
        """The server state of this configuration's kept final state (`Store.load_final`), the client store
        brought to it (with `state.storage=mmap`, from the row files kept beside it). Client state that is
        not what the method declares is `CheckpointRefused`, naming the file."""
        rows = self.store.final_rows_dir(self.cfg.train_id) if "client_rows" in kept else None
        try:
            return self._restore(kept, rows)
        except StoreMismatch as e:
            raise CheckpointRefused(str(e), self.store.final_path(self.cfg.train_id), "client_state",
                                    "kept final state") from None

    # -- what a checkpoint must be (fedprism.experiment.checkpoint) ---------------------------------------
    def binding(self, final: bool = False) -> dict:
        """What this run's checkpoints (`final`: its kept final state) are bound to, inside their signed
        header: the run id (the training identity) and the SHA-256 of the configuration it hashes."""
        from fedprism.experiment.checkpoint import config_sha256

        if final:
            return {"kind": "final", "train_id": self.cfg.train_id,
                    "config_sha256": config_sha256(self.cfg.train_identity)}
        return {"kind": "checkpoint", "run_id": self.run_id, "config_sha256": config_sha256(self.cfg.identity)}

    def checkpoint_key(self) -> bytes | None:
        """The HMAC key of `checkpoint.key` (None: checkpoints are signed with a plain SHA-256), read once;
        a key file that cannot be read is a ConfigError naming the key."""
        from fedprism.experiment.checkpoint import read_key

        if not hasattr(self, "_key"):
            self._key = read_key(self.cfg.get("checkpoint.key", ""))
        return self._key

    def initial_layout(self) -> dict:
        """The method's server state at round 0 (what a checkpoint's state is checked against), computed
        once, with the global random generators left as they were."""
        if getattr(self, "_layout", None) is None:
            import random

            py, npy = random.getstate(), np.random.get_state()
            with torch.random.fork_rng(devices=[]):
                self._layout = self.algo.init_state()
            random.setstate(py)
            np.random.set_state(npy)
        return self._layout

    def _client_rows(self) -> dict:
        """name -> (row shape, dtype) of the method's declared client state."""
        from fedprism.protocol import _dims

        return {k: (_dims(d.shape, self.ctx), d.dtype) for k, d in self.algo.client_state.items()}

    def checkpoint_bytes(self) -> int:
        """The largest checkpoint (or kept final state) this run can write (`checkpoint.max_bytes`: from its
        initial server state, its declared client state and the model's size); larger files are not read."""
        from fedprism.experiment.checkpoint import max_bytes, nbytes

        N = self.ctx.num_clients
        rows = sum(N * int(np.prod(shape, dtype=np.int64)) * torch.empty(0, dtype=dt).element_size()
                   for shape, dt in self._client_rows().values())
        return max_bytes(nbytes(self.initial_layout()) + rows + N, N, self.ctx.spec.size)

    def check_snapshot(self, snap: dict, file, final: bool = False, stored_rounds: int | None = None) -> None:
        """A loaded checkpoint (`final`: kept final state) against this run before any of it is used
        (`checkpoint.check_snapshot`); `CheckpointRefused` names `file` and the field."""
        from fedprism.experiment.checkpoint import check_snapshot

        try:
            check_snapshot(snap, rounds=self.cfg["rounds"], stored_rounds=stored_rounds,
                           initial=self.initial_layout(), clients=self.ctx.num_clients,
                           client_rows=self._client_rows(), final=final)
        except CheckpointRefused as e:
            raise e.at(file, "kept final state" if final else "checkpoint") from None

    def provenance(self) -> dict:
        """What is stored with the run about how it ran (`fedprism.experiment.provenance.capture`)."""
        return capture(self)

    def rescore_source(self, provenance: dict | None = None) -> tuple[str, dict] | None:
        """A finished run that trained exactly this configuration (same training identity, other
        evaluation-only settings) and whose final state was kept: (the id of the run that kept it, the
        kept state). One state is kept per training id, so it is loaded once. With `provenance` (this
        run's), a state kept by a run stored from other code or data is not a source: it is not what this
        code would have trained (the reuse rule of docs/reproducibility.md)."""
        from fedprism.experiment.config import resolve
        from fedprism.experiment.provenance import differences

        if not self.shares_final:
            return None
        want = self.cfg.train_id
        for row in self.store.runs(method=self.cfg["method"], seed=self.cfg["seed"], status="finished"):
            if row["run_id"] == self.run_id or _trained_remotely(row):
                continue
            try:
                other = resolve(_json(row["config"]))
            except Exception:  # noqa: BLE001 - a stored config of an older version: not a match
                continue
            if other.train_id != want:
                continue
            kept = self.store.load_final(want, self.binding(final=True), self.checkpoint_key(),
                                         self.checkpoint_bytes())
            if kept is None:
                return None
            self.check_snapshot(kept, self.store.final_path(want), final=True)
            source = str(kept.get("run_id") or row["run_id"])          # the run that trained this state
            if provenance is not None and differences(self.store.provenance(source), provenance):
                return None
            return source, kept
        return None

    def rescore(self, source: str, kept: dict, provenance: dict | None = None) -> RunResult:
        """Evaluate a kept final state under this configuration's evaluation settings (no training), stored
        as the run's one round (the kept state's); the callbacks of `build.rescore_callbacks` (the
        `scalars=DIR` files) see it as a run of that one round started from scratch."""
        store, run_id = self.store, self.run_id
        callbacks = rescore_callbacks(self)      # before the run is started, as in `run`
        store.start_run(run_id, self.cfg.values, self.sweep, provenance=provenance)
        with _marks_failure(store, run_id):
            state = self.restore_final(kept)
            evaluator = self.evaluator()
            metrics, client_rows = self.evaluate_round(evaluator, state)
            metrics.update(self.gate(state, metrics))
            metrics["train_s"] = 0.0
            last = int(kept["round"])
            store.truncate(run_id, -1)
            loop = Loop(state, 0, None, 0.0, np.zeros(self.ctx.num_clients, bool), evaluator)
            for cb in callbacks:
                cb.on_run_start(self, loop)
            r = Round(last, state, evaluator, metrics, [("rescored", None, {"from": source,
                                                                           "train_id": self.cfg.train_id})],
                      client_rows, evaluated=True)
            store.write_round(run_id, last, r.metrics, r.client_rows, r.records, r.wall)
            for cb in callbacks:
                cb.on_round_stored(self, r)
            history = store.round_metrics(run_id)
            final = final_metrics(history, 0.0)
            final.update(privacy_metrics(self.cfg, self.ctx.privacy))
            final["rescored_from"] = source
            store.finish(run_id, final)
        for cb in callbacks:
            cb.on_finish(self, loop, final)
        return RunResult(run_id, "finished", final, history)

    def _losses(self, state: dict, clients: np.ndarray) -> np.ndarray:
        """Mean training loss of the model each client would be sent (Power-of-Choice candidates)."""
        r = self.engine.evaluate(self.algo.model_for(state, clients), clients, "train")
        return (r.loss_sum / r.count.clamp(min=1)).numpy()

    # -- the round loop -------------------------------------------------------------------------------
    def callbacks(self) -> list[Callback]:
        """The round loop's callbacks (experiment/callbacks.py), from the composition root
        (`build.round_callbacks`): drift, evaluation sampling, the gate, the `scalars=DIR` files,
        checkpoints, progress. Called once per `run`, before the run is started (a constructor may refuse
        the configuration: `scalars`)."""
        return round_callbacks(self)

    def run(self, stop_after: int | None = None) -> RunResult:
        """Run to the end (or for `stop_after` more rounds, for tests of resumption)."""
        cfg, store, run_id = self.cfg, self.store, self.run_id
        stop_after = plain(stop_after)
        if stop_after is not None and (isinstance(stop_after, bool) or not isinstance(stop_after, int)
                                       or stop_after < 1):
            raise ConfigError("stop_after", stop_after, "None (run to the end) or an integer >= 1: the "
                              "number of rounds to run now", kind="argument")
        if getattr(store, "readonly", False):          # before its lock file or any write
            raise StoreError(f"{store.path} is open read-only (Store(path, readonly=True)): a run writes its "
                             "rounds; open the store with Store(path)")
        key = self.checkpoint_key()              # `checkpoint.key`: a key file that cannot be read stops here
        set_threads(cfg)                                   # `threads=`: execution-only, recorded below
        selector = make_selector(cfg, self.ctx, self.algo)
        prov = self.provenance()                 # compared with a stored run's (docs/reproducibility.md)
        settle_stored(self, prov)                # other code: a finished run refused, an unfinished one replaced
        row = store.run(run_id)
        if row is not None and row["status"] == "finished":
            store.start_run(run_id, cfg.values, self.sweep, provenance=prov)   # sweep membership
            return RunResult(run_id, "finished", _json(row["final"]), store.round_metrics(run_id), reused=True)
        if row is None or row["rounds_done"] == 0:
            src = self.rescore_source(prov)
            if src is not None:
                return self.rescore(*src, provenance=prov)
        callbacks = self.callbacks()             # before the run is started: a bad `scalars` folder is refused
        store.start_run(run_id, cfg.values, self.sweep, provenance=prov)
        # from here on the run is `running` and holds its lock: whatever raises (restoring the checkpoint,
        # rewriting the `scalars` files, a round, keeping the final state) marks it `interrupted` or `failed`,
        # which releases the lock; it resumes from its last checkpoint
        with _marks_failure(store, run_id):
            loop = self._resume(key)
            for cb in callbacks:
                cb.on_run_start(self, loop)
            for rnd in range(loop.start, cfg["rounds"]):
                if stop_after is not None and rnd - loop.start >= stop_after:
                    store.mark(run_id, "interrupted")
                    return RunResult(run_id, "interrupted", {}, store.round_metrics(run_id), loop.resumed)
                self.round(rnd, loop, selector, callbacks)
            final, history = self._finish(loop)
        if self.clients is not None:
            self.clients.close(keep=loop.kept)
        for cb in callbacks:
            cb.on_finish(self, loop, final)
        return RunResult(run_id, "finished", final, history, loop.resumed)

    def _resume(self, key) -> Loop:
        """The loop's starting point: the run's checkpoint restored (bound to this run, signed with its key,
        checked before use), or round 0; the store drops the rounds after it."""
        store, run_id = self.store, self.run_id
        path = store.checkpoint_path(run_id)
        ckpt = store.load_checkpoint(run_id, self.binding(), key, self.checkpoint_bytes() if path.exists() else None)
        if ckpt is not None and ckpt.get("run_id") == run_id:
            self.check_snapshot(ckpt, path, stored_rounds=store.run(run_id)["rounds_done"])
            try:
                state, start, resumed = self._restore(ckpt), ckpt["round"] + 1, ckpt["round"]
            except StoreMismatch as e:   # client state this code cannot take (other declarations,
                store.discard_checkpoint(run_id, f"client state: {e}")   # or `mmap` files not its own)
                self.clients = self.client_store()
                ckpt = None
        if ckpt is not None and ckpt.get("run_id") == run_id:
            elapsed = ckpt.get("elapsed", 0.0)
            if getattr(self, "system", None) is not None:
                self.system.restore(ckpt.get("system"))
        else:
            state, start, resumed, elapsed = self.initial_state(), 0, None, 0.0
            if getattr(self, "system", None) is not None:
                self.system.restore(None)
        store.truncate(run_id, start - 1)
        evaluator = self.evaluator()
        seen = np.zeros(self.ctx.num_clients, bool)
        if ckpt is not None and "seen" in ckpt:
            seen = ckpt["seen"]
        return Loop(state, start, resumed, elapsed, seen, evaluator, key)

    def round(self, rnd: int, loop: Loop, selector: Selector, callbacks: list[Callback]) -> Round:
        """One round: the callbacks' round start, the cohort's work and the server step (`train_round`),
        the evaluation when due, the round's counts, then it is stored and the callbacks see it stored."""
        t0 = time.time()
        r = Round(rnd, loop.state, loop.evaluator)
        for cb in callbacks:
            cb.on_round_start(self, r)
        plan, update = self.train_round(r, loop, selector)
        T = self.cfg["rounds"]
        if (rnd + 1) % self.cfg["eval_every"] == 0 or rnd == T - 1:
            if r.eval_clients is None:           # every client (Flower's evaluate_round takes no sample)
                scored, r.client_rows = self.evaluate_round(loop.evaluator, loop.state)
            else:                                # `eval.clients`: this round scores a seeded sample
                scored, r.client_rows = self.evaluate_round(loop.evaluator, loop.state, r.eval_clients)
            r.metrics = {**scored, **r.metrics}  # the evaluation's metrics, then the round's own (train_s)
            r.evaluated = True
            for cb in callbacks:
                cb.on_eval(self, r)
        r.metrics.update(self.traffic(rnd, plan, update, loop.seen))
        if getattr(getattr(self, "engine", None), "local_dp", None) is not None:   # dp.local=dpsgd
            self.dpsgd_round(r)
        r.records += self.extra_records(rnd) + (self.partition_records() if rnd == 0 else [])
        if rnd == 0 and getattr(self, "unseen", None) is not None:
            r.records.append(("unseen_clients", None, {"clients": np.flatnonzero(self.unseen).tolist()}))
        attack = getattr(getattr(self, "ctx", None), "attack", None)
        if rnd == 0 and attack is not None:               # `attack.*`: who the Byzantine clients are
            r.records.append(("byzantine_clients", None, {"clients": attack.clients.tolist(), "kind": attack.kind,
                                                          "scale": attack.scale}))
        for cb in callbacks:
            cb.on_round_end(self, r)
        r.wall = time.time() - t0
        loop.elapsed += r.wall
        self.store.write_round(self.run_id, rnd, r.metrics, r.client_rows, r.records, r.wall)
        for cb in callbacks:
            cb.on_round_stored(self, r)
        return r

    def train_round(self, r: Round, loop: Loop, selector: Selector) -> tuple[Plan, Update]:
        """The cohort (`selection`), the plan, the clients' work, what the server accepts of it and the
        server step (`aggregate_records`); the round's records of failures, rejections, the method's and
        the selection's."""
        rnd, state, name = r.index, loop.state, type(self.algo).__name__
        system = getattr(self, "system", None)
        if system is not None and rnd == 0:
            r.records += system.model.records()
        if system is not None and system.model.fedbuff:      # one buffered asynchronous server step
            return system.fedbuff_round(self, r, loop, selector)
        sampled, chosen_by = selector.select(rnd, lambda cand: self._losses(state, cand))
        plan = check_plan(self.algo.plan(state, rnd, sampled), self.algo.ctx.num_clients, name)
        if getattr(self, "unseen", None) is not None:    # a plan beyond the cohort (Local's participation=all,
            keep = ~self.unseen[plan.clients]            # FedClust's first round) leaves the held-out clients out
            if not keep.all():
                plan = plan.subset(np.flatnonzero(keep))
        if system is not None:                           # the clients offline this round leave the plan
            plan = system.online(r, plan)
        t_train = time.time()
        update, failed = self.local_work(plan, rnd)
        stop_on_failure(self.cfg, failed, rnd)   # `fail_on_client_error=true`: a failed client fails the run
        r.metrics["train_s"] = time.time() - t_train
        update, rejected = receive(update, plan, self.clients, self.upload, name, self.ctx.compress)
        if self.trusts_clients:
            malformed_round(rejected, plan, rnd, name)
        if system is not None:                           # uploads past the deadline discarded; simulated time
            update = system.deadline(self, r, plan, update)
        update.rejected = {**failed, **rejected}
        loop.seen[update.clients] = True
        recs = aggregate_records(self.algo, state, rnd, update)
        if self.ctx.dp is not None:                      # DP-FedAvg: the round's releases and the epsilon so far
            r.metrics.update(self.dp_round(rnd, plan))
        r.records += [("failure", c, {"reason": why}) for c, why in failed.items()]
        r.records += [("rejected", c, {"reason": why}) for c, why in rejected.items()]
        r.records += [(k, None, v) for k, v in recs.items()]
        if chosen_by:
            r.records.append(("selection", None, chosen_by))
        if rnd == 0:
            r.records += selector.records()
        return plan, update

    def dp_round(self, rnd: int, plan: Plan) -> dict:
        """DP-FedAvg's round metrics: `dpfedavg_releases` (the server step's noisy averages this round),
        `dpfedavg_q` (the sampling rate the accountant uses: cohort / clients, or 1 for a round whose plan
        names more clients than a cohort, such as FedClust's first), and `dpfedavg_epsilon`, the epsilon
        spent so far at `dp.target_delta` (fedprism.privacy.dpfedavg_epsilon over every round up to this
        one; left out while it is infinite, `dp.noise_multiplier=0`). Earlier rounds come from the store, so
        a resumed run accounts for the rounds it did not run in this process."""
        dp = self.ctx.dp
        hist = getattr(self, "_dp_rounds", None)
        if hist is None or len(hist) != rnd:
            hist = [(float(m.get("dpfedavg_q", dp.rate)), int(m.get("dpfedavg_releases", 0)))
                    for m in self.store.round_metrics(self.run_id) if m["round"] < rnd]
        q = dp.rate if len(plan.clients) <= dp.cohort else 1.0
        self._dp_rounds = hist = [*hist, (q, dp.releases)]
        out = {"dpfedavg_releases": dp.releases, "dpfedavg_q": q}
        eps = dp.epsilon(hist)
        if math.isfinite(eps):
            out["dpfedavg_epsilon"] = eps
        return out

    def dpsgd_round(self, r: Round) -> None:
        """Local DP-SGD's round (`dp.local=dpsgd`, fedprism.local_dp): a `dpsgd_steps` record of each client's
        DP-SGD steps this round and its sampling rate, and the metrics `dpsgd_epsilon_max` /
        `dpsgd_epsilon_mean` (over the clients that have trained so far: the epsilon each has spent),
        `dpsgd_steps`, `dpsgd_q_min` / `dpsgd_q_max`. Earlier rounds' steps come from the store's records,
        so a resumed run accounts for the rounds it did not run in this process."""
        ldp = self.engine.local_dp
        if ldp.next_round != r.index:
            done, rate, ldp.steps = dict(ldp.round_steps), dict(ldp.rate), {}
            for rec in self.store.records(self.run_id, "dpsgd_steps"):
                if rec["round"] < r.index:
                    for c, k, q in zip(rec["data"]["clients"], rec["data"]["steps"], rec["data"]["q"]):
                        ldp.rate[int(c)] = float(q)
                        ldp.steps[int(c)] = ldp.steps.get(int(c), 0) + int(k)
            for c, k in done.items():
                ldp.steps[c] = ldp.steps.get(c, 0) + k
            ldp.rate.update(rate)
        this = sorted(ldp.round_steps.items())
        r.metrics.update(ldp.round_metrics())
        r.records.append(("dpsgd_steps", None, {"clients": [c for c, _ in this], "steps": [k for _, k in this],
                                                 "q": [ldp.rate[c] for c, _ in this]}))
        ldp.round_steps, ldp.next_round = {}, r.index + 1

    def traffic(self, rnd: int, plan: Plan, update: Update, seen: np.ndarray) -> dict:
        """The round's counts: clients planned, accepted and rejected, bytes each way (round 0 with the
        method's one-off setup exchange), clients never accepted so far, the mean training loss."""
        down, up = self.algo.setup_bytes() if rnd == 0 else (0, 0)
        out = {"clients": len(plan.clients), "accepted": len(update.clients), "rejected": len(update.rejected),
               "bytes_down": self.algo.wire_bytes("plan", plan.payload) + down,
               "bytes_up": self.algo.wire_bytes("update", update.payload) + up, "never_sampled": int((~seen).sum())}
        if self.ctx.compress is not None:                # the encoded form (fedprism.compression), as it travels
            out["bytes_up"] = self.ctx.compress.wire_bytes(self.upload, len(update.clients)) + up
        if "train_loss" in update.metrics and len(update.clients):
            out["train_loss"] = float(update.metrics["train_loss"].mean())
        return out

    def _finish(self, loop: Loop) -> tuple[dict, list[dict]]:
        """The run's final metrics; its final state kept when `keep_final` (the clients' row files with
        it); the run marked finished."""
        cfg, store = self.cfg, self.store
        self.state = loop.state
        history = store.round_metrics(self.run_id)
        final = final_metrics(history, loop.elapsed)
        final.update(privacy_metrics(cfg, self.ctx.privacy))
        final.update(update_privacy_metrics(cfg, history))
        final.update(local_dp_metrics(cfg, history))
        final.update(final_system_metrics(history))
        if cfg["keep_final"] and self.shares_final:
            if self.clients is not None and self.clients.storage == "mmap":
                self.clients.move_to(store.final_rows_dir(cfg.train_id))   # the row files go with it
            store.save_final(cfg.train_id, self._snapshot(cfg["rounds"] - 1, loop.state, loop.seen, loop.elapsed),
                             self.binding(final=True), loop.key)
            loop.kept = True
        store.finish(self.run_id, final)
        return final, history


@contextmanager
def _marks_failure(store: Store, run_id: str):
    """The one place a started run that raises is marked: `interrupted` on Ctrl-C (KeyboardInterrupt),
    `failed` on anything else; either releases its lock, and the exception goes on."""
    try:
        yield
    except KeyboardInterrupt:
        store.mark(run_id, "interrupted")
        raise
    except BaseException:
        store.mark(run_id, "failed")
        raise


FINAL_KEYS = ("global_acc", "local_acc", "local_acc_weighted", "ad", "sdad", "local_f1", "global_f1",
              "global_model_acc", "unseen_local_acc", "unseen_local_acc_weighted", "unseen_local_f1")


def final_metrics(history: list[dict], seconds: float) -> dict:
    """Final (last evaluated round) and best values of the headline metrics."""
    evald = [h for h in history if "local_acc" in h]
    out: dict[str, Any] = {"seconds": seconds, "rounds": len(history)}
    sampled = sum(1 for h in evald if "eval_clients" in h)
    if sampled:                         # `eval.clients`: best values only from rounds that scored every client
        out["eval_sampled_rounds"] = sampled
    full = [h for h in evald if "eval_clients" not in h] or evald
    if evald:
        last = evald[-1]
        for k in FINAL_KEYS:
            if k in last:
                out[k] = last[k]
                vals = [h[k] for h in full if h.get(k) is not None]
                if not vals:                # every evaluation of this metric failed: no best value
                    continue
                if k in ("ad", "sdad"):
                    out[f"best_{k}"] = min(vals)
                else:
                    out[f"best_{k}"] = max(vals)
        out.update({k: v for k, v in last.items() if "@" in k})     # alternative predictions (diagnostics)
    out["bytes_down"] = sum(h.get("bytes_down", 0) for h in history)
    out["bytes_up"] = sum(h.get("bytes_up", 0) for h in history)
    out["rejected"] = sum(h.get("rejected", 0) for h in history)
    out["accepted"] = sum(h.get("accepted", 0) for h in history)
    stuck = None                     # the first round of the run's trailing stretch of all-rejected rounds
    for i, h in reversed(list(enumerate(history))):
        if h.get("accepted", 0) + h.get("rejected", 0) == 0:
            continue                         # a round without updates (nobody sampled) neither ends nor extends it
        if h.get("accepted", 0) > 0:
            break
        stuck = h.get("round", i)
    out["diverged"] = stuck is not None      # from that round on no update was usable: the model stopped there
    if stuck is not None:
        out["diverged_round"] = stuck
    return out


def _trained_remotely(row) -> bool:
    """A stored run whose clients trained elsewhere (a Flower run: its provenance names its engine)."""
    prov = _json(row["provenance"] if "provenance" in row.keys() else None)
    return (prov.get("execution") or {}).get("engine") == "RemoteTrainer"


def _json(s: str | None) -> dict:
    import json
    return json.loads(s) if s else {}


def run(cfg: Config, store: Store, **kw: Any) -> RunResult:
    return Experiment(cfg, store, **{k: v for k, v in kw.items() if k in ("fed", "progress", "sweep")}).run(
        kw.get("stop_after"))
