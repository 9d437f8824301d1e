"""Choosing the number of clusters.

- :func:`choose_k_silhouette` — Clust-PSI-PFL: K-Means for every
  tau in 2..n-1, keep the largest silhouette; strict ``>`` so the smallest tau wins ties.
- :func:`choose_k_davies_bouldin` — FedSub: K-Means for every K
  in 2..n-1, keep the lowest Davies-Bouldin index (smallest K on ties). Its K-Means is
  :func:`fedprism.clustering.kmeans.kmeans_every_k` (all restarts at once, one seeding for all K; FedSub
  runs it for every class every
  round), silhouette's is sklearn's.

Both score in Euclidean distance on the given features, so only the Euclidean methods
(kmeans, ward, average, single) are accepted. A candidate k for which clustering is impossible
(fewer distinct points than k) or that yields fewer than k non-empty clusters is skipped (its score
is not recorded).
"""

from __future__ import annotations

import numpy as np

from fedprism.clustering.hard import TooFewPoints, as_features, euclidean_embedding, euclidean_labels
from fedprism.errors import ConfigError

EUCLIDEAN_METHODS = ("kmeans", "ward", "average", "single")


def _candidates(features: np.ndarray, k_range, method: str, seed: int, labeller=None):
    """Yield (k, labels, embedding) for every feasible k in ``k_range`` (default 2..n-1).

    Clustering and scoring both run on :func:`euclidean_embedding` (same distances, n columns).
    ``labeller(embedding, k)`` replaces :func:`euclidean_labels` when given.
    """
    if method not in EUCLIDEAN_METHODS:
        raise ConfigError("clustering.method", method, f"one of {EUCLIDEAN_METHODS} for choosing K")
    n = features.shape[0]
    ks = range(2, n) if k_range is None else k_range
    n_distinct = int(np.unique(features, axis=0).shape[0])
    emb = euclidean_embedding(features)
    for k in ks:
        k = int(k)
        if not 2 <= k <= n - 1 or k > n_distinct:  # scores are undefined for k = 1 and k = n
            continue
        labels = (labeller(emb, k) if labeller is not None
                  else euclidean_labels(emb, k, method, seed, n_features=features.shape[1]))
        if len(np.unique(labels)) == k:
            yield k, labels, emb


def choose_k_silhouette(
    features,
    k_range=None,
    method: str = "kmeans",
    seed: int = 0,
    allow_single_cluster: bool = False,
) -> tuple[int, dict[int, float]]:
    """Number of clusters with the largest silhouette (Clust-PSI-PFL).

    Args:
        features: [n, d] (Clust-PSI-PFL: z-scored PSI features; standardising is the caller's job).
        k_range: candidate k (default ``range(2, n)``, i.e. tau in 2..n-1 as in the paper).
            Values outside 2..n-1 are ignored.
        method: ``"kmeans"`` (the paper) or another Euclidean method of :func:`hard_cluster`.
        seed: K-Means ``random_state``.
        allow_single_cluster: the authors' code fallback: k = 1 takes part with score 0, so one
            cluster is returned unless some silhouette is strictly positive.

    Returns:
        ``(k, scores)`` with ``scores[k]`` the silhouette of every feasible candidate.

    Raises:
        TooFewPoints: no feasible candidate and ``allow_single_cluster`` is False.
    """
    from sklearn.metrics import silhouette_score

    x = as_features(features)
    scores: dict[int, float] = {}
    best_k, best = (1, 0.0) if allow_single_cluster else (None, -np.inf)
    for k, labels, emb in _candidates(x, k_range, method, seed):
        scores[k] = float(silhouette_score(emb, labels, metric="euclidean"))
        if scores[k] > best:
            best_k, best = k, scores[k]
    if best_k is None:
        n = x.shape[0]
        raise TooFewPoints(
            n, int(np.unique(x, axis=0).shape[0]), 2, method,
            reason=f"no k in the candidates gives a silhouette (needs 2 <= k <= n-1 = {n - 1} "
            "and k distinct points)",
        )
    return best_k, scores


def choose_k_davies_bouldin(
    features,
    k_range=None,
    method: str = "kmeans",
    seed: int = 0,
    return_labels: bool = False,
):
    """Number of clusters with the lowest Davies-Bouldin index (FedSub).

    Candidates are K in 2..n-1 (sklearn refuses K = n pitfall). When no
    candidate is feasible (``n <= 2`` or all points identical) the answer is one cluster:
    ``(1, {})``, as recommended for FedSub. ``method="kmeans"`` uses
    :func:`fedprism.clustering.kmeans.kmeans_every_k` (10 restarts seeded by ``seed``, one k-means++
    sequence per restart for all K); the linkage methods use sklearn.

    Returns:
        ``(k, scores)`` with ``scores[k]`` the Davies-Bouldin index of every feasible candidate, and
        with ``return_labels`` the chosen clustering's labels [n] (0..k-1, all zeros for one cluster)
        as a third item.
    """
    from fedprism.clustering.kmeans import davies_bouldin, kmeans_every_k

    x = as_features(features)
    labeller = None
    if method == "kmeans":
        n = x.shape[0]
        emb = euclidean_embedding(x)
        fits = kmeans_every_k(emb, [k for k in (range(2, n) if k_range is None else k_range) if 2 <= k <= n - 1],
                              n_init=10, seed=seed)
        labeller = lambda _emb, k: fits[k][0]  # noqa: E731
    scores: dict[int, float] = {}
    best_k, best, best_labels = 1, np.inf, np.zeros(x.shape[0], dtype=np.int64)
    for k, labels, emb in _candidates(x, k_range, method, seed, labeller):
        scores[k] = davies_bouldin(emb, labels)
        if scores[k] < best:
            best_k, best = k, scores[k]
            best_labels = np.unique(labels, return_inverse=True)[1].astype(np.int64)
    return (best_k, scores, best_labels) if return_labels else (best_k, scores)
