"""The scripts of `bench/`: `bench/run_cost.py` reads whole-run cost from a results store (the quantity the
FedPrism cost target is stated in), read-only; the others run small versions of their benches and check
what they report (the same bits where a bench claims them)."""

from __future__ import annotations

import json
import shutil
import sqlite3

import pytest
import torch
from conftest import load_script

from fedprism.kernels import build
from fedprism.experiment.config import resolve
from fedprism.experiment.runner import Experiment
from fedprism.experiment.store import Store

SMALL = {"dataset": "digits", "model": "mlp", "clients": 4, "fraction": 1.0, "rounds": 3, "local_epochs": 1,
         "eval_every": 1, "engine": "sequential"}


def test_run_cost_sums_train_and_eval_seconds_and_the_ratio(tmp_path, capsys):
    db = tmp_path / "s.db"
    ids = {}
    for method in ("fedavg", "local"):
        store = Store(str(db))
        ids[method] = Experiment(resolve({**SMALL, "method": method}), store).run().run_id
        store.close()
    con = sqlite3.connect(db)
    want = {}
    for m, rid in ids.items():
        ms = [json.loads(r) for (r,) in con.execute("select metrics from rounds where run_id = ?", (rid,))]
        want[m] = (sum(x["train_s"] for x in ms), sum(x["eval_s"] for x in ms if "eval_s" in x))
    con.close()
    before = db.read_bytes()
    mod = load_script("bench/run_cost.py")
    got = mod.costs(str(db), [])
    for m, rid in ids.items():
        assert abs(got[rid]["train"] - want[m][0]) < 1e-9 and abs(got[rid]["eval"] - want[m][1]) < 1e-9
        assert got[rid]["rounds"] == 3 and got[rid]["method"] == m
    assert mod.main([str(db), "--ratio", ids["local"][:8], ids["fedavg"][:8]]) == 0
    ratio = float(capsys.readouterr().out.rsplit("cost ", 1)[1].split(": ")[1].split("x")[0])
    assert abs(ratio - sum(want["local"]) / sum(want["fedavg"])) < 0.006
    assert mod.main([str(db), "--ratio", "nosuchrun", ids["fedavg"][:8]]) == 2
    assert db.read_bytes() == before                                   # read-only
    assert mod.main([str(tmp_path / "missing.db")]) == 2
    assert not (tmp_path / "missing.db").exists()


