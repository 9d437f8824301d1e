"""Federated algorithms: one module per method, all on the interface in `base`.

Every module of this package is imported here, so a method module registers itself (`@register`) by
existing. Methods from other packages register through the `fedprism.methods` entry-point group
(`fedprism.plugins`); `REGISTRY` then holds them beside the built-in ones.
"""

import importlib
import pkgutil

from fedprism.algorithms.base import REGISTRY, Algorithm, ClientState, Context, EvalResult, Inference, Plan, \
    TensorSpec, TrainJob, Update, register, train_update

for _m in pkgutil.iter_modules(__path__):
    if _m.name not in ("base", "aggregation"):
        importlib.import_module(f"{__name__}.{_m.name}")

__all__ = ["REGISTRY", "Algorithm", "ClientState", "Context", "EvalResult", "Inference", "Plan", "TensorSpec",
           "TrainJob", "Update", "register", "train_update"]
