"""`fedprism demo`: the main job. A real Fed-PRISM comparison on the embedded default dataset.

Fashion-MNIST (Debian package dataset-fashion-mnist) when present, else scikit-learn's bundled
digits. It runs the FedPrism paper's method (dual-stream, routed; `private_source=specialist`, which
saves one of its three local trainings and is the same update, see `fedprism.algorithms.fedprism_dual`),
every clustering method of the Fed-PRISM server, FedClust, FedAvg and Local on one shared
Dirichlet(0.3) partition and one cohort sequence, two runs at a time in separate processes. The runs and
the sizes per dataset are data, not code: demo.toml beside this module (shipped with the package).

Size (FMNIST): 9000 training images over 30 clients, 12 rounds of 10 clients, E = 2, 2000 test images.
Measured on the 2-core VM with its cores otherwise idle: 1 min 27 s (seed 0) and 1 min 36 s (seed 1),
`fedprism demo seed=S` (with two low-priority sweep workers and a test run beside it, about 3 min). The
ranking the table is read by held in both seeds: FedPrism (routed) has the highest local accuracy
(0.758 / 0.785), Local the second (0.710 / 0.767) and by far the lowest global accuracy (0.265 / 0.266);
FedPrism's global accuracy (0.563 / 0.498) lies between Local's and those of every Fed-PRISM row and
FedAvg (0.582-0.636 / 0.542-0.583), with FedClust's about as low (0.508 / 0.494); the one-model FedAvg
has nearly equal local and global accuracy (0.637 / 0.636, 0.589 / 0.583: one model, two test sets). The
order among the five Fed-PRISM clusterings is not stable at this size (they differ by a few points and
swap between seeds), which the printed guide does not claim.

What `key=value` overrides may change (each checked before anything is loaded or trained):

* `dataset`: fmnist or digits only. An unknown name is refused by the config's own check
  (`fedprism.experiment.config.resolve`: the same message as `fedprism run`); the other known datasets
  are refused too, pointing to `fedprism run` / `fedprism sweep`: the demo's sizes (clients, rounds,
  subsets, batch size, learning rate), its running time and the ranking its guide describes were set and
  measured on these two only, and a colour (cifar10, svhn), 100-class (cifar100), tabular (synthetic) or
  time-series (wisdm) set needs sizes of its own rather than a 28x28-greyscale recipe under the demo's
  name. The header names the dataset the runs are configured with.
* the keys the demo sets per run (`PER_RUN_KEYS`: `method`, `name` and the method parameters of the
  [[runs]] of demo.toml: `fedprism.k`, `fedprism_dual.private_source`, ...) are refused: the demo
  compares fixed methods with fixed settings, so an override there would either be dropped silently or
  turn the comparison into something else; a single method or other settings are `fedprism run` /
  `fedprism sweep`.
* other parameters of a method the demo runs (`fedprism_dual.inference_weight=1`) go to that method's
  runs only; a parameter of a method it does not run (`fedsoft.k`) is refused, naming the methods it runs.
* every other key (`seed`, `rounds`, `partition.alpha`, ...) applies to every run.
"""

from __future__ import annotations

import sys
from functools import lru_cache
from pathlib import Path

from fedprism.experiment.config import flatten, parse_overrides, read_toml, resolve


#: the demo's recipe, a data file shipped with the package: its runs and its sizes per dataset
RECIPE_FILE = Path(__file__).with_name("demo.toml")


@lru_cache(maxsize=1)
def recipe() -> dict:
    """demo.toml, read once: `order` (the datasets, tried in that order), `fallback` (what is said when
    the first is not found), `base` and `quick` (flat keys), `datasets` (name -> flat keys, with its
    flat `quick` keys under "quick"), `runs` (label -> flat keys)."""
    doc = read_toml(RECIPE_FILE, "demo recipe")
    sizes = {}
    for name, table in doc["datasets"].items():
        table = dict(table)
        quick = flatten(table.pop("quick", {}))
        sizes[name] = {"keys": {"dataset": name, **flatten(table)}, "quick": quick}
    return {"order": tuple(doc["order"]), "fallback": doc["fallback"], "base": flatten(doc.get("base", {})),
            "quick": flatten(doc.get("quick", {})), "datasets": sizes,
            "runs": [(r["label"], flatten({k: v for k, v in r.items() if k != "label"})) for r in doc["runs"]]}


def default_dataset() -> str:
    """The first dataset of the recipe's `order` whose files are found, saying so when it falls back to
    the next one."""
    from fedprism.data.datasets import load_dataset
    from fedprism.errors import DataError

    *tried, last = recipe()["order"]
    for name in tried:
        try:
            load_dataset(name, pad32=True)
            return name
        except DataError:
            pass
    print(f"fedprism demo: {recipe()['fallback']}", file=sys.stderr)
    return last


#: the datasets the demo has sizes for (`demo_configs`'s bases)
DATASETS = recipe()["order"]

#: the compared runs: (label, the keys each sets); `method`, `name` and these keys are the demo's own
RUNS: list[tuple[str, dict]] = recipe()["runs"]
PER_RUN_KEYS = frozenset({"method", "name"}.union(*(r for _, r in RUNS)))
METHODS = tuple(dict.fromkeys(r["method"] for _, r in RUNS))


