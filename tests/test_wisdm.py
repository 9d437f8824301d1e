"""WISDM: raw-file parsing and 1-second windows, the checked archive, `dataset=wisdm` with its per-user
split, trust-on-first-use downloads, and `partition=natural` (one client per user), all on small generated
files in the real format."""

from __future__ import annotations

import io
import json
import re
import tarfile

import numpy as np
import pytest
import torch
from _fakedata import isolate, wisdm_archive_bytes, wisdm_text, write_fake, write_wisdm

from fedprism.data import datasets
from fedprism.data import download as dl
from fedprism.data import integrity
from fedprism.data.sets import wisdm
from fedprism.data.datasets import load_dataset
from fedprism.data.sets.wisdm import ACTIVITIES, load_raw, parse_raw, split_by_user, windows
from fedprism.errors import ConfigError, DataError, PartitionError

#: generated files have no published digest nor a first-use record unless a test downloads them
pytestmark = pytest.mark.filterwarnings("ignore::fedprism.data.integrity.UnverifiedDataWarning")


@pytest.fixture
def iso(monkeypatch, tmp_path):
    """No test reads or writes the real ~/.cache or $FEDPRISM_DATA."""
    isolate(monkeypatch, tmp_path)
    monkeypatch.setattr(integrity, "_digests", {})
    return tmp_path


def fixture_text() -> str:
    rows = []
    for i in range(45):                                    # user 33 walking: 2 full windows + 5 readings
        rows.append(f"33,Walking,{49105962326000 + i},{i % 20}.0,1.5,-2.0;")
    for i in range(20):                                    # user 7 sitting: 1 window
        rows.append(f"7,Sitting,{1000 + i},0.5,9.8,{i}.0;")
    text = "\n".join(rows)
    return text + "\n\n33,Jogging,1,2.0,;\n8,Flying,1,1,1,1;\n"   # truncated record, unknown activity


def test_parse_and_windows(tmp_path):
    users, labels, xyz, skipped = parse_raw(fixture_text())
    assert len(users) == 65 and skipped == 2
    p = tmp_path / "WISDM_ar_v1.1_raw.txt"
    p.write_text(fixture_text())
    x, y, u = load_raw(p)
    assert x.shape == (3, 3)
    assert list(y) == [ACTIVITIES.index("Walking")] * 2 + [ACTIVITIES.index("Sitting")]
    assert list(u) == [33, 33, 7]
    assert np.allclose(x[0], [9.5, 1.5, -2.0]) and np.allclose(x[2], [0.5, 9.8, 9.5])


def test_the_real_files_oddities_are_parsed_or_skipped():
    """Trailing ',;', several records per line, CRLF, blank lines are read; truncated records, empty
    fields, unknown activities, non-numeric and non-finite values are skipped without breaking a run."""
    fake = wisdm_text()
    assert ",;" in fake.text and "\r\n" in fake.text and ",," in fake.text and "\n\n" in fake.text
    assert re.search(r";\d+,(Walking|Jogging|Sitting),", fake.text)       # two records on one line
    users, labels, xyz, skipped = parse_raw(fake.text)
    assert skipped == fake.skipped and skipped >= 5
    assert np.isfinite(xyz).all()
    x, y, u = windows(users, labels, xyz)
    np.testing.assert_array_equal(y, fake.labels)
    np.testing.assert_array_equal(u, fake.users)
    np.testing.assert_allclose(x, fake.features, rtol=0, atol=1e-5)


