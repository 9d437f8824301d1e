"""ACSIncome (Ding, Hardt, Miller, Schmidt 2021, "Retiring Adult: New Datasets for Fair Machine Learning",
arXiv:2108.04884): is a person's yearly income above $50 000, from 10 features of the American Community
Survey's Public Use Microdata Sample (ACS PUMS), read from the Census Bureau's person files, one
``csv_p<state>.zip`` per state, of the 1-Year survey. Each person keeps the US state of the file it came
from, the dataset's natural client (`partition=natural`: one client per state).

The task is folktables' ``ACSIncome``, computed here from the files without folktables:

* features ``AGEP, COW, SCHL, MAR, OCCP, POBP, RELP, WKHP, SEX, RAC1P``, the codes as numbers, a missing
  value as -1 (folktables' ``nan_to_num(-1)``);
* rows kept: ``AGEP > 16``, ``PINCP > 100``, ``WKHP > 0``, ``PWGTP >= 1`` (folktables' ``adult_filter``);
* label ``PINCP > 50000`` (classes ``<=50K``, ``>50K``).

Files: each state's zip holds one person CSV (``psam_p<FIPS>.csv`` since 2017); it is streamed from the
archive, nothing is extracted. The files carry no year in their names, so a copy of the default year (2018)
may be laid out flat (``csv_pca.zip`` ..., where `fedprism data download acsincome` puts them), and any
year as folktables lays it out, ``<year>/1-Year/csv_pca.zip`` (also the extracted
``<year>/1-Year/psam_p06.csv``); the year of each file is read from its ``SERIALNO`` (which starts with the
survey year) and a file of another year than asked is refused. From 2019 the Census Bureau renamed
``RELP`` to ``RELSHIPP`` (with other codes); such a file's ``RELSHIPP`` is read as the relationship feature.

Options: ``states`` (postal codes, default folktables' 50 states and Puerto Rico: 1 664 500 persons in
2018, the size Clust-PSI-PFL's Table I gives), ``year`` (default 2018), and the split: within each
(state, label), a seeded ``round(test_fraction * n)`` go to test (``seed`` 0, ``test_fraction`` 0.2: the
random 80/20 split Clust-PSI-PFL uses for data without an official test set). Decision: the features are
standardised with the training rows' per-feature mean and std (``Dataset.mean`` / ``std``), so a
logistic regression trained with Adam at lr 1e-3 sees inputs of unit scale (the paper does not say how it
scales them). The Census Bureau publishes no checksum: downloads are trusted on first use.
"""

from __future__ import annotations

import csv
import io
import re
import zipfile
import zlib
from pathlib import Path

import numpy as np

from fedprism.data import download as _download
from fedprism.data import integrity as _integrity
from fedprism.data.base import DATASETS, Dataset, DatasetSpec, FileSet, float_option, int_option
from fedprism.data.cache import arrays_digest, cache_file, load_npz, save_npz
from fedprism.data.download import RemoteFile
from fedprism.data.files import locate, missing_error
from fedprism.data.grouped import split_within_groups
from fedprism.errors import ConfigError, DataError

FEATURES = ("AGEP", "COW", "SCHL", "MAR", "OCCP", "POBP", "RELP", "WKHP", "SEX", "RAC1P")
CLASSES = ("<=50K", ">50K")
THRESHOLD = 50_000
DEFAULT_YEAR = 2018
#: folktables' state list (50 states and Puerto Rico), with the FIPS codes of the person files
FIPS = {"AL": 1, "AK": 2, "AZ": 4, "AR": 5, "CA": 6, "CO": 8, "CT": 9, "DE": 10, "FL": 12, "GA": 13, "HI": 15,
        "ID": 16, "IL": 17, "IN": 18, "IA": 19, "KS": 20, "KY": 21, "LA": 22, "ME": 23, "MD": 24, "MA": 25,
        "MI": 26, "MN": 27, "MS": 28, "MO": 29, "MT": 30, "NE": 31, "NV": 32, "NH": 33, "NJ": 34, "NM": 35,
        "NY": 36, "NC": 37, "ND": 38, "OH": 39, "OK": 40, "OR": 41, "PA": 42, "RI": 44, "SC": 45, "SD": 46,
        "TN": 47, "TX": 48, "UT": 49, "VT": 50, "VA": 51, "WA": 53, "WV": 54, "WI": 55, "WY": 56, "PR": 72}
