"""Tables and plots from the results store (`fedprism report`).

Runs are grouped by their label (`name`: a sweep row) and dataset/partition; seeds are aggregated
as mean +- std of the final and best accuracies. Output is deterministic in the database contents
(sorted rows, no timestamps, PNG metadata stripped), so a committed report can be regenerated
byte-for-byte.
"""

from __future__ import annotations

import csv
import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from fedprism.experiment.store import Store

COLUMNS = [("global_acc", "Glob"), ("local_acc", "Loc"), ("best_global_acc", "Best Glob"),
           ("best_local_acc", "Best Loc"), ("sdad", "SDAD")]


def _pm(vals: list[float], scale: float = 100.0) -> str:
    v = [x for x in vals if x is not None]
    if not v:
        return "-"
    a = np.asarray(v, dtype=float) * scale
    return f"{a.mean():.2f} ± {a.std():.2f}" if len(a) > 1 else f"{a.mean():.2f}"


def setting_of(cfg: dict) -> str:
    part = cfg["partition"]
    extra = {k.split(".", 1)[1]: v for k, v in cfg.items() if k.startswith("partition.")
             and k not in ("partition.min_train", "partition.min_test")}
    args = ",".join(f"{k}={v}" for k, v in sorted(extra.items()))
    return f"{cfg['dataset']} {part}({args}) N={cfg['clients']} T={cfg['rounds']}"


def collect(store: Store, sweep: str | None = None) -> dict[str, dict[str, list[dict]]]:
    """setting -> label -> list of (config, final) for finished runs."""
    rows = store.runs(sweep=sweep) if sweep else store.runs()
    out: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r["status"] != "finished":
            continue
        cfg = json.loads(r["config"])
        out[setting_of(cfg)][r["label"] or cfg["method"]].append(
            {"run_id": r["run_id"], "config": cfg, "final": json.loads(r["final"] or "{}")})
    return out


def tables(groups) -> tuple[str, list[list]]:
    md, rows = ["# fedprism results", ""], []
    for setting in sorted(groups):
        md += [f"## {setting}", "", "| method | seeds | " + " | ".join(h for _, h in COLUMNS) + " |",
               "|---|---|" + "---|" * len(COLUMNS)]
        for label in sorted(groups[setting]):
            runs = sorted(groups[setting][label], key=lambda x: x["config"]["seed"])
            cells = [_pm([r["final"].get(k) for r in runs]) for k, _ in COLUMNS]
            md.append(f"| {label} | {len(runs)} | " + " | ".join(cells) + " |")
            for r in runs:
                rows.append([setting, label, r["config"]["seed"], r["run_id"]]
                            + [r["final"].get(k) for k, _ in COLUMNS])
        md.append("")
    md.append("Glob: each client's model on the full global test set, mean over clients. Loc: each client's "
              "model on its own test split, mean over clients. Final = last round, Best = best evaluated "
              "round; mean ± std over seeds, in %. SDAD: std of per-client local accuracy (fraction).")
    return "\n".join(md) + "\n", rows


def _save(fig, path: Path) -> None:
    fig.savefig(path, dpi=90, metadata={"Software": None})


def plot_run(store: Store, run: dict, out: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    hist = [h for h in store.round_metrics(run["run_id"]) if "local_acc" in h]
    if hist:
        fig, ax = plt.subplots(figsize=(5, 3.2))
        r = [h["round"] + 1 for h in hist]
        ax.plot(r, [h["local_acc"] for h in hist], label="local acc")
        if "global_acc" in hist[0]:
            ax.plot(r, [h["global_acc"] for h in hist], label="global acc")
        ax.set_xlabel("round")
        ax.set_ylabel("accuracy")
        ax.set_title(f"{run['config'].get('name')} (seed {run['config']['seed']})", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        p = out / f"{run['run_id']}-accuracy.png"
        _save(fig, p)
        plt.close(fig)
        paths.append(p)
    recs = store.records(run["run_id"], "clusters")
    if recs:
        n = run["config"]["clients"]
        rounds = [x["round"] for x in recs]
        grid = np.full((n, len(recs)), np.nan)
        last = np.full(n, np.nan)
        for j, x in enumerate(recs):
            last[np.asarray(x["data"]["clients"], dtype=int)] = x["data"]["labels"]
            grid[:, j] = last
        fig, ax = plt.subplots(figsize=(5, 4))
        im = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="tab10")
        ax.set_xticks(range(len(rounds)))
        ax.set_xticklabels([str(r) for r in rounds], fontsize=6)
        ax.set_xlabel("clustering round")
        ax.set_ylabel("client")
        ax.set_title(f"cluster assignment: {run['config'].get('name')}", fontsize=9)
        fig.colorbar(im, ax=ax, label="cluster")
        fig.tight_layout()
        p = out / f"{run['run_id']}-clusters.png"
        _save(fig, p)
        plt.close(fig)
        paths.append(p)
    return paths


def write_report(db: str, out: str, sweep: str | None = None, plots: bool = True) -> list[Path]:
    store = Store(db)
    groups = collect(store, sweep)
    outdir = Path(out)
    outdir.mkdir(parents=True, exist_ok=True)
    md, rows = tables(groups)
    paths = [outdir / "results.md", outdir / "results.csv"]
    paths[0].write_text(md)
    with open(paths[1], "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["setting", "method", "seed", "run_id"] + [k for k, _ in COLUMNS])
        w.writerows(rows)
    if plots:
        pdir = outdir / "plots"
        pdir.mkdir(exist_ok=True)
        for setting in sorted(groups):
            for label in sorted(groups[setting]):
                for run in groups[setting][label]:
                    paths += plot_run(store, run, pdir)
    return paths
