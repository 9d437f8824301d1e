"""Krum, Multi-Krum and Bulyan (`aggregation.average` with rule krum / multi_krum / bulyan): Krum's scores
and every rule's choice on hand-made vectors, Multi-Krum with m = n is the mean bit for bit (alone and
through the runner), a planted outlier is excluded, a brute-force reference of Bulyan, the fallback for
too few rows, the configuration checks, and every averaging method takes the rules without a run id
changing."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from fedprism.algorithms import REGISTRY
from fedprism.algorithms.aggregation import (BYZANTINE_RULES, average, bulyan_select, check_rule_cohort,
                                             krum_scores, multi_krum_select, squared_distances, weighted_sum)
from fedprism.errors import ConfigError
from fedprism.experiment.config import parse_overrides, resolve
from fedprism.experiment.limits import check_cohort

# five hand-made vectors; squared distances:
#   d01 = 1, d02 = 4, d03 = 2, d04 = 200, d12 = 5, d13 = 1, d14 = 181, d23 = 2, d24 = 164, d34 = 162
# with f = 1, each score sums the n - f - 2 = 2 smallest distances to the others:
#   s0 = 1 + 2 = 3, s1 = 1 + 1 = 2, s2 = 2 + 4 = 6, s3 = 1 + 2 = 3, s4 = 162 + 164 = 326
V = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0], [1.0, 1.0], [10.0, 10.0]])
W = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])


def test_krum_scores_by_hand():
    d2 = squared_distances(V)
    assert d2.tolist() == [[0, 1, 4, 2, 200], [1, 0, 5, 1, 181], [4, 5, 0, 2, 164], [2, 1, 2, 0, 162],
                           [200, 181, 164, 162, 0]]
    assert krum_scores(d2, 1).tolist() == [3, 2, 6, 3, 326]
    # f = 0: three neighbours each; s0 = 1 + 2 + 4, s1 = 1 + 1 + 5, s2 = 2 + 4 + 5, s3 = 1 + 2 + 2, s4 = 162 + 164 + 181
    assert krum_scores(d2, 0).tolist() == [7, 7, 11, 5, 507]


def test_squared_distances_in_blocks_of_columns(monkeypatch):
    """Blocks of a few columns give the distances of whole rows (the sums of exact small integers here)."""
    import fedprism.algorithms.aggregation as agg

    g = torch.Generator().manual_seed(8)
    v = torch.randint(-5, 6, (6, 11), generator=g).double()
    want = ((v[:, None, :] - v[None, :, :]) ** 2).sum(-1)
    monkeypatch.setattr(agg, "_DIST_BLOCK", 13)                    # 2 columns a block for 6 rows
    got = squared_distances(v)
    assert torch.equal(got, want) and torch.equal(got, got.T)


def test_krum_and_multi_krum_choose_by_hand():
    # Krum: the lowest score, s1 = 2 -> V1 itself (weights play no part in the choice)
    assert average(V, W, rule="krum", f=1).tolist() == [1.0, 0.0]
    # Multi-Krum m = 3: s1 = 2, then s0 = s3 = 3 -> rows 0, 1, 3; their weighted mean (1 V0 + 2 V1 + 4 V3) / 7
    assert average(V, W, rule="multi_krum", f=1, m=3).tolist() == pytest.approx([6 / 7, 4 / 7], abs=1e-15)
    # m = 2: s1, then the tie s0 = s3 goes to the lower row, 0: (1 V0 + 2 V1) / 3
    assert average(V, W, rule="multi_krum", f=1, m=2).tolist() == pytest.approx([2 / 3, 0.0], abs=1e-15)
    # m = 0 is n - f = 4: every row but the outlier V4
    assert multi_krum_select(squared_distances(V), 1, 0).tolist() == [0, 1, 2, 3]
    assert average(V, W, rule="multi_krum", f=1).tolist() == pytest.approx([6 / 10, 10 / 10], abs=1e-15)


def test_the_updates_are_compared_and_the_rows_averaged():
    """With `sent`, the scores are those of the updates x - sent: the rows below are far apart, but their
    updates are V, so Krum picks row 1 again, and returns the row (sent_1 + V1), not the update."""
    sent = torch.tensor([[100.0, 0.0], [0.0, 50.0], [-7.0, 3.0], [2.0, 2.0], [0.0, 0.0]])
    assert average(V + sent, W, sent, rule="krum", f=1).tolist() == [1.0, 50.0]
    assert multi_krum_select(squared_distances(V + sent - sent), 1, 2).tolist() == [0, 1]
    # without `sent` the rows themselves are compared: row 3 ((3, 3)) is now the most central
    assert average(V + sent, W, None, rule="krum", f=1).tolist() == [3.0, 3.0]


# Bulyan on seven values (f = 1: n = 7 >= 4f + 3), one coordinate:
#   rows 0..6 = 0, 1, 2, 4, 7, 20, -30
#   (B1) theta = n - 2f = 5 picks by Krum on the rows left, |R| - f - 2 neighbours (at least 1):
#     |R| = 7, 4 neighbours: scores 70, 47, 34, 38, 119, 1110, 4041          -> row 2
#     |R| = 6, 3 neighbours (rows 0, 1, 3, 4, 5, 6): 66, 46, 34, 94, 786, 3017 -> row 3
#     |R| = 5, 2 neighbours (rows 0, 1, 4, 5, 6): 50, 37, 85, 530, 1861        -> row 1
#     |R| = 4, 1 neighbour (rows 0, 4, 5, 6): 49, 49, 169, 900  (tie: lower)   -> row 0
#     |R| = 3, 1 neighbour (rows 4, 5, 6): 169, 169, 1369      (tie: lower)   -> row 4
#   S = rows 0..4 = 0, 1, 2, 4, 7; median 2; distances 2, 1, 0, 2, 5
#   (B2) beta = theta - 2f = 3 closest: 2, 1, then the tie 0 / 4 goes to the lower row (value 0)
SEVEN = torch.tensor([[0.0], [1.0], [2.0], [4.0], [7.0], [20.0], [-30.0]])


def test_bulyan_by_hand():
    assert bulyan_select(squared_distances(SEVEN), 1).tolist() == [0, 1, 2, 3, 4]
    assert average(SEVEN, torch.ones(7), rule="bulyan", f=1).tolist() == [1.0]
    # weights 1..7: the three values 2, 1, 0 of rows 2, 1, 0 (weights 3, 2, 1): (6 + 2 + 0) / 6
    w = torch.arange(1.0, 8.0)
    assert average(SEVEN, w, rule="bulyan", f=1).tolist() == pytest.approx([8 / 6], abs=1e-15)
    # a second coordinate, chosen per coordinate: values 10 x row index -> S rows 0..4 give 0, 10, .., 40
    # (S is chosen on the whole vectors), median 20, closest three 20, 10, 30 -> mean 20
    two = torch.cat([SEVEN, 10 * torch.arange(7.0)[:, None]], 1)
    two[5:, 1] = torch.tensor([1e3, -1e3])
    assert bulyan_select(squared_distances(two), 1).tolist() == [0, 1, 2, 3, 4]
    assert average(two, torch.ones(7), rule="bulyan", f=1).tolist() == [1.0, 20.0]


def _bulyan_reference(x: np.ndarray, f: int) -> np.ndarray:
    """(B1)-(B2) written out with Python lists (equal weights, no ties on continuous random data)."""
    rows = list(range(len(x)))
    chosen = []
    while len(chosen) < len(x) - 2 * f:
        k = max(len(rows) - f - 2, 1)
        scores = {i: sum(sorted(float(((x[i] - x[j]) ** 2).sum()) for j in rows if j != i)[:k]) for i in rows}
        best = min(rows, key=lambda i: scores[i])
        chosen.append(best)
        rows.remove(best)
    S = x[sorted(chosen)]
    beta = len(S) - 2 * f
    out = []
    for c in range(x.shape[1]):
        col = S[:, c]
        med = float(np.median(col))
        out.append(np.mean(sorted(col, key=lambda v: abs(v - med))[:beta]))
    return np.array(out)


@pytest.mark.parametrize("n, f", [(7, 1), (11, 2), (9, 1), (12, 2)])
def test_bulyan_equals_a_brute_force_reference(n, f):
    g = torch.Generator().manual_seed(n + 10 * f)
    x = torch.randn(n, 6, generator=g, dtype=torch.float64)
    got = average(x, torch.ones(n), rule="bulyan", f=f)
    assert np.allclose(got.numpy(), _bulyan_reference(x.numpy(), f), atol=1e-12)


def _multi_krum_reference(x: np.ndarray, w: np.ndarray, f: int, m: int) -> np.ndarray:
    n = len(x)
    scores = [sum(sorted(float(((x[i] - x[j]) ** 2).sum()) for j in range(n) if j != i)[:n - f - 2])
              for i in range(n)]
    keep = sorted(sorted(range(n), key=lambda i: scores[i])[:m])
    return (w[keep, None] * x[keep]).sum(0) / w[keep].sum()


@pytest.mark.parametrize("n, f, m", [(5, 1, 1), (8, 2, 3), (10, 3, 6), (6, 0, 4)])
def test_multi_krum_equals_a_brute_force_reference(n, f, m):
    g = torch.Generator().manual_seed(n * m)
    x, w = torch.randn(n, 5, generator=g, dtype=torch.float64), torch.rand(n, generator=g, dtype=torch.float64) + 0.5
    got = average(x, w, rule="multi_krum", f=f, m=m)
    assert np.allclose(got.numpy(), _multi_krum_reference(x.numpy(), w.numpy(), f, m), atol=1e-12)


# -- Multi-Krum with everyone: the mean, bit for bit ---------------------------------------------------------
def test_multi_krum_with_m_n_is_the_weighted_mean_bit_for_bit():
    g = torch.Generator().manual_seed(3)
    for n, f in ((5, 1), (9, 3), (4, 0)):
        x, w = torch.randn(n, 37, generator=g), torch.rand(n, generator=g) * 50 + 1
        assert torch.equal(average(x, w, rule="multi_krum", f=f, m=n), weighted_sum(x, w))
        assert torch.equal(average(x, w, rule="multi_krum", f=f, m=n), average(x, w))
        assert torch.equal(average(x, w, x * 0.5, rule="multi_krum", f=f, m=n), average(x, w))


def test_multi_krum_with_m_n_runs_as_fedavg_bit_for_bit(tmp_path):
    """Through the whole round loop: fedavg.aggregation=multi_krum with m = the cohort gives the default
    FedAvg's model and stored metrics, round by round and client by client."""
    from test_fedprox_ditto_apfl import assert_same_run, run

    assert_same_run(run(tmp_path, "fedavg"),
                    run(tmp_path, "fedavg", fedavg__aggregation="multi_krum", fedavg__aggregation__m=3,
                        fedavg__aggregation__f=0))


