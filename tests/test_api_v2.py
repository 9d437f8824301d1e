"""The algorithm interface: declared uploads and client state, payload byte counts, open local training
(Adam, per-client masks), evaluation-only settings, plugins, layering."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import plugins.protostate  # noqa: F401 (registers the test-only method)
from fedprism.algorithms import REGISTRY
from fedprism.algorithms.base import ClientState, TensorSpec, TrainJob, Update, train_update
from fedprism.algorithms.fedavg import FedAvg
from fedprism.engine.base import LocalConfig, optimizer_state, optimizer_step
from fedprism.engine.sequential import SequentialEngine
from fedprism.engine.vectorized import VectorizedEngine
from fedprism.experiment.config import resolve
from fedprism.experiment.runner import Experiment, validate_update
from fedprism.experiment.store import Store
from fedprism.experiment.sweep import dump_sweep
from fedprism.models import build_model

ROOT = Path(__file__).resolve().parent.parent
SMALL = dict(dataset="digits", clients=6, rounds=2, fraction=0.5, local_epochs=1, batch_size=16, lr=0.05,
             model="mlp", engine="sequential", device="cpu", seed=1)


def cfg(**kw):
    return resolve({**SMALL, **{k.replace("__", "."): v for k, v in kw.items()}})


# -- uploads -----------------------------------------------------------------------------------------
def test_wrong_or_missing_payload_tensors_are_rejected_and_recorded():
    spec = {"params": TensorSpec((4,)), "cluster": TensorSpec((), torch.int32, low=0, high=3)}
    up = Update(np.array([5, 6, 7, 8]),
                {"params": torch.zeros(4, 4), "cluster": torch.tensor([0, 2, 3, 1], dtype=torch.int32)},
                torch.tensor([1.0, 2.0, 3.0, float("nan")], dtype=torch.float64))
    up.payload["params"][0, 1] = float("inf")
    kept, bad = validate_update(up, spec)
    assert kept.clients.tolist() == [6] and sorted(bad) == [5, 7, 8]
    assert "non-finite" in bad[5] and "cluster" in bad[7] and "n_samples" in bad[8]
    wrong = Update(np.array([1, 2]), {"params": torch.zeros(2, 5)}, torch.ones(2, dtype=torch.float64))
    kept, bad = validate_update(wrong, {"params": TensorSpec((4,))})
    assert len(kept.clients) == 0 and "wrong shape (5,), expected (4,)" in bad[1]
    missing = Update(np.array([1, 2]), {"params": torch.zeros(2, 4)}, torch.ones(2, dtype=torch.float64))
    kept, bad = validate_update(missing, spec)
    assert len(kept.clients) == 0 and bad[2] == "missing tensor 'cluster'"
    extra = Update(np.array([3]), {"params": torch.zeros(1, 4), "cluster": torch.zeros(1, dtype=torch.int32),
                                   "spy": torch.zeros(1, 2)}, torch.ones(1, dtype=torch.float64))
    assert validate_update(extra, spec)[1] == {3: "unexpected tensor 'spy'"}
    wrong_dtype = Update(np.array([3]), {"params": torch.zeros(1, 4, dtype=torch.float64),
                                         "cluster": torch.zeros(1, dtype=torch.int32)}, torch.ones(1, dtype=torch.float64))
    assert "wrong dtype" in validate_update(wrong_dtype, spec)[1][3]
    # a bound holds for every entry of a row, not for the row as a whole
    counts = {"n": TensorSpec((3,), torch.int64, low=0)}
    rows = Update(np.array([1, 2]), {"n": torch.tensor([[2, 0, 5], [2, -1, 0]])},
                  torch.ones(2, dtype=torch.float64))
    kept, bad = validate_update(rows, counts)
    assert kept.clients.tolist() == [1] and bad == {2: "n: values below 0"}


def test_client_state_starts_from_its_declared_fill(tmp_path):
    ctx = Experiment(cfg(method="fedavg"), Store(tmp_path / "x.db")).ctx
    assert ClientState((2,), init=0.25).initial(ctx, 3).tolist() == [[0.25, 0.25]] * 3
    assert ClientState(("C",), init="zeros").initial(ctx, 1).tolist() == [[0.0] * ctx.num_classes]
    assert torch.equal(ClientState().initial(ctx, 2), ctx.init.expand(2, -1))


class BadShape(FedAvg):
    """FedAvg whose client 0 sends a vector one entry short."""

    name = "test_badshape"

    def client_update(self, plan, trainer, rnd, cstate):
        up = train_update(trainer, TrainJob(plan.clients, plan.start), rnd)
        if 0 in plan.clients:
            up.payload["params"] = up.payload["params"].clone()
            up.payload["params"][plan.clients == 0] = float("nan")
        return up


def test_a_rejected_row_is_recorded_and_the_run_goes_on(tmp_path):
    REGISTRY["test_badshape"] = BadShape
    try:
        c = cfg(method="test_badshape", fraction=1.0)
        store = Store(tmp_path / "r.db")
        res = Experiment(c, store).run()
        assert res.status == "finished"
        rec = store.records(c.run_id, "rejected")
        assert [r["client"] for r in rec] == [0, 0] and "params: non-finite" in rec[0]["data"]["reason"]
        assert [h["accepted"] for h in res.history] == [5, 5]
        P = Experiment(c, Store(tmp_path / "x.db")).ctx.spec.size
        assert [h["bytes_up"] for h in res.history] == [5 * 4 * P] * 2          # only accepted rows count
    finally:
        REGISTRY.pop("test_badshape")


class NoWeight(FedAvg):
    """FedAvg whose clients all report 0 training samples."""

    name = "test_noweight"

    def client_update(self, plan, trainer, rnd, cstate):
        up = train_update(trainer, TrainJob(plan.clients, plan.start), rnd)
        up.n_samples = torch.zeros_like(up.n_samples)
        return up


def test_replies_of_zero_samples_are_rejected_and_the_model_is_kept(tmp_path):
    """A reply of 0 samples has no weight (a Flower server refuses it the same way). When every client of
    a round says 0, the weighted mean had nothing to divide by and raised from inside the method."""
    REGISTRY["test_noweight"] = NoWeight
    try:
        c = cfg(method="test_noweight", fraction=1.0)
        store = Store(tmp_path / "r.db")
        e = Experiment(c, store)
        res = e.run()
        assert res.status == "finished" and [h["accepted"] for h in res.history] == [0, 0]
        rec = store.records(c.run_id, "rejected")
        assert len(rec) == 2 * c["clients"] and all("0 samples" in r["data"]["reason"] for r in rec)
        assert torch.equal(e.state["w"], e.ctx.init)                      # nothing was averaged in
    finally:
        REGISTRY.pop("test_noweight")


class NanState(REGISTRY["local"]):
    """Local whose client 0 returns a NaN model as its new state."""

    name = "test_nanstate"

    def client_update(self, plan, trainer, rnd, cstate):
        up = super().client_update(plan, trainer, rnd, cstate)
        up.client_state["w"][plan.clients == 0] = float("nan")
        return up


def test_a_client_whose_new_state_is_nan_is_rejected_and_keeps_its_state(tmp_path):
    """Client 0's NaN model is not kept (it holds its initial model, the others their trained ones), and
    its reply is a `rejected` record. It was stored as sent, and the run scored a NaN model."""
    REGISTRY["test_nanstate"] = NanState
    try:
        c = cfg(method="test_nanstate", fraction=1.0, rounds=1)
        store = Store(tmp_path / "r.db")
        e = Experiment(c, store)
        res = e.run()
        w = e.clients.rows(np.arange(c["clients"]))["w"]
        assert torch.equal(w[0], e.ctx.init)
        assert not any(torch.equal(w[k], e.ctx.init) for k in range(1, len(w)))
        assert bool(torch.isfinite(w).all())
        rec = store.records(c.run_id, "rejected")
        why = "client state 'w': non-finite values (NaN/Inf)"
        assert [(r["client"], r["data"]["reason"]) for r in rec] == [(0, why)]
        assert res.history[0]["accepted"] == c["clients"] - 1 and not res.final["diverged"]
    finally:
        REGISTRY.pop("test_nanstate")


class NanDitto(REGISTRY["ditto"]):
    """Ditto whose client 0 returns NaN as its personal model and its upload, client 1 as its personal
    model only."""

    name = "test_nanditto"

    def client_update(self, plan, trainer, rnd, cstate):
        up = super().client_update(plan, trainer, rnd, cstate)
        for k in up.client_state:
            up.client_state[k][np.isin(plan.clients, [0, 1])] = float("nan")
        up.payload["params"][plan.clients == 0] = float("nan")
        return up


def test_a_rejected_state_names_a_non_finite_upload_too(tmp_path):
    """The record tells a client whose whole local training diverged (state and upload) from one whose
    state alone did."""
    REGISTRY["test_nanditto"] = NanDitto
    try:
        c = cfg(method="test_nanditto", fraction=1.0, rounds=1)
        store = Store(tmp_path / "r.db")
        Experiment(c, store).run()
        why = {r["client"]: r["data"]["reason"] for r in store.records(c.run_id, "rejected")}
        assert set(why) == {0, 1} and why[0].endswith("; its upload 'params' too")
        assert why[1].startswith("client state ") and why[1].endswith("non-finite values (NaN/Inf)")
    finally:
        REGISTRY.pop("test_nanditto")


# -- bytes per round -----------------------------------------------------------------------------------
def _bytes_methods() -> list[str]:
    return sorted(m for m in REGISTRY if not m.startswith("test_") or m == "test_protostate")


@pytest.mark.parametrize("method", _bytes_methods())
def test_bytes_per_round_are_the_payload_sizes(method, tmp_path):
    """Every registered method: bytes up = the declared upload of the accepted rows, bytes down = the
    payload each method's paper sends (hand values; floats of 4 bytes)."""
    k = {"fedprism": {"fedprism.k": 2, "fedprism.m": 1}, "ifca": {"ifca.k": 3}, "fedprism_dual": {"fedprism_dual.k": 2},
         "fedclust": {"fedclust.k": 2}, "fedsoft": {"fedsoft.k": 2}}.get(method, {})
    c = cfg(method=method, **{key.replace(".", "__"): v for key, v in k.items()})
    e = Experiment(c, Store(tmp_path / "b.db"))
    P, C, d = e.ctx.spec.size, e.ctx.num_classes, e.ctx.feature_dim
    body = e.ctx.spec.body.stop - e.ctx.spec.body.start
    protos = C * d + C                                      # [C, d] prototypes + [C] counts or presence
    per_down = {"local": 0, "fedprism_dual": P + 1, "ifca": 3 * P, "fedper": body, "fedrep": body,
                "fedproto": protos, "pfpl": protos, "protohar": body + protos, "fedsoft": 2 * P,
                "lg_fedavg": P - body, "fedbabu": body, "scaffold": 2 * P, "fedem": 3 * P,
                "fedpac": P + C * d + C + 1, "gpfl": body + 2 * (d * d + d) + 4 * d + C * d}.get(method, P)
    per_up = {"local": 0, "ifca": P + 1, "fedper": body, "fedrep": body, "fedproto": protos, "pfpl": protos,
              "protohar": body + protos, "fedsoft": P + 2, "lg_fedavg": P - body,
              "fedbabu": body, "scaffold": 2 * P, "fednova": P + 1, "qffl": P + 1, "fedem": 3 * P,
              "fedpac": P + 2 * C * d + C + 1, "gpfl": body + 2 * (d * d + d) + 4 * d + C * d}.get(method, P)
    res = e.run()
    if method == "fedfomo":         # up to M models of clients that uploaded, 4 P + 8 bytes each (counted by hand
        m, h0 = e.algo.hp["m"], res.history[0]     # in tests/test_fedala_fedrod_fedfomo.py); nothing in round 0
        assert h0["bytes_down"] == 0 and all(h["bytes_up"] == 4 * (P + m) * h["accepted"] and h["bytes_down"] %
                                             (4 * P + 8) == 0 for h in res.history) and res.history[1]["bytes_down"]
        return
    if method == "fedsub":          # sparse: bit masks and the kept parameters only (FedSub.encode)
        U = e.algo.layout.units
        union = {r["round"]: r["data"]["subnet_bytes_union"] for r in e.store.records(e.run_id, "fedsub")}
        for i, h in enumerate(res.history):     # the record's union counts the mask bits unrounded
            bits = (C * U + 7) // 8 - C * U / 8
            assert h["bytes_up"] == pytest.approx(union[i] + h["accepted"] * (bits + 4 * C * d + 4 * C), abs=1e-6), h
            assert (U + 7) // 8 * h["clients"] <= h["bytes_down"] <= ((U + 7) // 8 + 4 * P) * h["clients"], h
        assert res.history[0]["bytes_down"] == (U + 7) // 8 * res.history[0]["clients"]   # empty U_k
        return
    setup_down, setup_up = e.algo.setup_bytes()       # a declared one-off exchange before round 0
    assert (setup_down, setup_up) == ((0, e.ctx.num_clients * C * 8) if method == "clust_psi_pfl" else (0, 0))
    for i, h in enumerate(res.history):
        assert h["bytes_down"] == 4 * per_down * h["clients"] + (setup_down if i == 0 else 0), h
        assert h["bytes_up"] == 4 * per_up * h["accepted"] + (setup_up if i == 0 else 0), h
    declared = sum(int(np.prod(s.shape)) * torch.empty(0, dtype=s.dtype).element_size() for s in e.upload.values())
    assert declared == 4 * per_up


