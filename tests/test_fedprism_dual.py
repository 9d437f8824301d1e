"""FedPrism paper method (fedprism_dual): FedAvg equivalence, routing limits, privacy of P_i / L_i,
alpha bounds and mixing rows, components, engines, runner (bytes, resume)."""

from __future__ import annotations

import copy
import warnings
from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import planted_federation, same, unequal_federation
from sklearn.metrics import adjusted_rand_score

import fedprism.experiment.evaluate as evaluate_mod
from fedprism.algorithms import REGISTRY
from fedprism.algorithms.base import Context, TrainJob
from fedprism.algorithms.fedprism_dual import COMPONENTS, DIAGNOSTIC_TEMPERATURES, FedPrismDual, route
from fedprism.engine import LocalConfig, SequentialEngine
from fedprism.engine.vectorized import VectorizedEngine
from fedprism.errors import ConfigError
from fedprism.experiment.config import resolve
from fedprism.experiment.evaluate import StreamScorer, score_inference
from fedprism.experiment.runner import Experiment, Simulator, sample_clients
from fedprism.experiment.store import Store
from fedprism.models import build_model
from fedprism.params import ParamSpec, flatten
from fedprism.report import write_report

LOCAL = LocalConfig(epochs=1, batch_size=16, lr=0.05, momentum=0.9)


def setup(fed, method="fedprism_dual", seed=0, engine="sequential", **hp):
    model = build_model("mlp", fed.input_shape, fed.num_classes, seed=seed)
    ctx = Context(fed.num_clients, fed.num_classes, ParamSpec.of(model), flatten(model), fed.n_train,
                  fed.label_hist(), seed, 5, 1.0)
    algo = REGISTRY[method](ctx, **hp)
    eng = SequentialEngine(fed, model, LOCAL, seed) if engine == "sequential" else \
        VectorizedEngine(fed, model, LOCAL, seed, "cpu", compile=False)
    return algo, eng


def drive(algo, engine, rounds, fraction=1.0, seed=0, on_round=None):
    """Run `rounds` rounds; the Simulator holds the server state (`sim.state`) and the clients' own
    P_i / L_i (`sim.clients.data`)."""
    sim = Simulator(algo, engine)
    for t in range(rounds):
        clients = sample_clients(seed, t, algo.ctx.num_clients, fraction)
        plan, update, rec = sim.round(t, clients)
        if on_round:
            on_round(t, sim.state, plan, update, rec)
    return sim


@pytest.fixture(scope="module")
def unequal(digits):
    return unequal_federation(digits)


@pytest.fixture(scope="module")
def trained(unequal):
    """Default fedprism_dual after 2 rounds (shared by the read-only tests)."""
    algo, eng = setup(unequal, k=2, every=1)
    return algo, eng, drive(algo, eng, 2)


def backbone_and_expert(sim, clients):
    """The two streams a client predicts with: W_i = shared part + gamma_i P_i, and L_i."""
    inf = sim.inference(clients)
    return inf.streams["backbone"], inf.streams["expert"]


def test_beta0_fixed_alpha1_backbone_is_fedavg(unequal):
    a, e = setup(unequal, alpha=1.0, beta=0.0, alpha_mode="fixed", k=2, every=1)
    b, e2 = setup(unequal, "fedavg", weighting="samples")
    starts = []
    sim_a = drive(a, e, 3, fraction=0.5, on_round=lambda t, s, p, u, r: starts.append(p.start.clone()))
    sa, sb = sim_a.state, drive(b, e2, 3, fraction=0.5).state
    assert torch.equal(sa["w_g"], sb["w"])
    assert torch.equal(a.model_for(sa, np.arange(6)), sb["w"].expand(6, -1))
    assert torch.equal(backbone_and_expert(sim_a, np.arange(6))[0], sb["w"].expand(6, -1))   # gamma_i P_i = 0
    assert not same(sb["w"], b.ctx.init)                      # something was trained
    assert not a.uses_private                                 # P_i has weight 0 forever: not trained
    assert torch.equal(sim_a.clients.data["private"], a.ctx.init.expand(6, -1))


