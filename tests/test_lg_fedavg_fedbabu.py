"""LG-FedAvg (the clients keep the lower layers, the server averages the top ones) and FedBABU (FedAvg on
the body under the frozen initial head, fine-tuning at evaluation): the reduction to FedAvg, what never
leaves a client, the frozen head, the averaged body, the fine-tuned predictions, both engines."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import planted_federation, unequal_federation
from test_fedper_fedrep_fedbn import drive, setup

from fedprism.algorithms import REGISTRY
from fedprism.engine import SequentialEngine
from fedprism.engine.vectorized import VectorizedEngine
from fedprism.errors import ConfigError
from fedprism.experiment.config import resolve
from fedprism.experiment.runner import Experiment, Simulator, sample_clients
from fedprism.experiment.store import Store


class Recorder:
    """The engine, recording every TrainJob and its result."""

    def __init__(self, engine):
        self.engine, self.jobs = engine, []

    def train(self, job, rnd):
        out = self.engine.train(job, rnd)
        self.jobs.append((job, rnd, out))
        return out

    def __getattr__(self, name):
        return getattr(self.engine, name)


def n_layers(spec) -> int:
    bn = {(s.start, s.stop) for s in spec.batchnorm}
    return sum((s.start, s.stop) not in bn for _, s in spec.layers)


# -- LG-FedAvg ---------------------------------------------------------------------------------------
def test_lg_fedavg_sharing_every_layer_is_fedavg_bit_for_bit(digits):
    fed = unequal_federation(digits)
    spec = setup(fed, "fedavg")[0].ctx.spec
    algo, eng = setup(fed, "lg_fedavg", shared=n_layers(spec))
    ref, eng2 = setup(fed, "fedavg")
    a, b = drive(algo, eng), drive(ref, eng2)
    assert algo.upload()["shared"].shape == (spec.size,)
    assert torch.equal(a.state["shared"], b.state["w"]) and not torch.equal(b.state["w"], ref.ctx.init)
    assert torch.equal(a.inference().single, b.inference().single)
    ra, rb = a.evaluate("local"), b.evaluate("local")
    assert torch.equal(ra.correct, rb.correct) and torch.equal(ra.loss_sum, rb.loss_sum)


def test_lg_fedavg_shares_the_top_layers(digits):
    fed = unequal_federation(digits)
    head = setup(fed, "lg_fedavg", "mlp_bn")[0]
    spec = head.ctx.spec
    assert torch.equal(head.shared, torch.arange(spec.head.start, spec.size))      # default: the head
    assert torch.equal(setup(fed, "lg_fedavg", "mlp_bn", shared=1)[0].shared, head.shared)
    two = setup(fed, "lg_fedavg", "mlp_bn", shared=2)[0]          # fc1, BN, fc2, BN, head: fc2 on
    assert torch.equal(two.shared, torch.arange(spec.layers[2][1].start, spec.size))
    for bad in (0, 4, "body"):
        with pytest.raises(ConfigError, match="lg_fedavg.shared"):
            setup(fed, "lg_fedavg", "mlp_bn", shared=bad)


def test_fedbabu_head_stays_the_initial_head_and_the_body_is_the_mean(digits, tmp_path):
    """Every local training freezes the head (trained models keep the initial head bit for bit), starts
    from the server's body under the initial head, and the server's body is the n_k-weighted mean of the
    uploaded bodies (replayed by hand in float64); only the body travels."""
    fed = unequal_federation(digits)
    algo, eng = setup(fed, "fedbabu")
    spec, rec = algo.ctx.spec, Recorder(eng)
    head, body, init = spec.head, spec.body, algo.ctx.init
    sim = Simulator(algo, rec)
    assert sim.clients.data == {} and algo.upload()["shared"].shape == (body.stop,)
    for t in range(3):
        s_before = sim.state["shared"].clone()
        plan, update, _ = sim.round(t, sample_clients(0, t, fed.num_clients, 0.5))
        ((job, rnd, out),) = rec.jobs
        rec.jobs.clear()
        assert rnd == t and job.stream == "train" and job.epochs is None
        assert torch.equal(job.start[:, body], s_before.expand(len(plan.clients), -1))
        assert torch.equal(job.start[:, head], init[head].expand(len(plan.clients), -1))
        assert torch.equal(out.params[:, head], job.start[:, head])                   # head frozen
        assert (out.params[:, body] != job.start[:, body]).any(1).all()                 # body trained
        assert torch.equal(update.payload["shared"], out.params[:, body])
        n = torch.as_tensor(fed.n_train[plan.clients], dtype=torch.float64)
        mean = (n[:, None] * out.params[:, body].double()).sum(0) / n.sum()
        assert torch.equal(sim.state["shared"], mean.float())
    assert not torch.equal(sim.state["shared"], init[body])
    c = resolve(dict(dataset="digits", clients=6, rounds=2, fraction=0.5, local_epochs=1, batch_size=16,
                     lr=0.05, model="mlp", engine="sequential", device="cpu", seed=1, method="fedbabu",
                     **{"fedbabu.finetune_epochs": 1}))
    res = Experiment(c, Store(tmp_path / "b.db")).run()
    for h in res.history:
        assert h["bytes_up"] == 4 * body.stop * h["accepted"] > 0
        assert h["bytes_down"] == 4 * body.stop * h["clients"]


def test_fedbabu_without_finetuning_predicts_with_the_global_model(digits):
    """tau = 0: the one stream is (server body, initial head), scored exactly as that model; tau > 0: the
    `global` alternative is that model's score on the same samples and the headline is the fine-tuned one."""
    fed = unequal_federation(digits)
    zero = drive(*setup(fed, "fedbabu", finetune_epochs=0))
    algo = zero.algo
    w = torch.cat([zero.state["shared"], algo.ctx.init[algo.ctx.spec.head]])
    everyone = np.arange(fed.num_clients)
    assert torch.equal(zero.inference().single, w.expand(fed.num_clients, -1))
    tuned = drive(*setup(fed, "fedbabu", finetune_epochs=2))
    assert torch.equal(tuned.state["shared"], zero.state["shared"])         # training ignores tau
    for split in ("local", "global"):
        exact = zero.engine.evaluate(w.expand(fed.num_clients, -1), everyone, split)
        r0, r2 = zero.evaluate(split), tuned.evaluate(split)
        assert torch.equal(r0.correct, exact.correct) and torch.equal(r0.loss_sum, exact.loss_sum)
        assert torch.equal(r2.alternatives["global"], exact.correct), split
        assert not torch.equal(r2.correct, exact.correct), split
    assert REGISTRY["fedbabu"].headline({"fedbabu.finetune_epochs": 0}) == "global model"
    a = resolve({"method": "fedbabu"})
    b = resolve({"method": "fedbabu", "fedbabu.finetune_epochs": 0, "fedbabu.finetune": "head"})
    assert a.train_id == b.train_id and a.run_id != b.run_id                  # evaluation-only keys


