"""`eval.finetune` (fine-tuning at evaluation, the `ft` alternative prediction) and `data.unseen_clients`
(clients held out of every cohort, scored as newcomers): both off leave every run id and number as they
were; fine-tuning by hand equals `@ft`; held-out clients are never planned and are scored with the
method's newcomer rule (FedAvg's global model, IFCA's lowest-loss cluster); re-scoring; both engines;
refusals (a method that cannot say what it fine-tunes, Flower)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedprism.engine.base import batch_order, stream_seed
from fedprism.errors import ConfigError
from fedprism.experiment.build import make_selector
from fedprism.experiment.config import resolve
from fedprism.experiment.evaluate import Evaluator, summarize
from fedprism.experiment.federation import SeenSelector, held_out_clients, unseen_mask
from fedprism.experiment.runner import Experiment
from fedprism.experiment.store import Store
from fedprism.selection import Selector

SMALL = dict(dataset="digits", clients=8, rounds=2, fraction=0.5, local_epochs=1, batch_size=16, lr=0.05,
             partition="dirichlet", **{"partition.alpha": 0.5}, model="mlp", engine="sequential", device="cpu")
TIMING = {"train_s", "eval_s", "wall_s"}


def cfg(**kw):
    return resolve({**SMALL, **{k.replace("__", "."): v for k, v in kw.items()}})


def run(tmp_path, name="r", **kw):
    c = cfg(**kw)
    e = Experiment(c, Store(tmp_path / f"{name}.db"))
    res = e.run()
    assert res.status == "finished"
    return e, res


def acc(logits: torch.Tensor, y: torch.Tensor) -> float:
    return float((logits.argmax(-1) == y).double().mean())


# -- off: nothing changes ---------------------------------------------------------------------------------
def test_keys_at_zero_leave_run_ids_and_numbers_unchanged(tmp_path):
    plain = cfg(method="fedavg")
    off = cfg(method="fedavg", eval__finetune=0, data__unseen_clients=0.0)
    assert off.run_id == plain.run_id and off.train_id == plain.train_id
    assert "eval.finetune" not in plain.identity and "data.unseen_clients" not in plain.identity
    assert cfg(method="fedavg", eval__finetune=1).run_id != plain.run_id
    assert cfg(method="fedavg", eval__finetune=1).train_id == plain.train_id        # evaluation-only
    assert cfg(method="fedavg", data__unseen_clients=0.25).train_id != plain.train_id
    ea, ra = run(tmp_path, "a", method="fedavg")
    eb, rb = run(tmp_path, "b", method="fedavg", eval__finetune=0, data__unseen_clients=0.0)
    assert isinstance(make_selector(off, ea.ctx, ea.algo), Selector) and ea.unseen is None
    for ha, hb in zip(ra.history, rb.history, strict=True):
        assert {k: v for k, v in ha.items() if k not in TIMING} == {k: v for k, v in hb.items() if k not in TIMING}
        assert not any("unseen" in k or "@" in k for k in ha)
    assert ea.store.client_rows(plain.run_id) == eb.store.client_rows(plain.run_id)
    assert torch.equal(ea.state["w"], eb.state["w"])


def test_the_options_leave_the_seen_clients_headline_bit_for_bit(tmp_path):
    """The evaluation path of the options scores the seen clients' own inference exactly as the plain path."""
    e, _ = run(tmp_path, method="ditto")
    mask = np.zeros(8, bool)
    mask[[1, 6]] = True
    base = Evaluator(e.engine, 8)(e.algo, e.state, e.clients)
    both = Evaluator(e.engine, 8, finetune=1, unseen=mask)(e.algo, e.state, e.clients)
    assert np.array_equal(both.clients, base.clients)
    for k in ("local_acc", "local_loss", "local_f1", "global_acc", "global_f1", "n_test"):
        assert np.array_equal(getattr(both, k)[~mask], getattr(base, k)[~mask], equal_nan=True), k
    # clients 1 and 6 trained in this run: as newcomers they get Ditto's fresh personal model instead
    assert not np.array_equal(both.local_acc[mask], base.local_acc[mask])
    ft = Evaluator(e.engine, 8, finetune=1)(e.algo, e.state, e.clients)
    assert summarize(ft)["local_acc"] == summarize(base)["local_acc"]
    assert set(ft.alternatives) == {"local_acc@ft", "global_acc@ft"}