# -- local training -------------------------------------------------------------------------------------
@pytest.fixture
def engines(digits):
    from conftest import unequal_federation

    fed = unequal_federation(digits)
    model = build_model("mlp", fed.input_shape, fed.num_classes, seed=0)
    def make(**kw):
        c = LocalConfig(epochs=2, batch_size=8, lr=0.01, **kw)
        return (SequentialEngine(fed, model, c, 3, "cpu"),
                VectorizedEngine(fed, model, c, 3, "cpu", compile=False, max_slots=2))
    return fed, model, make


def test_adam_vectorized_equals_sequential_and_torch(engines):
    fed, model, make = engines
    seq, vec = make(optimizer="adam", weight_decay=0.01)
    P = seq.spec.size
    start = torch.randn(4, P, generator=torch.Generator().manual_seed(0)) * 0.1
    job = TrainJob(np.array([3, 0, 5, 1]), start)
    a, b = seq.train(job, 2), vec.train(job, 2)
    torch.testing.assert_close(a.params, b.params, atol=2e-5, rtol=1e-4)
    assert not torch.allclose(a.params, start)
    # one step equals torch.optim.Adam (L2 weight decay, bias corrections)
    cfg1 = LocalConfig(lr=0.01, optimizer="adam", weight_decay=0.01)
    w = torch.randn(P)
    p = torch.nn.Parameter(w.clone())
    opt = torch.optim.Adam([p], lr=0.01, weight_decay=0.01)
    st = optimizer_state(cfg1, w)
    for k in range(3):
        g = torch.randn(P, generator=torch.Generator().manual_seed(k))
        p.grad = g.clone()
        opt.step()
        w, st = optimizer_step(w, g, st, cfg1)
    torch.testing.assert_close(w, p.detach(), atol=1e-6, rtol=1e-5)


