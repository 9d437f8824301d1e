"""Models and partitions as self-describing components: the external plugins of docs/adding-a-model.md
(tests/plugins/lenet300_model_plugin.py) and docs/adding-a-partition.md
(tests/plugins/quantity_skew_partition_plugin.py) through the CLI, sweeps, reports and Flower; what a
ModelSpec / PartitionSpec declares is what the run layer uses; methods, models and partitions import
only when named; and unknown names get a did-you-mean."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

import fedprism
from fedprism.data.partitions import PARTITIONS, PartitionSpec, make_partition
from fedprism.errors import ConfigError, PartitionError
from fedprism.experiment.config import resolve
from fedprism.experiment.sweep import dump_sweep
from fedprism.models import MODELS, ModelSpec, build_model

ROOT = Path(__file__).resolve().parents[1]
SRC = Path(fedprism.__file__).resolve().parents[1]           # the sources under test (a mutant copy too)
PLUGINS = Path(__file__).parent / "plugins"
MODEL_PLUGIN = PLUGINS / "lenet300_model_plugin.py"
PARTITION_PLUGIN = PLUGINS / "quantity_skew_partition_plugin.py"
sys.path.insert(0, str(PLUGINS))
import lenet300_model_plugin as lenet300  # noqa: E402
import quantity_skew_partition_plugin as quantity_skew  # noqa: E402


@pytest.fixture
def registered():
    """Both plugins registered in this process for one test, forgotten afterwards."""
    fedprism.register_model("lenet300", lenet300.SPEC)
    fedprism.register_partition("quantity_skew", quantity_skew.SPEC)
    yield
    MODELS.pop("lenet300")
    PARTITIONS.pop("quantity_skew")
    from fedprism.experiment.federation import clear_federations
    clear_federations()


def install_plugins(where: Path) -> dict:
    """An installed distribution that declares both specs as entry points (`fedprism.models`,
    `fedprism.partitions`); returns the environment that puts it on the path."""
    dist = where / "fedprism_examples-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: fedprism-examples\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[fedprism.models]\nlenet300 = lenet300_model_plugin:SPEC\n\n"
                                           "[fedprism.partitions]\n"
                                           "quantity_skew = quantity_skew_partition_plugin:SPEC\n")
    for plugin in (MODEL_PLUGIN, PARTITION_PLUGIN):
        (where / plugin.name).write_text(plugin.read_text())
    path = os.pathsep.join([str(where), str(SRC), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


def cli(args: list[str], env: dict, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fedprism.cli", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


RUN = ["dataset=digits", "model=lenet300", "partition=quantity_skew", "partition.beta=2.0", "clients=4",
       "rounds=2", "local_epochs=1"]


# ------------------------------------------------------------------------- the plugins, end to end


def test_model_and_partition_plugins_run_through_cli_sweep_and_report(tmp_path):
    env = install_plugins(tmp_path / "site")
    db = tmp_path / "p.db"
    r = cli(["run", "--db", str(db), "--json", "method=fedavg", *RUN], env)
    assert r.returncode == 0, r.stderr
    first = json.loads(r.stdout.strip().splitlines()[-1])
    assert 0 <= first["local_acc"] <= 1
    listed = cli(["models", "lenet300"], env).stdout
    assert "LeNet-300-100" in listed and "plugin, lenet300_model_plugin" in listed
    assert "266,610 on [1x28x28]" in listed and "(265,600 parameters)" in listed and "(1,010 parameters)" in listed
    listed = cli(["partitions", "quantity_skew"], env).stdout
    assert "partition.beta" in listed and "0.5" in listed and "partition.max_tries" in listed
    assert "plugin, quantity_skew_partition_plugin" in listed
    assert "lenet300" in cli(["models"], env).stdout and "quantity_skew" in cli(["partitions"], env).stdout
    sweep = tmp_path / "s.toml"
    base = dict(item.split("=") for item in RUN)
    base.update({"clients": 4, "rounds": 2, "local_epochs": 1, "partition.beta": 2.0})
    # FedPer shares the body and keeps the head: the plugin model's declared split is what it uses
    sweep.write_text(dump_sweep("plugin_components", base, [dict(label="FedAvg", method="fedavg"),
                                                             dict(label="FedPer", method="fedper")]))
    r = cli(["sweep", str(sweep), "--db", str(db)], env)
    assert r.returncode == 0, r.stderr + r.stdout
    from fedprism.experiment.store import Store
    store = Store(db)
    rows = store.runs(sweep="plugin_components")
    store.close()
    assert sorted(x["method"] for x in rows) == ["fedavg", "fedper"]
    configs = [json.loads(x["config"]) for x in rows]
    assert {(c["model"], c["partition"], c["partition.beta"]) for c in configs} == {("lenet300", "quantity_skew", 2.0)}
    fedavg = next(x for x in rows if x["method"] == "fedavg")
    assert json.loads(fedavg["final"])["local_acc"] == pytest.approx(first["local_acc"], abs=1e-12)  # the same run
    r = cli(["report", "--db", str(db), "--sweep", "plugin_components", "--out", str(tmp_path / "rep"),
             "--no-plots"], env)
    assert r.returncode == 0, r.stderr
    text = "\n".join(p.read_text() for p in (tmp_path / "rep").glob("*.md"))
    assert "FedAvg" in text and "FedPer" in text
    # without the plugins installed each name is an error naming its key and the known names
    bare = {**os.environ, "PYTHONPATH": str(SRC)}
    r = cli(["run", "--db", str(tmp_path / "q.db"), "method=fedavg", *RUN], bare)
    assert r.returncode == 2 and "'partition' = 'quantity_skew'" in r.stderr and "dirichlet" in r.stderr
    r = cli(["run", "--db", str(tmp_path / "q.db"), "method=fedavg", "dataset=digits", "model=lenet300"], bare)
    assert r.returncode == 2 and "'model' = 'lenet300'" in r.stderr and "lenet5" in r.stderr


@pytest.mark.slow
def test_model_and_partition_plugins_run_on_the_flower_simulation(tmp_path):
    pytest.importorskip("flwr")
    env = install_plugins(tmp_path / "site")
    env.update({"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1", "RAY_USAGE_STATS_ENABLED": "0"})
    exp = " ".join(["method=fedavg", *RUN[:-3], "clients=3", "rounds=2", "local_epochs=1", "fraction=1.0",
                    "engine=sequential"])
    db = tmp_path / "f.db"
    r = subprocess.run([sys.executable, "-m", "fedprism.flower", "simulate", "--db", str(db), "--experiment", exp],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    from fedprism.experiment.store import Store
    rows = Store(db).runs(method="fedavg")
    assert len(rows) == 1 and rows[0]["status"] == "finished"
    ref = cli(["run", "--db", str(tmp_path / "ref.db"), "--json", *exp.split()], env)
    assert ref.returncode == 0, ref.stderr
    want = json.loads(ref.stdout.strip().splitlines()[-1])
    assert json.loads(rows[0]["final"])["local_acc"] == pytest.approx(want["local_acc"], abs=1e-9)


@pytest.mark.parametrize("doc, plugin", [("adding-a-model.md", MODEL_PLUGIN),
                                         ("adding-a-partition.md", PARTITION_PLUGIN)])
def test_the_documented_plugins_are_the_tested_ones(doc, plugin):
    """The docs show the code that the plugin tests run, line for line."""
    block = (ROOT / "docs" / doc).read_text().split("```python\n", 1)[1].split("```", 1)[0]
    code = plugin.read_text()
    assert block.strip() == code[code.index('"""', 3) + 3:].strip()


