#!/usr/bin/env python
"""Loopback Flower deployment of fedprism: 1 SuperLink + N SuperNodes on 127.0.0.1, TLS + node auth.

What it does (every wait has a deadline; every process it starts is stopped by id in `finally`):

 1. generates a CA, a server certificate for 127.0.0.1 and one ECDSA key per SuperNode (python
    `cryptography`), plus one key that is never registered;
 2. starts `flower-superlink` with TLS, `--enable-supernode-auth` and no runtime `uv sync`;
 3. registers the N node keys (`flwr supernode register`), checks that a SuperNode with the
    unregistered key is refused, then starts N SuperNodes (`--node-config client-id=i`);
 4. writes the operator's key registry (`registry.json`: the SHA-256 fingerprint of node i's public key
    -> client i) and a Flower app directory that reads it, and runs Fed-PRISM (`flwr run ... --stream`);
 5. a scripted hostile node (`--impostor`, default on): a key registered with Flower -- so it passes
    node authentication -- but absent from the registry, started as `client-id=0` while client 0's
    node is online. The server must refuse it (a `failure` record naming the field `registry`) and
    client 0 must keep its own node in every round;
 6. when round 1 is stored it SIGKILLs the SuperNode of `--kill-client` (during round 2), the run goes
    on with the survivors;
 7. checks the store (status, rounds, failures of the killed client, the impostor refused, round-0
    rows intact), renders `fedprism report`, writes a JSON summary, and stops every process it started.

    .venv/bin/python scripts/flower_deploy.py [--workdir DIR] [--json summary.json] [--kill-client -1]

Exit status 0 when every check passed. Only 127.0.0.1 is used.
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HOST = "127.0.0.1"
BIN = Path(sys.executable).parent
EXPERIMENT = ("method=fedprism dataset=digits clients={n} rounds={rounds} fraction=1.0 local_epochs=1 lr=0.05 "
              "model=mlp device=cpu fedprism.k=2 fedprism.every=1 partition.alpha=0.5 seed=1")
#: `--secagg`: FedAvg, whose server needs only the sum of the uploads (Fed-PRISM clusters them: refused)
SECAGG_EXPERIMENT = ("method=fedavg dataset=digits clients={n} rounds={rounds} fraction=1.0 local_epochs=1 "
                     "lr=0.05 model=mlp device=cpu partition.alpha=0.5 seed=1")


def log(msg: str) -> None:
    print(f"[deploy {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# -- certificates and keys ---------------------------------------------------------------------------------
def write_private(path: Path, data: bytes) -> Path:
    """Write a private key readable by its owner only from the first byte on: created with mode 0600
    (whatever the umask), an existing file narrowed to 0600 before anything is written into it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as f:
            fd = -1
            f.write(data)
    finally:
        if fd >= 0:
            os.close(fd)
    return path


def make_certificates(d: Path) -> dict[str, Path]:
    """CA + server certificate (SAN IP:127.0.0.1, DNS:localhost), PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = dt.datetime.now(dt.UTC)
    ca_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedprism-test-ca")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
          .not_valid_after(now + dt.timedelta(days=2))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                       crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, HOST)])).issuer_name(ca_name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(HOST)),
                                                        x509.DNSName("localhost")]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    files = {"ca": d / "ca.crt", "cert": d / "server.pem", "key": d / "server.key"}
    files["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    write_private(files["key"], key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                  serialization.NoEncryption()))
    return files


def make_node_key(d: Path, name: str) -> tuple[Path, Path]:
    """OpenSSH ECDSA P-384 key pair (what `ssh-keygen -t ecdsa -b 384` writes)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    k = ec.generate_private_key(ec.SECP384R1())
    priv, pub = d / name, d / f"{name}.pub"
    write_private(priv, k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                        serialization.NoEncryption()))
    pub.write_bytes(k.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
                    + f" {name}\n".encode())
    return priv, pub


