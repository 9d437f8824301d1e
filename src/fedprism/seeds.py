"""Seeds of the random streams of a run, from (run seed, round, client, stream name) alone: independent of
the cohort, the engine and the process, so a client's batch order, dropout masks and privacy noise are the
same in the simulator, on a Flower node and after a resume.

It imports nothing of fedprism: the engine (batch orders, dropout), the privacy layer (noise of a release)
and the methods use it from below.
"""

from __future__ import annotations

import hashlib

import numpy as np


def client_seed(seed: int, rnd: int, client: int) -> int:
    """Seed of client `client`'s shuffling stream in round `rnd` (independent of cohort and engine)."""
    return int((seed * 1_000_003 + rnd * 7_919 + client * 104_729 + 17) % (2**62))


#: streams whose seeds predate named streams: their batch orders are those of the committed runs
#: (`fedprism_dual` trains its private components and specialists on 'private' and 'expert')
LEGACY_STREAMS = {"train": 0, "private": 1_000_000, "expert": 2_000_000}


def stream_seed(seed: int, rnd: int, client: int, stream: str = "train") -> int:
    """Seed of the batch order of `client` in round `rnd` on the named stream.

    Independent of the cohort and the engine. A new name gets its own stream from a hash of the name
    (SeedSequence of (seed, round, client, name hash)); the legacy names keep their historic formula."""
    if stream in LEGACY_STREAMS:
        return client_seed(seed, rnd + LEGACY_STREAMS[stream], client)
    h = int.from_bytes(hashlib.blake2b(stream.encode(), digest_size=8).digest(), "little")
    return int(np.random.SeedSequence([seed, rnd, client, h]).generate_state(1, np.uint64)[0] % (2**62))


def dropout_seed(seed: int, rnd: int, client: int, stream: str = "train") -> int:
    """Seed of the dropout masks of `client` in round `rnd` for the training job on the named stream: the
    stream `"dropout:" + stream` (`stream_seed`), independent of the batch order's stream, the cohort and
    the engine (`fedprism.models.dropout`)."""
    return stream_seed(seed, rnd, client, "dropout:" + stream)
