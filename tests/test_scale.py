"""Federations of many clients: client-state storage (`state.storage`), sampled evaluation
(`eval.clients`), evaluation in client blocks, the size limits, and a run of 10 000 clients
(docs/architecture.md, "Scale"; HACCS's set-membership selection is tested in tests/test_selection.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fedprism.errors import ConfigError
from fedprism.experiment import evaluate
from fedprism.experiment.clientstore import FLOAT16_MAX, MmapStore, StoreMismatch, make_store
from fedprism.experiment.config import resolve
from fedprism.experiment.evaluate import sample_eval_clients
from fedprism.experiment.runner import Experiment
from fedprism.experiment.store import Store
from fedprism.federation import Federation
from fedprism.protocol import ClientState, Context

SMALL = dict(dataset="digits", clients=6, rounds=3, fraction=0.5, local_epochs=1, batch_size=16, lr=0.05,
             partition="dirichlet", engine="sequential", **{"partition.alpha": 0.5})
DUAL = {"method": "fedprism_dual", "fedprism_dual.k": 2}
TIMING = ("train_s", "eval_s", "wall_s")


def cfg(**kw):
    return resolve({**SMALL, **{k.replace("__", "."): v for k, v in kw.items()}})


def stored(store: Store, run_id: str) -> tuple[list[dict], list[tuple]]:
    """Every stored number of a run except timings: round metrics and per-client rows."""
    hist = [{k: v for k, v in h.items() if k not in TIMING} for h in store.round_metrics(run_id)]
    rows = [tuple(r)[1:] for r in store.db.execute(
        "SELECT * FROM client_metrics WHERE run_id=? ORDER BY round, client", (run_id,))]
    return hist, rows


def ctx(n: int, p: int = 5) -> Context:
    """A Context of n clients and a P-parameter model (what a client store needs of it)."""
    from types import SimpleNamespace

    return Context(num_clients=n, num_classes=2, spec=SimpleNamespace(size=p), init=torch.linspace(-1, 1, p),
                   n_train=np.ones(n, int), label_hist=np.ones((n, 2), int), seed=0, rounds=1, fraction=0.5)


# -- the default is what main computed ------------------------------------------------------------------------
#: every stored number (timings aside) of a small run of each kind, computed by the code before `state.storage`,
#: `eval.clients` and evaluation blocks existed (git main at b398469). Kept as values, not as a hash: the last
#: bits of a float loss depend on the CPU's kernels (an AVX-512 and an AVX2 machine differ there while every
#: accuracy agrees), so ids, counts and local_acc must match exactly and other floats to 1e-6 relative (far
#: below one flipped prediction, which moves an accuracy by >= 1/900).
PINNED = json.loads((Path(__file__).parent / "data" / "pinned_small_runs.json").read_text())


def assert_same_numbers(got, want, where="") -> None:
    """Equal structure, equal ints/strings/None, floats within 1e-6 relative (an accuracy flip is >= 1/75)."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(want), f"{where}: keys {sorted(got)} != {sorted(want)}"
        for k in want:
            assert_same_numbers(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), f"{where}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same_numbers(g, w, f"{where}[{i}]")
    elif isinstance(want, float) and not isinstance(got, bool):
        assert isinstance(got, (int, float)) and got == pytest.approx(want, rel=1e-6, abs=1e-9), f"{where}: {got} != {want}"
    else:
        assert got == want and type(got) is type(want), f"{where}: {got!r} != {want!r}"


@pytest.mark.parametrize("method,extra", [("fedprism_dual", {"fedprism_dual.k": 2}), ("local", {}),
                                          ("fedprism", {"fedprism.k": 2, "fedprism.m": 1})])
def test_default_run_reproduces_the_numbers_of_the_code_before(tmp_path, method, extra):
    torch.set_num_threads(1)
    c = resolve({**SMALL, "method": method, **extra})
    s = Store(tmp_path / "p.db")
    Experiment(c, s).run()
    want = PINNED[method]
    assert c.run_id == want["run_id"]                                # new keys at their defaults: same ids
    hist, rows = stored(s, c.run_id)
    assert [h["local_acc"] for h in hist] == [h["local_acc"] for h in want["rounds"]]
    assert_same_numbers(hist, want["rounds"], "rounds")
    assert_same_numbers(rows, [r[1:] for r in want["client_metrics"]], "client_metrics")   # r[0]: the run id


