"""Every command an error or a note names works as printed: it carries the store's `--db`, and for a method
registered in a process only (which no `fedprism` command started elsewhere can see) the Python form is
named instead of `fedprism verify`. `fedprism show` names why it cannot tell whether a run's code is
today's, and an empty label is shown as nothing."""

from __future__ import annotations

import json
import sqlite3

import pytest

import fedprism
from fedprism.algorithms import REGISTRY
from fedprism.algorithms.fedavg import FedAvg
from fedprism.cli import main
from fedprism.errors import FedPrismError
from fedprism.experiment.checkpoint import CheckpointRefused
from fedprism.experiment.provenance import ProvenanceMismatch, code_state
from fedprism.experiment.store import Store
from fedprism.experiment.sweep import dump_sweep, run_sweep

TINY = {"dataset": "digits", "model": "mlp", "clients": 3, "rounds": 1, "fraction": 1.0, "local_epochs": 1,
        "engine": "sequential"}


def _args(**over) -> list[str]:
    return [f"{k}={json.dumps(v) if isinstance(v, str) else v}" for k, v in {**TINY, **over}.items()]


def _tamper(db, run_id: str) -> None:
    """Make a stored run read as stored from other code."""
    con = sqlite3.connect(db)
    prov = json.loads(con.execute("SELECT provenance FROM runs WHERE run_id=?", (run_id,)).fetchone()[0])
    prov["code"]["method"].update(sha256="0" * 64, text="0" * 64)
    prov["code"]["method"].pop("tokens", None)
    con.execute("UPDATE runs SET provenance=? WHERE run_id=?", (json.dumps(prov), run_id))
    con.commit()
    con.close()


class InProcess(FedAvg):
    """FedAvg under a name that only this process knows."""

    name = "inprocess_hint"


@pytest.fixture
def inprocess():
    fedprism.register(InProcess)
    yield "inprocess_hint"
    REGISTRY.pop("inprocess_hint", None)


def test_the_stale_run_error_of_the_cli_names_the_store(tmp_path, capsys):
    db = str(tmp_path / "my store.db")                        # a path that needs quoting in a shell
    assert main(["run", "--db", db, "--quiet", "--json", *_args(method="fedavg")]) == 0
    run_id = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["run_id"]
    _tamper(db, run_id)
    assert main(["run", "--db", db, "--quiet", *_args(method="fedavg")]) == 2
    err = capsys.readouterr().err
    assert f"`fedprism verify {run_id} --db '{db}'` checks whether the current code reproduces" in err
    assert f"`fedprism run --fresh {run_id} --db '{db}'`" in err
    assert f"`fedprism verify {run_id}` " not in err
    # `fedprism show`: the same command after "code now"
    assert main(["show", run_id, "--db", db]) == 0
    out = capsys.readouterr().out
    assert f"data not checked here (`fedprism verify {run_id} --db '{db}'` checks whether" in out
    assert f"run {run_id}: fedavg seed 0," in out                           # no label: nothing, not ''
    # a prefix the store does not hold: the listing command with the store
    assert main(["show", "ffff", "--db", db]) == 2
    assert f"`fedprism runs --db '{db}'` lists them" in capsys.readouterr().err


def test_an_in_process_method_gets_the_python_forms_only(inprocess, tmp_path):
    db = tmp_path / "r.db"
    cfg = {**TINY, "method": inprocess}
    run_id = fedprism.run(cfg, db=db, progress=False).run_id
    _tamper(db, run_id)
    with pytest.raises(ProvenanceMismatch) as e:
        fedprism.run(cfg, db=db, progress=False)
    msg = str(e.value)
    assert f"`fedprism.experiment.verify.verify({str(db)!r}, {run_id!r})` in the process that registers " \
           f"'{inprocess}' checks whether the current code reproduces its first rounds" in msg
    assert f"`fedprism verify {run_id}" not in msg and "`fedprism run --fresh" not in msg
    assert e.value.with_fix("another fix").verify == e.value.verify      # the verify advice survives


