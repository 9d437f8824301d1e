"""Run any fedprism algorithm on Flower (optional extra: `pip install "fedprism[flower]"`).

    fedprism.flower.server_app:app   ServerApp: the runner's round loop over Flower's Grid; each node
                                     gets its own start vector (Fed-PRISM's per-client models)
    fedprism.flower.client_app:app   ClientApp: the algorithm's `client_update` with a sequential engine
                                     on the node's own partition; evaluation on the node
    fedprism.flower.simulation       Flower's Simulation Runtime from Python via `flwr run` (a simulation
                                     SuperLink on 127.0.0.1; Ray on loopback or a Ray cluster)
    python -m fedprism.flower        `app DIR` writes a Flower app directory for `flwr run`;
                                     `simulate` runs an experiment on the Simulation Runtime

Nothing here imports Flower until used, so `import fedprism` works without the extra. Commands and
failure semantics: docs/flower.md.
"""

from __future__ import annotations

from typing import Any

from fedprism.flower.settings import OFFLINE_ENV, RUN_KEYS, RunSettings, flower_run_id

__all__ = [
    "OFFLINE_ENV",
    "RUN_KEYS",
    "RunSettings",
    "flower_run_id",
    "make_client_app",
    "make_server_app",
    "offline_env",
    "simulate",
]


def offline_env() -> None:
    """Switch off Flower's telemetry and update check, Ray's usage stats (in this process and children)."""
    import os

    for k, v in OFFLINE_ENV.items():
        os.environ.setdefault(k, v)


def __getattr__(name: str) -> Any:
    if name == "make_server_app":
        from fedprism.flower.server_app import make_server_app
        return make_server_app
    if name == "make_client_app":
        from fedprism.flower.client_app import make_client_app
        return make_client_app
    if name == "simulate":
        from fedprism.flower.simulation import simulate
        return simulate
    raise AttributeError(f"module 'fedprism.flower' has no attribute {name!r}")
