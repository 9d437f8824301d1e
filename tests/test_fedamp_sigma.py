"""FedAMP's kernel width: recorded self-attention each round, and `sigma_update=every_round`."""

from __future__ import annotations

import numpy as np
import pytest

from fedprism.experiment.config import resolve
from fedprism.experiment.runner import Experiment
from fedprism.experiment.store import Store

BASE = dict(method="fedamp", dataset="digits", clients=6, rounds=4, fraction=1.0, local_epochs=1, lr=0.1,
            model="mlp", engine="sequential", seed=2)


def _sq_dists(w) -> np.ndarray:
    """||w_i - w_j||^2 of every pair of rows, float64, by the definition."""
    w = w.double().numpy()
    return ((w[:, None, :] - w[None, :, :]) ** 2).sum(-1)


def _median_rule(w) -> float:
    """sigma=auto (distance): the median off-diagonal squared distance of the clients' models."""
    return float(np.median(_sq_dists(w)[~np.eye(len(w), dtype=bool)]))


def _self_weights(w, sigma: float) -> np.ndarray:
    """xi_ii of every client when all are known (alpha_k = max): 1 - mean_{j != i} exp(-d_ij / sigma)."""
    e = np.exp(-_sq_dists(w) / sigma)
    return 1.0 - (e.sum(1) - 1.0) / (len(w) - 1)


def _run(cfg, store) -> list[dict]:
    """Run `cfg`; returns, per round, the server's models and sigma before and after `aggregate`."""
    exp = Experiment(cfg, store)
    real, seen = exp.algo.aggregate, []

    def spy(state, rnd, update):
        before = {"w": state["w"].clone(), "sigma": state["sigma"], "clients": update.clients.copy()}
        out = real(state, rnd, update)
        seen.append({"before": before, "w": state["w"].clone(), "sigma": state["sigma"]})
        return out

    exp.algo.aggregate = spy
    assert exp.run().status == "finished"
    return seen


def test_self_attention_is_recorded_and_sigma_can_follow_the_models(tmp_path):
    """The recorded self-weights are the mean/min xi_ii recomputed from the server's models and sigma of
    that round; sigma is the median rule on the models after round 0 (once) or after every round
    (every_round)."""
    store = Store(tmp_path / "a.db")
    once = resolve(BASE)
    seen = _run(once, store)
    sig = store.records(once.run_id, "fedamp")
    att = store.records(once.run_id, "fedamp_attention")
    assert len(sig) == 1 and [r["round"] for r in att] == [1, 2, 3]          # round 0: sigma not known yet
    assert sig[0]["data"]["sigma"] == pytest.approx(_median_rule(seen[0]["w"]), rel=1e-9)
    assert all(s["sigma"] == sig[0]["data"]["sigma"] for s in seen)          # set once, kept
    for r in att:
        b = seen[r["round"]]["before"]
        assert len(b["clients"]) == 6 and r["data"]["sigma"] == b["sigma"]
        xii = _self_weights(b["w"], b["sigma"])
        assert r["data"]["self_weight_mean"] == pytest.approx(xii.mean(), rel=1e-9, abs=1e-12)
        assert r["data"]["self_weight_min"] == pytest.approx(xii.min(), rel=1e-9, abs=1e-12)
        assert 0 < xii.min() < xii.mean() < 1
    every = resolve({**BASE, "fedamp.sigma_update": "every_round"})
    assert every.run_id != once.run_id and resolve(BASE).run_id == once.run_id
    seen2 = _run(every, store)
    sig2 = store.records(every.run_id, "fedamp")
    assert [r["round"] for r in sig2] == [0, 1, 2, 3] and len({r["data"]["sigma"] for r in sig2}) == 4
    assert sig2[0]["data"]["sigma"] == sig[0]["data"]["sigma"]                # same first estimate
    for r in sig2:                                          # re-derived from the models of that round
        assert r["data"]["sigma"] == seen2[r["round"]]["sigma"]
        assert r["data"]["sigma"] == pytest.approx(_median_rule(seen2[r["round"]]["w"]), rel=1e-9)
    for r in store.records(every.run_id, "fedamp_attention"):
        b = seen2[r["round"]]["before"]
        assert r["data"]["sigma"] == b["sigma"] == seen2[r["round"] - 1]["sigma"]
        xii = _self_weights(b["w"], b["sigma"])
        assert r["data"]["self_weight_mean"] == pytest.approx(xii.mean(), rel=1e-9, abs=1e-12)
        assert r["data"]["self_weight_min"] == pytest.approx(xii.min(), rel=1e-9, abs=1e-12)
