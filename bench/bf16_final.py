"""bf16 evaluation on whole runs: a kept final state scored at float32 and at bfloat16.

    python bench/bf16_final.py [--db results/fedprism.db] [RUN ...] [--threads 1]

Training is float32 whatever `eval.precision` says, and nothing in training reads an evaluation (for the
uniform client selection of these runs), so a run with `eval.precision=bfloat16` trains the very models
of its float32 twin. Scoring a finished run's kept final state both ways therefore gives exactly the
final-round numbers each of the two runs would report. This script does that for every finished run
whose final state is kept beside the store (or the runs named), and prints, per headline metric, both
values and their difference next to the seed-to-seed spread of the same metric: the difference between
seeds 0 and 1 of the FedPrism paper runs at Dirichlet 0.1 ("FedPrism" of `sweeps/paper_fmnist_dir01.toml`) in
the store.
Read-only: the store is opened read-only and nothing is written.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from fedprism.experiment.config import resolve
from fedprism.experiment.runner import Experiment
from fedprism.experiment.store import Store

KEYS = ("local_acc", "global_acc", "local_acc@backbone", "global_acc@backbone", "local_acc@expert",
        "global_acc@expert")
SPREAD_SWEEP, SPREAD_LABEL = "paper_fmnist_dir01", "FedPrism"


def seed_spread(store: Store) -> dict[str, float]:
    """|seed 0 - seed 1| of each KEYS metric over the FedPrism paper runs' final metrics."""
    finals = {}
    for row in store.runs(status="finished"):
        if row["name"] == SPREAD_LABEL and SPREAD_SWEEP in (row["sweep"] or ""):
            finals[row["seed"]] = json.loads(row["final"])
    if not {0, 1} <= set(finals):
        return {}
    return {k: abs(finals[0][k] - finals[1][k]) for k in KEYS if k in finals[0] and k in finals[1]}


def _kept(store: Store, row: dict) -> bool:
    """Whether the run's final state is kept beside the store (False for a config of an older version
    that cannot be rebuilt)."""
    try:
        tid = resolve(json.loads(row["config"])).train_id
    except Exception:  # noqa: BLE001 - any config error means: not a run this script can score
        return False
    return store.load_final(tid) is not None


def score(store: Store, row: dict, precision: str) -> dict:
    """The run's evaluation metrics of its kept final state at `precision` (its own training identity
    finds the state: `eval.precision` is part of a run's id)."""
    conf = json.loads(row["config"])
    tid = resolve(conf).train_id
    kept = store.load_final(tid)
    cfg = resolve({**conf, "eval.precision": precision, "engine": "vectorized", "compile": False,
                   "device": "cpu"})
    exp = Experiment(cfg, store)
    state = exp._restore(kept, store.final_rows_dir(tid) if "client_rows" in kept else None)
    metrics, _ = exp.evaluate_round(exp.evaluator(), state)
    return metrics


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="*",
                    help="run ids or prefixes (default: every finished run with a kept state)")
    ap.add_argument("--db", default="results/fedprism.db")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    native = [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
    print(f"# torch {torch.__version__}, {a.threads} thread(s), native bf16: {', '.join(native) or 'none'}")
    store = Store(a.db, readonly=True)
    try:
        return _run(store, a.runs)
    finally:
        store.close()


def _run(store: Store, runs: list[str]) -> int:
    spread = seed_spread(store)
    rows = []
    for row in store.runs(status="finished"):
        if runs and not any(row["run_id"].startswith(r) for r in runs):
            continue
        if _kept(store, row):
            rows.append(row)
    if not rows:
        print("no finished run with a kept final state", file=sys.stderr)
        return 2
    print(f"{'run':18s} {'name':14s} {'metric':22s} {'float32':>8s} {'bfloat16':>8s} {'diff':>7s} "
          f"{'seed spread':>11s}")
    worst = 0.0
    for row in rows:
        t = time.perf_counter()
        m32, m16 = score(store, row, "float32"), score(store, row, "bfloat16")
        for k in KEYS:
            if k not in m32:
                continue
            d = 100 * (m16[k] - m32[k])
            worst = max(worst, abs(d))
            sp = f"{100 * spread[k]:11.2f}" if k in spread else f"{'':>11s}"
            name = (row["name"] or "-")[:14].replace(" ", "_")
            print(f"{row['run_id']:18s} {name:14s} {k:22s} {100 * m32[k]:8.2f} {100 * m16[k]:8.2f} "
                  f"{d:+7.2f} {sp}")
        print(f"# {row['run_id']}: eval {m32['eval_s']:.1f} s float32, {m16['eval_s']:.1f} s bfloat16 "
              f"({time.perf_counter() - t:.0f} s in all)", flush=True)
    print(f"\nlargest |bfloat16 - float32|: {worst:.2f} points; seed-to-seed spread of the FedPrism paper "
          "runs: " + ", ".join(f"{k} {100 * v:.2f}" for k, v in spread.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
