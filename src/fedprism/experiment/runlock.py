"""One process per run: an advisory `flock` on `<db>.ckpt/<run_id>.lock`.

The lock is taken when a run starts (or resumes) and released when it finishes, is interrupted or
fails. The kernel drops an `flock` when its process dies (even by `kill -9`), so a lock left by a dead
process is simply taken over; the pid written into the file is only for the message. The file is
removed on release; a taker that finds its locked file already unlinked (it lost a race with a
release) tries again, so two processes can never hold locks on two different files of one run.

The lock file is opened without following links and without blocking (`safefs.open_regular`) inside
an owner-only folder (`safefs.private_dir`): a link or a FIFO planted at `<run_id>.lock` is refused,
never truncated, written or waited on, and a lock that fails after its `flock` was taken closes its
descriptor (so the process keeps no lock it does not know of).
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
from pathlib import Path

from fedprism.errors import FedPrismError
from fedprism.experiment.safefs import is_regular, open_regular, private_dir


class RunBusyError(FedPrismError):
    """The run is being executed by another process."""


class RunLock:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise RunBusyError naming the holder (`safefs.UnsafePath` when the lock file is
        a link or not a regular file)."""
        private_dir(self.path.parent)
        for _ in range(50):
            fd = open_regular(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError as e:
                    if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                        holder = _read(fd)
                        raise RunBusyError(f"run {self.path.stem} is running in another process"
                                           f"{' (' + holder + ')' if holder else ''}; lock {self.path}") from None
                    raise
                try:
                    now = os.lstat(self.path)
                    same = os.fstat(fd).st_ino == now.st_ino and is_regular(self.path)
                except FileNotFoundError:
                    same = False
                if same:
                    os.ftruncate(fd, 0)
                    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode())
                    self.fd, fd = fd, None
                    return
            finally:
                if fd is not None:            # refused, failed, or released and unlinked meanwhile: retry
                    os.close(fd)
        raise RunBusyError(f"run {self.path.stem}: could not take {self.path} (it keeps changing)")

    @property
    def held(self) -> bool:
        return self.fd is not None

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            try:                                      # while still holding it: see the module docstring
                if os.lstat(self.path).st_ino == os.fstat(self.fd).st_ino:
                    self.path.unlink()                # only the file this lock holds, never another put there
            except FileNotFoundError:
                pass
        finally:
            os.close(self.fd)                         # closing drops the flock
            self.fd = None


def holder_gone(path: str | Path | None) -> bool:
    """True when no process runs the run of lock file `path`: there is no lock file (a run unlinks it when
    it ends), or the file names a process of this host that no longer exists (`kill -9`). Takes no lock
    and writes nothing, so a read-only command may ask; a holder on another host counts as alive."""
    if path is None:                              # `Store.lock_path` of an id that is no run id: no file
        return False
    try:
        fd = open_regular(path, os.O_RDONLY)
    except FileNotFoundError:
        return True
    except OSError:                               # a link, a FIFO, unreadable: nothing to tell from it
        return False
    try:
        text = _read(fd)
    finally:
        os.close(fd)
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
