"""`fedprism merge`: bring the finished runs of other results stores into this one.

A sweep too large for one machine runs in parts (a GPU session, cluster nodes, a colleague's laptop),
each part writing its own store with `fedprism sweep FILE --db part.db`; `fedprism merge part.db --db
results.db` then copies what each part finished. Run ids are hashes of the configuration, so the same
run computed twice is recognised and kept once.

Per run of the other store:
* finished there, absent here: copied (its row, rounds, per-client rows, records, sweep membership,
  and its final state file when the other store kept one);
* finished there, unfinished here (interrupted or failed): the finished copy replaces it, unless a
  process is running it here right now (its run lock is held: then it is left alone and reported);
* finished here too: kept as it is (the first finished copy wins; the two may differ in the last
  floating-point bits when they ran on different hardware);
* unfinished there: not copied (resume it where it ran, or here: a sweep re-runs it).

Only part of the other store can be merged: `runs` (ids or unambiguous prefixes) and `sweeps` (names)
select the runs named and the runs those sweeps hold (the union of both). With `sweeps`, a copied run
belongs here only to the named sweeps: its other sweeps' membership rows stay behind, and its `runs.sweep`
column (the sweep that first ran it, which reports also read as membership) is set to a named sweep that
holds it when the one recorded there is not named. Only the selected runs' final state files come along.

The other store is opened read-only and checked (`PRAGMA quick_check`) before anything is written;
everything of one run is written in one transaction, so an interrupted merge leaves whole runs only.

A part store is data from elsewhere, so a finished run is copied only when it can be trusted as far as
a store can say (otherwise it is `refused`, named with the reason, and nothing of it is written):
* its id is a run id (16 hex digits; a row without one, or with a path for an id, is refused);
* its id is the hash of its stored configuration (`Config.run_id` over the stored values, or
  `flower_run_id` with the Flower settings its provenance records): a fabricated result filed under the
  id of a real configuration would otherwise become that configuration's "stored, not run again" result;
* every row of it is well formed (`store.ROW_OK`: each JSON column parses to what readers expect,
  numbers and statuses of the right type), so no read command fails on it afterwards.
Stores of every earlier schema version are read (`store.SCHEMA_VERSION`). Of the part's `.final/`
folder only plain files and folders of plain files named after a train id are copied, into owner-only
folders, opened without following links (`fedprism.experiment.safefs`).
"""

from __future__ import annotations

import json
import os
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

from fedprism.errors import FedPrismError
from fedprism.experiment.safefs import is_real_dir, is_regular, open_file, private_dir
from fedprism.experiment.store import MissingStoreError, Store, table_columns, valid_run_id

ROW_TABLES = ("rounds", "client_metrics", "records")


@dataclass
class MergeReport:
    source: str
    copied: list[str] = field(default_factory=list)
    replaced: list[str] = field(default_factory=list)     # finished there, an unfinished copy here
    present: list[str] = field(default_factory=list)      # finished on both sides: ours kept
    busy: list[str] = field(default_factory=list)         # being run here right now: left alone
    unfinished: list[str] = field(default_factory=list)   # not finished there: not copied
    refused: list[tuple[str, str]] = field(default_factory=list)   # (id as stored, why): not copied
    finals: int = 0

    def summary(self, dry_run: bool = False) -> str:
        verb = "would merge" if dry_run else "merged"
        parts = [f"{self.source}: {verb} {len(self.copied) + len(self.replaced)} finished run(s)"]
        if self.replaced:
            parts.append(f"{len(self.replaced)} of them replacing an unfinished copy")
        parts.append(f"{len(self.present)} already finished here")
        if self.busy:
            parts.append(f"{len(self.busy)} running here now, left alone ({', '.join(self.busy)})")
        if self.unfinished:
            parts.append(f"{len(self.unfinished)} unfinished there, not merged")
        if self.refused:
            shown = "; ".join(f"{rid}: {why}" for rid, why in self.refused[:5])
            parts.append(f"{len(self.refused)} refused, not merged ({shown}{'; ...' if len(self.refused) > 5 else ''})")
        if self.finals:
            parts.append(f"{self.finals} final state file(s)")
        return "; ".join(parts)


def _open_source(path: str | Path, dst: Store) -> Store:
    p = Path(path)
    if p.resolve() == dst.path.resolve():
        raise FedPrismError(f"merge: {p} is the target store itself (--db); name another store")
    src = Store(p, readonly=True)
    try:
        try:
            ok = src.db.execute("PRAGMA quick_check").fetchone()[0]
        except sqlite3.DatabaseError as e:
            raise MissingStoreError(f"{p} is corrupt ({e}); nothing was merged") from None
        if ok != "ok":
            raise MissingStoreError(f"{p} is corrupt (integrity check: {ok}); nothing was merged")
        missing = [t for t in ("runs", *ROW_TABLES) if not table_columns(src.db, t)]
        if missing:
            raise MissingStoreError(f"{p} is not a fedprism results store (no table {', '.join(missing)})")
    except BaseException:
        src.close()
        raise
    return src


