"""Two exact formulations of LeNet-5's 2x2 max pooling for training, against `nn.MaxPool2d(2)`, compiled.

The compiled training step's largest kernel (`bench/README.md`, "The compiled step's largest kernel")
is the fused backward of the first pooling and ReLU. This bench replaces every plain `MaxPool2d(2)` of the
model with one of two formulations that send each window's gradient to the same input as `max_pool2d`
(its first maximum), so that the parameters stay the same bits:

  where  the four strided views, their maximum, and nested `torch.where` on first-maximum masks (the
         backward is element-wise: no scatter);
  stack  the four views stacked on a last dimension of 4 and `max(dim=-1)` (ties go to the first index).

Each engine trains the same rounds of the paper workload (FMNIST, 100 clients, Dirichlet 0.1, 10 clients
a round, B=32, SGD 0.01 / 0.9, LeNet-5) from the same starts, in rotating order; round 0 (compilation)
is left out of the medians, and every round checks the bits against `MaxPool2d`.

    python bench/pool_train.py --epochs 2 --rounds 4            # one thread
    python bench/pool_train.py --epochs 2 --rounds 4 --unfold   # and the unfold + GEMM convolution
    python bench/pool_train.py --epochs 2 --rounds 5 --fused-conv1 --nchw
    python bench/pool_train.py --epochs 2 --rounds 7 --aten-pool-bwd

Two more variants, which change the convolutions rather than the pooling:

  fused-conv1  the first block (convolution, ReLU, pooling) as element-wise operations: the sum over the
               kernel taps of shifted input views times the tap's weight, the first-maximum pooling of
               `where` (in evaluation the four views' maximum, the same numbers), then ReLU (ReLU and
               max-pooling commute). Inductor fuses it into loops that never write the 28 x 28 map to
               memory, and builds the weight gradient as reductions (no oneDNN convolution, no layout
               change). Its rounding differs from oneDNN's.
  nchw         the unchanged model compiled with Inductor's layout optimisation off
               (`torch._inductor.config.layout_optimization = False`), so that activations stay NCHW
               instead of the channels-last layout Inductor picks for oneDNN convolutions on CPU.
  aten-pool-bwd the unchanged model compiled with the pooling's backward left to ATen's CPU kernel
               (Inductor's decomposition and lowering of `max_pool2d_with_indices_backward` taken out
               while it compiles), instead of the gather loop Inductor generates and fuses with ReLU's
               backward. The same bits.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine import build_federation

from fedprism.algorithms.base import TrainJob
from fedprism.engine.base import LocalConfig
from fedprism.engine.vectorized import VectorizedEngine
from fedprism.models import build_model
from fedprism.models.pooling import MaxPool2x2, replace_modules, replace_plain_2x2
from fedprism.params import flatten


def _views(x: torch.Tensor):
    h, w = x.shape[-2] // 2 * 2, x.shape[-1] // 2 * 2
    x = x[..., :h, :w]
    return x[..., 0::2, 0::2], x[..., 0::2, 1::2], x[..., 1::2, 0::2], x[..., 1::2, 1::2]


class WhereMax2x2(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b, c, d = _views(x)
        m = torch.maximum(torch.maximum(a, b), torch.maximum(c, d))
        ia = (a == m) | torch.isnan(a)
        ib = ~ia & ((b == m) | torch.isnan(b))
        ic = ~ia & ~ib & ((c == m) | torch.isnan(c))
        return torch.where(ia, a, torch.where(ib, b, torch.where(ic, c, d)))


class StackMax2x2(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack(_views(x), -1).max(-1).values


class UnfoldConv2d(nn.Module):
    """`--unfold`: a Conv2d (no padding, stride 1) as unfold plus a matrix product, so that under vmap the
    models stay out of the channel dimension (a batched GEMM). Its rounding differs from oneDNN's."""

    def __init__(self, conv: nn.Conv2d):
        super().__init__()
        self.weight, self.bias, self.k = conv.weight, conv.bias, conv.kernel_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, _, H, W = x.shape
        out = self.weight.reshape(self.weight.shape[0], -1) @ F.unfold(x, self.k) + self.bias[:, None]
        return out.view(B, -1, H - self.k[0] + 1, W - self.k[1] + 1)


class FusedConvBlock(nn.Module):
    """`--fused-conv1`: Conv2d (stride 1, no padding) + ReLU + MaxPool2d(2) as element-wise operations."""

    def __init__(self, conv: nn.Conv2d):
        super().__init__()
        self.weight, self.bias, self.k = conv.weight, conv.bias, conv.kernel_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (kh, kw), (H, W) = self.k, (x.shape[-2] - self.k[0] + 1, x.shape[-1] - self.k[1] + 1)
        acc = self.bias.view(-1, 1, 1)
        for c in range(x.shape[1]):
            for i in range(kh):
                for j in range(kw):
                    acc = acc + x[:, c:c + 1, i:i + H, j:j + W] * self.weight[:, c, i, j].view(-1, 1, 1)
        pool = WhereMax2x2() if torch.is_grad_enabled() else MaxPool2x2()    # the same numbers without grads
        return pool(acc).relu()