# ------------------------------------------------------------------------------ models, in process


def test_a_registered_model_is_built_under_the_seed_and_checked_against_its_declaration(registered):
    assert "lenet300" in MODELS and not MODELS.is_builtin("lenet300")
    a, b = build_model("lenet300", (1, 8, 8), 10, seed=3), build_model("lenet300", (1, 8, 8), 10, seed=3)
    torch.manual_seed(3)
    direct = lenet300.build((1, 8, 8), 10)
    for x, y, z in zip(a.parameters(), b.parameters(), direct.parameters()):
        assert torch.equal(x, y) and torch.equal(x, z)
    assert not torch.equal(next(a.parameters()), next(build_model("lenet300", (1, 8, 8), 10, seed=4).parameters()))
    # the declared refusal is the error, naming the model and the reason, before anything is built
    with pytest.raises(ConfigError, match=r"'model' = 'lenet300' .*at most 3072 inputs .*\[3, 64, 64\]"):
        build_model("lenet300", (3, 64, 64), 10)


def test_padding_is_what_the_model_declares(registered):
    """data.pad32=auto pads a 28x28 dataset for a model that declares pad32, built in or not."""
    from fedprism.experiment.federation import _pad32

    def pads(model: str) -> bool:
        return _pad32(resolve({"dataset": "fmnist", "model": model}), "fmnist")

    assert {m: pads(m) for m in MODELS.names()} == {m: MODELS[m].pad32 for m in MODELS.names()}
    assert [m for m in MODELS.names() if MODELS[m].pad32] == ["clustpsi_cifar_cnn", "cnn", "lenet5", "lenet5_bn",
                                                                  "vgg11"]
    assert pads("auto") and not pads("lenet300")
    fedprism.register_model("lenet300", replace(lenet300.SPEC, pad32=True))
    assert pads("lenet300")
    assert not _pad32(resolve({"dataset": "digits", "model": "lenet300"}), "digits")   # 8x8 digits: never