# -- a planted outlier ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("n, f, bad", [(9, 1, (4,)), (11, 2, (0, 7))])
def test_the_planted_outliers_are_excluded(n, f, bad):
    """Honest updates around a common direction; the planted clients send a large update (the model of a
    hostile client, with a weight 100 x the honest ones). Krum picks an honest row, Multi-Krum's and
    Bulyan's selections hold no planted row, and each aggregate lies in the honest rows' per-coordinate
    range; the plain mean is dragged far out of it."""
    g = torch.Generator().manual_seed(n)
    P = 40
    sent = torch.randn(P, generator=g).expand(n, P)
    u = 0.1 * torch.randn(n, P, generator=g) + 0.05
    w = torch.full((n,), 60.0)
    for b in bad:
        u[b] = 3.0 * torch.randn(P, generator=g)
        w[b] = 6000.0
    x = sent + u
    honest = np.array([i not in bad for i in range(n)])
    d2 = squared_distances(u)
    assert not set(multi_krum_select(d2, f, 0).tolist()) & set(bad)
    assert not set(bulyan_select(d2, f).tolist()) & set(bad)
    lo = x[honest].double().min(0).values - 1e-12
    hi = x[honest].double().max(0).values + 1e-12
    for rule in BYZANTINE_RULES:
        got = average(x, w, sent, rule=rule, f=f)
        assert bool(((got >= lo) & (got <= hi)).all()), rule
    krum_row = average(x, w, sent, rule="krum", f=f)
    assert any(torch.equal(krum_row, x[i].double()) for i in np.flatnonzero(honest))
    plain = average(x, w, sent)
    assert not bool(((plain >= lo) & (plain <= hi)).all())


