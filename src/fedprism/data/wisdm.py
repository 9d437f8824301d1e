"""WISDM's raw-format reader, windows and per-user split: kept importable here; the dataset, with these
functions, lives in :mod:`fedprism.data.sets.wisdm`."""

from fedprism.data.sets.wisdm import (ACTIVITIES, ARCHIVE, MAX_RAW_BYTES, MEMBER, RATE_HZ, RAW_FILE,  # noqa: F401
                                      load_raw, parse_raw, read_archive, split_by_user, windows)
