"""A dynamic-data protocol: classes leave some clients' data and come back later, on a seeded schedule.

FedSub's dynamic scenario (Campana and Delmastro, "FedSub: Introducing Class-aware Subnetworks Fusion to
Enhance Personalized Federated Learning", Section 4.5): a random `drift.fraction` of the clients (the paper:
60%) lose up to `drift.remove` of their classes (the paper: up to 80%) before the first round; every
`drift.every` rounds (the paper: 50 for WISDM, 200 for WESAD and DREAMT) each of them gets one removed class
back, in a random order, until all are back.

Decisions: a drifting client loses exactly floor(remove x its number of classes) classes, and at least one
class always stays (a client with one class does not drift); the class of each return is drawn with the
schedule. A removed class is absent from every split of the client (train, local test, validation), so the
local test follows what the client currently sees and a returning class shows up in its test split too,
as in the paper, where the drops in F1 come when classes are reintroduced. The global test set never
changes. The schedule is a pure function of (seed, the partition's label counts, the three keys), drawn from
its own random stream, and is stored with round 0 of the run (records `drift`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DriftSchedule:
    """returns[k] = ((class, round it comes back), ...) for every drifting client k."""

    returns: dict[int, tuple[tuple[int, int], ...]]

    def removed(self, rnd: int) -> dict[int, list[int]]:
        """The classes absent from each drifting client's data in round `rnd` (clients with none left out)."""
        out = {k: [c for c, back in ret if back > rnd] for k, ret in self.returns.items()}
        return {k: v for k, v in out.items() if v}

    def rows(self, idx: list[np.ndarray], y: np.ndarray, rnd: int) -> list[np.ndarray]:
        """Each client's index list with the rows of its removed classes dropped (`y`: labels of the pool)."""
        gone = self.removed(rnd)
        return [i[~np.isin(y[i], gone[k])] if k in gone else i for k, i in enumerate(idx)]

    def records(self) -> list[tuple[str, int, dict]]:
        return [("drift", int(k), {"returns": [[int(c), int(r)] for c, r in ret]}) for k, ret in self.returns.items()]


def make_schedule(label_hist: np.ndarray, fraction: float, remove: float, every: int, seed: int) -> DriftSchedule:
    """The seeded schedule for a federation with train label counts `label_hist` [N, C]."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0xD1F7]))
    N = label_hist.shape[0]
    chosen = np.sort(rng.choice(N, size=int(np.floor(fraction * N)), replace=False))
    returns = {}
    for k in chosen:
        classes = np.flatnonzero(label_hist[k] > 0)
        n = min(int(np.floor(remove * len(classes))), len(classes) - 1)
        if n <= 0:
            continue
        gone = rng.permutation(rng.choice(classes, size=n, replace=False))
        returns[int(k)] = tuple((int(c), (i + 1) * every) for i, c in enumerate(gone))
    return DriftSchedule(returns)
