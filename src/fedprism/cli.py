"""The `fedprism` command: run | demo | sweep | report | runs | show | verify | partition | methods | models |
partitions |
merge | export | store | data."""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import sqlite3
import sys
import textwrap
from pathlib import Path

from fedprism.errors import ConfigError, DataError, FedPrismError, printable
from fedprism.textable import fmt as _fmt  # noqa: F401
from fedprism.textable import table as _table

DEFAULT_DB = "fedprism-results.db"

KV_HELP = "key=value overrides, e.g. dataset=fmnist method=fedprism fedprism.k=5 rounds=50 (see `fedprism methods`); a key given twice: the last value wins"


def _finite(x):
    """`x` with every NaN and infinity replaced by None (JSON has neither), as the store keeps them."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def json_text(x) -> str:
    """What `--json` prints: valid JSON (RFC 8259 has no NaN or Infinity, which `json.dumps` would write and
    strict parsers refuse), non-finite numbers as null."""
    return json.dumps(_finite(x), allow_nan=False)


def _raw(args) -> dict:
    """The configuration as given: the TOML file's keys, then the key=value overrides (not resolved)."""
    from fedprism.experiment.config import load_toml, parse_overrides

    raw: dict = {}
    items = list(args.items)
    if items and "=" not in items[0]:
        raw.update(load_toml(items.pop(0)))
    raw.update(parse_overrides(items))
    return raw


def _config(args) -> "Config":  # noqa: F821
    from fedprism.experiment.config import resolve

    return resolve(_raw(args))


def _stored_run_item(args) -> str | None:
    """The RUN_ID of `fedprism run --fresh RUN_ID [key=value ...]`: a first item that is neither a key=value
    pair nor an existing file, given with --fresh; None otherwise."""
    items = list(args.items)
    if not args.fresh or not items or "=" in items[0] or Path(items[0]).exists():
        return None
    return items[0]


def cmd_run(args) -> int:
    from fedprism.experiment import lookup
    from fedprism.experiment.result import divergence_note, summary_extras

    stored_id = _stored_run_item(args)
    raw = None if stored_id else _raw(args)
    pristine = lookup.pristine()                 # before anything below imports torch
    # a finished stored run is answered from the store without building it (fedprism.experiment.lookup)
    found = None if stored_id or args.fresh else lookup.stored_result(raw, args.db)
    cfg, res = found if found is not None else _run_built(args, stored_id, raw, pristine)
    f = res.final
    val = last_validation(res.history)
    if f.get("diverged"):
        print(f"fedprism: warning: {divergence_note(res.run_id, f)}", file=sys.stderr)
    if not args.json:
        rounds = f"{cfg['rounds']} round{'s' if cfg['rounds'] != 1 else ''}"
        print(f"run {res.run_id} ({cfg['method']} on {cfg['dataset']}, {cfg['clients']} clients, "
              f"{rounds}) -> {res.status}" + (" (DIVERGED)" if f.get("diverged") else "")
              + (f", resumed after round {res.resumed_from + 1}" if res.resumed_from is not None else "")
              + (f", re-scored from run {f['rescored_from']}'s kept final state (no training)"
                 if f.get("rescored_from") and not res.reused else "")
              + (" (stored: not run again; --fresh runs it again)" if res.reused else ""))
        keys = [k for k in ("global_acc", "local_acc", "local_acc_weighted", "ad", "sdad", "local_f1",
                            "global_model_acc", *_EXTRA_ACCURACIES, "seconds") if k in f]
        rows = [[k, f[k], f.get(f"best_{k}")] for k in keys]
        rows += [[f"{k} (last evaluation)", v, None] for k, v in val.items()]
        if "rejected" in f:
            rows.append(["rejected updates", f["rejected"], None])
        rows += [[k, f[k], None] for k in summary_extras(f)]     # simulated time, totals, epsilon spent
        print(_table(rows, ["metric", "final", "best"]))
    failed = _client_failures(args.db, res.run_id) if f.get("rejected") else []
    if failed and not args.json:
        print(f"client updates not used ({f['rejected']}; `fedprism show {res.run_id} --db {shlex.quote(args.db)}` "
              "lists them by round):")
        for k in failed:
            print(f"  {k.line()}")
    out = {k: f.get(k) for k in ("global_acc", "local_acc", "ad", "sdad", "seconds", "rejected")}
    out.update({k: f[k] for k in _EXTRA_ACCURACIES if k in f})
    out.update(val)
    out.update({k: f[k] for k in summary_extras(f)})
    out["diverged"] = bool(f.get("diverged", False))
    if f.get("diverged"):
        out["diverged_round"] = f.get("diverged_round")
    out["status"] = res.status
    out["reused"] = res.reused
    out["run_id"] = res.run_id
    if f.get("rescored_from"):                     # evaluated from another run's final state, not trained
        out["rescored_from"] = f["rescored_from"]
    if failed:
        out["client_failures"] = [k.as_dict() for k in failed]
    if args.json:
        print(json_text(out))
    return 0


def last_validation(history: list[dict]) -> dict:
    """The validation scores (`data.val_fraction`: `val_acc`, ...) of a run's last evaluation that has them,
    {} without: what a value is chosen on, printed beside the test scores (never in the stored final)."""
    for h in reversed(history):
        val = {k: h[k] for k in VALIDATION_KEYS if k in h}
        if val:
            return val
    return {}


#: the validation scores a round stores where the run holds out validation rows (`data.val_fraction`)
VALIDATION_KEYS = ("val_acc", "val_loss", "val_f1")


#: accuracies `fedprism run` prints and puts in --json where the run has them: the held-out clients'
#: (`data.unseen_clients`) and the fine-tuned prediction's (`eval.finetune`, `<metric>@ft`)
_EXTRA_ACCURACIES = ("unseen_local_acc", "global_acc@ft", "local_acc@ft", "unseen_local_acc@ft")


def _run_built(args, stored_id: str | None, raw: dict | None, pristine: bool):
    """`fedprism run` the full way: the configuration resolved, the run built, then run, resumed or found
    stored (its provenance checked); the lookup memo is written from it (`lookup.Recorder`)."""
    from fedprism.experiment.config import resolve
    from fedprism.experiment.fresh import fix_for_cli_run, stored_config
    from fedprism.experiment.lookup import Recorder
    from fedprism.experiment.runner import Experiment
    from fedprism.experiment.store import Store, drop_if_new_and_empty

    cfg = None if stored_id else resolve(raw)
    if cfg is not None:
        from fedprism.experiment.limits import attack_warning

        note = attack_warning(cfg)
        if note:
            print(f"fedprism: warning: {note}", file=sys.stderr)
    memo = Recorder(raw, cfg, active=pristine and cfg is not None)
    created = not Path(args.db).exists()
    store = Store(args.db)
    try:
        if stored_id:                               # `run --fresh RUN_ID`: the stored run's configuration
            from fedprism.experiment.config import parse_overrides

            cfg = stored_config(store, stored_id, parse_overrides(args.items[1:]))
        exp = Experiment(cfg, store, progress=not args.quiet)    # progress goes to stderr, also with --json
        exp.fix = fix_for_cli_run(exp.run_id, args.db)
        memo.watch(exp)
        if args.fresh and exp.forget_stored():  # only now: a run that cannot start, or is running, is kept
            print(f"--fresh: dropped what the store held of run {exp.run_id} (rounds, checkpoint, kept final "
                  "state); running it again",
                  file=sys.stderr)
        res = exp.run()
    except BaseException:
        drop_if_new_and_empty(store, created)     # refused (data, partition, scalars=): no empty store behind
        raise
    memo.save(res)
    return cfg, res


