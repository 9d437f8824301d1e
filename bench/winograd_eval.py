"""Evaluation by minimal filtering, F(2 x 2, 5 x 5) (Lavin & Gray, "Fast Algorithms for Convolutional Neural
Networks", CVPR 2016, arXiv:1509.09308), against the fused direct kernel, on the evaluation shapes of the
FedPrism paper workload: a tried-and-dropped experiment (bench/README.md, "Evaluation by minimal filtering:
tried, dropped").

The Winograd kernel (`winograd_forward`) lived in `src/fedprism/engine/csrc/fused_stem.cpp` at one commit
only; this script builds that file from git (`--rev`) under its own operator namespace, as
`bench/kernel_ab.py` does, and calls its direct kernel (`stem_forward`) and its Winograd kernel in
alternation: `--batches` batches of `--reps` calls each, the order flipping every batch. It reports the
fastest and the median batch of each, and the largest difference between their outputs.

    python bench/winograd_eval.py [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from kernel_ab import ROOT, SOURCE, build

REV = "HEAD"      # the commit whose kernels hold winograd_forward

SHAPES = {        # name: (groups, images, channels, height = width, filters): 10 models, 1000 images
    "eval 2 (6 -> 16 channels, 14 x 14)": (10, 1000, 6, 14, 16),
    "eval 1, shared (1 -> 6 x 10 models)": (1, 1000, 1, 32, 60),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", default=REV, help="git revision whose fused_stem.cpp holds winograd_forward")
    ap.add_argument("--batches", type=int, default=9)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    source = subprocess.run(["git", "show", f"{a.rev}:{SOURCE}"], cwd=ROOT, capture_output=True,
                            check=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        ops = build(source, "fedprism_winograd_bench", Path(tmp))
        print(f"# direct (stem_forward) and Winograd (winograd_forward) kernels of {a.rev}; torch "
              f"{torch.__version__}, {a.threads} thread(s); milliseconds per call over {a.batches} "
              "alternating batches")
        print(f"{'shape':38s} {'direct':>8s} {'winograd':>9s} {'ratio':>6s}   {'(median)':>8s} "
              f"{'':>9s} {'ratio':>6s}   largest difference / largest output")
        g = torch.Generator().manual_seed(0)
        for name, (G, N, C, H, O) in SHAPES.items():
            x = torch.relu(torch.randn(G, N, C, H, H, generator=g))
            w = torch.randn(G, O, C * 25, generator=g) * (2 / (C * 25)) ** .5
            b = torch.randn(G, O, generator=g) * .1
            f = {"direct": lambda: ops.stem_forward(x, w, b, 5),
                 "winograd": lambda: ops.winograd_forward(x, w, b, 5)}
            times: dict[str, list[float]] = {k: [] for k in f}
            for k in f:
                f[k]()
            for i in range(a.batches):
                for k in (("direct", "winograd") if i % 2 == 0 else ("winograd", "direct")):
                    t0 = time.perf_counter()
                    for _ in range(a.reps):
                        f[k]()
                    times[k].append((time.perf_counter() - t0) / a.reps * 1e3)
            d, wi = f["direct"](), f["winograd"]()
            diff = (d - wi).abs().max().item() / d.abs().max().item()
            lo = {k: min(v) for k, v in times.items()}
            med = {k: statistics.median(v) for k, v in times.items()}
            print(f"{name:38s} {lo['direct']:8.2f} {lo['winograd']:9.2f} {lo['direct'] / lo['winograd']:5.2f}x"
                  f"   {med['direct']:8.2f} {med['winograd']:9.2f} {med['direct'] / med['winograd']:5.2f}x"
                  f"   {diff:.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
