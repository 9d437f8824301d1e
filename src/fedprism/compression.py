"""Update compression: what a client uploads, quantised or sparsified before it leaves the client.

`compress = int8 | stochastic | topk` (experiment keys; `none` is off) applies to every method: the
client's work (`client_update`) is unchanged, and its upload is encoded on the client by `encode_update`
and decoded on the server by `decode_update`, before the server checks it and averages it. The encoded
tensors are what travels: in process they are the Update's payload between the client's work and the
server's `receive`, and on Flower they are the tensors the codec sends (fedprism.flower.codec), so the
round's `bytes_up` (`wire_bytes`, counted from the encoded form) are the bytes of the arrays sent.

What is compressed: every floating-point tensor of the declared upload (`Algorithm.upload`) with at least
one dimension per client (scalars such as q-FFL's loss travel as they are, and so do integer tensors).
When the plan sent the client a tensor of the same name and shape (FedAvg's `params`, the shared
coordinates of FedPer / FedRep, ...), the client compresses its update u = upload - sent and the server
adds the decoded update to what it sent; otherwise it compresses the tensor itself (class prototypes).

The three codecs, on one client's tensor v flattened to n values:

* `int8` (8-bit linear quantisation with one scale per tensor): s = max|v| / 127 (float32), q_i =
  round(v_i / s) in [-127, 127]; decoded s q_i. Sent: n int8 values and the scale, n + 4 bytes.
* `stochastic` (QSGD, Alistarh, Grubic, Li, Tomioka, Vojnovic 2017, "QSGD: Communication-Efficient SGD via
  Gradient Quantization and Encoding", arXiv:1610.02132): with `compress.bits` = b, L = 2^(b-1) - 1 levels
  and ||v|| the L2 norm, each |v_i| / ||v|| L is rounded up with probability equal to its fractional part
  and down otherwise (unbiased: E[decoded] = v), giving a level l_i in [0, L]; the code sign(v_i) l_i + L
  in [0, 2L] takes b bits. Sent: the norm (float32) and the n codes packed b bits each (most significant
  bit first), ceil(n b / 8) + 4 bytes. The rounding draws come from a stream of the run seed, the round,
  the client and the tensor (`stream_seed(..., "compress:<name>")`): a Flower node draws what the simulator
  draws.
* `topk` (top-k sparsification with error feedback, Stich, Cordonnier, Jaggi 2018, "Sparsified SGD with
  Memory", arXiv:1809.07599): the k = max(1, ceil(`compress.k` n)) entries of largest magnitude (ties:
  the lower index), sent as int32 indices in increasing order and their float32 values, 8 k bytes.

Error feedback (`compress.feedback`; `auto`: on for `topk`, off for the quantisers, which are unbiased or
nearly so): the client keeps what compression dropped, e = (u + e) - decoded(C(u + e)), as client state
(`ef.<tensor>`, declared beside the method's own client state, so it is checkpointed with the run and kept in
a Flower node's state) and adds it to its next update of that tensor before compressing. A client whose
upload is rejected has already updated its residual, as a client that does not learn the server's verdict.

Decisions where the papers are silent: one scale (int8) or norm (QSGD) per tensor of a client's upload, not
per bucket (QSGD's bucket size d is here the whole tensor); the quantisers' arithmetic is float64 and the
decoded values are rounded once to float32; k is a fraction of each tensor's entries so that one setting
works for every method and model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from fedprism.protocol import ClientState, Rows, TensorSpec, Update
from fedprism.seeds import stream_seed

CODECS = ("none", "int8", "stochastic", "topk")
#: separator of an encoded tensor's name: `params` travels as `params@q` and `params@scale` (int8), ...
SEP = "@"
#: prefix of the error-feedback residuals in the client state
RESIDUAL = "ef."
_PARTS = {"int8": ("q", "scale"), "stochastic": ("codes", "norm"), "topk": ("idx", "val")}


@dataclass(frozen=True)
class Compressor:
    """The run's upload compression (`compress`, `compress.k`, `compress.bits`, `compress.feedback`)."""

    how: str
    k: float = 0.01
    bits: int = 4
    feedback: bool = True
    seed: int = 0

    @classmethod
    def of(cls, cfg) -> "Compressor | None":
        """The configuration's compressor, None when `compress=none`."""
        how = cfg.get("compress", "none")
        if how == "none":
            return None
        fb = cfg.get("compress.feedback", "auto")
        feedback = how == "topk" if fb == "auto" else fb in (True, "true")
        return cls(how, float(cfg.get("compress.k", 0.01)), int(cfg.get("compress.bits", 4)), feedback,
                   int(cfg.get("seed", 0)))

    @property
    def levels(self) -> int:
        """QSGD's L = 2^(bits-1) - 1 levels per sign."""
        return 2 ** (self.bits - 1) - 1

    # -- which tensors ------------------------------------------------------------------------------
    @staticmethod
    def compressed(upload: dict[str, TensorSpec]) -> list[str]:
        """The names of the upload's tensors that are compressed: floating point, at least one dimension."""
        return sorted(k for k, s in upload.items() if s.dtype.is_floating_point and len(s.shape) >= 1)

    def residual_state(self, upload: dict[str, TensorSpec]) -> dict[str, ClientState]:
        """The client state error feedback keeps: one zero-initialised residual per compressed tensor."""
        if not self.feedback:
            return {}
        return {RESIDUAL + k: ClientState(tuple(upload[k].shape), init="zeros") for k in self.compressed(upload)}

    def kept(self, n: int) -> int:
        """Top-k's k for a tensor of n entries."""
        return min(n, max(1, math.ceil(self.k * n - 1e-9)))

    def wire_spec(self, upload: dict[str, TensorSpec]) -> dict[str, TensorSpec]:
        """The declared upload as it travels (resolved specs in, resolved specs out): the encoded tensors of
        every compressed one, the others unchanged. What the server checks a reply against before decoding."""
        out = {}
        for name, spec in upload.items():
            if name not in self.compressed(upload):
                out[name] = spec
                continue
            n = int(np.prod(spec.shape))
            a, b = _PARTS[self.how]
            if self.how == "int8":
                out[f"{name}{SEP}{a}"] = TensorSpec((n,), torch.int8, low=-127)
                out[f"{name}{SEP}{b}"] = TensorSpec((), torch.float32, low=0)
            elif self.how == "stochastic":
                out[f"{name}{SEP}{a}"] = TensorSpec((math.ceil(n * self.bits / 8),), torch.uint8)
                out[f"{name}{SEP}{b}"] = TensorSpec((), torch.float32, low=0)
            else:
                k = self.kept(n)
                out[f"{name}{SEP}{a}"] = TensorSpec((k,), torch.int32, low=0, high=n)
                out[f"{name}{SEP}{b}"] = TensorSpec((k,), torch.float32)
        return out

    def wire_bytes(self, upload: dict[str, TensorSpec], clients: int) -> int:
        """Bytes `clients` encoded replies hold (element sizes of `wire_spec`'s tensors)."""
        per = sum(int(np.prod(s.shape)) * torch.empty((), dtype=s.dtype).element_size()
                  for s in self.wire_spec(upload).values())
        return per * int(clients)

    @staticmethod
    def encoded(payload: Rows) -> bool:
        """Whether `payload` holds encoded tensors (names with `SEP`), i.e. has not been decoded yet."""
        return any(SEP in k for k in payload)

    # -- one client's tensor ------------------------------------------------------------------------
    def encode(self, v: torch.Tensor, gen: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One client's values (any shape) -> the two encoded tensors (a row each, without the client axis)."""
        x = v.reshape(-1).to(torch.float64)
        n = x.numel()
        if self.how == "int8":
            scale = (x.abs().max() / 127.0 if n else torch.zeros((), dtype=torch.float64)).to(torch.float32)
            s64 = scale.to(torch.float64)
            q = torch.zeros(n, dtype=torch.int8) if float(scale) == 0 else \
                torch.round(x / s64).clamp(-127, 127).to(torch.int8)
            return q, scale
        if self.how == "stochastic":
            L = self.levels
            norm = x.norm().to(torch.float32)
            n64 = norm.to(torch.float64)
            if float(norm) == 0:
                codes = torch.full((n,), L, dtype=torch.int64)
            else:
                r = (x.abs() / n64 * L).clamp(max=L)
                low = torch.floor(r)
                up = torch.rand(n, generator=gen, dtype=torch.float64) < (r - low)
                level = (low + up.to(torch.float64)).clamp(max=L)
                codes = (torch.sign(x) * level).to(torch.int64) + L
            return torch.from_numpy(_pack(codes.numpy(), self.bits)), norm
        k = self.kept(n)
        # the k largest magnitudes, ties to the lower index: a stable sort of -|x|
        order = torch.sort(-x.abs(), stable=True).indices[:k]
        idx = torch.sort(order).values
        return idx.to(torch.int32), x[idx].to(torch.float32)

    def decode(self, a: torch.Tensor, b: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """The float32 values of shape `shape` that `encode` sent as (a, b); ValueError when malformed."""
        n = int(np.prod(shape))
        if self.how == "int8":
            return (a.to(torch.float64) * b.to(torch.float64)).to(torch.float32).reshape(shape)
        if self.how == "stochastic":
            L = self.levels
            codes = torch.from_numpy(_unpack(a.numpy(), self.bits, n))
            if bool((codes > 2 * L).any()):
                raise ValueError(f"a code above {2 * L} (bits={self.bits})")
            return (b.to(torch.float64) * (codes - L).to(torch.float64) / L).to(torch.float32).reshape(shape)
        idx = a.to(torch.int64)
        if idx.numel() > 1 and not bool((idx[1:] > idx[:-1]).all()):
            raise ValueError("indices not strictly increasing")
        out = torch.zeros(n, dtype=torch.float32)
        out[idx] = b.to(torch.float32)
        return out.reshape(shape)

    # -- a client's upload, and the server's view of it -----------------------------------------------
    def encode_update(self, up: Update, sent: Rows, upload: dict[str, TensorSpec], rnd: int, cstate: Rows
                      ) -> Update:
        """The client side: `up` (the method's reply, [n, ...] rows) with every compressed tensor replaced by
        its encoding, and the new error-feedback residuals in its client state. `sent`: the plan rows the
        clients received; `cstate`: their rows of the client state (the residuals among them)."""
        payload = {k: v for k, v in up.payload.items() if k not in self.compressed(upload)}
        state = dict(up.client_state)
        for name in self.compressed(upload):
            v = up.payload[name]
            ref = _reference(name, v, sent)
            u = v - ref if ref is not None else v
            if self.feedback:
                u = u + cstate[RESIDUAL + name].to(u.dtype)
            a_rows, b_rows, res = [], [], []
            for i, c in enumerate(up.clients):
                gen = torch.Generator().manual_seed(stream_seed(self.seed, rnd, int(c), f"compress:{name}"))
                a, b = self.encode(u[i], gen)
                a_rows.append(a)
                b_rows.append(b)
                if self.feedback:
                    res.append(u[i] - self.decode(a, b, tuple(u[i].shape)))
            pa, pb = _PARTS[self.how]
            payload[f"{name}{SEP}{pa}"] = torch.stack(a_rows) if a_rows else torch.zeros(0)
            payload[f"{name}{SEP}{pb}"] = torch.stack(b_rows) if b_rows else torch.zeros(0)
            if self.feedback:
                state[RESIDUAL + name] = torch.stack(res) if res else u[:0]
        return Update(up.clients, payload, up.n_samples, up.metrics, state, up.sent, dict(up.rejected))

    def decode_update(self, up: Update, sent: Rows, upload: dict[str, TensorSpec]
                      ) -> tuple[Update, dict[int, str]]:
        """The server side: the clients' encoded rows (already checked against `wire_spec`) -> the upload the
        method declared; a row that cannot be decoded is left out and named in the second value. An update
        whose payload is already decoded (a Flower server decodes each reply as it arrives) is returned as
        it is."""
        names = self.compressed(upload)
        if not names or not self.encoded(up.payload):
            return up, {}
        pa, pb = _PARTS[self.how]
        rows: dict[str, list[torch.Tensor]] = {k: [] for k in names}
        bad: dict[int, str] = {}
        for i, c in enumerate(up.clients):
            try:
                dec = {}
                for name in names:
                    shape = tuple(upload[name].shape)
                    d = self.decode(up.payload[f"{name}{SEP}{pa}"][i], up.payload[f"{name}{SEP}{pb}"][i], shape)
                    ref = _reference(name, d[None], {k: v[i:i + 1] for k, v in sent.items()})
                    dec[name] = d if ref is None else (ref[0] + d)
            except (ValueError, RuntimeError, IndexError) as e:
                bad[int(c)] = f"{name}: undecodable {self.how} encoding ({e})"
                continue
            for name in names:
                rows[name].append(dec[name])
        keep = np.array([int(c) not in bad for c in up.clients], dtype=bool)
        kept = up.select(keep)
        payload = {k: v for k, v in kept.payload.items() if SEP not in k}
        for name in names:
            payload[name] = torch.stack(rows[name]) if rows[name] else \
                torch.zeros((0, *upload[name].shape), dtype=torch.float32)
        kept.payload = payload
        return kept, bad


def _reference(name: str, v: torch.Tensor, sent: Rows) -> torch.Tensor | None:
    """What the update of upload tensor `name` is measured from: the plan's tensor of the same name and
    shape, None when the plan sent none (then the tensor itself is compressed)."""
    ref = sent.get(name) if sent else None
    if isinstance(ref, torch.Tensor) and ref.is_floating_point() and tuple(ref.shape) == tuple(v.shape):
        return ref.to(v.dtype)
    return None


def _pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """n integer codes in [0, 2^bits) -> ceil(n bits / 8) bytes, each code's bits most significant first."""
    shifts = np.arange(bits - 1, -1, -1, dtype=np.int64)
    b = ((codes.astype(np.int64)[:, None] >> shifts) & 1).astype(np.uint8).reshape(-1)
    return np.packbits(b)


def _unpack(packed: np.ndarray, bits: int, n: int) -> np.ndarray:
    """The n codes `_pack` packed."""
    if packed.dtype != np.uint8 or packed.size * 8 < n * bits:
        raise ValueError(f"{packed.size} bytes hold fewer than {n} codes of {bits} bits")
    b = np.unpackbits(packed)[: n * bits].reshape(n, bits).astype(np.int64)
    return (b << np.arange(bits - 1, -1, -1, dtype=np.int64)).sum(1)


def client_work(algo, plan, trainer, rnd: int, cstate: Rows) -> Update:
    """A client's work as it leaves the client: the method's `client_update` on its own client state (the
    error-feedback residuals held back), then, under `attack.*`, a Byzantine client's crafted upload
    (`fedprism.attacks`), then, under `compress`, the encoding of its upload (`Compressor.encode_update`).
    The in-process runner and a Flower node both call this."""
    comp, attack = getattr(algo.ctx, "compress", None), getattr(algo.ctx, "attack", None)
    own = cstate if comp is None else {k: v for k, v in cstate.items() if not k.startswith(RESIDUAL)}
    up = algo.client_update(plan, trainer, rnd, own)
    if comp is None and attack is None:
        return up
    whole = len(up.clients) == len(plan.clients)
    sent = plan.payload if whole else plan.subset(_rows_of(plan, up)).payload
    if attack is not None:            # `attack.*`: the Byzantine clients' uploads crafted (fedprism.attacks)
        up = attack.poison(up, sent, rnd)
    if comp is None:
        return up
    upload = {k: s.resolve(algo.ctx) for k, s in algo.upload().items()}
    return comp.encode_update(up, sent, upload, rnd, cstate if whole else _take_rows(cstate, _rows_of(plan, up)))


def _rows_of(plan, up: Update) -> np.ndarray:
    pos = {int(c): i for i, c in enumerate(plan.clients)}
    return np.array([pos[int(c)] for c in up.clients], dtype=np.int64)


def _take_rows(rows: Rows, idx: np.ndarray) -> Rows:
    t = torch.as_tensor(idx, dtype=torch.long)
    return {k: v[t] for k, v in rows.items()}