def _client_failures(db: str, run_id: str) -> list:
    """The failure kinds of a stored run (`fedprism.experiment.failures`): each with its count and first
    message, read from the store opened read-only."""
    from fedprism.experiment.failures import of_run
    from fedprism.experiment.store import Store

    with Store(db, readonly=True) as store:
        return of_run(store, run_id)


def cmd_demo(args) -> int:
    from fedprism.experiment.demo import demo

    return demo(args.db, quick=args.quick, items=args.items, workers=args.workers)


def _ray_options(args):
    """`--ray ADDRESS` and its options (`sweep`, `tune`) as an `executor.RayOptions`, or None; checked before
    any file is read."""
    if args.ray is not None:
        from fedprism.experiment.executor import RayOptions

        ray = RayOptions(args.ray, 1.0 if args.ray_cpus is None else args.ray_cpus,
                         0.0 if args.ray_gpus is None else args.ray_gpus, args.ray_store or "shared", args.ray_scratch)
        if args.workers != 1:
            raise ConfigError("--workers", args.workers, "1 with --ray (each run is a task of the cluster, which "
                              "runs as many at once as its CPUs and GPUs hold: --ray-cpus, --ray-gpus)", kind="option")
        return ray
    if any(v is not None for v in (args.ray_cpus, args.ray_gpus, args.ray_store, args.ray_scratch)):
        raise ConfigError("--ray", None, "the cluster's address (host:port, auto or local) with --ray-cpus, "
                          "--ray-gpus, --ray-store or --ray-scratch", kind="option")
    return None


def cmd_sweep(args) -> int:
    from fedprism.experiment.config import parse_overrides
    from fedprism.experiment.sweep import run_sweep, sweep_db

    ray = _ray_options(args)                 # checked before the sweep file is read
    # --db, then $FEDPRISM_DB, then the file's own `db` (not for --quick smoke runs), then the default
    db = args.db or os.environ.get("FEDPRISM_DB") or (None if args.quick else sweep_db(args.file)) or DEFAULT_DB
    return run_sweep(args.file, db, only=args.only, quick=args.quick, progress=not args.quiet,
                     limit=args.limit, seeds=args.seed, overrides=parse_overrides(args.items), workers=args.workers,
                     fresh=args.fresh, ray=ray)


def cmd_tune(args) -> int:
    from fedprism.experiment.config import parse_overrides
    from fedprism.experiment.tune import run_study, study_db

    ray = _ray_options(args)                 # checked before the study file is read
    # --db, then $FEDPRISM_DB, then the file's own `db` (not for --quick), then the default
    db = args.db or os.environ.get("FEDPRISM_DB") or (None if args.quick else study_db(args.file)) or DEFAULT_DB
    run_study(args.file, db, quick=args.quick, overrides=parse_overrides(args.items), only=args.only,
              stage=args.stage, workers=args.workers, progress=not args.quiet, ray=ray)
    return 0


def cmd_report(args) -> int:
    from fedprism.report import write_report

    if args.leaderboard and not args.html:       # the leaderboard of the named sweeps only
        from fedprism.report.leaderboard import write_leaderboard

        for p in write_leaderboard(args.db, args.out, args.sweep or [], metric=args.metric):
            print(p)
        return 0

    if args.partition_study:                     # partitions only: no store is read
        from fedprism.report import write_partition_studies

        for p in write_partition_studies(args.partition_study, args.out, seeds=tuple(args.seed or (0, 1, 2)),
                                         plots=not args.no_plots):
            print(p)
        return 0
    # with --html --leaderboard: the report of the sweeps and their leaderboard, both on report.html's page
    paths = write_report(args.db, args.out, sweep=args.sweep, plots=not args.no_plots, reference=args.reference,
                         html=args.html, leaderboard=args.metric if args.leaderboard else None)
    for p in paths:
        print(p)
    from fedprism.experiment.store import Store
    from fedprism.report import selected_runs

    with Store(args.db, readonly=True) as store:   # tables hold finished runs only: name those left out
        left = sorted({(r["run_id"], r["status"]) for r in selected_runs(store, args.sweep)
                       if r["status"] != "finished"})
    if left:
        print(f"fedprism: note: {len(left)} unfinished run(s) left out of the report: "
              + ", ".join(f"{printable(rid[:8])} ({printable(status)})" for rid, status in left[:10])
              + (", ..." if len(left) > 10 else "") + "; resume them with the same sweep or run command",
              file=sys.stderr)
    return 0


def _acc(final: dict, key: str) -> str:
    v = final.get(key)
    return f"{100 * v:.2f}" if isinstance(v, (int, float)) and not isinstance(v, bool) else ""


def cmd_runs(args) -> int:
    from fedprism.experiment.store import Store

    with Store(args.db, readonly=True) as store:     # closed on every path: no -wal/-shm left behind
        return _runs(args, store)


def _runs(args, store) -> int:
    if args.sweep:
        store.require_sweeps([args.sweep])
    stored = sorted({r[0] for r in store.db.execute("SELECT DISTINCT method FROM runs")}) if args.method else []
    if args.method and args.method not in stored:      # a stored method's runs are listed without its code
        from fedprism import plugins
        from fedprism.algorithms import REGISTRY
        from fedprism.experiment.config import suggest

        plugins.load()
        if args.method not in REGISTRY:
            raise FedPrismError(f"no method {args.method!r}{suggest(args.method, sorted({*REGISTRY, *stored}))};"
                                f" methods of stored runs: {', '.join(stored) or 'none'}")
    where = {k: v for k, v in (("method", args.method), ("status", args.status)) if v}
    rows = store.runs(**({"sweep": args.sweep} if args.sweep else {}), **where)
    from fedprism.experiment.runlock import holder_gone

    from fedprism.experiment.differ import tell_apart

    cfgs = [json.loads(r["config"]) for r in rows]
    # the keys that tell apart rows of one method and label (two alphas of "FedAvg"): "partition.alpha=0.1"
    apart = tell_apart(cfgs, names=[(r["method"], r["label"]) for r in rows])
    records = []                # numbers as stored (accuracies in [0, 1]; None before a run has finished)
    for r, cfg, differs in zip(rows, cfgs, apart):
        f = json.loads(r["final"] or "{}")
        records.append({"run_id": r["run_id"], "method": r["method"], "label": r["label"] or "",
                        "differs": differs, "seed": cfg.get("seed"), "status": r["status"],
                        "rounds_done": r["rounds_done"], "rounds": cfg.get("rounds"),
                        "local_acc": f.get("local_acc"), "global_acc": f.get("global_acc")})
        if (cfg.get("data.val_fraction") or 0) > 0:     # the score a value is chosen on, last evaluation
            val = last_validation(store.round_metrics(r["run_id"]))
            if "val_acc" in val:
                records[-1]["val_acc"] = val["val_acc"]
        if "sim_clock" in f:                          # simulated seconds of a run with `system.speeds`
            records[-1]["sim_clock"] = f["sim_clock"]
        if r["status"] == "running" and holder_gone(store.lock_path(r["run_id"])):
            records[-1]["process_gone"] = True        # killed: the store says so at its next write-open
    hidden = store.hidden()
    store.close()
    if hidden:
        print(f"fedprism: warning: {args.db}: {hidden} stored row(s) are not well formed (damaged or crafted) "
              f"and are left out; `fedprism merge {shlex.quote(args.db)} --db NEW.db` copies the sound runs into "
              "a new store", file=sys.stderr)
    gone = any(d.get("process_gone") for d in records)
    if args.json:
        print(json_text(records))
    elif records:
        differs = any(d["differs"] for d in records)     # the column only where rows of one label differ
        clock = any("sim_clock" in d for d in records)   # the column only where a listed run has a clock
        val = any("val_acc" in d for d in records)        # only where a listed run holds out validation rows
        head = ["id", "method", "label", *(["differs"] if differs else []), "seed", "status", "rounds",
                *(["val %"] if val else []), "local %", "global %", *(["sim s"] if clock else [])]
        print(_table([[d["run_id"], d["method"], d["label"], *([d["differs"]] if differs else []), d["seed"],
                       "interrupted*" if d.get("process_gone") else d["status"],
                       f"{d['rounds_done']}/{d['rounds']}", *([_acc(d, "val_acc")] if val else []),
                       _acc(d, "local_acc"), _acc(d, "global_acc"), *([d.get("sim_clock")] if clock else [])]
                      for d in records], head))
        if gone:
            print("* stored as running, but no process runs it (killed); the same command resumes it, and "
                  "the store records it as interrupted when next opened for writing", file=sys.stderr)
    else:
        print("no runs match", file=sys.stderr)
    return 0


