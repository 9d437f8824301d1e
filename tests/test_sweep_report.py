"""The clustering sweep at CI size, its resumption, and the report rendered from the store."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from fedprism.errors import ConfigError
from fedprism.experiment.store import Store
from fedprism.experiment.sweep import load_sweep, run_sweep
from fedprism.report import write_report

SWEEP = "sweeps/fedprism_clustering.toml"


def test_quick_clustering_sweep_stores_all_and_reports(tmp_path, monkeypatch):
    monkeypatch.chdir(__import__("pathlib").Path(__file__).parents[1])
    db = str(tmp_path / "s.db")
    name, configs = load_sweep(SWEEP, quick=True)
    labels = {c["name"] for c in configs}
    assert {"Fed-PRISM kmeans", "Fed-PRISM ward", "Fed-PRISM average", "Fed-PRISM single",
            "Fed-PRISM covariance", "FedClust", "FedAvg", "Local"} <= labels
    # one shared partition: every run of a seed has the same data keys
    assert len({(c["dataset"], c["partition"], c["partition.alpha"], c["clients"], c["seed"]) for c in configs}) == 2
    run_sweep(SWEEP, db, quick=True, progress=False, limit=3)
    store = Store(db)
    assert sum(r["status"] == "finished" for r in store.runs()) == 3
    run_sweep(SWEEP, db, quick=True, progress=False)          # resumes: the 3 finished are skipped
    runs = store.runs()
    assert len(runs) == len(configs) and all(r["status"] == "finished" for r in runs)
    assert all(r["sweep"] == name for r in runs)
    out = tmp_path / "rep"
    paths = write_report(db, str(out), sweep=name)
    md = (out / "results.md").read_text()
    for label in labels:
        assert f"| {label} | 2 |" in md
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert len(rows) == len(configs)
    assert any(p.name.startswith("clusters_fedprism_Fed-PRISM-kmeans_") for p in paths)
    assert any(p.name.startswith("accuracy_") for p in paths)
    assert any(p.name.startswith("ecdf_") for p in paths)
    assert "## Paper layout" in md and "\n| FedAvg | " in md.split("## Paper layout")[1].split("\n## ")[0]
    before = {p: p.read_bytes() for p in paths}
    write_report(db, str(out), sweep=name)                    # byte-for-byte reproducible
    assert all(p.read_bytes() == b for p, b in before.items())


def test_a_run_two_sweeps_share_is_run_once_and_reported_by_both(tmp_path, monkeypatch):
    from fedprism.experiment.config import resolve
    from fedprism.experiment.runner import Experiment

    db = str(tmp_path / "m.db")
    store = Store(db)
    cfg = resolve({"dataset": "digits", "model": "mlp", "clients": 6, "rounds": 2, "fraction": 0.5,
                   "method": "fedavg", "name": "FedAvg"})
    Experiment(cfg, store, progress=False, sweep="first").run()
    a = tmp_path / "second.toml"
    a.write_text('name = "second"\n[base]\ndataset = "digits"\nmodel = "mlp"\nclients = 6\nrounds = 2\n'
                 'fraction = 0.5\n[[runs]]\nlabel = "Baseline"\nmethod = "fedavg"\n')
    run_sweep(str(a), db, progress=False)                     # same config: skipped, but now a member
    assert len(store.runs()) == 1
    assert [r["label"] for r in store.runs(sweep="second")] == ["Baseline"]
    assert [r["label"] for r in store.runs(sweep="first")] == ["FedAvg"]
    write_report(db, str(tmp_path / "rep"), sweep="second", plots=False)
    assert "| Baseline | 1 |" in (tmp_path / "rep" / "results.md").read_text()
    write_report(db, str(tmp_path / "both"), sweep=["first", "second"], plots=False)
    md = (tmp_path / "both" / "results.md").read_text()
    assert "| FedAvg | 1 |" in md and "Baseline" not in md          # once, under the first sweep's label
    # a published table beside ours: differences above 3 points are flagged, missing rows say so
    import json

    from fedprism.report import reference, setting_of

    cfg = json.loads(store.runs()[0]["config"])
    ours = 100 * json.loads(store.runs()[0]["final"])["global_acc"]
    key = setting_of(cfg)
    other_t = setting_of({**cfg, "rounds": cfg["rounds"] + 1})   # same partition, another protocol: not ours
    monkeypatch.setitem(reference.REFERENCES, "toy", {key: {"Baseline": (ours - 1.0, 100.0), "Other": (1.0, 2.0)},
                                                      other_t: {"Baseline": (50.0, 50.0)}})
    write_report(db, str(tmp_path / "ref"), sweep="second", plots=False, reference="toy")
    md = (tmp_path / "ref" / "results.md").read_text()
    row = next(line for line in md.splitlines() if "| Baseline | 1 |" in line and "paper" not in line
               and line.count("|") == 11)
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[5] == "+1.00" and cells[8].startswith("**-")      # Glob +1 (not flagged); Loc flagged
    assert "| Other |" not in md                       # a published row that no rendered sweep has: left out
    assert any(f"T={cfg['rounds'] + 1} | Baseline | 0 |" in line and line.rstrip().endswith("| - | 50.00 | - | - |")
               for line in md.splitlines())             # a row the sweeps have, in a setting not run: '-' 
    with pytest.raises(ValueError, match="unknown reference"):
        write_report(db, str(tmp_path / "bad"), plots=False, reference="nope")


def test_sweep_overrides_switch_dataset_and_partition(monkeypatch):
    """`fedprism sweep FILE dataset=cifar10 partition=pathological`: the CIFAR-10 rows of Tables 3-5."""
    monkeypatch.chdir(__import__("pathlib").Path(__file__).parents[1])
    _, fm = load_sweep("sweeps/ablation_components.toml")
    _, cf = load_sweep("sweeps/ablation_components.toml", overrides={"dataset": "cifar10", "partition": "pathological"})
    assert len(cf) == len(fm) == 5
    for a, b in zip(fm, cf):
        assert a["partition"] == "dirichlet" and a["partition.alpha"] == 0.1
        assert b["dataset"] == "cifar10" and b["partition"] == "pathological"
        assert b["partition.shards_per_client"] == 2 and "partition.alpha" not in b.values
        assert b["fedprism_dual.components"] == a["fedprism_dual.components"] and b.run_id != a.run_id


def test_a_changed_row_supersedes_its_older_run_once_finished(tmp_path):
    """The file's row changes (a parameter or default changed): the new run takes the row over when it
    has finished; the older run leaves that sweep only, stays in the store and in other sweeps."""
    db = str(tmp_path / "s.db")
    body = ('name = "s"\n[base]\ndataset = "digits"\nmodel = "mlp"\nclients = 6\nrounds = 2\nfraction = 0.5\n'
            '[grid]\nseed = [0, 1]\n[[runs]]\nlabel = "A"\nmethod = "fedavg"\nlr = {lr}\n'
            '[[runs]]\nlabel = "B"\nmethod = "local"\n')
    f = tmp_path / "s.toml"
    f.write_text(body.format(lr=0.05))
    run_sweep(str(f), db, progress=False)
    store = Store(db)
    old = {r["run_id"] for r in store.runs(sweep="s") if r["label"] == "A"}
    store.add_to_sweep("other", sorted(old)[0], "A old")
    f.write_text(body.format(lr=0.02))
    run_sweep(str(f), db, progress=False, seeds=[0], limit=0)          # nothing run yet: nothing superseded
    assert {r["run_id"] for r in store.runs(sweep="s") if r["label"] == "A"} == old
    run_sweep(str(f), db, progress=False, seeds=[0])
    rows = store.runs(sweep="s")
    assert sorted((r["label"], json.loads(r["config"])["seed"]) for r in rows) == [("A", 0), ("A", 1), ("B", 0),
                                                                                  ("B", 1)]
    new_a0 = [r for r in rows if r["label"] == "A" and json.loads(r["config"])["seed"] == 0][0]
    assert json.loads(new_a0["config"])["lr"] == 0.02 and new_a0["run_id"] not in old
    assert len(store.runs()) == 5                                   # the old run is still stored
    assert [r["label"] for r in store.runs(sweep="other")] == ["A old"]


def test_a_sweep_file_names_its_own_database(tmp_path, monkeypatch):
    """`db = ...` in the file (relative to it) is used when neither --db nor $FEDPRISM_DB is given,
    and never for --quick smoke runs."""
    from fedprism.cli import main

    (tmp_path / "sweeps").mkdir()
    f = tmp_path / "sweeps" / "s.toml"
    f.write_text('name = "s"\ndb = "../store/own.db"\n[base]\ndataset = "digits"\nmodel = "mlp"\nclients = 4\n'
                 'rounds = 1\nfraction = 0.5\n[[runs]]\nlabel = "A"\nmethod = "fedavg"\n[quick]\nrounds = 1\n')
    (tmp_path / "store").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FEDPRISM_DB", raising=False)
    assert main(["sweep", str(f), "--quiet"]) == 0
    assert [r["label"] for r in Store(tmp_path / "store" / "own.db").runs(sweep="s")] == ["A"]
    assert main(["sweep", str(f), "--quiet", "--db", str(tmp_path / "x.db")]) == 0
    assert len(Store(tmp_path / "x.db").runs()) == 1
    monkeypatch.setenv("FEDPRISM_DB", str(tmp_path / "env.db"))
    assert main(["sweep", str(f), "--quiet"]) == 0
    assert len(Store(tmp_path / "env.db").runs()) == 1
    monkeypatch.delenv("FEDPRISM_DB")
    assert main(["sweep", str(f), "--quiet", "--quick"]) == 0
    assert (tmp_path / "fedprism-results.db").exists()              # the default, not the file's store
    f.write_text('name = "s"\ndb = 3\n')
    assert main(["sweep", str(f)]) == 2                              # a clear error, not a traceback


def test_seed_spread_is_the_sample_std():
    """Two seeds at 50 % and 70 %: mean 60, sample std (ddof=1) 14.14, not the population std 10."""
    from fedprism.report import _pm
    assert _pm([0.5, 0.7]) == "60.00 ± 14.14"
    assert _pm([0.5]) == "50.00" and _pm([None]) == "-"


def test_megabytes_of_a_small_model_are_not_shown_as_zero():
    from fedprism.report import _mb

    assert _mb([0, 0]) == "0.00 ± 0.00" and _mb([2.5e6]) == "2.50"              # nothing sent; a large model
    assert _mb([1234.0]) == "0.0012" and _mb([1000.0, 3000.0]) == "0.002 ± 0.0014"
    assert _mb([]) == "-"


def test_a_label_with_a_pipe_stays_one_table_cell_in_markdown_and_html():
    from fedprism.report import _cell
    from fedprism.report.html import _cells

    row = f"| {_cell('FedAvg | S 0.03')} | 83.56 | 83.58 |"
    assert row == "| FedAvg \\| S 0.03 | 83.56 | 83.58 |"
    assert _cells(row) == ["FedAvg | S 0.03", "83.56", "83.58"]


def test_quick_without_a_quick_section_is_refused(tmp_path):
    """--quick on a file without [quick] would silently run the full-size sweep: refused, naming the section."""
    from fedprism.errors import ConfigError

    f = tmp_path / "s.toml"
    f.write_text('name = "s"\n[base]\ndataset = "digits"\n[[runs]]\nmethod = "fedavg"\n')
    with pytest.raises(ConfigError, match=r"\[quick\]"):
        load_sweep(f, quick=True)
    assert len(load_sweep(f)[1]) == 1


def test_a_refused_sweep_names_no_results_file_and_creates_none(tmp_path, capsys):
    """`fedprism sweep` says where results go only once the file and options are valid: a refused
    --quick prints one error line and no 'results: PATH' for a store it never creates."""
    from fedprism.cli import main

    f = tmp_path / "s.toml"
    f.write_text('name = "s"\n[base]\ndataset = "digits"\n[[runs]]\nmethod = "fedavg"\n')
    assert main(["sweep", str(f), "--quick", "--db", str(tmp_path / "x.db")]) == 2
    err = capsys.readouterr().err
    assert "option '--quick'" in err and "results:" not in err and not (tmp_path / "x.db").exists()


def test_every_shipped_sweep_has_a_small_quick_form():
    for path in sorted((Path(__file__).parent.parent / "sweeps").glob("*.toml")):
        if "\n[tune]" in path.read_text():       # a tuning study: tests/test_tune.py runs its quick form
            with pytest.raises(ConfigError, match="fedprism tune"):
                load_sweep(path, quick=True)
            continue
        _, configs = load_sweep(path, quick=True)
        assert configs and all(c["rounds"] <= 5 and c["clients"] <= 20 for c in configs), path.name


def test_only_prefers_the_exact_label_and_names_the_labels_when_nothing_matches(tmp_path):
    from fedprism.errors import ConfigError
    from fedprism.experiment.sweep import select_only

    runs = [{"name": n} for n in ("FedAvg | S 0", "FedAvg | S 0.03", "Clust-PSI-PFL | S 0.03")]
    assert [c["name"] for c in select_only(runs, "FedAvg | S 0")] == ["FedAvg | S 0"]       # exact wins
    assert [c["name"] for c in select_only(runs, "S 0.03")] == ["FedAvg | S 0.03", "Clust-PSI-PFL | S 0.03"]
    assert len(select_only(runs, "FedAvg")) == 2                                            # else: contains
    with pytest.raises(ConfigError, match=r"--only.*'Clust-PSI-PFL \| S 0.03', 'FedAvg \| S 0'"):
        select_only(runs, "FedProx")
    db = tmp_path / "s.db"
    root = Path(__file__).parents[1]
    with pytest.raises(ConfigError, match="--only"):
        run_sweep(str(root / SWEEP), str(db), only="no such label", quick=True, progress=False)
    assert not db.exists()                                                                  # nothing written


def test_only_suggests_the_nearest_label_and_a_seed_outside_the_sweep_is_refused(tmp_path):
    """A mistyped `--only` names the nearest label; `--seed` with a seed no run of the sweep has used to run
    nothing and exit 0: now an error listing the sweep's seeds, with nothing written."""
    from fedprism.errors import ConfigError
    from fedprism.experiment.sweep import select_only

    runs = [{"name": n} for n in ("FedAvg", "Local", "FedPrism")]
    with pytest.raises(ConfigError, match=r"did you mean 'FedAvg'\?"):
        select_only(runs, "FedAvgg")
    db = tmp_path / "s.db"
    root = Path(__file__).parents[1]
    seeds = sorted({c["seed"] for c in load_sweep(root / SWEEP, quick=True)[1]})
    listed = ", ".join(map(str, seeds))
    with pytest.raises(ConfigError, match=r"--seed.*= 7 .*a seed of the sweep's runs: " + listed):
        run_sweep(str(root / SWEEP), str(db), seeds=[seeds[0], 7], quick=True, progress=False)
    assert not db.exists()