def test_model_registration_refusals():
    with pytest.raises(ValueError, match="'lenet5' is a built-in model"):
        fedprism.register_model("lenet5", lenet300.SPEC)
    with pytest.raises(ValueError, match="built-in model of fedprism.models.cnn"):
        MODELS.register(replace(lenet300.SPEC, name="cnn"))
    with pytest.raises(TypeError, match=r"cannot be called as build\(input_shape, num_classes\)"):
        MODELS.register(ModelSpec("bad", lambda shape: None))
    with pytest.raises(TypeError, match="not callable"):
        MODELS.register(3, name="bad")
    assert "bad" not in MODELS
    fedprism.register_model("bare", lenet300.build)            # a bare builder becomes a spec
    try:
        spec = MODELS["bare"]
        assert isinstance(spec, ModelSpec) and spec.build is lenet300.build and not spec.pad32
        assert spec.__module__ == "lenet300_model_plugin"
    finally:
        MODELS.pop("bare")


def test_built_in_models_are_their_modules_and_keep_their_weights():
    """Each built-in model is the module of its name; the same seed gives the same first weights as the
    model classes themselves under that seed (construction order unchanged), and LeNet-5's count is the
    paper network's 61,706 parameters for 10 classes."""
    from fedprism.models.lenet5 import LeNet5

    for name in MODELS.names():
        spec = MODELS[name]
        assert spec.__module__ == f"fedprism.models.{name}" and MODELS.is_builtin(name)
        model = build_model(name, spec.shape, 10, seed=0, vocab_size=spec.vocab if spec.tokens else 0)
        assert isinstance(model.body, torch.nn.Module) and isinstance(model.head, torch.nn.Module)
        assert spec.why_not(spec.shape) is None
    torch.manual_seed(7)
    ref = LeNet5(1, 10)
    got = build_model("lenet5", (1, 32, 32), 10, seed=7)
    assert all(torch.equal(x, y) for x, y in zip(ref.parameters(), got.parameters()))
    assert sum(p.numel() for p in got.parameters()) == 61706


# -------------------------------------------------------------------------- partitions, in process


