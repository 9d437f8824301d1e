"""The FMNIST CNN of Clust-PSI-PFL (`clustpsi_fmnist_cnn`; Jimenez-Gutierrez et al. 2025,
arXiv:2512.20363)."""

from __future__ import annotations

from torch import nn

from fedprism.models.base import MODELS, ModelSpec, Split


class PsiFmnistCNN(Split):
    """The FMNIST CNN of Clust-PSI-PFL (Jimenez-Gutierrez et al. 2025, arXiv:2512.20363, section IV-A):
    "three convolutional stages with 8, 16, and 32 feature maps ... followed by max-pooling and a dense
    layer with 2048 ReLU units before the final classifier" (`clustpsi_fmnist_cnn`).

    Where the paper is silent: 3x3 kernels with no padding (the paper names "same" padding for its CIFAR
    network only), ReLU after each convolution, one 2x2 max-pooling after the stack (as written), inputs
    at their own size (28x28 FMNIST: 22x22x32 -> 11x11x32 -> 2048; about 8 M parameters).
    """

    def __init__(self, in_channels: int, size: tuple[int, int], num_classes: int = 10):
        super().__init__()
        h, w = size[0] - 6, size[1] - 6
        self.body = nn.Sequential(
            nn.Conv2d(in_channels, 8, 3), nn.ReLU(), nn.Conv2d(8, 16, 3), nn.ReLU(),
            nn.Conv2d(16, 32, 3), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(32 * (h // 2) * (w // 2), 2048), nn.ReLU(),
        )
        self.head = nn.Sequential(nn.Linear(2048, num_classes))


def _refuse(shape: tuple[int, ...]) -> str | None:
    if len(shape) != 3 or min(shape[1:]) < 8:
        return f"clustpsi_fmnist_cnn needs [C, H, W] images of at least 8x8, data has {list(shape)}"
    return None


SPEC = MODELS.register(ModelSpec(
    "clustpsi_fmnist_cnn", lambda shape, k: PsiFmnistCNN(shape[0], tuple(shape[1:]), k),
    title="the FMNIST CNN of Clust-PSI-PFL (Jimenez-Gutierrez et al. 2025, arXiv:2512.20363, IV-A)",
    inputs="[C, H, W] images of at least 8x8, at their own size", refuse=_refuse,
    body="conv(8, 3x3)-conv(16, 3x3)-conv(32, 3x3)-pool-fc2048", head="fc(classes)", shape=(1, 28, 28)))
