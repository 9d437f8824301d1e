"""Server math written once: client weights, weighted means, the soft cluster step, personalisation.

Every method that averages uses these, so the same quantity is computed the same way (float64
accumulation, then one rounding to the parameters' dtype) everywhere.
"""

from __future__ import annotations

import torch

from fedprism.protocol import Update

WEIGHTINGS = ("samples", "uniform")


def client_weights(update: Update, how: str = "samples") -> torch.Tensor:
    """[n] float64 aggregation weights: n_k (`samples`, FedAvg's n_k / N_t once normalised) or 1 (`uniform`)."""
    if how == "samples":
        return update.n_samples.to(torch.float64)
    if how == "uniform":
        return torch.ones(len(update.clients), dtype=torch.float64)
    raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {how!r}")


def weighted_sum(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum_k (w_k / sum w) x_k over rows, in float64 (not rounded). w must sum > 0."""
    w64 = w.to(torch.float64)
    s = w64.sum()
    if not s > 0:
        raise ValueError("weights sum to zero; the caller must keep the previous value")
    return (w64 / s) @ x.to(torch.float64)


def weighted_mean(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum_k w_k x_k / sum_k w_k over rows, accumulated in float64, in x's dtype. w must sum > 0."""
    return weighted_sum(x, w).to(x.dtype)


def personalize(w_g: torch.Tensor, w_c: torch.Tensor, W: torch.Tensor, alpha: float | torch.Tensor,
                beta: float | torch.Tensor | None = None) -> torch.Tensor:
    """a w_g + b W @ w_c for a block of rows of W, float64 mixing (b = 1 - a unless given).

    `alpha` and `beta` may be per-row tensors [n]: the Fed-PRISM ensemble a w_g + (1 - a) sum_c W[i,c] w_c
    and the FedPrism paper's shared part a_i G + beta sum_k w_ik C_k are the same call.
    """
    mix = W.to(torch.float64) @ w_c.to(torch.float64)
    a = alpha.to(torch.float64)[:, None] if isinstance(alpha, torch.Tensor) else alpha
    if beta is None:
        b = 1 - a
    else:
        b = beta.to(torch.float64)[:, None] if isinstance(beta, torch.Tensor) else beta
    return (a * w_g.to(torch.float64) + b * mix).to(w_g.dtype)


def soft_cluster_step(w_c: torch.Tensor, W_S: torch.Tensor, vec: torch.Tensor, lr: float = 1.0,
                      toward: bool = False) -> torch.Tensor:
    """Soft-weighted cluster update, only for clusters with Z_c = sum_i W[i,c] > 0 (others bit-identical).

    toward=False: w_c += lr * (W_S^T vec) / Z          (vec = updates Delta: the Fed-PRISM server)
    toward=True : w_c += lr * ((W_S^T vec) / Z - w_c)   (vec = returned models: the FedPrism paper)
    """
    Z = W_S.to(torch.float64).sum(0)
    live = Z > 0
    if not live.any():
        return w_c
    mean = (W_S.to(torch.float64).T[live] @ vec.to(torch.float64)) / Z[live, None]
    out = w_c.clone()
    step = mean - w_c[live].to(torch.float64) if toward else mean
    out[live] = (w_c[live].to(torch.float64) + lr * step).to(w_c.dtype)
    return out
