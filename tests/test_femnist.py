"""FEMNIST (LEAF): LEAF's JSON output and TensorFlow Federated's HDF5 files / archive give the same data,
pixels inverted to bright strokes, one natural client per writer, the archive's published SHA-256
enforced, and a 1-round run on generated files."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from _fakedata import isolate
from _leafdata import tff_archive, write_leaf_json, write_tff_h5

from fedprism.data import download as dl
from fedprism.data import integrity
from fedprism.data.datasets import load_dataset
from fedprism.data.sets import femnist
from fedprism.errors import DataError

pytestmark = pytest.mark.filterwarnings("ignore::fedprism.data.integrity.UnverifiedDataWarning")

WRITERS = {"f0003_41": (5, 2), "f0001_07": (4, 3), "f0102_33": (6, 1)}     # writer -> (train, test) samples


@pytest.fixture
def iso(monkeypatch, tmp_path):
    isolate(monkeypatch, tmp_path)
    monkeypatch.setattr(integrity, "_digests", {})
    return tmp_path


def writers(seed: int = 0) -> tuple[dict, dict]:
    """(train, test): writer -> (pixels [n, 28, 28] float in [0, 1] as k/255, labels [n])."""
    rng = np.random.default_rng(seed)
    out: tuple[dict, dict] = ({}, {})
    for w, counts in WRITERS.items():
        for split, n in enumerate(counts):
            px = rng.integers(0, 256, (n, 28, 28)) / 255.0
            out[split][w] = (px.astype(np.float32), rng.integers(0, 62, n))
    return out


def as_leaf(data: dict) -> dict:
    return {w: {"x": px.reshape(len(px), -1).astype(np.float64).tolist(), "y": y.tolist()}
            for w, (px, y) in data.items()}


def as_tff(data: dict) -> dict:
    return {w: {"pixels": px, "label": y.astype(np.int32)} for w, (px, y) in data.items()}


def expected(data: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Images (bright strokes, [0, 1]), labels and group ids (index of the writer among all writers,
    sorted) in the loader's order: writers by name."""
    names = sorted(WRITERS)
    xs, ys, gs = [], [], []
    for w in sorted(data):
        px, y = data[w]
        xs.append(((255 - np.rint(px * 255)) / 255.0).astype(np.float32)[:, None])
        ys.append(y)
        gs.append(np.full(len(y), names.index(w)))
    return np.concatenate(xs), np.concatenate(ys), np.concatenate(gs)


def write_h5(folder, data):
    tr = write_tff_h5(folder / femnist.H5[0], as_tff(data[0]))
    te = write_tff_h5(folder / femnist.H5[1], as_tff(data[1]))
    return tr, te


def check(ds, data):
    assert ds.classes == list(femnist.CLASSES) and ds.classes[:12] == list("0123456789AB") and ds.classes[-1] == "z"
    assert ds.input_shape == (1, 28, 28) and ds.x_train.dtype == torch.float32
    for split, d in (("train", data[0]), ("test", data[1])):
        x, y, g = expected(d)
        np.testing.assert_allclose(getattr(ds, f"x_{split}").numpy(), x, rtol=0, atol=1e-6)
        np.testing.assert_array_equal(getattr(ds, f"y_{split}").numpy(), y)
        np.testing.assert_array_equal(ds.groups if split == "train" else ds.test_groups, g)


def test_leaf_json_is_read_inverted_with_writers(iso):
    data = writers()
    write_leaf_json(iso / "leaf", as_leaf(data[0]), as_leaf(data[1]))
    ds = load_dataset("femnist", root=iso / "leaf")
    check(ds, data)
    assert "3 writers" in ds.source
    assert all(v.startswith("unverified") for v in ds.integrity.values()) and len(ds.integrity) == 4
    # one hand-checked pixel: 1.0 (white paper) becomes 0 (black background), 0.0 (ink) becomes 1
    px = data[0]["f0001_07"][0][0]
    assert ds.x_train[0, 0, 3, 5].item() == pytest.approx(1 - px[3, 5], abs=1e-6)


