"""pFedMe (arXiv:2006.08848, Algorithm 1): the inner solve and one local step by hand, the server's beta
step, the reducing setting (K = 1, lambda = personal_lr = 1 is FedAvg bit for bit), personalisation on
a non-IID federation, and the engines' agreement."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import planted_federation, same, unequal_federation

from fedprism.algorithms import REGISTRY
from fedprism.algorithms.base import Context, Update
from fedprism.algorithms.fedavg import FedAvg
from fedprism.algorithms.fedprox import prox_job
from fedprism.algorithms.pfedme import PFedMe, moreau_loss
from fedprism.engine import LocalConfig, SequentialEngine
from fedprism.engine.vectorized import VectorizedEngine
from fedprism.experiment.config import resolve
from fedprism.experiment.runner import Experiment, Simulator
from fedprism.experiment.store import Store
from fedprism.models import build_model
from fedprism.params import ParamSpec, flatten

SMALL = dict(dataset="digits", clients=6, rounds=3, fraction=0.5, local_epochs=1, batch_size=16, lr=0.05,
             model="mlp", device="cpu", seed=1)                               # SGD momentum 0.9 (default)


class Linear:
    """logits = x @ W, W = w.view(d, C): softmax regression, gradients in closed form."""

    def __init__(self, d, c):
        self.d, self.c = d, c

    def __call__(self, w, x):
        return x @ w.reshape(self.d, self.c)


def test_inner_solve_is_k_steps_of_gradient_descent_by_hand():
    """The loss's value is f(theta~; D) + (lambda/2)||w - theta~||^2 and its gradient lambda (w - theta~),
    theta~ = K steps theta <- theta - plr (grad f(theta) + lambda (theta - w)) from w (Algorithm 1)."""
    d, c, B = 4, 3, 6
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(B, d, generator=g), torch.randn(d * c, generator=g)
    y = torch.tensor([0, 2, 1, 2, 0, 1])
    model, ones = Linear(d, c), torch.ones(B)

    def f(theta):
        return F.cross_entropy(x @ theta.reshape(d, c), y)

    def grad_f(theta):                           # X^T (softmax(X Theta) - Y) / B
        p = torch.softmax(x @ theta.reshape(d, c), -1)
        return (x.T @ (p - F.one_hot(y, c).float()) / B).reshape(-1)

    for k, lam, plr in ((1, 15.0, 0.05), (5, 15.0, 0.05), (3, 2.0, 0.3)):
        theta = w.clone()
        for _ in range(k):
            theta = theta - plr * (grad_f(theta) + lam * (theta - w))
        ex = {"lam": torch.tensor(lam), "personal_lr": torch.tensor(plr)}
        gw, value = torch.func.grad_and_value(lambda v: moreau_loss(k)(model, v, x, y, ones, ex))(w)
        torch.testing.assert_close(gw, lam * (w - theta), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(value, f(theta) + 0.5 * lam * ((w - theta) ** 2).sum())
        wr = w.clone().requires_grad_(True)                # the sequential engine's autograd path
        (ga,) = torch.autograd.grad(moreau_loss(k)(model, wr, x, y, ones, ex), wr)
        assert torch.equal(ga, gw)


def _one_client_engines(digits, **local):
    """Both engines on a federation whose clients hold <= 16 samples: one batch, one local step."""
    fed = unequal_federation(digits, sizes=(7, 12, 16))
    model = build_model("mlp", fed.input_shape, fed.num_classes, seed=0)
    cfg = LocalConfig(epochs=1, batch_size=16, **local)
    ctx = Context(fed.num_clients, fed.num_classes, ParamSpec.of(model), flatten(model), fed.n_train,
                  fed.label_hist(), 0, 10, 1.0)
    return fed, ctx, (SequentialEngine(fed, model, cfg, 0),
                      VectorizedEngine(fed, model, cfg, 0, compile=False))


def test_one_local_step_is_the_papers_update_by_hand(digits):
    """One batch, plain SGD (momentum 0): w_1 = w - eta lambda (w - theta~), theta~ K inner steps on the
    client's batch, computed here with autograd on the model; in both engines."""
    lam, plr, k, eta = 15.0, 0.05, 5, 0.02
    fed, ctx, engines = _one_client_engines(digits, lr=eta, momentum=0.0)
    algo = PFedMe(ctx, lam=lam, k=k, personal_lr=plr, personal_epochs=0)
    S = np.arange(fed.num_clients)
    plan = algo.plan(algo.init_state(), 0, S)
    w = plan.start[0]
    f = engines[0].f
    want = []
    for i in S:
        x, y = engines[0].data(int(i), "train")
        theta = w.clone()
        for _ in range(k):
            th = theta.clone().requires_grad_(True)
            (gf,) = torch.autograd.grad(F.cross_entropy(f(th, x), y), th)
            theta = theta - plr * (gf + lam * (theta - w))
        want.append(w - eta * lam * (w - theta))
    want = torch.stack(want)
    for engine in engines:
        up = algo.client_update(plan, engine, 0, {})
        torch.testing.assert_close(up.params, want, rtol=1e-5, atol=1e-6)
        assert torch.equal(up.client_state["theta"], up.params)      # personal_epochs = 0: w_{i,R}
        assert (up.params != w).any(1).all()


