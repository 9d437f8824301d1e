"""`fedprism tune`: equal-budget hyper-parameter search on validation splits (docs/tuning.md).

A study file names the methods, the search budget every one of them gets and the shared settings:

    name = "tune_fmnist_dir01"
    [tune]
    trials = 12                  # the budget: trials per method, the same for every method
    sampler = "tpe"              # tpe or random (Optuna's samplers, below), or grid (every point in order)
    pruner = "median"            # median (stop a trial below the median of earlier trials) or none
    objective = "val_acc"        # a validation metric: val_acc or global_val_acc
    seeds = [0, 1, 2]            # the final stage: the chosen configuration over these seeds
    [base]                       # keys every run shares (as a sweep's [base])
    "data.val_fraction" = 0.1
    [space]                      # overrides of the declared search spaces, for every method
    lr = { low = 0.003, high = 0.1, scale = "log" }
    [[methods]]
    label = "FedProx"
    method = "fedprox"
    space = { "fedprox.mu" = { low = 0.001, high = 1.0, scale = "log" } }
    [quick]                      # `--quick`: smaller settings, and [quick.tune] a smaller budget

Each method's search space is the experiment keys that declare one (`lr`), the method's own declaration
(`Algorithm.search_space()`: `Param.space`, `algorithms/spaces.py`), the file's `[space]`, then the
method table's `space`; a key set to `false` there is not searched.

Trials are runs. Trial n of a method is the run of the study's base, the method's table and the n-th
suggestion, stored in the sweep `<name>/trials` as `<label> #<n + 1>` (what a person reads numbers trials
from 1: progress, run names, summary, leaderboard; `trial_number`), with a `tune_trial` record (round -1,
`Store.annotate`) holding the study, the label, n (from 0), the parameters, the state (complete or pruned), the
objective's value and its value at every evaluated round. Nothing else is kept: the study is rebuilt
from those records each time a trial is asked for, and the n-th suggestion is drawn by a sampler seeded
by (study seed, label, n) alone. So a study killed at any point (`kill -9` included) and started again
asks the same trials with the same parameters as one that was never stopped: the trial that was
running is asked again, its run id is the same, and it resumes from its last checkpoint.

`sampler = "grid"` asks the points of the spaces' Cartesian product one by one, in order (keys sorted,
each key's values in the order given), so no point repeats and none is skipped; every searched key must be a
list of `choices` or an integer range, and a method's trials stop at `trials` or at its grid's size,
whichever is smaller.

Pruning reports the objective at every evaluated round (`eval_every`) and stops a trial that the pruner
judges hopeless; its run is left `interrupted` with its checkpoint (asked again, it would resume).

Only validation metrics are read while tuning: `validation_metrics` keeps the keys of the validation
splits (`val_acc`, `global_val_acc` and their `@` alternatives) and every value the tuner sees passes
through it; test metrics (`local_acc`, `global_acc`, per-client rows) are never read.

The final stage runs the chosen configuration (the complete trial with the best objective; ties: the
earlier trial) over `seeds`, in the sweep `<name>` under the method's label, each run with a
`tune_choice` record (the chosen trial, its run, its parameters and value, the budget and how many trials
completed or were pruned), which the leaderboard links from its cells (`fedprism.report.leaderboard`).
`defaults = true` also runs every method's untuned configuration over the same seeds, in the sweep
`<name>/defaults`.

The search is Optuna's (Akiba et al. 2019, "Optuna: A Next-generation Hyperparameter Optimization
Framework", arXiv:1907.10902): its tree-structured Parzen estimator (Bergstra, Bardenet, Bengio, Kegl
2011, "Algorithms for Hyper-Parameter Optimization", NeurIPS) or random sampling, and its median pruner.

`run_trial` is the one function that executes a trial: a store path, a resolved configuration, the
objective and a pruning callback in, the trial's outcome out, so another executor can call it.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from fedprism.errors import ConfigError, printable
from fedprism.experiment.callbacks import Callback
from fedprism.experiment.config import KEYS, Config, flatten, read_toml, resolve, suggest
from fedprism.hparams import Space

#: the study file's [tune] keys and their defaults
TUNE_DEFAULTS: dict[str, Any] = {"trials": 12, "sampler": "tpe", "startup": 5, "pruner": "median",
                                 "prune_startup": 4, "prune_warmup": 0, "objective": "val_acc", "seed": 0,
                                 "seeds": [0, 1, 2], "defaults": False}
SAMPLERS = ("tpe", "random", "grid")
PRUNERS = ("median", "none")
#: the validation metrics an objective may be (and their `@` alternatives, `val_acc@backbone`)
OBJECTIVES = ("val_acc", "global_val_acc")
SECTIONS = ("name", "description", "db", "tune", "base", "space", "methods", "quick")
TRIAL_RECORD, CHOICE_RECORD = "tune_trial", "tune_choice"


def validation_metrics(metrics: dict) -> dict:
    """The round metrics of the validation splits only (`val_acc`, `global_val_acc`, `val_acc@<name>`...)
    and the round number: what the tuner may read of a round. Test metrics never pass."""
    return {k: v for k, v in metrics.items()
            if k == "round" or k.split("@", 1)[0] in OBJECTIVES}


@dataclass
class MethodEntry:
    label: str
    raw: dict[str, Any]                    # the [[methods]] table's keys (method included), flat
    space: dict[str, Space]                # key -> where it is searched

    @property
    def method(self) -> str:
        return self.raw["method"]


@dataclass
class Study:
    name: str
    path: Path
    base: dict[str, Any]
    methods: list[MethodEntry]
    trials: int
    sampler: str
    startup: int
    pruner: str
    prune_startup: int
    prune_warmup: int
    objective: str
    seed: int
    seeds: list[int]
    defaults: bool
    quick: dict[str, Any] = field(default_factory=dict)
    overrides: dict[str, Any] = field(default_factory=dict)

    @property
    def trials_sweep(self) -> str:
        return f"{self.name}/trials"

    @property
    def defaults_sweep(self) -> str:
        return f"{self.name}/defaults"

    def entry(self, label: str) -> MethodEntry:
        for m in self.methods:
            if m.label == label:
                return m
        raise ConfigError("--only", label, f"a method label of the study: {', '.join(m.label for m in self.methods)}"
                          f"{suggest(label, [m.label for m in self.methods], quote=True)}", kind="option")

    def source(self, entry: MethodEntry, key: str, params: dict[str, Any] | None = None) -> str:
        """Where the value of `key` in `entry`'s configuration comes from, in the order `config` lays them
        over each other (last wins): a command-line override, the search space, [quick], the method's
        [[methods]] table, [base], or else the key's default."""
        if key in self.overrides:
            return f"the command line override {key}={self.overrides[key]!r}"
        if key in (params or {}):
            return "the search space"
        if key in self.quick:
            return f"{self.path.name}'s [quick]"
        if key in entry.raw:
            return f"{self.path.name}'s [[methods]] table {entry.label!r}"
        if key in self.base:
            return f"{self.path.name}'s [base]"
        return "the default"

    def config(self, entry: MethodEntry, params: dict[str, Any] | None, seed: int | None = None,
               name: str | None = None) -> Config:
        """The resolved configuration of `entry` with `params` (None: its untuned configuration)."""
        raw = {**self.base, **entry.raw, **self.quick, **(params or {})}
        if "partition" in self.overrides:          # as in a sweep: another partition drops the file's parameters
            raw = {k: v for k, v in raw.items() if not k.startswith("partition.")}
        raw.update(self.overrides)
        raw = {k: v for k, v in raw.items() if k in entry.raw or k in (params or {}) or _applies(k, entry.method)}
        if seed is not None:
            raw["seed"] = seed
        raw["name"] = name or entry.label
        try:
            return resolve(raw)
        except ConfigError as e:
            where = self.source(entry, e.key, params)
            hint = ("narrow the method's space in the study file" if where == "the search space" else
                    "change it there" if e.key in self.overrides else "set it in the study file")
            name = "command line" if e.key in self.overrides else self.path.name
            raise ConfigError(f"{name}: {entry.label}: {e.key}", e.value,
                              f"{e.allowed} (set by {where}: {hint})", kind="") from None


