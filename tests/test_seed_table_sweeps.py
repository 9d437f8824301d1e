"""The sweep files of the papers' tables whose data is downloaded (Clust-PSI-PFL on ACSIncome, PFPL on the
Digits domains and on Office-Caltech10, FedSub on WISDM and UCI HAR): each `--quick` form runs on files of
the real format generated in a temporary folder (`data.root`), and the full-size forms hold the papers'
settings. The fast tests run the first runs of each quick form; the slow ones run all of it."""

from __future__ import annotations

from pathlib import Path

import pytest
from _fakedata import isolate, write_wisdm
from _realformat import write_digit_domains, write_har, write_office, write_pums

from fedprism.data import integrity
from fedprism.experiment.store import Store
from fedprism.experiment.sweep import load_sweep, run_sweep

pytestmark = pytest.mark.filterwarnings("ignore::fedprism.data.integrity.UnverifiedDataWarning")

SWEEPS = Path(__file__).resolve().parents[1] / "sweeps"


def _acs(root: Path) -> None:
    from fedprism.data.sets.acsincome import STATES
    write_pums(root, {s: 40 for s in STATES})


def _digits(root: Path) -> None:
    write_digit_domains(root, n_train=40, n_test=20)


def _office(root: Path) -> None:
    write_office(root, per_class=4)


def _har(root: Path) -> None:
    write_har(root)


def _wisdm(root: Path) -> None:
    write_wisdm(root)


#: sweep -> (writer of its data, runs in its quick form, the full form's settings checked below)
CASES = {
    "clust_psi_pfl_acsincome": (_acs, 73, {"dataset": "acsincome", "model": "logreg", "clients": 100, "rounds": 40,
                                           "fraction": 0.5, "local_epochs": 5, "batch_size": 32,
                                           "optimizer": "adam", "lr": 0.001}),
    "pfpl_digits": (_digits, 24, {"dataset": "digit_domains", "model": "resnet18", "clients": 20, "rounds": 100,
                                  "fraction": 1.0, "local_epochs": 1, "batch_size": 4, "lr": 0.01,
                                  "momentum": 0.9, "weight_decay": 1e-5, "partition": "domain_mix",
                                  "data.domains": "mnist,usps,svhn,synthdigits"}),
    "pfpl_office_caltech10": (_office, 24, {"dataset": "office_caltech10", "model": "resnet18", "clients": 20,
                                            "rounds": 100, "batch_size": 4, "lr": 0.01, "momentum": 0.9,
                                            "weight_decay": 1e-5, "partition": "domain_mix"}),
    "fedsub_wisdm": (_wisdm, 13, {"dataset": "wisdm", "model": "mlp_fedsub", "clients": 36, "rounds": 300,
                                  "fraction": 1.0, "local_epochs": 1, "partition": "natural"}),
    "fedsub_uci_har": (_har, 13, {"dataset": "uci_har", "model": "mlp_fedsub", "clients": 30, "rounds": 300,
                                  "fraction": 1.0, "local_epochs": 1, "partition": "natural"}),
}


@pytest.fixture
def iso(monkeypatch, tmp_path):
    isolate(monkeypatch, tmp_path)
    monkeypatch.setattr(integrity, "_digests", {})
    return tmp_path


@pytest.mark.parametrize("name", sorted(CASES))
def test_full_forms_hold_the_papers_settings_and_cite_them(name):
    text = (SWEEPS / f"{name}.toml").read_text()
    header = text.split("\nname =")[0]
    assert "arXiv:" in header or "states neither a year nor an arXiv identifier" in header   # FedSub's text has none
    assert "Not the paper's" in text
    _, configs = load_sweep(SWEEPS / f"{name}.toml")
    want = CASES[name][2]
    for c in configs:
        assert {k: c[k] for k in want} == want, c["name"]
    if name == "clust_psi_pfl_acsincome":        # the ACSIncome columns of Tables III and IV, five seeds
        settings = {(c["partition"], c.get("partition.alpha"), c.get("partition.s")) for c in configs}
        assert {(p, a if p == "dirichlet_per_class" else s) for p, a, s in settings} >= {
            ("dirichlet_per_class", 50), ("dirichlet_per_class", 0.7), ("dirichlet_per_class", 0.3),
            ("similarity", 1.0), ("similarity", 0.03), ("similarity", 0.0)}
        assert sorted({c["seed"] for c in configs}) == [0, 1, 2, 3, 4]
        assert not any(c.get("partition.alpha") in (0.2, 0.09, 0.05) for c in configs if c["partition"] ==
                       "dirichlet_per_class")
    if name.startswith("pfpl"):
        assert sorted({(c["partition.min_classes"], c["partition.max_classes"]) for c in configs}) == \
            [(3, 3), (4, 4), (5, 5)]


def _run(name: str, root: Path, db: Path, limit: int | None) -> list[dict]:
    writer, n, _ = CASES[name]
    writer(root)
    _, configs = load_sweep(SWEEPS / f"{name}.toml", quick=True, overrides={"data.root": str(root)})
    assert len(configs) == n
    assert run_sweep(str(SWEEPS / f"{name}.toml"), str(db), quick=True, progress=False, limit=limit,
                     overrides={"data.root": str(root)}) == 0
    with Store(db) as st:
        runs = [r for r in st.runs() if r["status"] == "finished"]
    assert len(runs) == (n if limit is None else min(limit, n))
    return runs


@pytest.mark.parametrize("name", sorted(CASES))
def test_quick_form_runs_on_generated_files(name, iso, monkeypatch):
    monkeypatch.setattr(integrity, "KNOWN_MD5", {})           # generated MNIST-M: not the published tarball
    _run(name, iso / "data", iso / "s.db", limit=2)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_whole_quick_form_runs_on_generated_files(name, iso, monkeypatch):
    monkeypatch.setattr(integrity, "KNOWN_MD5", {})
    _run(name, iso / "data", iso / "s.db", limit=None)
