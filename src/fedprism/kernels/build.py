"""Building, caching and loading the kernels' C++ libraries, one library at a time.

Each library (`LIBRARIES`) is compiled with the system's C++ compiler (``$CXX``, else g++) for this CPU's
instruction set (``-march=native``; ``$FEDPRISM_KERNEL_MARCH`` names another target, e.g. ``x86-64-v3``
for AVX2 nodes from a build host with AVX-512) and cached under ``~/.cache/fedprism/kernels``
(``$FEDPRISM_CACHE/kernels``), named by a key: a hash of the source, the torch version, the CPU's flags,
the compiler and the target (`library_path`). A build takes about a minute on a 2-core VM, so it is made
once, at set-up (`fedprism kernels build`, which ``bash bootstrap.sh`` runs), or on the first run that
asks for the kernels explicitly.

A failed build is remembered beside it (`failure_path`: the compiler's message, under the same key), so
that no later process, e.g. each worker of a sweep, spends another minute failing again; a new source,
torch, CPU, compiler or target is a new key and is tried afresh, and ``fedprism kernels build`` forgets
the failure and tries again. Concurrent builds of one library (sweep workers starting together) take a
file lock: one compiles, the others wait and load its result. The rename into place is atomic, and a
damaged cached copy (truncated, another ABI) is rebuilt once.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from fedprism.machine import cache_root, cpu_flags

CSRC = Path(__file__).with_name("csrc")


@dataclass(frozen=True)
class Library:
    """One of the kernels' shared libraries: its name (`fedprism kernels status`), its C++ source and the
    ops it registers under ``torch.ops.fedprism_kernels``."""

    name: str
    source: Path
    ops: tuple[str, ...]


#: the kernels' libraries, each built, cached, remembered as failed and loaded on its own
LIBRARIES: dict[str, Library] = {
    "fused": Library("fused", CSRC / "fused_stem.cpp",
                     ("vector_floats", "stem_forward", "stem_train_forward", "stem_backward", "block_backward")),
}

_lock = threading.Lock()
_state: dict[str, tuple[bool, str | None]] = {}     # library name -> (loaded, why not) in this process
_loaded: dict[str, Path] = {}                       # library name -> the file loaded into this process


class KernelBuildError(RuntimeError):
    """A library could not be built or loaded (the message says why)."""


def cache_dir() -> Path:
    """``$FEDPRISM_CACHE/kernels``, else ``~/.cache/fedprism/kernels`` (beside the data cache)."""
    return cache_root() / "kernels"


def compiler() -> str:
    """The C++ compiler: ``$CXX``, else ``g++``."""
    return os.environ.get("CXX", "") or "g++"


def march() -> str:
    """The compiler's target (``-march=``): ``$FEDPRISM_KERNEL_MARCH``, else ``native``."""
    return os.environ.get("FEDPRISM_KERNEL_MARCH", "") or "native"


def _cpu_flags() -> str:
    """The CPU's flags as one string (part of the build's key), else the processor's name."""
    flags = cpu_flags()
    return " ".join(flags) if flags is not None else platform.processor()


def source_hash(source: Path) -> str:
    """The first 16 hex digits of a kernel's C++ source's sha256: a run's provenance records it, since the
    engine's code is not part of a run's fingerprint and a change of the kernels' summation order changes
    a fused run's numbers at float32 rounding."""
    return hashlib.sha256(source.read_bytes()).hexdigest()[:16]


def build_key(source: Path, cxx: str | None = None) -> str:
    """The cache key of a build of `source` on this machine: a hash of the source, the torch version, the
    CPU's flags, the compiler and the target (``native`` keeps the names of the builds made before the
    target could be chosen)."""
    cxx = cxx or compiler()
    target = "" if march() == "native" else f"-march={march()}"
    return hashlib.sha256(source.read_bytes() + torch.__version__.encode() + _cpu_flags().encode()
                          + cxx.encode() + target.encode()).hexdigest()[:16]


def library_path(lib: Library, cxx: str | None = None) -> Path:
    """Where this machine's build of `lib` is cached (named by its source's name and `build_key`)."""
    return cache_dir() / f"{lib.source.stem}_{build_key(lib.source, cxx)}.so"


def failure_path(lib: Library, cxx: str | None = None) -> Path:
    """Where a failed build of `lib` under this key is remembered (the reason, as text)."""
    return library_path(lib, cxx).with_suffix(".failed")


def _compile(cxx: str, out: Path, source: Path) -> None:
    from torch.utils.cpp_extension import include_paths, library_paths

    libs = library_paths()
    cmd = [cxx, "-O3", f"-march={march()}", "-fopenmp", "-shared", "-fPIC", "-std=c++17",
           f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
           *[f"-I{p}" for p in include_paths()], str(source), "-o", str(out),
           *[f"-L{p}" for p in libs], "-lc10", "-ltorch_cpu", "-ltorch", *[f"-Wl,-rpath,{p}" for p in libs]]
    try:
        r = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KernelBuildError(f"{cxx} could not run: {e}") from None
    if r.returncode != 0:
        target = "" if march() == "native" else f" (target -march={march()} from $FEDPRISM_KERNEL_MARCH)"
        raise KernelBuildError(f"{cxx} failed ({r.returncode}){target}: {r.stderr.strip()[-800:]}")


