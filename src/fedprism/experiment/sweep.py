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

A run's keys are [base]'s, then its [[runs]] table's, then its grid point's, then (with --quick)
[quick]'s, each overriding the one before; so its method is the last of those that sets `method`, else
fedprism. Method keys in [base], [grid] or [quick] (`fedprism.k`) apply only to the runs of that
method; a grid over one method's key (`"fedprism.k" = [2, 3]`) runs each other method once. Runs that
would share a table row get the keys that tell them apart in their labels (`_distinct_rows`).

Every run of a sweep with the same data keys shares one partition and, through the seeded sampler,
one cohort sequence.

A finished run is skipped only when its recorded code and data fingerprints match the current ones
(runs stored without provenance have none to compare); otherwise the sweep stops with an error that
names what changed (`fedprism run --fresh` re-runs it; see docs/reproducibility.md).

A sweep's table row is (label, seed, data setting). When the file's configuration of a row changes (a
method default or a parameter changed), the run of the new configuration takes the row over once it
has finished: the older run leaves the sweep (`superseded`), and stays in the store under its run id
and in any other sweep that holds it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shlex
import sys
import threading
import time
from pathlib import Path
from typing import Any

from fedprism.algorithms import REGISTRY
from fedprism.errors import ConfigError, printable
from fedprism.experiment.config import KEYS, Config, flatten, prefer_stored, read_toml, resolve, suggest
from fedprism.experiment.differ import tell_apart


def load_sweep(path: str | Path, quick: bool = False, overrides: dict[str, Any] | None = None
               ) -> tuple[str, list[Config]]:
    """(sweep name, resolved configs). `overrides` (flat keys) apply to every run, last; overriding
    `partition` drops the file's partition parameters (e.g. `partition=pathological` after Dirichlet)."""
    from fedprism import plugins

    plugins.load()       # entry-point methods are in REGISTRY before method keys are assigned to runs below
    p = Path(path)
    doc = _read(p)
    sections = ["name", "description", "db", "base", "grid", "runs", "quick"]
    if isinstance(doc.get("tune"), dict) and "methods" in doc:     # a tuning study (docs/tuning.md)
        raise ConfigError("sweep file", str(path), "a sweep file; this one is a tuning study ([tune] and "
                          f"[[methods]] tables): run it with `fedprism tune {path}`", kind="")
    unknown = set(doc) - set(sections)
    misspelt = any(_form(k, doc[k]).startswith("[") and suggest(k, ["base", "grid", "runs"])
                   for k in unknown)                             # a table [bse], [[run]]: not a run's keys
    if unknown and not set(doc) & {"base", "grid", "runs"} and not misspelt:  # one run's keys: a run file
        raise ConfigError("sweep file", str(path), "a [base] table, a [grid] table or [[runs]] tables; this file "
                          f"has one run's keys ({sorted(unknown)[0]}, ...): run it with `fedprism run {path}`",
                          kind="")
    if unknown:
        raise _unknown_section(p.name, sorted(unknown)[0], doc, sections)
    name = doc.get("name", p.stem)
    if not isinstance(name, str) or not name.strip():       # a blank name is no sweep anyone can report
        raise ConfigError(f"{p.name}: name", name, "a string that is not empty or only whitespace")
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
    check_grid_size(p, len(runs), {k: len(v) for k, v in grid.items()})
    for i, r in enumerate(runs):
        if "label" in r and (not isinstance(r["label"], str) or not r["label"].strip()):
            raise ConfigError(f"{p.name}: runs[{i}].label", r["label"], "a string that is not empty or only "
                              "whitespace (it names the run's table row)")
    if quick and not doc.get("quick"):      # --quick must never fall through to the full-size sweep
        raise ConfigError("--quick", True, f"{p.name} has no [quick] section of smaller settings, so --quick "
                          "would run the full sweep; add one or leave --quick out", kind="option")
    quick_over = flatten(doc.get("quick", {})) if quick else {}
    configs, made, seen = [], [], set()
    for i, variant in enumerate(runs):
        variant = flatten(variant)
        label = variant.pop("label", None)
        for values in itertools.product(*grid.values()) if grid else [()]:
            point = dict(zip(grid.keys(), values))
            raw = {**base, **variant, **point, **quick_over}
            method = raw.get("method", KEYS["method"].default)
            # keys of *other* methods in [base], [grid] or [quick] apply only to runs of those methods
            raw = {k: v for k, v in raw.items()
                   if k in variant or k.split(".")[0] not in REGISTRY or k.split(".")[0] == method}
            if overrides:
                if "partition" in overrides:
                    raw = {k: v for k, v in raw.items() if not k.startswith("partition.")}
                raw.update(overrides)
            raw["name"] = label or raw.get("name") or raw.get("method", "run")
            try:
                cfg = resolve(raw)
            except ConfigError as e:             # a key of the file: named with the file and its table
                where = _table_of(e.key, overrides or {}, quick_over, point, variant, base, i)
                if where is None:
                    raise
                raise _in_table(p.name, where, e, method) from None
            if (cfg.run_id, cfg["name"]) in seen:     # a grid over another method's key: this run once
                continue
            seen.add((cfg.run_id, cfg["name"]))
            configs.append(cfg)
            made.append((i, {k: v for k, v in {**variant, **point}.items() if k in raw}))
    return name, _distinct_rows(configs, made, p.name)


