"""FedSoft: importance estimation, the proximal anchor (S = 2) and the cluster update by hand, S = 1
reduces to FedProx (mu = lambda) averaged like FedAvg, smoothed importances stay positive, and an
end-to-end run."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedprism.algorithms.base import Update
from fedprism.algorithms.fedsoft import FedSoft, importance
from fedprism.experiment.config import resolve
from fedprism.experiment.runner import Experiment
from fedprism.experiment.store import Store
from fedprism.protocol import Context, Trained

TINY = dict(dataset="digits", model="mlp", clients=6, rounds=1, fraction=1.0, local_epochs=1, lr=0.05,
            engine="sequential", seed=1)


class _Trainer:
    """Four samples of classes (0, 1, 1, 0); 'cluster model' s outputs fixed logits per sample."""

    def data(self, client, split):
        return torch.arange(4.0)[:, None], torch.tensor([0, 1, 1, 0])

    def logits(self, params, x):
        # model 0 is right on samples 0, 1, 2; model 1 is right on sample 3 only; params[s, 0] = s
        right0 = torch.tensor([[5.0, 0], [0, 5.0], [0, 5.0], [0, 5.0]])
        right3 = torch.tensor([[0, 5.0], [5.0, 0], [5.0, 0], [5.0, 0]])
        return torch.stack([right0 if float(p[0]) == 0 else right3 for p in params])[:, : len(x)]


def test_importance_counts_the_best_fitting_model_per_sample():
    c = torch.tensor([[0.0], [1.0]])
    assert importance(_Trainer(), 0, c, 1e-4).tolist() == [0.75, 0.25]
    three = torch.tensor([[0.0], [1.0], [2.0]])                 # model 2 fits no sample: smoothed, > 0
    u = importance(_Trainer(), 0, three, 1e-4)
    assert u.tolist() == pytest.approx([0.75, 0.25, 1e-4]) and bool((u > 0).all())


class _Spy(_Trainer):
    """`_Trainer` that also trains: it records each TrainJob and returns start + 1 for every row."""

    def __init__(self):
        self.jobs = []

    def train(self, job, rnd):
        self.jobs.append(job)
        n = len(job.clients)
        return Trained(job.clients, job.start + 1, torch.full((n,), 4.0, dtype=torch.float64),
                       torch.zeros(n, dtype=torch.float64))


def test_local_training_is_prox_to_the_importance_weighted_clusters():
    """S = 2, by hand: client k trains from its own w_k towards cbar_k = sum_s u_ks c_s / sum_s u_ks with
    mu_k = lambda sum_s u_ks (Eq. 4). Round 1 (tau = 2): client 0 has never estimated, so it estimates
    u_0 = (0.75, 0.25) (`_Trainer`: model 0 fits 3 of its 4 samples); clients 1 and 2 keep their stored
    u_k, client 2's smoothed (sum 1.25)."""
    ctx = Context(num_clients=3, num_classes=2, spec=None, init=torch.zeros(2), n_train=np.full(3, 4),
                  label_hist=np.ones((3, 2)), seed=0, rounds=2, fraction=1.0)
    algo = FedSoft(ctx, k=2, lam=0.1, tau=2)
    c = torch.tensor([[0.0, 4.0], [2.0, 8.0]])                  # c_0 is model 0 of `_Trainer`, c_1 model 1
    plan = algo.plan({"c": c}, 1, np.arange(3))
    w = torch.tensor([[9.0, 9.0], [-1.0, 3.0], [5.0, -5.0]])
    cstate = {"w": w, "u": torch.tensor([[0.0, 0.0], [0.5, 0.5], [1.0, 0.25]])}
    spy = _Spy()
    up = algo.client_update(plan, spy, 1, cstate)
    (job,) = spy.jobs
    assert job.loss == "prox" and torch.equal(job.start, w)                     # from w_k, not a cluster
    # 0.75 c_0 + 0.25 c_1;  0.5 c_0 + 0.5 c_1;  (c_0 + 0.25 c_1) / 1.25
    assert torch.allclose(job.extras["anchor"], torch.tensor([[0.5, 5.0], [1.0, 6.0], [0.4, 4.8]]))
    assert torch.allclose(job.extras["mu"], torch.tensor([0.1, 0.1, 0.125]))
    assert torch.allclose(up.payload["u"], torch.tensor([[0.75, 0.25], [0.5, 0.5], [1.0, 0.25]]))
    assert torch.equal(up.params, w + 1) and torch.equal(up.client_state["w"], w + 1)
    assert torch.equal(up.client_state["u"], up.payload["u"])


