"""Robust aggregation (`fedprism.algorithms.aggregation.average`): hand-computed values of every rule,
one hostile client out of ten, and the methods that average selecting the rule by a parameter."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedprism.algorithms import REGISTRY
from fedprism.algorithms.aggregation import ROBUST_PARAMS, average, soft_cluster_step, weighted_sum
from fedprism.experiment.config import resolve
from fedprism.protocol import Update

X = torch.tensor([[1.0, 10.0], [2.0, 20.0], [100.0, -5.0]])
W = torch.tensor([1.0, 1.0, 2.0])
ONES = torch.ones(3)


def test_mean_is_the_weighted_sum_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(7, 33, generator=g), torch.rand(7, generator=g) * 100
    assert torch.equal(average(x, w), weighted_sum(x, w))
    assert torch.equal(average(X, W), torch.tensor([50.75, 5.0], dtype=torch.float64))   # (1+2+200)/4, (10+20-10)/4


def test_median_by_hand():
    # equal weights: the middle value of each column
    assert average(X, ONES, rule="median").tolist() == [2.0, 10.0]
    # weights 1,1,2 (total 4, half 2): column 0 sorted 1|2|100, cumulative 1,2,4 -> reaches 2 exactly at
    # value 2 -> mean of 2 and the next value 100 = 51; column 1 sorted -5|10|20, cumulative 2,3,4 ->
    # exactly half at -5 -> mean of -5 and 10 = 2.5
    assert average(X, W, rule="median").tolist() == [51.0, 2.5]
    # weights 1,1,3: column 0 cumulative 1,2,5 (half 2.5) -> 100; column 1 -5(3) -> -5
    assert average(X, torch.tensor([1.0, 1.0, 3.0]), rule="median").tolist() == [100.0, -5.0]
    # a zero-weight row takes no part
    assert average(X, torch.tensor([1.0, 1.0, 0.0]), rule="median").tolist() == [1.5, 15.0]


def test_trimmed_mean_by_hand():
    # equal weights, trim 1/3 per side: the middle row only
    assert average(X, ONES, rule="trimmed_mean", trim=1 / 3).tolist() == pytest.approx([2.0, 10.0], abs=1e-12)
    # weights 1,1,2, trim 0.1: keep the weight in [0.4, 3.6] of [0, 4]
    # column 0: 1 covers [0,1] -> 0.6, 2 covers [1,2] -> 1, 100 covers [2,4] -> 1.6: (0.6 + 2 + 160) / 3.2
    # column 1: -5 covers [0,2] -> 1.6, 10 -> 1, 20 covers [3,4] -> 0.6: (-8 + 10 + 12) / 3.2
    got = average(X, W, rule="trimmed_mean", trim=0.1)
    assert got.tolist() == pytest.approx([162.6 / 3.2, 14 / 3.2], abs=1e-12)
    assert torch.allclose(average(X, W, rule="trimmed_mean", trim=0.0), average(X, W), atol=1e-12, rtol=0)
    with pytest.raises(ValueError):
        average(X, W, rule="trimmed_mean", trim=0.5)
    # rows wholly outside the kept window weigh 0, not less: five equal weights, trim 0.25 keeps [1.25, 3.75]
    # of [0, 5]; 0 covers [0, 1] and 100 covers [4, 5] -> 0; 1 and 3 keep 0.75 each, 2 keeps 1: 5 / 2.5
    five = torch.tensor([[0.0], [1.0], [2.0], [3.0], [100.0]])
    got = average(five, torch.ones(5), rule="trimmed_mean", trim=0.25)
    assert got.tolist() == pytest.approx([2.0], abs=1e-12)


def test_clipped_mean_by_hand():
    sent = torch.tensor([[1.0, 0.0]]).expand(3, 2)
    # updates (0,10), (1,20), (99,-5); norms 10, sqrt(401), sqrt(9826); median sqrt(401) = tau (clip 1)
    # rows 0 and 1 stay, row 2 scales by s = sqrt(401 / 9826); weights 1,1,2
    s = math.sqrt(401 / 9826)
    want = [1 + (0 + 1 + 2 * 99 * s) / 4, (10 + 20 + 2 * -5 * s) / 4]
    assert average(X, W, sent, rule="clipped_mean", clip=1.0).tolist() == pytest.approx(want, abs=1e-12)
    # clip 2: tau = 2 sqrt(401) -> row 2 scales by 2s
    want2 = [1 + (0 + 1 + 2 * 99 * 2 * s) / 4, (10 + 20 + 2 * -5 * 2 * s) / 4]
    assert average(X, W, sent, rule="clipped_mean", clip=2.0).tolist() == pytest.approx(want2, abs=1e-12)
    # without `sent` the rows are the updates: clipped around 0
    assert average(X, W, None, rule="clipped_mean").tolist() == pytest.approx(
        [(1 + 2 + 2 * 100 * math.sqrt(404 / 10025)) / 4, (10 + 20 - 10 * math.sqrt(404 / 10025)) / 4], abs=1e-12)
    # tau is the median over the rows that take part: with row 2 at weight 0 (a client outside the cluster
    # being averaged) the norms are sqrt(101) and 2 sqrt(101), tau = 1.5 sqrt(101); row 1 scales by 0.75
    assert average(X, torch.tensor([1.0, 1.0, 0.0]), None, rule="clipped_mean").tolist() == pytest.approx(
        [(1 + 0.75 * 2) / 2, (10 + 0.75 * 20) / 2], abs=1e-12)


def test_one_hostile_client_in_ten():
    """Nine honest updates around a common direction, one scaled by 1e4. Bounds (derived from the honest
    rows only): median and trimmed mean (trim 0.1 = one row per side) lie, per coordinate, inside the
    honest rows' range, so |aggregate - honest mean| <= the honest spread max_k |x_k - honest mean|;
    the clipped mean's rows all have norm <= the largest honest update norm M (tau = the median norm of
    ten rows, nine honest, is at most M), so ||aggregate - honest mean|| <= 2 M. The plain mean moves by
    about 1e3 times the attacker's honest-sized update."""
    g = torch.Generator().manual_seed(7)
    P = 50
    sent = torch.randn(P, generator=g).expand(10, P)
    u = 0.1 * torch.randn(10, P, generator=g) + 0.05
    u[3] *= 1e4                                                        # the hostile client
    x, w = sent + u, torch.full((10,), 60.0)
    honest = np.arange(10) != 3
    h_mean = x[honest].double().mean(0)
    spread = (x[honest].double() - h_mean).abs().max(0).values           # per coordinate
    M = u[honest].double().norm(dim=1).max()
    for rule in ("median", "trimmed_mean"):
        got = average(x, w, sent, rule=rule, trim=0.1)
        assert bool(((got - h_mean).abs() <= spread + 1e-9).all()), rule
    got = average(x, w, sent, rule="clipped_mean", clip=1.0)
    assert float((got - h_mean).norm()) <= 2 * float(M)
    plain = average(x, w)
    assert float((plain - h_mean).abs().max()) > 100 * float(spread.max())
    assert float((plain - h_mean).norm()) > 100 * float(M)