def test_tff_h5_and_its_archive_give_what_leaf_json_gives(iso):
    data = writers(1)
    write_leaf_json(iso / "leaf", as_leaf(data[0]), as_leaf(data[1]))
    tr, te = write_h5(iso / "h5", data)
    tff_archive(iso / "tar" / femnist.ARCHIVE, {f"datasets/{femnist.H5[0]}": tr, f"datasets/{femnist.H5[1]}": te})
    a = load_dataset("femnist", root=iso / "leaf", cache_dir=False)
    for folder in ("h5", "tar"):
        b = load_dataset("femnist", root=iso / folder, cache_dir=False)
        check(b, data)
        assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    load_dataset("femnist", root=iso / "tar")                # scratch: the cache folder
    assert (iso / "cache").is_dir() and not list((iso / "cache").rglob("*.h5")), \
        "the archive's members are extracted to scratch, then removed"


def test_pad32_pads_with_background_and_the_cache_is_used(iso, monkeypatch):
    data = writers(2)
    write_leaf_json(iso / "leaf", as_leaf(data[0]), as_leaf(data[1]))
    ds = load_dataset("femnist", root=iso / "leaf", pad32=True)
    assert ds.input_shape == (1, 32, 32) and float(ds.x_train[:, :, :2].abs().max()) == 0.0
    monkeypatch.setattr(femnist, "decode", lambda *a: (_ for _ in ()).throw(AssertionError("decoded again")))
    again = load_dataset("femnist", root=iso / "leaf")
    check(again, data)


def test_malformed_leaf_files_are_refused_naming_the_file(iso):
    data = writers(3)
    folder = write_leaf_json(iso / "leaf", as_leaf(data[0]), as_leaf(data[1]))
    bad = sorted((folder / "data" / "train").glob("*.json"))[0]
    text = bad.read_text()
    bad.write_text(text[:-10])
    with pytest.raises(DataError, match="cannot read LEAF JSON") as e:
        load_dataset("femnist", root=folder, cache_dir=False)
    assert str(bad) in str(e.value)
    bad.write_text(text.replace('"num_samples": [', '"num_samples": [1, ', 1))
    with pytest.raises(DataError, match="'users' and 'num_samples' must be lists of one length"):
        load_dataset("femnist", root=folder, cache_dir=False)
    leaf = as_leaf(data[0])
    leaf["f0003_41"]["x"][0] = leaf["f0003_41"]["x"][0][:100]
    write_leaf_json(iso / "leaf2", leaf, as_leaf(data[1]))
    with pytest.raises(DataError, match="'x' is not a list of 784 numbers|784 values"):
        load_dataset("femnist", root=iso / "leaf2", cache_dir=False)
    leaf = as_leaf(data[0])
    leaf["f0003_41"]["y"][0] = 62
    write_leaf_json(iso / "leaf3", leaf, as_leaf(data[1]))
    with pytest.raises(DataError, match=r"labels must be integers in 0..61"):
        load_dataset("femnist", root=iso / "leaf3", cache_dir=False)
    (iso / "leaf4" / "data" / "train").mkdir(parents=True)
    (iso / "leaf4" / "data" / "train" / "a.json").write_text(text)
    with pytest.raises(DataError, match="lack test/\\*.json"):
        load_dataset("femnist", root=iso / "leaf4")


