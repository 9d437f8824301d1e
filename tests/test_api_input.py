"""Bad input through the Python API: a name registered again is other code or data (never a stored
result of the earlier definition), registrations that could never be called, arguments of the wrong
type, and a method hook returning what no round can store; each named where it is wrong."""

from __future__ import annotations

import pytest
import torch

import fedprism
from fedprism import plugins
from fedprism.algorithms.base import REGISTRY
from fedprism.algorithms.fedavg import FedAvg
from fedprism.data.datasets import load_dataset
from fedprism.experiment.config import resolve
from fedprism.experiment.provenance import ProvenanceMismatch
from fedprism.experiment.runner import Experiment, MethodError
from fedprism.experiment.store import Store, UnknownSweep

TINY = dict(dataset="digits", model="mlp", clients=4, rounds=2, fraction=1.0, local_epochs=1,
            engine="sequential")


@pytest.fixture
def registered():
    """Names registered by a test, removed afterwards."""
    names = {"model": [], "dataset": [], "method": []}
    yield names
    for n in names["model"]:
        plugins.MODELS.pop(n, None)
    for n in names["dataset"]:
        plugins.DATASETS.pop(n, None)
    for n in names["method"]:
        REGISTRY.pop(n, None)


def test_a_model_registered_again_in_the_same_file_is_other_code(tmp_path, registered):
    """Two builders under one name in one file (a notebook cell run again with other code): the file's hash
    alone is the same, so the second run used to be the first one's stored result."""
    def narrow(shape, k):
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, k))

    def wide(shape, k):
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.ReLU(),
                                   torch.nn.Linear(32, k))

    registered["model"].append("nb_model")
    fedprism.register_model("nb_model", narrow)
    cfg = fedprism.config(**{**TINY, "model": "nb_model", "method": "fedavg"})
    fedprism.run(cfg, db=tmp_path / "m.db")
    assert fedprism.run(cfg, db=tmp_path / "m.db").reused               # the same definition: reused
    fedprism.register_model("nb_model", wide)
    with pytest.raises(ProvenanceMismatch, match="model code"):
        fedprism.run(cfg, db=tmp_path / "m.db")


def test_a_method_registered_again_does_not_resume_the_earlier_ones_run(tmp_path, registered):
    class Mine(FedAvg):
        name = "nb_method"

    class Other(FedAvg):
        name = "nb_method"

        def aggregate(self, state, rnd, update):
            return super().aggregate(state, rnd, update)

    registered["method"].append("nb_method")
    fedprism.register(Mine)
    cfg = resolve({**TINY, "method": "nb_method"})
    with Store(tmp_path / "r.db") as st:
        assert Experiment(cfg, st).run(stop_after=1).status == "interrupted"
    fedprism.register(Other)
    # an unfinished run of other code is not resumed: it is replaced, with a one-line note, and runs from round 0
    with Store(tmp_path / "r.db") as st, pytest.warns(UserWarning, match="interrupted after 1 round.*method code"
                                                      ".*replaced: it runs from round 0"):
        res = Experiment(cfg, st).run()
    assert res.status == "finished" and res.resumed_from is None and len(res.history) == 2


def test_a_dataset_registered_again_is_loaded_again(tmp_path, registered):
    """The federations of a dataset are cached per process by name: registering the name again must not
    leave runs on the earlier loader's data."""
    def first(pad32, root):
        return load_dataset("digits", cache_dir=False)

    def second(pad32, root):
        ds = load_dataset("digits", cache_dir=False)
        ds.x_train, ds.x_test = ds.x_train + 1.0, ds.x_test + 1.0
        return ds

    from fedprism.experiment.federation import build_federation

    registered["dataset"].append("nb_data")
    fedprism.register_dataset("nb_data", first)
    cfg = resolve({**TINY, "dataset": "nb_data", "method": "fedavg"})
    a = build_federation(cfg).x_train.clone()
    fedprism.run(cfg, db=tmp_path / "d.db")
    fedprism.register_dataset("nb_data", second)
    assert torch.equal(build_federation(cfg).x_train, a + 1.0)
    with pytest.raises(ProvenanceMismatch, match="data"):
        fedprism.run(cfg, db=tmp_path / "d.db")


def test_registrations_that_could_never_be_called_are_refused_at_once(registered):
    with pytest.raises(TypeError, match=r"register_model\('m', \.\.\.\): .* cannot be called as "
                                        r"build\(input_shape, num_classes\)"):
        fedprism.register_model("m", lambda: None)
    with pytest.raises(TypeError, match=r"cannot be called as load\(pad32, root\)"):
        fedprism.register_dataset("d", lambda path: None)
    fedprism.register_model("m", lambda *a, **k: None)                      # what binds is accepted
    registered["model"].append("m")
    assert "d" not in plugins.DATASETS


def test_a_dataset_whose_splits_have_other_input_shapes_is_refused(tmp_path, registered):
    from fedprism.errors import ConfigError

    def load(pad32, root):
        ds = load_dataset("digits", cache_dir=False)
        ds.x_test = ds.x_test.reshape(len(ds.x_test), -1)[:, :50]
        return ds

    registered["dataset"].append("nb_shapes")
    fedprism.register_dataset("nb_shapes", load)
    with pytest.raises(ConfigError, match=r"'nb_shapes' .*inputs of one shape in both splits"):
        fedprism.run(fedprism.config(**{**TINY, "dataset": "nb_shapes", "method": "fedavg"}),
                     db=tmp_path / "s.db")
    assert not (tmp_path / "s.db").exists()


