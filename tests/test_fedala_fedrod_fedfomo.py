"""FedALA, FedRoD and FedFomo: their reducing settings against FedAvg / Local bit for bit, one step of
each computed by hand on tiny models or hand-made clients, what never travels, both engines, the
messages and the `fedprism methods` listing."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import unequal_federation

from fedprism.algorithms import REGISTRY
from fedprism.algorithms.base import Context, TrainJob, Update
from fedprism.algorithms.fedala import ala_model, ala_sample, ala_step, learn_weights
from fedprism.algorithms.fedavg import FedAvg
from fedprism.algorithms.fedfomo import (choose_models, epsilon_at, fomo_update, fomo_weights, mean_ce,
                                         validation_rows)
from fedprism.algorithms.fedrod import LOG_ZERO, balanced_softmax_loss, log_prior, personal_head_loss
from fedprism.engine import LocalConfig, SequentialEngine
from fedprism.engine.vectorized import VectorizedEngine
from fedprism.errors import ConfigError
from fedprism.experiment.config import resolve
from fedprism.experiment.runner import Experiment, Simulator, sample_clients
from fedprism.experiment.store import Store
from fedprism.models import build_model
from fedprism.params import ParamSpec, flatten
from fedprism.protocol import TrainSettings

LOCAL = LocalConfig(epochs=1, batch_size=16, lr=0.05, momentum=0.9, weight_decay=1e-4)
#: a first ALA that stops after 3 epochs (window 2, any spread), so the tests stay fast
QUICK_ALA = {"threshold": 100.0, "window": 2, "max_epochs": 5}


def setup(fed, method, engine=SequentialEngine, cfg=LOCAL, seed=0, model="mlp", **hp):
    m = build_model(model, fed.input_shape, fed.num_classes, seed=seed)
    ctx = Context(fed.num_clients, fed.num_classes, ParamSpec.of(m), flatten(m), fed.n_train, fed.label_hist(),
                  seed, 10, 0.5, train=TrainSettings.of(cfg))
    eng = engine(fed, m, cfg, seed, "cpu") if engine is SequentialEngine else engine(fed, m, cfg, seed, "cpu",
                                                                                       compile=False)
    return (REGISTRY[method] if isinstance(method, str) else method)(ctx, **hp), eng


def drive(algo, engine, rounds=3, fraction=0.5, on_round=None, cohorts=None):
    sim = Simulator(algo, engine)
    for t in range(rounds):
        before = {k: v.clone() for k, v in sim.clients.data.items()}
        clients = (sample_clients(0, t, algo.ctx.num_clients, fraction) if cohorts is None
                   else np.asarray(cohorts[t]))
        plan, update, _ = sim.round(t, clients)
        if on_round:
            on_round(t, plan, update, before, sim)
    return sim


class Recorder:
    """The engine, recording every TrainJob and its result."""

    def __init__(self, engine):
        self.engine, self.jobs = engine, []

    def train(self, job, rnd):
        out = self.engine.train(job, rnd)
        self.jobs.append((job, out))
        return out

    def __getattr__(self, name):
        return getattr(self.engine, name)


@pytest.fixture
def fed(digits):
    return unequal_federation(digits)


def linear(C: int, d: int):
    """A bias-free linear model as a function of its flat [C * d] parameters."""
    return lambda w, x: x @ w.view(C, d).T


# == FedALA ===============================================================================================
@pytest.mark.parametrize("hp", [{"layers": 0}, {"eta": 0.0}])
def test_fedala_reducing_settings_are_fedavg_bit_for_bit(hp, fed):
    """p = 0 (no ALA) and eta = 0 (W stays at ones: Eq. 4 is Theta exactly): every upload and the global
    model are FedAvg's; with eta = 0 the ALA did run for clients whose model differed from Theta."""
    algo, eng = setup(fed, "fedala", **hp, **QUICK_ALA)
    ref, eng2 = setup(fed, "fedavg")
    ups = []
    a = drive(algo, eng, on_round=lambda t, p, u, b, s: ups.append(u.params.clone()))
    b = drive(ref, eng2, on_round=lambda t, p, u, b_, s: ups.append(u.params.clone()))
    assert all(torch.equal(x, y) for x, y in zip(ups[:3], ups[3:]))
    assert torch.equal(a.state["w"], b.state["w"]) and not torch.equal(b.state["w"], ref.ctx.init)
    ran = a.clients.data["started"].flatten()
    assert bool((ran > 0).any()) == ("eta" in hp)
    assert torch.equal(a.clients.data["W"], torch.ones_like(a.clients.data["W"]))