# -- fine-tuning -------------------------------------------------------------------------------------------
def test_finetuning_by_hand_equals_at_ft(tmp_path):
    """Two epochs of SGD with momentum (the run's lr, momentum and batch size) from FedAvg's global model, on
    each client's training rows in the batch order of the `eval_finetune` stream, by hand."""
    e, res = run(tmp_path, method="fedavg", eval__finetune=2, momentum=0.5)
    eng, w0, lr, mom = e.engine, e.state["w"], 0.05, 0.5
    local, glob = [], []
    xg, yg = eng.data(0, "global")
    for c in range(8):
        x, y = eng.data(c, "train")
        w, buf = w0.clone(), None
        for b in batch_order(len(y), 2, 16, stream_seed(0, 0, c, "eval_finetune")):      # round 0, always
            v = w.detach().requires_grad_(True)
            g = torch.autograd.grad(F.cross_entropy(eng.f(v, x[b]), y[b]), v)[0]
            buf = g.clone() if buf is None else mom * buf + g
            w = w - lr * buf
        xl, yl = eng.data(c, "local")
        if len(yl):
            local.append(acc(eng.f(w, xl), yl))
        glob.append(acc(eng.f(w, xg), yg))
    assert res.final["local_acc@ft"] == pytest.approx(np.mean(local), abs=1e-12)
    assert res.final["global_acc@ft"] == pytest.approx(np.mean(glob), abs=1e-12)
    assert res.final["local_acc@ft"] != res.final["local_acc"]          # fine-tuning did something


def test_a_finished_run_is_rescored_with_finetuning_without_training(tmp_path):
    store = Store(tmp_path / "r.db")
    first = Experiment(cfg(method="fedavg"), store).run()
    c = cfg(method="fedavg", eval__finetune=2)
    again = Experiment(c, store).run()
    assert again.final["rescored_from"] == first.run_id and again.final["accepted"] == 0
    assert again.final["local_acc"] == first.final["local_acc"]
    _, direct = run(tmp_path, "direct", method="fedavg", eval__finetune=2)      # trained in one go
    for k in ("local_acc@ft", "global_acc@ft", "local_acc"):
        assert again.final[k] == direct.final[k], k


def test_a_method_that_is_not_one_model_is_refused_before_training(tmp_path):
    with pytest.raises(ConfigError) as e:
        Experiment(cfg(method="fedbabu", eval__finetune=1), Store(tmp_path / "r.db"))
    assert "eval.finetune" in str(e.value) and "method=fedbabu" in str(e.value) and "finetune_start" in str(e.value)
    assert not (tmp_path / "r.db").exists() or Store(tmp_path / "r.db").run(cfg(method="fedbabu",
                                                                                eval__finetune=1).run_id) is None


# -- clients that never train -----------------------------------------------------------------------------
def test_held_out_clients_are_seeded_and_validated():
    a = held_out_clients(3, 20, 0.25)
    assert len(a) == 5 and np.array_equal(a, held_out_clients(3, 20, 0.25)) and np.all(np.diff(a) > 0)
    assert not np.array_equal(a, held_out_clients(4, 20, 0.25))
    assert unseen_mask(cfg(data__unseen_clients=0.0)) is None
    with pytest.raises(ConfigError, match="data.unseen_clients.*at least one"):
        cfg(data__unseen_clients=0.1)                 # floor(0.1 x 8) = 0 clients held out
    with pytest.raises(ConfigError, match="data.unseen_clients"):
        cfg(data__unseen_clients=1.0)
    with pytest.raises(ConfigError, match="eval.finetune"):
        cfg(eval__finetune=-1)


