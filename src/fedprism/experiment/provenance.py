"""What produced a run: recorded with it, compared before a stored result is reused.

A run's provenance is a JSON object in the `provenance` column of the store's `runs` table:

    version      the fedprism package version
    code         sha256 of the source file of the algorithm class and of the model class that ran
                 (`inspect.getsourcefile`, so a method or model defined in a plugin is covered too),
                 with the file's repository-relative or absolute path. A registered model is its
                 builder's file, together with its class's file when that is another file outside
                 torch: a builder returning `torch.nn.Sequential` is fingerprinted by its own code.
                 `text` is a second hash of the same file(s), over its Python tokens without comments,
                 docstrings and blank lines (`text_sha256`). A class or builder that is not fedprism's
                 own has its own source folded into both as written, and into a third, `tokens`, as its
                 tokens without comments, docstrings and blank lines (`_own_hashes`). `method_bases`: the same two hashes over
                 the files of the classes the algorithm inherits from, other than its own file and the
                 interface (`INTERFACE_MODULES`): FedPer's `partial.py`, FedProx's `fedavg.py`; absent
                 (None) for a method that inherits only the interface, and in runs recorded before it
                 existed, which are therefore compared on their own file alone. `method_helpers`: the
                 same two hashes over the modules of its own project that a plugin method imports,
                 directly or through each other (`helper_files`: the modules of its top-level package, or
                 for a method in a top-level module the modules in its file's folder and below), other
                 than the files of `method_bases`, with
                 their files and module names; absent for fedprism's own methods (their fingerprints are
                 those of every run stored before), for a method that imports none, and in runs recorded
                 before it existed (compared without it). Not covered: fedprism itself, installed
                 packages, the standard library, modules imported by a name computed at run time
                 (`importlib.import_module`), and data or configuration files a method reads
    data         sha256 over the arrays the run trained and evaluated on: the in-memory train/test
                 tensors after loading, padding and subsetting, and every client's train/test indices
                 (the partition). Hashing the decoded arrays reads the whole dataset (a sweep does
                 it once per data setting) and covers what no file checksum can: a changed loader,
                 normalisation, subset or partitioner. `None` when the process holds no data (a
                 Flower server).
    execution    threads (`torch.get_num_threads()`), engine and compile decision actually used,
                 device, torch and numpy versions, Python version, CPU model (/proc/cpuinfo)

Reuse rule (`check`): a stored run is returned, or resumed, only when its recorded code and data
fingerprints equal the current ones. Code counts as equal when the file hashes are equal, or when both
sides record a `tokens` or a `text` hash and those are equal: a run is not orphaned by an edit of a comment
or docstring, inside a plugin's class too. (A docstring that the code reads at run time, as `__doc__`,
would escape this; no method does.) A plugin's run recorded before `tokens` existed is compared by its
`text`, in which the class's comments counted (`BEFORE_TOKENS` says so when it differs). A run recorded
before `text` or `tokens` existed gains them the first time a write command (`run`, `sweep`) finds its
file hash equal to the current one (`with_text`). When they differ, a finished run is refused with
`ProvenanceMismatch`, naming what changed and how the entry point in use runs it again (`fedprism run
--fresh RUN_ID`, `fedprism sweep FILE --fresh`, `fedprism.run(..., fresh=True)`), and `fedprism verify
RUN` checks whether the new code still reproduces it; a run that did not finish is replaced
(`fedprism.experiment.fresh`). A run stored before provenance was recorded ("unknown": the
column is NULL) has no fingerprint to compare and is reused as before. Execution details (threads,
engine, versions, CPU) are recorded, never compared: they may change the last bits of a result, not
what it means.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import io
import platform
import sysconfig
import tokenize
from functools import lru_cache
from pathlib import Path
from typing import Any

from fedprism.errors import FedPrismError

# numpy and torch are imported where they are used: comparing fingerprints (`check`, `differences`) and
# hashing source files import neither, so a stored result is answered without them
# (fedprism.experiment.lookup)

#: keys of the provenance object that `check` compares (fingerprints); everything else is a record
COMPARED = (("code", "method"), ("code", "method_bases"), ("code", "method_helpers"), ("code", "model"), ("data",))
#: the code fingerprints that join several files (" + " in their `file`): followed again by `code_now`
JOINED = ("method_bases", "method_helpers")


class ProvenanceMismatch(FedPrismError):
    """A stored run was produced by other code or other data than the current ones. `run_id` and
    `differences` say which run and what differs; `fix` is the way to run it again from the entry point in
    use and `verify` the way to check whether the current code reproduces it, with the store's `--db` and
    in the Python form for a method registered in a process only (`fedprism.experiment.fresh`); `with_fix`
    gives the same refusal with another fix."""

    run_id: str = ""
    differences: tuple[str, ...] = ()
    verify: str | None = None

    @classmethod
    def of(cls, run_id: str, diff: list[str] | tuple[str, ...], fix: str | None = None,
           verify: str | None = None) -> "ProvenanceMismatch":
        fix = fix or f"`fedprism run --fresh {run_id}` re-runs it under the current code"
        check = verify or f"`fedprism verify {run_id}` checks whether the current code reproduces its first rounds"
        e = cls(f"run {run_id} is stored from other code or data ({'; '.join(diff)}); its results are not "
                f"reused. {fix}; {check}")
        e.run_id, e.differences, e.verify = run_id, tuple(diff), verify
        return e

    def with_fix(self, fix: str) -> "ProvenanceMismatch":
        """This refusal with `fix` as the way to run the run again (an entry point's own advice)."""
        return type(self).of(self.run_id, self.differences, fix, self.verify) if self.run_id else self


def sha256_file(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def text_sha256(path: str | Path) -> str | None:
    """sha256 of a Python file's tokens without comments, docstrings and blank lines, so that editing
    only those leaves it as it was; None when the file does not parse (`source_text_sha256`)."""
    return source_text_sha256(Path(path).read_text(encoding="utf-8"))


def source_text_sha256(src: str) -> str | None:
    """sha256 of Python source's tokens without comments, docstrings and blank lines; None when it does
    not parse. A docstring is the string statement that opens a module, class or function (as
    `ast.get_docstring` reads it); the statement's end (its NEWLINE or `;`) goes with it, so that adding or
    removing one changes nothing either. Indented source (a class defined in a function, as
    `inspect.getsource` gives it) is read inside an `if 1:` block, so it parses as it stands."""
    first = next((line for line in src.splitlines() if line.strip()), "")
    if first[:1].isspace():
        src = "if 1:\n" + src
    try:
        tree = ast.parse(src)
        toks = list(tokenize.generate_tokens(io.StringIO(src).readline))
    except (SyntaxError, tokenize.TokenError, ValueError):
        return None
    starts = {(d.lineno, d.col_offset)
              for node in ast.walk(tree)
              if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
              and node.body and isinstance(d := node.body[0], ast.Expr)
              and isinstance(d.value, ast.Constant) and isinstance(d.value.value, str)}
    h, in_doc = hashlib.sha256(), False
    for t in toks:
        if t.type in (tokenize.COMMENT, tokenize.NL):
            continue
        if in_doc or t.start in starts:      # the docstring statement, up to its NEWLINE or `;`
            in_doc = not (t.type == tokenize.NEWLINE or (t.type == tokenize.OP and t.string == ";"))
            continue
        h.update(f"{t.type}\x00{t.string}\x01".encode())
    return h.hexdigest()


@lru_cache(maxsize=256)
def _text_of(path: str, sha256: str) -> str | None:
    """`text_sha256(path)` once per file content (`sha256`): tokenizing costs far more than hashing the
    bytes, and a sweep fingerprints the same files for every run it checks."""
    return text_sha256(path)


def _file_hashes(path: Path) -> dict[str, str | None]:
    sha = sha256_file(path)
    return {"sha256": sha, "text": _text_of(str(path), sha)}


def _where(path: str) -> str:
    """A path to show: relative to the package's parent folder when inside it, else absolute."""
    import fedprism

    root = Path(inspect.getsourcefile(fedprism) or "").resolve().parent.parent
    p = Path(path).resolve()
    try:
        return p.relative_to(root).as_posix()
    except ValueError:
        return p.as_posix()


def _source_file(obj: Any) -> Path | None:
    """The source file that defines `obj` (a class, function or module), resolved; None if it has none."""
    try:
        path = inspect.getsourcefile(obj)
    except TypeError:
        return None
    return Path(path).resolve() if path and Path(path).is_file() else None


def source_fingerprint(obj: Any) -> dict[str, str] | None:
    """sha256 of the source file that defines `obj` (a class), and the file, or None if it has none."""
    cls = obj if inspect.isclass(obj) else type(obj)
    path = _source_file(cls)
    if path is None:
        return None
    return {**_own_hashes(cls, path), "file": _where(str(path)),
            "class": f"{cls.__module__}.{cls.__qualname__}"}


def _own_hashes(obj: Any, path: Path) -> dict[str, str | None]:
    """`_file_hashes(path)`, and for a class or builder that is not fedprism's own (a plugin, or registered
    in a script or a notebook) its own source folded in: two definitions under one name in one file, a
    notebook cell run again with other code, are other code. The source is folded in three times:
    as written into `sha256` and into `text` (so `text` still counts the comments inside the class: it is
    the hash every run recorded before `tokens` was compared by), and as its tokens without comments,
    docstrings and blank lines (`source_text_sha256`) into `tokens`, which is what an edit of only those
    leaves as it was. fedprism's own are their files' hashes alone (their `text` already leaves out every
    comment and docstring of the file), so stored runs of the built-in methods and models keep their
    fingerprints."""
    hashes = _file_hashes(path)
    if getattr(obj, "__module__", "").split(".")[0] == "fedprism":
        return hashes
    try:
        own = inspect.getsource(obj)
    except (OSError, TypeError):
        return hashes
    digest = hashlib.sha256(own.encode()).hexdigest()
    out = {k: None if v is None else hashlib.sha256(f"{v}:{digest}".encode()).hexdigest()
           for k, v in hashes.items()}
    tokens = source_text_sha256(own)
    out["tokens"] = (None if hashes["text"] is None or tokens is None
                     else hashlib.sha256(f"{hashes['text']}:{tokens}".encode()).hexdigest())
    return out


#: the interface every method implements: not a method's own code (changing it would orphan every run)
INTERFACE_MODULES = ("fedprism.algorithms.base", "fedprism.protocol")


def bases_fingerprint(cls: type) -> dict[str, str] | None:
    """The source files of the classes `cls` inherits from (its method resolution order), other than its
    own file, the interface (`INTERFACE_MODULES`) and Python's own (builtins, the standard library):
    FedPer's `partial.py`, FedProx's `fedavg.py`. One hash over their file hashes (and one over their text
    hashes), or None when `cls` inherits only from the interface."""
    files = _base_files(cls)
    if not files:
        return None
    return {**_joint([_file_hashes(p) for p in files]), "file": " + ".join(_where(str(p)) for p in files),
            "class": f"{cls.__module__}.{cls.__qualname__}"}


def _base_files(cls: type) -> list[Path]:
    """The files `bases_fingerprint` covers, in the order of the method resolution order."""
    own, stdlib = _source_file(cls), Path(sysconfig.get_paths()["stdlib"]).resolve()
    files: list[Path] = []
    for base in cls.__mro__[1:]:
        if base.__module__ in INTERFACE_MODULES or base.__module__ == "builtins":
            continue
        path = _source_file(base)                # `abc.ABC`, `typing.Generic`: Python's, not the method's
        if path is not None and path != own and path not in files and stdlib not in path.parents:
            files.append(path)
    return files


def helpers_fingerprint(cls: type) -> dict[str, Any] | None:
    """The project-local modules a plugin method imports (`helper_files`), other than the files of the
    classes it inherits from (those are `method_bases`): one hash over their file hashes
    and one over their text hashes (`_joint`), with their files and module names; None for fedprism's own
    methods (their fingerprints stay those of the runs stored before helpers were covered) and for a
    method that imports no module of its own project."""
    module = str(getattr(cls, "__module__", "") or "")
    own = _source_file(cls)
    if own is None or _top(module) == "fedprism":
        return None
    bases = set(_base_files(cls))                # fingerprinted as `method_bases` already: each file once
    found = [(n, p) for n, p in helper_files(module, own) if p not in bases]
    if not found:
        return None
    names, files = zip(*found)
    return {**_joint([_file_hashes(p) for p in files]), "file": " + ".join(_where(str(p)) for p in files),
            "class": f"{cls.__module__}.{cls.__qualname__}", "modules": list(names)}


def _top(module: str) -> str:
    return module.split(".", 1)[0]


def _outside_projects() -> list[Path]:
    """Folders whose modules are never a plugin's own: Python's standard library and the folders packages
    are installed into (site-packages, dist-packages)."""
    import site

    paths = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    try:
        paths.update(site.getsitepackages())
    except AttributeError:                       # a virtual environment's old `site` module
        pass
    paths.add(site.getusersitepackages() if hasattr(site, "getusersitepackages") else "")
    return [Path(p).resolve() for p in paths if p]


def _installed(path: Path, outside: list[Path]) -> bool:
    return (any(o == path or o in path.parents for o in outside)
            or any(part in ("site-packages", "dist-packages") for part in path.parts))


def _local_rule(module: str, own: Path):
    """Which imported modules belong to the method's own project, as (name_ok(name), file_ok(path)): for a
    method in a package (a dotted module name, or a package's `__init__.py`), the modules of the same
    top-level package; for a method in a top-level module (a plugin file, a script, `__main__`), the
    modules whose files lie in the method file's folder or below it. fedprism's own modules never do, nor
    anything installed (`_installed`: a single-file plugin installed into site-packages has no helpers, as
    everything beside it is another distribution's). None when no module can be local."""
    outside = _outside_projects()
    top = _top(module)
    if "." in module or own.name == "__init__.py":
        if top == "fedprism":
            return None
        return (lambda name: _top(name) == top), (lambda path: True)
    folder = own.parent
    if _installed(folder, outside):
        return None
    return ((lambda name: _top(name) != "fedprism"),
            (lambda path: folder in path.parents and not _installed(path, outside)))


@lru_cache(maxsize=512)
def _imported_names(path: str, sha256: str, module: str, is_package: bool) -> tuple[str, ...]:
    """The module names a Python file imports, anywhere in it (deferred imports inside functions too):
    `import a.b` gives `a.b`; `from a import b` gives `a` and `a.b` (b may be a submodule); relative
    imports are resolved against `module`. Read once per file content (`sha256`)."""
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    except (SyntaxError, ValueError, OSError):
        return ()
    out: list[str] = []
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".") if package else []
                if node.level - 1 > len(parts) or not parts:
                    continue                     # beyond the top-level package: not importable anyway
                base = ".".join(parts[:len(parts) - (node.level - 1)])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            if base:
                out.append(base)
                out += [f"{base}.{a.name}" for a in node.names if a.name != "*"]
    return tuple(dict.fromkeys(out))


def _module_file(name: str) -> Path | None:
    """The source file of module `name` (imported or importable), resolved; None when it has none or does
    not exist. `a.b` is looked up only once `a` is known to exist."""
    import importlib.util
    import sys

    mod = sys.modules.get(name)
    if mod is not None:
        f = getattr(mod, "__file__", None)
    else:
        parent = name.rpartition(".")[0]
        if parent and parent not in sys.modules and _module_file(parent) is None:
            return None
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError, AttributeError):
            return None
        f = spec.origin if spec is not None and spec.has_location else None
    if not f or not str(f).endswith(".py"):
        return None
    p = Path(f).resolve()
    return p if p.is_file() else None


