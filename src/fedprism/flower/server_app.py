"""The fedprism ServerApp: any fedprism algorithm's plan / aggregate over Flower's Grid (Message API).

    @app.main()  ->  serve(grid, run_config)
        1. settings from the run config (experiment, db, min-nodes, min-replies, timeouts, ...)
        2. identity: wait (bounded) until `min-nodes` nodes told us their persistent client id
        3. FlowerExperiment(...).run(): the runner's loop -- sampling, `algo.plan` (one start vector
           per client), train messages, validation, `algo.aggregate`, evaluation on the nodes, store
           writes and a checkpoint after every round; a restarted ServerApp resumes from it

`app` reads its settings from the run config (`flwr run ... -c 'experiment="..." db="/abs/x.db"'`);
`make_server_app(**defaults)` gives defaults for runs without one (Python `run_simulation`).
"""

from __future__ import annotations

from typing import Any

import torch
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedprism.experiment.runner import RunResult
from fedprism.experiment.store import Store
from fedprism.flower.server import FlowerExperiment, Link, _log
from fedprism.flower.settings import RunSettings, flower_run_id


def serve(grid: Grid, run_config: dict[str, Any]) -> RunResult:
    """Run (or resume) the configured experiment on the nodes behind `grid`; results go to the store."""
    s = RunSettings.from_run_config(run_config)
    store = Store(s.db)
    try:
        run_id = flower_run_id(s.cfg)
        row = store.run(run_id)
        if row is not None and row["status"] == "finished":
            _log(f"run {run_id} is already finished in {s.db}; nothing to do")
            return FlowerExperiment.finished(store, run_id)
        link = Link(grid, s.cfg["clients"], s.cfg.run_id, s.poll_interval, s.probe_timeout)
        _log(f"run {run_id}: {s.cfg['method']} on {s.cfg['dataset']}, {s.cfg['clients']} clients, "
             f"{s.cfg['rounds']} rounds; waiting for {s.min_nodes} node(s) (at most {s.nodes_timeout:g}s)")
        link.discover(s.min_nodes, s.nodes_timeout)
        exp = FlowerExperiment(s, store, link)
        res = exp.run(stop_after=s.stop_after or None)
        _log(f"run {run_id} {res.status}" + (f" (resumed after round {res.resumed_from})"
                                              if res.resumed_from is not None else "")
             + (f": local_acc {res.final['local_acc']:.4f}" if "local_acc" in res.final else ""))
        if res.status == "finished" and s.save_final:
            torch.save({"run_id": run_id, "state": exp.state}, s.save_final)
        return res
    finally:
        store.close()


def make_server_app(**defaults: Any) -> ServerApp:
    """A ServerApp whose run-config defaults are `defaults` (keys of `settings.RUN_KEYS`, `_` or `-`)."""
    defaults = {k.replace("_", "-"): v for k, v in defaults.items()}
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        serve(grid, {**defaults, **dict(context.run_config)})

    return app


#: the ServerApp that `flwr run` loads (`fedprism.flower.server_app:app`)
app = make_server_app()
