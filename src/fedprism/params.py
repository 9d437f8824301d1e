"""Flat parameter vectors <-> modules: the one place that knows the layout (docs/architecture.md).

A model's trainable parameters live as one float32 vector of length P. `ParamSpec` maps slices of
that vector to named parameter shapes, so a global model, a cluster model, a client delta or a whole
cohort (`[n, P]`) are plain tensors and aggregation is matrix algebra.

Decision (BatchNorm): only *parameters* live in the flat vector. Models in `fedprism.models` use
BatchNorm with `track_running_stats=False` (batch statistics in training and evaluation), so there
are no buffers to average or to keep client-local; a BatchNorm layer's slice of the vector is its
affine weight and bias, which `ParamSpec.batchnorm` lists (docs/architecture.md, "BatchNorm and the
flat vector").
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch
from torch import nn
from torch.func import functional_call


@dataclass(frozen=True)
class ParamSpec:
    """Layout of a flat parameter vector: names, shapes and offsets in registration order."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    head_prefix: str = "head."
    #: names of the parameters that belong to BatchNorm layers (their affine weight and bias)
    bn_names: tuple[str, ...] = ()

    @classmethod
    def of(cls, module: nn.Module) -> "ParamSpec":
        names, shapes, offsets, off = [], [], [], 0
        for name, p in module.named_parameters():
            names.append(name)
            shapes.append(tuple(p.shape))
            offsets.append(off)
            off += p.numel()
        bn = {f"{m}.{n}" if m else n for m, mod in module.named_modules()
              if isinstance(mod, nn.modules.batchnorm._BatchNorm)
              for n, _ in mod.named_parameters(recurse=False)}
        return cls(tuple(names), tuple(shapes), tuple(offsets) + (off,),
                   bn_names=tuple(n for n in names if n in bn))

    @property
    def size(self) -> int:
        return self.offsets[-1]

    def slice_of(self, name: str) -> slice:
        i = self.names.index(name)
        return slice(self.offsets[i], self.offsets[i + 1])

    def prefix_slice(self, prefix: str) -> slice:
        """The contiguous slice of all parameters whose name starts with `prefix`."""
        idx = [i for i, n in enumerate(self.names) if n.startswith(prefix)]
        if not idx:
            raise KeyError(f"no parameter starts with {prefix!r}; have {self.names}")
        if idx != list(range(idx[0], idx[-1] + 1)):
            raise ValueError(f"parameters under {prefix!r} are not contiguous")
        return slice(self.offsets[idx[0]], self.offsets[idx[-1] + 1])

    @property
    def head(self) -> slice:
        """Slice of the classifier head (the `head` submodule of every fedprism model)."""
        return self.prefix_slice(self.head_prefix)

    @property
    def body(self) -> slice:
        return slice(0, self.head.start)

    @property
    def last_layer(self) -> slice:
        """Slice of the final linear layer (weight and bias): the FedPrism paper's prototype h_i."""
        w = [n for n in self.names if n.startswith(self.head_prefix) and n.endswith("weight")][-1]
        start = self.offsets[self.names.index(w)]
        return slice(start, self.size)

    def _groups(self) -> list[tuple[str, int, int]]:
        """(module name, first, end) index ranges into `names` of each module that owns parameters."""
        out: list[tuple[str, int, int]] = []
        for i, n in enumerate(self.names):
            layer = n.rsplit(".", 1)[0] if "." in n else ""
            if out and out[-1][0] == layer:
                out[-1] = (layer, out[-1][1], i + 1)
            else:
                out.append((layer, i, i + 1))
        return out

    @property
    def layers(self) -> tuple[tuple[str, slice], ...]:
        """(module name, slice) of every module that owns parameters, in flat-vector order, e.g.
        ('body.1', slice(0, 640)) for a Linear layer's weight and bias."""
        return tuple((m, slice(self.offsets[a], self.offsets[b])) for m, a, b in self._groups())

    @property
    def batchnorm(self) -> tuple[slice, ...]:
        """Slices of the BatchNorm layers (affine weight and bias), one per layer in vector order; empty for
        a model without BatchNorm. Methods that treat normalisation layers apart (FedBN) use these, never
        parameter names."""
        bn = set(self.bn_names)
        return tuple(slice(self.offsets[a], self.offsets[b]) for _, a, b in self._groups()
                     if any(n in bn for n in self.names[a:b]))

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of `flat` (shape [..., P]) as named parameter tensors; works under vmap."""
        # one split, not a slice per tensor: the backward of a split writes each gradient once into one
        # [P] vector, while per-tensor slices each build a zero-filled [P] gradient and add them (a
        # round of Adam on an 8 M-parameter model spent over half its time there, `bench/README.md, "step_cost"`)
        lead = flat.shape[:-1]
        parts = flat.split([self.offsets[i + 1] - self.offsets[i] for i in range(len(self.names))], dim=-1)
        return {n: v.view(*lead, *s) for n, s, v in zip(self.names, self.shapes, parts)}

    def numel(self, name: str) -> int:
        return prod(self.shapes[self.names.index(name)])


def flatten(module: nn.Module) -> torch.Tensor:
    """The module's parameters as one detached float32 vector (a copy)."""
    return torch.cat([p.detach().reshape(-1).float() for p in module.parameters()])


