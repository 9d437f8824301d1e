"""IFCA, CFL and FedAMP: planted-group recovery, equivalences with FedAvg / Local, invariants."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import planted_federation, same
from sklearn.metrics import adjusted_rand_score

from fedprism.algorithms import REGISTRY
from fedprism.algorithms.base import Context, EvalResult, Inference, Update
from fedprism.algorithms.cfl import CFL
from fedprism.algorithms.fedamp import FedAMP
from fedprism.algorithms.ifca import IFCA, choose, permuted_inits
from fedprism.engine import LocalConfig, SequentialEngine
from fedprism.errors import ConfigError
from fedprism.experiment.evaluate import Evaluator
from fedprism.experiment.runner import Simulator, sample_clients
from fedprism.federation import Federation
from fedprism.models import build_model
from fedprism.params import ParamSpec, flatten

LOCAL = LocalConfig(epochs=1, batch_size=16, lr=0.05, momentum=0.9)
SPLIT = {"eps1": 0.35, "eps2": 0.6, "warmup": 3}     # measured on these federations (record `cfl`)


def setup(fed, method, seed=0, **hp):
    model = build_model("mlp", fed.input_shape, fed.num_classes, seed=seed)
    ctx = Context(fed.num_clients, fed.num_classes, ParamSpec.of(model), flatten(model), fed.n_train,
                  fed.label_hist(), seed, 10, 1.0)
    return REGISTRY[method](ctx, **hp), SequentialEngine(fed, model, LOCAL, seed)


def drive(algo, engine, rounds, fraction=1.0, seed=0, on_round=None):
    """Run `rounds` rounds; returns the Simulator (`sim.state`: server state, `sim.clients.data`: the
    clients' own state, e.g. Local's models)."""
    sim = Simulator(algo, engine)
    for t in range(rounds):
        before = {k: v.clone() for k, v in sim.state.items() if isinstance(v, torch.Tensor)}
        plan, _, rec = sim.round(t, sample_clients(seed, t, algo.ctx.num_clients, fraction))
        if on_round:
            on_round(t, sim.state, plan, rec, before)
    return sim


def iid_federation(ds, clients=10, per_class=6, seed=0) -> Federation:
    """Every client holds per_class samples of every class (equal label mixes)."""
    rng = np.random.default_rng(seed)
    y, yt = ds.y_train.numpy(), ds.y_test.numpy()
    train, test = [[] for _ in range(clients)], [[] for _ in range(clients)]
    for c in range(ds.num_classes):
        p, pt = rng.permutation(np.flatnonzero(y == c)), rng.permutation(np.flatnonzero(yt == c))
        for i in range(clients):
            train[i] += list(p[i * per_class:(i + 1) * per_class])
            test[i] += list(pt[i * 2:(i + 1) * 2])
    return Federation(ds.x_train, ds.y_train, ds.x_test, ds.y_test, [np.sort(t) for t in train],
                      [np.sort(t) for t in test], ds.num_classes, list(ds.classes), "digits-iid")


@pytest.fixture(scope="module")
def planted5(digits):
    return planted_federation(digits, clients_per_group=5, per_client=60)


# -- IFCA -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("init,seed,rounds", [("random", 0, 3), ("warmup", 0, 5)])
def test_ifca_recovers_planted_groups(planted5, init, seed, rounds):
    fed, truth = planted5
    algo, eng = setup(fed, "ifca", seed=seed, k=2, init=init, warmup_rounds=2)
    P = algo.ctx.spec.size
    seen = []

    def on_round(t, state, plan, rec, before):
        warm = init == "warmup" and t < 2
        assert plan.bytes == 4 * (P if warm else 2 * P) * len(plan.clients)     # 1 or K models per client
        if warm:
            assert "clusters" not in rec and torch.equal(state["w"][0], state["w"][1])
        else:
            seen.append(rec["clusters"]["labels"])
            for c in set(range(2)) - set(rec["clusters"]["labels"].tolist()):   # chosen by nobody
                assert torch.equal(state["w"][c], before["w"][c])

    state = drive(algo, eng, rounds, seed=seed, on_round=on_round).state
    assert adjusted_rand_score(truth, seen[-1]) == 1.0
    assert adjusted_rand_score(truth, state["assign"].numpy()) == 1.0


def test_ifca_k1_equals_fedavg(planted5):
    fed, _ = planted5
    a, e = setup(fed, "ifca", k=1)
    b, e2 = setup(fed, "fedavg")
    sa, sb = drive(a, e, 3, fraction=0.5).state, drive(b, e2, 3, fraction=0.5).state
    assert same(sa["w"][0], sb["w"]) and not same(sb["w"], b.ctx.init)


def test_ifca_random_inits_are_independent_permutations(planted5):
    fed, _ = planted5
    algo, _ = setup(fed, "ifca", k=3)
    w, spec = algo.init_state()["w"], algo.ctx.spec
    assert torch.equal(w[0], algo.ctx.init)
    assert not torch.equal(w[1], w[0]) and not torch.equal(w[2], w[1])
    for a, b in zip(spec.offsets[:-1], spec.offsets[1:]):          # same values, tensor by tensor
        assert torch.equal(w[1, a:b].sort().values, w[0, a:b].sort().values)
    assert torch.equal(permuted_inits(algo.ctx.init, spec, 3, 0), w)   # seeded


def test_ifca_ties_are_broken_by_the_seeded_rng():
    clients = np.arange(40)
    losses = np.ones((40, 3))
    a, b = choose(losses, clients, [0, 1]), choose(losses, clients, [0, 1])
    assert np.array_equal(a, b) and set(a.tolist()) == {0, 1, 2}          # not always index 0
    assert not np.array_equal(a, choose(losses, clients, [0, 2]))         # another round, other picks
    losses[:, 2] = 0.5
    assert (choose(losses, clients, [0, 1]) == 2).all()
    # a diverged model's NaN loss is never the choice
    assert choose(np.array([[np.nan, 2.0, 1.0], [1.0, np.nan, 3.0]]), np.arange(2), [0, 1]).tolist() == [2, 0]


def test_ifca_never_sampled_clients_pick_by_train_loss(planted5):
    fed, truth = planted5
    algo, eng = setup(fed, "ifca", k=2)
    sim = drive(algo, eng, 3)
    state = sim.state
    clients = np.arange(fed.num_clients)
    chosen = algo.model_for(state, clients)
    expect = eng.evaluate(chosen, clients, "local")
    assert torch.equal(sim.inference(clients).single, chosen)              # everybody chose: model_for
    assert not torch.equal(state["w"][0], state["w"][1])                   # the choice matters
    state["assign"][[0, 7]] = -1                                            # as if never sampled
    assert torch.equal(sim.inference(clients).single, chosen)              # they pick their group's model
    got = sim.evaluate("local", clients)
    assert torch.equal(got.correct, expect.correct)


# -- CFL ------------------------------------------------------------------------------------------
def test_cfl_splits_planted_groups_once(planted5):
    fed, truth = planted5
    algo, eng = setup(fed, "cfl", **SPLIT)
    splits = []

    def on_round(t, state, plan, rec, before):
        assert len(rec["cfl"]["mean_norm"]) == len(rec["cfl"]["cluster"])
        splits.extend(rec.get("cfl_split", []))
        if "cfl_split" in rec:
            assert t >= SPLIT["warmup"] and rec["cfl_split"][0]["gamma_max"] > 0.5

    state = drive(algo, eng, 10, on_round=on_round).state
    assert len(splits) == 1 and len(state["w"]) == 2
    assert adjusted_rand_score(truth, state["assign"].numpy()) == 1.0
    assert not torch.equal(state["w"][0], state["w"][1])


def test_cfl_does_not_split_an_iid_federation(digits):
    fed = iid_federation(digits)
    algo, eng = setup(fed, "cfl", **SPLIT)
    state = drive(algo, eng, 10).state
    assert len(state["w"]) == 1 and (state["assign"] == 0).all()
    # forced trigger: the gamma certificate alone refuses to split an IID federation
    algo, eng = setup(fed, "cfl", eps1=100.0, eps2=0.0, warmup=1, gamma=0.5)
    assert len(drive(algo, eng, 3).state["w"]) == 1


def _ctx(N, P):
    return Context(N, 2, None, torch.zeros(P), np.full(N, 10), np.zeros((N, 2)), 0, 10, 1.0)


def test_cfl_opposite_updates_split_exactly():
    """Updates +u, +u, -u, -u: mean ~ 0 < eps1, max = ||u|| > eps2."""
    torch.manual_seed(0)
    u = torch.randn(6)
    delta = torch.stack([u, u, -u, -u]) + 1e-4 * torch.randn(4, 6)
    algo = CFL(_ctx(4, 6), eps1=0.1, eps2=0.5 * float(u.norm()), warmup=0)
    state = algo.init_state()
    up = Update(np.arange(4), {"params": delta.clone()}, torch.full((4,), 10.0, dtype=torch.float64),
                sent={"params": torch.zeros(4, 6)})
    rec = algo.aggregate(state, 0, up)
    (s,) = rec["cfl_split"]
    assert s["left"].tolist() == [0, 1] and s["right"].tolist() == [2, 3]
    assert abs(s["gamma_max"] - 1.0) < 1e-6
    assert torch.allclose(state["w"][0], delta[:2].mean(0), atol=1e-6)     # children average their own
    assert torch.allclose(state["w"][1], delta[2:].mean(0), atol=1e-6)
    # next round only cluster 1 participates: cluster 0 stays bit-identical
    w0 = state["w"][0].clone()
    up = Update(np.array([2, 3]), {"params": delta[2:] * 2}, torch.full((2,), 10.0, dtype=torch.float64),
                sent={"params": delta[2:]})
    algo.aggregate(state, 1, up)
    assert torch.equal(state["w"][0], w0)


def _three_against_two(min_size: int, first: int = 3):
    """CFL over 7 clients: the first `first` of clients 0-4 send +u, the others -u; 5-6 were never sampled."""
    u = torch.randn(6, generator=torch.Generator().manual_seed(1))
    half = 0.5 * float(u.norm())
    algo = CFL(_ctx(7, 6), eps1=half, eps2=half, warmup=0, min_size=min_size)
    state = algo.init_state()
    delta = torch.stack([u if i < first else -u for i in range(5)])
    up = Update(np.arange(5), {"params": delta}, torch.full((5,), 10.0, dtype=torch.float64),
                sent={"params": torch.zeros(5, 6)})
    return state, algo.aggregate(state, 0, up)


@pytest.mark.parametrize("first", [3, 2])
def test_cfl_members_without_an_update_join_the_larger_child(first):
    state, rec = _three_against_two(min_size=3, first=first)
    assert len(rec["cfl_split"]) == 1
    a = state["assign"].tolist()
    larger = 0 if first == 3 else 4
    assert a[5] == a[6] == a[larger] and len({a[0], a[4]}) == 2 and sorted(a).count(a[5]) == 5


def test_cfl_splits_only_clusters_of_at_least_min_size_members():
    assert "cfl_split" in _three_against_two(min_size=7)[1]          # the cluster holds all 7 clients
    state, rec = _three_against_two(min_size=8)
    assert "cfl_split" not in rec and state["assign"].tolist() == [0] * 7


# -- FedAMP ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("hp", [{"attention": "cosine", "self_weight": 1.0}, {"alpha_k": 0.0, "sigma": 1.0}])
def test_fedamp_self_weight_one_is_local_training(planted5, hp):
    fed, _ = planted5
    a, e = setup(fed, "fedamp", mu=0.0, **hp)
    b, e2 = setup(fed, "local")
    sa, sb = drive(a, e, 3, fraction=0.5).state, drive(b, e2, 3, fraction=0.5).clients.data
    assert torch.equal(sa["w"], sb["w"])                               # Local's models are client state


def test_fedamp_uniform_attention_is_fedavg(planted5):
    fed, _ = planted5
    N = fed.num_clients
    a, e = setup(fed, "fedamp", attention="cosine", sigma=0.0, self_weight=1.0 / N, mu=0.0)
    b, e2 = setup(fed, "fedavg", weighting="uniform")
    sa, sb = drive(a, e, 3).state, drive(b, e2, 3).state
    assert same(sa["w"].double().mean(0).float(), sb["w"])
    assert not same(sa["w"][0], sa["w"][N - 1])                        # models stay personalized


@pytest.mark.parametrize("attention", ["distance", "cosine"])
def test_fedamp_attention_rows_and_auto_sigma(planted5, attention):
    """sigma=auto is set once, after round 0, from its definition on the uploaded models (distance: the
    median off-diagonal ||w_i - w_j||^2; cosine: 1 / median off-diagonal (1 - cos)); the attention rows
    sum to 1 and favour the client's own planted group."""
    fed, truth = planted5
    algo, eng = setup(fed, "fedamp", attention=attention)
    recs, w0 = [], []

    def on_round(t, s, p, rec, b):
        recs.append(rec)
        if t == 0:
            w0.append(s["w"].double().numpy().copy())

    state = drive(algo, eng, 3, on_round=on_round).state
    assert recs[0]["fedamp"]["sigma"] == state["sigma"] > 0                # set once, at round 0
    (w,) = w0
    off = ~np.eye(len(w), dtype=bool)
    if attention == "distance":
        expect = np.median(((w[:, None, :] - w[None, :, :]) ** 2).sum(-1)[off])
    else:
        v = w / np.linalg.norm(w, axis=1, keepdims=True)
        expect = 1.0 / np.median(1.0 - (v @ v.T)[off])
    assert state["sigma"] == pytest.approx(expect, rel=1e-9)
    assert all("fedamp" not in r for r in recs[1:])
    clients = np.arange(fed.num_clients)
    xi, peers = algo.attention(state, clients)
    assert np.array_equal(peers, clients) and (xi >= 0).all() and np.allclose(xi.sum(1), 1.0)
    same_group = truth[:, None] == truth[None, :]
    off = ~np.eye(len(clients), dtype=bool)
    assert xi[off & same_group].mean() > 10 * xi[off & ~same_group].mean()   # attends to its own group
    assert np.diag(xi).max() < 0.99                                          # not Local training
    # all client vectors equal -> u_i = w_i
    state["w"][:] = state["w"][0]
    xi, _ = algo.attention(state, clients)
    u = torch.as_tensor(xi) @ state["w"].double()
    assert torch.allclose(u.float(), state["w"])


