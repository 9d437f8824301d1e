"""Partitions, domain transforms and the partition plot."""

from __future__ import annotations

import math
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from conftest import load_script

from fedprism.data.domains import DOMAINS, apply_domain, apply_domains
from fedprism.data.partition import (PARTITIONS, Partition, _split_among_holders, label_histograms,
                                     make_partition, summarize)
from fedprism.data.plots import plot_class_distribution
from fedprism.errors import PartitionError

C = 10


def _labels(n: int, seed: int, skew: bool = False) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if skew:  # unequal class sizes, like real datasets
        p = np.linspace(1.0, 2.0, C)
        return rng.choice(C, size=n, p=p / p.sum())
    return rng.integers(0, C, size=n)


Y_TRAIN = _labels(6000, 0, skew=True)
Y_TEST = _labels(1000, 1, skew=True)

CASES = [
    ("iid", {}),
    ("dirichlet", {"alpha": 0.1}),
    ("dirichlet", {"alpha": 1.0}),
    ("dirichlet_per_class", {"alpha": 0.5}),
    ("pathological", {"shards_per_client": 2}),
    ("pathological", {"shards_per_client": 3, "variant": "classes"}),
    ("similarity", {"s": 0.3}),
    ("domain_mix", {"num_domains": 4, "min_classes": 2, "max_classes": 5}),
]
USES_ALL = {"iid", "dirichlet_per_class", "pathological", "domain_mix"}


def _ids(case):
    name, params = case
    return name + "".join(f"-{k}={v}" for k, v in params.items())


def _pmf(y: np.ndarray, idx: np.ndarray) -> np.ndarray:
    return np.bincount(y[idx], minlength=C) / max(len(idx), 1)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_exact_disjoint_cover_and_valid_indices(case):
    name, params = case
    part = make_partition(name, Y_TRAIN, Y_TEST, num_clients=20, seed=3, **params)
    assert isinstance(part, Partition) and part.num_clients == 20 and len(part.test) == 20
    for tr, te in zip(part.train, part.test):
        for idx, n in ((tr, len(Y_TRAIN)), (te, len(Y_TEST))):
            assert idx.dtype == np.int64
            assert np.all(np.diff(idx) >= 0), "indices must be sorted"
            assert idx.size == 0 or (idx.min() >= 0 and idx.max() < n)
    flat = np.concatenate(part.train)
    assert np.unique(flat).size == flat.size, "a train index is used by two clients"
    assert part.meta["n_train_used"] == flat.size
    assert part.meta["n_train_used"] + part.meta["n_train_unused"] == len(Y_TRAIN)
    if name in USES_ALL:
        assert np.array_equal(np.sort(flat), np.arange(len(Y_TRAIN)))
    assert part.n_train.min() >= 10 and part.n_test.min() >= 1


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_deterministic_in_seed(case):
    name, params = case
    a = make_partition(name, Y_TRAIN, Y_TEST, 20, seed=5, **params)
    b = make_partition(name, Y_TRAIN, Y_TEST, 20, seed=5, **params)
    c = make_partition(name, Y_TRAIN, Y_TEST, 20, seed=6, **params)
    for x, y in zip(a.train + a.test, b.train + b.test):
        assert np.array_equal(x, y)
    assert a.meta == b.meta
    assert (a.domains is None) == (b.domains is None)
    if a.domains is not None:
        assert np.array_equal(a.domains, b.domains)
    assert any(not np.array_equal(x, y) for x, y in zip(a.train, c.train))


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_min_sizes_respected(case):
    name, params = case
    part = make_partition(name, Y_TRAIN, Y_TEST, 20, seed=0, min_train=50, min_test=7, **params)
    assert part.n_train.min() >= 50
    assert part.n_test.min() >= 7


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_test_split_follows_train_pmf(case):
    name, params = case
    y_tr, y_te = _labels(60000, 10, skew=True), _labels(10000, 11, skew=True)
    part = make_partition(name, y_tr, y_te, 10, seed=1, **params)
    ratio = len(y_te) / len(y_tr)
    for tr, te in zip(part.train, part.test):
        assert abs(len(te) - round(len(tr) * ratio)) <= 1
        if len(te) >= 500:
            assert 0.5 * np.abs(_pmf(y_tr, tr) - _pmf(y_te, te)).sum() < 0.01


