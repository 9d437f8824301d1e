"""The training slot count above the cap: the capped LPT ideal against `VectorizedEngine.slots_for`.

    python bench/slots.py [--per-round 20] [--clients 100] [--dataset fmnist] [--model lenet5] [--epochs 2]
                          [--kernels aten] [--rounds 6] [--threads 2]

A cohort whose LPT ideal `floor(sum steps / max steps)` exceeds `max_slots` (16 on CPU) used to train in
`max_slots` slots: 20 clients of equal size then run two waves of 16 slot-steps where two waves of 10
do the same work. `slots_for` now takes the fewest slots whose LPT makespan is the cap's. A third rule,
not taken, is measured beside them: the count of least makespan x (slots + step overhead), which may take
more steps than the cap. The rules train the same cohorts
(FMNIST, Dirichlet 0.1 over `--clients` clients of equal size, or `--dataset` split IID; `--model`,
B = 32, SGD 0.01 / 0.9), one engine each in one process, taking turns at going first; it prints the
slot counts, the median training time of each rule after the first round
(compilation), the speed of the other two relative to the capped rule, and the largest difference
between the rules' trained models (exit status 1 where they differ).
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
from fedprism.experiment.config import resolve  # noqa: E402
from fedprism.experiment.federation import build_federation as federation_of  # noqa: E402
from fedprism.models import build_model  # noqa: E402
from fedprism.params import flatten  # noqa: E402


class CappedEngine(VectorizedEngine):
    """The rule before: the LPT ideal, capped by max_slots."""

    def slots_for(self, steps: list[int]) -> int:
        w = min(ideal_slots(steps), self.max_slots)
        self._slot_graphs.add(w)
        return w


class LeastTimeEngine(VectorizedEngine):
    """A rule not taken: above the cap, the count of least estimated time (`slot_time`), the larger on a
    tie; it may take more steps than the cap."""

    def slots_for(self, steps: list[int]) -> int:
        w = ideal_slots(steps)
        if w > self.max_slots:
            w = min(range(self.max_slots, 0, -1), key=lambda k: self.slot_time(steps, k))
        self._slot_graphs.add(w)
        return w


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-round", type=int, default=20, help="clients trained per round")
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--dataset", default="fmnist", help="fmnist (Dirichlet 0.1, equal sizes) or any dataset "
                    "fedprism loads (an IID split), e.g. synthetic")
    ap.add_argument("--model", default="lenet5", help="a model name of fedprism.models (lenet5, mlp, ...)")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--kernels", default="aten", choices=("aten", "fused"))
    ap.add_argument("--rounds", type=int, default=6, help="rounds per rule; the first holds compilation")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compile", default="true", choices=("true", "false"))
    ap.add_argument("--max-train", type=int, default=0, help="cap each client's training samples (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.max_train and a.dataset != "fmnist":
        ap.error(f"--max-train works on fmnist only (got --dataset {a.dataset})")
    if not 1 <= a.per_round <= a.clients or a.rounds < 2 or a.epochs < 1:
        ap.error(f"--per-round must be in 1..--clients (got {a.per_round} of {a.clients}), --rounds >= 2 "
                 f"(got {a.rounds}), --epochs >= 1 (got {a.epochs})")
    torch.set_num_threads(a.threads)
    if a.dataset == "fmnist":
        fed, src = build_federation(argparse.Namespace(
            clients=a.clients, per_round=a.per_round, epochs=a.epochs, batch=32, alpha=0.1,
            partition="dirichlet", test_samples=0, max_train=a.max_train, seed=a.seed))
    else:                       # fedprism's own loader and an IID split: clients of (nearly) equal size
        fed = federation_of(resolve({"method": "fedavg", "dataset": a.dataset, "model": a.model,
                                     "clients": a.clients, "partition": "iid", "seed": a.seed}))
        src = f"{a.dataset}, iid"
    cfg = LocalConfig(epochs=a.epochs, batch_size=32, lr=0.01, momentum=0.9, train_kernels=a.kernels,
                      eval_kernels=a.kernels)
    model = build_model(a.model, fed.input_shape, fed.num_classes, seed=a.seed)
    engines = {rule: cls(fed, model, cfg, a.seed, "cpu", compile=a.compile, rounds=100)
               for rule, cls in (("capped", CappedEngine), ("slots_for", VectorizedEngine),
                                 ("least_time", LeastTimeEngine))}
    W = flatten(model).expand(fed.num_clients, -1).clone()
    rng = np.random.default_rng(a.seed)
    times: dict[str, list[float]] = {rule: [] for rule in engines}
    diff = 0.0
    for r in range(a.rounds):
        clients = np.sort(rng.choice(fed.num_clients, size=a.per_round, replace=False))
        order = list(engines)[r % 3:] + list(engines)[:r % 3]
        out = {}
        for rule in order:
            t = time.perf_counter()
            out[rule] = engines[rule].train(TrainJob(clients, W[torch.as_tensor(clients)].clone()), r).params
            if r:
                times[rule].append(time.perf_counter() - t)
        diff = max(diff, *((out["capped"] - out[rule]).abs().max().item() for rule in out))
        W[torch.as_tensor(clients)] = out["slots_for"]
    print(f"# {src}; {a.model}, {a.per_round} of {a.clients} clients a round, E = {a.epochs}, "
          f"kernels {a.kernels}, compile {a.compile}, {a.threads} thread(s), torch {torch.__version__}")
    med = {rule: statistics.median(v) for rule, v in times.items()}
    for rule, eng in engines.items():
        print(f"{rule:10s} slots {sorted(eng._slot_graphs)}  training s/round {med[rule]:6.2f}  "
              f"({', '.join(f'{x:.2f}' for x in times[rule])})")
    print(f"slots_for: {med['capped'] / med['slots_for']:.2f}x as fast as capped; least_time: "
          f"{med['capped'] / med['least_time']:.2f}x; largest difference between the trained models: "
          f"{diff:.3g}")
    return 0 if diff == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
