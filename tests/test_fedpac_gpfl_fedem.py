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


# ==== FedPAC ===============================================================================================
from fedprism.algorithms.fedpac import (FedPAC, collaboration_matrix, combination_weights,  # noqa: E402
                                        feature_statistics, project_simplex, simplex_qp)


@pytest.mark.parametrize("engine", ["sequential", "vectorized"])
def test_fedpac_without_alignment_and_collaboration_is_fedrep_bit_for_bit(tmp_path, engine):
    """lambda = 0, collaborate = false: FedRep with one head epoch and E body epochs, the same body and every
    stored metric but the bytes (FedPAC also sends prototypes and statistics)."""
    ref = run(tmp_path, "fedrep", engine=engine, fedrep__head_epochs=1, fedrep__body_epochs=1)
    got = run(tmp_path, "fedpac", engine=engine, fedpac__lam=0.0, fedpac__collaborate=False)
    assert torch.equal(ref[0].state["shared"], got[0].state["shared"])
    assert torch.equal(ref[0].clients.data["local"], got[0].clients.data["local"])
    for ha, hb in zip(ref[1].history, got[1].history):
        for k in set(ha) - TIMING - {"bytes_up", "bytes_down"}:
            assert ha[k] == hb[k], (k, ha[k], hb[k])
        assert hb["bytes_up"] > ha["bytes_up"]
    assert ref[2] == got[2]


def test_fedpac_alignment_and_collaboration_act(tmp_path):
    ref = run(tmp_path, "fedpac", fedpac__lam=0.0, fedpac__collaborate=False)[0]
    aligned = run(tmp_path, "fedpac", fedpac__collaborate=False)[0]
    assert not torch.equal(ref.state["shared"], aligned.state["shared"])
    # on IID clients the feature statistics are close: the heads of the last round's clients are mixed
    full = run(tmp_path, "fedpac", partition="iid")[0]
    mixed = [i for i in torch.nonzero(full.state["combined"]).flatten().tolist()
             if not torch.equal(full.state["heads"][i], full.clients.data["local"][i, full.algo.head])]
    assert mixed


def test_simplex_projection_by_the_numbers():
    t = torch.tensor
    assert torch.allclose(project_simplex(t([0.2, 0.3, 0.5], dtype=torch.float64)), t([0.2, 0.3, 0.5], dtype=torch.float64))
    assert torch.allclose(project_simplex(t([2.0, 0.0], dtype=torch.float64)), t([1.0, 0.0], dtype=torch.float64))
    assert torch.allclose(project_simplex(t([1.0, 1.0, -5.0], dtype=torch.float64)), t([0.5, 0.5, 0.0], dtype=torch.float64))
    assert torch.allclose(project_simplex(t([0.5, 0.0, 0.0], dtype=torch.float64)),
                          t([0.5 + 0.5 / 3, 0.5 / 3, 0.5 / 3], dtype=torch.float64))


def _kkt_optimum(Q: torch.Tensor) -> torch.Tensor:
    """The exact minimiser of a^T Q a on the simplex (Q positive definite) by enumerating supports: on a
    support s, 2 Q_ss a_s = nu 1 and sum a_s = 1; keep the feasible solution with the least objective."""
    import itertools
    n, best, arg = len(Q), math.inf, None
    for r in range(1, n + 1):
        for s in itertools.combinations(range(n), r):
            s = list(s)
            x = torch.linalg.solve(Q[s][:, s], torch.ones(r, dtype=torch.float64))
            a = torch.zeros(n, dtype=torch.float64)
            a[s] = x / x.sum()
            if bool((a >= -1e-12).all()):
                v = float(a @ Q @ a)
                if v < best:
                    best, arg = v, a
    return arg