def cmd_show(args) -> int:
    from fedprism.experiment.store import Store

    with Store(args.db, readonly=True) as store:     # closed on every path: no -wal/-shm left behind
        return _show(args, store)


def _show(args, store) -> int:
    from fedprism.experiment.result import PRIVACY_PREFIXES, round_columns, summary_extras

    row = store.find(args.run)
    run_id = row["run_id"]
    cfg = json.loads(row["config"])
    prov = store.provenance(run_id)
    sweeps = [r[0] for r in store.db.execute("SELECT sweep FROM sweep_runs WHERE run_id=? ORDER BY sweep", (run_id,))]
    source = json.loads(row["final"] or "{}").get("rescored_from")
    label = f" '{row['name']}'" if row["name"] else ""          # no label: nothing, not ''
    print(printable(f"run {run_id}: {row['method']}{label} seed {row['seed']}, {row['status']}, "
                    f"{row['rounds_done']}/{cfg.get('rounds')} rounds; code {row['code_version']}"
                    + (f"; sweeps: {', '.join(sweeps)}" if sweeps else "")))
    if source:
        print(f"re-scored from run {source}'s kept final state: no training; its rounds are in that run")
    print("\nConfiguration:")
    print(_table([[k, json.dumps(v)] for k, v in sorted(cfg.items())], ["key", "value"]))
    print("\nProvenance:")
    if prov is None:
        print("  unknown (stored before provenance was recorded: no code or data fingerprint to compare)")
    else:
        flat = []
        for k, v in prov.items():
            if isinstance(v, dict):
                for k2, v2 in v.items():
                    flat.append([f"{k}.{k2}", json.dumps(v2) if isinstance(v2, dict) else _fmt(v2)])
            else:
                flat.append([k, _fmt(v)])
        print(_table(flat, ["key", "value"]))
        from fedprism.experiment.fresh import verify_hint
        from fedprism.experiment.provenance import code_state

        now = code_state(prov)
        print("code now: " + (now if now.startswith("cannot tell") else
                              f"{now}; data not checked here ({verify_hint(run_id, args.db, row['method'])})"))
    hist = store.round_metrics(run_id)
    failures = [r for r in store.records(run_id) if r["kind"] in ("failure", "rejected")]
    store.close()
    if failures:
        _show_failures(failures, run_id, args.db)
    if hist:
        keys = [k for k in ("global_acc", "local_acc", "val_acc", "sdad", "global_model_acc", "train_loss",
                            "accepted", "rejected", "eval_clients", "train_s", "eval_s") if any(k in h for h in hist)]
        # the clock, who missed the round, staleness, bytes and epsilon: the columns a run's rounds store
        keys += round_columns(hist)
        print("\nRounds:")
        print(_table([[h["round"] + 1] + [h.get(k) for k in keys] for h in hist], ["round"] + keys))
    final = json.loads(row["final"] or "{}")
    summary = [k for k in ("global_acc", "local_acc", "sdad", "global_model_acc", *_EXTRA_ACCURACIES, "rejected")
               if k in final]
    summary += summary_extras(final)
    val = last_validation(hist) if final else {}
    if summary:
        print("\nFinal:")
        print(_table([[k, final[k]] for k in summary] + [[f"{k} (last evaluation)", v] for k, v in val.items()],
                     ["metric", "value"]))
    dp = [[k, _fmt(final[k])] for k in sorted(final) if k.startswith(PRIVACY_PREFIXES)]
    if dp:
        print("\nDifferential privacy (docs/privacy.md):")
        print(_table(dp, ["key", "value"]))
    return 0


#: most client failures `fedprism show` lists one by one (all are counted by kind)
_SHOWN_FAILURES = 50


def _show_failures(records: list[dict], run_id: str, db: str) -> None:
    """`fedprism show`: the run's client failures by kind (count and first message), then one line each."""
    from fedprism.experiment.failures import kinds, one_line, reason_of

    print("\nClient failures (updates not used):")
    for k in kinds(records):
        print(f"  {k.line()}")
    rows = [[r["round"] + 1, r["client"], r["kind"], one_line(reason_of(r["data"]), 160)]
            for r in records[:_SHOWN_FAILURES]]
    print(_table(rows, ["round", "client", "kind", "reason"]))
    if len(records) > _SHOWN_FAILURES:
        print(f"  ... and {len(records) - _SHOWN_FAILURES} more (`fedprism export --run {run_id} --db "
              f"{shlex.quote(db)}` writes every record)")


def cmd_verify(args) -> int:
    from fedprism.experiment.verify import verify

    from fedprism.experiment.config import parse_overrides

    ok = verify(args.db, args.run, rounds=args.rounds, threads=args.threads, progress=not args.quiet,
                overrides=parse_overrides(args.items))
    return 0 if ok else 1


def _shown(p) -> str:
    """A parameter's default as it can be typed back: `auto` for a default that `auto` stands for."""
    if p.default is None:
        try:
            p.validate("key", "auto")
            return "auto"
        except FedPrismError:
            pass
    return repr(p.default)


def _list_components(registry, names, describe, head=("key", "default", "meaning"), before=None) -> int:
    """The listing behind `fedprism methods`, `models`, `partitions` and `datasets`: for each name in
    `names` (default: every registered one, built-in or plugin, sorted) a title line and a table.

    `describe(name, component) -> (title, rows)` says what to show; rows are lists of cells under `head`
    (no table when empty). `before(width)` prints what comes before the components when no name is given
    (the experiment keys in `fedprism methods`). An unknown name is refused with the registry's
    did-you-mean before anything is printed or imported. Only this kind's plugins are loaded (its
    entry-point group): `fedprism datasets` imports no method, model or torch."""
    registry.load_plugins()
    unknown = [n for n in names if n not in registry]
    if unknown:
        raise FedPrismError(registry.unknown(unknown[0]))
    width = shutil.get_terminal_size((110, 24)).columns
    if not names and before is not None:
        before(width)
    for name in (list(dict.fromkeys(names)) or registry.names()):
        title, rows = describe(name, registry[name])
        print(f"\n{title}")
        if rows:
            print(_table(rows, list(head), width))
    return 0


def _param_row(key: str, p) -> list:
    return [key, _shown(p), p.help + (f" [{', '.join(map(str, p.choices))}]" if p.choices else "")]


