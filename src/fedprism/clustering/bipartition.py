"""CFL's optimal bipartition (Sattler, Mueller, Samek 2020).

CFL splits a cluster c into ``(c1, c2) = argmin_{c1 u c2 = c} max_{i in c1, j in c2} alpha_ij``,
with ``alpha_ij`` the cosine similarity of the client updates. This min-max cut is solved exactly by
single-linkage agglomeration on similarity: process pairs in descending ``alpha`` order and merge
their components (Kruskal's algorithm for the *maximum* spanning tree) until two components remain.

Why it is optimal: let e* be the weakest edge of the maximum spanning tree (the edge Kruskal would
add last). Every bipartition cuts at least one tree edge, whose similarity is >= e*, so every split
has ``max cross >= e*``. The two components left before adding e* have ``max cross = e*``: the
largest cross similarity is exactly the edge that would join them. O(n^2 log n).

The notebook and FL-bench use complete linkage instead, which is not the paper's cut; it differs on
chain-like similarity structures.
"""

from __future__ import annotations

import numpy as np

from fedprism.clustering.soft import cosine_matrix


def pairwise_cosine(updates) -> np.ndarray:
    """Cosine similarity matrix ``alpha_ij`` of the update vectors [n, d] -> [n, n].

    A zero update has similarity 0 with every update (also on the diagonal).
    """
    return cosine_matrix(updates, updates)


def _check_similarity(similarity) -> np.ndarray:
    s = np.asarray(similarity, dtype=np.float64)
    if s.ndim != 2 or s.shape[0] != s.shape[1]:
        raise ValueError(f"similarity must be a square matrix, got shape {s.shape}")
    if s.shape[0] < 2:
        raise ValueError(f"a bipartition needs at least 2 points, got {s.shape[0]}")
    if not np.isfinite(s).all():
        raise ValueError("similarity contains NaN or Inf")
    if not np.allclose(s, s.T, rtol=0.0, atol=1e-9):
        raise ValueError("similarity must be symmetric")
    return s


def optimal_bipartition(similarity) -> tuple[np.ndarray, np.ndarray]:
    """Split indices ``0..n-1`` into two non-empty sets minimising the max cross similarity.

    Args:
        similarity: symmetric [n, n] matrix (n >= 2), e.g. :func:`pairwise_cosine` of the updates.
            The diagonal is ignored.

    Returns:
        ``(idx1, idx2)``: sorted index arrays; ``idx1`` contains index 0. Ties between equal
        similarities are processed in row-major (i, j) order, so the result is deterministic.
    """
    s = _check_similarity(similarity)
    n = s.shape[0]
    parent = np.arange(n)

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    iu, ju = np.triu_indices(n, k=1)
    order = np.argsort(-s[iu, ju], kind="stable")
    components = n
    for e in order:
        if components == 2:
            break
        ri, rj = find(int(iu[e])), find(int(ju[e]))
        if ri != rj:
            parent[max(ri, rj)] = min(ri, rj)
            components -= 1
    roots = np.array([find(i) for i in range(n)])
    in_first = roots == roots[0]
    return np.flatnonzero(in_first), np.flatnonzero(~in_first)


def max_cross_similarity(similarity, idx1, idx2) -> float:
    """``alpha_max_cross = max_{i in idx1, j in idx2} similarity[i, j]``.

    CFL's certificate is ``gamma_max = sqrt((1 - alpha_max_cross) / 2)``.
    """
    s = np.asarray(similarity, dtype=np.float64)
    return float(s[np.ix_(np.asarray(idx1), np.asarray(idx2))].max())