def helper_files(module: str, own: Path) -> list[tuple[str, Path]]:
    """(module name, file) of every project-local module (`_local_rule`) that the method's module imports,
    directly or through another such module, other than the method's own file; in the order of their
    names. Imports are read from the files (`_imported_names`), not from what ran: a module loaded by
    `importlib.import_module("name")` or `__import__` is not seen."""
    rule = _local_rule(module, own)
    if rule is None:
        return []
    name_ok, file_ok = rule
    found: dict[Path, str] = {}
    todo, seen = [(module, own)], {own}
    while todo:
        name, path = todo.pop()
        for dep in _imported_names(str(path), sha256_file(path), name, path.name == "__init__.py"):
            if not name_ok(dep):
                continue                         # another package: not looked up
            f = _module_file(dep)
            if f is None or f in seen or not file_ok(f):
                continue
            seen.add(f)
            found[f] = dep
            todo.append((dep, f))
    return sorted(((n, p) for p, n in found.items()), key=lambda t: t[0])


def _joint(parts: list[dict]) -> dict[str, str | None]:
    """One fingerprint of several files, in order: sha256 over their sha256 hex digests, and over their
    text hashes when every file has one; and where a part has a `tokens` hash (a plugin's class or
    builder, `_own_hashes`), `tokens` over each part's `tokens`, else its `text`."""
    texts = [h["text"] for h in parts]
    out = {"sha256": hashlib.sha256("".join(h["sha256"] for h in parts).encode()).hexdigest(),
           "text": hashlib.sha256("".join(texts).encode()).hexdigest() if all(texts) else None}
    if any("tokens" in h for h in parts):
        tokens = [h["tokens"] if "tokens" in h else h["text"] for h in parts]
        out["tokens"] = hashlib.sha256("".join(tokens).encode()).hexdigest() if all(tokens) else None
    return out


