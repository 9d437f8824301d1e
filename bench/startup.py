"""What a command costs before it starts: `fedprism run` of a 1-round FedAvg run on digits with 4 clients into
a fresh store, and the same command again once the run is stored (answered from the store without torch:
fedprism.experiment.lookup). Each is timed in fresh interpreters, `--reps` times, as wall time and as the CPU
time of the process (user + system, which a machine shared with other work inflates less than wall time);
the medians are printed, then where the imports of one run of each go (`python -X importtime`: the ten
top-level packages that take the most import time, each package's modules' own times summed).

    python bench/startup.py                 # 5 repetitions each
    python bench/startup.py --reps 9 --keep-cache
    git worktree add /tmp/old <commit>; python bench/startup.py --src /tmp/old/src     # another checkout

The commands import fedprism from a copy of `--src` taken at the start (a tree that others edit meanwhile
would change the lookup memo's key between repetitions). Their environment is this one's, except
`FEDPRISM_CACHE`, which points at a temporary folder (an
empty cache: no built kernels, so `train.kernels=auto` resolves to aten, and no lookup memo before the first
run writes it); `--keep-cache` uses the real cache instead. `OMP_NUM_THREADS=1` unless set. bench/README.md,
"bench/startup.py", has the figures.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ITEMS = ["method=fedavg", "dataset=digits", "clients=4", "rounds=1"]


def timed(cmd: list[str], env: dict, cwd: Path) -> tuple[float, float, subprocess.CompletedProcess]:
    """(wall seconds, CPU seconds of the child: user + system, the finished process)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    r = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout}{r.stderr}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), r


def import_summary(stderr: str, top: int = 10) -> tuple[float, list[tuple[str, float]]]:
    """Total import time and the `top` top-level packages by summed own ("self") import time, in seconds,
    from the text `python -X importtime` writes to stderr."""
    own: Counter = Counter()
    for line in stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        self_us, _, name = line.split(":", 1)[1].split("|", 2)
        own[name.strip().split(".")[0]] += int(self_us)
    return sum(own.values()) / 1e6, [(k, v / 1e6) for k, v in own.most_common(top)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5, help="fresh interpreters per figure (default 5)")
    ap.add_argument("--src", default=str(ROOT / "src"),
                    help="the src/ folder the commands import fedprism from (default: this checkout's)")
    ap.add_argument("--keep-cache", action="store_true",
                    help="use the real FEDPRISM_CACHE (built kernels, memo entries) instead of an empty one")
    a = ap.parse_args(argv)
    if a.reps < 1:
        ap.error("--reps: an integer >= 1")
    work = Path(tempfile.mkdtemp(prefix="fedprism-startup-"))
    shutil.copytree(Path(a.src) / "fedprism", work / "src" / "fedprism", ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(work / "src"), os.environ.get("PYTHONPATH")]))}
    if not a.keep_cache:
        env["FEDPRISM_CACHE"] = str(work / "cache")
    fedprism = [sys.executable, "-m", "fedprism", "run", *ITEMS, "--quiet"]

    runs, lookups = [], []
    for i in range(a.reps):                                   # (1) a run into a fresh store, each time
        wall, cpu, r = timed([*fedprism, "--db", str(work / f"run{i}.db")], env, work)
        assert "(stored: not run again" not in r.stdout, r.stdout
        runs.append((wall, cpu))
    stored = work / "run0.db"
    for _ in range(a.reps):                                   # (2) the same run, stored
        wall, cpu, r = timed([*fedprism, "--db", str(stored)], env, work)
        assert "(stored: not run again" in r.stdout, r.stdout
        lookups.append((wall, cpu))
    run_id = r.stdout.split()[1]

    print(f"fedprism run {' '.join(ITEMS)}  (run {run_id}, fedprism from {a.src}); {a.reps} fresh "
          "interpreters each, medians")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}; Python {platform.python_version()}")
    for what, xs in (("run into a fresh store", runs), ("stored result (lookup)", lookups)):
        walls, cpus = [w for w, _ in xs], [c for _, c in xs]
        print(f"  {what:24s} wall {statistics.median(walls):6.2f} s (min {min(walls):.2f}, max {max(walls):.2f})"
              f"   CPU {statistics.median(cpus):6.2f} s (min {min(cpus):.2f}, max {max(cpus):.2f})")
    for what, db in (("run into a fresh store", work / "importtime.db"), ("stored result (lookup)", stored)):
        _, _, r = timed([sys.executable, "-X", "importtime", *fedprism[1:], "--db", str(db)], env, work)
        total, top = import_summary(r.stderr)
        print(f"\nimports of one {what}: {total:.2f} s in all; the ten largest packages (own time):")
        for name, s in top:
            print(f"  {name:28s} {s:6.3f} s")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
