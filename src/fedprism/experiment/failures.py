"""Client failures, made visible: what the runner records when a client fails or its reply is rejected,
grouped for people (the end-of-run summary of `fedprism run`, `fedprism show RUN`), and
`fail_on_client_error=true`, which turns any client failure into a failed run.

The runner records, per round, `failure` (the client's `client_update` raised, or a Flower node sent an
error or nothing) and `rejected` (its reply did not match the declared upload, or held NaN/Inf) with the
reason. A failure kind is the record kind and the first part of the reason: the exception's class for a
failure (`RuntimeError`), the field for a rejection (`params`, `n_samples`, `client state 'c'`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedprism.errors import FedPrismError, printable

#: the record kinds that say a client's work was not used
KINDS = ("failure", "rejected")
#: longest message shown for one kind (the store keeps the whole reason)
MESSAGE_CHARS = 300


class ClientFailure(FedPrismError):
    """A client failed in a run with `fail_on_client_error=true`: the run is failed with the client's message."""


@dataclass
class FailureKind:
    """One kind of client failure of a run: how many client updates it cost and where it happened first."""

    kind: str               # 'failure' or 'rejected'
    what: str               # the exception class, or the rejected field
    count: int
    first_round: int        # counted from 0, as stored
    first_client: int | None
    message: str            # the first reason, one printable line of at most MESSAGE_CHARS

    @property
    def label(self) -> str:
        return f"{'raised' if self.kind == 'failure' else 'rejected'} {self.what}"

    def line(self) -> str:
        """One printable line: the kind, its count and its first message."""
        where = f"round {self.first_round + 1}" + (f", client {self.first_client}" if self.first_client is not None
                                                   else "")
        return f"{self.label}: {self.count} update(s); first in {where}: {self.message}"

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "what": self.what, "count": self.count, "first_round": self.first_round,
                "first_client": self.first_client, "message": self.message}


def one_line(text: object, limit: int = MESSAGE_CHARS) -> str:
    """`text` as one printable line (line breaks and control characters escaped) of at most `limit` characters."""
    s = printable(str(text).strip())
    return s if len(s) <= limit else s[:limit - 3] + "..."


def reason_of(data: Any) -> str:
    if isinstance(data, dict):
        return str(data.get("reason", data.get("error", "")) or "")
    return str(data or "")


def kinds(records: list[dict]) -> list[FailureKind]:
    """The failure kinds of a run's records (`Store.records`), in order of first occurrence."""
    out: dict[tuple[str, str], FailureKind] = {}
    for rec in records:
        if rec.get("kind") not in KINDS:
            continue
        reason = reason_of(rec.get("data"))
        what = one_line(reason.split(":", 1)[0] if ":" in reason else (reason or "unknown"), 60)
        key = (rec["kind"], what)
        if key in out:
            out[key].count += 1
        else:
            out[key] = FailureKind(rec["kind"], what, 1, int(rec.get("round") or 0), rec.get("client"),
                                   one_line(reason or "(no message)"))
    return list(out.values())


def of_run(store: Any, run_id: str) -> list[FailureKind]:
    """The failure kinds stored with run `run_id`."""
    return kinds(store.records(run_id))


def stop_on_failure(cfg: Any, failed: dict[int, str], rnd: int) -> None:
    """`fail_on_client_error=true`: a round with a failed client fails the run (`ClientFailure` naming the
    first client, its message and how many failed); nothing otherwise."""
    if not failed or not cfg.get("fail_on_client_error", False):
        return
    client, why = next(iter(failed.items()))
    more = f" ({len(failed)} clients of the round failed)" if len(failed) > 1 else ""
    raise ClientFailure(f"client {client} failed in round {rnd + 1}: {one_line(why)}{more}; "
                        "fail_on_client_error=true fails the run on any client failure")
