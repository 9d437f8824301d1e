"""What whole runs cost, read from a results store: the sums of the rounds' `train_s` and `eval_s`.

    python bench/run_cost.py STORE.db [RUN ...] [--ratio RUN_A RUN_B]

For every finished run (or the runs named, by id or prefix) it prints the rounds stored, training and
evaluation seconds (sums), the first round's training time (it holds the one-time compilation), the
median of the later rounds' training and of the later evaluations, and the final headline accuracies.
`--ratio A B` adds the cost of run A over run B (train_s + eval_s), the quantity the FedPrism cost target
is stated in. Read-only: the store is opened in SQLite's read-only mode.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
import sys

KEYS = ("global_acc", "local_acc", "global_acc@backbone", "local_acc@expert")


def costs(db: str, runs: list[str]) -> dict[str, dict]:
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        rows = con.execute("select run_id, name, method, status from runs order by run_id").fetchall()
        out = {}
        for rid, name, method, status in rows:
            if runs and not any(rid.startswith(r) for r in runs):
                continue
            if not runs and status != "finished":
                continue
            q = "select metrics from rounds where run_id = ? order by round"
            ms = [json.loads(m) for (m,) in con.execute(q, (rid,))]
            if not ms:
                continue
            train = [m.get("train_s", 0.0) for m in ms]
            evals = [m["eval_s"] for m in ms if "eval_s" in m]
            last = next((m for m in reversed(ms) if "global_acc" in m or "local_acc" in m), {})
            out[rid] = {"name": name, "method": method, "rounds": len(ms), "train": sum(train),
                        "eval": sum(evals), "train0": train[0],
                        "train_med": statistics.median(train[1:]) if len(train) > 1 else train[0],
                        "eval_med": statistics.median(evals[1:]) if len(evals) > 1 else (evals or [0.0])[0],
                        "final": {k: last[k] for k in KEYS if k in last}}
        return out
    finally:
        con.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("db")
    ap.add_argument("runs", nargs="*", help="run ids or prefixes (default: every finished run)")
    ap.add_argument("--ratio", nargs=2, metavar=("A", "B"), help="print cost(A) / cost(B)")
    a = ap.parse_args(argv)
    try:
        out = costs(a.db, a.runs + (list(a.ratio) if a.ratio else []))
    except sqlite3.Error as e:
        print(f"run_cost: cannot read {a.db}: {e}", file=sys.stderr)
        return 2
    print(f"{'run':18s} {'method':14s} {'rounds':>6s} {'train s':>8s} {'eval s':>7s} {'total s':>8s} "
          f"{'round 0':>7s} {'train/rd':>8s} {'eval/ev':>7s}  final")
    for rid, c in out.items():
        fin = ", ".join(f"{k} {100 * v:.2f}" for k, v in c["final"].items())
        print(f"{rid:18s} {c['method']:14s} {c['rounds']:6d} {c['train']:8.1f} {c['eval']:7.1f} "
              f"{c['train'] + c['eval']:8.1f} {c['train0']:7.2f} {c['train_med']:8.3f} {c['eval_med']:7.3f}"
              f"  {fin}")
    if a.ratio:
        found = {r: next((rid for rid in out if rid.startswith(r)), None) for r in a.ratio}
        if None in found.values():
            missing = [r for r, v in found.items() if v is None]
            print(f"run_cost: --ratio: no such run: {missing}", file=sys.stderr)
            return 2
        ca, cb = (out[found[r]] for r in a.ratio)
        print(f"\ncost {found[a.ratio[0]]} / {found[a.ratio[1]]}: "
              f"{(ca['train'] + ca['eval']) / (cb['train'] + cb['eval']):.2f}x "
              f"(training {ca['train'] / cb['train']:.2f}x, "
              f"evaluation {ca['eval'] / max(cb['eval'], 1e-9):.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
