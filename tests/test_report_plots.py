"""The report's figures: written as PNG and PDF, the spread over seeds drawn as a band, titles that name
only what is not at its default, and curves that lie on top of each other told apart (markers by method,
a legend note when identical). A small store stand-in with hand-made curves: no training."""

from __future__ import annotations

import numpy as np
import pytest

from fedprism.plotting import PDF_METADATA, pyplot, save
from fedprism.experiment.differ import tell_apart
from fedprism.report import accuracy_figure, ecdf_figure, plot_setting, plot_title, setting_of, styles


class Curves:
    """`round_metrics` and `client_rows` of a store, from dicts: run id -> rounds / final client rows."""

    def __init__(self, rounds: dict[str, list[dict]], clients: dict[str, list[dict]]):
        self.rounds, self.clients = rounds, clients

    def round_metrics(self, run_id):
        return self.rounds[run_id]

    def client_rows(self, run_id):
        return self.clients[run_id]


def _cfg(method, seed, **kw):
    return {"method": method, "name": method, "seed": seed, "dataset": "digits", "partition": "dirichlet",
            "partition.alpha": 0.3, "partition.min_train": 10, "clients": 4, "rounds": 3, "lr": 0.01,
            "eval_every": 1, "threads": 2, **kw}


def _store():
    g = {"a0": [0.2, 0.4, 0.6], "a1": [0.4, 0.6, 0.9], "b0": [0.1, 0.1, 0.3], "c0": [0.1, 0.1, 0.3]}
    rounds = {rid: [{"round": t, "global_acc": v, "local_acc": v + 0.05} for t, v in enumerate(vals)]
              for rid, vals in g.items()}
    clients = {rid: [{"local_acc": v} for v in (0.5, 0.7)] for rid in g}
    labels = {"FedAvg": [{"run_id": "a0", "config": _cfg("fedavg", 0)}, {"run_id": "a1", "config": _cfg("fedavg", 1)}],
              "Local": [{"run_id": "b0", "config": _cfg("local", 0)}],
              "Mine": [{"run_id": "c0", "config": _cfg("local", 0, lr=0.05)}]}
    return Curves(rounds, clients), labels


def _bands(fig):
    return {c.get_gid(): c for ax in fig.axes for c in ax.collections if str(c.get_gid()).startswith("band:")}


def test_the_band_spans_min_to_max_over_seeds_around_the_mean():
    store, labels = _store()
    fig = accuracy_figure(store, "s", labels)
    bands = _bands(fig)
    assert set(bands) == {"band:FedAvg:global_acc", "band:FedAvg:local_acc"}     # one seed: no band
    path = bands["band:FedAvg:global_acc"].get_paths()[0].vertices
    ys = {round(float(x), 6): set() for x in path[:, 0]}
    for x, y in path:
        ys[round(float(x), 6)].add(round(float(y), 6))
    assert ys[1.0] == {0.2, 0.4} and ys[2.0] == {0.4, 0.6} and ys[3.0] == {0.6, 0.9}   # min and max per round
    line = next(ln for ln in fig.axes[0].lines if ln.get_label() == "FedAvg")
    assert np.allclose(line.get_ydata(), [0.3, 0.5, 0.75])                            # the mean over seeds
    assert "band: min to max over seeds" in fig.axes[0].get_ylabel()
    pyplot().close(fig)


def test_identical_curves_are_named_and_methods_have_markers():
    store, labels = _store()
    fig = accuracy_figure(store, "s", labels)
    by_label = {ln.get_label(): ln for ln in fig.axes[0].lines}
    assert "Mine (Glob = Local; Loc = Local)" in by_label and "Local" in by_label
    markers = [by_label[k].get_marker() for k in ("FedAvg", "Local", "Mine (Glob = Local; Loc = Local)")]
    assert len(set(markers)) == 3 and "None" not in markers
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "Mine (Glob = Local; Loc = Local)" in legend
    pyplot().close(fig)
    fig = ecdf_figure(store, "s", labels)
    names = [ln.get_label() for ln in fig.axes[0].lines]
    assert names == ["FedAvg", "Local", "Mine (same as Local)"]     # FedAvg pools two seeds' clients
    pyplot().close(fig)
    assert len({(s["color"], str(s["ls"]), s["marker"]) for s in styles(12)}) == 12


