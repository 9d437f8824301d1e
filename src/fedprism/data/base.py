"""What a dataset is to the rest of fedprism: a :class:`Dataset` in memory, described by a
:class:`DatasetSpec` registered on :data:`DATASETS`.

A dataset is one module. The built-in ones are the modules of :mod:`fedprism.data.sets` (module
``usps.py`` holds the dataset ``usps``); each declares one ``DatasetSpec`` and registers it. Datasets of
other packages come through the ``fedprism.datasets`` entry-point group or
``fedprism.register_dataset``; a bare loader ``load(pad32, root) -> Dataset`` registered there is
wrapped into a spec that declares nothing else (its classes and shape are known once it has loaded).

Everything the run, report, CLI and Flower layers need to know about a dataset is read from its spec:
class count and names, input shape, normalisation, whether and how its samples carry their natural
client, whether ``data.pad32=auto`` pads it, which config keys feed its loader, and its files with their
checksums and download mirrors. Nothing outside a dataset's own module names it.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fedprism.data.download import RemoteFile
from fedprism.errors import ConfigError
from fedprism.registry import Registry

if TYPE_CHECKING:      # torch is imported where tensors are made or read: listing datasets needs none
    import torch

__all__ = ["DATASETS", "Dataset", "DatasetSpec", "FileSet", "KnownCopy", "check_loaded", "check_tokens",
           "int_option", "float_option", "natural_datasets"]


@dataclass
class Dataset:
    """A labelled dataset in memory: normalised float32 inputs, int64 labels, class names.

    ``groups`` / ``test_groups`` give each sample's natural client (the user or device it came from, for
    a dataset whose spec declares ``natural``; else None), which ``partition=natural`` uses. ``mean`` /
    ``std`` are the per-channel constants the images were normalised with (per feature for data
    standardised at load time; empty for data left unnormalised); ``source`` says where the data came from.
    """

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    classes: list[str]
    groups: np.ndarray | None = None
    test_groups: np.ndarray | None = None
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()
    source: str = ""
    #: file -> 'sha256 verified...' | 'md5 verified...' | 'unverified: ...' (datasets read from files only)
    integrity: dict[str, str] | None = None
    #: named per-sample columns besides the inputs and labels (a state, a writer id), one value per train /
    #: test sample: what ``partition=natural partition.column=NAME`` makes its clients from (None: none)
    columns: dict[str, np.ndarray] | None = None
    test_columns: dict[str, np.ndarray] | None = None
    #: token data (text): the number of token ids; ``x_train`` / ``x_test`` are then int64 ``[n, seq_len]``
    #: ids in 0..vocab_size-1, not normalised (``mean`` / ``std`` empty). 0: not tokens (float inputs)
    vocab_size: int = 0

    def __post_init__(self) -> None:
        if len(self.x_train) != len(self.y_train) or len(self.x_test) != len(self.y_test):
            raise ValueError("x and y of a split must have the same number of samples")
        if self.vocab_size and (self.mean or self.std):
            raise ValueError("token data (vocab_size > 0) is not normalised: mean and std must be empty")
        if self.groups is not None and len(self.groups) != len(self.y_train):
            raise ValueError("groups must give one device id per training sample")
        if self.test_groups is not None and len(self.test_groups) != len(self.y_test):
            raise ValueError("test_groups must give one device id per test sample")
        for cols, y, what in ((self.columns, self.y_train, "columns"), (self.test_columns, self.y_test, "test_columns")):
            for k, v in (cols or {}).items():
                if len(v) != len(y):
                    raise ValueError(f"{what}[{k!r}] must give one value per sample of its split")

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])

    def denormalize(self, x: torch.Tensor) -> torch.Tensor:
        """Undo the per-channel normalisation: images back in [0, 1] (tabular data is returned as is)."""
        import torch

        if not self.mean:
            return x
        shape = (1, -1) + (1,) * (x.dim() - 2)
        m = torch.tensor(self.mean, dtype=x.dtype, device=x.device).view(shape)
        s = torch.tensor(self.std, dtype=x.dtype, device=x.device).view(shape)
        return x * s + m


@dataclass(frozen=True)
class KnownCopy:
    """A file published elsewhere than the download mirrors (a distribution's package) with its digests:
    a file of this name and SHA-256 is as trusted as a downloaded one."""

    filename: str
    sha256: str
    md5: str = ""
    origin: str = ""


@dataclass(frozen=True)
class FileSet:
    """Where a dataset's files are found, how they are recognised, and where they come from.

    find:    ``find(folder) -> {key: path}`` for a folder holding a complete copy, else a short reason
             ("no .mat files", "incomplete: missing ..."), shown in the not-found message. The keys name
             the files for the decoder and enter the decoded-array cache key.
    needed:  the files in words, for error messages.
    remote:  the official files to download, each with its checksums (or trust on first use) and mirrors
             (:class:`fedprism.data.download.RemoteFile`); empty when they cannot be downloaded.
    known:   other published copies whose digests are trusted too (:class:`KnownCopy`).
    folders: folders searched besides ``data.root``, ``$FEDPRISM_DATA`` and the download folder.
    hint:    another way to get the files, one sentence for the not-found message.
    """

    find: Callable[[Path], dict[str, Path] | str]
    needed: str
    remote: tuple[RemoteFile, ...] = ()
    known: tuple[KnownCopy, ...] = ()
    folders: tuple[Path, ...] = ()
    hint: str = ""

    @property
    def trust_on_first_use(self) -> bool:
        return any(f.tofu for f in self.remote)


@dataclass(frozen=True)
class DatasetSpec:
    """Everything fedprism needs to know about one dataset.

    name:         the config value (``dataset=NAME``): a non-empty string without dots or spaces.
    load:         ``load(pad32, root, **options) -> Dataset``; a spec with ``files`` is loaded as
                  ``load(pad32, root, download=..., cache_dir=..., **options)``. ``pad32`` zero-pads
                  images smaller than 32x32 before normalising; ``root`` is ``data.root`` (or None).
    summary:      one line: what the data is, with its paper (title, year).
    num_classes:  the number of classes; None when only the loader knows (a bare registered loader).
    class_names:  the class names when fixed (empty when read from the files or not declared).
    input_shape:  one sample as loaded with ``pad32=False``: ``(C, H, W)`` for images, ``(D,)`` for
                  tabular data; None when only the loader knows. ``pad32`` is refused for non-images.
    mean, std:    per-channel constants the images are normalised with, ``(x / scale - mean) / std``
                  (empty when the data is standardised at load time or left as it is: ``normalisation``
                  says which).
    natural:      what one natural client is ("user", "device"), for a dataset whose loader fills
                  ``groups`` / ``test_groups``; empty when the samples carry none.
    pad32_auto:   ``data.pad32=auto`` pads these images to 32x32 for models that take 32x32 inputs
                  (LeNet-5 on 28x28 digits, as in its paper).
    options:      keyword options the loader takes besides pad32 and root (``seed``, ``test_fraction``).
    config_keys:  (config key, loader option) pairs: the run's value of the key is passed as the option.
    files:        the :class:`FileSet` for a dataset read from files; None for generated or bundled data.
    vocab_size:   token data (text): the number of token ids; its inputs are int64 ``[n, seq_len]`` ids
                  (``input_shape`` ``(seq_len,)``, no mean or std) and only token models
                  (``ModelSpec.tokens``) take it. 0: not tokens.
    module:       the module that declared the spec (found from the caller when left empty).
    """

    name: str
    load: Callable[..., Dataset]
    summary: str = ""
    num_classes: int | None = None
    class_names: tuple[str, ...] = ()
    input_shape: tuple[int, ...] | None = None
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()
    normalisation: str = ""
    natural: str = ""
    pad32_auto: bool = False
    options: tuple[str, ...] = ()
    config_keys: tuple[tuple[str, str], ...] = ()
    files: FileSet | None = None
    vocab_size: int = 0
    module: str = field(default="", compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.module:                 # as collections.namedtuple does: the declaring module
            try:
                caller = sys._getframe(2).f_globals.get("__name__", "")
            except (AttributeError, ValueError):
                caller = ""
            object.__setattr__(self, "module", caller)
        object.__setattr__(self, "__module__", self.module)   # what the registry checks a built-in by
        if self.class_names and self.num_classes is None:
            object.__setattr__(self, "num_classes", len(self.class_names))
        if self.normalisation == "" and self.mean:
            object.__setattr__(self, "normalisation", "per channel, (x / scale - mean) / std")

    @property
    def images(self) -> bool | None:
        """True for ``(C, H, W)`` inputs, False for others, None when the shape is not declared."""
        return None if self.input_shape is None else len(self.input_shape) == 3

    @property
    def downloadable(self) -> bool:
        return self.files is not None and bool(self.files.remote)

    def loader_kwargs(self, cfg: Any) -> dict[str, Any]:
        """The loader options a run's config gives (``config_keys``)."""
        return {option: cfg[key] for key, option in self.config_keys}


# ------------------------------------------------------------------------------------------ checks


def _check_spec(name: str, spec: DatasetSpec) -> None:
    """Refuse, at registration, a spec that could never load or that contradicts itself."""
    if not isinstance(spec, DatasetSpec):
        raise TypeError(f"dataset {name!r}: a DatasetSpec or a loader load(pad32, root) -> Dataset, "
                        f"not {type(spec).__name__}")
    if spec.name != name:
        raise ValueError(f"dataset {name!r}: its spec is named {spec.name!r}")
    if not callable(spec.load):
        raise TypeError(f"dataset {name!r}: load = {spec.load!r} is not callable")
    k = spec.num_classes
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise ValueError(f"dataset {name!r}: num_classes = {k!r} is not valid: an integer >= 1")
    if spec.class_names and len(spec.class_names) != k:
        raise ValueError(f"dataset {name!r}: {len(spec.class_names)} class names for num_classes = {k}")
    shape = spec.input_shape
    if shape is not None and (not isinstance(shape, tuple) or not shape
                              or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0
                                         for d in shape)):
        raise ValueError(f"dataset {name!r}: input_shape = {shape!r} is not valid: a tuple of positive ints")
    if len(spec.mean) != len(spec.std) or (spec.mean and not spec.images):
        raise ValueError(f"dataset {name!r}: mean and std are per-channel constants of images, one each per "
                         f"channel; got {len(spec.mean)} means and {len(spec.std)} stds for shape {shape}")
    if spec.mean and len(spec.mean) != shape[0]:
        raise ValueError(f"dataset {name!r}: {len(spec.mean)} means for {shape[0]} channels")
    if spec.pad32_auto and not spec.images:
        raise ValueError(f"dataset {name!r}: pad32_auto is for images (input_shape (C, H, W))")
    v = spec.vocab_size
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"dataset {name!r}: vocab_size = {v!r} is not valid: 0 (not tokens) or the number of "
                         "token ids")
    if v and (spec.mean or (shape is not None and len(shape) != 1)):
        raise ValueError(f"dataset {name!r}: token data (vocab_size = {v}) has input_shape (seq_len,) and no "
                         f"mean or std; got input_shape {shape} and {len(spec.mean)} means")
    if not isinstance(spec.natural, str):
        raise TypeError(f"dataset {name!r}: natural = {spec.natural!r} is not valid: a word such as 'user', "
                        "or '' when the samples carry no natural client")
    for key, option in spec.config_keys:
        if option not in spec.options:
            raise ValueError(f"dataset {name!r}: config key {key!r} feeds option {option!r}, which is not "
                             f"one of its options {spec.options}")
    if spec.files is not None and not callable(spec.files.find):
        raise TypeError(f"dataset {name!r}: files.find is not callable")
    extra = {"download": False, "cache_dir": None} if spec.files is not None else {}
    call = "load(pad32, root" + (", download, cache_dir" if extra else "") + "".join(
        f", {o}" for o in spec.options) + ")"
    try:
        inspect.signature(spec.load).bind(pad32=False, root=None, **extra, **{o: None for o in spec.options})
    except TypeError as e:
        raise TypeError(f"dataset {name!r}: {spec.load!r} cannot be called as {call} ({e})") from None
    except ValueError:                  # no signature to read (some builtins): checked when it is called
        pass


