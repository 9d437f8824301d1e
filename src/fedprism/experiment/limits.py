"""Upper bounds for the size keys of a run, derived from its data, its method's declarations and this
machine's memory.

`check_limits(cfg, n_train, num_params)` runs once the federation and the model exist (so the client
sizes and the parameter count P are known) and before anything large is allocated. Each bound raises
`ConfigError` naming the key, its value, the largest value allowed here and why:

    batch_size     at most the federation's train samples (a larger batch is the whole data anyway)
    local_epochs   batch orders are drawn lazily, one epoch at a time (memory does not grow with
                   epochs), so the bound is on work: at most MAX_STEPS (10^9) optimiser steps for the
                   largest client in one round (more than a day of a tiny model's steps: a typo);
                   and one epoch's batch order of the largest cohort must fit in a quarter of
                   the available memory
    <method>.k     for a method that trains K cluster models (`Algorithm.clusters`): at most `clients`
                   (a cluster model nobody can join is never trained), and at most a round's cohort when
                   the method clusters only the round's clients (`Algorithm.clusters_cohort`), since a
                   clustering of fewer points than K is skipped and would be skipped every round
    method checks  `Algorithm.check_cohort` (CFL: at least two clients a round); the robust rule of a method
                   that averages models (`aggregation.check_rule_cohort`: Krum's n > 2f + 2, Bulyan's n >= 4f + 3)
    memory         one rule for every method, from its declarations: the clients' own state
                   (`Algorithm.client_state`, e.g. ('P',) per entry: N x P x element size, at the bytes
                   `state.storage` keeps: float16 halves floating-point state, mmap keeps it on disk beside
                   the store and only a cohort's rows in memory) plus the server's models beyond the
                   global one (`Algorithm.server_models`: K cluster models and their working copies, a
                   model per client kept at the server, ... as float32) must fit in half of the available
                   memory. The key blamed is the one behind the largest share (`clients` for the client
                   state), with the largest value that would fit; the message gives bytes per client,
                   clients, the total and the memory
    disk           state.storage = mmap: the client state's row files (N x bytes per client at their
                   declared element sizes) must fit on the disk beside the store (`disk`: its free bytes)

Available memory is MemAvailable of /proc/meminfo, capped by the cgroup limit where there is one.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from fedprism.errors import ConfigError
from fedprism.experiment.config import held_out_count
from fedprism.protocol import ClientState
from fedprism.textable import size_text as _gb

#: bytes per sample and per batch of one epoch's batch order: int64 index + the vectorized engine's
#: [T, W, B] index (int64) and weight (float32) schedule; a torch view object per batch
_PER_SAMPLE = 8 + 8 + 4
_PER_BATCH = 256
#: optimiser steps one client may take in one round (local_epochs x batches per epoch)
MAX_STEPS = 10**9
#: `state.storage` values whose rows are not held in memory (only the rows of a round)
_ON_DISK = ("mmap",)


def _method(cfg):
    from fedprism.algorithms import REGISTRY

    return REGISTRY[cfg["method"]]


def _hp(cfg) -> dict:
    """The method's resolved hyper-parameters, keys without the `<method>.` prefix (`cfg`: a Config or a
    dict of its values)."""
    p = cfg["method"] + "."
    values = cfg if isinstance(cfg, dict) else cfg.values
    return {k[len(p):]: v for k, v in values.items() if k.startswith(p)}


def _cohort(cfg, N: int) -> int:
    """Clients a round of `cfg` trains (`Algorithm.cohort`: floor(fraction x N), at least 1, unless the
    method trains others)."""
    return min(N, _method(cfg).cohort(_hp(cfg), N, cfg["fraction"]))


def _training_cohort(cfg, N: int) -> tuple[int, int]:
    """(clients a round trains, clients held out by `data.unseen_clients`): cohorts are drawn from the
    clients that train."""
    unseen = cfg.get("data.unseen_clients", 0.0)
    held = held_out_count(N, unseen) if unseen else 0
    return _cohort(cfg, N - held), held


def check_cohort(cfg, N: int | None = None) -> None:
    """The limits that need only the configuration (`check_limits` runs them too; a Flower simulation runs
    them before it starts anything): K above the clients, K above a round's cohort for the methods that
    cluster a round's clients, and the method's own (`Algorithm.check_cohort`). `N`: the federation's
    clients (default `cfg["clients"]`)."""
    N = cfg["clients"] if N is None else int(N)
    method, cls, hp = cfg["method"], _method(cfg), _hp(cfg)
    unseen = cfg.get("data.unseen_clients", 0.0)
    cohort, held = _training_cohort(cfg, N)
    where = f"clients={N} x fraction={cfg['fraction']:g}"
    if held:
        where = (f"fraction={cfg['fraction']:g} x the {N - held} clients that train "
                 f"(data.unseen_clients={unseen:g} holds out {held} of clients={N})")
    K = cls.clusters(hp)
    if K is not None:
        if K > N:
            raise ConfigError(f"{method}.k", K, f"at most clients={N} (a cluster model no client can join "
                              "is never trained)")
        if cohort < K and cls.clusters_cohort(hp):
            alt = "".join(f", or {method}.{k}={v}" for k, v in _cohort_free(cls, hp))
            raise ConfigError(f"{method}.k", K, f"at most {cohort} here: {where} gives {cohort} client(s) a "
                              "round, and a "
                              "re-clustering of fewer clients than clusters is skipped, every time, so "
                              "the cluster models would never separate (the run would be FedAvg-like); "
                              f"raise fraction, lower {method}.k{alt}")
    cls.check_cohort(hp, N, cohort, cfg["fraction"])
    if cls.averages:                 # the robust rule's own bound (krum, multi_krum, bulyan: f against the cohort)
        from fedprism.algorithms.aggregation import check_rule_cohort
        check_rule_cohort(method, hp, cohort, where)


def attack_warning(cfg) -> str | None:
    """A note when Byzantine clients (`attack.fraction`) are expected to outnumber what the method's robust
    rule tolerates (`aggregation.f`) in a round: allowed (a rule's breakdown is worth measuring), but said."""
    fraction = float(cfg.get("attack.fraction", 0.0) or 0.0)
    hp = _hp(cfg)
    rule = hp.get("aggregation", "mean")
    from fedprism.algorithms.aggregation import BYZANTINE_RULES

    if fraction <= 0 or rule not in BYZANTINE_RULES or not _method(cfg).averages:
        return None
    cohort, _ = _training_cohort(cfg, cfg["clients"])
    f, expected = int(hp.get("aggregation.f", 1)), fraction * cohort
    if expected <= f:
        return None
    return (f"attack.fraction={fraction:g} puts about {expected:.1f} Byzantine clients in a round of {cohort}, "
            f"more than the {cfg['method']}.aggregation.f={f} that {rule} tolerates: this run measures {rule} "
            "past its bound (raise aggregation.f, and fraction or clients if the rule then asks for it)")


def _cohort_free(cls, hp: dict) -> list[tuple[str, object]]:
    """Values of one choice parameter of the method under which it no longer clusters a round's clients
    only (Fed-PRISM dual's `cluster_on=seen`), to name in the message."""
    out = []
    for key, p in cls.params.items():
        for v in getattr(p, "choices", None) or ():
            if v != hp.get(key) and not cls.clusters_cohort({**hp, key: v}):
                out.append((key, v))
    return out


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


def _element_bytes(decl: ClientState, storage: str) -> int:
    """Bytes one element of a declared client state takes in memory under `storage`."""
    if storage in _ON_DISK:
        return 0
    if storage == "float16" and decl.dtype.is_floating_point:
        return 2
    return decl.dtype.itemsize


def _elements(decl: ClientState, dims: dict[str, int]) -> int:
    """Elements of one client's row of a declaration: the product of its shape, symbols ('P', 'C', 'd', 'N')
    resolved from `dims`. A symbol not given is bounded by P (a model's classes and feature width never
    exceed its parameters), so the bound errs on the side of refusing."""
    n = 1
    for s in decl.shape:
        n *= int(dims.get(s, dims["P"])) if isinstance(s, str) else int(s)
    return n


def client_state_bytes(cls, P: int, N: int, storage: str = "memory",
                       dims: dict[str, int] | None = None) -> int:
    """Bytes per client of the method's declared client state (`Algorithm.client_state`) in memory under
    `state.storage` = `storage` (0 for mmap: the rows live on disk)."""
    dims = {"N": N, **(dims or {}), "P": P}
    return sum(_elements(d, dims) * _element_bytes(d, storage) for d in cls.client_state.values())


def client_state_disk_bytes(cls, P: int, N: int, dims: dict[str, int] | None = None) -> int:
    """Bytes per client of the declared client state's row files (`state.storage=mmap`)."""
    dims = {"N": N, **(dims or {}), "P": P}
    return sum(_elements(d, dims) * d.dtype.itemsize for d in cls.client_state.values())


def check_limits(cfg, n_train: np.ndarray, num_params: int, memory: int | None = None,
                 sizes_complete: bool = True, disk: int | None = None) -> None:
    """Raise ConfigError for a size key beyond what this data and this machine allow (module doc).

    `sizes_complete=False` (a Flower server that only knows the counts its nodes reported so far):
    the batch-size bound, which needs the federation's total, is skipped. `disk`: free bytes where
    `state.storage=mmap` keeps its row files (None: not checked)."""
    mem = available_memory() if memory is None else memory
    n_train = np.asarray(n_train, dtype=np.int64)
    N, P, total = len(n_train), int(num_params), int(n_train.sum())

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
    check_memory(cfg, N, P, mem, disk=disk)


def memory_terms(cfg, N: int, P: int, dims: dict[str, int] | None = None) -> list[tuple[str, str, int]]:
    """What a run of `cfg` with N clients and P parameters holds beyond one model and its data, from its
    method's declarations: [(key that sets it, what it is, bytes)]. The client state of every client at
    `state.storage`'s element size (and, for mmap, the rows of one round in memory); each group of
    `Algorithm.server_models` as float32 models."""
    cls, hp = _method(cfg), _hp(cfg)
    storage = cfg.get("state.storage", "memory")
    cohort = min(N, cls.cohort(hp, N, cfg["fraction"]))
    out = []
    if cls.client_state:
        per = client_state_bytes(cls, P, N, storage, dims)
        entries = ", ".join(f"{name} {_elements(d, {'N': N, **(dims or {}), 'P': P})} x "
                            f"{_element_bytes(d, storage) or d.dtype.itemsize} B"
                            for name, d in cls.client_state.items())
        if storage in _ON_DISK:
            per_row = client_state_disk_bytes(cls, P, N, dims)
            out.append(("clients", f"the client state of a round's {cohort} clients in memory ({entries}; "
                        f"state.storage={storage} keeps the rest on disk): {per_row} bytes per client", cohort * per_row))
        else:
            out.append(("clients", f"the client state ({entries}; state.storage={storage}): {per} bytes per "
                        f"client x {N} clients", N * per))
    for key, models in cls.server_models(hp, N, cohort).items():
        if models:
            out.append((key, f"{models} server model(s) of {P} float32 parameters ({key if key == 'clients' else cfg['method'] + '.' + key}), {4 * P} bytes each",
                        4 * P * int(models)))
    return out


def _largest(fits, hi: int) -> int:
    """The largest n in [0, hi] with fits(n) (fits is monotone: true up to some n), 0 if none."""
    lo = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def check_memory(cfg, N: int, P: int, mem: int, disk: int | None = None,
                 dims: dict[str, int] | None = None) -> None:
    """The memory rule (module docstring), the same for every method: the terms of `memory_terms` must fit in
    half of `mem`. Refused with the key behind the largest term, the largest value of it that fits, and
    the numbers; for `state.storage=mmap`, the row files must fit in `disk` (None: not checked)."""
    method, cls, hp = cfg["method"], _method(cfg), _hp(cfg)
    limit = mem // 2
    terms = memory_terms(cfg, N, P, dims)
    need = sum(b for _, _, b in terms)
    if need > limit:
        by_key: dict[str, int] = {}
        for key, _, b in terms:
            by_key[key] = by_key.get(key, 0) + b
        key = max(by_key, key=lambda k: (by_key[k], k == "clients"))
        if key == "clients":
            most = _largest(lambda n: sum(b for *_, b in memory_terms(cfg, n, P, dims)) <= limit, N)
            name, value, bound = "clients", N, f"at most {most} here for {method}"
        else:
            name, value = f"{method}.{key}", hp.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                hp_of = lambda v: {**{f"{method}.{k}": x for k, x in hp.items()}, **{  # noqa: E731
                    k: cfg[k] for k in ("method", "fraction", "state.storage")}, name: v}
                most = _largest(lambda v: sum(b for *_, b in memory_terms(hp_of(v), N, P, dims)) <= limit, value)
                bound = f"at most {most} here"
            else:
                bound = f"another value here for {method}"
        parts = "; ".join(f"{what} = {_gb(b)}" for _, what, b in terms)
        raise ConfigError(name, value, f"{bound}: {parts}; {need} bytes ({_gb(need)}) in all, more than half "
                          f"the available memory ({_gb(limit)} of {_gb(mem)})")
    storage = cfg.get("state.storage", "memory")
    if storage in _ON_DISK and disk is not None and cls.client_state:
        per = client_state_disk_bytes(cls, P, N, dims)
        if N * per > disk:
            raise ConfigError("clients", N, f"at most {disk // per} here for {method} with state.storage={storage}: "
                              f"its row files take {per} bytes per client x {N} clients = {_gb(N * per)} on disk "
                              f"beside the store, {_gb(disk)} are free there")