def test_a_sweep_names_verify_with_the_store_or_the_python_form(inprocess, tmp_path, capsys):
    db = str(tmp_path / "s.db")
    f = tmp_path / "s.toml"
    f.write_text(dump_sweep("hints", TINY, [{"label": "A", "method": "fedavg"}, {"label": "B", "method": inprocess}]))
    assert run_sweep(str(f), db, progress=False) == 0
    with Store(db, readonly=True) as s:
        ids = {r["method"]: r["run_id"] for r in s.runs()}
    _tamper(db, ids["fedavg"])
    capsys.readouterr()
    with pytest.raises(ProvenanceMismatch) as e:
        run_sweep(str(f), db, progress=False)
    err = capsys.readouterr().err
    assert f"`fedprism verify {ids['fedavg']} --db {db}` checks" in err    # the row, the built-in method
    assert f"`fedprism verify RUN --db {db}` checks whether the current code reproduces one" in str(e.value)
    _tamper(db, ids[inprocess])
    with pytest.raises(ProvenanceMismatch) as e:
        run_sweep(str(f), db, progress=False)
    err = capsys.readouterr().err
    assert f"`fedprism.experiment.verify.verify({db!r}, {ids[inprocess]!r})` in the process" in err
    assert f"`fedprism.experiment.verify.verify({db!r}, RUN)` in the process that registers '{inprocess}'" \
        in str(e.value) and "`fedprism verify RUN" not in str(e.value)


def test_show_names_why_it_cannot_tell_and_the_failures_command_names_the_store(tmp_path, capsys):
    """A run of a method registered in a script: its class is not importable by `fedprism show`."""
    db = str(tmp_path / "x.db")
    assert main(["run", "--db", db, "--quiet", "--json", *_args(method="fedavg")]) == 0
    run_id = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["run_id"]
    con = sqlite3.connect(db)
    prov = json.loads(con.execute("SELECT provenance FROM runs").fetchone()[0])
    con.close()
    gone = {**prov, "code": {**prov["code"], "method": {**prov["code"]["method"], "class": "mynova.MyNova"}}}
    assert code_state(gone) == ("cannot tell (class mynova.MyNova is not importable here: ModuleNotFoundError: "
                                "No module named 'mynova')")
    script = {**prov, "code": {**prov["code"], "method": {**prov["code"]["method"], "class": "__main__.MyNova"}}}
    assert code_state(script).startswith("cannot tell (class __main__.MyNova is not importable here (defined in "
                                         "a script's __main__ or a notebook: registered in that process only): ")
    two = {"code": {"model": {"sha256": "a", "file": "a.py + b.py", "class": "a.f -> b.C"}}}
    assert code_state(two) == ("cannot tell (the model fingerprint joins two files (a.py + b.py): a registered "
                               "model's builder and class are not followed here)")
    assert code_state(None) == "cannot tell (no code fingerprint recorded)"
    con = sqlite3.connect(db)
    con.execute("UPDATE runs SET provenance=?", (json.dumps(gone),))
    con.commit()
    con.close()
    assert main(["show", run_id, "--db", db]) == 0
    assert "code now: cannot tell (class mynova.MyNova is not importable here: ModuleNotFoundError" in \
        capsys.readouterr().out


class Flaky(FedAvg):
    """FedAvg whose client 1 raises in the first round."""

    name = "flaky_hint"

    def client_update(self, plan, trainer, rnd, cstate):
        if rnd == 0 and 1 in [int(c) for c in plan.clients]:
            raise RuntimeError("client 1 fails")
        return super().client_update(plan, trainer, rnd, cstate)


def test_the_client_failures_hint_names_the_store(tmp_path, capsys):
    fedprism.register(Flaky)
    try:
        db = str(tmp_path / "f.db")
        assert main(["run", "--db", db, "--quiet", *_args(method="flaky_hint", clients=3)]) == 0
        out = capsys.readouterr().out
        (line,) = [ln for ln in out.splitlines() if ln.startswith("client updates not used")]
        run_id = out.split()[1]
        assert f"`fedprism show {run_id} --db {db}` lists them by round" in line
    finally:
        REGISTRY.pop("flaky_hint", None)


def test_the_store_errors_name_the_store(tmp_path):
    db = tmp_path / "e.db"
    with Store(db) as s, pytest.raises(FedPrismError, match=f"`fedprism runs --db {db}` lists them"):
        s.find("abcd")
    refused = CheckpointRefused("a reason", tmp_path / "e.db.ckpt" / "0123456789abcdef.ckpt")
    assert f"`fedprism run --fresh --db {db}` with this configuration" in str(refused)
    kept = CheckpointRefused("a reason", tmp_path / "e.db.final" / "0123456789abcdef.ckpt", what="kept final state")
    assert f"`fedprism run --fresh --db {db}` with this configuration (or deleting the file) discards it and " \
           "trains again" in str(kept)
    assert "`fedprism run --fresh` with" in str(CheckpointRefused("a reason", tmp_path / "elsewhere.ckpt"))
