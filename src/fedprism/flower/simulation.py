"""Flower simulations through `flwr run`:
`simulate("method=fedprism clients=6 fraction=0.5 fedprism.k=3 rounds=3", db="x.db")`.

flwr 1.41 runs a simulation as a run submitted to a SuperLink started in simulation mode; the
SuperLink's SuperExec starts `flwr-simulation`, which loads the app's ServerApp and ClientApp and
runs one virtual SuperNode per client (`partition-id` = client id) on Ray. `simulate` does exactly
that, with nothing shared with other runs:

    1. a Flower app directory (`app_dir.write_app`: the run config in `[tool.flwr.app.config]`);
    2. a private FLWR_HOME whose Flower configuration (`config.toml`) names one SuperLink connection,
       `fedprism-sim`, at 127.0.0.1:<free port>, and `flower-superlink --simulation --insecure --host
       127.0.0.1 --port <port> --disable-runtime-dependency-installation` (state in memory);
    3. `flwr run APP fedprism-sim --federation-config "num-supernodes=N client-resources-num-cpus=C ..."`
       (the simulation federation: how many SuperNodes, the Ray backend's resources), then
       `flwr log RUN fedprism-sim --stream` until the run ends and `flwr ls ... --run-id RUN` for its
       status;
    4. the SuperLink and every process under it (SuperExec, flwr-simulation, Ray) are stopped, by pid.

Local Ray (default) binds 127.0.0.1 only (`LOOPBACK_ENV`) and is started for the run with
`num_cpus`; `ray_address="HEAD:6379"` attaches the run to an existing Ray cluster instead (head and
workers started with `ray start`, docs/flower.md "Multi-node Ray cluster"). The simulation
federation is not declared in the app's pyproject.toml: `flwr run` 1.41 treats
`[tool.flwr.federations]` there as legacy, moves it into `$FLWR_HOME/config.toml` as a connection to a
Flower-managed SuperLink on fixed ports and comments it out of the app's pyproject.toml.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fedprism.errors import ConfigError
from fedprism.experiment.store import Store
from fedprism.flower.settings import OFFLINE_ENV, RunSettings
from fedprism.flower.trust import load_registry

#: Ray turns a node address of 127.0.0.1 into this machine's routable address (its
#: `resolve_ip_for_localhost`) unless multi-node clusters are disabled; with them disabled the node
#: address is 127.0.0.1 and Ray's GCS, raylet, worker gRPC servers and runtime-env / dashboard agents
#: listen on loopback only. Set for the processes of a local simulation only (a Ray worker node
#: refuses to start with it, so a multi-node cluster runs without it).
LOOPBACK_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}

#: the name of the SuperLink connection in the private Flower configuration
CONNECTION = "fedprism-sim"
HOST = "127.0.0.1"
_RAY_ADDRESS = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.\-]*):(\d{1,5})$")


def check_ray_address(value: Any) -> str:
    """`HOST:PORT` of a Ray head's GCS, as `ray start --head` prints it (port 6379 by default)."""
    m = _RAY_ADDRESS.match(value) if isinstance(value, str) else None
    if m is None or not 0 < int(m.group(2)) < 65536:
        raise ConfigError("--ray-address (ray_address)", value, "HOST:PORT of the Ray head (`ray start "
                          "--head` prints it), e.g. 10.0.0.1:6379")
    return value


