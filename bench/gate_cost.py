"""The learned gate's fit with scikit-learn's weighted binning and with `fast_binning.sorted_once`.

`learned_gates` (the `eval.gate=learned` option) fits histogram gradient boosting with sample weights; on
fewer than 200,000 rows scikit-learn bins each feature at weighted quantiles, one sort per threshold.
`fedprism.algorithms.fedprism_dual.fast_binning` sorts each column once. This bench times one gate weight both ways on
synthetic rows of the paper run's shape (100 clients; 55 validation, 100 local test rows each; each client's
view of a 5,000-image global validation and a 10,000-image global test set; 63 features), alternating
which goes first, and checks that both give the same accuracies on every split.

    python bench/gate_cost.py                 # the paper shape, 2 repetitions each (several minutes)
    python bench/gate_cost.py --quick         # 20 clients, 1,000 / 2,000 global rows
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time


def synthetic_rows(rng, clients: int, sizes: dict, features: int = 63) -> dict:
    """{split: [(features [n, F], specialist right [n], backbone right [n])] per client}: the streams are
    right or wrong with rates that depend on two of the features, as a gate's target does."""

    rows = {}
    for split, n in sizes.items():
        rows[split] = []
        for _ in range(clients):
            x = rng.random((n, features))
            spec = rng.random(n) < 0.2 + 0.7 * x[:, 0]
            back = rng.random(n) < 0.9 - 0.5 * x[:, 1]
            rows[split].append((x, spec, back))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    import numpy as np
    from threadpoolctl import threadpool_limits

    import fedprism.algorithms.fedprism_dual.gate as gate
    from fedprism.algorithms.fedprism_dual.fast_binning import sorted_once

    clients = 20 if a.quick else a.clients
    sizes = ({"val": 55, "global_val": 1000, "local": 100, "global": 2000} if a.quick else
             {"val": 55, "global_val": 5000, "local": 100, "global": 10000})
    rows = synthetic_rows(np.random.default_rng(0), clients, sizes)
    fit_rows = sum(int((s != b).sum()) for split in ("val", "global_val") for _, s, b in rows[split])
    print(f"{clients} clients, {sizes}; {fit_rows:,} fitting rows (the streams disagree), one gate weight "
          f"(3 fits: two out-of-fold, one on all rows), {a.threads} thread(s)")
    variants = {"scikit-learn binning": contextlib.nullcontext, "sorted_once": sorted_once}
    times, answers = {k: [] for k in variants}, {}
    with threadpool_limits(a.threads):
        for rep in range(a.reps):
            for name in (list(variants) if rep % 2 == 0 else list(variants)[::-1]):
                gate.sorted_once = variants[name]
                t = time.perf_counter()
                answers.setdefault(name, []).append(gate.learned_gates(rows, weights=(3,)))
                times[name].append(time.perf_counter() - t)
                print(f"  rep {rep}  {name:22s} {times[name][-1]:7.1f} s", flush=True)
    gate.sorted_once = sorted_once
    same = all(x == answers["sorted_once"][0] for v in answers.values() for x in v)
    old, new = (statistics.median(times[k]) for k in variants)
    print(f"median: scikit-learn binning {old:.1f} s, sorted_once {new:.1f} s, ratio {old / new:.2f}x; "
          f"same accuracies on every split: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
