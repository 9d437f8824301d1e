"""LeNet-5 (`lenet5`), the network of the FedPrism paper's experiments (section 4.3)."""

from __future__ import annotations

from torch import nn

from fedprism.models.base import MODELS, ModelSpec, Split


class LeNet5(Split):
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


def refuse_unless_32x32(name: str, hint: str = ""):
    """`ModelSpec.refuse` for a model of [C, 32, 32] inputs (its fully connected layers are sized for them)."""
    def refuse(shape: tuple[int, ...]) -> str | None:
        if len(shape) != 3 or shape[1:] != (32, 32):
            return f"{name} needs [C, 32, 32] inputs, data has {list(shape)}{hint}"
        return None
    return refuse


PAD_HINT = " (set data.pad32=true for 28x28 images)"

SPEC = MODELS.register(ModelSpec(
    "lenet5", lambda shape, k: LeNet5(shape[0], k),
    title="LeNet-5 (FedPrism paper, section 4.3), ReLU and max-pooling",
    inputs="[C, 32, 32] images (28x28 ones padded: data.pad32=auto)",
    refuse=refuse_unless_32x32("lenet5", PAD_HINT), pad32=True,
    body="conv(6, 5x5)-pool-conv(16, 5x5)-pool-fc120-fc84", head="fc(classes)", shape=(1, 32, 32)))