def test_test_split_disjoint_while_pool_lasts_then_reused():
    part = make_partition("dirichlet", Y_TRAIN, Y_TEST, 20, seed=0, alpha=0.5, test_ratio=0.05)
    flat = np.concatenate(part.test)
    assert np.unique(flat).size == flat.size
    assert part.meta["test_with_replacement"] is False and part.meta["test_reused_samples"] == 0

    small_test = Y_TEST[:200]
    part = make_partition("dirichlet", Y_TRAIN, small_test, 20, seed=0, alpha=0.5, test_ratio=0.2)
    assert part.meta["test_with_replacement"] is True
    assert part.meta["test_reused_classes"] and part.meta["test_reused_samples"] > 0
    for te in part.test:  # a client's own test set has no repeats while its demand fits the pool
        per_class = np.bincount(small_test[te], minlength=C)
        pool = np.bincount(small_test, minlength=C)
        if np.all(per_class <= pool):
            assert np.unique(te).size == te.size


def test_test_ratio_sets_size():
    part = make_partition("iid", Y_TRAIN, Y_TEST, 10, seed=0, test_ratio=0.1)
    assert np.all(np.abs(part.n_test - np.rint(part.n_train * 0.1)) <= 0)


def test_min_test_raises_small_test_splits_only():
    # unequal client sizes; test_ratio 0.02 gives round(0.02 n_i) < 7 test rows to the smaller clients:
    # they get 7, the others keep their rounded size
    part = make_partition("dirichlet_per_class", Y_TRAIN, Y_TEST, 20, seed=0, min_train=50, min_test=7,
                          alpha=0.5, test_ratio=0.02)
    want = np.maximum(np.rint(part.n_train * 0.02), 7)
    assert (np.rint(part.n_train * 0.02) < 7).any() and (np.rint(part.n_train * 0.02) > 7).any()
    assert part.n_test.tolist() == want.tolist()


def test_a_class_missing_from_the_test_set_is_left_out_of_every_test_split():
    # no test image of class 3: a client holding class 3 draws its test rows from its other classes only
    y_test = Y_TEST[Y_TEST != 3]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        part = make_partition("dirichlet", Y_TRAIN, y_test, 20, seed=0, alpha=0.1)
    holds_3 = [i for i, tr in enumerate(part.train) if (Y_TRAIN[tr] == 3).any()]
    assert holds_3
    for tr, te in zip(part.train, part.test):
        assert set(y_test[te].tolist()) <= set(Y_TRAIN[tr].tolist()) - {3}


def test_leftover_samples_go_to_holders_at_random():
    # 30 classes of 4 samples, each held by the same 3 clients: every class leaves one sample over, and the
    # client that gets it is drawn per class, so no client gets all 30 (nor none)
    alloc = _split_among_holders(np.random.default_rng(0), np.ones((3, 30), dtype=bool), np.full(30, 4))
    assert (alloc.sum(axis=0) == 4).all() and set(alloc.ravel().tolist()) == {1, 2}
    extras = (alloc == 2).sum(axis=1)
    assert extras.sum() == 30 and extras.min() > 0


