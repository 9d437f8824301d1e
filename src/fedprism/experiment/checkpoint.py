"""Checkpoints that cannot run code: a JSON skeleton plus raw tensor bytes, signed and bound to their run.

A run's algorithm state is a nested structure of dicts, lists and tuples whose leaves are torch
tensors, numpy arrays, numpy scalars and plain values (bool, int, float, str, None). It is written
as one file, `<db>.ckpt/<run_id>.ckpt` (a kept final state: `<db>.final/<train_id>.ckpt`):

    8 bytes   magic  b"FPCKPT\\x00\\x01"
    8 bytes   length of the header (little-endian unsigned)
    header    UTF-8 JSON: {"format": "fedprism-checkpoint", "version": 2, "mac": "sha256" | "hmac-sha256",
                           "binding": {"kind", "run_id" | "train_id", "config_sha256"} | null,
                           "skeleton": ..., "tensors": [{"kind", "dtype", "shape", "offset", "nbytes", ...}]}
    data      the tensors' bytes, one after another (C order, little-endian)
    32 bytes  SHA-256 of everything before it, or its HMAC-SHA256 under the run's `checkpoint.key`

Reading parses JSON and turns byte ranges into arrays of an allow-listed dtype (`numpy.frombuffer`):
there is no pickle anywhere, so a file received from someone else can be wrong but never executes
anything. The binding (which run, or which training identity, and the SHA-256 of its configuration)
is inside the signed header, so a file cannot be moved to another run's name; with `checkpoint.key` the
trailer is an HMAC, so a file edited by someone without the key cannot be signed again.

Two kinds of failure (docs/robustness.md, "Checkpoints"):

* `CheckpointError`: the file is not an intact checkpoint of this run (bad magic, truncated, checksum or
  HMAC mismatch, a header or skeleton that points outside the data, another run's binding). It says
  nothing about this run: the runner deletes it and starts the run from round 0 (`checkpoint_discarded`).
* `CheckpointRefused`: the file cannot be used as it is and fedprism will not guess (a format version
  it does not read, a file signed with a key this run does not have, a file larger than this run's state
  can be, a round outside the run or past the rounds the store holds, a state whose names, shapes or
  dtypes are not the method's). It is a `FedPrismError` naming the file and the field; the file is kept,
  and `fedprism run --fresh` (or deleting the file) discards it.

Writes go to a unique temporary file in the same folder (`tempfile.mkstemp`), are flushed and
fsync'ed, then renamed over the old checkpoint (`os.replace`), so a reader sees the old or the new
checkpoint, never half of one.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import struct
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedprism.errors import FedPrismError, printable

MAGIC = b"FPCKPT\x00\x01"
FORMAT = "fedprism-checkpoint"
VERSION = 2
SUFFIX = ".ckpt"
_DIGEST = 32
_MAX_HEADER = 1 << 30
#: shortest key `checkpoint.key` may name (bytes, after surrounding whitespace is stripped)
MIN_KEY_BYTES = 32

#: numpy dtypes a checkpoint may hold (little-endian names as numpy spells them)
_NP_DTYPES = {np.dtype(t).str: np.dtype(t) for t in (
    np.bool_, np.uint8, np.int8, np.int16, np.int32, np.int64, np.uint16, np.uint32, np.uint64,
    np.float16, np.float32, np.float64, np.complex64, np.complex128)}

#: torch dtypes: name -> (dtype, numpy dtype of the same bytes)
_TORCH_DTYPES: dict[str, tuple[torch.dtype, np.dtype]] = {
    "bool": (torch.bool, np.dtype(np.bool_)), "uint8": (torch.uint8, np.dtype(np.uint8)),
    "int8": (torch.int8, np.dtype(np.int8)), "int16": (torch.int16, np.dtype("<i2")),
    "int32": (torch.int32, np.dtype("<i4")), "int64": (torch.int64, np.dtype("<i8")),
    "float16": (torch.float16, np.dtype("<f2")), "float32": (torch.float32, np.dtype("<f4")),
    "float64": (torch.float64, np.dtype("<f8")), "bfloat16": (torch.bfloat16, np.dtype("<i2")),
    "complex64": (torch.complex64, np.dtype("<c8")), "complex128": (torch.complex128, np.dtype("<c16")),
}
_TORCH_NAMES = {dt: name for name, (dt, _) in _TORCH_DTYPES.items()}


class _Problem(FedPrismError):
    """A checkpoint problem: `reason`, and where known the `file` and the `field` it is about. The
    arguments are kept as given (`args`), so the error crosses a process boundary (sweep workers)."""

    def __init__(self, reason: str, file: str | Path | None = None, field: str | None = None,
                 what: str = "checkpoint"):
        file = None if file is None else str(file)
        super().__init__(reason, file, field, what)
        self.reason, self.file, self.field, self.what = reason, file, field, what

    def at(self, file: str | Path, what: str = "checkpoint") -> "_Problem":
        """The same problem, naming `file` (called `what`: checkpoint, kept final state)."""
        return type(self)(self.reason, file, self.field, what)

    def __str__(self) -> str:
        where = f"{self.what} {self.file}: " if self.file else ""
        field = f"{self.field}: " if self.field else ""
        return printable(f"{where}{field}{self.reason}")


class CheckpointError(_Problem):
    """A checkpoint file is unreadable, truncated, tampered with, of another run or of an unknown
    structure: not an intact checkpoint of this run. The runner deletes it and starts from round 0."""


class CheckpointRefused(_Problem):
    """An intact checkpoint (or kept final state) that this run cannot use as it is: another format
    version, signed with a key this run lacks, larger than the run's state, or a round, name, shape or
    dtype the run does not have. Raised to the user (the file is kept); `--fresh` discards it."""

    def __str__(self) -> str:
        fresh = f"`fedprism run --fresh{self._db()}` with this configuration (or deleting the file) discards it"
        fix = f"{fresh} and trains again" if self.what == "kept final state" else f"{fresh} and runs again from round 0"
        return f"{super().__str__()}; the file is left as it is: {fix}" if self.file else super().__str__()

    def _db(self) -> str:
        """' --db STORE' for a file in a store's `<db>.ckpt/` or `<db>.final/` folder, else ''."""
        import shlex

        folder = Path(self.file or "").parent
        for suffix in (".ckpt", ".final"):
            if folder.name.endswith(suffix) and len(folder.name) > len(suffix):
                return f" --db {shlex.quote(str(folder.with_name(folder.name[:-len(suffix)])))}"
        return ""


