"""Shared fixtures: small real federations (sklearn digits) built without the CLI."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
# `train.kernels` / `eval.kernels` = auto resolves to aten here (fedprism.kernels.PIN), in this process and in
# the CLI processes tests start: the suite's run ids and numbers must not depend on whether this machine has
# the fused kernels built. Tests of `auto` itself clear it (tests/test_fused_kernels.py).
os.environ.setdefault("FEDPRISM_KERNELS", "aten")

from fedprism.data.datasets import load_dataset  # noqa: E402
from fedprism.federation import Federation  # noqa: E402


def load_script(relpath: str):
    """A script of the repository (`bench/*.py`, `scripts/*.py`) imported as a module, by path."""
    import importlib.util
    path = Path(__file__).resolve().parents[1] / relpath
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny ops on a shared 2-core machine: one intra-op thread is faster and steadier."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def digits():
    return load_dataset("digits", cache_dir=False)


def planted_federation(ds, clients_per_group: int = 6, per_client: int = 60, seed: int = 0,
                       groups=((0, 1, 2, 3, 4), (5, 6, 7, 8, 9))) -> tuple[Federation, np.ndarray]:
    """Clients in group g hold only the classes of groups[g] (disjoint label sets)."""
    rng = np.random.default_rng(seed)
    y, yt = ds.y_train.numpy(), ds.y_test.numpy()
    pools = {g: rng.permutation(np.flatnonzero(np.isin(y, cls))) for g, cls in enumerate(groups)}
    tpools = {g: rng.permutation(np.flatnonzero(np.isin(yt, cls))) for g, cls in enumerate(groups)}
    train, test, truth = [], [], []
    for g in range(len(groups)):
        for j in range(clients_per_group):
            train.append(np.sort(pools[g][j * per_client:(j + 1) * per_client]))
            nt = len(tpools[g]) // clients_per_group
            test.append(np.sort(tpools[g][j * nt:(j + 1) * nt]))
            truth.append(g)
    fed = Federation(ds.x_train, ds.y_train, ds.x_test, ds.y_test, train, test, ds.num_classes,
                     list(ds.classes), "digits-planted")
    return fed, np.array(truth)


@pytest.fixture
def planted(digits):
    return planted_federation(digits)


def unequal_federation(ds, sizes=(7, 20, 33, 50, 64, 90), seed: int = 0) -> Federation:
    rng = np.random.default_rng(seed)
    perm = rng.permutation(len(ds.y_train))
    cuts = np.cumsum((0,) + tuple(sizes))
    train = [np.sort(perm[a:b]) for a, b in zip(cuts[:-1], cuts[1:])]
    tperm = rng.permutation(len(ds.y_test))
    test = [np.sort(tperm[i * 20:(i + 1) * 20]) for i in range(len(sizes))]
    return Federation(ds.x_train, ds.y_train, ds.x_test, ds.y_test, train, test, ds.num_classes,
                      list(ds.classes), "digits-unequal")


def same(a: torch.Tensor, b: torch.Tensor, atol: float = 1e-5) -> bool:
    return bool(torch.allclose(a, b, atol=atol, rtol=1e-4))


@pytest.fixture(scope="session")
def committed_db() -> Path:
    """The committed results store, built once from its dump in results/ (tests/_committed.py); read it
    read-only or copy it."""
    from _committed import committed_store

    db = committed_store()
    if db is None:
        pytest.skip("no committed results dump (results/store.json)")
    return db
