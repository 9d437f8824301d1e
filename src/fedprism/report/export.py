"""`fedprism export`: the store as flat tables (CSV, or Parquet when pandas + pyarrow are installed).

The CSV export is streamed: each table is read row by row from SQLite and written as it is read, so a
store of any size is exported in the memory of a few rows (the columns of `runs` and `rounds`, the union
of the keys of their JSON objects, are collected first by SQLite's `json_each`, not in Python). Parquet
needs whole frames: every table's frame is built before the first file is written (a failure in pandas
writes nothing), so a Parquet export holds the store in memory. The store is read through its read-only views
(`fedprism.experiment.store`): rows that are not well formed are left out, and a store of any earlier
schema exports as the current one.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Callable, Iterator

from fedprism.errors import FedPrismError
from fedprism.experiment.store import Store

Keep = Callable[..., bool]


def _keys(store: Store, table: str, col: str, keep: Keep) -> list[str]:
    """The sorted union of the keys of the JSON objects in `table.col` of the kept runs."""
    q = f"SELECT DISTINCT t.run_id, j.key FROM {table} t, json_each(t.{col}) j WHERE t.{col} IS NOT NULL"
    return sorted({k for rid, k in store.db.execute(q) if keep(rid)})


def _tables(store: Store, keep: Keep | None = None) -> Iterator[tuple[str, list[str], Iterator[list]]]:
    """(name, header, rows) of every table of the store, or of the rows of the runs `keep(run_id, sweep)`
    accepts (sweep: the membership row's sweep, None for the other tables). Rows are produced lazily: a
    table's rows must be consumed before the next table is asked for."""
    take = (lambda rid, sweep=None: True) if keep is None else keep
    ckeys, fkeys = _keys(store, "runs", "config", take), _keys(store, "runs", "final", take)

    def runs() -> Iterator[list]:
        for r in store.db.execute("SELECT * FROM runs ORDER BY created"):
            if take(r["run_id"]):
                cfg, fin = json.loads(r["config"]), json.loads(r["final"] or "{}")
                yield ([r["run_id"], r["status"], r["code_version"], r["sweep"], r["provenance"]]
                       + [cfg.get(k) for k in ckeys] + [fin.get(k) for k in fkeys])

    yield ("runs", ["run_id", "status", "code_version", "sweep", "provenance"] + ckeys
           + [f"final.{k}" for k in fkeys], runs())
    mkeys = _keys(store, "rounds", "metrics", take)

    def rounds() -> Iterator[list]:
        for r in store.db.execute("SELECT run_id, round, metrics, wall_s FROM rounds ORDER BY run_id, round"):
            if take(r["run_id"]):
                m = json.loads(r["metrics"])
                yield [r["run_id"], r["round"], r["wall_s"]] + [m.get(k) for k in mkeys]

    yield "rounds", ["run_id", "round", "wall_s"] + mkeys, rounds()
    cm = ["run_id", "round", "client", "local_acc", "local_loss", "global_acc", "n_test", "local_f1"]
    yield "client_metrics", cm, (list(r) for r in store.db.execute(
        f"SELECT {', '.join(cm)} FROM client_metrics ORDER BY run_id, round, client") if take(r["run_id"]))
    cols = ["run_id", "round", "seq", "kind", "client", "data"]
    yield "records", cols, (list(r) for r in store.db.execute(
        f"SELECT {', '.join(cols)} FROM records ORDER BY rowid") if take(r["run_id"]))
    # sweep membership: every sweep that holds a run, under its row label (`runs.sweep` is the first only)
    sr = store.db.execute(
        "SELECT m.sweep, m.run_id, COALESCE(m.label, r.name) FROM sweep_runs m "
        "LEFT JOIN runs r USING (run_id) UNION SELECT sweep, run_id, name FROM runs "
        "WHERE sweep IS NOT NULL AND NOT EXISTS (SELECT 1 FROM sweep_runs m "
        "WHERE m.sweep = runs.sweep AND m.run_id = runs.run_id) ORDER BY 1, 2")
    yield "sweep_runs", ["sweep", "run_id", "label"], (list(r) for r in sr if take(r[1], r[0]))


def export(db: str, out: str, fmt: str = "csv", runs: list[str] | None = None,
           sweeps: list[str] | None = None) -> list[Path]:
    """Write the store's tables to `out`; with `runs` (ids or prefixes) and/or `sweeps` (names), only the
    selected runs' rows, as `fedprism merge` selects them: a run named by id keeps every sweep membership,
    a run selected through a sweep only that sweep's. Nothing is written when a name is not in the store."""
    if fmt != "csv":                             # checked first: a missing library writes nothing
        import importlib.util

        missing = [m for m in ("pandas", "pyarrow") if importlib.util.find_spec(m) is None]
        if missing and not (missing == ["pyarrow"] and importlib.util.find_spec("fastparquet")):
            raise FedPrismError(f"parquet export needs pandas and pyarrow: pip install {' '.join(missing)}")
    from fedprism.experiment.merge import selection

    store = Store(db, readonly=True)             # never changes the file it reads
    try:
        by_id, missing = selection(store, runs, None)
        _, missing_sweeps = selection(store, None, sweeps)
        if missing or missing_sweeps:
            raise FedPrismError(f"{db} has no {', '.join(missing + missing_sweeps)}; "
                                f"`fedprism runs --db {db}` lists its runs and sweeps")
        keep = None
        if runs or sweeps:
            in_sweep = {(sw, r["run_id"]) for sw in sweeps or [] for r in store.runs(sweep=sw)}
            chosen = (by_id or set()) | {rid for _, rid in in_sweep}
            keep = lambda rid, sweep=None: rid in chosen if sweep is None else (  # noqa: E731
                rid in (by_id or ()) or (sweep, rid) in in_sweep)
        outdir = Path(out)
        if fmt != "csv":                         # every frame built before any file is written
            import pandas as pd

            frames = [(name, pd.DataFrame(list(rows), columns=header)) for name, header, rows in
                      _tables(store, keep)]
            outdir.mkdir(parents=True, exist_ok=True)
            paths = []
            for name, frame in frames:
                p = outdir / f"{name}.parquet"
                frame.to_parquet(p)
                paths.append(p)
            return paths
        outdir.mkdir(parents=True, exist_ok=True)
        paths = []
        for name, header, rows in _tables(store, keep):
            p = outdir / f"{name}.csv"
            with open(p, "w", newline="") as f:
                w = csv.writer(f, lineterminator="\n")
                w.writerow(header)
                for row in rows:
                    w.writerow(row)
            paths.append(p)
        return paths
    finally:
        store.close()