# -- encoding -------------------------------------------------------------------------------------------
def _bytes_view(a: np.ndarray) -> memoryview:
    """The C-order bytes of `a` without copying them (a copy only when `a` is not contiguous)."""
    return memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))


class _Writer:
    """Encodes a structure into the skeleton and the list of tensor byte buffers (views, not copies: a
    checkpoint of a large client state is streamed to its file without a second copy in memory)."""

    def __init__(self) -> None:
        self.entries: list[dict] = []
        self.chunks: list[memoryview] = []
        self.offset = 0

    def _add(self, meta: dict, data: memoryview) -> int:
        meta.update(offset=self.offset, nbytes=data.nbytes)
        self.entries.append(meta)
        self.chunks.append(data)
        self.offset += data.nbytes
        return len(self.entries) - 1

    def tensor(self, t: torch.Tensor, where: str) -> dict:
        if t.dtype not in _TORCH_NAMES:
            raise TypeError(f"{where}: cannot checkpoint a tensor of dtype {t.dtype}")
        if t.is_sparse or t.layout != torch.strided:
            raise TypeError(f"{where}: cannot checkpoint a {t.layout} tensor")
        name = _TORCH_NAMES[t.dtype]
        c = t.detach().to("cpu").contiguous()
        if name == "bfloat16":
            c = c.view(torch.int16)
        data = _bytes_view(c.numpy().astype(_TORCH_DTYPES[name][1], copy=False))
        i = self._add({"kind": "torch", "dtype": name, "shape": list(t.shape), "device": str(t.device),
                       "requires_grad": bool(t.requires_grad)}, data)
        return {"t": "tensor", "i": i}

    def array(self, a: np.ndarray, where: str, tag: str) -> dict:
        dt = a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype
        if dt.str not in _NP_DTYPES:
            raise TypeError(f"{where}: cannot checkpoint a numpy array of dtype {a.dtype}")
        data = _bytes_view(np.ascontiguousarray(a, dtype=dt))
        i = self._add({"kind": "numpy", "dtype": dt.str, "shape": list(a.shape)}, data)
        return {"t": tag, "i": i}

    def encode(self, x: Any, where: str) -> Any:
        if isinstance(x, np.generic):                 # before float: numpy.float64 is a float subclass
            return self.array(np.asarray(x), where, "npscalar")
        if x is None or isinstance(x, (bool, str)):
            return x
        if isinstance(x, int):
            return x
        if isinstance(x, float):
            return {"t": "float", "v": x.hex()}
        if isinstance(x, torch.Tensor):
            return self.tensor(x, where)
        if isinstance(x, np.ndarray):
            return self.array(x, where, "ndarray")
        if isinstance(x, dict):
            return {"t": "dict", "items": [[self.encode(k, f"{where} key {k!r}"), self.encode(v, f"{where}[{k!r}]")]
                                           for k, v in x.items()]}
        if isinstance(x, (list, tuple)):
            return {"t": "list" if isinstance(x, list) else "tuple",
                    "v": [self.encode(v, f"{where}[{i}]") for i, v in enumerate(x)]}
        raise TypeError(f"{where}: cannot checkpoint a value of type {type(x).__name__} (allowed: dict, list, "
                        "tuple, torch tensors, numpy arrays and scalars, bool, int, float, str, None)")