def _describe_method(name: str, cls) -> tuple[str, list[list]]:
    """A method's own parameters; the title of one that averages models (`averages`) names the shared
    server-step options, which `fedprism methods` lists once (`_server_steps`)."""
    own = getattr(cls, "own_params", cls.params)
    title = f"{name}  ({cls.paper})"
    if getattr(cls, "averages", ()):
        width = shutil.get_terminal_size((110, 24)).columns
        title += "\n" + textwrap.fill(f"+ {name}.aggregation*, {name}.server_*: the server step on "
                                      f"{', '.join(cls.averages)} (Server steps, below)", width,
                                      initial_indent="  ", subsequent_indent="    ", break_on_hyphens=False)
    space = cls.search_space()                     # where `fedprism tune` searches a key (docs/tuning.md)
    rows = [_param_row(f"{name}.{k}", p) for k, p in own.items()]
    for row in rows:
        if row[0] in space:
            row[2] += f"; tuned in {space[row[0]].describe()}"
    return title, rows


def _server_steps(registry, names, width: int) -> None:
    """The shared server-step options, once, for the averaging methods among those listed."""
    from fedprism.algorithms.aggregation import SERVER_STEP_PARAMS

    averaging = [n for n in (list(dict.fromkeys(names)) or registry.names()) if getattr(registry[n], "averages", ())]
    if not averaging:
        return
    print("\n" + textwrap.fill(f"Server steps (<method>.KEY of every method that averages models: "
                              f"{', '.join(averaging)}):", width, subsequent_indent="  ", break_on_hyphens=False))
    print(_table([_param_row(f"<method>.{k}", p) for k, p in SERVER_STEP_PARAMS.items()],
                 ["key", "default", "meaning"], width))


def cmd_methods(args) -> int:
    from fedprism.algorithms import REGISTRY
    from fedprism.experiment.config import KEYS

    def keys(width: int) -> None:
        print("Experiment keys:")
        print(_table([[k, repr(p.default), p.help + (f"; tuned in {p.space.describe()}" if p.space else "")]
                      for k, p in KEYS.items()], ["key", "default", "meaning"], width))

    _list_components(REGISTRY, args.names, _describe_method, before=keys)
    width = shutil.get_terminal_size((110, 24)).columns
    _server_steps(REGISTRY, args.names, width)
    if args.names:
        return 0
    from fedprism.data.partitions import PARTITIONS
    from fedprism.experiment.config import PARTITION_COMMON

    print("\nPartitions (partition=NAME; `fedprism partitions` says what each key means):")
    for name, spec in PARTITIONS.items():
        allp = {**PARTITION_COMMON, **spec.params}
        print(textwrap.fill(f"  {name}: " + ", ".join(f"partition.{k}={p.default!r}" for k, p in allp.items()),
                            width, subsequent_indent="    ", break_on_hyphens=False))
    return 0


def _kind(registry, name: str, obj) -> str:
    """'built in', or 'plugin, <module>' for a registered component."""
    return "built in" if registry.is_builtin(name) else f"plugin, {getattr(obj, '__module__', '?')}"


#: the class count `fedprism models` builds each model with (its parameter counts)
_LIST_CLASSES = 10


def _describe_model(name: str, spec) -> tuple[str, list[list]]:
    """`fedprism models`: what the spec declares, and the parameter counts of the model built on its
    example input shape (body and head apart when it has them)."""
    import torch

    from fedprism.models import MODELS, build_model

    rows: list[list] = [["inputs", spec.inputs],
                        ["data.pad32=auto", "pads 28x28 images to 32x32" if spec.pad32 else "leaves images as they are"]]
    shape = "x".join(map(str, spec.shape))
    try:
        model = build_model(name, spec.shape, _LIST_CLASSES, vocab_size=spec.vocab if spec.tokens else 0)
    except Exception as e:  # noqa: BLE001 - a plugin builder that fails here is shown, not fatal to the listing
        rows.append(["parameters", f"not built on [{shape}]: {type(e).__name__}: {e}"])
        return f"{name}  ({spec.title or _kind(MODELS, name, spec)})", rows
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    vocab = f", vocabulary {spec.vocab:,}" if spec.tokens else ""
    rows.append(["parameters", f"{count(model):,} on [{shape}] inputs, {_LIST_CLASSES} classes{vocab}"])
    try:
        from fedprism.models.flops import forward_macs

        macs = forward_macs(model, spec.shape, torch.int64 if spec.tokens else torch.float32)
        rows.append(["forward", f"{_macs(macs)} multiply-adds per sample (matrix products and convolutions, "
                                "fedprism.models.flops)"])
    except Exception as e:  # noqa: BLE001 - a plugin model whose forward fails here is shown, not fatal
        rows.append(["forward", f"not counted on [{shape}]: {type(e).__name__}: {e}"])
    body, head = getattr(model, "body", None), getattr(model, "head", None)
    if isinstance(body, torch.nn.Module) and isinstance(head, torch.nn.Module):
        rows += [["body", f"{spec.body or type(body).__name__} ({count(body):,} parameters)"],
                 ["head", f"{spec.head or type(head).__name__} ({count(head):,} parameters)"]]
    else:
        rows.append(["body / head", "no `body` and `head` submodules: methods that share or keep the head "
                                    "apart (FedPer, FedRep, prototypes) cannot use it"])
    title = spec.title + ("" if MODELS.is_builtin(name) else f"; {_kind(MODELS, name, spec)}") if spec.title \
        else _kind(MODELS, name, spec)
    return f"{name}  ({title})", rows


def _macs(n: int) -> str:
    """A multiply-add count with its magnitude: 416,520 (417 k)."""
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= div:
            return f"{n:,} ({n / div:.3g} {unit})"
    return f"{n:,}"


def cmd_models(args) -> int:
    """`fedprism models [NAME...]`: every registered model (or the named ones) with what it declares."""
    from fedprism.models import MODELS

    def auto(width: int) -> None:
        from fedprism.models import AUTO_IMAGES, AUTO_OTHER, AUTO_TOKENS

        print(textwrap.fill(f"Models (model=NAME; model=auto: {AUTO_IMAGES} for images of at least 28 pixels, "
                            f"{AUTO_TOKENS} for token data, {AUTO_OTHER} for everything else). Parameter counts "
                            f"and forward multiply-adds (MACs: one multiply and one add, 2 FLOPs) are for one "
                            f"sample of the input shape shown and {_LIST_CLASSES} classes.", width))

    return _list_components(MODELS, args.names, _describe_model, head=("field", "value"), before=auto)


def _describe_partition(name: str, spec) -> tuple[str, list[list]]:
    from fedprism.data.partitions import PARTITIONS

    title = spec.title or _kind(PARTITIONS, name, spec)
    if not PARTITIONS.is_builtin(name) and spec.title:
        title += f"; {_kind(PARTITIONS, name, spec)}"
    rows = [[f"partition.{k}", _shown(p), p.help + (f" [{', '.join(map(str, p.choices))}]" if p.choices else "")]
            for k, p in spec.params.items()]
    if spec.natural:
        rows.append(["(data)", "-", "needs a dataset that records each sample's user or device; clients = "
                                    "their number"])
    return f"{name}  ({title})", rows


def cmd_partitions(args) -> int:
    """`fedprism partitions [NAME...]`: every registered partition (or the named ones) with its keys."""
    from fedprism.data.partitions import PARTITIONS
    from fedprism.experiment.config import PARTITION_COMMON

    def common(width: int) -> None:
        print("Keys of every partition:")
        print(_table([[f"partition.{k}", _shown(p), p.help] for k, p in PARTITION_COMMON.items()],
                     ["key", "default", "meaning"], width))

    return _list_components(PARTITIONS, args.names, _describe_partition, before=common)