def test_fedavg_with_krum_ignores_a_hostile_client_in_a_run(tmp_path):
    """A client whose upload is replaced by a far-off model: with fedavg.aggregation=krum (or bulyan) the
    server model is one honest client's model every round; with the mean it is not."""
    from fedprism.experiment.runner import Experiment
    from fedprism.experiment.store import Store
    from fedprism.flower.settings import parse_experiment

    def hostile_run(rule: str):
        exp = ("method=fedavg dataset=digits clients=7 rounds=2 fraction=1.0 local_epochs=1 lr=0.05 model=mlp "
               f"device=cpu engine=sequential seed=4 fedavg.aggregation={rule}")
        e = Experiment(parse_experiment(exp), Store(tmp_path / f"{rule}.db"))
        real_update, real_aggregate, seen = e.algo.client_update, e.algo.aggregate, []

        def client_update(plan, trainer, rnd, cstate):
            up = real_update(plan, trainer, rnd, cstate)
            i = int(np.flatnonzero(up.clients == 3)[0])
            up.payload["params"][i] = up.payload["params"][i] + 5.0
            return up

        def aggregate(state, rnd, update):
            out = real_aggregate(state, rnd, update)
            seen.append((update.params.clone(), state["w"].clone(), int(np.flatnonzero(update.clients == 3)[0])))
            return out

        e.algo.client_update, e.algo.aggregate = client_update, aggregate
        assert e.run().status == "finished"
        return seen

    for rows, w, bad in hostile_run("krum"):
        assert any(torch.equal(w, rows[i]) for i in range(len(rows)) if i != bad)
    for rows, w, bad in hostile_run("bulyan"):
        assert float((w - rows[bad]).abs().min()) > 1.0                     # nothing of the hostile model
    rows, w, bad = hostile_run("mean")[0]
    assert float((w - rows[[i for i in range(len(rows)) if i != bad]].mean(0)).abs().max()) > 0.5


