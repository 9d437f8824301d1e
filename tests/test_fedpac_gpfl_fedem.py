"""FedPAC, GPFL and FedEM: their reducing settings bit for bit (FedEM with M = 1 is FedAvg; FedPAC with
lambda = 0 and no classifier collaboration is FedRep with one head epoch and E body epochs; GPFL with
lambda = mu = 0 and no angle-level term trains the body, the Conditional Valve and the head on the
personalized path alone), the steps of each by hand on tiny federations (FedEM's E-step, M-step and
server step; FedPAC's feature statistics and the quadratic program's weights on hand-made cases; GPFL's
conditional inputs, valve and regulariser values), both engines agree, and `fedprism methods` lists them."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import unequal_federation
from test_fedprox_ditto_apfl import SMALL, run

from fedprism.algorithms.fedem import FedEM, component_losses, fedem_loss, mixture_logits, mixture_weights, \
    responsibilities
from fedprism.cli import main
from fedprism.engine import LocalConfig, SequentialEngine
from fedprism.engine.vectorized import VectorizedEngine
from fedprism.errors import ConfigError
from fedprism.experiment.config import resolve
from fedprism.models import build_model
from fedprism.params import ParamSpec, flatten
from fedprism.protocol import Context, Plan, TrainSettings, Update
from fedprism.seeds import stream_seed

TIMING = {"train_s", "eval_s", "wall_s"}


def same_history(a, b, extra=()):
    """Every stored metric but the timings (and `extra`, which only b has), round by round, and the same
    per-client rows."""
    (_, ra, ca), (_, rb, cb) = a, b
    assert len(ra.history) == len(rb.history) == SMALL["rounds"]
    for ha, hb in zip(ra.history, rb.history):
        assert set(hb) - set(ha) == set(extra)
        for k in set(ha) - TIMING:
            assert ha[k] == hb[k], (k, ha[k], hb[k])
    assert ca == cb


def tiny(digits, cls, engine=SequentialEngine, sizes=(30, 45, 20), lr=0.1, epochs=1, model="mlp", **hp):
    """`cls` on a federation of `sizes` digits clients, plain SGD (momentum 0), batch 16."""
    fed = unequal_federation(digits, sizes=sizes)
    net = build_model(model, fed.input_shape, fed.num_classes, seed=0)
    local = LocalConfig(epochs=epochs, batch_size=16, lr=lr, momentum=0.0)
    eng = engine(fed, net, local, 0)
    ctx = Context(fed.num_clients, fed.num_classes, ParamSpec.of(net), flatten(net), fed.n_train,
                  fed.label_hist(), seed=0, rounds=2, fraction=1.0, feature_dim=net.head[0].in_features,
                  train=TrainSettings.of(local))
    return cls(ctx, **hp), eng


def batches(eng, client, rnd, stream="train", epochs=1, B=16):
    """The engines' batch order of `stream` for (seed 0, rnd, client): index tensors into the client's rows."""
    n = len(eng.data(int(client), "train")[1])
    gen = torch.Generator().manual_seed(stream_seed(0, rnd, int(client), stream))
    return [b for _ in range(epochs) for b in torch.randperm(n, generator=gen).split(B)]


def sgd(w, lr, loss_of, xs, ys, order):
    """Plain SGD by hand: w <- w - lr grad loss_of(w, x_b, y_b) over the batches of `order`."""
    w = w.clone()
    for b in order:
        wr = w.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(loss_of(wr, xs[b], ys[b]), wr)
        w = w - lr * g
    return w


# ==== FedEM ================================================================================================
@pytest.mark.parametrize("engine", ["sequential", "vectorized"])
def test_fedem_with_one_component_is_fedavg_bit_for_bit(tmp_path, engine):
    """M = 1: the same server model and every stored metric, round by round and client by client (3 rounds,
    half the clients a round), for both weightings."""
    for weighting in ("samples", "uniform"):
        ref = run(tmp_path, "fedavg", engine=engine, fedavg__weighting=weighting)
        got = run(tmp_path, "fedem", engine=engine, fedem__m=1, fedem__weighting=weighting)
        assert got[0].state["w"].shape == (1, ref[0].state["w"].numel())
        assert torch.equal(ref[0].state["w"], got[0].state["w"][0])
        same_history(ref, got)
        pi = got[0].clients.data["pi"]
        assert torch.equal(pi, torch.ones_like(pi))                     # one component: pi = 1 throughout


def test_fedem_responsibilities_and_weights_by_the_numbers():
    """(2) and (3) on two samples, three components: pi = (1/2, 1/4, 1/4), losses (1, 2, 1/2) and (3, 0, 1)."""
    pi = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)
    losses = torch.tensor([[1.0, 2.0, 0.5], [3.0, 0.0, 1.0]], dtype=torch.float64)
    q = responsibilities(pi.log(), losses)
    for row, l in zip(q, losses):
        un = pi * torch.exp(-l)
        assert torch.allclose(row, un / un.sum(), atol=1e-15, rtol=0)
    a = 0.5 * math.exp(-1), 0.25 * math.exp(-2), 0.25 * math.exp(-0.5)
    assert q[0, 0].item() == pytest.approx(a[0] / sum(a), abs=1e-15)
    assert torch.allclose(mixture_weights(q), q.mean(0))
    assert mixture_weights(q).sum().item() == pytest.approx(1.0, abs=1e-15)
    # a component with weight 0 stays at 0; one component always takes everything
    q0 = responsibilities(torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64).log(), losses)
    assert torch.equal(q0[:, 0], torch.zeros(2, dtype=torch.float64)) and torch.equal(q0[:, 1], torch.ones(2, dtype=torch.float64))
    assert torch.equal(responsibilities(torch.zeros(1), torch.tensor([[7.5], [0.25]])), torch.ones(2, 1))


def _two_components(algo):
    g = torch.Generator().manual_seed(3)
    P = algo.ctx.spec.size
    return torch.stack([algo.ctx.init, algo.ctx.init + 0.2 * torch.randn(P, generator=g)])


def test_fedem_client_round_by_hand(digits):
    """Two components, two clients with made-up pi: the client's new pi is (3) of (2) over its training
    split, and each component's local model is SGD on (4) with q of (2) on every batch from the frozen
    components and the client's previous pi."""
    lr, rnd = 0.1, 1
    algo, eng = tiny(digits, FedEM, m=2)
    models, P = _two_components(algo), algo.ctx.spec.size
    clients = np.array([2, 0])
    pi = torch.tensor([[0.3, 0.7], [0.9, 0.1]], dtype=torch.float64)
    plan = Plan(clients, {"models": models.expand(2, -1, -1).clone()})
    up = algo.client_update(plan, eng, rnd, {"pi": pi.clone()})
    assert set(up.payload) == {"models"} and up.payload["models"].shape == (2, 2, P)     # pi never travels
    for i, c in enumerate(clients):
        xs, ys = eng.data(int(c), "train")
        with torch.no_grad():
            L = torch.stack([F.cross_entropy(eng.f(models[m], xs), ys, reduction="none") for m in range(2)], 1)
        un = pi[i] * torch.exp(-L.double())
        want_pi = (un / un.sum(1, keepdim=True)).mean(0)
        assert torch.allclose(up.client_state["pi"][i], want_pi, atol=1e-6)
        assert up.client_state["pi"][i].sum().item() == pytest.approx(1.0, abs=1e-12)

        def loss_of(z, x, y, i=i):
            with torch.no_grad():
                fixed = torch.stack([F.cross_entropy(eng.f(models[m], x), y, reduction="none") for m in range(2)], 1)
                q = pi[i].float() * torch.exp(-fixed)
                q = q / q.sum(1, keepdim=True)
            return sum((F.cross_entropy(eng.f(z[m * P:(m + 1) * P], x), y, reduction="none") * q[:, m]).mean()
                       for m in range(2))
        want = sgd(models.reshape(-1), lr, loss_of, xs, ys, batches(eng, c, rnd))
        assert torch.allclose(up.payload["models"][i].reshape(-1), want, atol=1e-5)
    # component 1's gradient is weighted by q: it does not move as an unweighted training would
    unweighted = sgd(models[1], lr, lambda w, x, y: F.cross_entropy(eng.f(w, x), y), *eng.data(2, "train"),
                     batches(eng, 2, rnd))
    assert not torch.allclose(up.payload["models"][0, 1], unweighted, atol=1e-4)