def test_fixed_inference_weight_0_is_the_backbone_and_1_the_expert(trained):
    algo, eng, sim = trained
    clients = np.arange(algo.ctx.num_clients)
    backbone, expert = backbone_and_expert(sim, clients)
    assert torch.equal(expert, sim.clients.data["expert"])
    refs = {0.0: backbone, 1.0: expert}
    try:
        for w, params in refs.items():
            algo.hp["inference_weight"] = w
            inf = sim.inference(clients)
            assert torch.equal(inf.single, params)                # one stream: that model alone
            for split in ("local", "global"):
                ref = eng.evaluate(params, clients, split)
                # the runner's path (exact engine evaluation) and the stream scorer's logits path
                scorer = StreamScorer(eng, len(clients))
                for got in (sim.evaluate(split, clients), scorer(inf, clients, split)):
                    assert torch.equal(got.correct, ref.correct) and torch.equal(got.count, ref.count)
                    assert torch.equal(got.confusion, ref.confusion)
                    assert torch.allclose(got.loss_sum, ref.loss_sum, rtol=1e-4, atol=1e-3)
        # the two streams really differ here, so the test above can tell them apart
        assert not torch.equal(eng.evaluate(refs[0.0], clients, "global").confusion,
                               eng.evaluate(refs[1.0], clients, "global").confusion)
    finally:
        algo.hp["inference_weight"] = None


def test_diagnostic_streams_and_temperatures_equal_their_own_evaluations(trained):
    """The `alternatives` of a routed evaluation are exactly what a separate evaluation of each stream
    (weight 0 / 1) and of each other temperature gives, on both splits."""
    algo, eng, sim = trained
    clients = np.arange(algo.ctx.num_clients)
    T0 = algo.hp["inference_temperature"]
    others = [t for t in DIAGNOSTIC_TEMPERATURES if t != T0]
    for split in ("local", "global"):
        alt = sim.evaluate(split, clients).alternatives
        rules = {"margin", "seen_mass", "prior"}                                    # the other routing rules
        assert set(alt) == {"backbone", "expert"} | {f"T={t:g}" for t in others} | rules   # T0 is the headline
        cases = [("backbone", {"inference_weight": 0.0}), ("expert", {"inference_weight": 1.0})]
        cases += [(f"T={t:g}", {"inference_temperature": t}) for t in (others[0], others[-1])]
        cases += [(r, {"routing": r}) for r in sorted(rules)]
        try:
            for name, hp in cases:
                algo.hp.update(hp)
                assert torch.equal(alt[name], sim.evaluate(split, clients).correct), (split, name)
                algo.hp.update(inference_weight=None, inference_temperature=T0, routing="confidence")
        finally:
            algo.hp.update(inference_weight=None, inference_temperature=T0, routing="confidence")
    assert not torch.equal(alt["backbone"], alt["expert"])      # the streams differ: the test can fail


def test_global_expert_logit_cache_is_exact(unequal, monkeypatch):
    algo, eng = setup(unequal, k=2, every=1)
    sim = drive(algo, eng, 1)
    clients = np.arange(6)
    scorer = StreamScorer(eng, 6)
    scorer(sim.inference(clients), clients, "global")                     # fills the cache
    assert {"expert", "backbone"} <= set(scorer.caches)
    sub = np.array([1, 4])
    sim.round(1, sub)                                                     # 2 specialists change
    cached = scorer(sim.inference(clients), clients, "global")
    runs = []
    real_run = scorer._run
    monkeypatch.setattr(scorer, "_run", lambda params, *a: runs.append(len(params)) or real_run(params, *a))
    again = scorer(sim.inference(clients), clients, "global")            # nothing changed: nothing recomputed
    assert runs == [] and torch.equal(again.correct, cached.correct)
    monkeypatch.setattr(evaluate_mod, "STREAM_CACHE_BYTES", 0)            # no cache: everything recomputed
    fresh = scorer(sim.inference(clients), clients, "global")
    assert torch.equal(cached.correct, fresh.correct) and torch.equal(cached.confusion, fresh.confusion)
    assert torch.allclose(cached.loss_sum, fresh.loss_sum, rtol=1e-6)


