"""Tests for fedprism.clustering (the Fed-PRISM technical report, section 3)."""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import pytest
import scipy.special
from scipy.spatial.distance import pdist
from sklearn.metrics import adjusted_rand_score

from fedprism.clustering import (
    METHODS,
    TooFewPoints,
    centroid_cost,
    choose_k_davies_bouldin,
    choose_k_silhouette,
    cosine_matrix,
    covariance_affinity,
    euclidean_embedding,
    hard_cluster,
    match_clusters,
    max_cross_similarity,
    optimal_bipartition,
    overlap_cost,
    pairwise_cosine,
    relabel,
    reorder,
    soft_assign,
)
from fedprism.errors import ConfigError

D = 5000


def planted_models(k: int, per_group: int = 6, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Theta-like features: k well-separated centres plus small noise, groups interleaved."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(k, D)) * 1.0
    truth = np.tile(np.arange(k), per_group)
    x = centres[truth] + 0.05 * rng.normal(size=(len(truth), D))
    return x, truth


def planted_updates(k: int, per_group: int = 6, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Delta-like features: each group moves along its own direction (orthogonal for k >= 3,
    anti-correlated for k = 2), with random scales and noise."""
    rng = np.random.default_rng(seed)
    if k == 2:
        u = rng.normal(size=D)
        dirs = np.stack([u, -u])
    else:
        dirs = np.linalg.qr(rng.normal(size=(D, k)))[0].T * np.sqrt(D)
    truth = np.tile(np.arange(k), per_group)
    scale = rng.uniform(0.5, 2.0, size=(len(truth), 1))
    x = scale * (dirs[truth] + 0.3 * rng.normal(size=(len(truth), D)))
    return x, truth


# ----------------------------------------------------------------------------- hard clustering


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("method", METHODS)
def test_planted_groups_recovered(method, k):
    x, truth = planted_updates(k) if method == "covariance" else planted_models(k)
    result = hard_cluster(x, k, method, seed=0)
    assert adjusted_rand_score(truth, result.labels) == 1.0
    assert result.labels.dtype.kind == "i" and set(result.labels.tolist()) == set(range(k))
    assert result.centroids.shape == (k, D)
    for c in range(k):
        np.testing.assert_allclose(result.centroids[c], x[result.labels == c].mean(axis=0))
    assert result.info["method"] == method and result.info["k_found"] == k
    if method == "covariance":
        assert result.affinity.shape == (len(truth), len(truth))
        assert result.info["affinity"] == "shifted"
    else:
        assert result.affinity is None


@pytest.mark.parametrize("method", ["kmeans", "ward", "average", "single"])
def test_embedding_gives_same_partition_as_raw_sklearn(method):
    # overlapping groups, so the partition is not trivial; n x d embedding vs sklearn on n x d
    from sklearn.cluster import AgglomerativeClustering, KMeans

    rng = np.random.default_rng(7)
    x = 10.0 + rng.normal(size=(4, D))[rng.integers(0, 4, 40)] + 1.5 * rng.normal(size=(40, D))
    if method == "kmeans":
        raw = KMeans(n_clusters=4, n_init=10, random_state=3).fit_predict(x)
    else:
        raw = AgglomerativeClustering(n_clusters=4, linkage=method).fit_predict(x)
    assert adjusted_rand_score(raw, hard_cluster(x, 4, method, seed=3).labels) == 1.0
    emb = euclidean_embedding(x)
    assert emb.shape == (40, 40)
    np.testing.assert_allclose(pdist(emb), pdist(x), rtol=1e-9)


def test_labels_contiguous_first_appearance_and_deterministic():
    x, _ = planted_models(3)
    a = hard_cluster(x, 3, "kmeans", seed=5)
    b = hard_cluster(x, 3, "kmeans", seed=5)
    np.testing.assert_array_equal(a.labels, b.labels)
    assert a.labels[0] == 0
    first = [int(np.flatnonzero(a.labels == c)[0]) for c in range(3)]
    assert first == sorted(first)


def test_covariance_clip_affinity_and_values():
    x, truth = planted_updates(2)
    result = hard_cluster(x, 2, "covariance", affinity="clip")
    assert adjusted_rand_score(truth, result.labels) == 1.0
    assert result.info["affinity"] == "clip"
    assert (result.affinity >= 0).all()
    # correlation of u and -u is -1: shifted affinity 0, clipped 0; of u and 2u: 1
    u = np.array([[1.0, 2.0, 3.0, 0.0], [-1.0, -2.0, -3.0, 0.0], [2.0, 4.0, 6.0, 0.0]])
    a = covariance_affinity(u, "shifted")
    np.testing.assert_allclose(a, [[1, 0, 1], [0, 1, 0], [1, 0, 1]], atol=1e-12)
    np.testing.assert_allclose(covariance_affinity(u, "clip"), a, atol=1e-12)
    # centring: a constant offset is removed, so correlation is shift-invariant
    np.testing.assert_allclose(covariance_affinity(u + 5.0), a, atol=1e-12)


def test_torch_input_accepted():
    torch = pytest.importorskip("torch")
    x, truth = planted_models(2)
    result = hard_cluster(torch.from_numpy(x).float(), 2, "ward")
    assert adjusted_rand_score(truth, result.labels) == 1.0
    assert result.centroids.dtype == np.float64


def test_k_equal_n_and_k_one():
    x, _ = planted_models(2, per_group=2)
    assert hard_cluster(x, 4, "covariance").labels.tolist() == [0, 1, 2, 3]
    one = hard_cluster(x, 1, "single")
    assert one.labels.tolist() == [0, 0, 0, 0]
    np.testing.assert_allclose(one.centroids[0], x.mean(axis=0))


@pytest.mark.parametrize("method", METHODS)
def test_too_few_points(method):
    x, _ = planted_models(2, per_group=1)  # 2 rows
    with pytest.raises(TooFewPoints, match="only 2 points"):
        hard_cluster(x, 3, method)
    dup = np.concatenate([x, x, x])  # 6 rows, 2 distinct
    with pytest.raises(TooFewPoints, match="2 distinct points among 6"):
        hard_cluster(dup, 3, method)
    assert issubclass(TooFewPoints, ValueError)


def test_covariance_scaled_duplicates_count_as_one():
    u = np.random.default_rng(0).normal(size=(2, 50))
    x = np.concatenate([u, 3.0 * u, 0.5 * u])  # 6 rows, 2 distinct directions
    with pytest.raises(TooFewPoints):
        hard_cluster(x, 3, "covariance")


def test_bad_input():
    x, _ = planted_models(2)
    x[1, 7] = np.nan
    with pytest.raises(ValueError, match="NaN or Inf"):
        hard_cluster(x, 2, "kmeans")
    x[1, 7] = np.inf
    with pytest.raises(ValueError):
        hard_cluster(x, 2, "covariance")
    with pytest.raises(ConfigError):
        hard_cluster(np.eye(4), 2, "dbscan")
    with pytest.raises(ConfigError):
        hard_cluster(np.eye(4), 2, "covariance", affinity="abs")
    with pytest.raises(ValueError):
        hard_cluster(np.eye(4), 0, "kmeans")
    with pytest.raises(ValueError, match="2-D"):
        hard_cluster(np.ones(4), 1, "kmeans")


# ----------------------------------------------------------------------------- soft assignment


def test_soft_assign_hand_example():
    # cosines 0.9 and 0.5 -> 0.5987, 0.4013
    # feature at angle arccos(0.9) from e1; centroid 2 at angle arccos(0.5) from the feature
    f = np.array([[0.9, np.sqrt(1 - 0.81)]])
    c2 = np.array([0.5 * 0.9 - np.sqrt(0.75) * np.sqrt(0.19), 0.5 * np.sqrt(0.19) + np.sqrt(0.75) * 0.9])
    np.testing.assert_allclose(cosine_matrix(f, np.stack([[1.0, 0.0], c2])), [[0.9, 0.5]], atol=1e-12)
    w = soft_assign(f, np.stack([[1.0, 0.0], c2]), m=2)
    np.testing.assert_allclose(w, [[0.598688, 0.401312]], atol=1e-6)
    w1 = soft_assign(f, np.stack([[1.0, 0.0], c2]), m=1)
    np.testing.assert_array_equal(w1, [[1.0, 0.0]])


def test_soft_assign_rows_and_sparsity():
    rng = np.random.default_rng(1)
    k, n = 5, 12
    features, centroids = rng.normal(size=(n, 300)), rng.normal(size=(k, 300))
    cos = cosine_matrix(features, centroids)
    for m in range(1, k + 1):
        w = soft_assign(features, centroids, m)
        assert w.shape == (n, k)
        np.testing.assert_allclose(w.sum(axis=1), 1.0, atol=1e-12)
        assert ((w > 0).sum(axis=1) == m).all()
        # the non-zeros are the m largest cosines
        for i in range(n):
            assert set(np.flatnonzero(w[i])) == set(np.argsort(-cos[i])[:m])
    dense = soft_assign(features, centroids, k)
    np.testing.assert_allclose(dense, scipy.special.softmax(cos, axis=1), atol=1e-12)
    for t in (0.1, 0.5, 3.0):
        np.testing.assert_allclose(
            soft_assign(features, centroids, k, temperature=t),
            scipy.special.softmax(cos / t, axis=1),
            atol=1e-12,
        )
    # lower temperature sharpens
    assert soft_assign(features, centroids, k, 0.1).max(axis=1).min() > dense.max(axis=1).min()
    # a small temperature stays finite: exp of Sim / T is taken after subtracting the row's largest entry
    # (cosines 0.9 and -0.9 at T = 1e-3 are 900 and -900; exp(1800) overflows float64)
    np.testing.assert_array_equal(soft_assign(np.array([[0.9, np.sqrt(0.19)]]),
                                              np.array([[1.0, 0.0], [-1.0, 0.0]]), 2, 1e-3), [[1.0, 0.0]])


def test_soft_assign_ties_and_zero_norm():
    centroids = np.array([[1.0, 0.0], [1.0, 0.0], [0.0, 0.0]])  # duplicate and zero centroid
    f = np.array([[1.0, 0.0], [0.0, 0.0]])
    np.testing.assert_allclose(cosine_matrix(f, centroids), [[1, 1, 0], [0, 0, 0]])
    w = soft_assign(f, centroids, m=1)
    np.testing.assert_array_equal(w, [[1, 0, 0], [1, 0, 0]])  # lowest index wins ties
    w = soft_assign(f, centroids, m=2)
    np.testing.assert_allclose(w, [[0.5, 0.5, 0], [0.5, 0.5, 0]])
    with pytest.raises(ValueError):
        soft_assign(f, centroids, m=4)
    with pytest.raises(ValueError):
        soft_assign(f, centroids, m=0)
    with pytest.raises(ValueError):
        soft_assign(f, centroids, m=1, temperature=0.0)


# ----------------------------------------------------------------------------- matching


def test_match_identity_when_unchanged():
    labels = np.array([0, 0, 1, 2, 2, 1])
    w_old = np.eye(3)[labels] * 0.8 + 0.2 / 3  # soft rows peaked on the old label
    perm = match_clusters(overlap_cost(labels, w_old))
    np.testing.assert_array_equal(perm, [0, 1, 2])


def test_match_invariant_to_label_permutation():
    rng = np.random.default_rng(3)
    n, k = 20, 4
    w_old = rng.dirichlet(np.ones(k) * 0.3, size=n)
    labels = rng.integers(0, k, size=n)
    labels[:k] = np.arange(k)
    final = relabel(labels, match_clusters(overlap_cost(labels, w_old)))
    for p in itertools.permutations(range(k)):
        permuted = np.asarray(p)[labels]
        final_p = relabel(permuted, match_clusters(overlap_cost(permuted, w_old)))
        np.testing.assert_array_equal(final_p, final)


def test_match_hand_made_3x3():
    # greedy row-by-row would give 0->0 (cost -10) then 1->2, 2->1 (total -10 - 1 - 1 = -12);
    # the optimum is 0->1, 1->0, 2->2 (total -9 - 8 - 7 = -24)
    cost = -np.array([[10.0, 9.0, 0.0], [8.0, 0.0, 1.0], [0.0, 1.0, 7.0]])
    np.testing.assert_array_equal(match_clusters(cost), [1, 0, 2])
    # overlap cost by hand
    labels = np.array([0, 0, 1, 2])
    w_old = np.array([[0.5, 0.5, 0], [0, 1, 0], [1, 0, 0], [0, 0.25, 0.75]])
    np.testing.assert_allclose(
        overlap_cost(labels, w_old), -np.array([[0.5, 1.5, 0], [1, 0, 0], [0, 0.25, 0.75]])
    )
    np.testing.assert_array_equal(match_clusters(overlap_cost(labels, w_old)), [1, 0, 2])


def test_match_rectangular_and_centroid_cost():
    # fewer new clusters than models: distinct models, one model left unmatched
    cost = -np.array([[0.1, 0.9, 0.0], [0.8, 0.0, 0.2]])
    np.testing.assert_array_equal(match_clusters(cost), [1, 0])
    # more new clusters than models: extra cluster gets a fresh index k_old
    cost = -np.array([[0.9, 0.0], [0.1, 0.2], [0.0, 0.8]])
    np.testing.assert_array_equal(match_clusters(cost), [0, 2, 1])
    # two extra clusters get two fresh indices, in increasing j (the result stays injective)
    cost = -np.array([[0.1, 0.0], [0.9, 0.0], [0.2, 0.1], [0.0, 0.7]])
    np.testing.assert_array_equal(match_clusters(cost), [2, 0, 3, 1])
    # centroid cost: new centroids are the models permuted and perturbed
    rng = np.random.default_rng(0)
    models = rng.normal(size=(4, 100))
    order = np.array([2, 0, 3, 1])
    new = models[order] + 0.01 * rng.normal(size=(4, 100))
    np.testing.assert_array_equal(match_clusters(centroid_cost(new, models)), order)
    # reorder puts centroid j at row perm[j]
    np.testing.assert_allclose(reorder(new, order)[order], new)
    assert reorder(new[:2], order[:2], n_models=4).shape == (4, 100)


# ----------------------------------------------------------------------------- choosing K


def test_choose_k_silhouette_and_davies_bouldin_planted():
    x, _ = planted_models(3, per_group=3)
    k, scores = choose_k_silhouette(x, seed=0)
    assert k == 3 and set(scores) == set(range(2, 9))
    assert choose_k_silhouette(x, method="ward")[0] == 3
    k, scores = choose_k_davies_bouldin(x, k_range=range(1, 7), seed=0)
    assert k == 3 and set(scores) == set(range(2, 7))


def test_choose_k_degenerate():
    x, _ = planted_models(2, per_group=1)
    with pytest.raises(TooFewPoints):
        choose_k_silhouette(x)  # n = 2: no k in 2..n-1
    assert choose_k_silhouette(x, allow_single_cluster=True) == (1, {})
    assert choose_k_davies_bouldin(x) == (1, {})
    # identical rows: every k > 1 is infeasible and skipped
    same = np.ones((5, 10))
    assert choose_k_silhouette(same, allow_single_cluster=True) == (1, {})
    # three distinct rows, each three times: k > 3 is skipped before K-Means runs (no convergence warning)
    trio = np.repeat(np.eye(3) * 5, 3, axis=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        k, scores = choose_k_silhouette(trio, seed=0)
    assert k == 3 and set(scores) == {2, 3}
    with pytest.raises(ConfigError):
        choose_k_silhouette(x, method="covariance")


def test_choose_k_silhouette_single_cluster_competes_with_score_zero(monkeypatch):
    # Every candidate negative (K-Means' optima rarely give that on real data, so the scores are set):
    # without the fallback the least negative wins; with it k = 1 wins at 0, and only a strictly
    # positive silhouette beats it.
    import sklearn.metrics

    x, _ = planted_models(2, per_group=3)                       # n = 6: candidates k = 2..5
    for scores, plain, single in (({2: -0.3, 3: -0.1, 4: -0.2, 5: -0.4}, 3, 1),
                                  ({2: -0.3, 3: 0.0, 4: -0.2, 5: -0.4}, 3, 1),
                                  ({2: -0.3, 3: -0.1, 4: 0.05, 5: -0.4}, 4, 4)):
        monkeypatch.setattr(sklearn.metrics, "silhouette_score",
                            lambda emb, labels, metric, s=scores: s[len(np.unique(labels))])
        assert choose_k_silhouette(x, seed=0) == (plain, scores)
        assert choose_k_silhouette(x, seed=0, allow_single_cluster=True) == (single, scores)


def test_silhouette_two_psi_groups():
    # two groups of five, jittered, tau = 2 and exactly those groups
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal([1, 0, 0], 0.05, (5, 3)), rng.normal([0, 1, 1], 0.05, (5, 3))])
    k, _ = choose_k_silhouette(x)
    assert k == 2
    assert adjusted_rand_score([0] * 5 + [1] * 5, hard_cluster(x, k, "kmeans").labels) == 1.0


# ----------------------------------------------------------------------------- CFL bipartition


def brute_force_min_max(s: np.ndarray) -> float:
    n = s.shape[0]
    best = np.inf
    for mask in range(1, 2 ** (n - 1)):  # index n-1 always in the second set: each split once
        a = [i for i in range(n) if mask >> i & 1]
        b = [i for i in range(n) if not mask >> i & 1]
        best = min(best, max_cross_similarity(s, a, b))
    return best


def test_bipartition_cfl_four_clients():
    rng = np.random.default_rng(0)
    u = rng.normal(size=1000)
    updates = np.stack([u, u, -u, -u]) + 1e-3 * rng.normal(size=(4, 1000))
    s = pairwise_cosine(updates)
    idx1, idx2 = optimal_bipartition(s)
    assert idx1.tolist() == [0, 1] and idx2.tolist() == [2, 3]
    alpha = max_cross_similarity(s, idx1, idx2)
    assert alpha == pytest.approx(-1.0, abs=1e-4)
    assert np.sqrt((1 - alpha) / 2) == pytest.approx(1.0, abs=1e-4)


def test_bipartition_planted_groups():
    x, truth = planted_updates(2, per_group=5)
    idx1, idx2 = optimal_bipartition(pairwise_cosine(x))
    labels = np.zeros(len(truth), dtype=int)
    labels[idx2] = 1
    assert adjusted_rand_score(truth, labels) == 1.0


@pytest.mark.parametrize("n", [2, 3, 5, 7, 9])
@pytest.mark.parametrize("seed", range(5))
def test_bipartition_matches_brute_force(n, seed):
    rng = np.random.default_rng(seed)
    s = pairwise_cosine(rng.normal(size=(n, 4)))
    idx1, idx2 = optimal_bipartition(s)
    assert len(idx1) and len(idx2) and 0 in idx1
    assert sorted(idx1.tolist() + idx2.tolist()) == list(range(n))
    assert max_cross_similarity(s, idx1, idx2) <= brute_force_min_max(s) + 1e-12


def test_bipartition_chain_differs_from_complete_linkage():
    # a chain 0-1-2-3-4 with strong neighbours: the min-max cut breaks the weakest link (2-3)
    s = np.full((5, 5), -0.5)
    for i, v in enumerate([0.9, 0.8, 0.1, 0.7]):
        s[i, i + 1] = s[i + 1, i] = v
    np.fill_diagonal(s, 1.0)
    idx1, idx2 = optimal_bipartition(s)
    assert idx1.tolist() == [0, 1, 2] and idx2.tolist() == [3, 4]


def test_bipartition_bad_input():
    with pytest.raises(ValueError):
        optimal_bipartition(np.ones((1, 1)))
    with pytest.raises(ValueError):
        optimal_bipartition(np.array([[1.0, 0.2], [0.3, 1.0]]))
    with pytest.raises(ValueError):
        optimal_bipartition(np.ones((2, 3)))


# ----------------------------------------------------------------------------- batched K-Means


def test_batched_kmeans_finds_planted_groups_and_sklearn_inertia():
    from sklearn.cluster import KMeans

    from fedprism.clustering.kmeans import kmeans

    x, groups = planted_models(4, per_group=5)
    labels, inertia = kmeans(x, 4, seed=3)
    # the same partition as the planted one (up to names): a bijection between labels and groups
    assert len({(a, b) for a, b in zip(labels, groups)}) == 4 == len(set(labels))
    # unstructured data: the best of 10 restarts is as good as sklearn's best of 10, on average over
    # 10 seeds to 2 % (single seeds land in different local optima)
    rng = np.random.default_rng(0)
    y = rng.normal(size=(30, 6))
    for k in (2, 5, 9):
        ours = np.mean([kmeans(y, k, seed=s)[1] for s in range(10)])
        ref = np.mean([KMeans(n_clusters=k, n_init=10, random_state=s).fit(y).inertia_ for s in range(10)])
        assert ours <= ref * 1.02, (k, ours, ref)
        # inertia is the labels' own within-cluster sum of squares
        lab, inertia = kmeans(y, k, seed=1)
        wss = sum(((y[lab == c] - y[lab == c].mean(0)) ** 2).sum() for c in np.unique(lab))
        assert wss == pytest.approx(inertia)
    assert kmeans(y, 1)[1] == pytest.approx(((y - y.mean(0)) ** 2).sum())
    with pytest.raises(ValueError):
        kmeans(y, 31)


def test_davies_bouldin_is_sklearns():
    from sklearn.metrics import davies_bouldin_score

    from fedprism.clustering.kmeans import davies_bouldin

    rng = np.random.default_rng(1)
    y = rng.normal(size=(25, 4))
    for k in (2, 3, 7):
        labels = rng.integers(k, size=25)
        assert davies_bouldin(y, labels) == pytest.approx(davies_bouldin_score(y, labels), rel=1e-12)
    # a hand value: two clusters on a line, points {0, 2} and {10, 12}: s = 1, 1; centroid gap 10
    line = np.array([[0.0], [2.0], [10.0], [12.0]])
    assert davies_bouldin(line, [0, 0, 1, 1]) == pytest.approx(0.2)
    # coincident centroids are skipped, as sklearn does
    pts = np.array([[0.0], [2.0], [1.0], [1.0], [5.0], [7.0]])
    assert davies_bouldin(pts, [0, 0, 1, 1, 2, 2]) == pytest.approx(davies_bouldin_score(pts, [0, 0, 1, 1, 2, 2]))


def test_choose_k_davies_bouldin_returns_the_chosen_labels():
    x, groups = planted_models(3, per_group=4)
    k, scores, labels = choose_k_davies_bouldin(x, seed=0, return_labels=True)
    assert k == 3 and sorted(set(labels)) == [0, 1, 2]
    assert len({(a, b) for a, b in zip(labels, groups)}) == 3
    assert choose_k_davies_bouldin(np.ones((4, 3)), return_labels=True)[2].tolist() == [0, 0, 0, 0]


def test_kmeans_every_k_is_kmeans_per_k_on_separated_data():
    from fedprism.clustering.kmeans import kmeans_every_k

    x, groups = planted_models(3, per_group=4)
    fits = kmeans_every_k(x, range(1, 6), seed=0)
    assert sorted(fits) == [1, 2, 3, 4, 5]
    assert len({(a, b) for a, b in zip(fits[3][0], groups)}) == 3 == len(set(fits[3][0]))
    # inertia falls with k and each is the labels' own within-cluster sum of squares
    inertias = [fits[k][1] for k in range(1, 6)]
    assert all(a >= b for a, b in zip(inertias, inertias[1:]))
    for k in range(1, 6):
        lab = fits[k][0]
        assert len(set(lab)) == k
        wss = sum(((x[lab == c] - x[lab == c].mean(0)) ** 2).sum() for c in np.unique(lab))
        assert wss == pytest.approx(fits[k][1])
    with pytest.raises(ValueError):
        kmeans_every_k(x, [2, 13])