def fuse_first_block(model: nn.Module) -> nn.Module:
    """LeNet-5 with body[0:3] (conv1, ReLU, pool) replaced; the parameter names stay `body.0.*`."""
    out = copy.deepcopy(model)
    out.body[0], out.body[1], out.body[2] = FusedConvBlock(out.body[0]), nn.Identity(), nn.Identity()
    return out


class _OwnGraph(nn.MaxPool2d):
    """`nn.MaxPool2d(2)` under another type. Every engine's step is the same Python function, and Dynamo's
    guards check the model's module types, so the unchanged model of `--nchw` or `--aten-pool-bwd` would
    run the graph compiled for the first engine; `own_graph` gives each such engine a subclass of its own."""

    def __init__(self):
        super().__init__(2)


def own_graph(model: nn.Module) -> nn.Module:
    """`model` with its poolings of a new type, so that its engine compiles a graph of its own."""
    return replace_plain_2x2(model, type("_OwnGraph", (_OwnGraph,), {}))


class _NoLayoutOpt(VectorizedEngine):
    """`--nchw`: compiles (lazily, inside `train`) with Inductor's layout optimisation off."""

    def train(self, job, rnd):
        import torch._inductor.config as inductor

        with inductor.patch(layout_optimization=False):
            return super().train(job, rnd)


class _AtenPoolBackward(VectorizedEngine):
    """`--aten-pool-bwd`: compiles (lazily, inside `train`) with `max_pool2d_with_indices_backward` an
    ATen call. Inductor's graph caches are off meanwhile: the key does not cover the tables patched here,
    so a cached graph of the plain engine would be loaded instead."""

    def train(self, job, rnd):
        import torch._functorch.config as functorch
        import torch._inductor.config as inductor
        import torch._inductor.decomposition as decomp
        import torch._inductor.lowering as lowering

        op = torch.ops.aten.max_pool2d_with_indices_backward
        keys = (op, *(getattr(op, o) for o in op.overloads()))
        saved = {k: lowering.lowerings[k] for k in keys if k in lowering.lowerings}
        dropped = {k: decomp.decompositions.pop(k) for k in keys if k in decomp.decompositions}
        lowering.lowerings.update({k: lowering.fallback_max_pool2d_with_indices_backward for k in saved})
        decomp.fast_random_decomps.cache_clear()
        try:
            with inductor.patch(fx_graph_cache=False), functorch.patch(enable_autograd_cache=False):
                return super().train(job, rnd)
        finally:
            lowering.lowerings.update(saved)
            decomp.decompositions.update(dropped)
            decomp.fast_random_decomps.cache_clear()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="20 clients of 200 samples, E=1, no compile")
    ap.add_argument("--unfold", action="store_true",
                    help="also time the convolutions as unfold + GEMM (other rounding: max |dW| printed)")
    ap.add_argument("--fused-conv1", action="store_true",
                    help="also time the first block as element-wise operations (other rounding)")
    ap.add_argument("--nchw", action="store_true",
                    help="also time the model compiled with Inductor's layout optimisation off")
    ap.add_argument("--aten-pool-bwd", action="store_true",
                    help="also time the model compiled with the pooling's backward as an ATen call")
    ap.add_argument("--eval-reps", type=int, default=0,
                    help="also time R evaluations of 100 models on the global test set per variant")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    ns = argparse.Namespace(clients=20 if a.quick else 100, partition="dirichlet", alpha=0.1, seed=0,
                            test_samples=0 if a.eval_reps else 1000, max_train=200 if a.quick else 0)
    fed, src = build_federation(ns)
    cfg = LocalConfig(epochs=1 if a.quick else a.epochs, batch_size=32, lr=0.01, momentum=0.9)
    model = build_model("lenet5", (1, 32, 32), 10, seed=0)
    comp = not a.quick
    engines = {name: VectorizedEngine(fed, m, cfg, 0, "cpu", compile=comp, rounds=100)
               for name, m in (("MaxPool2d", copy.deepcopy(model)),
                               ("where", replace_plain_2x2(model, WhereMax2x2)),
                               ("stack", replace_plain_2x2(model, StackMax2x2)))}
    if a.unfold:
        unfold = replace_modules(model, lambda m: type(m) is nn.Conv2d, UnfoldConv2d)
        engines["unfold"] = VectorizedEngine(fed, unfold, cfg, 0, "cpu", compile=comp, rounds=100)
    if a.fused_conv1:
        engines["fused-conv1"] = VectorizedEngine(fed, fuse_first_block(model), cfg, 0, "cpu", compile=comp,
                                                  rounds=100)
    if a.nchw:
        engines["nchw"] = _NoLayoutOpt(fed, own_graph(model), cfg, 0, "cpu", compile=comp, rounds=100)
    if a.aten_pool_bwd:
        engines["aten-pool-bwd"] = _AtenPoolBackward(fed, own_graph(model), cfg, 0, "cpu", compile=comp,
                                                     rounds=100)
    print(f"# pooling bench  torch {torch.__version__}  threads {a.threads}  data {src}  E={cfg.epochs}")
    w0, rng = flatten(model), np.random.default_rng(0)
    times: dict[str, list[float]] = {k: [] for k in engines}
    same = True
    for r in range(a.rounds):
        clients = np.sort(rng.choice(fed.num_clients, 10 if not a.quick else 4, replace=False))
        job = TrainJob(clients, w0.expand(len(clients), -1).clone())
        names = list(engines)
        names = names[r % len(names):] + names[:r % len(names)]
        res = {}
        for k in names:
            t = time.perf_counter()
            res[k] = engines[k].train(job, r)
            if r > 0:
                times[k].append(time.perf_counter() - t)
        for k in ("where", "stack", *(v for v in ("nchw", "aten-pool-bwd") if v in res)):
            eq = torch.equal(res[k].params, res["MaxPool2d"].params) and torch.equal(res[k].loss,
                                                                                      res["MaxPool2d"].loss)
            same &= eq
            print(f"round {r}: {k} {'same bits' if eq else 'DIFFERENT'}", flush=True)
        for k in ("unfold", "fused-conv1"):
            if k in res:
                d = float((res[k].params - res["MaxPool2d"].params).abs().max())
                print(f"round {r}: {k} max |dW| {d:.2g} (other rounding, not compared)", flush=True)
    base = statistics.median(times["MaxPool2d"]) if times["MaxPool2d"] else float("nan")
    for k, v in times.items():
        if v:
            print(f"{k:>10}: median training round {statistics.median(v):.3f} s, "
                  f"{statistics.median(v) / base:.2f}x MaxPool2d's")
    if a.aten_pool_bwd:
        _pool_backward_calls({k: engines[k] for k in ("MaxPool2d", "aten-pool-bwd")}, job)
    if a.eval_reps:
        _time_evaluation(engines, res["MaxPool2d"].params, fed.num_clients, a.eval_reps)
    return 0 if same else 1