def test_fedem_server_step_and_prediction_by_hand():
    """(5) for each component with n_t weights; (1) as log sum_m pi_m softmax(h_m)."""
    ctx = Context(num_clients=4, num_classes=3, spec=None, init=torch.zeros(2), n_train=np.ones(4),
                  label_hist=np.ones((4, 3)), seed=0, rounds=1, fraction=1.0)
    algo = FedEM(ctx, m=2)
    state = {"w": torch.zeros(2, 2)}
    models = torch.tensor([[[1.0, 2.0], [3.0, 4.0]], [[5.0, 6.0], [7.0, 11.0]]])          # [client, m, P]
    up = Update(np.array([1, 3]), {"models": models}, torch.tensor([10.0, 30.0], dtype=torch.float64),
                sent={"models": torch.zeros(2, 2, 2)})
    algo.aggregate(state, 0, up)
    assert torch.allclose(state["w"], torch.tensor([[4.0, 5.0], [6.0, 9.25]]))
    algo = FedEM(ctx, m=2, weighting="uniform")
    algo.aggregate(state, 0, up)
    assert torch.allclose(state["w"], torch.tensor([[3.0, 4.0], [5.0, 7.5]]))
    # the prediction: two clients' mixtures of two components' logits
    z = {"c0": torch.tensor([[[2.0, 0.0, -1.0]], [[0.0, 0.0, 0.0]]]),
         "c1": torch.tensor([[[-1.0, 3.0, 0.0]], [[1.0, 0.0, 5.0]]])}
    pi = torch.tensor([[0.25, 0.75], [1.0, 0.0]], dtype=torch.float64)
    out = mixture_logits(z, {"pi": pi})
    want = torch.log(pi[:, 0, None, None] * torch.softmax(z["c0"].double(), -1)
                     + pi[:, 1, None, None] * torch.softmax(z["c1"].double(), -1))
    assert torch.allclose(out, want, atol=1e-12)
    assert torch.allclose(out[1].exp(), torch.softmax(z["c0"][1].double(), -1), atol=1e-12)   # pi = (1, 0)
    assert torch.allclose(out.exp().sum(-1), torch.ones(2, 1, dtype=torch.float64))