def config_sha256(identity: dict) -> str:
    """The SHA-256 (hex) of a configuration's identity as run ids hash it (`Config.identity`: a run id is
    its first 16 characters), bound into every checkpoint of the run."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()


def _signer(key: bytes | None):
    """A fresh digest object: SHA-256, or HMAC-SHA256 under `key`."""
    return hmac.new(key, digestmod=hashlib.sha256) if key is not None else hashlib.sha256()


def _parts(obj: Any, binding: dict | None = None, key: bytes | None = None) -> list[bytes | memoryview]:
    """The pieces of the checkpoint body of `obj`, in order (magic, header length, header, tensor bytes)."""
    w = _Writer()
    skeleton = w.encode(obj, "state")
    header = json.dumps({"format": FORMAT, "version": VERSION, "mac": "hmac-sha256" if key is not None else "sha256",
                         "binding": binding, "skeleton": skeleton, "tensors": w.entries},
                        separators=(",", ":"), allow_nan=False).encode()
    return [MAGIC, struct.pack("<Q", len(header)), header, *w.chunks]


def dumps(obj: Any, binding: dict | None = None, key: bytes | None = None) -> bytes:
    """The checkpoint bytes of `obj` (raises TypeError naming the first value it cannot hold), bound to
    `binding` (a JSON object: which run the state belongs to) and signed with `key` (HMAC) if given."""
    body = b"".join(_parts(obj, binding, key))
    sig = _signer(key)
    sig.update(body)
    return body + sig.digest()


# -- decoding -------------------------------------------------------------------------------------------
def _array(meta: Any, data: memoryview) -> np.ndarray:
    if not isinstance(meta, dict):
        raise CheckpointError("a tensor entry is not an object")
    try:
        shape = tuple(int(s) for s in meta["shape"])
        off, nbytes = int(meta["offset"]), int(meta["nbytes"])
        if meta["kind"] == "torch":
            dt = _TORCH_DTYPES[meta["dtype"]][1]
        elif meta["kind"] == "numpy":
            dt = _NP_DTYPES[meta["dtype"]]
        else:
            raise CheckpointError(f"unknown tensor kind {meta['kind']!r}")
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"bad tensor entry ({type(e).__name__}: {e})") from None
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if min(shape, default=0) < 0 or off < 0 or nbytes != count * dt.itemsize or off + nbytes > len(data):
        raise CheckpointError("a tensor entry points outside the data section")
    return np.frombuffer(data[off:off + nbytes], dtype=dt, count=count).reshape(shape).copy()


def _device(name: str) -> str:
    if name.startswith("cuda") and torch.cuda.is_available():
        return name
    return "cpu"


def _decode(x: Any, tensors: list, data: memoryview, depth: int = 0) -> Any:
    if depth > 200:
        raise CheckpointError("skeleton nested too deeply")
    if x is None or isinstance(x, (bool, str, int)):
        return x
    if not isinstance(x, dict) or "t" not in x:
        raise CheckpointError(f"unexpected skeleton node {type(x).__name__}")
    t = x["t"]
    try:
        if t == "float":
            return float.fromhex(x["v"])
        if t in ("dict",):
            return {_decode(k, tensors, data, depth + 1): _decode(v, tensors, data, depth + 1) for k, v in x["items"]}
        if t in ("list", "tuple"):
            vals = [_decode(v, tensors, data, depth + 1) for v in x["v"]]
            return vals if t == "list" else tuple(vals)
        if t in ("tensor", "ndarray", "npscalar"):
            i = x["i"]
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(tensors):
                raise CheckpointError(f"tensor index {i!r} out of range")
            meta = tensors[i]
            a = _array(meta, data)
            if t == "ndarray":
                if meta.get("kind") != "numpy":
                    raise CheckpointError("an ndarray node points at a torch entry")
                return a
            if t == "npscalar":
                if meta.get("kind") != "numpy" or a.ndim != 0:
                    raise CheckpointError("a numpy scalar node points at a non-scalar entry")
                return a[()]
            if meta.get("kind") != "torch":
                raise CheckpointError("a tensor node points at a numpy entry")
            dt = _TORCH_DTYPES[meta["dtype"]][0]
            out = torch.from_numpy(a)
            if dt == torch.bfloat16:
                out = out.view(torch.bfloat16)
            out = out.to(_device(str(meta.get("device", "cpu"))))
            if meta.get("requires_grad"):
                out.requires_grad_(True)
            return out
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise CheckpointError(f"bad skeleton node {t!r} ({type(e).__name__}: {e})") from None
    raise CheckpointError(f"unknown skeleton node {t!r}")


def _header(body: bytes) -> tuple[dict, int]:
    """The parsed header of a checkpoint body and where its data section starts."""
    (hlen,) = struct.unpack("<Q", body[len(MAGIC):len(MAGIC) + 8])
    start = len(MAGIC) + 8
    if hlen > min(_MAX_HEADER, len(body) - start):
        raise CheckpointError("header length exceeds the file", field="header")
    try:
        header = json.loads(body[start:start + hlen].decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"unreadable header ({type(e).__name__})", field="header") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise CheckpointError("not a fedprism checkpoint header", field="header")
    return header, start + hlen


def _verify(body: bytes, digest: bytes, key: bytes | None) -> None:
    """The trailer must be the SHA-256 of the body, or its HMAC under `key` when the run has one."""
    sig = _signer(key)
    sig.update(body)
    if hmac.compare_digest(sig.digest(), digest):
        return
    plain = hashlib.sha256(body).digest() == digest
    if key is not None:
        raise CheckpointError("not signed with this run's checkpoint.key (written without it or with another "
                              "key, or modified by someone without it)" if plain else
                              "HMAC mismatch (truncated or modified file, or signed with another checkpoint.key)",
                              field="signature")
    try:
        mac = _header(body)[0].get("mac")
    except CheckpointError:
        mac = None
    if mac == "hmac-sha256":
        raise CheckpointRefused("signed with a key (checkpoint.key) and this run has none: give the run the key "
                                "it was written with", field="mac")
    raise CheckpointError("checksum mismatch (truncated or modified file)", field="signature")


def _bound(header: dict, binding: dict | None) -> None:
    """The header's binding must be `binding` (None: not checked)."""
    if binding is None:
        return
    held = header.get("binding")
    if not isinstance(held, dict):
        raise CheckpointError("not a checkpoint of this run (it names no run)", field="binding")
    for k, want in binding.items():
        if held.get(k) != want:
            raise CheckpointError(f"not a checkpoint of this run ({k} is {printable(repr(held.get(k)))[:80]}, "
                                  f"this run's is {want!r})", field=f"binding.{k}")


