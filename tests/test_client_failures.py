"""Client failures are visible: the end-of-run summary of `fedprism run` prints each failure kind with its
count and first message (one sanitized line each), `fedprism show RUN` lists them, and
`fail_on_client_error=true` (an execution key: the same run id) fails the run with the client's message."""

from __future__ import annotations

import json

import pytest

import fedprism
from fedprism.algorithms import REGISTRY
from fedprism.algorithms.fedavg import FedAvg
from fedprism.cli import main
from fedprism.experiment.config import resolve
from fedprism.experiment.failures import FailureKind, kinds, one_line
from fedprism.experiment.store import Store

TINY = {"dataset": "digits", "model": "mlp", "clients": 4, "rounds": 2, "fraction": 1.0, "local_epochs": 1,
        "engine": "sequential", "method": "flaky"}
ARGS = [f"{k}={json.dumps(v) if isinstance(v, str) else v}" for k, v in TINY.items()]


class Flaky(FedAvg):
    """FedAvg whose clients 1 and 3 raise in the first round (a message of two lines with an escape code)."""

    name = "flaky"

    def client_update(self, plan, trainer, rnd, cstate):
        bad = [int(c) for c in plan.clients if rnd == 0 and int(c) in (1, 3)]
        if bad:
            raise RuntimeError(f"disk quota exceeded on client {bad[0]}\n\x1b[31mretry later")
        return super().client_update(plan, trainer, rnd, cstate)


@pytest.fixture
def flaky():
    fedprism.register(Flaky)
    yield
    REGISTRY.pop("flaky", None)


def test_a_partial_client_failure_reaches_the_summary_and_show(flaky, tmp_path, capsys):
    db = str(tmp_path / "f.db")
    assert main(["run", "--db", db, "--quiet", *ARGS]) == 0                  # the round goes on without them
    out = capsys.readouterr().out
    assert "client updates not used (2;" in out
    lines = [ln for ln in out.splitlines() if ln.strip().startswith("raised ")]
    assert lines == ["  raised RuntimeError: 2 update(s); first in round 1, client 1: RuntimeError: disk quota "
                     "exceeded on client 1\\n\\x1b[31mretry later"]                     # one line, escaped
    run_id = resolve(TINY).run_id
    assert main(["show", run_id, "--db", db]) == 0
    shown = capsys.readouterr().out
    assert "Client failures (updates not used):" in shown and "raised RuntimeError: 2 update(s)" in shown
    assert shown.count("disk quota exceeded on client 3") == 1 and "\x1b" not in shown
    assert main(["run", "--db", db, "--quiet", "--json", *ARGS]) == 0        # stored: the same summary
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["client_failures"]
    assert got == [{"kind": "failure", "what": "RuntimeError", "count": 2, "first_round": 0, "first_client": 1,
                    "message": "RuntimeError: disk quota exceeded on client 1\\n\\x1b[31mretry later"}]


def test_fail_on_client_error_fails_the_run_with_the_message(flaky, tmp_path, capsys):
    db = str(tmp_path / "e.db")
    cfg = resolve({**TINY, "fail_on_client_error": True})
    assert cfg.run_id == resolve(TINY).run_id                                # an execution key
    assert main(["run", "--db", db, "--quiet", *ARGS, "fail_on_client_error=true"]) == 2
    err = capsys.readouterr().err
    assert ("fedprism: error: client 1 failed in round 1: RuntimeError: disk quota exceeded on client 1\\n"
            "\\x1b[31mretry later (2 clients of the round failed); fail_on_client_error=true fails the run") in err
    with Store(db, readonly=True) as s:
        assert s.run(cfg.run_id)["status"] == "failed" and s.round_metrics(cfg.run_id) == []
    assert main(["run", "--db", db, "--quiet", *ARGS]) == 0                  # without it: recorded, finished
    assert "raised RuntimeError: 2 update(s)" in capsys.readouterr().out


def test_failure_kinds_group_by_exception_or_field():
    recs = [{"round": 0, "kind": "failure", "client": 2, "data": {"reason": "ValueError: bad"}},
            {"round": 0, "kind": "rejected", "client": 1, "data": {"reason": "params: non-finite values (NaN/Inf)"}},
            {"round": 1, "kind": "failure", "client": 0, "data": {"reason": "ValueError: worse"}},
            {"round": 1, "kind": "rejected", "client": 3, "data": {"reason": "n_samples: 0 samples"}},
            {"round": 1, "kind": "selection", "client": None, "data": {}}]
    assert kinds(recs) == [FailureKind("failure", "ValueError", 2, 0, 2, "ValueError: bad"),
                           FailureKind("rejected", "params", 1, 0, 1, "params: non-finite values (NaN/Inf)"),
                           FailureKind("rejected", "n_samples", 1, 1, 3, "n_samples: 0 samples")]
    assert one_line("x" * 400) == "x" * 297 + "..."
