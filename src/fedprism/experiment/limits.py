"""Upper bounds for the size keys of a run, derived from its data and from this machine's memory.

`check_limits(cfg, n_train, num_params)` runs once the federation and the model exist (so the client
sizes and the parameter count P are known) and before anything large is allocated. Each bound raises
`ConfigError` naming the key, its value, the largest value allowed here and why:

    batch_size     at most the federation's train samples (a larger batch is the whole data anyway)
    local_epochs   batch orders are drawn lazily, one epoch at a time (memory does not grow with
                   epochs), so the bound is on work: at most MAX_STEPS (10^9) optimiser steps for the
                   largest client in one round (more than a day of a tiny model's steps: a typo);
                   and one epoch's batch order of the largest cohort must fit in a quarter of
                   the available memory
    <method>.k     at most `clients` (a cluster model nobody can join is never trained); for methods that
                   cluster only the round's clients (fedprism; fedprism_dual with cluster_on = reporting;
                   fedclust's periodic variant) at most the cohort floor(fraction x clients), since a
                   clustering of fewer points than K is skipped and would be skipped every round; and
                   the K cluster models (IFCA: scored by every client of a cohort, cohort x K copies)
                   fit in half of the available memory
    fraction       cfl: at least two clients a round (its split test compares the mean and the largest
                   update of a round's clients, equal for one client)
    clients        N <= train samples / partition.min_train is the partitioner's own check
                   (PartitionError); methods that keep a model per client (local, fedamp, cfl,
                   fedprism_dual) also need N x P x 4 bytes to fit in half of the available memory.
                   Models that are the clients' own state (local, fedprism_dual) follow
                   `state.storage`: float16 halves them; mmap needs them on disk beside the store
                   (`disk`: the free bytes there) and only a cohort's rows in memory
    fedprism_dual.cluster_on = seen keeps every client's last clustering feature (N x d float64) and
                   clusters up to N of them: with features = full (d = P), N x P x 16 bytes in half
                   of the memory

Available memory is MemAvailable of /proc/meminfo, capped by the cgroup limit where there is one.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from fedprism.errors import ConfigError

#: bytes per sample and per batch of one epoch's batch order: int64 index + the vectorized engine's
#: [T, W, B] index (int64) and weight (float32) schedule; a torch view object per batch
_PER_SAMPLE = 8 + 8 + 4
_PER_BATCH = 256
#: optimiser steps one client may take in one round (local_epochs x batches per epoch)
MAX_STEPS = 10**9
#: methods whose state holds per-client models ([N, P] rows), and how many
_PER_CLIENT_MODELS = {"local": 1, "fedamp": 2, "cfl": 1, "fedprism_dual": 2}
#: of those, the ones held as the clients' own state (`Algorithm.client_state`, `state.storage`)
_CLIENT_STATE_MODELS = {"local": 1, "fedprism_dual": 2}
#: bytes per parameter of a client-state model in memory, per `state.storage`
_STORAGE_BYTES = {"memory": 4, "float16": 2, "mmap": 0}
_K_METHODS = ("fedprism", "fedprism_dual", "ifca", "fedclust")


def _clusters_the_cohort(cfg) -> bool:
    """Whether the method's re-clustering runs on the clients of one round only (Fed-PRISM's UpdateClusters
    on S_t; `fedprism_dual.cluster_on=reporting`; FedClust's periodic variant), so that a cohort smaller
    than K can never be clustered."""
    if cfg["method"] == "fedprism":
        return True
    if cfg["method"] == "fedclust":
        return cfg["fedclust.variant"] == "periodic"
    return cfg["method"] == "fedprism_dual" and cfg["fedprism_dual.cluster_on"] == "reporting"


def _cluster_k(cfg) -> int | None:
    """K of a configuration that trains K cluster models, None otherwise (FedClust's original variant
    finds its clusters by a threshold and does not use `fedclust.k`)."""
    method = cfg["method"]
    if method not in _K_METHODS or f"{method}.k" not in cfg.values:
        return None
    if method == "fedclust" and cfg.get("fedclust.variant") == "original":
        return None
    return cfg[f"{method}.k"]


def _cohort(cfg, N: int) -> int:
    """Clients a round of `cfg` trains: all with Local's `participation=all`, else floor(fraction x N), at
    least 1 (`fedprism.selection.cohort_size`)."""
    if cfg["method"] == "local" and cfg.get("local.participation") == "all":
        return N
    from fedprism.selection import cohort_size

    return min(N, cohort_size(N, cfg["fraction"]))


def check_cohort(cfg, N: int | None = None) -> None:
    """The limits that need only the configuration (`check_limits` runs them too; a Flower simulation runs
    them before it starts anything): K above the clients, K above a round's cohort for the methods that
    cluster a round's clients, CFL with one client a round. `N`: the federation's clients (default
    `cfg["clients"]`)."""
    N = cfg["clients"] if N is None else int(N)
    method = cfg["method"]
    cohort = _cohort(cfg, N)
    K = _cluster_k(cfg)
    if K is not None:
        if K > N:
            raise ConfigError(f"{method}.k", K, f"at most clients={N} (a cluster model no client can join "
                              "is never trained)")
        if cohort < K and _clusters_the_cohort(cfg):
            alt = ", or fedprism_dual.cluster_on=seen" if method == "fedprism_dual" else ""
            raise ConfigError(f"{method}.k", K, f"at most {cohort} here: clients={N} x fraction="
                              f"{cfg['fraction']:g} gives {cohort} client(s) a round, and a "
                              "re-clustering of fewer clients than clusters is skipped, every time, so "
                              "the cluster models would never separate (the run would be FedAvg-like); "
                              f"raise fraction, lower {method}.k{alt}")
    if method == "cfl" and cohort < 2 <= N and cfg["cfl.eps1"] <= cfg["cfl.eps2"]:
        raise ConfigError("fraction", cfg["fraction"], f"at least {2 / N:g} for cfl with clients={N}: with "
                          "one client a round the mean update is that client's update, so the split test "
                          "(mean norm < cfl.eps1 <= cfl.eps2 < max norm) can never pass and CFL stays FedAvg")


def available_memory() -> int:
    """Bytes of memory this process may still use (MemAvailable, capped by a cgroup limit)."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            avail = 8 << 30
    for f in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(f).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            try:
                used = int(Path(f).with_name("memory.current" if f.endswith(".max") else "memory.usage_in_bytes")
                           .read_text())
            except (OSError, ValueError):
                used = 0
            avail = min(avail, max(int(text) - used, 0))
    return int(avail)


