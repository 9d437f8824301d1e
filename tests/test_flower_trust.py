"""The Flower server against hostile nodes (docs/flower.md, "Trust and failure semantics"): sample
counts, update checks, identity bound to keys, malformed messages (fuzzed), node-reported evaluation.

Every test drives the real ServerApp loop (`serve`) over `HostileGrid`, the in-process grid of
tests/test_flower.py with per-node authentication keys (`get_nodes()` gives `NodeInfo.public_key`, as
Flower's Grid does in a deployment with node authentication) and forged replies.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("flwr")

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict  # noqa: E402
from flwr.proto.node_pb2 import NodeInfo  # noqa: E402
from test_flower import (EXP4, NOT_RESULTS, FakeGrid, assert_same_state, in_process,  # noqa: E402,F401
                         nodes_for, offline,
                         run_config, task_identity)

from fedprism.algorithms.base import Plan, Update  # noqa: E402
from fedprism.experiment.store import Store  # noqa: E402
from fedprism.flower import codec  # noqa: E402
from fedprism.flower.node import build_node  # noqa: E402
from fedprism.flower.server_app import serve, server_data  # noqa: E402
from fedprism.flower.settings import RunSettings, parse_experiment  # noqa: E402
from fedprism.flower.spec import RunSpec  # noqa: E402
from fedprism.flower.trust import Refused, Registry, fingerprint, parse_identity, sample_count  # noqa: E402
from fedprism.protocol import EvalResult  # noqa: E402

FEDAVG4 = EXP4.replace("method=fedprism", "method=fedavg").replace(" fedprism.k=2 fedprism.every=1", "")


class HostileGrid(FakeGrid):
    """FakeGrid with node keys and forged replies.

    keys[nid]: the node's authentication public key (bytes), reported by `get_nodes()`.
    forge[nid] = (fn, real): fn(message, real reply content or None) -> content to send instead (None:
    send the real reply). With real=False the node's ClientApp never runs for that node.
    `forged` lists (node id, message type, round or None, client id or None) of every forged reply."""

    def __init__(self, *a, keys=None, forge=None, **kw):
        super().__init__(*a, **kw)
        self.keys = dict(keys or {})
        self.forge = dict(forge or {})
        self.forged: list[tuple] = []

    def get_nodes(self):
        return [NodeInfo(node_id=nid, public_key=self.keys.get(nid, b"")) for nid in self.nodes]

    def push_messages(self, messages):
        ids = []
        for m in messages:
            nid = m.metadata.dst_node_id
            if nid not in self.forge:
                ids += list(super().push_messages([m]))
                continue
            fn, real = self.forge[nid]
            if real:
                got = list(super().push_messages([m]))
                if not got:
                    continue
                mid = got[0]
                reply = self.replies.get(mid)
                content = reply.content if reply is not None and not reply.has_error() else None
            else:
                import uuid
                mid = uuid.uuid4().hex
                m.metadata.__dict__["_message_id"] = mid
                self.log.append((nid, m.metadata.message_type))
                content = None
            ids.append(mid)
            new = fn(m, content)
            if new is not None:
                task = m.content.config_records.get("task")
                rnd = task["round"] if m.metadata.message_type == "train" else None
                cid = task["client-id"] if task is not None and "client-id" in task else None
                self.forged.append((nid, m.metadata.message_type, rnd, cid))
                self.replies[mid] = Message(new, reply_to=m)
        return ids


def mutate(content: RecordDict, arrays: dict | None = None, meta: dict | None = None) -> RecordDict:
    """A copy of a train reply with some arrays / meta fields replaced (value None: removed)."""
    a = {k: content.array_records[codec.UPDATE][k] for k in content.array_records[codec.UPDATE].keys()}
    m = {k: content.config_records[codec.META][k] for k in content.config_records[codec.META].keys()}
    for k, v in (arrays or {}).items():
        if v is None:
            a.pop(k, None)
        else:
            a[k] = Array(np.ascontiguousarray(v))
    for k, v in (meta or {}).items():
        if v is None:
            m.pop(k, None)
        else:
            m[k] = v
    return RecordDict({codec.UPDATE: ArrayRecord(a), codec.META: ConfigRecord(m)})


def _train(fn):
    """Forge only train replies (identity and evaluation stay honest)."""
    return lambda m, real: fn(m, real) if m.metadata.message_type == "train" else None


def _node(grid_nodes: dict, cid: int) -> int:
    return next(nid for nid, c in grid_nodes.items() if c["client-id"] == cid)


# -- units ---------------------------------------------------------------------------------------------
def test_sample_count_rules():
    assert sample_count(120.0, 500) == (120.0, False)
    assert sample_count(1e9, 500) == (500.0, True)
    assert sample_count(1e9, None) == (1e9, False)
    for bad in (float("nan"), float("inf"), -1.0, 1e30, 2.5, "x", None):
        with pytest.raises(Refused, match="n_samples"):
            sample_count(bad, 500)


def test_identity_fields_are_named():
    ok = {"client-id": 1, "config-id": "abc", "input-shape": [64], "num-classes": 3, "param-size": 10,
          "num-examples": 5, "label-hist": [1, 2, 2]}
    assert parse_identity(ok, 4, "abc").client == 1
    for field, bad in (("client-id", "1"), ("client-id", 4), ("client-id", True), ("config-id", 7),
                       ("config-id", "other"), ("input-shape", "64"), ("input-shape", [0]), ("num-classes", 2.0),
                       ("param-size", -1), ("num-examples", float("nan")), ("num-examples", 10 ** 30),
                       ("label-hist", [1, 2]), ("label-hist", [1, -2, 2]), ("label-hist", None),
                       ("label-hist", [1, 1, 1])):
        with pytest.raises(Refused) as e:
            parse_identity({**ok, field: bad}, 4, "abc")
        assert e.value.field == field, (field, bad)
    with pytest.raises(Refused) as e:
        parse_identity({k: v for k, v in ok.items() if k != "param-size"}, 4, "abc")
    assert e.value.field == "param-size"


def test_registry_files(tmp_path):
    (tmp_path / "r.json").write_text(json.dumps({"nodes": {fingerprint(b"k0"): {"client": 0, "samples": 12},
                                                           "node:77": 1}}))
    r = Registry.load(str(tmp_path / "r.json"), 4)
    assert r.samples_of(0) == 12 and r.samples_of(1) is None
    assert r.lookup(["node:5", "node:77"])[1].client == 1
    (tmp_path / "r.toml").write_text(f'[nodes."{fingerprint(b"k2")}"]\nclient = 2\nsamples = 3\n')
    assert Registry.load(str(tmp_path / "r.toml"), 4).lookup([fingerprint(b"k2")])[1].client == 2
    for bad in ({"nodes": {"node:1": 0, "node:2": 0}}, {"nodes": {"x": 0}}, {"nodes": {"node:1": 9}}, {}):
        (tmp_path / "b.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError):
            Registry.load(str(tmp_path / "b.json"), 4)


def test_default_cap_is_the_largest_training_split():
    s = RunSettings.from_run_config({"experiment": FEDAVG4})
    shared, biggest, sizes, drift, spec = server_data(s)
    from fedprism.experiment.federation import build_federation
    fed = build_federation(s.cfg)
    assert biggest == int(max(len(ix) for ix in fed.train_idx))
    assert len(shared.x_train) == 0 and all(len(ix) == 0 for ix in shared.train_idx + shared.test_idx)
    assert torch.equal(shared.x_test, fed.x_test)                     # the public test split, nothing else
    assert sizes["local"].tolist() == [len(ix) for ix in fed.test_idx] and sizes["global"] == len(fed.y_test)
    assert drift is None                                              # static data
    assert (spec.input_shape, spec.num_classes) == (fed.input_shape, fed.num_classes)


# -- sample counts and update checks ------------------------------------------------------------------
def _state(path: Path) -> dict:
    return torch.load(path, weights_only=False)["state"]


def test_hostile_counts_and_values_are_rejected_and_the_honest_aggregate_stands(tmp_path, task_identity):
    """Client 3 reports n_samples NaN, inf, 1e30 (rounds 0, 1, 2); client 2 uploads parameters of 3e38.
    Every one is rejected and recorded; the run ends with the state of a run in which clients 2 and 3
    fail every round (the honest clients' aggregate)."""
    nodes = nodes_for(4)
    bad_n = {0: np.nan, 1: np.inf, 2: 1e30}

    def client3(m, real):
        rnd = m.content.config_records["task"]["round"]
        return mutate(real, {"n_samples": np.array([bad_n[rnd]])})

    def client2(m, real):
        p = real.array_records[codec.UPDATE]["u.params"].numpy()
        return mutate(real, {"u.params": np.full_like(p, 3e38)})

    rc = run_config(FEDAVG4, tmp_path / "h.db", save_final=str(tmp_path / "h.pt"))
    grid = HostileGrid(nodes, rc, forge={_node(nodes, 3): (_train(client3), True),
                                         _node(nodes, 2): (_train(client2), True)})
    res = serve(grid, rc)
    assert res.status == "finished"
    s = Store(tmp_path / "h.db")
    fails = [(f["round"], f["client"], f["data"]["reason"]) for f in s.records(res.run_id, "failure")]
    train = {(r, c): why for r, c, why in fails if why.startswith("train")}
    assert set(train) == {(r, c) for r in range(3) for c in (2, 3)}
    for r in range(3):
        assert "n_samples" in train[(r, 3)] and "rejected" in train[(r, 3)]
        assert "overflows float32" in train[(r, 2)]
    assert [m["accepted"] for m in s.round_metrics(res.run_id)] == [2, 2, 2]
    assert [m["rejected"] for m in s.round_metrics(res.run_id)] == [2, 2, 2]

    rc2 = run_config(FEDAVG4, tmp_path / "b.db", save_final=str(tmp_path / "b.pt"))
    crash = {_node(nodes, 2), _node(nodes, 3)}
    base = serve(FakeGrid(nodes, rc2, lambda nid, m: "raise" if nid in crash and m.metadata.message_type == "train"
                          else "ok"), rc2)
    assert base.status == "finished"
    assert_same_state(_state(tmp_path / "b.pt"), _state(tmp_path / "h.pt"), atol=0)


def test_a_billion_samples_weigh_as_the_cap(tmp_path, task_identity):
    """Client 0 says it has 10^9 samples (identity and every train reply): it weighs the cap (max-samples'
    default: the largest training split the partition gives a client), exactly as a client that reports
    the cap."""
    nodes = nodes_for(4)
    cap = server_data(RunSettings.from_run_config({"experiment": FEDAVG4}))[1]

    def claim(n):
        def fn(m, real):
            if m.metadata.message_type == "train":
                return mutate(real, {"n_samples": np.array([float(n)])})
            if m.metadata.message_type == "query.identity":
                rec = real.config_records[codec.IDENTITY]
                info = {k: rec[k] for k in rec.keys()}
                hist = [int(v) for v in info["label-hist"]]
                hist[0] += int(n) - sum(hist)                           # a histogram that agrees with the count
                info["num-examples"], info["label-hist"] = int(n), hist
                return RecordDict({codec.IDENTITY: ConfigRecord(info)})
            return None
        return fn

    out = {}
    for name, n in (("big", 10 ** 9), ("cap", cap)):
        rc = run_config(FEDAVG4, tmp_path / f"{name}.db", save_final=str(tmp_path / f"{name}.pt"))
        res = serve(HostileGrid(nodes, rc, forge={_node(nodes, 0): (claim(n), True)}), rc)
        assert res.status == "finished"
        out[name] = (res, Store(tmp_path / f"{name}.db"))
    assert_same_state(_state(tmp_path / "cap.pt"), _state(tmp_path / "big.pt"), atol=0)
    res, s = out["big"]
    capped = s.records(res.run_id, "capped")
    assert {(r["client"], r["data"]["field"]) for r in capped} == {(0, "num-examples"), (0, "n_samples")}
    assert all(r["data"]["used"] == cap for r in capped)
    from fedprism.flower.trust import scaled_hist
    assert scaled_hist((10 ** 9 - 2, 1, 1), cap).sum() == cap and scaled_hist((3, 1), 4).tolist() == [3, 1]
    assert out["cap"][1].records(out["cap"][0].run_id, "capped") == []


def test_update_norm_bound_rejects_or_clips(tmp_path, task_identity):
    nodes = nodes_for(4)

    def far(m, real):                                                  # an update of norm ~1e3
        p = real.array_records[codec.UPDATE]["u.params"].numpy()
        return mutate(real, {"u.params": p + np.float32(1e3 / np.sqrt(p.size))})

    got = {}
    for action in ("reject", "clip"):
        rc = run_config(FEDAVG4, tmp_path / f"{action}.db", update_norm_bound=50.0, norm_action=action)
        res = serve(HostileGrid(nodes, rc, forge={_node(nodes, 1): (_train(far), True)}), rc)
        s = Store(tmp_path / f"{action}.db")
        nb = s.records(res.run_id, "norm_bound")
        assert {r["client"] for r in nb} == {1} and len(nb) == 3 and all(r["data"]["action"] == action for r in nb)
        assert all(r["data"]["norm"] > 50.0 for r in nb)
        got[action] = [m["accepted"] for m in s.round_metrics(res.run_id)]
    assert got == {"reject": [3, 3, 3], "clip": [4, 4, 4]}


# -- identity bound to keys ---------------------------------------------------------------------------------
def test_registered_key_cannot_claim_another_client(tmp_path, task_identity):
    """The node holding client 3's registered key says it is client 0 (while client 0's real node is
    online). It is refused and recorded, client 0 keeps its node and its model, and the run's numbers
    are those of the run without the impostor."""
    nodes = {1000 + 17 * c: {"client-id": c} for c in range(3)}
    keys = {nid: f"key-of-client-{c['client-id']}".encode() for nid, c in nodes.items()}
    impostor = 10                                       # probed first: lower node id than every real node
    reg = {fingerprint(k): {"client": nodes[nid]["client-id"]} for nid, k in keys.items()}
    reg[fingerprint(b"key-of-client-3")] = {"client": 3}
    (tmp_path / "reg.json").write_text(json.dumps({"nodes": reg}))
    rc = run_config(FEDAVG4, tmp_path / "i.db", min_nodes=3, registry=str(tmp_path / "reg.json"),
                    save_final=str(tmp_path / "i.pt"))
    grid = HostileGrid(nodes, rc, keys={**keys, impostor: b"key-of-client-3"})
    grid.add_node(impostor, {"client-id": 0})
    res = serve(grid, rc)
    assert res.status == "finished"
    s = Store(tmp_path / "i.db")
    refused = [f for f in s.records(res.run_id, "failure") if f["data"].get("node") == impostor]
    assert refused and all(f["data"]["field"] == "client-id" and "registered for client 3" in f["data"]["reason"]
                           for f in refused)
    assert [t for n, t in grid.log if n == impostor] and all(t == "query.identity" for n, t in grid.log
                                                              if n == impostor)
    ev = s.records(res.run_id, "flower_node")
    assert not [e for e in ev if e["data"]["event"] == "remapped"]
    assert {e["client"]: e["data"]["node"] for e in ev if e["data"]["event"] == "joined"} == \
        {c["client-id"]: nid for nid, c in nodes.items()}

    rc2 = run_config(FEDAVG4, tmp_path / "n.db", min_nodes=3, registry=str(tmp_path / "reg.json"),
                     save_final=str(tmp_path / "n.pt"))
    base = serve(HostileGrid(nodes, rc2, keys=keys), rc2)
    assert_same_state(_state(tmp_path / "n.pt"), _state(tmp_path / "i.pt"), atol=0)
    assert base.final["local_acc"] == res.final["local_acc"]

    # a node whose key is not in the registry is refused too
    rc3 = run_config(FEDAVG4.replace("rounds=3", "rounds=1"), tmp_path / "u.db", min_nodes=3,
                     registry=str(tmp_path / "reg.json"))
    grid3 = HostileGrid(nodes, rc3, keys=keys)
    grid3.add_node(11, {"client-id": 3})
    grid3.keys[11] = b"unknown"
    res3 = serve(grid3, rc3)
    assert any(f["data"].get("node") == 11 and f["data"]["field"] == "registry"
               for f in Store(tmp_path / "u.db").records(res3.run_id, "failure"))


def test_registry_by_node_id(tmp_path, task_identity):
    """Without node authentication the registry maps Flower node ids ('node:<id>')."""
    nodes = nodes_for(4)
    (tmp_path / "reg.toml").write_text("".join(f'[nodes."node:{nid}"]\nclient = {c["client-id"]}\n'
                                               for nid, c in nodes.items() if c["client-id"] != 2))
    rc = run_config(FEDAVG4.replace("rounds=3", "rounds=1"), tmp_path / "t.db", min_nodes=3,
                    registry=str(tmp_path / "reg.toml"))
    res = serve(FakeGrid(nodes, rc), rc)
    s = Store(tmp_path / "t.db")
    f = [r for r in s.records(res.run_id, "failure") if r["data"].get("phase") == "identity"]
    assert f and all(r["client"] == 2 and r["data"]["field"] == "registry" for r in f)
    assert s.round_metrics(res.run_id)[0]["accepted"] == 3


def test_without_registry_an_online_clients_id_is_not_taken_over(tmp_path, task_identity):
    nodes = nodes_for(4)
    rc = run_config(FEDAVG4, tmp_path / "o.db", save_final=str(tmp_path / "o.pt"))
    grid = FakeGrid(nodes, rc)
    grid.add_node(99_000, {"client-id": 1})               # a second node says it is client 1
    res = serve(grid, rc)
    s = Store(tmp_path / "o.db")
    refused = [f for f in s.records(res.run_id, "failure") if f["data"].get("node") == 99_000]
    assert refused and "is held by node" in refused[0]["data"]["reason"] and refused[0]["client"] == 1
    assert not [e for e in s.records(res.run_id, "flower_node") if e["data"]["event"] == "remapped"]
    assert all(t == "query.identity" for n, t in grid.log if n == 99_000)


# -- malformed messages (fuzz) --------------------------------------------------------------------------------
def _bad_identity(rng: np.random.Generator, good: dict) -> RecordDict:
    kind = int(rng.integers(0, 16))
    info = dict(good)
    if kind == 0:
        return RecordDict({"other": ConfigRecord({"x": 1})})                  # no identity record
    if kind == 1:
        del info[str(rng.choice(sorted(info)))]                                # a missing field
        if "client-id" in info and "config-id" in info and "method" not in good:
            pass
        if set(good) - set(info) <= {"method", "num-test"}:
            info["client-id"] = "x"
    elif kind == 2:
        info["client-id"] = str(good["client-id"])
    elif kind == 3:
        info["client-id"] = int(rng.choice([-1, 10 ** 6]))
    elif kind == 4:
        info["client-id"] = float(good["client-id"]) + 0.5
    elif kind == 5:
        info["config-id"] = "f" * 16
    elif kind == 6:
        info["config-id"] = int(rng.integers(0, 100))
    elif kind == 7:
        info["input-shape"] = [int(v) + 1 for v in good["input-shape"]]
    elif kind == 8:
        info["input-shape"] = "64"
    elif kind == 9:
        info["num-classes"] = float(rng.choice([np.nan, np.inf, 3.5]))
    elif kind == 10:
        info["num-classes"] = int(good["num-classes"]) + 1
    elif kind == 11:
        info["param-size"] = int(good["param-size"]) + int(rng.integers(1, 100))
    elif kind == 12:
        info["num-examples"] = float(rng.choice([np.nan, np.inf, -1.0, 1e300]))
    elif kind == 13:
        info["num-examples"] = -int(rng.integers(1, 100))
    elif kind == 14:
        info["label-hist"] = [int(v) for v in good["label-hist"]][:-1]
    else:
        info["label-hist"] = [float("nan")] * len(good["label-hist"])
    return RecordDict({codec.IDENTITY: ConfigRecord(info)})


def _bad_train(rng: np.random.Generator, m: Message, template: RecordDict, other: int) -> RecordDict:
    P = template.array_records[codec.UPDATE]["u.params"].numpy().shape[1]
    good = codec.decode_plan(m.content)[0].payload["params"].numpy() + 0.01
    base = mutate(template, {"u.params": good.astype(np.float32)}, {"client-id": int(m.content.config_records["task"]
                                                                                   ["client-id"])})
    kind = int(rng.integers(0, 24))
    big = lambda v: np.full((1, P), v, dtype=np.float32)  # noqa: E731
    nan_at = good.astype(np.float32).copy()
    nan_at[0, int(rng.integers(0, P))] = float(rng.choice([np.nan, np.inf, -np.inf]))
    return {
        0: lambda: RecordDict({codec.META: base.config_records[codec.META]}),                   # no arrays
        1: lambda: RecordDict({codec.UPDATE: base.array_records[codec.UPDATE]}),                 # no meta
        2: lambda: mutate(base, meta={"payload": 7}),
        3: lambda: mutate(base, meta={"payload": [1, 2]}),
        4: lambda: mutate(base, {"u.params": None}),
        5: lambda: mutate(base, {"u.params": np.zeros((1, P + int(rng.integers(1, 9))), np.float32)}),
        6: lambda: mutate(base, {"u.params": np.zeros((P,), np.float32)}),
        7: lambda: mutate(base, {"u.params": nan_at}),
        8: lambda: mutate(base, {"u.params": big(3e38)}),
        9: lambda: mutate(base, {"u.params": big(float(rng.choice([1e10, 1e20, 1e30])))}),
        10: lambda: mutate(base, {"u.params": good.astype(np.int64)}),
        11: lambda: mutate(base, {"u.params": np.zeros((1, 0), np.float32)}),
        12: lambda: mutate(base, {"n_samples": np.array([float(rng.choice([np.nan, np.inf, -np.inf]))])}),
        13: lambda: mutate(base, {"n_samples": np.array([float(rng.choice([-1.0, 0.0, 2.5, 1e30, 1e300]))])}),
        14: lambda: mutate(base, {"n_samples": np.array([5.0, 5.0])}),
        15: lambda: mutate(base, {"n_samples": np.array([5], dtype=np.int64)}),
        16: lambda: mutate(base, {"n_samples": None}),
        17: lambda: mutate(base, {"m.train_loss": np.array([np.nan])}),
        18: lambda: mutate(base, {"m.train_loss": np.zeros((3, 2))}),
        19: lambda: mutate(base, meta={"client-id": str(rng.choice(["x", "1.5", ""]))}),
        20: lambda: mutate(base, meta={"client-id": other}),
        21: lambda: mutate(base, meta={"config-id": str(rng.choice(["", "0" * 16, "other"]))}),
        22: lambda: mutate(base, meta={"config-id": None}),
        23: lambda: mutate(base, {"u.evil": np.zeros((1, 3), np.float32)}, {"payload": ["evil", "params"]}),
    }[kind]()


def _bad_scores(rng: np.random.Generator, m: Message) -> RecordDict:
    kind = int(rng.integers(0, 6))
    n = 1
    ok = {"correct": np.array([3]), "loss_sum": np.array([1.0]), "count": np.array([5]),
          "confusion": np.zeros((n, 10, 10), dtype=np.int64)}
    ok["confusion"][0, 0, 0] = 5
    bad = dict(ok)
    if kind == 0:
        bad["correct"] = np.array([9])                          # more correct than counted
    elif kind == 1:
        bad["loss_sum"] = np.array([np.nan])
    elif kind == 2:
        bad["count"] = np.array([-5])
    elif kind == 3:
        bad["confusion"] = np.zeros((n, 3, 3), dtype=np.int64)
    elif kind == 4:
        del bad["count"]
    else:
        bad["correct"] = np.array([3.0])
    cid = m.content.config_records["task"]["client-id"]
    return RecordDict({codec.SCORES: ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in bad.items()}),
                       codec.META: ConfigRecord({"client-id": int(cid)})})


