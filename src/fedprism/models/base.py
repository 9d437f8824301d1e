"""What a model is to the rest of fedprism: a `ModelSpec` registered on `MODELS`.

Every model is `head(body(x))` (`Split`): `body` ends with the penultimate features, `head` holds the
classifier. Prototype and head-only methods use `ParamSpec.head` / `.body` slices, never layer names;
methods that keep normalisation layers apart use `ParamSpec.batchnorm`. `forward(x, features_only=True)`
returns the body output. Dropout is `fedprism.models.dropout.SeededDropout` (masks from a key the engines
derive per run seed, round, client and step; identity at evaluation), never `torch.nn.Dropout`.

A model is one module: the built-in ones are the modules of `fedprism.models` (module `lenet5.py` holds
the model `lenet5`), each declaring one `ModelSpec` and registering it. The spec says everything the run,
CLI and Flower layers need: how to build it, which input shapes it takes (checked before it is built, with
the reason in the error), whether `data.pad32=auto` pads 28x28 images to 32x32 for it, and what its body
and head hold (for `fedprism models`). Nothing outside a model's own module names it. Models of other
packages come through the `fedprism.models` entry-point group or `fedprism.register_model`; a bare
`build(input_shape, num_classes)` registered there becomes a spec that declares nothing else.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from fedprism.errors import ConfigError
from fedprism.registry import Registry

__all__ = ["MODELS", "ModelSpec", "Split", "BatchNorm1d", "BATCH_STATS", "RunningBatchNorm1d",
           "RunningBatchNorm2d", "build_model", "features",
           "token_mismatch"]


class Split(nn.Module):
    """`head(body(x))`; `features_only=True` returns `body(x)` (the penultimate features)."""

    body: nn.Module
    head: nn.Module

    def forward(self, x: torch.Tensor, features_only: bool = False) -> torch.Tensor:
        z = self.body(x)
        return z if features_only else self.head(z)


#: BatchNorm on batch statistics only (`track_running_stats=False`): no buffers, so the flat vector holds
#: everything that is averaged (see `fedprism.params`)
BATCH_STATS = {"track_running_stats": False}


class BatchNorm1d(nn.BatchNorm1d):
    """BatchNorm1d on batch statistics (no running statistics, as every BatchNorm here) that also takes a
    batch of one sample. Training keeps the last, partial batch (`engine.base.batch_order`), which holds
    a single sample whenever n_k = 1 mod B; torch's `F.batch_norm` refuses such a batch, while the
    formula is defined: the sample is its own batch mean, x_hat = 0, and the layer outputs its bias beta
    (exactly: computing x - mean in floating point would leave a rounding residue that 1/sqrt(eps)
    amplifies into noise, different from engine to engine)."""

    def __init__(self, num_features: int):
        super().__init__(num_features, track_running_stats=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            return x * 0 + self.bias
        return F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)


def _batched(x: torch.Tensor) -> bool:
    """True inside torch.func.vmap (the vectorized engine), where a kernel cannot write a shared buffer."""
    return torch._C._functorch.is_functorch_wrapped_tensor(x)


class _RunningStats:
    """BatchNorm that keeps running statistics in the model's flat vector (`fedprism.params`: the buffer
    section), for models that behave as in other libraries and in deployment: batch statistics in
    training, running statistics in evaluation (Ioffe & Szegedy 2015, "Batch Normalization: Accelerating
    Deep Network Training by Reducing Internal Covariate Shift", arXiv:1502.03167).

    Called through `fedprism.params.Functional` (every engine, every Flower node), the layer reads the
    function's mode (`stats_ctx.mode`): in a training step it normalises with the batch's mean and biased
    variance and records the batch mean and unbiased variance, which the engine folds into the running
    statistics with `momentum` (0.1, PyTorch's default) after the optimiser step; anywhere else it
    normalises with the running statistics. Called as a plain module (outside fedprism), it is PyTorch's
    BatchNorm. Decisions: `num_batches_tracked` is not kept (it is read only with `momentum=None`, the
    cumulative average, which the layer does not offer); a batch in which a channel has one value (one
    sample of a fully connected layer) outputs the bias exactly (as `BatchNorm1d` here) and records nothing,
    since it has no variance; its momentum is fixed at construction."""

    running_stats = True
    stats_ctx = None
    stats_index = 0

    def _setup(self) -> None:
        if self.momentum is None:
            raise ValueError("RunningBatchNorm: momentum=None (a cumulative average) is not offered; give a "
                             "number in (0, 1], e.g. 0.1")
        self.register_buffer("num_batches_tracked", None)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # a state dict of torch's BatchNorm carries num_batches_tracked, which this layer does not keep;
        # torch's loader would add the key back (and a strict load then refuse it)
        state_dict.pop(prefix + "num_batches_tracked", None)
        nn.Module._load_from_state_dict(self, state_dict, prefix, *args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        mode = None if self.stats_ctx is None else self.stats_ctx.mode
        if mode is None:                       # a plain module call: PyTorch's BatchNorm
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                self.training, self.momentum, self.eps)
        if not hasattr(mode, "records"):       # evaluation: the running statistics (constants: a gradient
            # through an evaluation-mode forward, e.g. of a method's own objective, leaves them at 0)
            return F.batch_norm(x, self.running_mean.detach(), self.running_var.detach(), self.weight, self.bias,
                                False, 0.0, self.eps)
        if x.numel() == x.shape[1]:           # one value per channel: no variance (see the class docstring)
            shape = (1, -1) + (1,) * (x.dim() - 2)
            return x * 0 + self.bias.view(shape)
        if mode.on and not _batched(x):        # one pass: the kernel's own batch mean and unbiased variance
            c = x.shape[1]                     # (momentum 1: the buffers become them), as PyTorch records them
            mean = torch.zeros(c, dtype=torch.float32, device=x.device)
            var = torch.ones(c, dtype=torch.float32, device=x.device)
            y = F.batch_norm(x, mean, var, self.weight, self.bias, True, 1.0, self.eps)
            mode.records[self.stats_index].append((mean, var))
            return y
        y = F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)
        if mode.on:                            # under vmap: no in-place buffers, the statistics apart
            dims = [0, *range(2, x.dim())]
            var, mean = torch.var_mean(x.detach(), dim=dims, correction=1)
            mode.records[self.stats_index].append((mean, var))
        return y


class RunningBatchNorm2d(_RunningStats, nn.BatchNorm2d):
    """BatchNorm2d with running statistics in the flat vector (`_RunningStats`)."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1):
        super().__init__(num_features, eps=eps, momentum=momentum, affine=True, track_running_stats=True)
        self._setup()


class RunningBatchNorm1d(_RunningStats, nn.BatchNorm1d):
    """BatchNorm1d with running statistics in the flat vector (`_RunningStats`)."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1):
        super().__init__(num_features, eps=eps, momentum=momentum, affine=True, track_running_stats=True)
        self._setup()


def features(input_shape: tuple[int, ...]) -> int:
    """Inputs per sample once flattened (MLPs)."""
    n = 1
    for d in input_shape:
        n *= d
    return n


@dataclass(frozen=True)
class ModelSpec:
    """One model, declared.

    name:     the config value (`model=NAME`)
    build:    build(input_shape, num_classes) -> torch.nn.Module, called under the run seed; a built-in
              returns a `Split` (body and head)
    title:    one line: what it is and where it comes from (paper, year, arXiv id)
    inputs:   the input shapes it takes, in words (listings and errors)
    refuse:   refuse(input_shape) -> None, or why the shape cannot be used (the error says it, naming the
              model, before anything is built)
    pad32:    True when `data.pad32=auto` pads 28x28 images to 32x32 for it (a model built for 32x32)
    body, head: what the body and the head hold, in words (`fedprism models`)
    shape:    an input shape it takes, for listings (parameter counts)
    conv:     False when the model holds no conv -> ReLU -> 2x2 max-pooling block (an MLP): the fused CPU
              kernels have nothing to run, so `train.kernels` / `eval.kernels` = auto resolve to `aten` and
              the run keeps the id it had before the kernels existed
    tokens:   True for a model of token inputs (text): int64 [batch, seq_len] ids of a dataset with
              `vocab_size` > 0; `build_model` passes `vocab_size=` to its build, and refuses it data that
              is not tokens (as it refuses a model with tokens=False token data)
    vocab:    a token model's vocabulary size for listings (`shape` is then `(seq_len,)`)
    """

    name: str
    build: Callable[[tuple[int, ...], int], nn.Module]
    title: str = ""
    inputs: str = "any input shape"
    refuse: Callable[[tuple[int, ...]], str | None] | None = None
    pad32: bool = False
    body: str = ""
    head: str = ""
    shape: tuple[int, ...] = (1, 28, 28)
    conv: bool = True
    tokens: bool = False
    vocab: int = 0

    def __post_init__(self) -> None:
        # the module that declared it is its builder's: a plugin cannot take a built-in's name (`Registry`)
        object.__setattr__(self, "__module__", getattr(self.build, "__module__", None) or type(self).__module__)

    def why_not(self, input_shape: tuple[int, ...]) -> str | None:
        """None when the model takes `input_shape`, else why not."""
        return None if self.refuse is None else self.refuse(tuple(input_shape))


def _make(name: str, obj: Any) -> ModelSpec:
    """What a registration holds: a `ModelSpec` under `name`; a bare builder becomes one."""
    if isinstance(obj, ModelSpec):
        return obj if obj.name == name else replace(obj, name=name)
    if not callable(obj):
        raise TypeError(f"model {name!r}: {obj!r} is not callable (a ModelSpec or build(input_shape, "
                        "num_classes) -> torch.nn.Module)")
    return ModelSpec(name, obj)


def _check(name: str, spec: ModelSpec) -> None:
    if not callable(spec.build):
        raise TypeError(f"model {name!r}: build {spec.build!r} is not callable")
    try:
        if spec.tokens:
            inspect.signature(spec.build).bind((80,), 10, vocab_size=80)
        else:
            inspect.signature(spec.build).bind((1, 28, 28), 10)
    except TypeError as e:
        call = "build(input_shape, num_classes" + (", vocab_size=...)" if spec.tokens else ")")
        raise TypeError(f"model {name!r}: {spec.build!r} cannot be called as {call} ({e})") from None
    except ValueError:                  # no signature to read (some builtins): checked when it is called
        pass


#: name -> ModelSpec: the built-in models (modules of `fedprism.models`) and registered ones
MODELS: Registry[ModelSpec] = Registry("model", "fedprism.models", skip=("base", "dropout", "flops", "pooling"),
                                       check=_check, make=_make)


def token_mismatch(spec: ModelSpec, vocab_size: int, dataset: str = "") -> str | None:
    """Why model `spec` cannot take data of this `vocab_size` (0: not tokens), naming both; None if it can."""
    data = f"dataset '{dataset}'" if dataset else "the data"
    if spec.tokens and not vocab_size:
        return (f"a model for this data: {spec.name} is a token model (int64 token ids, e.g. text) and {data} "
                "is not token data (vocab_size = 0)")
    if not spec.tokens and vocab_size:
        return (f"a model for this data: {data} is token data (int64 ids, vocab_size = {vocab_size}) and "
                f"{spec.name} is not a token model (ModelSpec.tokens)")
    return None


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int, seed: int = 0, vocab_size: int = 0,
                dataset: str = "") -> nn.Module:
    """Instantiate model `name` (built-in or registered) with deterministic initial weights for `seed`.
    An input shape the model declares it cannot take is a ConfigError naming the model and the reason;
    so is token data (`vocab_size` > 0, of `dataset` if named) for a model that does not take tokens, and
    the reverse. A token model (`ModelSpec.tokens`) is built as build(input_shape, num_classes,
    vocab_size=vocab_size)."""
    spec = MODELS.get(name, "model")
    why = token_mismatch(spec, int(vocab_size), dataset) or spec.why_not(tuple(input_shape))
    if why:
        raise ConfigError("model", name, why)
    kw = {"vocab_size": int(vocab_size)} if spec.tokens else {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return spec.build(tuple(input_shape), num_classes, **kw)


def images(input_shape: tuple[int, ...]) -> bool:
    """[C, H, W] inputs."""
    return len(input_shape) == 3
