"""The keys that tell runs of one name apart, for lines that name runs: a sweep's progress lines and
`fedprism runs`.

A sweep over `partition.alpha = [0.1, 0.5]` has two runs labelled "FedAvg" for each seed; "[1/4] FedAvg
seed=0" and "[3/4] FedAvg seed=0" would read the same. `tell_apart` gives each run the keys whose values
differ among the runs that share its name ("partition.alpha=0.1"), so the lines read "[1/4] FedAvg
partition.alpha=0.1 seed=0" and "[3/4] FedAvg partition.alpha=0.5 seed=0". The seed is shown on its own
and never counted; execution-only keys (`config.EXECUTION_KEYS`: threads, device, the name itself...)
never tell two runs apart. Runs whose names are unique get no keys: their lines stay as they were.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from fedprism.experiment.config import EXECUTION_KEYS

#: never listed: shown on its own (the seed) or not part of what a run computes
IGNORED = EXECUTION_KEYS | {"seed"}


def fmt(value: Any) -> str:
    """A key's value as a `key=value` override writes it: 0.1, true, kmeans."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def differing_keys(cfgs: Sequence[Mapping[str, Any]]) -> list[str]:
    """The keys (sorted) whose values differ among `cfgs`, a key missing from some counting as a value of
    its own; `IGNORED` keys left out."""
    keys = {k for c in cfgs for k in c} - IGNORED
    return sorted(k for k in keys
                  if len({json.dumps(c.get(k), sort_keys=True, default=str) for c in cfgs}) > 1)


def tell_apart(cfgs: Sequence[Mapping[str, Any]], names: Sequence[Any] | None = None) -> list[str]:
    """For each of `cfgs` (in order): "key=value ..." of the keys that differ among the configs sharing its
    name (`names[i]`, default each config's `name`; `differing_keys`), or "" when it shares its name with
    none or they differ only in the seed."""
    groups: dict[Any, list[int]] = defaultdict(list)
    for i, c in enumerate(cfgs):
        groups[c.get("name") if names is None else names[i]].append(i)
    out = [""] * len(cfgs)
    for members in groups.values():
        keys = differing_keys([cfgs[i] for i in members]) if len(members) > 1 else []
        for i in members:
            out[i] = " ".join(f"{k}={fmt(cfgs[i][k])}" for k in keys if k in cfgs[i])
    return out
