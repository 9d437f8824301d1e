"""The partition study of Clust-PSI-PFL (Jimenez-Gutierrez et al. 2025, "Clust-PSI-PFL: A Population
Stability Index Approach for Clustered Non-IID Personalized Federated Learning", arXiv:2512.20363):
figures that need the partitions only, no training.

* Fig. 3: WPSI^L (Eq. 3) and the divergences HD, JSD and EMD against the non-IID level, for the
  Dirichlet protocol (alpha) and the Similarity protocol (S). HD / JSD / EMD are the FedArtML
  definitions the paper computes (`fedartml_compat=True` of `fedprism.data.heterogeneity`).
* Fig. 5: the silhouette score of K-Means++ on the standardised PSI features against the number of
  clusters tau, for K clients in {10, 50, 100} (the clustering phase of `clust_psi_pfl`, the same
  function: `fedprism.algorithms.clust_psi_pfl.psi_clusters`).
* Fig. 6: the chosen tau (smallest tau at the largest silhouette) against K.
* Fig. 4: models predicting the non-IID level (alpha, S) from WPSI^L, HD, JSD and EMD (Fig. 3's rows), with
  each model's feature importances. The paper trains LightGBM, an SVM, an MLP and a regression tree and
  finds WPSI^L ranked highest. Decisions where the paper is silent: the targets are log10(alpha) (the
  Dirichlet grid spans three decades) and S; the features are standardised for the SVM (RBF kernel) and
  the MLP (one hidden layer of 32); LightGBM is not a dependency of fedprism, so scikit-learn's gradient
  boosting of regression trees takes its place; the trees' importances are their impurity importances,
  the SVM's and the MLP's permutation importances (R^2 drop, 10 repeats), negatives set to 0, and each
  model's importances are normalised to sum 1; the fit is also scored by cross-validated R^2 (5 folds,
  fewer when a protocol has under 10 rows, so that every test fold holds two rows at least).
  A protocol with fewer than `MIN_IMPORTANCE_ROWS` rows or one level only is left out (noted).

Each point is the mean over `seeds` partitions (error bars: std over them). The partitions are the ones
a run with the same `dataset`, `partition`, `clients` and `seed` trains on (same function, same
arguments), so the tau of a Clust-PSI-PFL run equals the tau shown here for its seed.

The protocols (partition, parameter, grid, the values of Figs. 5-6, how they are named and drawn) are
data: study.toml beside this module. This module is the method package's `study` companion, found by
`fedprism report --partition-study fmnist --out DIR` through `Algorithm.partition_study` (never by the
method's name); it writes partition_study.md, partition_study.csv and the three figures (PNG and PDF), reads no store
and writes nothing else.

The seeds (`--seed`, repeatable) are checked before anything is loaded or written: each must be a seed a
run accepts (`seed` of `fedprism.experiment.config.KEYS`: an integer >= 0, below 2**63), at least one must
be given, and none twice (a repeated seed would count one partition twice in the mean and shrink the std).
A bad one is a `ConfigError` naming the option `--seed`, not a study of empty tables whose every setting
"cannot be partitioned".
"""

from __future__ import annotations

import csv
import tomllib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedprism.hparams import Param

#: study.toml, the study's settings (shipped with the package)
SETTINGS_FILE = Path(__file__).with_name("study.toml")


@dataclass(frozen=True)
class Protocol:
    """One non-IID protocol of the paper: the partition a run of it trains on and its non-IID parameter,
    Fig. 3's grid of values, the value Figs. 5-6 plot, its name in tables and legends, Fig. 3's x axis."""

    partition: str
    param: str
    values: tuple[float, ...]
    cluster: float
    title: str
    axis: str
    log: bool


def _settings() -> tuple[tuple[Protocol, ...], tuple[int, ...], dict[str, str]]:
    with open(SETTINGS_FILE, "rb") as f:
        doc = tomllib.load(f)
    protocols = tuple(Protocol(p["partition"], p["param"], tuple(float(v) for v in p["values"]), float(p["cluster"]),
                               p["title"], p["axis"], bool(p["log"])) for p in doc["protocols"])
    titles = {**doc.get("titles", {}), **{p.partition: p.title for p in protocols}}
    return protocols, tuple(int(k) for k in doc["client_counts"]), titles


