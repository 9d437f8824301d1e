"""Bounded resources: size keys beyond this data / this machine are ConfigErrors before any allocation;
a run whose every update is rejected says so (final['diverged'], CLI warning, `rejected` shown)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedprism.algorithms.ifca import choose
from fedprism.cli import main
from fedprism.errors import ConfigError
from fedprism.experiment.config import resolve
from fedprism.experiment.limits import available_memory, check_limits
from fedprism.experiment.runner import Experiment
from fedprism.experiment.store import Store

BASE = dict(dataset="digits", clients=6, rounds=2, fraction=0.5, local_epochs=1, engine="sequential")


def build(tmp_path, **kw):
    return Experiment(resolve({**BASE, **kw}), Store(tmp_path / "b.db"))


@pytest.mark.parametrize("kw,key,needle", [
    ({"method": "fedavg", "local_epochs": 10**9}, "local_epochs", "steps per client"),
    ({"method": "ifca", "ifca.k": 10**6}, "ifca.k", "at most clients=6"),
    ({"method": "fedprism", "fedprism.k": 7}, "fedprism.k", "at most clients=6"),
    ({"method": "fedprism_dual", "fedprism_dual.k": 10**6}, "fedprism_dual.k", "at most clients=6"),
    ({"method": "fedavg", "batch_size": 10**9}, "batch_size", "train samples"),
])
def test_size_keys_beyond_the_data_or_the_machine_are_config_errors(tmp_path, kw, key, needle):
    with pytest.raises(ConfigError) as e:
        build(tmp_path, **kw)
    assert e.value.key == key and needle in str(e.value) and "at most" in str(e.value)


def test_cluster_count_above_the_cohort_is_a_config_error_for_methods_that_cluster_a_round(tmp_path):
    """Fed-PRISM (and FedClust's periodic variant) clusters the round's clients; with fewer of them than K
    every re-clustering is skipped and the cluster models never leave the global model. clients=6 x
    fraction=0.5 = 3 clients a round."""
    m1 = {"fedprism": {"fedprism.m": 1}, "fedprism_dual": {"fedprism_dual.m": 1}, "fedclust": {}}
    for method in ("fedprism", "fedprism_dual", "fedclust"):
        with pytest.raises(ConfigError) as e:
            build(tmp_path, method=method, **{f"{method}.k": 4, **m1[method]})
        assert (e.value.key, e.value.value) == (f"{method}.k", 4) and "at most 3 here" in str(e.value)
        assert "clients=6 x fraction=0.5 gives 3 client(s) a round" in str(e.value)
        build(tmp_path, method=method, **{f"{method}.k": 3, **m1[method]})              # K = cohort: runs
    build(tmp_path, method="fedclust", **{"fedclust.k": 4, "fedclust.variant": "original"})   # all clients
    build(tmp_path, method="fedprism_dual", **{"fedprism_dual.k": 4, "fedprism_dual.cluster_on": "seen"})
    build(tmp_path, method="ifca", **{"ifca.k": 4})                   # IFCA: clients choose, nothing skipped
    assert not (tmp_path / "b.db").exists() or Store(tmp_path / "b.db").runs() == []


def test_cfl_with_one_client_a_round_is_a_config_error(tmp_path):
    """CFL's split test needs the mean update norm under eps1 and the largest over eps2: one client's
    update is both, so with eps1 <= eps2 it never splits."""
    with pytest.raises(ConfigError) as e:
        build(tmp_path, method="cfl", fraction=0.1)
    assert (e.value.key, e.value.value) == ("fraction", 0.1) and "at least 0.333333 for cfl with clients=6" \
        in str(e.value)
    build(tmp_path, method="cfl", fraction=0.34)                                   # two clients a round
    build(tmp_path, method="cfl", fraction=0.1, **{"cfl.eps1": 2.0, "cfl.eps2": 1.0})   # can split: allowed


def test_memory_bounds_use_the_parameter_count(tmp_path):
    cfg = resolve({**BASE, "method": "ifca", "ifca.k": 5, "clients": 50})
    n = np.full(50, 100)
    check_limits(cfg, n, num_params=1000, memory=8 << 30)                       # fits
    with pytest.raises(ConfigError, match=r"ifca.k.*at most 1 here.*cluster models of 10000000 parameters"):
        check_limits(cfg, n, num_params=10_000_000, memory=2 << 30)
    local = resolve({**BASE, "method": "local", "clients": 50})
    with pytest.raises(ConfigError, match=r"'clients' = 50.*at most 26 here for local"):
        check_limits(local, n, num_params=10_000_000, memory=2 << 30)
    # epochs cost work, not memory (lazy batch orders): 10^9 steps per client and round at most
    big = resolve({**BASE, "method": "fedavg", "local_epochs": 10**6, "clients": 50})
    check_limits(big, np.full(50, 10_000), num_params=10, memory=8 << 30)            # 313 * 10^6 steps: fits
    with pytest.raises(ConfigError, match=r"local_epochs.*at most 3194888 here.*313 steps per epoch"):
        check_limits(resolve({**BASE, "method": "fedavg", "local_epochs": 3194889, "clients": 50}),
                     np.full(50, 10_000), num_params=10, memory=8 << 30)
    with pytest.raises(ConfigError, match=r"local_epochs.*no epoch fits here"):         # cohort of 25
        check_limits(big, np.full(50, 10_000), num_params=10, memory=4 * (25 * (20 * 10_000 + 256 * 313)) - 4)
    assert available_memory() > 0


def test_client_limit_follows_state_storage():
    n = np.full(10_000, 6)
    P = 61_706                                   # LeNet-5
    dual = lambda st: resolve({**BASE, "method": "fedprism_dual", "clients": 10_000, "fraction": 0.01,  # noqa: E731
                               "partition.min_train": 1, "state.storage": st})
    with pytest.raises(ConfigError, match=r"'clients' = 10000.*at most 4350 here.*4 bytes per parameter"):
        check_limits(dual("memory"), n, P, memory=4 << 30)
    with pytest.raises(ConfigError, match=r"at most 8700 here.*2 bytes per parameter.*state.storage=float16"):
        check_limits(dual("float16"), n, P, memory=4 << 30)
    check_limits(dual("mmap"), n, P, memory=4 << 30, disk=8 << 30)      # rows on disk, not in memory
    with pytest.raises(ConfigError, match=r"at most 4350 here.*state.storage=mmap.*on disk beside the store"):
        check_limits(dual("mmap"), n, P, memory=4 << 30, disk=2 << 30)
    check_limits(dual("memory"), n, P, memory=16 << 30)
    seen = resolve({**BASE, "method": "fedprism_dual", "clients": 10_000, "fraction": 0.01, "state.storage": "mmap",
                    "fedprism_dual.cluster_on": "seen", "fedprism_dual.features": "full"})
    with pytest.raises(ConfigError, match=r"'fedprism_dual.cluster_on' = 'seen'.*features=last_layer.*9.2 GB"):
        check_limits(seen, n, P, memory=16 << 30, disk=8 << 30)
    check_limits(seen.with_(fedprism_dual__features="last_layer"), n, P, memory=16 << 30, disk=8 << 30)


def test_valid_sizes_still_run(tmp_path):
    exp = build(tmp_path, method="ifca", **{"ifca.k": 6})                     # k == clients
    assert exp.run().status == "finished"


def test_ifca_choice_survives_nan_losses():
    losses = np.array([[np.nan, np.nan], [np.nan, 1.0], [np.inf, 2.0], [3.0, 3.0]])
    j = choose(losses, np.arange(4), [0, 0])
    assert j[1] == 1 and j[2] == 1 and set(j) <= {0, 1}


@pytest.mark.parametrize("method", ["ifca", "fedavg", "local", "ditto"])
def test_exploding_learning_rates_finish_and_report_rejections(tmp_path, capsys, method):
    """local and ditto: a client whose new state (its own model) is NaN is rejected like a NaN upload and
    keeps its state; Local's run used to finish as not diverged, scored with NaN models."""
    db = str(tmp_path / "d.db")
    args = ["run", "--db", db, "dataset=digits", f"method={method}", "clients=6", "rounds=3", "local_epochs=1",
            "engine=sequential"] + (["ifca.k=2"] if method == "ifca" else [])
    assert main([*args, "lr=1e6", "--json"]) == 0                 # huge but finite weights: NaN losses downstream
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["status"] == "finished" and "rejected" in out
    assert main([*args, "lr=1e30", "--json"]) == 0      # every update non-finite: diverged
    cap = capsys.readouterr()
    out = json.loads(cap.out.strip().splitlines()[-1])
    assert out["diverged"] is True and out["rejected"] == 3 and out["status"] == "finished"
    assert "DIVERGED" in cap.err
    assert main([*args, "lr=1e30", "--quiet"]) == 0   # stored: table shows it
    text = capsys.readouterr().out
    assert "(DIVERGED)" in text and "rejected updates" in text


def test_a_run_that_diverges_after_learning_says_from_which_round(tmp_path, capsys):
    """Round 1's updates are finite (the loss explodes), every later one is rejected: the run stopped
    learning at round 2, and says so, although some update was accepted once."""
    args = ["run", "--db", str(tmp_path / "d.db"), "dataset=digits", "method=fedavg", "clients=10", "rounds=3",
            "local_epochs=1", "fraction=0.5", "lr=1000", "engine=sequential", "--json"]
    assert main(args) == 0
    cap = capsys.readouterr()
    out = json.loads(cap.out.strip().splitlines()[-1])
    assert out["diverged"] is True and out["diverged_round"] == 1 and out["rejected"] == 10
    assert "every update from round 2 on was rejected" in cap.err and "model after round 1" in cap.err
    assert main([*args[:-2], "lr=0.05", "--json"]) == 0       # a healthy run: no flag, no round
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["diverged"] is False and "diverged_round" not in out
    sweep = tmp_path / "s.toml"                                  # a sweep's line says it too
    sweep.write_text('name = "s"\n[base]\ndataset = "digits"\nclients = 10\nrounds = 3\nlocal_epochs = 1\n'
                     'fraction = 0.5\nengine = "sequential"\n[[runs]]\nmethod = "fedavg"\nlr = 1000\n')
    assert main(["sweep", str(sweep), "--db", str(tmp_path / "s.db")]) == 0
    assert "DIVERGED: every update from round 2 on was rejected" in capsys.readouterr().err


def test_a_diverged_evaluation_summarizes_without_numpys_empty_slice_warning():
    """Every client's loss NaN (a diverged model): the round's loss is NaN, and no RuntimeWarning reaches the
    user's terminal beside the run's own "DIVERGED" line; a partly NaN round keeps `np.nanmean`'s value."""
    import warnings

    import numpy as np

    from fedprism.experiment.evaluate import ClientScores, summarize

    def scores(loss):
        n = len(loss)
        return ClientScores(np.arange(n), np.full(n, 0.1), np.array(loss), np.full(n, np.nan), np.full(n, 10),
                            np.full(n, 0.1), np.full(n, 0.1), n)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = summarize(scores([np.nan, np.nan]))
        assert np.isnan(out["local_loss"]) and np.isnan(out["local_f1"])
        assert summarize(scores([np.nan, 2.0, 4.0]))["local_loss"] == 3.0


def test_no_sweep_file_asks_for_more_clusters_than_clients_a_round():
    """Every run of every sweep file in the repository, full size and `--quick`, passes the limits that
    depend on the configuration alone (the cohort check above among them), here with ample memory."""
    from pathlib import Path

    from fedprism.experiment.sweep import load_sweep

    files = sorted((Path(__file__).resolve().parents[1] / "sweeps").glob("*.toml"))
    assert len(files) >= 10
    for f in files:
        for quick in (False, True):
            for c in load_sweep(f, quick=quick)[1]:
                check_limits(c, np.full(c["clients"], 100), num_params=1000, memory=1 << 40, disk=1 << 40)


def test_the_flower_apps_default_experiment_passes_the_limits(tmp_path):
    """A Flower run without `experiment` in its run config runs this default: it must be one that the
    limits accept (it once had one client a round for Fed-PRISM's K = 5)."""
    from fedprism.experiment.config import parse_overrides
    from fedprism.flower.settings import RUN_KEYS

    cfg = resolve({**parse_overrides(RUN_KEYS["experiment"].default.split()), "engine": "sequential"})
    Experiment(cfg, Store(tmp_path / "f.db"))