@pytest.mark.parametrize("rule", ["uniform", "poc", "haccs", "fedcls"])
def test_held_out_clients_are_in_no_cohort(tmp_path, rule):
    c = cfg(method="fedavg", clients=20, fraction=0.3, data__unseen_clients=0.25, selection=rule)
    e = Experiment(c, Store(tmp_path / "r.db"))
    sel = make_selector(c, e.ctx, e.algo)
    held = np.flatnonzero(e.unseen)
    assert isinstance(sel, SeenSelector) and len(held) == 5
    drawn = set()
    for rnd in range(200):
        chosen, rec = sel.select(rnd, lambda cand: np.asarray(cand, dtype=np.float64))
        assert len(chosen) == 4 == len(set(chosen.tolist()))         # max(floor(0.3 x 15), 1) seen clients
        assert not set(chosen.tolist()) & set(held.tolist()), (rnd, chosen)
        assert not set(rec.get("candidates", [])) & set(held.tolist())
        drawn |= set(chosen.tolist())
    if rule == "uniform":
        assert drawn == set(range(20)) - set(held.tolist())           # every seen client does take part


def test_held_out_clients_never_train_even_when_a_method_plans_everyone(tmp_path):
    """Local with participation=all plans every client: the held-out ones are left out of the plan, keep
    their fresh (initial) model, and are scored with it as newcomers."""
    e, res = run(tmp_path, method="local", local__participation="all", rounds=3, data__unseen_clients=0.25)
    held = np.flatnonzero(e.unseen)
    rows = e.clients.rows(np.arange(8))["w"]
    init = e.ctx.init
    for c in range(8):
        assert torch.equal(rows[c], init) == (c in held), c
    assert all(h["clients"] == 6 and h["accepted"] == 6 for h in res.history)
    assert e.store.records(c := e.run_id, "unseen_clients")[0]["data"]["clients"] == held.tolist()
    by_client = {r["client"]: r for r in e.store.client_rows(c)}
    eng = e.engine
    for k in held:                                      # scored with the initial model
        x, y = eng.data(int(k), "local")
        assert by_client[int(k)]["local_acc"] == pytest.approx(acc(eng.f(init, x), y), abs=1e-12)


def test_fedavg_newcomers_are_scored_with_the_global_model_by_hand(tmp_path):
    e, res = run(tmp_path, method="fedavg", rounds=3, data__unseen_clients=0.25)
    held = set(np.flatnonzero(e.unseen).tolist())
    assert len(held) == 2
    eng, w = e.engine, e.state["w"]
    seen_acc, unseen_acc, unseen_n = [], [], []
    for c in range(8):
        x, y = eng.data(c, "local")
        if not len(y):
            continue
        (unseen_acc if c in held else seen_acc).append(acc(eng.f(w, x), y))
        if c in held:
            unseen_n.append(len(y))
    f = res.final
    assert f["unseen_local_acc"] == pytest.approx(np.mean(unseen_acc), abs=1e-12)
    assert f["unseen_local_acc_weighted"] == pytest.approx(np.dot(unseen_acc, unseen_n) / sum(unseen_n), abs=1e-12)
    assert f["local_acc"] == pytest.approx(np.mean(seen_acc), abs=1e-12)      # the seen clients only
    assert 0 <= f["unseen_local_f1"] <= 1 and res.history[-1]["unseen_clients"] == 2
    assert {r["client"] for r in e.store.client_rows(e.run_id)} == set(range(8))


