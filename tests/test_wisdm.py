"""WISDM raw-file parsing and 1-second windows on a small generated file in the real format."""

from __future__ import annotations

import numpy as np

from fedprism.data.wisdm import ACTIVITIES, load_raw, parse_raw


def fixture_text() -> str:
    rows = []
    for i in range(45):                                    # user 33 walking: 2 full windows + 5 readings
        rows.append(f"33,Walking,{49105962326000 + i},{i % 20}.0,1.5,-2.0;")
    for i in range(20):                                    # user 7 sitting: 1 window
        rows.append(f"7,Sitting,{1000 + i},0.5,9.8,{i}.0;")
    text = "\n".join(rows)
    return text + "\n\n33,Jogging,1,2.0,;\n8,Flying,1,1,1,1;\n"   # truncated record, unknown activity


def test_parse_and_windows(tmp_path):
    users, labels, xyz, skipped = parse_raw(fixture_text())
    assert len(users) == 65 and skipped == 2
    p = tmp_path / "WISDM_ar_v1.1_raw.txt"
    p.write_text(fixture_text())
    x, y, u = load_raw(p)
    assert x.shape == (3, 3)
    assert list(y) == [ACTIVITIES.index("Walking")] * 2 + [ACTIVITIES.index("Sitting")]
    assert list(u) == [33, 33, 7]
    assert np.allclose(x[0], [9.5, 1.5, -2.0]) and np.allclose(x[2], [0.5, 9.8, 9.5])