#: a sweep file's top-level keys and tables, as they are written
SECTION_FORMS = {"name": "name", "description": "description", "db": "db", "base": "[base]", "grid": "[grid]",
                 "runs": "[[runs]]", "quick": "[quick]"}


def _form(key: str, value: Any) -> str:
    """How a top-level entry of a TOML file is written: `[[key]]`, `[key]` or `key`."""
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return f"[[{key}]]"
    return f"[{key}]" if isinstance(value, dict) else key


def _plain_error(key: str, value: Any, message: str) -> ConfigError:
    """A ConfigError (its `key`, `value`) whose text is `message` as it stands."""
    e = ConfigError(key, value, message)
    e.args = (printable(message),)
    return e


def _unknown_section(file: str, key: str, doc: dict, sections: list[str]) -> ConfigError:
    """'s.toml: unknown table [[run]] (did you mean [[runs]]?)': the entry as it is written, never its
    value, the nearest of the sweep file's sections, else all of them."""
    form = _form(key, doc[key])
    what = "table" if form.startswith("[") else "key"
    near = suggest(key, sections)
    if near:
        best = near[len(" (did you mean "):-len("?)")]
        hint = f" (did you mean {SECTION_FORMS.get(best, best)}?)"
    else:
        hint = f"; a sweep file holds {', '.join(SECTION_FORMS[k] for k in sections)}"
    return _plain_error(f"{file}: {key}", doc[key], f"{file}: unknown {what} {form}{hint}")


def _table_of(key: str, overrides: dict, quick: dict, point: dict, variant: dict, base: dict,
              i: int) -> str | None:
    """Which part of the sweep file set `key` for run table `i` (the last that sets it wins, as the keys
    are merged): `[quick]`, `[grid]`, `[[runs]] #i+1` or `[base]`; None when it came from the command
    line's overrides or from no table."""
    if key in overrides:
        return None
    for table, keys in (("[quick]", quick), ("[grid]", point), (f"[[runs]] #{i + 1}", variant), ("[base]", base)):
        if key in keys:
            return table
    return None


def _valid_keys(method: str) -> list[str]:
    """Every configuration key a sweep's table may hold: the experiment keys, every partition's and every
    method's parameters (the keys of other methods apply to their runs only)."""
    from fedprism.data.partitions import PARTITIONS
    from fedprism.experiment.config import PARTITION_COMMON

    parts = {*PARTITION_COMMON, *(q for _, spec in PARTITIONS.items() for q in spec.params)}
    return [*KEYS, *(f"partition.{q}" for q in sorted(parts)),
            *(f"{m}.{q}" for m, cls in REGISTRY.items() for q in cls.params)]


