"""Differential privacy for the statistics clients share: label counts and class prototypes.

Opt-in with `privacy.epsilon = eps > 0` (with `privacy.delta`, `privacy.clip`, `privacy.noise`). Every
client releases each statistic through the Gaussian mechanism (Dwork & Roth 2014, "The Algorithmic
Foundations of Differential Privacy", Thm. A.1) before it leaves the client; the noise multiplier z is
calibrated so that all of a client's releases in a run together are (eps, delta)-DP under add/remove-one-
sample adjacency, by the Renyi-DP accountant of Google's `dp-accounting` library (Mironov 2017, "Renyi
Differential Privacy", arXiv:1702.07476; `dp_accounting.calibrate_dp_mechanism`).

What is released, and its L2 sensitivity Delta (one sample more or fewer):

* label counts [C]: once per client per run (the simulator's `ctx.label_hist`, a Flower node's identity
  reply). Delta = 1 (one count moves by 1). Released: max(0, h + N(0, z^2)).
* class prototypes [C, d] with their counts [C] (FedProto, ProtoHAR, and any method with
  `shares_prototypes = True`): at most once per round the client is sampled. Each sample's feature vector
  is first clipped to L2 norm `clip`, so one sample moves one class sum by at most `clip` and its count by
  1: Delta = sqrt(clip^2 + 1). Released: the sums and the counts with N(0, (z Delta)^2) noise each, the
  prototype being noisy_sum / max(noisy_count, 1) and the uploaded count max(noisy_count, 0)
  (post-processing costs no privacy).

The budget is planned for the worst case, a client sampled in every round: R = 1 + rounds releases for a
prototype method, R = 1 otherwise; z is the smallest noise multiplier with eps(R releases) <= eps. The
epsilon actually spent by the most-sampled client (1 + the times it was sampled) is stored with the run
(`dp_epsilon`, with `dp_delta` and `dp_noise_multiplier`) and shown by `fedprism report`. Sampling
amplification is not claimed (the cohort draw is seeded and known to the server).

Where the noise comes from (`privacy.noise`): `seeded` (default) draws it from a named random stream of
the run seed, so a simulation is reproducible, but whoever knows the seed can subtract it; `system` draws it
from the operating system's entropy, which is what a deployment needs (the server knows the run seed).
"""

from __future__ import annotations

import functools
import math
import secrets
from dataclasses import dataclass

import torch

from fedprism.seeds import stream_seed

#: the planned releases per client of the label counts
LABEL_RELEASES = 1
NOISE_SOURCES = ("seeded", "system")


def _events(z: float, releases: int):
    from dp_accounting import dp_event

    return dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(float(z)), int(releases))


def epsilon_spent(z: float, releases: int, delta: float) -> float:
    """Epsilon of `releases` Gaussian releases with noise multiplier z (std z x sensitivity) at delta."""
    if releases <= 0:
        return 0.0
    from dp_accounting import rdp

    acc = rdp.RdpAccountant()
    acc.compose(_events(z, releases))
    return float(acc.get_epsilon(delta))


@functools.lru_cache(maxsize=64)
def calibrate(epsilon: float, delta: float, releases: int) -> float:
    """The smallest noise multiplier z (within 1e-6) whose `releases` compositions are (epsilon, delta)-DP."""
    from dp_accounting import calibrate_dp_mechanism, rdp

    z = float(calibrate_dp_mechanism(rdp.RdpAccountant, lambda v: _events(v, releases), epsilon, delta))
    while epsilon_spent(z, releases, delta) > epsilon:     # Brent's tolerance may land just below the optimum
        z *= 1 + 1e-6
    return z