def test_fedamp_plan_uses_prox_to_the_cloud_model(planted5):
    fed, _ = planted5
    algo, eng = setup(fed, "fedamp", mu=0.5)
    state = drive(algo, eng, 1).state
    plan = algo.plan(state, 1, np.arange(4))
    assert set(plan.payload) == {"params"}                             # start = cloud: u_i only
    jobs = []

    class Spy:                                                         # the engine, recording each job
        def __getattr__(self, name):
            return getattr(eng, name)

        def train(self, job, rnd):
            jobs.append(job)
            return eng.train(job, rnd)

    update = algo.client_update(plan, Spy(), 1, {})
    (job,) = jobs
    assert job.loss == "prox" and torch.equal(job.start, plan.start)
    assert torch.equal(job.extras["anchor"], plan.start)
    assert torch.equal(job.extras["mu"], torch.full((4,), 0.5))
    assert torch.equal(update.params, eng.train(job, 1).params)


# -- parameters -------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls,bad,key", [
    (IFCA, {"k": 0}, "ifca.k"), (IFCA, {"init": "kmeans"}, "ifca.init"),
    (IFCA, {"warmup_rounds": 0}, "ifca.warmup_rounds"), (IFCA, {"weighting": "x"}, "ifca.weighting"),
    (IFCA, {"kk": 2}, "ifca.kk"),
    (CFL, {"eps1": -1}, "cfl.eps1"), (CFL, {"eps2": "big"}, "cfl.eps2"), (CFL, {"gamma": 1.0}, "cfl.gamma"),
    (CFL, {"min_size": 1}, "cfl.min_size"), (CFL, {"bipartition": "single"}, "cfl.bipartition"),
    (FedAMP, {"self_weight": 1.5}, "fedamp.self_weight"), (FedAMP, {"sigma": "big"}, "fedamp.sigma"),
    (FedAMP, {"sigma": 0.0}, "fedamp.sigma"), (FedAMP, {"alpha_k": -1}, "fedamp.alpha_k"),
    (FedAMP, {"mu": -0.1}, "fedamp.mu"), (FedAMP, {"attention": "dot"}, "fedamp.attention"),
])
def test_invalid_parameters_name_the_key(cls, bad, key):
    with pytest.raises(ConfigError) as e:
        cls.resolve(bad)
    assert f"'{key}'" in str(e.value)


