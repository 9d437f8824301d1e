"""Federated algorithms: one module per method, all on the interface in `base`."""

from fedprism.algorithms.base import REGISTRY, Algorithm, Context, EvalResult, Plan, Update, register

from fedprism.algorithms import cfl, fedamp, fedavg, fedclust, fedprism, fedprism_dual, ifca, local  # noqa: F401 (registers)

__all__ = ["REGISTRY", "Algorithm", "Context", "EvalResult", "Plan", "Update", "register"]