def test_fedpac_qp_weights_on_hand_made_cases():
    d = torch.float64
    # no bias: (8) is min sum_j a_j^2 V_j, whose optimum is the inverse-variance weights
    V = torch.tensor([1.0, 2.0, 4.0], dtype=d)
    assert torch.allclose(simplex_qp(torch.diag(V)), (1 / V) / (1 / V).sum(), atol=1e-9)
    # an active bound: on a + b = 1, (a, b) Q (a, b) = 14 a^2 - 16 a + 10 falls until a = 8/7 > 1: a = 1
    assert torch.allclose(simplex_qp(torch.tensor([[1.0, 2.0], [2.0, 10.0]], dtype=d)),
                          torch.tensor([1.0, 0.0], dtype=d), atol=1e-9)
    # Q = 0: every point is optimal; the uniform start is kept
    assert torch.equal(simplex_qp(torch.zeros(3, 3, dtype=d)), torch.full((3,), 1 / 3, dtype=d))
    # random positive definite problems against the exact KKT optimum
    g = torch.Generator().manual_seed(0)
    for n in (2, 3, 4, 5):
        A = torch.randn(n, n + 1, generator=g, dtype=d)
        Q = A @ A.T + 0.1 * torch.eye(n, dtype=d)
        Q[0, 0] += 5.0 * float(torch.rand(1, generator=g))
        assert torch.allclose(simplex_qp(Q), _kkt_optimum(Q), atol=1e-7)


def test_fedpac_combination_weights_from_feature_statistics():
    """Three clients, two classes, d = 2: clients 0 and 1 have the same h (no bias between them), client 2's h
    is far away (every entry 20). V = (1, 1, 1). For client 0: Q = diag(1, 1, 1) + |h_0 - h_2|^2 = 4 x 400 on the
    third diagonal entry, so a = (1, 1, 1/1601) / (2 + 1/1601): a_2 < 1e-3 is set to 0, a = (1/2, 1/2, 0).
    Client 2 is far from both others: the others' weights fall below 1e-3 and its own head takes all."""
    h = torch.zeros(3, 2, 2)
    h[2] = 20.0
    V = torch.ones(3, dtype=torch.float64)
    Q0 = collaboration_matrix(V, h, 0)
    assert torch.allclose(Q0, torch.diag(torch.tensor([1.0, 1.0, 1601.0], dtype=torch.float64)))
    raw = simplex_qp(Q0)
    want = torch.tensor([1.0, 1.0, 1 / 1601], dtype=torch.float64)
    assert torch.allclose(raw, want / want.sum(), atol=1e-9)
    alpha = combination_weights(V, h)
    assert torch.allclose(alpha[0], torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64), atol=1e-9)
    assert torch.allclose(alpha[1], alpha[0])
    Q2 = collaboration_matrix(V, h, 2)
    assert torch.allclose(simplex_qp(Q2), _kkt_optimum(Q2), atol=1e-9)             # (3.1e-4, 3.1e-4, 0.99938)
    assert torch.equal(alpha[2], torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64))
    assert torch.allclose(alpha.sum(1), torch.ones(3, dtype=torch.float64))
    # the cross terms: D_jj' = sum_k <h_ik - h_jk, h_ik - h_j'k>: <(1, -1), (-1, -2)> = 1
    h = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]], [[2.0, 2.0]]])
    D = collaboration_matrix(torch.zeros(3), h, 0)
    assert torch.allclose(D, torch.tensor([[0.0, 0.0, 0.0], [0.0, 2.0, 1.0], [0.0, 1.0, 5.0]], dtype=torch.float64))


def test_fedpac_feature_statistics_by_hand(digits):
    algo, eng = tiny(digits, FedPAC)
    w = algo.ctx.init.expand(2, -1)
    V, h = feature_statistics(eng, np.array([1, 2]), w, 10)
    for i, c in enumerate((1, 2)):
        xs, ys = eng.data(c, "train")
        z = eng.f.features(algo.ctx.init, xs).double()
        n, want_h, want_v = len(ys), torch.zeros(10, z.shape[1], dtype=torch.float64), 0.0
        for k in range(10):
            zk = z[ys == k]
            if len(zk):
                p = len(zk) / n
                want_h[k] = p * zk.mean(0)
                want_v += p * (zk * zk).sum(1).mean() - (want_h[k] ** 2).sum()
        assert torch.allclose(h[i].double(), want_h, atol=1e-5)
        assert V[i].item() == pytest.approx(float(want_v) / n, rel=1e-5)


