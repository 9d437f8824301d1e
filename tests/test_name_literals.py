"""A method, dataset, model or partition is named as a string only where it lives: its own module (or
package), the registry package of its kind, and the tests. Anywhere else a name literal is knowledge of
one component kept outside it (a dispatch on a name, a table that goes stale).

The names come from the registries (`Registry._builtins`: every built-in component and its module).
Every module under src/fedprism is walked with `ast`; docstrings are prose and do not count. A literal that
is the same word with another meaning is listed in `OTHER_MEANING` with its module and why; literals of
work under way elsewhere are listed in `PENDING` by area (each must still be there: the test fails once
one is removed, so the list cannot go stale).
"""

from __future__ import annotations

import ast
from pathlib import Path

from fedprism.algorithms.base import REGISTRY
from fedprism.data.base import DATASETS
from fedprism.data.partitions.base import PARTITIONS
from fedprism.models.base import MODELS

SRC = Path(__file__).resolve().parents[1] / "src"

#: each kind's registry and the package that holds it (its listings may name every component)
REGISTRIES = [(REGISTRY, "fedprism.algorithms"), (MODELS, "fedprism.models"), (DATASETS, "fedprism.data.sets"),
              (PARTITIONS, "fedprism.data.partitions")]

#: (name, module) -> the other meaning of the word there
OTHER_MEANING: dict[tuple[str, str], str] = {
    ("fedprism", "fedprism.cli"): "the program's name",
    ("fedprism", "fedprism.experiment.provenance"): "the package's name (fedprism's own classes)",
    ("fedprism", "fedprism.machine"): "the cache folder's name",
    ("fedprism", "fedprism.experiment.config"): "the default value of the `method` key",
    ("digits", "fedprism.experiment.config"): "the default value of the `dataset` key",
    ("dirichlet", "fedprism.experiment.config"): "the default value of the `partition` key",
    ("local", "fedprism.algorithms.fedprism_dual.gate"): "the clients' own test split",
    ("local", "fedprism.algorithms.partial"): "the name of partial sharing's kept parameters",
    ("local", "fedprism.data.drift"): "the clients' own test split",
    ("local", "fedprism.engine.base"): "the clients' own test split",
    ("local", "fedprism.engine.vectorized"): "the clients' own test split",
    ("local", "fedprism.experiment.evaluate"): "the clients' own test split",
    ("local", "fedprism.flower.server"): "the clients' own test split",
    ("local", "fedprism.flower.server_app"): "the clients' own test split",
    ("local", "fedprism.flower.simulation"): "the clients' own test split",
    ("mlp", "fedprism.algorithms.fedprism_dual.gate"): "the learned gate's kind (a small network)",
    ("natural", "fedprism.cli"): "a column heading (whether a dataset has natural clients)",
    ("iid", "fedprism.data.sets.synthetic"): "the synthetic dataset's own `iid` parameter",
    ("digits", "fedprism.data.sets.emnist"): "the name of one of EMNIST's splits",
    ("mnist", "fedprism.data.sets.emnist"): "the name of one of EMNIST's splits",
    ("local", "fedprism.experiment.executor"): "Ray's address `local` (a cluster started in this process)",
    ("dirichlet", "fedprism.data.partitions.quantity"): "a client-size distribution (shares from Dir(beta))",
}

