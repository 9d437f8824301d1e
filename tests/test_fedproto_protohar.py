"""FedProto and ProtoHAR: what travels, hand-computed prototypes, the loss, the reducing settings, and
the nearest-prototype prediction through the evaluation path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fedprism.algorithms import REGISTRY
from fedprism.algorithms.aggregation import class_prototypes
from fedprism.algorithms.base import Context, Inference, TrainJob, train_update
from fedprism.algorithms.fedavg import FedAvg
from fedprism.algorithms.fedproto import prototype_loss, update_prototypes
from fedprism.engine.base import LocalConfig
from fedprism.engine.sequential import SequentialEngine
from fedprism.experiment.config import resolve
from fedprism.experiment.evaluate import Evaluator, StreamScorer
from fedprism.experiment.runner import Experiment, Simulator
from fedprism.experiment.store import Store
from fedprism.federation import Federation
from fedprism.params import Functional, flatten
from fedprism.protocol import Update

SMALL = dict(dataset="digits", clients=6, rounds=3, fraction=0.5, local_epochs=1, batch_size=16, lr=0.05,
             model="mlp", engine="sequential", device="cpu", seed=1)


def cfg(**kw):
    return resolve({**SMALL, **{k.replace("__", "."): v for k, v in kw.items()}})


def run(tmp_path, **kw) -> Experiment:
    e = Experiment(cfg(**kw), Store(tmp_path / f"{kw['method']}.db"))
    assert e.run().status == "finished"
    return e


# -- server math -------------------------------------------------------------------------------------------
def test_class_prototypes_by_hand():
    protos = torch.tensor([[[1.0, 0.0], [2.0, 2.0], [0.0, 0.0], [0.0, 0.0]],
                           [[3.0, 0.0], [0.0, 0.0], [4.0, 4.0], [0.0, 0.0]]])
    counts = torch.tensor([[1.0, 3.0, 0.0, 0.0], [3.0, 0.0, 2.0, 0.0]])
    mean, present = class_prototypes(protos, counts, "samples")
    assert present.tolist() == [True, True, True, False]
    assert torch.equal(mean, torch.tensor([[2.5, 0.0], [2.0, 2.0], [4.0, 4.0], [0.0, 0.0]]))
    mean, _ = class_prototypes(protos, counts, "uniform")
    assert torch.equal(mean, torch.tensor([[2.0, 0.0], [2.0, 2.0], [4.0, 4.0], [0.0, 0.0]]))


def test_round_memory_keeps_unreported_classes_and_seen_memory_averages_every_latest_upload():
    ctx = Context(num_clients=3, num_classes=2, spec=None, init=torch.zeros(1), n_train=np.ones(3),
                  label_hist=np.ones((3, 2)), seed=0, rounds=2, fraction=1.0, feature_dim=1)
    from fedprism.algorithms.fedproto import prototype_state
    first = Update(np.array([0, 1]), {"protos": torch.tensor([[[1.0], [10.0]], [[3.0], [0.0]]]),
                                      "counts": torch.tensor([[1.0, 2.0], [1.0, 0.0]])})
    second = Update(np.array([2]), {"protos": torch.tensor([[[8.0], [0.0]]]),
                                    "counts": torch.tensor([[2.0, 0.0]])})
    out = {}
    for over in ("round", "seen"):
        state = prototype_state(ctx, over)
        update_prototypes(state, first, "samples", over)
        assert state["protos"].flatten().tolist() == [2.0, 10.0] and state["present"].tolist() == [True, True]
        update_prototypes(state, second, "samples", over)
        out[over] = state["protos"].flatten().tolist()
    assert out["round"] == [8.0, 10.0]                     # class 1 not reported in round 2: kept
    assert out["seen"] == [(1 + 3 + 2 * 8) / 4, 10.0]      # every client's latest upload


# -- the loss ------------------------------------------------------------------------------------------------
class Identity2(nn.Module):
    """features = the input itself (2-d), a linear head over 4 classes: prototypes are class means of x."""

    def __init__(self, classes: int = 4):
        super().__init__()
        self.body = nn.Identity()
        self.head = nn.Sequential(nn.Linear(2, classes))

    def forward(self, x, features_only=False):
        z = self.body(x)
        return z if features_only else self.head(z)


def test_prototype_loss_by_hand():
    torch.manual_seed(0)
    f = Functional(Identity2())
    w = flatten(f.module)
    x = torch.tensor([[0.0, 0.0], [2.0, 0.0], [0.0, 4.0]])
    y = torch.tensor([0, 0, 1])
    protos = torch.tensor([[1.0, 0.0], [9.0, 9.0], [0.0, 0.0], [0.0, 0.0]])
    present = torch.tensor([1.0, 0.0, 0.0, 0.0])                         # class 1 has no global prototype
    ce = torch.nn.functional.cross_entropy(f(w, x), y)

    def loss(lam, weight):
        return prototype_loss(f, w, x, y, weight, {"protos": protos, "present": present, "lam": torch.tensor(lam)})

    ones = torch.ones(3)
    torch.testing.assert_close(loss(2.0, ones), ce + 2.0 * (1 + 1 + 0) / (3 * 2))     # mean over batch and d
    assert torch.equal(loss(0.0, ones), ce)
    pad = torch.tensor([1.0, 1.0, 0.0])                             # a padded sample counts nowhere
    ce2 = torch.nn.functional.cross_entropy(f(w, x[:2]), y[:2])
    torch.testing.assert_close(loss(1.0, pad), ce2 + (1 + 1) / (2 * 2))


def test_fedproto_with_lambda_zero_is_local_training(tmp_path):
    local = run(tmp_path, method="local")
    zero = run(tmp_path, method="fedproto", fedproto__lam=0.0)
    one = run(tmp_path, method="fedproto")
    assert torch.equal(zero.clients.data["w"], local.clients.data["w"])
    assert not torch.equal(one.clients.data["w"], local.clients.data["w"])    # lambda = 1 changes the models


# -- what travels ----------------------------------------------------------------------------------------------
def test_fedproto_uploads_and_downloads_only_prototypes(tmp_path):
    e = run(tmp_path, method="fedproto")
    C, d = e.ctx.num_classes, e.ctx.feature_dim
    assert set(e.upload) == {"protos", "counts"}
    assert e.upload["protos"].shape == (C, d) and e.upload["counts"].shape == (C,)
    for h in e.store.round_metrics(e.run_id):
        assert h["accepted"] == h["clients"] == 3, h                             # nothing rejected
        assert h["bytes_up"] == h["accepted"] * (C * d + C) * 4, h
        assert h["bytes_down"] == h["clients"] * (C * d + C) * 4, h
    plan = e.algo.plan(e.state, 0, np.array([0, 1]))
    assert {k: tuple(v.shape) for k, v in plan.payload.items()} == {"protos": (2, C, d), "present": (2, C)}
    assert set(e.state) == {"protos", "present", "client_protos", "client_counts"}     # no model on the server


def test_protohar_head_never_leaves_the_client(tmp_path):
    e = run(tmp_path, method="protohar", fraction=1.0)
    spec, C, d = e.ctx.spec, e.ctx.num_classes, e.ctx.feature_dim
    nb = spec.body.stop - spec.body.start
    assert {k: s.shape for k, s in e.upload.items()} == {"body": (nb,), "protos": (C, d), "counts": (C,)}
    for h in e.store.round_metrics(e.run_id):
        assert h["accepted"] == h["clients"] == 6, h                             # nothing rejected
        assert h["bytes_up"] == h["accepted"] * (nb + C * d + C) * 4, h
        assert h["bytes_down"] == h["clients"] * (nb + C * d + C) * 4, h
    plan = e.algo.plan(e.state, 0, np.arange(6))
    assert set(plan.payload) == {"body", "protos", "present"} and plan.payload["body"].shape == (6, nb)
    assert e.state["body"].shape == (nb,)
    heads = e.clients.data["w"][:, spec.head]
    assert not torch.equal(heads[0], e.ctx.init[spec.head])                     # the heads trained ...
    assert len({tuple(h.tolist()) for h in heads}) == 6                         # ... each its own


class FrozenHeadFedAvg(FedAvg):
    """FedAvg whose clients train only the body (the head stays the initial one)."""

    name = "test_frozenhead_fedavg"

    def client_update(self, plan, trainer, rnd, cstate):
        mask = torch.zeros(self.ctx.spec.size)
        mask[self.ctx.spec.body] = 1
        return train_update(trainer, TrainJob(plan.clients, plan.start, mask=mask), rnd)


@pytest.fixture
def frozen_head_fedavg():
    REGISTRY[FrozenHeadFedAvg.name] = FrozenHeadFedAvg
    yield FrozenHeadFedAvg.name
    REGISTRY.pop(FrozenHeadFedAvg.name)


def test_protohar_without_regulariser_and_head_phase_is_fedavg_of_the_body(tmp_path, frozen_head_fedavg):
    unequal = dict(partition="dirichlet_per_class")                     # unequal n_k: the weights matter
    ref = run(tmp_path, method=frozen_head_fedavg, **unequal)
    assert len(set(ref.ctx.n_train.tolist())) > 1
    e = run(tmp_path, method="protohar", protohar__lam=0.0, protohar__head_epochs=0, **unequal)
    body, head = e.ctx.spec.body, e.ctx.spec.head
    assert torch.equal(e.state["body"], ref.state["w"][body])
    assert torch.equal(e.clients.data["w"][:, head], e.ctx.init[head].expand(6, -1))
    with_reg = run(tmp_path / "reg", method="protohar", protohar__head_epochs=0, **unequal)
    assert not torch.equal(with_reg.state["body"], ref.state["w"][body])        # lambda = 1 moves the body


def test_protohar_phase_order(tmp_path, frozen_head_fedavg):
    """After one round, body_first uploads a body trained under the initial head (FedAvg's frozen-head
    body); head_first trains the body under the head it fitted first."""
    ref = run(tmp_path, method=frozen_head_fedavg, rounds=1)
    body = ref.ctx.spec.body
    first = run(tmp_path, method="protohar", rounds=1, protohar__lam=0.0, protohar__order="body_first")
    assert torch.equal(first.state["body"], ref.state["w"][body])
    head = ref.ctx.spec.head
    assert not torch.equal(first.clients.data["w"][:, head], ref.state["w"][head].expand(6, -1))   # head trained
    then = run(tmp_path / "h", method="protohar", rounds=1, protohar__lam=0.0)
    assert not torch.equal(then.state["body"], ref.state["w"][body])


# -- a hand-made federation with known features -----------------------------------------------------------------
def hand_federation() -> Federation:
    x_train = torch.tensor([[0.0, 0.0], [2.0, 0.0], [0.0, 4.0],                  # client 0: class 0 x2, class 1
                            [4.0, 0.0], [10.0, 10.0], [10.0, 12.0], [10.0, 14.0]])  # client 1: class 0, class 2 x3
    y_train = torch.tensor([0, 0, 1, 0, 2, 2, 2])
    x_test = torch.tensor([[1.9, 0.1], [0.0, 3.0], [0.5, 3.5], [9.0, 11.0], [4.0, 0.0], [0.3, 0.2]])
    y_test = torch.tensor([0, 1, 0, 2, 3, 0])
    return Federation(x_train, y_train, x_test, y_test, [np.arange(3), np.arange(3, 7)],
                      [np.arange(3), np.arange(3, 6)], 4, ["a", "b", "c", "d"], "hand")


def hand_setup(method, **hp):
    fed = hand_federation()
    torch.manual_seed(0)
    model = Identity2()
    engine = SequentialEngine(fed, model, LocalConfig(epochs=1, batch_size=2, lr=0.01), seed=0)
    ctx = Context(num_clients=2, num_classes=4, spec=engine.spec, init=flatten(model), n_train=fed.n_train,
                  label_hist=fed.label_hist(), seed=0, rounds=1, fraction=1.0, feature_dim=2)
    return Simulator(REGISTRY[method](ctx, **hp), engine), engine


@pytest.mark.parametrize("method,key", [("fedproto", "weighting"), ("protohar", "proto_weighting")])
def test_two_clients_with_known_features_give_the_hand_computed_prototypes(method, key):
    for how, class0 in (("samples", [2.0, 0.0]), ("uniform", [2.5, 0.0])):    # (2 (1,0) + (4,0)) / 3 or / 2
        sim, _ = hand_setup(method, **{key: how})
        _, up, _ = sim.round(0, np.array([0, 1]))
        local = torch.tensor([[[1.0, 0.0], [0.0, 4.0], [0.0, 0.0], [0.0, 0.0]],           # class means of x
                              [[4.0, 0.0], [0.0, 0.0], [10.0, 12.0], [0.0, 0.0]]])
        torch.testing.assert_close(up.payload["protos"], local)
        assert up.payload["counts"].tolist() == [[2, 1, 0, 0], [1, 0, 3, 0]]
        expected = torch.tensor([class0, [0.0, 4.0], [10.0, 12.0], [0.0, 0.0]])
        torch.testing.assert_close(sim.state["protos"], expected)
        assert sim.state["present"].tolist() == [True, True, True, False]


def test_nearest_prototype_prediction_through_the_evaluation_path():
    sim, engine = hand_setup("fedproto")
    sim.round(0, np.array([0, 1]))
    ev = Evaluator(engine, 2)
    for _ in range(2):                                        # the second call reads the cached features
        s = ev(sim.algo, sim.state, sim.clients.data)
        # prototypes (2,0), (0,4), (10,12); class 3 has none (its zero row must not count). Client 0's test:
        # (1.9,.1)->0 ok, (0,3)->1 ok, (.5,3.5)->1 but is 0; client 1's: (9,11)->2 ok, (4,0)->0 but is 3,
        # (.3,.2)->0 ok (the zero row of class 3 would be nearer). The global set: 4 of 6.
        assert s.alternatives["local_acc@proto"].tolist() == [2 / 3, 2 / 3]
        assert s.alternatives["global_acc@proto"].tolist() == [4 / 6, 4 / 6]
        head = engine.evaluate(sim.clients.data["w"], np.array([0, 1]), "local").accuracy.numpy()
        assert s.local_acc.tolist() == head.tolist()          # the headline is the own model's head
    inf = sim.inference()
    bad = Inference({"features": inf.streams["features"]}, alternatives=inf.alternatives, extras=inf.extras,
                    features=("features",))
    with pytest.raises(ValueError, match="needs logits"):
        StreamScorer(engine, 2)(bad, np.array([0, 1]), "local")