def _in_table(file: str, table: str, e: ConfigError, method: str) -> ConfigError:
    """`e` (from `resolve`) for a key that `table` of `file` set: named with the file and the table. An
    unknown key lists only the nearest valid keys (did-you-mean), not every key."""
    import difflib

    allowed = e.allowed
    if allowed.startswith(("unknown key;", "unknown key (did you mean")) or (allowed.startswith("unknown key (")
                                                                            and "; known keys:" in allowed):
        near = difflib.get_close_matches(e.key, _valid_keys(method), n=3, cutoff=0.6)
        allowed = ("unknown key " + (f"(did you mean {' or '.join(near)}?)" if near else
                                     "(no key is near it; `fedprism methods` lists every key)"))
    return _plain_error(f"{file}: {table} {e.key}", e.value,
                        f"{file}: {table} key '{printable(e.key)}' = {printable(repr(e.value))[:200]} is not "
                        f"valid: {allowed}")


#: the most runs one sweep file may expand to ([[runs]] tables x the product of the [grid] axes' lengths):
#: each is resolved and checked before the first trains, and the largest sweep in sweeps/ has a few hundred
MAX_SWEEP_RUNS = 100_000


def check_grid_size(path: Path, variants: int, axes: dict[str, int]) -> int:
    """The number of runs a sweep file expands to, computed from the lengths alone (nothing is expanded:
    a 677-byte file with eight axes of ten values is 10^8 runs); more than `MAX_SWEEP_RUNS` is a
    ConfigError naming the file, the number of [[runs]] tables and every axis with its length."""
    total = variants
    for n in axes.values():
        total *= n
    if total > MAX_SWEEP_RUNS:
        sizes = ", ".join(f"{printable(k)} ({n})" for k, n in axes.items())
        raise ConfigError("sweep file", str(path), f"at most {MAX_SWEEP_RUNS:,} runs; it expands to {total:,}: "
                          f"{variants} [[runs]] table(s) x the [grid] axes {sizes or '(none)'}; split it into "
                          "several files or shorten the axes", kind="")
    return total


def _distinct_rows(configs: list[Config], made: list[tuple[int, dict]], file: str) -> list[Config]:
    """Runs that would share a table row (`_row_key`: label, seed, data setting) with another configuration
    get the `[[runs]]` and grid keys that tell them apart added to their labels, `fedprox (fedprox.mu=0.1)`;
    otherwise each would supersede the other in the sweep. Rows that still coincide are an error."""
    groups: dict[tuple, list[int]] = {}
    for j, c in enumerate(configs):
        groups.setdefault(_row_key(c.values, c["name"]), []).append(j)
    out = list(configs)
    for members in groups.values():
        if len({configs[j].run_id for j in members}) < 2:
            continue
        keys = sorted({k for j in members for k in made[j][1] if k != "seed"})
        differ = [k for k in keys if len({repr(made[j][1].get(k)) for j in members}) > 1]
        for j in members:
            parts = ", ".join(f"{k}={made[j][1][k]}" for k in differ if k in made[j][1])
            if parts:
                out[j] = configs[j].with_(name=f"{configs[j]['name']} ({parts})")
    seen: dict[tuple, int] = {}
    for j, c in enumerate(out):
        key = _row_key(c.values, c["name"])
        if key in seen and out[seen[key]].run_id != c.run_id:
            a, b = made[seen[key]][0], made[j][0]
            raise ConfigError(f"{file}: runs[{b}].label", c["name"],
                              f"a label no other run of the same seed and data has (runs[{a}] has it too, "
                              "with another configuration: each would replace the other in the sweep)")
        seen.setdefault(key, j)
    return out


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {_toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"cannot write {type(v).__name__} to a sweep file")


def dump_sweep(name: str, base: dict[str, Any], runs: list[dict[str, Any]], grid: dict[str, list] | None = None) -> str:
    """A sweep file's text from Python: `[base]` keys, an optional `[grid]`, one `[[runs]]` table per run
    (each with its `label`). Dotted keys are written quoted (`"fedprism.k" = 5`)."""
    lines = [f"name = {_toml_value(name)}", "", "[base]"]
    lines += [f"{json.dumps(k)} = {_toml_value(v)}" for k, v in base.items()]
    if grid:
        lines += ["", "[grid]"] + [f"{json.dumps(k)} = {_toml_value(v)}" for k, v in grid.items()]
    for r in runs:
        lines += ["", "[[runs]]"] + [f"{json.dumps(k)} = {_toml_value(v)}" for k, v in r.items()]
    return "\n".join(lines) + "\n"


