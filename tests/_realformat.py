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
                     "COW": "" if child or i % 11 == 5 else int(rng.integers(1, 9)),   # some adults' blank
                     "MAR": int(rng.integers(1, 6)),
                     "SCHL": schl, "SEX": int(rng.integers(1, 3)), "WKHP": hours, "RELP": int(rng.integers(0, 18)),
                     "OCCP": "" if child else f"{int(rng.integers(10, 9920)):04d}", "POBP": int(rng.integers(1, 60)),
                     "RAC1P": int(rng.integers(1, 10)), "PINCP": inc})
    return rows


def pums_csv(rows: list[dict], year: int = 2018) -> str:
    """The CSV text; from 2019 the Census Bureau's header names RELP `RELSHIPP`."""
    header = [("RELSHIPP" if c == "RELP" and year >= 2019 else c) for c in PUMS_HEADER]
    return ",".join(header) + "\n" + "".join(",".join(str(r[c]) for c in PUMS_HEADER) + "\n" for r in rows)


def write_pums(folder: Path, states: dict, year: int = 2018, layout: str = "flat", seed: int = 0) -> dict:
    """`csv_p<st>.zip` per state (postal code -> number of persons), holding `psam_p<FIPS>.csv`, flat in
    `folder` or in `folder/<year>/1-Year/` (layout="folktables"). Returns postal code -> rows."""
    from fedprism.data.sets.acsincome import FIPS

    out = {}
    d = folder if layout == "flat" else folder / str(year) / "1-Year"
    d.mkdir(parents=True, exist_ok=True)
    for st, n in states.items():
        rows = pums_rows(FIPS[st], n, year, seed)
        (d / f"csv_p{st.lower()}.zip").write_bytes(zip_bytes({f"psam_p{FIPS[st]:02d}.csv": pums_csv(rows, year),
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


# ------------------------------------------------------------------------- MNIST-M, SynthDigits, Office


def png_bytes(rgb: np.ndarray, fmt: str = "PNG") -> bytes:
    """[3, H, W] uint8 -> encoded image bytes (lossless PNG by default)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(rgb.transpose(1, 2, 0))).save(buf, format=fmt)
    return buf.getvalue()


@dataclass
class ImageFiles:
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    path: Path


def write_mnistm(folder: Path, n_train: int = 20, n_test: int = 10, seed: int = 0, as_tar: bool = True) -> ImageFiles:
    """`mnist_m.tar.gz` as the authors release it: mnist_m/mnist_m_{train,test}/<8 digits>.png (28x28 RGB)
    and mnist_m/mnist_m_{train,test}_labels.txt, '<file> <digit>' per line (or the extracted folder)."""
    rng = np.random.default_rng(seed)
    members, out = {}, []
    for split, n in (("train", n_train), ("test", n_test)):
        x = rng.integers(0, 256, (n, 3, 28, 28), dtype=np.uint8)
        y = np.arange(n) % 10
        lines = []
        for i in range(n):
            members[f"mnist_m/mnist_m_{split}/{i:08d}.png"] = png_bytes(x[i])
            lines.append(f"{i:08d}.png {y[i]}\n")
        members[f"mnist_m/mnist_m_{split}_labels.txt"] = "".join(lines)
        out += [x, y]
    folder.mkdir(parents=True, exist_ok=True)
    if as_tar:
        path = folder / "mnist_m.tar.gz"
        path.write_bytes(tar_gz_bytes(members))
    else:
        for name, data in members.items():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_bytes(data if isinstance(data, bytes) else data.encode())
        path = folder / "mnist_m"
    return ImageFiles(*out, path)


def mat_bytes(x: np.ndarray, y: np.ndarray) -> bytes:
    """SVHN's .mat layout: X uint8 [32, 32, 3, N], y [N, 1]."""
    from scipy.io import savemat

    buf = io.BytesIO()
    savemat(buf, {"X": np.ascontiguousarray(x.transpose(2, 3, 1, 0)), "y": y.astype(np.uint8)[:, None]})
    return buf.getvalue()


def write_synthdigits(folder: Path, n_train: int = 20, n_test: int = 10, seed: int = 0, as_zip: bool = True
                      ) -> ImageFiles:
    """`SynthDigits.zip` with synth_train_32x32.mat / synth_test_32x32.mat (or the two files)."""
    rng = np.random.default_rng(seed)
    members, out = {}, []
    for split, n in (("train", n_train), ("test", n_test)):
        x = rng.integers(0, 256, (n, 3, 32, 32), dtype=np.uint8)
        y = np.arange(n) % 10
        members[f"synth_{split}_32x32.mat"] = mat_bytes(x, y)
        out += [x, y]
    folder.mkdir(parents=True, exist_ok=True)
    if as_zip:
        path = folder / "SynthDigits.zip"
        path.write_bytes(zip_bytes(members))
    else:
        for name, data in members.items():
            (folder / name).write_bytes(data)
        path = folder
    return ImageFiles(*out, path)


def write_digit_domains(root: Path, n_train: int = 30, n_test: int = 12, seed: int = 0) -> dict:
    """`root/<domain>` for the five Digits domains, each in its real format; domain -> written arrays."""
    from _fakedata import write_fake

    return {"mnist": write_fake("mnist", root / "mnist", n_train, n_test, seed),
            "mnistm": write_mnistm(root / "mnistm", n_train, n_test, seed),
            "svhn": write_fake("svhn", root / "svhn", n_train, n_test, seed),
            "usps": write_fake("usps", root / "usps", n_train, n_test, seed),
            "synthdigits": write_synthdigits(root / "synthdigits", n_train, n_test, seed)}


OFFICE_SITES = ("amazon", "caltech", "dslr", "webcam")
OFFICE_CLASSES = ("back_pack", "bike", "calculator", "headphones", "keyboard", "laptop_computer", "monitor",
                  "mouse", "mug", "projector")


def write_office(folder: Path, per_class: int = 3, seed: int = 0, as_zip: bool = True, side: int = 20) -> dict:
    """FedBN's `office_caltech_10_dataset.zip`: office_caltech_10/<site>/<class>/<n>.jpg (JPEG photos of
    varied sizes, some greyscale as in Caltech-256) plus FedBN's split pickles, which are not read. Returns
    (site, class, file) -> the RGB array written (before JPEG)."""
    rng = np.random.default_rng(seed)
    members, written = {}, {}
    for s, site in enumerate(OFFICE_SITES):
        for c, cls in enumerate(OFFICE_CLASSES):
            for i in range(per_class):
                h, w = side + int(rng.integers(0, 8)), side + int(rng.integers(0, 8))
                img = np.full((3, h, w), 40 * s + 15 * c, np.uint8)
                img[:, : h // 2] += np.uint8(10 * i)
                if site == "caltech" and i == 0:
                    img[1] = img[2] = img[0]                     # a greyscale photo
                members[f"office_caltech_10/{site}/{cls}/frame_{i:04d}.jpg"] = png_bytes(img, "JPEG")
                written[(site, cls, f"frame_{i:04d}.jpg")] = img
        members[f"office_caltech_10/{site}_train.pkl"] = b"\x80\x04N."    # FedBN's lists: never unpickled
    folder.mkdir(parents=True, exist_ok=True)
    if as_zip:
        (folder / "office_caltech_10_dataset.zip").write_bytes(zip_bytes(members))
    else:
        for name, data in members.items():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_bytes(data)
    return written
