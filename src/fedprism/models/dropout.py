"""Dropout whose masks are a pure function of a key: the same in both engines, under vmap, on Flower nodes.

`torch.nn.Dropout` draws from the global generator, so a vmapped cohort and a client-by-client loop
would see different masks (and a different number of draws would shift every later stream). Here a
dropout layer draws nothing: its mask is computed from an integer key that the engine passes in with
the parameters (`fedprism.params.Functional.keyed`), and from the position of each activation in the
batch. The key of a training step is (`engine.base.dropout_key`)

    key = (s mod 2^32, s div 2^32, j),   s = stream_seed(run seed, round, client, "dropout:" + stream),
                                          j = the step's index in the client's local training

so a mask depends on (run seed, round, client, named stream, step, layer, sample position in the
batch, feature index) and on nothing else: not on the cohort, the slot a client was packed into, the
padding of the last batch, the engine or the process (a Flower node derives the same keys).

Mask of layer l (`salt` l, numbered in module order by `Functional`), sample b, feature f (flattened
index inside the sample, c = b F + f with F features per sample):

    k_a = h(h(h(l) xor j) xor s_lo),   k_b = h(k_a xor s_hi)
    u   = h(h(c xor k_a) xor k_b)                      (32 bits)
    drop  iff  floor(u / 2^8) < round(p 2^24)          (P(drop) = p to within 2^-25)
    out = x / (1 - p) where kept, 0 where dropped      (inverted dropout: E[out] = x)

h is the `triple32` integer permutation (three xorshift-multiply rounds; C. Wellons, hash-prospector,
2018), evaluated in int64 arithmetic with every product below 2^63 (32 x 16-bit partial products), so
eager, vmapped and compiled kernels compute the same bits on every device. Two keyed rounds of h
per activation make the masks of different keys unrelated (one round of `h(c xor k)` would give every
key a permutation of the same field).

Without a key (any call outside local training: evaluation, prototypes, importance estimates, a plain
`module(x)`) the layer is the identity, so inference is deterministic; p = 0 is the identity as well,
bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32) and a constant c < 2^32, with products below 2^49."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """`triple32` (C. Wellons, hash-prospector, 2018): a bijection of [0, 2^32) with low bias, on int64."""
    x = x & _M32
    x = x ^ (x >> 17)
    x = _mul32(x, 0xED5AD4BB)
    x = x ^ (x >> 11)
    x = _mul32(x, 0xAC4C1B51)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x31848BAB)
    return x ^ (x >> 14)


def hash32_int(x: int) -> int:
    """`hash32` of one Python integer, on the host (the same bits; no tensor to copy to a device, so a step
    that calls it can be recorded as a CUDA graph)."""
    x &= _M32
    for shift, c in ((17, 0xED5AD4BB), (11, 0xAC4C1B51), (15, 0x31848BAB)):
        x = ((x ^ (x >> shift)) * c) & _M32
    return x ^ (x >> 14)


def keep_mask(key: torch.Tensor, salt: int, batch: int, features: int, p: float) -> torch.Tensor:
    """[batch, features] bool: True where an activation is kept (the module docstring's formula).

    `key` is int64 [3] = (s_lo, s_hi, step); under vmap each slot carries its own key."""
    if batch * features >= 2**32:
        raise ValueError(f"a dropout layer sees {batch} x {features} activations; the counter needs < 2^32")
    key = key.to(torch.int64)
    dev = key.device
    salt_h = torch.full((), hash32_int(int(salt)), dtype=torch.int64, device=dev)
    k_a = hash32(hash32(hash32(salt_h ^ key[2]) ^ key[0]))
    k_b = hash32(k_a ^ key[1])
    c = torch.arange(batch * features, dtype=torch.int64, device=dev)
    u = hash32(hash32(c ^ k_a) ^ k_b)
    threshold = int(round(float(p) * 2**24))
    return ((u >> 8) >= threshold).view(batch, features)


class SeededDropout(nn.Module):
    """Inverted dropout with rate `p` driven by a key buffer (the module docstring); identity without a key.

    The buffer `key` is empty (non-persistent, not in the flat parameter vector or any state dict);
    `Functional.keyed(key)` substitutes the step's key for it during local training."""

    seeded_dropout = True

    def __init__(self, p: float):
        super().__init__()
        if not 0.0 <= float(p) < 1.0:
            raise ValueError(f"dropout rate must be in [0, 1), got {p!r}")
        self.p = float(p)
        self.salt = 0                                   # set by `Functional` (layer number in module order)
        self.register_buffer("key", torch.zeros(0, dtype=torch.int64), persistent=False)

    def extra_repr(self) -> str:
        return f"p={self.p}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.p == 0.0 or self.key.numel() == 0:      # shapes only: vmap- and compile-safe
            return x
        b = x.shape[0]
        keep = keep_mask(self.key, self.salt, b, x[0].numel() if b else 0, self.p).view(x.shape)
        return torch.where(keep, x * (1.0 / (1.0 - self.p)), torch.zeros((), dtype=x.dtype, device=x.device))


from fedprism.params import dropout_layers  # noqa: E402 (the layers `Functional` keys; re-exported here)


__all__ = ["SeededDropout", "dropout_layers", "hash32", "keep_mask"]