_STOP = None            # in a worker: the sweep's "stop" event (set when the sweep is interrupted)
_IN_RUN = None          # in a worker: the shared array of the pids of the workers inside a run
_READY = None           # in a worker: the shared array of the pids of the workers done with their set-up


def _sweep_worker_init(threads: int, stop=None, in_run=None, ready=None) -> None:
    import torch

    from fedprism import plugins

    global _STOP, _IN_RUN, _READY
    _STOP, _IN_RUN, _READY = stop, in_run, ready
    torch.set_num_threads(threads)
    plugins.load()                     # methods registered by entry points (in-process registrations are not seen)
    exit_with_parent()
    if threading.current_thread() is threading.main_thread():
        import signal

        signal.signal(signal.SIGINT, signal.SIG_IGN)       # until a run (`_sweep_job`); a Ctrl-C pending
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})   # since the spawn is dropped here
    _mark(_READY, os.getpid())


def exit_with_parent(poll_s: float = 1.0) -> None:
    """End this process within `poll_s` seconds of its parent's death (a daemon thread watches the parent
    pid). `kill` of a sweep (SIGTERM or SIGKILL to the `fedprism sweep` process alone, as a job scheduler
    or a user does) would otherwise leave its workers training and writing to the store: a second
    `fedprism sweep` then finds their runs busy. The interrupted run resumes from its last checkpoint;
    SQLite's journal keeps the store whole, and the run lock dies with the process."""
    import threading

    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _sweep_job(db: str, name: str, cfg: Config) -> dict:
    """One run of a sweep in a worker process (its own store connection; SQLite WAL serialises writes)."""
    import signal

    from fedprism.experiment.runner import Experiment
    from fedprism.experiment.store import Store

    # A worker ignores SIGINT (`_sweep_worker_init`) except inside a run, where it ends the run
    # 'interrupted' with its checkpoint. The pid in `_IN_RUN`, then the handler, then the stop check:
    # `stop_workers` sets the event, reads `_IN_RUN` and sends SIGINT to the pids it holds, so a run
    # either sees the event or gets the signal with its handler in place.
    try:
        _mark(_IN_RUN, os.getpid())
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if _STOP is not None and _STOP.is_set():
            return None                # the sweep was interrupted before this run started: leave it untouched
        store = Store(db)
        try:
            res = Experiment(cfg, store, progress=False, sweep=name).run()
            supersede(store, name, cfg)
            return res.final
        finally:
            store.close()
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _mark(_IN_RUN, os.getpid(), leaving=True)


def _mark(pids, pid: int, leaving: bool = False) -> None:
    """Put `pid` into a free slot of the shared array `pids`, or take it out."""
    if pids is None:
        return
    with pids.get_lock():
        held = list(pids)
        if (pid if leaving else 0) in held:
            pids[held.index(pid if leaving else 0)] = 0 if leaving else pid


