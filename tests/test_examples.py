"""The examples under examples/ run as documented (CI executes them through this test)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_quickstart_runs_and_reuses_stored_results(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, str(ROOT / "examples" / "quickstart.py"), "--db", str(tmp_path / "qs.db")]
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    for method in ("fedavg ", "fedavg_ema", "local ", "fedprism "):
        assert method in first.stdout
    assert "4 finished runs" in first.stdout and "fedavg local accuracy by round" in first.stdout
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)      # stored: no training
    assert again.returncode == 0 and again.stdout.splitlines()[:4] == first.stdout.splitlines()[:4]


def test_the_readmes_python_example_runs_as_printed(tmp_path):
    """The code block of README.md's "Python API" section, run as printed (its store lands in tmp_path).
    A configuration the limits refuse (say, fewer clients a round than Fed-PRISM's K) fails here."""
    text = (ROOT / "README.md").read_text()
    block = text.split("## Python API", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    local, glob = map(float, r.stdout.split())
    assert 0.8 < local <= 1 and 0 < glob <= 1 and (tmp_path / "study.db").exists()


def test_the_python_api_guides_first_example_runs_as_printed(tmp_path):
    """docs/python-api.md, "Run an experiment": the first code block, as printed."""
    text = (ROOT / "docs" / "python-api.md").read_text()
    block = text.split("```python\n", 1)[1].split("```", 1)[0]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, env=env, cwd=tmp_path,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "study.db").exists()


def test_the_python_api_guides_simulator_example_runs_as_printed(tmp_path, monkeypatch):
    """docs/python-api.md, "Drive an algorithm by hand": the code block, as printed (in this process)."""
    text = (ROOT / "docs" / "python-api.md").read_text()
    block = text.split("## Drive an algorithm by hand", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(block, "python-api.md", "exec"), scope)
    assert scope["sim"].evaluate("local").count.sum() > 0 and (tmp_path / "sim.db").exists()
