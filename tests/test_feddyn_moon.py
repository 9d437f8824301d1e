"""FedDyn and MOON: their reducing settings (alpha = 0, mu = 0) equal FedAvg bit for bit through the runner,
on both engines; one local training and one server step of each computed by hand on a tiny federation;
the engines agree on the methods' own objectives; a Flower run gives the in-process numbers; both are
listed by `fedprism methods`."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import unequal_federation
from test_fedprox_ditto_apfl import SMALL, assert_same_run, run

from fedprism.algorithms.fedavg import FedAvg
from fedprism.algorithms.feddyn import FedDyn, dyn_loss, gradient_state, server_model, server_state
from fedprism.algorithms.moon import Moon, contrastive, moon_loss
from fedprism.cli import main
from fedprism.engine import LocalConfig, SequentialEngine
from fedprism.engine.vectorized import VectorizedEngine
from fedprism.errors import ConfigError
from fedprism.experiment.config import resolve
from fedprism.models import build_model
from fedprism.params import ParamSpec, flatten
from fedprism.protocol import Context, Plan, TrainSettings, Update
from fedprism.seeds import stream_seed


# -- the reducing settings: FedAvg bit for bit -------------------------------------------------------------
@pytest.mark.parametrize("engine", ["sequential", "vectorized"])
def test_feddyn_with_alpha_zero_is_fedavg_bit_for_bit(tmp_path, engine):
    """alpha = 0: the uniform mean of (4) is fedavg.weighting=uniform, the n_k mean FedAvg's default; the
    same final model and every stored metric, round by round and client by client (3 rounds, half the
    clients a round)."""
    assert_same_run(run(tmp_path, "fedavg", engine=engine, fedavg__weighting="uniform"),
                    run(tmp_path, "feddyn", engine=engine, feddyn__alpha=0.0))
    assert_same_run(run(tmp_path, "fedavg", engine=engine),
                    run(tmp_path, "feddyn", engine=engine, feddyn__alpha=0.0, feddyn__weighting="samples"))


@pytest.mark.parametrize("engine", ["sequential", "vectorized"])
def test_moon_with_mu_zero_is_fedavg_bit_for_bit(tmp_path, engine):
    assert_same_run(run(tmp_path, "fedavg", engine=engine), run(tmp_path, "moon", engine=engine, moon__mu=0.0))


@pytest.mark.parametrize("cls, hp, state", [(FedDyn, {"alpha": 0.0}, "g"), (Moon, {"mu": 0.0}, "prev")])
def test_the_reducing_setting_trains_the_plain_objective(digits, cls, hp, state):
    """alpha = 0 / mu = 0 hand the engine the experiment's own objective (`ce`, no extras): the path of
    FedAvg's client whatever the kernels, and no forward passes of the frozen models; otherwise the method's
    own loss."""
    algo, eng = _tiny(digits, cls, **hp)
    jobs, real = [], eng.train
    eng.train = lambda job, rnd: jobs.append(job) or real(job, rnd)
    P = algo.ctx.spec.size
    plan = Plan(np.array([0, 1]), {"params": algo.ctx.init.expand(2, -1).clone()})
    algo.client_update(plan, eng, 0, {state: torch.zeros(2, P)})
    assert jobs[-1].loss == "ce" and jobs[-1].extras == {}
    algo2, _ = _tiny(digits, cls)
    algo2.client_update(plan, eng, 0, {state: torch.zeros(2, P)})
    assert jobs[-1].loss is (dyn_loss if cls is FedDyn else moon_loss)


def test_the_regularisers_act(tmp_path):
    """alpha > 0 and mu > 0 change the model (the tests above would also pass if the terms were ignored)."""
    ref = run(tmp_path, "fedavg", fedavg__weighting="uniform")[0].state["w"]
    dyn = run(tmp_path, "feddyn")[0]
    assert not torch.equal(dyn.state["w"], ref) and bool(dyn.state["h"].abs().sum() > 0)
    assert not torch.equal(run(tmp_path, "moon")[0].state["w"], run(tmp_path, "fedavg")[0].state["w"])


# -- FedDyn by hand ------------------------------------------------------------------------------------------
def _tiny(digits, cls, engine=SequentialEngine, sizes=(30, 45, 20), lr=0.1, **hp):
    fed = unequal_federation(digits, sizes=sizes)
    model = build_model("mlp", fed.input_shape, fed.num_classes, seed=0)
    local = LocalConfig(epochs=1, batch_size=16, lr=lr, momentum=0.0)
    eng = engine(fed, model, local, 0)
    ctx = Context(fed.num_clients, fed.num_classes, ParamSpec.of(model), flatten(model), fed.n_train,
                  fed.label_hist(), seed=0, rounds=2, fraction=1.0, train=TrainSettings.of(local))
    return cls(ctx, **hp), eng


def _sgd_by_hand(eng, client, start, rnd, lr, grad_of):
    """One epoch of plain SGD in the engines' batch order (the stream `train` of (seed 0, rnd, client)):
    w <- w - lr grad_of(w, x_b, y_b)."""
    xs, ys = eng.data(int(client), "train")
    w = start.clone()
    gen = torch.Generator().manual_seed(stream_seed(0, rnd, int(client), "train"))
    for b in torch.randperm(len(ys), generator=gen).split(16):
        w = w - lr * grad_of(w, xs[b], ys[b])
    return w


def test_feddyn_round_by_hand(digits):
    """Two of three clients; their g_k and theta^{t-1} made up. Each client's local training is SGD on
    CE(w) - <g_k, w> + (alpha/2)||w - theta||^2, i.e. steps of grad CE(w) - g_k + alpha (w - theta);
    then (2) g_k <- g_k - alpha (theta_k - theta), (3) and (4) on the server."""
    alpha, lr, rnd = 0.3, 0.1, 1
    algo, eng = _tiny(digits, FedDyn, alpha=alpha)
    P = algo.ctx.spec.size
    g = torch.Generator().manual_seed(0)
    theta = algo.ctx.init + 0.01 * torch.randn(P, generator=g)
    g_k = 0.01 * torch.randn(2, P, generator=g)
    clients = np.array([2, 0])
    plan = Plan(clients, {"params": theta.expand(2, -1).clone()})
    up = algo.client_update(plan, eng, rnd, {"g": g_k.clone()})
    for i, client in enumerate(clients):
        def grad_of(w, x, y, i=i):
            w = w.clone().requires_grad_(True)
            (grad,) = torch.autograd.grad(F.cross_entropy(eng.f(w, x), y), w)
            return grad - g_k[i] + alpha * (w.detach() - theta)
        want = _sgd_by_hand(eng, client, theta, rnd, lr, grad_of)
        assert torch.allclose(up.params[i], want, atol=1e-5)
        state_by_hand = g_k[i].double() - alpha * (up.params[i].double() - theta.double())
        assert torch.allclose(up.client_state["g"][i].double(), state_by_hand, atol=1e-7)
    assert set(up.payload) == {"params"}                                      # g_k never travels
    # the server: m = 3 clients in the federation, a uniform mean over the two that trained
    h0 = 0.001 * torch.randn(P, generator=g, dtype=torch.float64)
    state = {"w": theta.clone(), "h": h0.clone()}
    up.sent = plan.payload
    algo.aggregate(state, rnd, up)
    h = h0 - alpha * (up.params.double() - theta.double()).sum(0) / 3
    assert torch.allclose(state["h"], h, atol=1e-12)
    want = (up.params.double().mean(0) - h / alpha).float()
    assert torch.allclose(state["w"], want, atol=1e-6)


def test_feddyn_server_step_by_the_numbers():
    """m = 4, alpha = 0.5, theta^{t-1} = (1, 1), two clients return (2, 1) and (1, 3): the updates sum to
    (1, 2), h = 0 - 0.5 (1, 2) / 4 = (-0.125, -0.25), the mean is (1.5, 2), theta^t = (1.5, 2) + (0.25, 0.5)."""
    ctx = Context(num_clients=4, num_classes=2, spec=None, init=torch.ones(2), n_train=np.ones(4),
                  label_hist=np.ones((4, 2)), seed=0, rounds=1, fraction=1.0)
    algo = FedDyn(ctx, alpha=0.5)
    state = algo.init_state()
    up = Update(np.array([1, 3]), {"params": torch.tensor([[2.0, 1.0], [1.0, 3.0]])},
                torch.tensor([10.0, 30.0], dtype=torch.float64), sent={"params": torch.ones(2, 2)})
    algo.aggregate(state, 0, up)
    assert state["h"].tolist() == [-0.125, -0.25] and state["w"].tolist() == [1.75, 2.5]
    # samples weighting changes the mean only: (2 x 10 + 1 x 30) / 40 = 1.25, (1 x 10 + 3 x 30) / 40 = 2.5
    algo = FedDyn(ctx, alpha=0.5, weighting="samples")
    state = algo.init_state()
    algo.aggregate(state, 0, up)
    assert state["h"].tolist() == [-0.125, -0.25] and state["w"].tolist() == [1.5, 3.0]
    # alpha = 0: h stays 0 and the correction is 0, theta^t is the mean
    state = FedDyn(ctx, alpha=0.0).init_state()
    FedDyn(ctx, alpha=0.0).aggregate(state, 0, up)
    assert state["h"].tolist() == [0.0, 0.0] and state["w"].tolist() == [1.5, 2.0]


def test_feddyn_pure_functions_by_the_numbers():
    g = torch.tensor([[1.0, -1.0]])
    assert gradient_state(g, torch.tensor([[3.0, 0.0]]), torch.tensor([[1.0, 1.0]]), 0.5).tolist() == [[0.0, -0.5]]
    h = server_state(torch.zeros(2, dtype=torch.float64), torch.tensor([[3.0, 0.0], [1.0, 1.0]]),
                     torch.tensor([1.0, 1.0]), 2.0, 4)
    assert h.tolist() == [-1.0, 0.5]
    assert server_model(torch.tensor([1.0, 1.0], dtype=torch.float64), h, 2.0).tolist() == [1.5, 0.75]
    assert torch.equal(server_model(torch.tensor([1.0, 2.0]), h, 0.0), torch.tensor([1.0, 2.0]))

    # the loss: CE - <g, w> + (alpha/2)||w - anchor||^2, its value on a one-sample batch
    def f(w, x):
        return x @ w.view(2, 2)
    w, x, y = torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.tensor([[1.0, 0.0]]), torch.tensor([0])
    ex = {"g": torch.tensor([1.0, 2.0, 0.0, 0.0]), "anchor": torch.zeros(4), "alpha": torch.tensor(3.0)}
    want = math.log(1 + math.exp(-1.0)) - 1.0 + 1.5 * 2.0
    assert dyn_loss(f, w, x, y, torch.ones(1), ex).item() == pytest.approx(want, abs=1e-6)


# -- MOON by hand ------------------------------------------------------------------------------------------------
def test_contrastive_loss_by_the_numbers():
    """(1) with z = (1, 0), z_glob = (1, 0), z_prev = (0, 1), tau = 0.5: a = 1 / 0.5 = 2, b = 0, so
    l_con = -log(e^2 / (e^2 + 1)) = log(1 + e^-2); z_glob = z_prev gives log 2 whatever z; scaling z,
    z_glob or z_prev changes nothing (cosine)."""
    z, zg, zp = torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])
    assert contrastive(z, zg, zp, 0.5).item() == pytest.approx(math.log(1 + math.exp(-2)), abs=1e-7)
    assert contrastive(z, 3 * zg, 0.2 * zp, 0.5).item() == pytest.approx(math.log(1 + math.exp(-2)), abs=1e-7)
    assert contrastive(torch.tensor([[0.3, -2.0]]), zp, zp, 0.1).item() == pytest.approx(math.log(2), abs=1e-6)
    # the previous model's side: z = z_prev, z_glob orthogonal, tau = 1: a = 0, b = 1 -> log(1 + e)
    assert contrastive(zp, zg, zp, 1.0).item() == pytest.approx(math.log(1 + math.e), abs=1e-6)


def test_moon_round_by_hand(digits):
    """Two clients' local training is SGD on CE(w) + mu mean_b(-log(e^a / (e^a + e^b))), a and b the cosine
    similarities / tau of the features of w to those of w^t and of the client's previous model, written
    here from the printed formula (not the module's `contrastive`); the client keeps what it trained."""
    mu, tau, lr, rnd = 2.0, 0.5, 0.1, 1
    algo, eng = _tiny(digits, Moon, mu=mu, tau=tau)
    P = algo.ctx.spec.size
    g = torch.Generator().manual_seed(1)
    w_t = algo.ctx.init + 0.05 * torch.randn(P, generator=g)
    prev = algo.ctx.init + 0.05 * torch.randn(2, P, generator=g)
    clients = np.array([1, 2])
    plan = Plan(clients, {"params": w_t.expand(2, -1).clone()})
    up = algo.client_update(plan, eng, rnd, {"prev": prev.clone()})
    for i, client in enumerate(clients):
        def grad_of(w, x, y, i=i):
            w = w.clone().requires_grad_(True)
            z, zg, zp = eng.f.features(w, x), eng.f.features(w_t, x), eng.f.features(prev[i], x)
            a = (z * zg).sum(1) / (z.norm(dim=1) * zg.norm(dim=1)) / tau
            b = (z * zp).sum(1) / (z.norm(dim=1) * zp.norm(dim=1)) / tau
            l_con = -torch.log(torch.exp(a) / (torch.exp(a) + torch.exp(b)))
            (grad,) = torch.autograd.grad(F.cross_entropy(eng.f(w, x), y) + mu * l_con.mean(), w)
            return grad
        want = _sgd_by_hand(eng, client, w_t, rnd, lr, grad_of)
        assert torch.allclose(up.params[i], want, atol=1e-5)
    assert torch.equal(up.client_state["prev"], up.params)                    # the next previous model
    assert set(up.payload) == {"params"}
    # the server: FedAvg's n_k mean (sizes 45 and 20)
    state = algo.init_state()
    up.sent = plan.payload
    algo.aggregate(state, rnd, up)
    want = (45 * up.params[0].double() + 20 * up.params[1].double()) / 65
    assert torch.allclose(state["w"], want.float(), atol=1e-7)


def test_moon_first_round_is_fedavg_s_when_the_previous_model_is_the_global_one(digits):
    """In round 0 the previous model is w^0 = w^t: z_glob = z_prev, l_con = log 2 with zero gradient; the
    trained model is FedAvg's (up to the rounding of a zero gradient added)."""
    algo, eng = _tiny(digits, Moon, mu=5.0)
    fed_algo = FedAvg(algo.ctx)
    clients = np.array([0, 1, 2])
    w0 = algo.ctx.init
    plan = Plan(clients, {"params": w0.expand(3, -1).clone()})
    got = algo.client_update(plan, eng, 0, {"prev": w0.expand(3, -1).clone()})
    want = fed_algo.client_update(plan, eng, 0, {})
    assert torch.allclose(got.params, want.params, atol=1e-6)
    assert torch.allclose(got.metrics["train_loss"], want.metrics["train_loss"] + 5.0 * math.log(2), atol=1e-5)


# -- both engines agree ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls, hp", [(FedDyn, {"alpha": 0.1}), (Moon, {"mu": 1.0})])
def test_both_engines_agree(digits, cls, hp):
    """The vectorized engine (padded last batches, vmap over clients) trains the methods' own objectives
    to the sequential engine's models, and both give the same client state."""
    out = []
    for engine in (SequentialEngine, VectorizedEngine):
        algo, eng = _tiny(digits, cls, engine, sizes=(7, 20, 33), **hp)
        P = algo.ctx.spec.size
        g = torch.Generator().manual_seed(2)
        w = algo.ctx.init + 0.05 * torch.randn(P, generator=g)
        key = next(iter(algo.client_state))
        rows = 0.01 * torch.randn(3, P, generator=g) + (algo.ctx.init if key == "prev" else 0)
        plan = Plan(np.array([2, 0, 1]), {"params": w.expand(3, -1).clone()})
        up = algo.client_update(plan, eng, 1, {key: rows})
        out.append((up.params, up.client_state[key], up.metrics["train_loss"]))
    for a, b in zip(*out):
        torch.testing.assert_close(a.double(), b.double(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method, extra", [("feddyn", {"feddyn.alpha": 0.1}), ("moon", {}),
                                           ("fedavg", {"fedavg.aggregation": "krum", "fedavg.aggregation.f": 0})])
def test_both_engines_agree_through_the_runner(tmp_path, method, extra):
    from fedprism.experiment.runner import Experiment
    from fedprism.experiment.store import Store

    finals = []
    for engine in ("sequential", "vectorized"):
        cfg = resolve({**SMALL, "method": method, "engine": engine, "rounds": 2, **extra})
        e = Experiment(cfg, Store(tmp_path / f"{engine}.db"))
        assert e.run().status == "finished"
        finals.append(e.state["w"])
    torch.testing.assert_close(finals[0], finals[1], atol=1e-4, rtol=1e-4)


# -- Flower ------------------------------------------------------------------------------------------------------
def test_feddyn_on_flower_gives_the_in_process_numbers(tmp_path):
    """The Flower simulation (one node per client) keeps the same g_k on its nodes and the same h and theta
    on the server as the in-process run, here with Multi-Krum averaging the models of (4)."""
    pytest.importorskip("flwr")
    import test_flower as tf
    from test_scaffold_plugin import tf_identity

    from fedprism.flower.server_app import serve

    exp = ("method=feddyn dataset=digits clients=5 rounds=2 fraction=1.0 local_epochs=1 lr=0.05 model=mlp "
           "device=cpu engine=sequential partition.alpha=0.5 seed=2 feddyn.alpha=0.1 "
           "feddyn.aggregation=multi_krum feddyn.aggregation.m=3")
    rc = tf.run_config(exp, tmp_path / "f.db", save_final=str(tmp_path / "final.pt"))
    ref, final = tf.in_process(exp, tmp_path / "ref.db")
    with tf_identity(tf):
        grid = tf.FakeGrid(tf.nodes_for(5), rc)
        res = serve(grid, rc)
    assert res.status == "finished"
    got = torch.load(tmp_path / "final.pt", weights_only=False)["state"]
    assert set(got) == {"w", "h"}
    tf.assert_same_state(ref.state, got)
    for nid, node in grid.nodes.items():
        rows = grid.states[nid].array_records.get("fedprism-client-state")
        assert torch.allclose(torch.from_numpy(rows["g"].numpy()).double(),
                              ref.clients.data["g"][node["client-id"]].double().unsqueeze(0), atol=1e-6)
    assert res.final["local_acc"] == pytest.approx(final["local_acc"], abs=1e-9)


# -- listing and validation --------------------------------------------------------------------------------------
def test_fedprism_methods_lists_both(capsys):
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    assert "feddyn  (Acar et al. 2021, arXiv:2111.04263)" in out and "feddyn.alpha" in out
    assert "moon  (Li, He, Song 2021, arXiv:2103.16257)" in out and "moon.mu" in out and "moon.tau" in out
    assert "krum, multi_krum, bulyan" in out                       # the rules, under "Server steps"


@pytest.mark.parametrize("key, value", [("feddyn.alpha", -0.1), ("moon.mu", -1.0), ("moon.tau", 0.0)])
def test_bad_values_name_the_key(key, value):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        resolve({"method": key.split(".")[0], key: value})


def test_defaults_and_run_ids():
    a, b = resolve({"method": "feddyn"}), resolve({"method": "moon"})
    assert (a.method_params["alpha"], a.method_params["weighting"]) == (0.01, "uniform")
    assert (b.method_params["mu"], b.method_params["tau"], b.method_params["weighting"]) == (1.0, 0.5, "samples")
    assert resolve({"method": "feddyn", "feddyn.alpha": 0.1}).run_id != a.run_id


def test_moon_trains_on_pytorchs_kernels_on_a_conv_model(monkeypatch):
    """MOON's objective evaluates the global and previous models on the batch: `train.kernels = auto` is aten
    for it on LeNet-5 (the fused kernels would refuse the objective at its first step: every client raised)."""
    from fedprism import kernels

    monkeypatch.setattr(kernels, "resolve", lambda key, value, device: "fused" if value == "auto" else value)
    assert resolve({"method": "fedavg", "dataset": "fmnist", "model": "lenet5"})["train.kernels"] == "fused"
    assert resolve({"method": "moon", "dataset": "fmnist", "model": "lenet5"})["train.kernels"] == "aten"
