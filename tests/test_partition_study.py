"""`fedprism report --partition-study`: found through the method registry (`Algorithm.partition_study`,
a method package's `study` companion), never by a method's name; its settings are data (study.toml)."""

from __future__ import annotations

import pytest

from fedprism.algorithms import REGISTRY
from fedprism.algorithms.base import Algorithm
from fedprism.cli import main
from fedprism.errors import ConfigError
from fedprism.report import partition_studies, write_partition_studies


def test_the_study_is_found_through_the_methods_hook():
    from fedprism.algorithms.clust_psi_pfl import study

    found = partition_studies()
    assert found == {"clust_psi_pfl": study.write_partition_study}
    assert REGISTRY.get("clust_psi_pfl").partition_study() is study.write_partition_study
    assert REGISTRY.get("fedavg").partition_study() is None          # a one-file method: none
    assert REGISTRY.get("fedprism_dual").partition_study() is None   # a package without a `study` companion


def test_the_settings_file_holds_the_papers_protocols():
    """study.toml is the paper's Fig. 3 grids and Figs. 5-6 settings (arXiv:2512.20363, section IV-A)."""
    from fedprism.algorithms.clust_psi_pfl import study

    assert study.GRIDS == {"dirichlet_per_class": ("alpha", (0.05, 0.07, 0.09, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0, 5.0,
                                                             50.0)),
                           "similarity": ("s", (0.0, 0.01, 0.03, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1.0))}
    assert study.CLUSTER_SETTINGS == (("dirichlet_per_class", "alpha", 0.3), ("similarity", "s", 0.0))
    assert study.CLIENT_COUNTS == (10, 50, 100)
    assert [study._label({"protocol": p, "param": "x", "value": 0.5}) for p in
            ("dirichlet_per_class", "similarity", "dirichlet", "iid")] == [
        "Dirichlet x=0.5", "Similarity x=0.5", "Dirichlet x=0.5", "iid x=0.5"]
    for partition in study.GRIDS:                     # every protocol is a partition a run can train on
        assert partition in __import__("fedprism.data.partitions.base", fromlist=["PARTITIONS"]).PARTITIONS


@pytest.mark.parametrize("seed", [0, 7, -1, 2**63, True, 0.5, "3"])
def test_a_study_seed_is_what_a_runs_seed_is(seed):
    """The study checks its seeds by the rule of the run's `seed` key without importing the runs layer."""
    from fedprism.algorithms.clust_psi_pfl.study import SEED
    from fedprism.experiment.config import KEYS

    def outcome(param):
        try:
            return param.validate("seed", seed)
        except ConfigError as e:
            return str(e)

    assert outcome(SEED) == outcome(KEYS["seed"])


def test_several_methods_with_a_study_each_write_into_their_own_folder(tmp_path, monkeypatch):
    calls = []

    def fake(dataset, out, seeds=(0, 1, 2), plots=True):
        calls.append((dataset, out, seeds, plots))
        out.mkdir(parents=True)
        (out / "s.md").write_text(dataset)
        return [out / "s.md"]

    fedavg = REGISTRY.get("fedavg")
    monkeypatch.setattr(fedavg, "partition_study", classmethod(lambda cls: fake if cls is fedavg else None))
    paths = write_partition_studies("digits", tmp_path / "o", seeds=(1,), plots=False)
    assert calls == [("digits", tmp_path / "o" / "fedavg", (1,), False)]
    assert tmp_path / "o" / "fedavg" / "s.md" in paths
    assert any(p.parent == tmp_path / "o" / "clust_psi_pfl" and p.name == "partition_study.md" for p in paths)


def test_no_method_with_a_study_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(Algorithm, "partition_study", classmethod(lambda cls: None))
    with pytest.raises(ConfigError, match="no registered method has one"):
        write_partition_studies("digits", tmp_path / "o")
    assert main(["report", "--partition-study", "digits", "--out", str(tmp_path / "o"), "--no-plots"]) == 2
    assert "option '--partition-study' = 'digits'" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_the_cli_writes_the_study_through_the_hook(tmp_path, monkeypatch, capsys):
    from fedprism.algorithms.clust_psi_pfl import study

    seen = []
    real = study.write_partition_study

    def spy(dataset, out, **kw):
        seen.append((dataset, out, kw))
        return real(dataset, out, **kw)

    monkeypatch.setattr(study, "write_partition_study", spy)
    monkeypatch.setattr(study, "CLIENT_COUNTS", (10,))
    monkeypatch.setattr(study, "GRIDS", {"dirichlet_per_class": ("alpha", (0.3,))})
    assert main(["report", "--partition-study", "digits", "--out", str(tmp_path / "ps"), "--seed", "0",
                 "--no-plots"]) == 0
    assert seen == [("digits", tmp_path / "ps", {"seeds": (0,), "plots": False})]
    md = (tmp_path / "ps" / "partition_study.md").read_text()
    assert "| Dirichlet alpha=0.3 | 10 |" in md and "| Similarity s=0 | 10 |" in md
    assert capsys.readouterr().out.split() == [str(tmp_path / "ps" / n) for n in ("partition_study.md",
                                                                                   "partition_study.csv")]
