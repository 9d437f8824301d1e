"""Gaussian blobs of three sites as an external dataset plugin.

The worked example of docs/adding-a-dataset.md: a package registers it through the `fedprism.datasets`
entry-point group and it runs through `fedprism run`, sweeps, reports and Flower like a built-in dataset,
`partition=natural` included (each sample keeps the site it was drawn at).
"""

import numpy as np
import torch

from fedprism.data.base import Dataset, DatasetSpec

CLASSES = ("left", "centre", "right")
SITES, FEATURES = 3, 4


def load(pad32: bool = False, root: str | None = None, seed: int = 0) -> Dataset:
    """60 training and 30 test samples per site; class c is centred at (c - 1) * 2 on the first feature,
    and every site shifts all features by its own offset (a feature skew between the natural clients)."""
    rng = np.random.default_rng(seed)
    parts = {"xtr": [], "ytr": [], "gtr": [], "xte": [], "yte": [], "gte": []}
    for site in range(SITES):
        for split, n in (("tr", 60), ("te", 30)):
            y = rng.integers(0, len(CLASSES), n)
            x = rng.normal(0.5 * site, 1.0, (n, FEATURES))
            x[:, 0] += (y - 1) * 2.0
            parts["x" + split].append(x.astype(np.float32))
            parts["y" + split].append(y.astype(np.int64))
            parts["g" + split].append(np.full(n, site, np.int64))
    cat = {k: np.concatenate(v) for k, v in parts.items()}
    return Dataset(name="blobs", x_train=torch.from_numpy(cat["xtr"]), y_train=torch.from_numpy(cat["ytr"]),
                   x_test=torch.from_numpy(cat["xte"]), y_test=torch.from_numpy(cat["yte"]),
                   classes=list(CLASSES), groups=cat["gtr"], test_groups=cat["gte"],
                   source=f"blobs(seed={seed})")


SPEC = DatasetSpec(
    name="blobs",
    load=load,
    summary="Gaussian blobs at three sites, 4 features, 3 classes (a generated example)",
    class_names=CLASSES,
    input_shape=(FEATURES,),
    normalisation="none (generated at unit scale)",
    natural="site",
    options=("seed",),
)
