"""`eval.gate=learned`: the learned routing gate of `fedprism.algorithms.fedprism_dual.gate`, fitted at a run's final
evaluation or when a kept final state is re-scored, stored beside the method's routings and chosen among
them by the report's validation rule."""

from __future__ import annotations

import numpy as np
import pytest

from fedprism.errors import ConfigError
from fedprism.algorithms.fedprism_dual import gate
from fedprism.experiment.config import resolve
from fedprism.experiment.runner import Experiment
from fedprism.experiment.store import Store
from fedprism.algorithms.fedprism_dual.routing import choose_routing

CFG = dict(dataset="digits", model="mlp", clients=6, rounds=2, fraction=1.0, local_epochs=1,
           engine="sequential", seed=2, method="fedprism_dual", **{"fedprism_dual.k": 2, "data.val_fraction": 0.25,
                                               "data.global_val": 200})
WEIGHTS = (1, 3)


@pytest.fixture
def two_weights(monkeypatch):
    monkeypatch.setattr(gate, "GATE_WEIGHTS", WEIGHTS)      # two candidates instead of five: a faster test


def _gate_keys(m: dict) -> list[str]:
    return sorted(k for k in m if "@gate " in k)


def test_gate_is_evaluation_only_and_absent_by_default():
    base = resolve(CFG)
    on = resolve({**CFG, "eval.gate": "learned"})
    assert resolve({**CFG, "eval.gate": "none"}).run_id == base.run_id     # stored run ids stay valid
    assert on.run_id != base.run_id and on.train_id == base.train_id       # same training, re-scored


@pytest.mark.parametrize("change, field", [
    ({"method": "fedavg"}, "method=fedavg"),
    ({"data.val_fraction": 0.0}, "data.val_fraction"),
    ({"data.global_val": 0}, "data.global_val"),
    ({"fedprism_dual.inference_weight": 1.0}, "inference_weight=1"),
])
def test_gate_without_two_streams_or_validation_data_is_refused(change, field):
    raw = {**CFG, "eval.gate": "learned", **change}
    if change.get("method") == "fedavg":
        raw.pop("fedprism_dual.k")
    with pytest.raises(ConfigError, match="eval.gate") as e:
        resolve(raw)
    assert field in str(e.value)
    with pytest.raises(ConfigError, match="eval.gate"):
        resolve({**CFG, "eval.gate": "boosted"})


def test_gate_rows_are_the_evaluated_streams(tmp_path):
    """The rows the gate is fitted and scored on hold the two streams the run's evaluation scored: their
    per-client mean accuracies equal the stored `@expert` and `@backbone` metrics on all four splits."""
    exp = Experiment(resolve(CFG), Store(tmp_path / "r.db"))
    res = exp.run()
    m = res.history[-1]
    rows = gate.stream_rows(exp, exp.state)
    for split, key in gate.METRIC.items():
        assert len(rows[split]) == 6
        spec = np.mean([r[1].mean() for r in rows[split]])
        back = np.mean([r[2].mean() for r in rows[split]])
        assert spec == pytest.approx(m[f"{key}@expert"], abs=1e-12)
        assert back == pytest.approx(m[f"{key}@backbone"], abs=1e-12)
    assert m["global_acc@expert"] != m["global_acc@backbone"]


def test_gated_run_stores_the_gate_at_its_end_and_rescoring_adds_it(tmp_path, two_weights):
    db = tmp_path / "g.db"
    trained = Experiment(resolve({**CFG, "eval.gate": "learned"}), Store(db)).run()
    names = [f"gate w={w}" for w in WEIGHTS]
    want = sorted(f"{k}@{n}" for k in gate.METRIC.values() for n in names)
    assert _gate_keys(trained.history[-1]) == want                     # the final evaluation only
    assert all(not _gate_keys(h) for h in trained.history[:-1])
    assert trained.history[-1]["gate_s"] > 0
    assert trained.history[-1]["eval_s"] >= trained.history[-1]["gate_s"]

    plain = Experiment(resolve(CFG), Store(db)).run()                 # re-scored: the same models, no gate
    assert plain.final.get("rescored_from") == trained.run_id and not _gate_keys(plain.history[-1])
    last = trained.history[-1]
    for k, v in plain.history[-1].items():
        if k.endswith("_s") or k in ("train_s", "eval_s"):
            continue
        assert last[k] == v, k

    db2 = tmp_path / "h.db"                                           # and the other way round
    Experiment(resolve(CFG), Store(db2)).run()
    again = Experiment(resolve({**CFG, "eval.gate": "learned"}), Store(db2)).run()
    assert again.final.get("rescored_from") and again.history[-1]["train_s"] == 0.0
    assert {k: again.history[-1][k] for k in want} == {k: last[k] for k in want}   # same gate, same numbers

    ch = choose_routing(last)
    assert {c["name"] for c in ch.candidates} >= set(names)
    exp = Experiment(resolve(CFG), Store(db2))
    rows = gate.stream_rows(exp, exp._restore(Store(db2).load_final(resolve(CFG).train_id)))
    for split, key in gate.METRIC.items():                            # each row goes to one of the streams
        both = np.mean([(r[1] & r[2]).mean() for r in rows[split]])
        either = np.mean([(r[1] | r[2]).mean() for r in rows[split]])
        for n in names:
            assert both - 1e-12 <= last[f"{key}@{n}"] <= either + 1e-12


def test_gate_that_would_not_fit_in_memory_is_refused_before_training(tmp_path, monkeypatch):
    """The gate's rows (N x the shared sets + the clients' own rows, 63 float32 columns each for 10 classes)
    are counted before round 0: too many for the memory is a ConfigError naming `eval.gate`, not an
    out-of-memory error at the final evaluation."""
    from fedprism.experiment import limits
    from fedprism.experiment.federation import build_federation

    cfg = resolve({**CFG, "eval.gate": "learned"})
    fed = build_federation(cfg)
    own = sum(map(len, fed.test_idx)) + sum(map(len, fed.val_idx))
    assert gate.row_bytes(fed) == (own + 6 * (len(fed.x_test) + 200)) * (63 * 4 + 11)
    monkeypatch.setattr(limits, "available_memory", lambda: 2 * gate.row_bytes(fed) - 2)
    with pytest.raises(ConfigError, match="eval.gate.*more than half the available memory"):
        Experiment(cfg, Store(tmp_path / "m.db"))
    monkeypatch.setattr(limits, "available_memory", lambda: 2 * gate.row_bytes(fed))
    Experiment(cfg, Store(tmp_path / "m.db"))
