"""Round loop, results store, resume, bad updates, failing clients, config validation."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fedprism.errors import ConfigError
from fedprism.experiment.config import parse_overrides, resolve
from fedprism.experiment.runner import Experiment, sample_clients
from fedprism.experiment.store import Store
from fedprism.protocol import Plan

SMALL = dict(dataset="digits", clients=8, rounds=4, fraction=0.5, local_epochs=1, batch_size=16, lr=0.05,
             partition="dirichlet", **{"partition.alpha": 0.5}, engine="sequential")


def cfg(**kw):
    return resolve({**SMALL, **{k.replace("__", "."): v for k, v in kw.items()}})


def test_sampling_is_shared_and_deterministic():
    a = sample_clients(3, 7, 100, 0.1)
    assert len(a) == 10 and len(set(a)) == 10
    assert np.array_equal(a, sample_clients(3, 7, 100, 0.1))
    assert not np.array_equal(a, sample_clients(3, 8, 100, 0.1))
    assert len(sample_clients(0, 0, 5, 0.01)) == 1          # m_t = max(floor(qN), 1)


def test_run_stores_everything_and_second_run_is_a_noop(tmp_path):
    store = Store(tmp_path / "r.db")
    c = cfg(method="fedprism", fedprism__k=2, fedprism__m=1, fedprism__every=2)
    res = Experiment(c, store).run()
    assert res.status == "finished" and 0 <= res.final["local_acc"] <= 1
    assert len(store.round_metrics(c.run_id)) == 4
    rows = store.client_rows(c.run_id)
    assert len(rows) == 8 and all(r["n_test"] >= 1 for r in rows)
    assert store.records(c.run_id, "clusters")
    again = Experiment(c, store).run()
    assert again.final == res.final and len(store.round_metrics(c.run_id)) == 4
    assert not store.ckpt_dir.exists() or not any(store.ckpt_dir.iterdir())


@pytest.mark.parametrize("method", ["fedprism", "local"])
def test_resumed_run_equals_uninterrupted(tmp_path, method):
    c = cfg(method=method, **({"fedprism__k": 2} if method == "fedprism" else {}))   # K <= 4 clients a round
    full = Experiment(c, Store(tmp_path / "a.db")).run()
    s = Store(tmp_path / "b.db")
    part = Experiment(c, s).run(stop_after=2)
    assert part.status == "interrupted" and s.run(c.run_id)["status"] == "interrupted"
    resumed = Experiment(c, s).run()
    assert resumed.resumed_from == 1
    for k in ("local_acc", "global_acc", "sdad"):
        assert resumed.final[k] == pytest.approx(full.final[k], abs=1e-9)
    assert [h["local_acc"] for h in s.round_metrics(c.run_id)] == \
        pytest.approx([h["local_acc"] for h in Store(tmp_path / "a.db").round_metrics(c.run_id)])


def test_torn_checkpoint_restarts_cleanly(tmp_path):
    c = cfg(method="fedavg")
    s = Store(tmp_path / "c.db")
    Experiment(c, s).run(stop_after=2)
    assert s.checkpoint_path(c.run_id).is_file()
    s.checkpoint_path(c.run_id).write_bytes(b"garbage")
    res = Experiment(c, s).run()
    assert res.status == "finished" and res.resumed_from is None
    assert len(s.round_metrics(c.run_id)) == 4
    (note,) = s.records(c.run_id, "checkpoint_discarded")
    assert note["round"] == 0 and "truncated" in note["data"]["reason"]


@pytest.mark.parametrize("storage", ["memory", "float16"])
@pytest.mark.parametrize("change", ["added", "reshaped"])
def test_a_checkpoint_of_other_client_state_declarations_restarts_the_run(tmp_path, monkeypatch, storage,
                                                                          change):
    """The method's code changed between an interruption and the resume so that its declared client
    state differs from the checkpoint's: the checkpoint is discarded with a record naming both, and the
    run completes from round 0 with the numbers of a fresh run under the new declarations."""
    from fedprism.algorithms.base import REGISTRY, ClientState

    c = cfg(method="local", **{"state.storage": storage})
    s = Store(tmp_path / "c.db")
    before = dict(REGISTRY["local"].client_state)

    def declare(n: int) -> None:
        decl = {**before, "extra": ClientState((n,), init="zeros")}
        monkeypatch.setattr(REGISTRY["local"], "client_state", decl)

    if change == "reshaped":                                    # a state row of 3 numbers, then of 4
        declare(3)
    Experiment(c, s).run(stop_after=2)
    declare(4)
    res = Experiment(c, s).run()
    assert res.status == "finished" and res.resumed_from is None
    (note,) = s.records(c.run_id, "checkpoint_discarded")
    assert note["round"] == 0 and note["data"]["reason"].startswith("client state: checkpoint")
    ref = Store(tmp_path / "ref.db")
    Experiment(c, ref).run()
    strip = ("train_s", "eval_s", "wall_s")
    assert [{k: v for k, v in h.items() if k not in strip} for h in s.round_metrics(c.run_id)] == \
        [{k: v for k, v in h.items() if k not in strip} for h in ref.round_metrics(c.run_id)]


def test_nan_update_is_rejected_and_the_round_goes_on(tmp_path, monkeypatch):
    c = cfg(method="fedavg", rounds=2)
    exp = Experiment(c, Store(tmp_path / "n.db"))
    real = exp.engine.train

    def poisoned(plan, rnd):
        up = real(plan, rnd)
        up.params[0, 3] = float("nan")
        return up

    monkeypatch.setattr(exp.engine, "train", poisoned)
    res = exp.run()
    assert res.status == "finished"
    assert np.isfinite(res.final["local_acc"])
    recs = exp.store.records(c.run_id, "rejected")
    assert len(recs) == 2 and "NaN" in recs[0]["data"]["reason"]
    assert torch.isfinite(exp.state["w"]).all()


def test_failing_client_is_recorded_and_others_aggregate(tmp_path, monkeypatch):
    c = cfg(method="fedprism", rounds=2, fedprism__k=2)
    exp = Experiment(c, Store(tmp_path / "f.db"))
    real = exp.engine.train
    victim = int(sample_clients(c["seed"], 0, 8, 0.5)[1])

    def flaky(plan, rnd):
        if victim in plan.clients.tolist():
            raise RuntimeError("client crashed")
        return real(plan, rnd)

    monkeypatch.setattr(exp.engine, "train", flaky)
    res = exp.run()
    assert res.status == "finished"
    fails = exp.store.records(c.run_id, "failure")
    assert fails and fails[0]["client"] == victim and "crashed" in fails[0]["data"]["reason"]
    r0 = exp.store.round_metrics(c.run_id)[0]
    assert r0["accepted"] == r0["clients"] - 1


def test_a_method_that_raises_for_every_client_stops_the_run_with_its_traceback(tmp_path):
    """One client raising is a client's failure (previous test); every client of a round raising is, in
    process, the method's bug: `MethodError` naming the method, the round and the first client's error,
    chained to the real exception, and the run is `failed` (it was stored 'finished', 'diverged')."""
    from fedprism.experiment.runner import MethodError

    c = cfg(method="fedavg", rounds=2)
    exp = Experiment(c, Store(tmp_path / "m.db"))

    def broken(plan, trainer, rnd, cstate):
        return exp.algo.undefined_helper(plan)

    exp.algo.client_update = broken
    with pytest.raises(MethodError, match=r"every client of round 1 raised in FedAvg\.client_update "
                                          r"\(client \d+: AttributeError: .*undefined_helper") as e:
        exp.run()
    assert isinstance(e.value.__cause__, AttributeError)
    assert exp.store.run(c.run_id)["status"] == "failed"


def _as(up, clients=None, payload=None, n=None):
    """The reply `up` with some of its parts replaced."""
    return type(up)(up.clients if clients is None else clients, up.payload if payload is None else payload,
                    up.n_samples if n is None else n)


@pytest.mark.parametrize("reply, what", [
    (lambda up: {"params": up.params}, r"a dict, not a fedprism\.protocol\.Update"),
    (lambda up: _as(up, payload={"params": up.params[:-1]}), r"payload\['params'\] of \(3, "),
    (lambda up: _as(up, clients=up.clients + 100), r"clients \[1\d\d.*plan does not hold"),
    (lambda up: _as(up, clients=np.repeat(up.clients[:1], 4)), r"clients \[\d+, .* with repeats"),
    (lambda up: _as(up, n=up.n_samples[:1]), r"n_samples .* one value per client \(4\)"),
    (lambda up: _as(up, payload={"params": up.params.numpy()}), r"payload\['params'\] of ndarray"),
])
def test_a_malformed_reply_is_a_method_error_naming_what_is_wrong(tmp_path, reply, what):
    """Replies whose structure no client could send (not an Update, a row short, clients outside the
    plan or repeated, numpy instead of tensors) stop the run with what was wrong, instead of an
    IndexError or KeyError from inside the runner; per-client rows that fail the declared upload are
    rejected client by client (tests/test_api_v2.py)."""
    from fedprism.experiment.runner import MethodError

    c = cfg(method="fedavg", rounds=1)
    exp = Experiment(c, Store(tmp_path / "m.db"))
    real = exp.algo.client_update
    exp.algo.client_update = lambda plan, trainer, rnd, cstate: reply(real(plan, trainer, rnd, cstate))
    with pytest.raises(MethodError, match="FedAvg.client_update returned " + what):
        exp.run()
    assert exp.store.run(c.run_id)["status"] == "failed"



@pytest.mark.parametrize("plan, what", [
    (lambda p, n: {"params": p.start}, r"a dict, not a fedprism\.protocol\.Plan"),
    (lambda p, n: Plan(np.r_[p.clients[1:], -1], p.payload), r"clients \[-1\]: .* are 0\.\.7"),
    (lambda p, n: Plan(np.r_[p.clients[1:], n], p.payload), r"clients \[8\]: .* are 0\.\.7"),
    (lambda p, n: Plan(np.repeat(p.clients[:1], 4), p.payload), r"clients \[\d+, .* with repeats"),
    (lambda p, n: Plan(p.clients.tolist(), p.payload), r"clients \[.*\]: expected a 1-D integer numpy"),
    (lambda p, n: Plan(p.clients.astype(float), p.payload), r"clients array\(.*\): expected a 1-D integer"),
    (lambda p, n: Plan(p.clients, {"params": p.start[:-1]}), r"payload\['params'\] of \(3, "),
])
def test_a_malformed_plan_is_a_method_error_naming_what_is_wrong(tmp_path, plan, what):
    """A plan's clients must be distinct indices of the federation, with one payload row each. A negative
    index used to train the data of the client it counts back to, without a word, and an index past the
    last client was recorded as that client's failure (an IndexError)."""
    from fedprism.experiment.runner import MethodError

    c = cfg(method="fedavg", rounds=1)
    exp = Experiment(c, Store(tmp_path / "m.db"))
    real, n = exp.algo.plan, exp.algo.ctx.num_clients
    exp.algo.plan = lambda state, rnd, clients: plan(real(state, rnd, clients), n)
    with pytest.raises(MethodError, match="FedAvg.plan returned " + what):
        exp.run()
    assert exp.store.run(c.run_id)["status"] == "failed"

