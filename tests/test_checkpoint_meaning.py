"""Checkpoints and kept final states are bound to their run and checked for meaning before use: a file
re-signed with another round, shape or dtype is refused naming the file and the field (no traceback, the
same on every retry until `--fresh`), a keyed run's files cannot be signed again without the key, and a
file larger than the run's state is refused before it is read (docs/robustness.md, "Checkpoints")."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch

from fedprism.cli import main
from fedprism.errors import ConfigError, FedPrismError
from fedprism.experiment import checkpoint
from fedprism.experiment.checkpoint import CheckpointRefused, check_like
from fedprism.experiment.config import resolve
from fedprism.experiment.runner import Experiment
from fedprism.experiment.store import Store

SMALL = dict(dataset="digits", clients=8, rounds=4, fraction=0.5, local_epochs=1, batch_size=16, lr=0.05,
             partition="dirichlet", **{"partition.alpha": 0.5}, engine="sequential", model="mlp")
ARGS = [f"{k}={v}" for k, v in SMALL.items()]


def _interrupted(tmp_path, method="fedavg", **kw):
    c = resolve({**SMALL, "method": method, **kw})
    s = Store(tmp_path / "c.db")
    Experiment(c, s).run(stop_after=2)                      # rounds 0 and 1 stored, checkpoint of round 1
    return c, s


def _resign(path, edit, key=None):
    """What anyone who can write the folder can do without the key: read the file, change it, sign it
    again with the binding its own header names."""
    blob = path.read_bytes()
    (hlen,) = struct.unpack("<Q", blob[8:16])
    binding = json.loads(blob[16:16 + hlen])["binding"]
    payload = checkpoint.load(path, key=key)
    edit(payload)
    checkpoint.save(path, payload, binding)


def _cli(args, capsys):
    rc = main(args)
    err = capsys.readouterr().err
    return rc, err


@pytest.mark.parametrize("round_, why", [(3, "store holds rounds 0..1"), (99, "not a round of this run"),
                                         (2, "store holds rounds 0..1"), (-1, "not a round of this run")])
def test_a_resigned_round_is_refused_until_fresh(tmp_path, capsys, round_, why):
    """Round 3 (the last) re-signed into the checkpoint of a run stored to round 1 used to mark the run
    finished with rounds 2 and 3 missing."""
    c, s = _interrupted(tmp_path)
    path = s.checkpoint_path(c.run_id)
    _resign(path, lambda p: p.update(round=round_))
    before = path.read_bytes()
    with pytest.raises(CheckpointRefused) as e:
        Experiment(c, s).run()
    assert e.value.file == str(path) and e.value.field == "round" and why in str(e.value)
    assert s.run(c.run_id)["status"] == "failed" and len(s.round_metrics(c.run_id)) == 2   # nothing lost
    args = ["run", *ARGS, "method=fedavg", "--db", str(tmp_path / "c.db"), "--quiet"]
    for _ in range(2):                                       # the same clear line on every retry
        rc, err = _cli(args, capsys)
        assert rc == 2 and "Traceback" not in err
        assert err.startswith(f"fedprism: error: checkpoint {path}: round: ") and "--fresh" in err
        assert len(err.strip().splitlines()) == 1 and path.read_bytes() == before
    rc, err = _cli([*args, "--fresh"], capsys)
    assert rc == 0 and "--fresh: dropped" in err
    assert s.run(c.run_id)["status"] == "finished"
    assert [m["round"] for m in s.round_metrics(c.run_id)] == [0, 1, 2, 3] and not path.exists()


def _w(p):
    return p["state"]["w"]


@pytest.mark.parametrize("edit, field, says", [
    (lambda p: p["state"].update(w=_w(p)[:-1]), "state['w']", "a tensor float32 (8969,), the method declares "
                                                             "a tensor float32 (8970,)"),
    (lambda p: p["state"].update(w=_w(p).double()), "state['w']", "float64"),
    (lambda p: p["state"].update(w=_w(p).numpy()), "state['w']", "an array float32"),
    (lambda p: p["state"].pop("w"), "state['w']", "missing"),
    (lambda p: p.update(seen=np.zeros(9, bool)), "seen", "one bool per client"),
    (lambda p: p.update(elapsed=float("nan")), "elapsed", "seconds >= 0"),
    (lambda p: p.update(round=True), "round", "an integer round"),
], ids=["shape", "dtype", "numpy", "missing", "seen", "elapsed", "bool round"])
def test_a_resigned_state_of_another_shape_or_dtype_is_refused_naming_the_field(tmp_path, edit, field, says):
    """A float64 `w` used to train on and end `diverged`; a shorter one gave a traceback on every retry."""
    c, s = _interrupted(tmp_path)
    path = s.checkpoint_path(c.run_id)
    _resign(path, edit)
    with pytest.raises(CheckpointRefused) as e:
        Experiment(c, s).run()
    assert (e.value.file, e.value.field) == (str(path), field) and says in str(e.value)
    assert isinstance(e.value, FedPrismError) and path.exists()


def test_pending_rows_of_mmap_storage_are_checked_against_the_declarations(tmp_path):
    c, s = _interrupted(tmp_path, method="local", **{"state.storage": "mmap"})
    path = s.checkpoint_path(c.run_id)

    def edit(p):
        pend = p["client_rows"]["pending"]["w"]
        pend["clients"] = pend["clients"] + 100                # clients that do not exist
    _resign(path, edit)
    with pytest.raises(CheckpointRefused) as e:
        Experiment(c, s).run()
    assert e.value.field == "client_rows.pending['w'].clients" and "0..7" in str(e.value)


def test_check_like_lets_stacks_of_models_grow_and_nothing_else():
    N = 8
    init = {"w": torch.zeros(1, 5), "assign": torch.zeros(N, dtype=torch.long), "d": torch.zeros(N, 5),
            "g": torch.zeros(5), "sub": {"m": np.zeros((2, 3))}}
    grown = {**init, "w": torch.zeros(3, 5), "opt": {"w": {"m": torch.zeros(3, 5, dtype=torch.float64)}}}
    check_like(grown, init, "state", N)                       # CFL split twice; state made on first use
    for bad, field in [({**init, "w": torch.zeros(3, 6)}, "state['w']"),
                       ({**init, "d": torch.zeros(N + 1, 5)}, "state['d']"),        # one row per client
                       ({**init, "g": torch.zeros(6)}, "state['g']"),
                       ({**init, "assign": torch.zeros(N, dtype=torch.int32)}, "state['assign']"),
                       ({**init, "sub": {"m": np.zeros((2, 4))}}, "state['sub']['m']"),
                       ({**init, "sub": {"m": torch.zeros(2, 3, dtype=torch.float64)}}, "state['sub']['m']")]:
        with pytest.raises(CheckpointRefused) as e:
            check_like(bad, init, "state", N)
        assert e.value.field == field


def test_a_kept_final_state_of_another_dtype_is_refused_until_fresh_trains_again(tmp_path, capsys):
    """Per-FedAvg's `eval_steps` is evaluation-only: the second configuration re-scores the first one's kept
    final state. Re-signed as float64 it used to fail in the evaluation (a traceback on every retry, and
    `--fresh` kept the file); now it is refused by name and `--fresh` trains the configuration."""
    db = tmp_path / "k.db"
    c1 = resolve({**SMALL, "method": "perfedavg", "rounds": 2})
    c2 = c1.with_(**{"perfedavg.eval_steps": 2})
    assert c1.train_id == c2.train_id and c1.run_id != c2.run_id
    s = Store(db)
    Experiment(c1, s).run()
    kept = s.final_path(c1.train_id)
    _resign(kept, lambda p: p["state"].update(w=p["state"]["w"].double()))
    with pytest.raises(CheckpointRefused) as e:
        Experiment(c2, s).run()
    assert (e.value.file, e.value.field) == (str(kept), "state['w']")
    args = ["run", *ARGS, "method=perfedavg", "rounds=2", "perfedavg.eval_steps=2", "--db", str(db), "--quiet"]
    for _ in range(2):
        rc, err = _cli(args, capsys)
        assert rc == 2 and err.startswith(f"fedprism: error: kept final state {kept}: state['w']: ")
        assert "--fresh" in err and "Traceback" not in err
    rc, err = _cli([*args, "--fresh"], capsys)
    assert rc == 0
    row = s.run(c2.run_id)
    assert row["status"] == "finished" and "rescored_from" not in json.loads(row["final"])   # it trained
    assert len(s.round_metrics(c2.run_id)) == 2
    assert checkpoint.load(kept)["state"]["w"].dtype == torch.float32          # kept again, by this run


def test_an_earlier_format_is_refused_with_a_message_fresh_clears(tmp_path, capsys):
    """A checkpoint of format version 1 (no binding) is refused naming the file and the version."""
    import hashlib

    c, s = _interrupted(tmp_path)
    path = s.checkpoint_path(c.run_id)
    blob = path.read_bytes()
    (hlen,) = struct.unpack("<Q", blob[8:16])
    header = json.loads(blob[16:16 + hlen])
    header["version"] = 1
    del header["binding"], header["mac"]
    hdr = json.dumps(header).encode()
    body = checkpoint.MAGIC + struct.pack("<Q", len(hdr)) + hdr + blob[16 + hlen:-32]
    path.write_bytes(body + hashlib.sha256(body).digest())
    args = ["run", *ARGS, "method=fedavg", "--db", str(tmp_path / "c.db"), "--quiet"]
    rc, err = _cli(args, capsys)
    assert rc == 2 and f"checkpoint {path}: version: written by an earlier fedprism in format version 1" in err
    assert _cli([*args, "--fresh"], capsys)[0] == 0 and s.run(c.run_id)["status"] == "finished"


def test_an_oversized_checkpoint_is_refused_before_it_is_read(tmp_path, capsys, monkeypatch):
    c, s = _interrupted(tmp_path)
    path = s.checkpoint_path(c.run_id)
    bound = Experiment(c, s).checkpoint_bytes()
    assert path.stat().st_size < bound < 64 << 20            # the bound follows the run's state size
    with open(path, "r+b") as f:                              # a sparse file: no disk used
        f.truncate(bound + 1)
    from pathlib import Path
    real = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda p: pytest.fail("read") if p == path else real(p))
    args = ["run", *ARGS, "method=fedavg", "--db", str(tmp_path / "c.db"), "--quiet"]
    for _ in range(2):
        rc, err = _cli(args, capsys)
        assert rc == 2 and f"checkpoint {path}: size: {bound + 1} bytes, more than this run's state" in err
    assert "out of memory" not in err and path.stat().st_size == bound + 1
    assert _cli([*args, "--fresh"], capsys)[0] == 0 and not path.exists()


def _key(tmp_path, name="k", n=32):
    f = tmp_path / name
    f.write_bytes(bytes(range(n)))
    return str(f)


def test_a_keyed_checkpoint_cannot_be_signed_again_without_the_key(tmp_path):
    """With checkpoint.key the trailer is an HMAC: a file re-signed with a plain SHA-256 is discarded, the
    run starts from round 0 and ends with the numbers of an uninterrupted run. The key is no part of the
    run id, and a resume under the key gives the numbers of a run without one."""
    key = _key(tmp_path)
    c, s = _interrupted(tmp_path, **{"checkpoint.key": key})
    assert c.run_id == resolve({**SMALL, "method": "fedavg"}).run_id
    path = s.checkpoint_path(c.run_id)
    secret = checkpoint.read_key(key)
    assert checkpoint.load(path, key=secret)["round"] == 1
    _resign(path, lambda p: p.update(round=3), key=secret)
    res = Experiment(c, s).run()
    assert res.resumed_from is None and [m["round"] for m in s.round_metrics(c.run_id)] == [0, 1, 2, 3]
    (note,) = s.records(c.run_id, "checkpoint_discarded")
    assert "not signed with this run's checkpoint.key" in note["data"]["reason"]
    plain = Store(tmp_path / "plain.db")
    ref = Experiment(resolve({**SMALL, "method": "fedavg"}), plain).run()
    assert res.final["local_acc"] == ref.final["local_acc"] and res.final["global_acc"] == ref.final["global_acc"]


def test_a_keyed_checkpoint_needs_its_key_and_resumes_with_it(tmp_path):
    key = _key(tmp_path)
    c, s = _interrupted(tmp_path, **{"checkpoint.key": key})
    path = s.checkpoint_path(c.run_id)
    bare = resolve({**SMALL, "method": "fedavg"})
    with pytest.raises(CheckpointRefused) as e:               # the key forgotten: refused, kept, not discarded
        Experiment(bare, s).run()
    assert e.value.field == "mac" and "give the run the key" in str(e.value) and path.exists()
    other = c.with_(**{"checkpoint.key": _key(tmp_path, "other", 40)})
    res = Experiment(c, s).run()
    assert res.resumed_from == 1 and res.status == "finished"
    (tmp_path / "second").mkdir()
    c2, s2 = _interrupted(tmp_path / "second", **{"checkpoint.key": key})
    Experiment(other, s2).run()                               # another key: not this run's file, discarded
    assert "checkpoint.key" in s2.records(c2.run_id, "checkpoint_discarded")[0]["data"]["reason"]


@pytest.mark.parametrize("content, says", [(None, "No such file"), (b"short\n", "it holds 5 bytes")])
def test_a_key_file_that_cannot_serve_is_a_config_error_before_the_run_is_stored(tmp_path, content, says):
    f = tmp_path / "key"
    if content is not None:
        f.write_bytes(content)
    s = Store(tmp_path / "k.db")
    c = resolve({**SMALL, "method": "fedavg", "checkpoint.key": str(f)})
    with pytest.raises(ConfigError, match=r"'checkpoint.key' = .*at least 32 bytes.*" + says):
        Experiment(c, s).run()
    assert s.run(c.run_id) is None


def test_a_keyed_checkpoint_copied_to_another_run_is_discarded(tmp_path):
    """Both runs sign with the same key: the HMAC verifies, the binding inside it names the other run."""
    key = _key(tmp_path)
    a, s = _interrupted(tmp_path, **{"checkpoint.key": key})
    b = a.with_(lr=0.04)
    Experiment(b, s).run(stop_after=1)
    s.checkpoint_path(a.run_id).replace(s.checkpoint_path(b.run_id))
    res = Experiment(b, s).run()
    assert res.resumed_from is None
    why = s.records(b.run_id, "checkpoint_discarded")[0]["data"]["reason"]
    assert "binding.run_id" in why and a.run_id in why