def test_the_title_names_what_is_not_at_its_default():
    store, labels = _store()
    cfgs = [r["config"] for runs in labels.values() for r in runs]
    # alpha 0.3 is not Dirichlet's default, min_train 10 is; lr differs between the runs (the legend's);
    # eval_every 1 and lr 0.01 are the defaults; threads is execution-only; the seed is pooled
    assert plot_title(cfgs) == "digits dirichlet(alpha=0.3) N=4 T=3"
    same_lr = [c for c in cfgs if c["lr"] == 0.01]
    assert plot_title(same_lr) == "digits dirichlet(alpha=0.3) N=4 T=3"
    assert plot_title([{**c, "lr": 0.2, "eval_every": 5} for c in same_lr]) == \
        "digits dirichlet(alpha=0.3) N=4 T=3\neval_every=5, lr=0.2"
    # the partition is always named with its parameters, at their defaults too (alpha 0.1 is Dirichlet's)
    assert plot_title([{**c, "partition.alpha": 0.1, "eval_every": 5} for c in same_lr]) == \
        "digits dirichlet(alpha=0.1) N=4 T=3\neval_every=5"
    # numbers as `fedprism runs` writes them (alpha=1, not 1.0), in the title and in the table's setting
    one = [{**c, "partition.alpha": 1.0} for c in same_lr]
    assert plot_title(one) == "digits dirichlet(alpha=1) N=4 T=3" and setting_of(one[0]) == \
        "digits dirichlet(alpha=1) N=4 T=3"
    assert tell_apart([one[0], {**one[0], "partition.alpha": 0.5}], names=["x", "x"])[0] == "partition.alpha=1"
    # a common partition key where it is changed; a partition without parameters
    assert plot_title([{**c, "partition.min_train": 5} for c in same_lr]) == \
        "digits dirichlet(alpha=0.3,min_train=5) N=4 T=3"
    plain = [{k: v for k, v in c.items() if k != "partition.alpha"} | {"partition": "iid"} for c in same_lr]
    assert plot_title(plain) == "digits iid N=4 T=3" and setting_of(plain[0]) == "digits iid() N=4 T=3"
    fig = accuracy_figure(store, "s", labels)
    assert fig._suptitle.get_text() == plot_title(cfgs)
    pyplot().close(fig)


def test_every_figure_is_written_as_png_and_pdf(tmp_path):
    store, labels = _store()
    paths = plot_setting(store, "digits dirichlet(alpha=0.3) N=4 T=3", labels, tmp_path)
    assert [p.suffix for p in paths] == [".png", ".pdf", ".png", ".pdf"]
    assert [p.stem for p in paths[::2]] == [p.stem for p in paths[1::2]]
    for p in paths:
        head = p.read_bytes()[:8]
        assert head.startswith(b"\x89PNG") if p.suffix == ".png" else head.startswith(b"%PDF-")
    again = plot_setting(store, "digits dirichlet(alpha=0.3) N=4 T=3", labels, tmp_path / "again") \
        if (tmp_path / "again").mkdir() is None else None
    for a, b in zip(paths, again):                       # the same figure: the same bytes, PDF included
        assert a.read_bytes() == b.read_bytes(), a.name
    pdf = paths[1].read_bytes()
    assert b"CreationDate" not in pdf and b"Producer" not in pdf


def test_save_writes_both_formats(tmp_path):
    plt = pyplot()
    fig, ax = plt.subplots()
    ax.fill_between([0, 1], [0, 0], [1, 1], gid="band:x")
    assert save(fig, tmp_path / "f.png") == [tmp_path / "f.png", tmp_path / "f.pdf"]
    plt.close(fig)
    assert set(PDF_METADATA) == {"Creator", "Producer", "CreationDate"}


@pytest.mark.parametrize("html", [False, True])
def test_a_report_lists_both_formats(tmp_path, html):
    """A real (tiny) run through `write_report`: every PNG it lists has its PDF beside it."""
    from fedprism.experiment.config import resolve
    from fedprism.experiment.runner import Experiment
    from fedprism.experiment.store import Store
    from fedprism.report import write_report

    db = tmp_path / "r.db"
    for seed in (0, 1):
        Experiment(resolve({"method": "fedavg", "dataset": "digits", "model": "mlp", "clients": 4, "rounds": 2,
                            "local_epochs": 1, "eval_every": 1, "seed": seed, "engine": "sequential",
                            "data.train_subset": 300, "data.test_subset": 100,
                            "partition.min_train": 5, "partition.min_test": 2}), Store(db)).run()
    paths = write_report(str(db), str(tmp_path / "rep"), html=html)
    pngs = {p.stem for p in paths if p.suffix == ".png"}
    assert pngs and pngs == {p.stem for p in paths if p.suffix == ".pdf"}
    assert all(p.is_file() for p in paths)
