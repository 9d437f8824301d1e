"""Per-FedAvg: the FO and HF directions by hand on a tiny model, one engine step, alpha = 0 is FedAvg bit
for bit, the evaluation step by hand and eval_steps = 0, the engines agree (compiled too), and on a
non-IID federation the adapted models beat the un-adapted global model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import planted_federation, unequal_federation

from fedprism.algorithms import REGISTRY
from fedprism.algorithms.base import Context, Plan, TrainJob
from fedprism.algorithms.perfedavg import maml_fo, maml_hf
from fedprism.engine import LocalConfig, SequentialEngine
from fedprism.engine.base import batch_order, stream_seed
from fedprism.engine.vectorized import VectorizedEngine
from fedprism.experiment.config import resolve
from fedprism.experiment.runner import Experiment
from fedprism.experiment.store import Store
from fedprism.models import build_model
from fedprism.params import ParamSpec, flatten

SMALL = dict(dataset="digits", clients=6, rounds=3, fraction=0.5, local_epochs=1, batch_size=16, lr=0.05,
             model="mlp", engine="sequential", device="cpu", seed=1)          # SGD momentum 0.9 (default)
TIMING = {"train_s", "eval_s", "wall_s"}


def tiny(w, x):
    """A 21-parameter model: tanh(x A) B, A [4, 3], B [3, 3]."""
    return torch.tanh(x @ w[:12].view(4, 3)) @ w[12:].view(3, 3)


def tiny_batch(n=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    w, x = torch.randn(21, generator=g), torch.randn(n, 4, generator=g)
    return w, x, torch.randint(0, 3, (n,), generator=g)


def ce_grad(w, x, y):
    w = w.detach().requires_grad_(True)
    return torch.autograd.grad(F.cross_entropy(tiny(w, x), y), w)[0]


def direction(loss, w, x, y, alpha):
    wr = w.clone().requires_grad_(True)
    value = loss(tiny, wr, x, y, torch.ones(len(y)), {"alpha": torch.tensor(alpha)})
    return torch.autograd.grad(value, wr)[0], value.detach()


def test_fo_direction_is_the_hand_computed_maml_step():
    w, x, y = tiny_batch()
    g, value = direction(maml_fo, w, x, y, 0.3)
    w_tmp = w - 0.3 * ce_grad(w, x[0::2], y[0::2])                            # D: positions 0, 2, ...
    torch.testing.assert_close(g, ce_grad(w_tmp, x[1::2], y[1::2]), atol=1e-6, rtol=1e-5)   # D': 1, 3, ...
    torch.testing.assert_close(value, F.cross_entropy(tiny(w_tmp, x[1::2]), y[1::2]))
    one, _ = direction(maml_fo, w, x[:1], y[:1], 0.3)                         # D' empty: no step
    assert torch.equal(one, torch.zeros(21))


def test_hf_direction_uses_the_exact_hessian_vector_product():
    w, x, y = tiny_batch()
    g, _ = direction(maml_hf, w, x, y, 0.3)
    w_tmp = w - 0.3 * ce_grad(w, x[0::3], y[0::3])
    d = ce_grad(w_tmp, x[1::3], y[1::3])
    H = torch.autograd.functional.hessian(lambda v: F.cross_entropy(tiny(v, x[2::3]), y[2::3]), w)   # D''
    torch.testing.assert_close(g, d - 0.3 * H @ d, atol=1e-6, rtol=1e-5)
    assert float((H @ d).norm()) > 1e-2 * float(d.norm())                     # the correction is not nothing
    two_fo, _ = direction(maml_fo, w, x[:2], y[:2], 0.3)                      # D'' empty: HF is FO
    two_hf, _ = direction(maml_hf, w, x[:2], y[:2], 0.3)
    torch.testing.assert_close(two_hf, two_fo, atol=0, rtol=0)


def _algo_engine(fed, local, seed=0, **hp):
    model = build_model("mlp", fed.input_shape, fed.num_classes, seed=seed)
    ctx = Context(fed.num_clients, fed.num_classes, ParamSpec.of(model), flatten(model), fed.n_train,
                  fed.label_hist(), seed, 10, 1.0)
    return REGISTRY["perfedavg"](ctx, **hp), SequentialEngine(fed, model, local, seed)


def test_one_engine_step_is_w_minus_lr_times_the_maml_direction(digits):
    fed = unequal_federation(digits)                                          # client 0 holds 7 samples
    algo, eng = _algo_engine(fed, LocalConfig(epochs=1, batch_size=8, lr=0.05, momentum=0.0), alpha=0.2)
    w = flatten(eng.model)
    up = algo.client_update(Plan(np.array([0]), {"params": w[None].clone()}), eng, 4, {})
    (b,) = batch_order(7, 1, 8, stream_seed(0, 4, 0, "train"))               # the one batch of the step
    x, y = (t[b] for t in eng.data(0, "train"))

    def g(v, xx, yy):
        v = v.detach().requires_grad_(True)
        return torch.autograd.grad(F.cross_entropy(eng.f(v, xx), yy), v)[0]

    want = w - 0.05 * g(w - 0.2 * g(w, x[0::2], y[0::2]), x[1::2], y[1::2])
    torch.testing.assert_close(up.params[0], want, atol=1e-6, rtol=1e-5)


def run(tmp_path, method, **kw):
    c = resolve({**SMALL, "method": method, **{k.replace("__", "."): v for k, v in kw.items()}})
    e = Experiment(c, Store(tmp_path / f"{method}-{c.run_id}.db"))
    res = e.run()
    assert res.status == "finished"
    return e, res, [tuple(r)[1:] for r in e.store.client_rows(c.run_id)]


@pytest.mark.parametrize("variant", ["fo", "hf"])
def test_alpha_zero_is_fedavg_bit_for_bit(tmp_path, variant):
    (ea, ra, ca), (eb, rb, cb) = run(tmp_path, "fedavg"), run(tmp_path, "perfedavg", perfedavg__alpha=0.0,
                                                               perfedavg__variant=variant)
    assert torch.equal(ea.state["w"], eb.state["w"])
    for ha, hb in zip(ra.history, rb.history, strict=True):
        for k in set(ha) - TIMING:
            assert ha[k] == hb[k], (k, ha[k], hb[k])
    assert ca == cb


def test_evaluation_steps_by_hand_and_zero_steps_is_the_global_model(digits):
    fed = planted_federation(digits, clients_per_group=2, per_client=30)[0]
    local = LocalConfig(epochs=1, batch_size=16, lr=0.05, momentum=0.9)
    clients = np.array([1, 3])
    w = 0.05 * torch.randn(2, flatten(build_model("mlp", fed.input_shape, fed.num_classes)).numel(),
                           generator=torch.Generator().manual_seed(0))
    algo, eng = _algo_engine(fed, local, alpha=0.3, eval_steps=0)
    inf = algo.inference(eng, clients, {"params": w}, {})
    assert inf.single is not None and torch.equal(inf.single, w)
    algo, eng = _algo_engine(fed, local, alpha=0.3, eval_steps=2)
    inf = algo.inference(eng, clients, {"params": w}, {})
    assert torch.equal(inf.streams["global"], w) and set(inf.alternatives) == {"global"}
    for i, c in enumerate(clients):
        x, y = eng.data(int(c), "train")
        v = w[i]
        for _ in range(2):                                                    # plain full-batch steps
            vr = v.detach().requires_grad_(True)
            v = v - 0.3 * torch.autograd.grad(F.cross_entropy(eng.f(vr, x), y), vr)[0]
        torch.testing.assert_close(inf.streams["adapted"][i], v, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("loss", [maml_fo, maml_hf])
def test_vectorized_and_sequential_engines_agree(digits, loss):
    """Unequal clients (7, 20, 33, 50, 64, 90 samples, B = 8): padded last batches of 1 and 2 samples, so
    empty parts D' (FO) and D'' (HF) in the sequential engine and all-padding parts in the vectorized one."""
    fed = unequal_federation(digits)
    model = build_model("mlp", fed.input_shape, fed.num_classes, seed=0)
    cfg = LocalConfig(epochs=2, batch_size=8, lr=0.05, momentum=0.9)
    S = np.array([0, 2, 3, 5])
    w = flatten(model).expand(len(S), -1).clone()
    job = TrainJob(S, w, loss=loss, extras={"alpha": torch.full((len(S),), 0.2)})
    a = SequentialEngine(fed, model, cfg, 3).train(job, 1)
    b = VectorizedEngine(fed, model, cfg, 3, "cpu", compile=False, max_slots=2).train(job, 1)
    torch.testing.assert_close(a.params, b.params, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(a.loss, b.loss, atol=1e-5, rtol=1e-5)
    assert float((a.params - w).abs().max()) > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("loss", [maml_fo, maml_hf])
def test_compiled_vectorized_engine_agrees(digits, loss):
    """Both variants under torch.compile, as one graph without breaks (a cold compile took ~15 s for FO
    and ~100 s for HF on this project's 2 cores; a few seconds with a warm inductor cache)."""
    from torch._dynamo.utils import counters

    fed = unequal_federation(digits)
    model = build_model("mlp", fed.input_shape, fed.num_classes, seed=0)
    cfg = LocalConfig(epochs=1, batch_size=8, lr=0.05, momentum=0.9)
    S = np.array([0, 3, 5])
    w = flatten(model).expand(3, -1).clone()
    job = TrainJob(S, w, loss=loss, extras={"alpha": torch.full((3,), 0.2)})
    ref = SequentialEngine(fed, model, cfg, 3).train(job, 1)
    counters.clear()
    eng = VectorizedEngine(fed, model, cfg, 3, "cpu", compile=True, max_slots=2)
    got = eng.train(job, 1)
    assert all(s.cfn is not None for s in eng._steps.values())                   # no fallback to eager
    assert not counters["graph_break"], dict(counters["graph_break"])           # one graph, no breaks
    assert counters["stats"]["unique_graphs"] >= 1
    torch.testing.assert_close(got.params, ref.params, atol=2e-5, rtol=1e-4)


def test_adapted_models_beat_the_global_model_on_non_iid_clients(tmp_path):
    """Two planted label groups: one step of size alpha from the meta-learnt global model raises the
    clients' local accuracy above the global model's own (`local_acc@global`)."""
    c = resolve({**SMALL, "method": "perfedavg", "clients": 6, "rounds": 2, "fraction": 1.0,
                 "partition": "pathological", "partition.shards_per_client": 2, "perfedavg.alpha": 0.2})
    res = Experiment(c, Store(tmp_path / "p.db")).run()
    last = res.history[-1]
    assert last["local_acc"] > last["local_acc@global"] + 0.2, last          # measured: 0.82 against 0.42
