"""SynthDigits (SynNumbers; Ganin, Ustinova, Ajakan, Germain, Larochelle, Laviolette, Marchand, Lempitsky
2016, "Domain-Adversarial Training of Neural Networks", arXiv:1505.07818): 32x32 RGB digits rendered from
Windows fonts with varied position, orientation, background and stroke colour and blur, 479 400 train /
9 553 test; one of the Digits domains of FedBN (Li et al. 2021, arXiv:2102.07623).

The copy read is the authors' ``SynthDigits.zip``, holding ``synth_train_32x32.mat`` and
``synth_test_32x32.mat`` in SVHN's format (``X`` uint8 [32, 32, 3, N], ``y`` [N, 1]; a label 10, if any, is
the digit 0 as in SVHN), or those two files extracted. The members are read from the zip in memory (each
at most ``MAX_MEMBER_BYTES``; nothing is extracted). No checksum is published: the download is trusted on
first use (docs/datasets.md). The normalisation is FedBN's for every digit domain, (x - 0.5) / 0.5.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from fedprism.data.base import DATASETS, DatasetSpec, FileSet
from fedprism.data.cache import Raw
from fedprism.data.download import RemoteFile
from fedprism.data.files import load_images
from fedprism.data.formats import DIGIT_CLASSES, read_svhn_mat
from fedprism.data.grouped import read_zip_member
from fedprism.errors import DataError

ARCHIVE = "SynthDigits.zip"
FILES = {"train": "synth_train_32x32.mat", "test": "synth_test_32x32.mat"}
MAX_MEMBER_BYTES = 4 << 30
"""Largest member read (the real synth_train_32x32.mat is about 1.5 GiB)."""


def read_mat_bytes(data: bytes, where: str) -> tuple[np.ndarray, np.ndarray]:
    """`read_svhn_mat` of a .mat file's bytes: uint8 [N, 3, 32, 32] images and labels 0..9."""
    if not data.startswith(b"MATLAB"):
        raise DataError(f"{where}: not a MATLAB file (an error page saved in its place?); delete it and "
                        "download it again")
    import scipy.io

    try:
        mat = scipy.io.loadmat(io.BytesIO(data), variable_names=["X", "y"])
    except Exception as e:  # scipy raises ValueError, TypeError, OSError, ... on bad files
        raise DataError(f"{where}: cannot read MATLAB file ({type(e).__name__}: {e}); it is truncated or "
                        "corrupt, download it again") from e
    x, y = mat.get("X"), mat.get("y")
    if x is None or y is None:
        raise DataError(f"{where}: no 'X' and 'y' variables; not a SynthDigits file")
    if x.dtype != np.uint8 or x.ndim != 4 or x.shape[:3] != (32, 32, 3):
        raise DataError(f"{where}: 'X' is {x.dtype} {x.shape}, expected uint8 [32, 32, 3, N]")
    y = np.asarray(y).reshape(-1).astype(np.int64)
    if len(y) != x.shape[3]:
        raise DataError(f"{where}: {len(y)} labels for {x.shape[3]} images")
    y[y == 10] = 0  # as in SVHN's files, should a 10 stand for the digit 0
    return np.ascontiguousarray(x.transpose(3, 2, 0, 1)), y


def find(d: Path) -> dict[str, Path] | str:
    if (d / ARCHIVE).is_file():
        return {"archive": d / ARCHIVE}
    missing = [f for f in FILES.values() if not (d / f).is_file()]
    if len(missing) == len(FILES):
        return f"no {ARCHIVE} and no synth_*_32x32.mat"
    if missing:
        return f"incomplete: missing {', '.join(missing)}"
    return {k: d / f for k, f in FILES.items()}


def decode(files: dict[str, Path], scratch: Path) -> Raw:
    out = []
    for split, member in FILES.items():
        if "archive" in files:
            data = read_zip_member(files["archive"], member, MAX_MEMBER_BYTES)
            out += read_mat_bytes(data, f"{files['archive']}:{member}")
        else:
            out += read_svhn_mat(files[split])
    return Raw(*out, list(DIGIT_CLASSES))


def load(pad32: bool = False, root: str | Path | None = None, *, download: bool = False,
         cache_dir: str | Path | None | bool = None):
    return load_images(SPEC, decode, pad32, root, download, cache_dir)


SPEC = DATASETS.register(DatasetSpec(
    name="synthdigits",
    load=load,
    summary="SynthDigits: 32x32 RGB rendered digits, 479 400 train / 9 553 test (Ganin et al. 2016, "
            "arXiv:1505.07818)",
    class_names=DIGIT_CLASSES,
    input_shape=(3, 32, 32),
    mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5),
    files=FileSet(
        find=find,
        needed=f"{ARCHIVE}, or synth_train_32x32.mat and synth_test_32x32.mat",
        # no checksum is published: trust on first use (fedprism.data.download)
        remote=(RemoteFile(ARCHIVE, ("https://drive.usercontent.google.com/download"
                                     "?id=0B9Z4d7lAwbnTSVR1dEFSRUFxOUU"
                                     "&export=download&confirm=t",), tofu=True),),
    ),
))
