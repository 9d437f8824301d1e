"""`eval.kernels = fused` / `train.kernels = fused`: a model's first conv -> ReLU -> 2x2 max-pooling as C++
kernels (`fedprism.kernels.fused`). Exact where the arithmetic is exact (integer-valued inputs: outputs,
pooling ties and gradients), within float32 rounding of PyTorch's layers otherwise, under every way the
engines call them (one model, vmap over models with a shared or an own input batch, compiled); only
qualifying layers are fused; each library builds on its own (tests/test_kernels.py: the build, its
remembered failures, and which kernels a run uses)."""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import vmap

from fedprism.cli import main
from fedprism.kernels import build, fused
from fedprism.engine.sequential import SequentialEngine
from fedprism.engine.vectorized import VectorizedEngine
from fedprism.models import build_model
from fedprism.params import Functional, ParamSpec, flatten

from test_engine_equivalence import CFG, make_fed

pytestmark = pytest.mark.skipif(not build.load("fused"),
                                reason=f"fused kernel unavailable: {build.unavailable_reason()}")


def plain(x, w, b):
    return F.max_pool2d(F.relu(F.conv2d(x, w, b)), 2)


def _ints(*shape, lo=-3, hi=4, seed=0):
    return torch.randint(lo, hi, shape, generator=torch.Generator().manual_seed(seed)).float()


@pytest.mark.parametrize("n,c,h,w,o,k", [(5, 1, 32, 32, 6, 5), (3, 3, 13, 11, 7, 3), (2, 2, 9, 9, 13, 4),
                                          (1, 1, 6, 6, 1, 1), (2, 1, 11, 45, 5, 3), (1, 1, 9, 36, 3, 5),
                                          (3, 6, 14, 14, 16, 5), (2, 5, 17, 19, 20, 3), (2, 4, 9, 30, 3, 2)])
def test_integer_inputs_give_pytorchs_numbers_exactly(n, c, h, w, o, k):
    """Small integers: every partial sum is exact in float32, so summation order cannot matter and the
    kernel must equal conv2d -> relu -> max_pool2d bit for bit: odd sizes (floor pooling), filter counts
    that are not a multiple of the kernel's blocks (six by position, 16 by filter), pooled rows that are
    not a multiple of 16 (or wider than 16: a two-vector grid row) nor of the seven windows of the
    filter-vectorized layout (which blocks with more than three input channels take)."""
    x, wt, b = _ints(n, c, h, w), _ints(o, c, k, k, seed=1), _ints(o, seed=2)
    assert torch.equal(fused.conv_relu_pool(x, wt, b), plain(x, wt, b))


def test_vmap_shared_and_own_inputs_match_a_loop_over_models():
    x, xs = _ints(4, 1, 12, 12), _ints(3, 4, 1, 12, 12, seed=5)
    W, B = _ints(3, 5, 1, 3, 3, seed=3), _ints(3, 5, seed=4)
    shared = vmap(fused.conv_relu_pool, in_dims=(None, 0, 0))(x, W, B)
    own = vmap(fused.conv_relu_pool)(xs, W, B)
    one_filter = vmap(fused.conv_relu_pool, in_dims=(0, None, None))(xs, W[0], B[0])
    for m in range(3):
        assert torch.equal(shared[m], plain(x, W[m], B[m]))
        assert torch.equal(own[m], plain(xs[m], W[m], B[m]))
        assert torch.equal(one_filter[m], plain(xs[m], W[0], B[0]))