def test_a_sweep_file_given_to_run_says_to_use_sweep(tmp_path):
    """`fedprism run SWEEP.toml` used to fail on `base.batch_size` as an unknown key: it now says what the
    file is and which command runs it."""
    from fedprism.cli import main

    root = Path(__file__).parents[1]
    db = tmp_path / "r.db"
    assert main(["run", str(root / SWEEP), "--db", str(db)]) == 2
    assert not db.exists()
    from fedprism.errors import ConfigError
    from fedprism.experiment.config import load_toml

    with pytest.raises(ConfigError, match=r"this is a sweep file .*fedprism sweep"):
        load_toml(root / SWEEP)


def test_a_run_file_given_to_sweep_says_to_use_run_and_a_mistyped_table_gets_a_suggestion(tmp_path):
    from fedprism.cli import main

    run_file = tmp_path / "exp.toml"
    run_file.write_text('dataset = "digits"\nclients = 5\n')
    db = tmp_path / "s.db"
    assert main(["sweep", str(run_file), "--db", str(db)]) == 2
    assert not db.exists()
    with pytest.raises(ConfigError, match=r"one run's keys \(clients, ...\): run it with `fedprism run"):
        load_sweep(run_file)
    typo = tmp_path / "s.toml"
    typo.write_text('name = "s"\n[base]\ndataset = "digits"\n[[run]]\nmethod = "fedavg"\n')
    with pytest.raises(ConfigError) as e:
        load_sweep(typo)
    assert str(e.value) == "s.toml: unknown table [[run]] (did you mean [[runs]]?)"      # never the value