@pytest.mark.parametrize("stop", ["1", 0, -1, 1.5, True])
def test_a_bad_stop_after_is_refused_before_the_stored_run_is_touched(tmp_path, stop):
    """`stop_after` is validated first: an interrupted run stays interrupted (it used to become `failed`
    on "1"; 0 and -1 created an interrupted row of 0 rounds)."""
    c = cfg(method="fedavg", rounds=3)
    store = Store(tmp_path / "s.db")
    Experiment(c, store).run(stop_after=1)
    before = dict(store.run(c.run_id))
    with pytest.raises(ConfigError, match=f"argument 'stop_after' = {stop!r} is not valid"):
        Experiment(c, store).run(stop_after=stop)
    assert dict(store.run(c.run_id)) == before and before["status"] == "interrupted"
    other = cfg(method="fedavg", rounds=3, seed=5)
    with pytest.raises(ConfigError, match="stop_after"):
        Experiment(other, store).run(stop_after=0)
    assert store.run(other.run_id) is None


def test_a_run_on_a_read_only_store_is_refused_and_leaves_no_file(tmp_path):
    from fedprism.experiment.store import StoreError

    db = tmp_path / "r.db"
    Store(db).close()
    before = sorted(p.name for p in tmp_path.iterdir())
    ro = Store(db, readonly=True)
    with pytest.raises(StoreError, match="open read-only"):
        Experiment(cfg(method="fedavg", rounds=1), ro).run()
    ro.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_store_is_transactional(tmp_path):
    s = Store(tmp_path / "t.db")
    s.start_run("0123456789abcdef", {"method": "fedavg", "dataset": "digits", "seed": 0})
    with pytest.raises(TypeError):     # the record cannot be serialised: fails after the metrics insert
        s.write_round("0123456789abcdef", 0, {"a": 1}, [(0, 0.5, 1.0, 0.4, 10, 0.3)], [("bad", None, object())], 0.1)
    assert s.round_metrics("0123456789abcdef") == []          # nothing of the failed round was kept
    assert s.client_rows("0123456789abcdef", 0) == []
    assert s.run("0123456789abcdef")["rounds_done"] == 0


