"""Shakespeare (LEAF): LEAF's 80-character vocabulary, its JSON output and TensorFlow Federated's HDF5 files
and archive (snippets made into 80-character windows as LEAF makes them), one natural client per role,
the archive's published SHA-256 enforced, and a 1-round char_lstm run on generated files."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from _fakedata import isolate
from _leafdata import tff_archive, write_leaf_json, write_tff_h5

from fedprism.data import download as dl
from fedprism.data import integrity
from fedprism.data.datasets import load_dataset
from fedprism.data.sets import shakespeare as sh
from fedprism.errors import DataError

pytestmark = pytest.mark.filterwarnings("ignore::fedprism.data.integrity.UnverifiedDataWarning")

LEAF_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"


@pytest.fixture
def iso(monkeypatch, tmp_path):
    isolate(monkeypatch, tmp_path)
    monkeypatch.setattr(integrity, "_digests", {})
    return tmp_path


def test_the_vocabulary_is_leafs_80_characters():
    assert sh.VOCAB == LEAF_LETTERS and len(sh.VOCAB) == 80 == sh.SPEC.vocab_size == sh.SPEC.num_classes
    assert sh.ids("a}\n|").tolist() == [LEAF_LETTERS.index("a"), 79, 0, -1]
    assert sh.SPEC.input_shape == (80,) and sh.SPEC.natural == "role" and sh.CLASSES[0] == "\\n"


def test_leaf_text_and_windows_by_hand():
    assert sh.leaf_text(["To be,  or", "not   to be"]) == "To be, or not to be "       # each line + newline
    text = "x" * 79 + "ab|cd"                       # 84 characters: windows 0..3, the '|' at position 81
    x, y, dropped = sh.windows(text, seq_len=80)
    # window i covers text[i:i + 80] and predicts text[i + 80]; windows 2 and 3 (and their targets for
    # i = 1) touch the '|' (positions 81): i = 1 predicts text[81] = '|', i = 2, 3 hold it
    assert dropped == 3 and len(x) == 1
    assert "".join(LEAF_LETTERS[i] for i in x[0]) == text[:80] and LEAF_LETTERS[y[0]] == "b"
    assert sh.windows("short", 80)[0].shape == (0, 80)


def role_text(rng, n):
    return "".join(rng.choice(list("abc DEF,.;'\n")) for _ in range(n))


def leaf_samples(text):
    """LEAF's txt_to_data, written out independently: every 80-window and its next character."""
    return [text[i:i + 80] for i in range(len(text) - 80)], [text[i + 80] for i in range(len(text) - 80)]


ROLES = ["THE_TEMPEST_PROSPERO", "HAMLET_OPHELIA", "KING_LEAR_KENT"]


def make_roles(seed=0, odd=True):
    """role -> (train lines, test lines), plain vocabulary characters, one odd '|' in Kent's test text."""
    rng = np.random.default_rng(seed)
    out = {}
    for k, r in enumerate(ROLES):
        tr = [role_text(rng, 40 + 10 * k) for _ in range(3)]
        te = [role_text(rng, 50) for _ in range(2)]
        out[r] = (tr, te)
    if odd:
        out["KING_LEAR_KENT"][1][0] = out["KING_LEAR_KENT"][1][0][:20] + "|" + out["KING_LEAR_KENT"][1][0][21:]
    return out


def expected(roles, split):
    xs, ys, gs = [], [], []
    for g, r in enumerate(sorted(roles)):
        x, y = leaf_samples(sh.leaf_text(roles[r][split]))
        keep = [i for i in range(len(x)) if "|" not in x[i] + y[i]]
        xs += [[LEAF_LETTERS.index(c) for c in x[i]] for i in keep]
        ys += [LEAF_LETTERS.index(y[i]) for i in keep]
        gs += [g] * len(keep)
    return np.array(xs), np.array(ys), np.array(gs)


def check(ds, roles):
    assert ds.vocab_size == 80 and ds.classes == list(sh.CLASSES) and ds.mean == () and ds.input_shape == (80,)
    for split, s in (("train", 0), ("test", 1)):
        x, y, g = expected(roles, s)
        assert getattr(ds, f"x_{split}").dtype == torch.int64
        np.testing.assert_array_equal(getattr(ds, f"x_{split}").numpy(), x)
        np.testing.assert_array_equal(getattr(ds, f"y_{split}").numpy(), y)
        np.testing.assert_array_equal(ds.groups if s == 0 else ds.test_groups, g)


def write_h5(folder, roles):
    tr = write_tff_h5(folder / sh.H5[0], {r: {"snippets": np.array([s.encode() for s in v[0]], dtype=object)}
                                          for r, v in roles.items()})
    te = write_tff_h5(folder / sh.H5[1], {r: {"snippets": np.array([s.encode() for s in v[1]], dtype=object)}
                                          for r, v in roles.items()})
    return tr, te


