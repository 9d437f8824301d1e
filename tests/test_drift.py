"""Class drift (fedprism.data.drift): a seeded schedule stored with the run, removed classes are neither
trained on nor tested on while away, metrics follow the schedule, static runs keep their ids."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedprism.data.drift import make_schedule
from fedprism.experiment.config import resolve
from fedprism.experiment.runner import Experiment
from fedprism.experiment.store import Store
from fedprism.protocol import TrainJob

BASE = dict(dataset="digits", clients=6, rounds=4, fraction=1.0, local_epochs=1, batch_size=16, lr=0.05,
            model="mlp", seed=1, method="fedavg")
DRIFT = {"drift.fraction": 0.5, "drift.every": 2}


def test_schedule_is_deterministic_given_the_seed():
    hist = np.random.default_rng(0).integers(0, 5, size=(20, 6))
    a = make_schedule(hist, 0.6, 0.8, 50, seed=3)
    assert a == make_schedule(hist, 0.6, 0.8, 50, seed=3)
    assert a != make_schedule(hist, 0.6, 0.8, 50, seed=4)
    assert 0 < len(a.returns) <= 12
    for k, ret in a.returns.items():
        held = np.flatnonzero(hist[k])
        assert len(ret) == min(int(0.8 * len(held)), len(held) - 1)        # at least one class stays
        assert set(c for c, _ in ret) <= set(held)
        assert [r for _, r in ret] == [50 * (i + 1) for i in range(len(ret))]
    assert a.removed(10 ** 6) == {}


@pytest.mark.parametrize("engine", ["sequential", "vectorized"])
def test_a_class_that_left_is_not_trained_or_tested_on(tmp_path, engine):
    e = Experiment(resolve({**BASE, **DRIFT, "engine": engine, "device": "cpu"}), Store(tmp_path / "d.db"))
    for rnd in (0, 2, 4, 8):
        e.apply_drift(rnd, None)
        gone = e.drift.removed(rnd)
        clients = np.arange(6)
        t = e.engine.train(TrainJob(clients, e.ctx.init.expand(6, -1).clone()), rnd)
        for k in clients:
            for split in ("train", "local"):
                y = e.engine.data(int(k), split)[1].numpy()
                assert not np.isin(y, gone.get(int(k), [])).any()
            full = e.fed.y_train[torch.as_tensor(e.fed.train_idx[k])].numpy()
            assert t.n_samples[k] == (~np.isin(full, gone.get(int(k), []))).sum()
        if rnd == 0:
            assert gone and sum(t.n_samples) < sum(len(i) for i in e.fed.train_idx)
        if rnd == 8:
            assert gone == {}


def test_sequential_batches_hold_only_present_classes(tmp_path):
    e = Experiment(resolve({**BASE, **DRIFT, "engine": "sequential", "device": "cpu"}), Store(tmp_path / "d.db"))
    e.apply_drift(0, None)
    seen = []

    def spy(model, w, x, y, weight, extras):
        seen.append(y.clone())
        return torch.nn.functional.cross_entropy(model(w, x), y)

    k = min(e.drift.removed(0))
    e.engine.train(TrainJob(np.array([k]), e.ctx.init[None].clone(), loss=spy), 0)
    assert not np.isin(torch.cat(seen).numpy(), e.drift.removed(0)[k]).any()


def test_run_stores_schedule_and_metrics_follow_it(tmp_path):
    e = Experiment(resolve({**BASE, **DRIFT, "engine": "sequential", "device": "cpu"}), Store(tmp_path / "d.db"))
    res = e.run()
    recs = e.store.records(e.run_id, "drift")
    assert {r["client"]: [tuple(x) for x in r["data"]["returns"]] for r in recs} == \
        {k: list(v) for k, v in e.drift.returns.items()}
    removed = [h["drift_removed"] for h in res.history]
    assert removed == [sum(len(v) for v in e.drift.removed(t).values()) for t in range(4)]
    assert removed[0] > removed[2] and all(np.isfinite(h["local_acc"]) for h in res.history)


def test_static_run_ids_are_unchanged():
    """Run ids computed before the drift keys existed (pinned) stay valid at their defaults."""
    assert resolve(BASE).run_id == "e292b3833cfa366c"
    assert resolve({**BASE, "method": "protohar"}).run_id == "3417ff423711eac9"
    assert resolve({**BASE, "drift.fraction": 0.0, "drift.every": 50}).run_id == "e292b3833cfa366c"
    assert resolve({**BASE, **DRIFT}).run_id != "e292b3833cfa366c"


def test_engines_train_the_same_drifted_rows(tmp_path):
    out = []
    for engine in ("sequential", "vectorized"):
        e = Experiment(resolve({**BASE, **DRIFT, "engine": engine, "device": "cpu"}), Store(tmp_path / f"{engine}.db"))
        e.apply_drift(0, None)
        out.append(e.engine.train(TrainJob(np.arange(6), e.ctx.init.expand(6, -1).clone()), 0).params)
    assert torch.allclose(out[0], out[1], atol=1e-5)