def test_an_inner_block_reads_the_first_blocks_output_in_place_under_vmap():
    """LeNet-5's two blocks under vmap over models on a shared batch: the second block's input is a
    strided view of the first's stacked output (the models' dimension inside), read without a copy."""
    x = _ints(4, 1, 32, 32)
    W1, B1 = _ints(3, 6, 1, 5, 5, seed=1), _ints(3, 6, seed=2)
    W2, B2 = _ints(3, 16, 6, 5, 5, seed=3, lo=-1, hi=2), _ints(3, 16, seed=4)

    def two(x, w1, b1, w2, b2):
        return fused.conv_relu_pool(fused.conv_relu_pool(x, w1, b1), w2, b2)

    out = vmap(two, in_dims=(None, 0, 0, 0, 0))(x, W1, B1, W2, B2)
    for m in range(3):
        assert torch.equal(out[m], plain(plain(x, W1[m], B1[m]), W2[m], B2[m]))
    h = torch.ops.fedprism_kernels.stem_forward(x[None], W1.reshape(1, 18, 25), B1.reshape(1, 18), 5)
    view = h.unflatten(2, (3, 6)).movedim(2, 0).flatten(0, 1)           # [3 models, 4, 6, 14, 14]
    assert not view.is_contiguous()
    got = torch.ops.fedprism_kernels.stem_forward(view, W2.reshape(3, 16, -1), B2, 5)
    assert torch.equal(got, torch.ops.fedprism_kernels.stem_forward(view.contiguous(), W2.reshape(3, 16, -1),
                                                                       B2, 5))


def test_float_inputs_stay_within_rounding():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(20, 3, 32, 32, generator=g), torch.randn(6, 3, 5, 5, generator=g)
    b = torch.randn(6, generator=g)
    d = (fused.conv_relu_pool(x, w, b) - plain(x, w, b)).abs().max().item()
    assert d < 1e-5 * plain(x, w, b).abs().max().item()


def test_only_qualifying_first_blocks_are_fused_and_names_stay():
    lenet = build_model("lenet5", (1, 32, 32), 10, seed=0)
    done = fused.fuse_stems(lenet)
    kinds = [type(m).__name__ for m in done.body]
    assert kinds[:6] == ["FusedConvReLUPool", "Identity", "Identity"] * 2    # both of LeNet-5's blocks
    assert ParamSpec.of(done) == ParamSpec.of(lenet)          # a flat vector maps the same way
    assert type(lenet.body[0]) is nn.Conv2d                     # the original is untouched
    assert fused.fuse_stems(build_model("mlp", (1, 8, 8), 10, seed=0)) is None
    refused = [nn.Conv2d(1, 4, 3, padding=1), nn.Conv2d(1, 4, 3, stride=2), nn.Conv2d(1, 4, 3, bias=False),
               nn.Conv2d(4, 4, 3, groups=2), nn.Conv2d(1, 4, 3, dilation=2), nn.Conv2d(1, 4, (3, 2))]
    for conv in refused:
        assert fused.fuse_stems(nn.Sequential(conv, nn.ReLU(), nn.MaxPool2d(2))) is None, conv
    assert fused.fuse_stems(nn.Sequential(nn.Conv2d(1, 4, 3), nn.MaxPool2d(2), nn.ReLU())) is None
    assert fused.fuse_stems(nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.MaxPool2d(3))) is None


def _models(model, n=6):
    g = torch.Generator().manual_seed(1)
    w = flatten(model)
    return w.expand(n, -1) + 0.05 * torch.randn(n, w.numel(), generator=g)


@pytest.mark.parametrize("channels", [1, 3])
def test_engines_score_within_rounding_of_pytorchs_kernels(channels):
    shape = (channels, 32, 32)
    fed = make_fed(shape)
    model = build_model("lenet5", shape, 10, seed=0)
    W, clients = _models(model), np.arange(6)
    cfg = dataclasses.replace(CFG, eval_kernels="fused")
    pairs = [(SequentialEngine(fed, model, CFG, 3), SequentialEngine(fed, model, cfg, 3)),
             (VectorizedEngine(fed, model, CFG, 3, compile=False),
              VectorizedEngine(fed, model, cfg, 3, compile=False))]
    for aten, fast in pairs:
        assert type(fast.f.inference_module.body[0]) is fused.FusedConvReLUPool
        la, lf = aten.logits(W, fed.x_test[:40]), fast.logits(W, fed.x_test[:40])
        assert 0 < (la - lf).abs().max().item() < 1e-4            # really the kernel, and close
        for split in ("local", "global"):
            a, f = aten.evaluate(W, clients, split), fast.evaluate(W, clients, split)
            assert torch.equal(a.count, f.count)
            assert (a.correct - f.correct).abs().max() <= 1, split
            torch.testing.assert_close(a.loss_sum, f.loss_sum, rtol=1e-4, atol=1e-4)


