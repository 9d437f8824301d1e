"""Property-based tests (hypothesis): hostile configurations, TOML files, sweep files and partition
parameters give a ConfigError / PartitionError (CLI: exit 2, one line), never a traceback; valid
configurations resolve."""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from fedprism.algorithms import REGISTRY
from fedprism.cli import _config, main
from fedprism.data.partition import PARTITIONS, make_partition
from fedprism.errors import ConfigError, PartitionError
from fedprism.experiment import sweep as sweep_mod
from fedprism.experiment.config import KEYS, PARTITION_COMMON, Config, resolve

#: deterministic in the test suite; FEDPRISM_FUZZ_EXAMPLES=4000 FEDPRISM_FUZZ_RANDOM=1 for a longer,
#: fresh search
FUZZ = settings(max_examples=int(os.environ.get("FEDPRISM_FUZZ_EXAMPLES", "400")), deadline=None,
                derandomize=not os.environ.get("FEDPRISM_FUZZ_RANDOM"), database=None,
                suppress_health_check=[HealthCheck.too_slow])

#: every known key with its Param: experiment, partition (all partitions), method parameters
ALL_PARAMS = {**KEYS, **{f"partition.{k}": p for part in PARTITIONS.values() for k, p in part.params.items()},
              **{f"partition.{k}": p for k, p in PARTITION_COMMON.items()},
              **{f"{m}.{k}": p for m, cls in REGISTRY.items() for k, p in cls.params.items()}}
NUMERIC = sorted(k for k, p in ALL_PARAMS.items()
                 if type(p.default) in (int, float) and p.choices is None and k != "method")

hostile_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=2**63, max_value=2**200),
    st.integers(max_value=-2**63), st.floats(allow_nan=True, allow_infinity=True), st.just(float("nan")),
    st.just(float("inf")), st.just(-float("inf")), st.text(max_size=30), st.binary(max_size=10),
    st.dates(), st.datetimes(), st.times(), st.just("\u202e\u0000\n"),
)
hostile = st.recursive(hostile_scalars, lambda inner: st.lists(inner, max_size=3)
                       | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=6)
unicode_keys = st.text(min_size=1, max_size=20).filter(lambda k: k not in ALL_PARAMS and k != "partition.name")


def resolves_or_config_error(raw: dict) -> Config | None:
    try:
        return resolve(raw)
    except ConfigError as e:
        msg = str(e)
        assert "\n" not in msg and msg.isprintable(), msg
        return None


@FUZZ
@given(key=st.sampled_from(sorted(ALL_PARAMS)), value=hostile)
def test_any_value_for_any_key_is_config_or_config_error(key, value):
    method = key.split(".")[0] if key.split(".")[0] in REGISTRY else "fedavg"
    raw = {"method": method, key: value}
    if key.startswith("partition."):
        part = next((n for n, spec in PARTITIONS.items() if key[10:] in spec.params), "dirichlet")
        raw["partition"] = part
    got = resolves_or_config_error(raw)
    if isinstance(value, float) and not math.isfinite(value):
        assert got is None, f"{key}={value} accepted"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 2**63:
        assert got is None, f"{key}={value} accepted"


@FUZZ
@given(key=st.sampled_from(NUMERIC), value=st.sampled_from([float("nan"), float("inf"), -float("inf"),
                                                            2**63, 2**64 + 1, -2**63, 10**30, 1e300]))
def test_non_finite_and_huge_numbers_are_refused_for_every_numeric_key(key, value):
    method = key.split(".")[0] if key.split(".")[0] in REGISTRY else "fedavg"
    raw = {"method": method, key: value}
    if key.startswith("partition."):
        raw["partition"] = next((n for n, spec in PARTITIONS.items() if key[10:] in spec.params), "dirichlet")
    if value == 1e300 and type(ALL_PARAMS[key].default) is float:
        assume(False)                     # a finite float: range checks decide
    assert resolves_or_config_error(raw) is None, f"{key}={value!r} accepted"


@FUZZ
@given(key=unicode_keys, value=hostile)
def test_unknown_keys_are_config_errors(key, value):
    assert resolves_or_config_error({key: value}) is None


@FUZZ
@given(raw=st.dictionaries(st.sampled_from(sorted(ALL_PARAMS) + ["partition", "method", "dataset", "zz"]),
                           hostile, max_size=6))
def test_random_mixtures_never_raise_anything_else(raw):
    resolves_or_config_error(raw)


