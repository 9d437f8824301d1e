"""One registry for every kind of component: methods, datasets, models and partitions.

A component is one module. Built-in components are *discovered* without being imported: a registry
knows the package that holds them, and each module of that package named like the component (module
`fedavg.py` holds the method `fedavg`) registers itself when it is imported. `get(name)` imports
exactly the module it needs, so a run imports the method, dataset, model and partition it uses and
nothing else.

Components from other packages come through the entry-point groups `fedprism.methods`,
`fedprism.datasets`, `fedprism.models` and `fedprism.partitions` (read the first time a name is not
found among the built-ins), or are registered in-process with `Registry.register`. Built-ins and
plugins take the same path after that: the same `get`, `names`, listing and did-you-mean errors.

This module imports nothing of fedprism but `errors`: every layer may use it.
"""

from __future__ import annotations

import difflib
import importlib
import pkgutil
import threading
import warnings
from importlib.metadata import entry_points
from typing import Any, Callable, Generic, Iterator, TypeVar

from fedprism.errors import ConfigError

T = TypeVar("T")

KINDS = ("method", "dataset", "model", "partition")

#: where each kind's plugin is explained: its interface and how to declare it as an entry point
DOCS = {"method": "docs/writing-a-method.md", "dataset": "docs/adding-a-dataset.md",
        "model": "docs/adding-a-model.md", "partition": "docs/adding-a-partition.md"}


def suggest(key: str, valid: list[str] | tuple[str, ...], quote: bool = False) -> str:
    """' (did you mean X?)' for the entry of `valid` closest to `key` (difflib ratio >= 0.6), else ''.

    `quote` writes X as a Python string literal (labels with spaces). A dotted key (`fedprsim.k`) whose
    whole does not match is matched part by part."""
    valid = list(valid)
    best = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if not best and "." in key:
        head, tail = key.split(".", 1)
        heads = difflib.get_close_matches(head, sorted({v.split(".", 1)[0] for v in valid if "." in v}), n=1)
        if heads:
            best = difflib.get_close_matches(f"{heads[0]}.{tail}", valid, n=1, cutoff=0.6)
    if not best:
        return ""
    return f" (did you mean {best[0]!r}?)" if quote else f" (did you mean {best[0]}?)"


