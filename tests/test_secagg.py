"""Secure aggregation on Flower through SecAgg+ (fedprism.flower.secagg, docs/flower.md "Secure
aggregation"): the server sees only the sum of the updates, the numbers equal plain aggregation within
SecAgg+'s quantisation, and a method that needs individual uploads is refused with the reason."""

from __future__ import annotations

import copy
import uuid

import numpy as np
import pytest
import torch
from flwr.app import Context, Error, Message, RecordDict

from fedprism.errors import ConfigError
from fedprism.experiment.store import Store
from fedprism.flower.server_app import serve
from fedprism.flower.settings import RunSettings
from test_flower import FakeGrid, nodes_for, offline, run_config, task_identity  # noqa: F401 (fixtures)

EXP = ("method=fedavg dataset=digits clients=4 rounds=1 fraction=1.0 local_epochs=1 lr=0.05 model=mlp "
       "device=cpu engine=sequential seed=4")


class SecGrid(FakeGrid):
    """FakeGrid with Flower's `send_and_receive` (what SecAggPlusWorkflow calls); every train reply's arrays
    are kept, to show what the server received."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.train_arrays: list[dict] = []

    def push_messages(self, messages):
        ids = []
        for m in messages:
            mid = uuid.uuid4().hex
            m.metadata.__dict__["_message_id"] = mid
            nid = m.metadata.dst_node_id
            if nid not in self.nodes:
                continue
            ids.append(mid)
            state = self.states.setdefault(nid, RecordDict())
            ctx = Context(run_id=1, node_id=nid, node_config=self.nodes[nid], state=state, run_config={})
            try:          # a copy, as the wire gives each node its own (the setup stage shares one content)
                reply = self.apps[nid](copy.deepcopy(m), ctx)
            except Exception as e:  # noqa: BLE001 - as Flower's runtime answers a raising ClientApp
                reply = Message(Error(code=2, reason=f"{type(e).__name__}: {e}"), reply_to=m)
            if m.metadata.message_type == "train" and not reply.has_error():
                self.train_arrays.append({k: {n: rec[n].numpy() for n in rec.keys()}
                                          for k, rec in reply.content.array_records.items()})
            self.replies[mid] = reply
        return ids

    def send_and_receive(self, messages, timeout=None):
        return self.pull_messages(self.push_messages(list(messages)))


def run(tmp_path, name, exp=EXP, **kw):
    rc = run_config(exp, tmp_path / f"{name}.db", save_final=str(tmp_path / f"{name}.pt"), **kw)
    grid = SecGrid(nodes_for(4), rc)
    res = serve(grid, rc)
    return res, grid, torch.load(tmp_path / f"{name}.pt", weights_only=False)["state"]


def test_secure_fedavg_equals_plain_within_the_quantisation(tmp_path, task_identity):
    plain, _, ws = run(tmp_path, "plain")
    sec, grid, wq = run(tmp_path, "sec", secagg="secaggplus")
    assert sec.status == "finished" and sec.run_id != plain.run_id
    s = Store(tmp_path / "sec.db")
    rec = s.records(sec.run_id, "secagg")[0]["data"]
    m = s.round_metrics(sec.run_id)[0]
    assert rec["clients"] == [0, 1, 2, 3] and m["accepted"] == 4
    # the bound of the module docstring: n (2c / Q) max_weight / sum_k a_k, plus float32 rounding of w
    from fedprism.experiment.federation import build_federation
    from fedprism.flower.settings import parse_experiment

    n_k = build_federation(parse_experiment(EXP)).n_train
    assert rec["weight_total"] == float(sum(n_k)) and rec["max_weight"] == max(n_k)     # a_k = n_k
    diff = (wq["w"].double() - ws["w"].double()).abs().max().item()
    bound = 4 * (2 * 8.0 / 2 ** 22) * max(n_k) / sum(n_k) + 2 ** -23 * ws["w"].abs().max().item()
    print(f"max |secagg - plain| = {diff:.3g}, bound {bound:.3g}")
    assert 0 < diff <= bound
    # what reached the server in the collect stage: masked integers only, no update in the clear
    for arrays in grid.train_arrays:
        assert all(len(rec) == 0 for rec in arrays.values())


@pytest.mark.parametrize("exp, key, words", [
    (EXP.replace("method=fedavg", "method=fedamp"), "method", "reads each client's upload"),
    (EXP + " fedavg.aggregation=median", "fedavg.aggregation", "robust rule median"),
])
def test_a_method_that_needs_individual_uploads_is_refused(tmp_path, task_identity, exp, key, words):
    rc = run_config(exp, tmp_path / "r.db", secagg="secaggplus")
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as e:
        serve(SecGrid(nodes_for(4), rc), rc)
    assert words in str(e.value)


def test_the_norm_bound_cannot_apply_to_a_sum(tmp_path, task_identity):
    rc = run_config(EXP, tmp_path / "r.db", secagg="secaggplus", update_norm_bound=5.0)
    with pytest.raises(ConfigError, match="update-norm-bound"):
        serve(SecGrid(nodes_for(4), rc), rc)


def test_secagg_is_part_of_the_flower_run_id_and_off_by_default():
    base = RunSettings.from_run_config({"experiment": EXP})
    assert base.run_id == RunSettings.from_run_config({"experiment": EXP, "secagg": "none", "secagg-clip": 8.0}).run_id
    assert RunSettings.from_run_config({"experiment": EXP, "secagg": "secaggplus"}).run_id != base.run_id
    with pytest.raises(ConfigError, match="secagg"):
        RunSettings.from_run_config({"experiment": EXP, "secagg": "secagg"})


@pytest.mark.slow
def test_secure_aggregation_in_the_loopback_deployment(tmp_path):
    """scripts/flower_deploy.py --secagg: SuperLink + 3 SuperNodes on 127.0.0.1 (TLS, node authentication,
    the hostile node refused), FedAvg for one round with SecAgg+; the final model equals the in-process
    run's within the quantisation bound (about 6 minutes on a shared 2-core machine)."""
    import json
    import sys

    from test_flower import ROOT, run_bounded

    pytest.importorskip("cryptography")
    p = run_bounded([sys.executable, str(ROOT / "scripts" / "flower_deploy.py"), "--secagg", "--rounds", "1",
                     "--kill-client", "-1", "--workdir", str(tmp_path / "deploy"), "--json",
                     str(tmp_path / "summary.json"), "--timeout", "1000"], 1080, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-6000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["accepted"] == [3]
    sec = summary["secagg"]
    assert sec["records"] == 1 and sec["clients"] == [0, 1, 2]
    assert 0 < sec["max_abs_diff"] <= sec["bound"]
    assert summary["leftover_processes"] == []
