"""Flower's Simulation Runtime from Python: `simulate("method=fedprism clients=6 rounds=3", db="x.db")`.

Runs the same ServerApp and ClientApp as a deployment, with one virtual SuperNode per client
(`partition-id` = client id) on Ray, bound to 127.0.0.1 with telemetry off. Uses Flower's
`run_simulation` (deprecated in flwr 1.42 but supported, and the only in-process entry point); the
`flwr run` equivalent is in docs/flower.md.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

from fedprism.experiment.store import Store
from fedprism.flower.settings import OFFLINE_ENV, RunSettings, flower_run_id


#: Ray turns a node address of 127.0.0.1 into this machine's routable address (its
#: `resolve_ip_for_localhost`) unless multi-node clusters are disabled; with them disabled the node
#: address stays 127.0.0.1 and Ray's GCS, raylet, worker gRPC servers and runtime-env / dashboard
#: agents listen on loopback only (they bind 0.0.0.0 otherwise, whatever `_node_ip_address` says)
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def loopback_only() -> None:
    """Make the Ray started by this process (and its children) bind 127.0.0.1 only."""
    os.environ.update(LOOPBACK_ENV)
    import sys
    if "ray._private.ray_constants" in sys.modules:         # Ray imported already: its constant is read
        sys.modules["ray._private.ray_constants"].ENABLE_RAY_CLUSTER = False   # at call time


def backend_config(num_cpus: int = 2, cpus_per_client: float = 1.0) -> dict:
    """Ray on loopback only, explicit resources (Flower's default of 2 CPUs per client serialises a
    2-core machine)."""
    return {"client_resources": {"num_cpus": cpus_per_client, "num_gpus": 0.0},
            "init_args": {"num_cpus": num_cpus, "_node_ip_address": "127.0.0.1", "include_dashboard": False,
                          "log_to_driver": False}}


def simulate(experiment: str, db: str | Path = "fedprism-results.db", num_nodes: int | None = None, *,
             num_cpus: int = 2, cpus_per_client: float = 1.0, verbose: bool = False, **settings: Any) -> str:
    """Run `experiment` on Flower's Simulation Runtime; results land in the store `db`.

    `num_nodes` defaults to the experiment's `clients` (one virtual SuperNode per client); `settings`
    are further run-config keys (`min_replies=2`, `round_timeout=60`, `save_final="state.pt"`, ...).
    `min_nodes` defaults to `num_nodes`, so every client is identified before round 0. Returns the run's
    status ('finished', or 'interrupted' with `stop_after`); raises RuntimeError if it did not complete.
    """
    for k, v in OFFLINE_ENV.items():
        os.environ.setdefault(k, v)
    loopback_only()
    from fedprism.flower.client_app import make_client_app
    from fedprism.flower.server_app import make_server_app

    run_config = {"experiment": experiment, "db": str(db), **{k.replace("_", "-"): v for k, v in settings.items()}}
    s = RunSettings.from_run_config(run_config)            # validate before starting Ray
    n = int(num_nodes or s.cfg["clients"])
    run_config.setdefault("min-nodes", min(n, s.cfg["clients"]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from flwr.simulation import run_simulation
        run_simulation(server_app=make_server_app(**run_config), client_app=make_client_app(**run_config),
                       num_supernodes=n, backend_config=backend_config(num_cpus, cpus_per_client),
                       verbose_logging=verbose)
    # Flower logs a failing ServerApp or backend and returns: say so to the caller
    store = Store(db)
    try:
        row = store.run(flower_run_id(s.cfg))
        status = None if row is None else row["status"]
    finally:
        store.close()
    if status not in ("finished", "interrupted"):
        raise RuntimeError(f"the Flower simulation did not complete (run status: {status}); see the log above"
                           " (Ray needs RAY_TMPDIR short enough for its socket paths: < ~60 characters)")
    return status
