"""The fused conv -> ReLU -> 2x2 max-pooling blocks (`eval.kernels=fused`, `train.kernels=fused`,
`fedprism.kernels.fused`) against PyTorch's layers, on the FedPrism paper workload's shapes (LeNet-5, 32 x 32
Fashion-MNIST-sized inputs).

1. The block alone, interleaved, median of `--reps`: LeNet-5's first block for 10 models on a shared
   batch of 1000 images (one input channel, 60 stacked filters: the kernel's position-vectorized layout),
   and its second block with an input per model (6 -> 16 channels, grouped: the filter-vectorized layout):
   PyTorch's conv2d in channels-last (what Inductor picks) then ReLU and 2x2 max-pooling, against the
   kernel.
2. One evaluation chunk of the compiled vectorized engine (10 models x 1000 images of the global test set,
   the CPU default), `aten` against `fused` (both blocks fused), interleaved, then each profiled by
   operator.
3. One training round of the compiled vectorized engine (10 clients of the paper partition, E=`--epochs`,
   B=32, SGD 0.01 / 0.9), `train.kernels` `aten` against `fused` (the first block fused), interleaved over
   `--rounds` rounds (round 0, compilation, left out), and the largest parameter difference after each
   round.

    python bench/fused_stem.py                # two threads (torch's default here)
    python bench/fused_stem.py --threads 1
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine import build_federation

from fedprism._alloc import tune_allocator
from fedprism.algorithms.base import TrainJob
from fedprism.kernels import build, fused
from fedprism.engine.base import LocalConfig
from fedprism.engine.vectorized import VectorizedEngine
from fedprism.models import build_model
from fedprism.params import flatten


def timed(fns: dict, reps: int) -> dict[str, float]:
    for f in fns.values():
        f()
    t: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(reps):
        for k in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            s = time.perf_counter()
            fns[k]()
            t[k].append(time.perf_counter() - s)
    return {k: statistics.median(v) for k, v in t.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--rounds", type=int, default=5, help="training rounds (part 3)")
    ap.add_argument("--epochs", type=int, default=2, help="local epochs per training round (part 3)")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    tune_allocator()                                    # as every engine does
    if not build.load("fused"):
        print(f"fused kernel unavailable: {build.unavailable_reason()}")
        return 2
    print(f"# fused blocks bench  torch {torch.__version__}  threads {torch.get_num_threads()}  "
          f"kernels: {fused.vector_floats()}-float vectors")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, 1, 32, 32, generator=g)
    w1, b1 = 0.2 * torch.randn(60, 1, 5, 5, generator=g), 0.1 * torch.randn(60, generator=g)
    h = torch.relu(torch.randn(10, 1000, 6, 14, 14, generator=g))
    w2, b2 = 0.1 * torch.randn(10, 16, 6, 5, 5, generator=g), 0.1 * torch.randn(10, 16, generator=g)
    xl = x.contiguous(memory_format=torch.channels_last)
    hl = h.transpose(0, 1).reshape(1000, 60, 14, 14).contiguous(memory_format=torch.channels_last)
    stem = torch.ops.fedprism_kernels.stem_forward
    blocks = {
        "first block, PyTorch": lambda: F.max_pool2d(F.relu(F.conv2d(xl, w1, b1)), 2),
        "first block, fused": lambda: stem(x[None], w1.reshape(1, 60, 25), b1[None], 5),
        "second block, PyTorch": lambda: F.max_pool2d(F.relu(F.conv2d(hl, w2.reshape(160, 6, 5, 5),
                                                                     b2.reshape(160), groups=10)), 2),
        "second block, fused": lambda: stem(h, w2.reshape(10, 16, 150), b2, 5),
    }
    ref1 = blocks["first block, PyTorch"]()
    d1 = (ref1 - blocks["first block, fused"]()[0]).abs().max().item()
    ref2 = blocks["second block, PyTorch"]().reshape(1000, 10, 16, 5, 5).transpose(0, 1)
    d2 = (ref2 - blocks["second block, fused"]()).abs().max().item()
    t = timed(blocks, a.reps)
    print("\n## one block, 10 models x 1000 images (median seconds; max |difference| of the outputs)")
    for name, diff in (("first block", d1), ("second block", d2)):
        p, f = t[f"{name}, PyTorch"], t[f"{name}, fused"]
        print(f"{name:>13}: PyTorch {p * 1e3:8.1f} ms   fused {f * 1e3:8.1f} ms   PyTorch/fused {p / f:5.2f}x"
              f"   max |diff| {diff:.2g}")

    fed, src = build_federation(argparse.Namespace(clients=100, partition="dirichlet", alpha=0.1, seed=0,
                                                   test_samples=1000, max_train=0))
    xt, yt = fed.x_test, fed.y_test
    model = build_model("lenet5", (1, 32, 32), 10, seed=0)
    W = flatten(model).expand(10, -1) + 0.05 * torch.randn(10, flatten(model).numel(), generator=g)
    engines = {k: VectorizedEngine(fed, model, LocalConfig(eval_kernels=k), 0, compile=True,
                                   eval_samples=1000)
               for k in ("aten", "fused")}
    valid = torch.ones(1000)
    with torch.no_grad():
        chunk = {k: (lambda e=e: e._eval_shared(W, xt, yt, valid)) for k, e in engines.items()}
        res = {k: f() for k, f in chunk.items()}
        t = timed(chunk, a.reps)
        print(f"\n## one evaluation chunk of the compiled engine: 10 models x 1000 images ({src})")
        print(f"aten {t['aten'] * 1e3:.1f} ms   fused {t['fused'] * 1e3:.1f} ms   aten/fused "
              f"{t['aten'] / t['fused']:.2f}x   correct counts equal: "
              f"{torch.equal(res['aten'][0], res['fused'][0])}")
        from torch.profiler import profile
        for k, f in chunk.items():
            with profile(record_shapes=True) as prof:
                for _ in range(3):
                    f()
            rows = sorted(prof.key_averages(group_by_input_shape=True), key=lambda e: -e.self_cpu_time_total)
            total = sum(e.self_cpu_time_total for e in rows)
            print(f"\n{k}: self CPU time by operator (3 chunks, profiled)")
            for e in rows[:5]:
                shape = str(e.input_shapes[:2]) if e.input_shapes else ""
                print(f"  {100 * e.self_cpu_time_total / total:5.1f} %  {e.key[:60]:<60} {shape[:60]}")

    cfg = LocalConfig(epochs=a.epochs, batch_size=32, lr=0.01, momentum=0.9)
    trainers = {k: VectorizedEngine(fed, model, dataclasses.replace(cfg, train_kernels=k), 0, compile=True)
                for k in ("aten", "fused")}
    rng = np.random.default_rng(0)
    t = {k: [] for k in trainers}
    print(f"\n## training rounds of the compiled engine: 10 clients, E={a.epochs}, B=32 (seconds)")
    for r in range(a.rounds):
        job = TrainJob(np.sort(rng.choice(fed.num_clients, 10, replace=False)), W.clone())
        out = {}
        for k in (list(trainers) if r % 2 == 0 else list(trainers)[::-1]):
            s = time.perf_counter()
            out[k] = trainers[k].train(job, r)
            if r:
                t[k].append(time.perf_counter() - s)
        d = (out["aten"].params - out["fused"].params).abs().max().item()
        shown = "  ".join(f"{k} {v[-1]:.3f}" for k, v in t.items()) if r else "compilation"
        print(f"round {r}: {shown}   max |dW| {d:.2g}", flush=True)
    ma, mf = statistics.median(t["aten"]), statistics.median(t["fused"])
    print(f"median training round: aten {ma:.3f} s   fused {mf:.3f} s   aten/fused {ma / mf:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
