"""ResNet-18 at CIFAR shape: a PFLlib-style FedAvg loop against fedprism's engines, in one process.

Workload: ResNet-18 in its CIFAR form (`resnet18`: 3x3 stem, no max-pooling, BasicBlocks [2, 2, 2, 2],
BatchNorm with running statistics; He et al. 2016, arXiv:1512.03385), 3x32x32 generated images (class means
plus noise, 10 classes), 100 clients, FedAvg: each round `--per-round` clients train E local epochs of SGD
(lr 0.01, momentum 0.9, batch `--batch`) from the global model, the server averages the model state
(parameters and running statistics, weighted by samples), and the global model is scored on every client's
local test split (what PFLlib's `evaluate` does each round).

(a) the loop written the way PFLlib does it: a deep copy of the model per client, the global state loaded
    into it, a DataLoader over a Python list of (x, y) tuples with shuffling, torch.optim.SGD, the average
    over `state_dict()` entries in Python, evaluation with a DataLoader per client in eval mode;
(b) fedprism's sequential engine (`engine=auto` on a CPU for a model of 1 M parameters or more:
    `fedprism.engine.AUTO_SEQUENTIAL_PARAMS_CPU`), FedAvg on flat vectors;
(v) fedprism's vectorized engine (eager vmap; `engine=vectorized`), the same numbers;
(m) with `--bf16`: fedprism's sequential engine with `train.precision=bfloat16 eval.precision=bfloat16`
    (opt-in mixed precision: the forward and backward passes under bf16 autocast, bf16 evaluation; the
    parameters, optimiser state and averaged vectors stay float32), against the same float32 loop (a).

The three run interleaved round by round, rotating which goes first (this machine drifts). Every round is
timed; the ratios use every round (no compilation: the engines run eager here). The workload is cut to fit
a few minutes on a loaded 2-core CPU (`--train-per-client`, `--test-per-client`, `--rounds`): ResNet-18 costs
~1.1 GFLOP per 32x32 image forward, so the time is the convolutions', whoever loops. Usage:

    .venv/bin/python bench/resnet.py                      # 2 rounds, 5 of 100 clients, CPU
    .venv/bin/python bench/resnet.py --bf16 --no-vectorized --threads 1   # (a), (b) and (m) in one run
    .venv/bin/python bench/resnet.py --device cuda --train-per-client 500 --test-per-client 100 --rounds 5
"""

from __future__ import annotations

import argparse
import copy
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from fedprism.algorithms.base import TrainJob  # noqa: E402
from fedprism.engine import AUTO_SEQUENTIAL_PARAMS_CPU, make_engine  # noqa: E402
from fedprism.engine.base import LocalConfig  # noqa: E402
from fedprism.federation import Federation  # noqa: E402
from fedprism.models import build_model  # noqa: E402
from fedprism.params import flatten  # noqa: E402


def federation(args) -> Federation:
    """Generated CIFAR-shaped data: `train_per_client` and `test_per_client` samples per client."""
    g = torch.Generator().manual_seed(args.seed)
    n_tr, n_te = args.clients * args.train_per_client, args.clients * args.test_per_client
    mu = torch.randn(10, 3, 32, 32, generator=g)
    y_tr, y_te = torch.randint(0, 10, (n_tr,), generator=g), torch.randint(0, 10, (n_te,), generator=g)
    x_tr = mu[y_tr] + torch.randn(n_tr, 3, 32, 32, generator=g)
    x_te = mu[y_te] + torch.randn(n_te, 3, 32, 32, generator=g)
    tr = np.arange(n_tr).reshape(args.clients, -1)
    te = np.arange(n_te).reshape(args.clients, -1)
    return Federation(x_tr, y_tr, x_te, y_te, list(tr), list(te), 10, name="cifar-shaped")