def _pool_backward_calls(engines: dict, job: TrainJob) -> None:
    """One more round of each engine under torch.profiler: how often, and how long, ATen's pooling
    backward ran (none in the plain engine, where Inductor generates it)."""
    from torch.profiler import profile

    for k, eng in engines.items():
        with profile() as prof:
            eng.train(job, 99)
        ev = [e for e in prof.key_averages() if e.key == "aten::max_pool2d_with_indices_backward"]
        n, s = (ev[0].count, ev[0].self_cpu_time_total / 1e6) if ev else (0, 0.0)
        print(f"{k:>13}: aten::max_pool2d_with_indices_backward {n} calls, {s:.3f} s in a profiled round")


def _time_evaluation(engines: dict, trained: torch.Tensor, n: int, reps: int) -> None:
    """`--eval-reps R`: each engine scores the same n models (the last round's, cycled) on the global test
    set, R times in rotating order after one warm-up; median seconds and the largest accuracy change."""
    W = trained[torch.arange(n) % len(trained)]
    every = np.arange(n)
    base = {k: e.evaluate(W, every, "global") for k, e in engines.items()}      # warm-up (compilation)
    times: dict[str, list[float]] = {k: [] for k in engines}
    for r in range(reps):
        names = list(engines)[r % len(engines):] + list(engines)[:r % len(engines)]
        for k in names:
            t = time.perf_counter()
            engines[k].evaluate(W, every, "global")
            times[k].append(time.perf_counter() - t)
    ref = statistics.median(times["MaxPool2d"])
    for k, v in times.items():
        d = float((base[k].accuracy - base["MaxPool2d"].accuracy).abs().max())
        print(f"{k:>10}: median evaluation of {n} models x {int(base[k].count[0])} test samples "
              f"{statistics.median(v):.3f} s, {statistics.median(v) / ref:.2f}x MaxPool2d's; largest accuracy "
              f"change {d:.4f}")


if __name__ == "__main__":
    sys.exit(main())
