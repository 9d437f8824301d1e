"""Input checks of `fedprism demo` and `fedprism report --partition-study`: what the user asked for is
what runs, or a one-line ConfigError (exit status 2) before anything is trained or written."""

from __future__ import annotations

import pytest

from fedprism.cli import main
from fedprism.errors import ConfigError


@pytest.fixture(autouse=True)
def no_training(monkeypatch):
    """Nothing here may train: a run that starts fails the test at once instead of taking minutes."""
    import fedprism.experiment.runner as runner
    import fedprism.experiment.sweep as sweep

    def trained(*a, **kw):
        raise AssertionError("the demo started training")

    monkeypatch.setattr(sweep, "run_in_workers", trained)
    monkeypatch.setattr(runner.Experiment, "run", trained)


def _refused(argv, capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fedprism: error: ") and "\n" not in err, err
    return err


def test_demo_refuses_an_unknown_dataset_with_the_configs_own_message(tmp_path, capsys):
    from fedprism.experiment.config import resolve

    db = tmp_path / "d.db"
    with pytest.raises(ConfigError) as want:
        resolve({"dataset": "nosuch"})
    err = _refused(["demo", "--db", str(db), "dataset=nosuch"], capsys)
    assert err == f"fedprism: error: {want.value}"
    assert "'dataset' = 'nosuch'" in err and "fmnist" in err and "digits" in err and "cifar10" in err
    err = _refused(["demo", "--quick", "--db", str(db), "dataset="], capsys)     # empty: not the default
    assert "'dataset' = ''" in err
    assert not db.exists()


def test_demo_refuses_a_known_dataset_it_has_no_sizes_for(tmp_path, capsys):
    from fedprism.experiment.demo import demo_configs

    db = tmp_path / "d.db"
    for ds in ("cifar10", "mnist", "synthetic"):
        err = _refused(["demo", "--quick", "--db", str(db), f"dataset={ds}"], capsys)
        assert f"config key 'dataset' = '{ds}' is not valid: fmnist or digits" in err
        assert f"fedprism run dataset={ds}" in err and "fedprism sweep" in err
        with pytest.raises(ConfigError, match="fmnist or digits"):
            demo_configs(ds, quick=True)                    # not the digits runs under another name
    assert not db.exists()


def test_demo_runs_and_names_the_dataset_it_was_given(tmp_path, monkeypatch, capsys):
    import fedprism.experiment.sweep as sweep
    from fedprism.experiment.demo import demo_configs

    for ds in ("fmnist", "digits"):
        assert {c["dataset"] for c in demo_configs(ds)} == {ds}
        assert {c["dataset"] for c in demo_configs(ds, quick=True)} == {ds}
    seen = []

    def fake(db, sweep_name, items, workers):          # the runs' configs, no training
        seen.extend(c for _, c in items)
        return ((name, {"seconds": 0.0}) for name, _ in items)

    monkeypatch.setattr(sweep, "run_in_workers", fake)
    for ds in ("fmnist", "digits"):                        # nothing trains, so fmnist needs no files here
        seen.clear()
        assert main(["demo", "--quick", "--db", str(tmp_path / "d.db"), f"dataset={ds}"]) == 0
        assert capsys.readouterr().err.startswith(f"fedprism demo: {ds}, 10 clients")
        assert len(seen) == 9 and {c["dataset"] for c in seen} == {ds}


@pytest.mark.parametrize("item", ["method=fedavg", "name=mine", "fedprism.k=5", "fedprism.clustering=ward",
                                  "fedprism_dual.private_source=full", "fedclust.every=2"])
def test_demo_refuses_overrides_of_the_keys_it_sets_per_run(tmp_path, monkeypatch, capsys, item):
    import fedprism.experiment.demo as demo

    key, value = item.split("=")
    db = tmp_path / "d.db"
    err = _refused(["demo", "--quick", "--db", str(db), "dataset=digits", item], capsys)
    assert f"config key '{key}' =" in err and "set by the demo for each run" in err
    assert "compares fixed methods" in err and "fedprism run" in err and "fedprism sweep" in err
    monkeypatch.setattr(demo, "default_dataset", lambda: pytest.fail("looked for Fashion-MNIST first"))
    err = _refused(["demo", "--db", str(db), item], capsys)     # before the default dataset is loaded
    assert "set by the demo for each run" in err
    assert not db.exists()


def test_demo_gives_a_methods_own_parameter_to_that_methods_runs_only(capsys):
    from fedprism.experiment.demo import demo_configs

    cfgs = demo_configs("digits", quick=True, overrides={"fedprism_dual.inference_weight": 1.0, "seed": 3})
    assert [c.get("fedprism_dual.inference_weight") for c in cfgs] == [1.0] + [None] * 8
    assert {c["seed"] for c in cfgs} == {3}
    assert _refused(["demo", "--quick", "dataset=digits", "fedsoft.k=2"], capsys).endswith(
        "a parameter of a method the demo runs (fedprism_dual, fedprism, fedclust, fedavg, local); "
        "run fedsoft with `fedprism run method=fedsoft` or `fedprism sweep`")


@pytest.mark.parametrize("seeds, allowed", [(["-1"], "an integer >= 0"),
                                            (["0", "-3"], "an integer >= 0"),
                                            ([str(2**63)], "an integer of magnitude below 2**63"),
                                            (["1", "1"], "distinct seeds")])
def test_partition_study_refuses_a_bad_seed_before_writing(tmp_path, capsys, seeds, allowed):
    out = tmp_path / "study"
    argv = ["report", "--partition-study", "digits", "--out", str(out), "--no-plots"]
    for s in seeds:
        argv += ["--seed", s]
    err = _refused(argv, capsys)
    assert f"fedprism: error: option '--seed' = {seeds[-1]} is not valid: {allowed}" in err
    assert not out.exists()


def test_write_partition_study_checks_its_seeds_first(tmp_path, monkeypatch):
    import fedprism.data.datasets as datasets
    from fedprism.algorithms.clust_psi_pfl.study import write_partition_study

    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **kw: pytest.fail("loaded before the seeds"))
    for seeds in ((), (True,), (0.5,), (-1,)):
        with pytest.raises(ConfigError, match="option '--seed'"):
            write_partition_study("digits", tmp_path / "s", seeds=seeds, plots=False)
    assert not (tmp_path / "s").exists()


