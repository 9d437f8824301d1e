"""Runs on other machines: an executor sends each run to a backend as one task and brings its result
into the one results store, with the guarantees of a sweep's local workers (`sweep.run_in_workers`):

* **a run is stored once**: the runs are submitted once per run id; a task runs `Experiment`, which
  returns a run the store already holds as finished without training, and the store's run lock refuses a
  second process running the same run (that task reports it busy);
* **an interrupted run resumes from its checkpoint**: a task stopped by the driver (`cancel`: Ctrl-C, an
  error) ends its run `interrupted` with the checkpoint of its last finished round, as a local worker does;
  the next submission of that run resumes from it (the store is shared, or the task landed on the node whose
  scratch holds the part store);
* **killing the driver loses nothing finished**: each run is in the store when its task reports it finished
  (with a shared store the task wrote it; with shipped results the driver merges it as it arrives).

Two ways the results reach the store (`store_mode`):

``shared``  every worker opens the store at the same path (a file system all nodes mount, or one machine):
            exactly what a local worker does, rounds and checkpoints included.
``ship``    every task writes a store of its own in the node's scratch folder (``<scratch>/<run_id>.db``,
            its checkpoints beside it) and returns the finished store's bytes; the driver merges the run into
            the one store (`fedprism.experiment.merge`, which checks that the run's id is its
            configuration's hash). A task restarted on the node that holds the part store resumes from its
            checkpoint; on another node it starts the run again.

A backend is anything with ``submit(job) -> handle``, ``wait(handles) -> finished handles``,
``result(handle) -> dict`` and ``cancel(handles)``: `RayExecutor` (a Ray cluster, docs/ray.md) or an
in-process one for tests. `run_configs` is the one entry point for sweeps and studies: configurations in,
finished run ids out.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Protocol

from fedprism.errors import ConfigError, FedPrismError

__all__ = ["Job", "Executor", "InlineExecutor", "RayExecutor", "RayOptions", "execute", "run_configs", "run_job",
           "STORE_MODES"]

STORE_MODES = ("shared", "ship")


@dataclass
class Job:
    """One run for a backend: its configuration, the store (`db`: its path, the same on every worker in
    `shared` mode), the sweep it belongs to, and where it writes with shipped results (`scratch`: a folder on
    the worker, None for the worker's temporary folder)."""

    cfg: Any
    db: str
    sweep: str | None = None
    store_mode: str = "shared"
    scratch: str | None = None
    threads: int = 1
    tag: str = field(default="", compare=False)
    #: a `fedprism tune` trial (`tune.TrialTask`: the objective and the pruner's state): the run is the trial's,
    #: pruned where it runs, and its outcome comes back as ``"trial"``
    trial: Any = field(default=None, compare=False)


class Executor(Protocol):
    """What `execute` needs of a backend."""

    def submit(self, job: Job) -> Any: ...

    def wait(self, handles: list[Any]) -> list[Any]: ...

    def result(self, handle: Any) -> dict: ...

    def cancel(self, handles: list[Any]) -> None: ...


def run_job(job: Job) -> dict:
    """Run one job where it lands (a Ray worker, or this process): ``{"run_id", "final", "resumed"}`` (the
    checkpoint's round a resumed run started from, else None), plus ``"part"``
    (the bytes of the part store) with shipped results, or ``"busy"`` (the message) when another process
    holds the run. A KeyboardInterrupt (the driver's cancel) ends the run `interrupted` with its checkpoint."""
    import torch

    from fedprism import plugins
    from fedprism.experiment.runlock import RunBusyError
    from fedprism.experiment.runner import Experiment
    from fedprism.experiment.store import Store
    from fedprism.experiment.sweep import supersede

    plugins.load()
    if job.threads > 0:
        torch.set_num_threads(job.threads)
    cfg = job.cfg
    path = job.db if job.store_mode == "shared" else str(part_path(job.scratch, cfg.run_id))
    if job.trial is not None:
        from fedprism.experiment.tune import run_trial_task

        try:
            out = run_trial_task(path, cfg, job.sweep, job.trial)
        except RunBusyError as e:
            return {"run_id": cfg.run_id, "busy": str(e)}
        if job.store_mode == "ship":
            out["part"] = Path(path).read_bytes()
        return out
    store = Store(path)
    try:
        try:
            res = Experiment(cfg, store, progress=False, sweep=job.sweep).run()
        except RunBusyError as e:
            return {"run_id": cfg.run_id, "busy": str(e)}
        if job.sweep is not None and job.store_mode == "shared":
            supersede(store, job.sweep, cfg)
        out = {"run_id": cfg.run_id, "final": res.final, "resumed": res.resumed_from}
    finally:
        store.close()
    if job.store_mode == "ship":
        out["part"] = Path(path).read_bytes()
    return out


def part_path(scratch: str | None, run_id: str) -> Path:
    """Where a task writes run `run_id` with shipped results: ``<scratch>/<run_id>.db``; the scratch folder is
    ``$FEDPRISM_RAY_SCRATCH``, else ``<temp>/fedprism-ray``, on the node the task runs on."""
    folder = Path(scratch or os.environ.get("FEDPRISM_RAY_SCRATCH") or Path(tempfile.gettempdir()) / "fedprism-ray")
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{run_id}.db"


def execute(todo: Iterable[tuple[str, Any]], db: str, executor: Executor, sweep: str | None = None,
            store_mode: str = "shared", scratch: str | None = None, threads: int = 1
            ) -> Iterator[tuple[str, Any]]:
    """Submit each (tag, config) of `todo` once per run id and yield (tag, final metrics) as runs finish,
    or (tag, RunBusyError) for a run another process holds. With shipped results each finished run is merged
    into the store at `db` before it is yielded. An error of a run, Ctrl-C or the caller leaving cancels every
    task still out (their runs end `interrupted` with their checkpoints) and is raised."""
    from fedprism.experiment.runlock import RunBusyError

    if store_mode not in STORE_MODES:
        raise ConfigError("--ray-store", store_mode, f"one of {', '.join(STORE_MODES)}", kind="option")
    db = str(Path(db).resolve())
    out: dict[Any, tuple[str, Any]] = {}
    seen: set[str] = set()
    try:
        for tag, cfg in todo:
            if cfg.run_id in seen:          # the same configuration twice: one run
                continue
            seen.add(cfg.run_id)
            out[executor.submit(Job(cfg, db, sweep, store_mode, scratch, threads, tag))] = (tag, cfg)
        while out:
            for handle in executor.wait(list(out)):
                tag, cfg = out.pop(handle)
                res = executor.result(handle)
                if "busy" in res:
                    yield tag, RunBusyError(res["busy"])
                    continue
                if res.get("run_id") != cfg.run_id:
                    raise FedPrismError(f"{tag}: the task returned run {res.get('run_id')!r} for run {cfg.run_id}")
                if "part" in res:
                    merge_part(db, res["part"], cfg, sweep)
                yield tag, res["final"]
    except BaseException:
        if out:
            executor.cancel(list(out))
        raise


def merge_part(db: str, part: bytes, cfg: Any, sweep: str | None) -> None:
    """Merge run `cfg` from a shipped part store (its bytes) into the store at `db`; then older runs of its
    sweep row leave the sweep (`sweep.supersede`), as after a local run. A run the store already holds as
    finished is kept as it is (merge's rule: the first finished copy wins)."""
    from fedprism.experiment.merge import merge
    from fedprism.experiment.store import Store
    from fedprism.experiment.sweep import supersede

    with tempfile.TemporaryDirectory(prefix="fedprism-part-") as tmp:
        path = Path(tmp) / f"{cfg.run_id}.db"
        path.write_bytes(part)
        store = Store(db)
        try:
            rep = merge(store, path, runs=[cfg.run_id])
            if rep.refused:
                raise FedPrismError(f"run {cfg.run_id}: its shipped results were refused by the merge: "
                                    f"{rep.refused[0][1]}")
            if cfg.run_id not in {*rep.copied, *rep.replaced, *rep.present}:
                raise FedPrismError(f"run {cfg.run_id}: its shipped results hold no finished run "
                                    f"({'busy here' if rep.busy else 'unfinished'})")
            if sweep is not None:
                store.add_to_sweep(sweep, cfg.run_id, cfg["name"])
                supersede(store, sweep, cfg)
        finally:
            store.close()


def run_configs(configs: Iterable[Any], db: str, executor: Executor, sweep: str | None = None,
                store_mode: str = "shared", threads: int = 1,
                on_result: Callable[[str, Any], None] | None = None) -> list[str]:
    """Run every configuration (`fedprism.experiment.config.Config`) through `executor` into the store at
    `db`; returns the run ids that are finished there, in the order given (a run another process holds is
    left out). `on_result(tag, final or RunBusyError)` is called as each comes back. For studies that hand
    many runs to a cluster (`fedprism tune`) and for `fedprism sweep --ray`."""
    from fedprism.experiment.runlock import RunBusyError

    configs = list(configs)
    done: set[str] = set()
    tagged = [(f"{c.get('name') or c['method']} seed={c['seed']} ({c.run_id})", c) for c in configs]
    by_tag = dict(tagged)
    for tag, final in execute(tagged, db, executor, sweep, store_mode, threads=threads):
        if on_result is not None:
            on_result(tag, final)
        if not isinstance(final, RunBusyError):
            done.add(by_tag[tag].run_id)
    return list(dict.fromkeys(c.run_id for c in configs if c.run_id in done))


class InlineExecutor:
    """Runs each job in this process when it is waited for (`run_job`), in the order submitted; for tests and
    for one machine without Ray. `fn` replaces `run_job` (a test's stand-in)."""

    def __init__(self, fn: Callable[[Job], dict] | None = None):
        self.fn = fn or run_job
        self.jobs: dict[int, Job] = {}
        self.results: dict[int, dict] = {}
        self.cancelled: list[int] = []

    def submit(self, job: Job) -> int:
        handle = len(self.jobs)
        self.jobs[handle] = job
        return handle

    def wait(self, handles: list[int]) -> list[int]:
        first = min(handles)
        self.results[first] = self.fn(self.jobs[first])
        return [first]

    def result(self, handle: int) -> dict:
        return self.results.pop(handle)

    def cancel(self, handles: list[int]) -> None:
        self.cancelled.extend(handles)


@dataclass
class RayOptions:
    """`fedprism sweep --ray ADDRESS`: the cluster, what each run's task declares (`cpus`, `gpus`: a fraction
    below 1 shares a GPU between runs), how results reach the store (`store`: one of `STORE_MODES`) and the
    workers' scratch folder for shipped results. Checked when made, before any run is checked or started."""

    address: str
    cpus: float = 1.0
    gpus: float = 0.0
    store: str = "shared"
    scratch: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.address, str) or not self.address.strip():
            raise ConfigError("--ray", self.address, "the cluster's address: host:port of its head, auto, or local",
                              kind="option")
        for key, value in (("--ray-cpus", self.cpus), ("--ray-gpus", self.gpus)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ConfigError(key, value, "a finite number >= 0", kind="option")
        if self.cpus == 0 and self.gpus == 0:
            raise ConfigError("--ray-cpus", self.cpus, "a number > 0 when --ray-gpus is 0 (each run's task "
                              "declares what it uses)", kind="option")
        if self.gpus > 1 and self.gpus != int(self.gpus):
            raise ConfigError("--ray-gpus", self.gpus, "a fraction in (0, 1] (runs sharing one GPU) or a whole "
                              "number of GPUs", kind="option")
        if self.store not in STORE_MODES:
            raise ConfigError("--ray-store", self.store, f"one of {', '.join(STORE_MODES)}", kind="option")

    def executor(self) -> "RayExecutor":
        return RayExecutor(self.address, self.cpus, self.gpus)


class RayExecutor:
    """A Ray cluster as the backend: each job is a Ray task declaring `cpus` CPUs and `gpus` GPUs (a fraction
    below 1 lets several runs share one GPU: Ray packs up to floor(1 / gpus) of them per GPU and sets
    CUDA_VISIBLE_DEVICES for each). `address` is the cluster's (``host:port`` of the head, ``auto``, or
    ``local``: a Ray instance started in this process on this machine). docs/ray.md says how to run it."""

    def __init__(self, address: str, cpus: float = 1.0, gpus: float = 0.0, runtime_env: dict | None = None):
        RayOptions(address, cpus, gpus)            # the same checks as the command line's
        import ray

        self.ray = ray
        if not ray.is_initialized():
            kw: dict[str, Any] = {"log_to_driver": True, "configure_logging": False}
            if runtime_env:
                kw["runtime_env"] = runtime_env
            if address == "local":
                ray.init(include_dashboard=False, **kw)
            else:
                ray.init(address=address, **kw)
        self.remote = ray.remote(num_cpus=cpus, num_gpus=gpus, max_retries=0)(run_job)
        self.threads = max(1, int(cpus))

    def submit(self, job: Job) -> Any:
        job.threads = self.threads
        return self.remote.remote(job)

    def wait(self, handles: list[Any]) -> list[Any]:
        ready, _ = self.ray.wait(handles, num_returns=1)
        return ready

    def result(self, handle: Any) -> dict:
        return self.ray.get(handle)

    def cancel(self, handles: list[Any]) -> None:
        """Each task gets a KeyboardInterrupt (its run ends `interrupted` with its checkpoint); a task not
        started yet never starts."""
        for h in handles:
            try:
                self.ray.cancel(h, force=False)
            except Exception:  # noqa: BLE001 - a task that finished meanwhile
                pass
        for h in handles:                       # wait for the runs to mark themselves and close the store
            try:
                self.ray.get(h, timeout=60)
            except Exception:  # noqa: BLE001 - cancelled, or failed while stopping: both expected here
                pass
