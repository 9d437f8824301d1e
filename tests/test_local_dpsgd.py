"""Local DP-SGD through Opacus (`dp.local=dpsgd`, fedprism.local_dp): per-sample clipping by hand, the noise's
stream and scale (Opacus' convention: N(0, (z C)^2) on the sum of the clipped per-sample gradients, divided by
the expected batch size), the epsilon stored per round and at the end against Opacus' RDP accountant (and
dp-accounting's), the steps per client, the refusals, and nothing changed while it is off."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedprism.errors import ConfigError
from fedprism.experiment.config import resolve
from fedprism.experiment.runner import Experiment
from fedprism.experiment.store import Store
from fedprism.local_dp import LocalDPSGD, check_model, rdp_epsilon
from fedprism.seeds import stream_seed

EXP = dict(method="fedavg", dataset="digits", model="mlp", clients=4, rounds=2, fraction=0.5, local_epochs=1,
           lr=0.05, engine="sequential", device="cpu", seed=2, keep_final=False)
DP = {"dp.local": "dpsgd", "dp.local_clip": 0.7, "dp.local_noise": 1.1, "dp.local_delta": 1e-4}


def _experiment(tmp_path, name="r.db", **kw) -> Experiment:
    return Experiment(resolve({**EXP, **kw}), Store(tmp_path / name))


def _one_step(e: Experiment, dp: LocalDPSGD, rows: torch.Tensor, client: int = 0):
    """One DP-SGD step (q = 1: the whole of `rows` is the batch) of plain SGD with lr 1 from the run's
    initial model: returns (w0, w1)."""
    cfg = dataclasses.replace(e.engine.cfg, lr=1.0, momentum=0.0, weight_decay=0.0, batch_size=10_000)
    w0 = e.ctx.init.clone()
    w1, _, steps = dp.train(e.engine, w0.clone(), rows, 1, "ce", {}, cfg, client, 0, "train", None)
    assert steps == 1
    return w0, w1


def _per_sample_grads(e: Experiment, w: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[n, P] gradient of each sample's cross-entropy, one backward per sample."""
    out = []
    for i in rows:
        x, y = e.engine.fed.x_train[i : i + 1], e.engine.fed.y_train[i : i + 1]
        wr = w.detach().clone().requires_grad_(True)
        (g,) = torch.autograd.grad(F.cross_entropy(e.engine.f(wr, x), y), wr)
        out.append(g)
    return torch.stack(out)


# -- the mechanism, by hand ----------------------------------------------------------------------------------
def test_per_sample_clipping_by_hand(tmp_path):
    """Without noise, one step of lr 1 on n samples moves w by -(sum_j g_j min(1, C / (||g_j|| + 1e-6))) / n:
    the per-sample gradients computed one backward at a time, clipped by hand (every clipped norm <= C, some
    clipped, some not), summed. A batch of one sample moves w by a vector of norm exactly min(||g||, C)."""
    e = _experiment(tmp_path)
    rows = e.engine._train_idx[0][:9]
    C = 2.8                                     # the per-sample norms are 2.4 to 3.1 here
    w0, w1 = _one_step(e, LocalDPSGD(clip=C, noise=0.0, delta=1e-5, seed=2), rows)
    g = _per_sample_grads(e, w0, rows)
    norms = g.norm(dim=1)
    assert (norms > C).any() and (norms < C).any()                  # both branches of the clip taken
    clipped = g * (C / (norms + 1e-6)).clamp(max=1.0)[:, None]
    assert (clipped.norm(dim=1) <= C + 1e-6).all()
    assert torch.allclose(w0 - w1, clipped.sum(0) / len(rows), atol=1e-6, rtol=1e-5)
    assert not torch.allclose(w0 - w1, g.mean(0), atol=1e-4)           # the clipping did something
    big = int(norms.argmax())
    w0, w1 = _one_step(e, LocalDPSGD(clip=C, noise=0.0, delta=1e-5, seed=2), rows[big : big + 1])
    nb = float(norms[big])
    assert float((w0 - w1).norm()) == pytest.approx(C * nb / (nb + 1e-6), rel=1e-5)


