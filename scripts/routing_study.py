"""Routing rules for FedPrism's dual stream beyond those `fedprism_dual` stores, scored from a kept final state.

    python scripts/routing_study.py --db results/fedprism.db RUN [RUN ...] [--out FILE.md]

Every finished `fedprism_dual` run with validation splits keeps its final server and client state beside
the store (`<db>.final/`). This script rebuilds each client's two streams from it (the backbone W_i and
the specialist L_i, exactly as the run's evaluation does), computes their logits on every split (the
client's local test and validation rows, the global test and validation sets), and scores the candidate
rules below, without training and without writing anything. The choice among them is the validation rule
of `fedprism.report.routing` (among the rules whose local validation accuracy is within 0.5 points of
the specialist's, the highest global validation accuracy); test numbers are printed beside it, never
compared. m(x) = the backbone's probability mass on the client's seen classes S (from its own label
counts); per-client thresholds are calibrated on the client's own training rows.

    confidence T   the paper's Eq. 2: lambda = max softmax(z_L / T), z = lambda z_L + (1 - lambda) z_W
    ensemble b     z_W + b z_L (a fixed logit ensemble)
    seen-ens b     z_W + b m(x) z_L
    share-ens r b  z_W + b m_r(x) z_L, m_r(x) = the backbone's mass on the client's well-represented classes
                   (share n_ic / n_i >= r of its own training labels): rare-but-seen classes go with the
                   unseen ones, where the per-class bound says the backbone is the better stream
    pred-route r   the specialist when the backbone's predicted class is well represented (share >= r), else
                   the backbone: a hard gate on the predicted class, the label-free form of the per-class
                   bound
    agree-route r  the specialist when both streams predict a well-represented class, else the backbone
    factored       p_W(y) outside S; p_W(S|x) p_L(y | x, S) inside S
    veto tau       the specialist's prediction unless m(x) < tau, then the backbone's
    oracle ...     bounds, not rules (they read the labels of the split they score; never chosen): the
                   seen-class gate (the specialist exactly when x's true class is one the client has seen,
                   else the backbone) and the best stream per class (each true class of the split to the
                   stream that gets more of its inputs right): what a gate on x's class could give at best
    switch s q     the specialist when its score s (energy = logsumexp z_L, or max softmax) is at least the
                   q-quantile of s on the client's training rows, else the backbone
    learned w      a gate shared by all clients and learned from data: scikit-learn's histogram gradient
                   boosting (200 trees; their seed is `--gate-seed`, 0 by default) predicts, per input,
                   whether the specialist is the stream that is right, from `gate_features` (both streams'
                   softmax, their predicted classes, the client's label shares and the signals of the rules
                   above). Fitted on the inputs where exactly one stream is right, from each client's local
                   validation rows (total weight w) and the global validation set (total weight 1). Its
                   validation numbers are out of fold (two folds by row parity within each client's split,
                   each scored by the gate fitted on the other), so the validation rule sees no row a gate was
                   fitted on; its test numbers come from the gate refitted on all validation rows. It is
                   fitted here in one place on every client's features (probabilities and label shares, no
                   images), not by a federated protocol
    learned-linear w  the same with a convex gate (logistic regression on the standardised features),
                   the kind of gate the clients could train together with FedAvg
    learned-soft w  (`--soft-gate` only; and learned-linear-soft w) the same fitted gates used as mixing
                   weights instead of switches: argmax of g(x) p_L(x) + (1 - g(x)) p_W(x), g(x) the gate's
                   probability that the specialist is right (a mixture of experts with a learned gate,
                   Jacobs et al. 1991, "Adaptive Mixtures of Local Experts"): where the gate hedges, the
                   two streams are averaged, as the fixed ensembles do
    learned-mlp w  (`--mlp-gate` only) the same with a small network as the gate (`MLPGate` of
                   `fedprism.algorithms.fedprism_dual.gate`: two hidden layers of 64, Adam, three passes): the kind of gate
                   the clients could train together with FedAvg without uploading their rows
    learned-routed w  (`--routed-gate` only) the boosted gate between the run's routed prediction (the
                   paper's Eq. 2 at the run's `inference_temperature`, T = 5 in the validation runs) and the
                   backbone, instead of between the specialist and the backbone: the same features of
                   (routed, backbone) logits, the same fitting, folds and weights. Confidence routing keeps
                   (and on local rows beats) the specialist's accuracy, so the gate's local side starts from
                   a better stream
    learned-maha w  (`--maha-gate` only) the boosted gate with two more features: each stream's Mahalanobis
                   distance of x (as in maha-F below) over its 80th percentile on the client's training
                   rows, in logs (`maha_features`): a feature-space novelty score beside the softmax ones
    learned-local w  (`--local-gate plain` only) one boosted gate per client, fitted on its own validation
                   rows (total weight w) and the global validation set as its streams score it (total
                   weight 1): the public-set design, in which no feature leaves the client (`local_gates`);
                   `learned-local-prior w` (`--local-gate prior`) reweights those public rows by the
                   client's label shares
    learned own    (and learned-linear own) the same gates fitted on the clients' own validation rows
                   alone, without the global validation set: a gate that needs no data outside the clients
                   (their rare classes stand in for the classes they lack); the global validation set
                   then only scores it, as it scores every rule
    maha-F q       a one-class gate trained on the client's own rows (no foreign images needed): the
                   specialist when the Mahalanobis distance of x's penultimate features in stream F (L: the
                   specialist's, W: the backbone's) to the nearest of the client's class means (tied
                   covariance, shrunk by 1e-3 of its mean eigenvalue, both from the training rows) is at most
                   the (1 - q)-quantile of the training rows' distances, else the backbone (Lee et al. 2018,
                   "A Simple Unified Framework for Detecting Out-of-Distribution Samples", arXiv:1807.03888)
    bound: test-fitted w  (`--frontier` only) the boosted gate fitted on the test rows themselves (local test
                   rows total weight w, the global test set 1) and scored on them: how close to the goal any
                   gate on these features can come (a bound, never chosen; `frontier_gates`)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from fedprism.algorithms.fedprism_dual.gate import (SCALARS, SHARES, _Constant, gate_features, label_share,  # noqa: F401
                                     learned_gates)

SPLITS = ("val", "global_val", "local", "global")


def _rules() -> dict:
    ls = lambda z: torch.log_softmax(z, -1)  # noqa: E731
    sm = lambda z: torch.softmax(z, -1)  # noqa: E731

    def conf(T):
        return lambda e, b, S, th: (lambda lam: lam * e + (1 - lam) * b)(sm(e / T).amax(-1, keepdim=True))

    def factored(e, b, S, th):
        seen = S.expand_as(b)
        lw = ls(b)
        lseen = torch.logsumexp(lw.masked_fill(~seen, -torch.inf), -1, keepdim=True)
        return torch.where(seen, lseen + ls(e.masked_fill(~seen, -torch.inf)), lw)

    def veto(tau):
        return lambda e, b, S, th: torch.where((sm(b) * S).sum(-1, keepdim=True) >= tau, ls(e), ls(b))

    def switch(kind):
        score = (lambda e: torch.logsumexp(e, -1)) if kind == "energy" else (lambda e: sm(e).amax(-1))
        return lambda e, b, S, th: torch.where((score(e) >= th[kind])[:, None], ls(e), ls(b))

    rules = {"backbone": lambda e, b, S, th: b, "specialist": lambda e, b, S, th: e}
    rules.update({f"confidence T={t:g}": conf(t) for t in (1, 5, 10, 20, 50)})
    rules.update({f"ensemble b={x:g}": (lambda e, b, S, th, x=x: b + x * e) for x in (0.1, 0.2, 0.3, 0.5)})
    rules.update({f"seen-ens b={x:g}": (lambda e, b, S, th, x=x: b + x * (sm(b) * S).sum(-1, keepdim=True) * e)
                  for x in (0.3, 0.5, 1.0, 2.0)})
    def share_ens(r, x):
        return lambda e, b, S, th: b + x * (sm(b) * (th["share"] >= r)).sum(-1, keepdim=True) * e
    rules.update({f"share-ens r={r:g} b={x:g}": share_ens(r, x) for r in SHARES for x in (0.5, 1.0, 2.0)})
    well = lambda z, th, r: (th["share"][0] >= r)[z.argmax(-1)][:, None]  # noqa: E731
    rules.update({f"pred-route r={r:g}": (lambda e, b, S, th, r=r: torch.where(well(b, th, r), ls(e), ls(b)))
                  for r in SHARES})
    rules.update({f"agree-route r={r:g}": (lambda e, b, S, th, r=r:
                                           torch.where(well(b, th, r) & well(e, th, r), ls(e), ls(b)))
                  for r in SHARES})
    rules["factored"] = factored
    rules.update({f"veto tau={t:g}": veto(t) for t in (0.5, 0.2, 0.05)})
    rules.update({f"switch {k} q={q:g}": (lambda e, b, S, th, k=k, q=q: switch(k)(e, b, S, th[q]))
                  for k in ("energy", "msp") for q in (0.05, 0.2)})

    def maha(stream, q):       # th["maha"][stream] = (distance function, thresholds by q); th["dist"]: the inputs
        return lambda e, b, S, th: torch.where((th["dist"][stream] <= th["maha"][stream][1][q])[:, None],
                                               ls(e), ls(b))
    rules.update({f"maha-{st} q={q:g}": maha(st, q) for st in ("L", "W") for q in MAHA_Q})
    # bounds, not rules: they read the test label (never chosen, never a candidate for the goal)
    rules[ORACLE] = lambda e, b, S, th: torch.where(S[0, th["y"]][:, None], ls(e), ls(b))

    def per_class(e, b, S, th):
        y = th["y"]
        c = e.shape[-1]
        hit_e = torch.bincount(y, (e.argmax(-1) == y).double(), minlength=c)
        hit_b = torch.bincount(y, (b.argmax(-1) == y).double(), minlength=c)
        return torch.where((hit_e > hit_b)[y][:, None], ls(e), ls(b))
    rules[ORACLE_CLASS] = per_class
    return rules


#: the best any gate between the two streams could do that routes on "is x of a class this client has
#: seen?": the specialist exactly for the inputs whose true class is seen (it reads the label: a bound)
ORACLE = "oracle seen-class gate (bound)"
#: the best any gate could do that routes on x's true class: each class of this split to the stream that
#: classifies more of its inputs correctly (ties: the backbone); reads the labels of the split it scores
ORACLE_CLASS = "oracle best stream per class (bound)"
BOUNDS = (ORACLE, ORACLE_CLASS)


MAHA_Q = (0.01, 0.05, 0.2)


#: the learned gate's total weight of the clients' validation rows against the global validation set's 1;
#: inf: the clients' own validation rows alone (`learned own`), a gate that needs no data outside the clients
GATE_WEIGHTS = (1, 2, 3, 5, 8, float("inf"))
#: the weights of `learned-routed` (an `own` gate would fall back to the routed stream, as `learned own` does)
ROUTED_WEIGHTS = (1, 2, 3, 5, 8)
#: the weights of `learned-local`, the per-client gates
LOCAL_WEIGHTS = (1, 3, 8)





#: names of the `--frontier` rows: the gate fitted on the test rows it scores (a bound, never chosen)
FRONTIER = "bound: test-fitted"
#: the weights of the test-fitted gate (the local test rows' total weight against the global test set's 1)
FRONTIER_WEIGHTS = (1, 2, 3, 5, 8, 13)


def is_bound(rule: str) -> bool:
    """A bound reads the labels of the split it scores: never chosen, never a candidate for the goal."""
    return rule in BOUNDS or rule.startswith(FRONTIER)


def frontier_gates(rows: dict, weights=FRONTIER_WEIGHTS, seed: int = 0) -> dict:
    """{`bound: test-fitted w=..`: {split: accuracy}}: the boosted gate of `learned_gates` (same features,
    trees and fitting) fitted on the *test* rows where exactly one stream is right, the clients' local test
    rows with total weight w and the global test set with weight 1, and scored on those same rows. It reads
    the labels it is scored on, so it is a bound, not a rule: the test (Loc, Glob) pairs that a gate on these
    features could reach at best, in sample, one point per weight. If no weight reaches the goal, no gate
    on these features fitted on any data would, bar a luckier fit; the validation columns are the same
    gates scored on the validation rows, for reference."""
    return learned_gates(rows, weights, seed=seed, prefix=FRONTIER, fit_on=("local", "global"))


def goal_slack(acc: dict, rule: str) -> tuple[float, float]:
    """(Loc slack, Glob slack) of `rule` against the goal on the test splits, in points: its routed Loc
    minus the specialist's, and its routed Glob minus (the backbone's Glob - 2). Both >= 0: the goal is
    met."""
    a, bb, sp = acc[rule], acc["backbone"], acc["specialist"]
    return 100 * (a["local"] - sp["local"]), 100 * (a["global"] - bb["global"] + 0.02)


def local_gates(rows: dict, weights=LOCAL_WEIGHTS, seed: int = 0, prior: dict | None = None) -> dict:
    """{`learned-local w=..`: {split: accuracy}}: one boosted gate per client (100 trees), `learned_gates`
    on that client's rows alone: its own validation rows (total weight w) and the global validation set
    scored by its two streams (total weight 1), on the rows where exactly one stream is right. What it needs
    from outside the client is the labelled global validation set (a public set the server would send); no
    feature leaves the client. Accuracies are means over clients, as for every rule.

    With `prior` = {"y": the public set's labels, "share": [C] label shares per client}
    (`learned-local-prior w=..`), each public row also stands for the client's own distribution: it gets
    the extra weight w * share(y) / sum_j share(y_j), so that the public rows of the client's classes
    weigh as its local inputs will (importance weighting under label shift), not only its few own rows."""
    name = "learned-local" + ("-prior" if prior is not None else "")
    per_client = []
    for k in range(len(rows["val"])):
        extra = None if prior is None else \
            {"global_val": np.asarray(prior["share"][k], dtype=np.float64)[prior["y"]]}
        per_client.append(learned_gates({s: [rows[s][k]] for s in rows}, weights, seed=seed, prefix=name,
                                        max_iter=100, extra=extra))
    return {r: {s: float(np.mean([c[r][s] for c in per_client])) for s in rows} for r in per_client[0]}


def maha_features(th: dict) -> np.ndarray:
    """[n, 2] extra features of `learned-maha`: log of each stream's Mahalanobis distance (`mahalanobis`,
    penultimate features, the client's class means) over the 80th percentile of that distance on the
    client's own training rows, so that one scale holds for every client (specialist, then backbone)."""
    q = max(MAHA_Q)
    return torch.stack([torch.log(th["dist"][k].clamp_min(1e-12) / th["maha"][k][1][q].clamp_min(1e-12))
                        for k in ("L", "W")], -1).float().numpy()


def mahalanobis(feats: torch.Tensor, y: torch.Tensor):
    """Nearest-class-mean Mahalanobis distance with a tied, shrunk covariance fitted on (feats, y): returns
    the distance function and its (1 - q)-quantiles on the fitting rows, by q."""
    feats = feats.double()
    classes = torch.unique(y)
    mu = torch.stack([feats[y == c].mean(0) for c in classes])
    centred = feats - mu[torch.searchsorted(classes, y)]
    cov = centred.T @ centred / max(1, len(y) - 1)
    cov += 1e-3 * cov.diagonal().mean().clamp_min(1e-12) * torch.eye(cov.shape[0], dtype=cov.dtype)
    prec = torch.linalg.inv(cov)

    def dist(f: torch.Tensor) -> torch.Tensor:
        d = f.double()[:, None, :] - mu[None]
        return torch.einsum("nkd,de,nke->nk", d, prec, d).amin(1)

    own = dist(feats)
    return dist, {q: torch.quantile(own, 1 - q) for q in MAHA_Q}


def study(db: str, run_id: str, state: str | None = None, gate_seed: int = 0,
          routed_gate: bool = False, local_gate: str | None = None, maha_gate: bool = False,
          soft_gate: bool = False, frontier: bool = False, mlp_gate: bool = False) -> dict:
    """Score every rule for run `run_id` from its kept final state, or from the checkpoint file `state`
    (a run's `<db>.ckpt/<run>.ckpt`, for a run stopped before its end); `routed_gate` adds
    `learned-routed`, `local_gate` ("plain" or "prior") the per-client gates, `maha_gate` `learned-maha`,
    `soft_gate` the `-soft` rows of the pooled gates, `frontier` the test-fitted bound (`frontier_gates`),
    `mlp_gate` `learned-mlp`."""
    from fedprism.algorithms.fedprism_dual import route
    from fedprism.experiment import checkpoint
    from fedprism.experiment.config import resolve
    from fedprism.experiment.runner import Experiment
    from fedprism.experiment.store import Store

    store = Store(db, readonly=True)
    row = next((r for r in store.runs() if r["run_id"] == run_id), None)
    if row is None:
        raise SystemExit(f"no run {run_id} in {db}")
    conf = json.loads(row["config"])
    if conf.get("method") != "fedprism_dual":
        raise SystemExit(f"run {run_id} is {conf.get('method')}, not fedprism_dual")
    cfg = resolve({**conf, "engine": "sequential", "compile": False, "device": "cpu"})   # CPU work, any run
    if not (cfg["data.val_fraction"] > 0 and cfg["data.global_val"] > 0):
        raise SystemExit(f"run {run_id} has no validation splits (data.val_fraction, data.global_val)")
    source = "final" if state is None else "checkpoint"
    kept = store.load_final(cfg.train_id) if state is None else checkpoint.load(Path(state))
    if kept is None:
        raise SystemExit(f"no kept final state {cfg.train_id} beside {db} (it stays on the machine that ran it)")
    exp = Experiment(cfg, store)
    state = exp.restore_final(kept) if source == "final" else exp._restore(kept)
    f, eng, algo = exp.engine.f, exp.engine, exp.algo
    rules = _rules()
    hits = {r: {s: [] for s in SPLITS} for r in rules}
    gate_rows = {s: [] for s in SPLITS}
    routed_rows = {s: [] for s in SPLITS}      # the same gate between Eq. 2's routed logits and the backbone
    maha_rows = {s: [] for s in SPLITS}        # the gate's features and both streams' Mahalanobis distances
    shares, public_y = [], None                # each client's label shares; the global validation labels
    T = float(algo.hp["inference_temperature"])
    with torch.inference_mode():
        for c0 in range(0, exp.ctx.num_clients, 10):
            block = np.arange(c0, min(c0 + 10, exp.ctx.num_clients))
            inf = algo.inference(eng, block, algo.eval_payload(state, block), exp.clients.view(block))
            seen = inf.extras["seen"] > 0
            for j, c in enumerate(block):
                logits = lambda s, x: torch.cat([f(inf.streams[s][j], x[i:i + 2048])  # noqa: E731
                                                 for i in range(0, len(x), 2048)])
                feats = lambda s, x: torch.cat([f.features(inf.streams[s][j], x[i:i + 2048])  # noqa: E731
                                                for i in range(0, len(x), 2048)])
                xt, yt = eng.data(int(c), "train")
                et = logits("expert", xt)
                th = {q: {"energy": torch.quantile(torch.logsumexp(et, -1), q),
                          "msp": torch.quantile(torch.softmax(et, -1).amax(-1), q)} for q in (0.05, 0.2)}
                th["maha"] = {"L": mahalanobis(feats("expert", xt), yt), "W": mahalanobis(feats("backbone", xt), yt)}
                S = seen[j][None, :]
                th["share"] = label_share(exp.ctx, c)
                shares.append(th["share"][0].numpy())
                for split in SPLITS:
                    x, y = eng.data(int(c), split)
                    if len(y) == 0:
                        continue
                    e, b = logits("expert", x), logits("backbone", x)
                    th["y"] = y
                    if split == "global_val":
                        public_y = y.numpy()
                    th["dist"] = {"L": th["maha"]["L"][0](feats("expert", x)),
                                  "W": th["maha"]["W"][0](feats("backbone", x))}
                    for name, rule in rules.items():
                        hits[name][split].append(float((rule(e, b, S, th).argmax(-1) == y).double().mean()))
                    gate_rows[split].append((gate_features(e, b, th["share"]).numpy(),
                                             (e.argmax(-1) == y).numpy(), (b.argmax(-1) == y).numpy(),
                                             y.numpy()))
                    if maha_gate:
                        x0, *right = gate_rows[split][-1]
                        maha_rows[split].append((np.concatenate([x0, maha_features(th)], 1), *right))
                    if routed_gate:
                        z = route(e, b, None, T)
                        routed_rows[split].append((gate_features(z, b, th["share"]).numpy(),
                                                   (z.argmax(-1) == y).numpy(), (b.argmax(-1) == y).numpy()))
    mean = lambda by_split: {s: float(np.mean(v)) for s, v in by_split.items()}  # noqa: E731
    return {"run_id": run_id, "seed": cfg["seed"], "round": int(kept["round"]),
            "from": source,
            "acc": {**{r: mean(hits[r]) for r in rules if not is_bound(r)},
                    **learned_gates(gate_rows, weights=GATE_WEIGHTS, seed=gate_seed, soft=soft_gate),
                    **learned_gates(gate_rows, weights=GATE_WEIGHTS, kind="linear", soft=soft_gate),
                    **(learned_gates(gate_rows, weights=ROUTED_WEIGHTS, kind="mlp", seed=gate_seed)
                       if mlp_gate else {}),
                    **(learned_gates(routed_rows, weights=ROUTED_WEIGHTS, seed=gate_seed,
                                     prefix="learned-routed") if routed_gate else {}),
                    **(learned_gates(maha_rows, weights=ROUTED_WEIGHTS, seed=gate_seed,
                                     prefix="learned-maha") if maha_gate else {}),
                    **(local_gates(gate_rows, seed=gate_seed) if local_gate == "plain" else {}),
                    **(local_gates(gate_rows, seed=gate_seed, prior={"y": public_y, "share": shares})
                       if local_gate == "prior" else {}),
                    **{r: mean(hits[r]) for r in BOUNDS},
                    **(frontier_gates(gate_rows, seed=gate_seed) if frontier else {})}}


def render(res: dict) -> str:
    from fedprism.algorithms.fedprism_dual.routing import MARGIN

    acc = res["acc"]
    spec = acc["specialist"]["val"]
    ok = [r for r in acc if r not in ("backbone", "specialist") and not is_bound(r)
          and acc[r]["val"] >= spec - MARGIN]
    chosen = max(ok, key=lambda r: (acc[r]["global_val"], acc[r]["val"])) if ok else None
    what = "final state of round" if res.get("from", "final") == "final" else "checkpoint of round"
    lines = [f"### Run `{res['run_id']}` (seed {res['seed']}, {what} {res['round'] + 1})", "",
             "| rule | val Loc | val Glob | test Loc | test Glob |", "|---|---|---|---|---|"]
    for r, a in acc.items():
        mark = " **(chosen on validation)**" if r == chosen else ""
        lines.append(f"| {r}{mark} | {100 * a['val']:.2f} | {100 * a['global_val']:.2f} | "
                     f"{100 * a['local']:.2f} | {100 * a['global']:.2f} |")
    if chosen:
        c, bb, sp = acc[chosen], acc["backbone"], acc["specialist"]
        met = min(goal_slack(acc, chosen)) >= 0
        lines += ["", f"Goal (routed Glob within 2 points of the backbone's {100 * bb['global']:.2f}, routed Loc at "
                  f"least the specialist's {100 * sp['local']:.2f}): {'met' if met else 'not met'} by `{chosen}` "
                  f"({100 * c['global']:.2f} / {100 * c['local']:.2f})."]
    front = [r for r in acc if r.startswith(FRONTIER)]
    if front:
        best = max(front, key=lambda r: min(goal_slack(acc, r)))
        lo, gl = goal_slack(acc, best)
        lines += ["", f"Bound: the test-fitted gate's point nearest the goal is `{best}`, Loc {lo:+.2f} and "
                  f"Glob {gl:+.2f} points from the goal's two halves "
                  f"({'inside' if min(lo, gl) >= 0 else 'outside'} the goal)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--db", default="results/fedprism.db")
    ap.add_argument("--checkpoint",
                    help="score this checkpoint file instead of the kept final state (one run)")
    ap.add_argument("--out", help="write the markdown here (default: stdout)")
    ap.add_argument("--gate-seed", type=int, default=0,
                    help="seed of the boosted gate's trees (its internal early-stopping split); default 0")
    ap.add_argument("--routed-gate", action="store_true",
                    help="also fit `learned-routed`, a gate between the routed prediction and the backbone")
    ap.add_argument("--local-gate", choices=("plain", "prior"),
                    help="also fit one gate per client on its own rows and the public set: `learned-local` "
                         "(plain) or `learned-local-prior` (public rows reweighted by its label shares)")
    ap.add_argument("--soft-gate", action="store_true",
                    help="also score the pooled gates as mixing weights (`learned-soft`, "
                         "`learned-linear-soft`)")
    ap.add_argument("--maha-gate", action="store_true",
                    help="also fit `learned-maha`, the boosted gate with both streams' Mahalanobis distances")
    ap.add_argument("--frontier", action="store_true",
                    help="also fit the bound `bound: test-fitted w=..`: the gate fitted on the test rows it "
                         "scores, the best these features could reach")
    ap.add_argument("--mlp-gate", action="store_true",
                    help="also fit `learned-mlp`, the pooled gate as a small network (one FedAvg could train)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    if a.checkpoint and len(a.runs) != 1:
        ap.error("--checkpoint scores one run")
    from fedprism.errors import FedPrismError
    try:
        text = "".join(render(study(a.db, r, a.checkpoint, a.gate_seed, a.routed_gate, a.local_gate,
                                         a.maha_gate, a.soft_gate, a.frontier, a.mlp_gate)) + "\n"
                       for r in a.runs)
    except FedPrismError as e:                  # no store, not a store: one line, as the CLI says it
        raise SystemExit(f"routing_study: error: {e}") from None
    if a.out:
        Path(a.out).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
