"""The round loop's callbacks (experiment/callbacks.py) and the composition root (experiment/build.py):
the hooks run in their documented order, what a callback adds is stored, a resumed run starts its
callbacks at the restored round, and the factories are one set for the runner and Flower."""

from __future__ import annotations

from fedprism.experiment import build, callbacks, runner
from fedprism.experiment.config import resolve
from fedprism.experiment.runner import Experiment
from fedprism.experiment.store import Store

TINY = {"method": "fedavg", "dataset": "digits", "clients": 4, "rounds": 3, "fraction": 1.0, "local_epochs": 1,
        "model": "mlp", "device": "cpu", "engine": "sequential", "seed": 2, "eval_every": 2}


class Recorder(callbacks.Callback):
    def __init__(self):
        self.calls = []

    def on_run_start(self, exp, loop):
        self.calls.append(("run_start", loop.start))

    def on_round_start(self, exp, rnd):
        self.calls.append(("round_start", rnd.index))

    def on_eval(self, exp, rnd):
        self.calls.append(("eval", rnd.index, "local_acc" in rnd.metrics))

    def on_round_end(self, exp, rnd):
        self.calls.append(("round_end", rnd.index, "accepted" in rnd.metrics))
        rnd.metrics["my_metric"] = 10.0 + rnd.index
        rnd.records.append(("mine", None, {"round": rnd.index}))

    def on_round_stored(self, exp, rnd):
        self.calls.append(("stored", rnd.index, exp.store.run(exp.run_id)["rounds_done"]))

    def on_finish(self, exp, loop, final):
        self.calls.append(("finish", exp.store.run(exp.run_id)["status"], final["rounds"]))


class WithRecorder(Experiment):
    recorder: Recorder

    def callbacks(self):
        return [*super().callbacks(), self.recorder]


def test_hooks_run_in_order_and_what_a_callback_adds_is_stored(tmp_path):
    e = WithRecorder(resolve(TINY), Store(tmp_path / "s.db"))
    e.recorder = Recorder()
    res = e.run()
    assert res.status == "finished"
    assert e.recorder.calls == [
        ("run_start", 0),
        ("round_start", 0), ("round_end", 0, True), ("stored", 0, 1),
        ("round_start", 1), ("eval", 1, True), ("round_end", 1, True), ("stored", 1, 2),
        ("round_start", 2), ("eval", 2, True), ("round_end", 2, True), ("stored", 2, 3),
        ("finish", "finished", 3)]
    assert [h["my_metric"] for h in res.history] == [10.0, 11.0, 12.0]
    assert [r["data"]["round"] for r in e.store.records(res.run_id, "mine")] == [0, 1, 2]
    assert not e.store.checkpoint_path(res.run_id).exists()          # the Checkpoint callback's on_finish


def test_a_resumed_run_starts_its_callbacks_at_the_restored_round(tmp_path):
    db = tmp_path / "s.db"
    with Store(db) as s:
        e = WithRecorder(resolve(TINY), s)
        e.recorder = Recorder()
        assert e.run(stop_after=1).status == "interrupted"
        assert e.recorder.calls[0] == ("run_start", 0) and e.recorder.calls[-1] == ("stored", 0, 1)
        assert s.checkpoint_path(e.run_id).exists()
    with Store(db) as s:
        e = WithRecorder(resolve(TINY), s)
        e.recorder = Recorder()
        res = e.run()
    assert res.resumed_from == 0 and e.recorder.calls[0] == ("run_start", 1)
    with Store(tmp_path / "whole.db") as s:
        whole = Experiment(resolve(TINY), s).run()
    strip = lambda h: {k: v for k, v in h.items() if not k.endswith("_s") and k != "my_metric"}  # noqa: E731
    assert [strip(h) for h in res.history] == [strip(h) for h in whole.history]


def test_the_composition_root_picks_the_callbacks_of_the_config(tmp_path):
    names = lambda cfg: [type(c).__name__ for c in Experiment(resolve(cfg), Store(tmp_path / "s.db")).callbacks()]  # noqa: E731
    assert names(TINY) == ["Checkpoint", "ProgressBar"]
    assert names({**TINY, "eval.clients": 2, "drift.fraction": 0.5}) == ["Drift", "EvalSampling", "Checkpoint",
                                                                         "ProgressBar"]


def test_the_runner_re_exports_the_factories():
    for name in ("make_model", "make_context", "make_algorithm", "local_config", "drift_schedule", "make_selector",
                 "check_runnable", "privacy_plan", "feature_dim", "warn_if_nothing_personal"):
        assert getattr(runner, name) is getattr(build, name), name


def test_every_round_keeps_its_training_time_evaluated_or_not(tmp_path):
    """An evaluated round's metrics are the evaluation's and the round's own: `train_s` (what
    bench/run_cost.py sums) is stored for every round, as it was before the loop had callbacks."""
    with Store(tmp_path / "s.db") as s:
        e = Experiment(resolve({**TINY, "rounds": 3, "eval_every": 2}), s)
        e.run()
        rounds = s.round_metrics(e.run_id)
    assert len(rounds) == 3 and all("train_s" in m and m["train_s"] >= 0 for m in rounds)
    assert [("local_acc" in m) for m in rounds] == [False, True, True]
