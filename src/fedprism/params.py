"""Flat parameter vectors <-> modules: the one place that knows the layout (docs/architecture.md).

A model's trainable parameters live as one float32 vector of length P. `ParamSpec` maps slices of
that vector to named parameter shapes, so a global model, a cluster model, a client delta or a whole
cohort (`[n, P]`) are plain tensors and aggregation is matrix algebra.

Decision (BatchNorm): the flat vector holds a model's *state*: its parameters and, for BatchNorm layers
that keep running statistics (`fedprism.models.RunningBatchNorm2d`, marked `running_stats = True`), their
running mean and variance, laid out in module order (a layer's weight, bias, running_mean, running_var),
as `state_dict` orders them. The running statistics are the vector's *buffer section*
(`ParamSpec.buffer_names`, `ParamSpec.trainable`): every method sees them as part of the model, so they are
averaged where a method averages the model, kept on the client where it keeps the layer (FedBN, through
`ParamSpec.batchnorm`), checkpointed, sent and counted in bytes, without a method knowing of them. No
optimiser steps them: the engines train with them masked out (no gradient, no weight decay) and then set
them from the step's batch statistics (`Functional.with_stats`, `apply_running`), as PyTorch's training
mode does. Models whose BatchNorm uses batch statistics only (`track_running_stats=False`: `cnn`,
`lenet5_bn`, `mlp_bn`, `clustpsi_cifar_cnn`) have no buffer section, and their vector, its layout and
every number computed from it are what they were (docs/architecture.md, "BatchNorm and the flat vector").
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch
from torch import nn
from torch.func import functional_call


def running_layers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, layer) of every BatchNorm layer that keeps running statistics in the flat vector
    (`running_stats = True`, `fedprism.models.RunningBatchNorm2d`), in module order.

    A PyTorch `_BatchNorm` layer with `track_running_stats=True` updates its buffers in place in training
    mode, which no engine can do on a flat vector under `torch.func`: it is refused here, naming the layer
    and the two forms fedprism trains."""
    out = []
    for n, m in module.named_modules():
        if getattr(m, "running_stats", False):
            out.append((n, m))
        elif isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats:
            raise ValueError(f"layer {n or type(m).__name__!r} is a torch BatchNorm with running statistics "
                             "(track_running_stats=True), which fedprism's engines cannot update on a flat "
                             "vector; use fedprism.models.RunningBatchNorm2d / RunningBatchNorm1d (running "
                             "statistics in the model's vector) or track_running_stats=False (batch statistics)")
    return out


