"""How the cost of a vectorized training step grows with the number of models trained together, for two
formulations of LeNet-5's convolutions: the grouped convolution that `vmap` makes of `nn.Conv2d` (the
models sit in the channel dimension; what the engine runs) and unfold plus a batched matrix product
(`bench/pool_train.py`'s `UnfoldConv2d`: the models stay a batch dimension of one GEMM).

`fedprism_dual` trains 20 models in one pass where FedAvg trains 10 (`bench/README.md`, "GPU"), so how a
step's cost grows from 10 to 20 and 30 models decides how far that fusing can bring its cost towards
FedAvg's. Each (formulation, models) pair has its own engine, eager, and on CUDA with the step recorded
as a CUDA graph (`cuda_graphs=True`), so launch overhead is out of the figures and what is timed is the
kernels; the recorded step replayed alone gives the device's share. The paper workload's client training
(FMNIST, Dirichlet 0.1, B=32, SGD 0.01 / 0.9, E epochs). The unfold formulation rounds differently from
the grouped convolution; its parameters are compared, not required to match.

    python bench/conv_scaling.py --device cuda               # 10, 20, 30 models, E=10, 4 rounds
    python bench/conv_scaling.py --device cpu --quick        # smoke test
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine import build_federation
from pool_train import UnfoldConv2d

from fedprism.algorithms.base import TrainJob
from fedprism.engine.base import LocalConfig, n_batches
from fedprism.engine.vectorized import VectorizedEngine
from fedprism.models import build_model
from fedprism.models.pooling import replace_modules
from fedprism.params import flatten


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--sizes", default="10,20,30", help="models per job, comma-separated")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="20 clients of 200 samples, E=1, sizes 2,4")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here")
        return 2
    sizes = [int(s) for s in a.sizes.split(",")]
    ns = argparse.Namespace(clients=100, partition="dirichlet", alpha=0.1, seed=0, test_samples=1000,
                            max_train=0)
    if a.quick:
        ns.clients, ns.max_train, a.epochs, a.rounds, sizes = 20, 200, 1, 2, [2, 4]
    fed, src = build_federation(ns)
    cfg = LocalConfig(epochs=a.epochs, batch_size=32, lr=0.01, momentum=0.9)
    model = build_model("lenet5", (1, 32, 32), 10, seed=0)
    forms = {"grouped": model,
             "unfold": replace_modules(model, lambda m: type(m) is nn.Conv2d, UnfoldConv2d)}
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    print(f"# conv scaling bench  torch {torch.__version__}  {name}  data {src}  E={a.epochs}  B=32  "
          f"LeNet-5, "
          f"eager{', CUDA graphs' if cuda else ''}")
    w0 = flatten(model).to(device)
    rng = np.random.default_rng(0)
    times: dict[tuple[str, int], list[float]] = {(f, n): [] for f in forms for n in sizes}
    replay: dict[tuple[str, int], float] = {}
    engines = {(f, n): VectorizedEngine(fed, m, cfg, 0, device, compile=False, rounds=100,
                                        cuda_graphs=cuda or None, max_slots=n)
               for f, m in forms.items() for n in sizes}
    slots: dict[int, list[int]] = {n: [] for n in sizes}
    print(f"{'round':>5} {'models':>6} {'slots':>5} {'grouped s':>9} {'unfold s':>9} {'max |dW|':>9}")
    for r in range(a.rounds):
        for n in sizes:
            clients = np.sort(rng.choice(fed.num_clients, size=n, replace=n > fed.num_clients))
            job = TrainJob(clients, w0.expand(n, -1).clone())
            slots[n].append(engines[("grouped", n)].slots_for(
                [n_batches(len(fed.train_idx[c]), a.epochs, 32) for c in clients]))
            order = list(forms) if r % 2 == 0 else list(forms)[::-1]
            res = {}
            for f in order:
                _sync(device)
                t = time.perf_counter()
                res[f] = engines[(f, n)].train(job, r)
                _sync(device)
                if r > 0:                          # round 0: recording and library autotuning
                    times[(f, n)].append(time.perf_counter() - t)
            d = float((res["unfold"].params - res["grouped"].params).abs().max())
            print(f"{r:>5} {n:>6} {slots[n][-1]:>5} {times[('grouped', n)][-1] if r else float('nan'):>9.3f} "
                  f"{times[('unfold', n)][-1] if r else float('nan'):>9.3f} {d:>9.2g}", flush=True)
    if cuda:                                       # the recorded step alone: the device's share
        for key, eng in engines.items():
            if eng._graphs:
                gs = next(iter(eng._graphs.values()))
                _sync(device)
                t = time.perf_counter()
                for _ in range(200):
                    gs.replay()
                _sync(device)
                replay[key] = (time.perf_counter() - t) / 200 * 1e3
    print(f"\n# median training round (rounds 1..{a.rounds - 1}); 'x {sizes[0]}' is the round's cost over "
          f"the {sizes[0]}-model round of the same formulation; slots: the rows of the vectorized step")
    for f in forms:
        base = statistics.median(times[(f, sizes[0])])
        for n in sizes:
            m = statistics.median(times[(f, n)])
            extra = f"  recorded step alone {replay[(f, n)]:.3f} ms" if (f, n) in replay else ""
            print(f"{f:>8} {n:>3} models ({min(slots[n])}-{max(slots[n])} slots): {m:.3f} s  "
                  f"x {sizes[0]}: {m / base:.2f}{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
