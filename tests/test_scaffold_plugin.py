"""SCAFFOLD as a plugin (tests/plugins/scaffold_plugin.py) through the public view of the training settings
(`ctx.train`, `TrainSettings`) and the steps each client took (`Trained.steps`): it runs through `fedprism
run`; with zero control variates its first round is FedAvg's bit for bit; its control-variate update is
option II computed by hand; both engines and the Flower simulation agree."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import unequal_federation

import fedprism
from fedprism.algorithms import REGISTRY
from fedprism.cli import main
from fedprism.engine import LocalConfig, SequentialEngine
from fedprism.engine.vectorized import VectorizedEngine
from fedprism.errors import ConfigError
from fedprism.experiment.config import resolve
from fedprism.experiment.runner import Experiment, Simulator
from fedprism.experiment.store import Store
from fedprism.models import build_model
from fedprism.params import ParamSpec, flatten
from fedprism.protocol import Context, Plan, TrainJob, TrainSettings
from fedprism.seeds import stream_seed
from plugins.scaffold_plugin import Scaffold, option_two

TINY = dict(dataset="digits", model="mlp", clients=4, rounds=2, fraction=1.0, local_epochs=1, lr=0.05,
            engine="sequential")


@pytest.fixture
def scaffold():
    fedprism.register(Scaffold)
    yield Scaffold
    REGISTRY.pop("scaffold_plugin", None)


# -- the public view --------------------------------------------------------------------------------------
def test_the_training_settings_are_the_configurations(tmp_path):
    cfg = resolve({**TINY, "method": "fedavg", "batch_size": 16, "momentum": 0.5, "weight_decay": 1e-4,
                   "local_epochs": 3})
    with Store(tmp_path / "t.db") as s:
        exp = Experiment(cfg, s)
    t = exp.ctx.train
    assert t == TrainSettings(optimizer="sgd", lr=0.05, momentum=0.5, weight_decay=1e-4, batch_size=16,
                              local_epochs=3)
    assert TrainSettings.of(exp.engine.cfg) == t                      # what the engine trains with
    with pytest.raises(AttributeError):
        t.lr = 1.0                                                    # read-only
    job = TrainJob(np.array([0]), exp.ctx.init.unsqueeze(0), epochs=1, optimizer="adam")
    assert t.for_job(job).local_epochs == 1 and t.for_job(job).optimizer == "adam" and t.for_job(job).lr == 0.05
    assert t.steps(33) == 3 * 3 and t.steps(32, epochs=2) == 2 * 2 and t.steps(0) == 3


@pytest.mark.parametrize("engine", [SequentialEngine, VectorizedEngine])
def test_trained_steps_are_the_batches_each_client_took(digits, engine):
    fed = unequal_federation(digits, sizes=(7, 20, 33))
    model = build_model("mlp", fed.input_shape, fed.num_classes, seed=0)
    eng = engine(fed, model, LocalConfig(epochs=2, batch_size=16, lr=0.05), 0)
    clients = np.array([2, 0, 1])
    t = eng.train(TrainJob(clients, flatten(model).expand(3, -1).clone()), 0)
    assert t.steps.dtype == torch.int64 and t.steps.tolist() == [2 * 3, 2 * 1, 2 * 2]   # ceil(n / 16) per epoch
    t = eng.train(TrainJob(clients, flatten(model).expand(3, -1).clone(), epochs=0), 0)
    assert t.steps.tolist() == [0, 0, 0]


# -- through `fedprism run` -----------------------------------------------------------------------------
def test_scaffold_runs_through_fedprism_run(scaffold, tmp_path, capsys):
    db = str(tmp_path / "s.db")
    args = [f"{k}={json.dumps(v) if isinstance(v, str) else v}" for k, v in {**TINY, "method": "scaffold_plugin"}.items()]
    assert main(["run", "--db", db, "--quiet", "--json", *args]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["status"] == "finished" and out["rejected"] == 0 and 0.1 < out["local_acc"] <= 1.0
    assert main(["run", "--db", db, "--quiet", *args, "optimizer=adam"]) == 2
    assert "config key 'optimizer' = 'adam' is not valid: sgd: SCAFFOLD" in capsys.readouterr().err


# -- zero control variates: FedAvg ----------------------------------------------------------------------
@pytest.mark.parametrize("engine", ["sequential", "vectorized"])
def test_first_round_with_zero_control_variates_is_fedavg_bit_for_bit(scaffold, tmp_path, engine):
    states = {}
    for method in ("scaffold_plugin", "fedavg"):
        cfg = resolve({**TINY, "method": method, "engine": engine, "momentum": 0.9, "fedavg.weighting": "uniform"}
                      if method == "fedavg" else {**TINY, "method": method, "engine": engine, "momentum": 0.9})
        with Store(tmp_path / f"{method}.db") as s:
            exp = Experiment(cfg, s)
        sim = Simulator(exp.algo, exp.engine)
        _, update, _ = sim.round(0, np.arange(4))
        states[method] = (sim.state["w"].clone(), update.params.clone(), update.metrics["train_loss"].clone())
        if method == "scaffold_plugin":
            c_rows = sim.clients.data["c"]
    for a, b in zip(states["scaffold_plugin"], states["fedavg"]):
        assert torch.equal(a, b)
    assert bool(c_rows.abs().sum() > 0)                  # the control variates moved: round 2 is SCAFFOLD's


# -- option II by hand ---------------------------------------------------------------------------------------
def _tiny(digits, engine=SequentialEngine, lr=0.1):
    fed = unequal_federation(digits, sizes=(30, 45, 20))            # N = 3 clients, two of them sampled below
    model = build_model("mlp", fed.input_shape, fed.num_classes, seed=0)
    local = LocalConfig(epochs=2, batch_size=16, lr=lr)
    eng = engine(fed, model, local, 0)
    ctx = Context(fed.num_clients, fed.num_classes, ParamSpec.of(model), flatten(model), fed.n_train,
                  fed.label_hist(), seed=0, rounds=2, fraction=1.0, train=TrainSettings.of(local))
    return Scaffold(ctx), eng


def test_control_variate_update_is_option_two_computed_by_hand(digits):
    algo, eng = _tiny(digits)
    P, lr, rnd = algo.ctx.spec.size, 0.1, 1
    g = torch.Generator().manual_seed(0)
    x = algo.ctx.init.clone()
    c = 0.01 * torch.randn(P, generator=g)
    c_i = 0.01 * torch.randn(2, P, generator=g)
    clients = np.array([0, 1])
    plan = Plan(clients, {"params": x.expand(2, -1).clone(), "c": c.expand(2, -1).clone()})
    up = algo.client_update(plan, eng, rnd, {"c": c_i.clone()})
    for k, client in enumerate(clients):
        # the client's K local steps of y <- y - lr (grad CE(y) + c - c_i), in the engines' batch order
        xs, ys = eng.data(int(client), "train")
        y, K = x.clone(), 0
        gen = torch.Generator().manual_seed(stream_seed(0, rnd, int(client), "train"))
        for _ in range(2):                                     # epochs
            for b in torch.randperm(len(ys), generator=gen).split(16):
                w = y.clone().requires_grad_(True)
                (grad,) = torch.autograd.grad(F.cross_entropy(eng.f(w, xs[b]), ys[b]), w)
                y = y - lr * (grad + c - c_i[k])
                K += 1
        assert K == 2 * -(-len(ys) // 16)
        want = c_i[k].double() - c.double() + (x.double() - y.double()) / (K * lr)
        assert torch.allclose(up.params[k], y, atol=1e-5)
        assert torch.allclose(up.client_state["c"][k].double(), want, atol=1e-4)
        assert torch.allclose(up.payload["delta_c"][k], up.client_state["c"][k] - c_i[k])
    # the server: x is the uniform mean of the y_i, c moves by (1/N) sum of the sampled clients' delta c
    state = {"w": x.clone(), "c": c.clone()}
    up.sent = plan.payload
    algo.aggregate(state, rnd, up)
    assert torch.allclose(state["w"], up.params.double().mean(0).float(), atol=1e-7)
    assert torch.allclose(state["c"].double(), c.double() + up.payload["delta_c"].double().sum(0) / 3, atol=1e-7)


def test_option_two_by_the_numbers():
    """c_i+ = c_i - c + (x - y) / (K lr) on numbers small enough to check by eye; K = 0 keeps c_i."""
    c_i = torch.tensor([[1.0, 2.0], [1.0, 2.0]])
    c = torch.tensor([[0.5, 0.5], [0.5, 0.5]])
    x = torch.tensor([[1.0, 1.0], [1.0, 1.0]])
    y = torch.tensor([[0.0, 2.0], [0.0, 2.0]])
    got = option_two(c_i, c, x, y, torch.tensor([4, 0]), lr=0.5)
    assert got.tolist() == [[1.0 - 0.5 + 1.0 / 2.0, 2.0 - 0.5 - 1.0 / 2.0], [1.0, 2.0]]


def test_both_engines_take_the_same_steps_and_give_the_same_control_variates(digits):
    out = {}
    for engine in (SequentialEngine, VectorizedEngine):
        algo, eng = _tiny(digits, engine)
        x, P = algo.ctx.init.clone(), algo.ctx.spec.size
        c = torch.full((P,), 1e-3)
        plan = Plan(np.array([1, 0]), {"params": x.expand(2, -1).clone(), "c": c.expand(2, -1).clone()})
        t = eng.train(TrainJob(plan.clients, plan.start), 0)
        out[engine] = (t.steps, algo.client_update(plan, eng, 0, {"c": torch.zeros(2, P)}).client_state["c"])
    (s1, c1), (s2, c2) = out.values()
    assert torch.equal(s1, s2) and s1.tolist() == [2 * 3, 2 * 2]
    assert torch.allclose(c1, c2, atol=1e-4)


def test_adam_is_refused_from_the_settings(digits):
    fed = unequal_federation(digits, sizes=(30, 45))
    model = build_model("mlp", fed.input_shape, fed.num_classes, seed=0)
    ctx = Context(fed.num_clients, fed.num_classes, ParamSpec.of(model), flatten(model), fed.n_train,
                  fed.label_hist(), 0, 2, 1.0, train=TrainSettings.of(LocalConfig(optimizer="adam")))
    with pytest.raises(ConfigError, match="optimizer"):
        Scaffold(ctx)


def test_scaffold_on_flower_gives_the_in_process_numbers(scaffold, tmp_path):
    """The Flower simulation (one node per client, each with its own engine) takes the same steps and keeps
    the same control variates on its nodes as the in-process run."""
    pytest.importorskip("flwr")
    import test_flower as tf

    from fedprism.flower.server_app import serve

    exp = ("method=scaffold_plugin dataset=digits clients=3 rounds=2 fraction=1.0 local_epochs=1 lr=0.05 model=mlp "
           "device=cpu engine=sequential partition.alpha=0.5 seed=2")
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
        assert torch.allclose(torch.from_numpy(rows["c"].numpy()).double(),
                              ref.clients.data["c"][node["client-id"]].double().unsqueeze(0), atol=1e-6)
    assert res.final["local_acc"] == pytest.approx(final["local_acc"], abs=1e-9)


def tf_identity(tf):
    """test_flower's `task_identity` fixture as a context manager."""
    import contextlib

    return contextlib.contextmanager(tf.task_identity.__wrapped__)()
