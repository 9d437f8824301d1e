"""Plans, updates and evaluation scores <-> Flower records (the only place that knows the wire format).

A train message carries one client's row of the server's `Plan` payload (every named tensor); the reply
carries that client's `Update` row: its payload tensors, its sample count and its training metrics.
The client's own state (`Algorithm.client_state`) never travels. An evaluation message carries either
parameter rows to score (methods whose inference is the server's model) or the client's row of the
method's `eval_payload`, from which the node builds its own inference. Tensors travel as numpy arrays
(dtype and shape preserved), nothing received is ever unpickled, and every field of a reply is parsed
under a guard: a malformed reply raises `ValueError` naming the field (the server records it as that
client's failure).

Payload rows travel as the method encodes them (`wire`: the algorithm, whose `encode(kind, row)` /
`decode(kind, wire)` give e.g. FedSub's sparse subnetworks; None: as they are held), so the bytes the
runner counts (`Algorithm.wire_bytes`) are the bytes of the arrays sent here.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fedprism.protocol import EvalResult, Plan, Rows, Update

PLAN, TASK, UPDATE, META, IDENTITY, MODELS, SCORES = "plan", "task", "update", "meta", "identity", "models", "scores"


def _arr(t: torch.Tensor | np.ndarray) -> Array:
    a = t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)
    return Array(np.ascontiguousarray(a))


def _ten(a: Array) -> torch.Tensor:
    return torch.from_numpy(np.array(a.numpy(), copy=True))


def _names(cfg: Any, key: str) -> list[str]:
    try:
        v = cfg[key]
    except (KeyError, TypeError):
        raise ValueError(f"field {key!r} missing") from None
    if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) for x in v):
        raise ValueError(f"field {key!r} must be a list of names, got {type(v).__name__}")
    return list(v)


def _tensors(arrays: Any, prefix: str, names: list[str]) -> Rows:
    out = {}
    for k in names:
        try:
            out[k] = _ten(arrays[f"{prefix}{k}"])
        except KeyError:
            raise ValueError(f"tensor '{prefix}{k}' missing") from None
        except Exception as e:  # noqa: BLE001 - anything unreadable is a malformed field
            raise ValueError(f"tensor '{prefix}{k}' unreadable ({type(e).__name__}: {e})") from None
    return out


def _int(cfg: Any, key: str) -> int:
    try:
        v = cfg[key]
    except (KeyError, TypeError):
        raise ValueError(f"field {key!r} missing") from None
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise ValueError(f"field {key!r} must be an integer, got {v!r}")
    return int(v)


def _encode(wire: Any, kind: str, row: Rows) -> Rows:
    return row if wire is None else wire.encode(kind, row)


def decode_rows(wire: Any, kind: str, rows: Rows) -> Rows:
    """One client's row of a message of `kind` from the tensors that travelled (`wire.decode`); anything
    malformed raises ValueError."""
    if wire is None:
        return rows
    try:
        return wire.decode(kind, rows)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - anything a malformed encoding trips is a malformed field
        raise ValueError(f"{kind} payload undecodable ({type(e).__name__}: {e})") from None


# -- train -------------------------------------------------------------------------------------------
def encode_plan(plan: Plan, rnd: int, client: int, config_id: str, wire: Any = None) -> RecordDict:
    """One client's plan row (len(plan.clients) == 1) as a train message body, encoded by `wire`."""
    if len(plan.clients) != 1 or int(plan.clients[0]) != client:
        raise ValueError(f"a train message carries exactly client {client}'s row, got clients {plan.clients}")
    payload = _encode(wire, "plan", plan.payload)
    arrays = {f"p.{k}": _arr(v) for k, v in payload.items()}
    task = {"round": int(rnd), "client-id": int(client), "config-id": config_id, "payload": sorted(payload)}
    return RecordDict({PLAN: ArrayRecord(arrays), TASK: ConfigRecord(task)})


def decode_plan(content: RecordDict, wire: Any = None) -> tuple[Plan, int, int, str]:
    """-> (plan for one client, round, client id, config id), decoded by `wire`."""
    arrays, task = content.array_records[PLAN], content.config_records[TASK]
    cid = _int(task, "client-id")
    payload = decode_rows(wire, "plan", _tensors(arrays, "p.", _names(task, "payload")))
    return Plan(np.array([cid], dtype=np.int64), payload), _int(task, "round"), cid, str(task["config-id"])


