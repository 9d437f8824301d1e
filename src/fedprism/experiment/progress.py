"""Progress of a run on stderr, readable in a terminal and in a log file.

* stderr is a terminal: one line redrawn in place (round, bar, ETA, latest accuracies).
* stderr is not a terminal (a log, `nohup`, CI, a pipe): plain lines, one when a round ends and at
  least `every_s` seconds (10 s) have passed since the last line, plus the first and the last
  round; no carriage returns, so `tail -f` and log viewers show them as they are.

Progress always goes to stderr, so `fedprism run --json` keeps stdout to the one JSON object.
"""

from __future__ import annotations

import sys
import time
from typing import IO

from fedprism.errors import printable


def _is_tty(stream: IO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


class Progress:
    """`Progress(total, enabled, label)`; `update(done, metrics)` after every round."""

    width = 24

    def __init__(self, total: int, enabled: bool, label: str = "", stream: IO | None = None,
                 tty: bool | None = None, every_s: float = 10.0, clock=time.monotonic):
        self.total, self.enabled, self.label = total, enabled, printable(label)   # a run's name: user text
        self.stream = stream if stream is not None else sys.stderr
        self.tty = _is_tty(self.stream) if tty is None else tty
        self.every_s, self.clock = every_s, clock
        self.t0 = clock()
        self.done0: int | None = None
        self.last_line: float | None = None
        self.metrics: dict = {}

    def _acc(self) -> str:
        m = self.metrics
        if "local_acc" not in m:
            return ""
        s = f" local {m['local_acc']:.3f}"
        if "global_acc" in m:
            s += f" global {m['global_acc']:.3f}"
        return s

    def update(self, done: int, metrics: dict | None) -> None:
        if not self.enabled:
            return
        now = self.clock()
        if self.done0 is None:
            self.done0 = done - 1
        if metrics:
            self.metrics = metrics                     # the latest evaluation stays on the line
        rate = (now - self.t0) / max(1, done - self.done0)
        eta = rate * (self.total - done)
        if self.tty:
            bar = "#" * int(self.width * done / self.total)
            self.stream.write(f"\r{self.label} round {done}/{self.total} [{bar:<{self.width}}] "
                              f"ETA {eta:5.0f}s{self._acc()}   ")
            if done == self.total:
                self.stream.write("\n")
        else:
            first = self.last_line is None
            if not (first or done == self.total or now - self.last_line >= self.every_s):
                return
            self.last_line = now
            self.stream.write(f"{self.label} round {done}/{self.total} ({100 * done / self.total:.0f}%) "
                              f"{rate:.1f}s/round ETA {eta:.0f}s{self._acc()}\n")
        self.stream.flush()
