"""The Digits domains as one federation (FedBN, Li, Jiang, Zhang, Kamp, Dou 2021, "FedBN: Federated Learning
on Non-IID Features via Local Batch Normalization", arXiv:2102.07623; PFPL, Zeng et al. 2025, uses four of
them): MNIST, MNIST-M, SVHN, USPS and SynthDigits, each read by its own dataset (``mnist``, ``mnistm``,
``svhn``, ``usps``, ``synthdigits``, with their files and checksums), brought to one shape and kept apart
by domain: each image's domain is its natural client (``groups``), so ``partition=natural`` gives one
client per domain (FedBN's setting) and ``partition=domain_mix`` gives each client one domain and ``n`` of
its classes (PFPL's; :func:`fedprism.data.domains.real_domain_mix`).

Shape: 3x32x32 (:func:`fedprism.data.domains.to_rgb32`: greyscale copied to three channels, USPS's 16x16
enlarged 2x by pixel repetition, MNIST's and MNIST-M's 28x28 zero-padded, centred), normalised as FedBN
normalises every digit domain, (x - 0.5) / 0.5 per channel. Domain ids: 0 mnist, 1 mnistm, 2 svhn, 3 usps,
4 synthdigits, whichever are loaded (option ``domains``).

Sizes: every domain contributes a seeded random ``train_per_domain`` of its training images (default 7 291,
all of USPS's, the smallest domain, so the domains are balanced as in FedBN's equal-size partitions) and
``test_per_domain`` of its test images (default 2 007, all of USPS's); 0 takes all (SynthDigits alone then
has 479 400). Decision (the papers give no exact count): equal shares at the smallest domain's size.

Files: with ``data.root`` each domain is read from ``<root>/<domain name>`` (for example
``<root>/svhn/train_32x32.mat``); without it, each domain is searched where it is on its own
(``$FEDPRISM_DATA/<name>``, the download folder; docs/datasets.md).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from fedprism.data.base import DATASETS, Dataset, DatasetSpec, FileSet, int_option
from fedprism.data.cache import Raw, cache_file, read_cache, write_cache
from fedprism.data.domains import to_rgb32
from fedprism.data.files import check_raw, images, read_files
from fedprism.data.formats import DIGIT_CLASSES, decode_idx
from fedprism.data.sets import mnist, mnistm, svhn, synthdigits, usps
from fedprism.errors import ConfigError

#: each domain's dataset module, by domain id, and how its files decode (MNIST's IDX through decode_idx)
_MODULES = (mnist, mnistm, svhn, usps, synthdigits)
DOMAINS = tuple(m.SPEC.name for m in _MODULES)
GROUP_NAMES = DOMAINS          # by domain id, for the report's per-domain table
_DECODERS = {m.SPEC.name: getattr(m, "decode", lambda files, scratch: decode_idx(files, DIGIT_CLASSES))
             for m in _MODULES}


def _decoder(name: str):
    return _DECODERS[name]


def domain_raw(name: str, root: str | Path | None, download: bool, cache_dir: str | Path | None | bool
               ) -> tuple[Raw, dict[str, str], Path]:
    """A domain's decoded uint8 arrays, as its own dataset finds, verifies, decodes and caches them."""
    spec = DATASETS.get(name)
    files, where, integrity, cache = read_files(spec, root, download, cache_dir)
    cfile = cache_file(spec.name, files, cache) if cache is not None else None
    raw = read_cache(cfile, lambda r, p: check_raw(spec, r, p)) if cfile is not None else None
    if raw is None:
        raw = _decoder(name)(files, cache if cache is not None else Path(tempfile.gettempdir()))
        check_raw(spec, raw, where)
        if cfile is not None:
            write_cache(cfile, raw)
    return raw, integrity, where


