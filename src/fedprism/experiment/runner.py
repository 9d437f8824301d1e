"""The round loop: config -> federation -> algorithm + engine -> rounds -> store (DESIGN.md).

Resumable: after every round the algorithm state is checkpointed beside the database, and every
random stream is a pure function of (seed, round, client), so a resumed run reaches exactly the
numbers of an uninterrupted one.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fedprism.algorithms import REGISTRY
from fedprism.algorithms.base import Algorithm, Context, Plan, Update
from fedprism.engine import make_engine
from fedprism.engine.base import LocalConfig
from fedprism.experiment.config import Config
from fedprism.experiment.evaluate import Evaluator, summarize
from fedprism.experiment.federation import build_federation, resolve_model_name
from fedprism.experiment.limits import check_limits
from fedprism.experiment.store import Store
from fedprism.federation import Federation
from fedprism.models import build_model
from fedprism.params import flatten


def sample_clients(seed: int, rnd: int, num_clients: int, fraction: float) -> np.ndarray:
    """m_t = max(floor(qN), 1) clients without replacement from a stream seeded by (seed, round)
    only, so every method sees the same cohorts (specs 0.5)."""
    m = max(int(math.floor(fraction * num_clients + 1e-9)), 1)
    rng = np.random.default_rng([seed, rnd, 0x5A3])
    return np.sort(rng.choice(num_clients, size=m, replace=False))


@dataclass
class RunResult:
    run_id: str
    status: str
    final: dict
    history: list[dict] = field(default_factory=list)
    resumed_from: int | None = None


class Progress:
    """A one-line progress bar on stderr: round, ETA and the latest accuracies."""

    def __init__(self, total: int, enabled: bool, label: str = ""):
        self.total, self.enabled, self.label = total, enabled, label
        self.t0 = time.time()
        self.done0: int | None = None

    def update(self, done: int, metrics: dict | None) -> None:
        if not self.enabled:
            return
        if self.done0 is None:
            self.done0 = done - 1
        rate = (time.time() - self.t0) / max(1, done - self.done0)
        eta = rate * (self.total - done)
        width = 24
        bar = "#" * int(width * done / self.total)
        acc = ""
        if metrics:
            acc = f" local {metrics.get('local_acc', float('nan')):.3f}"
            if "global_acc" in metrics:
                acc += f" global {metrics['global_acc']:.3f}"
        sys.stderr.write(f"\r{self.label} round {done}/{self.total} [{bar:<{width}}] ETA {eta:5.0f}s{acc}   ")
        if done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _validate(update: Update, P: int) -> tuple[Update, dict[int, str]]:
    """Reject rows with the wrong length or NaN/Inf values (specs 0.10); never stop the round."""
    if update.params.dim() != 2 or update.params.shape[1] != P:
        return update.select(np.zeros(len(update.clients), bool)), {
            int(c): f"wrong shape {tuple(update.params.shape)}, expected [n, {P}]" for c in update.clients}
    finite = torch.isfinite(update.params).all(1).cpu().numpy()
    bad = {int(c): "non-finite values (NaN/Inf)" for c, ok in zip(update.clients, finite) if not ok}
    return (update if not bad else update.select(finite)), bad


def _local_work(algo: Algorithm, plan: Plan, engine, rnd: int) -> tuple[Update | None, dict[int, str]]:
    """Run the cohort; if it fails, retry client by client and record the ones that fail."""
    try:
        return algo.client_update(plan, engine, rnd), {}
    except Exception as e:  # noqa: BLE001 - a client failure must not stop the run
        if len(plan.clients) == 1:
            return None, {int(plan.clients[0]): f"{type(e).__name__}: {e}"}
    parts, failed = [], {}
    for r in range(len(plan.clients)):
        up, f = _local_work(algo, plan.subset(np.array([r])), engine, rnd)
        failed.update(f)
        if up is not None:
            parts.append(up)
    return (Update.concat(parts) if parts else None), failed


def local_config(cfg: Config) -> LocalConfig:
    """The client-side training settings of a config."""
    return LocalConfig(epochs=cfg["local_epochs"], batch_size=cfg["batch_size"], lr=cfg["lr"],
                       momentum=cfg["momentum"], weight_decay=cfg["weight_decay"])


def make_model(cfg: Config, input_shape: tuple[int, ...], num_classes: int) -> torch.nn.Module:
    """The config's model, initialised from the run seed (same seed -> same initial vector)."""
    return build_model(resolve_model_name(cfg["model"], input_shape), input_shape, num_classes, seed=cfg["seed"])


