"""Availability, stragglers, deadlines and FedBuff in simulation (`system.*`, fedprism.systems,
experiment/systems_run.py, docs/systems.md)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fedprism.errors import ConfigError
from fedprism.experiment.config import resolve
from fedprism.experiment.runner import Experiment
from fedprism.experiment.store import Store
from fedprism.selection import sample_clients
from fedprism.systems import availability_trace, client_speeds, load_availability, staleness_weight

BASE = dict(method="fedavg", dataset="digits", clients=8, fraction=0.5, rounds=3, local_epochs=1, model="mlp")


def run(tmp_path, name="a", stop_after=None, **kw):
    exp = Experiment(resolve({**BASE, **kw}), Store(str(tmp_path / f"{name}.db")))
    return exp, exp.run(stop_after)


def records(exp, kind):
    return [r for r in exp.store.records(exp.run_id) if r["kind"] == kind]


def data(rec):
    return rec["data"] if isinstance(rec["data"], dict) else json.loads(rec["data"])


def equal_times_file(tmp_path, exp_or_ntrain, bw=1e9):
    """Speeds under which every client takes the same simulated time: compute_k = 10 n_k samples/s."""
    n = np.asarray(exp_or_ntrain)
    path = tmp_path / "speeds.csv"
    path.write_text("client,compute,bandwidth\n" + "".join(f"{c},{10 * int(v)},{bw}\n" for c, v in enumerate(n)))
    return str(path)


def n_train(tmp_path):
    exp = Experiment(resolve(BASE), Store(str(tmp_path / "probe.db")))
    return np.asarray(exp.ctx.n_train)


# -- defaults -------------------------------------------------------------------------------------------
def test_defaults_leave_the_run_id_and_the_metrics_as_they_were(tmp_path):
    cfg = resolve(BASE)
    assert not any(k.startswith("system.") for k in cfg.identity)
    assert cfg.run_id == resolve({**BASE, "system.availability": "always", "system.speeds": "none",
                                  "system.deadline": 0.0, "system.async": "none"}).run_id
    exp, res = run(tmp_path)
    assert exp.system is None
    for h in res.history:
        assert not {"sim_time", "sim_clock", "unavailable", "late"} & set(h)
    assert "sim_clock" not in res.final
    # a system key away from its default is another run
    assert resolve({**BASE, "system.availability": "bernoulli"}).run_id != cfg.run_id


# -- availability ------------------------------------------------------------------------------------------
def test_bernoulli_trace_is_the_seeded_draw():
    tr = availability_trace("bernoulli", 0.7, 0.0, 5, 40, 6)
    want = np.random.default_rng([5, 0xA7A1]).random((6, 40)) < 0.7
    assert np.array_equal(tr, want)
    assert np.array_equal(tr, availability_trace("bernoulli", 0.7, 0.0, 5, 40, 6))      # pure
    assert not np.array_equal(tr, availability_trace("bernoulli", 0.7, 0.0, 6, 40, 6))


def test_markov_trace_has_its_stationary_share_and_correlation():
    p, rho = 0.7, 0.6
    tr = availability_trace("markov", p, rho, 0, 4000, 60).astype(float)
    assert abs(tr.mean() - p) < 0.01
    a, b = tr[:-1].ravel(), tr[1:].ravel()
    corr = np.corrcoef(a, b)[0, 1]
    assert abs(corr - rho) < 0.02


def test_dropout_set_by_hand_in_a_trace_file(tmp_path):
    """Clients 1 and 5 are offline in round 0, client 2 in round 1 (the file repeats past its 2 columns):
    exactly those of each round's cohort neither train nor count, and the others are accepted."""
    rows = [[1, 1]] * 8
    rows = [list(r) for r in rows]
    rows[1][0] = rows[5][0] = 0
    rows[2][1] = 0
    f = tmp_path / "trace.csv"
    f.write_text("".join(",".join(map(str, r)) + "\n" for r in rows))
    exp, res = run(tmp_path, **{"system.availability": str(f)})
    off = {0: {1, 5}, 1: {2}, 2: {1, 5}}
    unav = {r["round"]: set(data(r)["clients"]) for r in records(exp, "unavailable")}
    for t, h in enumerate(res.history):
        cohort = set(sample_clients(0, t, 8, 0.5).tolist())
        gone = cohort & off[t]
        assert unav.get(t, set()) == gone
        assert h["unavailable"] == len(gone) and h["clients"] == h["accepted"] == len(cohort) - len(gone)
    assert res.final["unavailable"] == sum(len(set(sample_clients(0, t, 8, 0.5).tolist()) & off[t]) for t in range(3))
    # the same trace as JSON reads the same
    j = tmp_path / "trace.json"
    j.write_text(json.dumps({"available": rows}))
    assert np.array_equal(load_availability(str(j), 8), load_availability(str(f), 8))


