"""`fedprism verify RUN --rounds N`: does the current code reproduce a stored run's first rounds?

The stored configuration is resolved again and run for N rounds (`Experiment(cfg, store).run(
stop_after=N)`) into a temporary store, with the thread count recorded in the run's provenance (1 for
runs stored without provenance; `--threads` overrides). Then, round by round, every stored round metric
(timings excluded), every per-client row and every record (cluster assignments, ...) is compared for
exact equality; the first difference is reported, or that everything matched. The store being verified
is opened read-only.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from fedprism.experiment.store import Store

#: wall-clock measurements: never compared
TIMING_KEYS = frozenset({"train_s", "eval_s", "wall_s", "seconds"})


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _first_diff(stored: dict, new: dict, prefix: str) -> str | None:
    for k in sorted(set(stored) | set(new)):
        if k in TIMING_KEYS:
            continue
        a, b = stored.get(k, "<absent>"), new.get(k, "<absent>")
        if not _same(a, b):
            delta = f" (|Δ| = {abs(a - b):.3g})" if isinstance(a, (int, float)) and isinstance(b, (int, float)) else ""
            return f"{prefix}{k}: stored {a!r}, now {b!r}{delta}"
    return None


#: execution facts that can change the last bits of a result (`provenance.execution`)
EXECUTION_FACTS = ("cpu", "device", "torch", "numpy", "engine", "compile", "threads", "fuse_jobs",
                   "cuda_graphs", "fused_kernels")


def execution_note(stored: dict | None, now: dict) -> str | None:
    """Why a small difference need not be a change of code: the re-run executed differently from the
    stored run (another CPU, library version, engine, ...), or the stored run recorded no execution."""
    why = ("rounding differs between CPUs, library versions and execution paths (docs/reproducibility.md); "
           "re-run `verify` where the run was stored, or with the execution-only keys it had, to check the "
           "code")
    if not stored:
        return f"note: the stored run records no execution (CPU, versions, engine); {why}"
    changed = [f"{k} {stored.get(k)!r} -> {now.get(k)!r}" for k in EXECUTION_FACTS
               if k in stored and stored.get(k) != now.get(k)]
    return f"note: this re-run executed differently ({'; '.join(changed)}): {why}" if changed else None


def _snapshot(store: Store, run_id: str, n: int) -> tuple[dict, dict, dict]:
    rounds = {h["round"]: h for h in store.round_metrics(run_id) if h["round"] < n}
    clients = {}
    for r in store.db.execute("SELECT * FROM client_metrics WHERE run_id=? AND round<? ORDER BY round, client",
                              (run_id, n)):
        clients[(r["round"], r["client"])] = {k: r[k] for k in r.keys() if k not in ("run_id", "round", "client")}
    records: dict[int, list] = {}
    for rec in store.records(run_id):
        if rec["round"] < n:
            records.setdefault(rec["round"], []).append((rec["kind"], rec["client"], rec["data"]))
    return rounds, clients, records


def compare(old: tuple[dict, dict, dict], new: tuple[dict, dict, dict], n: int) -> tuple[str | None, int]:
    """(first difference or None, number of values compared)."""
    (r0, c0, x0), (r1, c1, x1) = old, new
    count = 0
    for rnd in range(n):
        d = _first_diff(r0.get(rnd, {}), r1.get(rnd, {}), f"round {rnd + 1}, metric ")
        if d:
            return d, count
        count += len(set(r0.get(rnd, {})) - TIMING_KEYS - {"round"})
        for key in sorted(k for k in set(c0) | set(c1) if k[0] == rnd):
            d = _first_diff(c0.get(key, {}), c1.get(key, {}), f"round {rnd + 1}, client {key[1]}, ")
            if d:
                return d, count
            count += len(c0.get(key, {}))
        a, b = x0.get(rnd, []), x1.get(rnd, [])
        if json.dumps(a, sort_keys=True) != json.dumps(b, sort_keys=True):
            kinds = sorted({k for k, _, _ in a} | {k for k, _, _ in b})
            bad = next(k for k in kinds if [x for x in a if x[0] == k] != [x for x in b if x[0] == k])
            return f"round {rnd + 1}, record '{bad}' differs", count
        count += len(a)
    return None, count


def verify(db: str, run: str, rounds: int = 2, threads: int | None = None, progress: bool = True,
           say: Callable[[str], None] = print, overrides: dict[str, Any] | None = None) -> bool:
    """True when the first `rounds` rounds re-run equal the stored ones. `overrides`: execution-only
    keys (engine=sequential, compile=false, device=cpu, ...) to re-run under other execution settings, and
    keys the stored configuration does not hold (added since the run was stored: the value its code had,
    e.g. pfpl.own_share=live)."""
    from fedprism.errors import ConfigError
    from fedprism.experiment.config import EXECUTION_KEYS, resolve_stored

    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ConfigError("--rounds", rounds, "an integer >= 1 (how many rounds to re-run)", kind="option")
    from fedprism.experiment.runner import Experiment

    src = Store(db, readonly=True)
    try:
        row = src.find(run)
        run_id = row["run_id"]
        stored_cfg = json.loads(row["config"])
        for k in overrides or {}:
            if k not in EXECUTION_KEYS and k in stored_cfg:
                raise ConfigError(k, overrides[k], "an execution-only key ("
                                  + ", ".join(sorted(EXECUTION_KEYS)) + ") or a key this run's stored "
                                  "configuration does not hold: other values of its own keys would make it "
                                  "another run")
        prov = src.provenance(run_id)
        n = min(rounds, int(row["rounds_done"]))
        old = _snapshot(src, run_id, n)
    finally:
        src.close()
    if n <= 0:
        say(f"run {run_id}: no stored rounds to compare")
        return False
    recorded = ((prov or {}).get("execution") or {}).get("threads")
    t = threads or recorded or 1
    cfg = resolve_stored({**stored_cfg, **(overrides or {}), "threads": t})
    if cfg.run_id != run_id:
        say(f"note: the current code resolves this configuration to run id {cfg.run_id} (a key or default "
            "changed since it was stored); comparing anyway")
    label = f" '{stored_cfg['name']}'" if stored_cfg.get("name") else ""       # no label: nothing, not ''
    say(f"verify {run_id} ({stored_cfg['method']}{label}, seed {stored_cfg['seed']}): "
        f"re-running {n} round(s) with {t} thread(s)" + ("" if recorded else " (thread count not recorded)")
        + (f", {' '.join(f'{k}={v}' for k, v in overrides.items())}" if overrides else ""))
    before = torch.get_num_threads()
    try:
        with tempfile.TemporaryDirectory(prefix="fedprism-verify-") as tmp:
            store = Store(Path(tmp) / "verify.db")
            try:
                Experiment(cfg, store, progress=progress).run(stop_after=n)
                new = _snapshot(store, cfg.run_id, n)
                ex = (store.provenance(cfg.run_id) or {}).get("execution", {})
                say(f"executed with engine {ex.get('engine')}, compile {ex.get('compile')}, "
                    f"{ex.get('threads')} thread(s), torch {ex.get('torch')}, CPU {ex.get('cpu')}")
            finally:
                store.close()
    finally:
        torch.set_num_threads(before)
    diff, count = compare(old, new, n)
    if diff:
        say(f"DIFFERS: {diff}")
        note = execution_note((prov or {}).get("execution"), ex)
        if note:
            say(note)
        return False
    say(f"reproduced: all {count} stored values of rounds 1-{n} match exactly (timings excluded)")
    return True


if __name__ == "__main__":  # pragma: no cover
    sys.exit(0 if verify(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 2) else 1)
