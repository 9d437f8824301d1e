"""`python -m fedprism.flower app DIR ...` and `python -m fedprism.flower simulate ...` (docs/flower.md)."""

from __future__ import annotations

import argparse
import sys

from fedprism.errors import FedPrismError
from fedprism.experiment.config import parse_value


def _kv(items: list[str]) -> dict:
    out = {}
    for it in items:
        if "=" not in it:
            raise SystemExit(f"expected key=value, got {it!r}")
        k, v = it.split("=", 1)
        out[k.strip()] = parse_value(v.strip())
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fedprism.flower", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("app", help="write a Flower app directory (pyproject.toml) for `flwr run`")
    a.add_argument("dir")
    a.add_argument("--experiment", required=True, help='e.g. "method=fedprism dataset=digits clients=3 rounds=3"')
    a.add_argument("settings", nargs="*", help="run-config key=value (db=/abs/results.db min-replies=2 ...)")
    s = sub.add_parser("simulate", help="run an experiment on Flower's Simulation Runtime (Ray, 127.0.0.1)")
    s.add_argument("--experiment", required=True)
    s.add_argument("--db", default="fedprism-results.db")
    s.add_argument("--nodes", type=int, default=None, help="virtual SuperNodes (default: clients)")
    s.add_argument("settings", nargs="*", help="run-config key=value (min-replies=2 round-timeout=120 ...)")
    args, extra = ap.parse_known_args(argv)     # key=value settings may follow the options
    bad = [e for e in extra if "=" not in e or e.startswith("-")]
    if bad:
        ap.error(f"unrecognized arguments: {' '.join(bad)}")
    args.settings = list(args.settings) + extra
    try:
        if args.cmd == "app":
            from fedprism.flower.app_dir import write_app
            p = write_app(args.dir, {"experiment": args.experiment, **_kv(args.settings)})
            print(p)
        else:
            from fedprism.flower.simulation import simulate
            simulate(args.experiment, db=args.db, num_nodes=args.nodes, **_kv(args.settings))
    except FedPrismError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
