"""Fixed image "domains" for the mixed feature + label skew protocol (``domain_mix``, after PFPL:
personalized federated prototype learning in mixed heterogeneous data scenarios).

PFPL draws each client's data from one of several real domains (MNIST / USPS / SVHN / SYN). To get the
same feature shift on any single image dataset, each domain here is a fixed, deterministic transform
of an image batch ``[N, C, H, W]`` (any leading dimensions work; the last two are H and W):

== ========== ==========================================================================================
0  identity   unchanged
1  rot90      rotation by 90 degrees (counter-clockwise); non-square images are rotated by 180 degrees so
              the shape is kept
2  invert     colour inversion ``lo + hi - x`` over the value range
3  blur       3x3 box blur per channel, edges replicated
4  noise      additive Gaussian noise, std ``NOISE_STD * (hi - lo)``, clipped to the range, drawn from a
              ``numpy.random.default_rng(seed)`` stream
== ========== ==========================================================================================

The value range ``(lo, hi)`` defaults to ``(0, 255)`` for integer arrays and to the array's own
``(min, max)`` for floats (so already mean/std-normalised data is inverted onto itself and noise is
clipped to the data's range); pass ``value_range`` (e.g. ``(0, 1)``) to make ``invert`` and ``noise``
independent of which images are in the array. ``rot90`` and ``blur`` always act on each image
independently; ``noise`` is deterministic for a given ``(x, seed)``, so apply the domains once to a
domain's whole subset (preprocessing), not per mini-batch.

Real domains. A dataset whose samples carry the domain they come from (spec ``natural = "domain"``: the
five Digits domains of ``digit_domains``, the four sites of ``office_caltech10``) needs no transform: with
``partition=domain_mix`` each client is given one of the data's domains (balanced over the clients and
shuffled, as for the transforms) and its ``n`` classes are drawn from that domain's samples only, its local
test rows from that domain's test samples (:func:`real_domain_mix`); ``partition=natural`` gives one
client per domain. :func:`to_rgb32` brings images of different sizes and channel counts to one
``3 x 32 x 32`` shape, so that several datasets can be one federation.
"""

from __future__ import annotations

import numpy as np

__all__ = ["DOMAINS", "NOISE_STD", "apply_domain", "apply_domains", "to_rgb32", "real_domain_mix"]

DOMAINS: tuple[str, ...] = ("identity", "rot90", "invert", "blur", "noise")
NOISE_STD = 0.1  # relative to the value range


def _value_range(x: np.ndarray, value_range: tuple[float, float] | None) -> tuple[float, float]:
    if value_range is not None:
        lo, hi = float(value_range[0]), float(value_range[1])
        if not hi > lo:
            raise ValueError(f"value_range = {value_range!r} is not valid: (lo, hi) with hi > lo")
        return lo, hi
    if np.issubdtype(x.dtype, np.integer):
        return 0.0, 255.0
    if x.size:
        lo, hi = float(x.min()), float(x.max())
        if hi > lo:
            return lo, hi
    return 0.0, 1.0