def test_the_registered_partition_is_the_papers_formula(registered):
    """Client sizes are floor(cumsum(q) n) cuts of q ~ Dir(beta 1_N) drawn from make_partition's train
    stream, recomputed here by hand; the labels are a shuffle of the whole data."""
    y = np.repeat(np.arange(5), 40)                             # 200 labels, 5 classes
    y_test = np.repeat(np.arange(5), 10)
    part = make_partition("quantity_skew", y, y_test, 4, seed=11, min_train=5, beta=1.0)
    rng = np.random.default_rng(np.random.SeedSequence(11).spawn(2)[0])
    redraws = 0
    while True:
        q = rng.dirichlet(np.ones(4))
        sizes = np.diff(np.concatenate([[0], np.floor(np.cumsum(q) * 200).astype(int)[:-1], [200]]))
        if sizes.min() >= 5:
            break
        redraws += 1
    assert part.n_train.tolist() == sizes.tolist() and part.meta["num_redraws"] == redraws
    order = rng.permutation(200)
    assert [t.tolist() for t in part.train] == [sorted(order[a:b].tolist()) for a, b in
                                                zip(np.r_[0, np.cumsum(sizes)[:-1]], np.cumsum(sizes))]
    assert part.meta["params"] == {"beta": 1.0, "max_tries": 100} and part.meta["partition"] == "quantity_skew"
    with pytest.raises(PartitionError, match="partition.min_train = 50 is not reachable with partition.beta"):
        make_partition("quantity_skew", y, y_test, 4, seed=11, min_train=50, beta=0.1)   # only 50 each would do


def test_a_registered_partition_resolves_and_builds_a_federation(registered):
    cfg = resolve({"dataset": "digits", "partition": "quantity_skew", "partition.beta": 3.0, "clients": 5})
    assert cfg["partition.beta"] == 3.0 and cfg["partition.max_tries"] == 100 and cfg["partition.min_train"] == 10
    assert cfg.run_id != resolve({"dataset": "digits", "partition": "quantity_skew", "clients": 5}).run_id
    from fedprism.experiment.federation import build_federation
    fed = build_federation(cfg)
    assert fed.num_clients == 5 and int(fed.n_train.sum()) == len(fed.y_train)   # every sample used
    with pytest.raises(ConfigError, match=r"partition.bta.*\(did you mean partition.beta\?\)"):
        resolve({"partition": "quantity_skew", "partition.bta": 1.0})
    with pytest.raises(ConfigError, match="'partition.beta' = 0.0 is not valid: a finite number > 0"):
        resolve({"partition": "quantity_skew", "partition.beta": 0})


def test_a_partition_declared_natural_needs_data_with_groups():
    """`natural=True` in the spec, not the name `natural`, is what makes the federation pass each sample's
    user or device and refuse data that records none."""
    fedprism.register_partition("by_user", replace(PARTITIONS["natural"], name="by_user"))
    try:
        from fedprism.experiment.federation import build_federation
        with pytest.raises(ConfigError, match="'by_user' gives each client the samples of one user or device"):
            build_federation(resolve({"dataset": "digits", "partition": "by_user", "clients": 3}))
    finally:
        PARTITIONS.pop("by_user")


def test_partition_registration_refusals():
    with pytest.raises(ValueError, match="'iid' is a built-in partition"):
        fedprism.register_partition("iid", quantity_skew.SPEC)
    with pytest.raises(ValueError, match="partition.min_train is a key of every partition"):
        PARTITIONS.register(replace(quantity_skew.SPEC, name="mine", params={"min_train": quantity_skew.SPEC.params["beta"]}))
    with pytest.raises(TypeError, match="each value a fedprism.hparams.Param"):
        PARTITIONS.register(replace(quantity_skew.SPEC, name="mine", params={"beta": 0.5}))
    with pytest.raises(TypeError, match=r"cannot be called as split\(y, num_classes"):
        PARTITIONS.register(PartitionSpec("mine", lambda y, rng: None))
    with pytest.raises(TypeError, match="not a fedprism.data.partitions.PartitionSpec"):
        PARTITIONS.register(lambda *a: None, name="mine")
    assert "mine" not in PARTITIONS
    spec = fedprism.register_partition("mine", quantity_skew.split, dict(quantity_skew.SPEC.params))
    try:
        assert PARTITIONS["mine"] is spec and spec.name == "mine" and spec.params.keys() == {"beta", "max_tries"}
    finally:
        PARTITIONS.pop("mine")


# ------------------------------------------------------------------------ one registry for all four