#: the protocols in the order the figures show them; Figs. 5-6's numbers of clients; partition -> title
PROTOCOLS, CLIENT_COUNTS, TITLES = _settings()
#: Fig. 3's grids: partition -> (parameter, values)
GRIDS = {p.partition: (p.param, p.values) for p in PROTOCOLS}
#: Figs. 5-6: the settings the paper plots, (partition, parameter, value)
CLUSTER_SETTINGS = tuple((p.partition, p.param, p.cluster) for p in PROTOCOLS)


def _hist(y_train: np.ndarray, y_test: np.ndarray, C: int, scheme: str, key: str, value: float, K: int,
          seed: int) -> np.ndarray | str:
    """The [K, C] label counts of the partition a run would train on, or why it cannot be drawn."""
    from fedprism.data.partition import label_histograms, make_partition
    from fedprism.errors import PartitionError

    try:
        part = make_partition(scheme, y_train, y_test, K, seed, **{key: value})
    except PartitionError as e:
        return str(e)
    return label_histograms(part.train, y_train, C)


#: settings that could not be partitioned: (protocol, param, value, clients, seed, reason)
Skipped = list[tuple[str, str, float, int, int, str]]


def _drawn(y_train, y_test, C: int, scheme: str, key: str, value: float, K: int, seed: int,
           skipped: Skipped | None) -> np.ndarray | None:
    """`_hist`, with a setting that cannot be drawn noted in `skipped` (None returned)."""
    h = _hist(y_train, y_test, C, scheme, key, value, K, seed)
    if isinstance(h, str):
        if skipped is not None:
            skipped.append((scheme, key, float(value), K, seed, h))
        return None
    return h


def divergence_rows(y_train, y_test, C: int, clients: int = 100, seeds=(0, 1, 2),
                    grids: dict[str, tuple[str, tuple[float, ...]]] | None = None,
                    skipped: Skipped | None = None) -> list[dict]:
    """Fig. 3's data: one row per (protocol, value, seed) with WPSI^L, HD, JSD and EMD; partitions that
    cannot be drawn (e.g. too few samples per client) go to `skipped`. `grids`: partition -> (parameter,
    values), default the protocols' (`GRIDS`)."""
    from fedprism.data.heterogeneity import emd, hellinger, jensen_shannon, wpsi

    rows = []
    for scheme, (key, values) in (GRIDS if grids is None else grids).items():
        for v in values:
            for seed in seeds:
                h = _drawn(y_train, y_test, C, scheme, key, v, clients, seed, skipped)
                if h is None:
                    continue
                rows.append({"protocol": scheme, "param": key, "value": float(v), "seed": int(seed),
                             "clients": clients, "wpsi": wpsi(h), "hd": hellinger(h, fedartml_compat=True),
                             "jsd": jensen_shannon(h, fedartml_compat=True), "emd": emd(h, fedartml_compat=True)})
    return rows


def silhouette_rows(y_train, y_test, C: int, clients=CLIENT_COUNTS, seeds=(0, 1, 2),
                    settings=CLUSTER_SETTINGS, skipped: Skipped | None = None) -> list[dict]:
    """Figs. 5-6's data: per (setting, K, seed) the silhouette of every tau and the chosen tau."""
    from fedprism.algorithms.clust_psi_pfl import psi_clusters

    rows = []
    for scheme, key, v in settings:
        for K in clients:
            for seed in seeds:
                h = _drawn(y_train, y_test, C, scheme, key, v, K, seed, skipped)
                if h is None:
                    continue
                cl = psi_clusters(h, seed=seed)
                rows.append({"protocol": scheme, "param": key, "value": float(v), "clients": K, "seed": int(seed),
                             "tau": cl.tau, "scores": {int(k): float(s) for k, s in cl.scores.items()},
                             "wpsi": cl.wpsi})
    return rows


#: Fig. 4's features (keys of Fig. 3's rows) and how tables name them
FEATURES = (("wpsi", "WPSI^L"), ("hd", "HD"), ("jsd", "JSD"), ("emd", "EMD"))
#: Fig. 4's models, in the order tables and plots show them
IMPORTANCE_MODELS = ("gradient boosting", "SVM", "MLP", "regression tree")
#: the fewest rows (settings x seeds) of a protocol Fig. 4 fits models on
MIN_IMPORTANCE_ROWS = 6