@pytest.mark.parametrize("raw,key", [
    ({"rounds": 0}, "rounds"), ({"fraction": 1.5}, "fraction"), ({"fraction": 0}, "fraction"),
    ({"lr": -1}, "lr"), ({"clients": "many"}, "clients"), ({"method": "fedsgd"}, "method"),
    ({"dataset": "imagenet"}, "dataset"), ({"partition": "weird"}, "partition"),
    ({"bogus": 1}, "bogus"), ({"fedprism.k": 0}, "fedprism.k"), ({"fedprism.m": 9}, "fedprism.m"),
    ({"fedprism.clustering": "dbscan"}, "fedprism.clustering"), ({"partition.alpha": 0}, "partition.alpha"),
    ({"fedavg.weighting": "samples"}, "fedavg.weighting"), ({"partition.s": 0.5}, "partition.s"),
])
def test_config_errors_name_key_value_and_allowed(raw, key):
    with pytest.raises(Exception) as e:
        r = resolve({"method": "fedprism", **raw})
        Experiment(r, None)  # partition-level checks happen when the federation is built
    msg = str(e.value)
    assert key in msg, msg
    assert isinstance(e.value, (ConfigError, ValueError))


def test_overrides_parse_toml_literals():
    o = parse_overrides(["rounds=5", "lr=0.1", "eval.global=false", "dataset=fmnist", 'name="a b"'])
    assert o == {"rounds": 5, "lr": 0.1, "eval.global": False, "dataset": "fmnist", "name": "a b"}
    with pytest.raises(ConfigError):
        parse_overrides(["rounds"])