def encode_update(up: Update, client: int, config_id: str | None = None, wire: Any = None) -> RecordDict:
    """A client's Update (one row) as a train reply body: payload (encoded by `wire`), sample count,
    metrics (not its state), and the experiment it was computed for (`config_id`)."""
    payload = _encode(wire, "update", up.payload)
    arrays = {f"u.{k}": _arr(v) for k, v in payload.items()}
    arrays.update({f"m.{k}": _arr(v) for k, v in up.metrics.items()})
    arrays["n_samples"] = _arr(up.n_samples.to(torch.float64))
    meta = {"client-id": int(client), "payload": sorted(payload), "metrics": sorted(up.metrics)}
    if config_id is not None:
        meta["config-id"] = str(config_id)
    return RecordDict({UPDATE: ArrayRecord(arrays), META: ConfigRecord(meta)})


def decode_update(content: RecordDict, plan_row: Plan, config_id: str | None = None, wire: Any = None) -> Update:
    """The reply to `plan_row`'s message -> Update of one client, its payload decoded by `wire` (shapes are
    checked by the runner against the method's declared upload). With `config_id`, the reply must say it
    was computed for that experiment. Metrics must be finite numbers (they are the node's word, stored as
    is), unless the payload itself holds NaN/Inf: a diverged client, whose update the runner then rejects
    for its payload ("non-finite values"), as in a simulation."""
    try:
        arrays, meta = content.array_records[UPDATE], content.config_records[META]
    except Exception as e:  # noqa: BLE001 - KeyError, or records of the wrong kind
        raise ValueError(f"record {e} missing") from None
    if config_id is not None:
        got = meta["config-id"] if "config-id" in meta else None
        if got != config_id:
            raise ValueError(f"field 'config-id': the reply is for experiment {str(got)[:40]!r}, "
                             f"the server runs {config_id}")
    payload = _tensors(arrays, "u.", _names(meta, "payload"))
    metrics = _tensors(arrays, "m.", _names(meta, "metrics"))
    n = _tensors(arrays, "", ["n_samples"])["n_samples"]
    if not n.is_floating_point() or n.reshape(-1).shape != (1,):
        raise ValueError(f"field 'n_samples' must be one float, got {tuple(n.shape)} {n.dtype}")
    for k, v in {**payload, **metrics}.items():
        if v.dim() == 0 or v.shape[0] != 1:
            raise ValueError(f"tensor {k!r} must have one row, got shape {tuple(v.shape)}")
    payload = decode_rows(wire, "update", payload)
    diverged = any(isinstance(v, torch.Tensor) and v.is_floating_point() and not bool(torch.isfinite(v).all())
                   for v in payload.values())
    for k, v in metrics.items():     # a diverged node's NaN loss passes: the runner rejects its payload
        if v.dtype == torch.bool or v.is_complex() or not (
                diverged or bool(torch.isfinite(v.double()).all())):
            raise ValueError(f"tensor 'm.{k}' must hold finite numbers")
    return Update(plan_row.clients.copy(), payload, n.to(torch.float64).reshape(1), metrics)


# -- evaluate ----------------------------------------------------------------------------------------
def encode_eval(params: torch.Tensor | None, splits: list[str], client: int, payload: Rows | None = None,
                rnd: int | None = None, wire: Any = None) -> RecordDict:
    """Either parameter rows to score (row i on `splits[i]`: 'local' / 'train' on this client's data,
    'global' on the shared test set), or (params None) this client's `eval_payload` row (encoded by
    `wire`), from which the node builds its own inference and scores it on every split of `splits`.
    `rnd`: the round whose client data are scored (they change under class drift, fedprism.data.drift)."""
    if payload is not None:
        payload = _encode(wire, "eval", payload)
    arrays = {"params": _arr(params)} if params is not None else {}
    arrays.update({f"x.{k}": _arr(v) for k, v in (payload or {}).items()})
    task = {"splits": list(splits), "client-id": int(client), "payload": sorted(payload) if payload is not None else []}
    if rnd is not None:
        task["round"] = int(rnd)
    return RecordDict({MODELS: ArrayRecord(arrays), TASK: ConfigRecord(task)})