def _importance_model(name: str, seed: int):
    from sklearn.ensemble import GradientBoostingRegressor
    from sklearn.neural_network import MLPRegressor
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler
    from sklearn.svm import SVR
    from sklearn.tree import DecisionTreeRegressor

    return {"gradient boosting": lambda: GradientBoostingRegressor(random_state=seed),
            "SVM": lambda: make_pipeline(StandardScaler(), SVR(kernel="rbf")),
            "MLP": lambda: make_pipeline(StandardScaler(), MLPRegressor(hidden_layer_sizes=(32,), max_iter=5000,
                                                                        random_state=seed)),
            "regression tree": lambda: DecisionTreeRegressor(random_state=seed)}[name]()


def importance_rows(div: list[dict], seed: int = 0, models=IMPORTANCE_MODELS) -> tuple[list[dict], list[str]]:
    """Fig. 4's data from Fig. 3's rows (`divergence_rows`): per protocol and model, the normalised
    importance of each feature (`FEATURES`) for predicting the non-IID level, the in-sample R^2 and the
    cross-validated R^2. Returns (rows, notes on protocols left out)."""
    import warnings

    from sklearn.exceptions import ConvergenceWarning
    from sklearn.inspection import permutation_importance
    from sklearn.model_selection import KFold, cross_val_score

    rows, notes = [], []
    for proto in sorted({r["protocol"] for r in div}):
        rs = [r for r in div if r["protocol"] == proto]
        x = np.array([[r[k] for k, _ in FEATURES] for r in rs], dtype=np.float64)
        v = np.array([r["value"] for r in rs], dtype=np.float64)
        log = proto in TARGET_LOG or any(p.partition == proto and p.log for p in PROTOCOLS)
        y = np.log10(v) if log and (v > 0).all() else v
        title = TITLES.get(proto, proto)
        if len(rs) < MIN_IMPORTANCE_ROWS or len(set(v.tolist())) < 2:
            notes.append(f"{title}: {len(rs)} rows, {len(set(v.tolist()))} level(s); Fig. 4 needs at least "
                         f"{MIN_IMPORTANCE_ROWS} rows and two levels")
            continue
        folds = KFold(min(5, len(rs) // 2), shuffle=True, random_state=seed)     # >= 2 rows per test fold
        for name in models:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ConvergenceWarning)
                model = _importance_model(name, seed).fit(x, y)
                if hasattr(model, "feature_importances_"):
                    imp = np.asarray(model.feature_importances_, dtype=np.float64)
                else:
                    imp = permutation_importance(model, x, y, n_repeats=10, random_state=seed).importances_mean
                cv = cross_val_score(_importance_model(name, seed), x, y, cv=folds, scoring="r2")
            imp = np.clip(imp, 0.0, None)
            imp = imp / imp.sum() if imp.sum() > 0 else imp
            rows.append({"protocol": proto, "param": rs[0]["param"], "target": ("log10 " if y is not v else "")
                         + rs[0]["param"], "model": name, "rows": len(rs), "r2": float(model.score(x, y)),
                         "r2_cv": float(np.mean(cv)), **{k: float(i) for (k, _), i in zip(FEATURES, imp)}})
    return rows, notes


#: partitions outside the protocols whose level Fig. 4 predicts on a log scale
TARGET_LOG = frozenset({"dirichlet"})


def _label(row: dict) -> str:
    """"Dirichlet alpha=0.3": the protocol's title (`TITLES`; else the partition's name) and its setting."""
    return f"{TITLES.get(row['protocol'], row['protocol'])} {row['param']}={row['value']:g}"


def _mean_std(vals) -> tuple[float, float]:
    a = np.asarray(vals, dtype=np.float64)
    return float(a.mean()), float(a.std(ddof=1)) if len(a) > 1 else 0.0


def markdown(div: list[dict], sil: list[dict], dataset: str, skipped: Skipped = (),
             imp: list[dict] | None = None, imp_notes=()) -> str:
    seeds = sorted({r["seed"] for r in div} | {r["seed"] for r in sil})
    md = [f"# Partition study: {dataset}", "",
          "Clust-PSI-PFL (arXiv:2512.20363) Figs. 3 to 6 from the partitions alone (no training); mean ± std "
          f"over seeds {', '.join(map(str, seeds))}. HD, JSD and EMD as FedArtML computes them.", "",
          f"## WPSI^L and the divergences against the non-IID level (Fig. 3; K = {div[0]['clients'] if div else '-'})",
          "", "| protocol | value | WPSI^L | HD | JSD | EMD |", "|---|---|---|---|---|---|"]
    keys = sorted({(r["protocol"], r["param"], r["value"]) for r in div})
    for p, k, v in keys:
        rs = [r for r in div if (r["protocol"], r["param"], r["value"]) == (p, k, v)]
        md.append(f"| {_label(rs[0]).rsplit(' ', 1)[0]} | {k}={v:g} | " + " | ".join(
            "{:.4f} ± {:.4f}".format(*_mean_std([r[m] for r in rs])) for m in ("wpsi", "hd", "jsd", "emd")) + " |")
    md += ["", "## Chosen number of clusters tau against K (Figs. 5-6)", "",
           "The smallest tau at the largest silhouette of K-Means++ on the z-scored PSI features "
           "(`clust_psi_pfl`'s clustering phase); per seed, and the silhouette at the chosen tau.", "",
           "| setting | K | tau per seed | silhouette at tau (mean) | WPSI^L (mean) |", "|---|---|---|---|---|"]
    for p, k, v in sorted({(r["protocol"], r["param"], r["value"]) for r in sil}):
        for K in sorted({r["clients"] for r in sil}):
            rs = [r for r in sil if (r["protocol"], r["param"], r["value"], r["clients"]) == (p, k, v, K)]
            if rs:
                best = [r["scores"].get(r["tau"], float("nan")) for r in rs]
                md.append(f"| {_label(rs[0])} | {K} | {', '.join(str(r['tau']) for r in rs)} | "
                          f"{np.nanmean(best):.4f} | {np.mean([r['wpsi'] for r in rs]):.4f} |")
    if imp is not None:
        md += ["", "## Predicting the non-IID level from the measures (Fig. 4)", "",
               "Each model predicts the protocol's level from WPSI^L, HD, JSD and EMD (Fig. 3's rows: every "
               "setting and seed); importances are normalised to sum 1 per model (trees: impurity; SVM and "
               "MLP: permutation), the largest in bold. R^2 in sample and cross-validated (up to 5 folds).", "",
               "| protocol | target | model | " + " | ".join(n for _, n in FEATURES) + " | R^2 | R^2 (cv) |",
               "|---|---|---|" + "---|" * len(FEATURES) + "---|---|"]
        for r in imp:
            top = max(FEATURES, key=lambda f: r[f[0]])[0]
            cells = [f"**{r[k]:.3f}**" if k == top else f"{r[k]:.3f}" for k, _ in FEATURES]
            md.append(f"| {TITLES.get(r['protocol'], r['protocol'])} | {r['target']} | {r['model']} | "
                      + " | ".join(cells) + f" | {r['r2']:.3f} | {r['r2_cv']:.3f} |")
        md += [f"* {n}" for n in imp_notes] if imp_notes else []
    if skipped:
        md += ["", "## Settings that cannot be partitioned", "",
               "Left out above (the same error a run of that setting would stop with):", ""]
        seeds_of: dict[tuple[str, int, str], list[int]] = {}     # one line per setting, K and reason
        for p, k, v, K, sd, why in skipped:                      # (Figs. 3 and 5 may both skip it)
            sds = seeds_of.setdefault((_label({"protocol": p, "param": k, "value": v}), K, why), [])
            if sd not in sds:
                sds.append(sd)
        md += [f"* {label}, K = {K}, seed{'s' if len(sds) > 1 else ''} {', '.join(map(str, sds))}: {why}"
               for (label, K, why), sds in seeds_of.items()]
    return "\n".join(md) + "\n"


def plot_importances(imp: list[dict], out: Path) -> list[Path]:
    """Fig. 4: one panel per protocol, grouped bars of each model's feature importances."""
    from fedprism.plotting import pyplot as _plt, save as _save

    protos = sorted({r["protocol"] for r in imp})
    if not protos:
        return []
    plt = _plt()
    fig, axes = plt.subplots(len(protos), 1, figsize=(7, 3.2 * len(protos)), squeeze=False)
    for ax, proto in zip(axes[:, 0], protos):
        rs = [r for r in imp if r["protocol"] == proto]
        xs = np.arange(len(FEATURES))
        width = 0.8 / max(1, len(rs))
        for j, r in enumerate(rs):
            ax.bar(xs + (j - (len(rs) - 1) / 2) * width, [r[k] for k, _ in FEATURES], width, color=f"C{j}",
                   label=f"{r['model']} (R^2 cv {r['r2_cv']:.2f})")
        ax.set_xticks(xs)
        ax.set_xticklabels([n for _, n in FEATURES])
        ax.set_ylabel("importance (sum 1 per model)")
        ax.set_title(f"{TITLES.get(proto, proto)}: predicting {rs[0]['target']}")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(frameon=False, fontsize=7)
    fig.tight_layout()
    paths = _save(fig, out / "partition_importance.png")
    plt.close(fig)
    return paths


def plot(div: list[dict], sil: list[dict], out: Path) -> list[Path]:
    from fedprism.plotting import pyplot as _plt, save as _save

    plt = _plt()
    paths = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, proto in zip(axes, PROTOCOLS):
        rs = [r for r in div if r["protocol"] == proto.partition]
        if not rs:
            continue
        xs = sorted({r["value"] for r in rs})
        stat = {m: [_mean_std([r[m] for r in rs if r["value"] == x]) for x in xs] for m in ("wpsi", "hd", "jsd", "emd")}
        ax.errorbar(xs, [s[0] for s in stat["wpsi"]], [s[1] for s in stat["wpsi"]], color="k", marker="o",
                    label="WPSI^L (left axis)")
        ax.set_ylabel("WPSI^L")
        ax2 = ax.twinx()
        for m, st, c in (("hd", "--", "C0"), ("jsd", "-.", "C1"), ("emd", ":", "C2")):
            ax2.errorbar(xs, [s[0] for s in stat[m]], [s[1] for s in stat[m]], color=c, linestyle=st, marker="s",
                         markersize=3, label=m.upper() + " (right axis)")
        ax2.set_ylabel("HD / JSD / EMD")
        if proto.log:
            ax.set_xscale("log")
        ax.set_xlabel(proto.axis)
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, fontsize=7, frameon=False, loc="upper right")
        ax.grid(alpha=0.3)
    fig.suptitle(f"WPSI^L and divergences against the non-IID level, K = {div[0]['clients']} clients" if div else "")
    fig.tight_layout()
    paths += _save(fig, out / "partition_wpsi.png")
    plt.close(fig)

    settings = sorted({(r["protocol"], r["param"], r["value"]) for r in sil})
    Ks = sorted({r["clients"] for r in sil})
    fig, axes = plt.subplots(1, max(1, len(settings)), figsize=(5.5 * max(1, len(settings)), 4), squeeze=False)
    for ax, key in zip(axes[0], settings):
        for j, K in enumerate(Ks):
            rs = [r for r in sil if (r["protocol"], r["param"], r["value"], r["clients"]) == (*key, K)]
            taus = sorted(set().union(*[r["scores"] for r in rs])) if rs else []
            if not taus:
                continue
            ys = [np.nanmean([r["scores"].get(t, np.nan) for r in rs]) for t in taus]
            ax.plot(taus, ys, color=f"C{j}", label=f"K = {K}")
            mode = max(set(r["tau"] for r in rs), key=[r["tau"] for r in rs].count)
            ax.axvline(mode, color=f"C{j}", linestyle=":", linewidth=1)
        ax.set_xscale("log")
        ax.set_xlabel("number of clusters tau (log scale; dotted: the most chosen tau)")
        ax.set_ylabel("silhouette (mean over seeds)")
        ax.set_title(_label({"protocol": key[0], "param": key[1], "value": key[2]}))
        ax.grid(alpha=0.3)
        ax.legend(frameon=False, fontsize=8)
    fig.tight_layout()
    paths += _save(fig, out / "partition_silhouette.png")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for j, key in enumerate(settings):
        st = [_mean_std([r["tau"] for r in sil if (r["protocol"], r["param"], r["value"], r["clients"]) == (*key, K)])
              for K in Ks]
        ax.errorbar(Ks, [s[0] for s in st], [s[1] for s in st], marker="o", color=f"C{j}", capsize=3,
                    label=_label({"protocol": key[0], "param": key[1], "value": key[2]}))
    ax.set_xlabel("clients K")
    ax.set_ylabel("chosen tau (mean ± std over seeds)")
    ax.set_xticks(Ks)
    ax.grid(alpha=0.3)
    ax.legend(frameon=False)
    fig.tight_layout()
    paths += _save(fig, out / "partition_tau.png")
    plt.close(fig)
    return paths