def test_ala_weight_step_by_hand():
    """Eq. 5 on a bias-free linear model: grad of the mean CE at theta_hat is (softmax - onehot)^T x / B,
    times (Theta - theta), a step of eta, clipped to [0, 1]; the lower coordinates take Theta."""
    g = torch.Generator().manual_seed(0)
    C, d, B, eta = 3, 4, 5, 0.7
    theta, Theta = torch.randn(C * d, generator=g), torch.randn(C * d, generator=g)
    W = torch.rand(C * d, generator=g)
    x, y = torch.randn(B, d, generator=g), torch.tensor([0, 2, 1, 2, 0])
    for top in (slice(0, C * d), slice(d, C * d)):                   # all of it; the last two rows
        hat = Theta.clone().double()
        hat[top] = theta.double()[top] + (Theta.double()[top] - theta.double()[top]) * W.double()[top]
        p = torch.softmax(x.double() @ hat.view(C, d).T, -1)
        grad = ((p - F.one_hot(y, C).double()).T @ x.double() / B).flatten()
        want = W.double().clone()
        want[top] = (W.double()[top] - eta * grad[top] * (Theta.double()[top] - theta.double()[top])).clamp(0, 1)
        got, loss = ala_step(linear(C, d), theta, Theta, W, top, x, y, eta)
        torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=0)
        assert torch.equal(got[:top.start], W[:top.start])          # below the top: not learned
        assert loss == pytest.approx(float(-torch.log(p[torch.arange(B), y]).mean()), rel=1e-5)
        assert 0 < int(((want > 0) & (want < 1)).sum()) and bool((want[top] == 0).any() | (want[top] == 1).any())
    # Eq. 4 is exact at the ends: W = 1 gives Theta, W = 0 gives theta
    top = slice(d, C * d)
    assert torch.equal(ala_model(theta, Theta, torch.ones(C * d), top), Theta)
    zero = ala_model(theta, Theta, torch.zeros(C * d), top)
    assert torch.equal(zero[top], theta[top]) and torch.equal(zero[:d], Theta[:d])


def test_ala_epochs_start_phase_and_sample():
    """One epoch after the start phase; in it, until the last `window` losses spread less than
    `threshold` (more than `window` epochs), at most `max_epochs`; the sample is floor(s n), >= 1."""
    g = torch.Generator().manual_seed(1)
    C, d = 3, 4
    theta, Theta, W = torch.randn(C * d, generator=g), torch.randn(C * d, generator=g), torch.full((C * d,), 0.5)
    x, y = torch.randn(10, d, generator=g), torch.randint(0, C, (10,), generator=g)
    f, top = linear(C, d), slice(0, C * d)
    _, one = learn_weights(f, theta, Theta, W, top, x, y, 0.1, 4, start_phase=False)
    _, conv = learn_weights(f, theta, Theta, W, top, x, y, 0.1, 4, start_phase=True, threshold=1e9, window=3)
    _, capped = learn_weights(f, theta, Theta, W, top, x, y, 0.1, 4, start_phase=True, threshold=0.0, window=3,
                              max_epochs=7)
    assert (len(one), len(conv), len(capped)) == (1, 4, 7)
    # an epoch's loss is the sample-weighted mean of its batch losses (batches 4, 4, 2)
    w1, l1 = ala_step(f, theta, Theta, W, top, x[:4], y[:4], 0.1)
    w2, l2 = ala_step(f, theta, Theta, w1, top, x[4:8], y[4:8], 0.1)
    _, l3 = ala_step(f, theta, Theta, w2, top, x[8:], y[8:], 0.1)
    assert one[0] == pytest.approx((4 * l1 + 4 * l2 + 2 * l3) / 10, rel=1e-6)
    assert len(ala_sample(20, 80, 0, 1, 2)) == 16 and len(ala_sample(3, 10, 0, 1, 2)) == 1
    assert len(ala_sample(0, 80, 0, 1, 2)) == 0
    s = ala_sample(50, 80, 0, 1, 2)
    assert len(set(s.tolist())) == 40 and np.array_equal(s, ala_sample(50, 80, 0, 1, 2))
    assert not np.array_equal(s, ala_sample(50, 80, 0, 2, 2))           # another round, another sample