@contextmanager
def _build_lock(lib_file: Path):
    """An exclusive lock on `lib_file`'s build (a ``.lock`` file beside it) where the OS has ``fcntl``."""
    try:
        import fcntl
    except ImportError:                    # Windows: no lock (the kernels do not build there anyway)
        yield
        return
    with open(lib_file.with_suffix(".lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _compile_into(cxx: str, lib: Library, out: Path) -> None:
    # a pause of tens of seconds on a 2-core VM, once per machine: said, so that it is not taken for a hang
    print(f"fedprism: compiling the {lib.name} CPU kernels for this machine into {out.parent} (once)",
          file=sys.stderr, flush=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        _compile(cxx, Path(tmp), lib.source)
        os.replace(tmp, out)                   # atomic: a concurrent build wins or loses whole
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def remembered_failure(lib: Library) -> str | None:
    """The reason a build of `lib` under this machine's key failed earlier, or None."""
    try:
        return failure_path(lib).read_text(errors="replace").strip() or "(no message)"
    except OSError:
        return None


def build(lib: Library, force: bool = False, retry: bool = False) -> Path:
    """This machine's build of `lib`, compiled if it is not cached (`force`: compiled again even so). A failure
    is remembered under the key (`failure_path`) and raised again without compiling, unless `retry` or
    `force` (``fedprism kernels build`` retries)."""
    cxx = compiler()
    if shutil.which(cxx) is None:
        raise KernelBuildError(f"no C++ compiler {cxx!r} on PATH (set CXX)")
    out, failed = library_path(lib, cxx), failure_path(lib, cxx)
    if not force and out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(out):
        if not force and out.exists():         # built by another process while this one waited
            return out
        if not (force or retry):
            why = remembered_failure(lib)
            if why is not None:
                raise KernelBuildError(f"the build failed earlier ({failed}; `fedprism kernels build` tries "
                                       f"again): {why}")
        failed.unlink(missing_ok=True)
        try:
            _compile_into(cxx, lib, out)
        except KernelBuildError as e:
            failed.write_text(str(e))
            raise
    return out


def _register(lib: Library) -> None:
    from fedprism.kernels import fused

    fused.register_ops(lib.ops)


def load(name: str = "fused") -> bool:
    """Build (if needed) and load the library `name` into this process; False, with `unavailable_reason`,
    if that fails. Each library's verdict is its own: one that cannot be built leaves the others usable."""
    lib = LIBRARIES[name]
    with _lock:
        if name in _state:
            return _state[name][0]
        if name in _loaded:                    # loaded before `_forget`: an op namespace registers once
            _state[name] = (True, None)
            return True
        try:
            path = build(lib)
            try:
                torch.ops.load_library(str(path))
            except OSError:
                path = build(lib, force=True)  # a damaged cached copy (truncated, another ABI): once more
                torch.ops.load_library(str(path))
            _loaded[name] = path
            _register(lib)                     # the ops' fake and vmap rules: once per process, too
            _state[name] = (True, None)
        except Exception as e:  # noqa: BLE001 - any failure means: run PyTorch's kernels
            _state[name] = (False, f"{type(e).__name__}: {e}")
        return _state[name][0]


def built(name: str = "fused") -> bool:
    """True when the library `name` is built for this machine (cached under its key), or loaded."""
    return _state.get(name, (False,))[0] or library_path(LIBRARIES[name]).exists()


def unavailable_reason(name: str = "fused") -> str | None:
    """Why `load(name)` failed in this process (None when it did not fail, or was not tried)."""
    return _state.get(name, (True, None))[1]


def status() -> list[dict]:
    """One row per library: its name, source, state on this machine (``loaded``, ``built``, ``failed``
    with the remembered reason, or ``not built``), the cached file and the compiler and target."""
    rows = []
    for name, lib in LIBRARIES.items():
        path = library_path(lib)
        why = remembered_failure(lib)
        state = ("loaded" if _state.get(name, (False,))[0] else "built" if path.exists()
                 else "failed" if why is not None else "not built")
        rows.append({"library": name, "source": lib.source.name, "source_sha256": source_hash(lib.source),
                     "state": state, "path": str(path), "compiler": compiler(), "target": march(),
                     "why": why if state == "failed" else None})
    return rows


def _forget(name: str) -> None:
    """Drop this process's verdict on `name` (tests; `fedprism kernels build` after a failure)."""
    with _lock:
        _state.pop(name, None)


__all__ = ["LIBRARIES", "KernelBuildError", "Library", "build", "build_key", "built", "cache_dir", "compiler",
           "failure_path", "library_path", "load", "march", "remembered_failure", "source_hash", "status",
           "unavailable_reason"]
