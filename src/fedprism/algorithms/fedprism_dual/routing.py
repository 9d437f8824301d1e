"""Choosing FedPrism's routing on validation data, and reporting the choice on the test split.

A `fedprism_dual` run with validation splits (`data.val_fraction`, `data.global_val`) scores, at every
evaluation, its headline routing and every alternative (confidence routing at each diagnostic
temperature T, margin, seen_mass, prior; each stream alone) on the test splits *and* on the validation
splits (`val_acc@<name>`: each client's validation rows; `global_val_acc@<name>`: the global validation
set carved from the training pool). Training does not depend on the routing, so all of them come from
the same models.

The rule (fixed before the validation runs were looked at, and the same for every run):

    among the routed predictions whose local validation accuracy is at least the specialist's own
    local validation accuracy minus `MARGIN` (0.5 points), take the one with the highest global
    validation accuracy; if none qualifies, the one with the highest local validation accuracy.

It encodes the goal of the dual stream: keep the specialist's accuracy on the client's own classes,
and from the routings that do, take the one that loses least on everything else. Test numbers are read
only after the choice and are never compared between candidates.
"""

from __future__ import annotations

from dataclasses import dataclass

MARGIN = 0.005
STREAMS = ("backbone", "expert")


@dataclass(frozen=True)
class Choice:
    name: str                      # the chosen prediction ('headline' or an alternative's name)
    candidates: list[dict]         # one row per routed prediction: name, val_loc, val_glob, loc, glob
    expert_val_loc: float
    qualified: bool                # whether the chosen one met the local-accuracy condition

    def row(self, name: str) -> dict:
        return next(c for c in self.candidates if c["name"] == name)


def _get(m: dict, split: str, name: str):
    key = split if name == "headline" else f"{split}@{name}"
    return m.get(key)


def _order(name: str) -> tuple:
    """Temperatures first, by value (T=0.5 .. T=50), then the other rules by name."""
    if name.startswith("T="):
        try:
            return (0, float(name[2:]), name)
        except ValueError:
            pass
    return (1, 0.0, name)


def choose_routing(metrics: dict, margin: float = MARGIN) -> Choice | None:
    """The validation choice (module docstring) from one evaluated round's metrics; None when the round
    has no validation scores of the streams."""
    expert = metrics.get("val_acc@expert")
    if expert is None or metrics.get("global_val_acc") is None:
        return None
    alts = {k.split("@", 1)[1] for k in metrics if k.startswith("global_val_acc@")} - set(STREAMS)
    names = ["headline"] + sorted(alts, key=_order)
    cands = []
    for n in names:
        row = {"name": n, "val_loc": _get(metrics, "val_acc", n), "val_glob": _get(metrics, "global_val_acc", n),
               "loc": _get(metrics, "local_acc", n), "glob": _get(metrics, "global_acc", n)}
        if row["val_loc"] is not None and row["val_glob"] is not None:
            cands.append(row)
    ok = [c for c in cands if c["val_loc"] >= expert - margin]
    if ok:
        best = max(ok, key=lambda c: (c["val_glob"], c["val_loc"]))
    else:
        best = max(cands, key=lambda c: (c["val_loc"], c["val_glob"]))
    return Choice(best["name"], cands, expert, bool(ok))


def _pct(v) -> str:
    return "n/a" if v is None else f"{100 * v:.2f}"


def routing_choice_table(store, groups) -> list[str]:
    """The validation choice of every run that has validation scores (last evaluated round) and more than
    one routed prediction to choose from, with the test accuracies of the chosen routing beside the
    backbone's and the specialist's own."""
    from fedprism.algorithms import REGISTRY

    md: list[str] = []
    for setting in sorted(groups):
        for label in sorted(groups[setting]):
            for r in sorted(groups[setting][label], key=lambda x: x["config"]["seed"]):
                if "global_val_acc@expert" not in r["final"]:    # no validation scores: no rounds to read
                    continue
                evald = [m for m in store.round_metrics(r["run_id"]) if "global_val_acc" in m]
                if not evald:
                    continue
                m = evald[-1]
                ch = choose_routing(m)
                if ch is None or len(ch.candidates) < 2:     # a fixed inference weight: nothing to choose
                    continue
                if not md:
                    md = ["## Routing chosen on validation data (final round, %)", "",
                          "The rule (`fedprism.report.routing`): among the routed predictions whose local "
                          f"validation accuracy is at least the specialist's minus {100 * MARGIN:g} points, the "
                          "highest global validation accuracy. Test columns are read after the choice.", ""]
                method = REGISTRY.find(r["config"]["method"])
                head = method.headline(r["config"]) if method else "headline"
                md += [f"**{label}**, {setting}, seed {r['config']['seed']} (`{r['run_id']}`)", "",
                       "| prediction | val Loc | val Glob | test Loc | test Glob | |", "|---|---|---|---|---|---|"]
                for c in ch.candidates:
                    name = f"{head} (headline)" if c["name"] == "headline" else c["name"]
                    mark = "chosen" if c["name"] == ch.name else ("" if c["val_loc"] >= ch.expert_val_loc - MARGIN
                                                                  else "loses local")
                    md.append(f"| {name} | {_pct(c['val_loc'])} | {_pct(c['val_glob'])} | {_pct(c['loc'])} | "
                              f"{_pct(c['glob'])} | {mark} |")
                c = ch.row(ch.name)
                bb, ex = m.get("global_acc@backbone"), m.get("local_acc@expert")
                md += [f"| backbone alone | {_pct(m.get('val_acc@backbone'))} | "
                       f"{_pct(m.get('global_val_acc@backbone'))} | {_pct(m.get('local_acc@backbone'))} | "
                       f"{_pct(bb)} | |",
                       f"| specialist alone | {_pct(ch.expert_val_loc)} | {_pct(m.get('global_val_acc@expert'))} | "
                       f"{_pct(ex)} | {_pct(m.get('global_acc@expert'))} | |", ""]
                if bb is not None and ex is not None:
                    md += [f"Chosen: **{ch.name}**. Test Glob {_pct(c['glob'])} against the backbone's "
                           f"{_pct(bb)} ({100 * (c['glob'] - bb):+.2f}); test Loc {_pct(c['loc'])} against the "
                           f"specialist's {_pct(ex)} ({100 * (c['loc'] - ex):+.2f}).", ""]
    return md


__all__ = ["MARGIN", "Choice", "choose_routing", "routing_choice_table"]
