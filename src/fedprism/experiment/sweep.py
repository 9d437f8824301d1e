"""Sweeps: a grid of runs from one TOML file, resumable (finished runs are skipped).

    name = "fedprism_clustering"          # stored with every run (`fedprism report --sweep NAME`)
    [base]                                 # keys shared by every run
    dataset = "fmnist"
    [grid]                                 # cartesian product over these keys
    seed = [0, 1, 2]
    [[runs]]                               # the variants; `label` names the table row
    label = "Fed-PRISM kmeans"
    method = "fedprism"
    fedprism.clustering = "kmeans"
    [quick]                                # overrides for `--quick` (CI-sized)
    rounds = 3
    db = "../results/fedprism.db"          # optional: where the sweep's results live (relative to
                                           # this file); `--db` or $FEDPRISM_DB win, `--quick` ignores it

Method keys in [base] or [quick] (`fedprism.k`) apply only to the runs of that method.

Every run of a sweep with the same data keys shares one partition and, through the seeded sampler,
one cohort sequence.

A sweep's table row is (label, seed, data setting). When the file's configuration of a row changes (a
method default or a parameter changed), the run of the new configuration takes the row over once it
has finished: the older run leaves the sweep (`superseded`), and stays in the store under its run id
and in any other sweep that holds it.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

from fedprism.algorithms import REGISTRY
from fedprism.errors import ConfigError
from fedprism.experiment.config import Config, flatten, read_toml, resolve


def load_sweep(path: str | Path, quick: bool = False, overrides: dict[str, Any] | None = None
               ) -> tuple[str, list[Config]]:
    """(sweep name, resolved configs). `overrides` (flat keys) apply to every run, last; overriding
    `partition` drops the file's partition parameters (e.g. `partition=pathological` after Dirichlet)."""
    p = Path(path)
    doc = _read(p)
    unknown = set(doc) - {"name", "base", "grid", "runs", "quick", "description", "db"}
    if unknown:
        raise ConfigError(f"{p.name}: {sorted(unknown)[0]}", "",
                          "sweep files have name, description, db, base, grid, runs, quick")
    name = doc.get("name", p.stem)
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{p.name}: name", name, "a non-empty string")
    for section in ("base", "grid", "quick"):
        if not isinstance(doc.get(section, {}), dict):
            raise ConfigError(f"{p.name}: {section}", doc[section], f"a table ([{section}])")
    base = flatten(doc.get("base", {}))
    grid = flatten(doc.get("grid", {}))
    for k, v in grid.items():
        if not isinstance(v, list) or not v:
            raise ConfigError(f"grid.{k}", v, "a non-empty list of values")
    runs = doc.get("runs", [{}])
    if not isinstance(runs, list) or not all(isinstance(r, dict) for r in runs):
        raise ConfigError(f"{p.name}: runs", runs, "an array of tables ([[runs]] sections)")
    runs = runs or [{}]
    for i, r in enumerate(runs):
        if "label" in r and (not isinstance(r["label"], str) or not r["label"]):
            raise ConfigError(f"{p.name}: runs[{i}].label", r["label"], "a non-empty string")
    quick_over = flatten(doc.get("quick", {})) if quick else {}
    configs = []
    for variant in runs:
        variant = flatten(variant)
        label = variant.pop("label", None)
        for values in itertools.product(*grid.values()) if grid else [()]:
            method = variant.get("method", base.get("method", "fedprism"))
            shared = {**base, **quick_over}
            # keys of *other* methods in [base] / [quick] apply only to runs of those methods
            shared = {k: v for k, v in shared.items()
                      if k.split(".")[0] not in REGISTRY or k.split(".")[0] == method}
            raw = {**base, **variant, **dict(zip(grid.keys(), values)), **quick_over}
            raw = {k: v for k, v in raw.items() if k in shared or k in variant or k in grid}
            if overrides:
                if "partition" in overrides:
                    raw = {k: v for k, v in raw.items() if not k.startswith("partition.")}
                raw.update(overrides)
            raw["name"] = label or raw.get("name") or raw.get("method", "run")
            configs.append(resolve(raw))
    return name, configs