def test_confidence_routing_formula():
    torch.manual_seed(0)
    z_e, z_b = torch.randn(3, 7, 4), torch.randn(3, 7, 4)
    lam = torch.softmax(z_e / 2.0, -1).max(-1, keepdim=True).values
    assert torch.allclose(route(z_e, z_b, None, 2.0), lam * z_e + (1 - lam) * z_b)
    assert ((lam >= 0.25) & (lam <= 1)).all()
    assert torch.equal(route(None, z_b, 0.0), z_b) and torch.equal(route(z_e, None, 1.0), z_e)
    assert torch.allclose(route(z_e, z_b, 0.2), 0.2 * z_e + 0.8 * z_b)


def test_private_and_expert_never_travel(unequal):
    algo, eng = setup(unequal, alpha=0.5, beta=0.2, k=2, every=1)       # gamma = 0.3 > 0
    P, n = algo.ctx.spec.size, unequal.num_clients
    sim = drive(algo, eng, 1)                                             # P_i, L_i now trained
    state, store = sim.state, sim.clients.data
    assert not {"private", "expert"} & set(state)                         # the server does not hold them
    clients = np.array([0, 2, 3, 5])
    S = torch.as_tensor(clients)
    plan = algo.plan(state, 1, clients)
    assert set(plan.payload) == {"params", "gamma"} and plan.payload["gamma"].shape == (4,)
    assert plan.bytes == 4 * (P + 1) * 4                                  # P + 1 floats per client
    # the message does not depend on the client-side store at all
    saved = {k: store[k].clone() for k in ("private", "expert")}
    store["private"][S] = torch.randn(4, P)
    store["expert"][S] = torch.randn(4, P)
    again = algo.plan(state, 1, clients)
    assert torch.equal(again.start, plan.start) and torch.equal(again.payload["gamma"], plan.payload["gamma"])
    for k in saved:
        store[k].copy_(saved[k])
    a, b, g = algo.mixing(state["alpha"][S])
    assert torch.allclose(plan.payload["gamma"].double(), g.float().double())
    mix = state["W"][S] @ state["w_c"].double()
    shared = (a[:, None] * state["w_g"].double() + b[:, None] * mix).float()
    assert torch.allclose(plan.start, shared, atol=1e-6)

    sent, update, _ = sim.round(1, clients)                               # the same plan, then the round
    assert torch.equal(sent.start, plan.start) and torch.equal(sent.payload["gamma"], plan.payload["gamma"])
    assert set(update.payload) == {"params"} and update.bytes == 4 * P * 4   # P floats per client up
    assert update.params.shape == (4, P) and set(update.metrics) <= {"train_loss"} and not update.rejected
    assert torch.equal(update.start, plan.start)
    # Update.params are the trained backbones, built from the new P_i (trained on its own stream)
    new_p = eng.train(TrainJob(clients, saved["private"][S].clone(), stream="private"), 1).params
    new_l = eng.train(TrainJob(clients, saved["expert"][S].clone(), stream="expert"), 1).params
    assert torch.equal(store["private"][S], new_p) and torch.equal(store["expert"][S], new_l)
    start = (plan.start.double() + plan.payload["gamma"].double()[:, None] * new_p.double()).float()
    assert torch.equal(update.params, eng.train(TrainJob(clients, start), 1).params)
    for rows in (store["private"][S], store["expert"][S], saved["private"][S], saved["expert"][S]):
        assert (torch.cdist(update.params, rows) > 1e-3).all()
        assert (torch.cdist(plan.start, rows) > 1e-3).all()
    assert n == 6


