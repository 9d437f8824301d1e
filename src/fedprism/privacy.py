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