def run_sweep(path: str, db: str, only: str | None = None, quick: bool = False, progress: bool = True,
              limit: int | None = None, seeds: list[int] | None = None,
              overrides: dict[str, Any] | None = None) -> int:
    from fedprism.experiment.runlock import RunBusyError
    from fedprism.experiment.runner import Experiment
    from fedprism.experiment.store import Store

    name, configs = load_sweep(path, quick, overrides)
    if only:
        configs = [c for c in configs if only in c["name"]]
    if seeds:
        configs = [c for c in configs if c["seed"] in seeds]
    store = Store(db)
    done = skipped = busy = 0
    t0 = time.time()
    for i, cfg in enumerate(configs):
        if limit is not None and done >= limit:
            break
        row = store.run(cfg.run_id)
        tag = f"[{i + 1}/{len(configs)}] {cfg['name']} seed={cfg['seed']}"
        if row is not None and row["status"] == "finished":
            skipped += 1
            store.add_to_sweep(name, cfg.run_id, cfg["name"])
            supersede(store, name, cfg)
            print(f"{tag}: finished earlier, skipped", file=sys.stderr)
            continue
        try:
            res = Experiment(cfg, store, progress=progress, sweep=name).run()
        except RunBusyError as e:        # another process (e.g. a second copy of this sweep) runs it
            busy += 1
            print(f"{tag}: skipped, {e}", file=sys.stderr)
            continue
        supersede(store, name, cfg)
        done += 1
        f = res.final
        print(f"{tag}: global {f.get('global_acc', float('nan')):.4f} local {f.get('local_acc', float('nan')):.4f}"
              f" ({f.get('seconds', 0):.0f}s)" + (f", {f['rejected']} updates rejected" if f.get("rejected") else "")
              + (" -- DIVERGED: every update was rejected" if f.get("diverged") else ""), file=sys.stderr)
    print(f"sweep {name}: {done} run, {skipped} already finished"
          + (f", {busy} running in other processes" if busy else "") + f", {time.time() - t0:.0f}s", file=sys.stderr)
    store.close()
    return 0


def _read(p: Path) -> dict[str, Any]:
    return read_toml(p, "sweep file")


def sweep_db(path: str | Path) -> str | None:
    """The results database a sweep file names (`db = ...`, relative to the file's folder), if any."""
    p = Path(path)
    db = _read(p).get("db")
    if db is None:
        return None
    if not isinstance(db, str) or not db or "\0" in db:
        raise ConfigError(f"{p.name}: db", db, "a path to a SQLite file (relative to the sweep file)")
    return str((p.parent / db).resolve())          # an absolute `db` stays itself


def _row_key(cfg: dict[str, Any], label: str | None) -> tuple:
    """What makes one row of a sweep's tables: its label, seed and data setting."""
    data = sorted((k, repr(v)) for k, v in cfg.items()
                  if k in ("dataset", "clients", "rounds", "partition") or k.startswith("partition."))
    return label, cfg.get("seed"), tuple(data)


def supersede(store, sweep: str, cfg: Config) -> list[str]:
    """Older runs of `cfg`'s row (same label, seed and data setting, another configuration) leave the
    sweep; returns their run ids. Called once the run of `cfg` has finished."""
    key = _row_key(cfg.values, cfg["name"])
    old = [r["run_id"] for r in store.runs(sweep=sweep)
           if r["run_id"] != cfg.run_id and _row_key(json.loads(r["config"]), r["label"]) == key]
    for run_id in old:
        store.leave_sweep(sweep, run_id)
        print(f"sweep {sweep}: run {run_id} superseded by {cfg.run_id} as '{cfg['name']}' seed={cfg['seed']}",
              file=sys.stderr)
    return old


def sweep_summary(configs: list[Config]) -> list[dict[str, Any]]:
    return [{"name": c["name"], "run_id": c.run_id, "seed": c["seed"]} for c in configs]
