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
    assert not torch.equal(y.state["w"], ref.state["w"]) and set(y.state["opt"]["w"]) == {"m", "v"}


def test_resumed_run_equals_uninterrupted(tmp_path):
    from fedprism.experiment.runner import Experiment
    from fedprism.experiment.store import Store
    from fedprism.flower.settings import parse_experiment

    exp = ("method=clust_psi_pfl dataset=digits clients=6 rounds=3 fraction=0.5 local_epochs=1 lr=0.05 model=mlp "
           "device=cpu engine=sequential partition.alpha=0.3 seed=2 clust_psi_pfl.server_opt=adam "
           "clust_psi_pfl.server_lr=0.01")
    full = Experiment(parse_experiment(exp), Store(tmp_path / "full.db"))
    full.run()
    assert full.state["opt"]["w"]["m"].shape == full.state["w"].shape       # one state row per cluster model
    part = Experiment(parse_experiment(exp), Store(tmp_path / "part.db"))
    assert part.run(stop_after=1).status == "interrupted"
    again = Experiment(parse_experiment(exp), Store(tmp_path / "part.db"))
    res = again.run()
    assert res.resumed_from == 0
    assert torch.equal(again.state["w"], full.state["w"])
    assert torch.equal(again.state["opt"]["w"]["v"], full.state["opt"]["w"]["v"])


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


# -- every method that averages models (aggregation.server_update) --------------------------------------
#: method -> (extra settings, the state keys of its averaged models)
AVERAGING = {
    "fedavg": ("", ("w",)), "fedprox": ("", ("w",)), "ditto": ("", ("w",)), "apfl": ("", ("w",)),
    "fedper": ("", ("shared",)), "fedrep": ("fedrep.head_epochs=1", ("shared",)),
    "fedbn": ("model=mlp_bn", ("shared",)), "protohar": ("", ("body",)), "fedsoft": ("", ("c",)),
    "ifca": ("ifca.k=2", ("w",)), "fedclust": ("fedclust.k=2", ("w_c", "w_g")),
    "cfl": ("cfl.warmup=0 cfl.eps1=100 cfl.eps2=0", ("w",)),
    "fedprism": ("fedprism.k=2 fedprism.every=1", ("w_g", "w_c")),
    "fedprism_dual": ("fedprism_dual.k=2", ("w_g", "w_c")), "clust_psi_pfl": ("", ("w",)),
    "lg_fedavg": ("", ("shared",)), "fedbabu": ("fedbabu.finetune_epochs=1", ("shared",)),
    "pfedme": ("", ("w",)), "perfedavg": ("", ("w",)),
}
CASES = [(m, e) for m, (e, _) in AVERAGING.items()] + [
    ("ifca", "ifca.k=2 ifca.init=warmup ifca.warmup_rounds=1"), ("fedclust", "fedclust.variant=original"),
    ("fedprism", "fedprism.k=2 fedprism.every=1 fedprism.update=model")]


@pytest.mark.parametrize("method", sorted(AVERAGING))
def test_every_averaging_method_takes_the_option_and_keeps_its_run_ids(method):
    from fedprism.algorithms import REGISTRY

    assert set(SERVER_OPT_PARAMS) <= set(REGISTRY[method].params)
    base = resolve({"method": method})
    old_defaults = {"server_opt": "none", "server_lr": 1.0, "server_momentum": 0.9, "server_beta1": 0.9,
                    "server_beta2": 0.99, "server_tau": 1e-3}          # the fixed defaults before `auto`
    assert resolve({"method": method, **{f"{method}.{k}": v for k, v in old_defaults.items()}}).run_id == base.run_id
    assert resolve({"method": method, f"{method}.server_opt": "avgm", f"{method}.server_lr": 1.0}).run_id == \
        resolve({"method": method, f"{method}.server_opt": "avgm"}).run_id
    assert resolve({"method": method, f"{method}.server_opt": "avgm"}).run_id != base.run_id


def _same(a, b, path=""):
    """Bit-for-bit equality of two server states (nested dicts of tensors, arrays and plain values)."""
    if isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            _same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), path
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), path
    elif isinstance(a, float) and a != a:
        assert b != b, path                                                    # NaN in both
    else:
        assert a == b, path


@pytest.mark.parametrize("method, extra", CASES)
def test_avgm_momentum_0_lr_1_is_the_default_bit_for_bit(method, extra, tmp_path):
    """For each method with the option, through the whole round loop: avgm with momentum 0 and server lr 1
    leaves every number of the default run unchanged; adam moves the averaged models and keeps one
    optimiser state per model (per row of a model matrix) under opt/<key>."""
    from fedprism.experiment.runner import Experiment
    from fedprism.experiment.store import Store
    from fedprism.flower.settings import parse_experiment

    exp = (f"method={method} dataset=digits clients=5 rounds=2 fraction=1.0 local_epochs=1 lr=0.05 model=mlp "
           f"device=cpu engine=sequential partition.alpha=0.5 seed=3 {extra}")
    runs = {}
    for name, opt in (("none", ""), ("avgm", f"{method}.server_opt=avgm {method}.server_momentum=0 "
                                             f"{method}.server_lr=1"),
                      ("adam", f"{method}.server_opt=adam {method}.server_lr=0.01")):
        e = Experiment(parse_experiment(f"{exp} {opt}"), Store(tmp_path / f"{name}.db"))
        res = e.run()
        assert res.status == "finished"
        runs[name] = (e.state, res.final)
    ref, ident = runs["none"][0], runs["avgm"][0]
    assert "opt" not in ref and set(ident["opt"]) == set(AVERAGING[method][1])
    _same(ref, {k: v for k, v in ident.items() if k != "opt"})
    _same({k: v for k, v in runs["none"][1].items() if k != "seconds"},
          {k: v for k, v in runs["avgm"][1].items() if k != "seconds"})
    adam = runs["adam"][0]
    for key in AVERAGING[method][1]:
        assert adam["opt"][key]["m"].shape == adam[key].shape and adam["opt"][key]["m"].dtype == torch.float64
        assert not torch.equal(adam[key], ref[key]), key


