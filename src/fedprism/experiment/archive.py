"""A results store as text files, one per run: what git holds of a store (`fedprism store dump` / `load`).

A SQLite file is rewritten whole by every change, so committing one makes every new run cost the
repository the whole file again. A dump instead grows by what it adds:

    DIR/store.json              what is not per run: the dump's format, SQLite's `user_version` and page
                                size, the schema (every CREATE statement, in the store's order), each
                                table's columns and kind, and the rows of tables that belong to no run
                                (none today)
    DIR/runs/<run_id>.json.gz   one run: every row of every table that has a `run_id` column (`runs`,
                                `rounds`, `client_metrics`, `records`) that belongs to it, with its rowid,
                                in rowid order
    DIR/sweeps/<sweep>.json     one sweep's membership rows (`sweep_runs`), sorted by run id

Adding a run adds one run file and changes the membership file of each sweep it joins; no other file
changes (`store.json` holds no list of runs). A run file's text is JSON with one table row per line:
its values as SQLite returns them (text, integer, real, NULL; a blob as `{"blob": base64}`), floats in
Python's shortest round-trip form (`repr`: every bit comes back, -0.0 and subnormals included; an
infinity as `Infinity`), the `run_id` column left out (the file's `run_id` names it). It is gzipped at
level 9 with mtime 0 and no file name, so the same run gives the same bytes under the same zlib; `dump`
compares decompressed text, so a machine whose zlib packs differently rewrites nothing.

`load` builds a store from a dump: the schema's statements in their order, then every table's rows in
rowid order with their rowids, the `user_version`, one transaction into a temporary file beside the
target that is then linked into place (never over an existing file). The same dump gives the same rows
in the same order, and under the same SQLite the same bytes. Each run is checked as `fedprism merge`
checks a run from elsewhere: its id is a run id and the hash of its stored configuration
(`merge.id_problem`); one run that is not refuses the whole dump, naming it (a result filed under the id
of another configuration would otherwise become that configuration's stored result). A target that
exists is left alone: loaded already (the same rows), nothing is written; different, `load` refuses.

`dump` reads the store read-only (`Store(readonly=True)`: no byte of it changes) inside one read
transaction, so a sweep writing to it meanwhile is seen as of one moment; rows the store cannot place in a
run file (a row naming no stored run, a run id that is no run id) are refused, never dropped, and so is a
run whose id is not the hash of its configuration (a dump that `load` would refuse).
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import os
import re
import shlex
import sqlite3
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from fedprism.errors import FedPrismError
from fedprism.experiment.store import Store, schema_version, valid_run_id

#: format tags of the three kinds of file (a loader refuses a tag it does not know)
STORE_FORMAT = "fedprism-store-dump/1"
RUN_FORMAT = "fedprism-run/1"
SWEEP_FORMAT = "fedprism-sweep/1"
META = "store.json"
RUNS = "runs"
SWEEPS = "sweeps"
RUN_FILE = re.compile(r"([0-9a-f]{16})\.json\.gz")
#: the table of sweep membership (one file per sweep); every other table with a `run_id` column is per run
MEMBERSHIP = "sweep_runs"


class ArchiveError(FedPrismError):
    """A dump cannot be written from this store, or read into one."""


# -- text ----------------------------------------------------------------------------------------------
def _value(v: Any) -> Any:
    """A SQLite value as JSON: a blob (bytes) as {"blob": base64}; everything else as it is."""
    return {"blob": base64.b64encode(bytes(v)).decode("ascii")} if isinstance(v, (bytes, memoryview)) else v


def _unvalue(v: Any) -> Any:
    if isinstance(v, dict):
        if set(v) != {"blob"} or not isinstance(v["blob"], str):
            raise ValueError(f"a value {json.dumps(v)[:80]} is neither text, a number, null nor "
                             '{"blob": ...}')
        return base64.b64decode(v["blob"], validate=True)
    if isinstance(v, list):
        raise ValueError("a value is a list (a row's values are text, numbers, null or a blob)")
    return v


def _row(values: Iterable[Any]) -> str:
    """One row, one line: compact, ASCII, floats by `repr` (round-trip exact), infinities as Infinity."""
    return json.dumps([_value(v) for v in values], separators=(",", ":"))


def _tables_text(head: dict, tables: dict[str, tuple[list[str], list[str]]]) -> str:
    """`head`'s keys, then "tables": {name: {"columns": [...], "rows": [one row per line]}} (names sorted)."""
    out = [json.dumps(head, sort_keys=True, separators=(",", ":"))[:-1] + ',"tables":{']
    for i, (name, (cols, rows)) in enumerate(sorted(tables.items())):
        head_cols = json.dumps(cols, separators=(",", ":"))
        out.append(("," if i else "") + f'{json.dumps(name)}:{{"columns":{head_cols},"rows":[')
        out.append(",\n".join(rows))
        out.append("]}")
    return "\n".join(out) + "}}\n"