def _valid_value(p):
    """Strategy of values the Param accepts on its own."""
    from fedprism.experiment.config import KEYS
    from fedprism.models import MODELS

    if p is KEYS["model"]:                  # a model name: the built-in ones (plugins add more at run time)
        return st.sampled_from(("auto", *MODELS))
    if p.choices is not None:
        return st.sampled_from(p.choices)
    d = p.default
    if isinstance(d, bool):
        return st.booleans()
    if isinstance(d, int):
        return st.integers(min_value=0, max_value=50)
    if isinstance(d, float):
        return st.floats(min_value=0.0, max_value=1.0)
    if isinstance(d, str):
        return st.text(max_size=10)
    return st.just(d)


@FUZZ
@given(data=st.data(), method=st.sampled_from(sorted(REGISTRY)), partition=st.sampled_from(sorted(PARTITIONS)))
def test_every_valid_configuration_resolves(data, method, partition):
    raw: dict = {"method": method, "partition": partition}
    names = [k for k in KEYS if k not in ("method", "partition", "dataset")]
    names += [f"partition.{k}" for k in {**PARTITION_COMMON, **PARTITIONS[partition].params}]
    names += [f"{method}.{k}" for k in REGISTRY[method].params]
    for key in data.draw(st.lists(st.sampled_from(names), unique=True, max_size=8)):
        p = ALL_PARAMS[key] if not key.startswith(method + ".") else REGISTRY[method].params[key[len(method) + 1:]]
        v = data.draw(_valid_value(p))
        try:
            p.validate(key, v)
        except ConfigError:
            continue                                  # not valid on its own
        raw[key] = v
    try:
        cfg = resolve(raw)
    except ConfigError as e:                          # only cross-parameter rules may still refuse it
        if e.key == "eval.clients":                   # more clients scored than the federation has
            assert raw["eval.clients"] > raw.get("clients", KEYS["clients"].default), e
        elif e.key == "data.unseen_clients":          # a fraction that holds out no client, or every one
            from fedprism.experiment.config import held_out_count
            n = raw.get("clients", KEYS["clients"].default)
            assert not 1 <= held_out_count(n, raw["data.unseen_clients"]) < n, e
        elif e.key == "data.synthetic_devices":       # the synthetic generator's key with another dataset
            assert raw.get("dataset", KEYS["dataset"].default) != "synthetic", e
        elif e.key.startswith("data.hf."):            # a Hugging Face dataset's key with another dataset
            assert not raw.get("dataset", KEYS["dataset"].default).startswith("hf:"), e
        elif e.key == "eval.gate":                    # a gate needs two streams and both validation splits
            assert raw["eval.gate"] != "none" and (
                method != "fedprism_dual" or not raw.get("data.val_fraction") or not raw.get("data.global_val")
                or raw.get("fedprism_dual.inference_weight") in (0, 1)), e
        elif e.key in ("train.kernels", "train.precision") and raw.get("train.precision") == "bfloat16":
            # bf16 training with the float32-only fused kernels, or with Opacus' float32 DP-SGD
            assert raw.get("train.kernels") == "fused" or raw.get("dp.local", "none") != "none", e
        elif "only with dataset=" in str(e):         # a dataset's own key (data.acs.*, data.domains, ...) elsewhere
            want = str(e).split("only with dataset=")[1].split(" ")[0].rstrip(",;)")
            assert raw.get("dataset", KEYS["dataset"].default) != want, e
        elif e.key.startswith(("dp.", "compress")):   # DP or compression with a method (or engine) that refuses it
            assert raw.get(e.key, KEYS[e.key].default if e.key in KEYS else None) != KEYS[e.key].default \
                if e.key in KEYS else True, e
        elif e.key.startswith("system.") or (e.key == "selection" and raw.get("system.async") == "fedbuff"):
            assert any(k.startswith("system.") for k in raw), e     # a system.* key the others make meaningless
        else:
            assert e.key.startswith(method + "."), e
        return
    assert isinstance(cfg, Config) and cfg.run_id


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), derandomize=FUZZ.derandomize,
          database=None)
@given(items=st.lists(st.text(max_size=25), min_size=1, max_size=4))
def test_cli_run_with_hostile_arguments_exits_2_with_one_line(items):
    items = [i for i in items if i.strip() and not i.startswith("-")]
    assume(items)
    items = [i if "=" in i else "x" + i + "=1" for i in items] + ["rounds=nan"]
    with tempfile.TemporaryDirectory() as d, pytest.MonkeyPatch.context() as mp:
        import io
        import sys
        err = io.StringIO()
        mp.setattr(sys, "stderr", err)
        assert main(["run", "--db", str(Path(d) / "x.db"), *items]) == 2
        text = err.getvalue().strip()
        assert text.startswith("fedprism: error: ") and "\n" not in text, text


