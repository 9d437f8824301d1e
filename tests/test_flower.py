"""fedprism on Flower: same numbers as the in-process runner, identity, failures, resume, deployment.

Fast tests drive the real ServerApp loop (`serve`) and the real ClientApp handlers through an
in-process grid (`FakeGrid`: push runs the ClientApp at once, with scripted silences and crashes),
so they need neither Ray nor a SuperLink. Slow tests use Flower's Simulation Runtime through `flwr run`
(a simulation SuperLink; Ray on loopback, or a local multi-node Ray cluster: head + 2 workers) and a
loopback deployment (SuperLink + 3 SuperNodes, TLS, node authentication: scripts/flower_deploy.py).
Skipped cleanly when flwr is not installed (`pip install -e ".[flower]"`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

flwr = pytest.importorskip("flwr")

from flwr.app import Context, Error, Message, RecordDict  # noqa: E402

import plugins.protostate  # noqa: E402,F401 (a method with zero-initialised [C, d] client state)
from fedprism.algorithms.base import Plan, Update  # noqa: E402
from fedprism.errors import ConfigError  # noqa: E402
from fedprism.experiment.runner import Experiment  # noqa: E402
from fedprism.experiment.store import Store  # noqa: E402
from fedprism.flower import codec  # noqa: E402
from fedprism.flower.client_app import make_client_app  # noqa: E402
from fedprism.flower.server_app import serve  # noqa: E402
from fedprism.flower.settings import OFFLINE_ENV, RunSettings, client_id_of, flower_run_id, parse_experiment  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXP4 = ("method=fedprism dataset=digits clients=4 rounds=3 fraction=1.0 local_epochs=1 lr=0.05 model=mlp "
        "device=cpu engine=sequential fedprism.k=2 fedprism.every=1 partition.alpha=0.5 seed=3")
EXP6 = ("method=fedprism dataset=digits clients=6 rounds=3 fraction=1.0 local_epochs=1 lr=0.05 model=mlp "
        "device=cpu engine=sequential fedprism.k=2 fedprism.every=1 partition.alpha=0.5 seed=1")


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    for k, v in OFFLINE_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr-home"))
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def task_identity():
    """Flower stamps instruction messages with the run of the current process; the runtime sets it."""
    try:
        from flwr.supercore.task_identity import TaskIdentity
    except ImportError:  # other flwr versions: nothing to set
        yield
        return
    old = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0
    yield
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = old


class FakeGrid:
    """Flower's Grid in one process: pushing a message runs the ClientApp of its node at once.

    `script(node_id, message) -> "ok" | "silent" | "raise"` injects faults: a silent node never
    answers (a timeout), "raise" makes the ClientApp fail (an error reply, as Flower sends one).
    """

    def __init__(self, nodes: dict[int, dict], run_config: dict, script=None, experiment_of=None):
        self.nodes = dict(nodes)                     # node id -> node_config
        self.apps = {nid: make_client_app(**run_config) for nid in nodes}
        self.run_config = run_config
        self.script = script or (lambda nid, msg: "ok")
        self.replies: dict[str, Message] = {}
        self.log: list[tuple[int, str]] = []
        self.sent: list[tuple[int, int, dict]] = []              # (round, client, payload) of train messages
        self.up_bytes: list[tuple[int, int, int]] = []           # (round, client, payload bytes) of train replies
        self.states: dict[int, RecordDict] = {}                    # node id -> its Context.state

    def add_node(self, nid: int, node_config: dict, run_config: dict | None = None) -> None:
        self.nodes[nid] = node_config
        self.apps[nid] = make_client_app(**(run_config or self.run_config))

    def get_node_ids(self):
        return list(self.nodes)

    def push_messages(self, messages):
        ids = []
        for m in messages:
            mid = uuid.uuid4().hex
            m.metadata.__dict__["_message_id"] = mid
            nid = m.metadata.dst_node_id
            if nid not in self.nodes:
                continue
            self.log.append((nid, m.metadata.message_type))
            if m.metadata.message_type == "train":
                plan, rnd, cid, _ = codec.decode_plan(m.content)
                self.sent.append((rnd, cid, {k: v[0] for k, v in plan.payload.items()}))
            what = self.script(nid, m)
            ids.append(mid)
            if what == "silent":
                continue
            # a node keeps its Context.state across messages (Flower does, per run and node)
            state = self.states.setdefault(nid, RecordDict())
            ctx = Context(run_id=1, node_id=nid, node_config=self.nodes[nid], state=state, run_config={})
            try:
                if what == "raise":
                    raise RuntimeError("injected client crash")
                reply = self.apps[nid](m, ctx)
            except Exception as e:  # noqa: BLE001 - what Flower's runtime does with a raising ClientApp
                reply = Message(Error(code=2, reason=f"{type(e).__name__}: {e}"), reply_to=m)
            self.replies[mid] = reply
            if m.metadata.message_type == "train" and not reply.has_error():
                arrays = reply.content.array_records[codec.UPDATE]
                self.up_bytes.append((rnd, cid, sum(arrays[k].numpy().nbytes for k in arrays.keys()
                                                    if k.startswith("u."))))
        return ids

    def pull_messages(self, ids):
        return [self.replies.pop(i) for i in list(ids) if i in self.replies]


def run_bounded(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    """Run `cmd` in its own process group; on timeout SIGTERM it (cleanup runs), then SIGKILL the group."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **kw)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            out, err = p.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
        raise AssertionError(f"timed out after {timeout}s: {cmd[:3]}\n{out[-3000:]}\n{err[-3000:]}") from None
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)     # anything the command left in its group (e.g. Ray workers)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def nodes_for(n: int, base: int = 1000) -> dict[int, dict]:
    return {base + 17 * c: {"client-id": c} for c in range(n)}


def in_process(exp: str, db: Path) -> tuple[Experiment, dict]:
    cfg = parse_experiment(exp)
    e = Experiment(cfg, Store(db))
    res = e.run()
    return e, res.final


def run_config(exp: str, db: Path, **kw) -> dict:
    rc = {"experiment": exp, "db": str(db), "min-nodes": parse_experiment(exp)["clients"], "round-timeout": 30.0,
          "poll-interval": 0.01, "probe-timeout": 5.0}
    rc.update({k.replace("_", "-"): v for k, v in kw.items()})
    return rc


def assert_same_state(a: dict, b: dict, atol: float = 1e-6) -> None:
    assert set(a) == set(b)
    for k, x in a.items():
        y = b[k]
        if isinstance(x, torch.Tensor):
            assert x.shape == y.shape, k
            if x.dtype == torch.bool:
                assert torch.equal(x, y), k
            else:
                assert torch.allclose(x.double(), y.double(), atol=atol, rtol=0), (k, (x.double() - y.double()).abs().max())


# -- settings and wire format (no grid) -----------------------------------------------------------------
def test_run_config_is_validated():
    with pytest.raises(ConfigError, match="bogus"):
        RunSettings.from_run_config({"bogus": 1})
    with pytest.raises(ConfigError, match="min-replies"):
        RunSettings.from_run_config({"experiment": "clients=3", "min-replies": 4})
    with pytest.raises(ConfigError, match="round-timeout"):
        RunSettings.from_run_config({"round-timeout": -1})
    with pytest.raises(ConfigError, match="fedprism.k"):
        RunSettings.from_run_config({"experiment": "method=fedprism fedprism.k=0"})
    s = RunSettings.from_run_config({"experiment": "clients=5 rounds=2 fraction=1.0", "min-replies": 2})
    assert s.cfg["clients"] == 5 and s.min_replies == 2 and s.round_timeout == 300.0


def test_client_id_comes_from_node_config():
    assert client_id_of({"client-id": 3}, 5) == 3
    assert client_id_of({"client-id": "4"}, 5) == 4
    assert client_id_of({"partition-id": 2, "num-partitions": 5}, 5) == 2      # Flower simulation
    for bad in ({"client-id": 5}, {"client-id": -1}, {"client-id": "x"}, {}):
        with pytest.raises(ConfigError, match="client-id|partition-id"):
            client_id_of(bad, 5)


