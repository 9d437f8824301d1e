"""Checkpoints without pickle: exact round trips, and hostile files that restart the run, never run code."""

from __future__ import annotations

import functools
import json
import math
import os
import pickle

import numpy as np
import pytest
import torch

from fedprism.experiment import checkpoint
from fedprism.experiment.checkpoint import CheckpointError, CheckpointRefused
from fedprism.experiment.config import resolve
from fedprism.experiment.runner import Experiment
from fedprism.experiment.store import Store

SMALL = dict(dataset="digits", clients=8, rounds=4, fraction=0.5, local_epochs=1, batch_size=16, lr=0.05,
             partition="dirichlet", **{"partition.alpha": 0.5}, engine="sequential")


def _bytes(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def same(a, b) -> bool:
    """Exact equality, type included (tuples stay tuples, numpy scalars keep their dtype, -0.0, NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.shape, a.device, a.requires_grad) == (b.dtype, b.shape, b.device, b.requires_grad) \
            and _bytes(a) == _bytes(b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, np.generic):
        return a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(k1, k2) and same(a[k1], b[k2]) for k1, k2 in zip(a, b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


EVERY_TYPE = {
    "f32": torch.randn(3, 4), "f64": torch.randn(5, dtype=torch.float64), "f16": torch.randn(2).half(),
    "bf16": torch.randn(3).bfloat16(), "i64": torch.arange(7), "i32": torch.arange(3, dtype=torch.int32),
    "u8": torch.tensor([0, 255], dtype=torch.uint8), "bool_t": torch.tensor([True, False]),
    "empty": torch.zeros(0, 5), "scalar_t": torch.tensor(3.5), "c64": torch.randn(2, dtype=torch.complex64),
    "grad": torch.ones(2, requires_grad=True), "strided": torch.arange(12.).view(3, 4).t(),
    "nan_inf": torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0]),
    "np_f64": np.linspace(0, 1, 5), "np_bool": np.array([True, False]), "np_i8": np.arange(-3, 3, dtype=np.int8),
    "np_2d": np.arange(6, dtype=np.float32).reshape(2, 3), "np_be": np.arange(3, dtype=">f8"),
    "np_0d": np.array(2.5), "np_u64": np.array([2**64 - 1], dtype=np.uint64),
    "np_scalars": [np.float32(1.5), np.int64(-7), np.bool_(True), np.float64("nan"), np.uint8(9)],
    "py": [True, False, 0, -1, 2**100, 1.0, -0.0, float("nan"), float("inf"), 1e-310, "", "ünï\u0000code", None],
    "tuple": (1, (2, [3, {"x": (4,)}])), "int_keys": {0: "a", 5: torch.ones(1), -3: None},
    "mixed_keys": {None: 1, True: 2, 1.5: 3, "s": 4, (1, 2): 5},
    "nested": {"a": {"b": {"c": [np.zeros(2), torch.zeros(2)]}}}, "empty_dict": {}, "empty_list": [],
}


def test_round_trip_of_every_state_type():
    blob = checkpoint.dumps(EVERY_TYPE)
    back = checkpoint.loads(blob)
    big_endian = back.pop("np_be")             # stored little-endian, same values
    assert same(back, {k: v for k, v in EVERY_TYPE.items() if k != "np_be"})
    assert isinstance(back["tuple"], tuple) and isinstance(back["np_scalars"][0], np.float32)
    assert big_endian.dtype == np.dtype("<f8") and big_endian.tolist() == [0.0, 1.0, 2.0]
    assert back["strided"].is_contiguous() and torch.equal(back["strided"], EVERY_TYPE["strided"])
    assert checkpoint.dumps(back) == checkpoint.dumps(checkpoint.loads(checkpoint.dumps(back)))  # deterministic


def test_save_streams_the_bytes_of_dumps_without_copying_the_tensors(tmp_path):
    import tracemalloc

    path = tmp_path / "s.ckpt"
    checkpoint.save(path, EVERY_TYPE)
    assert path.read_bytes() == checkpoint.dumps(EVERY_TYPE)             # the same file, piece by piece
    big = {"client_state": {"w": torch.ones(4 << 20), "m": np.ones(1 << 20)}}   # 16 MiB + 8 MiB
    tracemalloc.start()
    try:
        checkpoint.save(tmp_path / "big.ckpt", big)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20                                   # no bytes copy of the 24 MiB (it made three)
    assert checkpoint.load(tmp_path / "big.ckpt")["client_state"]["w"].sum() == 4 << 20


@pytest.mark.parametrize("bad", [object(), {1, 2}, np.array([object()], dtype=object), b"bytes", lambda: 0,
                                 torch.zeros(2).to_sparse()])
def test_unsupported_values_are_refused_at_save_with_their_path(bad):
    with pytest.raises(TypeError, match=r"state\['w'\]\[1\]"):
        checkpoint.dumps({"w": [0, bad]})


def test_every_method_state_round_trips(tmp_path):
    from fedprism.algorithms import REGISTRY
    for method in sorted(REGISTRY):
        clustered = method in ("fedprism", "fedprism_dual", "fedclust")
        k = {f"{method}.k": 2} if clustered else {}                    # K <= the 4 clients of a round
        exp = Experiment(resolve({**SMALL, "method": method, "rounds": 1, **k}),
                         Store(tmp_path / f"{method}.db"))
        exp.run()
        state = exp.state
        assert same(checkpoint.loads(checkpoint.dumps(state)), state), method


def test_tampered_truncated_and_foreign_files_raise(tmp_path):
    blob = checkpoint.dumps({"w": torch.arange(10.)})
    flipped = bytearray(blob)
    flipped[len(blob) // 2] ^= 1
    forged = blob[:-32]
    header_only = blob[:20]
    with pytest.raises(CheckpointError, match="checksum"):
        checkpoint.loads(bytes(flipped))
    with pytest.raises(CheckpointError, match="checksum"):
        checkpoint.loads(forged + b"\0" * 32)
    with pytest.raises(CheckpointError, match="truncated"):
        checkpoint.loads(header_only)
    with pytest.raises(CheckpointError, match="magic"):
        checkpoint.loads(pickle.dumps({"w": 1}) + b"\0" * 64)
    # a consistent checksum over a lying skeleton (offsets outside the data) is still refused
    import hashlib
    import json
    import struct
    hdr = json.dumps({"format": checkpoint.FORMAT, "version": 2, "mac": "sha256", "skeleton": {"t": "tensor", "i": 0},
                      "tensors": [{"kind": "torch", "dtype": "float32", "shape": [1000], "offset": 0,
                                   "nbytes": 4000}]}).encode()
    body = checkpoint.MAGIC + struct.pack("<Q", len(hdr)) + hdr + b"\0" * 8
    with pytest.raises(CheckpointError, match="outside"):
        checkpoint.loads(body + hashlib.sha256(body).digest())
    hdr2 = hdr.replace(b'"version": 2', b'"version": 99')
    body2 = checkpoint.MAGIC + struct.pack("<Q", len(hdr2)) + hdr2
    with pytest.raises(CheckpointRefused, match="version: unsupported checkpoint version 99"):
        checkpoint.loads(body2 + hashlib.sha256(body2).digest())
    with pytest.raises(CheckpointError, match="cannot read"):
        checkpoint.load(tmp_path / "absent.ckpt")


def _signed(skeleton: dict, tensors: list, data: bytes) -> bytes:
    """A checkpoint whose checksum is right (anyone can compute it) around a lying header."""
    import hashlib
    import json
    import struct
    hdr = json.dumps({"format": checkpoint.FORMAT, "version": checkpoint.VERSION, "mac": "sha256",
                      "skeleton": skeleton, "tensors": tensors}).encode()
    body = checkpoint.MAGIC + struct.pack("<Q", len(hdr)) + hdr + data
    return body + hashlib.sha256(body).digest()


def test_a_tensor_entry_whose_size_disagrees_with_its_shape_is_refused():
    # 10 floats said to take 8 bytes (the data section holds 64)
    entry = {"kind": "torch", "dtype": "float32", "shape": [10], "offset": 0, "nbytes": 8}
    with pytest.raises(CheckpointError, match="outside"):
        checkpoint.loads(_signed({"t": "tensor", "i": 0}, [entry], b"\0" * 64))


def test_a_numpy_scalar_node_must_point_at_a_scalar():
    entry = {"kind": "numpy", "dtype": "<f8", "shape": [3], "offset": 0, "nbytes": 24}
    with pytest.raises(CheckpointError, match="scalar"):
        checkpoint.loads(_signed({"t": "npscalar", "i": 0}, [entry], b"\0" * 24))


def test_save_is_atomic_with_unique_temporary_names(tmp_path, monkeypatch):
    p = tmp_path / "r.ckpt"
    checkpoint.save(p, {"a": 1})
    real = os.replace

    def crash(*a):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        checkpoint.save(p, {"a": 2})
    monkeypatch.setattr(os, "replace", real)
    assert checkpoint.load(p) == {"a": 1}                      # the old checkpoint is intact
    assert sorted(x.name for x in tmp_path.iterdir()) == ["r.ckpt"]   # no temporary file left


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("where", ["legacy", "current"])
def test_planted_pickle_checkpoint_runs_nothing_and_the_run_completes(tmp_path, where):
    marker = tmp_path / "pwned"
    c = resolve({**SMALL, "method": "fedavg"})
    s = Store(tmp_path / "p.db")
    Experiment(c, s).run(stop_after=2)
    evil = pickle.dumps({"run_id": c.run_id, "round": 1, "state": _Evil(marker), "x": _Evil(marker)})
    target = s.ckpt_dir / f"{c.run_id}.pt" if where == "legacy" else s.checkpoint_path(c.run_id)
    s.checkpoint_path(c.run_id).unlink()          # a results folder of an older version: only the .pt
    target.write_bytes(evil)
    res = Experiment(c, s).run()
    assert not marker.exists()
    assert res.status == "finished" and res.resumed_from is None
    assert [m["round"] for m in s.round_metrics(c.run_id)] == [0, 1, 2, 3]
    (note,) = s.records(c.run_id, "checkpoint_discarded")
    assert note["data"]["file"] == target.name
    assert not target.exists()
    # the attack is real: loading it the old way would have run the command
    if where == "legacy":
        pickle.loads(evil)
        assert marker.exists()


def test_checkpoint_of_another_run_is_discarded(tmp_path):
    c = resolve({**SMALL, "method": "fedavg"})
    s = Store(tmp_path / "o.db")
    Experiment(c, s).run(stop_after=2)
    payload = checkpoint.load(s.checkpoint_path(c.run_id))
    payload["run_id"] = "someone-else"
    checkpoint.save(s.checkpoint_path(c.run_id), payload)
    res = Experiment(c, s).run()
    assert res.resumed_from is None
    assert "not a checkpoint of this run" in s.records(c.run_id, "checkpoint_discarded")[0]["data"]["reason"]


def _raw(header: bytes, data: bytes = b"", hlen: int | None = None) -> bytes:
    import hashlib
    import struct
    body = checkpoint.MAGIC + struct.pack("<Q", len(header) if hlen is None else hlen) + header + data
    return body + hashlib.sha256(body).digest()


_F32 = {"kind": "torch", "dtype": "float32", "shape": [2], "offset": 0, "nbytes": 8}
_NP = {"kind": "numpy", "dtype": "<f8", "shape": [1], "offset": 0, "nbytes": 8}


@pytest.mark.parametrize("blob, needle", [
    (lambda: _raw(b"{}", hlen=10 ** 6), "header length exceeds the file"),
    (lambda: _raw(b"\xff\xfe{"), r"unreadable header \(UnicodeDecodeError\)"),
    (lambda: _raw(b"{not json"), r"unreadable header \(JSONDecodeError\)"),
    (lambda: _raw(b'["fedprism"]'), "not a fedprism checkpoint header"),
    (lambda: _raw(b'{"format": "other"}'), "not a fedprism checkpoint header"),
    (lambda: _raw(json.dumps({"format": checkpoint.FORMAT, "version": checkpoint.VERSION, "mac": "sha256",
                              "skeleton": None}).encode()), "header has no tensor table"),
    (lambda: _signed({"t": "tensor", "i": 3}, [_F32], b"\0" * 8), "tensor index 3 out of range"),
    (lambda: _signed({"t": "tensor", "i": True}, [_F32, _F32], b"\0" * 8), "tensor index True out of range"),
    (lambda: _signed({"t": "tensor", "i": 0}, ["x"], b"\0" * 8), "a tensor entry is not an object"),
    (lambda: _signed({"t": "tensor", "i": 0}, [{**_F32, "kind": "jax"}], b"\0" * 8),
     "unknown tensor kind 'jax'"),
    (lambda: _signed({"t": "tensor", "i": 0}, [{**_F32, "dtype": "float99"}], b"\0" * 8),
     r"bad tensor entry \(KeyError"),
    (lambda: _signed({"t": "tensor", "i": 0}, [{**_F32, "shape": [-2]}], b"\0" * 8), "outside the data"),
    (lambda: _signed({"t": "ndarray", "i": 0}, [_F32], b"\0" * 8), "an ndarray node points at a torch entry"),
    (lambda: _signed({"t": "tensor", "i": 0}, [_NP], b"\0" * 8), "a tensor node points at a numpy entry"),
    (lambda: _signed([1, 2], [], b""), "unexpected skeleton node list"),
    (lambda: _signed({"t": "set", "v": []}, [], b""), "unknown skeleton node 'set'"),
    (lambda: _signed({"t": "float", "v": "0xZZ"}, [], b""), r"bad skeleton node 'float' \(ValueError"),
    (lambda: _signed({"t": "dict", "items": [[{"t": "list", "v": []}, 1]]}, [], b""),
     r"bad skeleton node 'dict' \(TypeError"),                                 # an unhashable key
    (lambda: _signed(functools.reduce(lambda s, _: {"t": "list", "v": [s]}, range(300), None), [], b""),
     "skeleton nested too deeply"),
], ids=["header past the end", "header not utf-8", "header not json", "header a list", "other format",
        "no tensor table", "index out of range", "index a bool", "entry not an object", "unknown kind",
        "unknown dtype", "negative shape", "ndarray at torch", "tensor at numpy", "skeleton a list",
        "unknown node", "bad float", "unhashable key", "deep nesting"])
def test_every_forged_structure_is_a_checkpoint_error(blob, needle):
    """A file with a right checksum (anyone can compute one) and a forged header or skeleton: each lie is
    a CheckpointError saying what is wrong, never a crash, a KeyError or an object built from it."""
    with pytest.raises(CheckpointError, match=needle):
        checkpoint.loads(blob())
