"""Sent140 (LEAF): LEAF's tokens, the vocabulary of the training tweets, 25 ids padded or cut, LEAF's JSON
output and the Sentiment140 CSV / archive split per user, its trust-on-first-use download refusing a
changed archive, and a 1-round text_cnn run on generated files."""

from __future__ import annotations

import csv
import io
import json
import zipfile

import numpy as np
import pytest
import torch
from _fakedata import isolate
from _leafdata import write_leaf_json

from fedprism.data import download as dl
from fedprism.data import integrity
from fedprism.data.datasets import load_dataset
from fedprism.data.sets import sent140 as s1
from fedprism.errors import ConfigError, DataError

pytestmark = pytest.mark.filterwarnings("ignore::fedprism.data.integrity.UnverifiedDataWarning")


@pytest.fixture
def iso(monkeypatch, tmp_path):
    isolate(monkeypatch, tmp_path)
    monkeypatch.setattr(integrity, "_digests", {})
    return tmp_path


def test_tokens_vocabulary_and_encoding_by_hand():
    assert s1.tokens("I'm SO happy!!! at_home, ok?") == ["i'm", "so", "happy", "!", "!", "!", "at_home", ",", "ok",
                                                         "?"]
    vocab = s1.vocabulary(["b a b", "c b a", "d"])
    assert vocab == ["b", "a", "c", "d"]                      # b 3, a 2, then c, d once each by the token
    x = s1.encode(["a zz b", " ".join(["c"] * 30), ""], vocab)
    assert x.dtype == np.uint16 and x.shape == (3, 25)
    assert x[0, :4].tolist() == [3, s1.UNKNOWN, 2, s1.PAD] and not x[0, 3:].any()
    assert (x[1] == 4).all() and not x[2].any()
    assert s1.VOCAB_SIZE == 10_002 == s1.SPEC.vocab_size and s1.SPEC.input_shape == (25,)


def row(i, user, text, pol="4"):
    return [pol, str(1467810369 + i), "Mon Apr 06 22:19:45 PDT 2009", "NO_QUERY", user, text]


TWEETS = {"alice": ["love this day", "so sad today", "good good day", "meh", "happy happy"],
          "bob": ["bad day", "love it", "worst day ever"],
          "carol": ["only one tweet"],
          "dave": ["day one", "day two", "day three", "day four"]}


def write_csv(path, extra_rows=()):
    rows = []
    i = 0
    for u, ts in TWEETS.items():
        for k, t in enumerate(ts):
            rows.append(row(i, u, t, "4" if k % 2 == 0 else "0"))
            i += 1
    buf = io.StringIO()
    w = csv.writer(buf, quoting=csv.QUOTE_ALL)
    for r in rows:
        w.writerow(r)
    text = buf.getvalue() + "".join(extra_rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode("latin-1"))
    return path


def expected_split(seed=0, test_fraction=0.1, min_samples=3):
    """The split written out independently of the loader."""
    rng = np.random.default_rng(seed)
    tr, te = {}, {}
    for u in sorted(TWEETS):
        ts = TWEETS[u]
        ys = [1 if k % 2 == 0 else 0 for k in range(len(ts))]
        if len(ts) < min_samples:
            continue
        perm = rng.permutation(len(ts))
        n = int(round(test_fraction * len(ts)))
        tr[u] = [(ts[i], ys[i]) for i in sorted(perm[n:])]
        if n:
            te[u] = [(ts[i], ys[i]) for i in sorted(perm[:n])]
    return tr, te


def test_raw_csv_is_split_per_user_with_a_vocabulary_of_the_training_tweets(iso):
    write_csv(iso / "d" / s1.CSV, extra_rows=['"2","1","x","NO_QUERY","eve","neutral?"\n', '"4","2","x"\n'])
    ds = load_dataset("sent140", root=iso / "d", test_fraction=0.5)
    tr, te = expected_split(test_fraction=0.5)
    users = sorted(set(tr) | set(te))                          # group ids: the users kept, sorted
    assert "carol" not in tr and "2 malformed rows skipped" in ds.source
    train_texts = [t for u in sorted(tr) for t, _ in tr[u]]
    vocab = s1.vocabulary(train_texts)
    np.testing.assert_array_equal(ds.x_train.numpy(), s1.encode(train_texts, vocab).astype(np.int64))
    np.testing.assert_array_equal(ds.y_train.numpy(), [y for u in sorted(tr) for _, y in tr[u]])
    np.testing.assert_array_equal(ds.groups, [users.index(u) for u in sorted(tr) for _ in tr[u]])
    np.testing.assert_array_equal(ds.test_groups, [users.index(u) for u in sorted(te) for _ in te[u]])
    assert ds.x_train.dtype == torch.int64 and ds.vocab_size == 10_002 and ds.classes == ["negative", "positive"]
    other = load_dataset("sent140", root=iso / "d", test_fraction=0.5, seed=5)
    tr5, _ = expected_split(seed=5, test_fraction=0.5)
    assert other.y_train.tolist() == [y for u in sorted(tr5) for _, y in tr5[u]] != ds.y_train.tolist()
    with pytest.raises(ConfigError, match="min_samples"):
        load_dataset("sent140", root=iso / "d", min_samples=0)