def make_context(cfg: Config, model: torch.nn.Module, n_train: np.ndarray, label_hist: np.ndarray) -> Context:
    """The algorithm's view of the federation (sizes and label counts, no raw data). `spec` is
    filled in by the caller once the engine (or a `Functional`) has laid the parameters out."""
    return Context(num_clients=len(n_train), num_classes=int(label_hist.shape[1]), spec=None, init=flatten(model),
                   n_train=n_train, label_hist=label_hist, seed=cfg["seed"], rounds=cfg["rounds"],
                   fraction=cfg["fraction"])


def make_algorithm(cfg: Config, ctx: Context) -> Algorithm:
    return REGISTRY[cfg["method"]](ctx, **cfg.method_params)


class Experiment:
    """One configured run. `run()` executes or resumes it and stores everything.

    `run()` uses only `cfg`, `store`, `sweep`, `progress`, `run_id`, `ctx`, `engine` (any Trainer) and
    `algo`, plus the hooks `local_work`, `extra_records` and `evaluate_round`: the Flower ServerApp
    (`fedprism.flower`) subclasses it with remote clients and no data on the server.
    """

    def __init__(self, cfg: Config, store: Store, fed: Federation | None = None, progress: bool = False,
                 sweep: str | None = None):
        self.cfg, self.store, self.sweep = cfg, store, sweep
        self.progress = progress
        self.run_id = cfg.run_id
        self.fed = fed if fed is not None else build_federation(cfg)
        self.model = make_model(cfg, self.fed.input_shape, self.fed.num_classes)
        check_limits(cfg, self.fed.n_train, sum(p.numel() for p in self.model.parameters()))
        self.ctx = make_context(cfg, self.model, self.fed.n_train, self.fed.label_hist())
        self.engine = make_engine(cfg["engine"], self.fed, self.model, local_config(cfg), cfg["seed"], cfg["device"],
                                  compile=cfg["compile"], rounds=cfg["rounds"])
        self.ctx.spec = self.engine.spec
        self.algo: Algorithm = make_algorithm(cfg, self.ctx)

    # -- hooks (overridden by the Flower ServerApp) -------------------------------------------------
    def local_work(self, plan: Plan, rnd: int) -> tuple[Update | None, dict[int, str]]:
        """The sampled clients' work: (update of the clients that succeeded, failed client -> reason)."""
        return _local_work(self.algo, plan, self.engine, rnd)

    def extra_records(self, rnd: int) -> list[tuple[str, int | None, Any]]:
        """Further (kind, client, data) records to store with round `rnd`."""
        return []

    def evaluate_round(self, evaluator: Evaluator, state: dict) -> tuple[dict, list[tuple]]:
        """Round metrics and per-client rows of one evaluation."""
        t_eval = time.time()
        scores = evaluator(self.algo, state)
        metrics = summarize(scores)
        for name, w in self.algo.extra_models(state).items():
            r = self.engine.evaluate(w.unsqueeze(0), np.array([0]), "global")
            metrics[f"{name}_model_acc"] = float(r.accuracy[0])
        metrics["eval_s"] = time.time() - t_eval
        metrics["models_evaluated"] = scores.evaluated
        client_rows = [(int(c), scores.local_acc[c], scores.local_loss[c], scores.global_acc[c],
                        int(scores.n_test[c]), scores.local_f1[c]) for c in range(self.ctx.num_clients)]
        return metrics, client_rows

    def initial_state(self) -> dict:
        """The algorithm's state at round 0 (hook: the Flower server drops the client-side rows)."""
        return self.algo.init_state()

    def run(self, stop_after: int | None = None) -> RunResult:
        """Run to the end (or for `stop_after` more rounds, for tests of resumption)."""
        cfg, store = self.cfg, self.store
        run_id = self.run_id
        row = store.start_run(run_id, cfg.values, self.sweep)
        if row["status"] == "finished":
            return RunResult(run_id, "finished", _json(row["final"]), store.round_metrics(run_id))
        ckpt = store.load_checkpoint(run_id)
        if ckpt is not None and ckpt.get("run_id") == run_id:
            state, start, resumed = ckpt["state"], ckpt["round"] + 1, ckpt["round"]
            elapsed = ckpt.get("elapsed", 0.0)
        else:
            state, start, resumed, elapsed = self.initial_state(), 0, None, 0.0
        store.truncate(run_id, start - 1)
        evaluator = Evaluator(self.engine, self.ctx.num_clients, cfg["eval.global"])
        seen = np.zeros(self.ctx.num_clients, bool)
        if ckpt is not None and "seen" in ckpt:
            seen = ckpt["seen"]
        bar = Progress(cfg["rounds"], self.progress, cfg.get("name") or cfg["method"])
        P = self.ctx.spec.size
        metrics: dict[str, Any] | None = None
        T = cfg["rounds"]
        try:
            for rnd in range(start, T):
                if stop_after is not None and rnd - start >= stop_after:
                    store.mark(run_id, "interrupted")
                    return RunResult(run_id, "interrupted", {}, store.round_metrics(run_id), resumed)
                t0 = time.time()
                sampled = sample_clients(cfg["seed"], rnd, self.ctx.num_clients, cfg["fraction"])
                plan = self.algo.plan(state, rnd, sampled)
                t_train = time.time()
                update, failed = self.local_work(plan, rnd)
                t_train = time.time() - t_train
                rejected: dict[int, str] = {}
                if update is not None:
                    update, rejected = _validate(update, P)
                else:
                    update = Update(plan.clients[:0], plan.start[:0], plan.start[:0], torch.zeros(0, dtype=torch.float64))
                update.rejected = {**failed, **rejected}
                seen[update.clients] = True
                recs = self.algo.aggregate(state, rnd, update) or {}
                records = [("failure", c, {"reason": r}) for c, r in failed.items()]
                records += [("rejected", c, {"reason": r}) for c, r in rejected.items()]
                records += [(k, None, v) for k, v in recs.items()]
                metrics, client_rows = None, None
                if (rnd + 1) % cfg["eval_every"] == 0 or rnd == T - 1:
                    metrics, client_rows = self.evaluate_round(evaluator, state)
                else:
                    metrics = {}
                down = plan.down_floats if plan.down_floats is not None else P
                up = update.up_floats if update.up_floats is not None else P
                metrics.update({
                    "train_s": t_train, "clients": len(plan.clients), "accepted": len(update.clients),
                    "rejected": len(update.rejected), "bytes_down": 4 * down * len(plan.clients),
                    "bytes_up": 4 * up * len(update.clients), "never_sampled": int((~seen).sum()),
                })
                if "train_loss" in update.extras and len(update.clients):
                    metrics["train_loss"] = float(update.extras["train_loss"].mean())
                records += self.extra_records(rnd)
                wall = time.time() - t0
                elapsed += wall
                store.write_round(run_id, rnd, metrics, client_rows, records, wall)
                store.save_checkpoint(run_id, {"run_id": run_id, "round": rnd, "state": state, "seen": seen,
                                               "elapsed": elapsed})
                bar.update(rnd + 1, metrics if "local_acc" in metrics else None)
        except KeyboardInterrupt:
            store.mark(run_id, "interrupted")
            raise
        except BaseException:
            store.mark(run_id, "failed")
            raise
        self.state = state
        history = store.round_metrics(run_id)
        final = final_metrics(history, elapsed)
        store.finish(run_id, final)
        store.drop_checkpoint(run_id)
        return RunResult(run_id, "finished", final, history, resumed)


