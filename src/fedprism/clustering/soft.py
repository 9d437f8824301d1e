"""Soft top-m assignment of clients to cluster centroids (the Fed-PRISM technical report section 3.3).

``Sim[i, c] = cos(feature_i, mu_c)``; ``M_i`` = the m clusters with the largest similarity;
``W[i, c] = exp(Sim[i, c] / T) / sum_{c' in M_i} exp(Sim[i, c'] / T)`` for ``c in M_i``, else 0.
With T = 1 (the report's formula) cosines in [-1, 1] give fairly flat weights: 0.9 vs 0.5 -> 0.5987 / 0.4013.
"""

from __future__ import annotations

import numpy as np

from fedprism.clustering.hard import as_features


def cosine_matrix(a, b) -> np.ndarray:
    """Cosine similarity of every row of ``a`` [n, d] with every row of ``b`` [k, d] -> [n, k].

    A zero-norm row has similarity 0 with everything (including itself). Values are clipped to
    [-1, 1] against rounding.
    """
    a, b = as_features(a, "a"), as_features(b, "b")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"dimension mismatch: a has {a.shape[1]} columns, b has {b.shape[1]}")
    na = np.linalg.norm(a, axis=1)
    nb = np.linalg.norm(b, axis=1)
    denom = np.outer(na, nb)
    sim = np.divide(a @ b.T, denom, out=np.zeros(denom.shape), where=denom > 0)
    return np.clip(sim, -1.0, 1.0)


def top_m_softmax(sim: np.ndarray, m: int, temperature: float = 1.0) -> np.ndarray:
    """Row-wise softmax of ``sim / temperature`` restricted to the m largest entries of each row.

    Ties are broken by the lowest column index (stable sort), so every row has exactly m non-zeros
    (softmax weights are strictly positive) and sums to 1.
    """
    sim = np.asarray(sim, dtype=np.float64)
    if sim.ndim != 2:
        raise ValueError(f"similarities must be 2-D [n, k], got shape {sim.shape}")
    n, k = sim.shape
    if int(m) != m or not 1 <= m <= k:
        raise ValueError(f"m must be an integer in 1..{k} (number of clusters), got {m!r}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    m = int(m)
    top = np.argsort(-sim, axis=1, kind="stable")[:, :m]  # [n, m]
    z = np.take_along_axis(sim, top, axis=1) / temperature
    z = np.exp(z - z.max(axis=1, keepdims=True))
    weights = np.zeros((n, k))
    np.put_along_axis(weights, top, z / z.sum(axis=1, keepdims=True), axis=1)
    return weights


def soft_assign(features, centroids, m: int, temperature: float = 1.0) -> np.ndarray:
    """Soft assignment matrix W [n, k] of the Fed-PRISM technical report section 3.3 (see the module docstring).

    Args:
        features: [n, d] client features (Theta_i or Delta_i, the space the centroids live in).
        centroids: [k, d] cluster centroids (row c belongs to cluster / model c).
        m: number of non-zero weights per row, 1 <= m <= k.
        temperature: T > 0; Sim is divided by T before the softmax (T = 1 is the report's formula).
    """
    return top_m_softmax(cosine_matrix(features, centroids), m, temperature)
