"""Dataset loaders and downloads: exact round trips on tiny fake files, clear errors, cache, checksums."""

from __future__ import annotations

import bz2
import hashlib
import io
import os
import pickle
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from _fakedata import (
    FMNIST_CLASSES,
    idx_bytes,
    isolate,
    search_folders,
    write_cifar,
    write_fake,
    write_idx,
    write_idx_dataset,
    write_svhn,
    write_usps,
)

from fedprism.data import datasets, formats
from fedprism.data import download as dl
from fedprism.data.datasets import DATASETS, NORMALIZATION, load_dataset, read_idx, search_paths
from fedprism.errors import ConfigError, DataError


#: fake files have no known digests: each is (correctly) reported unverified; tests/test_data_integrity.py
#: covers that report
pytestmark = pytest.mark.filterwarnings("ignore::fedprism.data.integrity.UnverifiedDataWarning")


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    """No test reads or writes the real ~/.cache, $FEDPRISM_DATA or Debian's dataset folder."""
    isolate(monkeypatch, tmp_path)


def _pixels(ds, x: torch.Tensor) -> np.ndarray:
    """Normalised images back to the uint8 pixels they came from."""
    return torch.round(ds.denormalize(x) * 255).to(torch.int64).numpy()


def _assert_same(ds, fake, shape: tuple[int, ...]) -> None:
    assert ds.x_train.dtype == torch.float32 and ds.y_train.dtype == torch.int64
    assert ds.input_shape == shape
    np.testing.assert_array_equal(_pixels(ds, ds.x_train), fake.x_train)
    np.testing.assert_array_equal(_pixels(ds, ds.x_test), fake.x_test)
    np.testing.assert_array_equal(ds.y_train.numpy(), fake.y_train)
    np.testing.assert_array_equal(ds.y_test.numpy(), fake.y_test)
    assert ds.classes == fake.classes


# ----------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("name", ["fmnist", "mnist"])
@pytest.mark.parametrize("gz", [True, False])
def test_idx_round_trip(tmp_path, name, gz):
    fake = write_fake(name, tmp_path / "d", gz=gz)
    ds = load_dataset(name, root=tmp_path / "d")
    _assert_same(ds, fake, (1, 28, 28))
    assert ds.num_classes == 10 and ds.groups is None
    assert ds.mean == NORMALIZATION[name][0] and ds.std == NORMALIZATION[name][1]
    expected = (fake.x_train[:, :, 0, 0] / 255 - ds.mean[0]) / ds.std[0]
    np.testing.assert_allclose(ds.x_train[:, :, 0, 0].numpy(), expected, rtol=1e-6, atol=1e-6)
    if name == "fmnist":
        assert ds.classes == FMNIST_CLASSES


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
@pytest.mark.parametrize("archive", [False, True])
def test_cifar_round_trip(tmp_path, name, archive):
    fake = write_cifar(tmp_path / "d", name, archive=archive)
    ds = load_dataset(name, root=tmp_path / "d", cache_dir=tmp_path / "c")
    _assert_same(ds, fake, (3, 32, 32))
    assert ds.num_classes == (10 if name == "cifar10" else 100)
    if name == "cifar10":
        assert ds.classes[:2] == ["airplane", "automobile"]
    # the archive was extracted into the cache only for decoding: just the decoded .npz stays
    assert [p.name for p in (tmp_path / "c").iterdir()] == ["decoded"]


def test_cifar_folder_given_directly(tmp_path):
    fake = write_cifar(tmp_path / "d", "cifar10")
    ds = load_dataset("cifar10", root=tmp_path / "d" / "cifar-10-batches-py")
    _assert_same(ds, fake, (3, 32, 32))


def test_svhn_round_trip_maps_label_10_to_0(tmp_path):
    fake = write_svhn(tmp_path / "d")
    assert (fake.y_train == 0).any()  # stored as 10 in the .mat file
    ds = load_dataset("svhn", root=tmp_path / "d")
    _assert_same(ds, fake, (3, 32, 32))


@pytest.mark.parametrize("compress", [True, False])
def test_usps_round_trip(tmp_path, compress):
    fake = write_usps(tmp_path / "d", compress=compress)
    ds = load_dataset("usps", root=tmp_path / "d")
    _assert_same(ds, fake, (1, 16, 16))
    assert {0, 127, 255} <= set(np.unique(fake.x_train).tolist())      # both ends and an absent index
    assert ds.num_classes == 10 and ds.classes == [str(i) for i in range(10)]
    assert (ds.mean, ds.std) == NORMALIZATION["usps"]
    assert load_dataset("usps", root=tmp_path / "d", pad32=True).input_shape == (1, 32, 32)


def test_usps_labels_and_pixels_follow_the_libsvm_convention(tmp_path):
    """Label k is digit k - 1; value v is pixel uint8((v + 1) / 2 * 255); an absent index is 0."""
    (tmp_path / "d").mkdir()
    train = "1 1:-1 2:1 3:0.5 256:-0.5 \n10 2:0.999 \n"
    (tmp_path / "d" / "usps.bz2").write_bytes(bz2.compress(train.encode()))
    (tmp_path / "d" / "usps.t.bz2").write_bytes(bz2.compress(b"5 1:0\n"))
    x, y = datasets.read_usps(tmp_path / "d" / "usps.bz2")
    assert y.tolist() == [0, 9] and x.shape == (2, 1, 16, 16) and x.dtype == np.uint8
    assert x[0, 0, 0, :4].tolist() == [0, 255, 191, 127] and x[0, 0, 15, 15] == 63
    assert x[1, 0, 0, :3].tolist() == [127, 254, 127]
    ds = load_dataset("usps", root=tmp_path / "d", cache_dir=False)
    assert ds.y_test.tolist() == [4]


