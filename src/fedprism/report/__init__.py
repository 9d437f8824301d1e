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

from fedprism.algorithms import REGISTRY
from fedprism.experiment.store import Store

#: the per-setting tables, in the layout of the paper's ablation tables (3-5, 9-11): Final and Best
COLUMNS = [("global_acc", "Glob Final"), ("best_global_acc", "Glob Best"), ("local_acc", "Loc Final"),
           ("best_local_acc", "Loc Best"), ("sdad", "SDAD"), ("global_model_acc", "G Final")]


def _pm(vals: list[float], scale: float = 100.0) -> str:
    v = [x for x in vals if x is not None]
    if not v:
        return "-"
    a = np.asarray(v, dtype=float) * scale             # ± is the sample std over seeds (ddof=1)
    return f"{a.mean():.2f} ± {a.std(ddof=1):.2f}" if len(a) > 1 else f"{a.mean():.2f}"


def setting_of(cfg: dict) -> str:
    part = cfg["partition"]
    extra = {k.split(".", 1)[1]: v for k, v in cfg.items() if k.startswith("partition.")
             and k not in ("partition.min_train", "partition.min_test")}
    args = ",".join(f"{k}={v}" for k, v in sorted(extra.items()))
    return f"{cfg['dataset']} {part}({args}) N={cfg['clients']} T={cfg['rounds']}"


def collect(store: Store, sweep: str | list[str] | None = None) -> dict[str, dict[str, list[dict]]]:
    """setting -> label -> list of (config, final) for finished runs (of the given sweeps, if any).

    A run that several of the sweeps hold appears once, under the label of the first sweep listed.
    """
    sweeps = [sweep] if isinstance(sweep, str) else list(sweep or [])
    rows = [r for sw in sweeps for r in store.runs(sweep=sw)] if sweeps else store.runs()
    out: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    seen: set[str] = set()
    for r in rows:
        if r["status"] != "finished" or r["run_id"] in seen:
            continue
        seen.add(r["run_id"])
        cfg = json.loads(r["config"])
        out[setting_of(cfg)][r["label"] or cfg["method"]].append(
            {"run_id": r["run_id"], "config": cfg, "final": json.loads(r["final"] or "{}")})
    return out


def family_of(cfg: dict) -> tuple[str, str]:
    """(family, column): settings of one family differ only in their partition parameters."""
    extra = {k.split(".", 1)[1]: v for k, v in cfg.items() if k.startswith("partition.")
             and k not in ("partition.min_train", "partition.min_test")}
    col = ",".join(f"{k}={v}" for k, v in sorted(extra.items())) or "-"
    return f"{cfg['dataset']} {cfg['partition']} N={cfg['clients']} T={cfg['rounds']}", col


def paper_tables(groups) -> list[str]:
    """The paper's layout (Tables 1, 6, 7): methods x settings, Glob and Loc as mean ± std in %."""
    fams: dict[str, dict[str, str]] = defaultdict(dict)
    for setting, labels in groups.items():
        any_run = next(iter(next(iter(labels.values()))))
        fam, col = family_of(any_run["config"])
        fams[fam][col] = setting
    md = []
    for fam in sorted(fams):
        cols = sorted(fams[fam])
        labels = sorted({lab for c in cols for lab in groups[fams[fam][c]]})
        md += [f"### {fam}", "", "| method | " + " | ".join(f"{c} Glob | {c} Loc" for c in cols) + " |",
               "|---|" + "---|---|" * len(cols)]
        for lab in labels:
            cells = []
            for c in cols:
                runs = groups[fams[fam][c]].get(lab, [])
                cells += [_pm([r["final"].get(k) for r in runs]) for k in ("global_acc", "local_acc")]
            md.append(f"| {lab} | " + " | ".join(cells) + " |")
        md.append("")
    return md


