"""EMNIST: NIST's gzip.zip of IDX files (images stored transposed), its splits and mapping files, the
MD5 torchvision lists enforced, and a 1-round run, all on generated files in the real format."""

from __future__ import annotations

import io
import zipfile

import numpy as np
import pytest
import torch
from _fakedata import isolate
from _leafdata import write_emnist_zip

from fedprism.data import download as dl
from fedprism.data import integrity
from fedprism.data.datasets import load_dataset
from fedprism.data.sets import emnist
from fedprism.errors import ConfigError, DataError

pytestmark = pytest.mark.filterwarnings("ignore::fedprism.data.integrity.UnverifiedDataWarning")

LETTERS = [(i + 1, 65 + i, 97 + i) for i in range(26)]          # the letters split: 1..26 -> "A/a"...
DIGITS = [(i, 48 + i) for i in range(10)]


@pytest.fixture
def iso(monkeypatch, tmp_path):
    isolate(monkeypatch, tmp_path)
    monkeypatch.setattr(integrity, "_digests", {})
    return tmp_path


def fake(seed: int, n_train: int, n_test: int, k: int, first: int = 0):
    rng = np.random.default_rng(seed)
    x_tr = rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8)
    x_te = rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8)
    y_tr = (np.arange(n_train) % k + first).astype(np.uint8)
    y_te = rng.integers(first, first + k, n_test).astype(np.uint8)
    return x_tr, y_tr, x_te, y_te


def test_letters_split_is_upright_renumbered_and_named_from_its_mapping(iso):
    x_tr, y_tr, x_te, y_te = fake(0, 30, 8, 26, first=1)
    write_emnist_zip(iso / "d" / emnist.ARCHIVE, "letters", x_tr, y_tr, x_te, y_te, LETTERS,
                     other_splits=("digits",))
    ds = load_dataset("emnist", root=iso / "d", split="letters")
    assert ds.num_classes == 26 and ds.classes[0] == "A/a" and ds.classes[25] == "Z/z"
    np.testing.assert_array_equal(ds.y_train.numpy(), y_tr.astype(np.int64) - 1)
    np.testing.assert_array_equal(ds.y_test.numpy(), y_te.astype(np.int64) - 1)
    # upright: the file holds the transpose, the loader gives back the image as written
    np.testing.assert_allclose(ds.x_train.numpy()[:, 0], x_tr / 255.0, atol=1e-6)
    np.testing.assert_allclose(ds.x_test.numpy()[:, 0], x_te / 255.0, atol=1e-6)
    assert ds.x_train[3, 0, 2, 7].item() == pytest.approx(x_tr[3, 2, 7] / 255, abs=1e-6)
    assert ds.input_shape == (1, 28, 28) and ds.groups is None and "split letters" in ds.source


def test_digits_split_and_split_choice_and_missing_split(iso):
    x_tr, y_tr, x_te, y_te = fake(1, 20, 6, 10)
    write_emnist_zip(iso / "d" / emnist.ARCHIVE, "digits", x_tr, y_tr, x_te, y_te, DIGITS)
    ds = load_dataset("emnist", root=iso / "d", split="digits")
    assert ds.classes == [str(i) for i in range(10)]
    np.testing.assert_array_equal(ds.y_train.numpy(), y_tr)
    with pytest.raises(DataError, match=r"lacks emnist-byclass-train-images-idx3-ubyte.gz.*splits there: digits"):
        load_dataset("emnist", root=iso / "d")                         # the default split, byclass
    with pytest.raises(ConfigError, match="'split' = 'letter' is not valid: one of byclass, .*letters"):
        load_dataset("emnist", root=iso / "d", split="letter")
    padded = load_dataset("emnist", root=iso / "d", split="digits", pad32=True)
    assert padded.input_shape == (1, 32, 32) and float(padded.x_train[:, :, :2].abs().max()) == 0


