"""FedProx, Ditto and APFL: their reducing settings equal FedAvg bit for bit through the runner, the
proximal / personal pulls act, personal state never leaves the client, APFL's alpha step by hand."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from conftest import planted_federation, unequal_federation

from fedprism.algorithms import REGISTRY
from fedprism.algorithms.apfl import apfl_loss, split
from fedprism.algorithms.base import Context, TensorSpec, TrainJob
from fedprism.engine import LocalConfig, SequentialEngine
from fedprism.engine.base import optimizer_state, optimizer_step
from fedprism.engine.vectorized import VectorizedEngine
from fedprism.experiment.config import resolve
from fedprism.experiment.runner import Experiment, Simulator, sample_clients
from fedprism.experiment.store import Store
from fedprism.models import build_model
from fedprism.objectives import ce
from fedprism.params import ParamSpec, flatten

SMALL = dict(dataset="digits", clients=6, rounds=3, fraction=0.5, local_epochs=1, batch_size=16, lr=0.05,
             model="mlp", engine="sequential", device="cpu", seed=1)          # SGD momentum 0.9 (default)
TIMING = {"train_s", "eval_s", "wall_s"}


def run(tmp_path, method, **kw):
    c = resolve({**SMALL, "method": method, **{k.replace("__", "."): v for k, v in kw.items()}})
    store = Store(tmp_path / f"{method}-{c.run_id}.db")
    e = Experiment(c, store)
    res = e.run()
    assert res.status == "finished"
    return e, res, [tuple(r)[1:] for r in store.client_rows(c.run_id)]      # without the run id


def assert_same_run(ref, got, extra=()):
    """Same final server model and the same stored metrics (every key but the timings and `extra`,
    which only `got` has), round by round and client by client."""
    (ea, ra, ca), (eb, rb, cb) = ref, got
    assert torch.equal(ea.state["w"], eb.state["w"])
    assert len(ra.history) == len(rb.history) == SMALL["rounds"]
    for ha, hb in zip(ra.history, rb.history):
        assert set(hb) - set(ha) == set(extra)
        for k in set(ha) - TIMING:
            assert ha[k] == hb[k], (k, ha[k], hb[k])
    assert ca == cb


def six(digits):
    """Six clients in two planted label groups (digits 0-4 and 5-9), 40 train samples each."""
    return planted_federation(digits, clients_per_group=3, per_client=40)[0]


def engine_and_algo(method, fed, seed=0, local=None, **hp):
    """The method on `fed` (a Federation) with a sequential engine (SGD momentum 0.9 unless `local`)."""
    model = build_model("mlp", fed.input_shape, fed.num_classes, seed=seed)
    ctx = Context(fed.num_clients, fed.num_classes, ParamSpec.of(model), flatten(model), fed.n_train,
                  fed.label_hist(), seed, 10, 1.0)
    local = local or LocalConfig(epochs=2, batch_size=16, lr=0.05, momentum=0.9)
    engine = SequentialEngine(fed, model, local, seed)
    return REGISTRY[method](ctx, **hp), engine


# -- FedProx ---------------------------------------------------------------------------------------------
def test_fedprox_mu_zero_is_fedavg_bit_for_bit(tmp_path):
    assert_same_run(run(tmp_path, "fedavg"), run(tmp_path, "fedprox", fedprox__mu=0.0))


def test_fedprox_mu_pulls_the_local_models_toward_the_received_model(digits):
    dist = {}
    for mu in (0.0, 0.5, 5.0):
        algo, engine = engine_and_algo("fedprox", six(digits), mu=mu)
        plan = algo.plan(algo.init_state(), 0, np.arange(6))
        up = algo.client_update(plan, engine, 0, {})
        dist[mu] = (up.params - plan.start).norm(dim=1)
    assert (dist[0.5] < dist[0.0]).all() and (dist[5.0] < 0.5 * dist[0.5]).all(), dist


# -- Ditto -------------------------------------------------------------------------------------------------
def test_ditto_global_model_is_fedavg_bit_for_bit(tmp_path):
    fedavg, ditto = run(tmp_path, "fedavg"), run(tmp_path, "ditto")
    (ea, ra, _), (eb, rb, _) = fedavg, ditto
    assert torch.equal(ea.state["w"], eb.state["w"])
    for ha, hb in zip(ra.history, rb.history):
        for k in ("train_loss", "bytes_up", "bytes_down", "clients", "accepted"):
            assert ha[k] == hb[k], k
        assert hb["global_model_acc"] == ha["global_acc"]       # the global w, scored as FedAvg's
    assert ra.history[-1]["local_acc"] != rb.history[-1]["local_acc"]    # Ditto predicts with v_k


def test_ditto_personal_models_never_leave_the_client(digits):
    algo, engine = engine_and_algo("ditto", six(digits))
    P = algo.ctx.spec.size
    assert algo.upload() == {"params": TensorSpec(("P",))}
    sim = Simulator(algo, engine)
    for t in range(3):
        sampled = sample_clients(0, t, algo.ctx.num_clients, 0.5)
        before = sim.clients.data["v"].clone()
        plan, up, _ = sim.round(t, sampled)
        v = sim.clients.data["v"]
        trained = v[(v != algo.ctx.init).any(1)]                   # personal models that left w^0
        assert set(plan.payload) == {"params"} and set(up.payload) == {"params"}
        assert up.payload["params"].shape == (len(sampled), P)
        for row in torch.cat([plan.payload["params"], up.payload["params"]]):
            assert not (trained == row).all(1).any()               # no message row is a personal model
        moved = (v != before).any(1)
        assert moved[torch.as_tensor(sampled)].all() and not moved.sum() > len(sampled)
    assert sim.algo.eval_payload(sim.state, np.arange(6)) == {}
    assert torch.equal(sim.inference().single, sim.clients.data["v"])     # each client predicts with v_k


def test_ditto_lambda_pulls_v_toward_the_received_global_model(digits):
    out = {}
    for lam in (0.0, 10.0):
        algo, engine = engine_and_algo("ditto", six(digits), lam=lam)
        S = np.arange(6)
        state = algo.init_state()
        plan = algo.plan(state, 0, S)
        far = plan.start + 0.2 * torch.randn(plan.start.shape, generator=torch.Generator().manual_seed(1))
        up = algo.client_update(plan, engine, 0, {"v": far.clone()})
        out[lam] = up.client_state["v"]
        if lam == 0:           # lambda = 0: v_k is Local training of v_k on the personal stream
            local = engine.train(TrainJob(S, far.clone(), stream="ditto"), 0).params
            assert torch.equal(out[0.0], local)
    d0, d10 = ((out[lam] - plan.start).norm(dim=1) for lam in (0.0, 10.0))
    assert (d10 < 0.2 * d0).all(), (d0, d10)


# -- APFL --------------------------------------------------------------------------------------------------
def test_apfl_fixed_alpha_zero_is_fedavg_bit_for_bit(tmp_path):
    apfl = run(tmp_path, "apfl", apfl__alpha=0.0, apfl__alpha_mode="fixed")
    fedavg = run(tmp_path, "fedavg")
    assert_same_run(fedavg, apfl, extra={"global_model_acc"})
    for ha, hb in zip(fedavg[1].history, apfl[1].history):
        assert hb["global_model_acc"] == ha["global_acc"]


def test_apfl_personal_state_stays_on_the_client(digits, tmp_path):
    algo, engine = engine_and_algo("apfl", six(digits))
    assert algo.upload() == {"params": TensorSpec(("P",))}
    sim = Simulator(algo, engine)
    for t in range(3):
        sampled = sample_clients(0, t, algo.ctx.num_clients, 0.5)
        plan, up, _ = sim.round(t, sampled)
        assert set(plan.payload) == {"params"} and set(up.payload) == {"params"}
        v = sim.clients.data["v"]
        trained = v[(v != algo.ctx.init).any(1)]
        for row in torch.cat([plan.payload["params"], up.payload["params"]]):
            assert not (trained == row).all(1).any()
    a = sim.clients.data["alpha"]
    assert ((a >= 0) & (a <= 1)).all() and (a != 0.5).any()            # adaptive: alpha moved, clipped
    assert set(sim.algo.eval_payload(sim.state, np.arange(6))) == {"params"}
    w, v = sim.state["w"].double(), sim.clients.data["v"].double()       # inference: the mixed model
    want = (a.double()[:, None] * v + (1 - a.double()[:, None]) * w).float()
    assert torch.equal(sim.inference().single, want) and (want != sim.state["w"]).any(1).all()
    fedavg = run(tmp_path, "fedavg")[1].history
    apfl = run(tmp_path, "apfl")[1].history
    assert [h["bytes_up"] for h in apfl] == [h["bytes_up"] for h in fedavg]
    assert [h["bytes_down"] for h in apfl] == [h["bytes_down"] for h in fedavg]


def test_apfl_fixed_alpha_does_not_move(digits):
    algo, engine = engine_and_algo("apfl", six(digits), alpha=0.3, alpha_mode="fixed")
    sim = Simulator(algo, engine)
    sim.round(0, np.arange(6))
    assert (sim.clients.data["alpha"] == torch.tensor(0.3)).all()
    assert (sim.clients.data["v"] != algo.ctx.init).any(1).all()        # v_k trains on the mixed loss


class Linear:
    """logits = x @ W, W = w.view(d, C): a model whose gradients are known in closed form."""

    def __init__(self, d, c):
        self.d, self.c = d, c

    def __call__(self, w, x):
        return x @ w.reshape(self.d, self.c)


def test_apfl_loss_gradient_is_algorithm_1_step_by_hand():
    """One step of Algorithm 1 on a softmax regression: dL/dw = grad f(w), dL/dv = alpha grad f(v_bar),
    dL/dalpha = <v - w, grad f(v_bar)> (Eq. 10), value f(w); one SGD step moves alpha by -eta <.,.>."""
    d, c, B = 4, 3, 5
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(B, d, generator=g), torch.tensor([0, 2, 1, 2, 0])
    w, v = torch.randn(d * c, generator=g), torch.randn(d * c, generator=g)
    model, ones = Linear(d, c), torch.ones(B)

    def grad_f(theta):                           # softmax regression: X^T (softmax(X Theta) - Y) / B
        p = torch.softmax(x @ theta.reshape(d, c), -1)
        return (x.T @ (p - F.one_hot(y, c).float()) / B).reshape(-1)

    for alpha in (0.3, 0.0, 1.0):
        z = torch.cat([w, v, torch.tensor([alpha])])
        gz, value = torch.func.grad_and_value(lambda q: apfl_loss(model, q, x, y, ones, {}))(z)
        gw, gv, ga = split(gz)
        vbar = alpha * v + (1 - alpha) * w
        torch.testing.assert_close(gw, grad_f(w))
        torch.testing.assert_close(gv, alpha * grad_f(vbar))
        torch.testing.assert_close(ga, torch.dot(v - w, grad_f(vbar)))
        assert value == ce(model, w, x, y, ones, {})                     # exactly f(w)
        cfg, eta = LocalConfig(lr=0.1, momentum=0.0), 0.1
        z1, _ = optimizer_step(z, gz, optimizer_state(cfg, z), cfg)
        torch.testing.assert_close(split(z1)[2], torch.tensor(alpha) - eta * torch.dot(v - w, grad_f(vbar)))
    # outside [0, 1] the mixing stays at the boundary and alpha gets no gradient
    z = torch.cat([w, v, torch.tensor([1.4])])
    gz = torch.func.grad(lambda q: apfl_loss(model, q, x, y, ones, {}))(z)
    assert split(gz)[2] == 0 and torch.allclose(split(gz)[1], grad_f(v))


def test_apfl_one_round_moves_alpha_by_the_eq10_step(digits):
    """Through the engine: a client with fewer samples than a batch takes one SGD step per epoch; its new
    alpha is alpha - lr <v - w, grad F_k(v_bar)> with the gradient taken on its whole train set."""
    fed = unequal_federation(digits)                      # client 0 holds 7 samples
    algo, engine = engine_and_algo("apfl", fed, local=LocalConfig(epochs=1, batch_size=8, lr=0.05))
    P, S = algo.ctx.spec.size, np.array([0])
    gen = torch.Generator().manual_seed(2)
    w = algo.ctx.init.unsqueeze(0)
    v = w + 0.1 * torch.randn(1, P, generator=gen)
    alpha = torch.tensor([0.4])
    up = algo.client_update(algo.plan({"w": w[0]}, 0, S), engine, 0, {"v": v.clone(), "alpha": alpha.clone()})
    x, y = engine.data(0, "train")
    vbar = (0.4 * v[0] + 0.6 * w[0]).requires_grad_(True)
    (gbar,) = torch.autograd.grad(F.cross_entropy(engine.f(vbar, x), y), vbar)
    want = 0.4 - 0.05 * torch.dot(v[0] - w[0], gbar)
    torch.testing.assert_close(up.client_state["alpha"], want.reshape(1), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(up.client_state["v"], v - 0.05 * 0.4 * gbar, atol=1e-6, rtol=1e-5)


def test_apfl_engines_agree_and_w_trains_as_fedavg(digits):
    fed = unequal_federation(digits)
    model = build_model("mlp", fed.input_shape, fed.num_classes, seed=0)
    cfg = LocalConfig(epochs=2, batch_size=8, lr=0.05, momentum=0.9)
    seq = SequentialEngine(fed, model, cfg, 3, "cpu")
    vec = VectorizedEngine(fed, model, cfg, 3, "cpu", compile=False, max_slots=2)
    P, S = seq.spec.size, np.array([3, 0, 5])
    g = torch.Generator().manual_seed(0)
    w, v = 0.1 * torch.randn(3, P, generator=g), 0.1 * torch.randn(3, P, generator=g)
    z = torch.cat([w, v, torch.tensor([[0.2], [0.5], [0.9]])], 1)
    a, b = seq.train(TrainJob(S, z, loss=apfl_loss), 1), vec.train(TrainJob(S, z, loss=apfl_loss), 1)
    torch.testing.assert_close(a.params, b.params, atol=2e-5, rtol=1e-4)
    for eng, out in ((seq, a), (vec, b)):
        plain = eng.train(TrainJob(S, w.clone()), 1)
        assert torch.equal(split(out.params)[0], plain.params) and torch.equal(out.loss, plain.loss)


def test_fedprism_methods_lists_them_with_their_papers(capsys):
    from fedprism.cli import main

    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    for head in ("fedprox  (Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith 2020, arXiv:1812.06127)",
                 "ditto  (Li, Hu, Beirami, Smith 2021, arXiv:2012.04387)",
                 "apfl  (Deng, Kamani, Mahdavi 2020, arXiv:2003.13461)"):
        assert head in out
    for key in ("fedprox.mu", "ditto.lam", "ditto.personal_epochs", "apfl.alpha", "apfl.alpha_mode"):
        assert key in out


def test_ditto_personal_phase_is_anchored_at_the_received_global_model(tmp_path, monkeypatch):
    """Algorithm 1's personal objective F_k(v) + (lambda/2)||v - w^t||^2 anchors v at the model the client
    received (w^t), not at the client's own freshly trained w_k."""
    import fedprism.algorithms.ditto as ditto_module

    anchors, real = [], ditto_module.prox_job

    def spy(clients, start, anchor, *a, **k):
        anchors.append(anchor.clone())
        return real(clients, start, anchor, *a, **k)

    monkeypatch.setattr(ditto_module, "prox_job", spy)
    e = Experiment(resolve({**SMALL, "method": "ditto", "rounds": 1}), Store(tmp_path / "d.db"))
    e.run()
    (anchor,) = anchors
    assert torch.equal(anchor, e.ctx.init.expand_as(anchor))          # round 0 sends the initial model
