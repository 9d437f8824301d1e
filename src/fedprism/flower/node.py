"""What a SuperNode holds: its client's slice of the federation, a sequential engine and the algorithm.

Every node builds the federation from the same experiment config (dataset + partition + seed: the
partition is deterministic), keeps only its own client's train and local-test rows plus the public
global test set, and drops the rest. The algorithm object is built exactly as the in-process runner
builds it (`fedprism.experiment.runner.make_*`), so `algo.client_update(plan, engine, rnd)` here runs
the same code, on the same numbers, as the simulator's sequential engine.

No Flower import: this module is the ClientApp's payload and is unit-tested without Flower.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from fedprism.algorithms.base import Algorithm, EvalResult, Plan, Update
from fedprism.engine import resolve_device
from fedprism.engine.sequential import SequentialEngine
from fedprism.experiment import federation as _fedmod
from fedprism.experiment.config import Config
from fedprism.experiment.runner import local_config, make_algorithm, make_context, make_model
from fedprism.federation import Federation
from fedprism.flower.settings import parse_experiment


def client_slice(fed: Federation, client: int) -> Federation:
    """Client `client`'s train rows and local test split, plus the global test set; nothing else.

    Client ids keep their meaning (other clients hold no rows), so seeds derived from
    (seed, round, client) are those of the in-process run.
    """
    tr = torch.as_tensor(fed.train_idx[client], dtype=torch.long)
    empty = np.zeros(0, dtype=np.int64)
    train_idx = [empty] * fed.num_clients
    test_idx = [empty] * fed.num_clients
    train_idx[client] = np.arange(len(tr), dtype=np.int64)
    test_idx[client] = np.asarray(fed.test_idx[client], dtype=np.int64)
    return Federation(fed.x_train[tr].clone(), fed.y_train[tr].clone(), fed.x_test, fed.y_test, train_idx, test_idx,
                      fed.num_classes, list(fed.class_names), fed.name, dict(fed.meta))


@dataclass
class Node:
    cfg: Config
    client: int
    engine: SequentialEngine
    algo: Algorithm
    label_hist: np.ndarray        # this client's train label counts
    n_test: int
    input_shape: tuple[int, ...]
    num_classes: int

    @property
    def n_train(self) -> int:
        return int(self.label_hist.sum())

    def identity(self) -> dict:
        """What the node tells the server about itself (no raw data)."""
        return {"client-id": self.client, "config-id": self.cfg.run_id, "method": self.cfg["method"],
                "num-examples": self.n_train, "num-test": self.n_test,
                "label-hist": [int(v) for v in self.label_hist],
                "input-shape": [int(v) for v in self.input_shape], "num-classes": self.num_classes,
                "param-size": int(self.engine.spec.size)}

    def train(self, plan: Plan, rnd: int) -> Update:
        if plan.clients.tolist() != [self.client]:
            raise ValueError(f"this node is client {self.client}; the message is for clients {plan.clients.tolist()}")
        P = self.engine.spec.size
        if plan.start.shape != (1, P):
            raise ValueError(f"start parameters of shape {tuple(plan.start.shape)}, expected (1, {P})")
        return self.algo.client_update(plan, self.engine, rnd)

    def evaluate(self, params: torch.Tensor, splits: list[str]) -> EvalResult:
        """Row i of `params` scored on `splits[i]`: 'local' (this client's test split), 'train' (its train
        rows, e.g. IFCA's choice of a cluster model) or 'global' (the global test set)."""
        if params.dim() != 2 or params.shape[0] != len(splits):
            raise ValueError(f"{tuple(params.shape)} parameter rows for {len(splits)} splits")
        bad = sorted(set(splits) - {"local", "global", "train"})
        if bad:
            raise ValueError(f"unknown split {bad[0]!r}: local, global or train")
        rows = [self.engine.evaluate(params[i:i + 1], np.array([self.client]), s) for i, s in enumerate(splits)]
        c = self.num_classes
        if not rows:
            z = torch.zeros(0, dtype=torch.long)
            return EvalResult(z, z.double(), z, torch.zeros(0, c, c, dtype=torch.long))
        return EvalResult(torch.cat([r.correct for r in rows]), torch.cat([r.loss_sum for r in rows]),
                          torch.cat([r.count for r in rows]), torch.cat([r.confusion for r in rows]))


@lru_cache(maxsize=64)
def build_node(experiment: str, client: int, data_root: str = "", device: str = "") -> Node:
    """The node for `client` under `experiment` (cached: a simulation actor serves many virtual nodes).

    `data_root` and `device` are node-local (execution keys: they do not change the run's identity).
    """
    cfg = parse_experiment(experiment, **{"data.root": data_root or None, "device": device or None})
    if not 0 <= client < cfg["clients"]:
        raise ValueError(f"client id {client} outside [0, {cfg['clients'] - 1}]")
    fed = _fedmod.build_federation(cfg)
    model = make_model(cfg, fed.input_shape, fed.num_classes)
    ctx = make_context(cfg, model, fed.n_train, fed.label_hist())
    local = client_slice(fed, client)
    hist = fed.label_hist()[client].copy()
    del fed
    clear = getattr(_fedmod._federation, "cache_clear", None)   # keep only this client's rows in memory
    if clear is not None:
        clear()
    engine = SequentialEngine(local, model, local_config(cfg), cfg["seed"], resolve_device(cfg["device"]))
    ctx.spec = engine.spec
    algo = make_algorithm(cfg, ctx)
    return Node(cfg, client, engine, algo, hist, len(local.test_idx[client]), local.input_shape,
                local.num_classes)
