"""FedProx's Synthetic(alpha, beta) data (Li et al. 2020, "Federated optimization in heterogeneous
networks", arXiv:1812.06127): 60 features, 10 classes, generated per device; each sample keeps its device,
the dataset's natural client."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedprism.data.base import DATASETS, Dataset, DatasetSpec, float_option, int_option
from fedprism.data.files import ignore_root
from fedprism.data.formats import DIGIT_CLASSES
from fedprism.errors import ConfigError

DIM, CLASSES = 60, 10


def generate_synthetic(alpha: float = 1.0, beta: float = 1.0, num_devices: int = 30, seed: int = 0,
                       test_fraction: float = 0.2, iid: bool = False) -> Dataset:
    """FedProx's Synthetic(alpha, beta) data (Li et al. 2020): 60 features, 10 classes, natural devices.

    For device k: ``u_k ~ N(0, alpha)``, ``W_k ~ N(u_k, 1)`` [60x10], ``b_k ~ N(u_k, 1)``;
    ``B_k ~ N(0, beta)``, ``v_k ~ N(B_k, 1)`` [60], ``x ~ N(v_k, Sigma)`` with ``Sigma = diag(j^-1.2)``;
    ``y = argmax softmax(W_k x + b_k)``; ``n_k = int(lognormal(4, 2)) + 50`` samples. As in the FedProx
    generator, alpha and beta are used as standard deviations. ``iid=True`` gives Synthetic-IID (one
    global W, b; ``v_k = B_k``). Each device's samples are split ``test_fraction`` to test; the device
    ids are kept in ``groups`` / ``test_groups``. Features are left unnormalised, as in FedProx.
    """
    alpha = float_option("alpha", alpha, 0.0)
    beta = float_option("beta", beta, 0.0)
    num_devices = int_option("num_devices", num_devices, 1)
    seed = int_option("seed", seed, 0)
    test_fraction = float_option("test_fraction", test_fraction, 0.0, 1.0, open_low=True)
    if not isinstance(iid, bool):
        raise ConfigError("iid", iid, "true or false")

    dim, k = DIM, CLASSES
    rng = np.random.default_rng(seed)
    sizes = rng.lognormal(4, 2, num_devices).astype(np.int64) + 50
    u = rng.normal(0.0, alpha, num_devices)
    big_b = rng.normal(0.0, beta, num_devices)
    sd = np.arange(1, dim + 1, dtype=np.float64) ** (-1.2 / 2)  # sqrt of the diagonal covariance
    if iid:
        w_global, b_global = rng.normal(0.0, 1.0, (dim, k)), rng.normal(0.0, 1.0, k)
    parts: dict[str, list[np.ndarray]] = {key: [] for key in ("xtr", "ytr", "gtr", "xte", "yte", "gte")}
    for dev in range(num_devices):
        v = np.full(dim, big_b[dev]) if iid else rng.normal(big_b[dev], 1.0, dim)
        if iid:
            w, b = w_global, b_global
        else:
            w, b = rng.normal(u[dev], 1.0, (dim, k)), rng.normal(u[dev], 1.0, k)
        n = int(sizes[dev])
        x = v + rng.standard_normal((n, dim)) * sd
        y = np.argmax(x @ w + b, axis=1)  # argmax of softmax = argmax of the logits
        order = rng.permutation(n)
        n_test = int(round(test_fraction * n))
        te, tr = order[:n_test], order[n_test:]
        for tag, idx in (("tr", tr), ("te", te)):
            parts["x" + tag].append(x[idx])
            parts["y" + tag].append(y[idx])
            parts["g" + tag].append(np.full(len(idx), dev, dtype=np.int64))
    cat = {key: np.concatenate(v) for key, v in parts.items()}
    import torch          # here: listing the datasets imports this module, and needs no tensor

    return Dataset(
        name="synthetic",
        x_train=torch.from_numpy(cat["xtr"].astype(np.float32)),
        y_train=torch.from_numpy(cat["ytr"].astype(np.int64)),
        x_test=torch.from_numpy(cat["xte"].astype(np.float32)),
        y_test=torch.from_numpy(cat["yte"].astype(np.int64)),
        classes=list(DIGIT_CLASSES),
        groups=cat["gtr"],
        test_groups=cat["gte"],
        source=f"synthetic(alpha={alpha}, beta={beta}, num_devices={num_devices}, seed={seed}, iid={iid})",
    )


def load(pad32: bool = False, root: str | Path | None = None, **options) -> Dataset:
    """:func:`generate_synthetic` with ``options``; tabular data is never padded, no files are read."""
    ignore_root(SPEC.name, root)
    return generate_synthetic(**options)


SPEC = DATASETS.register(DatasetSpec(
    name="synthetic",
    load=load,
    summary="FedProx's Synthetic(alpha, beta): 60 features per sample, generated per device (Li et al. 2020, "
            "arXiv:1812.06127); no files",
    class_names=DIGIT_CLASSES,
    input_shape=(DIM,),
    normalisation="none (the generator's features, as in FedProx)",
    natural="device",
    options=("alpha", "beta", "num_devices", "seed", "test_fraction", "iid"),
    config_keys=(("data.synthetic_devices", "num_devices"),),
))
