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

One schedule, two places that apply it: the in-process runner (`Experiment.apply_drift`, over the whole
federation) and every Flower node (`fedprism.flower.node`, over its own client's slice) build it with
`fedprism.experiment.runner.drift_schedule` from the same config and partition, and give their engine
round t's rows through the same `DriftedData.apply`; the node learns t from the message it answers (a
train message's `round`, an evaluation message's `round`). The Flower server, which holds no client
rows, takes each split's size in round t from `split_sizes` (the sizes it checks evaluation replies
against) and stores the same `drift` records and `drift_removed` metric as the in-process runner.
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

    def key(self, rnd: int) -> tuple:
        """The removed classes of round `rnd` as one hashable value: the clients' rows change exactly when
        it does."""
        return tuple(sorted((k, tuple(v)) for k, v in self.removed(rnd).items()))

    def absent(self, rnd: int) -> int:
        """The number of absent (client, class) pairs in round `rnd` (the metric `drift_removed`)."""
        return sum(len(v) for v in self.removed(rnd).values())

    def split_rows(self, fed, rnd: int) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray] | None]:
        """(train, local test, validation) rows of every client of the federation `fed` in round `rnd`, the
        arguments of `EngineBase.set_rows`. `fed` may be a Flower node's slice (other clients hold no rows)."""
        y_tr, y_te = fed.y_train.cpu().numpy(), fed.local_xy()[1].cpu().numpy()   # local rows: test or own pool
        return (self.rows(fed.train_idx, y_tr, rnd), self.rows(fed.test_idx, y_te, rnd),
                None if fed.val_idx is None else self.rows(fed.val_idx, y_tr, rnd))

    def split_sizes(self, counts: dict[str, np.ndarray], rnd: int) -> dict[str, np.ndarray]:
        """Each client's number of rows of each split in round `rnd`, from the static per-class counts
        `counts[split]` [N, C] (`class_counts`): the size of `split_rows`'s lists, without the rows."""
        gone = self.removed(rnd)
        out = {}
        for split, cnt in counts.items():
            n = cnt.sum(1).astype(np.int64)
            for k, classes in gone.items():
                n[k] -= int(cnt[k, classes].sum())
            out[split] = n
        return out

    def records(self) -> list[tuple[str, int, dict]]:
        return [("drift", int(k), {"returns": [[int(c), int(r)] for c, r in ret]}) for k, ret in self.returns.items()]


class DriftedData:
    """A federation whose clients' rows follow a schedule. `apply(engine, rnd)` gives the engine round `rnd`'s
    rows (`EngineBase.set_rows`) when they differ from the last ones it gave, and says whether they changed.
    The in-process runner (the whole federation) and a Flower node (its own slice) both use it."""

    def __init__(self, schedule: DriftSchedule, fed):
        self.schedule, self.fed = schedule, fed
        self.last: tuple | None = None

    def apply(self, engine, rnd: int) -> bool:
        key = self.schedule.key(rnd)
        if key == self.last:
            return False
        engine.set_rows(*self.schedule.split_rows(self.fed, rnd))
        self.last = key
        return True


def class_counts(fed) -> dict[str, np.ndarray]:
    """Per-class row counts [N, C] of every client's own splits ('train', 'local', and 'val' when the
    federation has validation rows): what `DriftSchedule.split_sizes` takes."""
    C = fed.num_classes
    y_tr, y_te = fed.y_train.cpu().numpy(), fed.local_xy()[1].cpu().numpy()
    count = lambda y, idx: np.stack([np.bincount(y[i], minlength=C) for i in idx]).astype(np.int64)  # noqa: E731
    out = {"train": count(y_tr, fed.train_idx), "local": count(y_te, fed.test_idx)}
    if fed.val_idx is not None:
        out["val"] = count(y_tr, fed.val_idx)
    return out


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