@pytest.mark.parametrize("line, needle", [
    ("0 1:0.5", "label 0 is out of range; USPS labels are 1..10"),
    ("11 1:0.5", "label 11 is out of range"),
    ("x 1:0.5", "label 'x' is not an integer"),
    ("3 1:0.5 1:0.2", "feature index 1 is not valid: indices run 1..256, increasing"),
    ("3 257:0.5", "feature index 257 is not valid"),
    ("3 0:0.5", "feature index 0 is not valid"),
    ("3 1=0.5", "feature '1=0.5' is not index:value"),
    ("3 1:1.5", "feature 1 = '1.5' is outside [-1, 1]"),
    ("3 1:nan", "feature 1 = 'nan' is outside [-1, 1]"),
])
def test_usps_malformed_line_names_file_line_and_token(tmp_path, line, needle):
    write_usps(tmp_path / "d")
    p = tmp_path / "d" / "usps.t.bz2"
    good = bz2.decompress(p.read_bytes()).decode().splitlines(keepends=True)
    p.write_bytes(bz2.compress("".join(good[:4] + [line + "\n"] + good[4:]).encode()))
    with pytest.raises(DataError) as e:
        load_dataset("usps", root=tmp_path / "d")
    assert f"{p}: line 5: " in str(e.value) and needle in str(e.value)


def test_truncated_and_corrupt_usps(tmp_path):
    write_usps(tmp_path / "d")
    p = tmp_path / "d" / "usps.bz2"
    p.write_bytes(p.read_bytes()[:-40])                                 # cut inside the bzip2 stream
    with pytest.raises(DataError, match="corrupt or truncated bzip2 stream") as e:
        load_dataset("usps", root=tmp_path / "d")
    assert str(p) in str(e.value)

    write_usps(tmp_path / "d")
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF                                        # a flipped byte: CRC / stream error
    p.write_bytes(bytes(data))
    with pytest.raises(DataError, match="bzip2") as e:
        load_dataset("usps", root=tmp_path / "d")
    assert str(p) in str(e.value)

    p.write_bytes(bz2.compress(b""))
    with pytest.raises(DataError, match="no samples") as e:
        load_dataset("usps", root=tmp_path / "d")
    assert str(p) in str(e.value)

    p.write_bytes(b"\x89PNG\r\n\x1a\n")
    with pytest.raises(DataError, match="not ASCII") as e:
        load_dataset("usps", root=tmp_path / "d")
    assert str(p) in str(e.value)


def test_usps_missing_file_is_named(tmp_path):
    write_usps(tmp_path / "d")
    (tmp_path / "d" / "usps.t.bz2").unlink()
    with pytest.raises(DataError, match=r"incomplete: missing usps\.t\[\.bz2\]"):
        load_dataset("usps", root=tmp_path / "d")


def test_pad32_pads_raw_zero_then_normalises(tmp_path):
    fake = write_fake("fmnist", tmp_path / "d")
    plain = load_dataset("fmnist", root=tmp_path / "d")
    padded = load_dataset("fmnist", root=tmp_path / "d", pad32=True)
    assert padded.input_shape == (1, 32, 32)
    assert torch.equal(padded.x_train[:, :, 2:30, 2:30], plain.x_train)
    background = -padded.mean[0] / padded.std[0]
    border = torch.cat([padded.x_train[:, :, :2].flatten(), padded.x_train[:, :, -2:].flatten(),
                        padded.x_train[:, :, :, :2].flatten(), padded.x_train[:, :, :, -2:].flatten()])
    assert torch.allclose(border, torch.full_like(border, background), rtol=0, atol=1e-6)
    assert _pixels(padded, padded.x_test)[:, :, 2:30, 2:30].tolist() == fake.x_test.tolist()


# ---------------------------------------------------------------------------------- corrupt files


def test_truncated_idx_raw_and_gz(tmp_path):
    write_idx_dataset(tmp_path / "raw", gz=False)
    p = tmp_path / "raw" / "train-images-idx3-ubyte"
    p.write_bytes(p.read_bytes()[:-100])
    with pytest.raises(DataError, match="truncated") as e:
        load_dataset("mnist", root=tmp_path / "raw")
    assert str(p) in str(e.value) and "need" in str(e.value)

    write_idx_dataset(tmp_path / "gz")
    q = tmp_path / "gz" / "t10k-images-idx3-ubyte.gz"
    q.write_bytes(q.read_bytes()[:-30])  # cut inside the gzip stream
    with pytest.raises(DataError, match="gzip") as e:
        load_dataset("mnist", root=tmp_path / "gz")
    assert str(q) in str(e.value)