def test_fedpac_client_round_by_hand(digits):
    """One client, global prototypes for classes 0-4 only: one epoch of SGD on the head (CE, body frozen) on
    stream 'fedrep_head', then one epoch on the body with CE + lambda mean((f(x) - c_y)^2) over the batch and
    the d dimensions for samples of classes with a prototype (head frozen), on 'fedrep_body'."""
    lam, lr, rnd = 0.7, 0.1, 1
    algo, eng = tiny(digits, FedPAC, lam=lam)
    spec, P = algo.ctx.spec, algo.ctx.spec.size
    d = algo.ctx.feature_dim
    g = torch.Generator().manual_seed(5)
    protos = torch.randn(10, d, generator=g)
    present = (torch.arange(10) < 5).float()
    body = algo.ctx.init[algo.shared] + 0.01 * torch.randn(len(algo.shared), generator=g)
    local = algo.ctx.init + 0.02 * torch.randn(P, generator=g)
    plan = Plan(np.array([1]), {"shared": body[None].clone(), "protos": protos[None], "present": present[None],
                                "head": torch.zeros(1, algo.H), "combined": torch.zeros(1)})
    up = algo.client_update(plan, eng, rnd, {"local": local[None].clone()})
    xs, ys = eng.data(1, "train")
    start = local.clone()
    start[algo.shared] = body
    head_mask = torch.zeros(P)
    head_mask[spec.head] = 1.0

    def head_loss(w, x, y):
        return F.cross_entropy(eng.f(w, x), y) + 0 * w.sum()

    def body_loss(w, x, y):
        z = eng.f.features(w, x)
        reg = ((z - protos[y]) ** 2).sum(1) * present[y]
        return F.cross_entropy(eng.f.head(w, z), y) + lam * reg.sum() / (len(y) * d)
    w = start.clone()
    for b in batches(eng, 1, rnd, "fedrep_head"):
        wr = w.clone().requires_grad_(True)
        (gr,) = torch.autograd.grad(head_loss(wr, xs[b], ys[b]), wr)
        w = w - lr * gr * head_mask
    for b in batches(eng, 1, rnd, "fedrep_body"):
        wr = w.clone().requires_grad_(True)
        (gr,) = torch.autograd.grad(body_loss(wr, xs[b], ys[b]), wr)
        w = w - lr * gr * (1 - head_mask)
    assert torch.allclose(up.client_state["local"][0], w, atol=1e-5)
    assert torch.allclose(up.payload["shared"][0], w[algo.shared]) and torch.allclose(up.payload["head"][0], w[spec.head])
    # (5) with the trained body, (1)-(2) with the received one
    z = eng.f.features(w, xs).double()
    for k in range(10):
        if (ys == k).any():
            assert torch.allclose(up.payload["protos"][0, k].double(), z[ys == k].mean(0), atol=1e-5)
    V, h = feature_statistics(eng, np.array([1]), start[None], 10)
    assert torch.allclose(up.payload["V"].double(), V.double()) and torch.allclose(up.payload["h"], h)


def test_fedpac_server_step_by_hand(digits):
    """(6) the n_i-weighted body, (7) the class-count-weighted prototypes, (8)-(9) each client's combined head
    from the round's heads; a client outside the round keeps its row."""
    algo, _ = tiny(digits, FedPAC, sizes=(30, 45, 20, 10))
    state = algo.init_state()
    before = state["heads"][3].clone()
    g = torch.Generator().manual_seed(7)
    S, C, d, H = np.array([0, 2, 1]), 10, algo.ctx.feature_dim, algo.H
    shared = torch.randn(3, len(algo.shared), generator=g)
    heads = torch.randn(3, H, generator=g)
    protos = torch.randn(3, C, d, generator=g)
    counts = torch.randint(0, 4, (3, C), generator=g).float()
    V = torch.rand(3, generator=g) + 0.1
    h = 0.3 * torch.randn(3, C, d, generator=g)
    n = torch.tensor([30.0, 20.0, 45.0], dtype=torch.float64)
    up = Update(S, {"shared": shared, "head": heads, "protos": protos, "counts": counts, "V": V, "h": h}, n)
    algo.aggregate(state, 1, up)
    assert torch.allclose(state["shared"], ((n[:, None] * shared.double()).sum(0) / n.sum()).float(), atol=1e-6)
    for k in range(C):
        if counts[:, k].sum() > 0:
            want = (counts[:, k, None] * protos[:, k]).sum(0) / counts[:, k].sum()
            assert torch.allclose(state["protos"][k], want, atol=1e-5) and bool(state["present"][k])
    for r, c in enumerate(S):
        a = simplex_qp(collaboration_matrix(V.double(), h, r))
        a = torch.where(a < 1e-3, torch.zeros_like(a), a)
        a = a / a.sum()
        assert torch.allclose(state["heads"][c].double(), a @ heads.double(), atol=1e-6)
        assert bool(state["combined"][c])
    assert torch.equal(state["heads"][3], before) and not bool(state["combined"][3])