def test_proximal_gradient_is_added_after_privatisation(tmp_path):
    """FedProx's and Ditto's penalty mu/2 ||w - anchor||^2 reads no sample: its gradient mu (w - anchor) is
    added to the privatised one, unclipped. One step of lr 1 with anchor w0 + 1 moves w by mu more than the
    cross-entropy step alone."""
    e = _experiment(tmp_path)
    rows = e.engine._train_idx[0][:6]
    cfg = dataclasses.replace(e.engine.cfg, lr=1.0, momentum=0.0, weight_decay=0.0, batch_size=10_000)
    dp = LocalDPSGD(clip=0.1, noise=0.0, delta=1e-5, seed=2)
    w0 = e.ctx.init.clone()
    ce = dp.train(e.engine, w0.clone(), rows, 1, "ce", {}, cfg, 0, 0, "train", None)[0]
    extras = {"anchor": w0 + 1.0, "mu": torch.tensor(0.3)}
    prox = dp.train(e.engine, w0.clone(), rows, 1, "prox", extras, cfg, 0, 0, "train", None)[0]
    assert torch.allclose(prox - ce, torch.full_like(ce, 0.3), atol=1e-5)


def test_noise_is_opacus_seeded_stream_with_std_zc_over_batch(tmp_path):
    """The noise of a step is N(0, (z C)^2) per coordinate of the clipped sum, drawn by Opacus from the stream
    (run seed, round, client, 'dpsgd_noise:<stream>') parameter by parameter, then divided by the expected
    batch size n (here q = 1, so n): std z C / n on the gradient."""
    e = _experiment(tmp_path)
    rows = e.engine._train_idx[1][:5]
    z, C = 3.0, 0.4
    w0, quiet = _one_step(e, LocalDPSGD(clip=C, noise=0.0, delta=1e-5, seed=2), rows, client=1)
    _, noisy = _one_step(e, LocalDPSGD(clip=C, noise=z, delta=1e-5, seed=2), rows, client=1)
    noise = (quiet - noisy) * len(rows)                                 # the noise on the sum
    gen = torch.Generator().manual_seed(stream_seed(2, 0, 1, "dpsgd_noise:train"))
    want = torch.cat([torch.normal(0.0, z * C, size=shape, generator=gen).reshape(-1)
                      for shape in e.engine.spec.shapes])
    assert torch.allclose(noise, want, atol=1e-4, rtol=1e-4)
    assert float(noise.std()) == pytest.approx(z * C, rel=0.05) and abs(float(noise.mean())) < 0.05 * z * C
    again = _one_step(e, LocalDPSGD(clip=C, noise=z, delta=1e-5, seed=2), rows, client=1)[1]
    assert torch.equal(again, noisy)                                    # seeded: the same draw
    other = _one_step(e, LocalDPSGD(clip=C, noise=z, delta=1e-5, seed=3), rows, client=1)[1]
    assert not torch.equal(other, noisy)


# -- accounting ----------------------------------------------------------------------------------------------
def _opacus(z, q, steps, delta):
    from opacus.accountants import RDPAccountant

    acc = RDPAccountant()
    for _ in range(steps):
        acc.step(noise_multiplier=z, sample_rate=q)
    return acc.get_epsilon(delta)


def _dp_accounting(z, q, steps, delta):
    from dp_accounting import dp_event, rdp

    acc = rdp.RdpAccountant()
    ev = dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(z))
    acc.compose(dp_event.SelfComposedDpEvent(ev, steps))
    return acc.get_epsilon(delta)


