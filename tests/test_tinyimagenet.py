"""Tiny-ImageNet: the CS231n layout of JPEGs, zipped or extracted, decoded with Pillow (greyscale ones to
RGB), the labelled validation images as the test split, the archive's MD5 enforced, and a 1-round run,
all on generated files in the real layout."""

from __future__ import annotations

import io
import zipfile

import numpy as np
import pytest
import torch
from _fakedata import isolate
from _leafdata import jpeg, write_tiny_imagenet

from fedprism.data import download as dl
from fedprism.data import integrity
from fedprism.data.datasets import load_dataset
from fedprism.data.sets import tinyimagenet as tin
from fedprism.errors import DataError

pytestmark = pytest.mark.filterwarnings("ignore::fedprism.data.integrity.UnverifiedDataWarning")

WNIDS = [f"n{1443537 + 7 * i:08d}" for i in range(tin.NUM_CLASSES)]


@pytest.fixture
def iso(monkeypatch, tmp_path):
    isolate(monkeypatch, tmp_path)
    monkeypatch.setattr(integrity, "_digests", {})
    return tmp_path


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """One copy in both forms: 2 train and 1 val image per class (600 small JPEGs), train image 5 grey."""
    base = tmp_path_factory.mktemp("tin")
    folder = write_tiny_imagenet(base / "f", WNIDS, per_class=2, val_per_class=1, gray=5)
    zipped = write_tiny_imagenet(base / "z", WNIDS, per_class=2, val_per_class=1, gray=5, zipped=True)
    return folder, zipped


def colours(ds, split):
    x = ds.denormalize(getattr(ds, f"x_{split}")).numpy() * 255
    return x.mean(axis=(2, 3))


def test_zip_and_folder_decode_to_the_images_written(iso, small):
    folder, zipped = small
    a = load_dataset("tinyimagenet", root=folder["path"].parent, cache_dir=False)
    b = load_dataset("tinyimagenet", root=zipped["path"].parent, cache_dir=False)
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    assert a.input_shape == (3, 64, 64) and a.num_classes == 200
    assert a.classes[0] == f"class {WNIDS[0][-3:]}" and len(set(a.classes)) == 200   # first name of words.txt
    np.testing.assert_array_equal(a.y_train.numpy(), folder["train_labels"])
    np.testing.assert_array_equal(a.y_test.numpy(), folder["val_labels"])
    np.testing.assert_allclose(colours(a, "train"), folder["train_colours"], atol=2.5)   # JPEG rounding
    np.testing.assert_allclose(colours(a, "test"), folder["val_colours"], atol=2.5)
    grey = a.denormalize(a.x_train[5:6])[0]
    assert torch.allclose(grey[0], grey[1], atol=1e-6) and torch.allclose(grey[1], grey[2], atol=1e-6)


def test_validation_order_is_by_file_name_and_wnids_order_gives_the_labels(iso, tmp_path):
    wnids = list(reversed(WNIDS))
    fake = write_tiny_imagenet(tmp_path / "r", wnids, per_class=1, val_per_class=1, seed=3)
    ds = load_dataset("tinyimagenet", root=tmp_path / "r", cache_dir=False)
    np.testing.assert_array_equal(ds.y_test.numpy(), fake["val_labels"])
    assert ds.classes[0] == f"class {wnids[0][-3:]}"
    np.testing.assert_allclose(colours(ds, "test"), fake["val_colours"], atol=2.5)


def test_damaged_copies_are_refused_naming_the_file(iso, tmp_path):
    fake = write_tiny_imagenet(tmp_path / "d", WNIDS, per_class=1, val_per_class=1)
    root = fake["path"]
    img = root / "train" / WNIDS[3] / "images" / f"{WNIDS[3]}_0.JPEG"
    good = img.read_bytes()
    img.write_bytes(good[:40])
    with pytest.raises(DataError, match="cannot decode the JPEG") as e:
        load_dataset("tinyimagenet", root=tmp_path / "d", cache_dir=False)
    assert str(img) in str(e.value)
    from PIL import Image
    buf = io.BytesIO()
    Image.new("RGB", (32, 32)).save(buf, format="JPEG")
    img.write_bytes(buf.getvalue())
    with pytest.raises(DataError, match="a 32x32 image; Tiny-ImageNet images are 64x64"):
        load_dataset("tinyimagenet", root=tmp_path / "d", cache_dir=False)
    img.write_bytes(good)
    ann = root / "val" / "val_annotations.txt"
    ann.write_text(ann.read_text().replace(WNIDS[0], "n99999999", 1))
    with pytest.raises(DataError, match="val_annotations.txt line 1 is not"):
        load_dataset("tinyimagenet", root=tmp_path / "d", cache_dir=False)
    (root / "wnids.txt").write_text("\n".join(WNIDS[:199]))
    with pytest.raises(DataError, match="wnids.txt lists 199 WordNet ids"):
        load_dataset("tinyimagenet", root=tmp_path / "d", cache_dir=False)


def test_the_archive_is_checked_against_its_md5(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDPRISM_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("FEDPRISM_DATA", raising=False)
    monkeypatch.setattr(integrity, "_digests", {})
    arch = tmp_path / "d" / tin.ARCHIVE
    arch.parent.mkdir()
    with zipfile.ZipFile(arch, "w") as z:
        z.writestr("tiny-imagenet-200/wnids.txt", "\n".join(WNIDS))
        z.writestr("tiny-imagenet-200/val/images/val_0.JPEG", jpeg(np.zeros((64, 64, 3), np.uint8)))
    monkeypatch.setattr(tin, "decode", lambda *a: (_ for _ in ()).throw(AssertionError("decoded")))
    with pytest.raises(DataError) as e:
        load_dataset("tinyimagenet", root=tmp_path / "d")
    msg = str(e.value)
    assert str(arch) in msg and "MD5 mismatch" in msg and tin.MD5 in msg and dl.file_digests(arch)["md5"] in msg


def test_download_refuses_a_mismatch_and_keeps_nothing(iso):
    calls = []

    def opener(url, timeout):
        calls.append(url)
        return io.BytesIO(b"PK not it")

    with pytest.raises(DataError, match="MD5 mismatch: expected " + tin.MD5):
        dl.download("tinyimagenet", opener=opener)
    assert calls == ["http://cs231n.stanford.edu/tiny-imagenet-200.zip"]
    assert not dl.download_dir("tinyimagenet").exists()


def test_a_one_round_run_on_the_generated_zip(iso, small, monkeypatch):
    from fedprism.cli import main

    _, zipped = small
    run = ["dataset=tinyimagenet", "partition=iid", "clients=2", "model=mlp", "method=fedavg", "rounds=1",
           "local_epochs=1", "batch_size=16", "partition.min_train=1", f"data.root={zipped['path'].parent}"]
    assert main(["run", "--db", str(iso / "r.db"), *run, "--quiet"]) == 0
    (cache,) = (iso / "cache" / "decoded").glob("tinyimagenet-*.npz")          # decoded once, then cached
    monkeypatch.setattr(tin, "decode", lambda *a: (_ for _ in ()).throw(AssertionError("decoded again")))
    assert load_dataset("tinyimagenet", root=zipped["path"].parent).num_classes == 200