AVERAGING = ("fedavg", "ifca", "fedclust", "cfl", "fedprism", "fedprism_dual", "fedprox", "ditto", "apfl", "fedper",
             "fedrep", "fedbn", "protohar", "lg_fedavg", "fedbabu", "pfedme", "perfedavg", "feddyn", "moon")


@pytest.mark.parametrize("method", AVERAGING)
def test_methods_take_the_rule_and_keep_their_run_ids(method):
    base = resolve({"method": method})
    assert set(ROBUST_PARAMS) <= set(REGISTRY[method].params)
    assert base.run_id == resolve({"method": method, f"{method}.aggregation": "mean",
                                   f"{method}.aggregation.trim": 0.1, f"{method}.aggregation.clip": 1.0}).run_id
    other = resolve({"method": method, f"{method}.aggregation": "median"})
    assert other.run_id != base.run_id and other.method_params["aggregation"] == "median"
    with pytest.raises(Exception, match="aggregation"):
        resolve({"method": method, f"{method}.aggregation": "mode"})


def _ctx(n_clients: int, P: int):
    from fedprism.protocol import Context
    return Context(num_clients=n_clients, num_classes=2, spec=None, init=torch.zeros(P), n_train=np.ones(n_clients),
                   label_hist=np.ones((n_clients, 2)), seed=0, rounds=1, fraction=1.0, feature_dim=0)


def test_fedavg_aggregates_with_the_chosen_rule():
    from fedprism.algorithms.fedavg import FedAvg
    clients = np.arange(3)
    up = Update(clients, {"params": X.clone()}, W.double(), sent={"params": torch.zeros(3, 2)})
    for rule, want in (("mean", [50.75, 5.0]), ("median", [51.0, 2.5])):
        algo = FedAvg(_ctx(3, 2), aggregation=rule)
        state = algo.init_state()
        algo.aggregate(state, 0, up)
        assert state["w"].tolist() == want and state["w"].dtype == torch.float32, rule