def test_dirichlet_equal_sizes_and_skew():
    n_cl = 30
    part = make_partition("dirichlet", Y_TRAIN, Y_TEST, n_cl, seed=0, alpha=0.1)
    assert np.all(part.n_train == len(Y_TRAIN) // n_cl)
    rows = summarize(part, Y_TRAIN, C)
    assert np.mean([r["dominant_share"] for r in rows]) > 0.6
    iid_like = make_partition("dirichlet", Y_TRAIN, Y_TEST, n_cl, seed=0, alpha=1000.0)
    assert np.mean([r["dominant_share"] for r in summarize(iid_like, Y_TRAIN, C)]) < 0.2


def test_dirichlet_per_class_large_alpha_matches_global_shares():
    part = make_partition("dirichlet_per_class", Y_TRAIN, Y_TEST, 10, seed=0, alpha=1e6)
    glob = np.bincount(Y_TRAIN, minlength=C) / len(Y_TRAIN)
    for tr in part.train:
        assert np.abs(_pmf(Y_TRAIN, tr) - glob).max() < 0.02


def test_dirichlet_per_class_small_alpha_is_skewed_and_retries_recorded():
    part = make_partition("dirichlet_per_class", Y_TRAIN, Y_TEST, 20, seed=0, alpha=0.1, min_train=20)
    assert part.n_train.min() >= 20
    assert part.meta["num_redraws"] == 0                      # the first draw already gives >= 22 per client
    assert np.mean([r["dominant_share"] for r in summarize(part, Y_TRAIN, C)]) > 0.5
    # a minimum the first draws miss (their smallest client holds 22): the retries are counted, and the
    # accepted draw is the one after them (same seed: same count, same partition)
    hard = make_partition("dirichlet_per_class", Y_TRAIN, Y_TEST, 20, seed=0, alpha=0.1, min_train=40)
    assert hard.meta["num_redraws"] == 3 and hard.n_train.min() >= 40
    again = make_partition("dirichlet_per_class", Y_TRAIN, Y_TEST, 20, seed=0, alpha=0.1, min_train=40)
    assert again.meta["num_redraws"] == 3 and all(np.array_equal(a, b) for a, b in zip(hard.train, again.train))


@pytest.mark.parametrize("s", [1, 2, 3, 5])
def test_pathological_classes_variant_gives_exactly_s_classes(s):
    part = make_partition("pathological", Y_TRAIN, Y_TEST, 25, seed=2, shards_per_client=s, variant="classes")
    for r in summarize(part, Y_TRAIN, C):
        assert r["num_classes"] == s
    # classes are held about equally often
    holders = (part.hist(Y_TRAIN, C) > 0).sum(axis=0)
    assert holders.max() - holders.min() <= 1
    # test split has the same class set
    for tr, te in zip(part.train, part.test):
        assert set(np.unique(Y_TEST[te])) <= set(np.unique(Y_TRAIN[tr]))


def test_pathological_shards_sizes_and_class_counts():
    y = np.repeat(np.arange(C), 600)  # 6000 balanced, sorted shards never straddle oddly
    part = make_partition("pathological", y, Y_TEST, 100, seed=0, shards_per_client=2)
    assert np.all(part.n_train == 60)
    assert part.meta["shard_size"] == 30
    assert max(r["num_classes"] for r in summarize(part, y, C)) <= 2


def test_similarity_extremes():
    y = _labels(20000, 4)
    glob = np.bincount(y, minlength=C) / len(y)
    part = make_partition("similarity", y, Y_TEST, 10, seed=0, s=1.0)
    for tr in part.train:
        assert 0.5 * np.abs(_pmf(y, tr) - glob).sum() < 0.05
    balanced = np.random.default_rng(4).permutation(np.repeat(np.arange(C), 2000))
    for k in (4, 5, 10, 20, 40):
        part = make_partition("similarity", balanced, Y_TEST, k, seed=0, s=0.0)
        limit = math.ceil(C / k) + 1
        assert max(r["num_classes"] for r in summarize(part, balanced, C)) <= limit
    # S in between: IID share plus label-sorted slices, sizes equal
    part = make_partition("similarity", y, Y_TEST, 10, seed=0, s=0.5)
    assert np.all(part.n_train == 2000)


def test_domain_mix_domains_and_class_counts():
    part = make_partition("domain_mix", Y_TRAIN, Y_TEST, 22, seed=0, num_domains=4, min_classes=2,
                          max_classes=5)
    assert part.domains is not None and part.domains.dtype == np.int64 and part.domains.shape == (22,)
    counts = np.bincount(part.domains, minlength=4)
    assert counts.min() >= 5 and counts.max() - counts.min() <= 1
    k = [r["num_classes"] for r in summarize(part, Y_TRAIN, C)]
    assert min(k) >= 2 and max(k) <= 5 and len(set(k)) > 1
    rows = summarize(part, Y_TRAIN, C)
    assert [r["domain"] for r in rows] == part.domains.tolist()
    dom = part.train_sample_domains(len(Y_TRAIN))
    for i, tr in enumerate(part.train):
        assert np.all(dom[tr] == part.domains[i])


def test_summarize_and_histograms():
    part = make_partition("iid", Y_TRAIN, Y_TEST, 7, seed=0)
    rows = summarize(part, Y_TRAIN, C)
    assert [r["client"] for r in rows] == list(range(7))
    assert sum(r["n_train"] for r in rows) == len(Y_TRAIN)
    assert all("domain" not in r for r in rows)          # only partitions with domains have the key
    h = label_histograms(part.train, Y_TRAIN, C)
    assert h.shape == (7, C) and np.array_equal(h.sum(axis=0), np.bincount(Y_TRAIN, minlength=C))
    assert np.array_equal(part.hist(Y_TEST, C, "test").sum(axis=1), part.n_test)


def test_partitions_registry_lists_parameters():
    assert set(PARTITIONS) == {"iid", "dirichlet", "dirichlet_per_class", "pathological", "similarity",
                               "domain_mix", "natural", "quantity", "feature_noise", "user_shift"}
    assert set(PARTITIONS["natural"].params) == {"column"} and PARTITIONS["natural"].natural
    assert PARTITIONS["natural"].params["column"].new          # left out of run ids at its default
    assert PARTITIONS["dirichlet"].params["alpha"].default == 0.1
    assert PARTITIONS["dirichlet_per_class"].params["alpha"].default == 0.5
    assert PARTITIONS["pathological"].params["shards_per_client"].default == 2
    assert PARTITIONS["similarity"].params["s"].default == 0.5
    assert PARTITIONS["domain_mix"].params["num_domains"].default == 4


@pytest.mark.parametrize(
    "name, kwargs, needle",
    [
        ("iid", {"num_clients": 700}, "clients = 700 is not valid"),
        ("iid", {"num_clients": 0}, "clients = 0 is not valid"),
        ("dirichlet", {"alpha": 0}, "alpha"),
        ("dirichlet", {"alpha": -1.0}, "alpha"),
        ("dirichlet", {"alpha": float("inf")}, "alpha"),
        ("dirichlet", {"alpha": float("nan")}, "alpha"),
        ("dirichlet_per_class", {"alpha": 0.0}, "alpha"),
        ("dirichlet_per_class", {"alpha": 1e-3, "num_clients": 500, "max_tries": 3}, "min_train"),
        ("similarity", {"s": 1.5}, "partition.s"),
        ("similarity", {"s": -0.1}, "partition.s"),
        ("pathological", {"shards_per_client": 0}, "shards_per_client"),
        ("pathological", {"shards_per_client": 400, "num_clients": 20, "min_train": 1}, "shards_per_client"),
        ("pathological", {"shards_per_client": 11, "variant": "classes"}, "shards_per_client"),
        ("pathological", {"variant": "rows"}, "variant"),
        ("domain_mix", {"min_classes": 4, "max_classes": 3}, "max_classes"),
        ("domain_mix", {"max_classes": 11}, "max_classes"),
        ("domain_mix", {"num_domains": 9}, "num_domains"),
        ("iid", {"bogus": 1}, "bogus"),
        ("dirichlet", {"s": 0.5}, "alpha"),  # unknown key: the message lists the allowed ones
        ("iid", {"min_train": 0}, "min_train"),
        ("iid", {"seed": -1}, "seed"),
        ("iid", {"test_ratio": 0.0}, "test_ratio"),
    ],
)
def test_impossible_requests_raise_partition_error_naming_the_parameter(name, kwargs, needle):
    kw = {"num_clients": 20, "seed": 0, **kwargs}
    with pytest.raises(PartitionError) as err:
        make_partition(name, Y_TRAIN, Y_TEST, **kw)
    assert needle in str(err.value)


def test_unknown_partition_lists_allowed():
    with pytest.raises(PartitionError) as err:
        make_partition("dirichlett", Y_TRAIN, Y_TEST, 10, 0)
    msg = str(err.value)
    assert "dirichlett" in msg and all(n in msg for n in PARTITIONS)


def test_bad_labels_raise():
    with pytest.raises(PartitionError, match="y_train"):
        make_partition("iid", np.zeros((10, 2), dtype=int), Y_TEST, 1, 0, min_train=1)
    with pytest.raises(PartitionError, match="y_train"):
        make_partition("iid", np.array([0.5, 1.0, 2.0]), Y_TEST, 1, 0, min_train=1)


@pytest.mark.parametrize("name, params", [("iid", {}), ("dirichlet", {"alpha": 0.1}), ("pathological", {})])
def test_fast_on_60k_labels_1000_clients(name, params):
    y = np.random.default_rng(0).integers(0, C, 60000)
    yt = np.random.default_rng(1).integers(0, C, 10000)
    make_partition(name, y[:2000], yt[:500], 10, 0, **params)  # warm up
    t = time.perf_counter()
    part = make_partition(name, y, yt, 1000, 0, **params)
    assert time.perf_counter() - t < 1.0
    assert part.num_clients == 1000


def test_bench_script_runs_small():
    mod = load_script("bench/partition.py")
    times = mod.bench_partitions(n=3000, num_clients=50, num_classes=10, seed=0)
    assert set(times) >= {"iid", "dirichlet", "pathological"}
    assert all(v >= 0 for v in times.values() if v is not None)


# ----------------------------------------------------------------------------------------------------
# domains and plots
# ----------------------------------------------------------------------------------------------------


def _images(dtype=np.float32):
    rng = np.random.default_rng(0)
    x = rng.random((6, 3, 8, 8))
    return (x * 255).astype(np.uint8) if dtype == np.uint8 else x.astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.uint8])