def test_in_place_step_is_the_reference_step():
    """The eager loops' in-place step: SGD the same bits as `optimizer_step`, Adam (torch's fused kernel)
    equal to float32 rounding and to torch.optim.Adam, masked coordinates untouched, updated in place."""
    from fedprism.engine.base import optimizer_step_

    P = 1000
    mask = (torch.arange(P) % 3 != 0).float()
    for opt in ("sgd", "adam"):
        cfg = LocalConfig(lr=0.01, optimizer=opt, momentum=0.9 if opt == "sgd" else 0.0, weight_decay=0.01)
        w0 = torch.randn(P, generator=torch.Generator().manual_seed(5))
        w, st = w0.clone(), optimizer_state(cfg, w0)
        w_, st_ = w0.clone(), optimizer_state(cfg, w0)
        p = torch.nn.Parameter(w0.clone())
        ref = (torch.optim.SGD([p], lr=0.01, momentum=0.9, weight_decay=0.01) if opt == "sgd"
               else torch.optim.Adam([p], lr=0.01, weight_decay=0.01))
        for k in range(4):
            g = torch.randn(P, generator=torch.Generator().manual_seed(k))
            w, st = optimizer_step(w, g, st, cfg, mask)
            out, st_ = optimizer_step_(w_, g, st_, cfg, mask)
            assert out is w_                                   # in place
            p.grad = g.clone()
            ref.step()
        if opt == "sgd":
            assert torch.equal(w_, w) and torch.equal(st_[0], st[0])
        else:
            torch.testing.assert_close(w_, w, atol=1e-6, rtol=0)
            torch.testing.assert_close(st_[1], st[1], atol=1e-7, rtol=1e-5)
            assert not torch.equal(w_, w0)
        assert torch.equal(w_[mask == 0], w0[mask == 0])
        torch.testing.assert_close(w_[mask == 1], p.detach()[mask == 1], atol=1e-6, rtol=1e-5)