def worker_threads(workers: int) -> int:
    """Torch threads per worker process: the machine's cores split between the workers."""
    return max(1, (os.cpu_count() or 1) // workers)


def run_in_workers(db: str, name: str, todo: list[tuple[str, Config]], workers: int):
    """Run `todo`'s (tag, config) pairs in `workers` spawned processes (threads split between them), in
    the order given; yields (tag, final metrics) as runs finish, or (tag, RunBusyError) for a run that
    another process holds. Any other error of a run is raised."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed

    from fedprism.experiment.runlock import RunBusyError

    ctx = mp.get_context("spawn")
    stop, in_run, ready = ctx.Event(), ctx.Array("q", workers), ctx.Array("q", workers)
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_sweep_worker_init,
                               initargs=(worker_threads(workers), stop, in_run, ready))
    try:
        with _spawning():
            futures = {pool.submit(_sweep_job, db, name, cfg): tag for tag, cfg in todo}
        for fut in as_completed(futures):
            try:
                yield futures[fut], fut.result()
            except RunBusyError as e:
                yield futures[fut], e
    except BaseException:              # Ctrl-C, a signal to this process alone, an error, the caller leaving
        stop_workers(pool, stop, in_run, ready)
        raise
    pool.shutdown(wait=True)


@contextlib.contextmanager
def _spawning():
    """SIGINT blocked in this process while the pool spawns its workers (`submit` starts them): they
    inherit the mask, so a Ctrl-C (it reaches the whole foreground process group) stays pending in a
    worker still importing torch instead of printing a `KeyboardInterrupt` traceback before the sweep's
    own message; `_sweep_worker_init` ignores SIGINT and drops it, and `_sweep_job` catches it only inside
    a run. Here the pending signal is delivered when the mask is restored, and the sweep process stops
    the workers itself (`stop_workers`); a worker that has not started its run finds the stop event set."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def stop_workers(pool, stop, in_run=None, ready=None, grace_s: float = 30.0) -> None:
    """Stop a sweep's worker pool at once: no queued run starts (the executor's own shutdown would run
    every queued run first), each running run gets SIGINT, marks itself 'interrupted' and keeps the
    checkpoint of its last finished round; a worker still importing (not in `ready`) is ended with
    SIGTERM; an idle one ends on the pool's sentinel (a signal could catch it holding a queue's lock); a
    worker still alive after `grace_s` is killed (its run then resumes from the same checkpoint: the run
    lock dies with the process). Without `in_run` every worker gets SIGINT."""
    import signal

    procs = [p for p in (getattr(pool, "_processes", None) or {}).values()]
    stop.set()
    pool.shutdown(wait=False, cancel_futures=True)
    running = up = set()
    if in_run is not None:
        with in_run.get_lock():
            running = set(in_run)
    if ready is not None:
        with ready.get_lock():
            up = set(ready)
    for p in procs:
        if not p.is_alive():
            continue
        sig = signal.SIGINT if in_run is None or p.pid in running else \
            signal.SIGTERM if ready is not None and p.pid not in up else None
        if sig is not None:
            try:
                os.kill(p.pid, sig)
            except ProcessLookupError:
                pass
    deadline = time.time() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.time()))
        if p.is_alive():
            p.terminate()
            p.join(5)


def select_only(configs: list, only: str) -> list:
    """The runs `--only` names: those whose label is exactly `only` when there are any (so "FedAvg | S 0"
    does not also pick "FedAvg | S 0.03"), else those whose label contains it; none is an error that lists
    the labels."""
    exact = [c for c in configs if c["name"] == only]
    picked = exact or [c for c in configs if only in c["name"]]
    if not picked:
        labels = sorted({c["name"] for c in configs})
        more = f", ... ({len(labels)})" if len(labels) > 12 else ""
        shown = ", ".join(repr(x) for x in labels[:12]) + more
        hint = suggest(only, labels, quote=True)
        raise ConfigError("--only", only, f"text in one of the sweep's run labels{hint}: {shown}")
    return picked