def cmd_partition(args) -> int:
    import numpy as np

    from fedprism.data import heterogeneity
    from fedprism.data.partition import Partition, summarize
    from fedprism.data.plots import plot_class_distribution
    from fedprism.experiment.federation import build_federation

    cfg = _config(args)
    png = _figure_path(args.png) if args.png else None          # checked before any work
    fed = build_federation(cfg)
    hist = fed.label_hist()
    domains = fed.meta.get("client_domains")
    rows = summarize(Partition(fed.train_idx, fed.test_idx, domains=None if domains is None else np.asarray(domains)),
                     fed.y_train.numpy(), fed.num_classes)
    noise = _input_noise(cfg, fed.meta)
    for r in rows if noise else []:               # a partition that perturbs the inputs: each client's level
        r["noise_std"] = noise[int(r["client"])]
    show = rows if args.all else rows[:20]
    print(_table([[r.get(k) for k in show[0]] for r in show], list(show[0])))
    if len(rows) > len(show):
        print(f"... {len(rows) - len(show)} more clients (--all to list them)")
    rep = heterogeneity.report(hist)
    print("\nHeterogeneity of the train label distributions:")
    print(_table([[k, v] for k, v in rep.items() if np.isscalar(v)], ["metric", "value"]))
    if noise:
        print(f"\nFeature skew ({cfg['partition']}): each client's inputs carry Gaussian noise of std noise_std "
              f"(in normalised units; {min(noise):.4g} to {max(noise):.4g}), its local test rows too, the global "
              "test set none; the label statistics above do not see it")
    n = fed.n_train
    print(f"\n{fed.num_clients} clients, train samples per client min {n.min()} / median {int(np.median(n))} / "
          f"max {n.max()}; local test per client min {fed.n_test.min()} / max {fed.n_test.max()}")
    if png is None:
        print("(--png FILE draws the class distribution of the first 20 clients)")
        return 0
    plot_class_distribution(hist, png, first=20,
                            title=f"{cfg['dataset']} {cfg['partition']} {cfg.partition_params}")
    print(f"class distribution of the first 20 clients: {png}")
    return 0


def _input_noise(cfg, meta: dict) -> list[float] | None:
    """Each client's noise std when the partition perturbs the inputs (`PartitionSpec.perturb`, such as
    `feature_noise`'s sigma*i/N) and records the levels in its metadata (`noise_std`); None otherwise."""
    from fedprism.data.partitions import PARTITIONS

    if PARTITIONS.get(cfg["partition"], "partition").perturb is None or "noise_std" not in meta:
        return None
    return [float(v) for v in meta["noise_std"]]


def _figure_path(value: str) -> Path:
    """--png: a file whose suffix names a figure format matplotlib writes here (.png, .pdf or .svg)."""
    path = Path(value)
    if path.suffix.lower() not in (".png", ".pdf", ".svg"):
        raise ConfigError("--png", value, "a file name ending in .png, .pdf or .svg", kind="option")
    if path.is_dir():
        raise ConfigError("--png", value, "a file name, not a folder", kind="option")
    return path


def cmd_export(args) -> int:
    from fedprism.report.export import export

    for p in export(args.db, args.out, args.format, runs=args.run, sweeps=args.sweep):
        print(p)
    return 0


def cmd_merge(args) -> int:
    from fedprism.experiment.merge import merge, selection
    from fedprism.experiment.store import Store

    if args.dry_run and not Path(args.db).is_file():
        raise FedPrismError(f"--dry-run: no results store at {args.db} (check --db or $FEDPRISM_DB)")
    found: dict[str, int] = {}
    for src in args.stores:            # every part must be a store before the destination is created
        if not Path(src).is_file():
            raise FedPrismError(f"no results store to merge at {src}")
        with Store(src, readonly=True) as part:
            missing = selection(part, args.run, args.sweep)[1]
        for name in [*(args.run or []), *(f"sweep {s}" for s in args.sweep or [])]:
            found[name] = found.get(name, 0) + (name not in missing)
    if absent := [name for name, n in found.items() if not n]:
        raise FedPrismError(f"merge: no store of {', '.join(args.stores)} has {', '.join(absent)}; "
                            "nothing was merged")
    with Store(args.db, readonly=args.dry_run) as store:
        for src in args.stores:
            rep = merge(store, src, dry_run=args.dry_run, runs=args.run, sweeps=args.sweep, missing_ok=True)
            print(rep.summary(args.dry_run))
    return 0


def _dataset_files(spec) -> str:
    """Whether a copy of the dataset's files is found (no file is read or hashed), and where."""
    from fedprism.data.files import locate

    if spec.files is None:
        return "none needed (bundled or generated)"
    found = locate(spec, None)
    if isinstance(found, tuple):
        return f"found in {found[1]}"
    return f"not found (needed: {spec.files.needed}; searched {', '.join(str(p) for p, _ in found)})"


def _dataset_download(spec) -> str:
    if spec.files is None:
        return "-"
    if not spec.files.remote:
        return "no (copy the files in)"
    if spec.files.trust_on_first_use:
        return f"yes, `fedprism data download {spec.name}` (no published checksum: trusted on first use)"
    pinned = "SHA-256 and MD5" if all(f.sha256 and f.md5 for f in spec.files.remote) else \
        "SHA-256" if all(f.sha256 for f in spec.files.remote) else "MD5 only"
    return f"yes, `fedprism data download {spec.name}` ({pinned} verified)"


def _describe_dataset(name: str, spec) -> tuple[str, list[list]]:
    """A dataset's spec as rows: classes, input, normalisation, natural clients, padding, options, files."""
    def unknown(v):
        return "(known once loaded)" if v is None else v

    names = f": {', '.join(spec.class_names)}" if spec.class_names else ""
    shape = "x".join(map(str, spec.input_shape)) if spec.input_shape else unknown(None)
    norm = f"per channel, mean {spec.mean}, std {spec.std}" if spec.mean else spec.normalisation or "-"
    from_config = {option: key for key, option in spec.config_keys}
    rows = [["classes", f"{unknown(spec.num_classes)}{names}"],
            ["input", shape + (" (data.pad32=auto pads to 32x32 for models that take 32x32)" if spec.pad32_auto
                               else "")
             + (f" token ids, vocabulary {spec.vocab_size:,} (token models only)" if spec.vocab_size else "")],
            ["normalisation", norm],
            ["natural partition", f"by {spec.natural} (partition=natural: one client per {spec.natural})"
             if spec.natural else "none"],
            ["options", ", ".join(o + (f" (from {from_config[o]})" if o in from_config else "")
                                  for o in spec.options) or "-"],
            ["files", _dataset_files(spec)],
            ["download", _dataset_download(spec)]]
    kind = "built in" if _datasets().is_builtin(name) else f"plugin, {spec.module}"
    return f"{name}  ({spec.summary or kind}; {kind})", rows


def _datasets():
    from fedprism.data.base import DATASETS

    return DATASETS


def cmd_store(args) -> int:
    from fedprism.experiment import archive

    if args.store_command == "dump":
        print(archive.dump(args.db, args.out).summary())
    else:
        print(archive.load(args.dump, args.db).summary())
    return 0


def cmd_datasets(args) -> int:
    """`fedprism datasets [NAME...]`: every registered dataset (or the named ones) with its spec."""
    registry = _datasets()

    def overview(width: int) -> None:
        rows = []
        for n, spec in registry.all().items():
            files = _dataset_files(spec)
            rows.append([n, spec.num_classes if spec.num_classes is not None else "?",
                         "x".join(map(str, spec.input_shape)) if spec.input_shape else "?",
                         spec.natural or "-", files.split(" (")[0].split(" in ")[0],
                         "yes" if spec.downloadable else "no"])
        print("Datasets (dataset=NAME; details below):")
        print(_table(rows, ["dataset", "classes", "input", "natural", "files", "download"], width))

    return _list_components(registry, args.names, _describe_dataset, head=("field", "value"), before=overview)


