"""Secure aggregation on Flower: a round's uploads reach the server only as their weighted sum, through
Flower's SecAgg+ (Bell et al. 2020, "Secure Single-Server Aggregation with (Poly)Logarithmic Overhead",
ACM CCS; `flwr.server.workflow.SecAggPlusWorkflow` and the client mod `flwr.client.mod.secaggplus_mod`).

Run config `secagg=secaggplus` (docs/flower.md, "Secure aggregation"). Only a method whose server step
needs the uploads' weighted mean alone can take it (`Algorithm.sum_weighting`: FedAvg, FedProx, MOON,
Ditto, APFL, Per-FedAvg, pFedMe at `<method>.aggregation=mean`); any other is refused before a round
starts, with the reason (it reads each client's upload: clusters, similarities, a robust rule).

One round:

    server                                          node k (its ClientApp behind `secagg_mod`)
    SecAgg+ setup, key sharing (Flower's stages)
    collect stage: the node's plan row ------------>  client_update as always; uploads
                                                      u_k = a_k (x_k - x_sent) / max_weight, a_k = n_k
                                                      (`samples`) or 1 (`uniform`), quantised, masked
    unmask stage -> sum_k a_k (x_k - x_sent) / sum_k a_k, dequantised

The server then adds back the row every client was sent (a sum-only method sends every client the same
rows, checked) and hands the method one row per accepting client, each the mean x_sent + Delta, with the
client's weight: their weighted mean is that mean, which is all the method reads. Clients send their
update rather than their model so that SecAgg+'s clipping range (`secagg-clip`, default Flower's 8.0)
bounds updates, not weights.

Tolerance against plain aggregation. SecAgg+ maps each coordinate of a_k Delta_k / max_weight, clipped to
[-c, c], to an integer in [0, Q] with stochastic rounding (error below one step 2c/Q, Q = 2^22); the sum of
n clients is divided by sum_k a_k / max_weight. So while no coordinate is clipped, every coordinate of the
mean is within n (2c/Q) max_weight / sum_k a_k of the exact one (plus the quantisation of the weights,
relative 1/(2 a_k Q / max_weight)); with c = 8, FedAvg's max_weight = the largest training split and equal
clients, that is about 4e-6 (`tests/test_secagg.py` checks the bound). The stochastic rounding draws from
numpy's global generator: a SecAgg+ run is not reproducible bit for bit.

What the server no longer sees: each update (so `update-norm-bound` cannot apply, and is refused), and
the weight inside the masked sum (a node's a_k is its own word; its reported sample count is still
capped for the records). The sample counts and training losses travel in the clear, as metadata.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict

from fedprism.errors import ConfigError
from fedprism.protocol import Plan, Update

#: Flower's record name for the SecAgg+ configuration in a train message (`RECORD_KEY_CONFIGS`)
try:
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
except ImportError:  # pragma: no cover - other flwr versions
    RECORD_KEY_CONFIGS = "secaggplus"


def secagg_mod(msg, ctx, call_next):
    """The ClientApp's mod: SecAgg+'s `secaggplus_mod` for the train messages of the protocol (they carry its
    configuration record), every other message straight to the handler (a run without secure aggregation
    is served exactly as before)."""
    if msg.metadata.message_type == "train" and RECORD_KEY_CONFIGS in msg.content.config_records:
        from flwr.client.mod import secaggplus_mod

        return secaggplus_mod(msg, ctx, call_next)
    return call_next(msg, ctx)


def is_secure(content: RecordDict) -> bool:
    """A train message of the SecAgg+ collect stage (the node answers with its masked update)."""
    return RECORD_KEY_CONFIGS in content.config_records


def weight_of(algo, n_samples: float) -> int:
    """a_k, the weight a node multiplies its update by: its sample count (`samples`) or 1 (`uniform`)."""
    return int(round(n_samples)) if algo.sum_weighting(algo.hp) == "samples" else 1


def secure_reply(node, plan: Plan, update: Update, config_id: str) -> RecordDict:
    """The node's answer to the collect stage, in the layout `secaggplus_mod` reads (a FitRes): the update
    Delta = x - x_sent (float64) as the parameters, a_k as `num_examples`; the sample count, the training
    loss, the client id and the experiment id as metrics (in the clear). The mod masks the parameters and
    drops them from the reply."""
    import flwr.compat.common.recorddict_compat as compat
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters

    delta = (update.payload["params"][0].to(torch.float64) - plan.payload["params"][0].to(torch.float64)).numpy()
    n = float(update.n_samples[0])
    metrics = {"n_samples": n, "client-id": int(node.client), "config-id": str(config_id)}
    metrics.update({f"m.{k}": float(v[0]) for k, v in update.metrics.items()})
    res = FitRes(Status(Code.OK, ""), ndarrays_to_parameters([delta]), weight_of(node.algo, n), metrics)
    return compat.fitres_to_recorddict(res, keep_input=True)


# -- server side --------------------------------------------------------------------------------------
def check_secure(cfg, algo, settings, max_weight: int | None) -> None:
    """ConfigError when this run cannot aggregate securely: a method that reads individual uploads, an
    upload that is not one model, `update-norm-bound` (the server never sees an update), or samples
    weighting without a bound on the sample counts (`max-samples` or a dataset the server can read)."""
    weighting = algo.sum_weighting(algo.hp, "secure aggregation (secagg=secaggplus)")
    if set(algo.upload()) != {"params"}:
        raise ConfigError("secagg", "secaggplus", f"none for method={cfg['method']}: its upload is not one model")
    if settings.update_norm_bound > 0:
        raise ConfigError("update-norm-bound", settings.update_norm_bound, "0 with secagg=secaggplus: the server "
                          "sees only the sum of the updates, never one update's norm")
    if weighting == "samples" and not max_weight:
        raise ConfigError("max-samples", 0, "a bound on the sample counts with secagg=secaggplus and "
                          f"{cfg['method']}.weighting=samples (SecAgg+ scales each weight by it before "
                          "quantising); set max-samples or make the dataset readable on the server")


@dataclass
class _Proxy:
    node_id: int


class _Strategy:
    """The two calls of Flower's legacy Strategy that SecAggPlusWorkflow makes: which nodes take part
    (`configure_fit`), and the aggregate (`aggregate_fit`, which here only keeps what the workflow hands it)."""

    def __init__(self, nodes: list[int]):
        self.nodes, self.results, self.failures = nodes, None, []

    def configure_fit(self, server_round, parameters, client_manager):
        from flwr.common import FitIns

        return [(_Proxy(n), FitIns(parameters, {})) for n in self.nodes]

    def aggregate_fit(self, server_round, results, failures):
        self.results, self.failures = results, failures
        return None, {}


class _Manager:
    def __init__(self, n: int):
        self.n = n

    def num_available(self) -> int:
        return self.n


def _workflow(bodies: dict[int, RecordDict], **kw):
    from flwr.server.workflow import SecAggPlusWorkflow

    class Workflow(SecAggPlusWorkflow):
        """Flower's SecAgg+ with fedprism's plan rows as the collect stage's content (instead of FitIns)."""

        def collect_masked_vectors_stage(self, grid, context, state):
            state.nid_to_fitins = {nid: bodies[nid] for nid in state.nid_to_fitins}
            return super().collect_masked_vectors_stage(grid, context, state)

    return Workflow(**kw)


