"""FedPer, FedRep and FedBN (personal layers / local BatchNorm), and the BatchNorm models they need:
reductions to FedAvg, what never leaves a client, FedRep's two phases, both engines on the BN models."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import unequal_federation

from fedprism.algorithms import REGISTRY
from fedprism.algorithms.base import Context
from fedprism.engine import LocalConfig, SequentialEngine
from fedprism.engine.vectorized import VectorizedEngine
from fedprism.errors import ConfigError
from fedprism.experiment.config import resolve
from fedprism.experiment.runner import Experiment, Simulator, sample_clients
from fedprism.experiment.store import Store
from fedprism.federation import Federation
from fedprism.models import BatchNorm1d, build_model
from fedprism.params import ParamSpec, flatten

LOCAL = LocalConfig(epochs=1, batch_size=16, lr=0.05, momentum=0.9, weight_decay=1e-4)
#: sha256 of the float32 bytes of build_model(name, shape, 10, seed=0) before the BN models were added:
#: the committed runs start from these vectors
INITIAL = {("lenet5", (1, 32, 32)): "2a2d133895b1684e55d0f152ead2914b55adc551d9790a4b4585309b79c60362",
           ("mlp", (64,)): "e6da43c7892e0a85c2494a096f19c6651fe4e2204f446817e4b25155cf9f102f",
           ("cnn", (3, 32, 32)): "d825ac6518a92fca5119b56333d0233da8216f7ea0b696f25c25eabb61b7d27e"}


def setup(fed, method, model="mlp", engine=SequentialEngine, cfg=LOCAL, seed=0, **hp):
    m = build_model(model, fed.input_shape, fed.num_classes, seed=seed)
    ctx = Context(fed.num_clients, fed.num_classes, ParamSpec.of(m), flatten(m), fed.n_train,
                  fed.label_hist(), seed, 10, 0.5)
    eng = engine(fed, m, cfg, seed, "cpu") if engine is SequentialEngine else engine(fed, m, cfg, seed, "cpu",
                                                                                       compile=False)
    return REGISTRY[method](ctx, **hp), eng


def drive(algo, engine, rounds=3, fraction=0.5, on_round=None):
    sim = Simulator(algo, engine)
    for t in range(rounds):
        before = {k: v.clone() for k, v in sim.clients.data.items()}
        plan, update, _ = sim.round(t, sample_clients(0, t, algo.ctx.num_clients, fraction))
        if on_round:
            on_round(t, plan, update, before, sim)
    return sim


def private_index(algo) -> torch.Tensor:
    return torch.nonzero(algo.mask_private).flatten()


# -- models ------------------------------------------------------------------------------------------
def test_existing_models_keep_their_initial_vectors_and_bn_models_their_layout():
    # the committed runs start from these vectors: the BN models and ParamSpec.batchnorm changed none
    for (name, shape), digest in INITIAL.items():
        w = flatten(build_model(name, shape, 10, seed=0))
        assert hashlib.sha256(w.numpy().tobytes()).hexdigest() == digest, name
    for name, shape, n_bn in (("lenet5", (1, 32, 32), 0), ("mlp", (64,), 0), ("cnn", (3, 32, 32), 2),
                              ("lenet5_bn", (1, 32, 32), 4), ("mlp_bn", (64,), 2)):
        m = build_model(name, shape, 10, seed=0)
        spec = ParamSpec.of(m)
        bn = [mod for mod in m.modules() if isinstance(mod, torch.nn.modules.batchnorm._BatchNorm)]
        assert len(spec.batchnorm) == len(bn) == n_bn, name
        w = flatten(m)
        for s, mod in zip(spec.batchnorm, bn):                     # each slice is one layer's (weight, bias)
            assert torch.equal(w[s], torch.cat([mod.weight.detach(), mod.bias.detach()])), name
        assert sum(s.stop - s.start for _, s in spec.layers) == spec.size
    # same seed: the BN models' conv / linear layers start as the plain models'
    for name, shape in (("lenet5", (1, 32, 32)), ("mlp", (64,))):
        plain, bn = build_model(name, shape, 10, seed=4), build_model(f"{name}_bn", shape, 10, seed=4)
        spec = ParamSpec.of(bn)
        keep = torch.ones(spec.size, dtype=torch.bool)
        for s in spec.batchnorm:
            keep[s] = False
        assert torch.equal(flatten(bn)[keep], flatten(plain))


def test_batchnorm1d_is_batch_norm_and_takes_a_batch_of_one():
    bn = BatchNorm1d(5)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 2)
        bn.bias.uniform_(-1, 1)
    x = torch.randn(7, 5)
    torch.testing.assert_close(bn(x), F.batch_norm(x, None, None, bn.weight, bn.bias, True, 0.0, bn.eps))
    assert torch.equal(bn(x[:1]), bn.bias.detach()[None])      # one sample is its own mean: exactly beta


# -- FedPer / FedRep ---------------------------------------------------------------------------------
@pytest.mark.parametrize("method,model", [("fedper", "mlp"), ("fedbn", "mlp")])
def test_reducing_setting_is_fedavg_bit_for_bit(method, model, digits):
    """FedPer with no personal layer, FedBN on a model without BatchNorm: FedAvg's numbers exactly."""
    fed = unequal_federation(digits)
    hp = {"personal": 0} if method == "fedper" else {}
    algo, eng = setup(fed, method, model, **hp)
    ref, eng2 = setup(fed, "fedavg", model)
    a, b = drive(algo, eng), drive(ref, eng2)
    assert algo.upload()["shared"].shape == (algo.ctx.spec.size,)
    assert torch.equal(a.state["shared"], b.state["w"])
    assert not torch.equal(b.state["w"], ref.ctx.init)
    assert torch.equal(a.inference().single, b.inference().single)
    ra, rb = a.evaluate("local"), b.evaluate("local")
    assert torch.equal(ra.correct, rb.correct) and torch.equal(ra.loss_sum, rb.loss_sum)