def model_fingerprint(name: str, model: Any) -> dict[str, str] | None:
    """The code fingerprint of model `name` as built (`model`). A built-in model is its class's file. A
    registered model is its builder's file, and its class's too when that is another file outside torch:
    the class alone would be torch's own file for a builder that returns `nn.Sequential`, and a changed
    builder would not count as changed code."""
    import torch

    from fedprism.models import MODELS

    built = source_fingerprint(type(model))
    build = None if MODELS.is_builtin(name) else MODELS.get(name, "model").build
    path = _source_file(build) if build is not None else None
    if path is None:
        return built
    ours = {**_own_hashes(build, path), "file": _where(str(path)),
            "class": f"{getattr(build, '__module__', '?')}.{getattr(build, '__qualname__', repr(build))}"}
    cls_path = _source_file(type(model))           # None exactly when `built` is None
    if cls_path is None or cls_path == path or _source_file(torch).parent in cls_path.parents:
        return ours
    return {**_joint([ours, built]), "file": f"{ours['file']} + {built['file']}",
            "class": f"{ours['class']} -> {built['class']}"}


def _hash_tensor(h: "hashlib._Hash", x: Any) -> None:
    import numpy as np
    import torch

    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().contiguous().numpy()
    a = np.ascontiguousarray(np.asarray(x))
    h.update(f"{a.dtype.str}{a.shape}".encode())
    h.update(a.data)                    # the buffer itself (same bytes as tobytes()): no copy of the dataset