def _whole(key: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < least:
        raise ConfigError(key, value, f"an integer >= {least}" + (
            " (Flower's simulation federation config takes whole CPUs)" if "cpus" in key else ""))
    return int(value)


def federation_config(num_nodes: int, *, cpus_per_client: float = 1, gpus_per_client: float = 0.0,
                      num_cpus: int | None = 2, ray_address: str | None = None, verbose: bool = False) -> dict:
    """The simulation federation of a run: Flower's `SimulationConfig` keys as `flwr run
    --federation-config` takes them. `num_cpus` is what a local Ray is started with; with
    `ray_address` the cluster's own resources count (Ray refuses `num_cpus` when attaching)."""
    cfg: dict[str, Any] = {
        "num-supernodes": _whole("--nodes (num_nodes)", num_nodes, 1),
        "backend": "ray",
        "client-resources-num-cpus": _whole("--cpus-per-client (cpus_per_client)", cpus_per_client, 1),
        "client-resources-num-gpus": float(gpus_per_client),
        "init-args-log-to-driver": bool(verbose),
        "verbose": bool(verbose),
    }
    g = cfg["client-resources-num-gpus"]
    if isinstance(gpus_per_client, bool) or not 0 <= g < float("inf"):
        raise ConfigError("--gpus-per-client (gpus_per_client)", gpus_per_client,
                          "a finite number >= 0 (a fraction shares a GPU)")
    if ray_address is None:
        n = _whole("--num-cpus (num_cpus)", num_cpus, 1)
        if n < cfg["client-resources-num-cpus"]:
            raise ConfigError("--num-cpus (num_cpus)", num_cpus,
                              f"at least --cpus-per-client = {cfg['client-resources-num-cpus']}")
        cfg["init-args-num-cpus"] = n
    else:
        check_ray_address(ray_address)
    return cfg


def federation_config_arg(cfg: dict) -> str:
    """`cfg` as the value of `flwr run --federation-config` (TOML values)."""
    def lit(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)
        return repr(v)
    return " ".join(f"{k}={lit(v)}" for k, v in cfg.items())


def flower_config(port: int) -> str:
    """The private Flower configuration (`$FLWR_HOME/config.toml`): one connection to our SuperLink."""
    return (f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\naddress = "{HOST}:{port}"\n'
            "insecure = true\n")


# -- processes ---------------------------------------------------------------------------------------------
def _proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state) of every process visible in /proc."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        out[int(d.name)] = (int(fields[1]), fields[0])
    return out


def descendants(pids: set[int], table: dict[int, tuple[int, str]] | None = None) -> set[int]:
    """`pids` and every live (non-zombie) process below them."""
    table = _proc_table() if table is None else table
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        kids.setdefault(ppid, []).append(pid)
    out, todo = set(), list(pids)
    while todo:
        p = todo.pop()
        if p in out:
            continue
        out.add(p)
        todo.extend(kids.get(p, []))
    return {p for p in out if p in table and table[p][1] != "Z"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


class LocalSuperLink:
    """`flower-superlink --simulation` on 127.0.0.1:<free port>, stopped with everything it started."""

    def __init__(self, workdir: Path, env: dict[str, str], bin_dir: Path, startup_timeout: float = 300.0):
        self.workdir, self.env, self.bin_dir = workdir, env, bin_dir
        self.port = _free_port()
        self.log = workdir / "superlink.log"
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self.seen: set[int] = set()

    def start(self) -> LocalSuperLink:
        cmd = [str(self.bin_dir / "flower-superlink"), "--simulation", "--insecure",
               "--disable-runtime-dependency-installation", "--host", HOST, "--port", str(self.port)]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, cwd=os.getcwd())
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"flower-superlink exited with {self.proc.returncode}:\n{_tail(self.log)}")
            try:
                with urllib.request.urlopen(f"http://{HOST}:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"flower-superlink did not answer on {HOST}:{self.port} within "
                           f"{self.startup_timeout:g}s:\n{_tail(self.log)}")

    def watch(self) -> None:
        """Remember the processes below the SuperLink now (SuperExec detaches into its own session, and
        a process whose parent died is re-parented, so the tree is recorded while it is whole)."""
        if self.proc is not None:
            self.seen |= descendants({self.proc.pid})

    def stop(self, grace: float = 20.0) -> list[int]:
        """SIGTERM the SuperLink (it stops its SuperExec, which stops flwr-simulation and Ray), SIGKILL
        whatever of its tree is left after `grace` s. Returns the pids still alive (none expected)."""
        if self.proc is None:
            return []
        self.watch()
        tree = set(self.seen)
        if self.proc.poll() is None:
            self.proc.terminate()
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            self.proc.poll()
            alive = descendants(tree)
            tree |= alive
            if not alive:
                break
            time.sleep(0.2)
        for pid in descendants(tree):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        time.sleep(0.2)
        return sorted(descendants(tree))