def test_per_client_mask_trains_only_the_masked_coordinates(engines):
    fed, model, make = engines
    for opt in ("sgd", "adam"):
        seq, vec = make(optimizer=opt, momentum=0.9 if opt == "sgd" else 0.0, weight_decay=0.1)
        spec = seq.spec
        n = 3
        start = torch.randn(n, spec.size, generator=torch.Generator().manual_seed(1)) * 0.1
        mask = torch.zeros(n, spec.size)
        mask[0, spec.head] = 1                 # client 4: head only
        mask[1, spec.body] = 1                 # client 2: body only
        # client 0: nothing trains
        job = TrainJob(np.array([4, 2, 0]), start, mask=mask)
        for eng in (seq, vec):
            out = eng.train(job, 1).params
            frozen = mask == 0
            assert torch.equal(out[frozen], start[frozen]), (opt, eng.name)
            assert ((out != start) | frozen).all() or (out[~frozen] != start[~frozen]).float().mean() > 0.9
        torch.testing.assert_close(seq.train(job, 1).params, vec.train(job, 1).params, atol=2e-5, rtol=1e-4)


def test_named_streams_give_independent_orders_and_legacy_names_keep_their_seeds():
    from fedprism.engine.base import client_seed, stream_seed

    assert stream_seed(3, 7, 2) == client_seed(3, 7, 2)
    assert stream_seed(3, 7, 2, "expert") == client_seed(3, 7 + 2_000_000, 2)
    assert stream_seed(3, 7, 2, "private") == client_seed(3, 7 + 1_000_000, 2)
    seeds = {stream_seed(3, 7, 2, s) for s in ("train", "expert", "private", "head", "body", "ditto")}
    assert len(seeds) == 6 and stream_seed(3, 7, 2, "head") == stream_seed(3, 7, 2, "head")


