"""The validation rule that picks FedPrism's routing (fedprism.report.routing), on hand-made metrics."""

from fedprism.report.routing import choose_routing


def _metrics(rows, expert_val_loc=0.90):
    """rows: name -> (val_loc, val_glob, loc, glob); 'headline' has no suffix."""
    m = {"val_acc@expert": expert_val_loc, "global_val_acc@expert": 0.30, "local_acc@expert": 0.91,
         "global_acc@expert": 0.31, "val_acc@backbone": 0.60, "global_val_acc@backbone": 0.85,
         "local_acc@backbone": 0.61, "global_acc@backbone": 0.86}
    for n, (vl, vg, lo, gl) in rows.items():
        sfx = "" if n == "headline" else f"@{n}"
        m.update({f"val_acc{sfx}": vl, f"global_val_acc{sfx}": vg, f"local_acc{sfx}": lo, f"global_acc{sfx}": gl})
    return m


def test_highest_global_validation_among_those_that_keep_local_validation():
    m = _metrics({"headline": (0.90, 0.50, 0.0, 0.0),      # keeps local, glob 0.50
                  "T=10": (0.896, 0.60, 0.0, 0.0),         # within 0.5 points: qualifies, best glob
                  "T=50": (0.80, 0.80, 0.0, 0.0),          # loses local: excluded despite the best glob
                  "seen_mass": (0.92, 0.55, 0.0, 0.0)})
    ch = choose_routing(m)
    assert ch.name == "T=10" and ch.qualified
    assert [c["name"] for c in ch.candidates] == ["headline", "T=10", "T=50", "seen_mass"]


def test_the_test_split_never_enters_the_choice():
    rows = {"headline": (0.90, 0.50, 0.99, 0.99), "prior": (0.91, 0.70, 0.10, 0.10)}
    assert choose_routing(_metrics(rows)).name == "prior"


def test_none_qualifies_falls_back_to_best_local_validation():
    ch = choose_routing(_metrics({"headline": (0.70, 0.80, 0, 0), "margin": (0.75, 0.60, 0, 0)}))
    assert ch.name == "margin" and not ch.qualified


def test_no_validation_scores_no_choice():
    assert choose_routing({"local_acc": 0.9, "global_acc": 0.5}) is None


def test_report_section_lists_runs_with_a_choice_only():
    from fedprism.report.routing import routing_choice_table

    routed = _metrics({"headline": (0.90, 0.50, 0.91, 0.52), "T=10": (0.896, 0.60, 0.90, 0.61)})
    fixed = _metrics({"headline": (0.93, 0.70, 0.93, 0.71)})        # a fixed inference weight: one prediction

    class Store:
        def round_metrics(self, run_id):
            return [{"routed": routed, "fixed": fixed}[run_id]]

    run = lambda rid: {"run_id": rid, "final": {"global_val_acc@expert": 0.3}, "config": {"method": "x", "seed": 0}}  # noqa: E731
    md = "\n".join(routing_choice_table(Store(), {"s": {"a": [run("routed")], "b": [run("fixed")]}}))
    assert "`routed`" in md and "`fixed`" not in md
    assert "Chosen: **T=10**. Test Glob 61.00 against the backbone's 86.00 (-25.00)" in md
    assert routing_choice_table(Store(), {"s": {"b": [run("fixed")]}}) == []
