"""The model zoo's newer members (`vgg11`, `char_lstm`, `text_cnn`, `text_transformer`, `tabular_mlp`): each
builds at its listed shape with the body/head split, maps a batch to [batch, classes] logits and the body to
its penultimate features, refuses the inputs it cannot take, and runs a round through `fedprism.api` and the
CLI on tiny generated data; the forward multiply-adds of `fedprism models` (one counter,
`fedprism.models.flops`) are checked against hand-computed counts, and listed for every model."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout

import numpy as np
import pytest
import torch
from torch import nn

import fedprism
from fedprism.data.base import DATASETS, Dataset, DatasetSpec
from fedprism.errors import ConfigError
from fedprism.models import MODELS, build_model
from fedprism.models.flops import forward_macs

#: model -> (input shape, vocabulary, penultimate width)
NEW = {"vgg11": ((3, 32, 32), 0, 512), "char_lstm": ((80,), 80, 256), "text_cnn": ((25,), 50, 300),
       "tabular_mlp": ((10,), 0, 128), "text_transformer": ((25,), 50, 64)}


def _batch(shape, vocab, n=3):
    g = torch.Generator().manual_seed(0)
    if vocab:
        return torch.randint(0, vocab, (n, *shape), generator=g)
    return torch.randn((n, *shape), generator=g)


@pytest.mark.parametrize("name", sorted(NEW))
def test_new_model_builds_and_maps_shapes(name):
    shape, vocab, width = NEW[name]
    spec = MODELS.get(name)
    assert spec.__module__ == f"fedprism.models.{name}" and spec.tokens == bool(vocab)
    model = build_model(name, shape, 7, seed=1, vocab_size=vocab).eval()
    x = _batch(shape, vocab)
    with torch.no_grad():
        assert model(x).shape == (3, 7)
        assert model(x, features_only=True).shape == (3, width)
        assert torch.equal(model.head(model(x, features_only=True)), model(x))
    again = build_model(name, shape, 7, seed=1, vocab_size=vocab)      # the run seed fixes the weights
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))


def test_body_and_head_partition_the_parameters_of_every_model():
    """Each built-in model's parameters are its body's and its head's, each exactly once (what FedPer, FedRep
    and the prototype methods split by the `head.` prefix)."""
    for name in MODELS.names():
        spec = MODELS.get(name)
        model = build_model(name, spec.shape, 10, vocab_size=spec.vocab if spec.tokens else 0)
        every = {id(p) for p in model.parameters()}
        body = [id(p) for p in model.body.parameters()]
        head = [id(p) for p in model.head.parameters()]
        assert head, name
        assert not set(body) & set(head) and set(body) | set(head) == every, name
        assert len(body) + len(head) == len(every), name
        names = [n for n, _ in model.named_parameters()]
        assert all(n.startswith(("body.", "head.")) for n in names), name


def test_new_models_refuse_inputs_they_cannot_take():
    for name, shape, why in (("vgg11", (1, 28, 28), "multiples of 32"), ("vgg11", (96,), "multiples of 32"),
                             ("tabular_mlp", (1, 8, 8), r"rows of features \[D\]"),
                             ("text_cnn", (4,), "at least 5 tokens"), ("char_lstm", (2, 8), r"\[seq_len\]"),
                             ("text_transformer", (1, 8, 8), r"\[seq_len\]")):
        spec = MODELS.get(name)
        with pytest.raises(ConfigError, match=why):
            build_model(name, shape, 3, vocab_size=spec.vocab if spec.tokens else 0)
    assert build_model("vgg11", (3, 64, 64), 5).body[-6].in_features == 512 * 2 * 2    # Tiny-ImageNet's size


# ----------------------------------------------------------------------------------------------- FLOPs


def test_multiply_adds_by_hand():
    """Linear 4->3: 12. Conv 2->3, 3x3, on 5x5 (valid): 3x3 outputs x 3 maps x (2 x 9) = 486. LSTM 2->3 over
    4 steps: 4 x 4 gates x 3 x (2 + 3) = 240; two layers, both directions: 2 x 4 x 12 x (2 + 3) +
    2 x 4 x 12 x (6 + 3) = 1344. GRU, two layers: 4 x 9 x 5 + 4 x 9 x 6 = 396. LeNet-5 on 1x32x32:
    6 x 28 x 28 x 25 + 16 x 10 x 10 x 150 + 400 x 120 + 120 x 84 + 84 x 10 = 416,520."""
    assert forward_macs(nn.Linear(4, 3), (4,)) == 12
    assert forward_macs(nn.Conv2d(2, 3, 3), (2, 5, 5)) == 486
    assert forward_macs(nn.LSTM(2, 3, batch_first=True), (4, 2)) == 240
    assert forward_macs(nn.LSTM(2, 3, num_layers=2, bidirectional=True, batch_first=True), (4, 2)) == 1344
    assert forward_macs(nn.GRU(2, 3, num_layers=2, batch_first=True), (4, 2)) == 396
    lenet = 6 * 28 * 28 * 25 + 16 * 10 * 10 * 150 + 400 * 120 + 120 * 84 + 84 * 10
    assert forward_macs(build_model("lenet5", (1, 32, 32), 10), (1, 32, 32)) == lenet == 416_520
    # char_lstm: two LSTM layers over 80 characters (embedding 8, hidden 256) and the head
    lstm = 80 * 4 * 256 * (8 + 256) + 80 * 4 * 256 * (256 + 256) + 256 * 10
    assert forward_macs(build_model("char_lstm", (80,), 10, vocab_size=80), (80,), torch.int64) == lstm
    # text_cnn: widths 3/4/5 over 25 tokens of 128 dims, 100 maps each, and fc 300 -> 10
    conv = sum(100 * (25 - w + 1) * 128 * w for w in (3, 4, 5))
    assert forward_macs(build_model("text_cnn", (25,), 10, vocab_size=50), (25,), torch.int64) == conv + 3000
    # text_transformer: per layer over 25 positions of width 64, 4 heads of 16: q/k/v, q k^T, att v, out, FFN
    layer = 25 * 64 * 192 + 4 * 25 * 25 * 16 * 2 + 25 * 64 * 64 + 2 * 25 * 64 * 128
    assert forward_macs(build_model("text_transformer", (25,), 10, vocab_size=50), (25,), torch.int64) == \
        2 * layer + 64 * 10


def test_counting_leaves_the_model_as_it_was():
    """Counted in evaluation mode (a BatchNorm layer's running statistics do not move), then put back."""
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    before = model[1].running_mean.clone()
    assert forward_macs(model, (4,)) == 12 and model.training
    assert torch.equal(model[1].running_mean, before) and int(model[1].num_batches_tracked) == 0
    model.eval()
    forward_macs(model, (4,))
    assert not model.training


def test_models_listing_shows_parameters_and_multiply_adds_of_every_model():
    from fedprism.cli import main

    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["models"]) == 0
    text = out.getvalue()
    blocks = {b.split("  (")[0].strip(): b for b in text.split("\n\n") if "  (" in b.splitlines()[0]}
    assert set(MODELS.names()) <= set(blocks)
    for name in MODELS.names():
        forward = [ln for ln in blocks[name].splitlines() if ln.startswith("forward")]
        assert forward and "multiply-adds per sample" in forward[0], name
    assert "416,520 (417 k) multiply-adds" in blocks["lenet5"] and "61,706 on [1x32x32]" in blocks["lenet5"]
    assert "vocabulary 80" in blocks["char_lstm"]


