"""Same numbers before and after a refactor: the first rounds of committed runs, re-run and compared.

    # 1. run the first N rounds of every committed run of a sweep with some checkout of fedprism
    PYTHONPATH=/path/to/old/src python bench/api_equivalence.py run --out old.json
    python bench/api_equivalence.py run --out new.json
    # 2. compare the two, and each with the stored rounds
    python bench/api_equivalence.py compare old.json new.json
    # the same on a small digits federation (every original method, both engines; seconds)
    PYTHONPATH=/path/to/old/src python bench/api_equivalence.py run --small --out old-small.json

`run` opens `results/fedprism.db` read-only, takes the seed-0 runs of `--sweep` (default
`paper_fmnist_dir01`: all eight methods, the Fed-PRISM server with its five clusterings), and re-runs
each configuration for `--rounds` rounds (`stop_after`, so the configuration, and with it the engine and
compile decision, is the stored one) into a temporary store, one thread. Only this script's own
`fedprism` import decides which code runs, so the same file serves the code before and after a change.

`compare` prints, per run, the first round and metric where two files differ (timing keys excluded)
or "identical", and the same against the stored rounds.
"""

from __future__ import annotations

import argparse
import json
import math
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: wall-clock keys: they differ run to run and say nothing about the numbers
TIMING = {"train_s", "eval_s", "wall_s"}
#: work counters: how many model evaluations were computed (not cached); reported, not a result
WORK = {"models_evaluated"}


def stored_runs(db: Path, sweep: str, seed: int) -> list[tuple[str, str, dict]]:
    con = sqlite3.connect(f"file:{db}?mode=ro&immutable=1", uri=True)
    rows = con.execute(
        "SELECT s.label, r.run_id, r.config FROM sweep_runs s JOIN runs r USING (run_id) "
        "WHERE s.sweep = ? AND r.seed = ? ORDER BY s.label", (sweep, seed)).fetchall()
    return [(label, rid, json.loads(cfg)) for label, rid, cfg in rows]


def stored_rounds(db: Path, run_id: str, n: int) -> list[dict]:
    con = sqlite3.connect(f"file:{db}?mode=ro&immutable=1", uri=True)
    rows = con.execute("SELECT round, metrics FROM rounds WHERE run_id = ? AND round < ? ORDER BY round",
                       (run_id, n)).fetchall()
    return [{"round": r, **json.loads(m)} for r, m in rows]


#: the small federation of `run --small`: every original method, both engines, seconds each
SMALL = [("fedavg", {}), ("local", {}), ("fedprism", {"fedprism.k": 2, "fedprism.m": 2}),
         ("fedprism", {"fedprism.k": 3, "fedprism.clustering": "covariance"}), ("fedprism_dual", {"fedprism_dual.k": 2}),
         ("fedclust", {"fedclust.k": 2}), ("ifca", {"ifca.k": 3}),
         ("cfl", {"cfl.warmup": 1, "cfl.eps1": 10.0, "cfl.eps2": 0.0}), ("fedamp", {})]


def small_configs() -> list[tuple[str, dict]]:
    base = {"dataset": "digits", "clients": 8, "rounds": 4, "fraction": 0.5, "local_epochs": 1, "model": "mlp",
            "compile": False, "lr": 0.05, "seed": 3}
    return [(f"{engine}:{m}" + (":covariance" if "fedprism.clustering" in extra else ""),
             {**base, "method": m, "engine": engine, **extra})
            for engine in ("sequential", "vectorized") for m, extra in SMALL]