def _domains(domains: object) -> tuple[str, ...]:
    if domains is None or domains == "all":
        return DOMAINS
    if isinstance(domains, str):
        domains = [d for d in domains.replace(",", " ").split() if d]
    if not isinstance(domains, (list, tuple)) or not domains:
        raise ConfigError("domains", domains, f"'all' or a list of {', '.join(DOMAINS)}")
    out = []
    for d in domains:
        if d not in DOMAINS:
            from fedprism.registry import suggest
            raise ConfigError("domains", d, f"one of {', '.join(DOMAINS)}"
                              + (suggest(d, list(DOMAINS)) if isinstance(d, str) else ""))
        if d not in out:
            out.append(d)
    return tuple(sorted(out, key=DOMAINS.index))


def _subset(n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    return np.arange(n) if k == 0 or k >= n else np.sort(rng.permutation(n)[:k])


def load(pad32: bool = False, root: str | Path | None = None, *, download: bool = False,
         cache_dir: str | Path | None | bool = None, domains: object = "all", train_per_domain: int = 7291,
         test_per_domain: int = 2007, seed: int = 0) -> Dataset:
    """The chosen domains' images at 3x32x32, ``train_per_domain`` / ``test_per_domain`` of each (seeded),
    each image's domain id in ``groups`` / ``test_groups``."""
    names = _domains(domains)
    k_tr = int_option("train_per_domain", train_per_domain, 0)
    k_te = int_option("test_per_domain", test_per_domain, 0)
    seed = int_option("seed", seed, 0)
    parts: dict[str, list] = {k: [] for k in ("xtr", "ytr", "gtr", "xte", "yte", "gte")}
    integrity: dict[str, str] = {}
    wheres = []
    for name in names:
        d = DOMAINS.index(name)
        raw, integ, where = domain_raw(name, Path(root).expanduser() / name if root is not None else None,
                                       download, cache_dir)
        integrity.update(integ)
        wheres.append(f"{name}: {where}")
        rng = np.random.default_rng([seed, d])
        tr, te = _subset(len(raw.y_train), k_tr, rng), _subset(len(raw.y_test), k_te, rng)
        for split, idx, x, y in (("tr", tr, raw.x_train, raw.y_train), ("te", te, raw.x_test, raw.y_test)):
            parts["x" + split].append(to_rgb32(x[idx]))
            parts["y" + split].append(np.asarray(y)[idx].astype(np.int64))
            parts["g" + split].append(np.full(len(idx), d, np.int64))
    cat = {k: np.concatenate(v) for k, v in parts.items()}
    ds = images(SPEC, cat["xtr"], cat["ytr"], cat["xte"], cat["yte"], list(DIGIT_CLASSES), 255.0, False,
                "; ".join(wheres))
    ds.groups, ds.test_groups = cat["gtr"], cat["gte"]
    ds.integrity = integrity
    return ds


def find(d: Path) -> dict[str, Path] | str:
    """`fedprism datasets` reports the domains found in ``d/<domain>`` (each domain is loaded by its own
    dataset; this copy is complete when all five are there)."""
    found, missing = {}, []
    for name in DOMAINS:
        got = DATASETS.get(name).files.find(d / name) if (d / name).is_dir() else "no such folder"
        if isinstance(got, dict):
            found.update({f"{name}/{k}": p for k, p in got.items()})
        else:
            missing.append(name)
    if missing:
        return f"no {', '.join(missing)} in {', '.join(f'{m}/' for m in missing)}"
    return found


SPEC = DATASETS.register(DatasetSpec(
    name="digit_domains",
    load=load,
    summary="the Digits domains MNIST, MNIST-M, SVHN, USPS, SynthDigits as one federation, one natural "
            "client per domain (FedBN, arXiv:2102.07623)",
    class_names=DIGIT_CLASSES,
    input_shape=(3, 32, 32),
    mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5),
    natural="domain",
    options=("domains", "train_per_domain", "test_per_domain", "seed"),
    config_keys=(("data.domains", "domains"), ("data.per_domain_train", "train_per_domain"),
                 ("data.per_domain_test", "test_per_domain")),
    files=FileSet(
        find=find,
        needed="each domain's own files in <folder>/mnist, /mnistm, /svhn, /usps, /synthdigits (see those "
               "datasets)",
        hint="fetch each domain with `fedprism data download mnist` (and mnistm, svhn, usps, synthdigits), "
             "or pass data.download=true",
    ),
))
