"""Datasets, partitions and heterogeneity metrics (no torch.nn here)."""

from fedprism.data.datasets import DATASETS, Dataset, generate_synthetic, load_dataset, search_paths