def test_fedala_learns_until_convergence_only_in_the_first_ala(fed):
    """Round 0: theta = Theta, nothing learned. Later: a client's first ALA runs window + 1 epochs (the
    spread test passes at once), every later one a single epoch; W and theta never travel."""
    algo, eng = setup(fed, "fedala", **QUICK_ALA)
    rec = Recorder(eng)
    cohorts = [[0, 1, 2], [1, 3], [1, 3, 4]]
    epochs = []

    def check(t, plan, update, before, sim):
        epochs.append(dict(zip(update.clients.tolist(), update.metrics["ala_epochs"].tolist())))
        assert set(update.payload) == {"params"} and set(plan.payload) == {"params"}
        job, out = rec.jobs[-1]
        W, theta = sim.clients.data["W"], sim.clients.data["theta"]
        for r, c in enumerate(update.clients):               # the start is Eq. 4 with the new W
            assert torch.equal(job.start[r], ala_model(before["theta"][c], plan.start[r], W[c], algo.top))
            assert torch.equal(theta[c], out.params[r])
        out_ = np.setdiff1d(np.arange(fed.num_clients), update.clients)
        assert torch.equal(W[out_], before["W"][out_])

    drive(algo, rec, rounds=3, on_round=check, cohorts=cohorts)
    assert epochs == [{0: 0, 1: 0, 2: 0}, {1: 3, 3: 3}, {1: 1, 3: 1, 4: 3}]


def test_fedala_predicts_with_its_own_model_and_scores_the_ala_start(fed):
    algo, eng = setup(fed, "fedala", **QUICK_ALA)
    sim = drive(algo, eng, rounds=2)
    inf = sim.inference()
    assert torch.equal(inf.streams["own"], sim.clients.data["theta"])
    for c in range(fed.num_clients):
        assert torch.equal(inf.streams["ala"][c], ala_model(sim.clients.data["theta"][c], sim.state["w"],
                                                            sim.clients.data["W"][c], algo.top))
    assert set(inf.alternatives) == {"ala"}
    with pytest.raises(ConfigError, match="fedala.layers"):
        setup(fed, "fedala", layers=4)                      # the MLP has three layers


# == FedRoD ===============================================================================================
def test_balanced_softmax_loss_by_hand():
    """-log(N_y e^{z_y} / sum_c N_c e^{z_c}) with counts N = (3, 0, 1, 6): a class the client lacks is out
    of the normaliser; a padding row of that class adds nothing and stays finite."""
    z = torch.tensor([[1.0, 2.0, -1.0, 0.5], [0.0, 0.3, 0.2, -0.4], [0.7, 5.0, 0.1, 0.0]])
    y = torch.tensor([0, 3, 1])
    N = [3.0, 0.0, 1.0, 6.0]

    def by_hand(row, label):
        num = N[label] * math.exp(float(z[row, label]))
        return -math.log(num / sum(n * math.exp(float(v)) for n, v in zip(N, z[row])))

    model = lambda w, x: x                                              # noqa: E731 - logits are the input
    prior = log_prior(torch.tensor(N))
    assert prior[1] == LOG_ZERO and prior[3] == pytest.approx(math.log(6))
    weight = torch.tensor([1.0, 1.0, 0.0])
    got = balanced_softmax_loss(model, None, z, y, weight, {"log_prior": prior})
    assert float(got) == pytest.approx((by_hand(0, 0) + by_hand(1, 3)) / 2, rel=1e-6)
    z_ = z.clone().requires_grad_(True)
    loss = balanced_softmax_loss(model, None, z_, y, weight, {"log_prior": prior})
    loss.backward()
    assert torch.isfinite(loss) and bool(torch.isfinite(z_.grad).all()) and torch.equal(z_.grad[2], torch.zeros(4))
    # uniform counts: plain cross-entropy (up to rounding)
    ce = F.cross_entropy(z[:2], y[:2])
    assert float(balanced_softmax_loss(model, None, z[:2], y[:2], torch.ones(2), {"log_prior": log_prior(
        torch.full((4,), 5.0))})) == pytest.approx(float(ce), rel=1e-6)


