"""`fedprism tune` (src/fedprism/experiment/tune.py, docs/tuning.md): search spaces, study files, the
planted test-only signal, resumption after kill -9, and the committed study's quick form."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import fedprism
from fedprism.algorithms import REGISTRY
from fedprism.algorithms.spaces import SPACES
from fedprism.data.base import DATASETS
from fedprism.errors import ConfigError
from fedprism.experiment import tune
from fedprism.experiment.config import KEYS
from fedprism.experiment.store import Store
from fedprism.hparams import Space

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent / "plugins"))

import planted_signal_plugin as planted  # noqa: E402

TINY = """
name = "tiny"
[tune]
trials = {trials}
sampler = "{sampler}"
startup = 2
prune_startup = 1
seeds = [0, 1]
{tune_extra}
[base]
dataset = "digits"
model = "mlp"
clients = 6
rounds = {rounds}
fraction = 0.5
local_epochs = 1
"data.val_fraction" = 0.2
eval_every = 1
{base_extra}
[[methods]]
label = "FedAvg"
method = "fedavg"
[[methods]]
label = "FedProx"
method = "fedprox"
{methods_extra}
"""


def tiny(tmp_path, trials=3, sampler="tpe", rounds=3, tune_extra="", base_extra="", methods_extra="",
         name="s.toml") -> Path:
    p = tmp_path / name
    p.write_text(TINY.format(trials=trials, sampler=sampler, rounds=rounds, tune_extra=tune_extra,
                             base_extra=base_extra, methods_extra=methods_extra))
    return p


# -- spaces -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, msg", [
    (dict(low=1.0, high=1.0), "below high"),
    (dict(low=0.0, high=1.0, scale="log"), "log scale"),
    (dict(low=0.0, high=1.0, scale="cubic"), "linear or log"),
    (dict(low=0.5, high=3, integer=True), "whole-number"),
    (dict(low=0.0, high=1.0, choices=(1, 2)), "either"),
    (dict(choices=()), "either"),
    (dict(low=float("nan"), high=1.0), "finite"),
])
def test_space_refuses_bad_ranges(kw, msg):
    with pytest.raises(ValueError, match=msg):
        Space(**kw)


@pytest.mark.parametrize("method", sorted(SPACES))
def test_every_declared_space_lies_within_its_keys_checks(method):
    """Both ends of every built-in range (and every choice) are values its Param accepts: a trial never asks
    for a value the configuration refuses. Every method named in the table exists and has the key."""
    cls = REGISTRY[method]
    space = cls.search_space()
    assert set(space) == {f"{method}.{k}" for k in SPACES[method]}
    for key, sp in space.items():
        param = cls.params[key.split(".", 1)[1]]
        ends = sp.choices if sp.choices else (sp.low, sp.high)
        for v in ends:
            param.validate(key, int(v) if sp.integer else v)


def test_declared_space_of_a_method_joins_lr_its_own_and_a_params_space():
    assert tune.declared_space("fedavg") == {"lr": KEYS["lr"].space}
    fp = tune.declared_space("fedprox")
    assert fp["fedprox.mu"] == Space(1e-4, 1.0, "log") and fp["lr"] == Space(0.001, 0.3, "log")
    fedprism.register(planted.ShiftedFedAvg)
    try:       # a method written today declares its space beside its parameter
        assert planted.ShiftedFedAvg.search_space() == {"shifted_fedavg.shift": Space(choices=(0, 1))}
    finally:
        REGISTRY.pop("shifted_fedavg", None)


# -- study files --------------------------------------------------------------------------------------------
def test_study_file_spaces_are_overridden_and_removed(tmp_path):
    p = tiny(tmp_path, base_extra='\n[space]\nlr = { low = 0.01, high = 0.1, scale = "log" }\n'
             '[space.fedprox]\nmu = { choices = [0.0, 0.5] }',
             methods_extra='space = { lr = false }')
    study = tune.load_study(p)
    fedavg, fedprox = study.methods
    assert fedavg.space == {"lr": Space(0.01, 0.1, "log")}     # [space] applies; fedprox's key does not
    assert fedprox.space == {"fedprox.mu": Space(choices=(0.0, 0.5))}    # its own table removed lr


@pytest.mark.parametrize("tune_extra, base_extra, methods_extra, match", [
    ('objective = "local_acc"', "", "", "validation metric"),
    ('trails = 3', "", "", "did you mean 'trials'"),
    ('sampler = "sobol"', "", "", "tpe, random, grid"),
    ('seeds = [0, 0]', "", "", "distinct"),
    ("", '"data.val_fraction" = 0.0', "", "data.val_fraction"),
    ("", "", 'space = { "fedprox.muu" = { low = 0.1, high = 1.0 } }', "did you mean 'fedprox.mu'"),
    ("", "", 'space = { "fedavg.weighting" = { choices = ["samples"] } }', "a key of fedprox"),
    ("", "", 'space = { "fedprox.mu" = { low = -1.0, high = 1.0 } }', "fedprox.mu"),
    ("", "", 'space = { "fedprox.mu" = { low = 1.0, high = 0.1 } }', "below high"),
])
def test_study_file_errors_name_the_table_and_key(tmp_path, tune_extra, base_extra, methods_extra, match):
    p = tiny(tmp_path, methods_extra=methods_extra)
    text = p.read_text()
    for line in (tune_extra, base_extra):       # replaces the template's line of the same key, or adds it
        if line:
            key = line.split(" = ")[0]
            lines = [x for x in text.splitlines() if x.split(" = ")[0] == key]
            text = text.replace(lines[0], line) if lines else text.replace("[tune]\n", f"[tune]\n{line}\n")
    p.write_text(text)
    with pytest.raises(ConfigError, match=match):
        tune.load_study(p)


def test_a_trial_value_and_the_choice_come_from_validation_metrics_only():
    m = {"round": 3, "val_acc": 0.5, "global_val_acc": 0.4, "val_acc@backbone": 0.3, "local_acc": 0.9,
         "global_acc": 0.8, "local_acc@backbone": 0.7}
    assert tune.validation_metrics(m) == {"round": 3, "val_acc": 0.5, "global_val_acc": 0.4, "val_acc@backbone": 0.3}
    trials = [{"trial": 0, "state": "complete", "value": 0.5}, {"trial": 1, "state": "pruned", "value": 0.9},
              {"trial": 2, "state": "complete", "value": 0.7}, {"trial": 3, "state": "complete", "value": 0.7}]
    assert tune.choose(trials)["trial"] == 2           # pruned trials are never chosen; ties: the earlier


# -- a study end to end -------------------------------------------------------------------------------------
def test_tiny_study_stores_trials_chooses_the_best_and_runs_the_seeds(tmp_path):
    db = tmp_path / "s.db"
    study = tune.run_study(tiny(tmp_path, tune_extra="defaults = true"), db, progress=False)
    with Store(db, readonly=True) as store:
        for e in study.methods:
            trials = tune.stored_trials(store, "tiny", e.label)
            assert [t["trial"] for t in trials] == [0, 1, 2]
            assert {t["state"] for t in trials} <= {"complete", "pruned"}
            for t in trials:                       # each trial is a run of the trials sweep with its parameters
                cfg = json.loads(store.run(t["run_id"])["config"])
                assert {k: cfg[k] for k in t["params"]} == t["params"]
                rounds = store.round_metrics(t["run_id"])
                assert t["value"] == rounds[-1]["val_acc"]            # the last evaluated round's val_acc
                assert store.run(t["run_id"])["status"] == ("finished" if t["state"] == "complete" else "interrupted")
            labels = {r["label"] for r in store.runs(sweep="tiny/trials") if r["method"] == e.method}
            assert labels == {f"{e.label} #{n}" for n in (1, 2, 3)}       # named from 1, stored from 0
            best = tune.choose(trials)
            finals = [r for r in store.runs(sweep="tiny") if r["label"] == e.label]
            assert sorted(json.loads(r["config"])["seed"] for r in finals) == [0, 1]
            for r in finals:
                cfg = json.loads(r["config"])
                assert {k: cfg[k] for k in best["params"]} == best["params"]
                (rid, note), = [(i, d) for i, d in store.annotations("tune_choice") if i == r["run_id"]]
                assert note["trial"] == best["trial"] and note["value"] == best["value"]
                assert note["complete"] + note["pruned"] == 3 and note["budget"] == 3
    with Store(db, readonly=True) as store:    # the median pruner stopped some trials part-way (seeded: always)
        pruned = [t for e in study.methods for t in tune.stored_trials(store, "tiny", e.label) if t["state"] == "pruned"]
        assert pruned and all(store.run(t["run_id"])["rounds_done"] < 3 and max(map(int, t["intermediate"])) < 2
                              for t in pruned)
    # running it again runs nothing more: the budget is spent and the final runs are stored
    before = len(Store(db, readonly=True).runs())
    tune.run_study(tiny(tmp_path, tune_extra="defaults = true"), db, progress=False)
    assert len(Store(db, readonly=True).runs()) == before
    # the leaderboard of the chosen and the untuned configurations links each cell to what it ran
    from fedprism.report.leaderboard import write_leaderboard

    md = write_leaderboard(str(db), str(tmp_path / "lb"), ["tiny", "tiny/defaults"])[0].read_text()
    assert md.count("](#tuned-") == 4 and "| FedAvg |" in md and "| FedProx |" in md
    assert "untuned configuration of study `tiny`" in md and "`lr=0.01`" in md and "`fedprox.mu=0.01`" in md
    with Store(db, readonly=True) as store:
        best = tune.choose(tune.stored_trials(store, "tiny", "FedProx"))
    assert f"chosen: trial #{best['trial'] + 1} of study `tiny` (run `{best['run_id']}`)" in md
    # the summary's number is the run's name and the leaderboard's: one trial, one number, from 1
    with Store(db, readonly=True) as store:
        (line,) = [x for x in tune.summary(store, study) if x.startswith("  FedProx:")]
        named = {r["run_id"]: r["label"] for r in store.runs(sweep="tiny/trials")}
    assert f"chose #{best['trial'] + 1} " in line and named[best["run_id"]] == f"FedProx #{best['trial'] + 1}"
    # the study travels with a store dump (what git holds) and is rebuilt from it as it was
    from fedprism.experiment.archive import dump, load

    dump(db, tmp_path / "dump")
    load(tmp_path / "dump", tmp_path / "loaded.db")
    with Store(db, readonly=True) as a, Store(tmp_path / "loaded.db", readonly=True) as b:
        for e in study.methods:
            assert tune.stored_trials(a, "tiny", e.label) == tune.stored_trials(b, "tiny", e.label)
        assert a.annotations("tune_choice") == b.annotations("tune_choice")


def test_a_rebuilt_study_asks_what_a_continuous_one_asked(tmp_path):
    """Trial n's parameters depend on the stored trials before it and the study seed only: a study run in
    two parts (the second a fresh process would be) asks exactly what one run in one go asks."""
    one, two = tmp_path / "one.db", tmp_path / "two.db"
    tune.run_study(tiny(tmp_path, trials=4), one, stage="tune", progress=False, only=["FedProx"])
    tune.run_study(tiny(tmp_path, trials=2), two, stage="tune", progress=False, only=["FedProx"])
    tune.run_study(tiny(tmp_path, trials=4), two, stage="tune", progress=False, only=["FedProx"])
    with Store(one, readonly=True) as a, Store(two, readonly=True) as b:
        ta, tb = tune.stored_trials(a, "tiny", "FedProx"), tune.stored_trials(b, "tiny", "FedProx")
    strip = lambda ts: [{k: t[k] for k in ("trial", "params", "state", "value", "intermediate", "run_id")} for t in ts]  # noqa: E731
    assert strip(ta) == strip(tb) and len(ta) == 4
    assert len({json.dumps(t["params"], sort_keys=True) for t in ta}) == 4       # and they are not one point


def test_a_test_only_signal_cannot_change_the_choice(tmp_path):
    """The planted method is right on validation data at shift=0 and right on test data at shift=1 (the test
    labels are shifted): both shifts are tried, the test metrics favour 1 by far, and the study chooses 0."""
    fedprism.register(planted.ShiftedFedAvg)
    fedprism.register_dataset("planted", planted.SPEC)
    try:
        p = tmp_path / "planted.toml"
        p.write_text("""
