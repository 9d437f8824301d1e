"""What a SuperNode holds: its client's slice of the federation, a sequential engine and the algorithm.

Every node builds the federation from the same experiment config (dataset + partition + seed: the
partition is deterministic), keeps only its own client's train and local-test rows plus the public
global test set, and drops the rest. The algorithm object is built exactly as the in-process runner
builds it (`fedprism.experiment.build.make_*`, the composition root), so `algo.client_update(plan, engine, rnd)` here runs
the same code, on the same numbers, as the simulator's sequential engine.

Class drift (`drift.*`, fedprism.data.drift): the node draws the run's schedule from the whole partition
before dropping the other clients' rows (`drift_schedule`, as the in-process runner does) and, before it
trains or scores for round t (the message says t), gives its engine its own rows of round t through the
runner's `DriftedData.apply`.

No Flower import: this module is the ClientApp's payload and is unit-tested without Flower.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from fedprism.algorithms.base import Algorithm
from fedprism.engine import resolve_device
from fedprism.engine.base import SPLITS
from fedprism.engine.sequential import SequentialEngine
from fedprism.experiment import federation as _fedmod
from fedprism.experiment.config import Config
from fedprism.experiment.evaluate import StreamScorer, score_inference
from fedprism.data.drift import DriftedData
from fedprism.compression import client_work
from fedprism.experiment.build import drift_schedule, local_config, make_algorithm, make_context, make_model
from fedprism.experiment.limits import check_limits
from fedprism.federation import Federation
from fedprism.flower.settings import parse_experiment
from fedprism.protocol import ClientState, Context, EvalResult, Plan, Rows, Update


def client_slice(fed: Federation, client: int) -> Federation:
    """Client `client`'s train rows (and validation rows), its local test split, plus the global test set
    (and the global validation set); nothing else.

    Client ids keep their meaning (other clients hold no rows), so seeds derived from
    (seed, round, client) are those of the in-process run. With local test rows held out of the client's
    own data (`data.local_test = "split"`, `local_pool = "train"`) they travel with its train rows.
    """
    tr = np.asarray(fed.train_idx[client], dtype=np.int64)
    va = np.asarray(fed.val_idx[client], dtype=np.int64) if fed.val_idx is not None else np.zeros(0, np.int64)
    own_test = fed.local_pool == "train"
    te = np.asarray(fed.test_idx[client], dtype=np.int64) if own_test else np.zeros(0, np.int64)
    rows = torch.as_tensor(np.concatenate([tr, va, te]), dtype=torch.long)
    empty = np.zeros(0, dtype=np.int64)
    train_idx = [empty] * fed.num_clients
    test_idx = [empty] * fed.num_clients
    train_idx[client] = np.arange(len(tr), dtype=np.int64)
    test_idx[client] = (np.arange(len(tr) + len(va), len(tr) + len(va) + len(te), dtype=np.int64) if own_test
                        else np.asarray(fed.test_idx[client], dtype=np.int64))
    val_idx = None
    if fed.val_idx is not None:
        val_idx = [empty] * fed.num_clients
        val_idx[client] = np.arange(len(tr), len(tr) + len(va), dtype=np.int64)
    return Federation(fed.x_train[rows].clone(), fed.y_train[rows].clone(), fed.x_test, fed.y_test, train_idx,
                      test_idx, fed.num_classes, list(fed.class_names), fed.name, dict(fed.meta), val_idx,
                      fed.x_val, fed.y_val, fed.local_pool, fed.vocab_size)


class NodeStore:
    """A node's client-side store: its own client's rows of the method's declared `client_state`.

    They start as the declaration says (the run's initial model, zeros, ...), as the simulator's do,
    change only by what this node's `client_update` returns, and persist across rounds in the node's
    Flower `Context.state` (`to_arrays` / `load`), so a ClientApp process that is restarted between
    rounds finds them again.
    """

    def __init__(self, client: int, decls: dict[str, ClientState], ctx: Context):
        self.client, self.decls, self.ctx = client, dict(decls), ctx
        self.reset()

    def reset(self) -> None:
        """Back to the initial rows (a node whose Context holds no state yet)."""
        self.data: Rows = {k: d.initial(self.ctx, 1) for k, d in self.decls.items()}

    def rows(self) -> Rows:
        return {k: v.clone() for k, v in self.data.items()}

    def write(self, rows: Rows) -> None:
        for k, v in rows.items():
            if k not in self.data:
                raise KeyError(f"client state {k!r} was not declared (declared: {sorted(self.data)})")
            self.data[k] = v.detach().to(self.data[k].dtype).reshape(self.data[k].shape).clone()

    def to_arrays(self) -> dict[str, np.ndarray]:
        return {k: v.cpu().numpy() for k, v in self.data.items()}

    def load(self, arrays: dict[str, np.ndarray]) -> None:
        for k in self.decls:
            if k in arrays:
                a = torch.from_numpy(np.array(arrays[k], copy=True))
                if a.shape != self.data[k].shape or a.dtype != self.data[k].dtype:
                    raise ValueError(f"stored client state {k!r} has shape {tuple(a.shape)} {a.dtype}, "
                                     f"expected {tuple(self.data[k].shape)} {self.data[k].dtype}")
                self.data[k] = a


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
    store: NodeStore                  # this client's rows of the method's `client_state`
    scorer: StreamScorer              # multi-stream scoring with its logits caches
    drift: DriftedData | None = None  # this client's rows under the run's class-drift schedule (None: static)

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

    def at_round(self, rnd: int | None) -> None:
        """The engine holds this client's rows of round `rnd` (they change only under class drift)."""
        if self.drift is None:
            return
        if rnd is None:
            raise ValueError("field 'round' missing: under drift.fraction > 0 the node needs the round to know "
                             "which of its classes are present")
        self.drift.apply(self.engine, rnd)

    def train(self, plan: Plan, rnd: int) -> Update:
        """The method's `client_update` for this client, with its own state, on its rows of round `rnd`;
        the new state is kept (`store.write`) only after the update succeeded and only when it is finite
        (a diverged client's reply is an error; it keeps the state it had, as in process)."""
        if plan.clients.tolist() != [self.client]:
            raise ValueError(f"this node is client {self.client}; the message is for clients {plan.clients.tolist()}")
        self.at_round(rnd)
        up = client_work(self.algo, plan, self.engine, rnd, self.store.rows())   # encoded under `compress`
        diverged = up.nonfinite_state()
        if diverged:                       # the server records the failure; the node keeps its last state
            raise ValueError(f"{diverged[self.client]}; this client keeps its previous state")
        self.store.write(up.client_state)
        up.client_state = {}
        return up

    def evaluate(self, params: torch.Tensor | None, splits: list[str], payload: Rows | None = None,
                 rnd: int | None = None) -> EvalResult:
        """Either row i of `params` scored on `splits[i]` ('local': this client's test split, 'train': its
        train rows, 'global': the global test set), or (params None) this client's inference built from the
        method's `payload` row and its own state, scored on every split of `splits`; on this client's rows
        of round `rnd` (needed under class drift only)."""
        bad = sorted(set(splits) - set(SPLITS))
        if bad:
            raise ValueError(f"unknown split {bad[0]!r}: one of {', '.join(SPLITS)}")
        self.at_round(rnd)
        me = np.array([self.client])
        if params is None:
            inf = self.algo.inference(self.engine, me, payload or {}, self.store.rows())
            rows = [score_inference(self.engine, self.scorer, inf, me, s) for s in splits]
        else:
            if params.dim() != 2 or params.shape[0] != len(splits):
                raise ValueError(f"{tuple(params.shape)} parameter rows for {len(splits)} splits")
            rows = [self.engine.evaluate(params[i:i + 1], me, s) for i, s in enumerate(splits)]
        return EvalResult.concat(rows, self.num_classes)


@lru_cache(maxsize=64)
def build_node(experiment: str, client: int, data_root: str = "", device: str = "") -> Node:
    """The node for `client` under `experiment` (cached: a simulation actor serves many virtual nodes).

    `data_root` and `device` are node-local (execution keys: they do not change the run's identity).
    """
    cfg = parse_experiment(experiment, **{"data.root": data_root or None, "device": device or None})
    if not 0 <= client < cfg["clients"]:
        raise ValueError(f"client id {client} outside [0, {cfg['clients'] - 1}]")
    fed = _fedmod.build_federation(cfg)
    model = make_model(cfg, fed.input_shape, fed.num_classes, fed.vocab_size)
    check_limits(cfg, fed.n_train, sum(p.numel() for p in model.parameters()))   # before anything large
    ctx = make_context(cfg, model, fed.n_train, fed.label_hist())
    schedule = drift_schedule(cfg, fed)                    # drawn from the whole partition, as in process
    local = client_slice(fed, client)
    hist = fed.label_hist()[client].copy()
    del fed
    _fedmod.clear_federations()                                   # keep only this client's rows in memory
    engine = SequentialEngine(local, model, local_config(cfg), cfg["seed"], resolve_device(cfg["device"]))
    ctx.spec = engine.spec
    algo = make_algorithm(cfg, ctx)
    return Node(cfg, client, engine, algo, hist, len(local.test_idx[client]), local.input_shape,
                local.num_classes, NodeStore(client, algo.client_state, ctx), StreamScorer(engine, ctx.num_clients),
                None if schedule is None else DriftedData(schedule, local))
