"""The leaderboard (src/fedprism/report/leaderboard.py): its statistics on hand-made numbers, and a board
built from a hand-made store through `fedprism report --leaderboard`."""

import csv
import json
import math

import numpy as np
import pytest

from fedprism.cli import main
from fedprism.experiment.config import resolve
from fedprism.experiment.store import Store
from fedprism.report import leaderboard as lb


def test_mean_and_t_interval_by_hand():
    m, half = lb.mean_ci([0.8, 0.9, 1.0])
    assert m == pytest.approx(0.9)
    assert half == pytest.approx(4.302652729911275 * 0.1 / math.sqrt(3))      # t(0.975, 2) s / sqrt(n)
    assert lb.mean_ci([0.7]) == (0.7, None)


def test_ranks_share_ties():
    assert lb.ranks([0.5, 0.7, 0.7, 0.1]) == [3.0, 1.5, 1.5, 4.0]


def test_sign_flip_weights_each_seed_equally_by_hand():
    """Blocks [1, 2] and [3]: T = (1 + 2)/2/2 + 3/2 = 2.25 (pooling the three pairs would give 2); the 8 sign
    patterns of (0.25, 0.5, 1.5) reach |T*| >= 2.25 twice: p = 2/8."""
    t, p = lb.stratified_sign_flip([np.array([1.0, 2.0]), np.array([3.0])])
    assert t == pytest.approx(2.25) and p == pytest.approx(0.25)
    assert lb.stratified_sign_flip([np.zeros(3), np.zeros(2)]) == (0.0, 1.0)        # equal methods: p = 1
    # one block of -3 against four of +1: every pattern is at least |1.5 - 0.5| = 1 = |T|
    t, p = lb.stratified_sign_flip([np.ones(4), np.array([-3.0])])
    assert t == pytest.approx(-1.0) and p == 1.0


def test_sign_flip_beyond_exact_enumeration():
    """20 pairs of +1: exactly p = 2 / 2^20; the random patterns (fixed seed) give (1 + hits) / (1 + draws)
    with almost no hit, and agree with exact enumeration on a mixed sample."""
    t, p = lb.stratified_sign_flip([np.ones(10), np.ones(10)])
    assert t == pytest.approx(1.0) and p <= 3 / (1 + lb.DRAWS)
    rng = np.random.default_rng(3)
    blocks = [rng.normal(0.1, 1.0, 8), rng.normal(0.1, 1.0, 8)]
    exact = lb.stratified_sign_flip(blocks)[1]
    sampled = lb.stratified_sign_flip(blocks, draws=40_000, exact_pairs=0)[1]
    assert abs(exact - sampled) < 0.01


CLIENTS = {("A", 0): [0.9, 0.8, 0.7], ("A", 1): [0.6, 0.9, 0.9],
           ("B", 0): [0.5, 0.8, 0.6], ("B", 1): [0.6, 0.7, 0.8]}


def _store(path):
    """Runs of labels A (fedavg) and B (fedprox), seeds 0 and 1, three clients each (`CLIENTS`), in the sweep
    'lb'; A's runs carry a tune_choice record."""
    store = Store(path)
    for (label, seed), accs in CLIENTS.items():
        cfg = resolve({"method": "fedavg" if label == "A" else "fedprox", "dataset": "digits", "clients": 3,
                       "rounds": 1, "seed": seed, "name": label})
        rid = cfg.run_id
        store.start_run(rid, cfg.values, "lb")
        store.write_round(rid, 0, {"local_acc": float(np.mean(accs))},
                          [(c, a, 0.1, a, 10, a) for c, a in enumerate(accs)], [], 0.1)
        store.finish(rid, {"local_acc": float(np.mean(accs)), "global_acc": float(np.mean(accs))})
        if label == "A":
            store.annotate(rid, "tune_choice", {"study": "lb", "label": "A", "trial": 4, "trial_run": "0" * 16,
                                                "params": {"lr": 0.05}, "value": 0.77, "objective": "val_acc",
                                                "budget": 12, "sampler": "tpe", "pruner": "median", "complete": 9,
                                                "pruned": 3, "rounds_trained": 300, "trials_sweep": "lb/trials",
                                                "space": {"lr": "[0.001, 0.1] log"}}, -5)
    store.close()