def cmd_data(args) -> int:
    from fedprism.data.datasets import load_dataset
    from fedprism.data.download import download

    if args.action == "download":
        import signal

        def stop(*_):
            raise KeyboardInterrupt

        from fedprism.data.download import remote_files

        remote = remote_files()
        for name in args.names:                        # every name before the first (long) download
            if name not in remote:
                download(name, args.dest)              # raises, naming the downloadable datasets
        before = signal.signal(signal.SIGTERM, stop)   # as Ctrl-C: the partial file is removed on the way out
        try:
            for name in args.names:
                print(f"{name}: {download(name, args.dest)}")
        except KeyboardInterrupt:
            print("\nfedprism: download interrupted; nothing partial was kept (run it again to download "
                  "again)", file=sys.stderr)
            return 130
        finally:
            signal.signal(signal.SIGTERM, before)
    else:
        for name in args.names:
            try:
                ds = load_dataset(name, root=args.dest)
            except DataError as e:
                if args.dest is None:
                    raise
                raise DataError(f"{e}\n(--dest is the data.root here: `fedprism data download {name} --dest "
                                f"{args.dest}` fetches the files into it)") from None
            print(f"{name}: train {tuple(ds.x_train.shape)} test {tuple(ds.x_test.shape)} classes {len(ds.classes)}")
    return 0


def cmd_kernels(args) -> int:
    """`fedprism kernels build`: build this machine's kernel libraries, each on its own (a failure is
    remembered for its key; `build` forgets it and tries again); `status`: what is built, and why not."""
    from fedprism.kernels import build

    names = args.libraries or list(build.LIBRARIES)
    unknown = [n for n in names if n not in build.LIBRARIES]
    if unknown:
        raise ConfigError("library", unknown[0], f"one of {', '.join(build.LIBRARIES)}", kind="argument")
    rc = 0
    if args.action == "build":
        for name in names:
            try:
                path = build.build(build.LIBRARIES[name], force=args.force, retry=True)
            except build.KernelBuildError as e:
                rc = 1
                print(f"{name}: not built: {e}", file=sys.stderr)
            else:
                print(f"{name}: built {path}")
        return rc
    for row in build.status():
        if row["library"] in names:
            why = f" ({row['why']})" if row["why"] else ""
            print(f"{row['library']}: {row['state']}{why}; {row['source']} sha256 {row['source_sha256']}, "
                  f"compiler {row['compiler']}, -march={row['target']}, {row['path']}")
    return rc


def _store_path(value: str) -> str:
    """--db: a file's path; an empty one would name the current folder."""
    if not value.strip():
        raise argparse.ArgumentTypeError(f"an empty path is not a results store; name a file (e.g. "
                                         f"{DEFAULT_DB})")
    return value


