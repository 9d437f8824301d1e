"""Datasets as self-describing components: the external plugin of docs/adding-a-dataset.md
(tests/plugins/blobs_dataset_plugin.py) through the CLI, sweeps, reports and Flower; what a DatasetSpec
declares is checked at registration and against what its loader returns; downloads and digests come
from the specs; and no module outside a dataset's own names a built-in dataset."""

from __future__ import annotations

import ast
import hashlib
import io
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import fedprism
from fedprism.data import download as dl
from fedprism.data import integrity
from fedprism.data.base import DATASETS, DatasetSpec, FileSet, builtin_specs, natural_datasets
from fedprism.data.datasets import load_dataset
from fedprism.errors import ConfigError, DataError
from fedprism.experiment.sweep import dump_sweep

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = Path(__file__).parent / "plugins" / "blobs_dataset_plugin.py"
sys.path.insert(0, str(PLUGIN.parent))
import blobs_dataset_plugin as blobs  # noqa: E402

SPEC = blobs.SPEC


@pytest.fixture
def registered():
    """`blobs` registered in this process for one test, forgotten afterwards."""
    fedprism.register_dataset("blobs", SPEC)
    yield SPEC
    DATASETS.pop("blobs")
    from fedprism.experiment.federation import clear_federations
    clear_federations()