@pytest.mark.parametrize("method", ["fedavg", "ditto"])
def test_stored_epsilon_is_the_accountants(method, tmp_path):
    """Each client takes E ceil(n_i / B) steps per training at q_i = B / n_i (Ditto: its global and its
    personal phase); the epsilon stored per round (max and mean over the clients trained so far) and at the
    end is Opacus' RDP accountant's for those steps, q_i, z and delta, and within 2 % of dp-accounting's."""
    e = _experiment(tmp_path, method=method, rounds=3, **DP)
    res = e.run()
    B = e.cfg["batch_size"]
    per_training = 1 + ((e.cfg["ditto.personal_epochs"] or 1) if method == "ditto" else 0)   # None: E
    steps: dict[int, int] = {}
    hist = e.store.round_metrics(e.run_id)
    recs = e.store.records(e.run_id, "dpsgd_steps")
    assert [r["round"] for r in recs] == [0, 1, 2]
    for h, rec in zip(hist, recs):
        d = rec["data"]
        for c, k, q in zip(d["clients"], d["steps"], d["q"]):
            n = len(e.engine._train_idx[c])
            assert k == per_training * math.ceil(n / B) and q == pytest.approx(B / n, rel=1e-12)
            steps[c] = steps.get(c, 0) + k
        eps = [_opacus(1.1, B / len(e.engine._train_idx[c]), k, 1e-4) for c, k in steps.items()]
        assert h["dpsgd_epsilon_max"] == pytest.approx(max(eps), rel=1e-12)
        assert h["dpsgd_epsilon_mean"] == pytest.approx(np.mean(eps), rel=1e-12)
        assert h["dpsgd_steps"] == sum(d["steps"])
    f = res.final
    assert f["dpsgd_epsilon_max"] == hist[-1]["dpsgd_epsilon_max"] and f["dpsgd_epsilon_max"] > 0
    assert (f["dpsgd_delta"], f["dpsgd_noise_multiplier"], f["dpsgd_clip"]) == (1e-4, 1.1, 0.7)
    assert f["dpsgd_steps"] == sum(steps.values())
    c = max(steps, key=lambda c: rdp_epsilon(1.1, B / len(e.engine._train_idx[c]), steps[c], 1e-4))
    q = B / len(e.engine._train_idx[c])
    assert f["dpsgd_epsilon_max"] == pytest.approx(_dp_accounting(1.1, q, steps[c], 1e-4), rel=0.02)


def test_accountant_edges():
    assert rdp_epsilon(1.0, 0.1, 0, 1e-5) == 0.0 and rdp_epsilon(0.0, 0.1, 5, 1e-5) == math.inf
    eps = [rdp_epsilon(z, 0.05, 200, 1e-5) for z in (0.6, 1.0, 2.0, 4.0)]
    assert eps == sorted(eps, reverse=True)
    assert rdp_epsilon(1.0, 0.05, 400, 1e-5) > rdp_epsilon(1.0, 0.05, 200, 1e-5)


def test_every_qualifying_method_runs(tmp_path):
    for method in ("fedprox", "local"):
        e = _experiment(tmp_path, f"{method}.db", method=method, rounds=1, **DP)
        res = e.run()
        assert res.status == "finished" and res.final["dpsgd_epsilon_max"] > 0
        assert e.engine.local_dp is not None and type(e.engine).__name__ == "SequentialEngine"


def test_engine_auto_builds_the_sequential_loop(tmp_path, monkeypatch):
    """engine=auto asks make_engine for the sequential loop (the vectorized engine has no DP-SGD step)."""
    import fedprism.experiment.build as build

    asked = []
    real = build.make_engine
    monkeypatch.setattr(build, "make_engine", lambda name, *a, **k: asked.append(name) or real(name, *a, **k))
    e = _experiment(tmp_path, "auto.db", engine="auto", rounds=1, **DP)
    assert asked == ["sequential"] and type(e.engine).__name__ == "SequentialEngine"
    _experiment(tmp_path, "plain.db", engine="auto", rounds=1)
    assert asked == ["sequential", "auto"]                               # off: as before


# -- refusals ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method,why", [("scaffold", "control variates"), ("fedper", "mask"),
                                        ("moon", "contrastive"), ("fedproto", "prototypes"),
                                        ("pfedme", "Moreau")])
def test_methods_without_plain_local_sgd_are_refused(method, why):
    with pytest.raises(ConfigError, match=why) as e:
        resolve({**EXP, "method": method, **DP})
    assert e.value.key == "dp.local" and f"method={method}" in str(e.value)


def test_other_refusals():
    with pytest.raises(ConfigError, match="sequential") as e:
        resolve({**EXP, **DP, "engine": "vectorized"})
    assert e.value.key == "engine"
    with pytest.raises(ConfigError, match="BatchNorm") as e:
        check_model(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)), "bn_mlp")
    assert e.value.key == "model"
    from fedprism.flower.settings import check_flower_config
    with pytest.raises(ConfigError, match="in-process") as e:
        check_flower_config(resolve({**EXP, **DP}))
    assert e.value.key == "dp.local"
    with pytest.raises(ConfigError, match="dp.local_clip"):
        resolve({**EXP, **DP, "dp.local_clip": 0})


