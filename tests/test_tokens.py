"""Token inputs (text): a dataset of int64 token ids [n, seq_len] with `vocab_size` > 0 runs with the token
models (`ModelSpec.tokens`) through both engines, evaluation, validation splits, the decoded-array cache
and Flower; every mismatch between token data and a model is refused naming both."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import fedprism
from fedprism.data.base import DATASETS, Dataset, DatasetSpec, FileSet, check_loaded
from fedprism.errors import ConfigError, DataError
from test_flower import task_identity  # noqa: F401 (a fixture: Flower's run identity for in-process apps)

VOCAB, SEQ, CLASSES = 12, 8, ("a", "b", "c")


def make_tokens(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n sequences of SEQ ids in 0..VOCAB-1; class c holds id 9 + c somewhere (a learnable marker)."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, len(CLASSES), n)
    x = rng.integers(0, 9, (n, SEQ))
    x[np.arange(n), rng.integers(0, SEQ, n)] = 9 + y
    return torch.from_numpy(x.astype(np.int64)), torch.from_numpy(y.astype(np.int64))


def load(pad32: bool = False, root: str | None = None) -> Dataset:
    xtr, ytr = make_tokens(96, 0)
    xte, yte = make_tokens(48, 1)
    return Dataset("tok", xtr, ytr, xte, yte, list(CLASSES), source="generated", vocab_size=VOCAB)


SPEC = DatasetSpec(name="tok", load=load, summary="generated token sequences (a test dataset)",
                   class_names=CLASSES, input_shape=(SEQ,), vocab_size=VOCAB, normalisation="none (token ids)")


@pytest.fixture
def tok():
    fedprism.register_dataset("tok", SPEC)
    yield SPEC
    DATASETS.pop("tok")
    from fedprism.experiment.federation import clear_federations
    clear_federations()


RUN = dict(dataset="tok", clients=3, rounds=1, local_epochs=1, batch_size=16, lr=0.05, device="cpu",
           compile="false", seed=2)


def test_token_federation_keeps_int64_ids(tok):
    from fedprism.experiment.federation import build_federation

    fed = build_federation(fedprism.config(**RUN, model="text_cnn", **{"data.val_fraction": 0.25,
                                                                           "data.global_val": 12}))
    assert fed.vocab_size == VOCAB
    for x in (fed.x_train, fed.x_test, fed.x_val):
        assert x.dtype == torch.int64 and x.shape[1:] == (SEQ,)
    assert torch.equal(fed.x_test, load().x_test)                   # not normalised, not cast
    assert all(len(v) for v in fed.val_idx)


@pytest.mark.parametrize("engine", ["sequential", "vectorized"])
def test_text_cnn_runs_one_round_on_token_data(tok, tmp_path, engine):
    r = fedprism.run(**RUN, model="text_cnn", method="fedavg", engine=engine, db=tmp_path / "r.db")
    assert 0.0 <= r.final["local_acc"] <= 1.0 and 0.0 <= r.final["global_acc"] <= 1.0


@pytest.mark.parametrize("model", ["text_cnn", "text_transformer"])
def test_engines_agree_on_token_data(tok, tmp_path, model):
    """The vectorized engine trains and scores token models (with dropout) as the sequential one."""
    out = {}
    for engine in ("sequential", "vectorized"):
        r = fedprism.run(**RUN, model=model, method="fedper", engine=engine, db=tmp_path / f"{engine}.db",
                         **{"data.val_fraction": 0.25})
        out[engine] = r.final
    for k in ("local_acc", "global_acc", "sdad", "local_f1", "global_f1", "bytes_up"):
        assert out["vectorized"][k] == pytest.approx(out["sequential"][k], abs=1e-9), k


def test_text_cnn_learns_the_marker_task_federated(tok, tmp_path):
    """Each class is a marker id somewhere in the sequence: a filter that fires on it and max-over-time pooling
    find it wherever it is. Three rounds of FedAvg take the global accuracy well above chance (1/3)."""
    r = fedprism.run(**{**RUN, "rounds": 3, "local_epochs": 10, "lr": 0.1, "fraction": 1.0}, model="text_cnn",
                     method="fedavg", engine="sequential", db=tmp_path / "learn.db")
    assert r.final["global_acc"] > 0.5


def test_model_auto_picks_a_token_model(tok):
    from fedprism.experiment.build import make_model
    from fedprism.models.text_cnn import TextCNN

    model = make_model(fedprism.config(**RUN, model="auto"), (SEQ,), 3, VOCAB)
    assert isinstance(model, TextCNN) and model.body[0].embedding.num_embeddings == VOCAB
    # without the data (a Flower server that reads none): the vocabulary its spec declares
    model = make_model(fedprism.config(**RUN, model="auto"), (SEQ,), 3)
    assert isinstance(model, TextCNN) and model.body[0].embedding.num_embeddings == VOCAB


def test_lstm_runs_on_the_sequential_engine_and_vectorized_refuses_it(tok, tmp_path):
    from fedprism.engine import SequentialEngine, make_engine
    from fedprism.engine.base import LocalConfig
    from fedprism.experiment.federation import build_federation
    from fedprism.models import build_model

    fed = build_federation(fedprism.config(**RUN, model="char_lstm"))
    model = build_model("char_lstm", (SEQ,), 3, vocab_size=VOCAB)
    assert isinstance(make_engine("auto", fed, model, LocalConfig(), 0, "cpu", compile="true"), SequentialEngine)
    with pytest.raises(ConfigError, match="engine.*vectorized.*LSTM"):
        make_engine("vectorized", fed, model, LocalConfig(), 0, "cpu")
    r = fedprism.run(**RUN, model="char_lstm", method="fedavg", engine="auto", db=tmp_path / "l.db")
    assert 0.0 <= r.final["global_acc"] <= 1.0


def test_token_model_on_other_data_and_other_models_on_tokens_are_refused(tok, tmp_path):
    with pytest.raises(ConfigError, match=r"text_cnn is a token model.*dataset 'digits' is not token data"):
        fedprism.run(dataset="digits", model="text_cnn", clients=2, rounds=1, db=tmp_path / "a.db")
    with pytest.raises(ConfigError, match=r"dataset 'tok' is token data.*mlp is not a token model"):
        fedprism.run(**RUN, model="mlp", db=tmp_path / "b.db")
    from fedprism.models import build_model
    with pytest.raises(ConfigError, match="char_lstm is a token model"):
        build_model("char_lstm", (SEQ,), 3)
    with pytest.raises(ConfigError, match="lenet5 is not a token model"):
        build_model("lenet5", (1, 32, 32), 3, vocab_size=VOCAB)
    with pytest.raises(ConfigError, match="domain"):
        fedprism.run(**RUN, model="text_cnn", partition="domain_mix", db=tmp_path / "c.db",
                     **{"partition.max_classes": 3})


def test_registered_token_loader_is_checked():
    def loaded(**kw):
        x, y = make_tokens(10, 0)
        base = dict(name="tok", x_train=x, y_train=y, x_test=x, y_test=y, classes=list(CLASSES),
                    vocab_size=VOCAB)
        return Dataset(**{**base, **kw})

    assert check_loaded(SPEC, loaded()) is not None
    with pytest.raises(ConfigError, match="int64"):
        check_loaded(SPEC, loaded(x_train=loaded().x_train.float()))
    bad = loaded().x_test.clone()
    bad[0, 0] = VOCAB
    with pytest.raises(ConfigError, match=f"ids in 0..{VOCAB - 1}"):
        check_loaded(SPEC, loaded(x_test=bad))
    with pytest.raises(ConfigError, match="vocab_size 12 its spec declares"):
        check_loaded(SPEC, loaded(vocab_size=0))
    with pytest.raises(ValueError, match="not normalised"):
        loaded(mean=(0.5,), std=(0.2,))


def test_token_spec_is_checked_at_registration():
    from dataclasses import replace

    for bad, why in ((replace(SPEC, name="t1", input_shape=(1, SEQ, SEQ)), "seq_len"),
                     (replace(SPEC, name="t2", vocab_size=-1), "vocab_size"),
                     (replace(SPEC, name="t3", vocab_size=True), "vocab_size")):
        with pytest.raises(ValueError, match=why):
            fedprism.register_dataset(bad.name, bad)
        assert DATASETS.find(bad.name) is None


@pytest.mark.filterwarnings("ignore::fedprism.data.integrity.UnverifiedDataWarning")
def test_token_files_go_through_the_decoded_cache_as_int64(tmp_path):
    """`load_tokens`: decoded once, then read back from the cache with the same int64 ids; ids outside the
    vocabulary are a DataError naming the range."""
    from fedprism.data.cache import Raw
    from fedprism.data.datasets import load_dataset
    from fedprism.data.files import load_tokens

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "tok.txt").write_text("x")
    calls = []

    def decode_bad(files, scratch):
        raw = decode(files, scratch)
        raw.x_train[0, 0] = VOCAB + 3
        return raw

    def decode(files, scratch):
        calls.append(1)
        xtr, ytr = make_tokens(20, 0)
        xte, yte = make_tokens(10, 1)
        return Raw(xtr.numpy(), ytr.numpy(), xte.numpy(), yte.numpy(), list(CLASSES))

    def find(folder):
        f = folder / "tok.txt"
        return {"text": f} if f.is_file() else "no tok.txt"

    def load_files(pad32=False, root=None, download=False, cache_dir=None):
        return load_tokens(DATASETS.get("tokf"), decode, root, download, cache_dir)

    spec = DatasetSpec(name="tokf", load=load_files, class_names=CLASSES, input_shape=(SEQ,), vocab_size=VOCAB,
                       files=FileSet(find=find, needed="tok.txt"))
    fedprism.register_dataset("tokf", spec)
    try:
        a = load_dataset("tokf", root=tmp_path / "d", cache_dir=tmp_path / "cache")
        b = load_dataset("tokf", root=tmp_path / "d", cache_dir=tmp_path / "cache")
        decoded = len(calls)
        bad = pytest.raises(DataError, match=f"token ids must lie in 0..{VOCAB - 1}")
        with bad:
            load_tokens(spec, decode_bad, tmp_path / "d", False, False)
    finally:
        DATASETS.pop("tokf")
    assert decoded == 1 and list((tmp_path / "cache" / "decoded").glob("tokf-*.npz"))
    assert b.x_train.dtype == torch.int64 and torch.equal(a.x_train, b.x_train) and b.vocab_size == VOCAB
    assert torch.equal(b.x_test, make_tokens(10, 1)[0]) and not b.mean



def test_token_data_on_flower_matches_the_in_process_run(tok, tmp_path, monkeypatch, task_identity):
    """Nodes read their own token rows (int64) and train the token model as the simulator does."""
    import test_flower as tf
    from fedprism.flower.server_app import serve
    from fedprism.flower.settings import OFFLINE_ENV

    for k, v in OFFLINE_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr-home"))
    exp = ("method=fedavg dataset=tok model=text_cnn clients=3 rounds=2 fraction=1.0 local_epochs=1 lr=0.05 "
           "batch_size=16 device=cpu engine=sequential seed=2")
    ref, final = tf.in_process(exp, tmp_path / "ref.db")
    rc = tf.run_config(exp, tmp_path / "fl.db")
    res = serve(tf.FakeGrid(tf.nodes_for(3), rc), rc)
    assert res.status == "finished"
    for k in ("local_acc", "global_acc"):
        assert res.final[k] == pytest.approx(final[k], abs=1e-9), k


class _BagOfTokens(nn.Module):
    """A registered (plugin) token model: mean of token embeddings, a linear head."""

    def __init__(self, vocab_size: int, num_classes: int):
        super().__init__()
        self.body = nn.Embedding(vocab_size, 6)
        self.head = nn.Linear(6, num_classes)

    def forward(self, x, features_only=False):
        z = self.body(x).mean(dim=1)
        return z if features_only else self.head(z)


def test_a_registered_token_model_is_checked_on_token_ids_and_runs(tok, tmp_path):
    from fedprism.models import MODELS, ModelSpec

    spec = ModelSpec("bag", lambda shape, k, vocab_size: _BagOfTokens(vocab_size, k), tokens=True, vocab=VOCAB,
                     shape=(SEQ,), conv=False)
    fedprism.register_model("bag", spec)
    try:
        r = fedprism.run(**RUN, model="bag", method="fedavg", engine="vectorized", db=tmp_path / "bag.db")
        assert 0.0 <= r.final["global_acc"] <= 1.0
    finally:
        MODELS.pop("bag")
    with pytest.raises(TypeError, match=r"build\(input_shape, num_classes, vocab_size=...\)"):
        fedprism.register_model("bag2", ModelSpec("bag2", lambda shape, k: _BagOfTokens(VOCAB, k), tokens=True))
    assert MODELS.find("bag2") is None


def test_datasets_listing_names_the_vocabulary(tok, capsys):
    from fedprism.cli import main

    assert main(["datasets", "tok"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("input"))
    assert line.split(None, 1)[1] == f"{SEQ} token ids, vocabulary {VOCAB} (token models only)"
