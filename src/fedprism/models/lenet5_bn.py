"""LeNet-5 with BatchNorm (`lenet5_bn`), the layout of FedBN's digits model."""

from __future__ import annotations

from torch import nn

from fedprism.models.base import BATCH_STATS, MODELS, BatchNorm1d, ModelSpec, Split
from fedprism.models.lenet5 import PAD_HINT, refuse_unless_32x32


class LeNet5BN(Split):
    """LeNet-5 with BatchNorm after each convolution and each hidden linear layer of the body (the layout of
    FedBN's digits model, Li et al. 2021, arXiv:2102.07623: conv-BN-ReLU-pool, fc-BN-ReLU); the head is
    LeNet-5's classifier. With the same seed its conv and linear layers start as `LeNet5`'s (BatchNorm
    starts at weight 1, bias 0 and draws no random numbers). BatchNorm on batch statistics
    (`fedprism.params`, docs/architecture.md)."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, 6, 5), nn.BatchNorm2d(6, **BATCH_STATS), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5), nn.BatchNorm2d(16, **BATCH_STATS), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(16 * 5 * 5, 120), BatchNorm1d(120), nn.ReLU(),
            nn.Linear(120, 84), BatchNorm1d(84), nn.ReLU(),
        )
        self.head = nn.Sequential(nn.Linear(84, num_classes))


SPEC = MODELS.register(ModelSpec(
    "lenet5_bn", lambda shape, k: LeNet5BN(shape[0], k),
    title="LeNet-5 with BatchNorm after each conv and hidden fc (FedBN's digits layout, arXiv:2102.07623)",
    inputs="[C, 32, 32] images (28x28 ones padded: data.pad32=auto)",
    refuse=refuse_unless_32x32("lenet5_bn", PAD_HINT), pad32=True,
    body="conv(6, 5x5)-BN-pool-conv(16, 5x5)-BN-pool-fc120-BN-fc84-BN", head="fc(classes)", shape=(1, 32, 32)))