def _recipe_as_it_was_written_in_code(dataset: str, quick: bool) -> list[tuple[str, dict]]:
    """The demo's runs as experiment/demo.py spelled them before they moved to demo.toml (the runs the
    stored demo results have): a second, independent statement of the recipe."""
    if dataset == "fmnist":
        base = {"dataset": "fmnist", "data.train_subset": 9000, "data.test_subset": 2000, "clients": 30,
                "fraction": 0.34, "rounds": 12, "local_epochs": 2, "batch_size": 32, "lr": 0.01, "momentum": 0.9,
                "partition": "dirichlet", "partition.alpha": 0.3, "eval_every": 5}
    else:
        base = {"dataset": "digits", "clients": 20, "fraction": 0.5, "rounds": 20, "local_epochs": 2,
                "batch_size": 16, "lr": 0.05, "momentum": 0.9, "partition": "dirichlet", "partition.alpha": 0.3,
                "eval_every": 5}
    if quick:
        base.update({"rounds": 3, "eval_every": 1, "data.train_subset": 3000 if dataset == "fmnist" else 0,
                     "clients": 10, "fraction": 0.5})
    k = {"fedprism.k": 3, "fedprism.m": 2, "fedprism.every": 5, "fedprism.alpha": 0.5}
    runs = [("FedPrism (paper, routed)", {"method": "fedprism_dual", "fedprism_dual.k": 3, "fedprism_dual.every": 5,
                                          "fedprism_dual.private_source": "specialist"}),
            *[(f"Fed-PRISM {c}", {"method": "fedprism", **k, "fedprism.clustering": c})
              for c in ("kmeans", "ward", "average", "single", "covariance")],
            ("FedClust", {"method": "fedclust", "fedclust.k": 3, "fedclust.every": 5}),
            ("FedAvg", {"method": "fedavg"}), ("Local", {"method": "local"})]
    return [(label, {**base, **r, "name": label}) for label, r in runs]


@pytest.mark.parametrize("dataset", ["fmnist", "digits"])
@pytest.mark.parametrize("quick", [False, True])
def test_the_demo_recipe_file_gives_the_runs_the_code_gave(dataset, quick):
    """demo.toml resolves to the same runs, in the same order and under the same names (so the same run
    ids: a store holding the demo's results finds them again) as the recipe it replaced."""
    from fedprism.experiment.config import resolve
    from fedprism.experiment.demo import DATASETS, METHODS, PER_RUN_KEYS, demo_configs

    got = demo_configs(dataset, quick)
    want = [resolve(raw) for _, raw in _recipe_as_it_was_written_in_code(dataset, quick)]
    assert [c["name"] for c in got] == [c["name"] for c in want]
    assert [dict(c.values) for c in got] == [dict(c.values) for c in want]
    assert [c.run_id for c in got] == [c.run_id for c in want]
    assert DATASETS == ("fmnist", "digits")
    assert METHODS == ("fedprism_dual", "fedprism", "fedclust", "fedavg", "local")
    assert PER_RUN_KEYS == {"method", "name", "fedprism_dual.k", "fedprism_dual.every",
                            "fedprism_dual.private_source", "fedprism.k", "fedprism.m", "fedprism.every",
                            "fedprism.alpha", "fedprism.clustering", "fedclust.k", "fedclust.every"}


def test_the_demo_recipe_is_shipped_with_the_package():
    """demo.toml is package data (pyproject.toml), so an installed (non-editable) fedprism has it."""
    import fnmatch
    import tomllib
    from pathlib import Path

    from fedprism.experiment.demo import RECIPE_FILE

    root = Path(__file__).resolve().parents[1]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["fedprism"]
    rel = RECIPE_FILE.relative_to(root / "src" / "fedprism").as_posix()
    assert RECIPE_FILE.is_file() and any(fnmatch.fnmatch(rel, g) for g in globs)