def test_run_id_ignores_execution_keys_only():
    a, b = cfg(method="fedavg"), cfg(method="fedavg", engine="vectorized", name="x")
    assert a.run_id == b.run_id
    assert a.run_id != cfg(method="fedavg", seed=1).run_id


def test_cli_run_json_and_error_exit(tmp_path, capsys):
    from fedprism.cli import main

    db = str(tmp_path / "cli.db")
    assert main(["run", "--db", db, "dataset=digits", "method=fedavg", "clients=6", "rounds=2",
                 "local_epochs=1", "fraction=0.5", "engine=sequential", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(out) >= {"global_acc", "local_acc", "ad", "sdad", "seconds"}
    assert main(["run", "--db", db, "rounds=-3"]) == 2
    err = capsys.readouterr().err
    assert "rounds" in err and "-3" in err


def test_final_metrics_when_no_evaluation_gave_a_value():
    from fedprism.experiment.runner import final_metrics

    f = final_metrics([{"local_acc": None, "global_acc": None, "bytes_up": 3}], 1.0)
    assert f["local_acc"] is None and "best_local_acc" not in f and f["bytes_up"] == 3


def test_macro_f1_by_hand_over_the_classes_present():
    from fedprism.experiment.evaluate import macro_f1

    # confusion[true, predicted] of one model, 3 classes; class 2 never occurs but is predicted twice:
    # F1_0 = 2*3 / (4 + 3) = 6/7, F1_1 = 2*2 / (4 + 3) = 4/7; class 2 has no support and takes no part
    conf = torch.tensor([[[3, 1, 0], [0, 2, 2], [0, 0, 0]]])
    assert macro_f1(conf).tolist() == pytest.approx([5 / 7], abs=1e-12)
    # a perfect model scores 1; a model with no test rows scores 0
    assert macro_f1(torch.stack([torch.eye(3) * 4, torch.zeros(3, 3)])).tolist() == [1.0, 0.0]
