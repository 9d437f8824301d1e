"""The sweep files of the FedPrism paper's SVHN / CIFAR-10 / CIFAR-100 tables and of Clust-PSI-PFL's CIFAR-10
rows: each extends the committed FMNIST file of its table (`extends`), so the full form must be that file's
rows on the paper's data, and its `--quick` form runs on files of the real formats generated in a
temporary folder (`data.root`). The fast tests run the first runs of three quick forms; the slow ones the
first row of every file on each of its datasets and seeds (the other rows are the extended file's, whose
quick forms the other sweep tests run)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _fakedata import isolate, write_fake

from fedprism.data import integrity
from fedprism.errors import ConfigError
from fedprism.experiment.store import Store
from fedprism.experiment.sweep import load_sweep, run_sweep

pytestmark = pytest.mark.filterwarnings("ignore::fedprism.data.integrity.UnverifiedDataWarning")

SWEEPS = Path(__file__).resolve().parents[1] / "sweeps"
IGNORED = {"name", "dataset", "model", "partition", "partition.alpha", "partition.shards_per_client",
           "partition.variant"}

#: sweep -> (the file it extends, its datasets, its model, its partition, runs in the slow test)
CASES = {
    "paper_svhn_cifar_dir01": ("paper_fmnist_dir01", ("svhn", "cifar10", "cifar100"), "lenet5",
                               ("dirichlet", 0.1), 6),
    "paper_svhn_cifar_dir03": ("paper_fmnist_dir03", ("svhn", "cifar10", "cifar100"), "lenet5",
                               ("dirichlet", 0.3), 6),
    "paper_svhn_cifar_dir05": ("paper_fmnist_dir05", ("svhn", "cifar10", "cifar100"), "lenet5",
                               ("dirichlet", 0.5), 6),
    "paper_pathological": ("paper_fmnist_dir01", ("svhn", "cifar100", "cifar10"), "lenet5",
                           ("pathological", 2), 6),
    "paper_cifar10_ablation_components": ("ablation_components", ("cifar10",), "lenet5", ("pathological", 2),
                                          None),
    "paper_cifar10_ablation_inference_weight": ("ablation_inference_weight", ("cifar10",), "lenet5",
                                                ("pathological", 2), 6),
    "paper_cifar10_ablation_alpha": ("ablation_alpha", ("cifar10",), "lenet5", ("pathological", 2), None),
    "clust_psi_pfl_cifar10": ("clust_psi_pfl_fmnist", ("cifar10",), "clustpsi_cifar_cnn", None, 8),
}


def _rows(configs) -> list[tuple]:
    """A sweep's runs without the keys its extension changes."""
    return sorted(repr(sorted((k, v) for k, v in c.values.items() if k not in IGNORED)) for c in configs)


@pytest.mark.parametrize("name", sorted(CASES))
def test_full_form_is_the_extended_files_rows_on_the_papers_data(name):
    parent, datasets, model, partition, _ = CASES[name]
    _, mine = load_sweep(SWEEPS / f"{name}.toml")
    _, theirs = load_sweep(SWEEPS / f"{parent}.toml")
    assert sorted({c["dataset"] for c in mine}) == sorted(datasets)
    assert {c["model"] for c in mine} == {model}
    if partition is not None:
        key = "partition.alpha" if partition[0] == "dirichlet" else "partition.shards_per_client"
        assert {(c["partition"], c[key]) for c in mine} == {partition}
    per_dataset = [[c for c in mine if c["dataset"] == d] for d in datasets]
    for block in per_dataset:                 # every row of the extended file, once per dataset
        assert _rows(block) == _rows(theirs)
    header = (SWEEPS / f"{name}.toml").read_text().split("\nextends =")[0]
    assert "arXiv" in header and "fedprism data download" in header


def _write(root: Path, datasets) -> None:
    for d in datasets:
        write_fake(d, root, n_train=400 if d != "cifar100" else 500, n_test=60)


def _run(name: str, root: Path, db: Path, limit: int | None) -> None:
    _, datasets, _, _, _ = CASES[name]
    _write(root, datasets)
    over = {"data.root": str(root)}
    _, configs = load_sweep(SWEEPS / f"{name}.toml", quick=True, overrides=over)
    assert {c["dataset"] for c in configs} == set(datasets)       # the quick form keeps the paper's data
    assert run_sweep(str(SWEEPS / f"{name}.toml"), str(db), quick=True, progress=False, limit=limit,
                     overrides=over) == 0
    with Store(db) as st:
        runs = [r for r in st.runs() if r["status"] == "finished"]
    assert len(runs) == (len(configs) if limit is None else min(limit, len(configs)))


