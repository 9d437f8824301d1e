"""The run executor behind `fedprism sweep --ray` (fedprism.experiment.executor): its logic with a fake
backend, and real runs through the in-process backend with a shared store and with shipped results."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fedprism.errors import ConfigError, FedPrismError
from fedprism.experiment.config import resolve
from fedprism.experiment.executor import InlineExecutor, Job, RayOptions, execute, run_configs, run_job
from fedprism.experiment.runlock import RunBusyError
from fedprism.experiment.runner import Experiment
from fedprism.experiment.store import Store

TINY = {"dataset": "digits", "clients": 3, "rounds": 2, "local_epochs": 1, "model": "mlp", "method": "fedavg",
        "fraction": 1.0, "keep_final": False}


def _cfg(**kw):
    return resolve({**TINY, **kw})


class Fake:
    """A backend stand-in: records what was submitted, answers from `answer(job)`, finishes jobs in the
    order `order` gives (default: last submitted first)."""

    def __init__(self, answer, order=None):
        self.answer, self.order = answer, order
        self.jobs, self.cancelled = [], []

    def submit(self, job):
        self.jobs.append(job)
        return len(self.jobs) - 1

    def wait(self, handles):
        return [max(handles)] if self.order is None else [self.order(handles)]

    def result(self, h):
        return self.answer(self.jobs[h])

    def cancel(self, handles):
        self.cancelled.extend(handles)


def test_each_run_is_submitted_once_and_results_come_as_they_finish(tmp_path):
    a, b = _cfg(seed=0), _cfg(seed=1)
    fake = Fake(lambda job: {"run_id": job.cfg.run_id, "final": {"seed": job.cfg["seed"]}})
    got = list(execute([("A", a), ("B", b), ("A again", a)], str(tmp_path / "s.db"), fake, sweep="sw"))
    assert [j.cfg.run_id for j in fake.jobs] == [a.run_id, b.run_id]          # the duplicate is not sent
    assert got == [("B", {"seed": 1}), ("A", {"seed": 0})]                  # in the order they finished
    assert {j.db for j in fake.jobs} == {str((tmp_path / "s.db").resolve())} and fake.jobs[0].sweep == "sw"


def test_busy_runs_are_reported_and_left_out_of_the_finished_ids(tmp_path):
    a, b = _cfg(seed=0), _cfg(seed=1)
    fake = Fake(lambda job: ({"run_id": job.cfg.run_id, "busy": "held by pid 7"} if job.cfg["seed"] == 1 else
                             {"run_id": job.cfg.run_id, "final": {}}))
    seen = []
    ids = run_configs([a, b], str(tmp_path / "s.db"), fake, on_result=lambda tag, f: seen.append(f))
    assert ids == [a.run_id]
    assert any(isinstance(f, RunBusyError) and "pid 7" in str(f) for f in seen)


def test_an_error_or_interrupt_cancels_every_task_still_out(tmp_path):
    cfgs = [_cfg(seed=s) for s in range(4)]

    def answer(job):
        if job.cfg["seed"] == 3:             # the first to finish (last submitted) fails
            raise KeyboardInterrupt
        return {"run_id": job.cfg.run_id, "final": {}}

    fake = Fake(answer)
    with pytest.raises(KeyboardInterrupt):
        list(execute([(str(c["seed"]), c) for c in cfgs], str(tmp_path / "s.db"), fake))
    assert sorted(fake.cancelled) == [0, 1, 2]


def test_a_result_for_another_run_is_refused(tmp_path):
    a, b = _cfg(seed=0), _cfg(seed=1)
    fake = Fake(lambda job: {"run_id": b.run_id, "final": {}})
    with pytest.raises(FedPrismError, match=f"returned run '{b.run_id}' for run {a.run_id}"):
        list(execute([("A", a)], str(tmp_path / "s.db"), fake))
    assert fake.cancelled == []


@pytest.mark.parametrize("mode", ["shared", "ship"])
def test_runs_reach_the_one_store_as_a_local_run_stores_them(tmp_path, mode):
    cfgs = [_cfg(seed=0), _cfg(seed=1)]
    db = tmp_path / "one.db"
    ids = run_configs(cfgs, str(db), InlineExecutor(), sweep="sw", store_mode=mode) if mode == "shared" else \
        list(run_configs_ship(cfgs, db, tmp_path / "scratch"))
    assert ids == [c.run_id for c in cfgs]
    ref = Store(tmp_path / "ref.db")
    want = {c.run_id: Experiment(c, ref).run().final for c in cfgs}
    with Store(db) as store:
        for c in cfgs:
            row = store.run(c.run_id)
            assert row["status"] == "finished"
            assert [m["local_acc"] for m in store.round_metrics(c.run_id)] == \
                [m["local_acc"] for m in ref.round_metrics(c.run_id)]
            assert store.round_metrics(c.run_id)[-1]["global_acc"] == want[c.run_id]["global_acc"]
        assert {r["run_id"] for r in store.runs(sweep="sw")} == set(ids)
    ref.close()
    if mode == "ship":                           # each run's own store stayed in the node's scratch
        assert sorted(p.name for p in (tmp_path / "scratch").glob("*.db")) == sorted(f"{i}.db" for i in ids)


def run_configs_ship(cfgs, db, scratch):
    done = []
    for tag, final in execute([(c.run_id, c) for c in cfgs], str(db), InlineExecutor(), sweep="sw",
                              store_mode="ship", scratch=str(scratch)):
        done.append(tag)
    return [c.run_id for c in cfgs if c.run_id in done]


def test_a_finished_run_is_not_run_again_and_stays_stored_once(tmp_path):
    cfg = _cfg()
    db = str(tmp_path / "one.db")
    run_configs([cfg], db, InlineExecutor())
    calls = []

    def spy(job):
        calls.append(job)
        return run_job(job)

    assert run_configs([cfg], db, InlineExecutor(spy)) == [cfg.run_id] and len(calls) == 1

    def counts():
        with Store(db) as store:
            return tuple(store.db.execute(f"SELECT COUNT(*) FROM {t} WHERE run_id=?", (cfg.run_id,)).fetchone()[0]
                         for t in ("runs", "rounds", "client_metrics"))

    before = counts()
    assert before[0] == 1 and before[1] >= cfg["rounds"]
    # shipped twice: each merge finds the run finished here and keeps the first copy
    for _ in range(2):
        list(execute([("x", cfg)], db, InlineExecutor(), store_mode="ship", scratch=str(tmp_path / "scratch")))
    assert counts() == before


def test_options_are_checked_before_anything_runs():
    with pytest.raises(ConfigError, match="--ray-gpus"):
        RayOptions("auto", gpus=-1)
    with pytest.raises(ConfigError, match="--ray-gpus"):
        RayOptions("auto", gpus=1.5)
    with pytest.raises(ConfigError, match="--ray-cpus"):
        RayOptions("auto", cpus=0, gpus=0)
    with pytest.raises(ConfigError, match="--ray-store"):
        RayOptions("auto", store="nfs")
    assert RayOptions("auto", cpus=0, gpus=0.25).gpus == 0.25
    with pytest.raises(ConfigError, match="--ray-store"):
        list(execute([], "x.db", InlineExecutor(), store_mode="nfs"))


def test_cli_refuses_ray_options_without_an_address(tmp_path):
    r = subprocess.run([sys.executable, "-m", "fedprism", "sweep", "none.toml", "--ray-gpus", "0.5"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "--ray" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "fedprism", "sweep", "none.toml", "--ray", "auto", "--ray-gpus", "-1"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "--ray-gpus" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "fedprism", "sweep", "none.toml", "--ray", "auto", "--workers", "2"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "'--workers' = 2 is not valid: 1 with --ray" in r.stderr, r.stderr


def test_job_defaults():
    job = Job(_cfg(), "x.db")
    assert job.store_mode == "shared" and job.threads == 1 and job.sweep is None


@pytest.mark.parametrize("mode", ["shared", "ship"])
def test_an_interrupted_run_resumes_from_its_checkpoint(tmp_path, mode):
    from fedprism.experiment.executor import part_path

    cfg = _cfg(rounds=3)
    db, scratch = tmp_path / "one.db", tmp_path / "scratch"
    where = db if mode == "shared" else part_path(str(scratch), cfg.run_id)
    with Store(where) as s:                        # the task that was stopped after its first round
        first = Experiment(cfg, s).run(stop_after=1)
        assert first.status == "interrupted"
    outs = []

    def spy(job):
        outs.append(run_job(job))
        return outs[-1]

    got = list(execute([("r", cfg)], str(db), InlineExecutor(spy), store_mode=mode, scratch=str(scratch)))
    assert outs[0]["resumed"] == 0                  # from the checkpoint of round 0, not from the start
    with Store(tmp_path / "ref.db") as ref:
        want = Experiment(cfg, ref).run()
        want_acc = [m["local_acc"] for m in ref.round_metrics(cfg.run_id)]
    assert got[0][1]["global_acc"] == want.final["global_acc"]
    with Store(db) as s:
        assert [m["local_acc"] for m in s.round_metrics(cfg.run_id)] == want_acc       # bit for bit
        assert s.run(cfg.run_id)["status"] == "finished"
