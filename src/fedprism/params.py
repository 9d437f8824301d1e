"""Flat parameter vectors <-> modules: the one place that knows the layout (docs/architecture.md).

A model's trainable parameters live as one float32 vector of length P. `ParamSpec` maps slices of
that vector to named parameter shapes, so a global model, a cluster model, a client delta or a whole
cohort (`[n, P]`) are plain tensors and aggregation is matrix algebra.

Decision (BatchNorm): only *parameters* live in the flat vector. Models in `fedprism.models` use
BatchNorm with `track_running_stats=False` (batch statistics in training and evaluation), so there
are no buffers to average or to keep client-local; see README "Design decisions".
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

    @classmethod
    def of(cls, module: nn.Module) -> "ParamSpec":
        names, shapes, offsets, off = [], [], [], 0
        for name, p in module.named_parameters():
            names.append(name)
            shapes.append(tuple(p.shape))
            offsets.append(off)
            off += p.numel()
        return cls(tuple(names), tuple(shapes), tuple(offsets) + (off,))

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

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of `flat` (shape [..., P]) as named parameter tensors; works under vmap."""
        lead = flat.shape[:-1]
        return {
            n: flat[..., self.offsets[i] : self.offsets[i + 1]].view(*lead, *s)
            for i, (n, s) in enumerate(zip(self.names, self.shapes))
        }

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


class Functional:
    """A model as a pure function `logits = f(flat_params, x)` (meta-device skeleton + functional_call)."""

    def __init__(self, module: nn.Module):
        self.spec = ParamSpec.of(module)
        self.module = module
        self.buffers = {k: v for k, v in module.named_buffers()}

    def __call__(self, flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return functional_call(self.module, (self.spec.unflatten(flat), self.buffers), (x,))

    def features(self, flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Penultimate representation (input of `head`), for prototype methods."""
        params = self.spec.unflatten(flat)
        return functional_call(self.module, (params, self.buffers), (x,), {"features_only": True})

    def head(self, flat: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Logits of penultimate features `z` under the head of `flat` (for losses on features)."""
        params = self.spec.unflatten(flat)
        p = self.spec.head_prefix
        return functional_call(self.module.head, {k[len(p):]: v for k, v in params.items() if k.startswith(p)}, (z,))
