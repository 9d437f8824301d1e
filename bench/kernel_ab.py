"""Two builds of the fused CPU kernels (`src/fedprism/kernels/csrc/fused_stem.cpp`), kernel by kernel: the
source at a git revision (`--base`, default HEAD) against the working tree's.

Both builds are loaded into one process (each copy's operator namespace renamed, so they register side by
side) and called in alternation: `--batches` batches of `--reps` calls per kernel, base and new in turn,
the order flipping every batch, so both see the same moments of the VM (its speed drifts by +-30 % over
minutes and differs between processes). It reports the fastest and the median batch of each, and the
largest difference between the two builds' outputs (0 where the change keeps the arithmetic). The shapes
are the FedPrism paper workload's (LeNet-5 on 32 x 32 inputs): a training step of `--models` models on
`--batch` images each, and an evaluation chunk of the same models on 1000 shared images.

    python bench/kernel_ab.py                    # HEAD's kernels against the working tree's, one thread
    python bench/kernel_ab.py --base HEAD~3 --threads 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

KERNELS = ("train fwd 1", "train fwd 2", "bwd 2 (dW, dx)", "bwd 1 (dW)", "eval 1 (shared)", "eval 2")
SOURCE = "src/fedprism/kernels/csrc/fused_stem.cpp"


def build(source: bytes, ns: str, tmp: Path):
    """`source` compiled as fedprism.kernels.build compiles it, namespace renamed to `ns`, loaded:
    torch.ops.<ns>."""
    from fedprism.kernels import build as kernels

    src = tmp / f"{ns}.cpp"
    src.write_bytes(source.replace(b"fedprism_kernels", ns.encode()))
    kernels._compile(kernels.compiler(), tmp / f"{ns}.so", src)
    torch.ops.load_library(str(tmp / f"{ns}.so"))
    return getattr(torch.ops, ns)


def calls(ops, models: int, batch: int) -> list:
    """The six kernel calls on fixed random inputs (the same for every build: one seeded generator)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(models, batch, 1, 32, 32, generator=g)
    xs = torch.randn(1, 1000, 1, 32, 32, generator=g)
    w1, b1 = torch.randn(models, 6, 25, generator=g) * .2, torch.randn(models, 6, generator=g) * .1
    w2, b2 = torch.randn(models, 16, 150, generator=g) * .1, torch.randn(models, 16, generator=g) * .1
    g2 = torch.randn(models, batch, 16, 5, 5, generator=g)
    h1, a1 = ops.stem_train_forward(x, w1, b1, 5)
    _, a2 = ops.stem_train_forward(h1, w2, b2, 5)
    g1 = ops.block_backward(g2, a2, h1, w2, 5)[2]
    ws, bs = w1.reshape(1, -1, 25), b1.reshape(1, -1)
    e1 = ops.stem_forward(xs, ws, bs, 5).reshape(1000, models, 6, 14, 14).transpose(0, 1)
    return [lambda: ops.stem_train_forward(x, w1, b1, 5), lambda: ops.stem_train_forward(h1, w2, b2, 5),
            lambda: ops.block_backward(g2, a2, h1, w2, 5), lambda: ops.stem_backward(g1, a1, x, 5),
            lambda: ops.stem_forward(xs, ws, bs, 5), lambda: ops.stem_forward(e1, w2, b2, 5)]


def alternate(calls: dict, batches: int, reps: int) -> dict[str, list[float]]:
    """Milliseconds per call of each of two `calls` (name -> function), after one warm-up call each:
    `batches` batches of `reps` calls, the two in turn, the order flipping every batch (both see the same
    moments of the VM)."""
    first, second = calls
    times: dict[str, list[float]] = {k: [] for k in calls}
    for f in calls.values():
        f()
    for r in range(batches):
        for k in ((first, second) if r % 2 == 0 else (second, first)):
            s = time.perf_counter()
            for _ in range(reps):
                calls[k]()
            times[k].append((time.perf_counter() - s) / reps * 1e3)
    return times


def largest_difference(a, b) -> float:
    a, b = (t if isinstance(t, (tuple, list)) else (t,) for t in (a, b))
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="HEAD", help="git revision of the base kernels (default HEAD)")
    ap.add_argument("--batches", type=int, default=15)
    ap.add_argument("--reps", type=int, default=40, help="calls per batch of a training kernel (an "
                    "evaluation kernel, 20x the work, gets a twentieth)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--models", type=int, default=10)
    ap.add_argument("--batch", type=int, default=32)
    a = ap.parse_args(argv)
    for name in ("batches", "reps", "threads", "models", "batch"):
        if getattr(a, name) < 1:
            ap.error(f"--{name} must be at least 1, got {getattr(a, name)}")
    from fedprism._alloc import tune_allocator

    tune_allocator()                  # as the engines do: large outputs are not page-faulted in every call
    torch.set_num_threads(a.threads)
    got = subprocess.run(["git", "-C", str(ROOT), "show", f"{a.base}:{SOURCE}"], capture_output=True)
    if got.returncode != 0:
        ap.error(f"--base {a.base}: no kernel source there (git show: {got.stderr.decode().strip()})")
    base_src = got.stdout
    with tempfile.TemporaryDirectory(prefix="fedprism-kernel-ab-") as tmp:
        fns = {"base": calls(build(base_src, "fedprism_kernels_base", Path(tmp)), a.models, a.batch),
               "new": calls(build((ROOT / SOURCE).read_bytes(), "fedprism_kernels_new", Path(tmp)),
                            a.models, a.batch)}
    times: dict[str, dict[str, list[float]]] = {w: {k: [] for k in KERNELS} for w in fns}
    for i, name in enumerate(KERNELS):
        n = a.reps if name.startswith(("train", "bwd")) else max(1, a.reps // 20)
        got = alternate({w: fns[w][i] for w in ("base", "new")}, a.batches, n)
        for w in fns:
            times[w][name] = got[w]
    print(f"# fused kernels: {a.base} (base) against the working tree (new); torch {torch.__version__}, "
          f"{a.threads} thread(s), {a.models} models, training batch {a.batch}, evaluation chunk 1000 images")
    print(f"# milliseconds per call over {a.batches} alternating batches: fastest and median\n")
    print(f"{'kernel':16s} {'base':>8s} {'new':>8s} {'ratio':>7s}   {'base':>8s} {'new':>8s} {'ratio':>7s}"
          f"   largest output difference")
    tot = {(w, f): 0.0 for w in fns for f in (min, statistics.median)}
    for i, name in enumerate(KERNELS):
        row = []
        for f in (min, statistics.median):
            tb, tn = f(times["base"][name]), f(times["new"][name])
            if name.startswith(("train", "bwd")):
                tot["base", f], tot["new", f] = tot["base", f] + tb, tot["new", f] + tn
            row.append(f"{tb:8.3f} {tn:8.3f} {tb / tn:6.2f}x")
        diff = largest_difference(fns["base"][i](), fns["new"][i]())
        print(f"{name:16s} {'   '.join(row)}   {diff:.2g}")
    row = [f"{tot['base', f]:8.3f} {tot['new', f]:8.3f} {tot['base', f] / tot['new', f]:6.2f}x"
           for f in (min, statistics.median)]
    print(f"{'training step':16s} {'   '.join(row)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