def test_fuzzed_messages_never_stop_the_server(tmp_path, task_identity):
    """At least 200 malformed identity replies (from 200 nodes that never identify properly) and 200
    malformed train replies (22 of 24 clients, 12 rounds; missing fields, wrong types and shapes, NaN,
    huge values, wrong experiment id), plus malformed evaluation replies: the run completes with the two
    honest clients, and every forged message has its record."""
    exp = ("method=fedavg dataset=digits clients=24 rounds=12 fraction=1.0 local_epochs=1 lr=0.05 model=mlp "
           "device=cpu engine=sequential partition.alpha=5.0 seed=4 eval_every=12")
    rng = np.random.default_rng(20261123)
    honest = {2000: {"client-id": 0}, 2001: {"client-id": 1}}
    hostile = {3000 + c: {"client-id": c} for c in range(2, 24)}
    noisy = {5000 + k: {"client-id": int(k % 24)} for k in range(200)}
    rc = run_config(exp, tmp_path / "z.db", min_nodes=24, update_norm_bound=100.0, probe_timeout=3600.0)
    template_node = build_node(exp, 0)
    good_ident = template_node.identity()
    from fedprism.protocol import Update
    template = codec.encode_update(Update(np.array([0]), {"params": torch.zeros(1, template_node.engine.spec.size)},
                                          torch.tensor([50.0], dtype=torch.float64),
                                          {"train_loss": torch.tensor([0.5], dtype=torch.float64)}), 0,
                                   parse_experiment(exp).run_id)

    def hostile_fn(m, real):
        cid = int(hostile[m.metadata.dst_node_id]["client-id"])
        t = m.metadata.message_type
        if t == "query.identity":
            info = {**good_ident, "client-id": cid}
            return RecordDict({codec.IDENTITY: ConfigRecord(info)})
        if t == "train":
            return _bad_train(rng, m, template, other=(cid + 1) % 24)
        return _bad_scores(rng, m)

    def noisy_fn(m, real):
        return _bad_identity(rng, {**good_ident, "client-id": int(noisy[m.metadata.dst_node_id]["client-id"])})

    forge = {**{nid: (hostile_fn, False) for nid in hostile}, **{nid: (noisy_fn, False) for nid in noisy}}
    grid = HostileGrid({**honest, **hostile, **noisy}, rc, forge=forge)
    res = serve(grid, rc)
    assert res.status == "finished"
    s = Store(tmp_path / "z.db")
    idents = [f for f in grid.forged if f[1] == "query.identity" and f[0] in noisy]
    trains = [f for f in grid.forged if f[1] == "train"]
    evals = [f for f in grid.forged if f[1] == "evaluate"]
    assert len(idents) >= 200 and len(trains) >= 200 and evals
    fails = s.records(res.run_id, "failure") + s.records(res.run_id, "rejected")
    by_node = {}
    for f in fails:
        if f["data"].get("phase") == "identity":
            by_node[f["data"]["node"]] = by_node.get(f["data"]["node"], 0) + 1
    for nid in noisy:
        assert by_node.get(nid, 0) == sum(1 for f in idents if f[0] == nid), nid
    train_recs = {(f["round"], f["client"]) for f in fails if "phase" not in f["data"]}
    missing = [(r, c) for _, _, r, c in trains if (r, c) not in train_recs]
    assert not missing, missing[:5]
    eval_recs = {f["client"] for f in fails if f["data"].get("phase") == "evaluate"}
    assert {c for *_, c in evals} <= eval_recs
    assert all(m["accepted"] == 2 for m in s.round_metrics(res.run_id))
    assert Store(tmp_path / "z.db").run(res.run_id)["status"] == "finished"