def _applies(key: str, method: str) -> bool:
    """Keys of other methods in [base] or [quick] apply only to their runs (as in a sweep)."""
    from fedprism.algorithms import REGISTRY

    head = key.split(".")[0]
    return head not in REGISTRY or head == method


def _space_of(value: Any, where: str) -> Space | None:
    """A study file's space entry: {low, high, scale, integer} or {choices}, or false (not searched)."""
    if value is False:
        return None
    if not isinstance(value, dict) or not value or set(value) - {"low", "high", "scale", "integer", "choices"}:
        raise ConfigError(where, value, "false (not searched), { low = ..., high = ..., scale = \"linear\" | \"log\", "
                          "integer = true | false } or { choices = [...] }", kind="")
    try:
        return Space(**value)
    except (TypeError, ValueError) as e:
        raise ConfigError(where, value, str(e), kind="") from None


def declared_space(method: str) -> dict[str, Space]:
    """The experiment keys that declare a space (`lr`) and the method's own (`Algorithm.search_space`)."""
    from fedprism.algorithms import REGISTRY

    out = {k: p.space for k, p in KEYS.items() if p.space is not None}
    out.update(REGISTRY[method].search_space())
    return out


def _check_key(key: str, method: str, where: str) -> None:
    from fedprism.algorithms import REGISTRY

    params = REGISTRY[method].params
    ok = key in KEYS or (key.startswith(method + ".") and key[len(method) + 1:] in params)
    if not ok:
        near = suggest(key, [*KEYS, *(f"{method}.{k}" for k in params)], quote=True)
        raise ConfigError(where, key, f"an experiment key or a key of {method}{near}", kind="")


