"""A small CNN for 32x32 inputs (`cnn`); no published architecture."""

from __future__ import annotations

from torch import nn

from fedprism.models.base import MODELS, ModelSpec, Split
from fedprism.models.lenet5 import refuse_unless_32x32


class SmallCNN(Split):
    """A small CNN for 32x32 inputs (`cnn`): two conv(3x3)-BN-ReLU-pool blocks, fc256, fc(classes); no
    published architecture. It is not the CIFAR-10 network of Clust-PSI-PFL (that one is
    `clustpsi_cifar_cnn`, `PsiCifarCNN`).

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


SPEC = MODELS.register(ModelSpec(
    "cnn", lambda shape, k: SmallCNN(shape[0], k),
    title="a small CNN (no published architecture): two conv(3x3)-BN-ReLU-pool blocks, fc256",
    inputs="[C, 32, 32] images (28x28 ones padded: data.pad32=auto)", refuse=refuse_unless_32x32("cnn"),
    pad32=True, body="conv(32, 3x3)-BN-pool-conv(64, 3x3)-BN-pool-fc256", head="fc(classes)",
    shape=(3, 32, 32)))