def install_plugin(where: Path) -> dict:
    """An installed distribution that declares the plugin's spec as a `fedprism.datasets` entry point;
    returns the environment that puts it on the path."""
    dist = where / "blobs_dataset_plugin-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: blobs-dataset-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[fedprism.datasets]\nblobs = blobs_dataset_plugin:SPEC\n")
    (where / "blobs_dataset_plugin.py").write_text(PLUGIN.read_text())
    path = os.pathsep.join([str(where), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}


def cli(args: list[str], env: dict, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fedprism.cli", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


RUN = ["dataset=blobs", "partition=natural", "clients=3", "rounds=2", "local_epochs=1", "model=mlp"]


# ------------------------------------------------------------------------- the plugin, end to end


def test_dataset_plugin_runs_through_cli_sweep_and_report(tmp_path):
    env = install_plugin(tmp_path / "site")
    db = tmp_path / "p.db"
    r = cli(["run", "--db", str(db), "--json", "method=fedavg", *RUN], env)
    assert r.returncode == 0, r.stderr
    first = json.loads(r.stdout.strip().splitlines()[-1])
    assert 0 <= first["local_acc"] <= 1
    listed = cli(["datasets", "blobs"], env).stdout
    assert "3: left, centre, right" in listed and "by site (partition=natural" in listed
    assert "plugin, blobs_dataset_plugin" in listed and "seed" in listed
    overview = cli(["datasets"], env).stdout
    assert "blobs" in overview and "fmnist" in overview
    sweep = tmp_path / "s.toml"
    base = dict(item.split("=") for item in RUN)
    base.update(clients=3, rounds=2, local_epochs=1)
    sweep.write_text(dump_sweep("blobs_sweep", base, [dict(label="FedAvg", method="fedavg"),
                                                      dict(label="Local", method="local")]))
    r = cli(["sweep", str(sweep), "--db", str(db)], env)
    assert r.returncode == 0, r.stderr + r.stdout
    from fedprism.experiment.store import Store
    store = Store(db)
    rows = store.runs(sweep="blobs_sweep")
    store.close()
    assert sorted(x["method"] for x in rows) == ["fedavg", "local"]
    assert {json.loads(x["config"])["dataset"] for x in rows} == {"blobs"}
    fedavg = next(x for x in rows if x["method"] == "fedavg")
    assert json.loads(fedavg["final"])["local_acc"] == pytest.approx(first["local_acc"], abs=1e-12)  # the same run
    r = cli(["report", "--db", str(db), "--sweep", "blobs_sweep", "--out", str(tmp_path / "rep"), "--no-plots"], env)
    assert r.returncode == 0, r.stderr
    text = "\n".join(p.read_text() for p in (tmp_path / "rep").glob("*.md"))
    assert "blobs" in text and "FedAvg" in text and "Local" in text
    # without the plugin installed the dataset is an error naming the key and the known datasets
    r = cli(["run", "--db", str(tmp_path / "q.db"), "method=fedavg", *RUN],
            {**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert r.returncode == 2 and "'dataset' = 'blobs'" in r.stderr and "fmnist" in r.stderr


@pytest.mark.slow
def test_dataset_plugin_runs_on_the_flower_simulation(tmp_path):
    pytest.importorskip("flwr")
    env = install_plugin(tmp_path / "site")
    env.update({"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1", "RAY_USAGE_STATS_ENABLED": "0"})
    exp = " ".join(["method=fedavg", *RUN, "fraction=1.0", "engine=sequential"])
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


def test_the_documented_plugin_is_the_tested_one():
    """docs/adding-a-dataset.md shows the code that the plugin tests run, line for line."""
    doc = (ROOT / "docs" / "adding-a-dataset.md").read_text()
    block = doc.split("```python\n", 1)[1].split("```", 1)[0]
    code = PLUGIN.read_text()
    assert block.strip() == code[code.index('"""', 3) + 3:].strip()


# ------------------------------------------------------------------------ in process, from the spec


def test_a_registered_spec_is_used_everywhere_a_built_in_one_is(registered):
    assert "blobs" in DATASETS and not DATASETS.is_builtin("blobs")
    assert "blobs" in natural_datasets() and natural_datasets()[-1] == "wisdm"
    ds = load_dataset("blobs", seed=3)
    assert ds.input_shape == (4,) and ds.classes == list(blobs.CLASSES)
    assert np.array_equal(ds.x_train.numpy(), blobs.load(seed=3).x_train.numpy())   # options reach the loader
    with pytest.raises(ConfigError, match="dataset 'blobs' takes only seed"):
        load_dataset("blobs", test_fraction=0.5)
    with pytest.raises(ConfigError, match=r"'data.pad32' = True .*false for the blobs \(tabular\) dataset"):
        load_dataset("blobs", pad32=True)
    cfg = fedprism.config(method="fedavg", dataset="blobs", partition="natural", clients=3, rounds=1, model="mlp")
    from fedprism.experiment.federation import build_federation
    fed = build_federation(cfg)
    assert fed.num_clients == 3 and fed.class_names == list(blobs.CLASSES)
    with pytest.raises(ConfigError, match="only with dataset=synthetic .*dataset=blobs"):
        fedprism.config(method="fedavg", dataset="blobs", data__synthetic_devices=5)


def test_what_a_spec_declares_is_checked_against_what_its_loader_returns(registered):
    for changes, match in (({"class_names": (), "num_classes": 4}, "gives the 4 classes its spec declares"),
                           ({"input_shape": (5,)}, r"shape \(5,\) its spec declares; they are \(4,\)"),
                           ({"natural": "site", "load": lambda pad32=False, root=None, seed=0:
                             replace(blobs.load(), groups=None, test_groups=None)},
                            "gives each sample's site in groups and test_groups")):
        fedprism.register_dataset("blobs", replace(SPEC, **changes))
        with pytest.raises(ConfigError, match=match):
            load_dataset("blobs")
    fedprism.register_dataset("blobs", SPEC)
    load_dataset("blobs")


@pytest.mark.parametrize("changes, match", [
    ({"class_names": ("a", "b"), "num_classes": 3}, "2 class names for num_classes = 3"),
    ({"input_shape": (0,)}, "input_shape = \\(0,\\) is not valid"),
    ({"mean": (0.5,), "std": (0.5,)}, "mean and std are per-channel constants of images"),
    ({"pad32_auto": True}, "pad32_auto is for images"),
    ({"config_keys": (("data.synthetic_devices", "devices"),)}, "feeds option 'devices'"),
    ({"options": ("seed", "alpha")}, r"cannot be called as load\(pad32, root, seed, alpha\)"),
    ({"files": FileSet(find=lambda d: "none", needed="x")}, r"cannot be called as load\(pad32, root, download"),
])
def test_a_spec_that_contradicts_itself_is_refused_at_registration(changes, match):
    with pytest.raises((TypeError, ValueError), match=match):
        DATASETS.register(replace(SPEC, **changes))
    assert "blobs" not in DATASETS


def test_a_built_in_name_and_a_bare_loader():
    with pytest.raises(ValueError, match="'mnist' is a built-in dataset"):
        fedprism.register_dataset("mnist", SPEC)
    with pytest.raises(ValueError, match="built-in dataset of fedprism.data.sets.mnist"):
        DATASETS.register(replace(SPEC, name="mnist"))
    fedprism.register_dataset("bare", lambda pad32, root: blobs.load())
    try:
        spec = DATASETS.get("bare")
        assert isinstance(spec, DatasetSpec) and spec.num_classes is None and spec.module == __name__
        assert load_dataset("bare").num_classes == 3
    finally:
        DATASETS.pop("bare")


def test_a_plugin_s_files_are_downloaded_and_verified_from_its_spec(tmp_path, monkeypatch):
    """A spec that declares files is downloadable (`download` and `remote_files` read the spec) and its
    files are verified against the spec's own checksums at every load."""
    monkeypatch.setenv("FEDPRISM_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("FEDPRISM_DATA", raising=False)
    payload = b"0.5 1.5\n2.0 0.0\n"
    remote = dl.RemoteFile("pairs.txt", ("https://mirror.invalid/pairs.txt",),
                           sha256=hashlib.sha256(payload).hexdigest())

    def load(pad32=False, root=None, *, download=False, cache_dir=None):
        from fedprism.data.files import read_files
        files, where, checks, _ = read_files(DATASETS.get("pairs"), root, download, cache_dir)
        ds = blobs.load()
        ds.integrity = checks
        return ds

    files = FileSet(find=lambda d: {"data": d / "pairs.txt"} if (d / "pairs.txt").is_file() else "no pairs.txt",
                    needed="pairs.txt", remote=(remote,))
    fedprism.register_dataset("pairs", replace(SPEC, name="pairs", natural="", load=load, options=(), files=files))
    try:
        assert dl.remote_files()["pairs"] == (remote,) and "pairs" in dl.REMOTE
        with pytest.raises(DataError, match="fedprism data download pairs"):
            load_dataset("pairs")
        calls = []
        dest = dl.download("pairs", opener=lambda url, timeout: calls.append(url) or io.BytesIO(payload))
        assert calls == ["https://mirror.invalid/pairs.txt"] and (dest / "pairs.txt").read_bytes() == payload
        ds = load_dataset("pairs")
        assert list(ds.integrity.values()) == ["sha256 verified"]
        (dest / "pairs.txt").write_bytes(b"tampered")
        with pytest.raises(DataError, match="SHA-256 mismatch for dataset pairs"):
            load_dataset("pairs")
    finally:
        DATASETS.pop("pairs")
    assert "pairs" not in dl.remote_files()


def test_the_built_in_tables_are_read_from_the_specs():
    """The digests, downloads, normalisation and natural-client tables hold what the specs declare."""
    from fedprism.data import datasets
    specs = {s.name: s for s in builtin_specs()}
    assert set(dl.remote_files()) == {n for n, s in specs.items() if s.downloadable}
    assert datasets.NORMALIZATION == {n: (s.mean, s.std) for n, s in specs.items() if s.mean}
    assert datasets.NATURAL_CLIENTS == tuple(n for n, s in specs.items() if s.natural)
    assert {"synthetic", "wisdm", "femnist"} <= set(datasets.NATURAL_CLIENTS)
    known = integrity._known()
    for s in specs.values():
        for f in (s.files.remote if s.files else ()):
            if f.sha256:
                assert known[(s.name, f.filename)][0] == f.sha256
        for k in (s.files.known if s.files else ()):
            assert k.sha256 in known[(s.name, k.filename)]
    assert {n for n, s in specs.items() if s.pad32_auto} >= {"fmnist", "mnist", "femnist"}
    assert all(s.input_shape[1:] == (28, 28) for s in specs.values() if s.pad32_auto)
    for s in specs.values():                                     # what `fedprism datasets` shows is what loads
        assert s.num_classes == (len(s.class_names) if s.class_names else s.num_classes) and s.input_shape


#: string literals naming a built-in dataset that may stay outside its module: the `dataset` key's default
#: (the demo's recipes are data, experiment/demo.toml; the Flower server reads the datasets' specs)
ALLOWED = {("experiment/config.py", "digits")}


def test_no_module_but_its_own_names_a_built_in_dataset():
    names = set(DATASETS.names()) & {s.name for s in builtin_specs()}
    src = ROOT / "src" / "fedprism"
    found = set()
    for p in src.rglob("*.py"):
        if p.parent.name == "sets" and p.stem in names:
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
                found.add((p.relative_to(src).as_posix(), node.value))
    assert found <= ALLOWED, sorted(found - ALLOWED)
