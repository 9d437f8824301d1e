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
    from fedprism.report.partition_study import write_partition_study

    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **kw: pytest.fail("loaded before the seeds"))
    for seeds in ((), (True,), (0.5,), (-1,)):
        with pytest.raises(ConfigError, match="option '--seed'"):
            write_partition_study("digits", tmp_path / "s", seeds=seeds, plots=False)
    assert not (tmp_path / "s").exists()