def _all_correct(real: RecordDict, scale: int = 1) -> RecordDict:
    """A node's evaluation reply rewritten to claim every row correct (row counts times `scale`)."""
    sc = real.array_records[codec.SCORES]
    count = sc["count"].numpy() * scale
    conf = np.zeros_like(sc["confusion"].numpy())
    conf[:, 0, 0] = count
    return RecordDict({codec.SCORES: ArrayRecord({"correct": Array(count.copy()), "count": Array(count.copy()),
                                                  "loss_sum": Array(np.zeros(len(count))),
                                                  "confusion": Array(conf)}),
                       codec.META: real.config_records[codec.META]})


# -- evaluation trust -----------------------------------------------------------------------------------------
def test_global_test_set_is_scored_on_the_server(tmp_path, task_identity):
    """A node that reports perfect scores for everything it is asked to evaluate: with global-eval=server
    (the default) the global accuracy is the in-process one; the local scores it reports are stored, and
    marked node-reported. With global-eval=nodes its lie reaches the global accuracy."""
    exp = FEDAVG4.replace("rounds=3", "rounds=1")
    ref, final = in_process(exp, tmp_path / "ref.db")
    nodes = nodes_for(4)

    def liar(m, real):
        if m.metadata.message_type != "evaluate":
            return None
        return _all_correct(real)

    out = {}
    for mode in ("server", "nodes"):
        rc = run_config(exp, tmp_path / f"{mode}.db", global_eval=mode)
        res = serve(HostileGrid(nodes, rc, forge={_node(nodes, 0): (liar, True)}), rc)
        s = Store(tmp_path / f"{mode}.db")
        out[mode] = (res, s.round_metrics(res.run_id)[-1], s.records(res.run_id, "eval_trust"))
    res, last, trust = out["server"]
    assert res.final["global_acc"] == pytest.approx(final["global_acc"], abs=1e-12)
    assert last["node_reported"] == 1 and last["global_on_server"] == 1
    assert "local_acc" in trust[-1]["data"]["node_reported"] and "global_acc" in trust[-1]["data"]["server_scored"]
    assert res.final["local_acc"] > final["local_acc"]              # the lie about its own test split stands
    res_n, last_n, trust_n = out["nodes"]
    assert last_n["global_on_server"] == 0 and "global_acc" in trust_n[-1]["data"]["node_reported"]
    assert res_n.final["global_acc"] > final["global_acc"]


