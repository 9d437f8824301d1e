"""CUDA graphs for the training step: the same rounds with and without them, in one process.

Workload of `bench/engine.py` (FedPrism paper, arXiv:2603.08252: Fashion-MNIST 32x32, 100 clients,
Dirichlet 0.1, E=10, B=32, SGD lr 0.01 momentum 0.9, LeNet-5), training only: each round samples
`--per-round` clients and trains them from the same starts with two compiled vectorized engines, one with
`cuda_graphs=False` and one with `cuda_graphs=True`, alternating which goes first. Every round checks that
both give the same parameters and losses bit for bit. `--fused` also times a job of twice the models (the
size of `fedprism_dual`'s fused specialist + private pass). Round 0 holds compilation and recording and
is left out of the ratios.

    python bench/cuda_graphs.py --rounds 6           # needs CUDA
    python bench/cuda_graphs.py --device cpu --quick # the CPU smoke version (graphs off on both sides)
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

from engine import build_federation

from fedprism.algorithms.base import TrainJob
from fedprism.engine.base import LocalConfig
from fedprism.engine.vectorized import VectorizedEngine
from fedprism.models import build_model
from fedprism.params import flatten


def timed(eng: VectorizedEngine, job: TrainJob, rnd: int, device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t = time.perf_counter()
    out = eng.train(job, rnd)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="20 clients, E=1, 200 samples each, no compile")
    ap.add_argument("--fused", action="store_true", help="also time jobs of 2 x per-round models")
    ap.add_argument("--per-round", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    ns = argparse.Namespace(clients=100, partition="dirichlet", alpha=0.1, seed=args.seed, test_samples=1000,
                            max_train=0)
    epochs, compile_ = 10, True
    if args.quick:
        ns.clients, ns.max_train, epochs, compile_ = 20, 200, 1, False
        args.rounds, args.per_round = min(args.rounds, 2), min(args.per_round, 4)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here")
        return 2
    fed, src = build_federation(ns)
    cfg = LocalConfig(epochs=epochs, batch_size=32, lr=0.01, momentum=0.9)
    model = build_model("lenet5", (1, 32, 32), 10, seed=args.seed)
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    print(f"# CUDA graphs bench  torch {torch.__version__}  {name}  data {src}  {fed.num_clients} clients, "
          f"{args.per_round}/round, E={epochs}, B=32, LeNet-5, compile={compile_}")
    engines = {g: VectorizedEngine(fed, model, cfg, args.seed, device, compile=compile_, rounds=100,
                                   cuda_graphs=g and cuda) for g in (False, True)}
    w0 = flatten(model).to(device)
    rng = np.random.default_rng(args.seed)
    sizes = [args.per_round] + ([2 * args.per_round] if args.fused else [])
    times: dict[tuple[int, bool], list[float]] = {(n, g): [] for n in sizes for g in (False, True)}
    print(f"{'round':>5} {'models':>6} {'steps':>6} {'plain s':>8} {'graphs s':>8} {'same bits':>9}")
    for r in range(args.rounds):
        for n in sizes:
            clients = np.sort(rng.choice(fed.num_clients, size=n, replace=n > fed.num_clients))
            start = w0 + 0.01 * torch.randn(n, w0.numel(), device=device,
                                            generator=torch.Generator(device).manual_seed(r))
            job = TrainJob(clients, start)
            order = (False, True) if r % 2 == 0 else (True, False)
            res = {g: timed(engines[g], job, r, device) for g in order}
            if r > 0:
                for g, (_, dt) in res.items():
                    times[(n, g)].append(dt)
            (a, ta), (b, tb) = res[False], res[True]
            same = torch.equal(a.params, b.params) and torch.equal(a.loss, b.loss)
            steps = -(-int(a.n_samples.max()) // 32) * epochs
            print(f"{r:>5} {n:>6} {steps:>6} {ta:>8.3f} {tb:>8.3f} {same!s:>9}", flush=True)
            if not same:
                print("MISMATCH: graphs changed the numbers")
                return 1
    print(f"\n# graphs recorded: {len(engines[True]._graphs)}; engine with graphs still on: "
          f"{engines[True].cuda_graphs}")
    if cuda and engines[True]._graphs:          # the recorded step alone: the GPU's share of a step
        gs = next(iter(engines[True]._graphs.values()))
        torch.cuda.synchronize(device)
        t = time.perf_counter()
        for _ in range(190):
            gs.replay()
        torch.cuda.synchronize(device)
        print(f"# one recorded step of {gs.w.shape[0]} slots replayed alone: "
              f"{(time.perf_counter() - t) / 190 * 1e3:.3f} ms (190 replays)")
    for n in sizes:
        p, g = times[(n, False)], times[(n, True)]
        if p and g:
            mp, mg = statistics.median(p), statistics.median(g)
            print(f"{n} models/job: median training round {mp:.3f} s plain, {mg:.3f} s graphs, "
                  f"ratio plain/graphs {mp / mg:.2f}x (rounds 1..{args.rounds - 1})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
