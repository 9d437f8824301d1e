"""What `fedprism run` (table and --json), `show`, `runs` and `report` tell about a run's optional parts: the
simulated clock and who missed a round (`system.*`, docs/systems.md), FedBuff's staleness, the bytes each way
of every run, and the epsilon of DP-FedAvg and local DP-SGD (docs/privacy.md). The columns come from what a
run's rounds store (`experiment.result.round_columns`, `summary_extras`), so a run without them shows none."""

from __future__ import annotations

import csv
import json

import pytest

from fedprism.cli import main
from fedprism.experiment.result import round_columns, summary_extras
from fedprism.experiment.store import Store

BASE = ["method=fedavg", "dataset=digits", "model=mlp", "clients=6", "fraction=0.5", "rounds=3", "local_epochs=1"]


def cli(capsys, *args) -> str:
    assert main(list(args)) == 0
    return capsys.readouterr().out


def run_json(capsys, db, *items) -> dict:
    return json.loads(cli(capsys, "run", *BASE, *items, "--db", str(db), "--json", "--quiet"))


def stored(db, run_id) -> tuple[list[dict], dict]:
    with Store(str(db), readonly=True) as store:
        return store.round_metrics(run_id), json.loads(store.find(run_id)["final"])


def rounds_table(out: str) -> tuple[list[str], list[list[str]]]:
    """The header and rows of `show`'s Rounds table."""
    lines = out.split("\nRounds:\n")[1].split("\n\n")[0].splitlines()
    return lines[0].split(), [x.split() for x in lines[2:]]


def section(out: str, title: str) -> dict[str, str]:
    lines = out.split(f"\n{title}\n")[1].split("\n\n")[0].splitlines()
    return {x.split()[0]: x.split()[1] for x in lines[2:]}


# -- the choice of columns, by hand -----------------------------------------------------------------------
def test_round_columns_are_what_some_round_stores_in_a_fixed_order():
    hist = [{"round": 0, "bytes_up": 1, "late": 0, "local_acc": 0.5},
            {"round": 1, "bytes_up": 2, "bytes_down": 3, "sim_clock": 4.0, "dpsgd_epsilon_max": 1.0,
             "dpfedavg_epsilon": 2.0, "dpfedavg_q": 0.5, "dpsgd_steps": 7}]
    assert round_columns(hist) == ["sim_clock", "late", "bytes_down", "bytes_up", "dpfedavg_epsilon",
                                   "dpsgd_epsilon_max"]
    assert round_columns([{"round": 0, "local_acc": 0.1}]) == []
    final = {"local_acc": 0.5, "bytes_up": 9, "sim_clock": 3.0, "unavailable": 2, "dpsgd_epsilon_mean": 0.5,
             "dpsgd_clip": 1.0, "dpfedavg_epsilon": 1.5}
    assert summary_extras(final) == ["sim_clock", "unavailable", "bytes_up", "dpfedavg_epsilon", "dpsgd_epsilon_mean"]


# -- a run with a clock ------------------------------------------------------------------------------------
def test_a_systems_run_shows_its_clock_and_totals_everywhere(tmp_path, capsys):
    db = tmp_path / "s.db"
    out = run_json(capsys, db, "system.availability=bernoulli", "system.availability.p=0.6",
                   "system.speeds=lognormal", "system.compute=400", "system.deadline=2.5")
    hist, final = stored(db, out["run_id"])
    assert len(hist) == 3 and all({"sim_time", "sim_clock", "unavailable", "late"} <= set(h) for h in hist)
    # --json: the clock after the last round and the totals of the rounds
    assert out["sim_clock"] == final["sim_clock"] == pytest.approx(sum(h["sim_time"] for h in hist))
    assert out["unavailable"] == sum(h["unavailable"] for h in hist)
    assert out["late"] == sum(h["late"] for h in hist)
    assert out["bytes_down"] == sum(h["bytes_down"] for h in hist) > 0
    assert out["bytes_up"] == sum(h["bytes_up"] for h in hist)
    # the run's table (answered from the store now)
    table = cli(capsys, "run", *BASE, "system.availability=bernoulli", "system.availability.p=0.6",
                "system.speeds=lognormal", "system.compute=400", "system.deadline=2.5", "--db", str(db))
    rows = {x.split()[0]: x.split()[1:] for x in table.splitlines()[3:]}
    assert rows["sim_clock"] == [f"{final['sim_clock']:.4f}"] and rows["late"] == [str(out["late"])]
    assert rows["unavailable"] == [str(out["unavailable"])] and rows["bytes_down"] == [str(out["bytes_down"])]
    # show: a column per stored metric, each round's value; the totals in Final
    shown = cli(capsys, "show", out["run_id"], "--db", str(db))
    head, body = rounds_table(shown)
    for k in ("sim_time", "sim_clock", "unavailable", "late", "bytes_down", "bytes_up"):
        assert k in head, k
        assert [r[head.index(k)] for r in body] == [
            f"{h[k]:.4f}" if isinstance(h[k], float) else str(h[k]) for h in hist], k
    assert "stale_max" not in head and "dpfedavg_epsilon" not in head
    fin = section(shown, "Final:")
    assert fin["sim_clock"] == f"{final['sim_clock']:.4f}" and fin["late"] == str(out["late"])
    assert fin["bytes_up"] == str(out["bytes_up"]) and fin["unavailable"] == str(out["unavailable"])
    # runs: a simulated-time column, since a listed run has a clock
    listing = cli(capsys, "runs", "--db", str(db))
    assert listing.splitlines()[0].split()[-2:] == ["sim", "s"]
    assert listing.splitlines()[2].split()[-1] == f"{final['sim_clock']:.4f}"
    assert json.loads(cli(capsys, "runs", "--db", str(db), "--json"))[0]["sim_clock"] == final["sim_clock"]


