"""Dataset files are checked against their known SHA-256 before use; unknown files are loudly
unverified; each file is hashed once per process; an explicit data.root is never passed over."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings

import numpy as np
import pytest

from _fakedata import isolate, write_fake, write_idx
from fedprism.data import datasets, integrity
from fedprism.data.datasets import load_dataset
from fedprism.errors import DataError

DEBIAN = datasets.DEBIAN_FMNIST


@pytest.fixture
def known(monkeypatch, tmp_path):
    """Isolated folders, with the fake files' digests registered as the known ones."""
    isolate(monkeypatch, tmp_path)
    monkeypatch.setattr(integrity, "_digests", {})
    table: dict = {}
    monkeypatch.setattr(integrity, "KNOWN", table)
    return table


def _register(table, name, folder):
    for p in folder.rglob("*"):
        if p.is_file():
            table[(name, p.name)] = (hashlib.sha256(p.read_bytes()).hexdigest(),)


def test_known_table_covers_every_official_download():
    from fedprism.data.download import REMOTE
    for name, files in REMOTE.items():
        for f in files:
            if f.sha256:
                assert f.sha256 in integrity.KNOWN[(name, f.filename)]
                assert (name, f.filename) not in integrity.KNOWN_MD5
            elif f.md5:                                                 # only an MD5 is published (USPS)
                assert integrity.KNOWN_MD5[(name, f.filename)] == (f.md5,)
            else:                                                       # trust on first use (WISDM)
                assert f.tofu and (name, f.filename) not in integrity.KNOWN
    assert len(integrity.KNOWN[("fmnist", "train-images-idx3-ubyte.gz")]) == 2     # upstream + Debian
    assert set(integrity.KNOWN_MD5) >= {("usps", "usps.bz2"), ("usps", "usps.t.bz2"), ("emnist", "gzip.zip"),
                                        ("tinyimagenet", "tiny-imagenet-200.zip")}


def test_matching_files_load_and_are_listed_as_verified(known, tmp_path):
    write_fake("mnist", tmp_path / "d")
    _register(known, "mnist", tmp_path / "d")
    with warnings.catch_warnings():
        warnings.simplefilter("error", integrity.UnverifiedDataWarning)
        ds = load_dataset("mnist", root=tmp_path / "d")
    assert set(ds.integrity.values()) == {"sha256 verified"} and len(ds.integrity) == 4


def test_a_substituted_file_is_an_error_naming_file_expected_and_actual(known, tmp_path):
    write_fake("mnist", tmp_path / "d")
    _register(known, "mnist", tmp_path / "d")
    victim = tmp_path / "d" / "train-labels-idx1-ubyte.gz"
    expected = known[("mnist", victim.name)][0]
    load_dataset("mnist", root=tmp_path / "d")                    # fills the decoded-array cache too
    labels = np.zeros(30, np.uint8)
    write_idx(victim, labels)                                     # same name, other content
    actual = hashlib.sha256(victim.read_bytes()).hexdigest()
    with pytest.raises(DataError) as e:
        load_dataset("mnist", root=tmp_path / "d")
    msg = str(e.value)
    assert str(victim) in msg and expected in msg and actual in msg and "\n" not in msg


def test_same_size_and_mtime_tampering_is_still_caught_by_a_new_process(known, tmp_path):
    """The per-process cache is keyed by (path, size, mtime); the decoded cache is, too: a byte
    flipped with the mtime restored passes a stat-based cache, so a new process hashes again."""
    write_fake("mnist", tmp_path / "d", gz=False)
    _register(known, "mnist", tmp_path / "d")
    victim = tmp_path / "d" / "t10k-labels-idx1-ubyte"
    load_dataset("mnist", root=tmp_path / "d")
    st = victim.stat()
    data = bytearray(victim.read_bytes())
    data[-1] = (data[-1] + 1) % 10
    victim.write_bytes(bytes(data))
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    integrity._digests.clear()                                    # a new process
    with pytest.raises(DataError, match="SHA-256 mismatch"):
        load_dataset("mnist", root=tmp_path / "d")