# -- off: nothing changes ------------------------------------------------------------------------------------
def test_off_leaves_ids_and_numbers_unchanged(tmp_path):
    plain = resolve(EXP)
    explicit = resolve({**EXP, "dp.local": "none", "dp.local_clip": 1.0, "dp.local_noise": 1.0,
                        "dp.local_delta": 1e-5})
    assert plain.run_id == explicit.run_id and plain.train_id == explicit.train_id
    assert not any(k.startswith("dp.local") for k in plain.identity)
    assert resolve({**EXP, **DP}).run_id != plain.run_id
    a, b = _experiment(tmp_path, "a.db"), Experiment(explicit, Store(tmp_path / "b.db"))
    ra, rb = a.run(), b.run()
    assert a.engine.local_dp is None and torch.equal(a.state["w"], b.state["w"])
    assert ra.final["global_acc"] == rb.final["global_acc"]
    assert not any(k.startswith("dpsgd") for k in ra.final)
    assert not any("dpsgd_steps" in h for h in a.store.round_metrics(a.run_id))


def test_resumed_run_accounts_for_the_rounds_before(tmp_path):
    """A run stopped after round 1 and resumed in a new process (a fresh engine, whose step counts start
    empty) rebuilds them from the stored `dpsgd_steps` records: its epsilons and its model are the
    uninterrupted run's."""
    whole = _experiment(tmp_path, "whole.db", rounds=3, **DP)
    ref = whole.run()
    c = resolve({**EXP, "rounds": 3, **DP})
    s = Store(tmp_path / "cut.db")
    Experiment(c, s).run(stop_after=1)
    again = Experiment(c, s)
    res = again.run()
    assert again.engine.local_dp.next_round == 3 and torch.equal(again.state["w"], whole.state["w"])
    for k in ("dpsgd_epsilon_max", "dpsgd_epsilon_mean", "dpsgd_steps"):
        want = [h[k] for h in whole.store.round_metrics(whole.run_id)]
        assert [h[k] for h in s.round_metrics(c.run_id)] == want
        assert res.final[k] == ref.final[k]


def test_report_table():
    from fedprism.report import local_dpsgd_table

    f = {"dpsgd_clip": 1.0, "dpsgd_noise_multiplier": 1.1, "dpsgd_q_min": 0.05, "dpsgd_q_max": 0.2,
         "dpsgd_delta": 1e-5, "dpsgd_epsilon_max": 3.456, "dpsgd_epsilon_mean": 2.0, "global_acc": 0.5,
         "local_acc": 0.25}
    md = local_dpsgd_table({"S": {"fedavg": [{"final": f, "config": {"seed": 0}},
                                             {"final": {"global_acc": 0.9}, "config": {"seed": 1}}]}})
    assert md[0] == "## Local DP-SGD" and len([l for l in md if l.startswith("| fedavg")]) == 1
    assert "| fedavg | S | 0 | 1 | 1.1 | 0.05-0.2 | 1e-05 | 3.46 | 2 | 0.5000 | 0.2500 |" in md
    f0 = {k: v for k, v in f.items() if not k.startswith("dpsgd_epsilon")}          # z = 0: inf
    assert "| inf | inf |" in local_dpsgd_table({"S": {"a": [{"final": f0, "config": {"seed": 0}}]}})[-2]


def _contrastive(f, w, x, y, ones, extras):      # a Loss callable: another objective than ce and prox
    return F.cross_entropy(f(w, x), y)


def test_the_engine_refuses_a_job_that_is_not_plain_training(tmp_path):
    """The sequential engine checks each job under DP-SGD: another objective, a mask or other extras raise
    (a qualifying method that changed), before any client trains."""
    from fedprism.protocol import TrainJob

    e = _experiment(tmp_path, **DP)
    start = e.ctx.init.expand(1, -1).clone()
    one = np.array([0])
    for job in (TrainJob(one, start, loss=_contrastive), TrainJob(one, start, mask=torch.ones_like(start[0])),
                TrainJob(one, start, loss="prox", extras={"anchor": start, "mu": torch.ones(1), "c": start})):
        with pytest.raises(RuntimeError, match="plain local training"):
            e.engine.train(job, 0)
    assert e.engine.local_dp.steps == {}
    e.engine.train(TrainJob(np.array([0]), start), 0)                    # plain: trains
    assert e.engine.local_dp.steps == {0: math.ceil(len(e.engine._train_idx[0]) / e.cfg["batch_size"])}
