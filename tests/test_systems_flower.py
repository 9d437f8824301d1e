"""`system.*` on Flower (docs/systems.md): `system.deadline` is the real timeout of a round's train exchange,
so a node that sleeps past it is dropped for the round; the availability trace keeps the server from
contacting the clients it has offline."""

from __future__ import annotations

import time

import pytest

from fedprism.errors import ConfigError
from fedprism.experiment.store import Store
from fedprism.flower.server_app import serve
from test_flower import FakeGrid, nodes_for, offline, run_config, task_identity  # noqa: F401 (fixtures)

EXP = ("method=fedavg dataset=digits clients=3 rounds=2 fraction=1.0 local_epochs=1 lr=0.05 model=mlp "
       "device=cpu engine=sequential seed=2")


class SleepyGrid(FakeGrid):
    """A node whose train replies become available `delay` seconds after the message was sent (it sleeps)."""

    def __init__(self, *a, sleepy: int, delay: float, **kw):
        super().__init__(*a, **kw)
        self.sleepy, self.delay, self.ready = sleepy, delay, {}

    def push_messages(self, messages):
        ids = super().push_messages(messages)
        for m, mid in zip(messages, ids):
            if m.metadata.dst_node_id == self.sleepy and m.metadata.message_type == "train":
                self.ready[mid] = time.monotonic() + self.delay
        return ids

    def pull_messages(self, ids):
        now = time.monotonic()
        return [self.replies.pop(i) for i in list(ids) if i in self.replies and self.ready.get(i, 0) <= now]


@pytest.mark.parametrize("deadline, accepted", [(0.0, [3, 3]), (0.4, [2, 2])])
def test_a_node_sleeping_past_the_deadline_is_dropped(tmp_path, task_identity, deadline, accepted):
    nodes = nodes_for(3)
    sleepy = next(nid for nid, c in nodes.items() if c["client-id"] == 1)
    exp = EXP + (f" system.deadline={deadline}" if deadline else "")
    rc = run_config(exp, tmp_path / "f.db", min_replies=1, round_timeout=10.0)
    grid = SleepyGrid(nodes, rc, sleepy=sleepy, delay=1.2)
    t0 = time.monotonic()
    res = serve(grid, rc)
    took = time.monotonic() - t0
    s = Store(tmp_path / "f.db")
    assert [m["accepted"] for m in s.round_metrics(res.run_id)] == accepted
    fails = [(f["round"], f["client"], f["data"]["reason"]) for f in s.records(res.run_id, "failure")
             if "phase" not in f["data"]]
    if deadline:
        assert fails[0][:2] == (0, 1) and {c for _, c, _ in fails} == {1}     # the sleeper, and only it
        assert "no reply" in fails[0][2] and "within 0.4s" in fails[0][2]
    else:
        assert fails == [] and took >= 2 * 1.2        # waited for the sleeper every round


def test_the_availability_trace_holds_on_flower(tmp_path, task_identity):
    f = tmp_path / "trace.csv"
    f.write_text("1,1\n0,1\n1,0\n")
    exp = EXP + f" system.availability={f}"
    rc = run_config(exp, tmp_path / "a.db", min_replies=1)
    grid = FakeGrid(nodes_for(3), rc)
    res = serve(grid, rc)
    s = Store(tmp_path / "a.db")
    assert [m["accepted"] for m in s.round_metrics(res.run_id)] == [2, 2]
    assert [(r["round"], r["data"]["clients"]) for r in s.records(res.run_id, "unavailable")] == [(0, [1]), (1, [2])]
    sent = sorted((rnd, c) for rnd, c, _ in grid.sent)
    assert sent == [(0, 0), (0, 2), (1, 0), (1, 1)]


@pytest.mark.parametrize("key, value", [("system.speeds", "lognormal"), ("system.async", "fedbuff")])
def test_simulated_speeds_and_fedbuff_are_refused_on_flower(tmp_path, task_identity, key, value):
    extra = f" {key}={value}" + (" system.speeds=equal" if key == "system.async" else "")
    rc = run_config(EXP + extra, tmp_path / "r.db")
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        serve(FakeGrid(nodes_for(3), rc), rc)
