"""A learned routing gate for a dual-stream prediction (`eval.gate=learned`), fitted once a run has ended.

The method's `learned_gate` (`Algorithm.learned_gate`: this companion module of its package) is what the
run layer asks for: `check_config` when a configuration is resolved, `check_memory` before training and
`metrics` at the final evaluation (`fedprism.experiment.runner.Experiment.gate`).

FedPrism's `fedprism_dual` predicts with two streams per client: the backbone W_i (shared knowledge) and
the specialist L_i (trained on the client's own classes only). Its routings (`fedprism_dual.ROUTINGS`,
confidence at each T) read the specialist's own scores, and a specialist trained on one to three classes
is confidently wrong on the others, so no stored routing keeps both the specialist's local accuracy and
the backbone's global accuracy (results/README.md, "Routing chosen on validation data"). This gate learns
the decision instead, from data that is not the test split:

    features   `gate_features`: both streams' softmax and predicted classes, the client's label shares
               (from its own label counts), and scalars of both (max probabilities, the shares of the
               predicted classes, the backbone's mass on the client's seen and well-represented classes,
               logsumexps, agreement)
    target     whether the specialist is the stream that is right, on the rows where exactly one is
    rows       every client's local validation rows (total weight w) and the global validation set as
               each client's two streams score it (total weight 1); the global validation set is carved
               from the training pool before partitioning, so it holds the foreign classes a client lacks
    model      scikit-learn's histogram gradient boosting, 200 trees, seed 0 (Ke et al. 2017, "LightGBM:
               A Highly Efficient Gradient Boosting Decision Tree", NeurIPS; the per-input gate of
               mixtures of experts, Jacobs et al. 1991, "Adaptive Mixtures of Local Experts")
    routing    the specialist's prediction where the gate says it is right (probability > 0.5), else the
               backbone's

Each weight w in `GATE_WEIGHTS` is one candidate routing, `gate w=..`, stored beside the method's own
routings under the same metric names (`val_acc@gate w=3`, `global_val_acc@...`, `local_acc@...`,
`global_acc@...`), so `fedprism.algorithms.fedprism_dual.routing.choose_routing` chooses among all of them with one rule.
Validation numbers are out of fold (two folds by row parity within each client's split, each scored by
the gate fitted on the other), so the rule sees no row a gate was fitted on; test numbers come from the
gate refitted on every validation row.

What it costs and what it reveals (decisions; the method's paper has no gate):

* It runs once, at the final evaluation (and when a kept final state is re-scored: `eval.gate` is an
  evaluation-only key, so `fedprism run ... eval.gate=learned` on a finished run with a kept final state
  scores it without training). Fitting is about 15 boosted fits on the rows where the streams disagree;
  the rows take N x (local + global + validation sizes) x 63 floats (about 0.4 GB for 100 clients of
  Fashion-MNIST; `row_bytes`), and a run whose rows would take more than half the available memory is
  refused before training (`check_memory`).
* Protocol: the gate is fitted at the server on features the clients compute and upload: for each of its
  validation rows and each image of the global validation set (sent once by the server), both streams'
  probability vectors and whether each stream was right, plus its label shares. No image and no model
  leaves a client, but a probability vector with "right" reveals the label of a validation row, so this is
  an evaluation-time protocol that reveals more than `fedprism_dual` training does; it is off by default.
  A gate the clients could train together without uploading rows (a small network, `MLPGate`, fitted on
  the pooled rows as FedAvg would at best) misses the routing goal in both seeds where the boosted gate
  meets it (results/README.md, "The learned gate as an option").
"""

from __future__ import annotations

import numpy as np
import torch

from fedprism.algorithms.fedprism_dual.fast_binning import sorted_once
from fedprism.errors import ConfigError
from fedprism.textable import size_text

#: the candidate weights of the clients' validation rows against the global validation set's 1
GATE_WEIGHTS = (1, 2, 3, 5, 8)
#: the splits a gate reads: fitted on the first two (out of fold), scored on all four
SPLITS = ("val", "global_val", "local", "global")
#: metric name of each split (`<name>@gate w=..`)
METRIC = {"val": "val_acc", "global_val": "global_val_acc", "local": "local_acc", "global": "global_acc"}
#: class-share thresholds: the backbone's mass on the client's well-represented classes (share
#: n_ic / n_i >= r) is a feature of the gate, one column per r
SHARES = (0.02, 0.05, 0.1)


#: the scalar columns that `gate_features` puts before both softmaxes
SCALARS = 10 + len(SHARES)