def test_the_archive_is_checked_against_tffs_published_sha256(tmp_path, monkeypatch):
    """Without the isolation that forgets known digests: a generated archive is not TFF's, refused with
    the published digest named, before anything is decoded."""
    monkeypatch.setenv("FEDPRISM_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("FEDPRISM_DATA", raising=False)
    monkeypatch.setattr(integrity, "_digests", {})
    tr, te = write_h5(tmp_path / "h5", writers())
    arch = tff_archive(tmp_path / "d" / femnist.ARCHIVE, {femnist.H5[0]: tr, femnist.H5[1]: te})
    monkeypatch.setattr(femnist, "decode", lambda *a: (_ for _ in ()).throw(AssertionError("decoded")))
    with pytest.raises(DataError) as e:
        load_dataset("femnist", root=tmp_path / "d")
    msg = str(e.value)
    assert str(arch) in msg and "SHA-256 mismatch" in msg and femnist.TFF_SHA256 in msg
    assert dl.file_digests(arch)["sha256"] in msg


def test_download_fetches_tffs_archive_and_refuses_a_mismatch(iso):
    calls = []

    def opener(url, timeout):
        calls.append(url)
        return io.BytesIO(b"not the archive")

    with pytest.raises(DataError, match="SHA256 mismatch: expected " + femnist.TFF_SHA256):
        dl.download("femnist", opener=opener)
    assert calls == ["https://storage.googleapis.com/tff-datasets-public/fed_emnist.tar.bz2"]
    assert not dl.download_dir("femnist").exists()


def test_a_one_round_natural_run_on_the_generated_files(iso):
    from fedprism.cli import main
    from fedprism.experiment.config import resolve
    from fedprism.experiment.federation import build_federation

    data = writers(4)
    write_leaf_json(iso / "leaf", as_leaf(data[0]), as_leaf(data[1]))
    cfg = {"dataset": "femnist", "partition": "natural", "clients": 3, "model": "mlp", "method": "fedavg",
           "rounds": 1, "local_epochs": 1, "partition.min_train": 1, "batch_size": 4, "data.root": str(iso / "leaf")}
    fed = build_federation(resolve(cfg))
    assert fed.meta["client_groups"] == [0, 1, 2]
    for c, w in enumerate(sorted(WRITERS)):
        assert (len(fed.train_idx[c]), len(fed.test_idx[c])) == WRITERS[w]
    assert main(["run", "--db", str(iso / "r.db"), *(f"{k}={v}" for k, v in cfg.items()), "--quiet"]) == 0


def test_leaf_files_that_contradict_themselves_are_refused(iso):
    data = writers(5)
    leaf = as_leaf(data[0])
    leaf["f0001_07"]["x"][0][17] = 1.5
    write_leaf_json(iso / "a", leaf, as_leaf(data[1]))
    with pytest.raises(DataError, match=r"pixel values must lie in \[0, 1\], found 0.0..1.5"):
        load_dataset("femnist", root=iso / "a", cache_dir=False)
    folder = write_leaf_json(iso / "b", as_leaf(data[0]), as_leaf(data[1]))
    f = sorted((folder / "data" / "train").glob("*.json"))[0]
    obj = json.loads(f.read_text())
    obj["num_samples"][0] += 1
    f.write_text(json.dumps(obj))
    with pytest.raises(DataError, match=f"user {obj['users'][0]!r} has num_samples"):
        load_dataset("femnist", root=folder, cache_dir=False)
    obj["num_samples"][0] -= 1
    f.write_text(json.dumps(obj))
    g = sorted((folder / "data" / "train").glob("*.json"))[1]
    other = json.loads(g.read_text())
    other["users"].append(obj["users"][0])
    other["num_samples"].append(obj["num_samples"][0])
    other["user_data"][obj["users"][0]] = obj["user_data"][obj["users"][0]]
    g.write_text(json.dumps(other))
    with pytest.raises(DataError, match="appears in two files of the same split"):
        load_dataset("femnist", root=folder, cache_dir=False)


def test_an_archive_with_a_link_or_a_missing_member_is_refused(iso):
    import tarfile

    tr, te = write_h5(iso / "h5", writers(6))
    arch = iso / "d" / femnist.ARCHIVE
    arch.parent.mkdir()
    with tarfile.open(arch, "w:bz2") as tar:
        tar.add(tr, arcname=femnist.H5[0])
        link = tarfile.TarInfo(femnist.H5[1])
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    with pytest.raises(DataError, match="member 'fed_emnist_test.h5' is not a regular file; refusing it"):
        load_dataset("femnist", root=iso / "d")
    tff_archive(arch, {femnist.H5[0]: tr})
    with pytest.raises(DataError, match="the archive lacks fed_emnist_test.h5"):
        load_dataset("femnist", root=iso / "d")
    assert not [p for p in (iso / "cache").rglob("*") if p.suffix == ".h5"]     # scratch copies removed


def test_natural_partition_names_femnist_among_the_datasets_with_natural_clients():
    from fedprism.data.partition import make_partition
    from fedprism.errors import PartitionError

    with pytest.raises(PartitionError) as e:
        make_partition("natural", np.zeros(4, np.int64), np.zeros(2, np.int64), 2, 0)
    listed = str(e.value).split("natural clients: ")[1].rstrip(")").split(", ")
    assert "femnist" in listed and "shakespeare" in listed and "sent140" in listed and "wisdm" in listed