@pytest.mark.parametrize("domain", range(len(DOMAINS)))
def test_apply_domain_keeps_shape_dtype_and_is_deterministic(domain, dtype):
    x = _images(dtype)
    a = apply_domain(x, domain, seed=3)
    b = apply_domain(x, domain, seed=3)
    assert a.shape == x.shape and a.dtype == x.dtype
    assert np.array_equal(a, b)
    assert a is not x
    if domain == 0:
        assert np.array_equal(a, x)
    else:
        assert not np.array_equal(a, x)


def test_domain_transform_properties():
    x = _images()
    r = x
    for _ in range(4):
        r = apply_domain(r, 1)
    assert np.array_equal(r, x)
    assert np.allclose(apply_domain(apply_domain(x, 2), 2), x, atol=1e-6)
    assert np.allclose(apply_domain(x, 2, value_range=(0, 1)), 1.0 - x)
    const = np.full((2, 1, 5, 5), 0.4, dtype=np.float32)
    assert np.allclose(apply_domain(const, 3), const)
    blurred = apply_domain(x, 3)
    assert np.isclose(blurred[0, 0, 3, 3], x[0, 0, 2:5, 2:5].mean(), atol=1e-6)
    n1, n2 = apply_domain(x, 4, seed=0, value_range=(0, 1)), apply_domain(x, 4, seed=1, value_range=(0, 1))
    assert not np.array_equal(n1, n2) and n1.min() >= 0.0 and n1.max() <= 1.0
    assert 0.03 < np.std(n1 - x) < 0.12
    # per-image transforms do not depend on the batch
    assert np.array_equal(apply_domain(x[:2], 1), apply_domain(x, 1)[:2])
    assert np.allclose(apply_domain(x[:2], 3), apply_domain(x, 3)[:2])
    # normalised float data: the range is the data's own, so inversion and noise stay inside it
    z = (x - 0.3) / 0.2
    for d in (2, 4):
        out = apply_domain(z, d)
        assert out.min() >= z.min() - 1e-5 and out.max() <= z.max() + 1e-5
    assert np.allclose(apply_domain(z, 2), z.min() + z.max() - z, atol=1e-5)
    # non-square images keep their shape
    assert apply_domain(np.zeros((1, 1, 4, 6)), 1).shape == (1, 1, 4, 6)


