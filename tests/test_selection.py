"""Client selection rules (fedprism.selection): hand-computed cohorts on tiny federations, the default
draw unchanged, every rule through the round loop, bad settings named, and Flower equal to in process."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedprism.errors import ConfigError
from fedprism.experiment.config import resolve
from fedprism.experiment.runner import Experiment
from fedprism.experiment.store import Store
from fedprism.selection import (Selector, fedcls_choose, haccs_choose, poc_candidates, poc_choose, presence,
                                sample_clients)

pytest.importorskip("flwr")
from test_flower import task_identity  # noqa: E402,F401

TINY = dict(dataset="digits", method="fedavg", model="mlp", clients=8, rounds=3, fraction=0.25, local_epochs=1,
            lr=0.05, engine="sequential", seed=4)


def test_the_default_draw_is_the_one_every_committed_run_used():
    # the cohorts of the committed paper runs (seed 0, 100 clients, fraction 0.1), rounds 0 and 99, as the
    # code before pluggable selection drew them
    assert sample_clients(0, 0, 100, 0.1).tolist() == [4, 24, 27, 31, 43, 45, 51, 55, 76, 86]
    assert sample_clients(0, 99, 100, 0.1).tolist() == [10, 15, 16, 26, 27, 35, 51, 59, 62, 92]
    sel = Selector("uniform", 0, 100, 0.1, np.ones(100), np.ones((100, 10)))
    for r in range(30):
        got, rec = sel.select(r)
        assert np.array_equal(got, sample_clients(0, r, 100, 0.1)) and rec == {}
    base = resolve(TINY)
    assert base.run_id == resolve({**TINY, "selection": "uniform", "selection.d": 0, "selection.rho": 0.95,
                                   "selection.tau": 0.1}).run_id
    assert resolve({**TINY, "selection": "fedcls"}).run_id != base.run_id


def test_power_of_choice_takes_the_largest_losses():
    cand = np.array([1, 4, 7, 9])
    assert poc_choose(cand, np.array([0.5, 2.0, 2.0, 0.1]), 2).tolist() == [4, 7]
    assert poc_choose(cand, np.array([0.5, np.nan, 0.2, 3.0]), 2).tolist() == [4, 9]      # NaN: largest
    assert poc_choose(cand, np.array([1.0, 1.0, 1.0, 1.0]), 3).tolist() == [1, 4, 7]      # ties: lower id
    # candidates: d distinct clients, drawn by size; a client of size 0 is never a candidate
    n = np.array([0, 10, 10, 10, 10, 0])
    for r in range(20):
        c = poc_candidates(3, r, n, 3)
        assert len(set(c.tolist())) == 3 and not {0, 5} & set(c.tolist())


def test_haccs_covers_the_groups_and_prefers_the_fast():
    groups = np.array([0, 0, 0, 1, 1, 1])
    latency = np.array([3.0, 1.0, 2.0, 0.5, 9.0, 0.7])
    for r in range(5):
        assert haccs_choose(0, r, groups, latency, 2, rho=1.0).tolist() == [1, 3]       # fastest of each
        assert haccs_choose(0, r, groups, latency, 4, rho=1.0).tolist() == [1, 2, 3, 5]  # then the next fastest
    picks = [tuple(haccs_choose(0, r, groups, latency, 2, rho=0.0)) for r in range(40)]
    assert all(sum(c < 3 for c in p) == 1 for p in picks)                               # one per group
    assert len(set(picks)) > 3                                                          # random within groups


def _haccs_reference(seed, rnd, groups, latency, m, rho):
    """The list-membership implementation HACCS had before (same draws, quadratic in a group's size)."""
    rng = np.random.default_rng([seed, rnd, 0x4AC])
    members = {g: list(np.flatnonzero(groups == g)) for g in np.unique(groups)}
    order = [int(g) for g in rng.permutation(sorted(members))]
    chosen: list[int] = []
    while len(chosen) < m:
        for g in order:
            left = [c for c in members[g] if c not in chosen]
            if not left or len(chosen) == m:
                continue
            if rng.random() < rho:
                chosen.append(int(min(left, key=lambda c: (latency[c], c))))
            else:
                chosen.append(int(left[rng.integers(len(left))]))
    return np.sort(np.asarray(chosen, dtype=np.int64))


@pytest.mark.parametrize("n,groups,m,rho", [(60, 3, 20, 0.5), (200, 7, 50, 0.95), (40, 2, 40, 0.0)])
def test_haccs_with_set_membership_draws_what_the_list_version_drew(n, groups, m, rho):
    rng = np.random.default_rng(n)
    g = rng.integers(0, groups, n)
    lat = rng.random(n)
    for rnd in range(3):
        got = haccs_choose(1, rnd, g, lat, m, rho)
        assert np.array_equal(got, _haccs_reference(1, rnd, g, lat, m, rho))
        assert len(set(got.tolist())) == m


def test_fedcls_picks_complementary_labels():
    hist = np.array([[50, 40, 0, 0], [60, 55, 2, 0], [0, 0, 30, 30], [0, 20, 25, 0]])
    b = presence(hist, 0.1)
    assert b.tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1], [0, 1, 1, 0]]
    # from client 0 (union 1100): Hamming 0 (client 1), 4 (client 2), 2 (client 3) -> client 2
    assert fedcls_choose(0, 0, b, 2, first=0).tolist() == [0, 2]
    # union 1111: client 1 (1100) and client 3 (0110) are both at distance 2 -> either, drawn
    third = {(set(fedcls_choose(0, r, b, 3, first=0).tolist()) - {0, 2}).pop() for r in range(30)}
    assert third == {1, 3}
    # a client without samples holds no class (0 >= tau x 0 must not count)
    assert presence(np.array([[0, 0, 0], [5, 1, 0]]), 0.1).tolist() == [[0, 0, 0], [1, 1, 0]]


