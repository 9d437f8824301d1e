"""The composed server step (`aggregation.ServerStep`, `Algorithm.averages`): the robust rule and the server
optimiser are shared options of every method that averages models, declared once, and a method composed
with them computes what the per-method code computed before, bit for bit; and the runner's promise that
`aggregate` never sees an empty update."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from fedprism.algorithms import REGISTRY, Algorithm
from fedprism.algorithms.aggregation import (ROBUST_PARAMS, SERVER_OPT_PARAMS, SERVER_STEP_PARAMS, ServerStep,
                                             average, client_weights, robust_args, server_update,
                                             soft_cluster_step)
from fedprism.experiment.config import resolve
from fedprism.hparams import Param
from fedprism.protocol import Context, Update

SRC = Path(__file__).resolve().parents[1] / "src" / "fedprism" / "algorithms"

#: every built-in method that averages models -> the server-state keys it declares
AVERAGING = {"fedavg": ("w",), "fedprox": ("w",), "ditto": ("w",), "apfl": ("w",), "perfedavg": ("w",),
             "pfedme": ("w",), "fedper": ("shared",), "fedrep": ("shared",), "fedbn": ("shared",),
             "lg_fedavg": ("shared",), "fedbabu": ("shared",), "protohar": ("body",), "fedsoft": ("c",),
             "ifca": ("w",), "cfl": ("w",), "clust_psi_pfl": ("w",), "fedclust": ("w_c", "w_g"),
             "fedprism": ("w_g", "w_c"), "fedprism_dual": ("w_g", "w_c"), "feddyn": ("w",), "moon": ("w",),
             "fedala": ("w",), "fedrod": ("w",), "scaffold": ("w",), "fednova": ("w",), "qffl": ("w",),
             "fedpac": ("shared",), "gpfl": ("shared",), "fedem": ("w",)}


def _ctx(n: int, P: int) -> Context:
    return Context(num_clients=n, num_classes=2, spec=None, init=torch.zeros(P), n_train=np.ones(n),
                   label_hist=np.ones((n, 2)), seed=0, rounds=1, fraction=1.0, feature_dim=0)


# -- declared once -----------------------------------------------------------------------------------
@pytest.mark.parametrize("method", [m for m in sorted(REGISTRY.names()) if REGISTRY.is_builtin(m)])
def test_the_server_step_options_come_from_the_declaration(method):
    """A method that declares `averages` takes the shared options, the very Param objects of
    SERVER_STEP_PARAMS, after its own; a method that does not, takes none of them."""
    cls = REGISTRY[method]
    assert tuple(cls.averages) == AVERAGING.get(method, ())
    assert not set(cls.own_params) & set(SERVER_STEP_PARAMS)
    if cls.averages:
        assert list(cls.params) == [*cls.own_params, *SERVER_STEP_PARAMS]
        assert all(cls.params[k] is p for k, p in SERVER_STEP_PARAMS.items())
    else:
        assert cls.params == cls.own_params


def test_no_method_module_declares_the_options_itself():
    """The 9 keys live in aggregation.py only: no method module copies them into its params."""
    for path in SRC.rglob("*.py"):
        if path.name in ("aggregation.py", "base.py"):
            continue
        text = path.read_text()
        assert not re.search(r"ROBUST_PARAMS|SERVER_OPT_PARAMS|robust_args|server_update", text), path
        assert "len(update.clients) == 0" not in text and "not len(update.clients)" not in text, path


def test_a_method_may_not_redeclare_a_server_step_key():
    with pytest.raises(TypeError, match="server_opt"):
        type("Bad", (Algorithm,), {"name": "bad", "averages": ("w",),
                                   "params": {"server_opt": Param("sgd", "mine")}})
    with pytest.raises(TypeError, match="averages"):
        type("Bad", (Algorithm,), {"name": "bad", "averages": "w"})


def test_a_subclass_that_stops_averaging_drops_the_options():
    from fedprism.algorithms.fedavg import FedAvg

    Plain = type("Plain", (FedAvg,), {"name": "plain", "averages": ()})
    assert set(Plain.params) == {"weighting"} and "server_opt" not in Plain.resolve({})


def test_a_new_method_gets_the_server_step_by_declaring_what_it_averages():
    """A method written outside the package: `averages = ("w",)` and nothing else gives it the keys, their
    checks and the `auto` resolution; `self.server` refuses a key it did not declare."""
    class Mine(Algorithm):
        name = "mine_averaging"
        averages = ("w",)
        params = {"weighting": Param("samples", "weights", choices=("samples", "uniform"))}

    hp = Mine.resolve({"server_opt": "adam", "aggregation": "median"})
    assert (hp["server_lr"], hp["server_tau"]) == (0.001, 0.001) and hp["aggregation"] == "median"
    with pytest.raises(Exception, match="mine_averaging.server_momentum"):
        Mine.resolve({"server_momentum": 1.5})
    algo = Mine(_ctx(3, 2), aggregation="median", server_opt="avgm")
    state = {"w": torch.zeros(2), "v": torch.zeros(2)}
    algo.server.update(state, "w", torch.ones(2, dtype=torch.float64))
    assert set(state["opt"]) == {"w"}
    with pytest.raises(ValueError, match=r"state\['v'\].*averages"):
        algo.server.update(state, "v", torch.ones(2, dtype=torch.float64))
    with pytest.raises(AttributeError, match="averages"):
        REGISTRY["local"](_ctx(3, 2)).server


def test_server_step_is_the_free_functions():
    """ServerStep.average / update are `average(..., **robust_args(hp))` / `server_update(..., hp)`."""
    g = torch.Generator().manual_seed(1)
    x, w, sent = torch.randn(6, 5, generator=g), torch.rand(6, generator=g) + 0.1, torch.randn(6, 5, generator=g)
    for hp in ({}, {"aggregation": "median"}, {"aggregation": "trimmed_mean", "aggregation.trim": 0.25},
               {"aggregation": "clipped_mean", "aggregation.clip": 0.5}):
        assert torch.equal(ServerStep(hp).average(x, w, sent), average(x, w, sent, **robust_args(hp)))
    hp = {"server_opt": "yogi", "server_lr": 0.1, "server_tau": 0.01, "server_beta1": 0.9, "server_beta2": 0.99}
    a = {"w": torch.randn(3, 5, generator=g)}
    b = copy.deepcopy(a)
    for rows in ([0, 2], 1, [1, 2]):
        shape = (5,) if isinstance(rows, int) else (len(rows), 5)
        avg = torch.randn(shape, generator=g, dtype=torch.float64)
        ServerStep(hp, ("w",)).update(a, "w", avg, rows=rows)
        server_update(b, "w", avg, hp, rows)
    assert torch.equal(a["w"], b["w"]) and torch.equal(a["opt"]["w"]["v"], b["opt"]["w"]["v"])


@pytest.mark.parametrize("method", sorted(AVERAGING))
def test_every_key_keeps_its_meaning_and_run_id(method):
    """The keys written the old way resolve to the same values and run ids as before (where no key is
    given, and with each of the 9 keys at a non-default value)."""
    base = resolve({"method": method})
    assert {k for k in base.method_params if k in SERVER_STEP_PARAMS} == set(SERVER_STEP_PARAMS)
    for kw, want in (({"server_opt": "avgm", "server_momentum": 0.5}, {"server_lr": None, "server_momentum": 0.5}),
                     ({"server_opt": "adagrad"}, {"server_lr": 0.3162, "server_tau": 0.1}),
                     ({"aggregation": "trimmed_mean", "aggregation.trim": 0.2}, {"aggregation.trim": 0.2}),
                     ({"server_opt": "none", "server_lr": 1.0, "server_tau": 1e-3}, {"server_lr": None})):
        cfg = resolve({"method": method, **{f"{method}.{k}": v for k, v in kw.items()}})
        assert all(cfg.method_params[k] == v for k, v in want.items()), kw
    assert resolve({"method": method, f"{method}.server_lr": 1.0}).run_id == base.run_id


# -- the composed step equals the per-method code it replaced ---------------------------------------------
def _old_fedavg(hp, state, rnd, update):                      # fedavg.py before the composition
    if len(update.clients):
        x = update.params
        avg = average(x, client_weights(update, hp["weighting"]), update.sent.get("params"), **robust_args(hp))
        server_update(state, "w", avg, hp)


def _old_pfedme(hp, state, rnd, update):
    if len(update.clients):
        avg = average(update.params, client_weights(update, hp["weighting"]),
                      update.sent.get("params"), **robust_args(hp))
        beta = hp["beta"]
        mixed = avg if beta == 1 else (1 - beta) * state["w"].to(torch.float64) + beta * avg
        server_update(state, "w", mixed, hp)


def _old_partial(hp, state, rnd, update):
    if len(update.clients):
        w = client_weights(update, hp["weighting"])
        x = update.payload["shared"]
        server_update(state, "shared", average(x, w, update.sent.get("shared"), **robust_args(hp)), hp)


def _old_fedprism(hp, state, rnd, update):                    # FedPrism._server_step before
    S = torch.as_tensor(update.clients)
    w = client_weights(update, hp["global_weighting"])
    rb = robust_args(hp)
    W_S = state["W"][S]
    if hp["update"] == "delta":
        delta = update.delta
        g = state["w_g"].double() + average(delta, w, **rb)
        c = soft_cluster_step(state["w_c"], W_S, delta, hp["cluster_lr"], robust=rb)
    else:
        sent = update.sent.get("params")
        g = average(update.params, w, sent, **rb)
        c = soft_cluster_step(state["w_c"], W_S, update.params, hp["cluster_lr"], toward=True, robust=rb, sent=sent)
    server_update(state, "w_g", g, hp)
    live = torch.nonzero(W_S.to(torch.float64).sum(0) > 0).flatten().tolist()
    if live:
        server_update(state, "w_c", c[live], hp, rows=live)


def _old_fedsoft(hp, state, rnd, update):
    a = update.payload["u"].to(torch.float64) * update.n_samples.to(torch.float64)[:, None]
    total = a.sum(0)
    x, rb = update.params.to(torch.float64), robust_args(hp)
    for s in range(state["c"].shape[0]):
        if total[s] > 0:
            avg = ((a[:, s] / total[s]) @ x if rb["rule"] == "mean"
                   else average(x, a[:, s], state["c"][s].expand(len(x), -1), **rb))
            server_update(state, "c", avg, hp, rows=s)


#: (method, extra settings, the old code of its averaging step, the state it leaves to other code)
OLD = [("fedavg", "", _old_fedavg), ("pfedme", "pfedme.beta=0.7", _old_pfedme), ("fedper", "", _old_partial),
       ("fedprism", "fedprism.k=2 fedprism.every=1", _old_fedprism),
       ("fedprism", "fedprism.k=2 fedprism.every=1 fedprism.update=model", _old_fedprism),
       ("fedsoft", "", _old_fedsoft)]


@pytest.mark.parametrize("rule, opt", [("median", "avgm"), ("trimmed_mean", "adam"), ("clipped_mean", "yogi")])
@pytest.mark.parametrize("method, extra, old", OLD, ids=[f"{m}-{i}" for i, (m, _, _) in enumerate(OLD)])
def test_composed_step_equals_the_old_per_method_path_bit_for_bit(method, extra, old, rule, opt, tmp_path):
    """Through the whole round loop on a tiny federation: every round, the old per-method averaging code
    (`average(..., **robust_args(hp))` then `server_update(..., hp)`, copied above) is replayed on a copy of
    the server state with the same uploads, and the method composed with the shared server step leaves the
    averaged models and their optimiser state bit for bit where the old code does."""
    from fedprism.experiment.runner import Experiment
    from fedprism.experiment.store import Store
    from fedprism.flower.settings import parse_experiment

    exp = (f"method={method} dataset=digits clients=5 rounds=3 fraction=1.0 local_epochs=1 lr=0.05 model=mlp "
           f"device=cpu engine=sequential partition.alpha=0.5 seed=3 {extra} {method}.aggregation={rule} "
           f"{method}.aggregation.trim=0.2 {method}.server_opt={opt} {method}.server_lr=0.05")
    e = Experiment(parse_experiment(exp), Store(tmp_path / "s.db"))
    real, checked, start = e.algo.aggregate, [], {}

    def aggregate(state, rnd, update):
        start.setdefault("state", copy.deepcopy(state))
        replay = copy.deepcopy(state)
        old(e.algo.hp, replay, rnd, copy.deepcopy(update))
        out = real(state, rnd, update)
        for key in AVERAGING[method]:
            assert torch.equal(state[key], replay[key]), (rnd, key)
            for k in ("m", "v"):
                assert torch.equal(state["opt"][key][k], replay["opt"][key][k]), (rnd, key, k)
        checked.append(rnd)
        return out

    e.algo.aggregate = aggregate
    assert e.run().status == "finished" and checked == [0, 1, 2]
    for key in AVERAGING[method]:                         # the step moved every averaged model
        assert not torch.equal(e.state[key], start["state"][key]), key


# -- the runner's promise: `aggregate` never sees an empty update --------------------------------------------
def test_a_round_without_accepted_updates_does_not_call_aggregate(tmp_path):
    """Round 0's every reply is non-finite (rejected, not a method bug): `aggregate` is not called, the
    server state stays as it was, and the run goes on; with the former guards removed, FedAvg's aggregate
    would raise on the empty update (weights that sum to zero)."""
    from fedprism.experiment.runner import Experiment
    from fedprism.experiment.store import Store
    from fedprism.flower.settings import parse_experiment

    exp = ("method=fedavg dataset=digits clients=4 rounds=2 fraction=1.0 local_epochs=1 lr=0.05 model=mlp "
           "device=cpu engine=sequential seed=1 fedavg.server_opt=avgm")
    e = Experiment(parse_experiment(exp), Store(tmp_path / "s.db"))
    real_update, real_aggregate, seen = e.algo.client_update, e.algo.aggregate, []

    def client_update(plan, trainer, rnd, cstate):
        up = real_update(plan, trainer, rnd, cstate)
        if rnd == 0:
            up.payload["params"] = torch.full_like(up.payload["params"], float("nan"))
        return up

    def aggregate(state, rnd, update):
        seen.append((rnd, len(update.clients), torch.equal(state["w"], e.algo.ctx.init)))
        return real_aggregate(state, rnd, update)

    e.algo.client_update, e.algo.aggregate = client_update, aggregate
    res = e.run()
    assert res.status == "finished"
    assert seen == [(1, 4, True)]                      # round 0 skipped; round 1 starts from the initial w
    assert [h["accepted"] for h in res.history] == [0, 4] and res.history[0]["rejected"] == 4


@pytest.mark.parametrize("method, extra", [(m, "") for m in ("fedavg", "fedproto", "centralised", "fedsub", "pfpl",
                                                               "fedamp", "local", "fedper", "protohar", "pfedme")]
                         + [("ifca", "ifca.k=2"), ("cfl", ""), ("fedclust", "fedclust.k=2"),
                            ("fedprism", "fedprism.k=2"), ("fedprism_dual", "fedprism_dual.k=2"),
                            ("clust_psi_pfl", ""), ("fedsoft", "")])
def test_simulator_skips_aggregate_for_an_empty_update(method, extra, tmp_path):
    """Every method that had a guard of its own (and a few others): a round whose clients all reply with no
    row (an empty update, whatever the method planned) goes through the runner's path (`Simulator.round`
    -> `aggregate_records`) without calling `aggregate` and leaves the server state bit-identical; round 0
    still gives the method's setup records."""
    from fedprism.experiment.runner import Experiment, Simulator
    from fedprism.experiment.store import Store
    from fedprism.flower.settings import parse_experiment

    exp = (f"method={method} dataset=digits clients=6 rounds=2 fraction=1.0 local_epochs=1 model=mlp "
           f"device=cpu engine=sequential seed=0 {extra}")
    e = Experiment(parse_experiment(exp), Store(tmp_path / "s.db"))
    sim = Simulator(e.algo, e.engine)
    before = copy.deepcopy(sim.state)
    real = e.algo.client_update

    def nothing(plan, trainer, rnd, cstate):
        up = real(plan, trainer, rnd, cstate)
        return up.select(np.zeros(len(up.clients), dtype=bool))

    def refuse(*a, **k):
        raise AssertionError("aggregate called with an empty update")

    e.algo.client_update, e.algo.aggregate = nothing, refuse
    for rnd in (0, 1):
        _, update, records = sim.round(rnd, np.arange(6))
        assert len(update.clients) == 0
        assert set(records) == ({"psi", "clusters"} if method == "clust_psi_pfl" and rnd == 0 else set())
    _same(before, sim.state)


