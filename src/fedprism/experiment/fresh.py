"""Running a stored run again under the current code (docs/reproducibility.md, "Running a run again").

A stored run is reused (or resumed) only when its recorded code and data fingerprints equal the current
ones (`fedprism.experiment.provenance`). Otherwise:

* a **finished** run of other code or data is refused (`ProvenanceMismatch`), with the way to run it
  again from the entry point in use (`fix`): `fedprism run --fresh RUN_ID`, `fedprism sweep FILE --fresh
  --only LABEL`, `fedprism.run(..., fresh=True)`. A method registered in this process only
  (`fedprism.register`) is invisible to a `fedprism` command started elsewhere, so for it only the
  Python forms are suggested (`cli_visible`);
* a run that did **not finish** (failed, interrupted, or left `running` by a killed process) of other
  code or data is replaced (`settle_stored`): its rounds, records and checkpoint are dropped, a one-line
  warning says so, and it runs from round 0 under the current code. Its partial rounds are no result
  anyone can reuse, and the fixed code is what should run;
* `--fresh` (`fedprism run --fresh`, `fedprism sweep --fresh`, `fedprism.run(..., fresh=True)`) drops
  what the store holds of the run (`forget`), whatever code stored it, and runs it again.
"""

from __future__ import annotations

import json
import shlex
import warnings
from typing import Any

from fedprism.errors import ConfigError


def cli_visible(method: str) -> bool:
    """Whether a `fedprism` command started in another process knows `method`: a built-in method, or one
    declared in the `fedprism.methods` entry-point group. A method registered in this process only
    (`fedprism.register` in a script or notebook) is not."""
    from importlib.metadata import entry_points

    from fedprism.algorithms.base import REGISTRY

    if REGISTRY.is_builtin(method):
        return True
    try:
        return any(ep.name == method for ep in entry_points(group="fedprism.methods"))
    except Exception:  # noqa: BLE001 - unreadable distribution metadata: say what surely works
        return False


def _db(db: Any) -> str:
    return shlex.quote(str(db))


def fix_for_cli_run(run_id: str, db: Any) -> str:
    """What re-runs a refused run from `fedprism run`."""
    return f"`fedprism run --fresh {run_id} --db {_db(db)}` re-runs it under the current code"


def fix_for_sweep(file: Any, label: str, db: Any, method: str) -> str:
    """What re-runs one refused row of a sweep: the command, or for a method registered in this process
    only, `run_sweep(..., fresh=True)` in that process."""
    only = shlex.quote(label)
    if cli_visible(method):
        return (f"`fedprism sweep {shlex.quote(str(file))} --fresh --only {only} --db {_db(db)}` re-runs it "
                "under the current code (`--fresh` without `--only`: every run of the sweep)")
    return (f"`fedprism.experiment.sweep.run_sweep({str(file)!r}, {str(db)!r}, only={label!r}, fresh=True)` in "
            f"the process that registers {method!r} re-runs it under the current code (a `fedprism` command "
            "cannot see a method registered in a process)")


def fix_for_python(run_id: str, db: Any, method: str, how: str = "fedprism.run(cfg, db=..., fresh=True)") -> str:
    """What re-runs a refused run from Python (`how`), and the command that does it where the method is
    visible to one (`cli_visible`)."""
    text = f"`{how}` re-runs it under the current code"
    if cli_visible(method):
        return text + f", as does `fedprism run --fresh {run_id} --db {_db(db)}`"
    return text + (f" ({method!r} is registered in this process only, so no `fedprism` command started "
                   "elsewhere can run it)")


def verify_hint(run_id: str, db: Any, method: str) -> str:
    """What checks whether the current code reproduces a stored run: `fedprism verify RUN_ID --db DB`, or
    for a method registered in this process only (`cli_visible`), `verify(...)` in that process."""
    if cli_visible(method):
        return (f"`fedprism verify {run_id} --db {_db(db)}` checks whether the current code reproduces its "
                "first rounds")
    return (f"`fedprism.experiment.verify.verify({str(db)!r}, {run_id!r})` in the process that registers "
            f"{method!r} checks whether the current code reproduces its first rounds (`fedprism verify` "
            "cannot see a method registered in a process)")