# -- processes -----------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def wait_port(port: int, deadline: float) -> None:
    while time.monotonic() < deadline:
        with socket.socket() as s:
            s.settimeout(1.0)
            if s.connect_ex((HOST, port)) == 0:
                return
        time.sleep(0.3)
    raise TimeoutError(f"nothing listens on {HOST}:{port}")


class Procs:
    """Processes started here, each in its own session (process group id = its pid), and the processes
    seen below them: a SuperLink's SuperExec starts `flwr-serverapp` in a session of its own, out of
    reach of the group's signals."""

    def __init__(self, logdir: Path):
        self.logdir = logdir
        self.procs: dict[str, subprocess.Popen] = {}
        self.seen: set[int] = set()

    def watch(self) -> None:
        """Record the live processes below the ones started here (while the tree is whole)."""
        from fedprism.flower.simulation import descendants

        self.seen |= descendants({p.pid for p in self.procs.values()})

    def _signal_tree(self, sig: int) -> None:
        from fedprism.flower.simulation import descendants

        for pid in descendants(self.seen):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def start(self, name: str, cmd: list[str], env: dict) -> subprocess.Popen:
        with open(self.logdir / f"{name}.log", "wb") as out:
            p = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True)
        self.procs[name] = p
        log(f"started {name} (pid {p.pid}): {' '.join(cmd[:2])} ...")
        return p

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        p = self.procs[name]
        try:
            os.killpg(p.pid, sig)          # the process and the children it started (same group)
        except ProcessLookupError:
            pass

    def stop_all(self, grace: float = 10.0) -> list[int]:
        """SIGTERM every group and every process seen below it, SIGKILL what is left after `grace` s;
        returns pids still alive."""
        self.watch()
        for p in self.procs.values():
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        self._signal_tree(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and self.alive():
            time.sleep(0.2)
            for p in self.procs.values():
                p.poll()
        for p in self.procs.values():
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._signal_tree(signal.SIGKILL)
        for p in self.procs.values():
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        time.sleep(0.5)
        return self.alive()

    def alive(self) -> list[int]:
        """Pids of live processes in the groups started here or seen below them (zombies excluded)."""
        from fedprism.flower.simulation import descendants

        groups = {p.pid for p in self.procs.values()}
        seen = descendants(self.seen)
        out = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()
            if fields[0] != "Z" and (int(fields[2]) in groups or int(d.name) in seen):
                out.append(int(d.name))
        return out


def run_cmd(cmd: list[str], env: dict, timeout: float, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
                       check=False)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} -> {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    return p


# -- main ------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", help="directory for certificates, logs, store (default: a temporary one)")
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kill-client", type=int, default=2, help="client whose SuperNode is killed (-1: none)")
    ap.add_argument("--kill-after-round", type=int, default=1,
                    help="kill once this many rounds are stored (1: during round 2)")
    ap.add_argument("--round-timeout", type=float, default=120.0)
    ap.add_argument("--timeout", type=float, default=900.0, help="deadline for the whole script (s)")
    ap.add_argument("--json", help="write a JSON summary here")
    ap.add_argument("--no-impostor", dest="impostor", action="store_false",
                    help="do not start the hostile node that claims client 0 with a key outside the registry")
    ap.add_argument("--secagg", action="store_true",
                    help="FedAvg with secure aggregation (run config secagg=secaggplus, Flower's SecAgg+): checks "
                         "that the final model equals the in-process run's within SecAgg+'s quantisation "
                         "(use --rounds 1: the bound is per round)")
    args = ap.parse_args(argv)
    # SIGTERM (e.g. a test's timeout) -> SystemExit, so that `finally` stops every process started here
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t_start = time.monotonic()
    deadline = t_start + args.timeout

    def left(cap: float) -> float:
        rem = deadline - time.monotonic()
        if rem <= 0:
            raise TimeoutError("the script's overall deadline passed")
        return min(cap, rem)

    work = Path(args.workdir or tempfile.mkdtemp(prefix="fedprism-flower-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    (work / "logs").mkdir(exist_ok=True)
    certs_dir = work / "certs"
    certs_dir.mkdir(mode=0o700, exist_ok=True)
    os.chmod(certs_dir, 0o700)
    from fedprism.experiment.store import Store
    from fedprism.flower.app_dir import write_app
    from fedprism.flower.settings import OFFLINE_ENV, flower_run_id, parse_experiment

    base_env = {**os.environ, **OFFLINE_ENV, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
                "PYTHONUNBUFFERED": "1"}
    base_env.pop("PYTHONPATH", None)

    def env_for(name: str) -> dict:
        home = work / "flwr-home" / name
        home.mkdir(parents=True, exist_ok=True)
        return {**base_env, "FLWR_HOME": str(home)}

    procs = Procs(work / "logs")
    summary: dict = {"workdir": str(work), "ok": False}
    try:
        files = make_certificates(certs_dir)
        keys = [make_node_key(certs_dir, f"node{i}") for i in range(args.nodes)]
        stranger = make_node_key(certs_dir, "unregistered")
        impostor = make_node_key(certs_dir, "impostor") if args.impostor else None
        port = free_port()
        procs.start("superlink", [str(BIN / "flower-superlink"), "--ssl-ca-certfile", str(files["ca"]),
                                  "--ssl-certfile", str(files["cert"]), "--ssl-keyfile", str(files["key"]),
                                  "--enable-supernode-auth", "--disable-runtime-dependency-installation",
                                  "--host", HOST, "--port", str(port),
                                  "--database", str(work / "linkstate.db")], env_for("superlink"))
        wait_port(port, time.monotonic() + left(90))
        cli_env = env_for("cli")
        Path(cli_env["FLWR_HOME"], "config.toml").write_text(
            f'[superlink]\ndefault = "deploy"\n\n[superlink.deploy]\naddress = "{HOST}:{port}"\n'
            f'root-certificates = "{files["ca"]}"\n')
        flwr = str(BIN / "flwr")
        # register the node keys (retry while the SuperLink finishes starting)
        node_ids = []
        to_register = keys + ([impostor] if impostor else [])
        for i, (_, pub) in enumerate(to_register):
            t_end = time.monotonic() + left(90)
            while True:
                p = run_cmd([flwr, "supernode", "register", str(pub), "deploy"], cli_env, left(60), check=False)
                if p.returncode == 0:
                    break
                if time.monotonic() > t_end:
                    raise RuntimeError(f"flwr supernode register failed:\n{p.stdout}\n{p.stderr}")
                time.sleep(2)
            node_ids.append(p.stdout.strip().splitlines()[-1] if p.stdout.strip() else "")
            log(f"registered {'impostor' if i == len(keys) else f'node{i}'} with Flower: {node_ids[-1][:120]}")
        # a SuperNode with an unregistered key must be refused
        common = ["--root-certificates", str(files["ca"]), "--superlink", f"{HOST}:{port}"]
        stray = procs.start("unregistered", [str(BIN / "flower-supernode"), *common, "--auth-supernode-private-key",
                                             str(stranger[0]), "--port", str(free_port()),
                                             "--node-config", "client-id=0", "--max-retries", "2",
                                             "--max-wait-time", "30"], env_for("unregistered"))
        try:
            rc = stray.wait(timeout=left(120))
        except subprocess.TimeoutExpired:
            rc = None
        stray_log = (work / "logs" / "unregistered.log").read_text(errors="replace")
        # refused = exits non-zero with Flower's "Failed to activate SuperNode" (exit code 305); the
        # registered nodes below use the same certificates and flags, only their keys are registered
        summary["unregistered_node_refused"] = (rc is not None and rc != 0
                                                and ("Failed to activate SuperNode" in stray_log or "305" in stray_log))
        summary["unregistered_exit_code"] = rc
        log(f"unregistered SuperNode exited with {rc}: refused={summary['unregistered_node_refused']}")
        if not summary["unregistered_node_refused"]:
            raise RuntimeError(f"a SuperNode with an unregistered key was not refused:\n{stray_log[-2000:]}")
        # the registered SuperNodes, one per client
        for i, (priv, _) in enumerate(keys):
            procs.start(f"supernode{i}", [str(BIN / "flower-supernode"), *common, "--auth-supernode-private-key",
                                          str(priv), "--port", str(free_port()), "--node-config", f"client-id={i}",
                                          "--max-wait-time", str(int(args.timeout))], env_for(f"supernode{i}"))
        # the operator's registry: which key may serve which client (the impostor's key is not in it)
        from fedprism.flower.trust import openssh_fingerprint
        registry = work / "registry.json"
        registry.write_text(json.dumps({"nodes": {openssh_fingerprint(pub.read_bytes()): {"client": i}
                                                  for i, (_, pub) in enumerate(keys)}}, indent=1))
        if impostor:
            procs.start("impostor", [str(BIN / "flower-supernode"), *common, "--auth-supernode-private-key",
                                     str(impostor[0]), "--port", str(free_port()), "--node-config", "client-id=0",
                                     "--max-wait-time", str(int(args.timeout))], env_for("impostor"))
        # the app and its run config
        experiment = (SECAGG_EXPERIMENT if args.secagg else EXPERIMENT).format(n=args.nodes, rounds=args.rounds)
        cfg = parse_experiment(experiment)
        db = work / "results.db"
        app = work / "app"
        run_config = {"experiment": experiment, "db": str(db), "min-nodes": args.nodes,
                      "min-replies": max(1, args.nodes - 1), "round-timeout": args.round_timeout,
                      "nodes-timeout": 300.0, "poll-interval": 0.5, "probe-timeout": 60.0,
                      "save-final": str(work / "final_state.pt"), "registry": str(registry)}
        if args.secagg:
            run_config["secagg"] = "secaggplus"
        run_id = flower_run_id(cfg, run_config)
        write_app(app, run_config)
        t_run = time.monotonic()
        runner = procs.start("flwr-run", [flwr, "run", str(app), "deploy", "--stream"], cli_env)
        killed_at = None
        while runner.poll() is None:
            procs.watch()
            if time.monotonic() > deadline:
                raise TimeoutError("flwr run did not finish before the deadline")
            if args.kill_client >= 0 and killed_at is None and db.exists():
                try:
                    s = Store(db)
                    row = s.run(run_id)
                    s.close()
                except Exception:  # noqa: BLE001 - the ServerApp may be creating the file right now
                    row = None
                if row is not None and row["rounds_done"] >= args.kill_after_round:
                    time.sleep(1.0)
                    procs.kill(f"supernode{args.kill_client}")
                    killed_at = int(row["rounds_done"])
                    log(f"killed supernode{args.kill_client} (SIGKILL) after {killed_at} stored round(s)")
            time.sleep(0.5)
        summary["flwr_run_exit_code"] = runner.returncode
        summary["run_seconds"] = round(time.monotonic() - t_run, 1)
        log(f"flwr run exited with {runner.returncode} after {summary['run_seconds']}s")
        # the store
        s = Store(db)
        row = s.run(run_id)
        if row is None:
            raise RuntimeError(f"no run {run_id} in {db}; see {work / 'logs'}")
        hist = s.round_metrics(run_id)
        fails = s.records(run_id, "failure")
        refused = [f for f in fails if f["data"].get("phase") == "identity" and f["data"].get("field") == "registry"]
        by_round: dict[str, list[int]] = {}
        for f in fails:
            if "phase" not in f["data"]:
                by_round.setdefault(str(f["round"]), []).append(f["client"])
        summary.update({
            "run_id": run_id, "status": row["status"], "rounds": len(hist),
            "accepted": [h["accepted"] for h in hist], "local_acc": [h.get("local_acc") for h in hist],
            "round_wall_s": [round(h["wall_s"], 1) for h in hist],
            "killed_client": args.kill_client if killed_at is not None else None, "killed_after_rounds": killed_at,
            "failed_clients_round": by_round, "failures": [(f["round"], f["client"], f["data"]) for f in fails],
            "round0_clients_with_metrics": sum(r["local_acc"] is not None for r in s.client_rows(run_id, 0)),
            "impostor_refusals": [f["data"] for f in refused],
            "client0_failures": [f["round"] for f in fails if f["client"] == 0 and "phase" not in f["data"]],
            "final": json.loads(row["final"] or "{}"),
        })
        s.close()
        rep = run_cmd([str(BIN / "fedprism"), "report", "--db", str(db), "--out", str(work / "report"), "--no-plots"],
                      base_env, left(120), check=False)
        summary["report_ok"] = rep.returncode == 0 and f"{cfg['method']} (flower)" in (work / "report" / "results.md").read_text() \
            if (work / "report" / "results.md").exists() else False
        checks = {
            "finished": row["status"] == "finished" and len(hist) == args.rounds,
            "unregistered refused": summary["unregistered_node_refused"],
            "report": summary["report_ok"],
            "round 0 intact": summary["round0_clients_with_metrics"] == args.nodes,
        }
        if args.impostor:
            checks["impostor refused"] = bool(refused)
            checks["client 0 kept its node"] = not summary["client0_failures"] and args.kill_client != 0
        if args.kill_client >= 0:
            checks["kill happened"] = killed_at is not None
            checks["failure recorded"] = args.kill_client in by_round.get(str(args.kill_after_round), [])
            checks["survivors aggregated"] = all(a == args.nodes - 1 for a in summary["accepted"][args.kill_after_round:])
        if args.secagg:              # the server saw only the sum: equal to plain aggregation within the bound
            import torch

            from fedprism.experiment.runner import Experiment
            s = Store(db)
            rec = s.records(run_id, "secagg")
            s.close()
            ref = Experiment(cfg, Store(work / "in_process.db"))
            ref.run()
            got = torch.load(work / "final_state.pt", weights_only=False)["state"]["w"].double()
            want = ref.state["w"].double()
            d = rec[0]["data"] if rec else {}
            bound = (len(d.get("clients", [])) * 2 * d.get("clip", 8.0) / 2 ** 22 * d.get("max_weight", 0)
                     / max(d.get("weight_total", 1), 1e-300) + 2 ** -23 * float(want.abs().max()))
            summary["secagg"] = {"records": len(rec), "max_abs_diff": float((got - want).abs().max()),
                                 "bound": bound, "clients": d.get("clients")}
            checks["secagg record every round"] = len(rec) == args.rounds
            checks["secagg within the quantisation bound"] = 0 < summary["secagg"]["max_abs_diff"] <= bound
        summary["checks"] = checks
        summary["ok"] = all(checks.values())
        for k, v in checks.items():
            log(f"check {k}: {'ok' if v else 'FAILED'}")
    except Exception as e:  # noqa: BLE001 - report, clean up, exit non-zero
        summary["error"] = f"{type(e).__name__}: {e}"
        log(f"error: {summary['error']}")
    finally:
        summary["leftover_processes"] = procs.stop_all()
        summary["seconds"] = round(time.monotonic() - t_start, 1)
        log(f"stopped {len(procs.procs)} process group(s); leftover: {summary['leftover_processes']}; "
            f"total {summary['seconds']}s; logs in {work / 'logs'}")
        if args.json:
            Path(args.json).write_text(json.dumps(summary, indent=1, default=str))
    return 0 if summary["ok"] and not summary["leftover_processes"] else 1


if __name__ == "__main__":
    sys.exit(main())
