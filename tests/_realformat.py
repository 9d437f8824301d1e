"""Small files in the real formats of UCI HAR, the ACS PUMS person files, MNIST-M, SynthDigits and
Office-Caltech10, generated for the tests (no test needs the network). Each writer returns what it wrote, so
a test can compare the loader's arrays with the values it put in the files."""

from __future__ import annotations

import io
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# ------------------------------------------------------------------------------------------- UCI HAR


@dataclass
class HarFiles:
    x: dict          # split -> float [n, 561] as written (7 significant digits)
    y: dict          # split -> activity 1..6
    subject: dict    # split -> subject id
    path: Path


def har_arrays(seed: int = 0, subjects=((1, 3, 5), (2, 4)), per_activity: int = 4):
    """Per split: features, activities 1..6 and subjects; every subject has `per_activity` windows of each
    activity; the first feature encodes the activity (so a model can learn it)."""
    rng = np.random.default_rng(seed)
    out = {}
    for split, subs in zip(("train", "test"), subjects):
        ys, ss = [], []
        for s in subs:
            for a in range(1, 7):
                ys += [a] * per_activity
                ss += [s] * per_activity
        y, s = np.array(ys), np.array(ss)
        x = rng.uniform(-1, 1, (len(y), 561))
        x[:, 0] = (y - 3.5) / 3.0
        x = np.array([[float(f"{v:.7e}") for v in row] for row in x])
        out[split] = (x, y, s)
    return out


def write_har(folder: Path, seed: int = 0, as_zip: bool = True, **kw) -> HarFiles:
    """`UCI HAR Dataset.zip` (or the extracted folder) in `folder`, in the official layout: X lines of 561
    numbers in the authors' `%.7e` style with leading blanks, y and subject files one integer per line."""
    arrays = har_arrays(seed, **kw)
    members = {"UCI HAR Dataset/activity_labels.txt":
               "1 WALKING\n2 WALKING_UPSTAIRS\n3 WALKING_DOWNSTAIRS\n4 SITTING\n5 STANDING\n6 LAYING\n"}
    for split, (x, y, s) in arrays.items():
        members[f"UCI HAR Dataset/{split}/X_{split}.txt"] = "".join(
            "".join(f"{v: .7e}".rjust(16) for v in row) + "\n" for row in x)
        members[f"UCI HAR Dataset/{split}/y_{split}.txt"] = "".join(f"{v}\n" for v in y)
        members[f"UCI HAR Dataset/{split}/subject_{split}.txt"] = "".join(f"{v}\n" for v in s)
    folder.mkdir(parents=True, exist_ok=True)
    if as_zip:
        path = folder / "UCI HAR Dataset.zip"
        path.write_bytes(zip_bytes(members))
    else:
        for name, text in members.items():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(text)
        path = folder / "UCI HAR Dataset"
    return HarFiles({k: v[0] for k, v in arrays.items()}, {k: v[1] for k, v in arrays.items()},
                    {k: v[2] for k, v in arrays.items()}, path)


def zip_bytes(members: dict) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            z.writestr(name, data if isinstance(data, bytes) else data.encode())
    return buf.getvalue()


def tar_gz_bytes(members: dict) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in members.items():
            data = data if isinstance(data, bytes) else data.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


# --------------------------------------------------------------------------------- ACS PUMS persons

PUMS_HEADER = ("RT", "SERIALNO", "DIVISION", "SPORDER", "PUMA", "REGION", "ST", "ADJINC", "PWGTP", "AGEP",
               "CIT", "COW", "MAR", "SCHL", "SEX", "WKHP", "RELP", "OCCP", "POBP", "RAC1P", "PINCP")


def pums_rows(state_fips: int, n: int, year: int = 2018, seed: int = 0) -> list[dict]:
    """`n` person records of one state in PUMS columns: blanks where the survey leaves them (COW, WKHP,
    OCCP, PINCP of children), incomes around the $50k threshold that depend on SCHL and WKHP."""
    rng = np.random.default_rng([seed, state_fips])
    rows = []
    for i in range(n):
        age = int(rng.integers(5, 80))
        child = age < 16
        schl = int(rng.integers(1, 25))
        hours = "" if child or rng.random() < 0.2 else int(rng.integers(1, 80))
        inc = "" if child else int(rng.integers(-5000, 30000) + schl * 2500 + (hours or 0) * 600
                                   + state_fips * 100)
        rows.append({"RT": "P", "SERIALNO": f"{year}{'GQ' if i % 7 == 0 else 'HU'}{i:07d}", "DIVISION": 9,
                     "SPORDER": 1 + i % 3, "PUMA": f"{(i % 5) + 100:05d}", "REGION": 4, "ST": f"{state_fips:02d}",
                     "ADJINC": 1013097, "PWGTP": int(rng.integers(0, 200)), "AGEP": age, "CIT": 1,
                     "COW": "" if child else int(rng.integers(1, 9)), "MAR": int(rng.integers(1, 6)),
                     "SCHL": schl, "SEX": int(rng.integers(1, 3)), "WKHP": hours, "RELP": int(rng.integers(0, 18)),
                     "OCCP": "" if child else f"{int(rng.integers(10, 9920)):04d}", "POBP": int(rng.integers(1, 60)),
                     "RAC1P": int(rng.integers(1, 10)), "PINCP": inc})
    return rows


def pums_csv(rows: list[dict]) -> str:
    return ",".join(PUMS_HEADER) + "\n" + "".join(
        ",".join(str(r[c]) for c in PUMS_HEADER) + "\n" for r in rows)


def write_pums(folder: Path, states: dict, year: int = 2018, layout: str = "flat", seed: int = 0) -> dict:
    """`csv_p<st>.zip` per state (postal code -> number of persons), holding `psam_p<FIPS>.csv`, flat in
    `folder` or in `folder/<year>/1-Year/` (layout="folktables"). Returns postal code -> rows."""
    from fedprism.data.sets.acsincome import FIPS

    out = {}
    d = folder if layout == "flat" else folder / str(year) / "1-Year"
    d.mkdir(parents=True, exist_ok=True)
    for st, n in states.items():
        rows = pums_rows(FIPS[st], n, year, seed)
        (d / f"csv_p{st.lower()}.zip").write_bytes(zip_bytes({f"psam_p{FIPS[st]:02d}.csv": pums_csv(rows),
                                                              "ACS2018_PUMS_README.pdf": b"%PDF-1.4"}))
        out[st] = rows
    return out


def acsincome_expected(rows: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """folktables' ACSIncome of the rows, computed by hand: the filter, -1 for blanks, PINCP > 50000."""
    feats = ("AGEP", "COW", "SCHL", "MAR", "OCCP", "POBP", "RELP", "WKHP", "SEX", "RAC1P")
    num = lambda v: float(v) if v != "" else float("nan")  # noqa: E731
    x, y = [], []
    for r in rows:
        if num(r["AGEP"]) > 16 and num(r["PINCP"]) > 100 and num(r["WKHP"]) > 0 and num(r["PWGTP"]) >= 1:
            x.append([-1.0 if r[f] == "" else float(r[f]) for f in feats])
            y.append(int(float(r["PINCP"]) > 50000))
    return np.array(x, np.float64).reshape(-1, len(feats)), np.array(y, np.int64)