def test_fedem_inference_uses_the_clients_own_weights(tmp_path):
    """A run of M = 2: pi moved away from uniform on trained clients, stays uniform on never-sampled ones,
    and the headline prediction is the mixture of the components with those weights."""
    e, res, _ = run(tmp_path, "fedem", fedem__m=2)
    pi = e.clients.data["pi"]
    trained = np.flatnonzero(~torch.isclose(pi[:, 0], torch.tensor(0.5, dtype=torch.float64)).numpy())
    assert len(trained) >= 3 and torch.allclose(pi.sum(1), torch.ones(len(pi), dtype=torch.float64))
    inf = e.algo.inference(e.engine, np.arange(len(pi)), e.algo.eval_payload(e.state, np.arange(len(pi))),
                           {"pi": pi})
    assert set(inf.streams) == {"c0", "c1"} and torch.equal(inf.extras["pi"], pi)
    assert e.state["w"].shape[0] == 2 and not torch.equal(e.state["w"][0], e.state["w"][1])


def test_fedem_objective_with_one_component_is_the_plain_cross_entropy(digits):
    """(4) at M = 1 is the experiment's objective bit for bit (q = 1 exactly), value and gradient."""
    from fedprism.objectives import ce
    algo, eng = tiny(digits, FedEM, m=1)
    xs, ys = eng.data(0, "train")
    w = algo.ctx.init.clone().requires_grad_(True)
    ex = {"start": algo.ctx.init.clone(), "log_pi": torch.zeros(1)}
    wt = torch.ones(len(ys))
    a = fedem_loss(eng.f, w, xs, ys, wt, ex)
    (ga,) = torch.autograd.grad(a, w)
    b = ce(eng.f, w, xs, ys, wt, {})
    (gb,) = torch.autograd.grad(b, w)
    assert torch.equal(a, b) and torch.equal(ga, gb)


def test_fedem_component_losses_are_per_sample_cross_entropies(digits):
    algo, eng = tiny(digits, FedEM, m=2)
    models = _two_components(algo)
    L = component_losses(eng, 1, models)
    xs, ys = eng.data(1, "train")
    assert L.shape == (len(ys), 2) and L.dtype == torch.float64
    for m in range(2):
        assert torch.allclose(L[:, m].float(), F.cross_entropy(eng.f(models[m], xs), ys, reduction="none"), atol=1e-5)


def test_fedem_both_engines_agree(digits):
    out = []
    for engine in (SequentialEngine, VectorizedEngine):
        algo, eng = tiny(digits, FedEM, engine, sizes=(7, 20, 33), m=3)
        g = torch.Generator().manual_seed(1)
        models = algo.init_state()["w"] + 0.01 * torch.randn(3, algo.ctx.spec.size, generator=g)
        pi = torch.tensor([[0.2, 0.3, 0.5], [1 / 3, 1 / 3, 1 / 3], [0.6, 0.4, 0.0]], dtype=torch.float64)
        plan = Plan(np.array([2, 0, 1]), {"models": models.expand(3, -1, -1).clone()})
        up = algo.client_update(plan, eng, 1, {"pi": pi})
        out.append((up.payload["models"], up.client_state["pi"], up.metrics["train_loss"]))
    for a, b in zip(*out):
        torch.testing.assert_close(a.double(), b.double(), atol=1e-4, rtol=1e-4)
    assert out[0][1][2, 2].item() == 0.0                           # a zero weight stays zero


def test_fedem_both_engines_agree_through_the_runner(tmp_path):
    finals = []
    for engine in ("sequential", "vectorized"):                # one store each: the engine is not in the run id
        (tmp_path / engine).mkdir()
        finals.append(run(tmp_path / engine, "fedem", engine=engine, fedem__m=2)[0].state["w"])
    torch.testing.assert_close(finals[0], finals[1], atol=1e-4, rtol=1e-4)


def test_fedem_refuses_bad_values_and_fused_kernels():
    with pytest.raises(ConfigError, match=r"fedem\.m"):
        resolve({"method": "fedem", "fedem.m": 0})
    assert resolve({"method": "fedem"})["train.kernels"] == "aten"