@dataclass(frozen=True)
class ParamSpec:
    """Layout of a flat model vector: names, shapes and offsets in module order (parameters, and the
    running statistics of running-stat BatchNorm layers: `buffer_names`)."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    head_prefix: str = "head."
    #: names of the entries that belong to BatchNorm layers (their affine weight and bias, and their running
    #: statistics where they keep them)
    bn_names: tuple[str, ...] = ()
    #: names of the entries that are buffers (running mean and variance), not parameters: averaged and kept
    #: like parameters, never stepped by an optimiser
    buffer_names: tuple[str, ...] = ()

    @classmethod
    def of(cls, module: nn.Module) -> "ParamSpec":
        running = running_layers(module)
        names, shapes, offsets, off = [], [], [], 0
        if running:
            entries, bufs, seen = [], [], set()
            run = {id(m) for _, m in running}
            for mname, mod in module.named_modules():
                for n, p in mod.named_parameters(recurse=False):
                    if id(p) not in seen:
                        seen.add(id(p))
                        entries.append((f"{mname}.{n}" if mname else n, p))
                if id(mod) in run:
                    for n in ("running_mean", "running_var"):
                        full = f"{mname}.{n}" if mname else n
                        entries.append((full, getattr(mod, n)))
                        bufs.append(full)
        else:
            entries, bufs = list(module.named_parameters()), []
        for name, p in entries:
            names.append(name)
            shapes.append(tuple(p.shape))
            offsets.append(off)
            off += p.numel()
        bn = {f"{m}.{n}" if m else n for m, mod in module.named_modules()
              if isinstance(mod, nn.modules.batchnorm._BatchNorm)
              for n, _ in mod.named_parameters(recurse=False)} | set(bufs)
        return cls(tuple(names), tuple(shapes), tuple(offsets) + (off,),
                   bn_names=tuple(n for n in names if n in bn), buffer_names=tuple(bufs))

    @property
    def buffers(self) -> tuple[slice, ...]:
        """Slices of the buffer section (each running mean and variance), in vector order; empty for a
        model without running statistics."""
        return tuple(self.slice_of(n) for n in self.buffer_names)

    @property
    def trainable(self) -> torch.Tensor | None:
        """float32 [P]: 1 on parameters, 0 on buffers (the mask an optimiser step multiplies in); None
        when the vector holds parameters only."""
        if not self.buffer_names:
            return None
        m = torch.ones(self.size)
        for s in self.buffers:
            m[s] = 0.0
        return m

    @property
    def parameters(self) -> int:
        """Number of trainable parameters (the vector's size less the buffer section)."""
        return self.size - sum(s.stop - s.start for s in self.buffers)

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


def _state(module: nn.Module, spec: ParamSpec) -> list[torch.Tensor]:
    """The module's tensors in the order of `spec`: parameters and running statistics."""
    if not spec.buffer_names:
        return list(module.parameters())
    tensors = dict(module.named_parameters())
    tensors.update((n, b) for n, b in module.named_buffers() if n in set(spec.buffer_names))
    return [tensors[n] for n in spec.names]


def flatten(module: nn.Module) -> torch.Tensor:
    """The module's state as one detached float32 vector (a copy): its parameters, and the running
    statistics of running-stat BatchNorm layers in their place (`ParamSpec`)."""
    return torch.cat([p.detach().reshape(-1).float() for p in _state(module, ParamSpec.of(module))])


def load_flat(module: nn.Module, flat: torch.Tensor) -> nn.Module:
    """Copy a flat vector into the module's parameters (and running statistics) in place."""
    spec = ParamSpec.of(module)
    if flat.numel() != spec.size:
        raise ValueError(f"flat vector has {flat.numel()} entries, model needs {spec.size}")
    with torch.no_grad():
        for p, v in zip(_state(module, spec), spec.unflatten(flat).values()):
            p.copy_(v)
    return module


def dropout_layers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, layer) of every seeded dropout layer (`seeded_dropout = True`), in module order."""
    return [(n, m) for n, m in module.named_modules() if getattr(m, "seeded_dropout", False)]


#: the mode of running-stat layers outside training: normalise with the running statistics
EVAL = "eval"


class StatsContext:
    """What the running-stat BatchNorm layers of one `Functional`'s modules read (`stats_ctx`): `mode` is
    None (a module called outside fedprism: PyTorch's own behaviour), `EVAL` (every forward of the
    `Functional` outside a training step: running statistics) or a `StatsRecorder` (a training step: batch
    statistics)."""

    __slots__ = ("mode",)

    def __init__(self) -> None:
        self.mode: object = None


class StatsRecorder:
    """One training step's batch statistics: `records[i]` the (mean, unbiased variance) of running layer i
    in each training-mode forward at the trained vector `target` (`on` while such a forward runs), in call
    order. Forwards at other vectors (a fixed global model in an objective) normalise with their batch
    statistics and record nothing, as another module in training mode would not touch this one's."""

    def __init__(self, target: torch.Tensor, layers: int):
        self.target, self.on = target, False
        self.records: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(layers)]