def test_only_the_registered_key_moves_a_client_to_a_new_node(tmp_path):
    """Link-level: client 1's registered key reconnects under a new node id while its old node id is
    still listed online (Flower drops a dead node only after missed heartbeats): re-mapped. Another node
    claiming client 1 is refused, with or without a registry, while the holder is online."""
    from fedprism.flower.server import Link

    class Stub:
        def __init__(self):
            self.keys: dict[int, bytes] = {}

        def get_node_ids(self):
            return list(self.keys)

        def get_nodes(self):
            return [NodeInfo(node_id=n, public_key=k) for n, k in self.keys.items()]

    info = {"client-id": 1, "config-id": "cfg", "input-shape": [64], "num-classes": 10, "param-size": 100,
            "num-examples": 40, "label-hist": [4] * 10}
    (tmp_path / "reg.json").write_text(json.dumps({"nodes": {fingerprint(b"K1"): {"client": 1}}}))
    grid = Stub()
    spec = RunSpec((64,), 10, 100)
    link = Link(grid, 4, "cfg", log=lambda m: None, registry=Registry.load(str(tmp_path / "reg.json"), 4),
                spec=spec)
    grid.keys = {10: b"K1", 20: b"K1", 30: b"K9"}
    link._admit(10, info)
    link._admit(30, info)                                             # not registered
    link._admit(20, info)                                             # the registered key, new node id
    assert link.node_of == {1: 20} and 10 not in link.client_of
    ev = [(k, c, d.get("event"), d.get("field"), d.get("node")) for k, c, d in link.pop_events()]
    assert ("failure", 1, None, "registry", 30) in ev and ("flower_node", 1, "remapped", None, 20) in ev

    plain = Link(grid, 4, "cfg", log=lambda m: None, spec=spec)
    plain._admit(10, info)
    plain._admit(20, info)                                            # no registry: 10 is online, refused
    assert plain.node_of == {1: 10}
    assert [d["field"] for k, c, d in plain.pop_events() if k == "failure"] == ["client-id"]
    del grid.keys[10]                                                  # node 10 goes offline ...
    plain.refresh = lambda: None
    plain._forget(10, "offline")
    plain._admit(20, info)                                             # ... then node 20 may take client 1
    assert plain.node_of == {1: 20}