def run_sweep(path: str, db: str, only: str | None = None, quick: bool = False, progress: bool = True,
              limit: int | None = None, seeds: list[int] | None = None,
              overrides: dict[str, Any] | None = None, workers: int = 1, fresh: bool = False,
              ray: Any = None) -> int:
    """Run every run of a sweep file that has not finished (resumable). `workers` > 1 runs that many
    runs at once in separate processes, the machine's cores split between them (torch threads per
    worker = cores // workers), each printing one line when its run finishes. `fresh=True` (`--fresh`)
    runs every selected run again (`only`, `seeds`, `limit` select): what the store holds of it is
    dropped (`fresh.forget`) once every run to do has passed the checks that need no training. `ray` (an
    `executor.RayOptions`, `--ray ADDRESS`) sends each run to a Ray cluster as one task instead
    (`fedprism.experiment.executor`, docs/ray.md)."""
    from fedprism.experiment.fresh import cli_visible, fix_for_sweep, forget, verify_hint
    from fedprism.experiment.provenance import check, fingerprints
    from fedprism.experiment.runlock import RunBusyError
    from fedprism.experiment.runner import Experiment
    from fedprism.experiment.store import Store

    name, configs = load_sweep(path, quick, overrides)
    if only:
        configs = select_only(configs, only)
    if seeds:
        have = sorted({c["seed"] for c in configs})
        if set(seeds) - set(have):
            raise ConfigError("--seed", sorted(set(seeds) - set(have))[0],
                              f"a seed of the sweep's runs{' (with --only)' if only else ''}: "
                              f"{', '.join(map(str, have))}")
        configs = [c for c in configs if c["seed"] in seeds]
    if not isinstance(workers, int) or workers < 1:
        raise ConfigError("--workers", workers, "an integer >= 1", kind="option")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 0):
        raise ConfigError("--limit", limit, "an integer >= 0 (0 runs nothing and refreshes the stored runs' "
                          "text hashes)", kind="option")     # a negative one would slice runs off the end
    from fedprism.experiment.provenance import ProvenanceMismatch

    new_dirs = _missing_folders(Path(db).parent)
    created = not Path(db).exists()
    store = Store(db)
    configs = [prefer_stored(c, store) for c in configs]   # `auto` kernels: stored runs with PyTorch's count
    done = skipped = busy = 0
    t0 = time.time()
    todo: list[tuple[str, Config]] = []
    other_code: list[str] = []          # finished under other code or data: neither re-used nor re-run
    hidden_from_cli: set[str] = set()   # the methods of those runs that a `fedprism` command cannot see
    data_memo: dict = {}                # each data setting fingerprinted once per sweep
    apart = tell_apart([c.values for c in configs])   # two alphas of "FedAvg" read differently
    try:
        for i, cfg in enumerate(configs):
            row = store.run(cfg.run_id)
            differs = f" {printable(apart[i])}" if apart[i] else ""
            tag = f"[{i + 1}/{len(configs)}] {printable(cfg['name'])}{differs} seed={cfg['seed']}"
            if row is not None and row["status"] == "finished" and not fresh:
                stored = row["provenance"] if "provenance" in row.keys() else None
                if stored:                     # other code or data: never skipped as if it were this run's
                    try:
                        check(cfg.run_id, stored := json.loads(stored), now := fingerprints(cfg, data_memo),
                              fix_for_sweep(path, cfg["name"], db, cfg["method"]),
                              verify_hint(cfg.run_id, db, cfg["method"]))
                    except ProvenanceMismatch as e:  # the others still run; the sweep ends with status 2
                        other_code.append(f"{tag}: {e}")
                        if not cli_visible(cfg["method"]):
                            hidden_from_cli.add(cfg["method"])
                        print(f"{tag}: not run, {e}", file=sys.stderr)
                        continue
                    store.add_text_fingerprints(cfg.run_id, stored, now)
                skipped += 1
                store.add_to_sweep(name, cfg.run_id, cfg["name"])
                supersede(store, name, cfg)
                print(f"{tag}: finished earlier, skipped", file=sys.stderr)
                continue
            todo.append((tag, cfg))
        if limit is not None:
            todo = todo[:limit]
        check_runs(todo, store.path, keep_data=ray is None and (workers == 1 or len(todo) <= 1))
    except BaseException:
        _drop_new_store(store, created, new_dirs)    # a refused sweep leaves no empty store (nor folder)
        raise
    if fresh:                                    # only now: a sweep refused above loses nothing
        todo, busy = _forget_all(store, todo, forget)
    print(f"results: {printable(db)}", file=sys.stderr)      # once every run to do is known to be able to start

    def line(tag: str, f: dict) -> str:
        return (f"{tag}: global {f.get('global_acc', float('nan')):.4f} local {f.get('local_acc', float('nan')):.4f}"
                f" ({f.get('seconds', 0):.0f}s)" + (f", {f['rejected']} updates rejected" if f.get("rejected") else "")
                + (f" -- DIVERGED: every update from round {f.get('diverged_round', 0) + 1} on was rejected"
                   if f.get("diverged") else ""))

    if ray is not None and todo:
        from fedprism.experiment.executor import execute

        store.close()
        executor = ray.executor()
        print(f"sweep {printable(name)}: {len(todo)} runs on the Ray cluster at {printable(ray.address)}, "
              f"{ray.cpus:g} CPU(s) and {ray.gpus:g} GPU(s) each, results {ray.store}", file=sys.stderr)
        for tag, f in execute(todo, db, executor, name, ray.store, ray.scratch):
            if isinstance(f, RunBusyError):
                busy += 1
                print(f"{tag}: skipped, {f}", file=sys.stderr)
                continue
            done += 1
            print(f"{line(tag, f)}  [{done}/{len(todo)} done, {time.time() - t0:.0f}s]", file=sys.stderr)
        store = Store(db)
    elif workers == 1 or len(todo) <= 1:
        for tag, cfg in todo:
            try:
                res = Experiment(cfg, store, progress=progress, sweep=name).run()
            except RunBusyError as e:        # another process (e.g. a second copy of this sweep) runs it
                busy += 1
                print(f"{tag}: skipped, {e}", file=sys.stderr)
                continue
            supersede(store, name, cfg)
            done += 1
            print(line(tag, res.final), file=sys.stderr)
    else:
        store.close()
        print(f"sweep {printable(name)}: {len(todo)} runs on {workers} workers, {worker_threads(workers)} thread(s) each",
              file=sys.stderr)
        for tag, f in run_in_workers(db, name, todo, workers):
            if isinstance(f, RunBusyError):
                busy += 1
                print(f"{tag}: skipped, {f}", file=sys.stderr)
                continue
            done += 1
            print(f"{line(tag, f)}  [{done}/{len(todo)} done, {time.time() - t0:.0f}s]", file=sys.stderr)
        store = Store(db)
    print(f"sweep {printable(name)}: {done} ran, {skipped} already finished"
          + (f", {busy} running in other processes" if busy else "")
          + (f", {len(other_code)} stored from other code or data (listed above; neither re-used nor re-run)"
             if other_code else "") + f", {time.time() - t0:.0f}s", file=sys.stderr)
    store.close()
    if other_code:
        raise ProvenanceMismatch(f"{len(other_code)} run(s) of sweep {name} are stored from other code or data "
                                 "(each listed above with the command that re-runs it): `--fresh` runs them "
                                 "again under the current code (every run of the sweep, or those of `--only`); "
                                 + (f"`fedprism verify RUN --db {shlex.quote(str(db))}` checks whether the current "
                                    "code reproduces one" if not hidden_from_cli else
                                    f"`fedprism.experiment.verify.verify({str(db)!r}, RUN)` in the process that "
                                    f"registers {', '.join(map(repr, sorted(hidden_from_cli)))} checks whether the "
                                    "current code reproduces one (`fedprism verify` cannot see a method registered "
                                    "in a process)"))
    return 0