class Registry(Generic[T]):
    """Name -> component for one kind.

    kind:      "method", "dataset", "model" or "partition" (used in messages and the config key).
    package:   the package whose modules are the built-in components (module name == component name);
               `skip` names modules of it that hold shared code, not a component.
    check:     called as `check(name, obj)` on every registration; raises TypeError/ValueError.
    make:      called as `make(name, obj)` before `check`: turns what is registered into the component
               (a model registry wraps a bare `build` function into its spec); default: `obj` as is.

    Besides `get`/`names`, a registry reads like the dict it replaces: `reg[name]`, `name in reg`,
    `reg.items()`, `len(reg)`, `reg[name] = obj` (registers), `reg.pop(name)`, and `find(name)` where a
    dict's `get(name)` gave None for an unknown name.
    """

    def __init__(self, kind: str, package: str | None = None, *, skip: tuple[str, ...] = (),
                 check: Callable[[str, Any], None] | None = None, make: Callable[[str, Any], T] | None = None):
        self.kind, self.package, self.skip, self.check, self.make = kind, package, tuple(skip), check, make
        self.group = f"fedprism.{kind}s"
        self._items: dict[str, T] = {}
        self._own: dict[str, T] = {}          # each built-in as its module last registered it (survives `pop`)
        self._builtin_modules: dict[str, str] | None = None     # name -> module, discovered lazily
        self._plugins_loaded = False
        self._lock = threading.RLock()
        self._families: dict[str, str] = {}   # prefix -> "module:function" making the components `prefix:rest`
        self._made: dict[str, T] = {}         # components made by a family, by full name (not listed in names())

    # -- families --------------------------------------------------------------------------------
    def family(self, prefix: str, factory: str) -> None:
        """Names of the form ``prefix:rest`` (``hf:mnist``) are components made on first use by
        ``factory`` (``"module:function"``, imported then), called as ``function(name)`` with the whole
        name; `make` and `check` apply as to a registration. A family's components are not listed by
        `names` (there is one per name anyone writes), and `unknown` / `not_found` mention the prefix."""
        if not prefix or ":" in prefix or "." in prefix or ":" not in factory:
            raise ValueError(f"a family prefix is a word without ':' or '.', and its factory 'module:function'; "
                             f"got {prefix!r}, {factory!r}")
        with self._lock:
            self._families[prefix] = factory

    def families(self) -> list[str]:
        """The family prefixes, sorted (``["hf"]``)."""
        return sorted(self._families)

    def family_of(self, name: object) -> str | None:
        """The family prefix `name` belongs to (``hf`` for ``hf:mnist``), or None."""
        if isinstance(name, str) and ":" in name:
            prefix = name.split(":", 1)[0]
            return prefix if prefix in self._families else None
        return None

    def _make_member(self, name: str) -> T:
        with self._lock:
            if name in self._made:
                return self._made[name]
            module, _, func = self._families[self.family_of(name)].partition(":")
            obj = getattr(importlib.import_module(module), func)(name)
            if self.make is not None:
                obj = self.make(name, obj)
            if self.check is not None:
                self.check(name, obj)
            self._made[name] = obj
            return obj

    # -- discovery -------------------------------------------------------------------------------
    def _builtins(self) -> dict[str, str]:
        if self._builtin_modules is None:
            found: dict[str, str] = {}
            if self.package is not None:
                pkg = importlib.import_module(self.package)
                for m in pkgutil.iter_modules(pkg.__path__):
                    if m.name.startswith("_") or m.name in self.skip:
                        continue
                    found[m.name] = f"{self.package}.{m.name}"
            self._builtin_modules = found
        return self._builtin_modules

    def is_builtin(self, name: str) -> bool:
        return name in self._builtins()

    def load_plugins(self, force: bool = False) -> None:
        """Import the entry points of this kind's group (once per process unless `force`). A plugin that
        fails to import or to register is skipped with a warning naming it: one broken package cannot
        stop fedprism."""
        with self._lock:
            if self._plugins_loaded and not force:
                return
            self._plugins_loaded = True
            for ep in entry_points(group=self.group):
                try:
                    obj = ep.load()
                    if self._items.get(ep.name) is not obj:
                        self.register(obj, name=ep.name, _plugin=True)
                except Exception as e:  # noqa: BLE001 - a broken plugin must not break the built-ins
                    warnings.warn(f"fedprism plugin {ep.name!r} ({ep.value}) of {self.group} failed to load: "
                                  f"{type(e).__name__}: {e}", stacklevel=2)

    # -- registration ----------------------------------------------------------------------------
    def register(self, obj: Any = None, *, name: str | None = None, _plugin: bool = False) -> Any:
        """Register `obj` under `name` (default: `obj.name`). Usable as `@reg.register` or
        `@reg.register(name="x")`. Registering a name again replaces the earlier entry (a notebook cell
        run twice), except a built-in's name: a plugin cannot silently stand in for a built-in."""
        if obj is None:
            return lambda o: self.register(o, name=name, _plugin=_plugin)
        key = name if name is not None else getattr(obj, "name", None)
        if not isinstance(key, str) or not key or "." in key or any(c.isspace() for c in key):
            raise ValueError(f"a {self.kind} name is a non-empty string without dots or spaces, not {key!r}")
        if self.make is not None:
            obj = self.make(key, obj)
        if self.check is not None:
            self.check(key, obj)
        with self._lock:
            module = getattr(obj, "__module__", "") or ""
            home = self._builtins().get(key)
            if home is not None and not (module == home or module.startswith(home + ".")):
                raise ValueError(f"{key!r} is the built-in {self.kind} of {home}; give yours a name of its own")
            self._items[key] = obj
            if home is not None:
                self._own[key] = obj
        return obj

    def unregister(self, name: str) -> None:
        """Forget an in-process registration (tests, notebooks). Built-ins come back on the next `get`."""
        self.pop(name)

    def pop(self, name: str, default: Any = None) -> Any:
        """Forget `name` and return what it was (`default` if nothing was registered under it). A built-in
        comes back, as its module last registered it, on the next `get`."""
        with self._lock:
            return self._items.pop(name, default)

    # -- lookup ----------------------------------------------------------------------------------
    def get(self, name: str, key: str | None = None) -> T:
        """The component `name`, importing its module if it is a built-in not yet imported. Unknown names
        raise ConfigError naming the config key (`key`, default the kind), the value and the choices."""
        with self._lock:
            if name in self._items:
                return self._items[name]
            if self.family_of(name) is not None:
                return self._make_member(name)
            if isinstance(name, str) and name in self._own:       # popped built-in: its module ran already
                self._items[name] = self._own[name]
                return self._items[name]
            module = self._builtins().get(name) if isinstance(name, str) else None
            if module is not None:
                importlib.import_module(module)
                if name in self._items:
                    return self._items[name]
                raise RuntimeError(f"module {module} did not register the {self.kind} {name!r} (a module of "
                                   f"shared code in {self.package} belongs in its registry's `skip`)")
            self.load_plugins()
            if name in self._items:
                return self._items[name]
        raise self.not_found(name, key)

    def plugin_hint(self) -> str:
        """How a plugin's component of this kind becomes known to every entry point."""
        where = f"; {DOCS[self.kind]}" if self.kind in DOCS else ""
        return (f"a {self.kind} from a plugin must be installed or on PYTHONPATH as an entry point (group "
                f"{self.group}{where})")

    def not_found(self, name: object, key: str | None = None, also: tuple[str, ...] = ()) -> ConfigError:
        """The error for a name that no built-in, entry point or registration knows, naming the config key
        (`key`, default the kind), the value, the choices (`also`: values the key takes besides the
        names, such as a model's `auto`), the nearest one (did-you-mean) and how a plugin's component is
        made known (`plugin_hint`)."""
        names = [*also, *self.names()]
        near = suggest(name.lower(), names) if isinstance(name, str) else ""
        fams = "".join(f", {p}:NAME" for p in sorted(self._families))
        return ConfigError(key or self.kind, name, f"one of {', '.join(names)}{fams}{near}; {self.plugin_hint()}")

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        if name in self._items or name in self._builtins() or self.family_of(name) is not None:
            return True
        self.load_plugins()
        return name in self._items

    def names(self) -> list[str]:
        """Every known name, built-in or plugin, sorted; imports no built-in module."""
        self.load_plugins()
        return sorted(set(self._builtins()) | set(self._items))

    def all(self) -> dict[str, T]:
        """Every component, imported (for listings such as `fedprism methods`)."""
        return {n: self.get(n) for n in self.names()}

    def find(self, name: str) -> T | None:
        """The component `name`, or None when no such name is known (a dict's `get`)."""
        return self.get(name) if name in self else None

    def unknown(self, name: object, what: str | None = None) -> str:
        """'no method 'x' (did you mean y?); the methods: a, b': the message for a name not registered
        (commands that list components say it this way; `get` raises a ConfigError naming the key)."""
        names = self.names()
        hint = suggest(name, names) if isinstance(name, str) else ""
        return (f"no {what or self.kind} {name!r}{hint}; the {what or self.kind}s: {', '.join(names)}; "
                f"{self.plugin_hint()}")

    def __getitem__(self, name: str) -> T:
        return self.get(name)

    def __setitem__(self, name: str, obj: T) -> None:
        self.register(obj, name=name)

    def keys(self) -> list[str]:
        return self.names()

    def values(self) -> list[T]:
        return list(self.all().values())

    def items(self) -> list[tuple[str, T]]:
        return list(self.all().items())

    def __len__(self) -> int:
        return len(self.names())

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {len(self.names())} entries)"
