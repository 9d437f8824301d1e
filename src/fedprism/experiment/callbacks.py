"""Callbacks of the round loop (`runner.Experiment.run`): what a run does around its rounds besides
training, aggregating and scoring, each in one small class (the pattern of pfl-research's
`pfl/callback/` and of Keras callbacks).

A callback implements any of these hooks (the base class's do nothing); the loop calls them in the order
of `Experiment.callbacks()` (`build.round_callbacks`):

    on_run_start(exp, loop)    once per call of `run`, after a checkpoint was restored (loop.start, loop.state)
    on_round_start(exp, rnd)   before the cohort is drawn: the round's data (class drift)
    on_eval(exp, rnd)          after the round was scored (rnd.metrics, rnd.client_rows), before its traffic
                               counts: more metrics or records of the evaluation (the learned gate, the
                               evaluation sample)
    on_round_end(exp, rnd)     the round's metrics and records are complete but not yet stored: add to them
    on_round_stored(exp, rnd)  the round is in the store: checkpoints, progress
    on_finish(exp, loop, final)  the run is finished and its state closed

`exp` is the `Experiment` (or the Flower ServerApp's `FlowerExperiment`), `loop` its `Loop` (what the
loop carries from round to round) and `rnd` a `Round` (one round's state, metrics and records). A
callback may add metrics and records; it must not change the server state. `Round.records` keeps its
order: each callback appends where the loop calls it, so the stored records are those of the loop
written inline. The list is built once per call of `run`, before the run is started, so a constructor
may refuse the configuration (a `ConfigError`) with nothing stored or locked.

The built-in callbacks, in the order `round_callbacks` lists them (each only when its key asks for it,
the last two always):

    Drift          `drift.*`: each round's local data, the `drift_removed` metric
    EvalSampling   `eval.clients`: which clients a scored round scores, recorded
    Gate           `eval.gate=learned`: the learned gate's routings at the final evaluation
    Scalars        `scalars=DIR`: the round's metrics and per-client rows appended to CSV files, the files
                   cut back to the restored round at the start (experiment/scalars.py)
    Checkpoint     the state after every stored round, dropped when the run finishes
    ProgressBar    the progress line on stderr

A re-scored run (`Experiment.rescore`: one evaluation of a kept final state, no training) calls the
callbacks of `build.rescore_callbacks` (`Scalars` only) as a run of that one round: `on_run_start` with
`loop.start` 0, `on_round_stored` for the stored round, `on_finish`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Loop:
    """What the round loop carries between rounds of one call of `run`."""

    state: dict
    start: int                          # the first round this call runs (after a restored checkpoint)
    resumed: int | None                 # the checkpoint's round, None for a fresh start
    elapsed: float                      # seconds of the rounds run so far (checkpointed)
    seen: np.ndarray                    # [N] bool: clients whose update was accepted at least once
    evaluator: Any
    key: Any = None                     # `checkpoint.key`: what signs the checkpoints
    kept: bool = False                  # the final state was kept (`keep_final`)


@dataclass
class Round:
    """One round as the loop builds it: the callbacks read and extend `metrics` and `records`."""

    index: int
    state: dict
    evaluator: Any
    metrics: dict = field(default_factory=dict)
    records: list = field(default_factory=list)
    client_rows: list | None = None
    evaluated: bool = False             # scored this round (`eval_every`, or the last round)
    eval_clients: np.ndarray | None = None   # the clients scored when not every client (`eval.clients`)
    wall: float = 0.0                   # seconds of the round, set before it is stored


class Callback:
    """The hooks of the round loop (module docstring); every one does nothing by default."""

    def on_run_start(self, exp, loop: Loop) -> None:
        pass

    def on_round_start(self, exp, rnd: Round) -> None:
        pass

    def on_eval(self, exp, rnd: Round) -> None:
        pass

    def on_round_end(self, exp, rnd: Round) -> None:
        pass

    def on_round_stored(self, exp, rnd: Round) -> None:
        pass

    def on_finish(self, exp, loop: Loop, final: dict) -> None:
        pass


class Drift(Callback):
    """`drift.*` (fedprism.data.drift): each round's local data before the cohort trains on it
    (`Experiment.apply_drift`; a Flower server knows the sizes, its nodes change their own rows), the
    round's `drift_removed` metric and, with round 0, the schedule's records."""

    def on_round_start(self, exp, rnd: Round) -> None:
        self._removed = exp.apply_drift(rnd.index, rnd.evaluator)

    def on_round_end(self, exp, rnd: Round) -> None:
        rnd.metrics["drift_removed"] = self._removed
        if rnd.index == 0:
            rnd.records += exp.drift.records()


class EvalSampling(Callback):
    """`eval.clients=K`: a scored round scores a seeded sample of K clients (`Experiment.eval_sample`;
    every client at the final round) and records which (`eval_sample`)."""

    def __init__(self, k: int):
        self.k = k

    def on_round_start(self, exp, rnd: Round) -> None:
        rnd.eval_clients = exp.eval_sample(rnd.index)

    def on_eval(self, exp, rnd: Round) -> None:
        if rnd.eval_clients is not None:
            rnd.records.append(("eval_sample", None, {"clients": rnd.eval_clients.tolist()}))


class Gate(Callback):
    """`eval.gate=learned`: at the final evaluation, the learned gate's candidate routings
    (`Experiment.gate`; its time goes into the round's `eval_s` and `gate_s`)."""

    def on_eval(self, exp, rnd: Round) -> None:
        if rnd.index == exp.cfg["rounds"] - 1:
            rnd.metrics.update(exp.gate(rnd.state, rnd.metrics))


class Checkpoint(Callback):
    """After every stored round: the server state, the clients' state, the accepted-client mask and the
    elapsed time beside the store (`Store.save_checkpoint`, bound to the run and signed with its key), and
    the clients' row files committed (`state.storage=mmap`); when the run finished, the checkpoint goes."""

    def on_run_start(self, exp, loop: Loop) -> None:
        self.loop = loop

    def on_round_stored(self, exp, rnd: Round) -> None:
        loop = self.loop
        exp.store.save_checkpoint(exp.run_id, exp._snapshot(rnd.index, rnd.state, loop.seen, loop.elapsed),
                                  exp.binding(), loop.key)
        if exp.clients is not None:
            exp.clients.commit()                       # `mmap`: the round's rows reach their files now

    def on_finish(self, exp, loop: Loop, final: dict) -> None:
        exp.store.drop_checkpoint(exp.run_id)


class ProgressBar(Callback):
    """The progress line on stderr (`experiment.progress.Progress`; silent unless `progress`)."""

    def __init__(self, show: bool):
        self.show = show

    def on_run_start(self, exp, loop: Loop) -> None:
        from fedprism.experiment.progress import Progress

        self.bar = Progress(exp.cfg["rounds"], self.show, exp.cfg.get("name") or exp.cfg["method"])

    def on_round_stored(self, exp, rnd: Round) -> None:
        self.bar.update(rnd.index + 1, rnd.metrics if "local_acc" in rnd.metrics else None)
