"""Server math written once: client weights, weighted means, the soft cluster step, personalisation,
class prototypes, and the composable server step (robust rule + server optimiser) of every method that
averages models.

Every method that averages uses these, so the same quantity is computed the same way (float64
accumulation, then one rounding to the parameters' dtype) everywhere.

The server step. A method that averages client models declares which state it averages
(`Algorithm.averages`, e.g. `("w",)`); the shared options `<method>.aggregation*` (the robust rule,
ROBUST_PARAMS) and `<method>.server_*` (the server optimiser, SERVER_OPT_PARAMS) then come with it
(`compose_params`, run when the class is defined), and the method averages through the `ServerStep`
composed from them (`Algorithm.server`): `server.average(x, w, sent)` is the rule, `server.update(state,
key, avg, rows)` the optimiser. This is the pattern of Flower's strategy wrappers (FedAvgM post-processes
FedAvg's average) and of fedjax's server optimiser passed to an algorithm: the method says what it
averages; how rows are averaged and what the server does with the average are options of the run, the
same for every such method.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fedprism.hparams import Param
from fedprism.protocol import Update

WEIGHTINGS = ("samples", "uniform")


def client_weights(update: Update, how: str = "samples") -> torch.Tensor:
    """[n] float64 aggregation weights: n_k (`samples`, FedAvg's n_k / N_t once normalised) or 1 (`uniform`)."""
    if how == "samples":
        return update.n_samples.to(torch.float64)
    if how == "uniform":
        return torch.ones(len(update.clients), dtype=torch.float64)
    raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {how!r}")


def weighted_sum(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum_k (w_k / sum w) x_k over rows, in float64 (not rounded). w must sum > 0."""
    w64 = w.to(torch.float64)
    s = w64.sum()
    if not s > 0:
        raise ValueError("weights sum to zero; the caller must keep the previous value")
    return (w64 / s) @ x.to(torch.float64)


def weighted_mean(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum_k w_k x_k / sum_k w_k over rows, accumulated in float64, in x's dtype. w must sum > 0."""
    return weighted_sum(x, w).to(x.dtype)


def personalize(w_g: torch.Tensor, w_c: torch.Tensor, W: torch.Tensor, alpha: float | torch.Tensor,
                beta: float | torch.Tensor | None = None) -> torch.Tensor:
    """a w_g + b W @ w_c for a block of rows of W, float64 mixing (b = 1 - a unless given).

    `alpha` and `beta` may be per-row tensors [n]: the Fed-PRISM ensemble a w_g + (1 - a) sum_c W[i,c] w_c
    and the FedPrism paper's shared part a_i G + beta sum_k w_ik C_k are the same call.
    """
    mix = W.to(torch.float64) @ w_c.to(torch.float64)
    a = alpha.to(torch.float64)[:, None] if isinstance(alpha, torch.Tensor) else alpha
    if beta is None:
        b = 1 - a
    else:
        b = beta.to(torch.float64)[:, None] if isinstance(beta, torch.Tensor) else beta
    return (a * w_g.to(torch.float64) + b * mix).to(w_g.dtype)


def soft_cluster_step(w_c: torch.Tensor, W_S: torch.Tensor, vec: torch.Tensor, lr: float = 1.0,
                      toward: bool = False, robust: dict | None = None, sent: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """Soft-weighted cluster update, only for clusters with Z_c = sum_i W[i,c] > 0 (others bit-identical).

    toward=False: w_c += lr * (W_S^T vec) / Z          (vec = updates Delta: the Fed-PRISM server)
    toward=True : w_c += lr * ((W_S^T vec) / Z - w_c)   (vec = returned models: the FedPrism paper)

    `robust` (keywords of `average`, e.g. `robust_args(hp)`): with a rule other than `mean`, the soft
    weighted mean of cluster c is `average(vec, W_S[:, c], sent, **robust)`, cluster by cluster.
    """
    if robust is not None and robust.get("dp") is not None:
        from fedprism.errors import ConfigError
        raise ConfigError("dp.clip", robust["dp"].clip, "0 for a method whose server step mixes every client into "
                          "soft cluster models (soft_cluster_step): a client's weight in each cluster is not a "
                          "per-client sensitivity bound, so DP-FedAvg cannot bound it")
    Z = W_S.to(torch.float64).sum(0)
    live = Z > 0
    if not live.any():
        return w_c
    if robust is None or robust.get("rule", "mean") == "mean":
        mean = (W_S.to(torch.float64).T[live] @ vec.to(torch.float64)) / Z[live, None]
    else:
        mean = torch.stack([average(vec, W_S[:, c], sent, **robust) for c in torch.nonzero(live).flatten().tolist()])
    out = w_c.clone()
    step = mean - w_c[live].to(torch.float64) if toward else mean
    out[live] = (w_c[live].to(torch.float64) + lr * step).to(w_c.dtype)
    return out


def class_prototypes(protos: torch.Tensor, counts: torch.Tensor, how: str = "samples"
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Global class prototypes from client prototypes (FedProto Eq. 6, ProtoHAR's server; both use it).

    protos [n, C, d] (client k's mean feature of class j), counts [n, C] (its samples of class j).
    C_bar_j = sum_k a_kj C_kj / sum_k a_kj over the clients with counts_kj > 0, a_kj = counts_kj
    (`samples`) or 1 (`uniform`); float64 accumulation, one rounding to protos' dtype.
    Returns (C_bar [C, d], present [C] bool); a class no client has is a zero row with present False.
    """
    if how not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {how!r}")
    c = counts.to(torch.float64)
    has = c > 0
    a = torch.where(has, c if how == "samples" else torch.ones_like(c), torch.zeros_like(c))   # [n, C]
    total = a.sum(0)                                                                             # [C]
    present = total > 0
    s = torch.einsum("nc,ncd->cd", a, protos.to(torch.float64))
    mean = torch.where(present[:, None], s / total.clamp(min=1e-300)[:, None], torch.zeros_like(s))
    return mean.to(protos.dtype), present


# -- robust aggregation ----------------------------------------------------------------------------
#: aggregation rules every averaging method takes (`<method>.aggregation`)
RULES = ("mean", "median", "trimmed_mean", "clipped_mean", "krum", "multi_krum", "bulyan")
#: the rules that select clients by Krum's score and so need the number f of Byzantine clients
BYZANTINE_RULES = ("krum", "multi_krum", "bulyan")


#: the robust-aggregation parameters a method merges into its `params` (`params = {..., **ROBUST_PARAMS}`):
#: `<method>.aggregation`, `<method>.aggregation.trim`, `<method>.aggregation.clip`. All `new=True` at
#: default `mean`, so stored run ids stay valid and `mean` is today's weighted mean, bit for bit.
ROBUST_PARAMS = {
    "aggregation": Param("mean", "how client rows are averaged: mean (weighted mean), median (coordinate-wise "
                         "weighted median), trimmed_mean (coordinate-wise, `aggregation.trim` of the weight "
                         "cut per side), clipped_mean (updates clipped to `aggregation.clip` x the median "
                         "update norm, then the weighted mean), krum (the row of lowest Krum score), multi_krum "
                         "(the weighted mean of the `aggregation.m` rows of lowest score) or bulyan (Krum "
                         "selection, then per coordinate the mean of the values closest to the median), with "
                         "`aggregation.f` Byzantine clients", choices=RULES, new=True),
    "aggregation.trim": Param(0.1, "trimmed_mean: fraction of the total weight cut on each side of every "
                              "coordinate", lambda v: 0 <= v < 0.5, "a number in [0, 0.5)", new=True),
    "aggregation.clip": Param(1.0, "clipped_mean: each update's norm is capped at clip x the cohort's median "
                              "update norm", lambda v: v > 0 and math.isfinite(v), "a finite number > 0",
                              new=True),
    "aggregation.f": Param(1, "krum, multi_krum, bulyan: f, the Byzantine clients tolerated; krum and multi_krum "
                           "need a round's n > 2f + 2 clients, bulyan n >= 4f + 3 (a smaller set of rows, e.g. "
                           "one cluster's, or a round thinned by dropouts or availability, uses the largest f it allows)", lambda v: v >= 0, "an integer >= 0",
                           new=True),
    "aggregation.m": Param(0, "multi_krum: the m rows of lowest Krum score that are averaged (0: n - f)",
                           lambda v: v >= 0, "an integer >= 0 (0: n - f)", new=True),
}


def robust_args(hp: dict) -> dict:
    """The rule keywords of `average` from a method's resolved parameters (mean when it has none)."""
    return {"rule": hp.get("aggregation", "mean"), "trim": hp.get("aggregation.trim", 0.1),
            "clip": hp.get("aggregation.clip", 1.0), "f": hp.get("aggregation.f", 1),
            "m": hp.get("aggregation.m", 0)}


def weighted_median(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Coordinate-wise weighted median of the rows of x [n, P], float64 [P].

    Per coordinate, the rows sorted by value with cumulative weights c_1..c_n (total W): the smallest
    value with c_k >= W/2; when c_k == W/2 exactly, the mean of it and the next value (so equal weights
    and an even n give the usual median). Rows with weight 0 take no part."""
    x64, w64 = _positive(x, w)
    vals, order = torch.sort(x64, dim=0)
    c = torch.cumsum(w64[order], dim=0)                               # [n, P]
    half = w64.sum() / 2
    tol = 1e-12 * float(half)
    k = (c < half - tol).sum(0)                                       # first index with c_k >= W/2
    lo = vals.gather(0, k[None]).squeeze(0)
    exact = (c.gather(0, k[None]).squeeze(0) - half).abs() <= tol
    hi = vals.gather(0, (k + 1).clamp(max=len(vals) - 1)[None]).squeeze(0)
    return torch.where(exact & (k + 1 < len(vals)), (lo + hi) / 2, lo)


def trimmed_mean(x: torch.Tensor, w: torch.Tensor, trim: float) -> torch.Tensor:
    """Coordinate-wise weighted trimmed mean, float64 [P]: per coordinate, the rows sorted by value each
    cover their weight's interval [c_{k-1}, c_k] of [0, W]; the part of it inside [trim W, (1 - trim) W]
    is the row's kept weight, and the result is the kept-weight mean. Equal weights with trim n an
    integer give the classic trimmed mean (the trim n smallest and largest values dropped)."""
    if not 0 <= trim < 0.5:
        raise ValueError(f"trim must be in [0, 0.5), got {trim}")
    x64, w64 = _positive(x, w)
    vals, order = torch.sort(x64, dim=0)
    ws = w64[order]
    hi_c = torch.cumsum(ws, dim=0)
    lo_c = hi_c - ws
    W = w64.sum()
    kept = (torch.minimum(hi_c, (1 - trim) * W) - torch.maximum(lo_c, trim * W)).clamp(min=0)
    return (kept * vals).sum(0) / kept.sum(0)


def clipped_mean(x: torch.Tensor, w: torch.Tensor, sent: torch.Tensor | None, clip: float) -> torch.Tensor:
    """Norm-clipped weighted mean, float64 [P]: each row's update u_k = x_k - sent_k (x_k itself when
    `sent` is None: the rows are updates) is scaled to norm <= tau = clip * median_k ||u_k|| (the median
    over the rows with weight > 0; the mean of the two middle norms for an even count), then the weighted
    mean of sent_k + u_k."""
    keep = w.to(torch.float64) > 0
    x64 = x.to(torch.float64)
    base = torch.zeros_like(x64) if sent is None else sent.to(torch.float64).expand_as(x64)
    u = x64 - base
    norms = u.norm(dim=1)
    tau = clip * torch.quantile(norms[keep], 0.5) if keep.any() else torch.zeros((), dtype=torch.float64)
    scale = torch.where(norms > tau, tau / norms.clamp(min=1e-300), torch.ones_like(norms))
    return weighted_sum(base + scale[:, None] * u, w)


def _positive(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w64 = w.to(torch.float64)
    if not w64.sum() > 0:
        raise ValueError("weights sum to zero; the caller must keep the previous value")
    keep = w64 > 0
    return x.to(torch.float64)[keep], w64[keep]


# -- Krum, Multi-Krum, Bulyan ------------------------------------------------------------------------
# Krum and Multi-Krum: Blanchard, El Mhamdi, Guerraoui, Stainer 2017, "Machine Learning with Adversaries:
# Byzantine Tolerant Gradient Descent" (NeurIPS 2017). Bulyan: El Mhamdi, Guerraoui, Rouault 2018, "The
# Hidden Vulnerability of Distributed Learning in Byzantium" (ICML 2018, arXiv:1802.07927). With n vectors
# V_1..V_n of which f may be Byzantine:
#
#   (K1)  s(i) = sum_{i -> j} ||V_i - V_j||^2        i -> j: the n - f - 2 vectors closest to V_i (j != i)
#   (K2)  Krum = V_{i*},  i* = argmin_i s(i)                                  (needs 2f + 2 < n)
#   (K3)  Multi-Krum = the mean of the m vectors of lowest score          (m = 1: Krum; m = n: the mean)
#   (B1)  Bulyan, selection: S = {}; R = all; while |S| < theta = n - 2f: p = Krum(R); R -= p; S += p
#   (B2)  Bulyan, per coordinate c: M_c = the beta = theta - 2f values of S closest to median_c(S);
#         the output's coordinate c is (1/beta) sum_{X in M_c} X_c                (needs n >= 4f + 3)
#
# Decisions where the papers are silent (they aggregate gradients of equal standing; here the rows are
# client models with sample counts as weights):
# * What is compared: the clients' updates u_k = x_k - sent_k when `sent` is given (the papers' V_i are
#   the workers' gradient estimates; an update is its analogue, and rows sent different models, e.g.
#   cluster models, are compared by what they did), the rows themselves otherwise. What is averaged: the
#   chosen rows x_k, so with one model sent to all the result is sent + the same mean of the updates.
# * Weights: every choice counts clients, one vote each, as in the papers (a client's weight n_k is what
#   it reports; a weight that bought selection would void the guarantees, which count clients). What is
#   chosen is then averaged with the clients' weights, as the `mean` rule does: Multi-Krum is the weighted
#   mean of its m rows, and with m = n it IS `mean` (the same `weighted_sum` call, bit for bit); Bulyan's
#   coordinate c is the weighted mean of its beta values (the paper's plain mean for equal weights).
#   Rows with weight 0 take no part (a client outside the cluster being averaged).
# * Ties (equal scores, equal distances to a median): the lower row first. The median of an even count of
#   values is the mean of the two middle ones.
# * Bulyan's recursion (B1) runs Krum on the remaining set R with |R| - f - 2 neighbours; at the end R is
#   smaller than Krum's own bound (|R| = 2f + 1 at the last pick), so the neighbours are at least 1.
# * Too few rows: a method's configured cohort must allow f (`check_rule_cohort`, a ConfigError before
#   the run). A set of rows smaller than that (clients that failed, one cluster's members, a soft
#   cluster's rows) uses the largest f' <= f it allows: f' = floor((n - 3) / 2) for Krum and Multi-Krum,
#   floor((n - 3) / 4) for Bulyan; Multi-Krum's m = 0 means n - f'; an m above n means n. With n <= 2 no
#   row can be told apart from the others: their weighted mean (`mean`).
# * Multi-Krum's default m = n - f keeps every row but the f that Krum's score ranks last. AggregaThor
#   (LPD-EPFL/AggregaThor, aggregators/krum.py, by S. Rouault, an author of Bulyan) averages m = n - f - 2;
#   `aggregation.m` sets either.


def _rows_taking_part(x: torch.Tensor, w: torch.Tensor, sent: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(index of the rows with weight > 0, their x and weights in float64, the vectors compared: their
    updates x - sent when `sent` is given, else x)."""
    w64 = w.to(torch.float64)
    if not w64.sum() > 0:
        raise ValueError("weights sum to zero; the caller must keep the previous value")
    idx = torch.nonzero(w64 > 0).flatten()
    x64 = x.to(torch.float64)[idx]
    v = x64 if sent is None else x64 - sent.to(torch.float64).expand_as(x)[idx]
    return idx, x64, w64[idx], v


#: elements of one block of columns `squared_distances` works on at a time (32 MiB of float64)
_DIST_BLOCK = 1 << 22


def squared_distances(v: torch.Tensor) -> torch.Tensor:
    """[n, n] float64 ||v_i - v_j||^2 from the differences themselves (no Gram-matrix cancellation), a
    block of columns at a time so that the working memory stays about `_DIST_BLOCK` elements whatever P.
    Symmetric bit for bit (v_j - v_i is -(v_i - v_j) exactly)."""
    v = v.to(torch.float64)
    n, P = v.shape
    out = torch.zeros(n, n, dtype=torch.float64)
    step = max(1, _DIST_BLOCK // max(n, 1))
    buf = torch.empty(n, min(step, P), dtype=torch.float64)
    for a in range(0, P, step):
        blk = v[:, a:a + step]
        for i in range(n - 1):                                # the pairs j > i; the rest by symmetry
            d = buf[: n - 1 - i, : blk.shape[1]]
            torch.sub(blk[i + 1:], blk[i], out=d)
            out[i, i + 1:] += d.square_().sum(1)
    return out + out.T


def krum_scores(d2: torch.Tensor, f: int) -> torch.Tensor:
    """(K1): s(i) = the sum of the n - f - 2 smallest ||V_i - V_j||^2 over j != i, float64 [n], from the
    squared distances d2 [n, n]. The neighbours are at least 1 (Bulyan's recursion, see above) and at most
    n - 1."""
    n = len(d2)
    k = min(max(n - int(f) - 2, 1), n - 1)
    if n < 2:
        return torch.zeros(n, dtype=torch.float64)
    others = d2.masked_fill(torch.eye(n, dtype=torch.bool), float("inf"))
    return torch.sort(others, dim=1, stable=True).values[:, :k].sum(1)


def krum_f(n: int, f: int) -> int:
    """The f Krum and Multi-Krum use on n rows: f itself when n > 2f + 2, else the largest f' that n allows
    (floor((n - 3) / 2); -1 when n <= 2: no f does)."""
    return min(int(f), (n - 3) // 2)


def bulyan_f(n: int, f: int) -> int:
    """The f Bulyan uses on n rows: f itself when n >= 4f + 3, else floor((n - 3) / 4) (-1 when n <= 2)."""
    return min(int(f), (n - 3) // 4)


def multi_krum_select(d2: torch.Tensor, f: int, m: int) -> torch.Tensor:
    """(K3) the rows of the m lowest Krum scores (m = 0: n - f), in ascending row order; ties: lower row
    first. m = 1 is Krum's choice (K2)."""
    n = len(d2)
    m = n - int(f) if m == 0 else min(int(m), n)
    order = torch.sort(krum_scores(d2, f), stable=True).indices
    return torch.sort(order[:m]).values


def bulyan_select(d2: torch.Tensor, f: int) -> torch.Tensor:
    """(B1) theta = n - 2f rows picked one by one by Krum on the rows still left (f fixed, the neighbours
    |R| - f - 2, at least 1), in ascending row order."""
    left = list(range(len(d2)))
    chosen = []
    for _ in range(len(d2) - 2 * int(f)):
        sub = d2[left][:, left]
        pick = left[int(torch.sort(krum_scores(sub, f), stable=True).indices[0])]
        chosen.append(pick)
        left.remove(pick)
    return torch.tensor(sorted(chosen), dtype=torch.long)


def krum(x: torch.Tensor, w: torch.Tensor, sent: torch.Tensor | None, f: int) -> torch.Tensor:
    """Krum (K2), float64 [P]: the row whose update (or the row itself without `sent`) has the lowest score
    (K1). With n <= 2 rows taking part: their weighted mean."""
    return multi_krum(x, w, sent, f, 1)


def multi_krum(x: torch.Tensor, w: torch.Tensor, sent: torch.Tensor | None, f: int, m: int) -> torch.Tensor:
    """Multi-Krum (K3), float64 [P]: the weighted mean of the m rows of lowest Krum score (m = 0: n - f),
    `weighted_sum` of the chosen rows in their order: when every row is chosen (m = n, no row of weight 0)
    that is the `mean` rule's call on the same rows, so the numbers are the mean's bit for bit."""
    idx, x64, w64, v = _rows_taking_part(x, w, sent)
    n = len(idx)
    f = krum_f(n, f)
    if f < 0:
        return weighted_sum(x, w)
    sel = multi_krum_select(squared_distances(v), f, m)
    return weighted_sum(x64[sel], w64[sel])


def bulyan(x: torch.Tensor, w: torch.Tensor, sent: torch.Tensor | None, f: int) -> torch.Tensor:
    """Bulyan (B1-B2), float64 [P]: theta = n - 2f rows by recursive Krum, then per coordinate the weighted
    mean of the beta = theta - 2f chosen values closest to their median (compared on the updates when
    `sent` is given, averaged on the rows). With n <= 2 rows taking part: their weighted mean."""
    idx, x64, w64, v = _rows_taking_part(x, w, sent)
    n = len(idx)
    f = bulyan_f(n, f)
    if f < 0:
        return weighted_sum(x, w)
    S = bulyan_select(squared_distances(v), f)
    theta = len(S)
    beta = theta - 2 * f
    vs, xs, ws = v[S], x64[S], w64[S]
    srt = torch.sort(vs, dim=0).values
    med = (srt[(theta - 1) // 2] + srt[theta // 2]) / 2                       # [P]
    near = torch.sort((vs - med).abs(), dim=0, stable=True).indices[:beta]   # [beta, P] rows of S
    wk = ws[near]
    return (wk * xs.gather(0, near)).sum(0) / wk.sum(0)


def check_rule_cohort(method: str, hp: Mapping[str, Any], cohort: int, where: str = "") -> None:
    """ConfigError when a method's rule cannot hold for a round of `cohort` clients: krum and multi_krum
    need cohort > 2f + 2, bulyan cohort >= 4f + 3, multi_krum's m at most the cohort. `method`: the
    method's name (the keys are `<method>.aggregation*`); `where`: how the cohort came about, for the
    message (e.g. "clients=10 x fraction=0.5")."""
    from fedprism.errors import ConfigError

    rule = hp.get("aggregation", "mean")
    if rule not in BYZANTINE_RULES:
        return
    f, m = int(hp.get("aggregation.f", 1)), int(hp.get("aggregation.m", 0))
    given = f" ({where} gives {cohort} client(s) a round)" if where else f" ({cohort} client(s) a round)"
    need, most = (("n >= 4f + 3", bulyan_f(cohort, f)) if rule == "bulyan" else ("n > 2f + 2", krum_f(cohort, f)))
    if most < 0:
        raise ConfigError(f"{method}.aggregation", rule, f"a rule other than {rule} here: {rule} needs a round "
                          f"of n > 2f + 2 clients, 3 at least{given}; raise fraction or clients, or use median, "
                          "trimmed_mean or clipped_mean")
    if most < f:
        n_f = 4 * f + 3 if rule == "bulyan" else 2 * f + 3
        raise ConfigError(f"{method}.aggregation.f", f, f"an integer in [0, {most}] here: {rule} needs a round's "
                          f"n clients to satisfy {need}{given}; to tolerate f = {f}, raise fraction or clients "
                          f"until a round has {n_f} clients or more (f = 0 tolerates no Byzantine client)")
    if rule == "multi_krum" and m > cohort:
        raise ConfigError(f"{method}.aggregation.m", m, f"an integer in [1, {cohort}], or 0 for n - f: the rows "
                          f"of lowest Krum score among a round's n clients{given}")


def average(x: torch.Tensor, w: torch.Tensor, sent: torch.Tensor | None = None, rule: str = "mean",
            trim: float = 0.1, clip: float = 1.0, f: int = 1, m: int = 0) -> torch.Tensor:
    """The one averaging function of every method that averages client rows: float64 [P] (not rounded).

    rule `mean` is `weighted_sum(x, w)` (the same code path, bit for bit); `median`, `trimmed_mean`
    (`trim` per side) and `clipped_mean` (`clip`; needs `sent`, the rows the clients were sent, unless
    the rows are updates already) are the robust rules. Robust statistics for federated averaging: Yin
    et al. 2018, "Byzantine-Robust Distributed Learning: Towards Optimal Statistical Rates",
    arXiv:1803.01498 (coordinate-wise median and trimmed mean); Pillutla et al. 2019, "Robust
    Aggregation for Federated Learning", arXiv:1912.13445; norm clipping as in Sun et al. 2019, "Can
    You Really Backdoor Federated Learning?", arXiv:1911.07963. `krum`, `multi_krum` (`m`) and `bulyan`
    select clients among which at most `f` are Byzantine (Blanchard et al. 2017; El Mhamdi, Guerraoui,
    Rouault 2018, arXiv:1802.07927; equations and decisions above `krum`)."""
    if rule == "mean":
        return weighted_sum(x, w)
    if rule == "median":
        return weighted_median(x, w)
    if rule == "trimmed_mean":
        return trimmed_mean(x, w, trim)
    if rule == "clipped_mean":
        return clipped_mean(x, w, sent, clip)
    if rule == "krum":
        return krum(x, w, sent, f)
    if rule == "multi_krum":
        return multi_krum(x, w, sent, f, m)
    if rule == "bulyan":
        return bulyan(x, w, sent, f)
    raise ValueError(f"aggregation must be one of {RULES}, got {rule!r}")


# -- server optimisers -----------------------------------------------------------------------------
#: server steps every model-averaging method can take after averaging (`<method>.server_opt`)
SERVER_OPTS = ("none", "avgm", "adagrad", "yogi", "adam")

#: `server_lr` and `server_tau` of each optimiser when left at `auto`. avgm: eta = 1, FedAvgM as Hsu, Qi,
#: Brown 2019 ("Measuring the Effects of Non-Identical Data Distribution for Federated Visual
#: Classification", arXiv:1909.06335) write it (w <- w - v, v <- beta v + Delta); tau is not used.
#: adagrad / yogi / adam: the values tuned for these servers on FMNIST, CIFAR-10 and four other data sets,
#: 100 clients, by Jimenez-Gutierrez et al. 2025 ("Clust-PSI-PFL: A Population Stability Index Approach
#: for Clustered Non-IID Personalized Federated Learning", arXiv:2512.20363, Table II: FedAdagrad eta
#: 0.3162 from {0.1, 0.3162} with tau 0.1; FedYogi eta 0.001 from {0.001, 0.01} with tau 0.01; FedAdam
#: eta 0.001 from {0.001, 0.01} with tau 0.001), inside the grid Reddi et al. 2021 ("Adaptive Federated
#: Optimization", arXiv:2003.00295) search. The adaptive steps move every coordinate by about eta at
#: first whatever the size of Delta, so eta = 1 (avgm's) would move each weight by ~1 per round.
SERVER_OPT_DEFAULTS: dict[str, tuple[float, float | None]] = {
    "none": (1.0, None), "avgm": (1.0, None),
    "adagrad": (0.3162, 0.1), "yogi": (0.001, 0.01), "adam": (0.001, 0.001),
}
#: the fixed defaults of `server_lr` / `server_tau` before they became `auto` (kept for run ids, see below)
_LEGACY_LR, _LEGACY_TAU = 1.0, 1e-3

_unit = lambda v: 0 <= v < 1  # noqa: E731
_pos_finite = lambda v: v > 0 and math.isfinite(v)  # noqa: E731


class AutoNumber(Param):
    """A finite number > 0, or `auto` (stored as None): the server optimiser's own default."""

    def validate(self, key, value):
        if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not _pos_finite(float(value)):
            from fedprism.errors import ConfigError
            raise ConfigError(key, value, self.allowed)
        return float(value)

    def words(self) -> tuple[str, ...]:
        """`auto` (a mistyped one is answered with a did-you-mean, `Param.words`)."""
        return ("auto",)


#: the server-optimiser parameters a method merges into its `params` (`params = {..., **SERVER_OPT_PARAMS}`)
#: and applies with `server_update`. All `new=True`: at `server_opt = none` a run's id and numbers are those
#: it had before they existed.
SERVER_OPT_PARAMS = {
    "server_opt": Param("none", "server step after averaging: none (the average is the new model), avgm "
                        "(FedAvgM, server momentum), adagrad, yogi or adam (FedOpt, Reddi et al. 2021)",
                        choices=SERVER_OPTS, new=True),
    "server_lr": AutoNumber(None, "server learning rate eta; auto: 1 for avgm, Clust-PSI-PFL's Table II for the "
                            "adaptive steps (adagrad 0.3162, yogi 0.001, adam 0.001)",
                            allowed="auto or a finite number > 0", new=True),
    "server_momentum": Param(0.9, "avgm: momentum beta of m <- beta m + Delta", _unit, "a number in [0, 1)",
                             new=True),
    "server_beta1": Param(0.9, "adagrad / yogi / adam: beta1 of m <- beta1 m + (1 - beta1) Delta (0 gives "
                          "Flower's FedAdagrad, which has no first moment)", _unit, "a number in [0, 1)", new=True),
    "server_beta2": Param(0.99, "yogi / adam: beta2 of the second-moment recursion", _unit, "a number in [0, 1)",
                          new=True),
    "server_tau": AutoNumber(None, "adagrad / yogi / adam: adaptivity tau of eta m / (sqrt(v) + tau); v starts at "
                             "tau^2; auto: Clust-PSI-PFL's Table II (adagrad 0.1, yogi 0.01, adam 0.001)",
                             allowed="auto or a finite number > 0", new=True),
}


def normalise_server_opt(hp: dict) -> dict:
    """Resolve `auto` where it changes numbers, so that run ids tell runs apart (in place; idempotent).

    Called by `Algorithm.resolve` for every method that takes SERVER_OPT_PARAMS:
    * adagrad / yogi / adam: `auto` becomes the number of SERVER_OPT_DEFAULTS, so the run id names it
      (and differs from that of a run stored when the default was eta = 1, tau = 1e-3).
    * none / avgm: `auto` stays (None) and an explicit 1.0 (`server_lr`) or 1e-3 (`server_tau`, unused
      there), the fixed defaults they replaced, become `auto`: configs written with those values keep
      their run ids."""
    how = hp.get("server_opt", "none")
    lr, tau = SERVER_OPT_DEFAULTS[how]
    if how in ("none", "avgm"):
        if hp.get("server_lr") == _LEGACY_LR:
            hp["server_lr"] = None
        if hp.get("server_tau") == _LEGACY_TAU:
            hp["server_tau"] = None
    else:
        if hp.get("server_lr") is None:
            hp["server_lr"] = lr
        if hp.get("server_tau") is None:
            hp["server_tau"] = tau
    return hp


def _lr_tau(hp: dict) -> tuple[float, float]:
    """(eta, tau) of the configured optimiser, `auto` (None) resolved by SERVER_OPT_DEFAULTS."""
    how = hp.get("server_opt", "none")
    lr, tau = SERVER_OPT_DEFAULTS.get(how, (1.0, None))
    lr = lr if hp.get("server_lr") is None else float(hp["server_lr"])
    tau = (tau if tau is not None else _LEGACY_TAU) if hp.get("server_tau") is None else float(hp["server_tau"])
    return lr, tau


def server_opt_state(hp: dict, size: int, rows: int | None = None) -> dict:
    """One model's initial optimiser state: {} for `none`, else {"opt": {"m": zeros, "v": tau^2}} in
    float64, [size] for one model or [rows, size] for one row per model (cluster models). `server_update`
    keeps one such state per averaged model of a method under `state["opt"][<state key>]`, so it is
    checkpointed and resumed with the server state."""
    if hp.get("server_opt", "none") == "none":
        return {}
    shape = (size,) if rows is None else (rows, size)
    return {"opt": {"m": torch.zeros(shape, dtype=torch.float64),
                    "v": torch.full(shape, _lr_tau(hp)[1] ** 2, dtype=torch.float64)}}


def server_step(w: torch.Tensor, avg: torch.Tensor, opt: dict | None, hp: dict, row: int | None = None
                ) -> torch.Tensor:
    """The new server model from the current one `w` [P] and the clients' average `avg` (float64 [P], the
    value of `average`), in w's dtype. `opt` is the `"opt"` entry of `server_opt_state` (mutated in place;
    `row` picks one model's row of it). With Delta = avg - w (the mean update; clients minus server):

        none     x' = avg                                             (FedAvg; the same code path as before)
        avgm     m = beta m + Delta;  x' = w + eta m                  (Hsu, Qi, Brown 2019, arXiv:1909.06335)
                 computed as avg + (eta - 1) Delta + eta beta m_old, the same value, so eta = 1 and beta = 0
                 give `avg` bit for bit
        adagrad  m = b1 m + (1 - b1) Delta;  v = v + Delta^2
        yogi     m as adagrad;  v = v - (1 - b2) Delta^2 sign(v - Delta^2)
        adam     m as adagrad;  v = b2 v + (1 - b2) Delta^2
                 x' = w + eta m / (sqrt(v) + tau), no bias correction, v starting at tau^2
                 (Reddi et al. 2021, "Adaptive Federated Optimization", arXiv:2003.00295, Algorithm 2)

    eta and tau at `auto` are SERVER_OPT_DEFAULTS. Everything element-wise (any shape) in float64, one
    rounding to w's dtype."""
    how = hp.get("server_opt", "none")
    if how == "none":
        return avg.to(w.dtype)
    if opt is None:
        raise ValueError(f"server_opt={how} needs the optimiser state (server_opt_state) in the server state")
    m = opt["m"] if row is None else opt["m"][row]
    v = opt["v"] if row is None else opt["v"][row]
    x = w.to(torch.float64)
    avg = avg.to(torch.float64)
    delta = avg - x
    lr, tau = _lr_tau(hp)
    if how == "avgm":
        beta = float(hp["server_momentum"])
        new = avg + (lr - 1.0) * delta + (lr * beta) * m
        m.copy_(beta * m + delta)
        return new.to(w.dtype)
    b1, b2 = float(hp["server_beta1"]), float(hp["server_beta2"])
    m.copy_(b1 * m + (1.0 - b1) * delta)
    d2 = delta * delta
    if how == "adagrad":
        v.copy_(v + d2)
    elif how == "yogi":
        v.copy_(v - (1.0 - b2) * d2 * torch.sign(v - d2))
    elif how == "adam":
        v.copy_(b2 * v + (1.0 - b2) * d2)
    else:
        raise ValueError(f"server_opt must be one of {SERVER_OPTS}, got {how!r}")
    return (x + lr * m / (v.sqrt() + tau)).to(w.dtype)


def _opt_slot(state: dict, key: str, target: torch.Tensor, hp: dict) -> dict:
    """The optimiser state of model `state[key]` (created on first use; rows appended to a model matrix
    later, e.g. a CFL split, get fresh rows; a model whose shape changed otherwise starts afresh)."""
    opt = state.setdefault("opt", {})
    if isinstance(opt.get("m"), torch.Tensor):        # checkpoints written with one state, of "w", under "opt"
        opt = state["opt"] = {"w": opt}
    slot = opt.get(key)
    if slot is not None and slot["m"].shape != target.shape:
        grows = (target.dim() == 2 and slot["m"].dim() == 2 and slot["m"].shape[1] == target.shape[1]
                 and slot["m"].shape[0] < target.shape[0])
        if grows:
            fresh = server_opt_state(hp, target.shape[1], target.shape[0] - slot["m"].shape[0])["opt"]
            slot = {k: torch.cat([slot[k], fresh[k]]) for k in ("m", "v")}
        else:
            slot = None
    if slot is None:
        slot = server_opt_state(hp, target.shape[-1], target.shape[0] if target.dim() == 2 else None)["opt"]
    opt[key] = slot
    return slot


def server_update(state: dict, key: str, avg: torch.Tensor, hp: dict, rows=None) -> None:
    """Write the server step of `hp["server_opt"]` (`server_step`) for the averaged model `state[key]`:
    the one place where every model-averaging method applies its server optimiser.

    `avg` is the clients' aggregate in place of the model: [P] for a vector model (`rows` None); for a
    matrix of models [R, P] (cluster models), `rows` = an int (avg [P], that row) or a sequence of row
    indices (avg [len(rows), P]); rows not named are left bit-identical, optimiser state included (a
    cluster nobody trained this round takes no step). With `server_opt = none` this is the plain
    assignment `state[key] (rows) = avg` in the model's dtype, the code path of every method before the
    optimisers existed. Otherwise each model (row) keeps its own state under `state["opt"][key]`."""
    target = state[key]
    if hp.get("server_opt", "none") == "none":
        if rows is None:
            state[key] = avg.to(target.dtype)
        else:
            target[int(rows) if isinstance(rows, numbers.Integral) else torch.as_tensor(rows, dtype=torch.long)] = \
                avg.to(target.dtype)
        return
    slot = _opt_slot(state, key, target, hp)
    if rows is None:
        state[key] = server_step(target, avg, slot, hp)
    elif isinstance(rows, numbers.Integral):
        target[int(rows)] = server_step(target[int(rows)], avg, slot, hp, row=int(rows))
    else:
        idx = torch.as_tensor(rows, dtype=torch.long)
        sub = {k: slot[k][idx].clone() for k in ("m", "v")}
        target[idx] = server_step(target[idx], avg, sub, hp)
        for k in ("m", "v"):
            slot[k][idx] = sub[k]


def _average_buffers(state: dict, key: str, avg: torch.Tensor, rows, buffers: torch.Tensor) -> None:
    """Set the buffer section (`buffers`, bool [P]) of the model `state[key]` (or its `rows`) to the plain
    average `avg`: running statistics are estimates of the data's moments, which no optimiser steps
    (docs/architecture.md, "BatchNorm and the flat vector")."""
    t, idx = state[key], torch.nonzero(buffers.to(avg.device)).flatten()
    if rows is None:
        t[..., idx] = avg[..., idx].to(t.dtype)
    elif isinstance(rows, numbers.Integral):
        t[int(rows), idx] = avg[idx].to(t.dtype)
    else:
        r = torch.as_tensor(rows, dtype=torch.long)
        t[r[:, None], idx[None, :]] = avg[:, idx].to(t.dtype)


# -- the composed server step ----------------------------------------------------------------------
#: the shared options of every method that averages models (`Algorithm.averages`): the robust rule, then
#: the server optimiser. Declared once here; `compose_params` adds them to such a method's `params`.
SERVER_STEP_PARAMS: dict[str, Param] = {**ROBUST_PARAMS, **SERVER_OPT_PARAMS}


def compose_params(cls: type) -> None:
    """Give an algorithm class the shared server-step options when it averages models (`cls.averages`
    non-empty): `cls.params` becomes the method's own parameters followed by SERVER_STEP_PARAMS, and
    `cls.own_params` holds its own ones. A class that does not average keeps its own parameters only
    (inherited server-step options are dropped). Called by `Algorithm.__init_subclass__` for every class.

    The keys, defaults, checks and the `new=True` flags are those the methods declared one by one before,
    so a configuration resolves to the same values and the same run id. A method may not declare a
    server-step key of its own (TypeError): its meaning is the shared one."""
    averages = getattr(cls, "averages", ())
    if isinstance(averages, str) or not all(isinstance(k, str) and k for k in averages):
        raise TypeError(f"{cls.__name__}.averages = {averages!r}: a tuple of the server-state keys the method "
                        "averages, e.g. ('w',)")
    own = {k: p for k, p in cls.params.items() if not (k in SERVER_STEP_PARAMS and p is SERVER_STEP_PARAMS[k])}
    if not averages:
        if len(own) < len(cls.params) and "params" not in cls.__dict__:      # inherited from an averaging base
            cls.params = own
        cls.own_params = {k: p for k, p in cls.params.items()}
        return
    clash = sorted(set(own) & set(SERVER_STEP_PARAMS))
    if clash:
        raise TypeError(f"{cls.__name__}.params declares {', '.join(clash)}: a method that averages models "
                        "(`averages`) takes the shared server-step options (aggregation.SERVER_STEP_PARAMS); "
                        "leave them out of its own params")
    cls.own_params = own
    cls.params = {**own, **SERVER_STEP_PARAMS}


@dataclass(frozen=True)
class ServerStep:
    """The server step of one method that averages models, composed from the shared options in its
    resolved parameters `hp`: the robust rule (`average`) and the server optimiser (`update`), for the
    server-state keys the method declared (`keys`, its `averages`).

        avg = server.average(x, w, sent)             # float64 [P]: `average` with <method>.aggregation*
        server.update(state, "w", avg)               # the new model: `server_update` with <method>.server_*
        server.update(state, "w", avg_c, rows=c)     # one row of a matrix of models (a cluster model)

    With the defaults (`mean`, `none`) this is the weighted mean and the plain assignment, bit for bit
    the code path of a method without the options."""

    hp: Mapping[str, Any]
    keys: tuple[str, ...] = ()
    #: DP-FedAvg (`fedprism.privacy.UpdateDP`, `dp.clip` > 0): `average` clips, sums and adds noise
    dp: Any = None
    #: bool [P] of the averaged vector, True on its buffer section (BatchNorm running statistics,
    #: `fedprism.params`): a server optimiser steps the parameters, the statistics take the plain average
    buffers: Any = None

    @property
    def rule(self) -> str:
        return self.hp.get("aggregation", "mean")

    @property
    def robust(self) -> dict:
        """The rule's keywords of `average` (and of `soft_cluster_step(..., robust=...)`); under DP-FedAvg
        also `dp`, which `soft_cluster_step` refuses (its soft weights are not a per-client bound)."""
        return robust_args(self.hp) if self.dp is None else {**robust_args(self.hp), "dp": self.dp}

    @property
    def optimizer(self) -> str:
        return self.hp.get("server_opt", "none")

    def average(self, x: torch.Tensor, w: torch.Tensor, sent: torch.Tensor | None = None) -> torch.Tensor:
        """The clients' aggregate of rows x [n, P] with weights w [n] under the run's rule, float64 [P]
        (`sent`: the rows the clients were sent, for `clipped_mean`; None when x are updates). Under
        DP-FedAvg (`dp`) the rule is `mean` and the average is `UpdateDP.aggregate`: updates clipped to
        `dp.clip`, each client counted once, Gaussian noise on their sum (docs/privacy.md)."""
        if self.dp is not None:
            return self.dp.aggregate(x, w, sent)
        return average(x, w, sent, **self.robust)

    def update(self, state: dict, key: str, avg: torch.Tensor, rows=None) -> None:
        """Write the new model `state[key]` (or its `rows`) from the aggregate `avg` with the run's server
        optimiser (`server_update`); `key` must be one the method declares in `averages`, so the
        optimiser's state is kept, checkpointed and resumed for exactly the models it averages."""
        if self.keys and key not in self.keys:
            raise ValueError(f"server step on state[{key!r}], which the method does not declare in `averages` "
                           f"{self.keys}")
        server_update(state, key, avg, self.hp, rows)
        b = self.buffers
        if b is not None and self.optimizer != "none" and avg.shape[-1] == b.numel():
            _average_buffers(state, key, avg, rows, b)