def load_flat(module: nn.Module, flat: torch.Tensor) -> nn.Module:
    """Copy a flat vector into the module's parameters in place."""
    spec = ParamSpec.of(module)
    if flat.numel() != spec.size:
        raise ValueError(f"flat vector has {flat.numel()} entries, model needs {spec.size}")
    with torch.no_grad():
        for (_, p), v in zip(module.named_parameters(), spec.unflatten(flat).values()):
            p.copy_(v)
    return module


def dropout_layers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, layer) of every seeded dropout layer (`seeded_dropout = True`), in module order."""
    return [(n, m) for n, m in module.named_modules() if getattr(m, "seeded_dropout", False)]


class Functional:
    """A model as a pure function `logits = f(flat_params, x)` (meta-device skeleton + functional_call).

    Dropout (`fedprism.models.dropout.SeededDropout`, any layer that says `seeded_dropout = True` and
    holds a `key` buffer: `dropout_layers`): `f(flat, x)` runs without dropout (evaluation); `f.keyed(key)`
    is the same function with the step's dropout key (int64 [3], one per vmap slot) in every dropout
    layer, for local training. Layers are numbered (`salt`) in module order here, so their masks differ.

    `inference_module`: a copy of `module` that computes the same numbers faster without gradients (the
    engine passes `fedprism.models.pooling.for_inference(module)`), used whenever gradients are off;
    None: `module` itself."""

    def __init__(self, module: nn.Module, inference_module: nn.Module | None = None):
        self.spec = ParamSpec.of(module)
        self.module = module
        self.buffers = {k: v for k, v in module.named_buffers()}
        self.dropout = tuple(f"{n}.key" for n, _ in dropout_layers(module))
        for i, (_, m) in enumerate(dropout_layers(module)):
            m.salt = i
        self.inference_module = inference_module      # faster poolings, same numbers; gradients off only

    def _module(self) -> nn.Module:
        if self.inference_module is None or torch.is_grad_enabled():
            return self.module
        return self.inference_module

    def _buffers(self, key: torch.Tensor | None, prefix: str = "") -> dict[str, torch.Tensor]:
        if key is None or not self.dropout:
            bufs = self.buffers
        else:
            bufs = {**self.buffers, **{n: key for n in self.dropout}}
        if prefix:
            bufs = {k[len(prefix):]: v for k, v in bufs.items() if k.startswith(prefix)}
        return bufs

    def __call__(self, flat: torch.Tensor, x: torch.Tensor, key: torch.Tensor | None = None) -> torch.Tensor:
        return functional_call(self._module(), (self.spec.unflatten(flat), self._buffers(key)), (x,))

    def features(self, flat: torch.Tensor, x: torch.Tensor, key: torch.Tensor | None = None) -> torch.Tensor:
        """Penultimate representation (input of `head`), for prototype methods."""
        params = self.spec.unflatten(flat)
        return functional_call(self._module(), (params, self._buffers(key)), (x,), {"features_only": True})

    def head(self, flat: torch.Tensor, z: torch.Tensor, key: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of penultimate features `z` under the head of `flat` (for losses on features)."""
        params = self.spec.unflatten(flat)
        p = self.spec.head_prefix
        head_params = {k[len(p):]: v for k, v in params.items() if k.startswith(p)}
        return functional_call(self.module.head, (head_params, self._buffers(key, p)), (z,))

    def keyed(self, key: torch.Tensor | None) -> "Functional | Keyed":
        """This function with dropout key `key` (itself when the model has no dropout or key is None)."""
        return self if key is None or not self.dropout else Keyed(self, key)


class Keyed:
    """A `Functional` bound to one training step's dropout key: what an objective receives as `f` when
    the model has dropout (`f(flat, x)`, `f.features`, `f.head` all use the key)."""

    def __init__(self, f: Functional, key: torch.Tensor):
        self.f, self.key = f, key
        self.spec, self.module = f.spec, f.module

    def __call__(self, flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.f(flat, x, self.key)

    def features(self, flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.f.features(flat, x, self.key)

    def head(self, flat: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return self.f.head(flat, z, self.key)
