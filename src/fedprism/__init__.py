"""fedprism: personalized federated learning under non-IID data.

Fed-PRISM (global + K cluster models, soft top-m assignment, personalized ensembles), the FedPrism
paper's dual-stream method and their baselines, on flat parameter vectors, with a vectorized engine and
a SQLite results store. The public API (imported lazily; importing `fedprism` changes no process-wide
setting):

    run, config, results                       fedprism.api
    Config, Experiment, RunResult, Store       the configuration, the round loop, the results store
    Algorithm, register, REGISTRY              the method interface (fedprism.algorithms.base)
    Plan, Update, TrainJob, Inference, ClientState, TensorSpec, Context    its types (fedprism.protocol)
    TrainSettings, Trained                     the training settings (ctx.train) and a job's result
    register_model, register_dataset,          extensions in-process (fedprism.plugins)
    register_partition
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_API = {
    "run": "fedprism.api", "config": "fedprism.api", "results": "fedprism.api",
    "Config": "fedprism.experiment.config", "Experiment": "fedprism.experiment.runner",
    "RunResult": "fedprism.experiment.result", "Simulator": "fedprism.experiment.runner",
    "Store": "fedprism.experiment.store",
    "Algorithm": "fedprism.algorithms.base", "register": "fedprism.algorithms.base",
    "REGISTRY": "fedprism.algorithms.base", "train_update": "fedprism.algorithms.base",
    "Plan": "fedprism.protocol", "Update": "fedprism.protocol", "TrainJob": "fedprism.protocol",
    "Inference": "fedprism.protocol", "ClientState": "fedprism.protocol", "TensorSpec": "fedprism.protocol",
    "Context": "fedprism.protocol", "EvalResult": "fedprism.protocol", "TrainSettings": "fedprism.protocol",
    "Trained": "fedprism.protocol",
    "register_model": "fedprism.plugins", "register_dataset": "fedprism.plugins",
    "register_partition": "fedprism.data.partitions",
}

__all__ = ["__version__", *_API]


def __getattr__(name: str) -> Any:
    if name in _API:
        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'fedprism' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
