"""How non-IID is a federation? Label-distribution metrics over a [clients, classes] histogram.

* PSI / WPSI (Clust-PSI-PFL: population stability index for clustered personalized FL, Eq. 1-3).
* Hellinger, Jensen-Shannon and Earth Mover's distances (as FedArtML defines them), each in a *correct* default
  form and, behind ``fedartml_compat=True``, exactly as FedArtML computes them (the values
  Clust-PSI-PFL's Figure 3 plots).

Inputs are label **counts** per client (``Partition.hist`` / ``Federation.label_hist``); a row of
probabilities also works wherever only the client pmf matters. Empty clients (no samples) are left out
of the federation-level distances and get ``nan`` PSI.

Choices made here (documented in the report so stored numbers say what they are):

* ``hellinger``: root-mean-square of the pairwise Hellinger distances over all client pairs (equals
  FedArtML's value, which is already a sound aggregate); ``reference="global"`` gives the mean over
  clients of the distance to the pooled pmf instead.
* ``jensen_shannon``: generalised JS divergence with uniform client weights, ``H(mean_i P_i) -
  mean_i H(P_i)`` in bits, divided by its attainable maximum ``log2(min(N, C))`` and square-rooted, so it
  is 1 exactly when clients are as separated as N clients over C classes can be. FedArtML divides by
  ``log2(N)`` (only when N > 2), which caps the value below 1 whenever N > C.
* ``emd``: total variation ``0.5 * sum_c |p_i(c) - p(c)|`` to the pooled global pmf, averaged over
  clients (the 0/1 ground metric: class labels are not ordinal). FedArtML feeds the two pmf vectors to
  ``scipy.stats.wasserstein_distance`` as *sample values*, which ignores which class holds the mass
  (two single-class clients of different classes get 0); kept only as ``fedartml_compat=True``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "HeterogeneityReport",
    "PSI_EPS",
    "emd",
    "emd_pair",
    "hellinger",
    "hellinger_pair",
    "heterogeneity_report",
    "jensen_shannon",
    "js_pair",
    "psi",
    "report",
    "tv_pair",
    "wpsi",
]

PSI_EPS = 1e-6          # the Clust-PSI-PFL authors' additive epsilon (Appendix B #4)
SMOOTHINGS = ("additive", "laplace")
_BLOCK_ELEMS = 1 << 22  # float64 elements per block of the pairwise Hellinger matrix (32 MiB)


# --------------------------------------------------------------------------------------------------
# Input handling
# --------------------------------------------------------------------------------------------------


def _hist(hist, name: str = "hist") -> np.ndarray:
    h = np.asarray(hist, dtype=np.float64)
    if h.ndim != 2 or h.shape[0] == 0 or h.shape[1] == 0:
        raise ValueError(f"{name} must be a non-empty 2-D [clients, classes] array, got shape {h.shape}")
    if not np.isfinite(h).all() or (h < 0).any():
        raise ValueError(f"{name} must hold finite, non-negative counts")
    return h


def _pmf(v, name: str) -> np.ndarray:
    p = np.asarray(v, dtype=np.float64)
    if p.ndim != 1 or p.size == 0 or not np.isfinite(p).all() or (p < 0).any() or p.sum() <= 0:
        raise ValueError(f"{name} must be a non-empty 1-D array of non-negative weights with a positive sum")
    return p / p.sum()


def _client_pmfs(hist) -> np.ndarray:
    """Row-normalised pmfs of the non-empty clients."""
    h = _hist(hist)
    n = h.sum(axis=1)
    h = h[n > 0]
    return h / h.sum(axis=1, keepdims=True)


def _entropy2(p: np.ndarray) -> np.ndarray:
    """Shannon entropy in bits along the last axis, with 0 log 0 = 0."""
    logp = np.log2(p, out=np.zeros_like(p), where=p > 0)
    return -(p * logp).sum(axis=-1)


def _pairwise_abs_sum(a: np.ndarray) -> np.ndarray:
    """Per column ``c``: ``sum over pairs i < j of |a_ic - a_jc|`` in O(N log N) (sorted-prefix identity).

    With a column sorted ascending, ``sum_{i<j} (v_j - v_i) = sum_j v_j (2j - (N - 1))``.
    """
    n = a.shape[0]
    v = np.sort(a, axis=0)
    coef = 2.0 * np.arange(n) - (n - 1)
    return coef @ v


# --------------------------------------------------------------------------------------------------
# PSI (Clust-PSI-PFL, Eq. 1-3)
# --------------------------------------------------------------------------------------------------


def psi(client_hist, global_hist=None, eps: float = PSI_EPS,
        smoothing: str = "additive") -> tuple[np.ndarray, np.ndarray]:
    """Per-client PSI (Eq. 1) and its per-class terms (Eq. 2) against the global label pmf.

    ``PSI_ic = (P(c) - P_i(c)) * ln(P(c) / P_i(c))``, ``PSI_i = sum_c PSI_ic`` (the Jeffreys divergence).
    ``global_hist`` defaults to the pooled counts ``client_hist.sum(0)``. Zero probabilities
    (Appendix B #4): ``smoothing="additive"`` adds ``eps`` to both pmfs without renormalising (the
    authors' code, eps = 1e-6); ``"laplace"`` adds ``eps`` to every count and renormalises (use
    e.g. eps = 0.5 or 1). Classes absent from the whole federation are excluded (terms 0).
    Returns ``(psi [N], terms [N, C])``; clients without samples get ``nan``.
    """
    h = _hist(client_hist, "client_hist")
    g = h.sum(axis=0) if global_hist is None else np.asarray(global_hist, dtype=np.float64)
    if g.shape != (h.shape[1],) or not np.isfinite(g).all() or (g < 0).any() or g.sum() <= 0:
        raise ValueError(f"global_hist must be {h.shape[1]} non-negative counts with a positive sum")
    if smoothing not in SMOOTHINGS:
        raise ValueError(f"smoothing = {smoothing!r} is not valid: one of {', '.join(SMOOTHINGS)}")
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps = {eps!r} is not valid: a finite number >= 0")
    if smoothing == "laplace" and eps <= 0:
        raise ValueError(f"eps = {eps!r} is not valid for laplace smoothing: a pseudo-count > 0")
    keep = g > 0
    h, g = h[:, keep], g[keep]
    n = h.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        if smoothing == "additive":
            p_i = h / n + eps
            p = g / g.sum() + eps
        else:
            k = h.shape[1]
            p_i = (h + eps) / (n + eps * k)
            p = (g + eps) / (g.sum() + eps * k)
        terms_kept = (p - p_i) * np.log(p / p_i)
    terms_kept[n[:, 0] == 0] = np.nan
    terms = np.zeros((h.shape[0], keep.size))
    terms[:, keep] = terms_kept
    return terms_kept.sum(axis=1), terms


def wpsi(hist, eps: float = PSI_EPS, smoothing: str = "additive") -> float:
    """Sample-weighted PSI over clients (Eq. 3): ``sum_i (n_i / n) PSI_i`` with ``n = sum_i n_i``."""
    h = _hist(hist)
    n = h.sum(axis=1)
    per_client, _ = psi(h, eps=eps, smoothing=smoothing)
    ok = n > 0
    return float((n[ok] * per_client[ok]).sum() / n.sum())


# --------------------------------------------------------------------------------------------------
# Pair distances
# --------------------------------------------------------------------------------------------------


def hellinger_pair(p, q) -> float:
    """Hellinger distance ``sqrt(0.5 * sum_c (sqrt p_c - sqrt q_c)^2)`` in [0, 1] (inputs normalised)."""
    p, q = _pmf(p, "p"), _pmf(q, "q")
    return float(np.sqrt(0.5 * ((np.sqrt(p) - np.sqrt(q)) ** 2).sum()))


def js_pair(p, q) -> float:
    """Jensen-Shannon distance, log base 2, in [0, 1].

    Equals ``scipy.spatial.distance.jensenshannon(p, q, base=2)``.
    """
    p, q = _pmf(p, "p"), _pmf(q, "q")
    js = _entropy2((p + q) / 2) - 0.5 * (_entropy2(p) + _entropy2(q))
    return float(np.sqrt(max(js, 0.0)))


def tv_pair(p, q) -> float:
    """Total variation ``0.5 * sum_c |p_c - q_c|`` in [0, 1]: the EMD under the 0/1 ground metric."""
    p, q = _pmf(p, "p"), _pmf(q, "q")
    return float(0.5 * np.abs(p - q).sum())


def emd_pair(p, q) -> float:
    """1-D Wasserstein distance with class indices 0..C-1 as positions and the pmfs as weights.

    Equals ``scipy.stats.wasserstein_distance(arange(C), arange(C), p, q)``: ``sum_c |F_p(c) - F_q(c)|``
    over the cumulative pmfs. Only meaningful for ordinal labels; see :func:`emd` for the federation metric.
    """
    p, q = _pmf(p, "p"), _pmf(q, "q")
    if p.shape != q.shape:
        raise ValueError(f"p and q must have the same length, got {p.size} and {q.size}")
    return float(np.abs(np.cumsum(p - q)[:-1]).sum())


# --------------------------------------------------------------------------------------------------
# Federation-level distances (Hellinger, Jensen-Shannon, EMD)
# --------------------------------------------------------------------------------------------------


def _check_reference(reference: str) -> None:
    if reference not in ("pairwise", "global"):
        raise ValueError(f"reference = {reference!r} is not valid: 'pairwise' or 'global'")


def _global_pmf(hist) -> np.ndarray:
    g = _hist(hist).sum(axis=0)
    return g / g.sum() if g.sum() > 0 else g


def hellinger(hist, fedartml_compat: bool = False, reference: str = "pairwise") -> float:
    """Hellinger distance of a federation.

    Default: ``sqrt(mean over client pairs i != j of H^2(P_i, P_j))`` (RMS of pairwise distances; 1 when
    clients have disjoint supports). ``reference="global"``: mean over clients of ``H(P_i, P)`` with the
    pooled pmf ``P``. ``fedartml_compat=True``: FedArtML's ``hellinger_distance`` (the same pairwise RMS,
    capped at 1).
    """
    _check_reference(reference)
    s = np.sqrt(_client_pmfs(hist))
    if reference == "global" and not fedartml_compat:
        sg = np.sqrt(_global_pmf(hist))
        return float(np.mean(np.sqrt(np.clip(1.0 - s @ sg, 0.0, None))))
    n = len(s)
    if n < 2:
        return 0.0
    total, step = 0.0, max(1, _BLOCK_ELEMS // n)
    for i in range(0, n, step):
        h2 = np.clip(1.0 - s[i:i + step] @ s.T, 0.0, None)   # 0.5 ||sqrt p_i - sqrt p_j||^2 (unit mass)
        rows = np.arange(i, min(i + step, n))
        h2[rows - i, rows] = 0.0
        total += float(h2.sum())
    value = float(np.sqrt(total / (n * (n - 1))))
    return min(value, 1.0) if fedartml_compat else value


def jensen_shannon(hist, fedartml_compat: bool = False) -> float:
    """Generalised Jensen-Shannon distance over clients (uniform weights, bits).

    ``JS = H(mean_i P_i) - mean_i H(P_i)``. Default: ``sqrt(JS / log2(min(N, C)))`` with C the classes
    present, which is in [0, 1] and reaches 1 when the federation is maximally separated; for two clients
    it equals :func:`js_pair`. ``fedartml_compat=True``: FedArtML's ``jensen_shannon_distance``, which
    divides by ``log2(N)`` only when N > 2 and caps ``sqrt`` at 1.
    """
    p = _client_pmfs(hist)
    n = len(p)
    js = float(_entropy2(p.mean(axis=0)) - _entropy2(p).mean())
    js = max(js, 0.0)
    if fedartml_compat:
        if n > 2:
            js /= math.log2(n)
        return min(math.sqrt(js), 1.0)
    support = int((p.sum(axis=0) > 0).sum())
    bound = math.log2(min(n, support)) if min(n, support) > 1 else 0.0
    return 0.0 if bound == 0.0 else min(math.sqrt(js / bound), 1.0)


def emd(hist, fedartml_compat: bool = False, reference: str = "global") -> float:
    """Earth Mover's distance of a federation under the 0/1 ground metric (total variation).

    Default: mean over clients of ``TV(P_i, P)`` to the pooled pmf ``P``. ``reference="pairwise"``: mean
    ``TV(P_i, P_j)`` over client pairs. ``fedartml_compat=True``: FedArtML's ``earth_movers_distance``:
    ``sqrt(mean over pairs of scipy.stats.wasserstein_distance(P_i, P_j))`` capped at 1, where the pmf
    entries are treated as sample values (a documented quirk: disjoint single-class clients give 0).
    """
    _check_reference(reference)
    p = _client_pmfs(hist)
    if fedartml_compat:
        # wasserstein_distance(u, v) of two equal-size, equally weighted samples = mean |sort(u) - sort(v)|
        n = len(p)
        if n < 2:
            return 0.0
        srt = np.sort(p, axis=1)
        mean = float(_pairwise_abs_sum(srt).mean()) / (n * (n - 1) / 2)
        return min(math.sqrt(max(mean, 0.0)), 1.0)
    if reference == "pairwise":
        n = len(p)
        return 0.0 if n < 2 else float(0.5 * _pairwise_abs_sum(p).sum()) / (n * (n - 1) / 2)
    return float(np.mean(0.5 * np.abs(p - _global_pmf(hist)).sum(axis=1)))


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------


@dataclass
class HeterogeneityReport:
    """Every label-skew metric of one federation, with the PSI smoothing used (stored with results)."""

    num_clients: int
    num_classes: int
    wpsi: float
    psi_eps: float
    psi_smoothing: str
    hellinger: float
    jensen_shannon: float
    emd: float
    hellinger_fedartml: float
    jensen_shannon_fedartml: float
    emd_fedartml: float
    psi: np.ndarray = field(repr=False)          # [N] per client (Eq. 1)
    psi_terms: np.ndarray = field(repr=False)    # [N, C] per client and class (Eq. 2)

    def as_dict(self, per_client: bool = False) -> dict:
        """Scalars (and, with ``per_client``, the PSI vector and terms as lists) for printing/storing."""
        out = {
            "num_clients": self.num_clients,
            "num_classes": self.num_classes,
            "wpsi": self.wpsi,
            "psi_mean": float(np.nanmean(self.psi)) if np.isfinite(self.psi).any() else float("nan"),
            "psi_max": float(np.nanmax(self.psi)) if np.isfinite(self.psi).any() else float("nan"),
            "psi_eps": self.psi_eps,
            "psi_smoothing": self.psi_smoothing,
            "hellinger": self.hellinger,
            "jensen_shannon": self.jensen_shannon,
            "emd": self.emd,
            "hellinger_fedartml": self.hellinger_fedartml,
            "jensen_shannon_fedartml": self.jensen_shannon_fedartml,
            "emd_fedartml": self.emd_fedartml,
        }
        if per_client:
            out["psi"] = self.psi.tolist()
            out["psi_terms"] = self.psi_terms.tolist()
        return out


def heterogeneity_report(hist, eps: float = PSI_EPS, smoothing: str = "additive") -> HeterogeneityReport:
    """Compute every metric of this module on a [clients, classes] count histogram."""
    h = _hist(hist)
    per_client, terms = psi(h, eps=eps, smoothing=smoothing)
    return HeterogeneityReport(
        num_clients=h.shape[0],
        num_classes=h.shape[1],
        wpsi=wpsi(h, eps=eps, smoothing=smoothing),
        psi_eps=float(eps),
        psi_smoothing=smoothing,
        hellinger=hellinger(h),
        jensen_shannon=jensen_shannon(h),
        emd=emd(h),
        hellinger_fedartml=hellinger(h, fedartml_compat=True),
        jensen_shannon_fedartml=jensen_shannon(h, fedartml_compat=True),
        emd_fedartml=emd(h, fedartml_compat=True),
        psi=per_client,
        psi_terms=terms,
    )


def report(hist, eps: float = PSI_EPS, smoothing: str = "additive", per_client: bool = False) -> dict:
    """All metrics as a plain dict (see :meth:`HeterogeneityReport.as_dict`)."""
    return heterogeneity_report(hist, eps=eps, smoothing=smoothing).as_dict(per_client=per_client)