def merge(dst: Store, source: str | Path, dry_run: bool = False, runs: list[str] | None = None,
          sweeps: list[str] | None = None, missing_ok: bool = False) -> MergeReport:
    """Copy the finished runs of the store at `source` into `dst`, all of them or those `runs` and
    `sweeps` select (see the module docstring). A run or sweep named there that `source` lacks is an
    error before anything is written, unless `missing_ok` (a selection spread over several stores)."""
    src = _open_source(source, dst)
    rep = MergeReport(str(source))
    try:
        cols = {t: [c for c in table_columns(src.db, t) if c in set(table_columns(dst.db, t))]
                for t in ("runs", *ROW_TABLES, "sweep_runs")}
        if "run_id" not in cols["runs"] or "status" not in cols["runs"]:
            raise MissingStoreError(f"{source} is not a fedprism results store (its runs table lacks run_id)")
        chosen, missing = selection(src, runs, sweeps)
        if missing and not missing_ok:
            raise FedPrismError(f"merge: {source} has no {', '.join(missing)} (`fedprism runs --db {source}` "
                                "lists its runs and sweeps); nothing was merged")
        # the file's own rows, not the read-only store's views: a row left out as damaged is named, not lost
        for row in src.db.execute("SELECT rowid, run_id, status, config FROM main.runs "
                                  "ORDER BY created, run_id").fetchall():
            rid = row["run_id"]
            if not valid_run_id(rid):
                if chosen is None:
                    rep.refused.append((f"row {row['rowid']} ({str(rid)[:40]!r})" if rid is not None
                                        else f"row {row['rowid']} (no run id)", "not a run id"))
                continue
            if chosen is not None and rid not in chosen:
                continue
            if row["status"] != "finished":
                rep.unfinished.append(rid)
                continue
            why = src.damage(rid) or _not_its_config(src, rid)
            if why:
                rep.refused.append((rid, why))
                continue
            # this store's row as it is (a damaged copy here is replaced by the sound one, not kept)
            here = dst.db.execute("SELECT status FROM main.runs WHERE run_id=?", (rid,)).fetchone()
            if here is not None and here["status"] == "finished" and not dst.damage(rid):
                rep.present.append(rid)
                continue
            if here is not None and not dry_run:
                try:
                    dst.lock(rid)                # a process running it here holds this lock
                except FedPrismError:
                    rep.busy.append(rid)
                    continue
            try:
                if not dry_run:
                    _copy_run(src, dst, rid, cols, sweeps or None)
                    if here is not None:
                        dst.drop_checkpoint(rid)
                (rep.replaced if here is not None else rep.copied).append(rid)
            finally:
                if here is not None and not dry_run:
                    dst.unlock(rid)
        if not dry_run:
            # only the final states of runs that passed the checks above (a refused run's state could
            # otherwise be re-scored as a configuration of the same training)
            keep = _train_ids(src, {*rep.copied, *rep.replaced, *rep.present})
            rep.finals = _copy_finals(src.final_dir, dst.final_dir, keep)
    finally:
        src.close()
    return rep


def selection(src: Store, runs: list[str] | None, sweeps: list[str] | None
              ) -> tuple[set[str] | None, list[str]]:
    """The run ids of `src` that `runs` (ids or prefixes) and `sweeps` (names) select (None: no filter,
    every run), and the prefixes and sweep names `src` lacks. An ambiguous prefix is an error."""
    if not runs and not sweeps:
        return None, []
    chosen, missing = set(), []
    for prefix in runs or []:
        rows = src.with_prefix(prefix, "run_id")
        if len(rows) > 1:
            src.find(prefix)                     # raises, naming the candidates
        chosen |= {r[0] for r in rows}
        missing += [repr(prefix) if not prefix.strip() else prefix] if not rows else []   # '' named as such
    known = src.sweeps()
    for name in sweeps or []:
        chosen |= {r["run_id"] for r in src.runs(sweep=name)}
        missing += [f"sweep {name}"] if name not in known else []
    return chosen, missing