def test_compiled_evaluation_uses_the_kernel_and_training_does_not():
    fed = make_fed((1, 32, 32))
    model = build_model("lenet5", (1, 32, 32), 10, seed=0)
    cfg = dataclasses.replace(CFG, eval_kernels="fused")
    aten = VectorizedEngine(fed, model, CFG, 3, compile=True, eval_samples=40)
    fast = VectorizedEngine(fed, model, cfg, 3, compile=True, eval_samples=40)
    W = _models(model, 4)
    a, f = aten.logits(W, fed.x_test[:40]), fast.logits(W, fed.x_test[:40])
    assert 0 < (a - f).abs().max().item() < 1e-4
    from fedprism.algorithms.base import TrainJob
    job = TrainJob(np.array([0, 1, 2]), W[:3].clone())
    assert torch.equal(aten.train(job, 0).params, fast.train(job, 0).params)   # training: PyTorch's kernels


def test_an_unknown_compiler_target_is_named_in_the_reason(monkeypatch, tmp_path):
    """`$FEDPRISM_KERNEL_MARCH` that the compiler refuses: not built, the reason names the variable and its
    value, and the failure is remembered under that target's key (a configuration's `fused` then resolves
    to aten with that reason: tests/test_kernels.py)."""
    monkeypatch.setenv("FEDPRISM_KERNEL_MARCH", "no-such-cpu")
    monkeypatch.setenv("FEDPRISM_CACHE", str(tmp_path))
    monkeypatch.setattr(build, "_state", {})
    monkeypatch.setattr(build, "_loaded", {})
    assert build.load("fused") is False
    why = build.unavailable_reason("fused")
    assert "-march=no-such-cpu from $FEDPRISM_KERNEL_MARCH" in why, why
    assert not any((tmp_path / "kernels").glob("*.so"))
    assert "no-such-cpu" in build.failure_path(build.LIBRARIES["fused"]).read_text()


@pytest.mark.slow
def test_a_fresh_cache_builds_the_kernel_once(tmp_path):
    """A cache without the libraries: a fresh process compiles each (atomically, into the cache), saying so
    on stderr (it takes tens of seconds), and the next process reuses the files silently."""
    import subprocess
    import sys
    code = "from fedprism.kernels import build; print(all(build.load(n) for n in build.LIBRARIES))"
    env = {**os.environ, "FEDPRISM_CACHE": str(tmp_path)}

    def fresh_process():
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, env=env)
        assert r.stdout.split() == ["True"], r.stderr[-2000:]
        return r.stderr

    err = fresh_process()
    for name in build.LIBRARIES:
        assert f"compiling the {name} CPU kernels for this machine into {tmp_path / 'kernels'}" in err
    built = sorted(p.name for p in (tmp_path / "kernels").glob("*.so"))
    assert sorted(lib.source.stem for lib in build.LIBRARIES.values()) == [n.rsplit("_", 1)[0] for n in built]
    mtime = [os.path.getmtime(tmp_path / "kernels" / n) for n in built]
    assert "compiling" not in fresh_process()
    assert [os.path.getmtime(tmp_path / "kernels" / n) for n in built] == mtime