def test_simulation_federation_is_what_flwr_run_takes(tmp_path, monkeypatch):
    """The simulation federation `simulate` submits (`flwr run --federation-config`) parses with Flower's
    own parser into the SimulationConfig we meant, and Flower reads the SuperLink connection we write;
    bad values are refused naming the field before anything starts."""
    from flwr.cli.flower_config import read_superlink_connection
    from flwr.common.config import parse_config_args
    from flwr.supercore.utils import simulation_config_from_json

    from fedprism.flower.simulation import CONNECTION, federation_config, federation_config_arg, flower_config

    def proto(fc):
        parsed = parse_config_args([federation_config_arg(fc)])
        return simulation_config_from_json({k.replace("-", "_"): v for k, v in parsed.items()})

    p = proto(federation_config(6, cpus_per_client=2, gpus_per_client=0.5, num_cpus=4, verbose=True))
    assert (p.num_supernodes, p.client_resources_num_cpus, p.client_resources_num_gpus, p.init_args_num_cpus,
            p.backend, p.verbose, p.init_args_log_to_driver) == (6, 2, 0.5, 4, "ray", True, True)
    # attached to a Ray cluster: no num_cpus for ray.init (Ray refuses it when connecting to a cluster)
    p = proto(federation_config(3, ray_address="10.0.0.1:6379"))
    assert p.num_supernodes == 3 and p.client_resources_num_cpus == 1 and not p.HasField("init_args_num_cpus")
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "config.toml").write_text(flower_config(43210))
    conn = read_superlink_connection(CONNECTION)
    assert conn.address == "127.0.0.1:43210" and conn.insecure and conn.options is None
    for kw, field in [({"num_nodes": 0}, "--nodes"), ({"cpus_per_client": 0.5}, "--cpus-per-client"),
                      ({"gpus_per_client": -1.0}, "--gpus-per-client"), ({"num_cpus": 0}, "--num-cpus"),
                      ({"cpus_per_client": 2, "num_cpus": 1}, "--num-cpus"),
                      ({"ray_address": "head-without-port"}, "--ray-address"),
                      ({"ray_address": "h:70000"}, "--ray-address")]:
        with pytest.raises(ConfigError, match=field):
            federation_config(**{"num_nodes": 3, **kw})
    from fedprism.flower.__main__ import main as cli
    assert cli(["simulate", "--experiment", EXP4, "--db", str(tmp_path / "x.db"), "--cpus-per-client", "0.5"]) == 2
    assert cli(["simulate", "--experiment", EXP4, "--db", str(tmp_path / "x.db"), "--ray-address", "nowhere"]) == 2
    assert not (tmp_path / "x.db").exists()


def test_flower_run_id_is_stable_and_distinct():
    cfg = parse_experiment(EXP4)
    assert flower_run_id(cfg) == flower_run_id(parse_experiment(EXP4 + " name=x device=cpu"))
    assert flower_run_id(cfg) != cfg.run_id
    assert flower_run_id(cfg) != flower_run_id(parse_experiment(EXP4.replace("seed=3", "seed=4")))
    import hashlib                      # the formula Flower runs were stored under before the settings counted
    assert flower_run_id(cfg) == hashlib.sha256(f"flower:{cfg.run_id}".encode()).hexdigest()[:16]
    # run-config settings that change the numbers are part of the id, unless at their defaults
    rc = run_config(EXP4, Path("x.db"), round_timeout=7.0, poll_interval=0.2)
    assert RunSettings.from_run_config(rc).run_id == flower_run_id(cfg, rc) == flower_run_id(cfg)
    assert flower_run_id(cfg, {"update-norm-bound": 0.0, "global-eval": "server"}) == flower_run_id(cfg)
    ids = {flower_run_id(cfg, {k: v}) for k, v in (("update-norm-bound", 50.0), ("min-replies", 2),
                                                    ("max-samples", 100), ("stats-epsilon", 1.0),
                                                    ("registry", "/r.json"), ("global-eval", "nodes"),
                                                    ("norm-action", "clip"))}
    assert len(ids) == 7 and flower_run_id(cfg) not in ids
    assert RunSettings.from_run_config({**rc, "update-norm-bound": 50.0}).run_id == \
        flower_run_id(cfg, {"update-norm-bound": 50})


def test_simulator_only_keys_are_refused_before_anything_starts():
    """Refused from the run config alone: `simulate` and `app` stop before a SuperLink or Ray starts."""
    for extra in ("eval.clients=2", "state.storage=mmap"):
        with pytest.raises(ConfigError, match="on Flower"):
            RunSettings.from_run_config({"experiment": EXP4 + " " + extra})


def test_plan_and_update_round_trip(task_identity):
    g = torch.Generator().manual_seed(0)
    plan = Plan(np.array([7]), {"params": torch.randn(1, 11, generator=g), "anchor": torch.randn(1, 11, generator=g),
                                "mu": torch.tensor([[0.1]], dtype=torch.float64),
                                "models": torch.randn(1, 3, 11, generator=g)})
    back, rnd, cid, conf = codec.decode_plan(codec.encode_plan(plan, 5, 7, "abc"))
    assert (rnd, cid, conf) == (5, 7, "abc")
    assert back.clients.tolist() == [7] and set(back.payload) == set(plan.payload)
    for k, v in plan.payload.items():
        assert torch.equal(back.payload[k], v) and back.payload[k].dtype == v.dtype, k
    with pytest.raises(ValueError):
        codec.encode_plan(plan, 5, 8, "abc")                       # row of another client
    up = Update(plan.clients, {"params": plan.start + 1, "cluster": torch.tensor([2], dtype=torch.int32)},
                torch.tensor([42.0], dtype=torch.float64), {"train_loss": torch.tensor([0.5], dtype=torch.float64)},
                client_state={"private": torch.zeros(1, 11)})
    got = codec.decode_update(codec.encode_update(up, 7), plan)
    assert torch.equal(got.params, up.params) and got.payload["cluster"].dtype == torch.int32
    assert got.n_samples.tolist() == [42.0] and got.bytes == up.bytes == 11 * 4 + 4
    assert torch.equal(got.metrics["train_loss"], up.metrics["train_loss"])
    assert got.client_state == {}                                  # a client's own state never travels
    body = codec.encode_update(up, 7)
    del body.array_records[codec.UPDATE]["u.cluster"]
    with pytest.raises(ValueError, match="u.cluster"):              # a malformed reply names its field
        codec.decode_update(body, plan)


def test_app_directory_for_flwr_run(tmp_path):
    import tomllib

    from fedprism.flower.__main__ import main as cli
    assert cli(["app", str(tmp_path / "app"), "--experiment", EXP4, "min-replies=2", "db=/abs/r.db"]) == 0
    doc = tomllib.loads((tmp_path / "app" / "pyproject.toml").read_text())
    comp = doc["tool"]["flwr"]["app"]["components"]
    assert comp == {"serverapp": "fedprism.flower.server_app:app", "clientapp": "fedprism.flower.client_app:app"}
    rc = doc["tool"]["flwr"]["app"]["config"]
    assert RunSettings.from_run_config(rc).min_replies == 2 and rc["experiment"] == EXP4 and rc["db"] == "/abs/r.db"
    assert cli(["app", str(tmp_path / "bad"), "--experiment", EXP4, "bogus=1"]) == 2     # unknown key: clear error
    with pytest.MonkeyPatch.context() as mp:            # a relative db is named absolutely
        mp.chdir(tmp_path)
        assert cli(["app", str(tmp_path / "rel"), "--experiment", EXP4, "db=rel.db"]) == 0
        assert cli(["app", str(tmp_path / "dflt"), "--experiment", EXP4]) == 0
    for d, name in (("rel", "rel.db"), ("dflt", "fedprism-results.db")):
        doc = tomllib.loads((tmp_path / d / "pyproject.toml").read_text())
        got = doc["tool"]["flwr"]["app"]["config"]["db"]
        assert got == str(tmp_path.resolve() / name), got
    # Flower itself accepts it as an app (builds a FAB), offline
    flwr_bin = Path(sys.executable).parent / "flwr"
    if flwr_bin.exists():
        p = run_bounded([str(flwr_bin), "build", "--app", str(tmp_path / "app")], 120, cwd=tmp_path,
                        env={**os.environ, "FLWR_HOME": str(tmp_path / "home")})
        assert p.returncode == 0, p.stdout + p.stderr
        assert list(tmp_path.glob("*.fab"))


