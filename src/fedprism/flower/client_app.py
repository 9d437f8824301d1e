"""The fedprism ClientApp: identity, local training (`algo.client_update`) and evaluation on one node.

Handlers (Flower Message API):

    query "identity"  -> {client-id, config-id, num-examples, label-hist, input-shape, ...}
    train             -> the algorithm's `client_update` on this client's rows of the message's round
                         (sequential engine; the rows change only under class drift)
    evaluate          -> scores of the given parameter rows on the local test split / global test set

Every reply carries the node's `client-id`. An exception becomes an error reply (Flower does that),
which the server records as a failure of this client. `app` reads everything from the run config and
the node config; `make_client_app(**defaults)` supplies defaults for runs without a run config
(tests drive it over an in-process grid).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from fedprism.flower import codec
from fedprism.flower.node import Node, build_node
from fedprism.flower.secagg import is_secure, secagg_mod, secure_reply
from fedprism.flower.settings import RUN_KEYS, client_id_of, parse_experiment
from fedprism.flower.trust import laplace_hist


def node_for(context: Context, defaults: dict[str, Any]) -> Node:
    run_config = {**defaults, **dict(context.run_config)}
    text = run_config.get("experiment", RUN_KEYS["experiment"].default)
    nc = dict(context.node_config)
    clients = parse_experiment(text)["clients"]
    cid = client_id_of(nc, clients)
    return build_node(text, cid, str(nc.get("data-root", "") or ""), str(nc.get("device", "") or ""))


#: the name of the node's client-side store in its Flower `Context.state`
STORE = "fedprism-client-state"


def load_store(node: Node, context: Context) -> None:
    """Bind the node's client-side rows (the method's `client_state`, e.g. fedprism_dual's P_i, L_i) to
    what this node's Context holds; a fresh Context (first round) keeps the initial rows."""
    node.store.reset()
    if STORE in context.state.array_records:
        rec = context.state.array_records[STORE]
        node.store.load({k: rec[k].numpy() for k in rec.keys()})


def save_store(node: Node, context: Context) -> None:
    if node.store.data:
        context.state[STORE] = ArrayRecord({k: Array(v) for k, v in node.store.to_arrays().items()})


#: the name of the node's released statistics in its Flower `Context.state` (stats-epsilon > 0)
RELEASED = "fedprism-released-stats"


def released_hist(node: Node, context: Context, epsilon: float) -> np.ndarray | None:
    """The node's label histogram as it tells the server: None when it is exact; otherwise released
    once and kept in the node's Context.state, so every later query gets the same release (no privacy
    spent again; Flower starts a new ClientApp process per message). Two mechanisms:

    * `privacy.epsilon` of the experiment (Gaussian, calibrated with the run's other releases by the RDP
      accountant, fedprism.privacy): the node's context already holds its release (`ctx.label_hist`,
      noise from the run seed or, with `privacy.noise=system`, from the OS), rounded to integers;
    * the run config's `stats-epsilon` (Laplace, `trust.laplace_hist`, noise from the OS's entropy,
      never from the run seed, which the server knows)."""
    privacy = node.algo.ctx.privacy
    if privacy is None and epsilon <= 0:
        return None
    mech = np.array([1.0, privacy.z]) if privacy is not None else np.array([0.0, epsilon])
    rec = context.state.array_records[RELEASED] if RELEASED in context.state.array_records else None
    if rec is not None and "mech" in rec.keys() and np.array_equal(rec["mech"].numpy(), mech):
        return rec["hist"].numpy().astype(np.int64)
    if privacy is not None:
        hist = np.rint(node.algo.ctx.label_hist[node.client]).astype(np.int64)
    else:
        hist = laplace_hist(node.label_hist, epsilon, np.random.default_rng())
    context.state[RELEASED] = ArrayRecord({"hist": Array(hist), "mech": Array(mech)})
    return hist


def make_client_app(**defaults: Any) -> ClientApp:
    """A ClientApp whose run-config defaults are `defaults` (keys of `settings.RUN_KEYS`)."""
    defaults = {k.replace("_", "-"): v for k, v in defaults.items()}
    app = ClientApp(mods=[secagg_mod])         # SecAgg+'s messages to its mod, every other one as it is

    def epsilon(context: Context) -> float:
        return float({**defaults, **dict(context.run_config)}.get("stats-epsilon", 0.0) or 0.0)

    @app.query("identity")
    def identity(msg: Message, context: Context) -> Message:
        node = node_for(context, defaults)
        info = node.identity()
        hist = released_hist(node, context, epsilon(context))
        if hist is not None:
            info.update({"label-hist": [int(v) for v in hist], "num-examples": int(hist.sum())})
        return Message(RecordDict({codec.IDENTITY: ConfigRecord(info)}), reply_to=msg)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        node = node_for(context, defaults)
        plan, rnd, cid, config_id = codec.decode_plan(msg.content)          # the rows as they travel
        if config_id != node.cfg.run_id:
            raise ValueError(f"the server runs experiment {config_id}, this node was configured for {node.cfg.run_id}")
        if cid != node.client:
            raise ValueError(f"message for client {cid} reached the node of client {node.client}")
        plan.payload = codec.decode_rows(node.algo, "plan", plan.payload)
        load_store(node, context)
        update = node.train(plan, rnd)
        save_store(node, context)          # only after a successful update (client_update commits last)
        hist = released_hist(node, context, epsilon(context))
        if hist is not None:               # the released total, not the exact one
            total = max(int(hist.sum()), 1)     # a weight of 0 carries nothing
            update.n_samples = torch.tensor([float(total)], dtype=torch.float64)
        if is_secure(msg.content):         # secagg=secaggplus: the update goes to the mod, which masks it
            return Message(secure_reply(node, plan, update, node.cfg.run_id), reply_to=msg)
        return Message(codec.encode_update(update, node.client, node.cfg.run_id, node.algo), reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        node = node_for(context, defaults)
        params, splits, cid, payload = codec.decode_eval(msg.content)      # the rows as they travel
        if cid != node.client:
            raise ValueError(f"message for client {cid} reached the node of client {node.client}")
        if payload is not None:
            payload = codec.decode_rows(node.algo, "eval", payload)
        load_store(node, context)
        scores = node.evaluate(params, splits, payload, codec.eval_round(msg.content))
        return Message(codec.encode_scores(scores, node.client), reply_to=msg)

    return app


#: the ClientApp that `flwr run` loads (`fedprism.flower.client_app:app`)
app = make_client_app()