def test_ifca_newcomers_pick_the_lowest_loss_cluster(tmp_path):
    """IFCA's own rule for a client that never chose: the cluster model of lowest loss on its training rows."""
    e, res = run(tmp_path, method="ifca", ifca__k=3, rounds=3, data__unseen_clients=0.25, eval__finetune=1)
    eng, W = e.engine, e.state["w"]
    held = np.flatnonzero(e.unseen)
    assert bool((e.state["assign"][torch.as_tensor(held)] == -1).all())        # they never chose
    by_client = {r["client"]: r for r in e.store.client_rows(e.run_id)}
    picked = []
    for k in held:
        x, y = eng.data(int(k), "train")
        losses = [float(F.cross_entropy(eng.f(W[j], x), y)) for j in range(3)]
        j = int(np.argmin(losses))
        assert sorted(losses)[0] < sorted(losses)[1] - 1e-6          # no tie: the rule decides alone
        xl, yl = eng.data(int(k), "local")
        assert by_client[int(k)]["local_acc"] == pytest.approx(acc(eng.f(W[j], xl), yl), abs=1e-12)
        picked.append(j)
    assert "unseen_local_acc@ft" in res.final and "local_acc@ft" in res.final


def test_both_engines_agree(tmp_path):
    kw = dict(method="fedavg", rounds=2, data__unseen_clients=0.25, eval__finetune=1)
    ea, ra = run(tmp_path, "seq", **kw)
    eb, rb = run(tmp_path, "vec", **{**kw, "engine": "vectorized", "compile": "false"})
    torch.testing.assert_close(ea.state["w"], eb.state["w"], atol=1e-4, rtol=1e-4)
    for k in ("local_acc", "unseen_local_acc", "local_acc@ft", "unseen_local_acc@ft", "global_acc@ft"):
        assert ra.final[k] == pytest.approx(rb.final[k], abs=0.02), k


def test_flower_refuses_both_options():
    from fedprism.flower.settings import check_flower_config

    check_flower_config(cfg(method="fedavg"))
    with pytest.raises(ConfigError, match="'eval.finetune' = 1 .*0 on Flower"):
        check_flower_config(cfg(method="fedavg", eval__finetune=1))
    with pytest.raises(ConfigError, match="'data.unseen_clients' = 0.25 .*0 on Flower"):
        check_flower_config(cfg(method="fedavg", data__unseen_clients=0.25))


def test_the_report_shows_ft_as_an_alternative_and_unseen_as_a_column(tmp_path):
    from fedprism.report import write_report

    store = Store(tmp_path / "r.db")
    Experiment(cfg(method="fedavg"), store).run()
    res = Experiment(cfg(method="fedavg", data__unseen_clients=0.25, eval__finetune=2, seed=1), store).run()
    write_report(str(tmp_path / "r.db"), str(tmp_path / "out"), plots=False)
    md = (tmp_path / "out" / "results.md").read_text()
    f = res.final
    assert f"| fine-tuned, 2 local epochs (eval.finetune) | {100 * f['global_acc@ft']:.2f} | " \
           f"{100 * f['local_acc@ft']:.2f} | {100 * f['unseen_local_acc@ft']:.2f} |" in md
    assert "Fine-tuned: each client's model" in md and "dual-stream" not in md   # says what the rows are
    assert "| Loc Unseen |" in md and f"{100 * f['unseen_local_acc']:.2f}" in md
    # the +FT numbers are columns of the per-setting table too, beside the method's own
    row = [line for line in md.splitlines() if line.startswith("| fedavg (data.unseen_clients=0.25")][-1]
    assert row.endswith(f"| {100 * f['unseen_local_acc']:.2f} | {100 * f['local_acc@ft']:.2f} | "
                        f"{100 * f['unseen_local_acc@ft']:.2f} |"), row
    assert "| Loc Unseen | Loc +FT | Loc Unseen +FT |" in md
    header = (tmp_path / "out" / "results.csv").read_text().splitlines()[0]
    assert header.endswith(",unseen_local_acc,local_acc@ft,unseen_local_acc@ft")
    alone = Store(tmp_path / "plain.db")                   # a report without held-out clients: no such column
    Experiment(cfg(method="fedavg"), alone).run()
    write_report(str(tmp_path / "plain.db"), str(tmp_path / "plain"), plots=False)
    assert "Unseen" not in (tmp_path / "plain" / "results.md").read_text()
    assert "unseen" not in (tmp_path / "plain" / "results.csv").read_text()
