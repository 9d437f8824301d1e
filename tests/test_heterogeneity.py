"""Label-skew metrics: PSI / WPSI (Clust-PSI-PFL Eq. 1-3) and Hellinger / JS / EMD (FedArtML's definitions)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.spatial.distance import jensenshannon
from scipy.stats import wasserstein_distance

from fedprism.data import heterogeneity as H
from fedprism.data.partition import make_partition

RNG = np.random.default_rng(12345)


def _random_pmfs(k: int, c: int, rng=RNG, zeros: bool = True) -> np.ndarray:
    p = rng.dirichlet(np.full(c, 0.7), size=k)
    if zeros:
        p[rng.random(p.shape) < 0.2] = 0.0
        p[:, 0] += 1e-3
    return p / p.sum(axis=1, keepdims=True)


# ----------------------------------------------------------------------------------------------------
# PSI
# ----------------------------------------------------------------------------------------------------


def test_psi_hand_values_and_eps_dependence():
    val, terms = H.psi([[0.25, 0.75]], [0.5, 0.5])
    assert val[0] == pytest.approx(0.274653, abs=1e-5)
    assert terms.sum() == pytest.approx(val[0])
    assert H.psi([[0, 1]], [0.5, 0.5])[0][0] == pytest.approx(6.9078, abs=1e-4)
    assert H.psi([[0, 1]], [0.5, 0.5], eps=1e-4)[0][0] == pytest.approx(4.6052, abs=1e-4)


def test_psi_is_symmetric_jeffreys_and_terms_nonnegative():
    p = _random_pmfs(6, 5, zeros=False)
    for i in range(5):
        a, b = p[i], p[i + 1]
        ab = H.psi([a], b)[0][0]
        ba = H.psi([b], a)[0][0]
        assert ab == pytest.approx(ba, rel=1e-9)
        ae, be = a + 1e-6, b + 1e-6          # Jeffreys: sum a ln(a/b) + sum b ln(b/a) on shifted pmfs
        assert ab == pytest.approx(np.sum(ae * np.log(ae / be)) + np.sum(be * np.log(be / ae)), rel=1e-9)
    _, terms = H.psi(p * 100)
    assert np.all(terms >= 0)


def test_psi_counts_vs_pmfs_and_absent_classes_excluded():
    hist = np.array([[10, 0, 30], [20, 20, 0], [5, 5, 5]])
    psi_counts, t = H.psi(hist)
    glob = hist.sum(0)
    psi_pmf, _ = H.psi(hist / hist.sum(1, keepdims=True), glob)
    assert np.allclose(psi_counts, psi_pmf)
    assert np.allclose(t.sum(1), psi_counts)
    padded = np.concatenate([hist, np.zeros((3, 2), dtype=int)], axis=1)
    psi_pad, t_pad = H.psi(padded)
    assert np.allclose(psi_pad, psi_counts)
    assert t_pad.shape == (3, 5) and np.all(t_pad[:, 3:] == 0)


def test_psi_laplace_smoothing_is_finite_and_close_to_exact_for_large_counts():
    hist = np.array([[0, 50, 50], [40, 30, 30]])
    lap, _ = H.psi(hist, smoothing="laplace", eps=0.5)
    assert np.all(np.isfinite(lap)) and np.all(lap > 0)
    big = np.array([[2000, 5000, 3000], [4000, 3000, 3000]])
    exact, _ = H.psi(big, eps=0.0)
    assert np.allclose(H.psi(big, smoothing="laplace", eps=1.0)[0], exact, rtol=1e-3)
    # by hand: counts (2, 0) and (0, 2), pseudo-count 1 -> client pmfs (3/4, 1/4) and (1/4, 3/4), global
    # (1/2, 1/2); PSI = (1/2 - 3/4) ln(2/3) + (1/2 - 1/4) ln 2 = (1/4) ln 3 for each client
    lap2, _ = H.psi(np.array([[2, 0], [0, 2]]), smoothing="laplace", eps=1.0)
    assert lap2.tolist() == pytest.approx([0.25 * np.log(3)] * 2, abs=1e-12)
    with pytest.raises(ValueError, match="smoothing"):
        H.psi(hist, smoothing="other")
    with pytest.raises(ValueError, match="eps"):
        H.psi(hist, smoothing="laplace", eps=0.0)
    with pytest.raises(ValueError, match="eps"):
        H.psi(hist, eps=-1.0)


def test_psi_empty_client_is_nan_and_ignored_by_wpsi():
    hist = np.array([[10, 10], [0, 0], [5, 15]])
    per, _ = H.psi(hist)
    assert np.isnan(per[1]) and np.isfinite(per[[0, 2]]).all()
    assert H.wpsi(hist) == pytest.approx(H.wpsi(hist[[0, 2]]) * 60 / 60)


def test_wpsi_is_sample_weighted_mean_and_zero_for_identical_clients():
    hist = np.array([[10, 30, 60], [50, 25, 25], [1, 1, 8]])
    per, _ = H.psi(hist)
    n = hist.sum(1)
    assert H.wpsi(hist) == pytest.approx(float((n * per).sum() / n.sum()))
    same = np.tile([[3, 5, 2]], (7, 1)) * np.arange(1, 8)[:, None]
    assert H.wpsi(same) == pytest.approx(0.0, abs=1e-12)


def test_wpsi_near_zero_for_large_alpha():
    y = np.random.default_rng(0).integers(0, 10, 40000)
    yt = np.random.default_rng(1).integers(0, 10, 4000)
    part = make_partition("dirichlet", y, yt, 20, seed=0, alpha=1000.0)
    assert H.wpsi(part.hist(y, 10)) < 0.02


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_wpsi_strictly_increases_as_alpha_falls(seed):
    from sklearn.datasets import load_digits

    y = load_digits().target
    perm = np.random.default_rng(seed).permutation(len(y))
    y_tr, y_te = y[perm[:1400]], y[perm[1400:]]
    values = []
    for alpha in (1000.0, 10.0, 1.0, 0.3, 0.1):
        part = make_partition("dirichlet", y_tr, y_te, 30, seed=seed, alpha=alpha, min_train=10)
        values.append(H.wpsi(part.hist(y_tr, 10)))
    assert values[0] < 0.2
    assert all(a < b for a, b in zip(values, values[1:])), values


def test_wpsi_decreases_with_similarity_s():
    y = np.random.default_rng(0).integers(0, 10, 20000)
    values = [H.wpsi(make_partition("similarity", y, y[:2000], 50, seed=0, s=s).hist(y, 10))
              for s in (0.0, 0.3, 0.7, 1.0)]
    assert all(a > b for a, b in zip(values, values[1:])), values


# ----------------------------------------------------------------------------------------------------
# Pair distances
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("c", [2, 3, 10, 25])
def test_pair_functions_agree_with_scipy(c):
    rng = np.random.default_rng(c)
    for _ in range(20):
        p, q = _random_pmfs(2, c, rng)
        assert H.js_pair(p, q) == pytest.approx(jensenshannon(p, q, base=2), abs=1e-9)
        pos = np.arange(c)
        assert H.emd_pair(p, q) == pytest.approx(
            wasserstein_distance(pos, pos, u_weights=p, v_weights=q), abs=1e-9)
        bc = np.sum(np.sqrt(p * q))
        assert H.hellinger_pair(p, q) == pytest.approx(math.sqrt(max(1 - bc, 0.0)), abs=1e-9)
        assert H.tv_pair(p, q) == pytest.approx(0.5 * np.abs(p - q).sum(), abs=1e-12)
        # unnormalised weights are normalised first
        assert H.js_pair(3 * p, q) == pytest.approx(H.js_pair(p, q))


def test_pair_functions_identical_and_disjoint():
    p = np.array([0.2, 0.3, 0.5])
    for f in (H.hellinger_pair, H.js_pair, H.tv_pair, H.emd_pair):
        assert f(p, p) == pytest.approx(0.0, abs=1e-12)
    a, b = [1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]
    assert H.hellinger_pair(a, b) == pytest.approx(1.0)
    assert H.js_pair(a, b) == pytest.approx(1.0)
    assert H.tv_pair(a, b) == pytest.approx(1.0)
    assert H.emd_pair(a, b) == pytest.approx(1.0)
    assert H.emd_pair(a, [0, 0, 0, 1.0]) == pytest.approx(3.0)  # ordinal ground metric
    with pytest.raises(ValueError):
        H.hellinger_pair([0, 0], [1, 0])


# ----------------------------------------------------------------------------------------------------
# Federation-level distances
# ----------------------------------------------------------------------------------------------------


def _fedartml_reference(p: np.ndarray) -> tuple[float, float, float]:
    """Straight transcription of FedArtML's three formulas with scipy, for comparison."""
    n = len(p)
    sq = np.sqrt(p)
    h = np.sum((sq[:, None, :] - sq[None, :, :]) ** 2, axis=2)
    hd = min(float(np.sqrt(h.sum() / (2 * n * (n - 1)))), 1.0)

    def ent(v):
        return -sum(x * math.log2(x) for x in v if x != 0)

    js = ent(p.mean(0)) - np.mean([ent(r) for r in p])
    if n > 2:
        js /= math.log2(n)
    js = min(math.sqrt(max(js, 0.0)), 1.0)
    d = [wasserstein_distance(p[i], p[j]) for i in range(n) for j in range(i + 1, n)]
    emd = min(math.sqrt(float(np.mean(d))), 1.0)
    return hd, js, emd