def test_personal_head_loss_by_hand(fed):
    """L_P: cross-entropy of the generic head's logits plus the personal head's, on w's features."""
    algo, eng = setup(fed, "fedrod")
    g = torch.Generator().manual_seed(2)
    P, head = algo.ctx.spec.size, algo.head
    w, generic = torch.randn(P, generator=g) * 0.1, torch.randn(P, generator=g) * 0.1
    x, y = eng.data(3, "train")
    x, y = x[:8], y[:8]
    f = eng.f
    mixed = w.clone()
    mixed[head] = generic[head]
    want = F.cross_entropy(f(mixed, x) + f(w, x), y)
    got = personal_head_loss(f, w, x, y, torch.ones(8), {"generic": generic})
    assert float(got) == pytest.approx(float(want), rel=1e-5)


class FedAvgBSM(FedAvg):
    """FedAvg whose clients minimise the balanced softmax of their own label counts: FedRoD with a
    personal head that stays zero, written without FedRoD's code."""

    name = "test_fedavg_bsm"

    def client_update(self, plan, trainer, rnd, cstate):
        counts = torch.stack([torch.bincount(trainer.data(int(c), "train")[1], minlength=self.ctx.num_classes)
                              for c in plan.clients]).double()
        prior = torch.where(counts > 0, counts.clamp(min=1).log(), torch.full_like(counts, -1e30)).float()
        t = trainer.train(TrainJob(plan.clients, plan.start, loss=balanced_softmax_loss,
                                   extras={"log_prior": prior}), rnd)
        return Update(t.clients, {"params": t.params}, t.n_samples, {"train_loss": t.loss})


@pytest.mark.parametrize("generic_loss", ["ce", "bsm"])
def test_fedrod_with_a_zero_personal_head_is_fedavg_bit_for_bit(generic_loss, fed):
    """personal_epochs = 0: the generic model is FedAvg's (ce) or FedAvg-with-balanced-softmax's (bsm),
    bit for bit, and the prediction is the generic model's exactly. A trained personal head leaves the
    uploads (the generic pass) as they were."""
    algo, eng = setup(fed, "fedrod", generic_loss=generic_loss, personal_epochs=0)
    ref, eng2 = setup(fed, FedAvg if generic_loss == "ce" else FedAvgBSM)
    pers, eng3 = setup(fed, "fedrod", generic_loss=generic_loss)
    a, b, c = drive(algo, eng), drive(ref, eng2), drive(pers, eng3)
    assert torch.equal(a.state["w"], b.state["w"]) and torch.equal(c.state["w"], b.state["w"])
    assert not torch.equal(b.state["w"], ref.ctx.init)
    assert not bool(a.clients.data["phi"].any())
    inf, x = a.inference(), eng.data(2, "local")[0]
    logits = {k: eng.f(v[2], x) for k, v in inf.streams.items()}
    assert torch.equal(inf.combine(logits, {}), eng.f(b.state["w"], x))     # generic + 0: exactly generic
    ra, rb = a.evaluate("local"), b.evaluate("local")       # (two streams are scored on another path)
    assert torch.equal(ra.correct, rb.correct)
    torch.testing.assert_close(ra.loss_sum, rb.loss_sum, rtol=1e-6, atol=0)
    rc = c.evaluate("local")
    assert not torch.equal(rc.loss_sum, rb.loss_sum)                  # the personal heads change predictions
    if generic_loss == "bsm":                                         # and the balanced softmax the model
        plain, eng4 = setup(fed, "fedrod", generic_loss="ce", personal_epochs=0)
        assert not torch.equal(drive(plain, eng4).state["w"], a.state["w"])


