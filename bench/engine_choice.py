"""Which engine for which model on this CPU: the sequential loop against the compiled vectorized engine.

For each model, one process builds both engines on the same FMNIST federation (100 clients, Dirichlet
per class 0.7, the Clust-PSI-PFL protocol's client training: Adam lr 1e-3, B = 32) and runs `--rounds`
training rounds of `--clients` clients x `--epochs` epochs, alternating which engine goes first each
round, then scores the trained models on 2,000 global test images. Round 0 holds the vectorized engine's
compilation and is left out. Both engines start every round from the same parameters and train the same
batches, so their results must agree (the largest parameter difference is printed).

    .venv/bin/python bench/engine_choice.py                          # lenet5 and clustpsi_fmnist_cnn
    .venv/bin/python bench/engine_choice.py --models mlp --rounds 4
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from fedprism.algorithms.base import TrainJob  # noqa: E402
from fedprism.data.datasets import load_dataset  # noqa: E402
from fedprism.data.partition import make_partition  # noqa: E402
from fedprism.engine.base import LocalConfig  # noqa: E402
from fedprism.engine.sequential import SequentialEngine  # noqa: E402
from fedprism.engine.vectorized import VectorizedEngine  # noqa: E402
from fedprism.federation import Federation  # noqa: E402
from fedprism.models import build_model  # noqa: E402
from fedprism.params import flatten  # noqa: E402


def federation(pad32: bool, seed: int, test: int) -> Federation:
    ds = load_dataset("fmnist", pad32=pad32)
    y, yt = ds.y_train.numpy(), ds.y_test.numpy()
    p = make_partition("dirichlet_per_class", y, yt, 100, seed, alpha=0.7)
    return Federation(ds.x_train, ds.y_train, ds.x_test[:test], ds.y_test[:test],
                      [np.asarray(i) for i in p.train], [np.asarray(i) for i in p.test], 10, name="fmnist")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["lenet5", "clustpsi_fmnist_cnn"])
    ap.add_argument("--rounds", type=int, default=3, help="rounds per model (round 0 holds compilation)")
    ap.add_argument("--clients", type=int, default=16, help="clients trained per round")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = LocalConfig(epochs=args.epochs, batch_size=32, lr=1e-3, optimizer="adam")
    print(f"# engine choice  torch {torch.__version__}  threads {torch.get_num_threads()}  "
          f"{args.clients} clients x E={args.epochs} per round, Adam 1e-3, B=32; rounds >= 1 timed")
    print(f"{'model':<22} {'params':>9} {'seq train':>10} {'vec train':>10} {'seq/vec':>8} "
          f"{'seq eval':>9} {'vec eval':>9} {'seq/vec':>8} {'max |dW|':>9}")
    for name in args.models:
        fed = federation(name.startswith("lenet5"), args.seed, 2000)
        model = build_model(name, tuple(fed.x_train.shape[1:]), 10, seed=args.seed)
        seq = SequentialEngine(fed, model, cfg, args.seed, "cpu")
        vec = VectorizedEngine(fed, model, cfg, args.seed, "cpu", compile="true")
        W = flatten(model).expand(args.clients, -1).clone()
        rng = np.random.default_rng(args.seed)
        t = {"seq_train": [], "vec_train": [], "seq_eval": [], "vec_eval": []}
        diff = 0.0
        for r in range(args.rounds):
            clients = np.sort(rng.choice(fed.num_clients, args.clients, replace=False))
            out = {}
            for who in (("seq", "vec") if r % 2 == 0 else ("vec", "seq")):
                eng = seq if who == "seq" else vec
                s = time.perf_counter()
                out[who] = eng.train(TrainJob(clients, W.clone()), r).params
                dt = time.perf_counter() - s
                s = time.perf_counter()
                eng.evaluate(out[who], clients, "global")
                de = time.perf_counter() - s
                if r:
                    t[who + "_train"].append(dt)
                    t[who + "_eval"].append(de)
            diff = max(diff, (out["seq"] - out["vec"]).abs().max().item())
            W = out["seq"]
        st, vt = np.mean(t["seq_train"]), np.mean(t["vec_train"])
        se, ve = np.mean(t["seq_eval"]), np.mean(t["vec_eval"])
        print(f"{name:<22} {W.shape[1]:>9,} {st:>9.2f}s {vt:>9.2f}s {st / vt:>7.2f}x {se:>8.2f}s {ve:>8.2f}s "
              f"{se / ve:>7.2f}x {diff:>9.2e}", flush=True)
    print("seq/vec > 1: the vectorized engine is faster; < 1: the sequential loop is.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