def _gzip(text: str) -> bytes:
    return gzip.compress(text.encode("ascii"), compresslevel=9, mtime=0)


def sweep_file(name: str) -> str:
    """The file name of sweep `name`'s membership: the name percent-encoded (a '/' or '..' names no folder),
    a leading '.' too (no hidden file)."""
    if not isinstance(name, str) or not name:
        raise ArchiveError(f"sweep name {name!r}: a sweep's membership file is named after it; an empty or "
                           "non-text name cannot be dumped (rename the sweep's rows first)")
    quoted = urllib.parse.quote(name, safe="")
    return ("%2E" + quoted[1:] if quoted.startswith(".") else quoted) + ".json"


# -- reading a store -----------------------------------------------------------------------------------
@dataclass
class Snapshot:
    """A store as the dump's texts: `meta` (store.json), run id -> run text,
    sweep name -> membership text, and each run's (config, provenance) for the id check."""
    meta: dict
    runs: dict[str, str]
    sweeps: dict[str, str]
    configs: dict[str, tuple[Any, Any]] = field(default_factory=dict)


def _has_rowid(sql: str | None) -> bool:
    return not (sql and re.search(r"\bWITHOUT\s+ROWID\b", sql, re.I))


def snapshot(path: str | Path) -> Snapshot:
    """Everything of the store at `path` as a dump's texts, read in one read transaction
    (`Store(readonly=True)`: the file is not changed). `ArchiveError` for rows that no run file can hold."""
    with Store(path, readonly=True) as st:
        db = st.db
        db.execute("BEGIN")                    # one snapshot of a store that a sweep may be writing
        try:
            return _snapshot(db, str(path))
        finally:
            db.execute("COMMIT")