def check_dataset(dataset: object) -> str:
    """`dataset` if the demo runs on it; else a `ConfigError` naming `dataset` (an unknown name gets the
    config's own message, a known one the demo has no sizes for the datasets it supports)."""
    from fedprism.errors import ConfigError

    resolve({"dataset": dataset})              # unknown name or not a string: the message of `fedprism run`
    if dataset not in DATASETS:
        raise ConfigError("dataset", dataset, f"{' or '.join(DATASETS)}: the demo's sizes are set and "
                          f"timed for these only; compare methods on {dataset} with `fedprism run "
                          f"dataset={dataset} method=...` or `fedprism sweep FILE dataset={dataset}`")
    return dataset


def _method_of(key: str) -> str | None:
    """The method a method-scoped key belongs to (`fedprism_dual.inference_weight`: fedprism_dual), or
    None for a key of every run (`rounds`, `partition.alpha`)."""
    from fedprism import plugins
    from fedprism.algorithms import REGISTRY
    from fedprism.experiment.config import KEYS

    plugins.load()                             # a plugin method's keys are method keys too
    owner = key.split(".", 1)[0]
    return owner if "." in key and key not in KEYS and owner in REGISTRY else None


def check_overrides(overrides: dict) -> None:
    """Refuse overrides of the keys the demo sets per run and parameters of methods it does not run."""
    from fedprism.errors import ConfigError

    for k, v in overrides.items():
        if k in PER_RUN_KEYS:
            raise ConfigError(k, v, f"set by the demo for each run: it compares fixed methods "
                              f"({', '.join(METHODS)}) with fixed settings "
                              f"({', '.join(sorted(PER_RUN_KEYS))}); to run one method or change these, "
                              "use `fedprism run` or `fedprism sweep`")
        owner = _method_of(k)
        if owner is not None and owner not in METHODS:
            raise ConfigError(k, v, f"a parameter of a method the demo runs ({', '.join(METHODS)}); "
                              f"run {owner} with `fedprism run method={owner}` or `fedprism sweep`")


def demo_configs(dataset: str, quick: bool = False, overrides: dict | None = None) -> list:
    """The demo's resolved run configs on `dataset` (one of `DATASETS`), with `overrides` applied: a
    method's own parameters to that method's runs only, every other key to every run."""
    from fedprism.errors import ConfigError

    overrides = dict(overrides or {})
    if "dataset" in overrides and overrides["dataset"] != dataset:
        raise ConfigError("dataset", overrides["dataset"], f"{dataset!r} (the dataset argument) or left out")
    overrides.pop("dataset", None)
    check_overrides(overrides)
    check_dataset(dataset)
    rec, sizes = recipe(), recipe()["datasets"][dataset]
    base = {**rec["base"], **sizes["keys"]}
    if quick:
        base.update({**rec["quick"], **sizes["quick"]})
    owner = {k: _method_of(k) for k in overrides}
    base.update({k: v for k, v in overrides.items() if owner[k] is None})
    own = {m: {k: v for k, v in overrides.items() if owner[k] == m} for m in METHODS}
    return [resolve({**base, **own[r["method"]], **r, "name": label}) for label, r in RUNS]


def demo(db: str, quick: bool = False, items: list[str] | None = None, workers: int | None = None) -> int:
    import os

    from fedprism.experiment.runner import Experiment
    from fedprism.experiment.store import Store
    from fedprism.experiment.sweep import run_in_workers, worker_threads
    from fedprism.textable import table as _table

    over = parse_overrides(items or [])
    check_overrides(over)                          # before anything is loaded: the cheap refusals first
    dataset = check_dataset(over.pop("dataset")) if "dataset" in over else default_dataset()
    configs = demo_configs(dataset, quick, over)
    if workers is not None and (not isinstance(workers, int) or workers < 1):
        from fedprism.errors import ConfigError
        raise ConfigError("--workers", workers, "an integer >= 1", kind="option")
    workers = workers or min(2, os.cpu_count() or 1)
    c0 = configs[0]
    print(f"fedprism demo: {c0['dataset']}, {c0['clients']} clients, {c0['partition']}(alpha="
          f"{c0['partition.alpha']}), {c0['rounds']} rounds, R={c0['fraction']}, E={c0['local_epochs']}; "
          f"{len(configs)} runs on {workers} worker(s), {worker_threads(workers)} thread(s) each; results in {db}",
          file=sys.stderr)
    finals: dict[str, dict] = {}
    if workers == 1:
        store = Store(db)
        for cfg in configs:
            finals[cfg["name"]] = Experiment(cfg, store, progress=True, sweep="demo").run().final
        store.close()
    else:                    # the configs come longest first (FedPrism's three trainings per client)
        for name, final in run_in_workers(db, "demo", [(c["name"], c) for c in configs], workers):
            if isinstance(final, Exception):
                raise final
            finals[name] = final
            print(f"  {name}: done ({final.get('seconds', 0):.0f} s)", file=sys.stderr)
    rows = [[c["name"]] + [finals[c["name"]].get(k) for k in ("global_acc", "local_acc", "sdad")]
            + [f"{finals[c['name']].get('seconds', 0):.1f}"] for c in configs]
    print()
    print(_table(rows, ["method", "global acc", "local acc", "SDAD", "seconds"]))
    print("\nHow to read it: local acc = each client's model on its own test split (the same label mix as its "
          "training data), mean over clients: personalization. global acc = each client's model on the full test "
          "set, mean over clients: what a client's model knows beyond its own classes. SDAD = spread of local acc "
          "over clients (lower is fairer). FedAvg trains one model (its two accuracies match); Local never "
          "communicates (high local, low global); the Fed-PRISM rows trade between them through the cluster "
          "models; FedPrism routes each prediction between a private specialist and the shared backbone. "
          "`fedprism report --db " + db + " --out report` writes the tables and plots.")
    return 0