def test_extracted_gzip_folder_gives_what_the_archive_gives(iso):
    x_tr, y_tr, x_te, y_te = fake(2, 20, 6, 10)
    arch = write_emnist_zip(iso / "a" / emnist.ARCHIVE, "mnist", x_tr, y_tr, x_te, y_te, DIGITS)
    with zipfile.ZipFile(arch) as z:
        z.extractall(iso / "x")
    a = load_dataset("emnist", root=iso / "a", split="mnist", cache_dir=False)
    b = load_dataset("emnist", root=iso / "x", split="mnist", cache_dir=False)
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    assert all(v.startswith("unverified") for v in b.integrity.values())


def test_split_caches_do_not_mix(iso):
    x_tr, y_tr, x_te, y_te = fake(3, 26, 6, 26, first=1)
    write_emnist_zip(iso / "d" / emnist.ARCHIVE, "letters", x_tr, y_tr, x_te, y_te, LETTERS)
    with zipfile.ZipFile(iso / "d" / emnist.ARCHIVE, "a") as z:          # a digits split, other images
        d_tr, dy_tr, d_te, dy_te = fake(4, 12, 4, 10)
        from _leafdata import idx_bytes
        import gzip
        for part, x, y in (("train", d_tr, dy_tr), ("test", d_te, dy_te)):
            z.writestr(f"gzip/emnist-digits-{part}-images-idx3-ubyte.gz", gzip.compress(idx_bytes(x.transpose(0, 2, 1))))
            z.writestr(f"gzip/emnist-digits-{part}-labels-idx1-ubyte.gz", gzip.compress(idx_bytes(y)))
        z.writestr("gzip/emnist-digits-mapping.txt", "".join(f"{a} {b}\n" for a, b in DIGITS))
    letters = load_dataset("emnist", root=iso / "d", split="letters")
    digits = load_dataset("emnist", root=iso / "d", split="digits")
    assert letters.num_classes == 26 and digits.num_classes == 10 and len(digits.y_train) == 12
    assert len(list((iso / "cache" / "decoded").glob("emnist-*.npz"))) == 2
    again = load_dataset("emnist", root=iso / "d", split="letters")
    assert torch.equal(again.x_train, letters.x_train)


def test_corrupt_members_are_refused_naming_them(iso):
    x_tr, y_tr, x_te, y_te = fake(5, 20, 6, 10)
    arch = write_emnist_zip(iso / "d" / emnist.ARCHIVE, "digits", x_tr, y_tr, x_te, y_te, DIGITS)
    with zipfile.ZipFile(arch) as z:
        z.extractall(iso / "x")
    g = iso / "x" / "gzip"
    lab = g / "emnist-digits-train-labels-idx1-ubyte.gz"
    good = lab.read_bytes()
    lab.write_bytes(good[:-6])
    with pytest.raises(DataError, match="truncated|corrupt") as e:
        load_dataset("emnist", root=iso / "x", split="digits", cache_dir=False)
    assert str(lab) in str(e.value)
    import gzip
    lab.write_bytes(gzip.compress(np.arange(5, dtype=np.uint8).tobytes()))
    with pytest.raises(DataError, match="bad IDX magic number"):
        load_dataset("emnist", root=iso / "x", split="digits", cache_dir=False)
    lab.write_bytes(good)
    (g / "emnist-digits-mapping.txt").write_text("0 48\n1 49\n")
    with pytest.raises(DataError, match="maps 2 labels .* this split has 10 consecutive labels"):
        load_dataset("emnist", root=iso / "x", split="digits", cache_dir=False)
    (g / "emnist-digits-mapping.txt").write_text("".join(f"{a if a < 9 else 11} {b}\n" for a, b in DIGITS))
    with pytest.raises(DataError, match=r"maps 10 labels \[0, 1, 2\]...; this split has 10 consecutive labels"):
        load_dataset("emnist", root=iso / "x", split="digits", cache_dir=False)