def test_archive_and_csv_agree(iso):
    csv_path = write_csv(iso / "c" / s1.CSV)
    (iso / "z").mkdir()
    with zipfile.ZipFile(iso / "z" / s1.ARCHIVE, "w") as z:
        z.write(csv_path, s1.CSV)
        z.writestr("testdata.manual.2009.06.14.csv", '"2","3","x","q","u","neutral"\n')
    a = load_dataset("sent140", root=iso / "c", min_samples=1, test_fraction=0.3)
    b = load_dataset("sent140", root=iso / "z", min_samples=1, test_fraction=0.3)
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    assert np.array_equal(a.groups, b.groups) and len(np.unique(a.groups)) == 4


def test_leaf_json_rows_and_polarities(iso):
    train = {"u1": {"x": [["1", "d", "NO_QUERY", "u1", "good day"], ["2", "d", "NO_QUERY", "u1", "bad"]],
                    "y": [1, 0]},
             "u2": {"x": [["3", "d", "NO_QUERY", "u2", "day day"]], "y": ["4"]}}
    test = {"u1": {"x": [["4", "d", "NO_QUERY", "u1", "unseen day"]], "y": ["0"]},
            "u3": {"x": ["good"], "y": [1]}}
    write_leaf_json(iso / "leaf", train, test)
    ds = load_dataset("sent140", root=iso / "leaf")
    # vocabulary of the training tweets: day 3, bad 1, good 1 -> ids 2, 3, 4
    assert ds.x_train[:, :2].tolist() == [[4, 2], [3, 0], [2, 2]]
    assert ds.y_train.tolist() == [1, 0, 1] and ds.y_test.tolist() == [0, 1]
    assert ds.x_test[0, :2].tolist() == [s1.UNKNOWN, 2]                       # 'unseen' is not a training word
    assert ds.groups.tolist() == [0, 0, 1] and ds.test_groups.tolist() == [0, 2]
    bad = {"u1": {"x": [["1", "d"]], "y": [1]}}
    write_leaf_json(iso / "bad", bad, test)
    with pytest.raises(DataError, match=r"LEAF's sent140 rows are \[id, date, query, user, text\]"):
        load_dataset("sent140", root=iso / "bad")
    bad = {"u1": {"x": ["a"], "y": [2]}}
    write_leaf_json(iso / "bad2", bad, test)
    with pytest.raises(DataError, match="polarity 2; expected 0 or 1"):
        load_dataset("sent140", root=iso / "bad2")


def _opener(payload, calls):
    def opener(url, timeout):
        calls.append(url)
        return io.BytesIO(payload)
    return opener


def test_trust_on_first_use_download_and_a_changed_archive_refused(iso):
    csv_path = write_csv(iso / "c" / s1.CSV)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.write(csv_path, s1.CSV)
    payload = buf.getvalue()
    calls = []
    dest = dl.download("sent140", opener=_opener(payload, calls))
    assert calls == ["https://cs.stanford.edu/people/alecmgo/trainingandtestdata.zip"]
    archive = dest / s1.ARCHIVE
    rec = json.loads(dl.tofu_record_path(archive).read_text())
    assert rec["sha256"] == dl.file_digests(archive)["sha256"]
    ds = load_dataset("sent140", test_fraction=0.5)
    assert list(ds.integrity.values())[0].startswith("sha256 verified against the trust-on-first-use record")
    tampered = bytearray(payload)
    tampered[len(tampered) // 2] ^= 1
    archive.write_bytes(bytes(tampered))
    with pytest.raises(DataError) as e:
        load_dataset("sent140", test_fraction=0.5)
    msg = str(e.value)
    assert str(archive) in msg and "SHA-256 mismatch" in msg and rec["sha256"] in msg
    archive.unlink()
    with pytest.raises(DataError, match="SHA-256 mismatch with the first-use record"):
        dl.download("sent140", opener=_opener(bytes(tampered), calls))
    assert not archive.exists()


def test_a_one_round_natural_text_cnn_run(iso):
    from fedprism.cli import main

    rng = np.random.default_rng(0)
    words = np.array(["good", "bad", "day", "love", "sad", "ok"])

    def user(name, n):
        return {"x": [["0", "d", "NO_QUERY", name, " ".join(rng.choice(words, 6))] for _ in range(n)],
                "y": rng.integers(0, 2, n).tolist()}

    names = ["ann", "ben", "cat"]
    write_leaf_json(iso / "leaf", {u: user(u, 6) for u in names}, {u: user(u, 2) for u in names})
    run = ["dataset=sent140", "partition=natural", "clients=3", "model=text_cnn", "method=fedavg", "rounds=1",
           "local_epochs=1", "batch_size=2", "partition.min_train=1", f"data.root={iso / 'leaf'}"]
    assert main(["run", "--db", str(iso / "r.db"), *run, "--quiet"]) == 0