def test_alpha_clipped_and_every_mixing_row_sums_to_one(planted):
    fed, _ = planted
    beta = 0.2
    algo, eng = setup(fed, alpha=0.7, beta=beta, k=3, every=1, alpha_lr=50.0, alpha_signal="raw")
    seen = []

    def check(t, state, plan, update, rec):
        al = state["alpha"]
        assert ((al >= 0) & (al <= 1 - beta + 1e-12)).all()
        W = state["W"]
        assert torch.allclose(W.sum(1), torch.ones(len(W), dtype=W.dtype)) and (W >= 0).all()
        a, b, g = algo.mixing(al)
        rows = torch.cat([a[:, None], b[:, None] * W, g[:, None]], 1)
        assert (rows >= 0).all() and torch.allclose(rows.sum(1), torch.ones(len(rows), dtype=rows.dtype))
        seen.append(rec["alpha"]["alpha"])

    drive(algo, eng, 3, fraction=0.5, on_round=check)
    vals = np.concatenate(seen)
    assert vals.min() == 0.0 or vals.max() == pytest.approx(1 - beta)   # the clip did work


@pytest.mark.parametrize("components", COMPONENTS)
def test_components_mix_what_they_say(unequal, components):
    algo, eng = setup(unequal, components=components, alpha=0.6, beta=0.1, k=2, every=1, m=1)
    sim = drive(algo, eng, 1)
    state, private = sim.state, sim.clients.data["private"]
    clients = np.arange(6)
    S = torch.as_tensor(clients)
    W_c = (state["W"] @ state["w_c"].double()).float()
    expect = {
        "full": None,
        "pure_global": state["w_g"].expand(6, -1),
        "global_cluster": (0.6 * state["w_g"].double() + 0.4 * W_c.double()).float(),
        "pure_cluster": W_c,
        "pure_private": private[S],
    }[components]
    got = backbone_and_expert(sim, clients)[0]                   # the backbone W_i the client predicts with
    a, b, g = algo.mixing(state["alpha"])
    if expect is None:
        expect = (a[:, None] * state["w_g"].double() + b[:, None] * W_c.double()
                  + g[:, None] * private.double())
    assert torch.allclose(got, expect.float(), atol=1e-5)
    # the server's part (model_for, the payload) is the backbone without gamma_i P_i
    shared = (a[:, None] * state["w_g"].double() + b[:, None] * W_c.double()).float()
    assert torch.allclose(algo.model_for(state, clients), shared, atol=1e-5)
    assert algo.uses_private == (components in ("full", "pure_private"))
    assert ((state["W"] > 0).sum(1) == 1).all()                  # m = 1 after the round-0 clustering


def test_planted_groups_clustered_on_last_layer(digits):
    fed, truth = planted_federation(digits, clients_per_group=4, per_client=60)
    algo, eng = setup(fed, k=2, every=1, m=1)
    labels = []
    drive(algo, eng, 2, on_round=lambda t, s, p, u, r: labels.append(np.asarray(r["clusters"]["labels"])))
    assert all(adjusted_rand_score(truth, lab) == 1.0 for lab in labels)
    assert np.array_equal(labels[0], labels[1])                  # identity kept (Hungarian matching, as in the Fed-PRISM technical report)


def test_warmup_every_and_seen_cache(planted):
    fed, _ = planted
    algo, eng = setup(fed, k=2, every=2, warmup=1, cluster_on="seen")
    assert [t for t in range(7) if algo._recluster_due(t)] == [1, 3, 5]
    got = {}
    drive(algo, eng, 2, fraction=0.5, on_round=lambda t, s, p, u, r: got.update({t: r}))
    assert "clusters" not in got[0] and "clusters" in got[1]
    seen = set(sample_clients(0, 0, 12, 0.5)) | set(sample_clients(0, 1, 12, 0.5))
    assert set(got[1]["clusters"]["clients"]) == seen            # every client seen so far


