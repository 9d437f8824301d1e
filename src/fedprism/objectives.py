"""Local objectives `loss(f, flat, x, y, weight, extras) -> scalar`, written once for both engines.

`f(flat, x)` gives logits; `weight` [B] is 1 for real samples and 0 for padding (the vectorized engine
pads the last batch); `extras` holds this client's row of `Plan.extras`. Every objective must be
vmap-safe (no data-dependent Python control flow).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

Objective = Callable[..., torch.Tensor]


def _ce(f, flat, x, y, weight):
    losses = F.cross_entropy(f(flat, x), y, reduction="none")
    return (losses * weight).sum() / weight.sum().clamp(min=1.0)


def ce(f, flat, x, y, weight, extras):
    """Plain cross-entropy (FedAvg, Local, Fed-PRISM clients)."""
    return _ce(f, flat, x, y, weight)


def prox(f, flat, x, y, weight, extras):
    """Cross-entropy + (mu/2)||w - anchor||^2 (FedProx, FedAMP with anchor u_i, Ditto)."""
    d = flat - extras["anchor"]
    return _ce(f, flat, x, y, weight) + 0.5 * extras["mu"] * (d * d).sum()


OBJECTIVES: dict[str, Objective] = {"ce": ce, "prox": prox}
