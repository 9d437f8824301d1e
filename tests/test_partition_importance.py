"""Fig. 4 of Clust-PSI-PFL (Jimenez-Gutierrez et al. 2025, arXiv:2512.20363): models predicting the non-IID
level from WPSI^L, HD, JSD and EMD, with feature importances, rendered by `fedprism report --partition-study`."""

from __future__ import annotations

import numpy as np
import pytest

from fedprism.algorithms.clust_psi_pfl import study
from fedprism.cli import main


def _rows(protocol="dirichlet_per_class", param="alpha", values=(0.05, 0.1, 0.3, 1.0, 5.0, 50.0), seeds=3,
          driver="wpsi"):
    """Generated Fig. 3 rows: the `driver` measure is a function of the level, the other three are noise."""
    rng = np.random.default_rng(0)
    rows = []
    for v in values:
        for s in range(seeds):
            r = {"protocol": protocol, "param": param, "value": float(v), "seed": s, "clients": 10}
            for k, _ in study.FEATURES:
                r[k] = float(rng.uniform(0, 1))
            r[driver] = float(-np.log10(v) if param == "alpha" else 1 - v) + float(rng.normal(0, 1e-3))
            rows.append(r)
    return rows


@pytest.mark.parametrize("driver", ["wpsi", "emd"])
def test_the_measure_that_carries_the_level_ranks_first_for_every_model(driver):
    div = _rows(driver=driver) + _rows("similarity", "s", (0.0, 0.1, 0.3, 0.5, 0.9, 1.0), driver=driver)
    imp, notes = study.importance_rows(div, seed=0)
    assert not notes and len(imp) == 2 * len(study.IMPORTANCE_MODELS)
    assert [r["model"] for r in imp[:4]] == list(study.IMPORTANCE_MODELS)
    for r in imp:
        vals = {k: r[k] for k, _ in study.FEATURES}
        assert sum(vals.values()) == pytest.approx(1.0, abs=1e-9) and min(vals.values()) >= 0
        assert max(vals, key=vals.get) == driver, r
        assert r["r2"] > 0.75 and r["rows"] == 18                   # (the RBF SVM at its defaults fits least)
    assert {r["target"] for r in imp} == {"log10 alpha", "s"}     # alpha spans three decades: log10


def test_the_dirichlet_target_is_log10_alpha():
    """A tree fits the level it is given exactly: its in-sample predictions of log10(alpha) reproduce the
    levels, so the target is log10(alpha), not alpha (R^2 of 1 either way would not tell)."""
    div = _rows()
    model = study._importance_model("regression tree", 0)
    x = np.array([[r[k] for k, _ in study.FEATURES] for r in div])
    model.fit(x, np.log10([r["value"] for r in div]))
    imp, _ = study.importance_rows(div)
    tree = [r for r in imp if r["model"] == "regression tree"][0]
    assert tree["r2"] == pytest.approx(1.0) and tree["wpsi"] == pytest.approx(float(model.feature_importances_[0]))


def test_too_few_rows_or_one_level_are_left_out_with_a_note():
    imp, notes = study.importance_rows(_rows(values=(0.3,), seeds=3))
    assert imp == [] and len(notes) == 1 and "Dirichlet" in notes[0] and "two levels" in notes[0]
    imp, notes = study.importance_rows(_rows(values=(0.3, 1.0), seeds=2))
    assert imp == [] and "4 rows" in notes[0]


def test_report_renders_fig4_from_a_tiny_study(tmp_path, monkeypatch, capsys):
    """`fedprism report --partition-study` on digits with a small grid: the Fig. 4 table in the markdown,
    its CSV and its plot."""
    monkeypatch.setattr(study, "CLIENT_COUNTS", (10,))
    monkeypatch.setattr(study, "GRIDS", {"dirichlet_per_class": ("alpha", (5.0, 20.0, 50.0)),   # K = 100 on digits
                                         "similarity": ("s", (0.0, 0.5, 1.0))})
    out = tmp_path / "ps"
    assert main(["report", "--partition-study", "digits", "--out", str(out), "--seed", "0", "--seed", "1"]) == 0
    md = (out / "partition_study.md").read_text()
    assert "## Predicting the non-IID level from the measures (Fig. 4)" in md
    table = [l for l in md.splitlines() if l.startswith("| Dirichlet | log10 alpha |") or
             l.startswith("| Similarity | s |")]
    assert len(table) == 2 * len(study.IMPORTANCE_MODELS)
    for line in table:                                             # one bold importance per model: the largest
        cells = [c.strip() for c in line.strip("|").split("|")][3:3 + len(study.FEATURES)]
        bold = [i for i, c in enumerate(cells) if c.startswith("**")]
        vals = [float(c.strip("*")) for c in cells]
        assert len(bold) == 1 and vals[bold[0]] == max(vals), line
    assert any(not line.split("|")[4].strip().startswith("**") for line in table)   # not always WPSI^L
    lines = (out / "partition_importance.csv").read_text().splitlines()
    assert lines[0] == "protocol,target,model,rows,wpsi,hd,jsd,emd,r2,r2_cv" and len(lines) == 1 + len(table)
    assert all(line.split(",")[3] == "6" for line in lines[1:])     # 3 levels x 2 seeds per protocol
    assert all(line.split(",")[-1] != "nan" for line in lines[1:])  # 3 folds of 2 rows: R^2 defined
    assert (out / "plots" / "partition_importance.png").stat().st_size > 0
    assert str(out / "plots" / "partition_importance.png") in capsys.readouterr().out.split()