FINAL_KEYS = ("global_acc", "local_acc", "local_acc_weighted", "ad", "sdad", "local_f1", "global_f1",
              "global_model_acc")


def final_metrics(history: list[dict], seconds: float) -> dict:
    """Final (last evaluated round) and best values of the headline metrics."""
    evald = [h for h in history if "local_acc" in h]
    out: dict[str, Any] = {"seconds": seconds, "rounds": len(history)}
    if evald:
        last = evald[-1]
        for k in FINAL_KEYS:
            if k in last:
                out[k] = last[k]
                vals = [h[k] for h in evald if h.get(k) is not None]
                if k in ("ad", "sdad"):
                    out[f"best_{k}"] = min(vals)
                else:
                    out[f"best_{k}"] = max(vals)
        out.update({k: v for k, v in last.items() if "@" in k})     # alternative predictions (diagnostics)
    out["bytes_down"] = sum(h.get("bytes_down", 0) for h in history)
    out["bytes_up"] = sum(h.get("bytes_up", 0) for h in history)
    out["rejected"] = sum(h.get("rejected", 0) for h in history)
    out["accepted"] = sum(h.get("accepted", 0) for h in history)
    out["diverged"] = out["accepted"] == 0 and out["rejected"] > 0      # no update was ever usable
    return out


def _json(s: str | None) -> dict:
    import json
    return json.loads(s) if s else {}


def run(cfg: Config, store: Store, **kw: Any) -> RunResult:
    return Experiment(cfg, store, **{k: v for k, v in kw.items() if k in ("fed", "progress", "sweep")}).run(
        kw.get("stop_after"))
