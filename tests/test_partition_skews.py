"""Quantity skew, noise-based feature skew and natural partitions by column (Li, Diao, Chen, He 2022,
"Federated Learning on Non-IID Data Silos: An Experimental Study", arXiv:2102.02079): sizes and noise
checked by hand and against the seeded streams, reproducibility, refusals, listing."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from fedprism.data.partitions import PARTITIONS, make_partition
from fedprism.data.partitions.feature_noise import NOISE_STREAM
from fedprism.data.partitions.natural import column_groups
from fedprism.errors import PartitionError
from fedprism.experiment.config import resolve
from fedprism.experiment.federation import build_federation, clear_federations

Y = np.arange(100) % 4
Y_TEST = np.arange(40) % 4


def _train_rng(seed: int) -> np.random.Generator:
    """The stream make_partition hands a partition's split (the first of two spawned from the seed)."""
    return np.random.default_rng(np.random.SeedSequence(seed).spawn(2)[0])


@pytest.mark.parametrize("seed", [0, 3])
def test_power_law_sizes_by_hand(seed):
    # q ~ rank^-1 for ranks 1..4: (1, 1/2, 1/3, 1/4) / (25/12) = (12, 6, 4, 3) / 25; cut at floor(cumsum(q) 100):
    # 48, 72, 88 -> sizes 48, 24, 16, 12 for ranks 1, 2, 3, 4, given to the clients in a seeded order
    by_rank = [48, 24, 16, 12]
    part = make_partition("quantity", Y, Y_TEST, 4, seed=seed, min_train=5, sizes="power_law", exponent=1.0)
    ranks = _train_rng(seed).permutation(4)
    assert part.n_train.tolist() == [by_rank[r] for r in ranks]
    assert sorted(part.n_train.tolist()) == [12, 16, 24, 48]
    allrows = np.concatenate(part.train)
    assert sorted(allrows.tolist()) == list(range(100))            # every sample, each once


def test_power_law_exponent_zero_is_equal_sizes():
    part = make_partition("quantity", Y, Y_TEST, 4, seed=1, min_train=5, sizes="power_law", exponent=0.0)
    assert part.n_train.tolist() == [25, 25, 25, 25]


def test_dirichlet_sizes_and_iid_labels_follow_the_stream():
    seed, beta = 7, 0.5
    part = make_partition("quantity", Y, Y_TEST, 4, seed=seed, min_train=5, beta=beta)
    rng = _train_rng(seed)
    while True:                                   # the redraw rule: until every client has min_train
        q = rng.dirichlet(np.full(4, beta))
        sizes = np.diff(np.concatenate([[0], np.floor(np.cumsum(q)[:-1] * 100).astype(int), [100]]))
        if sizes.min() >= 5:
            break
    order = rng.permutation(100)                  # then one permutation, cut by the sizes: labels IID
    assert part.n_train.tolist() == sizes.tolist()
    cuts = np.cumsum(sizes)[:-1]
    assert [sorted(p.tolist()) for p in np.split(order, cuts)] == [p.tolist() for p in part.train]
    assert part.meta["client_sizes"] == sizes.tolist()


def test_quantity_is_reproducible_and_seeded():
    a = make_partition("quantity", Y, Y_TEST, 4, seed=2, min_train=5)
    b = make_partition("quantity", Y, Y_TEST, 4, seed=2, min_train=5)
    c = make_partition("quantity", Y, Y_TEST, 4, seed=3, min_train=5)
    assert all(np.array_equal(x, y) for x, y in zip(a.train, b.train))
    assert a.n_train.tolist() != c.n_train.tolist()