def eval_round(content: RecordDict) -> int | None:
    """The round an evaluation message scores (None when it does not say)."""
    task = content.config_records[TASK]
    return _int(task, "round") if "round" in task else None


def decode_eval(content: RecordDict, wire: Any = None) -> tuple[torch.Tensor | None, list[str], int, Rows | None]:
    """-> (parameter rows or None, splits, client id, eval payload row (decoded by `wire`) or None)."""
    task, a = content.config_records[TASK], content.array_records[MODELS]
    names = _names(task, "payload")
    params = _ten(a["params"]) if "params" in a else None
    payload = decode_rows(wire, "eval", _tensors(a, "x.", names)) if params is None else None
    return params, _names(task, "splits"), _int(task, "client-id"), payload


def encode_scores(r: EvalResult, client: int) -> RecordDict:
    arrays = {"correct": _arr(r.correct), "loss_sum": _arr(r.loss_sum), "count": _arr(r.count),
              "confusion": _arr(r.confusion)}
    arrays.update({f"alt:{k}": _arr(v) for k, v in r.alternatives.items()})
    return RecordDict({SCORES: ArrayRecord(arrays), META: ConfigRecord({"client-id": int(client)})})


def decode_scores(content: RecordDict, num_classes: int | None = None) -> EvalResult:
    """Scores of n rows; every field checked: counts are integers >= 0, 0 <= correct <= count, the loss
    sum is finite and >= 0, the confusion matrices are [n, C, C] of integers >= 0 summing to the counts,
    alternative-prediction counts lie in [0, count]. A bad field raises ValueError naming it."""
    try:
        a = content.array_records[SCORES]
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"record {e} missing") from None
    t = _tensors(a, "", ["correct", "loss_sum", "count", "confusion"])
    alts = _tensors(a, "", [k for k in a.keys() if isinstance(k, str) and k.startswith("alt:")])
    n = t["count"].reshape(-1).shape[0] if t["count"].dim() == 1 else -1
    for k in ("correct", "count", *alts):
        v = t.get(k, alts.get(k))
        if v.dim() != 1 or v.shape[0] != n or v.is_floating_point() or v.dtype == torch.bool or v.is_complex():
            raise ValueError(f"field {k!r} must be {max(n, 0)} integers, got {tuple(v.shape)} {v.dtype}")
    loss = t["loss_sum"]
    if loss.shape != (n,) or not loss.is_floating_point() or not bool(torch.isfinite(loss.double()).all()) \
            or bool((loss < 0).any()):
        raise ValueError(f"field 'loss_sum' must be {n} finite numbers >= 0")
    count, correct = t["count"].long(), t["correct"].long()
    if bool((count < 0).any()) or bool((correct < 0).any()) or bool((correct > count).any()):
        raise ValueError("field 'correct' / 'count': need 0 <= correct <= count")
    conf = t["confusion"]
    C = conf.shape[-1] if conf.dim() == 3 else -1
    if conf.dim() != 3 or conf.shape != (n, C, C) or (num_classes is not None and C != num_classes) \
            or conf.is_floating_point() or conf.dtype == torch.bool or bool((conf < 0).any()) \
            or not torch.equal(conf.long().sum((1, 2)), count):
        raise ValueError(f"field 'confusion' must be [{n}, C, C] counts summing to 'count', got {tuple(conf.shape)}")
    for k, v in alts.items():
        if bool((v.long() < 0).any()) or bool((v.long() > count).any()):
            raise ValueError(f"field {k!r} must lie in [0, count]")
    return EvalResult(correct, loss.double(), count, conf.long(), {k[4:]: v.long() for k, v in alts.items()})


def reply_client(content: RecordDict) -> int | None:
    """The client id a reply says it comes from (every reply carries it); ValueError when it is not an
    integer."""
    for name in (META, IDENTITY):
        if name in content.config_records and "client-id" in content.config_records[name]:
            v = content.config_records[name]["client-id"]
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise ValueError(f"field 'client-id' must be an integer, got {type(v).__name__}")
            return int(v)
    return None
