"""`fedprism.algorithms.fedprism_dual.fast_binning`: scikit-learn's weighted binning, the same bits, sorted once."""

from __future__ import annotations

import numpy as np
import pytest

from fedprism.algorithms.fedprism_dual.fast_binning import _SortedOnce, sorted_once

binning = pytest.importorskip("sklearn.ensemble._hist_gradient_boosting.binning")
if not hasattr(binning, "_weighted_percentile"):
    pytest.skip("this scikit-learn bins without weights: nothing to replace", allow_module_level=True)
ORIGINAL = binning._weighted_percentile
RANKS = np.linspace(0, 100, num=256)[1:-1]            # the ranks `_find_binning_thresholds` asks for


def columns(rng):
    """Sorted columns as `_find_binning_thresholds` passes them, with ties and exact rank boundaries."""
    for n in (1, 2, 3, 7, 255, 1000):
        for kind in ("ties", "distinct"):
            x = np.sort(rng.integers(0, max(2, n // 4), n).astype(np.float64) if kind == "ties"
                        else rng.standard_normal(n))
            for w in (np.ones(n), rng.choice([0.5, 2.0], n), rng.integers(1, 4, n).astype(np.float64),
                      rng.random(n) + 1e-3):
                yield x, w


@pytest.mark.parametrize("average", [True, False])
def test_every_threshold_is_scikit_learns(average):
    fast = _SortedOnce(ORIGINAL)
    rng = np.random.default_rng(0)
    boundaries = 0
    for x, w in columns(rng):
        cdf = np.cumsum(w[np.argsort(x.reshape(-1, 1), axis=0)[:, 0]])
        boundaries += int(np.isin(RANKS / 100 * cdf[-1], cdf).sum())
        for p in RANKS:
            mine, theirs = fast(x, w, p, average=average), ORIGINAL(x, w, p, average=average)
            assert np.asarray(mine).shape == np.asarray(theirs).shape == ()
            assert np.asarray(mine).tobytes() == np.asarray(theirs).tobytes(), (len(x), p, average)
    assert boundaries > 100          # ranks that land exactly on a cumulative weight (the averaging rule) ran


def test_other_calls_go_to_scikit_learn():
    calls = []

    def spy(*a, **kw):
        calls.append(a)
        return ORIGINAL(*a, **kw)

    fast, x, w = _SortedOnce(spy), np.arange(5.0), np.ones(5)
    for args in [(np.array([1.0, np.nan]), np.ones(2), 50.0), (x, np.array([1, 0, 1, 1, 1.0]), 50.0),
                 (x.reshape(-1, 1), w, 50.0), (x, w, np.array([10.0, 50.0])), (x.astype(np.float32), w, 50.0),
                 (x, w.astype(np.float32), 50.0)]:
        fast(*args)
    assert len(calls) == 6
    fast(x, w, 50.0)
    assert len(calls) == 6


def test_whole_fits_are_the_same_bits_and_the_original_comes_back():
    from sklearn.ensemble import HistGradientBoostingClassifier

    rng = np.random.default_rng(1)
    X = np.c_[rng.standard_normal((3000, 3)), rng.integers(0, 300, (3000, 2)), rng.integers(0, 9, 3000)]
    y = (X[:, 0] + 0.01 * X[:, 3] + rng.standard_normal(3000) > 1).astype(int)
    w = np.where(rng.random(3000) < 0.3, 5.0, 1.0)
    plain = HistGradientBoostingClassifier(max_iter=20, random_state=0).fit(X, y, sample_weight=w)
    with sorted_once():
        assert isinstance(binning._weighted_percentile, _SortedOnce)
        with sorted_once():                                   # nested: one replacement
            assert binning._weighted_percentile.original is ORIGINAL
            fast = HistGradientBoostingClassifier(max_iter=20, random_state=0).fit(X, y, sample_weight=w)
        assert isinstance(binning._weighted_percentile, _SortedOnce)
    assert binning._weighted_percentile is ORIGINAL
    for a, b in zip(plain._bin_mapper.bin_thresholds_, fast._bin_mapper.bin_thresholds_):
        assert a.tobytes() == b.tobytes()
    assert plain.predict_proba(X).tobytes() == fast.predict_proba(X).tobytes()
    with pytest.raises(RuntimeError), sorted_once():
        raise RuntimeError("a failing fit")
    assert binning._weighted_percentile is ORIGINAL
