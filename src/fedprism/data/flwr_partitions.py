"""``partition=flwr:CLASS``: a partitioner of Flower Datasets (``flwr_datasets.partitioner``) as a fedprism
partition (docs/huggingface.md).

The family ``flwr`` of the partition registry (`fedprism.registry.Registry.family`) makes one
`PartitionSpec` per class named: ``flwr:DirichletPartitioner``, or without the suffix and in any case,
``flwr:dirichlet``. Its ``partition.*`` keys are the class's own keyword arguments, read from its signature
(default, type, and the choices of a ``Literal``; an argument without a default is required). fedprism fills
``num_partitions`` (``clients``), ``partition_by`` (the label column) and ``seed`` (drawn from the run's
partition stream, so the same configuration gives the same partition in every process). The partitioner
splits the training labels; `fedprism.data.partitions.make_partition` then draws each client's test rows as
for any partition.
"""

from __future__ import annotations

import inspect
import typing
from typing import Any

import numpy as np

from fedprism.data.partitions.base import PartitionSpec
from fedprism.errors import ConfigError, PartitionError
from fedprism.hparams import Param

__all__ = ["spec_for", "partitioner_class"]

#: the arguments fedprism fills itself
FILLED = ("num_partitions", "partition_by", "seed")


def _module():
    try:
        import flwr_datasets.partitioner as module
    except ImportError:                     # pragma: no cover - the `hf` extra is installed with the package
        raise ConfigError("partition", "flwr:", "a partitioner of an installed flwr-datasets: pip install "
                          "'fedprism[hf]'") from None
    return module


def partitioner_class(name: str) -> type:
    """The class ``flwr:NAME`` names: ``NAME`` itself or ``NAME + 'Partitioner'``, in any case."""
    module = _module()
    classes = {c: getattr(module, c) for c in dir(module)
               if c.endswith("Partitioner") and c != "Partitioner" and isinstance(getattr(module, c), type)}
    want = name.split(":", 1)[1].strip().lower()
    for cname, cls in classes.items():
        if want in (cname.lower(), cname.lower()[:-len("partitioner")]):
            return cls
    from fedprism.registry import suggest

    short = sorted(c[:-len("Partitioner")].lower() for c in classes)
    raise ConfigError("partition", name, f"flwr:NAME with NAME a partitioner of Flower Datasets: "
                      f"{', '.join(short)}{suggest(want, short)}")


def _param(name: str, p: inspect.Parameter, cls: type) -> Param:
    hint = p.annotation
    if isinstance(hint, str):
        try:
            hint = typing.get_type_hints(cls.__init__).get(name, hint)
        except Exception:  # noqa: BLE001 - an annotation that does not resolve: no choices from it
            pass
    choices = tuple(typing.get_args(hint)) if typing.get_origin(hint) is typing.Literal else None
    text = f"{cls.__name__}'s {name}" + (f" ({hint.__name__})" if isinstance(hint, type) else "")
    if p.default is inspect.Parameter.empty:
        return Param(None, f"{text}; required", lambda v: v is not None, f"a value (required by {cls.__name__})")
    return Param(p.default, text, choices=choices)


def spec_for(name: str) -> PartitionSpec:
    """The spec of ``flwr:CLASS`` (the registry's factory for the family ``flwr``)."""
    cls = partitioner_class(name)
    sig = inspect.signature(cls.__init__)
    takes = set(sig.parameters)
    params = {k: _param(k, p, cls) for k, p in sig.parameters.items()
              if k != "self" and k not in FILLED and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}

    def split(y, num_classes, num_clients, min_train, rng, values):
        """The partitioner's own split of the labels (`spec_for`)."""
        import datasets

        kwargs: dict[str, Any] = {k: v for k, v in values.items() if v is not None}
        if "num_partitions" in takes:
            kwargs["num_partitions"] = num_clients
        if "partition_by" in takes:
            kwargs["partition_by"] = "label"
        if "seed" in takes:
            kwargs["seed"] = int(rng.integers(2**31 - 1))
        try:
            part = cls(**kwargs)
            part.dataset = datasets.Dataset.from_dict({"label": np.asarray(y, np.int64),
                                                       "_row": np.arange(len(y), dtype=np.int64)})
            if part.num_partitions != num_clients:
                raise PartitionError(f"clients = {num_clients} is not valid for partition '{name}': its "
                                     f"partitioner makes {part.num_partitions} partitions")
            rows = [np.asarray(part.load_partition(i)["_row"], dtype=np.int64) for i in range(num_clients)]
        except PartitionError:
            raise
        except (ValueError, TypeError, KeyError) as e:
            raise PartitionError(f"partition '{name}' ({cls.__name__}) refused {kwargs}: {e}") from None
        idx = np.concatenate(rows) if rows else np.zeros(0, np.int64)
        owner = np.repeat(np.arange(num_clients), [len(r) for r in rows])
        return idx, owner, {"partitioner": cls.__name__}

    split.__module__ = __name__
    return PartitionSpec(name, split, params, title=f"Flower Datasets' {cls.__name__} (flwr_datasets.partitioner)")