# -- state.storage ---------------------------------------------------------------------------------------------
def test_mmap_storage_equals_memory_bit_for_bit_across_a_crash_between_checkpoint_and_commit(tmp_path, monkeypatch):
    mem = cfg(**DUAL)
    a = Store(tmp_path / "a.db")
    ea = Experiment(mem, a)
    ea.run()
    mm = cfg(**DUAL, **{"state.storage": "mmap"})
    assert mm.run_id != mem.run_id and mm["state.storage"] == "mmap"
    b = Store(tmp_path / "b.db")
    eb = Experiment(mm, b)
    assert isinstance(eb.clients, MmapStore)
    real = MmapStore.commit
    calls = []

    def crash_once(self):               # round 1's checkpoint is on disk, its rows never reach the files
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real(self)

    monkeypatch.setattr(MmapStore, "commit", crash_once)
    with pytest.raises(KeyboardInterrupt):
        eb.run()
    monkeypatch.setattr(MmapStore, "commit", real)
    assert b.rows_dir(mm.run_id).is_dir() and b.checkpoint_path(mm.run_id).is_file()
    eb2 = Experiment(mm, b)
    res = eb2.run()
    assert res.resumed_from == 1
    assert stored(a, mem.run_id) == stored(b, mm.run_id)
    for k, v in ea.clients.data.items():                    # the clients' final rows, bit for bit
        assert torch.equal(v, eb2.clients.data[k])
    assert not b.rows_dir(mm.run_id).exists()                  # moved beside the kept final state
    assert b.final_rows_dir(mm.train_id).is_dir()


def test_mmap_files_that_are_not_the_checkpoints_restart_the_run(tmp_path):
    mm = cfg(**DUAL, **{"state.storage": "mmap"})
    s = Store(tmp_path / "m.db")
    Experiment(mm, s).run(stop_after=2)
    meta = s.rows_dir(mm.run_id) / "meta.json"
    m = json.loads(meta.read_text())
    meta.write_text(json.dumps({**m, "token": "0" * 16}))        # files of another attempt
    res = Experiment(mm, s).run()
    assert res.status == "finished" and res.resumed_from is None
    (note,) = s.records(mm.run_id, "checkpoint_discarded")
    assert note["round"] == 0 and "another run or attempt" in note["data"]["reason"]
    ref = Store(tmp_path / "r.db")
    Experiment(mm, ref).run()
    assert stored(ref, mm.run_id)[0] == stored(s, mm.run_id)[0]


def _damage_meta(**change):
    def damage(folder: Path) -> None:
        meta = json.loads((folder / "meta.json").read_text())
        (folder / "meta.json").write_text(json.dumps({**meta, **change}))
    return damage


@pytest.mark.parametrize("damage, reason", [
    (lambda f: (f / "meta.json").unlink(), "no readable .*meta.json"),
    (lambda f: (f / "meta.json").write_text("{not json"), "no readable .*meta.json"),
    (_damage_meta(token="0" * 16), "another run or attempt"),
    (_damage_meta(clients=8), "hold other shapes"),
    (_damage_meta(state={"w": {"shape": [5], "dtype": "float16"}, "z": {"shape": [3], "dtype": "float32"}}),
     "hold other shapes"),
    (_damage_meta(seq=0), r"at commit 0, the checkpoint at 3"),              # files older than the checkpoint
    (_damage_meta(seq=5), r"at commit 5, the checkpoint at 3"),              # or newer
    (lambda f: (f / "z.rows").unlink(), r"z.rows is missing or not 84 bytes"),
    (lambda f: (f / "w.rows").write_bytes((f / "w.rows").read_bytes()[:-4]), r"w.rows is missing or not 140"),
], ids=["meta deleted", "meta not json", "other token", "other N", "other dtype", "older commit",
        "newer commit", "rows deleted", "rows truncated"])