def test_idx_wrong_magic_and_trailing_bytes(tmp_path):
    write_idx_dataset(tmp_path / "d")
    p = tmp_path / "d" / "train-labels-idx1-ubyte.gz"
    write_idx(p, np.zeros((30, 28, 28), np.uint8))  # an image file where labels belong
    with pytest.raises(DataError, match="magic number 0x00000803") as e:
        load_dataset("mnist", root=tmp_path / "d")
    assert str(p) in str(e.value) and "expected 0x00000801" in str(e.value)

    raw = tmp_path / "x.idx"
    raw.write_bytes(idx_bytes(np.arange(5, dtype=np.uint8)) + b"junk")
    with pytest.raises(DataError, match="4 unexpected bytes"):
        read_idx(raw, ndim=1)
    raw.write_bytes(b"\x00\x00")
    with pytest.raises(DataError, match="truncated"):
        read_idx(raw)


def test_idx_label_count_mismatch(tmp_path):
    write_idx_dataset(tmp_path / "d", n_train=30)
    lab = tmp_path / "d" / "train-labels-idx1-ubyte.gz"
    write_idx(lab, np.zeros(29, np.uint8))
    with pytest.raises(DataError, match="29 labels but .* has 30 images") as e:
        load_dataset("fmnist", root=tmp_path / "d")
    assert str(lab) in str(e.value)


def test_label_out_of_range(tmp_path):
    write_idx_dataset(tmp_path / "d")
    write_idx(tmp_path / "d" / "t10k-labels-idx1-ubyte.gz", np.full(12, 10, np.uint8))
    with pytest.raises(DataError, match=r"labels must lie in 0\.\.9"):
        load_dataset("mnist", root=tmp_path / "d")


@pytest.mark.parametrize("name", ["mnist", "fmnist"])
def test_idx_files_of_another_image_size_or_empty_are_refused(tmp_path, name):
    """IDX files of 5x5 images are not MNIST, whatever their names say; an empty test split is no split."""
    write_idx_dataset(tmp_path / "small", size=5)
    with pytest.raises(DataError, match=f"train images are 1x5x5 .*; {name} images are 1x28x28"):
        load_dataset(name, root=tmp_path / "small")
    write_idx_dataset(tmp_path / "empty", n_test=0)
    with pytest.raises(DataError, match="the test split holds no images"):
        load_dataset(name, root=tmp_path / "empty")


@pytest.mark.parametrize("name", ["digits", "synthetic"])
def test_built_in_datasets_say_that_they_ignore_a_root(tmp_path, name):
    with pytest.warns(UserWarning, match=f"dataset {name} is built in .*data.root '.*nowhere' is not read"):
        load_dataset(name, root=tmp_path / "nowhere")


def test_truncated_and_hostile_pickles(tmp_path):
    write_cifar(tmp_path / "d", "cifar10")
    p = tmp_path / "d" / "cifar-10-batches-py" / "data_batch_3"
    p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2])
    with pytest.raises(DataError, match="cannot unpickle") as e:
        load_dataset("cifar10", root=tmp_path / "d")
    assert str(p) in str(e.value) and "truncated" in str(e.value)

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    p.write_bytes(pickle.dumps({b"data": Evil()}, protocol=2))
    with pytest.raises(DataError, match="refusing global"):
        load_dataset("cifar10", root=tmp_path / "d")


def test_forged_headers_and_fields_are_data_errors(tmp_path):
    """An IDX header whose dimensions overflow int64, and CIFAR batches whose labels or data are not arrays
    of integers, are refused as corrupt files (no ValueError / OverflowError traceback)."""
    raw = tmp_path / "huge.idx"
    raw.write_bytes(bytes([0, 0, 0x08, 3]) + (2 ** 31).to_bytes(4, "big") * 3 + b"\x00" * 16)
    with pytest.raises(DataError, match="truncated"):
        read_idx(raw)
    write_cifar(tmp_path / "d", "cifar10")
    p = tmp_path / "d" / "cifar-10-batches-py" / "data_batch_2"
    good = pickle.loads(p.read_bytes(), encoding="bytes")
    for labels, data in ((["a"] * 10, None), ({"x": 1}, None), ([2 ** 70] * 10, None), (None, [[1, 2], [3]])):
        bad = dict(good)
        if labels is not None:
            bad[b"labels"] = labels
        if data is not None:
            bad[b"data"] = data
        p.write_bytes(pickle.dumps(bad, protocol=2))
        with pytest.raises(DataError) as e:
            load_dataset("cifar10", root=tmp_path / "d")
        assert str(p) in str(e.value), (labels, data)


def _edit_cifar_batch(edit):
    def damage(folder: Path) -> Path:
        p = folder / "cifar-10-batches-py" / "data_batch_2"
        batch = pickle.loads(p.read_bytes(), encoding="bytes")
        p.write_bytes(pickle.dumps(edit(batch), protocol=2))
        return p
    return damage


def _edit_cifar_meta(folder: Path) -> Path:
    p = folder / "cifar-10-batches-py" / "batches.meta"
    meta = pickle.loads(p.read_bytes(), encoding="bytes")
    p.write_bytes(pickle.dumps({**meta, b"label_names": meta[b"label_names"][:9]}, protocol=2))
    return p