def cmd_run(a: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(a.threads)
    import fedprism
    from fedprism.experiment.config import resolve
    from fedprism.experiment.runner import Experiment
    from fedprism.experiment.store import Store

    out = json.loads(Path(a.out).read_text()) if Path(a.out).exists() else {}
    todo = [(label, resolve(cfg).run_id + ":" + label, cfg) for label, cfg in small_configs()] if a.small \
        else stored_runs(Path(a.db), a.sweep, a.seed)
    for label, rid, cfg in todo:
        if a.only and label not in a.only:
            continue
        if rid in out and len(out[rid]["rounds"]) >= a.rounds:
            continue
        # a stored configuration is replayed as it ran: keys added since (the kernels) at their old values
        c = resolve(cfg) if a.small else resolve({"train.kernels": "aten", "eval.kernels": "aten", **cfg})
        t0 = time.time()
        with tempfile.TemporaryDirectory() as tmp:
            store = Store(Path(tmp) / "eq.db")
            Experiment(c, store).run(stop_after=a.rounds)
            rounds = store.round_metrics(c.run_id)
            store.close()
        out[rid] = {"label": label, "rounds": rounds, "code": getattr(fedprism, "__file__", "?"),
                    "seconds": time.time() - t0}
        Path(a.out).write_text(json.dumps(out, indent=1, sort_keys=True))
        print(f"{label:32s} {rid} {len(rounds)} rounds in {time.time() - t0:.0f}s", flush=True)


def first_difference(x: list[dict], y: list[dict], skip: set[str] = TIMING | WORK) -> str | None:
    """'round r: key a != b' for the first differing metric of `x` (keys in `skip` ignored; keys only `y`
    has are additions, not differences), or None."""
    for r, (m1, m2) in enumerate(zip(x, y)):
        for k in sorted(m1):
            if k in skip:
                continue
            v1, v2 = m1.get(k), m2.get(k)
            same = v1 == v2 or (isinstance(v1, float) and isinstance(v2, float) and math.isnan(v1) and math.isnan(v2))
            if not same:
                return f"round {r}: {k} {v1!r} != {v2!r}"
    if len(x) != len(y):
        return f"{len(x)} rounds vs {len(y)}"
    return None


def cmd_compare(a: argparse.Namespace) -> int:
    old, new = json.loads(Path(a.old).read_text()), json.loads(Path(a.new).read_text())
    bad = 0
    print(f"{'run':32s} {'old == new':34s} stored == new")
    for rid in sorted(set(old) | set(new), key=lambda r: (old.get(r) or new.get(r))["label"]):
        if rid not in old or rid not in new:
            print(f"{(old.get(rid) or new.get(rid))['label']:32s} missing in {'old' if rid not in old else 'new'}")
            bad += 1
            continue
        n = len(new[rid]["rounds"])
        d = first_difference(old[rid]["rounds"], new[rid]["rounds"])
        stored = stored_rounds(Path(a.db), rid, n)
        s = first_difference(stored, new[rid]["rounds"]) if stored else "(not a stored run)"
        added = sorted(set().union(*new[rid]["rounds"]) - set().union(*old[rid]["rounds"]))
        if added:
            d = (d or f"identical ({n} rounds)") + f"; new keys {', '.join(added)}"
        work = [(h1.get(k), h2.get(k)) for h1, h2 in zip(old[rid]["rounds"], new[rid]["rounds"]) for k in WORK
                if h1.get(k) != h2.get(k)]
        bad += d is not None
        note = f"; models_evaluated differs in {len(work)} rounds (old {work[0][0]} -> new {work[0][1]})" if work else ""
        print(f"{new[rid]['label']:32s} {(d or f'identical ({n} rounds)') + note:34s} {s or 'identical'}")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--db", default=str(ROOT / "results" / "fedprism.db"))
    r.add_argument("--sweep", default="paper_fmnist_dir01")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--rounds", type=int, default=10)
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--only", nargs="*", help="row labels to run (default: all)")
    r.add_argument("--small", action="store_true",
                   help="instead of the stored runs: every original method on a small digits federation, both "
                        "engines (4 rounds, seconds each)")
    c = sub.add_parser("compare")
    c.add_argument("old")
    c.add_argument("new")
    c.add_argument("--db", default=str(ROOT / "results" / "fedprism.db"))
    a = ap.parse_args()
    if a.cmd == "run":
        cmd_run(a)
        return 0
    return cmd_compare(a)


if __name__ == "__main__":
    sys.exit(main())