def test_a_damaged_cached_library_is_rebuilt(tmp_path):
    """A truncated or foreign file where the cached build should be: rebuilt once and loaded (in a fresh
    process: a library loads once per process). The build copies this machine's cached library (the
    compiler itself is exercised by the fresh-cache test above), so the test costs no compilation."""
    import subprocess
    import sys
    assert build.load("fused"), build.unavailable_reason()
    good = str(build._loaded["fused"])
    code = ("import shutil; from fedprism.kernels import build; lib = build.LIBRARIES['fused']; "
            "p = build.library_path(lib); p.parent.mkdir(parents=True); p.write_bytes(b'not a shared library'); "
            f"calls = []; good = {good!r}; "
            "build._compile = lambda cxx, out, source: (calls.append(out), shutil.copyfile(good, out)); "
            "ok = build.load('fused'); same = p.read_bytes() == open(good, 'rb').read(); "
            "print(ok, build.unavailable_reason('fused'), len(calls), same)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "FEDPRISM_CACHE": str(tmp_path)})
    assert out.stdout.split() == ["True", "None", "1", "True"], out.stderr[-2000:]


def _has_avx2() -> bool:
    try:
        return " avx2 " in Path("/proc/cpuinfo").read_text().split("\nflags", 1)[1].split("\n", 1)[0] + " "
    except (OSError, IndexError):
        return False


@pytest.mark.slow
@pytest.mark.skipif(not _has_avx2(), reason="the portable builds target x86-64-v3 (AVX2) and below")
@pytest.mark.parametrize("target, widest", [("x86-64-v3", "%ymm"), ("x86-64", "%xmm")])
def test_the_build_for_cpus_without_avx512_passes_the_exactness_tests(tmp_path, target, widest):
    """The kernels' branches for CPUs without AVX-512 (AVX2's masked loads and stores; without AVX2, scalar
    loops) are compiled only for such a target. Built for it
    (`FEDPRISM_KERNEL_MARCH`) in a fresh cache, in a
    child process (a process loads one build), this file's other tests pass with it, and that build's widest
    register is the target's."""
    import shutil
    import subprocess
    import sys
    env = {**os.environ, "FEDPRISM_KERNEL_MARCH": target, "FEDPRISM_CACHE": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                        "-m", "not slow", "-k", "not fresh_cache and not damaged", __file__],
                       capture_output=True, text=True, timeout=1200, env=env, cwd=Path(__file__).parent)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and " skipped" not in r.stdout.splitlines()[-1], r.stdout[-500:]
    libs = sorted((tmp_path / "kernels").glob("*.so"))
    assert [p.name.split("_")[0] for p in libs] == ["fused"]
    if shutil.which("objdump"):
        for lib in libs:
            code = subprocess.run(["objdump", "-d", str(lib)], capture_output=True, text=True,
                                  check=True).stdout
            wider = {"%xmm": ("%ymm", "%zmm"), "%ymm": ("%zmm",)}[widest]
            assert widest in code and not any(w in code for w in wider), lib.name


@pytest.mark.slow
def test_the_other_forward_layout_gives_the_same_bits(tmp_path):
    """A block's forward has two layouts of the same sums: by position (a first block, on AVX-512) and by
    filter (an inner block, and every block on AVX2). A build takes one of them for a first block, so the
    other is compiled here with the threshold swapped, under its own operator namespace beside the default
    build: on float inputs (where any other order of the sums would show) both give the same outputs and
    winning corners, bit for bit, for first and inner blocks, one group and several."""
    ops = torch.ops.fedprism_kernels
    src = build.LIBRARIES["fused"].source.read_text()
    by_pos, by_filter = ("constexpr int64_t MAX_POSITION_CHANNELS = 3;",
                         "constexpr int64_t MAX_POSITION_CHANNELS = 0;")
    assert src.count(by_pos) == 1 and src.count(by_filter) == 1
    swapped = src.replace(by_pos, "@").replace(by_filter, by_pos).replace("@", by_filter)
    (tmp_path / "swapped.cpp").write_text(swapped.replace("fedprism_kernels", "fedprism_kernels_swapped"))
    build._compile(build.compiler(), tmp_path / "swapped.so", tmp_path / "swapped.cpp")
    torch.ops.load_library(str(tmp_path / "swapped.so"))
    other = torch.ops.fedprism_kernels_swapped
    g = torch.Generator().manual_seed(0)
    for G, N, C, H, W, O, k in [(1, 20, 1, 32, 32, 60, 5), (3, 4, 1, 32, 32, 6, 5), (2, 3, 3, 13, 11, 7, 3),
                                (2, 2, 2, 9, 30, 13, 4), (2, 3, 6, 14, 14, 16, 5), (1, 2, 1, 11, 45, 5, 3)]:
        x = torch.randn(G, N, C, H, W, generator=g)
        w, b = torch.randn(G, O, C * k * k, generator=g) * .3, torch.randn(G, O, generator=g) * .1
        shape = (G, N, C, H, W, O, k)
        assert torch.equal(ops.stem_forward(x, w, b, k), other.stem_forward(x, w, b, k)), shape
        (out, arg), (out2, arg2) = ops.stem_train_forward(x, w, b, k), other.stem_train_forward(x, w, b, k)
        assert torch.equal(out, out2) and torch.equal(arg, arg2), shape
        assert (arg < 4).any() and (arg == 255).any()


