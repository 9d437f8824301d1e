"""The training slot count above the cap: the capped LPT ideal against `VectorizedEngine.slots_for`.

    python bench/slots.py [--per-round 20] [--epochs 2] [--kernels aten] [--rounds 6] [--threads 2]

A cohort whose LPT ideal `floor(sum steps / max steps)` exceeds `max_slots` (16 on CPU) used to train in
`max_slots` slots: 20 clients of equal size then run two waves of 16 slot-steps where two waves of 10
do the same work. `slots_for` now takes the count in 1..max_slots of least estimated time. Both rules
train the same cohorts (FMNIST, 100 clients, Dirichlet 0.1, LeNet-5, B = 32, SGD 0.01 / 0.9), one
engine each in one process, alternating round by round; it prints the slot counts, the median training
time of each rule after the first round (compilation), their ratio, and the largest difference between
the two rules' trained models (exit status 1 where they differ).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine import build_federation  # noqa: E402
from fedprism.algorithms.base import TrainJob  # noqa: E402
from fedprism.engine.base import LocalConfig  # noqa: E402
from fedprism.engine.vectorized import VectorizedEngine, ideal_slots  # noqa: E402
from fedprism.models import build_model  # noqa: E402
from fedprism.params import flatten  # noqa: E402


class CappedEngine(VectorizedEngine):
    """The rule before: the LPT ideal, capped by max_slots."""

    def slots_for(self, steps: list[int]) -> int:
        w = min(ideal_slots(steps), self.max_slots)
        self._slot_graphs.add(w)
        return w


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-round", type=int, default=20, help="clients trained per round (of 100)")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--kernels", default="aten", choices=("aten", "fused"))
    ap.add_argument("--rounds", type=int, default=6, help="rounds per rule; the first holds compilation")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compile", default="true", choices=("true", "false"))
    ap.add_argument("--max-train", type=int, default=0, help="cap each client's training samples (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if not 1 <= a.per_round <= 100 or a.rounds < 2 or a.epochs < 1:
        ap.error(f"--per-round must be in 1..100 (got {a.per_round}), --rounds >= 2 (got {a.rounds}), "
                 f"--epochs >= 1 (got {a.epochs})")
    torch.set_num_threads(a.threads)
    fed, src = build_federation(argparse.Namespace(
        clients=100, per_round=a.per_round, epochs=a.epochs, batch=32, alpha=0.1, partition="dirichlet",
        test_samples=0, max_train=a.max_train, seed=a.seed))
    cfg = LocalConfig(epochs=a.epochs, batch_size=32, lr=0.01, momentum=0.9, train_kernels=a.kernels,
                      eval_kernels=a.kernels)
    model = build_model("lenet5", (1, 32, 32), 10, seed=a.seed)
    engines = {rule: cls(fed, model, cfg, a.seed, "cpu", compile=a.compile, rounds=100)
               for rule, cls in (("capped", CappedEngine), ("slots_for", VectorizedEngine))}
    W = flatten(model).expand(fed.num_clients, -1).clone()
    rng = np.random.default_rng(a.seed)
    times: dict[str, list[float]] = {rule: [] for rule in engines}
    diff = 0.0
    for r in range(a.rounds):
        clients = np.sort(rng.choice(fed.num_clients, size=a.per_round, replace=False))
        order = list(engines) if r % 2 == 0 else list(engines)[::-1]
        out = {}
        for rule in order:
            t = time.perf_counter()
            out[rule] = engines[rule].train(TrainJob(clients, W[torch.as_tensor(clients)].clone()), r).params
            if r:
                times[rule].append(time.perf_counter() - t)
        diff = max(diff, (out["capped"] - out["slots_for"]).abs().max().item())
        W[torch.as_tensor(clients)] = out["slots_for"]
    print(f"# {src}; {a.per_round} clients a round, E = {a.epochs}, kernels {a.kernels}, compile {a.compile}, "
          f"{a.threads} thread(s), torch {torch.__version__}")
    med = {rule: statistics.median(v) for rule, v in times.items()}
    for rule, eng in engines.items():
        print(f"{rule:10s} slots {sorted(eng._slot_graphs)}  training s/round {med[rule]:6.2f}  "
              f"({', '.join(f'{x:.2f}' for x in times[rule])})")
    print(f"slots_for / capped: {med['capped'] / med['slots_for']:.2f}x faster; "
          f"largest difference between the trained models: {diff:.3g}")
    return 0 if diff == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
