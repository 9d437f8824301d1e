"""Seeded dropout (`fedprism.models.dropout`) and the Clust-PSI-PFL CIFAR-10 CNN (`clustpsi_cifar_cnn`):
masks fixed by (run seed, round, client, stream, step), different between clients, steps and layers;
rate p = 0 is the model without dropout bit for bit; evaluation runs without dropout and is deterministic.
The engines' agreement with dropout is in tests/test_engine_equivalence.py, Flower's in tests/test_flower.py."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from fedprism.engine.base import LocalConfig, dropout_key, dropout_seed
from fedprism.engine.sequential import SequentialEngine
from fedprism.engine.vectorized import VectorizedEngine
from fedprism.errors import ConfigError
from fedprism.models import PsiCifarCNN, build_model
from fedprism.models.dropout import SeededDropout, hash32, hash32_int, keep_mask
from fedprism.params import Functional, flatten
from fedprism.protocol import TrainJob
from test_engine_equivalence import make_fed, starts

CFG = LocalConfig(epochs=1, batch_size=8, lr=0.01, momentum=0.9)


def mask_of(seed: int, rnd: int, client: int, step: int, salt: int = 0, stream: str = "train",
            shape=(32, 100), p: float = 0.5) -> torch.Tensor:
    return keep_mask(dropout_key(dropout_seed(seed, rnd, client, stream), step), salt, *shape, p)


def without_dropout(model: nn.Module) -> nn.Module:
    """A copy of `model` with every SeededDropout replaced by nn.Identity (same parameters)."""
    twin = copy.deepcopy(model)
    for name, m in list(twin.named_modules()):
        for child, sub in list(m.named_children()):
            if isinstance(sub, SeededDropout):
                setattr(m, child, nn.Identity())
    assert not any(isinstance(m, SeededDropout) for m in twin.modules())
    return twin


def test_hash32_is_the_published_triple32():
    # the reference: the published rounds on Python's unbounded integers, reduced mod 2^32 after each product
    def ref(x: int) -> int:
        M = 0xFFFFFFFF
        x ^= x >> 17
        x = (x * 0xED5AD4BB) & M
        x ^= x >> 11
        x = (x * 0xAC4C1B51) & M
        x ^= x >> 15
        x = (x * 0x31848BAB) & M
        return x ^ (x >> 14)
    xs = [0, 1, 2, 12345, 2**31 - 1, 2**31, 2**32 - 1, 0xDEADBEEF]
    got = hash32(torch.tensor(xs, dtype=torch.int64)).tolist()
    assert got == [ref(x) for x in xs]
    assert [hash32_int(x) for x in xs] == got                                   # the host twin, same bits
    assert len(set(hash32(torch.arange(1 << 16)).tolist())) == 1 << 16          # a bijection on a range


def test_masks_are_reproducible_and_differ_between_clients_steps_rounds_layers_streams():
    a = mask_of(7, 3, 2, 5)
    assert torch.equal(a, mask_of(7, 3, 2, 5))                                   # reproducible
    others = [mask_of(7, 3, 1, 5), mask_of(7, 3, 2, 6), mask_of(7, 4, 2, 5), mask_of(8, 3, 2, 5),
              mask_of(7, 3, 2, 5, salt=1), mask_of(7, 3, 2, 5, stream="ditto")]
    for o in others:
        agree = float((o == a).double().mean())
        assert 0.4 < agree < 0.6                     # independent masks of rate 1/2 agree on about half
    # rows (samples of a batch) differ from each other, and a sample's mask does not depend on the batch size
    assert not torch.equal(a[0], a[1])
    assert torch.equal(mask_of(7, 3, 2, 5, shape=(8, 100))[:8], a[:8])


@pytest.mark.parametrize("p", [0.2, 0.5, 0.9])
def test_drop_rate_is_p(p):
    m = mask_of(0, 0, 0, 0, shape=(64, 4096), p=p)
    rate = 1.0 - float(m.double().mean())
    assert abs(rate - p) < 4 * np.sqrt(p * (1 - p) / m.numel())                 # four standard errors


def test_layer_scales_kept_activations_and_is_identity_without_key():
    layer = SeededDropout(0.25)
    x = torch.randn(16, 3, 5, 5)
    assert torch.equal(layer(x), x)                                             # no key: identity
    layer.key = dropout_key(123, 4)
    y = layer(x)
    keep = keep_mask(layer.key, 0, 16, 75, 0.25).view_as(x)
    assert torch.equal(y[keep], x[keep] * (1 / 0.75)) and bool((y[~keep] == 0).all())
    assert 0 < int((~keep).sum()) < x.numel()
    with pytest.raises(ValueError, match="dropout rate"):
        SeededDropout(1.0)


def _cnn(rates=PsiCifarCNN.RATES, head=PsiCifarCNN.HEAD_RATE):
    torch.manual_seed(0)
    return PsiCifarCNN(1, (8, 8), 10, rates=rates, head_rate=head)


def test_the_paper_cifar_cnn():
    m = build_model("clustpsi_cifar_cnn", (3, 32, 32), 10, seed=0)
    convs = [mod for mod in m.body if isinstance(mod, nn.Conv2d)]
    assert [c.out_channels for c in convs] == [32, 32, 64, 64, 128, 128]
    assert all(c.kernel_size == (3, 3) and c.padding == (1, 1) for c in convs)
    assert [d.p for d in m.modules() if isinstance(d, SeededDropout)] == [0.2, 0.3, 0.4, 0.5]
    assert sum(isinstance(mod, nn.modules.batchnorm._BatchNorm) for mod in m.modules()) == 7
    fc = [mod for mod in m.modules() if isinstance(mod, nn.Linear)]
    assert [(f.in_features, f.out_features) for f in fc] == [(128 * 4 * 4, 128), (128, 10)]
    assert Functional(m).dropout == ("body.7.key", "body.15.key", "body.23.key", "head.0.key")
    assert torch.equal(flatten(m), flatten(build_model("clustpsi_cifar_cnn", (3, 32, 32), 10, seed=0)))
    with pytest.raises(ConfigError, match="multiples of 8"):
        build_model("clustpsi_cifar_cnn", (1, 28, 28), 10)


@pytest.mark.parametrize("engine", [SequentialEngine, VectorizedEngine])
def test_rate_zero_is_the_model_without_dropout_bit_for_bit(engine):
    fed = make_fed((1, 8, 8), sizes=(5, 19, 10), n_test=(6, 0, 9))
    zero = _cnn((0.0, 0.0, 0.0), 0.0)
    kw = {"compile": False} if engine is VectorizedEngine else {}
    a = engine(fed, zero, CFG, 3, "cpu", **kw)
    b = engine(fed, without_dropout(zero), CFG, 3, "cpu", **kw)
    job = TrainJob(np.array([0, 1, 2]), starts(zero, 3, seed=8))
    ta, tb = a.train(job, 2), b.train(job, 2)
    assert torch.equal(ta.params, tb.params) and torch.equal(ta.loss, tb.loss)
    assert not torch.equal(ta.params, job.start)


@pytest.mark.parametrize("engine", [SequentialEngine, VectorizedEngine])
def test_dropout_trains_differently_and_evaluates_without_dropout(engine):
    fed = make_fed((1, 8, 8), sizes=(5, 19, 10), n_test=(6, 0, 9))
    model = _cnn()
    kw = {"compile": False} if engine is VectorizedEngine else {}
    drop = engine(fed, model, CFG, 3, "cpu", **kw)
    plain = engine(fed, without_dropout(model), CFG, 3, "cpu", **kw)
    job = TrainJob(np.array([0, 1, 2]), starts(model, 3, seed=8))
    t1, t2 = drop.train(job, 2), drop.train(job, 2)
    assert torch.equal(t1.params, t2.params)                                      # reproducible
    assert not torch.allclose(t1.params, plain.train(job, 2).params, atol=1e-3)   # dropout is on in training
    # evaluation: no dropout, deterministic, the same numbers as the model without dropout layers
    clients = np.array([0, 1, 2])
    for split in ("local", "global", "train"):
        e1, e2 = drop.evaluate(t1.params, clients, split), drop.evaluate(t1.params, clients, split)
        e3 = plain.evaluate(t1.params, clients, split)
        assert torch.equal(e1.correct, e2.correct) and torch.equal(e1.loss_sum, e2.loss_sum), split
        assert torch.equal(e1.correct, e3.correct) and torch.equal(e1.loss_sum, e3.loss_sum), split
    x = fed.x_test[:20]
    assert torch.equal(drop.logits(t1.params, x), drop.logits(t1.params, x))
    assert torch.equal(drop.logits(t1.params, x), plain.logits(t1.params, x))


def test_a_clients_masks_do_not_depend_on_its_cohort():
    fed = make_fed((1, 8, 8), sizes=(5, 19, 10), n_test=(6, 0, 9))
    model = _cnn()
    eng = SequentialEngine(fed, model, CFG, 3, "cpu")
    s = starts(model, 3, seed=8)
    both = eng.train(TrainJob(np.array([0, 2]), s[[0, 2]]), 1)
    alone = eng.train(TrainJob(np.array([2]), s[[2]]), 1)
    assert torch.equal(both.params[1], alone.params[0])
