"""The command line: help, methods, partition, demo (quick, on digits), export, report."""

from __future__ import annotations

import pytest

from fedprism.cli import main


def test_help_of_every_subcommand(capsys):
    for sub in ("run", "demo", "sweep", "report", "runs", "show", "verify", "partition", "methods", "export",
                "data"):
        with pytest.raises(SystemExit) as e:
            main([sub, "--help"])
        assert e.value.code == 0
        assert "usage: fedprism " + sub in capsys.readouterr().out


def test_a_missing_run_id_names_only_it_and_verify_needs_a_round(capsys):
    for sub in ("verify", "show"):
        with pytest.raises(SystemExit):
            main([sub])
        assert capsys.readouterr().err.strip().endswith("the following arguments are required: run")
    assert main(["verify", "abc", "--rounds", "0", "--db", "/nonexistent/never.db"]) == 2
    assert "option '--rounds' = 0 is not valid: an integer >= 1" in capsys.readouterr().err


def test_methods_lists_parameters(capsys):
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    for key in ("fedprism.k", "fedprism.m", "fedprism.every", "fedprism.alpha", "fedprism.clustering",
                "fedclust.variant", "local.participation", "partition.alpha", "fraction"):
        assert key in out


def test_every_listed_default_can_be_typed_back():
    """What `fedprism methods` shows as a parameter's default, given back as `key=value`, is accepted and
    gives the default's configuration (`auto`, not `None`, where `auto` stands for an unset default)."""
    from fedprism.algorithms import REGISTRY
    from fedprism.cli import _shown
    from fedprism.experiment.config import parse_value, resolve

    autos = 0
    for name, cls in REGISTRY.items():
        default = resolve({"method": name})
        for k, p in cls.params.items():
            shown = _shown(p)
            if shown == "None":                      # a default no value stands for (the help says "unset")
                continue
            typed = resolve({"method": name, f"{name}.{k}": parse_value(shown)})
            assert typed.run_id == default.run_id, (name, k, shown)
            autos += shown == "auto"
    assert autos >= 3                                # fedavg.server_lr, .server_tau, fedprism_dual.inference_weight


def test_methods_names_one_method_and_wraps_to_the_terminal(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "72")
    assert main(["methods", "ifca"]) == 0
    out = capsys.readouterr().out
    assert "ifca.k" in out and "fedprism.k" not in out and "Experiment keys" not in out
    lines = out.splitlines()
    assert lines[1].startswith("ifca  (Ghosh et al. 2020")                   # the paper line is not cut
    assert max(map(len, lines[2:])) <= 72 and all(x == x.rstrip() for x in lines)
    assert "a FedAvg warm-up" in out.replace("\n" + " " * 34, " ")     # wrapped, not cut
    assert main(["methods", "fedprsim"]) == 2
    assert "no method 'fedprsim' (did you mean fedprism?)" in capsys.readouterr().err


def test_table_wraps_only_the_last_column_under_its_own_start():
    from fedprism.textable import table

    t = table([["a", "one two three four five six seven eight nine ten eleven twelve"]], ["k", "meaning"], 36)
    assert t.splitlines() == ["k  meaning", "-  ---------------------------------",
                              "a  one two three four five six seven", "   eight nine ten eleven twelve"]
    assert table([["a", "short"]], ["k", "meaning"], 36) == table([["a", "short"]], ["k", "meaning"])