def data_fingerprint(fed: Any) -> str | None:
    """sha256 over a federation's train/test arrays and its clients' index lists, or None without data."""
    if fed is None or getattr(fed, "x_train", None) is None:
        return None
    import numpy as np

    h = hashlib.sha256()
    for name in ("x_train", "y_train", "x_test", "y_test"):
        _hash_tensor(h, getattr(fed, name))
    for name in ("train_idx", "test_idx"):
        for idx in getattr(fed, name, None) or []:
            _hash_tensor(h, np.asarray(idx, dtype=np.int64))
    pool = getattr(fed, "local_pool", "test")
    if pool != "test":                  # test_idx index the training pool (data.local_test = "split")
        h.update(f"local_pool={pool}".encode())
    return h.hexdigest()


@lru_cache(maxsize=1)
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def execution() -> dict[str, Any]:
    """How this process executes runs (threads, library versions, CPU)."""
    import sys

    import numpy as np
    import torch

    return {"threads": torch.get_num_threads(), "torch": torch.__version__, "numpy": np.__version__,
            "python": sys.version.split()[0], "cpu": cpu_model()}


def capture(exp: Any) -> dict[str, Any]:
    """The provenance of an `Experiment` about to run (its algorithm, model, federation and engine)."""
    from fedprism import __version__

    eng = getattr(exp, "engine", None)
    ex = execution()
    ex.update({"engine": type(eng).__name__ if eng is not None else None,
               "compile": bool(getattr(eng, "compiled", False)),
               "fuse_jobs": bool(getattr(eng, "fuses_jobs", False)),
               "cuda_graphs": bool(getattr(eng, "cuda_graphs", False)),
               "device": str(getattr(eng, "device", "") or "") or None})
    fused = {"train": getattr(eng, "stem", None) is not None, "eval": bool(getattr(eng, "eval_fused", False))}
    if any(fused.values()):                      # train.kernels / eval.kernels = fused, where it applied
        from fedprism.kernels.build import LIBRARIES, source_hash
        from fedprism.kernels.fused import vector_floats

        # which version of the kernels' C++, and the vector width it was built for
        ex["fused_kernels"] = {**fused, "source": source_hash(LIBRARIES["fused"].source),
                               "vector_floats": vector_floats()}
    if str(ex["device"]).startswith("cuda"):     # CUDA engines turn it on (engine.base.deterministic_cudnn)
        import torch

        ex["cudnn_deterministic"] = bool(torch.backends.cudnn.deterministic)
    algo = type(exp.algo) if getattr(exp, "algo", None) is not None else None
    return {"version": __version__,
            "code": {"method": source_fingerprint(algo) if algo is not None else None,
                     "method_bases": bases_fingerprint(algo) if algo is not None else None,
                     **_helpers(algo),
                     "model": _experiment_model(exp)},
            "data": data_fingerprint(getattr(exp, "fed", None)),
            "execution": ex}