def test_split_by_user_is_seeded_stratified_and_complete():
    labels = np.repeat([0, 1, 0, 4], [10, 8, 5, 3])
    users = np.repeat([3, 3, 9, 9], [10, 8, 5, 3])
    tr, te = split_by_user(labels, users, seed=0, test_fraction=0.2)
    assert np.array_equal(np.sort(np.concatenate([tr, te])), np.arange(26)) and not set(tr) & set(te)
    got = {(u, a): int(((users[te] == u) & (labels[te] == a)).sum()) for u, a in [(3, 0), (3, 1), (9, 0), (9, 4)]}
    assert got == {(3, 0): 2, (3, 1): 2, (9, 0): 1, (9, 4): 1}           # round(0.2 n) per user and activity
    again = split_by_user(labels, users, seed=0, test_fraction=0.2)
    assert all(np.array_equal(a, b) for a, b in zip((tr, te), again))
    assert any(not np.array_equal(te, split_by_user(labels, users, seed=s, test_fraction=0.2)[1])
               for s in range(1, 4))


@pytest.mark.parametrize("archive", [True, False])
def test_load_dataset_windows_split_and_standardise(iso, archive):
    fake = write_wisdm(iso / "d", archive=archive)
    ds = load_dataset("wisdm", root=iso / "d")
    assert ds.name == "wisdm" and ds.classes == list(ACTIVITIES) and ds.num_classes == 6
    assert ds.input_shape == (3,) and ds.x_train.dtype == torch.float32 and ds.y_train.dtype == torch.int64
    assert str(fake.skipped) in ds.source and str(iso / "d") in ds.source
    tr, te = split_by_user(fake.labels, fake.users, seed=0, test_fraction=0.2)
    np.testing.assert_array_equal(ds.y_train.numpy(), fake.labels[tr])
    np.testing.assert_array_equal(ds.y_test.numpy(), fake.labels[te])
    np.testing.assert_array_equal(ds.groups, fake.users[tr])
    np.testing.assert_array_equal(ds.test_groups, fake.users[te])
    np.testing.assert_allclose(ds.denormalize(ds.x_train).numpy(), fake.features[tr], atol=1e-4)
    np.testing.assert_allclose(ds.denormalize(ds.x_test).numpy(), fake.features[te], atol=1e-4)
    np.testing.assert_allclose(ds.x_train.mean(0).numpy(), 0, atol=1e-5)  # train statistics
    np.testing.assert_allclose(ds.x_train.std(0, unbiased=False).numpy(), 1, atol=1e-5)
    other = load_dataset("wisdm", root=iso / "d", seed=1, test_fraction=0.5)
    assert len(other.y_test) > len(ds.y_test) and not torch.equal(other.y_train[:20], ds.y_train[:20])


def test_mlp_fedsub_takes_the_wisdm_windows(iso):
    from fedprism.models import MLPFedSub, build_model

    write_wisdm(iso / "d")
    ds = load_dataset("wisdm", root=iso / "d")
    model = build_model("mlp_fedsub", ds.input_shape, ds.num_classes)
    assert isinstance(model, MLPFedSub) and model.body[1].in_features == 3
    assert model(ds.x_test).shape == (len(ds.y_test), 6)


def test_options_and_pad32_are_checked(iso):
    write_wisdm(iso / "d")
    with pytest.raises(ConfigError, match="test_fraction"):
        load_dataset("wisdm", root=iso / "d", test_fraction=1.0)
    with pytest.raises(ConfigError, match="seed"):
        load_dataset("wisdm", root=iso / "d", seed=-1)
    with pytest.raises(ConfigError, match="pad32"):
        load_dataset("wisdm", root=iso / "d", pad32=True)
    with pytest.raises(ConfigError, match="only seed, test_fraction"):
        load_dataset("wisdm", root=iso / "d", alpha=1.0)


