"""SCAFFOLD, FedNova and q-FFL (src/fedprism/algorithms/scaffold.py, fednova.py, qffl.py): their reducing
settings equal FedAvg bit for bit through the runner on both engines (SCAFFOLD's first round with zero
control variates, FedNova with equal step counts, q-FFL with q = 0); one client step and one server step
of each computed by hand on a tiny federation; the engines agree; SCAFFOLD on Flower gives the in-process
numbers; bad settings are refused; the methods are listed by `fedprism methods`."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import unequal_federation
from test_fedprox_ditto_apfl import SMALL, TIMING, run

from fedprism.algorithms.fednova import FedNova, effective_steps, rescaled_models, tau_eff
from fedprism.algorithms.qffl import LOSS_OFFSET, QFFL, qffl_step
from fedprism.algorithms.scaffold import Scaffold, corrected_ce, option_two, server_model, server_variate
from fedprism.cli import main
from fedprism.engine import LocalConfig, SequentialEngine
from fedprism.errors import ConfigError
from fedprism.experiment.config import resolve
from fedprism.experiment.runner import Experiment, Simulator
from fedprism.experiment.store import Store
from fedprism.models import build_model
from fedprism.params import ParamSpec, flatten
from fedprism.protocol import Context, Plan, TrainSettings, Update
from fedprism.seeds import stream_seed

UNEQUAL = "dirichlet_per_class"          # clients of unequal size: unequal step counts


def assert_same_numbers(ref, got, up_extra: int, down_extra: int = 0):
    """The same final server model, every stored round metric and every client row; bytes up (down) larger by
    `up_extra` (`down_extra`) bytes per accepted (sampled) client: what the method sends beside the model."""
    (ea, ra, ca), (eb, rb, cb) = ref, got
    assert torch.equal(ea.state["w"], eb.state["w"])
    assert len(ra.history) == len(rb.history) == SMALL["rounds"]
    for ha, hb in zip(ra.history, rb.history):
        assert set(ha) == set(hb)
        for k in set(ha) - TIMING - {"bytes_up", "bytes_down"}:
            assert ha[k] == hb[k], (k, ha[k], hb[k])
        assert hb["bytes_up"] == ha["bytes_up"] + up_extra * hb["accepted"]
        assert hb["bytes_down"] == ha["bytes_down"] + down_extra * hb["clients"]
    assert ca == cb


def _tiny(digits, cls, engine=SequentialEngine, sizes=(30, 45, 20), lr=0.1, momentum=0.0, epochs=2, **hp):
    fed = unequal_federation(digits, sizes=sizes)
    model = build_model("mlp", fed.input_shape, fed.num_classes, seed=0)
    local = LocalConfig(epochs=epochs, batch_size=16, lr=lr, momentum=momentum)
    eng = engine(fed, model, local, 0)
    ctx = Context(fed.num_clients, fed.num_classes, ParamSpec.of(model), flatten(model), fed.n_train,
                  fed.label_hist(), seed=0, rounds=2, fraction=1.0, train=TrainSettings.of(local))
    return cls(ctx, **hp), eng


def _sgd_by_hand(eng, client, start, rnd, lr, rho, epochs, grad_of):
    """`epochs` epochs of SGD with momentum rho (torch's: buf <- rho buf + g, dampening 0; w <- w - lr buf) in
    the engines' batch order (the stream `train` of (seed 0, rnd, client)). Returns (w, steps)."""
    xs, ys = eng.data(int(client), "train")
    w, buf, K = start.clone(), None, 0
    gen = torch.Generator().manual_seed(stream_seed(0, rnd, int(client), "train"))
    for _ in range(epochs):
        for b in torch.randperm(len(ys), generator=gen).split(16):
            g = grad_of(w, xs[b], ys[b])
            buf = g if buf is None else rho * buf + g
            w = w - lr * buf
            K += 1
    return w, K


def _ce_grad(eng):
    def grad_of(w, x, y):
        w = w.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(F.cross_entropy(eng.f(w, x), y), w)
        return g
    return grad_of


# -- the reducing settings: FedAvg bit for bit -----------------------------------------------------------------
@pytest.mark.parametrize("engine", ["sequential", "vectorized"])
@pytest.mark.parametrize("option", ["I", "II"])
def test_scaffold_first_round_with_zero_control_variates_is_fedavg_bit_for_bit(tmp_path, engine, option):
    """c = c_i = 0: the correction is an exact zero and eta_g = 1, so round 0 is FedAvg's with the uniform mean
    (the model, each client's model and training loss); the control variates then move, so round 1 differs."""
    base = {**SMALL, "engine": engine, "fraction": 1.0, "clients": 4}
    out = {}
    for method, extra in (("fedavg", {"fedavg.weighting": "uniform"}), ("scaffold", {"scaffold.option": option})):
        with Store(tmp_path / f"{method}.db") as s:
            exp = Experiment(resolve({**base, "method": method, **extra}), s)
        sim = Simulator(exp.algo, exp.engine)
        _, update, _ = sim.round(0, np.arange(4))
        out[method] = [sim.state["w"].clone(), update.params.clone(), update.metrics["train_loss"].clone()]
        if method == "scaffold":
            c_rows, c = sim.clients.data["c_i"].clone(), sim.state["c"].clone()
        sim.round(1, np.arange(4))
        out[method].append(sim.state["w"].clone())
    for a, b in zip(out["scaffold"][:3], out["fedavg"][:3]):
        assert torch.equal(a, b)
    assert bool(c_rows.abs().sum() > 0) and bool(c.abs().sum() > 0)
    assert not torch.equal(out["scaffold"][3], out["fedavg"][3])


@pytest.mark.parametrize("engine", ["sequential", "vectorized"])
def test_fednova_with_equal_step_counts_is_fedavg_bit_for_bit(tmp_path, engine):
    """A batch larger than every client's data: each client takes local_epochs = 2 steps, every a_i is the
    same (momentum 0.9), and FedNova is FedAvg with the same weighting, round by round, client by client, 3
    rounds of half the clients (the steps tau_i travel as 4 more bytes up per client)."""
    kw = dict(engine=engine, batch_size=512, local_epochs=2)
    assert_same_numbers(run(tmp_path, "fedavg", **kw), run(tmp_path, "fednova", **kw), up_extra=4)
    assert_same_numbers(run(tmp_path, "fedavg", fedavg__weighting="uniform", **kw),
                        run(tmp_path, "fednova", fednova__weighting="uniform", **kw), up_extra=4)


def test_fednova_with_unequal_step_counts_is_not_fedavg(tmp_path):
    """Clients of unequal size (a per-class Dirichlet split), batches of 16: they take different numbers of
    steps and the normalisation moves the model away from FedAvg's."""
    e, _, _ = run(tmp_path, "fednova", partition=UNEQUAL)
    assert len(set(e.ctx.n_train.tolist())) > 1
    assert not torch.equal(e.state["w"], run(tmp_path, "fedavg", partition=UNEQUAL)[0].state["w"])


@pytest.mark.parametrize("engine", ["sequential", "vectorized"])
def test_qffl_with_q_zero_is_uniform_fedavg_bit_for_bit(tmp_path, engine):
    assert_same_numbers(run(tmp_path, "fedavg", engine=engine, fedavg__weighting="uniform"),
                        run(tmp_path, "qffl", engine=engine, qffl__q=0.0), up_extra=4)


def test_qffl_with_q_above_zero_is_not_fedavg(tmp_path):
    e, _, _ = run(tmp_path, "qffl", qffl__q=0.5)
    assert not torch.equal(e.state["w"], run(tmp_path, "fedavg", fedavg__weighting="uniform")[0].state["w"])


# -- SCAFFOLD by hand --------------------------------------------------------------------------------------------
def test_scaffold_option_two_with_momentum_by_hand(digits):
    """Two of three clients, made-up x, c and c_i; momentum 0.5. Each client's steps are SGD with momentum on
    grad CE(y) + c - c_i; c_i+ = c_i - c + (x - y_i) / (a lr) with a the sum over the K steps of (1 - rho^k) /
    (1 - rho), summed here term by term."""
    lr, rho, rnd = 0.1, 0.5, 1
    algo, eng = _tiny(digits, Scaffold, lr=lr, momentum=rho)
    P = algo.ctx.spec.size
    g = torch.Generator().manual_seed(0)
    x = algo.ctx.init.clone()
    c = 0.01 * torch.randn(P, generator=g)
    c_i = 0.01 * torch.randn(2, P, generator=g)
    clients = np.array([2, 0])
    plan = Plan(clients, {"params": x.expand(2, -1).clone(), "c": c.expand(2, -1).clone()})
    up = algo.client_update(plan, eng, rnd, {"c_i": c_i.clone()})
    ce_grad = _ce_grad(eng)
    for k, client in enumerate(clients):
        y, K = _sgd_by_hand(eng, client, x, rnd, lr, rho, 2, lambda w, xb, yb, k=k: ce_grad(w, xb, yb) + c - c_i[k])
        a = sum((1 - rho ** j) / (1 - rho) for j in range(1, K + 1))
        want = c_i[k].double() - c.double() + (x.double() - y.double()) / (a * lr)
        assert K == 2 * -(-len(eng.data(int(client), "train")[1]) // 16)
        assert torch.allclose(up.params[k], y, atol=1e-5)
        assert torch.allclose(up.client_state["c_i"][k].double(), want, atol=1e-4)
        assert torch.equal(up.payload["delta_c"][k], up.client_state["c_i"][k] - c_i[k])
    assert set(up.payload) == {"params", "delta_c"}                            # c_i itself never travels


def test_scaffold_option_one_is_the_full_local_gradient_at_x(digits):
    """Option I: c_i+ is the gradient at x of the mean cross-entropy over all the client's training samples
    (one autograd call on the whole data here; the module accumulates chunks of the batch size), whatever the
    local steps; the model trained is the same as under option II."""
    algo, eng = _tiny(digits, Scaffold, option="I")
    two, _ = _tiny(digits, Scaffold)
    P = algo.ctx.spec.size
    g = torch.Generator().manual_seed(3)
    x = algo.ctx.init + 0.05 * torch.randn(P, generator=g)
    c, c_i = 0.01 * torch.randn(P, generator=g), 0.01 * torch.randn(2, P, generator=g)
    clients = np.array([1, 2])
    plan = Plan(clients, {"params": x.expand(2, -1).clone(), "c": c.expand(2, -1).clone()})
    up = algo.client_update(plan, eng, 0, {"c_i": c_i.clone()})
    for k, client in enumerate(clients):
        xs, ys = eng.data(int(client), "train")
        w = x.clone().requires_grad_(True)
        (want,) = torch.autograd.grad(F.cross_entropy(eng.f(w, xs), ys), w)
        assert torch.allclose(up.client_state["c_i"][k], want, atol=1e-6)
    assert torch.equal(up.params, two.client_update(plan, eng, 0, {"c_i": c_i.clone()}).params)


def test_scaffold_server_step_by_the_numbers():
    """N = 4 clients, x = (1, 1), c = (0.5, 0): clients return y = (2, 1) and (1, 3) (mean (1.5, 2), Delta x =
    (0.5, 1)), Delta c = (1, 2) and (3, -2). eta_g = 2: x = (1, 1) + 2 (0.5, 1) = (2, 3); c = (0.5, 0) + (4, 0) / 4
    = (1.5, 0), |S| / N of the mean Delta c."""
    ctx = Context(num_clients=4, num_classes=2, spec=None, init=torch.ones(2), n_train=np.ones(4),
                  label_hist=np.ones((4, 2)), seed=0, rounds=1, fraction=1.0,
                  train=TrainSettings("sgd", 0.1, 0.0, 0.0, 16, 1))
    up = Update(np.array([1, 3]), {"params": torch.tensor([[2.0, 1.0], [1.0, 3.0]]),
                                   "delta_c": torch.tensor([[1.0, 2.0], [3.0, -2.0]])},
                torch.tensor([10.0, 30.0], dtype=torch.float64), sent={"params": torch.ones(2, 2)})
    algo = Scaffold(ctx, global_lr=2.0)
    state = algo.init_state()
    state["c"] = torch.tensor([0.5, 0.0], dtype=torch.float64)
    algo.aggregate(state, 0, up)
    assert state["w"].tolist() == [2.0, 3.0] and state["c"].tolist() == [1.5, 0.0]
    plan = algo.plan(state, 1, np.array([0, 2]))                             # the next round sends x and c
    assert plan.payload["params"].tolist() == [[2.0, 3.0]] * 2 and plan.payload["c"].tolist() == [[1.5, 0.0]] * 2
    assert plan.payload["c"].dtype == torch.float32 and state["c"].dtype == torch.float64
    # eta_g = 1, samples weighting: the n_i mean (2 x 10 + 1 x 30) / 40 = 1.25, (10 + 90) / 40 = 2.5
    algo = Scaffold(ctx, weighting="samples")
    state = algo.init_state()
    algo.aggregate(state, 0, up)
    assert state["w"].tolist() == [1.25, 2.5] and state["c"].tolist() == [1.0, 0.0]
    # the pure functions: eta_g = 1 returns the average itself; option II with K = 0 keeps c_i
    avg = torch.tensor([0.1, 0.7], dtype=torch.float64)
    assert torch.equal(server_model(avg, torch.tensor([5.0, -3.0]), 1.0), avg)
    assert server_variate(torch.zeros(2), torch.ones(3, 2), 6).tolist() == [0.5, 0.5]
    got = option_two(torch.tensor([[1.0, 2.0], [1.0, 2.0]]), torch.full((2, 2), 0.5), torch.ones(2, 2),
                     torch.tensor([[0.0, 2.0], [0.0, 2.0]]), torch.tensor([4, 0]), lr=0.5)
    assert got.tolist() == [[1.0 - 0.5 + 1.0 / 2.0, 2.0 - 0.5 - 1.0 / 2.0], [1.0, 2.0]]
    # momentum 0.5, K = 2: a = 1 + 1.5 = 2.5, so (x - y) / (a lr) = (1, -1) / 1.25
    got = option_two(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), torch.tensor([[0.0, 2.0]]),
                     torch.tensor([2]), lr=0.5, momentum=0.5)
    assert got[0].tolist() == pytest.approx([0.8, -0.8], abs=1e-7)


def test_corrected_loss_is_the_cross_entropy_with_the_correction_as_gradient():
    def f(w, x):
        return x @ w.view(2, 2)
    w, x, y = torch.tensor([1.0, 0.0, 0.0, 1.0], requires_grad=True), torch.tensor([[1.0, 0.0]]), torch.tensor([0])
    corr = torch.tensor([0.5, -1.0, 2.0, 3.0])
    loss = corrected_ce(f, w, x, y, torch.ones(1), {"correction": corr})
    plain = F.cross_entropy(f(w, x), y)
    assert loss.item() == plain.item()                                       # the added term is an exact zero
    (g,) = torch.autograd.grad(loss, w)
    (g0,) = torch.autograd.grad(F.cross_entropy(f(w, x), y), w)
    assert torch.equal(g, g0 + corr)


def test_scaffold_server_variate_is_the_mean_of_the_clients_variates(tmp_path):
    """c = (1/N) sum_i c_i at every round (c and c_i start at 0; (5) adds (1/N) of each change), with half the
    clients sampled each round and momentum: the invariant that makes c - c_i a difference of estimates."""
    with Store(tmp_path / "s.db") as s:
        exp = Experiment(resolve({**SMALL, "method": "scaffold"}), s)
    sim = Simulator(exp.algo, exp.engine)
    from fedprism.experiment.runner import sample_clients
    for t in range(3):
        sim.round(t, sample_clients(SMALL["seed"], t, 6, 0.5))
        mean = sim.clients.data["c_i"].double().mean(0)
        assert torch.allclose(sim.state["c"], mean, atol=1e-6) and bool(mean.abs().sum() > 0)


# -- FedNova by hand ---------------------------------------------------------------------------------------------
def test_effective_steps_by_the_numbers_and_against_torch_sgd():
    """(1): rho = 0 gives tau; tau = 3, rho = 0.5 gives [3 - 0.5 (1 - 0.125) / 0.5] / 0.5 = 4.25; and K steps of
    torch.optim.SGD with momentum on a constant gradient g move by lr a(K, rho) g."""
    assert effective_steps(torch.tensor([0, 1, 7]), 0.0).tolist() == [0.0, 1.0, 7.0]
    assert effective_steps(torch.tensor([3]), 0.5).tolist() == [4.25]
    assert effective_steps(torch.tensor([0, 1]), 0.9).tolist() == pytest.approx([0.0, 1.0], abs=1e-12)
    for rho, K in ((0.9, 13), (0.3, 5), (0.0, 4)):
        p = torch.zeros(3, dtype=torch.float64, requires_grad=True)
        opt = torch.optim.SGD([p], lr=0.01, momentum=rho)
        g = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
        for _ in range(K):
            opt.zero_grad()
            (p * g).sum().backward()
            opt.step()
        a = float(effective_steps(torch.tensor([K]), rho))
        assert torch.allclose(-p.detach(), 0.01 * a * g, rtol=1e-12)


def test_fednova_server_step_by_the_numbers():
    """x = (1, 1); two clients with tau = 1 and 3 (rho = 0: a = tau) return y = (0, 1) and (1, -2): d = (1, 0) and
    (0, 3) / 3 = (0, 1). Uniform p: tau_eff = 2, x = (1, 1) - 2 (0.5, 0.5) = (0, 0). Samples 10 and 30: p = (1/4,
    3/4), tau_eff = 2.5, x = (1, 1) - 2.5 (0.25, 0.75) = (0.375, -0.875). (FedAvg would give (0.5, -0.5) and
    (0.75, -1.25).)"""
    ctx = Context(num_clients=4, num_classes=2, spec=None, init=torch.ones(2), n_train=np.ones(4),
                  label_hist=np.ones((4, 2)), seed=0, rounds=1, fraction=1.0,
                  train=TrainSettings("sgd", 0.1, 0.0, 0.0, 16, 1))
    up = Update(np.array([0, 2]), {"params": torch.tensor([[0.0, 1.0], [1.0, -2.0]]),
                                   "steps": torch.tensor([1, 3], dtype=torch.int32)},
                torch.tensor([10.0, 30.0], dtype=torch.float64), sent={"params": torch.ones(2, 2)})
    for weighting, want in (("uniform", [0.0, 0.0]), ("samples", [0.375, -0.875])):
        algo = FedNova(ctx, weighting=weighting)
        state = algo.init_state()
        algo.aggregate(state, 0, up)
        assert state["w"].tolist() == pytest.approx(want, abs=1e-7), weighting
    # momentum 0.5: a = (1, 4.25), uniform tau_eff = 2.625; x - 2.625 ((1, 0) + (0, 3) / 4.25) / 2
    ctx.train = TrainSettings("sgd", 0.1, 0.5, 0.0, 16, 1)
    algo = FedNova(ctx, weighting="uniform")
    state = algo.init_state()
    algo.aggregate(state, 0, up)
    assert state["w"].tolist() == pytest.approx([1 - 2.625 * 0.5, 1 - 2.625 * (3 / 4.25) / 2], abs=1e-6)
    # rescaled_models: equal a gives the rows themselves, bit for bit (here sum_j p_j a is not a in floating
    # point, and x - (tau_eff / a)(x - y) would miss y); a = 0 gives x
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(5, generator=gen), torch.randn(3, 5, generator=gen)
    p = torch.full((3,), 1 / 3, dtype=torch.float64)
    a = torch.full((3,), 7.1, dtype=torch.float64)
    assert tau_eff(a, p) != 7.1
    assert torch.equal(rescaled_models(x, y, a, p), y.double())
    z = rescaled_models(torch.ones(5), y, torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64), p)
    assert torch.equal(z[0], torch.ones(5, dtype=torch.float64))