def _helpers(cls: type | None) -> dict[str, Any]:
    """{"method_helpers": fingerprint} for a method that imports modules of its own project
    (`helpers_fingerprint`), else nothing: the provenance of a built-in method's run keeps the keys it had."""
    fp = helpers_fingerprint(cls) if cls is not None else None
    return {} if fp is None else {"method_helpers": fp}


def _experiment_model(exp: Any) -> dict[str, str] | None:
    model = getattr(exp, "model", None)
    if model is None:
        return None
    cfg, fed = getattr(exp, "cfg", None), getattr(exp, "fed", None)
    if cfg is None or fed is None:
        return source_fingerprint(type(model))
    from fedprism.experiment.federation import resolve_model_name

    return model_fingerprint(resolve_model_name(cfg["model"], fed.input_shape, fed.vocab_size), model)


def fingerprints(cfg: Any, memo: dict | None = None) -> dict[str, Any]:
    """The compared part of the provenance of a configuration, without building its engine: used to
    check a stored finished run before a sweep skips it. `memo` (one dict per sweep) keeps each data
    setting's fingerprint, input shape and class count, so a sweep that skips many runs hashes and
    partitions each data setting once."""
    from fedprism.algorithms import REGISTRY
    from fedprism.experiment.federation import build_federation, federation_key, resolve_model_name
    from fedprism.models import build_model

    memo = {} if memo is None else memo
    key = federation_key(cfg)
    if key not in memo:
        fed = build_federation(cfg)
        memo[key] = (data_fingerprint(fed), fed.input_shape, fed.num_classes, fed.vocab_size)
    data, input_shape, num_classes, vocab = memo[key]
    name = resolve_model_name(cfg["model"], input_shape, vocab)
    model = build_model(name, input_shape, num_classes, vocab_size=vocab, dataset=cfg["dataset"])
    cls = REGISTRY[cfg["method"]]
    return {"code": {"method": source_fingerprint(cls), "method_bases": bases_fingerprint(cls), **_helpers(cls),
                     "model": model_fingerprint(name, model)},
            "data": data}


