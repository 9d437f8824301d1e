"""Time ``make_partition`` for every partition type (train split + per-client test split).

Default workload: 60 000 labels, 10 classes, 1 000 clients, 10 000 test labels (MNIST-sized).
Prints seconds per partition; exits non-zero if ``iid``, ``dirichlet`` or ``pathological`` take more
than ``--limit`` seconds (1 s by default).

    .venv/bin/python bench/partition.py [--n 60000] [--clients 1000] [--classes 10] [--limit 1.0]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from fedprism.data.partition import make_partition
from fedprism.errors import PartitionError

WORKLOADS: list[tuple[str, str, dict]] = [
    ("iid", "iid", {}),
    ("dirichlet", "dirichlet", {"alpha": 0.1}),
    ("dirichlet_per_class", "dirichlet_per_class", {"alpha": 0.5}),
    ("pathological", "pathological", {"shards_per_client": 2}),
    ("pathological_classes", "pathological", {"shards_per_client": 2, "variant": "classes"}),
    ("similarity", "similarity", {"s": 0.5}),
    ("domain_mix", "domain_mix", {}),
]
MUST_BE_FAST = ("iid", "dirichlet", "pathological")


def bench_partitions(n: int = 60_000, num_clients: int = 1_000, num_classes: int = 10, seed: int = 0,
                     repeats: int = 3) -> dict[str, float | None]:
    """Best-of-``repeats`` seconds per workload (``None`` if the request is impossible at this size)."""
    rng = np.random.default_rng(seed)
    y_train = rng.integers(0, num_classes, size=n)
    y_test = rng.integers(0, num_classes, size=max(n // 6, num_classes))
    min_train = max(1, min(10, n // (num_clients * 2)))
    make_partition("iid", y_train[:1000], y_test[:200], 2, seed, min_train=1)  # warm up imports
    times: dict[str, float | None] = {}
    for label, name, params in WORKLOADS:
        best = None
        for _ in range(repeats):
            t = time.perf_counter()
            try:
                make_partition(name, y_train, y_test, num_clients, seed, min_train=min_train, **params)
            except PartitionError:
                best = None
                break
            dt = time.perf_counter() - t
            best = dt if best is None else min(best, dt)
        times[label] = best
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=60_000)
    ap.add_argument("--clients", type=int, default=1_000)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--limit", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    times = bench_partitions(args.n, args.clients, args.classes, args.seed)
    print(f"make_partition: {args.n} labels, {args.classes} classes, {args.clients} clients (best of 3)")
    failed = []
    for label, t in times.items():
        shown = "impossible" if t is None else f"{t:8.4f} s"
        flag = ""
        if label in MUST_BE_FAST and (t is None or t > args.limit):
            failed.append(label)
            flag = f"  > limit {args.limit} s"
        print(f"  {label:22s} {shown}{flag}")
    if failed:
        print(f"FAIL: {', '.join(failed)} slower than {args.limit} s", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