def test_a_rescored_run_moves_no_bytes_of_its_own():
    """A run re-scored from another's kept final state stored no training rounds: its bytes per round are
    shown as unknown, not as 0 (which would read as a method that communicates nothing)."""
    from fedprism.report import dispersion_table

    acc = {"global_acc": 0.5, "local_acc": 0.9, "ad": 0.1, "sdad": 0.02}
    groups = {"s": {"trained": [{"final": {**acc, "bytes_down": 300e6, "bytes_up": 100e6, "rounds": 3}}],
                    "rescored": [{"final": {**acc, "bytes_down": 0, "bytes_up": 0, "rounds": 1,
                                            "rescored_from": "0123456789abcdef"}}]}}
    md = dispersion_table(groups)
    assert "| trained | 1 | 50.00 | 90.00 | 10.00 | 2.00 | 100.00 | 33.33 |" in md
    assert "| rescored | 1 | 50.00 | 90.00 | 10.00 | 2.00 | - | - |" in md


def test_a_rescored_run_has_no_best_round_of_its_own():
    """A re-scored run holds its final round only: its Best columns are '-' in the markdown and empty in
    the CSV (they showed the final value as the best over training)."""
    from fedprism.experiment.config import resolve
    from fedprism.report import tables

    fin = {"global_acc": 0.5, "best_global_acc": 0.5, "local_acc": 0.9, "best_local_acc": 0.9, "sdad": 0.02}
    run = {"run_id": "r", "config": dict(resolve({"method": "fedavg"}).values)}
    groups = {"s": {"trained": [{**run, "final": {**fin, "best_global_acc": 0.6}}],
                    "rescored": [{**run, "final": {**fin, "rescored_from": "0123456789abcdef"}}]}}
    md, rows = tables(groups)
    assert "| trained | 1 | 50.00 | 60.00 | 90.00 | 90.00 | 2.00 | - |" in md
    assert "| rescored | 1 | 50.00 | - | 90.00 | - | 2.00 | - |" in md
    assert [r[4:] for r in rows] == [[0.5, None, 0.9, None, 0.02, None], [0.5, 0.6, 0.9, 0.9, 0.02, None]]


