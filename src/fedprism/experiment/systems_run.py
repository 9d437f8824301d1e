"""The round loop's part of systems realism (`system.*`, fedprism.systems, docs/systems.md): who of a round's
cohort is online, which uploads arrive before the deadline, the simulated clock, and FedBuff's buffered
asynchronous server steps. `Experiment.train_round` calls `SystemRun` only when a `system.*` key is set, so
every other run takes the code path it always took.

Round metrics (only under `system.*`): `unavailable` (sampled clients offline), `late` (uploads past the
deadline, discarded), `sim_time` (the round's simulated seconds) and `sim_clock` (simulated seconds since
the start, at the end of the round); FedBuff adds `stale_max` and `stale_mean` (server steps between a
buffered update's start and its use). The final metrics hold `sim_clock` (the run's simulated time) and
the totals of `unavailable` and `late`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fedprism.errors import ConfigError
from fedprism.protocol import Plan, Update
from fedprism.systems import SystemModel, staleness_weight, system_model


@dataclass
class Flight:
    """A client training under FedBuff: who, from which server step's model, when it started and arrives."""

    client: int
    version: int
    start: float
    finish: float
    seq: int                            # start order (ties at one instant are taken in it)
    row: dict                           # its plan row, [1, ...] tensors, as sent
    down: int                           # bytes of that row