def test_partition_prints_summary_metrics_and_png(tmp_path, capsys):
    png = tmp_path / "p.png"
    assert main(["partition", "dataset=digits", "partition=dirichlet", "partition.alpha=0.1", "clients=20",
                 "seed=0", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "wpsi" in out and "hellinger" in out and "n_train" in out
    assert png.exists() and png.stat().st_size > 1000
    assert "domain" not in out.splitlines()[0]           # no domain column where the partition has none


def test_partition_refuses_a_figure_name_it_cannot_write_before_any_work(tmp_path, capsys, monkeypatch):
    """--png needs a .png, .pdf or .svg file name: another suffix, none, or a folder is refused naming the
    option, before the partition is computed (matplotlib would fail after it, or write another name)."""
    import fedprism.experiment.federation as federation

    monkeypatch.setattr(federation, "build_federation", lambda cfg: pytest.fail("computed first"))
    (tmp_path / "d").mkdir()
    for name in ("p.txt", "noext", "d"):
        assert main(["partition", "dataset=digits", "clients=10", "--png", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert "option '--png'" in err and ("ending in .png, .pdf or .svg" in err or "not a folder" in err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


def test_path_errors_name_the_option_and_an_empty_db_is_refused(tmp_path, capsys, monkeypatch):
    """An OS error on a path says which option gave it and what is wrong, in words; `--db ""` and an empty
    $FEDPRISM_DB (which would name the current folder) are refused or ignored."""
    (tmp_path / "afile").write_text("x")
    from fedprism.experiment.store import Store

    db = str(tmp_path / "s.db")
    Store(db).close()
    for out, why in (("afile", "exists and is not a folder"),
                     ("afile/x", "a part of the path is a file, not a folder")):
        assert main(["export", "--db", db, "--out", str(tmp_path / out)]) == 2
        assert capsys.readouterr().err.strip() == f"fedprism: error: --out {tmp_path / out}: {why}"
    (tmp_path / "dbdir").mkdir()
    under = f"{tmp_path / 'afile'} is a file, not a folder"
    for cmd, db_, why in ((["run", "dataset=digits"], "dbdir", "is a folder, not a file"),
                          (["runs"], "dbdir", "is a folder, not a file"),
                          (["run", "dataset=digits"], "afile/x.db", under), (["runs"], "afile/x.db", under)):
        assert main([cmd[0], "--db", str(tmp_path / db_), *cmd[1:]]) == 2
        assert f"results store {tmp_path / db_}: {why}" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "dbdir", "s.db"]
    with pytest.raises(SystemExit) as e:
        main(["runs", "--db", ""])
    assert e.value.code == 2 and "--db: an empty path is not a results store" in capsys.readouterr().err
    monkeypatch.setenv("FEDPRISM_DB", "")
    monkeypatch.chdir(tmp_path)
    assert main(["runs"]) == 2
    assert "no results store at fedprism-results.db" in capsys.readouterr().err


def test_a_path_error_names_a_positional_path_by_itself_and_an_option_by_its_flag(tmp_path):
    """The positional arguments are read from the parser (no list kept by hand): a path given as one is
    named as given (`x.toml: ...`), one given by an option with its flag (`--db x.db: ...`)."""
    import argparse

    from fedprism.cli import _path_error, _positional, build_parser

    positional = _positional(build_parser())
    assert {"file", "run", "stores", "items"} <= positional and not positional & {"db", "out", "png"}
    f, db = str(tmp_path / "x.toml"), str(tmp_path / "x.db")
    args = argparse.Namespace(command="sweep", file=f, db=db)
    assert _path_error(args, PermissionError(13, "Permission denied", f), positional) == \
        f"{f}: permission denied"
    error = _path_error(args, IsADirectoryError(21, "Is a directory", db), positional)
    assert error.startswith(f"--db {db}: ")


def test_a_min_test_beyond_the_test_set_and_running_out_of_memory_are_one_line(capsys, monkeypatch):
    """partition.min_test above the test set's size would repeat it for every client (1e9 ran out of memory
    first); and a size that passes every check but not this machine's RAM ends as one line, exit 2."""
    assert main(["partition", "dataset=digits", "clients=4", "partition.min_test=1000000000"]) == 2
    assert "partition.min_test = 1000000000 is not valid: at most the" in capsys.readouterr().err
    import fedprism.experiment.federation as federation

    def huge(cfg):
        raise MemoryError("Unable to allocate 29.8 GiB for an array")

    monkeypatch.setattr(federation, "build_federation", huge)
    assert main(["partition", "dataset=digits", "clients=4"]) == 2
    assert capsys.readouterr().err.startswith("fedprism: error: out of memory (Unable to allocate 29.8 GiB")


def test_small_input_slips_are_named(tmp_path, capsys, monkeypatch):
    """Every dataset name is checked before the first download starts; an empty run id is named as '';
    a method's key under another method reads "an ifca parameter", not "a ifca"."""
    import fedprism.data.download as dl

    monkeypatch.setattr(dl, "fetch", lambda *a, **k: pytest.fail("downloaded before all names were checked"))
    assert main(["data", "download", "usps", "nosuch", "--dest", str(tmp_path / "d")]) == 2
    assert "'nosuch' is not valid: downloadable datasets are" in capsys.readouterr().err
    from fedprism.experiment.store import Store

    Store(tmp_path / "s.db").close()
    assert main(["export", "--db", str(tmp_path / "s.db"), "--run", "", "--out", str(tmp_path / "e")]) == 2
    assert "s.db has no '';" in capsys.readouterr().err
    assert main(["run", "--db", str(tmp_path / "s.db"), "method=fedavg", "ifca.k=2"]) == 2
    assert "is not valid: an ifca parameter, but method=fedavg" in capsys.readouterr().err


def test_partition_writes_no_file_unless_asked(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["partition", "dataset=digits", "clients=10", "seed=0"]) == 0
    assert "--png FILE draws" in capsys.readouterr().out and list(tmp_path.iterdir()) == []


def test_partition_prints_each_clients_domain_under_domain_mix(tmp_path, capsys):
    from fedprism.experiment.config import parse_overrides, resolve
    from fedprism.experiment.federation import build_federation

    args = ["dataset=digits", "partition=domain_mix", "partition.num_domains=4", "partition.min_classes=3",
            "partition.max_classes=3", "clients=8", "seed=0"]
    assert main(["partition", *args, "--png", str(tmp_path / "p.png")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[-1] == "domain"
    printed = [int(line.split()[-1]) for line in lines[2:10]]
    fed = build_federation(resolve(parse_overrides(args)))
    assert printed == [int(d) for d in fed.meta["client_domains"]]
    assert sorted(printed) == [0, 0, 1, 1, 2, 2, 3, 3]      # balanced over the clients


def test_impossible_partition_is_a_clear_error(capsys):
    assert main(["partition", "dataset=digits", "clients=5000"]) == 2
    err = capsys.readouterr().err
    assert "fedprism: error" in err and ("clients" in err or "num_clients" in err)


def test_quick_demo_on_digits_then_report_and_export(tmp_path, capsys):
    db = str(tmp_path / "demo.db")
    assert main(["demo", "--quick", "--db", db, "dataset=digits"]) == 0
    out = capsys.readouterr().out
    for label in ("FedPrism (paper, routed)", "Fed-PRISM kmeans", "Fed-PRISM covariance", "FedClust", "FedAvg", "Local",
                  "How to read it"):
        assert label in out
    import re
    row = next(x for x in out.splitlines() if x.startswith("FedAvg "))
    assert re.fullmatch(r"FedAvg +0\.\d{4} +0\.\d{4} +0\.\d{4} +\d+\.\d", row)    # seconds to 0.1
    assert main(["report", "--db", db, "--out", str(tmp_path / "rep"), "--no-plots"]) == 0
    assert "| FedAvg | 1 |" in (tmp_path / "rep" / "results.md").read_text()
    assert main(["export", "--db", db, "--out", str(tmp_path / "exp")]) == 0
    header = (tmp_path / "exp" / "rounds.csv").read_text().splitlines()[0]
    assert "local_acc" in header and "bytes_down" in header


def test_listing_runs_starts_without_torch(tmp_path):
    """`fedprism runs` reads the store alone: no torch, scipy or scikit-learn import (each costs seconds at
    start), in a fresh interpreter on a store with a finished run and its checkpoint folder."""
    import subprocess
    import sys

    from fedprism.experiment.config import resolve
    from fedprism.experiment.runner import Experiment
    from fedprism.experiment.store import Store

    db = tmp_path / "r.db"
    Experiment(resolve(dict(dataset="digits", method="fedavg", clients=4, rounds=1, local_epochs=1,
                            engine="sequential")), Store(db)).run()
    code = ("import sys; from fedprism.cli import main; rc = main(['runs', '--db', sys.argv[1]]); "
            "print(rc, sorted(m for m in ('torch', 'scipy', 'sklearn') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code, str(db)], capture_output=True, text=True, timeout=120)
    assert r.stdout.splitlines()[-1] == "0 []", r.stdout + r.stderr
    assert "fedavg" in r.stdout


def test_a_number_is_asked_once(tmp_path, capsys):
    db = str(tmp_path / "r.db")
    assert main(["run", "--db", db, "method=moon", "moon.mu=abc"]) == 2
    assert capsys.readouterr().err.strip().endswith("is not valid: a number >= 0")
    assert not (tmp_path / "r.db").exists()                       # refused before anything was written
