"""`fedprism demo`: the main job. A real Fed-PRISM comparison on the embedded default dataset.

Fashion-MNIST (Debian package dataset-fashion-mnist) when present, else scikit-learn's bundled
digits. Measured: 563 s on the 2-core VM with a test run sharing it, 319 s of it the FedPrism paper's
method (three trainings per client and round; the other eight runs 23-34 s each). It runs the FedPrism paper's method (dual-stream,
routed), every clustering method of the Fed-PRISM server, FedClust, FedAvg and Local on one shared
Dirichlet(0.3) partition and one cohort sequence.
"""

from __future__ import annotations

import sys

from fedprism.experiment.config import parse_overrides, resolve


def default_dataset() -> str:
    from fedprism.data.datasets import load_dataset
    from fedprism.errors import DataError

    try:
        load_dataset("fmnist", pad32=True)
        return "fmnist"
    except DataError:
        print("fedprism demo: Fashion-MNIST not found (apt-get install dataset-fashion-mnist, or "
              "`fedprism data download fmnist`); using the bundled digits set", file=sys.stderr)
        return "digits"


def demo_configs(dataset: str, quick: bool = False, overrides: dict | None = None) -> list:
    if dataset == "fmnist":
        base = {"dataset": "fmnist", "data.train_subset": 12000, "data.test_subset": 2000, "clients": 30,
                "fraction": 0.34, "rounds": 15, "local_epochs": 2, "batch_size": 32, "lr": 0.01, "momentum": 0.9,
                "partition": "dirichlet", "partition.alpha": 0.3, "eval_every": 5}
    else:
        base = {"dataset": "digits", "clients": 20, "fraction": 0.5, "rounds": 20, "local_epochs": 2,
                "batch_size": 16, "lr": 0.05, "momentum": 0.9, "partition": "dirichlet", "partition.alpha": 0.3,
                "eval_every": 5}
    if quick:
        base.update({"rounds": 3, "eval_every": 1, "data.train_subset": 3000 if dataset == "fmnist" else 0,
                     "clients": 10, "fraction": 0.5})
    base.update(overrides or {})
    k = {"fedprism.k": 3, "fedprism.m": 2, "fedprism.every": 5, "fedprism.alpha": 0.5}
    runs = [(f"Fed-PRISM {c}", {"method": "fedprism", **k, "fedprism.clustering": c})
            for c in ("kmeans", "ward", "average", "single", "covariance")]
    runs.insert(0, ("FedPrism (paper, routed)", {"method": "fedprism_dual", "fedprism_dual.k": 3,
                                                 "fedprism_dual.every": 5}))
    runs += [("FedClust", {"method": "fedclust", "fedclust.k": 3, "fedclust.every": 5}),
             ("FedAvg", {"method": "fedavg"}), ("Local", {"method": "local"})]
    return [resolve({**base, **r, "name": label}) for label, r in runs]


def demo(db: str, quick: bool = False, items: list[str] | None = None) -> int:
    from fedprism.textable import table as _table
    from fedprism.experiment.runner import Experiment
    from fedprism.experiment.store import Store

    over = parse_overrides(items or [])
    dataset = over.pop("dataset", None) or default_dataset()
    configs = demo_configs(dataset, quick, over)
    c0 = configs[0]
    print(f"fedprism demo: {dataset}, {c0['clients']} clients, {c0['partition']}(alpha="
          f"{c0['partition.alpha']}), {c0['rounds']} rounds, R={c0['fraction']}, E={c0['local_epochs']}; "
          f"results in {db}", file=sys.stderr)
    store = Store(db)
    rows = []
    for cfg in configs:
        res = Experiment(cfg, store, progress=True, sweep="demo").run()
        f = res.final
        rows.append([cfg["name"], f.get("global_acc"), f.get("local_acc"), f.get("sdad"), f.get("seconds")])
    print()
    print(_table(rows, ["method", "global acc", "local acc", "SDAD", "seconds"]))
    print("\nHow to read it: local acc = each client's model on its own test split (the same label mix as its "
          "training data), mean over clients: personalization. global acc = each client's model on the full test "
          "set, mean over clients: what a client's model knows beyond its own classes. SDAD = spread of local acc "
          "over clients (lower is fairer). FedAvg trains one model (its two accuracies match); Local never "
          "communicates (high local, low global); the Fed-PRISM rows trade between them through the cluster "
          "models; FedPrism routes each prediction between a private specialist and the shared backbone. "
          "`fedprism report --db " + db + " --out report` writes the tables and plots.")
    return 0