def load_study(path: str | Path, quick: bool = False, overrides: dict[str, Any] | None = None) -> Study:
    """The study file at `path`, checked: every key, every space and every method's configuration at
    its untuned values and at the ends of its ranges resolve (`ConfigError` naming the file, the table
    and the key otherwise)."""
    from fedprism import plugins
    from fedprism.algorithms import REGISTRY

    plugins.load()
    p = Path(path)
    doc = read_toml(p, "study file")
    unknown = sorted(set(doc) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"{p.name}: {unknown[0]}", doc[unknown[0]], f"a study file holds {', '.join(SECTIONS)}"
                          f"{suggest(unknown[0], list(SECTIONS), quote=True)}", kind="")
    name = doc.get("name", p.stem)
    if not isinstance(name, str) or not name.strip() or "/" in name:
        raise ConfigError(f"{p.name}: name", name, "a non-empty string without '/' (the study's sweeps are "
                          "<name>, <name>/trials and <name>/defaults)", kind="")
    for sec in ("tune", "base", "space", "quick"):
        if not isinstance(doc.get(sec, {}), dict):
            raise ConfigError(f"{p.name}: {sec}", doc[sec], f"a table ([{sec}])", kind="")
    quick_doc = dict(doc.get("quick", {})) if quick else {}
    if quick and not doc.get("quick"):
        raise ConfigError("--quick", True, f"{p.name} has no [quick] section of smaller settings, so --quick "
                          "would run the full study; add one or leave --quick out", kind="option")
    tune = {**TUNE_DEFAULTS, **_tune_table(doc.get("tune", {}), p.name, "[tune]"),
            **_tune_table(quick_doc.pop("tune", {}), p.name, "[quick.tune]")}
    base = flatten(doc.get("base", {}))
    if "method" in base:
        raise ConfigError(f"{p.name}: [base] method", base["method"], "no method in [base]: each [[methods]] table "
                          "names its own", kind="")
    methods_doc = doc.get("methods")
    if not isinstance(methods_doc, list) or not methods_doc or not all(isinstance(m, dict) for m in methods_doc):
        raise ConfigError(f"{p.name}: methods", methods_doc, "one or more [[methods]] tables, each with a label "
                          "and a method", kind="")
    shared_space = doc.get("space", {})
    entries: list[MethodEntry] = []
    for i, table in enumerate(methods_doc):
        where = f"{p.name}: [[methods]] #{i + 1}"
        table = dict(table)
        label = table.pop("label", None)
        own_space = table.pop("space", {})
        if not isinstance(label, str) or not label.strip() or "#" in label:
            raise ConfigError(f"{where} label", label, "a non-empty string without '#' (the method's row; its "
                              "trials are '<label> #n')", kind="")
        if label in {e.label for e in entries}:
            raise ConfigError(f"{where} label", label, "a label no other [[methods]] table has", kind="")
        raw = flatten(table)
        method = raw.get("method")
        if method not in REGISTRY:
            raise ConfigError(f"{where} method", method, "a registered method (`fedprism methods` lists them)"
                              f"{suggest(str(method), REGISTRY.names(), quote=True)}", kind="")
        if not isinstance(own_space, dict):
            raise ConfigError(f"{where} space", own_space, "a table of key = space", kind="")
        space = declared_space(method)
        for src, table_name in ((shared_space, "[space]"), (own_space, f"[[methods]] #{i + 1} space")):
            for key, value in _flat_space(src).items():
                if src is shared_space and not _applies(key, method):
                    continue
                _check_key(key, method, f"{p.name}: {table_name} {key}")
                sp = _space_of(value, f"{p.name}: {table_name} {key}")
                if sp is None:
                    space.pop(key, None)
                else:
                    space[key] = sp
        entries.append(MethodEntry(label.strip(), raw, dict(sorted(space.items()))))
    study = Study(name.strip(), p, base, entries, tune["trials"], tune["sampler"], tune["startup"], tune["pruner"],
                  tune["prune_startup"], tune["prune_warmup"], tune["objective"], tune["seed"], list(tune["seeds"]),
                  tune["defaults"], flatten(quick_doc), dict(overrides or {}))
    if study.sampler == "grid":
        for e in study.methods:
            for key, sp in e.space.items():
                if grid_values(sp) is None:
                    raise ConfigError(f"{p.name}: [tune] sampler", "grid",
                                      f"lists of choices only: {printable(e.label)}'s {key} is the range "
                                      f"{sp.describe()} (give it {{ choices = [...] }} in [space] or the method's "
                                      "space, or choose sampler tpe or random)", kind="")
    for e in study.methods:                       # every method's configuration resolves at its corners
        _check_objective(study, e, study.config(e, None))
        for corner in _corners(e.space):
            study.config(e, corner)
    return study


SPACE_FIELDS = {"low", "high", "scale", "integer", "choices"}