# -- the ServerApp loop over an in-process grid ----------------------------------------------------------
def test_same_final_parameters_as_in_process(tmp_path, task_identity):
    ref, final = in_process(EXP4, tmp_path / "ref.db")
    db = tmp_path / "fl.db"
    rc = run_config(EXP4, db, save_final=str(tmp_path / "final.pt"))
    grid = FakeGrid(nodes_for(4), rc)
    res = serve(grid, rc)
    assert res.status == "finished"
    got = torch.load(tmp_path / "final.pt", weights_only=False)
    assert got["run_id"] == res.run_id == flower_run_id(parse_experiment(EXP4))
    assert_same_state(ref.state, got["state"])
    for k in ("local_acc", "global_acc", "sdad", "global_model_acc"):
        assert res.final[k] == pytest.approx(final[k], abs=1e-9), k
    s = Store(db)
    row = s.run(res.run_id)
    assert json.loads(row["config"])["name"] == "fedprism (flower)"
    a = [tuple(r)[2:] for r in Store(tmp_path / "ref.db").client_rows(ref.run_id, 2)]
    b = [tuple(r)[2:] for r in s.client_rows(res.run_id, 2)]
    assert np.allclose(np.array(a, dtype=float), np.array(b, dtype=float), atol=1e-9)
    joined = s.records(res.run_id, "flower_node")
    assert sorted(r["client"] for r in joined) == [0, 1, 2, 3] and all(r["round"] == 0 for r in joined)
    assert s.records(res.run_id, "failure") == []
    assert [r["data"]["replies"] for r in s.records(res.run_id, "flower_round")] == [4, 4, 4]
    # every node got its own start vector: Fed-PRISM personalizes once round 0 has clustered the clients
    starts = {(m[0], m[1]): m[2]["params"] for m in grid.sent}
    assert len(starts) == 4 * 3
    r2 = torch.stack([starts[(2, c)] for c in range(4)])
    assert len({tuple(r.tolist()) for r in r2}) > 1
    # and the finished run is a no-op when the ServerApp is started again
    grid2 = FakeGrid(nodes_for(4, base=5000), rc)
    again = serve(grid2, rc)
    assert again.status == "finished" and grid2.log == []
    # the report renders Flower runs like any other run
    from fedprism.report import write_report
    paths = write_report(str(db), str(tmp_path / "report"), plots=False)
    text = "".join(Path(p).read_text() for p in paths if str(p).endswith(".md"))
    assert "fedprism (flower)" in text


def _methods() -> list[str]:
    from fedprism.algorithms import REGISTRY
    # a simulation-only method (centralised: the pooled data of every client) is refused on Flower, below
    return sorted(m for m in REGISTRY if m != "fedprism" and not REGISTRY[m].simulation_only
                  and not m.startswith("test_") or m == "test_protostate")


def test_a_simulation_only_method_is_refused_before_anything_starts(tmp_path, task_identity):
    """`centralised` trains on every client's data in one process: the ServerApp refuses it from the
    experiment alone, naming the method and why, and `simulate` refuses it before any process starts."""
    from fedprism.algorithms import REGISTRY
    from fedprism.flower.simulation import simulate

    assert [m for m in REGISTRY if REGISTRY[m].simulation_only] == ["centralised"]
    exp = EXP4.replace("method=fedprism ", "method=centralised ")
    exp = exp.replace(" fedprism.k=2 fedprism.every=1", "")
    rc = run_config(exp, tmp_path / "s.db")
    with pytest.raises(ConfigError, match=r"'method' = 'centralised'.*simulator only \(it trains on the"):
        serve(FakeGrid(nodes_for(4), rc), rc)
    with pytest.raises(ConfigError, match="simulator only"):
        simulate(exp, tmp_path / "s.db", workdir=tmp_path / "w")
    assert not (tmp_path / "s.db").exists() and not (tmp_path / "w").exists()


def test_flower_and_in_process_runs_of_one_config_in_one_store_each_train(tmp_path, task_identity):
    """Both orders: neither run re-scores the other's final state (a Flower run's models are what its
    nodes sent). Both train every round, and they reach the same numbers."""
    for first in ("in-process", "flower"):
        db = tmp_path / f"{first}.db"
        rc = run_config(EXP4, db)
        runs = []
        for who in ((first, "flower") if first == "in-process" else (first, "in-process")):
            if who == "flower":
                res = serve(FakeGrid(nodes_for(4), rc), rc)
                final = res.final
            else:
                e, final = in_process(EXP4, db)
                res = e
            runs.append((who, res.run_id, final))
        s = Store(db)
        for who, rid, final in runs:
            assert "rescored_from" not in final, (first, who)
            assert not s.records(rid, "rescored"), (first, who)
            assert [m["accepted"] for m in s.round_metrics(rid)] == [4, 4, 4], (first, who)
        assert runs[0][2]["local_acc"] == pytest.approx(runs[1][2]["local_acc"], abs=1e-9)
        flower = next(rid for who, rid, _ in runs if who == "flower")
        prov = json.loads(s.run(flower)["provenance"])
        assert prov["flower"]["update-norm-bound"] == 0.0 and prov["flower"]["min-replies"] == 1
        s.close()


def test_a_diverging_flower_run_is_rejected_and_flagged_as_in_process(tmp_path, task_identity):
    """lr = 1e30: every update holds NaN/Inf. On Flower, as in process, each is `rejected` for its
    non-finite values (not failed as a malformed reply for its NaN loss) and the run is flagged diverged."""
    exp = EXP4.replace("lr=0.05", "lr=1e30").replace("rounds=3", "rounds=2")
    ref, ref_final = in_process(exp, tmp_path / "ref.db")
    rc = run_config(exp, tmp_path / "fl.db")
    res = serve(FakeGrid(nodes_for(4), rc), rc)
    assert ref_final["diverged"] and res.final["diverged"]
    assert res.final["rejected"] == ref_final["rejected"] == 8
    s = Store(tmp_path / "fl.db")
    assert not [f for f in s.records(res.run_id, "failure") if "malformed" in f["data"].get("reason", "")]


@pytest.mark.parametrize("method", ["clust_psi_pfl", "fedsoft", "fedsub"])
def test_partial_participation_runs_the_same_on_flower(method, tmp_path, task_identity):
    """Methods whose cohort or state depends on who is sampled (Clust-PSI-PFL draws its own per-cluster
    cohorts; FedSoft re-estimates importances of sampled clients; FedSub caches artifacts by round), at
    half participation: the Flower run equals the in-process one."""
    exp = (f"method={method} dataset=digits clients=6 rounds=3 fraction=0.5 local_epochs=1 lr=0.05 model=mlp "
           "device=cpu engine=sequential partition.alpha=0.5 seed=5")
    rc = run_config(exp, tmp_path / "m.db", save_final=str(tmp_path / "final.pt"))
    ref, final = in_process(exp, tmp_path / "ref.db")
    res = serve(FakeGrid(nodes_for(6), rc), rc)
    assert res.status == "finished"
    got = torch.load(tmp_path / "final.pt", weights_only=False)["state"]
    assert_same_state({k: v for k, v in ref.state.items() if k not in ref.algo.client_state}, got)
    assert res.final["local_acc"] == pytest.approx(final["local_acc"], abs=1e-9)
    acc = [h["accepted"] for h in ref.store.round_metrics(ref.run_id)]
    assert acc == [h["accepted"] for h in Store(tmp_path / "m.db").round_metrics(res.run_id)]