@pytest.mark.parametrize("method,model,hp", [("fedper", "mlp", {}), ("fedrep", "mlp", {"head_epochs": 2}),
                                             ("fedper", "mlp_bn", {"personal": 2}), ("fedbn", "mlp_bn", {}),
                                             ("lg_fedavg", "mlp", {})])
def test_private_coordinates_never_leave_the_client(method, model, hp, digits, tmp_path):
    """The head (FedPer, FedRep), the BN layers (FedBN) or the lower layers (LG-FedAvg): in no payload, not
    in the server state, not in the bytes; a client that is not sampled keeps them bit-identical, a sampled
    one trains them; each client predicts with its own private coordinates under the server's shared ones."""
    fed = unequal_federation(digits)
    algo, eng = setup(fed, method, model, **hp)
    spec, priv = algo.ctx.spec, private_index(algo)
    if method == "fedbn":
        expect = sum(s.stop - s.start for s in spec.batchnorm)
    elif method == "lg_fedavg":               # everything below the shared head
        expect = spec.head.start
    elif hp.get("personal") == 2:             # mlp_bn's last two layers, BN not counted: fc2, its BN, head
        expect = spec.size - spec.layers[2][1].start
    else:
        expect = spec.head.stop - spec.head.start
    assert len(priv) == expect > 0
    n_shared = spec.size - len(priv)
    assert {k: v.shape for k, v in algo.upload().items()} == {"shared": (n_shared,)}
    moved = []

    def check(t, plan, update, before, sim):
        evaluation = sim.algo.eval_payload(sim.state, np.arange(fed.num_clients))
        for rows in (plan.payload, update.payload, evaluation):
            assert all(v.shape[1:] == (n_shared,) for v in rows.values())
        assert all(v.numel() == n_shared for v in sim.state.values())
        local = sim.clients.data["local"]
        out = np.setdiff1d(np.arange(fed.num_clients), plan.clients)
        assert len(out) and torch.equal(local[out][:, priv], before["local"][out][:, priv])
        trained = local[plan.clients][:, priv] != before["local"][plan.clients][:, priv]
        moved.append(bool(trained.any(1).all()))
        # what a client predicts with: the server's shared coordinates and its own private ones
        model = sim.inference().single
        assert torch.equal(model[:, priv], local[:, priv])
        assert torch.equal(model[:, algo.shared], sim.state["shared"].expand(fed.num_clients, -1))

    drive(algo, eng, on_round=check)
    assert all(moved)
    # through the runner: bytes up and down are the shared coordinates only
    c = resolve(dict(dataset="digits", clients=6, rounds=2, fraction=0.5, local_epochs=1, batch_size=16,
                     lr=0.05, model=model, engine="sequential", device="cpu", seed=1, method=method,
                     **{f"{method}.{k}": v for k, v in hp.items()}))
    res = Experiment(c, Store(tmp_path / "b.db")).run()
    for h in res.history:
        assert h["bytes_up"] == 4 * n_shared * h["accepted"]
        assert h["bytes_down"] == 4 * n_shared * h["clients"]