def test_fedamp_alpha_k_bound_needs_the_federation():
    assert FedAMP(_ctx(11, 3), sigma=1.0, alpha_k=0.1).hp["alpha_k"] == 0.1      # = sigma/(N-1)
    with pytest.raises(ConfigError) as e:
        FedAMP(_ctx(11, 3), sigma=1.0, alpha_k=0.2)
    assert "'fedamp.alpha_k'" in str(e.value) and "sigma/(N-1)" in str(e.value)
    amp = FedAMP(_ctx(11, 3), sigma="auto", alpha_k=5.0)
    assert amp.hp["alpha_k"] == 5.0                         # kept: the bound needs sigma, not known yet
    st = amp.init_state()
    st["sigma"], st["known"][:] = 2.0, True                  # once sigma is known, alpha_k is capped there
    xi, _ = amp.attention(st, np.arange(11))                # equal models: A'(0) = 1/sigma for every pair
    off = ~np.eye(11, dtype=bool)
    assert np.allclose(xi[off], (2.0 / 10) / 2.0) and np.allclose(np.diag(xi), 0.0)   # min(5, sigma/(N-1))


@pytest.mark.parametrize("method,hp", [("ifca", {"k": 2}), ("cfl", {"eps1": 10.0, "eps2": 0.0, "warmup": 1}),
                                       ("fedamp", {"mu": 0.5})])
