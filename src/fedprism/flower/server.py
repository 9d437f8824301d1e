"""The server side on Flower: node <-> client identity, deadline-bounded exchanges, remote evaluation,
and the runner's round loop (`Experiment.run`) with remote clients.

    Link               maps Flower node ids to persistent client ids (identity queries, re-mapping of
                       restarted nodes), pushes messages and pulls replies until a deadline
    RemoteTrainer      the Trainer the Evaluator sees: scores parameter rows on the nodes
    FlowerExperiment   `Experiment` whose `local_work` sends each sampled client its own plan row and
                       whose evaluation runs on the nodes; sampling, validation, aggregation, metrics,
                       store writes and checkpoint/resume are the runner's own code

Failure semantics (docs/flower.md): an error reply, a missing reply at the deadline, a client with no
connected node, or a malformed reply is non-participation of that client in that round, stored as a
`failure` record (client id, reason); the round aggregates the clients that succeeded if there are at
least `min-replies` of them, else its update is skipped (`round_skipped` record). A node that timed out
is dropped from the map and asked for its identity again (without blocking the rounds); a node that
comes back, with the same or a new node id, is re-mapped to its client id once its previous node is
offline (with a key registry: only the registered key may hold a client id).

Trust (docs/flower.md, "Trust and failure semantics"; `fedprism.flower.trust`): every field of every
reply is parsed under a guard and a refusal names the field; sample counts are capped; an update above
`update-norm-bound` is rejected or clipped; identity can be bound to node keys; metrics that only a node
could compute are marked node-reported, and the server scores the global test set itself when it can.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from flwr.app import ConfigRecord, Message, RecordDict

from fedprism.algorithms.base import Algorithm
from fedprism.data.drift import DriftSchedule
from fedprism.errors import ConfigError, printable
from fedprism.experiment.evaluate import Evaluator, row_hashes
from fedprism.experiment.limits import check_limits
from fedprism.experiment.build import make_algorithm, make_context, make_model
from fedprism.experiment.runner import Experiment, RunResult, validate_update
from fedprism.experiment.systems_run import system_run
from fedprism.experiment.store import Store
from fedprism.flower import codec
from fedprism.flower.secagg import check_secure, secure_round
from fedprism.flower.settings import IDENTITY_KEYS, RunSettings, check_flower_config, flower_label
from fedprism.flower.spec import RunSpec
from fedprism.flower.trust import (FLOAT32_MAX, Refused, Registry, clip_update, node_keys, parse_identity, sample_count,
                                  scaled_hist, update_norm)
from fedprism.params import Functional, ParamSpec
from fedprism.protocol import EvalResult, Plan, Rows, Update

IDENTITY_QUERY = "query.identity"

#: run-config settings stored in a Flower run's provenance: those its numbers depend on, and the deadlines
FLOWER_RECORDED = (*IDENTITY_KEYS, "min-nodes", "round-timeout")

try:  # names of Flower's error codes, for readable failure records
    from flwr.common.constant import ErrorCode as _EC
    ERROR_NAMES = {v: k for k, v in vars(_EC).items() if k.isupper() and isinstance(v, int)}
    NODE_UNAVAILABLE = getattr(_EC, "NODE_UNAVAILABLE", 5)
except ImportError:  # pragma: no cover
    ERROR_NAMES, NODE_UNAVAILABLE = {}, 5
#: error codes that say "not delivered / expired / node gone", not "the node refused"
TRANSIENT = {3, 4, NODE_UNAVAILABLE}

Record = tuple[str, "int | None", dict]

NO_DRIFT_WITHOUT_DATA = ("0 unless the dataset is readable on the server: the class-drift schedule "
                         "(fedprism.data.drift) is drawn from the partition's label counts, and the server needs "
                         "it for the sizes of the clients' splits in each round and for the stored schedule")


@dataclass(frozen=True)
class ServerDrift:
    """What the server holds of class drift (`drift.*`): the run's schedule and the static per-class row
    counts of every client's own splits (`fedprism.data.drift.class_counts`), from which it knows each
    split's size in every round without holding a row."""

    schedule: DriftSchedule
    counts: dict[str, np.ndarray]


def _log(msg: str) -> None:
    """One line of the ServerApp's log; a node's words in it (failure reasons, names) are made printable
    (`fedprism.errors.printable`: control characters, terminal escape sequences among them, escaped)."""
    msg = printable(msg)
    try:
        from logging import INFO

        from flwr.common.logger import log
        log(INFO, "[fedprism] %s", msg)
    except Exception:  # noqa: BLE001 - logging must never break a round
        print(f"[fedprism] {msg}", flush=True)


