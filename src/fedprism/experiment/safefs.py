"""Files beside a results store, opened without following links.

A results store is a file someone may have received (a part of a sweep, a colleague's archive), and
the folders fedprism keeps beside it (`<db>.ckpt/`: run locks, checkpoints, `state.storage=mmap` row
folders; `<db>.final/`: kept final states) may have come with it. A symbolic link planted there, or a
FIFO in place of a lock file, must not make fedprism open, truncate, write or delete a file elsewhere,
nor hang it. So every folder fedprism makes beside a store is created owner-only (0700, whatever the
umask) and refused when it is a link or not a folder, and every file in it is opened with `O_NOFOLLOW`
and `O_NONBLOCK` and refused unless it is a regular file.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path

from fedprism.errors import FedPrismError

#: the mode of a folder fedprism creates beside a store: owner only
DIR_MODE = 0o700


class UnsafePath(FedPrismError, OSError):
    """A path beside a store is a symbolic link, a special file, or a folder others may write."""


def _refuse(path: Path, what: str) -> UnsafePath:
    return UnsafePath(f"{path} {what}; fedprism never follows links or opens special files beside a results "
                      "store (remove it, or use another --db)")


def private_dir(path: str | Path) -> Path:
    """`path` as a folder of this user that only it can write: created 0700 (its parents as `mkdir -p`
    would, they are the user's choice of store path), or an existing folder whose group and other write
    bits are cleared. A link, a file, or a folder of another user that others may write is `UnsafePath`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(path, DIR_MODE)
        os.chmod(path, DIR_MODE, follow_symlinks=False)   # mkdir's mode is masked by the umask: never wider
        return path
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise _refuse(path, "is a symbolic link")
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(path, "is not a folder")
    if st.st_mode & 0o022:
        if st.st_uid != os.geteuid():
            raise _refuse(path, "is a folder of another user that others may write")
        os.chmod(path, stat.S_IMODE(st.st_mode) & ~0o022 & 0o777)
    return path


def open_regular(path: str | Path, flags: int, mode: int = 0o600) -> int:
    """`os.open(path, flags)` that never follows a link in the last component and never blocks on a FIFO
    or a device: anything but a regular file is closed again and `UnsafePath`. Returns the descriptor
    (blocking, close-on-exec)."""
    path = Path(path)
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _refuse(path, "is a symbolic link") from None
        if e.errno in (errno.ENXIO, errno.EWOULDBLOCK):      # a FIFO without a reader opened for writing
            raise _refuse(path, "is not a regular file") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _refuse(path, "is not a regular file")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_file(path: str | Path, mode: str = "rb"):
    """A Python file object for `path` opened as `open_regular` does: 'rb', 'r+b', 'wb' (truncates) or
    'xb' (a new file; an existing one, link or not, is `FileExistsError`)."""
    flags = {"rb": os.O_RDONLY, "r+b": os.O_RDWR, "wb": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
             "xb": os.O_WRONLY | os.O_CREAT | os.O_EXCL}[mode]
    return os.fdopen(open_regular(path, flags), mode.replace("x", "w"))


def is_regular(path: str | Path) -> bool:
    """Whether `path` itself (not what a link names) is a regular file."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except (OSError, ValueError):
        return False


def is_real_dir(path: str | Path) -> bool:
    """Whether `path` itself (not what a link names) is a folder."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except (OSError, ValueError):
        return False


def write_atomic(path: str | Path, data: bytes) -> None:
    """Write `data` to `path` through a new temporary file beside it (created exclusively, so a planted
    link there is never written through) and `os.replace` (which replaces a link, never its target)."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        with open_file(tmp, "xb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