@pytest.mark.parametrize("method", ["fedavg", "fedsub"])
def test_class_drift_runs_the_same_on_flower(method, tmp_path, task_identity):
    """Class drift (fedprism.data.drift) on Flower: every node applies the run's schedule to its own rows for
    the round its train or evaluation message names, the server checks the nodes' scores against that
    round's split sizes and stores the schedule. At half participation, with classes returning mid-run, the
    Flower run equals the in-process one bit for bit: final state, every round's metrics and client rows."""
    exp = (f"method={method} dataset=digits clients=6 rounds=4 fraction=0.5 local_epochs=1 lr=0.05 model=mlp "
           "device=cpu engine=sequential partition.alpha=0.5 seed=5 drift.fraction=0.5 drift.every=2")
    db = tmp_path / "d.db"
    rc = run_config(exp, db, save_final=str(tmp_path / "final.pt"))
    ref, final = in_process(exp, tmp_path / "ref.db")
    res = serve(FakeGrid(nodes_for(6), rc), rc)
    assert res.status == "finished"
    got = torch.load(tmp_path / "final.pt", weights_only=False)["state"]
    assert_same_state({k: v for k, v in ref.state.items() if k not in ref.algo.client_state}, got, atol=0)
    s = Store(db)
    a, b = ref.store.round_metrics(ref.run_id), s.round_metrics(res.run_id)
    removed = [h["drift_removed"] for h in a]
    assert removed[0] > removed[2]                        # classes came back in round 2
    assert [h["drift_removed"] for h in b] == removed
    for x, y in zip(a, b, strict=True):
        for k in ("local_acc", "global_acc", "local_f1", "train_loss", "accepted", "bytes_up", "bytes_down"):
            assert y[k] == x[k], (x["round"], k)
    for rnd in range(4):
        np.testing.assert_array_equal(np.array([tuple(r)[2:] for r in ref.store.client_rows(ref.run_id, rnd)], float),
                                      np.array([tuple(r)[2:] for r in s.client_rows(res.run_id, rnd)], float))
    returns = lambda st, rid: {r["client"]: r["data"]["returns"] for r in st.records(rid, "drift")}  # noqa: E731
    assert returns(s, res.run_id) == returns(ref.store, ref.run_id) != {}
    assert s.records(res.run_id, "failure") == []


@pytest.mark.parametrize("method", ["fedavg", "fedsub"])
def test_counted_bytes_are_the_bytes_the_codec_sends(method, tmp_path, task_identity):
    """bytes_down / bytes_up of every round are the payload arrays of the train messages and replies that
    crossed the grid (FedSub's sparse subnetworks, FedAvg's full model), and equal the in-process count."""
    exp = (f"method={method} dataset=digits clients=4 rounds=2 fraction=1.0 local_epochs=1 lr=0.05 model=mlp "
           "device=cpu engine=sequential partition.alpha=0.5 seed=5")
    db = tmp_path / "b.db"
    rc = run_config(exp, db)
    ref, _ = in_process(exp, tmp_path / "ref.db")
    grid = FakeGrid(nodes_for(4), rc)
    res = serve(grid, rc)
    assert res.status == "finished"
    got, want = Store(db).round_metrics(res.run_id), ref.store.round_metrics(ref.run_id)
    for rnd in range(2):
        sent = sum(v.numel() * v.element_size() for r, _, p in grid.sent if r == rnd for v in p.values())
        came = sum(b for r, _, b in grid.up_bytes if r == rnd)
        assert got[rnd]["bytes_down"] == sent == want[rnd]["bytes_down"]
        assert got[rnd]["bytes_up"] == came == want[rnd]["bytes_up"]
    P = ref.ctx.spec.size
    if method == "fedsub":                               # sparse: less than one full model per client each way
        assert got[1]["bytes_down"] < 4 * 4 * P and got[1]["bytes_up"] - 4 * 4 * ref.ctx.num_classes * \
            (ref.ctx.feature_dim + 1) < 4 * 4 * P
    else:
        assert got[1]["bytes_down"] == got[1]["bytes_up"] == 4 * 4 * P


def test_class_drift_needs_the_dataset_on_the_server(monkeypatch):
    """The drift schedule is drawn from the partition's label counts: a server that cannot build the partition
    refuses `drift.fraction > 0` before waiting for any node, naming the key; static data run as before."""
    from fedprism.experiment import federation as fedmod
    from fedprism.flower.server_app import server_data

    def unreadable(cfg):
        raise FileNotFoundError("no dataset here")

    monkeypatch.setattr(fedmod, "build_federation", unreadable)
    with pytest.raises(ConfigError, match=r"drift\.fraction.*readable on the server"):
        server_data(RunSettings.from_run_config({"experiment": EXP4 + " drift.fraction=0.5"}))
    *held, spec = server_data(RunSettings.from_run_config({"experiment": EXP4}))
    assert held == [None, None, None, None]
    assert (spec.input_shape, spec.num_classes) == ((1, 8, 8), 10)     # digits' format, not a node's word


def test_a_configuration_that_can_never_cluster_is_refused_before_flower_starts(tmp_path):
    """The limits that need no data (here Fed-PRISM's K above a round's cohort) are checked when the run
    config is read, so `simulate` refuses in one line before any SuperLink, Ray or node starts (it used to
    fail inside the ServerApp with a traceback, leaving an empty store)."""
    from fedprism.flower.simulation import simulate

    exp = "method=fedprism dataset=digits clients=4 rounds=1 fedprism.k=3"
    with pytest.raises(ConfigError, match=r"fedprism\.k.*at most 1 here"):
        RunSettings.from_run_config({"experiment": exp})
    with pytest.raises(ConfigError, match=r"fedprism\.k"):
        simulate(exp, tmp_path / "s.db", workdir=tmp_path / "w")
    assert not (tmp_path / "s.db").exists() and not (tmp_path / "w").exists()


#: EXP4 as a dual-stream run with validation splits, where `eval.gate` is a valid key
GATED = (EXP4.replace("method=fedprism ", "method=fedprism_dual ")
         .replace("fedprism.k=2 fedprism.every=1", "fedprism_dual.k=2 fedprism_dual.every=1")
         + " data.val_fraction=0.25 data.global_val=100")


@pytest.mark.parametrize("key, value", [("eval.clients", "2"), ("state.storage", "float16"),
                                        ("state.storage", "mmap"), ("eval.gate", "learned")])
def test_simulator_only_scale_keys_are_refused_on_flower(key, value, tmp_path, task_identity):
    """`eval.clients` (sampled evaluation) and `state.storage` other than memory are simulated in process
    only: the ServerApp refuses them naming the key, and stores no round."""
    db = tmp_path / "s.db"
    exp = GATED if key == "eval.gate" else EXP4
    rc = run_config(exp + f" {key}={value}", db)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.") + ".*on Flower"):
        serve(FakeGrid(nodes_for(4), rc), rc)
    assert not db.exists()                          # a refused run leaves no empty store behind
    Store(db).close()                               # and a store that existed keeps its rows
    with pytest.raises(ConfigError, match=key.replace(".", r"\.") + ".*on Flower"):
        serve(FakeGrid(nodes_for(4), rc), rc)
    st, rid = Store(db), flower_run_id(parse_experiment(rc["experiment"]))
    assert db.exists() and st.run(rid) is None                          # nothing of the refused run stored


