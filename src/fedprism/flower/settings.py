"""Run-config and node-config keys of the Flower apps, validated like every other fedprism key.

No Flower import here: the keys are plain values (Flower's `[tool.flwr.app.config]`, `flwr run -c`,
and `flower-supernode --node-config` deliver int / float / str / bool).

Run config (the same on the ServerApp and every ClientApp of a run):

    experiment          the fedprism experiment, as on the `fedprism run` command line:
                        "method=fedprism dataset=digits clients=6 fraction=0.5 rounds=3 fedprism.k=2"
                        (an optional first word without `=` names a TOML file, as in `fedprism run`)
    db                  results store (server side; use an absolute path in a deployment)
    min-nodes           identified nodes to wait for before round 0
    nodes-timeout       deadline in seconds for `min-nodes` (the run fails with a clear error after it)
    min-replies         successful train replies a round needs; fewer: the round's update is skipped
    round-timeout       deadline in seconds for the replies of one train or evaluate exchange
    poll-interval       seconds between two pulls of replies
    probe-timeout       an identity query lives 2 x probe-timeout s (then it is sent again); a refused
                        node is asked again after probe-timeout s
    save-final          optional path: torch.save of the final server state (all models), server side
    stop-after          stop after this many rounds (0: run to the end); the next run resumes

  Trust (docs/flower.md, "Trust and failure semantics"):

    max-samples         cap on the sample counts a node reports (identity `num-examples`, train-reply
                        `n_samples`); 0: the largest training split the experiment's partition gives a
                        client (the server builds the partition when it can read the dataset)
    update-norm-bound   0: off; else the largest accepted norm of an update (upload minus what was sent)
    norm-action         what happens to an update above the bound: reject (the client's round is refused)
                        or clip (scaled to the bound); recorded either way
    registry            optional JSON or TOML file written by the operator: node key -> client id (and
                        optionally its sample count); a node may only claim its registered client id
    stats-epsilon       0: nodes report exact label counts; > 0: each node releases its label histogram once
                        with epsilon-DP (Laplace noise, kept in its Context.state and reused), and that
                        total as its sample count in identity and train replies
    global-eval         server: the server scores the global test set itself (methods whose inference is
                        the server's model, when the server can build the dataset); nodes: the nodes do

Node config (per SuperNode, `--node-config 'client-id=3 data-root="/data"'`):

    client-id           this node's persistent client id, 0 <= id < clients (simulation: partition-id)
    data-root           where this node's dataset files are (overrides the experiment's data.root)
    device              cpu or cuda for this node's local training (overrides the experiment's device)
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fedprism.errors import ConfigError
from fedprism.experiment.config import Config, load_toml, parse_overrides, resolve
from fedprism.experiment.flower_id import IDENTITY_KEYS, IDENTITY_PARAMS, flower_run_id  # noqa: F401
from fedprism.experiment.limits import check_cohort
from fedprism.hparams import Param

_pos = lambda v: v > 0  # noqa: E731
_finite_pos = lambda v: v > 0 and math.isfinite(v)  # noqa: E731

#: ServerApp / ClientApp run-config keys (the ones a run's id hashes, `IDENTITY_KEYS`, are defined with
#: `flower_run_id` in `fedprism.experiment.flower_id`: the store merge checks Flower run ids too)
RUN_KEYS: dict[str, Param] = {
    "experiment": Param("method=fedprism dataset=digits clients=6 fraction=0.5 rounds=3 fedprism.k=3",
                        "the fedprism experiment (key=value pairs, as `fedprism run` takes them)"),
    "db": Param("fedprism-results.db", "results store (SQLite) written by the ServerApp"),
    "min-nodes": Param(1, "identified nodes to wait for before round 0", _pos, "an integer >= 1"),
    "nodes-timeout": Param(300.0, "deadline (s) to reach min-nodes", _finite_pos, "a number > 0"),
    "min-replies": IDENTITY_PARAMS["min-replies"],
    "round-timeout": Param(300.0, "deadline (s) for the replies of one exchange", _finite_pos, "a number > 0"),
    "poll-interval": Param(0.5, "seconds between pulls of replies", _finite_pos, "a number > 0"),
    "probe-timeout": Param(60.0, "identity queries live 2x this long; a refused node is asked again after it",
                           _finite_pos,
                           "a number > 0"),
    "save-final": Param("", "path for torch.save of the final server state ('' = do not save)"),
    "stop-after": Param(0, "stop after this many rounds (0 = run to the end)", lambda v: v >= 0,
                        "an integer >= 0"),
    "max-samples": IDENTITY_PARAMS["max-samples"],
    "update-norm-bound": IDENTITY_PARAMS["update-norm-bound"],
    "norm-action": IDENTITY_PARAMS["norm-action"],
    "registry": IDENTITY_PARAMS["registry"],
    "stats-epsilon": IDENTITY_PARAMS["stats-epsilon"],
    "global-eval": IDENTITY_PARAMS["global-eval"],
    "secagg": IDENTITY_PARAMS["secagg"],
    "secagg-clip": IDENTITY_PARAMS["secagg-clip"],
    "secagg-shares": Param(1.0, "SecAgg+: shares of each node's secret, as a fraction of the round's nodes",
                           lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "secagg-threshold": Param(0.7, "SecAgg+: shares needed to reconstruct a secret, as a fraction of the shares",
                              lambda v: 0 < v <= 1, "a number in (0, 1]"),
}

#: SuperNode node-config keys (Flower's simulation adds partition-id / num-partitions)
NODE_KEYS = ("client-id", "partition-id", "num-partitions", "data-root", "device")


def parse_experiment(text: str, **overrides: Any) -> Config:
    """The experiment string -> a validated fedprism Config (same syntax as `fedprism run`)."""
    if not isinstance(text, str) or not text.strip():
        raise ConfigError("experiment", text, "a non-empty string of key=value pairs, e.g. 'method=fedprism clients=6'")
    items = shlex.split(text)
    raw: dict[str, Any] = {}
    if items and "=" not in items[0]:
        raw.update(load_toml(items.pop(0)))
    raw.update(parse_overrides(items))
    raw.update({k: v for k, v in overrides.items() if v is not None})
    for key in ("train.kernels", "eval.kernels"):   # the server cannot know which nodes have the fused kernels
        if raw.get(key, "auto") == "auto":          # built: `auto` is PyTorch's on Flower (`fused` asks for them)
            raw[key] = "aten"
    return resolve(raw)


@dataclass(frozen=True)
class RunSettings:
    """The validated run config: the experiment plus the Flower-side knobs."""

    cfg: Config
    db: str
    min_nodes: int
    nodes_timeout: float
    min_replies: int
    round_timeout: float
    poll_interval: float
    probe_timeout: float
    save_final: str
    stop_after: int
    max_samples: int = 0
    update_norm_bound: float = 0.0
    norm_action: str = "reject"
    registry: str = ""
    global_eval: str = "server"
    stats_epsilon: float = 0.0
    secagg: str = "none"
    secagg_clip: float = 8.0
    secagg_shares: float = 1.0
    secagg_threshold: float = 0.7

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> RunSettings:
        unknown = sorted(set(run_config) - set(RUN_KEYS))
        if unknown:
            raise ConfigError(unknown[0], run_config[unknown[0]],
                              f"unknown run-config key; known: {', '.join(RUN_KEYS)}")
        v = {k: (p.validate(k, run_config[k]) if k in run_config else p.default) for k, p in RUN_KEYS.items()}
        cfg = parse_experiment(v["experiment"])
        if v["min-replies"] > cfg["clients"]:
            raise ConfigError("min-replies", v["min-replies"], f"an integer in [1, clients={cfg['clients']}]")
        if v["min-nodes"] > cfg["clients"]:
            raise ConfigError("min-nodes", v["min-nodes"], f"an integer in [1, clients={cfg['clients']}]")
        if v["stats-epsilon"] > 0 and cfg.get("privacy.epsilon", 0.0) > 0:
            raise ConfigError("stats-epsilon", v["stats-epsilon"], "0 when the experiment sets privacy.epsilon "
                              "(the label counts are then released once, with the run's Gaussian mechanism)")
        check_cohort(cfg)                       # what needs no data: before any SuperLink or node starts
        check_flower_config(cfg)
        return cls(cfg=cfg, db=v["db"], min_nodes=v["min-nodes"], nodes_timeout=v["nodes-timeout"],
                   min_replies=v["min-replies"], round_timeout=v["round-timeout"],
                   poll_interval=v["poll-interval"], probe_timeout=v["probe-timeout"],
                   save_final=v["save-final"], stop_after=v["stop-after"], max_samples=v["max-samples"],
                   update_norm_bound=v["update-norm-bound"], norm_action=v["norm-action"],
                   registry=v["registry"], global_eval=v["global-eval"],
                   stats_epsilon=v["stats-epsilon"], secagg=v["secagg"], secagg_clip=v["secagg-clip"],
                   secagg_shares=v["secagg-shares"], secagg_threshold=v["secagg-threshold"])

    def knobs(self, keys: tuple[str, ...] = IDENTITY_KEYS) -> dict[str, Any]:
        """This run's values of the run-config keys `keys` (run-config names)."""
        return {k: getattr(self, k.replace("-", "_")) for k in keys}

    @property
    def run_id(self) -> str:
        return flower_run_id(self.cfg, self.knobs())