def test_vectorized_engine_matches_sequential(unequal):
    """Both engines, and the vectorized engine fusing the specialist and private trainings into one pass
    (`fuse_jobs`, the CUDA default): the same states and scores."""
    out, passes = [], []
    for engine in ("sequential", "vectorized", "fused"):
        algo, eng = setup(unequal, engine="sequential" if engine == "sequential" else "vectorized",
                          k=2, every=1, alpha=0.6, beta=0.2)
        if engine == "fused":
            eng.fuses_jobs, train = True, eng.train
            eng.train = lambda job, rnd: passes.append(len(job.clients)) or train(job, rnd)
        sim = drive(algo, eng, 2, fraction=0.5)
        out.append(({**sim.state, **sim.clients.data}, sim.evaluate("local", np.arange(6)),
                    sim.evaluate("global", np.arange(6))))
    assert passes == [6, 3] * 2                  # per round: specialists + private parts, then backbones
    s1, l1, g1 = out[0]
    for s2, l2, g2 in out[1:]:
        for k in ("w_g", "w_c", "private", "expert", "alpha", "W"):
            assert same(s1[k].float(), s2[k].float(), atol=1e-4), k
        for a, b in ((l1, l2), (g1, g2)):
            assert (a.correct - b.correct).abs().max() <= 1
            assert torch.allclose(a.loss_sum, b.loss_sum, rtol=1e-3, atol=1e-2)


def test_runner_bytes_records_and_resume(tmp_path):
    raw = dict(dataset="digits", clients=6, rounds=3, fraction=0.5, local_epochs=1, batch_size=16, lr=0.05,
               partition="dirichlet", engine="sequential", method="fedprism_dual",
               **{"partition.alpha": 0.5, "fedprism_dual.k": 2, "fedprism_dual.every": 1,
                  "fedprism_dual.inference_weight": "auto"})
    c = resolve(raw)
    assert c["fedprism_dual.inference_weight"] is None
    full_store = Store(tmp_path / "a.db")
    full = Experiment(c, full_store).run()
    P = Experiment(c, Store(tmp_path / "x.db")).ctx.spec.size
    hist = full_store.round_metrics(c.run_id)
    assert all(h["bytes_down"] == 4 * (P + 1) * 3 and h["bytes_up"] == 4 * P * 3 for h in hist)
    assert full_store.records(c.run_id, "alpha") and full_store.records(c.run_id, "clusters")
    assert 0 <= full.final["local_acc"] <= 1 and "global_model_acc" in hist[-1]
    assert {"local_acc@backbone", "global_acc@expert", "global_acc@T=10"} <= set(hist[-1])
    assert full.final["global_acc@T=10"] == hist[-1]["global_acc@T=10"]     # kept in the run's final
    write_report(str(tmp_path / "a.db"), str(tmp_path / "rep"), plots=False)
    md = (tmp_path / "rep" / "results.md").read_text()
    f = full.final
    assert f"| backbone alone | {100 * f['global_acc@backbone']:.2f} | {100 * f['local_acc@backbone']:.2f} |" in md
    assert f"| routed, T=5 (headline) | {100 * f['global_acc']:.2f} | {100 * f['local_acc']:.2f} |" in md
    s = Store(tmp_path / "b.db")
    assert Experiment(c, s).run(stop_after=1).status == "interrupted"
    resumed = Experiment(c, s).run()
    assert resumed.resumed_from == 0
    for k in ("local_acc", "global_acc", "global_model_acc"):
        assert resumed.final[k] == pytest.approx(full.final[k], abs=1e-9)


