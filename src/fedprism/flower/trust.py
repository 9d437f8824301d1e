"""What the ServerApp believes of a node, and what it checks before believing it (docs/flower.md, "Trust
and failure semantics").

    Registry          the operator's file: node key -> client id (and optionally its sample count)
    node_keys         the keys a node can be recognised by: its authentication public key's fingerprint
                      (Flower's Grid gives the ServerApp `NodeInfo.public_key` in a deployment with
                      `--enable-supernode-auth`) and its Flower node id
    parse_identity    every field of an identity reply, parsed under a guard (a refusal names the field)
    sample_count      a reported sample count -> the count the server uses (capped), or a refusal
    update_norm       the norm of an upload relative to what the client was sent

No Flower import: unit-testable without Flower.
"""

from __future__ import annotations

import hashlib
import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

#: sample counts above this are not exact integers in float64 (train replies carry n_samples as a float)
EXACT_COUNT = 2 ** 53
#: an update whose norm exceeds float32's largest value overflows any float32 model arithmetic
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


class Refused(ValueError):
    """A node's message that the server does not accept; `field` names what was wrong."""

    def __init__(self, field_name: str, why: str):
        super().__init__(f"{field_name}: {why}")
        self.field = field_name


def fingerprint(public_key: bytes) -> str:
    """'sha256:<hex>' of a node's authentication public key as Flower stores it (`NodeInfo.public_key`)."""
    return "sha256:" + hashlib.sha256(bytes(public_key)).hexdigest()


def openssh_fingerprint(openssh_public_key: bytes) -> str:
    """The registry key of an OpenSSH EC public key file (what `flwr supernode register` takes): Flower
    stores and reports it as PEM SubjectPublicKeyInfo bytes, whose SHA-256 is the fingerprint."""
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_ssh_public_key(openssh_public_key)
    return fingerprint(key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))


def node_keys(node_id: int, public_key: bytes | None) -> list[str]:
    """The registry keys a node is recognised by, strongest first: its key fingerprint, its node id."""
    keys = [fingerprint(public_key)] if public_key else []
    return keys + [f"node:{int(node_id)}"]


@dataclass(frozen=True)
class Entry:
    client: int
    samples: int | None = None


@dataclass
class Registry:
    """node key ('sha256:<hex>' of the public key, or 'node:<Flower node id>') -> Entry."""

    entries: dict[str, Entry] = field(default_factory=dict)
    path: str = ""

    @classmethod
    def load(cls, path: str, num_clients: int) -> "Registry":
        """JSON `{"nodes": {"sha256:ab..": {"client": 0, "samples": 120}, "node:7": 1}}` or the same as TOML
        (`[nodes."sha256:ab.."]` with `client = 0`, `samples = 120`). Every client id at most once."""
        p = Path(path)
        text = p.read_text()
        if p.suffix.lower() == ".toml":
            doc = tomllib.loads(text)
        else:
            doc = json.loads(text)
        nodes = doc.get("nodes") if isinstance(doc, dict) else None
        if not isinstance(nodes, dict):
            raise ValueError(f"registry {path}: needs a 'nodes' table (node key -> client id)")
        out: dict[str, Entry] = {}
        owner: dict[int, str] = {}
        for key, v in nodes.items():
            if not (isinstance(key, str) and (key.startswith("sha256:") or key.startswith("node:"))):
                raise ValueError(f"registry {path}: key {key!r} is neither 'sha256:<hex>' nor 'node:<id>'")
            if key.startswith("sha256:"):
                key = key.lower()
            spec = {"client": v} if not isinstance(v, dict) else v
            cid, samples = spec.get("client"), spec.get("samples")
            if isinstance(cid, bool) or not isinstance(cid, int) or not 0 <= cid < num_clients:
                raise ValueError(f"registry {path}: {key}: client must be an integer in [0, {num_clients - 1}]")
            if samples is not None and (isinstance(samples, bool) or not isinstance(samples, int) or samples < 0):
                raise ValueError(f"registry {path}: {key}: samples must be an integer >= 0")
            if cid in owner:
                raise ValueError(f"registry {path}: client {cid} is registered twice ({owner[cid]}, {key})")
            owner[cid] = key
            out[key] = Entry(cid, samples)
        return cls(out, str(path))

    def lookup(self, keys: list[str]) -> tuple[str, Entry] | None:
        for k in keys:
            if k in self.entries:
                return k, self.entries[k]
        return None

    def samples_of(self, client: int) -> int | None:
        for e in self.entries.values():
            if e.client == client:
                return e.samples
        return None