@pytest.mark.parametrize("n, c", [(2, 3), (5, 10), (12, 4), (40, 10)])
def test_fedartml_compat_matches_reference_formulas(n, c):
    p = _random_pmfs(n, c, np.random.default_rng(n * c))
    hist = p * np.random.default_rng(1).integers(10, 100, size=(n, 1))
    hd, js, emd = _fedartml_reference(p)
    assert H.hellinger(hist, fedartml_compat=True) == pytest.approx(hd, abs=1e-9)
    assert H.jensen_shannon(hist, fedartml_compat=True) == pytest.approx(js, abs=1e-9)
    assert H.emd(hist, fedartml_compat=True) == pytest.approx(emd, abs=1e-9)


def test_identical_clients_give_zero_everywhere():
    hist = np.tile([[4, 1, 3, 2]], (6, 1)) * np.arange(1, 7)[:, None]
    for compat in (False, True):
        assert H.hellinger(hist, fedartml_compat=compat) == pytest.approx(0.0, abs=1e-7)
        assert H.jensen_shannon(hist, fedartml_compat=compat) == pytest.approx(0.0, abs=1e-7)
        assert H.emd(hist, fedartml_compat=compat) == pytest.approx(0.0, abs=1e-7)
    assert H.hellinger(hist, reference="global") == pytest.approx(0.0, abs=1e-7)
    assert H.emd(hist, reference="pairwise") == pytest.approx(0.0, abs=1e-12)
    assert H.wpsi(hist) == pytest.approx(0.0, abs=1e-12)