def gate_features(e: torch.Tensor, b: torch.Tensor, share: torch.Tensor) -> torch.Tensor:
    """[n, 13 + 5 C] features of the learned gate from the specialist's and the backbone's logits and the
    client's label shares [1, C]: max probabilities, the share of each stream's predicted class, each stream's
    probability of the other's class, agreement, m(x), m_r(x), both logsumexps; both softmaxes, the shares,
    one-hots of both predicted classes."""
    pe, pb = torch.softmax(e.float(), -1), torch.softmax(b.float(), -1)
    sh = share[0].float()
    ae, ab = pe.argmax(-1), pb.argmax(-1)
    cols = [pe.amax(-1), pb.amax(-1), sh[ae], sh[ab], pb.gather(1, ae[:, None])[:, 0],
            pe.gather(1, ab[:, None])[:, 0], (ae == ab).float(), (pb * (sh > 0)).sum(-1),
            torch.logsumexp(e.float(), -1), torch.logsumexp(b.float(), -1),
            *[(pb * (sh >= r)).sum(-1) for r in SHARES]]
    hot = lambda a: torch.nn.functional.one_hot(a, e.shape[-1]).float()  # noqa: E731
    return torch.cat([torch.stack(cols, -1), pe, pb, sh.expand(len(e), -1), hot(ae), hot(ab)], -1)


class _Constant:
    """A gate that always answers `to_specialist` (1) or never (0)."""

    def __init__(self, to_specialist: int):
        self.p = float(to_specialist)

    def predict_proba(self, x):
        return np.column_stack([np.full(len(x), 1 - self.p), np.full(len(x), self.p)])