def test_mmap_restore_refuses_row_files_that_are_not_the_checkpoints(tmp_path, damage, reason):
    """Each way the row files can disagree with a checkpoint is refused with a StoreMismatch naming it
    (the runner then discards the checkpoint and restarts the run: the test above); undamaged files
    restore to the checkpoint's rows, pending rows included."""
    c = ctx(7)
    decl = {"w": ClientState(("P",), init="model"), "z": ClientState((3,), init="zeros")}
    st = make_store("mmap", decl, c, tmp_path / "rows")
    rng = torch.Generator().manual_seed(0)
    for who in ([1, 4], [0, 5]):
        rows = {"w": torch.randn(2, 5, generator=rng), "z": torch.randn(2, 3, generator=rng)}
        st.write(np.array(who), rows)
        st.commit()
    st.write(np.array([2]), {"w": torch.randn(1, 5, generator=rng), "z": torch.randn(1, 3, generator=rng)})
    snap, want = st.snapshot(), st.rows(np.arange(7))
    assert snap["client_rows"]["seq"] == 3
    fresh = make_store("mmap", decl, c, tmp_path / "rows")
    fresh.restore(snap)                                               # the undamaged files: restored
    for k in decl:
        assert torch.equal(fresh.rows(np.arange(7))[k], want[k])
    damage(tmp_path / "rows")
    with pytest.raises(StoreMismatch, match=reason):
        make_store("mmap", decl, c, tmp_path / "rows").restore(snap)


def test_mmap_rereads_written_rows_and_initial_rows(tmp_path):
    c = ctx(7)
    decl = {"w": ClientState(("P",), init="model"), "z": ClientState((3,), init="zeros")}
    st = make_store("mmap", decl, c, tmp_path / "rows")
    mem = make_store("memory", decl, c)
    rng = torch.Generator().manual_seed(0)
    touched = np.zeros(7, dtype=bool)
    for step, who in enumerate(([1, 4], [0, 4, 5], [5])):
        who = np.array(who)
        rows = {"w": torch.randn(len(who), 5, generator=rng), "z": torch.randn(len(who), 3, generator=rng)}
        st.write(who, rows)
        mem.write(who, rows)
        for k in decl:                                  # pending rows are read back before the commit
            assert torch.equal(st.rows(np.arange(7))[k], mem.rows(np.arange(7))[k])
        st.commit()
        touched[who] = True
        assert not st.pending["w"] and np.array_equal(st.written["w"], touched)
    for k in decl:                                      # from the files, and initial rows for 2, 3, 6
        assert torch.equal(st.rows(np.array([6, 0, 3, 5]))[k], mem.rows(np.array([6, 0, 3, 5]))[k])
    assert (tmp_path / "rows" / "w.rows").stat().st_size == 7 * 5 * 4


def test_float16_storage_rounds_to_half_precision_and_refuses_overflow(monkeypatch):
    asked = []
    real = ClientState.initial
    monkeypatch.setattr(ClientState, "initial", lambda self, cx, n: asked.append(n) or real(self, cx, n))
    make_store("float16", {"w": ClientState(("P",)), "v": ClientState(("P",))}, ctx(1000))
    assert asked == [1, 1]                   # one initial row per name, copied: no [N, P] float32 on the way
    c = ctx(4)
    decl = {"w": ClientState(("P",), init="model"), "n": ClientState((2,), init=0.0, dtype=torch.int64)}
    st = make_store("float16", decl, c)
    assert st.data["w"].dtype == torch.float16 and st.data["n"].dtype == torch.int64
    x = torch.tensor([[1 / 3, -2.0009765625, 1e-3, 60000.0, 0.1]])
    st.write(np.array([2]), {"w": x, "n": torch.tensor([[7, -9]])})
    got = st.rows(np.array([2]))
    assert got["w"].dtype == torch.float32 and torch.equal(got["w"], x.half().float())
    assert ((got["w"] - x).abs() <= x.abs() * 2.0 ** -11).all()      # the stated tolerance
    assert torch.equal(got["n"], torch.tensor([[7, -9]]))              # integer state is kept as declared
    assert torch.equal(st.rows(np.array([0]))["w"], c.init.half().float()[None])
    with pytest.raises(ValueError, match=r"client state 'w' of client 3: a value of 70000 is beyond float16's range"):
        st.write(np.array([1, 3]), {"w": torch.tensor([[0.0] * 5, [0.0, 0.0, 7e4, 0.0, 0.0]])})
    assert FLOAT16_MAX == float(torch.finfo(torch.float16).max)