def test_the_builds_vector_width_follows_its_target():
    """16 floats with AVX-512, 8 otherwise (the slow test below builds for x86-64-v3 on any CPU): the
    blocking for one width spills the other's registers (2-4x slower than PyTorch's layers on an AVX2 CPU,
    bench/README.md)."""
    avx512 = "avx512f" in build._cpu_flags().split()
    expected = {"native": 16 if avx512 else 8, "x86-64-v3": 8, "x86-64": 8}.get(build.march())
    if expected is None:
        pytest.skip(f"no expected width for -march={build.march()}")
    assert fused.vector_floats() == expected


def test_eval_kernels_setting_end_to_end_and_refused_values(tmp_path, capsys):
    common = ["run", "--db", str(tmp_path / "s.db"), "dataset=digits", "method=fedavg", "clients=6",
              "rounds=2", "fraction=0.5", "local_epochs=1", "model=mlp", "engine=sequential", "--quiet"]
    assert main(common) == 0
    assert main(common + ["eval.kernels=aten"]) == 0                 # the default: the same run, reused
    from fedprism.experiment.store import Store
    assert len(Store(tmp_path / "s.db").runs()) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")                                # an MLP has nothing to fuse: no warning
        assert main(common + ["eval.kernels=fused"]) == 0
    runs = Store(tmp_path / "s.db").runs()
    assert len(runs) == 2 and all(r["status"] == "finished" for r in runs)
    capsys.readouterr()
    assert main(["run", "--db", str(tmp_path / "x.db"), "eval.kernels=mkl"]) == 2
    err = capsys.readouterr().err
    assert "eval.kernels" in err and "auto, aten, fused" in err and not (tmp_path / "x.db").exists()
    capsys.readouterr()
    assert main(["run", "--db", str(tmp_path / "x.db"), "eval.kernels=winograd"]) == 2   # measured, removed
    assert "one of auto, aten, fused" in capsys.readouterr().err and not (tmp_path / "x.db").exists()


def test_no_kernel_reads_past_the_end_of_its_storage():
    """An input whose storage ends at a page that may not be read (mprotect): the evaluation kernel reads
    whole vectors of rows but nothing past the storage's end (without the bound the process dies of
    SIGSEGV), in a child process."""
    import subprocess
    import sys
    code = """if True:
        import ctypes, mmap, sys, torch
        from fedprism.kernels import build
        assert build.load("fused")
        ops, page = torch.ops.fedprism_kernels, mmap.PAGESIZE
        shape, k = (1, 2, 6, 14, 14), 5
        n = 2 * 6 * 14 * 14
        pages = (4 * n + page - 1) // page
        buf = mmap.mmap(-1, (pages + 1) * page)
        base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.mprotect(ctypes.c_void_p(base + pages * page), page, 0) == 0      # PROT_NONE
        whole = torch.frombuffer(buf, dtype=torch.float32, count=pages * page // 4)
        x = whole[whole.numel() - n:].view(shape)
        x.copy_(torch.rand(shape))
        w, b = torch.randn(1, 16, 150) * .2, torch.randn(1, 16)
        torch.testing.assert_close(ops.stem_forward(x, w, b, k), ops.stem_forward(x.clone(), w, b, k),
                                   rtol=0, atol=0)
        print("read nothing past the end")
    """
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "read nothing past the end" in r.stdout, (r.returncode, r.stderr[-2000:])