def _same(a, b):
    if isinstance(a, dict):
        assert set(a) == set(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b, equal_nan=a.dtype.kind == "f")
    else:
        assert a == b or (a != a and b != b)


def test_clust_psi_pfl_stores_its_clustering_with_an_empty_round_0(tmp_path):
    """The clustering made before round 0 is stored with round 0 (`setup_records`) even when round 0 has
    no accepted update, in the order it had when `aggregate` wrote it (psi, clusters, then the round's)."""
    from fedprism.experiment.runner import Experiment
    from fedprism.experiment.store import Store
    from fedprism.flower.settings import parse_experiment

    exp = ("method=clust_psi_pfl dataset=digits clients=6 rounds=2 fraction=1.0 local_epochs=1 lr=0.05 model=mlp "
           "device=cpu engine=sequential seed=0")
    e = Experiment(parse_experiment(exp), Store(tmp_path / "s.db"))
    real = e.algo.client_update

    def client_update(plan, trainer, rnd, cstate):
        up = real(plan, trainer, rnd, cstate)
        if rnd == 0:
            up.payload["params"] = torch.full_like(up.payload["params"], float("inf"))
        return up

    e.algo.client_update = client_update
    res = e.run()
    assert res.history[0]["accepted"] == 0
    psi = e.store.records(res.run_id, "psi")
    clusters = e.store.records(res.run_id, "clusters")
    assert [r["round"] for r in psi] == [0] and [r["round"] for r in clusters] == [0]
    assert psi[0]["data"]["tau"] == len(e.state["w"])
    assert clusters[0]["data"]["labels"] == e.state["assign"].tolist()