@pytest.mark.parametrize("text, words", [
    ("1,1\n1,2\n" + "1,1\n" * 6, "line 2, round 1: 0 or 1"),
    ("1,1\n" * 7, "8 rows (clients=8), got 7"),
    ("1,1\n1\n" + "1,1\n" * 6, "the same length"),
])
def test_a_bad_trace_is_refused_naming_where(tmp_path, text, words):
    f = tmp_path / "bad.csv"
    f.write_text(text)
    with pytest.raises(ConfigError, match="system.availability") as e:
        resolve({**BASE, "system.availability": str(f)})
    assert words in str(e.value)


def test_an_edited_trace_file_is_another_run_and_a_stored_config_refuses_it(tmp_path):
    f = tmp_path / "t.csv"
    f.write_text("1\n" * 8)
    a = resolve({**BASE, "system.availability": str(f)})
    f.write_text("1\n" * 7 + "0\n")
    b = resolve({**BASE, "system.availability": str(f)})
    assert a.run_id != b.run_id
    with pytest.raises(ConfigError, match="system.files"):
        resolve(a.values)                      # the stored configuration names the old file's sha256


# -- speeds and deadline -------------------------------------------------------------------------------------
def test_deadline_drops_exactly_the_slow_clients(tmp_path):
    n = n_train(tmp_path)
    compute = np.array([50.0, 5.0, 40.0, 3.0, 60.0, 4.0, 30.0, 2.0])       # samples / s; odd clients slow
    f = tmp_path / "speeds.json"
    f.write_text(json.dumps({"compute": compute.tolist(), "bandwidth": [1e6] * 8}))
    P = 8970                                                   # the MLP's parameters on digits
    T = n / compute + 2 * 4 * P / 1e6                          # E = 1; a row of P float32 each way
    first = [int(c) for c in sample_clients(0, 0, 8, 0.5) if compute[c] < 10]
    assert first
    D = round(0.75 * min(T[first]), 3)          # one late client within (D, 2D): the bound is exactly D
    exp, res = run(tmp_path, **{"system.speeds": str(f), "system.deadline": D})
    assert exp.ctx.spec.size == P
    late = {r["round"]: data(r) for r in records(exp, "late")}
    for t, h in enumerate(res.history):
        cohort = sample_clients(0, t, 8, 0.5)
        slow = [int(c) for c in cohort if T[c] > D]
        assert late.get(t, {}).get("clients", []) == slow
        assert h["late"] == len(slow) and h["accepted"] == len(cohort) - len(slow)
        assert h["sim_time"] == (D if slow else pytest.approx(max(T[c] for c in cohort), rel=1e-12))
    assert any(late.values())
    assert res.final["sim_clock"] == pytest.approx(sum(h["sim_time"] for h in res.history))
    assert res.final["late"] == sum(h["late"] for h in res.history)


def test_lognormal_speeds_are_seeded():
    c, b = client_speeds("lognormal", 100.0, 1e6, 0.5, 3, 10)
    z = np.random.default_rng([3, 0x5BED]).standard_normal((2, 10))
    assert np.allclose(c, 100 * np.exp(0.5 * z[0]), rtol=0) and np.allclose(b, 1e6 * np.exp(0.5 * z[1]), rtol=0)


def test_deadline_without_speeds_is_refused_in_process(tmp_path):
    with pytest.raises(ConfigError, match="system.deadline") as e:
        run(tmp_path, **{"system.deadline": 5.0})
    assert "system.speeds=equal, lognormal or a .csv / .json file" in str(e.value)     # what to set


def test_fedbuff_without_speeds_says_which_speeds_to_set():
    with pytest.raises(ConfigError, match=r"system\.async.*system\.speeds=equal, lognormal or a \.csv / \.json file"):
        resolve({**BASE, "system.async": "fedbuff"})