# -- training ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("G,N,C,H,O,k", [(3, 5, 1, 12, 6, 5), (2, 4, 3, 13, 7, 3), (1, 3, 2, 9, 13, 4),
                                          (2, 2, 1, 40, 4, 5), (1, 2, 6, 14, 16, 5)])
def test_training_kernels_give_pytorchs_outputs_ties_and_gradients_exactly(G, N, C, H, O, k):
    """Integer inputs: many exact ties in the pooling windows (and at zero), which must go where
    max_pool2d after ReLU sends them; every gradient sum is exact."""
    ops = torch.ops.fedprism_kernels
    x, w, b = _ints(G, N, C, H, H), _ints(G, O, C, k, k, seed=1), _ints(G, O, seed=2)
    out, arg = ops.stem_train_forward(x, w.reshape(G, O, -1), b, k)
    go = _ints(*out.shape, seed=3)
    dw, db = ops.stem_backward(go, arg, x, k)
    for g in range(G):
        wg, bg = w[g].clone().requires_grad_(), b[g].clone().requires_grad_()
        ref = plain(x[g], wg, bg)
        (ref * go[g]).sum().backward()
        assert torch.equal(out[g], ref)
        assert torch.equal(dw[g], wg.grad.reshape(O, -1)) and torch.equal(db[g], bg.grad)


@pytest.mark.parametrize("G,N,C,H,O,k", [(2, 3, 6, 14, 16, 5), (1, 2, 5, 11, 20, 3), (2, 2, 4, 9, 3, 2),
                                          (1, 2, 4, 21, 5, 3), (1, 2, 2, 10, 4, 3)])
def test_an_inner_blocks_training_kernels_give_pytorchs_gradients_exactly(G, N, C, H, O, k):
    """More than three input channels (the filter-vectorized layout, LeNet-5's second block): the winning
    corners and the filters', biases' and input's gradients, bit for bit on integer inputs; 20 filters
    span two blocks of 16; k = 2 takes the kernel's generic path; a 21-wide input, two vectors per row; an
    inner block with two input channels takes the position-vectorized forward, the same backward."""
    ops = torch.ops.fedprism_kernels
    x, w, b = _ints(G, N, C, H, H, lo=0, hi=3), _ints(G, O, C, k, k, seed=1), _ints(G, O, seed=2)
    out, arg = ops.stem_train_forward(x, w.reshape(G, O, -1), b, k)
    go = _ints(*out.shape, seed=3)
    dw, db, dx = ops.block_backward(go, arg, x, w.reshape(G, O, -1), k)
    assert 0 < (arg == 255).float().mean() < 1 and (arg < 4).any()
    for g in range(G):
        xg, wg, bg = (t[g].clone().requires_grad_() for t in (x, w, b))
        ref = plain(xg, wg, bg)
        (ref * go[g]).sum().backward()
        assert torch.equal(out[g], ref.detach())
        assert torch.equal(dw[g], wg.grad.reshape(O, -1)) and torch.equal(db[g], bg.grad)
        assert torch.equal(dx[g], xg.grad)


@pytest.mark.parametrize("C,H,W,k", [(1, 12, 11, 3), (1, 32, 30, 5), (2, 9, 20, 3), (1, 7, 33, 3)])
def test_the_kernels_read_nothing_past_their_input(C, H, W, k):
    """The first block's polyphase split reads whole vectors of input rows. Lanes past a row's end are the
    next row's (computed and dropped), but past the last image's last row they would be memory beyond the
    tensor: masked off, so NaN there changes nothing. Otherwise the first block's filter gradients sum
    0 x NaN over the dropped lanes."""
    ops = torch.ops.fedprism_kernels
    G, N, O = 1, 2, 4
    x = _ints(G, N, C, H, W, lo=0, hi=3)
    buf = torch.full((x.numel() + 256,), float("nan"))
    buf[:x.numel()] = x.flatten()
    xv = buf[:x.numel()].view(x.shape)                      # contiguous: the kernels use it in place
    w, b = _ints(G, O, C * k * k, seed=1), _ints(G, O, seed=2)
    out, arg = ops.stem_train_forward(x, w, b, k)
    outv, argv = ops.stem_train_forward(xv, w, b, k)
    assert torch.equal(out, outv) and torch.equal(arg, argv)
    go = _ints(*out.shape, seed=3)
    for a, bb in zip(ops.stem_backward(go, arg, x, k), ops.stem_backward(go, arg, xv, k)):
        assert torch.equal(a, bb)

