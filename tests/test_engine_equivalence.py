"""The vectorized engine gives the sequential engine's numbers (two engines, one answer).

Small federations with unequal client sizes (partial last batches, LPT slot reloads), momentum and
weight decay; the `prox` objective with per-client extras; a train mask; evaluation on local, train
and global splits; FedAvg and Local end to end. compile=False throughout (compiling is too slow here).
"""

from __future__ import annotations

import copy
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from fedprism.algorithms.base import Context, TrainJob
from fedprism.algorithms.fedavg import FedAvg
from fedprism.algorithms.local import Local
from fedprism.engine.base import LocalConfig
from fedprism.engine.sequential import SequentialEngine
from fedprism.engine.vectorized import (
    AUTO_COMPILE_FLOPS,
    VectorizedEngine,
    estimate_run_flops,
    ideal_slots,
    lpt_slots,
    parse_compile,
    profile_model,
)
from fedprism.experiment.runner import Simulator
from fedprism.federation import Federation
from fedprism.models import _Split, build_model
from fedprism.models.dropout import SeededDropout
from fedprism.params import flatten

SIZES = (7, 20, 33, 50, 64, 90)
CFG = LocalConfig(epochs=2, batch_size=8, lr=0.05, momentum=0.9, weight_decay=1e-4)