def load_registry(path: str, num_clients: int) -> Registry:
    """`Registry.load` for a run: any failure (no such file, a folder, unreadable, not JSON / TOML, a bad
    entry) is a ConfigError naming the run-config key `registry`, its value and what is wrong, raised
    before anything is started or written (`simulate` and `serve` call it first)."""
    from fedprism.errors import ConfigError

    what = ("a JSON or TOML file with a 'nodes' table: node key ('sha256:<hex>' or 'node:<id>') -> client id "
            "(docs/flower.md, 'Trust and failure semantics')")
    try:
        return Registry.load(path, num_clients)
    except IsADirectoryError:
        why = "it is a folder"
    except FileNotFoundError:
        why = "no such file"
    except PermissionError:
        why = "permission denied"
    except UnicodeDecodeError:
        why = "not UTF-8 text"
    except OSError as e:
        why = f"cannot be read ({e.strerror or type(e).__name__})"
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        why = f"not valid {'TOML' if Path(path).suffix.lower() == '.toml' else 'JSON'} ({e})"
    except ValueError as e:          # an entry `Registry.load` refuses
        why = str(e).removeprefix(f"registry {path}: ")
    raise ConfigError("registry", path, f"{what}; {why}", kind="run-config key")


# -- fields ------------------------------------------------------------------------------------------
def _int(info: dict, key: str, low: int | None = None, high: int | None = None) -> int:
    if key not in info:
        raise Refused(key, "missing")
    v = info[key]
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise Refused(key, f"must be an integer, got {type(v).__name__} {_short(v)}")
    v = int(v)
    if (low is not None and v < low) or (high is not None and v > high):
        raise Refused(key, f"{v} outside [{low}, {high if high is not None else 'inf'}]")
    return v


def _int_list(info: dict, key: str, length: int | None = None, low: int = 0) -> list[int]:
    if key not in info:
        raise Refused(key, "missing")
    v = info[key]
    if isinstance(v, (str, bytes)) or not isinstance(v, (list, tuple)):
        raise Refused(key, f"must be a list of integers, got {type(v).__name__}")
    if length is not None and len(v) != length:
        raise Refused(key, f"must have {length} entries, got {len(v)}")
    if not v or any(isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < low for x in v):
        raise Refused(key, f"must be a non-empty list of integers >= {low}, got {_short(v)}")
    return [int(x) for x in v]


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


@dataclass(frozen=True)
class Identity:
    client: int
    config_id: str
    input_shape: tuple[int, ...]
    num_classes: int
    param_size: int
    num_examples: int
    label_hist: tuple[int, ...]


def parse_identity(info: Any, num_clients: int, config_id: str) -> Identity:
    """Every field of an identity reply, each under a guard; raises `Refused` naming the first bad field.
    Order: client-id, config-id (a node of another experiment is refused before its data is looked at),
    input-shape, num-classes, param-size, num-examples, label-hist."""
    if not isinstance(info, dict):
        raise Refused("identity", f"must be a record of fields, got {type(info).__name__}")
    cid = _int(info, "client-id", 0, num_clients - 1)
    cfg = info.get("config-id")
    if not isinstance(cfg, str):
        raise Refused("config-id", f"must be a string, got {_short(cfg)}")
    if cfg != config_id:
        raise Refused("config-id", f"node runs experiment {_short(cfg)}, server runs {config_id} "
                                   "(give every node and the server the same experiment)")
    shape = tuple(_int_list(info, "input-shape", low=1))
    if len(shape) > 8 or math.prod(shape) > 2 ** 31:
        raise Refused("input-shape", f"implausible shape {_short(shape)}")
    classes = _int(info, "num-classes", 1, 1_000_000)
    psize = _int(info, "param-size", 1, 2 ** 40)
    n = _int(info, "num-examples", 0, EXACT_COUNT)
    hist = tuple(_int_list(info, "label-hist", length=classes, low=0))
    if sum(hist) != n:
        raise Refused("label-hist", f"sums to {sum(hist)}, num-examples says {n}")
    return Identity(cid, cfg, shape, classes, psize, n, hist)