def _forget_all(store, todo: list[tuple[str, Config]], forget) -> tuple[list[tuple[str, Config]], int]:
    """`--fresh`: drop what `store` holds of each run to do (`fresh.forget`), saying which held something;
    a run that another process executes is kept and left out (with the count of those)."""
    from fedprism.experiment.runlock import RunBusyError

    kept, busy = [], 0
    for tag, cfg in todo:
        try:
            dropped = forget(store, cfg, keep_lock=False)
        except RunBusyError as e:
            busy += 1
            print(f"{tag}: skipped, {e}", file=sys.stderr)
            continue
        if dropped:
            print(f"{tag}: --fresh: dropped its stored rounds, checkpoint and kept final state; running it again",
                  file=sys.stderr)
        kept.append((tag, cfg))
    return kept, busy


def check_runs(todo: list[tuple[str, Config]], db: str | Path, keep_data: bool = True) -> None:
    """Before any run of a sweep starts: every (tag, config) of `todo` against the checks that need no
    training, those of `Experiment.__init__` (`runner.check_runnable`), and its data and model against the
    configuration (a partition the data cannot give, a model the inputs do not fit). Each data
    setting is built once (`build_federation` caches it, so the first runs reuse it; `keep_data=False`
    empties that cache afterwards: worker processes build their own) and each model's parameter count is
    taken once. A refusal is raised naming the run as the progress lines do (`[2/3] FedAvg seed=0: ...`)."""
    from fedprism.errors import FedPrismError
    from fedprism.experiment.federation import build_federation, clear_federations, federation_key
    from fedprism.experiment.runner import check_runnable, make_model, resolve_model_name

    groups: dict[tuple, list[tuple[str, Config]]] = {}      # per data setting, in order of first use
    for tag, cfg in todo:
        groups.setdefault(federation_key(cfg), []).append((tag, cfg))
    sizes: dict[tuple, int] = {}                             # parameter count per (model, inputs, classes)
    try:
        for runs in groups.values():
            fed = None
            for tag, cfg in runs:
                try:
                    if fed is None:
                        fed = build_federation(cfg)
                    shape = tuple(fed.input_shape)
                    key = (resolve_model_name(cfg["model"], shape, fed.vocab_size), shape, fed.num_classes)
                    if key not in sizes:
                        model = make_model(cfg, shape, fed.num_classes, fed.vocab_size)
                        sizes[key] = sum(p.numel() for p in model.parameters())
                    check_runnable(cfg, fed, sizes[key], db)
                except FedPrismError as e:     # the same error, naming the run; its type and fields kept
                    e.args = (f"{tag}: {e}; no run of the sweep was started",)
                    raise
    finally:
        if not keep_data:
            clear_federations()