def _as_spec(name: str, obj: Any) -> DatasetSpec:
    """What is registered -> its spec: a DatasetSpec as it is (renamed to the name it is registered
    under), a bare loader wrapped into a spec that declares nothing else."""
    if isinstance(obj, DatasetSpec):
        return obj if obj.name == name else replace(obj, name=name)
    if callable(obj):
        return DatasetSpec(name=name, load=obj, module=getattr(obj, "__module__", None) or "",
                           summary="registered loader")
    raise TypeError(f"dataset {name!r}: a DatasetSpec or a loader load(pad32, root) -> Dataset, "
                    f"not {type(obj).__name__}")


#: every dataset: the modules of `fedprism.data.sets`, entry points of `fedprism.datasets`, and
#: `fedprism.register_dataset`
DATASETS: Registry[DatasetSpec] = Registry("dataset", "fedprism.data.sets", check=_check_spec, make=_as_spec)
#: `dataset=hf:NAME`: a Hugging Face dataset (`fedprism.data.hf`), its spec made on first use
DATASETS.family("hf", "fedprism.data.hf:spec_for")


def builtin_specs() -> list[DatasetSpec]:
    """The built-in datasets' specs, by name (imports their modules)."""
    return [DATASETS.get(n) for n in DATASETS.names() if DATASETS.is_builtin(n)]