def test_fednova_client_sends_its_model_and_its_steps(digits):
    """The client trains as FedAvg's and sends tau_i, the steps its engine counted: epochs x ceil(n_i / B)."""
    algo, eng = _tiny(digits, FedNova, momentum=0.9)
    x = algo.ctx.init
    plan = Plan(np.array([0, 1, 2]), {"params": x.expand(3, -1).clone()})
    up = algo.client_update(plan, eng, 0, {})
    assert up.payload["steps"].dtype == torch.int32 and up.payload["steps"].tolist() == [2 * 2, 2 * 3, 2 * 2]
    w, K = _sgd_by_hand(eng, 1, x, 0, 0.1, 0.9, 2, _ce_grad(eng))
    assert K == 6 and torch.allclose(up.params[1], w, atol=1e-5)


# -- q-FFL by hand -----------------------------------------------------------------------------------------------
def test_qffl_server_step_is_the_papers_update():
    """(3)-(6) written as printed, in float64, on made-up rows: w - sum_k F_k^q L (w - wbar_k) / sum_k h_k."""
    g = torch.Generator().manual_seed(0)
    w, y = torch.randn(7, generator=g), torch.randn(3, 7, generator=g)
    losses = torch.tensor([0.3, 1.7, 2.2])
    lr = 0.05
    from fedprism.algorithms.aggregation import average
    for q in (0.5, 1.0, 2.0, 5.0):
        L = 1 / lr
        Fk = losses.double() + LOSS_OFFSET
        dw = L * (w.double() - y.double())
        h = q * Fk ** (q - 1) * (dw * dw).sum(1) + L * Fk ** q
        want = w.double() - (Fk[:, None] ** q * dw).sum(0) / h.sum()
        got = qffl_step(w, y, w.expand(3, -1), losses, q, lr, average)
        assert torch.allclose(got, want, atol=1e-12, rtol=0), q
    # q = 0: the uniform mean itself (the weights F^0 are exact ones)
    assert torch.equal(qffl_step(w, y, w.expand(3, -1), losses, 0.0, lr, average), average(y, torch.ones(3)))