class PFLlibFedAvg:
    """(a): per-client modules, DataLoaders over lists of tuples, torch.optim.SGD, Python loops."""

    def __init__(self, fed: Federation, model: torch.nn.Module, cfg: LocalConfig, device: torch.device):
        self.cfg, self.device = cfg, device
        self.train_data = [[(fed.x_train[j], fed.y_train[j]) for j in idx] for idx in fed.train_idx]
        self.test_data = [[(fed.x_test[j], fed.y_test[j]) for j in idx] for idx in fed.test_idx]
        self.glob = copy.deepcopy(model).to(device)
        self.models = [copy.deepcopy(model).to(device) for _ in range(fed.num_clients)]

    def round(self, clients) -> int:
        n, states, sizes = 0, [], []
        for c in clients:
            model = self.models[int(c)]
            model.load_state_dict(self.glob.state_dict())             # receive the global model
            loader = DataLoader(self.train_data[int(c)], self.cfg.batch_size, shuffle=True)
            opt = torch.optim.SGD(model.parameters(), lr=self.cfg.lr, momentum=self.cfg.momentum)
            model.train()
            for _ in range(self.cfg.epochs):
                for x, y in loader:
                    x, y = x.to(self.device), y.to(self.device)
                    loss = F.cross_entropy(model(x), y)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    n += len(y)
            states.append(model.state_dict())
            sizes.append(len(self.train_data[int(c)]))
        total = float(sum(sizes))
        avg = {k: sum(s[k].float() * (m / total) for s, m in zip(states, sizes)) for k, v in states[0].items()
               if v.is_floating_point()}
        self.glob.load_state_dict({**self.glob.state_dict(), **avg})
        return n

    def evaluate(self) -> tuple[float, int]:
        correct, total = 0, 0
        for c, data in enumerate(self.test_data):
            model = self.models[c]
            model.load_state_dict(self.glob.state_dict())
            model.eval()
            with torch.no_grad():
                for x, y in DataLoader(data, self.cfg.batch_size, shuffle=False):
                    x, y = x.to(self.device), y.to(self.device)
                    correct += int((model(x).argmax(1) == y).sum())
                    total += len(y)
        return correct / max(1, total), total


class FedprismFedAvg:
    """(b) / (v): FedAvg on flat vectors with a fedprism engine (the round's arithmetic of `fedavg`)."""

    def __init__(self, engine, init: torch.Tensor, fed: Federation):
        self.eng, self.w, self.fed = engine, init.clone(), fed

    def round(self, clients, rnd: int) -> int:
        out = self.eng.train(TrainJob(clients, self.w.expand(len(clients), -1).clone()), rnd)
        n = out.n_samples.to(torch.float64)
        self.w = ((n[:, None] * out.params.double()).sum(0) / n.sum()).float()
        return int(out.n_samples.sum()) * self.eng.cfg.epochs

    def evaluate(self) -> tuple[float, int]:
        everyone = np.arange(self.fed.num_clients)
        r = self.eng.evaluate(self.w.expand(len(everyone), -1), everyone, "local")
        return float(r.correct.sum()) / max(1, int(r.count.sum())), int(r.count.sum())


