"""Two cores as two client groups, against two cores inside every operation, on the paper workload.

`bench/engine.py` runs the compiled vectorized engine with torch's intra-op threads: every convolution
of the ten stacked LeNet-5 models is split over both cores. The operations are small (channel counts
1 -> 6 -> 16, batch 32 per model), so the split costs synchronisation on every operation. The other way
to use two cores is to give each core its own clients: two engines with one thread each, each training
half of the round's cohort (or scoring half of the models), at the same time from two Python threads
(PyTorch's operators and the compiled kernels run outside the GIL).

Variants, each timed in rotating order in one process (round 0, which compiles, left out):

  intra     one engine, `torch.set_num_threads(T)`: what a run does today
  one       one engine, one thread: the single-core figure the others are read against
  split     T engines with one thread each, the cohort cut into T contiguous groups, run concurrently

The bits of `split` are checked against `one` per model (the same clients, starts and seeds, a smaller
stack; the exit status is 1 when they differ), and `intra` against `one`.

    python bench/client_threads.py --epochs 2 --rounds 4 --eval-reps 2
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
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


def _in_threads(pool: ThreadPoolExecutor, calls: list, together: bool = True) -> list:
    """Run each call in a pool thread with one torch thread there: at the same time, or (`together` off:
    compiling) one after the other."""
    def one_thread(call):
        torch.set_num_threads(1)            # this thread's OpenMP setting (the setting is per thread)
        return call()
    if not together:
        return [pool.submit(one_thread, c).result() for c in calls]
    return [f.result() for f in [pool.submit(one_thread, c) for c in calls]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2,
                    help="T: intra-op threads of `intra`, client groups of `split`")
    ap.add_argument("--per-round", type=int, default=10)
    ap.add_argument("--eval-reps", type=int, default=2, help="evaluations of 100 models on the 10k test set")
    ap.add_argument("--quick", action="store_true", help="20 clients of 200 samples, E=1, no compile")
    a = ap.parse_args(argv)
    T = a.threads
    ns = argparse.Namespace(clients=20 if a.quick else 100, partition="dirichlet", alpha=0.1, seed=0,
                            test_samples=1000 if a.quick else 0, max_train=200 if a.quick else 0)
    fed, src = build_federation(ns)
    cfg = LocalConfig(epochs=1 if a.quick else a.epochs, batch_size=32, lr=0.01, momentum=0.9)
    model = build_model("lenet5", (1, 32, 32), 10, seed=0)
    def make() -> VectorizedEngine:         # each engine its own model: functional_call swaps its parameters
        return VectorizedEngine(fed, copy.deepcopy(model), cfg, 0, "cpu", compile=not a.quick, rounds=100)
    pool = ThreadPoolExecutor(T)
    torch.set_num_threads(T)
    intra = make()
    torch.set_num_threads(1)
    one, groups = make(), [make() for _ in range(T)]
    print(f"# client-thread bench  torch {torch.__version__}  T={T}  data {src}  E={cfg.epochs}  "
          f"{a.per_round} clients a round", flush=True)

    def run(name: str, job: TrainJob, rnd: int):
        if name == "intra":
            torch.set_num_threads(T)
            return intra.train(job, rnd)
        torch.set_num_threads(1)
        if name == "one":
            return one.train(job, rnd)
        parts = np.array_split(np.arange(len(job.clients)), T)
        res = _in_threads(pool, [lambda e=e, p=p: e.train(_part(job, p), rnd) for e, p in zip(groups, parts)],
                          together=rnd > 0)   # round 0 compiles each group's engine alone
        return torch.cat([r.params for r in res]), torch.cat([r.loss for r in res])

    w0, rng = flatten(model), np.random.default_rng(0)
    times: dict[str, list[float]] = {k: [] for k in ("intra", "one", "split")}
    same = {"split": True, "intra": True}
    for r in range(a.rounds):
        clients = np.sort(rng.choice(fed.num_clients, a.per_round, replace=False))
        job = TrainJob(clients, w0.expand(len(clients), -1).clone())
        names = list(times)[r % 3:] + list(times)[:r % 3]
        res = {}
        for k in names:
            t = time.perf_counter()
            out = run(k, job, r)
            res[k] = out if k == "split" else (out.params, out.loss)
            if r > 0:
                times[k].append(time.perf_counter() - t)
        for k in ("split", "intra"):
            d = float((res[k][0] - res["one"][0]).detach().abs().max())
            same[k] &= d == 0 and torch.equal(res[k][1], res["one"][1])
            print(f"round {r}: {k} vs one: max |dW| {d:.3g}", flush=True)
    base = statistics.median(times["one"])
    for k, v in times.items():
        m = statistics.median(v)
        print(f"train {k:>5}: median round {m:.3f} s, {base / m:.2f}x one thread's speed"
              f"{'' if k == 'one' else ', same bits as one' if same[k] else ', other rounding'}")
    if a.eval_reps:
        _evaluation(one, intra, groups, pool, res["one"][0], fed.num_clients, a.eval_reps, T)
    return 0 if same["split"] else 1


def _part(job: TrainJob, rows: np.ndarray) -> TrainJob:
    return TrainJob(job.clients[rows], job.start[torch.as_tensor(rows)].clone())


def _evaluation(one, intra, groups, pool, trained, n: int, reps: int, T: int) -> None:
    """The same n models (the last round's, cycled) scored on the global test set, per variant."""
    W = trained[torch.arange(n) % len(trained)]
    every = np.arange(n)
    parts = np.array_split(every, T)

    def run(name, together=True):
        if name == "intra":
            torch.set_num_threads(T)
            return intra.evaluate(W, every, "global").accuracy
        torch.set_num_threads(1)
        if name == "one":
            return one.evaluate(W, every, "global").accuracy
        return torch.cat([r.accuracy for r in _in_threads(
            pool, [lambda e=e, p=p: e.evaluate(W[torch.as_tensor(p)], p, "global")
                   for e, p in zip(groups, parts)], together)])

    for name in ("intra", "one"):
        run(name)                            # warm-up (compilation)
    run("split", together=False)             # each group's engine compiled alone
    times: dict[str, list[float]] = {k: [] for k in ("intra", "one", "split")}
    acc = {}
    for r in range(reps):
        for k in list(times)[r % 3:] + list(times)[:r % 3]:
            t = time.perf_counter()
            acc[k] = run(k)
            times[k].append(time.perf_counter() - t)
    base = statistics.median(times["one"])
    for k, v in times.items():
        m = statistics.median(v)
        d = float((acc[k] - acc["one"]).abs().max())
        print(f"eval  {k:>5}: median of {n} models x 10k {m:.3f} s, {base / m:.2f}x one thread's speed, "
              f"largest accuracy change against one {d:.4f}")


if __name__ == "__main__":
    sys.exit(main())