def test_vectorized_engine_gives_the_same_states(planted5, method, hp):
    from fedprism.engine.vectorized import VectorizedEngine

    fed, _ = planted5
    algo, seq = setup(fed, method, **hp)
    vec = VectorizedEngine(fed, build_model("mlp", fed.input_shape, fed.num_classes, seed=0), LOCAL, 0, "cpu",
                           compile=False)
    a, b = drive(algo, seq, 3, fraction=0.5).state, drive(algo, vec, 3, fraction=0.5).state
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert v.shape == b[k].shape and same(v.float(), b[k].float(), atol=1e-4), k


def test_evaluator_scores_each_distinct_global_row_once():
    """Identical model rows (100 clients holding K cluster models) are scored once on the shared global
    test set: K evaluations, not 100; every client's own local split is scored. Exact."""
    calls = []

    class Fake:
        def evaluate(self, params, clients, split):
            calls.append((split, len(params)))
            n = len(params)
            acc = params[:, 0].round().long()           # a score that depends on the row only
            return EvalResult(acc, acc.double(), torch.full((n,), 10), torch.zeros(n, 2, 2, dtype=torch.long))

    rows = torch.tensor([[3.0, 1], [5, 2], [3, 1], [5, 2], [7, 0]])
    ev = Evaluator(Fake(), 5)
    got = ev.score(Inference({"model": rows}))
    assert calls == [("local", 5), ("global", 3)]
    assert got.global_acc.tolist() == [0.3, 0.5, 0.3, 0.5, 0.7] == got.local_acc.tolist()
    assert got.evaluated == 8