def loads(blob: bytes, binding: dict | None = None, key: bytes | None = None) -> Any:
    """The object `dumps` wrote; `CheckpointError` for anything else (never executes code). `binding`:
    what the header must bind the state to; `key`: the HMAC key it must be signed with."""
    if len(blob) < len(MAGIC) + 8 + _DIGEST:
        raise CheckpointError(f"truncated: {len(blob)} bytes")
    if blob[:len(MAGIC)] != MAGIC:
        raise CheckpointError("not a fedprism checkpoint (bad magic number)")
    body, digest = blob[:-_DIGEST], blob[-_DIGEST:]
    _verify(body, digest, key)
    header, start = _header(body)
    version = header.get("version")
    if version != VERSION:
        if version == 1:
            raise CheckpointRefused("written by an earlier fedprism in format version 1, which is not bound to "
                                    "its run; this version reads version 2 only", field="version")
        raise CheckpointRefused(f"unsupported checkpoint version {printable(repr(version))[:40]} (this code "
                                f"reads {VERSION})", field="version")
    if header.get("mac") != ("hmac-sha256" if key is not None else "sha256"):
        raise CheckpointError(f"the header's mac {printable(repr(header.get('mac')))[:40]} is not the signature "
                              "it was checked with", field="mac")
    _bound(header, binding)
    tensors = header.get("tensors")
    if not isinstance(tensors, list):
        raise CheckpointError("header has no tensor table", field="header")
    data = memoryview(body)[start:]
    try:
        return _decode(header.get("skeleton"), tensors, data)
    except RecursionError:
        raise CheckpointError("skeleton nested too deeply", field="skeleton") from None
    except CheckpointError as e:
        raise CheckpointError(e.reason, field="skeleton") from None


