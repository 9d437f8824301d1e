"""Typed, validated parameters shared by methods, partitions and the experiment config.

Every value goes through `Param.validate` (subclasses that override it included): a float must be
finite (NaN and +-inf are refused for every key, whatever its own check says) and an integer must fit
in 64 bits (|v| < 2**63: the store keeps seeds as SQLite integers, torch and numpy take int64).
"""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass
from typing import Any, Callable

from fedprism.errors import ConfigError
from fedprism.registry import suggest


def plain(value: Any) -> Any:
    """A numpy scalar (np.int64 from a loop over np.arange, np.float32, np.bool_, np.str_) as the Python
    value it holds, so that it validates, and hashes into a run id, as that value does; anything else
    unchanged. (numpy is not imported for this: where it is not imported yet, no value is one of its
    scalars, and configuration and the results store stay free of it.)"""
    np = sys.modules.get("numpy")
    return value.item() if np is not None and isinstance(value, np.generic) else value


def did_you_mean(value: Any, choices) -> str:
    """' (did you mean 'samples'?)' for the string choice closest to a string `value` that is not one of
    them (`registry.suggest`: difflib, case as typed, then lower case), else ''."""
    if not isinstance(value, str):
        return ""
    words = [str(c) for c in choices if isinstance(c, str)]
    return suggest(value, words, quote=True) or suggest(value.strip().lower(), words, quote=True)


@dataclass(frozen=True)
class Space:
    """Where `fedprism tune` searches one key (docs/tuning.md): a range `[low, high]` on a `linear` or `log`
    scale (`integer=True`: whole numbers only), or a list of `choices`. It is a declaration only: a run's
    value is checked by its `Param` as any other value, and no run id depends on a space."""

    low: float | None = None
    high: float | None = None
    scale: str = "linear"
    integer: bool = False
    choices: tuple | None = None

    def __post_init__(self) -> None:
        if self.choices is not None:
            if self.low is not None or self.high is not None or not len(self.choices):
                raise ValueError(f"Space: choices={self.choices!r} with low={self.low!r}, high={self.high!r}; "
                                 "either a non-empty list of choices or a range low..high")
            object.__setattr__(self, "choices", tuple(self.choices))
            return
        if self.scale not in ("linear", "log"):
            raise ValueError(f"Space: scale={self.scale!r}; linear or log")
        for name, v in (("low", self.low), ("high", self.high)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"Space: {name}={v!r}; a finite number")
        if not self.low < self.high:
            raise ValueError(f"Space: low={self.low!r} >= high={self.high!r}; low must be below high")
        if self.scale == "log" and self.low <= 0:
            raise ValueError(f"Space: low={self.low!r} on a log scale; a number > 0")
        if self.integer and not (float(self.low).is_integer() and float(self.high).is_integer()):
            raise ValueError(f"Space: integer range {self.low!r}..{self.high!r}; whole-number bounds")

    def describe(self) -> str:
        """'[0.001, 0.3] log', '{1, 2, 3}': how `fedprism methods` and the tuning docs write it."""
        if self.choices is not None:
            return "{" + ", ".join(map(str, self.choices)) + "}"
        kind = " integer" if self.integer else ""
        return f"[{self.low:g}, {self.high:g}] {self.scale}{kind}"


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
    #: where `fedprism tune` searches this key (a `Space`); None: not tuned unless a study file says so
    space: Space | None = None

    def __init_subclass__(cls, **kw: Any) -> None:
        """A subclass's own `validate` gets the same finite / 64-bit checks first."""
        super().__init_subclass__(**kw)
        own = cls.__dict__.get("validate")
        if own is not None and not getattr(own, "_prechecked", False):
            @functools.wraps(own)
            def validate(self: Param, key: str, value: Any) -> Any:
                value = plain(value)
                self._precheck(key, value)
                try:
                    return own(self, key, value)
                except ConfigError as e:        # a keyword mistyped ('hed' for 'head'): say the nearest
                    hint = did_you_mean(value, self.words()) if e.key == key and e.value is value else ""
                    if hint and "did you mean" not in e.allowed:
                        e.allowed += hint
                        e.args = (f"{e.args[0]}{hint}",)
                    raise
            validate._prechecked = True  # type: ignore[attr-defined]
            cls.validate = validate  # type: ignore[method-assign]

    def words(self) -> tuple[str, ...]:
        """The words this parameter takes as values (its string choices; for a subclass that takes a number
        or a keyword, the keyword: its string default, its `word`), which a mistyped value is matched
        against."""
        out = [c for c in (self.choices or ()) if isinstance(c, str)]
        out += [w for w in (self.default, getattr(self, "word", None)) if isinstance(w, str) and w and w not in out]
        return tuple(out)

    def _precheck(self, key: str, value: Any) -> None:
        extra = f"; {self.allowed}" if self.allowed else ""
        if isinstance(value, float) and not math.isfinite(value):      # said once: "allowed" may say it too
            raise ConfigError(key, value, self.allowed if "finite" in extra else f"a finite number{extra}")
        if isinstance(value, int) and not isinstance(value, bool) and not -2**63 < value < 2**63:
            raise ConfigError(key, value, f"an integer of magnitude below 2**63{extra}")

    def validate(self, key: str, value: Any) -> Any:
        value = plain(value)
        self._precheck(key, value)
        t = type(self.default)
        if self.choices is not None:
            if value not in self.choices:
                extra = f"; {self.allowed}" if self.allowed else ""
                raise ConfigError(key, value, f"one of {', '.join(map(str, self.choices))}{extra}"
                                  f"{did_you_mean(value, self.choices)}")
            return value      # as given (1 is not rewritten to True: that would change stored run ids)
        if t is bool:
            if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
                value = value.lower() in ("true", "1")
            if not isinstance(value, bool):
                raise ConfigError(key, value, "true or false")
        elif t is int:
            if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, float) and value.is_integer())):
                allowed = self.allowed if self.allowed.startswith("an integer") else \
                    "an integer" + (f"; {self.allowed}" if self.allowed else "")
                raise ConfigError(key, value, allowed)
            value = int(value)
            self._precheck(key, value)              # 1e300 is an integer-valued float
        elif t is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                allowed = self.allowed if self.allowed.startswith("a number") else \
                    "a number" + (f"; {self.allowed}" if self.allowed else "")
                raise ConfigError(key, value, allowed)
            value = float(value)
        elif self.default is not None and not isinstance(value, t):
            raise ConfigError(key, value, f"a {t.__name__}")
        if self.check is not None and not self.check(value):
            raise ConfigError(key, value, self.allowed or "out of range")
        return value
