"""Facts about this machine that several layers need: where fedprism keeps what it can make again
(downloaded datasets, `fedprism.data.download`; the CPU kernels built for this machine,
`fedprism.kernels`) and the CPU's feature flags (the kernels' build key, `fedprism.engine.base.native_bf16`).
A bottom layer: it imports nothing of fedprism, so each of those can use it without depending on another."""

from __future__ import annotations

import functools
import os
from pathlib import Path


def cache_root() -> Path:
    """Root of fedprism's caches: ``$FEDPRISM_CACHE`` if set, else ``~/.cache/fedprism``."""
    env = os.environ.get("FEDPRISM_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fedprism"


@functools.cache
def cpu_flags() -> tuple[str, ...] | None:
    """The CPU's feature flags (the `flags` line of /proc/cpuinfo), None where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith("flags")), None)
    except OSError:
        return None
    return None if line is None else tuple(line.split(":", 1)[-1].split())


__all__ = ["cache_root", "cpu_flags"]