def test_method_registration_keeps_its_checks():
    """The dict-like `REGISTRY[name] = cls` goes through `register`'s checks: an Algorithm subclass, under
    its own name (the name configurations and stored runs use)."""
    from fedprism.algorithms import REGISTRY
    from fedprism.algorithms.fedavg import FedAvg

    mine = type("Mine", (FedAvg,), {"name": "mine_m"})
    with pytest.raises(ValueError, match="registered under its own name"):
        REGISTRY["other"] = mine
    with pytest.raises(TypeError, match="subclass of fedprism.Algorithm"):
        REGISTRY["other"] = object
    assert "other" not in REGISTRY and "mine_m" not in REGISTRY
    REGISTRY["mine_m"] = mine
    try:
        assert REGISTRY["mine_m"] is mine and "mine_m" in REGISTRY.names() and not REGISTRY.is_builtin("mine_m")
    finally:
        REGISTRY.pop("mine_m")


def test_unknown_names_get_a_did_you_mean():
    for raw, want in (({"method": "fedavgg"}, "(did you mean fedavg?)"), ({"model": "lenet55"}, "(did you mean lenet5?)"),
                      ({"partition": "dirichet"}, "(did you mean dirichlet?)")):
        with pytest.raises(ConfigError, match=want.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
            resolve(raw)
    with pytest.raises(PartitionError, match=r"one of .*natural.* \(did you mean pathological\?\)"):
        make_partition("pathologcal", np.zeros(4, int), np.zeros(2, int), 1, 0, min_train=1)
    with pytest.raises(ConfigError, match=r"'model' = 'mpl' .*\(did you mean mlp\?\)"):
        build_model("mpl", (4,), 2)


def test_every_built_in_module_registers_its_own_name():
    """Each registry lists its built-ins from module names without importing them; every listed module
    must register exactly that name (a module of shared code belongs in the registry's `skip`)."""
    from fedprism.algorithms import REGISTRY
    for registry in (REGISTRY, MODELS, PARTITIONS):      # built-ins only: another test's plugin may be registered
        found = {n: registry.get(n) for n in registry.names() if registry.is_builtin(n)}
        assert found and all(getattr(obj, "name", n) == n for n, obj in found.items())
    # a built-in forgotten in-process (a test's clean-up) comes back as its module registered it
    fedavg = REGISTRY["fedavg"]
    assert REGISTRY.pop("fedavg") is fedavg and REGISTRY["fedavg"] is fedavg and REGISTRY.find("nope") is None


def test_a_process_imports_only_the_components_it_names():
    """`fedprism.algorithms`, `fedprism.models` and `fedprism.data.partitions` import no component module;
    resolving a configuration and building its model import that method (and its base class's module),
    that model and that partition only."""
    code = """if True:
        import sys
        import fedprism.algorithms, fedprism.models, fedprism.data.partitions
        from fedprism.experiment.config import resolve
        from fedprism.models import build_model
        def mine(pkg, shared):
            return sorted(m.rsplit('.', 1)[1] for m in sys.modules if m.startswith(pkg + '.')
                          and m.rsplit('.', 1)[1] not in shared)
        before = [mine('fedprism.algorithms', ('base', 'aggregation', 'partial')),
                  mine('fedprism.models', ('base', 'dropout', 'pooling')),
                  mine('fedprism.data.partitions', ('base', 'splits', 'summary'))]
        cfg = resolve({'method': 'fedprox', 'partition': 'similarity', 'model': 'mlp_bn'})
        build_model(cfg['model'], (1, 8, 8), 10)
        import fedprism.data.partitions as p; p.PARTITIONS[cfg['partition']]
        after = [mine('fedprism.algorithms', ('base', 'aggregation', 'partial')),
                 mine('fedprism.models', ('base', 'dropout', 'pooling')),
                 mine('fedprism.data.partitions', ('base', 'splits', 'summary'))]
        print(repr((before, after)))
    """
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    before, after = ast.literal_eval(r.stdout.strip().splitlines()[-1])
    assert before == [[], [], []]
    assert after == [["fedavg", "fedprox"], ["mlp_bn"], ["similarity"]]