def test_float16_run_stays_within_tolerance_of_memory(tmp_path):
    a, b = Store(tmp_path / "a.db"), Store(tmp_path / "b.db")
    ea = Experiment(cfg(method="local"), a)
    ea.run()
    eb = Experiment(cfg(method="local", **{"state.storage": "float16"}), b)
    eb.run()
    wa, wb = ea.clients.data["w"], eb.clients.data["w"]
    assert wb.dtype == torch.float16 and not torch.equal(wa, wb.float())
    assert (wa - wb.float()).abs().max() < 1e-2                     # 3 rounds of Local on digits
    la = [h["local_acc"] for h in a.round_metrics(ea.run_id)]
    lb = [h["local_acc"] for h in b.round_metrics(eb.run_id)]
    assert np.allclose(la, lb, atol=0.05)


# -- sampled and blocked evaluation ----------------------------------------------------------------------------
def test_sampled_evaluation_scores_exactly_the_drawn_clients_and_the_final_round_all(tmp_path, monkeypatch):
    c = cfg(method="local", clients=8, **{"eval.clients": 3})
    s = Store(tmp_path / "e.db")
    exp = Experiment(c, s)
    scored: dict[int, set[int]] = {}
    now = {"rnd": -1}
    real_eval, real_agg = exp.engine.evaluate, exp.algo.aggregate

    def agg(state, rnd, update):
        now["rnd"] = rnd
        return real_agg(state, rnd, update)

    def spy(params, clients, split):
        if split in ("local", "global"):
            scored.setdefault(now["rnd"], set()).update(int(x) for x in clients)
        return real_eval(params, clients, split)

    monkeypatch.setattr(exp.algo, "aggregate", agg)
    monkeypatch.setattr(exp.engine, "evaluate", spy)
    exp.run()
    hist = s.round_metrics(c.run_id)
    for rnd in (0, 1):
        want = sample_eval_clients(c["seed"], rnd, 8, 3).tolist()
        assert [r["client"] for r in s.client_rows(c.run_id, rnd)] == want
        assert hist[rnd]["eval_clients"] == 3
        assert [r["data"]["clients"] for r in s.records(c.run_id, "eval_sample") if r["round"] == rnd] == [want]
        assert scored.get(rnd, set()) <= set(want)                      # only drawn clients were scored ...
        local = [r["local_acc"] for r in s.client_rows(c.run_id, rnd)]
        assert hist[rnd]["local_acc"] == pytest.approx(np.mean(local), abs=1e-12)
    assert scored[0] == set(sample_eval_clients(c["seed"], 0, 8, 3).tolist())    # ... all of them (no cache yet)
    assert [r["client"] for r in s.client_rows(c.run_id, 2)] == list(range(8)) and "eval_clients" not in hist[2]
    assert not [r for r in s.records(c.run_id, "eval_sample") if r["round"] == 2]
    final = json.loads(s.run(c.run_id)["final"])
    assert final["eval_sampled_rounds"] == 2
    assert final["best_local_acc"] == final["local_acc"] == hist[2]["local_acc"]   # best: full evaluations only


def test_eval_clients_draw_is_seeded_and_shared():
    a = sample_eval_clients(3, 5, 100, 10)
    assert len(set(a.tolist())) == 10 and np.array_equal(a, np.sort(a))
    assert np.array_equal(a, sample_eval_clients(3, 5, 100, 10))
    assert not np.array_equal(a, sample_eval_clients(3, 6, 100, 10))


@pytest.mark.parametrize("method,extra", [("fedprism_dual", {"fedprism_dual.k": 2}),
                                          ("fedprism", {"fedprism.k": 2, "fedprism.m": 1})])
