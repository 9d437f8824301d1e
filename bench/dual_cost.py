"""Cost of a `fedprism_dual` run against a FedAvg run of the same configuration, in one process.

    python bench/dual_cost.py [--rounds 4] [--threads 1] [--quick] [--device cuda]
                              [--only "dual own;dual own fused"] [--kernels fused]

Workload: the FedPrism paper's FMNIST protocol (arXiv:2603.08252, section 4: 100 clients, Dirichlet 0.1,
10 clients per round, E = 10, B = 32, SGD 0.01 / 0.9, LeNet-5). Every variant runs `--rounds` rounds with an
evaluation after every round, in the order FedAvg, the dual variants, FedAvg again (the two FedAvg
runs bracket the others, so a drift of the machine's speed shows as a difference between them).

From each run's stored round metrics (`train_s`, `eval_s`, the numbers `fedprism show` prints) the
bench projects the paper's 100-round run with an evaluation every 5 rounds:

    cost = train_s(round 0) + 99 x median train_s(rounds 1..)
         + 19 x median eval_s(sampled rounds) + eval_s(a full evaluation)

(round 0 holds the one-time compilation). With `eval.clients` the 19 intermediate evaluations score a
seeded sample of clients and the last one all of them, as in a real run; without it every evaluation
is full. It prints each variant's projected cost and its ratio to FedAvg's (the mean of both FedAvg
runs).

Variants:
  fedavg                          the reference
  dual own                        the paper's Algorithm 1 (three trainings per participation)
  dual own fused                  the same, the specialist and private trainings in one vectorized pass
                                  (`fedprism.protocol.train_together`; the engine's default on CUDA only)
  dual specialist                 private_source=specialist (P_i is L_i: two trainings)
  dual specialist, eval.clients   the same, 10 clients scored per intermediate evaluation
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

PAPER = {"dataset": "fmnist", "model": "lenet5", "partition": "dirichlet", "partition.alpha": 0.1,
         "clients": 100, "fraction": 0.1, "local_epochs": 10, "batch_size": 32, "lr": 0.01, "momentum": 0.9,
         "seed": 0, "eval_every": 1}
QUICK = {"dataset": "digits", "model": "mlp", "clients": 20, "fraction": 0.5, "local_epochs": 1}
DUAL = {"method": "fedprism_dual", "fedprism_dual.k": 5, "fedprism_dual.every": 10}
VARIANTS = [
    ("fedavg", {"method": "fedavg"}),
    ("dual own", {**DUAL, "fuse_jobs": "false"}),
    ("dual own fused", {**DUAL, "fuse_jobs": "true"}),
    ("dual specialist", {**DUAL, "fedprism_dual.private_source": "specialist"}),
    ("dual specialist, eval.clients=10", {**DUAL, "fedprism_dual.private_source": "specialist",
                                          "eval.clients": 10}),
    ("fedavg (again)", {"method": "fedavg"}),
]


def project(history: list[dict], rounds: int = 100, every: int = 5, sampled: bool = False) -> dict:
    """The projected cost of a `rounds`-round run (see the module docstring) from a short run's rounds."""
    train = [h["train_s"] for h in history]
    evals = [h["eval_s"] for h in history if "eval_s" in h]
    n_eval = rounds // every
    full = evals[-1]                                       # the last round scores every client
    mid = statistics.median(evals[1:-1]) if sampled else statistics.median(evals[1:])
    t = train[0] + (rounds - 1) * statistics.median(train[1:])
    e = (n_eval - 1) * mid + full
    return {"train": t, "eval": e, "total": t + e, "train_round": statistics.median(train[1:]), "eval_mid": mid,
            "eval_full": full}


def main() -> None:
    from fedprism.experiment.config import resolve
    from fedprism.experiment.runner import Experiment
    from fedprism.experiment.store import Store

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=4, help="rounds per variant (>= 3)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="digits / MLP smoke test")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--only", default="", help="semicolon-separated variant labels to run besides both "
                    "FedAvg runs (default: all)")
    ap.add_argument("--kernels", default="aten", choices=("aten", "fused"),
                    help="train.kernels and eval.kernels of every variant (fedprism.engine.fused)")
    a = ap.parse_args()
    if a.rounds < 3:
        ap.error("--rounds must be >= 3 (round 0 compiles; the median needs the rest)")
    torch.set_num_threads(a.threads)
    base = {**PAPER, **(QUICK if a.quick else {}), "rounds": a.rounds, "device": a.device,
            "train.kernels": a.kernels, "eval.kernels": a.kernels}
    only = {x.strip() for x in a.only.split(";") if x.strip()}
    unknown = only - {label for label, _ in VARIANTS}
    if unknown:
        ap.error(f"--only: unknown variant(s) {sorted(unknown)}; "
                 f"variants: {[label for label, _ in VARIANTS]}")
    variants = [(label, over) for label, over in VARIANTS
                if not only or label in only or label.startswith("fedavg")]
    out = {}
    with tempfile.TemporaryDirectory() as d:
        for i, (label, over) in enumerate(variants):
            cfg = resolve({**base, **over, "name": label})
            store = Store(str(Path(d) / f"bench{i}.db"))     # one store each: the second FedAvg runs again
            res = Experiment(cfg, store, progress=False, sweep="bench").run()
            store.close()
            out[label] = project(res.history, sampled="eval.clients" in over)
            p = out[label]
            print(f"{label:34s} train/round {p['train_round']:6.2f} s  eval {p['eval_mid']:6.2f} s "
                  f"(full {p['eval_full']:6.2f} s)  projected 100 rounds {p['total'] / 60:6.1f} min", flush=True)
    ref = (out["fedavg"]["total"] + out["fedavg (again)"]["total"]) / 2
    drift = out["fedavg (again)"]["total"] / out["fedavg"]["total"]
    print(f"\nFedAvg projected {ref / 60:.1f} min (second FedAvg run / first: {drift:.2f})")
    for label, p in out.items():
        if not label.startswith("fedavg"):
            print(f"{label:34s} {p['total'] / ref:5.2f}x FedAvg  (training {p['train'] / ref:4.2f}x, "
                  f"evaluation {p['eval'] / ref:4.2f}x)")


if __name__ == "__main__":
    main()