def test_personal_layers_parameter(digits):
    fed = unequal_federation(digits)
    spec = setup(fed, "fedper", "mlp_bn")[0].ctx.spec
    head = setup(fed, "fedper", "mlp_bn")[0]
    one = setup(fed, "fedper", "mlp_bn", personal=1)[0]
    assert torch.equal(private_index(head), torch.arange(spec.head.start, spec.size))
    assert torch.equal(private_index(one), private_index(head))
    three = setup(fed, "fedper", "mlp_bn", personal=3)[0]        # fc1, BN, fc2, BN, head: all but nothing
    assert len(private_index(three)) == spec.size and len(three.shared) == 0
    with pytest.raises(ConfigError, match="fedper.personal"):
        setup(fed, "fedper", "mlp_bn", personal=4)
    with pytest.raises(ConfigError, match="fedper.personal"):
        setup(fed, "fedper", "mlp", personal="tail")
    with pytest.raises(ConfigError, match="fedrep"):
        setup(fed, "fedrep", "mlp", head_epochs=0, body_epochs=0)


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


def test_fedrep_trains_the_head_then_the_body_each_with_the_other_frozen(digits):
    fed = unequal_federation(digits)
    algo, eng = setup(fed, "fedrep", head_epochs=2, body_epochs=1)
    spec, rec = algo.ctx.spec, Recorder(eng)
    head, body = spec.head, spec.body

    def check(t, plan, update, before, sim):
        (hj, ho), (bj, bo) = rec.jobs[-2:]
        assert (hj.stream, hj.epochs, bj.stream, bj.epochs) == ("fedrep_head", 2, "fedrep_body", 1)
        # the head phase starts from the received body and the client's own head
        assert torch.equal(hj.start[:, body], plan.payload["shared"])
        assert torch.equal(hj.start[:, head], before["local"][plan.clients][:, head])
        assert torch.equal(ho.params[:, body], hj.start[:, body])                     # body frozen
        assert (ho.params[:, head] != hj.start[:, head]).any(1).all()                   # head trained
        assert torch.equal(bj.start, ho.params)
        assert torch.equal(bo.params[:, head], bj.start[:, head])                     # head frozen
        assert (bo.params[:, body] != bj.start[:, body]).any(1).all()                   # body trained
        assert torch.equal(update.payload["shared"], bo.params[:, body])
        assert torch.equal(sim.clients.data["local"][plan.clients], bo.params)
        rec.jobs.clear()

    sim = Simulator(algo, rec)
    for t in range(2):
        before = {k: v.clone() for k, v in sim.clients.data.items()}
        plan, update, _ = sim.round(t, sample_clients(0, t, fed.num_clients, 0.5))
        check(t, plan, update, before, sim)


