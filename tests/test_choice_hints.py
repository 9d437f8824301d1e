"""A mistyped choice value is answered with the nearest allowed one (`hparams.did_you_mean`, through
`registry.suggest`), for every choice-valued parameter: the config keys, every method's parameters, the
Flower run-config keys, and the parameters that take a number or a keyword ('head', 'auto', 'max')."""

from __future__ import annotations

import pytest

from fedprism.algorithms import REGISTRY
from fedprism.cli import main
from fedprism.errors import ConfigError
from fedprism.experiment.config import KEYS, resolve
from fedprism.hparams import Param, did_you_mean


def _message(param: Param, key: str, value) -> str:
    with pytest.raises(ConfigError) as e:
        param.validate(key, value)
    assert str(e.value).endswith(e.value.allowed)
    return str(e.value)


def test_a_weighting_typo_gets_the_nearest_choice():
    with pytest.raises(ConfigError) as e:
        resolve({"method": "fedavg", "fedavg.weighting": "sample"})
    assert str(e.value) == ("config key 'fedavg.weighting' = 'sample' is not valid: one of samples, uniform "
                            "(did you mean 'samples'?)")
    assert e.value.key == "fedavg.weighting" and e.value.allowed.endswith("(did you mean 'samples'?)")


def test_the_command_line_says_it(tmp_path, capsys):
    assert main(["run", "method=fedavg", "fedavg.weighting=unifrom", "--db", str(tmp_path / "r.db")]) == 2
    err = capsys.readouterr().err
    assert "config key 'fedavg.weighting' = 'unifrom' is not valid" in err and "(did you mean 'uniform'?)" in err
    assert not (tmp_path / "r.db").exists()


def _choice_params():
    """(key, Param) of every parameter with string choices: config keys, method parameters, Flower keys."""
    from fedprism.experiment.flower_id import IDENTITY_PARAMS

    out = [(k, p) for k, p in KEYS.items()]
    for name in REGISTRY.names():
        out += [(f"{name}.{k}", p) for k, p in REGISTRY.get(name).params.items()]
    out += list(IDENTITY_PARAMS.items())
    return [(k, p) for k, p in out if p.choices and any(isinstance(c, str) and len(c) >= 3 for c in p.choices)]


def test_every_choice_valued_parameter_names_the_nearest_choice():
    params = _choice_params()
    assert len(params) > 30 and {"fedavg.weighting", "engine", "norm-action"} <= {k for k, _ in params}
    for key, p in params:
        for c in (c for c in p.choices if isinstance(c, str) and len(c) >= 3):
            typo = c + "x"                     # one letter more: nearer to c than to any other choice
            msg = _message(p, key, typo)
            assert msg.endswith(f"(did you mean {c!r}?)"), (key, typo, msg)
        msg = _message(p, key, "qqqqqqqqqq")  # near nothing: no guess
        assert "did you mean" not in msg, (key, msg)


@pytest.mark.parametrize("key, typo, word", [("fedper.personal", "hed", "head"), ("fedamp.sigma", "aut", "auto"),
                                              ("fedamp.alpha_k", "mx", "max"), ("fedavg.server_lr", "auot", "auto")])
def test_a_keyword_of_a_number_or_keyword_parameter(key, typo, word):
    with pytest.raises(ConfigError) as e:
        resolve({"method": key.split(".")[0], key: typo})
    assert str(e.value).endswith(f"(did you mean {word!r}?)"), str(e.value)
    with pytest.raises(ConfigError) as e:            # a number out of range gets no guess
        resolve({"method": key.split(".")[0], key: -5})
    assert "did you mean" not in str(e.value)


def test_did_you_mean_by_hand():
    assert did_you_mean("sample", ("samples", "uniform")) == " (did you mean 'samples'?)"
    assert did_you_mean("UNIFORM", ("samples", "uniform")) == " (did you mean 'uniform'?)"   # case
    assert did_you_mean("zzz", ("samples", "uniform")) == ""
    assert did_you_mean(3, ("samples", "uniform")) == ""                  # only strings are guessed at
    assert did_you_mean("tru", ("auto", True, False, "true")) == " (did you mean 'true'?)"