def test_fedrod_personal_head_stays_on_the_client_and_only_the_head_trains(fed):
    algo, eng = setup(fed, "fedrod", personal_epochs=2)
    rec = Recorder(eng)
    head = algo.head
    body = torch.ones(algo.ctx.spec.size, dtype=torch.bool)
    body[head] = False

    def check(t, plan, update, before, sim):
        (gj, go), (pj, po) = rec.jobs[-2:]
        assert (gj.stream, pj.stream, pj.epochs) == ("train", "fedrod_personal", 2)
        assert torch.equal(pj.extras["generic"], go.params) and torch.equal(update.params, go.params)
        assert torch.equal(po.params[:, body], go.params[:, body])    # the body and generic head: frozen
        phi = sim.clients.data["phi"]
        S = update.clients
        assert torch.equal(phi[S][:, head], po.params[:, head]) and not bool(phi[:, body].any())
        out = np.setdiff1d(np.arange(fed.num_clients), S)
        assert torch.equal(phi[out], before["phi"][out])
        assert set(update.payload) == {"params"}

    sim = drive(algo, rec, on_round=check)
    inf = sim.inference()
    x, _ = eng.data(2, "local")
    logits = {k: eng.f(v[2], x) for k, v in inf.streams.items()}
    manual = eng.f(sim.state["w"], x)
    personal = sim.state["w"].clone()
    personal[head] = sim.clients.data["phi"][2][head]
    torch.testing.assert_close(inf.combine(logits, {}), manual + eng.f(personal, x))
    assert torch.equal(inf.alternatives["generic"](logits, {}), manual)


# == FedFomo ==============================================================================================
def test_fomo_weights_by_hand():
    raw, w = fomo_weights(1.0, torch.tensor([0.5, 1.5, 0.8]), torch.tensor([2.0, 1.0, 0.0]))
    assert raw.tolist() == [0.25, -0.5, 0.0] and w.tolist() == [1.0, 0.0, 0.0]
    raw, w = fomo_weights(1.0, torch.tensor([0.8, 0.6]), torch.tensor([1.0, 4.0]))
    torch.testing.assert_close(raw, torch.tensor([0.2, 0.1], dtype=torch.float64))
    torch.testing.assert_close(w, torch.tensor([2 / 3, 1 / 3], dtype=torch.float64))
    raw, w = fomo_weights(0.5, torch.tensor([0.8, 0.6]), torch.tensor([1.0, 4.0]))
    assert not bool(w.any())
    theta = torch.tensor([1.0, 2.0])
    models = torch.tensor([[3.0, 2.0], [1.0, -1.0]])
    assert torch.equal(fomo_update(theta, models, torch.tensor([0.25, 0.75], dtype=torch.float64)),
                       torch.tensor([1.5, -0.25]))
    assert torch.equal(fomo_update(theta, models, torch.zeros(2, dtype=torch.float64)), theta)


