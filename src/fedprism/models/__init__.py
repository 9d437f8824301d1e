"""Small networks with a body/head split (FedPrism paper 4.3; Clust-PSI-PFL CIFAR CNN).

Every model is `head(body(x))`: `body` ends with the penultimate features, `head` holds the
classifier. Prototype and head-only methods use `ParamSpec.head` / `.body` slices, never layer names.
`forward(x, features_only=True)` returns the body output.
"""

from __future__ import annotations

import torch
from torch import nn

from fedprism.errors import ConfigError


class _Split(nn.Module):
    body: nn.Module
    head: nn.Module

    def forward(self, x: torch.Tensor, features_only: bool = False) -> torch.Tensor:
        z = self.body(x)
        return z if features_only else self.head(z)


class LeNet5(_Split):
    """LeNet-5 as in the FedPrism paper 4.3: conv(6,5x5)-pool-conv(16,5x5)-pool-fc120-fc84-fc(classes).

    Inputs are 32x32 with 1 (FMNIST padded from 28x28) or 3 channels. ReLU and max-pooling, the
    common modern reading of the paper's "LeNet-5".
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, 6, 5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(16 * 5 * 5, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(),
        )
        self.head = nn.Sequential(nn.Linear(84, num_classes))


class MLP(_Split):
    """Two-hidden-layer perceptron for tabular and 8x8 digits data (inputs flattened)."""

    def __init__(self, in_features: int, num_classes: int, hidden: int = 64):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU(),
                                  nn.Linear(hidden, hidden), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(hidden, num_classes))


class CifarCNN(_Split):
    """The Clust-PSI-PFL CIFAR CNN (Clust-PSI-PFL): two conv(3x3)-BN-ReLU-pool blocks, fc256, fc(classes).

    BatchNorm uses batch statistics only (`track_running_stats=False`): no buffers, so the flat vector
    holds everything that is averaged (see `fedprism.params`).
    """

    def __init__(self, in_channels: int = 3, num_classes: int = 10):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, 32, 3, padding=1), nn.BatchNorm2d(32, track_running_stats=False),
            nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64, track_running_stats=False),
            nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(64 * 8 * 8, 256), nn.ReLU(),
        )
        self.head = nn.Sequential(nn.Linear(256, num_classes))


MODELS = ("lenet5", "mlp", "cnn")


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int, seed: int = 0) -> nn.Module:
    """Instantiate a model with deterministic initial weights for `seed` (built-in or registered,
    `fedprism.plugins.MODELS`)."""
    from fedprism import plugins

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if name in plugins.MODELS and name not in MODELS:
            return plugins.MODELS[name](tuple(input_shape), num_classes)
        if name == "lenet5":
            if len(input_shape) != 3 or input_shape[1:] != (32, 32):
                raise ConfigError("model", name, f"lenet5 needs [C, 32, 32] inputs, data has {list(input_shape)}"
                                  " (set data.pad32=true for 28x28 images)")
            return LeNet5(input_shape[0], num_classes)
        if name == "mlp":
            feat = 1
            for d in input_shape:
                feat *= d
            return MLP(feat, num_classes)
        if name == "cnn":
            if len(input_shape) != 3 or input_shape[1:] != (32, 32):
                raise ConfigError("model", name, f"cnn needs [C, 32, 32] inputs, data has {list(input_shape)}")
            return CifarCNN(input_shape[0], num_classes)
    raise ConfigError("model", name, f"one of {', '.join(MODELS)}")