@contextmanager
def _sigint_ignored():
    """SIGINT ignored for the time of the block (in the main thread; elsewhere signals are not ours)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


def _flwr_json(out: str) -> dict:
    start, end = out.find("{"), out.rfind("}")
    if start < 0 or end < start:
        raise ValueError("no JSON object in the output")
    return json.loads(out[start:end + 1])


def child_env(home: Path, bin_dir: Path, ray_address: str | None) -> dict[str, str]:
    """The environment of the SuperLink and everything below it."""
    import fedprism

    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    src = Path(fedprism.__file__).resolve().parents[1]
    if src.name not in ("site-packages", "dist-packages") and str(src) not in paths:   # a source checkout:
        paths.insert(0, str(src))                                                      # the apps run this code
    env = {**OFFLINE_ENV, **os.environ, "FLWR_HOME": str(home), "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
           "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(paths)}
    for k in LOOPBACK_ENV:
        env.pop(k, None)
    if ray_address is None:
        env.update(LOOPBACK_ENV)
        env["RAY_ADDRESS"] = "local"        # a new local Ray, never a cluster that `ray start` left running
    else:
        env["RAY_ADDRESS"] = ray_address
    return env


def simulate(experiment: str, db: str | Path = "fedprism-results.db", num_nodes: int | None = None, *,
             num_cpus: int = 2, cpus_per_client: float = 1, gpus_per_client: float = 0.0,
             ray_address: str | None = None, verbose: bool = False, timeout: float | None = None,
             workdir: str | Path | None = None, **settings: Any) -> str:
    """Run `experiment` on Flower's Simulation Runtime via `flwr run`; results land in the store `db`.

    `num_nodes` defaults to the experiment's `clients` (one virtual SuperNode per client); `settings`
    are further run-config keys (`min_replies=2`, `round_timeout=60`, `save_final="state.pt"`, ...).
    `min_nodes` defaults to `num_nodes`, so every client is identified before round 0. Ray: a local
    one with `num_cpus`, or the cluster at `ray_address`; each virtual SuperNode's ClientApp runs in a
    Ray actor of `cpus_per_client` CPUs and `gpus_per_client` GPUs. `timeout` bounds the run (s);
    `workdir` keeps the app directory, Flower home and logs there (default: a temporary directory,
    removed afterwards). Returns the run's status ('finished', or 'interrupted' with `stop_after`);
    raises RuntimeError if it did not complete.
    """
    run_config = {"experiment": experiment, "db": str(Path(db).resolve()),
                  **{k.replace("_", "-"): v for k, v in settings.items()}}
    s = RunSettings.from_run_config(run_config)            # validate before starting anything
    if s.registry:                                         # read by the ServerApp later: refuse a bad one now
        load_registry(s.registry, s.cfg["clients"])
    n = _whole("num-supernodes", num_nodes if num_nodes is not None else s.cfg["clients"], 1)
    run_config.setdefault("min-nodes", min(n, s.cfg["clients"]))
    fed = federation_config(n, cpus_per_client=cpus_per_client, gpus_per_client=gpus_per_client,
                            num_cpus=None if ray_address else num_cpus, ray_address=ray_address, verbose=verbose)
    if timeout is not None and not (isinstance(timeout, (int, float)) and 0 < timeout < float("inf")):
        raise ConfigError("timeout", timeout, "a number of seconds > 0, or None (no limit)")
    from fedprism.flower.app_dir import write_app

    bin_dir = Path(sys.executable).parent
    for exe in ("flwr", "flower-superlink", "flower-superexec", "flwr-simulation"):
        if not (bin_dir / exe).exists():
            raise RuntimeError(f"{bin_dir / exe} is missing: install the Flower extra into this Python "
                               "environment (pip install 'fedprism[flower]')")
    keep = workdir is not None
    work = Path(workdir).resolve() if keep else Path(tempfile.mkdtemp(prefix="fedprism-flwr-"))
    work.mkdir(parents=True, exist_ok=True)
    home = work / "flwr-home"
    home.mkdir(exist_ok=True)
    app = work / "app"
    write_app(app, run_config)
    env = child_env(home, bin_dir, ray_address)
    link = LocalSuperLink(work, env, bin_dir)
    deadline = None if timeout is None else time.monotonic() + timeout
    flwr = str(bin_dir / "flwr")

    def left(cap: float) -> float:
        if deadline is None:
            return cap
        rem = deadline - time.monotonic()
        if rem <= 0:
            raise TimeoutError(f"the Flower simulation did not finish within timeout={timeout:g}s")
        return min(cap, rem)

    def cli(args: list[str], cap: float) -> subprocess.CompletedProcess:
        wait = left(cap)
        try:
            return subprocess.run([flwr, *args], env=env, capture_output=True, text=True, timeout=wait,
                                  stdin=subprocess.DEVNULL, cwd=os.getcwd())
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"`flwr {args[0]}` did not answer within {wait:g}s") from None

    leftover: list[int] = []
    try:
        link.start()
        (home / "config.toml").write_text(flower_config(link.port))
        p = cli(["run", str(app), CONNECTION, "--federation-config", federation_config_arg(fed), "--format", "json"],
                300)
        link.watch()
        try:
            started = _flwr_json(p.stdout)
        except ValueError:
            started = {}
        if p.returncode != 0 or not started.get("success") or not started.get("run-id"):
            raise RuntimeError(f"flwr run failed ({p.returncode}): {started.get('error-message') or p.stdout[-3000:]}"
                               f"\n{p.stderr[-3000:]}")
        flwr_run = str(started["run-id"])
        # the run's log, streamed until the run has finished (then the SuperLink ends the stream)
        stream = subprocess.Popen([flwr, "log", flwr_run, CONNECTION, "--stream"], env=env, stdin=subprocess.DEVNULL,
                                  cwd=os.getcwd())
        try:
            while stream.poll() is None:
                link.watch()
                left(float("inf"))
                time.sleep(1.0)
        finally:
            if stream.poll() is None:
                stream.kill()
                stream.wait()
        status, details = "", ""
        for _ in range(60):                     # the stream ends once the run is finished; be sure of it
            q = cli(["ls", CONNECTION, "--run-id", flwr_run, "--format", "json"], 120)
            try:
                row = _flwr_json(q.stdout).get("runs", [{}])[0]
            except (ValueError, IndexError, AttributeError):
                row = {}
            status, details = str(row.get("status", "")), str(row.get("status-details", ""))
            if status.startswith("finished"):
                break
            time.sleep(left(2.0))
        if status != "finished:completed":
            raise RuntimeError(f"the Flower run {flwr_run} ended as '{status or 'unknown'}' {details}\n"
                               f"{_tail(link.log)}")
    finally:
        with _sigint_ignored():                # a second Ctrl-C must not leave the SuperLink's tree running
            leftover = link.stop()
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    if leftover:
        raise RuntimeError(f"processes of the Flower simulation survived SIGKILL: {leftover}")
    # Flower logs a failing ServerApp or backend and returns: say so to the caller
    store = Store(run_config["db"])
    try:
        row = store.run(s.run_id)
        status = None if row is None else row["status"]
        final = json.loads(row["final"] or "{}") if row is not None else {}
    finally:
        store.close()
    if final.get("diverged"):
        from fedprism.experiment.runner import divergence_note
        print(f"fedprism: warning: {divergence_note(s.run_id, final)}", file=sys.stderr)
    if status not in ("finished", "interrupted"):
        raise RuntimeError(f"the Flower simulation did not complete (run status: {status}); see the log above"
                           " (Ray needs RAY_TMPDIR short enough for its socket paths: < ~60 characters)")
    return status