@pytest.mark.parametrize("damage, needle", [
    (_edit_cifar_batch(lambda b: [b[b"data"]]), "expected a dict, found list; not a CIFAR file"),
    (_edit_cifar_batch(lambda b: {k: v for k, v in b.items() if k != b"labels"}),
     "not a CIFAR batch: needs 'data' and 'labels', has batch_label, data, filenames"),
    (_edit_cifar_batch(lambda b: {**b, b"data": b[b"data"][:, :1024]}),
     r"'data' is uint8 \(6, 1024\), expected uint8 \[N, 3072\]"),
    (_edit_cifar_batch(lambda b: {**b, b"labels": b[b"labels"][:5]}), "5 labels for 6 images"),
    (_edit_cifar_meta, "'label_names' should list 10 class names"),
], ids=["not a dict", "no labels", "grey images", "labels short", "nine class names"])
def test_well_formed_cifar_files_with_the_wrong_content_are_named(tmp_path, damage, needle):
    """A file that unpickles but is not what CIFAR's file of that name holds: a DataError naming the file
    and what is wrong, never a KeyError or a shape error from deeper down."""
    write_cifar(tmp_path / "d", "cifar10")
    p = damage(tmp_path / "d")
    with pytest.raises(DataError, match=needle) as e:
        load_dataset("cifar10", root=tmp_path / "d", cache_dir=False)
    assert str(p) in str(e.value)


@pytest.mark.parametrize("variables, needle", [
    (lambda x, y: {"images": x, "y": y}, "no 'X' and 'y' variables; not an SVHN cropped-digits file"),
    (lambda x, y: {"X": x[:, :, :1], "y": y},
     r"'X' is uint8 \(32, 32, 1, 12\), expected uint8 \[32, 32, 3, N\]"),
    (lambda x, y: {"X": x, "y": y[:7]}, "7 labels for 12 images"),
], ids=["no X", "grey images", "labels short"])
def test_well_formed_svhn_files_with_the_wrong_content_are_named(tmp_path, variables, needle):
    from scipy.io import loadmat, savemat

    write_svhn(tmp_path / "d")
    p = tmp_path / "d" / "test_32x32.mat"
    m = loadmat(p)
    savemat(p, variables(m["X"], m["y"]))
    with pytest.raises(DataError, match=needle) as e:
        load_dataset("svhn", root=tmp_path / "d", cache_dir=False)
    assert str(p) in str(e.value)


def test_an_incomplete_cifar_folder_or_archive_is_named(tmp_path):
    """The missing-data error says what is incomplete: the folder's missing members, or an archive
    without them (which is refused after opening it, leaving no extraction behind)."""
    write_cifar(tmp_path / "d", "cifar10")
    (tmp_path / "d" / "cifar-10-batches-py" / "data_batch_4").unlink()
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="incomplete: cifar-10-batches-py/ lacks data_batch_4"):
        load_dataset("cifar10", root=tmp_path / "d")
    with pytest.raises(DataError, match=r"no cifar-10-batches-py/ folder and no cifar-10-python.tar.gz"):
        load_dataset("cifar10", root=tmp_path / "empty")
    write_cifar(tmp_path / "a", "cifar10", archive=True)
    tar = tmp_path / "a" / "cifar-10-python.tar.gz"
    with tarfile.open(tar) as t:
        members = [(m, t.extractfile(m).read() if m.isfile() else None) for m in t.getmembers()]
    with tarfile.open(tar, "w:gz") as t:
        for m, data in members:
            if not m.name.endswith("test_batch"):
                t.addfile(m, io.BytesIO(data) if data is not None else None)
    with pytest.raises(DataError, match="the archive lacks cifar-10-batches-py/test_batch") as e:
        load_dataset("cifar10", root=tmp_path / "a", cache_dir=tmp_path / "c")
    assert str(tar) in str(e.value)
    assert not any((tmp_path / "c").glob("cifar-10-batches-py-*"))      # no extraction left behind


def test_corrupt_cifar_archive(tmp_path):
    write_cifar(tmp_path / "d", "cifar100", archive=True)
    tar = tmp_path / "d" / "cifar-100-python.tar.gz"
    tar.write_bytes(tar.read_bytes()[:200])
    with pytest.raises(DataError, match="cannot read the archive") as e:
        load_dataset("cifar100", root=tmp_path / "d", cache_dir=tmp_path / "c")
    assert str(tar) in str(e.value)
    assert not any((tmp_path / "c").glob("cifar-100-python-*"))  # no extraction left behind


def test_corrupt_mat(tmp_path):
    write_svhn(tmp_path / "d")
    p = tmp_path / "d" / "test_32x32.mat"
    p.write_bytes(p.read_bytes()[:300])
    with pytest.raises(DataError, match="cannot read MATLAB file") as e:
        load_dataset("svhn", root=tmp_path / "d")
    assert str(p) in str(e.value)


# ------------------------------------------------------------------------------ missing, search