@dataclass
class SystemRun:
    """The systems side of one run: the model (availability, speeds) and what carries over rounds (the
    simulated clock; under FedBuff the clients in flight and the updates waiting for a buffer)."""

    model: SystemModel
    flower: bool = False                # on Flower: availability and the deadline (real seconds) only
    clock: float = 0.0
    flights: list[Flight] = field(default_factory=list)
    queue: list[Flight] = field(default_factory=list)
    started_at: dict[int, int] = field(default_factory=dict)
    seq: int = 0

    # -- checkpoint --------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        def flat(fs: list[Flight]) -> list[dict]:
            return [{"client": f.client, "version": f.version, "start": f.start, "finish": f.finish, "seq": f.seq,
                     "row": f.row, "down": f.down} for f in fs]
        return {"clock": self.clock, "flights": flat(self.flights), "queue": flat(self.queue),
                "started_at": dict(self.started_at), "seq": self.seq}

    def restore(self, snap: dict | None) -> None:
        """Bring the run to a checkpoint's `system` entry (None: a fresh start)."""
        if snap is None:
            self.clock, self.flights, self.queue, self.started_at, self.seq = 0.0, [], [], {}, 0
            return
        self.clock = float(snap["clock"])
        self.flights = [Flight(**f) for f in snap["flights"]]
        self.queue = [Flight(**f) for f in snap["queue"]]
        self.started_at = {int(k): int(v) for k, v in snap["started_at"].items()}
        self.seq = int(snap["seq"])

    # -- synchronous rounds ------------------------------------------------------------------------
    def online(self, r, plan: Plan) -> Plan:
        """The plan without the clients that are offline in round r (record `unavailable`)."""
        on = self.model.online(r.index, plan.clients)
        r.metrics["unavailable"] = int((~on).sum())
        if on.all():
            return plan
        r.records.append(("unavailable", None, {"clients": plan.clients[~on].tolist()}))
        return plan.subset(np.flatnonzero(on))

    def deadline(self, exp, r, plan: Plan, update: Update) -> Update:
        """The uploads that arrived by the deadline (the late ones discarded, record `late`), and the round's
        simulated time (`sim_time`, `sim_clock`)."""
        m = self.model
        if self.flower:        # real time: a node past the deadline is a `failure` ("no reply within D s")
            return update
        if not m.timed:
            r.metrics["late"] = 0
            return update
        pos = {int(c): i for i, c in enumerate(plan.clients)}
        algo = exp.algo
        times = []
        for i, c in enumerate(update.clients):
            row = plan.subset(np.array([pos[int(c)]]))
            up = {k: v[i:i + 1] for k, v in update.payload.items()}
            times.append(m.duration(int(c), algo.wire_bytes("plan", row.payload), algo.wire_bytes("update", up)))
        times = np.asarray(times, dtype=np.float64)
        late = times > m.deadline if m.deadline > 0 else np.zeros(len(times), dtype=bool)
        if late.any():
            r.records.append(("late", None, {"clients": update.clients[late].tolist(),
                                             "times": [round(float(v), 6) for v in times[late]],
                                             "deadline": m.deadline}))
            update = update.select(~late)
            took = m.deadline
        elif len(times):
            took = float(times.max())
        else:
            took = m.deadline
        r.metrics["late"] = int(late.sum())
        self.tick(r, took)
        return update

    def tick(self, r, seconds: float) -> None:
        self.clock += seconds
        r.metrics["sim_time"] = seconds
        r.metrics["sim_clock"] = self.clock

    # -- FedBuff -----------------------------------------------------------------------------------
    def fedbuff_round(self, exp, r, loop, selector) -> tuple[Plan, Update]:
        """One FedBuff server step (module docstring of fedprism.systems): start clients up to the
        concurrency, take arrivals in time order until the buffer holds K, train them from the rows they were
        sent, weigh each by its staleness and aggregate. Returns (the rows sent this step, the update used)."""
        from fedprism.experiment.runner import aggregate_records, receive

        t, state, algo, m = r.index, loop.state, exp.algo, self.model
        start_clock = self.clock
        m_t = selector.m
        C = m.concurrency or m_t
        K = m.buffer or m_t
        cohort = [int(c) for c in selector.select(t)[0]]
        sent: list[Plan] = []
        fills = [0]

        def fill() -> None:
            busy = {f.client for f in self.flights} | {f.client for f in self.queue}
            need = C - len(self.flights)
            if need <= 0:
                return
            free = [c for c in range(algo.ctx.num_clients)
                    if c not in busy and self.started_at.get(c) != t and m.available[t, c]
                    and (getattr(exp, "unseen", None) is None or not exp.unseen[c])]
            first = [c for c in cohort if c in set(free)][:need]
            rest = sorted(set(free) - set(first))
            if len(first) < need and rest:
                rng = np.random.default_rng([algo.ctx.seed, t, 0xFB0F, fills[0]])
                first += sorted(int(c) for c in rng.choice(rest, size=min(need - len(first), len(rest)),
                                                           replace=False))
            fills[0] += 1
            if not first:
                return
            plan = algo.plan(state, t, np.asarray(first, dtype=np.int64))
            sent.append(plan)
            up = upload_bytes(exp)
            for i, c in enumerate(plan.clients.tolist()):
                row = plan.subset(np.array([i]))
                down = algo.wire_bytes("plan", row.payload)
                self.flights.append(Flight(int(c), t, self.clock, self.clock + m.duration(c, down, up), self.seq,
                                           row.payload, down))
                self.started_at[int(c)] = t
                self.seq += 1

        fill()
        buffer = self.take(K)
        while len(buffer) < K and self.flights:
            now = min(f.finish for f in self.flights)
            group = sorted((f for f in self.flights if f.finish == now), key=lambda f: f.seq)
            self.flights = [f for f in self.flights if f.finish != now]
            self.clock = now
            self.queue += group
            buffer += self.take(K - len(buffer))
            if len(buffer) < K:
                fill()
        t_train = time.time()
        update, failed, rejected = self.train_buffer(exp, buffer)
        r.metrics["train_s"] = time.time() - t_train
        stale = [t - f.version for f in buffer]
        if len(update.clients):
            update = self.weigh(exp, state, t, update, {f.client: f.version for f in buffer})
        update.rejected = {**failed, **rejected}
        loop.seen[update.clients] = True
        recs = aggregate_records(algo, state, t, update)
        r.records += [("failure", c, {"reason": why}) for c, why in failed.items()]
        r.records += [("rejected", c, {"reason": why}) for c, why in rejected.items()]
        r.records += [(k, None, v) for k, v in recs.items()]
        r.records.append(("fedbuff", None, {"clients": [f.client for f in buffer], "staleness": stale,
                                            "arrived": [round(f.finish, 6) for f in buffer]}))
        if t == 0:
            r.records += selector.records()
        r.metrics["unavailable"] = int((~m.available[t][cohort]).sum()) if cohort else 0
        r.metrics["late"] = 0
        r.metrics["stale_max"] = max(stale) if stale else 0
        r.metrics["stale_mean"] = float(np.mean(stale)) if stale else 0.0
        took, self.clock = self.clock - start_clock, start_clock
        self.tick(r, took)
        if not sent:
            return Plan(np.zeros(0, dtype=np.int64), {k: v[:0] for k, v in buffer[0].row.items()} if buffer else {}), update
        return Plan(np.concatenate([p.clients for p in sent]),
                    {k: torch.cat([p.payload[k] for p in sent]) for k in sent[0].payload}), update

    def take(self, k: int) -> list[Flight]:
        got, self.queue = self.queue[:k], self.queue[k:]
        return got

    def train_buffer(self, exp, buffer: list[Flight]) -> tuple[Update, dict, dict]:
        """Train the buffered clients from the rows they were sent, grouped by the server step they started
        at (its number names their random streams, as a synchronous round's does)."""
        from fedprism.experiment.failures import stop_on_failure
        from fedprism.experiment.runner import receive

        name = type(exp.algo).__name__
        parts, failed, rejected = [], {}, {}
        for v in sorted({f.version for f in buffer}):
            fs = [f for f in buffer if f.version == v]
            rows = {k: torch.cat([f.row[k] for f in fs]) for k in fs[0].row}
            plan = Plan(np.asarray([f.client for f in fs], dtype=np.int64), rows)
            up, bad = exp.local_work(plan, v)
            stop_on_failure(exp.cfg, bad, v)
            failed.update(bad)
            up, rej = receive(up, plan, exp.clients, exp.upload, name)
            rejected.update(rej)
            if len(up.clients):
                parts.append(up)
        if not parts:
            empty = Plan(np.zeros(0, dtype=np.int64), {k: v[:0] for k, v in buffer[0].row.items()}) if buffer else None
            return (receive(None, empty, None, {}, name)[0] if empty is not None else
                    Update(np.zeros(0, dtype=np.int64))), failed, rejected
        return (Update.concat(parts) if len(parts) > 1 else parts[0]), failed, rejected

    def weigh(self, exp, state: dict, t: int, update: Update, version: dict[int, int]) -> Update:
        """Each update relative to the current model: x' = w_now + eta_g s(tau) (x - x_sent); a fresh update
        with eta_g s(0) = 1 stays as it is. `sent` becomes the current rows."""
        m = self.model
        factors = [m.server_lr * staleness_weight(t - version[int(c)], m.staleness) for c in update.clients]
        fresh = [t == version[int(c)] and f == 1.0 for c, f in zip(update.clients, factors)]
        if all(fresh):
            return update
        now = exp.algo.plan(state, t, update.clients).payload["params"]
        x, sent = update.payload["params"], update.sent["params"]
        out = x.clone()
        for i, (f, ok) in enumerate(zip(factors, fresh)):
            if not ok:
                out[i] = (now[i].to(torch.float64) + f * (x[i].to(torch.float64) - sent[i].to(torch.float64))
                          ).to(x.dtype)
        update.payload = {**update.payload, "params": out}
        update.sent = {**update.sent, "params": now}
        return update