def test_evaluation_in_client_blocks_equals_one_call(tmp_path, monkeypatch, method, extra):
    c = resolve({**SMALL, "method": method, "rounds": 1, **extra})
    exp = Experiment(c, Store(tmp_path / "x.db"))
    exp.run()
    state = exp.state
    whole = evaluate.Evaluator(exp.engine, 6)(exp.algo, state, exp.clients)
    monkeypatch.setattr(evaluate, "EVAL_BLOCK_BYTES", 8 * exp.ctx.spec.size * 2)     # blocks of 2 clients
    ev = evaluate.Evaluator(exp.engine, 6)
    assert ev.block_size() == 2
    calls = []
    real = exp.algo.eval_payload
    monkeypatch.setattr(exp.algo, "eval_payload", lambda st, cl: calls.append(len(cl)) or real(st, cl))
    blocks = ev(exp.algo, state, exp.clients)
    assert calls == [2, 2, 2]
    for f in ("clients", "local_acc", "local_f1", "n_test", "global_acc", "global_f1"):
        assert np.array_equal(getattr(whole, f), getattr(blocks, f), equal_nan=True), f
    # the float64 mixing of personalised models is a BLAS product whose kernel depends on the number of rows
    # in the block: a model can differ by one float32 ulp, a loss by ~1e-9 relative (docs/architecture.md)
    assert np.allclose(whole.local_loss, blocks.local_loss, rtol=1e-6, atol=0)
    assert whole.alternatives.keys() == blocks.alternatives.keys()
    for k in whole.alternatives:
        assert np.array_equal(whole.alternatives[k], blocks.alternatives[k], equal_nan=True)
    sub = ev(exp.algo, state, exp.clients, np.array([1, 4, 5]))
    assert sub.clients.tolist() == [1, 4, 5]
    assert np.array_equal(sub.local_acc, whole.local_acc[[1, 4, 5]], equal_nan=True)


# -- configuration and limits ----------------------------------------------------------------------------------
@pytest.mark.parametrize("raw,key,needle", [
    ({"eval.clients": 7}, "eval.clients", "[0, clients=6]"),
    ({"eval.clients": -1}, "eval.clients", ">= 0"),
    ({"state.storage": "disk"}, "state.storage", "memory, float16, mmap"),
    ({"data.synthetic_devices": 100}, "data.synthetic_devices", "only with dataset=synthetic"),
    ({"dataset": "synthetic", "data.synthetic_devices": 0}, "data.synthetic_devices", "[1, 100000]"),
])
def test_new_keys_name_the_key_value_and_what_is_allowed(raw, key, needle):
    with pytest.raises(ConfigError) as e:
        resolve({**SMALL, **raw})
    assert e.value.key == key and needle in str(e.value)


def test_new_keys_at_their_defaults_leave_run_ids_alone():
    base = resolve(SMALL)
    same = resolve({**SMALL, "eval.clients": 0, "state.storage": "memory"})
    assert same.run_id == base.run_id and same.train_id == base.train_id
    assert resolve({**SMALL, "state.storage": "mmap"}).run_id != base.run_id
    assert resolve({**SMALL, "eval.clients": 2}).run_id != base.run_id


# -- 10 000 clients ------------------------------------------------------------------------------------------
def tiny_federation(n: int, seed: int = 0) -> Federation:
    """n clients with 2 train samples and 1 local test sample each, 4 features, 2 classes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2 * n, 4, generator=g)
    xt = torch.randn(n, 4, generator=g)
    train = [np.array([2 * i, 2 * i + 1]) for i in range(n)]
    test = [np.array([i]) for i in range(n)]
    return Federation(x, (x[:, 0] > 0).long(), xt, (xt[:, 0] > 0).long(), train, test, 2, ["a", "b"], "tiny")


@pytest.mark.slow
def test_ten_thousand_clients_of_fedprism_dual_with_mmap_and_sampled_evaluation(tmp_path):
    from fedprism.selection import sample_clients

    N = 10_000
    c = resolve({"method": "fedprism_dual", "dataset": "synthetic", "clients": N, "rounds": 2, "fraction": 0.01,
                 "local_epochs": 1, "batch_size": 2, "eval.clients": 50, "eval.global": False,
                 "state.storage": "mmap", "model": "mlp", "engine": "vectorized", "compile": "false",
                 "partition.min_train": 1, "fedprism_dual.k": 3})
    s = Store(tmp_path / "big.db")
    exp = Experiment(c, s, fed=tiny_federation(N))
    assert exp.run().status == "finished"
    hist = s.round_metrics(c.run_id)
    assert hist[0]["eval_clients"] == 50 and hist[0]["clients"] == 100 and "eval_clients" not in hist[1]
    assert len(s.client_rows(c.run_id, 0)) == 50 and len(s.client_rows(c.run_id, 1)) == N
    trained = np.union1d(sample_clients(c["seed"], 0, N, 0.01), sample_clients(c["seed"], 1, N, 0.01))
    for k in ("private", "expert"):                                  # only the cohorts' rows were ever written
        assert np.array_equal(np.flatnonzero(exp.clients.written[k]), trained)
