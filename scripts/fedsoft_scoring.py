"""FedSoft's finished runs scored on their cluster models per client, from their kept final states (no
training, nothing written).

    python scripts/fedsoft_scoring.py --db results/fedprism.db --sweep clust_psi_pfl_fmnist_lenet5

FedSoft (Ruan & Joe-Wong 2022, arXiv:2112.06053) trains S cluster models c_s and, on every client, a
personal model w_k and importance weights u_k (the share of its training samples each c_s fits best).
`src/fedprism/algorithms/fedsoft.py` scores each client's w_k (the personalised model of the paper's
Algorithm 1). A paper that reports FedSoft may have scored something else; this script prints, for
every FedSoft run of a sweep whose final state was kept beside the store (`<db>.final/`, `keep_final`):

    own          each client's w_k on its own test split: the stored `local_acc_weighted` (printed as a
                 check that the script rebuilt the run's state)
    top u_k      each client on the cluster model of its highest importance weight, on its own test split
                 (u_k as the client last estimated it; a client never sampled estimates it now, with the
                 final cluster models, as FedSoft's Sec. 4 does)
    top now      the same with every u_k re-estimated now, with the final cluster models
    mix          each client on the u_k-weighted mixture of the cluster models' softmax, on its own test
                 split (u_k as in `top now`)
    top shared   the cluster model of each client's highest u_k (as in `top u_k`) on the shared test set,
                 averaged over the clients (each counts once)

Accuracies on the clients' own test splits are sample-weighted over the clients, as `local_acc_weighted`
is; ties in u_k go to the lower s. The kept states stay on the machine that ran the sweep (they hold
weights, never committed); `fedprism sweep FILE` re-creates them.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch

COLUMNS = ("own", "top u_k", "top now", "mix", "top shared")


def score(db: str, run_id: str) -> dict[str, float]:
    """The five accuracies of one FedSoft run (fractions)."""
    from fedprism.algorithms.fedsoft import importance
    from fedprism.experiment.config import resolve
    from fedprism.experiment.runner import Experiment
    from fedprism.experiment.store import Store

    store = Store(db, readonly=True)
    row = store.run(run_id)
    cfg = resolve({**json.loads(row["config"]), "engine": "sequential", "compile": False, "device": "cpu"})
    kept = store.load_final(cfg.train_id)
    if kept is None:
        raise SystemExit(f"no kept final state {cfg.train_id} beside {db} (it stays on the machine that "
                         "ran it)")
    exp = Experiment(cfg, store)
    state = exp.restore_final(kept)
    eng, n = exp.engine, exp.ctx.num_clients
    clients = np.arange(n)
    c = state["c"]                                                                 # [S, P]
    rows = exp.clients.rows(clients)
    sigma = exp.algo.hp["sigma"]
    with torch.inference_mode():
        now = torch.stack([importance(eng, k, c, sigma).to(torch.float32) for k in clients])
        last = rows["u"].clone()
        unset = last.sum(1) == 0
        last[unset] = now[unset]
        top = {"top u_k": last.argmax(1), "top now": now.argmax(1)}       # ties: the first (lower s)
        own = eng.evaluate(rows["w"], clients, "local")
        out = {"own": own.correct}
        for name, s in top.items():
            out[name] = eng.evaluate(c[s], clients, "local").correct
        mix = torch.zeros(n, dtype=torch.long)
        for k in clients:
            x, y = eng.data(int(k), "local")
            p = torch.softmax(eng.logits(c, x), -1)                              # [S, B, C]
            mix[k] = int(((now[k][:, None, None] * p).sum(0).argmax(-1) == y.to(p.device)).sum())
        out["mix"] = mix
        shared = eng.evaluate(c, np.zeros(len(c), dtype=int), "global")
        acc = shared.correct.to(torch.float64) / shared.count
    res = {k: float(v.to(torch.float64).sum() / own.count.sum()) for k, v in out.items()}
    res["top shared"] = float(acc[top["top u_k"]].mean())
    res["stored own"] = json.loads(row["final"])["local_acc_weighted"]
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", default="results/fedprism.db")
    ap.add_argument("--sweep", required=True, help="score every finished FedSoft run of this sweep")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    from fedprism.errors import FedPrismError
    from fedprism.experiment.store import Store

    try:
        runs = [r for r in Store(a.db, readonly=True).runs(sweep=a.sweep, method="fedsoft")
                if r["status"] == "finished"]
    except FedPrismError as e:                  # no store, not a store: one line, as the CLI says it
        raise SystemExit(f"fedsoft_scoring: error: {e}") from None
    if not runs:
        raise SystemExit(f"no finished FedSoft run in sweep {a.sweep} of {a.db}")
    print("| run | label | " + " | ".join(COLUMNS) + " |")
    print("|---|---|" + "---:|" * len(COLUMNS))
    for r in runs:
        res = score(a.db, r["run_id"])
        if abs(res["own"] - res["stored own"]) > 1e-9:
            raise SystemExit(f"run {r['run_id']}: rebuilt own-model accuracy {res['own']:.6f} is not the "
                             f"stored {res['stored own']:.6f}; the kept state is not this run's")
        label = (r["label"] or "").replace(" | ", ", ")
        print(f"| {r['run_id']} | {label} | " + " | ".join(f"{100 * res[k]:.2f}" for k in COLUMNS) + " |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