# -------------------------------------------------------------------------------------- runs on tiny data


def _images(pad32=False, root=None):
    g = np.random.default_rng(0)
    x = g.normal(0, 1, (36, 3, 32, 32)).astype(np.float32)
    y = np.arange(36) % 3
    x[np.arange(36), y] += 1.0                                   # the label shifts one channel
    t = torch.from_numpy
    return Dataset("tinyimg", t(x[:24]), t(y[:24]), t(x[24:]), t(y[24:]), ["a", "b", "c"], source="generated")


def _rows(pad32=False, root=None):
    g = np.random.default_rng(1)
    y = np.arange(90) % 3
    x = (g.normal(0, 1, (90, 10)) + y[:, None] * 0.8).astype(np.float32)
    t = torch.from_numpy
    return Dataset("tinyrows", t(x[:60]), t(y[:60]), t(x[60:]), t(y[60:]), ["a", "b", "c"], source="generated")


@pytest.fixture
def tiny():
    fedprism.register_dataset("tinyimg", DatasetSpec(name="tinyimg", load=_images, class_names=("a", "b", "c"),
                                                     input_shape=(3, 32, 32), normalisation="none"))
    fedprism.register_dataset("tinyrows", DatasetSpec(name="tinyrows", load=_rows, class_names=("a", "b", "c"),
                                                      input_shape=(10,), normalisation="none"))
    yield
    DATASETS.pop("tinyimg")
    DATASETS.pop("tinyrows")
    from fedprism.experiment.federation import clear_federations
    clear_federations()


