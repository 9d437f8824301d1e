"""`fedprism sweep --workers N`: the same runs and numbers as one worker, in parallel processes."""

from __future__ import annotations

import json

import pytest

from fedprism.experiment.store import Store
from fedprism.experiment.sweep import dump_sweep, run_sweep

SWEEP = dump_sweep("par", dict(dataset="digits", clients=6, rounds=2, local_epochs=1, model="mlp",
                                engine="sequential"),
                   [dict(label="FedAvg", method="fedavg"), dict(label="Local", method="local")], {"seed": [0, 1]})


def finals(db):
    return {r["run_id"]: (r["label"], json.loads(r["final"])["local_acc"]) for r in Store(db).runs(sweep="par")}


def test_two_workers_give_the_same_runs_as_one(tmp_path):
    f = tmp_path / "s.toml"
    f.write_text(SWEEP)
    run_sweep(str(f), str(tmp_path / "one.db"), progress=False, workers=1)
    run_sweep(str(f), str(tmp_path / "two.db"), progress=False, workers=2)
    one, two = finals(tmp_path / "one.db"), finals(tmp_path / "two.db")
    assert len(one) == 4 and one == two
    s = Store(tmp_path / "two.db")
    assert all(r["status"] == "finished" for r in s.runs())
    assert all(len(s.round_metrics(r["run_id"])) == 2 for r in s.runs())
    run_sweep(str(f), str(tmp_path / "two.db"), progress=False, workers=2)      # resumable: nothing to do
    assert finals(tmp_path / "two.db") == two


KILL_PARENT = """
import os, signal, sys, time
import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor
from fedprism.experiment.sweep import _sweep_worker_init

if __name__ == "__main__":
    pool = ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"), initializer=_sweep_worker_init, initargs=(1,))
    pid = pool.submit(os.getpid).result()
    pool.submit(time.sleep, 600)                   # a long run in the worker
    with open(sys.argv[1], "w") as f:
        f.write(str(pid))
    os.kill(os.getpid(), signal.SIGKILL)           # the sweep is killed; no cleanup runs in the parent
"""


def test_workers_end_when_the_sweep_process_is_killed(tmp_path):
    """A killed `fedprism sweep` leaves no worker behind to keep training and holding its run."""
    import os
    import subprocess
    import sys
    import time

    script = tmp_path / "kill_parent.py"
    script.write_text(KILL_PARENT)
    pid_file = tmp_path / "worker.pid"
    subprocess.run([sys.executable, str(script), str(pid_file)], stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, timeout=120)         # no pipe a surviving worker could hold open
    worker = int(pid_file.read_text())

    def alive(pid: int) -> bool:           # a zombie (ended, not yet reaped by its new parent) is not alive
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except (ProcessLookupError, FileNotFoundError):
            return False
        except OSError:
            return True

    deadline = time.time() + 10
    while alive(worker) and time.time() < deadline:
        time.sleep(0.2)
    if alive(worker):
        os.kill(worker, 9)
        raise AssertionError(f"worker {worker} outlived the killed sweep process")


@pytest.mark.parametrize("inherited", ["default", "ignored"])
def test_sigint_to_the_sweep_process_alone_stops_every_worker_at_once(tmp_path, inherited):
    """`kill -INT <sweep pid>` (what `timeout -s INT` and job schedulers send): the running runs end
    'interrupted' with their checkpoints, and no queued run starts. The process pool's own shutdown would
    first run every queued run to its end (here: hours). "ignored": launched with SIGINT ignored, as a
    shell starts a background job (`fedprism sweep ... &`); the signal must still stop it."""
    import os
    import signal
    import subprocess
    import sys
    import time

    f = tmp_path / "long.toml"
    f.write_text(SWEEP.replace('"rounds" = 2', '"rounds" = 100000'))
    assert '"rounds" = 100000' in f.read_text()
    db = tmp_path / "s.db"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    disposition = signal.SIG_IGN if inherited == "ignored" else signal.SIG_DFL
    proc = subprocess.Popen([sys.executable, "-m", "fedprism", "sweep", str(f), "--db", str(db), "--workers", "2",
                             "--quiet"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, disposition))
    try:
        deadline = time.time() + 120
        while time.time() < deadline:          # both workers are inside a run (each wrote a round)
            if db.exists() and len([r for r in Store(db).runs() if r["rounds_done"] >= 1]) == 2:
                break
            time.sleep(0.3)
        else:
            raise AssertionError("the two workers did not start their runs")
        os.kill(proc.pid, signal.SIGINT)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 130, proc.stderr.read().decode()
    import sqlite3
    raw = sqlite3.connect(f"file:{db}?mode=ro", uri=True)   # before `Store` recovers a killed worker's run
    assert [s for (s,) in raw.execute("SELECT status FROM runs")] == ["interrupted"] * 2   # the runs said so
    raw.close()
    runs = Store(db).runs()
    assert len(runs) == 2, [r["name"] for r in runs]            # no queued run started after the signal
    assert {r["status"] for r in runs} == {"interrupted"}


def test_ctrl_c_while_the_workers_start_prints_no_traceback(tmp_path):
    """Ctrl-C in a terminal reaches the whole process group, the workers too, and they spend their first
    seconds importing torch. They start with SIGINT ignored until their set-up is done, and the sweep
    process stops them itself: one line on stderr, no worker's `KeyboardInterrupt` traceback, no run."""
    import os
    import signal
    import subprocess
    import sys
    import time

    f = tmp_path / "s.toml"
    f.write_text(SWEEP)
    db = tmp_path / "s.db"

    def spawned_workers(parent: int) -> int:
        """The workers whose interpreter is up (Python ignores SIGPIPE from its start) and importing."""
        n = 0
        for d in os.listdir("/proc"):
            try:
                with open(f"/proc/{d}/stat") as st:
                    ppid = int(st.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{d}/cmdline", "rb") as c:
                    worker = ppid == parent and b"spawn_main" in c.read()
                with open(f"/proc/{d}/status") as st:
                    ignored = int(next(x for x in st if x.startswith("SigIgn:")).split()[1], 16)
                n += worker and bool(ignored & 1 << (signal.SIGPIPE - 1))
            except (ValueError, OSError, IndexError, StopIteration):
                continue
        return n

    proc = subprocess.Popen([sys.executable, "-m", "fedprism", "sweep", str(f), "--db", str(db),
                             "--workers", "2"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.time() + 60
        while spawned_workers(proc.pid) < 2 and time.time() < deadline and proc.poll() is None:
            time.sleep(0.02)
        assert spawned_workers(proc.pid) == 2, "the sweep did not spawn two workers"
        os.killpg(proc.pid, signal.SIGINT)             # what a terminal's Ctrl-C does
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    err = proc.stderr.read().decode()
    assert rc == 130 and "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert "run the same command again to resume" in err
    assert not db.exists() or Store(db).runs() == []