def test_runs_that_would_share_a_row_are_told_apart_by_their_keys(tmp_path):
    """Two unlabelled `[[runs]]` of one method, or one label over a grid of a parameter, would share a row
    and supersede each other: their labels get the keys that differ, and every run stays in the sweep."""
    f = tmp_path / "s.toml"
    f.write_text('name = "s"\n[base]\ndataset = "digits"\nmodel = "mlp"\nclients = 6\nrounds = 1\n'
                 'local_epochs = 1\nfraction = 0.5\n[grid]\nseed = [0]\nlr = [0.05, 0.1]\n'
                 '[[runs]]\nmethod = "fedprox"\n"fedprox.mu" = 0.1\n[[runs]]\nmethod = "fedprox"\n'
                 '"fedprox.mu" = 1.0\n[[runs]]\nlabel = "L"\nmethod = "local"\n')
    _, cfgs = load_sweep(f)
    assert [c["name"] for c in cfgs] == ["fedprox (fedprox.mu=0.1, lr=0.05)", "fedprox (fedprox.mu=0.1, lr=0.1)",
                                         "fedprox (fedprox.mu=1.0, lr=0.05)", "fedprox (fedprox.mu=1.0, lr=0.1)",
                                         "L (lr=0.05)", "L (lr=0.1)"]
    db = str(tmp_path / "s.db")
    run_sweep(str(f), db, progress=False)
    with Store(db, readonly=True) as s:
        assert len(s.runs(sweep="s")) == 6
    plain = tmp_path / "p.toml"                                 # rows that do not collide keep their labels
    plain.write_text('name = "p"\n[base]\ndataset = "digits"\n[grid]\nseed = [0, 1]\n'
                     '[[runs]]\nmethod = "fedavg"\n[[runs]]\nlabel = "X"\nmethod = "fedavg"\nlr = 0.1\n')
    assert [c["name"] for c in load_sweep(plain)[1]] == ["fedavg", "fedavg", "X", "X"]
    clash = tmp_path / "c.toml"                                 # a label that names the other's suffix
    clash.write_text('name = "c"\n[base]\ndataset = "digits"\n[[runs]]\nlabel = "A (lr=0.1)"\nmethod = "fedavg"\n'
                     '[[runs]]\nlabel = "A"\nmethod = "fedavg"\nlr = 0.1\n[[runs]]\nlabel = "A"\nmethod = "fedavg"\n')
    with pytest.raises(ConfigError, match=r"runs\[1\].label.*runs\[0\] has it too"):
        load_sweep(clash)


