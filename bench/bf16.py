"""bf16 against float32 for one LeNet-5 on this CPU: an inference forward of 2000 images (bf16 weights and
inputs, and autocast) and 20 training steps at batch 32 (autocast), interleaved, one thread.

    python bench/bf16.py [--reps 5]

Says whether the CPU has native bf16 (AVX512-BF16 / AMX) and prints each variant's milliseconds and its
speed-up over float32. The engine's own bf16 evaluation is measured by `bench/engine.py --bf16-eval`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from fedprism.models import build_model  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    native = [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
    print(f"# torch {torch.__version__}, 1 thread, native bf16: {', '.join(native) or 'none'}")
    g = torch.Generator().manual_seed(0)
    m = build_model("lenet5", (1, 32, 32), 10, seed=0)
    mb = build_model("lenet5", (1, 32, 32), 10, seed=0).to(torch.bfloat16)
    x, y = torch.randn(2000, 1, 32, 32, generator=g), torch.randint(0, 10, (2000,), generator=g)
    xb = x.to(torch.bfloat16)

    def eval_fp32():
        with torch.no_grad():
            m(x)

    def eval_bf16():
        with torch.no_grad():
            mb(xb)

    def eval_autocast():
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            m(x)

    def train(autocast: bool):
        for i in range(20):
            m.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = F.cross_entropy(m(x[i * 32:(i + 1) * 32]), y[i * 32:(i + 1) * 32])
            loss.backward()

    fns = {"eval fp32": eval_fp32, "eval bf16": eval_bf16, "eval autocast": eval_autocast,
           "train fp32": lambda: train(False), "train autocast": lambda: train(True)}
    for f in fns.values():
        f()                                           # warm-up
    t = dict.fromkeys(fns, 0.0)
    for _ in range(args.reps):                        # interleaved: load changes hit every variant alike
        for k, f in fns.items():
            s = time.perf_counter()
            f()
            t[k] += time.perf_counter() - s
    for k in fns:
        base = t["eval fp32"] if k.startswith("eval") else t["train fp32"]
        print(f"{k:15s} {1000 * t[k] / args.reps:8.1f} ms   speed-up over fp32 {base / t[k]:5.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