# -- too few rows: the documented fallback -----------------------------------------------------------------------
def test_fewer_rows_use_the_largest_f_they_allow():
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(6, 3, generator=g), torch.rand(6, generator=g) + 0.5
    # Krum: 6 rows allow f' = floor((6 - 3) / 2) = 1 when f = 2 is asked
    assert torch.equal(average(x, w, rule="krum", f=2), average(x, w, rule="krum", f=1))
    assert torch.equal(average(x, w, rule="multi_krum", f=4, m=0), average(x, w, rule="multi_krum", f=1, m=0))
    # Bulyan: 6 rows allow f' = floor(3 / 4) = 0 -> every row, every value: the mean (up to rounding)
    assert torch.allclose(average(x, w, rule="bulyan", f=1), average(x, w), atol=1e-12, rtol=0)
    # m above the rows: every row
    assert torch.equal(average(x[:4], w[:4], rule="multi_krum", f=0, m=9), average(x[:4], w[:4]))
    # two rows or one: no row can be told from the other -> the weighted mean
    for rule in BYZANTINE_RULES:
        assert torch.equal(average(x[:2], w[:2], rule=rule, f=1), average(x[:2], w[:2])), rule
        assert torch.equal(average(x[:1], w[:1], rule=rule, f=1), x[0].double()), rule


def test_rows_of_weight_zero_take_no_part():
    """A client outside the cluster being averaged (weight 0) is neither scored nor averaged."""
    g = torch.Generator().manual_seed(6)
    x, w = torch.randn(9, 4, generator=g), torch.rand(9, generator=g) + 0.5
    x[2] += 1e3
    w0 = w.clone()
    w0[[2, 5]] = 0.0
    keep = [i for i in range(9) if i not in (2, 5)]
    for rule in BYZANTINE_RULES:
        assert torch.allclose(average(x, w0, rule=rule, f=1), average(x[keep], w[keep], rule=rule, f=1),
                              atol=1e-12, rtol=0), rule
    with pytest.raises(ValueError, match="weights sum to zero"):
        average(x, torch.zeros(9), rule="krum")


