"""Typed, validated parameters shared by methods, partitions and the experiment config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from fedprism.errors import ConfigError


@dataclass(frozen=True)
class Param:
    """One method parameter: default, type, validity check and help (shown by `fedprism methods`)."""

    default: Any
    help: str
    check: Callable[[Any], bool] | None = None
    allowed: str = ""
    choices: tuple | None = None
    #: True: changes only inference (not part of a run's training identity; a finished run is re-scored)
    eval_only: bool = False
    #: True: added after runs were first stored; left out of the run id while at its default
    new: bool = False

    def validate(self, key: str, value: Any) -> Any:
        t = type(self.default)
        if self.choices is not None:
            if value not in self.choices:
                raise ConfigError(key, value, f"one of {', '.join(map(str, self.choices))}")
            return value
        if t is bool:
            if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
                value = value.lower() in ("true", "1")
            if not isinstance(value, bool):
                raise ConfigError(key, value, "true or false")
        elif t is int:
            if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, float) and value.is_integer())):
                raise ConfigError(key, value, f"an integer{'; ' + self.allowed if self.allowed else ''}")
            value = int(value)
        elif t is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(key, value, f"a number{'; ' + self.allowed if self.allowed else ''}")
            value = float(value)
        elif self.default is not None and not isinstance(value, t):
            raise ConfigError(key, value, f"a {t.__name__}")
        if self.check is not None and not self.check(value):
            raise ConfigError(key, value, self.allowed or "out of range")
        return value