def test_a_node_cannot_reweigh_its_scores(tmp_path, task_identity):
    """A node that claims 100 times its test rows (all correct) to weigh more in the sample-weighted
    means: the server knows each split's size (it builds the partition), refuses the score (field
    'count') and the client has no score that round."""
    exp = FEDAVG4.replace("rounds=3", "rounds=1")
    nodes = nodes_for(4)

    def inflate(m, real):
        if m.metadata.message_type != "evaluate":
            return None
        return _all_correct(real, 100)

    rc = run_config(exp, tmp_path / "w.db")
    res = serve(HostileGrid(nodes, rc, forge={_node(nodes, 1): (inflate, True)}), rc)
    s = Store(tmp_path / "w.db")
    f = [r for r in s.records(res.run_id, "failure") if r["data"].get("phase") == "evaluate"]
    assert f and all(r["client"] == 1 and "field 'count'" in r["data"]["reason"] for r in f)
    rows = {r["client"]: r for r in s.client_rows(res.run_id, 0)}
    assert rows[1]["local_acc"] is None or rows[1]["n_test"] == 0
    assert rows[0]["local_acc"] is not None


def test_registered_sample_count_is_the_weight(tmp_path, task_identity):
    """The registry lists client 0 with 100 samples: its replies weigh 100 whatever it reports (as a
    node that reports 100 without a registry), recorded `registry_count`."""
    nodes = nodes_for(4)
    reg = {f"node:{nid}": ({"client": 0, "samples": 100} if c["client-id"] == 0 else c["client-id"])
           for nid, c in nodes.items()}
    (tmp_path / "reg.json").write_text(json.dumps({"nodes": reg}))
    rc = run_config(FEDAVG4, tmp_path / "r.db", registry=str(tmp_path / "reg.json"), save_final=str(tmp_path / "r.pt"))
    res = serve(FakeGrid(nodes, rc), rc)
    recs = Store(tmp_path / "r.db").records(res.run_id, "registry_count")
    assert sorted(r["data"]["field"] for r in recs) == ["n_samples"] * 3 + ["num-examples"]
    assert all(r["client"] == 0 and r["data"]["used"] == 100 for r in recs)
    rc2 = run_config(FEDAVG4, tmp_path / "f.db", save_final=str(tmp_path / "f.pt"))
    serve(HostileGrid(nodes, rc2, forge={_node(nodes, 0): (_train(lambda m, real: mutate(
        real, {"n_samples": np.array([100.0])})), True)}), rc2)
    assert_same_state(_state(tmp_path / "f.pt"), _state(tmp_path / "r.pt"), atol=0)


# -- differentially private statistics --------------------------------------------------------------------------
def test_laplace_hist_scale():
    from fedprism.flower.trust import laplace_hist
    rng = np.random.default_rng(0)
    hist = np.full(20_000, 50)
    for eps in (0.5, 2.0):
        out = laplace_hist(hist, eps, rng)
        assert out.dtype == np.int64 and (out >= 0).all()
        # |Laplace(b)| is Exp(1/b); rounded: P(k) = e^{-(k-1/2)/b} - e^{-(k+1/2)/b}, so
        # E|round(X)| = sum_{k>=1} e^{-(k-1/2)/b} = e^{-1/(2b)} / (1 - e^{-1/b}), b = 1/eps
        b = 1 / eps
        assert np.mean(np.abs(out - hist)) == pytest.approx(np.exp(-0.5 / b) / (1 - np.exp(-1 / b)), rel=0.05)


def test_nodes_release_their_label_counts_with_dp(tmp_path, task_identity):
    """stats-epsilon > 0: each node's label histogram reaches the server noised once (the same release
    at every later query), its total is the node's num-examples and train-reply n_samples; the run
    finishes. stats-epsilon = 0 (default): exact counts."""
    exp = FEDAVG4.replace("rounds=3", "rounds=2")
    nodes = nodes_for(4)
    seen: list[tuple[int, list[int], int]] = []
    train_n: list[tuple[int, float]] = []

    def spy(m, real):
        if m.metadata.message_type == "query.identity":
            rec = real.config_records[codec.IDENTITY]
            seen.append((int(rec["client-id"]), list(rec["label-hist"]), int(rec["num-examples"])))
        elif m.metadata.message_type == "train":
            train_n.append((int(real.config_records[codec.META]["client-id"]),
                            float(real.array_records[codec.UPDATE]["n_samples"].numpy()[0])))
        return None

    rc = run_config(exp, tmp_path / "dp.db", stats_epsilon=1.0)
    grid = HostileGrid(nodes, rc, forge={nid: (spy, True) for nid in nodes})
    res = serve(grid, rc)
    assert res.status == "finished"
    true = {c: build_node(exp, c).label_hist.tolist() for c in range(4)}
    assert {c for c, _, _ in seen} == {0, 1, 2, 3}
    assert any(h != true[c] for c, h, _ in seen)            # noised (all 40 counts exact: probability ~1e-16)
    assert all(sum(h) == n for _, h, n in seen)
    released = {c: n for c, _, n in seen}
    assert all(n == max(released[c], 1) for c, n in train_n)
    # a second identity query of the same node gets the same release
    nid = next(iter(nodes))
    q = Message(RecordDict({codec.TASK: ConfigRecord({"config-id": "x"})}), dst_node_id=nid,
                message_type="query.identity")
    again = []
    grid.forge[nid] = (lambda m, real: again.append(list(real.config_records[codec.IDENTITY]["label-hist"])), True)
    grid.push_messages([q])
    assert again and again[0] == next(h for c, h, _ in seen if c == nodes[nid]["client-id"])


def test_zero_samples_is_refused(tmp_path, task_identity):
    nodes = nodes_for(4)
    rc = run_config(FEDAVG4.replace("rounds=3", "rounds=2"), tmp_path / "zero.db")
    zero = _train(lambda m, real: mutate(real, {"n_samples": np.array([0.0])}))
    res = serve(HostileGrid(nodes, rc, forge={_node(nodes, 1): (zero, True)}), rc)
    s = Store(tmp_path / "zero.db")
    f = [(r["round"], r["client"]) for r in s.records(res.run_id, "failure") if "0 samples" in r["data"]["reason"]]
    assert f == [(0, 1), (1, 1)]
    assert [m["accepted"] for m in s.round_metrics(res.run_id)] == [3, 3]


