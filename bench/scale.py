"""Scale bench: round time and peak memory against the number of clients N (docs/architecture.md, "Scale").

For N in {100, 1 000, 10 000} clients, the methods fedavg, local, fedprism and fedprism_dual at 1 %
participation (fraction = 0.01), on Fashion-MNIST (Dirichlet(0.3) label skew, LeNet-5) and on FedProx's
synthetic data (`data.synthetic_devices = 1000`, Dirichlet(0.3), the MLP); E = 1, B = 32, a few rounds.
Methods with client state (local, fedprism_dual) also run with `state.storage = float16` and `mmap`.
At N = 100 the cohort is one client, and a method that clusters a round's clients needs at least K of
them (`fedprism.experiment.limits`), so fedprism and fedprism_dual run there with K = 1 (those rows
were measured again on 2026-11-27; before the check they ran with K = 5 and every re-clustering skipped).
Every configuration runs in its own child process (`--child`), so its peak RSS is that child's own
(`os.wait4` rusage, ru_maxrss), not the largest so far.

Engine and compilation are the defaults (`engine = auto`, `compile = auto`: for runs this short, the
sequential engine without compilation), one torch thread. A round's time includes its checkpoint (the
runner's own round time stops before it). Evaluation: every non-final round scores `eval.clients = 100`
clients drawn per round; the final round scores every client (as `eval.clients` always does). Only the clients' local test splits are scored
(`eval.global = false`): scoring 10 000 personalised models on the 10 000-image global test set is
10^8 forward passes per stream, hours on a 2-core CPU, and measures the CPU, not the federation.

    python bench/scale.py                          # the whole grid (each run in its own process)
    python bench/scale.py --n 100 1000 --rounds 3  # a part of it
    python bench/scale.py --plot-only              # redraw bench/out/scale.md and bench/out/scale.png from scale.json
    python bench/scale.py --phases fedprism_dual 1000 fmnist [key=value ...]   # where the memory goes, per phase

Writes bench/out/scale.json (raw rows), bench/out/scale.md (the table) and bench/out/scale.png (the plot).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "out"                                  # the raw outputs of bench/
sys.path.insert(0, str(HERE.parent / "src"))

METHODS = ("fedavg", "local", "fedprism", "fedprism_dual")
STATEFUL = ("local", "fedprism_dual")
DATASETS = ("fmnist", "synthetic")


def base_config(method: str, n: int, dataset: str, rounds: int) -> dict:
    cfg = {"method": method, "clients": n, "dataset": dataset, "fraction": 0.01, "rounds": rounds,
           "local_epochs": 1, "batch_size": 32, "partition": "dirichlet", "partition.alpha": 0.3,
           "partition.min_train": 5, "eval.clients": min(100, n), "eval.global": False, "eval_every": 1,
           "threads": 1, "keep_final": False}
    from fedprism.selection import cohort_size

    cohort = cohort_size(n, cfg["fraction"])
    if method in ("fedprism", "fedprism_dual") and cohort < 5:      # K = 5 needs 5 clients a round
        cfg[f"{method}.k"] = cohort
        if method == "fedprism":
            cfg["fedprism.m"] = min(2, cohort)
    if dataset == "fmnist":
        cfg["model"] = "lenet5"
    else:
        cfg.update({"model": "mlp", "data.synthetic_devices": 1000})
    return cfg


# -- one configuration, in a child process ------------------------------------------------------------
def _status() -> tuple[float, float]:
    s = Path("/proc/self/status").read_text()
    g = lambda k: int(re.search(k + r":\s+(\d+)", s).group(1)) / 1024  # noqa: E731
    return g("VmRSS"), g("VmHWM")


def child(raw: dict) -> None:
    """Run one configuration in a fresh store; print one JSON line with its timings."""
    import torch

    from fedprism.experiment.config import resolve
    from fedprism.experiment.federation import build_federation
    from fedprism.experiment.runner import Experiment
    from fedprism.experiment.store import Store

    t0 = time.time()
    cfg = resolve(raw)
    fed = build_federation(cfg)
    t_fed = time.time() - t0
    with tempfile.TemporaryDirectory(dir=os.environ.get("SCALE_TMP")) as d:
        store = Store(Path(d) / "scale.db")
        t1 = time.time()
        exp = Experiment(cfg, store, fed=fed)
        t_init = time.time() - t1
        ckpt: list[float] = []                       # a round's wall time does not include its checkpoint
        save = store.save_checkpoint

        def timed(*a, **k):
            t = time.time()
            save(*a, **k)
            ckpt.append(time.time() - t)

        store.save_checkpoint = timed
        t2 = time.time()
        res = exp.run()
        t_run = time.time() - t2
        rounds = [dict(r) for r in store.db.execute("SELECT round, wall_s FROM rounds WHERE run_id=? ORDER BY round",
                                                    (cfg.run_id,))]
        hist = store.round_metrics(cfg.run_id)
        store.close()
    print(json.dumps({
        "status": res.status, "P": exp.ctx.spec.size, "setup_s": t_fed + t_init, "federation_s": t_fed,
        "round_wall_s": [r["wall_s"] for r in rounds], "checkpoint_s": ckpt, "run_s": t_run,
        "train_s": [h.get("train_s") for h in hist],
        "eval_s": [h.get("eval_s") for h in hist], "local_acc": res.final.get("local_acc"),
        "rss_end_mib": _status()[0], "torch_threads": torch.get_num_threads()}))


def run_one_wait4(raw: dict, timeout: float) -> dict:
    """The configuration in its own process: its JSON line plus its own peak RSS (ru_maxrss from os.wait4)."""
    env = {**os.environ, "PYTHONPATH": str(HERE.parent / "src")}
    t = time.time()
    with tempfile.TemporaryFile("w+") as fo, tempfile.TemporaryFile("w+") as fe:
        p = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(raw)],
                             stdout=fo, stderr=fe, env=env, text=True)
        deadline = time.time() + timeout
        rc, usage = None, None
        while rc is None:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                rc, usage = os.waitstatus_to_exitcode(status), ru
                p.returncode = rc
                break
            if time.time() > deadline:
                p.kill()
                _, status, usage = os.wait4(p.pid, 0)
                rc = "timeout"
                p.returncode = -9
                break
            time.sleep(0.2)
        fo.seek(0)
        fe.seek(0)
        out, err = fo.read(), fe.read()
    row = {"config": raw, "wall_s": time.time() - t, "rc": rc,
           "peak_rss_mib": usage.ru_maxrss / 1024 if usage is not None else None}
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if lines:
        row.update(json.loads(lines[-1]))
    if rc != 0:
        row["error"] = err.strip().splitlines()[-1] if err.strip() else str(rc)
    return row


# -- where the memory goes (one configuration, in this process) -------------------------------------------
def phases(method: str, n: int, dataset: str, overrides: list[str], rounds: int) -> None:
    """RSS before/after and peak (VmHWM, reset before each phase) of every phase of a short run."""
    from fedprism.experiment.config import parse_overrides, resolve
    from fedprism.experiment.federation import build_federation
    from fedprism.experiment.runner import Experiment
    from fedprism.experiment.store import Store

    top = [0.0]                      # clear_refs resets VmHWM (and ru_maxrss): keep the true peak here

    def reset():
        top[0] = max(top[0], _status()[1])
        Path("/proc/self/clear_refs").write_text("5")

    raw = {**base_config(method, n, dataset, rounds), **parse_overrides(overrides)}
    cfg = resolve(raw)
    r0 = _status()[0]
    fed = build_federation(cfg)
    idx = sum(i.nbytes for i in fed.train_idx + fed.test_idx) / 2**20
    print(f"{method} N={n} {dataset}: federation +{_status()[0] - r0:.0f} MiB (inputs "
          f"{(fed.x_train.numel() + fed.x_test.numel()) * 4 / 2**20:.0f} MiB, index arrays {idx:.1f} MiB + "
          f"{len(fed.train_idx) * 2} array objects)")
    with tempfile.TemporaryDirectory(dir=os.environ.get("SCALE_TMP")) as d:
        store = Store(Path(d) / "p.db")
        r1 = _status()[0]
        exp = Experiment(cfg, store, fed=fed)
        P = exp.ctx.spec.size
        print(f"  experiment init +{_status()[0] - r1:.0f} MiB, P = {P}, state.storage = {cfg['state.storage']}")
        for k, d_ in exp.algo.client_state.items():
            per = {"memory": 4, "float16": 2, "mmap": 0}[cfg["state.storage"]]
            print(f"  client state {k!r}: {n} x {P} -> {n * P * per / 2**20:.0f} MiB in RAM")
        st = exp.algo.init_state()
        import torch
        sizes = {k: v.numel() * v.element_size() / 2**20 for k, v in st.items() if isinstance(v, torch.Tensor)}
        print("  server state MiB:", {k: round(v, 2) for k, v in sizes.items()})
        table: dict[str, list] = {}

        def wrap(obj, name, label):
            f = getattr(obj, name)

            def w(*a, **k):
                before = _status()[0]
                reset()
                t = time.time()
                out = f(*a, **k)
                after, hwm = _status()
                row = table.setdefault(label, [0.0, 0.0, 0.0, 0])
                row[0] = max(row[0], hwm - before)
                row[1] = after
                row[2] += time.time() - t
                row[3] += 1
                return out
            setattr(obj, name, w)

        wrap(exp.algo, "plan", "plan")
        wrap(exp, "local_work", "train")
        wrap(exp.algo, "aggregate", "aggregate")
        wrap(exp, "evaluate_round", "evaluate")
        wrap(store, "save_checkpoint", "checkpoint")
        exp.run()
        for k, (peak, after, secs, calls) in table.items():
            print(f"  {k:10s} peak +{peak:7.0f} MiB over its start, RSS after {after:6.0f} MiB, "
                  f"{secs / calls:7.2f} s per call")
        store.close()
    print(f"  peak RSS {max(top[0], _status()[1]):.0f} MiB (the largest VmHWM between resets)")


# -- table and plot ---------------------------------------------------------------------------------------
def label(row: dict) -> str:
    st = row["config"].get("state.storage", "memory")
    return row["config"]["method"] + ("" if st == "memory" else f" ({st})")


def round_times(row: dict) -> list[float]:
    """Each round's wall time plus its checkpoint (the runner's round time stops before the checkpoint)."""
    walls, ck = row.get("round_wall_s") or [], row.get("checkpoint_s") or []
    return [w + (ck[i] if i < len(ck) else 0.0) for i, w in enumerate(walls)]


def steady(times: list[float]) -> float:
    """Median time of the rounds between the first (warm-up) and the last (every client scored)."""
    mid = sorted(times[1:-1]) or sorted(times)
    return mid[len(mid) // 2] if mid else float("nan")


def table(rows: list[dict], machine: str) -> str:
    out = [f"Machine: {machine}. Each row is one child process; times are wall-clock seconds on shared cores "
           "(indicative only, see bench/README.md).", "",
           "| dataset | N | method (state.storage) | P | peak RSS MiB | setup s | round s (sampled eval) | "
           "of which checkpoint s | final round s (all clients) | status |",
           "|---|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        c = r["config"]
        times = round_times(r)
        ck = r.get("checkpoint_s") or []
        st = "ok" if r.get("rc") == 0 else f"{r.get('rc')}: {r.get('error', '')}"[:80]
        out.append(f"| {c['dataset']} | {c['clients']} | {label(r)} | {r.get('P', '')} | "
                   f"{(r.get('peak_rss_mib') or float('nan')):.0f} | {r.get('setup_s', float('nan')):.1f} | "
                   f"{steady(times):.2f} | {steady(ck):.2f} | {times[-1] if times else float('nan'):.1f} | {st} |")
    if any(not r.get("checkpoint_s") for r in rows):
        out += ["", "A checkpoint time of nan: the row was measured before checkpoint times were recorded, so its "
                "round times exclude the checkpoint."]
    return "\n".join(out) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), sharex=True)
    for j, ds in enumerate(DATASETS):
        mine = [r for r in rows if r["config"]["dataset"] == ds and r.get("rc") == 0]
        for lab in sorted({label(r) for r in mine}):
            pts = sorted(((r["config"]["clients"], r) for r in mine if label(r) == lab), key=lambda t: t[0])
            ns = [n for n, _ in pts]
            style = "--" if "(" in lab else "-"
            axes[0, j].plot(ns, [r["peak_rss_mib"] / 1024 for _, r in pts], style, marker="o", label=lab)
            axes[1, j].plot(ns, [steady(round_times(r)) for _, r in pts], style, marker="o", label=lab)
        axes[0, j].set_title(f"{ds}: peak RSS")
        axes[0, j].axhline(8, color="grey", lw=0.8, ls=":")
        axes[0, j].set_ylabel("GiB")
        axes[1, j].set_title(f"{ds}: round time (a round with sampled evaluation)")
        axes[1, j].set_ylabel("s (shared cores)")
        axes[1, j].set_xlabel("clients N (1 % per round)")
        for a in axes[:, j]:
            a.set_xscale("log")
            a.grid(alpha=0.3)
    axes[1, 1].set_yscale("log")
    axes[1, 0].set_yscale("log")
    axes[0, 1].legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def machine() -> str:
    cpu = ""
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                   if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = ""
    try:
        kb = int(re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1))
        mem = f", {kb / 2**20:.0f} GiB RAM"
    except (OSError, AttributeError):
        pass
    import torch
    return f"{os.cpu_count()} x {cpu or platform.processor()}{mem}, Python {platform.python_version()}, torch " \
           f"{torch.__version__}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--phases", nargs="+", metavar="ARG", help="METHOD N DATASET [key=value ...]")
    ap.add_argument("--n", type=int, nargs="+", default=[100, 1000, 10_000])
    ap.add_argument("--methods", nargs="+", default=list(METHODS))
    ap.add_argument("--datasets", nargs="+", default=list(DATASETS))
    ap.add_argument("--storages", nargs="+", default=["memory", "float16", "mmap"],
                    help="state.storage values for the methods with client state")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--out", default=str(OUT / "scale.json"))
    ap.add_argument("--plot-only", action="store_true")
    ap.add_argument("--skip-done", action="store_true", help="skip configurations scale.json holds a finished row of")
    a = ap.parse_args()
    if a.child:
        child(json.loads(a.child))
        return
    if a.phases:
        m, n, ds, *rest = a.phases
        phases(m, int(n), ds, rest, a.rounds)
        return
    out = Path(a.out)
    data = json.loads(out.read_text()) if out.exists() else {"machine": machine(), "rows": []}
    if not a.plot_only:
        for ds in a.datasets:
            for n in a.n:
                for m in a.methods:
                    for st in (a.storages if m in STATEFUL else ["memory"]):
                        raw = {**base_config(m, n, ds, a.rounds), **({"state.storage": st} if st != "memory" else {})}
                        key = json.dumps(raw, sort_keys=True)
                        if a.skip_done and any(json.dumps(r["config"], sort_keys=True) == key and r.get("rc") == 0
                                               and "checkpoint_s" in r for r in data["rows"]):
                            continue
                        row = run_one_wait4(raw, a.timeout)
                        print(f"{ds:9s} N={n:6d} {label(row):24s} peak {row.get('peak_rss_mib') or 0:7.0f} MiB  "
                              f"rounds {[round(w, 1) for w in row.get('round_wall_s', [])]}  rc {row['rc']}"
                              + (f"  {row.get('error')}" if row['rc'] != 0 else ""), flush=True)
                        data["rows"] = [r for r in data["rows"] if json.dumps(r["config"], sort_keys=True) != key]
                        data["rows"].append(row)
                        data["machine"] = machine()
                        out.write_text(json.dumps(data, indent=1))
    order = {m: i for i, m in enumerate(METHODS)}
    rows = sorted(data["rows"], key=lambda r: (r["config"]["dataset"], r["config"]["clients"],
                                               order.get(r["config"]["method"], 9),
                                               r["config"].get("state.storage", "memory")))
    OUT.mkdir(exist_ok=True)
    (OUT / "scale.md").write_text(table(rows, data["machine"]))
    plot(rows, OUT / "scale.png")
    print(f"wrote {out}, {OUT / 'scale.md'}, {OUT / 'scale.png'}")


if __name__ == "__main__":
    main()