def test_fedfomo_update_on_three_hand_made_clients(fed):
    """Client 0 holds its own model; clients 1 and 2 have uploaded theirs (hand-made vectors). Client 0's
    start is Eq. 5 with the weights of Eqs. 6-7 from losses on its validation rows computed here with
    plain cross-entropy; the server adds the raw weights to P[0] and stores the trained model."""
    fed3 = replace(fed, train_idx=fed.train_idx[3:], test_idx=fed.test_idx[3:])
    algo, eng = setup(fed3, "fedfomo", m=2, epsilon=0.0)
    rec = Recorder(eng)
    sim = Simulator(algo, rec)
    P, g = algo.ctx.spec.size, torch.Generator().manual_seed(3)
    own = algo.ctx.init + 0.05 * torch.randn(P, generator=g)
    others = torch.stack([algo.ctx.init + 0.05 * torch.randn(P, generator=g), algo.ctx.init.clone()])
    others[1] = own + 0.5 * (others[0] - own)                      # a model between the two
    sim.clients.write(np.array([0]), {"theta": own[None]})
    sim.state["models"][1:] = others
    sim.state["seen"][1:] = True
    plan, update, _ = sim.round(1, np.array([0]))
    assert plan.payload["ids"].tolist() == [[1, 2]] and torch.equal(plan.payload["models"][0], others)
    x, y = validation_rows(eng, 0, 0.2, 0)
    L = [float(F.cross_entropy(eng.f(m, x), y)) for m in (own, others[0], others[1])]
    d = [float(torch.linalg.vector_norm((m - own).double())) for m in others]
    raw = [(L[0] - L[1]) / d[0], (L[0] - L[2]) / d[1]]
    pos = [max(r, 0.0) for r in raw]
    assert sum(pos) > 0
    w = [p / sum(pos) for p in pos]
    want = own.double() + sum(wi * (m.double() - own.double()) for wi, m in zip(w, others))
    job, out = rec.jobs[-1]
    torch.testing.assert_close(job.start[0].double(), want, atol=1e-6, rtol=0)
    torch.testing.assert_close(update.payload["weights"][0].double(), torch.tensor(raw, dtype=torch.float64),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sim.state["affinity"][0, 1:], torch.tensor(raw, dtype=torch.float64), atol=1e-5,
                               rtol=1e-5)
    assert torch.equal(sim.state["models"][0], out.params[0]) and bool(sim.state["seen"].all())
    assert torch.equal(sim.clients.data["theta"][0], out.params[0])


def test_fedfomo_download_choice():
    rng = lambda: np.random.default_rng(5)                            # noqa: E731
    aff = np.array([0.0, 3.0, -1.0, 2.0, 2.0, 0.5])
    cands = np.array([1, 2, 3, 4, 5])
    assert choose_models(aff, cands, 2, 0.0, rng()).tolist() == [1, 3] or \
        choose_models(aff, cands, 2, 0.0, rng()).tolist() == [1, 4]
    assert choose_models(aff, cands, 3, 0.0, rng()).tolist() == [1, 3, 4]
    assert choose_models(aff, cands, 9, 0.0, rng()).tolist() == [1, 2, 3, 4, 5]
    picks = {tuple(choose_models(aff, cands, 2, 1.0, np.random.default_rng(s))) for s in range(40)}
    assert len(picks) > 3 and all(len(p) == 2 and len(set(p)) == 2 for p in picks)
    assert epsilon_at(0.3, 0.05, 0) == 0.3 and epsilon_at(0.3, 0.05, 2) == pytest.approx(0.2)
    assert epsilon_at(0.3, 0.05, 7) == 0.0


def test_fedfomo_first_round_is_local_training_bit_for_bit_and_plans_only_uploaded_others(fed):
    algo, eng = setup(fed, "fedfomo", m=2)
    ref, eng2 = setup(fed, "local")
    a, b = Simulator(algo, eng), Simulator(ref, eng2)
    S = np.array([1, 3, 4])
    plan, _, _ = a.round(0, S)
    b.round(0, S)
    assert bool((plan.payload["ids"] == -1).all()) and algo.wire_bytes("plan", plan.payload) == 0
    assert torch.equal(a.clients.data["theta"], b.clients.data["w"])
    plan, update, _ = a.round(1, np.array([0, 3]))
    ids = plan.payload["ids"]
    for r, c in enumerate([0, 3]):
        sent = [int(i) for i in ids[r] if i >= 0]
        assert len(sent) == 2 and c not in sent and set(sent) <= {1, 3, 4}
        for k, i in enumerate(sent):
            assert torch.equal(plan.payload["models"][r, k], a.state["models"][i]) or i in (0, 3)
    assert a.algo.wire_bytes("plan", plan.payload) == 2 * 2 * (4 * algo.ctx.spec.size + 8)


def test_fedfomo_wire_round_trip_and_malformed_rows(fed):
    algo, _ = setup(fed, "fedfomo", m=3)
    P = algo.ctx.spec.size
    row = {"models": torch.zeros(1, 3, P), "ids": torch.tensor([[4, 1, -1]])}
    row["models"][0, :2] = torch.randn(2, P)
    wire = algo.encode("plan", row)
    assert wire["models"].shape == (1, 2, P) and wire["ids"].tolist() == [[4, 1]]
    back = algo.decode("plan", wire)
    assert torch.equal(back["models"], row["models"]) and torch.equal(back["ids"], row["ids"])
    with pytest.raises(ValueError, match="ids"):
        algo.decode("plan", {"models": wire["models"], "ids": torch.tensor([[4, 1, 2, 0]])})
    with pytest.raises(ValueError, match="models"):
        algo.decode("plan", {"models": torch.zeros(1, 1, P), "ids": wire["ids"]})
    assert algo.encode("update", {"params": torch.ones(1, P)})["params"].shape == (1, P)