def test_fedbabu_finetuning_is_evaluation_only_and_rescored_from_the_kept_state(tmp_path):
    """A finished run with tau = 1, then tau = 0 in the same store: re-scored from the kept final state
    (one evaluated round, no training), and its headline is the first run's `global` alternative."""
    base = dict(dataset="digits", clients=6, rounds=2, fraction=0.5, local_epochs=1, batch_size=16, lr=0.05,
                model="mlp", engine="sequential", device="cpu", seed=1, method="fedbabu")
    store = Store(tmp_path / "a.db")
    tuned = Experiment(resolve({**base, "fedbabu.finetune_epochs": 1}), store).run().history[-1]
    plain = Experiment(resolve({**base, "fedbabu.finetune_epochs": 0}), store).run().history
    assert len(plain) == 1 and "local_acc@global" not in plain[0]
    assert plain[0]["local_acc"] == tuned["local_acc@global"] != tuned["local_acc"]
    assert plain[0]["global_acc"] == tuned["global_acc@global"]


def test_fedbabu_finetuning_personalises_on_a_non_iid_federation(digits):
    """Clients holding two classes each: fine-tuning the whole model (tau epochs on the 'finetune' stream,
    from the global model) beats the global model on the clients' own test splits; `finetune=head`
    trains the head alone."""
    fed, _ = planted_federation(digits, clients_per_group=2, per_client=40,
                                groups=((0, 1), (2, 3), (4, 5), (6, 7), (8, 9)))
    sim = drive(*setup(fed, "fedbabu"), rounds=3, fraction=1.0)
    r = sim.evaluate("local")
    ft, glob = r.accuracy.mean().item(), (r.alternatives["global"].double() / r.count.double()).mean().item()
    assert ft > glob + 0.1, (ft, glob)
    rec = Recorder(sim.engine)
    spec = sim.algo.ctx.spec
    for how, trains in (("full", slice(0, spec.size)), ("head", spec.head)):
        algo = REGISTRY["fedbabu"](sim.algo.ctx, finetune=how, finetune_epochs=2)
        everyone = np.arange(fed.num_clients)
        inf = algo.inference(rec, everyone, algo.eval_payload(sim.state, everyone), {})
        ((job, rnd, out),) = rec.jobs
        rec.jobs.clear()
        assert (job.stream, job.epochs, rnd) == ("finetune", 2, 0)
        frozen = torch.ones(spec.size, dtype=torch.bool)
        frozen[trains] = False
        assert torch.equal(out.params[:, frozen], job.start[:, frozen])
        assert (out.params[:, trains] != job.start[:, trains]).any(1).all(), how
        assert torch.equal(inf.streams["finetuned"], out.params)
        assert torch.equal(inf.streams["global"], job.start)


@pytest.mark.parametrize("method", ["lg_fedavg", "fedbabu"])
def test_engines_agree_and_finetuning_is_a_function_of_the_payload(method, digits):
    """Both engines: the same server state and predictions up to rounding. FedBABU's fine-tuned models do
    not depend on when or in which blocks inference runs (the evaluator builds it block by block; a Flower
    node builds its own)."""
    fed = unequal_federation(digits)
    hp = {"finetune_epochs": 2} if method == "fedbabu" else {}
    engines = (SequentialEngine, VectorizedEngine)
    sims = [drive(*setup(fed, method, engine=e, **hp), rounds=2) for e in engines]
    torch.testing.assert_close(sims[0].state["shared"], sims[1].state["shared"], atol=1e-5, rtol=1e-4)
    infs = [s.inference() for s in sims]
    for name in infs[0].streams:
        torch.testing.assert_close(infs[0].streams[name], infs[1].streams[name], atol=1e-4, rtol=1e-4)
    for split in ("local", "global"):
        ra, rb = sims[0].evaluate(split), sims[1].evaluate(split)
        assert torch.equal(ra.correct, rb.correct), split
        assert ra.alternatives.keys() == rb.alternatives.keys()
        assert all(torch.equal(ra.alternatives[k], rb.alternatives[k]) for k in ra.alternatives), split
    if method == "fedbabu":
        sim = sims[0]
        again = sim.inference()
        halves = [sim.inference(np.arange(3)), sim.inference(np.arange(3, 6))]
        for name in infs[0].streams:
            assert torch.equal(again.streams[name], infs[0].streams[name])
            assert torch.equal(torch.cat([h.streams[name] for h in halves]), infs[0].streams[name])