def _flat_space(doc: dict, prefix: str = "") -> dict[str, Any]:
    """A space table's entries by their flat keys: `[space.fedprox] mu = {...}` and `"fedprox.mu" = {...}`
    are both `fedprox.mu`; a table of space fields (low, high, ...) is an entry, not a level."""
    out: dict[str, Any] = {}
    for k, v in doc.items():
        if isinstance(v, dict) and v and not set(v) & SPACE_FIELDS:
            out.update(_flat_space(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _tune_table(t: Any, file: str, where: str) -> dict[str, Any]:
    if not isinstance(t, dict):
        raise ConfigError(f"{file}: {where}", t, "a table", kind="")
    out = {}
    for k, v in t.items():
        w = f"{file}: {where} {k}"
        if k not in TUNE_DEFAULTS:
            raise ConfigError(w, v, f"one of the keys {', '.join(TUNE_DEFAULTS)}"
                              f"{suggest(k, list(TUNE_DEFAULTS), quote=True)}", kind="")
        if k in ("trials", "startup", "prune_startup", "prune_warmup", "seed"):
            lo = 1 if k == "trials" else 0
            if isinstance(v, bool) or not isinstance(v, int) or v < lo or v >= 2 ** 31:
                raise ConfigError(w, v, f"an integer >= {lo}", kind="")
        elif k == "sampler" and v not in SAMPLERS:
            raise ConfigError(w, v, f"one of {', '.join(SAMPLERS)}", kind="")
        elif k == "pruner" and v not in PRUNERS:
            raise ConfigError(w, v, f"one of {', '.join(PRUNERS)}", kind="")
        elif k == "objective" and (not isinstance(v, str) or v.split("@", 1)[0] not in OBJECTIVES):
            raise ConfigError(w, v, "a validation metric: val_acc or global_val_acc (or one of their alternative "
                              "predictions, val_acc@<name>); test metrics are never an objective", kind="")
        elif k == "seeds" and (not isinstance(v, list) or not v or len(set(v)) != len(v)
                               or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 2 ** 31
                                          for s in v)):
            raise ConfigError(w, v, "a non-empty list of distinct integers >= 0", kind="")
        elif k == "defaults" and not isinstance(v, bool):
            raise ConfigError(w, v, "true or false", kind="")
        out[k] = v
    return out


def _check_objective(study: Study, entry: MethodEntry, cfg: Config) -> None:
    """The objective is a validation metric: the configuration must make validation splits. The error
    names where the offending value came from (`Study.source`): a command-line override, not the file's
    [base], when the override set it."""
    need = "data.global_val" if study.objective.startswith("global_val") else "data.val_fraction"
    if not cfg[need]:
        where = study.source(entry, need)
        name = f"command line: {need}" if need in study.overrides else f"{study.path.name}: {need}"
        fix = f"set it > 0 in {study.path.name}'s [base]" if where == "the default" else "change it there"
        raise ConfigError(name, cfg[need], f"> 0 (set by {where}: {fix}): the objective "
                          f"{study.objective} is scored on the validation splits, which {need} makes", kind="")


def _corners(space: dict[str, Space]) -> list[dict[str, Any]]:
    """The lowest and the highest value of every key at once, and each choice of each categorical key."""
    if not space:
        return []
    lo = {k: (s.choices[0] if s.choices else (int(s.low) if s.integer else s.low)) for k, s in space.items()}
    hi = {k: (s.choices[-1] if s.choices else (int(s.high) if s.integer else s.high)) for k, s in space.items()}
    out = [lo, hi]
    for k, s in space.items():
        for c in s.choices or ():
            out.append({**lo, k: c})
    return out


# -- one trial ----------------------------------------------------------------------------------------------
class TrialPruned(Exception):
    """Raised from the round loop when the pruner stops a trial (the run is left `interrupted`)."""


class Pruning(Callback):
    """Reports the objective at every evaluated round (`report(round, value) -> stop?`); raises
    `TrialPruned` once the round is stored and checkpointed (it is the last callback). A resumed run
    reports its stored rounds first, without stopping on them (they were reported before)."""

    def __init__(self, objective: str, report: Callable[[int, float], bool] | None):
        self.objective, self.report = objective, report

    def on_run_start(self, exp, loop) -> None:
        if self.report is None:
            return
        for m in exp.store.round_metrics(exp.run_id) if loop.start else []:
            v = validation_metrics(m).get(self.objective)
            if m["round"] < loop.start and _number(v):
                self.report(m["round"], float(v))

    def on_round_stored(self, exp, rnd) -> None:
        if self.report is None or not rnd.evaluated:
            return
        v = validation_metrics(rnd.metrics).get(self.objective)
        if _number(v) and self.report(rnd.index, float(v)) and rnd.index < exp.cfg["rounds"] - 1:
            raise TrialPruned(f"pruned at round {rnd.index + 1}")


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass
class TrialOutcome:
    run_id: str
    state: str                          # complete or pruned
    value: float | None                 # the objective at the last evaluated round the run stored
    intermediate: dict[int, float]      # round (0-based) -> the objective there
    rounds: int                         # rounds the run has stored


def run_trial(db: str | Path, cfg: Config, objective: str, report: Callable[[int, float], bool] | None = None,
              sweep: str | None = None, label: str | None = None) -> TrialOutcome:
    """Run (or resume, or take as stored) the run of `cfg` in the store `db`, reporting `objective` at each
    evaluated round to `report` (True: prune). Reads back only validation metrics. A finished run in the
    store is taken as it is (a complete trial)."""
    from fedprism.experiment.runner import Experiment
    from fedprism.experiment.store import Store

    class TrialExperiment(Experiment):
        def callbacks(self):
            return [*super().callbacks(), Pruning(objective, report)]

    store = Store(db)
    try:
        state = "complete"
        exp = TrialExperiment(cfg, store, sweep=sweep)
        try:
            exp.run()
        except TrialPruned:
            store.mark(exp.run_id, "interrupted")         # unfinished, resumable (it was marked failed)
            state = "pruned"
        if sweep is not None and label is not None:
            store.add_to_sweep(sweep, exp.run_id, label)
        values = {m["round"]: float(m[objective]) for m in map(validation_metrics, store.round_metrics(exp.run_id))
                  if _number(m.get(objective))}
        if not values:
            raise ConfigError("objective", objective, f"a metric the run stores; run {exp.run_id} stored none "
                              f"(its validation metrics: {', '.join(sorted(validation_metrics(store.round_metrics(exp.run_id)[-1]))) or 'none'})",
                              kind="")
        last = max(values)
        return TrialOutcome(exp.run_id, state, values[last], values, store.run(exp.run_id)["rounds_done"])
    finally:
        store.close()


# -- the study ----------------------------------------------------------------------------------------------
def _slot(study: str, label: str, n: int) -> int:
    """The record slot of trial n of `label` in `study`: a negative 48-bit number from their hash."""
    h = hashlib.blake2b(f"{study}\0{label}\0{n}".encode(), digest_size=6).digest()
    return -1 - int.from_bytes(h, "big")


def _trial_seed(study: Study, label: str, n: int) -> int:
    h = hashlib.blake2b(f"{study.seed}\0{study.name}\0{label}\0{n}".encode(), digest_size=4).digest()
    return int.from_bytes(h, "big")


def stored_trials(store, study: str, label: str) -> list[dict]:
    """The trials of `label` in `study` that the store holds, by trial number (each the record's data with
    `run_id`)."""
    out = {}
    for run_id, data in store.annotations(TRIAL_RECORD):
        if isinstance(data, dict) and data.get("study") == study and data.get("label") == label:
            out[data["trial"]] = {**data, "run_id": run_id}
    return [out[n] for n in sorted(out)]


def distributions(space: dict[str, Space]) -> dict[str, Any]:
    import optuna

    out = {}
    for k, s in space.items():
        if s.choices is not None:
            out[k] = optuna.distributions.CategoricalDistribution(list(s.choices))
        elif s.integer:
            out[k] = optuna.distributions.IntDistribution(int(s.low), int(s.high), log=s.scale == "log")
        else:
            out[k] = optuna.distributions.FloatDistribution(float(s.low), float(s.high), log=s.scale == "log")
    return out


#: most values an integer range may give a grid
GRID_MAX_RANGE = 100


def grid_values(sp: Space) -> list | None:
    """The values `sampler = "grid"` takes for one key: its choices in order, or every whole number of a small
    integer range; None for a continuous range (no grid)."""
    if sp.choices is not None:
        return list(sp.choices)
    if sp.integer and sp.high - sp.low < GRID_MAX_RANGE:
        return list(range(int(sp.low), int(sp.high) + 1))
    return None


def grid_points(space: dict[str, Space]) -> list[dict]:
    """The grid of `space` (keys sorted), in order: the first key varies slowest."""
    keys = sorted(space)
    return [dict(zip(keys, values)) for values in itertools.product(*(grid_values(space[k]) for k in keys))]


def _sampler(study: Study, seed: int):
    import optuna

    if study.sampler in ("random", "grid"):      # grid: the trial's point is enqueued (`_ask`)
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=study.startup)


