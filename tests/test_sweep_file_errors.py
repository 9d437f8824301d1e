"""A mistake in a sweep file is named where it is: the file, the table (`[base]`, `[grid]`, `[[runs]] #i`,
`[quick]`) and the key, with the nearest valid keys only; a mistyped table is named as it is written
(`[[run]]`), never by dumping its value."""

from __future__ import annotations

import pytest

from fedprism.cli import main
from fedprism.errors import ConfigError
from fedprism.experiment.sweep import load_sweep

HEAD = 'name = "s"\n'


def _error(tmp_path, text: str, name: str = "bad1.toml") -> str:
    f = tmp_path / name
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_sweep(f)
    return str(e.value)


@pytest.mark.parametrize("text,want", [
    ('[base]\ndataset = "digits"\n[[run]]\nmethod = "fedavg"\nlabel = "FedAvg"\n',
     "bad1.toml: unknown table [[run]] (did you mean [[runs]]?)"),
    ('[bse]\ndataset = "digits"\n', "bad1.toml: unknown table [bse] (did you mean [base]?)"),
    ('nmae = "x"\n[base]\ndataset = "digits"\n', "bad1.toml: unknown key nmae (did you mean name?)"),
    ('[base]\ndataset = "digits"\n[[zzzz]]\nmethod = "fedavg"\n',
     "bad1.toml: unknown table [[zzzz]]; a sweep file holds name, description, db, [base], [grid], [[runs]], "
     "[quick]"),
])
def test_an_unknown_table_is_named_as_written(tmp_path, text, want):
    assert _error(tmp_path, HEAD + text) == want


def test_an_unknown_key_names_the_file_the_table_and_the_nearest_keys_only(tmp_path):
    msg = _error(tmp_path, HEAD + '[base]\ndataset = "digits"\nrouns = 3\n[[runs]]\nmethod = "fedavg"\n')
    assert msg == "bad1.toml: [base] key 'rouns' = 3 is not valid: unknown key (did you mean rounds?)"
    msg = _error(tmp_path, HEAD + '[base]\ndataset = "digits"\n[[runs]]\nmethod = "fedavg"\n'
                 '[[runs]]\nmethod = "local"\nlocal_epoch = 2\n')
    assert msg == ("bad1.toml: [[runs]] #2 key 'local_epoch' = 2 is not valid: unknown key (did you mean "
                   "local_epochs?)")
    msg = _error(tmp_path, HEAD + '[base]\ndataset = "digits"\n[grid]\nzzqqxx = [1, 2]\n')
    assert msg == ("bad1.toml: [grid] key 'zzqqxx' = 1 is not valid: unknown key (no key is near it; "
                   "`fedprism methods` lists every key)")
    # the keys it would have listed before: none of them
    assert "known keys" not in msg and "batch_size" not in msg


def test_a_bad_value_in_a_table_is_named_with_the_file_and_the_table(tmp_path):
    msg = _error(tmp_path, HEAD + '[base]\ndataset = "digits"\nclients = 0\n[quick]\nrounds = 1\n')
    assert msg.startswith("bad1.toml: [base] key 'clients' = 0 is not valid: ")
    msg = _error(tmp_path, HEAD + '[base]\ndataset = "digits"\n[[runs]]\nmethod = "fedavg"\n'
                 'fedavg.weightin = "x"\n')
    assert msg.startswith("bad1.toml: [[runs]] #1 key 'fedavg.weightin' = 'x' is not valid: unknown parameter "
                          "(did you mean fedavg.weighting?)")


def test_a_key_from_the_command_line_is_not_blamed_on_the_file(tmp_path, capsys):
    f = tmp_path / "good.toml"
    f.write_text(HEAD + '[base]\ndataset = "digits"\n[[runs]]\nmethod = "fedavg"\n')
    assert main(["sweep", str(f), "--db", str(tmp_path / "x.db"), "rouns=3"]) == 2
    err = capsys.readouterr().err
    assert "config key 'rouns' = 3 is not valid: unknown key (did you mean rounds?)" in err
    assert "good.toml" not in err
    # a key the file sets too: the command line's value is the one refused
    assert main(["sweep", str(f), "--db", str(tmp_path / "x.db"), "dataset=nope"]) == 2
    err = capsys.readouterr().err
    assert "config key 'dataset' = 'nope' is not valid" in err and "good.toml" not in err


def test_a_run_file_is_still_told_apart_from_a_misspelt_table(tmp_path):
    """`rounds = 3` is near `runs` but is a run's key, not a table: the file is one run's configuration."""
    msg = _error(tmp_path, 'dataset = "digits"\nrounds = 3\n[partition]\nname = "iid"\n', "exp.toml")
    assert "this file has one run's keys" in msg and "run it with `fedprism run" in msg