class MLPGate:
    """A small network as the gate: two hidden layers of `hidden` ReLU units on the features standardised by
    their weighted mean and deviation, weighted binary cross-entropy, Adam (lr 3e-3), `epochs` passes in
    seeded batches of 1024. It is the kind of gate the clients could train together with FedAvg without
    uploading a row (each client's loss is its rows' share of the weighted sum); fitted here on the pooled
    rows, which a FedAvg fit on label-skewed clients approaches at best."""

    def __init__(self, hidden: int = 64, epochs: int = 3, seed: int = 0):
        self.hidden, self.epochs, self.seed = hidden, epochs, seed

    def fit(self, X: np.ndarray, t: np.ndarray, w: np.ndarray) -> "MLPGate":
        g = torch.Generator().manual_seed(self.seed)
        X, t = torch.as_tensor(X, dtype=torch.float32), torch.as_tensor(t, dtype=torch.float32)
        w = torch.as_tensor(w / w.sum(), dtype=torch.float32)
        self.mu = (w[:, None] * X).sum(0)
        self.sd = (w[:, None] * (X - self.mu) ** 2).sum(0).sqrt().clamp_min(1e-6)
        h = self.hidden
        with torch.random.fork_rng(devices=[]):         # a seeded initialisation; the caller's RNG is untouched
            torch.manual_seed(self.seed)
            self.net = torch.nn.Sequential(torch.nn.Linear(X.shape[1], h), torch.nn.ReLU(),
                                           torch.nn.Linear(h, h), torch.nn.ReLU(), torch.nn.Linear(h, 1))
        opt = torch.optim.Adam(self.net.parameters(), lr=3e-3)
        Z, n = (X - self.mu) / self.sd, len(X)
        for _ in range(self.epochs):
            for j in torch.randperm(n, generator=g).split(1024):
                opt.zero_grad()
                z = self.net(Z[j])[:, 0]
                loss = (w[j] * torch.nn.functional.binary_cross_entropy_with_logits(z, t[j], reduction="none"))
                (loss.sum() * (n / len(j))).backward()
                opt.step()
        return self

    def predict_proba(self, x: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            z = (torch.as_tensor(x, dtype=torch.float32) - self.mu) / self.sd
            p = torch.sigmoid(self.net(z)[:, 0]).double().numpy()
        return np.column_stack([1 - p, p])


def learned_gates(rows: dict, weights=GATE_WEIGHTS, kind: str = "boosted", seed: int = 0,
                  prefix: str = "learned", max_iter: int = 200, extra: dict | None = None,
                  soft: bool = False, fit_on: tuple[str, str] = ("val", "global_val")) -> dict:
    """{`learned w=..`: {split: accuracy}} of the learned gate (module docstring; kind "linear":
    `learned-linear w=..`, a logistic regression on the standardised features; kind "mlp": `learned-mlp
    w=..`, `MLPGate`; `prefix` names the rows): rows[split] is one (features [n, F], specialist right [n],
    backbone right [n]) per client; accuracy is the mean over
    clients, as for every rule. Validation splits are scored out of fold, test splits by the gate fitted
    on every validation row. `extra` = {fitting split: non-negative score per row} gives that split an
    extra total weight w, spread over its rows in proportion to the scores; `max_iter`: the boosted
    gate's trees. `soft` (rows with a fourth element, the labels, and `gate_features` columns) also scores
    the same gates as mixing weights, `<name>-soft w=..`: argmax of g(x) p_L + (1 - g(x)) p_W.
    `fit_on` = (the clients' own split, the shared split) that the gates are fitted on; with the test
    splits (the study's test-fitted bound) every split is scored by the gate fitted on all of them, in
    sample."""
    from sklearn.ensemble import HistGradientBoostingClassifier
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    fit_splits = fit_on                                # (the clients' own split, the shared split)
    in_sample = set(fit_on) & {"local", "global"}       # a bound: no held-out rows to score out of fold
    cat = {s: [np.concatenate([np.asarray(r[i]) for r in rows[s]]) for i in range(4 if soft else 3)]
           for s in rows}
    fold = {s: np.concatenate([np.arange(len(r[1])) % 2 for r in rows[s]]) for s in fit_splits}
    client = {s: np.concatenate([np.full(len(r[1]), k) for k, r in enumerate(rows[s])]) for s in rows}

    def fit(lw, pick):
        X, t, w = [], [], []
        for s in fit_splits:
            if s == fit_splits[1] and lw == float("inf"):
                continue               # `own`: the clients' validation rows alone
            x, he, hb = cat[s][:3]
            m = (he != hb) & pick[s]
            X.append(x[m]), t.append(he[m].astype(np.int64))
            wt = np.full(m.sum(), (1 if lw == float("inf") or s != fit_splits[0] else lw) / max(1, len(he)))
            if extra is not None and s in extra and lw != float("inf"):
                e = np.asarray(extra[s], dtype=np.float64)
                wt = wt + (lw * e / max(e.sum(), 1e-12))[m]
            w.append(wt)
        w, t = np.concatenate(w), np.concatenate(t)
        if len(np.unique(t)) < 2:      # one stream right on every fitting row (tiny federations): constant
            return _Constant(int(t[0]) if len(t) else 0)
        if kind == "mlp":
            return MLPGate(seed=seed).fit(np.concatenate(X), t, w)
        if kind == "linear":
            return make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000)).fit(
                np.concatenate(X), t, logisticregression__sample_weight=w / w.mean())
        gate = HistGradientBoostingClassifier(max_iter=max_iter, learning_rate=0.1, random_state=seed)
        with sorted_once():            # the same bits, binned faster (`fast_binning`)
            return gate.fit(np.concatenate(X), t, sample_weight=w / w.mean())

    def per_client(s, hit):           # the mean over clients of each client's accuracy, as for every rule
        return float(np.mean([hit[client[s] == c].mean() for c in range(len(rows[s]))]))

    def score(s, to_specialist):
        _, he, hb = cat[s][:3]
        return per_client(s, np.where(to_specialist, he, hb))

    def score_soft(s, g):
        x, y = cat[s][0], cat[s][3]
        C, k = (x.shape[1] - SCALARS) // 5, SCALARS
        mix = g[:, None] * x[:, k:k + C] + (1 - g[:, None]) * x[:, k + C:k + 2 * C]
        return per_client(s, mix.argmax(1) == y)

    out = {}
    for lw in weights:
        folds = [] if in_sample else [fit(lw, {s: fold[s] == k for s in fit_splits}) for k in (0, 1)]
        full = fit(lw, {s: np.ones_like(fold[s], dtype=bool) for s in fit_splits})
        acc, mix = {}, {}
        for s in rows:
            x = cat[s][0]
            if s in fit_splits and not in_sample:   # out of fold: rows of fold k by the gate fitted on 1 - k
                p = np.where(fold[s] == 0, folds[1].predict_proba(x)[:, 1], folds[0].predict_proba(x)[:, 1])
            else:
                p = full.predict_proba(x)[:, 1]
            acc[s] = score(s, p > 0.5)
            if soft:
                mix[s] = score_soft(s, p)
        name = "own" if lw == float("inf") else f"w={lw:g}"
        tag = {"linear": "-linear", "mlp": "-mlp"}.get(kind, "")
        out[f"{prefix}{tag} {name}"] = acc
        if soft:
            out[f"{prefix}{tag}-soft {name}"] = mix
    return out