def test_theta_is_the_inner_problem_solved_at_the_final_local_model(digits):
    """theta_i: `personal_epochs` epochs of f_i(theta) + (lambda/2)||theta - w_{i,R}||^2 from w_{i,R} on the
    stream `pfedme` (a replay of that job), not the uploaded w_{i,R} itself."""
    fed, ctx, (engine, _) = _one_client_engines(digits, lr=0.05, momentum=0.9)
    algo = PFedMe(ctx, personal_epochs=2)
    S = np.arange(fed.num_clients)
    up = algo.client_update(algo.plan(algo.init_state(), 0, S), engine, 0, {})
    replay = engine.train(prox_job(S, up.params, up.params, 15.0, epochs=2, stream="pfedme"), 0).params
    assert torch.equal(up.client_state["theta"], replay)
    assert (up.client_state["theta"] != up.params).any(1).all()


def test_server_beta_mixes_the_mean_with_the_previous_model():
    """beta = 1: FedAvg's aggregate bit for bit (a mean replay); beta = 2 (the paper's other value):
    (1 - beta) w^t + beta * mean, by hand; both through `weighting`."""
    P = 3
    init = torch.tensor([1.0, -2.0, 0.5])
    ctx = Context(num_clients=3, num_classes=2, spec=None, init=init, n_train=np.ones(3),
                  label_hist=np.ones((3, 2)), seed=0, rounds=1, fraction=1.0)
    X = torch.tensor([[0.0, 1.0, 2.0], [3.0, -1.0, 0.25], [6.0, 4.0, -1.0]])
    n = torch.tensor([1.0, 2.0, 5.0], dtype=torch.float64)
    up = Update(np.arange(3), {"params": X.clone()}, n, sent={"params": init.expand(3, P).clone()})
    for weighting, wt in (("samples", n), ("uniform", torch.ones(3, dtype=torch.float64))):
        ref = FedAvg(ctx, weighting=weighting)
        s_ref = ref.init_state()
        ref.aggregate(s_ref, 0, up)
        algo = PFedMe(ctx, weighting=weighting)
        s = algo.init_state()
        algo.aggregate(s, 0, up)
        assert torch.equal(s["w"], s_ref["w"])
        mean = (wt / wt.sum()) @ X.double()
        assert torch.equal(s["w"], mean.float())
        algo = PFedMe(ctx, weighting=weighting, beta=2.0)
        s = algo.init_state()
        algo.aggregate(s, 0, up)
        assert torch.equal(s["w"], ((1 - 2.0) * init.double() + 2.0 * mean).float()), weighting


def _run(tmp_path, method, **kw):
    c = resolve({**SMALL, "method": method, **{k.replace("__", "."): v for k, v in kw.items()}})
    e = Experiment(c, Store(tmp_path / f"{method}-{c.run_id}.db"))
    res = e.run()
    assert res.status == "finished"
    return e, res


@pytest.mark.parametrize("engine", ["sequential", "vectorized"])
def test_k1_lambda1_personal_lr1_is_fedavg_bit_for_bit(engine, tmp_path):
    """K = 1, lambda = personal_lr = 1: the local gradient lambda (w - theta~) is grad f(w; D) itself, so
    the global model is FedAvg's, bit for bit, through the runner (SGD momentum 0.9); other settings
    are not."""
    ea, ra = _run(tmp_path, "fedavg", engine=engine)
    eb, rb = _run(tmp_path, "pfedme", engine=engine, pfedme__k=1, pfedme__lam=1.0, pfedme__personal_lr=1.0)
    assert torch.equal(ea.state["w"], eb.state["w"])
    for ha, hb in zip(ra.history, rb.history):
        assert hb["global_model_acc"] == ha["global_acc"]
        for key in ("bytes_up", "bytes_down", "clients", "accepted"):
            assert ha[key] == hb[key], key
    ec, _ = _run(tmp_path, "pfedme", engine=engine, pfedme__k=2, pfedme__lam=1.0, pfedme__personal_lr=1.0)
    assert not torch.equal(ea.state["w"], ec.state["w"])


