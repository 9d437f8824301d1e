"""The optional CPU kernels as a part of the package (`fedprism.kernels`): each library builds on its own, a
failed build is remembered on disk under its key, `fedprism kernels build|status`, and which kernels a run
uses: `auto` and `fused` resolve to what can run here BEFORE the run id is computed, so a run that fell back
to PyTorch's kernels is never stored under the fused run's id, and every stored run keeps its id. Most of
these tests need no compiler (a stand-in compiler script); the ones that need the built kernels say so."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedprism import kernels
from fedprism.cli import main
from fedprism.errors import ConfigError
from fedprism.experiment.config import prefer_stored, resolve
from fedprism.experiment.store import Store
from fedprism.kernels import build

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "results" / "store.json"        # the committed store's dump (tests/_committed.py)

#: a stand-in C++ compiler: logs its call, fails on a source holding "#error", else writes a placeholder
FAKE_CXX = """#!/bin/sh
echo "$@" >> "$FAKE_CXX_CALLS"
src=""; out=""; prev=""
for a in "$@"; do
  case "$a" in *.cpp) src="$a";; esac
  [ "$prev" = "-o" ] && out="$a"
  prev="$a"
done
if grep -q '#error' "$src"; then echo "$src:1: error: broken on purpose" >&2; exit 1; fi
printf 'placeholder' > "$out"
"""


def kernels_here() -> bool:
    """Whether the real fused kernels load in this process (built for this machine)."""
    return build.load("fused")


@pytest.fixture
def fake(monkeypatch, tmp_path):
    """Two libraries, `good` and `bad` (its source does not compile), the stand-in compiler, an empty cache
    and no verdicts of this process; returns a function that counts the compiler's calls."""
    cxx = tmp_path / "fakecxx"
    cxx.write_text(FAKE_CXX)
    cxx.chmod(0o755)
    calls = tmp_path / "calls.txt"
    (tmp_path / "good.cpp").write_text("int good;\n")
    (tmp_path / "bad.cpp").write_text("#error this source does not compile\n")
    monkeypatch.setenv("CXX", str(cxx))
    monkeypatch.setenv("FAKE_CXX_CALLS", str(calls))
    monkeypatch.setenv("FEDPRISM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "LIBRARIES", {"good": build.Library("good", tmp_path / "good.cpp", ()),
                                             "bad": build.Library("bad", tmp_path / "bad.cpp", ())})
    monkeypatch.setattr(build, "_state", {})
    return lambda: len(calls.read_text().splitlines()) if calls.exists() else 0


def test_each_library_builds_on_its_own_and_a_failure_is_remembered(fake, tmp_path):
    good, bad = build.LIBRARIES["good"], build.LIBRARIES["bad"]
    with pytest.raises(build.KernelBuildError, match="broken on purpose"):
        build.build(bad)
    assert build.build(good).read_text() == "placeholder"        # the other library builds all the same
    assert fake() == 2
    marker = build.failure_path(bad)
    assert marker.parent == tmp_path / "cache" / "kernels" and "broken on purpose" in marker.read_text()
    assert not build.failure_path(good).exists() and not build.library_path(bad).exists()
    # remembered: a later attempt (every new process reads the marker on disk) does not compile again
    with pytest.raises(build.KernelBuildError, match="failed earlier .*broken on purpose"):
        build.build(bad)
    assert build.load("bad") is False and "failed earlier" in build.unavailable_reason("bad")
    build.build(good)                                            # cached: not compiled again either
    assert fake() == 2
    # a new key (here: a changed source) is tried afresh; `retry` (the CLI's build) tries again
    (tmp_path / "bad.cpp").write_text("#error still broken, another source\n")
    with pytest.raises(build.KernelBuildError, match="broken on purpose"):
        build.build(bad)
    assert fake() == 3
    (tmp_path / "bad.cpp").write_text("int fixed;\n")
    assert build.build(bad).exists() and fake() == 4
    (tmp_path / "bad.cpp").write_text("#error still broken, another source\n")   # the remembered key again
    with pytest.raises(build.KernelBuildError, match="failed earlier"):
        build.build(bad)
    with pytest.raises(build.KernelBuildError, match="broken on purpose"):
        build.build(bad, retry=True)
    assert fake() == 5


