"""Federated algorithms: one module per method, all on the interface in `base`.

A method module `x.py` holds the method `x` and registers itself (`@register`) when it is imported.
Nothing here imports them: `REGISTRY["x"]` imports `fedprism.algorithms.x` the first time `x` is named,
so a run imports the one method it uses, and `REGISTRY.names()` lists every method without importing
any (`fedprism.registry`). `base.SHARED_MODULES` names the modules of shared code. Methods from other
packages register through the `fedprism.methods` entry-point group or `register`; `REGISTRY` then holds
them beside the built-in ones.
"""

from fedprism.algorithms.base import REGISTRY, Algorithm, ClientState, Context, EvalResult, Inference, Plan, \
    TensorSpec, TrainJob, Update, register, train_update

__all__ = ["REGISTRY", "Algorithm", "ClientState", "Context", "EvalResult", "Inference", "Plan", "TensorSpec",
           "TrainJob", "Update", "register", "train_update"]