def test_apply_domains_per_sample_and_errors():
    x = _images()
    ids = np.array([0, 1, 2, -1, 1, 3])
    out = apply_domains(x, ids, seed=0, value_range=(0, 1))
    assert np.array_equal(out[0], x[0]) and np.array_equal(out[3], x[3])
    assert np.array_equal(out[[1, 4]], apply_domain(x[[1, 4]], 1))
    assert np.array_equal(out[5], apply_domain(x[5:6], 3)[0])
    assert np.allclose(out[2], 1.0 - x[2])
    with pytest.raises(ValueError, match="domain"):
        apply_domain(x, 7)
    with pytest.raises(ValueError, match="domain_ids"):
        apply_domains(x, ids[:3])


def test_plot_class_distribution_writes_png(tmp_path):
    part = make_partition("dirichlet", Y_TRAIN, Y_TEST, 30, seed=0, alpha=0.1)
    out = plot_class_distribution(part.hist(Y_TRAIN, C), tmp_path / "sub" / "fig.png", first=20,
                                  title="Dirichlet alpha=0.1")
    assert Path(out).exists() and Path(out).stat().st_size > 5000
    assert Path(out).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="first"):
        plot_class_distribution(part.hist(Y_TRAIN, C), tmp_path / "x.png", first=0)