def _missing_folders(folder: Path) -> list[Path]:
    """`folder` and those of its parents that do not exist yet, deepest first."""
    out = []
    while not folder.exists() and folder != folder.parent:
        out.append(folder)
        folder = folder.parent
    return out


def _drop_new_store(store, created: bool, folders: list[Path]) -> None:
    """Close `store`; if this command `created` it and it holds no run, delete its files and the
    `folders` made for it (`_missing_folders`) that are still empty."""
    from fedprism.experiment.store import drop_if_new_and_empty

    try:
        drop_if_new_and_empty(store, created)
        store.close()
        if created and not Path(store.path).exists():
            for folder in folders:
                folder.rmdir()
    except Exception:  # noqa: BLE001 - tidying up must not hide the error that refused the sweep
        pass


def _read(p: Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A sweep file's tables, with `extends = "other.toml"` resolved: the other file's tables (its path
    relative to this file), updated by this file's [base] and [quick] keys (key by key), its [grid] keys
    and its [[runs]] when it has any, and its name, description and db. One table runs on other data this
    way (`dataset = "cifar10"` in [base]) without a copy of its runs."""
    doc = read_toml(p, "sweep file")
    parent = doc.pop("extends", None)
    if parent is None:
        return doc
    if not isinstance(parent, str) or not parent or "\0" in parent:
        raise ConfigError(f"{p.name}: extends", parent, "the path of another sweep file (relative to this one)")
    q = (p.parent / parent).resolve()
    if q in _seen or q == p.resolve():
        raise ConfigError(f"{p.name}: extends", parent, "a sweep file that does not extend this one again "
                          "(the chain is a loop)")
    if not q.is_file():
        raise ConfigError(f"{p.name}: extends", parent, f"an existing sweep file ({q} is not a file)")
    merged = _read(q, (*_seen, p.resolve()))
    merged.pop("name", None)                   # a sweep of its own: its name is this file's (or its stem)
    grid_mine, quick_mine = doc.get("grid", {}), doc.get("quick", {})
    grid_keys = list(flatten(grid_mine)) if isinstance(grid_mine, dict) else []
    quick_mine = quick_mine if isinstance(quick_mine, dict) else {}
    for section in ("base", "grid", "quick"):
        mine = doc.pop(section, {})
        if not isinstance(mine, dict):
            raise ConfigError(f"{p.name}: {section}", mine, f"a table ([{section}])")
        mine, theirs = flatten(mine), flatten(merged.get(section, {}))
        if "partition" in mine or "partition.name" in mine:   # another partition: the other's keys do not apply
            theirs = {k: v for k, v in theirs.items() if k != "partition" and not k.startswith("partition.")}
        merged[section] = {**theirs, **mine}
    for k in grid_keys:                         # what this file's grid varies, the other's [quick] leaves
        if k not in flatten(quick_mine):
            merged["quick"].pop(k, None)
    merged.update(doc)                          # name, description, db, [[runs]]
    return merged


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
        print(f"sweep {printable(sweep)}: run {run_id} superseded by {cfg.run_id} as '{printable(cfg['name'])}' "
              f"seed={cfg['seed']}",
              file=sys.stderr)
    return old


def sweep_summary(configs: list[Config]) -> list[dict[str, Any]]:
    return [{"name": c["name"], "run_id": c.run_id, "seed": c["seed"]} for c in configs]