def check_flower_config(cfg: Config) -> None:
    """Experiment settings a Flower run cannot honour, refused from the experiment alone (before any
    SuperLink, Ray or node starts)."""
    from fedprism.algorithms import REGISTRY

    why = getattr(REGISTRY.find(cfg["method"]), "simulation_only", "")
    if why:
        raise ConfigError("method", cfg["method"], f"a method that runs on Flower: {cfg['method']} runs "
                          f"in the simulator only ({why})")
    if cfg.get("eval.clients", 0):
        raise ConfigError("eval.clients", cfg["eval.clients"], "0 on Flower: every connected node scores "
                          "its client at each evaluation (sampled evaluation is simulated in process only)")
    if cfg.get("state.storage", "memory") != "memory":
        raise ConfigError("state.storage", cfg["state.storage"], "memory on Flower: each node keeps its own "
                          "client's rows in its Context.state")
    if cfg.get("eval.gate", "none") != "none":
        raise ConfigError("eval.gate", cfg["eval.gate"], "none on Flower: the gate is fitted on every "
                          "client's stream outputs in one process (in-process runs and re-scoring only)")
    if cfg.get("eval.finetune", 0):
        raise ConfigError("eval.finetune", cfg["eval.finetune"], "0 on Flower: a node scores the inference "
                          "it builds and has no fine-tuning step (in-process runs and re-scoring only)")
    if cfg.get("dp.local", "none") != "none":
        raise ConfigError("dp.local", cfg["dp.local"], "none on Flower: local DP-SGD (Opacus) runs in the "
                          "in-process simulator only, whose runner accounts each client's steps (a node's "
                          "steps do not reach the ServerApp); client-level DP (dp.clip) runs on Flower")
    if cfg.get("attack.fraction", 0.0):
        raise ConfigError("attack.fraction", cfg["attack.fraction"], "0 on Flower: simulated Byzantine clients "
                          "run in the in-process simulator; on Flower the Byzantine clients are the deployment's "
                          "own nodes")
    if cfg.get("data.unseen_clients", 0.0):
        raise ConfigError("data.unseen_clients", cfg["data.unseen_clients"], "0 on Flower: every connected "
                          "node is a client of the federation, and a held-out node would need the newcomer "
                          "evaluation, which the nodes do not run (in-process runs only)")