def test_disjoint_single_class_clients():
    hist = np.array([[7, 0, 0, 0], [0, 3, 0, 0]])
    assert H.hellinger(hist) == pytest.approx(1.0)
    assert H.jensen_shannon(hist) == pytest.approx(1.0)
    assert H.emd(hist, reference="pairwise") == pytest.approx(1.0)           # TV-EMD between the clients
    assert H.emd(hist) == pytest.approx(0.5)                                 # TV to the pooled pmf [.7, .3]
    assert H.emd(hist, fedartml_compat=True) == pytest.approx(0.0)           # FedArtML quirk
    # N > C: maximal separation reaches 1 by default, but not with FedArtML's log2(N) normaliser
    many = np.repeat(np.eye(4, dtype=int) * 10, 3, axis=0)                    # 12 clients, 4 classes
    assert H.jensen_shannon(many) == pytest.approx(1.0)
    assert H.jensen_shannon(many, fedartml_compat=True) < 0.8


def test_two_client_js_equals_pair():
    p = _random_pmfs(2, 6)
    assert H.jensen_shannon(p) == pytest.approx(H.js_pair(p[0], p[1]))
    assert H.hellinger(p) == pytest.approx(H.hellinger_pair(p[0], p[1]))
    assert H.emd(p, reference="pairwise") == pytest.approx(H.tv_pair(p[0], p[1]))


