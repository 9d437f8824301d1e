"""What fedprism prints is safe and parseable: user text (run labels, sweep names) reaches a terminal with
its control characters escaped, `--json` prints valid JSON (NaN and infinities as null), and `threads` is
bounded (docs/robustness.md, "Configuration, TOML and sweep files")."""

from __future__ import annotations

import io
import json
import math

import pytest

from fedprism.cli import json_text, main
from fedprism.errors import ConfigError, printable
from fedprism.experiment.config import resolve
from fedprism.experiment.progress import Progress
from fedprism.experiment.store import Store
from fedprism.experiment.sweep import dump_sweep, run_sweep

EVIL = "evil\x1b]0;owned\x07\x1b[2J\r\nfake line\u202e"
TINY = dict(dataset="digits", clients=4, rounds=1, local_epochs=1, model="mlp", engine="sequential",
            method="fedavg")


def _strict(text: str):
    """json.loads that refuses NaN, Infinity and -Infinity, as RFC 8259 parsers do."""
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))


def test_printable_escapes_every_control_and_format_character():
    assert printable(EVIL) == "evil\\x1b]0;owned\\x07\\x1b[2J\\r\\nfake line\\u202e"
    assert printable("a\nb\x1b", newlines=True) == "a\nb\\x1b" and printable("Fed-PRISM ü") == "Fed-PRISM ü"


@pytest.mark.parametrize("tty", [True, False])
def test_progress_lines_escape_the_label(tty):
    out = io.StringIO()
    bar = Progress(2, True, EVIL, stream=out, tty=tty)
    bar.update(1, {"local_acc": 0.5})
    bar.update(2, None)
    text = out.getvalue()
    assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text and "evil\\x1b]0;owned" in text


def test_labels_are_escaped_in_sweep_runs_show_and_error_output(tmp_path, capsys):
    f = tmp_path / "s.toml"
    f.write_text(dump_sweep(EVIL, {k: v for k, v in TINY.items() if k != "method"},
                            [dict(label=EVIL, method="fedavg")]))
    db = tmp_path / "e.db"
    assert run_sweep(str(f), str(db), progress=True) == 0
    outputs = [capsys.readouterr()]
    for cmd in (["runs"], ["runs", "--sweep", EVIL], ["show", Store(db).runs()[0]["run_id"]]):
        assert main([*cmd, "--db", str(db)]) == 0
        outputs.append(capsys.readouterr())
    bad = tmp_path / "bad.toml"          # a refused run: the error line names the run by its label
    bad.write_text(dump_sweep("x", {**{k: v for k, v in TINY.items() if k != "method"}, "clients": 4},
                              [dict(label=EVIL, method="fedprism")]))
    assert main(["sweep", str(bad), "--db", str(tmp_path / "b.db"), "--quiet"]) == 2
    outputs.append(capsys.readouterr())
    text = "".join(o.out + o.err for o in outputs)
    assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text and "\r" not in text
    assert text.count("evil\\x1b]0;owned") >= 5


def test_json_output_is_valid_json_with_null_for_non_finite_numbers(tmp_path, capsys, monkeypatch):
    assert json_text({"a": float("nan"), "b": [float("inf"), -float("inf"), 1.5], "c": None}) == \
        '{"a": null, "b": [null, null, 1.5], "c": null}'
    db = tmp_path / "j.db"
    assert main(["run", *(f"{k}={v}" for k, v in TINY.items()), "--db", str(db), "--quiet", "--json"]) == 0
    assert _strict(capsys.readouterr().out.strip().splitlines()[-1])["status"] == "finished"
    assert main(["runs", "--db", str(db), "--json"]) == 0
    (rec,) = _strict(capsys.readouterr().out)
    assert rec["status"] == "finished"

    from fedprism.experiment import runner

    real = runner.Experiment.run

    def nan_run(self, stop_after=None):
        res = real(self, stop_after)
        res.final.update(local_acc=math.nan, ad=math.inf, seconds=-math.inf)
        return res
    monkeypatch.setattr(runner.Experiment, "run", nan_run)
    assert main(["run", *(f"{k}={v}" for k, v in TINY.items()), "seed=1", "--db", str(db), "--quiet",
                 "--json"]) == 0
    out = _strict(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["local_acc"] is None and out["ad"] is None and out["seconds"] is None and out["status"] == "finished"


def test_threads_is_bounded_by_a_fixed_limit():
    assert resolve({"threads": 256})["threads"] == 256
    for bad in (257, 1024, 100000):
        with pytest.raises(ConfigError, match=r"'threads' = \d+ is not valid: an integer in \[0, 256\]"):
            resolve({"threads": bad})
