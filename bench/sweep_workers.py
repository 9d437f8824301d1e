"""Wall time of a 4-run sweep with `--workers 1` and `--workers 2`, in one run (ratios, not absolutes).

    python bench/sweep_workers.py [--rounds 20] [--clients 20]

Each run is a small real experiment (digits, MLP, sequential engine) so that process start-up is a
small part of it. Prints both wall times and their ratio; the claim in bench/README.md comes from here.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from fedprism.experiment.sweep import dump_sweep, run_sweep


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--epochs", type=int, default=5)
    a = ap.parse_args()
    sweep = dump_sweep("bench_workers", dict(dataset="digits", clients=a.clients, rounds=a.rounds, fraction=0.5,
                                             local_epochs=a.epochs, model="mlp", engine="sequential"),
                       [dict(label="FedAvg", method="fedavg"),
                        dict(label="Fed-PRISM", method="fedprism", fedprism={"k": 2, "m": 1})], {"seed": [0, 1]})
    out = {}
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "s.toml"
        f.write_text(sweep)
        for workers in (1, 2):
            t0 = time.time()
            run_sweep(str(f), str(Path(d) / f"w{workers}.db"), progress=False, workers=workers)
            out[workers] = time.time() - t0
    print(f"4-run sweep: --workers 1 {out[1]:.1f}s, --workers 2 {out[2]:.1f}s, ratio {out[2] / out[1]:.2f}")


if __name__ == "__main__":
    main()
