"""Evaluation with exact caching (specs/performance.md B.7 "F").

Every client's inference model (`model_for`) is scored on its local test split and on the global
test set. A model row is identified by a hash of its bytes: a client whose model did not change
since its last evaluation is not scored again, and identical models (FedAvg's one shared model)
are scored on the global test set once. Results are exact, not approximations.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import torch

from fedprism.algorithms.base import Algorithm, EvalResult


def row_hashes(params: torch.Tensor) -> list[bytes]:
    a = params.detach().to("cpu", torch.float32).contiguous().numpy()
    return [hashlib.blake2b(r.tobytes(), digest_size=16).digest() for r in a]


def macro_f1(conf: torch.Tensor) -> torch.Tensor:
    """Per-model macro-F1 over the classes present in the true labels; conf [n, C, C]."""
    c = conf.double()
    tp = c.diagonal(dim1=1, dim2=2)
    support = c.sum(2)
    predicted = c.sum(1)
    denom = support + predicted
    f1 = torch.where(denom > 0, 2 * tp / denom.clamp(min=1), torch.zeros_like(tp))
    present = support > 0
    return (f1 * present).sum(1) / present.sum(1).clamp(min=1)


@dataclass
class ClientScores:
    """Per-client arrays of one evaluation (NaN where a split is empty or not evaluated)."""

    local_acc: np.ndarray
    local_loss: np.ndarray
    local_f1: np.ndarray
    n_test: np.ndarray
    global_acc: np.ndarray
    global_f1: np.ndarray
    evaluated: int            # model-evaluations actually computed (for the speed report)
    #: per-client accuracies of an algorithm's alternative predictions, `<split>_acc@<name>`
    alternatives: dict[str, np.ndarray] = field(default_factory=dict)


class Evaluator:
    def __init__(self, engine, num_clients: int, do_global: bool = True):
        self.engine = engine
        self.n = num_clients
        self.do_global = do_global
        self._local: dict[int, tuple[bytes, tuple]] = {}
        self._global: dict[bytes, tuple] = {}

    @staticmethod
    def _rows(r: EvalResult) -> list[tuple]:
        f1 = macro_f1(r.confusion)
        return [(int(r.correct[i]), int(r.count[i]), float(r.loss_sum[i]), float(f1[i])) for i in range(len(r.count))]

    def __call__(self, algo: Algorithm, state: dict) -> ClientScores:
        clients = np.arange(self.n)
        evaluated = 0
        alternatives: dict[str, np.ndarray] = {}
        custom_local = algo.evaluate(state, self.engine, clients, "local")
        if custom_local is not None:
            local = self._rows(custom_local)
            results = {"local": custom_local}
            glob = None
            if self.do_global:
                results["global"] = algo.evaluate(state, self.engine, clients, "global")
                glob = self._rows(results["global"])
            for split, r in results.items():
                n = r.count.double().numpy()
                with np.errstate(invalid="ignore", divide="ignore"):
                    for name, correct in r.alternatives.items():
                        alternatives[f"{split}_acc@{name}"] = np.where(n > 0, correct.double().numpy() / n, np.nan)
            evaluated = 2 * self.n
        else:
            params = algo.model_for(state, clients)
            hashes = row_hashes(params)
            todo = [i for i in clients if self._local.get(int(i), (None,))[0] != hashes[i]]
            if todo:
                res = self._rows(self.engine.evaluate(params[torch.as_tensor(todo)], np.array(todo), "local"))
                for i, r in zip(todo, res):
                    self._local[int(i)] = (hashes[i], r)
                evaluated += len(todo)
            local = [self._local[int(i)][1] for i in clients]
            glob = None
            if self.do_global:
                need = {}
                for i, h in enumerate(hashes):
                    if h not in self._global and h not in need:
                        need[h] = i
                if need:
                    idx = list(need.values())
                    res = self._rows(self.engine.evaluate(params[torch.as_tensor(idx)], np.array(idx), "global"))
                    for h, r in zip(need, res):
                        self._global[h] = r
                    evaluated += len(idx)
                glob = [self._global[h] for h in hashes]
                live = set(hashes)
                self._global = {h: r for h, r in self._global.items() if h in live}

        def acc(rows):
            return np.array([r[0] / r[1] if r[1] else np.nan for r in rows])

        n_test = np.array([r[1] for r in local])
        return ClientScores(
            local_acc=acc(local),
            local_loss=np.array([r[2] / r[1] if r[1] else np.nan for r in local]),
            local_f1=np.array([r[3] if r[1] else np.nan for r in local]),
            n_test=n_test,
            global_acc=acc(glob) if glob is not None else np.full(self.n, np.nan),
            global_f1=np.array([r[3] for r in glob]) if glob is not None else np.full(self.n, np.nan),
            evaluated=evaluated,
            alternatives=alternatives,
        )


def summarize(s: ClientScores) -> dict:
    """Round-level metrics from per-client scores (README "Evaluation semantics")."""
    ok = s.n_test > 0
    la = s.local_acc[ok]
    out = {
        "local_acc": float(np.mean(la)) if la.size else float("nan"),
        "local_acc_weighted": float(np.sum(la * s.n_test[ok]) / max(1, s.n_test[ok].sum())),
        "local_loss": float(np.nanmean(s.local_loss)) if ok.any() else float("nan"),
        "local_f1": float(np.nanmean(s.local_f1)) if ok.any() else float("nan"),
        "ad": float(1 - np.mean(la)) if la.size else float("nan"),
        "sdad": float(np.std(la)) if la.size else float("nan"),
        "clients_without_test": int((~ok).sum()),
    }
    if not np.all(np.isnan(s.global_acc)):
        out["global_acc"] = float(np.mean(s.global_acc))
        out["global_acc_std"] = float(np.std(s.global_acc))
        out["global_f1"] = float(np.mean(s.global_f1))
    for name, acc in s.alternatives.items():          # mean over the clients that have samples there
        if not np.all(np.isnan(acc)):
            out[name] = float(np.nanmean(acc))
    return out
