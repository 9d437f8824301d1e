"""Does a test guard this line? Break the line in a copy of `src/` and run the tests against the copy.

    python scripts/mutate.py FILE OLD NEW [pytest arguments ...]

FILE is relative to `src/` (e.g. `fedprism/algorithms/fedavg.py`); OLD must occur exactly once in it and
is replaced by NEW. The tests run with `PYTHONPATH` pointing at the copy, so the working tree is never
touched and several checks can run at once. Exit status: 0 KILLED (some test failed: the line is
guarded), 1 SURVIVED (every test passed), 2 the mutation does not apply (OLD missing or not unique).

    python scripts/mutate.py fedprism/clustering/soft.py "z.max(axis=1" "z.min(axis=1" \
        tests/test_clustering.py -k soft_assign

A mutation that survives is either equivalent (the code computes the same thing either way, e.g. a guard
another guard already covers) or a gap in the tests: write the test, then run the mutation again and see
it killed. Slow tests are left out unless the pytest arguments select them (`-m slow`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    rel, old, new, *pytest_args = argv
    with tempfile.TemporaryDirectory(prefix="fedprism-mutant-") as tmp:
        src = Path(tmp) / "src"
        shutil.copytree(ROOT / "src", src, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        target = src / rel
        if not target.is_file():
            print(f"mutate: no file src/{rel}", file=sys.stderr)
            return 2
        text = target.read_text()
        count = text.count(old)
        if count != 1:
            print(f"mutate: {old!r} occurs {count} times in src/{rel}; it must occur exactly once",
                  file=sys.stderr)
            return 2
        target.write_text(text.replace(old, new))
        path = os.pathsep.join(p for p in (str(src), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "PYTHONPATH": path}
        marks = [] if "-m" in pytest_args else ["-m", "not slow"]
        done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *marks,
                               *pytest_args], cwd=ROOT, env=env, capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode == 5:                                     # pytest: no test was collected
        print(f"mutate: no test selected by {pytest_args}", file=sys.stderr)
        return 2
    summary = lines[-1] if lines else done.stderr.strip()[-300:]
    failed = [ln for ln in lines if ln.startswith("FAILED")][:1]
    verdict = "KILLED" if done.returncode else "SURVIVED"
    print(f"{verdict}  src/{rel}: {old!r} -> {new!r}  | {summary}" + (f"  ({failed[0]})" if failed else ""))
    return 0 if done.returncode else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
