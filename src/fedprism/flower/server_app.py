"""The fedprism ServerApp: any fedprism algorithm's plan / aggregate over Flower's Grid (Message API).

    @app.main()  ->  serve(grid, run_config)
        1. settings from the run config (experiment, db, min-nodes, min-replies, timeouts, ...)
        2. what the run's data and model are (input shape, classes, model size: `spec.server_spec`),
           from the server's own configuration, before any node is contacted
        3. identity: wait (bounded) until `min-nodes` nodes told us their persistent client id; a node
           whose identity disagrees with the spec is refused alone
        4. FlowerExperiment(...).run(): the runner's loop -- sampling, `algo.plan` (one start vector
           per client), train messages, validation, `algo.aggregate`, evaluation on the nodes, store
           writes and a checkpoint after every round; a restarted ServerApp resumes from it

`app` reads its settings from the run config (`flwr run ... -c 'experiment="..." db="/abs/x.db"'`);
`make_server_app(**defaults)` gives defaults for runs without one (tests drive it over an in-process grid).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedprism.errors import ConfigError
from fedprism.experiment.limits import check_limits
from fedprism.data.drift import class_counts
from fedprism.experiment.build import drift_schedule, make_model
from fedprism.experiment.runner import RunResult
from fedprism.experiment.store import Store, drop_if_new_and_empty
from fedprism.flower.server import NO_DRIFT_WITHOUT_DATA, FlowerExperiment, Link, ServerDrift, _log
from fedprism.flower.settings import RunSettings
from fedprism.flower.spec import server_spec
from fedprism.flower.trust import load_registry


def server_data(s: RunSettings):
    """What the server may hold of the data: (a federation with only the public shared splits -- the
    global test set and the global validation set -- or None; the largest training split the
    experiment's partition gives a client or None; the size of every client's split, {'train': [N],
    'local': [N], 'val': [N], 'global': n, 'global_val': n}, or None; under class drift (`drift.*`) the
    run's schedule with every client's per-class split counts (`ServerDrift`), else None; the run's
    input shape, classes and model size (`RunSpec`), always). Built like a node builds it (same
    experiment, same deterministic partition) when the dataset is readable on the server; the clients'
    rows are dropped. Without the dataset the spec comes from the dataset's published format
    (`spec.published_shape`); a registered dataset the server cannot read, and class drift without the
    dataset, are a ConfigError (naming `dataset`, `drift.fraction`)."""
    try:
        from fedprism.experiment import federation as fedmod
        from fedprism.federation import Federation

        fed = fedmod.build_federation(s.cfg)
    except Exception as e:  # noqa: BLE001 - no data on the server: the nodes score, no default cap
        _log(f"the dataset is not readable on the server ({type(e).__name__}: {e})")
        if s.cfg.get("drift.fraction", 0.0):
            raise ConfigError("drift.fraction", s.cfg["drift.fraction"], NO_DRIFT_WITHOUT_DATA) from e
        return None, None, None, None, server_spec(s.cfg)
    biggest = int(max(len(ix) for ix in fed.train_idx)) if len(fed.train_idx) else 0
    sizes = {"train": np.array([len(ix) for ix in fed.train_idx]), "local": np.array([len(ix) for ix in fed.test_idx]),
             "global": len(fed.y_test)}
    if fed.val_idx is not None:
        sizes["val"] = np.array([len(ix) for ix in fed.val_idx])
    if fed.y_val is not None:
        sizes["global_val"] = len(fed.y_val)
    # the size keys against the data and this machine, before waiting for any node
    model = make_model(s.cfg, fed.input_shape, fed.num_classes, fed.vocab_size)
    check_limits(s.cfg, sizes["train"], sum(p.numel() for p in model.parameters()))
    spec = server_spec(s.cfg, fed.input_shape, fed.num_classes, model)
    schedule = drift_schedule(s.cfg, fed)              # the nodes and the in-process runner draw the same
    drift = None if schedule is None else ServerDrift(schedule, class_counts(fed))
    N = fed.num_clients
    empty = np.zeros(0, dtype=np.int64)
    shared = Federation(fed.x_train[:0].clone(), fed.y_train[:0].clone(), fed.x_test, fed.y_test, [empty] * N,
                        [empty] * N, fed.num_classes, list(fed.class_names), fed.name, dict(fed.meta),
                        None if fed.val_idx is None else [empty] * N, fed.x_val, fed.y_val,
                        vocab_size=fed.vocab_size)
    del fed
    fedmod.clear_federations()
    return (shared if s.global_eval == "server" else None), biggest, sizes, drift, spec


def serve(grid: Grid, run_config: dict[str, Any]) -> RunResult:
    """Run (or resume) the configured experiment on the nodes behind `grid`; results go to the store."""
    s = RunSettings.from_run_config(run_config)
    registry = load_registry(s.registry, s.cfg["clients"]) if s.registry else None   # before the store
    created = not Path(s.db).exists()
    store = Store(s.db)
    try:
        run_id = s.run_id
        row = store.run(run_id)
        if row is not None and row["status"] == "finished":
            _log(f"run {run_id} is already finished in {s.db}; nothing to do")
            return FlowerExperiment.finished(store, run_id)
        try:
            shared, biggest, sizes, drift, spec = server_data(s)
        except ConfigError as e:
            _log(f"refused: {e}")            # one line naming the key, its value and what is allowed
            drop_if_new_and_empty(store, created)
            raise
        cap = s.max_samples or biggest
        link = Link(grid, s.cfg["clients"], s.cfg.run_id, s.poll_interval, s.probe_timeout, registry=registry,
                    max_samples=cap, spec=spec)
        where = "server" if s.global_eval == "server" and shared is not None else "nodes"
        capped = cap if cap is not None else "nothing (max-samples unset, the dataset is not readable here)"
        bound = (f"update norms bounded at {s.update_norm_bound:g} ({s.norm_action})" if s.update_norm_bound
                 else "update norms unbounded (update-norm-bound=0)")
        _log(f"trust: sample counts capped at {capped}; registry {s.registry or 'none'}; {bound}; "
             f"global test set scored on the {where}; nodes must hold data of shape {list(spec.input_shape)} "
             f"with {spec.num_classes} classes and a model of {spec.param_size} parameters ({spec.source})")
        _log(f"run {run_id}: {s.cfg['method']} on {s.cfg['dataset']}, {s.cfg['clients']} clients, "
             f"{s.cfg['rounds']} rounds; waiting for {s.min_nodes} node(s) (at most {s.nodes_timeout:g}s)")
        link.discover(s.min_nodes, s.nodes_timeout)
        try:
            exp = FlowerExperiment(s, store, link, shared, sizes, drift)
        except ConfigError as e:
            _log(f"refused: {e}")            # one line naming the key, its value and what is allowed
            drop_if_new_and_empty(store, created)
            raise
        res = exp.run(stop_after=s.stop_after or None)
        _log(f"run {run_id} {res.status}" + (f" (resumed after round {res.resumed_from + 1})"
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
