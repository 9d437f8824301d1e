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