def reference_table(groups, name: str) -> list[str]:
    """Ours next to a published table, row by row; |difference| > FLAG_POINTS is marked."""
    from fedprism.report.reference import FLAG_POINTS, REFERENCES

    if name not in REFERENCES:
        raise ValueError(f"unknown reference {name!r}; known: {', '.join(sorted(REFERENCES))}")
    ref = REFERENCES[name]
    md = [f"## Ours vs {name} (final round, %; ours mean over seeds)", "",
          "| setting | method | seeds | Glob ours | Glob paper | Δ | Loc ours | Loc paper | Δ | G ours |",
          "|---|---|---|---|---|---|---|---|---|---|"]
    for setting in sorted(ref):
        ours = groups.get(setting, {})
        for lab, paper in ref[setting].items():
            runs = ours.get(lab, [])
            cells = []
            for k, p in zip(("global_acc", "local_acc"), paper):
                v = [r["final"].get(k) for r in runs if r["final"].get(k) is not None]
                if v:
                    o = 100 * float(np.mean(v))
                    d = o - p
                    cells += [f"{o:.2f}", f"{p:.2f}", f"**{d:+.2f}**" if abs(d) > FLAG_POINTS else f"{d:+.2f}"]
                else:
                    cells += ["-", f"{p:.2f}", "-"]
            g = [r["final"].get("global_model_acc") for r in runs if r["final"].get("global_model_acc") is not None]
            cells.append(f"{100 * float(np.mean(g)):.2f}" if g else "-")
            md.append(f"| {setting} | {lab} | {len(runs)} | " + " | ".join(cells) + " |")
    md += ["", f"Bold: |Δ| > {FLAG_POINTS:g} points. '-': not run (yet), or no shared global model (G).", ""]
    return md


def alternatives_table(groups) -> list[str]:
    """Runs whose evaluation also scored alternative predictions (`<split>_acc@<name>`: fedprism_dual's
    streams alone and other routing temperatures T): final Glob / Loc of each, next to the headline."""
    md: list[str] = []
    for setting in sorted(groups):
        for label in sorted(groups[setting]):
            for r in sorted(groups[setting][label], key=lambda x: x["config"]["seed"]):
                f = r["final"]
                method = REGISTRY.get(r["config"]["method"])
                order = list(method.predictions) if method else []
                have = {k.split("@", 1)[1] for k in f if "@" in k}
                names = [n for n in order if n in have] + sorted(have - set(order))
                if not names:
                    continue
                if not md:
                    md = ["## Alternative predictions (final round, %)", "",
                          "Each stream of the dual-stream model alone, and the routed prediction (Eq. 2-3) at other "
                          "temperatures T, from the same evaluation as the headline numbers.", ""]
                cfg = r["config"]
                head = method.headline(cfg) if method else "prediction"
                label_of = method.predictions if method else {}
                md += [f"**{label}**, {setting}, seed {cfg['seed']} (`{r['run_id']}`)", "",
                       "| prediction | Glob | Loc |", "|---|---|---|",
                       f"| {head} (headline) | {_pm([f.get('global_acc')])} | {_pm([f.get('local_acc')])} |"]
                md += [f"| {label_of.get(n, n)} | {_pm([f.get('global_acc@' + n)])} | "
                       f"{_pm([f.get('local_acc@' + n)])} |" for n in names]
                md.append("")
    return md


def tables(groups, reference: str | None = None) -> tuple[str, list[list]]:
    md, rows = ["# fedprism results", "", "## Paper layout (final round; mean ± std over seeds, %)", ""], []
    md += paper_tables(groups)
    if reference:
        md += reference_table(groups, reference)
    md += alternatives_table(groups)
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
        md += ["", f"![accuracy per round](plots/{slug(setting)}-accuracy.png) "
                   f"![per-client local accuracy ECDF](plots/{slug(setting)}-ecdf.png)", ""]
    md.append("Glob: each client's model on the full global test set, mean over clients. Loc: each client's "
              "model on its own test split, mean over clients. Final = last round, Best = best evaluated "
              "round; mean ± sample standard deviation (ddof=1) over seeds, in %. SDAD: std of per-client "
              "local accuracy (×100). G: the method's shared global model (Fed-PRISM's w_g, FedPrism's G) "
              "on the global test set, where it has one.")
    return "\n".join(md) + "\n", rows


def slug(setting: str) -> str:
    return "".join(ch if ch.isalnum() or ch in ".-" else "-" for ch in setting.replace("=", "")).strip("-")


def _save(fig, path: Path) -> None:
    fig.savefig(path, dpi=90, metadata={"Software": None})


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _colors(n: int):
    plt = _plt()
    cmap = plt.get_cmap("tab10" if n <= 10 else "tab20")
    return [cmap(i % cmap.N) for i in range(n)]