# -- bounded resources ----------------------------------------------------------------------------------------
def test_size_keys_are_bounded_on_the_server_and_on_the_nodes(tmp_path):
    """A size key beyond the data or the machine is a ConfigError naming the key: on the server before it
    waits for any node, and on a node before it builds its engine (its reply is then an error)."""
    from fedprism.errors import ConfigError

    exp = FEDAVG4.replace("local_epochs=1", "local_epochs=1000000000")
    rc = run_config(exp, tmp_path / "r.db")
    grid = FakeGrid(nodes_for(4), rc)
    with pytest.raises(ConfigError, match=r"'local_epochs' = 1000000000.*at most \d+ here"):
        serve(grid, rc)
    assert grid.log == []                                   # refused before a single message went out
    with pytest.raises(ConfigError, match="local_epochs"):
        build_node(exp, 0)
    assert Store(tmp_path / "r.db").runs() == []


def test_a_node_whose_new_state_is_nan_keeps_its_state_and_replies_an_error():
    """As in process (`runner.receive`): a client whose training left its own model NaN does not keep it.
    The node raises, so the server records the client's failure, and its next round starts from the last
    finite state."""
    from fedprism.protocol import Plan

    node = build_node("method=local dataset=digits clients=4 rounds=2 local_epochs=1 model=mlp device=cpu "
                      "engine=sequential", 0)
    before = {k: v.clone() for k, v in node.store.rows().items()}
    real = node.algo.client_update

    def diverge(plan, trainer, rnd, cstate):
        up = real(plan, trainer, rnd, cstate)
        up.client_state["w"][0, 3] = float("inf")
        return up

    node.algo.client_update = diverge
    with pytest.raises(ValueError, match="client state 'w': non-finite values"):
        node.train(Plan(np.array([0])), 0)
    assert all(torch.equal(v, node.store.rows()[k]) for k, v in before.items())
    node.algo.client_update = real
    node.train(Plan(np.array([0])), 0)
    assert not torch.equal(before["w"], node.store.rows()["w"])          # a finite state is kept


# -- the codec, message by message ---------------------------------------------------------------------------
def _plan_row(P: int = 4) -> Plan:
    return Plan(np.array([2]), {"params": torch.zeros(1, P)})


def _reply(P: int = 4) -> RecordDict:
    up = Update(np.array([2]), {"params": torch.ones(1, P)}, torch.tensor([7.0], dtype=torch.float64),
                {"train_loss": torch.tensor([0.5])})
    return codec.encode_update(up, 2, config_id="abc")


def _scores(**change) -> RecordDict:
    r = EvalResult(torch.tensor([3, 1]), torch.tensor([1.5, 0.25], dtype=torch.float64), torch.tensor([4, 2]),
                   torch.tensor([[[2, 1], [0, 1]], [[1, 0], [1, 0]]]), {"proto": torch.tensor([4, 0])})
    content = codec.encode_scores(r, 2)
    a = {k: content.array_records[codec.SCORES][k] for k in content.array_records[codec.SCORES].keys()}
    for k, v in change.items():
        if v is None:
            a.pop(k)
        else:
            a[k] = Array(np.ascontiguousarray(v))
    return RecordDict({codec.SCORES: ArrayRecord(a), codec.META: content.config_records[codec.META]})


@pytest.mark.parametrize("content, needle", [
    (lambda: RecordDict({codec.META: _reply().config_records[codec.META]}), "record .* missing"),
    (lambda: mutate(_reply(), meta={"config-id": "other"}),
     "field 'config-id': the reply is for experiment 'other', the server runs abc"),
    (lambda: mutate(_reply(), meta={"payload": None}), "field 'payload' missing"),
    (lambda: mutate(_reply(), meta={"payload": "params"}),
     "field 'payload' must be a list of names, got str"),
    (lambda: mutate(_reply(), {"u.params": None}), "tensor 'u.params' missing"),
    (lambda: mutate(_reply(), {"n_samples": np.array([7], dtype=np.int64)}),
     "field 'n_samples' must be one float"),
    (lambda: mutate(_reply(), {"u.params": np.ones((2, 4), np.float32)}),
     "tensor 'params' must have one row"),
    (lambda: mutate(_reply(), {"m.train_loss": np.array([np.inf], np.float32)}),
     "tensor 'm.train_loss' must hold finite numbers"),
], ids=["no update record", "other experiment", "no payload names", "payload names a string",
        "tensor missing", "integer count", "two rows", "infinite loss"])
def test_a_malformed_train_reply_is_refused_naming_the_field(content, needle):
    """Each way a train reply can be malformed is a ValueError naming the field (the server records it as
    that client's failure: `test_fuzzed_messages_never_stop_the_server`)."""
    with pytest.raises(ValueError, match=needle):
        codec.decode_update(content(), _plan_row(), config_id="abc")
    up = codec.decode_update(_reply(), _plan_row(), config_id="abc")           # the well-formed reply
    assert up.n_samples.tolist() == [7.0] and torch.equal(up.payload["params"], torch.ones(1, 4))


def test_a_diverged_nodes_nan_loss_passes_decoding_for_the_runner_to_reject():
    up = codec.decode_update(mutate(_reply(), {"u.params": np.full((1, 4), np.nan, np.float32),
                                               "m.train_loss": np.array([np.nan], np.float32)}),
                             _plan_row(), config_id="abc")
    assert torch.isnan(up.payload["params"]).all() and torch.isnan(up.metrics["train_loss"]).all()


@pytest.mark.parametrize("change, needle", [
    ({"correct": None}, "tensor 'correct' missing"),
    ({"correct": np.array([3.0, 1.0])}, r"field 'correct' must be 2 integers, got \(2,\) torch.float64"),
    ({"count": np.array([4, 2, 1])}, "field 'correct' must be 3 integers"),
    ({"loss_sum": np.array([1.5, -0.25])}, "field 'loss_sum' must be 2 finite numbers >= 0"),
    ({"loss_sum": np.array([1.5, np.nan])}, "field 'loss_sum' must be 2 finite numbers >= 0"),
    ({"correct": np.array([5, 1])}, "need 0 <= correct <= count"),
    ({"confusion": np.array([[[2, 1], [0, 0]], [[1, 0], [1, 0]]])}, "counts summing to 'count'"),
    ({"confusion": np.array([[[2, 1], [0, 1]], [[1, 0], [1, 0]]]).astype(np.float32)}, "counts summing to"),
    ({"alt:proto": np.array([5, 0])}, r"field 'alt:proto' must lie in \[0, count\]"),
], ids=["no correct", "float correct", "count of 3", "negative loss", "nan loss", "correct > count",
        "confusion sums", "float confusion", "alternative > count"])
def test_malformed_scores_are_refused_naming_the_field(change, needle):
    with pytest.raises(ValueError, match=needle):
        codec.decode_scores(_scores(**change), num_classes=2)
    r = codec.decode_scores(_scores(), num_classes=2)
    assert r.correct.tolist() == [3, 1] and r.alternatives["proto"].tolist() == [4, 0]
    with pytest.raises(ValueError, match=r"\[2, C, C\] counts"):
        codec.decode_scores(_scores(), num_classes=3)                           # other number of classes
    with pytest.raises(ValueError, match="record .* missing"):
        codec.decode_scores(RecordDict({codec.META: _scores().config_records[codec.META]}))