RUN = dict(clients=2, rounds=1, local_epochs=1, batch_size=8, lr=0.01, device="cpu", compile="false", seed=0)


def test_vgg11_runs_a_round_through_the_cli(tiny, tmp_path):
    from fedprism.cli import main

    out = io.StringIO()
    with redirect_stdout(out):
        rc = main(["run", "--db", str(tmp_path / "v.db"), "--json", "method=fedper", "dataset=tinyimg",
                   "model=vgg11", *[f"{k}={v}" for k, v in RUN.items()]])
    assert rc == 0
    final = json.loads(out.getvalue().strip().splitlines()[-1])
    assert 0.0 <= final["local_acc"] <= 1.0


def test_tabular_mlp_runs_a_round_alike_in_both_engines(tiny, tmp_path):
    """Dropout in the body (`SeededDropout`): the vectorized engine trains with the sequential one's masks."""
    got = {}
    for engine in ("sequential", "vectorized"):
        r = fedprism.run(**RUN, dataset="tinyrows", model="tabular_mlp", method="fedavg", engine=engine,
                         db=tmp_path / f"{engine}.db")
        got[engine] = r.final
    for k in ("local_acc", "global_acc", "local_f1", "sdad"):
        assert got["vectorized"][k] == pytest.approx(got["sequential"][k], abs=1e-9), k
    with pytest.raises(ConfigError, match="rows of features"):
        fedprism.run(**RUN, dataset="tinyimg", model="tabular_mlp", db=tmp_path / "x.db")


# ------------------------------------------------------------------------ the papers' formulas, by hand


