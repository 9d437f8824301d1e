"""`fedprism sweep` input checks: a run that cannot start is refused before any run trains, `--limit` is a
count (>= 0), and a sweep's name is not blank."""

from __future__ import annotations

import pytest

from fedprism.cli import main
from fedprism.errors import ConfigError, FedPrismError
from fedprism.experiment.store import Store
from fedprism.experiment.sweep import dump_sweep, load_sweep, run_sweep

BASE = dict(dataset="digits", clients=4, rounds=1, local_epochs=1, model="mlp", engine="sequential")


def write(tmp_path, runs, name="inp", base=BASE):
    f = tmp_path / "s.toml"
    f.write_text(dump_sweep(name, base, runs))
    return f


def test_a_run_over_its_limits_is_refused_by_name_before_any_run_trains(tmp_path, capsys):
    """fedavg then fedprism with clients=4: fedprism.k=5 (its default) exceeds the clients. The sweep
    stops before the fedavg run trains, naming the refused run as its progress lines do."""
    f = write(tmp_path, [dict(label="FedAvg", method="fedavg"), dict(label="Fed-PRISM", method="fedprism")])
    db = tmp_path / "kept.db"
    Store(db).close()                                   # a store that exists stays, with nothing run into it
    with pytest.raises(ConfigError, match=r"\[2/2\] Fed-PRISM seed=0: config key 'fedprism.k' = 5 .*"
                                          r"at most clients=4") as e:
        run_sweep(str(f), str(db), progress=False)
    assert e.value.key == "fedprism.k" and e.value.value == 5
    assert Store(db).runs() == []

    new = tmp_path / "new" / "sub" / "x.db"             # a store (and folders) this command would create
    assert main(["sweep", str(f), "--db", str(new), "--quiet"]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("fedprism: error:")]
    assert len(lines) == 1 and "Fed-PRISM seed=0" in lines[0] and "'fedprism.k'" in lines[0]
    assert "FedAvg seed=0: global" not in err and "results:" not in err    # it names no store it removed
    assert not (tmp_path / "new").exists()
    assert main(["sweep", str(write(tmp_path, [dict(label="FedAvg", method="fedavg")])), "--db", str(new),
                 "--quiet"]) == 0
    assert f"results: {new}" in capsys.readouterr().err


def test_a_data_setting_that_cannot_be_built_is_refused_by_name_before_any_run(tmp_path):
    """Too many clients for the data (the partitioner's own check) in the second run: refused up front."""
    f = write(tmp_path, [dict(label="FedAvg", method="fedavg"),
                         dict(label="Big", method="fedavg", clients=5000)])
    db = tmp_path / "x.db"
    with pytest.raises(FedPrismError, match=r"\[2/2\] Big seed=0: "):
        run_sweep(str(f), str(db), progress=False)
    assert not db.exists()


def test_a_negative_limit_is_refused_and_zero_runs_nothing(tmp_path, capsys):
    f = write(tmp_path, [dict(label="FedAvg", method="fedavg")])
    db = tmp_path / "x.db"
    assert main(["sweep", str(f), "--db", str(db), "--limit", "-1", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "option '--limit' = -1 is not valid: an integer >= 0" in err and not db.exists()
    with pytest.raises(ConfigError, match="--limit"):
        run_sweep(str(f), str(db), progress=False, limit=-3)
    assert run_sweep(str(f), str(db), progress=False, limit=0) == 0    # documented: refreshes hashes only
    assert Store(db).runs() == []


@pytest.mark.parametrize("name", ["", "  ", "\t"])
def test_a_blank_sweep_name_is_refused(tmp_path, name):
    f = write(tmp_path, [dict(label="FedAvg", method="fedavg")], name=name)
    with pytest.raises(ConfigError, match=r"s\.toml: name' = "):
        load_sweep(f)


@pytest.mark.parametrize("label", ["", "  "])
def test_a_blank_run_label_is_refused(tmp_path, label):
    f = write(tmp_path, [dict(label=label, method="fedavg")])
    with pytest.raises(ConfigError, match=r"runs\[0\]\.label' = .*not empty or only whitespace"):
        load_sweep(f)


def test_a_grid_over_the_limit_is_refused_from_its_axes_before_anything_is_expanded(tmp_path, monkeypatch):
    """Eight axes of ten values: 10^8 runs from a file of a few hundred bytes (it grew to 4 GB before any
    output). Refused from the axes' lengths, naming the file, each axis and its length; nothing resolved."""
    import fedprism.experiment.sweep as sweep

    axes = ["seed", "lr", "momentum", "local_epochs", "batch_size", "clients", "rounds", "eval_every"]
    text = 'name = "big"\n[base]\ndataset = "digits"\n[grid]\n' + "".join(
        f"{a} = {[i + 1 for i in range(10)] if a != 'momentum' and a != 'lr' else [i / 20 for i in range(10)]}\n"
        for a in axes) + '[[runs]]\nmethod = "fedavg"\n[[runs]]\nmethod = "fedprox"\n'
    f = tmp_path / "big.toml"
    f.write_text(text)
    assert len(text) < 700
    monkeypatch.setattr(sweep, "resolve", lambda raw: pytest.fail("a run was resolved"))
    with pytest.raises(ConfigError) as e:
        load_sweep(f)
    msg = str(e.value)
    assert str(f) in msg and "at most 100,000 runs; it expands to 200,000,000: 2 [[runs]] table(s)" in msg
    assert all(f"{a} (10)" in msg for a in axes)
    db = tmp_path / "x.db"
    assert main(["sweep", str(f), "--db", str(db), "--quiet"]) == 2 and not db.exists()


def test_the_grid_limit_is_on_the_number_of_runs():
    from pathlib import Path

    from fedprism.experiment.sweep import MAX_SWEEP_RUNS, check_grid_size

    assert check_grid_size(Path("s.toml"), 4, {"seed": 5, "lr": 5000}) == MAX_SWEEP_RUNS == 100_000
    with pytest.raises(ConfigError, match=r"it expands to 100,001: 1 \[\[runs\]\] table\(s\) x the \[grid\] "
                                          r"axes seed \(100001\)"):
        check_grid_size(Path("s.toml"), 1, {"seed": 100_001})
    with pytest.raises(ConfigError, match=r"expands to 100,002: .* axes \(none\)"):
        check_grid_size(Path("s.toml"), 100_002, {})


def test_a_byte_order_mark_is_accepted_in_sweep_and_config_files(tmp_path):
    """Windows editors save UTF-8 with a byte-order mark, which TOML (and tomllib) refuse."""
    from fedprism.experiment.config import load_toml

    f = write(tmp_path, [dict(label="FedAvg", method="fedavg")])
    plain = load_sweep(f)
    f.write_bytes(b"\xef\xbb\xbf" + f.read_bytes())
    name, configs = load_sweep(f)
    assert (name, [c.run_id for c in configs]) == (plain[0], [c.run_id for c in plain[1]])
    c = tmp_path / "run.toml"
    c.write_bytes(b"\xef\xbb\xbfmethod = \"fedavg\"\nrounds = 3\n")
    assert load_toml(c) == {"method": "fedavg", "rounds": 3}
    c.write_bytes(b"\xef\xbb\xbfrounds = 3\n\xff")         # an offset counts the mark's three bytes
    with pytest.raises(ConfigError, match="byte 0xff at offset 14 is not UTF-8"):
        load_toml(c)