def test_cluster_update_is_the_importance_weighted_mean():
    ctx = Context(num_clients=3, num_classes=2, spec=None, init=torch.zeros(2), n_train=np.array([10, 30, 60]),
                  label_hist=np.ones((3, 2)), seed=0, rounds=1, fraction=1.0)
    algo = FedSoft.__new__(FedSoft)
    algo.ctx, algo.hp = ctx, {"k": 2, "lam": 0.1, "sigma": 1e-4, "tau": 2}
    state = {"c": torch.zeros(2, 2)}
    w = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0]])
    u = torch.tensor([[1.0, 0.0], [0.5, 0.5], [0.0, 1.0]])
    up = Update(np.arange(3), {"params": w, "u": u}, torch.tensor([10.0, 30.0, 60.0], dtype=torch.float64))
    algo.aggregate(state, 0, up)
    # cluster 0: weights 10 * 1, 30 * 0.5 -> (10 w0 + 15 w1) / 25; cluster 1: 15 w1 + 60 w2 over 75
    assert torch.allclose(state["c"][0], torch.tensor([0.4, 0.6]))
    assert torch.allclose(state["c"][1], torch.tensor([1.6, 1.8]))


def test_one_source_is_fedprox_averaged_like_fedavg(tmp_path):
    """S = 1: u = 1, the anchor is c_1 = the initial model = every w_k's start, mu = lambda: one round of
    FedSoft is one round of FedProx with mu = lambda, bit for bit."""
    soft = Experiment(resolve({**TINY, "method": "fedsoft", "fedsoft.k": 1, "fedsoft.lam": 0.1}), Store(tmp_path / "a.db"))
    soft.run()
    prox = Experiment(resolve({**TINY, "method": "fedprox", "fedprox.mu": 0.1}), Store(tmp_path / "b.db"))
    prox.run()
    assert torch.equal(soft.state["c"][0], prox.state["w"])
    other = Experiment(resolve({**TINY, "method": "fedprox", "fedprox.mu": 0.5}), Store(tmp_path / "c.db"))
    other.run()
    assert not torch.equal(soft.state["c"][0], other.state["w"])


def test_fedsoft_learns_and_keeps_personal_models(tmp_path):
    """Dirichlet 0.3, 4 rounds: the personal models w_k keep about Local's fit to their own data (measured
    local_acc: FedSoft 0.592, Local 0.603 = FedSoft with lam = 0, FedAvg 0.176; FedSoft need not beat Local
    here), importances sum to 1 and are recorded every round."""
    cfg = resolve({**TINY, "method": "fedsoft", "rounds": 4, "clients": 8, "fraction": 0.5, "partition.alpha": 0.3})
    exp = Experiment(cfg, Store(tmp_path / "r.db"))
    res = exp.run()
    assert res.status == "finished" and res.final["local_acc"] > 0.55     # 10 classes; 2 local epochs each
    u = exp.clients.data["u"]
    trained = u.sum(1) > 0
    assert bool(trained.any()) and torch.allclose(u[trained].sum(1), torch.ones(int(trained.sum())), atol=1e-3)
    recs = Store(tmp_path / "r.db").records(res.run_id, "fedsoft_importance")
    assert len(recs) == 4