def test_custom_loss_sees_features(engines):
    fed, model, make = engines
    seq, vec = make()
    seen = []

    def loss(f, w, x, y, weight, extras):
        z = f.features(w, x)
        seen.append(z.shape[-1])
        logits = f.head(w, z)
        ce = torch.nn.functional.cross_entropy(logits, y, reduction="none")
        return (ce * weight).sum() / weight.sum() + extras["lam"] * (z * z).mean()

    start = torch.zeros(2, seq.spec.size) + 0.01
    job = TrainJob(np.array([1, 2]), start, loss=loss, extras={"lam": torch.tensor([0.0, 1.0])})
    torch.testing.assert_close(seq.train(job, 0).params, vec.train(job, 0).params, atol=2e-5, rtol=1e-4)
    assert seen and all(d == 64 for d in seen)


# -- evaluation-only settings --------------------------------------------------------------------------
def test_changing_the_routing_temperature_rescores_without_training(tmp_path):
    base = dict(method="fedprism_dual", fedprism_dual__k=2, rounds=3, fraction=1.0)
    c5 = cfg(**base, fedprism_dual__inference_temperature=5.0)
    c2 = cfg(**base, fedprism_dual__inference_temperature=2.0)
    assert c5.run_id != c2.run_id and c5.train_id == c2.train_id
    store = Store(tmp_path / "t.db")
    first = Experiment(c5, store).run()
    e2 = Experiment(c2, store)
    second = e2.run()
    assert e2.engine.samples_trained == 0                                     # nothing trained
    assert second.final["rescored_from"] == c5.run_id
    assert [r["data"]["from"] for r in store.records(c2.run_id, "rescored")] == [c5.run_id]
    assert second.final["global_acc"] == pytest.approx(first.final["global_acc@T=2"], abs=1e-12)
    assert second.final["local_acc"] == pytest.approx(first.final["local_acc@T=2"], abs=1e-12)
    assert second.final["global_acc@T=5"] == pytest.approx(first.final["global_acc"], abs=1e-12)
    # a training key differs: no re-scoring
    c_other = cfg(**base, fedprism_dual__inference_temperature=2.0, lr=0.02)
    e3 = Experiment(c_other, store)
    e3.run()
    assert e3.engine.samples_trained > 0
    # opt-out: no kept state, so a new temperature trains
    c_no = cfg(**base, seed=4, keep_final=False)
    Experiment(c_no, store).run()
    e4 = Experiment(cfg(**base, seed=4, keep_final=False, fedprism_dual__inference_temperature=1.0), store)
    e4.run()
    assert e4.engine.samples_trained > 0