@pytest.mark.parametrize("method", _methods() + ["fedsub fedsub.prototypes=input"])   # + kept client rows
def test_every_method_runs_the_same_on_flower(method, tmp_path, task_identity):
    """No algorithm code is duplicated for Flower: each registered method's plan / client_update /
    aggregate / evaluation gives the in-process numbers. Client-side rows (fedprism_dual's P_i and L_i)
    live only in the nodes' Context.state: the server's state has none, and every node's rows equal
    the simulator's."""
    exp = (f"method={method} dataset=digits clients=5 rounds=2 fraction=1.0 local_epochs=1 lr=0.05 model=mlp "
           "device=cpu engine=sequential partition.alpha=0.5 seed=2")
    db = tmp_path / "m.db"
    rc = run_config(exp, db, save_final=str(tmp_path / "final.pt"))
    ref, final = in_process(exp, tmp_path / "ref.db")
    grid = FakeGrid(nodes_for(5), rc)
    res = serve(grid, rc)
    assert res.status == "finished"
    got = torch.load(tmp_path / "final.pt", weights_only=False)["state"]
    private = ref.algo.client_state
    assert not set(private) & set(got)
    assert_same_state({k: v for k, v in ref.state.items() if k not in private}, got)
    for nid, node_cfg in grid.nodes.items():
        rows = grid.states[nid].array_records.get("fedprism-client-state") if private else None
        for k in private:
            assert torch.allclose(torch.from_numpy(rows[k].numpy()).double(),
                                  ref.clients.data[k][node_cfg["client-id"]].double().unsqueeze(0), atol=1e-6), k
    assert res.final["local_acc"] == pytest.approx(final["local_acc"], abs=1e-9)
    if "global_acc" in final:
        assert res.final["global_acc"] == pytest.approx(final["global_acc"], abs=1e-9)
    last_ref = ref.store.round_metrics(ref.run_id)[-1]
    last_got = Store(db).round_metrics(res.run_id)[-1]
    alternatives = sorted(k for k in last_ref if "@" in k)      # fedprism_dual's streams, fedproto's prototypes
    assert bool(alternatives) == bool(ref.algo.predictions)
    assert alternatives == sorted(k for k in last_got if "@" in k)
    for k in alternatives:
        assert last_got[k] == pytest.approx(last_ref[k], abs=1e-9), k
    if private:          # nothing the server sent holds a client-side row
        for (_, _, payload) in grid.sent:
            for t in payload.values():
                for k in private:
                    assert not any(t.shape == ref.clients.data[k][c].shape and
                                   torch.equal(t.float(), ref.clients.data[k][c].float()) for c in range(5))


def test_failures_are_recorded_and_survivors_aggregate(tmp_path, task_identity):
    """Client 1 crashes in round 1, client 2 goes silent from round 1 on: error reply and timeout both
    count as non-participation, are stored as failures, and the round aggregates the others."""
    nodes = nodes_for(4)
    node_of = {cfg["client-id"]: nid for nid, cfg in nodes.items()}
    dead: set[int] = set()

    def script(nid, msg):
        rnd = msg.content.config_records["task"]["round"] if msg.metadata.message_type == "train" else None
        if nid == node_of[2] and rnd == 1:
            dead.add(nid)                    # from its round-1 message on, client 2's node never answers
        if nid in dead:
            return "silent"
        if nid == node_of[1] and rnd == 1:
            return "raise"
        return "ok"

    db = tmp_path / "f.db"
    rc = run_config(EXP4, db, min_replies=2, round_timeout=0.5)
    grid = FakeGrid(nodes, rc, script)
    res = serve(grid, rc)
    assert res.status == "finished"
    s = Store(db)
    fails = s.records(res.run_id, "failure")
    train_fails = [(f["round"], f["client"], f["data"]["reason"]) for f in fails if "phase" not in f["data"]]
    assert (1, 1) in [(r, c) for r, c, _ in train_fails]
    crash = next(why for r, c, why in train_fails if (r, c) == (1, 1))
    assert "CLIENT_APP_RAISED_EXCEPTION" in crash and "injected client crash" in crash
    silent = {r: why for r, c, why in train_fails if c == 2}
    assert set(silent) == {1, 2}
    assert "no reply" in silent[1]                         # timed out ...
    assert "no connected node" in silent[2] or "no reply" in silent[2]   # ... then dropped from the map
    accepted = [m["accepted"] for m in s.round_metrics(res.run_id)]
    assert accepted == [4, 2, 3]
    assert any(f["data"].get("phase") == "evaluate" and f["client"] == 2 for f in fails)
    lost = [r for r in s.records(res.run_id, "flower_node") if r["data"]["event"] == "lost"]
    assert lost and lost[0]["client"] == 2
    # nothing already stored was lost: round 0 has every client's metrics
    assert len(s.client_rows(res.run_id, 0)) == 4
    assert all(r["local_acc"] is not None for r in s.client_rows(res.run_id, 0))


def test_an_error_reply_is_stored_without_colour_codes_and_bounded():
    from types import SimpleNamespace

    from fedprism.flower.server import Link

    tb = ("Traceback (most recent call last):\n" + "  \x1b[31mFile x\x1b[0m, line 1\n" * 200
          + "ValueError: boom")
    why = Link.describe_error(SimpleNamespace(error=SimpleNamespace(code=0, reason=tb)))
    assert "\x1b" not in why and why.endswith("ValueError: boom") and len(why) < 1100


def test_too_few_replies_skip_the_update(tmp_path, task_identity):
    nodes = nodes_for(4)
    silent = {nid for nid, c in nodes.items() if c["client-id"] in (0, 1)}
    db = tmp_path / "m.db"
    rc = run_config(EXP4.replace("rounds=3", "rounds=1"), db, min_replies=3, round_timeout=0.3,
                    save_final=str(tmp_path / "s.pt"))
    grid = FakeGrid(nodes, rc, lambda nid, m: "silent" if nid in silent and m.metadata.message_type == "train" else "ok")
    res = serve(grid, rc)
    assert res.status == "finished"
    s = Store(db)
    skipped = s.records(res.run_id, "round_skipped")
    assert len(skipped) == 1 and skipped[0]["data"]["replies"] == 2
    state = torch.load(tmp_path / "s.pt", weights_only=False)["state"]
    cfg = parse_experiment(EXP4)
    init = Experiment(cfg, Store(tmp_path / "x.db")).algo.init_state()
    assert_same_state(init, state, atol=0)                  # no update was applied
    assert s.round_metrics(res.run_id)[0]["accepted"] == 0


def test_restarted_node_is_remapped_to_its_client(tmp_path, task_identity):
    db = tmp_path / "r.db"
    rc = run_config(EXP4, db)
    grid = FakeGrid(nodes_for(4), rc)
    old = next(nid for nid, c in grid.nodes.items() if c["client-id"] == 3)
    orig_push = grid.push_messages

    def push(messages):
        messages = list(messages)
        if any(m.metadata.message_type == "train" and m.content.config_records["task"]["round"] == 1
               for m in messages) and old in grid.nodes:
            del grid.nodes[old]                            # the SuperNode of client 3 restarts ...
            grid.add_node(99_999, {"client-id": 3})        # ... and comes back with a new node id
        return orig_push(messages)

    grid.push_messages = push
    res = serve(grid, rc)
    assert res.status == "finished"
    s = Store(db)
    ev = [(r["round"], r["client"], r["data"]["event"], r["data"]["node"]) for r in s.records(res.run_id, "flower_node")]
    assert (1, 3, "lost", old) in ev
    assert any(c == 3 and e in ("rejoined", "remapped") and n == 99_999 for _, c, e, n in ev)
    fails = [(f["round"], f["client"]) for f in s.records(res.run_id, "failure")]
    assert (1, 3) in fails                                 # missed round 1 (message sent to the old node)
    assert (2, 3) not in fails                             # back in round 2 under its new node id
    assert s.round_metrics(res.run_id)[2]["accepted"] == 4


