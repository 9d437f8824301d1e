"""The leaderboard: methods by settings, mean and 95 % confidence interval over seeds, rank, and a paired
test against the best method of each column (`fedprism report --leaderboard`, docs/tuning.md).

A column is a data setting (`setting_of`: dataset, partition, N, T) of one sweep; with several sweeps
(`--sweep study --sweep study/defaults`) each sweep's settings are columns of their own, headed by the
sweep. A row is a sweep label (a method). A cell holds the finished runs of that label and setting, one
per seed.

* **Mean and interval**: the mean over seeds of the run's final `metric` (default `local_acc`) and the
  Student t 95 % interval, mean +- t(0.975, n-1) s / sqrt(n) with s the sample standard deviation over
  seeds (no interval from one seed).
* **Rank**: 1 for the best mean of the column, ties share the mean of their ranks.
* **Paired test against the column's best**: a stratified paired permutation (sign-flip) test. For each
  seed s and client c that both runs scored at their final evaluation, d_sc = best_sc - other_sc (the
  per-client value of `metric` in the store's client rows: clients paired within a seed). The statistic
  is the mean over seeds of the mean over that seed's clients of d_sc, so each seed is one block of equal
  weight and no client is compared across seeds. Under the null hypothesis that the two methods are
  exchangeable for every client, each d_sc is as likely to have either sign; the p-value is two-sided,
  P(|T*| >= |T|) over the 2^m sign patterns of the m pairs (exact when m <= `EXACT_PAIRS`), else over
  `DRAWS` random patterns from a fixed seed as (1 + #{|T*| >= |T|}) / (1 + DRAWS). This is the paired
  randomization test of Fisher's "The Design of Experiments" (1935) restricted to within-block
  permutations (Good, "Permutation, Parametric, and Bootstrap Tests of Hypotheses", 2005, ch. 5). A
  cell whose p-value is below 0.05 is marked as worse than the best; no correction for the several
  comparisons of a column is applied (the p-values are printed).
* **Tuned configuration**: a run of a `fedprism tune` final stage carries a `tune_choice` record; each cell
  links to a section that lists the chosen trial, its parameters and validation value, and the budget
  (trials, how many completed or were pruned, rounds trained).

Output: leaderboard.md, leaderboard.csv (one row per cell) and leaderboard.html (one self-contained page
in the HTML report's style, with the cells' links); with `fedprism report --html --leaderboard` the same
table and tuned configurations are also a section of the report's one page, report.html (`html_section`).
"""

from __future__ import annotations

import csv
import html
import itertools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fedprism.errors import FedPrismError
from fedprism.experiment.store import Store

#: the most pairs whose 2^m sign patterns are enumerated exactly
EXACT_PAIRS = 16
#: random sign patterns beyond that
DRAWS = 20_000
#: the store's per-client columns a leaderboard can pair on (the final metric of the same name)
CLIENT_METRICS = ("local_acc", "global_acc", "local_f1")
ALPHA = 0.05


def t_quantile(p: float, df: int) -> float:
    from scipy import stats

    return float(stats.t.ppf(p, df))


def mean_ci(values: list[float], level: float = 0.95) -> tuple[float, float | None]:
    """(mean, half-width of the Student t interval at `level`); None for fewer than two values."""
    x = np.asarray(values, float)
    m = float(x.mean())
    if len(x) < 2:
        return m, None
    return m, t_quantile(0.5 + level / 2, len(x) - 1) * float(x.std(ddof=1)) / math.sqrt(len(x))


