"""Plans, updates and evaluation scores <-> Flower records (the only place that knows the wire format).

A train message carries one row of the server's `Plan` (`plan.subset([row])`: the exact start vector
this client is sent, its objective, per-client extras and train mask); the reply carries that client's
`Update` row (trained parameters, sample count, extras). Tensors travel as numpy arrays (dtype and
shape preserved), other extras as JSON: nothing received is ever unpickled.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fedprism.algorithms.base import EvalResult, Plan, Update

PLAN, TASK, UPDATE, META, IDENTITY, MODELS, SCORES = "plan", "task", "update", "meta", "identity", "models", "scores"


def _arr(t: torch.Tensor | np.ndarray) -> Array:
    a = t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)
    return Array(np.ascontiguousarray(a))


def _ten(a: Array) -> torch.Tensor:
    return torch.from_numpy(np.array(a.numpy(), copy=True))


def _opt(x: int | None) -> int:
    return -1 if x is None else int(x)


def _unopt(x: int) -> int | None:
    return None if x < 0 else int(x)


# -- train -------------------------------------------------------------------------------------------
def encode_plan(plan: Plan, rnd: int, client: int, config_id: str) -> RecordDict:
    """One client's plan row (len(plan.clients) == 1) as a train message body."""
    if len(plan.clients) != 1 or int(plan.clients[0]) != client:
        raise ValueError(f"a train message carries exactly client {client}'s row, got clients {plan.clients}")
    arrays = {"start": _arr(plan.start)}
    for k, v in plan.extras.items():
        arrays[f"extra.{k}"] = _arr(v)
    if plan.train_mask is not None:
        arrays["train_mask"] = _arr(plan.train_mask)
    task = {"round": int(rnd), "client-id": int(client), "objective": plan.objective, "epochs": _opt(plan.epochs),
            "down-floats": _opt(plan.down_floats), "config-id": config_id, "extras": sorted(plan.extras)}
    return RecordDict({PLAN: ArrayRecord(arrays), TASK: ConfigRecord(task)})


def decode_plan(content: RecordDict) -> tuple[Plan, int, int, str]:
    """-> (plan for one client, round, client id, config id)."""
    arrays, task = content.array_records[PLAN], content.config_records[TASK]
    extras = {k: _ten(arrays[f"extra.{k}"]) for k in task["extras"]}
    mask = _ten(arrays["train_mask"]) if "train_mask" in arrays else None
    cid = int(task["client-id"])
    plan = Plan(np.array([cid], dtype=np.int64), _ten(arrays["start"]), str(task["objective"]), extras, mask,
                _unopt(int(task["epochs"])), _unopt(int(task["down-floats"])))
    return plan, int(task["round"]), cid, str(task["config-id"])


def encode_update(up: Update, client: int) -> RecordDict:
    """A client's Update (one row) as a train reply body. `start` is not sent back: the server has it."""
    arrays = {"params": _arr(up.params), "n_samples": _arr(up.n_samples.to(torch.float64))}
    tensors, ndarrays, plain = [], [], {}
    for k, v in up.extras.items():
        if isinstance(v, torch.Tensor):
            arrays[f"extra.{k}"] = _arr(v)
            tensors.append(k)
        elif isinstance(v, np.ndarray):
            arrays[f"extra.{k}"] = _arr(v)
            ndarrays.append(k)
        else:
            plain[k] = v
    meta = {"client-id": int(client), "up-floats": _opt(up.up_floats), "tensor-extras": tensors,
            "numpy-extras": ndarrays, "json-extras": json.dumps(plain, default=_jsonable)}
    return RecordDict({UPDATE: ArrayRecord(arrays), META: ConfigRecord(meta)})


def _jsonable(x: Any) -> Any:
    if isinstance(x, (np.generic,)):
        return x.item()
    raise TypeError(f"extra of type {type(x).__name__} cannot be sent to the server (use a tensor)")


def decode_update(content: RecordDict, plan_row: Plan) -> Update:
    """The reply to `plan_row`'s message -> Update (start = the vector that was sent)."""
    arrays, meta = content.array_records[UPDATE], content.config_records[META]
    extras: dict[str, Any] = json.loads(str(meta["json-extras"]))
    for k in meta["tensor-extras"]:
        extras[k] = _ten(arrays[f"extra.{k}"])
    for k in meta["numpy-extras"]:
        extras[k] = np.array(arrays[f"extra.{k}"].numpy(), copy=True)
    params = _ten(arrays["params"])
    n = _ten(arrays["n_samples"]).to(torch.float64).reshape(-1)
    if params.dim() != 2 or params.shape[0] != 1 or n.shape != (1,):
        raise ValueError(f"a reply carries one row: params {tuple(params.shape)}, n_samples {tuple(n.shape)}")
    return Update(plan_row.clients.copy(), params, plan_row.start, n, extras, _unopt(int(meta["up-floats"])))


# -- evaluate ----------------------------------------------------------------------------------------
def encode_eval(params: torch.Tensor, splits: list[str], client: int,
                extras: dict[str, torch.Tensor] | None = None) -> RecordDict:
    """Rows of `params` to score: row i on `splits[i]` ('local': this client's test split; 'global').

    `extras` (row-aligned) marks the rows as an algorithm's `eval_payload`, scored by the node's
    `evaluate_client` (client-side parts included); None: plain models."""
    arrays = {"params": _arr(params)}
    arrays.update({f"x:{k}": _arr(v) for k, v in (extras or {}).items()})
    return RecordDict({MODELS: ArrayRecord(arrays),
                       TASK: ConfigRecord({"splits": list(splits), "client-id": int(client),
                                           "payload": extras is not None})})


def decode_eval(content: RecordDict) -> tuple[torch.Tensor, list[str], int, dict[str, torch.Tensor] | None]:
    task = content.config_records[TASK]
    a = content.array_records[MODELS]
    extras = {k[2:]: _ten(a[k]) for k in a.keys() if k.startswith("x:")} if task.get("payload", False) else None
    return _ten(a["params"]), [str(s) for s in task["splits"]], int(task["client-id"]), extras


def encode_scores(r: EvalResult, client: int) -> RecordDict:
    arrays = {"correct": _arr(r.correct), "loss_sum": _arr(r.loss_sum), "count": _arr(r.count),
              "confusion": _arr(r.confusion)}
    arrays.update({f"alt:{k}": _arr(v) for k, v in r.alternatives.items()})
    return RecordDict({SCORES: ArrayRecord(arrays), META: ConfigRecord({"client-id": int(client)})})


def decode_scores(content: RecordDict) -> EvalResult:
    a = content.array_records[SCORES]
    return EvalResult(_ten(a["correct"]).long(), _ten(a["loss_sum"]).double(), _ten(a["count"]).long(),
                      _ten(a["confusion"]).long(),
                      {k[4:]: _ten(a[k]).long() for k in a.keys() if k.startswith("alt:")})


def reply_client(content: RecordDict) -> int | None:
    """The client id a reply says it comes from (every reply carries it)."""
    for name in (META, IDENTITY):
        if name in content.config_records and "client-id" in content.config_records[name]:
            return int(content.config_records[name]["client-id"])
    return None