def test_board_from_a_hand_made_store(tmp_path):
    db = tmp_path / "lb.db"
    _store(db)
    with Store(db, readonly=True) as store:
        board = lb.build(store, ["lb"])
    (col,) = board.columns
    a, b = board.cells[("A", col)], board.cells[("B", col)]
    assert board.best[col] == "A" and (a.rank, b.rank) == (1.0, 2.0)
    assert a.mean == pytest.approx(0.8) and a.half == pytest.approx(0.0, abs=1e-12)
    assert b.mean == pytest.approx((1.9 / 3 + 0.7) / 2)
    sd = np.std([1.9 / 3, 0.7], ddof=1)
    assert b.half == pytest.approx(12.706204736174698 * sd / math.sqrt(2))
    # d = best - B per client: seed 0 (0.4, 0, 0.1), seed 1 (0, 0.2, 0.1); T = (0.5/3 + 0.3/3) / 2; the four
    # non-zero pairs reach |T| only all of one sign: p = 2/16
    assert b.pairs == 6 and b.diff == pytest.approx((0.5 / 3 + 0.3 / 3) / 2) and b.p == pytest.approx(0.125)
    assert a.p is None and a.choice["trial"] == 4 and b.choice is None


def test_leaderboard_command_writes_markdown_csv_html_with_links(tmp_path, capsys):
    db = tmp_path / "lb.db"
    _store(db)
    out = tmp_path / "out"
    assert main(["report", "--leaderboard", "--sweep", "lb", "--db", str(db), "--out", str(out)]) == 0
    md = (out / "leaderboard.md").read_text()
    (row_a,) = [line for line in md.splitlines() if line.startswith("| A |")]
    anchor = row_a.split("](#")[1].split(")")[0]
    assert "**80.00 ± 0.00** (1)" in row_a and f'<a id="{anchor}"></a>' in md
    assert "trial #5 of study `lb`" in md and "`lr=0.05`" in md and "12 trials (tpe sampler, median pruner): 9 " \
        "complete, 3 pruned, 300 rounds trained" in md
    (row_b,) = [line for line in md.splitlines() if line.startswith("| B |")]
    assert "66.67 ± " in row_b and "(2) p=0.125" in row_b and "](#" not in row_b and "▼" not in row_b
    rows = list(csv.DictReader(open(out / "leaderboard.csv")))
    assert [(r["method"], r["rank"], r["best"]) for r in rows] == [("A", "1.0", "A"), ("B", "2.0", "A")]
    assert float(rows[1]["p_vs_best"]) == pytest.approx(0.125) and rows[1]["pairs"] == "6"
    assert json.loads(rows[0]["tuned_params"]) == {"lr": 0.05} and rows[0]["budget"] == "12"
    assert rows[0]["tuned_trial"] == "5" and rows[1]["tuned_trial"] == ""    # the stored trial 4, counted from 1
    page = (out / "leaderboard.html").read_text()
    assert f'<a href="#{anchor}">' in page and f'<h3 id="{anchor}">' in page and "<script" not in page


def test_leaderboard_refuses_what_it_cannot_pair(tmp_path):
    db = tmp_path / "lb.db"
    _store(db)
    with Store(db, readonly=True) as store:
        with pytest.raises(Exception, match="per client"):
            lb.build(store, ["lb"], metric="ad")
        with pytest.raises(Exception, match="--sweep"):
            lb.build(store, [])
        with pytest.raises(Exception, match="no sweep 'lbb'"):
            lb.build(store, ["lbb"])