@pytest.mark.parametrize("kw, key", [
    ({"system.buffer": 3}, "system.buffer"),
    ({"system.availability.corr": 0.2}, "system.availability.corr"),
    ({"system.sigma": 0.5, "system.speeds": "equal"}, "system.sigma"),
    ({"system.async": "fedbuff"}, "system.async"),
])
def test_keys_that_do_not_apply_are_refused(kw, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        resolve({**BASE, **kw})


# -- FedBuff -------------------------------------------------------------------------------------------------
def test_fedbuff_with_buffer_cohort_and_no_staleness_is_fedavg_bit_for_bit(tmp_path):
    f = equal_times_file(tmp_path, n_train(tmp_path))
    plain, rp = run(tmp_path, "plain")
    sync, rs = run(tmp_path, "sync", **{"system.speeds": f})
    buff, rb = run(tmp_path, "buff", **{"system.speeds": f, "system.async": "fedbuff"})
    assert torch.equal(plain.state["w"], sync.state["w"])
    assert torch.equal(plain.state["w"], buff.state["w"])
    assert all(h["stale_max"] == 0 for h in rb.history)
    for a, b in zip(rp.history, rb.history):
        assert a["local_acc"] == b["local_acc"] and a["bytes_down"] == b["bytes_down"] and a["clients"] == b["clients"]
    assert [h["sim_time"] for h in rs.history] == [h["sim_time"] for h in rb.history]


def test_fedbuff_weighs_stale_updates(tmp_path):
    """Unequal speeds: the stored staleness of every buffered update is the server steps since it started, and
    the server step is w + eta_g sum_i p_i s(tau_i) (x_i - x_i^sent), recomputed from the kept rows."""
    exp, res = run(tmp_path, rounds=4, **{"system.speeds": "lognormal", "system.async": "fedbuff",
                                          "system.concurrency": 6, "fedavg.weighting": "uniform",
                                          "system.server_lr": 0.5})
    stale = [s for r in records(exp, "fedbuff") for s in data(r)["staleness"]]
    assert max(stale) >= 1 and all(s >= 0 for s in stale)
    assert [len(data(r)["clients"]) for r in records(exp, "fedbuff")] == [4] * 4
    assert staleness_weight(0, "sqrt") == 1.0 and staleness_weight(3, "sqrt") == 0.5
    assert staleness_weight(3, "none") == 1.0


def test_fedbuff_server_step_by_hand():
    """`SystemRun.weigh` on a hand-made update: x' = w + eta s(tau) (x - sent), fresh rows kept as they are."""
    from types import SimpleNamespace

    from fedprism.experiment.systems_run import SystemRun
    from fedprism.protocol import Plan, Update
    from fedprism.systems import SystemModel

    w = torch.tensor([1.0, 2.0])
    algo = SimpleNamespace(plan=lambda state, t, c: Plan(c, {"params": w.expand(len(c), -1).clone()}))
    sr = SystemRun(SystemModel(np.ones((5, 3), bool), None, None, 1, np.ones(3), server_lr=0.5))
    up = Update(np.array([0, 1]), {"params": torch.tensor([[3.0, 2.0], [1.0, 6.0]])}, torch.ones(2))
    up.sent = {"params": torch.tensor([[1.0, 2.0], [0.0, 0.0]])}
    out = sr.weigh(SimpleNamespace(algo=algo), {}, 4, up, {0: 4, 1: 1})
    # client 0: tau 0, factor 0.5 -> w + 0.5 (x - sent) = [2, 2]; client 1: tau 3, 0.5 * 0.5 -> w + 0.25 [1, 6]
    assert torch.equal(out.params, torch.tensor([[2.0, 2.0], [1.25, 3.5]]))
    assert torch.equal(out.sent["params"], w.expand(2, -1))


def test_fedbuff_resumes_exactly(tmp_path):
    kw = {"system.speeds": "lognormal", "system.async": "fedbuff", "system.concurrency": 6}
    whole, rw = run(tmp_path, "whole", **kw)
    part, _ = run(tmp_path, "part", stop_after=1, **kw)
    again = Experiment(resolve({**BASE, **kw}), Store(str(tmp_path / "part.db")))
    ra = again.run()
    assert ra.resumed_from == 0
    assert torch.equal(whole.state["w"], again.state["w"])
    assert [h["sim_clock"] for h in rw.history] == [h["sim_clock"] for h in ra.history]


@pytest.mark.parametrize("kw, key, words", [
    ({"method": "fedamp"}, "method", "reads each client's upload"),
    ({"fedavg.aggregation": "median"}, "fedavg.aggregation", "the robust rule median"),
    ({"method": "feddyn"}, "method", "reads each client's upload"),
    ({"drift.fraction": 0.5}, "drift.fraction", "0 with system.async=fedbuff"),
])
def test_fedbuff_refuses_methods_that_read_each_upload(tmp_path, kw, key, words):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as e:
        run(tmp_path, **{"system.speeds": "equal", "system.async": "fedbuff", **kw})
    assert words in str(e.value)


def test_client_time_by_hand():
    """T_k = E n_k / compute_k + (down + up) / bandwidth_k: 3 x 100 / 50 + (500 + 1500) / 1000 = 8 s."""
    from fedprism.systems import SystemModel

    m = SystemModel(np.ones((1, 2), bool), np.array([1.0, 50.0]), np.array([1.0, 1000.0]), 3, np.array([7, 100]))
    assert m.duration(1, 500, 1500) == 8.0
    assert m.duration(0, 0, 0) == 21.0


def test_fedbuff_starts_a_client_at_most_once_per_server_step(tmp_path):
    """Even clients are instant, odd ones slow: the instant ones would otherwise start again from the same
    model in the same step (their updates would repeat); each (client, start step) is used once."""
    f = tmp_path / "speeds.json"
    f.write_text(json.dumps({"compute": [1e9 if c % 2 == 0 else 1.0 for c in range(8)], "bandwidth": [1e12] * 8}))
    exp, res = run(tmp_path, rounds=4, **{"system.speeds": str(f), "system.async": "fedbuff"})
    used = [(c, r["round"] - s) for r in records(exp, "fedbuff")
            for c, s in zip(data(r)["clients"], data(r)["staleness"])]
    assert len(used) == 16 and len(set(used)) == len(used)
