"""Clustering machinery shared by Fed-PRISM, FedClust, IFCA, CFL, FedPrism-paper and Clust-PSI-PFL.

Every function accepts numpy arrays or torch tensors and returns float64 numpy arrays.

- :mod:`.hard` — :func:`hard_cluster` with the five methods of the Fed-PRISM technical report section 3.2.
- :mod:`.soft` — :func:`soft_assign` (top-m softmax of cosine similarity, the report's section 3.3).
- :mod:`.matching` — Hungarian matching of new clusters to persistent models.
- :mod:`.select_k` — choice of K by silhouette (Clust-PSI-PFL) or Davies-Bouldin (FedSub).
- :mod:`.bipartition` — CFL's optimal min-max bipartition.
"""

from fedprism.clustering.bipartition import max_cross_similarity, optimal_bipartition, pairwise_cosine
from fedprism.clustering.hard import (
    AFFINITIES,
    METHODS,
    SPECTRAL_ASSIGN_LABELS,
    Clustering,
    TooFewPoints,
    as_features,
    cluster_means,
    contiguous_labels,
    covariance_affinity,
    euclidean_embedding,
    euclidean_labels,
    hard_cluster,
)
from fedprism.clustering.matching import centroid_cost, match_clusters, overlap_cost, relabel, reorder
from fedprism.clustering.select_k import choose_k_davies_bouldin, choose_k_silhouette
from fedprism.clustering.soft import cosine_matrix, soft_assign, top_m_softmax

__all__ = [
    "AFFINITIES",
    "METHODS",
    "SPECTRAL_ASSIGN_LABELS",
    "Clustering",
    "TooFewPoints",
    "as_features",
    "centroid_cost",
    "choose_k_davies_bouldin",
    "choose_k_silhouette",
    "cluster_means",
    "contiguous_labels",
    "cosine_matrix",
    "covariance_affinity",
    "euclidean_embedding",
    "euclidean_labels",
    "hard_cluster",
    "match_clusters",
    "max_cross_similarity",
    "optimal_bipartition",
    "overlap_cost",
    "pairwise_cosine",
    "relabel",
    "reorder",
    "soft_assign",
    "top_m_softmax",
]
