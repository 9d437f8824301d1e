"""Server optimisers (FedAvgM: Hsu, Qi, Brown 2019, arXiv:1909.06335; FedAdagrad / FedYogi / FedAdam:
Reddi et al. 2021, arXiv:2003.00295): one step by hand, FedAvg as a special case, resume, run ids."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedprism.algorithms.aggregation import SERVER_OPT_PARAMS, server_opt_state, server_step
from fedprism.experiment.config import resolve

DEFAULTS = {k: p.default for k, p in SERVER_OPT_PARAMS.items()}
W = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float32)
AVG = torch.tensor([1.5, -2.5, 0.5], dtype=torch.float64)         # Delta = [0.5, -0.5, 0]


def hp(**kw):
    return {**DEFAULTS, **kw}


def _step(h, rounds=1, avg=AVG):
    opt = server_opt_state(h, 3).get("opt")
    w = W.clone()
    for _ in range(rounds):
        w = server_step(w, avg, opt, h)
    return w, opt


def test_none_is_the_average():
    w, opt = _step(hp())
    assert opt is None and torch.equal(w, AVG.float())


def test_avgm_by_hand_two_steps():
    h = hp(server_opt="avgm", server_lr=0.5, server_momentum=0.7)
    w, opt = _step(h)
    d = np.array([0.5, -0.5, 0.0])
    assert w.double().numpy() == pytest.approx(W.double().numpy() + 0.5 * d, abs=1e-7)      # m_0 = Delta
    assert opt["m"].numpy() == pytest.approx(d)
    w2 = server_step(w, AVG, opt, h)                          # Delta_1 = AVG - w
    d1 = AVG.numpy() - w.double().numpy()
    m1 = 0.7 * d + d1
    assert opt["m"].numpy() == pytest.approx(m1, abs=1e-12)
    assert w2.double().numpy() == pytest.approx(w.double().numpy() + 0.5 * m1, abs=1e-6)


@pytest.mark.parametrize("how", ["adagrad", "yogi", "adam"])
def test_adaptive_one_step_by_hand(how):
    eta, b1, b2, tau = 0.1, 0.9, 0.99, 0.01
    h = hp(server_opt=how, server_lr=eta, server_beta1=b1, server_beta2=b2, server_tau=tau)
    w, opt = _step(h)
    d = np.array([0.5, -0.5, 0.0])
    v0 = tau ** 2
    m = (1 - b1) * d
    v = {"adagrad": v0 + d ** 2,
         "yogi": v0 - (1 - b2) * d ** 2 * np.sign(v0 - d ** 2),
         "adam": b2 * v0 + (1 - b2) * d ** 2}[how]
    want = W.double().numpy() + eta * m / (np.sqrt(v) + tau)
    assert opt["m"].numpy() == pytest.approx(m, abs=1e-15) and opt["v"].numpy() == pytest.approx(v, abs=1e-15)
    assert w.double().numpy() == pytest.approx(want, abs=1e-6)          # one float32 rounding
    assert w[2] == W[2]                                       # no update, no move


def test_adam_without_moments_moves_by_eta_sign():
    """beta1 = beta2 = 0 and tau -> 0: every coordinate moves by eta sign(Delta)."""
    w, _ = _step(hp(server_opt="adam", server_lr=0.01, server_beta1=0.0, server_beta2=0.0, server_tau=1e-12))
    assert (w.double() - W.double()).numpy() == pytest.approx([0.01, -0.01, 0.0], abs=1e-7)


def test_avgm_momentum_0_lr_1_is_fedavg_bit_for_bit(tmp_path):
    from fedprism.experiment.runner import Experiment
    from fedprism.experiment.store import Store
    from fedprism.flower.settings import parse_experiment

    exp = ("method=fedavg dataset=digits clients=4 rounds=2 fraction=1.0 local_epochs=1 lr=0.05 model=mlp "
           "device=cpu engine=sequential partition.alpha=0.5 seed=1")
    ref = Experiment(parse_experiment(exp), Store(tmp_path / "a.db"))
    ref.run()
    m = Experiment(parse_experiment(exp + " fedavg.server_opt=avgm fedavg.server_momentum=0 fedavg.server_lr=1"),
                   Store(tmp_path / "b.db"))
    m.run()
    assert m.run_id != ref.run_id
    assert torch.equal(m.state["w"], ref.state["w"])
    # and a real server optimiser changes the model, and its state is in the server state (checkpointed)
    y = Experiment(parse_experiment(exp + " fedavg.server_opt=yogi fedavg.server_lr=0.01"), Store(tmp_path / "c.db"))
    y.run()
    assert not torch.equal(y.state["w"], ref.state["w"]) and set(y.state["opt"]) == {"m", "v"}


def test_resumed_run_equals_uninterrupted(tmp_path):
    from fedprism.experiment.runner import Experiment
    from fedprism.experiment.store import Store
    from fedprism.flower.settings import parse_experiment

    exp = ("method=clust_psi_pfl dataset=digits clients=6 rounds=3 fraction=0.5 local_epochs=1 lr=0.05 model=mlp "
           "device=cpu engine=sequential partition.alpha=0.3 seed=2 clust_psi_pfl.server_opt=adam "
           "clust_psi_pfl.server_lr=0.01")
    full = Experiment(parse_experiment(exp), Store(tmp_path / "full.db"))
    full.run()
    assert full.state["opt"]["m"].shape == full.state["w"].shape            # one state row per cluster model
    part = Experiment(parse_experiment(exp), Store(tmp_path / "part.db"))
    assert part.run(stop_after=1).status == "interrupted"
    again = Experiment(parse_experiment(exp), Store(tmp_path / "part.db"))
    res = again.run()
    assert res.resumed_from == 0
    assert torch.equal(again.state["w"], full.state["w"])
    assert torch.equal(again.state["opt"]["v"], full.state["opt"]["v"])


#: run ids computed before the server optimisers existed (the paper's FMNIST protocol keys)
BEFORE = {"fedavg": "c7356112e09e4c03", "fedprox": "eadd47fa825198d3"}


@pytest.mark.parametrize("method", sorted(BEFORE))
def test_stored_run_ids_are_unchanged(method):
    raw = {"method": method, "dataset": "fmnist", "clients": 100, "rounds": 40, "fraction": 0.5, "local_epochs": 5,
           "optimizer": "adam", "lr": 1e-3}
    assert resolve(raw).run_id == BEFORE[method]
    assert resolve({**raw, f"{method}.server_opt": "none", f"{method}.server_lr": 1.0}).run_id == BEFORE[method]


def test_avgm_identity_is_exact_where_the_textbook_formula_rounds():
    """w + 1 * (avg - w) loses avg = 2^-60 next to w = 1 in float64; the step is computed as
    avg + (eta - 1) Delta + eta beta m, which returns avg itself at eta = 1, beta = 0."""
    w, avg = torch.tensor([1.0]), torch.tensor([2.0 ** -60], dtype=torch.float64)
    h = hp(server_opt="avgm", server_lr=1.0, server_momentum=0.0)
    opt = server_opt_state(h, 1)["opt"]
    for _ in range(2):
        assert torch.equal(server_step(w, avg, opt, h), avg.float())


@pytest.mark.parametrize("method", ["fedavg", "fedprox", "clust_psi_pfl"])
def test_defaults_keep_run_ids_and_state(method):
    base = resolve({"method": method})
    at_defaults = resolve({"method": method, **{f"{method}.{k}": v for k, v in DEFAULTS.items()}})
    assert base.run_id == at_defaults.run_id and base.train_id == at_defaults.train_id
    for how in ("avgm", "adagrad", "yogi", "adam"):
        assert resolve({"method": method, f"{method}.server_opt": how}).run_id != base.run_id
    with pytest.raises(Exception, match="server_opt"):
        resolve({"method": method, f"{method}.server_opt": "sgd"})
    with pytest.raises(Exception, match="server_lr"):
        resolve({"method": method, f"{method}.server_lr": 0})