def test_vgg11_is_configuration_a():
    """Configuration A (Simonyan & Zisserman 2014, Table 1) on 3x32x32: eight 3x3 convolutions 3-64, 64-128,
    128-256, 256-256, 256-512, 512-512, 512-512, 512-512 at 32, 16, 8, 8, 4, 4, 2, 2 pixels (max-pooling
    after the 1st, 2nd, 4th, 6th and 8th), then fc 512-512, 512-512, 512-10: parameters and multiply-adds
    counted by hand."""
    convs = [(3, 64, 32), (64, 128, 16), (128, 256, 8), (256, 256, 8), (256, 512, 4), (512, 512, 4),
             (512, 512, 2), (512, 512, 2)]
    params = sum(i * o * 9 + o for i, o, _ in convs) + 2 * (512 * 512 + 512) + 512 * 10 + 10
    macs = sum(s * s * i * o * 9 for i, o, s in convs) + 2 * 512 * 512 + 512 * 10
    model = build_model("vgg11", (3, 32, 32), 10)
    assert sum(p.numel() for p in model.parameters()) == params == 9_750_922
    assert forward_macs(model, (3, 32, 32)) == macs == 153_293_824
    kinds = [type(m).__name__ for m in model.body if not isinstance(m, nn.ReLU)]
    assert kinds[:13] == ["Conv2d", "MaxPool2d", "Conv2d", "MaxPool2d", "Conv2d", "Conv2d", "MaxPool2d",
                          "Conv2d", "Conv2d", "MaxPool2d", "Conv2d", "Conv2d", "MaxPool2d"]
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def test_text_cnn_is_max_over_time_of_relu_filters():
    """Kim (2014), eq. (2)-(3): c_i = ReLU(w . x_{i:i+h-1} + b) for each filter of width h, c_hat = max_i c_i;
    computed here position by position from the model's weights."""
    model = build_model("text_cnn", (9,), 4, seed=3, vocab_size=20).eval()
    x = torch.randint(0, 20, (2, 9), generator=torch.Generator().manual_seed(1))
    emb = model.body[0].embedding.weight[x]                                   # [B, T, E]
    want = []
    for conv in model.body[1].convs:
        h = conv.kernel_size[0]
        c = torch.stack([torch.einsum("bte,fet->bf", emb[:, i:i + h], conv.weight) + conv.bias
                         for i in range(9 - h + 1)], dim=2)
        want.append(torch.relu(c).amax(dim=2))
    with torch.no_grad():
        got = model(x, features_only=True)
    assert torch.allclose(got, torch.cat(want, dim=1), atol=1e-5)


def test_char_lstm_predicts_from_the_last_position():
    """The next character is predicted from the top layer's output after the whole sequence: the logits move
    with the last character (and with the first, through the recurrence)."""
    model = build_model("char_lstm", (12,), 5, seed=0, vocab_size=9).eval()
    x = torch.randint(0, 9, (1, 12), generator=torch.Generator().manual_seed(2))
    last, first = x.clone(), x.clone()
    last[0, -1] = (x[0, -1] + 1) % 9
    first[0, 0] = (x[0, 0] + 1) % 9
    with torch.no_grad():
        base, a, b = model(x), model(last), model(first)
        out, _ = model.body.lstm(model.body.embedding(x))
        assert torch.equal(model(x, features_only=True), out[:, -1])
    assert not torch.allclose(base, a) and not torch.allclose(base, b)


def test_text_transformer_is_the_pre_ln_encoder_by_hand():
    """Vaswani et al. (2017) attention softmax(Q K^T / sqrt(d_k)) V per head (d_k = 64 / 4), in pre-LN layers
    (Xiong et al. 2020), final LayerNorm, mean over positions; written out head by head from the weights."""
    import torch.nn.functional as F

    model = build_model("text_transformer", (6,), 3, seed=5, vocab_size=11).eval()
    enc = model.body
    x = torch.randint(0, 11, (2, 6), generator=torch.Generator().manual_seed(4))
    h = enc.embedding.weight[x] + enc.position
    for layer in enc.layers:
        a = layer.ln1(h)
        q, k, v = (a @ layer.attn.qkv.weight.T + layer.attn.qkv.bias).split(64, dim=-1)
        heads = []
        for j in range(4):
            s = slice(16 * j, 16 * (j + 1))
            w = F.softmax(q[..., s] @ k[..., s].transpose(1, 2) / 4.0, dim=-1)
            heads.append(w @ v[..., s])
        h = h + layer.attn.out(torch.cat(heads, dim=-1))
        f = layer.ln2(h)
        h = h + layer.ffn[2](F.gelu(layer.ffn[0](f)))
    want = enc.ln(h).mean(dim=1)
    with torch.no_grad():
        assert torch.allclose(model(x, features_only=True), want, atol=1e-5)