def test_fedpac_both_engines_agree_through_the_runner(tmp_path):
    out = []
    for engine in ("sequential", "vectorized"):
        (tmp_path / engine).mkdir()
        e = run(tmp_path / engine, "fedpac", engine=engine)[0]
        out.append((e.state["shared"], e.state["heads"], e.state["protos"], e.clients.data["local"]))
    for a, b in zip(*out):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_fedpac_refuses_bad_values():
    with pytest.raises(ConfigError, match=r"fedpac\.lam"):
        resolve({"method": "fedpac", "fedpac.lam": -1.0})
    with pytest.raises(ConfigError, match=r"fedpac\.body_epochs"):
        resolve({"method": "fedpac", "fedpac.head_epochs": 0, "fedpac.body_epochs": 0})


# ==== GPFL =================================================================================================
from fedprism.algorithms.gpfl import (GPFL, angle_loss, conditional_inputs, cov_size, gpfl_loss,  # noqa: E402
                                      magnitude_loss, split_vector, valve)


def _layer_norm(v, w, b, eps=1e-5):
    m = v.mean(-1, keepdim=True)
    var = ((v - m) ** 2).mean(-1, keepdim=True)
    return (v - m) / torch.sqrt(var + eps) * w + b


def _valve_by_hand(cov, f, v):
    """(3) written out: gamma = LN(ReLU(W_g v + b_g)), beta = LN(ReLU(W_b v + b_b)), ReLU(f (gamma + 1) + beta)."""
    d = f.shape[-1]
    o, parts = 0, []
    for size in [d * d, d, d, d] * 2:
        parts.append(cov[o:o + size])
        o += size
    gW, gb, glw, glb, bW, bb, blw, blb = parts
    gamma = _layer_norm(torch.relu(gW.reshape(d, d) @ v + gb), glw, glb)
    beta = _layer_norm(torch.relu(bW.reshape(d, d) @ v + bb), blw, blb)
    return torch.relu(f * (gamma + 1) + beta)


