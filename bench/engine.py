"""Engine benchmark: the FedPrism paper workload, PFLlib-style reference vs fedprism's VectorizedEngine.

Workload (FedPrism paper, arXiv:2603.08252, section 4): Fashion-MNIST padded to 32x32, 100 clients,
Dirichlet(alpha=0.1) label skew, 10 clients per round, E=10 local epochs, batch 32, SGD lr 0.01
momentum 0.9, LeNet-5; every round all 100 personalized models (the Local method: every client keeps
its own model) are evaluated on their clients' local test splits and on the 10k global test set.

(a) reference written here the way PFLlib does it: one nn.Module per client (deepcopy), a DataLoader
    over a Python list of (x, y) tuples with shuffling, torch.optim.SGD, Python loops for training and
    evaluation (batch 32, no_grad).
(b) fedprism.engine.vectorized.VectorizedEngine (compiled vmap over LPT slots / stacked models).

(a) and (b) run interleaved round by round in one process (the machine drifts by +-30% over
minutes), alternating which goes first. Round 0 includes (b)'s compilation; throughput figures use
rounds >= 1 and the compile overhead is reported separately. Usage:

    .venv/bin/python bench/engine.py                 # 3 rounds, CPU, the default kernels (`auto`)
    .venv/bin/python bench/engine.py --quick         # smoke test, < 60 s, no compile
    .venv/bin/python bench/engine.py --device cuda   # when CUDA exists
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from fedprism.algorithms.base import TrainJob  # noqa: E402
from fedprism.engine.base import LocalConfig  # noqa: E402
from fedprism.engine.vectorized import VectorizedEngine  # noqa: E402
from fedprism.federation import Federation  # noqa: E402
from fedprism.models import build_model  # noqa: E402
from fedprism.params import flatten  # noqa: E402


# -- data ---------------------------------------------------------------------------------------
def build_federation(args) -> tuple[Federation, str]:
    try:
        from fedprism.data.datasets import load_dataset
        from fedprism.data.partition import make_partition

        ds = load_dataset("fmnist", pad32=True)
        x_tr, y_tr, x_te, y_te, src = ds.x_train, ds.y_train, ds.x_test, ds.y_test, f"fmnist ({ds.source})"
    except Exception as e:  # noqa: BLE001 - a benchmark still runs without the data files
        print(f"[data] Fashion-MNIST not available ({type(e).__name__}: {e}); using random 32x32 data")
        g = torch.Generator().manual_seed(args.seed)
        y_tr, y_te = torch.randint(0, 10, (60000,), generator=g), torch.randint(0, 10, (10000,), generator=g)
        x_tr, x_te = torch.randn(60000, 1, 32, 32, generator=g), torch.randn(10000, 1, 32, 32, generator=g)
        src, make_partition = "random", None
    if args.test_samples and args.test_samples < len(y_te):
        x_te, y_te = x_te[: args.test_samples], y_te[: args.test_samples]
    if make_partition is not None:
        p = make_partition(args.partition, y_tr.numpy(), y_te.numpy(), args.clients, args.seed, alpha=args.alpha)
        train_idx, test_idx = [np.asarray(i) for i in p.train], [np.asarray(i) for i in p.test]
    else:
        rng = np.random.default_rng(args.seed)
        tr = np.array_split(rng.permutation(len(y_tr)), args.clients)
        te = np.array_split(rng.permutation(len(y_te)), args.clients)
        train_idx, test_idx = list(tr), list(te)
    if args.max_train:
        train_idx = [i[: args.max_train] for i in train_idx]
    return Federation(x_tr, y_tr, x_te, y_te, train_idx, test_idx, 10, name="fmnist"), src


# -- (a) the PFLlib-style reference ---------------------------------------------------------------
class PFLlibReference:
    """Per-client nn.Modules, DataLoaders over lists of tuples, torch.optim.SGD, Python loops."""

    def __init__(self, fed: Federation, model: torch.nn.Module, cfg: LocalConfig, device: torch.device):
        self.cfg, self.device = cfg, device
        cpu = Federation(fed.x_train.cpu(), fed.y_train.cpu(), fed.x_test.cpu(), fed.y_test.cpu(),
                         fed.train_idx, fed.test_idx, fed.num_classes)
        # PFLlib reads each client's data into a list of (x, y) tuples once
        self.train_data = [[(cpu.x_train[j], cpu.y_train[j]) for j in idx] for idx in cpu.train_idx]
        self.test_data = [[(cpu.x_test[j], cpu.y_test[j]) for j in idx] for idx in cpu.test_idx]
        self.global_test = list(zip(cpu.x_test, cpu.y_test))
        self.models = [copy.deepcopy(model).to(device) for _ in range(fed.num_clients)]
        self.loss = torch.nn.CrossEntropyLoss()

    def train(self, clients) -> int:
        n = 0
        for c in clients:
            model = self.models[int(c)]
            loader = DataLoader(self.train_data[int(c)], self.cfg.batch_size, drop_last=False, shuffle=True)
            opt = torch.optim.SGD(model.parameters(), lr=self.cfg.lr, momentum=self.cfg.momentum,
                                  weight_decay=self.cfg.weight_decay)
            model.train()
            for _ in range(self.cfg.epochs):
                for x, y in loader:
                    x, y = x.to(self.device), y.to(self.device)
                    loss = self.loss(model(x), y)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    n += len(y)
        return n

    def evaluate(self, clients, split: str) -> tuple[np.ndarray, int]:
        accs, n = [], 0
        for c in clients:
            model = self.models[int(c)]
            data = self.global_test if split == "global" else self.test_data[int(c)]
            loader = DataLoader(data, self.cfg.batch_size, drop_last=False, shuffle=True)
            model.eval()
            correct, total, loss = 0, 0, 0.0
            with torch.no_grad():
                for x, y in loader:
                    x, y = x.to(self.device), y.to(self.device)
                    out = model(x)
                    correct += int((out.argmax(1) == y).sum())
                    loss += float(F.cross_entropy(out, y, reduction="sum"))
                    total += len(y)
            accs.append(correct / max(1, total))
            n += total
        return np.array(accs), n


# -- helpers ------------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def now(device: torch.device) -> float:
    sync(device)
    return time.perf_counter()


def gemm_peak(device: torch.device, n: int = 1024, reps: int = 20) -> float:
    """fp32 sgemm GFLOP/s measured now (best of 3), to put absolute samples/s in context."""
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    best = 0.0
    for _ in range(3):
        t = now(device)
        for _ in range(reps):
            a @ b
        dt = now(device) - t
        best = max(best, 2 * n**3 * reps / dt / 1e9)
    return best


def fmt_s(sec: float) -> str:
    return f"{sec / 60:.1f} min" if sec >= 120 else f"{sec:.1f} s"


def _width(train: str, fused_eval: bool) -> str:
    """The fused kernels' vector width, where (b) or (bf) uses them (16 floats: AVX-512; 8: AVX2)."""
    if train == "aten" and not fused_eval:
        return ""
    from fedprism.kernels import build, fused

    n = fused.vector_floats()
    return (f" (fused kernels: {n}-float vectors)" if n
            else f" (fused kernels not loaded: {build.unavailable_reason()})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds (round 0 includes compilation)")
    ap.add_argument("--quick", action="store_true", help="tiny smoke version (< 60 s)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    ap.add_argument("--compile", default=None, help="auto/true/false (default: true; false with --quick)")
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--per-round", type=int, default=10, help="clients sampled per round")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--alpha", type=float, default=0.1)
    ap.add_argument("--partition", default="dirichlet", choices=("dirichlet", "dirichlet_per_class"),
                    help="dirichlet: per client over classes, equal sizes (FedPrism paper); dirichlet_per_class: "
                         "per class over clients, unequal sizes (PFLlib 'dir', exercises LPT slots)")
    ap.add_argument("--full-rounds", type=int, default=100, help="rounds of the projected full run")
    ap.add_argument("--test-samples", type=int, default=0, help="use only the first N global test samples")
    ap.add_argument("--max-train", type=int, default=0, help="cap samples per client")
    ap.add_argument("--ref-eval-models", type=int, default=25,
                    help="models (a) evaluates per round; its time is scaled to all models (a loop is linear "
                         "in models). 0: all")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bf16-eval", action="store_true",
                    help="also score every model with a second engine at eval.precision=bfloat16 (b16), timed "
                         "right after (b)'s evaluation: its ratio to (a) and (b) and the largest accuracy change")
    ap.add_argument("--kernels", default="auto", choices=("auto", "aten", "fused"),
                    help="(b)'s train.kernels and eval.kernels, resolved as a run's are (fedprism.kernels."
                         "resolve; auto, the default path: fused where they are built for this CPU, else aten; "
                         "fused: the fused conv blocks, fedprism.kernels.fused)")
    ap.add_argument("--fused-eval", action="store_true",
                    help="also score every model with a second engine at eval.kernels=fused (bf: the fused "
                         "conv blocks, fedprism.kernels.fused), timed right after (b)'s evaluation: its "
                         "ratio to (a) and (b) and the largest accuracy change")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds = min(args.rounds, 2)
        args.clients, args.per_round, args.epochs = 20, 4, 1
        args.test_samples, args.max_train = args.test_samples or 1000, args.max_train or 200
        args.compile = args.compile or "false"
    compile_opt = args.compile or "true"
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here")
        return 2

    torch.manual_seed(args.seed)
    fed, src = build_federation(args)
    from fedprism.kernels import resolve as resolve_kernels

    train_k = resolve_kernels("train.kernels", args.kernels, str(device))
    eval_k = resolve_kernels("eval.kernels", args.kernels, str(device))
    cfg = LocalConfig(epochs=args.epochs, batch_size=args.batch, lr=0.01, momentum=0.9,
                      train_kernels=train_k, eval_kernels=eval_k)
    model = build_model("lenet5", (1, 32, 32), 10, seed=args.seed)
    n_tr = fed.n_train
    from fedprism.experiment.provenance import cpu_model
    from fedprism.machine import cpu_flags

    isa = [f for f in ("avx512f", "avx2") if f in (cpu_flags() or ())]
    print(f"# fedprism engine bench  torch {torch.__version__}  python {platform.python_version()}  "
          f"device {device}  threads {torch.get_num_threads()}  cpu {cpu_model()} ({', '.join(isa) or 'no AVX'})")
    print(f"# data {src}; {fed.num_clients} clients, {args.partition} alpha={args.alpha}: train sizes "
          f"min/median/max {n_tr.min()}/{int(np.median(n_tr))}/{n_tr.max()}, global test {len(fed.y_test)}, "
          f"local test total {fed.n_test.sum()}")
    print(f"# {args.per_round} clients/round, E={args.epochs}, B={args.batch}, SGD lr 0.01 momentum 0.9, "
          f"LeNet-5; evaluation every round of all {fed.num_clients} personalized models; "
          f"compile={compile_opt}; (b) kernels={args.kernels}: train {train_k}, eval {eval_k}"
          + _width(train_k, args.fused_eval))
    peaks = [gemm_peak(device)]          # measured again after every round: the floor below uses their median
    print(f"# fp32 GEMM peak now: {peaks[0]:.0f} GFLOP/s")

    ref = PFLlibReference(fed, model, cfg, device)
    t0 = time.perf_counter()
    eng = VectorizedEngine(fed, model, cfg, args.seed, device, compile=compile_opt, rounds=args.full_rounds)
    setup_b = time.perf_counter() - t0
    eng16 = VectorizedEngine(fed, model, dataclasses.replace(cfg, eval_precision="bfloat16"), args.seed, device,
                             compile=compile_opt, rounds=args.full_rounds) if args.bf16_eval else None
    d16: list[float] = []
    engf = VectorizedEngine(fed, model, dataclasses.replace(cfg, eval_kernels="fused"), args.seed, device,
                            compile=compile_opt, rounds=args.full_rounds) if args.fused_eval else None
    dfu: list[float] = []
    W = flatten(model).to(device).expand(fed.num_clients, -1).clone()
    everyone = np.arange(fed.num_clients)
    n_ref = args.ref_eval_models if 0 < args.ref_eval_models < fed.num_clients else fed.num_clients
    ref_models = np.sort(np.random.default_rng(args.seed + 1).choice(fed.num_clients, n_ref, replace=False))
    scale = fed.num_clients / n_ref
    rng = np.random.default_rng(args.seed)
    rows = []
    print(f"\n{'round':>5} {'a.train':>8} {'b.train':>8} {'a.eval':>8} {'b.eval':>8} {'b.eval10':>8}"
          f" {'a.local':>7} {'b.local':>7} {'a.glob':>7} {'b.glob':>7}")
    print(f"(seconds per round; a.eval is (a)'s time for {n_ref} models x {scale:g}; accuracies: mean over "
          f"those {n_ref} models)")
    for r in range(args.rounds):
        clients = np.sort(rng.choice(fed.num_clients, size=args.per_round, replace=False))
        order = ("a", "b") if r % 2 == 0 else ("b", "a")
        t = {}
        for who in order:                                  # training, interleaved
            s = now(device)
            if who == "a":
                n_a = ref.train(clients)
            else:
                up = eng.train(TrainJob(clients, W[torch.as_tensor(clients)].clone()), r)
                W[torch.as_tensor(clients)] = up.params.to(device)
                n_b = int(up.n_samples.sum()) * args.epochs
            t[who + "train"] = now(device) - s
            print(f"  [round {r}] {who}.train {t[who + 'train']:.1f} s", file=sys.stderr, flush=True)
        assert n_a == n_b, (n_a, n_b)
        for who in order:                                  # evaluation of all personalized models
            s = now(device)
            if who == "a":
                la, ea = ref.evaluate(ref_models, "local")
                ga, eg = ref.evaluate(ref_models, "global")
                e_a = ea + eg
            else:
                lr_ = eng.evaluate(W, everyone, "local")
                gr = eng.evaluate(W, everyone, "global")
                e_b = int(lr_.count.sum() + gr.count.sum())
            t[who + "eval"] = now(device) - s
            print(f"  [round {r}] {who}.eval {t[who + 'eval']:.1f} s", file=sys.stderr, flush=True)
            if who == "b" and eng16 is not None:            # the same models and splits in bf16
                s = now(device)
                l16, g16 = eng16.evaluate(W, everyone, "local"), eng16.evaluate(W, everyone, "global")
                t["beval16"] = now(device) - s
                d16.append(max((l16.accuracy - lr_.accuracy).abs().max().item(),
                               (g16.accuracy - gr.accuracy).abs().max().item()))
            if who == "b" and engf is not None:            # the same models and splits, fused kernels
                s = now(device)
                lf, gf = engf.evaluate(W, everyone, "local"), engf.evaluate(W, everyone, "global")
                t["bevalf"] = now(device) - s
                dfu.append(max((lf.accuracy - lr_.accuracy).abs().max().item(),
                               (gf.accuracy - gr.accuracy).abs().max().item()))
        t["aeval"] *= scale          # (a) evaluated n_ref models; scale to all of them
        # (b) with exact evaluation caching (Local): only this round's trained models change
        s = now(device)
        sub = W[torch.as_tensor(clients)]
        eng.evaluate(sub, clients, "local")
        eng.evaluate(sub, clients, "global")
        t["beval10"] = now(device) - s
        sel = torch.as_tensor(ref_models)
        assert e_a == int(lr_.count[sel].sum() + gr.count[sel].sum()), (e_a, e_b)
        acc = (la.mean(), lr_.accuracy[sel].mean().item(), ga.mean(), gr.accuracy[sel].mean().item())
        rows.append((t, n_a, e_b))
        peaks.append(gemm_peak(device))
        print(f"{r:>5} {t['atrain']:8.2f} {t['btrain']:8.2f} {t['aeval']:8.2f} {t['beval']:8.2f}"
              f" {t['beval10']:8.2f} {acc[0]:7.3f} {acc[1]:7.3f} {acc[2]:7.3f} {acc[3]:7.3f}", flush=True)

    meas = rows[1:] if len(rows) > 1 else rows
    tot = {k: sum(r[0][k] for r in meas) for k in rows[0][0]}
    n_train = sum(r[1] for r in meas)
    n_eval = sum(r[2] for r in meas)
    k = len(meas)
    tr_a, tr_b = n_train / tot["atrain"], n_train / tot["btrain"]
    ev_a, ev_b = n_eval / tot["aeval"], n_eval / tot["beval"]
    per_a = (tot["atrain"] + tot["aeval"]) / k
    per_b = (tot["btrain"] + tot["beval"]) / k
    per_bc = (tot["btrain"] + tot["beval10"]) / k
    warm = rows[0][0]
    compile_s = max(0.0, (warm["btrain"] + warm["beval"] + warm["beval10"]) - per_b - tot["beval10"] / k) \
        if len(rows) > 1 else float("nan")
    R = args.full_rounds
    print(f"\n## rounds used for throughput: {'1..' + str(len(rows) - 1) if len(rows) > 1 else '0'}")
    print(f"training    samples/s  (a) {tr_a:9,.0f}   (b) {tr_b:9,.0f}   ratio (b)/(a) {tr_b / tr_a:5.2f}x")
    print(f"evaluation  samples/s  (a) {ev_a:9,.0f}   (b) {ev_b:9,.0f}   ratio (b)/(a) {ev_b / ev_a:5.2f}x")
    print(f"per round   seconds    (a) {per_a:9.2f}   (b) {per_b:9.2f}   end-to-end ratio {per_a / per_b:5.2f}x")
    for name, key, diffs, side in (("b16", "beval16", d16, eng16), ("bf", "bevalf", dfu, engf)):
        if side is None:            # the second evaluation engine of --bf16-eval / --fused-eval
            continue
        ev2 = n_eval / tot[key]
        per2 = (tot["btrain"] + tot[key]) / k
        print(f"evaluation  samples/s  ({name}) {ev2:9,.0f}   ratio ({name})/(a) {ev2 / ev_a:5.2f}x   "
              f"({name})/(b) {ev2 / ev_b:5.2f}x   end-to-end (a)/({name}) {per_a / per2:5.2f}x   largest change "
              f"of a model's accuracy against (b): {max(diffs):.4f}")
    print(f"(b) one-time overhead: engine setup {setup_b:.1f} s + compilation/warm-up in round 0 "
          f"~{compile_s:.1f} s")
    full_a = R * per_a
    full_b = setup_b + compile_s + R * per_b
    full_bc = setup_b + compile_s + R * per_bc
    print(f"projected {R}-round run: (a) {fmt_s(full_a)}   (b) {fmt_s(full_b)}  ({full_a / full_b:.2f}x incl. "
          f"compile)   (b)+eval caching (Local: {args.per_round} models re-evaluated/round) {fmt_s(full_bc)} "
          f"({full_a / full_bc:.2f}x)")
    # the arithmetic floor: a round's convolution and linear FLOPs (a training sample costs 3 forward
    # passes) at the fp32 GEMM rate this machine reached during the run (median of the per-round peaks)
    peak = statistics.median(peaks) * 1e9
    f_tr, f_ev = 3 * eng.fwd_flops * n_train / k, eng.fwd_flops * n_eval / k
    floor_b = setup_b + compile_s + R * (f_tr + f_ev) / peak
    print(f"arithmetic floor: {f_tr / 1e9:.0f} GFLOP training + {f_ev / 1e9:.0f} GFLOP evaluation a round; at the "
          f"median fp32 GEMM peak of the run ({peak / 1e9:.0f} GFLOP/s; {min(peaks):.0f}-{max(peaks):.0f}) "
          f"a round takes {(f_tr + f_ev) / peak:.2f} s, the {R}-round run {fmt_s(floor_b)}; (b) reaches "
          f"{f_tr / peak / (tot['btrain'] / k):.0%} of it in training, {f_ev / peak / (tot['beval'] / k):.0%} "
          f"in evaluation")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    extra = f", peak CUDA memory {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB" if device.type == "cuda" else ""
    print(f"peak RSS {rss:.0f} MiB{extra}; engine: {'compiled' if eng.compiled else 'eager'}, "
          f"eval chunk {eng.eval_models} models x {eng.eval_samples} samples, slots used {sorted(eng._slot_graphs)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
