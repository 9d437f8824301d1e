"""README.md is what a newcomer reads first: at most 10,000 characters, the two set-up commands that CI
runs, and a quick start that runs as printed, shows its progress and answers a second time from the store."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_the_readme_is_short_and_names_the_two_commands():
    assert len(README) <= 10_000, len(README)
    assert "bash bootstrap.sh demo" in README and "bash bootstrap.sh test" in README
    assert "bash bootstrap.sh test" in (ROOT / ".ci" / "run").read_text()


def quickstart_command() -> list[str]:
    block = README.split("## Quick start", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    line = block.replace("\\\n", " ").splitlines()
    run = next(x for x in line if x.strip().startswith("fedprism run"))
    return shlex.split(run)[1:]


@pytest.mark.slow
def test_the_quick_start_runs_as_printed_with_progress(tmp_path):
    args = quickstart_command()
    assert "threads=2" in args and any(a.startswith("local_epochs=") for a in args)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, "-m", "fedprism", *args]
    first = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=900)
    assert first.returncode == 0, first.stderr[-3000:]
    rounds = next(a for a in args if a.startswith("rounds=")).split("=")[1]
    assert f"round {rounds}/{rounds}" in first.stderr                # one progress line per round, in a log too
    assert "local_acc" in first.stdout and "global_acc" in first.stdout
    again = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=900)
    assert again.returncode == 0 and "round 1/" not in again.stderr   # the stored result: no training
    assert again.stdout.splitlines()[1:] == first.stdout.splitlines()[1:]
