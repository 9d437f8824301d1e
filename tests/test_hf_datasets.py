"""dataset=hf:NAME (fedprism.data.hf): small datasets saved by the tests with the `datasets` library's
save_to_disk, read back as fedprism datasets (images and tabular), the data.hf.* keys, natural partitions
on a named column, the refusals, and a run end to end."""

from __future__ import annotations

import subprocess
import sys

import datasets
import numpy as np
import pytest
import torch
from PIL import Image

from fedprism.data.datasets import load_dataset
from fedprism.errors import ConfigError, DataError
from fedprism.experiment.config import resolve

CLASSES = ["cat", "dog", "fox"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Two saved DatasetDicts: 8x8 grey images with a ClassLabel, a writer (string) and a site (int) column;
    and a tabular one with integer, float and string columns and integer labels 3 and 7."""
    root = tmp_path_factory.mktemp("hf")
    rng = np.random.default_rng(0)
    feats = datasets.Features({"img": datasets.Image(), "label": datasets.ClassLabel(names=CLASSES),
                               "writer": datasets.Value("string"), "site": datasets.Value("int64")})
    raw = {}
    splits = {}
    for split, n in (("train", 60), ("test", 30)):
        pixels = rng.integers(0, 256, (n, 8, 8), dtype=np.uint8)
        raw[split] = pixels
        splits[split] = datasets.Dataset.from_dict(
            {"img": [Image.fromarray(p) for p in pixels], "label": (np.arange(n) % 3).tolist(),
             "writer": [f"w{i % 4}" for i in range(n)], "site": [int(i % 2) for i in range(n)]}, features=feats)
    datasets.DatasetDict(splits).save_to_disk(str(root / "imgs"))
    tab = {}
    for split, n in (("train", 40), ("validation", 20)):
        tab[split] = datasets.Dataset.from_dict(
            {"age": rng.integers(18, 80, n).tolist(), "income": rng.normal(50.0, 10.0, n).tolist(),
             "city": [["Oslo", "Rome"][i % 2] for i in range(n)], "y": [[3, 7][i % 2] for i in range(n)]})
    datasets.DatasetDict(tab).save_to_disk(str(root / "tab"))
    datasets.Dataset.from_dict({"img": [Image.fromarray(p) for p in raw["train"][:12]],
                                "label": [i % 2 for i in range(12)]}).save_to_disk(str(root / "single"))
    return root, raw, tab


def test_images_are_scaled_and_standardised_by_the_train_split(saved):
    root, raw, _ = saved
    ds = load_dataset("hf:imgs", root=str(root))
    assert ds.classes == CLASSES and tuple(ds.x_train.shape) == (60, 1, 8, 8) and ds.input_shape == (1, 8, 8)
    x = raw["train"].astype(np.float32) / 255.0
    mean, std = x.mean(dtype=np.float64), x.std(dtype=np.float64)
    assert ds.mean == pytest.approx((mean,)) and ds.std == pytest.approx((std,))
    want = ((raw["test"].astype(np.float32) / 255.0 - mean) / std).astype(np.float32)
    assert torch.allclose(ds.x_test[:, 0], torch.from_numpy(want), atol=1e-6)
    assert ds.y_train.tolist() == (np.arange(60) % 3).tolist() and ds.y_train.dtype == torch.int64
    assert set(ds.columns) == {"writer", "site"} and ds.test_columns["writer"][:5].tolist() == ["w0", "w1", "w2",
                                                                                                 "w3", "w0"]
    # the folder itself as the name, no data.root
    same = load_dataset(f"hf:{root / 'imgs'}")
    assert torch.equal(same.x_train, ds.x_train)


def test_pad32_pads_before_standardising(saved):
    root, raw, _ = saved
    ds = load_dataset("hf:imgs", root=str(root), pad32=True)
    assert tuple(ds.x_train.shape[1:]) == (1, 32, 32)
    x = np.zeros((60, 32, 32), np.float32)
    x[:, 12:20, 12:20] = raw["train"] / 255.0
    assert ds.mean[0] == pytest.approx(x.mean(dtype=np.float64))


def test_tabular_features_and_string_labels(saved):
    root, _, tab = saved
    ds = load_dataset("hf:tab", root=str(root), features="age,income", label="y", test_split="validation")
    assert ds.classes == ["3", "7"] and ds.y_train.tolist() == [i % 2 for i in range(40)]
    age = np.array(tab["train"]["age"], dtype=np.float64)
    assert torch.allclose(ds.x_train[:, 0].double(), torch.from_numpy((age - age.mean()) / age.std()), atol=1e-5)
    assert tuple(ds.x_test.shape) == (20, 2) and set(ds.columns) == {"city"}


def test_a_carved_test_split_is_stratified_and_seeded(saved):
    root, _, _ = saved
    ds = load_dataset("hf:tab", root=str(root), features="age", label="y", test_split="", test_fraction=0.25)
    assert len(ds.y_test) == 10 and np.bincount(ds.y_test.numpy()).tolist() == [5, 5]      # round(0.25 * 20)
    again = load_dataset("hf:tab", root=str(root), features="age", label="y", test_split="", test_fraction=0.25)
    assert torch.equal(ds.x_test, again.x_test)


@pytest.mark.parametrize("kw, key, words", [
    ({"label": "lbl"}, "data.hf.label", ["a column of hf:imgs", "did you mean"]),
    ({"test_split": "tset"}, "data.hf.test_split", ["a split of hf:imgs: train, test", "did you mean"]),
    ({"train_split": "validation"}, "data.hf.train_split", ["train, test"]),
    ({"image": "picture"}, "data.hf.image", ["img, label, writer, site"]),
    ({"features": "site,writer"}, "data.hf.features", ["numeric columns; 'writer'", "site"]),
    ({"image": "img", "features": "site"}, "data.hf.features", ["when data.hf.image is set"]),
])
def test_refusals_name_the_key_the_value_and_what_exists(saved, kw, key, words):
    root, _, _ = saved
    with pytest.raises(ConfigError) as e:
        load_dataset("hf:imgs", root=str(root), **kw)
    assert e.value.key == key, e.value
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_more_refusals(saved, tmp_path):
    root, _, _ = saved
    with pytest.raises(ConfigError, match="'data.hf.image' = '' .*hf:tab has no Image column.*age, income"):
        load_dataset("hf:tab", root=str(root), label="y", test_split="validation")   # no image column, no features
    with pytest.raises(ConfigError, match="saved as one Dataset without splits"):
        load_dataset("hf:single", root=str(root))
    one = load_dataset("hf:single", root=str(root), test_split="", test_fraction=0.5)
    assert len(one.y_train) == len(one.y_test) == 6
    with pytest.raises(DataError, match="data.download=true"):
        load_dataset("hf:nowhere/at-all", root=str(tmp_path))
    with pytest.raises(ConfigError, match="hf:NAME"):
        resolve({"dataset": "hf:"})


def test_config_keys_feed_the_loader_and_the_run_id(saved):
    root, _, _ = saved
    plain = resolve({"dataset": "digits"})
    assert not any(k.startswith("data.hf.") for k in plain.identity)            # every stored run keeps its id
    a = resolve({"dataset": "hf:tab", "data.hf.features": "age", "data.hf.label": "y"})
    b = resolve({"dataset": "hf:tab", "data.hf.features": "age,income", "data.hf.label": "y"})
    assert a.identity["data.hf.features"] == "age" and a.run_id != b.run_id
    assert resolve({**a.values, "data.root": str(root)}).run_id == a.run_id       # where it lies is not identity
    with pytest.raises(ConfigError, match="data.hf.label.*only with dataset=.*hf:"):
        resolve({"dataset": "digits", "data.hf.label": "y"})


def test_a_run_on_a_natural_column_end_to_end(saved, tmp_path):
    root, _, _ = saved
    db = tmp_path / "r.db"
    args = [sys.executable, "-m", "fedprism", "run", "dataset=hf:imgs", f"data.root={root}", "partition=natural",
            "partition.column=writer", "clients=4", "model=mlp", "method=fedavg", "rounds=2", "local_epochs=1",
            "partition.min_train=5", "fraction=1.0", "--db", str(db)]
    r = subprocess.run(args, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    from fedprism.experiment.federation import build_federation
    cfg = resolve({"dataset": "hf:imgs", "data.root": str(root), "partition": "natural",
                   "partition.column": "writer", "clients": 4, "partition.min_train": 5})
    fed = build_federation(cfg)
    assert fed.n_train.tolist() == [15, 15, 15, 15] and fed.meta["client_groups"] == [0, 1, 2, 3]
    bad = subprocess.run(args[:-2] + ["partition.column=wrter", "--db", str(db)], capture_output=True, text=True)
    assert bad.returncode == 2 and "partition.column = 'wrter'" in bad.stderr and "writer" in bad.stderr
    bad = subprocess.run([a if a != "clients=4" else "clients=3" for a in args], capture_output=True, text=True)
    assert bad.returncode == 2 and "clients = 4" in bad.stderr


def test_flower_partitioners_split_as_they_do_themselves():
    from flwr_datasets.partitioner import DirichletPartitioner

    from fedprism.data.partitions import PARTITIONS, make_partition
    from fedprism.errors import PartitionError

    y, y_test, seed = np.arange(200) % 4, np.arange(40) % 4, 3
    part = make_partition("flwr:dirichlet", y, y_test, 4, seed=seed, min_train=5, alpha=0.5)
    # the seed the partitioner gets: the first draw of the run's partition stream
    inner = int(np.random.default_rng(np.random.SeedSequence(seed).spawn(2)[0]).integers(2**31 - 1))
    ref = DirichletPartitioner(num_partitions=4, partition_by="label", alpha=0.5, seed=inner)
    ref.dataset = datasets.Dataset.from_dict({"label": y, "_row": np.arange(200)})
    assert [p.tolist() for p in part.train] == [sorted(ref.load_partition(i)["_row"]) for i in range(4)]
    assert part.meta["partitioner"] == "DirichletPartitioner"
    same = make_partition("flwr:DirichletPartitioner", y, y_test, 4, seed=seed, min_train=5, alpha=0.5)
    assert [p.tolist() for p in same.train] == [p.tolist() for p in part.train]
    assert set(PARTITIONS["flwr:dirichlet"].params) == {"alpha", "min_partition_size", "self_balancing", "shuffle"}
    with pytest.raises(PartitionError, match="partition.alpha.*required by DirichletPartitioner"):
        make_partition("flwr:dirichlet", y, y_test, 4, seed=seed, min_train=5)
    with pytest.raises(ConfigError, match="did you mean dirichlet"):
        resolve({"partition": "flwr:dirichlt"})
    cfg = resolve({"partition": "flwr:pathological", "partition.num_classes_per_partition": 2, "clients": 5})
    assert cfg.partition_params["class_assignment_mode"] == "random"
    with pytest.raises(ConfigError, match="class_assignment_mode.*one of random, deterministic"):
        resolve({"partition": "flwr:pathological", "partition.num_classes_per_partition": 2,
                 "partition.class_assignment_mode": "rnd"})


def test_a_tabular_run_with_a_flower_partitioner(saved, tmp_path):
    from fedprism.experiment.runner import Experiment
    from fedprism.experiment.store import Store

    root, _, _ = saved
    cfg = resolve({"dataset": "hf:tab", "data.root": str(root), "data.hf.features": "age,income",
                   "data.hf.label": "y", "data.hf.test_split": "validation", "partition": "flwr:iid", "clients": 2,
                   "partition.min_train": 5, "model": "mlp", "method": "fedavg", "rounds": 2, "local_epochs": 1,
                   "fraction": 1.0, "keep_final": False})
    with Store(tmp_path / "t.db") as store:
        res = Experiment(cfg, store).run()
        assert res.status == "finished" and 0.0 <= res.final["global_acc"] <= 1.0
        assert [len(r) for r in store.round_metrics(cfg.run_id)] and store.run(cfg.run_id)["status"] == "finished"


@pytest.mark.parametrize("feature, rows", [
    (datasets.Array2D((8, 8), "uint8"), lambda p: p),
    (datasets.Sequence(datasets.Sequence(datasets.Value("uint8"))), lambda p: p.tolist()),
])
def test_array_images_are_named_by_the_no_image_error_and_read_with_data_hf_image(saved, tmp_path, feature, rows):
    """Images stored as arrays (no ``Image`` feature): the error names the column and the key that reads it;
    data.hf.image=<column> then reads the same pixels as the Image column of the same data."""
    _, raw, _ = saved
    feats = datasets.Features({"pix": feature, "vec": datasets.Sequence(datasets.Value("float32")),
                               "label": datasets.Value("int64")})
    datasets.DatasetDict({split: datasets.Dataset.from_dict(
        {"pix": rows(raw[split]), "vec": [[0.5, 1.0]] * len(raw[split]), "label": (np.arange(len(raw[split])) % 3).tolist()},
        features=feats) for split in ("train", "test")}).save_to_disk(str(tmp_path / "arr"))
    with pytest.raises(ConfigError, match=r"no Image column.*its array column\(s\) pix can hold images: "
                                          r"data\.hf\.image=pix reads one"):
        load_dataset("hf:arr", root=str(tmp_path))
    got = load_dataset("hf:arr", root=str(tmp_path), image="pix")
    ref = load_dataset("hf:imgs", root=str(saved[0]))
    assert torch.equal(got.x_train, ref.x_train) and torch.equal(got.x_test, ref.x_test)
