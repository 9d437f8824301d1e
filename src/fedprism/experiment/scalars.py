"""The `scalars=DIR` execution key: every round's scalars as CSV files, written as the run goes (for plotting
tools and spreadsheets; `torch.utils.tensorboard` needs the `tensorboard` package, which fedprism does not
require). A callback of the round loop (experiment/callbacks.py), registered by `build.round_callbacks` when
`scalars` is set and by `build.rescore_callbacks` for a re-scored run:

    DIR/<run_id>-rounds.csv    round, tag, value (one row per numeric round metric, TensorBoard's layout)
    DIR/<run_id>-clients.csv   round, client, local_acc, local_loss, global_acc, n_test, local_f1

    Scalars(DIR, run_id)   before the run is started: the folder and both files made (a header in a new or
                           empty file, nothing else touched); a folder that cannot hold them (a file of that
                           name, a path under a file, no permission) is a `ConfigError` for `scalars`, so the
                           run is neither stored nor locked
    on_run_start           each file rewritten with its header and the rows of the rounds before the loop's
                           first (`loop.start`: all of a resumed run's rounds up to its checkpoint, none for a
                           fresh or re-scored run)
    on_round_stored        the round's numeric metrics (sorted by tag) and its per-client rows, appended
                           once the round is in the store and before its checkpoint is written (the callback
                           runs ahead of `Checkpoint`): a round whose rows could not be written is not
                           checkpointed, so its resume redoes it and rewrites them
    on_finish              closed: nothing more is written

No file stays open between rounds: each file is opened, appended to and closed once per round, so a killed
run leaves every stored round on disk and at most a torn last line, which the resume drops.

Only stdlib and fedprism's light modules are imported here (no torch, no numpy).
"""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path

from fedprism.errors import ConfigError
from fedprism.experiment.callbacks import Callback
from fedprism.experiment.store import StoreError, _clean, _file_in_the_way


class Scalars(Callback):
    """The CSV files of one run under `scalars=DIR` (module docstring). Rounds redone after a resume replace
    the rows they had: each file is rewritten (atomically) with its header and the well-formed rows of the
    rounds kept; a damaged line (torn by a crash, junk appended) is dropped, and a row that appears twice
    (same round and tag, or round and client) is kept once, its first copy. Failures to write are a
    `StoreError` naming the file (the run is marked `failed` and resumes from its last checkpoint)."""

    ROUND_COLS = ("round", "tag", "value")
    CLIENT_COLS = ("round", "client", "local_acc", "local_loss", "global_acc", "n_test", "local_f1")

    def __init__(self, folder: str | Path, run_id: str):
        self.dir = Path(folder)
        self.rounds = self.dir / f"{run_id}-rounds.csv"
        self.clients = self.dir / f"{run_id}-clients.csv"
        self.closed = False
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            for p, head in self._files():
                with open(p, "a", newline="") as f:     # may be written (nothing it holds is touched here)
                    if f.tell() == 0:                   # new, or left empty by a crash: the header first
                        f.write(",".join(head) + "\n")
        except (OSError, ValueError) as e:             # ValueError: a NUL character in the path
            raise ConfigError("scalars", folder, "a folder (created if missing) that the run's CSV files can "
                              f"be written into, or '' for none; {self._why(e)}") from None

    # -- the callback ------------------------------------------------------------------------------------
    def on_run_start(self, exp, loop) -> None:
        self.truncate(loop.start - 1)

    def on_round_stored(self, exp, rnd) -> None:
        self.write(rnd.index, rnd.metrics, rnd.client_rows)

    def on_finish(self, exp, loop, final: dict) -> None:
        self.close()

    # -- the files ---------------------------------------------------------------------------------------
    def close(self) -> None:
        """The run is over: a later `truncate` or `write` of this object is a `RuntimeError`."""
        self.closed = True

    def _open(self) -> None:
        if self.closed:
            raise RuntimeError(f"scalars files {self.rounds.name}, {self.clients.name}: closed when the run "
                               "finished; a new run makes its own `Scalars`")

    def _why(self, e: Exception) -> str:
        blocker = _file_in_the_way(self.dir)
        if blocker is not None:
            return f"{str(blocker)!r} is a file, not a folder"
        name = getattr(e, "filename", None)
        return f"{name}: {e.strerror}" if name and getattr(e, "strerror", None) else str(e)

    def _files(self) -> tuple[tuple[Path, tuple[str, ...]], ...]:
        return (self.rounds, self.ROUND_COLS), (self.clients, self.CLIENT_COLS)

    @staticmethod
    def _key(line: str, head: tuple[str, ...]) -> tuple[int, str] | None:
        """(round, tag or client) of a well-formed data row of a file with columns `head`; None for the
        header and anything damaged (torn, other columns, a round, client or value that is no number)."""
        try:
            (cells,) = csv.reader([line], strict=True)
        except (csv.Error, ValueError):                 # ValueError: an empty line (no row)
            return None
        per_client = head[1] == "client"
        ids = cells[:2] if per_client else cells[:1]
        if len(cells) != len(head) or not cells[1] or not all(c.isascii() and c.isdigit() for c in ids):
            return None
        for c in cells[2:]:
            if c == "" and per_client:                  # a client's score that was NaN (written empty)
                continue
            try:
                if not math.isfinite(float(c)):         # never written: NaN/Inf are cleaned to None
                    return None
            except ValueError:
                return None
        return int(cells[0]), cells[1]

    def truncate(self, after_round: int) -> None:
        """Keep the rows of rounds <= `after_round` (-1: none), each once, in round order, under the
        header."""
        self._open()
        for p, head in self._files():
            keep: dict[tuple[int, str], str] = {}
            try:
                lines = p.read_bytes().split(b"\n") if p.exists() else []
                for raw in lines:
                    try:
                        ln = raw.decode("utf-8").removesuffix("\r")
                    except UnicodeDecodeError:
                        continue
                    key = self._key(ln, head)
                    if key is not None and key[0] <= after_round:
                        keep.setdefault(key, ln)        # a kept round is never written twice: a copy is junk
                rows = [ln for _, ln in sorted(keep.items(), key=lambda kv: kv[0][0])]   # stable: round order
                tmp = p.with_name(p.name + ".tmp")
                try:
                    tmp.write_text("".join(f"{ln}\n" for ln in (",".join(head), *rows)))
                    os.replace(tmp, p)
                finally:
                    tmp.unlink(missing_ok=True)
            except OSError as e:
                raise StoreError(f"scalars file {p}: {e.strerror or e} (rewriting it for the resumed run)"
                                 ) from None

    def write(self, rnd: int, metrics: dict | None, clients: list[tuple] | None) -> None:
        """Append round `rnd`: its numeric metrics (sorted by tag; NaN/Inf, bools and non-numbers left out)
        and its per-client rows (NaN written empty)."""
        self._open()
        p = self.rounds
        try:
            with open(p, "a", newline="") as f:
                w = csv.writer(f, lineterminator="\n")
                for k, v in sorted((metrics or {}).items()):
                    v = _clean(v)
                    if isinstance(v, (int, float)) and not isinstance(v, bool):
                        w.writerow([rnd, k, v])
            if clients:
                p = self.clients
                with open(p, "a", newline="") as f:
                    w = csv.writer(f, lineterminator="\n")
                    w.writerows([[rnd, *map(_clean, c)] for c in clients])
        except OSError as e:
            raise StoreError(f"scalars file {p}: {e.strerror or e} (writing round {rnd})") from None
