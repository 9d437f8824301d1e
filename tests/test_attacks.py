"""Byzantine clients (`attack.*`, fedprism/attacks.py): who they are, what they upload, by hand and in runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedprism.attacks import byzantine_clients, craft
from fedprism.errors import ConfigError
from fedprism.experiment.config import resolve
from fedprism.experiment.runner import Experiment
from fedprism.experiment.store import Store

BASE = {"dataset": "digits", "model": "mlp", "clients": 10, "fraction": 1.0, "rounds": 2, "local_epochs": 1,
        "lr": 0.05, "engine": "sequential", "device": "cpu", "threads": 1}


def test_the_byzantine_clients_are_a_seeded_draw_of_floor_fraction_n():
    a = byzantine_clients(3, 10, 0.25)
    assert len(a) == 2 and np.array_equal(a, np.sort(a)) and np.array_equal(a, byzantine_clients(3, 10, 0.25))
    assert len(byzantine_clients(3, 10, 0.3)) == 3 and len(byzantine_clients(3, 10, 0.0)) == 0
    assert not np.array_equal(byzantine_clients(3, 100, 0.2), byzantine_clients(4, 100, 0.2))


def test_craft_by_hand():
    s, y = torch.tensor([1.0, 2.0, -1.0]), torch.tensor([1.5, 1.0, 0.0])
    # sign_flip: s - lambda (y - s) = [1, 2, -1] - 2 [0.5, -1, 1]
    assert torch.equal(craft("sign_flip", 2.0, s, y, torch.Generator()), torch.tensor([0.0, 4.0, -3.0]))
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    noise = torch.randn(3, generator=g2, dtype=torch.float64).float()
    assert torch.equal(craft("gaussian", 0.5, s, y, g1), s + 0.5 * noise)


def _captured(cfg: dict, tmp_path, name: str):
    """Run `cfg`, keeping each round's uploaded rows and the rows the clients were sent."""
    e = Experiment(resolve(cfg), Store(tmp_path / f"{name}.db"))
    real, seen = e.algo.aggregate, []

    def aggregate(state, rnd, update):
        seen.append((update.clients.copy(), update.params.clone(), update.start.clone()))
        return real(state, rnd, update)

    e.algo.aggregate = aggregate
    res = e.run()
    return e, res, seen


def test_the_byzantine_rows_are_crafted_and_the_honest_rows_untouched(tmp_path):
    cfg = {**BASE, "method": "fedavg", "attack.fraction": 0.3, "attack.scale": 2.0, "seed": 1}
    e, res, seen = _captured(cfg, tmp_path, "attacked")
    _, clean, seen0 = _captured({**cfg, "attack.fraction": 0.0}, tmp_path, "clean")
    bad = e.ctx.attack.clients
    assert len(bad) == 3 and res.run_id != clean.run_id
    # round 0: the same start, the same training, so the honest rows equal the clean run's and the
    # Byzantine rows are s - 2 (y - s) of the clean run's trained rows
    (c, x, s), (c0, y, s0) = seen[0], seen0[0]
    assert np.array_equal(c, c0) and torch.equal(s, s0)
    for i, client in enumerate(c):
        want = s[i] - 2.0 * (y[i] - s[i]) if client in bad else y[i]
        assert torch.equal(x[i], want), client
    recs = [r for r in Store(tmp_path / "attacked.db").records(res.run_id) if r["kind"] == "byzantine_clients"]
    assert len(recs) == 1 and recs[0]["data"]["clients"] == bad.tolist()


def test_off_is_absent_from_the_run_id_and_changes_nothing(tmp_path):
    cfg = {**BASE, "method": "fedavg"}
    assert resolve(cfg).run_id == resolve({**cfg, "attack.fraction": 0.0, "attack.kind": "sign_flip"}).run_id
    assert not [k for k in resolve(cfg).identity if k.startswith("attack.")]


def test_the_mean_collapses_and_multi_krum_holds_under_sign_flipping(tmp_path):
    """20 clients, 5 of them Byzantine (sign_flip x 3): FedAvg's mean ends near chance, Multi-Krum (f = 5:
    the 15 rows of lowest score averaged) keeps learning (54 % against 10 % for the mean, 68 % for the mean
    without the attack)."""
    base = {**BASE, "clients": 20, "fraction": 1.0, "rounds": 8, "seed": 0}
    acc = {}
    for rule in ("mean", "multi_krum"):
        for frac in (0.0, 0.25):
            cfg = {**base, "method": "fedavg", "fedavg.aggregation": rule, "fedavg.aggregation.f": 5,
                   "attack.fraction": frac, "attack.scale": 3.0}
            acc[rule, frac] = Experiment(resolve(cfg), Store(tmp_path / f"{rule}{frac}.db")).run().final["global_acc"]
    assert acc["mean", 0.0] > 0.6 and acc["mean", 0.25] < 0.25, acc
    assert acc["multi_krum", 0.25] > acc["mean", 0.25] + 0.3, acc


@pytest.mark.parametrize("method", ["ifca", "fedsoft"])
def test_a_method_without_a_model_upload_is_refused_before_training(method, tmp_path):
    with pytest.raises(ConfigError) as err:
        Experiment(resolve({**BASE, "method": method, "attack.fraction": 0.3}), Store(tmp_path / "r.db"))
    assert err.value.key == "attack.fraction" and "nothing to craft" in str(err.value)


@pytest.mark.parametrize("key, value", [("attack.fraction", 1.0), ("attack.fraction", -0.1), ("attack.kind", "flip"),
                                        ("attack.scale", 0)])
def test_bad_values_name_the_key(key, value):
    with pytest.raises(ConfigError) as err:
        resolve({**BASE, "method": "fedavg", key: value})
    assert err.value.key == key


def test_refused_on_flower():
    from fedprism.flower.settings import check_flower_config

    with pytest.raises(ConfigError, match="attack.fraction"):
        check_flower_config(resolve({**BASE, "method": "fedavg", "attack.fraction": 0.2}))


def test_a_warning_when_attackers_outnumber_the_rule_s_f():
    """Allowed (a rule's breakdown is worth measuring), but said: about fraction x cohort attackers a round
    against aggregation.f."""
    from fedprism.experiment.config import resolve
    from fedprism.experiment.limits import attack_warning

    base = {"method": "fedavg", "dataset": "digits", "model": "mlp", "clients": 10, "fraction": 1.0,
            "fedavg.aggregation": "krum"}
    note = attack_warning(resolve({**base, "attack.fraction": 0.4}))
    assert note is not None and "about 4.0 Byzantine clients in a round of 10" in note and "f=1" in note
    assert attack_warning(resolve({**base, "attack.fraction": 0.1})) is None            # 1 <= f
    assert attack_warning(resolve({**base, "attack.fraction": 0.3, "fedavg.aggregation.f": 3})) is None
    assert attack_warning(resolve({**base, "attack.fraction": 0.4, "fedavg.aggregation": "mean"})) is None
