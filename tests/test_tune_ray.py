"""`fedprism tune FILE --ray ADDRESS` (src/fedprism/experiment/tune.py: `tune_on`, `final_on`,
`run_trial_task`): trials and final seed runs as tasks of an executor, pruned inside the task from the shipped
pruner state. The in-process backend (`executor.InlineExecutor`) gives the local study's trials, prunings,
choice and final runs exactly; a driver stopped between tasks loses nothing and the resumed study is the
uninterrupted one; the slow test runs the command on a loopback Ray cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedprism.errors import ConfigError
from fedprism.experiment import tune
from fedprism.experiment.executor import InlineExecutor, run_job
from fedprism.experiment.store import Store
from fedprism.hparams import Space

sys.path.insert(0, str(Path(__file__).parent))

from test_tune import tiny  # noqa: E402

KEYS = ("trial", "params", "state", "value", "intermediate", "run_id", "rounds")


def _study(db) -> dict:
    """Everything a study stored: each method's trials, the final sweeps' runs and their choice records."""
    with Store(db, readonly=True) as store:
        trials = {label: [{k: t[k] for k in KEYS} for t in tune.stored_trials(store, "tiny", label)]
                  for label in ("FedAvg", "FedProx")}
        sweeps = {s: sorted((r["label"], r["run_id"], r["status"]) for r in store.runs(sweep=s))
                  for s in ("tiny", "tiny/trials", "tiny/defaults")}
        finals = {r["run_id"]: [m["val_acc"] for m in store.round_metrics(r["run_id"])]
                  for s in ("tiny", "tiny/defaults") for r in store.runs(sweep=s)}
        choices = sorted((rid, json.dumps(d, sort_keys=True)) for rid, d in store.annotations("tune_choice"))
    return {"trials": trials, "sweeps": sweeps, "finals": finals, "choices": choices}


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """The tiny study (3 trials of FedAvg and FedProx, median pruner, 2 seeds, defaults) run locally."""
    tmp = tmp_path_factory.mktemp("local")
    db = tmp / "local.db"
    tune.run_study(tiny(tmp, tune_extra="defaults = true"), db, progress=False)
    return _study(db)


def test_the_executor_path_gives_the_local_study(tmp_path, local):
    ex = InlineExecutor()
    db = tmp_path / "inline.db"
    tune.run_study(tiny(tmp_path, tune_extra="defaults = true"), db, progress=False, executor=ex)
    got = _study(db)
    assert got == local                         # trials, prunings, choice, final runs and records, bit for bit
    pruned = [t for ts in got["trials"].values() for t in ts if t["state"] == "pruned"]
    assert pruned and all(t["rounds"] < 3 for t in pruned)        # the pruning happened inside the tasks
    trial_jobs = [j for j in ex.jobs.values() if j.trial is not None]
    assert len(trial_jobs) == 6 and len(ex.jobs) == 6 + 2 * 2 * 2   # 2 x 3 trials; 2 methods x 2 seeds x 2 sweeps
    # each method's trial n was shipped with the method's n trials before it: the pruner's whole state
    for j in trial_jobs:
        label, n = j.cfg["name"].split(" #")
        assert [t["trial"] for t in j.trial.history] == list(range(int(n) - 1))    # names count from 1
        assert all(t["label"] == label for t in j.trial.history)
    # the methods' trials were out at once: FedProx #1 was submitted before FedAvg #2
    order = [j.cfg["name"] for j in ex.jobs.values()]
    assert order.index("FedProx #1") < order.index("FedAvg #2")
    # again: nothing is asked or run, only the stored final runs come back as stored
    again = InlineExecutor()
    tune.run_study(tiny(tmp_path, tune_extra="defaults = true"), db, progress=False, executor=again)
    assert all(j.trial is None for j in again.jobs.values()) and _study(db) == local


class StopAfter(InlineExecutor):
    """The in-process backend whose driver is stopped (Ctrl-C) once `n` tasks came back."""

    def __init__(self, n):
        super().__init__()
        self.n, self.back = n, 0

    def wait(self, handles):
        if self.back >= self.n:
            raise KeyboardInterrupt
        return super().wait(handles)

    def result(self, handle):
        self.back += 1
        return super().result(handle)


def test_a_stopped_driver_loses_nothing_and_the_resumed_study_is_the_uninterrupted_one(tmp_path, local):
    db = tmp_path / "stopped.db"
    path = tiny(tmp_path, tune_extra="defaults = true")
    ex = StopAfter(3)
    with pytest.raises(KeyboardInterrupt):
        tune.run_study(path, db, progress=False, executor=ex)
    assert ex.cancelled                          # the tasks still out were cancelled
    with Store(db, readonly=True) as store:      # the three trials that came back are stored, with their records
        stored = [t for label in ("FedAvg", "FedProx") for t in tune.stored_trials(store, "tiny", label)]
    assert len(stored) == 3
    tune.run_study(path, db, progress=False, executor=InlineExecutor())
    assert _study(db) == local


def test_a_task_prunes_from_the_shipped_state_as_the_median_pruner_does():
    """One complete trial stored, with 0.5 at round 0 and 0.8 at round 1: from round 0 on (warm-up 0, one
    trial to start), a value below the stored one at that round is pruned, one at or above it is not."""
    history = [{"trial": 0, "params": {"lr": 0.01}, "state": "complete", "value": 0.8,
                "intermediate": {"0": 0.5, "1": 0.8}}]
    task = tune.TrialTask("val_acc", "median", 1, 0, {"lr": Space(0.001, 0.1, "log")}, history)
    assert tune._task_pruning(task)(0, 0.4) is True
    assert tune._task_pruning(task)(0, 0.5) is False
    report = tune._task_pruning(task)
    assert report(0, 0.6) is False and report(1, 0.7) is True
    late = tune.TrialTask("val_acc", "median", 1, 1, {"lr": Space(0.001, 0.1, "log")}, history)
    assert tune._task_pruning(late)(0, 0.1) is False                     # warm-up: not before round 1
    early = tune.TrialTask("val_acc", "median", 2, 0, {"lr": Space(0.001, 0.1, "log")}, history)
    assert tune._task_pruning(early)(0, 0.1) is False                    # startup: one complete trial < 2
    none = tune.TrialTask("val_acc", "none", 1, 0, {"lr": Space(0.001, 0.1, "log")}, history)
    assert tune._task_pruning(none)(0, 0.0) is False


def test_shipped_results_without_pruning_give_the_local_study(tmp_path):
    """--ray-store ship: each trial's task writes its own store and the driver merges it; with pruner = "none"
    (every trial's run finishes) the study is the local one."""
    from fedprism.experiment.executor import RayOptions

    path = tiny(tmp_path, trials=2, rounds=2, tune_extra='pruner = "none"')
    tune.run_study(path, tmp_path / "local.db", progress=False)

    class Ship(RayOptions):
        def executor(self):
            return InlineExecutor()

    scratch = tmp_path / "scratch"
    tune.run_study(path, tmp_path / "ship.db", progress=False,
                   ray=Ship("local", store="ship", scratch=str(scratch)))
    assert _study(tmp_path / "ship.db") == _study(tmp_path / "local.db")
    # the part stores of the 4 trials and of the 4 final runs, less the 2 final runs at the trials' seed (0):
    # those are the chosen trials' own runs
    assert len(list(scratch.glob("*.db"))) == 2 * 2 + 2 * 2 - 2


def test_shipped_results_are_refused_for_a_study_that_prunes(tmp_path):
    from fedprism.experiment.executor import RayOptions

    with pytest.raises(ConfigError, match="--ray-store.*shared for a study that prunes.*pruner = 'median'"):
        tune.run_study(tiny(tmp_path), tmp_path / "s.db", progress=False, ray=RayOptions("local", store="ship"))
    assert not (tmp_path / "s.db").exists()
    with pytest.raises(ConfigError, match="'--workers' = 2 is not valid: 1 with --ray"):
        tune.run_study(tiny(tmp_path), tmp_path / "s.db", progress=False, executor=InlineExecutor(), workers=2)


def test_a_busy_trial_names_the_study_and_the_trial(tmp_path):
    def busy(job):
        return {"run_id": job.cfg.run_id, "busy": "held by pid 7"} if job.trial is not None else run_job(job)

    with pytest.raises(Exception, match="tiny: FedAvg trial #1: held by pid 7; one `fedprism tune` process"):
        tune.run_study(tiny(tmp_path), tmp_path / "s.db", progress=False, executor=InlineExecutor(busy))


def test_cli_tune_takes_the_ray_options_and_checks_them_first(tmp_path):
    run = lambda *a: subprocess.run([sys.executable, "-m", "fedprism", "tune", "none.toml", *a],  # noqa: E731
                                    capture_output=True, text=True, cwd=tmp_path)
    r = run("--ray-gpus", "0.5")
    assert r.returncode == 2 and "--ray" in r.stderr and "none.toml" not in r.stderr, r.stderr
    r = run("--ray", "auto", "--ray-cpus", "0")
    assert r.returncode == 2 and "--ray-cpus" in r.stderr, r.stderr
    r = run("--ray", "auto", "--workers", "2")
    assert r.returncode == 2 and "'--workers' = 2 is not valid: 1 with --ray" in r.stderr, r.stderr


# -- on a Ray cluster ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_tune_on_a_loopback_cluster_gives_the_local_study(tmp_path, local):
    """A head without CPUs and one worker node of two CPUs (ray.cluster_utils.Cluster, on loopback): the
    command's trials, prunings, choice and final runs are the local study's."""
    pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        c.add_node(num_cpus=2)
        c.wait_for_nodes()
        db = tmp_path / "ray.db"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
        r = subprocess.run([sys.executable, "-m", "fedprism", "tune", str(tiny(tmp_path, tune_extra="defaults = true")),
                            "--db", str(db), "--ray", c.address, "--ray-cpus", "1"],
                           capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0, r.stderr
        assert "trials and final runs on the Ray cluster" in r.stderr
        assert _study(db) == local
    finally:
        c.shutdown()
