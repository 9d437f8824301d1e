"""Engines run client work: `sequential` (the reference) and `vectorized` (many clients at once)."""

from __future__ import annotations

import torch

from fedprism.engine.base import EngineBase, LocalConfig
from fedprism.engine.sequential import SequentialEngine
from fedprism.errors import ConfigError


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", device, "cpu or auto (no CUDA device is available here)")
    return device


def make_engine(name: str, fed, model, cfg: LocalConfig, seed: int, device: str = "auto",
                compile: str | bool = "auto", rounds: int = 1) -> EngineBase:
    """Build an engine. `auto`: vectorized on GPU, and on CPU when its kernels are compiled (long
    runs); otherwise the sequential loop, which is faster than an eager vmap on CPU."""
    dev = resolve_device(device)
    if name in ("auto", "vectorized"):
        try:
            from fedprism.engine.vectorized import VectorizedEngine
        except ImportError:
            if name == "vectorized":
                raise
        else:
            eng = VectorizedEngine(fed, model, cfg, seed, dev, compile=compile, rounds=rounds)
            # On CPU an uncompiled vmap is slower than the plain loop:
            # `auto` keeps the vectorized engine only where it pays.
            if name == "vectorized" or eng.compiled or dev != "cpu":
                return eng

    if name in ("auto", "sequential"):
        return SequentialEngine(fed, model, cfg, seed, dev)
    raise ConfigError("engine", name, "auto, sequential or vectorized")


__all__ = ["EngineBase", "LocalConfig", "SequentialEngine", "make_engine", "resolve_device"]