def test_cohort_size_is_floor_qn_without_float_rounding_loss():
    # 0.29 x 100 = 28.999999999999996 and 0.57 x 100 = 56.99999999999999 in floating point; q N is 29 and 57
    assert [len(sample_clients(0, 0, 100, q)) for q in (0.29, 0.57, 0.1, 0.005)] == [29, 57, 10, 1]


@pytest.mark.parametrize("rule", ["poc", "haccs", "fedcls"])
def test_every_rule_runs_and_records_its_cohorts(rule, tmp_path):
    exp = Experiment(resolve({**TINY, "selection": rule}), Store(tmp_path / "s.db"))
    res = exp.run()
    assert res.status == "finished"
    s = Store(tmp_path / "s.db")
    if rule == "poc":
        recs = s.records(res.run_id, "selection")
        assert [r["round"] for r in recs] == [0, 1, 2]
        assert all(len(r["data"]["candidates"]) == 4 and len(r["data"]["losses"]) == 4 for r in recs)
    if rule == "haccs":
        lat = s.records(res.run_id, "latency")
        assert len(lat) == 1 and len(lat[0]["data"]["latency"]) == 8
    # the cohorts differ from the uniform draw's in at least one round
    uni = Experiment(resolve(TINY), Store(tmp_path / "u.db"))
    uni.run()
    assert not torch.equal(exp.state["w"], uni.state["w"])


def test_bad_selection_settings_name_the_key(tmp_path):
    with pytest.raises(ConfigError) as e:
        Experiment(resolve({**TINY, "selection": "poc", "selection.d": 1}), Store(tmp_path / "a.db")).run()
    assert e.value.key == "selection.d" and "[2, 8]" in str(e.value)
    with pytest.raises(ConfigError) as e:
        Experiment(resolve({**TINY, "method": "local", "selection": "poc"}), Store(tmp_path / "b.db")).run()
    assert e.value.key == "selection"
    assert Store(tmp_path / "b.db").runs() == []                  # refused before the run is stored
    with pytest.raises(ConfigError):
        resolve({**TINY, "selection": "best"})
    with pytest.raises(ConfigError) as e:                         # a method that draws its own cohorts
        Experiment(resolve({**TINY, "method": "clust_psi_pfl", "selection": "fedcls",
                            "clust_psi_pfl.sampling": "per_cluster"}), Store(tmp_path / "c.db")).run()
    assert e.value.key == "selection" and "sampling=global" in str(e.value)


def test_power_of_choice_on_flower_equals_in_process(tmp_path, task_identity):
    from test_flower import FakeGrid, assert_same_state, in_process, nodes_for, run_config

    from fedprism.flower.server_app import serve
    exp = ("method=fedavg dataset=digits clients=4 rounds=2 fraction=0.5 local_epochs=1 lr=0.05 model=mlp "
           "device=cpu engine=sequential partition.alpha=0.5 seed=3 selection=poc selection.d=3")
    ref, _ = in_process(exp, tmp_path / "ref.db")
    rc = run_config(exp, tmp_path / "fl.db", save_final=str(tmp_path / "final.pt"))
    res = serve(FakeGrid(nodes_for(4), rc), rc)
    assert res.status == "finished"
    assert_same_state(ref.state, torch.load(tmp_path / "final.pt", weights_only=False)["state"])
    a = [r["data"]["candidates"] for r in Store(tmp_path / "ref.db").records(ref.run_id, "selection")]
    b = [r["data"]["candidates"] for r in Store(tmp_path / "fl.db").records(res.run_id, "selection")]
    assert a == b and len(a) == 2