def _snapshot(db: sqlite3.Connection, where: str) -> Snapshot:
    schema = [list(r) for r in db.execute(
        "SELECT type, name, tbl_name, sql FROM main.sqlite_master "
        "WHERE sql IS NOT NULL AND name NOT LIKE 'sqlite_%' ORDER BY rowid")]
    tables: dict[str, dict] = {}
    for typ, name, _, sql in schema:
        if typ != "table":
            continue
        cols = [r[1] for r in db.execute(f'PRAGMA main.table_info("{name}")')]
        kind = "sweep" if name == MEMBERSHIP else "run" if "run_id" in cols else "store"
        tables[name] = {"columns": cols, "kind": kind, "rowid": _has_rowid(sql)}
    if "runs" not in tables or tables["runs"]["kind"] != "run":
        raise ArchiveError(f"{where}: no runs table with a run_id column; not a fedprism results store")
    meta = {"format": STORE_FORMAT, "user_version": db.execute("PRAGMA main.user_version").fetchone()[0],
            "page_size": db.execute("PRAGMA main.page_size").fetchone()[0], "schema": schema, "tables": tables,
            "schema_version": schema_version(db), "store_rows": {}}

    def rows(table: str, where_sql: str = "", args: tuple = ()) -> Iterable[tuple]:
        t = tables[table]
        sel = ", ".join(f'"{c}"' for c in t["columns"])
        order = "rowid" if t["rowid"] else sel
        return db.execute(f'SELECT {"rowid, " if t["rowid"] else ""}{sel} FROM main."{table}" {where_sql} '
                          f"ORDER BY {order}", args)

    def head(table: str, drop: str | None) -> list[str]:
        t = tables[table]
        return (["rowid"] if t["rowid"] else []) + [c for c in t["columns"] if c != drop]

    ids = [r[0] for r in db.execute("SELECT run_id FROM main.runs ORDER BY rowid")]
    bad = [i for i in ids if not valid_run_id(i)]
    if bad:
        raise ArchiveError(f"{where}: {len(bad)} run(s) whose id is no run id (16 hex digits), e.g. "
                           f"{str(bad[0])[:40]!r}: no run file can be named after it; `fedprism merge "
                           f"{shlex.quote(where)} --db NEW.db` copies the store's sound runs into a clean store")
    per_run = sorted(t for t, v in tables.items() if v["kind"] == "run")
    for t in per_run:
        orphans = db.execute(f'SELECT count(*), min(run_id) FROM main."{t}" WHERE run_id IS NULL OR run_id NOT IN '
                             "(SELECT run_id FROM main.runs)").fetchone()
        if orphans[0]:
            raise ArchiveError(f"{where}: {orphans[0]} row(s) of {t} belong to no stored run (e.g. run id "
                               f"{str(orphans[1])[:40]!r}); a dump holds rows by run and would lose them")
    for t, v in tables.items():
        if v["kind"] == "store":
            meta["store_rows"][t] = [[_value(x) for x in r] for r in rows(t)]

    def drop_at(table: str, col: str) -> int:
        return head(table, None).index(col)

    runs: dict[str, str] = {}
    configs: dict[str, tuple[Any, Any]] = {}
    grouped: dict[str, dict[str, list[str]]] = {rid: {} for rid in ids}
    for t in per_run:                        # one pass per table, rows grouped by run (rowid order kept)
        i = drop_at(t, "run_id")
        for rid in ids:
            grouped[rid][t] = []
        for r in rows(t):
            grouped[r[i]][t].append(_row(r[:i] + r[i + 1:]))
    cols = {t: head(t, "run_id") for t in per_run}
    for rid in ids:
        runs[rid] = _tables_text({"format": RUN_FORMAT, "run_id": rid},
                                 {t: (cols[t], grouped[rid][t]) for t in per_run})
    prov = "provenance" in tables["runs"]["columns"]
    for r in db.execute(f"SELECT run_id, config, {'provenance' if prov else 'NULL'} FROM main.runs"):
        configs[r[0]] = (r[1], r[2])
    sweeps: dict[str, str] = {}
    if MEMBERSHIP in tables:
        i_sweep, i_run = drop_at(MEMBERSHIP, "sweep"), drop_at(MEMBERSHIP, "run_id")
        members: dict[Any, list[tuple]] = {}
        for r in rows(MEMBERSHIP):
            members.setdefault(r[i_sweep], []).append(r)
        names = {}
        for name in members:
            f = sweep_file(name)
            if f.casefold() in names:
                raise ArchiveError(f"{where}: sweeps {names[f.casefold()]!r} and {name!r} differ only in case: their "
                                   "membership files would be one file on a case-insensitive file system")
            names[f.casefold()] = name
        for name, rs in members.items():
            rs.sort(key=lambda r: (str(r[i_run]), r[0] if tables[MEMBERSHIP]["rowid"] else 0))
            sweeps[name] = _tables_text({"format": SWEEP_FORMAT, "sweep": name},
                                        {MEMBERSHIP: (head(MEMBERSHIP, "sweep"),
                                                      [_row(r[:i_sweep] + r[i_sweep + 1:]) for r in rs])})
    return Snapshot(meta, runs, sweeps, configs)