class Link:
    """The server's view of the federation: which node stands for which client, and message exchange."""

    def __init__(self, grid, num_clients: int, config_id: str, poll_interval: float = 0.5,
                 probe_timeout: float = 60.0, log: Callable[[str], None] = _log, registry: Registry | None = None,
                 max_samples: int | None = None, *, spec: RunSpec):
        self.grid, self.N, self.config_id = grid, num_clients, config_id
        #: the run's input shape, classes and model size, decided by the server before any node speaks
        #: (`fedprism.flower.spec.server_spec`); every identity reply is checked against it
        self.spec = spec
        self.poll, self.probe_timeout, self.log = poll_interval, probe_timeout, log
        self.registry, self.max_samples = registry, max_samples
        self.key_of: dict[int, str] = {}          # node id -> the registry key it was admitted under
        self.node_of: dict[int, int] = {}        # client id -> node id
        self.client_of: dict[int, int] = {}      # node id -> client id
        self.pending: dict[str, tuple[int, float]] = {}   # identity query id -> (node id, sent at)
        self.refused: dict[int, float] = {}      # node id -> when its identity was refused
        self.ever: set[int] = set()              # clients that were ever connected
        self.events: list[Record] = []
        self.n_train = np.zeros(num_clients, dtype=np.int64)     # filled from identity replies
        self.input_shape, self.num_classes = spec.input_shape, spec.num_classes
        self.param_size = spec.param_size
        self.label_hist = np.zeros((num_clients, spec.num_classes), dtype=np.int64)   # sized by the server

    # -- identity ----------------------------------------------------------------------------------
    def online(self) -> set[int]:
        return {int(n) for n in self.grid.get_node_ids()}

    def public_keys(self) -> dict[int, bytes]:
        """node id -> its authentication public key, as far as the Grid tells (`Grid.get_nodes()` gives
        `NodeInfo.public_key` in a deployment with node authentication; empty elsewhere)."""
        get = getattr(self.grid, "get_nodes", None)
        if get is None:
            return {}
        try:
            return {int(n.node_id): bytes(n.public_key) for n in get() if getattr(n, "public_key", b"")}
        except Exception:  # noqa: BLE001 - a Grid without node details: node ids only
            return {}

    def cap(self, cid: int) -> int | None:
        """The most samples client `cid` may claim (`max-samples`; None: no cap). A count in the registry
        replaces the node's word altogether (`_admit`, `FlowerExperiment.trust`)."""
        return self.max_samples

    def refresh(self) -> None:
        """Forget nodes that went offline, take in identity replies, query new nodes (no waiting)."""
        online = self.online()
        for nid in list(self.client_of):
            if nid not in online:
                self._forget(nid, "offline")
        self._collect()
        now = time.monotonic()
        for mid, (nid, t) in list(self.pending.items()):
            # a query stays pending until its reply (or Flower's TTL error reply) arrives: a node handles
            # one message at a time, so asking again sooner only queues more work behind a slow start
            if nid not in online or now - t > 2 * self.probe_timeout + 10:
                del self.pending[mid]
        probing = {nid for nid, _ in self.pending.values()}
        for nid in sorted(online):
            if nid in self.client_of or nid in probing or now - self.refused.get(nid, -np.inf) < self.probe_timeout:
                continue
            msg = Message(RecordDict({codec.TASK: ConfigRecord({"config-id": self.config_id})}),
                          dst_node_id=nid, message_type=IDENTITY_QUERY, ttl=2 * self.probe_timeout)
            for mid in self.grid.push_messages([msg]):
                self.pending[str(mid)] = (nid, now)

    def discover(self, min_nodes: int, timeout: float) -> None:
        """Wait (at most `timeout` s) until `min_nodes` nodes have told us their client id."""
        deadline = time.monotonic() + timeout
        while True:
            self.refresh()
            if len(self.node_of) >= min_nodes:
                self.log(f"{len(self.node_of)} node(s) identified: clients {sorted(self.node_of)}")
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"only {len(self.node_of)} of min-nodes={min_nodes} nodes identified within {timeout:g}s "
                    f"({len(self.online())} online); check that every SuperNode runs with "
                    f"--node-config 'client-id=<id>' and the same experiment")
            time.sleep(self.poll)

    def _collect(self) -> None:
        if not self.pending:
            return
        for r in self.grid.pull_messages(list(self.pending)):
            nid, _ = self.pending.pop(r.metadata.reply_to_message_id, (None, 0.0))
            if nid is None:
                continue
            if r.has_error():
                if int(r.error.code) in TRANSIENT:     # expired or undeliverable: simply ask again
                    continue
                self._refuse(nid, None, f"identity query failed: {self.describe_error(r)}")
                continue
            try:
                rec = r.content.config_records[codec.IDENTITY]
                info = {k: rec[k] for k in rec.keys()}
            except Exception as e:  # noqa: BLE001 - anything unreadable is a malformed reply
                self._refuse(nid, None, f"malformed identity reply ({type(e).__name__}: {e})", "identity")
                continue
            try:
                self._admit(nid, info)
            except Exception as e:  # noqa: BLE001 - a reply must never stop the server
                self._refuse(nid, None, f"malformed identity reply ({type(e).__name__}: {e})", "identity")

    def _refuse(self, nid: int, cid: int | None, reason: str, field: str | None = None) -> None:
        self.refused[nid] = time.monotonic()
        reason = printable(reason)
        data = {"phase": "identity", "node": nid, "reason": reason}
        if field is not None:
            data["field"] = field
        self.events.append(("failure", cid, data))
        self.log(f"node {nid} refused: {reason}")

    def _admit(self, nid: int, info: dict[str, Any]) -> None:
        claimed = info.get("client-id")
        claimed = int(claimed) if isinstance(claimed, (int, np.integer)) and not isinstance(claimed, bool) \
            and 0 <= claimed < self.N else None
        try:
            ident = parse_identity(info, self.N, self.config_id)
            self.spec.check(ident)               # the server's shape, classes, model size: not the node's
        except Refused as e:
            return self._refuse(nid, claimed, f"identity field {e}", e.field)
        cid = ident.client
        key = None
        if self.registry is not None:                     # identity bound to the operator's key registry
            found = self.registry.lookup(node_keys(nid, self.public_keys().get(nid)))
            if found is None:
                return self._refuse(nid, cid, f"node is not in the key registry {self.registry.path}", "registry")
            key, entry = found
            if entry.client != cid:
                return self._refuse(nid, cid, f"claims client {cid}, but its key {key} is registered for client "
                                              f"{entry.client}", "client-id")
        old = self.node_of.get(cid)
        if old is not None and old != nid:
            # another node holds this client id: it keeps it while it is online, unless the newcomer is the
            # registered key of the client (a registered node that reconnected under a new node id)
            if old in self.online() and not (key is not None and self.key_of.get(old) == key):
                return self._refuse(nid, cid, f"client {cid} is held by node {old}, which is online", "client-id")
            self.client_of.pop(old, None)
            self.key_of.pop(old, None)
            self.events.append(("flower_node", cid, {"event": "remapped", "node": nid, "previous": old}))
            self.log(f"client {cid}: node {old} replaced by node {nid}")
        elif old is None:
            self.events.append(("flower_node", cid, {"event": "rejoined" if cid in self.ever else "joined",
                                                     "node": nid}))
        self.node_of[cid], self.client_of[nid] = nid, cid
        if key is not None:
            self.key_of[nid] = key
        self.refused.pop(nid, None)
        self.ever.add(cid)
        cap = self.cap(cid)
        n = ident.num_examples
        reg = self.registry.samples_of(cid) if self.registry is not None else None
        if reg is not None:
            if reg != n:
                self.events.append(("registry_count", cid, {"field": "num-examples", "reported": n, "used": reg}))
            n = reg
        elif cap is not None and n > cap:
            self.events.append(("capped", cid, {"field": "num-examples", "reported": ident.num_examples, "used": cap}))
            n = cap
        self.n_train[cid] = n
        self.label_hist[cid] = scaled_hist(ident.label_hist, n)      # sums to the count the server uses

    def _forget(self, nid: int, why: str) -> None:
        cid = self.client_of.pop(nid, None)
        if cid is not None and self.node_of.get(cid) == nid:
            del self.node_of[cid]
            self.events.append(("flower_node", cid, {"event": "lost", "node": nid, "reason": why}))
            self.log(f"client {cid} (node {nid}) lost: {why}")

    # -- exchange ----------------------------------------------------------------------------------
    @staticmethod
    def describe_error(r: Message, limit: int = 1000) -> str:
        """An error reply as one stored line: terminal colour codes dropped, every other control character
        (escape sequences, carriage returns, newlines) escaped (`fedprism.errors.printable`), at most `limit`
        characters of the node's text (its last ones: a traceback ends with the exception)."""
        code = int(r.error.code)
        text = printable(re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", str(r.error.reason)).strip())
        if len(text) > limit:
            text = "..." + text[-limit:]
        return f"{ERROR_NAMES.get(code, 'ERROR')} ({code}): {text}"

    @staticmethod
    def clean(failed: dict[int, str]) -> dict[int, str]:
        """Failure reasons as printable lines (they quote what nodes sent)."""
        return {c: printable(str(why)) for c, why in failed.items()}

    def exchange(self, message_type: str, bodies: dict[int, RecordDict], timeout: float,
                 group: str = "") -> tuple[dict[int, RecordDict], dict[int, str]]:
        """Send bodies[client] to the client's node; pull replies until all arrived or `timeout` s passed.

        Returns (client -> reply content, client -> failure reason). A node that does not answer in
        time is dropped from the map (and asked for its identity again later); an error reply saying the
        node is unavailable drops it too.
        """
        replies: dict[int, RecordDict] = {}
        failed: dict[int, str] = {}
        pending: dict[str, int] = {}
        sent_to: dict[int, int] = {}
        for cid, body in bodies.items():
            nid = self.node_of.get(cid)
            if nid is None:
                failed[cid] = f"{message_type}: no connected node for this client"
                continue
            msg = Message(body, dst_node_id=nid, message_type=message_type, ttl=timeout, group_id=group)
            ids = list(self.grid.push_messages([msg]))
            if not ids:
                failed[cid] = f"{message_type}: the SuperLink did not accept the message for node {nid}"
                continue
            pending[str(ids[0])], sent_to[cid] = cid, nid
        deadline = time.monotonic() + timeout
        while pending:
            for r in self.grid.pull_messages(list(pending)):
                cid = pending.pop(r.metadata.reply_to_message_id, None)
                if cid is None:
                    continue
                nid = sent_to[cid]
                if r.has_error():
                    failed[cid] = f"{message_type}: error reply from node {nid}: {self.describe_error(r)}"
                    if int(r.error.code) == NODE_UNAVAILABLE:
                        self._forget(nid, "unavailable")
                else:
                    try:
                        said = codec.reply_client(r.content)
                    except Exception as e:  # noqa: BLE001 - a malformed reply is that client's failure
                        failed[cid] = f"{message_type}: malformed reply from node {nid} (field 'client-id': {e})"
                        continue
                    if said != cid:
                        failed[cid] = f"{message_type}: node {nid} answered as client {said}, expected {cid}"
                        self._forget(nid, "identity mismatch")
                    else:
                        replies[cid] = r.content
            if not pending or time.monotonic() >= deadline:
                break
            time.sleep(max(0.0, min(self.poll, deadline - time.monotonic())))
        for cid in pending.values():
            failed[cid] = f"{message_type}: no reply from node {sent_to[cid]} within {timeout:g}s"
            self._forget(sent_to[cid], "timed out")
        return replies, self.clean(failed)

    def pop_events(self) -> list[Record]:
        ev, self.events = self.events, []
        return ev



class RemoteTrainer:
    """The Trainer protocol, evaluated on the nodes (training happens in the ClientApps).

    Two evaluation paths, both on the nodes:
    * methods whose inference is the server's model (`Algorithm.client_side_inference()` False):
      `prefetch` scores, in one exchange, every client's model on its local split and each distinct model
      (plus the method's extra models) on the global test set; `evaluate` then answers the Evaluator from
      that cache and asks the nodes only for what is missing. 'local' and 'train' rows go to the client's
      node; global-test rows go to any connected node (the global test set is the same everywhere) and are
      retried once elsewhere if a node fails.
    * methods whose inference needs the client (its state or data): `score_payloads` sends each client
      its `eval_payload` row; its node builds the inference with its own state and scores it on the local
      split and the global test set.
    """

    name = "flower"
    remote = True

    def __init__(self, link: Link, spec: ParamSpec, num_classes: int, timeout: float, shared=None,
                 sizes: dict | None = None, wire: Algorithm | None = None):
        self.link, self.spec, self.C, self.timeout = link, spec, num_classes, timeout
        self.num_classes = num_classes
        self.cache: dict[tuple, tuple] = {}     # (split, client or None, row hash) -> scores
        self.rnd = -1
        #: a Trainer over the public shared splits only ('global', 'global_val'), on the server
        #: (`global-eval=server`); None: the nodes score them
        self.shared = shared
        #: the size of every client's split when the server could build the partition: a score over
        #: another number of rows is refused (a node cannot reweigh itself in the weighted means)
        self.sizes = sizes
        #: how `eval_payload` rows travel (the algorithm's `encode`; None: as they are held)
        self.wire = wire

    def train(self, *args: Any, **kw: Any):
        raise NotImplementedError("on Flower, clients train in their ClientApp (FlowerExperiment.local_work)")

    def logits(self, params: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("the server holds no data on Flower")

    def check_counts(self, r: EvalResult, splits: list[str], clients: list[int | None]) -> None:
        """Raise ValueError when a score covers another number of rows than the split has."""
        if self.sizes is None:
            return
        for i, (split, c) in enumerate(zip(splits, clients)):
            want = self.sizes.get(split)
            if want is None:
                continue
            if not isinstance(want, int):
                if c is None:
                    continue
                want = int(want[c])
            if int(r.count[i]) != want:
                raise ValueError(f"field 'count': {int(r.count[i])} rows scored on split {split!r}, it has {want}")

    def _zero(self) -> tuple:
        return (0, 0.0, 0, torch.zeros(self.C, self.C, dtype=torch.long), {})

    @staticmethod
    def _tuples(r: EvalResult) -> list[tuple]:
        return [(int(r.correct[i]), float(r.loss_sum[i]), int(r.count[i]), r.confusion[i],
                 {k: int(v[i]) for k, v in r.alternatives.items()}) for i in range(len(r.count))]

    def _score(self, jobs: list[tuple]) -> list[tuple | None]:
        if self.shared is not None and any(j[1] in ("global", "global_val") for j in jobs):
            out: list[tuple | None] = [None] * len(jobs)
            here = [k for k, j in enumerate(jobs) if j[1] in ("global", "global_val")]
            for k in here:
                r = self.shared.evaluate(jobs[k][0].unsqueeze(0), np.array([0]), jobs[k][1])
                out[k] = self._tuples(r)[0]
            rest = [k for k in range(len(jobs)) if k not in set(here)]
            for k, r in zip(rest, self._score_remote([jobs[k] for k in rest]) if rest else []):
                out[k] = r
            return out
        return self._score_remote(jobs)

    def _score_remote(self, jobs: list[tuple]) -> list[tuple | None]:
        """jobs = (row, split, client); 'local' / 'train' jobs go to their client's node, 'global' ones to
        any node (their own client's node first). Failed global jobs are retried once; every job that still
        has no score is recorded as an evaluation failure."""
        out: list[tuple | None] = [None] * len(jobs)
        why: dict[int, str] = {}
        todo = list(range(len(jobs)))
        for attempt in range(2):
            connected = sorted(self.link.node_of)
            per: dict[int, list[int]] = {}
            rr = 0
            for j in todo:
                _, split, c = jobs[j]
                if split != "global":                        # needs the client's own node
                    if c in self.link.node_of:
                        per.setdefault(c, []).append(j)
                    else:
                        why[j] = "evaluate: no connected node for this client"
                    continue
                if not connected:
                    why[j] = "evaluate: no connected node"
                    continue
                if attempt == 0 and c in self.link.node_of:
                    target = c
                else:
                    target, rr = connected[rr % len(connected)], rr + 1
                per.setdefault(target, []).append(j)
            if not per:
                break
            bodies = {c: codec.encode_eval(torch.stack([jobs[j][0] for j in js]), [jobs[j][1] for j in js], c,
                                           rnd=self.rnd) for c, js in per.items()}
            replies, failed = self.link.exchange("evaluate", bodies, self.timeout, group=f"eval-{self.rnd}")
            for c, js in per.items():
                if c in replies:
                    try:
                        r = codec.decode_scores(replies[c], self.C)
                        if len(r.count) != len(js):
                            raise ValueError(f"{len(r.count)} scores for {len(js)} rows")
                        self.check_counts(r, [jobs[j][1] for j in js], [jobs[j][2] for j in js])
                    except Exception as e:  # noqa: BLE001 - a malformed reply is a failure of that node
                        failed[c] = f"evaluate: malformed reply ({type(e).__name__}: {e})"
                    else:
                        for j, t in zip(js, self._tuples(r)):
                            out[j] = t
                for j in js:
                    if out[j] is None:
                        why[j] = failed.get(c, "evaluate: no score")
            todo = [j for j in todo if out[j] is None and jobs[j][1] == "global"]
            if not todo:
                break
        for j, (_, split, c) in enumerate(jobs):
            if out[j] is None:
                self.link.events.append(("failure", c, {"phase": "evaluate", "split": split,
                                                        "reason": why.get(j, "evaluate: no score")}))
        return out

    def prefetch(self, rnd: int, models: torch.Tensor, extra: list[torch.Tensor], do_global: bool,
                 keep: bool = False) -> None:
        """Score models[c] on client c's local split and every distinct model on the global test set."""
        self.rnd = rnd
        if not keep:
            self.cache.clear()
        hashes = row_hashes(models)
        jobs: list[tuple[torch.Tensor, str, int | None]] = [(models[c], "local", c) for c in range(len(models))]
        keys: list[tuple] = [("local", c, hashes[c]) for c in range(len(models))]
        seen: set[bytes] = set()
        glob_rows = [(models[c], hashes[c], c) for c in range(len(models))] if do_global else []
        glob_rows += [(w, row_hashes(w.unsqueeze(0))[0], None) for w in extra]
        for w, h, c in glob_rows:
            if h not in seen:
                seen.add(h)
                jobs.append((w, "global", c))
                keys.append(("global", None, h))
        for key, (_, split, _), res in zip(keys, jobs, self._score(jobs)):
            if res is not None:
                self.cache[key] = res
            elif split == "local":
                self.cache[key] = self._zero()      # node away: no local score this round (not asked again)

    def score_payloads(self, rnd: int, payload: Rows, num_clients: int, splits: list[str]) -> dict[str, EvalResult]:
        """Each client's `eval_payload` row to its own node, which scores its inference on `splits`.
        A client whose node is away or fails gets zeros (no score this round) and a failure record."""
        self.rnd = rnd
        bodies, failed = {}, {}
        for c in range(num_clients):
            if c in self.link.node_of:
                bodies[c] = codec.encode_eval(None, splits, c, {k: v[c:c + 1] for k, v in payload.items()}, rnd=rnd,
                                              wire=self.wire)
            else:
                failed[c] = "evaluate: no connected node for this client"
        replies, lost = self.link.exchange("evaluate", bodies, self.timeout, group=f"eval-{rnd}") if bodies \
            else ({}, {})
        failed.update(lost)
        got: dict[int, list[tuple]] = {}
        for c, content in replies.items():
            try:
                r = codec.decode_scores(content, self.C)
                if len(r.count) != len(splits):
                    raise ValueError(f"{len(r.count)} scores for {len(splits)} splits")
                self.check_counts(r, splits, [c] * len(splits))
                got[c] = self._tuples(r)
            except Exception as e:  # noqa: BLE001 - a malformed reply is a failure of that client
                failed[c] = f"evaluate: malformed reply ({type(e).__name__}: {e})"
        for c, reason in sorted(failed.items()):
            self.link.events.append(("failure", c, {"phase": "evaluate", "reason": reason}))
        return {s: self._result([got[c][i] if c in got else self._zero() for c in range(num_clients)])
                for i, s in enumerate(splits)}

    def _result(self, rows: list[tuple]) -> EvalResult:
        return EvalResult(torch.tensor([r[0] for r in rows], dtype=torch.long),
                          torch.tensor([r[1] for r in rows], dtype=torch.float64),
                          torch.tensor([r[2] for r in rows], dtype=torch.long),
                          torch.stack([r[3] for r in rows]) if rows else
                          torch.zeros(0, self.C, self.C, dtype=torch.long),
                          self._alternatives(rows))

    @staticmethod
    def _alternatives(rows: list[tuple]) -> dict[str, torch.Tensor]:
        """Alternative-prediction counts every row carries (a failed row carries none: then no key)."""
        names = set.intersection(*[set(r[4]) for r in rows]) if rows else set()
        return {k: torch.tensor([r[4][k] for r in rows], dtype=torch.long) for k in sorted(names)}

    def evaluate(self, params: torch.Tensor, clients: np.ndarray, split: str) -> EvalResult:
        if split not in ("local", "global", "train", "val", "global_val"):
            raise ValueError(f"split {split!r} cannot be evaluated remotely")
        hashes = row_hashes(params)
        keys = [(split, None if split == "global" else int(c), hashes[k]) for k, c in enumerate(clients)]
        rows: list[tuple | None] = [self.cache.get(key) for key in keys]
        miss = [k for k, r in enumerate(rows) if r is None]
        if miss:
            got = self._score([(params[k], split, int(clients[k])) for k in miss])
            for k, r in zip(miss, got):
                rows[k] = r if r is not None else self._zero()
                if r is not None:
                    self.cache[keys[k]] = r
        return self._result(rows)


class FlowerExperiment(Experiment):
    """The runner's round loop with the clients on Flower nodes and no data on the server."""

    trusts_clients = False        # a node's malformed reply is rejected, whatever the other nodes sent

    def __init__(self, settings: RunSettings, store: Store, link: Link, shared_data=None,
                 sizes: dict | None = None, drift: ServerDrift | None = None):
        cfg = flower_label(settings.cfg)
        if cfg.get("drift.fraction", 0.0) and (drift is None or sizes is None):
            raise ConfigError("drift.fraction", cfg["drift.fraction"], NO_DRIFT_WITHOUT_DATA)
        check_flower_config(cfg)
        self.cfg, self.store, self.sweep, self.progress = cfg, store, None, False
        self.drift = drift.schedule if drift is not None else None
        self._drift_counts = drift.counts if drift is not None else None
        self._drift_key: tuple | None = None
        self.settings, self.link = settings, link
        self.run_id = settings.run_id
        self.fed = None
        self.model = make_model(cfg, link.input_shape, link.num_classes)
        self.ctx = make_context(cfg, self.model, link.n_train, link.label_hist)   # arrays filled as nodes report
        self.ctx.spec = Functional(self.model).spec
        if sizes is None:      # with the partition's sizes, `server_data` checked the size keys already
            check_limits(cfg, link.n_train, self.ctx.spec.size, sizes_complete=False)   # the nodes' counts
        if self.ctx.spec.size != link.param_size:       # the spec was computed from this very config
            raise RuntimeError(f"the run's spec says {link.param_size} parameters, the model has "
                               f"{self.ctx.spec.size}")
        self.algo: Algorithm = make_algorithm(cfg, self.ctx)
        #: `system.*` on Flower: the availability trace (the server does not contact a client the trace
        #: has offline) and `system.deadline` as the real timeout of the train exchange (docs/systems.md)
        self.system = system_run(cfg, self.ctx, self.algo, flower=True)
        if settings.secagg == "secaggplus":          # refused before a round: a method that reads each upload
            check_secure(cfg, self.algo, settings, link.max_samples)
        self.clients = None                          # the nodes keep their own client state
        self.upload = {k: spec.resolve(self.ctx) for k, spec in self.algo.upload().items()}
        shared = None
        if settings.global_eval == "server" and shared_data is not None:
            from fedprism.engine.sequential import SequentialEngine
            from fedprism.experiment.build import local_config
            shared = SequentialEngine(shared_data, self.model, local_config(cfg), cfg["seed"], "cpu")
        self.engine = RemoteTrainer(link, self.ctx.spec, link.num_classes, settings.round_timeout, shared, sizes,
                                    wire=self.algo)
        self._records: list[Record] = []
        self._rnd = -1

    shares_final = False               # the nodes trained it: no re-scoring from or for in-process runs

    def provenance(self) -> dict:
        """The runner's provenance plus the Flower settings the run's numbers depend on (`fedprism show`)."""
        return {**super().provenance(), "flower": self.settings.knobs(FLOWER_RECORDED)}

    def apply_drift(self, rnd: int, evaluator: Evaluator | None) -> int:
        """Round `rnd` begins: the evaluation messages say it (a node scores its rows of that round). Under
        class drift, when the clients' rows change, the sizes the replies are checked against become that
        round's (`DriftSchedule.split_sizes`) and every cached score of the clients' own splits is dropped;
        the nodes change their rows themselves (`Node.at_round`). Returns the absent (client, class) pairs."""
        self._rnd = self.engine.rnd = rnd
        if self.drift is None:
            return 0
        key = self.drift.key(rnd)
        if key != self._drift_key:
            self.engine.sizes = {**self.engine.sizes, **self.drift.split_sizes(self._drift_counts, rnd)}
            self.engine.cache = {k: v for k, v in self.engine.cache.items() if k[0] in ("global", "global_val")}
            if evaluator is not None:
                evaluator.forget()
            self._drift_key = key
        return self.drift.absent(rnd)

    @staticmethod
    def finished(store: Store, run_id: str) -> RunResult:
        """The stored result of a finished run (re-running it is a no-op, as in the simulator)."""
        row = store.run(run_id)
        return RunResult(run_id, "finished", json.loads(row["final"] or "{}"), store.round_metrics(run_id))

    def local_work(self, plan: Plan, rnd: int) -> tuple[Update | None, dict[int, str]]:
        if self.settings.secagg == "secaggplus":     # the uploads reach the server only as their sum
            return secure_round(self, plan, rnd)
        link, s = self.link, self.settings
        self._rnd = rnd
        link.refresh()
        t0 = time.time()
        bodies = {int(c): codec.encode_plan(plan.subset(np.array([r])), rnd, int(c), self.cfg.run_id, self.algo)
                  for r, c in enumerate(plan.clients)}
        deadline = self.system.model.deadline if self.system is not None and self.system.model.deadline > 0 \
            else s.round_timeout             # `system.deadline`: a node that has not answered by then is dropped
        replies, failed = link.exchange("train", bodies, deadline, group=str(rnd))
        parts = []
        for r, c in enumerate(plan.clients):
            c = int(c)
            if c not in replies:
                continue
            row = plan.subset(np.array([r]))
            try:
                up = codec.decode_update(replies[c], row, self.cfg.run_id, self.algo)
                parts.append(self.trust(up, row))
            except Exception as e:  # noqa: BLE001 - a malformed or refused reply is that client's failure
                failed[c] = f"train: malformed reply ({type(e).__name__}: {e})" if not isinstance(e, Refused) \
                    else f"train: rejected by the server: {e}"
        if parts:                                # metrics every accepted reply carries (names are the node's word)
            common = set.intersection(*[set(p.metrics) for p in parts])
            for p in parts:
                p.metrics = {k: v for k, v in p.metrics.items() if k in common}
        self._records.append(("flower_round", None, {
            "sent": len(plan.clients), "replies": len(parts), "connected": len(link.node_of),
            "exchange_s": round(time.time() - t0, 3)}))
        _log(f"round {rnd}: {len(parts)}/{len(plan.clients)} replies in {time.time() - t0:.1f}s"
             + (f"; failed {sorted(failed)}" if failed else ""))
        failed = link.clean(failed)                     # reasons quote the nodes' words
        if len(parts) < s.min_replies:
            self._records.append(("round_skipped", None, {"replies": len(parts), "min_replies": s.min_replies,
                                                          "clients": [int(p.clients[0]) for p in parts]}))
            _log(f"round {rnd}: {len(parts)} replies < min-replies={s.min_replies}: update skipped")
            return None, failed
        return Update.concat(parts), failed

    def trust(self, up: Update, row: Plan) -> Update:
        """The server's checks of one decoded train reply, before `receive` (which checks the declared
        upload's shapes, dtypes and finiteness): the sample count (`trust.sample_count`: refused unless an
        exact count; capped at `max-samples`, recorded `capped`; a
        registered count replaces the node's, recorded `registry_count`), and the update norm relative
        to what the client was sent (refused above float32's range; above `update-norm-bound`: rejected
        or clipped, recorded `norm_bound`). Raises `Refused`."""
        c = int(up.clients[0])
        comp = self.ctx.compress
        if comp is not None and comp.compressed(self.upload):    # encoded rows: checked, then decoded here
            _, bad = validate_update(up, comp.wire_spec(self.upload))
            if bad:
                raise Refused("payload", bad[c])
            up, bad = comp.decode_update(up, row.payload, self.upload)
            if bad:
                raise Refused("payload", bad[c])
        _, bad = validate_update(up, self.upload)           # this row alone: a bad row never reaches concat
        if bad:
            raise Refused("payload", bad[c])
        for k, v in up.metrics.items():
            if not k.isprintable() or len(k) > 200:         # names are stored and printed as sent
                raise Refused("metrics", f"a metric name is printable text of at most 200 characters, got "
                                         f"{k[:60]!r}")
            if tuple(v.shape) != (1,):
                raise Refused(f"m.{k}", f"a metric is one number per client, got shape {tuple(v.shape)}")
        reported = float(up.n_samples[0])
        n, capped = sample_count(reported, self.link.cap(c))
        if n == 0:                                         # all-zero weights would leave nothing to average
            raise Refused("n_samples", "0 samples: an update without weight")
        if capped:
            self._records.append(("capped", c, {"field": "n_samples", "reported": reported, "used": n}))
        reg = self.link.registry.samples_of(c) if self.link.registry is not None else None
        if reg is not None and n != reg:                  # the operator's count, not the node's
            self._records.append(("registry_count", c, {"field": "n_samples", "reported": reported, "used": reg}))
            n = float(reg)
        up.n_samples = torch.tensor([n], dtype=torch.float64)
        for k, v in up.payload.items():
            if v.is_floating_point() and not bool(torch.isfinite(v).all()):
                raise Refused(f"u.{k}", "holds NaN or Inf")
        norm = update_norm(up.payload, row.payload)
        if not norm <= FLOAT32_MAX:
            raise Refused("update", f"norm {norm:.3g} overflows float32")
        bound = self.settings.update_norm_bound
        if bound > 0 and norm > bound:
            act = self.settings.norm_action
            self._records.append(("norm_bound", c, {"norm": norm, "bound": bound, "action": act}))
            if act == "reject":
                raise Refused("update", f"norm {norm:.6g} > update-norm-bound {bound:g}")
            up.payload = clip_update(up.payload, row.payload, bound, norm)
        return up

    def evaluate_round(self, evaluator: Evaluator, state: dict) -> tuple[dict, list[tuple]]:
        metrics, rows = self._evaluate_round(evaluator, state)
        if "local_acc" in metrics:               # who computed what (the server believes the nodes' scores)
            on_server = self.engine.shared is not None
            shared_keys = sorted(k for k in metrics if k.startswith(("global", "global_val")) or
                                 k.endswith("_model_acc"))
            node_keys_ = sorted(k for k in metrics if k not in shared_keys and
                                k not in ("eval_s", "models_evaluated"))
            client_side = self.algo.client_side_inference()
            by_server = [k for k in shared_keys if on_server and (not client_side or k.endswith("_model_acc"))]
            metrics["node_reported"] = 1
            metrics["global_on_server"] = int(bool(by_server) and set(by_server) == set(shared_keys))
            self._records.append(("eval_trust", None, {
                "node_reported": sorted(set(node_keys_) | (set(shared_keys) - set(by_server))),
                "server_scored": sorted(by_server)}))
        return metrics, rows

    def _evaluate_round(self, evaluator: Evaluator, state: dict) -> tuple[dict, list[tuple]]:
        self.link.refresh()
        N = self.ctx.num_clients
        clients = np.arange(N)
        extra = list(self.algo.extra_models(state).values())
        payload = self.algo.eval_payload(state, clients)
        if self.algo.client_side_inference():        # the inference exists only on the nodes
            t_eval = time.time()
            scores = evaluator.from_results(self.engine.score_payloads(self._rnd, payload, N, evaluator.splits))
            if extra:
                self.engine.prefetch(self._rnd, torch.zeros(0, self.ctx.spec.size), extra, True)
            metrics, rows = self.round_metrics(scores, state, t_eval)
        else:
            models = self.algo.inference(self.engine, clients, payload, {}).single
            self.engine.prefetch(self._rnd, models, extra, bool(self.cfg["eval.global"]))
            metrics, rows = super().evaluate_round(evaluator, state)
        if "local_acc" in metrics:
            _log(f"evaluation: local_acc {metrics['local_acc']:.4f}"
                 + (f", global_acc {metrics['global_acc']:.4f}" if "global_acc" in metrics else ""))
        return metrics, rows

    def extra_records(self, rnd: int) -> list[Record]:
        out = [(kind, c, {k: printable(v) if isinstance(v, str) else v for k, v in data.items()})
               for kind, c, data in self._records + self.link.pop_events()]    # whatever a node sent
        self._records = []
        return out