def _get(d: dict | None, path: tuple[str, ...], key: str = "sha256") -> Any:
    for k in path:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    if isinstance(d, dict):
        return d.get(key)
    return d if key == "sha256" else None


#: the hashes of a code fingerprint that leave out comments, docstrings and blank lines: `tokens` (a
#: plugin's class or builder, its own source included as tokens) and `text` (the file's tokens; for a
#: plugin's class with its own source folded in as written)
TEXT_KEYS = ("tokens", "text")


def _same_text(stored: dict | None, current: dict | None, path: tuple[str, ...]) -> bool:
    """The same code up to comments, docstrings and blank lines: a `TEXT_KEYS` hash that both sides record
    and that is equal. Either suffices: an equal `text` means the same file tokens and the same class
    source as written, so the same `tokens` too."""
    for key in TEXT_KEYS:
        a, b = _get(stored, path, key), _get(current, path, key)
        if a is not None and a == b:
            return True
    return False


#: said of a plugin's code fingerprint stored without `tokens` that differs from the current one
BEFORE_TOKENS = ("stored before comments and docstrings inside a plugin's class stopped counting, so an "
                 "edit of only those reads as a change for this run")


def differences(stored: dict | None, current: dict | None) -> list[str]:
    """The compared fingerprints that both record and that differ ('unknown' on either side: no
    fingerprint to compare, so no difference). A plugin's fingerprint stored without `tokens` (before
    they were recorded), compared with one that has them, is said to be so (`BEFORE_TOKENS`): its
    difference may be an edit of comments inside the class, which that record cannot tell apart."""
    out = []
    for path in COMPARED:
        a, b = _get(stored, path), _get(current, path)
        if a is not None and b is not None and a != b and not _same_text(stored, current, path):
            what = "/".join(path)
            if path[0] == "code":
                f = ((current or {}).get("code") or {}).get(path[1]) or {}
                what = f"{path[1]} code ({f.get('file', '?')})"
            old = _get(current, path, "tokens") is not None and _recorded(stored, path, "tokens") is False
            out.append(f"{what}: stored {a[:12]}, now {b[:12]}" + (f" ({BEFORE_TOKENS})" if old else ""))
    return out


