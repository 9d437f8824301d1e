"""Validation splits: each client's validation rows held out of its training rows, a global validation
set carved from the training pool before partitioning; scored every evaluation, never the test splits."""

from __future__ import annotations

import numpy as np
import pytest

from fedprism.experiment.config import resolve
from fedprism.experiment.federation import build_federation
from fedprism.experiment.runner import Experiment
from fedprism.experiment.store import Store

BASE = dict(dataset="digits", clients=6, rounds=2, fraction=1.0, local_epochs=1, model="mlp", engine="sequential",
            seed=3)


def test_validation_rows_are_held_out_and_seeded():
    plain = build_federation(resolve(BASE))
    fed = build_federation(resolve({**BASE, "data.val_fraction": 0.2}))
    assert plain.val_idx is None and fed.has_val and not fed.has_global_val
    for c in range(6):
        tr, va = set(fed.train_idx[c].tolist()), set(fed.val_idx[c].tolist())
        assert not tr & va and tr | va == set(plain.train_idx[c].tolist())
        assert len(va) == int(np.floor(0.2 * len(plain.train_idx[c])))
    again = build_federation(resolve({**BASE, "data.val_fraction": 0.2}))
    assert all(np.array_equal(a, b) for a, b in zip(fed.val_idx, again.val_idx))
    assert all(np.array_equal(a, b) for a, b in zip(fed.test_idx, plain.test_idx))      # test splits untouched
    g = build_federation(resolve({**BASE, "data.global_val": 100}))
    assert g.has_global_val and len(g.y_val) == 100 and len(g.y_train) == len(plain.y_train) - 100
    assert np.array_equal(g.y_test.numpy(), plain.y_test.numpy())


def test_runs_report_validation_accuracy_and_old_ids_stay(tmp_path):
    assert resolve(BASE).run_id == resolve({**BASE, "data.val_fraction": 0.0, "data.global_val": 0}).run_id
    c = resolve({**BASE, "method": "fedprism_dual", "fedprism_dual.k": 2, "data.val_fraction": 0.25,
                 "data.global_val": 200})
    res = Experiment(c, Store(tmp_path / "v.db")).run()
    last = res.history[-1]
    for k in ("val_acc", "global_val_acc", "val_acc@T=2", "global_val_acc@backbone", "local_acc", "global_acc"):
        assert k in last and 0 <= last[k] <= 1, k
    assert last["models_evaluated"] == 4 * 6


def test_single_model_validation_is_the_model_on_those_rows(tmp_path):
    c = resolve({**BASE, "method": "fedavg", "data.val_fraction": 0.3, "data.global_val": 150})
    e = Experiment(c, Store(tmp_path / "f.db"))
    res = e.run()
    w = e.state["w"].unsqueeze(0)
    g = e.engine.evaluate(w, np.array([0]), "global_val")
    assert res.history[-1]["global_val_acc"] == pytest.approx(float(g.accuracy[0]), abs=1e-12)
    per = [float(e.engine.evaluate(w, np.array([i]), "val").accuracy[0]) for i in range(6)]
    assert res.history[-1]["val_acc"] == pytest.approx(float(np.mean(per)), abs=1e-12)


@pytest.mark.parametrize("engine", ["sequential", "vectorized"])
def test_global_validation_logit_cache_gives_the_per_client_loops_numbers(tmp_path, monkeypatch, engine):
    """The streams' logits on the global validation set are cached per client like the global test set's
    (`StreamScorer._cached_logits`), so only changed streams are run again. Every stored number of a run
    is the one the per-client loop that scored that set before gave (the same run with the set scored as
    a client's own split, `SHARED` without it), bit for bit; and the cache is used."""
    import fedprism.experiment.evaluate as evaluate

    c = resolve({**BASE, "engine": engine, "rounds": 3, "fraction": 0.5, "method": "fedprism_dual",
                 "fedprism_dual.k": 2, "data.val_fraction": 0.25, "data.global_val": 200})
    calls = []
    real = evaluate.StreamScorer._cached_logits
    monkeypatch.setattr(evaluate.StreamScorer, "_cached_logits",
                        lambda self, name, *a, **k: calls.append(a[-1] if a else k.get("split")) or
                        real(self, name, *a, **k))
    cached = Experiment(c, Store(tmp_path / "a.db")).run().history
    assert "global_val" in calls and "global" in calls
    monkeypatch.setattr(evaluate, "SHARED", ("global",))                  # global_val through the loop
    loop = Experiment(c, Store(tmp_path / "b.db")).run().history
    for a, b in zip(cached, loop):
        keys = [k for k in a if "global_val" in k]
        assert len(keys) > 10
        for k in keys:
            assert a[k] == b[k], k
