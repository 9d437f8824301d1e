"""One process per run: an advisory `flock` on `<db>.ckpt/<run_id>.lock`.

The lock is taken when a run starts (or resumes) and released when it finishes, is interrupted or
fails. The kernel drops an `flock` when its process dies (even by `kill -9`), so a lock left by a dead
process is simply taken over; the pid written into the file is only for the message. The file is
removed on release; a taker that finds its locked file already unlinked (it lost a race with a
release) tries again, so two processes can never hold locks on two different files of one run.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
from pathlib import Path

from fedprism.errors import FedPrismError


class RunBusyError(FedPrismError):
    """The run is being executed by another process."""


class RunLock:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise RunBusyError naming the holder."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(50):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = _read(fd)
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise RunBusyError(f"run {self.path.stem} is running in another process"
                                       f"{' (' + holder + ')' if holder else ''}; lock {self.path}") from None
                raise
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if not same:                      # released and unlinked between our open and our flock
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode())
            self.fd = fd
            return
        raise RunBusyError(f"run {self.path.stem}: could not take {self.path} (it keeps changing)")

    @property
    def held(self) -> bool:
        return self.fd is not None

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)         # while still holding it: see the module docstring
        finally:
            os.close(self.fd)                         # closing drops the flock
            self.fd = None


def holder_gone(path: str | Path) -> bool:
    """True when no process runs the run of lock file `path`: there is no lock file (a run unlinks it when
    it ends), or the file names a process of this host that no longer exists (`kill -9`). Takes no lock
    and writes nothing, so a read-only command may ask; a holder on another host counts as alive."""
    try:
        text = Path(path).read_text().strip()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    pid, _, host = text.removeprefix("pid ").partition(" on ")
    if not pid.isdigit() or host != socket.gethostname():
        return False                              # being written right now, or another machine's
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def _read(fd: int) -> str:
    try:
        return os.pread(fd, 200, 0).decode(errors="replace").strip()
    except OSError:
        return ""