def _recorded(d: dict | None, path: tuple[str, ...], key: str) -> bool | None:
    """Whether the fingerprint at `path` has `key` (None: there is no fingerprint there)."""
    for k in path:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return key in d if isinstance(d, dict) else None


def with_text(stored: dict | None, current: dict | None) -> dict | None:
    """`stored` with the current `text` and `tokens` hashes added to each code fingerprint that lacks them
    and whose file hash equals the current one (the same code as written, so the same text); None when
    there is nothing to add. So a run stored before `tokens` existed is not orphaned by a later edit of a
    comment inside its plugin class once a write command has found it unchanged."""
    if not isinstance(stored, dict) or not isinstance(stored.get("code"), dict):
        return None
    out, added = {**stored, "code": dict(stored["code"])}, False
    for path in COMPARED:
        if path[0] != "code":
            continue
        fp = stored["code"].get(path[1])
        if not isinstance(fp, dict) or fp.get("sha256") is None or fp.get("sha256") != _get(current, path):
            continue
        new = {k: v for k in TEXT_KEYS if k not in fp and (v := _get(current, path, k)) is not None}
        if new:
            out["code"][path[1]], added = {**fp, **new}, True
    return out if added else None


def code_now(stored: dict | None) -> str | None:
    """Whether today's code still matches a stored run's code fingerprints, found from the classes (or
    builders) they name without building anything: "the same as stored" or "differs (...)"; None when a
    fingerprint cannot be followed (`code_state` says why). The data fingerprint needs the federation
    built, so it is not checked here."""
    answer, _ = _code_now(stored)
    return answer