def _trained_at_t5(tmp_path, rounds: int):
    """A finished fedprism_dual run at inference temperature 5 (its final state kept), and the config that
    differs only in that evaluation-only setting (temperature 2)."""
    base = dict(method="fedprism_dual", fedprism_dual__k=2, rounds=rounds, fraction=1.0)
    c5 = cfg(**base, fedprism_dual__inference_temperature=5.0)
    c2 = cfg(**base, fedprism_dual__inference_temperature=2.0)
    store = Store(tmp_path / "t.db")
    return c5, c2, store, Experiment(c5, store).run()


def test_a_kept_state_trained_by_other_code_is_not_rescored(tmp_path):
    """The reuse rule holds for re-scoring too: a kept final state whose run was stored from other code
    (its method file's fingerprint differs) is what that code trained, so a new evaluation setting trains
    under today's code instead of re-scoring it, and the source run is left as it is."""
    import sqlite3

    c5, c2, store, _ = _trained_at_t5(tmp_path, rounds=2)
    prov = store.provenance(c5.run_id)
    prov["code"]["method"] = {**prov["code"]["method"], "sha256": "0" * 64, "text": "1" * 64}
    con = sqlite3.connect(tmp_path / "t.db")
    con.execute("UPDATE runs SET provenance=? WHERE run_id=?", (json.dumps(prov), c5.run_id))
    con.commit()
    con.close()
    e2 = Experiment(c2, store)
    second = e2.run()
    assert e2.engine.samples_trained > 0 and "rescored_from" not in second.final
    assert store.records(c2.run_id, "rescored") == []
    assert store.provenance(c5.run_id)["code"]["method"]["sha256"] == "0" * 64


# -- layering ----------------------------------------------------------------------------------------
# (the layer order of every module is checked by tests/test_layering.py)


def test_importing_fedprism_changes_no_process_setting():
    code = "import fedprism, sys; print('torch' in sys.modules, fedprism._API['run'])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")}).stdout.split()
    assert out == ["False", "fedprism.api"]
    import fedprism._alloc as alloc
    assert "tune_allocator" not in (ROOT / "src" / "fedprism" / "__init__.py").read_text()
    assert alloc  # the engine calls it on first use