def plot_setting(store: Store, setting: str, labels: dict[str, list[dict]], out: Path) -> list[Path]:
    """Accuracy per round (mean over seeds; global and local) and the ECDF of per-client local accuracy
    at the final evaluated round (pooled over seeds; seed 001 Fig. 8), one line per method."""
    plt = _plt()
    names = sorted(labels)
    colors = dict(zip(names, _colors(len(names))))
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8), sharey=True)
    for lab in names:
        curves = [[h for h in store.round_metrics(r["run_id"]) if "local_acc" in h] for r in labels[lab]]
        curves = [c for c in curves if c]
        if not curves:
            continue
        rounds = sorted(set.intersection(*[{h["round"] for h in c} for c in curves]))
        by_round = [{h["round"]: h for h in c} for c in curves]
        x = [t + 1 for t in rounds]
        # (panel, metric, line label, style): Glob and Loc, and the shared global model G dashed
        for ax, key, name, style in ((axes[0], "global_acc", lab, "-"), (axes[1], "local_acc", lab, "-"),
                                     (axes[0], "global_model_acc", f"{lab} (G)", "--")):
            vals = [[b[t].get(key) for t in rounds] for b in by_round]
            if rounds and all(v is not None for row in vals for v in row):
                ax.plot(x, np.mean(vals, axis=0), label=name, color=colors[lab], lw=1.2 if style == "-" else 1.0,
                        ls=style)
    for ax, title in zip(axes, ("global accuracy (Glob)", "local accuracy (Loc)")):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("accuracy (mean over clients and seeds)")
    handles = dict(zip(*reversed(axes[0].get_legend_handles_labels())))   # one legend, beside the panels
    fig.suptitle(setting, fontsize=9)
    fig.tight_layout(rect=(0, 0, 0.8, 1))
    fig.legend(list(handles.values()), list(handles), fontsize=6, loc="center left", bbox_to_anchor=(0.8, 0.5))
    paths = [out / f"{slug(setting)}-accuracy.png"]
    _save(fig, paths[0])
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for lab in names:
        acc = np.sort([c["local_acc"] for r in labels[lab] for c in store.client_rows(r["run_id"])
                       if c["local_acc"] is not None])
        if acc.size:
            ax.step(acc, np.arange(1, acc.size + 1) / acc.size, where="post", label=lab, color=colors[lab], lw=1.2)
    ax.set_xlabel("client's local test accuracy (final round)")
    ax.set_ylabel("fraction of clients")
    ax.set_xlim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, loc="upper left")
    ax.set_title(f"ECDF of per-client local accuracy\n{setting}", fontsize=9)
    fig.tight_layout()
    paths.append(out / f"{slug(setting)}-ecdf.png")
    _save(fig, paths[-1])
    plt.close(fig)
    return paths


def plot_clusters(store: Store, run: dict, out: Path) -> list[Path]:
    """Cluster assignment of every client over the clustering rounds (methods that record clusters)."""
    recs = store.records(run["run_id"], "clusters")
    if not recs:
        return []
    plt = _plt()
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
    ax.set_title(f"cluster assignment: {run['config'].get('name')} (seed {run['config']['seed']})", fontsize=9)
    fig.colorbar(im, ax=ax, label="cluster")
    fig.tight_layout()
    p = out / f"{run['run_id']}-clusters.png"
    _save(fig, p)
    plt.close(fig)
    return [p]


def write_report(db: str, out: str, sweep: str | list[str] | None = None, plots: bool = True,
                 reference: str | None = None) -> list[Path]:
    """results.md (paper layout, optional published reference, per-setting detail), results.csv (one row
    per run) and plots/."""
    store = Store(db)
    try:
        groups = collect(store, sweep)
        outdir = Path(out)
        outdir.mkdir(parents=True, exist_ok=True)
        md, rows = tables(groups, reference)
        paths = [outdir / "results.md", outdir / "results.csv"]
        paths[0].write_text(md)
        with open(paths[1], "w", newline="") as f:
            w = csv.writer(f, lineterminator="\n")
            w.writerow(["setting", "method", "seed", "run_id"] + [k for k, _ in COLUMNS])
            w.writerows(rows)
        if plots:
            import matplotlib

            pdir = outdir / "plots"
            pdir.mkdir(exist_ok=True)
            # PNG bytes depend on the matplotlib version: say which one drew them
            paths.append(pdir / "RENDERED_WITH")
            paths[-1].write_text(f"matplotlib {matplotlib.__version__}\n")
            for setting in sorted(groups):
                paths += plot_setting(store, setting, groups[setting], pdir)
                for label in sorted(groups[setting]):
                    for run in sorted(groups[setting][label], key=lambda r: r["config"]["seed"]):
                        paths += plot_clusters(store, run, pdir)
        return paths
    finally:
        store.close()