def test_qffl_server_step_by_the_numbers():
    """q = 1, lr = 0.5 (L = 2), w = (0, 0), y = (1, 0) and (0, 1) with F = 1 and 3: Delta w = (-2, 0), (0, -2); h =
    1 x 4 + 2 x 1 = 6 and 1 x 4 + 2 x 3 = 10; w = -((-2, 0) + 3 (0, -2)) / 16 = (0.125, 0.375)."""
    ctx = Context(num_clients=4, num_classes=2, spec=None, init=torch.zeros(2), n_train=np.ones(4),
                  label_hist=np.ones((4, 2)), seed=0, rounds=1, fraction=1.0,
                  train=TrainSettings("sgd", 0.5, 0.0, 0.0, 16, 1))
    up = Update(np.array([0, 3]), {"params": torch.eye(2), "loss": torch.tensor([1.0, 3.0])},
                torch.tensor([10.0, 30.0], dtype=torch.float64), sent={"params": torch.zeros(2, 2)})
    algo = QFFL(ctx, q=1.0)
    state = algo.init_state()
    algo.aggregate(state, 0, up)
    assert state["w"].tolist() == pytest.approx([0.125, 0.375], abs=1e-7)


def test_qffl_client_loss_is_the_received_models_training_loss(digits):
    """F_k is the mean cross-entropy of w^t over all of client k's training samples, before training; the
    training is FedAvg's."""
    algo, eng = _tiny(digits, QFFL, momentum=0.9)
    x = algo.ctx.init
    plan = Plan(np.array([2, 0]), {"params": x.expand(2, -1).clone()})
    up = algo.client_update(plan, eng, 0, {})
    for k, client in enumerate((2, 0)):
        xs, ys = eng.data(client, "train")
        assert up.payload["loss"][k].item() == pytest.approx(F.cross_entropy(eng.f(x, xs), ys).item(), rel=1e-6)
    assert up.payload["loss"].dtype == torch.float32 and up.payload["loss"].shape == (2,)
    from fedprism.algorithms.fedavg import FedAvg
    ref, _ = _tiny(digits, FedAvg)
    assert torch.equal(up.params, ref.client_update(plan, eng, 0, {}).params)