def test_node_with_another_experiment_is_refused(tmp_path, task_identity):
    db = tmp_path / "c.db"
    rc = run_config(EXP4.replace("rounds=3", "rounds=1"), db, min_nodes=3)
    nodes = nodes_for(4)
    grid = FakeGrid(nodes, rc)
    odd = max(nodes)
    grid.add_node(odd, nodes[odd], {**rc, "experiment": rc["experiment"].replace("seed=3", "seed=4")})
    res = serve(grid, rc)
    s = Store(db)
    refused = [f for f in s.records(res.run_id, "failure") if f["data"].get("phase") == "identity"]
    assert refused and refused[0]["client"] == 3 and "experiment" in refused[0]["data"]["reason"]
    assert s.round_metrics(res.run_id)[0]["accepted"] == 3


def test_discovery_deadline_is_an_error(tmp_path, task_identity):
    rc = run_config(EXP4, tmp_path / "d.db", nodes_timeout=0.3)
    grid = FakeGrid(nodes_for(2), rc)
    with pytest.raises(TimeoutError, match="min-nodes=4"):
        serve(grid, rc)


def test_restarted_server_resumes_from_its_checkpoint(tmp_path, task_identity):
    ref, _ = in_process(EXP4, tmp_path / "ref.db")
    db = tmp_path / "res.db"
    rc = run_config(EXP4, db, stop_after=2, save_final=str(tmp_path / "final.pt"))
    first = serve(FakeGrid(nodes_for(4), rc), rc)
    assert first.status == "interrupted" and not (tmp_path / "final.pt").exists()
    rc2 = {**rc, "stop-after": 0}
    res = serve(FakeGrid(nodes_for(4, base=7000), rc2), rc2)           # new node ids: re-identified
    assert res.status == "finished" and res.resumed_from == 1
    assert_same_state(ref.state, torch.load(tmp_path / "final.pt", weights_only=False)["state"])
    assert [m["round"] for m in Store(db).round_metrics(res.run_id)] == [0, 1, 2]


def test_simulate_stops_on_sigint_even_when_started_with_it_ignored(monkeypatch, capsys):
    """`python -m fedprism.flower simulate ... &`: a shell starts a background job with SIGINT ignored, and
    Python then installs no handler, so `kill -INT` did nothing. `main` restores the handler (as every
    `fedprism` command does) and turns the KeyboardInterrupt into one line and exit status 130 (`simulate`
    has stopped what it started on the way out)."""
    from fedprism.flower import __main__ as entry
    from fedprism.flower import simulation

    seen = []

    def interrupted(*a, **kw):
        seen.append(signal.getsignal(signal.SIGINT))
        raise KeyboardInterrupt

    monkeypatch.setattr(simulation, "simulate", interrupted)
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        rc = entry.main(["simulate", "--experiment", EXP4])
    finally:
        signal.signal(signal.SIGINT, before)
    assert seen == [signal.default_int_handler] and rc == 130
    assert "interrupted; run the same command again to resume" in capsys.readouterr().err


# -- Flower's runtimes (slow) ------------------------------------------------------------------------------
def assert_identical_state(a: dict, b: dict) -> None:
    """Bit for bit: same keys, dtypes, shapes and values."""
    assert set(a) == set(b)
    for k, x in a.items():
        assert isinstance(b[k], torch.Tensor) and x.dtype == b[k].dtype and x.shape == b[k].shape, k
        assert torch.equal(x, b[k]), (k, (x.double() - b[k].double()).abs().max())


#: round-metric keys that are not results: timings, and the Flower run's flags for who scored what
NOT_RESULTS = ("wall_s", "train_s", "eval_s", "seconds", "node_reported", "global_on_server")


def assert_identical_numbers(ref: Store, ref_id: str, got: Store, got_id: str) -> None:
    """Every stored round metric and every client's row of every round equal the in-process run's."""
    a, b = ref.round_metrics(ref_id), got.round_metrics(got_id)
    assert len(a) == len(b) > 0
    for ra, rb in zip(a, b):
        keys = [k for k in ra if k not in NOT_RESULTS]
        assert {k: ra[k] for k in keys} == {k: rb.get(k) for k in keys}, ra["round"]
        rows_a = [tuple(r)[2:] for r in ref.client_rows(ref_id, ra["round"])]
        rows_b = [tuple(r)[2:] for r in got.client_rows(got_id, rb["round"])]
        assert rows_a == rows_b, ra["round"]
    fa, fb = json.loads(ref.run(ref_id)["final"]), json.loads(got.run(got_id)["final"])
    keys = [k for k in fa if k not in NOT_RESULTS]
    assert keys and {k: fa[k] for k in keys} == {k: fb.get(k) for k in keys}


def marked_processes(mark: str) -> list[int]:
    """Live processes whose environment carries FEDPRISM_TEST_MARK=`mark` (everything a test started)."""
    needle = f"FEDPRISM_TEST_MARK={mark}".encode()
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if needle in (d / "environ").read_bytes().split(b"\0") and "Z" != (d / "stat").read_text().rsplit(
                        ")", 1)[1].split()[0]:
                    out.append(int(d.name))
            except OSError:
                continue
    return out


def simulate_in_subprocess(tmp_path: Path, exp: str, timeout: float,
                           **kw) -> tuple[subprocess.CompletedProcess, float]:
    """`fedprism.flower.simulation.simulate(exp, ...)` in a child process (its own Flower and Ray); returns
    the finished process and its wall time. Every process it starts carries a test mark in its
    environment; the test fails if any of them is alive the moment the child has returned (they are
    SIGKILLed then)."""
    mark = uuid.uuid4().hex
    code = ("import signal, sys\nsignal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # cleanup runs\n"
            "from fedprism.flower.simulation import simulate\n"
            f"simulate({exp!r}, db={str(tmp_path / 'sim.db')!r}, save_final={str(tmp_path / 'sim.pt')!r}, "
            f"round_timeout=300, nodes_timeout=600, timeout={timeout - 60:g}, "
            + "".join(f"{k}={v!r}, " for k, v in kw.items()) + ")\n")
    ray_tmp = tempfile.mkdtemp(prefix="fpray-", dir="/tmp")     # Ray's socket paths must stay < 108 bytes
    env = {**os.environ, "FLWR_HOME": str(tmp_path / "flwr-home"), "RAY_TMPDIR": ray_tmp, "FEDPRISM_TEST_MARK": mark,
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src")] + [q for q in os.environ.get("PYTHONPATH", "").split(
               os.pathsep) if q])}
    t0 = time.time()
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, env=env, cwd=tmp_path)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.terminate()                                           # SIGTERM: simulate stops what it started
        out, err = p.communicate(timeout=120)
        raise AssertionError(f"simulate timed out after {timeout}s\n{out[-3000:]}\n{err[-3000:]}") from None
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        left = marked_processes(mark)                           # at once: nothing may outlive simulate
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert left == [], f"processes left behind by simulate: {left}"
    return subprocess.CompletedProcess(p.args, p.returncode, out, err), time.time() - t0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_simulation_runtime_matches_in_process_engine(tmp_path):
    """Fed-PRISM, 3 rounds, 6 virtual SuperNodes: `simulate` submits the app with `flwr run` to a
    simulation SuperLink (the federation: 6 SuperNodes, Ray on 127.0.0.1) and reaches the in-process
    sequential engine's numbers bit for bit: final parameters, every round's metrics, every client's
    row. Nothing it started is left running."""
    pytest.importorskip("ray")
    ref, final = in_process(EXP6, tmp_path / "ref.db")
    p, wall = simulate_in_subprocess(tmp_path, EXP6, 840)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    # the run went through `flwr run` with the federation config (6 simulated SuperNodes)
    assert "Federation `@none/default` (6 simulated SuperNodes)" in p.stdout + p.stderr, p.stdout[-3000:]
    got = torch.load(tmp_path / "sim.pt", weights_only=False)
    assert_identical_state(ref.state, got["state"])
    s = Store(tmp_path / "sim.db")
    run = s.run(got["run_id"])
    assert run["status"] == "finished"
    assert json.loads(run["final"])["local_acc"] == final["local_acc"]
    assert_identical_numbers(ref.store, ref.run_id, s, got["run_id"])
    assert s.records(got["run_id"], "failure") == []
    print(f"simulation wall {wall:.1f}s")


