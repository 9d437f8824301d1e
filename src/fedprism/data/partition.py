"""The partition API under its first name: `fedprism.data.partitions` holds it, one module per partition
(`make_partition`, `PARTITIONS`, `Partition`, `label_histograms`, `summarize`, `local_holdout`)."""

from fedprism.data.partitions import (PARTITIONS, Partition, PartitionSpec, label_histograms, local_holdout,
                                      make_partition, register_partition, summarize)
from fedprism.data.partitions.base import _split_among_holders  # noqa: F401 - tests of the class split

__all__ = ["PARTITIONS", "Partition", "PartitionSpec", "label_histograms", "local_holdout", "make_partition",
           "register_partition", "summarize"]