def test_second_load_reads_the_window_cache_and_a_corrupt_cache_is_rebuilt(iso, monkeypatch):
    write_wisdm(iso / "d")
    first = load_dataset("wisdm", root=iso / "d")
    (cache,) = (iso / "cache" / "decoded").glob("wisdm-*.npz")

    def boom(*a, **k):
        raise AssertionError("the parser must not run on a cache hit")

    with monkeypatch.context() as m:
        m.setattr(wisdm, "parse_raw", boom)
        second = load_dataset("wisdm", root=iso / "d")
    assert torch.equal(first.x_train, second.x_train) and np.array_equal(first.groups, second.groups)
    with np.load(cache) as z:
        arrays = dict(z)
    arrays["labels"] = (arrays["labels"] + 1) % 6                       # no longer matches its digest
    with open(cache, "wb") as f:
        np.savez(f, **arrays)
    with pytest.warns(RuntimeWarning, match="ignoring corrupt dataset cache"):
        third = load_dataset("wisdm", root=iso / "d")
    assert torch.equal(first.y_train, third.y_train)


# ------------------------------------------------------------------------------------------- archive


def _tar(tmp_path, text: str, extra=(), member=wisdm.MEMBER):
    p = tmp_path / "a" / wisdm.ARCHIVE
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(wisdm_archive_bytes(text, member=member, extra=list(extra)))
    return p


def test_archive_reads_only_the_expected_member_and_writes_nothing(tmp_path):
    fake = wisdm_text()
    evil = []
    for name in ("../evil.txt", "/tmp/fedprism-evil.txt", "WISDM_ar_v1.1/../../evil2.txt"):
        info = tarfile.TarInfo(name)
        info.size = 3
        evil.append(info)
    p = _tar(tmp_path, fake.text, evil)
    before = sorted(tmp_path.rglob("*"))
    assert wisdm.read_archive(p) == fake.text
    assert sorted(tmp_path.rglob("*")) == before                        # nothing extracted anywhere
    assert not (tmp_path / "evil.txt").exists()


def test_archive_refuses_links_duplicates_missing_and_oversized_members(tmp_path, monkeypatch):
    link = tarfile.TarInfo(wisdm.MEMBER)
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    p = _tar(tmp_path, "", member="WISDM_ar_v1.1/other.txt", extra=[link])
    with pytest.raises(DataError, match="is a link; refusing it") as e:
        wisdm.read_archive(p)
    assert str(p) in str(e.value)

    dup = tarfile.TarInfo(wisdm.MEMBER)
    dup.size = 1
    p = _tar(tmp_path, "1,Walking,1,1,1,1;", extra=[dup])
    with pytest.raises(DataError, match="2 times; refusing an ambiguous archive"):
        wisdm.read_archive(p)

    p = _tar(tmp_path, "x", member="WISDM_ar_v1.1/WISDM_ar_v1.1_raw.csv")
    with pytest.raises(DataError, match="the archive lacks WISDM_ar_v1.1/WISDM_ar_v1.1_raw.txt") as e:
        wisdm.read_archive(p)
    assert str(p) in str(e.value)

    p = _tar(tmp_path, wisdm_text().text)
    monkeypatch.setattr(wisdm, "MAX_RAW_BYTES", 1000)
    with pytest.raises(DataError, match="more than the 1000 accepted"):
        wisdm.read_archive(p)


def test_truncated_archive_and_data_without_windows(iso):
    p = write_wisdm(iso / "d").path
    p.write_bytes(p.read_bytes()[:-200])
    with pytest.raises(DataError, match="cannot read the archive") as e:
        load_dataset("wisdm", root=iso / "d")
    assert str(p) in str(e.value)

    p.write_bytes(wisdm_archive_bytes("33,Walking,1,1.0,2.0,3.0;\n" * 19 + "junk\n"))
    with pytest.raises(DataError, match=r"no complete window of 20 readings .*19 records parsed, 1 skipped"):
        load_dataset("wisdm", root=iso / "d")


def test_missing_wisdm_says_where_and_how_to_download(iso):
    with pytest.raises(DataError) as e:
        load_dataset("wisdm")
    msg = str(e.value)
    assert "WISDM_ar_latest.tar.gz" in msg and "fedprism data download wisdm" in msg
    assert "no checksum is published" in msg


# -------------------------------------------------------------------------------- trust on first use


def _opener(payload: bytes, calls: list):
    def opener(url, timeout):
        calls.append(url)
        return io.BytesIO(payload)
    return opener


