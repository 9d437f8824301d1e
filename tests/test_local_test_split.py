"""Local test rows held out of each client's own data (`data.local_test = "split"`, the 80/20 protocol of
Clust-PSI-PFL, arXiv:2512.20363, section IV-A; `fedprism.data.partition.local_holdout`): disjoint,
80/20 within rounding and stratified per client, seeded, carried by the engines and the Flower nodes;
the default leaves every existing federation and run id as it was."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedprism.data.partition import local_holdout
from fedprism.errors import ConfigError
from fedprism.experiment.config import resolve
from fedprism.experiment.federation import build_federation
from fedprism.experiment.provenance import data_fingerprint

BASE = {"dataset": "digits", "clients": 8, "seed": 3, "partition": "dirichlet_per_class", "partition.alpha": 0.3}
SPLIT = {**BASE, "data.local_test": "split"}


def _lists(rng, sizes, classes=10):
    y = rng.integers(0, classes, size=sum(sizes))
    cuts = np.cumsum((0,) + tuple(sizes))
    perm = rng.permutation(len(y))
    idx = [np.sort(perm[a:b]) for a, b in zip(cuts[:-1], cuts[1:])]
    return idx, y


def test_holdout_is_disjoint_complete_80_20_and_stratified():
    rng = np.random.default_rng(0)
    sizes = (1, 2, 3, 7, 10, 33, 101, 250)
    idx, y = _lists(rng, sizes)
    train, test = local_holdout(idx, y, 0.2, seed=5)
    for rows, tr, te in zip(idx, train, test):
        n = len(rows)
        assert not set(tr) & set(te)                                           # disjoint
        assert np.array_equal(np.sort(np.concatenate([tr, te])), np.sort(rows))  # nothing lost or added
        assert np.all(np.diff(tr) > 0) and np.all(np.diff(te) > 0)
        want = 0 if n == 1 else min(max(math.floor(0.2 * n + 0.5), 1), n - 1)
        assert len(te) == want, n                                              # 80/20 within rounding
        assert len(tr) >= 1
        # stratified: each class's test count is fraction n_c rounded up or down
        for c in np.unique(y[rows]):
            n_c, t_c = int((y[rows] == c).sum()), int((y[te] == c).sum())
            if n >= 10:
                assert math.floor(0.2 * n_c) <= t_c <= math.ceil(0.2 * n_c), (n, c)


def test_holdout_is_seeded_and_per_client():
    rng = np.random.default_rng(1)
    idx, y = _lists(rng, (40, 55, 70))
    a = local_holdout(idx, y, 0.2, seed=5)
    b = local_holdout(idx, y, 0.2, seed=5)
    assert all(np.array_equal(u, v) for u, v in zip(a[1], b[1]))             # deterministic for a seed
    c = local_holdout(idx, y, 0.2, seed=6)
    assert not all(np.array_equal(u, v) for u, v in zip(a[1], c[1]))          # another seed, another split
    alone = local_holdout(idx[:1], y, 0.2, seed=5)                             # independent of the others
    assert np.array_equal(alone[1][0], a[1][0])
    # another fraction: the sizes follow
    t30 = local_holdout(idx, y, 0.3, seed=5)[1]
    assert [len(t) for t in t30] == [math.floor(0.3 * n + 0.5) for n in (40, 55, 70)]
    with pytest.raises(ValueError, match="fraction"):
        local_holdout(idx, y, 1.0, seed=5)


def test_split_federation_holds_out_each_clients_own_rows():
    ref, fed = build_federation(resolve(BASE)), build_federation(resolve(SPLIT))
    assert fed.local_pool == "train" and ref.local_pool == "test"
    assert torch.equal(fed.x_test, ref.x_test)                                 # the global test set is unchanged
    for k in range(fed.num_clients):
        own = np.sort(np.concatenate([fed.train_idx[k], fed.test_idx[k]]))
        assert np.array_equal(own, np.sort(ref.train_idx[k]))                  # the client's partition rows
        assert not set(fed.train_idx[k]) & set(fed.test_idx[k])
        n = len(own)
        assert len(fed.test_idx[k]) == min(max(math.floor(0.2 * n + 0.5), 1), n - 1)
    # test_idx index the training pool: the engines and the label counts read them there
    from fedprism.engine.base import LocalConfig
    from fedprism.engine.sequential import SequentialEngine
    from fedprism.engine.vectorized import VectorizedEngine
    from fedprism.models import build_model
    model = build_model("mlp", fed.input_shape, fed.num_classes)
    for eng in (SequentialEngine(fed, model, LocalConfig(), 0), VectorizedEngine(fed, model, LocalConfig(), 0,
                                                                                 compile=False)):
        x, y = eng.data(2, "local")
        assert torch.equal(x, fed.x_train[torch.as_tensor(fed.test_idx[2])])
        assert torch.equal(y, fed.y_train[torch.as_tensor(fed.test_idx[2])])
    w = torch.stack([torch.nn.utils.parameters_to_vector(model.parameters()).detach()] * 3)
    a = SequentialEngine(fed, model, LocalConfig(), 0).evaluate(w, np.arange(3), "local")
    b = VectorizedEngine(fed, model, LocalConfig(), 0, compile=False).evaluate(w, np.arange(3), "local")
    assert torch.equal(a.confusion, b.confusion) and a.count.tolist() == [len(fed.test_idx[k]) for k in range(3)]
    torch.testing.assert_close(a.loss_sum, b.loss_sum, rtol=1e-5, atol=1e-4)
    hist = fed.label_hist("test")
    assert hist.sum(1).tolist() == [len(t) for t in fed.test_idx]
    assert np.array_equal(hist[0], np.bincount(fed.y_train.numpy()[fed.test_idx[0]], minlength=10))
    # validation rows come out of the 80 % train part, disjoint from the test rows
    val = build_federation(resolve({**SPLIT, "data.val_fraction": 0.25}))
    for k in range(val.num_clients):
        assert np.array_equal(val.test_idx[k], fed.test_idx[k])
        assert not set(val.val_idx[k]) & set(val.test_idx[k]) and not set(val.val_idx[k]) & set(val.train_idx[k])
    assert data_fingerprint(fed) != data_fingerprint(ref)


#: computed with the code before `data.local_test` existed (run id, data fingerprint)
BEFORE = [(BASE, "c8dcba60401d161a", "1e3afcdaec129e2ab208cda73856e407cf2cdd07b60e88b86d55cc51d483d735"),
          ({"dataset": "digits", "clients": 5, "seed": 1, "data.val_fraction": 0.25, "data.global_val": 100},
           "34500bb932bf320b", "ee0aa255588af437731c388f299ecd6f568d8566645c85637b0fadbffbbced46")]


@pytest.mark.parametrize("raw, run_id, fingerprint", BEFORE)
def test_default_leaves_federations_and_run_ids_as_they_were(raw, run_id, fingerprint):
    for extra in ({}, {"data.local_test": "official", "data.local_test_fraction": 0.2}):
        cfg = resolve({**raw, **extra})
        assert cfg.run_id == run_id
        assert data_fingerprint(build_federation(cfg)) == fingerprint
    assert resolve({**raw, "data.local_test": "split"}).run_id != run_id
    assert resolve({**raw, "data.local_test": "split", "data.local_test_fraction": 0.3}).run_id != \
        resolve({**raw, "data.local_test": "split"}).run_id


def test_bad_values_name_the_key():
    with pytest.raises(ConfigError, match="data.local_test.*official, split"):
        resolve({**BASE, "data.local_test": "random"})
    for bad in (0, 1, 1.5, -0.2):
        with pytest.raises(ConfigError, match=r"data.local_test_fraction.*\(0, 1\)"):
            resolve({**SPLIT, "data.local_test_fraction": bad})


def test_a_split_run_trains_and_scores_on_the_held_out_rows(tmp_path):
    from fedprism.experiment.runner import Experiment
    from fedprism.experiment.store import Store

    cfg = resolve({**SPLIT, "clients": 4, "rounds": 1, "method": "fedavg", "model": "mlp", "local_epochs": 1,
                   "device": "cpu", "engine": "sequential"})
    store = Store(tmp_path / "s.db")
    e = Experiment(cfg, store)
    assert e.run().status == "finished"
    fed = build_federation(cfg)
    rows = store.client_rows(e.run_id)
    assert [int(r["n_test"]) for r in rows] == [len(t) for t in fed.test_idx]        # n_test per client