def test_tff_h5_and_archive_give_leafs_windows_per_role(iso):
    roles = make_roles()
    tr, te = write_h5(iso / "h5", roles)
    tff_archive(iso / "tar" / sh.ARCHIVE, {sh.H5[0]: tr, sh.H5[1]: te})
    a = load_dataset("shakespeare", root=iso / "h5")
    check(a, roles)
    b = load_dataset("shakespeare", root=iso / "tar", cache_dir=False)
    check(b, roles)
    dropped = sum(len(leaf_samples(sh.leaf_text(roles["KING_LEAR_KENT"][1]))[0]) for _ in [0]) - \
        int((b.test_groups == 1).sum())
    assert dropped > 0 and f"{dropped} samples with a character outside the vocabulary dropped" in b.source


def test_leaf_json_gives_the_same_samples(iso):
    roles = make_roles(1, odd=False)
    leaf = [{}, {}]
    for r, v in roles.items():
        for s in (0, 1):
            x, y = leaf_samples(sh.leaf_text(v[s]))
            leaf[s][r] = {"x": x, "y": y}
    leaf[1]["HAMLET_OPHELIA"]["x"].append("a" * 80)                  # a target outside the vocabulary
    leaf[1]["HAMLET_OPHELIA"]["y"].append("|")
    write_leaf_json(iso / "leaf", *leaf)
    ds = load_dataset("shakespeare", root=iso / "leaf")
    check(ds, roles)
    assert "1 samples with a character outside the vocabulary dropped" in ds.source
    tr, te = write_h5(iso / "h5", roles)
    other = load_dataset("shakespeare", root=iso / "h5")
    assert torch.equal(ds.x_train, other.x_train) and torch.equal(ds.y_test, other.y_test)
    bad = [{r: dict(d) for r, d in leaf[0].items()}, leaf[1]]
    bad[0]["HAMLET_OPHELIA"] = {"x": [s[:79] for s in leaf[0]["HAMLET_OPHELIA"]["x"]],
                                "y": leaf[0]["HAMLET_OPHELIA"]["y"]}
    write_leaf_json(iso / "bad", *bad)
    with pytest.raises(DataError, match="'x' must hold strings of 80 characters") as e:
        load_dataset("shakespeare", root=iso / "bad")
    assert "HAMLET_OPHELIA" in str(e.value)


def test_the_archive_is_checked_against_tffs_published_sha256(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDPRISM_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("FEDPRISM_DATA", raising=False)
    monkeypatch.setattr(integrity, "_digests", {})
    tr, te = write_h5(tmp_path / "h5", make_roles())
    arch = tff_archive(tmp_path / "d" / sh.ARCHIVE, {sh.H5[0]: tr, sh.H5[1]: te})
    monkeypatch.setattr(sh, "decode", lambda *a: (_ for _ in ()).throw(AssertionError("decoded")))
    with pytest.raises(DataError) as e:
        load_dataset("shakespeare", root=tmp_path / "d")
    msg = str(e.value)
    assert str(arch) in msg and "SHA-256 mismatch" in msg and sh.TFF_SHA256 in msg
    assert dl.file_digests(arch)["sha256"] in msg


def test_download_fetches_tffs_archive_and_refuses_a_mismatch(iso):
    calls = []

    def opener(url, timeout):
        calls.append(url)
        return io.BytesIO(b"BZh9 not it")

    with pytest.raises(DataError, match="SHA256 mismatch: expected " + sh.TFF_SHA256):
        dl.download("shakespeare", opener=opener)
    assert calls == ["https://storage.googleapis.com/tff-datasets-public/shakespeare.tar.bz2"]
    assert not dl.download_dir("shakespeare").exists()


def test_an_archive_lacking_a_member_or_truncated_is_refused(iso):
    tr, _ = write_h5(iso / "h5", make_roles())
    arch = tff_archive(iso / "d" / sh.ARCHIVE, {sh.H5[0]: tr})
    with pytest.raises(DataError, match="the archive lacks shakespeare_test.h5") as e:
        load_dataset("shakespeare", root=iso / "d")
    assert str(arch) in str(e.value)
    arch.write_bytes(arch.read_bytes()[:200])
    with pytest.raises(DataError, match="cannot read the archive"):
        load_dataset("shakespeare", root=iso / "d")


def test_a_one_round_natural_char_lstm_run(iso):
    from fedprism.cli import main

    write_h5(iso / "h5", make_roles(2, odd=False))
    run = ["dataset=shakespeare", "partition=natural", "clients=3", "model=char_lstm", "method=fedavg",
           "rounds=1", "local_epochs=1", "batch_size=8", "partition.min_train=1", f"data.root={iso / 'h5'}"]
    assert main(["run", "--db", str(iso / "r.db"), *run, "--quiet"]) == 0