# -- files ----------------------------------------------------------------------------------------------
def save(path: str | Path, obj: Any, binding: dict | None = None, key: bytes | None = None) -> None:
    """Write `obj` to `path` atomically (unique temporary file in the same folder, fsync, rename), bound
    to `binding` and signed with `key` (HMAC-SHA256) if given."""
    path = Path(path)
    parts = _parts(obj, binding, key)       # the same bytes as `dumps`, written piece by piece
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            digest = _signer(key)
            for piece in parts:
                digest.update(piece)
                f.write(piece)
            f.write(digest.digest())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def load(path: str | Path, binding: dict | None = None, key: bytes | None = None,
         max_bytes: int | None = None, what: str = "checkpoint") -> Any:
    """Read a checkpoint file; `CheckpointError` (with the reason) if it cannot be trusted,
    `CheckpointRefused` if it cannot be used as it is. A file of more than `max_bytes` is refused before
    a byte of it is read. Both name the file (called `what`)."""
    try:
        if max_bytes is not None:
            size = os.stat(path).st_size
            if size > max_bytes:
                raise CheckpointRefused(f"{size} bytes, more than this run's state can take ({max_bytes} bytes at "
                                        "most); not read", field="size")
        blob = Path(path).read_bytes()
        return loads(blob, binding, key)
    except OSError as e:
        raise CheckpointError(f"cannot read it: {e.strerror or e}").at(path, what) from None
    except _Problem as e:
        raise e.at(path, what) from None


