"""Hand-computed server steps of fedprism_dual (FedPrism paper, Algorithm 2): the cluster moving average
(line 17), the global step (line 10) and the alpha update with its choice of k* (lines 27-31)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedprism.algorithms.fedprism_dual import FedPrismDual
from fedprism.experiment.config import resolve
from fedprism.experiment.runner import make_context
from fedprism.models import build_model
from fedprism.params import ParamSpec
from fedprism.protocol import Update


def algo(**hp):
    model = build_model("mlp", (4,), 3, seed=0)
    cfg = resolve({"method": "fedavg", "dataset": "digits", "clients": 3, "seed": 0})
    ctx = make_context(cfg, model, np.array([10, 30, 60]), np.ones((3, 3), dtype=np.int64))
    ctx.spec = ParamSpec.of(model)
    return FedPrismDual(ctx, k=2, warmup=1000, **hp)          # no re-clustering in these rounds


def test_cluster_moving_average_global_step_and_alpha_by_hand():
    a = algo(cluster_lr=0.5, alpha_lr=0.2, alpha_signal="relative", global_weighting="samples")
    P = a.ctx.spec.size
    st = a.init_state()
    st["w_g"] = torch.zeros(P)
    st["w_c"] = torch.stack([torch.full((P,), 1.0), torch.full((P,), -1.0)])
    st["W"][:] = torch.tensor([[0.75, 0.25], [0.25, 0.75], [0.5, 0.5]], dtype=torch.float64)
    st["alpha"][:] = torch.tensor([0.5, 0.8, 0.3], dtype=torch.float64)
    clients = np.array([0, 1])
    Wp = torch.stack([torch.full((P,), 2.0), torch.full((P,), -3.0)])          # the returned W'_i
    up = Update(clients, {"params": Wp}, torch.tensor([10.0, 30.0], dtype=torch.float64))
    rec = a.aggregate(st, 5, up)
    # line 10: G = sum n_i/N W'_i = (10*2 + 30*(-3)) / 40 = -1.75
    assert torch.allclose(st["w_g"], torch.full((P,), -1.75))
    # line 17: C_k <- C_k + 0.5 (sum_i w_ik W'_i / Z_k - C_k)
    m0 = (0.75 * 2 + 0.25 * -3) / 1.0            # = 0.75
    m1 = (0.25 * 2 + 0.75 * -3) / 1.0            # = -1.75
    assert torch.allclose(st["w_c"][0], torch.full((P,), 1.0 + 0.5 * (m0 - 1.0)))
    assert torch.allclose(st["w_c"][1], torch.full((P,), -1.0 + 0.5 * (m1 + 1.0)))
    # lines 27-31: k* = argmax of the row used this round; G and C_k* before this round's step
    s = np.sqrt(P)
    d_c0, d_g0 = abs(2 - 1.0) * s, abs(2 - 0.0) * s          # client 0: k* = 0 (0.75 > 0.25)
    d_c1, d_g1 = abs(-3 + 1.0) * s, abs(-3 - 0.0) * s        # client 1: k* = 1
    sig = np.array([(d_c0 - d_g0) / (d_c0 + d_g0), (d_c1 - d_g1) / (d_c1 + d_g1)])
    want = np.clip(np.array([0.5, 0.8]) + 0.2 * sig, 0, 1 - 0.1)
    assert np.allclose(st["alpha"][:2].numpy(), want) and st["alpha"][2] == 0.3      # unsampled: unchanged
    assert rec["alpha"]["cluster"].tolist() == [0, 1]
    assert np.allclose(rec["alpha"]["signal"], sig.round(6))


def test_alpha_is_clipped_to_one_minus_beta_and_raw_signal():
    a = algo(alpha_lr=10.0, alpha_signal="raw", beta=0.2, alpha=0.7)
    P = a.ctx.spec.size
    st = a.init_state()
    st["w_g"], st["w_c"] = torch.zeros(P), torch.full((2, P), 5.0)
    up = Update(np.array([2]), {"params": torch.zeros(1, P)}, torch.tensor([60.0], dtype=torch.float64))
    a.aggregate(st, 3, up)                       # ||W' - C|| - ||W' - G|| = 5 sqrt(P) > 0: alpha up
    assert st["alpha"][2].item() == pytest.approx(0.8)      # clipped at 1 - beta
    st["w_c"] = torch.zeros(2, P)
    st["w_g"] = torch.full((P,), 5.0)
    a.aggregate(st, 4, up)
    assert st["alpha"][2].item() == 0.0                     # clipped at 0


def test_relative_alpha_signal_is_zero_when_the_model_did_not_move():
    # W' = G = C_k: both distances are 0, the relative signal 0 / 0 is taken as 0 and alpha stays
    a = algo(alpha_lr=0.2, alpha_signal="relative", alpha=0.4)
    P = a.ctx.spec.size
    st = a.init_state()
    up = Update(np.array([1]), {"params": st["w_g"][None].clone()}, torch.tensor([30.0], dtype=torch.float64))
    rec = a.aggregate(st, 3, up)
    assert st["alpha"][1].item() == 0.4 and rec["alpha"]["signal"].tolist() == [0.0]


def test_routing_rules_by_hand():
    from fedprism.algorithms.fedprism_dual import combine, route

    z_e = torch.tensor([[[4.0, 0.0, 0.0], [0.0, 0.1, 0.0]]])          # [m=1, B=2, C=3]
    z_b = torch.tensor([[[0.0, 0.0, 3.0], [0.0, 2.0, 0.0]]])
    seen = torch.tensor([[1.0, 0.0, 0.0]])                              # the client has class 0 only
    prior = torch.tensor([[0.8, 0.1, 0.1]])
    ex = {"seen": seen, "prior": prior}
    # confidence = the paper's Eq. 2
    assert torch.allclose(combine("confidence", z_e, z_b, ex, 5.0), route(z_e, z_b, None, 5.0))
    # seen_mass: lambda = backbone probability of class 0
    pb = torch.softmax(z_b, -1)
    lam = pb[..., :1]
    assert torch.allclose(combine("seen_mass", z_e, z_b, ex, 1.0), lam * z_e + (1 - lam) * z_b)
    assert lam[0, 0, 0] < 0.05 and lam[0, 1, 0] < 0.15          # inputs the backbone calls unseen go to it
    # margin: top-1 minus top-2 of softmax(z_e / T)
    p = torch.softmax(z_e / 2.0, -1)
    top = p.sort(-1, descending=True).values
    m = top[..., :1] - top[..., 1:2]
    assert torch.allclose(combine("margin", z_e, z_b, ex, 2.0), m * z_e + (1 - m) * z_b)
    # prior: log p_B + log p_L - log pi
    want = torch.log_softmax(z_b, -1) + torch.log_softmax(z_e, -1) - torch.log(prior)[:, None, :]
    assert torch.allclose(combine("prior", z_e, z_b, ex, 1.0), want)


def test_alpha_as_printed_uses_raw_delta_with_c_k_and_clips_to_one():
    a = algo(alpha_rule="as_printed", alpha_lr=0.01, alpha=0.85, beta=0.1)
    P = a.ctx.spec.size
    st = a.init_state()
    st["w_g"] = torch.zeros(P)
    st["w_c"] = torch.stack([torch.full((P,), 3.0), torch.full((P,), 1.0)])      # C_K = C_2 = 1
    st["W"][:] = torch.tensor([[0.9, 0.1]] * 3, dtype=torch.float64)             # top cluster would be C_1
    up = Update(np.array([0]), {"params": torch.full((1, P), 2.0)}, torch.tensor([10.0], dtype=torch.float64))
    a.aggregate(st, 2, up)
    s = np.sqrt(P)
    delta = abs(2 - 1.0) * s - abs(2 - 0.0) * s                 # raw, with C_K: -sqrt(P)
    assert st["alpha"][0].item() == pytest.approx(float(np.clip(0.85 + 0.01 * delta, 0, 1)))
    st["alpha"][1] = 0.97                                         # above 1 - beta: allowed as printed
    g = a.mixing(st["alpha"][1:2])[2]
    assert g.item() == pytest.approx(1 - 0.97 - 0.1)              # gamma negative
    assert algo().mixing(torch.tensor([0.97], dtype=torch.float64))[2].item() == 0.0    # the reading clamps
