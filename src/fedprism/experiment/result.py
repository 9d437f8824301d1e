"""What a run returns (`RunResult`) and what is said of a run that diverged: plain data, importable without
torch, so that a stored result can be answered without the round loop (fedprism.experiment.lookup).
`fedprism.experiment.runner` re-exports both."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RunResult:
    run_id: str
    status: str
    final: dict
    history: list[dict] = field(default_factory=list)
    resumed_from: int | None = None
    reused: bool = False            # finished before this call: read from the store, nothing was run


def divergence_note(run_id: str, final: dict) -> str:
    """What to tell a user about a run whose `final` says it diverged (`runner.final_metrics`)."""
    r = final.get("diverged_round", 0)
    since = "of all rounds" if r == 0 else f"from round {r + 1} on"
    return (f"run {run_id} DIVERGED: every update {since} was rejected (non-finite values; "
            f"{final.get('rejected')} rejected in all); its metrics are those of the "
            + ("initial model" if r == 0 else f"model after round {r}") + " (lower lr?)")
