"""DP-FedAvg (client-level DP on model updates, `dp.*`, fedprism.privacy.UpdateDP): clipping by hand, the noise
and its calibration against dp-accounting, every averaging method through the shared server step, the
refusals, DP off changing nothing, and Flower equal to the in-process run with seeded noise."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedprism.errors import ConfigError
from fedprism.experiment.config import resolve
from fedprism.experiment.runner import Experiment
from fedprism.experiment.store import Store
from fedprism.privacy import UpdateDP, dpfedavg_epsilon
from fedprism.seeds import stream_seed

import test_flower as tf                       # the in-process Flower grid (FakeGrid) and its fixtures
from test_flower import offline, task_identity  # noqa: F401 (fixtures)

EXP = dict(method="fedavg", dataset="digits", model="mlp", clients=4, rounds=3, fraction=0.5, local_epochs=1,
           lr=0.05, engine="sequential", device="cpu", seed=2, keep_final=False)


def _run(tmp_path, name="r.db", **kw):
    e = Experiment(resolve({**EXP, **kw}), Store(tmp_path / name))
    res = e.run()
    return e, res


# -- the mechanism, by hand -------------------------------------------------------------------------------
def test_clipping_by_hand_on_two_clients():
    """Two clients sent w: updates (3, 4) (norm 5, clipped to 1: (0.6, 0.8)) and (0.3, 0) (norm 0.3, kept);
    without noise the new model is w + the mean of the clipped updates, whatever the sample counts."""
    dp = UpdateDP(clip=1.0, z=0.0, delta=1e-5)
    w = torch.tensor([1.0, -2.0])
    x = torch.stack([w + torch.tensor([3.0, 4.0]), w + torch.tensor([0.3, 0.0])])
    got = dp.aggregate(x, torch.tensor([10.0, 990.0]), w.expand(2, -1))
    want = torch.tensor([1.0 + (0.6 + 0.3) / 2, -2.0 + 0.8 / 2], dtype=torch.float64)
    assert torch.allclose(got, want, atol=1e-6, rtol=0)
    # rows that are already updates (sent None); a row of weight 0 takes no part
    got = dp.aggregate(torch.tensor([[3.0, 4.0], [0.3, 0.0], [100.0, 0.0]]), torch.tensor([1.0, 1.0, 0.0]), None)
    assert torch.allclose(got, torch.tensor([0.45, 0.4], dtype=torch.float64), atol=1e-7, rtol=0)
    assert dp.releases == 2


def test_two_client_federation_is_the_clipped_mean(tmp_path):
    """A FedAvg round of two clients with dp.clip below their update norms and no noise: the new global
    model is the sent model plus the mean of the two clipped updates, computed by hand from their uploads."""
    from fedprism.experiment.runner import Simulator

    e = Experiment(resolve({**EXP, "clients": 2, "fraction": 1.0, "dp.clip": 0.05, "dp.noise_multiplier": 0.0}),
                   Store(tmp_path / "s.db"))
    sim = Simulator(e.algo, e.engine)
    w0 = sim.state["w"].clone()
    plan, update, _ = sim.round(0, np.array([0, 1]))
    u = update.params.double() - w0.double()
    assert (u.norm(dim=1) > 0.05).all()                        # both clipped
    want = w0.double() + (u * (0.05 / u.norm(dim=1, keepdim=True))).mean(0)
    assert torch.allclose(sim.state["w"].double(), want, atol=1e-6, rtol=0)
    assert float((sim.state["w"].double() - w0.double()).norm()) <= 0.05 + 1e-6


def test_noise_is_the_seeded_stream_with_std_z_clip():
    """Zero updates: the average is the noise / n, drawn from the stream (seed, round, 'dp_update:<i>'), std
    z C per coordinate of the sum."""
    dp = UpdateDP(clip=2.0, z=0.7, delta=1e-5, seed=11)
    dp.begin_round(4)
    P, n = 200_000, 5
    got = dp.aggregate(torch.zeros(n, P), torch.ones(n), None)
    g = torch.Generator().manual_seed(stream_seed(11, 4, 0, "dp_update:0"))
    assert torch.equal(got, 0.7 * 2.0 * torch.randn(P, generator=g, dtype=torch.float64) / n)
    assert float((got * n).std()) == pytest.approx(1.4, rel=0.01)
    second = dp.aggregate(torch.zeros(n, P), torch.ones(n), None)     # the round's next release: another draw
    assert not torch.equal(got, second) and dp.releases == 2
    dp.begin_round(4)                                                  # the same round again: the same noise
    assert torch.equal(dp.aggregate(torch.zeros(n, P), torch.ones(n), None), got)


# -- calibration against the accountant ---------------------------------------------------------------------
def _dp_accounting(z, q, steps, delta, pld=False, fixed=None):
    from dp_accounting import dp_event, pld as pldm, privacy_accountant as pa, rdp

    if fixed is not None:
        ev = dp_event.SampledWithoutReplacementDpEvent(fixed[0], fixed[1], dp_event.GaussianDpEvent(z))
        acc = rdp.RdpAccountant(neighboring_relation=pa.NeighboringRelation.REPLACE_ONE)
    else:
        ev = dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(z))
        acc = pldm.PLDAccountant() if pld else rdp.RdpAccountant()
    acc.compose(dp_event.SelfComposedDpEvent(ev, steps))
    return acc.get_epsilon(delta)


def test_stored_epsilon_is_dp_accountings(tmp_path):
    """The epsilon a run stores (per round and final) is dp-accounting's RDP epsilon of Poisson sampling at
    q = cohort / clients composed over the rounds so far, at dp.target_delta; PLD and sampling without
    replacement likewise."""
    e, res = _run(tmp_path, **{"dp.clip": 1.0, "dp.noise_multiplier": 1.3, "dp.target_delta": 1e-4})
    hist = e.store.round_metrics(e.run_id)
    assert [h["dpfedavg_releases"] for h in hist] == [1, 1, 1] and [h["dpfedavg_q"] for h in hist] == [0.5] * 3
    for t, h in enumerate(hist):
        assert h["dpfedavg_epsilon"] == pytest.approx(_dp_accounting(1.3, 0.5, t + 1, 1e-4), rel=1e-12)
    f = res.final
    assert f["dpfedavg_epsilon"] == pytest.approx(_dp_accounting(1.3, 0.5, 3, 1e-4), rel=1e-12)
    assert (f["dpfedavg_delta"], f["dpfedavg_noise_multiplier"], f["dpfedavg_clip"], f["dpfedavg_q"]) == \
        (1e-4, 1.3, 1.0, 0.5)
    assert dpfedavg_epsilon(1.3, [(0.5, 1)] * 7, 1e-5, "pld") == pytest.approx(
        _dp_accounting(1.3, 0.5, 7, 1e-5, pld=True), rel=1e-12)
    assert dpfedavg_epsilon(1.3, [(0.5, 1)] * 7, 1e-5, sampling="fixed", clients=20, cohort=10) == pytest.approx(
        _dp_accounting(1.3, None, 7, 1e-5, fixed=(20, 10)), rel=1e-12)
    # r releases about one client in a round compose to one Gaussian of multiplier z / sqrt(r)
    assert dpfedavg_epsilon(2.0, [(0.5, 4)] * 3, 1e-5) == pytest.approx(_dp_accounting(1.0, 0.5, 3, 1e-5), rel=1e-12)
    assert dpfedavg_epsilon(0.0, [(0.5, 1)], 1e-5) == math.inf and dpfedavg_epsilon(1.0, [(0.5, 0)], 1e-5) == 0.0


def test_more_noise_spends_less():
    eps = [dpfedavg_epsilon(z, [(0.1, 1)] * 50, 1e-5) for z in (0.5, 1.0, 2.0, 4.0)]
    assert eps == sorted(eps, reverse=True) and eps[-1] < 1


# -- every averaging method, and the refusals ------------------------------------------------------------------
@pytest.mark.parametrize("method,extra", [("fedprox", {}), ("ditto", {}), ("fedrep", {}), ("fedper", {}),
                                          ("fedavg", {"fedavg.server_opt": "adam"})])
def test_methods_that_average_run_under_dp(method, extra, tmp_path):
    e, res = _run(tmp_path, method=method, **{"dp.clip": 0.5, "dp.noise_multiplier": 0.8}, **extra)
    hist = e.store.round_metrics(e.run_id)
    assert res.status == "finished" and all(h["dpfedavg_releases"] >= 1 for h in hist)
    assert res.final["dpfedavg_epsilon"] > 0


@pytest.mark.parametrize("kw,match", [
    ({"method": "local"}, "averages no models"),
    ({"method": "fedproto"}, "averages no models"),
    ({"fedavg.aggregation": "median"}, "aggregation=mean"),
    ({"dp.accountant": "pld", "dp.sampling": "fixed"}, "poisson"),
    ({"method": "scaffold"}, "delta_c"),
    ({"method": "ifca", "ifca.k": 2}, "cluster, params"),
    ({"method": "fedprism", "fedprism.k": 2}, "soft cluster"),
])
def test_dp_is_refused_where_it_cannot_bound_a_client(kw, match, tmp_path):
    with pytest.raises(ConfigError, match=match) as e:
        _run(tmp_path, **{"dp.clip": 1.0, **kw})
    assert e.value.key in ("dp.clip", "dp.sampling")


# -- DP off: nothing changes ---------------------------------------------------------------------------------
def test_dp_and_compression_off_leave_ids_and_numbers_unchanged(tmp_path):
    plain = resolve(EXP)
    explicit = resolve({**EXP, "dp.clip": 0.0, "dp.noise_multiplier": 1.0, "dp.target_delta": 1e-5,
                        "dp.accountant": "rdp", "dp.sampling": "poisson", "compress": "none",
                        "compress.k": 0.01, "compress.bits": 4, "compress.feedback": "auto"})
    assert plain.run_id == explicit.run_id and plain.train_id == explicit.train_id
    assert not any(k.startswith(("dp.", "compress")) for k in plain.identity)
    a, ra = _run(tmp_path, "a.db")
    b = Experiment(explicit, Store(tmp_path / "b.db"))
    rb = b.run()
    assert ra.final["global_acc"] == rb.final["global_acc"] and torch.equal(a.state["w"], b.state["w"])
    assert not any(k.startswith("dpfedavg") for k in ra.final)
    assert a.ctx.dp is None and a.ctx.compress is None
    assert [h["bytes_up"] for h in a.store.round_metrics(a.run_id)] == \
        [h["bytes_up"] for h in b.store.round_metrics(b.run_id)]


# -- Flower ----------------------------------------------------------------------------------------------------
def test_flower_equals_in_process_with_seeded_dp_noise(tmp_path, task_identity):
    """The ServerApp (over the in-process grid of tests/test_flower.py) adds the same seeded noise as the
    in-process run: the same final model, the same epsilon per round."""
    from fedprism.flower.server_app import serve

    exp = ("method=fedavg dataset=digits clients=4 rounds=2 fraction=0.5 local_epochs=1 lr=0.05 model=mlp "
           "device=cpu engine=sequential seed=4 dp.clip=0.5 dp.noise_multiplier=0.9")
    ref, final = tf.in_process(exp, tmp_path / "ref.db")
    rc = tf.run_config(exp, tmp_path / "fl.db", save_final=str(tmp_path / "final.pt"))
    res = serve(tf.FakeGrid(tf.nodes_for(4), rc), rc)
    assert res.status == "finished"
    got = torch.load(tmp_path / "final.pt", weights_only=False)
    assert torch.equal(got["state"]["w"], ref.state["w"])
    fl = Store(tmp_path / "fl.db").round_metrics(res.run_id)
    assert [h["dpfedavg_epsilon"] for h in fl] == [h["dpfedavg_epsilon"] for h in ref.store.round_metrics(ref.run_id)]
    assert res.final["dpfedavg_epsilon"] == final["dpfedavg_epsilon"]


def test_flower_server_side_fixed_clipping_is_the_same_mechanism():
    """Flower's own wrapper, DifferentialPrivacyServerSideFixedClipping around FedAvg, clips each update to
    the clipping norm, averages with the inner strategy (sample-weighted: equal counts here, as DP-FedAvg
    counts each client once) and adds N(0, (z C / m)^2) to the average, m the sampled clients. Without noise
    its new model is UpdateDP's, and its noise std (`compute_stdv`) is ours on the average."""
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg
    from flwr.supercore.differential_privacy import compute_stdv

    rng = np.random.default_rng(0)
    w = rng.normal(size=7).astype(np.float32)
    rows = [w + rng.normal(scale=s, size=7).astype(np.float32) for s in (0.1, 2.0, 5.0)]
    strategy = DifferentialPrivacyServerSideFixedClipping(FedAvg(), noise_multiplier=0.0, clipping_norm=1.5,
                                                          num_sampled_clients=3)
    strategy.current_round_params = [w.copy()]
    results = [(None, FitRes(Status(Code.OK, ""), ndarrays_to_parameters([r.copy()]), 50, {})) for r in rows]
    params, _ = strategy.aggregate_fit(1, results, [])
    flower = parameters_to_ndarrays(params)[0]
    ours = UpdateDP(clip=1.5, z=0.0, delta=1e-5).aggregate(torch.from_numpy(np.stack(rows)), torch.ones(3),
                                                            torch.from_numpy(w).expand(3, -1))
    assert np.allclose(ours.numpy(), flower, atol=1e-6, rtol=0)
    assert not np.allclose(np.mean(rows, axis=0), flower, atol=1e-3)      # the clipping did something
    assert compute_stdv(0.8, 1.5, 3) == pytest.approx(0.8 * 1.5 / 3)      # our noise's std on the average
