"""The centralised reference (CL of Clust-PSI-PFL, arXiv:2512.20363): pooled minibatch training."""

from __future__ import annotations

import numpy as np
import torch

from fedprism.engine.base import LocalConfig
from fedprism.engine.sequential import SequentialEngine
from fedprism.federation import Federation
from fedprism.models import build_model
from fedprism.params import flatten
from fedprism.protocol import TrainJob


def test_pooled_training_is_one_client_holding_all_data(digits):
    rng = np.random.default_rng(0)
    perm = rng.permutation(len(digits.y_train))[:300]
    parts = [np.sort(p) for p in np.array_split(perm, 3)]
    test = [np.arange(10 * i, 10 * i + 10) for i in range(3)]
    args = (digits.x_train, digits.y_train, digits.x_test, digits.y_test)
    fed3 = Federation(*args, parts, test, digits.num_classes, list(digits.classes), "three")
    fed1 = Federation(*args, [np.concatenate(parts)], test[:1], digits.num_classes, list(digits.classes), "one")
    model = build_model("mlp", tuple(digits.x_train.shape[1:]), digits.num_classes, seed=0)
    cfg = LocalConfig(epochs=2, batch_size=16, lr=0.01, optimizer="adam")
    e3, e1 = SequentialEngine(fed3, model, cfg, 5), SequentialEngine(fed1, model, cfg, 5)
    start = flatten(model)
    pooled = e3.train_pooled(start, np.arange(3), 1, stream="train")
    single = e1.train(TrainJob(np.array([0]), start.unsqueeze(0)), 1)
    assert pooled.n_samples.tolist() == [300.0]
    assert torch.equal(pooled.params, single.params)                 # same batches, same steps, bit for bit
    assert not torch.equal(e3.train_pooled(start, np.arange(3), 2).params, pooled.params)


def test_centralised_run_is_evaluated_like_fedavg(tmp_path):
    from fedprism.experiment.runner import Experiment
    from fedprism.experiment.store import Store
    from fedprism.flower.settings import parse_experiment

    exp = ("method=centralised dataset=digits clients=6 rounds=2 fraction=0.5 local_epochs=1 lr=0.05 model=mlp "
           "device=cpu engine=sequential partition.alpha=0.1 seed=0")
    e = Experiment(parse_experiment(exp), Store(tmp_path / "c.db"))
    res = e.run()
    assert res.status == "finished"
    assert res.final["local_acc"] > 0.6 and res.final["global_acc"] > 0.6          # it learns from all classes
    rows = e.store.client_rows(res.run_id, 1)
    assert len(rows) == 6 and len({r["global_acc"] for r in rows}) == 1                 # one shared model
    assert e.store.round_metrics(res.run_id)[0]["train_loss"] > 0
