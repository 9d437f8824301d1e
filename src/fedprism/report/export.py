"""`fedprism export`: the store as flat tables (CSV, or Parquet when pandas + pyarrow are installed)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from fedprism.errors import FedPrismError
from fedprism.experiment.store import Store, table_columns


def _tables(store: Store, keep=None) -> dict[str, tuple[list[str], list[list]]]:
    """Every table of the store, or the rows of the runs `keep(run_id, sweep)` accepts (sweep: the
    membership row's sweep, None for the other tables)."""
    take = (lambda rid, sweep=None: True) if keep is None else keep
    runs = [r for r in store.runs() if take(r["run_id"])]
    t: dict[str, tuple[list[str], list[list]]] = {}
    ckeys = sorted({k for r in runs for k in json.loads(r["config"])})
    fkeys = sorted({k for r in runs for k in json.loads(r["final"] or "{}")})
    prov = lambda r: r["provenance"] if "provenance" in r.keys() else None  # noqa: E731 (older stores)
    t["runs"] = (["run_id", "status", "code_version", "sweep", "provenance"] + ckeys + [f"final.{k}" for k in fkeys],
                 [[r["run_id"], r["status"], r["code_version"], r["sweep"], prov(r)]
                  + [json.loads(r["config"]).get(k) for k in ckeys]
                  + [json.loads(r["final"] or "{}").get(k) for k in fkeys] for r in runs])
    rr = [r for r in store.db.execute("SELECT run_id, round, metrics, wall_s FROM rounds "
                                      "ORDER BY run_id, round") if take(r["run_id"])]
    mkeys = sorted({k for r in rr for k in json.loads(r["metrics"])})
    t["rounds"] = (["run_id", "round", "wall_s"] + mkeys,
                   [[r["run_id"], r["round"], r["wall_s"]] + [json.loads(r["metrics"]).get(k) for k in mkeys] for r in rr])
    cm = [r for r in store.db.execute("SELECT * FROM client_metrics ORDER BY run_id, round, client")
          if take(r["run_id"])]
    t["client_metrics"] = (list(cm[0].keys()) if cm else ["run_id"], [list(r) for r in cm])
    has_seq = "seq" in table_columns(store.db, "records")          # older stores opened read-only: none
    cols = ["run_id", "round"] + ["seq"] * has_seq + ["kind", "client", "data"]
    rec = [r for r in store.db.execute(f"SELECT {', '.join(cols)} FROM records ORDER BY rowid")
           if take(r["run_id"])]
    t["records"] = (cols, [list(r) for r in rec])
    # sweep membership: every sweep that holds a run, under its row label (`runs.sweep` is the first only)
    sr = store.db.execute(
        "SELECT m.sweep, m.run_id, COALESCE(m.label, r.name) FROM sweep_runs m "
        "LEFT JOIN runs r USING (run_id) UNION SELECT sweep, run_id, name FROM runs "
        "WHERE sweep IS NOT NULL AND NOT EXISTS (SELECT 1 FROM sweep_runs m "
        "WHERE m.sweep = runs.sweep AND m.run_id = runs.run_id) ORDER BY 1, 2").fetchall()
    t["sweep_runs"] = (["sweep", "run_id", "label"], [list(r) for r in sr if take(r[1], r[0])])
    return t


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
        tables = _tables(store, keep)
    finally:
        store.close()
    if fmt != "csv":                             # every frame built before any file is written
        import pandas as pd

        frames = {name: pd.DataFrame(rows, columns=header) for name, (header, rows) in tables.items()}
    outdir = Path(out)
    outdir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, (header, rows) in tables.items():
        if fmt == "csv":
            p = outdir / f"{name}.csv"
            with open(p, "w", newline="") as f:
                w = csv.writer(f, lineterminator="\n")
                w.writerow(header)
                w.writerows(rows)
        else:
            p = outdir / f"{name}.parquet"
            frames[name].to_parquet(p)
        paths.append(p)
    return paths
