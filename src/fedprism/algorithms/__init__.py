"""Federated algorithms: one module per method, all on the interface in `base`.

Methods from other packages register through the `fedprism.methods` entry-point group
(`fedprism.plugins`); `REGISTRY` then holds them beside the built-in ones.
"""

from fedprism.algorithms.base import REGISTRY, Algorithm, ClientState, Context, EvalResult, Inference, Plan, \
    TensorSpec, TrainJob, Update, register, train_update

from fedprism.algorithms import cfl, fedamp, fedavg, fedclust, fedprism, fedprism_dual, ifca, local  # noqa: F401,E402 (registers)

__all__ = ["REGISTRY", "Algorithm", "ClientState", "Context", "EvalResult", "Inference", "Plan", "TensorSpec",
           "TrainJob", "Update", "register", "train_update"]
