"""Errors a user can act on. Each names the field, the value and what is allowed."""

from __future__ import annotations


class FedPrismError(Exception):
    """Base class for errors caused by user input or missing resources (printed without traceback)."""


class ConfigError(FedPrismError, ValueError):
    """A configuration value is unknown, of the wrong type or out of range.

    `kind` says what `key` is: a config key (the default), a command-line `option`, or "" for an input
    named by `key` itself (`sweep file '/x.toml' is not valid: ...`)."""

    def __init__(self, key: str, value: object, allowed: str, kind: str = "config key"):
        self.key, self.value, self.allowed = key, value, allowed
        what = f"{kind} '{_line(str(key))}' =" if kind else _line(str(key))
        super().__init__(f"{what} {_line(_repr(value))} is not valid: {_line(allowed)}")


def _repr(value: object, limit: int = 200) -> str:
    try:
        r = repr(value)
    except Exception:  # noqa: BLE001 - a value whose repr fails is still reported
        r = f"<{type(value).__name__}>"
    return r if len(r) <= limit else r[:limit] + f"... ({len(r)} characters)"


def printable(text: object, newlines: bool = False) -> str:
    """`text` as one printable line, safe to write to a terminal: every character that is not printable
    (control characters such as ESC, so no terminal escape sequence gets through; newlines, carriage
    returns, tabs; Unicode format characters such as the bidirectional overrides) is written as its Python
    escape (`\\x1b`, `\\n`, `\\u202e`). `newlines=True` keeps line breaks (a message of several lines).
    Every user-controlled string fedprism prints (run labels, sweep and method names, file names, values in
    errors and warnings, table cells) goes through it."""
    text = str(text)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or (newlines and c == "\n") else c.encode("unicode_escape").decode()
                   for c in text)


_line = printable


class DataError(FedPrismError):
    """A dataset is missing, truncated, corrupt or fails its checksum."""


class PartitionError(FedPrismError, ValueError):
    """A partition request is impossible (too many clients, bad alpha, ...)."""