def test_a_plain_run_shows_its_bytes_and_no_clock(tmp_path, capsys):
    db = tmp_path / "p.db"
    out = run_json(capsys, db)
    hist, final = stored(db, out["run_id"])
    assert "sim_clock" not in out and "late" not in out and out["bytes_up"] == final["bytes_up"] > 0
    shown = cli(capsys, "show", out["run_id"], "--db", str(db))
    head, body = rounds_table(shown)
    assert [r[head.index("bytes_up")] for r in body] == [str(h["bytes_up"]) for h in hist]
    assert [r[head.index("bytes_down")] for r in body] == [str(h["bytes_down"]) for h in hist]
    assert not {"sim_time", "sim_clock", "late", "unavailable"} & set(head)
    assert section(shown, "Final:")["bytes_down"] == str(final["bytes_down"])
    assert "sim" not in cli(capsys, "runs", "--db", str(db)).splitlines()[0]


def test_fedbuff_shows_its_staleness_per_round(tmp_path, capsys):
    db = tmp_path / "f.db"
    out = run_json(capsys, db, "system.speeds=lognormal", "system.async=fedbuff", "system.buffer=2")
    hist, _ = stored(db, out["run_id"])
    head, body = rounds_table(cli(capsys, "show", out["run_id"], "--db", str(db)))
    assert [r[head.index("stale_max")] for r in body] == [str(h["stale_max"]) for h in hist]
    assert [r[head.index("stale_mean")] for r in body] == [f"{h['stale_mean']:.4f}" for h in hist]


@pytest.mark.parametrize("items, eps", [
    (["dp.clip=1.0", "dp.noise_multiplier=1.3", "dp.target_delta=1e-4"], ["dpfedavg_epsilon"]),
    (["dp.local=dpsgd", "dp.local_clip=0.7", "dp.local_noise=1.1", "dp.local_delta=1e-4"],
     ["dpsgd_epsilon_max", "dpsgd_epsilon_mean"]),
])
def test_the_epsilon_spent_is_in_the_summary_and_show(tmp_path, capsys, items, eps):
    db = tmp_path / "d.db"
    out = run_json(capsys, db, *items)
    hist, final = stored(db, out["run_id"])
    for k in eps:
        assert out[k] == final[k] == hist[-1][k] > 0
    shown = cli(capsys, "show", out["run_id"], "--db", str(db))
    head, body = rounds_table(shown)
    assert [k for k in head if "epsilon" in k] == eps
    dp = section(shown, "Differential privacy (docs/privacy.md):")
    prefix = eps[0].split("_")[0] + "_"
    assert sorted(dp) == sorted(k for k in final if k.startswith(prefix)) and set(eps) <= set(dp)


# -- the report --------------------------------------------------------------------------------------------
def test_the_report_has_a_simulated_time_column_only_with_a_clock(tmp_path, capsys):
    db = tmp_path / "r.db"
    timed = run_json(capsys, db, "system.speeds=equal", "system.compute=300")
    _, final = stored(db, timed["run_id"])
    cli(capsys, "report", "--db", str(db), "--out", str(tmp_path / "rep"), "--no-plots")
    md = (tmp_path / "rep" / "results.md").read_text()
    lines = md.splitlines()
    (at,) = [i for i, x in enumerate(lines) if x.startswith("| method | seeds | Glob Final")]
    head, row = lines[at], lines[at + 2]
    cells = dict(zip(head.split(" | "), row.split(" | ")))
    assert cells["Sim s |"] == f"{final['sim_clock']:.1f} |"
    rows = list(csv.DictReader(open(tmp_path / "rep" / "results.csv")))
    assert float(rows[0]["sim_clock"]) == final["sim_clock"]
    plain = tmp_path / "plain.db"
    run_json(capsys, plain)
    cli(capsys, "report", "--db", str(plain), "--out", str(tmp_path / "rep2"), "--no-plots")
    assert "Sim s" not in (tmp_path / "rep2" / "results.md").read_text()
    assert "sim_clock" not in (tmp_path / "rep2" / "results.csv").read_text()