def client_id_of(node_config: Mapping[str, Any], num_clients: int) -> int:
    """The persistent client id a node stands for: `client-id`, else Flower simulation's `partition-id`."""
    key = "client-id" if "client-id" in node_config else "partition-id"
    if key not in node_config:
        raise ConfigError("client-id", None, "set on every SuperNode: --node-config 'client-id=<0..clients-1>'")
    cid = node_config[key]
    if isinstance(cid, str) and cid.strip().lstrip("-").isdigit():
        cid = int(cid)
    if isinstance(cid, bool) or not isinstance(cid, int) or not 0 <= cid < num_clients:
        raise ConfigError(key, cid, f"an integer in [0, {num_clients - 1}] (the experiment has {num_clients} clients)")
    return cid


def flower_label(cfg: Config) -> Config:
    """`cfg` labelled for reports: `<method> (flower)` unless the experiment names itself."""
    return cfg if cfg.get("name") else cfg.with_(name=f"{cfg['method']} (flower)")


OFFLINE_ENV = {
    "FLWR_TELEMETRY_ENABLED": "0",      # Flower's telemetry is on by default
    "FLWR_DISABLE_UPDATE_CHECK": "1",   # and so is its update check (network)
    "RAY_USAGE_STATS_ENABLED": "0",     # Ray's usage statistics
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_OFFLINE": "1",
}
