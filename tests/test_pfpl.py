"""PFPL: the reducing settings (lambda = 0, and alpha = 1 with own_share=live, are Local), the weights of
Eq. 4, hand-computed personalised prototypes, what travels, and a tiny end-to-end run on the mixed label +
feature skew protocol."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedprism.algorithms import REGISTRY
from fedprism.algorithms.base import Context
from fedprism.algorithms.pfpl import (first_neighbour_clusters, neighbour_prototypes, neighbour_weights,
                                      personalised_prototypes, pfpl_loss_norm, pfpl_loss_norm_sum,
                                      pfpl_loss_squared, pfpl_loss_squared_sum, squared_distances)
from fedprism.engine.base import LocalConfig
from fedprism.engine.sequential import SequentialEngine
from fedprism.errors import ConfigError
from fedprism.experiment.config import resolve
from fedprism.experiment.runner import Experiment, Simulator
from fedprism.experiment.store import Store
from fedprism.federation import Federation
from fedprism.params import Functional, flatten
from test_fedproto_protohar import Identity2  # features = the 2-d input, a linear head

SMALL = dict(dataset="digits", clients=6, rounds=3, fraction=0.5, local_epochs=1, batch_size=16, lr=0.05,
             model="mlp", engine="sequential", device="cpu", seed=1)


def cfg(**kw):
    return resolve({**SMALL, **{k.replace("__", "."): v for k, v in kw.items()}})


def run(tmp_path, name="r", **kw) -> Experiment:
    e = Experiment(cfg(**kw), Store(tmp_path / f"{name}.db"))
    assert e.run().status == "finished"
    return e


# -- alpha = 1 is Local training ------------------------------------------------------------------------------
def test_loss_by_hand_and_zero_regulariser_at_alpha_one():
    torch.manual_seed(0)
    f = Functional(Identity2())
    w = flatten(f.module)
    x = torch.tensor([[0.0, 0.0], [2.0, 0.0], [0.0, 4.0], [5.0, 5.0]])
    y = torch.tensor([0, 0, 1, 2])
    mix = torch.tensor([[1.0, 3.0], [0.0, 1.0], [9.0, 9.0], [7.0, 7.0]])
    present = torch.tensor([1.0, 1.0, 0.0, 1.0])        # class 2 has no target; class 3 is not in the batch
    ce = torch.nn.functional.cross_entropy(f(w, x), y)

    def loss(fn, coef, weight=torch.ones(4)):
        return fn(f, w, x, y, weight, {"target": mix, "present": present, "coef": torch.tensor(coef)})

    # batch class means: class 0 (1, 0), class 1 (0, 4); squared gaps to the targets 0 + 9 and 0 + 9, / d = 2
    torch.testing.assert_close(loss(pfpl_loss_squared, 2.0), ce + 2.0 * (9 + 9) / 2)
    torch.testing.assert_close(loss(pfpl_loss_norm, 2.0), ce + 2.0 * (3 + 3) / 2 ** 0.5)
    pad = torch.tensor([1.0, 0.0, 1.0, 1.0])                  # a padded sample is in no class mean
    ce2 = torch.nn.functional.cross_entropy(f(w, x[[0, 2, 3]]), y[[0, 2, 3]])
    torch.testing.assert_close(loss(pfpl_loss_squared, 1.0, pad), ce2 + ((1 + 9) + 9) / 2)
    for fn in (pfpl_loss_squared, pfpl_loss_norm):           # alpha = 1: coef = lambda (1 - alpha)^p = 0
        assert torch.equal(loss(fn, 0.0), ce)
    # align_scale=sum, the paper's sum of squares: no division by d = 2
    torch.testing.assert_close(loss(pfpl_loss_squared_sum, 2.0), ce + 2.0 * (9 + 9))
    torch.testing.assert_close(loss(pfpl_loss_norm_sum, 2.0), ce + 2.0 * (3 + 3))
    torch.testing.assert_close(loss(pfpl_loss_squared_sum, 1.0, pad), ce2 + (1 + 9) + 9)


def test_sum_scale_is_the_mean_scale_with_lambda_times_d(tmp_path):
    """The MLP's d = 64 features: align_scale=sum with lambda / 64 trains the models of align_scale=mean
    with lambda, bit for bit (division by a power of two is exact; the norm: by sqrt(64) = 8), and the same
    lambda at both scales trains other models; the default keeps the run id."""
    assert cfg(method="pfpl").run_id == cfg(method="pfpl", pfpl__align_scale="mean").run_id
    assert cfg(method="pfpl").run_id != cfg(method="pfpl", pfpl__align_scale="sum").run_id
    for dist, lam_sum in (("squared", 1.0 / 64), ("norm", 1.0 / 8)):
        mean = run(tmp_path, f"m{dist}", method="pfpl", rounds=2, pfpl__distance=dist)
        assert mean.ctx.feature_dim == 64
        same = run(tmp_path, f"s{dist}", method="pfpl", rounds=2, pfpl__distance=dist, pfpl__align_scale="sum",
                   pfpl__lam=lam_sum)
        assert torch.equal(same.clients.data["w"], mean.clients.data["w"]), dist
        strong = run(tmp_path, f"x{dist}", method="pfpl", rounds=2, pfpl__distance=dist, pfpl__align_scale="sum")
        assert not torch.equal(strong.clients.data["w"], mean.clients.data["w"]), dist


def test_reducing_settings_are_local_training_bit_for_bit(tmp_path):
    local = run(tmp_path, "local", method="local")
    for name, kw in (("live1", dict(pfpl__alpha=1.0, pfpl__own_share="live")), ("lam0", dict(pfpl__lam=0.0))):
        one = run(tmp_path, name, method="pfpl", **kw)
        assert torch.equal(one.clients.data["w"], local.clients.data["w"]), name
        a = [tuple(r)[2:] for r in local.store.client_rows(local.run_id, 3)]
        b = [tuple(r)[2:] for r in one.store.client_rows(one.run_id, 3)]
        assert a == b, name
    for name, kw in (("half", {}), ("up1", dict(pfpl__alpha=1.0)), ("live", dict(pfpl__own_share="live"))):
        other = run(tmp_path, name, method="pfpl", **kw)         # alpha = 1, uploaded share: still pulls
        assert not torch.equal(other.clients.data["w"], local.clients.data["w"]), name


def test_vectorized_engine_gives_the_sequential_models(tmp_path):
    seq = run(tmp_path, "seq", method="pfpl", rounds=2)
    vec = run(tmp_path, "vec", method="pfpl", rounds=2, engine="vectorized", pfpl__distance="norm")
    seq_norm = run(tmp_path, "seqn", method="pfpl", rounds=2, pfpl__distance="norm")
    assert torch.allclose(vec.clients.data["w"], seq_norm.clients.data["w"], atol=1e-5)
    assert not torch.allclose(seq.clients.data["w"], seq_norm.clients.data["w"], atol=1e-5)


# -- the weights of Eq. 4 -----------------------------------------------------------------------------------
def test_inverse_weights_favour_the_near_same_domain_client_and_as_printed_the_far_one():
    # client 0 and client 1 share a domain (near prototypes), client 2 is far; one class, d = 2
    protos = torch.tensor([[[0.0, 0.0]], [[0.1, 0.0]], [[5.0, 0.0]]])
    counts = torch.ones(3, 1)
    d = squared_distances(protos[:, 0])[0, 1:]                # from client 0 to clients 1 and 2
    for how, near_share in (("inverse", lambda s: s > 0.5), ("softmax", lambda s: s > 0.5),
                            ("as_printed", lambda s: s < 0.5)):
        w = neighbour_weights(d, how)
        assert float(w.sum()) == pytest.approx(1.0) and bool((w >= 0).all())
        assert near_share(float(w[0])), (how, w)
        mix, present, _ = neighbour_prototypes(protos, counts, how, clustering="none")
        x0 = float(mix[0, 0, 0])                              # P_0 lies between 0.1 (near) and 5 (far)
        assert present[0, 0] and (x0 < 2.55 if how != "as_printed" else x0 > 2.55), (how, x0)


def test_weights_at_the_edges_stay_finite():
    # softmax over far candidates: exp(-d / T) underflows for every one unless shifted by the nearest
    w = neighbour_weights(torch.tensor([1e4, 1e4 + 1.0], dtype=torch.float64), "softmax")
    assert w.tolist() == pytest.approx([1 / (1 + math.exp(-1)), math.exp(-1) / (1 + math.exp(-1))], abs=1e-12)
    # the printed weights of identical candidates (all distances 0): uniform, not 0 / 0
    assert neighbour_weights(torch.zeros(3, dtype=torch.float64), "as_printed").tolist() == [1 / 3] * 3


def test_hand_computed_personalised_prototypes():
    # class 0 held by three clients at (0, 0), (1, 0), (0, 2); class 1 only by client 0
    protos = torch.tensor([[[0.0, 0.0], [3.0, 3.0]], [[1.0, 0.0], [0.0, 0.0]], [[0.0, 2.0], [0.0, 0.0]]])
    counts = torch.tensor([[2.0, 1.0], [4.0, 0.0], [1.0, 0.0]])
    # squared distances: d01 = 1, d02 = 4, d12 = 5
    mix, present, clusters = neighbour_prototypes(protos, counts, "inverse", clustering="none")
    expected = torch.tensor([[0.8 * 1, 0.2 * 2],            # client 0: 1/1 : 1/4 -> 0.8, 0.2
                             [0.0, 2 / 6],                  # client 1: 1/1 : 1/5 -> 5/6 (0, 0), 1/6 (0, 2)
                             [4 / 9, 0.0]])                 # client 2: 1/4 : 1/5 -> 5/9 (0, 0), 4/9 (1, 0)
    torch.testing.assert_close(mix[:, 0], expected, atol=1e-6, rtol=0)
    assert present.tolist() == [[True, False], [True, False], [True, False]]   # nobody else holds class 1
    assert clusters == [1, 1]
    cbar = personalised_prototypes(protos, mix, present, alpha=0.5)              # Eq. 4
    torch.testing.assert_close(cbar[:, 0], 0.5 * protos[:, 0] + 0.5 * expected, atol=1e-6, rtol=0)
    assert torch.equal(cbar[0, 1], protos[0, 1])                                 # no target: its own
    printed, _, _ = neighbour_prototypes(protos, counts, "as_printed", clustering="none")
    torch.testing.assert_close(printed[0, 0], torch.tensor([0.2 * 1, 0.8 * 2]))   # 1/5 (1, 0), 4/5 (0, 2)


def test_first_neighbour_clustering_keeps_domains_apart():
    # class 0: two domains, two clients each; with clustering the other domain gets no weight
    protos = torch.tensor([[[0.0, 0.0]], [[0.2, 0.0]], [[9.0, 9.0]], [[9.0, 9.5]]])
    labels = first_neighbour_clusters(squared_distances(protos[:, 0]))
    assert labels.tolist() == [0, 0, 1, 1]
    assert first_neighbour_clusters(torch.zeros(1, 1)).tolist() == [0]
    mix, present, clusters = neighbour_prototypes(protos, torch.ones(4, 1), "as_printed", clustering="finch")
    assert clusters == [2] and present.all()
    torch.testing.assert_close(mix[:, 0], torch.tensor([[0.2, 0.0], [0.0, 0.0], [9.0, 9.5], [9.0, 9.0]]))
    everyone, _, clusters = neighbour_prototypes(protos, torch.ones(4, 1), "as_printed", clustering="none")
    assert clusters == [1] and float(everyone[0, 0, 0]) > 4.0                      # pulled to the far domain


def test_two_clients_with_known_features_through_a_round():
    x_train = torch.tensor([[0.0, 0.0], [2.0, 0.0], [0.0, 4.0],                  # client 0: class 0 x2, class 1
                            [4.0, 0.0], [10.0, 10.0], [10.0, 12.0], [10.0, 14.0]])  # client 1: class 0, class 2 x3
    y_train = torch.tensor([0, 0, 1, 0, 2, 2, 2])
    fed = Federation(x_train, y_train, x_train[:3], y_train[:3], [np.arange(3), np.arange(3, 7)],
                     [np.arange(3), np.arange(3)], 4, ["a", "b", "c", "d"], "hand")
    torch.manual_seed(0)
    model = Identity2()
    engine = SequentialEngine(fed, model, LocalConfig(epochs=1, batch_size=2, lr=0.01), seed=0)
    ctx = Context(num_clients=2, num_classes=4, spec=engine.spec, init=flatten(model), n_train=fed.n_train,
                  label_hist=fed.label_hist(), seed=0, rounds=1, fraction=1.0, feature_dim=2)
    sim = Simulator(REGISTRY["pfpl"](ctx), engine)
    plan, up, _ = sim.round(0, np.array([0, 1]))
    assert not plan.payload["present"].any()                          # round 0: no target yet
    torch.testing.assert_close(up.payload["protos"][:, 0], torch.tensor([[1.0, 0.0], [4.0, 0.0]]))
    assert up.payload["counts"].tolist() == [[2, 1, 0, 0], [1, 0, 3, 0]]
    # class 0 is the only shared class: each client's P is the other's prototype (a single neighbour)
    torch.testing.assert_close(sim.state["mix"][:, 0], torch.tensor([[4.0, 0.0], [1.0, 0.0]]))
    assert sim.state["present"].tolist() == [[True, False, False, False], [True, False, False, False]]
    # round 1 (Algorithm 1 lines 10-12): Cbar = 0.5 own upload + 0.5 P for class 0; a class only the client
    # holds has its own upload as target; a class it never uploaded has none
    plan = sim.algo.plan(sim.state, 1, np.array([0, 1]))
    torch.testing.assert_close(plan.payload["target"][:, 0], torch.tensor([[2.5, 0.0], [2.5, 0.0]]))
    torch.testing.assert_close(plan.payload["target"][0, 1], torch.tensor([0.0, 4.0]))
    torch.testing.assert_close(plan.payload["target"][1, 2], torch.tensor([10.0, 12.0]))
    assert plan.payload["present"].tolist() == [[1, 1, 0, 0], [1, 0, 1, 0]]


# -- what travels ---------------------------------------------------------------------------------------------
def test_only_prototypes_travel(tmp_path):
    e = run(tmp_path, method="pfpl")
    C, d, P = e.ctx.num_classes, e.ctx.feature_dim, e.ctx.spec.size
    assert set(e.upload) == {"protos", "counts"}
    assert e.upload["protos"].shape == (C, d) and e.upload["counts"].shape == (C,)
    assert C * d + C < P / 10                                                     # far smaller than the model
    for h in e.store.round_metrics(e.run_id):
        assert h["accepted"] == h["clients"] == 3, h
        assert h["bytes_up"] == h["accepted"] * (C * d + C) * 4, h                 # C x d prototypes + C counts
        assert h["bytes_down"] == h["clients"] * (C * d + C) * 4, h                # P_i [C, d] + present [C]
    plan = e.algo.plan(e.state, 0, np.array([0, 1]))
    assert {k: tuple(v.shape) for k, v in plan.payload.items()} == {"target": (2, C, d), "present": (2, C)}
    assert not torch.equal(plan.payload["target"][0], plan.payload["target"][1])  # personalised per client
    assert set(e.state) == {"client_protos", "client_counts", "mix", "present"}   # no model on the server
    assert e.algo.eval_payload(e.state, np.arange(6)) == {}


def test_parameters_are_validated_with_the_key_named():
    for key, value in (("alpha", 1.5), ("alpha", -0.1), ("lam", -1.0), ("weighting", "nearest"),
                       ("temperature", 0.0), ("clustering", "kmeans"), ("distance", "l1")):
        with pytest.raises(ConfigError, match=f"pfpl.{key}"):
            cfg(method="pfpl", **{f"pfpl__{key}": value})


# -- end to end on the mixed protocol --------------------------------------------------------------------------
def test_tiny_mixed_skew_run_learns(tmp_path):
    e = run(tmp_path, method="pfpl", clients=8, fraction=1.0, rounds=3, local_epochs=2, partition="domain_mix",
            partition__num_domains=4, partition__min_classes=3, partition__max_classes=3)
    last = e.store.round_metrics(e.run_id)[-1]
    assert all(np.isfinite(v) for v in last.values() if isinstance(v, float))
    assert last["local_acc"] > 0.8, last                          # 3 classes per client: chance is 1/3
    assert last["bytes_up"] > 0 and e.store.records(e.run_id, "pfpl_clusters")
    # per-domain accuracy for the report: every client's domain is stored with round 0
    from fedprism.report import collect, domain_accuracy, domain_table
    doms = {r["client"]: r["data"]["domain"] for r in e.store.records(e.run_id, "client_domain")}
    assert doms == dict(enumerate(e.fed.meta["client_domains"])) and len(doms) == 8
    rows = e.store.client_rows(e.run_id)
    by_hand = {d: np.mean([r["local_acc"] for r in rows if doms[r["client"]] == d]) for d in set(doms.values())}
    assert domain_accuracy(e.store, e.run_id) == pytest.approx(by_hand)
    md = "\n".join(domain_table(e.store, collect(e.store)))
    assert "Local accuracy per domain" in md and "1: rot90" in md and "| pfpl |" in md


# -- the mixed label + feature skew protocol ---------------------------------------------------------------------
def _digits_labels():
    from fedprism.data.datasets import load_dataset
    ds = load_dataset("digits")
    return ds.y_train.numpy(), ds.y_test.numpy()


@pytest.mark.parametrize("n", [3, 4, 5])
def test_mixed_protocol_gives_each_client_n_classes_of_one_domain(n):
    from fedprism.data.partition import make_partition
    y_tr, y_te = _digits_labels()
    kw = dict(num_domains=4, min_classes=n, max_classes=n)
    part = make_partition("domain_mix", y_tr, y_te, 12, seed=0, **kw)
    again = make_partition("domain_mix", y_tr, y_te, 12, seed=0, **kw)
    other = make_partition("domain_mix", y_tr, y_te, 12, seed=1, **kw)
    assert all(np.array_equal(a, b) for a, b in zip(part.train + part.test, again.train + again.test))
    assert np.array_equal(part.domains, again.domains) and part.meta == again.meta
    assert any(not np.array_equal(a, b) for a, b in zip(part.train, other.train))
    assert part.domains.shape == (12,) and set(part.domains.tolist()) == {0, 1, 2, 3}   # one domain each
    assert part.meta["client_domains"] == part.domains.tolist()
    for tr, te in zip(part.train, part.test):
        classes = set(y_tr[tr].tolist())
        assert len(classes) == n
        assert len(te) and set(y_te[te].tolist()) <= classes


def test_mixed_protocol_varies_n_and_k_per_client_around_the_average():
    """PFPL's protocol changes n and k per client: n_i uniform in [min_classes, max_classes] (average 3 for
    2..4), and with min_keep = 0.5 client i keeps floor(u_i share) (at least 1) of each class share, one
    u_i ~ U[0.5, 1] per client, drawn after the classes and domains (the same ones as min_keep = 1)."""
    from fedprism.data.partition import make_partition
    y_tr, y_te = _digits_labels()
    kw = dict(num_domains=4, min_classes=2, max_classes=4)
    full = make_partition("domain_mix", y_tr, y_te, 20, seed=0, **kw)
    assert np.array_equal(full.train[0], make_partition("domain_mix", y_tr, y_te, 20, seed=0, min_keep=1.0,
                                                        **kw).train[0])
    kept = make_partition("domain_mix", y_tr, y_te, 20, seed=0, min_keep=0.5, **kw)
    assert np.array_equal(kept.domains, full.domains)
    n = [len(set(y_tr[t].tolist())) for t in full.train]
    assert set(n) == {2, 3, 4} and 2.5 <= np.mean(n) <= 3.5
    ratios = []
    for a, b in zip(full.train, kept.train):
        ca, cb = np.bincount(y_tr[a], minlength=10), np.bincount(y_tr[b], minlength=10)
        assert np.array_equal(ca > 0, cb > 0)                         # the same classes
        held = ca > 0
        assert (cb[held] <= ca[held]).all() and (cb[held] >= np.maximum(np.floor(0.5 * ca[held]), 1)).all()
        lo = np.max(cb[held] / ca[held])                             # u_i is at least the largest kept share ...
        hi = np.min((cb[held] + 1) / ca[held])                       # ... and below every floor's next step
        assert lo <= hi and 0.5 <= hi and lo <= 1
        ratios.append(cb.sum() / ca.sum())
    assert max(ratios) - min(ratios) > 0.2                             # k differs between clients
    # a class share of one sample is kept whatever u_i (at least one sample of a class the client holds)
    y_small = np.repeat(np.arange(10), 3)
    one = make_partition("domain_mix", y_small, y_small, 10, seed=0, num_domains=2, min_classes=3, max_classes=3,
                         min_train=1)
    few = make_partition("domain_mix", y_small, y_small, 10, seed=0, num_domains=2, min_classes=3, max_classes=3,
                         min_train=1, min_keep=0.1)
    assert all(np.bincount(y_small[t], minlength=10).max() == 1 for t in one.train)
    assert [np.bincount(y_small[t], minlength=10).tolist() for t in few.train] == \
        [np.bincount(y_small[t], minlength=10).tolist() for t in one.train]
    with pytest.raises(ConfigError, match=r"partition\.min_keep"):
        cfg(method="pfpl", partition="domain_mix", partition__min_keep=0.0)
    base = cfg(method="pfpl", partition="domain_mix")
    assert base.run_id == cfg(method="pfpl", partition="domain_mix", partition__min_keep=1.0).run_id
    assert base.run_id != cfg(method="pfpl", partition="domain_mix", partition__min_keep=0.5).run_id


def test_mixed_protocol_refuses_impossible_settings_naming_the_field():
    from fedprism.data.partition import make_partition
    from fedprism.errors import PartitionError
    y_tr, y_te = _digits_labels()
    with pytest.raises(PartitionError, match=r"partition\.max_classes = 11 .*at most 10"):
        make_partition("domain_mix", y_tr, y_te, 8, seed=0, min_classes=11, max_classes=11)
    with pytest.raises(PartitionError, match=r"partition\.num_domains"):
        make_partition("domain_mix", y_tr, y_te, 8, seed=0, num_domains=6)
    with pytest.raises(PartitionError, match=r"partition\.max_classes"):
        make_partition("domain_mix", y_tr, y_te, 8, seed=0, min_classes=4, max_classes=3)
    with pytest.raises(ConfigError, match=r"partition\.num_domains"):
        cfg(method="pfpl", partition="domain_mix", partition__num_domains=6)


def test_mixed_protocol_test_split_comes_from_the_clients_domain_and_classes():
    from fedprism.data.domains import apply_domain
    from fedprism.data.datasets import load_dataset
    from fedprism.experiment.federation import build_federation
    c = cfg(method="pfpl", clients=8, partition="domain_mix", partition__num_domains=4, partition__min_classes=3,
            partition__max_classes=3)
    fed = build_federation(c)
    doms = fed.meta["client_domains"]
    base = load_dataset("digits")
    n_tr, n_te = len(base.y_train), len(base.y_test)
    slot = {d: k for k, d in enumerate(sorted(set(doms)))}
    for i, d in enumerate(doms):
        tr, te = fed.train_idx[i], fed.test_idx[i]
        assert set((tr // n_tr).tolist()) == {slot[d]} and set((te // n_te).tolist()) == {slot[d]}
        assert set(fed.y_test[te].tolist()) <= set(fed.y_train[tr].tolist())
        want = apply_domain(base.x_test[te % n_te].numpy(), d, seed=c["seed"] + 1)
        assert np.array_equal(fed.x_test[te].numpy(), want)                 # the client's own transform


def test_validation_sweep_chooses_lambda_at_both_scales_on_varying_n_and_k(tmp_path):
    """sweeps/pfpl_mixed_validation.toml: lambda grids at the sum (the paper's) and mean scales, n 3..5
    and k varying per client, validation rows held out; its quick form runs."""
    from pathlib import Path

    from fedprism.experiment.sweep import load_sweep, run_sweep

    path = Path(__file__).resolve().parents[1] / "sweeps" / "pfpl_mixed_validation.toml"
    _, cfgs = load_sweep(path)
    assert all(c["data.val_fraction"] == 0.1 and c["partition"] == "domain_mix" and c["partition.min_classes"] == 3
               and c["partition.max_classes"] == 5 and c["partition.min_keep"] == 0.5 for c in cfgs)
    pfpl = [c for c in cfgs if c["method"] == "pfpl"]
    lams = {s: sorted(c["pfpl.lam"] for c in pfpl if c["pfpl.align_scale"] == s) for s in ("sum", "mean")}
    assert 1.0 in lams["sum"] and 84.0 in lams["mean"] and 1.0 in lams["mean"] and max(lams["sum"]) == 4.0
    assert [c["method"] for c in cfgs].count("local") == 1
    db = tmp_path / "v.db"
    for only in ("Local", "PFPL sum lambda 1"):
        assert run_sweep(str(path), str(db), only=only, quick=True, progress=False) == 0
    with Store(db) as st:
        assert [r["status"] for r in st.runs()] == ["finished", "finished"]
