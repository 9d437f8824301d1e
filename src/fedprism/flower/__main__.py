"""`python -m fedprism.flower app DIR ...` and `python -m fedprism.flower simulate ...` (docs/flower.md)."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from fedprism.errors import FedPrismError
from fedprism.experiment.config import parse_value
from fedprism.flower.settings import RUN_KEYS


def _kv(items: list[str]) -> dict:
    out = {}
    for it in items:
        if "=" not in it:
            raise SystemExit(f"expected key=value, got {it!r}")
        k, v = it.split("=", 1)
        out[k.strip()] = parse_value(v.strip())
    return out


def main(argv: list[str] | None = None) -> int:
    from fedprism.cli import stop_on_sigint

    stop_on_sigint()         # `... simulate &` starts with SIGINT ignored: `kill -INT` must still stop it
    ap = argparse.ArgumentParser(prog="python -m fedprism.flower", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("app", help="write a Flower app directory (pyproject.toml) for `flwr run`")
    a.add_argument("dir")
    a.add_argument("--experiment", required=True,
                   help='e.g. "method=fedprism dataset=digits clients=6 fraction=0.5 rounds=3 fedprism.k=3"')
    a.add_argument("settings", nargs="*", help="run-config key=value (db=/abs/results.db min-replies=2 ...)")
    s = sub.add_parser("simulate", help="run an experiment on Flower's Simulation Runtime with `flwr run` "
                       "(a simulation SuperLink on 127.0.0.1; Ray local or a cluster)")
    s.add_argument("--experiment", required=True)
    s.add_argument("--db", default="fedprism-results.db")
    s.add_argument("--nodes", type=int, default=None, help="virtual SuperNodes (default: clients)")
    s.add_argument("--ray-address", default=None, metavar="HOST:PORT",
                   help="run on this Ray cluster (`ray start --head` prints it; default: a local Ray on 127.0.0.1)")
    s.add_argument("--num-cpus", type=int, default=2, help="CPUs of the local Ray (ignored with --ray-address)")
    s.add_argument("--cpus-per-client", type=float, default=1, help="CPUs of each ClientApp's Ray actor (1; whole)")
    s.add_argument("--gpus-per-client", type=float, default=0.0, help="GPUs of each ClientApp's Ray actor (0)")
    s.add_argument("--timeout", type=float, default=None, help="give up after this many seconds")
    s.add_argument("--workdir", default=None, help="keep the app directory, Flower home and logs here")
    s.add_argument("--verbose", action="store_true", help="Flower's and the ClientApps' logs in full")
    s.add_argument("settings", nargs="*", help="run-config key=value (min-replies=2 round-timeout=120 ...)")
    args, extra = ap.parse_known_args(argv)     # key=value settings may follow the options
    bad = [e for e in extra if "=" not in e or e.startswith("-")]
    if bad:
        ap.error(f"unrecognized arguments: {' '.join(bad)}")
    args.settings = list(args.settings) + extra
    try:
        if args.cmd == "app":
            from fedprism.flower.app_dir import write_app
            rc = {"experiment": args.experiment, **_kv(args.settings)}
            db = str(rc.get("db", RUN_KEYS["db"].default))
            if not Path(db).is_absolute():     # else the ServerApp writes it wherever the SuperLink runs
                rc["db"] = str(Path(db).resolve())
                print(f"db: {db} is relative; the app names {rc['db']} (pass db=/absolute/path for another "
                      "machine)", file=sys.stderr)
            p = write_app(args.dir, rc)
            print(p)
        else:
            from fedprism.flower.simulation import simulate
            simulate(args.experiment, db=args.db, num_nodes=args.nodes, ray_address=args.ray_address,
                     num_cpus=args.num_cpus, cpus_per_client=args.cpus_per_client,
                     gpus_per_client=args.gpus_per_client, timeout=args.timeout, workdir=args.workdir,
                     verbose=args.verbose, **_kv(args.settings))
    except FedPrismError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, TimeoutError) as e:      # the run failed or timed out; everything started is stopped
        print(f"error: {_lines(str(e))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:                      # SIGINT / Ctrl-C: everything started is stopped
        print("\ninterrupted; run the same command again to resume (the run continues from its last "
              "checkpointed round)", file=sys.stderr)
        return 130
    return 0


def _lines(text: str) -> str:
    """`text` (it may quote the SuperLink's log) with every line printable (`fedprism.errors.printable`)."""
    from fedprism.errors import printable

    return "\n".join(printable(ln) for ln in text.splitlines())


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))     # SIGTERM: `simulate` stops what it started
    sys.exit(main())