def scaled_hist(hist: tuple[int, ...], n: int) -> np.ndarray:
    """A label histogram scaled to sum to n (largest remainders), for a capped or registered count."""
    h = np.asarray(hist, dtype=np.float64)
    total = h.sum()
    if total <= 0 or int(total) == n:
        return np.asarray(hist, dtype=np.int64)
    exact = h * (n / total)
    out = np.floor(exact).astype(np.int64)
    rest = n - int(out.sum())
    if rest > 0:
        out[np.argsort(-(exact - out), kind="stable")[:rest]] += 1
    return out


def sample_count(value: Any, cap: int | None, field_name: str = "n_samples") -> tuple[float, bool]:
    """A reported sample count -> (the count the server uses, whether it was capped). Not a number, not
    finite, negative, not an integer or beyond float64's exact integers (2^53): `Refused`. Above `cap`:
    `cap` (None: no cap)."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise Refused(field_name, f"not a number: {_short(value)}") from None
    if not math.isfinite(v) or v < 0:
        raise Refused(field_name, f"{v!r} is not a finite number >= 0")
    if v != math.floor(v) or v > EXACT_COUNT:
        raise Refused(field_name, f"{v!r} is not an exact sample count (an integer <= 2^53)")
    if cap is not None and v > cap:
        return float(cap), True
    return v, False


def laplace_hist(hist, epsilon: float, rng: np.random.Generator) -> np.ndarray:
    """A label histogram released with epsilon-differential privacy (Laplace mechanism; Dwork, McSherry,
    Nissim, Smith 2006, "Calibrating Noise to Sensitivity in Private Data Analysis"): adding or removing
    one sample changes one count by 1 (L1 sensitivity 1), so each count gets Laplace(1/epsilon) noise;
    rounding to integers and clipping at 0 are post-processing. The total of the released histogram is
    the released sample count."""
    h = np.asarray(hist, dtype=np.float64)
    noisy = h + rng.laplace(0.0, 1.0 / epsilon, size=h.shape)
    return np.clip(np.rint(noisy), 0, None).astype(np.int64)


def update_norm(payload: dict[str, torch.Tensor], sent: dict[str, torch.Tensor]) -> float:
    """The norm (float64) of one client's upload relative to what it was sent, over its floating tensors:
    a tensor with a sent tensor of the same name and shape counts as the difference; one whose sent
    tensor of the same name stacks several candidates (IFCA's [1, K, P] models for a [1, P] upload)
    counts as the difference to the nearest candidate; any other as itself."""
    total = 0.0
    for k, v in payload.items():
        if not v.is_floating_point():
            continue
        x = v.double()
        s = sent.get(k, sent.get("models") if k == "params" else None)
        if s is not None and s.shape == v.shape:
            d = float((x - s.double()).norm())
        elif s is not None and s.dim() == v.dim() + 1 and s.shape[0] == v.shape[0] and s.shape[2:] == v.shape[1:]:
            d = float((x.unsqueeze(1) - s.double()).flatten(2).norm(dim=2).min())
        else:
            d = float(x.norm())
        total += d * d
    return math.sqrt(total) if math.isfinite(total) else math.inf


def clip_update(payload: dict[str, torch.Tensor], sent: dict[str, torch.Tensor], bound: float, norm: float
                ) -> dict[str, torch.Tensor]:
    """The upload scaled toward what was sent so that `update_norm` is `bound` (same reference as there)."""
    f = bound / norm
    out = {}
    for k, v in payload.items():
        if not v.is_floating_point():
            out[k] = v
            continue
        s = sent.get(k, sent.get("models") if k == "params" else None)
        x = v.double()
        if s is not None and s.shape == v.shape:
            ref = s.double()
        elif s is not None and s.dim() == v.dim() + 1 and s.shape[0] == v.shape[0] and s.shape[2:] == v.shape[1:]:
            i = (x.unsqueeze(1) - s.double()).flatten(2).norm(dim=2).argmin(1)
            ref = s.double()[torch.arange(len(i)), i]
        else:
            ref = torch.zeros_like(x)
        out[k] = (ref + f * (x - ref)).to(v.dtype)
    return out