def test_method_keys_follow_the_method_wherever_it_is_set():
    """A method from [grid] takes its keys from [base]; a grid over one method's key runs the other
    methods once (it used to drop fedprox.mu silently, and to refuse fedprism.k for the FedAvg run)."""
    from fedprism.experiment.sweep import dump_sweep

    import tempfile

    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "s.toml"
        f.write_text(dump_sweep("s", {"dataset": "digits", "fedprox.mu": 0.5}, [{}],
                                {"method": ["fedavg", "fedprox"]}))
        _, cfgs = load_sweep(f)
        assert [(c["method"], c.get("fedprox.mu")) for c in cfgs] == [("fedavg", None), ("fedprox", 0.5)]
        f.write_text(dump_sweep("s", {"dataset": "digits"}, [{"label": "P", "method": "fedprism"},
                                                             {"label": "A", "method": "fedavg"}],
                                {"fedprism.k": [2, 3], "seed": [0, 1]}))
        _, cfgs = load_sweep(f)
        assert sorted((c["name"], c["seed"]) for c in cfgs) == [
            ("A", 0), ("A", 1), ("P (fedprism.k=2)", 0), ("P (fedprism.k=2)", 1), ("P (fedprism.k=3)", 0),
            ("P (fedprism.k=3)", 1)]
        assert len({c.run_id for c in cfgs}) == 6


