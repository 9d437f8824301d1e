"""fedprism's optional hand-written CPU kernels, and which kernels a run uses (`train.kernels`,
`eval.kernels`).

The kernels (`fedprism.kernels.fused`) run LeNet-5-style ``Conv2d -> ReLU -> MaxPool2d(2)`` blocks on a CPU
in float32, 2-3x as fast as PyTorch's layers there; their C++ libraries are built once per machine
(`fedprism.kernels.build`; ``fedprism kernels build`` / ``status``; ``bash bootstrap.sh`` builds them at
set-up and goes on without them if that fails). Nothing else in fedprism needs them: the engines run
PyTorch's kernels (``aten``) wherever these are not used.

A run's kernels are part of its identity, because they change its numbers at float32 rounding. So a
configuration's kernel keys are resolved to the kernels that will actually run BEFORE its run id is
computed (`resolve`, called by `fedprism.experiment.config.resolve`):

* ``aten`` stays ``aten`` (every stored run made before the kernels, and the left-out key, hash as before);
* ``auto`` (the default) is ``fused`` where the library is built for this machine and the run is on a CPU,
  else ``aten`` with a one-line note (once per process); ``$FEDPRISM_KERNELS=aten`` pins it to ``aten``;
* ``fused`` asked explicitly is built if needed; where it cannot run (no compiler, a failed build, a CUDA
  device) the run is ``aten``, with a warning that says why, and is stored as the ``aten`` run it is, never
  under the ``fused`` run's id.

`fedprism.experiment.config.prefer_stored` adds one rule for ``auto`` (docs/reproducibility.md): where the
store already holds the run with PyTorch's kernels (e.g. a committed run), ``auto`` takes that run instead
of starting a fused one.
"""

from __future__ import annotations

import os
import sys
import warnings

from fedprism.errors import ConfigError
from fedprism.kernels.build import LIBRARIES, built, load, unavailable_reason

#: what `train.kernels` may be after resolution (and what an engine's `LocalConfig.train_kernels` takes)
KERNELS = ("aten", "fused")
#: what a configuration may ask for (`train.kernels`, `eval.kernels`): the concrete kernels, or `auto`
CHOICES = ("auto", *KERNELS)
#: the environment variable that pins `auto` to `aten` (e.g. a machine that must match stored aten runs)
PIN = "FEDPRISM_KERNELS"

_said: set[str] = set()         # the notes printed in this process (each once)


def _note(text: str) -> None:
    if text not in _said:
        _said.add(text)
        print(f"fedprism: {text}", file=sys.stderr, flush=True)


def on_cuda(device: str) -> bool:
    """Whether a run with `device` (``auto``, ``cpu``, ``cuda``) runs on a CUDA device, where the CPU
    kernels do not apply (`fedprism.engine.resolve_device`'s rule for ``auto``)."""
    if device == "auto":
        import torch

        return torch.cuda.is_available()
    return str(device).startswith("cuda")


def resolve(key: str, requested: str, device: str = "cpu") -> str:
    """The kernels that a run asking for `key` = `requested` (`CHOICES`) runs on this machine with
    `device`: ``aten`` or ``fused``, never ``auto`` and never kernels that cannot run here. A request that
    cannot be met warns, naming the reason and what runs instead; ``auto`` that resolves to ``aten`` on a
    CPU prints a one-line note."""
    if requested == "aten":
        return "aten"
    pin = os.environ.get(PIN, "")
    if pin not in ("", "aten"):
        raise ConfigError(PIN, pin, "aten (train.kernels / eval.kernels = auto then resolve to PyTorch's "
                          "kernels) or unset", kind="environment variable")
    cuda = on_cuda(device)
    if requested == "auto":
        if cuda or pin == "aten":
            return "aten"
        if built("fused") and load("fused"):
            return "fused"
        why = unavailable_reason("fused")
        _note(f"kernels: auto runs PyTorch's (aten): the fused CPU kernels are "
              + (f"unavailable here ({why})" if why else "not built for this machine (`fedprism kernels build`)"))
        return "aten"
    if cuda:
        warnings.warn(f"{key}={requested}: a CPU kernel, and this run is on a CUDA device; it runs PyTorch's "
                      f"kernels and is stored as {key}=aten", stacklevel=3)
        return "aten"
    if not load("fused"):
        warnings.warn(f"{key}={requested}: the fused kernels are unavailable ({unavailable_reason('fused')}); "
                      f"the run uses PyTorch's kernels and is stored as {key}=aten", stacklevel=3)
        return "aten"
    return requested


__all__ = ["CHOICES", "KERNELS", "LIBRARIES", "PIN", "built", "load", "on_cuda",
           "resolve", "unavailable_reason"]
