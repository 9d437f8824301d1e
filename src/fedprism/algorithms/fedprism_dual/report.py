"""The report sections and figures that only FedPrism (dual-stream) runs have, found by the report through
`Algorithm.report_sections` / `Algorithm.report_figures` (this module is the package's `report`
companion):

* the adaptive alpha_i and the private share gamma_i over the rounds (Algorithm 2 lines 27-31), from the
  run's `alpha` records: a table at six rounds of each run, and a figure per run;
* the routing chosen on validation data (`routing.routing_choice_table`), for runs with validation splits.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np

from fedprism.algorithms.fedprism_dual.routing import routing_choice_table
from fedprism.plotting import pyplot, save
from fedprism.textable import md_cell


def alpha_trajectory(store, run: dict) -> dict[str, np.ndarray] | None:
    """FedPrism's adaptive alpha_i and the private share gamma_i over the rounds (Algorithm 2 lines
    27-31, from the run's `alpha` records): per recorded round, the mean / min / max of alpha over every
    client updated so far (its latest value; never-sampled clients keep alpha_0 and are left out) and the
    mean gamma = 1 - alpha - beta (clamped at 0 unless `alpha_rule=as_printed`). None: no such records."""
    recs = store.records(run["run_id"], "alpha")
    if not recs:
        return None
    cfg, m = run["config"], run["config"]["method"]
    beta = float(cfg.get(f"{m}.beta", 0.0))
    full = cfg.get(f"{m}.components", "full") == "full"
    printed = cfg.get(f"{m}.alpha_rule", "reading") == "as_printed"
    latest = np.full(int(cfg["clients"]), np.nan)
    out: dict[str, list] = defaultdict(list)
    for x in recs:
        latest[np.asarray(x["data"]["clients"], dtype=int)] = x["data"]["alpha"]
        a = latest[np.isfinite(latest)]
        g = (1 - a - beta) if full else np.zeros_like(a)
        g = g if printed else np.clip(g, 0, None)
        for k, v in (("round", x["round"] + 1), ("mean", a.mean()), ("min", a.min()), ("max", a.max()),
                     ("p10", np.percentile(a, 10)), ("p90", np.percentile(a, 90)), ("gamma", g.mean()),
                     ("gamma_max", g.max()), ("seen", a.size)):
            out[k].append(v)
    return {k: np.asarray(v) for k, v in out.items()}


def alpha_table(store, groups) -> list[str]:
    """The alpha / gamma trajectory of every run with an adaptive alpha, at six rounds of the run."""
    md: list[str] = []
    for setting in sorted(groups):
        for label in sorted(groups[setting]):
            for r in sorted(groups[setting][label], key=lambda x: x["config"]["seed"]):
                t = alpha_trajectory(store, r)
                if t is None:
                    continue
                if not md:
                    md = ["## Adaptive alpha and the private share (FedPrism, Algorithm 2 lines 27-31)", "",
                          "alpha_i: weight of the global model in W_i; gamma_i = 1 - alpha_i - beta: weight of "
                          "the private model P_i. Over the clients updated so far (latest value each): mean "
                          "[min, max] of alpha, mean gamma, and how many clients have been updated.", "",
                          "| method | setting | seed | round | alpha mean [min, max] | gamma mean (max) | clients |",
                          "|---|---|---|---|---|---|---|"]
                n = len(t["round"])
                for i in sorted({0, n // 10, n // 4, n // 2, (3 * n) // 4, n - 1}):
                    md.append(f"| {md_cell(label)} | {setting} | {r['config']['seed']} | "
                              f"{int(t['round'][i])} | "
                              f"{t['mean'][i]:.4f} [{t['min'][i]:.4f}, {t['max'][i]:.4f}] | "
                              f"{t['gamma'][i]:.4f} ({t['gamma_max'][i]:.4f}) | {int(t['seen'][i])} |")
    return md + [""] if md else md


def plot_alpha(store, run: dict, out: Path, label: str, name: str) -> list[Path]:
    """alpha_i (mean and 10-90 % band over the clients updated so far) and mean gamma_i per round."""
    t = alpha_trajectory(store, run)
    if t is None:
        return []
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.fill_between(t["round"], t["p10"], t["p90"], alpha=0.25, color="C0", label="alpha, 10-90 % of clients")
    ax.plot(t["round"], t["mean"], color="C0", label="alpha, mean")
    ax.plot(t["round"], t["gamma"], color="C3", linestyle="--", label="gamma = 1 - alpha - beta, mean")
    ax.set_xlabel("round")
    ax.set_ylabel("mixing weight")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.set_title(f"adaptive alpha: {label} (seed {run['config']['seed']})")
    ax.legend(loc="center right", frameon=False)
    fig.tight_layout()
    paths = save(fig, out / name)
    plt.close(fig)
    return paths


def sections(store, groups) -> list[str]:
    """`Algorithm.report_sections`: the alpha trajectory table, then the routing chosen on validation data."""
    return alpha_table(store, groups) + routing_choice_table(store, groups)


def figures(store, run: dict, label: str, setting: str, stem: str) -> list:
    """`Algorithm.report_figures`: the alpha trajectory of a run that recorded one, `alpha<stem>`."""
    if not store.records(run["run_id"], "alpha")[:1]:
        return []
    caption = (f"Adaptive alpha_i and private share gamma_i over the rounds: {label}, seed "
               f"{run['config']['seed']}, {setting} (run {run['run_id']}).")
    return [(f"alpha{stem}", caption, lambda path: plot_alpha(store, run, path.parent, label, path.name))]
