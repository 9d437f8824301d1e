"""The host's share of a vectorized training round: everything `VectorizedEngine.train` does besides the
step's arithmetic (building the batch schedule, staging each step's inputs, reloading slots, reading the
losses), on the paper workload's round (FMNIST, 100 clients, Dirichlet 0.1, 10 clients, E=10, B=32).

The step is replaced by one that returns its inputs, and the images by one pixel each, so what is left is
the engine's own bookkeeping: on a GPU with the step replayed from a CUDA graph this is what stands
between a round and the device's share (`bench/README.md`, "GPU"). `--src` imports fedprism from another
checkout's `src/`, for a before/after comparison; run the two alternately in one shell loop.

    python bench/host_cost.py                          # this checkout, 6 rounds, one thread
    git worktree add /tmp/old <commit>; for i in 1 2 3; do
      python bench/host_cost.py --src /tmp/old/src; python bench/host_cost.py; done
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", default=str(Path(__file__).resolve().parents[1] / "src"),
                    help="the src/ folder to import fedprism from (default: this checkout's)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--quick", action="store_true", help="20 clients of 200 samples, E=1")
    a = ap.parse_args(argv)
    sys.path.insert(0, a.src)
    import numpy as np
    import torch

    from fedprism.data.datasets import load_dataset
    from fedprism.data.partition import make_partition
    from fedprism.algorithms.base import TrainJob
    from fedprism.engine.base import LocalConfig
    from fedprism.engine.vectorized import VectorizedEngine
    from fedprism.models import build_model
    from fedprism.params import flatten

    torch.set_num_threads(1)
    import fedprism
    from fedprism.federation import Federation

    # the federation is built here rather than by bench/engine.py's build_federation: importing that module
    # puts this checkout's src/ first on the path, and `--src` must decide which fedprism is imported
    clients, epochs, per_round, cap = 100, 10, 10, None
    if a.quick:
        clients, epochs, per_round, cap, a.rounds = 20, 1, 4, 200, 2
    try:
        ds = load_dataset("fmnist", pad32=True)
        x_tr, y_tr, x_te, y_te = ds.x_train, ds.y_train, ds.x_test[:1000], ds.y_test[:1000]
    except Exception as e:  # noqa: BLE001 - the partition's sizes are what matter; labels will do
        print(f"[data] Fashion-MNIST not available ({type(e).__name__}); random labels, zero images")
        g = torch.Generator().manual_seed(0)
        y_tr, y_te = torch.randint(0, 10, (60000,), generator=g), torch.randint(0, 10, (1000,), generator=g)
        x_tr, x_te = torch.zeros(60000, 1, 32, 32), torch.zeros(1000, 1, 32, 32)
    p = make_partition("dirichlet", y_tr.numpy(), y_te.numpy(), clients, 0, alpha=0.1)
    fed = Federation(x_tr, y_tr, x_te, y_te, [np.asarray(i)[:cap] for i in p.train],
                     [np.asarray(i) for i in p.test], 10, name="fmnist")
    model = build_model("lenet5", (1, 32, 32), 10, seed=0)
    eng = VectorizedEngine(fed, model, LocalConfig(epochs=epochs, batch_size=32, lr=0.01, momentum=0.9), 0,
                           "cpu", compile=False, rounds=100)

    def no_step(loss, cfg, per_client):
        def step(w, st, x, y, wt, ex, active, mask, *dkey):
            return w, st, torch.zeros(w.shape[0])
        return step

    eng._step_fn = no_step
    eng.fed = replace(eng.fed, x_train=eng.fed.x_train[:, :, :1, :1].contiguous())   # gathers cost ~nothing
    w0, rng, times, steps = flatten(model), np.random.default_rng(0), [], 0
    for r in range(a.rounds):
        clients = np.sort(rng.choice(fed.num_clients, per_round, replace=False))
        t = time.perf_counter()
        eng.train(TrainJob(clients, w0.expand(per_round, -1).clone()), r)
        times.append(time.perf_counter() - t)
        steps = max(-(-len(fed.train_idx[c]) // 32) * epochs for c in clients)
    med = statistics.median(times[1:] or times)
    where = Path(fedprism.__file__).parents[1]
    print(f"host share of a training round (fedprism from {where}): median {med * 1e3:.1f} ms over rounds "
          f"1..{a.rounds - 1}, about {med / max(1, steps) * 1e6:.0f} us per step of the longest client "
          f"({steps} steps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