def label_share(ctx, client: int) -> torch.Tensor:
    """[1, C] the client's label shares n_ic / n_i from its own train label counts (a gate feature)."""
    hist = torch.as_tensor(np.asarray(ctx.label_hist[int(client)], dtype=np.float64))
    return (hist / hist.sum().clamp_min(1)).float()[None, :]


def stream_rows(exp, state: dict, splits=SPLITS, block: int = 10, chunk: int = 2048) -> dict:
    """{split: [(gate features [n, F], specialist right [n], backbone right [n], labels [n]) per client]}
    of a run's state (`exp`: its `Experiment`): each client's two streams rebuilt by the method's own
    `inference`, exactly as its evaluation builds them, scored in float32 on every split. A client with no
    rows in a split has no entry there (its accuracy is left out of that split's mean, as in evaluation)."""
    eng, algo = exp.engine, exp.algo
    rows: dict = {s: [] for s in splits}
    n = exp.ctx.num_clients
    with torch.inference_mode():
        for c0 in range(0, n, block):
            ids = np.arange(c0, min(c0 + block, n))
            cstate = exp.clients.view(ids) if exp.clients is not None else {}
            inf = algo.inference(eng, ids, algo.eval_payload(state, ids), cstate)   # config: both streams
            for j, c in enumerate(ids):
                share = label_share(exp.ctx, c)
                for split in splits:
                    x, y = eng.data(int(c), split)
                    if len(y) == 0:
                        continue
                    e, b = (torch.cat([eng.f(inf.streams[s][j], x[i:i + chunk])
                                       for i in range(0, len(x), chunk)]) for s in ("expert", "backbone"))
                    y = y.to(e.device)
                    rows[split].append((gate_features(e, b, share.to(e.device)).cpu().numpy(),
                                        (e.argmax(-1) == y).cpu().numpy(), (b.argmax(-1) == y).cpu().numpy(),
                                        y.cpu().numpy()))
    return rows


def gate_metrics(exp, state: dict, weights=None) -> dict:
    """The metrics of `eval.gate=learned` (module docstring): `<split metric>@gate w=..` for every weight
    (default `GATE_WEIGHTS`) and split, accuracies as means over clients, the same metric names as the
    method's stored routings."""
    acc = learned_gates(stream_rows(exp, state), GATE_WEIGHTS if weights is None else weights, prefix="gate")
    return {f"{METRIC[s]}@{name}": v for name, by_split in acc.items() for s, v in by_split.items()}


def check_config(config) -> None:
    """ConfigError when the resolved configuration leaves one stream only (a fixed specialist weight of 0
    or 1): there is nothing to route."""
    weight = config.get(f"{config['method']}.inference_weight")
    if weight in (0, 1):
        raise ConfigError("eval.gate", config["eval.gate"], f"none with {config['method']}.inference_weight="
                          f"{weight} (one stream only); leave inference_weight unset to route")


def metrics(exp, state: dict) -> dict:
    """The run layer's call at the final evaluation: `gate_metrics` with every weight of `GATE_WEIGHTS`."""
    return gate_metrics(exp, state)


def row_bytes(fed) -> int:
    """Bytes of the rows `stream_rows` builds for a federation: every client's validation and local test
    rows, and the global test and validation sets once per client, each row `gate_features`' 13 + 5 C float32
    columns plus two bool flags and an int64 label, with a byte to spare. `learned_gates` concatenates one
    more copy of them, hence `check_memory`'s bound of half the memory."""
    n = len(fed.x_test) + (len(fed.x_val) if fed.x_val is not None else 0)
    own = sum(len(i) for i in fed.test_idx) + sum(len(i) for i in (fed.val_idx or []))
    return (own + fed.num_clients * n) * ((SCALARS + 5 * fed.num_classes) * 4 + 3 + 8)


def check_memory(fed, memory: int) -> None:
    """ConfigError on `eval.gate` when its rows would take more than half of `memory` bytes: refused before
    training, not at the final evaluation."""
    need = row_bytes(fed)
    if need > memory // 2:
        raise ConfigError("eval.gate", "learned", f"none here: the gate's rows of {fed.num_clients} clients "
                          f"take {size_text(need)}, more than half the available memory ({size_text(memory)}); lower "
                          "data.global_val or clients")
