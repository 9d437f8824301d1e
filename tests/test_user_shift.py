"""`user_shift`: per-user feature shift with shared class meanings (the FedSub substitute): the warp by
hand (whole-pixel moves, a quarter turn), each client's fixed transform from its stream, the labels split as
`dirichlet` splits them, the global test set untouched, the local test rows in the client's style."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedprism.data.partitions.user_shift import SHIFT_STREAM, user_transform, warp
from fedprism.errors import ConfigError
from fedprism.experiment.config import resolve
from fedprism.experiment.federation import build_federation, clear_federations

PARAMS = {"partition.max_rotation": 20.0, "partition.max_shift": 2.0, "partition.contrast": 0.3,
          "partition.brightness": 0.3, "partition.noise": 0.2, "partition.alpha": 0.5}


def test_warp_by_hand():
    x = torch.arange(2 * 1 * 5 * 5, dtype=torch.float32).view(2, 1, 5, 5)
    right = warp(x, 0.0, 1.0, 0.0)                       # one pixel right; the left border column repeated
    assert torch.equal(right[..., 1:], x[..., :-1]) and torch.equal(right[..., 0], x[..., 0])
    down = warp(x, 0.0, 0.0, 2.0)
    assert torch.equal(down[..., 2:, :], x[..., :-2, :]) and torch.equal(down[..., 0, :], x[..., 0, :])
    assert torch.allclose(warp(x, 90.0, 0.0, 0.0), torch.rot90(x, -1, (2, 3)), atol=1e-4)
    assert torch.allclose(warp(x, -90.0, 0.0, 0.0), torch.rot90(x, 1, (2, 3)), atol=1e-4)
    turned = torch.rot90(x, -1, (2, 3))                  # rotate first, then move (out(p) = in(R^-1 (p - t)))
    assert torch.allclose(warp(x, 90.0, 1.0, 0.0)[..., 1:], turned[..., :-1], atol=1e-4)
    assert torch.allclose(warp(x, 90.0, 0.0, 1.0)[..., 1:, :], turned[..., :-1, :], atol=1e-4)
    assert warp(x, 0.0, 0.0, 0.0) is x


def test_each_client_has_its_own_fixed_transform_from_its_stream():
    p = {k.split(".")[1]: v for k, v in PARAMS.items()}
    t = user_transform(3, 7, p)
    g = np.random.default_rng([7, SHIFT_STREAM, 3])
    want = (g.uniform(-20, 20), *g.uniform(-2, 2, size=2), g.uniform(0.7, 1.3), g.uniform(-0.3, 0.3),
            g.uniform(0, 0.2))
    assert t == pytest.approx(want, abs=0) and user_transform(3, 7, p) == t
    assert user_transform(4, 7, p) != t and user_transform(3, 8, p) != t


def _feds(seed=2):
    clear_federations()
    base = {"dataset": "digits", "clients": 4, "model": "mlp", "seed": seed}
    fed = build_federation(resolve({**base, "partition": "user_shift", **PARAMS}))
    clear_federations()
    plain = build_federation(resolve({**base, "partition": "dirichlet", "partition.alpha": 0.5}))
    return fed, plain


def test_federation_shifts_each_clients_rows_and_keeps_labels_and_the_global_test_set():
    seed = 2
    fed, plain = _feds(seed)
    p = {k.split(".")[1]: v for k, v in PARAMS.items()}
    assert [t.tolist() for t in fed.train_idx] == [t.tolist() for t in plain.train_idx]   # dirichlet's labels
    assert torch.equal(fed.x_test, plain.x_test) and torch.equal(fed.y_train[:len(plain.y_train)], plain.y_train)
    x_local, y_local = fed.local_xy()
    for c in range(4):
        angle, dx, dy, a, b, s = user_transform(c, seed, p)
        rows = torch.as_tensor(fed.train_idx[c])
        x = plain.x_train[rows]
        noise = torch.from_numpy(np.random.default_rng([seed, SHIFT_STREAM, c, 1]).standard_normal(
            tuple(x.shape), dtype=np.float32))
        want = warp(x, angle, dx, dy) * np.float32(a) + np.float32(b) + noise * np.float32(s)
        assert torch.allclose(fed.x_train[rows], want, atol=1e-5)
        assert not torch.allclose(fed.x_train[rows], x, atol=1e-2)
        # the local test rows: the client's own test rows in its style (noise from its test stream)
        trows = torch.as_tensor(fed.test_idx[c])
        base = plain.x_test[torch.as_tensor(plain.test_idx[c])]
        tnoise = torch.from_numpy(np.random.default_rng([seed, SHIFT_STREAM, c, 2]).standard_normal(
            tuple(base.shape), dtype=np.float32))
        assert torch.allclose(x_local[trows], warp(base, angle, dx, dy) * np.float32(a) + np.float32(b)
                              + tnoise * np.float32(s), atol=1e-5)
        assert torch.equal(y_local[trows], plain.y_test[torch.as_tensor(plain.test_idx[c])])


def test_keys_are_validated_and_tabular_data_is_refused():
    with pytest.raises(ConfigError, match=r"partition\.contrast"):
        resolve({"dataset": "digits", "partition": "user_shift", "partition.contrast": 1.0})
    with pytest.raises(ConfigError, match=r"partition\.max_rotation"):
        resolve({"dataset": "digits", "partition": "user_shift", "partition.max_rotation": 200.0})
    clear_federations()
    with pytest.raises(ConfigError, match="images"):
        build_federation(resolve({"dataset": "synthetic", "clients": 4, "model": "mlp", "partition": "user_shift"}))


@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_fedsub_shift_sweeps_state_what_is_not_the_papers_and_run_quick(kind, tmp_path):
    from pathlib import Path

    from fedprism.experiment.store import Store
    from fedprism.experiment.sweep import load_sweep, run_sweep

    root = Path(__file__).resolve().parents[1] / "sweeps"
    path = root / f"fedsub_fmnist_shift_{kind}.toml"
    _, cfgs = load_sweep(path)
    assert {c["partition"] for c in cfgs} == {"user_shift"} and {c["dataset"] for c in cfgs} == {"fmnist"}
    assert {c["model"] for c in cfgs} == {"mlp_fedsub"} and len(cfgs) == 13
    assert all(c["drift.fraction"] == (0.6 if kind == "dynamic" else 0.0) for c in cfgs)
    for name in (f"fedsub_fmnist_shift_{kind}", f"fedsub_{kind}"):
        header = (root / f"{name}.toml").read_text().split("\nname =")[0]
        assert "Not the paper's" in header and "lr 0.01, momentum 0.9 and batch 32" in header
        assert "Everything else follows the paper" not in header
    db = tmp_path / "q.db"
    assert run_sweep(str(path), str(db), only="FedSub naive Overlap", quick=True, progress=False) == 0
    with Store(db) as st:
        assert [r["status"] for r in st.runs()] == ["finished"]
