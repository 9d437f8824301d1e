"""The layers of docs/architecture.md ("Layers") run one way: no module imports a module of a higher layer.

Every module under src/fedprism is parsed with `ast`; every import counts, at module level or deferred
inside a function (a deferred import still ties the lower layer to the higher one at run time), and
`from fedprism import x` / relative imports are resolved to the module they name. The graph is followed
transitively, so a failure names the edge that runs against the order and one chain of imports through
which a module reaches the higher layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

#: the declared order, lowest first (docs/architecture.md, "Layers"). A module belongs to the layer of its
#: longest matching prefix: `fedprism.flower.__main__` is an entry point, the rest of `fedprism.flower` is
#: the transport layer.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundation", ("fedprism.errors", "fedprism.registry", "fedprism.seeds", "fedprism.textable",
                    "fedprism.plotting", "fedprism.machine", "fedprism._alloc", "fedprism.layers",
                    "fedprism.selection", "fedprism.hparams", "fedprism.objectives", "fedprism.params",
                    "fedprism.protocol", "fedprism.federation", "fedprism.privacy",
                    "fedprism.systems", "fedprism.compression", "fedprism.attacks")),
    ("components", ("fedprism.models", "fedprism.data", "fedprism.clustering", "fedprism.explain",
                    "fedprism.kernels")),
    ("methods and engines", ("fedprism.algorithms", "fedprism.engine", "fedprism.local_dp")),
    ("runs", ("fedprism.experiment", "fedprism.plugins")),
    ("transport and reports", ("fedprism.flower", "fedprism.report")),
    ("entry points", ("fedprism.cli", "fedprism.api", "fedprism.__main__", "fedprism.flower.__main__")),
]
#: the root package: every module loads it (for `__version__` too); its public API is imported lazily, by
#: name, so it is no edge of the graph
ROOT = "fedprism"

#: edges that still run the wrong way, each with where it is; the test fails when one of them is fixed
#: (remove it here) as well as when a new one appears
KNOWN: dict[tuple[str, str], str] = {}


def layer_of(module: str, layers=LAYERS) -> int:
    """The rank in `layers` of a dotted module name (its longest matching prefix)."""
    best, rank = -1, None
    for i, (_, prefixes) in enumerate(layers):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    if rank is None:
        raise KeyError(f"{module} is in no layer of LAYERS: add it to docs/architecture.md and here")
    return rank


def modules(src: Path, package: str = "fedprism") -> dict[str, Path]:
    """Dotted name -> file of every module of `package` under `src`."""
    out = {}
    for f in sorted((src / package).rglob("*.py")):
        parts = f.relative_to(src).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


def imports(name: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """(imported fedprism module, line) of every import in the file, deferred ones included."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[:len(base) - node.level + (1 if is_pkg else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in known]
            out += [(m, node.lineno) for m in subs]
            if len(subs) < len(node.names):         # names defined in `mod` itself
                out.append((mod, node.lineno))
    found = []
    for mod, line in out:
        while mod and mod not in known:           # `fedprism.algorithms.base.X` -> the module that holds X
            mod = mod.rpartition(".")[0]
        if mod.startswith("fedprism.") and mod != name:
            found.append((mod, line))
    return found


def graph(src: Path) -> dict[str, list[tuple[str, int]]]:
    mods = modules(src)
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def chain(g: dict, start: str, goal: str) -> list[str]:
    """A shortest chain of imports from `start` to `goal` (breadth first)."""
    prev, todo = {start: None}, [start]
    while todo:
        nxt = []
        for m in todo:
            for n, _ in g.get(m, ()):
                if n not in prev:
                    prev[n] = m
                    nxt.append(n)
        todo = nxt
    out, m = [], goal
    while m is not None:
        out.append(m)
        m = prev.get(m)
    return out[::-1]


def violations(src: Path, layers=LAYERS) -> dict[tuple[str, str], str]:
    """(importer, imported) -> message, for every import of a higher layer, followed transitively: an
    edge that runs upwards is reported once, with the chain through which the importer's package reaches
    the higher module."""
    g, files = graph(src), modules(src)
    out = {}
    for m, deps in sorted(g.items()):
        if m == ROOT:
            continue
        for d, line in deps:
            lm, ld = layer_of(m, layers), layer_of(d, layers)
            if ld > lm:
                reach = chain(g, m, d)
                where = files[m].relative_to(src).as_posix()
                out[(m, d)] = (f"{m} (layer {layers[lm][0]!r}) imports {d} (layer {layers[ld][0]!r}) at "
                               f"{where}:{line}; chain: {' -> '.join(reach)}")
    return out


def test_every_module_has_a_layer():
    for name in modules(SRC):
        if name != ROOT:
            layer_of(name)


def test_no_module_imports_a_higher_layer():
    found = violations(SRC)
    new = {k: v for k, v in found.items() if k not in KNOWN}
    assert not new, "imports against the layer order (docs/architecture.md, Layers):\n" + "\n".join(new.values())
    gone = set(KNOWN) - set(found)
    assert not gone, f"fixed, remove from KNOWN: {sorted(gone)}"


def _plant(tmp_path: Path, files: dict[str, str]) -> Path:
    src = tmp_path / "src"
    for rel, text in files.items():
        p = src / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return src


TREE = {
    "fedprism/__init__.py": "",
    "fedprism/errors.py": "",
    "fedprism/params.py": "from fedprism import errors\n",
    "fedprism/models/__init__.py": "from fedprism.params import x\n",
    "fedprism/algorithms/__init__.py": "",
    "fedprism/algorithms/base.py": "import fedprism.models\n",
    "fedprism/experiment/__init__.py": "",
    "fedprism/experiment/runner.py": "from fedprism.algorithms.base import Algorithm\n",
}


def test_a_planted_deferred_upward_import_is_reported(tmp_path):
    clean = _plant(tmp_path / "a", TREE)
    assert violations(clean) == {}
    src = _plant(tmp_path / "b", {**TREE, "fedprism/params.py": (
        "from fedprism import errors\n\n\ndef late():\n    from .experiment import runner\n    return runner\n")})
    found = violations(src)
    assert list(found) == [("fedprism.params", "fedprism.experiment.runner")]
    msg = found[("fedprism.params", "fedprism.experiment.runner")]
    assert "layer 'foundation'" in msg and "layer 'runs'" in msg and "params.py:5" in msg


def test_a_planted_edge_through_from_package_import_is_reported(tmp_path):
    """`from fedprism import experiment` in a model module: resolved to the package, reported with the
    chain, and the lower module that reaches it transitively is named by its own edge."""
    src = _plant(tmp_path, {**TREE, "fedprism/models/__init__.py": "from fedprism import experiment\n"})
    found = violations(src)
    assert ("fedprism.models", "fedprism.experiment") in found
    assert "chain: fedprism.models -> fedprism.experiment" in found[("fedprism.models", "fedprism.experiment")]


def test_known_edges_are_named_with_a_reason():
    for edge, why in KNOWN.items():
        assert why and layer_of(edge[1]) > layer_of(edge[0]), edge


def test_protocol_imports_only_params():
    """Within the foundation: the types every layer exchanges rest on the parameter layout alone."""
    g = graph(SRC)
    assert {d for d, _ in g["fedprism.protocol"]} <= {"fedprism.params"}