# -- plugins ------------------------------------------------------------------------------------------
def install_plugin(where: Path) -> dict:
    """An installed distribution that declares tests/plugins/fedavgm_plugin.py as a method entry point;
    returns the environment that puts it on the path."""
    dist = where / "fedavgm_plugin-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fedavgm-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[fedprism.methods]\nfedavgm = fedavgm_plugin:FedAvgM\n")
    (where / "fedavgm_plugin.py").write_text((Path(__file__).parent / "plugins" / "fedavgm_plugin.py").read_text())
    path = os.pathsep.join([str(where), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path}


def test_external_plugin_runs_through_cli_and_sweep(tmp_path):
    env = install_plugin(tmp_path / "site")
    db = tmp_path / "p.db"
    run = [sys.executable, "-m", "fedprism.cli", "run", "--db", str(db), "--json", "method=fedavgm",
           "dataset=digits", "clients=6", "rounds=2", "local_epochs=1", "model=mlp", "fedavgm.server_momentum=0.5"]
    r = subprocess.run(run, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert '"local_acc"' in r.stdout.strip().splitlines()[-1]
    sweep = tmp_path / "s.toml"
    # the plugin's key in [base] applies to its runs only, as a built-in method's would, even to a run
    # listed before any of its own (which are what would load the plugin otherwise)
    base = {"dataset": "digits", "clients": 6, "rounds": 2, "local_epochs": 1, "model": "mlp",
            "fedavgm.server_momentum": 0.5}
    runs = [dict(label="FedAvg", method="fedavg"), dict(label="FedAvgM", method="fedavgm")]
    sweep.write_text(dump_sweep("plugin_sweep", base, runs))
    listed = subprocess.run([sys.executable, "-m", "fedprism.cli", "methods"], capture_output=True, text=True,
                            env=env, timeout=120).stdout
    assert "fedavgm.server_momentum" in listed and "arXiv:1909.06335" in listed
    r = subprocess.run([sys.executable, "-m", "fedprism.cli", "sweep", str(sweep), "--db", str(db)],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr + r.stdout
    from fedprism.experiment.store import Store as S
    rows = S(db).runs(sweep="plugin_sweep")
    assert sorted(x["method"] for x in rows) == ["fedavg", "fedavgm"]
    momentum = {x["method"]: json.loads(x["config"]).get("fedavgm.server_momentum") for x in rows}
    assert momentum == {"fedavgm": 0.5, "fedavg": None}
    # without the plugin installed the method is an error naming the key
    r = subprocess.run(run, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert r.returncode == 2 and "method" in r.stderr and "fedavgm" in r.stderr


@pytest.mark.slow
def test_external_plugin_runs_on_the_flower_simulation(tmp_path):
    pytest.importorskip("flwr")
    env = install_plugin(tmp_path / "site")
    env.update({"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1", "RAY_USAGE_STATS_ENABLED": "0"})
    db = tmp_path / "f.db"
    exp = "method=fedavgm dataset=digits clients=3 rounds=2 fraction=1.0 local_epochs=1 model=mlp engine=sequential"
    r = subprocess.run([sys.executable, "-m", "fedprism.flower", "simulate", "--db", str(db), "--experiment", exp],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    from fedprism.experiment.store import Store as S
    rows = S(db).runs(method="fedavgm")
    assert len(rows) == 1 and rows[0]["status"] == "finished"
    ref = subprocess.run([sys.executable, "-m", "fedprism.cli", "run", "--db", str(tmp_path / "ref.db"), "--json",
                          *exp.split()], capture_output=True, text=True, env=env, timeout=300)
    final = json.loads(ref.stdout.strip().splitlines()[-1])
    got = json.loads(rows[0]["final"])
    assert got["local_acc"] == pytest.approx(final["final"]["local_acc"] if "final" in final else final["local_acc"],
                                             abs=1e-9)


def test_the_documented_plugin_is_the_tested_one():
    """docs/writing-a-method.md shows the code that the plugin tests run, line for line."""
    doc = (ROOT / "docs" / "writing-a-method.md").read_text()
    block = doc.split("```python\n", 1)[1].split("```", 1)[0]
    code = (Path(__file__).parent / "plugins" / "fedavgm_plugin.py").read_text()
    body = code[code.index('"""', 3) + 3:]
    assert block.strip() == body.strip()


# -- registration and plugin checks -------------------------------------------------------------------
def test_register_refuses_what_could_never_run_and_built_in_names(tmp_path):
    """A non-Algorithm, a name with a dot, a params entry that is no Param, a built-in method's, model's or
    dataset's name, a builder that is not callable: each refused at registration, naming it; registering
    a plugin's name again replaces it (a notebook cell run twice)."""
    import fedprism
    from fedprism.algorithms.base import REGISTRY
    from fedprism.algorithms.fedavg import FedAvg

    with pytest.raises(TypeError, match="subclass of fedprism.Algorithm"):
        fedprism.register(object)
    for name, params, match in (("fed.avg", {}, "without dots"), ("fedavg", {}, "built-in method"),
                                ("mine", {"k": 3}, r"params\['k'\] is 3")):
        cls = type("Mine", (FedAvg,), {"name": name, "params": {**FedAvg.params, **params}})
        with pytest.raises((TypeError, ValueError), match=match):
            fedprism.register(cls)
    assert REGISTRY["fedavg"] is FedAvg and "mine" not in REGISTRY
    with pytest.raises(ValueError, match="'mlp' is a built-in model"):
        fedprism.register_model("mlp", lambda shape, k: None)
    with pytest.raises(ValueError, match="'digits' is a built-in dataset"):
        fedprism.register_dataset("digits", lambda pad32, root: None)
    with pytest.raises(TypeError, match="not callable"):
        fedprism.register_model("mine_model", 3)
    # a reload of the built-in's own module (IPython %autoreload) makes a class of the same module and name
    again = type("FedAvg", (FedAvg,), {"__module__": FedAvg.__module__, "__qualname__": FedAvg.__qualname__})
    try:
        assert fedprism.register(again) is again and REGISTRY["fedavg"] is again
    finally:
        REGISTRY["fedavg"] = FedAvg
    try:
        first = fedprism.register(type("Mine", (FedAvg,), {"name": "mine_again"}))
        second = fedprism.register(type("Mine", (FedAvg,), {"name": "mine_again"}))
        assert REGISTRY["mine_again"] is second is not first
    finally:
        REGISTRY.pop("mine_again", None)


@pytest.mark.parametrize("build, match", [
    (lambda shape, k: None, "returns a torch.nn.Module; it returned NoneType"),
    (lambda shape, k: torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, k + 3)), r"gave \[2, 13\]"),
    (lambda shape, k: torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(50, k)), "the data's shape"),
    (lambda shape, k: torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, k)).requires_grad_(False)
     .apply(lambda m: m.weight.fill_(float("nan")) if isinstance(m, torch.nn.Linear) else None),
     "finite weights"),
])
def test_a_registered_model_that_cannot_serve_the_data_is_refused_and_leaves_no_store(tmp_path, build, match):
    """Checked when a run builds it: a module, finite weights, [batch, classes] logits for the data's
    input shape; the refusal names the model, and `fedprism.run` removes the store it created."""
    import fedprism
    from fedprism import plugins
    from fedprism.errors import ConfigError

    plugins.MODELS["bad_model"] = build
    try:
        with pytest.raises(ConfigError, match="'model' = 'bad_model' .*" + match):
            fedprism.run(fedprism.config(method="fedavg", model="bad_model", clients=4, rounds=1,
                                         local_epochs=1), db=tmp_path / "p.db")
        assert not (tmp_path / "p.db").exists()
    finally:
        plugins.MODELS.pop("bad_model", None)


