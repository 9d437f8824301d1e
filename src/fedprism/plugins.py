"""Extensions from other packages: methods, models, datasets and partitions registered through entry points.

A package adds to fedprism without editing it by declaring entry points in its own metadata
(`pyproject.toml`):

    [project.entry-points."fedprism.methods"]
    fedavgm = "my_package.fedavgm:FedAvgM"            # an `fedprism.algorithms.Algorithm` subclass
    [project.entry-points."fedprism.models"]
    lenet300 = "my_package.models:SPEC"                # a fedprism.models.ModelSpec, or build(input_shape,
                                                       # num_classes) -> nn.Module
    [project.entry-points."fedprism.datasets"]
    blobs = "my_package.data:SPEC"                     # a DatasetSpec, or load(pad32, root) -> Dataset
    [project.entry-points."fedprism.partitions"]
    quantity_skew = "my_package.partitions:SPEC"       # a fedprism.data.partitions.PartitionSpec

`load()` reads each group into its registry (`fedprism.registry`) once per process, the first time a
configuration is resolved (`fedprism run`, sweeps, reports, Flower nodes and servers all resolve
configurations), so a registered component is usable everywhere a built-in one is. In the same
process, `register` / `register_model` / `register_dataset` / `register_partition` do the same without
entry points. docs/writing-a-method.md, docs/adding-a-model.md, docs/adding-a-dataset.md and
docs/adding-a-partition.md each build one.
"""

from __future__ import annotations

from typing import Any, Callable

GROUPS = ("fedprism.methods", "fedprism.models", "fedprism.datasets", "fedprism.partitions")

#: name -> ModelSpec: the one model registry (`fedprism.models.base.MODELS`); a bare builder
#: build(input_shape, num_classes) -> torch.nn.Module registered here is wrapped into a spec
from fedprism.models.base import MODELS  # noqa: E402
#: name -> DatasetSpec: the one dataset registry (`fedprism.data.base.DATASETS`); a bare loader
#: load(pad32: bool, root: str | None) -> fedprism.data.datasets.Dataset registered here is wrapped into a spec
from fedprism.data.base import DATASETS  # noqa: E402

_loaded = False


def _check(kind: str, name: object, fn: object, builtin: tuple[str, ...], tokens: bool = False) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_{kind}: the name {name!r} is not a non-empty string")
    if name in builtin:
        raise ValueError(f"register_{kind}: {name!r} is a built-in {kind}; give yours a name of its own")
    if not callable(fn):
        raise TypeError(f"register_{kind}({name!r}, ...): {fn!r} is not callable")
    import inspect

    call = {"model": ("build(input_shape, num_classes, vocab_size=...)", ((80,), 10), {"vocab_size": 80})
            if tokens else ("build(input_shape, num_classes)", ((1, 28, 28), 10), {}),      # a token model's
            "dataset": ("load(pad32, root)", (), {"pad32": False, "root": None})}[kind]
    try:
        inspect.signature(fn).bind(*call[1], **call[2])
    except TypeError as e:
        raise TypeError(f"register_{kind}({name!r}, ...): {fn!r} cannot be called as {call[0]} "
                        f"({e})") from None
    except ValueError:                  # no signature to read (some builtins): checked when it is called
        pass


def register_model(name: str, build: Callable[..., Any]) -> Callable[..., Any]:
    """`build(input_shape, num_classes) -> torch.nn.Module`, or a whole `fedprism.models.ModelSpec` (which
    also declares input constraints, 32x32 padding and its body/head), under `name` (not a built-in
    model's name) in the model registry. What a builder returns is checked when a run builds it
    (`runner.make_model`)."""
    from fedprism.models.base import ModelSpec

    builtin = tuple(n for n in MODELS.names() if MODELS.is_builtin(n))
    spec = build if isinstance(build, ModelSpec) else None
    _check("model", name, build if spec is None else spec.build, builtin, tokens=spec is not None and spec.tokens)
    MODELS.register(build, name=name)
    return build


def register_dataset(name: str, load: Callable[..., Any]) -> Callable[..., Any]:
    """`load(pad32, root) -> fedprism.data.datasets.Dataset`, or a whole `fedprism.data.base.DatasetSpec`,
    under `name` (not a built-in dataset's) in the dataset registry."""
    from fedprism.data.base import DatasetSpec

    builtin = tuple(n for n in DATASETS.names() if DATASETS.is_builtin(n))
    _check("dataset", name, load.load if isinstance(load, DatasetSpec) else load, builtin)
    DATASETS.register(load, name=name)
    import sys

    federation = sys.modules.get("fedprism.experiment.federation")
    if federation is not None:          # its cached federations of `name` were built by the loader replaced
        federation.clear_federations()
    return load


def load(force: bool = False) -> None:
    """Import every entry point of the four groups (once per process unless `force`), each into its
    registry. A plugin that fails to import or to register is skipped with a warning naming it, so one
    broken package cannot stop fedprism."""
    global _loaded
    if _loaded and not force:
        return
    _loaded = True
    from fedprism.algorithms.base import REGISTRY
    from fedprism.data.partitions import PARTITIONS

    for registry in (REGISTRY, MODELS, DATASETS, PARTITIONS):
        registry.load_plugins(force)