def read_key(path: str) -> bytes | None:
    """The HMAC key of `checkpoint.key` (a file's bytes, surrounding whitespace stripped; '' = no key).
    A missing, unreadable or short key file is a ConfigError naming the key."""
    from fedprism.errors import ConfigError

    if not path:
        return None
    allowed = (f"a readable file holding the checkpoint signing key, at least {MIN_KEY_BYTES} bytes (e.g. "
               "`head -c 32 /dev/urandom > FILE` or `openssl rand -hex 32 > FILE`)")
    try:
        key = Path(path).expanduser().read_bytes().strip()
    except OSError as e:
        raise ConfigError("checkpoint.key", path, f"{allowed}; {e.strerror or e}") from None
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError("checkpoint.key", path, f"{allowed}; it holds {len(key)} bytes")
    return key


# -- meaning --------------------------------------------------------------------------------------------
def nbytes(x: Any) -> int:
    """The bytes of the tensors and arrays in a structure (what its checkpoint's data section holds)."""
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (np.ndarray, np.generic)):
        return int(np.asarray(x).nbytes)
    if isinstance(x, dict):
        return sum(nbytes(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return sum(nbytes(v) for v in x)
    return 0


def max_bytes(state_bytes: int, clients: int, params: int) -> int:
    """The largest checkpoint a run may have: four times its initial state (server and clients), plus
    32 bytes per client and model parameter (a model per client in float64 with two optimiser slots:
    CFL's cluster models grow up to one per client), plus 16 MiB for the header."""
    return 4 * state_bytes + 32 * (clients + 1) * params + (16 << 20)


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a tensor {str(x.dtype).replace('torch.', '')} {tuple(x.shape)}"
    if isinstance(x, np.ndarray):
        return f"an array {x.dtype} {x.shape}"
    return f"a {type(x).__name__}"


def check_like(x: Any, initial: Any, where: str, clients: int) -> None:
    """`x` (a checkpoint's server state) against `initial` (the method's state at round 0):
    every name of a dict of `initial` is in `x`, and every tensor or array of `initial` is one of the same
    kind, dtype and number of dimensions in `x`, of the same size in every dimension except the first of a
    stack (two or more dimensions) whose first size is not the number of clients (a stack of models a
    method adds to: CFL's cluster models). Names `initial` does not have (state created on first use) are
    left to the code that uses them. `CheckpointRefused` names the first field that differs."""
    if isinstance(initial, dict):
        if not isinstance(x, dict):
            raise CheckpointRefused(f"{_describe(x)}, the method's state has a dict here", field=where)
        for k, v in initial.items():
            if k not in x:
                raise CheckpointRefused(f"missing (the method's state has names {sorted(map(str, initial))})",
                                        field=f"{where}[{k!r}]")
            check_like(x[k], v, f"{where}[{k!r}]", clients)
        return
    if isinstance(initial, (torch.Tensor, np.ndarray)):
        if type(x) is not type(initial) and not (isinstance(x, torch.Tensor) and isinstance(initial, torch.Tensor)):
            raise CheckpointRefused(f"{_describe(x)}, the method declares {_describe(initial)}", field=where)
        same = x.dtype == initial.dtype and x.ndim == initial.ndim
        if same:
            free = x.ndim >= 2 and initial.shape[0] != clients
            same = tuple(x.shape[1:] if free else x.shape) == tuple(initial.shape[1:] if free else initial.shape)
        if not same:
            raise CheckpointRefused(f"{_describe(x)}, the method declares {_describe(initial)}"
                                    + (" (any first size)" if initial.ndim >= 2 and initial.shape[0] != clients
                                       else ""), field=where)


def check_snapshot(snap: Any, *, rounds: int, stored_rounds: int | None, initial: dict, clients: int,
                   client_rows: dict[str, tuple[tuple, torch.dtype]] | None = None, final: bool = False) -> None:
    """What a checkpoint (or, `final`, a kept final state) says against the run before any of it is used:
    its `round` (0..rounds-1, a kept final state's the last one; a checkpoint's one the store holds:
    below `stored_rounds`), the server state against the method's `initial` one (`check_like`), `seen`
    (one flag per client), `elapsed` (seconds >= 0) and, under `state.storage=mmap`, its pending rows
    against the declared `client_rows` (name -> (row shape, dtype)). Raises `CheckpointRefused`."""
    if not isinstance(snap, dict):
        raise CheckpointRefused(f"{_describe(snap)}, a checkpoint holds a dict")
    r = snap.get("round")
    if not isinstance(r, int) or isinstance(r, bool):
        raise CheckpointRefused(f"{_describe(r)}, an integer round expected", field="round")
    if final and r != rounds - 1:
        raise CheckpointRefused(f"{r}, but this configuration's final round is {rounds - 1} (rounds={rounds})",
                                field="round")
    if not 0 <= r < rounds:
        raise CheckpointRefused(f"{r} is not a round of this run (0..{rounds - 1}, rounds={rounds})", field="round")
    if stored_rounds is not None and r >= stored_rounds:
        held = f"rounds 0..{stored_rounds - 1}" if stored_rounds else "no round"
        raise CheckpointRefused(f"{r}, but the store holds {held} of this run: resuming after round {r} would "
                                "leave rounds missing", field="round")
    check_like(snap.get("state"), initial, "state", clients)
    seen = snap.get("seen")
    if not (isinstance(seen, np.ndarray) and seen.dtype == np.bool_ and seen.shape == (clients,)):
        raise CheckpointRefused(f"{_describe(seen)}, one bool per client expected ({clients},)", field="seen")
    el = snap.get("elapsed", 0.0)
    if isinstance(el, bool) or not isinstance(el, (int, float)) or not (math.isfinite(el) and el >= 0):
        raise CheckpointRefused(f"{printable(repr(el))[:40]}, a number of seconds >= 0 expected", field="elapsed")
    cr = snap.get("client_rows")
    if cr is None or client_rows is None:
        return
    if not isinstance(cr, dict) or not isinstance(cr.get("pending"), dict) or not isinstance(cr.get("written"), dict):
        raise CheckpointRefused("not the row files' record of state.storage=mmap", field="client_rows")
    for k, (shape, dtype) in client_rows.items():
        w = cr["written"].get(k)
        if not (isinstance(w, np.ndarray) and w.dtype == np.bool_ and w.shape == (clients,)):
            raise CheckpointRefused(f"{_describe(w)}, one bool per client expected", field=f"client_rows.written[{k!r}]")
        p = cr["pending"].get(k)
        c, v = (p.get("clients"), p.get("rows")) if isinstance(p, dict) else (None, None)
        if not (isinstance(c, np.ndarray) and c.dtype == np.int64 and c.ndim == 1 and len(np.unique(c)) == len(c)
                and (len(c) == 0 or (c.min() >= 0 and c.max() < clients))):
            raise CheckpointRefused(f"{_describe(c)}, distinct client indices in 0..{clients - 1} expected",
                                    field=f"client_rows.pending[{k!r}].clients")
        if not (isinstance(v, torch.Tensor) and v.dtype == dtype and tuple(v.shape) == (len(c), *shape)):
            want = f"a tensor {str(dtype).replace('torch.', '')} {(len(c), *shape)}"
            raise CheckpointRefused(f"{_describe(v)}, the method declares {want}",
                                    field=f"client_rows.pending[{k!r}].rows")
