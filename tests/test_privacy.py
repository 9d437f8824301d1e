"""Differentially private label counts and prototypes (fedprism.privacy): the accountant's calibration,
the two Gaussian mechanisms (clipping, noise scale), the in-process run (epsilon spent stored), and a
Flower run that releases the same prototypes as the in-process one."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedprism.algorithms.fedproto import local_prototypes
from fedprism.errors import ConfigError
from fedprism.experiment.config import resolve
from fedprism.experiment.runner import Experiment
from fedprism.experiment.store import Store
from fedprism.privacy import Privacy, calibrate, clip_rows, epsilon_spent

pytest.importorskip("flwr")
from test_flower import FakeGrid, assert_same_state, in_process, nodes_for, run_config, task_identity  # noqa: E402,F401

TINY = dict(dataset="digits", method="fedproto", model="mlp", clients=4, rounds=3, fraction=0.5, local_epochs=1,
            lr=0.05, engine="sequential", seed=2)


def test_calibration_meets_the_budget_and_tracks_the_releases():
    for eps, delta, r in [(0.5, 1e-5, 1), (2.0, 1e-5, 101), (8.0, 1e-6, 30)]:
        z = calibrate(eps, delta, r)
        assert epsilon_spent(z, r, delta) <= eps
        assert epsilon_spent(z * 0.99, r, delta) > eps                   # the smallest such z (1%)
    # a single release: no more noise than the classic analytic Gaussian bound (Dwork & Roth, Thm A.1)
    assert calibrate(0.5, 1e-5, 1) < math.sqrt(2 * math.log(1.25 / 1e-5)) / 0.5
    # RDP of R Gaussian releases is R a / (2 z^2); the classic conversion bounds what the accountant says
    z, r, delta = calibrate(2.0, 1e-5, 101), 101, 1e-5
    classic = min(r * a / (2 * z * z) + math.log(1 / delta) / (a - 1) for a in np.linspace(1.01, 200, 20000))
    assert epsilon_spent(z, r, delta) <= classic + 1e-9
    assert calibrate(2.0, 1e-5, 10) < calibrate(2.0, 1e-5, 100)        # more releases, more noise


def test_mechanisms_clip_and_noise_at_the_stated_scale():
    p = Privacy(1.0, 1e-5, 0.5, "seeded", 5, 3.0)
    g = torch.Generator().manual_seed(0)
    h = torch.full((20_000,), 50.0, dtype=torch.float64)
    out = p.label_counts(h, g)
    assert (out >= 0).all() and float((out - h).std()) == pytest.approx(3.0, rel=0.03)
    sums, counts = torch.zeros(10, 2000, dtype=torch.float64), torch.full((10,), 1e9, dtype=torch.float64)
    protos, n = p.prototype_sums(sums, counts, g)
    std = 3.0 * math.sqrt(0.5 ** 2 + 1)
    assert float((protos * n[:, None]).std()) == pytest.approx(std, rel=0.03)
    # released counts are clamped at 0: classes the client lacks come back as 0, never negative
    f64 = torch.float64
    _, n0 = p.prototype_sums(torch.zeros(200, 2, dtype=f64), torch.zeros(200, dtype=f64), g)
    assert float(n0.min()) == 0.0 and 50 < int((n0 == 0).sum()) < 150
    z = torch.tensor([[3.0, 4.0], [0.3, 0.4]], dtype=torch.float64)
    assert torch.allclose(clip_rows(z, 1.0), torch.tensor([[0.6, 0.8], [0.3, 0.4]], dtype=torch.float64))


class _Trainer:
    """Two clients with known 2-d features: client 0 has class 0 at (30, 40) x 3 and class 1 at (0, 1)."""

    def data(self, client, split):
        y = torch.tensor([0, 0, 0, 1]) if client == 0 else torch.tensor([1, 1])
        return torch.zeros(len(y), 1), y

    def features(self, params, x):
        feats = torch.tensor([[30.0, 40.0]] * 3 + [[0.0, 1.0]]) if len(x) == 4 else torch.tensor([[0.0, 2.0]] * 2)
        return feats[None]


class _Ctx:
    seed = 0

    def __init__(self, privacy):
        self.privacy = privacy


def test_private_prototypes_are_clipped_then_noised():
    t, S, w = _Trainer(), np.array([0, 1]), torch.zeros(2, 1)
    exact, n = local_prototypes(t, S, w, 2)
    assert torch.allclose(exact[0], torch.tensor([[30.0, 40.0], [0.0, 1.0]])) and n.tolist() == [[3, 1], [0, 2]]
    quiet = Privacy(1e9, 1e-5, 1.0, "seeded", 2, 1e-9)                    # clipping without noise
    p, m = local_prototypes(t, S, w, 2, _Ctx(quiet), rnd=0)
    assert torch.allclose(p[0], torch.tensor([[0.6, 0.8], [0.0, 1.0]]), atol=1e-6)
    assert torch.allclose(p[1, 1], torch.tensor([0.0, 1.0]), atol=1e-6)   # (0, 2) clipped to norm 1
    assert torch.allclose(m, n, atol=1e-6)
    loud = Privacy(1.0, 1e-5, 1.0, "seeded", 2, 5.0)
    a, _ = local_prototypes(t, S, w, 2, _Ctx(loud), rnd=0)
    b, _ = local_prototypes(t, S, w, 2, _Ctx(loud), rnd=0)
    c, _ = local_prototypes(t, S, w, 2, _Ctx(loud), rnd=1)
    assert torch.equal(a, b) and not torch.equal(a, c)                   # seeded per round and client
    sysn = Privacy(1.0, 1e-5, 1.0, "system", 2, 5.0)
    d, _ = local_prototypes(t, S, w, 2, _Ctx(sysn), rnd=0)
    e, _ = local_prototypes(t, S, w, 2, _Ctx(sysn), rnd=0)
    assert not torch.equal(d, e)                                         # OS entropy: never the same


def test_a_private_run_stores_the_epsilon_it_spent(tmp_path):
    cfg = resolve({**TINY, "privacy.epsilon": 4.0})
    exp = Experiment(cfg, Store(tmp_path / "p.db"))
    hist = exp.fed.label_hist()
    assert exp.ctx.privacy.releases == 1 + 3 and not np.array_equal(exp.ctx.label_hist, hist)
    res = exp.run()
    f = res.final
    assert f["dp_target_epsilon"] == 4.0 and f["dp_delta"] == 1e-5
    assert f["dp_noise_multiplier"] == pytest.approx(calibrate(4.0, 1e-5, 4))
    # the most-sampled client (2 clients of 4 per round, 3 rounds) spent its label release + its rounds
    times = np.zeros(4, int)
    from fedprism.experiment.runner import sample_clients
    for r in range(3):
        times[sample_clients(2, r, 4, 0.5)] += 1
    assert f["dp_epsilon"] == pytest.approx(epsilon_spent(f["dp_noise_multiplier"], 1 + int(times.max()), 1e-5))
    assert f["dp_epsilon"] <= 4.0
    plain = Experiment(resolve(TINY), Store(tmp_path / "q.db"))
    assert plain.ctx.privacy is None and np.array_equal(plain.ctx.label_hist, hist)
    assert "dp_epsilon" not in plain.run().final
    from fedprism.report import collect, tables
    md, _ = tables(collect(Store(tmp_path / "p.db")))
    assert "## Differential privacy" in md and f"| {f['dp_epsilon']:.3f} |" in md
    assert "Differential privacy" not in tables(collect(Store(tmp_path / "q.db")))[0]
    # a method that shares no prototypes releases only its label counts: one release
    fedavg = Experiment(resolve({**TINY, "method": "fedavg", "privacy.epsilon": 4.0}), Store(tmp_path / "r.db"))
    assert fedavg.ctx.privacy.releases == 1


@pytest.mark.parametrize("bad", [{"privacy.epsilon": -1}, {"privacy.epsilon": float("inf")}, {"privacy.delta": 0},
                                 {"privacy.delta": 1.5}, {"privacy.clip": 0}, {"privacy.noise": "dice"}])
def test_bad_privacy_settings_name_the_key(bad):
    with pytest.raises(ConfigError) as e:
        resolve({**TINY, **bad})
    assert e.value.key == next(iter(bad))


def test_flower_nodes_release_what_the_simulator_releases(tmp_path, task_identity):
    """FedProto with privacy.epsilon on Flower nodes (seeded noise) gives the in-process run's prototypes
    bit for bit; the label counts the server sees are the nodes' Gaussian releases, made once."""
    from fedprism.flower.server_app import serve

    exp = ("method=fedproto dataset=digits clients=4 rounds=2 fraction=1.0 local_epochs=1 lr=0.05 model=mlp "
           "device=cpu engine=sequential partition.alpha=0.5 seed=3 privacy.epsilon=3.0")
    ref, final = in_process(exp, tmp_path / "ref.db")
    rc = run_config(exp, tmp_path / "fl.db", save_final=str(tmp_path / "final.pt"))
    res = serve(FakeGrid(nodes_for(4), rc), rc)
    got = torch.load(tmp_path / "final.pt", weights_only=False)
    assert_same_state(ref.state, got["state"], atol=0)
    assert res.final["dp_epsilon"] == pytest.approx(final["dp_epsilon"]) and res.final["dp_epsilon"] <= 3.0
    with pytest.raises(ConfigError, match="stats-epsilon"):
        from fedprism.flower.settings import RunSettings
        RunSettings.from_run_config({**rc, "stats-epsilon": 1.0})


def test_every_method_that_uploads_prototypes_plans_their_releases(tmp_path):
    """A method whose upload holds class prototypes must declare `shares_prototypes`, so that
    `privacy.epsilon` budgets one release per round for them (and releases them through the DP path)."""
    from fedprism.algorithms import REGISTRY
    for name in sorted(m for m in REGISTRY if not m.startswith("test_")):
        exp = Experiment(resolve({**TINY, "method": name, "clients": 12}), Store(tmp_path / f"{name}.db"))
        sends = "protos" in exp.algo.upload()
        assert sends == type(exp.algo).shares_prototypes, name
