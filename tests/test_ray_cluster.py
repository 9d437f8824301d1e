"""`fedprism sweep FILE --ray ADDRESS` on a real Ray cluster on loopback: a head without CPUs and two worker
nodes of one CPU and one (declared) GPU each, started with ray.cluster_utils.Cluster (only this test's
processes are stopped at the end). The runs come back into the one store with the numbers of local runs;
killing the driver loses nothing finished and the killed runs resume; shipped results are merged."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SWEEP = """
name = "ray_loopback"
[base]
dataset = "digits"
clients = 3
fraction = 1.0
rounds = {rounds}
local_epochs = 1
model = "mlp"
keep_final = false
[grid]
seed = [0, 1]
[[runs]]
method = "fedavg"
[[runs]]
method = "fedprox"
"""


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    for _ in range(2):
        c.add_node(num_cpus=1, num_gpus=1)      # a declared GPU: --ray-gpus 0.5 packs two runs on each
    c.wait_for_nodes()
    yield c
    c.shutdown()


def _sweep(path: Path, db: Path, *extra: str, wait: bool = True):
    args = [sys.executable, "-m", "fedprism", "sweep", str(path), "--db", str(db), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    if not wait:
        return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=900)


def _local_finals(path: Path, tmp: Path) -> dict[str, list[float]]:
    """Each run's per-round local accuracy as a plain local sweep stores it."""
    from fedprism.experiment.store import Store
    from fedprism.experiment.sweep import load_sweep

    db = tmp / "local.db"
    r = _sweep(path, db)
    assert r.returncode == 0, r.stderr
    with Store(db) as store:
        return {c.run_id: [m["local_acc"] for m in store.round_metrics(c.run_id)] for c in load_sweep(path)[1]}


def test_a_sweep_on_the_cluster_stores_what_a_local_sweep_stores(cluster, tmp_path):
    from fedprism.experiment.store import Store

    path = tmp_path / "s.toml"
    path.write_text(SWEEP.format(rounds=12))
    want = _local_finals(path, tmp_path)
    db = tmp_path / "ray.db"
    # the driver is killed once the first run is stored: nothing finished is lost, the others resume
    proc = _sweep(path, db, "--ray", cluster.address, "--ray-cpus", "1", "--ray-gpus", "0.5", wait=False)
    deadline = time.time() + 600
    finished = set()
    while time.time() < deadline and not finished and proc.poll() is None:
        time.sleep(0.5)
        if db.exists():
            try:
                with Store(db) as store:
                    finished = {r["run_id"] for r in store.runs() if r["status"] == "finished"}
            except Exception:  # noqa: BLE001 - the store being created or written
                pass
    assert finished, proc.communicate()[1] if proc.poll() is not None else "no run finished in time"
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    time.sleep(2)                                   # the killed driver's tasks end with it
    with Store(db) as store:
        kept = {r["run_id"] for r in store.runs() if r["status"] == "finished"}
    assert finished <= kept
    r = _sweep(path, db, "--ray", cluster.address, "--ray-cpus", "1", "--ray-gpus", "0.5")
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("finished earlier, skipped") == len(kept), r.stderr
    assert "runs on the Ray cluster" in r.stderr or len(kept) == 4
    with Store(db) as store:
        got = {rid: [m["local_acc"] for m in store.round_metrics(rid)] for rid in want}
        assert all(store.run(rid)["status"] == "finished" for rid in want)
        assert {row["run_id"] for row in store.runs(sweep="ray_loopback")} == set(want)
        assert store.db.execute("SELECT COUNT(*) FROM runs").fetchone()[0] == 4          # each run once
    assert got == want                               # the numbers of the local sweep, resumed runs included
    again = _sweep(path, db, "--ray", cluster.address)
    assert again.returncode == 0 and again.stderr.count("finished earlier, skipped") == 4


def test_shipped_results_are_merged_into_the_store(cluster, tmp_path):
    from fedprism.experiment.store import Store

    path = tmp_path / "s.toml"
    path.write_text(SWEEP.format(rounds=2))
    want = _local_finals(path, tmp_path)
    db = tmp_path / "ship.db"
    scratch = tmp_path / "scratch"
    r = _sweep(path, db, "--ray", cluster.address, "--ray-store", "ship", "--ray-scratch", str(scratch))
    assert r.returncode == 0, r.stderr
    with Store(db) as store:
        assert {rid: [m["local_acc"] for m in store.round_metrics(rid)] for rid in want} == want
        assert {row["run_id"] for row in store.runs(sweep="ray_loopback")} == set(want)
    assert sorted(p.stem for p in scratch.glob("*.db")) == sorted(want)      # each task's own store
