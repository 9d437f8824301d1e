"""Where one evaluation of a run goes: the paper configuration's `fedprism_dual` (or any method) trained
for a few rounds, every evaluation timed, and one of them profiled twice: by Python function
(`cProfile`: host work such as hashing rows for the caches, building predictions, copies) and by
operator (`torch.profiler`, with the device's kernels on CUDA).

On an H200 a `fedprism_dual` evaluation took 0.68 s against FedAvg's 0.098 s (`bench/README.md`, "GPU"),
while its arithmetic, about 110 changed models on the 10k test set, is about 0.15 s there at the engine
bench's evaluation rate. This bench is there to find the rest.

    python bench/eval_profile.py --device cuda                   # fedprism_dual, paper configuration
    python bench/eval_profile.py --device cuda --method fedavg   # the same for FedAvg
    python bench/eval_profile.py --quick                         # digits, MLP, 20 clients (smoke test)
    python bench/eval_profile.py --validation                    # with validation splits (CPU)
    python bench/eval_profile.py --device cuda --threads 8       # the host's share in 8 threads

Training uses one local epoch (the evaluation does not depend on it) and a few rounds; the profiled
evaluation is the last one. Nothing is kept: the store is a temporary file.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import fedprism
import fedprism.experiment.evaluate as evaluate

PAPER = dict(dataset="fmnist", model="lenet5", clients=100, fraction=0.1, batch_size=32, lr=0.01,
             momentum=0.9, **{"partition.name": "dirichlet", "partition.alpha": 0.1, "fedprism_dual.k": 5,
                "fedprism_dual.every": 10})
QUICK = dict(dataset="digits", model="mlp", clients=20, fraction=0.5, **{"fedprism_dual.k": 3,
                                                                      "partition.min_train": 5})


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", default="fedprism_dual")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=4, help="rounds trained, each followed by an evaluation")
    ap.add_argument("--top", type=int, default=15, help="lines of each profile")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads (the run's `threads`; 0: torch's default): the host's share of an "
                         "evaluation (hashing rows, mixing models) runs in that many")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--validation", action="store_true",
                    help="with validation splits (10 %% of each client's rows, a 5000-image global "
                         "validation set; 200 for --quick), as sweeps/fedprism_validation.toml")
    a = ap.parse_args(argv)
    keys = dict(QUICK if a.quick else PAPER)
    if a.validation:
        keys.update({"data.val_fraction": 0.1, "data.global_val": 200 if a.quick else 5000})
    if a.method != "fedprism_dual":
        keys = {k: v for k, v in keys.items() if not k.startswith("fedprism_dual.")}
    cfg = fedprism.config(method=a.method, rounds=a.rounds, eval_every=1, local_epochs=1, device=a.device,
                          seed=0, threads=a.threads, **keys)
    times: list[float] = []
    report: list[str] = []
    original = evaluate.Evaluator.__call__

    def timed(self, *args, **kw):
        _sync(a.device)
        t = time.perf_counter()
        if len(times) < a.rounds - 1:
            out = original(self, *args, **kw)
        else:                                   # the last evaluation: profiled (and not timed with the rest)
            prof = cProfile.Profile()
            acts = [torch.profiler.ProfilerActivity.CPU] + (
                [torch.profiler.ProfilerActivity.CUDA] if a.device.startswith("cuda") else [])
            with torch.profiler.profile(activities=acts) as tp:
                prof.enable()
                out = original(self, *args, **kw)
                _sync(a.device)
                prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(a.top)
            text = s.getvalue().strip().replace(f"{ROOT}/", "")          # paths relative to the checkout
            report.append("## by Python function (cProfile, tottime)\n" + text)
            sort = "self_cuda_time_total" if a.device.startswith("cuda") else "self_cpu_time_total"
            report.append(f"## by operator (torch.profiler, {sort})\n"
                          + tp.key_averages().table(sort_by=sort, row_limit=a.top))
        _sync(a.device)
        times.append(time.perf_counter() - t)
        return out

    evaluate.Evaluator.__call__ = timed
    try:
        with tempfile.TemporaryDirectory() as d:
            fedprism.run(cfg, db=Path(d) / "profile.db")
    finally:
        evaluate.Evaluator.__call__ = original
    print(f"# evaluation profile  torch {torch.__version__}  device {a.device}  method {a.method}  "
          f"threads {torch.get_num_threads()}  "
          f"{cfg['dataset']}, {cfg['clients']} clients, {cfg['model']}"
          + (f", validation splits (global {cfg['data.global_val']})" if a.validation else ""))
    print(f"evaluations: {len(times)}; seconds each: {', '.join(f'{t:.3f}' for t in times)}")
    plain = times[1:-1] or times[:1]
    print(f"median of the unprofiled evaluations after the first: {statistics.median(plain):.3f} s "
          f"(the first holds compilation; the last is profiled, so slower)")
    print("\n\n".join(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