def test_fedamp_neighbours_are_clients_that_have_uploaded():
    # client 0 uploaded before; clients 1 and 2 are in this cohort for the first time: each attends to 0
    # (and itself) only, never to the other newcomer's untrained model
    amp = FedAMP(_ctx(4, 3), sigma=1.0, alpha_k=0.2)
    state = amp.init_state()
    state["w"][0] = torch.tensor([1.0, 0.0, 0.0])
    state["known"][0] = True
    xi, peers = amp.attention(state, np.array([1, 2]))
    assert peers.tolist() == [0, 1, 2]
    assert xi[0, 2] == 0.0 and xi[1, 1] == 0.0 and xi[0, 0] > 0 and xi[1, 0] > 0
    assert np.allclose(xi.sum(1), 1.0)


def test_fedamp_cosine_attention_stays_finite_with_a_sharp_kernel():
    # sigma = 1e4: exp(-sigma (1 - cos)) underflows for every neighbour unless the softmax is shifted by
    # the row's smallest 1 - cos; the neighbours' weights must still sum to 1 - self_weight
    amp = FedAMP(_ctx(3, 2), attention="cosine", sigma=1e4, self_weight=0.25)
    state = amp.init_state()
    state["w"] = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.0, 1.0]])
    state["known"][:] = True
    xi, _ = amp.attention(state, np.array([0]))
    assert xi[0, 0] == pytest.approx(0.25) and xi[0, 1] == pytest.approx(0.75) and xi[0, 2] < 1e-300


def test_fedamp_auto_sigma_waits_while_the_known_models_are_equal():
    amp = FedAMP(_ctx(3, 2))
    state = amp.init_state()
    state["known"][:2] = True                                       # two uploads, the same model
    assert amp._auto_sigma(state) is None
    state["w"][1] = torch.tensor([3.0, 4.0])
    assert amp._auto_sigma(state) == pytest.approx(25.0)            # the one squared distance