def _meta_text(meta: dict) -> str:
    return json.dumps(meta, sort_keys=True, indent=1) + "\n"


def id_problems(snap: Snapshot) -> list[str]:
    """"run id: why" for each run of `snap` whose id is not the hash of its stored configuration."""
    from fedprism.experiment.merge import id_problem

    return [f"{rid}: {why}" for rid, (config, prov) in sorted(snap.configs.items())
            if (why := id_problem(rid, config, prov))]


def _refuse(problems: list[str], what: str) -> None:
    if problems:
        raise ArchiveError(f"{len(problems)} run(s) {what}: " + "; ".join(problems[:5])
                           + ("; ..." if len(problems) > 5 else ""))


# -- dump ----------------------------------------------------------------------------------------------
@dataclass
class DumpReport:
    out: str
    written: list[str] = field(default_factory=list)      # files new or changed (paths relative to out)
    unchanged: int = 0
    removed: list[str] = field(default_factory=list)      # run and sweep files of runs and sweeps gone
    runs: int = 0
    sweeps: int = 0
    bytes: int = 0

    def summary(self) -> str:
        return (f"{self.out}: {self.runs} run(s), {self.sweeps} sweep(s), {self.bytes / 1e6:.1f} MB; "
                f"{len(self.written)} file(s) written, {self.unchanged} unchanged, {len(self.removed)} removed")


def _read_text(p: Path) -> str | None:
    """The text a dump file holds (a run file decompressed), or None when it is missing or unreadable."""
    try:
        data = p.read_bytes()
        return (gzip.decompress(data) if p.name.endswith(".gz") else data).decode("ascii")
    except (OSError, EOFError, gzip.BadGzipFile, UnicodeDecodeError, ValueError):
        return None


def _write(p: Path, data: bytes) -> None:
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, p)
    finally:
        tmp.unlink(missing_ok=True)


def dump(db: str | Path, out: str | Path) -> DumpReport:
    """Write the store at `db` as a dump into `out` (module docstring), writing only the files whose text
    changed and removing the run and sweep files of runs and sweeps the store no longer holds."""
    snap = snapshot(db)
    _refuse(id_problems(snap), f"of {db} are not filed under the hash of their configuration; nothing was "
                               f"written (`fedprism merge {shlex.quote(str(db))} --db NEW.db` copies a store's "
                               "sound runs into a clean store)")
    out = Path(out)
    want: dict[str, tuple[str, bytes | None]] = {META: (_meta_text(snap.meta), None)}
    for rid, text in snap.runs.items():
        want[f"{RUNS}/{rid}.json.gz"] = (text, None)
    for name, text in snap.sweeps.items():
        want[f"{SWEEPS}/{sweep_file(name)}"] = (text, None)
    rep = DumpReport(str(out), runs=len(snap.runs), sweeps=len(snap.sweeps))
    try:
        for sub in (RUNS, SWEEPS):
            (out / sub).mkdir(parents=True, exist_ok=True)
        for rel, (text, _) in sorted(want.items()):
            p = out / rel
            if _read_text(p) == text:
                rep.unchanged += 1
            else:
                _write(p, _gzip(text) if rel.endswith(".gz") else text.encode("ascii"))
                rep.written.append(rel)
            rep.bytes += p.stat().st_size
        for sub, pattern in ((RUNS, "*.json.gz"), (SWEEPS, "*.json")):
            for p in sorted((out / sub).glob(pattern)):
                rel = f"{sub}/{p.name}"
                if rel not in want and p.is_file():
                    p.unlink()
                    rep.removed.append(rel)
    except OSError as e:
        raise ArchiveError(f"dump into {out}: {e.filename or out}: {e.strerror or e}") from None
    return rep