class Functional:
    """A model as a pure function `logits = f(flat_params, x)` (meta-device skeleton + functional_call).

    Dropout (`fedprism.models.dropout.SeededDropout`, any layer that says `seeded_dropout = True` and
    holds a `key` buffer: `dropout_layers`): `f(flat, x)` runs without dropout (evaluation); `f.keyed(key)`
    is the same function with the step's dropout key (int64 [3], one per vmap slot) in every dropout
    layer, for local training. Layers are numbered (`salt`) in module order here, so their masks differ.

    Running statistics (`running_layers`): every call normalises with the running statistics held in the
    flat vector (evaluation mode), except inside a training step's loss wrapped by `with_stats`, where the
    layers use batch statistics and record them; `apply_running` then moves the vector's buffer section.

    `inference_module`: a copy of `module` that computes the same numbers faster without gradients (the
    engine passes `fedprism.models.pooling.for_inference(module)`), used whenever gradients are off;
    None: `module` itself."""

    def __init__(self, module: nn.Module, inference_module: nn.Module | None = None):
        self.spec = ParamSpec.of(module)
        self.module = module
        self.buffers = {k: v for k, v in module.named_buffers() if k not in set(self.spec.buffer_names)}
        self.dropout = tuple(f"{n}.key" for n, _ in dropout_layers(module))
        for i, (_, m) in enumerate(dropout_layers(module)):
            m.salt = i
        running = running_layers(module)
        #: per running layer: (running-mean slice, running-variance slice, momentum)
        self.running = tuple((self.spec.slice_of(f"{n}.running_mean"), self.spec.slice_of(f"{n}.running_var"),
                              float(m.momentum)) for n, m in running)
        for i, (_, m) in enumerate(running):
            m.stats_index = i
        self.ctx = StatsContext() if running else None
        self._bound: dict[int, list[nn.Module]] = {}
        self.inference_module = inference_module      # faster poolings, same numbers; gradients off only

    def _call(self, module: nn.Module, tensors: tuple, args: tuple, kwargs: dict | None,
              flat: torch.Tensor) -> torch.Tensor:
        """functional_call, with the running-stat layers in the mode this call needs."""
        if self.ctx is None:
            return functional_call(module, tensors, args, kwargs)
        layers = self._bound.get(id(module))
        if layers is None:       # copies (inference, fused) share this function's context
            layers = self._bound[id(module)] = [m for m in module.modules() if getattr(m, "running_stats", False)]
        for m in layers:         # another Functional of the same module (a second engine) may have bound it
            if m.stats_ctx is not self.ctx:
                m.stats_ctx = self.ctx
        mode = self.ctx.mode
        if isinstance(mode, StatsRecorder):
            on, mode.on = mode.on, flat is mode.target
            try:
                return functional_call(module, tensors, args, kwargs)
            finally:
                mode.on = on
        self.ctx.mode = EVAL
        try:
            return functional_call(module, tensors, args, kwargs)
        finally:
            self.ctx.mode = mode

    def with_stats(self, loss_of):
        """`loss_of(flat, *args) -> loss` as `(flat, *args) -> (loss, stats)`, run as a training step:
        running-stat layers normalise with batch statistics, and `stats[i]` holds the (mean, variance) pairs
        of running layer i at `flat` (detached; a tuple per layer, so `vmap` and `grad_and_value(...,
        has_aux=True)` carry them). A model without running statistics gives `stats = ()`."""
        if self.ctx is None:
            return lambda flat, *args: (loss_of(flat, *args), ())

        def fn(flat, *args):
            rec = StatsRecorder(flat, len(self.running))
            prev, self.ctx.mode = self.ctx.mode, rec
            try:
                loss = loss_of(flat, *args)
            finally:
                self.ctx.mode = prev
            return loss, tuple(tuple(r) for r in rec.records)
        return fn

    def apply_running(self, w: torch.Tensor, stats: tuple, mask: torch.Tensor | None = None,
                      active: torch.Tensor | None = None) -> torch.Tensor:
        """Move the buffer section of `w` ([..., P], in place) by the recorded batch statistics, one record
        after another as PyTorch's training mode does: r <- (1 - momentum) r + momentum s, with s the batch
        mean, or the unbiased batch variance. Coordinates that `mask` ([P] or [n, P]) zeroes, and rows
        that `active` ([n, 1] bool) leaves out, keep their values. Returns `w`."""
        for (ms, vs, m), recs in zip(self.running, stats):
            for rec in recs:
                for sl, s in zip((ms, vs), rec):
                    cur = w[..., sl]
                    new = cur * (1.0 - m) + s.to(cur.dtype) * m
                    allow = None if mask is None else mask[..., sl] != 0
                    if active is not None:
                        allow = active if allow is None else allow & active
                    w[..., sl] = new if allow is None else torch.where(allow, new, cur)
        return w

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
        return self._call(self._module(), (self.spec.unflatten(flat), self._buffers(key)), (x,), None, flat)

    def features(self, flat: torch.Tensor, x: torch.Tensor, key: torch.Tensor | None = None) -> torch.Tensor:
        """Penultimate representation (input of `head`), for prototype methods."""
        params = self.spec.unflatten(flat)
        return self._call(self._module(), (params, self._buffers(key)), (x,), {"features_only": True}, flat)

    def head(self, flat: torch.Tensor, z: torch.Tensor, key: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of penultimate features `z` under the head of `flat` (for losses on features)."""
        params = self.spec.unflatten(flat)
        p = self.spec.head_prefix
        head_params = {k[len(p):]: v for k, v in params.items() if k.startswith(p)}
        return self._call(self.module.head, (head_params, self._buffers(key, p)), (z,), None, flat)

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
