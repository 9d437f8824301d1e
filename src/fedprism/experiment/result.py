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
            + ("initial model" if r == 0 else f"model after round {r}") + " (lower lr, or the method's own "
            f"strength parameters: `fedprism show {run_id}` lists its configuration)")


#: round metrics of the optional parts of a run, in the order `fedprism show` prints them after the
#: accuracy columns: the simulated clock and who missed the round (`system.*`, docs/systems.md), FedBuff's
#: staleness, and the bytes each way (every run stores these; docs/compression.md)
ROUND_EXTRAS = ("sim_time", "sim_clock", "unavailable", "late", "stale_max", "stale_mean", "bytes_down", "bytes_up")

#: final metrics summed or last-of-run that `fedprism run` and `show` add to a run's summary where stored:
#: the simulated time, the totals of clients offline and late, the bytes each way
SUMMARY_EXTRAS = ("sim_clock", "unavailable", "late", "bytes_down", "bytes_up")

#: prefixes of the differential-privacy metrics (DP-FedAvg `dp.clip`, local DP-SGD `dp.local`; docs/privacy.md)
PRIVACY_PREFIXES = ("dpfedavg_", "dpsgd_")


def _epsilon(key: str) -> bool:
    return key.startswith(PRIVACY_PREFIXES) and "epsilon" in key


def round_columns(history: list[dict]) -> list[str]:
    """The optional per-round columns of a run: each of `ROUND_EXTRAS` that some round stores, then the
    privacy epsilons some round stores (`dpfedavg_epsilon`, `dpsgd_epsilon_max`, ...), sorted. Chosen
    from what the rounds hold, so a run without a clock or DP gets none of those columns."""
    present = {k for h in history for k in h}
    return [k for k in ROUND_EXTRAS if k in present] + sorted(k for k in present if _epsilon(k))


def summary_extras(final: dict) -> list[str]:
    """The keys of `final` (a run's final metrics) that the run's summary adds after its accuracies: each of
    `SUMMARY_EXTRAS` it stores, then the epsilons spent (`dpfedavg_epsilon`, `dpsgd_epsilon_max`, ...)."""
    return [k for k in SUMMARY_EXTRAS if k in final] + sorted(k for k in final if _epsilon(k))