def test_processes_that_build_at_once_compile_once(fake, tmp_path):
    """Sweep workers starting together: one compiles (under the build's file lock), the other waits and
    takes its build instead of compiling again."""
    slow = tmp_path / "slowcxx"
    slow.write_text(FAKE_CXX.replace("printf 'placeholder'", "sleep 3; printf 'placeholder'"))
    slow.chmod(0o755)
    code = ("import sys, time; from pathlib import Path; from fedprism.kernels import build; "
            "lib = build.Library('good', Path(sys.argv[1]), ()); Path(sys.argv[2]).touch(); "
            "go = Path(sys.argv[3])\nwhile not go.exists(): time.sleep(0.01)\n"
            "print(build.build(lib).read_text())")
    env = {**os.environ, "CXX": str(slow), "PYTHONPATH": str(Path(build.__file__).parents[2])}   # this fedprism
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "good.cpp"), str(tmp_path / f"ready{i}"),
                               str(tmp_path / "go")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env) for i in range(2)]
    deadline = time.time() + 300
    while not all((tmp_path / f"ready{i}").exists() for i in range(2)) and time.time() < deadline:
        time.sleep(0.05)
    (tmp_path / "go").touch()
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-1000:] for o in outs]
    assert [o[0].strip() for o in outs] == ["placeholder"] * 2
    assert fake() == 1


def test_without_a_compiler_nothing_is_built_or_remembered(fake, monkeypatch):
    """No compiler is a cheap check, not a failed build: nothing is written, so installing one later
    is enough."""
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.raises(build.KernelBuildError, match="no C\\+\\+ compiler 'no-such-compiler'"):
        build.build(build.LIBRARIES["good"])
    assert not (Path(os.environ["FEDPRISM_CACHE"]) / "kernels").exists()