def test_personal_models_beat_the_global_model_on_planted_digits(digits):
    """Two disjoint label groups, lambda = 1: each client's theta_i scores higher on its own test split
    than the global w does, and theta_i never travels (upload: the local w only; evaluation sends
    nothing). (With the default lambda = 15, theta_i stays close to w in a run this short.)"""
    fed = planted_federation(digits, clients_per_group=3, per_client=40)[0]
    model = build_model("mlp", fed.input_shape, fed.num_classes, seed=0)
    ctx = Context(fed.num_clients, fed.num_classes, ParamSpec.of(model), flatten(model), fed.n_train,
                  fed.label_hist(), 0, 10, 1.0)
    engine = SequentialEngine(fed, model, LocalConfig(epochs=2, batch_size=16, lr=0.05, momentum=0.9), 0)
    sim = Simulator(REGISTRY["pfedme"](ctx, lam=1.0, personal_epochs=2), engine)
    S = np.arange(fed.num_clients)
    for t in range(4):
        plan, up, _ = sim.round(t, S)
        assert set(plan.payload) == set(up.payload) == {"params"}
    assert sim.algo.eval_payload(sim.state, S) == {}
    theta = sim.inference().single
    assert torch.equal(theta, sim.clients.data["theta"])
    personal = engine.evaluate(theta, S, "local").accuracy
    glob = engine.evaluate(sim.state["w"].expand(len(S), -1), S, "local").accuracy
    assert (personal > glob).all() and float(personal.mean()) > float(glob.mean()) + 0.1, (personal, glob)


def test_sequential_and_vectorized_engines_agree(digits):
    """Unequal clients (padded last batches, slots reloaded), SGD with momentum: the uploads and the
    personal models of both engines agree to float tolerance."""
    fed = unequal_federation(digits)
    model = build_model("mlp", fed.input_shape, fed.num_classes, seed=0)
    ctx = Context(fed.num_clients, fed.num_classes, ParamSpec.of(model), flatten(model), fed.n_train,
                  fed.label_hist(), 0, 10, 1.0)
    cfg = LocalConfig(epochs=2, batch_size=16, lr=0.05, momentum=0.9)
    algo = PFedMe(ctx)
    plan = algo.plan(algo.init_state(), 0, np.arange(fed.num_clients))
    seq = algo.client_update(plan, SequentialEngine(fed, model, cfg, 3), 0, {})
    vec = algo.client_update(plan, VectorizedEngine(fed, model, cfg, 3, compile=False, max_slots=2), 0, {})
    assert same(seq.params, vec.params, atol=1e-6)
    assert same(seq.client_state["theta"], vec.client_state["theta"])
    assert same(seq.metrics["train_loss"], vec.metrics["train_loss"])
    assert (seq.params != plan.start).any(1).all()


@pytest.mark.slow
def test_compiled_vectorized_engine_agrees(digits):
    """The nested torch.func.grad under torch.compile: no fallback to eager, the eager numbers (~2 min
    of compiling on a 2-core CPU)."""
    import warnings
    fed = unequal_federation(digits, sizes=(7, 20, 33))
    model = build_model("mlp", fed.input_shape, fed.num_classes, seed=0)
    ctx = Context(fed.num_clients, fed.num_classes, ParamSpec.of(model), flatten(model), fed.n_train,
                  fed.label_hist(), 0, 10, 1.0)
    cfg = LocalConfig(epochs=1, batch_size=16, lr=0.05, momentum=0.9)
    algo = PFedMe(ctx, personal_epochs=0)
    plan = algo.plan(algo.init_state(), 0, np.arange(fed.num_clients))
    eager = algo.client_update(plan, SequentialEngine(fed, model, cfg, 3), 0, {})
    engine = VectorizedEngine(fed, model, cfg, 3, compile=True, max_slots=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)              # a compile failure warns and goes eager
        got = algo.client_update(plan, engine, 0, {})
    assert all(s.cfn is not None for s in engine._steps.values())
    assert same(eager.params, got.params, atol=1e-6)