def test_bf16_final_scores_a_kept_state_at_both_precisions_read_only(tmp_path, capsys):
    """`bench/bf16_final.py`: a finished fedprism_dual run with a kept final state is scored at float32
    (its stored final numbers, to the digit) and at bfloat16; the store is not written."""
    db = tmp_path / "s.db"
    conf = {**SMALL, "method": "fedprism_dual", "fedprism_dual.k": 2, "keep_final": True,
            "engine": "vectorized", "compile": False}
    store = Store(str(db))
    res = Experiment(resolve(conf), store).run()
    store.close()
    con = sqlite3.connect(db)                      # a rollback-journal file, as committed stores are: any
    con.execute("PRAGMA journal_mode=DELETE")      # write, even a -wal / -shm beside it, would show
    con.close()
    before = {p.name: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    mod = load_script("bench/bf16_final.py")
    assert mod.main(["--db", str(db)]) == 0
    out = capsys.readouterr().out
    rows = {ln.split()[2]: ln.split() for ln in out.splitlines() if ln.startswith(res.run_id)}
    assert set(rows) == set(mod.KEYS)
    for k, r in rows.items():                       # the float32 column is the run's own final number
        assert r[3] == f"{100 * res.final[k]:.2f}", k
    assert "largest |bfloat16 - float32|" in out
    assert {p.name: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    assert mod.main(["--db", str(db), "nosuchrun"]) == 2


def test_cuda_graphs_bench_checks_the_bits_on_cpu(capsys):
    """The CPU smoke form of `bench/cuda_graphs.py`: both sides train, the bit check runs and passes."""
    mod = load_script("bench/cuda_graphs.py")
    assert mod.main(["--device", "cpu", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "same bits" in out and "MISMATCH" not in out and "ratio plain/graphs" in out
    assert "True" in out.split("same bits", 1)[1]


def test_pool_train_bench_keeps_the_bits(capsys):
    """`bench/pool_train.py --quick`: both exact pooling rewrites train to MaxPool2d's bits (exit 0)."""
    mod = load_script("bench/pool_train.py")
    assert mod.main(["--quick", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("same bits") == 4 and "DIFFERENT" not in out


def test_pool_train_variants_of_the_unchanged_model_get_graphs_of_their_own(capsys):
    """`--nchw` and `--aten-pool-bwd` compile the unchanged model under other compiler settings. Dynamo
    reuses a compiled step for a model of the same module types, so each such engine's poolings must be
    of a type of its own (and compute MaxPool2d's numbers); without compiling, they train to its bits."""
    import torch

    from fedprism.models import build_model

    mod = load_script("bench/pool_train.py")
    model = build_model("lenet5", (1, 32, 32), 10, seed=0)
    pools = lambda m: [type(x) for x in m.modules() if isinstance(x, torch.nn.MaxPool2d)]
    a, b = mod.own_graph(model), mod.own_graph(model)
    assert pools(model) and set(pools(model)) == {torch.nn.MaxPool2d}
    assert len({*pools(a), *pools(b), torch.nn.MaxPool2d}) == 3
    x = torch.randn(4, 1, 32, 32)
    assert torch.equal(a(x), model(x))
    assert mod.main(["--quick", "--rounds", "2", "--nchw", "--aten-pool-bwd"]) == 0
    out = capsys.readouterr().out
    assert out.count("same bits") == 8 and "aten-pool-bwd: median" in out


def test_client_threads_bench_groups_keep_the_bits(capsys):
    """`bench/client_threads.py --quick`: two engines in two threads, each training half of the cohort, give
    every client the bits of one engine training them all (each engine has its own copy of the model)."""
    mod = load_script("bench/client_threads.py")
    assert mod.main(["--quick", "--rounds", "2", "--eval-reps", "1"]) == 0
    out = capsys.readouterr().out
    assert "split vs one: max |dW| 0\n" in out and "train split:" in out and "eval  split:" in out
    assert "largest accuracy change against one 0.0000" in out.split("eval  split:")[1]


def test_pool_train_fused_first_block_is_lenet5s_first_block():
    """`bench/pool_train.py --fused-conv1`: the element-wise first block computes conv1 + ReLU + pooling and
    keeps the parameter names. With small integers as inputs and conv1 weights every sum is exact and most
    pooling windows hold ties, so the forward must be the same bits and every gradient after the block
    too (ties go to the same input); conv1's own gradients differ by the order of their sums only."""
    import torch

    from fedprism.models import build_model

    mod = load_script("bench/pool_train.py")
    model = build_model("lenet5", (1, 32, 32), 10, seed=0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        model.body[0].weight.copy_(torch.randint(-2, 3, model.body[0].weight.shape, generator=g))
        model.body[0].bias.copy_(torch.randint(-2, 3, (6,), generator=g))
    fused = mod.fuse_first_block(model)
    assert [k for k, _ in fused.named_parameters()] == [k for k, _ in model.named_parameters()]
    x = torch.randint(-1, 2, (16, 1, 32, 32), generator=g).float()
    a, b = model(x), fused(x)
    assert torch.equal(a, b)
    a.square().sum().backward()
    b.square().sum().backward()
    for (k, p), q in zip(model.named_parameters(), fused.parameters()):
        if k.startswith("body.0."):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-5, msg=k)
        else:
            assert torch.equal(q.grad, p.grad), k


def test_conv_scaling_bench_runs_both_formulations_on_cpu(capsys):
    """`bench/conv_scaling.py --quick` on the CPU: both convolution formulations train every size, and the
    unfold formulation lands within rounding of the grouped convolution (it is the same function)."""
    mod = load_script("bench/conv_scaling.py")
    assert mod.main(["--device", "cpu", "--quick"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == 4 and all(float(r[-1]) < 1e-4 for r in rows)        # max |dW| per round and size
    assert "grouped   4 models" in out and "unfold   4 models" in out


def test_host_cost_bench_times_the_bookkeeping(capsys):
    """`bench/host_cost.py --quick`: a round with the step replaced by a no-op runs and reports its time."""
    mod = load_script("bench/host_cost.py")
    assert mod.main(["--quick"]) == 0
    assert "host share of a training round (fedprism from" in capsys.readouterr().out


def test_eval_profile_bench_profiles_the_last_evaluation(capsys):
    """`bench/eval_profile.py --quick`: a short fedprism_dual run, every evaluation timed, the last one
    profiled by Python function and by operator; the evaluator is restored afterwards."""
    import fedprism.experiment.evaluate as evaluate

    before = evaluate.Evaluator.__call__
    mod = load_script("bench/eval_profile.py")
    assert mod.main(["--quick", "--rounds", "3", "--validation"]) == 0
    out = capsys.readouterr().out
    assert "evaluations: 3;" in out and "## by Python function" in out and "## by operator" in out
    assert "validation splits (global 200)" in out
    assert evaluate.Evaluator.__call__ is before


@pytest.mark.slow
def test_kernel_ab_loads_two_builds_side_by_side_and_compares_their_outputs(capsys):
    """`bench/kernel_ab.py`: HEAD's kernel source and the working tree's, each built with its operator
    namespace renamed, load into one process and are called in turn; every kernel gets a row with two
    timings and the two builds' largest output difference, which is at most float32 rounding (a change to
    the kernels that alters their results beyond that fails `tests/test_fused_kernels.py` too)."""
    if shutil.which("git") is None or not build.load("fused"):
        pytest.skip(f"needs git and the fused kernels ({build.unavailable_reason()})")
    source = build.LIBRARIES["fused"].source.read_bytes()
    mod = load_script("bench/kernel_ab.py")
    assert mod.main(["--batches", "2", "--reps", "1", "--models", "2", "--batch", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {ln[:16].strip(): ln[16:].split() for ln in lines if ln[:16].strip() in mod.KERNELS}
    assert set(rows) == set(mod.KERNELS)
    for name, cells in rows.items():
        assert len(cells) == 7 and all(float(c.rstrip("x")) > 0 for c in cells[:6]), (name, cells)
        assert float(cells[6]) < 1e-2, (name, cells)
    assert hasattr(torch.ops, "fedprism_kernels_base") and hasattr(torch.ops, "fedprism_kernels_new")
    assert build.LIBRARIES["fused"].source.read_bytes() == source   # fedprism's own kernel source as it was


def test_slots_bench_trains_both_rules_to_the_same_bits(capsys):
    """`bench/slots.py`, eager, on 20 clients of 64 samples: the capped rule takes 16 slots, the other two 10,
    and all three train the same models (exit 0)."""
    mod = load_script("bench/slots.py")
    assert mod.main(["--compile", "false", "--rounds", "2", "--epochs", "1", "--max-train", "64",
                     "--threads", "1"]) == 0
    out = capsys.readouterr().out
    for rule in ("capped     slots [16]", "slots_for  slots [10]", "least_time slots [10]"):
        assert rule in out, out
    assert "largest difference between the trained models: 0" in out, out