def test_fedfomo_validation_rows(fed):
    """The client's validation rows when the federation has them; else a fixed 20% of its train rows."""
    val = [idx[:3] for idx in fed.train_idx]
    with_val = replace(fed, train_idx=[idx[3:] for idx in fed.train_idx], val_idx=val)
    _, eng = setup(with_val, "fedfomo")
    vx, vy = validation_rows(eng, 5, 0.2, 0)
    assert torch.equal(vy, with_val.y_train[val[5]])
    _, eng = setup(fed, "fedfomo")
    tx, ty = eng.data(5, "train")
    vx, vy = validation_rows(eng, 5, 0.2, 0)
    assert len(vy) == int(0.2 * len(ty)) == 18
    again = validation_rows(eng, 5, 0.2, 0)[0]
    assert torch.equal(vx, again)
    rows = [int(torch.nonzero((tx.flatten(1) == r.flatten()).all(1)).flatten()[0]) for r in vx]
    assert len(set(rows)) == 18
    assert mean_ce(eng.f, torch.zeros(2, eng.spec.size), vx[:0], vy[:0]).tolist() == [0.0, 0.0]


def test_fedfomo_bytes_through_the_runner(tmp_path):
    c = resolve(dict(dataset="digits", clients=6, rounds=3, fraction=0.5, local_epochs=1, batch_size=16, lr=0.05,
                     model="mlp", engine="sequential", device="cpu", seed=1, method="fedfomo",
                     **{"fedfomo.m": 2}))
    e = Experiment(c, Store(tmp_path / "f.db"))
    res = e.run()
    P = e.ctx.spec.size
    assert res.history[0]["bytes_down"] == 0
    for h in res.history:
        assert h["bytes_up"] == (4 * P + 4 * 2) * h["accepted"]
        sent = h["bytes_down"] / (4 * P + 8)
        assert sent == int(sent) and sent <= 2 * h["clients"]
    assert res.history[-1]["bytes_down"] > 0


# == all three ============================================================================================
@pytest.mark.parametrize("method,hp", [("fedala", QUICK_ALA), ("fedrod", {}), ("fedfomo", {"m": 2})])
def test_both_engines_agree(method, hp, fed):
    finals = []
    for engine in (SequentialEngine, VectorizedEngine):
        algo, eng = setup(fed, method, engine=engine, **hp)
        sim = drive(algo, eng, rounds=2)
        inf = sim.inference()
        finals.append((torch.cat(list(inf.streams.values()), 1), sim.evaluate("local")))
    (a, ra), (b, rb) = finals
    torch.testing.assert_close(a, b, atol=1e-4 * max(1.0, float(a.abs().max())), rtol=1e-4)
    assert abs(int(ra.correct.sum()) - int(rb.correct.sum())) <= 2


def test_methods_listing(capsys):
    from fedprism.cli import main

    assert main(["methods", "fedala", "fedrod", "fedfomo"]) == 0
    out = capsys.readouterr().out
    for key in ("fedala.layers", "fedala.rand_percent", "fedala.eta", "fedala.threshold", "fedala.window",
                "fedala.max_epochs", "fedrod.generic_loss", "fedrod.personal_epochs", "fedfomo.m",
                "fedfomo.epsilon", "fedfomo.epsilon_decay", "fedfomo.val_split"):
        assert key in out, key
    for name in ("fedala", "fedrod", "fedfomo"):
        cls = REGISTRY[name]
        assert name in cls.__module__ and "arXiv:" in cls.paper
        with pytest.raises(ConfigError, match=f"{name}."):
            resolve({"method": name, f"{name}.{next(iter(cls.own_params))}": -1})