# -- configuration -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra, key, value, allowed", [
    ("fedavg.aggregation=krum fedavg.aggregation.f=2 clients=6 fraction=1.0", "fedavg.aggregation.f", 2,
     "an integer in [0, 1] here: krum needs a round's n clients to satisfy n > 2f + 2 (clients=6 x fraction=1 "
     "gives 6 client(s) a round)"),
    ("fedavg.aggregation=multi_krum fedavg.aggregation.f=3 clients=10 fraction=0.8", "fedavg.aggregation.f", 3,
     "an integer in [0, 2] here: multi_krum needs a round's n clients to satisfy n > 2f + 2 (clients=10 x "
     "fraction=0.8 gives 8 client(s) a round)"),
    ("fedavg.aggregation=bulyan clients=6 fraction=1.0", "fedavg.aggregation.f", 1,
     "an integer in [0, 0] here: bulyan needs a round's n clients to satisfy n >= 4f + 3"),
    ("fedavg.aggregation=krum clients=2", "fedavg.aggregation", "krum",
     "a rule other than krum here: krum needs a round of n > 2f + 2 clients, 3 at least"),
    ("fedavg.aggregation=multi_krum fedavg.aggregation.m=7 clients=6 fraction=1.0", "fedavg.aggregation.m", 7,
     "an integer in [1, 6], or 0 for n - f"),
    ("ditto.aggregation=bulyan ditto.aggregation.f=2 clients=20 fraction=0.5", "ditto.aggregation.f", 2,
     "an integer in [0, 1] here: bulyan"),
    # cohorts are drawn from the clients that train: 14 of 20 with 30 % held out, 0.5 x 14 = 7 would do, 0.35 x 14
    # = 4 does not (clients x fraction = 7 would have passed)
    ("fedavg.aggregation=bulyan clients=20 fraction=0.35 data.unseen_clients=0.3", "fedavg.aggregation.f", 1,
     "(fraction=0.35 x the 14 clients that train (data.unseen_clients=0.3 holds out 6 of clients=20) gives 4 "
     "client(s) a round); to tolerate f = 1, raise fraction or clients until a round has 7 clients or more"),
])
def test_a_cohort_too_small_for_f_is_a_config_error(extra, key, value, allowed):
    method = key.split(".")[0]
    cfg = resolve({"method": method, **parse_overrides(extra.split())})
    with pytest.raises(ConfigError) as err:
        check_cohort(cfg)
    assert err.value.key == key and err.value.value == value and allowed in str(err.value)


def test_a_cohort_that_allows_f_passes():
    for extra in ({"fedavg.aggregation": "krum", "fedavg.aggregation.f": 1, "clients": 5},
                  {"fedavg.aggregation": "bulyan", "fedavg.aggregation.f": 1, "clients": 7},
                  {"fedavg.aggregation": "multi_krum", "fedavg.aggregation.m": 5, "clients": 5},
                  {"fedavg.aggregation": "median", "fedavg.aggregation.f": 9, "clients": 2},
                  {"fedavg.aggregation": "bulyan", "clients": 10, "data.unseen_clients": 0.3}):
        check_cohort(resolve({"method": "fedavg", "fraction": 1.0, **extra}))
    check_rule_cohort("fedavg", {"aggregation": "mean"}, 1)


@pytest.mark.parametrize("key, value", [("fedavg.aggregation.f", -1), ("fedavg.aggregation.f", 1.5),
                                        ("fedavg.aggregation.m", -2), ("fedavg.aggregation", "krumm")])
def test_bad_values_name_the_key(key, value):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        resolve({"method": "fedavg", key: value})


AVERAGING = sorted(m for m in REGISTRY if REGISTRY[m].averages)


@pytest.mark.parametrize("method", AVERAGING)
def test_every_averaging_method_takes_the_rules_and_keeps_its_run_id(method):
    """The new keys are `new=True`: at their defaults a configuration's run id is the one it had before
    they existed (the default, and f = 1, m = 0 given explicitly); a Byzantine rule is another run."""
    base = resolve({"method": method})
    assert {"aggregation.f", "aggregation.m"} <= set(base.method_params)
    assert "aggregation.f" not in str(base.identity) and "aggregation.m" not in str(base.identity)
    assert base.run_id == resolve({"method": method, f"{method}.aggregation.f": 1,
                                   f"{method}.aggregation.m": 0}).run_id
    ids = {resolve({"method": method, f"{method}.aggregation": r}).run_id for r in BYZANTINE_RULES}
    assert len(ids) == 3 and base.run_id not in ids
    assert resolve({"method": method, f"{method}.aggregation": "krum", f"{method}.aggregation.f": 2}).run_id not in ids


