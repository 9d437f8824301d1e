"""The shared-split cache of `StreamScorer`: rows that are one model on that split are run once.

Penultimate features never read the head, so a stream of features whose rows differ only in their heads
(GPFL: a shared body under personal heads) is one model; equal rows (FedEM's components, the same for every
client) are one model too. The scores of a many-client call must be those of scoring each client alone, and
the engine must see one row where the clients share one."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_fedpac_gpfl_fedem import tiny

from fedprism.algorithms.fedem import FedEM
from fedprism.algorithms.gpfl import GPFL
from fedprism.engine import SequentialEngine
from fedprism.engine.vectorized import VectorizedEngine
from fedprism.experiment.evaluate import StreamScorer
from fedprism.experiment.runner import Simulator


class Counting:
    """The engine, counting the model rows it runs on shared inputs (the features' width probe on two samples
    aside)."""

    def __init__(self, engine):
        self._e, self.rows = engine, 0

    def __getattr__(self, name):
        return getattr(self._e, name)

    def logits(self, params, x):
        self.rows += len(params)
        return self._e.logits(params, x)

    def features(self, params, x):
        self.rows += len(params) if len(x) > 2 else 0
        return self._e.features(params, x)


@pytest.mark.parametrize("engine", [SequentialEngine, VectorizedEngine])
@pytest.mark.parametrize("cls,hp", [(GPFL, {}), (FedEM, {"m": 2})])
def test_shared_rows_run_once_and_score_as_each_client_alone(digits, engine, cls, hp):
    algo, eng = tiny(digits, cls, engine=engine, sizes=(30, 45, 20, 25), **hp)
    sim = Simulator(algo, eng)
    sim.round(0, np.array([0, 2]))                     # clients 0 and 2 now hold their own heads / weights
    clients = np.arange(4)
    inf = sim.inference(clients)
    if cls is GPFL:                                    # the rows differ, in the head only
        rows = inf.streams["features"]
        assert not torch.equal(rows[0], rows[1])
        body = torch.ones(rows.shape[1], dtype=torch.bool)
        body[eng.spec.head] = False
        assert torch.equal(rows[0, body], rows[1, body])
    counting = Counting(eng)
    together = StreamScorer(counting, 4)(inf, clients, "global")
    assert counting.rows == len(inf.streams)          # one row a stream: the shared body / each component
    for c in clients:
        alone = StreamScorer(eng, 4)(sim.inference(np.array([c])), np.array([c]), "global")
        assert together.correct[c] == alone.correct[0]
        assert together.loss_sum[c] == alone.loss_sum[0]
        assert torch.equal(together.confusion[c], alone.confusion[0])
