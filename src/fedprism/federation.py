"""A federation in memory: the data, each client's train and test indices, and its label histogram.

Built once per experiment (`fedprism.experiment.build_federation`) and shared by every method, so all
methods see the same partition. Client test indices point into the global test set: each client's
local test split follows its train label distribution (FedPrism paper 4.2).

Local test rows from the clients' own data (optional, `data.local_test = "split"`): each client's rows
are split into train and test (`fedprism.data.partition.local_holdout`) and `test_idx` then points into
the training pool (`local_pool = "train"`); the global test set is unchanged.

Validation (optional, `data.val_fraction` / `data.global_val`): each client's own validation rows are
held out of its training rows (`val_idx`, same label mix as its train split), and a global validation
set (`x_val`, `y_val`) is carved from the training pool before partitioning. Hyper-parameters are chosen
on these, never on the test splits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class Federation:
    x_train: torch.Tensor              # [N_train, ...] float32, normalised; int64 [N_train, seq_len] tokens
    y_train: torch.Tensor              # [N_train] int64
    x_test: torch.Tensor               # [N_test, ...] the global (IID) test set
    y_test: torch.Tensor
    train_idx: list[np.ndarray]        # per client, indices into x_train
    test_idx: list[np.ndarray]         # per client, indices into x_test (into x_train: local_pool "train")
    num_classes: int
    class_names: list[str] = field(default_factory=list)
    name: str = ""
    meta: dict = field(default_factory=dict)
    #: per client, indices into x_train held out of training for validation (empty: no validation split)
    val_idx: list[np.ndarray] | None = None
    #: a global validation set carved from the training pool before partitioning (None: none)
    x_val: torch.Tensor | None = None
    y_val: torch.Tensor | None = None
    #: the pool `test_idx` indexes: "test" (x_test, the default) or "train" (x_train: each client's own
    #: held-out rows, `data.local_test = "split"`)
    local_pool: str = "test"
    #: token data: the number of token ids (inputs are int64 ids, `fedprism.data.base.Dataset.vocab_size`);
    #: 0 for float inputs
    vocab_size: int = 0

    def __post_init__(self) -> None:
        if len(self.train_idx) != len(self.test_idx):
            raise ValueError("train_idx and test_idx must list the same clients")
        if self.local_pool not in ("test", "train"):
            raise ValueError(f"local_pool must be 'test' or 'train', got {self.local_pool!r}")
        if self.val_idx is not None and len(self.val_idx) != len(self.train_idx):
            raise ValueError("val_idx must list the same clients as train_idx")

    @property
    def has_val(self) -> bool:
        return self.val_idx is not None

    @property
    def has_global_val(self) -> bool:
        return self.x_val is not None

    @property
    def num_clients(self) -> int:
        return len(self.train_idx)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])

    @property
    def n_train(self) -> np.ndarray:
        return np.array([len(i) for i in self.train_idx], dtype=np.int64)

    @property
    def n_test(self) -> np.ndarray:
        return np.array([len(i) for i in self.test_idx], dtype=np.int64)

    def local_xy(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) of the pool the clients' local test rows `test_idx` index."""
        return (self.x_train, self.y_train) if self.local_pool == "train" else (self.x_test, self.y_test)

    def label_hist(self, split: str = "train") -> np.ndarray:
        """[clients, classes] label counts (the input of PSI, histogram clustering, FedSub)."""
        y = (self.y_train if split == "train" else self.local_xy()[1]).cpu().numpy()
        idx = self.train_idx if split == "train" else self.test_idx
        return np.stack([np.bincount(y[i], minlength=self.num_classes) for i in idx]).astype(np.int64)

    def to(self, device: torch.device | str) -> "Federation":
        for k in ("x_train", "y_train", "x_test", "y_test", "x_val", "y_val"):
            if getattr(self, k) is not None:
                setattr(self, k, getattr(self, k).to(device))
        return self