#: the rule of a run's `seed` key (`fedprism.experiment.config.KEYS["seed"]`, in a layer above the methods):
#: a partition seed of the study is one a run accepts
SEED = Param(0, "partition seed", lambda v: v >= 0, "an integer >= 0")


def check_seeds(seeds) -> tuple[int, ...]:
    """`seeds` as a tuple of distinct valid run seeds, else a `ConfigError` on the option `--seed`."""
    from fedprism.errors import ConfigError

    try:
        given = tuple(seeds)
    except TypeError:
        raise ConfigError("--seed", seeds, "a list of seeds (integers >= 0)", kind="option") from None
    if not given:
        raise ConfigError("--seed", given, "at least one seed (an integer >= 0)", kind="option")
    out: list[int] = []
    for s in given:
        try:
            v = SEED.validate("seed", s)
        except ConfigError as e:
            raise ConfigError("--seed", s, e.allowed, kind="option") from None
        if v in out:
            raise ConfigError("--seed", s, "distinct seeds (this one is given twice: the mean and std "
                              "would count one partition twice)", kind="option")
        out.append(v)
    return tuple(out)


def write_partition_study(dataset: str, out: str | Path, seeds=(0, 1, 2), clients: int = 100,
                          client_counts=CLIENT_COUNTS, plots: bool = True, **kw) -> list[Path]:
    """Compute and write the study (markdown, CSV, plots) for `dataset`'s training labels. The seeds
    are checked first (`check_seeds`): a bad one raises `ConfigError` before anything is written."""
    from fedprism.data.datasets import load_dataset

    seeds = check_seeds(seeds)
    ds = load_dataset(dataset)
    y_train, y_test = ds.y_train.numpy(), ds.y_test.numpy()
    C = ds.num_classes
    skipped: Skipped = []
    div = divergence_rows(y_train, y_test, C, clients, seeds, skipped=skipped, **kw)
    sil = silhouette_rows(y_train, y_test, C, client_counts, seeds, skipped=skipped)
    imp, notes = importance_rows(div, seed=seeds[0])
    outdir = Path(out)
    outdir.mkdir(parents=True, exist_ok=True)
    paths = [outdir / "partition_study.md", outdir / "partition_study.csv"]
    paths[0].write_text(markdown(div, sil, dataset, skipped, imp, notes))
    with open(paths[1], "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(["figure", "protocol", "param", "value", "clients", "seed", "wpsi", "hd", "jsd", "emd", "tau",
                    "silhouette_at_tau"])
        for r in div:
            w.writerow(["3", r["protocol"], r["param"], r["value"], r["clients"], r["seed"], r["wpsi"], r["hd"],
                        r["jsd"], r["emd"], "", ""])
        for r in sil:
            w.writerow(["5-6", r["protocol"], r["param"], r["value"], r["clients"], r["seed"], r["wpsi"], "", "", "",
                        r["tau"], r["scores"].get(r["tau"], "")])
    if imp:          # Fig. 4: one file of its own (its columns are not Figs. 3, 5 and 6's)
        paths.append(outdir / "partition_importance.csv")
        with open(paths[-1], "w", newline="") as f:
            w = csv.writer(f, lineterminator="\n")
            w.writerow(["protocol", "target", "model", "rows", *(k for k, _ in FEATURES), "r2", "r2_cv"])
            for r in imp:
                w.writerow([r["protocol"], r["target"], r["model"], r["rows"], *(r[k] for k, _ in FEATURES),
                            r["r2"], r["r2_cv"]])
    if plots:
        pdir = outdir / "plots"
        pdir.mkdir(exist_ok=True)
        paths += plot(div, sil, pdir)
        paths += plot_importances(imp, pdir)
    return paths