def default_fix(exp: Any) -> str:
    """The advice of an `Experiment` that no entry point configured (`Experiment.fresh_fix`)."""
    return fix_for_python(exp.run_id, exp.store.path, exp.cfg["method"],
                          "fedprism.run(cfg, db=..., fresh=True)` (or `Experiment.forget_stored()` before `run()")


def forget(store: Any, cfg: Any, shares_final: bool = True, keep_lock: bool = True) -> bool:
    """`--fresh` for one configuration: drop what `store` holds of its run (rounds, client rows, records,
    checkpoint; `Store.forget`) and the final state kept for its training identity; False when it held
    neither. The run's lock is taken first, so a run that another process executes is refused
    (`RunBusyError`) and kept. `keep_lock=False` releases it again (a sweep forgets before its workers
    take the runs)."""
    held = store.run(cfg.run_id) is not None
    if held:
        store.lock(cfg.run_id)
        try:
            store.forget(cfg.run_id)
        finally:
            if not keep_lock:
                store.unlock(cfg.run_id)
    dropped = bool(shares_final and store.drop_final(cfg.train_id))
    return held or dropped


def _json(s: str | None) -> dict | None:
    try:
        return json.loads(s) if s else None
    except ValueError:
        return None


def settle_stored(exp: Any, current: dict | None) -> bool:
    """Before an `Experiment` runs: a stored run of its id whose code or data fingerprints differ from
    `current` (this run's provenance) is refused when finished (`ProvenanceMismatch` with `exp.fresh_fix`),
    and replaced, with a one-line warning, when it did not finish. True when one was replaced."""
    from fedprism.experiment.provenance import ProvenanceMismatch, differences

    row = exp.store.run(exp.run_id)
    if row is None:
        return False
    stored = _json(row["provenance"] if "provenance" in row.keys() else None)
    diff = differences(stored, current)
    if not diff:
        return False
    if row["status"] == "finished":
        raise ProvenanceMismatch.of(exp.run_id, diff, exp.fresh_fix(),
                                    verify_hint(exp.run_id, exp.store.path, exp.cfg["method"]))
    exp.store.lock(exp.run_id)                   # RunBusyError: another process executes it; it is kept
    exp.store.forget(exp.run_id)
    if getattr(exp, "clients", None) is not None:
        exp.clients = exp.client_store()         # its row files (state.storage=mmap) went with the run
    warnings.warn(f"run {exp.run_id} was stored {row['status']} after {row['rounds_done']} round(s) from "
                  f"other code or data ({'; '.join(diff)}); replaced: it runs from round 0 under the current "
                  "code", stacklevel=3)
    return True


def stored_config(store: Any, run: str, overrides: dict[str, Any] | None = None):
    """The configuration of stored run `run` (an id or an unambiguous prefix), resolved again, for `fedprism
    run --fresh RUN_ID`. `overrides` may set execution-only keys (threads=, engine=, ...) and keys the stored
    configuration does not hold; other values of its own keys would make another run (ConfigError). A
    configuration that the current code resolves to another run id (a default changed since it was stored)
    is refused naming both ids."""
    from fedprism.experiment.config import EXECUTION_KEYS, resolve_stored

    row = store.find(run)
    run_id = row["run_id"]
    values = json.loads(row["config"])
    for k, v in (overrides or {}).items():
        if k not in EXECUTION_KEYS and k in values and values[k] != v:
            raise ConfigError(k, v, f"an execution-only key ({', '.join(sorted(EXECUTION_KEYS))}) or a key run "
                              f"{run_id}'s stored configuration does not hold: another value of its own keys "
                              "makes another run (give the whole configuration instead of the run id)")
    cfg = resolve_stored({**values, **(overrides or {})})
    if cfg.run_id != run_id:
        raise ConfigError("RUN_ID", run, f"a run whose stored configuration the current code resolves to the same "
                          f"id; run {run_id}'s now resolves to {cfg.run_id} (a key or a default changed since it "
                          f"was stored): give the configuration itself (`fedprism show {run_id} --db "
                          f"{_db(store.path)}` lists it)",
                          kind="argument")
    return cfg