def test_first_download_is_recorded_and_later_loads_and_downloads_must_match(iso):
    fake = wisdm_text()
    payload = wisdm_archive_bytes(fake.text)
    calls: list = []
    dest = dl.download("wisdm", opener=_opener(payload, calls))
    archive = dest / wisdm.ARCHIVE
    assert archive.read_bytes() == payload and calls == list(dl.REMOTE["wisdm"][0].urls)
    rec = json.loads(dl.tofu_record_path(archive).read_text())
    assert rec["size"] == len(payload) and rec["sha256"] == dl.file_digests(archive)["sha256"]
    assert sorted(p.name for p in dest.iterdir()) == [wisdm.ARCHIVE, wisdm.ARCHIVE + ".tofu.json"]

    ds = load_dataset("wisdm")                                          # found in the download folder
    assert list(ds.integrity.values())[0].startswith("sha256 verified against the trust-on-first-use record")
    dl.download("wisdm", opener=_opener(payload, calls))                 # present and matching: no request
    assert len(calls) == 1

    archive.unlink()                                                     # a later download must match
    other = wisdm_archive_bytes(fake.text + "33,Walking,1,1,1,1;\n")
    with pytest.raises(DataError, match="differs from the .* bytes recorded on first use") as e:
        dl.download("wisdm", opener=_opener(other, calls))
    assert "nothing was kept" in str(e.value)
    assert sorted(p.name for p in dest.iterdir()) == [wisdm.ARCHIVE + ".tofu.json"]
    same_size = bytearray(payload)
    same_size[-5] ^= 0x01
    with pytest.raises(DataError, match="SHA-256 mismatch with the first-use record"):
        dl.download("wisdm", opener=_opener(bytes(same_size), calls))
    assert json.loads(dl.tofu_record_path(archive).read_text()) == rec  # the record is never rewritten
    rec["recorded"] = "2001-02-03T04:05:06Z"
    dl.tofu_record_path(archive).write_text(json.dumps(rec))
    dl.download("wisdm", opener=_opener(payload, calls))
    assert archive.read_bytes() == payload
    assert json.loads(dl.tofu_record_path(archive).read_text()) == rec  # not even by a matching download