def upload_bytes(exp) -> int:
    """Bytes of one client's upload as declared (`Algorithm.upload`: shapes and dtypes); the arrival time of
    a FedBuff client is known when it starts."""
    total = 0
    for spec in exp.upload.values():
        total += int(math.prod(spec.shape)) * torch.empty(0, dtype=spec.dtype).element_size()
    return total


def system_run(cfg, ctx, algo, flower: bool = False) -> SystemRun | None:
    """The run's `SystemRun` (None without `system.*` keys); ConfigError for what the run cannot simulate."""
    model = system_model(cfg, ctx.n_train)
    if model is None:
        return None
    if flower:
        for key, default in (("system.async", "none"), ("system.speeds", "none")):
            if cfg[key] != default:
                raise ConfigError(key, cfg[key], f"{default} on Flower: the nodes train at their own speeds and "
                                  "answer in real time (system.deadline is a real timeout there)")
    elif model.deadline > 0 and not model.timed:
        raise ConfigError("system.deadline", model.deadline, "0 unless system.speeds is set (system.speeds=equal, "
                          "lognormal or a .csv / .json file of per-client speeds; docs/systems.md): in process a "
                          "deadline is in simulated seconds, which come from the clients' speeds (on Flower it is "
                          "a real timeout)")
    if model.fedbuff:
        algo.sum_weighting(algo.hp, "system.async=fedbuff")
        if set(algo.upload()) != {"params"}:
            raise ConfigError("system.async", "fedbuff", f"none for method={cfg['method']}: FedBuff weighs a "
                              "client's model update, and its upload is not one model")
        if algo.own_cohort:
            raise ConfigError("system.async", "fedbuff", f"none for method={cfg['method']}, which draws its own "
                              "cohort")
        if cfg.get("drift.fraction", 0.0):
            raise ConfigError("drift.fraction", cfg["drift.fraction"], "0 with system.async=fedbuff: a client "
                              "trains on the data of the step it started at, and drift changes the data by round")
    return SystemRun(model, flower)


def final_system_metrics(history: list[dict]) -> dict[str, Any]:
    """`sim_clock` of the last round and the totals of `unavailable` and `late` (empty without them)."""
    out: dict[str, Any] = {}
    clocks = [h["sim_clock"] for h in history if "sim_clock" in h]
    if clocks:
        out["sim_clock"] = clocks[-1]
    for k in ("unavailable", "late"):
        if any(k in h for h in history):
            out[k] = int(sum(h.get(k, 0) for h in history))
    return out