def test_the_archive_is_checked_against_the_md5_torchvision_lists(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDPRISM_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("FEDPRISM_DATA", raising=False)
    monkeypatch.setattr(integrity, "_digests", {})
    arch = write_emnist_zip(tmp_path / "d" / emnist.ARCHIVE, "digits", *fake(6, 10, 4, 10), DIGITS)
    monkeypatch.setattr(emnist, "decode", lambda *a: (_ for _ in ()).throw(AssertionError("decoded")))
    with pytest.raises(DataError) as e:
        load_dataset("emnist", root=tmp_path / "d", split="digits")
    msg = str(e.value)
    assert str(arch) in msg and "MD5 mismatch" in msg and emnist.MD5 in msg and "only an MD5 is published" in msg
    assert dl.file_digests(arch)["md5"] in msg


def test_download_refuses_a_mismatch_and_keeps_nothing(iso):
    calls = []

    def opener(url, timeout):
        calls.append(url)
        return io.BytesIO(b"PK\x03\x04 not the archive")

    with pytest.raises(DataError, match="MD5 mismatch: expected " + emnist.MD5):
        dl.download("emnist", opener=opener)
    assert calls == ["https://biometrics.nist.gov/cs_links/EMNIST/gzip.zip"]
    assert not dl.download_dir("emnist").exists()


def test_a_one_round_run_on_the_generated_archive(iso):
    from fedprism.cli import main

    write_emnist_zip(iso / "d" / emnist.ARCHIVE, "byclass", *fake(7, 124, 30, 62),
                     DIGITS + [(10 + i, 65 + i) for i in range(26)] + [(36 + i, 97 + i) for i in range(26)])
    ds = load_dataset("emnist", root=iso / "d")
    assert ds.num_classes == 62 and ds.classes[10] == "A" and ds.classes[36] == "a"
    run = ["dataset=emnist", "partition=iid", "clients=2", "model=lenet5", "method=fedavg", "rounds=1",
           "local_epochs=1", "batch_size=8", "partition.min_train=1", f"data.root={iso / 'd'}"]
    assert main(["run", "--db", str(iso / "r.db"), *run, "--quiet"]) == 0


def test_a_member_that_decompresses_beyond_the_limit_is_refused(iso, monkeypatch):
    x_tr, y_tr, x_te, y_te = fake(8, 20, 6, 10)
    write_emnist_zip(iso / "d" / emnist.ARCHIVE, "digits", x_tr * 0, y_tr, x_te, y_te, DIGITS)  # zeros: small gz
    monkeypatch.setattr(emnist, "MAX_IDX_BYTES", 20 * 784)                # less than the 20 images' 15 696 bytes
    with pytest.raises(DataError, match=r"emnist-digits-train-images-idx3-ubyte.gz: decompresses to more than") as e:
        load_dataset("emnist", root=iso / "d", split="digits", cache_dir=False)
    assert str(iso / "d" / emnist.ARCHIVE) in str(e.value)


def test_the_config_key_chooses_the_split_of_a_run(iso):
    from fedprism.experiment.config import resolve
    from fedprism.experiment.federation import build_federation

    x_tr, y_tr, x_te, y_te = fake(9, 26, 8, 26, first=1)
    write_emnist_zip(iso / "d" / emnist.ARCHIVE, "letters", x_tr, y_tr, x_te, y_te, LETTERS)
    cfg = {"dataset": "emnist", "data.emnist.split": "letters", "partition": "iid", "clients": 2, "model": "mlp",
           "data.root": str(iso / "d"), "partition.min_train": 1}
    fed = build_federation(resolve(cfg))
    assert fed.num_classes == 26 and fed.class_names[0] == "A/a" and len(fed.y_train) == 26
    with pytest.raises(ConfigError, match="'split' = 'letter' is not valid"):
        build_federation(resolve({**cfg, "data.emnist.split": "letter"}))
    with pytest.raises(ConfigError, match="data.emnist.split"):
        resolve({**cfg, "dataset": "mnist"})                     # a key of a dataset that does not read it
    assert resolve(cfg).run_id != resolve({**cfg, "data.emnist.split": "byclass"}).run_id