# -- both engines ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method,kw", [("scaffold", {}), ("scaffold", {"scaffold__option": "I"}),
                                       ("scaffold", {"scaffold__global_lr": 1.5, "weight_decay": 1e-3}),
                                       ("fednova", {}), ("qffl", {}), ("qffl", {"qffl__q": 2.0})])
def test_both_engines_agree(tmp_path, method, kw):
    """3 rounds of half of 6 clients of unequal size, momentum 0.9: the vectorized engine's server state is the
    sequential engine's up to rounding."""
    a = run(tmp_path / "seq", method, engine="sequential", partition=UNEQUAL, **kw)[0]
    b = run(tmp_path / "vec", method, engine="vectorized", partition=UNEQUAL, **kw)[0]
    for key in ("w", "c") if method == "scaffold" else ("w",):
        torch.testing.assert_close(a.state[key], b.state[key], atol=2e-5, rtol=1e-4)
    if method == "scaffold":
        torch.testing.assert_close(a.clients.data["c_i"], b.clients.data["c_i"], atol=2e-4, rtol=1e-3)


# -- Flower -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra", ["scaffold.option=I scaffold.global_lr=1.5", "scaffold.option=II momentum=0.5"])
def test_scaffold_on_flower_gives_the_in_process_numbers(tmp_path, extra):
    """The Flower simulation (one node per client, each with its own engine) takes the same steps and keeps the
    same control variates on its nodes as the in-process run; x and c on the server are the same."""
    pytest.importorskip("flwr")
    import test_flower as tf
    from test_scaffold_plugin import tf_identity

    from fedprism.flower.server_app import serve

    exp = ("method=scaffold dataset=digits clients=3 rounds=2 fraction=1.0 local_epochs=1 lr=0.05 model=mlp "
           f"device=cpu engine=sequential partition.alpha=0.5 seed=2 {extra}")
    rc = tf.run_config(exp, tmp_path / "f.db", save_final=str(tmp_path / "final.pt"))
    ref, final = tf.in_process(exp, tmp_path / "ref.db")
    with tf_identity(tf):
        grid = tf.FakeGrid(tf.nodes_for(3), rc)
        res = serve(grid, rc)
    assert res.status == "finished"
    got = torch.load(tmp_path / "final.pt", weights_only=False)["state"]
    tf.assert_same_state(ref.state, got)                                    # x and c
    for nid, node in grid.nodes.items():
        rows = grid.states[nid].array_records.get("fedprism-client-state")
        assert torch.allclose(torch.from_numpy(rows["c_i"].numpy()).double(),
                              ref.clients.data["c_i"][node["client-id"]].double().unsqueeze(0), atol=1e-6)
    assert res.final["local_acc"] == pytest.approx(final["local_acc"], abs=1e-9)


