"""What the Flower server knows of a run's data and model before any node speaks: the input shape, the
number of classes and the model's parameter count (`RunSpec`), decided from the server's own
configuration, never from a node's identity reply.

    server_spec     the experiment (and, when the server can read it, the dataset) -> RunSpec
    published_shape input shape and class count as the dataset's spec declares them (its published
                    format: the official files' image size, the generator's sizes; `data.pad32`), for a
                    server that cannot read the data

Why: the first node to answer the identity query used to fix these for the whole run. One node claiming
another shape then had every honest node refused (or `min-nodes` never reached), and a claimed shape of
10^9 features made the server allocate the model for it before any check. The server built the
partition, or knows the dataset's declared format, so it decides; each node's identity is checked
against the spec (`RunSpec.check`) and a node that disagrees is refused alone. No allocation is sized
from a node's claim.

No Flower import: unit-testable without Flower.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedprism.errors import ConfigError
from fedprism.experiment.config import Config
from fedprism.flower.trust import Identity, Refused


@dataclass(frozen=True)
class RunSpec:
    """The run's input shape, class count and model size, as the server decided them (`source` says
    from what: the dataset read on the server, or the dataset's published format)."""

    input_shape: tuple[int, ...]
    num_classes: int
    param_size: int
    source: str = ""

    def check(self, ident: Identity) -> None:
        """Raise `Refused` (naming the field) when a node's identity disagrees with the spec."""
        if tuple(ident.input_shape) != self.input_shape:
            raise Refused("input-shape", f"data of shape {list(ident.input_shape)}, the experiment's data "
                                         f"has {list(self.input_shape)}")
        if ident.num_classes != self.num_classes:
            raise Refused("num-classes", f"{ident.num_classes} classes, the experiment's data has "
                                         f"{self.num_classes}")
        if ident.param_size != self.param_size:
            raise Refused("param-size", f"a model of {ident.param_size} parameters, the experiment's model "
                                        f"has {self.param_size}")


def published_shape(cfg: Config) -> tuple[tuple[int, ...], int] | None:
    """(input shape, classes) of the experiment's dataset as its spec declares them
    (`fedprism.data.base.DatasetSpec`: `input_shape` as loaded without padding, `num_classes`), with
    `data.pad32` applied as the federation applies it; None when the spec leaves them to the loader (a bare
    registered loader: only its data knows)."""
    from fedprism.data.base import DATASETS
    from fedprism.experiment.federation import _pad32

    name = cfg["dataset"]
    ds = DATASETS.find(name)
    if ds is None or ds.input_shape is None or ds.num_classes is None:
        return None
    shape = tuple(int(v) for v in ds.input_shape)
    if len(shape) == 3 and _pad32(cfg, name):      # images zero-padded to 32x32 (`data.pad32`)
        shape = (shape[0], 32, 32)                  # (larger images are refused by the loader)
    return shape, int(ds.num_classes)


def server_spec(cfg: Config, input_shape: tuple[int, ...] | None = None, num_classes: int | None = None,
                model=None) -> RunSpec:
    """The run's spec: from the dataset the server read (`input_shape`, `num_classes`, and the `model`
    already built from them, if any), else from the dataset's declared format (`published_shape`). A
    dataset that declares no shape and that the server cannot read is refused (ConfigError naming
    `dataset`): its shape would have to be a node's word."""
    from fedprism.experiment.build import make_model
    from fedprism.params import ParamSpec

    if input_shape is not None and num_classes is not None:
        shape, classes = tuple(int(v) for v in input_shape), int(num_classes)
        source = "the dataset, read on the server"
    else:
        pub = published_shape(cfg)
        if pub is None:
            raise ConfigError("dataset", cfg["dataset"], "a dataset the server can read, or one whose spec "
                              "declares its input_shape and classes: otherwise they are known only from its "
                              "data, and the server never takes them from a node (install the dataset on the "
                              "server too)")
        shape, classes = pub
        source = "the dataset's published format"
        model = None
    if model is None:
        model = make_model(cfg, shape, classes)
    return RunSpec(shape, classes, int(ParamSpec.of(model).size), source)
