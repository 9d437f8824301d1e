"""Layer-wise Relevance Propagation for ReLU multi-layer perceptrons.

Bach, Binder, Montavon, Klauschen, Mueller, Samek 2015, "On Pixel-Wise Explanations for Non-Linear
Classifier Decisions by Layer-Wise Relevance Propagation", PLOS ONE 10(7), doi:10.1371/journal.pone.0130140;
Montavon, Binder, Lapuschkin, Samek, Mueller 2019, "Layer-Wise Relevance Propagation: An Overview".

The network is a list of dense layers (W_l [out, in], b_l [out]); a_0 = x (flattened), a_l = ReLU(W_l a_{l-1}
+ b_l) for the hidden layers and the last layer's output is the logits (no ReLU). With z_ij = a_i w_ij (i a
neuron of the lower layer, j of the upper one) the rules redistribute an upper relevance R_j:

    alpha-beta:  R_i = sum_j ( alpha z_ij^+ / sum_i' z_i'j^+  -  beta z_ij^- / sum_i' z_i'j^- ) R_j,
                 alpha - beta = 1 (alpha = 1, beta = 0 is the original, conservative rule)
    epsilon:     R_i = sum_j z_ij / (z_j + eps sign(z_j)) R_j,   z_j = sum_i z_ij + b_j,  sign(0) = +1

Decisions: the alpha-beta denominators leave the bias out (so alpha = 1, beta = 0 conserves relevance
exactly: sum_i R_i = sum_j R_j for every upper neuron j with a positive contribution); an upper neuron whose
positive (negative) contributions sum to exactly 0 passes nothing through that term (no division by zero).
The output relevance is the caller's (`start`, [B, out]); `relevance` returns R_0 .. R_L, R_l [B, width of
a_l] (R_L = start).
"""

from __future__ import annotations

import torch

Layer = tuple[torch.Tensor, torch.Tensor]
RULES = ("alpha_beta", "epsilon")


def forward(layers: list[Layer], x: torch.Tensor) -> list[torch.Tensor]:
    """Activations a_0 .. a_L of a ReLU MLP on x [B, ...] (a_L: the logits, no ReLU)."""
    a = [x.reshape(x.shape[0], -1)]
    for l, (w, b) in enumerate(layers):
        z = a[-1] @ w.T + b
        a.append(z if l == len(layers) - 1 else torch.relu(z))
    return a


def _safe_div(r: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return torch.where(s != 0, r / torch.where(s != 0, s, torch.ones_like(s)), torch.zeros_like(r))


def propagate(w: torch.Tensor, b: torch.Tensor, a: torch.Tensor, r: torch.Tensor, rule: str = "alpha_beta",
              alpha: float = 1.0, beta: float = 0.0, eps: float = 1e-6) -> torch.Tensor:
    """Relevance of the lower layer [B, in] from the upper relevance r [B, out] through one dense layer
    (W [out, in], b [out]) whose input was a [B, in]."""
    if rule == "epsilon":
        z = a @ w.T + b
        s = r / (z + eps * torch.where(z >= 0, torch.ones_like(z), -torch.ones_like(z)))
        return a * (s @ w)
    if rule != "alpha_beta":
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    if abs(alpha - beta - 1.0) > 1e-12:
        raise ValueError(f"alpha - beta must be 1, got alpha={alpha}, beta={beta}")
    ap, an = a.clamp(min=0), a.clamp(max=0)
    wp, wn = w.clamp(min=0), w.clamp(max=0)
    # z_ij^+ = a_i^+ w_ij^+ + a_i^- w_ij^-,  z_ij^- = a_i^+ w_ij^- + a_i^- w_ij^+
    sp = ap @ wp.T + an @ wn.T                                         # [B, out] sum_i z_ij^+
    sn = ap @ wn.T + an @ wp.T                                         # [B, out] sum_i z_ij^-
    qp, qn = _safe_div(r, sp), _safe_div(r, sn)
    pos = ap * (qp @ wp) + an * (qp @ wn)
    out = alpha * pos
    if beta:
        out = out - beta * (ap * (qn @ wn) + an * (qn @ wp))
    return out


def relevance(layers: list[Layer], acts: list[torch.Tensor], start: torch.Tensor, rule: str = "alpha_beta",
              alpha: float = 1.0, beta: float = 0.0, eps: float = 1e-6) -> list[torch.Tensor]:
    """R_0 .. R_L for the activations `acts` of `forward` and the output relevance `start` [B, out]."""
    rel = [start]
    for l in range(len(layers) - 1, -1, -1):
        w, b = layers[l]
        rel.append(propagate(w, b, acts[l], rel[-1], rule, alpha, beta, eps))
    return rel[::-1]