def _copy_run(src: Store, dst: Store, rid: str, cols: dict[str, list[str]], sweeps: list[str] | None) -> None:
    with dst.transaction(f"merging run {rid}") as db:
        for t in ("runs", *ROW_TABLES, "sweep_runs"):
            if t != "sweep_runs":                # sweep membership: the union of both stores'
                db.execute(f"DELETE FROM {t} WHERE run_id=?", (rid,))
            c = cols[t]
            q = f"SELECT {', '.join(c)} FROM {t} WHERE run_id=?"
            rows = [tuple(r) for r in src.db.execute(q, (rid,))]
            if sweeps and t == "sweep_runs":     # only the named sweeps' membership comes along
                rows = [r for r in rows if r[c.index("sweep")] in sweeps]
            if sweeps and t == "runs" and "sweep" in c:
                rows = [_named_sweep(r, c.index("sweep"), src, rid, sweeps) for r in rows]
            if rows:
                db.executemany(f"INSERT OR IGNORE INTO {t} ({', '.join(c)}) VALUES ({', '.join('?' * len(c))})",
                               rows)


def _not_its_config(src: Store, rid: str) -> str:
    """Why `rid` is not the run id of its stored configuration under this code, or ""."""
    row = src.run(rid)
    return id_problem(rid, row["config"], row["provenance"])


def id_problem(rid: str, config: str | None, provenance: str | None = None) -> str:
    """Why `rid` is not the run id of the stored configuration `config` (JSON text; `provenance` the run's
    provenance JSON), or "": `Config.run_id` over the stored values as they are (re-resolving them would
    fill in today's values: kernels that `auto` picks on this machine, keys added since), or for a Flower run
    `flower_run_id` with the Flower settings its provenance records. `fedprism store load` checks a dump's
    runs with it too (fedprism.experiment.archive)."""
    from fedprism.experiment.config import Config

    try:
        values = json.loads(config) if isinstance(config, str) else None
        if not isinstance(values, dict):
            return "its configuration is not a JSON object"
        cfg = Config(values)
        own = cfg.run_id
    except (FedPrismError, ValueError, TypeError, KeyError) as e:
        return f"its configuration cannot be hashed here ({str(e).splitlines()[0][:160] if str(e) else type(e).__name__})"
    if rid == own:
        return ""
    try:
        prov = json.loads(provenance) if provenance else {}
    except ValueError:
        prov = {}
    knobs = prov.get("flower") if isinstance(prov, dict) else None
    if isinstance(knobs, dict):                # a Flower run: its id also hashes the recorded settings
        from fedprism.experiment.flower_id import flower_run_id

        try:
            if flower_run_id(cfg, knobs) == rid:
                return ""
        except (FedPrismError, ValueError, TypeError, KeyError):
            pass
    return (f"its id is not the hash of its configuration (that is {own}, its stored values hashed): a forged "
            "or damaged row")


def _named_sweep(row: tuple, i: int, src: Store, rid: str, sweeps: list[str]) -> tuple:
    """`row` of `runs` with its `sweep` column kept if named, else the first named sweep holding the run
    (None when only `runs` selected it)."""
    if row[i] in sweeps:
        return row
    held = {r[0] for r in src.db.execute("SELECT sweep FROM sweep_runs WHERE run_id=?", (rid,))}
    return (*row[:i], next((s for s in sweeps if s in held), None), *row[i + 1:])


def _train_ids(src: Store, chosen: set[str]) -> set[str]:
    """The train ids (the final state files' names) of the chosen runs of `src`."""
    from fedprism.experiment.config import Config

    ids = set()
    for rid in sorted(chosen):
        row = src.run(rid)
        try:                                  # the stored values as they are (see `_not_its_config`)
            ids.add(Config(json.loads(row["config"])).train_id)
        except (FedPrismError, ValueError, TypeError, KeyError):
            continue
    return ids


def _copy_finals(src_dir: Path, dst_dir: Path, train_ids: set[str] | None = None) -> int:
    """Final state files (`keep_final`) the other store has and this one lacks (named by train id), only
    those of `train_ids` when given. Only `<train id>.ckpt` plain files and `<train id>.rows` folders of
    plain files are copied (a link, a FIFO or any other name there is passed over, never read through),
    into owner-only folders, each new file created exclusively (a link at its place is never written)."""
    if not is_real_dir(src_dir):
        return 0
    n = 0
    for f in sorted(src_dir.iterdir()):
        tid, dot, kind = f.name.partition(".")
        if not dot or kind not in ("ckpt", "rows") or not valid_run_id(tid):
            continue
        if train_ids is not None and tid not in train_ids:
            continue
        target = dst_dir / f.name
        if os.path.lexists(target):
            continue
        if kind == "ckpt" and is_regular(f):
            private_dir(dst_dir)
            _copy_file(f, target)
        elif kind == "rows" and is_real_dir(f) and all(is_regular(x) for x in f.iterdir()):
            private_dir(dst_dir)
            private_dir(target)
            for x in sorted(f.iterdir()):
                _copy_file(x, target / x.name)
        else:
            continue
        n += 1
    return n


def _copy_file(src: Path, dst: Path, chunk: int = 1 << 20) -> None:
    with open_file(src, "rb") as fi, open_file(dst, "xb") as fo:
        while block := fi.read(chunk):
            fo.write(block)
