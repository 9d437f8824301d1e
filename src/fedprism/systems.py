"""Systems realism in simulation: which clients are online, how fast they are, round deadlines and
buffered asynchronous aggregation (`system.*` keys; docs/systems.md).

Every default leaves a run as it was (no key reaches the run id at its default, no metric is added): the
simulated clock exists only when a key asks for it.

* **Availability** (`system.availability`): `always` (default); `bernoulli`, each client online in each
  round with probability p (`system.availability.p`), independently; `markov`, a two-state on/off chain
  per client with stationary probability p and lag-one correlation rho (`system.availability.corr`):
  P(on -> off) = (1 - p)(1 - rho), P(off -> on) = p (1 - rho), the first round drawn from the stationary
  law (rho = 0 is `bernoulli`); or a file (`.csv` or `.json`, below). A sampled client that is offline in
  a round does not receive the plan, does not train and is recorded (`unavailable`). The trace is a pure
  function of (seed, clients, rounds), drawn once for the whole run.
* **Speeds** (`system.speeds`): `none` (default: no simulated clock), `equal` (every client at
  `system.compute` samples per second and `system.bandwidth` bytes per second), `lognormal` (each client's
  two speeds are those medians times exp(sigma Z), Z standard normal, sigma = `system.sigma`, seeded by
  the run seed only, as HACCS's latencies are), or a file. A client's simulated time in a round is

      T_k = E n_k / compute_k + (down_k + up_k) / bandwidth_k

  with E the local epochs, n_k its training samples, down_k and up_k the bytes of its plan row and of its
  upload as they travel (`Algorithm.wire_bytes`).
* **Deadline** (`system.deadline` = D seconds, 0 = none; needs speeds): the uploads of clients with
  T_k > D are discarded (record `late`; the client trained and keeps its own state, as a real straggler
  would); the server aggregates those that arrived. The round takes max T_k over the clients that took part
  without a deadline, and min(D, max T_k) with one; a round with nobody online takes D (0 without one).
* **FedBuff** (`system.async = fedbuff`; Nguyen et al. 2022, "Federated Learning with Buffered
  Asynchronous Aggregation", arXiv:2106.06639, Algorithm 1): `system.concurrency` clients train at once
  (0: the cohort size m), each from the model of the moment it started; the server takes their updates in
  the order they arrive and, once the buffer holds `system.buffer` = K of them (0: m), makes one server
  step: update i of staleness tau_i (server steps since it started) enters as

      x_i' = w + eta_g s(tau_i) (x_i - x_i^sent),     s(tau) = 1 / sqrt(1 + tau)  (`system.staleness=sqrt`)

  and the method aggregates the rows x_i' as it aggregates fresh ones (FedAvg: w + eta_g sum_i p_i s(tau_i)
  Delta_i, the paper's server step with p_i = 1/K under `fedavg.weighting=uniform`); eta_g =
  `system.server_lr`. A run's round is one server step. Decisions where the paper is silent: which
  clients start (the selection rule's cohort of the current server step first, then a seeded uniform draw
  among the idle online clients; a client starts at most once per server step); updates arriving at the
  same simulated instant are taken together, in the order they started, before anyone new starts, so that
  with equal client times, K = concurrency = m and no staleness FedBuff is FedAvg bit for bit (a fresh
  update with eta_g s(0) = 1 is used as it is, not rewritten as w + (x - w)).

Files. Availability: a CSV of one line per client (client 0 first) of 0/1 values, one per round, no
header, or JSON `{"available": [[0, 1, ...], ...]}`; a trace shorter than the run repeats (round t reads
column t mod R). Speeds: a CSV with the header `client,compute,bandwidth` and one line per client, or JSON
`{"compute": [...], "bandwidth": [...]}`; every value a finite number > 0. A file's sha256 is part of the
run id (`system.files`, filled in when the configuration is resolved), so editing it makes another run.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

from fedprism.errors import ConfigError
from fedprism.hparams import Param

AVAILABILITY = ("always", "bernoulli", "markov")
SPEEDS = ("none", "equal", "lognormal")
ASYNC = ("none", "fedbuff")
STALENESS = ("sqrt", "none")


class _NameOrFile(Param):
    """One of `choices`, or the path of a `.csv` / `.json` file that exists."""

    def validate(self, key: str, value: Any) -> Any:
        if value in self.choices:
            return value
        if isinstance(value, str) and value.lower().endswith((".csv", ".json")):
            if not Path(value).is_file():
                raise ConfigError(key, value, f"one of {', '.join(self.choices)}, or an existing .csv or .json "
                                  f"file (no file at {value})")
            return value
        raise ConfigError(key, value, f"one of {', '.join(self.choices)}, or the path of a .csv or .json file")


_unit_open = lambda v: 0 <= v < 1  # noqa: E731
_pos = lambda v: v > 0 and math.isfinite(v)  # noqa: E731
_nonneg = lambda v: v >= 0 and math.isfinite(v)  # noqa: E731

#: the experiment keys of this module (merged into `fedprism.experiment.config.KEYS`); all `new=True`, so
#: a run without them keeps its id
SYSTEM_KEYS: dict[str, Param] = {
    "system.availability": _NameOrFile("always", "which clients are online in each round: always, bernoulli "
                                       "(each with probability system.availability.p), markov (on/off chain) or a "
                                       ".csv / .json trace (docs/systems.md)", choices=AVAILABILITY, new=True),
    "system.availability.p": Param(0.7, "bernoulli / markov: probability that a client is online in a round",
                                   lambda v: 0 < v <= 1, "a number in (0, 1]", new=True),
    "system.availability.corr": Param(0.5, "markov: lag-one correlation of a client's availability (0: bernoulli)",
                                      _unit_open, "a number in [0, 1)", new=True),
    "system.speeds": _NameOrFile("none", "per-client compute and network speeds for the simulated clock: none "
                                 "(no clock), equal, lognormal (medians system.compute / system.bandwidth, spread "
                                 "system.sigma) or a .csv / .json file", choices=SPEEDS, new=True),
    "system.compute": Param(100.0, "median training speed in samples per second", _pos, "a finite number > 0",
                            new=True),
    "system.bandwidth": Param(1e6, "median network speed in bytes per second", _pos, "a finite number > 0",
                              new=True),
    "system.sigma": Param(1.0, "lognormal: standard deviation of log speed", _nonneg, "a finite number >= 0",
                          new=True),
    "system.deadline": Param(0.0, "round deadline in simulated seconds: later uploads are discarded (0: none)",
                             _nonneg, "a finite number >= 0 (0: no deadline)", new=True),
    "system.async": Param("none", "none (synchronous rounds) or fedbuff (buffered asynchronous aggregation)",
                          choices=ASYNC, new=True),
    "system.buffer": Param(0, "fedbuff: updates K per server step (0: the cohort size)", lambda v: v >= 0,
                           "an integer >= 0 (0: the cohort size)", new=True),
    "system.concurrency": Param(0, "fedbuff: clients training at once (0: the cohort size)", lambda v: v >= 0,
                                "an integer >= 0 (0: the cohort size)", new=True),
    "system.staleness": Param("sqrt", "fedbuff: staleness weight s(tau), sqrt: 1/sqrt(1+tau), none: 1",
                              choices=STALENESS, new=True),
    "system.server_lr": Param(1.0, "fedbuff: server learning rate eta_g", _pos, "a finite number > 0", new=True),
    "system.files": Param("", "sha256 of the availability and speed files (filled in when resolved)",
                          lambda v: v == "" or all(re.fullmatch(r"(availability|speeds):[0-9a-f]{64}", part)
                                                   for part in v.split()),
                          "'' or the files' sha256 as resolved ('availability:<hex> speeds:<hex>')", new=True),
}


def _sha(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _files(out: dict[str, Any]) -> str:
    parts = [f"{k.split('.')[1]}:{_sha(out[k])}" for k in ("system.availability", "system.speeds")
             if out[k] not in AVAILABILITY + SPEEDS]
    return " ".join(parts)


def check_system(out: dict[str, Any]) -> None:
    """Cross-key checks of the resolved `system.*` keys (ConfigError naming the key), the files read and
    validated, and `system.files` set to their sha256 (a stored configuration whose files changed is refused)."""
    n, rounds = out["clients"], out["rounds"]
    if out["system.availability"] not in AVAILABILITY:
        load_availability(out["system.availability"], n)
    if out["system.speeds"] not in SPEEDS:
        load_speeds(out["system.speeds"], n)
    files = _files(out)
    if out["system.files"] and out["system.files"] != files:
        raise ConfigError("system.files", out["system.files"], f"{files or '(no file)'}: the sha256 of the files "
                          "this configuration names now; a file changed since the run was configured (a changed "
                          "trace is another run: leave system.files out)")
    out["system.files"] = files
    for key, needs, ok in (("system.availability.p", "system.availability", ("bernoulli", "markov")),
                           ("system.availability.corr", "system.availability", ("markov",)),
                           ("system.compute", "system.speeds", ("equal", "lognormal")),
                           ("system.bandwidth", "system.speeds", ("equal", "lognormal")),
                           ("system.sigma", "system.speeds", ("lognormal",))):
        if out[key] != SYSTEM_KEYS[key].default and out[needs] not in ok:
            raise ConfigError(key, out[key], f"its default {SYSTEM_KEYS[key].default} unless {needs} is "
                              f"{' or '.join(ok)} ({needs}={out[needs]} does not read it)")
    if out["system.async"] == "fedbuff":
        if out["system.speeds"] == "none":
            raise ConfigError("system.async", "fedbuff", "none unless system.speeds is set (system.speeds="
                              "equal, lognormal or a .csv / .json file of per-client speeds; docs/systems.md): "
                              "FedBuff orders the updates by their simulated arrival times")
        if out["system.deadline"] > 0:
            raise ConfigError("system.deadline", out["system.deadline"], "0 with system.async=fedbuff: the server "
                              "waits for K updates, not for a round deadline")
        for key in ("system.buffer", "system.concurrency"):
            if out[key] > n:
                raise ConfigError(key, out[key], f"an integer in [0, clients={n}] (0: the cohort size)")
        if out["selection"] != "uniform":
            raise ConfigError("selection", out["selection"], "uniform with system.async=fedbuff: clients start "
                              "one by one as others finish")
    else:
        for key, default in (("system.buffer", 0), ("system.concurrency", 0), ("system.staleness", "sqrt"),
                             ("system.server_lr", 1.0)):
            if out[key] != default:
                raise ConfigError(key, out[key], f"{default} (its default) unless system.async=fedbuff")
    del rounds


def active(cfg: Any) -> bool:
    """True when any `system.*` key is away from its default (the run simulates systems)."""
    return any(cfg.get(k, p.default) != p.default for k, p in SYSTEM_KEYS.items() if k != "system.files")


# -- files --------------------------------------------------------------------------------------------
def _read(path: str, key: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(key, path, f"a readable UTF-8 .csv or .json file ({type(e).__name__}: {e})") from None


def load_availability(path: str, clients: int) -> np.ndarray:
    """[clients, R] bool from an availability file (module docstring); ConfigError naming the line and value."""
    import numpy as np
    key = "system.availability"
    text = _read(path, key)
    if path.lower().endswith(".json"):
        try:
            rows = json.loads(text)["available"]
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(key, path, f'a JSON object {{"available": [[0, 1, ...], ...]}} ({type(e).__name__}: '
                              f"{e})") from None
        where = "client"
    else:
        rows = [r for r in csv.reader(io.StringIO(text)) if any(c.strip() for c in r)]
        where = "line"
    if not isinstance(rows, list) or len(rows) != clients:
        got = len(rows) if isinstance(rows, list) else type(rows).__name__
        raise ConfigError(key, path, f"one row per client: {clients} rows (clients={clients}), got {got}")
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row, list) or not row:
            raise ConfigError(key, path, f"{where} {i + 1}: a non-empty list of 0/1 values, got {row!r:.60}")
        vals = []
        for j, v in enumerate(row):
            s = v.strip() if isinstance(v, str) else v
            if s in ("0", "1", 0, 1) and not isinstance(s, bool):
                vals.append(int(s))
            else:
                raise ConfigError(key, path, f"{where} {i + 1}, round {j}: 0 or 1, got {v!r:.40}")
        out.append(vals)
    if len({len(r) for r in out}) != 1:
        raise ConfigError(key, path, f"every client's row the same length (rounds of the trace), got lengths "
                          f"{sorted({len(r) for r in out})}")
    return np.asarray(out, dtype=bool)


def load_speeds(path: str, clients: int) -> tuple[np.ndarray, np.ndarray]:
    """(compute [N] samples/s, bandwidth [N] bytes/s) from a speeds file; ConfigError naming what is wrong."""
    import numpy as np
    key = "system.speeds"
    text = _read(path, key)
    if path.lower().endswith(".json"):
        try:
            d = json.loads(text)
            cols = {k: list(d[k]) for k in ("compute", "bandwidth")}
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(key, path, f'a JSON object {{"compute": [...], "bandwidth": [...]}} '
                              f"({type(e).__name__}: {e})") from None
        for k, v in cols.items():
            if len(v) != clients:
                raise ConfigError(key, path, f"{clients} values of {k!r} (one per client), got {len(v)}")
        comp, bw = cols["compute"], cols["bandwidth"]
    else:
        rows = [r for r in csv.reader(io.StringIO(text)) if any(c.strip() for c in r)]
        if not rows or [c.strip() for c in rows[0]] != ["client", "compute", "bandwidth"]:
            raise ConfigError(key, path, "a CSV whose first line is the header client,compute,bandwidth")
        comp, bw = [None] * clients, [None] * clients
        for i, r in enumerate(rows[1:], start=2):
            if len(r) != 3:
                raise ConfigError(key, path, f"line {i}: 3 values client,compute,bandwidth, got {len(r)}")
            try:
                c = int(r[0])
            except ValueError:
                raise ConfigError(key, path, f"line {i}: a client id, got {r[0]!r:.40}") from None
            if not 0 <= c < clients or comp[c] is not None:
                raise ConfigError(key, path, f"line {i}: client {c} is not a new client id in 0..{clients - 1}")
            comp[c], bw[c] = r[1], r[2]
        missing = [c for c in range(clients) if comp[c] is None]
        if missing:
            raise ConfigError(key, path, f"a line for every client; missing {missing[:5]}")
    out = []
    for name, vals in (("compute", comp), ("bandwidth", bw)):
        arr = []
        for c, v in enumerate(vals):
            try:
                x = float(v)
            except (TypeError, ValueError):
                x = float("nan")
            if isinstance(v, bool) or not (math.isfinite(x) and x > 0):
                raise ConfigError(key, path, f"client {c}: {name} a finite number > 0, got {v!r:.40}")
            arr.append(x)
        out.append(np.asarray(arr, dtype=np.float64))
    return out[0], out[1]


# -- the seeded draws -------------------------------------------------------------------------------
def availability_trace(kind: str, p: float, corr: float, seed: int, clients: int, rounds: int) -> np.ndarray:
    """[rounds, clients] bool: who is online in each round (module docstring), a pure function of its inputs."""
    import numpy as np
    if kind == "always":
        return np.ones((rounds, clients), dtype=bool)
    if kind not in AVAILABILITY:
        trace = load_availability(kind, clients)
        return trace[:, np.arange(rounds) % trace.shape[1]].T.copy()
    rng = np.random.default_rng([seed, 0xA7A1])
    u = rng.random((rounds, clients))
    if kind == "bernoulli" or corr == 0:
        return u < p
    off, on = (1 - p) * (1 - corr), p * (1 - corr)
    out = np.zeros((rounds, clients), dtype=bool)
    out[0] = u[0] < p
    for t in range(1, rounds):
        out[t] = np.where(out[t - 1], u[t] >= off, u[t] < on)
    return out


def client_speeds(kind: str, compute: float, bandwidth: float, sigma: float, seed: int,
                  clients: int) -> tuple[np.ndarray, np.ndarray]:
    """(compute [N], bandwidth [N]) of every client (module docstring), seeded by the run seed only."""
    import numpy as np
    if kind == "equal":
        return np.full(clients, float(compute)), np.full(clients, float(bandwidth))
    if kind == "lognormal":
        z = np.random.default_rng([seed, 0x5BED]).standard_normal((2, clients))
        return compute * np.exp(sigma * z[0]), bandwidth * np.exp(sigma * z[1])
    if kind == "none":
        raise ValueError("system.speeds=none has no speeds")
    return load_speeds(kind, clients)


def staleness_weight(tau: int, how: str) -> float:
    """s(tau): 1 / sqrt(1 + tau) (`sqrt`, FedBuff's choice) or 1 (`none`)."""
    if how == "none":
        return 1.0
    if how == "sqrt":
        return 1.0 / math.sqrt(1.0 + tau)
    raise ValueError(f"system.staleness must be one of {STALENESS}, got {how!r}")


@dataclass
class SystemModel:
    """The run's clients as systems: their availability in every round and their speeds."""

    available: np.ndarray               # [rounds, N] bool
    compute: np.ndarray | None          # [N] samples per second (None: no simulated clock)
    bandwidth: np.ndarray | None        # [N] bytes per second
    epochs: int
    n_train: np.ndarray                 # [N]
    deadline: float = 0.0
    fedbuff: bool = False
    buffer: int = 0
    concurrency: int = 0
    staleness: str = "sqrt"
    server_lr: float = 1.0
    files: str = ""

    @property
    def timed(self) -> bool:
        return self.compute is not None

    def online(self, rnd: int, clients: np.ndarray) -> np.ndarray:
        """bool [len(clients)]: which of `clients` are online in round `rnd`."""
        import numpy as np
        return self.available[rnd, np.asarray(clients, dtype=np.int64)]

    def duration(self, client: int, down: int, up: int) -> float:
        """T_k = E n_k / compute_k + (down + up) / bandwidth_k, simulated seconds."""
        c = int(client)
        return float(self.epochs * float(self.n_train[c]) / self.compute[c] + (down + up) / self.bandwidth[c])

    def records(self) -> list[tuple]:
        """Stored with round 0: the speeds and the files' sha256 (the trace is a function of the config)."""
        data: dict[str, Any] = {}
        if self.timed:
            data.update(compute=[round(float(v), 6) for v in self.compute],
                        bandwidth=[round(float(v), 3) for v in self.bandwidth])
        if self.files:
            data["files"] = self.files
        return [("system", None, data)] if data else []


def system_model(cfg: Any, n_train: np.ndarray) -> SystemModel | None:
    """The run's `SystemModel` from its configuration (None when no `system.*` key is set)."""
    import numpy as np
    if not active(cfg):
        return None
    n = cfg["clients"]
    avail = availability_trace(cfg["system.availability"], cfg["system.availability.p"],
                               cfg["system.availability.corr"], cfg["seed"], n, cfg["rounds"])
    comp = bw = None
    if cfg["system.speeds"] != "none":
        comp, bw = client_speeds(cfg["system.speeds"], cfg["system.compute"], cfg["system.bandwidth"],
                                 cfg["system.sigma"], cfg["seed"], n)
    return SystemModel(avail, comp, bw, int(cfg["local_epochs"]), np.asarray(n_train), float(cfg["system.deadline"]),
                       cfg["system.async"] == "fedbuff", int(cfg["system.buffer"]), int(cfg["system.concurrency"]),
                       cfg["system.staleness"], float(cfg["system.server_lr"]), cfg.get("system.files", ""))
