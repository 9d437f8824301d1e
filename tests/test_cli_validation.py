"""The validation score a value is chosen on (`data.val_fraction`), shown by `fedprism run`, `runs` and `show`
beside the test scores: the last evaluation's `val_acc` as the store holds it, and no column without it."""

from __future__ import annotations

import json

from fedprism.cli import main
from fedprism.experiment.store import Store

TINY = ["method=fedavg", "dataset=digits", "model=mlp", "clients=4", "rounds=2", "fraction=1.0", "local_epochs=1", "eval_every=1",
        "engine=sequential", "threads=1"]


def test_val_acc_is_printed_where_the_run_holds_out_validation_rows(tmp_path, capsys):
    db = str(tmp_path / "r.db")
    assert main(["run", "--db", db, "--json", *TINY, "data.val_fraction=0.3"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    with Store(db, readonly=True) as store:
        last = store.round_metrics(out["run_id"])[-1]
    assert out["val_acc"] == last["val_acc"] and "val_acc" not in json.dumps(store_final(db, out["run_id"]))
    assert main(["run", "--db", db, "--json", *TINY]) == 0              # no validation rows: no val_acc
    plain = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "val_acc" not in plain
    assert main(["runs", "--db", db]) == 0
    table = capsys.readouterr().out.splitlines()
    head = table[0].split()
    assert "val" in head
    rows = {line.split()[0]: line.split() for line in table[2:]}
    assert f"{100 * last['val_acc']:.2f}" in rows[out["run_id"]]
    assert len(rows[plain["run_id"]]) == len(rows[out["run_id"]]) - 1  # its val cell is empty
    assert main(["show", out["run_id"], "--db", db]) == 0
    shown = capsys.readouterr().out
    assert f"val_acc (last evaluation)  {last['val_acc']:.4f}" in shown
    assert main(["runs", "--db", db, "--method", "fedavg"]) == 0


def store_final(db: str, run_id: str) -> dict:
    with Store(db, readonly=True) as store:
        return json.loads(next(r for r in store.runs() if r["run_id"] == run_id)["final"])