name = "planted"
[tune]
trials = 4
sampler = "random"
pruner = "none"
seeds = [0]
[base]
dataset = "planted"
model = "mlp"
partition = "iid"
clients = 4
rounds = 4
fraction = 1.0
local_epochs = 3
lr = 0.1
"data.val_fraction" = 0.2
[space]
lr = false
[[methods]]
label = "Shifted"
method = "shifted_fedavg"
""")
        db = tmp_path / "p.db"
        tune.run_study(p, db, progress=False)
        with Store(db, readonly=True) as store:
            trials = tune.stored_trials(store, "planted", "Shifted")
            by_shift = {}
            for t in trials:
                final = json.loads(store.run(t["run_id"])["final"])
                by_shift[t["params"]["shifted_fedavg.shift"]] = (t["value"], final["local_acc"], final["global_acc"])
            assert set(by_shift) == {0, 1}
            assert by_shift[1][1] > by_shift[0][1] + 0.5 and by_shift[1][2] > by_shift[0][2] + 0.5   # test: 1
            assert by_shift[0][0] > by_shift[1][0] + 0.5                                               # val: 0
            assert tune.choose(trials)["params"] == {"shifted_fedavg.shift": 0}
            (final,) = store.runs(sweep="planted")
            assert json.loads(final["config"])["shifted_fedavg.shift"] == 0
    finally:
        REGISTRY.pop("shifted_fedavg", None)
        DATASETS.pop("planted", None)


def _trial_state(db: Path) -> tuple[int, int]:
    """(trial records, rounds stored by the running trial run) of the store at `db` (0, 0 before it exists)."""
    if not db.exists():
        return 0, 0
    try:
        with Store(db, readonly=True) as store:
            done = len(store.annotations("tune_trial"))
            running = [r["rounds_done"] for r in store.runs(sweep="tiny/trials") if r["status"] == "running"]
        return done, max(running, default=0)
    except Exception:  # noqa: BLE001 - the writer may be creating the file
        return 0, 0


@pytest.mark.slow
def test_kill_9_mid_study_then_resume_gives_the_uninterrupted_study(tmp_path):
    """SIGKILL to `fedprism tune` while its second trial is part-way through; the same command again
    finishes the study with the trials, values and choice of a study that was never stopped."""
    study = tiny(tmp_path, trials=3, rounds=12, tune_extra="prune_warmup = 20")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "fedprism", "tune", str(study), "--only", "FedAvg", "--stage", "tune", "--quiet"]
    killed = tmp_path / "killed.db"
    proc = subprocess.Popen(cmd + ["--db", str(killed)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        done, rounds = _trial_state(killed)
        if done >= 1 and rounds >= 3:
            break
        time.sleep(0.02)
    assert proc.poll() is None, f"the study ended before it could be killed: {proc.stderr.read().decode()[-2000:]}"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    done, rounds = _trial_state(killed)
    assert done == 1 and rounds >= 3                   # killed inside trial 2, which had stored rounds
    subprocess.run(cmd + ["--db", str(killed)], env=env, check=True, capture_output=True)
    whole = tmp_path / "whole.db"
    subprocess.run(cmd + ["--db", str(whole)], env=env, check=True, capture_output=True)
    with Store(killed, readonly=True) as a, Store(whole, readonly=True) as b:
        ta, tb = tune.stored_trials(a, "tiny", "FedAvg"), tune.stored_trials(b, "tiny", "FedAvg")
        resumed = [r for r in a.runs(sweep="tiny/trials")]
        assert len(resumed) == 3 and all(r["status"] == "finished" for r in resumed)
    keys = ("trial", "params", "state", "value", "intermediate", "run_id")
    assert [{k: t[k] for k in keys} for t in ta] == [{k: t[k] for k in keys} for t in tb]


# -- the committed study ------------------------------------------------------------------------------------
def test_the_committed_study_file_declares_the_issue_s_study():
    study = tune.load_study(ROOT / "sweeps" / "tune_fmnist_dir01.toml")
    assert study.trials >= 12 and study.seeds == [0, 1, 2] and study.objective == "val_acc"
    assert [m.method for m in study.methods] == ["fedavg", "fedprox", "ditto", "fedrep", "apfl", "clust_psi_pfl",
                                                 "fedprism_dual", "fedprism"]
    cfg = study.config(study.methods[0], None)
    assert (cfg["dataset"], cfg["partition"], cfg["partition.alpha"], cfg["clients"], cfg["rounds"], cfg["model"]) \
        == ("fmnist", "dirichlet", 0.1, 20, 30, "lenet5")
    assert all(m.space for m in study.methods)


def test_the_committed_study_s_quick_form_runs(tmp_path):
    db = tmp_path / "q.db"
    study = tune.run_study(ROOT / "sweeps" / "tune_fmnist_dir01.toml", db, quick=True, progress=False)
    with Store(db, readonly=True) as store:
        for e in study.methods:
            assert len(tune.stored_trials(store, study.name, e.label)) == study.trials
        assert len(store.runs(sweep=study.name)) == len(study.methods) * len(study.seeds)


def test_fedprism_methods_shows_where_a_key_is_tuned(capsys):
    from fedprism.cli import main

    assert main(["methods", "fedprox"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "tuned in [0.0001, 1] log" in out


def test_a_space_whose_end_a_run_would_refuse_stops_the_study_before_any_trial(tmp_path):
    """FedPrism at k = 2 trains on a cohort of 3; its space reaches k = 5, more clusters than the cohort
    (the limits refuse it): the study stops at once, naming the method and the value, and runs nothing."""
    p = tiny(tmp_path, methods_extra='[[methods]]\nlabel = "FedPrism"\nmethod = "fedprism_dual"\n'
             '"fedprism_dual.k" = 2\nspace = { "fedprism_dual.k" = { low = 2, high = 5, integer = true }, '
             'lr = false, "fedprism_dual.alpha" = false, "fedprism_dual.beta" = false, '
             '"fedprism_dual.temperature" = false }')
    db = tmp_path / "r.db"
    with pytest.raises(ConfigError, match=r"FedPrism at fedprism_dual.k=5.*fedprism_dual.k"):
        tune.run_study(p, db, progress=False)
    assert not db.exists() or not Store(db, readonly=True).runs()


def test_command_line_overrides_apply_to_every_run_as_in_a_sweep(tmp_path):
    p = tiny(tmp_path, base_extra='partition = { name = "dirichlet", alpha = 0.5 }')
    study = tune.load_study(p, overrides={"partition": "iid", "rounds": 2})
    cfg = study.config(study.methods[1], {"fedprox.mu": 0.5, "lr": 0.02}, seed=3)
    assert (cfg["partition"], cfg["rounds"], cfg["seed"], cfg["fedprox.mu"], cfg["lr"]) == ("iid", 2, 3, 0.5, 0.02)
    assert "partition.alpha" not in cfg.values


@pytest.mark.slow
def test_methods_tuned_in_worker_processes_give_the_sequential_study(tmp_path):
    one, two = tmp_path / "one.db", tmp_path / "two.db"
    tune.run_study(tiny(tmp_path), one, stage="tune", progress=False)
    tune.run_study(tiny(tmp_path), two, stage="tune", progress=False, workers=2)
    keys = ("trial", "params", "state", "value", "intermediate", "run_id")
    with Store(one, readonly=True) as a, Store(two, readonly=True) as b:
        for label in ("FedAvg", "FedProx"):
            assert [{k: t[k] for k in keys} for t in tune.stored_trials(a, "tiny", label)] == \
                [{k: t[k] for k in keys} for t in tune.stored_trials(b, "tiny", label)]


def test_the_progress_line_counts_trials_from_one_as_names_and_records_do(tmp_path, monkeypatch, capsys):
    """Stored trial 2 (the third) prints as `trial 3/3`, the number of its run `FedAvg #3`."""
    import fedprism.experiment.store as store_module

    stored = []

    class Recording:                                 # the store's side of `_record`: what it annotates
        def __init__(self, db):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def annotate(self, run_id, kind, data, slot):
            stored.append(data)

    study = tune.load_study(tiny(tmp_path))
    monkeypatch.setattr(store_module, "Store", Recording)
    out = tune.TrialOutcome("r" * 16, "complete", 0.5, {0: 0.4, 2: 0.5}, 3)
    tune._record(tmp_path / "s.db", study, study.entry("FedAvg"), 2, {"lr": 0.1}, out, 0.0, progress=True)
    assert "FedAvg trial 3/3: complete" in capsys.readouterr().err
    assert stored[0]["trial"] == 2 and tune.trial_name("FedAvg", 2) == "FedAvg #3"


@pytest.mark.parametrize("edit, overrides, match", [
    # the file is fine; the command line's override made it invalid: the override is blamed, not [base]
    (None, {"data.val_fraction": 0.0}, r"^command line: data\.val_fraction 0\.0 is not valid: > 0 \(set by the "
     r"command line override data\.val_fraction=0\.0: change it there\)"),
    ('"data.val_fraction" = 0.0', {}, r"^s\.toml: data\.val_fraction 0\.0 is not valid: > 0 \(set by s\.toml's \[base\]"),
    ("", {}, r"^s\.toml: data\.val_fraction 0\.0 is not valid: > 0 \(set by the default: set it > 0 in s\.toml's "
     r"\[base\]\)"),
    (None, {"lr": -1.0}, r"^command line: FedAvg: lr -1\.0 is not valid: .*\(set by the command line override "
     r"lr=-1\.0: change it there\)"),
])
def test_an_invalid_value_names_where_it_was_set(tmp_path, edit, overrides, match):
    p = tiny(tmp_path)
    if edit is not None:                     # None: the file as it is (data.val_fraction = 0.2 in [base])
        p.write_text(p.read_text().replace('"data.val_fraction" = 0.2', edit))
    with pytest.raises(ConfigError, match=match):
        tune.load_study(p, overrides=overrides)


def test_study_source_follows_the_layering_of_config(tmp_path):
    p = tiny(tmp_path, methods_extra='"fedprox.mu" = 0.1\n"data.val_fraction" = 0.3')
    study = tune.load_study(p, overrides={"rounds": 2})
    fedavg, fedprox = study.methods
    assert study.source(fedavg, "rounds") == "the command line override rounds=2"
    assert study.source(fedprox, "data.val_fraction") == "s.toml's [[methods]] table 'FedProx'"
    assert study.source(fedavg, "data.val_fraction") == "s.toml's [base]"
    assert study.source(fedprox, "fedprox.mu", {"fedprox.mu": 0.5}) == "the search space"
    assert study.source(fedavg, "local_epochs") == "s.toml's [base]" and study.source(fedavg, "seed") == "the default"


def test_the_grid_sampler_asks_every_point_once_in_order(tmp_path):
    """sampler = "grid": trial n is the n-th point of the choices' product (keys sorted), no point twice,
    and a method's trials stop at its grid's size when that is below the budget."""
    p = tiny(tmp_path, trials=5, sampler="grid", rounds=1, tune_extra="pruner = \"none\"",
             methods_extra='space = { "fedprox.mu" = { choices = [0.01, 1.0] } }')
    p.write_text(p.read_text().replace("[base]", "[space]\nlr = { choices = [0.05, 0.1] }\n[base]"))
    db = tmp_path / "s.db"
    study = tune.run_study(p, db, progress=False)
    with Store(db, readonly=True) as store:
        fedavg = [t["params"] for t in tune.stored_trials(store, "tiny", "FedAvg")]
        fedprox = [t["params"] for t in tune.stored_trials(store, "tiny", "FedProx")]
    assert fedavg == [{"lr": 0.05}, {"lr": 0.1}]                                   # 2 points < 5 trials
    assert fedprox == [{"fedprox.mu": 0.01, "lr": 0.05}, {"fedprox.mu": 0.01, "lr": 0.1},
                       {"fedprox.mu": 1.0, "lr": 0.05}, {"fedprox.mu": 1.0, "lr": 0.1}]
    assert [e.label for e in study.methods] == ["FedAvg", "FedProx"]


def test_the_grid_sampler_refuses_a_continuous_range(tmp_path):
    p = tiny(tmp_path, sampler="grid")                    # lr's declared space is a log range
    with pytest.raises(ConfigError, match="lists of choices only: FedAvg's lr is the range"):
        tune.load_study(p)
