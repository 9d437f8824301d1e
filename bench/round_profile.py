"""Where a round's time goes: the vectorized engine on the FedPrism paper workload, under torch.profiler.

    python bench/round_profile.py [--threads 1] [--rounds 1] [--quick] [--fused]

The workload of `bench/engine.py` (FMNIST, 100 clients, Dirichlet 0.1, 10 clients per round, E = 10,
B = 32, SGD 0.01 / 0.9, LeNet-5, compiled; every round all 100 models scored on the local test splits
and the global test set). One warm-up round (compilation), then `--rounds` profiled rounds. Each
operator's *self* time is put in one class:

  convolution      oneDNN convolution forward and backward
  fused blocks     with --fused (train.kernels = eval.kernels = fused): the conv -> ReLU -> pooling
                   kernels of `fedprism.engine.fused`, forward and backward
  GEMM             mm / bmm / addmm / baddbmm (the linear layers, per client)
  compiled kernels Inductor's generated C++ (ReLU, max-pooling and its backward, softmax / cross-
                   entropy, the SGD-momentum update, the accuracy counts): everything the compiled
                   graph runs itself
  data movement    indexing the batches out of the training tensor, copies, concatenation, dtype casts
  other ops        every remaining operator
  Python/dispatch  the compiled region's wrappers and guards, plus the wall time no operator accounts
                   for (the engine's Python loop, building the batch schedule)

and printed as seconds and shares, training and evaluation separately.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine import build_federation

CLASSES = (
    ("convolution", ("convolution", "conv2d", "mkldnn_conv")),
    ("fused blocks", ("fedprism_kernels",)),
    ("GEMM", ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::linear", "aten::matmul")),
    ("compiled kernels", ("CompiledFxGraph", "Compiled Function", "cpp_fused")),
    ("data movement", ("index", "copy_", "aten::cat", "aten::stack", "aten::to", "_to_copy", "contiguous",
                       "gather", "aten::clone", "aten::expand")),
    ("Python/dispatch", ("Torch-Compiled Region", "TorchDynamo", "Pregraph", "AOTDispatcher", "## Call")),
)


KERNELS = 0            # --kernels


def classify(name: str) -> str:
    for cls, keys in CLASSES:
        if any(k in name for k in keys):
            return cls
    return "other ops"


def profile(fn) -> tuple[float, dict[str, float]]:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    with tprofile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        fn()
        wall = time.perf_counter() - t0
    out: dict[str, float] = defaultdict(float)
    top: list[tuple[float, str]] = []
    for ev in prof.key_averages():               # self times: an operator's own time, children excluded
        out[classify(ev.key)] += ev.self_cpu_time_total / 1e6
        top.append((ev.self_cpu_time_total / 1e6, ev.key))
    out["__top__"] = sorted(top, reverse=True)   # type: ignore[assignment]
    return wall, out


def report(what: str, wall: float, parts: dict[str, float], threads: int) -> None:
    # every operator runs on the calling thread (intra-op threads work inside it), so the self times add up
    # to at most the wall time at any thread count, and the rest of the wall time is in no operator
    parts = dict(parts)
    top = parts.pop("__top__", [])
    ops = sum(parts.values())
    print(f"\n{what}: {wall:.2f} s wall ({threads} thread(s))")
    parts["Python/dispatch"] = parts.get("Python/dispatch", 0.0) + max(0.0, wall - ops)   # + in no operator
    for cls in [c for c, _ in CLASSES[:-1]] + ["other ops", "Python/dispatch"]:
        sec = parts.get(cls, 0.0)
        print(f"  {cls:18s} {sec:7.2f} s  {100 * sec / max(wall, ops):5.1f} %")
    for sec, name in top[:KERNELS]:             # --kernels N: the N largest single operators / kernels
        print(f"    {100 * sec / max(wall, ops):5.1f} %  {sec:7.2f} s  {name[:100]}")


def main() -> int:
    from fedprism.algorithms.base import TrainJob
    from fedprism.engine.base import LocalConfig
    from fedprism.engine.vectorized import VectorizedEngine
    from fedprism.models import build_model
    from fedprism.params import flatten

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="20 clients, E = 1, 1k test images, no compile")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kernels", type=int, default=0,
                    help="also list the N largest operators, Inductor's generated kernels one by one "
                         "(torch._inductor.config.cpp.enable_kernel_profile)")
    ap.add_argument("--fused", action="store_true", help="train.kernels = eval.kernels = fused")
    a = ap.parse_args()
    global KERNELS
    KERNELS = a.kernels
    if a.kernels:
        import torch._inductor.config as inductor_config
        inductor_config.cpp.enable_kernel_profile = True
    torch.set_num_threads(a.threads)
    args = argparse.Namespace(clients=100, per_round=10, epochs=10, batch=32, alpha=0.1, partition="dirichlet",
                              test_samples=0, max_train=0, seed=a.seed)
    if a.quick:
        args.clients, args.per_round, args.epochs, args.test_samples, args.max_train = 20, 4, 1, 1000, 200
    fed, src = build_federation(args)
    kernels = "fused" if a.fused else "aten"
    cfg = LocalConfig(epochs=args.epochs, batch_size=args.batch, lr=0.01, momentum=0.9,
                      train_kernels=kernels, eval_kernels=kernels)
    model = build_model("lenet5", (1, 32, 32), 10, seed=a.seed)
    eng = VectorizedEngine(fed, model, cfg, a.seed, "cpu", compile="false" if a.quick else "true", rounds=100)
    W = flatten(model).expand(fed.num_clients, -1).clone()
    everyone = np.arange(fed.num_clients)
    rng = np.random.default_rng(a.seed)
    print(f"# data {src}; {fed.num_clients} clients; compiled={eng.compiled}; kernels={kernels}; "
          f"torch {torch.__version__}")

    def one_round(r: int) -> None:
        clients = np.sort(rng.choice(fed.num_clients, size=args.per_round, replace=False))
        up = eng.train(TrainJob(clients, W[torch.as_tensor(clients)].clone()), r)
        W[torch.as_tensor(clients)] = up.params

    def evaluate() -> None:
        eng.evaluate(W, everyone, "local")
        eng.evaluate(W, everyone, "global")

    one_round(0)                                     # compilation
    evaluate()
    for r in range(1, a.rounds + 1):
        wall, parts = profile(lambda: one_round(r))
        report(f"training, round {r}", wall, parts, a.threads)
        wall, parts = profile(evaluate)
        report(f"evaluation of {fed.num_clients} models, round {r}", wall, parts, a.threads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
