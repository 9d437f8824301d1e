"""Federated algorithms: one module per method, all on the interface in `base`."""

from fedprism.algorithms.base import REGISTRY, Algorithm, Context, EvalResult, Plan, Update, register

from fedprism.algorithms import fedavg, fedclust, fedprism, local  # noqa: F401  (registration)

__all__ = ["REGISTRY", "Algorithm", "Context", "EvalResult", "Plan", "Update", "register"]