# -- load ----------------------------------------------------------------------------------------------
@dataclass
class LoadReport:
    db: str
    runs: int = 0
    rows: int = 0
    written: bool = True

    def summary(self) -> str:
        if not self.written:
            return f"{self.db} already holds this dump ({self.runs} run(s)); nothing was written"
        return f"{self.db}: built from the dump, {self.runs} run(s), {self.rows} row(s)"


@dataclass
class Dump:
    """A dump read from disk: store.json, and per run and per sweep the parsed file and its text."""
    meta: dict
    runs: dict[str, dict]
    run_texts: dict[str, str]
    sweeps: dict[str, dict]
    sweep_texts: dict[str, str]


def _bad(where: Path | str, why: str) -> ArchiveError:
    return ArchiveError(f"dump file {where}: {why}")


def read_dump(folder: str | Path) -> Dump:
    """The dump in `folder`, parsed and checked for form (each file's format, names and columns)."""
    folder = Path(folder)
    mp = folder / META
    if not mp.is_file():
        raise ArchiveError(f"{folder} holds no dump ({META} is missing): `fedprism store dump --db DB --out "
                           f"{folder}` writes one")
    text = _read_text(mp)
    try:
        meta = json.loads(text) if text is not None else None
    except ValueError as e:
        raise _bad(mp, f"not JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != STORE_FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else None
        raise _bad(mp, f"format {got!r}; this fedprism reads {STORE_FORMAT!r} (a newer fedprism wrote it?)")
    for key, typ in (("tables", dict), ("schema", list), ("user_version", int), ("page_size", int),
                     ("store_rows", dict)):
        if not isinstance(meta.get(key), typ):
            raise _bad(mp, f"{key!r} is missing or not a {typ.__name__}")
    per_run = sorted(t for t, v in meta["tables"].items() if v.get("kind") == "run")
    if "runs" not in per_run:
        raise _bad(mp, "no per-run table 'runs'")

    def parse(p: Path, fmt: str) -> tuple[dict, str]:
        t = _read_text(p)
        if t is None:
            raise _bad(p, "unreadable (not gzip, or not ASCII text)")
        try:
            d = json.loads(t)
        except ValueError as e:
            raise _bad(p, f"not JSON ({e})") from None
        if not isinstance(d, dict) or d.get("format") != fmt or not isinstance(d.get("tables"), dict):
            raise _bad(p, f"not a {fmt!r} file")
        return d, t

    def columns(p: Path, d: dict, tables: list[str], drop: str) -> None:
        if sorted(d["tables"]) != tables:
            raise _bad(p, f"tables {sorted(d['tables'])}; {META} says {tables}")
        for t in tables:
            info = meta["tables"][t]
            want = (["rowid"] if info.get("rowid", True) else []) + [c for c in info["columns"] if c != drop]
            got = d["tables"][t]
            if not isinstance(got, dict) or got.get("columns") != want or not isinstance(got.get("rows"), list):
                raise _bad(p, f"table {t}: columns {got.get('columns') if isinstance(got, dict) else got}; "
                              f"{META} says {want}")
            if any(not isinstance(r, list) or len(r) != len(want) for r in got["rows"]):
                raise _bad(p, f"table {t}: a row without exactly {len(want)} values")

    runs, run_texts = {}, {}
    rdir = folder / RUNS
    for p in sorted(rdir.iterdir()) if rdir.is_dir() else []:
        m = RUN_FILE.fullmatch(p.name)
        if not m or not p.is_file():
            raise _bad(p, "not a run file (runs/ holds only <run id>.json.gz files, a run id being 16 hex digits)")
        d, t = parse(p, RUN_FORMAT)
        if d.get("run_id") != m.group(1):
            raise _bad(p, f"holds run {str(d.get('run_id'))[:40]!r}, not the run its name says")
        columns(p, d, per_run, "run_id")
        if len(d["tables"]["runs"]["rows"]) != 1:
            raise _bad(p, f"{len(d['tables']['runs']['rows'])} rows of runs; a run file holds its run's one row")
        runs[m.group(1)], run_texts[m.group(1)] = d, t
    sweeps, sweep_texts = {}, {}
    sdir = folder / SWEEPS
    memb = [MEMBERSHIP] if MEMBERSHIP in meta["tables"] else []
    for p in sorted(sdir.iterdir()) if sdir.is_dir() else []:
        if not p.name.endswith(".json") or not p.is_file():
            raise _bad(p, "not a sweep file (sweeps/ holds only <sweep>.json files)")
        d, t = parse(p, SWEEP_FORMAT)
        name = d.get("sweep")
        if not isinstance(name, str) or not name or sweep_file(name) != p.name or name in sweeps:
            raise _bad(p, f"holds sweep {str(name)[:60]!r}, whose file is {sweep_file(name) if name else '?'}")
        columns(p, d, memb, "sweep")
        sweeps[name], sweep_texts[name] = d, t
    return Dump(meta, runs, run_texts, sweeps, sweep_texts)


def verify(d: Dump) -> None:
    """`ArchiveError` naming each run of `d` whose id is not the hash of its stored configuration
    (`merge.id_problem`, as `fedprism merge` checks a run from elsewhere)."""
    from fedprism.experiment.merge import id_problem

    problems = []
    for rid, run in sorted(d.runs.items()):
        t = run["tables"]["runs"]
        row = dict(zip(t["columns"], t["rows"][0]))
        if why := id_problem(rid, row.get("config"), row.get("provenance")):
            problems.append(f"{rid}: {why}")
    _refuse(problems, "of the dump are refused, nothing was loaded")


def key(folder: str | Path) -> str:
    """SHA-256 of a dump's files (names and bytes) and its format: a store built from it can be cached under
    this key (a changed dump, a new key)."""
    folder = Path(folder)
    h = hashlib.sha256(STORE_FORMAT.encode())
    files = [folder / META] + sorted((folder / RUNS).glob("*")) + sorted((folder / SWEEPS).glob("*"))
    for p in files:
        if p.is_file():
            h.update(f"\0{p.relative_to(folder).as_posix()}\0{p.stat().st_size}\0".encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def _differs(existing: Snapshot, d: Dump) -> str:
    """How the store `existing` differs from dump `d` ("" when it holds the same rows)."""
    mine = {k: v for k, v in existing.meta.items()}
    theirs = d.meta
    if json.loads(_meta_text(mine)) != theirs:
        return "its schema or store-wide rows differ"
    only_db = sorted(set(existing.runs) - set(d.runs))
    only_dump = sorted(set(d.runs) - set(existing.runs))
    changed = sorted(r for r in set(existing.runs) & set(d.runs) if existing.runs[r] != d.run_texts[r])
    sweeps = sorted(n for n in set(existing.sweeps) | set(d.sweeps)
                    if existing.sweeps.get(n) != d.sweep_texts.get(n))
    parts = [f"{len(x)} {what} (e.g. {x[0]})" for x, what in (
        (only_db, "run(s) only in the store"), (only_dump, "run(s) only in the dump"),
        (changed, "run(s) with other rows"), (sweeps, "sweep(s) with other members")) if x]
    return "; ".join(parts)


def load(folder: str | Path, db: str | Path) -> LoadReport:
    """Build the store `db` from the dump in `folder` (module docstring). An existing `db` holding the same
    rows is left as it is; one holding anything else is refused."""
    folder, db = Path(folder), Path(db)
    d = read_dump(folder)
    rep = LoadReport(str(db), runs=len(d.runs))
    if os.path.lexists(db):
        _check_existing(db, d)
        rep.written = False
        return rep
    verify(d)
    if db.parent and not db.parent.is_dir():
        try:
            db.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ArchiveError(f"--db {db}: {e.filename}: {e.strerror or e}") from None
    tmp = db.with_name(f".{db.name}.load-{os.getpid()}.tmp")
    try:
        rep.rows = _build(tmp, d)
        try:
            os.link(tmp, db)               # never over a file that appeared meanwhile
        except FileExistsError:
            _check_existing(db, d)
            rep.written = False
    except sqlite3.Error as e:
        raise ArchiveError(f"building {db} from {folder}: {e}") from None
    except OSError as e:
        raise ArchiveError(f"building {db} from {folder}: {e.filename or db}: {e.strerror or e}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return rep


def _check_existing(db: Path, d: Dump) -> None:
    try:
        why = _differs(snapshot(db), d)
    except (FedPrismError, sqlite3.Error) as e:
        why = f"it cannot be read as a results store ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
    if why:
        raise ArchiveError(f"{db} exists and differs from the dump ({why}); nothing was written: choose another "
                           "--db, or move that store away first")


def _build(path: Path, d: Dump) -> int:
    """Write the store of dump `d` into the new file `path`; the number of rows written."""
    path.unlink(missing_ok=True)
    con = sqlite3.connect(str(path), isolation_level=None)
    n = 0
    try:
        con.execute(f"PRAGMA page_size = {int(d.meta['page_size'])}")
        con.execute("BEGIN")
        for typ, name, _, sql in d.meta["schema"]:
            con.execute(sql)
        for typ, name, _, _ in d.meta["schema"]:
            if typ != "table":
                continue
            info = d.meta["tables"][name]
            cols = (["rowid"] if info.get("rowid", True) else []) + list(info["columns"])
            rows = _rows_of(d, name, info)
            names = ", ".join(c if c == "rowid" else f'"{c}"' for c in cols)
            q = f'INSERT INTO "{name}" ({names}) VALUES ({", ".join("?" * len(cols))})'
            con.executemany(q, rows)
            n += len(rows)
        con.execute(f"PRAGMA user_version = {int(d.meta['user_version'])}")
        con.execute("COMMIT")
    except ValueError as e:
        raise ArchiveError(f"dump: {e}") from None
    finally:
        con.close()
    return n


def _rows_of(d: Dump, table: str, info: dict) -> list[tuple]:
    """Every row of `table` in the dump, as full rows in the table's column order, sorted by rowid."""
    kind, has_rowid = info["kind"], info.get("rowid", True)
    cols = list(info["columns"])
    out: list[tuple] = []
    if kind == "store":
        out = [tuple(_unvalue(v) for v in r) for r in d.meta["store_rows"].get(table, [])]
    else:
        col, files = ("run_id", d.runs) if kind == "run" else ("sweep", d.sweeps)
        at = cols.index(col) + (1 if has_rowid else 0)
        for owner, f in files.items():
            for r in f["tables"][table]["rows"]:
                vals = [_unvalue(v) for v in r]
                out.append(tuple(vals[:at] + [owner] + vals[at:]))
    if has_rowid:
        out.sort(key=lambda r: r[0])
        ids = [r[0] for r in out]
        if any(not isinstance(i, int) for i in ids) or len(set(ids)) != len(ids):
            raise ArchiveError(f"dump: table {table} has a rowid that is not an integer, or one used twice")
    return out


def build_hint(path: str | Path) -> str:
    """For a store `path` that does not exist beside a dump (`results/fedprism.db` in a fresh checkout): the
    command that builds it, else ""."""
    p = Path(path)
    meta = p.parent / META
    try:
        if os.path.lexists(p) or not meta.is_file():
            return ""
        if STORE_FORMAT not in meta.read_text(errors="replace")[:4096]:
            return ""
    except (OSError, ValueError):                 # ValueError: a NUL character in the path
        return ""
    return (f"{p.parent}/ holds a dump of a results store ({META}, {RUNS}/, {SWEEPS}/): build the store from it "
            f"first with `fedprism store load {p.parent}/ --db {p}`")


__all__ = ["ArchiveError", "Dump", "DumpReport", "LoadReport", "Snapshot", "build_hint", "dump", "id_problems",
           "key", "load", "read_dump", "snapshot", "sweep_file", "verify"]