def _split(channels=1):
    model = build_model("lenet5", (channels, 32, 32), 10, seed=0)
    return model, fused.StemSplit(Functional(model))


def test_split_gradient_is_the_models_gradient():
    """The chain rule through the kernels gives the gradient autograd gives through PyTorch's layers, for
    cross-entropy and for FedProx's objective (whose proximal term also touches the fused filters)."""
    from fedprism.objectives import OBJECTIVES
    model, split = _split()
    assert split.names == ("body.0.weight", "body.0.bias", "body.3.weight", "body.3.bias")   # both blocks
    f = Functional(model)
    g = torch.Generator().manual_seed(0)
    flat = flatten(model) + 0.05 * torch.randn(flatten(model).numel(), generator=g)
    x, y, wt = torch.randn(8, 1, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g), torch.ones(8)
    extras = {"anchor": flatten(model), "mu": torch.tensor(0.3)}
    for name in ("ce", "prox"):
        obj = OBJECTIVES[name]
        g_ref, l_ref = torch.func.grad_and_value(lambda p: obj(f, p, x, y, wt, extras))(flat)
        g_fu, l_fu = split.grad_and_value(obj)(flat, x, y, wt, extras)
        torch.testing.assert_close(g_fu, g_ref, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(l_fu, l_ref)
    W = flat.expand(3, -1) + 0.01 * torch.randn(3, flat.numel(), generator=g)
    xs = torch.randn(3, 8, 1, 32, 32, generator=g)
    batched, _ = vmap(split.grad_and_value(OBJECTIVES["ce"]))(W, xs, y.expand(3, -1), wt.expand(3, -1), {})
    ce = split.grad_and_value(OBJECTIVES["ce"])
    shared, _ = vmap(ce, in_dims=(0, None, None, None, None))(W, x, y, wt, {})
    for m in range(3):
        one, _ = split.grad_and_value(OBJECTIVES["ce"])(W[m], xs[m], y, wt, {})
        torch.testing.assert_close(batched[m], one, rtol=0, atol=1e-7)
        one, _ = split.grad_and_value(OBJECTIVES["ce"])(W[m], x, y, wt, {})
        torch.testing.assert_close(shared[m], one, rtol=0, atol=1e-7)


def test_an_objective_on_another_input_or_other_parameters_is_refused():
    """The block output was computed from the batch and the parameters being differentiated; an objective
    that evaluates the model elsewhere (another input; APFL's mixed model at the same input) is refused."""
    model, split = _split()
    other_input = lambda f, p, x, y, wt, ex: F.cross_entropy(f(p, x + 1), y)             # noqa: E731
    other_params = lambda f, p, x, y, wt, ex: F.cross_entropy(f(0.5 * p, x), y)          # noqa: E731
    other_features = lambda f, p, x, y, wt, ex: f.features(p.detach(), x).sum()           # noqa: E731
    for objective in (other_input, other_params, other_features):
        with pytest.raises(RuntimeError, match="train.kernels=aten"):
            split.grad_and_value(objective)(flatten(model), torch.randn(4, 1, 32, 32),
                                            torch.zeros(4, dtype=torch.long), torch.ones(4), {})


def test_engines_train_with_the_fused_kernels_and_agree():
    from fedprism.algorithms.base import TrainJob
    fed = make_fed((1, 32, 32))
    model = build_model("lenet5", (1, 32, 32), 10, seed=0)
    cfg = dataclasses.replace(CFG, train_kernels="fused")
    seq, vec = SequentialEngine(fed, model, cfg, 3), VectorizedEngine(fed, model, cfg, 3, compile=False)
    assert seq.stem is not None and vec.stem is not None
    job = TrainJob(np.array([0, 2, 5]), _models(model, 3))
    a, b = seq.train(job, 1), vec.train(job, 1)
    torch.testing.assert_close(a.params, b.params, rtol=0, atol=1e-5)
    for plain_engine, run in ((SequentialEngine(fed, model, CFG, 3), a),
                              (VectorizedEngine(fed, model, CFG, 3, compile=False), b)):
        d = (plain_engine.train(job, 1).params - run.params).abs().max().item()
        assert 0 < d < 1e-3                               # really the kernels, and PyTorch's training
    for other in ("mlp", "lenet5_bn"):                     # nothing qualifies: PyTorch's training
        m = build_model(other, (1, 32, 32), 10, seed=0)
        assert SequentialEngine(fed, m, cfg, 3).stem is None


def test_compiled_training_with_the_fused_kernels_compiles_and_matches_eager():
    from fedprism.algorithms.base import TrainJob
    fed = make_fed((1, 32, 32))
    model = build_model("lenet5", (1, 32, 32), 10, seed=0)
    cfg = dataclasses.replace(CFG, train_kernels="fused")
    job = TrainJob(np.array([0, 1, 2]), _models(model, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)           # a compile failure would warn and fall back
        compiled = VectorizedEngine(fed, model, cfg, 3, compile=True).train(job, 0)
    eager = VectorizedEngine(fed, model, cfg, 3, compile=False).train(job, 0)
    torch.testing.assert_close(compiled.params, eager.params, rtol=0, atol=1e-5)


@pytest.mark.parametrize("value", ["fast", "winograd"])
def test_train_kernels_setting_refused_values(tmp_path, capsys, value):
    """An unknown value (and `winograd`, measured and removed) is refused before anything is written."""
    assert main(["run", "--db", str(tmp_path / "x.db"), f"train.kernels={value}"]) == 2
    err = capsys.readouterr().err
    assert "train.kernels" in err and "fused" in err and not (tmp_path / "x.db").exists()
    with pytest.raises(ValueError, match="train_kernels must be one of"):
        SequentialEngine(make_fed((1, 32, 32)), build_model("lenet5", (1, 32, 32), 10, seed=0),
                         dataclasses.replace(CFG, train_kernels=value), 3)


def test_a_fused_lenet_run_end_to_end_records_what_ran(monkeypatch, tmp_path):
    """A small Fashion-MNIST-format federation: the fused runs are their own run ids, finish, and their
    provenance says the fused blocks ran in training and in evaluation and which source and vector width;
    its accuracy is the aten run's to rounding."""
    from _fakedata import isolate, write_fake

    from fedprism.experiment.store import Store
    isolate(monkeypatch, tmp_path)
    write_fake("fmnist", tmp_path / "fm", n_train=200, n_test=50)
    db = str(tmp_path / "s.db")
    common = ["run", "--db", db, "dataset=fmnist", f"data.root={tmp_path / 'fm'}", "model=lenet5",
              "clients=4", "rounds=2", "fraction=0.5", "local_epochs=1", "method=fedavg", "engine=vectorized",
              "compile=false", "--quiet"]
    assert main(common) == 0
    assert main(common + ["train.kernels=fused", "eval.kernels=fused"]) == 0
    import json
    runs = {json.loads(r["config"]).get("eval.kernels", "aten"): r for r in Store(db).runs()}
    assert set(runs) == {"aten", "fused"}
    assert all(r["status"] == "finished" for r in runs.values())
    prov = {k: json.loads(r["provenance"]) for k, r in runs.items()}
    source = build.source_hash(build.LIBRARIES["fused"].source)
    built = {"train": True, "eval": True, "source": source, "vector_floats": fused.vector_floats()}
    assert prov["fused"]["execution"]["fused_kernels"] == built
    assert len(source) == 16
    assert "fused_kernels" not in prov["aten"]["execution"]
    fa, ff = (json.loads(runs[k]["final"]) for k in ("aten", "fused"))
    assert abs(fa["global_acc"] - ff["global_acc"]) <= 0.05
