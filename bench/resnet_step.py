"""One local training step of ResNet-18 (CIFAR form, B = 32, one thread): fedprism's functional step (a flat
parameter vector through `fedprism.params.Functional`, the batch statistics recorded, the gradient of the
flat vector) against a plain module step (`loss.backward()` into the module's own parameters), each at
float32 and under bf16 autocast (`train.precision=bfloat16`), interleaved; `--profile` adds the torch
profiler's table of the bf16 steps. It says where a step's time goes, so how far an engine can gain over a
PFLlib-style loop when both run the same convolutions (bench/README.md, "`bench/resnet.py`").

    .venv/bin/python bench/resnet_step.py --repeats 5 --profile
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from fedprism.engine.base import autocast_objective  # noqa: E402
from fedprism.models import build_model  # noqa: E402
from fedprism.objectives import ce  # noqa: E402
from fedprism.params import Functional, flatten  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, plain = build_model("resnet18", (3, 32, 32), 10), build_model("resnet18", (3, 32, 32), 10)
    plain.train()
    f, flat = Functional(model), flatten(model)
    x, y = torch.randn(args.batch, 3, 32, 32), torch.randint(0, 10, (args.batch,))
    ones = torch.ones(args.batch)

    def functional(obj):
        def step():
            wr = flat.detach().requires_grad_(True)
            loss, _ = f.with_stats(lambda p: obj(f, p, x, y, ones, {}))(wr)
            torch.autograd.grad(loss, wr)
        return step

    def module(bf16: bool):
        def step():
            plain.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                out = plain(x)
            F.cross_entropy(out.float(), y).backward()
        return step

    steps = {"fedprism fp32": functional(ce), "module fp32": module(False),
             "fedprism bf16": functional(autocast_objective(ce, "cpu")), "module bf16": module(True)}
    for step in steps.values():
        step()                                   # first-call costs out of the timings
    times = {k: [] for k in steps}
    for r in range(args.repeats):
        order = list(steps)[r % len(steps):] + list(steps)[:r % len(steps)]
        for k in order:
            t = time.perf_counter()
            steps[k]()
            times[k].append(time.perf_counter() - t)
    print(f"# ResNet-18, B = {args.batch}, one thread, {args.repeats} interleaved repeats; seconds per step")
    for k, v in times.items():
        print(f"{k:14s} min {min(v):.3f}  median {sorted(v)[len(v) // 2]:.3f}")
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    print(f"bf16 speed-up: fedprism {med['fedprism fp32'] / med['fedprism bf16']:.2f}x, "
          f"module {med['module fp32'] / med['module bf16']:.2f}x; fedprism / module at bf16: "
          f"{med['fedprism bf16'] / med['module bf16']:.2f}x the time")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        for k in ("fedprism bf16", "module bf16"):
            with profile(activities=[ProfilerActivity.CPU]) as p:
                steps[k]()
            print(f"\n## {k}\n" + p.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))


if __name__ == "__main__":
    main()
