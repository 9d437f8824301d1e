"""Hard clustering of client feature vectors (the Fed-PRISM technical report section 3.1-3.2).

One entry point, :func:`hard_cluster`, for the five methods of Fed-PRISM's UpdateClusters:

===========  ==========================  =================================================
method       features                    technique
===========  ==========================  =================================================
kmeans       Theta_i (local models)      ``KMeans(n_init=10, random_state=seed)``, Euclidean
ward         Theta_i                     ``AgglomerativeClustering(linkage="ward")``
average      Theta_i                     ``AgglomerativeClustering(linkage="average")``
single       Theta_i                     ``AgglomerativeClustering(linkage="single")``
covariance   Delta_i (updates)           ``SpectralClustering(affinity="precomputed")`` on the
                                         task correlation of the updates
===========  ==========================  =================================================

Features are an ``[n, d]`` matrix with few rows (tens of clients) and many columns (the ~62k
parameters of LeNet-5). Nothing here builds a ``d x d`` matrix. The Euclidean methods only depend
on pairwise distances, so they run on :func:`euclidean_embedding`, an ``[n, n]`` matrix with the
same pairwise distances (from the ``n x n`` Gram matrix of the centred rows); that gives the same
partition as running scikit-learn on the ``n x d`` matrix up to float rounding, 10-100x faster.
The covariance method works on the ``n x n`` correlation matrix. Centroids are always means of the
original rows.

Single linkage chains on high-dimensional model vectors (one big cluster plus singletons); that is
a property of the method to report, not a bug.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np

from fedprism.errors import ConfigError

METHODS = ("kmeans", "ward", "average", "single", "covariance")
AFFINITIES = ("shifted", "clip")

#: Label assignment step of spectral clustering. ``cluster_qr`` (Damle et al. 2019) extracts the
#: labels from the spectral embedding by a pivoted QR decomposition: it has no random restarts and
#: no iterations, so it is deterministic given the embedding and does not depend on a K-Means
#: initialisation (``"kmeans"`` does, and ``"discretize"`` can stall on nearly-degenerate spectra).
SPECTRAL_ASSIGN_LABELS = "cluster_qr"

#: Rows of the normalised update matrix that agree to this many decimals count as one point when
#: the covariance method checks that there are at least ``k`` distinct points.
_DISTINCT_DECIMALS = 10


class TooFewPoints(ValueError):
    """Fewer points (or fewer distinct points) than requested clusters.

    Callers skip re-clustering for that round, keep their previous assignment and record
    ``str(exc)`` as the reason.
    """

    def __init__(self, n_points: int, n_distinct: int, k: int, method: str, reason: str | None = None):
        self.n_points, self.n_distinct, self.k, self.method = n_points, n_distinct, k, method
        if reason is None:
            if n_points < k:
                reason = f"only {n_points} points"
            else:
                reason = f"only {n_distinct} distinct points among {n_points}"
        super().__init__(f"cannot form {k} clusters with method '{method}': {reason}")


@dataclass
class Clustering:
    """Result of :func:`hard_cluster`.

    ``labels`` are contiguous ``0..k-1`` in order of first appearance (client 0 is always in
    cluster 0), so equal partitions give equal label vectors. ``centroids[c]`` is the mean feature
    of cluster c's members in the feature space that was passed in (mean Delta for covariance).
    ``info`` records the choices made (method, k, affinity, label assignment, ...).
    """

    labels: np.ndarray
    centroids: np.ndarray
    affinity: np.ndarray | None = None
    info: dict = field(default_factory=dict)

    @property
    def k(self) -> int:
        """Number of (non-empty) clusters found."""
        return int(self.centroids.shape[0])


def as_features(x, name: str = "features") -> np.ndarray:
    """Return ``x`` as a 2-D float64 numpy array; accepts numpy arrays and torch tensors.

    Raises ValueError for the wrong number of dimensions or for NaN/Inf entries (bad client
    updates must be rejected before clustering).
    """
    if hasattr(x, "detach"):  # torch.Tensor, without importing torch here
        x = x.detach().cpu().numpy()
    arr = np.asarray(x, dtype=np.float64)
    if arr.ndim != 2:
        raise ValueError(f"{name} must be a 2-D array [n, d], got shape {arr.shape}")
    if not np.isfinite(arr).all():
        bad = np.flatnonzero(~np.isfinite(arr).all(axis=1)).tolist()
        raise ValueError(f"{name} contain NaN or Inf in rows {bad}")
    return arr


def contiguous_labels(labels) -> np.ndarray:
    """Relabel to ``0..k-1`` in order of first appearance (a canonical form of a partition)."""
    labels = np.asarray(labels)
    _, first, inverse = np.unique(labels, return_index=True, return_inverse=True)
    rank = np.empty(len(first), dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(len(first))
    return rank[inverse.reshape(-1)]


def cluster_means(features: np.ndarray, labels: np.ndarray, k: int | None = None) -> np.ndarray:
    """Mean feature of each cluster ``0..k-1`` (``[k, d]``); an empty cluster gives a zero row."""
    k = int(labels.max()) + 1 if k is None else k
    one_hot = np.zeros((k, len(labels)))
    one_hot[labels, np.arange(len(labels))] = 1.0
    counts = one_hot.sum(axis=1, keepdims=True)
    return (one_hot @ features) / np.maximum(counts, 1.0)


def euclidean_embedding(features: np.ndarray) -> np.ndarray:
    """Rows in R^n with the same pairwise Euclidean distances as the rows of ``features`` [n, d].

    Centre the rows, ``G = X_c X_c^T`` (n x n), ``G = V diag(lam) V^T``, embedding
    ``V diag(sqrt(lam))`` (negative rounding residue of ``lam`` clipped to 0). Means commute with the
    isometry, so K-Means, Ward/average/single linkage, silhouette and Davies-Bouldin give the same
    answers on it as on ``features`` (up to rounding, about 1e-8 of the spread of the data).
    Features with ``d <= n`` columns are returned unchanged (nothing to gain).
    """
    if features.shape[1] <= features.shape[0]:
        return features
    centred = features - features.mean(axis=0, keepdims=True)
    gram = centred @ centred.T
    lam, vec = np.linalg.eigh((gram + gram.T) / 2.0)
    return vec * np.sqrt(np.clip(lam, 0.0, None))


def euclidean_labels(embedding: np.ndarray, k: int, method: str, seed: int, n_features: int) -> np.ndarray:
    """Raw sklearn labels of a Euclidean method on an :func:`euclidean_embedding`.

    ``n_features`` is d of the original features: KMeans's stopping tolerance is relative to the
    mean per-feature variance, so ``tol`` is rescaled to match KMeans(tol=1e-4) on the raw matrix.
    """
    if method == "kmeans":
        from sklearn.cluster import KMeans

        tol = 1e-4 * embedding.shape[1] / max(n_features, 1)
        return KMeans(n_clusters=k, n_init=10, random_state=seed, tol=tol).fit_predict(embedding)
    from sklearn.cluster import AgglomerativeClustering

    return AgglomerativeClustering(n_clusters=k, linkage=method).fit_predict(embedding)


def normalized_updates(updates: np.ndarray) -> np.ndarray:
    """Centre each row over its coordinates and scale it to unit norm (zero rows stay zero)."""
    centred = updates - updates.mean(axis=1, keepdims=True)
    norms = np.linalg.norm(centred, axis=1, keepdims=True)
    return np.divide(centred, norms, out=np.zeros_like(centred), where=norms > 0)


def covariance_affinity(updates: np.ndarray, affinity: str = "shifted") -> np.ndarray:
    """Task-correlation affinity of update vectors.

    ``R = D D^T`` with D the centred, unit-norm updates, so ``R[i, j]`` is the Pearson correlation
    of Delta_i and Delta_j over coordinates, in [-1, 1]. The diagonal is set to 1 (a zero update
    is fully similar to itself). Spectral clustering needs non-negative weights:

    - ``"shifted"`` (default): ``A = (1 + R) / 2``; keeps the graph connected, anti-correlated tasks
      get affinity near 0.
    - ``"clip"``: ``A = max(R, 0)``; may disconnect the graph (the spectral embedding still works;
      :func:`hard_cluster` silences sklearn's "not fully connected" warning).
    """
    if affinity not in AFFINITIES:
        raise ConfigError("clustering.affinity", affinity, f"one of {AFFINITIES}")
    d = normalized_updates(updates)
    r = np.clip(d @ d.T, -1.0, 1.0)
    r = (r + r.T) / 2.0
    np.fill_diagonal(r, 1.0)
    return (1.0 + r) / 2.0 if affinity == "shifted" else np.maximum(r, 0.0)


def _n_distinct(rows: np.ndarray, decimals: int | None = None) -> int:
    if decimals is not None:
        rows = np.round(rows, decimals) + 0.0  # + 0.0 turns -0.0 into 0.0
    return int(np.unique(rows, axis=0).shape[0])


def hard_cluster(
    features,
    k: int,
    method: str,
    seed: int = 0,
    affinity: str = "shifted",
) -> Clustering:
    """Partition the rows of ``features`` into ``k`` clusters (the Fed-PRISM technical report section 3.2).

    Args:
        features: ``[n, d]``; Theta_i (local models) for kmeans/ward/average/single, Delta_i
            (updates) for covariance. numpy array or torch tensor; converted to float64.
        k: number of clusters, ``1 <= k``.
        method: one of :data:`METHODS`.
        seed: ``random_state`` for K-Means and spectral clustering (agglomerative is deterministic).
        affinity: covariance only, ``"shifted"`` or ``"clip"`` (see :func:`covariance_affinity`).

    Returns:
        A :class:`Clustering`. Labels are contiguous in order of first appearance. Spectral
        clustering may in rare cases return fewer than ``k`` non-empty clusters; ``result.k`` and
        ``info["k_found"]`` then say how many.

    Raises:
        TooFewPoints: fewer rows, or fewer distinct rows, than ``k`` (for covariance, distinct
            after centring and normalising, since that is what the method sees).
        ValueError: NaN/Inf features, bad shape, ``k < 1``; ConfigError for an unknown method or
            affinity.
    """
    if method not in METHODS:
        raise ConfigError("clustering.method", method, f"one of {METHODS}")
    if int(k) != k or k < 1:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    k = int(k)
    x = as_features(features)
    n = x.shape[0]
    info: dict = {"method": method, "k": k, "seed": seed}
    if method == "covariance":
        if affinity not in AFFINITIES:
            raise ConfigError("clustering.affinity", affinity, f"one of {AFFINITIES}")
        info.update(affinity=affinity, assign_labels=SPECTRAL_ASSIGN_LABELS)

    if n < k:
        raise TooFewPoints(n, n, k, method)
    if method == "covariance":
        n_distinct = _n_distinct(normalized_updates(x), _DISTINCT_DECIMALS)
    else:
        n_distinct = _n_distinct(x)
    if n_distinct < k:
        raise TooFewPoints(n, n_distinct, k, method)

    aff = covariance_affinity(x, affinity) if method == "covariance" else None
    if k == 1:
        raw = np.zeros(n, dtype=np.int64)
    elif k == n:
        raw = np.arange(n)  # every (distinct) point is its own cluster
    elif method != "covariance":
        raw = euclidean_labels(euclidean_embedding(x), k, method, seed, n_features=x.shape[1])
    else:
        from sklearn.cluster import SpectralClustering

        with warnings.catch_warnings():
            # "Graph is not fully connected" with affinity="clip": the embedding is still usable.
            warnings.filterwarnings("ignore", message="Graph is not fully connected")
            raw = SpectralClustering(
                n_clusters=k,
                affinity="precomputed",
                assign_labels=SPECTRAL_ASSIGN_LABELS,
                random_state=seed,
            ).fit_predict(aff)

    labels = contiguous_labels(raw)
    centroids = cluster_means(x, labels)
    info["k_found"] = int(centroids.shape[0])
    return Clustering(labels=labels, centroids=centroids, affinity=aff, info=info)