def code_state(stored: dict | None) -> str:
    """`code_now`'s answer, or "cannot tell (WHY)" naming why a fingerprint cannot be followed: no code
    fingerprint recorded, a class that is not importable here (a method registered in a script or a
    notebook, a plugin not installed), a registered model of two files."""
    answer, why = _code_now(stored)
    return answer if answer is not None else f"cannot tell ({why})"


def _code_now(stored: dict | None) -> tuple[str | None, str]:
    """(`code_now`'s answer, '') or (None, why it cannot tell)."""
    import importlib

    code = (stored or {}).get("code")
    if not isinstance(code, dict):
        return None, "no code fingerprint recorded"
    now: dict[str, Any] = {}
    for part, fp in code.items():
        if fp is None:                           # nothing recorded for this part: nothing to compare
            continue
        if not isinstance(fp, dict):
            return None, f"the {part} fingerprint is not well formed"
        if part not in JOINED and " + " in str(fp.get("file", "")):
            return None, (f"the {part} fingerprint joins two files ({fp.get('file')}): a registered model's "
                          "builder and class are not followed here")
        name = str(fp.get("class", ""))
        module, _, qualname = name.rpartition(".")
        try:
            obj: Any = importlib.import_module(module)
            for attr in qualname.split("."):
                obj = getattr(obj, attr)
        except (ImportError, AttributeError, ValueError) as e:
            where = (" (defined in a script's __main__ or a notebook: registered in that process only)"
                     if module in ("__main__", "") else "")
            return None, f"class {name or '?'} is not importable here{where}: {type(e).__name__}: {e}"
        if part == "method_bases":               # the files of the classes it inherits from, followed again
            now[part] = bases_fingerprint(obj) if inspect.isclass(obj) else None
            if now[part] is None:
                return f"differs ({part}: it inherits from no file outside the interface now)", ""
            continue
        if part == "method_helpers":             # the modules of its project it imports, read again
            now[part] = helpers_fingerprint(obj) if inspect.isclass(obj) else None
            if now[part] is None:
                return f"differs ({part}: it imports no module of its own project now)", ""
            continue
        path = _source_file(obj)
        if path is None:
            return None, f"{name} has no source file here"
        now[part] = {**_own_hashes(obj, path), "file": _where(str(path))}
    if not now:
        return None, "no code fingerprint recorded"
    diff = differences({"code": code}, {"code": now})
    return (f"differs ({'; '.join(diff)})" if diff else "the same as stored"), ""


def check(run_id: str, stored: dict | None, current: dict | None, fix: str | None = None,
          verify: str | None = None) -> None:
    """Raise `ProvenanceMismatch` when the stored run was produced by other code or data; `fix`: how the
    entry point in use runs it again (default: `fedprism run --fresh RUN_ID`), `verify`: how it checks the
    run (default: `fedprism verify RUN_ID`; `fedprism.experiment.fresh.verify_hint`)."""
    diff = differences(stored, current)
    if diff:
        raise ProvenanceMismatch.of(run_id, diff, fix, verify)


def set_threads(cfg: Any) -> None:
    """Apply the `threads=` execution key (0: leave torch's setting as it is)."""
    import torch

    n = int(cfg.get("threads", 0) or 0)
    if n > 0 and torch.get_num_threads() != n:
        torch.set_num_threads(n)