RAY_PROBE = """
import json, sys, time
import ray
from ray._private.state import actors
ray.init(address=sys.argv[1], log_to_driver=False, logging_level="ERROR")
deadline = time.time() + float(sys.argv[3])
while True:
    nodes = [n for n in ray.nodes() if n["Alive"]]
    if len(nodes) >= int(sys.argv[2]) or time.time() > deadline:
        break
    time.sleep(1)
print(json.dumps({
    "nodes": [{"id": n["NodeID"], "ip": n["NodeManagerAddress"], "cpus": n["Resources"].get("CPU", 0),
               "head": "node:__internal_head__" in n["Resources"]} for n in nodes],
    "actors": [{"class": a["ActorClassName"], "node": a["Address"]["NodeID"], "ip": a["Address"]["IPAddress"],
                "state": a["State"], "pid": a["Pid"], "restarts": a["NumRestarts"]} for a in actors().values()]}))
ray.shutdown()
"""


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_sigint_stops_a_background_simulate_and_the_same_command_resumes_it(tmp_path):
    """The real thing: `python -m fedprism.flower simulate` started as a background job would be (SIGINT
    ignored), sent SIGINT once round 0 is stored: it exits 130 within 120 s with nothing it started left
    running, the run not finished; the same command again resumes it from its checkpoint and finishes with
    every stored number of the uninterrupted in-process run."""
    pytest.importorskip("ray")
    # rounds of about a second (30 local epochs): SIGINT lands long before the last one
    exp = ("method=fedavg dataset=digits clients=2 rounds=30 local_epochs=30 lr=0.01 model=mlp device=cpu "
           "engine=sequential fraction=1.0 seed=5")
    db = tmp_path / "sim.db"
    run_id = RunSettings.from_run_config({"experiment": exp}).run_id
    mark = uuid.uuid4().hex
    ray_tmp = tempfile.mkdtemp(prefix="fpray-", dir="/tmp")     # Ray's socket paths must stay < 108 bytes
    paths = [str(ROOT / "src")] + [q for q in os.environ.get("PYTHONPATH", "").split(os.pathsep) if q]
    env = {**os.environ, "FLWR_HOME": str(tmp_path / "flwr-home"), "RAY_TMPDIR": ray_tmp,
           "FEDPRISM_TEST_MARK": mark, "PYTHONPATH": os.pathsep.join(paths)}
    cmd = [sys.executable, "-m", "fedprism.flower", "simulate", "--db", str(db), "--experiment", exp,
           "round-timeout=300", "nodes-timeout=600"]

    def start(name: str, ignore_sigint: bool) -> subprocess.Popen:
        out = open(tmp_path / f"{name}.log", "wb")
        pre = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore_sigint else None
        return subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=pre)

    def rounds() -> int:
        if not db.exists():
            return 0
        try:
            s = Store(db, readonly=True)
        except Exception:  # noqa: BLE001 - the file is being created
            return 0
        try:
            return len(s.round_metrics(run_id)) if s.run(run_id) is not None else 0
        finally:
            s.close()

    p = start("first", ignore_sigint=True)
    try:
        t0 = time.time()
        while p.poll() is None and rounds() < 1 and time.time() - t0 < 600:
            time.sleep(0.5)
        assert p.poll() is None, (tmp_path / "first.log").read_text(errors="replace")[-3000:]
        os.kill(p.pid, signal.SIGINT)                       # kill -INT <pid>: the process alone
        t_int = time.time()
        try:
            rc = p.wait(timeout=120)
        except subprocess.TimeoutExpired:
            raise AssertionError("SIGINT did not stop simulate within 120 s") from None
        stopped_s = time.time() - t_int
        log = (tmp_path / "first.log").read_text(errors="replace")
        assert rc == 130, log[-3000:]
        assert "interrupted; run the same command again to resume" in log
        assert marked_processes(mark) == [], "processes left behind by the interrupted simulate"
        s = Store(db, readonly=True)
        done = len(s.round_metrics(run_id))
        assert s.run(run_id)["status"] != "finished" and 1 <= done < 30, (done, f"stopped in {stopped_s:.1f}s")
        s.close()
        q = start("second", ignore_sigint=False)
        assert q.wait(timeout=900) == 0, (tmp_path / "second.log").read_text(errors="replace")[-3000:]
    finally:
        for proc in (p, locals().get("q")):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        for pid in marked_processes(mark):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(ray_tmp, ignore_errors=True)
    ref_db = tmp_path / "ref.db"
    ref = Experiment(parse_experiment(exp), Store(ref_db)).run()
    got = Store(db)
    assert got.run(run_id)["status"] == "finished"
    assert [m["round"] for m in got.round_metrics(run_id)] == list(range(30))
    assert_identical_numbers(Store(ref_db), ref.run_id, got, run_id)


