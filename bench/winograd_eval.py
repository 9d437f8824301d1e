"""Evaluation by minimal filtering, F(2 x 2, 5 x 5) (Lavin & Gray, "Fast Algorithms for Convolutional Neural
Networks", CVPR 2016, arXiv:1509.09308; `src/fedprism/engine/csrc/winograd.cpp`), against the fused direct
kernel (`csrc/fused_stem.cpp`), block by block: which blocks `eval.kernels = winograd` should take.

The two kernels are called in alternation, `--batches` batches of `--reps` calls each, the order flipping
every batch, so both see the same moments of the VM; it reports the fastest and the median batch of each,
and the largest difference between their outputs relative to the largest output. The shapes: the FedPrism
paper workload's evaluation chunk (10 LeNet-5 models, 1000 images; the first block on the shared test
images stacks the models' 6 filters into one group of 60), and blocks with 2, 3 and 4 input channels, which
place `fedprism.engine.fused.WINOGRAD_MIN_CHANNELS`.

    python bench/winograd_eval.py [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from kernel_ab import alternate  # noqa: E402  (bench/ is not a package; kernel_ab puts src/ on the path)

SHAPES = {        # name: (groups, images, channels, height = width, filters)
    "LeNet-5 block 2: 6 -> 16, 14 x 14, 10 models": (10, 1000, 6, 14, 16),
    "LeNet-5 block 1: 1 -> 60, 32 x 32, shared": (1, 1000, 1, 32, 60),
    "LeNet-5 block 1: 1 -> 6, 32 x 32, 10 models": (10, 1000, 1, 32, 6),
    "2 -> 16, 14 x 14, 10 models": (10, 1000, 2, 14, 16),
    "3 -> 16, 14 x 14, 10 models": (10, 1000, 3, 14, 16),
    "4 -> 16, 14 x 14, 10 models": (10, 1000, 4, 14, 16),
    "3 -> 16, 32 x 32, 10 models (RGB)": (10, 250, 3, 32, 16),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, default=9)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    for name in ("batches", "reps", "threads"):
        if getattr(a, name) < 1:
            ap.error(f"--{name} must be at least 1, got {getattr(a, name)}")
    from fedprism._alloc import tune_allocator
    from fedprism.engine import fused

    if not fused.load():
        ap.error(f"the kernels could not be built or loaded: {fused.unavailable_reason()}")
    tune_allocator()                  # as the engines do: large outputs are not page-faulted in every call
    torch.set_num_threads(a.threads)
    ops = torch.ops.fedprism_kernels
    print(f"# direct (stem_forward) and minimal-filtering (winograd_forward) kernels, "
          f"{fused.vector_floats()}-float vectors; torch {torch.__version__}, {a.threads} thread(s); "
          f"milliseconds per call over "
          f"{a.batches} alternating batches: fastest, then median")
    print(f"{'block':46s} {'direct':>8s} {'winograd':>9s} {'ratio':>6s}   {'direct':>8s} {'winograd':>9s} "
          f"{'ratio':>6s}   largest difference / largest output")
    g = torch.Generator().manual_seed(0)
    for name, (G, N, C, H, O) in SHAPES.items():
        x = torch.relu(torch.randn(G, N, C, H, H, generator=g))
        w = torch.randn(G, O, C * 25, generator=g) * (2 / (C * 25)) ** .5
        b = torch.randn(G, O, generator=g) * .1
        f = {"direct": lambda: ops.stem_forward(x, w, b, 5),
             "winograd": lambda: ops.winograd_forward(x, w, b, 5)}
        times = alternate(f, a.batches, a.reps)
        d, wi = f["direct"](), f["winograd"]()
        diff = (d - wi).abs().max().item() / d.abs().max().item()
        cols = []
        for stat in (min, statistics.median):
            td, tw = stat(times["direct"]), stat(times["winograd"])
            cols.append(f"{td:8.2f} {tw:9.2f} {td / tw:5.2f}x")
        print(f"{name:46s} {'   '.join(cols)}   {diff:.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