def make_fed(shape: tuple[int, ...], sizes=SIZES, n_test=(5, 11, 0, 17, 9, 30), classes=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    ntr, nte = sum(sizes), 120
    y_tr = torch.randint(0, classes, (ntr,), generator=g)
    y_te = torch.randint(0, classes, (nte,), generator=g)
    # class-dependent means so that models actually learn something
    mu = torch.randn(classes, *shape, generator=g)
    x_tr = mu[y_tr] + torch.randn(ntr, *shape, generator=g)
    x_te = mu[y_te] + torch.randn(nte, *shape, generator=g)
    perm = torch.randperm(ntr, generator=g).numpy()
    cuts = np.cumsum((0,) + tuple(sizes))
    train_idx = [perm[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
    rng = np.random.default_rng(seed)
    test_idx = [rng.choice(nte, size=k, replace=False) for k in n_test[: len(sizes)]]
    return Federation(x_tr, y_tr, x_te, y_te, train_idx, test_idx, classes)


def engines(fed, model, cfg=CFG, seed=3):
    return (SequentialEngine(fed, model, cfg, seed, "cpu"),
            VectorizedEngine(fed, model, cfg, seed, "cpu", compile=False))


def starts(model, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    w0 = flatten(model)
    return w0 + 0.05 * torch.randn(n, w0.numel(), generator=g)


def assert_close(a, b):
    scale = max(1.0, float(a.abs().max()))
    torch.testing.assert_close(a, b, atol=1e-4 * scale, rtol=1e-4)


@pytest.fixture(scope="module")
def mlp_setup():
    fed = make_fed((64,))
    return fed, build_model("mlp", (64,), 10, seed=0)


class DropoutMLP(_Split):
    """An MLP with seeded dropout in the body and in front of the head (no BatchNorm: padded batches)."""

    def __init__(self, features: int = 64, classes: int = 10):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(features, 32), torch.nn.ReLU(),
                                        SeededDropout(0.3), torch.nn.Linear(32, 32), torch.nn.ReLU())
        self.head = torch.nn.Sequential(SeededDropout(0.5), torch.nn.Linear(32, classes))


@pytest.fixture(scope="module")
def dropout_setup():
    fed = make_fed((64,))
    torch.manual_seed(0)
    return fed, DropoutMLP()


@pytest.fixture(scope="module")
def lenet_setup():
    fed = make_fed((1, 32, 32), sizes=(5, 12, 21, 30, 41, 9), n_test=(4, 7, 13, 0, 21, 3))
    return fed, build_model("lenet5", (1, 32, 32), 10, seed=0)


def test_lpt_slots_balance_and_cover():
    steps = [12, 3, 9, 30, 7, 7, 1, 20]
    w = ideal_slots(steps)
    assert w == sum(steps) // max(steps) == 2
    q = lpt_slots(steps, w)
    assert sorted(j for s in q for j in s) == list(range(len(steps)))
    loads = [sum(steps[j] for j in s) for s in q]
    assert max(loads) - min(loads) <= max(steps)
    assert q[0][0] == 3                       # the longest job starts first
    assert ideal_slots([5]) == 1 and ideal_slots([4, 4, 4]) == 3 and ideal_slots([]) == 1


def test_slots_above_the_cap_are_the_fewest_with_the_cap_s_steps(mlp_setup):
    """At most max_slots, the LPT ideal; above it, the fewest slots whose LPT makespan is the cap's, not the
    cap: 20 equal clients in 16 slots run two waves of 16, in 10 two waves of 10."""
    fed, model = mlp_setup
    eng = VectorizedEngine(fed, model, CFG, 3, "cpu", compile=False)
    assert eng.max_slots == 16
    assert eng.slots_for([19] * 20) == 10 and eng.slots_for([10] * 17) == 9 and eng.slots_for([10] * 33) == 11
    assert eng.slots_for([10] * 16) == 16 and eng.slots_for([3, 2, 1]) == 2      # the ideal, at most the cap
    assert eng.slots_for([4, 1, 3, 5, 4]) == 3       # the ideal below the cap, though 4 slots would cost less
    # 100 clients of one step: 7 steps in 16 slots and in 15. Ten slots would do less work in all (10 steps
    # x 10 slots against 7 x 15) but take more steps, each with its fixed cost
    assert eng.slots_for([1] * 100) == 15
    small = VectorizedEngine(fed, model, CFG, 3, "cpu", compile=False, max_slots=4)
    assert small.slots_for([5] * 6) == 3             # 10 steps in 4 slots and in 3, 15 in 2
    assert small.slots_for([5] * 8) == 4             # 10 steps in 4 slots, 15 in 3
    assert small.slots_for([4, 4, 4, 4, 4, 3, 1]) == 3   # 8 steps in 4 slots and in 3 (4 4 | 4 4 | 4 3 1)
    one = VectorizedEngine(fed, model, CFG, 3, "cpu", compile=False, max_slots=1)
    assert one.slots_for([5, 5, 5]) == 1


def test_parse_compile():
    assert parse_compile(True) == "true" and parse_compile("False") == "false"
    assert parse_compile("auto") == "auto"
    with pytest.raises(ValueError, match="compile"):
        parse_compile("sometimes")


@pytest.mark.parametrize("setup", ["mlp_setup", "lenet_setup", "dropout_setup"])
def test_train_matches_sequential(setup, request):
    fed, model = request.getfixturevalue(setup)
    seq, vec = engines(fed, model)
    clients = np.array([4, 0, 2, 5, 1, 3])
    plan = TrainJob(clients, starts(model, len(clients)))
    a, b = seq.train(plan, rnd=2), vec.train(plan, rnd=2)
    assert np.array_equal(a.clients, b.clients)
    assert_close(a.params, b.params)
    assert not torch.allclose(a.params, plan.start)              # training moved the models
    torch.testing.assert_close(a.loss, b.loss, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(a.n_samples, b.n_samples)
    assert seq.samples_trained == vec.samples_trained == 2 * sum(len(fed.train_idx[c]) for c in clients)


def test_train_subset_cohort_and_epoch_override(mlp_setup):
    fed, model = mlp_setup
    seq, vec = engines(fed, model)
    clients = np.array([5, 3])
    plan = TrainJob(clients, starts(model, 2, seed=7), epochs=3)
    a, b = seq.train(plan, rnd=0), vec.train(plan, rnd=0)
    assert_close(a.params, b.params)
    # a single client (the runner retries failed clients one by one)
    one = plan.subset(np.array([1]))
    assert_close(seq.train(one, 0).params, vec.train(one, 0).params)
    assert_close(vec.train(one, 0).params[0], b.params[1])      # independent of the cohort
    # no local steps: the start comes back unchanged
    zero = TrainJob(clients, plan.start, epochs=0)
    assert torch.equal(vec.train(zero, 0).params, plan.start)
    assert torch.equal(seq.train(zero, 0).params, plan.start)


def test_prox_objective_with_extras(mlp_setup):
    fed, model = mlp_setup
    seq, vec = engines(fed, model)
    clients = np.array([0, 1, 2, 3, 4, 5])
    s = starts(model, 6, seed=2)
    extras = {"anchor": starts(model, 6, seed=9), "mu": torch.tensor([0.0, 0.1, 0.5, 1.0, 2.0, 0.3])}
    plan = TrainJob(clients, s, loss="prox", extras=extras)
    a, b = seq.train(plan, rnd=1), vec.train(plan, rnd=1)
    assert_close(a.params, b.params)
    torch.testing.assert_close(a.loss, b.loss, atol=1e-4, rtol=1e-4)
    # the proximal term matters: the same plan with ce gives different parameters
    c = vec.train(TrainJob(clients, s), rnd=1)
    assert (c.params[4] - b.params[4]).abs().max() > 1e-3


def test_train_mask(lenet_setup):
    fed, model = lenet_setup
    seq, vec = engines(fed, model)
    spec = vec.spec
    mask = torch.zeros(spec.size)
    mask[spec.head] = 1.0
    clients = np.array([1, 3, 4])
    plan = TrainJob(clients, starts(model, 3, seed=4), mask=mask)
    a, b = seq.train(plan, rnd=5), vec.train(plan, rnd=5)
    assert_close(a.params, b.params)
    torch.testing.assert_close(b.params[:, spec.body], plan.start[:, spec.body])   # body frozen
    assert (b.params[:, spec.head] - plan.start[:, spec.head]).abs().max() > 1e-4


def test_slot_cap_and_order_do_not_change_results(mlp_setup):
    fed, model = mlp_setup
    clients = np.array([0, 1, 2, 3, 4, 5])
    plan = TrainJob(clients, starts(model, 6, seed=5))
    ref = VectorizedEngine(fed, model, CFG, 3, "cpu", compile=False).train(plan, 4).params
    for cap in (1, 2, 5):
        got = VectorizedEngine(fed, model, CFG, 3, "cpu", compile=False, max_slots=cap).train(plan, 4).params
        assert_close(ref, got)


def test_schedule_built_in_chunks_gives_the_same_bits(mlp_setup):
    """The vectorized schedule is drawn lazily, a chunk of steps at a time: one step per chunk, a few
    steps per chunk and the whole round at once give identical models and losses (plain and BatchNorm
    models, whose partial batches run outside the vmap)."""
    bn_fed = make_fed((3, 32, 32), sizes=(5, 19, 10), n_test=(6, 0, 9))
    cases = [(mlp_setup[0], mlp_setup[1], np.array([0, 1, 2, 3, 4, 5])),
             (bn_fed, build_model("cnn", (3, 32, 32), 10, seed=0), np.array([0, 1, 2]))]
    for fed, model, clients in cases:
        plan = TrainJob(clients, starts(model, len(clients), seed=5))
        runs = []
        for entries in (1 << 30, 1, 3 * 8 * 2):
            eng = VectorizedEngine(fed, model, CFG, 3, "cpu", compile=False)
            eng.schedule_entries = entries
            runs.append(eng.train(plan, 4))
        for r in runs[1:]:
            assert torch.equal(r.params, runs[0].params) and torch.equal(r.loss, runs[0].loss)
        assert eng.samples_trained == CFG.epochs * int(fed.n_train[clients].sum())


def test_batch_orders_are_lazy_and_match_the_eager_list():
    from fedprism.engine.base import batch_order, iter_batches, n_batches
    for n, e, b in [(0, 3, 4), (1, 2, 4), (33, 3, 8), (64, 2, 8)]:
        eager = batch_order(n, e, b, seed=11)
        assert len(eager) == n_batches(n, e, b)
        assert all(torch.equal(x, y) for x, y in zip(eager, iter_batches(n, e, b, seed=11)))
    # a billion epochs cost nothing until they are drawn
    it = iter_batches(10, 10**9, 4, seed=0)
    assert [len(next(it)) for _ in range(4)] == [4, 4, 2, 4]
    assert n_batches(10, 10**9, 4) == 3 * 10**9


@pytest.mark.parametrize("setup", ["mlp_setup", "lenet_setup", "dropout_setup"])
def test_evaluate_matches_sequential(setup, request):
    fed, model = request.getfixturevalue(setup)
    seq, vec = engines(fed, model)
    # distinct, partly trained models so predictions differ between rows
    clients = np.array([0, 1, 2, 3, 4, 5])
    params = seq.train(TrainJob(clients, starts(model, 6, seed=6)), rnd=0).params
    for split in ("local", "global", "train"):
        a, b = seq.evaluate(params, clients, split), vec.evaluate(params, clients, split)
        assert torch.equal(a.count, b.count), split
        assert torch.equal(a.correct, b.correct), split
        assert torch.equal(a.confusion, b.confusion), split
        torch.testing.assert_close(a.loss_sum, b.loss_sum, rtol=1e-4, atol=1e-3)
        assert b.confusion.sum((1, 2)).tolist() == b.count.tolist()
    # a permuted / repeated client list, and small chunks that force padding of the last chunk
    small = VectorizedEngine(fed, model, CFG, 3, "cpu", compile=False, eval_models=4, eval_samples=7)
    small.own_samples, small.own_rows = 5, 3
    cl = np.array([5, 5, 2, 0, 1])
    p = params[torch.tensor([0, 3, 2, 1, 4])]
    for split in ("local", "global"):
        a, b = seq.evaluate(p, cl, split), small.evaluate(p, cl, split)
        assert torch.equal(a.correct, b.correct) and torch.equal(a.confusion, b.confusion), split
        torch.testing.assert_close(a.loss_sum, b.loss_sum, rtol=1e-4, atol=1e-3)
    assert small.evaluate(p[:0], cl[:0], "global").count.numel() == 0


def test_logits_match(mlp_setup):
    fed, model = mlp_setup
    seq, vec = engines(fed, model)
    p = starts(model, 3)
    torch.testing.assert_close(seq.logits(p, fed.x_test[:10]), vec.logits(p, fed.x_test[:10]),
                               atol=1e-5, rtol=1e-4)


def test_batchnorm_model_matches():
    fed = make_fed((3, 32, 32), sizes=(5, 19, 10), n_test=(6, 0, 9))
    model = build_model("cnn", (3, 32, 32), 10, seed=0)
    cfg = LocalConfig(epochs=1, batch_size=8, lr=0.05, momentum=0.9, weight_decay=1e-4, eval_chunk=50)
    seq, vec = engines(fed, model, cfg)
    clients = np.array([0, 1, 2])
    plan = TrainJob(clients, starts(model, 3, seed=8))
    a, b = seq.train(plan, 0), vec.train(plan, 0)
    assert_close(a.params, b.params)
    for split in ("local", "global"):
        ea, eb = seq.evaluate(a.params, clients, split), vec.evaluate(a.params, clients, split)
        assert torch.equal(ea.correct, eb.correct) and torch.equal(ea.confusion, eb.confusion)


def test_dropout_models_match():
    """Seeded dropout (`fedprism.models.dropout`): both engines train with the same masks, also for the
    masked objectives (prox with extras, per-client masks) and the unpadded partial batches of BatchNorm
    models (the Clust-PSI-PFL CIFAR-10 CNN on 8x8 inputs; a small step keeps BatchNorm's rounding small)."""
    fed = make_fed((64,))
    torch.manual_seed(0)
    model = DropoutMLP()
    seq, vec = engines(fed, model)
    clients = np.array([4, 0, 2, 5, 1, 3])
    s = starts(model, 6, seed=2)
    mu = torch.full((6,), 0.1)
    mask = (torch.rand(6, s.shape[1], generator=torch.Generator().manual_seed(1)) > 0.3).float()
    for job in (TrainJob(clients, s, loss="prox", extras={"anchor": s.clone(), "mu": mu}, stream="other"),
                TrainJob(clients, s, mask=mask, epochs=1)):
        assert_close(seq.train(job, 1).params, vec.train(job, 1).params)
    plain = copy.deepcopy(model)
    for m in plain.modules():
        if isinstance(m, SeededDropout):
            m.p = 0.0
    assert not torch.allclose(seq.train(TrainJob(clients, s), 1).params,
                              SequentialEngine(fed, plain, CFG, 3, "cpu").train(TrainJob(clients, s), 1).params,
                              atol=1e-3)                                    # the masks are applied
    bn_fed = make_fed((3, 8, 8), sizes=(5, 19, 10), n_test=(6, 0, 9))
    cnn = build_model("clustpsi_cifar_cnn", (3, 8, 8), 10, seed=0)
    cfg = LocalConfig(epochs=1, batch_size=8, lr=3e-4, eval_chunk=50)
    seq, vec = engines(bn_fed, cnn, cfg)
    job = TrainJob(np.array([0, 1, 2]), starts(cnn, 3, seed=8))
    a, b = seq.train(job, 0), vec.train(job, 0)
    # BatchNorm over a few 1x1 maps amplifies the engines' different float rounding: compare with the move
    moved = float((a.params - job.start).abs().max())
    assert float((a.params - b.params).abs().max()) <= 0.02 * moved
    torch.testing.assert_close(a.loss, b.loss, atol=1e-4, rtol=1e-4)
    for split in ("local", "global"):
        ea, eb = seq.evaluate(a.params, job.clients, split), vec.evaluate(a.params, job.clients, split)
        assert torch.equal(ea.correct, eb.correct) and torch.equal(ea.confusion, eb.confusion)


def _context(fed, model, seed=0):
    return Context(num_clients=fed.num_clients, num_classes=fed.num_classes, spec=VectorizedEngine(
        fed, model, CFG, seed, "cpu", compile=False).spec, init=flatten(model), n_train=fed.n_train,
        label_hist=fed.label_hist(), seed=seed, rounds=3, fraction=0.5)


@pytest.mark.parametrize("algo_cls", [FedAvg, Local])
def test_algorithms_three_rounds(algo_cls, mlp_setup):
    fed, model = mlp_setup
    ctx = _context(fed, model)
    finals = []
    for eng in engines(fed, model):
        sim = Simulator(algo_cls(ctx), eng)
        rng = np.random.default_rng(0)
        for rnd in range(3):
            clients = np.sort(rng.choice(fed.num_clients, size=3, replace=False))
            sim.round(rnd, clients)
        finals.append(sim.inference(np.arange(fed.num_clients)).single.clone())   # each client's model
    assert_close(finals[0], finals[1])
    assert not torch.allclose(finals[0], flatten(model).expand_as(finals[0]))


def test_compile_auto_decision(mlp_setup):
    fed, model = mlp_setup
    assert not VectorizedEngine(fed, model, CFG, 0, compile="auto", rounds=100).compiled   # tiny run
    assert not VectorizedEngine(fed, model, CFG, 0, compile="false").compiled
    lenet = build_model("lenet5", (1, 32, 32), 10)
    act, flops = profile_model(lenet, (1, 32, 32), torch.device("cpu"))
    assert act == 6 * 28 * 28 and flops == 2 * (28 * 28 * 6 * 25 + 10 * 10 * 16 * 150 + 400 * 120 + 120 * 84 + 84 * 10)
    # the FedPrism paper workload (100 clients x 600 samples, 10k test, E=10, 100 rounds): compiled on CPU
    x = torch.zeros(1, 1, 32, 32)
    big = Federation(x.expand(60000, -1, -1, -1), torch.zeros(60000, dtype=torch.long), x.expand(10000, -1, -1, -1),
                     torch.zeros(10000, dtype=torch.long), [np.arange(600)] * 100, [np.arange(100)] * 100, 10)
    assert estimate_run_flops(flops, big, 10, 100) > 10 * AUTO_COMPILE_FLOPS
    cfg = LocalConfig(epochs=10, batch_size=32)
    assert VectorizedEngine(big, lenet, cfg, 0, compile="auto", rounds=100).compiled
    assert not VectorizedEngine(big, lenet, cfg, 0, compile="auto", rounds=1).compiled


def test_engine_auto_keeps_large_models_in_the_sequential_loop_on_cpu(mlp_setup):
    """engine=auto on CPU: a compiled vectorized engine for LeNet-5 on the paper workload, the sequential
    loop for a model of AUTO_SEQUENTIAL_PARAMS_CPU parameters or more; an explicit choice is obeyed."""
    from fedprism.engine import AUTO_SEQUENTIAL_PARAMS_CPU, make_engine

    fed, model = mlp_setup
    x = torch.zeros(1, 1, 32, 32)
    big = Federation(x.expand(60000, -1, -1, -1), torch.zeros(60000, dtype=torch.long), x.expand(10000, -1, -1, -1),
                     torch.zeros(10000, dtype=torch.long), [np.arange(600)] * 100, [np.arange(100)] * 100, 10)
    cfg = LocalConfig(epochs=10, batch_size=32)
    lenet = build_model("lenet5", (1, 32, 32), 10)
    assert isinstance(make_engine("auto", big, lenet, cfg, 0, "cpu", rounds=100), VectorizedEngine)
    wide = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(1024, AUTO_SEQUENTIAL_PARAMS_CPU // 1024))
    assert sum(p.numel() for p in wide.parameters()) >= AUTO_SEQUENTIAL_PARAMS_CPU
    assert type(make_engine("auto", big, wide, cfg, 0, "cpu", rounds=100)) is SequentialEngine
    assert isinstance(make_engine("vectorized", big, wide, cfg, 0, "cpu", compile="false"), VectorizedEngine)


@pytest.mark.slow
def test_bench_quick_smoke():
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "bench" / "engine.py"), "--quick"], cwd=root,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ratio (b)/(a)" in out.stdout and "projected 100-round run" in out.stdout


@pytest.mark.parametrize("setup", ["mlp_setup", "dropout_setup"])
def test_fused_jobs_keep_each_rows_batch_order_and_dropout(setup, request):
    """`train_together` on a fusing vectorized engine runs two jobs on different streams (one client in
    both) as one pass; every row gets the numbers of its own job trained alone, on either engine."""
    from fedprism.protocol import fuse_jobs, fusible, train_together
    fed, model = request.getfixturevalue(setup)
    jobs = [TrainJob(np.array([0, 2, 5]), starts(model, 3, seed=7), stream="expert"),
            TrainJob(np.array([5, 1]), starts(model, 2, seed=8), stream="private")]
    assert fusible(jobs) and fuse_jobs(jobs).stream == ("expert",) * 3 + ("private",) * 2
    seq, vec = engines(fed, model)
    fused = VectorizedEngine(fed, model, CFG, 3, "cpu", compile=False, fuse_jobs=True)
    calls = []
    train = fused.train
    fused.train = lambda job, rnd: calls.append(len(job.clients)) or train(job, rnd)
    got = train_together(fused, jobs, 2)
    assert calls == [5]                                             # one pass for both jobs
    for job, g in zip(jobs, got):
        alone_seq, alone_vec = seq.train(job, 2), vec.train(job, 2)
        assert_close(alone_vec.params, g.params)
        assert_close(alone_seq.params, g.params)
        torch.testing.assert_close(alone_seq.loss, g.loss, atol=1e-5, rtol=1e-5)
        assert torch.equal(alone_seq.n_samples, g.n_samples) and (g.clients == job.clients).all()
    # client 5 in both jobs: its two streams give two different models
    assert (got[0].params[2] - got[1].params[0]).abs().max() > 1e-3
    # the sequential engine and a non-fusing vectorized engine run the jobs one by one: the same bits
    for eng in (seq, vec):
        for job, g in zip(jobs, train_together(eng, jobs, 2)):
            assert torch.equal(eng.train(job, 2).params, g.params)


def test_jobs_that_differ_are_not_fused(mlp_setup):
    from fedprism.protocol import fusible, train_together
    fed, model = mlp_setup
    a = TrainJob(np.array([0, 1]), starts(model, 2), stream="expert")
    for b in (TrainJob(np.array([2]), starts(model, 1), loss="prox", extras={"anchor": starts(model, 1)}),
              TrainJob(np.array([2]), starts(model, 1), epochs=1),
              TrainJob(np.array([2]), starts(model, 1), optimizer="adam"),
              TrainJob(np.array([2]), starts(model, 1), mask=torch.ones(starts(model, 1).shape[1]))):
        assert not fusible([a, b])
    fused = VectorizedEngine(fed, model, CFG, 3, "cpu", compile=False, fuse_jobs=True)
    b = TrainJob(np.array([2]), starts(model, 1), epochs=1)
    got = train_together(fused, [a, b], 1)
    assert torch.equal(got[1].params, fused.train(b, 1).params)
    assert VectorizedEngine(fed, model, CFG, 3, "cpu", compile=False).fuses_jobs is False   # CPU default


def test_cuda_graphs_option_on_cpu(mlp_setup):
    """Off by default on CPU; asking for graphs there is a clear error naming the key."""
    from fedprism.engine import make_engine
    from fedprism.errors import ConfigError

    fed, model = mlp_setup
    assert VectorizedEngine(fed, model, CFG, 3, "cpu", compile=False).cuda_graphs is False
    with pytest.raises(ValueError, match="cuda_graphs=true needs a CUDA device"):
        VectorizedEngine(fed, model, CFG, 3, "cpu", compile=False, cuda_graphs=True)
    with pytest.raises(ConfigError, match="cuda_graphs"):
        make_engine("vectorized", fed, model, CFG, 3, "cpu", compile=False, cuda_graphs="true")
    eng = make_engine("vectorized", fed, model, CFG, 3, "cpu", compile=False, cuda_graphs="false")
    assert eng.cuda_graphs is False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("compiled", [False, True])
def test_cuda_graphs_give_the_same_bits(compiled):
    """A step replayed from a CUDA graph runs the recorded kernels on the same inputs: every job kind
    (plain, prox with extras, shared and per-client masks, dropout, BatchNorm partial batches, several
    slot counts) gives the unrecorded engine's parameters and losses bit for bit."""
    cases = [(make_fed((1, 32, 32), sizes=(5, 12, 21, 30, 41, 9), n_test=(4, 7, 13, 0, 21, 3)),
              build_model("lenet5", (1, 32, 32), 10, seed=0), CFG)]
    torch.manual_seed(0)
    cases.append((make_fed((64,)), DropoutMLP(), CFG))
    cases.append((make_fed((3, 8, 8), sizes=(5, 19, 10), n_test=(6, 0, 9)),
                  build_model("clustpsi_cifar_cnn", (3, 8, 8), 10, seed=0),
                  LocalConfig(epochs=1, batch_size=8, lr=3e-4, optimizer="adam", eval_chunk=50)))
    for fed, model, cfg in cases[:1] if compiled else cases:      # compiling costs ~15 s a model
        n = fed.num_clients
        s = starts(model.cpu(), n, seed=2)                         # an engine moves the model
        plain = VectorizedEngine(fed, model, cfg, 3, "cuda", compile=compiled, cuda_graphs=False)
        graphed = VectorizedEngine(fed, model, cfg, 3, "cuda", compile=compiled, cuda_graphs=True)
        clients = np.arange(n)[::-1].copy()
        mask = (torch.rand(n, s.shape[1], generator=torch.Generator().manual_seed(1)) > 0.3).float()
        jobs = [TrainJob(clients, s), TrainJob(clients[:2], s[:2]),
                TrainJob(clients, s, loss="prox", extras={"anchor": s.clone(), "mu": torch.full((n,), 0.1)}),
                TrainJob(clients, s, mask=mask[0]), TrainJob(clients, s, mask=mask, epochs=1),
                TrainJob(clients, s)]                       # a second use of the first recording
        for rnd, job in enumerate(jobs):
            a, b = plain.train(job, rnd), graphed.train(job, rnd)
            assert torch.equal(a.params, b.params), (type(model).__name__, rnd)
            assert torch.equal(a.loss, b.loss), (type(model).__name__, rnd)
        assert graphed.cuda_graphs and len(graphed._graphs) >= 3


def test_graph_buffers_give_the_same_bits_on_cpu(monkeypatch):
    """The bookkeeping around a recorded step (its own parameter, state, extras and mask tensors, staged
    indices, zeroed between jobs, one recording reused by later jobs) checked on the CPU with the
    recording itself left out (`GraphedStep.replay` runs the step directly when nothing is recorded)."""
    from fedprism.engine.cuda_graph import GraphedStep

    monkeypatch.setattr(GraphedStep, "record", lambda self: self)
    torch.manual_seed(0)
    for fed, model in ((make_fed((64,)), DropoutMLP()),
                       (make_fed((1, 32, 32), sizes=(5, 12, 21, 30, 41, 9), n_test=(4, 7, 13, 0, 21, 3)),
                        build_model("lenet5", (1, 32, 32), 10, seed=0))):
        plain = VectorizedEngine(fed, model, CFG, 3, "cpu", compile=False)
        graphed = VectorizedEngine(fed, model, CFG, 3, "cpu", compile=False)
        graphed.cuda_graphs = True
        n = fed.num_clients
        clients = np.arange(n)[::-1].copy()
        s = starts(model, n, seed=2)
        mask = (torch.rand(n, s.shape[1], generator=torch.Generator().manual_seed(1)) > 0.3).float()
        jobs = [TrainJob(clients, s), TrainJob(clients[:2], s[:2]),
                TrainJob(clients, s, loss="prox", extras={"anchor": s.clone(), "mu": torch.full((n,), 0.1)}),
                TrainJob(clients, s, mask=mask[0]), TrainJob(clients, s, mask=mask, epochs=1),
                TrainJob(clients, s)]
        for rnd, job in enumerate(jobs):
            a, b = plain.train(job, rnd), graphed.train(job, rnd)
            assert torch.equal(a.params, b.params) and torch.equal(a.loss, b.loss), rnd
        assert len(graphed._graphs) >= 3


def test_deterministic_cudnn_is_set_and_recorded_for_cuda_runs(monkeypatch):
    """`deterministic_cudnn` (called by every engine on a CUDA device) turns cuDNN's deterministic algorithms
    on and autotuning off, and a run's provenance records the setting for CUDA engines only."""
    from types import SimpleNamespace

    from fedprism.engine.base import deterministic_cudnn
    from fedprism.experiment.provenance import capture

    monkeypatch.setattr(torch.backends.cudnn, "deterministic", False)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", True)
    on = SimpleNamespace(engine=SimpleNamespace(device=torch.device("cuda")))
    assert capture(on)["execution"]["cudnn_deterministic"] is False
    deterministic_cudnn()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert capture(on)["execution"]["cudnn_deterministic"] is True
    cpu = capture(SimpleNamespace(engine=SimpleNamespace(device=torch.device("cpu"))))
    assert "cudnn_deterministic" not in cpu["execution"]


def test_a_compiler_failure_falls_back_to_eager_with_the_same_numbers_and_one_warning(mlp_setup, monkeypatch):
    """compile=true, and every compiled function raises (as a broken compiler toolchain would): the engine
    warns once, continues eagerly, and trains and scores exactly as compile=false does."""
    from fedprism.engine import vectorized

    fed, model = mlp_setup

    def broken(fn, **kw):
        def run(*args):
            raise RuntimeError("no C++ compiler found")
        return run

    monkeypatch.setattr(vectorized._MaybeCompiled, "_warned", False)
    monkeypatch.setattr(torch, "compile", broken)
    clients = np.array([4, 0, 2])
    plan = TrainJob(clients, starts(model, len(clients)))
    eager = VectorizedEngine(fed, model, CFG, 3, "cpu", compile=False)
    failing = VectorizedEngine(fed, model, CFG, 3, "cpu", compile=True)
    assert failing.compiled
    with pytest.warns(RuntimeWarning, match=r"compile failed \(RuntimeError: no C\+\+ compiler found\)"):
        got = failing.train(plan, rnd=1)
    want = eager.train(plan, rnd=1)
    assert torch.equal(got.params, want.params) and torch.equal(got.loss, want.loss)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                              # once per process, not per function
        a = failing.evaluate(got.params, clients, "local")
    b = eager.evaluate(want.params, clients, "local")
    assert torch.equal(a.correct, b.correct) and torch.equal(a.loss_sum, b.loss_sum)