def test_kernels_build_and_status_commands(fake, tmp_path, capsys):
    assert main(["kernels", "status"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [ln.split(":")[0] for ln in out] == ["good", "bad"]
    assert "good: not built;" in out[0] and "bad: not built;" in out[1]
    assert main(["kernels", "build"]) == 1                        # one failed: exit status 1
    cap = capsys.readouterr()
    assert f"good: built {build.library_path(build.LIBRARIES['good'])}" in cap.out
    assert "bad: not built:" in cap.err and "broken on purpose" in cap.err
    assert fake() == 2
    assert main(["kernels", "status"]) == 0
    out = capsys.readouterr().out
    assert "good: built;" in out and "bad: failed (" in out and "broken on purpose" in out
    assert main(["kernels", "build", "good"]) == 0 and fake() == 2          # cached: nothing compiled
    assert main(["kernels", "build", "good", "--force"]) == 0 and fake() == 3
    assert main(["kernels", "build", "bad"]) == 1 and fake() == 4           # the CLI tries a failure again
    capsys.readouterr()
    assert main(["kernels", "build", "nosuch"]) == 2
    assert "library" in capsys.readouterr().err and fake() == 4


def test_auto_resolves_to_aten_with_one_note_where_nothing_is_built(fake, monkeypatch, capsys):
    monkeypatch.delenv(kernels.PIN, raising=False)
    monkeypatch.setattr(build, "LIBRARIES", {"fused": build.LIBRARIES["good"]})
    monkeypatch.setattr(kernels, "_said", set())
    assert kernels.resolve("train.kernels", "auto", "cpu") == "aten"
    assert kernels.resolve("eval.kernels", "auto", "cpu") == "aten"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "auto runs PyTorch's (aten)" in err and "fedprism kernels build" in err
    assert fake() == 0                                   # auto never compiles (the set-up does)
    assert kernels.resolve("train.kernels", "aten", "cpu") == "aten"


@pytest.mark.skipif(not kernels_here(), reason=f"fused kernels unavailable: {build.unavailable_reason()}")
def test_auto_resolves_to_fused_where_built_and_to_aten_on_cuda_or_pinned(monkeypatch, recwarn):
    monkeypatch.delenv(kernels.PIN, raising=False)
    assert kernels.resolve("train.kernels", "auto", "cpu") == "fused"
    assert kernels.resolve("eval.kernels", "auto", "cpu") == "fused"
    assert kernels.resolve("eval.kernels", "auto", "cuda") == "aten" and not recwarn.list   # silently
    with pytest.warns(UserWarning, match="CUDA device.*stored as train.kernels=aten"):
        assert kernels.resolve("train.kernels", "fused", "cuda") == "aten"
    assert kernels.resolve("train.kernels", "fused", "cpu") == "fused"
    monkeypatch.setenv(kernels.PIN, "aten")
    assert kernels.resolve("train.kernels", "auto", "cpu") == "aten"
    assert kernels.resolve("train.kernels", "fused", "cpu") == "fused"     # the pin is auto's only
    monkeypatch.setenv(kernels.PIN, "fused")
    with pytest.raises(ConfigError, match="environment variable 'FEDPRISM_KERNELS' = 'fused' is not valid: aten"):
        kernels.resolve("train.kernels", "auto", "cpu")


LENET = {"dataset": "fmnist", "model": "lenet5", "clients": 4, "rounds": 2, "fraction": 0.5, "local_epochs": 1,
         "method": "fedavg"}


def test_aten_hashes_as_before_the_kernels_and_auto_never_reaches_the_identity(monkeypatch):
    monkeypatch.setenv(kernels.PIN, "aten")
    default, aten = resolve(LENET), resolve({**LENET, "train.kernels": "aten", "eval.kernels": "aten"})
    assert default["train.kernels"] == default["eval.kernels"] == "aten"
    assert default.auto == {"train.kernels", "eval.kernels"} and aten.auto == frozenset()
    assert default.run_id == aten.run_id
    assert not {"train.kernels", "eval.kernels"} & set(default.identity)      # as every run before them
    assert resolve({**LENET, "train.kernels": "auto", "eval.kernels": "auto"}).run_id == aten.run_id
    assert default.with_(rounds=3).auto == default.auto


@pytest.mark.skipif(not kernels_here(), reason=f"fused kernels unavailable: {build.unavailable_reason()}")
def test_auto_is_the_fused_run_where_built_and_keeps_auto_through_with(monkeypatch):
    monkeypatch.delenv(kernels.PIN, raising=False)
    auto = resolve(LENET)
    fused = resolve({**LENET, "train.kernels": "fused", "eval.kernels": "fused"})
    aten = resolve({**LENET, "train.kernels": "aten", "eval.kernels": "aten"})
    assert auto["train.kernels"] == auto["eval.kernels"] == "fused"
    assert auto.run_id == fused.run_id != aten.run_id
    assert auto.identity["train.kernels"] == "fused"
    assert aten.with_(rounds=3)["train.kernels"] == "aten"         # an explicit aten stays aten
    assert auto.with_(rounds=3).auto == auto.auto
    for method in ("apfl", "perfedavg", "pfedme"):               # objectives the training kernels refuse
        got = resolve({**LENET, "method": method})
        assert (got["train.kernels"], got["eval.kernels"]) == ("aten", "fused"), method
        assert resolve({**LENET, "method": method, "train.kernels": "fused"})["train.kernels"] == "fused"


@pytest.mark.skipif(not kernels_here(), reason=f"fused kernels unavailable: {build.unavailable_reason()}")
def test_auto_is_aten_for_a_model_with_nothing_to_fuse(monkeypatch):
    """An MLP (`ModelSpec.conv = False`, also as `model=auto` on data that is not 28px+ images) has no block
    the fused kernels run: auto resolves to aten and the run keeps the id it had before the kernels."""
    monkeypatch.delenv(kernels.PIN, raising=False)
    for cfg in ({**LENET, "model": "mlp"}, {**LENET, "dataset": "digits", "model": "auto"},
                {**LENET, "model": "mlp_fedsub"}):
        auto, aten = resolve(cfg), resolve({**cfg, "train.kernels": "aten", "eval.kernels": "aten"})
        assert (auto["train.kernels"], auto["eval.kernels"]) == ("aten", "aten"), cfg
        assert auto.run_id == aten.run_id, cfg
    assert resolve({**LENET, "model": "auto"})["train.kernels"] == "fused"     # fmnist: LeNet-5
    assert resolve({**LENET, "model": "mlp", "train.kernels": "fused"})["train.kernels"] == "fused"   # as asked


def test_a_stored_configuration_replays_with_the_kernels_it_ran_with(monkeypatch):
    """`resolve_stored` (verify, run --fresh RUN_ID): a configuration stored before the kernel keys existed
    holds neither key, and replays with PyTorch's kernels under its own id, wherever the kernels are built."""
    from fedprism.experiment.config import resolve_stored

    monkeypatch.delenv(kernels.PIN, raising=False)
    stored = dict(resolve({**LENET, "train.kernels": "aten", "eval.kernels": "aten"}).identity)
    assert "train.kernels" not in stored and "eval.kernels" not in stored
    again = resolve_stored(stored)
    assert (again["train.kernels"], again["eval.kernels"]) == ("aten", "aten")
    assert again.run_id == resolve({**LENET, "train.kernels": "aten", "eval.kernels": "aten"}).run_id
    assert resolve_stored({**stored, "train.kernels": "fused"})["train.kernels"] == "fused" or not kernels_here()


class _Held:
    """A store that holds the given run ids (what `prefer_stored` asks of a store)."""

    def __init__(self, *ids):
        self.ids = set(ids)

    def run(self, run_id):
        return {"run_id": run_id} if run_id in self.ids else None


@pytest.mark.skipif(not kernels_here(), reason=f"fused kernels unavailable: {build.unavailable_reason()}")
def test_auto_takes_a_stored_aten_run_and_never_changes_an_explicit_choice(monkeypatch):
    monkeypatch.delenv(kernels.PIN, raising=False)
    auto, explicit = resolve(LENET), resolve({**LENET, "train.kernels": "fused", "eval.kernels": "fused"})
    aten = resolve({**LENET, "train.kernels": "aten", "eval.kernels": "aten"})
    assert prefer_stored(auto, _Held()).run_id == auto.run_id               # nothing stored: the fast one
    assert prefer_stored(auto, _Held(aten.run_id)).run_id == aten.run_id    # the stored aten run
    got = prefer_stored(auto, _Held(aten.run_id))
    assert got["train.kernels"] == got["eval.kernels"] == "aten" and got.values == aten.values
    assert prefer_stored(auto, _Held(aten.run_id, auto.run_id)).run_id == auto.run_id   # its own first
    assert prefer_stored(explicit, _Held(aten.run_id)).run_id == explicit.run_id
    half = resolve({**LENET, "eval.kernels": "aten"})                        # train auto, eval explicit
    half_aten = resolve({**LENET, "train.kernels": "aten", "eval.kernels": "aten"})
    assert prefer_stored(half, _Held(half_aten.run_id)).run_id == half_aten.run_id


@pytest.mark.skipif(not COMMITTED.exists(), reason="no committed results dump")
def test_every_committed_run_is_found_from_its_stored_configuration(monkeypatch, tmp_path, committed_db):
    """`fedprism run` with a committed run's exact configuration finds it: resolved on this machine (with
    `auto` free to pick the fused kernels where they are built) and preferred against the store, every
    committed run's configuration gives its stored id; aten runs (the keys left out, or explicit where the
    method's objective refuses the fused kernels) and fused runs (the keys explicit) alike."""
    monkeypatch.delenv(kernels.PIN, raising=False)
    db = tmp_path / "committed.db"
    shutil.copy(committed_db, db)
    store = Store(db, readonly=True)
    rows = [(r["run_id"], json.loads(r["config"])) for r in store.runs()]
    # aten where the method's objective cannot take the fused kernels (APFL, MOON, ...: `fused_training`)
    assert {c.get("train.kernels") for _, c in rows} == {None, "fused", "aten"}
    missed, found = [], 0
    for run_id, config in rows:
        if config.get("train.kernels") == "fused" and not kernels_here():
            continue                        # asks for kernels this machine cannot run: an aten run here
        monkeypatch.setenv(kernels.PIN, "aten")
        before = resolve(config).run_id     # as it hashed before `auto` (aten wherever the keys are left out)
        monkeypatch.delenv(kernels.PIN)
        cfg = prefer_stored(resolve(config), store)
        if cfg.run_id != before:
            missed.append(run_id)
        found += cfg.run_id == run_id       # (a few PFPL runs predate a later parameter: stored apart)
    assert not missed, missed
    assert found >= len(rows) - 3 - (0 if kernels_here() else 78), (found, len(rows))


def _fake_fmnist(monkeypatch, tmp_path) -> list[str]:
    from _fakedata import isolate, write_fake

    isolate(monkeypatch, tmp_path)
    write_fake("fmnist", tmp_path / "fm", n_train=200, n_test=50)
    return ["dataset=fmnist", f"data.root={tmp_path / 'fm'}", "model=lenet5", "clients=4", "rounds=2",
            "fraction=0.5", "local_epochs=1", "method=fedavg", "engine=vectorized", "compile=false"]


@pytest.mark.skipif(not kernels_here(), reason=f"fused kernels unavailable: {build.unavailable_reason()}")
def test_a_run_that_fell_back_is_stored_apart_from_one_that_used_the_kernels(monkeypatch, tmp_path, capsys):
    """`fused` asked for on a machine without a compiler (CXX=no-such-compiler, an empty kernel cache, no
    library loaded yet: a fresh process's state): the run warns, runs PyTorch's kernels and is stored as the
    aten run it is, under the aten run's id; the same request where the kernels run is another run, with its
    own id and provenance."""
    keys = _fake_fmnist(monkeypatch, tmp_path)
    db = str(tmp_path / "s.db")
    ask = ["train.kernels=fused", "eval.kernels=fused"]
    with monkeypatch.context() as m:
        m.setenv("CXX", "no-such-compiler")
        m.setenv("FEDPRISM_CACHE", str(tmp_path / "empty-cache"))
        m.setattr(build, "_state", {})
        m.setattr(build, "_loaded", {})
        with pytest.warns(UserWarning, match="no C\\+\\+ compiler 'no-such-compiler'.*stored as train.kernels=aten"):
            assert main(["run", "--db", db, "--json", "--quiet", *keys, *ask]) == 0
        assert build._loaded == {} and not (tmp_path / "empty-cache" / "kernels").exists()
    fell_back = json.loads(capsys.readouterr().out)["run_id"]
    assert main(["run", "--db", db, "--json", "--quiet", *keys, *ask]) == 0      # here the kernels run
    used = json.loads(capsys.readouterr().out)["run_id"]
    assert used != fell_back
    assert main(["run", "--db", db, "--json", "--quiet", *keys, "train.kernels=aten", "eval.kernels=aten"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["run_id"] == fell_back                     # the fallback IS the aten run (found stored)
    runs = {r["run_id"]: r for r in Store(db).runs()}
    assert set(runs) == {fell_back, used} and all(r["status"] == "finished" for r in runs.values())
    cfg = {k: json.loads(runs[k]["config"])["train.kernels"] for k in runs}
    assert cfg == {fell_back: "aten", used: "fused"}
    prov = {k: json.loads(runs[k]["provenance"])["execution"] for k in runs}
    assert "fused_kernels" not in prov[fell_back] and prov[used]["fused_kernels"]["train"] is True


def test_an_engine_never_falls_back_on_its_own(monkeypatch, tmp_path):
    """An engine asked for the fused kernels where they cannot load refuses, naming why: only the
    configuration's resolution may choose PyTorch's kernels instead (the run id must say which ran)."""
    import dataclasses

    from fedprism.engine.sequential import SequentialEngine
    from fedprism.models import build_model

    from test_engine_equivalence import CFG, make_fed
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setenv("FEDPRISM_CACHE", str(tmp_path))
    monkeypatch.setattr(build, "_state", {})
    monkeypatch.setattr(build, "_loaded", {})
    fed, model = make_fed((1, 32, 32)), build_model("lenet5", (1, 32, 32), 10, seed=0)
    for key in ("train_kernels", "eval_kernels"):
        with pytest.raises(RuntimeError, match="unavailable .*no-such-compiler.*use aten"):
            SequentialEngine(fed, model, dataclasses.replace(CFG, **{key: "fused"}), 3)
    with pytest.raises(ValueError, match="train_kernels must be one of .*resolved by fedprism.kernels.resolve"):
        SequentialEngine(fed, model, dataclasses.replace(CFG, train_kernels="auto"), 3)


@pytest.mark.skipif(not kernels_here(), reason=f"fused kernels unavailable: {build.unavailable_reason()}")
def test_on_flower_auto_kernels_are_pytorchs(monkeypatch):
    """The Flower server cannot know which nodes have the kernels built, and a node asked for kernels it
    lacks refuses: there `auto` is `aten` (also where this machine has them), and `fused` is asked for."""
    from fedprism.flower.settings import parse_experiment

    monkeypatch.delenv(kernels.PIN, raising=False)
    text = "method=fedavg dataset=fmnist model=lenet5 clients=4 rounds=2"
    assert resolve({**LENET})["train.kernels"] == "fused"                     # in process: this machine's
    got = parse_experiment(text)
    assert (got["train.kernels"], got["eval.kernels"]) == ("aten", "aten")
    assert parse_experiment(text + " train.kernels=auto")["train.kernels"] == "aten"
    assert parse_experiment(text + " train.kernels=fused")["train.kernels"] == "fused"