# -- FedBN on BatchNorm models: both engines ---------------------------------------------------------
def image_federation(sizes=(5, 17, 33, 9), n_test=(6, 1, 9, 4), classes=10, seed=0) -> Federation:
    """Small 1x32x32 federation; with batch size 8, clients of 17, 33 and 9 samples end on a batch of one."""
    g = torch.Generator().manual_seed(seed)
    n, nt = sum(sizes), 60
    y, yt = torch.randint(0, classes, (n,), generator=g), torch.randint(0, classes, (nt,), generator=g)
    mu = torch.randn(classes, 1, 32, 32, generator=g)
    x, xt = mu[y] + torch.randn(n, 1, 32, 32, generator=g), mu[yt] + torch.randn(nt, 1, 32, 32, generator=g)
    cuts = np.cumsum((0,) + tuple(sizes))
    rng = np.random.default_rng(seed)
    return Federation(x, y, xt, yt, [np.arange(a, b) for a, b in zip(cuts[:-1], cuts[1:])],
                      [rng.choice(nt, size=k, replace=False) for k in n_test], classes)


@pytest.mark.parametrize("model", ["mlp_bn", "lenet5_bn"])
def test_fedbn_engines_agree_on_batchnorm_models(model, digits):
    """Batch size 8: clients of 17, 33 and 9 samples end on a batch of one (exactly beta in both engines).
    No client ends on a batch of two or three: BatchNorm1d divides by the spread of so few samples, which
    turns rounding differences between the engines into visible ones (1e-4 after two rounds)."""
    fed = (image_federation() if model == "lenet5_bn"
           else unequal_federation(digits, sizes=(5, 17, 33, 9, 44, 30)))
    cfg = LocalConfig(epochs=1, batch_size=8, lr=0.05, momentum=0.9, weight_decay=1e-4, eval_chunk=50)
    sims = [drive(*setup(fed, "fedbn", model, engine=e, cfg=cfg), rounds=2, fraction=1.0)
            for e in (SequentialEngine, VectorizedEngine)]
    a, b = (s.inference().single for s in sims)
    torch.testing.assert_close(a, b, atol=1e-4 * max(1.0, float(a.abs().max())), rtol=1e-4)
    priv = private_index(sims[0].algo)
    assert not torch.equal(a[:, priv], sims[0].algo.ctx.init[priv].expand_as(a[:, priv]))
    for split in ("local", "global"):
        ra, rb = sims[0].evaluate(split), sims[1].evaluate(split)
        assert torch.equal(ra.correct, rb.correct), split


def test_fedbn_on_a_model_without_batchnorm_warns_that_it_is_fedavg(tmp_path):
    import warnings

    base = dict(dataset="digits", clients=6, rounds=1, local_epochs=1, engine="sequential", method="fedbn")
    with pytest.warns(UserWarning, match=r"fedbn keeps no parameter of model mlp on the clients"):
        Experiment(resolve(base), Store(tmp_path / "a.db"))
    for ok in ({**base, "model": "mlp_bn"}, {**base, "method": "fedper"}):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            Experiment(resolve(ok), Store(tmp_path / "b.db"))
    import subprocess
    import sys

    args = [f"{k}={v}" for k, v in base.items()]                     # on the CLI: one line, like an error
    cmd = [sys.executable, "-m", "fedprism", "run", "--db", str(tmp_path / "c.db"), "--quiet", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stderr.startswith("fedprism: warning: fedbn keeps no parameter"), p.stderr
    assert len(p.stderr.splitlines()) == 1


def test_fedrep_reports_the_epoch_weighted_mean_loss_of_its_two_phases(digits):
    from fedprism.protocol import Trained

    algo, _ = setup(unequal_federation(digits), "fedrep", head_epochs=1, body_epochs=3)

    class Phases:                                   # a trainer whose head phase has loss 1, body phase 4
        def train(self, job, rnd):
            n = len(job.clients)
            loss = 1.0 if job.stream == "fedrep_head" else 4.0
            return Trained(job.clients, job.start, torch.ones(n, dtype=torch.float64),
                           torch.full((n,), loss, dtype=torch.float64))

    t = algo.local_training(np.arange(2), torch.zeros(2, algo.ctx.spec.size), Phases(), 0)
    assert t.loss.tolist() == [(1 * 1.0 + 3 * 4.0) / 4] * 2