def test_ifca_one_adam_step_by_hand():
    """IFCA, two cluster models, adam: each chosen cluster takes Algorithm 2's step from its clients'
    average (n_k weights) with its own state; the cluster nobody chose keeps model and state."""
    from fedprism.algorithms.ifca import IFCA
    from fedprism.protocol import Context, Update

    ctx = Context(num_clients=3, num_classes=2, spec=None, init=torch.tensor([0.5, -1.0]), n_train=np.ones(3),
                  label_hist=np.ones((3, 2)), seed=0, rounds=1, fraction=1.0, feature_dim=0)
    algo = IFCA(ctx, k=3, init="warmup", warmup_rounds=1, server_opt="adam", server_lr=0.1, server_tau=0.01)
    assert algo.hp["server_beta1"] == 0.9 and algo.hp["server_beta2"] == 0.99
    state = algo.init_state()
    state["w"] = torch.tensor([[0.5, -1.0], [1.0, 2.0], [3.0, 3.0]])
    x = torch.tensor([[1.0, -1.0], [2.0, 0.0], [0.0, 4.0]])
    up = Update(np.arange(3), {"params": x, "cluster": torch.tensor([0, 0, 1], dtype=torch.int32)},
                torch.tensor([1.0, 3.0, 2.0], dtype=torch.float64))
    algo.aggregate(state, 5, up)
    eta, b1, b2, tau = 0.1, 0.9, 0.99, 0.01
    w0 = np.array([[0.5, -1.0], [1.0, 2.0], [3.0, 3.0]])
    avg = {0: (1 * x[0].numpy() + 3 * x[1].numpy()) / 4, 1: x[2].numpy()}        # [1.75, -0.25], [0, 4]
    for c in (0, 1):
        d = avg[c] - w0[c]
        m = (1 - b1) * d
        v = b2 * tau ** 2 + (1 - b2) * d ** 2
        want = w0[c] + eta * m / (np.sqrt(v) + tau)
        assert state["w"][c].double().numpy() == pytest.approx(want, abs=1e-6), c
        assert state["opt"]["w"]["m"][c].numpy() == pytest.approx(m, abs=1e-15)
        assert state["opt"]["w"]["v"][c].numpy() == pytest.approx(v, abs=1e-15)
    assert torch.equal(state["w"][2], torch.tensor([3.0, 3.0]))                  # nobody chose cluster 2
    assert torch.equal(state["opt"]["w"]["m"][2], torch.zeros(2, dtype=torch.float64))
    assert torch.equal(state["opt"]["w"]["v"][2], torch.full((2,), tau ** 2, dtype=torch.float64))


def test_per_optimiser_defaults_and_what_the_run_id_names():
    """server_lr / server_tau at auto: 1 for avgm; Clust-PSI-PFL's Table II for the adaptive steps,
    written into the config so that the run id differs from a run with the old default eta = 1."""
    from fedprism.algorithms.aggregation import SERVER_OPT_DEFAULTS, _lr_tau

    assert SERVER_OPT_DEFAULTS["adagrad"] == (0.3162, 0.1) and SERVER_OPT_DEFAULTS["yogi"] == (0.001, 0.01)
    assert SERVER_OPT_DEFAULTS["adam"] == (0.001, 0.001) and SERVER_OPT_DEFAULTS["avgm"][0] == 1.0
    for how, (lr, tau) in SERVER_OPT_DEFAULTS.items():
        hp = resolve({"method": "fedavg", "fedavg.server_opt": how}).method_params
        if how in ("none", "avgm"):
            assert hp["server_lr"] is None and hp["server_tau"] is None and _lr_tau(hp)[0] == 1.0
        else:
            assert (hp["server_lr"], hp["server_tau"]) == (lr, tau) == _lr_tau(hp)
            old = resolve({"method": "fedavg", "fedavg.server_opt": how, "fedavg.server_lr": 1.0,
                           "fedavg.server_tau": 1e-3})
            assert old.run_id != resolve({"method": "fedavg", "fedavg.server_opt": how}).run_id
    hp = resolve({"method": "ifca", "ifca.server_opt": "adam", "ifca.server_lr": 0.05,
                  "ifca.server_tau": "auto"}).method_params
    assert (hp["server_lr"], hp["server_tau"]) == (0.05, 0.001)
    with pytest.raises(Exception, match=r"ifca.server_tau.*auto or a finite number > 0"):
        resolve({"method": "ifca", "ifca.server_tau": -1})
    with pytest.raises(Exception, match=r"fedsoft.server_lr.*auto or a finite number > 0"):
        resolve({"method": "fedsoft", "fedsoft.server_lr": "fast"})


def test_checkpoints_with_the_earlier_layout_resume():
    """A server state written when fedavg / fedprox / clust_psi_pfl kept one optimiser state directly under
    "opt" is read as the state of "w"."""
    from fedprism.algorithms.aggregation import server_update

    h = hp(server_opt="avgm", server_lr=1.0, server_momentum=0.5)
    state = {"w": W.clone(), **server_opt_state(h, 3)}
    state["opt"]["m"] += 1.0
    server_update(state, "w", AVG, h)
    assert set(state["opt"]) == {"w"}
    want = AVG + 0.5 * torch.ones(3, dtype=torch.float64)                      # avg + eta beta m_old
    assert torch.allclose(state["w"].double(), want, atol=1e-6)
