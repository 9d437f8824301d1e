"""BatchNorm with running statistics (`fedprism.models.RunningBatchNorm2d`, the flat vector's buffer section,
`fedprism.params`): the layout, PyTorch's training and evaluation modes in both engines, FedAvg averaging
the statistics and FedBN keeping them on the client (checked by hand), exact resume, counted bytes, Flower
equal to the in-process run, and every new model (ResNet-18/20/8 with BatchNorm or GroupNorm, the small
MobileNet) built, run and trained for a round."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_engine_equivalence import make_fed

from fedprism.algorithms import REGISTRY
from fedprism.algorithms.base import Context
from fedprism.engine import LocalConfig, SequentialEngine
from fedprism.engine.base import batch_order
from fedprism.engine.vectorized import VectorizedEngine
from fedprism.experiment.config import resolve
from fedprism.experiment.runner import Experiment, Simulator
from fedprism.experiment.store import Store
from fedprism.models import MODELS, RunningBatchNorm2d, build_model
from fedprism.params import ParamSpec, flatten, load_flat
from fedprism.protocol import TrainJob
from fedprism.seeds import stream_seed

NEW = ("resnet18", "resnet18_gn", "resnet20", "resnet20_gn", "resnet8", "resnet8_gn", "mobilenet_small")
CFG = LocalConfig(epochs=2, batch_size=4, lr=0.05, momentum=0.9, weight_decay=1e-3, eval_chunk=50)
SHAPE = (3, 8, 8)


def buffer_index(spec: ParamSpec) -> torch.Tensor:
    return torch.cat([torch.arange(s.start, s.stop) for s in spec.buffers])


def small(sizes=(13, 6, 9), n_test=(5, 4, 7)):
    return make_fed(SHAPE, sizes=sizes, n_test=n_test)


# -- layout ------------------------------------------------------------------------------------------------
def test_running_statistics_follow_their_layer_and_no_optimiser_steps_them():
    m = build_model("resnet8", SHAPE, 10)
    spec = ParamSpec.of(m)
    i = spec.names.index("body.1.weight")           # the stem's BatchNorm: weight, bias, running mean, variance
    assert spec.names[i:i + 4] == ("body.1.weight", "body.1.bias", "body.1.running_mean", "body.1.running_var")
    assert len(spec.buffer_names) == 2 * sum(isinstance(x, RunningBatchNorm2d) for x in m.modules())
    assert spec.size == spec.parameters + sum(b.numel() for n, b in m.named_buffers() if "running" in n)
    assert spec.parameters == sum(p.numel() for p in m.parameters())
    t = spec.trainable
    assert float(t.sum()) == spec.parameters and torch.equal(t[buffer_index(spec)], torch.zeros(len(buffer_index(spec))))
    # FedBN's slices hold each layer's running statistics with its affine parameters; the head holds none
    bn = torch.cat([torch.arange(s.start, s.stop) for s in spec.batchnorm])
    assert set(buffer_index(spec).tolist()) <= set(bn.tolist())
    assert set(spec.buffer_names) <= set(spec.bn_names)
    assert spec.head.start > max(bn.tolist())
    # the vector round-trips through the module, running statistics included
    v = flatten(m)
    assert torch.equal(v[spec.slice_of("body.1.running_var")], torch.ones(16))
    w = v + torch.arange(v.numel(), dtype=torch.float32) * 1e-6
    assert torch.equal(flatten(load_flat(m, w)), w)


@pytest.mark.parametrize("name", ["lenet5_bn", "cnn", "mlp_bn", "clustpsi_cifar_cnn", "resnet8_gn", "resnet18_gn"])
def test_batch_statistics_and_groupnorm_models_have_no_buffer_section(name):
    shape = (64,) if name == "mlp_bn" else (3, 32, 32)
    m = build_model(name, shape, 10)
    spec = ParamSpec.of(m)
    assert spec.buffer_names == () and spec.trainable is None
    assert spec.size == spec.parameters == sum(p.numel() for p in m.parameters())


def test_a_torch_batchnorm_with_running_statistics_is_refused_naming_the_layer():
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    with pytest.raises(ValueError, match=r"layer '1'.*RunningBatchNorm2d.*track_running_stats=False"):
        ParamSpec.of(m)


# -- training and evaluation modes ---------------------------------------------------------------------------
@pytest.mark.parametrize("engine", ["sequential", "vectorized"])
def test_local_training_is_pytorchs_training_mode(engine):
    """One client, two epochs of SGD with momentum and weight decay, a last batch of one sample: the engine's
    parameters and running statistics are those of a plain PyTorch loop over the same batches (model.train(),
    torch.optim.SGD, torch's BatchNorm updating its buffers in place)."""
    fed = small()
    model = build_model("resnet8", SHAPE, 10, seed=0)
    eng = SequentialEngine(fed, model, CFG, 3, "cpu") if engine == "sequential" else \
        VectorizedEngine(fed, model, CFG, 3, "cpu", compile=False)
    start = flatten(model)
    got = eng.train(TrainJob(np.array([0]), start[None]), 0).params[0]
    ref = build_model("resnet8", SHAPE, 10, seed=0).train()          # a plain module: PyTorch's BatchNorm
    opt = torch.optim.SGD(ref.parameters(), lr=CFG.lr, momentum=CFG.momentum, weight_decay=CFG.weight_decay)
    idx = torch.as_tensor(fed.train_idx[0])
    batches = batch_order(len(idx), CFG.epochs, CFG.batch_size, stream_seed(3, 0, 0, "train"))
    assert len(batches[-1]) == 1
    for b in batches:
        opt.zero_grad()
        F.cross_entropy(ref(fed.x_train[idx[b]]), fed.y_train[idx[b]]).backward()
        opt.step()
    want = flatten(ref)
    spec = eng.spec
    bufs = buffer_index(spec)
    assert float((want[bufs] - start[bufs]).abs().max()) > 0.1            # the statistics moved
    torch.testing.assert_close(got[bufs], want[bufs], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_evaluation_normalises_with_the_running_statistics():
    fed = small()
    model = build_model("resnet8", SHAPE, 10, seed=0)
    eng = SequentialEngine(fed, model, CFG, 3, "cpu")
    p = eng.train(TrainJob(np.array([0]), flatten(model)[None]), 0).params[0]
    x = fed.x_test[:9]
    batch = eng.logits(p[None], x)[0]
    alone = torch.cat([eng.logits(p[None], x[i:i + 1])[0] for i in range(len(x))])
    torch.testing.assert_close(alone, batch, atol=1e-6, rtol=1e-6)       # a sample's logits: not its batch's
    ref = load_flat(build_model("resnet8", SHAPE, 10), p).eval()             # PyTorch's evaluation mode
    with torch.no_grad():
        torch.testing.assert_close(ref(x), batch, atol=1e-5, rtol=1e-5)
    spec = eng.spec
    q = p.clone()
    q[spec.slice_of("body.1.running_mean")] += 1.0
    assert not torch.allclose(eng.logits(q[None], x)[0], batch, atol=1e-3)
    a, b = eng.evaluate(p[None], np.array([0]), "global"), eng.evaluate(q[None], np.array([0]), "global")
    assert float(a.loss_sum[0]) != float(b.loss_sum[0])
    vec = VectorizedEngine(fed, model, CFG, 3, "cpu", compile=False)
    for split in ("global", "local"):
        e1, e2 = eng.evaluate(p[None], np.array([0]), split), vec.evaluate(p[None], np.array([0]), split)
        assert torch.equal(e1.correct, e2.correct) and torch.equal(e1.confusion, e2.confusion)
        torch.testing.assert_close(e1.loss_sum, e2.loss_sum, atol=1e-4, rtol=1e-5)


def test_both_engines_agree_and_a_mask_keeps_running_statistics():
    """Three clients of unequal size (partial batches), a per-client mask that freezes the stem's BatchNorm
    (parameters and statistics) of client 1: both engines give the same models, and the masked coordinates
    stay bit-identical in both."""
    fed = small()
    model = build_model("resnet8", SHAPE, 10, seed=0)
    spec = ParamSpec.of(model)
    seq = SequentialEngine(fed, model, CFG, 3, "cpu")
    vec = VectorizedEngine(fed, model, CFG, 3, "cpu", compile=False)
    start = flatten(model).expand(3, -1).clone()
    mask = torch.ones(3, spec.size)
    stem = spec.batchnorm[0]
    mask[1, stem] = 0.0
    clients = np.array([0, 1, 2])
    for job in (TrainJob(clients, start), TrainJob(clients, start, mask=mask)):
        a, b = seq.train(job, 1), vec.train(job, 1)
        torch.testing.assert_close(a.params, b.params, atol=5e-5, rtol=1e-4)
        torch.testing.assert_close(a.loss, b.loss, atol=1e-5, rtol=1e-5)
    for out in (a, b):
        assert torch.equal(out.params[1, stem], start[1, stem])
        assert not torch.equal(out.params[0, stem], start[0, stem])


# -- FedAvg averages the statistics, FedBN keeps them ----------------------------------------------------------
def _setup(fed, method, engine=SequentialEngine):
    m = build_model("resnet8", SHAPE, 10, seed=0)
    ctx = Context(fed.num_clients, fed.num_classes, ParamSpec.of(m), flatten(m), fed.n_train, fed.label_hist(),
                  0, 3, 1.0)
    eng = engine(fed, m, CFG, 0, "cpu") if engine is SequentialEngine else engine(fed, m, CFG, 0, "cpu",
                                                                                  compile=False)
    return REGISTRY[method](ctx), eng


def test_fedbn_is_fedavg_bit_for_bit_with_one_client():
    fed = small(sizes=(13,), n_test=(5,))
    runs = []
    for method in ("fedavg", "fedbn"):
        algo, eng = _setup(fed, method)
        sim = Simulator(algo, eng)
        for t in range(2):
            sim.round(t, np.array([0]))
        runs.append(sim)
    avg, bn = runs
    assert torch.equal(avg.inference().single, bn.inference().single)
    assert not torch.equal(avg.state["w"], avg.algo.ctx.init)
    ra, rb = avg.evaluate("local"), bn.evaluate("local")
    assert torch.equal(ra.correct, rb.correct) and torch.equal(ra.loss_sum, rb.loss_sum)


def test_fedavg_averages_running_statistics_and_fedbn_keeps_each_clients():
    """Two clients, one round, by hand: each client's trained vector t_k (the same engine, round and stream);
    FedAvg's model is (n_1 t_1 + n_2 t_2) / (n_1 + n_2) on every coordinate, running statistics included;
    FedBN's server holds no BatchNorm coordinate, and client k predicts with its own t_k's BatchNorm layers,
    running statistics included, and the average elsewhere."""
    fed = small(sizes=(13, 6), n_test=(5, 4))
    clients = np.array([0, 1])
    algo, eng = _setup(fed, "fedavg")
    spec = algo.ctx.spec
    trained = eng.train(TrainJob(clients, algo.ctx.init.expand(2, -1).clone()), 0).params
    bufs = buffer_index(spec)
    assert float((trained[0, bufs] - trained[1, bufs]).abs().max()) > 1e-3       # the clients' statistics differ
    n = torch.tensor([13.0, 6.0], dtype=torch.float64)
    mean = ((n[:, None] * trained.double()).sum(0) / n.sum()).float()
    sim = Simulator(algo, eng)
    sim.round(0, clients)
    torch.testing.assert_close(sim.state["w"], mean, atol=1e-7, rtol=0)

    algo, eng = _setup(fed, "fedbn")
    bn = torch.cat([torch.arange(s.start, s.stop) for s in spec.batchnorm])
    assert algo.upload()["shared"].shape == (spec.size - len(bn),)
    assert not set(bufs.tolist()) & set(algo.shared.tolist())                   # no statistic travels
    sim = Simulator(algo, eng)
    sim.round(0, clients)
    models = sim.inference().streams["model"]
    for k in range(2):
        assert torch.equal(models[k, bn], trained[k, bn])                       # its own BN layers, statistics too
        torch.testing.assert_close(models[k, algo.shared], mean[algo.shared], atol=1e-7, rtol=0)
    assert not torch.equal(models[0, bufs], models[1, bufs])


# -- runs: resume, bytes, Flower ---------------------------------------------------------------------------------
RUN = dict(dataset="digits", model="resnet8", clients=3, rounds=3, fraction=1.0, local_epochs=1, batch_size=32,
           lr=0.05, partition="dirichlet", **{"partition.alpha": 0.5, "data.test_subset": 60}, engine="sequential")


@pytest.mark.parametrize("method", ["fedbn", "fedavg"])
def test_an_interrupted_run_resumes_exactly(tmp_path, method):
    c = resolve({**RUN, "method": method})
    full = Experiment(c, Store(tmp_path / "a.db"))
    done = full.run()
    s = Store(tmp_path / "b.db")
    assert Experiment(c, s).run(stop_after=2).status == "interrupted"
    again = Experiment(c, s)
    resumed = again.run()
    assert resumed.resumed_from == 1
    timing = lambda d: {k: v for k, v in d.items() if k != "seconds" and not k.endswith("_s")}  # noqa: E731
    assert timing(resumed.final) == timing(done.final)
    assert [h["local_acc"] for h in s.round_metrics(c.run_id)] == \
        [h["local_acc"] for h in full.store.round_metrics(c.run_id)]
    for k, v in full.state.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, again.state[k]), k


def test_bytes_count_the_running_statistics(tmp_path):
    c = resolve({**RUN, "method": "fedavg", "rounds": 1})
    e = Experiment(c, Store(tmp_path / "a.db"))
    e.run()
    spec = e.algo.ctx.spec
    assert spec.size > spec.parameters
    (h,) = e.store.round_metrics(c.run_id)
    assert h["bytes_down"] == h["bytes_up"] == 3 * spec.size * 4


def test_flower_equals_in_process_with_running_statistics(tmp_path):
    """FedBN on ResNet-8 over Flower (the in-process grid of tests/test_flower.py): every node trains and keeps
    its running statistics as the simulator does; final state and every round's metrics are equal."""
    flower = pytest.importorskip("test_flower")
    exp = ("method=fedbn dataset=digits model=resnet8 clients=3 rounds=2 fraction=1.0 local_epochs=1 lr=0.05 "
           "batch_size=32 device=cpu engine=sequential partition.alpha=0.5 data.test_subset=60 seed=2")
    from flwr.supercore.task_identity import TaskIdentity

    old = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0
    try:
        ref, _ = flower.in_process(exp, tmp_path / "ref.db")
        rc = flower.run_config(exp, tmp_path / "fl.db", save_final=str(tmp_path / "final.pt"))
        res = flower.serve(flower.FakeGrid(flower.nodes_for(3), rc), rc)
    finally:
        TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = old
    assert res.status == "finished"
    got = torch.load(tmp_path / "final.pt", weights_only=False)["state"]
    flower.assert_same_state({k: v for k, v in ref.state.items() if k not in ref.algo.client_state}, got, atol=0)
    a, b = ref.store.round_metrics(ref.run_id), Store(tmp_path / "fl.db").round_metrics(res.run_id)
    for x, y in zip(a, b, strict=True):
        for k in ("local_acc", "global_acc", "train_loss", "bytes_up", "bytes_down"):
            assert y[k] == x[k], (x["round"], k)


# -- the new models ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NEW)
def test_each_new_model_builds_runs_and_trains_a_round(name):
    spec = MODELS.get(name, "model")
    assert spec.why_not((3, 32, 32)) is None and spec.why_not((3, 2, 2)) and spec.why_not((64,))
    m = build_model(name, (3, 32, 32), 10, seed=0)
    assert m(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    assert m(torch.zeros(2, 3, 32, 32), features_only=True).shape[0] == 2
    ps = ParamSpec.of(m)
    assert ps.head.stop == ps.size and ps.body.stop == ps.head.start
    assert bool(ps.buffer_names) == (not name.endswith("_gn"))
    fed = small(sizes=(5, 6), n_test=(3, 2))
    algo, eng = (lambda mm: (REGISTRY["fedavg"](Context(fed.num_clients, 10, ParamSpec.of(mm), flatten(mm),
                                                        fed.n_train, fed.label_hist(), 0, 1, 1.0)),
                             SequentialEngine(fed, mm, LocalConfig(epochs=1, batch_size=4, lr=0.01), 0, "cpu")))(
        build_model(name, SHAPE, 10, seed=0))
    sim = Simulator(algo, eng)
    sim.round(0, np.array([0, 1]))
    w = sim.state["w"]
    assert torch.isfinite(w).all() and not torch.equal(w, algo.ctx.init)
    r = sim.evaluate("local")
    assert int(r.count.sum()) == 5


def test_state_dicts_load_with_or_without_num_batches_tracked():
    """The layer keeps no `num_batches_tracked`; a state dict of its own and one of torch's BatchNorm (which
    has the key) both load strictly."""
    a, b = build_model("resnet8", SHAPE, 10, seed=0), build_model("resnet8", SHAPE, 10, seed=1)
    sd = a.state_dict()
    assert not any("num_batches_tracked" in k for k in sd)
    b.load_state_dict(sd)
    assert torch.equal(flatten(a), flatten(b))
    torch_bn = torch.nn.BatchNorm2d(16).state_dict()
    assert "num_batches_tracked" in torch_bn
    b.body[1].load_state_dict(torch_bn)
    assert torch.equal(b.body[1].running_var, torch.ones(16))


def test_a_registered_model_with_torchs_running_batchnorm_is_refused_naming_the_fix():
    import fedprism
    from fedprism.errors import ConfigError
    from fedprism.experiment.build import make_model

    def build(shape, k):
        return torch.nn.Sequential(torch.nn.Conv2d(shape[0], 4, 3, padding=1), torch.nn.BatchNorm2d(4),
                                   torch.nn.Flatten(), torch.nn.Linear(4 * shape[1] * shape[2], k))

    fedprism.register_model("torch_bn_test", build)
    try:
        with pytest.raises(ConfigError, match=r"'model' = 'torch_bn_test'.*layer '1'.*RunningBatchNorm2d"):
            make_model(resolve({"dataset": "digits", "model": "torch_bn_test"}), (1, 8, 8), 10)
    finally:
        MODELS.pop("torch_bn_test")


def test_a_gradient_through_an_evaluation_mode_forward_leaves_the_statistics_alone():
    """Outside a training step (e.g. a method differentiating its model at evaluation) the running statistics
    are constants: the gradient flows to the parameters and is 0 on the buffer section."""
    from fedprism.params import Functional

    m = build_model("resnet8", SHAPE, 10, seed=0)
    f = Functional(m)
    w = flatten(m).requires_grad_(True)
    x = torch.randn(3, *SHAPE)
    (g,) = torch.autograd.grad(f(w, x).square().sum(), w)
    assert torch.equal(g[buffer_index(f.spec)], torch.zeros(len(buffer_index(f.spec))))
    assert float(g.abs().sum()) > 0


def test_the_cuda_graph_bookkeeping_keeps_the_running_statistics(monkeypatch):
    """The vectorized engine's recorded-step path (its own parameter, state, extras and mask tensors; partial
    batches written into them) on the CPU, the recording left out (`GraphedStep.replay` runs the step
    directly): the same bits as the plain path, running statistics included, job after job."""
    from fedprism.engine.cuda_graph import GraphedStep

    monkeypatch.setattr(GraphedStep, "record", lambda self: self)
    fed = small()
    model = build_model("resnet8", SHAPE, 10, seed=0)
    plain = VectorizedEngine(fed, model, CFG, 3, "cpu", compile=False)
    graphed = VectorizedEngine(fed, model, CFG, 3, "cpu", compile=False)
    graphed.cuda_graphs = True
    clients = np.array([2, 0, 1])
    s = flatten(model).expand(3, -1).clone()
    mask = torch.ones(3, s.shape[1])
    mask[0, ParamSpec.of(model).batchnorm[0]] = 0.0
    for rnd, job in enumerate([TrainJob(clients, s), TrainJob(clients, s, mask=mask, epochs=1), TrainJob(clients, s)]):
        a, b = plain.train(job, rnd), graphed.train(job, rnd)
        assert torch.equal(a.params, b.params) and torch.equal(a.loss, b.loss), rnd
    assert graphed._graphs


@pytest.mark.parametrize("method", ["fedavg", "fedper"])
def test_a_server_optimiser_steps_the_parameters_and_averages_the_running_statistics(method):
    """FedAdam (`server_opt=adam`) on ResNet-8, two clients, one round: the parameters take Adam's server
    step (not the average), the running statistics the plain average of the clients' (n_k-weighted), for a
    method that averages the whole vector (FedAvg) and one that averages the body (FedPer, one personal layer)."""
    fed = small(sizes=(13, 6), n_test=(5, 4))
    clients = np.array([0, 1])
    m = build_model("resnet8", SHAPE, 10, seed=0)
    spec = ParamSpec.of(m)
    ctx = Context(fed.num_clients, fed.num_classes, spec, flatten(m), fed.n_train, fed.label_hist(), 0, 3, 1.0)
    hp = {"server_opt": "adam", **({"personal": 1} if method == "fedper" else {})}
    algo, eng = REGISTRY[method](ctx, **hp), SequentialEngine(fed, m, CFG, 0, "cpu")
    trained = eng.train(TrainJob(clients, ctx.init.expand(2, -1).clone()), 0).params
    n = torch.tensor([13.0, 6.0], dtype=torch.float64)
    mean = ((n[:, None] * trained.double()).sum(0) / n.sum()).float()
    sim = Simulator(algo, eng)
    sim.round(0, clients)
    model = sim.inference().streams["model"][0] if method == "fedper" else sim.state["w"]
    bufs = buffer_index(spec)
    torch.testing.assert_close(model[bufs], mean[bufs], atol=1e-6, rtol=0)
    weights = torch.nonzero(spec.trainable[: spec.body.stop]).flatten()
    assert float((model[weights] - mean[weights]).abs().max()) > 1e-3       # Adam's step, not the average