def ranks(means: list[float]) -> list[float]:
    """1 for the largest, ties sharing the mean of their ranks."""
    order = sorted(range(len(means)), key=lambda i: -means[i])
    out = [0.0] * len(means)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and means[order[j + 1]] == means[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def stratified_sign_flip(blocks: list[np.ndarray], draws: int = DRAWS, seed: int = 0,
                         exact_pairs: int = EXACT_PAIRS) -> tuple[float, float]:
    """(T, two-sided p-value) of the paired sign-flip test with blocks: `blocks[s]` holds the paired
    differences of block s (a seed's clients); T = mean over blocks of the block's mean difference."""
    blocks = [np.asarray(b, float) for b in blocks if len(b)]
    if not blocks:
        raise ValueError("no paired differences")
    w = np.concatenate([np.full(len(b), 1.0 / (len(b) * len(blocks))) for b in blocks])
    d = np.concatenate(blocks)
    t = float(w @ d)
    a = w * d
    tol = 1e-12 * max(1.0, float(np.abs(a).sum()))
    m = len(d)
    if m <= exact_pairs:
        signs = np.array(list(itertools.product((1.0, -1.0), repeat=m)))
        stats_ = signs @ a
        return t, float(np.mean(np.abs(stats_) >= abs(t) - tol))
    rng = np.random.default_rng(seed)
    hits = 0
    for start in range(0, draws, 2000):
        n = min(2000, draws - start)
        signs = rng.choice((1.0, -1.0), size=(n, m))
        hits += int(np.sum(np.abs(signs @ a) >= abs(t) - tol))
    return t, (1 + hits) / (1 + draws)


@dataclass
class Cell:
    label: str
    column: str
    runs: list[dict]                              # run_id, seed, final, choice
    mean: float = float("nan")
    half: float | None = None
    rank: float = float("nan")
    diff: float | None = None                     # T against the column's best (None for the best itself)
    p: float | None = None
    pairs: int = 0
    choice: dict | None = None
    anchor: str = ""

    @property
    def seeds(self) -> list[int]:
        return [r["seed"] for r in self.runs]


@dataclass
class Board:
    metric: str
    columns: list[str]
    rows: list[str]
    cells: dict[tuple[str, str], Cell] = field(default_factory=dict)
    best: dict[str, str] = field(default_factory=dict)


def _client_values(store: Store, run_id: str, metric: str) -> dict[int, float]:
    rows = store.client_rows(run_id)
    return {int(r["client"]): float(r[metric]) for r in rows
            if r[metric] is not None and math.isfinite(r[metric])}


def build(store: Store, sweeps: list[str], metric: str = "local_acc") -> Board:
    """The leaderboard of the finished runs of `sweeps` (at least one)."""
    from fedprism.report import setting_of

    if metric not in CLIENT_METRICS:
        raise FedPrismError(f"leaderboard metric {metric!r}: one of {', '.join(CLIENT_METRICS)} (a metric stored per "
                            "client, so that clients can be paired)")
    if not sweeps:
        raise FedPrismError("the leaderboard needs --sweep NAME (the final stage of a study, or any sweep): its "
                            "rows are the sweep's labels")
    store.require_sweeps(sweeps)
    choices = {run_id: data for run_id, data in store.annotations("tune_choice")}
    cells: dict[tuple[str, str], Cell] = {}
    columns: list[str] = []
    rows: list[str] = []
    for sweep in sweeps:
        for r in store.runs(sweep=sweep):
            if r["status"] != "finished":
                continue
            cfg = json.loads(r["config"])
            col = setting_of(cfg) + (f" [{sweep}]" if len(sweeps) > 1 else "")
            label = r["label"] or cfg["method"]
            final = json.loads(r["final"] or "{}")
            if metric not in final:
                continue
            choice = choices.get(r["run_id"])
            if choice is not None and (choice.get("label") != label):
                choice = None
            cell = cells.setdefault((label, col), Cell(label, col, []))
            if any(x["seed"] == cfg["seed"] for x in cell.runs):
                raise FedPrismError(f"sweep {sweep}: two finished runs of '{label}' with seed {cfg['seed']} in "
                                    f"{col} ({cell.runs[0]['run_id']}, {r['run_id']}): a leaderboard cell holds "
                                    "one run per seed")
            cell.runs.append({"run_id": r["run_id"], "seed": cfg["seed"], "final": final, "choice": choice})
            if col not in columns:
                columns.append(col)
            if label not in rows:
                rows.append(label)
    board = Board(metric, columns, rows, cells)
    for col in columns:
        members = [c for (lab, cc), c in cells.items() if cc == col]
        for c in members:
            c.runs.sort(key=lambda x: x["seed"])
            c.mean, c.half = mean_ci([x["final"][metric] for x in c.runs])
            c.choice = next((x["choice"] for x in c.runs if x["choice"]), None)
        for c, rk in zip(members, ranks([c.mean for c in members])):
            c.rank = rk
        best = max(members, key=lambda c: (c.mean, -rows.index(c.label)))
        board.best[col] = best.label
        per_seed = {x["seed"]: _client_values(store, x["run_id"], metric) for x in best.runs}
        for c in members:
            if c is best:
                continue
            blocks = []
            for x in c.runs:
                if x["seed"] not in per_seed:
                    continue
                mine = _client_values(store, x["run_id"], metric)
                ref = per_seed[x["seed"]]
                common = sorted(set(mine) & set(ref))
                blocks.append(np.array([ref[k] - mine[k] for k in common]))
            blocks = [b for b in blocks if len(b)]
            if blocks:
                c.pairs = sum(len(b) for b in blocks)
                c.diff, c.p = stratified_sign_flip(blocks)
    for i, ((lab, col), c) in enumerate(sorted(cells.items())):
        c.anchor = "tuned-" + re.sub(r"[^a-z0-9]+", "-", f"{lab}-{col}".lower()).strip("-")
    return board


def _pct(v: float) -> str:
    return f"{100 * v:.2f}"


def cell_text(c: Cell, best: bool) -> str:
    s = _pct(c.mean) + (f" ± {_pct(c.half)}" if c.half is not None else "")
    s = f"**{s}**" if best else s
    s += f" ({c.rank:g})"
    if c.p is not None:
        s += f" p={c.p:.3g}" + (" ▼" if c.p < ALPHA else "")
    return s


def markdown(board: Board, title: str) -> str:
    out = [f"# {title}", "",
           f"{board.metric} in %: mean ± 95 % confidence half-width over seeds (Student t), (rank) in the column, "
           "and p, the two-sided p-value of the stratified paired sign-flip test against the column's best (bold): "
           "clients paired within a seed, seeds as blocks of equal weight. ▼: worse than the best at the 0.05 "
           "level (no correction for the column's several comparisons). A cell links to its tuned configuration "
           "and budget where a `fedprism tune` study chose it.", ""]
    out.append("| method | " + " | ".join(board.columns) + " |")
    out.append("|---" * (len(board.columns) + 1) + "|")
    for row in board.rows:
        cells = []
        for col in board.columns:
            c = board.cells.get((row, col))
            if c is None:
                cells.append("-")
                continue
            text = cell_text(c, board.best[col] == row)
            cells.append(f"[{text}](#{c.anchor})" if c.choice else text)
        out.append(f"| {row.replace('|', chr(92) + '|')} | " + " | ".join(cells) + " |")
    out.append("")
    out.append("Seeds per cell: " + "; ".join(
        f"{r} in {col}: {', '.join(map(str, board.cells[(r, col)].seeds))}"
        for r in board.rows for col in board.columns if (r, col) in board.cells) + ".")
    tuned = [c for c in board.cells.values() if c.choice]
    if tuned:
        out += ["", "## Tuned configurations", ""]
        for c in sorted(tuned, key=lambda c: c.anchor):
            out += [f'<a id="{c.anchor}"></a>', "", f"### {c.label}, {c.column}", "",
                    *(f"- {item}" for item in choice_items(c)), ""]
    return "\n".join(out) + "\n"


def choice_items(c: Cell) -> list[str]:
    """The lines (markdown inline) that a cell's link leads to: the chosen trial (or, for a run of the study's
    untuned configuration, its values), its parameters, the budget, the space and the cell's runs."""
    ch = c.choice
    params = ", ".join(f"`{k}={_fmt(v)}`" for k, v in sorted(ch["params"].items())) or "none searched"
    budget = (f"{ch['budget']} trials ({ch['sampler']} sampler, {ch.get('pruner', 'median')} pruner): {ch['complete']} "
              f"complete, {ch['pruned']} pruned, {ch.get('rounds_trained', 0)} rounds trained; trials in sweep "
              f"`{ch['trials_sweep']}`")
    if ch.get("default"):
        head = [f"untuned configuration of study `{ch['study']}` (its [base] and the method's table, not searched): "
                f"{params}",
                f"the tuned configuration of this method (sweep `{ch['study']}`) had a budget of {budget}"]
    else:
        head = [f"chosen: trial #{ch['trial'] + 1} of study `{ch['study']}` (run `{ch['trial_run']}`), {ch['objective']} "
                f"{_pct(ch['value'])} on the validation splits", f"parameters: {params}", f"budget: {budget}"]
    return head + ["search space: " + (", ".join(f"`{k}` {v}" for k, v in sorted(ch.get("space", {}).items()))
                                       or "empty"),
                   "runs of this cell: " + ", ".join(f"`{x['run_id']}` (seed {x['seed']})" for x in c.runs)]


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def csv_rows(board: Board) -> list[list]:
    head = ["setting", "method", "seeds", "n", "mean", "ci_low", "ci_high", "rank", "best", "diff_vs_best", "pairs",
            "p_vs_best", "tuned_trial", "tuned_trial_run", "tuned_params", "tuned_value", "budget", "complete",
            "pruned", "run_ids"]
    out = [head]
    for col in board.columns:
        for row in board.rows:
            c = board.cells.get((row, col))
            if c is None:
                continue
            ch = c.choice or {}
            lo = c.mean - c.half if c.half is not None else ""
            hi = c.mean + c.half if c.half is not None else ""
            out.append([col, row, " ".join(map(str, c.seeds)), len(c.runs), c.mean, lo, hi, c.rank,
                        board.best[col], "" if c.diff is None else c.diff, c.pairs, "" if c.p is None else c.p,
                        ch["trial"] + 1 if ch.get("trial") is not None else "", ch.get("trial_run", ""),
                        json.dumps(ch["params"], sort_keys=True) if ch else "", ch.get("value", ""),
                        ch.get("budget", ""), ch.get("complete", ""), ch.get("pruned", ""),
                        " ".join(x["run_id"] for x in c.runs)])
    return out


def html_section(board: Board, md: str, title: str, level: int = 1) -> str:
    """The leaderboard as HTML: its heading (`<h{level}>`), the legend, the table (each tuned cell a link) and
    the tuned configurations the links lead to (`<h{level + 1}>`, one `<h{level + 2}>` per cell). Its own
    page (`html_page`) or a section of the HTML report (`fedprism report --html --leaderboard`)."""
    from fedprism.report.html import _inline

    e = lambda s: html.escape(str(s), quote=True)  # noqa: E731
    head = "".join(f"<th>{e(c)}</th>" for c in board.columns)
    body = []
    for row in board.rows:
        tds = []
        for col in board.columns:
            c = board.cells.get((row, col))
            if c is None:
                tds.append("<td>-</td>")
                continue
            text = e(cell_text(c, False))
            if board.best[col] == row:
                text = f"<strong>{text}</strong>"
            tds.append(f'<td><a href="#{e(c.anchor)}">{text}</a></td>' if c.choice else f"<td>{text}</td>")
        body.append(f'<tr><td class="t">{e(row)}</td>{"".join(tds)}</tr>')
    intro = md.split("\n\n")[1]
    parts = [f'<h{level} id="leaderboard">{e(title)}</h{level}>', f"<p>{_inline(intro)}</p>",
             f"<table><thead><tr><th>method</th>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"]
    tuned = [c for c in board.cells.values() if c.choice]
    if tuned:
        parts.append(f"<h{level + 1}>Tuned configurations</h{level + 1}>")
        for c in sorted(tuned, key=lambda c: c.anchor):
            items = "".join(f"<li>{_inline(item)}</li>" for item in choice_items(c))
            parts.append(f'<h{level + 2} id="{e(c.anchor)}">{e(c.label)}, {e(c.column)}</h{level + 2}><ul>{items}</ul>')
    return "\n".join(parts)


def html_page(board: Board, title: str, md: str) -> str:
    from fedprism.report.html import CSS

    e = lambda s: html.escape(str(s), quote=True)  # noqa: E731
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{e(title)}</title><style>{CSS}</style></head>\n<body>\n" + html_section(board, md, title)
            + "\n</body></html>\n")