def now(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--per-round", type=int, default=5)
    ap.add_argument("--train-per-client", type=int, default=16)
    ap.add_argument("--test-per-client", type=int, default=1)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--no-vectorized", action="store_true", help="leave out (v)")
    ap.add_argument("--vectorized-eval", action="store_true",
                    help="also time (v)'s evaluation (on the CPU it pads every client's split to 64 samples, its "
                         "row length: 64x the work at one test sample a client)")
    ap.add_argument("--bf16", action="store_true",
                    help="add (m): the sequential engine with train.precision=bfloat16 "
                         "eval.precision=bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    fed = federation(args)
    cfg = LocalConfig(epochs=args.epochs, batch_size=args.batch, lr=0.01, momentum=0.9)
    model = build_model("resnet18", (3, 32, 32), 10, seed=args.seed)
    init = flatten(model)
    params = sum(p.numel() for p in model.parameters())
    auto = make_engine("auto", fed, copy.deepcopy(model), cfg, args.seed, str(device), compile="auto",
                       rounds=args.rounds)
    print(f"# ResNet-18 (CIFAR form) bench  torch {torch.__version__}  python {platform.python_version()}  device "
          f"{device}  threads {torch.get_num_threads()}")
    print(f"# {params:,} parameters + {init.numel() - params:,} running statistics; {fed.num_clients} clients x "
          f"{args.train_per_client} train / {args.test_per_client} test samples (3x32x32, generated); "
          f"{args.per_round} clients a round, E={args.epochs}, B={args.batch}, SGD lr 0.01 momentum 0.9; "
          f"evaluation every round on all {fed.num_clients} clients' test splits")
    print(f"# engine=auto picks {auto.name} here (AUTO_SEQUENTIAL_PARAMS_CPU = {AUTO_SEQUENTIAL_PARAMS_CPU:,})")
    systems = {"a": PFLlibFedAvg(fed, model, cfg, device),
               "b": FedprismFedAvg(make_engine("sequential", fed, copy.deepcopy(model), cfg, args.seed,
                                               str(device)), init, fed)}
    if not args.no_vectorized:
        systems["v"] = FedprismFedAvg(make_engine("vectorized", fed, copy.deepcopy(model), cfg, args.seed,
                                                  str(device), compile="false"), init, fed)
    if args.bf16:
        from dataclasses import replace

        m_cfg = replace(cfg, train_precision="bfloat16", eval_precision="bfloat16")
        systems["m"] = FedprismFedAvg(make_engine("sequential", fed, copy.deepcopy(model), m_cfg, args.seed,
                                                  str(device)), init, fed)
    rng = np.random.default_rng(args.seed)
    times = {k: [] for k in systems}
    names = list(systems)
    print(f"\n{'round':>5} " + " ".join(f"{k + '.train':>8} {k + '.eval':>7} {k + '.acc':>6}" for k in names))
    for r in range(args.rounds):
        clients = np.sort(rng.choice(fed.num_clients, size=args.per_round, replace=False))
        order = names[r % len(names):] + names[:r % len(names)]
        row = {}
        for k in order:
            s = now(device)
            n = systems[k].round(clients) if k == "a" else systems[k].round(clients, r)
            t_train = now(device) - s
            s = now(device)
            acc, _ = (float("nan"), 0) if k == "v" and not args.vectorized_eval else systems[k].evaluate()
            t_eval = now(device) - s
            row[k] = (t_train, t_eval, acc, n)
            times[k].append((t_train, t_eval))
            print(f"  [round {r}] {k}: train {t_train:.1f} s, eval {t_eval:.1f} s", file=sys.stderr, flush=True)
        assert len({row[k][3] for k in names}) == 1, {k: row[k][3] for k in names}
        print(f"{r:>5} " + " ".join(f"{row[k][0]:8.2f} {row[k][1]:7.2f} {row[k][2]:6.3f}" for k in names), flush=True)
    tot = {k: (sum(t for t, _ in v), sum(e for _, e in v)) for k, v in times.items()}
    a_tr, a_ev = tot["a"]
    print("\n## all rounds")
    for k in names[1:]:
        tr, ev = tot[k]
        if k == "v" and not args.vectorized_eval:
            print(f"({k})/(a): training {a_tr / tr:5.2f}x  (evaluation not timed: --vectorized-eval)")
            continue
        print(f"({k})/(a): training {a_tr / tr:5.2f}x  evaluation {a_ev / ev:5.2f}x  end to end "
              f"{(a_tr + a_ev) / (tr + ev):5.2f}x   ((a) {a_tr + a_ev:.1f} s, ({k}) {tr + ev:.1f} s)")
    if "v" in tot:
        print(f"(b)/(v): training {tot['v'][0] / tot['b'][0]:5.2f}x (the sequential engine against the vectorized)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
