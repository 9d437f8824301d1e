"""One local training step, taken apart: forward + backward through the flat parameter vector, and the
optimiser update, each timed the old way and the current way in one process (one thread).

    .venv/bin/python bench/step_cost.py                  # lenet5 and clustpsi_fmnist_cnn, batch 32
    .venv/bin/python bench/step_cost.py --models lenet5 --steps 50

Rows, per model (the ratio is old / new, same run, interleaved):
  fwd+bwd   gradient of the loss with respect to the flat vector. old: `ParamSpec.unflatten` as one slice
            per tensor (the backward of each slice zero-fills a [P] gradient and the slices' gradients
            are added: ~10 passes over P); new: one `split` (its backward writes each gradient once).
  adam      the update of one model: old `optimizer_step` (out of place, ~a dozen passes over P),
            new `optimizer_step_` (torch's fused Adam kernel, in place).
  sgd       momentum SGD: old out of place, new in place (same bits).
Both fwd+bwd variants give the same gradient bit for bit (checked here).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from fedprism._alloc import tune_allocator  # noqa: E402
from fedprism.engine.base import LocalConfig, optimizer_state, optimizer_step, optimizer_step_  # noqa: E402
from fedprism.models import build_model  # noqa: E402
from fedprism.params import Functional, flatten  # noqa: E402

SHAPES = {"lenet5": (1, 32, 32), "clustpsi_fmnist_cnn": (1, 28, 28)}


def sliced_unflatten(spec):
    """The former `ParamSpec.unflatten`: a slice per tensor."""
    def unflatten(flat):
        lead = flat.shape[:-1]
        return {n: flat[..., spec.offsets[i]: spec.offsets[i + 1]].view(*lead, *s)
                for i, (n, s) in enumerate(zip(spec.names, spec.shapes))}
    return unflatten


def timed(fn, steps: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t) / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=list(SHAPES))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repetitions; the minimum is kept")
    ap.add_argument("--default-malloc", action="store_true",
                    help="keep glibc's default malloc thresholds (the committed table's conditions) "
                         "instead of the tuning every engine applies (fedprism._alloc)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if not args.default_malloc:
        tune_allocator()           # as every engine on construction: large blocks reused, not re-faulted
    print(f"# torch {torch.__version__}, 1 thread, batch {args.batch}, {args.steps} steps x {args.repeats}")
    print(f"{'model':22s} {'params':>10s} {'part':8s} {'old ms':>8s} {'new ms':>8s} {'old/new':>8s}")
    for name in args.models:
        model = build_model(name, SHAPES[name], 10, seed=0)
        f = Functional(model)
        w = flatten(model)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(args.batch, *SHAPES[name], generator=g)
        y = torch.randint(0, 10, (args.batch,), generator=g)
        split_unflatten, old_unflatten = f.spec.unflatten, sliced_unflatten(f.spec)

        def grad(unflatten):
            object.__setattr__(f.spec, "unflatten", unflatten)       # ParamSpec is a frozen dataclass
            wr = w.detach().requires_grad_(True)
            (gr,) = torch.autograd.grad(F.cross_entropy(f(wr, x), y), wr)
            object.__setattr__(f.spec, "unflatten", split_unflatten)
            return gr

        assert torch.equal(grad(old_unflatten), grad(split_unflatten))
        gw = grad(split_unflatten)
        adam = LocalConfig(optimizer="adam", lr=1e-3)
        sgd = LocalConfig(optimizer="sgd", lr=0.01, momentum=0.9)
        wa, sa, wb, sb = w.clone(), optimizer_state(adam, w), w.clone(), optimizer_state(adam, w)
        ws, ss, wt, stt = w.clone(), optimizer_state(sgd, w), w.clone(), optimizer_state(sgd, w)
        parts = {
            "fwd+bwd": (lambda: grad(old_unflatten), lambda: grad(split_unflatten)),
            "adam": (lambda: optimizer_step(wa, gw, sa, adam), lambda: optimizer_step_(wb, gw, sb, adam)),
            "sgd": (lambda: optimizer_step(ws, gw, ss, sgd), lambda: optimizer_step_(wt, gw, stt, sgd)),
        }
        for part, (old, new) in parts.items():
            t_old, t_new = float("inf"), float("inf")
            for _ in range(args.repeats):
                t_old = min(t_old, timed(old, args.steps))
                t_new = min(t_new, timed(new, args.steps))
            print(f"{name:22s} {w.numel():>10,d} {part:8s} {1e3 * t_old:8.2f} {1e3 * t_new:8.2f} "
                  f"{t_old / t_new:7.2f}x")


if __name__ == "__main__":
    main()
