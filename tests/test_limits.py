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
from fedprism.algorithms import REGISTRY
from fedprism.experiment.limits import (available_memory, check_limits, check_memory, client_state_bytes,
                                         memory_terms)
from fedprism.textable import size_text as _gb
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
    # IFCA: K x (cohort + 1) = 5 x 26 copies of 10^7 float32 parameters = 5.2 GB > 1 GB
    with pytest.raises(ConfigError, match=r"ifca.k.*at most 1 here.*130 server model\(s\) of 10000000 float32 "
                       r"parameters \(ifca.k\)"):
        check_limits(cfg, n, num_params=10_000_000, memory=2 << 30)
    local = resolve({**BASE, "method": "local", "clients": 50})
    with pytest.raises(ConfigError, match=r"'clients' = 50.*at most 26 here for local.*40000000 bytes per client"):
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


#: LeNet-5's parameter count
LENET = 61_706


def _big(method: str, **kw):
    return resolve({**BASE, "method": method, "clients": 10_000, "fraction": 0.01, "partition.min_train": 1, **kw})


def test_ditto_with_ten_thousand_clients_is_refused_with_its_numbers():
    """Ditto keeps v_k, one model per client (`client_state = {"v": ("P",)}`): 61,706 float32 parameters
    = 246,824 bytes per client; 10,000 clients = 2,468,240,000 bytes, over half of 4 GiB (2,147,483,648);
    the most that fit: 2,147,483,648 // 246,824 = 8,700."""
    n = np.full(10_000, 6)
    with pytest.raises(ConfigError) as e:
        check_limits(_big("ditto"), n, LENET, memory=4 << 30)
    msg = str(e.value)
    assert (e.value.key, e.value.value) == ("clients", 10_000)
    for text in ("at most 8700 here for ditto", "v 61706 x 4 B", "246824 bytes per client x 10000 clients",
                 "2468240000 bytes (2.3 GB) in all", "(2.0 GB of 4.0 GB)"):
        assert text in msg, (text, msg)
    check_limits(_big("ditto"), n, LENET, memory=2 * 2_468_240_000)         # exactly half: admitted
    with pytest.raises(ConfigError):
        check_limits(_big("ditto"), n, LENET, memory=2 * 2_468_240_000 - 2)
    check_limits(_big("ditto").with_(clients=8700), np.full(8700, 6), LENET, memory=4 << 30)


def _declared_bytes(cls, P: int) -> int:
    """One client's row of every declared client state, by hand: elements x element size."""
    out = 0
    for decl in cls.client_state.values():
        elements = 1
        for s in decl.shape:
            elements *= P if s == "P" else int(s)
        out += elements * decl.dtype.itemsize
    return out


STATEFUL = [m for m in REGISTRY.names() if REGISTRY.is_builtin(m) and REGISTRY[m].client_state]   # not test plugins


def test_every_method_with_a_per_client_model_declares_it():
    """The rule reads the declarations: every method known to keep a model per client is among them."""
    assert {"apfl", "ditto", "fedbn", "fedper", "fedproto", "fedrep", "fedsoft", "fedsub", "lg_fedavg", "local",
            "pfedme", "pfpl", "protohar", "fedprism_dual"} <= set(STATEFUL)


@pytest.mark.parametrize("method", STATEFUL)
def test_client_state_memory_is_one_rule_for_every_method(method):
    """The same rule admits or refuses every method with client state: the declared bytes per client x
    clients plus its server models, against half the memory; refused with those numbers."""
    cls, N, P = REGISTRY[method], 10_000, LENET
    cfg = _big(method)
    per = _declared_bytes(cls, P)
    assert (per >= 4 * P or method == "fedem") and client_state_bytes(cls, P, N) == per   # FedEM: pi only
    need = sum(b for _, _, b in memory_terms(cfg, N, P))
    assert need >= N * per
    check_memory(cfg, N, P, mem=2 * need)                                      # fits exactly
    with pytest.raises(ConfigError) as e:
        check_memory(cfg, N, P, mem=2 * need - 2)
    msg = str(e.value)
    assert f"{per} bytes per client x {N} clients" in msg and f"{need} bytes" in msg, msg
    assert f"of {_gb(2 * need - 2)})" in msg and "at most" in msg
    if e.value.key == "clients":
        most = int(msg.split("at most ")[1].split(" ")[0])
        assert most < N
        check_memory(cfg.with_(clients=most), most, P, mem=2 * need - 2)      # the bound it names fits


@pytest.mark.parametrize("method", [m for m in REGISTRY.names() if REGISTRY.is_builtin(m)])
def test_every_method_passes_the_same_rule_with_room(method):
    cfg = resolve({**BASE, "method": method})
    check_memory(cfg, 6, 1000, mem=1 << 30)
    need = sum(b for _, _, b in memory_terms(cfg, 6, 1000))
    if need:
        with pytest.raises(ConfigError, match="more than half the available memory"):
            check_memory(cfg, 6, 1000, mem=2 * need - 2)


def test_client_limit_follows_state_storage():
    """fedprism_dual declares two models per client (private, expert): 2 x 61,706 x 4 = 493,648 bytes in
    memory, 246,824 at float16, none for mmap beyond a round's 100 rows; its server holds 3 x K = 15 models
    (3,702,360 bytes). Half of 4 GiB: (2,147,483,648 - 3,702,360) // 493,648 = 4,342 clients (8,685 at float16)."""
    n = np.full(10_000, 6)
    P = LENET
    dual = lambda st: _big("fedprism_dual", **{"state.storage": st})  # noqa: E731
    with pytest.raises(ConfigError, match=r"'clients' = 10000.*at most 4342 here.*private 61706 x 4 B, expert "
                       r"61706 x 4 B; state.storage=memory\): 493648 bytes per client"):
        check_limits(dual("memory"), n, P, memory=4 << 30)
    with pytest.raises(ConfigError, match=r"at most 8685 here.*x 2 B.*state.storage=float16\): 246824 bytes"):
        check_limits(dual("float16"), n, P, memory=4 << 30)
    check_limits(dual("mmap"), n, P, memory=4 << 30, disk=8 << 30)      # rows on disk, not in memory
    with pytest.raises(ConfigError, match=r"at most 4350 here.*state.storage=mmap.*493648 bytes per client.*on disk "
                       "beside the store"):
        check_limits(dual("mmap"), n, P, memory=4 << 30, disk=2 << 30)
    check_limits(dual("memory"), n, P, memory=16 << 30)
    seen = _big("fedprism_dual", **{"state.storage": "mmap", "fedprism_dual.cluster_on": "seen",
                                    "fedprism_dual.features": "full"})
    # every client's feature (d = P) kept and clustered in float64: 4 float32 models per client, 9.2 GB
    with pytest.raises(ConfigError, match=r"'fedprism_dual.cluster_on' = 'seen'.*another value.*40000 server "
                       r"model\(s\).*\(fedprism_dual.cluster_on\).*= 9.2 GB"):
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
        if "\n[tune]" in f.read_text():           # a tuning study: its runs are checked in tests/test_tune.py
            continue
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
