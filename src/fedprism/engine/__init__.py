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


#: on CPU, `engine=auto` keeps the sequential loop for models at least this large: their per-client
#: GEMMs already fill a core, and vmap only adds traffic over the stacked weights (`bench/README.md, "engine_choice"`,
#: 2026-11-26, one thread: the 8 M-parameter Clust-PSI-PFL FMNIST CNN trains 1.45x and scores 1.30x faster
#: in the loop; the 62 k-parameter LeNet-5 is even). 1 M is a round number between the two measured sizes.
AUTO_SEQUENTIAL_PARAMS_CPU = 1_000_000


def make_engine(name: str, fed, model, cfg: LocalConfig, seed: int, device: str = "auto",
                compile: str | bool = "auto", rounds: int = 1, fuse_jobs: str | bool = "auto",
                cuda_graphs: str | bool = "auto") -> EngineBase:
    """Build an engine. `auto`: vectorized on GPU, and on CPU when its kernels are compiled (long
    runs) and the model has fewer than `AUTO_SEQUENTIAL_PARAMS_CPU` parameters; otherwise the sequential
    loop, which is faster than an eager vmap, and than a compiled one for large models, on CPU; and the
    loop for a model vmap cannot batch (recurrent layers, `vectorized.unvmappable`), on any device. The
    engine changes how a run executes, not its run id. `fuse_jobs` (auto: on CUDA only) and `cuda_graphs`
    (auto: on for compiled CUDA runs) are the vectorized engine's options of those names."""
    dev = resolve_device(device)
    size = sum(p.numel() for p in model.parameters())
    if name == "auto" and dev == "cpu" and size >= AUTO_SEQUENTIAL_PARAMS_CPU:
        return SequentialEngine(fed, model, cfg, seed, dev)
    if cuda_graphs in (True, "true") and dev == "cpu":
        raise ConfigError("cuda_graphs", cuda_graphs, "auto or false on a CPU device (true needs CUDA)")
    if name in ("auto", "vectorized"):
        try:
            from fedprism.engine.vectorized import VectorizedEngine, unvmappable
        except ImportError:
            if name == "vectorized":
                raise
        else:
            if name == "auto" and unvmappable(model, cfg.train_precision):   # the loop runs them
                return SequentialEngine(fed, model, cfg, seed, dev)
            def flag(v):
                return None if v in ("auto", None) else v in (True, "true")

            eng = VectorizedEngine(fed, model, cfg, seed, dev, compile=compile, rounds=rounds,
                                   fuse_jobs=flag(fuse_jobs), cuda_graphs=flag(cuda_graphs))
            # On CPU an uncompiled vmap is slower than the plain loop:
            # `auto` keeps the vectorized engine only where it pays.
            if name == "vectorized" or eng.compiled or dev != "cpu":
                return eng

    if name in ("auto", "sequential"):
        return SequentialEngine(fed, model, cfg, seed, dev)
    raise ConfigError("engine", name, "auto, sequential or vectorized")


__all__ = ["AUTO_SEQUENTIAL_PARAMS_CPU", "EngineBase", "LocalConfig", "SequentialEngine", "make_engine",
           "resolve_device"]
