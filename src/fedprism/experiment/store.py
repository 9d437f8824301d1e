"""The results store: one SQLite file, every run, every round, every client.

Tables
    runs            one row per run: id (hash of resolved config), config, seed, code version, status,
                    provenance (JSON: what produced the run; NULL for runs stored before it existed)
    rounds          per-round metrics (JSON object) and wall time
    client_metrics  per-round, per-client accuracies and losses
    records         method- and runner-specific records (cluster assignments, rejected updates, ...)
    sweep_runs      which sweeps hold which runs, under which row label (a run whose config two
                    sweeps share is run once and belongs to both)

Writes are transactional per round (WAL mode), so a crash never leaves half a round. Checkpoints of
the algorithm state (weights) are NOT stored here: they live beside the database in `<db>.ckpt/`
(`fedprism.experiment.checkpoint`: JSON + raw tensor bytes, no pickle) and are deleted when the run
finishes, so a committed database holds metrics only.

Every table has a key: a round's records are keyed (run_id, round, seq), so writing a round twice
replaces it instead of duplicating it; stores of older versions are migrated when opened for
writing. One process at a time executes a run (`fedprism.experiment.runlock`). SQLite and file-system
failures (not a database, read-only, locked by another writer past `timeout` seconds, disk full) are
raised as `StoreError`, one line naming the file.

`Store(path, readonly=True)` opens an existing file with SQLite's `mode=ro`: it never creates the
file, never switches its journal mode and never migrates its schema, so reading a committed database
leaves every byte (and the mtime) as it was. Opening for writing adds columns that newer versions
need (`provenance`) to an older store. A finished run's final server and client state can be kept
beside the store (`<db>.final/`, same format as checkpoints) for re-scoring evaluation-only settings.

A store may come from elsewhere (a part of a sweep, an archive), so its contents are data, never paths
or trusted values:
* schema versions (`SCHEMA_VERSION`, kept in `PRAGMA user_version`): every earlier version is migrated
  on write-open (`migrate`) and read as the current one; a newer version, or a table with a column
  this version cannot fill, is refused before anything is written (`_not_writable_here`);
* a run id read from a store names a file beside it (lock, checkpoint, row folder) only when it has a
  run id's form (`valid_run_id`): an id such as `/etc/x.lock` or `../../y` names no file;
* a read-only store shows each table through a temporary view that leaves out rows that are not well
  formed (`ROW_OK`: JSON that is not a JSON object, a status or number of the wrong type, a config
  without the keys readers index) and makes an older schema look like the current one; a store open for
  writing refuses to resume or re-use a damaged row of the run it runs (`Store.run`, `Store.damage`);
* the folders beside it are owner-only and its files are opened without following links
  (`fedprism.experiment.safefs`); a WAL store in a folder this user may not write is read `immutable`.
"""

from __future__ import annotations

import json
import math
import os
import re
import sqlite3
import subprocess
import sys
import time
import urllib.parse
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from fedprism.errors import FedPrismError
from fedprism.hparams import plain
from fedprism.experiment.runlock import RunLock
from fedprism.experiment.safefs import is_real_dir, is_regular, private_dir

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY, name TEXT, method TEXT, dataset TEXT, seed INTEGER,
    config TEXT NOT NULL, code_version TEXT, status TEXT NOT NULL,
    rounds_done INTEGER NOT NULL DEFAULT 0, final TEXT, created REAL, updated REAL, sweep TEXT
);
CREATE TABLE IF NOT EXISTS rounds (
    run_id TEXT NOT NULL, round INTEGER NOT NULL, metrics TEXT NOT NULL, wall_s REAL,
    PRIMARY KEY (run_id, round)
);
CREATE TABLE IF NOT EXISTS client_metrics (
    run_id TEXT NOT NULL, round INTEGER NOT NULL, client INTEGER NOT NULL,
    local_acc REAL, local_loss REAL, global_acc REAL, n_test INTEGER, local_f1 REAL,
    PRIMARY KEY (run_id, round, client)
);
CREATE TABLE IF NOT EXISTS records (
    run_id TEXT NOT NULL, round INTEGER NOT NULL, kind TEXT NOT NULL, client INTEGER, data TEXT,
    seq INTEGER NOT NULL, PRIMARY KEY (run_id, round, seq)
);
CREATE INDEX IF NOT EXISTS records_run ON records (run_id, kind, round);
CREATE TABLE IF NOT EXISTS sweep_runs (
    sweep TEXT NOT NULL, run_id TEXT NOT NULL, label TEXT, PRIMARY KEY (sweep, run_id)
);
"""


def code_version() -> str:
    from fedprism import __version__
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        sha = ""
    return f"{__version__}+{sha}" if sha else __version__


def _checkpoint():
    """The checkpoint module, imported on first use: it needs torch, and a command that only reads the
    store (`fedprism runs`) never touches a checkpoint, so it starts without torch."""
    from fedprism.experiment import checkpoint
    return checkpoint


def _clean(x: Any) -> Any:
    """JSON-safe: tensors/arrays to lists, NaN/Inf to None."""
    torch = sys.modules.get("torch")              # a tensor exists only once torch is imported
    if torch is not None and isinstance(x, torch.Tensor):
        x = x.detach().cpu().tolist()
    if hasattr(x, "tolist") and not isinstance(x, (str, bytes)):
        x = x.tolist()
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def dumps(x: Any) -> str:
    return json.dumps(_clean(x), sort_keys=True, separators=(",", ":"))


def _quoted(path: Any) -> str:
    """A store's path as a shell word, for the commands an error names."""
    import shlex

    return shlex.quote(str(path))


def _json_or_none(s: str | None) -> dict | None:
    return json.loads(s) if s else None


#: columns added after the first release of the schema: (name, SQL type), added on write-open
MIGRATIONS = (("provenance", "TEXT"),)

#: the store's schema version, kept in SQLite's `PRAGMA user_version` from version 4 on (stores written
#: before it hold 0 and are recognised by their tables, `schema_version`):
#: 1 runs, rounds, client_metrics, records without a key (the first release);
#: 2 + sweep_runs (which sweeps hold which runs);
#: 3 + runs.provenance;
#: 4 records keyed (run_id, round, seq), and the version written into the file.
#: Opening for writing migrates 1-3 to 4 in one transaction; a higher version (a newer fedprism) is refused
#: before anything is written; reading (`readonly=True`) serves every version through temporary views.
SCHEMA_VERSION = 4

#: a run id: the first 16 hex digits of a SHA-256 (`Config.run_id`, `Config.train_id`, `flower_run_id`)
RUN_ID = re.compile(r"[0-9a-f]{16}")


def valid_run_id(run_id: Any) -> bool:
    """Whether `run_id` has the form of a run id (16 lowercase hex digits). Every path beside a store
    that is built from an id read from a store (its lock, checkpoint, row folder, kept final state) is
    built only from such an id: one that is a path (`/etc/x`, `../../y`) names no file of this store."""
    return isinstance(run_id, str) and RUN_ID.fullmatch(run_id) is not None