def test_quantity_refusals_name_the_key():
    with pytest.raises(PartitionError, match=r"partition.exponent <= 0\.\d+"):
        make_partition("quantity", Y, Y_TEST, 4, seed=0, min_train=20, sizes="power_law", exponent=1.0)
    with pytest.raises(PartitionError, match="partition.beta = 0.01.*raise partition.beta"):
        make_partition("quantity", Y, Y_TEST, 4, seed=0, min_train=24, beta=0.01, max_tries=3)
    with pytest.raises(PartitionError, match="partition.sizes"):
        make_partition("quantity", Y, Y_TEST, 4, seed=0, sizes="zipf")


def test_power_law_bound_in_the_message_is_reachable():
    # the largest exponent the message names gives every client min_train samples
    with pytest.raises(PartitionError) as e:
        make_partition("quantity", Y, Y_TEST, 4, seed=0, min_train=20, sizes="power_law", exponent=1.0)
    bound = float(str(e.value).split("partition.exponent <= ")[1].split(",")[0])
    part = make_partition("quantity", Y, Y_TEST, 4, seed=0, min_train=20, sizes="power_law", exponent=bound)
    assert part.n_train.min() >= 20


# -------------------------------------------------------------------------------------- feature noise

def _fed(**kw):
    clear_federations()
    cfg = resolve({"dataset": "digits", "clients": 4, "model": "mlp", "partition": "feature_noise", **kw})
    return cfg, build_federation(cfg)


def _clean(**kw):
    clear_federations()
    cfg = resolve({"dataset": "digits", "clients": 4, "model": "mlp", "partition": "iid", **kw})
    return build_federation(cfg)


def test_feature_noise_is_sigma_i_over_n_from_its_stream():
    sigma, seed = 0.8, 5
    cfg, fed = _fed(**{"partition.sigma": sigma, "seed": seed})
    clean = _clean(seed=seed)          # the same IID split, without noise (feature_noise splits as iid does)
    assert [t.tolist() for t in fed.train_idx] == [t.tolist() for t in clean.train_idx]
    assert fed.meta["noise_std"] == [0.0, 0.2, 0.4, 0.6000000000000001]
    for c, idx in enumerate(fed.train_idx):
        rows = torch.as_tensor(idx)
        got = fed.x_train[rows] - clean.x_train[rows]
        rng = np.random.default_rng([seed, NOISE_STREAM, c, 0])
        want = torch.from_numpy(rng.standard_normal(tuple(got.shape), dtype=np.float32)) * np.float32(sigma * c / 4)
        if c == 0:
            assert torch.equal(fed.x_train[rows], clean.x_train[rows])          # client 0: clean, bit for bit
        else:
            assert torch.allclose(got, want, atol=1e-5)
            assert abs(got.std().item() - sigma * c / 4) < 0.05 * sigma * c / 4 + 0.01
    # local test rows: the client's own test rows plus noise from its test stream; the global test set is clean
    assert fed.local_pool == "train" and torch.equal(fed.x_test, clean.x_test)
    for c, (idx, clean_idx) in enumerate(zip(fed.test_idx, clean.test_idx)):
        x_local, y_local = fed.local_xy()
        rows = torch.as_tensor(idx)
        base = clean.x_test[torch.as_tensor(clean_idx)]
        assert torch.equal(y_local[rows], clean.y_test[torch.as_tensor(clean_idx)])
        rng = np.random.default_rng([seed, NOISE_STREAM, c, 1])
        noise = torch.from_numpy(rng.standard_normal(tuple(base.shape), dtype=np.float32)) * np.float32(sigma * c / 4)
        assert torch.allclose(x_local[rows], base + noise, atol=1e-5)
    # no training row of any client is one of the appended local test rows
    n_pool = len(clean.y_train)
    assert all(int(i.max()) < n_pool for i in fed.train_idx) and all(int(i.min()) >= n_pool for i in fed.test_idx)


def test_feature_noise_is_reproducible_and_keyed_by_sigma():
    cfg1, a = _fed(**{"partition.sigma": 0.5})
    x1 = a.x_train.clone()
    cfg2, b = _fed(**{"partition.sigma": 0.5})
    assert torch.equal(x1, b.x_train) and cfg1.run_id == cfg2.run_id
    cfg3, _ = _fed(**{"partition.sigma": 0.25})
    assert cfg3.run_id != cfg1.run_id