def test_a_changed_archive_fails_its_first_use_record_at_load(iso):
    payload = wisdm_archive_bytes(wisdm_text().text)
    dest = dl.download("wisdm", opener=_opener(payload, []))
    archive = dest / wisdm.ARCHIVE
    recorded = dl.file_digests(archive)["sha256"]
    tampered = bytearray(payload)
    tampered[len(tampered) // 2] ^= 0x01
    archive.write_bytes(bytes(tampered))
    with pytest.raises(DataError) as e:
        load_dataset("wisdm")
    msg = str(e.value)
    assert str(archive) in msg and "SHA-256 mismatch" in msg and recorded in msg
    assert dl.file_digests(archive)["sha256"] in msg and "trust-on-first-use record" in msg
    archive.write_bytes(payload + b"\0")
    with pytest.raises(DataError, match=f"size {len(payload) + 1} bytes, but the trust-on-first-use record"):
        load_dataset("wisdm")


def test_a_broken_record_is_an_error_and_no_record_is_unverified(iso):
    payload = wisdm_archive_bytes(wisdm_text().text)
    dest = dl.download("wisdm", opener=_opener(payload, []))
    record = dl.tofu_record_path(dest / wisdm.ARCHIVE)
    record.write_text("{not json")
    with pytest.raises(DataError, match="cannot read the trust-on-first-use record") as e:
        load_dataset("wisdm")
    assert str(record) in str(e.value)
    record.write_text(json.dumps({"file": wisdm.ARCHIVE, "size": "12", "sha256": "0" * 64}))
    with pytest.raises(DataError, match="not a trust-on-first-use record"):
        load_dataset("wisdm")
    record.unlink()
    with pytest.warns(integrity.UnverifiedDataWarning, match="no trust-on-first-use record"):
        ds = load_dataset("wisdm")
    assert list(ds.integrity.values())[0].startswith("unverified")


def test_load_with_download_true_uses_the_recorded_download(iso, monkeypatch):
    payload = wisdm_archive_bytes(wisdm_text().text)
    monkeypatch.setattr(dl, "_default_opener", _opener(payload, []))
    with pytest.raises(DataError):
        load_dataset("wisdm")                                            # download=False never fetches
    ds = load_dataset("wisdm", download=True)
    assert ds.num_classes == 6 and dl.tofu_record_path(dl.download_dir("wisdm") / wisdm.ARCHIVE).is_file()


# ----------------------------------------------------------------------------- partition = natural


def _federation(root, **kw):
    from fedprism.experiment.config import resolve
    from fedprism.experiment.federation import build_federation

    raw = {"dataset": "wisdm", "partition": "natural", "clients": 3, "model": "mlp_fedsub",
           "data.root": str(root), "method": "fedavg", **kw}
    return build_federation(resolve(raw))


def test_natural_partition_gives_each_client_one_user(iso):
    fake = write_wisdm(iso / "d")
    fed = _federation(iso / "d")
    ds = load_dataset("wisdm", root=iso / "d")
    assert fed.num_clients == 3 and fed.meta["client_groups"] == [7, 12, 33]
    for c, user in enumerate([7, 12, 33]):
        np.testing.assert_array_equal(fed.train_idx[c], np.flatnonzero(ds.groups == user))
        np.testing.assert_array_equal(fed.test_idx[c], np.flatnonzero(ds.test_groups == user))
    assert sum(len(t) for t in fed.train_idx) == len(fed.y_train) == len(ds.y_train)
    assert sum(len(t) for t in fed.test_idx) == len(fed.y_test) == len(ds.y_test)
    assert len(ds.y_train) + len(ds.y_test) == len(fake.labels)
    assert fed.input_shape == (3,)


def test_natural_partition_needs_one_client_per_user_and_natural_data(iso):
    write_wisdm(iso / "d")
    with pytest.raises(PartitionError, match="the data has 3 users/devices .* so set clients = 3"):
        _federation(iso / "d", clients=4)
    write_fake("mnist", iso / "m")
    with pytest.raises(ConfigError) as e:
        _federation(iso / "m", dataset="mnist", model="mlp")
    msg = str(e.value)
    assert "'partition' = 'natural'" in msg and "dataset 'mnist' does not" in msg
    assert all(n in msg for n in datasets.NATURAL_CLIENTS) and {"synthetic", "wisdm"} <= set(datasets.NATURAL_CLIENTS)


def test_natural_partition_keeps_users_aligned_through_subsets(iso):
    """data.train_subset, data.test_subset and data.global_val drop rows before partitioning; each
    row's user must be dropped with it."""
    write_wisdm(iso / "d")
    ds = load_dataset("wisdm", root=iso / "d")
    fed = _federation(iso / "d", **{"data.train_subset": 45, "data.test_subset": 12, "data.global_val": 6})
    rng = np.random.default_rng([0, 0xDA7A])
    keep = np.sort(rng.permutation(len(ds.y_train))[:45])
    keep_test = np.sort(rng.permutation(len(ds.y_test))[:12])
    rest = np.sort(np.random.default_rng([0, 0x6A1]).permutation(45)[6:])
    users, test_users = ds.groups[keep][rest], ds.test_groups[keep_test]
    assert torch.equal(fed.x_train, ds.x_train[keep][rest]) and len(fed.y_val) == 6
    for c, user in enumerate(fed.meta["client_groups"]):
        np.testing.assert_array_equal(fed.train_idx[c], np.flatnonzero(users == user))
        np.testing.assert_array_equal(fed.test_idx[c], np.flatnonzero(test_users == user))