@pytest.mark.parametrize("method, extra", [("ifca", "ifca.k=2"), ("fedprism", "fedprism.k=2 fedprism.every=1"),
                                           ("fedper", ""), ("feddyn", "")])
@pytest.mark.parametrize("rule", BYZANTINE_RULES)
def test_methods_run_with_the_rules(method, extra, rule, tmp_path):
    """Cluster models (IFCA: a cluster's members, fewer than the cohort: the fallback), soft clusters
    (Fed-PRISM: weights 0 for other clusters' rows), a shared body (FedPer) and FedDyn run a round or two."""
    from fedprism.experiment.runner import Experiment
    from fedprism.experiment.store import Store
    from fedprism.flower.settings import parse_experiment

    exp = (f"method={method} dataset=digits clients=7 rounds=2 fraction=1.0 local_epochs=1 lr=0.05 model=mlp "
           f"device=cpu engine=sequential seed=0 {extra} {method}.aggregation={rule}")
    e = Experiment(parse_experiment(exp), Store(tmp_path / "s.db"))
    key, real, moved = REGISTRY[method].averages[0], e.algo.aggregate, []

    def aggregate(state, rnd, update):
        before = state[key].clone()
        out = real(state, rnd, update)
        moved.append(not torch.equal(state[key], before))
        return out

    e.algo.aggregate = aggregate
    res = e.run()
    assert res.status == "finished" and not res.history[-1].get("rejected")
    assert moved == [True, True]                                  # the averaged model moved every round


def test_rules_equal_to_a_subset_mean_keep_the_dtype():
    """The server writes the aggregate in the model's dtype through the usual path (FedAvg.aggregate)."""
    from fedprism.algorithms.fedavg import FedAvg
    from fedprism.protocol import Context, Update

    ctx = Context(num_clients=5, num_classes=2, spec=None, init=torch.zeros(2), n_train=np.ones(5),
                  label_hist=np.ones((5, 2)), seed=0, rounds=1, fraction=1.0)
    up = Update(np.arange(5), {"params": V.clone()}, W.double(), sent={"params": torch.zeros(5, 2)})
    for rule, want in (("krum", [1.0, 0.0]), ("multi_krum", [0.6, 1.0])):
        algo = FedAvg(ctx, aggregation=rule)
        state = algo.init_state()
        algo.aggregate(state, 0, up)
        assert state["w"].dtype == torch.float32 and state["w"].tolist() == pytest.approx(want, abs=1e-7), rule


def test_itertools_free_reference_sanity():
    """The references above agree with an exhaustive check of Krum's definition on one small case: the
    chosen row minimises the sum over its n - f - 2 nearest others among all subsets of that size."""
    x = V.double().numpy()
    n, f = 5, 1
    best = min(range(n), key=lambda i: min(sum(((x[i] - x[j]) ** 2).sum() for j in c)
                                           for c in itertools.combinations([j for j in range(n) if j != i], n - f - 2)))
    assert best == 1 and average(V, W, rule="krum", f=f).tolist() == V[best].tolist()


def test_the_server_step_passes_f_and_m_to_the_rule():
    """`<method>.aggregation.f` and `.m` reach `average` through `ServerStep` (robust_args)."""
    from fedprism.algorithms.aggregation import ServerStep

    hp = {"aggregation": "multi_krum", "aggregation.f": 2, "aggregation.m": 3}
    x = torch.cat([V, torch.tensor([[0.5, 0.5], [0.2, 0.9], [5.0, 5.0]])])
    w = torch.ones(8)
    got = ServerStep(hp).average(x, w)
    assert torch.equal(got, average(x, w, rule="multi_krum", f=2, m=3))     # rows 5, 6, 1
    assert not torch.equal(got, average(x, w, rule="multi_krum", f=1, m=3))  # rows 5, 6, 3
    assert not torch.equal(ServerStep({**hp, "aggregation.m": 0}).average(x, w), got)
