"""glibc allocator tuning.

PyTorch's CPU tensors use glibc malloc; large activation buffers are returned to the OS on free and
page-faulted back on the next call, which halves the speed of batched evaluation. Raising the mmap and
trim thresholds to 1 GiB keeps them. Set FEDPRISM_NO_MALLOPT=1 to skip.
"""

from __future__ import annotations

import ctypes
import os
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_done = False


def tune_allocator(threshold: int = 1 << 30) -> bool:
    """Set glibc's M_TRIM_THRESHOLD and M_MMAP_THRESHOLD once; return True if it took effect."""
    global _done
    if _done or os.environ.get("FEDPRISM_NO_MALLOPT") or not sys.platform.startswith("linux"):
        return _done
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_TRIM_THRESHOLD, threshold) == 1 and libc.mallopt(_M_MMAP_THRESHOLD, threshold) == 1
    except OSError:
        return False
    _done = bool(ok)
    return _done