def test_a_diverged_run_is_named_under_its_setting_table(tmp_path):
    """A run whose every update was rejected pools with the other seeds like any run: the report names it
    (label, seed, id, round) under its setting's table, so the row's numbers are not read as learned."""
    from fedprism.experiment.config import resolve
    from fedprism.experiment.runner import Experiment
    from fedprism.report import write_report

    db = str(tmp_path / "d.db")
    store = Store(db)
    base = {"method": "fedavg", "dataset": "digits", "model": "mlp", "clients": 4, "rounds": 2,
            "fraction": 1.0, "local_epochs": 1, "engine": "sequential"}
    good = Experiment(resolve({**base, "seed": 0}), store).run()
    bad = Experiment(resolve({**base, "seed": 1, "lr": 1e30}), store).run()
    store.close()
    assert bad.final["diverged"] and not good.final["diverged"]
    write_report(db, str(tmp_path / "rep"), plots=False)
    md = (tmp_path / "rep" / "results.md").read_text()
    assert f"seed 1 (`{bad.run_id}`, from round 1)" in md and good.run_id not in md.split("Diverged")[-1]


def test_plots_of_labels_with_one_slug_or_brackets_stay_apart_and_embedded(tmp_path):
    """Row labels 'FP a' and 'FP-a' slug alike: each run keeps its own cluster plot file (the second used to
    overwrite the first); a label with brackets ('FP [k=2]') still has its plots embedded in report.html."""
    import re

    from fedprism.experiment.config import resolve
    from fedprism.experiment.runner import Experiment

    db = str(tmp_path / "p.db")
    store = Store(db)
    base = {"method": "fedprism", "dataset": "digits", "model": "mlp", "clients": 4, "rounds": 2,
            "fraction": 1.0, "local_epochs": 1, "engine": "sequential", "fedprism.k": 2, "fedprism.every": 1}
    for i, label in enumerate(["FP a", "FP-a", "FP [k=2]"]):
        res = Experiment(resolve({**base, "seed": 0, "lr": 0.01 * (i + 1)}), store).run()
        store.add_to_sweep("s", res.run_id, label)
    store.close()
    write_report(db, str(tmp_path / "rep"), sweep="s", html=True)
    md = (tmp_path / "rep" / "results.md").read_text()
    linked = re.findall(r"^!\[.*\]\((plots/clusters_[^)]+)\)$", md, flags=re.M)
    assert len(linked) == 3 == len(set(linked)) and all((tmp_path / "rep" / p).is_file() for p in linked)
    html = (tmp_path / "rep" / "report.html").read_text()
    assert html.count("<img") == md.count("\n![") and "![" not in html


def test_a_run_of_one_evaluated_round_is_a_marker_on_the_accuracy_plot(tmp_path, monkeypatch):
    """A run with one evaluated round (a re-scored run, or rounds=1) was a line of one point: drawn as
    nothing, so the method was in the legend but not on the plot."""
    import fedprism.report as report
    from fedprism.experiment.config import resolve
    from fedprism.experiment.runner import Experiment

    db = str(tmp_path / "p.db")
    store = Store(db)
    base = {"method": "fedavg", "dataset": "digits", "model": "mlp", "clients": 4, "fraction": 1.0,
            "local_epochs": 1, "engine": "sequential", "seed": 0}
    cfgs = {f"R{n}": resolve({**base, "rounds": n}) for n in (1, 3)}
    ids = {k: Experiment(c, store).run().run_id for k, c in cfgs.items()}
    seen = {}

    def keep(fig, path):
        if "accuracy" in Path(path).name:
            seen.update({ln.get_label(): (len(ln.get_xdata()), ln.get_marker()) for ln in fig.axes[0].lines})
        fig.savefig(path)
        return [path]

    monkeypatch.setattr(report, "_save", keep)
    report.plot_setting(store, "s", {k: [{"run_id": v, "config": dict(cfgs[k].values)}] for k, v in ids.items()},
                        tmp_path)
    assert seen["R1"] == (1, "D")                  # one point: a large diamond
    assert seen["R3"][0] == 3 and seen["R3"][1] not in ("D", "None")    # a line with its method's markers
