"""Where the simulator keeps the clients' own state (`Algorithm.client_state`): the `state.storage` key.

A method that declares client state (fedprism_dual's private components and specialists, Local's
models, Ditto's personal models, ...) has one row per client and state name, `[N, *shape]`. The
runner hands `client_update` and `inference` their clients' rows (`rows`) and commits the rows a
client returns (`write`). Three stores, chosen by `state.storage`:

* ``memory`` (default): one tensor `[N, *shape]` per name in RAM, written whole into every
  checkpoint. Exactly the behaviour of every stored run.
* ``float16``: the same tensors with floating-point state held as IEEE half precision: half the RAM
  and half the checkpoint. Rows are rounded to the nearest float16 when written (and at
  initialisation) and read back in their declared dtype, so the numbers of a run change (a client's
  model loses bits between rounds: relative rounding error <= 2**-11). A value beyond float16's range
  (|v| > 65504) is an error naming the state and the client, never a silent infinity.
* ``mmap``: one raw row file per name beside the run's checkpoint (`<db>.ckpt/<run_id>.rows/`),
  read and written through short-lived `numpy.memmap` views, so RAM holds only the rows in use (the
  cohort's, or one evaluation block's). Bit for bit the numbers of ``memory``. A row never written
  reads as the declaration's initial value (the file is sparse until clients train). Rows written
  during a round are held in RAM (`pending`) and reach the files only after that round's checkpoint
  is on disk (`commit`); the checkpoint carries them, so a run killed at any point resumes exactly:
  the files then hold the rows of the checkpoint's round or of the round before, and the
  checkpoint's pending rows are applied again (idempotent). A sequence number and a random token in
  `meta.json` tie the files to their checkpoint: files of another run, or older or newer than the
  checkpoint, make the runner discard the checkpoint and start the run again (`checkpoint_discarded`).
  The folder is created owner-only and its files are opened without following links
  (`fedprism.experiment.safefs`): a row folder, row file or `meta.json` that is a link planted beside
  a store is never written through (new files replace it; files to resume from are refused).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path

import numpy as np
import torch

from fedprism.experiment.safefs import is_real_dir, is_regular, open_file, private_dir, write_atomic
from fedprism.protocol import ClientState, Context, Rows, _dims

STORAGES = ("memory", "float16", "mmap")
#: float16's largest finite value
FLOAT16_MAX = 65504.0


class StoreMismatch(Exception):
    """A checkpoint's client state cannot be restored into this store: the row files of an `mmap` store
    are not the checkpoint's, or the checkpoint holds other client-state names, shapes or dtypes than the
    method declares (its code changed since the checkpoint was written)."""


def _index(clients) -> torch.Tensor:
    return torch.as_tensor(np.asarray(clients), dtype=torch.long)


def _is_all(clients: np.ndarray, n: int) -> bool:
    """True when `clients` is 0..n-1 in order (the whole federation)."""
    c = np.asarray(clients)
    return len(c) == n and bool((c == np.arange(n)).all())


class ClientStore:
    """``state.storage = memory``: every name's rows `[N, *shape]` in RAM (`data`).

    `rows(clients)` hands `client_update` and `inference` their clients' rows (copies); `write` commits
    the new rows a client returned. The whole store goes into every checkpoint, so a resumed run is exact."""

    storage = "memory"

    def __init__(self, decls: dict[str, ClientState], ctx: Context):
        self.decls, self.ctx = dict(decls), ctx
        self.data: Rows = {k: self._stored(k, d.initial(ctx, ctx.num_clients)) for k, d in decls.items()}

    def _stored(self, name: str, rows: torch.Tensor, clients: np.ndarray | None = None) -> torch.Tensor:
        """Rows as this store keeps them."""
        return rows

    def _declared(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """Stored rows as the method declared them."""
        return rows

    def rows(self, clients: np.ndarray) -> Rows:
        idx = _index(clients)
        return {k: self._declared(k, v[idx]) for k, v in self.data.items()}

    def view(self, clients: np.ndarray) -> Rows:
        """Rows for reading only (evaluation): the stored tensors themselves when `clients` is the whole
        federation in order and they are kept as declared, else `rows(clients)`."""
        if type(self)._declared is ClientStore._declared and _is_all(clients, self.ctx.num_clients):
            return dict(self.data)
        return self.rows(clients)

    def write(self, clients: np.ndarray, rows: Rows) -> None:
        idx = _index(clients)
        for k, v in rows.items():
            if k not in self.data:
                raise KeyError(f"client state {k!r} was not declared (declared: {sorted(self.data)})")
            t = self.data[k]
            t[idx] = self._stored(k, v.detach().to(t.device, self.decls[k].dtype), np.asarray(clients))

    def commit(self) -> None:
        """After a round's checkpoint is on disk (`mmap` moves the round's rows to its files)."""

    # -- checkpoints ------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """What a checkpoint holds of the clients: {'client_state': every row} (the format of every
        stored checkpoint)."""
        return {"client_state": self.data}

    def restore(self, snap: dict, folder: Path | None = None) -> None:
        cs = snap.get("client_state", {})
        if not isinstance(cs, dict) or set(cs) != set(self.data):
            held = sorted(cs) if isinstance(cs, dict) else cs
            raise StoreMismatch(f"checkpoint holds client state {held!r}, "
                             f"the method declares {sorted(self.data)}")
        for k, v in cs.items():
            want = self.data[k]
            if not isinstance(v, torch.Tensor) or v.shape != want.shape or v.dtype != want.dtype:
                raise StoreMismatch(f"checkpoint's client state {k!r} is {getattr(v, 'dtype', type(v))} "
                                 f"{tuple(getattr(v, 'shape', ()))}, this store keeps {want.dtype} {tuple(want.shape)}"
                                 f" (state.storage={self.storage})")
        self.data = cs

    def close(self, keep: bool = False) -> None:
        """Release what the store holds outside RAM (`mmap`: its files unless `keep`)."""


class Float16Store(ClientStore):
    """``state.storage = float16``: floating-point state held in half precision (module docstring)."""

    storage = "float16"

    def __init__(self, decls: dict[str, ClientState], ctx: Context):
        # every client's initial row is the same: convert one row, then copy it (no [N, P] float32 on the way)
        self.decls, self.ctx = dict(decls), ctx
        self.data = {}
        for k, d in self.decls.items():
            one = self._stored(k, d.initial(ctx, 1))
            self.data[k] = one.expand(ctx.num_clients, *one.shape[1:]).clone()

    def _half(self, name: str) -> bool:
        return self.decls[name].dtype.is_floating_point

    def _stored(self, name: str, rows: torch.Tensor, clients: np.ndarray | None = None) -> torch.Tensor:
        if not self._half(name) or rows.numel() == 0:
            return rows.to(torch.float16) if self._half(name) else rows
        h = rows.to(torch.float16)
        bad = (torch.isinf(h) & torch.isfinite(rows)).reshape(len(rows), -1).any(1)
        if bool(bad.any()):
            r = int(bad.nonzero()[0, 0])
            v = rows.reshape(len(rows), -1)[r]
            v = float(v[torch.isfinite(v)].abs().max())
            who = f"client {int(clients[r])}" if clients is not None else f"row {r}"
            raise ValueError(f"state.storage=float16 cannot hold client state {name!r} of {who}: a value of "
                             f"{v:.6g} is beyond float16's range (|v| <= {FLOAT16_MAX:g}); use state.storage=memory "
                             "or mmap")
        return h

    def _declared(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        return rows.to(self.decls[name].dtype) if self._half(name) else rows


class MmapStore(ClientStore):
    """``state.storage = mmap``: rows in files beside the checkpoint (module docstring).

    `folder` holds `<name>.rows` (C-order rows of the declared dtype, `N x prod(shape)`) and
    `meta.json` (token, commit sequence number, shapes)."""

    storage = "mmap"

    def __init__(self, decls: dict[str, ClientState], ctx: Context, folder: str | Path):
        self.decls, self.ctx = dict(decls), ctx
        self.N = ctx.num_clients
        self.folder = Path(folder)
        self.shapes = {k: _dims(d.shape, ctx) for k, d in self.decls.items()}
        self.np_dtypes = {k: torch.empty(0, dtype=d.dtype).numpy().dtype for k, d in self.decls.items()}
        self.pending: dict[str, dict[int, torch.Tensor]] = {k: {} for k in self.decls}
        self.written = {k: np.zeros(self.N, dtype=bool) for k in self.decls}
        self.seq = 0
        self.token = secrets.token_hex(8)
        self._ready = False          # no file is touched before the first commit (a resumed run restores)

    # -- files ------------------------------------------------------------------------------------
    def _path(self, name: str) -> Path:
        return self.folder / f"{name}.rows"

    def _row_items(self, name: str) -> int:
        return int(np.prod(self.shapes[name], dtype=np.int64))

    def _map(self, name: str, mode: str) -> np.memmap | None:
        if self.N == 0 or self._row_items(name) == 0:
            return None
        with open_file(self._path(name), "rb" if mode == "r" else "r+b") as f:   # a link is never mapped
            return np.memmap(f, dtype=self.np_dtypes[name], mode=mode, shape=(self.N, self._row_items(name)))

    def _create(self) -> None:
        """Fresh, sparse row files (every row unwritten) and their meta.json, in an owner-only folder; a
        link found at the folder's place is removed (never written through), as are links in it."""
        self._ready = True
        if os.path.islink(self.folder):
            os.unlink(self.folder)
        private_dir(self.folder)
        for k in self.decls:
            p = self._path(k)
            if os.path.lexists(p) and not is_regular(p):
                p.unlink()                   # a link or a special file: replaced by a new file, never opened
            with open_file(p, "wb") as f:
                f.truncate(self.N * self._row_items(k) * self.np_dtypes[k].itemsize)
        self._write_meta()

    def _meta(self) -> dict:
        return {"format": "fedprism-client-rows", "token": self.token, "seq": self.seq, "clients": self.N,
                "state": {k: {"shape": list(self.shapes[k]), "dtype": str(self.np_dtypes[k])} for k in self.decls}}

    def _write_meta(self) -> None:
        write_atomic(self.folder / "meta.json", json.dumps(self._meta(), sort_keys=True).encode())

    def _read_meta(self) -> dict:
        if not is_real_dir(self.folder):
            raise StoreMismatch(f"{self.folder} is not a folder (missing, or a link: never read through)")
        try:
            with open_file(self.folder / "meta.json", "rb") as f:
                return json.loads(f.read(1 << 20))
        except (OSError, ValueError) as e:             # UnsafePath is an OSError
            raise StoreMismatch(f"no readable {self.folder / 'meta.json'} ({type(e).__name__})") from None

    # -- rows -------------------------------------------------------------------------------------
    def rows(self, clients: np.ndarray) -> Rows:
        c = np.asarray(clients, dtype=np.int64)
        out: Rows = {}
        for k, d in self.decls.items():
            res = torch.empty((len(c), *self.shapes[k]), dtype=d.dtype)
            w = self.written[k][c] if len(c) else np.zeros(0, dtype=bool)
            if (~w).any():
                res[torch.as_tensor(~w)] = d.initial(self.ctx, int((~w).sum()))
            if w.any():
                mm = self._map(k, "r")
                if mm is not None:
                    res[torch.as_tensor(w)] = torch.from_numpy(np.asarray(mm[c[w]])).reshape(-1, *self.shapes[k])
                del mm
            pend = self.pending[k]
            if pend:
                for i, ci in enumerate(c.tolist()):
                    if ci in pend:
                        res[i] = pend[ci]
            out[k] = res
        return out

    def view(self, clients: np.ndarray) -> Rows:
        return self.rows(clients)

    @property
    def data(self) -> Rows:   # type: ignore[override]
        """Every row, in RAM (for small federations and tests; the runner never asks for it)."""
        return self.rows(np.arange(self.N))

    def write(self, clients: np.ndarray, rows: Rows) -> None:
        c = np.asarray(clients, dtype=np.int64)
        for k, v in rows.items():
            if k not in self.decls:
                raise KeyError(f"client state {k!r} was not declared (declared: {sorted(self.decls)})")
            v = v.detach().to("cpu", self.decls[k].dtype)
            for i, ci in enumerate(c.tolist()):
                self.pending[k][ci] = v[i].clone()

    def _apply(self, pending: dict[str, tuple[np.ndarray, torch.Tensor]]) -> None:
        """Write rows to the files and flush them (then mark them written)."""
        for k, (c, v) in pending.items():
            if len(c) == 0:
                continue
            mm = self._map(k, "r+")
            if mm is not None:
                order = np.argsort(c, kind="stable")
                mm[c[order]] = v.reshape(len(c), -1)[torch.as_tensor(order)].numpy()
                mm.flush()
                del mm
            self.written[k][c] = True

    def _pending_arrays(self) -> dict[str, tuple[np.ndarray, torch.Tensor]]:
        out = {}
        for k, pend in self.pending.items():
            c = np.array(sorted(pend), dtype=np.int64)
            v = torch.stack([pend[int(i)] for i in c]) if len(c) else torch.zeros((0, *self.shapes[k]),
                                                                                 dtype=self.decls[k].dtype)
            out[k] = (c, v)
        return out

    def commit(self) -> None:
        """The round's checkpoint is on disk: move its rows to the files, then advance the sequence."""
        if not self._ready:
            self._create()
        self._apply(self._pending_arrays())
        self.pending = {k: {} for k in self.decls}
        self.seq += 1
        self._write_meta()

    # -- checkpoints ------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """{'client_rows': token, the commit this checkpoint ends with, the rows written since the last
        commit and which rows the files hold once they are applied}."""
        pend = self._pending_arrays()
        written = {k: self.written[k] | np.isin(np.arange(self.N), pend[k][0]) for k in self.decls}
        return {"client_rows": {"storage": "mmap", "token": self.token, "seq": self.seq + 1,
                                "pending": {k: {"clients": c, "rows": v} for k, (c, v) in pend.items()},
                                "written": written}}

    def restore(self, snap: dict, folder: Path | None = None) -> None:
        """Point the store at the files of `snap` (in `folder`, default its own) and bring them to the
        checkpoint's commit. Raises StoreMismatch when the files cannot be those of this checkpoint."""
        cr = snap.get("client_rows")
        if not isinstance(cr, dict) or cr.get("storage") != "mmap":
            raise StoreMismatch("the checkpoint holds no row files (it was written with another state.storage)")
        if folder is not None:
            self.folder = Path(folder)
        meta = self._read_meta()
        want = {k: {"shape": list(self.shapes[k]), "dtype": str(self.np_dtypes[k])} for k in self.decls}
        if meta.get("token") != cr.get("token"):
            raise StoreMismatch(f"the row files in {self.folder} belong to another run or attempt")
        if meta.get("clients") != self.N or meta.get("state") != want:
            raise StoreMismatch(f"the row files in {self.folder} hold other shapes: {meta.get('state')} vs {want}")
        seq = cr.get("seq")
        if not isinstance(seq, int) or meta.get("seq") not in (seq - 1, seq):
            raise StoreMismatch(f"the row files are at commit {meta.get('seq')}, the checkpoint at {seq}")
        for k in self.decls:
            p = self._path(k)
            need = self.N * self._row_items(k) * self.np_dtypes[k].itemsize
            if not is_regular(p) or p.stat().st_size != need:
                raise StoreMismatch(f"{p} is missing or not {need} bytes, or not a regular file (a link is never "
                                    "written through)")
        written, pend = cr.get("written", {}), cr.get("pending", {})
        if set(written) != set(self.decls) or set(pend) != set(self.decls):
            raise StoreMismatch(f"the checkpoint's client rows name {sorted(written)}, the method declares "
                                f"{sorted(self.decls)}")
        self.token, self.seq, self._ready = cr["token"], seq, True
        self.pending = {k: {} for k in self.decls}
        self.written = {k: np.asarray(written[k], dtype=bool).copy() for k in self.decls}
        self._apply({k: (np.asarray(v["clients"], dtype=np.int64), v["rows"]) for k, v in pend.items()})
        if folder is None:
            self._write_meta()

    def move_to(self, dest: str | Path) -> None:
        """Move the row files (committed, nothing pending) to `dest` (a kept final state)."""
        if any(self.pending.values()):
            raise RuntimeError("commit the pending rows before moving the row files")
        if not self._ready:
            self._create()
        dest = Path(dest)
        if os.path.islink(dest) or (os.path.lexists(dest) and not is_real_dir(dest)):
            os.unlink(dest)                  # a link (or a file) in the way goes, never what it names
        elif dest.exists():
            shutil.rmtree(dest)
        private_dir(dest.parent)
        os.replace(self.folder, dest)
        self.folder = dest

    def close(self, keep: bool = False) -> None:
        if not keep:
            shutil.rmtree(self.folder, ignore_errors=True)


def make_store(storage: str, decls: dict[str, ClientState], ctx: Context, folder: str | Path | None = None
               ) -> ClientStore:
    """The client store of `state.storage`; `mmap` needs the folder of its row files. A method without
    client state gets the empty memory store, whatever the key says."""
    if storage == "memory" or not decls:
        return ClientStore(decls, ctx)
    if storage == "float16":
        return Float16Store(decls, ctx)
    if storage == "mmap":
        if folder is None:
            raise ValueError("state.storage=mmap needs a folder for its row files")
        return MmapStore(decls, ctx, folder)
    raise ValueError(f"state.storage must be one of {', '.join(STORAGES)}, got {storage!r}")