@dataclass(frozen=True)
class Privacy:
    """The run's privacy plan: target (epsilon, delta), feature clip, noise source, planned releases, z."""

    epsilon: float
    delta: float
    clip: float
    noise: str
    releases: int
    z: float

    @classmethod
    def plan(cls, epsilon: float, delta: float, clip: float, noise: str, rounds: int,
             shares_prototypes: bool) -> "Privacy":
        releases = LABEL_RELEASES + (rounds if shares_prototypes else 0)
        return cls(epsilon, delta, clip, noise, releases, calibrate(epsilon, delta, releases))

    def spent(self, releases: int) -> float:
        return epsilon_spent(self.z, releases, self.delta)

    def generator(self, seed: int, rnd: int, client: int, what: str) -> torch.Generator:
        """The noise stream of one release: named stream of the run seed, or OS entropy (`system`)."""
        if self.noise == "system":
            return torch.Generator().manual_seed(secrets.randbits(63))
        return torch.Generator().manual_seed(stream_seed(seed, rnd, client, f"privacy:{what}"))

    # -- the two mechanisms ------------------------------------------------------------------------------
    def label_counts(self, hist, gen: torch.Generator) -> torch.Tensor:
        """max(0, h + N(0, z^2)) for one client's label counts (sensitivity 1), float64."""
        h = torch.as_tensor(hist, dtype=torch.float64)
        return (h + self.z * torch.randn(h.shape, generator=gen, dtype=torch.float64)).clamp(min=0)

    def prototype_sums(self, sums: torch.Tensor, counts: torch.Tensor, gen: torch.Generator
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Noisy prototypes and counts from clipped-feature class sums [C, d] and counts [C] (float64):
        sensitivity sqrt(clip^2 + 1), returns (noisy_sum / max(noisy_count, 1), max(noisy_count, 0))."""
        std = self.z * math.sqrt(self.clip ** 2 + 1.0)
        s = sums + std * torch.randn(sums.shape, generator=gen, dtype=torch.float64)
        n = counts + std * torch.randn(counts.shape, generator=gen, dtype=torch.float64)
        return s / n.clamp(min=1.0)[:, None], n.clamp(min=0.0)


def clip_rows(z: torch.Tensor, bound: float) -> torch.Tensor:
    """Each row scaled to L2 norm at most `bound`."""
    norm = z.norm(dim=-1, keepdim=True)
    return z * (bound / norm.clamp(min=bound))


# -- client-level DP for model updates (DP-FedAvg) -------------------------------------------------------
# McMahan, Ramage, Talwar, Zhang 2018, "Learning Differentially Private Recurrent Language Models" (ICLR 2018,
# arXiv:1710.06963), Algorithm 1 with flat clipping: each client's update is clipped to L2 norm C, the
# server adds N(0, (z C)^2 I) to the sum of the clipped updates and divides by the number of clients
# averaged. docs/privacy.md has the decisions; `fedprism.algorithms.aggregation.ServerStep.average` applies it
# for every method that averages models, `UpdateDP.epsilon` accounts for it.

#: accountants of `dp.accountant`: Renyi DP (Mironov 2017) or privacy loss distributions (dp-accounting's PLD)
DP_ACCOUNTANTS = ("rdp", "pld")
#: the sampling `dp.sampling` tells the accountant: poisson (each client independently with probability q =
#: m / N, the customary model) or fixed (m of N without replacement, what fedprism's uniform draw does;
#: RDP only, under replace-one adjacency)
DP_SAMPLING = ("poisson", "fixed")


def _quiet():
    """dp-accounting's RDP warns (absl) for every order it excludes near q = 1/2; that is not news."""
    import contextlib
    import logging

    @contextlib.contextmanager
    def cm():
        log = logging.getLogger("absl")
        level = log.level
        log.setLevel(logging.ERROR)
        try:
            yield
        finally:
            log.setLevel(level)
    return cm()


def dpfedavg_event(z: float, rounds: list[tuple[float, int]], sampling: str = "poisson", clients: int = 0,
                   cohort: int = 0):
    """The dp-accounting event of a DP-FedAvg run: per round (q_t, r_t), r_t Gaussian releases of noise
    multiplier z about the same client (their composition is one Gaussian of multiplier z / sqrt(r_t)),
    made when the client is sampled with probability q_t (q_t = 1: every client, no amplification).
    Rounds with r_t = 0 released nothing and are left out."""
    from dp_accounting import dp_event

    groups: dict[tuple[float, int], int] = {}
    for q, r in rounds:
        if r > 0:
            groups[(float(q), int(r))] = groups.get((float(q), int(r)), 0) + 1
    events = []
    for (q, r), count in sorted(groups.items()):
        g = dp_event.GaussianDpEvent(float(z) / math.sqrt(r))
        if q < 1:
            g = (dp_event.PoissonSampledDpEvent(q, g) if sampling == "poisson" else
                 dp_event.SampledWithoutReplacementDpEvent(int(clients), int(cohort), g))
        events.append(dp_event.SelfComposedDpEvent(g, count))
    return dp_event.ComposedDpEvent(events)


def dpfedavg_epsilon(z: float, rounds: list[tuple[float, int]], delta: float, accountant: str = "rdp",
                     sampling: str = "poisson", clients: int = 0, cohort: int = 0) -> float:
    """Epsilon at `delta` of a DP-FedAvg run (`dpfedavg_event`) by dp-accounting's RDP or PLD accountant;
    inf with z = 0 (clipping without noise), 0 when nothing was released."""
    if not any(r > 0 for _, r in rounds):
        return 0.0
    if z <= 0:
        return math.inf
    from dp_accounting import privacy_accountant as pa
    from dp_accounting import pld, rdp

    event = dpfedavg_event(z, rounds, sampling, clients, cohort)
    if accountant == "pld":
        if sampling != "poisson":
            raise ValueError("the PLD accountant takes poisson sampling only")
        acc = pld.PLDAccountant()
    else:
        rel = pa.NeighboringRelation.ADD_OR_REMOVE_ONE if sampling == "poisson" else \
            pa.NeighboringRelation.REPLACE_ONE
        acc = rdp.RdpAccountant(neighboring_relation=rel)
    with _quiet():
        acc.compose(event)
        return float(acc.get_epsilon(delta))


class UpdateDP:
    """The run's DP-FedAvg (`dp.clip` C > 0, `dp.noise_multiplier` z, `dp.target_delta`, `dp.accountant`,
    `dp.sampling`; noise from `privacy.noise`). One object per run on the server side; the runner calls
    `begin_round` before each server step, and every `aggregate` of that round is one release."""

    def __init__(self, clip: float, z: float, delta: float, accountant: str = "rdp", sampling: str = "poisson",
                 noise: str = "seeded", seed: int = 0, clients: int = 0, cohort: int = 0):
        self.clip, self.z, self.delta = float(clip), float(z), float(delta)
        self.accountant, self.sampling, self.noise, self.seed = accountant, sampling, noise, int(seed)
        self.clients, self.cohort = int(clients), int(cohort)
        self.rnd, self.releases = 0, 0

    @classmethod
    def of(cls, cfg, clients: int, cohort: int) -> "UpdateDP | None":
        """The configuration's plan, None when `dp.clip` is 0. `clients`: those a cohort is drawn from;
        `cohort`: how many a round draws."""
        if not cfg.get("dp.clip", 0.0):
            return None
        return cls(cfg["dp.clip"], cfg["dp.noise_multiplier"], cfg["dp.target_delta"], cfg["dp.accountant"],
                   cfg["dp.sampling"], cfg.get("privacy.noise", "seeded"), cfg["seed"], clients, cohort)

    @property
    def rate(self) -> float:
        """q = m / N, the probability the accountant gives a client of being in a round's cohort."""
        return self.cohort / self.clients if self.clients else 1.0

    def begin_round(self, rnd: int) -> None:
        self.rnd, self.releases = int(rnd), 0

    def generator(self) -> torch.Generator:
        """The noise of the round's next release: a named stream of the run seed, or OS entropy."""
        if self.noise == "system":
            return torch.Generator().manual_seed(secrets.randbits(63))
        return torch.Generator().manual_seed(stream_seed(self.seed, self.rnd, 0, f"dp_update:{self.releases}"))

    def aggregate(self, x: torch.Tensor, w: torch.Tensor, sent: torch.Tensor | None) -> torch.Tensor:
        """The DP average of rows x [n, P], float64 [P]: the rows with weight > 0 take part, each counted once
        (sample counts would scale a client's influence past C); their updates u_k = x_k - sent_k (x_k when
        `sent` is None: the rows are updates) are clipped to norm C, summed, N(0, (z C)^2) is added to every
        coordinate, and the sum is divided by the number of rows averaged (the variable denominator,
        docs/privacy.md); the mean of the rows sent is added back (the server's own knowledge)."""
        keep = w.to(torch.float64) > 0
        if not bool(keep.any()):
            raise ValueError("weights sum to zero; the caller must keep the previous value")
        x64 = x.to(torch.float64)[keep]
        base = torch.zeros_like(x64) if sent is None else sent.to(torch.float64).expand(len(x), -1)[keep]
        clipped = clip_rows(x64 - base, self.clip)
        noise = self.z * self.clip * torch.randn(x64.shape[1:], generator=self.generator(), dtype=torch.float64)
        self.releases += 1
        n = int(keep.sum())
        out = (clipped.sum(0) + noise) / n
        if sent is None:
            return out
        same = bool((base == base[0]).all())             # one model sent to all: that model, exactly
        return (base[0] if same else base.mean(0)) + out

    def epsilon(self, rounds: list[tuple[float, int]]) -> float:
        """Epsilon spent after `rounds` ((q_t, r_t) per round) at `dp.target_delta`."""
        return dpfedavg_epsilon(self.z, rounds, self.delta, self.accountant, self.sampling, self.clients,
                                self.cohort)