def test_arguments_of_the_wrong_type_are_named(tmp_path):
    cfg = resolve({**TINY, "method": "fedavg"})
    with pytest.raises(TypeError, match="Experiment: cfg is a dict"):
        Experiment(dict(TINY), Store(tmp_path / "a.db"))
    with pytest.raises(TypeError, match="Experiment: store is a str"):
        Experiment(cfg, str(tmp_path / "a.db"))
    with pytest.raises(TypeError, match="Experiment: sweep = 5"):
        Experiment(cfg, Store(tmp_path / "a.db"), sweep=5)
    with pytest.raises(TypeError, match="Store: path = None"):
        Store(None)
    Experiment(cfg, Store(tmp_path / "a.db"), sweep="s").run()
    with pytest.raises(UnknownSweep, match="'t'"):
        fedprism.results(tmp_path / "a.db", sweep="t")
    assert [r["method"] for r in fedprism.results(tmp_path / "a.db", sweep="s")] == ["fedavg"]


def test_aggregate_returning_no_dict_is_the_methods_error(tmp_path, registered):
    class Listy(FedAvg):
        name = "nb_listy"

        def aggregate(self, state, rnd, update):
            super().aggregate(state, rnd, update)
            return ["a record"]

    registered["method"].append("nb_listy")
    fedprism.register(Listy)
    with Store(tmp_path / "l.db") as st:
        exp = Experiment(resolve({**TINY, "method": "nb_listy"}), st)
        with pytest.raises(MethodError, match=r"Listy\.aggregate returned list: it returns a dict"):
            exp.run()
        assert st.run(exp.run_id)["status"] == "failed"


def test_a_round_whose_every_reply_is_malformed_is_the_methods_error(tmp_path, registered):
    """In process every reply comes from the method's own client_update: all of a round's replies one
    entry short is its bug (it was stored as 'finished' and 'diverged'). One client per round cannot tell
    and is a recorded rejection, as a NaN reply (training that diverged) is."""
    class Short(FedAvg):
        name = "nb_short"

        def client_update(self, plan, trainer, rnd, cstate):
            up = super().client_update(plan, trainer, rnd, cstate)
            up.payload["params"] = up.payload["params"][:, :-1]
            return up

    registered["method"].append("nb_short")
    fedprism.register(Short)
    with Store(tmp_path / "b.db") as st:
        exp = Experiment(resolve({**TINY, "method": "nb_short"}), st)
        with pytest.raises(MethodError, match=r"every client of round 1 sent Short a reply no round can use; "
                                              r"client 0: params: wrong shape"):
            exp.run()
        assert st.run(exp.run_id)["status"] == "failed"
        one = Experiment(resolve({**TINY, "method": "nb_short", "fraction": 0.25}), st).run()
    assert one.status == "finished" and [h["accepted"] for h in one.history] == [0, 0]


class _TupleInTraining(torch.nn.Module):
    """Logits in evaluation, (logits, aux) in training: the shape check used to run in eval mode only."""

    def __init__(self, k):
        super().__init__()
        self.f = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, k))

    def forward(self, x):
        y = self.f(x)
        return (y, y) if self.training else y


@pytest.mark.parametrize("build, match", [
    (lambda shape, k: _TupleInTraining(k), "logits in training mode; it gave tuple"),
    (lambda shape, k: torch.nn.Flatten(), "has parameters to train; this one has none"),
    (lambda shape, k: _Ints(k), r"floating-point logits; it gave \[2, 10\] of torch.int64"),
])
def test_a_registered_model_is_checked_in_both_modes(tmp_path, registered, build, match):
    from fedprism.errors import ConfigError

    registered["model"].append("nb_modes")
    fedprism.register_model("nb_modes", build)
    with pytest.raises(ConfigError, match="'model' = 'nb_modes' .*" + match):
        fedprism.run(fedprism.config(**{**TINY, "model": "nb_modes", "method": "fedavg"}),
                     db=tmp_path / "x.db")
    assert not (tmp_path / "x.db").exists()


class _Ints(torch.nn.Module):
    def __init__(self, k):
        super().__init__()
        self.f = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, k))

    def forward(self, x):
        return self.f(x).long()


def test_small_api_slips_are_named(tmp_path):
    with pytest.raises(TypeError, match=r"fedprism.run\(cfg\): None"):
        fedprism.run(None, db=tmp_path / "n.db")
    assert not (tmp_path / "n.db").exists()
    with pytest.raises(TypeError, match="Store: timeout = '5'"):
        Store(tmp_path / "t.db", timeout="5")
    res = fedprism.run(fedprism.config(**{**TINY, "method": "fedavg", "rounds": 1}), db=tmp_path / "t.db")
    with Store(tmp_path / "t.db") as st:
        with pytest.raises(ValueError, match="status 'bogus' is not one of running, finished"):
            st.mark(res.run_id, "bogus")
        with pytest.raises(ValueError, match="name None is not a label"):
            st.rename(res.run_id, None)
        assert st.run(res.run_id)["status"] == "finished"