def test_soft_cluster_step_robust_cluster_by_cluster():
    w_c = torch.zeros(2, 2)
    W_S = torch.tensor([[1.0, 0.0], [1.0, 0.5], [1.0, 0.5]], dtype=torch.float64)
    out = soft_cluster_step(w_c, W_S, X, robust={"rule": "median"})
    assert out[0].tolist() == [2.0, 10.0]            # cluster 0: equal weights over the three rows
    assert out[1].tolist() == [51.0, 7.5]            # cluster 1: rows 1 and 2 at 0.5 each (half reached exactly)
    assert torch.equal(soft_cluster_step(w_c, W_S, X, robust={"rule": "mean"}), soft_cluster_step(w_c, W_S, X))


#: method -> the state keys of its averaged models (tests/test_server_opt.py names the same ones)
AVERAGED_KEYS = {"fedavg": ("w",), "ifca": ("w",), "fedclust": ("w_c", "w_g"), "cfl": ("w",),
                 "fedprism": ("w_g", "w_c"), "fedprism_dual": ("w_g", "w_c"), "fedprox": ("w",),
                 "ditto": ("w",), "apfl": ("w",), "fedper": ("shared",), "fedrep": ("shared",),
                 "fedbn": ("shared",), "protohar": ("body",), "clust_psi_pfl": ("w",), "fedsoft": ("c",),
                 "lg_fedavg": ("shared",), "fedbabu": ("shared",), "pfedme": ("w",), "perfedavg": ("w",)}


@pytest.mark.parametrize("rule", ["median", "trimmed_mean", "clipped_mean"])
@pytest.mark.parametrize("method, extra", [
    ("fedavg", ""), ("ifca", "ifca.k=2"), ("ifca", "ifca.k=2 ifca.init=warmup ifca.warmup_rounds=1"),
    ("fedclust", "fedclust.k=2"), ("cfl", "cfl.warmup=0 cfl.eps1=100 cfl.eps2=0"),
    ("fedprism", "fedprism.k=2 fedprism.every=1"), ("fedprism", "fedprism.k=2 fedprism.every=1 fedprism.update=model"),
    ("fedprism_dual", "fedprism_dual.k=2"), ("fedprox", ""), ("ditto", ""), ("apfl", ""), ("fedper", ""),
    ("fedrep", ""), ("fedbn", "model=mlp_bn"), ("protohar", ""), ("clust_psi_pfl", ""), ("fedsoft", ""),
    ("lg_fedavg", ""), ("fedbabu", "fedbabu.finetune_epochs=1"), ("pfedme", ""), ("perfedavg", ""),
])
def test_every_averaging_method_runs_each_rule(method, extra, rule, tmp_path):
    """Each rule through the whole round loop (plan, local training, aggregate, evaluation): finite
    models, and not the mean's numbers in any averaged model (fedprism's w_g and every w_c, fedclust's
    cluster and global models, ...). Every round is also replayed with `mean` on a copy of the server (the
    same state, the same uploads): each averaged model differs from that replay in some round, so the rule
    reaches each of them, not only through the other models' trajectories. (Not in every round, and a
    matrix of cluster models as a whole: in a cluster of one or two clients the median is the mean.)"""
    import copy

    from fedprism.experiment.runner import Experiment
    from fedprism.experiment.store import Store
    from fedprism.flower.settings import parse_experiment

    model = "" if "model=" in extra else "model=mlp "
    exp = (f"method={method} dataset=digits clients=5 rounds=2 fraction=1.0 local_epochs=1 lr=0.05 {model}"
           f"device=cpu engine=sequential partition.alpha=0.5 seed=3 {extra}")
    runs, replays = {}, []                                 # (state after the rule, after the mean) per round
    for r in ("mean", rule):
        e = Experiment(parse_experiment(exp + f" {method}.aggregation={r} {method}.aggregation.trim=0.2"),
                       Store(tmp_path / f"{r}.db"))
        if r == rule:
            real = e.algo.aggregate

            def aggregate(state, rnd, update, algo=e.algo, real=real):
                mean_algo = copy.copy(algo)                    # aggregate changes no attribute of the algo
                mean_algo.hp = {**algo.hp, "aggregation": "mean"}
                mean_state = copy.deepcopy(state)
                type(algo).aggregate(mean_algo, mean_state, rnd, copy.deepcopy(update))
                out = real(state, rnd, update)
                replays.append((copy.deepcopy(state), mean_state))
                return out

            e.algo.aggregate = aggregate
        res = e.run()
        assert res.status == "finished"
        runs[r] = e.state
    for k, v in runs[rule].items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            assert bool(torch.isfinite(v).all()), k
    assert len(replays) == 2
    for key in AVERAGED_KEYS[method]:                                   # every averaged model
        assert not torch.equal(runs[rule][key], runs["mean"][key]), key
        assert any(not torch.equal(got[key], mean[key]) for got, mean in replays), key