def test_search_paths_order(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDPRISM_DATA", str(tmp_path / "data"))
    paths = search_paths("fmnist", root=tmp_path / "r")
    assert paths == [tmp_path / "r", tmp_path / "data" / "fmnist", tmp_path / "data",
                     tmp_path / "no-debian-fmnist", tmp_path / "cache" / "data" / "fmnist"]
    assert tmp_path / "no-debian-fmnist" not in search_paths("mnist")
    assert DATASETS.get("fmnist").files.folders == (tmp_path / "no-debian-fmnist",)        # isolated here
    from fedprism.data.sets.fmnist import DEBIAN_FMNIST
    assert datasets.DEBIAN_FMNIST == DEBIAN_FMNIST == Path("/usr/share/datasets/fashion-mnist")


def test_missing_lists_every_place_and_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDPRISM_DATA", str(tmp_path / "data"))
    (tmp_path / "data").mkdir()
    write_idx(tmp_path / "data" / "fmnist" / "train-images-idx3-ubyte.gz", np.zeros((2, 28, 28), np.uint8))
    with pytest.raises(DataError) as e:
        load_dataset("fmnist")
    msg = str(e.value)
    for p in search_paths("fmnist"):
        assert str(p) in msg
    assert "fedprism data download fmnist" in msg
    assert "apt-get install dataset-fashion-mnist" in msg
    assert "incomplete: missing train-labels-idx1-ubyte[.gz]" in msg
    with pytest.raises(DataError, match="fedprism data download svhn") as e:
        load_dataset("svhn")
    assert "apt-get" not in str(e.value) and "train_32x32.mat" in str(e.value)


def test_fedprism_data_env_is_searched(tmp_path, monkeypatch):
    fake = write_fake("mnist", tmp_path / "data" / "mnist")
    monkeypatch.setenv("FEDPRISM_DATA", str(tmp_path / "data"))
    ds = load_dataset("mnist")
    np.testing.assert_array_equal(ds.y_train.numpy(), fake.y_train)
    assert ds.source == str(tmp_path / "data" / "mnist")


def test_bad_arguments(tmp_path):
    with pytest.raises(ConfigError, match="dataset"):
        load_dataset("imagenet")
    with pytest.raises(ConfigError, match="no extra options"):
        load_dataset("mnist", root=tmp_path, alpha=1)
    with pytest.raises(ConfigError, match="pad32"):
        load_dataset("synthetic", pad32=True)
    with pytest.raises(ConfigError, match="alpha"):
        load_dataset("synthetic", alpha=-1)
    with pytest.raises(ConfigError, match="num_devices"):
        load_dataset("synthetic", num_devices=0)
    with pytest.raises(ConfigError, match="test_fraction"):
        load_dataset("digits", test_fraction=1.0)
    assert set(DATASETS) >= {"fmnist", "mnist", "cifar10", "cifar100", "svhn", "usps", "digits", "synthetic",
                             "wisdm", "femnist", "emnist", "tinyimagenet", "shakespeare", "sent140"}


# ------------------------------------------------------------------------------------------ cache


def test_second_load_reads_the_cache(tmp_path, monkeypatch):
    write_fake("fmnist", tmp_path / "d")
    first = load_dataset("fmnist", root=tmp_path / "d")
    assert len(list((tmp_path / "cache" / "decoded").glob("fmnist-*.npz"))) == 1

    def boom(*a, **k):
        raise AssertionError("the parser must not run on a cache hit")

    monkeypatch.setattr(formats, "read_idx", boom)
    second = load_dataset("fmnist", root=tmp_path / "d")
    assert torch.equal(second.x_train, first.x_train)
    assert torch.equal(second.y_test, first.y_test)
    assert second.classes == first.classes


def test_cache_follows_source_changes(tmp_path):
    write_fake("mnist", tmp_path / "d", seed=0)
    load_dataset("mnist", root=tmp_path / "d")
    fake = write_fake("mnist", tmp_path / "d", n_train=40, seed=1)  # new files: new sizes and mtimes
    ds = load_dataset("mnist", root=tmp_path / "d")
    np.testing.assert_array_equal(ds.y_train.numpy(), fake.y_train)


@pytest.mark.parametrize("damage", ["garbage", "truncate", "tamper"])
def test_corrupt_cache_is_rebuilt(tmp_path, damage):
    fake = write_cifar(tmp_path / "d", "cifar10")
    load_dataset("cifar10", root=tmp_path / "d")
    (cache,) = (tmp_path / "cache" / "decoded").glob("cifar10-*.npz")
    if damage == "garbage":
        cache.write_bytes(b"not a zip file")
    elif damage == "truncate":
        cache.write_bytes(cache.read_bytes()[:1000])
    else:  # a well-formed npz whose arrays no longer match their recorded digest
        with np.load(cache) as z:
            arrays = dict(z)
        arrays["y_train"] = (arrays["y_train"] + 1) % 10
        with open(cache, "wb") as f:
            np.savez(f, **arrays)
    with pytest.warns(RuntimeWarning, match="ignoring corrupt dataset cache"):
        ds = load_dataset("cifar10", root=tmp_path / "d")
    _assert_same(ds, fake, (3, 32, 32))
    with np.load(cache) as z:  # rebuilt and valid again
        np.testing.assert_array_equal(z["y_train"], fake.y_train)


def test_cache_can_be_disabled(tmp_path):
    write_fake("svhn", tmp_path / "d")
    load_dataset("svhn", root=tmp_path / "d", cache_dir=False)
    assert not (tmp_path / "cache").exists()


# --------------------------------------------------------------------------------------- download


def _remote(tmp_path, payload: bytes, sha256: str | None = None, md5: str | None = None,
            name: str = "blob.bin") -> dl.RemoteFile:
    src = tmp_path / "server" / name
    src.parent.mkdir(parents=True, exist_ok=True)
    src.write_bytes(payload)
    return dl.RemoteFile(name, (src.as_uri(),), sha256=sha256, md5=md5)


def test_download_verifies_sha256_and_md5(tmp_path):
    payload = os.urandom(3000)
    good = _remote(tmp_path, payload, hashlib.sha256(payload).hexdigest(), hashlib.md5(payload).hexdigest())
    dest = dl.download("mnist", tmp_path / "dest", files=[good])
    assert (dest / "blob.bin").read_bytes() == payload
    assert sorted(p.name for p in dest.iterdir()) == ["blob.bin"]  # no .part left


@pytest.mark.parametrize("algo", ["sha256", "md5"])
def test_download_checksum_mismatch_leaves_nothing(tmp_path, algo):
    payload = b"tampered content"
    bad = _remote(tmp_path, payload, **{algo: "0" * (64 if algo == "sha256" else 32)})
    with pytest.raises(DataError, match=f"{algo.upper()} mismatch") as e:
        dl.download("mnist", tmp_path / "dest", files=[bad])
    assert "blob.bin" in str(e.value) and bad.urls[0] in str(e.value)
    assert "A checksum mismatch means" in str(e.value)
    assert not (tmp_path / "dest").exists()               # nothing kept, not even the folder it created


def test_download_tries_the_next_mirror(tmp_path):
    payload = b"x" * 100
    good = _remote(tmp_path, payload, hashlib.sha256(payload).hexdigest())
    broken = (tmp_path / "server" / "missing.bin").as_uri()
    remote = dl.RemoteFile("blob.bin", (broken, good.urls[0]), sha256=good.sha256)
    calls = []

    def opener(url, timeout):
        calls.append(url)
        return dl._default_opener(url, timeout)

    path = dl.fetch(remote, tmp_path / "dest", opener=opener)
    assert path.read_bytes() == payload and calls == [broken, good.urls[0]]
    dl.fetch(remote, tmp_path / "dest", opener=opener)  # already there and verified: no new request
    assert len(calls) == 2
    # a stale file that fails verification is replaced by a verified download
    path.write_bytes(b"stale")
    dl.fetch(remote, tmp_path / "dest", opener=opener)
    assert path.read_bytes() == payload


def test_download_all_mirrors_fail(tmp_path):
    remote = dl.RemoteFile("a.bin", ((tmp_path / "nope1").as_uri(), (tmp_path / "nope2").as_uri()), md5="0" * 32)
    with pytest.raises(DataError) as e:
        dl.fetch(remote, tmp_path / "dest")
    assert "nope1" in str(e.value) and "nope2" in str(e.value)
    assert "checksum mismatch" not in str(e.value)        # nothing was downloaded: no checksum was compared
    assert not (tmp_path / "dest").exists()               # the folder this attempt created is gone again


def test_an_interrupted_download_leaves_neither_a_part_file_nor_the_folder_it_made(tmp_path):
    class Stop:
        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def read(self, n):
            raise KeyboardInterrupt                    # Ctrl-C, or SIGTERM in `fedprism data download`

    remote = dl.RemoteFile("a.bin", ("https://example.invalid/a.bin",), md5="0" * 32)
    with pytest.raises(KeyboardInterrupt):
        dl.fetch(remote, tmp_path / "new" / "dest", opener=lambda url, timeout: Stop())
    assert not (tmp_path / "new" / "dest").exists()


def test_a_killed_download_s_stale_part_file_is_removed_by_the_next(tmp_path):
    payload = b"y" * 50
    good = _remote(tmp_path, payload, hashlib.sha256(payload).hexdigest())
    dest = tmp_path / "dest"
    dest.mkdir()
    stale, fresh = dest / "blob.bin.k1ll3d.part", dest / "blob.bin.runn1n.part"
    stale.write_bytes(b"half")
    fresh.write_bytes(b"another download, now")
    os.utime(stale, (0, 0))
    assert dl.fetch(good, dest).read_bytes() == payload
    assert not stale.exists() and fresh.exists()           # a part file still being written is left alone


def test_download_default_destination_and_registry(tmp_path):
    assert dl.download_dir("mnist") == tmp_path / "cache" / "data" / "mnist"
    assert search_paths("mnist")[-1] == dl.download_dir("mnist")
    assert set(dl.REMOTE) >= {"fmnist", "mnist", "cifar10", "cifar100", "svhn", "usps", "wisdm", "femnist", "emnist",
                              "tinyimagenet", "shakespeare", "sent140"}
    assert set(dl.REMOTE) == {n for n, spec in DATASETS.all().items() if spec.downloadable}
    policy = {"usps": "md5", "emnist": "md5", "tinyimagenet": "md5",      # only an MD5 is published
              "femnist": "sha256", "shakespeare": "sha256",              # only a SHA-256 (TensorFlow Federated's)
              "wisdm": "tofu", "sent140": "tofu",                        # nothing is published
              **{n: "both" for n in ("fmnist", "mnist", "cifar10", "cifar100", "svhn")}}
    for name, files in dl.REMOTE.items():
        for f in files:
            has = ("both" if f.sha256 and f.md5 else "sha256" if f.sha256 else "md5" if f.md5 else
                   "tofu" if f.tofu else "none")
            assert has != "none" and has == policy.get(name, has), (name, f.filename, has)
            assert not (f.tofu and (f.sha256 or f.md5))
            if f.sha256:
                assert len(f.sha256) == 64 and int(f.sha256, 16) >= 0
            if f.md5:
                assert len(f.md5) == 32 and int(f.md5, 16) >= 0
            assert all(u.startswith(("https://", "http://")) for u in f.urls)
            if name in policy:                                           # these mirrors name the file
                assert all(u.endswith("/" + f.filename) for u in f.urls)
    assert {f.filename: f.md5 for f in dl.REMOTE["usps"]} == {"usps.bz2": "ec16c51db3855ca6c91edd34d0e9b197",
                                                              "usps.t.bz2": "8ea070ee2aca1ac39742fdd1ef5ed118"}
    with pytest.raises(ConfigError):
        dl.download("digits")


def test_a_remote_file_must_declare_how_it_is_checked():
    with pytest.raises(ValueError, match="needs a published checksum .* or tofu=True"):
        dl.RemoteFile("a.bin", ("https://example.org/a.bin",))
    with pytest.raises(ValueError, match="not both"):
        dl.RemoteFile("a.bin", ("https://example.org/a.bin",), md5="0" * 32, tofu=True)
    with pytest.raises(ValueError, match="md5 must be 32 hex digits"):
        dl.RemoteFile("a.bin", ("https://example.org/a.bin",), md5="abc")
    dl.RemoteFile("a.bin", ("https://example.org/a.bin",), md5="0" * 32)          # MD5 alone is a check


class _Response(io.BytesIO):
    """What an opener returns: a readable binary stream usable in a ``with`` statement."""


def test_usps_download_refuses_a_wrong_md5_and_keeps_nothing(tmp_path):
    """The official USPS entries with a fake opener: a payload whose MD5 is not the published one is
    refused for every file, and the destination holds nothing afterwards (no .part, no final file)."""
    requested = []

    def opener(url, timeout):
        requested.append(url)
        return _Response(bz2.compress(b"1 1:0.5\n") * 100)

    with pytest.raises(DataError, match="MD5 mismatch: expected ec16c51db3855ca6c91edd34d0e9b197") as e:
        dl.download("usps", tmp_path / "dest", opener=opener)
    assert "usps.bz2" in str(e.value) and "nothing was kept" in str(e.value)
    assert requested == ["https://www.csie.ntu.edu.tw/~cjlin/libsvmtools/datasets/multiclass/usps.bz2"]
    assert not (tmp_path / "dest").exists() or list((tmp_path / "dest").iterdir()) == []


def test_md5_only_download_accepts_the_matching_file(tmp_path):
    payload = bz2.compress(b"3 1:0.5\n")
    remote = dl.RemoteFile("usps.bz2", ("https://mirror.invalid/usps.bz2",), md5=hashlib.md5(payload).hexdigest())
    path = dl.fetch(remote, tmp_path / "dest", opener=lambda url, timeout: _Response(payload))
    assert path.read_bytes() == payload and sorted(p.name for p in path.parent.iterdir()) == ["usps.bz2"]


def test_load_with_download_fetches_then_loads(tmp_path, monkeypatch):
    got = {}

    def fake_download(name, dest=None, **kw):
        got["name"] = name
        got["fake"] = write_fake(name, dl.download_dir(name))
        return dl.download_dir(name)

    monkeypatch.setattr(dl, "download", fake_download)
    with pytest.raises(DataError):
        load_dataset("mnist")  # download=False never fetches
    assert not got
    ds = load_dataset("mnist", download=True)
    assert got["name"] == "mnist"
    np.testing.assert_array_equal(ds.y_test.numpy(), got["fake"].y_test)

    def into(name, dest=None, **kw):                  # a named data.root receives the download
        got["dest"] = dest
        write_fake(name, dest)
        return Path(dest)

    monkeypatch.setattr(dl, "download", into)
    with pytest.raises(DataError, match="data.download=true"):
        load_dataset("fmnist", root=tmp_path / "mine")
    ds = load_dataset("fmnist", root=tmp_path / "mine", download=True)
    assert got["dest"] == tmp_path / "mine" and len(ds.y_test)


# ------------------------------------------------------------------------------ digits, synthetic


def test_digits_deterministic_stratified():
    a, b = load_dataset("digits"), load_dataset("digits", seed=0)
    c = load_dataset("digits", seed=1)
    assert torch.equal(a.x_train, b.x_train)
    assert not torch.equal(a.y_train, c.y_train)
    assert a.input_shape == (1, 8, 8) and len(a.y_train) + len(a.y_test) == 1797
    assert len(a.y_test) == 450  # 25 %
    tr = np.bincount(a.y_train.numpy(), minlength=10) / len(a.y_train)
    te = np.bincount(a.y_test.numpy(), minlength=10) / len(a.y_test)
    assert np.abs(tr - te).max() < 0.01
    raw = torch.round(a.denormalize(a.x_train) * 16)
    assert raw.min() == 0 and raw.max() == 16
    assert abs(float(a.x_train.mean())) < 0.05 and abs(float(a.x_train.std()) - 1) < 0.05
    assert a.groups is None
    assert load_dataset("digits", pad32=True).input_shape == (1, 32, 32)


def test_synthetic_deterministic_shapes_and_devices():
    a = load_dataset("synthetic", alpha=1.0, beta=1.0, seed=0)
    b = load_dataset("synthetic", alpha=1.0, beta=1.0, seed=0)
    c = load_dataset("synthetic", alpha=1.0, beta=1.0, seed=1)
    assert torch.equal(a.x_train, b.x_train)
    assert torch.equal(a.y_test, b.y_test) and np.array_equal(a.groups, b.groups)
    assert a.x_train.shape != c.x_train.shape or not torch.equal(a.x_train, c.x_train)
    assert a.num_classes == 10 and a.input_shape == (60,) and a.x_train.dtype == torch.float32
    assert set(np.unique(a.groups)) == set(range(30)) and len(a.test_groups) == len(a.y_test)
    sizes = np.bincount(a.groups, minlength=30) + np.bincount(a.test_groups, minlength=30)
    assert sizes.min() >= 50
    np.testing.assert_allclose(np.bincount(a.test_groups, minlength=30), np.round(0.2 * sizes), atol=0)
    assert int(a.y_train.max()) <= 9 and int(a.y_train.min()) >= 0

    small = load_dataset("synthetic", num_devices=5, seed=0, test_fraction=0.5, iid=True)
    assert set(np.unique(small.groups)) == set(range(5))
    # non-IID devices disagree on their label distributions far more than IID ones (alpha = beta = 1)
    def spread(ds):
        hist = np.stack([np.bincount(ds.y_train.numpy()[ds.groups == g], minlength=10) for g in range(10)])
        p = hist / hist.sum(1, keepdims=True)
        return np.abs(p - p.mean(0)).sum(1).mean()

    iid = load_dataset("synthetic", num_devices=10, seed=0, iid=True, alpha=0.0, beta=0.0)
    noniid = load_dataset("synthetic", num_devices=10, seed=0, alpha=1.0, beta=1.0)
    assert spread(noniid) > spread(iid)


# -------------------------------------------------------------------------------- real FMNIST


@pytest.mark.skipif(not (Path("/usr/share/datasets/fashion-mnist") / "train-images-idx3-ubyte.gz").is_file(),
                    reason="Debian's dataset-fashion-mnist is not installed")
def test_real_fashion_mnist(tmp_path, monkeypatch):
    from fedprism.data import integrity
    search_folders(monkeypatch, "fmnist", Path("/usr/share/datasets/fashion-mnist"))
    monkeypatch.setattr(integrity, "KNOWN", integrity._known())          # the real digests
    ds = load_dataset("fmnist", pad32=True, cache_dir=False)
    assert ds.source == "/usr/share/datasets/fashion-mnist" and ds.classes[0] == "T-shirt/top"
    assert set(ds.integrity.values()) == {"sha256 verified"}
    assert ds.x_train.shape == (60000, 1, 32, 32) and ds.x_test.shape == (10000, 1, 32, 32)
    assert np.bincount(ds.y_train.numpy()).tolist() == [6000] * 10
    assert np.bincount(ds.y_test.numpy()).tolist() == [1000] * 10
    inner = ds.x_train[:, :, 2:30, 2:30]  # the 28x28 images; their stats define the constants
    assert abs(float(inner.mean())) < 0.01 and abs(float(inner.std()) - 1) < 0.01
    background = -ds.mean[0] / ds.std[0]
    assert float(ds.x_train[:, :, :2].max()) == pytest.approx(background, abs=1e-6)


def test_data_info_prints_each_datasets_shapes_and_names_what_is_missing(tmp_path, capsys):
    """`fedprism data info NAME... [--dest DIR]` loads each named dataset (verifying its files) and prints
    its splits' shapes; a folder without the files is an error naming the files it needs."""
    from fedprism.cli import main

    write_fake("fmnist", tmp_path / "f", n_train=30, n_test=12)
    assert main(["data", "info", "fmnist", "--dest", str(tmp_path / "f")]) == 0
    assert capsys.readouterr().out == "fmnist: train (30, 1, 28, 28) test (12, 1, 28, 28) classes 10\n"
    assert main(["data", "info", "digits"]) == 0
    assert capsys.readouterr().out == "digits: train (1347, 1, 8, 8) test (450, 1, 8, 8) classes 10\n"
    (tmp_path / "none").mkdir()
    assert main(["data", "info", "cifar10", "--dest", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert "does not hold dataset 'cifar10'" in err and "cifar-10-python.tar.gz" in err
    assert f"`fedprism data download cifar10 --dest {tmp_path / 'none'}` fetches the files into it" in err


def test_the_demo_uses_fashion_mnist_when_found_and_says_when_it_falls_back_to_digits(tmp_path, monkeypatch,
                                                                                     capsys):
    """README's set-up promise: `fedprism demo` runs on Fashion-MNIST where it is installed or downloaded,
    and otherwise on scikit-learn's bundled digits, saying why and how to get Fashion-MNIST."""
    from fedprism.experiment.demo import default_dataset

    assert default_dataset() == "digits"                              # isolated: no copy anywhere
    err = capsys.readouterr().err
    assert "Fashion-MNIST not found" in err and "fedprism data download fmnist" in err and "digits" in err
    write_fake("fmnist", tmp_path / "data" / "fmnist", n_train=30, n_test=12)
    monkeypatch.setenv("FEDPRISM_DATA", str(tmp_path / "data"))
    assert default_dataset() == "fmnist" and capsys.readouterr().err == ""