def test_a_node_refuses_messages_that_are_not_for_it_or_malformed():
    """The node side of a hostile or broken server: a plan for another client, an unknown split, parameter
    rows that do not match the splits, a client id outside the federation, and a drifting federation's
    message without its round are each a ValueError naming the problem, and the node's state is unchanged."""
    exp = ("method=local dataset=digits clients=4 rounds=2 local_epochs=1 model=mlp device=cpu "
           "engine=sequential")
    node = build_node(exp, 1)
    before = {k: v.clone() for k, v in node.store.rows().items()}
    P = node.engine.spec.size
    with pytest.raises(ValueError, match=r"this node is client 1; the message is for clients \[2\]"):
        node.train(Plan(np.array([2])), 0)
    with pytest.raises(ValueError, match=r"this node is client 1; the message is for clients \[1, 2\]"):
        node.train(Plan(np.array([1, 2])), 0)
    with pytest.raises(ValueError, match="unknown split 'secret': one of"):
        node.evaluate(torch.zeros(1, P), ["secret"])
    with pytest.raises(ValueError, match=r"\(1, \d+\) parameter rows for 2 splits"):
        node.evaluate(torch.zeros(1, P), ["local", "train"])
    assert all(torch.equal(v, before[k]) for k, v in node.store.rows().items())
    assert node.evaluate(torch.zeros(2, P), ["local", "train"]).count.shape == (2,)     # well-formed: scored
    for bad in (-1, 4):
        with pytest.raises(ValueError, match=r"client id -?\d outside \[0, 3\]"):
            build_node(exp, bad)
    drifting = build_node(exp + " drift.fraction=0.5", 0)
    with pytest.raises(ValueError, match="field 'round' missing: under drift.fraction > 0"):
        drifting.evaluate(torch.zeros(1, P), ["local"])


# -- the server decides the run's data and model: a node's identity is checked against it --------------------
def _lie(fields: dict):
    """An identity forger: the node's real identity with `fields` replaced (a callable value maps the real
    value); train and evaluate replies stay honest (they never come: the liar is refused)."""
    def fn(m, real):
        if m.metadata.message_type != "query.identity" or real is None:
            return None
        rec = real.config_records[codec.IDENTITY]
        info = {k: rec[k] for k in rec.keys()}
        for k, v in fields.items():
            info[k] = v(info[k]) if callable(v) else v
        return RecordDict({codec.IDENTITY: ConfigRecord(info)})
    return fn


LIES = {
    "shape": ({"input-shape": [1, 9, 9]}, "input-shape"),
    "classes": ({"num-classes": 11, "label-hist": lambda h: [*h, 0]}, "num-classes"),
    "huge shape": ({"input-shape": [2 ** 31]}, "input-shape"),      # the model for it: ~10^12 bytes
    "model size": ({"param-size": lambda p: p + 1}, "param-size"),
}


def test_a_node_lying_about_its_data_is_refused_alone_and_the_run_is_that_without_it(tmp_path, task_identity):
    """No registry. A fifth node claims client 0 and answers the identity query first (lowest node id)
    with another input shape, class count, a shape of 2^31 features, or another model size. It used to
    fix those for the run: every honest node was then refused and `min-nodes` never reached (or, with
    `min-nodes=1`, the server allocated the liar's model). The server decides them from its own
    configuration: the liar alone is refused (failure record naming its field), the four honest nodes
    are admitted, and the run's numbers and final state are those of the run without the liar."""
    exp = FEDAVG4.replace("rounds=3", "rounds=1")
    nodes = nodes_for(4)
    rc = run_config(exp, tmp_path / "ref.db", save_final=str(tmp_path / "ref.pt"), nodes_timeout=20.0)
    ref = serve(FakeGrid(nodes, rc), rc)
    ref_metrics = Store(tmp_path / "ref.db").round_metrics(ref.run_id)
    liar = 5                                                      # below every honest node id: asked first
    for name, (fields, field) in LIES.items():
        db = tmp_path / f"{name}.db"
        rc = run_config(exp, db, save_final=str(tmp_path / f"{name}.pt"), nodes_timeout=20.0)
        grid = HostileGrid(nodes, rc, forge={liar: (_lie(fields), True)})
        grid.add_node(liar, {"client-id": 0})
        res = serve(grid, rc)
        assert res.status == "finished", name
        s = Store(db)
        refused = [f for f in s.records(res.run_id, "failure") if f["data"].get("phase") == "identity"]
        assert refused and all(f["data"]["node"] == liar and f["data"]["field"] == field
                               for f in refused), name
        assert not [f for f in s.records(res.run_id, "failure") if f["data"].get("node") not in (None, liar)]
        joined = {r["client"]: r["data"]["node"] for r in s.records(res.run_id, "flower_node")
                  if r["data"]["event"] == "joined"}
        assert joined == {c["client-id"]: nid for nid, c in nodes.items()}, name
        assert {t for n, t in grid.log if n == liar} == {"query.identity"}, name
        strip = lambda ms: [{k: v for k, v in m.items() if k not in NOT_RESULTS} for m in ms]  # noqa: E731
        assert strip(s.round_metrics(res.run_id)) == strip(ref_metrics), name
        assert_same_state(_state(tmp_path / "ref.pt"), _state(tmp_path / f"{name}.pt"), atol=0)


def test_no_allocation_is_sized_from_a_nodes_claim(monkeypatch):
    """Link level, the first reply of the run: a claim of 2^31 input features and 10^6 classes is refused
    (field input-shape), and the server's arrays keep the sizes of its own spec."""
    from fedprism.flower import server as srv

    class Grid:
        def get_node_ids(self):
            return [1, 2]

    spec = RunSpec((64,), 10, 100)
    link = srv.Link(Grid(), 4, "cfg", log=lambda m: None, spec=spec)
    monkeypatch.setattr(srv, "make_model", lambda *a: pytest.fail("a model was built from a node's word"))
    huge = {"client-id": 1, "config-id": "cfg", "input-shape": [2 ** 31], "num-classes": 10 ** 6,
            "param-size": 2 ** 40, "num-examples": 1, "label-hist": [1] + [0] * (10 ** 6 - 1)}
    link._admit(1, huge)
    assert link.node_of == {} and (link.input_shape, link.num_classes, link.param_size) == ((64,), 10, 100)
    assert link.label_hist.shape == (4, 10)
    [(kind, cid, data)] = link.pop_events()
    assert (kind, cid, data["field"], data["node"]) == ("failure", 1, "input-shape", 1)
    ok = {"client-id": 2, "config-id": "cfg", "input-shape": [64], "num-classes": 10, "param-size": 100,
          "num-examples": 40, "label-hist": [4] * 10}
    link._admit(2, ok)                                            # an honest node after it: admitted
    assert link.node_of == {2: 2} and link.label_hist[2].tolist() == [4] * 10
    assert [(k, d["event"]) for k, _, d in link.pop_events()] == [("flower_node", "joined")]
    for field, value in (("num-classes", 9), ("param-size", 101), ("input-shape", [8, 8])):
        bad = {**ok, "client-id": 3, field: value}
        if field == "num-classes":                 # a histogram of as many entries as the claimed classes
            bad["label-hist"], bad["num-examples"] = [4] * 9, 36
        link._admit(3, bad)
        assert 3 not in link.node_of and [d["field"] for _, _, d in link.pop_events()] == [field]