def _ray_arguments(s, what: str = "each run") -> None:
    """--ray and its options, the same for `sweep` and `tune` (docs/ray.md)."""
    s.add_argument("--ray", default=None, metavar="ADDRESS",
                   help=f"send {what} to the Ray cluster at ADDRESS (host:port of its head, auto, or local) as "
                   "one task (docs/ray.md)")
    s.add_argument("--ray-cpus", type=float, default=None, help="--ray: CPUs each run's task declares (default 1)")
    s.add_argument("--ray-gpus", type=float, default=None,
                   help="--ray: GPUs each run's task declares; a fraction shares a GPU (0.25: four runs per GPU; "
                   "default 0)")
    s.add_argument("--ray-store", default=None, choices=("shared", "ship"),
                   help="--ray: shared (every node opens --db: one machine, or a file system all nodes mount) or "
                   "ship (each task writes a store in its node's scratch and the finished run is merged here); "
                   "default shared")
    s.add_argument("--ray-scratch", default=None, metavar="DIR",
                   help="--ray-store ship: the folder on each node for the runs' own stores and checkpoints "
                   "(default $FEDPRISM_RAY_SCRATCH, else <temp>/fedprism-ray)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fedprism",
        description="Personalized federated learning under non-IID data: Fed-PRISM and its baselines.",
        epilog="Every subcommand has --help. Results go to a SQLite file (--db, default fedprism-results.db).")
    sub = p.add_subparsers(dest="command", required=True)

    def with_db(sp):
        sp.add_argument("--db", default=os.environ.get("FEDPRISM_DB") or DEFAULT_DB, type=_store_path,
                        help=f"results database (default: $FEDPRISM_DB, else {DEFAULT_DB})")
        return sp

    r = with_db(sub.add_parser("run", help="run (or resume) one experiment",
                               description="Run one experiment from an optional TOML file plus key=value "
                               "overrides. A finished run with the same config is not run again; an "
                               "interrupted one resumes from its last round."))
    r.add_argument("items", nargs="*", default=[], metavar="[config.toml | RUN_ID] key=value",
                   help=KV_HELP + "; with --fresh, a stored run's id (or an unambiguous prefix) instead of "
                   "the configuration, plus execution-only keys")
    r.add_argument("--json", action="store_true", help="print one JSON object with the final metrics last")
    r.add_argument("--quiet", action="store_true", help="no progress (it goes to stderr, also with --json)")
    r.add_argument("--fresh", action="store_true",
                   help="drop the stored rounds of this run (same run id) and run it again from round 0 "
                   "(after an edit of its method: a finished run of the earlier code is refused until then)")
    r.set_defaults(fn=cmd_run)

    d = with_db(sub.add_parser("demo", help="the main job: Fed-PRISM vs baselines on the default data",
                               description="Compare the FedPrism paper's method, Fed-PRISM (five clustering methods), "
                               "FedClust, FedAvg and Local on Fashion-MNIST if installed, else the bundled digits set; prints a "
                               "table of global and local accuracy. About 3 minutes on 2 cores."))
    d.add_argument("items", nargs="*", default=[], metavar="key=value",
                   help="overrides (seed=1, rounds=20, dataset=digits): applied to every run; a compared "
                   "method's own parameters to its runs only; the keys the demo sets per run are refused")
    d.add_argument("--quick", action="store_true", help="a much smaller run (smoke test)")
    d.add_argument("--workers", type=int, default=None,
                   help="runs at once in separate processes (default: 2, or 1 on a one-core machine)")
    d.set_defaults(fn=cmd_demo)

    s = sub.add_parser("sweep", help="run every run of a sweep file (resumable)",
                       description="Run the grid of a sweep TOML file; finished runs are skipped, "
                       "interrupted ones resume. Results go to --db, else $FEDPRISM_DB, else the "
                       "file's own `db` (ignored with --quick), else fedprism-results.db.")
    s.add_argument("--db", default=None, type=_store_path,   # resolved in cmd_sweep: the file may name its own
                   help="results database (default: $FEDPRISM_DB, else the file's own `db`, else "
                   f"{DEFAULT_DB})")
    s.add_argument("file", help="sweep TOML file (see sweeps/)")
    s.add_argument("items", nargs="*", default=[], metavar="key=value",
                   help="overrides applied to every run, e.g. dataset=cifar10 partition=pathological")
    s.add_argument("--only", default=None,
                   help="only the runs with exactly this label, or else those whose label contains this text")
    s.add_argument("--quick", action="store_true", help="apply the file's [quick] overrides (CI size)")
    s.add_argument("--limit", type=int, default=None, help="stop after this many runs")
    s.add_argument("--seed", type=int, action="append", default=None,
                   help="only runs with this seed (repeatable)")
    s.add_argument("--workers", type=int, default=1,
                   help="runs at once, in separate processes sharing the cores (default 1)")
    s.add_argument("--quiet", action="store_true", help="no progress lines (the summary is still printed)")
    _ray_arguments(s)
    s.add_argument("--fresh", action="store_true",
                   help="run every selected run again (all, or those of --only / --seed / --limit): drop its "
                   "stored rounds, checkpoint and kept final state first (after an edit of a method, its "
                   "finished runs of the earlier code are refused until then)")
    s.set_defaults(fn=cmd_sweep)

    tu = sub.add_parser("tune", help="equal-budget hyper-parameter search on validation splits (resumable)",
                        description="Tune every method of a study file with the same number of trials (Optuna: "
                        "TPE or random, pruning on evaluated rounds), choosing on validation metrics only, then run "
                        "each chosen configuration over the study's seeds. Trials are runs in the store; running "
                        "the same command again, after a kill too, goes on where it stopped (docs/tuning.md).")
    tu.add_argument("--db", default=None, type=_store_path,
                    help=f"results database (default: $FEDPRISM_DB, else the file's own `db`, else {DEFAULT_DB})")
    tu.add_argument("file", help="study TOML file (see sweeps/tune_*.toml)")
    tu.add_argument("items", nargs="*", default=[], metavar="key=value", help="overrides applied to every run")
    tu.add_argument("--only", action="append", default=None, help="only this method label (repeatable)")
    tu.add_argument("--quick", action="store_true", help="apply the file's [quick] settings and budget")
    tu.add_argument("--stage", default="all", choices=("all", "tune", "final"),
                    help="tune: the trials only; final: the chosen configurations over the seeds only; all: both")
    tu.add_argument("--workers", type=int, default=1,
                    help="methods tuned at once, in separate processes sharing the cores (default 1)")
    tu.add_argument("--quiet", action="store_true", help="no line per trial (the summary is still printed)")
    _ray_arguments(tu, "each trial and each final run")
    tu.set_defaults(fn=cmd_tune)

    rp = with_db(sub.add_parser("report", help="comparison tables (markdown, CSV) and plots from the store",
                                description="Tables (markdown and CSV) and plots of the stored runs, one row "
                                "per configuration with seeds pooled, into --out. The store is only read."))
    rp.add_argument("--out", default="report", help="output directory (default: ./report)")
    rp.add_argument("--sweep", action="append", default=None,
                    help="only runs of this sweep (repeatable: several sweeps in one report)")
    rp.add_argument("--no-plots", action="store_true", help="tables only (the markdown links no images)")
    rp.add_argument("--html", action="store_true",
                    help="also write report.html: one self-contained page (plots embedded, no external files)")
    rp.add_argument("--reference", default=None,
                    help="put a published table next to ours, e.g. fedprism-paper-fmnist")
    rp.add_argument("--partition-study", metavar="DATASET", default=None,
                    help="instead of the store: Clust-PSI-PFL's partition figures for DATASET (WPSI and HD/JSD/EMD "
                         "against alpha and S; silhouette curves and the chosen number of clusters against K)")
    rp.add_argument("--seed", type=int, action="append", default=None,
                    help="partition seeds of --partition-study (repeatable; default 0 1 2)")
    rp.add_argument("--leaderboard", action="store_true",
                    help="instead of the tables: leaderboard.md, .csv and .html of the --sweep(s): methods by settings, "
                    "mean and 95%% interval over seeds, rank, a paired test against each column's best, and the "
                    "tuned configuration of each cell (docs/tuning.md); with --html: the tables and the "
                    "leaderboard, which is also a section of report.html")
    rp.add_argument("--metric", default="local_acc", choices=("local_acc", "global_acc", "local_f1"),
                    help="the leaderboard's metric (default local_acc)")
    rp.set_defaults(fn=cmd_report)

    ru = with_db(sub.add_parser("runs", help="list the stored runs (read-only)",
                                description="One line per stored run: id, method, label, seed, status and "
                                "its final accuracies. The store is only read."))
    ru.add_argument("--sweep", default=None, help="only the runs of this sweep (with its row labels)")
    ru.add_argument("--method", default=None, help="only runs of this method")
    ru.add_argument("--status", default=None, choices=("finished", "running", "interrupted", "failed"))
    ru.add_argument("--json", action="store_true",
                    help="one JSON list instead of the table (accuracies in [0, 1]; rounds_done, rounds)")
    ru.set_defaults(fn=cmd_runs)

    sh = with_db(sub.add_parser("show", help="one run: configuration, provenance and per-round metrics",
                                description="One stored run: its configuration, provenance (code, data, "
                                "machine) and per-round metrics (rounds counted from 1). The store is only "
                                "read."))
    sh.add_argument("run", help="run id (or an unambiguous prefix)")
    sh.set_defaults(fn=cmd_show)

    v = with_db(sub.add_parser("verify", help="re-run a stored run's first rounds and compare them",
                               description="Re-runs the first N rounds of a stored run into a temporary "
                               "store (with the recorded thread count) and reports the first metric that "
                               "differs from the stored one (timings excluded), or that all match. The "
                               "store itself is opened read-only."))
    v.add_argument("run", help="run id (or an unambiguous prefix)")
    v.add_argument("items", nargs="*", default=[], metavar="key=value",
                   help="execution-only overrides, e.g. engine=sequential compile=false")
    v.add_argument("--rounds", type=int, default=2, help="how many rounds to re-run (default 2)")
    v.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: the recorded count; 1 for runs stored without one)")
    v.add_argument("--quiet", action="store_true", help="no progress lines")
    v.set_defaults(fn=cmd_verify)

    pa = sub.add_parser("partition", help="split a dataset and print per-client summary + heterogeneity",
                        description="e.g. fedprism partition dataset=fmnist partition=dirichlet "
                        "partition.alpha=0.1 clients=100 seed=0. `fedprism partitions` lists the "
                        "partitions and their partition.* keys.")
    pa.add_argument("items", nargs="*", default=[], metavar="key=value", help=KV_HELP)
    pa.add_argument("--png", default=None, metavar="FILE",
                    help="also draw the first 20 clients' class distributions into FILE "
                         "(nothing is written without it)")
    pa.add_argument("--all", action="store_true", help="list every client")
    pa.set_defaults(fn=cmd_partition)

    def listing(name: str, fn, what: str, help: str, description: str) -> None:
        """A listing command of one registry: `fedprism NAME [NAMES ...]`."""
        ls = sub.add_parser(name, help=help, description=description)
        ls.add_argument("names", nargs="*", default=[], metavar=what.upper(), help=f"only these {what}s")
        ls.set_defaults(fn=fn)

    listing("methods", cmd_methods, "method", "list methods, their parameters and defaults",
            "Every experiment key and every method's parameters with defaults, or only the named methods' "
            "(`fedprism methods fedprism ifca`).")
    listing("models", cmd_models, "model", "list the registered models and what each declares",
            "Every registered model (built in or plugin), or the named ones: the inputs it takes, whether "
            "data.pad32=auto pads 28x28 images for it, its parameter count, its forward multiply-adds (MACs) "
            "per sample and its body/head split.")
    listing("partitions", cmd_partitions, "partition", "list the registered partitions and their partition.* keys",
            "Every registered partition (built in or plugin), or the named ones, with its partition.* keys, "
            "their defaults and meaning (`fedprism partition` splits a dataset and shows the result).")

    mg = with_db(sub.add_parser(
        "merge", help="copy the finished runs of other results stores into --db",
        description="Copy the finished runs of other results stores (another machine's part of a sweep) into "
                    "--db: runs absent here are added, a finished copy replaces an interrupted or failed one, "
                    "runs finished here are kept, unfinished runs there are not copied. The other stores are "
                    "only read. --run and --sweep merge only the runs they name (both together: the union); "
                    "with --sweep a copied run belongs here only to the named sweeps."))
    mg.add_argument("stores", nargs="+", help="results stores to merge from")
    mg.add_argument("--run", action="append", metavar="ID",
                    help="merge only this run (id or unambiguous prefix; repeatable)")
    mg.add_argument("--sweep", action="append", metavar="NAME",
                    help="merge only the runs this sweep holds, as members of it (repeatable)")
    mg.add_argument("--dry-run", action="store_true", help="say what would be merged; write nothing")
    mg.set_defaults(fn=cmd_merge)
    e = with_db(sub.add_parser("export", help="export the store to CSV or Parquet",
                               description="Flat tables of the store (runs, rounds, client metrics; rounds "
                               "counted from 0) into --out, or only the runs --run and --sweep select. "
                               "The store is only read."))
    e.add_argument("--format", choices=("csv", "parquet"), default="csv")
    e.add_argument("--run", action="append", metavar="ID",
                   help="export only this run (id or prefix; repeatable)")
    e.add_argument("--sweep", action="append", metavar="NAME",
                   help="export only the runs this sweep holds, with its memberships (repeatable)")
    e.add_argument("--out", default="export", help="output directory (default: ./export)")
    e.set_defaults(fn=cmd_export)

    so = sub.add_parser("store", help="a results store as text files, one per run (what git holds), and back",
                        description="dump: write --db as a dump into --out (store.json, runs/<run id>.json.gz, "
                        "sweeps/<sweep>.json; only files whose content changed are written; the store is only "
                        "read). load: build --db from a dump, checking that each run id is the hash of its "
                        "configuration; an existing --db is never overwritten. docs/reproducibility.md.")
    sos = so.add_subparsers(dest="store_command", required=True)
    sod = with_db(sos.add_parser("dump", help="write the store as a dump (one file per run)"))
    sod.add_argument("--out", required=True, help="the dump's folder (e.g. results/)")
    sol = with_db(sos.add_parser("load", help="build a store from a dump"))
    sol.add_argument("dump", metavar="DIR", help="the dump's folder (e.g. results/)")
    so.set_defaults(fn=cmd_store)

    da = sub.add_parser("data", help="download or inspect datasets")
    da.add_argument("action", choices=("download", "info"))
    da.add_argument("names", nargs="+", help="dataset names (`fedprism datasets` says which can be downloaded)")
    da.add_argument("--dest", default=None, help="target directory (default: the cache directory)")
    da.set_defaults(fn=cmd_data)
    listing("datasets", cmd_datasets, "dataset", "list the registered datasets and what each declares",
            "Every registered dataset, built-in or plugin (or only the named ones): its classes, input shape, "
            "normalisation, natural partition, options, whether its files are found (no file is read) and "
            "whether they can be downloaded.")

    k = sub.add_parser("kernels", help="build the optional CPU kernels for this machine, or show their state",
                       description="The hand-written CPU kernels (fedprism.kernels; train.kernels / eval.kernels "
                       "= auto uses them where they are built). build: compile every library for this CPU "
                       "(about a minute each on 2 cores) where none is cached, each on its own, trying again where "
                       "a failure is remembered; "
                       "exit status 1 when one fails. status: built, failed (and why) or not built.")
    k.add_argument("action", choices=("build", "status"))
    k.add_argument("libraries", nargs="*", help="which libraries (default: all)")
    k.add_argument("--force", action="store_true", help="build: compile again even where a build is cached")
    k.set_defaults(fn=cmd_kernels)
    return p