def board_of(db: str, sweeps: list[str], metric: str = "local_acc") -> Board:
    """The leaderboard of `sweeps` in the store at `db`; an error when no finished run can be ranked."""
    with Store(db, readonly=True) as store:
        board = build(store, sweeps, metric)
    if not board.columns:
        raise FedPrismError(f"no finished run of {', '.join(sweeps)} stores {metric}: nothing to rank")
    return board


def write_board(board: Board, out: str | Path, title: str) -> tuple[list[Path], str]:
    """leaderboard.md, leaderboard.csv and leaderboard.html of `board` into the folder `out`; returns the
    paths and the markdown."""
    outdir = Path(out)
    outdir.mkdir(parents=True, exist_ok=True)
    md = markdown(board, title)
    paths = [outdir / "leaderboard.md", outdir / "leaderboard.csv", outdir / "leaderboard.html"]
    paths[0].write_text(md)
    with open(paths[1], "w", newline="") as f:
        csv.writer(f, lineterminator="\n").writerows(csv_rows(board))
    paths[2].write_text(html_page(board, title, md))
    return paths, md


def title_of(sweeps: list[str]) -> str:
    return f"Leaderboard: {', '.join(sweeps)}"


def write_leaderboard(db: str, out: str, sweeps: list[str], metric: str = "local_acc",
                      title: str | None = None) -> list[Path]:
    """leaderboard.md, leaderboard.csv and leaderboard.html of `sweeps` into the folder `out`."""
    return write_board(board_of(db, sweeps, metric), out, title or title_of(sweeps))[0]
