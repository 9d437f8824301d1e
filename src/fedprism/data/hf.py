"""``dataset=hf:NAME``: a dataset of the Hugging Face ``datasets`` library (the format Flower Datasets,
``flwr-datasets``, reads too) as a fedprism :class:`~fedprism.data.base.Dataset`.

The family ``hf`` of the dataset registry (`fedprism.registry.Registry.family`) makes one
:class:`~fedprism.data.base.DatasetSpec` per name written, ``hf:ylecun/mnist`` or ``hf:./my_data``;
``datasets`` is imported only when one is loaded. Which columns and splits are used is configuration
(the ``data.hf.*`` keys, part of the run id where they differ from their defaults):

=========================  ================================================================================
``data.hf.image``          the image column (an ``Image`` feature, or arrays of one shape); '' = the one
                           ``Image`` column when there is exactly one
``data.hf.features``       tabular data: numeric columns, comma-separated (standardised with the train split's
                           mean and standard deviation)
``data.hf.label``          the label column: a ``ClassLabel`` (its names are the classes), integers or strings
                           (their sorted distinct values over both splits)
``data.hf.train_split``    the split the clients' rows come from (``train``)
``data.hf.test_split``     the split of the test set (``test``); '' = a seeded, stratified
                           ``data.hf.test_fraction`` of the train split
=========================  ================================================================================

Every other integer, string or boolean column is kept as a named column (``Dataset.columns``), which
``partition=natural partition.column=NAME`` turns into one client per value.

Where the data is found, in order (no network unless ``data.download=true``): ``NAME`` itself when it is a
folder written by ``save_to_disk`` (``hf:./my_data``, ``hf:/data/femnist``); ``data.root`` when it is such a
folder, else ``data.root/NAME``; ``$FEDPRISM_DATA/hf/NAME``; the download folder
``<cache root>/data/hf/NAME``. With ``data.download=true`` a name found nowhere is fetched with
``datasets.load_dataset(NAME)`` from the Hub and saved to the download folder with ``save_to_disk``, so later
runs read it offline. The data fingerprint of every run (docs/reproducibility.md) covers the arrays read, so a
changed copy is never taken for the stored one.

Images are scaled to [0, 1] (integers by 255), zero-padded to 32x32 with ``data.pad32`` where smaller, then
standardised per channel with the train split's mean and standard deviation (recorded in ``Dataset.mean`` /
``std``).
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from fedprism.data.base import Dataset, DatasetSpec
from fedprism.errors import ConfigError, DataError

__all__ = ["spec_for", "load", "saved_folder", "OPTIONS"]

#: the loader's options, each fed by the config key ``data.hf.<option>``
OPTIONS = ("image", "features", "label", "train_split", "test_split", "test_fraction")

#: the seed of the carved test split (``data.hf.test_split = ''``): part of the dataset, not of the run
CARVE_SEED = 0


def spec_for(name: str) -> DatasetSpec:
    """The spec of ``hf:SOURCE`` (the registry's factory for the family ``hf``)."""
    source = name.split(":", 1)[1]
    if not source.strip() or "\0" in source:
        raise ConfigError("dataset", name, "hf:NAME with NAME a Hugging Face dataset (hf:ylecun/mnist) or a folder "
                          "written by save_to_disk (hf:./my_data)")
    return DatasetSpec(
        name=name,
        load=partial(load, source),
        summary=f"Hugging Face dataset {source!r} through the datasets library (docs/datasets.md)",
        normalisation="per channel (images) or per feature (tabular), with the train split's mean and std",
        options=OPTIONS,
        config_keys=tuple((f"data.hf.{o}", o) for o in OPTIONS),
        module=__name__,
    )


def _datasets():
    try:
        import datasets
    except ImportError:                     # pragma: no cover - the `hf` extra is installed with the package
        raise ConfigError("dataset", "hf:", "a dataset of an installed `datasets` library: pip install "
                          "'fedprism[hf]'") from None
    return datasets


def saved_folder(path: Path) -> bool:
    """Whether ``path`` is a folder written by ``save_to_disk`` (a DatasetDict or a single Dataset)."""
    return path.is_dir() and ((path / "dataset_dict.json").is_file() or (path / "state.json").is_file())


def _candidates(source: str, root: str | os.PathLike | None) -> list[Path]:
    from fedprism.machine import cache_root

    out = [Path(source).expanduser()]
    if root:
        out += [Path(root).expanduser(), Path(root).expanduser() / source]
    if os.environ.get("FEDPRISM_DATA"):
        out.append(Path(os.environ["FEDPRISM_DATA"]) / "hf" / source)
    out.append(download_folder(source, cache_root()))
    return out


def download_folder(source: str, cache: Path) -> Path:
    """Where ``data.download=true`` saves ``hf:SOURCE``: ``<cache root>/data/hf/SOURCE``."""
    return Path(cache) / "data" / "hf" / source


def _open(source: str, root, download: bool):
    """The saved DatasetDict (or Dataset) for ``source``, and where it was read."""
    datasets = _datasets()
    looked = []
    for folder in _candidates(source, root):
        if folder in looked:
            continue
        looked.append(folder)
        if saved_folder(folder):
            return datasets.load_from_disk(str(folder)), str(folder)
    if not download:
        where = "\n  ".join(str(p) for p in looked)
        raise DataError(f"dataset hf:{source}: no folder written by save_to_disk was found; looked in:\n  {where}\n"
                        f"Point data.root at one, or set data.download=true to fetch {source!r} from the Hugging "
                        "Face Hub (saved to the last folder above).")
    from fedprism.machine import cache_root

    dest = download_folder(source, cache_root())
    data = datasets.load_dataset(source)
    dest.parent.mkdir(parents=True, exist_ok=True)
    data.save_to_disk(str(dest))
    return datasets.load_from_disk(str(dest)), str(dest)


def _split(data, which: str, key: str, source: str):
    names = list(data.keys()) if hasattr(data, "keys") else []
    if not names:                                   # a single saved Dataset: its one split is the train split
        if key == "data.hf.train_split":
            return data
        raise ConfigError(key, which, f"'' for hf:{source}: it was saved as one Dataset without splits, which is "
                          "the train split; set data.hf.test_split='' to carve the test set from it")
    if which not in names:
        from fedprism.registry import suggest

        raise ConfigError(key, which, f"a split of hf:{source}: {', '.join(names)}{suggest(which, names)}")
    return data[which]


def _column(ds, col: str, key: str, source: str, split: str) -> None:
    if col not in ds.column_names:
        from fedprism.registry import suggest

        raise ConfigError(key, col, f"a column of hf:{source} (split {split}): {', '.join(ds.column_names)}"
                          f"{suggest(col, list(ds.column_names))}")


def _values(ds, col: str):
    """One column of a split as numpy (an array; a list or object array where rows differ in shape)."""
    return ds.select_columns([col]).with_format("numpy")[:][col]


def _kind(feature) -> str:
    """'image', 'class', 'int', 'float', 'bool', 'string' or 'other' for a datasets feature type."""
    datasets = _datasets()
    if isinstance(feature, datasets.Image):
        return "image"
    if isinstance(feature, datasets.ClassLabel):
        return "class"
    if isinstance(feature, datasets.Value):
        d = feature.dtype
        if d == "bool":
            return "bool"
        if d.startswith(("int", "uint")):
            return "int"
        if d.startswith("float") or d in ("double", "halffloat"):
            return "float"
        if d in ("string", "large_string"):
            return "string"
    return "other"


def _array_images(feature) -> bool:
    """A column that can hold images without being an ``Image`` feature: an ``Array2D`` / ``Array3D``, or
    lists of lists (of lists) of numbers ([H, W] or [H, W, C] per row). Named by the no-Image-column error
    as what `data.hf.image=<column>` would read; a flat list of numbers is a feature vector, not an image."""
    datasets = _datasets()
    arrays = tuple(getattr(datasets, n) for n in ("Array2D", "Array3D") if isinstance(getattr(datasets, n, None), type))
    if arrays and isinstance(feature, arrays):
        return True
    lists = tuple(getattr(datasets, n) for n in ("List", "LargeList", "Sequence")
                  if isinstance(getattr(datasets, n, None), type))
    depth = 0
    while (lists and isinstance(feature, lists)) or isinstance(feature, list):
        feature = feature[0] if isinstance(feature, list) else feature.feature
        depth += 1
    return depth in (2, 3) and _kind(feature) in ("int", "float")


def _images(ds, col: str, source: str, split: str) -> np.ndarray:
    """[n, C, H, W] float32 in [0, 1] (integer pixels divided by 255)."""
    values = _values(ds, col)
    try:
        x = np.stack([np.asarray(v) for v in values]) if isinstance(values, list) or values.dtype == object \
            else np.asarray(values)
    except ValueError:
        raise ConfigError("data.hf.image", col, f"a column of images of one size and mode; hf:{source}'s {split} "
                          "split holds images of several shapes") from None
    if x.ndim == 3:
        x = x[:, None]
    elif x.ndim == 4 and x.shape[-1] in (1, 3, 4) and x.shape[1] not in (1, 3, 4):
        x = x.transpose(0, 3, 1, 2)
    if x.ndim != 4 or x.dtype.kind not in "uif":
        raise ConfigError("data.hf.image", col, f"a column of images ([H, W] or [H, W, C] numbers); hf:{source}'s "
                          f"{split} split gives {x.dtype} arrays of shape {list(x.shape[1:])}")
    return x.astype(np.float32) / (255.0 if x.dtype.kind in "ui" else 1.0)


def _features(ds, cols: list[str], source: str, split: str) -> np.ndarray:
    numeric = [c for c in ds.column_names if _kind(ds.features[c]) in ("int", "float", "bool", "class")]
    for c in cols:
        _column(ds, c, "data.hf.features", source, split)
        if c not in numeric:
            raise ConfigError("data.hf.features", c, f"numeric columns; '{c}' of hf:{source} holds "
                              f"{ds.features[c]!r}; its numeric columns: {', '.join(numeric) or 'none'}")
    return np.stack([np.asarray(_values(ds, c), dtype=np.float64) for c in cols], axis=1).astype(np.float32)


def _labels(train, test, col: str, source: str) -> tuple[np.ndarray, np.ndarray, list[str]]:
    feature = train.features[col]
    kind = _kind(feature)
    ytr, yte = np.asarray(_values(train, col)), np.asarray(_values(test, col))
    if kind == "class":
        return ytr.astype(np.int64), yte.astype(np.int64), list(feature.names)
    if kind not in ("int", "string", "bool"):
        raise ConfigError("data.hf.label", col, f"a label column of class ids, integers or strings; '{col}' of "
                          f"hf:{source} holds {feature!r}")
    values, ids = np.unique(np.concatenate([ytr, yte]), return_inverse=True)
    ids = ids.astype(np.int64).reshape(-1)
    return ids[:len(ytr)], ids[len(ytr):], [str(v) for v in values]


def _group_columns(ds, used: set[str]) -> dict[str, np.ndarray]:
    return {c: np.asarray(_values(ds, c)) for c in ds.column_names
            if c not in used and _kind(ds.features[c]) in ("int", "string", "bool", "class")}


def _carve(y: np.ndarray, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Sorted (train, test) rows: within each class, a seeded ``round(fraction n_c)`` of its rows go to test
    (the stream ``default_rng(CARVE_SEED)``, classes in ascending order)."""
    rng = np.random.default_rng(CARVE_SEED)
    test = np.zeros(len(y), bool)
    for c in np.unique(y):
        rows = np.flatnonzero(y == c)
        test[rng.permutation(rows)[:int(round(fraction * len(rows)))]] = True
    return np.flatnonzero(~test), np.flatnonzero(test)


def load(source: str, pad32: bool = False, root: str | None = None, download: bool = False, image: str = "",
         features: str = "", label: str = "label", train_split: str = "train", test_split: str = "test",
         test_fraction: float = 0.2, **_: Any) -> Dataset:
    """``hf:SOURCE`` as a Dataset (module docstring: where it is looked for, the columns, the scaling)."""
    import torch

    data, where = _open(source, root, download)
    train = _split(data, train_split, "data.hf.train_split", source)
    test = _split(data, test_split, "data.hf.test_split", source) if test_split else None
    for ds, split in ((train, train_split), (test, test_split)):
        if ds is not None:
            _column(ds, label, "data.hf.label", source, split)
    cols = [c.strip() for c in features.split(",") if c.strip()]
    if image and cols:
        raise ConfigError("data.hf.features", features, "'' when data.hf.image is set (one kind of input)")
    if not image and not cols:
        found = [c for c in train.column_names if _kind(train.features[c]) == "image"]
        if len(found) != 1:
            arrays = [c for c in train.column_names if not found and _array_images(train.features[c])]
            hint = (f"; its array column(s) {', '.join(arrays)} can hold images: data.hf.image={arrays[0]} reads "
                    "one (docs/huggingface.md)" if arrays else "")
            raise ConfigError("data.hf.image", image, f"the image column, or data.hf.features for tabular data; "
                              f"hf:{source} has {len(found) or 'no'} Image column(s) "
                              f"({', '.join(found) or 'columns: ' + ', '.join(train.column_names)}){hint}")
        image = found[0]
    if test is None:                                # carved from the train split, stratified by label
        y_all = _labels(train, train, label, source)[0]
        keep, held = _carve(y_all, test_fraction)
        train, test = train.select(keep), train.select(held)
        test_split = f"{train_split} (held-out {test_fraction:g})"
    read = []
    for ds, split in ((train, train_split), (test, test_split)):
        if image:
            _column(ds, image, "data.hf.image", source, split)
            read.append(_images(ds, image, source, split))
        else:
            read.append(_features(ds, cols, source, split))
    x_tr, x_te = read
    if image and x_tr.shape[1:] != x_te.shape[1:]:
        raise ConfigError("data.hf.image", image, f"images of one shape in both splits; hf:{source} has "
                          f"{list(x_tr.shape[1:])} in {train_split} and {list(x_te.shape[1:])} in {test_split}")
    if pad32:
        if not image:
            raise ConfigError("data.pad32", pad32, f"false for hf:{source} (tabular data)")
        x_tr, x_te = _pad32(x_tr), _pad32(x_te)
    y_tr, y_te, classes = _labels(train, test, label, source)
    axes = (0, 2, 3) if image else (0,)
    mean = x_tr.mean(axis=axes, dtype=np.float64)
    std = x_tr.std(axis=axes, dtype=np.float64)
    std = np.where(std > 0, std, 1.0)
    shape = (1, -1, 1, 1) if image else (1, -1)
    norm = [((x - mean.reshape(shape)) / std.reshape(shape)).astype(np.float32) for x in (x_tr, x_te)]
    used = {label, *cols, *([image] if image else [])}
    return Dataset(name=f"hf:{source}", x_train=torch.from_numpy(norm[0]), y_train=torch.from_numpy(y_tr),
                   x_test=torch.from_numpy(norm[1]), y_test=torch.from_numpy(y_te), classes=classes,
                   mean=tuple(float(m) for m in mean) if image else (),
                   std=tuple(float(s) for s in std) if image else (),
                   source=f"hf:{source} from {where} ({train_split} / {test_split})",
                   columns=_group_columns(train, used), test_columns=_group_columns(test, used))


def _pad32(x: np.ndarray) -> np.ndarray:
    h, w = x.shape[2:]
    if h >= 32 and w >= 32:
        return x
    top, left = (max(32 - h, 0)) // 2, (max(32 - w, 0)) // 2
    out = np.zeros(x.shape[:2] + (max(h, 32), max(w, 32)), dtype=x.dtype)
    out[:, :, top:top + h, left:left + w] = x
    return out