@pytest.fixture
def iso(monkeypatch, tmp_path):
    isolate(monkeypatch, tmp_path)
    monkeypatch.setattr(integrity, "_digests", {})
    return tmp_path


@pytest.mark.parametrize("name", ["paper_svhn_cifar_dir01", "paper_pathological", "clust_psi_pfl_cifar10"])
def test_quick_form_runs_on_generated_files(name, iso):
    _run(name, iso / "data", iso / "s.db", limit=2)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_whole_quick_form_runs_on_generated_files(name, iso):
    _run(name, iso / "data", iso / "s.db", limit=CASES[name][4])


def _sweep(folder: Path, name: str, text: str) -> Path:
    p = folder / f"{name}.toml"
    p.write_text(text)
    return p


def test_extends_updates_key_by_key_and_refuses_loops_and_missing_files(tmp_path):
    _sweep(tmp_path, "a", 'name = "a"\n[base]\ndataset = "digits"\nmodel = "mlp"\nclients = 6\nrounds = 1\n'
           'partition = { name = "dirichlet", alpha = 0.3 }\n[grid]\nseed = [0, 1]\n'
           '[quick]\ndataset = "digits"\nclients = 4\n'
           '[[runs]]\nlabel = "A"\nmethod = "fedavg"\n[[runs]]\nlabel = "L"\nmethod = "local"\n')
    b = _sweep(tmp_path, "b", 'extends = "a.toml"\n[base]\nclients = 8\n'
               'partition = { name = "pathological", shards_per_client = 2 }\n'
               '[grid]\ndataset = ["digits", "synthetic"]\n[quick]\nrounds = 1\n')
    name, configs = load_sweep(b)
    assert name == "b"                                                  # not the extended file's name
    assert len(configs) == 2 * 2 * 2                                    # rows x seeds x datasets
    assert {c["clients"] for c in configs} == {8} and {c["model"] for c in configs} == {"mlp"}
    assert {c["partition"] for c in configs} == {"pathological"}       # the other's partition.alpha dropped
    assert {c["dataset"] for c in configs} == {"digits", "synthetic"}
    _, quick = load_sweep(b, quick=True)                               # the other's quick dataset does not
    assert {c["dataset"] for c in quick} == {"digits", "synthetic"}    # fix what this file's grid varies
    assert {c["clients"] for c in quick} == {4}
    _sweep(tmp_path, "c", 'extends = "d.toml"\n')
    _sweep(tmp_path, "d", 'extends = "c.toml"\n')
    with pytest.raises(ConfigError, match="loop"):
        load_sweep(tmp_path / "c.toml")
    with pytest.raises(ConfigError, match="not a file"):
        load_sweep(_sweep(tmp_path, "e", 'extends = "missing.toml"\n'))
    with pytest.raises(ConfigError, match="extends"):
        load_sweep(_sweep(tmp_path, "f", 'extends = 3\n'))


@pytest.mark.parametrize("table", ["paper_fmnist_dir03", "paper_fmnist_dir05"])
def test_seed1_files_are_the_tables_rows_with_seed_1(table, tmp_path):
    """Tables 6 and 7's second seed: the extended file's rows, seed 1 only, under a sweep name of their own
    (the committed seed-0 rows keep theirs); the quick form runs."""
    name = f"{table}_seed1"
    got_name, mine = load_sweep(SWEEPS / f"{name}.toml")
    _, theirs = load_sweep(SWEEPS / f"{table}.toml")
    assert got_name == name and {c["seed"] for c in mine} == {1} and {c["seed"] for c in theirs} == {0}
    drop = lambda cs: sorted(repr(sorted((k, v) for k, v in c.values.items() if k != "seed")) for c in cs)  # noqa: E731
    assert drop(mine) == drop(theirs)
    assert not {c.run_id for c in mine} & {c.run_id for c in theirs}
    db = tmp_path / "s.db"
    assert run_sweep(str(SWEEPS / f"{name}.toml"), str(db), only="Local", quick=True, progress=False) == 0
    with Store(db) as st:
        assert [r["status"] for r in st.runs()] == ["finished"]