def check_run_id(run_id: Any, what: str = "run id") -> str:
    """`run_id` if it has the form of a run id, else `StoreError` naming it (a crafted or damaged store)."""
    if not valid_run_id(run_id):
        raise StoreError(f"{what} {str(run_id)[:80]!r} is not a run id (16 hex digits, the hash of a "
                         "configuration): the store is damaged or was crafted; no file is named after it")
    return run_id


def _obj(col: str) -> str:
    """SQL: `col` holds the text of a JSON object (json_type is asked only of valid JSON: it raises)."""
    return f"(typeof({col}) = 'text' AND CASE WHEN json_valid({col}) THEN json_type({col}) END = 'object')"


def _types(**cols: str) -> str:
    return " AND ".join(f"typeof({c}) IN ({', '.join(repr(t) for t in ts.split())})" for c, ts in cols.items())


_NUM = "real integer null"
#: SQL conditions a well-formed row of each table meets (what fedprism writes; what the readers assume)
ROW_OK = {
    "runs": (f"typeof(run_id) = 'text' AND length(run_id) = 16 AND run_id NOT GLOB '*[^0-9a-f]*' AND {_obj('config')}"
             f" AND (final IS NULL OR {_obj('final')}) AND (provenance IS NULL OR {_obj('provenance')})"
             f" AND status IN ({', '.join(repr(x) for x in ('running', 'finished', 'interrupted', 'failed'))})"
             " AND typeof(rounds_done) = 'integer' AND "
             + _types(seed="integer null", name="text null", method="text null", dataset="text null",
                      sweep="text null", code_version="text null", created=_NUM, updated=_NUM)),
    "rounds": f"typeof(run_id) = 'text' AND typeof(round) = 'integer' AND {_obj('metrics')} AND "
              + _types(wall_s=_NUM),
    "client_metrics": _types(run_id="text", round="integer", client="integer", local_acc=_NUM, local_loss=_NUM,
                             global_acc=_NUM, n_test="integer null", local_f1=_NUM),
    "records": "typeof(data) = 'text' AND json_valid(data) AND "
               + _types(run_id="text", round="integer", kind="text", client="integer null"),
    "sweep_runs": _types(sweep="text", run_id="text", label="text null"),
}


#: SQL: the run's config holds the keys every resolved configuration has and readers (reports, tables)
#: index. Required of the rows a read-only store shows and `fedprism merge` copies; a store open for
#: writing does not ask it of the run it executes (`Store.start_run` takes any config with a method)
CONFIG_OK = ("CASE WHEN json_valid(config) THEN " + " AND ".join(
    f"json_type(config, '$.{k}') = '{t}'" for k, t in (("method", "text"), ("dataset", "text"),
                                                        ("partition", "text"), ("seed", "integer"),
                                                        ("clients", "integer"), ("rounds", "integer"))) + " END")


def schema_version(db: sqlite3.Connection, schema: str = "main") -> int:
    """The schema version of the store open in `db` (`SCHEMA_VERSION`'s list); 0 for an empty file."""
    v = db.execute(f"PRAGMA {schema}.user_version").fetchone()[0]
    if v:
        return v
    tables = {r[0] for r in db.execute(f"SELECT name FROM {schema}.sqlite_master WHERE type='table'")}
    if "runs" not in tables:
        return 0
    if "sweep_runs" not in tables:
        return 1
    if "provenance" not in table_columns(db, "runs", schema):
        return 2
    return 3 if "seq" not in table_columns(db, "records", schema) else 4


class MissingStoreError(FedPrismError):
    """A read-only command was pointed at a results database that does not exist."""


#: a run's status: its row's `status`
STATUSES = ("running", "finished", "interrupted", "failed")


def _file_in_the_way(folder: Path) -> Path | None:
    """The existing file that `folder`, or a folder above it, is (so no folder can be made there), or None."""
    try:
        return next((q for q in (folder, *folder.parents) if q.exists() and not q.is_dir()), None)
    except (OSError, ValueError):                   # ValueError: a NUL character in the path
        return None


def _not_a_file(path: Path) -> str:
    """Why `path` can be no store file (a folder, or under a file), or ""."""
    if path.is_dir():
        return f"is a folder, not a file (name a file in it, e.g. {path / 'fedprism-results.db'})"
    blocker = _file_in_the_way(path.parent)
    return f"{blocker} is a file, not a folder" if blocker is not None else ""


def _linked_sidecar(path: Path) -> str:
    """Why SQLite must not open the store at `path`: a `-wal`, `-shm` or `-journal` file beside it (or
    beside the file a link to it names) that is a symbolic link, which SQLite would write through; or ""."""
    try:
        real = path.resolve()
    except (OSError, RuntimeError):
        real = path
    for base in dict.fromkeys((path, real)):
        for suffix in ("-wal", "-shm", "-journal"):
            side = Path(f"{base}{suffix}")
            if side.is_symlink():
                return (f"{side} is a symbolic link (SQLite would write through it); fedprism never follows links "
                        "beside a results store: remove it, or use another --db")
    return ""


def drop_if_new_and_empty(store: Store, created: bool) -> None:
    """Close `store` and delete its files if this process `created` it and it holds no run: a refused
    configuration leaves no empty store behind (`fedprism run`, the Flower ServerApp)."""
    if created and not store.runs():
        store.close()
        for suffix in ("", "-wal", "-shm", "-journal"):
            Path(str(store.path) + suffix).unlink(missing_ok=True)


class UnknownSweep(FedPrismError, ValueError):
    """`--sweep NAME` names no sweep of the store."""


class UnknownFilter(FedPrismError, ValueError):
    """A filter on stored runs (`fedprism.results(...)`, `Store.runs(...)`) names no column of `runs`."""


class StoreError(FedPrismError):
    """The results store cannot be opened or written (corrupt, read-only, locked, disk full)."""


def _create(db: sqlite3.Connection) -> None:
    """The schema, statement by statement (`executescript` would commit the open transaction)."""
    for stmt in SCHEMA.split(";"):
        if stmt.strip():
            db.execute(stmt)


def table_columns(db: sqlite3.Connection, table: str, schema: str | None = None) -> list[str]:
    """The column names of `table` in `db`, in order (none when it has no such table); `schema` 'main'
    reads the file's own table, not the view a read-only store shows in its place."""
    return [r[1] for r in db.execute(f"PRAGMA {schema + '.' if schema else ''}table_info({table})")]


