"""Upload compression (`compress=int8|stochastic|topk`, fedprism.compression): the codecs by hand, error
feedback's invariant, bytes counted from the encoded form and equal to what the Flower codec sends, Flower
equal to the in-process run, malformed encodings rejected, and the refusal for a method with its own
encoding."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedprism.compression import RESIDUAL, Compressor, _pack, _unpack
from fedprism.errors import ConfigError
from fedprism.experiment.config import resolve
from fedprism.experiment.runner import Experiment, receive
from fedprism.experiment.store import Store
from fedprism.protocol import Plan, TensorSpec, Update

import test_flower as tf                       # the in-process Flower grid (FakeGrid) and its fixtures
from test_flower import offline, task_identity  # noqa: F401 (fixtures)

EXP = dict(method="fedavg", dataset="digits", model="mlp", clients=4, rounds=2, fraction=0.5, local_epochs=1,
           lr=0.05, engine="sequential", device="cpu", seed=2, keep_final=False)


def test_int8_by_hand():
    c = Compressor("int8")
    q, s = c.encode(torch.tensor([1.0, -0.5, 0.25, 0.0]))
    assert float(s) == pytest.approx(1 / 127) and s.dtype == torch.float32
    assert q.tolist() == [127, -64, 32, 0] and q.dtype == torch.int8      # -63.5 rounds to even, 31.75 up
    assert torch.allclose(c.decode(q, s, (4,)), torch.tensor([1.0, -64 / 127, 32 / 127, 0.0]), atol=1e-7)
    q0, s0 = c.encode(torch.zeros(3))
    assert float(s0) == 0 and q0.tolist() == [0, 0, 0]


def test_qsgd_levels_unbiasedness_and_packing():
    c = Compressor("stochastic", bits=3)                 # L = 3 levels per sign, codes in [0, 6], 3 bits each
    assert c.levels == 3
    v = torch.tensor([0.6, -0.8, 0.0, 0.3])              # norm 1.0525...; |v|/norm*3 = 1.71, 2.28, 0, 0.86
    draws = []
    for i in range(4000):
        a, b = c.encode(v, torch.Generator().manual_seed(i))
        assert a.dtype == torch.uint8 and a.numel() == math.ceil(4 * 3 / 8)
        d = c.decode(a, b, (4,)).double()
        lv = d / float(b) * 3
        assert torch.allclose(lv, lv.round(), atol=1e-5)                  # on the grid norm * l / L
        r = v.double().abs() / v.double().norm() * 3
        assert bool(((lv.abs() - r.floor()).abs() < 1e-5).logical_or((lv.abs() - r.ceil()).abs() < 1e-5).all())
        draws.append(d)
    assert torch.allclose(torch.stack(draws).mean(0), v.double(), atol=0.02)   # E[decoded] = v
    codes = np.array([0, 6, 3, 5, 1, 2, 4, 6, 0], dtype=np.int64)
    assert np.array_equal(_unpack(_pack(codes, 3), 3, 9), codes)
    assert _pack(np.array([1, 2]), 2).tolist() == [0b01100000]              # most significant bit first
    with pytest.raises(ValueError, match="code above"):
        c.decode(torch.tensor([0xFF], dtype=torch.uint8), torch.tensor(1.0), (2,))


def test_topk_ties_and_error_feedback_invariant():
    """Top-k keeps the k largest magnitudes (ties: lower index). With error feedback, what was sent over the
    rounds plus what is still held back is exactly what the client wanted to send (Stich et al. 2018)."""
    c = Compressor("topk", k=0.4)
    idx, val = c.encode(torch.tensor([0.5, -2.0, 0.5, 1.0, 0.5]))
    assert idx.tolist() == [1, 3] and val.tolist() == [-2.0, 1.0] and idx.dtype == torch.int32
    up = {"params": TensorSpec((5,))}
    g = torch.Generator().manual_seed(0)
    e = torch.zeros(1, 5)
    sent_total, wanted = torch.zeros(5, dtype=torch.float64), torch.zeros(5, dtype=torch.float64)
    for t in range(6):
        u = torch.randn(1, 5, generator=g)
        wanted += u[0].double()
        enc = c.encode_update(Update(np.array([0]), {"params": u}, torch.ones(1)), {}, up, t, {RESIDUAL + "params": e})
        assert set(enc.payload) == {"params@idx", "params@val"}
        dec, bad = c.decode_update(enc, {}, up)
        assert not bad
        sent_total += dec.payload["params"][0].double()
        e = enc.client_state[RESIDUAL + "params"]
        assert torch.allclose(sent_total + e[0].double(), wanted, atol=1e-5)


def _experiment(tmp_path, name="r.db", **kw):
    return Experiment(resolve({**EXP, **kw}), Store(tmp_path / name))


@pytest.mark.parametrize("how,extra,per_client", [
    ("int8", {}, lambda P: P + 4),
    ("stochastic", {"compress.bits": 2}, lambda P: math.ceil(2 * P / 8) + 4),
    ("topk", {"compress.k": 0.05}, lambda P: 8 * math.ceil(0.05 * P)),
])
def test_bytes_up_are_the_encoded_form(how, extra, per_client, tmp_path):
    e = _experiment(tmp_path, compress=how, **extra)
    res = e.run()
    P = e.ctx.spec.size
    hist = e.store.round_metrics(e.run_id)
    assert [h["bytes_up"] for h in hist] == [2 * per_client(P)] * 2
    assert [h["bytes_down"] for h in hist] == [2 * 4 * P] * 2              # the plan is not compressed
    assert res.final["bytes_up"] == 4 * per_client(P)
    if how == "topk":                         # error feedback: a residual is kept for the clients that trained
        assert e.ctx.compress.feedback and RESIDUAL + "params" in e.algo.client_state   # auto: on for topk
        r = e.clients.data[RESIDUAL + "params"]
        assert int((r.abs().sum(1) > 0).sum()) >= 2
    else:
        assert RESIDUAL + "params" not in e.algo.client_state


def test_compressed_run_differs_and_keeps_learning(tmp_path):
    plain = _experiment(tmp_path, "a.db", rounds=3)
    plain.run()
    q = _experiment(tmp_path, "b.db", rounds=3, compress="int8")
    q.run()
    assert q.run_id != plain.run_id
    d = (q.state["w"] - plain.state["w"]).abs().max()
    assert 0 < float(d) < 0.05                            # 8 bits: close to the uncompressed model, not equal


def test_a_malformed_encoding_is_rejected_alone(tmp_path):
    e = _experiment(tmp_path, compress="topk", **{"compress.k": 0.5})
    P = e.ctx.spec.size
    k = math.ceil(0.5 * P)
    plan = Plan(np.array([0, 1]), {"params": torch.zeros(2, P)})
    idx = torch.arange(k, dtype=torch.int32).expand(2, -1).clone()
    idx[1, 3] = idx[1, 2]                                           # a repeated index
    up = Update(np.array([0, 1]), {"params@idx": idx, "params@val": torch.ones(2, k)}, torch.ones(2), {})
    kept, rejected = receive(up, plan, None, e.upload, "FedAvg", e.ctx.compress)
    assert kept.clients.tolist() == [0] and "increasing" in rejected[1]
    assert torch.equal(kept.params[0, :k], torch.ones(k)) and float(kept.params[0, k:].abs().sum()) == 0
    idx[1, 3] = P                                                   # out of range: refused by the wire spec
    up.payload["params@idx"] = idx
    kept, rejected = receive(up, plan, None, e.upload, "FedAvg", e.ctx.compress)
    assert kept.clients.tolist() == [0] and "params@idx" in rejected[1]


def test_a_method_with_its_own_encoding_is_refused():
    with pytest.raises(ConfigError, match="own encoding") as e:
        resolve({**EXP, "method": "fedsub", "compress": "int8"})
    assert e.value.key == "compress"


@pytest.mark.parametrize("how", ["stochastic", "topk"])
def test_flower_sends_the_counted_bytes_and_gets_the_in_process_numbers(how, tmp_path, task_identity):
    """On Flower the replies carry the encoded tensors: the bytes of the arrays that crossed the grid are the
    stored bytes_up, equal to the in-process count, and the seeded quantisation and the residuals kept by
    each node give the in-process model."""
    from fedprism.flower.server_app import serve

    exp = (f"method=fedavg dataset=digits clients=4 rounds=2 fraction=1.0 local_epochs=1 lr=0.05 model=mlp "
           f"device=cpu engine=sequential seed=5 compress={how} compress.k=0.1")
    ref, final = tf.in_process(exp, tmp_path / "ref.db")
    rc = tf.run_config(exp, tmp_path / "fl.db", save_final=str(tmp_path / "final.pt"))
    grid = tf.FakeGrid(tf.nodes_for(4), rc)
    res = serve(grid, rc)
    assert res.status == "finished"
    got, want = Store(tmp_path / "fl.db").round_metrics(res.run_id), ref.store.round_metrics(ref.run_id)
    for rnd in range(2):
        came = sum(b for r, _, b in grid.up_bytes if r == rnd)
        assert got[rnd]["bytes_up"] == came == want[rnd]["bytes_up"] < 4 * 4 * ref.ctx.spec.size
    state = torch.load(tmp_path / "final.pt", weights_only=False)["state"]
    assert torch.equal(state["w"], ref.state["w"])