def _pruner(study: Study):
    import optuna

    if study.pruner == "none":
        return optuna.pruners.NopPruner()
    return optuna.pruners.MedianPruner(n_startup_trials=study.prune_startup, n_warmup_steps=study.prune_warmup)


def rebuild(study: Study, entry: MethodEntry, trials: list[dict]):
    """An in-memory Optuna study holding `trials` (from `stored_trials`) as finished trials, in order; trials
    of parameters outside today's space (a narrowed file) are kept as they were stored."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    dists = distributions(entry.space)
    ostudy = optuna.create_study(direction="maximize", pruner=_pruner(study),
                                 sampler=optuna.samplers.RandomSampler(seed=0))
    for t in trials:
        params = {k: v for k, v in t["params"].items() if k in dists and _within(dists[k], v)}
        if set(params) != set(dists):
            continue                              # asked from another space: not part of this search
        state = optuna.trial.TrialState.COMPLETE if t["state"] == "complete" else optuna.trial.TrialState.PRUNED
        ostudy.add_trial(optuna.trial.create_trial(
            params=params, distributions={k: dists[k] for k in params}, state=state,
            value=t["value"] if state == optuna.trial.TrialState.COMPLETE else None,
            intermediate_values={int(r): v for r, v in t["intermediate"].items()}))
    return ostudy


def _within(dist, v) -> bool:
    try:
        return dist._contains(dist.to_internal_repr(v))
    except (ValueError, TypeError):
        return False


def _ask(db: str | Path, study: Study, entry: MethodEntry) -> tuple[int, dict, list[dict], Any] | None:
    """The next trial of `entry` (n, its parameters, the stored trials it was asked from, Optuna's trial), or
    None when the budget is spent. A function of the stored trials alone (see the module docstring)."""
    from fedprism.experiment.store import Store

    with Store(db) as store:
        trials = stored_trials(store, study.name, entry.label)
    if len(trials) >= study.trials:
        return None
    n = max((t["trial"] for t in trials), default=-1) + 1
    ostudy = rebuild(study, entry, trials)
    if study.sampler == "grid":
        points = grid_points(entry.space)
        if n >= len(points):
            return None                           # every point asked: the grid is the budget
        ostudy.enqueue_trial(points[n])           # trial n is the grid's n-th point
    ostudy.sampler = _sampler(study, _trial_seed(study, entry.label, n))
    trial = ostudy.ask(distributions(entry.space))
    return n, dict(trial.params), trials, trial


def trial_number(n: int) -> int:
    """The number a person reads for the record's trial `n`: trials count from 1 wherever they are printed
    or named (the progress line `trial 1/3`, the run name `<label> #1`, the summary's `chose #1`, the
    leaderboard's `trial #1`); the `trial` field of the stored records, and the sampler's seed, count from 0."""
    return n + 1


def trial_name(label: str, n: int) -> str:
    """The name of trial `n` (0-based, as stored) of the method `label`: `<label> #<n + 1>`."""
    return f"{label} #{trial_number(n)}"


def _record(db: str | Path, study: Study, entry: MethodEntry, n: int, params: dict, out: TrialOutcome,
            t0: float, progress: bool) -> None:
    """Store trial n's `tune_trial` record (what the next trial is asked from) and print its line."""
    from fedprism.experiment.store import Store

    data = {"study": study.name, "label": entry.label, "method": entry.method, "trial": n, "params": params,
            "state": out.state, "value": out.value, "intermediate": {str(k): v for k, v in out.intermediate.items()},
            "objective": study.objective, "budget": study.trials, "sampler": study.sampler,
            "rounds": out.rounds, "space": {k: s.describe() for k, s in entry.space.items()}}
    with Store(db) as store:
        store.annotate(out.run_id, TRIAL_RECORD, data, _slot(study.name, entry.label, n))
    if progress:
        print(f"[{printable(study.name)}] {printable(entry.label)} trial {trial_number(n)}/{study.trials}: {out.state}, "
              f"{study.objective} {out.value:.4f} at round {max(out.intermediate) + 1} ({_fmt_params(params)}; "
              f"{time.time() - t0:.0f}s)", file=sys.stderr)


def _busy(study: Study, label: str, n: int, e: Exception):
    from fedprism.experiment.runlock import RunBusyError

    return RunBusyError(f"{study.name}: {label} trial #{trial_number(n)}: {e}; one `fedprism tune` process per study "
                        "(or per method, with --only): the trials of a method are asked one after another")


def tune_method(db: str | Path, study: Study, label: str, progress: bool = True) -> list[dict]:
    """Run the missing trials of one method until the budget is spent; returns every trial (stored)."""
    from fedprism.experiment.runlock import RunBusyError
    from fedprism.experiment.store import Store

    entry = study.entry(label)
    while True:
        asked = _ask(db, study, entry)
        if asked is None:
            with Store(db) as store:
                return stored_trials(store, study.name, label)
        n, params, _, trial = asked
        cfg = study.config(entry, params, name=trial_name(label, n))
        t0 = time.time()

        def report(rnd: int, value: float) -> bool:
            trial.report(value, rnd)
            return trial.should_prune()

        try:
            out = run_trial(db, cfg, study.objective, report, sweep=study.trials_sweep, label=trial_name(label, n))
        except RunBusyError as e:           # a second `fedprism tune` of this study asked the same trial
            raise _busy(study, label, n, e) from None
        _record(db, study, entry, n, params, out, t0, progress)


# -- trials as tasks of an executor (`fedprism tune --ray`) ----------------------------------------------
@dataclass
class TrialTask:
    """What a trial's task needs besides its run: the objective, and the pruner's state, shipped with it. The
    pruner's state is the pruner's settings and the trials of the method stored before this one (their
    states and values at each evaluated round): exactly the study a local trial is asked and pruned from. The
    task rebuilds that study where it runs (`rebuild`) and prunes there, so a remote trial is pruned at the
    round a local one would be, with no round trip to the driver, and its outcome comes back with its run."""

    objective: str
    pruner: str
    prune_startup: int
    prune_warmup: int
    space: dict[str, Space]
    history: list[dict]


def _task_pruning(task: TrialTask) -> Callable[[int, float], bool]:
    """`report(round, value) -> prune?` from a shipped pruner state: a trial of the rebuilt study. Its
    parameters are not the trial's (the median pruner reads the values at each round only, never the
    parameters), so any asked trial of that study judges the same."""
    ostudy = rebuild(task, task, task.history)            # type: ignore[arg-type]  (duck-typed: see rebuild)
    trial = ostudy.ask(distributions(task.space))

    def report(rnd: int, value: float) -> bool:
        trial.report(value, rnd)
        return bool(trial.should_prune())

    return report


def run_trial_task(db: str, cfg: Config, sweep: str | None, task: TrialTask) -> dict:
    """A trial as an executor's task (`executor.run_job` with `Job.trial`): `run_trial` in the store at `db`
    (the shared store, or the task's part store), pruned by the shipped state; ``{"run_id", "final",
    "resumed", "trial"}`` with the outcome's fields."""
    out = run_trial(db, cfg, task.objective, _task_pruning(task), sweep=sweep, label=cfg["name"])
    return {"run_id": out.run_id, "final": {}, "resumed": None,
            "trial": {"run_id": out.run_id, "state": out.state, "value": out.value,
                      "intermediate": dict(out.intermediate), "rounds": out.rounds}}


def tune_on(executor, db: str | Path, study: Study, labels: list[str], store_mode: str = "shared",
            scratch: str | None = None, threads: int = 1, progress: bool = True) -> None:
    """The trials of `labels` as tasks of `executor` (`fedprism tune --ray`): one trial of each method out at
    a time (trial n is asked from the trials before it, as locally), so the methods' trials run at once. A
    trial's record is stored by this driver as its task reports back (with shipped results after its run is
    merged); the same trials, with the same parameters, prunings and run ids, as `tune_method`'s."""
    from fedprism.errors import FedPrismError
    from fedprism.experiment.executor import Job, merge_part

    db = str(Path(db).resolve())
    out: dict[Any, tuple[MethodEntry, int, dict, Config, float]] = {}

    def submit(entry: MethodEntry) -> None:
        asked = _ask(db, study, entry)
        if asked is None:
            return
        n, params, history, _ = asked
        cfg = study.config(entry, params, name=trial_name(entry.label, n))
        task = TrialTask(study.objective, study.pruner, study.prune_startup, study.prune_warmup, entry.space,
                         history)
        job = Job(cfg, db, study.trials_sweep, store_mode, scratch, threads, trial_name(entry.label, n), trial=task)
        out[executor.submit(job)] = (entry, n, params, cfg, time.time())

    try:
        for label in labels:
            submit(study.entry(label))
        while out:
            for handle in executor.wait(list(out)):
                entry, n, params, cfg, t0 = out.pop(handle)
                res = executor.result(handle)
                if "busy" in res:
                    raise _busy(study, entry.label, n, res["busy"])
                if res.get("run_id") != cfg.run_id:
                    raise FedPrismError(f"{trial_name(entry.label, n)}: the task returned run {res.get('run_id')!r} for run "
                                        f"{cfg.run_id}")
                if "part" in res:
                    merge_part(db, res["part"], cfg, study.trials_sweep)
                _record(db, study, entry, n, params, TrialOutcome(**res["trial"]), t0, progress)
                submit(entry)
    except BaseException:
        if out:
            executor.cancel(list(out))
        raise


def _fmt_params(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={_fmt(v)}" for k, v in params.items())


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def choose(trials: list[dict]) -> dict | None:
    """The complete trial with the best objective (the earlier on a tie); None when none completed."""
    done = [t for t in trials if t["state"] == "complete" and _number(t.get("value"))]
    return max(done, key=lambda t: (t["value"], -t["trial"])) if done else None


def final_plan(db: str | Path, study: Study, label: str) -> list[tuple[str, Config, dict]]:
    """The final stage's runs of `label`: (sweep, configuration, its `tune_choice` record) for the chosen
    configuration over the study's seeds, then (with `defaults`) the untuned one over the same seeds."""
    from fedprism.experiment.store import Store

    entry = study.entry(label)
    with Store(db) as store:
        trials = stored_trials(store, study.name, label)
    best = choose(trials)
    if best is None:
        raise ConfigError(f"{study.name}: {label}", len(trials), "a study with a complete trial to choose from "
                          "(every trial was pruned or none ran: run `fedprism tune` to the end first)", kind="")
    choice = {"study": study.name, "label": label, "method": entry.method, "trial": best["trial"],
              "trial_run": best["run_id"], "params": best["params"], "value": best["value"],
              "objective": study.objective, "budget": study.trials, "sampler": study.sampler, "pruner": study.pruner,
              "complete": sum(t["state"] == "complete" for t in trials),
              "pruned": sum(t["state"] == "pruned" for t in trials),
              "rounds_trained": sum(t.get("rounds", 0) for t in trials), "trials_sweep": study.trials_sweep,
              "space": {k: s.describe() for k, s in entry.space.items()}}
    untuned = study.config(entry, None)
    default = {**choice, "default": True, "trial": None, "trial_run": None, "value": None,
               "params": {k: untuned[k] for k in entry.space}}
    runs = [(study.name, best["params"], choice)] + ([(study.defaults_sweep, None, default)] if study.defaults else [])
    return [(sweep, study.config(entry, params, seed=seed), note) for sweep, params, note in runs
            for seed in study.seeds]


def _final_line(sweep: str, cfg: Config, final: dict, reused: bool, t0: float) -> str:
    return (f"[{printable(sweep)}] {printable(cfg['name'])} seed={cfg['seed']}: local "
            f"{final.get('local_acc', float('nan')):.4f} global {final.get('global_acc', float('nan')):.4f}"
            f"{' (stored)' if reused else ''} ({time.time() - t0:.0f}s)")


def final_stage(db: str | Path, study: Study, label: str, progress: bool = True) -> list[str]:
    """The chosen configuration of `label` over the study's seeds (and, with `defaults`, its untuned one);
    returns the run ids of the chosen configuration's runs."""
    from fedprism.experiment.runner import Experiment
    from fedprism.experiment.store import Store
    from fedprism.experiment.sweep import supersede

    ids = []
    for sweep, cfg, note in final_plan(db, study, label):
        with Store(db) as store:
            t0 = time.time()
            res = Experiment(cfg, store, sweep=sweep).run()
            supersede(store, sweep, cfg)
            store.annotate(cfg.run_id, CHOICE_RECORD, note, _slot(sweep, label, -1))
        if sweep == study.name:
            ids.append(cfg.run_id)
        if progress:
            print(_final_line(sweep, cfg, res.final, res.reused, t0), file=sys.stderr)
    return ids


def final_on(executor, db: str | Path, study: Study, labels: list[str], store_mode: str = "shared",
             scratch: str | None = None, threads: int = 1, progress: bool = True) -> None:
    """The final stage of `labels` as tasks of `executor` (`fedprism tune --ray`): every seed run of every
    method at once (`executor.execute`, one sweep at a time: the study's, then its defaults'); each run's
    `tune_choice` record is stored as its task reports it finished."""
    from fedprism.experiment.executor import execute
    from fedprism.experiment.runlock import RunBusyError
    from fedprism.experiment.store import Store

    plan = [p for label in labels for p in final_plan(db, study, label)]
    for sweep in dict.fromkeys(p[0] for p in plan):
        todo = {f"{cfg['name']} seed={cfg['seed']} ({cfg.run_id})": (cfg, note) for s, cfg, note in plan if s == sweep}
        t0 = time.time()
        for tag, final in execute([(t, c) for t, (c, _) in todo.items()], str(db), executor, sweep, store_mode,
                                  scratch, threads):
            if isinstance(final, RunBusyError):
                raise RunBusyError(f"{study.name}: {tag}: {final}") from None
            cfg, note = todo[tag]
            with Store(db) as store:
                store.annotate(cfg.run_id, CHOICE_RECORD, note, _slot(sweep, cfg["name"], -1))
            if progress:
                print(_final_line(sweep, cfg, final, False, t0), file=sys.stderr)


def _method_job(db: str, path: str, quick: bool, overrides: dict, label: str, stage: str,
                progress: bool = True) -> list[dict]:
    study = load_study(path, quick, overrides)
    trials = tune_method(db, study, label, progress) if stage in ("all", "tune") else []
    if stage in ("all", "final"):
        final_stage(db, study, label, progress)
    return trials


def run_study(path: str | Path, db: str | Path, quick: bool = False, overrides: dict[str, Any] | None = None,
              only: list[str] | None = None, stage: str = "all", workers: int = 1, progress: bool = True,
              ray: Any = None, executor: Any = None) -> Study:
    """`fedprism tune FILE`: every method's trials (resumable), then the final stage. `workers` > 1 tunes
    that many methods at once in separate processes (one method's trials are sequential: each is asked from
    the ones before it). `ray` (an `executor.RayOptions`, `--ray ADDRESS`) sends every trial and every final
    run to a Ray cluster as a task instead (`tune_on`, `final_on`; docs/ray.md); `executor` replaces the
    cluster's backend (`executor.InlineExecutor`: the same tasks in this process)."""
    from fedprism.experiment.store import Store
    from fedprism.experiment.sweep import check_runs

    if stage not in ("all", "tune", "final"):
        raise ConfigError("--stage", stage, "all, tune or final", kind="option")
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError("--workers", workers, "an integer >= 1", kind="option")
    remote = ray is not None or executor is not None
    if remote and workers != 1:
        raise ConfigError("--workers", workers, "1 with --ray (each trial is a task of the cluster, and the "
                          "methods' trials run at once there)", kind="option")
    study = load_study(path, quick, overrides)
    store_mode = getattr(ray, "store", "shared")
    if remote and store_mode == "ship" and study.pruner != "none" and stage != "final":
        raise ConfigError("--ray-store", store_mode, f"shared for a study that prunes ({study.path.name}: pruner = "
                          f"{study.pruner!r}): a pruned trial's run is unfinished, and shipped results bring "
                          "finished runs only; or set pruner = \"none\" in [tune]", kind="option")
    labels = [study.entry(o).label for o in only] if only else [m.label for m in study.methods]
    # each method's untuned configuration and the corners of its space pass the checks a run makes before it
    # trains (clusters against the cohort, memory): a trial the limits would refuse stops the study now
    check_runs([(f"{study.name}: {e.label}" + (f" at {_fmt_params(c)}" if c else ""), study.config(e, c or None))
                for e in study.methods if e.label in labels for c in [{}, *_corners(e.space)]], db)
    print(f"study {printable(study.name)}: {len(labels)} method(s), {study.trials} trials each ({study.sampler}, "
          f"pruner {study.pruner}, objective {study.objective}), then seeds {study.seeds}; results: {db}",
          file=sys.stderr)
    if remote:
        if executor is None:
            executor = ray.executor()
            print(f"study {printable(study.name)}: trials and final runs on the Ray cluster at "
                  f"{printable(ray.address)}, {ray.cpus:g} CPU(s) and {ray.gpus:g} GPU(s) each, results {ray.store}",
                  file=sys.stderr)
        kw = dict(store_mode=store_mode, scratch=getattr(ray, "scratch", None),
                  threads=max(1, int(getattr(ray, "cpus", 1))), progress=progress)
        if stage in ("all", "tune"):
            tune_on(executor, db, study, labels, **kw)
        if stage in ("all", "final"):
            final_on(executor, db, study, labels, **kw)
    elif workers == 1 or len(labels) == 1:
        for label in labels:
            _method_job(str(db), str(path), quick, overrides or {}, label, stage, progress)
    else:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        from fedprism.experiment.sweep import _sweep_worker_init, worker_threads

        ctx = mp.get_context("spawn")
        with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_sweep_worker_init,
                                 initargs=(worker_threads(workers),)) as pool:
            futs = [pool.submit(_method_job, str(db), str(path), quick, overrides or {}, label, stage, progress)
                    for label in labels]
            for f in futs:
                f.result()
    with Store(db, readonly=True) as store:
        for line in summary(store, study, labels):
            print(line, file=sys.stderr)
    return study


def summary(store, study: Study, labels: list[str] | None = None) -> list[str]:
    """One line per method: trials done (complete / pruned), the chosen trial, its value and parameters."""
    out = []
    for e in study.methods:
        if labels is not None and e.label not in labels:
            continue
        trials = stored_trials(store, study.name, e.label)
        best = choose(trials)
        done = f"{len(trials)}/{study.trials} trials ({sum(t['state'] == 'pruned' for t in trials)} pruned)"
        chosen = (f"chose #{trial_number(best['trial'])} {study.objective} {best['value']:.4f} "
                  + json.dumps(best["params"], sort_keys=True)) if best else "nothing chosen yet"
        out.append(f"  {printable(e.label)}: {done}; {chosen}")
    return out


def study_db(path: str | Path) -> str | None:
    """The results store a study file names (`db = ...`, relative to the file's folder), if any."""
    from fedprism.experiment.sweep import sweep_db

    return sweep_db(path)
