"""Checkpoints that cannot run code: a JSON skeleton plus raw tensor bytes, checksummed.

A run's algorithm state is a nested structure of dicts, lists and tuples whose leaves are torch
tensors, numpy arrays, numpy scalars and plain values (bool, int, float, str, None). It is written
as one file, `<db>.ckpt/<run_id>.ckpt`:

    8 bytes   magic  b"FPCKPT\\x00\\x01"
    8 bytes   length of the header (little-endian unsigned)
    header    UTF-8 JSON: {"format": "fedprism-checkpoint", "version": 1, "skeleton": ...,
                           "tensors": [{"kind", "dtype", "shape", "offset", "nbytes", ...}, ...]}
    data      the tensors' bytes, one after another (C order, little-endian)
    32 bytes  SHA-256 of everything before it

Reading parses JSON and turns byte ranges into arrays of an allow-listed dtype (`numpy.frombuffer`):
there is no pickle anywhere, so a file received from someone else can be wrong but never executes
anything. Every failure (bad magic, unknown version, checksum mismatch, truncation, a skeleton that
points outside the data) raises `CheckpointError` with the reason; the runner then starts the run
from round 0 and records why (`checkpoint_discarded`).

Writes go to a unique temporary file in the same folder (`tempfile.mkstemp`), are flushed and
fsync'ed, then renamed over the old checkpoint (`os.replace`), so a reader sees the old or the new
checkpoint, never half of one.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

MAGIC = b"FPCKPT\x00\x01"
FORMAT = "fedprism-checkpoint"
VERSION = 1
SUFFIX = ".ckpt"
_DIGEST = 32
_MAX_HEADER = 1 << 30

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


class CheckpointError(Exception):
    """A checkpoint file is unreadable, truncated, tampered with or of an unknown format."""


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


def _parts(obj: Any) -> list[bytes | memoryview]:
    """The pieces of the checkpoint body of `obj`, in order (magic, header length, header, tensor bytes)."""
    w = _Writer()
    skeleton = w.encode(obj, "state")
    header = json.dumps({"format": FORMAT, "version": VERSION, "skeleton": skeleton, "tensors": w.entries},
                        separators=(",", ":"), allow_nan=False).encode()
    return [MAGIC, struct.pack("<Q", len(header)), header, *w.chunks]


def dumps(obj: Any) -> bytes:
    """The checkpoint bytes of `obj` (raises TypeError naming the first value it cannot hold)."""
    body = b"".join(_parts(obj))
    return body + hashlib.sha256(body).digest()


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


def loads(blob: bytes) -> Any:
    """The object `dumps` wrote; `CheckpointError` for anything else (never executes code)."""
    if len(blob) < len(MAGIC) + 8 + _DIGEST:
        raise CheckpointError(f"truncated: {len(blob)} bytes")
    if blob[:len(MAGIC)] != MAGIC:
        raise CheckpointError("not a fedprism checkpoint (bad magic number)")
    body, digest = blob[:-_DIGEST], blob[-_DIGEST:]
    if hashlib.sha256(body).digest() != digest:
        raise CheckpointError("checksum mismatch (truncated or modified file)")
    (hlen,) = struct.unpack("<Q", body[len(MAGIC):len(MAGIC) + 8])
    start = len(MAGIC) + 8
    if hlen > min(_MAX_HEADER, len(body) - start):
        raise CheckpointError("header length exceeds the file")
    try:
        header = json.loads(body[start:start + hlen].decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"unreadable header ({type(e).__name__})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise CheckpointError("not a fedprism checkpoint header")
    if header.get("version") != VERSION:
        raise CheckpointError(f"unsupported checkpoint version {header.get('version')!r} (this code reads {VERSION})")
    tensors = header.get("tensors")
    if not isinstance(tensors, list):
        raise CheckpointError("header has no tensor table")
    data = memoryview(body)[start + hlen:]
    try:
        return _decode(header.get("skeleton"), tensors, data)
    except RecursionError:
        raise CheckpointError("skeleton nested too deeply") from None


# -- files ----------------------------------------------------------------------------------------------
def save(path: str | Path, obj: Any) -> None:
    """Write `obj` to `path` atomically (unique temporary file in the same folder, fsync, rename)."""
    path = Path(path)
    parts = _parts(obj)                   # the same bytes as `dumps`, written piece by piece
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            digest = hashlib.sha256()
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


def load(path: str | Path) -> Any:
    """Read a checkpoint file; `CheckpointError` (with the reason) if it cannot be trusted."""
    try:
        blob = Path(path).read_bytes()
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from None
    return loads(blob)