# -- refused settings, the listing -------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["scaffold", "fednova", "qffl"])
def test_adam_is_refused_naming_the_key(method, tmp_path, capsys):
    args = [f"method={method}", "dataset=digits", "model=mlp", "clients=3", "rounds=1", "optimizer=adam"]
    assert main(["run", "--db", str(tmp_path / "a.db"), "--quiet", *args]) == 2
    err = capsys.readouterr().err
    assert "config key 'optimizer' = 'adam' is not valid: sgd: " in err, err


@pytest.mark.parametrize("key,value,allowed", [("scaffold.option", "III", "I"), ("scaffold.global_lr", 0, "> 0"),
                                               ("fednova.weighting", "steps", "samples"), ("qffl.q", -1, ">= 0")])
def test_bad_parameters_name_the_key(key, value, allowed):
    with pytest.raises(ConfigError) as e:
        resolve({"method": key.split(".")[0], key: value})
    assert e.value.key == key and allowed in str(e.value)


def test_the_methods_are_listed(capsys):
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    for line in ("scaffold  (Karimireddy et al. 2020, arXiv:1910.06378)",
                 "fednova  (Wang, Liu, Liang, Joshi, Poor 2020, arXiv:2007.07481)",
                 "qffl  (Li, Sanjabi, Beirami, Smith 2020, arXiv:1905.10497)"):
        assert line in out
    for key in ("scaffold.option", "scaffold.global_lr", "scaffold.weighting", "fednova.weighting", "qffl.q"):
        assert key in out