def secure_round(exp, plan: Plan, rnd: int) -> tuple[Update | None, dict[int, str]]:
    """One round's training under SecAgg+ (module docstring): the update of the clients whose masked vectors
    were unmasked, one row each holding the mean, or None; failures by client."""
    from fedprism.flower import codec
    from flwr.server.compat.legacy_context import LegacyContext
    from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
    from flwr.server.workflow.constant import Key as WorkflowKey

    link, s, algo = exp.link, exp.settings, exp.algo
    link.refresh()
    rows = {k: v[:1] for k, v in plan.payload.items()}
    if any(not torch.equal(v, v[:1].expand_as(v)) for v in plan.payload.values()):
        raise ConfigError("secagg", "secaggplus", f"none for method={exp.cfg['method']}: its plan sends the "
                          "clients different rows, and a sum of updates needs one start")
    failed: dict[int, str] = {}
    bodies, node_client = {}, {}
    for r, c in enumerate(plan.clients.tolist()):
        nid = link.node_of.get(int(c))
        if nid is None:
            failed[int(c)] = "train: no connected node for this client"
            continue
        bodies[nid] = codec.encode_plan(plan.subset(np.array([r])), rnd, int(c), exp.cfg.run_id, algo)
        node_client[nid] = int(c)
    if len(bodies) < 2:
        for c in node_client.values():
            failed[c] = "train: secure aggregation needs at least 2 connected clients in a round"
        return None, failed
    strategy = _Strategy(sorted(bodies))
    base = Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={})
    ctx = LegacyContext(base, strategy=strategy, client_manager=_Manager(len(bodies)))
    ctx.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({WorkflowKey.CURRENT_ROUND: int(rnd)})
    ctx.state.array_records[MAIN_PARAMS_RECORD] = ArrayRecord()
    weighting = algo.sum_weighting(algo.hp)
    max_weight = float(link.max_samples if weighting == "samples" else 1)
    _workflow(bodies, num_shares=float(s.secagg_shares), reconstruction_threshold=float(s.secagg_threshold),
              max_weight=max_weight, clipping_range=s.secagg_clip, timeout=s.round_timeout)(link.grid, ctx)
    results = strategy.results or []
    got = {int(p.node_id): res for p, res in results}
    for nid, c in node_client.items():
        if nid not in got:
            failed[c] = f"train: no masked update from node {nid} was unmasked (SecAgg+ dropped it)"
    if not got:
        return None, failed
    from flwr.common import parameters_to_ndarrays

    delta = torch.as_tensor(np.asarray(parameters_to_ndarrays(next(iter(got.values())).parameters)[0],
                                       dtype=np.float64))
    mean = (rows["params"][0].to(torch.float64) + delta).to(rows["params"].dtype)
    clients, weights, metrics = [], [], {}
    for nid, res in sorted(got.items(), key=lambda kv: node_client[kv[0]]):
        m = dict(res.metrics)
        c = node_client[nid]
        if m.get("client-id") != c or m.get("config-id") != exp.cfg.run_id:
            failed[c] = f"train: node {nid} answered for client {m.get('client-id')} of {m.get('config-id')}"
            continue
        clients.append(c)
        weights.append(float(m.get("n_samples", res.num_examples)))
        for k, v in m.items():
            if k.startswith("m."):
                metrics.setdefault(k[2:], []).append(float(v))
    if not clients:
        return None, failed
    n = len(clients)
    common = {k: torch.tensor(v, dtype=torch.float32) for k, v in metrics.items() if len(v) == n}
    up = Update(np.asarray(clients, dtype=np.int64), {"params": mean.unsqueeze(0).expand(n, -1).clone()},
                torch.tensor(weights, dtype=torch.float64), common)
    parts = []
    for i, c in enumerate(clients):        # the server's checks of what it can see: the sample counts
        row = Update(up.clients[i:i + 1], {"params": up.payload["params"][i:i + 1]}, up.n_samples[i:i + 1],
                     {k: v[i:i + 1] for k, v in up.metrics.items()})
        try:
            parts.append(exp.trust(row, plan.subset(np.array([plan.clients.tolist().index(c)]))))
        except Exception as e:  # noqa: BLE001 - a refused reply is that client's failure
            failed[c] = f"train: rejected by the server: {e}"
    exp._records.append(("secagg", None, {"clients": [int(p.clients[0]) for p in parts], "sent": len(plan.clients),
                                          "clip": s.secagg_clip, "max_weight": max_weight,
                                          "weight_total": float(sum(r.num_examples for r in got.values()))}))
    if len(parts) < s.min_replies:
        exp._records.append(("round_skipped", None, {"replies": len(parts), "min_replies": s.min_replies,
                                                     "clients": [int(p.clients[0]) for p in parts]}))
        return None, link.clean(failed)
    return Update.concat(parts), link.clean(failed)