def _cast_back(y: np.ndarray, like: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """Return ``y`` in ``like``'s dtype (rounded and clipped for integer images)."""
    if np.issubdtype(like.dtype, np.integer):
        return np.clip(np.rint(y), lo, hi).astype(like.dtype)
    return y.astype(like.dtype, copy=False)


def _box_blur(x: np.ndarray) -> np.ndarray:
    """3x3 mean filter over the last two axes with edge replication (same shape)."""
    xf = x.astype(np.float64 if x.dtype == np.float64 else np.float32)
    pad = [(0, 0)] * (x.ndim - 2) + [(1, 1), (1, 1)]
    p = np.pad(xf, pad, mode="edge")
    h, w = x.shape[-2:]
    out = np.zeros_like(xf)
    for dy in range(3):
        for dx in range(3):
            out += p[..., dy:dy + h, dx:dx + w]
    return out / 9.0


def apply_domain(x: np.ndarray, domain: int, seed: int = 0,
                 value_range: tuple[float, float] | None = None) -> np.ndarray:
    """Apply the fixed transform of ``domain`` (0..4, see ``DOMAINS``) to images ``x`` [..., H, W].

    Returns a new array with ``x``'s shape and dtype. Deterministic: the same input, domain and seed
    always give the same output.
    """
    x = np.asarray(x)
    if x.ndim < 2:
        raise ValueError(f"x must have at least 2 dimensions [..., H, W], got shape {x.shape}")
    valid = isinstance(domain, (int, np.integer)) and not isinstance(domain, bool)
    if not valid or not 0 <= domain < len(DOMAINS):
        raise ValueError(f"domain = {domain!r} is not valid: an integer in [0, {len(DOMAINS) - 1}] "
                         f"({', '.join(f'{i}={d}' for i, d in enumerate(DOMAINS))})")
    lo, hi = _value_range(x, value_range)
    kind = DOMAINS[int(domain)]
    if kind == "identity":
        return x.copy()
    if kind == "rot90":
        k = 1 if x.shape[-1] == x.shape[-2] else 2
        return np.ascontiguousarray(np.rot90(x, k=k, axes=(-2, -1)))
    if kind == "invert":
        return _cast_back((lo + hi) - x.astype(np.float64), x, lo, hi)
    if kind == "blur":
        return _cast_back(_box_blur(x), x, lo, hi)
    # noise
    rng = np.random.default_rng(seed)
    noise = rng.standard_normal(x.shape) * (NOISE_STD * (hi - lo))
    return _cast_back(np.clip(x + noise, lo, hi), x, lo, hi)


def apply_domains(x: np.ndarray, domain_ids: np.ndarray, seed: int = 0,
                  value_range: tuple[float, float] | None = None) -> np.ndarray:
    """Transform each image ``x[j]`` with domain ``domain_ids[j]`` (-1 leaves it unchanged).

    One call per domain on that domain's subset; domain ``d`` uses noise seed ``seed + d``.
    ``Partition.train_sample_domains`` gives ``domain_ids`` for a ``domain_mix`` partition.
    """
    x = np.asarray(x)
    domain_ids = np.asarray(domain_ids)
    if domain_ids.shape != x.shape[:1]:
        raise ValueError(f"domain_ids must have shape {x.shape[:1]} (one per image), got {domain_ids.shape}")
    out = x.copy()
    for d in np.unique(domain_ids):
        if d < 0:
            continue
        sel = np.flatnonzero(domain_ids == d)
        out[sel] = apply_domain(x[sel], int(d), seed=seed + int(d), value_range=value_range)
    return out


# ----------------------------------------------------------------------------------- real domains


def to_rgb32(x: np.ndarray) -> np.ndarray:
    """uint8 images [N, C, H, W] (C = 1 or 3, H = W <= 32) -> [N, 3, 32, 32]: greyscale copied to the three
    channels; 32x32 kept, a side dividing 32 (USPS's 16) enlarged by repeating each pixel (nearest
    neighbour, exact), any other side (MNIST's 28) zero-padded, centred, as ``data.pad32`` pads."""
    x = np.asarray(x)
    if x.ndim != 4 or x.shape[1] not in (1, 3) or x.shape[2] != x.shape[3] or x.shape[2] > 32:
        raise ValueError(f"images must be [N, 1 or 3, S, S] with S <= 32, got shape {x.shape}")
    side = x.shape[2]
    if side != 32 and 32 % side == 0:
        k = 32 // side
        x = np.repeat(np.repeat(x, k, axis=2), k, axis=3)
    elif side != 32:
        top = (32 - side) // 2
        out = np.zeros(x.shape[:2] + (32, 32), dtype=x.dtype)
        out[:, :, top:top + side, top:top + side] = x
        x = out
    if x.shape[1] == 1:
        x = np.repeat(x, 3, axis=1)
    return np.ascontiguousarray(x)


def real_domain_mix(y_train: np.ndarray, y_test: np.ndarray, groups: np.ndarray, test_groups: np.ndarray,
                    num_clients: int, seed: int, params: dict):
    """``partition=domain_mix`` on data whose samples carry their real domain (``groups`` / ``test_groups``):
    a :class:`fedprism.data.partitions.Partition` with one domain per client and that client's ``n``
    classes from its domain's samples only.

    Client domains: ``permutation(arange(N) % D)`` over the data's D domains (ascending ids), from a stream
    seeded by ``seed``, as ``domain_mix`` draws them for the transforms; ``partition.num_domains`` must equal
    D. Within domain d, its clients' classes, train and local test rows are ``domain_mix``'s with one domain
    (the same draws, the same "n-way" rule) on domain d's train and test samples, seeded by ``(seed, d)``.
    The partition's ``domains`` stay None (nothing is transformed); ``meta["client_domains"]`` gives each
    client's domain id, as for the transforms.
    """
    from fedprism.data.partitions import Partition, make_partition
    from fedprism.errors import PartitionError

    g_tr, g_te = np.asarray(groups, np.int64), np.asarray(test_groups, np.int64)
    doms = np.unique(g_tr)
    params = dict(params)
    n_dom = int(params.pop("num_domains", len(doms)))
    if n_dom != len(doms):
        raise PartitionError(f"partition.num_domains = {n_dom} is not valid for this data: its samples come "
                             f"from {len(doms)} domains, each client is given one of them; set "
                             f"partition.num_domains = {len(doms)}")
    if num_clients < n_dom:
        raise PartitionError(f"clients = {num_clients} is not valid for partition 'domain_mix' on {n_dom} "
                             f"real domains: at least one client per domain, clients >= {n_dom}")
    rng = np.random.default_rng([seed, 0xD0])
    client_dom = rng.permutation(np.arange(num_clients) % n_dom)
    train: list = [None] * num_clients
    test: list = [None] * num_clients
    metas = {}
    for k, d in enumerate(doms):
        members = np.flatnonzero(client_dom == k)
        sub_tr, sub_te = np.flatnonzero(g_tr == d), np.flatnonzero(g_te == d)
        if not len(sub_te):
            raise PartitionError(f"domain {int(d)} has no test samples; each client's local test rows come "
                                 "from its domain's test samples")
        dseed = int(np.random.SeedSequence([seed, int(d)]).generate_state(1)[0])
        try:
            p = make_partition("domain_mix", y_train[sub_tr], y_test[sub_te], len(members), dseed,
                               num_domains=1, **params)
        except PartitionError as e:
            raise PartitionError(f"domain {int(d)} ({len(sub_tr)} training samples, {len(members)} clients): "
                                 f"{e}") from None
        for j, c in enumerate(members):
            train[c] = sub_tr[p.train[j]]
            test[c] = sub_te[p.test[j]]
        metas[int(d)] = p.meta
    n = len(y_train)
    used = int(sum(len(t) for t in train))
    meta = {"partition": "domain_mix", "params": {"num_domains": n_dom, **params}, "seed": seed,
            "num_clients": num_clients, "real_domains": [int(d) for d in doms],
            "client_domains": [int(doms[k]) for k in client_dom], "n_train_used": used,
            "n_train_unused": n - used,
            "test_with_replacement": any(m.get("test_with_replacement", False) for m in metas.values())}
    return Partition(train=train, test=test, domains=None, meta=meta)
