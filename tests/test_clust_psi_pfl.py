"""Clust-PSI-PFL (Jimenez-Gutierrez et al. 2025, arXiv:2512.20363): PSI by hand, the silhouette search,
planted groups, per-cluster sampling, late clients, the one-off label-count upload, a tiny run."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from fedprism.algorithms.clust_psi_pfl import ClustPsiPfl, psi_clusters, psi_features, zscore
from fedprism.clustering import choose_k_silhouette
from fedprism.data.heterogeneity import psi, wpsi
from fedprism.experiment.config import resolve
from fedprism.protocol import Context, Update

TINY = ("method=clust_psi_pfl dataset=digits clients=8 rounds=2 fraction=0.5 local_epochs=1 lr=0.05 model=mlp "
        "device=cpu engine=sequential partition.alpha=0.3 seed=3")


def test_psi_hand_values():
    # PSI([0.5, 0.5] vs [0.25, 0.75]) = 0.25 ln 2 + 0.25 ln(1.5) = 0.274653 (global first, client second)
    total, terms = psi(np.array([[1.0, 3.0]]), np.array([1.0, 1.0]), eps=0.0)
    assert total[0] == pytest.approx(0.25 * math.log(2) + 0.25 * math.log(1.5), abs=1e-12)
    assert total[0] == pytest.approx(0.274653, abs=1e-6)
    assert terms[0].tolist() == pytest.approx([0.25 * math.log(2), 0.25 * math.log(1.5)], abs=1e-12)
    # a missing class with the authors' eps = 1e-6: 0.5 ln(0.5 / 1e-6) twice-ish = 6.9078
    total, _ = psi(np.array([[0.0, 4.0]]), np.array([1.0, 1.0]))
    assert total[0] == pytest.approx(6.9078, abs=1e-4)
    # WPSI = 0 when every client has the global pmf; sample-weighted otherwise
    assert wpsi(np.array([[2.0, 2.0], [5.0, 5.0]])) == 0.0
    h = np.array([[1.0, 3.0], [3.0, 1.0], [2.0, 2.0]])
    per, _ = psi(h)
    assert wpsi(h) == pytest.approx(float((h.sum(1) * per).sum() / h.sum()), abs=1e-12)
    # the feature row is [PSI_i, PSI_i1 .. PSI_iC]
    x = psi_features(h)
    assert x.shape == (3, 3) and np.allclose(x[:, 0], x[:, 1:].sum(1))
    # a client without label counts is given the global pmf: PSI 0 in every column, not NaN
    assert psi_features(np.vstack([h, [0.0, 0.0]]))[3].tolist() == [0.0, 0.0, 0.0]


def test_zscore_constant_column_is_zero():
    z, mean, std = zscore(np.array([[1.0, 5.0], [3.0, 5.0]]))
    assert z.tolist() == [[-1.0, 0.0], [1.0, 0.0]] and std.tolist() == [1.0, 0.0]


def test_zscore_constant_column_is_zero_despite_a_rounding_residue():
    # the mean of 0.1 three times is 0.10000000000000002: numpy's std is 1.4e-17, not 0. A late client
    # standardised with that scaler would get (0.3 - mean) / 1.4e-17 ~ 1e16 in the column, a term that
    # swamps every other column's distance to the centroids (nearest centroid: a tie, cluster 0)
    x = np.array([[0.1, 0.0], [0.1, 1.0], [0.1, 2.0]])
    z, mean, std = zscore(x)
    assert std[0] == 0.0 and z[:, 0].tolist() == [0.0] * 3
    late, _, _ = zscore(np.array([[0.3, 2.0]]), mean, std)
    assert late[0, 0] == 0.0 and late[0, 1] == pytest.approx(z[2, 1])


def test_silhouette_hand_value_and_smallest_tau_on_ties():
    # 1-D points 0, 1, 10, 11 in two clusters: s = mean(9.5/10.5, 8.5/9.5, 8.5/9.5, 9.5/10.5)
    x = np.array([[0.0], [1.0], [10.0], [11.0]])
    k, scores = choose_k_silhouette(x, seed=0)
    assert k == 2 and scores[2] == pytest.approx((9.5 / 10.5 + 8.5 / 9.5) / 2, abs=1e-12)   # 0.899749
    # three identical pairs: j = 3 is perfect (silhouette 1), j = 2 is not; j = 4, 5 have singletons (s = 0)
    x = np.array([[0.0], [0.0], [5.0], [5.0], [10.0], [10.0]])
    k, scores = choose_k_silhouette(x, seed=0)
    assert k == 3 and scores[3] == pytest.approx(1.0) and 4 not in scores      # 3 distinct rows: j > 3 skipped


def test_ties_go_to_the_smallest_tau(monkeypatch):
    """Every candidate scores the same: the strict '>' of the paper's loop keeps the first, j = 2."""
    import sklearn.metrics

    monkeypatch.setattr(sklearn.metrics, "silhouette_score", lambda *a, **k: 0.5)
    h, _ = _planted_hist()
    cl = psi_clusters(h, seed=0)
    assert set(cl.scores.values()) == {0.5} and len(cl.scores) > 2 and cl.tau == 2