# ---------------------------------------------------------------------------------- natural clients

GROUPS = np.random.default_rng(5).choice([4, 17, 30, 102], size=len(Y_TRAIN))
TEST_GROUPS = np.random.default_rng(6).choice([4, 17, 30, 102, 999], size=len(Y_TEST))   # 999: no train


def test_natural_gives_each_client_one_group_and_its_own_test_rows():
    part = make_partition("natural", Y_TRAIN, Y_TEST, 4, 0, groups=GROUPS, test_groups=TEST_GROUPS)
    assert part.meta["client_groups"] == [4, 17, 30, 102] and part.meta["partition"] == "natural"
    for c, g in enumerate([4, 17, 30, 102]):
        assert np.array_equal(part.train[c], np.flatnonzero(GROUPS == g))
        assert np.array_equal(part.test[c], np.flatnonzero(TEST_GROUPS == g))
        assert part.train[c].dtype == np.int64 and part.test[c].dtype == np.int64
    assert part.meta["n_test_unused"] == int((TEST_GROUPS == 999).sum()) > 0
    assert part.meta["n_train_unused"] == 0 and part.meta["test_with_replacement"] is False
    again = make_partition("natural", Y_TRAIN, Y_TEST, 4, 7, groups=GROUPS, test_groups=TEST_GROUPS)
    assert all(np.array_equal(a, b) for a, b in zip(part.train, again.train))     # the seed plays no part


@pytest.mark.parametrize("kwargs, needle", [
    ({}, "the data records none (datasets with natural clients: "),
    ({"groups": GROUPS}, "the data records none"),
    ({"groups": GROUPS[:-1], "test_groups": TEST_GROUPS}, "groups must give one user/device id per sample"),
    ({"groups": GROUPS.astype(float), "test_groups": TEST_GROUPS}, "integer user/device ids"),
    ({"groups": GROUPS, "test_groups": TEST_GROUPS, "num_clients": 3},
     "clients = 3 is not valid for partition 'natural': the data has 4 users/devices"),
    ({"groups": GROUPS, "test_groups": TEST_GROUPS, "test_ratio": 0.5},
     "test_ratio = 0.5 is not valid for partition 'natural'"),
    ({"groups": GROUPS, "test_groups": TEST_GROUPS, "min_train": 5000}, "min_train = 5000 is not reachable"),
    ({"groups": GROUPS, "test_groups": np.full(len(Y_TEST), 4), "min_test": 1},
     "min_test = 1 is not reachable: user 17 (client 1) has 0 test samples"),
])
def test_natural_refuses_what_it_cannot_do(kwargs, needle):
    kwargs = {"num_clients": 4, **kwargs}
    n = kwargs.pop("num_clients")
    with pytest.raises(PartitionError) as e:
        make_partition("natural", Y_TRAIN, Y_TEST, n, 0, **kwargs)
    assert needle in str(e.value)


def test_natural_on_the_synthetic_devices():
    from fedprism.data.datasets import load_dataset

    ds = load_dataset("synthetic", num_devices=6, seed=0)
    part = make_partition("natural", ds.y_train.numpy(), ds.y_test.numpy(), 6, 0, groups=ds.groups,
                          test_groups=ds.test_groups)
    assert [len(t) for t in part.train] == np.bincount(ds.groups).tolist()
    assert [len(t) for t in part.test] == np.bincount(ds.test_groups).tolist()