def test_gpfl_parts_by_the_numbers():
    """(1)-(2) conditional inputs, (3) the valve, (6) the angle-level and (7) the magnitude-level terms on
    made-up numbers (d = 2, C = 3)."""
    emb = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 3.0]])
    g, p = conditional_inputs(emb, torch.tensor([0.5, 0.5, 0.0]))
    assert torch.allclose(g, torch.tensor([4 / 3, 5 / 3])) and torch.allclose(p, torch.tensor([0.5, 1.0]))
    # the valve: with zero linear layers and LayerNorm bias 0, gamma = beta = 0 and CoV(f) = ReLU(f)
    d = 2
    assert cov_size(d) == 2 * (4 + 2) + 8
    zero = torch.zeros(cov_size(d))
    f = torch.tensor([[1.5, -2.0], [0.0, 3.0]])
    assert torch.equal(valve(zero, f, p), torch.relu(f))
    gen = torch.Generator().manual_seed(0)
    cov = torch.randn(cov_size(d), generator=gen)
    assert torch.allclose(valve(cov, f, p), _valve_by_hand(cov, f, p), atol=1e-6)
    # (6): cosines of fg to the embeddings, then cross-entropy
    fg = torch.tensor([[2.0, 0.0], [1.0, 1.0]])
    y = torch.tensor([0, 2])
    s = 1 / math.sqrt(2)
    cos = torch.tensor([[1.0, 0.0, s], [s, s, 1.0]])
    want = (-(cos[0, 0] - torch.logsumexp(cos[0], 0)) - (cos[1, 2] - torch.logsumexp(cos[1], 0))) / 2
    assert angle_loss(fg, emb, y, torch.ones(2)).item() == pytest.approx(want.item(), abs=1e-6)
    # (7): ||(2, 0) - (1, 0)|| = 1 and ||(1, 1) - (3, 3)|| = sqrt(8), averaged; a padded row weighs 0
    assert magnitude_loss(fg, emb, y, torch.ones(2)).item() == pytest.approx((1 + math.sqrt(8)) / 2, abs=1e-6)
    assert magnitude_loss(fg, emb, y, torch.tensor([1.0, 0.0])).item() == pytest.approx(1.0, abs=1e-6)
    # a zero distance has a zero (not NaN) gradient
    at = emb[:1].clone().requires_grad_(True)
    (gr,) = torch.autograd.grad(magnitude_loss(at, emb, torch.tensor([0]), torch.ones(1)), at)
    assert torch.equal(gr, torch.zeros_like(gr))


def _gpfl_setup(digits, **hp):
    algo, eng = tiny(digits, GPFL, **hp)
    state = algo.init_state()
    return algo, eng, state


def test_gpfl_objective_by_hand_and_without_regularisers(digits):
    """(9) on one batch = L_P + L_alg + lambda L_mlg + mu/2 R, each written out; with lambda = mu = 0 it is
    L_P + L_alg exactly and the received embeddings play no part."""
    algo, eng, state = _gpfl_setup(digits)
    P, d, C = algo.P, algo.d, algo.C
    w, cov, emb = algo.parts(algo.ctx.init[None], state["shared"][None])
    xs, ys = eng.data(0, "train")
    x, y, wt = xs[:16], ys[:16], torch.ones(16)
    frac = torch.bincount(ys, minlength=C).float() / len(ys)             # not uniform: p differs from g
    g, p = conditional_inputs(emb[0], frac)
    assert not torch.allclose(g, p)
    frozen = emb[0] + 0.1
    z = torch.cat([w[0], cov[0], emb[0].reshape(-1)])

    def ex(lam, mu):
        return {"g": g, "p": p, "frozen": frozen.reshape(-1), "lam": torch.tensor(lam), "mu": torch.tensor(mu)}
    f = eng.f.features(w[0], x)
    fP = torch.stack([_valve_by_hand(cov[0], f[b], p) for b in range(16)])
    fG = torch.stack([_valve_by_hand(cov[0], f[b], g) for b in range(16)])
    L_P = F.cross_entropy(eng.f.head(w[0], fP), y)
    cosines = torch.stack([torch.stack([F.cosine_similarity(fG[b], emb[0, c], dim=0) for c in range(C)])
                           for b in range(16)])
    L_alg = F.cross_entropy(cosines, y)
    L_mlg = torch.stack([torch.linalg.norm(fG[b] - frozen[y[b]]) for b in range(16)]).mean()
    R = (cov[0] ** 2).sum() + (emb[0] ** 2).sum()
    got = gpfl_loss(eng.f, z, x, y, wt, ex(0.3, 0.2))
    assert got.item() == pytest.approx((L_P + L_alg + 0.3 * L_mlg + 0.1 * R).item(), rel=1e-5)
    plain = gpfl_loss(eng.f, z, x, y, wt, ex(0.0, 0.0))
    assert plain.item() == pytest.approx((L_P + L_alg).item(), rel=1e-5)
    other = ex(0.0, 0.0)
    other["frozen"] = torch.randn(C * d)
    zr = z.clone().requires_grad_(True)
    (ga,) = torch.autograd.grad(gpfl_loss(eng.f, zr, x, y, wt, ex(0.0, 0.0)), zr)
    (gb,) = torch.autograd.grad(gpfl_loss(eng.f, zr, x, y, wt, other), zr)
    assert torch.equal(plain, gpfl_loss(eng.f, z, x, y, wt, other)) and torch.equal(ga, gb)
    # the split of the training vector
    a, b, c = split_vector(z, P, d, C)
    assert torch.equal(a, w[0]) and torch.equal(b, cov[0]) and torch.equal(c, emb[0])