def test_hellinger_and_emd_global_reference():
    hist = np.array([[8, 2, 0], [1, 1, 8], [3, 3, 4]])
    g = hist.sum(0)
    expect_h = np.mean([H.hellinger_pair(r, g) for r in hist])
    expect_tv = np.mean([H.tv_pair(r, g) for r in hist])
    assert H.hellinger(hist, reference="global") == pytest.approx(expect_h)
    assert H.emd(hist) == pytest.approx(expect_tv)
    pairs = [(i, j) for i in range(3) for j in range(i + 1, 3)]
    assert H.hellinger(hist) == pytest.approx(
        math.sqrt(np.mean([H.hellinger_pair(hist[i], hist[j]) ** 2 for i, j in pairs])))
    with pytest.raises(ValueError, match="reference"):
        H.emd(hist, reference="median")


def test_permutation_invariance():
    rng = np.random.default_rng(7)
    hist = (_random_pmfs(15, 8, rng) * 200).round()
    hist[:, 1] += 1
    clients = rng.permutation(15)
    classes = rng.permutation(8)
    fns = {
        "hellinger": H.hellinger,
        "hellinger_g": lambda h: H.hellinger(h, reference="global"),
        "js": H.jensen_shannon,
        "emd": H.emd,
        "emd_pw": lambda h: H.emd(h, reference="pairwise"),
        "wpsi": H.wpsi,
        "hellinger_fa": lambda h: H.hellinger(h, fedartml_compat=True),
        "js_fa": lambda h: H.jensen_shannon(h, fedartml_compat=True),
        "emd_fa": lambda h: H.emd(h, fedartml_compat=True),
    }
    for name, f in fns.items():
        base = f(hist)
        assert f(hist[clients]) == pytest.approx(base, rel=1e-9, abs=1e-12), name
        assert f(hist[:, classes]) == pytest.approx(base, rel=1e-9, abs=1e-12), name
    psi, terms = H.psi(hist)
    psi_p, terms_p = H.psi(hist[clients][:, classes])
    assert np.allclose(psi_p, psi[clients])
    assert np.allclose(terms_p, terms[clients][:, classes])


def test_single_client_and_validation():
    one = np.array([[3, 4, 5]])
    assert H.hellinger(one) == 0.0 and H.jensen_shannon(one) == 0.0
    assert H.emd(one) == 0.0 and H.emd(one, fedartml_compat=True) == 0.0
    for bad in ([[1, -1]], [1, 2, 3], [[np.nan, 1]], np.zeros((0, 3))):
        with pytest.raises(ValueError):
            H.hellinger(bad)


def test_report_contains_every_metric_and_eps():
    y = np.random.default_rng(3).integers(0, 10, 5000)
    part = make_partition("dirichlet", y, y[:1000], 25, seed=0, alpha=0.3)
    hist = part.hist(y, 10)
    rep = H.report(hist)
    for key in ("wpsi", "psi_mean", "psi_max", "psi_eps", "psi_smoothing", "hellinger", "jensen_shannon",
                "emd", "hellinger_fedartml", "jensen_shannon_fedartml", "emd_fedartml", "num_clients",
                "num_classes"):
        assert key in rep, key
    assert rep["psi_eps"] == 1e-6 and rep["psi_smoothing"] == "additive"
    assert rep["wpsi"] == pytest.approx(H.wpsi(hist))
    assert 0 < rep["hellinger"] <= 1 and 0 < rep["jensen_shannon"] <= 1 and 0 < rep["emd"] <= 1
    full = H.heterogeneity_report(hist, eps=1e-4)
    assert full.psi.shape == (25,) and full.psi_terms.shape == (25, 10) and full.psi_eps == 1e-4
    d = full.as_dict(per_client=True)
    assert len(d["psi"]) == 25 and len(d["psi_terms"][0]) == 10