#: literals that other work is removing, by area: (name, module)
PENDING: dict[str, set[tuple[str, str]]] = {
    # each method's search space and its local DP-SGD eligibility, kept in tables beside the registry so that
    # the methods' files (and with them their stored runs' code fingerprints) stay as they are; each moves
    # into its method's module (a `space` on its Param, a class attribute) when that method's runs are next
    # re-run
    "method declarations kept in tables": {
    ("apfl", "fedprism.algorithms.spaces"), ("apfl", "fedprism.local_dp"),
    ("clust_psi_pfl", "fedprism.algorithms.spaces"), ("ditto", "fedprism.algorithms.spaces"),
    ("ditto", "fedprism.local_dp"), ("fedala", "fedprism.algorithms.spaces"),
    ("fedamp", "fedprism.algorithms.spaces"), ("fedavg", "fedprism.local_dp"),
    ("fedbabu", "fedprism.algorithms.spaces"), ("fedbabu", "fedprism.local_dp"),
    ("fedbn", "fedprism.local_dp"), ("fedclust", "fedprism.algorithms.spaces"),
    ("feddyn", "fedprism.algorithms.spaces"), ("feddyn", "fedprism.local_dp"),
    ("fedem", "fedprism.algorithms.spaces"), ("fedfomo", "fedprism.algorithms.spaces"),
    ("fednova", "fedprism.local_dp"), ("fedpac", "fedprism.algorithms.spaces"),
    ("fedper", "fedprism.local_dp"), ("fedprism", "fedprism.algorithms.spaces"),
    ("fedprism_dual", "fedprism.algorithms.spaces"), ("fedproto", "fedprism.algorithms.spaces"),
    ("fedproto", "fedprism.local_dp"), ("fedprox", "fedprism.algorithms.spaces"),
    ("fedprox", "fedprism.local_dp"), ("fedrep", "fedprism.algorithms.spaces"),
    ("fedrep", "fedprism.local_dp"), ("fedsoft", "fedprism.algorithms.spaces"),
    ("gpfl", "fedprism.algorithms.spaces"), ("ifca", "fedprism.algorithms.spaces"),
    ("lg_fedavg", "fedprism.local_dp"), ("local", "fedprism.local_dp"), ("moon", "fedprism.algorithms.spaces"),
    ("moon", "fedprism.local_dp"), ("perfedavg", "fedprism.algorithms.spaces"),
    ("perfedavg", "fedprism.local_dp"), ("pfedme", "fedprism.algorithms.spaces"),
    ("pfedme", "fedprism.local_dp"), ("pfpl", "fedprism.algorithms.spaces"),
    ("protohar", "fedprism.algorithms.spaces"), ("protohar", "fedprism.local_dp"),
    ("qffl", "fedprism.algorithms.spaces"), ("qffl", "fedprism.local_dp"),
    ("scaffold", "fedprism.algorithms.spaces"), ("scaffold", "fedprism.local_dp"),
    },
    # the real-domain form of domain_mix (Digits domains, Office-Caltech10) dispatched by name where the
    # federation is built, and the partition study's log-scale targets: to move into the PartitionSpecs
    "partition dispatch by name": {
    ("dirichlet", "fedprism.algorithms.clust_psi_pfl.study"), ("domain_mix", "fedprism.data.domains"),
    ("domain_mix", "fedprism.experiment.federation"),
    },
}


def owners(registries=REGISTRIES) -> dict[str, list[str]]:
    """name -> the modules where it may appear: its component's module (a package with its submodules,
    `name.*`) and its kind's registry modules (the package itself and its `base`, exactly)."""
    out: dict[str, list[str]] = {}
    for reg, package in registries:
        for name, module in reg._builtins().items():
            out.setdefault(name, []).extend([f"{module}.*", package, f"{package}.base"])
    return out


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def name_literals(src: Path, names: dict[str, list[str]]) -> dict[tuple[str, str], list[int]]:
    """(name, module) -> lines of every string literal equal to a component name outside the modules
    allowed for it (`names`: name -> allowed modules, each with its submodules)."""
    out: dict[tuple[str, str], list[int]] = {}
    for f in sorted(src.rglob("*.py")):
        parts = f.relative_to(src).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        tree = ast.parse(f.read_text(), filename=str(f))
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in docs:
                continue
            homes = names.get(node.value)
            if homes is None or any(module == h.removesuffix(".*") or (h.endswith(".*") and module.startswith(
                    h[:-1])) for h in homes):
                continue
            out.setdefault((node.value, module), []).append(node.lineno)
    return out


def test_no_component_name_outside_its_module():
    found = name_literals(SRC, owners())
    pending = set().union(*PENDING.values())
    new = {k: v for k, v in found.items() if k not in OTHER_MEANING and k not in pending}
    assert not new, "component names as literals outside their modules:\n" + "\n".join(
        f"  {name!r} in {module} (lines {', '.join(map(str, lines))})" for (name, module), lines in sorted(new.items()))
    gone = (pending | set(OTHER_MEANING)) - set(found)
    assert not gone, f"no longer there, remove from PENDING / OTHER_MEANING: {sorted(gone)}"


def _plant(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp_path


def test_a_planted_method_name_is_reported(tmp_path):
    """A run-layer module that dispatches on `"ditto"` is reported; the method's own module, the registry
    package and a docstring naming it are not."""
    names = owners()
    src = _plant(tmp_path, {
        "fedprism/algorithms/ditto.py": 'NAME = "ditto"\n',
        "fedprism/algorithms/__init__.py": 'BUILTIN = ("ditto",)\n',
        "fedprism/experiment/limits.py": '"""Ditto: "ditto" in prose."""\n\n\ndef f(cfg):\n'
                                         '    return cfg["method"] == "ditto"\n',
    })
    assert name_literals(src, names) == {("ditto", "fedprism.experiment.limits"): [5]}
    clean = _plant(tmp_path / "clean", {"fedprism/experiment/limits.py": "def f(cls):\n    return cls.name\n"})
    assert name_literals(clean, names) == {}


def test_every_kind_contributes_names():
    names = owners()
    for reg, _ in REGISTRIES:
        assert set(reg._builtins()) <= set(names)
    assert {"ditto", "fmnist", "lenet5", "dirichlet"} <= set(names)