def _read_views(db: sqlite3.Connection) -> None:
    """A read-only connection sees each table through a temporary view of the same name (temporary
    objects come first in SQLite's name lookup): rows that are not well formed (`ROW_OK`: an id that is no
    run id, JSON that is not JSON, a status or a number of the wrong type) are left out, and a store of an
    earlier schema looks like the current one (no `sweep_runs`: an empty table; no `provenance`: NULL;
    records without `seq`: numbered in their stored order). Nothing is written to the file."""
    main = {t: table_columns(db, t, "main") for t in ROW_OK}
    for stmt in SCHEMA.split(";"):               # a table the file lacks reads as empty
        t = stmt.split("EXISTS", 1)[-1].split("(", 1)[0].strip()
        if "CREATE TABLE" in stmt and not main.get(t):
            db.execute(stmt.replace("CREATE TABLE IF NOT EXISTS", "CREATE TEMP TABLE"))
    if main["sweep_runs"]:
        db.execute(f"CREATE TEMP VIEW sweep_runs AS SELECT * FROM main.sweep_runs WHERE {ROW_OK['sweep_runs']}")
    extra = ", NULL AS provenance" if "provenance" not in main["runs"] else ""
    db.execute(f"CREATE TEMP VIEW runs AS SELECT * FROM (SELECT *{extra} FROM main.runs) "
               f"WHERE {ROW_OK['runs']} AND {CONFIG_OK}")
    for t in ("rounds", "client_metrics"):
        if main[t]:
            db.execute(f"CREATE TEMP VIEW {t} AS SELECT * FROM main.{t} WHERE {ROW_OK[t]}")
    if main["records"]:
        seq = "" if "seq" in main["records"] else \
            ", ROW_NUMBER() OVER (PARTITION BY run_id, round ORDER BY rowid) - 1 AS seq"
        db.execute(f"CREATE TEMP VIEW records AS SELECT rowid AS rowid, *{seq} FROM main.records "
                   f"WHERE {ROW_OK['records']}")


#: the columns every version's tables have (the first schema's); a store without them is no results store
REQUIRED = {
    "runs": ("run_id", "name", "method", "dataset", "seed", "config", "code_version", "status", "rounds_done",
             "final", "created", "updated", "sweep"),
    "rounds": ("run_id", "round", "metrics", "wall_s"),
    "client_metrics": ("run_id", "round", "client", "local_acc", "local_loss", "global_acc", "n_test", "local_f1"),
    "records": ("run_id", "round", "kind", "client", "data"),
}


def _missing_columns(db: sqlite3.Connection) -> str:
    """What the store's tables lack of `REQUIRED` (and of `sweep_runs`), or "". A table other than `runs`
    that is not there at all is no fault: it is created (write) or read as empty (read-only)."""
    need = {**REQUIRED, "sweep_runs": ("sweep", "run_id", "label")}
    for t, want in need.items():
        have = table_columns(db, t, "main")
        if not have and t != "runs":
            continue
        if not have:
            return f"no table {t}"
        if lack := [c for c in want if c not in have]:
            return f"its {t} table lacks {', '.join(lack)}"
    return ""


def _not_writable_here(db: sqlite3.Connection) -> str:
    """Why this version must not write the store open in `db` (a newer schema: a higher version number,
    or columns it cannot fill), or ""."""
    v = schema_version(db)
    if v > SCHEMA_VERSION:
        return (f"it was written by a newer fedprism (schema version {v}; this version writes version "
                f"{SCHEMA_VERSION} and older); write it with that version, or use another --db")
    missing = _missing_columns(db)
    if missing:
        return f"it is not a fedprism results store of any version ({missing})"
    known = {**REQUIRED, "sweep_runs": ("sweep", "run_id", "label")}
    known = {**known, "runs": (*known["runs"], "provenance"), "records": (*known["records"], "seq")}
    for t in ROW_OK:
        for _, name, _, notnull, default, pk in db.execute(f"PRAGMA main.table_info({t})"):
            if name not in known[t] and notnull and default is None:
                return (f"its {t} table has a column {name!r} this version cannot fill (NOT NULL, no default): "
                        "a newer fedprism's schema; write it with that version, or use another --db")
    return ""


def migrate(db: sqlite3.Connection) -> int:
    """Bring the store open in `db` to `SCHEMA_VERSION` (inside the caller's transaction) from any earlier
    version; returns the version it had. 1 -> 2 creates `sweep_runs`, 2 -> 3 adds `runs.provenance`,
    3 -> 4 keys `records` (rows numbered in their stored order) and writes the version number."""
    was = schema_version(db)
    _migrate_records(db)
    _create(db)
    have = table_columns(db, "runs")
    for col, typ in MIGRATIONS:
        if col not in have:
            db.execute(f"ALTER TABLE runs ADD COLUMN {col} {typ}")
    if db.execute("PRAGMA user_version").fetchone()[0] != SCHEMA_VERSION:    # unchanged: no byte written
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    return was


def _migrate_records(db: sqlite3.Connection) -> None:
    """Stores written before records had a key: number each round's records in their old order."""
    cols = table_columns(db, "records")
    if not cols or "seq" in cols:          # a new store, or one already keyed
        return
    db.execute("ALTER TABLE records RENAME TO records_unkeyed")
    db.execute("DROP INDEX IF EXISTS records_run")
    _create(db)
    db.execute("INSERT INTO records (run_id, round, kind, client, data, seq) SELECT run_id, round, kind, client, data,"
               " ROW_NUMBER() OVER (PARTITION BY run_id, round ORDER BY rowid) - 1 FROM records_unkeyed"
               " ORDER BY rowid")
    db.execute("DROP TABLE records_unkeyed")


