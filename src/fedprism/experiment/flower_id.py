"""The store id of a Flower run (`flower_run_id`) and the Flower run-config keys it hashes
(`IDENTITY_PARAMS`).

They live in the runs layer, beside `Config.run_id`, because both sides of a store need them: the Flower
apps (`fedprism.flower.settings`, which files a run under this id) and the store merge
(`fedprism.experiment.merge`, which accepts a Flower run from another store only when its id is the hash
of its stored configuration and the Flower settings its provenance records). No Flower import.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from typing import Any

from fedprism.experiment.config import Config
from fedprism.hparams import Param

#: run-config keys that change what a Flower run computes (which replies count, what the nodes report, who
#: scores the global test set): part of its run id whenever they are not at their defaults. The other
#: run-config keys are `fedprism.flower.settings.RUN_KEYS`, which holds these too.
IDENTITY_PARAMS: dict[str, Param] = {
    "min-replies": Param(1, "successful train replies a round needs", lambda v: v > 0, "an integer >= 1"),
    "max-samples": Param(0, "cap on a node's reported sample counts (0 = the largest training split the "
                         "partition gives a client)", lambda v: v >= 0, "an integer >= 0"),
    "update-norm-bound": Param(0.0, "largest accepted update norm (0 = no bound)",
                               lambda v: v >= 0 and math.isfinite(v), "a finite number >= 0"),
    "norm-action": Param("reject", "an update above update-norm-bound is rejected or clipped to it",
                         choices=("reject", "clip")),
    "registry": Param("", "JSON or TOML file: node key -> client id [, samples] ('' = no registry)"),
    "stats-epsilon": Param(0.0, "nodes release their label histogram (and so their sample count) with "
                           "epsilon-differential privacy (Laplace); 0 = exact", lambda v: v >= 0 and math.isfinite(v),
                           "a finite number >= 0"),
    "global-eval": Param("server", "who scores the global test set: the server (when it can build the "
                         "dataset) or the nodes", choices=("server", "nodes")),
    "secagg": Param("none", "secure aggregation of the uploads: none, or secaggplus (Flower's SecAgg+; methods "
                    "whose server needs only the sum of the uploads)", choices=("none", "secaggplus")),
    "secagg-clip": Param(8.0, "SecAgg+: clipping range of each update coordinate before quantisation",
                         lambda v: v > 0 and math.isfinite(v), "a finite number > 0"),
}
IDENTITY_KEYS = tuple(IDENTITY_PARAMS)


def flower_run_id(cfg: Config, run_config: Mapping[str, Any] | None = None) -> str:
    """Store id of a Flower run of `cfg` with the run-config `run_config`: stable (a restarted ServerApp
    resumes it), distinct from the in-process run of the same config (so both can live in one store and
    be compared), and distinct for each value of the `IDENTITY_KEYS` (a run with update-norm-bound=50 is
    not the finished run without it). Keys at their defaults leave the id as it was before they counted."""
    knobs = {k: IDENTITY_PARAMS[k].validate(k, run_config[k]) for k in IDENTITY_KEYS
             if run_config is not None and k in run_config}
    knobs = {k: v for k, v in knobs.items() if v != IDENTITY_PARAMS[k].default}
    tail = f":{json.dumps(knobs, sort_keys=True)}" if knobs else ""
    return hashlib.sha256(f"flower:{cfg.run_id}{tail}".encode()).hexdigest()[:16]
