"""Weighted binning for scikit-learn's histogram gradient boosting, sorted once per feature.

Since scikit-learn 1.7, `HistGradientBoostingClassifier.fit(X, y, sample_weight=w)` on fewer than 200,000
rows bins every feature at weighted quantiles: `_find_binning_thresholds` calls
`sklearn.utils.stats._weighted_percentile` once per threshold (254 per feature), and every call sorts
the column, gathers the weights and sums them again. On the learned gate's rows (`fedprism.algorithms.fedprism_dual.gate`:
about 144,000 rows of 63 features per out-of-fold fit) that was 68 % of a fit (scikit-learn 1.9.1). It is a
known upstream problem (scikit-learn issue #34304, fixed by pull request #34248 for a later release).

`sorted_once()` is a context manager that, while it is open, hands `_find_binning_thresholds` a
`_weighted_percentile` that keeps the sort order and the cumulative weights of the column it was last
called on and answers each threshold with one binary search. For the calls it answers it performs
scikit-learn's own arithmetic in the same order on the same sorted arrays (the same unstable argsort of the
column as a one-column matrix, the same cumulative sum, the same rank `p / 100 * total`, the same search,
the same averaging rule), so the thresholds, the trees and every prediction are the same bits
(`tests/test_fast_binning.py` holds it to the original on ties, exact rank boundaries and whole fits;
`bench/README.md, "gate_cost"` measures it). Any other call (NaN in the column, a zero weight, a two-dimensional
array, an array of ranks, another array namespace) goes to scikit-learn's function. Where the private
names it replaces do not exist (another scikit-learn), it does nothing.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import numpy as np


class _SortedOnce:
    """`_weighted_percentile(array, sample_weight, percentile_rank, average, xp)` with the sort and the
    cumulative weights of the last column kept (per thread: scikit-learn bins features on a thread pool)."""

    def __init__(self, original):
        self.original = original
        self.local = threading.local()

    def _cached(self, array: np.ndarray, weight: np.ndarray):
        """(order, cumulative weights) of the column, or None where it has NaN or a weight that is not
        positive; computed once per column."""
        c = getattr(self.local, "c", None)
        if c is None or c[0] is not array or c[1] is not weight:
            usable = not np.isnan(array).any() and bool((weight > 0).all())
            order = np.argsort(array.reshape(-1, 1), axis=0)[:, 0] if usable else None  # as scikit-learn does
            c = self.local.c = (array, weight, order, np.cumsum(weight[order]) if usable else None)
        return None if c[2] is None else (c[2], c[3])

    def __call__(self, array, sample_weight, percentile_rank=50, average=False, xp=None):
        cached = None
        if (xp is None and type(array) is np.ndarray and type(sample_weight) is np.ndarray and array.ndim == 1
                and sample_weight.shape == array.shape and array.dtype == np.float64
                and sample_weight.dtype == np.float64 and np.ndim(percentile_rank) == 0 and array.size):
            cached = self._cached(array, sample_weight)
        if cached is None:
            return self.original(array, sample_weight, percentile_rank, average=average, xp=xp)
        order, cdf = cached
        rank = np.float64(percentile_rank) / 100 * cdf[-1:]
        if rank[0] == 0:
            rank = np.nextafter(rank, rank + 1)
        last = order.shape[0] - 1
        i = min(max(int(np.searchsorted(cdf, rank[0])), 0), last)
        value = array[order[i]]
        if not average or cdf[i] - rank[0] > np.finfo(np.float64).eps:
            return np.asarray(value)
        return np.asarray((value + array[order[min(i + 1, last)]]) / 2)


@contextmanager
def sorted_once():
    """While open, histogram gradient boosting bins weighted features with `_SortedOnce` (module
    docstring); restored on exit, also after an error."""
    try:
        from sklearn.ensemble._hist_gradient_boosting import binning
    except ImportError:
        binning = None
    original = getattr(binning, "_weighted_percentile", None)
    if original is None or isinstance(original, _SortedOnce):
        yield
        return
    binning._weighted_percentile = _SortedOnce(original)
    try:
        yield
    finally:
        binning._weighted_percentile = original