def _until_free(step, timeout: float) -> None:
    """Run `step` again while SQLite says the file is busy, for up to `timeout` seconds. Changing the
    journal mode of a file that another process is creating at the same moment fails with
    SQLITE_BUSY at once: SQLite does not call the busy handler for it, so `connect(timeout=...)`
    does not wait, and two processes starting one run together would see a spurious lock error."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return step()
        except sqlite3.OperationalError as e:
            if not ("locked" in str(e) or "busy" in str(e)) or time.monotonic() >= deadline:
                raise
            time.sleep(0.05)


def _sqlite_file(path: Path) -> bool:
    """Whether `path` is a file that begins with SQLite's header (read, never opened as a database: nothing
    is written; a FIFO or a folder is not opened at all)."""
    try:
        if not path.is_file():
            return False
        with open(path, "rb") as f:
            return f.read(16) == b"SQLite format 3\x00"
    except OSError:
        return False


def _dump_hint(path: Path) -> str:
    """How to build the missing store `path` from the dump beside it (`fedprism.experiment.archive`), or ""."""
    from fedprism.experiment.archive import build_hint
    return build_hint(path)


class Store:
    """`timeout`: seconds to wait for another writer's transaction (default `$FEDPRISM_DB_TIMEOUT` or
    10) before `StoreError`."""

    def __init__(self, path: str | Path = "fedprism-results.db", timeout: float | None = None,
                 readonly: bool = False):
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"Store: path = {path!r}; a file path (str or os.PathLike)")
        self.path = Path(path)
        self.readonly = readonly
        self._locks: dict[str, RunLock] = {}
        self._notes: dict[str, list[tuple[str, int | None, Any]]] = {}
        why = _not_a_file(self.path) or _linked_sidecar(self.path)
        if why:
            raise (MissingStoreError if readonly else StoreError)(f"results store {self.path}: {why}")
        if readonly:
            if not self.path.is_file():
                near = [str(p) for p in sorted(Path(".").glob("*.db")) + sorted(Path("results").glob("*.db"))
                        if p.resolve() != self.path.resolve() and _sqlite_file(p)]
                shown = ", ".join(near[:3]) + (", ..." if len(near) > 3 else "")
                raise MissingStoreError(f"no results store at {self.path} (check --db or $FEDPRISM_DB"
                                        + (f"; stores here: {shown}" if near else "") + ")"
                                        + (f"; {hint}" if (hint := _dump_hint(self.path)) else ""))
            self._real = self.path.resolve()        # SQLite keeps -wal / -shm beside the file a link names
            self._had = {x for x in ("-wal", "-shm") if Path(f"{self._real}{x}").exists()}
            self._immutable = False
            try:
                self.db = self._open_readonly()
                missing = _missing_columns(self.db)
                if missing:
                    self.db.close()
                    raise MissingStoreError(f"{self.path} is not a fedprism results store ({missing})")
                _read_views(self.db)
            except sqlite3.DatabaseError as e:
                what = "is corrupt" if "malformed" in str(e) else "is not a fedprism results store"
                raise MissingStoreError(f"{self.path} {what} ({e})") from None
            self.timeout = 60.0
            return
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))):
            raise TypeError(f"Store: timeout = {timeout!r}; seconds (a number) or None")
        if timeout is None:
            try:
                timeout = float(os.environ.get("FEDPRISM_DB_TIMEOUT", "10"))
            except ValueError:
                timeout = 10.0
        self.timeout = timeout if math.isfinite(timeout) and timeout >= 0 else 10.0
        self._locks: dict[str, RunLock] = {}
        self._notes: dict[str, list[tuple[str, int | None, Any]]] = {}
        if hint := _dump_hint(self.path):          # not a new empty store beside the dump it should be built from
            raise StoreError(f"no results store at {self.path}; {hint} (or choose another --db)")
        with self._errors("opening"):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.db = sqlite3.connect(str(self.path), timeout=timeout, isolation_level=None)
            self.db.row_factory = sqlite3.Row
            tables = sorted(r[0] for r in self.db.execute(
                "SELECT name FROM sqlite_master WHERE type='table'"))
            cols = set(table_columns(self.db, "runs"))
            if tables and not {"run_id", "config", "status"} <= cols:   # another program's: add nothing to it
                self.db.close()
                shown = ", ".join(tables[:5]) + (", ..." if len(tables) > 5 else "")
                raise StoreError(f"{self.path} is an SQLite database of something else (tables: {shown}), "
                                 "not a fedprism results store; choose another --db")
            why = _not_writable_here(self.db) if tables else ""
            if why:                                   # before the journal mode or anything else is written
                self.db.close()
                raise StoreError(f"results store {self.path}: {why}; nothing was written to it (this version "
                                 f"can read it: `fedprism runs --db {_quoted(self.path)}`, `show`, `report`, "
                                 "`export`)")
            _until_free(self._set_wal, self.timeout)
            self.db.execute("PRAGMA synchronous=NORMAL")
            with self.transaction():
                migrate(self.db)
            self._recover_stale()

    def _open_readonly(self) -> sqlite3.Connection:
        """A `mode=ro` connection. A store in WAL mode needs its `-shm` file, which SQLite cannot create in a
        folder this user may not write ('attempt to write a readonly database'): such a store is opened
        `immutable` instead (no locks, no `-shm`), which is exact when its write-ahead log is empty (as
        `close` leaves it); with a non-empty log that cannot be read without writing, it is an error."""
        # percent-encoded: a '#', '?' or '%' in the path would otherwise end or change the file name
        base = f"file:{urllib.parse.quote(self._real.as_posix())}?mode=ro"
        for uri in (base, base + "&immutable=1"):
            db = sqlite3.connect(uri, uri=True, timeout=60, isolation_level=None)
            db.row_factory = sqlite3.Row
            try:
                db.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchall()
                return db
            except sqlite3.OperationalError as e:
                db.close()
                if uri != base or not ("readonly" in str(e) or "unable to open" in str(e)):
                    raise
                wal = Path(f"{self._real}-wal")
                if wal.exists() and wal.stat().st_size > 0:
                    raise MissingStoreError(
                        f"{self.path} cannot be read by this user: it is in WAL mode, its folder is not writable "
                        f"here, and {wal.name} holds writes not yet folded into it (ask its owner to run any "
                        "fedprism command that writes it, or copy the store and its -wal file)") from None
                self._immutable = True
        raise AssertionError("unreachable")

    def _set_wal(self) -> None:
        if self.db.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
            self.db.execute("PRAGMA journal_mode=WAL")

    def _recover_stale(self) -> None:
        """A run marked 'running' whose lock nobody holds was stopped without being able to say so
        (killed, or its store could not be written at the end): mark it 'interrupted'."""
        for (run_id,) in self.db.execute("SELECT run_id FROM runs WHERE status='running'").fetchall():
            if not valid_run_id(run_id):  # a crafted id ('/etc/x', '../y'): no path is made of it, row left
                continue
            lock = RunLock(self.ckpt_dir / f"{run_id}.lock")
            try:
                lock.acquire()
            except (OSError, FedPrismError):
                continue                  # executed by another process right now (or unlockable)
            try:
                with self.transaction() as db:
                    db.execute("UPDATE runs SET status='interrupted' WHERE run_id=? AND status='running'", (run_id,))
            finally:
                lock.release()
                try:
                    self.ckpt_dir.rmdir()
                except OSError:
                    pass

    @contextmanager
    def _errors(self, doing: str) -> Iterator[None]:
        """SQLite and OS failures as one-line `StoreError`s naming the file and what was being done."""
        try:
            yield
        except sqlite3.DatabaseError as e:
            msg = str(e)
            if "locked" in msg or "busy" in msg:
                msg = f"locked by another writer (waited {self.timeout:g} s)"
            elif "not a database" in msg or "malformed" in msg:
                msg = f"not a fedprism results store, or corrupt ({msg})"
            elif "readonly" in msg or "read-only" in msg:
                msg = f"read-only ({msg})"
            raise StoreError(f"results store {self.path}: {msg} ({doing})") from None
        except OSError as e:
            raise StoreError(f"results store {self.path}: {e.strerror or e} ({doing})") from None

    def close(self) -> None:
        """Fold the write-ahead log into the database file (so a committed .db is complete) and close.
        Closing twice is harmless."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        if self.readonly:
            self.db.close()
            self._drop_wal_files()
            return
        for lock in self._locks.values():
            lock.release()
        self._locks.clear()
        try:
            self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.DatabaseError:
            pass                          # read-only or busy: the WAL stays for the next writer
        finally:
            self.db.close()

    def _drop_wal_files(self) -> None:
        """A read-only connection to a WAL store creates its -wal and -shm files and cannot remove them.
        When this store created them (there were none before) and no other connection is open, one plain
        connection that reads and closes lets SQLite remove them, as the last connection to close does
        (checkpointing first whatever a writer committed meanwhile, as any last connection would). With
        another connection open (a sweep writing) SQLite leaves them, as it must."""
        if self._had or not any(Path(f"{self._real}{x}").exists() for x in ("-wal", "-shm")):
            return
        try:
            con = sqlite3.connect(str(self._real), timeout=0)
            try:
                con.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchall()
            finally:
                con.close()
        except sqlite3.Error:
            pass                              # busy, or a file this user may not write: leave them

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @contextmanager
    def transaction(self, doing: str = "writing") -> Iterator[sqlite3.Connection]:
        # BEGIN inside the `try`: a signal that lands while SQLite waits for another writer's lock is
        # raised the moment BEGIN returns, and the open transaction must still be rolled back (else the
        # caller's next write, e.g. marking the run 'interrupted', finds a transaction within a transaction)
        with self._errors(doing):
            try:
                self.db.execute("BEGIN IMMEDIATE")
                yield self.db
                self.db.execute("COMMIT")
            except BaseException:
                if self.db.in_transaction:
                    try:
                        self.db.execute("ROLLBACK")
                    except sqlite3.DatabaseError:
                        pass
                raise

    # -- runs ---------------------------------------------------------------------------------------
    def run(self, run_id: str) -> sqlite3.Row | None:
        """The run's row, or None. A row of this id that is not well formed (`ROW_OK`: JSON that is not
        JSON, a status or number of the wrong type; a store opened for writing sees its rows as they are)
        is a `StoreError` naming it: it is neither resumed nor taken as this run's result."""
        row = self.db.execute("SELECT * FROM runs WHERE run_id=?", (run_id,)).fetchone()
        if row is not None and not self.readonly:
            why = self.damage(run_id, config_keys=False)
            if why:
                raise StoreError(f"results store {self.path}: run {run_id} is stored damaged ({why}); it is "
                                 f"neither resumed nor re-used: `fedprism merge {_quoted(self.path)} --db NEW.db` "
                                 "copies the store's sound runs into a new one, or use another --db")
        return row

    def damage(self, run_id: str, config_keys: bool = True) -> str:
        """What is not well formed (`ROW_OK`, and `CONFIG_OK` unless not `config_keys`) in the stored rows of
        run `run_id`, or "" (also for an id the store does not hold). Reads the file's own tables, not a
        read-only store's views."""
        if not valid_run_id(run_id):
            return f"its id {str(run_id)[:80]!r} is not a run id"
        cols = table_columns(self.db, "runs", "main")
        runs = "main.runs" if "provenance" in cols else "(SELECT *, NULL AS provenance FROM main.runs)"
        bad = self.db.execute(f"SELECT 1 FROM {runs} WHERE run_id=? AND NOT COALESCE(({ROW_OK['runs']}), 0)",
                              (run_id,)).fetchone()
        if bad is not None:
            return "its row in runs: a config, final or provenance that is no JSON object, or a value of the wrong type"
        if config_keys and self.db.execute(f"SELECT 1 FROM {runs} WHERE run_id=? AND NOT COALESCE(({CONFIG_OK}), 0)",
                                           (run_id,)).fetchone() is not None:
            return "its config lacks a key every configuration has (method, dataset, partition, seed, clients, rounds)"
        for t in ("rounds", "client_metrics", "records"):
            if not table_columns(self.db, t, "main"):
                continue
            n = self.db.execute(f"SELECT COUNT(*) FROM main.{t} WHERE run_id=? AND NOT COALESCE(({ROW_OK[t]}), 0)",
                                (run_id,)).fetchone()[0]
            if n:
                return f"{n} row(s) of {t} that are not well formed (JSON that is not JSON, values of the wrong type)"
        return ""

    def hidden(self) -> int:
        """How many rows of the file a read-only store leaves out as not well formed (`ROW_OK`); 0 for a
        store open for writing (which shows no views)."""
        if not self.readonly:
            return 0
        n = 0
        for t in ROW_OK:
            if table_columns(self.db, t, "main"):
                n += (self.db.execute(f"SELECT COUNT(*) FROM main.{t}").fetchone()[0]
                      - self.db.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0])
        return n

    def start_run(self, run_id: str, config: dict, sweep: str | None = None,
                  provenance: dict | None = None) -> sqlite3.Row:
        """Create the run if new; return its row (status 'running' unless already finished).

        `provenance` (see `fedprism.experiment.provenance`) is stored with a new run. For a stored run
        whose recorded code or data fingerprint differs from `provenance`'s, `ProvenanceMismatch` is
        raised: the stored result is never returned (nor resumed) as if this code had produced it.
        A non-empty `name` in `config` relabels a stored run (its id and results stay as they are).
        """
        from fedprism.experiment.provenance import ProvenanceMismatch, differences, with_text

        check_run_id(run_id)
        now = time.time()
        row = self.run(run_id)
        took = run_id not in self._locks
        if row is None or row["status"] != "finished":
            self.lock(run_id)             # RunBusyError when another process executes this run
        try:
            with self.transaction() as db:
                row = db.execute("SELECT * FROM runs WHERE run_id=?", (run_id,)).fetchone()
                if row is None:
                    db.execute(
                        "INSERT INTO runs (run_id, name, method, dataset, seed, config, code_version, status,"
                        " created, updated, sweep, provenance) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                        (run_id, config.get("name", ""), config["method"], config["dataset"], config["seed"],
                         dumps(config), code_version(), "running", now, now, sweep,
                         dumps(provenance) if provenance is not None else None))
                else:
                    if provenance is not None:
                        diff = differences(_json_or_none(row["provenance"]), provenance)
                        if diff:                 # the hints with this store's --db (they import the methods)
                            from fedprism.experiment.fresh import fix_for_cli_run, verify_hint

                            raise ProvenanceMismatch.of(run_id, diff, fix_for_cli_run(run_id, self.path),
                                                        verify_hint(run_id, self.path, config["method"]))
                        self._add_text(db, run_id, with_text(_json_or_none(row["provenance"]), provenance))
                    if config.get("name") and config["name"] != row["name"]:
                        self._rename(db, row, config["name"])
                if sweep is not None:
                    db.execute("INSERT OR REPLACE INTO sweep_runs VALUES (?,?,?)",
                               (sweep, run_id, config.get("name")))
                if row is not None and row["status"] != "finished":
                    db.execute("UPDATE runs SET status='running', updated=?, code_version=? WHERE run_id=?",
                               (now, code_version(), run_id))
                    if provenance is not None and row["provenance"] is None:
                        db.execute("UPDATE runs SET provenance=? WHERE run_id=?", (dumps(provenance), run_id))
        except BaseException:             # refused (ProvenanceMismatch) or not written: the transaction is
            if took:                      # rolled back, nothing was started, the lock this call took goes
                self.unlock(run_id)
            raise
        if row is not None and row["status"] == "finished":
            self.unlock(run_id)           # finished meanwhile: nothing to execute
        return self.run(run_id)

    @staticmethod
    def _add_text(db: sqlite3.Connection, run_id: str, upgraded: dict | None) -> None:
        if upgraded is not None:        # `provenance.with_text`: the same files, now also hashed as text
            db.execute("UPDATE runs SET provenance=? WHERE run_id=?", (dumps(upgraded), run_id))

    def add_text_fingerprints(self, run_id: str, stored: dict | None, current: dict) -> None:
        """Record the `text` code hashes of `current` with a stored run (its provenance `stored`) whose
        files are unchanged (`fedprism.experiment.provenance.with_text`); nothing when there is none."""
        from fedprism.experiment.provenance import with_text

        upgraded = with_text(stored, current)
        if upgraded is not None:
            with self.transaction() as db:
                self._add_text(db, run_id, upgraded)

    @staticmethod
    def _rename(db: sqlite3.Connection, row: sqlite3.Row, name: str) -> None:
        cfg = json.loads(row["config"])
        cfg["name"] = name                       # `name` is execution-only: the run id does not change
        db.execute("UPDATE runs SET name=?, config=? WHERE run_id=?", (name, dumps(cfg), row["run_id"]))

    def rename(self, run_id: str, name: str) -> None:
        """Store a new label for a run; its id, config values and results are unchanged."""
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"Store.rename: name {name!r} is not a label (a string that is not blank)")
        with self.transaction() as db:
            row = db.execute("SELECT * FROM runs WHERE run_id=?", (run_id,)).fetchone()
            if row is None:
                raise FedPrismError(f"no run {run_id} in {self.path}")
            self._rename(db, row, name)

    def _held(self, db: sqlite3.Connection, run_id: str) -> None:
        """An error naming the id and the store unless the store holds run `run_id`."""
        if db.execute("SELECT 1 FROM runs WHERE run_id=?", (run_id,)).fetchone() is None:
            raise FedPrismError(f"no run {run_id!r} in {self.path} (`fedprism runs --db {_quoted(self.path)}` "
                                "lists them; "
                                "`Store.find(prefix)` resolves a prefix)")

    def forget(self, run_id: str) -> None:
        """Drop a run completely (its row, rounds, client rows, records and checkpoint): `--fresh`.
        Sweep memberships are kept, so the run that replaces it under the same id stays in its sweeps. An
        id the store does not hold is an error (nothing is changed)."""
        with self.transaction() as db:
            self._held(db, run_id)
            for t in ("rounds", "client_metrics", "records", "runs"):
                db.execute(f"DELETE FROM {t} WHERE run_id=?", (run_id,))
        self.drop_checkpoint(run_id)

    def provenance(self, run_id: str) -> dict | None:
        row = self.run(run_id)
        if row is None or "provenance" not in row.keys():
            return None
        return _json_or_none(row["provenance"])

    def with_prefix(self, prefix: str, cols: str = "*") -> list[sqlite3.Row]:
        """The runs whose id starts with `prefix`; none for an empty prefix or one with SQL wildcards."""
        if not prefix or "%" in prefix or "_" in prefix:
            return []
        return self.db.execute(f"SELECT {cols} FROM runs WHERE run_id LIKE ? ORDER BY run_id",
                               (prefix + "%",)).fetchall()

    def find(self, prefix: str) -> sqlite3.Row:
        """The run whose id starts with `prefix` (an unambiguous prefix, as git accepts)."""
        rows = self.with_prefix(prefix)
        if not rows:
            raise FedPrismError(f"no run {prefix!r} in {self.path} (`fedprism runs --db {_quoted(self.path)}` "
                                "lists them)")
        if len(rows) > 1:
            raise FedPrismError(f"run id prefix {prefix!r} is ambiguous: {', '.join(r['run_id'] for r in rows[:5])}")
        return rows[0]

    def lock(self, run_id: str) -> None:
        """Hold the run's lock (`runlock`) until `finish`, `mark` or `close`."""
        if run_id not in self._locks:
            lock = RunLock(self.ckpt_dir / f"{check_run_id(run_id)}.lock")
            with self._errors("locking the run"):
                lock.acquire()
            self._locks[run_id] = lock
            self._drop_orphans(run_id)

    def _drop_orphans(self, run_id: str) -> None:
        """Temporary files of the run's checkpoint that a killed process left (`<run_id>.ckpt.*.tmp`, the
        checkpoint writer's `mkstemp` names): only the run's lock holder writes them, and it holds the lock
        now, so none is being written. Unlinking removes a planted link itself, never what it names."""
        for f in self.ckpt_dir.glob(f"{run_id}.ckpt.*.tmp"):
            if is_regular(f) or f.is_symlink():
                try:
                    f.unlink()
                except OSError:
                    pass

    def lock_path(self, run_id: str) -> Path | None:
        """The run's lock file, or None for an id that is no run id (no path is made of it)."""
        return self.ckpt_dir / f"{run_id}.lock" if valid_run_id(run_id) else None

    def unlock(self, run_id: str) -> None:
        lock = self._locks.pop(run_id, None)
        if lock is not None:
            lock.release()
            try:
                self.ckpt_dir.rmdir()
            except OSError:
                pass

    def truncate(self, run_id: str, after_round: int) -> None:
        """Drop rows of rounds > after_round (rounds redone after resuming from a checkpoint). An id the
        store does not hold is an error (nothing is changed)."""
        with self.transaction() as db:
            self._held(db, run_id)
            for t in ("rounds", "client_metrics", "records"):
                db.execute(f"DELETE FROM {t} WHERE run_id=? AND round>?", (run_id, after_round))
            db.execute("UPDATE runs SET rounds_done=? WHERE run_id=?", (after_round + 1, run_id))
            # notes of `load_checkpoint` (a discarded checkpoint) belong to the round the run restarts
            # from; negative seq keeps them apart from that round's own records
            for i, (kind, client, data) in enumerate(self._notes.pop(run_id, [])):
                db.execute("INSERT OR REPLACE INTO records (run_id, round, kind, client, data, seq)"
                           " VALUES (?,?,?,?,?,?)", (run_id, after_round + 1, kind, client, dumps(data), -1 - i))

    def write_round(self, run_id: str, rnd: int, metrics: dict | None, clients: list[tuple] | None,
                    records: list[tuple[str, int | None, Any]], wall_s: float) -> None:
        """One transaction: round metrics, per-client rows, records, progress counter. Writing the
        same round again replaces it (every row is keyed by run and round)."""
        with self.transaction() as db:
            if metrics is not None:
                db.execute("INSERT OR REPLACE INTO rounds VALUES (?,?,?,?)", (run_id, rnd, dumps(metrics), wall_s))
            if clients:
                db.executemany("INSERT OR REPLACE INTO client_metrics VALUES (?,?,?,?,?,?,?,?)",
                               [(run_id, rnd, *map(_clean, c)) for c in clients])
            db.execute("DELETE FROM records WHERE run_id=? AND round=? AND seq>=0", (run_id, rnd))
            if records:
                db.executemany("INSERT INTO records (run_id, round, kind, client, data, seq) VALUES (?,?,?,?,?,?)",
                               [(run_id, rnd, k, c, dumps(d), i) for i, (k, c, d) in enumerate(records)])
            cur = db.execute("UPDATE runs SET rounds_done=?, updated=? WHERE run_id=?",
                             (rnd + 1, time.time(), run_id))
            if cur.rowcount == 0:                 # raised inside: the round's rows are rolled back with it
                raise StoreError(self._gone(run_id, f"round {rnd + 1} not written"))

    def finish(self, run_id: str, final: dict, status: str = "finished") -> None:
        try:
            with self.transaction() as db:
                cur = db.execute("UPDATE runs SET status=?, final=?, updated=? WHERE run_id=?",
                                 (status, dumps(final), time.time(), run_id))
                if cur.rowcount == 0:
                    raise StoreError(self._gone(run_id, f"its end ({status}) not written"))
        finally:
            if status != "running":
                self.unlock(run_id)

    def _gone(self, run_id: str, what: str) -> str:
        return (f"results store {self.path}: run {run_id} is not in it (never started here, or dropped while "
                f"it ran); {what}")

    def mark(self, run_id: str, status: str) -> None:
        """Set a run's status; for any status but 'running' the run's lock is released (even when the
        store cannot be written: the lock, not the row, says whether a process executes the run)."""
        if status not in STATUSES:
            raise ValueError(f"Store.mark: status {status!r} is not one of {', '.join(STATUSES)}")
        try:
            with self.transaction() as db:
                db.execute("UPDATE runs SET status=?, updated=? WHERE run_id=?", (status, time.time(), run_id))
        finally:
            if status != "running":
                self.unlock(run_id)

    def annotate(self, run_id: str, kind: str, data: Any, slot: int) -> None:
        """A record about the run as a whole rather than one of its rounds: stored at round -1, which
        neither `truncate` (resuming drops rounds after the checkpoint's, never below 0) nor `write_round`
        touches, so it outlives an interrupted run's resumption; `forget` (`--fresh`) drops it with the
        run. `slot` (< 0) keys it among the run's other such records: the same slot again replaces it.
        `fedprism tune` keeps each trial's parameters and value this way (experiment/tune.py)."""
        if isinstance(slot, bool) or not isinstance(slot, int) or slot >= 0:
            raise ValueError(f"Store.annotate: slot={slot!r}; a negative integer")
        with self.transaction() as db:
            self._held(db, run_id)
            db.execute("INSERT OR REPLACE INTO records (run_id, round, kind, client, data, seq) VALUES (?,?,?,?,?,?)",
                       (run_id, -1, kind, None, dumps(data), slot))

    def annotations(self, kind: str) -> list[tuple[str, Any]]:
        """(run id, data) of every `annotate`d record of `kind`, over all runs, in stored order."""
        rows = self.db.execute("SELECT run_id, data FROM records WHERE round=-1 AND kind=? ORDER BY run_id, seq",
                               (kind,)).fetchall()
        return [(r[0], self._json(r[1], r[0], f"{kind} record", object)) for r in rows]

    # -- reading -----------------------------------------------------------------------------------
    def add_to_sweep(self, sweep: str, run_id: str, label: str | None) -> None:
        with self.transaction() as db:
            db.execute("INSERT OR REPLACE INTO sweep_runs VALUES (?,?,?)", (sweep, run_id, label))

    def leave_sweep(self, sweep: str, run_id: str) -> None:
        """The run no longer belongs to `sweep` (it stays in the store, and in any other sweep)."""
        with self.transaction() as db:
            db.execute("DELETE FROM sweep_runs WHERE sweep=? AND run_id=?", (sweep, run_id))
            db.execute("UPDATE runs SET sweep=NULL WHERE run_id=? AND sweep=?", (run_id, sweep))

    def sweeps(self) -> list[str]:
        """Names of the sweeps that hold runs in this store, sorted."""
        rows = self.db.execute("SELECT sweep FROM sweep_runs UNION "
                               "SELECT sweep FROM runs WHERE sweep IS NOT NULL")
        return sorted(r[0] for r in rows)

    def require_sweeps(self, names: list[str]) -> None:
        """`UnknownSweep` for a name no sweep in this store has: a mistyped `--sweep` would otherwise read as
        a sweep without runs (an empty table, an empty report)."""
        from fedprism.experiment.config import suggest

        known = self.sweeps()
        for name in names:
            if name not in known:
                raise UnknownSweep(f"no sweep {name!r} in {self.path}{suggest(name, known)}; sweeps here: "
                                   f"{', '.join(known) or 'none'}")

    def runs(self, **where: Any) -> list[sqlite3.Row]:
        """Run rows matching column values; `sweep=NAME` means the runs that sweep holds, with its labels.
        A key that is not a column of `runs` is an `UnknownFilter` naming the columns (never SQL)."""
        columns = table_columns(self.db, "runs")
        for k in where:
            if k not in columns:
                from fedprism.experiment.config import suggest

                raise UnknownFilter(f"no run column {k!r} to filter on{suggest(k, columns)}; columns: "
                                    f"{', '.join(columns)}")
        where = {k: plain(v) for k, v in where.items()}          # np.int64(0) matches seed 0
        for k, v in where.items():
            if not isinstance(v, (str, int, float)) or isinstance(v, bool):
                raise UnknownFilter(f"filter {k}={v!r}: one value (a string or a number) per column")
        if "sweep" in where:
            sweep = where.pop("sweep")
            q = ("SELECT runs.*, COALESCE(m.label, runs.name) AS label FROM runs LEFT JOIN sweep_runs m"
                 " ON m.run_id = runs.run_id AND m.sweep = ? WHERE (m.sweep IS NOT NULL OR runs.sweep = ?)")
            args = (sweep, sweep, *where.values())
            q += "".join(f" AND runs.{k}=?" for k in where) + self._sound("runs.run_id", " AND ")
            return self.db.execute(q + " ORDER BY runs.created", args).fetchall()
        q = "SELECT *, name AS label FROM runs"
        if where:
            q += " WHERE " + " AND ".join(f"{k}=?" for k in where)
        q += self._sound("run_id", " AND " if where else " WHERE ")
        return self.db.execute(q + " ORDER BY created", tuple(where.values())).fetchall()

    def _sound(self, col: str, joint: str) -> str:
        """SQL keeping only well-formed runs (`ROW_OK`) in a store open for writing: its searches (a sweep's
        earlier runs, a kept final state to re-score) pass over damaged rows. A read-only store's views
        already leave them out."""
        return "" if self.readonly else (f"{joint}{col} IN (SELECT run_id FROM main.runs WHERE {ROW_OK['runs']} "
                                         f"AND {CONFIG_OK})")

    def _known(self, run_id: str, rows: list) -> list:
        """`rows`, unless they are none because `run_id` names no run: that is an error, not an empty
        answer (it would read as 'no rows yet')."""
        if not rows:
            self._held(self.db, run_id)
        return rows

    def round_metrics(self, run_id: str) -> list[dict]:
        rows = self._known(run_id, self.db.execute(
            "SELECT round, metrics, wall_s FROM rounds WHERE run_id=? ORDER BY round", (run_id,)).fetchall())
        return [{"round": r["round"], "wall_s": r["wall_s"], **self._json(r["metrics"], run_id, "round metrics")}
                for r in rows]

    def _json(self, text: Any, run_id: str, what: str, kind: type = dict) -> Any:
        """A stored JSON column, parsed; a `StoreError` naming the run when it is not JSON of `kind` (a store
        open for writing shows its rows as they are: a crafted or damaged one)."""
        try:
            value = json.loads(text)
        except (TypeError, ValueError, RecursionError):
            value = None
        if not isinstance(value, kind):
            raise StoreError(f"results store {self.path}: run {run_id}'s {what} is not a JSON "
                             f"{'object' if kind is dict else 'value'} (the store is damaged or was crafted)")
        return value

    def client_rows(self, run_id: str, rnd: int | None = None) -> list[sqlite3.Row]:
        """One row per client of round `rnd` (0-based; default: the last round with client rows)."""
        rnd = plain(rnd)
        if rnd is not None and (isinstance(rnd, bool) or not isinstance(rnd, int)):
            raise FedPrismError(f"client_rows: rnd={rnd!r} is not a round number (an integer, 0-based)")
        if rnd is None:
            rnd = self.db.execute("SELECT MAX(round) FROM client_metrics WHERE run_id=?", (run_id,)).fetchone()[0]
        q = "SELECT * FROM client_metrics WHERE run_id=? AND round=? ORDER BY client"
        return self._known(run_id, self.db.execute(q, (run_id, rnd)).fetchall())

    def records(self, run_id: str, kind: str | None = None) -> list[dict]:
        q, args = "SELECT round, kind, client, data FROM records WHERE run_id=?", [run_id]
        if kind:
            q += " AND kind=?"
            args.append(kind)
        # a store of an older schema opened read-only has no `seq` (never migrated): its rowid order is the same
        keyed = "seq" in table_columns(self.db, "records")
        q += " ORDER BY round, seq" if keyed else " ORDER BY rowid"
        return self._known(run_id, [{"round": r[0], "kind": r[1], "client": r[2],
                                     "data": self._json(r[3], run_id, f"{r[1]} record", object)}
                                    for r in self.db.execute(q, args)])

    # -- checkpoints (beside the db, never inside) -------------------------------------------------
    @property
    def ckpt_dir(self) -> Path:
        return self.path.with_name(self.path.name + ".ckpt")

    def checkpoint_path(self, run_id: str) -> Path:
        return self.ckpt_dir / f"{check_run_id(run_id)}{_checkpoint().SUFFIX}"

    def save_checkpoint(self, run_id: str, payload: dict, binding: dict | None = None,
                        key: bytes | None = None) -> None:
        """Write the run's checkpoint, bound to `binding` and signed with `key` (`checkpoint.save`)."""
        with self._errors(f"writing the checkpoint of run {run_id}"):
            private_dir(self.ckpt_dir)          # owner only, never a link; the file is written by mkstemp
            _checkpoint().save(self.checkpoint_path(run_id), payload, binding, key)

    def load_checkpoint(self, run_id: str, binding: dict | None = None, key: bytes | None = None,
                        max_bytes: int | None = None) -> dict | None:
        """The run's checkpoint, or None. A checkpoint that cannot be trusted (unreadable, truncated,
        modified, not signed with `key`, bound to another run than `binding`, or a pickle of an older
        version: pickle can run code) is deleted, never loaded; the run starts from round 0 and a
        `checkpoint_discarded` record says why. One that cannot be used as it is (`CheckpointRefused`:
        another format version, more than `max_bytes`, ...) is raised, naming the file, and kept."""
        reasons = []
        legacy = self.ckpt_dir / f"{check_run_id(run_id)}.pt"
        if os.path.lexists(legacy):
            reasons.append((legacy, "a pickle checkpoint (older format, or planted): pickle can run code, never loaded"))
        p, ck = self.checkpoint_path(run_id), _checkpoint()
        payload = None
        if os.path.lexists(p) and not is_regular(p):
            reasons.append((p, "not a regular file (a link or a special file, planted): never read"))
        elif p.exists():
            try:
                payload = ck.load(p, binding, key, max_bytes)
                if not (isinstance(payload, dict) and payload.get("run_id") == run_id
                        and isinstance(payload.get("round"), int) and isinstance(payload.get("state"), dict)):
                    raise ck.CheckpointError("not a checkpoint of this run")
            except ck.CheckpointError as e:
                reasons.append((p, str(e)))
                payload = None
        for path, why in reasons:
            try:
                path.unlink(missing_ok=True)
            except OSError:
                pass
            self._notes.setdefault(run_id, []).append(
                ("checkpoint_discarded", None, {"file": path.name, "reason": why}))
        return payload

    @property
    def final_dir(self) -> Path:
        return self.path.with_name(self.path.name + ".final")

    def save_final(self, train_id: str, payload: dict, binding: dict | None = None,
                   key: bytes | None = None) -> None:
        """Keep a finished run's final server and client state (beside the store, in the checkpoint
        format, bound to `binding` and signed with `key`), so that evaluation-only settings can re-score
        it without training (`keep_final=false` opts out)."""
        ck = _checkpoint()
        with self._errors(f"writing the final state {train_id}"):
            private_dir(self.final_dir)
            ck.save(self.final_dir / f"{check_run_id(train_id, 'train id')}{ck.SUFFIX}", payload, binding, key)

    def final_path(self, train_id: str) -> Path:
        """The file of the final state kept for training identity `train_id`."""
        return self.final_dir / f"{check_run_id(train_id, 'train id')}{_checkpoint().SUFFIX}"

    def drop_final(self, train_id: str) -> bool:
        """Delete the final state kept for `train_id` and its row files (`--fresh`); False if there is none."""
        import shutil

        p = self.final_path(train_id)
        rows = self.final_rows_dir(train_id)
        had = os.path.lexists(p) or os.path.lexists(rows)
        p.unlink(missing_ok=True)
        if os.path.islink(rows):
            rows.unlink()
        shutil.rmtree(rows, ignore_errors=True)
        return had

    def load_final(self, train_id: str, binding: dict | None = None, key: bytes | None = None,
                   max_bytes: int | None = None) -> dict | None:
        """A kept final state, or None (also when it cannot be trusted: it is then deleted, unless the
        store is open read-only, which writes nothing). One that cannot be used as it is
        (`CheckpointRefused`) is raised, naming the file, and kept."""
        ck = _checkpoint()
        p = self.final_dir / f"{check_run_id(train_id, 'train id')}{ck.SUFFIX}"
        if not is_regular(p) or not is_real_dir(self.final_dir):   # a link is never read through
            return None
        try:
            payload = ck.load(p, binding, key, max_bytes, what="kept final state")
        except ck.CheckpointError:
            if not self.readonly:
                p.unlink(missing_ok=True)
            return None
        if isinstance(payload, dict) and "client_rows" in payload and not is_real_dir(self.final_rows_dir(train_id)):
            return None                       # `state.storage=mmap`: its row files are gone
        return payload if isinstance(payload, dict) and isinstance(payload.get("state"), dict) else None

    def rows_dir(self, run_id: str) -> Path:
        """Where a run with `state.storage=mmap` keeps its clients' row files (beside its checkpoint)."""
        return self.ckpt_dir / f"{check_run_id(run_id)}.rows"

    def final_rows_dir(self, train_id: str) -> Path:
        """The row files of a kept final state (`state.storage=mmap`), beside it."""
        return self.final_dir / f"{check_run_id(train_id, 'train id')}.rows"

    def discard_checkpoint(self, run_id: str, why: str) -> None:
        """Delete a checkpoint that cannot be resumed from; the run's next round-0 write records why."""
        p = self.checkpoint_path(run_id)
        p.unlink(missing_ok=True)
        self._notes.setdefault(run_id, []).append(("checkpoint_discarded", None, {"file": p.name, "reason": why}))

    def drop_checkpoint(self, run_id: str) -> None:
        import shutil

        shutil.rmtree(self.rows_dir(run_id), ignore_errors=True)
        self.checkpoint_path(run_id).unlink(missing_ok=True)
        try:
            self.ckpt_dir.rmdir()
        except OSError:
            pass