def test_gpfl_client_round_by_hand(digits):
    """One epoch of plain SGD on (9) over [model; CoV; GCE] from the received body, CoV and GCE and the
    client's own head, with (1)-(2) from the received GCE and the client's label fractions; the upload is
    [body; CoV; GCE], the client keeps its model."""
    lr, rnd, lam, mu = 0.1, 1, 0.05, 0.01
    algo, eng, state = _gpfl_setup(digits, lam=lam, mu=mu)
    P, d, C = algo.P, algo.d, algo.C
    gen = torch.Generator().manual_seed(4)
    local = algo.ctx.init + 0.02 * torch.randn(P, generator=gen)
    plan = Plan(np.array([2]), {"shared": state["shared"][None].clone()})
    up = algo.client_update(plan, eng, rnd, {"local": local[None].clone()})
    w, cov, emb = algo.parts(local[None], state["shared"][None])
    xs, ys = eng.data(2, "train")
    frac = torch.bincount(ys, minlength=C).float() / len(ys)
    g, p = emb[0].mean(0), frac @ emb[0]
    ex = {"g": g, "p": p, "frozen": emb[0].reshape(-1), "lam": torch.tensor(lam), "mu": torch.tensor(mu)}
    z0 = torch.cat([w[0], cov[0], emb[0].reshape(-1)])
    want = sgd(z0, lr, lambda z, x, y: gpfl_loss(eng.f, z, x, y, torch.ones(len(y)), ex), xs, ys,
               batches(eng, 2, rnd))
    assert torch.allclose(up.client_state["local"][0], want[:P], atol=1e-5)
    assert torch.allclose(up.payload["shared"][0], torch.cat([want[:P][algo.shared], want[P:]]), atol=1e-5)


def test_gpfl_prediction_is_the_head_on_the_personalized_feature(digits):
    algo, eng, state = _gpfl_setup(digits)
    clients = np.array([0, 1])
    local = algo.ctx.init.expand(2, -1).clone()
    inf = algo.inference(eng, clients, algo.eval_payload(state, clients), {"local": local})
    xs, ys = eng.data(1, "local")
    z = {"features": eng.features(inf.streams["features"], xs)}
    out = inf.combine(z, inf.extras)
    w, cov, emb = algo.parts(local, state["shared"].expand(2, -1))
    frac = torch.bincount(eng.data(1, "train")[1], minlength=10).float()
    p = (frac / frac.sum()) @ emb[1]
    want = eng.f.head(w[1], valve(cov[1], eng.f.features(w[1], xs), p))
    assert torch.allclose(out[1], want, atol=1e-5)


def test_gpfl_both_engines_agree_through_the_runner(tmp_path):
    out = []
    for engine in ("sequential", "vectorized"):
        (tmp_path / engine).mkdir()
        e, res, rows = run(tmp_path / engine, "gpfl", engine=engine)
        out.append((e.state["shared"], e.clients.data["local"], res.history[-1]["local_acc"]))
    torch.testing.assert_close(out[0][0], out[1][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[0][1], out[1][1], atol=1e-4, rtol=1e-4)
    assert out[0][2] == pytest.approx(out[1][2], abs=0.02)


def test_gpfl_refuses_bad_values():
    for key in ("gpfl.lam", "gpfl.mu"):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            resolve({"method": "gpfl", key: -0.5})
    assert resolve({"method": "gpfl"})["train.kernels"] == "aten"


# ==== the listing ==========================================================================================
def test_fedprism_methods_lists_the_three(capsys):
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    assert "fedpac  (Xu, Tong, Huang 2023" in out and "fedpac.lam" in out and "fedpac.collaborate" in out
    assert "gpfl  (Zhang et al. 2023" in out and "gpfl.lam" in out and "gpfl.mu" in out
    assert "fedem  (Marfoq" in out and "fedem.m" in out