class RayCluster:
    """A Ray cluster on this machine as docs/flower.md sets one up on several: `ray start --head --num-cpus 0`
    and `workers` x `ray start --address HEAD:PORT --num-cpus 1`, each node with its own temporary
    directory under `root`, each `ray start --block` in a session of its own; `stop` ends them by pid."""

    def __init__(self, root: Path, env: dict, workers: int = 2):
        self.root, self.env, self.workers = root, env, workers
        self.procs: dict[str, subprocess.Popen] = {}
        self.address = ""

    def _ray_start(self, name: str, args: list[str]) -> subprocess.Popen:
        with open(self.root / f"{name}.log", "wb") as out:
            p = subprocess.Popen([str(Path(sys.executable).parent / "ray"), "start", *args, "--block",
                                  "--disable-usage-stats", "--temp-dir", str(self.root / name)], env=self.env,
                                 stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs[name] = p
        return p

    def log(self, name: str) -> str:
        import re
        return re.sub(r"\x1b\[[0-9;]*m", "", (self.root / f"{name}.log").read_text(errors="replace"))

    def start(self, timeout: float = 240.0) -> RayCluster:
        import re
        with socket.socket() as sk:
            sk.bind(("", 0))
            port = sk.getsockname()[1]
        head = self._ray_start("head", ["--head", "--port", str(port), "--num-cpus", "0", "--num-gpus", "0",
                                        "--include-dashboard", "false"])
        deadline = time.monotonic() + timeout
        while not (m := re.search(r"Local node IP: (\S+)", self.log("head"))):
            assert head.poll() is None and time.monotonic() < deadline, self.log("head")[-3000:]
            time.sleep(0.5)
        self.address = f"{m.group(1)}:{port}"
        for i in range(self.workers):
            self._ray_start(f"worker{i}", ["--address", self.address, "--num-cpus", "1", "--num-gpus", "0"])
        info = self.probe(wait_for=1 + self.workers, timeout=deadline - time.monotonic())
        assert len(info["nodes"]) == 1 + self.workers, (info, {n: self.log(n)[-2000:] for n in self.procs})
        return self

    def probe(self, wait_for: int = 0, timeout: float = 60.0) -> dict:
        """The cluster's live nodes and every actor it has run (the GCS keeps dead actors)."""
        p = run_bounded([sys.executable, "-c", RAY_PROBE, self.address, str(wait_for), f"{max(timeout, 1):.0f}"],
                        timeout + 120, env=self.env)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
        return json.loads(p.stdout.strip().splitlines()[-1])

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM every `ray start` (its reaper takes its processes down), then SIGKILL every process
        left in their sessions."""
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        sessions = {p.pid for p in self.procs.values()}
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and self.alive(sessions):
            time.sleep(0.5)
        for pid in self.alive(sessions):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in self.procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    @staticmethod
    def alive(sessions: set[int]) -> list[int]:
        out = []
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    if os.getsid(int(d.name)) in sessions and (d / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                        out.append(int(d.name))
                except (OSError, IndexError):
                    continue
        return out


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_simulation_on_a_multi_node_ray_cluster(tmp_path):
    """The same `simulate` on an existing Ray cluster (`ray_address`): a head with no CPUs and two workers
    with one CPU each, started as docs/flower.md shows. Every ClientApp actor of the run was placed on a
    worker node, both workers served clients, and the numbers equal the in-process run bit for bit.
    The cluster is torn down whatever happens, and no process of it or of the run is left."""
    pytest.importorskip("ray")
    exp = ("method=fedprism dataset=digits clients=4 rounds=2 fraction=1.0 local_epochs=1 lr=0.05 model=mlp "
           "device=cpu engine=sequential fedprism.k=2 fedprism.every=1 partition.alpha=0.5 seed=7")
    ref, _ = in_process(exp, tmp_path / "ref.db")
    root = Path(tempfile.mkdtemp(prefix="fprc-", dir="/tmp"))      # Ray's socket paths must stay < 108 bytes
    mark = uuid.uuid4().hex
    env = {**os.environ, **OFFLINE_ENV, "FEDPRISM_TEST_MARK": mark,
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src")] + [q for q in os.environ.get("PYTHONPATH", "").split(
               os.pathsep) if q])}
    for k in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"):
        env.pop(k, None)
    cluster = RayCluster(root, env, workers=2)
    try:
        cluster.start()
        before = cluster.probe()
        head = [n["id"] for n in before["nodes"] if n["head"]]
        workers = {n["id"] for n in before["nodes"] if not n["head"]}
        assert len(head) == 1 and len(workers) == 2 and all(n["cpus"] == (0 if n["head"] else 1) for n in before["nodes"])
        p, wall = simulate_in_subprocess(tmp_path, exp, 900, ray_address=cluster.address)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
        after = cluster.probe()
    finally:
        cluster.stop()
        left = marked_processes(mark)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(root, ignore_errors=True)
    assert left == [], f"processes of the Ray cluster left behind: {left}"
    clients = [a for a in after["actors"] if a["class"] == "ClientAppActor"]
    assert clients, after
    assert {a["node"] for a in clients} == workers, (clients, head, workers)    # both workers, never the head
    assert all(a["state"] == "DEAD" and a["restarts"] == 0 for a in clients), clients   # ended with the run
    got = torch.load(tmp_path / "sim.pt", weights_only=False)
    assert_identical_state(ref.state, got["state"])
    s = Store(tmp_path / "sim.db")
    assert s.run(got["run_id"])["status"] == "finished"
    assert_identical_numbers(ref.store, ref.run_id, s, got["run_id"])
    assert s.records(got["run_id"], "failure") == []
    print(f"multi-node simulation wall {wall:.1f}s on {cluster.address}; ClientApp actors "
          f"{sorted((a['node'][:8], a['pid']) for a in clients)}")


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_loopback_deployment_with_tls_auth_and_a_killed_node(tmp_path):
    """scripts/flower_deploy.py: SuperLink + 3 SuperNodes on 127.0.0.1 with generated TLS certificates and
    node authentication; an unregistered key is refused; a hostile node whose key Flower accepts but the
    operator's registry does not claims client 0 and is refused, client 0 keeps its node; one SuperNode
    is killed in round 2; the run finishes with the survivors and the store records the failure; every
    process is stopped."""
    pytest.importorskip("cryptography")
    out = tmp_path / "deploy"
    p = run_bounded([sys.executable, str(ROOT / "scripts" / "flower_deploy.py"), "--workdir", str(out),
                     "--json", str(tmp_path / "summary.json"), "--timeout", "1000"], 1080, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-6000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["unregistered_node_refused"] is True
    assert summary["status"] == "finished" and summary["rounds"] == 3
    assert summary["killed_client"] in summary["failed_clients_round"]["1"]
    assert summary["accepted"][0] == 3 and all(a == 2 for a in summary["accepted"][1:])
    assert summary["round0_clients_with_metrics"] == 3
    assert summary["impostor_refusals"] and all(d["field"] == "registry" for d in summary["impostor_refusals"])
    assert summary["client0_failures"] == []
    assert summary["leftover_processes"] == []


def test_dropout_model_runs_the_same_on_flower(tmp_path, task_identity):
    """A model with seeded dropout (the Clust-PSI-PFL CIFAR-10 CNN, `fedprism.models.dropout`): each node
    derives its client's masks from (run seed, round, client, stream, step) as the simulator does, so the
    Flower run equals the in-process one."""
    exp = ("method=fedavg dataset=digits clients=3 rounds=2 fraction=1.0 local_epochs=1 lr=0.01 "
           "model=clustpsi_cifar_cnn device=cpu engine=sequential partition.alpha=0.5 seed=4")
    rc = run_config(exp, tmp_path / "d.db", save_final=str(tmp_path / "final.pt"))
    ref, final = in_process(exp, tmp_path / "ref.db")
    res = serve(FakeGrid(nodes_for(3), rc), rc)
    assert res.status == "finished"
    assert_same_state(ref.state, torch.load(tmp_path / "final.pt", weights_only=False)["state"])
    assert res.final["local_acc"] == pytest.approx(final["local_acc"], abs=1e-9)


@pytest.mark.parametrize("method, extra", [("fedavg", ""), ("local", ""),
                                           ("fedavg", "drift.fraction=0.5 drift.every=1 drift.remove=0.5")])
def test_held_out_local_test_rows_score_the_same_on_flower(method, extra, tmp_path, task_identity):
    """`data.local_test = "split"`: each node builds its client's 80/20 split of its own rows as the
    simulator does and scores its local test rows there (they travel with its train rows; under drift a
    class that leaves a client leaves its held-out rows too)."""
    exp = (f"method={method} dataset=digits clients=4 rounds=2 fraction=1.0 local_epochs=1 lr=0.05 model=mlp "
           "device=cpu engine=sequential partition.alpha=0.5 seed=6 data.local_test=split data.val_fraction=0.2 "
           f"{extra}")
    db = tmp_path / "s.db"
    rc = run_config(exp, db)
    ref, final = in_process(exp, tmp_path / "ref.db")
    res = serve(FakeGrid(nodes_for(4), rc), rc)
    assert res.status == "finished"
    assert res.final["local_acc"] == pytest.approx(final["local_acc"], abs=1e-9)
    a = [tuple(r)[2:] for r in Store(tmp_path / "ref.db").client_rows(ref.run_id)]
    b = [tuple(r)[2:] for r in Store(db).client_rows(res.run_id)]
    assert np.allclose(np.array(a, dtype=float), np.array(b, dtype=float), atol=1e-9)     # n_test included


@pytest.mark.parametrize("method", ["fedavg", "fedprism_dual", "local"])
def test_validation_splits_score_the_same_on_flower(method, tmp_path, task_identity):
    exp = (f"method={method} dataset=digits clients=5 rounds=2 fraction=1.0 local_epochs=1 lr=0.05 model=mlp "
           "device=cpu engine=sequential seed=5 data.val_fraction=0.25 data.global_val=120")   # clients >= k = 5
    db = tmp_path / "v.db"
    rc = run_config(exp, db)
    ref, final = in_process(exp, tmp_path / "ref.db")
    res = serve(FakeGrid(nodes_for(5), rc), rc)
    assert res.status == "finished"
    a, b = ref.store.round_metrics(ref.run_id)[-1], Store(db).round_metrics(res.run_id)[-1]
    keys = [k for k in a if k.startswith(("val_acc", "global_val_acc"))]
    assert "val_acc" in keys and "global_val_acc" in keys
    for k in keys:
        assert b[k] == pytest.approx(a[k], abs=1e-9), k
