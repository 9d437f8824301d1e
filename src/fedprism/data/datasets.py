"""Load a registered dataset by name: ``load_dataset(name)`` -> normalised tensors, offline.

Each dataset is one module of :mod:`fedprism.data.sets` (or a plugin) declaring a
:class:`~fedprism.data.base.DatasetSpec` on :data:`DATASETS`; this function looks the name up there,
checks the arguments against the spec and calls its loader. A dataset read from files is looked for in
:func:`search_paths` (never the network unless ``download=True``), checked against its known digests
(:mod:`fedprism.data.integrity`), decoded with numpy / scipy only (:mod:`fedprism.data.formats`) and
cached decoded (:mod:`fedprism.data.cache`); images come back as float32 normalised per channel,
``(x / scale - mean) / std``, laid out ``[N, C, H, W]`` (``[N, D]`` for tabular data). docs/datasets.md
describes every dataset, where it is looked for and how each file is verified; `fedprism datasets` lists
what is registered.

The names this module exported before datasets declared themselves (``NORMALIZATION``,
``NATURAL_CLIENTS``, ``FMNIST_CLASSES``, ``DEBIAN_FMNIST``, ``read_idx``, ``read_usps``,
``generate_synthetic``) are still importable from here; they are read from the datasets' modules.
"""

from __future__ import annotations

from pathlib import Path

from fedprism.data import files as _files
from fedprism.data.base import DATASETS, Dataset, DatasetSpec, check_loaded
from fedprism.data.formats import read_idx, read_usps
from fedprism.data.sets.synthetic import generate_synthetic
from fedprism.errors import ConfigError

__all__ = [
    "DATASETS",
    "NORMALIZATION",
    "Dataset",
    "DatasetSpec",
    "load_dataset",
    "search_paths",
    "read_idx",
    "read_usps",
    "generate_synthetic",
]


def spec_of(name: object, key: str = "dataset") -> DatasetSpec:
    """The spec of dataset ``name`` (case-insensitive for the built-ins); ConfigError naming ``key`` for a
    name nobody registered."""
    if isinstance(name, str) and name not in DATASETS and name.lower() in DATASETS:
        name = name.lower()
    if not isinstance(name, str):
        raise ConfigError(key, name, f"one of {', '.join(DATASETS.names())}")
    return DATASETS.get(name, key=key)


def search_paths(name: str, root: str | Path | None = None) -> list[Path]:
    """Folders searched for dataset ``name``, in order: ``root`` if given, ``$FEDPRISM_DATA/<name>``,
    ``$FEDPRISM_DATA``, the folders the dataset's spec adds (Debian's ``/usr/share/datasets/fashion-mnist``
    for Fashion-MNIST), then the download folder ``<cache root>/data/<name>``
    (``~/.cache/fedprism/data/<name>`` unless ``$FEDPRISM_CACHE`` is set)."""
    return _files.search_paths(spec_of(name), root)


def load_dataset(name: str, root: str | Path | None = None, download: bool = False, pad32: bool = False,
                 cache_dir: str | Path | None | bool = None, **kw: object) -> Dataset:
    """Load dataset ``name`` (see ``fedprism datasets``) as normalised tensors, offline.

    Files are looked for in :func:`search_paths`; when none holds a complete copy, ``download=True``
    fetches the official files first, otherwise a :class:`DataError` lists every folder looked at and
    the command that gets the data. ``pad32=True`` zero-pads smaller images to 32x32 (28x28: 2 pixels
    each side) *before* normalising, so the padding equals the black background (for LeNet-5 on 28x28
    digits, FedPrism paper 4.3); it is refused for tabular data. ``cache_dir`` holds the decoded-array
    cache and temporary extractions (default ``$FEDPRISM_CACHE`` or ``~/.cache/fedprism``; ``False``
    disables the cache). A dataset with no files (bundled or generated) warns about a ``root`` it does
    not read. ``kw`` are the dataset's own options (its spec's ``options``, e.g. ``seed`` and
    ``test_fraction`` of a split); a registered loader's result is checked before it is returned.
    """
    spec = spec_of(name)
    name = spec.name
    for key, value in (("download", download), ("pad32", pad32)):
        if not isinstance(value, bool):
            raise ConfigError(key, value, "true or false")
    for key, value in kw.items():
        if key not in spec.options:
            opts = f"only {', '.join(spec.options)}" if spec.options else "no extra options"
            raise ConfigError(key, value, f"dataset '{name}' takes {opts}")
    if pad32 and spec.images is False:
        raise ConfigError("data.pad32", pad32, f"false for the {name} (tabular) dataset")
    if spec.files is not None:
        ds = spec.load(pad32=pad32, root=root, download=download, cache_dir=cache_dir, **kw)
    elif _takes_cache_dir(spec.load):   # a dataset without files that caches what it computes (digits' split)
        ds = spec.load(pad32=pad32, root=root, cache_dir=cache_dir, **kw)
    elif _takes_cache_dir(spec.load, "download"):   # fetched by its own library (hf:NAME through `datasets`)
        ds = spec.load(pad32=pad32, root=root, download=download, **kw)
    else:
        ds = spec.load(pad32=pad32, root=root, **kw)
    if not DATASETS.is_builtin(name):
        check_loaded(spec, ds)
    return ds


def _takes_cache_dir(load: object, arg: str = "cache_dir") -> bool:
    import inspect

    try:
        return arg in inspect.signature(load).parameters
    except (TypeError, ValueError):             # no signature to read: called without it
        return False


def __getattr__(attr: str):
    """Tables derived from the built-in datasets' specs, read when asked for (importing this module imports
    no dataset module but ``synthetic``): ``NORMALIZATION`` (name -> (mean, std)), ``NATURAL_CLIENTS``,
    the image datasets' class counts and shapes, and the constants of single datasets."""
    from fedprism.data.base import builtin_specs

    if attr == "NORMALIZATION":
        return {s.name: (s.mean, s.std) for s in builtin_specs() if s.mean}
    if attr == "NATURAL_CLIENTS":
        return tuple(s.name for s in builtin_specs() if s.natural)
    if attr == "_NUM_CLASSES":
        return {s.name: s.num_classes for s in builtin_specs() if s.images and s.files is not None}
    if attr == "_IMAGE_SHAPE":
        return {s.name: s.input_shape for s in builtin_specs() if s.images and s.files is not None}
    if attr in ("FMNIST_CLASSES", "DEBIAN_FMNIST"):
        from fedprism.data.sets import fmnist

        return fmnist.CLASSES if attr == "FMNIST_CLASSES" else fmnist.DEBIAN_FMNIST
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
