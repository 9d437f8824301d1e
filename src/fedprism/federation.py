"""A federation in memory: the data, each client's train and test indices, and its label histogram.

Built once per experiment (`fedprism.experiment.build_federation`) and shared by every method, so all
methods see the same partition. Client test indices point into the global test set: each client's
local test split follows its train label distribution (FedPrism paper 4.2).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class Federation:
    x_train: torch.Tensor              # [N_train, ...] float32, normalised
    y_train: torch.Tensor              # [N_train] int64
    x_test: torch.Tensor               # [N_test, ...] the global (IID) test set
    y_test: torch.Tensor
    train_idx: list[np.ndarray]        # per client, indices into x_train
    test_idx: list[np.ndarray]         # per client, indices into x_test
    num_classes: int
    class_names: list[str] = field(default_factory=list)
    name: str = ""
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.train_idx) != len(self.test_idx):
            raise ValueError("train_idx and test_idx must list the same clients")

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

    def label_hist(self, split: str = "train") -> np.ndarray:
        """[clients, classes] label counts (the input of PSI, histogram clustering, FedSub)."""
        y = (self.y_train if split == "train" else self.y_test).numpy()
        idx = self.train_idx if split == "train" else self.test_idx
        return np.stack([np.bincount(y[i], minlength=self.num_classes) for i in idx]).astype(np.int64)

    def to(self, device: torch.device | str) -> "Federation":
        for k in ("x_train", "y_train", "x_test", "y_test"):
            setattr(self, k, getattr(self, k).to(device))
        return self
