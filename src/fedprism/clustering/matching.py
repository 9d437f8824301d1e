"""Keep cluster identity across re-clusterings.

Hard labels from a new clustering are arbitrary, but per-cluster state (models, logs) persists. Each
new hard cluster j is matched to an existing model ``perm[j]`` by a minimum-cost assignment
(Hungarian algorithm, ``scipy.optimize.linear_sum_assignment``). Two costs are provided:

- :func:`overlap_cost` (recommended, space-agnostic): ``cost[j, c] = -sum_{i in new cluster j}
  W_old[i, c]``, the members' previous weight on model c.
- :func:`centroid_cost` (Theta features): ``cost[j, c] = -cos(mu_j, w_c)``.

Typical use::

    perm = match_clusters(overlap_cost(clustering.labels, W_old[reporting]))
    labels = relabel(clustering.labels, perm)                       # model index per client
    centroids = reorder(clustering.centroids, perm, n_models)       # row c = centroid of model c
"""

from __future__ import annotations

import numpy as np


def match_clusters(cost) -> np.ndarray:
    """Minimum-cost matching of new clusters (rows) to existing models (columns).

    Returns ``perm`` of length ``k_new``: new hard cluster j maps to model ``perm[j]``.

    Rectangular costs ``[k_new, k_old]``:

    - ``k_new <= k_old``: every new cluster gets a distinct model; the ``k_old - k_new`` unmatched
      models receive no cluster (callers leave them unchanged).
    - ``k_new > k_old``: the best ``k_old`` new clusters get the existing models; each remaining new
      cluster gets a fresh index ``k_old, k_old + 1, ...`` (in increasing j), meaning "a model
      that does not exist yet" — the caller must create it (e.g. as a copy of the global model)
      or refuse.

    The result is always injective. Ties are resolved by scipy deterministically.
    """
    cost = np.asarray(cost, dtype=np.float64)
    if cost.ndim != 2:
        raise ValueError(f"cost must be a 2-D matrix [k_new, k_old], got shape {cost.shape}")
    if not np.isfinite(cost).all():
        raise ValueError("cost contains NaN or Inf")
    k_new, k_old = cost.shape
    perm = np.full(k_new, -1, dtype=np.int64)
    if k_new and k_old:
        from scipy.optimize import linear_sum_assignment    # here: scipy costs a second to import

        rows, cols = linear_sum_assignment(cost)
        perm[rows] = cols
    unmatched = np.flatnonzero(perm < 0)
    perm[unmatched] = k_old + np.arange(len(unmatched))
    return perm


def overlap_cost(new_labels, w_old_rows, k_new: int | None = None) -> np.ndarray:
    """``cost[j, c] = - sum_{i in new cluster j} W_old[i, c]``.

    Args:
        new_labels: [n] hard labels 0..k_new-1 of the clients just clustered.
        w_old_rows: [n, k_old] those clients' rows of the previous soft assignment W (any
            non-negative membership matrix works, e.g. one-hot previous hard labels).
        k_new: number of new clusters (default ``max(new_labels) + 1``).

    On the first clustering (uniform W_old) every matching costs the same and any is fine.
    """
    labels = np.asarray(new_labels, dtype=np.int64)
    w = np.asarray(w_old_rows, dtype=np.float64)
    if w.ndim != 2 or w.shape[0] != labels.shape[0]:
        raise ValueError(f"w_old_rows must be [n={labels.shape[0]}, k_old], got shape {w.shape}")
    k_new = int(labels.max()) + 1 if k_new is None else int(k_new)
    cost = np.zeros((k_new, w.shape[1]))
    np.add.at(cost, labels, w)
    return -cost


def centroid_cost(new_centroids, models) -> np.ndarray:
    """``cost[j, c] = -cos(mu_j, w_c)`` for new centroids [k_new, d] and models [k_old, d]."""
    from fedprism.clustering.soft import cosine_matrix

    return -cosine_matrix(new_centroids, models)


def relabel(labels, perm) -> np.ndarray:
    """Map hard labels through ``perm``: client i goes to model ``perm[labels[i]]``."""
    return np.asarray(perm, dtype=np.int64)[np.asarray(labels, dtype=np.int64)]


def reorder(rows, perm, n_models: int | None = None) -> np.ndarray:
    """Place row j of ``rows`` (e.g. centroids [k_new, d]) at position ``perm[j]``.

    Output has ``max(n_models, max(perm) + 1)`` rows; positions no cluster maps to are zero (a zero
    centroid has cosine similarity 0 with every client in :func:`soft_assign`; callers that want
    such models never selected should pass only the matched columns).
    """
    rows = np.asarray(rows, dtype=np.float64)
    perm = np.asarray(perm, dtype=np.int64)
    size = int(perm.max()) + 1 if perm.size else 0
    size = max(size, n_models or 0)
    out = np.zeros((size,) + rows.shape[1:])
    out[perm] = rows
    return out
