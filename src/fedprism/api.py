"""The Python entry points: build a configuration, run it, read what the store holds.

    import fedprism
    cfg = fedprism.config(method="fedavg", dataset="digits", clients=10, rounds=5)
    result = fedprism.run(cfg, db="study.db")          # runs, or returns the stored result
    result.final["local_acc"], result.history[-1]
    fedprism.results("study.db")                       # one dict per stored run
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fedprism.experiment.config import Config, flatten, load_toml, resolve
from fedprism.experiment.result import RunResult
from fedprism.experiment.store import Store

# the round loop (fedprism.experiment.runner, and with it torch) is imported by `run` when it builds a run:
# a stored result is answered without it (fedprism.experiment.lookup)


def config(source: str | Path | dict | Config | None = None, **keys: Any) -> Config:
    """A validated configuration from a TOML file, a dict of keys, or keyword arguments (dotted keys as
    `fedprism__k=5`, in a dict {"fedprism.k": 5}, or nested as in a TOML table: fedprism={"k": 5});
    later sources override earlier ones."""
    return resolve(_raw(source, **keys))


def _raw(source: str | Path | dict | Config | None = None, **keys: Any) -> dict[str, Any]:
    """The flat keys of `config(source, **keys)`, not yet resolved."""
    raw: dict[str, Any] = {}
    if isinstance(source, Config):
        raw.update(source.values)
    elif isinstance(source, dict):
        raw.update(flatten(source))
    elif isinstance(source, (str, os.PathLike)):
        raw.update(load_toml(source))
    elif source is not None:
        raise TypeError(f"fedprism.config(source): {source!r} is not a TOML file path, a dict of keys or a "
                        "Config")
    raw.update(flatten({k.replace("__", "."): v for k, v in keys.items()}))
    return raw


def run(cfg: Config | dict | str | Path | None = None, db: str | Path = "fedprism-results.db",
        progress: bool = False, fresh: bool = False, **keys: Any) -> RunResult:
    """Run (or resume, or return the stored result of) one experiment into the store `db`. A store this
    call creates is removed again when the configuration is refused before any run is stored in it (its
    data, partition or model), as `fedprism run` does.

    `fresh=True` drops what the store holds of the run (rounds, checkpoint, the kept final state of its
    training) once the run is built, and runs it again, as `fedprism run --fresh` does: after an edit of
    the method, a finished run of the earlier code is refused (`ProvenanceMismatch`) until then. A run
    that did not finish under other code is replaced without it (`fedprism.experiment.fresh`). A method
    registered in this process (`fedprism.register`) works here as everywhere in the process."""
    from fedprism.experiment import lookup
    from fedprism.experiment.store import drop_if_new_and_empty

    if cfg is None and not keys:          # config() of nothing is the default 100-round run: not by accident
        raise TypeError("fedprism.run(cfg): None; pass a configuration (fedprism.config(...), a dict, a TOML "
                        "path) or keys (fedprism.run(method='fedavg', ...))")
    if not isinstance(fresh, bool):
        raise TypeError(f"fedprism.run(fresh=...): {fresh!r} is not True or False")
    pristine = lookup.pristine()                # before anything below imports torch
    raw = _raw(cfg, **keys)
    if not fresh:                               # a finished stored run, answered without building it
        found = lookup.stored_result(raw, db)
        if found is not None:
            return found[1]
    from fedprism.experiment.runner import Experiment

    c = resolve(raw)
    if not isinstance(db, (str, os.PathLike)):
        raise TypeError(f"fedprism.run(db=...): {db!r} is not a file path (str or pathlib.Path)")
    memo = lookup.Recorder(raw, c, active=pristine)
    created = not Path(db).exists()
    store = Store(db)
    try:
        exp = Experiment(c, store, progress=progress)
    except BaseException:
        drop_if_new_and_empty(store, created)
        store.close()
        raise
    from fedprism.experiment.fresh import fix_for_python

    exp.fix = fix_for_python(exp.run_id, db, c["method"], f"fedprism.run(..., db={str(db)!r}, fresh=True)")
    memo.watch(exp)
    try:
        if fresh:                             # only now: a run that cannot be built, or is running, is kept
            exp.forget_stored()
        result = exp.run()
    finally:
        store.close()
    memo.save(result)
    return result


def results(db: str | Path = "fedprism-results.db", frame: bool = False, **where: Any):
    """Every stored run as a plain dict (id, method, name, seed, status, config, final metrics), filtered
    by column values (`method="fedavg"`, `status="finished"`, `sweep="paper_fmnist_dir01"`). The store is
    opened read-only. `frame=True` returns a pandas DataFrame instead (one row per run, the final metrics
    as columns; needs pandas)."""
    import json

    store = Store(db, readonly=True)
    try:
        if "sweep" in where:
            store.require_sweeps([where["sweep"]])     # a mistyped name is an error, not "no runs"
        rows = [{"run_id": r["run_id"], "method": r["method"], "name": r["label"], "seed": r["seed"],
                 "status": r["status"], "config": json.loads(r["config"]), "final": json.loads(r["final"] or "{}")}
                for r in store.runs(**where)]
    finally:
        store.close()
    if not frame:
        return rows
    try:
        import pandas as pd
    except ImportError:
        raise ImportError("results(frame=True) needs pandas (pip install pandas)") from None
    return pd.DataFrame([{k: v for k, v in r.items() if k not in ("config", "final")} | r["final"] for r in rows])
