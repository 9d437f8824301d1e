"""Per-client summaries of a partition (`fedprism partition`, the report)."""

from __future__ import annotations

import numpy as np

from fedprism.data.partitions.base import Partition, label_histograms


def summarize(part: Partition, y_train: np.ndarray, num_classes: int) -> list[dict]:
    """One row per client: sizes, classes present, dominant class and its share (for printing/storing),
    and the client's domain when the partition assigns domains (``domain_mix``).

    ``part`` may be any object with ``train`` and ``test`` index lists (and optionally ``domains``).
    """
    hist = label_histograms(part.train, np.asarray(y_train), num_classes)
    n_test = [len(t) for t in part.test]
    domains = getattr(part, "domains", None)
    rows = []
    for i, h in enumerate(hist):
        n = int(h.sum())
        present = np.flatnonzero(h)
        dom = int(np.argmax(h)) if n else -1
        rows.append(
            {
                "client": i,
                "n_train": n,
                "n_test": int(n_test[i]),
                "classes": present.tolist(),
                "num_classes": int(present.size),
                "dominant_class": dom,
                "dominant_share": float(h[dom] / n) if n else 0.0,
            }
        )
        if domains is not None:
            rows[-1]["domain"] = int(domains[i])
    return rows