@pytest.mark.parametrize("bad,key", [({"alpha": 0.95, "beta": 0.1}, "alpha"), ({"m": 3, "k": 2}, "m"),
                                     ({"inference_weight": 1.5}, "inference_weight"),
                                     ({"clustering": "covariance"}, "clustering"),
                                     ({"components": "pure"}, "components"), ({"alpha_lr": -1}, "alpha_lr")])
def test_invalid_parameters_name_the_key(bad, key):
    with pytest.raises(ConfigError) as e:
        FedPrismDual.resolve(bad)
    assert f"fedprism_dual.{key}" in str(e.value)


def test_parameter_normalisation():
    assert FedPrismDual.resolve({"inference_weight": "auto"})["inference_weight"] is None
    assert FedPrismDual.resolve({"inference_weight": 1})["inference_weight"] == 1.0
    # global_cluster mixes (alpha, 1 - alpha, 0): beta is unused, so alpha + beta > 1 is fine
    assert FedPrismDual.resolve({"components": "global_cluster", "alpha": 0.95})["alpha"] == 0.95


@pytest.mark.slow
def test_compiled_engine_evaluation_equals_eager(unequal):
    """The compiled `logits` path (shared-chunk batches) scores like the eager one (float reassociation
    may flip at most one near-tie prediction)."""
    algo, eng = setup(unequal, k=2, every=1, alpha=0.6, beta=0.2)
    sim = drive(algo, eng, 2, fraction=0.5)
    clients = np.arange(6)
    model = build_model("mlp", unequal.input_shape, unequal.num_classes, seed=0)
    res = {}
    for compiled in (False, True):
        v = VectorizedEngine(unequal, model, LOCAL, 0, "cpu", compile=compiled, eval_models=4, eval_samples=64)
        inf = algo.inference(v, clients, algo.eval_payload(sim.state, clients), sim.clients.rows(clients))
        res[compiled] = [score_inference(v, StreamScorer(v, 6), inf, clients, split)
                         for split in ("local", "global")]
    for a, b in zip(res[False], res[True]):
        assert (a.correct - b.correct).abs().max() <= 1 and torch.equal(a.count, b.count)
        assert torch.allclose(a.loss_sum, b.loss_sum, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("rule,gamma1", [("reading", 0.4 / 3), ("as_printed", 0.35 / 3)])
def test_alpha_trajectory_by_hand(rule, gamma1, tmp_path):
    """The report's alpha / gamma trajectory: latest alpha of every client updated so far, gamma =
    1 - alpha - beta clamped at 0 (unclamped when the lines are read as printed)."""
    from fedprism.algorithms.fedprism_dual.report import alpha_table, alpha_trajectory, plot_alpha

    class Recs:
        def records(self, run_id, kind):
            return [{"round": 0, "data": {"clients": [0, 1], "alpha": [0.9, 0.8]}},
                    {"round": 1, "data": {"clients": [1, 2], "alpha": [0.5, 0.95]}}] if kind == "alpha" else []

    cfg = {"clients": 4, "seed": 3, "method": "fedprism_dual", "fedprism_dual.beta": 0.1,
           "fedprism_dual.components": "full", "fedprism_dual.alpha_rule": rule}
    run = {"run_id": "r", "config": cfg}
    t = alpha_trajectory(Recs(), run)
    assert t["round"].tolist() == [1, 2] and t["seen"].tolist() == [2, 3]
    assert t["mean"] == pytest.approx([0.85, (0.9 + 0.5 + 0.95) / 3])
    assert t["min"].tolist() == [0.8, 0.5] and t["max"].tolist() == [0.9, 0.95]
    assert t["gamma"] == pytest.approx([0.05, gamma1])
    md = "\n".join(alpha_table(Recs(), {"s": {"FedPrism": [run]}}))
    assert "| FedPrism | s | 3 | 2 | 0.7833 [0.5000, 0.9500] |" in md
    assert plot_alpha(Recs(), run, tmp_path, "FedPrism", "a.png")[0].stat().st_size > 1000


def test_private_source_specialist_is_the_own_private_on_the_specialists_batch_order(unequal):
    """P_i = L_i (`private_source=specialist`) is exactly the separate private model trained on the
    specialist's batch order: Algorithm 1 lines 7 and 10 are one update; one training fewer per client."""
    runs = {}
    for src in ("own", "specialist"):
        algo, eng = setup(unequal, alpha=0.5, beta=0.2, k=2, every=1, private_source=src)   # gamma = 0.3
        calls = []
        orig = eng.train

        def train(job, rnd, orig=orig, calls=calls):
            calls.append(job.stream)
            return orig(replace(job, stream="expert") if job.stream == "private" else job, rnd)

        eng.train = train
        sim = drive(algo, eng, 3, fraction=0.5)
        runs[src] = (sim, calls, algo)
    (own, own_calls, _), (shared, shared_calls, algo) = runs["own"], runs["specialist"]
    assert set(shared.clients.data) == {"expert"} and set(own.clients.data) == {"private", "expert"}
    assert own_calls.count("private") == 3 and "private" not in shared_calls
    assert len(shared_calls) == 2 * 3 and len(own_calls) == 3 * 3
    for k in ("w_g", "w_c", "alpha", "W"):
        assert torch.equal(own.state[k], shared.state[k]), k
    assert torch.equal(own.clients.data["private"], shared.clients.data["expert"])
    clients = np.arange(unequal.num_clients)
    for a, b in zip(backbone_and_expert(own, clients), backbone_and_expert(shared, clients)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("chunk,per", [(7, 2), (1000, 4)])
def test_batched_own_splits_equal_the_per_client_loop(unequal, chunk, per):
    """On CUDA the stream scorer scores clients' own splits many clients per call (per-client inputs,
    padded and masked; `StreamScorer.batch_own`). Forced here on the CPU, with groups of `per` clients
    and windows of `chunk` rows (clients of 7..90 train rows: several windows, a ragged last group),
    it gives the per-client loop's counts, confusion matrices, alternatives and losses."""
    algo, eng = setup(unequal, engine="vectorized", k=2, every=1)
    sim = drive(algo, eng, 2)
    clients = np.array([5, 0, 3, 1, 4])
    inf = sim.inference(clients)
    loop, batched = StreamScorer(eng, 6), StreamScorer(eng, 6)
    assert not loop.batch_own                                          # the CPU default: the loop
    batched.batch_own = True
    for sc in (loop, batched):
        sc.chunk, sc.budget = chunk, chunk * per * len(inf.streams)
    for split in ("local", "train"):
        a, b = loop(inf, clients, split), batched(inf, clients, split)
        assert torch.equal(a.count, b.count) and torch.equal(a.correct, b.correct), split
        assert torch.equal(a.confusion, b.confusion)
        assert a.alternatives.keys() == b.alternatives.keys()
        assert all(torch.equal(a.alternatives[k], b.alternatives[k]) for k in a.alternatives)
        assert torch.allclose(a.loss_sum, b.loss_sum, rtol=1e-5, atol=1e-4)
        assert a.count.tolist() == [len(eng.data(int(c), split)[1]) for c in clients]
    assert not torch.equal(a.alternatives["backbone"], a.alternatives["expert"])   # the streams differ


def test_shared_set_caches_refreshed_in_groups(unequal):
    """The global test set's per-stream logit caches are refreshed in groups of the engine's width. With
    groups of 2 models and windows of 7 test rows, the first evaluation (every row stale) and a second one
    after the rows of three non-adjacent clients changed (only those refreshed) give the numbers of a
    scorer that computes everything in one group."""
    algo, eng = setup(unequal, engine="vectorized", k=2, every=1)
    sim = drive(algo, eng, 2)
    clients = np.arange(6)
    inf = sim.inference(clients)
    grouped = StreamScorer(eng, 6)
    grouped.chunk, grouped.budget = 7, 7 * 2

    def check(inf):
        a, b = grouped(inf, clients, "global"), StreamScorer(eng, 6)(inf, clients, "global")
        assert torch.equal(a.correct, b.correct) and torch.equal(a.confusion, b.confusion)
        assert all(torch.equal(a.alternatives[k], b.alternatives[k]) for k in b.alternatives)
        assert torch.allclose(a.loss_sum, b.loss_sum, rtol=1e-5, atol=1e-4)
        return a

    first = check(inf)
    expert = inf.streams["expert"].clone()
    expert[[1, 4, 5]] = inf.streams["backbone"][[1, 4, 5]].to(expert.dtype)
    run, models = grouped._run, []
    grouped._run = lambda p, x, f: models.append(len(p)) or run(p, x, f)
    second = check(replace(inf, streams={**inf.streams, "expert": expert}))
    assert not torch.equal(first.alternatives["expert"], second.alternatives["expert"])
    windows = -(-len(eng.data(0, "global")[1]) // 7)
    assert models == [2] * windows + [1] * windows      # the three changed rows only, in groups of two


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_stream_scorer_on_cuda_does_not_wait_for_the_device_per_chunk(unequal):
    """On CUDA the scorer's loops over chunks and groups queue work without waiting for the device (no
    host index tensors, no bincount, no boolean masks): the synchronising calls that
    `torch.cuda.set_sync_debug_mode` reports are as many with windows of 7 rows as with one window."""
    algo, cpu_engine = setup(unequal, engine="vectorized", k=2, every=1)
    sim = drive(algo, cpu_engine, 2)
    clients = np.arange(6)
    inf = sim.inference(clients)
    model = build_model("mlp", unequal.input_shape, unequal.num_classes, seed=0)
    eng = VectorizedEngine(copy.copy(unequal), model, LOCAL, 0, "cuda", compile=False)
    syncs, results = {}, {}
    for chunk in (7, 1000):
        sc = StreamScorer(eng, 6)
        assert sc.batch_own
        sc.chunk, sc.budget = chunk, chunk * 2 * len(inf.streams)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                results[chunk] = [sc(inf, clients, split) for split in ("local", "global")]
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs[chunk] = sum("called a synchronizing CUDA operation" in str(w.message) for w in caught)
    assert syncs[7] == syncs[1000], syncs
    for a, b in zip(*results.values()):
        assert torch.equal(a.count, b.count) and a.count.sum() == a.confusion.sum()


def test_batched_own_splits_with_feature_streams(unequal):
    """The batched own-split path with a stream that yields penultimate features (FedProto's
    nearest-prototype prediction, an alternative): the loop's numbers."""
    model = build_model("mlp", unequal.input_shape, unequal.num_classes, seed=0)
    width = next(m for m in model.head.modules() if isinstance(m, torch.nn.Linear)).in_features
    ctx = Context(unequal.num_clients, unequal.num_classes, ParamSpec.of(model), flatten(model), unequal.n_train,
                  unequal.label_hist(), 0, 5, 1.0, feature_dim=width)
    algo, eng = REGISTRY["fedproto"](ctx), VectorizedEngine(unequal, model, LOCAL, 0, "cpu", compile=False)
    sim = drive(algo, eng, 2)
    clients = np.arange(6)
    inf = sim.inference(clients)
    assert inf.features                                                 # a feature stream is scored
    loop, batched = StreamScorer(eng, 6), StreamScorer(eng, 6)
    batched.batch_own = True
    for sc in (loop, batched):
        sc.chunk, sc.budget = 16, 16 * 3 * len(inf.streams)
    a, b = loop(inf, clients, "local"), batched(inf, clients, "local")
    assert torch.equal(a.correct, b.correct) and torch.equal(a.confusion, b.confusion)
    assert a.alternatives.keys() == b.alternatives.keys() and len(a.alternatives)
    assert all(torch.equal(a.alternatives[k], b.alternatives[k]) for k in a.alternatives)