STATES = tuple(FIPS)
_BY_FIPS = {v: k for k, v in FIPS.items()}
BASE_URL = "https://www2.census.gov/programs-surveys/acs/data/pums/{year}/1-Year/"
MAX_CSV_BYTES = 4 << 30
"""Largest person CSV accepted (California's is about 0.2 GiB), so a hostile archive cannot run for ever."""
_ZIP = re.compile(r"csv_p([a-z]{2})\.zip")
_CSV = re.compile(r"psam_p(\d{2})\.csv")


def state_file(state: str) -> str:
    return f"csv_p{state.lower()}.zip"


def remote(year: int, states: tuple[str, ...] = STATES) -> tuple[RemoteFile, ...]:
    """The person files of ``year`` (trust on first use: no checksum is published)."""
    return tuple(RemoteFile(state_file(s), (BASE_URL.format(year=year) + state_file(s),), tofu=True)
                 for s in states)


# ------------------------------------------------------------------------------------------- reading

_NEEDED = FEATURES + ("PINCP", "PWGTP", "SERIALNO")


def _number(text: str) -> float:
    return float(text) if text.strip() else np.nan


def parse_person_csv(stream: io.TextIOBase, where: object, year: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(features float32 [n, 10], labels int64 [n], persons read) of one PUMS person CSV: the ACSIncome rows
    only. A header without a needed column, a row of the wrong length, a non-numeric value or a
    ``SERIALNO`` of another year is a :class:`DataError` naming the file and the line."""
    reader = csv.reader(stream)
    try:
        header = [h.strip().upper() for h in next(reader)]
    except StopIteration:
        raise DataError(f"{where}: empty file; not an ACS PUMS person file") from None
    index = {h: i for i, h in enumerate(header)}
    if "RELP" not in index and "RELSHIPP" in index:          # renamed from 2019 on
        index["RELP"] = index["RELSHIPP"]
    missing = [c for c in _NEEDED if c not in index]
    if missing:
        raise DataError(f"{where}: no column {', '.join(missing)}; not an ACS PUMS person file")
    cols = [index[c] for c in FEATURES]
    i_inc, i_w, i_ser, i_age, i_hours = (index[c] for c in ("PINCP", "PWGTP", "SERIALNO", "AGEP", "WKHP"))
    prefix = str(year)
    feats, labels, n = [], [], 0
    for line, row in enumerate(reader, start=2):
        if not row:
            continue
        n += 1
        if len(row) != len(header):
            raise DataError(f"{where}: line {line} has {len(row)} fields, the header {len(header)}")
        if not row[i_ser].startswith(prefix):
            raise DataError(f"{where}: line {line}: SERIALNO {row[i_ser]!r} is not of {year}; the file is of "
                            "another year than asked (option year)")
        try:
            age, inc, hours, w = (_number(row[i]) for i in (i_age, i_inc, i_hours, i_w))
            if not (age > 16 and inc > 100 and hours > 0 and w >= 1):
                continue
            feats.append([_number(row[i]) for i in cols])
        except ValueError as e:
            raise DataError(f"{where}: line {line}: a non-numeric value ({e})") from None
        labels.append(inc > THRESHOLD)
    x = np.nan_to_num(np.asarray(feats, np.float64).reshape(-1, len(FEATURES)), nan=-1.0)
    if not np.isfinite(x).all():
        raise DataError(f"{where}: non-finite feature values")
    return x.astype(np.float32), np.asarray(labels, np.int64), n


def read_state(path: Path, year: int) -> tuple[np.ndarray, np.ndarray, int]:
    """`parse_person_csv` of a state's ``csv_p<st>.zip`` (its one CSV member, streamed) or extracted CSV."""
    if path.suffix.lower() == ".csv":
        try:
            with open(path, encoding="latin-1", newline="") as f:
                return parse_person_csv(f, path, year)
        except OSError as e:
            raise DataError(f"{path}: cannot read file ({e.strerror or e})") from None
    try:
        with zipfile.ZipFile(path) as z:
            members = [i for i in z.infolist() if i.filename.lower().endswith(".csv") and not i.is_dir()]
            if len(members) != 1:
                raise DataError(f"{path}: {len(members)} CSV files in the archive; a PUMS person archive "
                                "holds one")
            if members[0].file_size > MAX_CSV_BYTES:
                raise DataError(f"{path}: {members[0].filename} is {members[0].file_size} bytes, more than "
                                f"the {MAX_CSV_BYTES} accepted")
            with z.open(members[0]) as raw:
                text = io.TextIOWrapper(raw, encoding="latin-1", newline="")
                return parse_person_csv(text, f"{path}:{members[0].filename}", year)
    except (zipfile.BadZipFile, OSError, EOFError, zlib.error) as e:
        raise DataError(f"{path}: cannot read the zip archive ({type(e).__name__}: {e}); it is truncated "
                        "or corrupt, download it again") from e


_KEYS = ("features", "labels", "persons")


_digest = arrays_digest("acsincome", _KEYS)


def _check(arrays: dict[str, np.ndarray], where: object) -> None:
    x, y = arrays["features"], arrays["labels"]
    if x.dtype != np.float32 or x.ndim != 2 or x.shape[1] != len(FEATURES) or y.shape != (len(x),):
        raise DataError(f"{where}: rows are {x.dtype} {x.shape} with labels {y.shape}")
    if len(y) and (y.min() < 0 or y.max() > 1):
        raise DataError(f"{where}: labels must be 0 or 1")


def _state_rows(state: str, path: Path, year: int, cache: Path | None) -> dict[str, np.ndarray]:
    cfile = cache_file(f"{SPEC.name}-{year}-{state}", {state: path}, cache) if cache is not None else None
    arrays = load_npz(cfile, _KEYS, _digest, _check) if cfile is not None else None
    if arrays is None:
        x, y, n = read_state(path, year)
        arrays = {"features": x, "labels": y, "persons": np.array(n, np.int64)}
        if cfile is not None:
            save_npz(cfile, **arrays, digest=np.array(_digest(arrays)))
    return arrays


# -------------------------------------------------------------------------------------------- files


def find(d: Path) -> dict[str, Path] | str:
    """Every person file in ``d`` (flat, key ``CA``) and in ``d/<year>/1-Year/`` (key ``2018/CA``)."""
    out: dict[str, Path] = {}
    for p in sorted(d.glob("csv_p*.zip")):
        m = _ZIP.fullmatch(p.name)
        if m and m.group(1).upper() in FIPS:
            out[m.group(1).upper()] = p
    for p in sorted(d.glob("[0-9][0-9][0-9][0-9]/1-Year/*")):
        year = p.parent.parent.name
        m, c = _ZIP.fullmatch(p.name), _CSV.fullmatch(p.name)
        state = m.group(1).upper() if m else (_BY_FIPS.get(int(c.group(1))) if c else None)
        if state in FIPS and p.is_file():
            out.setdefault(f"{year}/{state}", p)          # the zip before the extracted CSV (sorted)
    return out or "no csv_p<state>.zip files (nor <year>/1-Year/ with them)"


def _states(states: object) -> tuple[str, ...]:
    if states is None or states == "all":
        return STATES
    if isinstance(states, str):
        states = [s for s in re.split(r"[,\s]+", states) if s]
    if not isinstance(states, (list, tuple)) or not states:
        raise ConfigError("states", states, f"'all' or a list of postal codes ({', '.join(STATES)})")
    out = []
    for s in states:
        if not isinstance(s, str) or s.upper() not in FIPS:
            from fedprism.registry import suggest
            hint = suggest(s.upper(), list(STATES)) if isinstance(s, str) else ""
            raise ConfigError("states", s, f"a postal code of {', '.join(STATES)}{hint}")
        if s.upper() not in out:
            out.append(s.upper())
    return tuple(out)


def _files(states: tuple[str, ...], year: int, root, download: bool) -> tuple[dict[str, Path], Path, dict]:
    """{state: person file} of the asked states and year, downloaded first when asked, verified."""
    def pick(found):
        if not isinstance(found, tuple):
            return {}, None
        files, where = found
        flat = year == DEFAULT_YEAR             # flat files are the default year's (`fedprism data download`)
        chosen = {s: files.get(f"{year}/{s}") or (files.get(s) if flat else None) for s in states}
        return {s: p for s, p in chosen.items() if p is not None}, where

    try:
        found = locate(SPEC, root)
    except DataError:                       # an explicit data.root without any person file
        if not download:
            raise
        found = []
    chosen, where = pick(found)
    missing = [s for s in states if s not in chosen]
    if missing and download:
        dest = Path(root).expanduser() if root is not None else (where or _download.download_dir(SPEC.name))
        into = dest if year == DEFAULT_YEAR else dest / str(year) / "1-Year"
        for rf in remote(year, tuple(missing)):
            _download.fetch(rf, into)
        chosen, where = pick(locate(SPEC, root))
        missing = [s for s in states if s not in chosen]
    if isinstance(found, list) and not chosen:
        raise missing_error(SPEC, found)
    if missing:
        raise DataError(f"dataset 'acsincome': {where} lacks the {year} person files of {', '.join(missing)} "
                        f"({', '.join(state_file(s) for s in missing)}); add data.download=true (or "
                        "load_dataset(..., download=True)) to fetch them from the Census Bureau, or choose "
                        "other states")
    integrity = _integrity.verify(SPEC.name, chosen)
    return chosen, where, integrity


def load(pad32: bool = False, root: str | Path | None = None, *, download: bool = False,
         cache_dir: str | Path | None | bool = None, states: object = "all", year: int = DEFAULT_YEAR,
         seed: int = 0, test_fraction: float = 0.2) -> Dataset:
    """The ACSIncome rows of ``states`` in ``year``, split 80/20 within each (state, label), standardised
    with the training rows' statistics; each row's state (FIPS code) in ``groups`` / ``test_groups``."""
    states = _states(states)
    year = int_option("year", year, 2000)
    seed = int_option("seed", seed, 0)
    test_fraction = float_option("test_fraction", test_fraction, 0.0, 1.0, open_low=True)
    files, where, integrity = _files(states, year, root, download)
    if cache_dir is False:
        cache = None
    elif cache_dir is None or cache_dir is True:
        cache = _download.cache_root()
    else:
        cache = Path(cache_dir).expanduser()
    xs, ys, gs = [], [], []
    for s in states:
        a = _state_rows(s, files[s], year, cache)
        xs.append(a["features"])
        ys.append(a["labels"])
        gs.append(np.full(len(a["labels"]), FIPS[s], np.int64))
    x, y, g = np.concatenate(xs), np.concatenate(ys), np.concatenate(gs)
    if not len(y):
        raise DataError(f"{where}: no person of {', '.join(states)} passes the ACSIncome filter")
    tr, te = split_within_groups(y, g, seed=seed, test_fraction=test_fraction)
    if not len(tr) or not len(te):
        raise DataError(f"{where}: {len(tr)} training and {len(te)} test rows with test_fraction="
                        f"{test_fraction} ({len(y)} rows in all); both splits must be non-empty")
    mean = x[tr].astype(np.float64).mean(axis=0)
    std = x[tr].astype(np.float64).std(axis=0)
    std[std == 0] = 1.0
    xs_ = ((x - mean) / std).astype(np.float32)
    import torch          # here: listing the datasets imports this module, and needs no tensor

    ds = Dataset(name=SPEC.name, x_train=torch.from_numpy(xs_[tr]), y_train=torch.from_numpy(y[tr]),
                 x_test=torch.from_numpy(xs_[te]), y_test=torch.from_numpy(y[te]), classes=list(CLASSES),
                 groups=g[tr], test_groups=g[te], mean=tuple(float(v) for v in mean),
                 std=tuple(float(v) for v in std),
                 source=f"{where} (ACS PUMS {year} 1-Year, {len(states)} state(s))")
    ds.integrity = integrity
    return ds


SPEC = DATASETS.register(DatasetSpec(
    name="acsincome",
    load=load,
    summary="ACSIncome: income > $50k from 10 ACS PUMS features, one natural client per US state "
            "(Ding et al. 2021, arXiv:2108.04884)",
    class_names=CLASSES,
    input_shape=(len(FEATURES),),
    normalisation="per feature, with the training rows' mean and std (computed at load time)",
    natural="state",
    options=("states", "year", "seed", "test_fraction"),
    config_keys=(("data.acs.states", "states"), ("data.acs.year", "year")),
    files=FileSet(
        find=find,
        needed=f"the ACS PUMS 1-Year person files csv_p<state>.zip of the states asked (default: the "
               f"{len(STATES)} of folktables), flat or in <year>/1-Year/",
        # no checksum is published: trust on first use (fedprism.data.download); the default year's files
        remote=remote(DEFAULT_YEAR),
        hint="folktables' download (its <year>/1-Year/ folder, zips or extracted psam_p<FIPS>.csv) is read "
             "as it is",
    ),
))