def _planted_hist(seed: int = 0, centres=(0.9, 0.2), jitter: float = 0.01, sizes=(5, 5)
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Two groups (of `sizes` clients, five each by default) with pmfs [p, 1 - p] jittered around the two
    centres."""
    rng = np.random.default_rng(seed)
    rows, truth = [], []
    for g, (p, size) in enumerate(zip(centres, sizes)):
        for _ in range(size):
            q = p + rng.uniform(-jitter, jitter)
            rows.append([round(1000 * q), 1000 - round(1000 * q)])
            truth.append(g)
    return np.array(rows, dtype=float), np.array(truth)


def _same_groups(labels: np.ndarray, truth: np.ndarray) -> bool:
    return all(len(set(labels[truth == g])) == 1 for g in set(truth)) and len(set(labels)) == len(set(truth))


def test_planted_groups_give_tau_2_and_those_groups():
    h, truth = _planted_hist()
    cl = psi_clusters(h, seed=0)
    assert cl.tau == 2 and max(cl.scores, key=cl.scores.get) == 2 and len(cl.scores) == 8     # j = 2..9 tried
    assert _same_groups(cl.labels, truth)
    assert cl.wpsi == pytest.approx(wpsi(h), abs=1e-12)


def test_equal_psi_groups_are_separated_by_the_per_class_terms():
    """Mirrored pmfs [0.9, 0.1] and [0.1, 0.9]: every client has the same PSI_i (its column standardises
    to 0); only the per-class terms tell the groups apart."""
    h, truth = _planted_hist(centres=(0.9, 0.1), jitter=0.0)
    x = psi_features(h)
    assert np.allclose(x[:, 0], x[0, 0]) and not np.allclose(x[:, 1], x[0, 1])
    cl = psi_clusters(h, seed=0)
    assert cl.tau == 2 and _same_groups(cl.labels, truth)
    assert list(cl.scores) == [2]                     # two distinct rows: j > 2 is skipped, not scored


def test_identical_rows_give_one_cluster_with_a_reason_and_fixed_tau():
    h = np.tile([[10.0, 10.0, 5.0]], (6, 1))
    cl = psi_clusters(h, seed=0)
    assert cl.tau == 1 and (cl.labels == 0).all() and "no feasible" in cl.reason
    h, _ = _planted_hist()
    assert psi_clusters(h, seed=0, clusters=3).tau == 3
    assert psi_clusters(h, seed=0, max_clusters=2).scores.keys() == {2}


def _ctx(hist: np.ndarray, fraction: float = 0.5, P: int = 3) -> Context:
    hist = np.asarray(hist, dtype=float)
    return Context(num_clients=len(hist), num_classes=hist.shape[1], spec=None, init=torch.zeros(P),
                   n_train=hist.sum(1), label_hist=hist, seed=0, rounds=3, fraction=fraction)


def _distinct_models(state: dict) -> None:
    """Give every cluster its own model row (they all start at the same init), so a payload names its row."""
    tau, P = state["w"].shape
    state["w"] = torch.arange(tau * P, dtype=torch.float32).view(tau, P) + 1.0


def _sends_each_client_its_cluster_model(state: dict, plan) -> None:
    """Row i of the payload is the model of the cluster planned client i is assigned to (both clusters
    are in the plan, so a payload from the wrong row shows)."""
    a = state["assign"][torch.as_tensor(plan.clients)]
    assert sorted(set(a.tolist())) == [0, 1] and len(state["w"]) == 2
    for i, c in enumerate(a.tolist()):
        assert torch.equal(plan.payload["params"][i], state["w"][c]), (plan.clients[i], c)


def test_per_cluster_sampling_takes_q_of_each_cluster():
    """q |c| = 2 members of each cluster of five; each planned client is sent its own cluster's model row
    (with either sampling)."""
    h, truth = _planted_hist()
    algo = ClustPsiPfl(_ctx(h, fraction=0.4), sampling="per_cluster")
    assert _same_groups(algo.init_state()["assign"].numpy(), truth)
    state = algo.init_state()
    _distinct_models(state)
    plan = algo.plan(state, 0, np.arange(3))                     # the runner's cohort is replaced
    g = truth[plan.clients]
    assert len(plan.clients) == 4 and (g == 0).sum() == 2 and (g == 1).sum() == 2
    _sends_each_client_its_cluster_model(state, plan)
    assert not np.array_equal(algo.plan(state, 1, np.arange(3)).clients, plan.clients) or \
        not np.array_equal(algo.plan(state, 2, np.arange(3)).clients, plan.clients)
    glob = ClustPsiPfl(_ctx(h, fraction=0.4))          # the default: the paper's uniform cohort
    gstate = glob.init_state()
    _distinct_models(gstate)
    gplan = glob.plan(gstate, 0, np.array([0, 1, 7]))
    assert gplan.clients.tolist() == [0, 1, 7]
    _sends_each_client_its_cluster_model(gstate, gplan)


@pytest.mark.parametrize("fraction, want", [(0.4, (2, 1)), (0.1, (1, 1))])
def test_per_cluster_sampling_floors_q_times_the_cluster_size(fraction, want):
    """Clusters of 7 and 4 clients: max(floor(q |c|), 1) members each (the module's rule), i.e. q = 0.4
    takes 2 of 7 (q |c| = 2.8, rounding would take 3) and 1 of 4 (1.6, rounding: 2); q = 0.1 takes the
    minimum of one from each (0.7 and 0.4 floor to 0). The payloads are the members' cluster models."""
    h, truth = _planted_hist(sizes=(7, 4), jitter=0.0)                   # two distinct rows: tau = 2
    algo = ClustPsiPfl(_ctx(h, fraction=fraction), sampling="per_cluster")
    state = algo.init_state()
    assert _same_groups(state["assign"].numpy(), truth)
    _distinct_models(state)
    for rnd in range(3):
        plan = algo.plan(state, rnd, np.arange(3))
        g = truth[plan.clients]
        assert ((g == 0).sum(), (g == 1).sum()) == want and len(set(plan.clients.tolist())) == sum(want), rnd
        _sends_each_client_its_cluster_model(state, plan)


def test_min_two_per_cluster_is_the_authors_federation_per_cluster():
    """Clusters of 7, 2 and 1 clients at q = 0.2 with `min_per_cluster=2` (the authors' code: each cluster a
    federation with fraction q and at least two fit clients): floor(0.2 * 7) = 1 -> 2 of 7, both of the
    pair, the singleton alone, in every round; with the default (1) the pair sends one member."""
    from fedprism.algorithms.clust_psi_pfl import per_cluster_count

    assert [per_cluster_count(0.2, n, 2) for n in (7, 2, 1, 10, 0)] == [2, 2, 1, 2, 0]
    assert [per_cluster_count(0.2, n) for n in (7, 2, 1, 10)] == [1, 1, 1, 2]
    assert [per_cluster_count(0.5, n, 2) for n in (7, 3, 2, 1)] == [3, 2, 2, 1]
    h = np.array([[90.0, 10.0, 0.0]] * 7 + [[10.0, 90.0, 0.0]] * 2 + [[0.0, 10.0, 90.0]])
    truth = np.array([0] * 7 + [1] * 2 + [2])
    algo = ClustPsiPfl(_ctx(h, fraction=0.2), sampling="per_cluster", min_per_cluster=2, clusters=3)
    state = algo.init_state()
    assert _same_groups(state["assign"].numpy(), truth)
    _distinct_models(state)
    seen = set()
    for rnd in range(6):
        plan = algo.plan(state, rnd, np.arange(2))
        g = truth[plan.clients]
        assert ((g == 0).sum(), (g == 1).sum(), (g == 2).sum()) == (2, 2, 1), rnd
        seen.add(tuple(plan.clients[g == 0]))
        a = state["assign"][torch.as_tensor(plan.clients)]
        assert all(torch.equal(plan.payload["params"][i], state["w"][c]) for i, c in enumerate(a.tolist()))
    assert len(seen) > 1                                  # the big cluster's pair is drawn anew each round
    one = ClustPsiPfl(_ctx(h, fraction=0.2), sampling="per_cluster", clusters=3)
    g = truth[one.plan(one.init_state(), 0, np.arange(2)).clients]
    assert ((g == 0).sum(), (g == 1).sum(), (g == 2).sum()) == (1, 1, 1)


def test_min_per_cluster_needs_per_cluster_sampling_and_keeps_run_ids():
    from fedprism.errors import ConfigError

    with pytest.raises(ConfigError, match="min_per_cluster"):
        resolve({"method": "clust_psi_pfl", "clust_psi_pfl.min_per_cluster": 2})
    with pytest.raises(ConfigError, match="min_per_cluster"):
        resolve({"method": "clust_psi_pfl", "clust_psi_pfl.sampling": "per_cluster",
                 "clust_psi_pfl.min_per_cluster": 0})
    for sampling in ("global", "per_cluster"):
        b = resolve({"method": "clust_psi_pfl", "clust_psi_pfl.sampling": sampling})
        assert b.run_id == resolve({"method": "clust_psi_pfl", "clust_psi_pfl.sampling": sampling,
                                    "clust_psi_pfl.min_per_cluster": 1}).run_id
    assert resolve({"method": "clust_psi_pfl", "clust_psi_pfl.sampling": "per_cluster",
                    "clust_psi_pfl.min_per_cluster": 2}).run_id != b.run_id


def test_one_cluster_is_fedavg_bit_for_bit(tmp_path):
    """tau fixed to 1: the one cluster model is FedAvg's model after every round (same cohorts, same
    client streams, the same n_k-weighted average), bit for bit, and so are the scores."""
    from fedprism.experiment.runner import Experiment
    from fedprism.experiment.store import Store
    from fedprism.flower.settings import parse_experiment

    tiny = TINY + " partition=dirichlet_per_class"                # clients of unequal sizes: n_k matters
    ours = Experiment(parse_experiment(tiny + " clust_psi_pfl.clusters=1"), Store(tmp_path / "a.db"))
    avg = Experiment(parse_experiment(tiny.replace("method=clust_psi_pfl", "method=fedavg")), Store(tmp_path / "b.db"))
    assert len(set(avg.ctx.n_train.tolist())) > 1
    ra, rb = ours.run(), avg.run()
    assert ours.state["psi"]["tau"] == 1 and ours.state["w"].shape[0] == 1
    assert torch.equal(ours.state["w"][0], avg.state["w"].reshape(-1))
    ha, hb = ours.store.round_metrics(ra.run_id), avg.store.round_metrics(rb.run_id)
    assert [h["local_acc"] for h in ha] == [h["local_acc"] for h in hb]
    assert ra.final["local_acc_weighted"] == rb.final["local_acc_weighted"]


def test_aggregation_is_per_cluster_and_an_idle_cluster_keeps_its_model():
    h, truth = _planted_hist()
    algo = ClustPsiPfl(_ctx(h, fraction=1.0))
    state = algo.init_state()
    a = state["assign"].numpy()
    c0 = a[0]
    members = np.flatnonzero(a == c0)
    x = torch.arange(len(members) * 3, dtype=torch.float32).view(-1, 3)
    n = torch.arange(1, len(members) + 1, dtype=torch.float64)
    before = state["w"].clone()
    algo.aggregate(state, 1, Update(members, {"params": x}, n, sent={"params": torch.zeros_like(x)}))
    want = (n[:, None] * x.double()).sum(0) / n.sum()
    assert torch.equal(state["w"][c0], want.float())
    other = 1 - c0
    assert torch.equal(state["w"][other], before[other])


def test_late_client_joins_the_nearest_centroid():
    h, truth = _planted_hist()
    late = np.vstack([h, [[0.0, 0.0]]])                          # client 10 has not reported yet
    ctx = _ctx(late, fraction=1.0)
    algo = ClustPsiPfl(ctx)
    state = algo.init_state()
    assert int(state["assign"][10]) == -1 and state["psi"]["clustered"] == 10
    ctx.label_hist[10] = [91.0, 9.0]                             # it reports a group-0 pmf
    assert algo.clusters_of(state, np.array([10]))[0] == state["assign"][0]
    plan = algo.plan(state, 0, np.arange(11))
    assert 10 in plan.clients.tolist()
    up = Update(plan.clients, {"params": plan.payload["params"].clone()}, torch.ones(len(plan.clients), dtype=torch.float64),
                sent=dict(plan.payload))
    rec = algo.aggregate(state, 0, up)
    assert int(state["assign"][10]) == int(state["assign"][0]) and rec["joined"]["clients"].tolist() == [10]


def test_new_keys_at_defaults_keep_run_ids():
    base = resolve({"method": "fedavg"})
    for method in ("fedavg", "fedprox", "clust_psi_pfl"):
        b = resolve({"method": method})
        same = resolve({"method": method, f"{method}.server_opt": "none", f"{method}.server_lr": 1.0,
                        f"{method}.server_momentum": 0.9, f"{method}.server_beta1": 0.9,
                        f"{method}.server_beta2": 0.99, f"{method}.server_tau": 1e-3,
                        f"{method}.aggregation": "mean"})
        assert b.run_id == same.run_id, method
        assert resolve({"method": method, f"{method}.server_opt": "adam"}).run_id != b.run_id
    assert base.run_id == resolve({"method": "fedavg", "fedavg.weighting": "samples"}).run_id


def test_tiny_run_records_wpsi_and_counts_the_label_upload(tmp_path):
    from fedprism.experiment.runner import Experiment
    from fedprism.experiment.store import Store
    from fedprism.flower.settings import parse_experiment

    e = Experiment(parse_experiment(TINY), Store(tmp_path / "r.db"))
    res = e.run()
    assert res.status == "finished" and 0 <= res.final["local_acc"] <= 1
    rec = e.store.records(res.run_id, "psi")
    assert len(rec) == 1 and rec[0]["round"] == 0
    d = rec[0]["data"]
    assert d["wpsi"] == pytest.approx(wpsi(e.ctx.label_hist), abs=1e-12) and d["tau"] == len(e.state["w"]) >= 2
    assert d["tau"] == int(max(d["silhouette"], key=lambda k: (d["silhouette"][k], -int(k))))
    clusters = e.store.records(res.run_id, "clusters")[0]["data"]["labels"]
    assert sorted(set(clusters)) == list(range(d["tau"]))
    hist = e.store.round_metrics(res.run_id)
    # round 0: the models went down and up, plus every client's 10 counts of 8 bytes once
    assert hist[0]["bytes_up"] - hist[0]["bytes_down"] == 8 * 10 * 8
    assert hist[1]["bytes_up"] == hist[1]["bytes_down"]
    # each client is scored with its cluster's model
    a = e.state["assign"]
    assert torch.equal(e.algo.model_for(e.state, np.arange(8)), e.state["w"][a])
    # AD and SDAD as the paper defines them: 1 - mean A_k and the population std of A_k
    rows = e.store.client_rows(res.run_id, 1)
    accs = np.array([r["local_acc"] for r in rows], dtype=float)
    n = np.array([r["n_test"] for r in rows], dtype=float)
    assert res.final["ad"] == pytest.approx(1 - accs.mean(), abs=1e-9)
    assert res.final["sdad"] == pytest.approx(accs.std(), abs=1e-9)
    # the paper's global accuracy sum_k n_k A_k / sum_k n_k (n_k: client k's test samples)
    assert res.final["local_acc_weighted"] == pytest.approx((n * accs).sum() / n.sum(), abs=1e-9)


def test_paper_fmnist_cnn_shape():
    """Three 3x3 convolution stages 8/16/32, one 2x2 max-pool, dense 2048, classifier."""
    from fedprism.models import build_model

    m = build_model("clustpsi_fmnist_cnn", (1, 28, 28), 10, seed=0)
    convs = [l for l in m.body if isinstance(l, torch.nn.Conv2d)]
    assert [c.out_channels for c in convs] == [8, 16, 32] and all(c.kernel_size == (3, 3) for c in convs)
    dense = [l for l in m.body if isinstance(l, torch.nn.Linear)]
    assert [(d.in_features, d.out_features) for d in dense] == [(32 * 11 * 11, 2048)]
    assert m(torch.zeros(2, 1, 28, 28)).shape == (2, 10) and m.head[0].in_features == 2048


def test_paper_protocol_sweep_loads():
    from pathlib import Path

    from fedprism.experiment.sweep import load_sweep

    path = Path(__file__).resolve().parents[1] / "sweeps" / "clust_psi_pfl_fmnist.toml"
    name, cfgs = load_sweep(path)
    assert name == "clust_psi_pfl_fmnist"
    ours = [c for c in cfgs if c["method"] == "clust_psi_pfl"]
    assert ours and all(c["clients"] == 100 and c["rounds"] == 40 and c["fraction"] == 0.5 and c["local_epochs"] == 5
                        and c["optimizer"] == "adam" and c["lr"] == 1e-3 and c["batch_size"] == 32
                        and c["model"] == "clustpsi_fmnist_cnn" for c in cfgs)
    parts = {(c["partition"], c.get("partition.alpha"), c.get("partition.s")) for c in ours}
    assert len(parts) == 9 and {c["seed"] for c in ours} == {0, 1}
    from fedprism.selection import cohort_size

    poc = [c for c in cfgs if c.get("selection") == "poc"]     # Power-of-Choice needs m_t <= d <= K
    assert len(poc) == 9 and all(cohort_size(c["clients"], c["fraction"]) <= c["selection.d"] <= c["clients"]
                                 for c in poc)


def test_partition_study_gives_the_tau_a_run_chose(tmp_path):
    """The partition study (Figs. 3, 5, 6) clusters the very partition a run trains on: same tau, same
    silhouette curve and WPSI as the run's `psi` record; infeasible settings are listed, not fatal."""
    from fedprism.data.datasets import load_dataset
    from fedprism.experiment.runner import Experiment
    from fedprism.experiment.store import Store
    from fedprism.flower.settings import parse_experiment
    from fedprism.algorithms.clust_psi_pfl.study import divergence_rows, markdown, plot, silhouette_rows

    e = Experiment(parse_experiment(TINY), Store(tmp_path / "r.db"))
    e.run(stop_after=1)
    d = e.store.records(e.run_id, "psi")[0]["data"]
    ds = load_dataset("digits")
    y, yt = ds.y_train.numpy(), ds.y_test.numpy()
    skipped: list = []
    (row,) = silhouette_rows(y, yt, 10, clients=(8,), seeds=(3,), settings=(("dirichlet", "alpha", 0.3),),
                             skipped=skipped)
    assert row["tau"] == d["tau"] and row["wpsi"] == pytest.approx(d["wpsi"], abs=1e-12)
    assert row["scores"] == pytest.approx({int(k): v for k, v in d["silhouette"].items()}, abs=1e-12)
    div = divergence_rows(y, yt, 10, clients=8, seeds=(3,), skipped=skipped,
                          grids={"dirichlet_per_class": ("alpha", (0.3,)), "similarity": ("s", (0.0, 1.0))})
    assert [(r["protocol"], r["value"]) for r in div] == [("dirichlet_per_class", 0.3), ("similarity", 0.0),
                                                          ("similarity", 1.0)]
    assert div[1]["wpsi"] > div[2]["wpsi"]          # S = 0 (label-sorted) is far less IID than S = 1
    assert not skipped
    silhouette_rows(y, yt, 10, clients=(900,), seeds=(0,), settings=(("dirichlet", "alpha", 0.3),), skipped=skipped)
    assert len(skipped) == 1 and "min_train" in skipped[0][-1]
    md = markdown(div, [row], "digits", skipped)
    assert f"| Dirichlet alpha=0.3 | 8 | {d['tau']} |" in md and "cannot be partitioned" in md
    # a setting skipped by both figures, over two seeds, is one line naming both seeds
    divergence_rows(y, yt, 10, clients=900, seeds=(0, 1), grids={"dirichlet": ("alpha", (0.3,))}, skipped=skipped)
    silhouette_rows(y, yt, 10, clients=(900,), seeds=(1,), settings=(("dirichlet", "alpha", 0.3),), skipped=skipped)
    lines = [ln for ln in markdown(div, [row], "digits", skipped).splitlines() if ln.startswith("* ")]
    assert len(skipped) == 4 and len(lines) == 1 and lines[0].startswith("* Dirichlet alpha=0.3, K = 900, seeds 0, 1:")
    assert all(p.stat().st_size > 1000 for p in plot(div, [row], tmp_path))


@pytest.mark.skipif(not (Path("/usr/share/datasets/fashion-mnist") / "train-images-idx3-ubyte.gz").is_file(),
                    reason="needs the Debian Fashion-MNIST files")
def test_the_committed_runs_partition_has_no_constant_feature_column():
    """docs/clust_psi_pfl.md ("zero-variance feature columns") and results/README.md: the constant-column
    fix cannot change the committed S = 0.03 run, whose PSI features have no constant column (smallest
    column deviation 0.51)."""
    from fedprism.data.datasets import load_dataset
    from fedprism.data.partition import label_histograms, make_partition

    ds = load_dataset("fmnist")
    y = ds.y_train.numpy()
    part = make_partition("similarity", y, ds.y_test.numpy(), 100, 0, s=0.03)
    x = psi_features(label_histograms(part.train, y, 10))
    assert (x.max(0) > x.min(0)).all() and round(float(x.std(0).min()), 2) == 0.51
