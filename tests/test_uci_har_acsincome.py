"""UCI HAR and ACSIncome on small generated files in their real formats (the HAR text files, zipped; ACS
PUMS person CSVs in csv_p<st>.zip): the values the loaders give against the values written, the splits,
the natural partitions (one client per subject / per US state), the trust-on-first-use refusal of a changed
file, bad options, and a 1-round run of each."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from _fakedata import isolate
from _realformat import acsincome_expected, pums_csv, pums_rows, write_har, write_pums, zip_bytes

import fedprism
from fedprism.data import download as dl
from fedprism.data import integrity
from fedprism.data.datasets import load_dataset
from fedprism.data.grouped import split_within_groups
from fedprism.data.sets import acsincome, uci_har
from fedprism.errors import ConfigError, DataError

pytestmark = pytest.mark.filterwarnings("ignore::fedprism.data.integrity.UnverifiedDataWarning")


@pytest.fixture
def iso(monkeypatch, tmp_path):
    isolate(monkeypatch, tmp_path)
    monkeypatch.setattr(integrity, "_digests", {})
    return tmp_path


def _opener(payloads: dict, calls: list):
    def opener(url, timeout):
        calls.append(url)
        name = url.rsplit("/", 1)[1]
        return io.BytesIO(payloads[name] if name in payloads else payloads["*"])
    return opener


def test_split_within_groups_is_stratified_seeded_and_exact():
    y = np.array([0] * 10 + [1] * 5 + [0] * 4)
    g = np.array([1] * 15 + [2] * 4)
    tr, te = split_within_groups(y, g, seed=3, test_fraction=0.2)
    assert sorted(np.concatenate([tr, te])) == list(range(19)) and not set(tr) & set(te)
    # round(0.2 n) of each (group, label): 2 of 10, 1 of 5, 1 (0.8 rounds to 1) of 4
    assert [int(((g[te] == a) & (y[te] == b)).sum()) for a, b in ((1, 0), (1, 1), (2, 0))] == [2, 1, 1]
    np.testing.assert_array_equal(split_within_groups(y, g, seed=3)[1], te)
    assert not np.array_equal(split_within_groups(y, g, seed=4)[1], te)


# ------------------------------------------------------------------------------------------ UCI HAR


@pytest.mark.parametrize("as_zip", [True, False])
def test_har_values_subjects_and_splits(iso, as_zip):
    f = write_har(iso / "har", as_zip=as_zip)
    ds = load_dataset("uci_har", root=iso / "har", split="official")
    np.testing.assert_array_equal(ds.x_train.numpy(), f.x["train"].astype(np.float32))
    np.testing.assert_array_equal(ds.y_train.numpy(), f.y["train"] - 1)
    np.testing.assert_array_equal(ds.groups, f.subject["train"])
    np.testing.assert_array_equal(ds.test_groups, f.subject["test"])
    assert ds.classes[5] == "LAYING" and ds.input_shape == (561,)
    pooled = load_dataset("uci_har", root=iso / "har")      # split="subject": round(0.2 * 4) = 1 of each (subject, activity)
    assert len(pooled.y_train) == 5 * 6 * 3 and len(pooled.y_test) == 5 * 6
    assert set(pooled.test_groups) == set(pooled.groups) == {1, 2, 3, 4, 5}
    for s in range(1, 6):
        assert np.bincount(pooled.y_test.numpy()[pooled.test_groups == s], minlength=6).tolist() == [1] * 6
    written = {tuple(r): (a, s) for split in ("train", "test")                      # window -> (activity, subject)
               for r, a, s in zip(f.x[split].astype(np.float32), f.y[split] - 1, f.subject[split])}
    loaded = {tuple(r): (int(a), int(s)) for x, y, g in ((pooled.x_train, pooled.y_train, pooled.groups),
                                                        (pooled.x_test, pooled.y_test, pooled.test_groups))
              for r, a, s in zip(x.numpy(), y.numpy(), g)}
    assert loaded == written


def test_har_bad_files_and_options(iso):
    f = write_har(iso / "har", as_zip=False)
    x = f.path / "train" / "X_train.txt"
    lines = x.read_text().splitlines()
    x.write_text("\n".join(lines[:3] + [lines[3][:-16]] + lines[4:]) + "\n")      # one value short
    with pytest.raises(DataError, match="line 4 does not hold 561 numbers"):
        load_dataset("uci_har", root=iso / "har", cache_dir=False)
    x.write_text("\n".join(lines) + "\n")
    (f.path / "train" / "y_train.txt").write_text("7\n" * len(lines))
    with pytest.raises(DataError, match=r"values must lie in 1..6, found 7..7"):
        load_dataset("uci_har", root=iso / "har", cache_dir=False)
    (f.path / "train" / "y_train.txt").write_text("1\n" * (len(lines) - 1))
    with pytest.raises(DataError, match="windows, .* activities and .* subjects in the train files"):
        load_dataset("uci_har", root=iso / "har", cache_dir=False)
    (f.path / "test" / "subject_test.txt").unlink()
    with pytest.raises(DataError, match="incomplete: missing test/subject_test.txt"):
        load_dataset("uci_har", root=iso / "har", cache_dir=False)
    with pytest.raises(ConfigError, match="split"):
        load_dataset("uci_har", root=iso / "har", split="random")


def test_har_first_download_is_recorded_and_a_changed_archive_refused(iso):
    payload = (write_har(iso / "src").path).read_bytes()
    calls: list = []
    dest = dl.download("uci_har", opener=_opener({"*": payload}, calls))
    archive = dest / uci_har.ARCHIVE
    assert len(calls) == 1 and dl.read_tofu_record(archive)["sha256"] == dl.file_digests(archive)["sha256"]
    ds = load_dataset("uci_har")
    assert list(ds.integrity.values())[0].startswith("sha256 verified against the trust-on-first-use record")
    tampered = bytearray(payload)
    tampered[len(tampered) // 2] ^= 1
    archive.write_bytes(bytes(tampered))
    with pytest.raises(DataError, match="SHA-256 mismatch .*trust-on-first-use record"):
        load_dataset("uci_har")
    archive.unlink()
    with pytest.raises(DataError, match="SHA-256 mismatch with the first-use record"):
        dl.download("uci_har", opener=_opener({"*": bytes(tampered)}, calls))
    assert not archive.exists()


def test_har_natural_partition_and_one_round(iso):
    write_har(iso / "har")
    res = fedprism.run(fedprism.config(dataset="uci_har", partition="natural", clients=5, model="mlp_fedsub",
                                       method="fedsub", rounds=1, local_epochs=1, fraction=1.0, batch_size=8,
                                       **{"data.root": str(iso / "har")}), db=iso / "r.db")
    assert res.status == "finished" and 0 <= res.final["local_acc"] <= 1
    from fedprism.experiment.config import resolve
    from fedprism.experiment.federation import build_federation
    fed = build_federation(resolve({"dataset": "uci_har", "partition": "natural", "clients": 5,
                                    "data.root": str(iso / "har"), "method": "fedavg"}))
    assert fed.meta["client_groups"] == [1, 2, 3, 4, 5]
    assert [len(t) for t in fed.train_idx] == [18] * 5 and [len(t) for t in fed.test_idx] == [6] * 5
    ds = load_dataset("uci_har", root=iso / "har")
    for c, subject in enumerate([1, 2, 3, 4, 5]):         # one client per subject, its own windows only
        np.testing.assert_array_equal(fed.train_idx[c], np.flatnonzero(ds.groups == subject))
        np.testing.assert_array_equal(fed.test_idx[c], np.flatnonzero(ds.test_groups == subject))


# --------------------------------------------------------------------------------------- ACSIncome


def test_acsincome_is_folktables_task_per_state(iso):
    rows = write_pums(iso / "acs", {"CA": 300, "WY": 120})
    ds = load_dataset("acsincome", root=iso / "acs", states="CA,WY", test_fraction=0.25)
    x = ds.x_train.double().numpy() * np.array(ds.std) + np.array(ds.mean)      # undo the standardisation
    xt = ds.x_test.double().numpy() * np.array(ds.std) + np.array(ds.mean)
    for st, fips in (("CA", 6), ("WY", 56)):
        want_x, want_y = acsincome_expected(rows[st])
        got_x = np.concatenate([x[ds.groups == fips], xt[ds.test_groups == fips]])
        got_y = np.concatenate([ds.y_train.numpy()[ds.groups == fips], ds.y_test.numpy()[ds.test_groups == fips]])
        key = lambda a, b: sorted(map(tuple, np.round(np.c_[a, b], 3)))                   # noqa: E731
        assert key(got_x, got_y) == key(want_x, want_y)
        assert len(want_y) > 30 and 0 < want_y.mean() < 1 and (want_x[:, 1] == -1).any()   # a blank COW kept
    np.testing.assert_allclose(ds.x_train.double().mean(0).numpy(), 0, atol=1e-5)
    assert ds.classes == ["<=50K", ">50K"] and set(ds.groups) == {6, 56}


def test_acsincome_layouts_years_and_refusals(iso):
    write_pums(iso / "acs", {"CA": 60}, year=2019, layout="folktables")
    write_pums(iso / "acs", {"CA": 50}, year=2018)
    a = load_dataset("acsincome", root=iso / "acs", states=["ca"], year=2019)
    b = load_dataset("acsincome", root=iso / "acs", states=["CA"])
    assert "2019" in a.source and len(a.y_train) + len(a.y_test) != len(b.y_train) + len(b.y_test)
    with pytest.raises(DataError, match=r"lacks the 2018 person files of TX \(csv_ptx.zip\)"):
        load_dataset("acsincome", root=iso / "acs", states=["CA", "TX"])
    with pytest.raises(DataError, match="lacks the 2017 person files of CA"):   # flat files are 2018's
        load_dataset("acsincome", root=iso / "acs", states=["CA"], year=2017)
    (iso / "acs" / "2017" / "1-Year").mkdir(parents=True)
    (iso / "acs" / "csv_pca.zip").rename(iso / "acs" / "2017" / "1-Year" / "csv_pca.zip")      # misplaced
    with pytest.raises(DataError, match="SERIALNO '2018.*' is not of 2017"):
        load_dataset("acsincome", root=iso / "acs", states=["CA"], year=2017)
    with pytest.raises(ConfigError, match="states"):
        load_dataset("acsincome", root=iso / "acs", states=["CAL"])
    rows = pums_rows(6, 5)
    text = pums_csv(rows).replace("PINCP", "INCOME")
    (iso / "bad").mkdir()
    (iso / "bad" / "csv_pca.zip").write_bytes(zip_bytes({"psam_p06.csv": text}))
    with pytest.raises(DataError, match="no column PINCP"):
        load_dataset("acsincome", root=iso / "bad", states=["CA"], cache_dir=False)
    (iso / "bad" / "csv_pca.zip").write_bytes(zip_bytes({"psam_p06.csv": pums_csv(rows), "b.csv": "x"}))
    with pytest.raises(DataError, match="2 CSV files in the archive"):
        load_dataset("acsincome", root=iso / "bad", states=["CA"], cache_dir=False)
    (iso / "bad" / "csv_pca.zip").write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(DataError, match="cannot read the zip archive"):
        load_dataset("acsincome", root=iso / "bad", states=["CA"], cache_dir=False)


def test_acsincome_download_is_trusted_on_first_use_and_refused_when_changed(iso):
    write_pums(iso / "src", {"WY": 80, "VT": 70})
    payloads = {p.name: p.read_bytes() for p in (iso / "src").iterdir()}
    calls: list = []
    dest = iso / "acs"
    ds = None
    import fedprism.data.download as download_module
    orig = download_module._default_opener
    download_module._default_opener = _opener(payloads, calls)
    try:
        ds = load_dataset("acsincome", root=dest, states=["WY", "VT"], download=True)
        assert sorted(c.rsplit("/", 2)[1:] == ["1-Year", c.rsplit("/", 1)[1]] for c in calls) == [True, True]
        assert all("/2018/1-Year/csv_p" in c for c in calls)
        assert all(v.startswith("sha256 verified against the trust-on-first-use record")
                   for v in ds.integrity.values())
        (dest / "csv_pwy.zip").unlink()
        payloads["csv_pwy.zip"] = payloads["csv_pvt.zip"]                 # the mirror now serves other bytes
        with pytest.raises(DataError, match="differs from the .* bytes recorded on first use|SHA-256 mismatch"):
            load_dataset("acsincome", root=dest, states=["WY"], download=True)
        assert not (dest / "csv_pwy.zip").exists()
        (dest / "csv_pvt.zip").write_bytes(payloads["csv_pvt.zip"] + b"\0")
        with pytest.raises(DataError, match="trust-on-first-use record"):
            load_dataset("acsincome", root=dest, states=["VT"])
    finally:
        download_module._default_opener = orig
    rec = json.loads(dl.tofu_record_path(dest / "csv_pvt.zip").read_text())
    assert rec["url"].endswith("/2018/1-Year/csv_pvt.zip")
    write_pums(iso / "src19", {"VT": 60}, year=2019)          # another year: into <year>/1-Year/, its own URL
    payloads19 = {"csv_pvt.zip": (iso / "src19" / "csv_pvt.zip").read_bytes()}
    calls.clear()
    download_module._default_opener = _opener(payloads19, calls)
    try:
        ds19 = load_dataset("acsincome", root=dest, states=["VT"], year=2019, download=True)
    finally:
        download_module._default_opener = orig
    assert calls == ["https://www2.census.gov/programs-surveys/acs/data/pums/2019/1-Year/csv_pvt.zip"]
    assert (dest / "2019" / "1-Year" / "csv_pvt.zip").is_file() and "2019" in ds19.source


def test_acsincome_natural_partition_by_state_and_one_round(iso):
    write_pums(iso / "acs", {"CA": 200, "WY": 150, "PR": 150})
    from fedprism.experiment.config import resolve
    from fedprism.experiment.federation import build_federation
    raw = {"dataset": "acsincome", "partition": "natural", "clients": 51, "data.root": str(iso / "acs"),
           "method": "fedavg", "model": "logreg"}
    with pytest.raises(DataError, match="lacks the 2018 person files of AL, AK"):
        build_federation(resolve(raw))                                   # default: folktables' 51 states
    write_pums(iso / "acs", {st: 40 for st in acsincome.STATES if st not in ("CA", "WY", "PR")})
    fed = build_federation(resolve(raw))
    ds = load_dataset("acsincome", root=iso / "acs")
    assert fed.meta["client_groups"] == sorted(acsincome.FIPS.values())
    for c, fips in enumerate(sorted(acsincome.FIPS.values())):
        np.testing.assert_array_equal(fed.train_idx[c], np.flatnonzero(ds.groups == fips))
        np.testing.assert_array_equal(fed.test_idx[c], np.flatnonzero(ds.test_groups == fips))
    res = fedprism.run(fedprism.config(**{**raw, "rounds": 1, "local_epochs": 1, "fraction": 0.5,
                                          "optimizer": "adam", "lr": 0.001}), db=iso / "r.db")
    assert res.status == "finished" and 0 <= res.final["local_acc"] <= 1


def test_config_keys_choose_states_and_year(iso):
    write_pums(iso / "acs", {"CA": 120, "WY": 90})
    write_pums(iso / "acs", {"VT": 80}, year=2019, layout="folktables")
    from fedprism.experiment.config import resolve
    from fedprism.experiment.federation import build_federation
    raw = {"dataset": "acsincome", "partition": "natural", "data.root": str(iso / "acs"), "method": "fedavg",
           "model": "logreg"}
    fed = build_federation(resolve({**raw, "clients": 2, "data.acs.states": "CA,WY"}))
    assert fed.meta["client_groups"] == [6, 56]
    fed = build_federation(resolve({**raw, "clients": 1, "data.acs.states": "VT", "data.acs.year": 2019}))
    assert fed.meta["client_groups"] == [50]
    a = resolve({**raw, "clients": 2, "data.acs.states": "CA,WY"})
    assert a.run_id != resolve({**raw, "clients": 2, "data.acs.states": "WY,CA,TX"}).run_id
    with pytest.raises(ConfigError, match="data.acs.states.*only with dataset=acsincome"):
        resolve({"dataset": "digits", "method": "fedavg", "data.acs.states": "CA"})
    with pytest.raises(ConfigError, match="data.acs.year"):
        resolve({**raw, "clients": 2, "data.acs.year": 1999})