def _gb(b: float) -> str:
    return f"{b / 2**30:.1f} GB" if b >= 2**30 else f"{b / 2**20:.1f} MB"


def check_limits(cfg, n_train: np.ndarray, num_params: int, memory: int | None = None,
                 sizes_complete: bool = True, disk: int | None = None) -> None:
    """Raise ConfigError for a size key beyond what this data and this machine allow (module doc).

    `sizes_complete=False` (a Flower server that only knows the counts its nodes reported so far):
    the batch-size bound, which needs the federation's total, is skipped. `disk`: free bytes where
    `state.storage=mmap` keeps its row files (None: not checked)."""
    mem = available_memory() if memory is None else memory
    n_train = np.asarray(n_train, dtype=np.int64)
    N, P, total = len(n_train), int(num_params), int(n_train.sum())
    method = cfg["method"]

    B = cfg["batch_size"]
    if sizes_complete and B > max(total, 1):
        raise ConfigError("batch_size", B, f"at most {total} here (the federation's train samples)")

    cohort = _cohort(cfg, N)
    largest = np.sort(n_train)[::-1][:cohort]
    per_epoch = int(_PER_SAMPLE * largest.sum() + _PER_BATCH * np.ceil(largest / B).sum())
    E = cfg["local_epochs"]
    budget = mem // 4
    if per_epoch > budget:
        raise ConfigError("local_epochs", E, f"no epoch fits here: one epoch's batch order of the largest cohort "
                          f"({cohort} clients, {int(largest.sum())} samples) takes {_gb(per_epoch)}, more than a "
                          f"quarter of the available memory ({_gb(mem)}); lower fraction or clients")
    per_epoch_steps = int(np.ceil(largest[0] / B)) if len(largest) else 0
    if per_epoch_steps and E * per_epoch_steps > MAX_STEPS:
        raise ConfigError("local_epochs", E, f"at most {MAX_STEPS // per_epoch_steps} here: the largest client "
                          f"takes {per_epoch_steps} steps per epoch and a round may take at most {MAX_STEPS:.0e} "
                          "steps per client (batch orders are drawn lazily; the bound is on work, not memory)")

    check_cohort(cfg, N)
    K = _cluster_k(cfg)
    if K is not None:
        copies = cohort + 1 if method == "ifca" else 3
        need = K * P * 4 * copies
        if need > mem // 2:
            most = max((mem // 2) // (P * 4 * copies), 0)
            raise ConfigError(f"{method}.k", K, f"at most {most} here: {K} cluster models of {P} parameters "
                              f"(x{copies} copies) need {_gb(need)}, more than half the available memory "
                              f"({_gb(mem)})")

    storage = cfg.get("state.storage", "memory")
    own = _CLIENT_STATE_MODELS.get(method, 0)
    per_client = _PER_CLIENT_MODELS.get(method, 0)
    need = N * P * (4 * (per_client - own) + _STORAGE_BYTES[storage] * own)
    if need > mem // 2:
        per = P * (4 * (per_client - own) + _STORAGE_BYTES[storage] * own)
        most = (mem // 2) // per
        how = f" at {_STORAGE_BYTES[storage]} bytes per parameter (state.storage={storage}; mmap keeps them on disk)" \
            if own else ""
        raise ConfigError("clients", N, f"at most {most} here for {method}: {per_client} model(s) of {P} parameters "
                          f"per client{how} need {_gb(need)}, more than half the available memory ({_gb(mem)})")
    if own and storage == "mmap" and disk is not None and N * P * 4 * own > disk:
        raise ConfigError("clients", N, f"at most {disk // (P * 4 * own)} here for {method} with state.storage=mmap: "
                          f"its row files need {_gb(N * P * 4 * own)} on disk beside the store, "
                          f"{_gb(disk)} are free there")
    if method == "fedprism_dual" and cfg.get("fedprism_dual.cluster_on") == "seen":
        d = P if cfg.get("fedprism_dual.features") == "full" else 0
        if d and N * d * 16 > mem // 2:
            raise ConfigError("fedprism_dual.cluster_on", "seen", f"reporting here, or fedprism_dual.features="
                              f"last_layer: the features of all {N} clients ({d} parameters each, kept and "
                              f"clustered in float64) need {_gb(N * d * 16)}, more than half the available "
                              f"memory ({_gb(mem)})")