def test_a_registered_dataset_with_labels_out_of_range_is_refused(tmp_path):
    import fedprism
    from fedprism import plugins
    from fedprism.data.datasets import load_dataset
    from fedprism.errors import ConfigError

    def load(pad32, root):
        ds = load_dataset("digits", cache_dir=False)
        ds.classes = ds.classes[:3]                               # 3 class names, labels up to 9
        return ds

    plugins.DATASETS["bad_data"] = load
    try:
        with pytest.raises(ConfigError, match=r"'dataset' = 'bad_data' .*labels in 0\.\.2"):
            fedprism.run(fedprism.config(method="fedavg", dataset="bad_data", model="mlp", clients=4,
                                         rounds=1), db=tmp_path / "d.db")
        assert not (tmp_path / "d.db").exists()
    finally:
        plugins.DATASETS.pop("bad_data", None)


def test_api_arguments_of_the_wrong_kind_are_named(tmp_path):
    """`fedprism.config(5)`, `run(db=None)` and a Simulator round of clients that do not exist name the
    argument (they gave 'expected str, bytes or os.PathLike' or silently trained client N-1 for -1)."""
    import numpy as np

    import fedprism
    from fedprism.experiment.runner import Simulator

    for bad in (5, [1, 2], b"x.toml"):
        with pytest.raises(TypeError, match=r"fedprism.config\(source\)"):
            fedprism.config(bad)
    small = fedprism.config(method="fedavg", dataset="digits", clients=6, rounds=1, local_epochs=1,
                            model="mlp")
    with pytest.raises(TypeError, match=r"fedprism.run\(db=...\): None"):
        fedprism.run(small, db=None)
    exp = fedprism.Experiment(small, fedprism.Store(tmp_path / "s.db"))
    sim = Simulator(exp.algo, exp.engine)
    for bad in ([-1], [6], [1, 1], [0.5]):
        with pytest.raises(ValueError, match=r"not distinct client indices in 0\.\.5"):
            sim.round(0, np.array(bad))
    assert sim.round(0, np.arange(3))[1].clients.tolist() == [0, 1, 2]


def test_a_failing_rescore_marks_only_the_new_run_failed_and_runs_again(tmp_path, monkeypatch):
    """An error while a kept final state is re-scored (here: in the evaluation) marks the new run failed
    and leaves the source run and its kept state as they were; the same command then re-scores."""
    c5, c2, store, first = _trained_at_t5(tmp_path, rounds=2)
    e2 = Experiment(c2, store)

    def broken(*a, **k):
        raise RuntimeError("evaluation broke")

    monkeypatch.setattr(e2, "evaluate_round", broken)
    with pytest.raises(RuntimeError, match="evaluation broke"):
        e2.run()
    assert store.run(c2.run_id)["status"] == "failed" and e2.engine.samples_trained == 0
    assert store.run(c5.run_id)["status"] == "finished" and store.load_final(c5.train_id) is not None
    again = Experiment(c2, store)
    second = again.run()
    assert again.engine.samples_trained == 0 and second.final["rescored_from"] == c5.run_id
    assert second.final["global_acc"] == pytest.approx(first.final["global_acc@T=2"], abs=1e-12)
