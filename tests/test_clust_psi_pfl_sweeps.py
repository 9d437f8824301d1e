"""The Clust-PSI-PFL (Jimenez-Gutierrez et al. 2025, arXiv:2512.20363) study files on the LeNet-5 protocol:
`clust_psi_pfl_guard_sampling.toml` (PSI guard x sampling, chosen on validation data) and
`clust_psi_pfl_lenet5_table3.toml` (the Table III rows not yet run): their full forms hold the protocol of
`clust_psi_pfl_fmnist_lenet5.toml`, and their [quick] forms run."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedprism.experiment.store import Store
from fedprism.experiment.sweep import load_sweep, run_sweep

SWEEPS = Path(__file__).resolve().parents[1] / "sweeps"
PROTOCOL = {"dataset": "fmnist", "model": "lenet5", "clients": 100, "rounds": 40, "fraction": 0.5,
            "local_epochs": 5, "batch_size": 32, "optimizer": "adam", "lr": 1e-3}
DIRS = (0.3, 0.2, 0.09)
NINE = {("dirichlet_per_class", a) for a in (50, 0.7, 0.3, 0.2, 0.09, 0.05)} | {("similarity", s) for s in (1.0, 0.03, 0.0)}


def _setting(c) -> tuple:
    return (c["partition"], c["partition.alpha"] if c["partition"] == "dirichlet_per_class" else c["partition.s"])


def test_guard_sampling_full_form_is_the_issue_grid_on_validation():
    name, cfgs = load_sweep(SWEEPS / "clust_psi_pfl_guard_sampling.toml")
    assert name == "clust_psi_pfl_guard_sampling"
    assert all(c[k] == v for c in cfgs for k, v in PROTOCOL.items())
    assert all(c["data.val_fraction"] == 0.1 for c in cfgs)
    ours = [c for c in cfgs if c["method"] == "clust_psi_pfl"]
    grid = {(c["partition.alpha"], c["seed"], c["clust_psi_pfl.smoothing"], c["clust_psi_pfl.eps"],
             c["clust_psi_pfl.sampling"], c["clust_psi_pfl.min_per_cluster"]) for c in ours}
    want = {(a, s, sm, e, sa, m) for a in DIRS for s in (0, 1)
            for sm, e in (("additive", 1e-6), ("laplace", 0.5), ("laplace", 1.0))
            for sa, m in (("global", 1), ("per_cluster", 2))}
    assert grid == want and len(ours) == len(want)
    avg = {(c["partition.alpha"], c["seed"]) for c in cfgs if c["method"] == "fedavg"}
    assert avg == {(a, s) for a in DIRS for s in (0, 1)} and len(cfgs) == len(ours) + 6
    # the committed rows of the LeNet-5 file are not re-used: every row here holds out validation data
    _, committed = load_sweep(SWEEPS / "clust_psi_pfl_fmnist_lenet5.toml")
    assert not {c.run_id for c in cfgs} & {c.run_id for c in committed}


def test_table3_full_form_has_six_baselines_in_nine_settings_with_table_ii_values():
    name, cfgs = load_sweep(SWEEPS / "clust_psi_pfl_lenet5_table3.toml")
    assert name == "clust_psi_pfl_lenet5_table3"
    assert all(c[k] == v for c in cfgs for k, v in PROTOCOL.items()) and {c["seed"] for c in cfgs} == {0}
    by = {}
    for c in cfgs:
        by.setdefault(c["name"].split(" |")[0], []).append(c)
    assert sorted(by) == sorted(["FedAdagrad", "FedYogi", "FedAdam", "PoC", "FedCLS", "CL"])
    assert all({_setting(c) for c in rows} == NINE and len(rows) == 9 for rows in by.values())
    assert {(c["fedavg.server_opt"], c["fedavg.server_tau"], c["fedavg.server_lr"]) for c in by["FedAdagrad"]} == \
        {("adagrad", 0.1, 0.3162)}
    assert {(c["fedavg.server_opt"], c["fedavg.server_tau"], c["fedavg.server_lr"]) for c in by["FedYogi"]} == \
        {("yogi", 0.01, 0.001)}
    assert {(c["fedavg.server_opt"], c["fedavg.server_tau"], c["fedavg.server_lr"]) for c in by["FedAdam"]} == \
        {("adam", 0.001, 0.001)}
    assert {(c["selection"], c["selection.d"]) for c in by["PoC"]} == {("poc", 80)}
    assert {(c["selection"], c["selection.tau"]) for c in by["FedCLS"]} == {("fedcls", 0.1)}
    assert {c["method"] for c in by["CL"]} == {"centralised"}
    assert all(c["partition.min_train"] == 1 for c in cfgs if _setting(c) == ("dirichlet_per_class", 0.05))
    # the same rows as the full-protocol file but for the model and kernels
    _, full = load_sweep(SWEEPS / "clust_psi_pfl_fmnist.toml")
    drop = {"model", "train.kernels", "eval.kernels", "name"}
    key = lambda c: repr(sorted((k, v) for k, v in c.values.items() if k not in drop))  # noqa: E731
    theirs = {key(c) for c in full if c["name"].split(" |")[0] in by and c["seed"] == 0}
    assert len(theirs) == 5 * 9 + 1                       # the full file's CL is its Dir 50 row
    assert theirs <= {key(c) for c in cfgs}


def _quick(tmp_path, name: str, only: str) -> list[dict]:
    db = tmp_path / "s.db"
    assert run_sweep(str(SWEEPS / f"{name}.toml"), str(db), only=only, quick=True, progress=False,
                     seeds=[0]) == 0
    with Store(db) as st:
        runs = st.runs()
        return [dict(r, psi=st.records(r["run_id"], "psi")) for r in runs]


def test_guard_sampling_quick_form_runs(tmp_path):
    runs = _quick(tmp_path, "clust_psi_pfl_guard_sampling", "laplace 1 per-cluster | Dir 0.2")
    assert len(runs) == 1 and runs[0]["status"] == "finished"
    d = runs[0]["psi"][0]["data"]
    assert d["smoothing"] == "laplace" and d["eps"] == 1.0 and d["tau"] >= 1


@pytest.mark.slow
@pytest.mark.parametrize("name, only, n", [("clust_psi_pfl_guard_sampling", "| Dir 0.2", 7),
                                           ("clust_psi_pfl_lenet5_table3", "| Dir 0.3", 6)])
def test_quick_forms_run_a_setting(tmp_path, name, only, n):
    runs = _quick(tmp_path, name, only)
    assert len(runs) == n and all(r["status"] == "finished" for r in runs)


def test_table3_quick_form_runs_the_selection_rules_and_cl(tmp_path):
    for i, only in enumerate(("PoC | S 0.03", "CL | S 0.03")):
        runs = _quick(tmp_path / str(i), "clust_psi_pfl_lenet5_table3", only)
        assert len(runs) == 1 and runs[0]["status"] == "finished"