def natural_datasets() -> list[str]:
    """The datasets whose samples carry their natural client (spec ``natural``), by name."""
    return [n for n, spec in DATASETS.all().items() if spec.natural]


def check_loaded(spec: DatasetSpec, ds: object) -> Dataset:
    """What a registered (not built-in) loader returned, if a run can use it: a Dataset of tensors, float
    inputs, finite, one integer label in 0..classes-1 per input, both splits non-empty, one input shape,
    and the classes, shape and natural clients its spec declares."""
    import torch

    name = spec.name

    def bad(what: str) -> ConfigError:
        return ConfigError("dataset", name, f"a registered loader {what}")

    if not isinstance(ds, Dataset):
        raise bad(f"returns a fedprism.data.datasets.Dataset; it returned {type(ds).__name__}")
    k = len(ds.classes)
    for split in ("train", "test"):
        x, y = getattr(ds, f"x_{split}"), getattr(ds, f"y_{split}")
        tensors = isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
        if not tensors or len(x) != len(y) or not len(y):
            raise bad(f"gives a non-empty {split} split of tensors, one label per input")
        if x.dtype == torch.bool or (x.is_floating_point() and not bool(torch.isfinite(x).all())):
            raise bad(f"gives finite numeric {split} inputs")
        if ds.vocab_size or spec.vocab_size:
            check_tokens(name, split, x, ds.vocab_size, spec.vocab_size, bad)
        whole = not y.is_floating_point() or bool((y == y.round()).all())      # Federation casts with .long()
        if y.dtype == torch.bool or not whole or int(y.min()) < 0 or int(y.max()) >= k:
            raise bad(f"gives whole-number {split} labels in 0..{k - 1} (one per class name); "
                      f"found {y.dtype} {y.min().item()}..{y.max().item()}")
    if ds.x_train.dim() < 2 or ds.x_train.shape[1:] != ds.x_test.shape[1:]:
        raise bad(f"gives inputs of one shape in both splits, [samples, features...]; train "
                  f"{tuple(ds.x_train.shape)}, test {tuple(ds.x_test.shape)}")
    if spec.num_classes is not None and k != spec.num_classes:
        raise bad(f"gives the {spec.num_classes} classes its spec declares; it gave {k}")
    if spec.input_shape is not None and ds.input_shape != spec.input_shape:
        padded = spec.images and ds.input_shape == (spec.input_shape[0], 32, 32)
        if not padded:
            raise bad(f"gives inputs of the shape {spec.input_shape} its spec declares; they are "
                      f"{ds.input_shape}")
    if spec.natural and (ds.groups is None or ds.test_groups is None):
        raise bad(f"gives each sample's {spec.natural} in groups and test_groups, as its spec declares "
                  f"(natural = {spec.natural!r})")
    return ds