def stop_on_sigint() -> None:
    """Make SIGINT raise KeyboardInterrupt even when the process inherited it ignored (a shell starts
    background jobs, `cmd &`, with SIGINT ignored, and Python then installs no handler): SIGINT is how
    `timeout -s INT`, schedulers and `stop_workers` end a run cleanly, however it was launched."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


_PATH_ERRORS = {FileExistsError: "exists and is not a folder",
                NotADirectoryError: "a part of the path is a file, not a folder",
                IsADirectoryError: "is a folder, not a file", FileNotFoundError: "no such file or folder",
                PermissionError: "permission denied"}


def _positional(parser: argparse.ArgumentParser) -> set[str]:
    """The names (`dest`) of every positional argument of the parser and its sub-commands."""
    names: set[str] = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                names |= _positional(sub)
        elif not action.option_strings:
            names.add(action.dest)
    return names


def _path_error(args, e: OSError, positional: set[str]) -> str:
    """An OS error on a path as one line naming the option that gave the path (`--out afile: exists and is
    not a folder`) where one did: the path itself, a folder above it, or a file below it. A path given as a
    positional argument is named by itself."""
    what = _PATH_ERRORS.get(type(e), e.strerror or str(e))
    if not e.filename:
        return str(e)
    hit = Path(os.fsdecode(e.filename))
    for dest, value in vars(args).items():
        if isinstance(value, str) and value and dest not in ("command", "fn"):
            given = Path(value)
            if hit == given or given in hit.parents or hit in given.parents:
                named = value if dest in positional else f"--{dest.replace('_', '-')} {value}"
                return f"{named}: " + (what if hit == given else f"{hit}: {what}")
    return f"{hit}: {what}"


def main(argv: list[str] | None = None) -> int:
    stop_on_sigint()                 # defined here, not in the sweep module: `fedprism runs` imports no torch
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # key=value items after an option (`fedprism verify RUN --rounds 2 engine=sequential`)
    if extra and isinstance(getattr(args, "items", None), list) and all("=" in e and not e.startswith("-")
                                                                      for e in extra):
        args.items += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    import warnings

    plain = warnings.formatwarning            # fedprism's own warnings as one line, like its errors
    warnings.formatwarning = lambda m, c, f, n, line=None: (f"fedprism: warning: {printable(m, newlines=True)}\n"
                                                            if "/fedprism/" in f.replace("\\", "/")
                                                            else plain(m, c, f, n, line))
    try:
        return args.fn(args)
    except FedPrismError as e:                # its text holds user input (labels, paths): no escape sequence
        print(f"fedprism: error: {printable(e, newlines=True)}", file=sys.stderr)
        return 2
    except BrokenPipeError:                 # `fedprism show RUN | head`: the reader left, not an error
        sys.stdout = open(os.devnull, "w")
        return 0
    except KeyboardInterrupt:
        print("\nfedprism: interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    except MemoryError as e:                  # a size inside every key's range, beyond this machine's RAM
        print(f"fedprism: error: out of memory ({str(e).splitlines()[0] if str(e) else 'MemoryError'}); "
              "lower the sizes (clients, the data's size, batch_size) or use a larger machine",
              file=sys.stderr)
        return 2
    except sqlite3.DatabaseError as e:       # the open itself is checked; a page read later may be damaged
        where = getattr(args, "db", None) or "the results store"
        if not any(m in str(e) for m in ("malformed", "not a database", "disk image")):
            raise                                # locked, full, ...: not a damaged file
        print(f"fedprism: error: {where} is damaged ({e}); copy what is readable with "
              f"`sqlite3 {where} .recover | sqlite3 repaired.db`, or use another --db", file=sys.stderr)
        return 2
    except (FileExistsError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError) as e:
        # e.g. a file where --out needs a folder
        print(f"fedprism: error: {_path_error(args, e, _positional(parser))}", file=sys.stderr)
        return 2
    finally:
        warnings.formatwarning = plain


if __name__ == "__main__":
    sys.exit(main())
