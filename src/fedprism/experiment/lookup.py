"""A stored result without the start-up: `fedprism run` and `fedprism.run` answer a configuration whose
finished run is in the store without importing torch, numpy, or any method, dataset, model or partition
module.

Asking for a stored run cost what a run costs before its first round (torch, the method's module, the
dataset loaded and partitioned), because two things need all of it: the run id hashes the configuration
as *resolved* (every method parameter's default, the kernels that would run here:
`fedprism.experiment.config.resolve`), and a stored result is returned only when the code and data
fingerprints recorded with it equal the current ones (`fedprism.experiment.provenance`, the reuse rule of
docs/reproducibility.md). Both are functions of what the command was given and of what is on this
machine, so the full path remembers them, one small JSON file per configuration under
``<cache root>/lookup/`` (``$FEDPRISM_CACHE``, else ``~/.cache/fedprism``):

    the resolved configuration (its values, the kernel keys that were `auto`, and the method's
    parameter declarations the run id reads: default, `new`, `eval_only`), the provenance fingerprints the
    full path computed (code and data), and the dataset's files as the full path found them (each search
    folder up to the one it read, and that folder's files: size and modification time).

The file's name is a key over everything those values depend on (`key`): the configuration as given
(after reading the TOML file and the overrides), the bytes of every file of the fedprism package, the
Python executable and version, where torch, numpy, scipy and scikit-learn are installed and their files'
modification times, the `FEDPRISM_*`, `CUDA_VISIBLE_DEVICES`, `CC` and `CXX` environment variables, the
NVIDIA devices present, the working directory (relative `data.root`), the plugins' entry points and the
built CPU kernels (`fedprism.kernels`). An edit anywhere in fedprism, a reinstalled library, another
data folder: another key, and the full path runs again.

A lookup (`stored_result`) answers from the memo only when all of this holds, and otherwise returns None
and the full path (`Experiment`) runs and decides, exactly as it did before, errors included:

* the process has not imported torch: a process that has paid for it gains nothing, and may hold
  in-process changes (registrations, patched functions) that the key cannot see;
* an entry exists for the key, and its dataset files are as recorded;
* the method, dataset, model and partition are fedprism's own (checked when the entry is written: a
  plugin's code lies outside the key);
* no `checkpoint.key` is set (the full path reads the key file even for a stored run, and refuses one it
  cannot read);
* the store exists and holds the run (`prefer_stored` applied, as the full path does) as finished, and the
  fingerprints recorded with it are those remembered (`provenance.differences` is empty). Where they
  differ, the full path raises `ProvenanceMismatch`, as before.

The answer is then what the full path gives for a finished run: the store's `start_run` with the
remembered provenance (the same check, the relabel of `name`, the `text` hashes of an older run), and the
stored final metrics and rounds. What is not repeated: the one-line notes and warnings of building the run
(the kernels note, "nothing personal"), which concern a run that is not run.

Entries are written only by the full path of a process that started without torch (`Recorder`), once
the run finished, and only when the entry, read back, gives the same run id, training id and
PyTorch-kernels alternative as the configuration it records; at most `MAX_ENTRIES` are kept.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from fedprism.experiment.config import Config, prefer_stored
from fedprism.hparams import Param

#: the entries' format; another format is another key
FORMAT = 1
#: libraries whose installation the remembered values depend on (torch: the kernels' build key and
#: resolution; numpy, scipy, scikit-learn: the loaders, partitions and data fingerprints)
LIBRARIES = ("torch", "numpy", "scipy", "sklearn")
#: environment variables read on the way to a run id or a fingerprint, besides every FEDPRISM_* one
ENVIRONMENT = ("CUDA_VISIBLE_DEVICES", "CC", "CXX")
#: the most entries kept (a few kB each): every edit of fedprism is another key, so a working tree leaves
#: entries behind; past this many, the least recently written tenth is removed when one is written
MAX_ENTRIES = 4000


def memo_dir() -> Path:
    from fedprism.machine import cache_root

    return cache_root() / "lookup"


def pristine() -> bool:
    """Whether this process may answer from, and write, the memo: it has not imported torch."""
    return "torch" not in sys.modules


def code_hash(root: Path | None = None) -> str:
    """sha256 over every file of the fedprism package (relative path, size and bytes); read again at every
    call (a few milliseconds), so that an edit between two calls of one process is seen."""
    if root is None:
        import fedprism

        root = Path(fedprism.__file__).resolve().parent
    h = hashlib.sha256()
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
        for name in sorted(files):
            if name.endswith((".pyc", ".pyo")):
                continue
            p = Path(folder, name)
            data = p.read_bytes()
            h.update(f"{p.relative_to(root).as_posix()}\0{len(data)}\0".encode())
            h.update(data)
    return h.hexdigest()


def _stat(path: Path) -> list | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns]


def _libraries() -> dict[str, Any]:
    import importlib.util

    out: dict[str, Any] = {}
    for name in LIBRARIES:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        origin = spec.origin if spec is not None else None
        out[name] = [origin, _stat(Path(origin)) if origin else None]
    return out


def _plugins() -> list[list[str]]:
    from importlib.metadata import entry_points

    found = entry_points()                      # every distribution's, read once, then selected by group
    return sorted([ep.group, ep.name, ep.value] for kind in ("methods", "datasets", "models", "partitions")
                  for ep in found.select(group=f"fedprism.{kind}"))


def _kernels() -> list:
    from fedprism.machine import cache_root

    folder = cache_root() / "kernels"
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    return [[n, _stat(folder / n)] for n in names]


def key(raw: dict[str, Any]) -> str | None:
    """The memo key of the configuration `raw` (flat keys, as given) on this machine now; None when `raw`
    holds a value that is not plain JSON (a TOML date): such a configuration is always built."""
    try:
        given = json.dumps(raw, sort_keys=True, allow_nan=True)
    except (TypeError, ValueError):
        return None
    parts = {"format": FORMAT, "config": given, "code": code_hash(),
             "python": [sys.version, sys.executable, sys.prefix], "libraries": _libraries(),
             "environment": {k: v for k, v in sorted(os.environ.items())
                             if k.startswith("FEDPRISM_") or k in ENVIRONMENT},
             "devices": [os.path.exists(p) for p in ("/dev/nvidiactl", "/proc/driver/nvidia/version")],
             "cwd": os.getcwd(), "plugins": _plugins(), "kernels": _kernels()}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _path(k: str) -> Path:
    return memo_dir() / f"{k}.json"


def _read(k: str) -> dict | None:
    try:
        entry = json.loads(_path(k).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    need = ("format", "values", "auto", "declared", "ids", "provenance", "files")
    if not isinstance(entry, dict) or entry.get("format") != FORMAT or any(n not in entry for n in need):
        return None
    return entry


def _declared(entry: dict) -> dict[str, Param]:
    return {k: Param(d, "", new=bool(new), eval_only=bool(ev))
            for k, (d, new, ev) in entry["declared"].items()}


def config_of(entry: dict) -> Config:
    """The resolved configuration an entry records, its run id read from the recorded declarations."""
    return Config(dict(entry["values"]), frozenset(entry["auto"]), _declared(entry))


def _ids(cfg: Config) -> list[str]:
    """The run id, the training id and the run id with PyTorch's kernels for the `auto` keys
    (`prefer_stored`'s alternative) of `cfg`: what an entry must reproduce."""
    alt = Config({**cfg.values, **{k: "aten" for k in cfg.auto}}, cfg.auto, cfg.declared)
    return [cfg.run_id, cfg.train_id, alt.run_id]


def _files_now(files: list) -> list:
    return [[p, _stat(Path(p))] for p, _ in files]


def stored_result(raw: dict[str, Any], db: str | os.PathLike) -> tuple[Config, Any] | None:
    """(configuration, RunResult) of the finished stored run that `raw` asks for in the store `db`,
    answered from the memo without building anything; None where the full path must decide (module
    docstring)."""
    if not pristine() or not isinstance(db, (str, os.PathLike)) or not Path(db).is_file():
        return None
    k = key(raw)
    entry = _read(k) if k is not None else None
    try:                                   # an entry of another shape (damaged, crafted) is no entry
        if (entry is None or entry["values"].get("checkpoint.key")
                or _files_now(entry["files"]) != entry["files"] or not isinstance(entry["provenance"], dict)):
            return None
        cfg = config_of(entry)
        cfg.run_id                         # read here: declarations of another shape raise now
    except (TypeError, ValueError, KeyError, AttributeError):
        return None
    from fedprism.experiment.provenance import differences
    from fedprism.experiment.result import RunResult
    from fedprism.experiment.store import Store

    store = Store(db)
    try:
        cfg = prefer_stored(cfg, store)
        row = store.run(cfg.run_id)
        if row is None or row["status"] != "finished":
            return None
        if differences(store.provenance(cfg.run_id), entry["provenance"]):
            return None                    # the full path says what changed (ProvenanceMismatch)
        store.start_run(cfg.run_id, cfg.values, None, provenance=entry["provenance"])
        final = json.loads(row["final"]) if row["final"] else {}
        return cfg, RunResult(cfg.run_id, "finished", final, store.round_metrics(cfg.run_id), reused=True)
    finally:
        store.close()


class Recorder:
    """Writes the memo entry of one configuration from the full path:

        rec = Recorder(raw, cfg)          # before the run is built: the key and the dataset's files
        rec.watch(exp)                    # the Experiment: its provenance is kept when it is computed
        res = exp.run(); rec.save(res)    # a finished run: the entry is written

    Does nothing in a process that had imported torch before (`pristine`), for a configuration that
    `key` cannot key, or for a plugin's method, dataset, model or partition."""

    def __init__(self, raw: dict[str, Any] | None, cfg: Config, active: bool | None = None):
        self.cfg, self.provenance = cfg, None
        self.active = (pristine() if active is None else active) and raw is not None
        self.key = key(raw) if self.active else None
        self.files = _dataset_files(cfg) if self.key is not None else None

    def watch(self, exp: Any) -> None:
        if self.key is None:
            return
        compute = exp.provenance

        def provenance() -> dict:
            self.provenance = compute()
            return self.provenance

        exp.provenance = provenance

    def save(self, result: Any) -> bool:
        """Write the entry after `result` (a RunResult); True when it was written."""
        if self.key is None or self.files is None or self.provenance is None or result.status != "finished":
            return False
        if not _builtin(self.cfg):
            return False
        cfg = self.cfg
        method = cfg["method"]
        from fedprism.algorithms import REGISTRY

        declared = {k: [p.default, p.new, p.eval_only] for k, p in REGISTRY[method].params.items()}
        prov = {k: self.provenance[k] for k in ("version", "code", "data") if k in self.provenance}
        entry = {"format": FORMAT, "values": cfg.values, "auto": sorted(cfg.auto), "declared": declared,
                 "ids": _ids(cfg), "provenance": prov, "files": self.files}
        try:                             # read back as a lookup will: the same ids, or nothing is written
            text = json.dumps(entry, sort_keys=True, allow_nan=True)
            if _ids(config_of(json.loads(text))) != entry["ids"]:
                return False
        except (TypeError, ValueError):
            return False
        return _write(self.key, text)


def _builtin(cfg: Config) -> bool:
    """Whether the configuration's method, dataset, model and partition are fedprism's own modules."""
    from fedprism.algorithms import REGISTRY
    from fedprism.data.base import DATASETS
    from fedprism.data.partitions import PARTITIONS
    from fedprism.models import MODELS

    return (REGISTRY.is_builtin(cfg["method"]) and DATASETS.is_builtin(cfg["dataset"])
            and PARTITIONS.is_builtin(cfg["partition"])
            and (cfg["model"] == "auto" or MODELS.is_builtin(cfg["model"])))


def _dataset_files(cfg: Config) -> list | None:
    """[[path, [size, mtime_ns] or None], ...]: each folder searched for the dataset's files up to the first
    that holds a complete copy, then that copy's files; [] for a dataset without files (bundled or
    generated). None when the folders cannot be listed (an unknown dataset: nothing is remembered)."""
    try:
        from fedprism.data.base import DATASETS
        from fedprism.data.files import search_paths

        spec = DATASETS.get(cfg["dataset"])
        if spec.files is None:
            return []
        out: list = []
        for folder in search_paths(spec, cfg["data.root"] or None):
            out.append([str(folder), _stat(folder)])
            found = spec.files.find(folder) if folder.is_dir() else None
            if isinstance(found, dict):
                out += [[str(p), _stat(Path(p))] for _, p in sorted(found.items())]
                return out
        return out
    except Exception:  # noqa: BLE001 - what fails here fails again, with its message, as the run is built
        return None


def _write(k: str, text: str) -> bool:
    """Write the entry atomically (a reader sees the old file or the new one); False where it cannot be
    written (a read-only cache: lookups then take the full path)."""
    folder = memo_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".entry-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, _path(k))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError:
        return False
    _prune(folder)
    return True


def _prune(folder: Path, keep: int | None = None) -> None:
    """Remove the least recently written entries beyond `keep` (default MAX_ENTRIES), down to 90% of it."""
    keep = MAX_ENTRIES if keep is None else keep
    try:
        entries = [e for e in os.scandir(folder) if e.name.endswith(".json") and not e.name.startswith(".")]
        if len(entries) <= keep:
            return
        entries.sort(key=lambda e: e.stat().st_mtime_ns)
        for e in entries[:len(entries) - keep * 9 // 10]:
            Path(e.path).unlink(missing_ok=True)
    except OSError:                      # another process pruned it meanwhile, or a read-only cache
        pass


__all__ = ["FORMAT", "Recorder", "code_hash", "config_of", "key", "memo_dir", "pristine", "stored_result"]