def test_md5_only_files_are_verified_by_md5_and_a_mismatch_is_an_error(known, tmp_path, monkeypatch):
    md5s: dict = {}
    monkeypatch.setattr(integrity, "KNOWN_MD5", md5s)
    write_fake("usps", tmp_path / "d")
    for p in (tmp_path / "d").iterdir():
        md5s[("usps", p.name)] = (hashlib.md5(p.read_bytes()).hexdigest(),)
    with warnings.catch_warnings():
        warnings.simplefilter("error", integrity.UnverifiedDataWarning)
        ds = load_dataset("usps", root=tmp_path / "d")
    assert set(ds.integrity.values()) == {"md5 verified (only an MD5 is published)"} and len(ds.integrity) == 2
    victim = tmp_path / "d" / "usps.t.bz2"
    expected = md5s[("usps", victim.name)][0]
    write_fake("usps", tmp_path / "other", seed=1)
    shutil.copy(tmp_path / "other" / "usps.t.bz2", victim)
    with pytest.raises(DataError) as e:
        load_dataset("usps", root=tmp_path / "d")
    msg = str(e.value)
    assert str(victim) in msg and "MD5 mismatch" in msg and expected in msg
    assert hashlib.md5(victim.read_bytes()).hexdigest() in msg and "only an MD5 is published" in msg


def test_files_without_a_known_digest_are_loudly_unverified(monkeypatch, tmp_path):
    isolate(monkeypatch, tmp_path)                                # KNOWN is empty here
    write_fake("cifar10", tmp_path / "d", archive=False)
    with pytest.warns(integrity.UnverifiedDataWarning, match="UNVERIFIED") as rec:
        ds = load_dataset("cifar10", root=tmp_path / "d")
    assert len(rec) == 7 and all(v.startswith("unverified") for v in ds.integrity.values())


def test_a_first_use_record_counts_only_for_files_declared_trust_on_first_use(monkeypatch, tmp_path):
    """A `.tofu.json` beside a file of a name with no such policy (here a raw IDX file) is ignored: the
    file stays unverified, whatever the record says."""
    isolate(monkeypatch, tmp_path)
    write_fake("mnist", tmp_path / "d", gz=False)
    victim = tmp_path / "d" / "train-labels-idx1-ubyte"
    record = victim.with_name(victim.name + ".tofu.json")
    record.write_text(json.dumps({"file": victim.name, "size": victim.stat().st_size,
                                  "sha256": hashlib.sha256(victim.read_bytes()).hexdigest()}))
    with pytest.warns(integrity.UnverifiedDataWarning):
        ds = load_dataset("mnist", root=tmp_path / "d")
    assert ds.integrity[str(victim)].startswith("unverified")


def test_each_file_is_hashed_once_per_process(known, tmp_path, monkeypatch):
    write_fake("mnist", tmp_path / "d")
    _register(known, "mnist", tmp_path / "d")
    reads = []
    real = integrity._sha256
    monkeypatch.setattr(integrity, "_sha256", lambda *a: reads.append(1) or real(*a))
    for _ in range(3):
        load_dataset("mnist", root=tmp_path / "d")
    assert len(reads) == 4                                        # four files, once each


@pytest.mark.filterwarnings("ignore::fedprism.data.integrity.UnverifiedDataWarning")
def test_a_data_root_missing_a_file_is_an_error_not_a_fallback(known, tmp_path, monkeypatch):
    write_fake("mnist", tmp_path / "complete")
    monkeypatch.setenv("FEDPRISM_DATA", str(tmp_path / "complete"))
    assert load_dataset("mnist").source == str(tmp_path / "complete")     # found by the search
    write_fake("mnist", tmp_path / "root")
    (tmp_path / "root" / "t10k-images-idx3-ubyte.gz").unlink()
    with pytest.raises(DataError) as e:
        load_dataset("mnist", root=tmp_path / "root")
    msg = str(e.value)
    assert "data.root" in msg and str(tmp_path / "root") in msg and "t10k-images-idx3-ubyte" in msg
    with pytest.raises(DataError, match="data.root"):
        load_dataset("mnist", root=tmp_path / "nowhere")


@pytest.mark.skipif(not (DEBIAN / "train-images-idx3-ubyte.gz").is_file(), reason="Debian FMNIST not installed")
def test_the_debian_fashion_mnist_files_verify_and_a_corrupt_copy_does_not(tmp_path, monkeypatch):
    monkeypatch.setattr(integrity, "_digests", {})
    got = integrity.verify("fmnist", {p.name: p for p in DEBIAN.glob("*.gz")})
    assert set(got.values()) == {"sha256 verified"} and len(got) == 4

    def no_rehash():
        raise AssertionError("an unchanged file was read and hashed again")

    real = integrity._sha256
    monkeypatch.setattr(integrity, "_sha256", no_rehash)             # unchanged files: a stat, no read
    assert integrity.verify("fmnist", {p.name: p for p in DEBIAN.glob("*.gz")}) == got
    monkeypatch.setattr(integrity, "_sha256", real)
    copy = tmp_path / "fm"
    shutil.copytree(DEBIAN, copy)
    with open(copy / "t10k-labels-idx1-ubyte.gz", "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(DataError, match="t10k-labels-idx1-ubyte.gz: SHA-256 mismatch"):
        load_dataset("fmnist", root=copy, cache_dir=False)
