"""Nothing listens beyond loopback: the SuperLink and Ray under `python -m fedprism.flower simulate`, and
the deployment script's private keys are owner-only from the moment they exist."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import load_script

from fedprism.flower.simulation import descendants

ROOT = Path(__file__).resolve().parents[1]
LOOPBACK = re.compile(r"^(127\.\d+\.\d+\.\d+|\[::1\]|\[::ffff:127\.\d+\.\d+\.\d+\]|localhost):\d+$")


def _deploy_module():
    return load_script("scripts/flower_deploy.py")


def test_private_keys_are_created_owner_only(tmp_path, monkeypatch):
    pytest.importorskip("cryptography")
    deploy = _deploy_module()
    old = os.umask(0)                                   # a permissive umask must not matter
    try:
        monkeypatch.setattr(deploy.os, "chmod", lambda *a, **k: None)     # no chmod-after-write either
        files = deploy.make_certificates(tmp_path)
        priv, pub = deploy.make_node_key(tmp_path, "node0")
        for key in (files["key"], priv):
            assert key.stat().st_mode & 0o777 == 0o600, key
        (tmp_path / "node1").write_bytes(b"old")
        os.chmod(tmp_path / "node1", 0o644)
        deploy.write_private(tmp_path / "node1", b"new key")              # an existing file is narrowed
    finally:
        os.umask(old)
    assert (tmp_path / "node1").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "node1").read_bytes() == b"new key"
    assert b"PRIVATE KEY" in files["key"].read_bytes() and pub.read_text().startswith("ecdsa-sha2-nistp384 ")


def _listening(pids: set[int]) -> dict[str, str]:
    """Local address -> process name of every listening TCP/UDP socket of the given processes."""
    out = subprocess.run(["ss", "-ltnupH"], capture_output=True, text=True).stdout
    found = {}
    for line in out.splitlines():
        m = re.search(r"pid=(\d+)", line)
        if not m or int(m.group(1)) not in pids:
            continue
        name = re.search(r'\(\("([^"]+)"', line)
        found[line.split()[4]] = name.group(1) if name else "?"
    return found


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ray_under_simulate_listens_on_loopback_only(tmp_path):
    pytest.importorskip("ray")
    if shutil.which("ss") is None:
        pytest.skip("ss (iproute2) is not installed")
    ray_tmp = tempfile.mkdtemp(prefix="fpray-", dir="/tmp")              # Ray's socket paths stay short
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "RAY_TMPDIR": ray_tmp,
           "FLWR_HOME": str(tmp_path / "flwr-home")}
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
    cmd = [sys.executable, "-m", "fedprism.flower", "simulate", "--db", str(tmp_path / "sim.db"), "--experiment",
           "method=fedavg dataset=digits clients=2 rounds=12 local_epochs=1 model=mlp engine=sequential fraction=1.0"]
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    seen: dict[str, str] = {}
    tree: set[int] = set()
    try:
        t0 = time.time()
        while p.poll() is None and time.time() - t0 < 500:
            # the process tree, not the session: Flower's SuperExec detaches into a session of its own
            tree = descendants({p.pid} | tree)
            seen.update(_listening(tree))
            time.sleep(0.3)
        out = p.communicate(timeout=60)[0].decode(errors="replace")
    finally:
        if p.poll() is None:
            os.killpg(p.pid, 9)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert p.returncode == 0, out[-3000:]
    names = set(seen.values())
    assert {"gcs_server", "raylet"} <= names, seen                     # the probe saw Ray's servers
    assert any(n.startswith("flower-superlin") for n in names), seen    # and the simulation SuperLink
    exposed = {a: n for a, n in seen.items() if not LOOPBACK.match(a)}
    assert exposed == {}, f"listening beyond loopback: {exposed}"