@pytest.mark.parametrize("argv,needle", [
    (["seed=9223372036854775808"], "seed"), (["weight_decay=inf"], "weight_decay"),
    (["fedprism.temperature=inf"], "fedprism.temperature"), (["method=[1]"], "method"),
    (["fedamp.sigma=inf", "method=fedamp"], "fedamp.sigma"), (["clients=1e400"], "clients"),
    (["partition.alpha=nan"], "partition.alpha"), (['name="a\nb"', "lr=-1"], "lr"),
])
def test_cli_hostile_inputs_known_before(tmp_path, capsys, argv, needle):
    assert main(["run", "--db", str(tmp_path / "x.db"), "dataset=digits", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fedprism: error: ") and "\n" not in err and needle in err, err
    assert not (tmp_path / "x.db").exists()          # refused before anything was created


# -- TOML files ------------------------------------------------------------------------------------------
toml_bytes = st.one_of(
    st.binary(max_size=200),
    st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.lists(st.sampled_from([b"rounds = ", b"[fedprism]\n", b"k = ", b"1e999", b"nan", b"inf", b"\xff\xfe",
                              b'"\xc3\x28"', b"\n", b"[[runs]]\n", b"runs = ", b"{", b"}", b"[", b"]", b"=",
                              b"seed = 99999999999999999999", b'method = "fedavg"\n', b"lr = 0.1\n",
                              b"1979-05-27T07:32:00Z", b"[partition]\n", b"alpha = -1\n"]),
             max_size=12).map(b"".join),
)


@FUZZ
@given(blob=toml_bytes)
def test_config_files_of_random_bytes(blob):
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "c.toml"
        p.write_bytes(blob)
        try:
            cfg = _config(argparse.Namespace(items=[str(p)]))
        except ConfigError as e:
            assert "\n" not in str(e), str(e)
        else:
            assert isinstance(cfg, Config)


def test_non_utf8_config_file_is_a_one_line_error(tmp_path, capsys):
    p = tmp_path / "latin1.toml"
    p.write_bytes('name = "caf\xe9"\n'.encode("latin-1"))
    assert main(["run", "--db", str(tmp_path / "x.db"), str(p)]) == 2
    err = capsys.readouterr().err.strip()
    assert "UTF-8" in err and "0xe9" in err and "\n" not in err, err
    assert main(["run", "--db", str(tmp_path / "x.db"), str(tmp_path)]) == 2      # a folder
    assert "an existing TOML file" in capsys.readouterr().err


def test_inputs_that_are_not_config_keys_are_named_as_what_they_are(tmp_path, capsys):
    """A missing sweep file, a bare word on `run`, a misspelt dataset to download and `--workers 0` are
    not config keys: the error names the file, the argument, the dataset or the option as such."""
    db = str(tmp_path / "x.db")
    cases = [(["sweep", str(tmp_path / "no.toml"), "--db", db],
              f"sweep file '{tmp_path / 'no.toml'}' is not valid"),
             (["run", "--db", db, "roundz"], "config file 'roundz' is not valid: an existing TOML file"),
             (["data", "download", "fmnis", "--dest", str(tmp_path)],
              "dataset 'fmnis' is not valid: downloadable datasets are acsincome, cifar10, cifar100, emnist, "
              "femnist, fmnist, mnist, mnistm, office_caltech10, sent140, shakespeare, svhn, synthdigits, "
              "tinyimagenet, uci_har, usps, wisdm (did you mean fmnist?)"),
             (["demo", "--workers", "0", "--db", db], "option '--workers' = 0 is not valid: an integer >= 1")]
    for argv, want in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert want in err and "config key" not in err, err
    assert not (tmp_path / "x.db").exists()


# -- sweep files -----------------------------------------------------------------------------------------
sweep_docs = st.fixed_dictionaries({}, optional={
    "name": hostile, "base": hostile | st.dictionaries(st.sampled_from(["rounds", "method", "fedprism.k", "x"]),
                                                       hostile, max_size=3),
    "grid": hostile | st.dictionaries(st.sampled_from(["seed", "lr", "method"]), hostile, max_size=2),
    "runs": hostile | st.lists(st.dictionaries(st.sampled_from(["label", "method", "lr", "fedprism.k"]), hostile,
                                               max_size=3), max_size=3),
    "quick": hostile, "db": hostile, "description": hostile, "extra": hostile,
})


@FUZZ
@given(doc=sweep_docs, quick=st.booleans())
def test_sweep_files_of_random_structure(doc, quick):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sweep_mod, "_read", lambda p: doc)
        try:
            name, configs = sweep_mod.load_sweep("fuzz.toml", quick=quick)
        except ConfigError as e:
            assert "\n" not in str(e)
        else:
            assert isinstance(name, str) and all(isinstance(c, Config) for c in configs)
        try:
            sweep_mod.sweep_db("fuzz.toml")
        except ConfigError:
            pass


@pytest.mark.parametrize("text,needle", [
    ('name = "s"\n[runs]\nmethod = "fedavg"\n', "runs"),            # a table, not an array of tables
    ('name = "s"\nruns = ["fedavg"]\n', "runs"),
    ('name = "s"\nbase = 3\n', "base"),
    ('name = 7\n[[runs]]\nmethod = "fedavg"\n', "name"),
    ('[[runs]]\nlabel = ""\n', "label"),
    ('[grid]\nseed = 3\n', "grid.seed"),
    ('name = "\xff"\n', "UTF-8"),
])
def test_malformed_sweep_files_exit_2_with_one_line(tmp_path, capsys, text, needle):
    p = tmp_path / "s.toml"
    p.write_bytes(text.encode("latin-1"))
    assert main(["sweep", "--db", str(tmp_path / "x.db"), str(p), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("fedprism: error: ") and needle in err[-1], err


# -- partition parameters ----------------------------------------------------------------------------------
@settings(max_examples=300, deadline=None, derandomize=FUZZ.derandomize, database=None)
@given(name=st.sampled_from(sorted(PARTITIONS)), n=st.integers(0, 300), classes=st.integers(1, 12),
       clients=hostile_scalars | st.integers(-3, 80), seed=hostile_scalars | st.integers(0, 5),
       min_train=st.integers(-1, 20) | hostile_scalars, min_test=st.integers(-1, 3),
       params=st.dictionaries(st.sampled_from(["alpha", "max_tries", "shards_per_client", "variant", "s",
                                               "num_domains", "min_classes", "max_classes", "bogus"]),
                              hostile_scalars | st.integers(0, 12) | st.floats(0, 3), max_size=3),
       data_seed=st.integers(0, 3))
def test_partitions_of_random_parameters(name, n, classes, clients, seed, min_train, min_test, params, data_seed):
    rng = np.random.default_rng(data_seed)
    y = rng.integers(0, classes, n)
    yt = rng.integers(0, classes, max(n // 4, 1))
    try:
        part = make_partition(name, y, yt, clients, seed, min_train=min_train, min_test=min_test, **params)
    except (PartitionError, ConfigError) as e:
        assert str(e)
        return
    assert len(part.train) == clients
    assert all(len(t) >= min_train for t in part.train)


def test_nul_characters_in_paths_are_config_errors(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("FEDPRISM_DB", raising=False)
    f = tmp_path / "s.toml"
    f.write_text('db = "a\\u0000b"\n[[runs]]\nmethod = "fedavg"\n')
    assert main(["sweep", str(f), "--quiet"]) == 2                  # found by fuzzing: ValueError before
    assert "db" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="data.root"):
        resolve({"data.root": "/tmp/\0x"})


@pytest.mark.parametrize("raw, want", [
    ({"method": "fedprsm"}, "(did you mean fedprism?)"),
    ({"method": "FedAvg"}, "(did you mean fedavg?)"),
    ({"dataset": "fminst"}, "(did you mean fmnist?)"),
    ({"model": "lenet"}, "(did you mean lenet5?)"),
    ({"partition": "dirichet"}, "(did you mean dirichlet?)"),
    ({"clients": "abc"}, "is not valid: an integer >= 1"),
    ({"rounds": 2.5}, "is not valid: an integer >= 1"),
    ({"partition": "iid", "partition.alpha": 0.5}, "(a key of partition=dirichlet / dirichlet_per_class / user_shift)"),
    ({"partition": "dirichlet", "partition.alpah": 0.5}, "(did you mean partition.alpha?)"),
])
def test_misspelt_names_get_the_nearest_and_each_phrase_once(raw, want):
    with pytest.raises(ConfigError) as e:
        resolve(raw)
    assert want in str(e.value) and "an integer; an integer" not in str(e.value), str(e.value)
