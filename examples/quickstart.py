"""fedprism from Python: run experiments, read the results, add a method of your own.

    python examples/quickstart.py [--db quickstart.db]

Runs in about a minute on 2 CPU cores (the bundled digits data set, nothing to download). CI runs it.
"""

from __future__ import annotations

import argparse

import numpy as np

import fedprism
from fedprism.algorithms.aggregation import client_weights, weighted_mean
from fedprism.hparams import Param


# 1. A method of your own: FedAvg whose server keeps a running average of the global models
#    (a Polyak average; any subclass of fedprism.Algorithm works the same way).
class FedAvgEMA(fedprism.Algorithm):
    name = "fedavg_ema"
    paper = "example: FedAvg with an exponential moving average of the global model"
    personalized = False
    params = {"decay": Param(0.5, "w <- decay w + (1 - decay) mean of the returned models",
                             lambda v: 0 <= v < 1, "a number in [0, 1)")}

    def init_state(self) -> dict:
        return {"w": self.ctx.init.clone()}

    def plan(self, state, rnd, clients):
        return fedprism.Plan(clients, {"params": state["w"].expand(len(clients), -1).clone()})

    def aggregate(self, state, rnd, update):
        if len(update.clients):
            mean = weighted_mean(update.params, client_weights(update))
            state["w"] = self.hp["decay"] * state["w"] + (1 - self.hp["decay"]) * mean
        return {}

    def model_for(self, state, clients):
        return state["w"].expand(len(clients), -1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--db", default="quickstart.db")
    db = ap.parse_args().db

    fedprism.register(FedAvgEMA)                     # now usable by name, like a built-in method
    base = dict(dataset="digits", clients=10, rounds=10, fraction=0.5, local_epochs=1, lr=0.05,
                partition="dirichlet", partition__alpha=0.3, model="mlp")

    # 2. Run experiments (a finished configuration returns its stored result at once).
    for method, extra in [("fedavg", {}), ("fedavg_ema", {"fedavg_ema__decay": 0.3}), ("local", {}),
                          ("fedprism", {"fedprism__k": 3, "fedprism__m": 2, "fedprism__every": 2})]:
        res = fedprism.run(fedprism.config(method=method, **base, **extra), db=db)
        f = res.final
        print(f"{method:11s} local {f['local_acc']:.3f}  global {f.get('global_acc', float('nan')):.3f}  "
              f"({len(res.history)} rounds, run {res.run_id})")

    # 3. Read the results back as plain Python (one dict per run; pandas: fedprism.results(..., frame=True)).
    rows = fedprism.results(db, status="finished")
    best = max(rows, key=lambda r: r["final"]["local_acc"])
    print(f"\n{len(rows)} finished runs; best local accuracy: {best['method']} {best['final']['local_acc']:.3f}")
    per_round = fedprism.run(fedprism.config(method="fedavg", **base), db=db).history
    print("fedavg local accuracy by round:", np.round([h["local_acc"] for h in per_round], 3).tolist())


if __name__ == "__main__":
    main()