def test_the_published_format_is_the_data_the_server_builds():
    """`published_shape` (a server without the dataset) gives the shape and classes that building the
    federation gives, for the built-in datasets readable here (digits and synthetic always; padded too)."""
    from fedprism.experiment.federation import build_federation
    from fedprism.flower.spec import published_shape, server_spec

    cases = [FEDAVG4, FEDAVG4 + " data.pad32=true", "method=fedavg dataset=synthetic clients=4 model=mlp"]
    for extra in cases:
        cfg = parse_experiment(extra)
        fed = build_federation(cfg)
        assert published_shape(cfg) == (fed.input_shape, fed.num_classes), extra
        read, published = server_spec(cfg, fed.input_shape, fed.num_classes), server_spec(cfg)
        assert (published.input_shape, published.num_classes, published.param_size) == \
            (read.input_shape, read.num_classes, read.param_size), extra
    for name, shape, classes in (("fmnist", (1, 28, 28), 10), ("cifar100", (3, 32, 32), 100),
                                 ("usps", (1, 16, 16), 10), ("wisdm", (3,), 6)):
        assert published_shape(parse_experiment(f"dataset={name} model=mlp")) == (shape, classes)
    assert published_shape(parse_experiment("dataset=fmnist model=lenet5"))[0] == (1, 32, 32)   # pad32 auto


def test_a_registered_dataset_the_server_cannot_read_is_refused_before_any_node_is_asked(
        monkeypatch, tmp_path, task_identity):
    """A dataset the published format does not fix (a registered one) and that the server cannot read:
    refused naming `dataset` before any node is asked (its shape would otherwise be a node's word)."""
    from fedprism.errors import ConfigError
    from fedprism.experiment import federation as fedmod

    monkeypatch.setattr("fedprism.flower.spec.published_shape", lambda cfg: None)    # a bare loader's

    def unreadable(cfg):
        raise FileNotFoundError("no data")

    monkeypatch.setattr(fedmod, "build_federation", unreadable)
    rc = run_config(FEDAVG4, tmp_path / "p.db", nodes_timeout=5.0)
    grid = FakeGrid(nodes_for(4), rc)
    with pytest.raises(ConfigError, match=r"'dataset' = 'digits' is not valid: a dataset the server can"):
        serve(grid, rc)
    assert grid.log == [] and not (tmp_path / "p.db").exists()


# -- the registry file is read before anything starts ----------------------------------------------------
BAD_REGISTRIES = {
    "missing.json": (None, "no such file"),
    "folder.json": ("<dir>", "it is a folder"),
    "broken.json": ('{"nodes": {"node:1": 0', "not valid JSON"),
    "broken.toml": ('[nodes."node:1"\nclient = 0\n', "not valid TOML"),
    "binary.json": (b"\xff\xfe\x00garbage", "not UTF-8 text"),
    "range.json": ('{"nodes": {"node:1": 99}}', "client must be an integer in"),
    "notable.json": ('[1, 2]', "needs a 'nodes' table"),
}


def _bad_registry(tmp_path: Path, name: str) -> str:
    content, _ = BAD_REGISTRIES[name]
    p = tmp_path / "reg" / name
    p.parent.mkdir(exist_ok=True)
    if content == "<dir>":
        p.mkdir()
    elif isinstance(content, bytes):
        p.write_bytes(content)
    elif content is not None:
        p.write_text(content)
    return str(p)


@pytest.mark.parametrize("name", sorted(BAD_REGISTRIES))
def test_a_bad_registry_is_refused_before_anything_starts_or_is_written(name, tmp_path, monkeypatch,
                                                                        task_identity):
    """`simulate` used to start the SuperLink and Ray and leave an empty store before the ServerApp read the
    registry (a traceback from inside the run). Now: a ConfigError naming `registry`, its value and what is
    wrong; no SuperLink, no work folder, no store; the same from `serve` (no store, no node asked)."""
    from fedprism.errors import ConfigError
    from fedprism.flower import simulation

    reg = _bad_registry(tmp_path, name)
    why = BAD_REGISTRIES[name][1]
    monkeypatch.setattr(simulation.LocalSuperLink, "start", lambda self: pytest.fail("SuperLink started"))
    monkeypatch.setattr(simulation.tempfile, "mkdtemp", lambda **kw: pytest.fail("a work folder was made"))
    with pytest.raises(ConfigError) as e:
        simulation.simulate(FEDAVG4, db=tmp_path / "s.db", registry=reg, workdir=None)
    msg = str(e.value)
    assert msg.startswith(f"run-config key 'registry' = '{reg}' is not valid:") and why in msg, msg
    assert not (tmp_path / "s.db").exists()
    rc = run_config(FEDAVG4, tmp_path / "v.db", registry=reg)
    grid = FakeGrid(nodes_for(4), rc)
    with pytest.raises(ConfigError, match="registry"):
        serve(grid, rc)
    assert not (tmp_path / "v.db").exists() and grid.log == []


# -- what nodes say is printed and stored as printable text ----------------------------------------------
EVIL = "boom\x1b]0;owned\x07\x1b[2J\r\x1b[31mred\u202e\nline two"


def _printable_everywhere(texts) -> None:
    for t in texts:
        assert t.isprintable(), repr(t)
        assert "\x1b" not in t and "\r" not in t and "\u202e" not in t, repr(t)


def test_terminal_escapes_in_node_failure_reasons_are_stored_and_logged_escaped(tmp_path, monkeypatch,
                                                                                task_identity):
    """A node's error reply (its text carries OSC / CSI escape sequences, a carriage return, a bidi
    override and a newline), a train reply with such a metric name, and an identity of another experiment
    whose id carries them: every failure reason stored and every line the ServerApp logs is printable."""
    from flwr.app import Error
    import flwr.common.logger as flog

    logged: list[str] = []
    monkeypatch.setattr(flog, "log", lambda level, fmt, *args: logged.append(fmt % args))
    nodes = nodes_for(4)

    def error_reply(m, real):
        if m.metadata.message_type != "train":
            return None
        return Message(Error(code=2, reason=EVIL), reply_to=m)

    def metric_name(m, real):
        if m.metadata.message_type != "train":
            return None
        a = {k: real.array_records[codec.UPDATE][k] for k in real.array_records[codec.UPDATE].keys()}
        meta = {k: real.config_records[codec.META][k] for k in real.config_records[codec.META].keys()}
        a["m." + EVIL] = Array(np.array([1.0]))
        meta["metrics"] = [*meta["metrics"], EVIL]
        return RecordDict({codec.UPDATE: ArrayRecord(a), codec.META: ConfigRecord(meta)})

    class Grid(HostileGrid):                       # one forger sends a Flower error reply, not content
        def push_messages(self, messages):
            ids = super().push_messages(messages)
            for m, mid in zip(messages, ids):
                if m.metadata.dst_node_id == _node(nodes, 1) and m.metadata.message_type == "train":
                    self.replies[mid] = error_reply(m, None)
            return ids

    rc = run_config(FEDAVG4.replace("rounds=3", "rounds=1"), tmp_path / "e.db", min_nodes=4)
    grid = Grid(nodes, rc, forge={_node(nodes, 2): (metric_name, True),
                                  7: (_lie({"config-id": EVIL}), True)})
    grid.add_node(7, {"client-id": 3})
    res = serve(grid, rc)
    s = Store(tmp_path / "e.db")
    fails = s.records(res.run_id, "failure")
    reasons = {(f["client"], f["data"].get("phase", "train")): f["data"]["reason"] for f in fails}
    assert "boom" in reasons[(1, "train")] and "line two" in reasons[(1, "train")]
    assert "metric name" in reasons[(2, "train")] and (3, "identity") in reasons
    _printable_everywhere(reasons.values())
    assert any("boom" in line for line in logged) and any("refused" in line for line in logged)
    _printable_everywhere(logged)
    from types import SimpleNamespace

    from fedprism.flower.server import Link
    why = Link.describe_error(SimpleNamespace(error=SimpleNamespace(code=2, reason=EVIL)))   # one stored line
    _printable_everywhere([why])
    assert why.endswith("red\\u202e\\nline two") and "]0;owned" in why