def check_tokens(name: str, split: str, x: torch.Tensor, vocab_size: int, declared: int,
                 bad: Callable[[str], Exception]) -> None:
    """Token inputs as the contract says (``Dataset.vocab_size``): int64 ``[n, seq_len]`` ids in
    0..vocab_size-1, the vocabulary the spec declares (when it declares one)."""
    import torch

    if declared and vocab_size != declared:
        raise bad(f"gives token data of the vocab_size {declared} its spec declares; its Dataset says "
                  f"vocab_size = {vocab_size}")
    if x.dtype != torch.int64 or x.dim() != 2:
        raise bad(f"gives token {split} inputs as int64 [samples, seq_len] ids (vocab_size = {vocab_size}); "
                  f"they are {str(x.dtype).replace('torch.', '')} {list(x.shape)}")
    if x.numel() and (int(x.min()) < 0 or int(x.max()) >= vocab_size):
        raise bad(f"gives token {split} ids in 0..{vocab_size - 1} (vocab_size = {vocab_size}); found "
                  f"{int(x.min())}..{int(x.max())}")


# ------------------------------------------------------------------------------ loader options


def int_option(key: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ConfigError(key, value, f"an integer >= {low}")
    return int(value)


def float_option(key: str, value: object, low: float, high: float | None = None, open_low: bool = False) -> float:
    bad = isinstance(value, bool) or not isinstance(value, (int, float, np.floating))
    if not bad:
        v = float(value)  # type: ignore[arg-type]
        bad = not np.isfinite(v) or v < low or (open_low and v == low) or (high is not None and v >= high)
    if bad:
        interval = f"{'(' if open_low else '['}{low}, {high if high is not None else 'inf'})"
        raise ConfigError(key, value, f"a number in {interval}")
    return float(value)  # type: ignore[arg-type]
