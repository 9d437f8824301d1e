"""Runs of one name read differently: a sweep's progress lines and `fedprism runs` show the keys whose
values differ between runs that share a label (`fedprism.experiment.differ`)."""

from __future__ import annotations

import re

from fedprism.cli import main
from fedprism.experiment.differ import differing_keys, fmt, tell_apart
from fedprism.experiment.sweep import load_sweep, run_sweep


def test_tell_apart_by_hand():
    cfgs = [{"name": "FedAvg", "seed": 0, "partition.alpha": 0.1, "lr": 0.01, "threads": 1},
            {"name": "FedAvg", "seed": 1, "partition.alpha": 0.1, "lr": 0.01, "threads": 2},
            {"name": "FedAvg", "seed": 0, "partition.alpha": 0.5, "lr": 0.01, "threads": 1},
            {"name": "Local", "seed": 0, "partition.alpha": 0.9, "lr": 0.05},
            {"name": "Ditto", "seed": 0, "ditto.lam": True, "lr": 0.01},
            {"name": "Ditto", "seed": 0, "ditto.lam": False, "lr": 0.02}]
    # seeds and execution-only keys (threads) never tell runs apart; a unique name gets nothing
    assert tell_apart(cfgs) == ["partition.alpha=0.1", "partition.alpha=0.1", "partition.alpha=0.5", "",
                                "ditto.lam=true lr=0.01", "ditto.lam=false lr=0.02"]
    assert differing_keys(cfgs[:2]) == []
    assert differing_keys([{"a": 1}, {"a": 1, "b": 2}]) == ["b"]        # missing counts as a value
    assert tell_apart(cfgs[:3], names=["x", "y", "x"]) == ["partition.alpha=0.1", "", "partition.alpha=0.5"]
    assert [fmt(v) for v in (0.1, 1e-05, True, "kmeans", 3)] == ["0.1", "1e-05", "true", "kmeans", "3"]


SWEEP = """
name = "alphas"
[base]
method = "fedavg"
dataset = "digits"
model = "mlp"
engine = "sequential"
clients = 4
rounds = 1
local_epochs = 1
data = { train_subset = 400, test_subset = 200 }
partition = { name = "dirichlet", alpha = 0.5, min_train = 5, min_test = 2 }
[grid]
"partition.alpha" = [1.0, 5.0]
[[runs]]
label = "FedAvg"
[[runs]]
label = "Local"
method = "local"
"""


def test_sweep_progress_and_runs_name_the_differing_keys(tmp_path, capsys):
    f = tmp_path / "alphas.toml"
    f.write_text(SWEEP)
    db = tmp_path / "r.db"
    _, cfgs = load_sweep(f)
    assert [c["name"] for c in cfgs] == ["FedAvg", "FedAvg", "Local", "Local"]   # labels alone do not tell
    assert run_sweep(str(f), str(db), progress=False) == 0
    err = capsys.readouterr().err
    tags = re.findall(r"^(\[\d/4\] [^:]+): global", err, re.M)
    assert tags == ["[1/4] FedAvg partition.alpha=1 seed=0", "[2/4] FedAvg partition.alpha=5 seed=0",
                    "[3/4] Local partition.alpha=1 seed=0", "[4/4] Local partition.alpha=5 seed=0"]
    assert run_sweep(str(f), str(db), progress=False) == 0                        # skipped: the same tags
    assert "[2/4] FedAvg partition.alpha=5 seed=0: finished earlier, skipped" in capsys.readouterr().err

    assert main(["runs", "--db", str(db)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:5] == ["id", "method", "label", "differs", "seed"]
    rows = sorted(" ".join(ln.split()[1:5]) for ln in lines[2:])
    assert rows == ["fedavg FedAvg partition.alpha=1 0", "fedavg FedAvg partition.alpha=5 0",
                    "local Local partition.alpha=1 0", "local Local partition.alpha=5 0"]
    assert main(["runs", "--db", str(db), "--method", "local"]) == 0       # the keys among the rows shown
    out = capsys.readouterr().out
    assert "partition.alpha=1" in out and "partition.alpha=5" in out

    assert main(["runs", "--db", str(db), "--json"]) == 0
    import json
    assert sorted(d["differs"] for d in json.loads(capsys.readouterr().out)) == [
        "partition.alpha=1", "partition.alpha=1", "partition.alpha=5", "partition.alpha=5"]


def test_rows_that_differ_only_in_the_seed_keep_their_lines(tmp_path, capsys):
    f = tmp_path / "seeds.toml"
    f.write_text(SWEEP.replace('"partition.alpha" = [1.0, 5.0]', "seed = [0, 1]").replace(
        '[[runs]]\nlabel = "Local"\nmethod = "local"\n', ""))
    db = tmp_path / "r.db"
    assert run_sweep(str(f), str(db), progress=False) == 0
    assert re.findall(r"^(\[\d/2\] [^:]+): global", capsys.readouterr().err, re.M) == [
        "[1/2] FedAvg seed=0", "[2/2] FedAvg seed=1"]
    assert main(["runs", "--db", str(db)]) == 0
    assert capsys.readouterr().out.splitlines()[0].split()[:4] == ["id", "method", "label", "seed"]