def test_feature_noise_with_a_split_local_test_set_holds_out_noisy_rows():
    cfg, fed = _fed(**{"partition.sigma": 1.0, "data.local_test": "split"})
    clean = _clean(**{"data.local_test": "split"})
    assert fed.local_pool == "train" and len(fed.y_train) == len(clean.y_train)
    for c in (0, 3):
        rows = torch.as_tensor(fed.test_idx[c])
        diff = (fed.x_train[rows] - clean.x_train[rows]).abs().max().item()
        assert (diff == 0) if c == 0 else (diff > 0.1)


# -------------------------------------------------------------------------------------- natural by column

def test_column_groups_by_hand():
    tr = {"state": np.array(["NY", "CA", "NY", "TX", "CA"])}
    te = {"state": np.array(["TX", "CA", "WA"])}
    g_tr, g_te = column_groups(tr, te, "state", "x")
    # sorted values over both splits: CA 0, NY 1, TX 2, WA 3
    assert g_tr.tolist() == [1, 0, 1, 2, 0] and g_te.tolist() == [2, 0, 3]
    part = make_partition("natural", np.array([0, 1, 0, 1, 1]), np.array([0, 1, 1]), 3, seed=0, min_train=1,
                          min_test=0, groups=g_tr, test_groups=g_te, column="state")
    assert [t.tolist() for t in part.train] == [[1, 4], [0, 2], [3]]
    assert [t.tolist() for t in part.test] == [[1], [], [0]]        # WA has no train rows: its test row unused
    assert part.meta["params"] == {"column": "state"}


def test_column_groups_refusals():
    with pytest.raises(PartitionError, match=r"partition.column = 'stat'.*one of its columns: state.*did you mean"):
        column_groups({"state": np.zeros(2)}, {"state": np.zeros(1)}, "stat", "x")
    with pytest.raises(PartitionError, match="holds floats"):
        column_groups({"age": np.array([1.5, 2.0])}, {"age": np.array([3.0])}, "age", "x")
    with pytest.raises(PartitionError, match="gives none"):
        column_groups(None, None, "state", "x")


def test_natural_run_ids_keep_their_value_without_a_column():
    plain = resolve({"dataset": "wisdm", "partition": "natural", "clients": 36})
    assert "partition.column" not in plain.identity
    named = resolve({"dataset": "wisdm", "partition": "natural", "clients": 36, "partition.column": "user"})
    assert named.identity["partition.column"] == "user" and named.run_id != plain.run_id


def test_listed_by_fedprism_partitions():
    out = subprocess.run([sys.executable, "-m", "fedprism", "partitions"], capture_output=True, text=True,
                         check=True).stdout
    for word in ("quantity", "feature_noise", "partition.sigma", "partition.exponent", "partition.column"):
        assert word in out, word
    assert "quantity" in PARTITIONS and "feature_noise" in PARTITIONS


def test_fedprism_partition_lists_each_clients_noise_std(capsys):
    """`fedprism partition ... partition=feature_noise` prints sigma * i / N beside each client's label
    statistics (which alone cannot show a feature skew); a label partition gets no such column."""
    from fedprism.cli import main

    assert main(["partition", "dataset=digits", "clients=5", "partition=feature_noise", "partition.sigma=0.5"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    head = lines[0].split()
    assert head[-1] == "noise_std"
    assert [float(x.split()[-1]) for x in lines[2:7]] == [0.5 * i / 5 for i in range(5)]
    assert "Feature skew (feature_noise)" in out and "0 to 0.4)" in out
    assert main(["partition", "dataset=digits", "clients=5", "partition=dirichlet"]) == 0
    out = capsys.readouterr().out
    assert "noise_std" not in out and "Feature skew" not in out
